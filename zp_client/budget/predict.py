"""Predicted wait: when each waiter of a ledger will be admitted, from the live leases' projections.

A sans-I/O function of the ledger state (docs/admission.md#predicted-wait-and-fail-fast). It never reads
a clock: ``now`` is the caller's (the backend's own clock). It replays the ledger's own admission on a
copy of it: every live lease ends at its estimated end time, the leases left grow token by token up to
then, and the copy's :meth:`~zp_client.budget.ledger.Ledger.grant` runs at each end, so the order, the
barrier rule, the SLO-aware walk and the reservation policy are exactly the ledger's. A waiter admitted in
the replay at ``t`` has a predicted wait of ``t - now``.

Time enters only through a lease's *end*: ``its time to first token (if not seen yet) + its remaining
forecast tokens x the step time``. The step time and the time to first token are fitted on the live
leases themselves (:func:`pool_timing`: ``age = ttft + tokens x step`` over the leases that reported
tokens), falling back to :data:`DEFAULT_STEP_S` / :data:`DEFAULT_TTFT_S` while no lease has reported.

The replay is bounded: at most ``max_events`` lease ends. A waiter still waiting when the replay stops
(the bound, or only leases with no projection left: a lease without metadata holds its bound forever)
gets no number from :func:`predict_waits`, and :func:`predict_wait_of` answers a lower bound flagged as
such (the waiter is admitted no earlier than that), which is what fail-fast may refuse on.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from zp_client.budget.elastic import POLICY_KEYS, project
from zp_client.budget.ledger import LeaseRecord, Ledger
from zp_client.errors import DeadlineExceeded

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "DEFAULT_STEP_S",
    "DEFAULT_TTFT_S",
    "FAIL_FAST_COLD_FACTOR",
    "FAIL_FAST_ERROR_QUANTILE",
    "FAIL_FAST_KEY",
    "FAIL_FAST_MIN_SAMPLES",
    "FAIL_FAST_WINDOW",
    "ErrorWindow",
    "Prediction",
    "PoolTiming",
    "pool_timing",
    "predict_wait_of",
    "predict_waits",
    "refusal",
]

#: Decode seconds per output token assumed while no live lease has reported tokens (vLLM's step time at a
#: moderate batch on one GPU is 20-50 ms).
DEFAULT_STEP_S = 0.03
#: Seconds to the first token assumed while no live lease has reported tokens.
DEFAULT_TTFT_S = 0.2
#: Lease ends the replay visits at most (each costs one copy-ledger grant pass).
DEFAULT_MAX_EVENTS = 256

#: Waiter metadata: the caller opted into fail-fast (the core sets it from ``Settings.fail_fast`` or the
#: ``X-ZP-Fail-Fast`` header); the budget then refuses at enqueue when the predicted wait exceeds the
#: acquire's timeout (the request's remaining deadline). Not read by any policy or line.
FAIL_FAST_KEY = "fail_fast"


@dataclass(frozen=True, slots=True)
class PoolTiming:
    """The pool's timing as the live leases show it."""

    step_s: float
    """Seconds per output token."""
    ttft_s: float
    """Seconds from a grant to the first token."""
    samples: int
    """Leases that reported tokens (0: the defaults)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """A waiter's predicted wait from ``now`` (the backend's clock)."""

    wait_s: float
    """Seconds from ``now`` to the predicted admission; a lower bound when ``exact`` is False."""
    exact: bool
    """False: the replay stopped before admitting the waiter (see the module doc), ``wait_s`` is the time
    it reached: the waiter is admitted no earlier."""
    timing: PoolTiming | None = None
    """The pace the replay ran at; ``samples == 0``: the defaults (nothing measured), a guess."""


@dataclass
class _Run:
    admitted: dict[str, float] = field(default_factory=dict)
    horizon: float = 0.0
    done: bool = False
    left: str | None = None
    timing: PoolTiming | None = None


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _generated(meta: Mapping[str, object]) -> float | None:
    """Output tokens a lease reported (its ``tokens`` count the prompt too), None before any report."""
    k, prompt = _num(meta.get("tokens")), _num(meta.get("prompt_tokens"))
    if k is None or prompt is None:
        return None
    return max(0.0, k - prompt)


def pool_timing(leases: Mapping[str, LeaseRecord], now: float) -> PoolTiming:
    """Fit ``age = ttft + generated x step`` (least squares) over the live streaming leases that
    reported tokens (``generated``: their output tokens so far, ``age``: seconds since their grant);
    with fewer than three or no spread, ``step = sum(age) / sum(generated)`` and no time to first token.
    Clamped: ``step`` in [1 ms, 10 s], ``ttft`` >= 0. Reports come every few blocks, so ``generated``
    lags a little: the step reads slightly long (a conservative error for fail-fast)."""
    pts: list[tuple[float, float]] = []
    for rec in leases.values():
        k = _generated(rec.meta)
        if k is not None and k > 0:
            pts.append((k, max(0.0, now - rec.granted_at)))
    if not pts:
        return PoolTiming(DEFAULT_STEP_S, DEFAULT_TTFT_S, 0)
    n = len(pts)
    mk = sum(k for k, _ in pts) / n
    ma = sum(a for _, a in pts) / n
    var = sum((k - mk) ** 2 for k, _ in pts)
    step = ttft = None
    if n >= 3 and var > 0:
        step = sum((k - mk) * (a - ma) for k, a in pts) / var
        ttft = ma - step * mk
    if step is None or ttft is None or step <= 0 or ttft < 0:
        step = sum(a for _, a in pts) / sum(k for k, _ in pts)
        ttft = 0.0
    return PoolTiming(min(10.0, max(0.001, step)), max(0.0, ttft), n)


def _remaining_tokens(rec: LeaseRecord, block_size: int) -> int | None:
    """Output tokens left to the lease's projected end, None for a lease without projection metadata."""
    meta = rec.meta
    if not any(k in meta for k in POLICY_KEYS) or meta.get("pinned"):
        return None
    p = project(held=rec.held, bound=rec.bound, block_size=block_size, meta=meta)
    return p.remaining


