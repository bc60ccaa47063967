"""The release rules: one :class:`Holder` per admitted response owns its lease and releases it once.

A body that did not finish closes its connection BEFORE the lease is released (the server then aborts
the request and frees its KV); an abandoned body (garbage collection) or one nobody read for
``Settings.idle_stream_timeout_s`` (the :class:`Watchdog` thread) is released the same way.
See docs/admission.md.
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import anyio

from zp_client._clock import SYSTEM_CLOCK, Clock
from zp_client.budget.base import Lease
from zp_client.errors import DeadlineExceeded

if TYPE_CHECKING:
    from zp_client._admission.ports import HttpResponse, Metrics
    from zp_client.budget.base import Budget

logger = logging.getLogger("zp_client.transport")



def deadline_exceeded(where: str) -> DeadlineExceeded:
    """The error a call gets when its deadline (``X-ZP-Deadline`` / ``Settings.deadline_s``) passes while
    an attempt is in flight (``where``: waiting for the headers, reading the answer): the deadline bounds
    the whole call up to its last byte. The connection is closed and the lease released before it
    reaches the caller."""
    return DeadlineExceeded(
        f"the request's deadline passed {where}: the call was ended, its connection closed and its lease "
        "released (X-ZP-Deadline / Settings.deadline_s bound the whole call up to its last byte)"
    )


class Holder:
    """Owns one lease while a response body is open. Never references the stream wrapper, so the
    wrapper can be garbage collected (its finalizer then calls :meth:`abandon`)."""

    __slots__ = ("lease", "budget", "done", "loop", "resp", "last_activity", "waiting", "idle_timeout",
                 "clock", "granted_at", "metrics", "pending", "__weakref__")

    def __init__(self, lease: Lease, idle_timeout: float, *, is_async: bool,
                 clock: Clock = SYSTEM_CLOCK, metrics: Metrics | None = None,
                 budget: Budget | None = None) -> None:
        self.lease = lease
        self.budget = budget
        """The budget the lease was taken from (its ``aclose()`` releases the deferred releases of its
        leases at once: :meth:`DeferredReleases.release_now`)."""
        self.done = False
        self.clock = clock
        self.resp: HttpResponse | None = None  # the inner response, once its body is handed to the caller
        # made right after the grant: its hold time starts here
        self.granted_at = self.last_activity = clock.monotonic()
        self.metrics = metrics  # records the hold time at release (zp_client.metrics)
        # True while the caller waits for the server's next chunk: a slow server is not an idle caller.
        self.waiting = False
        self.idle_timeout = idle_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        # the release in progress on the loop (set there, by release()): a second release() waits for it
        self.pending: asyncio.Future[None] | None = None
        if is_async:
            try:
                self.loop = asyncio.get_running_loop()
            except RuntimeError:  # trio: finalizers fall back to release_sync
                self.loop = None

    def _mark_done(self) -> None:
        """Once, when the release starts: the lease's hold time ends here."""
        self.done = True
        if self.metrics is not None:
            self.metrics.held(self.lease.priority, self.clock.monotonic() - self.granted_at)

    async def release(self) -> None:
        if self.done:
            pending = self.pending
            if pending is not None and not pending.done():
                # a close racing server_ended's release must find the lease back, not on its way back
                with anyio.CancelScope(shield=True):
                    await asyncio.shield(pending)
            return
        self._mark_done()
        loop = self.loop
        if loop is not None and loop is _running_loop():
            self.pending = loop.create_future()
        # Shielded: this runs on cancellation paths and must finish so no blocks leak.
        try:
            with anyio.CancelScope(shield=True):
                try:
                    await self.lease.release()
                except Exception:  # release never raises by contract; a backend bug must not mask ours
                    logger.exception("lease release failed")
        finally:
            if self.pending is not None and not self.pending.done():
                self.pending.set_result(None)

    def release_sync(self) -> None:
        if self.done:
            return
        self._mark_done()
        try:
            self.lease.release_sync()
        except Exception:
            logger.exception("lease release failed")

    def release_later(self, after_s: float) -> None:
        """Release the lease in ``after_s`` seconds, without waiting. Used for a prefill leg whose KV the
        prefill replica keeps until vLLM's lease on it expires: the budget must hold those blocks as long
        as the server does. On the system clock one timer thread for the process does it (it outlives the
        event loop the lease was taken on); on another clock (a virtual-time loop) the loop does."""
        if self.done:
            return
        loop = self.loop
        if self.clock is not SYSTEM_CLOCK and loop is not None and not loop.is_closed():
            def fire() -> None:
                task = loop.create_task(self.release())
                _pending.add(task)
                task.add_done_callback(_pending.discard)

            loop.call_later(after_s, fire)
            return
        deferred.add(self, after_s)

    def server_ended(self) -> None:
        """The server ended the connection under a body its caller is not reading: it holds no KV for
        the request any more, so the lease goes back now. The response is not closed (what the server
        sent before it ended stays readable). Callable from any thread."""
        if self.done:
            return
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            self.release_sync()
            return
        # on the loop, as every other async release: a close racing it then waits for it (release())
        asyncio.run_coroutine_threadsafe(self.release(), loop)

    def abandon(self) -> None:
        """The caller walked away (garbage collection) or stopped reading (watchdog).

        Closes the inner response first, so the server sees the disconnect, aborts the request and
        frees its KV (releasing the lease while the server still generated would break the bound),
        then releases the lease. Callable from any thread; never blocks an event loop.
        """
        if self.done:
            return
        resp, self.resp = self.resp, None
        loop = self.loop
        if loop is None or loop.is_closed():
            if resp is not None and loop is None:
                try:
                    resp.close()
                except Exception:
                    logger.debug("closing an abandoned response failed", exc_info=True)
            self.release_sync()
            return
        self._mark_done()
        coro = _abandon_async(resp, self.lease)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(coro)
            _pending.add(task)
            task.add_done_callback(_pending.discard)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(coro, loop)
        else:
            coro.close()
            try:
                self.lease.release_sync()
            except Exception:
                logger.exception("lease release failed")


