"""The in-process budget: the embedded default, no server needed.

:class:`LocalBudget` is a thin, thread-safe shell around :class:`~zp_client.budget.ledger.Ledger`; async
tasks and threads share one limit and one line::

    budget = LocalBudget(limit_blocks=2_000)
    async with budget.lease(40, priority=0, timeout=30) as lease: ...
    with budget.lease_sync(40) as lease: ...         # from a thread, no event loop needed

What callers may rely on: see docs/admission.md#localbudget.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import anyio

from zp_client._tasks import quiesce
from zp_client.budget.base import Budget, BudgetStatus, Lease, Ticket
from zp_client.budget.elastic import make_policy
from zp_client.budget.ledger import (
    DEFAULT_LATE_BOUND_S,
    DEFAULT_LINE,
    DEFAULT_LONGEST_FIRST_S,
    DEFAULT_STARVATION_BOUND_S,
    Ledger,
    LineName,
    ReservationPolicy,
    validate_blocks,
)
from zp_client.budget.pins import DEFAULT_PIN_CAP_FRACTION
from zp_client.budget.predict import (
    FAIL_FAST_KEY,
    ErrorWindow,
    PoolTiming,
    predict_wait_of,
    predict_waits,
    refusal,
)
from zp_client.clock import SYSTEM_CLOCK, Clock
from zp_client.errors import AdmissionTimeout, ConfigurationError, DeadlineExceeded, LeaseTooLarge

if TYPE_CHECKING:
    from zp_client.config import Settings

__all__ = ["LocalBudget"]

logger = logging.getLogger("zp_client.budget.local")



class _LocalLease(Lease):
    """A lease granted by a :class:`LocalBudget`."""

    __slots__ = ("id", "bound", "priority", "ticket", "_budget", "_held", "_released", "predicted_wait_s")

    def __init__(self, budget: LocalBudget, lease_id: str, bound: int, held: int, priority: int,
                 ticket: Ticket) -> None:
        self.id = lease_id
        self.bound = bound
        self.priority = priority
        self.ticket = ticket
        self._budget = budget
        self._held = held
        self._released = False
        self.predicted_wait_s: float | None = None
        """The wait the budget predicted for this lease when it queued (seconds; None: granted at once
        or not predicted), see docs/admission.md#predicted-wait-and-fail-fast."""

    @property
    def held(self) -> int:
        return self._held

    @property
    def released(self) -> bool:
        return self._released

    def report_held(self, blocks: int) -> None:
        self.report_progress(blocks)

    def update_meta(self, **fields: object) -> None:
        """Merge progress metadata into the lease (see :meth:`Lease.update_meta`); under ``elastic``
        waiters the progress lets in are admitted at once."""
        self.report_progress(None, **fields)

    def report_progress(self, held: int | None = None, **fields: object) -> None:
        """Occupancy and metadata in one short critical section; never blocks on admission."""
        if self._released:
            return
        if held is not None:
            try:
                held = min(max(int(held), 0), self.bound)
            except (TypeError, ValueError):
                logger.warning("ignored report_held(%r) on lease %s: not a number of blocks", held, self.id)
                held = None
            else:
                self._held = held
        if held is None and not fields:
            return
        self._budget._progress(self.id, held, fields)

    async def release(self) -> None:
        # Non-blocking (a short lock), so the async form just calls the sync one; this also keeps
        # release working inside a cancelled scope, where awaiting would raise.
        self.release_sync()

    def release_sync(self) -> None:
        if self._released:
            return
        self._released = True
        self._budget._release(self.id)

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"<LocalLease {self.id} bound={self.bound} held={self._held} priority={self.priority} {state}>"


class _Waiter:
    """A parked caller. ``lease``/``error`` are set under the budget lock before ``wake`` is called."""

    __slots__ = ("id", "bound", "lease", "error", "wake", "event")

    def __init__(self, wid: str, bound: int, wake: Callable[[], None], event: Any) -> None:
        self.id = wid
        self.bound = bound
        self.lease: _LocalLease | None = None
        self.error: BaseException | None = None
        self.wake = wake
        self.event = event


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout)
            or timeout < 0):
        raise ConfigurationError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    return float(timeout)


