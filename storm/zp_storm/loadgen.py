"""The load generator: replays a workload's sessions through one client setup, in virtual time.

Arrivals are open loop (each session starts at its virtual ``start_s`` whatever the server does);
turns within a session are closed loop (the next turn waits for the previous one, its think time and
its sub-agents). Every timestamp is read from a :class:`VirtualClock` (the simulator's clock), never
the harness's wall clock.

The generator also measures itself: an event-loop lag sampler and the process's CPU use against wall
time (:class:`HarnessMonitor`), so a run whose harness could not keep up is flagged instead of trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from zp_client.clock import real_monotonic
from zp_storm.workloads import Session, Turn

__all__ = [
    "Caller",
    "ClientLoad",
    "HarnessMonitor",
    "LoopTimeClock",
    "RequestRecord",
    "VirtualClock",
    "run_sessions",
    "stream_chat",
]

log = logging.getLogger("zp_storm.loadgen")


class VirtualClock:
    """Virtual time from a ``now()`` callable (e.g. ``SimServer.clock``), and sleeps measured in it.

    ``speedup`` is virtual seconds per wall second, used only to size the wall-clock naps; a sleep
    always ends by re-reading ``now()``, so a lagging simulator lengthens the nap instead of skewing it.
    """

    def __init__(self, now: Callable[[], float], speedup: float) -> None:
        self._now = now
        self.speedup = float(speedup)

    def now(self) -> float:
        return float(self._now())

    async def sleep_until(self, t: float) -> None:
        while True:
            d = t - self.now()
            if d <= 0:
                return
            await asyncio.sleep(max(d / self.speedup, 0.0005))

    async def sleep(self, dt: float) -> None:
        if dt > 0:
            await self.sleep_until(self.now() + dt)


class LoopTimeClock(VirtualClock):
    """The running event loop's clock as a :class:`VirtualClock`: on the storm's virtual-time loop, the
    virtual time every client and the simulator share; a sleep ends at its deadline exactly."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        super().__init__(loop.time, 1.0)
        self._loop = loop

    async def sleep_until(self, t: float) -> None:
        if t > self._loop.time():
            from zp_sim.server import sleep_until  # the simulator's own: the same landing rule

            await sleep_until(self._loop, t)


@dataclass
class RequestRecord:
    """What the app observed for one logical request (virtual seconds, relative to the run's start)."""

    id: str
    session: str
    kind: str
    prompt_tokens: int
    max_tokens: int
    true_out: int
    t_submit: float | None = None
    t_first: float | None = None
    t_end: float | None = None
    out_tokens: int = 0
    attempts: int = 0
    ok: bool = False
    error: str | None = None
    sent: bool = False  # False: its conversation had stopped after an earlier error
    stream: bool = True
    bypass: bool = False
    """Sent straight to the server around the setup's zp budget (``--bypass``, :mod:`.bypass`)."""
    slo_class: str | None = None
    """The request's class (:attr:`~zp_storm.workloads.Turn.slo_class`), scored against its own
    SLO; None: the workload's one class."""
    root: str = ""
    """The id of the top-level session (conversation) the request belongs to (its own session for a
    top-level turn; the parent conversation for a sub-agent's)."""
    token_times: list[float] = field(default_factory=list, repr=False)
    cut_streams: int = field(default=0, repr=False)
    """Attempts whose stream delivered content to the caller and then failed (a connection reset, a
    gateway cut); not in :meth:`to_json` (the records' JSON is unchanged), reported by fleet storms."""

    @property
    def ttft(self) -> float | None:
        if self.t_first is None or self.t_submit is None:
            return None
        return self.t_first - self.t_submit

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two chunks)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    def itls(self) -> list[float]:
        tt = self.token_times
        return [b - a for a, b in zip(tt, tt[1:], strict=False)]

    def to_json(self) -> dict[str, Any]:
        extra = {} if self.slo_class is None else {"class": self.slo_class}
        return {**extra,
            "id": self.id, "session": self.session, "kind": self.kind,
            "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens, "true_out": self.true_out,
            # full precision: two runs of one seed on the virtual clock give equal floats
            "t_submit": self.t_submit, "t_first": self.t_first, "t_end": self.t_end,
            "ttft": self.ttft, "tpot": self.tpot, "out_tokens": self.out_tokens,
            "attempts": self.attempts, "ok": self.ok, "error": self.error, "sent": self.sent,
            "stream": self.stream, "bypass": self.bypass,
        }


class Caller(Protocol):
    """A client setup's way of making one logical request (its retries included).

    It must fill ``rec.attempts``, ``rec.token_times`` (virtual time of each content chunk of the
    attempt that succeeded), ``rec.out_tokens`` and ``rec.t_first``, and raise on a failure surfaced to
    the app.
    """

    async def __call__(self, turn: Turn, rec: RequestRecord, clock: VirtualClock) -> None: ...