def _lease_end(rec: LeaseRecord, now: float, timing: PoolTiming, block_size: int) -> float:
    """When the lease is expected to release: inf when it has no projection."""
    left = _remaining_tokens(rec, block_size)
    if left is None:
        return math.inf
    if rec.meta.get("first_token") or rec.meta.get("tokens") is not None:
        return now + left * timing.step_s
    # no token yet: its first token is still due (never before now), then the rest
    return max(now, rec.granted_at + timing.ttft_s) + left * timing.step_s


def _advance(sim: Ledger, rec: LeaseRecord, generated: int, block_size: int) -> None:
    """Record on the copy that a streaming lease has generated ``generated`` output tokens by now."""
    meta = rec.meta
    if not meta.get("streaming", True):
        return
    prompt = _num(meta.get("prompt_tokens"))
    if prompt is None:
        return
    tokens = int(prompt) + generated
    if tokens <= int(_num(meta.get("tokens")) or 0):
        return
    held = min(rec.bound, -(-tokens // block_size))
    sim.report_held(rec.id, max(held, rec.held))
    sim.update_meta(rec.id, tokens=tokens, first_token=True)


def _replay(ledger: Ledger, now: float, block_size: int, targets: set[str] | None,
            max_events: int, leave_at: Mapping[str, float] | None, fallback: PoolTiming | None,
            in_place: bool = False) -> _Run:
    run = _Run(horizon=now)
    if not len(ledger):
        run.done = True
        return run
    sim = ledger if in_place else copy.deepcopy(ledger)
    timing = pool_timing(sim.leases, now)
    if timing.samples == 0 and fallback is not None:
        timing = fallback
    run.timing = timing
    step = timing.step_s
    ends: dict[str, float] = {}
    # lease id -> (the time its output is counted from, output tokens then)
    start: dict[str, tuple[float, float]] = {}

    def track(rec: LeaseRecord, t: float) -> None:
        ends[rec.id] = _lease_end(rec, t, timing, block_size)
        k = _generated(rec.meta)
        if k is not None and (k > 0 or rec.meta.get("first_token")):
            start[rec.id] = (t, k)
        else:
            start[rec.id] = (max(t, rec.granted_at + timing.ttft_s), 0.0)

    for rec in sim.leases.values():
        track(rec, now)
    for gid in sim.grant(now):  # nothing normally: the backend granted at this instant already
        run.admitted[gid] = now
        track(sim.leases[gid], now)
    pending = set(targets) if targets is not None else {w.id for w in sim.line()}
    pending -= run.admitted.keys()
    # waiters that give up (their acquire's timeout) leave the line then, unless admitted before
    leaving = sorted((t, wid) for wid, t in (leave_at or {}).items() if wid in sim and sim.waiter(wid))
    t = now
    for _ in range(max_events):
        if not pending or not len(sim):
            run.done = True
            break
        live = [(e, lid) for lid, e in ends.items() if lid in sim.leases]
        t_next = min((e for e, _ in live), default=math.inf)
        while leaving and sim.waiter(leaving[0][1]) is None:
            leaving.pop(0)  # admitted meanwhile
        if leaving and leaving[0][0] <= t_next:
            t, wid = leaving.pop(0)
            t = max(t, now)
            if wid in pending:
                run.left = wid  # a target gives up before the replay admits it
                break
            sim.cancel(wid)
        elif math.isinf(t_next):
            break  # only leases that never end hold the pool
        else:
            t = t_next
            for e, lid in live:
                if e <= t:
                    sim.release(lid, t)
                    ends.pop(lid, None)
        for lid, rec in sim.leases.items():  # the rest grew meanwhile
            t0, k0 = start.get(lid, (t, 0.0))
            if t > t0 and not math.isinf(ends.get(lid, math.inf)):
                _advance(sim, rec, int(k0 + (t - t0) / step), block_size)
        for gid in sim.grant(t):
            run.admitted[gid] = t
            pending.discard(gid)
            track(sim.leases[gid], t)
    else:
        run.done = not pending
    run.horizon = t
    return run


def predict_waits(ledger: Ledger, now: float, *, block_size: int = 16,
                  max_events: int = DEFAULT_MAX_EVENTS,
                  leave_at: Mapping[str, float] | None = None,
                  fallback: PoolTiming | None = None,
                  only: Iterable[str] | None = None,
                  in_place: bool = False) -> dict[str, float]:
    """Predicted wait from ``now`` (seconds) of every waiter the bounded replay admits, by waiter id
    (``only``: the replay stops once these are admitted; others admitted by then are in the answer too).
    Waiters it does not reach are absent. ``leave_at``: waiter id -> when it gives up (its acquire's
    timeout on the same clock); the replay takes it out of line then. ``fallback``: the pace to assume
    when no live lease has reported tokens (e.g. the last one measured), instead of the defaults. The
    ledger is not changed, unless ``in_place`` (the replay then runs on ``ledger`` itself: for a caller
    that passes its own copy, e.g. one taken under a lock so that the replay can run outside it)."""
    waiting = {w.id for w in ledger.line()}
    run = _replay(ledger, now, block_size, None if only is None else set(only), max_events, leave_at,
                  fallback, in_place)
    return {wid: t - now for wid, t in run.admitted.items() if wid in waiting}


def predict_wait_of(ledger: Ledger, waiter_id: str, now: float, *, block_size: int = 16,
                    max_events: int = DEFAULT_MAX_EVENTS,
                    leave_at: Mapping[str, float] | None = None,
                    fallback: PoolTiming | None = None) -> Prediction | None:
    """The predicted wait of one waiter (None if it is not waiting): exact when the replay admits it,
    else a lower bound (:class:`Prediction`): also when ``leave_at`` has the waiter itself give up
    before the replay admits it (then the bound is its own give-up time). Only the line up to it
    matters; the replay stops once it is admitted. ``leave_at``, ``fallback``: see
    :func:`predict_waits`. The ledger is not changed."""
    if waiter_id not in ledger or ledger.waiter(waiter_id) is None:
        return None
    run = _replay(ledger, now, block_size, {waiter_id}, max_events, leave_at, fallback)
    t = run.admitted.get(waiter_id)
    if t is not None:
        return Prediction(t - now, True, run.timing)
    return Prediction(max(0.0, run.horizon - now), False, run.timing)


#: Fail-fast refuses only when the prediction exceeds the deadline by more than this quantile of the
#: class's recent over-predictions (predicted minus actual wait of its admitted waiters): a refusal is then
#: false (the waiter would have been admitted in time) in about ``1 - FAIL_FAST_ERROR_QUANTILE`` of the
#: cases where the errors to come are like those seen (docs/admission.md#predicted-wait-and-fail-fast).
FAIL_FAST_ERROR_QUANTILE = 0.95
#: Admitted predictions a class needs before its own margin and its bias are used (before: the margin
#: from every class's errors once they have this many together, else none; no bias).
FAIL_FAST_MIN_SAMPLES = 20
#: Recent admitted predictions kept per class.
FAIL_FAST_WINDOW = 256
#: Before the budget has seen enough of its own errors to size a margin (:meth:`ErrorWindow.calibrated`),
#: fail-fast refuses only a prediction of more than this many times the time left (chosen on `mixed`'s
#: tuning seeds 0-3: docs/admission.md#predicted-wait-and-fail-fast).
FAIL_FAST_COLD_FACTOR = 2.0


class ErrorWindow:
    """Each priority class's recent prediction errors, and fail-fast's margin from them.

    Sans-I/O: the budget records, for every waiter whose wait it predicted exactly and which it then
    admitted, ``predicted - actual`` (seconds; > 0: it was admitted sooner than predicted), and asks for
    :meth:`margin` before refusing. Refused waiters and waiters that gave up add nothing (their actual wait
    is unknown); they are the ones predicted long, so the window leans to waiters admitted in time, which
    makes the margin larger, the safe side for a refusal."""

    __slots__ = ("_errors", "_min", "_q", "_window")

    def __init__(self, quantile: float = FAIL_FAST_ERROR_QUANTILE, min_samples: int = FAIL_FAST_MIN_SAMPLES,
                 window: int = FAIL_FAST_WINDOW) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
        if min_samples < 1 or window < min_samples:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples!r}, {window!r}")
        self._q = quantile
        self._min = min_samples
        self._window = window
        self._errors: dict[int, deque[float]] = {}

    def record(self, priority: int, predicted_s: float, actual_s: float) -> None:
        """One admitted waiter of class ``priority``: its predicted and its actual wait."""
        if not (math.isfinite(predicted_s) and math.isfinite(actual_s)):
            return
        q = self._errors.get(priority)
        if q is None:
            q = self._errors[priority] = deque(maxlen=self._window)
        q.append(predicted_s - actual_s)

    def samples(self, priority: int) -> int:
        return len(self._errors.get(priority, ()))

    def calibrated(self) -> bool:
        """Whether the margins rest on errors seen: every class's together number ``min_samples``."""
        return sum(len(q) for q in self._errors.values()) >= self._min

    def bias(self, priority: int) -> float:
        """The median of class ``priority``'s recent errors (seconds; > 0: its waits ran shorter than
        predicted), 0 while it has fewer than ``min_samples``: what a prediction of the class is corrected
        by before it is reported (the replay cannot see, say, the earliest of many uncertain lease ends
        coming sooner than the earliest forecast one, or later arrivals of a more urgent class going
        ahead; its own record shows by how much it runs off)."""
        q = self._errors.get(priority)
        if q is None or len(q) < self._min:
            return 0.0
        return statistics.median(q)

    def margin(self, priority: int) -> float:
        """Seconds a prediction of class ``priority`` must exceed a deadline by before fail-fast refuses:
        the ``quantile`` of its recent errors (predicted minus actual), never below 0. While the class
        has fewer than ``min_samples`` errors: the larger of that quantile over every class's errors and
        over its own, once all classes together have ``min_samples``; 0 before."""
        own = self._errors.get(priority, ())
        if len(own) >= self._min:
            return self._quantile(own)
        pooled = [e for q in self._errors.values() for e in q]
        if len(pooled) < self._min:
            return 0.0
        return max(self._quantile(pooled), self._quantile(own) if own else 0.0)

    def _quantile(self, errors: Iterable[float]) -> float:
        xs = sorted(errors)
        return max(0.0, xs[min(len(xs) - 1, math.ceil(self._q * len(xs)) - 1)])


def refusal(pred: Prediction, timeout: float, *, margin: float = 0.0, bias: float = 0.0,
            calibrated: bool = True) -> DeadlineExceeded | None:
    """The fail-fast refusal of a waiter predicted ``pred`` with ``timeout`` seconds left before its
    deadline, or None: refused only when the pace the replay ran at was measured (not the defaults, a
    guess) and the prediction exceeds ``timeout`` by more than ``margin`` (seconds, >= 0: the class's
    recent over-predictions, :meth:`ErrorWindow.margin`). A lower-bound prediction refuses too (the waiter
    is admitted no earlier). The refusal reports the prediction less ``bias`` (:meth:`ErrorWindow.bias`):
    with ``bias`` the median and ``margin`` a higher quantile of the same errors (or ``bias`` 0), that is
    still more than ``timeout``. Not ``calibrated`` (the backend has not seen enough of its own errors to
    size a margin): refused only beyond :data:`FAIL_FAST_COLD_FACTOR` times ``timeout``. Shared by every
    backend that predicts (LocalBudget, RedisBudget)."""
    measured = pred.timing is not None and pred.timing.samples > 0
    if not measured or pred.wait_s - max(0.0, margin) <= timeout:
        return None
    if not calibrated and pred.wait_s <= FAIL_FAST_COLD_FACTOR * timeout:
        return None
    shown = max(0.0, pred.wait_s - bias)
    over = "" if pred.exact else "at least "
    if margin > 0 or bias:
        # the rule compares the replay's own prediction; the reported one is corrected by the bias
        why = (f"the replay's wait {over}{pred.wait_s:.3f} s exceeds the {timeout:.3f} s left before the "
               f"request's deadline by more than this class's recent prediction error ({margin:.3f} s); "
               f"predicted wait {shown:.3f} s")
    else:
        why = (f"predicted wait {over}{pred.wait_s:.3f} s exceeds the {timeout:.3f} s left before the "
               "request's deadline")
    return DeadlineExceeded(
        f"{why}: refused at once (fail-fast); retry later or raise X-ZP-Deadline",
        predicted_wait_s=shown,
        retry_after_s=max(0.0, shown - timeout),
    )
