"""The fleet ledger: one fair line for a set of replicas, each with a ledger of its own (sans I/O).

A fleet is a set of vLLM replicas of one model. Each replica keeps its own
:class:`~zp_client.budget.ledger.Ledger` (its own limit, sized from its own pool, and its own reservation
policy), so one replica cannot fill while the sum looks fine. There is **one line** for the whole fleet,
with the single budget's rules (priority classes, FIFO, backfill bounded by ``starvation_bound_s``,
retries keeping their ticket): it is a :class:`Ledger` too, whose policy places a waiter instead of
counting blocks. A waiter *fits* when some available replica's policy admits it; fitting places it.

Placement (:meth:`FleetLedger.place`), among the replicas that admit the request now:

1. the replica of its session (``X-ZP-Session``), if it had one;
2. otherwise the one whose prefix cache most likely holds the longest prefix of its prompt
   (:class:`~zp_client.fleet.prefix.PrefixIndex`);
3. ties (no match, equal matches) go to the least projected load (the policy's ``used`` / limit).

When the replica it prefers (its session's, or the best prefix match by at least ``min_affinity_blocks``)
does not admit it but another one does, the waiter waits for it up to ``affinity_wait_s`` from its
arrival, then takes the other one: a cold prefill elsewhere is cheaper than waiting long. A waiter that
waits for its affinity is not a barrier (it fits elsewhere), so the requests behind it keep flowing.

Health: :meth:`FleetLedger.note_failure` counts a replica's consecutive failures (connection errors
eject at once: nothing answers; 5 consecutive 5xx answers or cut streams eject, Envoy's outlier
detection default), :meth:`eject` takes it out for ``base_ejection_s x ejections`` (capped at
``max_ejection_s``) and releases its leases at once, :meth:`readmit` brings it back (its ejection time
over and, with active checks, its ``/health`` answering). When every replica is ejected the fleet
routes to all of them (Envoy's panic mode): sending is better than failing every request locally.

Not thread-safe, never reads a clock: :class:`~zp_client.fleet.local.Fleet` drives it under a lock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from zp_client.budget._types import BudgetStatus, ClassStatus, Ticket
from zp_client.budget.elastic import make_policy
from zp_client.budget.ledger import (
    DEFAULT_LATE_BOUND_S,
    DEFAULT_LINE,
    LeaseRecord,
    Ledger,
    LedgerView,
    LineName,
    ReservationPolicy,
    WaiterRecord,
    validate_blocks,
    validate_seconds,
)
from zp_client.errors import ConfigurationError, LeaseTooLarge
from zp_client.fleet.prefix import DEFAULT_MAX_ENTRIES, PrefixIndex, indexed

__all__ = [
    "DEFAULT_AFFINITY_WAIT_S",
    "DEFAULT_FLEET_STARVATION_BOUND_S",
    "FleetLedger",
    "HealthRules",
    "ReplicaState",
    "AVOID_META",
    "PREFIX_META",
    "SESSION_META",
]

PREFIX_META = "zp_prefix"
"""Lease meta key: the request's prefix keys (:func:`~zp_client.fleet.prefix.prefix_keys`)."""
SESSION_META = "zp_session"
"""Lease meta key: the request's session key (``X-ZP-Session``)."""
AVOID_META = "zp_avoid"
"""Lease meta key: replicas that failed this request already (a move avoids them while others are
available)."""
_ROUTING_META = (PREFIX_META, SESSION_META, AVOID_META)

DEFAULT_AFFINITY_WAIT_S = 0.0
"""How long a waiter waits for its affinity replica when another one has room (see the module
docstring). Off by default: on the agentic storm at 4 replicas (tuning seed 0) a 0.5 s wait raised the
TTFT p50 from 1.57 s to 2.63 s and cut goodput 4% for the same prefix hit rate (55%): the shared
preamble is cached everywhere, and the home replica is preferred whenever it has room anyway."""

DEFAULT_FLEET_STARVATION_BOUND_S = 10.0
"""A fleet's backfill bound: how long a waiter that fits nowhere lets later ones pass before it holds a
replica for itself. Longer than a single budget's 2 s because a hold idles a whole replica while it
drains for one (large) request: on the agentic storm at 4 replicas (tuning seed 0) 2 s gave a TTFT p50
of 1.57 s and 72% of requests within the SLO, 10 s gave 0.22 s, 78% and 12% more goodput, with no
preemption."""

