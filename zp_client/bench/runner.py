"""Run a storm: measure the unloaded server, build the workload, replay it through every setup.

Each setup runs against a FRESH :class:`~zp_client.sim.server.SimServer` with the same configuration
(only the gateway timeout differs: ``no-admission`` runs without one, see :mod:`.setups`), in the same
process and event loop as the load generator. ``zp-redis`` replays its sessions from worker processes
that read the virtual clock over HTTP (``GET /sim/clock``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from zp_client.bench.loadgen import HarnessMonitor, RequestRecord, VirtualClock, run_sessions
from zp_client.bench.setups import HEADROOM, SETUPS, SetupContext, open_caller, zp_limit_blocks
from zp_client.bench.tuning import ElasticTuning
from zp_client.bench.workloads import (
    ServerFacts,
    Session,
    Turn,
    Workload,
    build_workload,
    count_chat_tokens,
    make_text,
)

__all__ = ["StormConfig", "SetupRun", "measure_unloaded", "run_storm"]

log = logging.getLogger("zp_client.bench.runner")


@dataclass
class StormConfig:
    workload: str = "seed-burst"
    seed: int = 0
    setups: list[str] = field(default_factory=list)
    profile: str = "llama3-70b-fp8-8xh100"
    num_gpu_blocks: int | None = 2049
    max_model_len: int | None = None
    speedup: float = 2.0
    redis_url: str | None = None
    time_scale: float | None = None
    load_scale: float | None = None
    workers: int = 3
    workload_overrides: dict[str, Any] = field(default_factory=dict)
    elastic: ElasticTuning = field(default_factory=ElasticTuning)
    """Overrides for the elastic setups (measurements); every setup, in every worker, gets them through
    its :class:`~zp_client.bench.setups.SetupContext`."""


@dataclass
class SetupRun:
    """Raw results of one setup: client records, server stats and timeline, harness self-measurement."""

    name: str
    records: list[RequestRecord]
    server_stats: dict[str, Any]
    timeline: list[tuple[float, float, int, int, int]]
    t0: float
    harness: dict[str, Any]
    gateway_timeout_s: float | None
    limit_blocks: int | None = None
    rate_rps: float | None = None
    metrics_preemptions: float | None = None


def _sim_server(cfg: StormConfig, gateway_timeout_s: float | None) -> Any:
    from zp_client.sim.server import SimServer

    return SimServer(cfg.profile, num_gpu_blocks=cfg.num_gpu_blocks, speedup=cfg.speedup,
                     gateway_timeout_s=gateway_timeout_s, seed=cfg.seed, max_model_len=cfg.max_model_len)


async def _pool_facts(root_url: str) -> tuple[int, int, int, str]:
    """(num_gpu_blocks, block_size, max_model_len, model) as a client learns them: /metrics, /v1/models."""
    from zp_client.server import parse_metrics

    async with httpx.AsyncClient(base_url=root_url, timeout=30) as http:
        m = parse_metrics((await http.get("/metrics")).text)
        models = (await http.get("/v1/models")).json()["data"]
    if m.num_gpu_blocks is None or m.block_size is None:
        raise RuntimeError("the server's /metrics has no vllm:cache_config_info num_gpu_blocks/block_size")
    return m.num_gpu_blocks, m.block_size, int(models[0]["max_model_len"]), str(models[0]["id"])


async def measure_unloaded(cfg: StormConfig) -> tuple[ServerFacts, str]:
    """A short single-request run on a fresh server: the unloaded TTFT and inter-token latency."""
    async with _sim_server(cfg, None) as server:
        blocks, bs, mml, model = await _pool_facts(server.url)
        import random

        msgs = [{"role": "user", "content": make_text(512, random.Random(cfg.seed), "unloaded probe")}]
        turn = Turn(msgs, count_chat_tokens(msgs), 64, 64)
        clock = VirtualClock(server.clock, cfg.speedup)
        ctx = SetupContext(server.base_url, server.url, model, cfg.speedup, blocks, bs, 0,
                           elastic=cfg.elastic)
        async with open_caller("no-admission", ctx) as caller:
            recs = await run_sessions([Session("probe", 0.0, "probe", [turn])], caller, clock, t0=clock.now())
        rec = recs[0]
        if not rec.ok:
            raise RuntimeError(f"the unloaded probe request failed: {rec.error}")
        itls = sorted(rec.itls())
        itl = itls[len(itls) // 2]
        return ServerFacts(blocks, bs, mml, itl, rec.ttft or 0.0), model


async def _run_one(cfg: StormConfig, name: str, wl: Workload, model: str, rate_rps: float | None,
                   progress: Callable[[str, int], None]) -> SetupRun:
    spec = SETUPS[name]
    gateway = wl.gateway_timeout_s if spec.gateway else None
    async with _sim_server(cfg, gateway) as server:
        blocks, bs, _, _ = await _pool_facts(server.url)
        limit = zp_limit_blocks(blocks, HEADROOM)
        ctx = SetupContext(server.base_url, server.url, model, cfg.speedup, blocks, bs, limit,
                           rate_rps=rate_rps, redis_url=cfg.redis_url,
                           budget_name=f"zp-storm-{uuid.uuid4().hex[:12]}", elastic=cfg.elastic)
        clock = VirtualClock(server.clock, cfg.speedup)

        def done(rec: RequestRecord) -> None:
            progress(name, 1)

        async with HarnessMonitor() as mon:
            if spec.workers > 1:
                records, t0 = await _run_workers(cfg, name, ctx, wl.sessions, clock, done, mon)
            else:
                async with open_caller(name, ctx) as caller:
                    mon.mark()
                    t0 = clock.now()
                    records = await run_sessions(wl.sessions, caller, clock, t0=t0, on_done=done)
                    mon.stop()
        if cfg.redis_url and SETUPS[name].needs_redis:
            await _delete_budget_keys(cfg.redis_url, ctx.budget_name)
        stats = server.stats(requests=True)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            from zp_client.server import parse_metrics

            mp_total = parse_metrics((await http.get("/metrics")).text).num_preemptions_total
        return SetupRun(name, records, stats, list(server.timeline), t0, mon.summary(), gateway,
                        limit_blocks=limit if name.startswith("zp") or name == "clairvoyant" else None,
                        rate_rps=rate_rps if name == "rate-limited" else None,
                        metrics_preemptions=mp_total)


async def _delete_budget_keys(url: str, budget_name: str) -> None:
    """Remove the keys of this run's budget (its name holds a random id, so nothing else matches)."""
    import redis.asyncio as aredis
    from redis.exceptions import RedisError

    client = aredis.Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=f"*{budget_name}*", count=500)]
        if keys:
            await client.unlink(*keys)
    except (RedisError, OSError) as exc:  # cleanup must not fail a finished run
        log.warning("could not delete the storm's Redis keys for %s: %r", budget_name, exc)
    finally:
        await client.aclose()


