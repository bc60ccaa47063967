"""Run a storm: measure the unloaded server, build the workload, replay it through every setup.

Each setup runs against a FRESH :class:`~zp_sim.server.SimServer` with the same configuration
(only the gateway timeout differs: ``no-admission`` runs without one, see :mod:`.setups`), in the same
process and event loop as the load generator.

``clock="virtual"`` (the default): every setup, and the unloaded probe, runs on its own fresh
:class:`~zp_client.testing.VirtualTimeLoop` starting at 0, the clients reaching the simulator's app
through :mod:`~zp_client.testing`, the global ``random`` seeded from the storm's seed and the
setup's name: a setup's records depend only on the seed, the workload and the setup (not on the other
setups run, nor on the machine). ``clock="real"``: the simulator serves loopback HTTP in real time x
``speedup``, as a deployment would; ``zp-redis`` replays its sessions from worker processes that read
the virtual clock over HTTP (``GET /sim/clock``); only this mode can run them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import queue
import random
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from zp_client.clock import real_monotonic
from zp_client.errors import ConfigurationError
from zp_storm.loadgen import (
    ClientLoad,
    HarnessMonitor,
    LoopTimeClock,
    RequestRecord,
    VirtualClock,
    run_sessions,
)
from zp_storm.setups import HEADROOM, SETUPS, SetupContext, open_caller, zp_limit_blocks
from zp_storm.tuning import ElasticTuning
from zp_storm.workloads import (
    ServerFacts,
    Session,
    Turn,
    Workload,
    build_workload,
    count_chat_tokens,
    make_text,
)

__all__ = ["CLOCKS", "StormConfig", "SetupRun", "measure_unloaded", "run_storm"]

#: The storm's clocks: ``virtual`` (default; deterministic, as fast as the CPU allows) and ``real``.
CLOCKS = ("virtual", "real")

T = TypeVar("T")

log = logging.getLogger("zp_storm.runner")


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
    its :class:`~zp_storm.setups.SetupContext`."""
    clock: str = "virtual"
    """``"virtual"`` or ``"real"`` (see the module docstring); ``speedup`` applies to ``real`` only."""
    client_load: float = 0.0
    """A busy client (:class:`~zp_storm.loadgen.ClientLoad`): the fraction of real time the
    client's event loop is blocked in 50 ms bursts. Above 0 it needs ``clock="real"``, and the simulator
    then runs in its own process, so that only the client is slow."""
    bypass: float = 0.0
    """Fraction of the logical requests every ``zp-*`` setup sends straight to the server, unadmitted
    (:mod:`~zp_storm.bypass`); 0: none (the other setups never bypass)."""
    bypass_window: tuple[float, float] | None = None
    """``[start, end)`` virtual seconds of the run during which selected requests bypass; None: all of it."""
    replicas: int = 1
    """Simulated servers per setup run (a fleet, ``--replicas N``); 1: one server, as always. The
    workload's load scales with it (:func:`~zp_storm.workloads.build_workload`'s ``replicas``)."""
    kill_replica_s: float | None = None
    """Kill the replica with the most requests in flight this many virtual seconds after the run starts
    (``--kill-replica AT_S``; abruptly: connections reset, engine gone); None: no kill."""
    pd: tuple[int, int] | None = None
    """``(P, D)``: prefill/decode disaggregation (``--pd P:D``): ``replicas`` is P + D; a P/D setup's
    servers are P prefill and D decode ones (:mod:`zp_sim.pd`), every other setup runs colocated
    on P + D plain ones. None: no P/D."""

    def __post_init__(self) -> None:
        if self.pd is not None:
            p, d = self.pd
            if p < 1 or d < 1 or self.replicas != p + d:
                raise ConfigurationError(f"pd must be (P, D) with P, D >= 1 and replicas = P + D, got "
                                         f"pd={self.pd!r}, replicas={self.replicas}")
            if not self.sim_in_process:
                raise ConfigurationError("--pd needs the simulators in the clients' process (their "
                                         "prefill and decode servers reach each other in memory): drop "
                                         "--client-load")
        if self.replicas < 1:
            raise ConfigurationError(f"replicas must be >= 1, got {self.replicas!r}")
        if self.kill_replica_s is not None and self.kill_replica_s < 0:
            raise ConfigurationError(f"kill_replica_s must be >= 0, got {self.kill_replica_s!r}")
        if (self.replicas > 1 or self.kill_replica_s is not None) and self.client_load and not self.virtual:
            raise ConfigurationError("--replicas / --kill-replica with --client-load need --clock virtual "
                                     "(the real-clock busy client serves one simulator from its own process)")
        if self.clock not in CLOCKS:
            raise ConfigurationError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if not 0.0 <= self.client_load < 1.0:
            raise ConfigurationError(f"client_load must be in [0, 1), got {self.client_load!r}")
        if not 0.0 <= self.bypass <= 1.0:
            raise ConfigurationError(f"bypass must be a fraction in [0, 1], got {self.bypass!r}")
        if self.bypass_window is not None:
            start, end = self.bypass_window
            if not 0.0 <= start < end:
                raise ConfigurationError(f"bypass_window must be (start, end) with 0 <= start < end, got "
                                         f"{self.bypass_window!r}")

    @property
    def sim_in_process(self) -> bool:
        """Whether the simulator shares the clients' process (always on the virtual clock; on the real
        clock not with a busy client)."""
        return self.virtual or self.client_load == 0

    @property
    def virtual(self) -> bool:
        return self.clock == "virtual"

    @property
    def effective_speedup(self) -> float:
        """Virtual seconds per loop second: 1 on the virtual clock (the loop's time IS virtual)."""
        return 1.0 if self.virtual else self.speedup


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
    bypass: dict[str, Any] | None = None
    """The storm's bypass plan (:meth:`~zp_storm.bypass.BypassPlan.as_dict`) and whether it
    applied to this setup (``applies``), plus the selected ids (``ids``, for the reference split of the
    setups it does not apply to); None without ``--bypass``."""
    leases_granted: int | None = None
    """Leases the setup's zp budget granted over the run (``LocalBudget`` status; None: no local budget)."""
    limit_timeline: list[tuple[float, int]] | None = None
    """The budget limit over the run, ``(virtual s since the run's start, limit blocks)``, for a setup
    whose caller exposes one (``limit_timeline``: the adaptive limit); None otherwise."""
    keepwarms: int | None = None
    """Keep-warm requests a pinning setup's caller sent (``zp-pinned``, ``zp-pinned-timer``); None for
    the others."""
    pd_counts: dict[str, int] | None = None
    """What ``zp-pd``'s two-phase lease did (:attr:`zp_client.fleet.pd.PDSettings.counts`); None for the
    other setups."""
    held_timeline: list[tuple[float, list[int], list[int]]] | None = None
    """``(virtual s since the run's start, the budget's charged blocks per replica, the simulator's
    allocated blocks per replica)`` every :data:`HELD_SAMPLE_S`, for a setup whose caller exposes
    ``charged_blocks()`` (``zp-pd``) on the virtual clock; None otherwise."""
    replicas: int = 1
    """Servers in the run; above 1 ``server_stats`` and ``timeline`` aggregate them (see
    :func:`aggregate_stats`, :func:`fleet_timeline`) and the ``replica_*`` fields hold each one's."""
    replica_stats: list[dict[str, Any]] | None = None
    """Each replica's ``/sim/stats`` (without per-request records); None for one server and no kill."""
    replica_timelines: list[list[tuple[float, float, int, int, int]]] | None = None
    replica_metrics_preemptions: list[float | None] | None = None
    kill: dict[str, Any] | None = None
    """``--kill-replica``: ``{"replica": index, "url", "t_s": virtual s since the run's start, "in_flight":
    requests the server held, "reset": connections reset}``, or None (no kill, or the run ended first)."""
    moved_off_dead: int | None = None
    """Requests the setup moved off a failed replica (its caller's ``moved_off_dead``); None: not exposed."""
    replica_requests: list[int] | None = None
    """HTTP requests the setup's router sent to each replica (its caller's ``replica_requests``), or None."""
    sim_settings: dict[str, Any] | None = None
    """The setup's own server settings (:attr:`~zp_storm.setups.SetupSpec.sim_extra` and
    ``sim_for``: ``policy``, ``max_num_queued_tokens``...), or None: the run's defaults."""


