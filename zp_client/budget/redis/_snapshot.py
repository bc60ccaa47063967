"""A RedisBudget's state as a :class:`~zp_client.budget.ledger.Ledger`, for the wait prediction.

Sans-I/O: :func:`ledger_from_snapshot` turns the reply of ``lua/snapshot.lua`` (one read-only script: the
budget's settings, every live lease's record, the line in order with each waiter's record and heartbeat
expiry, and Redis ``TIME``) into a ledger on Redis's clock (seconds), which
:mod:`zp_client.budget.predict` replays exactly as :class:`~zp_client.budget.local.LocalBudget` replays
its own (docs/admission.md#predicted-wait-and-fail-fast). The records are those of ``lua/common.lua``'s
header; the compact metadata maps back to the policy's keys (``_script.compact_meta`` in reverse).

What the copy leaves out, and why a prediction is then not made (None): a fleet and pinned prefixes (the
reply is ``F``), more than ``cap`` leases or waiters (``C``), a budget in its recovery window (nothing is
admitted before it ends, which the replay does not model), a record it cannot read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zp_client.budget._types import Ticket
from zp_client.budget.elastic import ElasticPolicy, make_policy
from zp_client.budget.ledger import DEFAULT_LATE_BOUND_S, Ledger, WaiterRecord
from zp_client.budget.predict import PoolTiming, Prediction, predict_wait_of, predict_waits
from zp_client.budget.redis._meta import LONG_KEYS, META_FLAGS
from zp_client.budget.redis._meta import text as _text
from zp_client.errors import ZPError

__all__ = ["SNAPSHOT_CAP", "Snapshot", "class_heads_predicted", "ledger_from_snapshot", "predict_waiter"]

#: The most live leases, and the most waiters, a snapshot copies (snapshot.lua's cap); beyond it no
#: prediction is made and a fail-fast call waits as without it. 256 + 256 records is one reply of some
#: 100 KB and a replay of a few ms to a few hundred ms of client CPU (LocalBudget's replay, same code).
SNAPSHOT_CAP = 256



@dataclass
class Snapshot:
    """A budget's state copied from Redis: a private ledger (the replay may change it) and its clock."""

    ledger: Ledger
    now: float
    """Redis ``TIME`` when the snapshot was read, in seconds (the ledger's clock)."""
    leave_at: dict[str, float]
    """Waiter id -> when its acquire gives up (Redis clock, seconds): waiters whose client sent a timeout."""
    block_size: int


def _long_meta(m: object) -> dict[str, object]:
    """A record's compact meta as the policy's metadata (unknown fields dropped, flags as booleans)."""
    if not isinstance(m, Mapping):
        return {}
    out: dict[str, object] = {}
    for k, v in m.items():
        key = LONG_KEYS.get(k)
        if key is not None:
            out[key] = bool(v) if k in META_FLAGS else v
    return out


def _ms(v: object, default: float | None = None) -> float | None:
    s = _text(v) if v is not None else ""
    if s == "":
        return default
    return float(s)


