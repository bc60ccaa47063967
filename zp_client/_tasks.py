"""The owners of the library's background work (docs/admission.md#background-work).

Every task and thread zp starts has an owner that starts it and stops it, in one place:

- :class:`Supervisor`: one per budget face, fleet, forecaster, adaptive limit or pinned prefix, for the
  work that lives as long as it does (a Redis budget's pump, poller, keeper and flusher tasks, and its
  blocking face's pump and keeper threads; the shared forecaster's thread; a fleet's health checks; an
  adaptive limit's task or thread; a keep-warm sender; fire-and-forget releases and health reports).
  ``aclose()`` stops it in a fixed order: refuse new threads; let the fire-and-forget work finish within a
  grace period, then cancel what is left of it; cancel the long-lived tasks, newest first, and wait for
  them (bounded; one that lost its cancellation is cancelled again); stop the threads, newest first, and
  join them (bounded). The table of owners: docs/admission.md#background-work-who-owns-it-and-how-it-stops.
- :class:`ServiceThread`: one per process for the work no single owner has (the idle-stream watchdog,
  the deadline alarms, the deferred releases of prefill legs). It runs while it has work and ends when it
  has none; the next piece of work starts it again. :func:`quiesce` ends the idle ones now (a client's or
  budget's ``aclose()`` calls it), so after the last close nothing of zp runs.
- :class:`LoopRef`: the event loop a piece of work was started from, asyncio or trio, so another thread
  (a watchdog, a finalizer) runs an async release on it in the same way under both; :func:`call_later`
  runs one after a delay of that loop's time (a virtual-time loop).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Protocol

from zp_client.clock import SYSTEM_CLOCK

__all__ = ["Supervisor", "ServiceThread", "DeferredCalls", "deferred", "LoopRef", "quiesce", "call_later",
           "wait_event", "wait_within"]

logger = logging.getLogger("zp_client")


class Supervisor:
    """Owns one budget's (or client's) asyncio tasks and threads; ``aclose()`` stops them in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._tasks: list[asyncio.Task[object]] = []  # long-lived: cancelled at close
        self._background: set[asyncio.Task[object]] = set()  # fire-and-forget: finished at close
        self._threads: list[tuple[threading.Thread, Callable[[], None]]] = []
        self.closed = False

    def spawn(self, coro: Coroutine[object, object, object], *, name: str,
              loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[object]:
        """Start a long-lived task (on ``loop``, default the running one); cancelled by :meth:`aclose`."""
        task = (loop or asyncio.get_running_loop()).create_task(coro, name=name)
        with self._lock:
            self._tasks.append(task)  # kept when done: a handful per owner, read after a close
        return task

    def background(self, coro: Coroutine[object, object, object], *,
                   loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[object]:
        """Start a short piece of work nobody awaits (a release whose caller went away); :meth:`aclose`
        lets it finish first (within its grace period)."""
        task = (loop or asyncio.get_running_loop()).create_task(coro)
        with self._lock:
            self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def pending_background(self) -> list[asyncio.Task[object]]:
        with self._lock:
            return [t for t in self._background if not t.done()]

    def thread(self, target: Callable[[], None], *, name: str,
               stop: Callable[[], None]) -> threading.Thread | None:
        """Start a daemon thread running ``target``; :meth:`aclose` / :meth:`close_threads` call ``stop``
        (which must make ``target`` return) and join it. None, and nothing started, once the supervisor
        is closed: a closed owner starts nothing (a thread that was waiting in it when it closed and
        goes on afterwards must not start its keeper again)."""
        t = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            if self.closed:
                return None
            self._threads = [(th, s) for th, s in self._threads if th.is_alive()]
            self._threads.append((t, stop))
            t.start()  # under the lock: a close_threads() racing this one sees it started, and joins it
        return t

    @property
    def tasks(self) -> list[asyncio.Task[object]]:
        """The long-lived tasks, oldest first (finished ones included)."""
        return self._tasks

    @tasks.setter
    def tasks(self, tasks: list[asyncio.Task[object]]) -> None:
        with self._lock:
            self._tasks = list(tasks)

    @property
    def background_tasks(self) -> set[asyncio.Task[object]]:
        """The fire-and-forget tasks not finished yet."""
        return self._background

    async def aclose(self, *, grace_s: float = 2.0, wait_s: float = 2.0) -> None:
        """Stop everything this supervisor started, in order (see the module's doc). Bounded: a task
        stuck in a call or a thread stuck in a blocking read does not hang the close (logged)."""
        self.closed = True
        loop = asyncio.get_running_loop()
        late = [t for t in self.pending_background() if t.get_loop() is loop]
        if late:
            _, left = await asyncio.wait(late, timeout=grace_s)
            for t in left:
                t.cancel()
            if left:
                await asyncio.wait(left, timeout=0.5)
        await self.stop_tasks(wait_s)
        if self._threads:
            await asyncio.to_thread(self.close_threads, wait_s)

    async def stop_tasks(self, wait_s: float = 2.0) -> None:
        """Step (3) alone: cancel the long-lived tasks, newest first, and wait for those of the running
        loop (bounded). The fire-and-forget work is left alone (an owner that drains it its own way)."""
        self.closed = True
        loop = asyncio.get_running_loop()
        with self._lock:
            tasks = list(reversed(self._tasks))
        for t in tasks:
            t.cancel()
        stuck = await _until_done([t for t in tasks if t.get_loop() is loop], wait_s)
        if stuck:
            logger.debug("zp_client: %s: %d task(s) did not stop within %.1f s", self.name, len(stuck),
                         wait_s)

    def close_threads(self, wait_s: float = 2.0) -> None:
        """Stop and join the threads, newest first (the blocking part of :meth:`aclose`, for a close
        without an event loop)."""
        with self._lock:
            self.closed = True
            threads, self._threads = list(reversed(self._threads)), []
        for t, stop in threads:
            try:
                stop()
            except Exception:  # noqa: BLE001 - one thread's stop must not keep the others running
                logger.debug("zp_client: stopping %s failed", t.name, exc_info=True)
        for t, _ in threads:
            if t is not threading.current_thread():
                t.join(wait_s)

    def cancel_tasks(self) -> None:
        """Cancel the long-lived tasks, newest first, without waiting for them (from any thread)."""
        with self._lock:
            tasks = list(reversed(self._tasks))
        for t in tasks:
            loop = t.get_loop()
            if loop.is_closed():
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                t.cancel()
            else:
                loop.call_soon_threadsafe(t.cancel)

    def cancel_all(self) -> None:
        """Cancel every task from outside its loop (a close on another loop or none): what can be done
        without awaiting them."""
        self.closed = True
        with self._lock:
            tasks = list(reversed(self._tasks)) + list(self._background)
        for t in tasks:
            loop = t.get_loop()
            if not loop.is_closed():
                loop.call_soon_threadsafe(t.cancel)


RECANCEL_S = 0.25


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    """Wait until ``event`` is set or ``timeout`` seconds pass, whichever comes first.

    What ``asyncio.wait_for(event.wait(), timeout)`` is meant to do, without its Python 3.11 flaw
    (gh-86296): a cancellation of the caller that arrives as the event is set is returned as the event's
    result, and a background loop waiting so (a budget's keeper) runs on after ``asyncio.run`` cancelled
    it once at exit, until the program hangs on it. ``asyncio.wait`` never swallows the caller's
    cancellation."""
    await wait_within(asyncio.ensure_future(event.wait()), timeout)


async def wait_within(task: asyncio.Future[object], timeout: float) -> None:
    """Wait for ``task`` at most ``timeout`` seconds; a task still running then (or when the caller is
    cancelled) is cancelled and waited for, so nothing is left behind. Never swallows the caller's
    cancellation (``asyncio.wait``, not ``wait_for``: :func:`wait_event`). The caller reads the task's
    outcome: ``task.cancelled()`` after a timeout."""
    try:
        await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


async def _until_done(tasks: list[asyncio.Task[object]], wait_s: float) -> set[asyncio.Task[object]]:
    """Wait for cancelled ``tasks`` to end, at most ``wait_s``; returns those still running. One still
    running after :data:`RECANCEL_S` is cancelled again: on Python 3.10/3.11 ``asyncio.wait_for`` (which
    redis-py and others run each call under) returns the reply instead of raising when the cancellation
    lands just as the reply arrives, so a cancellation can be lost once and the task go on (measured: the
    adaptive limit's task on a RedisBudget, then destroyed pending with its loop)."""
    pending = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
        for t in pending:
            t.cancel()
    return pending


class ServiceThread:
    """One process-wide daemon thread that runs while there is work and ends when there is none.

    ``step()`` does one round of work (called without :attr:`cond` held) and returns how long to sleep
    before the next, or ``None`` when it saw no work; ``has_work()`` (called under :attr:`cond`) decides,
    atomically with :meth:`wake`, whether the thread ends. Whoever adds work calls :meth:`wake`."""

    _all: list[ServiceThread] = []

    def __init__(self, name: str, step: Callable[[], float | None], has_work: Callable[[], bool]) -> None:
        self.name = name
        self._step = step
        self._has_work = has_work
        self.cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._woken = False
        ServiceThread._all.append(self)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def wake(self) -> None:
        """New work (or an earlier deadline): start the thread if it is not running, else wake it."""
        with self.cond:
            self._woken = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            try:
                pause = self._step()
            except Exception:  # noqa: BLE001 - never let one round stop the service
                logger.debug("zp_client: %s: a round failed", self.name, exc_info=True)
                pause = 0.05
            with self.cond:
                if pause is None and not self._has_work():
                    # no work: end; a wake() from here on sees no thread and starts one
                    self._thread = None
                    return
                if not self._woken:
                    self.cond.wait(0.05 if pause is None else pause)
                self._woken = False

    def quiesce(self, wait_s: float = 1.0) -> None:
        """Let the thread end now if it has no work (it would at its next round), and join it."""
        with self.cond:
            t = self._thread
            if t is None or self._has_work():
                return
            self._woken = True
            self.cond.notify_all()
        if t is not None and t is not threading.current_thread():
            t.join(wait_s)


class DeferredCalls:
    """Calls made at a time (system clock) on behalf of an owner (a budget), on one process-wide
    :class:`ServiceThread` running while any is pending: the blocking release of a prefill leg whose KV
    the prefill replica keeps until vLLM's lease on it expires. ``run_now(owner)`` makes an owner's
    pending calls at once (its ``aclose()``: it is going away)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Deferred]] = []
        self._seq = 0
        self._service = ServiceThread("zp-deferred-release", self._step, lambda: bool(self._heap))
        self._cond = self._service.cond

    def add(self, owner: object, after_s: float, fn: Callable[[], None], done: Callable[[], bool]) -> None:
        """Call ``fn()`` in ``after_s`` seconds unless ``done()`` is true by then."""
        with self._cond:
            self._seq += 1
            entry = (SYSTEM_CLOCK.monotonic() + after_s, self._seq, _Deferred(owner, fn, done))
            heapq.heappush(self._heap, entry)
        self._service.wake()

    def pending(self) -> int:
        with self._cond:
            return sum(1 for _, _, d in self._heap if not d.done())

    def run_now(self, owner: object) -> int:
        """Make ``owner``'s pending calls now, in this thread; returns how many."""
        with self._cond:
            mine = [d for _, _, d in self._heap if d.owner is owner and not d.done()]
            self._heap = [e for e in self._heap if e[2].owner is not owner]
            heapq.heapify(self._heap)
        for d in mine:
            d.fn()
        return len(mine)

    def _step(self) -> float | None:
        due: list[_Deferred] = []
        with self._cond:
            now = SYSTEM_CLOCK.monotonic()
            while self._heap and (self._heap[0][0] <= now or self._heap[0][2].done()):
                due.append(heapq.heappop(self._heap)[2])
            pause = None if not self._heap else self._heap[0][0] - now
        for d in due:
            if not d.done():
                d.fn()
        return pause


class _Deferred:
    __slots__ = ("owner", "fn", "done")

    def __init__(self, owner: object, fn: Callable[[], None], done: Callable[[], bool]) -> None:
        self.owner, self.fn, self.done = owner, fn, done


deferred = DeferredCalls()


def quiesce(wait_s: float = 1.0) -> None:
    """End the process-wide service threads that have no work left, and join them."""
    for s in list(ServiceThread._all):
        s.quiesce(wait_s)


class _TrioToken(Protocol):
    """What is used of ``trio.lowlevel.TrioToken`` (trio is optional: never imported here unless running)."""

    def run_sync_soon(self, sync_fn: Callable[[], object]) -> None: ...


class LoopRef:
    """The event loop that was running where it was made: an asyncio loop, a trio run, or none."""

    __slots__ = ("asyncio_loop", "trio_token")

    def __init__(self) -> None:
        self.asyncio_loop: asyncio.AbstractEventLoop | None = None
        self.trio_token: _TrioToken | None = None
        try:
            self.asyncio_loop = asyncio.get_running_loop()
        except RuntimeError:
            self.trio_token = _trio_token()

    @property
    def closed(self) -> bool:
        """An asyncio loop that was closed (a trio run's end shows only when :meth:`run_soon` fails)."""
        return self.asyncio_loop is not None and self.asyncio_loop.is_closed()

    @property
    def alive(self) -> bool:
        if self.asyncio_loop is not None:
            return not self.asyncio_loop.is_closed() and self.asyncio_loop.is_running()
        return self.trio_token is not None

    def run_soon(self, fn: Callable[[], Awaitable[object]]) -> bool:
        """Run ``fn()`` as a task on that loop, from any thread, without waiting; False when the loop
        is gone (the caller then does the work another way)."""
        if self.asyncio_loop is not None:
            loop = self.asyncio_loop
            if loop.is_closed() or not loop.is_running():
                return False
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                task = loop.create_task(_as_coro(fn))
                _pending.add(task)
                task.add_done_callback(_pending.discard)
            else:
                asyncio.run_coroutine_threadsafe(_as_coro(fn), loop)
            return True
        if self.trio_token is None:
            return False
        import trio

        def spawn() -> None:
            trio.lowlevel.spawn_system_task(_as_coro, fn)

        try:
            self.trio_token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            return False
        return True


_pending: set[asyncio.Task[object]] = set()  # fire-and-forget work on a loop, kept until done


def call_later(loop: asyncio.AbstractEventLoop, after_s: float, fn: Callable[[], Awaitable[object]]) -> None:
    """Run ``fn()`` as a task on ``loop`` (the running one) in ``after_s`` seconds of its time: the timed
    release of a prefill leg on a virtual-time loop (the loop's own timer owns it; on the system clock
    :data:`deferred` does it instead)."""

    def fire() -> None:
        task = loop.create_task(_as_coro(fn))
        _pending.add(task)
        task.add_done_callback(_pending.discard)

    loop.call_later(after_s, fire)


async def _as_coro(fn: Callable[[], Awaitable[object]]) -> None:
    try:
        await fn()
    except Exception:  # noqa: BLE001 - background work: logged, never raised into a loop's handler
        logger.exception("zp_client: background work failed")


def _trio_token() -> _TrioToken | None:
    """The running trio run's token, or None (no trio, or not inside a trio run)."""
    import sys

    trio = sys.modules.get("trio")  # trio runs only if someone imported it
    if trio is None:
        return None
    try:
        token: _TrioToken = trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None
    return token
