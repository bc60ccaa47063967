"""The ``elastic`` reservation policy: admit on the projected peak of the pool, not on max_tokens.

A waiter is admitted only while the projected peak of the live leases (each growing one token per step
until its forecast end, shared prefixes counted once) plus its own stays within the limit. A lease that
reports no metadata is counted at its bound, as ``strict`` does. The projection, its units and the lease
metadata it reads: see docs/elastic.md#the-projection-exactly.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from zp_client.budget.ledger import LedgerView, ReservationPolicy, StrictPolicy, WaiterRecord, validate_blocks
from zp_client.errors import ConfigurationError

__all__ = [
    "DEFAULT_RESERVE_K",
    "DEFAULT_RESERVE_Z",
    "FOREVER",
    "HI_KEY",
    "MAX_OUTPUT_KEY",
    "POLICIES",
    "POLICY_KEYS",
    "ElasticPolicy",
    "Projection",
    "admission_meta",
    "brute_force_peak",
    "held_distinct",
    "make_policy",
    "project",
    "projected_peak",
    "risk_reserve",
    "spread_blocks",
    "spread_reserve",
]


#: The metadata fields the policy reads; a lease with none of them is projected at its bound, forever.
POLICY_KEYS = ("prompt_tokens", "forecast_tokens", "streaming", "tokens", "prefix_key", "prefix_blocks",
               "first_token")

#: A pinned prefix's lease (:meth:`zp_client.budget.ledger.Ledger.pin`) carries ``pinned: True`` with its
#: ``prefix_key`` and ``prefix_blocks``: it holds the prefix's blocks for as long as it is pinned, as a
#: member of the prefix's group that never ends, so every lease sharing the prefix is charged without it
#: (see :func:`_terms_for`).
PINNED_KEY = "pinned"

#: The lease's output bound in tokens (max output tokens, times ``n``). Read only together with
#: ``prompt_tokens``: the lease may end as late as ``prompt_tokens + max_output_tokens`` tokens, which is
#: more than its bound once the server's exact prompt count exceeds the estimate the bound was sized on.
#: A lease without it is capped at its bound. :func:`admission_meta` derives it at enqueue (the ledger and
#: RedisBudget call it), so callers need not send it; it is not one of :data:`POLICY_KEYS` (alone it does
#: not make a lease projected).
MAX_OUTPUT_KEY = "max_output_tokens"

#: Late-reader fields the policy stamps on a growth report (:meth:`ElasticPolicy.progress_meta`; callers
#: do not send them): when the report arrived, and the time and token count of the lease's first stamped
#: report (its read rate since then is its step time as the client saw it). Budget clock seconds.
TOKENS_AT_KEY, RATE_T0_KEY, RATE_N0_KEY = "tokens_at", "rate_t0", "rate_n0"

#: A stream read faster than this many seconds per token (2,000 tokens/s: no decode runs that fast per
#: sequence) is a backlog being drained: the client was not reading while the server generated (see
#: :meth:`ElasticPolicy.progress_meta`).
LATE_BURST_S_PER_TOKEN = 0.0005

#: For this many seconds after a late report, projections extrapolate each lease's tokens from the time
#: elapsed since its last report (:func:`project`); otherwise a report is read as the present.
LATE_WINDOW_S = 1.0

#: Steps of silence a lease is allowed before extrapolation counts it as having grown (a report due at
#: the same instant as a grant may arrive just after it).
LATE_GRACE_STEPS = 1

#: A stream's upper forecast, total output tokens (the transport sends the forecaster's
#: :meth:`~zp_client.forecast.LengthForecaster.spread`). Read only by a policy with a spread-sized
#: reserve (``ElasticPolicy(reserve_z=...)``), see :func:`spread_blocks`; it never changes the projection.
HI_KEY = "forecast_hi"

#: Default ``ElasticPolicy(reserve_k=...)``: the live leases' summed :func:`spread_blocks` times this is
#: kept free (the expected overrun when a quarter of the spread comes due together). Tuned on the storm's
#: seeds 0-3 (agentic 1x: 0 preempted twice without it, 0.25 held and kept the most within SLO of 0.25 /
#: 0.5), held out on seeds 4-6: docs/elastic.md#the-default-reserve.
DEFAULT_RESERVE_K = 0.25
#: Default ``ElasticPolicy(reserve_z=...)``: plus this times the root sum of squares of the spreads (their
#: spread when few long streams hold the pool: agentic 2x seed 5 and 4x seed 4 preempted once each with
#: ``reserve_k`` 0.25 alone; docs/elastic.md#the-default-reserve).
DEFAULT_RESERVE_Z = 0.5
#: Default ``ElasticPolicy(urgent_reserve=...)``: a waiter is admitted only while it also leaves this many
#: times the largest bound among the live leases of a more urgent class (a lower priority number) free, so
#: the next request of that class finds room without waiting for a lease to end (the server's priority
#: scheduler preempts for it; zp never does). Sized as room for two such requests: a rule, not a block count
#: from a workload (docs/admission.md#the-urgent-reserve has its measurements). A no-op while every live
#: lease is of one class.
DEFAULT_URGENT_RESERVE = 2.0
#: The urgent reserve reads the largest bound of at most this many more urgent classes, the nearest ones
#: (the Lua port's work per candidate is one sorted-set read per class, so it is bounded the same way).
URGENT_CLASSES_MAX = 64

#: ``remaining`` of a lease without metadata: later than any projected end (2**53 stays exact in the
#: Lua port's doubles).
FOREVER = 2**53


@dataclass(frozen=True, slots=True)
class Projection:
    """One term of the projection: ``blocks + grows * ceil(t / block_size)`` for ``0 <= t <= remaining``."""

    blocks: int
    remaining: int
    grows: bool = True


#: The meta fields :func:`project` reads without ``now`` (besides the lease's held and bound): a lease's
#: projection is kept while these are unchanged (:meth:`ElasticPolicy._projected`).
_PROJECT_KEYS = (*POLICY_KEYS, PINNED_KEY, MAX_OUTPUT_KEY)

#: A field a meta does not have (presence alone changes a projection: see :func:`project`).
_MISSING = object()
_MISSINGS = (_MISSING,) * len(_PROJECT_KEYS)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def admission_meta(meta: Mapping[str, Any], bound: int, block_size: int) -> Mapping[str, Any]:
    """``meta`` with :data:`MAX_OUTPUT_KEY` derived from the bound when the caller gave ``prompt_tokens``
    and not the key itself: ``bound * block_size - prompt_tokens`` (>= 0), the output room the bound was
    sized for (the request's max output tokens, plus under one block of rounding; less when the bound was
    cut at the model's maximum length). It stays in the lease's meta when ``prompt_tokens`` is later
    replaced by the server's exact count, so the projection's cap follows the exact prompt (see
    :func:`project`). Anything else is returned unchanged."""
    if "prompt_tokens" not in meta or MAX_OUTPUT_KEY in meta:
        return meta
    try:
        room = max(0, bound * block_size - int(meta["prompt_tokens"]))
    except (TypeError, ValueError):
        return meta
    out = dict(meta)
    out[MAX_OUTPUT_KEY] = room
    return out


def cap_tokens(bound: int, block_size: int, meta: Mapping[str, Any]) -> int:
    """The latest end of a lease in tokens: ``max(bound * block_size, prompt_tokens + max_output_tokens)``
    when both are known, else its bound. Never below the bound (the bound stays the reservation); above it
    once the exact prompt exceeds the estimate the bound was sized on."""
    bound_tokens = bound * block_size
    prompt = meta.get("prompt_tokens")
    room = meta.get(MAX_OUTPUT_KEY)
    if prompt is None or room is None:
        return bound_tokens
    return max(bound_tokens, int(prompt) + int(room))


def excess_blocks(bound: int, block_size: int, meta: Mapping[str, Any]) -> int:
    """Blocks by which a lease's cap (:func:`cap_tokens`) exceeds its bound (0 for most leases)."""
    return max(0, _ceil_div(cap_tokens(bound, block_size, meta), block_size) - bound)


def lease_step_s(meta: Mapping[str, Any]) -> float | None:
    """A lease's step time as its reports show it: seconds per token between its first stamped report and
    its last (see :data:`TOKENS_AT_KEY`); None before two reports a token apart."""
    try:
        t0, n0 = float(meta[RATE_T0_KEY]), int(meta[RATE_N0_KEY])
        ta, tk = float(meta[TOKENS_AT_KEY]), int(meta["tokens"])
    except (KeyError, TypeError, ValueError):
        return None
    if tk <= n0 or ta <= t0:
        return None
    return (ta - t0) / (tk - n0)


def late_tokens(meta: Mapping[str, Any], now: float, step_s: float | None = None) -> int:
    """Tokens a streaming lease has probably generated since its last growth report, by the time elapsed
    since that report: ``floor((now - tokens_at) / step) - LATE_GRACE_STEPS`` (>= 0), with the lease's own
    step time (:func:`lease_step_s`) or ``step_s`` (the budget's last learned one) before it has one."""
    at = meta.get(TOKENS_AT_KEY)
    if at is None or meta.get("tokens") is None:
        return 0
    step = lease_step_s(meta) or step_s
    if step is None or step <= 0:
        return 0
    try:
        missed = math.floor((now - float(at)) / step) - LATE_GRACE_STEPS
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(0, missed)


def project(
    *,
    held: int,
    bound: int,
    block_size: int,
    meta: Mapping[str, Any],
    candidate: bool = False,
    now: float | None = None,
    step_s: float | None = None,
) -> Projection:
    """Projection of one lease (or of a candidate about to be admitted) from its metadata.

    A lease that carries none of the policy's metadata (a caller using the budget directly, without
    reporting progress) tells the policy nothing to project: it is reserved at its bound for its whole
    life, exactly as ``strict`` counts it.

    ``now`` (given only while the client is known to read late, see :class:`ElasticPolicy`): a streaming
    lease holds the blocks of where it probably is now, its last report plus :func:`late_tokens` (never
    past its forecast end), and keeps the report's remaining steps: pointwise at least the report's
    projection, so extrapolation only ever counts more."""
    if not any(k in meta for k in POLICY_KEYS) or meta.get(PINNED_KEY):
        return Projection(blocks=bound, remaining=FOREVER, grows=False)
    prompt_tokens = int(meta.get("prompt_tokens", held * block_size))
    # The latest end: the bound, or the exact prompt plus the output bound when that is more.
    cap = cap_tokens(bound, block_size, meta)
    forecast = meta.get("forecast_tokens")
    end_tokens = cap if forecast is None else min(cap, prompt_tokens + int(forecast))
    if not meta.get("streaming", True):
        # The client cannot see its growth: hold the forecast end for as long as the forecast runs.
        blocks = min(_ceil_div(cap, block_size), _ceil_div(end_tokens, block_size))
        return Projection(blocks=blocks, remaining=max(0, end_tokens - prompt_tokens), grows=False)
    if candidate:
        held = _ceil_div(prompt_tokens, block_size)
    # Fewest tokens the lease may hold now: its remaining steps are counted from there (conservative).
    tokens_low = max(prompt_tokens, (held - 1) * block_size + 1) if held > 0 else prompt_tokens
    tokens = meta.get("tokens")
    if tokens is not None and not candidate:
        # Reported with held: the exact count, so a stream on schedule does not look one block ahead.
        tokens_low = max(tokens_low, min(int(tokens), held * block_size))
    if tokens_low >= end_tokens and end_tokens < cap:
        # Outgrew its forecast and nobody re-forecast yet: project to the cap (tightens at once).
        end_tokens = cap
    remaining = max(0, end_tokens - tokens_low)
    if now is not None and tokens is not None and not candidate:
        # A late reader: the server went on generating since the last report (up to the forecast end),
        # so the lease holds more blocks now than reported. Its end is left where the report puts it:
        # the term only grows (at every instant at least the report's projection), so a wrong step time
        # can make the pool look fuller, never emptier.
        late = late_tokens(meta, now, step_s)
        if late:
            held = max(held, _ceil_div(min(end_tokens, int(tokens) + late), block_size))
    return Projection(blocks=held, remaining=remaining, grows=True)


def spread_blocks(*, held: int, bound: int, block_size: int, meta: Mapping[str, Any],
                  candidate: bool = False) -> int:
    """A live streaming lease's forecast uncertainty in blocks: how many blocks later than its projected
    (forecast) end it would end at its upper forecast :data:`HI_KEY`, both capped at the lease's cap.

    0 for a lease that is not projected (no metadata: counted at its bound for life), not streamed (held
    at its forecast end, nothing to correct), without ``forecast_hi`` or ``forecast_tokens``, or that has
    already outgrown its forecast (the projection then runs it to its cap). ``candidate``: a waiter about
    to be admitted, read as :func:`project` reads it."""
    if not any(k in meta for k in POLICY_KEYS) or not meta.get("streaming", True):
        return 0
    forecast, hi = meta.get("forecast_tokens"), meta.get(HI_KEY)
    if forecast is None or hi is None:
        return 0
    prompt_tokens = int(meta.get("prompt_tokens", held * block_size))
    cap = cap_tokens(bound, block_size, meta)
    end = min(cap, prompt_tokens + int(forecast))
    if candidate:
        held = _ceil_div(prompt_tokens, block_size)
    tokens_low = max(prompt_tokens, (held - 1) * block_size + 1) if held > 0 else prompt_tokens
    tokens = meta.get("tokens")
    if tokens is not None and not candidate:
        tokens_low = max(tokens_low, min(int(tokens), held * block_size))
    if tokens_low >= end:
        return 0
    hi_end = min(cap, prompt_tokens + max(int(hi), int(forecast)))
    return max(0, _ceil_div(hi_end, block_size) - _ceil_div(end, block_size))


def urgent_room(bound: int, urgent_reserve: float) -> int:
    """``ceil(urgent_reserve x bound)`` in exact integer arithmetic on the thousandths ``urgent_reserve``
    is rounded to (the Lua port computes the same from the stored thousandths)."""
    milli = round(urgent_reserve * 1000)
    return bound * (milli // 1000) + -(-(bound * (milli % 1000)) // 1000)


def spread_reserve(sum_sq: int, z: float) -> int:
    """The reserve in blocks for live leases whose :func:`spread_blocks` squared sum to ``sum_sq``:
    ``ceil(z * sqrt(sum_sq))`` (independent errors add in quadrature; ``z`` scales the upper forecasts'
    spread to the reserve), exact in integers with ``z`` taken in thousandths."""
    if z <= 0 or sum_sq <= 0:
        return 0
    # ceil(z * sqrt(s)) = smallest r with r*r >= z*z*s; decided in integers with z in thousandths.
    zm = round(z * 1000)
    target = zm * zm * sum_sq  # (1000 r)^2 >= target
    r = math.isqrt(target) // 1000
    while (1000 * r) ** 2 < target:
        r += 1
    while r > 0 and (1000 * (r - 1)) ** 2 >= target:
        r -= 1
    return r


def risk_reserve(spread_sum: int, k: float) -> int:
    """The risk reserve in blocks for live leases whose :func:`spread_blocks` sum to ``spread_sum``:
    ``ceil(k * spread_sum)``, exact in integers with ``k`` taken in thousandths. Linear, not in
    quadrature: the streams admitted together under one route's forecast outgrow it together (a
    correlated error, docs/elastic.md#risk-reserve), which a quadrature sum undercounts."""
    if k <= 0 or spread_sum <= 0:
        return 0
    km = round(k * 1000)
    return -(-(km * spread_sum) // 1000)


def _remaining(p: Projection) -> int:
    return p.remaining


class _Profile:
    """The pool's projected occupancy at every lease end, prepared for O(log n) candidate checks."""

    __slots__ = ("bs", "ends", "values", "pre_max", "suf_max", "suf_blocks", "suf_growers", "sparse",
                 "groups")

    def __init__(self, terms: list[Projection], block_size: int, groups: dict[str, tuple[int, int]]) -> None:
        self.bs = bs = block_size
        self.groups = groups  # prefix_key -> (prefix blocks, remaining of the group's pseudo term)
        terms = sorted(terms, key=_remaining)
        self.ends = ends = [p.remaining for p in terms]
        # Suffix sums over terms alive at ends[j] (remaining >= ends[j]).
        neg_inf = float("-inf")
        suf_blocks = list(accumulate(reversed([p.blocks for p in terms]), initial=0))
        suf_blocks.reverse()
        suf_growers = list(accumulate(reversed([1 if p.grows else 0 for p in terms]), initial=0))
        suf_growers.reverse()
        self.suf_blocks, self.suf_growers = suf_blocks, suf_growers
        # values[j]: total at instant ends[j]. Equal ends are evaluated at their first index (all alive).
        values: list[int] = []
        ceils = [-(-e // bs) for e in ends]
        k, prev = 0, None
        for j, e in enumerate(ends):
            if e != prev:
                k, prev = j, e
            values.append(suf_blocks[k] + suf_growers[k] * ceils[j])
        self.values = values
        # pre_max[j] = max over i < j of values[i] + ceil(ends[i]/bs) (a candidate alive there adds that).
        self.pre_max: list[float] = list(accumulate(map(operator.add, values, ceils), max, initial=neg_inf))
        suf_max: list[float] = list(accumulate(reversed(values), max, initial=neg_inf))
        suf_max.reverse()
        self.suf_max = suf_max
        self.sparse: list[list[float]] | None = None

    def peak(self) -> int:
        now = self.suf_blocks[0]
        return int(max(now, self.suf_max[0])) if self.ends else now

    def _range_max(self, lo: int, hi: int) -> float:
        """max over lo <= i < hi of values[i] + ceil(ends[i]/bs) (sparse table, built on first use)."""
        if lo >= hi:
            return float("-inf")
        sparse = self.sparse
        if sparse is None:
            base: list[float] = [v + _ceil_div(e, self.bs)
                                 for v, e in zip(self.values, self.ends, strict=True)]
            sparse = [base]
            width = 1
            while 2 * width <= len(base):
                prev = sparse[-1]
                sparse.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
                width *= 2
            self.sparse = sparse
        k = (hi - lo).bit_length() - 1
        row = sparse[k]
        return max(row[lo], row[hi - (1 << k)])

    def peak_with(self, c: Projection, extra_prefix: tuple[int, int] | None = None) -> int:
        """Projected peak if the candidate ``c`` joins. ``extra_prefix = (blocks, from_end)``: the candidate
        extends a shared prefix's life from ``from_end`` to ``c.remaining`` (it outlives the group)."""
        bs = self.bs
        rc = c.remaining
        grow_c = 1 if c.grows else 0
        # Instants where the candidate is alive: ends <= rc, i.e. indices [0, hi).
        hi = bisect.bisect_right(self.ends, rc)
        best: float = self.suf_max[hi]  # after the candidate ends: unchanged
        alive_best = (self.pre_max[hi] if grow_c else self.suf_max_before(hi)) + c.blocks
        best = max(best, alive_best)
        # The candidate's own end instant (everything with remaining >= rc is alive, plus the candidate).
        k = bisect.bisect_left(self.ends, rc)
        at_end = (self.suf_blocks[k] + self.suf_growers[k] * _ceil_div(rc, bs) + c.blocks
                  + grow_c * _ceil_div(rc, bs))
        if extra_prefix is not None:
            pblocks, from_end = extra_prefix
            at_end += pblocks
            lo = bisect.bisect_right(self.ends, from_end)
            if grow_c:
                best = max(best, self._range_max(lo, hi) + c.blocks + pblocks)
            else:
                best = max(best, max(self.values[lo:hi], default=float("-inf")) + c.blocks + pblocks)
        best = max(best, at_end, self.suf_blocks[0] + c.blocks)
        return int(best)

    def suf_max_before(self, hi: int) -> float:
        return max(self.values[:hi], default=float("-inf"))


def _pinned_groups(items: list[tuple[Projection, Mapping[str, Any]]]) -> dict[str, int]:
    """``prefix_key -> blocks`` of the pinned prefixes among ``items`` (leases with :data:`PINNED_KEY`)."""
    out: dict[str, int] = {}
    for _, m in items:
        if m.get(PINNED_KEY) and m.get("prefix_key") is not None:
            out[m["prefix_key"]] = max(0, int(m.get("prefix_blocks", 0)))
    return out


def _shared_prefixes(
    items: list[tuple[Projection, Mapping[str, Any]]], pinned: dict[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, int]]:
    """The shared-prefix rule of the projection (and of :func:`held_distinct`): per ``prefix_key`` whose
    prefix is cached (a member with ``first_token`` and ``prefix_blocks``), the prefix blocks counted once,
    and how many growing members share it. A member cannot share more than it holds: the group's prefix
    is the smallest member's at most. The last qualifying member's ``prefix_blocks`` wins, in lease order.
    Pinned prefixes are not in it: :func:`_pinned_groups` has them (``pinned``, when the caller has it)."""
    if pinned is None:
        pinned = _pinned_groups(items)
    active: dict[str, int] = {}
    for _, m in items:
        key = m.get("prefix_key")
        if (key is not None and key not in pinned and m.get("first_token")
                and int(m.get("prefix_blocks", 0)) > 0):
            active[key] = int(m["prefix_blocks"])
    members: dict[str, int] = {}
    for p, m in items:
        key = m.get("prefix_key")
        if key in active and p.grows:
            active[key] = min(active[key], p.blocks)
            members[key] = members.get(key, 0) + 1
    return active, members


def _pin_share(pblocks: int, p: Projection, m: Mapping[str, Any]) -> int:
    """Blocks of a pinned prefix of ``pblocks`` that a member ``(p, m)`` is not charged for: the pin
    holds them. A member shares at most its own ``prefix_blocks`` and what it holds."""
    return max(0, min(pblocks, int(m.get("prefix_blocks", pblocks)), p.blocks))


def _terms_for(
    leases: Iterable[tuple[int, int, Mapping[str, Any]]], block_size: int,
    now: float | None = None, step_s: float | None = None,
) -> tuple[list[Projection], dict[str, tuple[int, int]]]:
    """Projection terms of live leases ``(held, bound, meta)``, shared prefixes counted once.

    A pinned prefix (a lease with :data:`PINNED_KEY`) is its own term, its blocks forever; every other
    lease with its ``prefix_key``, growing or not, is charged without the shared part (:func:`_pin_share`),
    and its group is ``(blocks, FOREVER)`` so a candidate sharing it is charged without it too."""
    items = [(project(held=h, bound=b, block_size=block_size, meta=m, now=now, step_s=step_s), m)
             for h, b, m in leases]
    return _terms_from_items(items)


def _terms_from_items(
    items: list[tuple[Projection, Mapping[str, Any]]],
) -> tuple[list[Projection], dict[str, tuple[int, int]]]:
    """:func:`_terms_for` of leases already projected: ``(projection, meta)`` in lease order."""
    pinned = _pinned_groups(items)
    active, _ = _shared_prefixes(items, pinned)
    terms: list[Projection] = []
    group_end: dict[str, int] = {}
    for p, m in items:
        key = m.get("prefix_key")
        if key in pinned and not m.get(PINNED_KEY):
            terms.append(Projection(p.blocks - _pin_share(pinned[key], p, m), p.remaining, p.grows))
        elif key in active and p.grows:
            terms.append(Projection(p.blocks - active[key], p.remaining, True))
            group_end[key] = max(group_end.get(key, -1), p.remaining)
        else:
            terms.append(p)
    groups: dict[str, tuple[int, int]] = {}
    for key, end in group_end.items():
        terms.append(Projection(active[key], end, grows=False))
        groups[key] = (active[key], end)
    for key, blocks in pinned.items():
        groups[key] = (blocks, FOREVER)
    return terms, groups


def held_distinct(leases: Iterable[tuple[int, int, Mapping[str, Any]]], block_size: int) -> int:
    """The blocks live leases ``(held, bound, meta)`` report holding now, each shared prefix counted once
    among the streaming leases that share it (those the projection groups: a ``prefix_key``, a first
    token seen), as the server's prefix cache holds it once. The sum of ``held`` less, per group of k
    such leases, (k - 1) x the group's prefix blocks."""
    leases = list(leases)
    items = [(project(held=h, bound=b, block_size=block_size, meta=m), m) for h, b, m in leases]
    active, members = _shared_prefixes(items)  # without now, a grower's projected blocks are its held
    pinned = _pinned_groups(items)
    # A pinned prefix is held by its pin lease: its members hold only what they add to it.
    pin_shared = sum(_pin_share(pinned[m["prefix_key"]], p, m) for p, m in items
                     if m.get("prefix_key") in pinned and not m.get(PINNED_KEY))
    return (sum(h for h, _, _ in leases) - sum(active[k] * (n - 1) for k, n in members.items())
            - pin_shared)


def projected_peak(leases: Iterable[tuple[int, int, Mapping[str, Any]]], block_size: int,
                   now: float | None = None, step_s: float | None = None) -> int:
    """The projected peak in blocks of live leases given as ``(held, bound, meta)`` (``now``, ``step_s``:
    see :func:`project`)."""
    terms, groups = _terms_for(leases, block_size, now, step_s)
    return _Profile(terms, block_size, groups).peak()


def brute_force_peak(terms: Iterable[Projection], block_size: int) -> int:
    """Reference for tests: step through every future instant and sum what is alive."""
    terms = list(terms)
    # Terms without metadata live FOREVER at a constant size: they are alive at every finite instant,
    # so stepping to the last finite end covers the maximum.
    horizon = max((p.remaining for p in terms if p.remaining < FOREVER), default=0)
    best = 0
    for t in range(horizon + 1):
        total = sum(p.blocks + (_ceil_div(t, block_size) if p.grows else 0)
                    for p in terms if p.remaining >= t)
        best = max(best, total)
    return best


class ElasticPolicy:
    """Admit a waiter while the projected peak, with the waiter, stays within the limit.

    The policy keeps a reserve for forecast error free below the limit, sized from the live leases' (and
    the candidate's) forecast spread (:meth:`reserve`): ``reserve_k`` times their sum (errors that move
    together add linearly: the expected overrun) plus ``reserve_z`` times their root sum of squares (its
    spread), :data:`DEFAULT_RESERVE_K` and :data:`DEFAULT_RESERVE_Z` by default, for a limit of the whole
    pool (docs/elastic.md#the-default-reserve). Both 0: nothing kept back (a limit below the pool is then
    the only reserve, as before issue 30).

    Across priority classes it also keeps an **urgent reserve** (:meth:`urgent_blocks`): a waiter is
    admitted only while it fits under the limit less ``urgent_reserve`` times the largest bound among the
    live leases of a more urgent class (:data:`DEFAULT_URGENT_RESERVE`; 0: off). With one class live it
    keeps nothing (docs/admission.md#the-urgent-reserve).

    ``used`` reports the projected peak of the live leases. The policy keeps a cache of the prepared
    projection keyed on the ledger's ``version`` (when it has one), so a grant that checks many waiters
    against an unchanged pool costs O(log n) per waiter. Each lease's projection is kept between versions,
    keyed on every input it reads, so a new version re-projects only the leases that changed (the
    terms and the profile are still rebuilt, O(n log n)); see benchmarks/elastic_prepare.py.
    """

    name = "elastic"
    progress_sensitive = True
    """Progress (held growth, ``first_token``, a re-forecast) can let waiters in: backends grant after
    progress reports (see :class:`~zp_client.budget.ledger.ReservationPolicy`)."""

    def __init__(self, block_size: int = 16, *, reserve_z: float = DEFAULT_RESERVE_Z,
                 reserve_k: float = DEFAULT_RESERVE_K, late_readers: bool = False,
                 urgent_reserve: float = DEFAULT_URGENT_RESERVE) -> None:
        for name, value in (("reserve_z", reserve_z), ("reserve_k", reserve_k),
                            ("urgent_reserve", urgent_reserve)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and 0 <= value <= 100):
                raise ConfigurationError(f"{name} must be a number in [0, 100], got {value!r}")
        self.block_size = block_size
        self.reserve_z = round(float(reserve_z), 3)
        """Spread-sized reserve: admission keeps ``spread_reserve(sum of spread_blocks^2, reserve_z)``
        blocks free below the limit (:func:`spread_reserve`; independent errors in quadrature). 0: off."""
        self.reserve_k = round(float(reserve_k), 3)
        """Risk reserve for correlated forecast error: admission keeps ``ceil(reserve_k x sum of
        spread_blocks)`` blocks free below the limit (:func:`risk_reserve`; the live leases' and the
        candidate's spreads added linearly, as errors that move together add). 0: off."""
        self.urgent_reserve = round(float(urgent_reserve), 3)
        """Room kept for more urgent classes: a waiter of priority ``p`` is admitted only while it fits
        under the limit less ``ceil(urgent_reserve x`` the largest bound among the live leases of
        priority ``< p``) (:meth:`urgent_blocks`; pins excluded). 0: off."""
        self._urgent_key: object = None
        self._urgent: tuple[list[int], list[int]] = ([], [])  # classes live, the largest bound of each
        self._spread_key: object = None
        self._spread_total = 0
        self._spread_lin = 0
        self.late_readers = late_readers
        """Whether growth reports are stamped and extrapolated for a late reader (:meth:`progress_meta`,
        opt-in; docs/elastic.md#late-readers has the measurements behind the default). False (default)
        reads every report as the present."""
        self._cache_key: object = None
        self._profile: _Profile | None = None
        self._lease_cache: dict[str, tuple[tuple[object, ...], Projection]] = {}
        self._lease_cache_view: int | None = None
        self._excess_key: object = None
        self._excess_sum = 0
        self._excess_cache: dict[str, tuple[tuple[object, ...], int]] = {}
        self._excess_cache_view: int | None = None
        self.late_at: float | None = None
        """When a growth report last showed the client reading late (see :meth:`progress_meta`)."""
        self.step_s: float | None = None
        """The last step time learned from a lease's reports (:func:`lease_step_s`): the fallback for
        leases too young to have their own."""

    def progress_meta(self, lease: Any, fields: Mapping[str, Any], now: float) -> Mapping[str, Any]:
        """Stamp a growth report (``fields`` with ``tokens``) of ``lease`` arriving at ``now``; the ledger
        calls this from :meth:`~zp_client.budget.ledger.Ledger.update_meta`.

        Adds :data:`TOKENS_AT_KEY` (and on the lease's first stamped report after its first token the
        rate origin). A reader on time reports its stream's growth at the server's pace; one that was
        busy finds a backlog and drains it, reporting tokens faster than any decode produces them
        (:data:`LATE_BURST_S_PER_TOKEN`). That shows the client reading late and turns on late-reader
        extrapolation for :data:`LATE_WINDOW_S` (:func:`project`). With no lateness seen, the projection
        reads every report as the present, exactly as before stamps existed."""
        tokens = fields.get("tokens")
        if not self.late_readers or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            return fields
        meta = lease.meta
        if not (fields.get("first_token") or meta.get("first_token")):
            return fields
        out = dict(fields)
        out[TOKENS_AT_KEY] = now
        prev, prev_at = meta.get("tokens"), meta.get(TOKENS_AT_KEY)
        if RATE_T0_KEY not in meta or prev is None or prev_at is None:
            out[RATE_T0_KEY], out[RATE_N0_KEY] = now, tokens
            return out
        try:
            grown, dt = tokens - int(prev), now - float(prev_at)
        except (TypeError, ValueError):
            return out
        if grown > 0 and dt < grown * LATE_BURST_S_PER_TOKEN:
            self.late_at = now
        step = lease_step_s({**meta, **out})
        if step is not None:
            self.step_s = step
        return out

    def _late_now(self, view: LedgerView) -> float | None:
        """The view's ``now`` while late-reader extrapolation is on, else None."""
        late_at = self.late_at
        if late_at is None:
            return None
        now = getattr(view, "now", None)
        if now is None or not 0 <= now - late_at <= LATE_WINDOW_S:
            return None
        return float(now)

    def _prepare(self, view: LedgerView) -> _Profile:
        version = getattr(view, "version", None)
        now = self._late_now(view)
        key = (id(view), version, now) if version is not None else None
        if key is not None and key == self._cache_key and self._profile is not None:
            return self._profile
        items = self._projected(view, now)
        terms, groups = _terms_from_items(items)
        profile = _Profile(terms, self.block_size, groups)
        self._cache_key, self._profile = key, profile
        return profile

    def _projected(self, view: LedgerView, now: float | None) -> list[tuple[Projection, Mapping[str, Any]]]:
        """Each live lease's :func:`project` with its meta, in lease order. A lease's projection is kept
        between calls keyed on every input it reads (:func:`_project_key`: held, bound and the meta fields
        :func:`project` reads), so a new ledger version recomputes only the leases that changed; released
        leases drop out. While late (``now`` given) the projection also reads the time and the step time:
        nothing is kept then."""
        bs, step_s = self.block_size, self.step_s
        if now is not None:
            return [(project(held=rec.held, bound=rec.bound, block_size=bs, meta=rec.meta, now=now,
                             step_s=step_s), rec.meta) for rec in view.leases.values()]
        old = self._lease_cache if self._lease_cache_view == id(view) else {}
        cache: dict[str, tuple[tuple[object, ...], Projection]] = {}
        items: list[tuple[Projection, Mapping[str, Any]]] = []
        for lid, rec in view.leases.items():
            held, bound, meta = rec.held, rec.bound, rec.meta
            key = (held, bound, *map(meta.get, _PROJECT_KEYS, _MISSINGS))
            hit = old.get(lid)
            if hit is not None and hit[0] == key:
                p = hit[1]
            else:
                p = project(held=held, bound=bound, block_size=bs, meta=meta)
            cache[lid] = (key, p)
            items.append((p, meta))
        self._lease_cache, self._lease_cache_view = cache, id(view)
        return items

    def used(self, view: LedgerView) -> int:
        return self._prepare(view).peak()

    def held_now(self, view: LedgerView) -> int:
        """What the live leases hold now with each shared prefix counted once, as the projection counts
        it (:func:`held_distinct`): reported as ``BudgetStatus.held_distinct``."""
        return held_distinct(((rec.held, rec.bound, rec.meta) for rec in view.leases.values()),
                             self.block_size)

    def _excess(self, view: LedgerView) -> int:
        """Sum of the live leases' :func:`excess_blocks` (cached on the ledger's version, like the
        projection): what the leases whose exact prompt outgrew its estimate may take beyond their bounds."""
        version = getattr(view, "version", None)
        key = (id(view), version) if version is not None else None
        if key is not None and key == self._excess_key:
            return self._excess_sum
        bs = self.block_size
        # Each lease's excess is kept between versions, keyed on what it reads (bound, prompt, room).
        old = self._excess_cache if self._excess_cache_view == id(view) else {}
        cache: dict[str, tuple[tuple[object, ...], int]] = {}
        total = 0
        for lid, rec in view.leases.items():
            meta = rec.meta
            ekey = (rec.bound, meta.get("prompt_tokens"), meta.get(MAX_OUTPUT_KEY))
            hit = old.get(lid)
            x = hit[1] if hit is not None and hit[0] == ekey else excess_blocks(rec.bound, bs, meta)
            cache[lid] = (ekey, x)
            total += x
        self._excess_cache, self._excess_cache_view = cache, id(view)
        self._excess_key, self._excess_sum = key, total
        return total

    def _spreads(self, view: LedgerView) -> tuple[int, int]:
        """(sum of squares, sum) over the live leases of :func:`spread_blocks` (cached on the ledger's
        version)."""
        version = getattr(view, "version", None)
        key = (id(view), version) if version is not None else None
        if key is not None and key == self._spread_key:
            return self._spread_total, self._spread_lin
        bs = self.block_size
        total = lin = 0
        for rec in view.leases.values():
            u = spread_blocks(held=rec.held, bound=rec.bound, block_size=bs, meta=rec.meta)
            total += u * u
            lin += u
        self._spread_key, self._spread_total, self._spread_lin = key, total, lin
        return total, lin

    def _spread_sq(self, view: LedgerView) -> int:
        """Sum over the live leases of :func:`spread_blocks` squared (cached on the ledger's version)."""
        return self._spreads(view)[0]

    def _urgent_bounds(self, view: LedgerView) -> tuple[list[int], list[int]]:
        """The live leases' classes in priority order and the largest bound of each (pins excluded;
        cached on the ledger's version)."""
        version = getattr(view, "version", None)
        key = (id(view), version) if version is not None else None
        if key is not None and key == self._urgent_key:
            return self._urgent
        largest: dict[int, int] = {}
        for rec in view.leases.values():
            if rec.meta.get("pinned"):
                continue  # a pin is a shared prefix, not a request of its class
            if rec.bound > largest.get(rec.priority, 0):
                largest[rec.priority] = rec.bound
        prios = sorted(largest)
        self._urgent_key, self._urgent = key, (prios, [largest[p] for p in prios])
        return self._urgent

    def urgent_blocks(self, view: LedgerView, candidate: WaiterRecord) -> int:
        """Blocks kept free of ``candidate`` for the classes more urgent than its own:
        ``ceil(urgent_reserve x b)``, ``b`` the largest bound among the live leases whose priority is
        lower than the candidate's (pins excluded; the :data:`URGENT_CLASSES_MAX` nearest such classes);
        0 when none is live or ``urgent_reserve`` is 0.

        The server's priority scheduler serves an urgent request at once by preempting; zp never
        preempts, so without this an urgent request that arrives to a pool full of less urgent leases
        waits for one to end. Keeping room for two requests of the size the urgent class runs now closes
        most of that wait (docs/admission.md#the-urgent-reserve) and costs nothing while one class is
        live."""
        if self.urgent_reserve <= 0 or not view.leases:
            return 0
        prios, largest = self._urgent_bounds(view)
        i = bisect.bisect_left(prios, candidate.priority)
        if i == 0:
            return 0
        return urgent_room(max(largest[max(0, i - URGENT_CLASSES_MAX):i]), self.urgent_reserve)

    def reserve(self, view: LedgerView, candidate: WaiterRecord | None = None) -> int:
        """Blocks admission keeps free below the limit for the live leases' forecast error (and the
        candidate's, when given): :func:`spread_reserve` of their :func:`spread_blocks` plus
        :func:`risk_reserve` of their sum. 0 when ``reserve_z`` and ``reserve_k`` are 0."""
        if self.reserve_z <= 0 and self.reserve_k <= 0:
            return 0
        sq, lin = self._spreads(view)
        if candidate is not None:
            u = spread_blocks(held=candidate.held, bound=candidate.bound, block_size=self.block_size,
                              meta=candidate.meta, candidate=True)
            sq += u * u
            lin += u
        return spread_reserve(sq, self.reserve_z) + risk_reserve(lin, self.reserve_k)

    @property
    def reads_spread(self) -> bool:
        """Whether a reserve reads the leases' upper forecasts (``forecast_hi``)."""
        return self.reserve_z > 0 or self.reserve_k > 0

    def admission_meta(self, bound: int, meta: Mapping[str, Any]) -> Mapping[str, Any]:
        """The meta a waiter is enqueued with (:meth:`Ledger.enqueue` calls this): :func:`admission_meta`."""
        return admission_meta(meta, bound, self.block_size)

    def exhausted(self, view: LedgerView) -> bool:
        # Adding a candidate never lowers the projected peak (every term is non-negative), so once the
        # live leases alone project above the limit nobody fits.
        if self._prepare(view).peak() > view.limit:
            return True
        if not self.reads_spread:
            return False
        # With a reserve (which never shrinks when a lease is added either: sums of squares and of
        # non-negative spreads) fits' slow
        # path refuses everyone; its fast path, which ignores the reserve, needs the bounds of the live
        # leases and of the smallest candidate (1 block, no excess) to fit.
        return (self._prepare(view).peak() + self.reserve(view) > view.limit
                and view.bound_sum + len(view.leases) + 2 + self._excess(view) > view.limit)

    def fits(self, view: LedgerView, candidate: WaiterRecord) -> bool:
        meta = candidate.meta
        bs = self.block_size
        # the room kept for more urgent classes narrows the limit for this candidate (0 with one class)
        lim = view.limit - self.urgent_blocks(view, candidate)
        # Sufficient, and cheap: no projection exceeds its cap (its bound plus excess_blocks) by more than
        # one block (see project), a candidate's neither while its prompt fits its bound, and shared
        # prefixes only subtract. The Lua port's uncontended fast path is the same test. On an empty pool
        # the candidate's one block is the projection's rounding, not a block it can hold (it holds at
        # most its cap): without it a lone request whose bound is the whole limit, forecast at its bound
        # (a cold route, ``cold_n``), would never be admitted.
        fast = (view.bound_sum + len(view.leases) + candidate.bound + (1 if view.leases else 0)
                + excess_blocks(candidate.bound, bs, meta))
        # While late, a term may exceed its cap by its extrapolated blocks: no fast path then.
        if ((not view.leases or self._late_now(view) is None) and fast <= lim
                and int(meta.get("prompt_tokens", 0)) <= candidate.bound * bs
                and fast + self._excess(view) <= lim):
            return True
        # Past the fast path (bounds, which no forecast error can exceed, do not fit): the projected peak
        # must fit with the forecast-error reserve kept free (none unless reserve_z > 0).
        profile = self._prepare(view)
        limit = lim - self.reserve(view, candidate)
        if not any(k in meta for k in POLICY_KEYS):
            # Reserved at its bound forever (see project): it adds its bound at every instant, the peak
            # included, so this is peak_with's answer in O(1).
            return profile.peak() + candidate.bound <= limit
        c = project(held=candidate.held, bound=candidate.bound, block_size=self.block_size, meta=meta,
                    candidate=True)
        extra: tuple[int, int] | None = None
        key = meta.get("prefix_key")
        group = profile.groups.get(key) if key is not None else None
        if group is not None and group[1] >= FOREVER:
            # A pinned prefix: held by its pin for good, the candidate adds only the rest.
            c = Projection(c.blocks - _pin_share(group[0], c, meta), c.remaining, c.grows)
        elif group is not None and c.grows:
            pblocks, group_end = group
            pblocks = min(pblocks, int(meta.get("prefix_blocks", pblocks)), c.blocks)
            c = Projection(c.blocks - pblocks, c.remaining, True)
            if c.remaining > group_end:
                extra = (pblocks, group_end)
        return profile.peak_with(c, extra) <= limit

    @staticmethod
    def walk(waiters: Sequence[WaiterRecord], now: float, starvation_bound_s: float,
             longest_first_s: float) -> Sequence[int]:
        """The order in which a grant tries one priority class's waiters: **longest forecast first**.

        Waiters that have waited at least ``longest_first_s`` seconds come first, in line order; then the
        younger ones by ``forecast_tokens``, largest first (a waiter without one counts 0), line order
        among equals. Admitting the longest requests first is the classic rule for the makespan of a
        batch (LPT): short requests backfill the end of a busy period instead of a long one starting last
        and running alone. The ledger's barrier rule applies in this order, so a waiter is overtaken by a
        longer one only while it is younger than ``longest_first_s``. ``longest_first_s`` or
        ``starvation_bound_s`` 0: line order (the ledger's pure FIFO stays pure)."""
        if longest_first_s <= 0 or starvation_bound_s <= 0 or len(waiters) < 2:
            return range(len(waiters))
        old: list[int] = []
        young: list[int] = []
        for i, w in enumerate(waiters):
            (old if now - w.since >= longest_first_s else young).append(i)
        young.sort(key=lambda i: -_forecast_of(waiters[i]))
        return old + young if old else young

    def __repr__(self) -> str:
        extra = f", reserve_z={self.reserve_z}" if self.reserve_z else ""
        if self.reserve_k:
            extra += f", reserve_k={self.reserve_k}"
        if self.late_readers:
            extra += ", late_readers=True"
        if self.urgent_reserve:
            extra += f", urgent_reserve={self.urgent_reserve}"
        return f"ElasticPolicy(block_size={self.block_size}{extra})"


def _forecast_of(w: WaiterRecord) -> float:
    """The walk's key: ``forecast_tokens`` when it is a finite number, else 0 (never raises in a grant)."""
    f = w.meta.get("forecast_tokens")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
        return 0
    return f


def _strict(block_size: int) -> ReservationPolicy:
    return StrictPolicy()  # counts bounds only: the block size does not matter


def _elastic(block_size: int) -> ReservationPolicy:
    return ElasticPolicy(validate_blocks(block_size, "block_size"))


#: The reservation policies a budget accepts by name: name -> factory taking the budget's block size.
POLICIES: dict[str, Callable[[int], ReservationPolicy]] = {"elastic": _elastic, "strict": _strict}


def make_policy(policy: str | ReservationPolicy, *, block_size: int = 16) -> ReservationPolicy:
    """Return the policy object for a name of :data:`POLICIES`, or pass a policy object through.

    ``"strict"`` is :class:`~zp_client.budget.ledger.StrictPolicy`; ``"elastic"`` is :class:`ElasticPolicy`,
    which projects growth token by token and so takes the budget's ``block_size`` (``strict`` ignores it).
    The budgets call this with their ``policy=`` argument and hand the object to their
    :class:`~zp_client.budget.ledger.Ledger`::

        Ledger(100, policy=make_policy("elastic", block_size=16))
    """
    if isinstance(policy, str):
        factory = POLICIES.get(policy)
        if factory is None:
            raise ConfigurationError(
                f"unknown reservation policy {policy!r}; available: {', '.join(sorted(POLICIES))} "
                "(or pass a ReservationPolicy object)"
            )
        return factory(block_size)
    if not isinstance(policy, ReservationPolicy):
        raise ConfigurationError(
            f"policy must be a name or a ReservationPolicy (with name, used() and fits()), got {policy!r}"
        )
    return policy