async def stream_chat(client: Any, model: str, turn: Turn, rec: RequestRecord, clock: VirtualClock,
                      **extra: Any) -> None:
    """One streamed chat completion through an openai-style ``client``; stamps chunks in virtual time.

    ``max_tokens`` is the client's bound; the true output length travels in ``sim_output_tokens``.
    """
    times: list[float] = []
    usage_tokens: int | None = None
    body = {"sim_output_tokens": turn.true_out, **extra.pop("extra_body", {})}
    # the server's request id (vLLM takes X-Request-Id): its records join the client's by it
    headers = {"X-Request-Id": rec.id}
    if turn.priority is not None:  # zp's transport reads (and strips) it; other setups' servers ignore it
        headers["X-ZP-Priority"] = str(turn.priority)
    extra["extra_headers"] = {**headers, **extra.get("extra_headers", {})}
    if not turn.stream:
        resp = await client.chat.completions.create(
            model=model, messages=turn.messages, max_tokens=turn.max_tokens, extra_body=body, **extra)
        rec.t_first = clock.now()
        rec.token_times = []
        rec.out_tokens = resp.usage.completion_tokens if resp.usage is not None else 0
        return
    # The stream is read from the raw response (openai's own request, retries and status errors) and
    # parsed here as openai's Stream does, minus its per-chunk pydantic models: those were half the CPU
    # of a fleet storm, and the CPU never shows in virtual time (the records are the same).
    async with client.chat.completions.with_streaming_response.create(
        model=model, messages=turn.messages, max_tokens=turn.max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body=body, **extra,
    ) as response:
        try:
            async for chunk in _sse_chunks(response):
                choices = chunk.get("choices")
                if choices and (choices[0].get("delta") or {}).get("content"):
                    times.append(clock.now())
                usage = chunk.get("usage")
                if usage is not None:
                    usage_tokens = usage.get("completion_tokens")
        except Exception:
            if times:  # content had reached the caller: a cut stream
                rec.cut_streams += 1
            raise
    rec.token_times = times
    rec.t_first = times[0] if times else clock.now()
    rec.out_tokens = usage_tokens if usage_tokens is not None else len(times)


def _http_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(timeouts, request errors) of the HTTP libraries loaded, as openai's Stream maps them."""
    import ssl

    mods = [m for m in (sys.modules.get("httpx"), sys.modules.get("httpx2")) if m is not None]
    return (tuple(m.TimeoutException for m in mods),
            (*(m.RequestError for m in mods), ssl.SSLError, anyio.EndOfStream))


