"""The simulated vLLM server: an OpenAI-compatible HTTP API in front of the step-driven engine.

    async with SimServer(profile="tiny", num_gpu_blocks=200, speedup=10) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x")

``with SimServer(...)`` runs it on a background thread for synchronous code. Endpoints, errors, output
lengths, tool calls, gateway emulation and virtual time: see docs/simulator.md#the-http-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from . import tokenizer as tok
from .engine import Engine, EngineConfig
from .pd import DEFAULT_KV_LEASE_S, KVRole, kv_params
from .profiles import StepProfile, get_profile

__all__ = ["DEFAULT_OUTPUT_MEDIAN", "DEFAULT_OUTPUT_SIGMA", "SimServer", "build_app", "sleep_until"]

logger = logging.getLogger("zp_sim.server")

DEFAULT_OUTPUT_MEDIAN = 220
DEFAULT_OUTPUT_SIGMA = 0.9
#: Lag (virtual seconds behind the real-time schedule) above which a run is flagged as lagging.
LAG_WARN_S = 0.25
#: While behind schedule, the engine loop yields to the HTTP handlers at least this often (real s).
_MAX_UNYIELDED_S = 0.002

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# vLLM's admission-control rejections (vllm/exceptions.py QueueOverflowError / MaxQueuedTokensError,
# mapped by create_error_response to 503 with type = the status phrase).
QUEUE_OVERFLOW_MESSAGE = ("The engine is currently busy and cannot accept new requests. "
                          "Please try again later or on a different instance.")
MAX_QUEUED_TOKENS_MESSAGE = ("The engine has reached its prefill token backlog limit. "
                             "Please try again later or on a different instance.")
_ADMISSION_ERROR_TYPE = "Service Unavailable"

_GATEWAY_504_BODY = (
    "<html>\r\n<head><title>504 Gateway Time-out</title></head>\r\n<body>\r\n"
    "<center><h1>504 Gateway Time-out</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def response(self) -> JSONResponse:
        return _error(self.status, self.message, self.type, self.param)


def _error(
    status: int, message: str, type_: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}},
                        status_code=status)


# ----------------------------------------------------------------------------------------------
# request state


@dataclass
class _Choice:
    index: int
    engine_id: str
    target: int  # number of tokens the engine will produce
    bound: int  # clamped max_tokens
    token_ids: list[int]  # the output ids (fixed up front: deterministic text)
    tool_call: tuple[str, str] | None = None  # (name, arguments JSON)
    generated: int = 0
    finished: bool = False

    @property
    def finish_reason(self) -> str:
        if self.target >= self.bound:
            return "length"
        return "tool_calls" if self.tool_call else "stop"


@dataclass
class _Record:
    request_id: str
    engine_ids: list[str]
    kind: str
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    priority: int
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    status: str = "running"  # running | finished | aborted | gateway_timeout
    preemptions: int = 0
    cached_tokens: int = 0
    """Prefix-cache hit tokens of its prompt at its first admission (vLLM's ``num_cached_tokens``)."""
    token_times: list[float] = field(default_factory=list, repr=False)
    """The virtual time of every engine step that produced tokens for it (not in the JSON)."""


async def sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleep until ``loop.time() >= when``, scheduled at ``when`` itself (``asyncio.sleep(when - now)``
    would land an ulp off it, and on a virtual-time loop chunks would not arrive at their emission time)."""
    fut = loop.create_future()
    handle = loop.call_at(when, _resolve, fut)
    try:
        await fut
    finally:
        handle.cancel()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _new_future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


@dataclass
class _Pending:
    """One HTTP request in flight: its choices and the queue the engine loop feeds."""

    request_id: str
    kind: str  # "chat" | "completion"
    created: int
    model: str
    prompt_ids: list[int]
    choices: list[_Choice]
    record: _Record
    last_token_t: dict[int, float] = field(default_factory=dict)
    # Wake-ups: handlers wait on exactly what they need (first byte, completion, any progress), so a
    # non-streamed request is not woken once per token.
    first: asyncio.Future[None] = field(default_factory=lambda: _new_future())
    completed: asyncio.Future[None] = field(default_factory=lambda: _new_future())
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # P/D (sim/zp_sim/pd.py): the request's kv_transfer_params, and the answer's (a prefill's)
    kv_in: dict[str, Any] | None = None
    kv_out: dict[str, Any] | None = None
    kv_hold: bool = False

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    def notify(self, first: bool = False, completed: bool = False) -> None:
        self.changed.set()
        if (first or completed) and not self.first.done():
            self.first.set_result(None)
        if completed and not self.completed.done():
            self.completed.set_result(None)


# ----------------------------------------------------------------------------------------------
# the simulator core (engine loop, clock, metrics); the Starlette app is a thin shell around it


class _Sim:
    def __init__(
        self,
        profile: StepProfile,
        *,
        num_gpu_blocks: int | None,
        speedup: float,
        gateway_timeout_s: float | None,
        policy: str,
        model: str,
        seed: int,
        enable_prefix_caching: bool,
        max_num_seqs: int | None,
        max_num_batched_tokens: int | None,
        max_model_len: int | None,
        timeline_interval_s: float,
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        role: str | None = None,
        kv_lease_s: float = DEFAULT_KV_LEASE_S,
        kv_transfer_s_per_block: float | None = None,
        long_prefill_token_threshold: int | None = None,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        for name, limit in (("max_num_queued_reqs", max_num_queued_reqs),
                            ("max_num_queued_tokens", max_num_queued_tokens)):
            if limit is not None and limit < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {limit}")
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        # vLLM's API-server view of the prefill backlog: the full prompt length of every request that
        # has no output token yet (waiting, or running a partial prefill), by engine id.
        self._prefilling: dict[str, int] = {}
        self._prefill_tokens = 0
        overrides: dict[str, Any] = {"policy": policy, "enable_prefix_caching": enable_prefix_caching}
        for key, value in (("num_gpu_blocks", num_gpu_blocks), ("max_num_seqs", max_num_seqs),
                           ("max_num_batched_tokens", max_num_batched_tokens)):
            if value is not None:
                overrides[key] = value
        blocks = num_gpu_blocks if num_gpu_blocks is not None else profile.num_gpu_blocks
        mml = max_model_len if max_model_len is not None else profile.max_model_len
        # vLLM refuses to start when one max_model_len request cannot fit the pool; the simulator
        # instead lowers max_model_len so any admitted request can always run alone (no livelock).
        capacity = (blocks - 1) * profile.block_size
        if mml > capacity:
            logger.warning("max_model_len %d exceeds the KV pool (%d usable blocks = %d tokens); "
                           "using max_model_len=%d", mml, blocks - 1, capacity, capacity)
            mml = capacity
        overrides["max_model_len"] = mml
        if kv_transfer_s_per_block is not None:
            overrides["kv_transfer_s_per_block"] = kv_transfer_s_per_block
        if long_prefill_token_threshold is not None:
            overrides["long_prefill_token_threshold"] = long_prefill_token_threshold
        self.profile = profile
        self.config = EngineConfig.from_profile(profile, **overrides)
        self.engine = Engine(self.config)
        self.kv = KVRole(role, lease_s=kv_lease_s, seed=seed)
        self.kv.bind(self.engine, self.clock)
        self.max_model_len = mml
        self.num_gpu_blocks = blocks
        self.block_size = profile.block_size
        self.speedup = float(speedup)
        self.gateway_timeout_s = gateway_timeout_s
        self.policy = policy
        self.model = model
        self.seed = seed
        self.enable_prefix_caching = enable_prefix_caching
        self.timeline_interval_s = timeline_interval_s
        self.timeline: list[tuple[float, float, int, int, int]] = []
        self.records: dict[str, _Record] = {}
        self._pending: dict[str, tuple[_Pending, int]] = {}  # engine id -> (pending, choice index)
        self._arrivals = 0
        self._requests_seen = 0  # numbers the server's own request ids (deterministic, unlike uuid4)
        # The event loop's clock: monotonic time under a normal loop, virtual time under the storm's
        # virtual-time loop (which then runs with speedup 1). Bound in start(); wall-clock
        # self-measurement (compute time, busy time) always uses perf_counter.
        self._time: Any = time.monotonic
        self._real0 = self._time()
        self._virt0 = 0.0
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.loop_error: BaseException | None = None
        self.counts = {"requests": 0, "finished": 0, "aborted_disconnect": 0, "gateway_504": 0,
                       "errors_4xx": 0,
                       "rejected_queue_full": 0}
        self.lag_s = 0.0
        self.max_lag_s = 0.0
        self._lag_sum = 0.0
        self.lagging = False
        self._lag_warned = False
        self.real_steps = 0
        self.real_busy_s = 0.0  # real seconds spent in engine.step() (compute)
        self.busy_wall_s = 0.0  # real seconds during which the engine had work
        self._busy_since: float | None = None
        # GET /metrics by scraper: the X-ZP-Poller header's value -> [scrapes, first, last] (virtual s),
        # so a test can count how many adaptive-limit controllers poll (docs/simulator.md)
        self.metrics_pollers: dict[str, list[float]] = {}
        self.metrics_scrapes = 0  # every GET /metrics, with or without the header
        self._setup_metrics()

    # -- clock ---------------------------------------------------------------------------------
    def _mapped(self, real: float | None = None) -> float:
        return self._virt0 + ((self._time() if real is None else real) - self._real0) * self.speedup

    def clock(self) -> float:
        """Virtual seconds now: the engine's clock while busy, real time x speedup while idle."""
        if self.engine.has_unfinished():
            return float(self.engine.now)
        return max(float(self.engine.now), self._mapped())

    # -- engine loop ---------------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._time = loop.time
        self._real0 = loop.time()
        self._wake = asyncio.Event()
        wake = self._wake
        # a freed prefill (read or aborted, from a decode server's loop: maybe another thread's) may
        # unblock a step
        def wake_soon() -> None:
            if not loop.is_closed():  # a stopped server's loop: nothing to wake
                loop.call_soon_threadsafe(wake.set)

        self.kv.wake = wake_soon
        self._loop_task = loop.create_task(self._run_loop(), name="zp-sim-engine")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    async def _run_loop(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        last_yield = time.perf_counter()
        try:
            while True:
                kv_next = self.kv.tick() if self.kv.role is not None else None
                if not self.engine.has_unfinished():
                    if self._busy_since is not None:
                        self.busy_wall_s += time.perf_counter() - self._busy_since
                        self._busy_since = None
                    self._wake.clear()
                    if kv_next is None:
                        await self._wake.wait()
                    else:  # a prefill's lease may expire meanwhile
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._wake.wait(), max(0.0, self._real_at(kv_next)
                                                                          - self._time()))
                        continue
                    self._busy_since = time.perf_counter()
                    continue
                t0 = time.perf_counter()
                out = self.engine.step()
                t1 = time.perf_counter()
                self.real_steps += 1
                self.real_busy_s += t1 - t0
                self._sample(out)
                if out.step is None and (out.kv_loading or out.kv_loaded):
                    self._deliver(out)  # KV events of a step that computed nothing
                if out.scheduled_tokens == 0 and out.end_time <= out.start_time:
                    ready = self.engine.next_kv_ready()
                    if ready is not None:
                        # only KV transfers in flight: the engine idles until the first one lands
                        wake_at = ready if kv_next is None else min(ready, kv_next)
                        self._wake.clear()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._wake.wait(),
                                                   max(0.0, self._real_at(wake_at) - self._time()))
                        self.engine.advance_idle(min(ready, max(self.engine.now, self._mapped())))
                        continue
                    # nothing schedulable (a prefill pool full of KV held for transfers; else it should
                    # not happen with max_model_len <= pool): wait for a change instead of spinning.
                    # The engine idles meanwhile: its clock follows the wall clock, as vLLM's does
                    # (without this, the steps after the wait would run "in the past", back to back).
                    self._wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.05)
                    self.engine.advance_idle(max(self.engine.now, self._mapped()))
                    continue
                deadline = self._real0 + (out.end_time - self._virt0) / self.speedup
                now = self._time()
                self.lag_s = max(0.0, (now - deadline) * self.speedup)
                self._lag_sum += self.lag_s
                if self.lag_s > self.max_lag_s:
                    self.max_lag_s = self.lag_s
                if self.lag_s > LAG_WARN_S:
                    self.lagging = True
                    if not self._lag_warned:
                        self._lag_warned = True
                        logger.warning("simulator cannot keep up with speedup %.3g: the engine is %.3f "
                                       "virtual s behind its real-time schedule (lower --speedup)",
                                       self.speedup, self.lag_s)
                if deadline > now:
                    await sleep_until(loop, deadline)  # at the step's end exactly: no float drift
                    last_yield = time.perf_counter()
                elif time.perf_counter() - last_yield > _MAX_UNYIELDED_S:
                    # behind schedule: run steps back to back, yielding to the HTTP side only every
                    # few ms (a yield costs a poll syscall, which would otherwise dominate)
                    await asyncio.sleep(0)
                    last_yield = time.perf_counter()
                self._deliver(out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the server turns unhealthy (503 on /health) and says why
            self.loop_error = exc
            logger.exception("simulator engine loop died")
            for pending, _ in list(self._pending.values()):
                pending.notify(completed=True)
            raise

    def _real_at(self, virtual: float) -> float:
        """The loop time at which virtual time ``virtual`` is reached (the inverse of _mapped)."""
        return self._real0 + (virtual - self._virt0) / self.speedup

    def _sample(self, out: Any) -> None:
        st = self.engine.stats
        if (self.timeline and self.timeline_interval_s > 0
                and out.end_time - self.timeline[-1][0] < self.timeline_interval_s):
            return
        self.timeline.append((float(out.end_time), float(out.kv_usage), int(st.preemptions_total),
                              int(out.num_running), int(out.num_waiting)))

    def _deliver(self, out: Any) -> None:
        t = float(out.end_time)
        for eid in out.kv_loaded:
            self.kv.loaded(eid)  # read: its prefill server frees the blocks
        if out.step is None:
            return
        for eid in out.scheduled:
            entry = self._pending.get(eid)
            if entry is not None and entry[0].record.first_scheduled is None:
                entry[0].record.first_scheduled = float(out.start_time)
                with contextlib.suppress(KeyError):
                    entry[0].record.cached_tokens = self.engine.cached_tokens(eid)
        for eid in out.first_token:
            self._prefill_done(eid)
            entry = self._pending.get(eid)
            if entry is None:
                continue
            pending, _ = entry
            rec = pending.record
            if rec.first_token is None:
                rec.first_token = t
                self._ttft.observe(t - rec.arrival)
        for eid, n in out.new_tokens.items():
            entry = self._pending.get(eid)
            if entry is None or n <= 0:
                continue
            pending, idx = entry
            choice = pending.choices[idx]
            last = pending.last_token_t.get(idx)
            if last is not None:
                self._itl.observe(t - last)
            pending.last_token_t[idx] = t
            pending.record.token_times.append(t)
            choice.generated += n
            pending.notify(first=True)
        for eid in out.finished:
            self._prefill_done(eid)
            entry = self._pending.pop(eid, None)
            if entry is None:
                continue
            pending, idx = entry
            choice = pending.choices[idx]
            choice.finished = True
            if pending.kv_hold and idx == 0:
                blocks = self.engine.held_block_ids(eid)
                pending.kv_out = self.kv.held_now(eid, len(pending.prompt_ids), blocks)
            pending.notify(completed=pending.done)
            if pending.done:
                self._finish_record(pending.record, t, "finished")

    def _finish_record(self, rec: _Record, t: float, status: str) -> None:
        rec.finish = t
        rec.status = status
        rec.preemptions = sum(self._engine_preemptions(eid) for eid in rec.engine_ids)
        for eid in rec.engine_ids:  # the server keeps its own record; let the engine drop its own
            self.engine.forget(eid)
        labels = (self.model, "0")
        if status == "finished":
            self.counts["finished"] += 1
            self.h_e2e.labels(*labels).observe(t - rec.arrival)
            if rec.first_scheduled is not None:
                self.h_queue.labels(*labels).observe(max(0.0, rec.first_scheduled - rec.arrival))

    def _engine_record(self, eid: str) -> Any:
        try:
            return self.engine.request_record(eid)
        except KeyError:  # the engine drops records of aborted (forgotten) requests
            return None

    @staticmethod
    def _get(obj: Any, name: str) -> Any:
        if obj is None:
            return None
        if isinstance(obj, Mapping):
            return obj.get(name)
        return getattr(obj, name, None)

    def _engine_preemptions(self, eid: str) -> int:
        r = self._engine_record(eid)
        for name in ("num_preemptions", "preemptions"):
            v = self._get(r, name)
            if v is not None:
                return int(v)
        return 0

    # -- admission -------------------------------------------------------------------------------
    def submit(self, pending: _Pending, priority: int) -> None:
        if self.loop_error is not None:
            raise _HTTPError(503, f"the simulated engine is dead: {self.loop_error!r}",
                             "ServiceUnavailableError")
        pull = self.kv.peer_for(pending.kv_in) if self.kv.role == "decode" else None
        pending.kv_hold = self.kv.wants_hold(pending.kv_in) and len(pending.choices) == 1
        try:
            self._check_admission(len(pending.choices))
        except _HTTPError:
            if pull is not None:  # a decode server that rejects tells its prefill server to free
                pull[0].free(pull[1], "aborted")
            raise
        if pull is not None and len(pending.choices) != 1:
            pull[0].free(pull[1], "aborted")
            pull = None
        if not self.engine.has_unfinished():
            t = self._mapped()
            if t > self.engine.now:
                self.engine.advance_idle(t)
        arrival = float(self.engine.now)
        pending.record.arrival = arrival
        self.records[pending.record.engine_ids[0]] = pending.record  # unique even when X-Request-Id repeats
        for choice in pending.choices:
            try:
                self.engine.add_request(choice.engine_id, pending.prompt_ids, choice.target,
                                        priority=priority, output_token_ids=choice.token_ids,
                                        hold_kv=pending.kv_hold, remote_kv=pull is not None)
                if pull is not None:
                    self.kv.pulling(choice.engine_id, *pull)
            except ValueError as exc:
                self.abort(pending, "aborted")
                raise _HTTPError(400, str(exc)) from None
            self._pending[choice.engine_id] = (pending, choice.index)
            self._prefilling[choice.engine_id] = len(pending.prompt_ids)
            self._prefill_tokens += len(pending.prompt_ids)
        self.counts["requests"] += 1
        assert self._wake is not None
        self._wake.set()

    def _check_admission(self, n: int) -> None:
        """vLLM's ``AsyncLLM.check_admission``: 503 when the ``n`` new engine requests would push the
        in-flight count (waiting + running) past ``max_num_queued_reqs``, or when the prefill backlog
        already holds ``max_num_queued_tokens`` prompt tokens (the request count is checked first)."""
        if self.max_num_queued_reqs is not None and len(self._pending) + n > self.max_num_queued_reqs:
            self.counts["rejected_queue_full"] += 1
            raise _HTTPError(503, QUEUE_OVERFLOW_MESSAGE, _ADMISSION_ERROR_TYPE)
        if self.max_num_queued_tokens is not None and self._prefill_tokens >= self.max_num_queued_tokens:
            self.counts["rejected_queue_full"] += 1
            raise _HTTPError(503, MAX_QUEUED_TOKENS_MESSAGE, _ADMISSION_ERROR_TYPE)

    def _prefill_done(self, eid: str) -> None:
        self._prefill_tokens -= self._prefilling.pop(eid, 0)

    def abort(self, pending: _Pending, status: str) -> None:
        """Abort every unfinished choice of ``pending`` (idempotent)."""
        aborted = False
        for choice in pending.choices:
            self._prefill_done(choice.engine_id)
            self.kv.dropped(choice.engine_id)  # a decode pull not landed yet: its prefill frees now
            if self._pending.pop(choice.engine_id, None) is not None:
                self.engine.abort(choice.engine_id)
                aborted = True
        if aborted:
            self._finish_record(pending.record, self.clock(), status)
            if status == "gateway_timeout":
                self.counts["gateway_504"] += 1
            else:
                self.counts["aborted_disconnect"] += 1
            assert self._wake is not None
            self._wake.set()

    def next_request_id(self, header: str | None) -> str:
        """The request's id: the client's ``X-Request-Id`` as vLLM takes it (retries may repeat one), or
        one derived from the seed and a counter, so that virtual-time runs repeat exactly."""
        self._requests_seen += 1
        if header:
            return header
        digest = hashlib.blake2b(f"{self.seed}:{self._requests_seen}".encode(), digest_size=16).hexdigest()
        return digest

    def next_rng(self, body_seed: Any) -> random.Random:
        self._arrivals += 1
        if isinstance(body_seed, int) and not isinstance(body_seed, bool):
            return random.Random(body_seed)
        return random.Random(f"{self.seed}:{self._arrivals}")

    # -- stats / metrics -------------------------------------------------------------------------
    def stats(self, with_requests: bool = False) -> dict[str, Any]:
        st = self.engine.stats
        names = ("num_running", "num_waiting", "kv_usage", "preemptions_total", "recomputed_tokens",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "steps")
        engine_stats = {n: getattr(st, n, None) for n in names}
        busy = self.busy_wall_s
        if self._busy_since is not None:
            busy += time.perf_counter() - self._busy_since
        out: dict[str, Any] = {
            "model": self.model,
            "profile": self.profile.name,
            "clock_s": self.clock(),
            "speedup": self.speedup,
            "num_gpu_blocks": self.num_gpu_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "policy": self.policy,
            "long_prefill_token_threshold": self.config.long_prefill_token_threshold,
            "gateway_timeout_s": self.gateway_timeout_s,
            "engine": engine_stats,
            "lag_s": self.lag_s,
            "max_lag_s": self.max_lag_s,
            "mean_lag_s": self._lag_sum / self.real_steps if self.real_steps else 0.0,
            "lag_warn_s": LAG_WARN_S,
            "lagging": self.lagging,
            "real_steps": self.real_steps,
            "real_step_compute_s": self.real_busy_s,
            "real_busy_s": busy,
            "steps_per_real_s": self.real_steps / busy if busy > 0 else None,
            "in_flight": len({id(p) for p, _ in self._pending.values()}),
            **self.counts,
        }
        if self.kv.role is not None:
            out["kv"] = {**self.kv.stats(), "pulled_blocks_total": st.kv_pulled_blocks_total,
                         "engine_held_blocks": st.kv_held_blocks}
        if with_requests:
            out["requests"] = [self._record_json(r) for r in self.records.values()]
        return out

    def note_scrape(self, poller: str | None) -> None:
        """Count one ``GET /metrics``; with an ``X-ZP-Poller`` header, per poller (first and last time)."""
        self.metrics_scrapes += 1
        if not poller:
            return
        now = self.clock()
        rec = self.metrics_pollers.get(poller[:200])
        if rec is None:
            if len(self.metrics_pollers) >= 10_000:  # bounded: a scraper that invents ids is not tracked
                return
            self.metrics_pollers[poller[:200]] = [1, now, now]
        else:
            rec[0] += 1
            rec[2] = now

    def pollers(self) -> dict[str, Any]:
        """``{"scrapes": n, "pollers": {id: {"polls", "first_s", "last_s"}}}`` (``GET /sim/pollers``)."""
        return {"scrapes": self.metrics_scrapes, "clock_s": self.clock(),
                "pollers": {k: {"polls": int(v[0]), "first_s": v[1], "last_s": v[2]}
                            for k, v in self.metrics_pollers.items()}}

    def _record_json(self, r: _Record) -> dict[str, Any]:
        if r.status == "running":
            r.preemptions = sum(self._engine_preemptions(e) for e in r.engine_ids)
        return {"id": r.request_id, "kind": r.kind, "status": r.status, "arrival_s": r.arrival,
                "first_token_s": r.first_token, "finish_s": r.finish, "prompt_tokens": r.prompt_tokens,
                "max_tokens": r.max_tokens, "output_tokens": r.output_tokens, "priority": r.priority,
                "first_scheduled_s": r.first_scheduled, "num_preemptions": r.preemptions,
                "cached_tokens": r.cached_tokens}

    def _setup_metrics(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ln = ["model_name", "engine"]
        self.h_ttft = Histogram("vllm:time_to_first_token_seconds",
                                "Histogram of time to first token in seconds.",
                                ln, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.h_itl = Histogram("vllm:inter_token_latency_seconds",
                               "Histogram of inter-token latency in seconds.",
                               ln, buckets=_ITL_BUCKETS, registry=self.registry)
        self.h_e2e = Histogram("vllm:e2e_request_latency_seconds",
                               "Histogram of e2e request latency in seconds.", ln, buckets=_LATENCY_BUCKETS,
                               registry=self.registry)
        self.h_queue = Histogram("vllm:request_queue_time_seconds",
                                 "Histogram of time spent in WAITING phase for request.", ln,
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(self))
        self._ttft = self.h_ttft.labels(self.model, "0")
        self._itl = self.h_itl.labels(self.model, "0")

    def cache_config_labels(self) -> dict[str, str]:
        # vLLM's CacheConfig.metrics_info(): every field as a string, plus the engine index
        return {
            "block_size": str(self.block_size),
            "gpu_memory_utilization": "0.92",
            "swap_space": "4",
            "cache_dtype": "auto",
            "is_attention_free": "False",
            "num_gpu_blocks_override": "None",
            "sliding_window": "None",
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "prefix_caching_hash_algo": "sha256",
            "cpu_offload_gb": "0",
            "calculate_kv_scales": "False",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_cpu_blocks": "None",
            "kv_sharing_fast_prefill": "False",
            "engine": "0",
        }


class _EngineCollector:
    """Reads the engine's counters at scrape time (gauges and counters keyed like vLLM's)."""

    def __init__(self, sim: _Sim) -> None:
        self.sim = sim

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        sim = self.sim
        st = sim.engine.stats
        ln = ["model_name", "engine"]
        lv = [sim.model, "0"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=ln)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=ln)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    st.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    st.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", st.kv_usage)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      st.preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      st.generation_tokens_total)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      st.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      st.prefix_cache_hits_total)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*ln, "finished_reason"])
        success.add_metric([*lv, "stop"], sim.counts["finished"])
        yield success
        if sim.kv.role is not None:
            yield counter("vllm:nixl_num_kv_expired_reqs",
                          "Number of requests that had their KV expire (the decode side never read it).",
                          sim.kv.counts["kv_expired"])
            xs = sim.kv.xfer_times
            h = HistogramMetricFamily("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for "
                                      "NIXL KV cache transfers.", labels=ln)
            bounds = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
            h.add_metric(lv, [(str(b), float(sum(1 for x in xs if x <= b))) for b in bounds]
                         + [("+Inf", float(len(xs)))], sum_value=float(sum(xs)))
            yield h
        labels = sim.cache_config_labels()
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(labels))
        info.add_metric(list(labels.values()), 1.0)
        yield info


# ----------------------------------------------------------------------------------------------
# request parsing and output shaping


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _HTTPError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    return value


def _schema_value(schema: Any, name: str, rng: random.Random, depth: int = 0) -> Any:
    if not isinstance(schema, Mapping):
        return "value"
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _schema_value(schema[key][0], name, rng, depth)
    typ = schema.get("type", "string")
    if isinstance(typ, list):
        typ = next((t for t in typ if t != "null"), "string")
    if typ == "integer":
        lo = schema.get("minimum", 1)
        return int(lo) + rng.randrange(10)
    if typ == "number":
        return round(float(schema.get("minimum", 0)) + rng.random() * 10, 2)
    if typ == "boolean":
        return True
    if typ == "array":
        return [_schema_value(schema.get("items", {}), name, rng, depth + 1)] if depth < 3 else []
    if typ == "object":
        return _object_from_schema(schema, rng, depth + 1) if depth < 3 else {}
    if typ == "null":
        return None
    return f"{name} {tok.decode(rng.randrange(tok.VOCAB_SIZE) for _ in range(2)).strip()}"


def _object_from_schema(schema: Mapping[str, Any], rng: random.Random, depth: int = 0) -> dict[str, Any]:
    props = schema.get("properties") or {}
    required = schema.get("required")
    keys = [k for k in props if k in required] if isinstance(required, list) and required else list(props)
    return {k: _schema_value(props[k], k, rng, depth) for k in keys}


def _pick_tool(body: Mapping[str, Any], messages: Sequence[Any]) -> Mapping[str, Any] | None:
    tools = body.get("tools") or []
    if not tools:
        return None
    choice = body.get("tool_choice", "auto")
    fns: list[Mapping[str, Any]] = [t.get("function", t) for t in tools if isinstance(t, Mapping)]
    if not fns:
        return None
    if choice == "none":
        return None
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        for fn in fns:
            if fn.get("name") == name:
                return fn
        raise _HTTPError(400, f"tool_choice names function {name!r}, which is not in 'tools'",
                         param="tool_choice")
    if choice == "required":
        return fns[0]
    # "auto": answer a user turn with a tool call, a tool result with text (agent loops terminate)
    last = messages[-1] if messages else {}
    return fns[0] if isinstance(last, Mapping) and last.get("role") == "user" else None


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _App:
    def __init__(self, sim: _Sim) -> None:
        self.sim = sim

    # -- helpers ---------------------------------------------------------------------------------
    async def _json(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise _HTTPError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, "the request body must be a JSON object")
        return body

    def _check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.sim.model:
            raise _HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _check_len(self, n_prompt: int) -> None:
        mml = self.sim.max_model_len
        if n_prompt >= mml:
            raise _HTTPError(
                400,
                f"This model's maximum context length is {mml} tokens. However, your prompt contains "
                f"{n_prompt} input tokens. Please reduce the length of the input messages.",
            )

    def _build(self, body: dict[str, Any], kind: str, prompt_ids: list[int],
               tool: Mapping[str, Any] | None, header_id: str | None = None) -> _Pending:
        sim = self.sim
        n_prompt = len(prompt_ids)
        self._check_len(n_prompt)
        max_tokens = _int_field(body, "max_completion_tokens") if kind == "chat" else None
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens")
        room = sim.max_model_len - n_prompt
        if max_tokens is not None and max_tokens < 1:
            raise _HTTPError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        bound = room if max_tokens is None else min(max_tokens, room)
        n = _int_field(body, "n") or 1
        if n < 1 or n > 64:
            raise _HTTPError(400, f"n must be between 1 and 64, got {n}.", param="n")
        true_len = _int_field(body, "sim_output_tokens")
        if true_len is not None and true_len < 1:
            raise _HTTPError(400, f"sim_output_tokens must be at least 1, got {true_len}.",
                             param="sim_output_tokens")
        priority = _int_field(body, "priority") or 0
        rng = sim.next_rng(body.get("seed"))
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{sim.next_request_id(header_id)}"
        # engine ids are "<request id>-<choice>"; a repeated X-Request-Id (a retry) gets a serial number
        engine_base = request_id
        if f"{request_id}-0" in sim.records:
            engine_base = f"{request_id}#{sim._requests_seen}"
        choices: list[_Choice] = []
        for i in range(n):
            call: tuple[str, str] | None = None
            natural: int
            if tool is not None:
                args = json.dumps(_object_from_schema(tool.get("parameters") or {}, rng))
                call = (str(tool.get("name", "tool")), args)
                rendered = json.dumps({"name": call[0], "parameters": json.loads(args)})
                natural = max(1, tok.count_tokens(rendered))
            else:
                natural = max(1, int(round(rng.lognormvariate(math.log(DEFAULT_OUTPUT_MEDIAN),
                                                              DEFAULT_OUTPUT_SIGMA))))
            if body.get("ignore_eos"):
                target = bound
            elif true_len is not None:
                target = min(true_len, bound)
            else:
                target = min(natural, bound)
            # deterministic output text: ids derived from the prompt and the choice index
            # (a multiplicative sequence from a stable hash: cheap even for thousands of tokens)
            key = f"{len(prompt_ids)}:{prompt_ids[-8:]}:{i}:{body.get('seed')}".encode()
            base = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            ids = [(base + 2_654_435_761 * k) % tok.VOCAB_SIZE for k in range(1, target + 1)]
            choices.append(_Choice(index=i, engine_id=f"{engine_base}-{i}", target=target,
                                   bound=bound, token_ids=ids, tool_call=call))
        record = _Record(request_id=request_id, engine_ids=[c.engine_id for c in choices], kind=kind,
                         prompt_tokens=n_prompt, max_tokens=bound,
                         output_tokens=sum(c.target for c in choices),
                         priority=priority, arrival=0.0)
        pending = _Pending(request_id=request_id, kind=kind, created=int(time.time()), model=sim.model,
                           prompt_ids=prompt_ids, choices=choices, record=record, kv_in=kv_params(body))
        sim.submit(pending, priority)
        return pending

    def _usage(self, pending: _Pending) -> dict[str, int]:
        completion = sum(c.generated for c in pending.choices)
        return {"prompt_tokens": len(pending.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(pending.prompt_ids) + completion}

    @staticmethod
    def _args_piece(choice: _Choice, start: int, end: int) -> str:
        """The part of a tool call's arguments belonging to output tokens [start, end)."""
        assert choice.tool_call is not None
        args = choice.tool_call[1]
        total = max(1, choice.target)
        a = len(args) * start // total
        b = len(args) if end >= total else len(args) * end // total
        return args[a:b]

    async def _wait_event(self, request: Request, target: asyncio.Future[None], until: float | None) -> str:
        """Wait for ``target`` (first token or completion) while watching the client.

        Returns "ready", "disconnect" or "timeout" (``until`` is a real monotonic deadline).
        """
        if target.done():
            return "ready"
        disc = asyncio.ensure_future(self._watch_disconnect(request))
        try:
            timeout = None if until is None else max(0.0, until - self.sim._time())
            done, _ = await asyncio.wait({target, disc}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if target in done:
                return "ready"
            return "disconnect" if disc in done else "timeout"
        finally:
            disc.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await disc

    @staticmethod
    async def _watch_disconnect(request: Request) -> None:
        # After the body is read, the next ASGI receive() returns only when the client goes away.
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    def _deadline(self) -> float | None:
        g = self.sim.gateway_timeout_s
        return None if g is None else self.sim._time() + g / self.sim.speedup

    # -- completions -----------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _HTTPError(400, "'messages' must be a non-empty list", param="messages")
            tools = body.get("tools")
            try:
                text = tok.render_chat(messages, tools=tools or None, add_generation_prompt=True)
            except (ValueError, AttributeError, TypeError) as exc:
                raise _HTTPError(400, f"invalid 'messages': {exc}", param="messages") from None
            tool = _pick_tool(body, messages)
            pending = self._build(body, "chat", tok.encode(text), tool, request.headers.get("x-request-id"))
        except _HTTPError as exc:
            if exc.status < 500:
                self.sim.counts["errors_4xx"] += 1
            return exc.response()
        return await self._respond(request, body, pending)

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = tok.encode(prompt, add_special_tokens=True)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise _HTTPError(400, "'prompt' must be a string or a list of token ids (the simulator "
                                      "serves one prompt per request; send a batch as separate requests)",
                                 param="prompt")
            pending = self._build(body, "completion", ids, None, request.headers.get("x-request-id"))
        except _HTTPError as exc:
            if exc.status < 500:
                self.sim.counts["errors_4xx"] += 1
            return exc.response()
        return await self._respond(request, body, pending)

    async def _respond(self, request: Request, body: Mapping[str, Any], pending: _Pending) -> Response:
        stream = bool(body.get("stream"))
        outcome = await self._wait_event(request, pending.first if stream else pending.completed,
                                         self._deadline())
        if outcome == "disconnect":
            self.sim.abort(pending, "aborted")
            return Response(status_code=499)
        if outcome == "timeout":
            self.sim.abort(pending, "gateway_timeout")
            return Response(_GATEWAY_504_BODY, status_code=504, media_type="text/html")
        if self.sim.loop_error is not None:
            self.sim.abort(pending, "aborted")
            return _error(503, f"the simulated engine is dead: {self.sim.loop_error!r}",
                          "ServiceUnavailableError")
        if not stream:
            return JSONResponse(self._full_body(pending))
        opts = body.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) if isinstance(opts, Mapping) else False
        # vLLM's should_include_usage: continuous stats only take effect with include_usage
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        return StreamingResponse(self._stream(pending, include_usage, continuous),
                                 media_type="text/event-stream")

    def _full_body(self, pending: _Pending) -> dict[str, Any]:
        choices = []
        for c in pending.choices:
            if pending.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [],
                                       "reasoning_content": None}
                if c.tool_call:
                    msg["tool_calls"] = [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function",
                                          "function": {"name": c.tool_call[0], "arguments": c.tool_call[1]}}]
                else:
                    msg["content"] = tok.decode(c.token_ids[:c.generated])
                choices.append({"index": c.index, "message": msg, "logprobs": None,
                                "finish_reason": c.finish_reason, "stop_reason": None})
            else:
                choices.append({"index": c.index, "text": tok.decode(c.token_ids[:c.generated]),
                                "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": None})
        out = {"id": pending.request_id,
               "object": "chat.completion" if pending.kind == "chat" else "text_completion",
               "created": pending.created, "model": pending.model, "choices": choices,
               "usage": self._usage(pending)}
        if pending.kv_out is not None:
            out["kv_transfer_params"] = pending.kv_out  # a prefill server's answer (vLLM's NixlConnector)
        return out

    async def _stream(self, pending: _Pending, include_usage: bool,
                      continuous: bool = False) -> AsyncIterator[bytes]:
        chat = pending.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        sent = [0] * len(pending.choices)
        role_sent = [False] * len(pending.choices)
        finished_sent = [False] * len(pending.choices)
        tool_ids = [f"chatcmpl-tool-{uuid.uuid4().hex[:16]}" for _ in pending.choices]

        prompt_len = len(pending.prompt_ids)

        def chunk(choice_obj: dict[str, Any], completion: int = 0) -> bytes:
            data: dict[str, Any] = {"id": pending.request_id, "object": obj, "created": pending.created,
                                    "model": pending.model, "choices": [choice_obj]}
            if continuous:
                # vLLM (continuous_usage_stats): every chunk carries the usage so far, its completion
                # tokens counted for the chunk's own choice; the role chunk has 0
                data["usage"] = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + completion,
                                 "completion_tokens": completion}
            elif include_usage:
                data["usage"] = None
            return _sse(data)

        def pieces() -> list[bytes]:
            out: list[bytes] = []
            for c in pending.choices:
                i = c.index
                if chat and not role_sent[i] and c.generated > 0:
                    role_sent[i] = True
                    out.append(chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}))
                if c.generated > sent[i]:
                    a, b = sent[i], c.generated
                    sent[i] = b
                    if chat and c.tool_call:
                        call: dict[str, Any] = {"index": 0,
                                                "function": {"arguments": self._args_piece(c, a, b)}}
                        if a == 0:
                            call.update(id=tool_ids[i], type="function")
                            call["function"]["name"] = c.tool_call[0]
                        delta: dict[str, Any] = {"tool_calls": [call]}
                    else:
                        delta = {"content": tok.decode(c.token_ids[a:b])}
                    if chat:
                        out.append(chunk({"index": i, "delta": delta, "logprobs": None,
                                          "finish_reason": None}, b))
                    else:
                        out.append(chunk({"index": i, "text": delta["content"], "logprobs": None,
                                          "finish_reason": None}, b))
                if c.finished and not finished_sent[i] and sent[i] >= c.generated:
                    finished_sent[i] = True
                    if chat:
                        out.append(chunk({"index": i, "delta": {}, "logprobs": None,
                                          "finish_reason": c.finish_reason, "stop_reason": None}, sent[i]))
                    else:
                        out.append(chunk({"index": i, "text": "", "logprobs": None,
                                          "finish_reason": c.finish_reason, "stop_reason": None}, sent[i]))
            return out

        try:
            while True:
                # clear before taking the snapshot: progress made while the pieces are being sent
                # sets the event again, so nothing is lost
                pending.changed.clear()
                for piece in pieces():
                    yield piece
                if pending.done or self.sim.loop_error is not None:
                    break
                await pending.changed.wait()
            if include_usage:
                yield _sse({"id": pending.request_id, "object": obj, "created": pending.created,
                            "model": pending.model, "choices": [], "usage": self._usage(pending)})
            yield b"data: [DONE]\n\n"
        finally:
            # a disconnect cancels this generator (or closes it unfinished): free the blocks now
            if not pending.done:
                self.sim.abort(pending, "aborted")

    # -- the rest of the surface -----------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                messages = body.get("messages")
                if not isinstance(messages, list):
                    raise _HTTPError(400, "'messages' must be a list", param="messages")
                try:
                    gen = bool(body.get("add_generation_prompt", True))
                    text = tok.render_chat(messages, tools=body.get("tools") or None,
                                           add_generation_prompt=gen)
                except (ValueError, AttributeError, TypeError) as exc:
                    raise _HTTPError(400, f"invalid 'messages': {exc}", param="messages") from None
                ids = tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise _HTTPError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
                ids = tok.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
        except _HTTPError as exc:
            return exc.response()
        return JSONResponse({"count": len(ids), "max_model_len": self.sim.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise _HTTPError(400, "'tokens' must be a list of integers", param="tokens")
            try:
                text = tok.decode(ids)
            except ValueError as exc:
                raise _HTTPError(400, str(exc), param="tokens") from None
        except _HTTPError as exc:
            return exc.response()
        return JSONResponse({"prompt": text})

    async def models(self, request: Request) -> Response:
        card = {"id": self.sim.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.sim.model, "parent": None, "max_model_len": self.sim.max_model_len,
                "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.sim.loop_error is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        self.sim.note_scrape(request.headers.get("x-zp-poller"))
        return Response(generate_latest(self.sim.registry), media_type=CONTENT_TYPE_LATEST)

    async def sim_stats(self, request: Request) -> Response:
        q = request.query_params
        out = self.sim.stats(q.get("requests", "0") not in ("0", "", "false"))
        if q.get("timeline", "0") not in ("0", "", "false"):  # the KV / preemption samples, one per step
            out["timeline"] = [list(t) for t in self.sim.timeline]
        return JSONResponse(out)

    async def sim_pollers(self, request: Request) -> Response:
        return JSONResponse(self.sim.pollers())

    async def sim_clock(self, request: Request) -> Response:
        return JSONResponse({"clock_s": self.sim.clock(), "speedup": self.sim.speedup,
                             "lag_s": self.sim.lag_s, "lagging": self.sim.lagging})

    async def not_found(self, request: Request) -> Response:
        return PlainTextResponse("Not Found", status_code=404)


def build_app(sim: _Sim) -> Starlette:
    """The Starlette app for a simulator core (the engine loop must be started separately)."""
    a = _App(sim)
    routes = [
        Route("/v1/chat/completions", a.chat, methods=["POST"]),
        Route("/v1/completions", a.completions, methods=["POST"]),
        Route("/tokenize", a.tokenize, methods=["POST"]),
        Route("/detokenize", a.detokenize, methods=["POST"]),
        Route("/v1/models", a.models, methods=["GET"]),
        Route("/health", a.health, methods=["GET"]),
        Route("/metrics", a.metrics, methods=["GET"]),
        Route("/sim/stats", a.sim_stats, methods=["GET"]),
        Route("/sim/clock", a.sim_clock, methods=["GET"]),
        Route("/sim/pollers", a.sim_pollers, methods=["GET"]),
    ]
    return Starlette(routes=routes)


# ----------------------------------------------------------------------------------------------
# the public handle


class SimServer:
    """A simulated vLLM server on 127.0.0.1 (uvicorn in-process).

    ``async with SimServer(...) as s`` runs it on the current event loop; ``with SimServer(...) as s``
    (or :meth:`start_in_thread` / :meth:`stop`) runs it on a background thread for synchronous code.
    ``num_gpu_blocks`` etc. default to the profile's values; ``gateway_timeout_s`` (virtual seconds)
    turns on the gateway emulation; ``port=0`` picks a free port. ``role`` (``"prefill"`` /
    ``"decode"``, with ``kv_lease_s`` and ``kv_transfer_s_per_block``): a P/D server, see
    :mod:`zp_sim.pd`. ``long_prefill_token_threshold``: vLLM's cap on one request's prefill
    tokens per step (0: off).
    """

    def __init__(
        self,
        profile: str | StepProfile = "tiny",
        *,
        num_gpu_blocks: int | None = None,
        speedup: float = 1.0,
        gateway_timeout_s: float | None = None,
        policy: str = "fcfs",
        port: int = 0,
        host: str = "127.0.0.1",
        model: str = "sim-llama",
        seed: int = 0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        timeline_interval_s: float = 0.0,
        log_level: str = "warning",
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
        role: str | None = None,
        kv_lease_s: float = DEFAULT_KV_LEASE_S,
        kv_transfer_s_per_block: float | None = None,
        long_prefill_token_threshold: int | None = None,
    ) -> None:
        self._config: dict[str, Any] = {
            "profile": profile, "num_gpu_blocks": num_gpu_blocks, "speedup": speedup,
            "gateway_timeout_s": gateway_timeout_s, "policy": policy, "port": port, "host": host,
            "model": model,
            "seed": seed, "enable_prefix_caching": enable_prefix_caching, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
            "timeline_interval_s": timeline_interval_s, "log_level": log_level,
            "max_num_queued_reqs": max_num_queued_reqs, "max_num_queued_tokens": max_num_queued_tokens,
            "role": role, "kv_lease_s": kv_lease_s, "kv_transfer_s_per_block": kv_transfer_s_per_block,
            "long_prefill_token_threshold": long_prefill_token_threshold}
        prof = get_profile(profile) if isinstance(profile, str) else profile
        self._sim = _Sim(prof, num_gpu_blocks=num_gpu_blocks, speedup=speedup,
                         gateway_timeout_s=gateway_timeout_s, policy=policy, model=model, seed=seed,
                         enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         timeline_interval_s=timeline_interval_s, max_num_queued_reqs=max_num_queued_reqs,
                         max_num_queued_tokens=max_num_queued_tokens, role=role, kv_lease_s=kv_lease_s,
                         kv_transfer_s_per_block=kv_transfer_s_per_block,
                         long_prefill_token_threshold=long_prefill_token_threshold)
        self._sim.kv.host = host
        self.app = build_app(self._sim)
        self._host = host
        self._port = port
        self._log_level = log_level
        self._uvicorn: Any = None
        self._serve_task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self.killed_at: float | None = None
        """Virtual seconds when :meth:`kill` ran, or None."""

    def config_kwargs(self) -> dict[str, Any]:
        """The constructor's arguments, to build the same server elsewhere (another process)."""
        return dict(self._config)

    @property
    def speedup(self) -> float:
        return self._sim.speedup

    # -- facts -------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:PORT`` (``/metrics``, ``/tokenize``, ``/sim/stats``)."""
        return f"http://{self._host}:{self._port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return self.url + "/v1"

    @property
    def model(self) -> str:
        return self._sim.model

    @property
    def engine(self) -> Engine:
        return self._sim.engine

    @property
    def max_model_len(self) -> int:
        return self._sim.max_model_len

    @property
    def num_gpu_blocks(self) -> int:
        return self._sim.num_gpu_blocks

    @property
    def timeline(self) -> list[tuple[float, float, int, int, int]]:
        return self._sim.timeline

    def clock(self) -> float:
        """Virtual seconds now."""
        return self._sim.clock()

    def allocated_blocks(self) -> int:
        """The engine's referenced blocks now (:attr:`~zp_sim.engine.Engine.allocated_blocks`)."""
        return int(self._sim.engine.allocated_blocks)

    def stats(self, requests: bool = False) -> dict[str, Any]:
        """What ``GET /sim/stats`` returns."""
        return self._sim.stats(requests)

    def pollers(self) -> dict[str, Any]:
        """Who read ``/metrics``: what ``GET /sim/pollers`` returns (scrapes, and per ``X-ZP-Poller``
        header value the polls and the first and last time, virtual seconds)."""
        return self._sim.pollers()

    # -- async lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        import uvicorn

        from zp_sim._uvicorn import PromptExitServer

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        self._port = sock.getsockname()[1]
        self._sim.kv.host, self._sim.kv.port = self._host, self._port
        config = uvicorn.Config(self.app, log_level=self._log_level, lifespan="off", access_log=False,
                                timeout_graceful_shutdown=1)
        self._uvicorn = PromptExitServer(config)
        self._sim.start()
        self._serve_task = asyncio.get_running_loop().create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the startup error
                raise RuntimeError("the simulator's HTTP server stopped during startup")
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.exit_now()  # uvicorn itself looks at should_exit every 0.1 s
        if self._serve_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._serve_task
            self._serve_task = None
        await self._sim.stop()

    @contextlib.asynccontextmanager
    async def in_memory(self, host: str = "sim.memory") -> AsyncIterator[SimServer]:
        """Run the engine on the current event loop without a socket: callers reach :attr:`app` as an
        ASGI app in memory (the storm's virtual-time runs do, through a streaming in-memory transport).
        :attr:`url` becomes ``http://HOST:80`` (default ``sim.memory``), a name only such a transport
        resolves (several servers in one run need distinct hosts: ``sim-0.memory``, ...)."""
        self._host, self._port = host, 80
        self._sim.kv.host, self._sim.kv.port = host, 80
        self._sim.start()
        try:
            yield self
        finally:
            await self._sim.stop()

    async def kill(self) -> int:
        """Die abruptly (the storm's ``--kill-replica``): stop the engine (its KV blocks are gone with it)
        and, when serving HTTP, close the listening socket and abort every open connection (a reset, no
        drain; best effort on uvicorn's internals). Returns the connections aborted. An in-memory server's
        connections are the transport's to reset (:meth:`zp_client.testing.MemoryNetwork.kill`)."""
        if self.killed_at is None:
            self.killed_at = self._sim.clock()
        aborted = 0
        if self._uvicorn is not None:
            for srv in list(getattr(self._uvicorn, "servers", None) or []):
                srv.close()
            state = getattr(self._uvicorn, "server_state", None)
            for conn in list(getattr(state, "connections", None) or []):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()
                    aborted += 1
            self._uvicorn.should_exit = True
        await self._sim.stop()
        return aborted

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def wait_closed(self) -> None:
        """Wait until the HTTP server stops (Ctrl-C / SIGTERM when run by ``zp-client sim``)."""
        if self._serve_task is not None:
            await asyncio.shield(self._serve_task)

    # -- thread lifecycle ---------------------------------------------------------------------------
    def start_in_thread(self) -> SimServer:
        """Run the server on a background thread with its own event loop; returns once it listens."""
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stopped = asyncio.Event()
            try:
                await self.start()
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread, which re-raises it
                failure.append(exc)
                ready.set()
                return
            ready.set()
            try:
                await self._stopped.wait()
            finally:
                await self.aclose()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._thread_loop = loop
            try:
                loop.run_until_complete(main())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"zp-sim-{id(self):x}", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def stop(self) -> None:
        """Stop a server started with :meth:`start_in_thread` (waits for the thread to end)."""
        if self._thread is None:
            return
        loop, stopped = self._thread_loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopped.set)
        self._thread.join(timeout=30)
        self._thread = None

    def __enter__(self) -> SimServer:
        return self.start_in_thread()

    def __exit__(self, *exc: object) -> None:
        self.stop()