def replica_seed(seed: int, index: int) -> int:
    """The simulator seed of replica ``index`` (replica 0 keeps the storm's own: a one-server run is
    unchanged)."""
    return seed if index == 0 else seed + 7919 * index


def replica_host(cfg: StormConfig, index: int) -> str:
    """The in-memory host of replica ``index``: ``sim.memory`` for one server (as always),
    ``sim-I.memory`` in a fleet."""
    return "sim.memory" if cfg.replicas == 1 else f"sim-{index}.memory"


@contextlib.asynccontextmanager
async def _sim_server(cfg: StormConfig, gateway_timeout_s: float | None,
                      index: int = 0, role: str | None = None, kv_lease_s: float | None = None,
                      sim_extra: Mapping[str, Any] | None = None) -> AsyncIterator[Any]:
    """A fresh simulator: in memory on the virtual clock, on loopback HTTP on the real one. ``role``:
    a P/D server's (with the run's scaled ``kv_lease_s``); ``sim_extra``: a setup's own server settings
    (``long_prefill_token_threshold``)."""
    from zp_sim.server import SimServer

    kw: dict[str, Any] = dict(sim_extra or {})
    if role is not None:
        kw["role"] = role
        if kv_lease_s is not None:
            kw["kv_lease_s"] = kv_lease_s
    server = SimServer(cfg.profile, num_gpu_blocks=cfg.num_gpu_blocks, speedup=cfg.effective_speedup,
                       gateway_timeout_s=gateway_timeout_s, seed=replica_seed(cfg.seed, index),
                       max_model_len=cfg.max_model_len, **kw)
    if cfg.virtual:
        async with server.in_memory(replica_host(cfg, index)):
            yield server
    elif cfg.sim_in_process:
        async with server:
            yield server
    else:
        async with _SimProcess(server) as remote:
            yield remote


