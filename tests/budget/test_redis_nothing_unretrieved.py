"""RedisBudget's async face never leaves an exception nobody retrieves.

``AsyncFace._warm_renewals`` pings the renewal client's connections under a time bound. With
``asyncio.wait_for(asyncio.gather(...))`` a bound that fired (a stalled Redis) or a keeper cancelled at
``aclose()`` left the gather's future holding a ``CancelledError`` nobody read: asyncio logged
"_GatheringFuture exception was never retrieved" when the garbage collector met it, and on CPython 3.11
that log line (its traceback formatting parses source with ``ast``) could run inside another
``ast.parse`` of the same thread and break it with "SystemError: AST constructor recursion depth
mismatch" (gh-106905): CI failed that way in an unrelated test. Likewise an acquire's script call (its own
task, awaited through ``asyncio.shield``) that failed after its caller was cancelled.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from zp_client.budget.redis import _async

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


class _HungRedis:
    """A renewal client whose every call waits forever (a SIGSTOPped Redis); counts the pings."""

    def __init__(self) -> None:
        self.pings = 0

    async def ping(self) -> bool:
        self.pings += 1
        await asyncio.Event().wait()
        return True


def _face(client: _HungRedis) -> Any:
    return SimpleNamespace(renew_client=client, core=SimpleNamespace(name="warm"))


def _never_retrieved(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if "never retrieved" in r.getMessage()]


async def test_a_warm_up_that_runs_out_of_time_leaves_nothing_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _HungRedis()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        await _async.AsyncFace._warm_renewals(_face(client), 0.05)  # returns: the bound fired
        await asyncio.sleep(0)
        gc.collect()
    assert client.pings == _async.RENEW_POOL_SIZE  # every connection was tried at once
    assert _never_retrieved(caplog.records) == []


async def test_a_warm_up_cancelled_at_close_leaves_nothing_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = _HungRedis()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        task = asyncio.ensure_future(_async.AsyncFace._warm_renewals(_face(client), 60.0))
        while client.pings < _async.RENEW_POOL_SIZE:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        gc.collect()
    assert _never_retrieved(caplog.records) == []


async def test_a_call_whose_caller_was_cancelled_leaves_nothing_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An acquire's script call runs as its own task, awaited through ``asyncio.shield``; when the caller
    was cancelled and the call then fails (Redis unreachable), nobody awaits it but ``_undo_after``'s
    ``asyncio.wait``, which does not read the exception."""
    gate = asyncio.Event()

    async def failing_eval(script: str, args: Any, **kw: Any) -> Any:
        await gate.wait()
        raise ConnectionError("Redis went away")

    face = SimpleNamespace(loop=asyncio.get_running_loop(), eval=failing_eval)
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        call = _async.AsyncFace._start(face, "acquire", [])
        caller = asyncio.ensure_future(asyncio.shield(call))
        await asyncio.sleep(0)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        gate.set()
        await asyncio.wait({call})  # what _undo_after does: the outcome is not raised
        assert call.done() and not call.cancelled()  # it failed, and nobody awaited it
        del call
        gc.collect()
    assert _never_retrieved(caplog.records) == []
