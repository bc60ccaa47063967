"""The one clock the library reads: monotonic time and sleeping, injectable.

Nothing else in :mod:`zp_client` calls :func:`time.monotonic` or :func:`time.time` (tests/test_layout.py
checks): the admission core, local budgets, the retry policy and retry budgets, and the idle-stream
watchdog's idle test ask the :class:`Clock` they were given, by default :data:`SYSTEM_CLOCK`. Three
places use :data:`SYSTEM_CLOCK` itself, on purpose: :class:`~zp_client.RedisBudget` (its leases expire on
the Redis server's clock, which no client can move), the server-facts cache's 30 s back-off after a
failed ``GET models``, and the watchdog thread's own wake-ups (real seconds; under a virtual clock it
can only act on a stream its caller stopped reading for ``idle_stream_timeout_s`` virtual seconds,
which the storm never does). A :class:`~zp_client.LocalBudget` made
with ``clock=`` hands that clock to every transport, retry policy and retry budget built on it, so one
argument moves a whole client onto another clock; :class:`LoopClock` is the running asyncio loop's
clock, which is virtual under :mod:`zp_client.testing`'s virtual-time loop (see
docs/benchmark.md#virtual-time). Public (``zp_client.clock``): an application's tests, the storm
benchmark and the framework integrations pass a clock without reaching into a private module.
See docs/admission.md.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

import anyio

from zp_client.errors import ConfigurationError

__all__ = ["Clock", "LoopClock", "SystemClock", "SYSTEM_CLOCK", "wall_time", "real_monotonic"]


class Clock(Protocol):
    """Monotonic seconds and sleeps. ``monotonic`` is called per stream chunk: keep it cheap."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def sleep_sync(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: :func:`time.monotonic`, :func:`anyio.sleep` and :func:`time.sleep`."""

    # A staticmethod, so ``clock.monotonic`` is the builtin itself: no extra call per chunk.
    monotonic = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))

    def sleep_sync(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


SYSTEM_CLOCK: Clock = SystemClock()


class LoopClock:
    """An asyncio event loop's own clock: ``loop.time()`` and :func:`asyncio.sleep`.

    Under a normal loop this is monotonic time; under a virtual-time loop (the storm's) it is virtual
    time, and sleeps on it end when the loop jumps to them. ``loop`` defaults to the running loop, so
    build it inside the loop it belongs to. It cannot block a thread: :meth:`sleep_sync` raises
    :class:`~zp_client.ConfigurationError` (use it with async clients only).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self.monotonic = self.loop.time  # bound once: read per stream chunk

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def sleep_sync(self, seconds: float) -> None:
        raise ConfigurationError("a LoopClock cannot block a thread; use it with async clients only")

    def __repr__(self) -> str:
        return f"LoopClock({type(self.loop).__name__})"


def wall_time() -> float:
    """Unix time (:func:`time.time`), for what is dated in the real world: an HTTP-date ``Retry-After``."""
    return time.time()


#: Real monotonic seconds whatever clock a client runs on: for measuring the process itself (how long
#: a benchmark took in wall time, how late the event loop woke up), never for admission decisions.
real_monotonic = time.perf_counter
