"""The release rules: one :class:`Holder` per admitted response owns its lease and releases it once.

A body that did not finish closes its connection BEFORE the lease is released (the server then aborts
the request and frees its KV); an abandoned body (garbage collection) or one nobody read for
``Settings.idle_stream_timeout_s`` (the :class:`Watchdog` thread) is released the same way.
See docs/admission.md.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import select
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import anyio

from zp_client._tasks import LoopRef, ServiceThread, call_later, deferred
from zp_client.budget.base import Lease
from zp_client.clock import SYSTEM_CLOCK, Clock
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

    __slots__ = ("lease", "budget", "done", "loop", "where", "resp", "last_activity", "waiting",
                 "idle_timeout", "clock", "granted_at", "metrics", "pending", "__weakref__")

    def __init__(self, lease: Lease, idle_timeout: float, *, is_async: bool,
                 clock: Clock = SYSTEM_CLOCK, metrics: Metrics | None = None,
                 budget: Budget | None = None) -> None:
        self.lease = lease
        self.budget = budget
        """The budget the lease was taken from (its ``aclose()`` releases the deferred releases of its
        leases at once: :meth:`zp_client._tasks.DeferredCalls.run_now`)."""
        self.done = False
        self.clock = clock
        self.resp: HttpResponse | None = None  # the inner response, once its body is handed to the caller
        # made right after the grant: its hold time starts here
        self.granted_at = self.last_activity = clock.monotonic()
        self.metrics = metrics  # records the hold time at release (zp_client.metrics)
        # True while the caller waits for the server's next chunk: a slow server is not an idle caller.
        self.waiting = False
        self.idle_timeout = idle_timeout
        # the event loop (asyncio, or a trio run) the lease was taken on: a release from another thread
        # (the watchdog, a finalizer) runs there, with the async release; None for a blocking call
        self.where: LoopRef | None = LoopRef() if is_async else None
        self.loop = None if self.where is None else self.where.asyncio_loop
        # the release in progress on the loop (set there, by release()): a second release() waits for it
        self.pending: asyncio.Future[None] | None = None

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
            call_later(loop, after_s, self.release)
            return
        deferred.add(self.budget, after_s, self.release_sync, lambda: self.done)

    def server_ended(self) -> None:
        """The server ended the connection under a body its caller is not reading: it holds no KV for
        the request any more, so the lease goes back now. The response is not closed (what the server
        sent before it ended stays readable). Callable from any thread."""
        if self.done:
            return
        where = self.where
        # on its loop, as every other async release: a close racing it then waits for it (release())
        if where is None or not where.alive or not where.run_soon(self.release):
            self.release_sync()

    def abandon(self) -> None:
        """The caller walked away (garbage collection) or stopped reading (watchdog).

        Closes the inner response first, so the server sees the disconnect, aborts the request and
        frees its KV (releasing the lease while the server still generated would break the bound),
        then releases the lease. Callable from any thread; never blocks an event loop.
        """
        if self.done:
            return
        resp, self.resp = self.resp, None
        where = self.where
        if where is None or where.closed:
            if resp is not None and where is None:
                try:
                    resp.close()
                except Exception:
                    logger.debug("closing an abandoned response failed", exc_info=True)
            self.release_sync()
            return
        self._mark_done()
        lease = self.lease
        # on its loop (asyncio or trio alike), from any thread; the blocking release once it stopped
        if not where.run_soon(lambda: _abandon_async(resp, lease)):
            try:
                lease.release_sync()
            except Exception:
                logger.exception("lease release failed")


class ReaderWatch:
    """Follows the asyncio task reading a body: when that task ends cancelled while the body is still
    open, the body was left behind (issue 33 item 2). Its frames, the stream in them, are then kept by
    asyncio's task <-> CancelledError <-> traceback cycle until the garbage collector runs, so the
    stream's finalizer would not fire: the holder abandons it at once (the connection is closed, then the
    lease released). A task that ended otherwise may have handed the stream on (its result): left alone.
    Holds the holder, never the body (a dropped body is still finalized as before)."""

    __slots__ = ("holder", "task", "_callback")

    def __init__(self, holder: Holder) -> None:
        self.holder = holder
        self.task: asyncio.Task[object] | None = None
        self._callback = self._ended

    def follow(self) -> None:
        """Called by the reader, each time it reads: the current task is the body's reader."""
        if self.holder.loop is None:  # trio, or a blocking body
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return
        if task is not self.task:
            self.stop()
            if task is not None:
                task.add_done_callback(self._callback)
                self.task = task

    def stop(self) -> None:
        if self.task is not None:
            self.task.remove_done_callback(self._callback)
            self.task = None

    def _ended(self, task: asyncio.Task[object]) -> None:
        self.task = None
        if not self.holder.done and task.cancelled():
            self.holder.abandon()


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


