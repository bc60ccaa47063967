"""One table of attempt-loop scenarios, run three ways: the sans-I/O core driven by hand (no I/O at all),
and the same rows through the blocking and the async transports (httpx, and httpx2 where installed).

Each row scripts what the upstream answers per attempt and says what the caller must see: how many
attempts (leases) there were, the retry sleeps, the final status or error, and that no block leaked.
Time is a fake clock shared by the core (deadlines) and the retry policy's sleeps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anyio
import httpx
import pytest

from zp_client._admission.actions import (
    Acquire,
    Close,
    Decide,
    Done,
    NewRetryState,
    Release,
    Send,
    Sleep,
)
from zp_client._admission.core import Core
from zp_client._admission.httplib import HTTPX
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import DeadlineExceeded
from zp_client.retry import RetryPolicy
from zp_client.transport import transport_classes

try:
    import httpx2
except ImportError:  # openai 2.x environments have no httpx2
    httpx2 = None

LIBS: list[ModuleType] = [httpx] + ([httpx2] if httpx2 is not None else [])
URL = "http://upstream.test/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
SSE_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
BACKOFF_MAX = 0.1


class Cancelled(BaseException):
    """Stands for a cancellation (a BaseException, as anyio's and KeyboardInterrupt are)."""


@dataclass
class Row:
    name: str
    upstream: list[Any]
    """Per attempt: a status code, (status, headers), "connect-error" or "stream-breaks"."""
    attempts: int
    outcome: int | type[BaseException]
    """The status the caller gets, or the error it gets (from the call or, streamed, from reading)."""
    sleeps: list[float | None] = field(default_factory=list)
    """Each retry sleep: its exact length (a Retry-After), or None for a jittered backoff."""
    deadline_s: float | None = None
    oversleep_s: float = 0.0
    """Extra fake time that passes in each sleep (a loaded machine)."""
    cancel_in_backoff: bool = False
    stream: bool = False
    delivered: bytes = b""
    """What the caller read before the outcome (a stream)."""


TABLE = [
    Row("429 with Retry-After is retried after it", [(429, {"retry-after-ms": "300"}), 200], 2, 200, [0.3]),
    Row("503 is retried with backoff", [503, 200], 2, 200, [None]),
    Row("a connect error is retried", ["connect-error", 200], 2, 200, [None]),
    Row("400 is not retried", [400], 1, 400),
    Row("500 is not retried", [500], 1, 500),
    Row("max attempts ends it with the last answer", [503, 503, 503], 3, 503, [None, None]),
    Row("a retry that does not fit the deadline is not tried",
        [(429, {"retry-after-ms": "300"}), (429, {"retry-after-ms": "300"}), 200], 2, DeadlineExceeded,
        [0.3], deadline_s=1.0),
    Row("the deadline passing during the backoff stops the next attempt",
        [(429, {"retry-after-ms": "300"}), 200], 1, DeadlineExceeded, [0.3], deadline_s=1.0, oversleep_s=1.0),
    Row("cancellation during the backoff propagates, lease already released",
        [(429, {"retry-after-ms": "300"}), 200], 1, Cancelled, [0.3], cancel_in_backoff=True),
    Row("bytes already delivered: a broken stream is not retried",
        ["stream-breaks", 200], 1, httpx.ReadError, stream=True, delivered=SSE_CHUNK),
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds

    def sleep_sync(self, seconds: float) -> None:
        self.now += seconds


class TablePolicy(RetryPolicy):
    """The default rules (no retry budget), sleeping in fake time and recording each sleep."""

    def __init__(self, clock: FakeClock, row: Row, *, is_async: bool) -> None:
        super().__init__(budget=None, backoff_initial_s=BACKOFF_MAX, backoff_max_s=BACKOFF_MAX)
        self.clock, self.row, self.is_async = clock, row, is_async
        self.slept: list[float] = []

    def _slept(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.clock.now += seconds + self.row.oversleep_s
        if self.row.cancel_in_backoff:
            raise asyncio.CancelledError() if self.is_async else Cancelled()

    async def sleep(self, seconds: float) -> None:
        self._slept(seconds)

    def sleep_sync(self, seconds: float) -> None:
        self._slept(seconds)


class Recorder:
    """A LocalBudget that records each acquire's ticket; ``used`` says whether a block leaked."""

    def __init__(self) -> None:
        self.budget = LocalBudget(1000, 16)
        self.tickets: list[Any] = []
        real_async, real_sync = self.budget.acquire, self.budget.acquire_sync

        async def acquire(blocks: int, **kw: Any) -> Any:
            lease = await real_async(blocks, **kw)
            self.tickets.append(lease.ticket)
            return lease

        def acquire_sync(blocks: int, **kw: Any) -> Any:
            lease = real_sync(blocks, **kw)
            self.tickets.append(lease.ticket)
            return lease

        self.budget.acquire = acquire  # type: ignore[method-assign]
        self.budget.acquire_sync = acquire_sync  # type: ignore[method-assign]


def _breaking_body(mod: ModuleType, is_async: bool) -> Any:
    """A body that delivers one SSE chunk, then the connection breaks (the library wraps the iterator
    in its own stream class)."""
    if is_async:
        async def agen() -> AsyncIterator[bytes]:
            yield SSE_CHUNK
            raise mod.ReadError("connection reset")

        return agen()

    def gen() -> Iterator[bytes]:
        yield SSE_CHUNK
        raise mod.ReadError("connection reset")

    return gen()


class Upstream:
    """The scripted server: one entry of the row per request it receives."""

    def __init__(self, mod: ModuleType, row: Row, *, is_async: bool) -> None:
        self.mod, self.row, self.is_async = mod, row, is_async
        self.requests: list[Any] = []
        self.last_body = b""

    def __call__(self, request: Any) -> Any:
        self.requests.append(request)
        spec = self.row.upstream[len(self.requests) - 1]
        mod = self.mod
        if spec == "connect-error":
            raise mod.ConnectError("connection refused", request=request)
        if spec == "stream-breaks":
            body = _breaking_body(mod, self.is_async)
            return mod.Response(200, headers={"content-type": "text/event-stream"}, content=body)
        status, headers = spec if isinstance(spec, tuple) else (spec, {})
        payload = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
        if status != 200:
            payload = {"error": {"message": f"status {status}", "attempt": len(self.requests)}}
        self.last_body = json.dumps(payload).encode()
        return mod.Response(status, headers=headers, content=self.last_body)


def _settings() -> Settings:
    # pool_check off: each row scripts every upstream request of the attempt loop, and the pool check's one
    # GET /metrics is not part of it (tests/estimate/test_pool_check.py covers that read).
    return Settings(estimator="heuristic", max_model_len=4096, stream_upstream=False, pool_check=False)


def _headers(row: Row) -> dict[str, str]:
    return {"X-ZP-Deadline": str(row.deadline_s)} if row.deadline_s is not None else {}


def _check(row: Row, rec: Recorder, policy: TablePolicy, upstream: Upstream, outcome: Any,
           delivered: bytes) -> None:
    assert len(upstream.requests) == row.attempts
    assert len(rec.tickets) == row.attempts and len(set(rec.tickets)) == 1  # one ticket: keeps its place
    assert len(policy.slept) == len(row.sleeps)
    for slept, expected in zip(policy.slept, row.sleeps, strict=True):
        if expected is None:
            assert 0 <= slept <= BACKOFF_MAX
        else:
            assert slept == pytest.approx(expected)
    if isinstance(row.outcome, int):
        assert outcome == row.outcome
    else:
        assert isinstance(outcome, row.outcome), outcome
    # the caller reads exactly what the server sent last (a stream: up to where it broke)
    expected = row.delivered if row.stream else upstream.last_body if isinstance(outcome, int) else b""
    assert delivered == expected
    assert rec.budget.status_sync().used == 0  # every lease released, whatever happened


# --------------------------------------------------------------------------------------------------
# 1. the core alone: the test is the driver, every action performed by hand in memory
# --------------------------------------------------------------------------------------------------


def _perform(action: Any, rec: Recorder, upstream: Upstream) -> Any:
    if isinstance(action, Acquire):
        return rec.budget.acquire_sync(action.blocks, **action.kwargs())
    if isinstance(action, Send):
        return upstream(action.request)
    if isinstance(action, Release):
        return action.holder.release_sync()
    if isinstance(action, NewRetryState):
        return action.policy.new_request()
    if isinstance(action, Decide):
        return action.policy.decide(action.state, **action.kwargs())
    if isinstance(action, Sleep):
        return action.policy.sleep_sync(action.seconds)
    if isinstance(action, Close):
        return action.response.close()
    raise AssertionError(f"unexpected action {action!r}")


@pytest.mark.parametrize("row", TABLE, ids=lambda r: r.name)
def test_core_without_io(row: Row) -> None:
    clock, rec = FakeClock(), Recorder()
    policy = TablePolicy(clock, row, is_async=False)
    upstream = Upstream(httpx, row, is_async=False)
    core = Core(rec.budget, _settings(), None, policy, lib=HTTPX, clock=clock)
    request = httpx.Request("POST", URL, json={**BODY, "stream": row.stream}, headers=_headers(row))
    request.read()
    machine = core.admit(request, None, is_async=False)
    outcome: Any = None
    delivered = b""
    try:
        step = machine.start()
        while not isinstance(step, Done):
            try:
                result = _perform(step, rec, upstream)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, as a driver does
                step = machine.throw(exc)
            else:
                step = machine.send(result)
        response = step.response
        outcome = response.status_code
        for chunk in response.iter_bytes():
            delivered += chunk
    except (Exception, Cancelled) as exc:  # noqa: BLE001 - the outcome the row asserts on
        outcome = exc
    _check(row, rec, policy, upstream, outcome, delivered)


# --------------------------------------------------------------------------------------------------
# 2. the same rows through the transports
# --------------------------------------------------------------------------------------------------


def _sync_run(mod: ModuleType, row: Row) -> None:
    clock, rec = FakeClock(), Recorder()
    policy = TablePolicy(clock, row, is_async=False)
    upstream = Upstream(mod, row, is_async=False)
    cls = transport_classes(mod).AdmissionTransport
    transport = cls(mod.MockTransport(upstream), budget=rec.budget, settings=_settings(), retry=policy,
                    clock=clock)
    outcome: Any = None
    delivered = b""
    with mod.Client(transport=transport) as client:
        try:
            with client.stream("POST", URL, content=json.dumps({**BODY, "stream": row.stream}),
                               headers=_headers(row)) as response:
                outcome = response.status_code
                for chunk in response.iter_bytes():
                    delivered += chunk
        except (Exception, Cancelled) as exc:  # noqa: BLE001 - the outcome the row asserts on
            outcome = exc
    _check(row, rec, policy, upstream, outcome, delivered)


async def _async_run(mod: ModuleType, row: Row) -> None:
    clock, rec = FakeClock(), Recorder()
    policy = TablePolicy(clock, row, is_async=True)
    upstream = Upstream(mod, row, is_async=True)
    cls = transport_classes(mod).AsyncAdmissionTransport
    transport = cls(mod.MockTransport(upstream), budget=rec.budget, settings=_settings(), retry=policy,
                    clock=clock)
    outcome: Any = None
    delivered = b""
    async with mod.AsyncClient(transport=transport) as client:
        try:
            async with client.stream("POST", URL, content=json.dumps({**BODY, "stream": row.stream}),
                                     headers=_headers(row)) as response:
                outcome = response.status_code
                async for chunk in response.aiter_bytes():
                    delivered += chunk
        except (Exception, asyncio.CancelledError) as exc:  # noqa: BLE001 - the outcome the row asserts on
            outcome = Cancelled() if isinstance(exc, asyncio.CancelledError) else exc
    _check(row, rec, policy, upstream, outcome, delivered)


def _outcome_for(mod: ModuleType, row: Row) -> Row:
    # The row names httpx's ReadError; through httpx2 the same failure is httpx2's.
    if row.outcome is httpx.ReadError and mod is not httpx:
        return Row(**{**row.__dict__, "outcome": mod.ReadError})
    return row


@pytest.mark.parametrize("mod", LIBS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("row", TABLE, ids=lambda r: r.name)
def test_sync_transport(mod: ModuleType, row: Row) -> None:
    _sync_run(mod, _outcome_for(mod, row))


@pytest.mark.parametrize("mod", LIBS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("row", TABLE, ids=lambda r: r.name)
def test_async_transport(mod: ModuleType, row: Row) -> None:
    anyio.run(_async_run, mod, _outcome_for(mod, row))


# --------------------------------------------------------------------------------------------------
# the idle-stream watchdog reads the injected clock too
# --------------------------------------------------------------------------------------------------


def test_the_idle_watchdog_measures_idleness_on_the_core_clock() -> None:
    import threading
    import time

    clock, rec = FakeClock(), Recorder()
    more = threading.Event()

    def body() -> Iterator[bytes]:
        yield SSE_CHUNK
        more.wait(10)  # the server would send more; the caller never asks

    def handler(request: Any) -> Any:
        if not request.url.path.endswith("/chat/completions"):  # the pool check's /metrics: no such page
            return httpx.Response(404)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    settings = Settings(estimator="heuristic", max_model_len=4096, idle_stream_timeout_s=0.2)
    transport = transport_classes(httpx).AdmissionTransport(httpx.MockTransport(handler), budget=rec.budget,
                                                            settings=settings, retry=False, clock=clock)
    with httpx.Client(transport=transport) as client, client.stream(
        "POST", URL, content=json.dumps({**BODY, "stream": True})
    ) as response:
        chunks = response.iter_raw()
        assert next(chunks) == SSE_CHUNK
        time.sleep(0.5)  # real time passes, the core's clock does not: not idle
        assert rec.budget.status_sync().used > 0
        clock.now += 1.0  # now it is
        deadline = time.monotonic() + 5
        while rec.budget.status_sync().used > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rec.budget.status_sync().used == 0
        more.set()