# ------------------------------------------------------------------------------ zp-redis workers


class _HttpClock:
    """The simulator's virtual clock seen from another process: re-anchored from ``GET /sim/clock``
    every 50 ms, extrapolated at ``speedup`` in between, never running backwards."""

    def __init__(self, root_url: str, speedup: float) -> None:
        self.root_url = root_url
        self.speedup = speedup
        self._v = 0.0
        self._w = time.perf_counter()
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        self.refresh_errors = 0
        """Polls that failed (the clock extrapolates from the last good one meanwhile)."""

    async def start(self) -> None:
        self._http = httpx.AsyncClient(base_url=self.root_url, timeout=10)
        await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self._http.aclose()

    async def _refresh(self) -> None:
        r = (await self._http.get("/sim/clock")).json()
        self._v, self._w = float(r["clock_s"]), time.perf_counter()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            try:
                await self._refresh()
            except httpx.HTTPError as exc:
                self.refresh_errors += 1
                log.debug("the simulator clock poll failed (%d so far): %r", self.refresh_errors, exc)

    def now(self) -> float:
        t = self._v + (time.perf_counter() - self._w) * self.speedup
        self._last = max(self._last, t)
        return self._last


def _count_turns(sessions: list[Session]) -> int:
    return sum(1 + _count_turns(t.children) for s in sessions for t in s.turns)