@contextlib.asynccontextmanager
async def _sim_fleet(cfg: StormConfig, gateway_timeout_s: float | None,
                     roles: list[str | None] | None = None, kv_lease_s: float | None = None,
                     sim_extra: Mapping[str, Any] | None = None) -> AsyncIterator[list[Any]]:
    """``cfg.replicas`` fresh simulators with the same configuration (seeds: :func:`replica_seed`), with
    ``roles`` for a P/D setup."""
    roles = roles or [None] * cfg.replicas
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(_sim_server(cfg, gateway_timeout_s, i, roles[i],
                                                               kv_lease_s, sim_extra))
                   for i in range(cfg.replicas)]
        yield servers


class _SimProcess:
    """A :class:`~zp_sim.server.SimServer` served from its own (spawned) process, with the
    handle's surface the runner uses (``url``, ``base_url``, ``app``, ``clock``, ``stats``, ``timeline``),
    read over HTTP. ``clock`` is the simulator's virtual clock read once over ``GET /sim/clock`` and
    extrapolated from there at ``speedup`` on this process's real clock (re-reading it would quantize
    client timestamps to the polls: the simulator's clock runs a step ahead while busy); ``stats`` and
    ``timeline`` are fetched by :meth:`fetch_results` once the run is over."""

    app = None

    def __init__(self, server: Any) -> None:
        self._server = server  # configured, never started here: its settings travel to the child
        self._proc: Any = None
        self._stop: Any = None
        self._stats: dict[str, Any] = {}
        self.timeline: list[tuple[float, float, int, int, int]] = []
        self._anchor = (0.0, 0.0)  # (virtual s, real s) at one reading of /sim/clock

    async def __aenter__(self) -> _SimProcess:
        mpc = mp.get_context("spawn")
        ports = mpc.Queue()
        self._stop = mpc.Event()
        args = (self._server.config_kwargs(), ports, self._stop)
        self._proc = mpc.Process(target=_sim_process_main, args=args, daemon=True)
        self._proc.start()
        loop = asyncio.get_running_loop()
        port = await loop.run_in_executor(None, ports.get, True, 120)
        if isinstance(port, str):
            raise RuntimeError(f"the simulator process failed to start: {port}")
        self.url = f"http://127.0.0.1:{port}"
        self.base_url = self.url + "/v1"
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            before = real_monotonic()
            virtual = float((await http.get("/sim/clock")).json()["clock_s"])
            self._anchor = (virtual, (before + real_monotonic()) / 2)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.terminate()

    def clock(self) -> float:
        virtual, real = self._anchor
        return virtual + (real_monotonic() - real) * float(self._server.speedup)

    async def fetch_results(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as http:
            self._stats = (await http.get("/sim/stats", params={"requests": 1, "timeline": 1})).json()
        self.timeline = [(float(t), float(kv), int(p), int(r), int(w))
                         for t, kv, p, r, w in self._stats.pop("timeline", [])]

    def stats(self, requests: bool = False) -> dict[str, Any]:
        return self._stats


def _sim_process_main(kwargs: dict[str, Any], ports: Any, stop: Any) -> None:
    """The simulator process: serve until ``stop`` is set; the port (or the failure) goes to ``ports``."""
    from zp_sim.server import SimServer

    async def main() -> None:
        async with SimServer(**kwargs) as server:
            ports.put(server.port)
            while not stop.is_set():
                await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it; never hang it
        ports.put(repr(exc))


def _http(server: Any, cfg: StormConfig) -> httpx.AsyncClient:
    """An httpx client for the harness's own calls to ``server`` (/metrics, /v1/models)."""
    transport = None
    if cfg.virtual:
        from zp_client.testing import MemoryTransport

        transport = MemoryTransport(server.app)
    return httpx.AsyncClient(base_url=server.url, timeout=30, transport=transport)


def _clock_for(server: Any, cfg: StormConfig) -> VirtualClock:
    return LoopTimeClock() if cfg.virtual else VirtualClock(server.clock, cfg.speedup)


async def _pool_facts(server: Any, cfg: StormConfig) -> tuple[int, int, int, str]:
    """(num_gpu_blocks, block_size, max_model_len, model) as a client learns them: /metrics, /v1/models."""
    from zp_client.server import parse_metrics

    async with _http(server, cfg) as http:
        m = parse_metrics((await http.get("/metrics")).text)
        models = (await http.get("/v1/models")).json()["data"]
    if m.num_gpu_blocks is None or m.block_size is None:
        raise RuntimeError("the server's /metrics has no vllm:cache_config_info num_gpu_blocks/block_size")
    return m.num_gpu_blocks, m.block_size, int(models[0]["max_model_len"]), str(models[0]["id"])


async def measure_unloaded(cfg: StormConfig) -> tuple[ServerFacts, str]:
    """A short single-request run on a fresh server: the unloaded TTFT and inter-token latency."""
    async with _sim_server(cfg, None) as server:
        blocks, bs, mml, model = await _pool_facts(server, cfg)
        msgs = [{"role": "user", "content": make_text(512, random.Random(cfg.seed), "unloaded probe")}]
        turn = Turn(msgs, count_chat_tokens(msgs), 64, 64)
        clock = _clock_for(server, cfg)
        ctx = SetupContext(server.base_url, server.url, model, cfg.effective_speedup, blocks, bs, 0,
                           elastic=cfg.elastic, clock=cfg.clock, app=server.app)
        async with open_caller("no-admission", ctx) as caller:
            recs = await run_sessions([Session("probe", 0.0, "probe", [turn])], caller, clock, t0=clock.now())
            rec = recs[0]
            if not rec.ok:
                raise RuntimeError(f"the unloaded probe request failed: {rec.error}")
            # the prefill throughput: one long prompt alone (after the first probe ended), its prompt
            # tokens over its TTFT (chunked prefill at the server's token budget, the first token included)
            n = max(64, min(PREFILL_PROBE_TOKENS, mml - 80))
            long_msgs = [{"role": "user", "content": make_text(n, random.Random(cfg.seed), "prefill probe")}]
            long_turn = Turn(long_msgs, count_chat_tokens(long_msgs), 1, 1)
            longs = await run_sessions([Session("prefill-probe", 0.0, "probe", [long_turn])], caller, clock,
                                       t0=clock.now())
        itls = sorted(rec.itls())
        itl = itls[len(itls) // 2]
        lp = longs[0]
        tps = long_turn.prompt_tokens / lp.ttft if lp.ok and lp.ttft else 0.0
        return ServerFacts(blocks, bs, mml, itl, rec.ttft or 0.0, tps), model


#: The prompt length (tokens, capped to the context) of the probe measuring the prefill throughput.
PREFILL_PROBE_TOKENS = 8000


def slo_classes(wl: Workload) -> dict[str, tuple[float, float | None, int]]:
    """The workload's request classes as setups see them: ``{class: (TTFT target s, TPOT target s or None,
    priority)}``, the workload's one class under the key ``""``."""
    out: dict[str, tuple[float, float | None, int]] = {"": (wl.slo.ttft_s, wl.slo.tpot_s, 0)}
    for name, c in wl.classes.items():
        out[name] = (c.slo.ttft_s, c.slo.tpot_s, c.priority)
    return out


def _leases_granted(caller: Any) -> int | None:
    """Leases granted so far by the zp budget behind ``caller`` (an AppCaller of a wrapped client on a
    LocalBudget), or None."""
    from zp_client import admitted_budget

    client = getattr(caller, "client", None)
    if client is None:
        return None
    try:
        budget = admitted_budget(client)
    except Exception:  # noqa: BLE001 - not a wrapped openai client: nothing to count
        return None
    status_sync = getattr(budget, "status_sync", None)
    if status_sync is None:
        return None
    granted = status_sync().extra.get("granted")
    return int(granted) if granted is not None else None


def _limit_timeline(caller: Any, b0: float, speedup: float) -> list[tuple[float, int]] | None:
    """The caller's ``limit_timeline`` (``(t, limit)`` pairs, ``t`` on the budget's clock) in virtual
    seconds since the run's start (``b0``: the budget's clock at the start; ``speedup``: virtual seconds per
    budget-clock second), or None when the caller exposes none."""
    tl = getattr(caller, "limit_timeline", None)
    if tl is None:
        return None
    if callable(tl):
        tl = tl()
    return [(round(max(0.0, (float(t) - b0) * speedup), 6), int(limit)) for t, limit in tl]


def _budget_now(ctx: SetupContext) -> float:
    """The budget's clock now (the loop's on the virtual clock, the system's otherwise)."""
    from zp_client.clock import SYSTEM_CLOCK

    return float((ctx.budget_clock() or SYSTEM_CLOCK).monotonic())


def _plan(cfg: StormConfig, wl: Workload) -> Any:
    """The storm's bypass plan (:func:`~zp_storm.bypass.plan_bypass`), or None without one."""
    if not cfg.bypass:
        return None
    from zp_storm.bypass import plan_bypass

    return plan_bypass(wl.sessions, cfg.bypass, cfg.seed, cfg.bypass_window)


async def _run_one(cfg: StormConfig, name: str, wl: Workload, model: str, rate_rps: float | None,
                   progress: Callable[[str, int], None], plan: Any = None,
                   keepwarm_period_s: float | None = None, kv_lease_s: float | None = None,
                   facts: ServerFacts | None = None) -> SetupRun:
    from zp_storm.bypass import bypass_applies, open_bypass

    spec = SETUPS[name]
    applies = plan is not None and bypass_applies(name)
    if spec.workers > 1 and cfg.virtual:
        raise ConfigurationError(f"setup {name} runs worker processes, which cannot share a virtual "
                                 "clock: run it with --clock real")
    # seeded per setup: openai's retry jitter and zp's full-jitter backoff draw from the global RNG
    random.seed(f"zp-storm:{cfg.seed}:{name}")
    gateway = wl.gateway_timeout_s if spec.gateway else None
    # A busy client: on the real clock it spins (ClientLoad); on the virtual clock, where spinning takes
    # no time, its reads are held through the busy periods instead (ReadPauses).
    pauses = None
    if cfg.virtual and cfg.client_load:
        from zp_client.testing import ReadPauses

        pauses = ReadPauses(cfg.client_load)
    fleet = cfg.replicas > 1 or cfg.kill_replica_s is not None
    if cfg.kill_replica_s is not None and spec.workers > 1:
        raise ConfigurationError(f"setup {name} runs worker processes, which --kill-replica does not "
                                 "support")
    roles: list[str | None] | None = None
    if cfg.pd is not None and spec.pd:
        roles = [*(["prefill"] * cfg.pd[0]), *(["decode"] * cfg.pd[1])]
    sim_extra = dict(spec.sim_extra or {})
    if spec.sim_for is not None:  # server settings derived from the workload and the measured server
        if facts is None:
            raise ConfigurationError(f"setup {name} sizes its server from the measured one: pass facts")
        sim_extra.update(spec.sim_for(wl, facts))
    async with _sim_fleet(cfg, gateway, roles, kv_lease_s, sim_extra) as servers:
        server = servers[0]
        pool = [await _pool_facts(s, cfg) for s in servers]
        blocks, bs, _, _ = pool[0]
        limit = zp_limit_blocks(blocks, HEADROOM)
        network = None
        if cfg.virtual and fleet:
            from zp_client.testing import MemoryNetwork

            network = MemoryNetwork({httpx.URL(s.url).host: s.app for s in servers})
        ctx = SetupContext(server.base_url, server.url, model, cfg.effective_speedup, blocks, bs, limit,
                           rate_rps=rate_rps, redis_url=cfg.redis_url,
                           budget_name=f"zp-storm-{uuid.uuid4().hex[:12]}", elastic=cfg.elastic,
                           clock=cfg.clock, app=server.app, read_pauses=pauses,
                           replica_base_urls=[s.base_url for s in servers],
                           replica_root_urls=[s.url for s in servers],
                           replica_apps=[s.app for s in servers],
                           replica_limit_blocks=[zp_limit_blocks(p[0], HEADROOM) for p in pool],
                           network=network, seed=cfg.seed, pin_prefixes=wl.pin_prefixes,
                           keepwarm_period_s=keepwarm_period_s,
                           replica_roles=list(roles) if roles else [None] * len(servers),
                           kv_lease_s=kv_lease_s if roles else None,
                           slo_classes=slo_classes(wl))
        clock = _clock_for(server, cfg)
        kill: dict[str, Any] = {}
        moved: int | None = None
        fleet_limit: int | None = None
        routed: list[int] | None = None

        def done(rec: RequestRecord) -> None:
            progress(name, 1)

        load = ClientLoad(0.0 if cfg.virtual else cfg.client_load)
        granted: int | None = None
        keepwarms: int | None = None
        limit_tl: list[tuple[float, int]] | None = None
        held_tl: list[tuple[float, list[int], list[int]]] | None = None
        pd_counts: dict[str, int] | None = None
        async with HarnessMonitor(sample_lag=not cfg.virtual) as mon:
            if spec.workers > 1:
                records, t0 = await _run_workers(cfg, name, ctx, wl.sessions, clock, done, mon,
                                                 plan if applies else None)
            else:
                async with open_caller(name, ctx) as caller, \
                        open_bypass(ctx, caller, plan if applies else None) as run_caller:
                    mon.mark()
                    t0 = clock.now()
                    b0 = _budget_now(ctx)
                    if run_caller is not caller:
                        run_caller.t0 = t0  # type: ignore[attr-defined]  # a BypassCaller
                    killer = None
                    if cfg.kill_replica_s is not None:
                        killer = asyncio.get_running_loop().create_task(
                            _kill_busiest(servers, network, clock, t0 + cfg.kill_replica_s, t0, kill))
                    sampler = None
                    if cfg.virtual and callable(getattr(caller, "charged_blocks", None)) and all(
                            callable(getattr(s, "allocated_blocks", None)) for s in servers):
                        held_tl = []
                        sampler = asyncio.get_running_loop().create_task(
                            _sample_held(caller, servers, clock, t0, held_tl))
                    try:
                        async with load:
                            records = await run_sessions(wl.sessions, run_caller, clock, t0=t0, on_done=done)
                    finally:
                        for task in (killer, sampler):
                            if task is not None:
                                task.cancel()
                                with contextlib.suppress(asyncio.CancelledError):
                                    await task
                    if held_tl is not None:  # one last sample: after the run both pools hold nothing
                        held_tl.append(_held_sample(caller, servers, clock, t0))
                    mon.stop()
                    granted = _leases_granted(caller)
                    limit_tl = _limit_timeline(caller, b0, cfg.effective_speedup)
                    fleet_limit = _caller_count(caller, "limit_blocks")
                    moved = _caller_count(caller, "moved_off_dead")
                    routed = _caller_count(caller, "replica_requests")
                    keepwarms = _caller_count(caller, "keepwarms")
                    pd_counts = getattr(caller, "pd_counts", None)
        if cfg.redis_url and SETUPS[name].needs_redis:
            await _delete_budget_keys(cfg.redis_url, ctx.budget_name)
        if isinstance(server, _SimProcess):
            await server.fetch_results()
        stats = server.stats(requests=True)
        mp_total = await _metrics_preemptions(server, cfg)
        timeline = list(server.timeline)
        fleet_fields: dict[str, Any] = {}
        if fleet:
            all_stats = [stats] + [s.stats(requests=True) for s in servers[1:]]
            replica_mp = [mp_total] + [await _metrics_preemptions(s, cfg) for s in servers[1:]]
            stats = aggregate_stats(all_stats)
            mp_total = None if any(x is None for x in replica_mp) else sum(x or 0.0 for x in replica_mp)
            timelines = [list(s.timeline) for s in servers]
            timeline = fleet_timeline(timelines)
            fleet_fields = {
                "replicas": len(servers),
                "replica_stats": [{k: v for k, v in st.items() if k != "requests"}
                                  | {"requests": len(st.get("requests") or [])} for st in all_stats],
                "replica_timelines": timelines,
                "replica_metrics_preemptions": replica_mp,
                "kill": kill or None,
                "moved_off_dead": moved,
                "replica_requests": routed,
            }
        harness = {**mon.summary(), "clock": cfg.clock}
        if pauses is not None:
            lags = sorted(pauses.lags)
            harness.update(client_load=cfg.client_load, client_load_model="read pauses",
                           read_pauses_held=pauses.held,
                           read_lag_p99_ms=round(1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))], 2)
                           if lags else 0.0)
        elif cfg.client_load:
            harness.update(client_load=cfg.client_load, client_load_bursts=load.bursts,
                           client_load_busy_s=round(load.busy_s, 3))
        return SetupRun(name, records, stats, timeline, t0, harness, gateway,
                        sim_settings=sim_extra or None,
                        limit_blocks=(ctx.built_limit or limit)
                        if name.startswith("zp") or name == "clairvoyant" else fleet_limit,
                        rate_rps=rate_rps if name == "rate-limited" else None,
                        metrics_preemptions=mp_total,
                        bypass=None if plan is None else {**plan.as_dict(), "applies": applies,
                                                          "ids": sorted(plan.ids)},
                        leases_granted=granted, limit_timeline=limit_tl, keepwarms=keepwarms,
                        held_timeline=held_tl, pd_counts=pd_counts, **fleet_fields)