def _async_waker(event: anyio.Event) -> Callable[[], None]:
    """A wake function for a task parked on ``event``, callable from any thread."""
    owner = threading.get_ident()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:

        def wake() -> None:
            if threading.get_ident() == owner:
                event.set()
            else:
                loop.call_soon_threadsafe(event.set)

        return wake
    # Not asyncio: anyio's other backend is trio, whose token plays the role of call_soon_threadsafe.
    import trio  # noqa: PLC0415 - only reached under trio

    token = trio.lowlevel.current_trio_token()

    def wake_trio() -> None:
        if threading.get_ident() == owner:
            event.set()
        else:
            token.run_sync_soon(event.set)

    return wake_trio


def _async_parking() -> tuple[Callable[[], None], anyio.Event]:
    event = anyio.Event()
    return _async_waker(event), event


class LocalBudget(Budget):
    """An in-process KV-block budget shared by the tasks and threads of one process.

    ``limit_blocks`` is in usable blocks: ``(num_gpu_blocks - 1) x headroom``, see
    docs/admission.md#choosing-limit_blocks.
    ``starvation_bound_s`` bounds backfill (default 2.0 s, as ``Settings.starvation_bound_s``; see
    :mod:`zp_client.budget.ledger`); ``longest_first_s`` is the elastic walk's longest-first window
    (default 0: off, line order; ``Settings.longest_first_s``). ``line`` is the line discipline,
    ``"slo"`` (default: waiters whose ``meta`` ``ttft_target_s`` can still be met go first, earliest
    deadline first; a waiter is passed so for at most ``late_bound_s``; without targets exactly FIFO) or
    ``"fifo"``: see
    docs/admission.md#the-slo-aware-line. ``policy`` is ``"elastic"`` (the
    default: admit on the projected peak of the pool; :mod:`zp_client.budget.elastic`; a lease without
    metadata is reserved at its bound, as strict would), ``"strict"`` (reserve every lease's bound:
    preemption impossible by construction) or a :class:`~zp_client.budget.ledger.ReservationPolicy`
    object (an object with a ``block_size`` must agree with the budget's). ``clock`` (default
    :data:`~zp_client.clock.SYSTEM_CLOCK`) is what the budget reads for line order and backfill, and
    what every transport, default retry policy and retry budget built on the budget reads too (the
    storm passes a :class:`~zp_client.clock.LoopClock` on its virtual-time loop).

    Under ``elastic``, ``acquire(..., meta=...)`` carries what the policy projects from
    (``prompt_tokens``, ``forecast_tokens``, ``streaming``, ``prefix_key``, ``prefix_blocks``), and
    ``lease.report_progress(held, **fields)`` / ``lease.update_meta(**fields)`` record progress
    (``first_token=True``, a re-forecast). Progress can lower the projected peak, so when waiters exist a
    progress report re-runs admission and wakes whoever now fits; with nobody waiting it is only a
    dictionary update under the lock. Under ``strict`` meta and progress metadata are ignored by the
    decision (recorded only).

    ``pin_cap``: pinned prefixes (:meth:`pin`) may hold at most this share of the limit (default 0.2).
    ``server_blocks``: the server's usable pool (``num_gpu_blocks - 1``), which a pinned prefix's
    keep-warm rule counts free blocks from (default: the limit, smaller, so keep-warms come earlier).
    """

    _status_in_process = True

    # How a parked thread waits; a seam for tests that interrupt a wait.
    _new_sync_event: Callable[[], threading.Event] = threading.Event

    def __init__(
        self,
        limit_blocks: int,
        block_size: int = 16,
        *,
        starvation_bound_s: float = DEFAULT_STARVATION_BOUND_S,
        policy: str | ReservationPolicy = "elastic",
        longest_first_s: float = DEFAULT_LONGEST_FIRST_S,
        line: LineName = DEFAULT_LINE,
        late_bound_s: float = DEFAULT_LATE_BOUND_S,
        name: str = "local",
        clock: Clock | None = None,
        pin_cap: float = DEFAULT_PIN_CAP_FRACTION,
        server_blocks: int | None = None,
        predict: bool = False,
    ) -> None:
        self.clock = clock if clock is not None else SYSTEM_CLOCK
        self.predict = bool(predict)
        """Predict every queued waiter's wait at enqueue (``lease.predicted_wait_s``, read by
        ``observe_admissions()`` and the metrics): one bounded replay of the ledger per waiting enqueue.
        A fail-fast waiter is predicted regardless."""
        self._predicted: dict[str, float] = {}
        # waiter id -> (when it queued, its class, the replay's own prediction), for the exact predictions
        # in _predicted (those are corrected by the class's bias): at its grant the replay's error goes to
        # _errors, which the bias and fail-fast's margin read
        self._predicted_from: dict[str, tuple[float, int, float]] = {}
        self._errors = ErrorWindow()
        # waiter id -> when its acquire times out (this budget's clock): the predictor takes it out of
        # line then, as the waiter will leave
        self._leave_at: dict[str, float] = {}
        # the pace last measured on the live leases: the prediction's fallback while none has reported
        self._timing: PoolTiming | None = None
        self.block_size = validate_blocks(block_size, "block_size")
        self.name = name
        pbs = getattr(policy, "block_size", None)
        if not isinstance(policy, str) and pbs is not None and pbs != self.block_size:
            raise ConfigurationError(
                f"the policy's block_size ({pbs}) differs from the budget's ({self.block_size}); "
                "build the policy with the budget's block_size, or pass its name"
            )
        self._ledger = Ledger(
            validate_blocks(limit_blocks, "limit_blocks"),
            policy=make_policy(policy, block_size=self.block_size),
            starvation_bound_s=starvation_bound_s,
            longest_first_s=longest_first_s,
            line=line,
            late_bound_s=late_bound_s,
        )
        self._lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._ids = itertools.count(1)
        self._wakeups = 0
        self._granted_total = 0
        if not isinstance(pin_cap, (int, float)) or not 0 <= pin_cap <= 1:
            raise ConfigurationError(f"pin_cap must be a share of the limit in [0, 1], got {pin_cap!r}")
        self._pin_cap = float(pin_cap)
        if server_blocks is not None:
            self._ledger.pins.server_blocks = validate_blocks(server_blocks, "server_blocks")
        self._keepwarm_listeners: list[Callable[[], None]] = []

    @classmethod
    def from_settings(cls, limit_blocks: int, settings: Settings | None = None, **kwargs: Any) -> LocalBudget:
        """A budget using ``block_size``, ``starvation_bound_s``, ``longest_first_s``, ``line`` and
        ``late_bound_s`` from :class:`~zp_client.Settings`."""
        if settings is None:
            from zp_client.config import Settings  # noqa: PLC0415 - pydantic-settings loads only when a caller asks for Settings

            settings = Settings()
        kwargs.setdefault("starvation_bound_s", settings.starvation_bound_s)
        kwargs.setdefault("longest_first_s", settings.longest_first_s)
        kwargs.setdefault("line", settings.line)
        kwargs.setdefault("late_bound_s", settings.late_bound_s)
        return cls(limit_blocks, settings.block_size, **kwargs)

    @classmethod
    def from_server(
        cls,
        url: str,
        *,
        headroom: float | None = None,
        policy: str = "elastic",
        timeout_s: float = 5.0,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> LocalBudget:
        """A budget sized by the server at ``url`` (``http://host:port`` or ``.../v1``), read once now.

        Reads ``/metrics`` and ``/v1/models`` with :func:`~zp_client.calibration.calibrate` (blocking;
        call it at startup) and returns ``LocalBudget(limit_blocks=floor((num_gpu_blocks - 1) x
        headroom), block_size=<the server's>, policy=policy, **kwargs)``; ``headroom`` defaults to the
        policy's. ``budget.calibration`` records how. Raises :class:`~zp_client.errors.CalibrationError`
        when the server has no usable ``/metrics`` (never a default limit). In async code:
        ``cal = await calibrate_async(url)`` and ``LocalBudget(cal.limit_blocks, cal.block_size)``.
        """
        from zp_client.calibration import calibrate  # noqa: PLC0415 - httpx loads only when asked

        cal = calibrate(url, headroom=headroom, policy=policy, timeout_s=timeout_s, headers=headers)
        kwargs.setdefault("server_blocks", cal.usable_blocks)
        budget = cls(cal.limit_blocks, cal.block_size, policy=policy, **kwargs)
        budget.calibration = cal
        return budget

    @property
    def limit(self) -> int:
        return self._ledger.limit

    @property
    def policy_name(self) -> str:
        return self._ledger.policy.name

    @property
    def reads_forecast_spread(self) -> bool:
        """Whether the policy reads the leases' upper forecasts (``forecast_hi``): an
        :class:`~zp_client.budget.elastic.ElasticPolicy` with a spread-sized reserve (``reserve_z > 0``)
        or a risk reserve (``reserve_k > 0``). The transport sends them only then."""
        policy = self._ledger.policy
        return bool(getattr(policy, "reserve_z", 0) or getattr(policy, "reserve_k", 0))

    # ------------------------------------------------------------------ admission
    def _enter(self, blocks: int, priority: int, ticket: Ticket | None, held: int | None,
               meta: Mapping[str, object] | None = None,
               ) -> tuple[str, _LocalLease | None, list[_Waiter]]:
        """Enqueue and grant (caller holds the lock). Returns (id, own lease if admitted, others to wake)."""
        now = self.clock.monotonic()
        wid = f"L{next(self._ids)}"
        self._ledger.enqueue(wid, blocks, held, priority, now, ticket, meta=meta)
        mine, to_wake = self._hand_out(self._ledger.grant(now), own=wid)
        return wid, mine, to_wake

    def _hand_out(
        self, granted: list[str], own: str | None = None
    ) -> tuple[_LocalLease | None, list[_Waiter]]:
        """Turn ledger grants into leases assigned to their waiters (caller holds the lock)."""
        mine = None
        to_wake: list[_Waiter] = []
        for gid in granted:
            lease = self._new_lease(gid)
            self._granted_total += 1
            if self._predicted:
                lease.predicted_wait_s = self._predicted.pop(gid, None)
                start = self._predicted_from.pop(gid, None)
                if start is not None:
                    self._errors.record(start[1], start[2], self.clock.monotonic() - start[0])
            if self._leave_at:
                self._leave_at.pop(gid, None)
            if gid == own:
                mine = lease
                continue
            waiter = self._waiters.pop(gid)
            waiter.lease = lease
            to_wake.append(waiter)
        return mine, to_wake

    def _new_lease(self, gid: str) -> _LocalLease:
        """The lease object for ledger lease ``gid`` (caller holds the lock; a fleet's names its replica)."""
        rec = self._ledger.leases[gid]
        return _LocalLease(self, gid, rec.bound, rec.held, rec.priority, rec.ticket)

    def _wake(self, waiters: list[_Waiter]) -> None:
        """Wake granted/failed waiters, outside the lock (and nudge keep-warm senders when a pinned
        prefix's keep-warm is due)."""
        if self._keepwarm_listeners:
            self._nudge_keepwarm()
        for w in waiters:
            try:
                w.wake()
            except RuntimeError:
                # The waiter's event loop is closed: nobody will ever take this lease, so return it.
                logger.warning("waiter %s's event loop is gone; releasing its lease", w.id)
                if w.lease is not None:
                    w.lease.release_sync()

    def _release(self, lease_id: str) -> None:
        now = self.clock.monotonic()
        with self._lock:
            if not self._ledger.release(lease_id, now):
                return
            _, to_wake = self._hand_out(self._ledger.grant(now))
        self._wake(to_wake)

    def _progress(self, lease_id: str, held: int | None, fields: Mapping[str, object]) -> None:
        """Record a lease's progress; under a progress-sensitive policy admit whoever now fits."""
        to_wake: list[_Waiter] = []
        with self._lock:
            led = self._ledger
            # the clock is read only for a policy that stamps reports (elastic's late_readers) or a grant
            now = self.clock.monotonic() if getattr(led.policy, "late_readers", False) else None
            live = led.report_held(lease_id, held) if held is not None else lease_id in led.leases
            if fields and live:
                led.update_meta(lease_id, now=now, **fields)
            # Only a policy that reads progress can admit on it, and only if somebody waits.
            if live and led.progress_sensitive and len(led):
                _, to_wake = self._hand_out(led.grant(self.clock.monotonic() if now is None else now))
        if to_wake or self._keepwarm_listeners:
            self._wake(to_wake)

    def _abandon(self, waiter: _Waiter) -> _LocalLease | None:
        """Take a waiter out of line after a timeout or cancellation.

        Returns its lease if the grant already happened (the caller decides: keep it or release it).
        """
        now = self.clock.monotonic()
        with self._lock:
            if waiter.lease is not None or waiter.error is not None:
                return waiter.lease
            self._waiters.pop(waiter.id, None)
            self._predicted.pop(waiter.id, None)
            self._predicted_from.pop(waiter.id, None)
            self._leave_at.pop(waiter.id, None)
            self._ledger.cancel(waiter.id)
            # Removing a waiter (say a starving head) may let the ones behind it in.
            _, to_wake = self._hand_out(self._ledger.grant(now))
        self._wake(to_wake)
        return None

    def _count_wakeup(self) -> None:
        with self._lock:
            self._wakeups += 1

    def _queue(
        self, blocks: int, priority: int, ticket: Ticket | None, held: int | None,
        meta: Mapping[str, object] | None, parking: Callable[[], tuple[Callable[[], None], Any]],
        timeout: float | None = None,
    ) -> tuple[Lease | None, Any]:
        """Enter the line (what ``acquire`` and ``acquire_sync`` share): ``(lease, None)`` when granted at
        once, else ``(None, waiter)`` with the waiter parked on ``parking()``'s ``(wake, event)``. A
        fail-fast waiter (meta ``fail_fast``) whose predicted wait exceeds ``timeout`` leaves the line at
        once with :class:`~zp_client.errors.DeadlineExceeded`."""
        waiter = None
        refused: DeadlineExceeded | None = None
        with self._lock:
            wid, mine, to_wake = self._enter(blocks, priority, ticket, held, meta)
            if mine is None:
                if timeout is not None and isinstance(self._ledger, Ledger):  # what the replay reads
                    self._leave_at[wid] = self.clock.monotonic() + timeout
                refused = self._predict_enqueued(wid, meta, timeout)
            if refused is not None:
                self._leave_at.pop(wid, None)
                self._ledger.cancel(wid)
                _, more = self._hand_out(self._ledger.grant(self.clock.monotonic()))
                to_wake += more
            elif mine is None:
                wake, event = parking()
                waiter = _Waiter(wid, blocks, wake, event)
                self._waiters[wid] = waiter
        self._wake(to_wake)
        if refused is not None:
            raise refused
        return mine, waiter

    def _predict_enqueued(self, wid: str, meta: Mapping[str, object] | None,
                          timeout: float | None) -> DeadlineExceeded | None:
        """Predict a waiter that just queued (caller holds the lock): record its wait for its lease, and
        return the refusal when it opted into fail-fast and the prediction exceeds ``timeout`` (its
        remaining deadline, on this budget's clock). A lower-bound prediction refuses too: the waiter is
        admitted no earlier. Fleets (no single ledger to replay) never predict."""
        fail_fast = bool(meta and meta.get(FAIL_FAST_KEY)) and timeout is not None
        if not (fail_fast or self.predict) or not isinstance(self._ledger, Ledger):
            return None
        now = self.clock.monotonic()
        # the others give up at their timeouts; this one is predicted as if it waited for good, so the
        # refusal compares its whole predicted wait with its timeout
        others = {k: v for k, v in self._leave_at.items() if k != wid}
        try:
            pred = predict_wait_of(self._ledger, wid, now, block_size=self.block_size, leave_at=others,
                                   fallback=self._timing)
        except Exception:  # noqa: BLE001 - a prediction (say a custom policy that cannot be copied)
            logger.debug("wait prediction failed; the waiter waits as without it", exc_info=True)
            return None  # must never fail the enqueue
        if pred is None:
            return None
        measured = pred.timing is not None and pred.timing.samples > 0
        if measured:
            self._timing = pred.timing
        rec = self._ledger.waiter(wid)
        priority = rec.priority if rec is not None else 0
        # reported: the replay's prediction less the class's recent bias (ErrorWindow.bias: 0 at first)
        shown = max(0.0, pred.wait_s - self._errors.bias(priority))
        if pred.exact:
            self._predicted[wid] = shown
            self._predicted_from[wid] = (now, priority, pred.wait_s)
        # refused only on a measured pace (before any lease has reported tokens the pace is a guess), and
        # only when the prediction exceeds the deadline by more than the class's recent over-predictions
        # (ErrorWindow.margin), or, before the budget has seen 20 errors, by more than
        # FAIL_FAST_COLD_FACTOR times the time left (predict.refusal)
        if not fail_fast or timeout is None:
            return None
        errors = self._errors
        refused = refusal(pred, timeout, margin=errors.margin(priority), bias=errors.bias(priority),
                          calibrated=errors.calibrated())
        if refused is not None:
            self._predicted.pop(wid, None)
            self._predicted_from.pop(wid, None)
        return refused

    def _sync_parking(self) -> tuple[Callable[[], None], threading.Event]:
        event = self._new_sync_event()
        return event.set, event

    async def acquire(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, object] | None = None,
    ) -> Lease:
        timeout = _check_timeout(timeout)
        mine, waiter = self._queue(blocks, priority, ticket, held, meta, _async_parking, timeout)
        if mine is not None:
            return mine
        try:
            await self._wait_async(waiter, timeout, meta)
        except BaseException:
            lease = self._abandon(waiter)
            if lease is not None:
                # The grant raced the cancellation: give the blocks back rather than leak them.
                lease.release_sync()
            raise
        return self._outcome(waiter, timeout)

    def acquire_sync(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, object] | None = None,
    ) -> Lease:
        timeout = _check_timeout(timeout)
        mine, waiter = self._queue(blocks, priority, ticket, held, meta, self._sync_parking, timeout)
        if mine is not None:
            return mine
        try:
            self._wait_sync(waiter, timeout, meta)
        except BaseException:  # KeyboardInterrupt and friends while parked
            lease = self._abandon(waiter)
            if lease is not None:
                lease.release_sync()
            raise
        return self._outcome(waiter, timeout)

    async def _wait_async(self, waiter: _Waiter, timeout: float | None,
                          meta: Mapping[str, object] | None) -> None:  # noqa: ARG002 - a subclass's hook
        """Park until granted, failed or ``timeout`` (a fleet wakes up once midway: its affinity wait)."""
        with anyio.move_on_after(timeout):
            await waiter.event.wait()
            self._count_wakeup()

    def _wait_sync(self, waiter: _Waiter, timeout: float | None,
                   meta: Mapping[str, object] | None) -> None:  # noqa: ARG002 - a subclass's hook
        """Blocking form of :meth:`_wait_async`."""
        if waiter.event.wait(timeout):
            self._count_wakeup()

    def _outcome(self, waiter: _Waiter, timeout: float | None) -> Lease:
        if waiter.error is not None:
            raise waiter.error
        if waiter.lease is not None:
            return waiter.lease
        lease = self._abandon(waiter)  # timed out; unless a grant slipped in meanwhile
        if lease is not None:
            return lease
        if waiter.error is not None:
            raise waiter.error
        raise AdmissionTimeout(
            f"waited {timeout:g} s for {waiter.bound} KV blocks without being admitted (budget limit "
            f"{self.limit} blocks is busy); raise the timeout, lower max_tokens, or raise limit_blocks"
        )

    # ------------------------------------------------------------------ control and status
    async def status(self) -> BudgetStatus:
        return self.status_sync()

    def status_sync(self) -> BudgetStatus:
        """Blocking form of :meth:`status` (it never waits on anything but a short lock).

        ``extra`` holds ``wakeups`` (waiters woken so far; every wake-up is a grant or a rejection) and
        ``granted`` (leases granted so far), besides the ledger's facts.
        """
        snap: tuple[Ledger, dict[str, float], PoolTiming | None, dict[int, float]] | None = None
        with self._lock:
            now = self.clock.monotonic()
            s = self._ledger.status(now, block_size=self.block_size)
            s.extra.update({"wakeups": self._wakeups, "granted": self._granted_total, "name": self.name})
            if len(self._ledger) and isinstance(self._ledger, Ledger):
                # only a copy under the lock (O(leases + waiters)); the replay runs on it after the lock
                try:
                    classes = {w.priority for w in self._ledger.line()}
                    snap = (copy.deepcopy(self._ledger), dict(self._leave_at), self._timing,
                            {p: self._errors.bias(p) for p in classes})
                except Exception:  # noqa: BLE001 - status must answer even when the replay cannot run
                    logger.debug("ledger copy failed; status has no predicted wait", exc_info=True)
                    s = replace(s, predicted_wait_s={})
        if snap is not None:
            s = replace(s, predicted_wait_s=self._class_heads_predicted(now, *snap))
        ctl = self.adaptive
        if ctl is not None:
            s.extra["adaptive"] = ctl.state()
        return s

    def _class_heads_predicted(self, now: float, ledger: Ledger, leave_at: dict[str, float],
                               timing: PoolTiming | None, biases: dict[int, float]) -> dict[int, float]:
        """Per priority class, its head's predicted wait (one bounded replay on ``ledger``, a private
        copy of this budget's, which the replay changes), less the class's recent bias (``biases``, as
        a waiter's own prediction is corrected). A class whose head the replay does not reach is
        absent."""
        heads: dict[int, str] = {}
        for w in ledger.line():
            heads.setdefault(w.priority, w.id)
        # the replay stops once every head is admitted
        try:
            waits = predict_waits(ledger, now, block_size=self.block_size, leave_at=leave_at,
                                  fallback=timing, only=heads.values(), in_place=True)
        except Exception:  # noqa: BLE001 - status must answer even when the replay cannot run
            logger.debug("wait prediction failed; status has none", exc_info=True)
            return {}
        return {p: max(0.0, waits[wid] - biases.get(p, 0.0)) for p, wid in heads.items() if wid in waits}

    async def set_limit(self, limit: int) -> None:
        self.set_limit_sync(limit)

    def set_limit_sync(self, limit: int) -> None:
        """Blocking form of :meth:`set_limit`.

        Raising the limit admits waiters at once. Lowering it never revokes a lease: admission pauses until
        enough is released. Waiters larger than the new limit could never be admitted: they fail with
        :class:`~zp_client.LeaseTooLarge`.
        """
        self._set_limit(validate_blocks(limit, "limit_blocks"), None)

    async def compare_and_set_limit(self, expected: int, limit: int, *, keep_size: bool = False) -> bool:
        """Set the limit to ``limit`` only if it is still ``expected``; returns whether it was set. As
        :meth:`set_limit` otherwise (never revokes a lease; waiters larger than a lowered limit fail).
        ``keep_size`` (what an adaptive limit passes): a temporary cut; requests up to the size limit
        before it (:attr:`size_limit`) wait for room instead of failing with
        :class:`~zp_client.LeaseTooLarge`."""
        return self.compare_and_set_limit_sync(expected, limit, keep_size=keep_size)

    def compare_and_set_limit_sync(self, expected: int, limit: int, *, keep_size: bool = False) -> bool:
        """Blocking form of :meth:`compare_and_set_limit` (a short lock, like :meth:`set_limit_sync`):
        the test and the change happen under the budget's lock, so of two callers that read the same
        limit exactly one succeeds."""
        return self._set_limit(validate_blocks(limit, "limit_blocks"),
                               validate_blocks(expected, "expected", minimum=0), keep_size=keep_size)

    @property
    def size_limit(self) -> int:
        """The largest lease this budget takes now: its limit, or the limit before a ``keep_size`` cut
        (an adaptive limit's), which a lease up to it waits for."""
        return self._ledger.size_limit

    def _set_limit(self, limit: int, expected: int | None, *, keep_size: bool = False) -> bool:
        now = self.clock.monotonic()
        with self._lock:
            if expected is not None and self._ledger.limit != expected:
                return False
            rejected = self._ledger.set_limit(limit, now, keep_size=keep_size)
            failed: list[_Waiter] = []
            for wid in rejected:
                waiter = self._waiters.pop(wid)
                self._leave_at.pop(wid, None)
                self._predicted.pop(wid, None)
                self._predicted_from.pop(wid, None)
                waiter.error = LeaseTooLarge(waiter.bound, limit, "the limit was lowered while it waited")
                failed.append(waiter)
            _, to_wake = self._hand_out(self._ledger.grant(now))
        logger.info("budget %s: limit set to %d blocks (%d waiters rejected)", self.name, limit,
                    len(rejected))
        self._wake(failed + to_wake)
        return True

    # ------------------------------------------------------------------ pinned prefixes
    @property
    def supports_pins(self) -> bool:
        return True

    async def pin(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                  span: int | None = None) -> None:
        self.pin_sync(key, blocks, margin=margin, track=track, span=span)

    def pin_sync(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                 span: int | None = None) -> None:
        """Blocking form of :meth:`pin` (a short lock). Needs the elastic policy: only it shares a
        prefix's blocks between leases (and sees the first tokens that keep it warm)."""
        if self.policy_name != "elastic":
            raise ConfigurationError(
                f"pinned prefixes need policy='elastic', this budget is {self.policy_name!r}")
        with self._lock:
            self._ledger.pin(key, blocks, self.clock.monotonic(), margin=margin,
                             cap_fraction=self._pin_cap, track=track, span=span)
        self._wake([])

    async def unpin(self, key: str) -> bool:
        return self.unpin_sync(key)

    def unpin_sync(self, key: str) -> bool:
        """Blocking form of :meth:`unpin`."""
        now = self.clock.monotonic()
        with self._lock:
            if not self._ledger.unpin(key, now):
                return False
            _, to_wake = self._hand_out(self._ledger.grant(now))
        self._wake(to_wake)
        return True

    async def keepwarm_due(self) -> list[str]:
        with self._lock:
            return self._ledger.pins.due(self.clock.monotonic())

    async def claim_keepwarm(self, key: str, ttl_s: float) -> bool:
        with self._lock:
            return self._ledger.pins.claim(key, self.clock.monotonic(), ttl_s)

    def add_keepwarm_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._keepwarm_listeners.append(fn)

    def remove_keepwarm_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._keepwarm_listeners:
                self._keepwarm_listeners.remove(fn)

    def _nudge_keepwarm(self) -> None:
        with self._lock:
            if not self._ledger.pins.due(self.clock.monotonic()):
                return
            listeners = tuple(self._keepwarm_listeners)
        for fn in listeners:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener's failure must not fail the request
                logger.exception("keep-warm listener %r failed", fn)

    async def aclose(self) -> None:
        """A LocalBudget has no background tasks of its own; the process-wide service threads
        (:mod:`zp_client._tasks`) end here when nothing is left for them. What attached to it (an adaptive
        limit, a keep-warm sender) stops first. Live leases are not released."""
        await self._close_attached()
        quiesce()

    def __repr__(self) -> str:
        with self._lock:
            return f"<LocalBudget {self.name} {self._ledger!r}>"