DEFAULT_MIN_AFFINITY_BLOCKS = 4
"""A prefix match worth waiting for: at least this many blocks (64 tokens at vLLM's block size 16) more
than the replica that has room."""

DEFAULT_MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class HealthRules:
    """Outlier detection, after Envoy's (its defaults where they apply: 5 consecutive failures, 30 s base
    ejection growing with each ejection, 300 s at most). A connection that cannot be made ejects at
    once: no server listens there."""

    consecutive_failures: int = 5
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0

    def __post_init__(self) -> None:
        validate_blocks(self.consecutive_failures, "consecutive_failures")
        validate_seconds(self.base_ejection_s, "base_ejection_s")
        validate_seconds(self.max_ejection_s, "max_ejection_s")


@dataclass
class ReplicaState:
    """One replica: its ledger, health and routing counters. Read-only for callers."""

    url: str
    ledger: Ledger
    capacity: int
    """Its pool in blocks, for the prefix index (what its cache can hold)."""
    ejected_until: float | None = None
    """While ejected: when it may come back (None: not ejected)."""
    ejections: int = 0
    last_ejected_at: float | None = None
    failures: int = 0
    """Consecutive failures since its last success."""
    draining: bool = False
    """Left the fleet: takes no new request; forgotten once its last lease ends."""
    placed: int = 0
    prompt_blocks: int = 0
    hit_blocks: int = 0
    """Placements, their prompts' blocks and the blocks the prefix index expected cached there."""
    lost_leases: int = 0
    """Leases that were live on it when it was ejected (they stay until their holders release them)."""
    used_version: int = -1
    used_now: int = 0
    """The policy's used blocks at ledger version ``used_version`` (a cache for ranking)."""

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def summary(self) -> dict[str, object]:
        led = self.ledger
        return {
            "limit": led.limit,
            "used": led.used,
            "held": led.held_sum,
            "leases": len(led.leases),
            "ejected": self.ejected,
            "ejected_until": self.ejected_until,
            "ejections": self.ejections,
            "failures": self.failures,
            "draining": self.draining,
            "placed": self.placed,
            "prefix_hit_rate": round(self.hit_blocks / self.prompt_blocks, 4) if self.prompt_blocks else None,
            "lost_leases": self.lost_leases,
        }


class _Placement:
    """The fleet line's policy: a waiter fits when some replica admits it, and fitting places it.

    Unlike a counting policy it has an effect (the placement), which is what the line's grant is for:
    :meth:`Ledger.grant` admits a waiter exactly when ``fits`` says True, so both agree."""

    name = "fleet"

    def __init__(self, fleet: FleetLedger) -> None:
        self._fleet = fleet

    def used(self, view: LedgerView) -> int:
        return sum(r.ledger.used for r in self._fleet.replicas.values())

    def fits(self, view: LedgerView, candidate: WaiterRecord) -> bool:
        now = getattr(view, "now", None)
        return self._fleet.place(candidate, 0.0 if now is None else float(now))


