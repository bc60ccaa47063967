"""The admission ledger: a sans-I/O state machine that *is* the definition of admission.

It never reads a clock and never does I/O: every time-dependent method takes ``now``. The backends
(:mod:`zp_client.budget.local`, the Redis Lua scripts) drive it and decide nothing of their own; the Redis
conformance suite uses it as the model. Vocabulary, the admission rule and the guarantees: see
docs/admission.md#the-ledger and docs/admission.md#the-fair-line.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from zp_client.budget._types import BudgetStatus, ClassStatus, Ticket
from zp_client.budget.pins import PinBook, PinRecord, pin_lease_id
from zp_client.errors import ConfigurationError, InvalidRequest, LeaseTooLarge

__all__ = [
    "AGE_KEY",
    "ANSWER_KEY",
    "DEFAULT_LATE_BOUND_S",
    "DEFAULT_LINE",
    "DEFAULT_LONGEST_FIRST_S",
    "DEFAULT_STARVATION_BOUND_S",
    "Expired",
    "LINES",
    "TPOT_TARGET_KEY",
    "TTFT_TARGET_KEY",
    "LeaseRecord",
    "Ledger",
    "LedgerView",
    "LineName",
    "ReservationPolicy",
    "StrictPolicy",
    "WaiterRecord",
    "line_deadline",
    "slo_walk",
    "validate_blocks",
    "validate_line",
    "validate_seconds",
]

DEFAULT_STARVATION_BOUND_S = 2.0
"""Default backfill bound; see docs/admission.md#the-fair-line for why 2 s."""

DEFAULT_LONGEST_FIRST_S = 0.0
"""Default longest-first window of the elastic walk: off (docs/admission.md#the-fair-line; measured in
docs/elastic.md#longest-first: 15 s cut seed-burst's makespan and TTFT p50 but made agentic's TTFT p99
1.4-3.9x longer)."""

LineName = Literal["fifo", "slo"]
#: The line disciplines a ledger runs (docs/admission.md#the-slo-aware-line).
LINES: tuple[LineName, ...] = ("fifo", "slo")
DEFAULT_LINE: LineName = "slo"
"""The default discipline: the SLO-aware line (docs/admission.md#the-slo-aware-line). With no targets sent
it is exactly the FIFO line; with targets it won the storm (docs/benchmark.md, "Goodput under overload")."""

DEFAULT_LATE_BOUND_S = 60.0
"""How long the SLO-aware line may let other waiters of a class go first (docs/admission.md#the-slo-aware-line
for why 60 s; the storm kept it: 10 s and 30 s lost most of the gain at 2x-4x)."""

#: Waiter metadata the SLO-aware line reads (seconds): the request's TTFT target, relative to the logical
#: request's first arrival; its TPOT target (carried, not read by the order); how old the logical request
#: already is at this enqueue (a retry's age, on the caller's clock); and, for a call whose caller reads
#: the whole answer at once (not streamed), its answer allowance: the forecast output tokens x the TPOT
#: target, the time a streamed call meeting both targets would spend after its first token, which the
#: non-streamed call's SLO grants it (docs/admission.md#targets). The deadline is computed on the
#: backend's clock from them (:func:`line_deadline`), so no two clocks are ever compared.
TTFT_TARGET_KEY, TPOT_TARGET_KEY, AGE_KEY = "ttft_target_s", "tpot_target_s", "age_s"
ANSWER_KEY = "answer_s"


@dataclass(slots=True)
class WaiterRecord:
    """A request waiting in line. Read-only for callers; the ledger owns it."""

    id: str
    bound: int
    held: int
    priority: int
    ticket: Ticket
    since: float
    """``now`` at enqueue: the wait age is ``now - since``."""
    seq: int
    """Arrival sequence; breaks ties between waiters that reuse the same ticket."""
    expires_at: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    deadline: float | None = None
    """The line's deadline on the ledger's clock (:func:`line_deadline`), None without a target."""
    claim_s: float | None = None
    """The claim window: a grant to this waiter is *pending* until :meth:`Ledger.claim`, and returned to
    the pool if not claimed within this many seconds (None: the grant is claimed as it is made)."""
    owner: str | None = None
    """The process that waits (:meth:`Ledger.heard`); its lease keeps it. None: no process (in-process
    backends)."""

    @property
    def key(self) -> tuple[int, int]:
        """Place within the priority class (order, then arrival)."""
        return (self.ticket.order, self.seq)


@dataclass(slots=True)
class LeaseRecord:
    """A live lease. Read-only for callers; the ledger owns it."""

    id: str
    bound: int
    held: int
    priority: int
    ticket: Ticket
    granted_at: float
    expires_at: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    pending: bool = False
    """Granted, not yet claimed by its holder (:meth:`Ledger.claim`): its blocks are reserved (counted in
    the bound sum, so nothing is over-admitted) but it is nobody's held lease; ``expires_at`` is then the
    end of its claim window."""
    owner: str | None = None
    """The holder's process (:meth:`Ledger.heard`), None: none named."""
    ttl: float | None = None
    """The TTL its last claim or renewal gave it (None: never renewed with a TTL)."""
    extension_s: float | None = None
    """Set while its renewal is late and its process alive (:meth:`Ledger.expire`): how much longer than
    ``expires_at`` it may still be kept; cleared by a renewal."""


