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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from zp_client.budget.elastic import POLICY_KEYS, project
from zp_client.budget.ledger import LeaseRecord, Ledger
from zp_client.errors import DeadlineExceeded

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "DEFAULT_STEP_S",
    "DEFAULT_TTFT_S",
    "FAIL_FAST_KEY",
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


def refusal(pred: Prediction, timeout: float) -> DeadlineExceeded | None:
    """The fail-fast refusal of a waiter predicted ``pred`` with ``timeout`` seconds left before its
    deadline, or None: refused only when the pace the replay ran at was measured (not the defaults, a
    guess) and the prediction exceeds ``timeout``. A lower-bound prediction refuses too (the waiter is
    admitted no earlier). Shared by every backend that predicts (LocalBudget, RedisBudget)."""
    measured = pred.timing is not None and pred.timing.samples > 0
    if not measured or pred.wait_s <= timeout:
        return None
    over = "" if pred.exact else "at least "
    return DeadlineExceeded(
        f"predicted wait {over}{pred.wait_s:.3f} s exceeds the {timeout:.3f} s left before the "
        "request's deadline: refused at once (fail-fast); retry later or raise X-ZP-Deadline",
        predicted_wait_s=pred.wait_s,
        retry_after_s=max(0.0, pred.wait_s - timeout),
    )