def finalize(holder: Holder) -> None:
    if not holder.done:
        logger.debug("response abandoned without close: closing it and releasing its lease")
        holder.abandon()



class Watchdog:
    """Releases leases of streams nobody has read for a while, and (every :data:`HANGUP_CHECK_S`, where
    poll() can tell) of bodies nobody is reading whose connection the server ended (it aborted or
    finished the request: it holds no KV for it any more). One process-wide
    :class:`~zp_client._tasks.ServiceThread`, running while any body is open."""

    def __init__(self) -> None:
        self._holders: weakref.WeakSet[Holder] = weakref.WeakSet()
        self._interval = 5.0
        self._service = ServiceThread("zp-idle-watchdog", self._step, self._open)
        self._lock = self._service.cond

    def _open(self) -> bool:
        return any(not h.done for h in self._holders)

    def add(self, holder: Holder) -> None:
        with self._lock:
            self._holders.add(holder)
            # Only a first body or a shorter timeout than any seen needs the thread now; waking it on
            # every request would cost a GIL hand-off per request.
            wake = not self._service.running or holder.idle_timeout / 4 < self._interval
            if wake:
                self._interval = min(self._interval, holder.idle_timeout / 4) if self._service.running \
                    else holder.idle_timeout / 4
        if wake:
            self._service.wake()

    def _step(self) -> float | None:
        with self._lock:
            holders = [h for h in self._holders if not h.done]
            if not holders:
                return None
            self._interval = max(0.01, min(h.idle_timeout for h in holders) / 4)
            interval = self._interval
        if _RDHUP:
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
        return interval


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
    """Calls a function at a monotonic time (system clock) unless cancelled first, on one process-wide
    :class:`~zp_client._tasks.ServiceThread` running while any alarm is set. A blocking call's deadline
    cuts its connection here (:func:`cut_connection`): a blocking read cannot be bounded from its own
    thread once it started."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._calls: dict[int, Callable[[], None]] = {}
        self._seq = 0
        self._service = ServiceThread("zp-deadline-alarms", self._step, lambda: bool(self._calls))
        self._cond = self._service.cond

    def at(self, due: float, fn: Callable[[], None]) -> int:
        """Call ``fn()`` at ``due`` (``SYSTEM_CLOCK.monotonic()`` time); returns a token to cancel it."""
        with self._cond:
            self._seq += 1
            self._calls[self._seq] = fn
            heapq.heappush(self._heap, (due, self._seq))
            token = self._seq
        self._service.wake()
        return token

    def cancel(self, token: int) -> None:
        with self._cond:
            self._calls.pop(token, None)

    def _step(self) -> float | None:
        fire: list[Callable[[], None]] = []
        with self._cond:
            now = SYSTEM_CLOCK.monotonic()
            while self._heap:
                due, token = self._heap[0]
                if token not in self._calls:  # cancelled: drop it
                    heapq.heappop(self._heap)
                    continue
                if due > now:
                    break
                heapq.heappop(self._heap)
                fire.append(self._calls.pop(token))
            pause = None if not self._heap else self._heap[0][0] - now
        for fn in fire:
            try:
                fn()
            except Exception:  # never let one alarm stop the thread
                logger.debug("a deadline alarm failed", exc_info=True)
        return pause


alarms = Alarms()