@dataclass(frozen=True, slots=True)
class Expired:
    """What :meth:`Ledger.expire` removed."""

    leases: list[str]
    waiters: list[str]
    unclaimed: list[str] = field(default_factory=list)
    """Pending grants whose claim window ended (their blocks went back to the pool)."""

    def __bool__(self) -> bool:
        return bool(self.leases or self.waiters or self.unclaimed)


@runtime_checkable
class LedgerView(Protocol):
    """What a reservation policy may read of the ledger (the :class:`Ledger` itself satisfies it)."""

    @property
    def limit(self) -> int: ...

    @property
    def bound_sum(self) -> int: ...

    @property
    def held_sum(self) -> int: ...

    @property
    def leases(self) -> Mapping[str, LeaseRecord]: ...

    # Optional (not part of the protocol, so simple views need not have it): ``version``, an int bumped
    # on every mutation; the Ledger has it and policies may cache on it. ``now``: the time of the grant
    # or status being computed (None when unknown), for policies that project from elapsed time.


@runtime_checkable
class ReservationPolicy(Protocol):
    """The admission seam: decides whether a candidate fits next to the live leases.

    ``fits`` is called during :meth:`Ledger.grant` with the view already updated for every lease admitted
    earlier in the same grant. Policies must be pure functions of the view and the candidate (no clock,
    no I/O), so the Redis port can reproduce them.

    Optional: a policy may define ``exhausted(view) -> bool``, true when no waiter at all can fit (e.g.
    no free block). :meth:`Ledger.grant` then stops walking the line early; it is only a shortcut and
    must agree with ``fits``.

    Optional: ``walk(waiters, now, starvation_bound_s, longest_first_s) -> Iterable[int]``, the order in which
    :meth:`Ledger.grant` tries one priority class's waiters (distinct indices in ``range(len(waiters))``,
    each at most once; default: line order); see :meth:`~zp_client.budget.elastic.ElasticPolicy.walk`.

    Optional: ``admission_meta(bound, meta) -> Mapping``, the meta a waiter is enqueued with (it travels to
    its lease); :class:`~zp_client.budget.elastic.ElasticPolicy` derives ``max_output_tokens`` there.

    Optional: ``progress_sensitive = True`` declares that a lease's progress (``held``, ``meta``) can
    change what fits, so a backend must call :meth:`Ledger.grant` after :meth:`Ledger.report_held` /
    :meth:`Ledger.update_meta` when waiters exist (``strict`` only counts bounds, so it does not).
    A policy may cache work on ``(id(view), view.version)``: the ledger bumps ``version`` on every
    mutation.
    """

    name: str

    def used(self, view: LedgerView) -> int:
        """Blocks this policy counts as taken (reported as ``BudgetStatus.used``)."""
        ...

    def fits(self, view: LedgerView, candidate: WaiterRecord) -> bool:
        """True if ``candidate`` may be admitted now."""
        ...


class StrictPolicy:
    """Admit while the sum of live leases' ``bound`` stays within the limit (preemption impossible)."""

    name = "strict"

    def used(self, view: LedgerView) -> int:
        return view.bound_sum

    def fits(self, view: LedgerView, candidate: WaiterRecord) -> bool:
        return view.bound_sum + candidate.bound <= view.limit

    def exhausted(self, view: LedgerView) -> bool:
        # Every waiter needs at least one block.
        return view.bound_sum >= view.limit

    def __repr__(self) -> str:
        return "StrictPolicy()"


def _check_policy(policy: object) -> ReservationPolicy:
    """``policy`` if it is a :class:`ReservationPolicy` object; else raise :class:`ConfigurationError`."""
    if isinstance(policy, str):
        raise ConfigurationError(
            f"the Ledger takes a policy object, got the name {policy!r}; resolve a name with "
            "zp_client.budget.elastic.make_policy (LocalBudget and RedisBudget take names)"
        )
    if not isinstance(policy, ReservationPolicy):
        raise ConfigurationError(
            f"policy must be a ReservationPolicy (with name, used() and fits()), got {policy!r}"
        )
    return policy


def validate_blocks(blocks: object, what: str = "blocks", *, minimum: int = 1) -> int:
    """Return ``blocks`` if it is an int >= ``minimum``; else raise :class:`ConfigurationError`."""
    if isinstance(blocks, bool) or not isinstance(blocks, int):
        raise ConfigurationError(f"{what} must be an int number of KV blocks, got {blocks!r}")
    if blocks < minimum:
        raise ConfigurationError(f"{what} must be >= {minimum} KV blocks, got {blocks}")
    return blocks