HELD_SAMPLE_S = 0.05
"""How often (virtual seconds) the held-vs-allocated timeline samples a ``zp-pd`` run."""


async def _sample_held(caller: Any, servers: list[Any], clock: Any, t0: float,
                       out: list[tuple[float, list[int], list[int]]]) -> None:
    """Every :data:`HELD_SAMPLE_S`: the caller's charged blocks per replica against each simulator's
    allocated blocks, read at one virtual instant."""
    while True:
        out.append(_held_sample(caller, servers, clock, t0))
        await asyncio.sleep(HELD_SAMPLE_S)


def _held_sample(caller: Any, servers: list[Any], clock: Any,
                 t0: float) -> tuple[float, list[int], list[int]]:
    """One sample: virtual s since ``t0``, the caller's charged blocks and each server's allocated."""
    return clock.now() - t0, list(caller.charged_blocks()), [s.allocated_blocks() for s in servers]


async def _metrics_preemptions(server: Any, cfg: StormConfig) -> float | None:
    """The server's ``vllm:num_preemptions`` from its /metrics; a killed server's (no /metrics over the
    network) from its engine's count."""
    from zp_client.server import parse_metrics

    if getattr(server, "killed_at", None) is not None and not cfg.virtual:
        return float(server.stats()["engine"]["preemptions_total"] or 0)
    async with _http(server, cfg) as http:
        return parse_metrics((await http.get("/metrics")).text).num_preemptions_total