async def _abandon_async(resp: HttpResponse | None, lease: Lease) -> None:
    try:
        if resp is not None:
            await resp.aclose()
    except Exception:
        logger.debug("closing an abandoned response failed", exc_info=True)
    finally:
        try:
            await lease.release()
        except Exception:
            logger.exception("lease release failed")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # trio
        return None


#: How often the watchdog looks for connections the server ended under unread bodies (Linux: poll()'s
#: POLLRDHUP says the peer shut its side even while data it sent is still unread).
HANGUP_CHECK_S = 0.25
try:
    _RDHUP = select.POLLRDHUP
except AttributeError:  # not Linux: poll() cannot tell a peer's shutdown from unread data
    _RDHUP = 0


class _NetworkStream(Protocol):
    """httpcore's ``network_stream`` response extension."""

    def get_extra_info(self, info: str) -> object: ...


class _Socket(Protocol):
    def fileno(self) -> int: ...

    def shutdown(self, how: int, /) -> None: ...


def _socket_of(resp: HttpResponse | None) -> _Socket | None:
    """The socket under an httpcore response (its ``network_stream`` extension), or None."""
    if resp is None:
        return None
    try:
        stream = cast("_NetworkStream | None", resp.extensions.get("network_stream"))
        return None if stream is None else cast("_Socket | None", stream.get_extra_info("socket"))
    except (AttributeError, TypeError, KeyError):  # not httpcore's: no socket to look at
        return None


