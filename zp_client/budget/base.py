"""The budget interface shared by every backend (LocalBudget, RedisBudget).

A *budget* holds a limit in KV blocks. A request takes a *lease* of ``bound`` blocks (the most it may
ever occupy on the server) before it is sent, and releases it when its response ends. Waiters queue
fairly (priority class, then arrival order); see :mod:`zp_client.budget.ledger` for the semantics.

The transport and the retry policy use only what is defined here, so any backend plugs in.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

# The plain value types live in a module of their own so the ledger can use them without this one.
import zp_client._hooks as _hooks  # the module, not the package root (which imports everything)
from zp_client.budget._types import BudgetStatus, ClassStatus, Ticket
from zp_client.budget.retries import LocalRetryBudget, RetryBudget
from zp_client.clock import SYSTEM_CLOCK, Clock
from zp_client.errors import ConfigurationError

if TYPE_CHECKING:
    # AdaptiveLimit is only named (the public signature of adapt()); it attaches from above through
    # zp_client._hooks. Calibration and Settings are below the budget layer.
    from zp_client.adaptive import AdaptiveLimit
    from zp_client.calibration import Calibration
    from zp_client.config import Settings

__all__ = ["Ticket", "Lease", "Budget", "BudgetStatus", "ClassStatus"]


class Lease(abc.ABC):
    """Blocks held in a budget by one request. Release is idempotent and never raises."""

    id: str
    bound: int
    priority: int
    ticket: Ticket

    @property
    @abc.abstractmethod
    def held(self) -> int:
        """Blocks the request occupies now, as last reported."""

    @property
    @abc.abstractmethod
    def released(self) -> bool: ...

    @abc.abstractmethod
    def report_held(self, blocks: int) -> None:
        """Record the request's current occupancy in blocks (its stream advanced).

        Never blocks and never raises: the server generates regardless, so growth is recorded, not
        admitted. Values above ``bound`` are clamped to ``bound``. Cheap enough to call every few
        blocks from a streaming loop; backends may batch.
        """

    def update_meta(self, **fields: object) -> None:  # noqa: B027 - optional hook with a safe default
        """Record progress metadata the budget's policy may read (``first_token=True``, a re-forecast
        ``forecast_tokens=...``; see :mod:`zp_client.budget.elastic`).

        Never blocks and never raises, like :meth:`report_held`. The default ignores the fields: a
        backend whose policy reads no metadata (``strict``) needs none. A backend with a
        progress-sensitive policy (``elastic``) re-runs admission when waiters exist, since progress can
        lower the projected peak.
        """

    def report_progress(self, held: int | None = None, **fields: object) -> None:
        """:meth:`report_held` (when ``held`` is given) and :meth:`update_meta` in one call; backends may
        override it to do both under one lock / round trip."""
        if held is not None:
            self.report_held(held)
        if fields:
            self.update_meta(**fields)

    @abc.abstractmethod
    async def release(self) -> None:
        """Return the blocks. Idempotent; safe to call from any exit path."""

    @abc.abstractmethod
    def release_sync(self) -> None:
        """Blocking form of :meth:`release`, for threads and finalizers. Idempotent."""


log = logging.getLogger("zp_client.budget")
_retry_budget_lock = threading.Lock()


class Budget(abc.ABC):
    """A KV-block budget shared by the requests of one server (one model)."""

    block_size: int

    clock: Clock = SYSTEM_CLOCK
    """The clock this budget reads; transports, retry policies and retry budgets built on it default to
    it (see :mod:`zp_client.clock`). :class:`~zp_client.LocalBudget` takes ``clock=``."""

    _status_in_process = False
    """True where ``status_sync()`` only takes an in-process lock (LocalBudget, Fleet): cheap enough to
    read on every metrics scrape (:mod:`zp_client.metrics`); False where it is a round trip."""

    calibration: Calibration | None = None
    """How the limit was sized when the budget came from ``from_server`` (see
    :mod:`zp_client.calibration`); None for a budget given its limit by hand. Not updated afterwards."""

    @property
    @abc.abstractmethod
    def limit(self) -> int:
        """The current limit in usable blocks."""

    @property
    def policy_name(self) -> str:
        """The reservation policy's name (``"strict"``, ``"elastic"``). The transport sends lease
        metadata (``meta=``: prompt tokens, forecast, prefix) and progress only when it is
        ``"elastic"``. Default ``"strict"``, for backends without policies."""
        return "strict"

    @abc.abstractmethod
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
        """Wait in line for a lease of ``blocks`` blocks and return it.

        ``held`` is what the request occupies at admission (its prompt's blocks; default ``blocks``).
        ``meta`` is what the reservation policy may read about the request (for ``elastic``:
        ``prompt_tokens``, ``forecast_tokens``, ``streaming``, ``prefix_key``, ``prefix_blocks``; see
        :mod:`zp_client.budget.elastic`); policies that read none (``strict``) ignore it.
        ``ticket`` keeps a retried request's place in line. Raises :class:`~zp_client.LeaseTooLarge`
        at once when ``blocks`` exceeds the limit, :class:`~zp_client.AdmissionTimeout` after
        ``timeout`` seconds. Cancellation while waiting leaves no trace in the budget.
        """

    @abc.abstractmethod
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
        """Blocking form of :meth:`acquire` for threads; needs no running event loop."""

    @abc.abstractmethod
    async def status(self) -> BudgetStatus:
        """A read-only snapshot."""

    @abc.abstractmethod
    async def set_limit(self, limit: int) -> None:
        """Change the limit at run time. Raising it admits waiters; lowering it never revokes a lease."""

    async def compare_and_set_limit(self, expected: int, limit: int, *, keep_size: bool = False) -> bool:
        """Set the limit to ``limit`` only if it is still ``expected`` (atomically, with the semantics of
        :meth:`set_limit`); returns whether it was set. What an adaptive limit changes the limit with
        (:mod:`zp_client.adaptive`). ``keep_size``: a temporary cut; a request that fit the limit before it
        waits for room instead of failing with :class:`~zp_client.LeaseTooLarge`.
        :class:`~zp_client.LocalBudget` and :class:`~zp_client.RedisBudget` implement it; this default
        raises :class:`NotImplementedError`."""
        raise NotImplementedError(f"{type(self).__name__} has no compare-and-set of its limit")

    adaptive: AdaptiveLimit | None = None
    """The started :class:`~zp_client.adaptive.AdaptiveLimit` of this budget in this process, or None (at
    most one per budget: a second one's ``start()`` raises :class:`~zp_client.ConfigurationError`)."""

    def adapt(self, server_url: str | None = None, **kwargs: Any) -> AdaptiveLimit:
        """An :class:`~zp_client.adaptive.AdaptiveLimit` for this budget (not started): ``async with
        budget.adapt(url):`` runs it. ``server_url`` defaults to the calibrated server's (a budget made
        by ``from_server``); ``kwargs`` are the controller's (``poll_interval_s``, tuning...)."""
        if server_url is None:
            if self.calibration is None:
                raise ConfigurationError(
                    "budget.adapt() needs the server's URL (this budget was not made by from_server)")
            server_url = self.calibration.url
        factory = _hooks.adaptive_limit  # installed by zp_client/__init__.py, which always runs first
        if factory is None:  # pragma: no cover - only if someone uninstalled it
            raise ConfigurationError("no adaptive limit factory installed (zp_client._hooks)")
        made: AdaptiveLimit = factory(self, server_url, **kwargs)
        return made

    def note_overload(self, status: int) -> None:
        """The server answered ``status`` (429, 503 or 529: overloaded) to a request of this budget; the
        admission core calls it for every such answer. Tells the listeners (an adaptive limit), cheaply;
        with none it does nothing. Never raises."""
        listeners = self.__dict__.get("_zp_overload_listeners")
        if not listeners:
            return
        for fn in tuple(listeners):
            try:
                fn(status)
            except Exception:  # noqa: BLE001 - a listener's failure must not fail the request
                log.exception("overload listener %r failed", fn)

    def add_overload_listener(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(status)`` on every :meth:`note_overload` (from any thread: keep it cheap)."""
        with _retry_budget_lock:
            listeners: list[Callable[[int], None]] = self.__dict__.setdefault("_zp_overload_listeners", [])
            listeners.append(fn)

    def remove_overload_listener(self, fn: Callable[[int], None]) -> None:
        """Undo :meth:`add_overload_listener` (a listener not added is ignored)."""
        with _retry_budget_lock:
            listeners = self.__dict__.get("_zp_overload_listeners") or []
            if fn in listeners:
                listeners.remove(fn)

    # ------------------------------------------------------------------ pinned prefixes
    @property
    def supports_pins(self) -> bool:
        """Whether :meth:`pin` works on this budget (see docs/pinning.md)."""
        return False

    async def pin(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                  span: int | None = None) -> None:
        """Pin the prefix ``key`` of ``blocks`` full KV blocks: the budget holds its blocks once, for as
        long as it is pinned, and leases sharing it (``meta`` ``prefix_key``) are not charged for it
        again; the budget tracks the blocks allocated on the server since the prefix was last released
        and says when a keep-warm request is due (:meth:`keepwarm_due`). ``margin``: blocks kept between
        the charged count and the prefix's eviction (default 2% of the limit, at least 16 and a quarter
        of the prefix). Idempotent for the same size. ``track=False``: hold and share the blocks only
        (the caller keeps the prefix warm its own way: nothing is ever due). ``span``: the prefix's
        blocks on the server, an upper bound (``blocks`` is what leases share, a lower one), which the
        keep-warm rule counts from. Raises :class:`~zp_client.errors.PinRefused` past the pin cap. Most
        callers use :class:`zp_client.PinnedPrefix`, which computes the key and sends the keep-warms."""
        raise ConfigurationError(f"{type(self).__name__} does not support pinned prefixes")

    async def unpin(self, key: str) -> bool:
        """Drop the pin of ``key``; False when it was not pinned."""
        return False

    async def keepwarm_due(self) -> list[str]:
        """Pinned prefix keys whose keep-warm request is due and not yet claimed."""
        return []

    async def claim_keepwarm(self, key: str, ttl_s: float) -> bool:
        """Claim the keep-warm of ``key`` for ``ttl_s`` seconds: True for exactly one caller (across
        processes for a shared budget) while it is due; that caller sends it."""
        return False

    def add_keepwarm_listener(self, fn: Callable[[], None]) -> None:  # noqa: B027 - optional, safe default
        """Call ``fn()`` (from any thread; keep it cheap) when a keep-warm may have become due. A budget
        without notifications never calls it: senders also poll :meth:`keepwarm_due`."""

    def remove_keepwarm_listener(self, fn: Callable[[], None]) -> None:  # noqa: B027 - optional, safe default
        """Undo :meth:`add_keepwarm_listener`."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook with a safe default (nothing to close)
        """Release background resources. Live leases are not released."""

    # ------------------------------------------------------------------ what attaches from above
    def _attach(self, closer: Callable[[], Awaitable[object]],
                sync: Callable[[], object] | None = None) -> None:
        """Something above the budget layer that runs on this budget (an adaptive limit, a keep-warm
        sender) and must stop before it: the budget's ``aclose()`` awaits ``closer()`` first, newest
        first (:meth:`_close_attached`); a blocking ``close_sync()`` calls ``sync()`` (when given: what
        can be stopped without an event loop, a controller on a thread of its own). The owner detaches
        when it closes on its own."""
        with _retry_budget_lock:
            attached: list[Callable[[], Awaitable[object]]] = self.__dict__.setdefault("_zp_attached", [])
            attached.append(closer)
            if sync is not None:
                self.__dict__.setdefault("_zp_attached_sync", {})[closer] = sync

    def _detach(self, closer: Callable[[], Awaitable[object]]) -> None:
        """Undo :meth:`_attach` (one not attached is ignored)."""
        with _retry_budget_lock:
            attached = self.__dict__.get("_zp_attached") or []
            if closer in attached:
                attached.remove(closer)
            (self.__dict__.get("_zp_attached_sync") or {}).pop(closer, None)

    async def _close_attached(self) -> None:
        """Stop what attached to this budget, newest first: the first step of every backend's
        ``aclose()`` (the shutdown order: docs/admission.md#background-work-who-owns-it-and-how-it-stops)."""
        with _retry_budget_lock:
            attached = list(reversed(self.__dict__.get("_zp_attached") or []))
        for closer in attached:
            try:
                await closer()
            except Exception:  # one attachment's failure must not keep the budget open
                log.exception("closing %r with its budget failed", closer)
            self._detach(closer)

    async def _loop_ending(self) -> None:
        """The running event loop is about to end (the thread of an adaptive limit's
        ``start_in_thread()``): stop what this budget runs on it. The budget stays open. By default
        nothing is bound to a loop."""
        return None

    def _close_attached_sync(self) -> None:
        """The blocking form of :meth:`_close_attached` (a budget's ``close_sync()``): stops, newest first,
        what attached with a blocking ``sync`` closer; the others (loop-bound) are left to their owner."""
        with _retry_budget_lock:
            attached = list(reversed(self.__dict__.get("_zp_attached") or []))
            syncs = dict(self.__dict__.get("_zp_attached_sync") or {})
        for closer in attached:
            sync = syncs.get(closer)
            if sync is None:
                continue
            try:
                sync()
            except Exception:
                log.exception("closing %r with its budget failed", sync)  # the others still close
            self._detach(closer)

    def new_retry_budget(
        self, *, ratio: float = 0.5, floor_per_s: float = 0.5, window_s: float = 20.0
    ) -> RetryBudget:
        """A new retry budget matching this KV budget, with these parameters.

        The default is a per-process :class:`~zp_client.retry.LocalRetryBudget`; a backend shared by
        many processes (:class:`~zp_client.RedisBudget`) returns one shared by all of them. Front ends
        use :meth:`retry_budget`, the one shared instance; this is for callers that want their own.
        """
        return LocalRetryBudget(ratio=ratio, floor_per_s=floor_per_s, window_s=window_s,
                                clock=self.clock.monotonic)

    def retry_budget(self, settings: Settings | None = None) -> RetryBudget:
        """The retry budget every front end on this KV budget shares (one per KV budget).

        Made on the first call from ``settings``' ``retry_budget_*`` fields (default
        :class:`~zp_client.Settings`'s), through :meth:`new_retry_budget`; later calls return the same
        object, whatever settings they pass (a differing request is logged at WARNING). Fleet-wide for
        a :class:`~zp_client.RedisBudget`, per process otherwise.
        """
        from zp_client.config import Settings as _Settings

        s = settings if settings is not None else _Settings()
        params = (float(s.retry_budget_ratio), float(s.retry_budget_floor_per_s),
                  float(s.retry_budget_window_s))
        with _retry_budget_lock:
            current: tuple[tuple[float, float, float], RetryBudget] | None = getattr(
                self, "_zp_shared_retry_budget", None)
            if current is None:
                rb = self.new_retry_budget(ratio=params[0], floor_per_s=params[1], window_s=params[2])
                current = (params, rb)
                self._zp_shared_retry_budget = current
            elif current[0] != params:
                log.warning(
                    "retry budget of this KV budget already made with (ratio, floor_per_s, window_s) = %s; "
                    "ignoring %s", current[0], params)
            return current[1]

    def _shared_retry_budget(self) -> RetryBudget | None:
        """The retry budget :meth:`retry_budget` made, or None before its first call (for a backend's
        close, which closes what it handed out)."""
        with _retry_budget_lock:
            made: tuple[tuple[float, float, float], RetryBudget] | None = getattr(
                self, "_zp_shared_retry_budget", None)
        return None if made is None else made[1]

    @contextlib.asynccontextmanager
    async def lease(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, object] | None = None,
    ) -> AsyncIterator[Lease]:
        """``async with budget.lease(blocks) as lease:`` waits, holds, and releases on every exit path."""
        # meta is passed only when given, so a backend written before it existed keeps working.
        extra = {"meta": meta} if meta is not None else {}
        lease = await self.acquire(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                   **extra)
        try:
            yield lease
        finally:
            await lease.release()

    @contextlib.contextmanager
    def lease_sync(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, object] | None = None,
    ) -> Iterator[Lease]:
        """``with budget.lease_sync(blocks) as lease:``, the blocking form for threads."""
        extra = {"meta": meta} if meta is not None else {}
        lease = self.acquire_sync(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                  **extra)
        try:
            yield lease
        finally:
            lease.release_sync()