def _caller_count(caller: Any, name: str) -> Any:
    """A counter a setup's caller may expose (an int, a list of ints, or a callable returning one)."""
    value = getattr(caller, name, None)
    if callable(value):
        value = value()
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else int(value)


async def _kill_busiest(servers: list[Any], network: Any, clock: VirtualClock, at: float, t0: float,
                        out: dict[str, Any]) -> None:
    """At ``at`` (the run's clock), kill the replica with the most requests in flight (ties: the lowest
    index) abruptly; describe it in ``out``."""
    await clock.sleep_until(at)
    loads = [int(s.stats()["in_flight"]) for s in servers]
    index = max(range(len(servers)), key=lambda i: (loads[i], -i))
    victim = servers[index]
    reset = network.kill(httpx.URL(victim.url).host) if network is not None else 0
    aborted = await victim.kill()
    out.update(replica=index, url=victim.url, t_s=round(clock.now() - t0, 6), in_flight=loads[index],
               in_flight_per_replica=loads, reset=reset + aborted)
    log.info("killed replica %d (%s) at %.3f s with %d requests in flight", index, victim.url,
             out["t_s"], loads[index])


_SUMMED_ENGINE = ("preemptions_total", "recomputed_tokens", "prompt_tokens_total", "generation_tokens_total",
                  "prefix_cache_queries_total", "prefix_cache_hits_total", "steps", "num_running",
                  "num_waiting")