def validate_seconds(value: object, what: str) -> float:
    """Return ``value`` as a float if it is a number of seconds >= 0 (not a bool, not NaN; inf allowed);
    else raise :class:`ConfigurationError`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigurationError(f"{what} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def validate_line(line: object) -> LineName:
    """Return ``line`` if it names a line discipline of :data:`LINES`; else raise
    :class:`ConfigurationError`."""
    if line not in LINES:
        raise ConfigurationError(f"line must be one of {', '.join(map(repr, LINES))}, got {line!r}")
    return line


def _target(meta: Mapping[str, Any], key: str, *, positive: bool) -> float | None:
    v = meta.get(key)
    if v is None:
        return None
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or not (v > 0 if positive else v >= 0)):
        what = "a positive" if positive else "a non-negative"
        raise InvalidRequest(f"meta {key} must be {what} finite number of seconds, got {v!r}", field=key)
    return float(v)


def line_deadline(meta: Mapping[str, Any] | None, now: float) -> float | None:
    """A waiter's deadline on the backend's clock: ``now - age_s + ttft_target_s + answer_s`` (``now`` is
    the enqueue time; ``answer_s`` absent: 0, a streamed call's TTFT deadline), None when ``meta`` has no
    ``ttft_target_s``. Also checks ``tpot_target_s``.

    Raises :class:`~zp_client.errors.InvalidRequest` (naming the key) for a target that is not a
    positive finite number of seconds or an age or answer allowance that is negative or not finite."""
    if not meta:
        return None
    ttft = _target(meta, TTFT_TARGET_KEY, positive=True)
    _target(meta, TPOT_TARGET_KEY, positive=True)
    age = _target(meta, AGE_KEY, positive=False)
    answer = _target(meta, ANSWER_KEY, positive=False)
    if ttft is None:
        return None
    return now - (age or 0.0) + ttft + (answer or 0.0)


def slo_walk(waiters: Sequence[WaiterRecord], now: float, late_bound_s: float) -> list[int] | None:
    """The SLO-aware order in which a grant tries one priority class's waiters (indices into
    ``waiters``, which is in line order), or None for the class's plain walk.

    Three groups: the waiters that have waited at least ``late_bound_s`` ("late-bound", in line order);
    then the waiters whose deadline is still ahead (``deadline > now``), earliest deadline first (line
    order among equal deadlines); then the rest (a deadline already passed, or no target) in line order.
    When no young waiter has a deadline ahead the answer is None: the class walks as under ``fifo``, so a
    line without targets is exactly the FIFO line. The ledger's barrier rule applies in this order."""
    old: list[int] = []
    edf: list[int] = []
    rest: list[int] = []
    for i, w in enumerate(waiters):
        if now - w.since >= late_bound_s:
            old.append(i)
        elif w.deadline is not None and w.deadline > now:
            edf.append(i)
        else:
            rest.append(i)
    if not edf:
        return None
    edf.sort(key=lambda i: (waiters[i].deadline, i))
    return old + edf + rest


def _fits_nobody(view: LedgerView, candidate: WaiterRecord) -> bool:
    """The fit of a grant pass on an exhausted pool (see :meth:`Ledger.grant`)."""
    return False


