"""An asyncio event loop on virtual time: it jumps to the next timer whenever nothing is ready.

The storm runs the simulator and every in-process client setup (the real openai SDK, zp's transport
and retry policy, tenacity, LangChain's rate limiter) on one :class:`VirtualTimeLoop`: ``loop.time()``
is virtual, ``asyncio.sleep`` / ``call_at`` / ``wait_for`` / anyio's timeouts all read it, and when no
callback is ready the loop moves its clock straight to the earliest timer instead of waiting. CPU work
therefore takes no virtual time, and a run depends only on its inputs: it is exactly reproducible from
its seed and runs as fast as the CPU allows.

The clock is frozen (the loop waits in real time, as a normal loop would) while anything outside the
loop could still deliver work: a file descriptor other than the loop's own wake-up pipe is registered
(a real socket), or a ``run_in_executor`` job is running. Client and server talk through
:mod:`zp_client.testing` (an in-memory streaming ASGI transport), so in a storm neither happens.
Threads started otherwise (anyio's worker threads, a thread calling ``call_soon_threadsafe``) are
not seen: the clock may jump while they work. ``asyncio.Runner(loop_factory=VirtualTimeLoop)`` works;
:func:`run_virtual` is the storm's way in (it also runs on Python 3.10).
Timers due at the same instant run in the order they were scheduled (asyncio's heap breaks such ties by
its own layout, which any unrelated timer can change: a run's order must follow from the program, not
from the heap), so sessions arriving together reach the server in the order they were started.
A loop with nothing scheduled and nothing in flight is deadlocked; after ``deadlock_s`` real seconds
of that it raises :class:`VirtualTimeDeadlock` instead of hanging.

docs/benchmark.md#virtual-time explains what this does and does not model.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from contextvars import Context
from typing import TYPE_CHECKING, TypeVar

from zp_client.errors import ZPError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from _typeshed import FileDescriptorLike
    from typing_extensions import Never

__all__ = ["VirtualTimeDeadlock", "VirtualTimeLoop", "run_virtual"]

T = TypeVar("T")


class VirtualTimeDeadlock(ZPError, RuntimeError):
    """Nothing is scheduled, ready or in flight on a virtual-time loop: it would wait forever."""


class _JumpingSelector(selectors.BaseSelector):
    """The loop's selector: polls the real one without waiting, and where the loop would wait for a
    timer, moves the loop's virtual clock to that timer instead."""

    def __init__(self, deadlock_s: float) -> None:
        self._real = selectors.DefaultSelector()
        self._loop: VirtualTimeLoop | None = None
        self._wakeup_fd: int | None = None
        self._deadlock_s = deadlock_s
        self._frozen_s = 0.0  # real seconds waited frozen with nothing arriving

    # -- delegated --------------------------------------------------------------------------------
    def register(self, fileobj: FileDescriptorLike, events: int,
                 data: object = None) -> selectors.SelectorKey:
        key = self._real.register(fileobj, events, data)
        if self._wakeup_fd is None:  # the loop registers its own wake-up pipe first, in its __init__
            self._wakeup_fd = key.fd
        return key

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: FileDescriptorLike, events: int, data: object = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    # -- the jump ---------------------------------------------------------------------------------
    def _outside_work(self) -> bool:
        loop = self._loop
        sockets = any(fd != self._wakeup_fd for fd in self._real.get_map())
        return sockets or (loop is not None and loop.executor_jobs > 0)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events or timeout == 0 or self._loop is None:
            self._frozen_s = 0.0
            return events
        if self._outside_work():
            # frozen: wait in real time for the outside world, but not forever (an idle socket, say a
            # keep-alive connection, would otherwise keep a due timer from ever firing)
            wait = self._deadlock_s - self._frozen_s
            slice_s = wait if timeout is None else min(timeout, wait)
            events = self._real.select(max(0.0, slice_s))
            if events:
                self._frozen_s = 0.0
                return events
            self._frozen_s += max(0.0, slice_s)
            if self._frozen_s >= self._deadlock_s:
                raise VirtualTimeDeadlock(
                    f"virtual-time loop: the clock has been frozen for {self._deadlock_s:g} real seconds by "
                    "a registered socket or a running executor job, and nothing arrived; a virtual-time run "
                    "must not use sockets (use zp_client.testing) and its executor jobs must end")
            return events
        if timeout is None:
            events = self._real.select(self._deadlock_s)
            if not events and not self._outside_work():
                raise VirtualTimeDeadlock(
                    "virtual-time loop: no timer is scheduled, no callback is ready and nothing is in flight "
                    f"(waited {self._deadlock_s:g} real seconds); every task is waiting for something that "
                    "cannot happen")
            return events
        self._loop._jump(timeout)
        return []