_SUMMED_COUNTS = ("finished", "aborted_disconnect", "gateway_504", "errors_4xx", "rejected_queue_full",
                  "in_flight", "real_steps")


def aggregate_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``/sim/stats`` for a fleet: replica 0's, with the engine's counters and the request counts
    summed over the replicas, ``kv_usage`` and lags the maximum, the per-request records concatenated,
    and ``replicas`` the count."""
    out = dict(stats[0])
    engine = dict(out.get("engine") or {})
    for key in _SUMMED_ENGINE:
        vals = [(st.get("engine") or {}).get(key) for st in stats]
        if any(v is not None for v in vals):
            engine[key] = sum(v or 0 for v in vals)
    kvs = [(st.get("engine") or {}).get("kv_usage") for st in stats]
    engine["kv_usage"] = max((k for k in kvs if k is not None), default=None)
    out["engine"] = engine
    for key in _SUMMED_COUNTS:
        if key in out:
            out[key] = sum(int(st.get(key) or 0) for st in stats)
    reqs = [st.get("requests") for st in stats]
    if all(isinstance(r, list) for r in reqs):
        out["requests"] = [x for r in reqs if isinstance(r, list) for x in r]
    elif all(isinstance(r, int) for r in reqs):
        out["requests"] = sum(r for r in reqs if isinstance(r, int))
    out["max_lag_s"] = max(float(st.get("max_lag_s") or 0.0) for st in stats)
    out["lagging"] = any(bool(st.get("lagging")) for st in stats)
    out["replicas"] = len(stats)
    return out


def fleet_timeline(timelines: list[list[tuple[float, float, int, int, int]]]
                   ) -> list[tuple[float, float, int, int, int]]:
    """The replicas' timelines merged in time order into one fleet timeline: at each sample, the largest
    KV usage of any replica and the fleet's total preemptions, running and waiting requests (each
    replica's latest sample)."""
    events = sorted((t, i, kv, p, r, w) for i, tl in enumerate(timelines) for (t, kv, p, r, w) in tl)
    latest: dict[int, tuple[float, int, int, int]] = {}
    out: list[tuple[float, float, int, int, int]] = []
    for t, i, kv, p, r, w in events:
        latest[i] = (kv, p, r, w)
        vals = latest.values()
        out.append((t, max(v[0] for v in vals), sum(v[1] for v in vals), sum(v[2] for v in vals),
                    sum(v[3] for v in vals)))
    return out


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
        self._w = real_monotonic()
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
        self._v, self._w = float(r["clock_s"]), real_monotonic()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            try:
                await self._refresh()
            except httpx.HTTPError as exc:
                self.refresh_errors += 1
                log.debug("the simulator clock poll failed (%d so far): %r", self.refresh_errors, exc)

    def now(self) -> float:
        t = self._v + (real_monotonic() - self._w) * self.speedup
        self._last = max(self._last, t)
        return self._last