class Ledger:
    """Leases, the fair line, expiry and limit changes; see docs/admission.md#the-ledger for the rules.

    Example::

        led = Ledger(limit=100)
        led.enqueue("a", bound=60, held=10, priority=0, now=0.0)
        led.enqueue("b", bound=60, held=10, priority=0, now=0.0)
        assert led.grant(now=0.0) == ["a"]        # "b" does not fit next to "a"
        led.release("a", now=1.0)
        assert led.grant(now=1.0) == ["b"]

    ``policy`` is a :class:`ReservationPolicy` object (default: a new :class:`StrictPolicy`).

    Not thread-safe: a backend serialises calls (a lock locally, a Lua script in Redis).
    """

    def __init__(
        self,
        limit: int,
        *,
        policy: ReservationPolicy | None = None,
        starvation_bound_s: float = DEFAULT_STARVATION_BOUND_S,
        longest_first_s: float = DEFAULT_LONGEST_FIRST_S,
        line: LineName = DEFAULT_LINE,
        late_bound_s: float = DEFAULT_LATE_BOUND_S,
    ) -> None:
        self._limit = validate_blocks(limit, "limit", minimum=0)
        self._line: LineName = validate_line(line)
        self._late_bound = validate_seconds(late_bound_s, "late_bound_s")
        self._policy = _check_policy(StrictPolicy() if policy is None else policy)
        self._progress_sensitive = bool(getattr(self._policy, "progress_sensitive", False))
        self._version = 0
        if (not isinstance(starvation_bound_s, (int, float)) or math.isnan(starvation_bound_s)
                or starvation_bound_s < 0):
            raise ConfigurationError(
                f"starvation_bound_s must be a number of seconds >= 0, got {starvation_bound_s!r}"
            )
        self._starvation_bound = float(starvation_bound_s)
        self._longest_first = validate_seconds(longest_first_s, "longest_first_s")
        self._leases: dict[str, LeaseRecord] = {}
        self._waiters: dict[str, WaiterRecord] = {}
        # One sorted list per priority class (sorted by WaiterRecord.key) and the sorted class numbers.
        self._classes: dict[int, list[WaiterRecord]] = {}
        self._class_order: list[int] = []
        self._bound_sum = 0
        self._held_sum = 0
        self._next_order = 0
        self._seq = 0
        self._now: float | None = None
        self._size_limit: int | None = None
        self._pins = PinBook()
        self._pending = 0  # pending grants (LeaseRecord.pending) and their bounds
        self._pending_blocks = 0
        self._heard: dict[str, float] = {}  # process -> the time of its last call (heard)

    # ------------------------------------------------------------------ read-only view
    @property
    def limit(self) -> int:
        return self._limit

    @property
    def size_limit(self) -> int:
        """The largest bound the ledger takes: the limit, or more while a lowered limit is expected back
        (:meth:`set_limit` with ``keep_size``). A bound above it is refused (:class:`LeaseTooLarge`); one
        between the limit and it waits."""
        s = self._size_limit
        return self._limit if s is None or s < self._limit else s

    @property
    def policy(self) -> ReservationPolicy:
        return self._policy

    @property
    def starvation_bound_s(self) -> float:
        return self._starvation_bound

    @property
    def longest_first_s(self) -> float:
        return self._longest_first

    @property
    def line_discipline(self) -> LineName:
        """The line discipline: ``"fifo"`` or ``"slo"`` (docs/admission.md#the-slo-aware-line)."""
        return self._line

    @property
    def late_bound_s(self) -> float:
        """Under the SLO-aware line: how long a waiter may be passed by waiters of its class with an
        earlier deadline before it is tried in line order ahead of them."""
        return self._late_bound

    @property
    def version(self) -> int:
        """A counter bumped by every mutation (enqueue, cancel, admission, release, report_held,
        update_meta, renew, expire, set_limit). Equal versions of one ledger mean equal state."""
        return self._version

    @property
    def now(self) -> float | None:
        """The ``now`` of the grant, status or progress report being computed (the last one given); None
        before any.
        Policies that project from elapsed time (elastic's late-reader extrapolation) read it."""
        return self._now

    @property
    def progress_sensitive(self) -> bool:
        """True when the policy declares that lease progress can admit waiters (see
        :class:`ReservationPolicy`); backends then call :meth:`grant` after progress reports."""
        return self._progress_sensitive

    @property
    def bound_sum(self) -> int:
        """Sum of live leases' ``bound``."""
        return self._bound_sum

    @property
    def held_sum(self) -> int:
        """Sum of live leases' ``held``."""
        return self._held_sum

    @property
    def held_distinct(self) -> int:
        """``held_sum`` with each shared prefix counted once: the policy's ``held_now`` where it has one
        (``elastic``), else ``held_sum``."""
        held_now = getattr(self._policy, "held_now", None)
        return int(held_now(self)) if held_now is not None else self._held_sum

    @property
    def used(self) -> int:
        """Blocks the policy counts as taken."""
        return self._policy.used(self)

    @property
    def leases(self) -> Mapping[str, LeaseRecord]:
        """Live leases by id (treat as read-only)."""
        return self._leases

    # ------------------------------------------------------------------ pinned prefixes
    @property
    def pins(self) -> PinBook:
        """The pinned prefixes and the blocks charged on the server (treat as read-only; see
        :mod:`zp_client.budget.pins`)."""
        return self._pins

    def pin(self, key: str, blocks: int, now: float, *, margin: int | None = None,
            cap_fraction: float | None = None, track: bool = True, span: int | None = None) -> PinRecord:
        """Pin the prefix ``key`` of ``blocks`` full blocks: a lease of its blocks held until
        :meth:`unpin` (id ``pin:<key>``, meta ``pinned``), which the elastic policy counts as a member of
        the prefix's group that never ends, so leases sharing the prefix are not charged for it again.
        Never waits and never revokes: if the pool is full, admission pauses until it fits, as after a
        lowered limit. Idempotent for the same size. Raises :class:`~zp_client.errors.PinRefused` past
        the cap (``cap_fraction`` of the limit, default 20%), :class:`ConfigurationError` for bad
        arguments. ``track=False``: no keep-warm bookkeeping (never due, holds nobody back). ``span``:
        the prefix's blocks on the server, an upper bound (default ``blocks``, which is a lower one:
        what the leases share); the keep-warm line counts from it. Call
        :meth:`grant` after :meth:`unpin`."""
        if cap_fraction is not None:
            if not isinstance(cap_fraction, (int, float)) or not 0 <= cap_fraction <= 1:
                raise ConfigurationError(
                    f"cap_fraction must be a share of the limit in [0, 1], got {cap_fraction!r}")
            self._pins.cap_fraction = float(cap_fraction)
        existing = self._pins.get(key) if isinstance(key, str) else None
        rec = self._pins.add(key, blocks, self._limit, now, margin=margin, track=track, span=span)
        if existing is None:
            lid = pin_lease_id(key)
            self._now = now
            self._version += 1
            self._leases[lid] = LeaseRecord(
                id=lid, bound=blocks, held=blocks, priority=0, ticket=Ticket(0, -1), granted_at=now,
                meta={"prefix_key": key, "prefix_blocks": blocks, "pinned": True})
            self._bound_sum += blocks
            self._held_sum += blocks
        return rec

    def unpin(self, key: str, now: float) -> bool:
        """Drop the pin of ``key``; False if it was not pinned. Call :meth:`grant` next."""
        if self._pins.get(key) is None:
            return False
        self.release(pin_lease_id(key), now)
        return True

    def server_free(self) -> int:
        """The server's free blocks as the keep-warm rule counts them: its pool (``pins.server_blocks``,
        default the limit) less what the live leases hold (``held_sum``), a pinned prefix's blocks once
        (its members' shares not again) and not at all while idle (the server holds them as free, cached
        blocks). Other shared prefixes are counted per lease: conservative (fewer free blocks, earlier
        keep-warms), and what the Redis port computes too."""
        pins = self._pins
        pool = pins.server_blocks or self._limit
        return pool - (self._held_sum - pins.member_shares - pins.idle_blocks())

    def lease(self, lease_id: str) -> LeaseRecord | None:
        return self._leases.get(lease_id)

    def waiter(self, waiter_id: str) -> WaiterRecord | None:
        return self._waiters.get(waiter_id)

    def __contains__(self, ident: object) -> bool:
        return ident in self._leases or ident in self._waiters

    def __len__(self) -> int:
        """Number of waiters."""
        return len(self._waiters)

    def line(self) -> Iterator[WaiterRecord]:
        """Waiters in line order: priority class, then ticket order, then arrival."""
        for p in self._class_order:
            yield from self._classes[p]

    def head(self) -> WaiterRecord | None:
        """The first waiter of the line, or None."""
        if not self._class_order:
            return None
        return self._classes[self._class_order[0]][0]

    # ------------------------------------------------------------------ mutations
    def enqueue(
        self,
        waiter_id: str,
        bound: int,
        held: int | None,
        priority: int,
        now: float,
        ticket: Ticket | None = None,
        *,
        expires_at: float | None = None,
        meta: Mapping[str, Any] | None = None,
        claim_s: float | None = None,
        owner: str | None = None,
    ) -> Ticket:
        """Put a waiter in line and return its ticket. Call :meth:`grant` next.

        ``held`` defaults to ``bound``. ``ticket`` (from an earlier attempt) keeps that place in line; its
        priority class wins over ``priority``. ``expires_at`` lets a backend drop waiters whose owner died
        (see :meth:`renew`, :meth:`expire`); ``None`` never expires. A granted lease keeps the waiter's
        expiry, so a backend that heartbeats waiters keeps heartbeating the lease under the same id.
        ``meta`` travels from the waiter to its lease, for policies that need more than weights; its
        ``ttft_target_s`` / ``age_s`` / ``answer_s`` give the waiter its deadline (:func:`line_deadline`),
        which the SLO-aware line orders by.

        ``claim_s``: the grant -> claim handshake of a backend whose waiters live in other processes
        (docs/redis.md, "Grants are claimed"): a grant to this waiter is pending (reserved, nobody's held
        lease) until :meth:`claim`, and :meth:`expire` returns it to the pool ``claim_s`` seconds after the
        grant if it was not claimed. None (the default, every in-process backend): claimed at once.

        ``owner``: the waiter's process, kept by its lease: a held lease whose renewal is late is kept
        while that process is :meth:`heard` from (:meth:`expire`). None: no process.

        Raises :class:`ConfigurationError` for a weight that is not a positive int, ``held`` outside
        ``[0, bound]``, a non-int priority or a duplicate id, and :class:`LeaseTooLarge` when ``bound``
        exceeds the limit (it could never be admitted), :class:`~zp_client.errors.InvalidRequest` for a
        target or age in ``meta`` that is not a finite number of seconds (positive; the age >= 0).
        """
        validate_blocks(bound, "blocks")
        if held is None:
            held = bound
        validate_blocks(held, "held", minimum=0)
        if held > bound:
            raise ConfigurationError(f"held ({held}) must not exceed the lease's blocks ({bound})")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigurationError(f"priority must be an int (lower = more urgent), got {priority!r}")
        if waiter_id in self._waiters or waiter_id in self._leases:
            raise ConfigurationError(f"id {waiter_id!r} is already waiting or holding a lease in this ledger")
        if bound > self.size_limit:
            raise LeaseTooLarge(bound, self.size_limit)
        if claim_s is not None:
            claim_s = validate_seconds(claim_s, "claim_s")
        deadline = line_deadline(meta, now)
        if ticket is None:
            ticket = Ticket(priority, self._next_order)
            self._next_order += 1
        else:
            if not isinstance(ticket, Ticket):
                raise ConfigurationError(f"ticket must be a zp_client.Ticket, got {ticket!r}")
            # A ticket from elsewhere must not let later arrivals slip in ahead of it.
            if ticket.order >= self._next_order:
                self._next_order = ticket.order + 1
        self._seq += 1
        w = WaiterRecord(
            id=waiter_id,
            bound=bound,
            held=held,
            priority=ticket.priority,
            ticket=ticket,
            since=now,
            seq=self._seq,
            expires_at=expires_at,
            meta=dict(meta) if meta else {},
            deadline=deadline,
            claim_s=claim_s,
            owner=owner,
        )
        prepare = getattr(self._policy, "admission_meta", None)
        if prepare is not None and w.meta:
            w.meta = dict(prepare(bound, w.meta))
        self._waiters[waiter_id] = w
        self._version += 1
        cls = self._classes.get(w.priority)
        if cls is None:
            self._classes[w.priority] = [w]
            bisect.insort(self._class_order, w.priority)
        elif not cls or cls[-1].key < w.key:
            cls.append(w)  # the common case: a new arrival goes last
        else:
            bisect.insort(cls, w, key=_key)
        return ticket

    def cancel(self, waiter_id: str) -> bool:
        """Remove a waiter from the line. Returns False if it is not waiting.

        If it returns False and ``waiter_id`` is a live lease, the grant won the race with the
        cancellation: the backend must :meth:`release` it. Removing a waiter (e.g. a starving barrier)
        can let others in: call :meth:`grant` next.
        """
        w = self._waiters.pop(waiter_id, None)
        if w is None:
            return False
        self._version += 1
        self._remove_from_class(w)
        return True

    def grant(self, now: float) -> list[str]:
        """Admit every waiter the rules allow; returns their ids (now lease ids) in admission order."""
        if not self._waiters:
            return []
        self._now = now
        granted: list[str] = []
        policy = self._policy
        fits = policy.fits
        exhausted = getattr(policy, "exhausted", None)
        if exhausted is not None and exhausted(self):
            if not len(self._pins):
                return granted
            # nobody fits, but the walk still marks the pinned prefixes a waiter would push past their
            # lines (their keep-warms are then due), as the Redis grant pass does
            exhausted = None
            fits = _fits_nobody
        bound_s = self._starvation_bound
        walk = getattr(policy, "walk", None)
        slo = self._line == "slo"
        if len(self._pins):
            fits = self._gated(fits, now)
        for p in list(self._class_order):
            cls = self._classes[p]
            admitted_here: list[int] = []  # indices into cls
            stop = False
            order: Iterable[int] | None = slo_walk(cls, now, self._late_bound) if slo else None
            if order is None:
                order = range(len(cls)) if walk is None else walk(cls, now, bound_s, self._longest_first)
            for i in order:
                w = cls[i]
                if fits(self, w):
                    admitted_here.append(i)
                    self._admit(w, now)
                    granted.append(w.id)
                    # nobody left to walk (a lone acquire's pass): the check, a projection of every live
                    # lease under elastic (the admission changed them), would only end a walk that is
                    # over (issue 33: about 0.3 of the 3.3 ms of client CPU per request in the
                    # 5,000-request storm)
                    if exhausted is not None and self._waiters and exhausted(self):
                        stop = True
                        break
                elif now - w.since >= bound_s:
                    stop = True  # a barrier: capacity drains to it
                    break
            if admitted_here:
                admitted_here.sort()  # a policy's walk may admit out of line order
                if len(admitted_here) == len(cls):
                    del self._classes[p]
                    self._class_order.remove(p)
                elif admitted_here[-1] == len(admitted_here) - 1:
                    del cls[: len(admitted_here)]  # FIFO: a prefix was admitted
                else:
                    for i in reversed(admitted_here):  # backfill: a few from the middle
                        del cls[i]
            if stop:
                break
        return granted

    def fits_now(self, candidate: WaiterRecord) -> bool:
        """Whether the policy would admit ``candidate`` (a waiter of another line, with its meta already
        prepared by :meth:`prepare_meta`) next to the live leases now. Read-only."""
        if len(self._pins) and self._pins.holds_back(candidate.meta, candidate.held, self._now or 0.0):
            return False
        return bool(self._policy.fits(self, candidate))

    def prepare_meta(self, bound: int, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        """The meta a waiter of ``bound`` blocks would be enqueued with here (the policy's
        ``admission_meta``), for a candidate built outside this ledger's line."""
        out = dict(meta) if meta else {}
        prepare = getattr(self._policy, "admission_meta", None)
        if prepare is not None and out:
            out = dict(prepare(bound, out))
        return out

    def admit_record(self, candidate: WaiterRecord, now: float) -> None:
        """Grant ``candidate`` (a waiter of another line: a fleet's, see :mod:`zp_client.fleet.ledger`) a
        lease here at once, whether or not it fits: the caller checked :meth:`fits_now`. Its id must be
        new to this ledger."""
        if candidate.id in self._leases or candidate.id in self._waiters:
            raise ConfigurationError(
                f"id {candidate.id!r} is already waiting or holding a lease in this ledger")
        self._now = now
        self._waiters[candidate.id] = candidate  # _admit moves it to the leases
        self._admit(candidate, now)

    def release(self, lease_id: str, now: float) -> bool:  # noqa: ARG002 - now kept for symmetry/ports
        """Return a lease's blocks. Idempotent: False if it was not live. Call :meth:`grant` next."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._version += 1
        self._bound_sum -= lease.bound
        self._held_sum -= lease.held
        if lease.pending:
            self._pending -= 1
            self._pending_blocks -= lease.bound
        if lease.meta.get("pinned"):
            self._pins.remove(str(lease.meta.get("prefix_key")))
        elif self._pins.is_member(lease_id):  # also after its pin is gone: its share is returned
            self._pins.released(lease_id, self.server_free)
        return True

    def report_held(self, lease_id: str, held: int) -> bool:
        """Record a lease's current occupancy, clamped to ``[0, bound]``. False if not live. Never raises
        for a live id: growth is recorded, never refused."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        try:
            value = int(held)
        except (TypeError, ValueError):
            return False
        value = min(max(value, 0), lease.bound)
        if value != lease.held:
            self._pins.grew(value - lease.held)
            self._version += 1
            self._held_sum += value - lease.held
            lease.held = value
        return True

    def update_meta(self, lease_id: str, *, now: float | None = None, **fields: Any) -> bool:
        """Merge ``fields`` into a live lease's ``meta`` (progress the policy may read: ``first_token``,
        a re-forecast ``forecast_tokens``...). False if not live. Like :meth:`report_held` it records,
        never refuses. Under a progress-sensitive policy call :meth:`grant` next (waiters may now fit).

        ``now``: when the report arrived. A policy with a ``progress_meta(lease, fields, now)`` hook
        (elastic: it stamps growth reports with their time, see
        :func:`~zp_client.budget.elastic.project`) may add fields; without ``now`` the hook is not called."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if now is not None:
            self._now = now
        stamp = getattr(self._policy, "progress_meta", None)
        if stamp is not None and now is not None and fields:
            fields = dict(stamp(lease, fields, now))
        if fields:
            meta = lease.meta if isinstance(lease.meta, dict) else dict(lease.meta)
            meta.update(fields)
            lease.meta = meta
            self._version += 1
            if fields.get("first_token") and len(self._pins):
                self._pins.first_token(lease_id)
        return True

    def renew(self, ident: str, now: float, ttl: float | None) -> bool:
        """Set a lease's or waiter's expiry to ``now + ttl`` (``None``: never). False if unknown. A
        pending grant renewed is claimed (only its holder, who knows of it, renews it): :meth:`claim`."""
        rec: LeaseRecord | WaiterRecord | None = self._leases.get(ident) or self._waiters.get(ident)
        if rec is None:
            return False
        if isinstance(rec, LeaseRecord):
            if rec.pending:
                return self.claim(ident, now, ttl)
            rec.ttl, rec.extension_s = ttl, None
        rec.expires_at = None if ttl is None else now + ttl
        self._version += 1
        return True

    def claim(self, lease_id: str, now: float, ttl: float | None) -> bool:
        """The holder's process claims a pending grant: from now on it is that process's held lease,
        expiring at ``now + ttl`` (``None``: never) like a renewal. Idempotent: a lease already claimed is
        left as it is. False if ``lease_id`` is not a live lease (never granted, released, or its claim
        window ended: :meth:`expire` returned it to the pool)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if lease.pending:
            lease.pending = False
            lease.expires_at = None if ttl is None else now + ttl
            lease.ttl = ttl
            self._pending -= 1
            self._pending_blocks -= lease.bound
            self._version += 1
        return True

    @property
    def pending(self) -> int:
        """Pending grants: granted, not yet claimed (:meth:`claim`)."""
        return self._pending

    @property
    def pending_blocks(self) -> int:
        """The bounds of the pending grants (reserved: part of :attr:`bound_sum`)."""
        return self._pending_blocks

    def heard(self, owner: str, now: float) -> None:
        """A call from process ``owner`` reached the ledger at ``now`` (any call: an acquire, a poll, a
        release, a renewal, a held report). A backend records it before it calls :meth:`expire` in the
        same call, so a process's own call counts for its leases."""
        if now > self._heard.get(owner, -math.inf):
            self._heard[owner] = now

    def expire(self, now: float) -> Expired:
        """Remove leases and waiters whose expiry is ``<= now``, and pending grants whose claim window
        ended (``unclaimed``). Call :meth:`grant` next if non-empty.

        A late renewal of a live process is not a dead holder (docs/redis.md, "A late renewal of a live
        process"): a held lease whose ``owner`` was :meth:`heard` from is reclaimed only one ``ttl`` after
        the later of its last renewal and its process's last call, and at most one ``ttl`` after the
        expiry its last renewal gave it (so a live process that stopped renewing it still loses it). A
        dead process's leases are therefore gone one ``ttl`` after its last call, as before."""
        for rec in self._leases.values():
            if (rec.expires_at is None or rec.expires_at > now or rec.pending or rec.owner is None
                    or rec.ttl is None):
                continue
            last = self._heard.get(rec.owner)
            if last is None:
                continue
            cap = rec.expires_at + (rec.ttl if rec.extension_s is None else rec.extension_s)
            until = min(last + rec.ttl, cap)
            if until > now:
                rec.extension_s = cap - until
                rec.expires_at = until
                self._version += 1
        due = [(lid, rec.pending) for lid, rec in self._leases.items()
               if rec.expires_at is not None and rec.expires_at <= now]
        dead_leases = [lid for lid, pending in due if not pending]
        unclaimed = [lid for lid, pending in due if pending]
        for lid, _ in due:
            self.release(lid, now)
        dead_waiters = [wid for wid, w in self._waiters.items()
                        if w.expires_at is not None and w.expires_at <= now]
        for wid in dead_waiters:
            self.cancel(wid)
        return Expired(dead_leases, dead_waiters, unclaimed)

    def set_limit(self, limit: int, now: float, *,  # noqa: ARG002 - now kept for symmetry/ports
                  keep_size: bool = False) -> list[str]:
        """Change the limit. Never revokes a lease: if ``used`` now exceeds the limit, admission pauses
        until it fits again. Waiters whose ``bound`` exceeds the new :attr:`size_limit` could never be
        admitted: they are removed and their ids returned so the backend can fail them with
        :class:`LeaseTooLarge`. Call :meth:`grant` next (a raise admits waiters).

        ``keep_size``: a temporary cut (an adaptive limit's): the size limit stays at least what it was,
        so requests that fit the limit before the cut wait for it to come back instead of failing. Without
        it the size limit is the new limit."""
        limit = validate_blocks(limit, "limit", minimum=0)
        self._size_limit = max(self.size_limit, limit) if keep_size else None
        self._limit = limit
        self._version += 1
        size = self.size_limit
        rejected = [w.id for w in self._waiters.values() if w.bound > size]
        for wid in rejected:
            self.cancel(wid)
        return rejected

    # ------------------------------------------------------------------ snapshot
    def status(self, now: float, *, block_size: int = 16) -> BudgetStatus:
        """A :class:`~zp_client.budget.base.BudgetStatus` snapshot (``extra`` holds ledger details)."""
        self._now = now
        used = self.used
        per_class = {
            p: ClassStatus(waiters=len(cls), weight=sum(w.bound for w in cls))
            for p, cls in ((p, self._classes[p]) for p in self._class_order)
        }
        head = self.head()
        head_wait = max(0.0, now - head.since) if head is not None else 0.0
        return BudgetStatus(
            limit=self._limit,
            used=used,
            free=max(0, self._limit - used),
            held=self._held_sum,
            leases=len(self._leases),
            waiters=per_class,
            head_wait_s=head_wait,
            policy=self._policy.name,
            block_size=block_size,
            extra={
                "starvation_bound_s": self._starvation_bound,
                "line": self._line,
                **({"late_bound_s": self._late_bound} if self._line == "slo" else {}),
                "head_starving": head is not None and head_wait >= self._starvation_bound,
                "bound_sum": self._bound_sum,
                **({"pending_grants": self._pending, "pending_blocks": self._pending_blocks}
                   if self._pending else {}),
                **({"pins": self._pins.status(), "pinned_blocks": self._pins.pinned_blocks,
                    "pinned_idle_blocks": self._pins.idle_blocks()} if len(self._pins) else {}),
            },
            # what the server holds: idle pinned prefixes are free (cached) blocks there, so an adaptive
            # limit comparing this with the server's KV use does not read them as missing bypass
            held_distinct=self.held_distinct - self._pins.idle_blocks(),
        )

    # ------------------------------------------------------------------ internals
    def _admit(self, w: WaiterRecord, now: float) -> None:
        del self._waiters[w.id]
        self._version += 1
        self._leases[w.id] = LeaseRecord(
            id=w.id,
            bound=w.bound,
            held=w.held,
            priority=w.priority,
            ticket=w.ticket,
            granted_at=now,
            expires_at=w.expires_at if w.claim_s is None else now + w.claim_s,
            meta=w.meta,
            pending=w.claim_s is not None,
            owner=w.owner,
        )
        self._bound_sum += w.bound
        self._held_sum += w.held
        if w.claim_s is not None:
            self._pending += 1
            self._pending_blocks += w.bound
        self._pins.admitted(w.id, w.held, w.meta)

    def _gated(self, fits: Any, now: float) -> Any:
        """``fits`` that also holds back a waiter whose admission would cross a pinned prefix's line
        (:meth:`~zp_client.budget.pins.PinBook.holds_back`)."""
        pins = self._pins

        def gated(view: LedgerView, w: WaiterRecord) -> bool:
            return not pins.holds_back(w.meta, w.held, now) and bool(fits(view, w))

        return gated

    def _remove_from_class(self, w: WaiterRecord) -> None:
        cls = self._classes[w.priority]
        i = bisect.bisect_left(cls, w.key, key=_key)
        # Keys are unique (seq), so index i holds w.
        del cls[i]
        if not cls:
            del self._classes[w.priority]
            self._class_order.remove(w.priority)

    def __repr__(self) -> str:
        return (
            f"Ledger(limit={self._limit}, used={self.used}, leases={len(self._leases)}, "
            f"waiters={len(self._waiters)}, policy={self._policy!r}, line={self._line!r})"
        )


def _key(w: WaiterRecord) -> tuple[int, int]:
    return (w.ticket.order, w.seq)