async def _sse_chunks(response: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an openai streaming response, with openai's Stream semantics: ``[DONE]`` ends
    the content (the rest of the body is drained), a chunk carrying ``error`` raises ``openai.APIError``,
    a timeout or a transport error while reading raises ``APITimeoutError`` / ``APIConnectionError``
    (errors that are already openai's, such as zp's ``StreamCut`` through ``wrap()``, pass unchanged)."""
    import openai

    timeouts, request_errors = _http_errors()
    done = False
    try:
        async for line in response.iter_lines():
            if done or not line.startswith("data:"):
                continue
            data = line[5:].lstrip()
            if data.startswith("[DONE]"):
                done = True
                continue
            chunk = json.loads(data)
            if isinstance(chunk, dict) and chunk.get("error"):
                error = chunk["error"]
                message = error.get("message") if isinstance(error, dict) else None
                if not message or not isinstance(message, str):
                    message = "An error occurred during streaming"
                raise openai.APIError(message=message, request=response.http_request, body=error)
            yield chunk
    except openai.OpenAIError:
        raise
    except timeouts as err:
        raise openai.APITimeoutError(request=response.http_request) from err
    except request_errors as err:
        raise openai.APIConnectionError(request=response.http_request) from err


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    name = type(exc).__name__
    return f"{name} {status}" if status is not None else name


async def run_sessions(
    sessions: list[Session],
    caller: Caller,
    clock: VirtualClock,
    *,
    t0: float,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    """Replay ``sessions`` through ``caller``; returns one record per logical request of the workload
    (requests of a conversation that stopped after an error are returned with ``sent=False``).

    Times in the records are relative to ``t0`` (a reading of ``clock``).
    """
    records: list[RequestRecord] = []

    def unsent(session: Session, from_turn: int, root: str) -> None:
        for k, turn in enumerate(session.turns[from_turn:], start=from_turn):
            rec = RequestRecord(f"{session.id}/t{k}", session.id, session.kind, turn.prompt_tokens,
                                turn.max_tokens, turn.true_out, error="conversation stopped",
                                slo_class=turn.slo_class, root=root)
            records.append(rec)
            if on_done:
                on_done(rec)
            for child in turn.children:
                unsent(child, 0, root)

    async def run_session(session: Session, start: float | None, root: str = "") -> None:
        root = root or session.id
        if start is not None:
            await clock.sleep_until(t0 + start)
        for k, turn in enumerate(session.turns):
            if turn.delay_s:
                await clock.sleep(turn.delay_s)
            rec = RequestRecord(f"{session.id}/t{k}", session.id, session.kind, turn.prompt_tokens,
                                turn.max_tokens, turn.true_out, sent=True, stream=turn.stream,
                                slo_class=turn.slo_class, root=root)
            records.append(rec)
            rec.t_submit = clock.now()
            try:
                await caller(turn, rec, clock)
                rec.ok = True
            except Exception as exc:  # an error surfaced to the app: the conversation stops here
                rec.error = _describe(exc)
                log.debug("request %s failed", rec.id, exc_info=True)
            rec.t_end = clock.now()
            _relativise(rec, t0)
            if on_done:
                on_done(rec)
            if not rec.ok:
                for child in turn.children:
                    unsent(child, 0, root)
                unsent(session, k + 1, root)
                return
            if turn.children:
                async with anyio.create_task_group() as tg:
                    for child in turn.children:
                        tg.start_soon(run_session, child, None, root)

    async with anyio.create_task_group() as tg:
        for s in sessions:
            tg.start_soon(run_session, s, s.start_s)
    return records


def _relativise(rec: RequestRecord, t0: float) -> None:
    if rec.t_submit is not None:
        rec.t_submit -= t0
    if rec.t_first is not None:
        rec.t_first -= t0
    if rec.t_end is not None:
        rec.t_end -= t0
    rec.token_times = [t - t0 for t in rec.token_times]


class ClientLoad:
    """A deliberately busy client: blocks the event loop's thread in ``burst_s`` (50 ms) bursts at duty
    cycle ``fraction``, spinning (so it holds the GIL, like application work: JSON, tool calls, prompt
    building), from ``__aenter__`` to ``__aexit__``. Real time only: on a virtual clock a burst takes
    no time at all."""

    def __init__(self, fraction: float, burst_s: float = 0.05) -> None:
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"client load must be in [0, 1), got {fraction!r}")
        self.fraction = float(fraction)
        self.burst_s = float(burst_s)
        self.bursts = 0
        self.busy_s = 0.0
        """Real seconds spent blocking (for the report)."""
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ClientLoad:
        if self.fraction > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # the burner we just cancelled
                await self._task

    async def _run(self) -> None:
        idle = self.burst_s * (1.0 - self.fraction) / self.fraction
        while True:
            await asyncio.sleep(idle)
            start = real_monotonic()
            end = start + self.burst_s
            while real_monotonic() < end:  # spin: a sleep would let the loop's other tasks run
                pass
            self.bursts += 1
            self.busy_s += real_monotonic() - start


class HarnessMonitor:
    """Measures the harness itself while a setup runs: event-loop lag and process CPU against wall.

    ``lag`` samples are how late a 10 ms nap woke up (wall seconds). CPU is ``os.times()`` user +
    system of this process (all its threads, the in-process simulator included) over the wall time.
    """

    def __init__(self, interval_s: float = 0.01, *, sample_lag: bool = True) -> None:
        self.interval_s = interval_s
        self.sample_lag = sample_lag
        """False on a virtual-time loop: a nap there wakes exactly on time whatever the CPU does."""
        self.lags: list[float] = []
        self._wall0 = self._cpu0 = 0.0
        self.wall_s = self.cpu_s = 0.0
        self._stopped: tuple[float, float] | None = None
        self._task: asyncio.Task[None] | None = None
        self.workers: list[dict[str, float]] = []
        """Self-measurements of worker processes (zp-redis), each like :meth:`summary`."""

    def mark(self) -> None:
        """Start measuring wall and CPU time from now (the run's t0, after setup work)."""
        self._wall0 = real_monotonic()
        t = os.times()
        self._cpu0 = t.user + t.system

    def stop(self) -> None:
        """Stop the wall and CPU clocks (the run's last request ended; teardown is not measured)."""
        if self._stopped is None:
            t = os.times()
            self._stopped = (real_monotonic() - self._wall0, t.user + t.system - self._cpu0)

    async def __aenter__(self) -> HarnessMonitor:
        self._stopped = None
        self.mark()
        if self.sample_lag:
            self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):  # the sampler we just cancelled
                await self._task
        self.stop()
        assert self._stopped is not None
        self.wall_s, self.cpu_s = self._stopped

    async def _sample(self) -> None:
        while True:
            t = real_monotonic()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, real_monotonic() - t - self.interval_s))

    def summary(self) -> dict[str, Any]:
        lags = sorted(self.lags) or [0.0]
        out: dict[str, Any] = {
            "wall_s": round(self.wall_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "cpu_frac": round(self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else 0.0,
            "loop_lag_p50_ms": round(1000 * lags[len(lags) // 2], 2),
            "loop_lag_p99_ms": round(1000 * lags[min(len(lags) - 1, math.ceil(0.99 * len(lags)) - 1)], 2),
            "loop_lag_max_ms": round(1000 * lags[-1], 2),
        }
        if self.workers:
            out["workers"] = self.workers
        return out