def _count_turns(sessions: list[Session]) -> int:
    return sum(1 + _count_turns(t.children) for s in sessions for t in s.turns)


def _worker_main(name: str, factory_module: str, ctx: SetupContext, sessions: list[Session], t0_value: Any,
                 start_evt: Any, out_q: Any, plan: Any = None) -> None:
    import importlib

    from zp_storm.bypass import open_bypass

    importlib.import_module(factory_module)  # a setup registered by another module exists here too

    async def main() -> None:
        hc = _HttpClock(ctx.root_url, ctx.speedup)
        await hc.start()
        clock = VirtualClock(hc.now, ctx.speedup)
        try:
            async with open_caller(name, ctx) as caller, open_bypass(ctx, caller, plan) as run_caller:
                out_q.put(("ready", None))
                while not start_evt.is_set():
                    await asyncio.sleep(0.005)
                if run_caller is not caller:
                    run_caller.t0 = t0_value.value  # type: ignore[attr-defined]  # a BypassCaller
                async with HarnessMonitor() as mon:
                    recs = await run_sessions(sessions, run_caller, clock, t0=t0_value.value,
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
                       clock: VirtualClock, done: Callable[[RequestRecord], None], mon: HarnessMonitor,
                       plan: Any = None) -> tuple[list[RequestRecord], float]:
    mpc = mp.get_context("spawn")
    n = max(1, cfg.workers if cfg.workers else SETUPS[name].workers)
    shares: list[list[Session]] = [sessions[i::n] for i in range(n)]
    t0_value = mpc.Value("d", 0.0)
    start_evt = mpc.Event()
    out_q = mpc.Queue()
    from zp_storm.setups import factory_module

    module = factory_module(name)
    procs = [mpc.Process(target=_worker_main,
                         args=(name, module, ctx, share, t0_value, start_evt, out_q, plan), daemon=True)
             for share in shares]
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