def _worker_main(name: str, factory_module: str, ctx: SetupContext, sessions: list[Session], t0_value: Any,
                 start_evt: Any, out_q: Any) -> None:
    import importlib

    importlib.import_module(factory_module)  # a setup registered by another module exists here too

    async def main() -> None:
        hc = _HttpClock(ctx.root_url, ctx.speedup)
        await hc.start()
        clock = VirtualClock(hc.now, ctx.speedup)
        try:
            async with open_caller(name, ctx) as caller:
                out_q.put(("ready", None))
                while not start_evt.is_set():
                    await asyncio.sleep(0.005)
                async with HarnessMonitor() as mon:
                    recs = await run_sessions(sessions, caller, clock, t0=t0_value.value,
                                              on_done=lambda r: out_q.put(("done", None)))
            out_q.put(("records", (recs, mon.summary())))
        finally:
            await hc.stop()

    try:
        asyncio.run(main())
    except BaseException as exc:  # report, never hang the parent
        log.exception("storm worker for %s failed", name)
        out_q.put(("error", repr(exc)))


async def _run_workers(cfg: StormConfig, name: str, ctx: SetupContext, sessions: list[Session],
                       clock: VirtualClock, done: Callable[[RequestRecord], None], mon: HarnessMonitor
                       ) -> tuple[list[RequestRecord], float]:
    mpc = mp.get_context("spawn")
    n = max(1, cfg.workers if cfg.workers else SETUPS[name].workers)
    shares: list[list[Session]] = [sessions[i::n] for i in range(n)]
    t0_value = mpc.Value("d", 0.0)
    start_evt = mpc.Event()
    out_q = mpc.Queue()
    from zp_client.bench.setups import factory_module

    module = factory_module(name)
    procs = [mpc.Process(target=_worker_main, args=(name, module, ctx, share, t0_value, start_evt, out_q),
                         daemon=True) for share in shares]
    for p in procs:
        p.start()
    records: list[RequestRecord] = []
    ready = finished = dones = 0
    worker_stats: list[dict[str, Any]] = []
    total = _count_turns(sessions)
    dummy = RequestRecord("", "", "", 0, 0, 0)
    try:
        while finished < n:
            try:
                kind, payload = out_q.get_nowait()
            except queue.Empty:
                if any(not p.is_alive() for p in procs) and out_q.empty():
                    await asyncio.sleep(0.2)
                    if out_q.empty() and any(p.exitcode not in (None, 0) for p in procs):
                        codes = [p.exitcode for p in procs]
                        raise RuntimeError(f"a {name} worker died: exit codes {codes}") from None
                await asyncio.sleep(0.01)
                continue
            if kind == "ready":
                ready += 1
                if ready == n:
                    t0_value.value = clock.now() + 0.05 * cfg.speedup  # a small lead for every worker
                    t0 = t0_value.value
                    mon.mark()
                    start_evt.set()
            elif kind == "done":
                done(dummy)
                if (dones := dones + 1) == total:
                    mon.stop()  # the last request ended; worker teardown is not part of the run
            elif kind == "records":
                recs, worker_harness = payload
                records.extend(recs)
                worker_stats.append(worker_harness)
                finished += 1
            elif kind == "error":
                raise RuntimeError(f"a {name} worker failed: {payload}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    mon.workers = worker_stats
    return records, t0


# ------------------------------------------------------------------------------ the whole storm


def sustainable_rate(run: SetupRun) -> float:
    """Completed logical requests per virtual second of the run (its makespan)."""
    ok = [r for r in run.records if r.ok and r.t_end is not None]
    if not ok:
        return 0.0
    makespan = max(r.t_end for r in ok if r.t_end is not None)
    return len(ok) / makespan if makespan > 0 else 0.0


async def run_storm(cfg: StormConfig, progress_factory: Callable[[list[str], int], Any] | None = None
                    ) -> tuple[Workload, ServerFacts, list[SetupRun]]:
    """Measure the unloaded server, build the workload, run every setup in ``cfg.setups`` in order."""
    facts, model = await measure_unloaded(cfg)
    wl = build_workload(cfg.workload, facts, cfg.seed, time_scale=cfg.time_scale, load_scale=cfg.load_scale,
                        **cfg.workload_overrides)
    total = wl.num_requests
    prog = progress_factory(cfg.setups, total) if progress_factory else None
    runs: list[SetupRun] = []
    rate: float | None = None
    for name in cfg.setups:
        if prog is not None:
            prog.start(name)
        run = await _run_one(cfg, name, wl, model, rate, prog.advance if prog else (lambda n, k: None))
        if name == "no-admission":
            rate = sustainable_rate(run)
        runs.append(run)
        if prog is not None:
            prog.finish(name)
    return wl, facts, runs