class FleetLedger:
    """A fleet's line and its replicas' ledgers; see the module docstring.

    ``replicas`` maps each replica's base URL to its limit in blocks (and optionally ``capacity``: its
    pool, default the limit). ``policy_factory()`` makes each replica's reservation policy (one per
    replica: policies cache per ledger). The rest are the line's rules and the routing's knobs.

    The methods a :class:`~zp_client.budget.local.LocalBudget` drives a ledger with are here with the same
    meaning (``enqueue``, ``grant``, ``cancel``, ``release``, ``report_held``, ``update_meta``,
    ``status``, ``leases``, ``limit``, ``size_limit``...), so the fleet's budget is a LocalBudget's shell.
    """

    def __init__(
        self,
        replicas: Mapping[str, int],
        policy_factory: Callable[[], ReservationPolicy],
        *,
        starvation_bound_s: float = DEFAULT_FLEET_STARVATION_BOUND_S,
        affinity_wait_s: float = DEFAULT_AFFINITY_WAIT_S,
        min_affinity_blocks: int = DEFAULT_MIN_AFFINITY_BLOCKS,
        health: HealthRules | None = None,
        max_prefix_entries: int = DEFAULT_MAX_ENTRIES,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        capacities: Mapping[str, int] | None = None,
        line: LineName = DEFAULT_LINE,
        late_bound_s: float = DEFAULT_LATE_BOUND_S,
    ) -> None:
        self._factory = policy_factory
        self.affinity_wait_s = validate_seconds(affinity_wait_s, "affinity_wait_s")
        self.min_affinity_blocks = validate_blocks(min_affinity_blocks, "min_affinity_blocks", minimum=0)
        self.health = health or HealthRules()
        self.index = PrefixIndex(max_prefix_entries)
        self.max_sessions = validate_blocks(max_sessions, "max_sessions")
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.replicas: dict[str, ReplicaState] = {}
        self._where: dict[str, ReplicaState] = {}
        self._matched: dict[str, int] = {}
        self._held_for: set[str] = set()
        self._policy_name: str | None = None
        self._progress_sensitive = False
        self.moves = 0
        """Requests moved off a failed replica without spending a retry (counted by the fleet's shell)."""
        # The line never stops at a barrier itself: a starving waiter holds one replica (the one it will
        # fit on soonest) for itself instead, so the other replicas keep admitting (see place()).
        self._starvation_bound = validate_seconds(starvation_bound_s, "starvation_bound_s")
        # line="slo": the line tries waiters in the SLO-aware order (docs/admission.md#the-slo-aware-line)
        self.line = Ledger(0, policy=_Placement(self), starvation_bound_s=math.inf, line=line,
                           late_bound_s=late_bound_s)
        if not replicas:
            raise ConfigurationError("a fleet needs at least one replica")
        for url, limit in replicas.items():
            self.add_replica(url, limit, (capacities or {}).get(url))

    # ------------------------------------------------------------------ membership
    def add_replica(self, url: str, limit: int, capacity: int | None = None) -> list[str]:
        """Add a replica (or bring back a draining one with this limit). Returns waiters rejected by the
        line's new size limit (none when adding)."""
        validate_blocks(limit, "limit_blocks")
        rep = self.replicas.get(url)
        if rep is not None:
            rep.draining = False
            rep.ledger.set_limit(limit, 0.0)
            rep.capacity = capacity or rep.capacity
        else:
            policy = self._factory()
            if self._policy_name is None:
                self._policy_name = policy.name
                self._progress_sensitive = bool(getattr(policy, "progress_sensitive", False))
            elif policy.name != self._policy_name:
                raise ConfigurationError("every replica of a fleet has the same policy")
            rep = ReplicaState(url, Ledger(limit, policy=policy), capacity or limit)
            self.replicas[url] = rep
        self.index.set_capacity(url, rep.capacity)
        return self._resize_line()

    def remove_replica(self, url: str) -> list[str]:
        """Take a replica out: no new request goes there; it is forgotten once its leases end (at once
        without any). Returns waiters that no remaining replica could ever take (bound too large)."""
        rep = self.replicas.get(url)
        if rep is None:
            return []
        rep.draining = True
        self._forget_if_done(rep)
        return self._resize_line()

    def set_replica_limit(self, url: str, limit: int, now: float, *,
                          keep_size: bool = False) -> list[str]:
        rep = self._replica(url)
        rep.ledger.set_limit(validate_blocks(limit, "limit_blocks", minimum=0), now, keep_size=keep_size)
        return self._resize_line()

    def _replica(self, url: str) -> ReplicaState:
        rep = self.replicas.get(url)
        if rep is None:
            raise ConfigurationError(
                f"{url!r} is not a replica of this fleet (replicas: {', '.join(self.replicas)})")
        return rep

    def _forget_if_done(self, rep: ReplicaState) -> None:
        if rep.draining and not rep.ledger.leases:
            del self.replicas[rep.url]
            self.index.remove(rep.url)

    def _resize_line(self) -> list[str]:
        """The line takes what the largest replica can: its size limit follows the replicas'."""
        size = max((r.ledger.size_limit for r in self.replicas.values() if not r.draining), default=0)
        if size == self.line.limit:
            return []
        return self.line.set_limit(size, 0.0)

    def available(self, now: float) -> list[ReplicaState]:
        """The replicas a request may go to now: not draining, not ejected; all non-draining ones when
        every one is ejected (panic mode)."""
        live = [r for r in self.replicas.values() if not r.draining]
        ok = [r for r in live if r.ejected_until is None]
        return ok or live

    # ------------------------------------------------------------------ placement
    def place(self, w: WaiterRecord, now: float) -> bool:
        """Place ``w`` on the replica the rules choose (module docstring) and return True, or False when
        no replica admits it now (or it waits for its affinity replica)."""
        avail = self.available(now)
        avoid = w.meta.get(AVOID_META)
        if avoid:
            avail = [r for r in avail if r.url not in avoid] or avail
        if self._held_for:
            # an earlier waiter of this grant waits for its affinity replica and will fall back to these:
            # nobody behind it in line takes them meanwhile (its wait must not cost it its room)
            avail = [r for r in avail if r.url not in self._held_for]
        if not avail:
            return False
        keys = w.meta.get(PREFIX_META) or ()
        session = w.meta.get(SESSION_META)
        # a prefix of under one block caches nothing worth routing for (the load decides, as in Redis)
        match = {u: b for u, b in self.index.match(keys).items() if b > 0} if keys else {}
        sess_url = self.sessions.get(session) if session is not None else None
        first = avail[0].ledger
        meta = {k: v for k, v in w.meta.items() if k not in _ROUTING_META}
        cand = WaiterRecord(w.id, w.bound, w.held, w.priority, w.ticket, w.since, w.seq, w.expires_at,
                            first.prepare_meta(w.bound, meta))
        # Rank by (session, prefix match, -projected load) and test fits down the ranking: the first
        # that admits is the choice, so usually one replica's policy runs, not every replica's. The
        # replicas with an affinity are few (they hold a prefix or the session): ranked first; the rest
        # only by load, cheapest first.
        bound = w.bound
        load = self._load
        if match or sess_url is not None:
            liked = [r for r in avail if r.url in match or r.url == sess_url]
            liked.sort(key=lambda r: (1 if r.url == sess_url else 0, match.get(r.url, 0), -load(r, bound)),
                       reverse=True)
        else:
            liked = []
        best = next((r for r in liked if bound <= r.ledger.size_limit and r.ledger.fits_now(cand)), None)
        if best is None:
            others = [r for r in avail if r.url not in match and r.url != sess_url] if liked else avail
            if others:
                lightest, least = others[0], float("inf")
                for r in others:  # min(others, key=load), inlined: this runs for every placement
                    led = r.ledger
                    if r.used_version != led.version:
                        r.used_version, r.used_now = led.version, led.used
                    x = (r.used_now + bound) / (led.limit or 1)
                    if x < least:
                        lightest, least = r, x
                if bound <= lightest.ledger.size_limit and lightest.ledger.fits_now(cand):
                    best = lightest
                else:  # the lightest is full (a bound it cannot hold, a reserve): try the others in order
                    others.sort(key=lambda r: load(r, bound))
                    best = next((r for r in others[1:]
                                 if bound <= r.ledger.size_limit and r.ledger.fits_now(cand)), None)
        if best is None:
            if now - w.since >= self._starvation_bound:
                self._hold_for_starving(avail, bound)
            return False
        pref = liked[0] if liked else best
        # never past the starvation bound: a waiter that old must not become a barrier for the line
        young = now - w.since < min(self.affinity_wait_s, self._starvation_bound)
        if pref is not best and young:
            pref_s, best_s = int(pref.url == sess_url), int(best.url == sess_url)
            gain = match.get(pref.url, 0) - match.get(best.url, 0)
            if pref_s > best_s or (pref_s == best_s and gain >= max(1, self.min_affinity_blocks)):
                self._held_for.add(best.url)
                return False  # worth waiting a little for the replica that has it cached
        best.ledger.admit_record(cand, now)
        self._where[w.id] = best
        best.placed += 1
        if keys:
            hit = min(match.get(best.url, 0), keys[-1][1])
            best.prompt_blocks += max(1, keys[-1][1])
            best.hit_blocks += hit
            if hit:
                self._matched[w.id] = hit
            self.index.insert(best.url, indexed(keys))
        if session is not None:
            self.sessions[session] = best.url
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return True

    def _hold_for_starving(self, avail: list[ReplicaState], bound: int) -> None:
        """A waiter that has waited the starvation bound and fits nowhere: the replica it will fit on
        soonest (the least short of room for it) takes nobody behind it in line until it does — the
        single budget's barrier, on one replica instead of the whole fleet."""
        able = [r for r in avail if bound <= r.ledger.size_limit]
        if able:
            target = min(able, key=lambda r: r.ledger.used + bound - r.ledger.limit)
            self._held_for.add(target.url)

    def _load(self, r: ReplicaState, bound: int) -> float:
        """``r``'s projected load with a candidate of ``bound`` blocks: (the policy's used + bound) /
        limit, the policy's used cached on the replica ledger's version (it changes only when that
        replica places or releases)."""
        led = r.ledger
        if r.used_version != led.version:
            r.used_version, r.used_now = led.version, led.used
        return (r.used_now + bound) / (led.limit or 1)

    def replica_of(self, lease_id: str) -> str | None:
        rep = self._where.get(lease_id)
        return None if rep is None else rep.url

    def matched_blocks(self, lease_id: str) -> int:
        """The blocks of a live lease's prompt the prefix index expected cached on its replica when it was
        placed (0: none, or not a live lease)."""
        return self._matched.get(lease_id, 0)

    # ------------------------------------------------------------------ health
    def note_failure(self, url: str, now: float, *, connect: bool = False) -> bool:
        """A request to ``url`` failed (5xx, a cut stream; ``connect``: no connection could be made).
        Returns True when the replica is (now) ejected."""
        rep = self.replicas.get(url)
        if rep is None:
            return False
        if rep.ejected:
            return True
        rep.failures += 1
        if connect or rep.failures >= self.health.consecutive_failures:
            self.eject(url, now)
            return True
        return False

    def note_success(self, url: str) -> None:
        rep = self.replicas.get(url)
        if rep is not None:
            rep.failures = 0

    def eject(self, url: str, now: float) -> list[str]:
        """Eject ``url`` for its backoff: no new request goes there until it returns. Its live leases
        stay on its ledger (their ids are returned): their streams may still run (a replica ejected for
        5xx answers or a failed probe is alive), and a replica that returns, or that panic mode uses,
        must not be admitted past what it still holds. A dead replica's holders fail at once and release
        them."""
        rep = self._replica(url)
        h = self.health
        if rep.last_ejected_at is not None and h.base_ejection_s > 0:
            # the multiplier decays by one per 10 base ejection times without an ejection (Envoy's
            # decrements it per interval a host stays healthy)
            quiet = now - rep.last_ejected_at
            rep.ejections = max(0, rep.ejections - int(quiet // (10 * h.base_ejection_s)))
        rep.ejections += 1
        rep.last_ejected_at = now
        rep.ejected_until = now + min(h.max_ejection_s, h.base_ejection_s * rep.ejections)
        rep.failures = 0
        live = list(rep.ledger.leases)
        rep.lost_leases += len(live)
        return live

    def due(self, now: float) -> list[str]:
        """Ejected replicas whose ejection time is over (to probe, or to :meth:`readmit` at once)."""
        return [r.url for r in self.replicas.values()
                if r.ejected_until is not None and r.ejected_until <= now]

    def readmit(self, url: str) -> bool:
        """Bring an ejected replica back. False when it was not ejected (or is unknown)."""
        rep = self.replicas.get(url)
        if rep is None or rep.ejected_until is None:
            return False
        rep.ejected_until = None
        rep.failures = 0
        self.index.forget(url)  # it may have restarted: its cache is not what was recorded
        return True

    # ------------------------------------------------------------------ the Ledger surface
    @property
    def limit(self) -> int:
        """The sum of the available replicas' limits (every non-draining one's in panic mode). Safe to read
        without the fleet's lock (it iterates a snapshot)."""
        reps = tuple(self.replicas.values())
        live = [r for r in reps if not r.draining]
        ok = [r for r in live if not r.ejected] or live
        return sum(r.ledger.limit for r in ok)

    @property
    def size_limit(self) -> int:
        return self.line.limit

    @property
    def policy(self) -> ReservationPolicy:
        """The replicas' policy (the first replica's object: they are all alike)."""
        for r in tuple(self.replicas.values()):
            return r.ledger.policy
        return self.line.policy

    @property
    def policy_name(self) -> str:
        return self._policy_name or "strict"

    @property
    def progress_sensitive(self) -> bool:
        return self._progress_sensitive

    @property
    def starvation_bound_s(self) -> float:
        return self._starvation_bound

    @property
    def leases(self) -> Mapping[str, LeaseRecord]:
        return self.line.leases

    @property
    def held_sum(self) -> int:
        return sum(r.ledger.held_sum for r in tuple(self.replicas.values()))

    @property
    def held_distinct(self) -> int:
        return sum(r.ledger.held_distinct for r in tuple(self.replicas.values()))

    @property
    def used(self) -> int:
        return sum(r.ledger.used for r in tuple(self.replicas.values()))

    def __len__(self) -> int:
        return len(self.line)

    def line_order(self) -> Iterator[WaiterRecord]:
        return self.line.line()

    def enqueue(self, waiter_id: str, bound: int, held: int | None, priority: int, now: float,
                ticket: Ticket | None = None, *, expires_at: float | None = None,
                meta: Mapping[str, object] | None = None) -> Ticket:
        """Put a waiter in the fleet's line (see :meth:`Ledger.enqueue`); :class:`LeaseTooLarge` when no
        replica could ever take it."""
        if not self.replicas or self.line.limit == 0:
            raise LeaseTooLarge(bound, 0, "the fleet has no replica with room (none, or every limit is 0)")
        return self.line.enqueue(waiter_id, bound, held, priority, now, ticket, expires_at=expires_at,
                                 meta=meta)

    def cancel(self, waiter_id: str) -> bool:
        return self.line.cancel(waiter_id)

    def grant(self, now: float) -> list[str]:
        self._held_for = set()  # replicas held this pass for an earlier waiter waiting for its affinity
        return self.line.grant(now)

    def release(self, lease_id: str, now: float) -> bool:
        rep = self._where.get(lease_id)
        if rep is None:
            return False
        self._release_on(rep, lease_id, now)
        return True

    def _release_on(self, rep: ReplicaState, lease_id: str, now: float) -> None:
        self._where.pop(lease_id, None)
        self._matched.pop(lease_id, None)
        rep.ledger.release(lease_id, now)
        self.line.release(lease_id, now)
        self._forget_if_done(rep)

    def report_held(self, lease_id: str, held: int) -> bool:
        rep = self._where.get(lease_id)
        if rep is None:
            return False
        self.line.report_held(lease_id, held)
        return rep.ledger.report_held(lease_id, held)

    def update_meta(self, lease_id: str, *, now: float | None = None, **fields: object) -> bool:
        rep = self._where.get(lease_id)
        if rep is None:
            return False
        return rep.ledger.update_meta(lease_id, now=now, **fields)

    def set_limit(self, limit: int, now: float, *, keep_size: bool = False) -> list[str]:
        raise ConfigurationError("a fleet's limit is per replica: use set_replica_limit(url, limit)")

    def status(self, now: float, *, block_size: int = 16) -> BudgetStatus:
        line = self.line.status(now, block_size=block_size)
        limit = self.limit
        used = self.used
        per_class = {p: ClassStatus(c.waiters, c.weight) for p, c in line.waiters.items()}
        prompt = sum(r.prompt_blocks for r in self.replicas.values())
        hits = sum(r.hit_blocks for r in self.replicas.values())
        return BudgetStatus(
            limit=limit,
            used=used,
            free=max(0, limit - used),
            held=self.held_sum,
            leases=len(self.line.leases),
            waiters=per_class,
            head_wait_s=line.head_wait_s,
            policy=self.policy_name,
            block_size=block_size,
            extra={
                "starvation_bound_s": self._starvation_bound,
                "head_starving": line.head_wait_s >= self._starvation_bound and line.head_wait_s > 0,
                "replicas": {url: r.summary() for url, r in self.replicas.items()},
                "prefix_hit_rate": round(hits / prompt, 4) if prompt else None,
                "prefix_index_entries": len(self.index),
                "sessions": len(self.sessions),
                "moves": self.moves,
            },
            held_distinct=self.held_distinct,
        )


def default_factory(policy: str | ReservationPolicy, block_size: int) -> Callable[[], ReservationPolicy]:
    """A policy factory from a name (a fresh policy per replica) or an object (copied per replica when
    it can be: a shared object would share its per-ledger caches, which are keyed by ledger anyway)."""
    if isinstance(policy, str):
        return lambda: make_policy(policy, block_size=block_size)
    return lambda: policy