def ledger_from_snapshot(reply: Sequence[object]) -> Snapshot | None:
    """The ledger of a ``snapshot.lua`` reply, or None when there is nothing to predict on (see the module
    doc). Leases enter in admission order (record field ``a``: the projection's lease order, on which a
    shared prefix's charge depends), each granted at its ``g`` with its bound, held blocks and metadata;
    waiters in line order with their ticket, arrival, metadata and SLO deadline ``d``. A waiter whose
    heartbeat expiry has passed is left out (the next grant pass drops it). Raises nothing for a record
    it cannot read: None."""
    try:
        return _build(reply)
    except (ZPError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None


def _build(reply: Sequence[object]) -> Snapshot | None:
    if not reply or _text(reply[0]) != "S":
        return None
    now_ms = float(_text(reply[1]))
    meta = list(reply[2])  # type: ignore[call-overload]
    limit, bs = int(_text(meta[0])), int(_text(meta[1]))
    policy = _text(meta[2]) or "strict"
    starve = _ms(meta[3], 0.0) or 0.0
    lpt = _ms(meta[4], 0.0) or 0.0
    line = "slo" if _text(meta[5]) == "slo" else "fifo"
    lb = _ms(meta[6])
    rec = _ms(meta[7], 0.0) or 0.0
    slimit = _ms(meta[8])
    # elastic's forecast-error reserves and urgent reserve in thousandths (absent: 0), replayed with the
    # same rule
    rz, rk, ru = (int(_ms(meta[i], 0.0) or 0) if len(meta) > i else 0 for i in (9, 10, 11))
    if rec > now_ms:
        return None  # recovering: nothing is admitted until the window ends
    now = now_ms / 1000
    size = max(limit, int(slimit)) if slimit is not None else limit
    # (stored as given: 0 is off, not ElasticPolicy's default, which a budget created before them has)
    rule = (ElasticPolicy(bs, reserve_z=rz / 1000, reserve_k=rk / 1000, urgent_reserve=ru / 1000)
            if policy == "elastic"
            else make_policy(policy, block_size=bs))
    ledger = Ledger(size, policy=rule, starvation_bound_s=starve / 1000,
                    longest_first_s=lpt / 1000, line=line,  # type: ignore[arg-type]
                    late_bound_s=DEFAULT_LATE_BOUND_S if lb is None else lb / 1000)
    if size != limit:
        ledger.set_limit(limit, now, keep_size=True)
    flat = list(reply[3])  # type: ignore[call-overload]
    leases = []
    for lid, raw in zip(flat[::2], flat[1::2], strict=True):
        r = json.loads(_text(raw))
        leases.append((int(r.get("a") or 0), float(r["g"]), _text(lid), r))
    leases.sort(key=lambda x: (x[0], x[1]))
    for seq, (_, granted, lid, r) in enumerate(leases):
        p = int(r["p"])
        w = WaiterRecord(id=lid, bound=int(r["b"]), held=int(r["h"]), priority=p,
                         ticket=Ticket(p, int(r["o"])), since=granted / 1000, seq=seq,
                         meta=_long_meta(r.get("m")))
        ledger.admit_record(w, granted / 1000)
    ws = list(reply[4])  # type: ignore[call-overload]
    leave_at: dict[str, float] = {}
    for wid_b, raw, wexp in zip(ws[::3], ws[1::3], ws[2::3], strict=True):
        wid, body = _text(wid_b), _text(raw)
        if not body:
            continue  # its record went with a reap the line has not seen yet
        exp = _ms(wexp)
        if exp is not None and exp < now_ms:
            continue  # its process stopped heartbeating: the next grant pass drops it
        r = json.loads(body)
        p = int(r["p"])
        ledger.enqueue(wid, int(r["b"]), int(r["h"]), p, float(r["s"]) / 1000, Ticket(p, int(r["o"])),
                       meta=_long_meta(r.get("mt")))
        waiting = ledger.waiter(wid)
        if waiting is not None and r.get("d") is not None:
            # the SLO deadline acquire.lua computed on Redis TIME (the ledger's line_deadline)
            waiting.deadline = float(r["d"]) / 1000
        if r.get("q") is not None:
            leave_at[wid] = float(r["q"]) / 1000
    return Snapshot(ledger, now, leave_at, bs)


def predict_waiter(snap: Snapshot, waiter_id: str, fallback: PoolTiming | None) -> Prediction | None:
    """The predicted wait of ``waiter_id`` in ``snap`` (None when it is not in line there): the same
    replay as LocalBudget's at enqueue, the other waiters leaving at their give-up times and this one
    predicted as if it waited for good. The snapshot's ledger is not changed."""
    others = {k: v for k, v in snap.leave_at.items() if k != waiter_id}
    return predict_wait_of(snap.ledger, waiter_id, snap.now, block_size=snap.block_size, leave_at=others,
                           fallback=fallback)


def class_heads_predicted(snap: Snapshot, fallback: PoolTiming | None) -> dict[int, float]:
    """Per priority class with waiters, its head's predicted wait (``BudgetStatus.predicted_wait_s``): one
    bounded replay on the snapshot's ledger, which it changes."""
    heads: dict[int, str] = {}
    for w in snap.ledger.line():
        heads.setdefault(w.priority, w.id)
    waits = predict_waits(snap.ledger, snap.now, block_size=snap.block_size, leave_at=snap.leave_at,
                          fallback=fallback, only=heads.values(), in_place=True)
    return {p: waits[wid] for p, wid in heads.items() if wid in waits}