class _FifoTimerHandle(asyncio.TimerHandle):
    """A timer ordered by (deadline, the order it was scheduled in)."""

    __slots__ = ("_seq",)

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[object, ...],
                 loop: asyncio.AbstractEventLoop, context: Context | None, seq: int) -> None:
        super().__init__(when, callback, args, loop, context=context)
        self._seq = seq

    def __lt__(self, other: asyncio.TimerHandle) -> bool:
        if isinstance(other, _FifoTimerHandle):
            return (self.when(), self._seq) < (other.when(), other._seq)
        return super().__lt__(other)

    def __le__(self, other: asyncio.TimerHandle) -> bool:
        if isinstance(other, _FifoTimerHandle):
            return (self.when(), self._seq) <= (other.when(), other._seq)
        return super().__le__(other)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose :meth:`time` is virtual (starts at ``start``, default 0.0) and jumps
    to the next timer whenever nothing is ready. See the module docstring."""

    def __init__(self, start: float = 0.0, *, deadlock_s: float = 10.0) -> None:
        self._now = float(start)
        self.executor_jobs = 0
        """``run_in_executor`` jobs not finished yet (the clock is frozen while there are any)."""
        self.jumps = 0
        """How many times the clock jumped (for tests and reports)."""
        self._timer_seq = itertools.count()
        selector = _JumpingSelector(deadlock_s)
        super().__init__(selector)
        selector._loop = self

    def time(self) -> float:
        return self._now

    def _jump(self, timeout: float) -> None:
        # asyncio computed ``timeout`` from its earliest live timer; land on that timer's deadline
        # exactly (adding the timeout back would be an ulp off), falling back to the timeout itself.
        scheduled = getattr(self, "_scheduled", None)
        when = getattr(scheduled[0], "_when", None) if scheduled else None
        target = when if isinstance(when, float) and when >= self._now else self._now + timeout
        self._now = max(self._now, target)
        self.jumps += 1

    def call_at(self, when: float, callback: Callable[..., object], *args: object,
                context: Context | None = None) -> asyncio.TimerHandle:
        # BaseEventLoop.call_at with a FIFO tie-break (see the module docstring)
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]  # asyncio's own private check
        timer = _FifoTimerHandle(when, callback, args, self, context, next(self._timer_seq))
        if timer._source_traceback:  # type: ignore[attr-defined]  # debug mode's traceback, as asyncio trims it
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]  # the loop's timer heap
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    async def shutdown_default_executor(self, *args: float | None) -> None:
        # its joining thread is outside work too: no jump to asyncio's 300 s join timeout meanwhile
        self.executor_jobs += 1
        try:
            await super().shutdown_default_executor(*args)
        finally:
            self.executor_jobs -= 1

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T],
                        *args: object) -> asyncio.Future[T]:
        fut: asyncio.Future[T] = super().run_in_executor(executor, func, *args)
        self.executor_jobs += 1

        def done(_: asyncio.Future[T]) -> None:
            self.executor_jobs -= 1

        fut.add_done_callback(done)
        return fut


def run_virtual(main: Coroutine[object, Never, T], *, start: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualTimeLoop` (like :func:`asyncio.run`: the
    loop's async generators and default executor are shut down and the loop closed after)."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