def hung_up(holders: list[Holder]) -> list[Holder]:
    """Those of ``holders`` (bodies nobody is reading) whose connection the server ended: shut down
    (POLLRDHUP, POLLHUP) or already closed under them. Empty where poll() has no POLLRDHUP."""
    if not _RDHUP or not holders:
        return []
    poller = select.poll()
    by_fd: dict[int, Holder] = {}
    ended: list[Holder] = []
    for h in holders:
        sock = _socket_of(h.resp)
        if sock is None:
            continue
        try:
            fd = sock.fileno()
        except (AttributeError, OSError):
            continue
        if fd < 0:  # closed under a body still held: the connection ended (ours would have released)
            ended.append(h)
        elif fd not in by_fd:
            by_fd[fd] = h
            poller.register(fd, _RDHUP | select.POLLHUP)
    for fd, events in poller.poll(0):
        if events & (_RDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
            ended.append(by_fd[fd])
    return ended


_pending: set[asyncio.Task[None]] = set()


def finalize(holder: Holder) -> None:
    if not holder.done:
        logger.debug("response abandoned without close: closing it and releasing its lease")
        holder.abandon()


class DeferredReleases:
    """One daemon thread for the process: releases leases at a time (:meth:`Holder.release_later`), with
    the blocking release (every budget has one). ``release_now(budget)`` releases a budget's pending ones
    at once (its ``aclose()``: the budget is going away)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Holder]] = []
        self._seq = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, holder: Holder, after_s: float) -> None:
        import heapq

        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (SYSTEM_CLOCK.monotonic() + after_s, self._seq, holder))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="zp-deferred-release", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return sum(1 for _, _, h in self._heap if not h.done)

    def release_now(self, budget: Budget) -> int:
        """Release at once the pending leases taken from ``budget``; returns how many."""
        with self._cond:
            mine = [h for _, _, h in self._heap if not h.done and h.budget is budget]
        for h in mine:
            h.release_sync()
        return len(mine)

    def _run(self) -> None:
        import heapq

        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, _, holder = self._heap[0]
                wait = due - SYSTEM_CLOCK.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
            holder.release_sync()


deferred = DeferredReleases()


class Watchdog:
    """One daemon thread for the process: releases leases of streams nobody has read for a while, and
    (every :data:`HANGUP_CHECK_S`, where poll() can tell) of bodies nobody is reading whose connection
    the server ended (it aborted or finished the request: it holds no KV for it any more)."""

    def __init__(self) -> None:
        self._holders: weakref.WeakSet[Holder] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._interval = 5.0
        # True while the thread sleeps past HANGUP_CHECK_S (no body was open): the next one wakes it
        self._sleeping_long = False

    def add(self, holder: Holder) -> None:
        with self._lock:
            self._holders.add(holder)
            if self._thread is None or not self._thread.is_alive():
                self._interval = holder.idle_timeout / 4
                self._thread = threading.Thread(target=self._run, name="zp-idle-watchdog", daemon=True)
                self._thread.start()
                return
            wake = holder.idle_timeout / 4 < self._interval or self._sleeping_long
            self._sleeping_long = False
        if wake:
            # Only a shorter timeout than any seen needs an earlier check; waking the thread on every
            # request would cost a GIL hand-off per request.
            self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                holders = [h for h in self._holders if not h.done]
                if holders:
                    self._interval = max(0.01, min(h.idle_timeout for h in holders) / 4)
                interval = self._interval
                self._sleeping_long = bool(_RDHUP) and not holders and interval > HANGUP_CHECK_S
            if holders and _RDHUP:
                interval = min(interval, HANGUP_CHECK_S)
                try:
                    unread = [h for h in holders if not h.done and not h.waiting and h.resp is not None]
                    ended = hung_up(unread)
                except Exception:  # never let this check stop the watchdog
                    logger.debug("checking for ended connections failed", exc_info=True)
                    ended = []
                for h in ended:
                    logger.debug("the server ended the connection of an unread body: releasing its lease")
                    h.server_ended()
            for h in holders:
                if not h.done and not h.waiting and h.clock.monotonic() - h.last_activity > h.idle_timeout:
                    logger.warning(
                        "stream idle for more than %.1f s (Settings.idle_stream_timeout_s): closing it and "
                        "releasing its lease",
                        h.idle_timeout,
                    )
                    h.abandon()
            self._wake.wait(interval)
            self._wake.clear()


watchdog = Watchdog()


def cut_connection(resp: HttpResponse | None) -> None:
    """Shut the socket under ``resp`` down (both ways), from any thread: a blocking read on it returns at
    once (closing it from another thread would not wake that read). For a blocking call whose deadline
    passed while it waits for the server's bytes (:class:`Alarms`); a no-op without a socket."""
    sock = _socket_of(resp)
    if sock is None:
        return
    try:
        import socket

        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed or shut: nothing left to wake
        pass


class Alarms:
    """One daemon thread for the process: calls a function at a monotonic time (system clock) unless
    cancelled first. A blocking call's deadline cuts its connection here (:func:`cut_connection`): a
    blocking read cannot be bounded from its own thread once it started."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._calls: dict[int, Callable[[], None]] = {}
        self._seq = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def at(self, due: float, fn: Callable[[], None]) -> int:
        """Call ``fn()`` at ``due`` (``SYSTEM_CLOCK.monotonic()`` time); returns a token to cancel it."""
        import heapq

        with self._cond:
            self._seq += 1
            self._calls[self._seq] = fn
            heapq.heappush(self._heap, (due, self._seq))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="zp-deadline-alarms", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._seq

    def cancel(self, token: int) -> None:
        with self._cond:
            self._calls.pop(token, None)

    def _run(self) -> None:
        import heapq

        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, token = self._heap[0]
                if token not in self._calls:  # cancelled: drop it
                    heapq.heappop(self._heap)
                    continue
                wait = due - SYSTEM_CLOCK.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                fn = self._calls.pop(token)
            try:
                fn()
            except Exception:  # never let one alarm stop the thread
                logger.debug("a deadline alarm failed", exc_info=True)


alarms = Alarms()