def _run(cfg: StormConfig, main: Coroutine[Any, Any, T]) -> T:
    """Run one step of the storm on a fresh loop: a virtual-time one (from 0) or a normal one."""
    if cfg.virtual:
        from zp_client.testing import run_virtual

        return run_virtual(main)
    return asyncio.run(main)


#: vLLM's ``kv_lease_duration`` default (seconds on the real deployment).
REAL_KV_LEASE_S = 30.0


def kv_lease_s(wl: Workload, facts: ServerFacts) -> float:
    """The P/D servers' KV lease, scaled to the simulator by the rule of the gateway timeout (a budget
    of loaded decode steps): ``REAL_KV_LEASE_S`` x the workload's gateway scale (its gateway timeout /
    60 s), or x :func:`~zp_storm.workloads.gateway_time_scale` for ~4k-token sequences when the
    workload has no gateway."""
    from zp_storm.workloads import REAL_GATEWAY_TIMEOUT_S, gateway_time_scale

    if wl.gateway_timeout_s:
        return round(REAL_KV_LEASE_S * wl.gateway_timeout_s / REAL_GATEWAY_TIMEOUT_S, 3)
    return round(REAL_KV_LEASE_S * gateway_time_scale(facts, 4096.0), 3)


def timer_period(run: SetupRun, prefixes: int) -> float | None:
    """The keep-warm period that sends, over ``run``'s span, as many keep-warms as ``run`` (``zp-pinned``)
    sent: ``prefixes`` of them per period. None when it sent none (the timer then uses its default)."""
    if not run.keepwarms or prefixes <= 0:
        return None
    ends = [r.t_end for r in run.records if r.t_end is not None]
    span = max(ends, default=0.0)  # records are relative to the run's start
    return span * prefixes / run.keepwarms if span > 0 else None


def run_storm(cfg: StormConfig, progress_factory: Callable[[list[str], int], Any] | None = None
              ) -> tuple[Workload, ServerFacts, list[SetupRun]]:
    """Measure the unloaded server, build the workload, run every setup in ``cfg.setups`` in order,
    each on a fresh event loop (see the module docstring)."""
    if cfg.virtual:
        refused = [n for n in cfg.setups if n in SETUPS and (SETUPS[n].workers > 1 or SETUPS[n].needs_redis)]
        if refused:
            raise ConfigurationError(f"setup {', '.join(refused)} runs worker processes or Redis, which a "
                                     "virtual clock cannot hold: run it with --clock real")
    facts, model = _run(cfg, measure_unloaded(cfg))
    extra: dict[str, Any] = {"replicas": cfg.replicas} if cfg.replicas > 1 else {}
    wl = build_workload(cfg.workload, facts, cfg.seed, time_scale=cfg.time_scale, load_scale=cfg.load_scale,
                        **extra, **cfg.workload_overrides)
    total = wl.num_requests
    plan = _plan(cfg, wl)
    prog = progress_factory(cfg.setups, total) if progress_factory else None
    runs: list[SetupRun] = []
    rate: float | None = None
    period: float | None = None
    lease = kv_lease_s(wl, facts) if cfg.pd is not None else None
    for name in cfg.setups:
        if prog is not None:
            prog.start(name)
        run = _run(cfg, _run_one(cfg, name, wl, model, rate, prog.advance if prog else (lambda n, k: None),
                                 plan, period, lease, facts))
        if name == "no-admission":
            rate = sustainable_rate(run)
        if name == "zp-pinned":
            period = timer_period(run, len(wl.pin_prefixes))
        runs.append(run)
        if prog is not None:
            prog.finish(name)
    return wl, facts, runs
