"""RedisBudget's snapshot as a Ledger (zp_client/budget/redis/_snapshot.py; docs/admission.md#predicted-wait-
and-fail-fast): the pure function on hand-built ``snapshot.lua`` replies, no Redis. A reply built from a
ledger (the records common.lua keeps) comes back as the same ledger, and the replay on it predicts what
the replay on the original does."""

from __future__ import annotations

import json
from typing import Any

import pytest

from zp_client.budget.elastic import make_policy
from zp_client.budget.ledger import Ledger
from zp_client.budget.predict import predict_wait_of, predict_waits
from zp_client.budget.redis._snapshot import (
    class_heads_predicted,
    ledger_from_snapshot,
    predict_waiter,
)

BS = 16
NOW_MS = 1_700_000_010_000


def _meta(**kw: str) -> list[bytes]:
    fields = {"limit": "30", "bs": str(BS), "policy": "elastic", "starve": "10000", "lpt": "0",
              "line": "", "lb": "", "rec": "0", "slimit": ""}
    fields.update(kw)
    return [fields[k].encode() for k in ("limit", "bs", "policy", "starve", "lpt", "line", "lb", "rec",
                                          "slimit")]


def _lease(g: int, a: int, *, b: int = 15, h: int = 6, p: int = 0, o: int = 0, **m: Any) -> bytes:
    rec = {"b": b, "h": h, "p": p, "o": o, "w": "proc", "l": 30000, "g": g, "a": a,
           "m": {"pt": 80, "ft": 160, "st": 1, "mo": 160, **m}}
    return json.dumps(rec).encode()


def _waiter(s: int, *, b: int = 15, h: int = 5, p: int = 0, o: int = 0, **extra: Any) -> bytes:
    rec = {"b": b, "h": h, "p": p, "o": o, "s": s, "m": "x", "x": "mb", "w": "proc", "l": 30000,
           "mt": {"pt": 80, "ft": 160, "st": 1, "mo": 160}, "t": 1500, **extra}
    return json.dumps(rec).encode()


def _reply(leases: list[tuple[str, bytes]], waiters: list[tuple[str, bytes, str]],
           **meta: str) -> list[Any]:
    return [b"S", NOW_MS, _meta(**meta), [x for lid, raw in leases for x in (lid.encode(), raw)],
            [x for wid, raw, exp in waiters for x in (wid.encode(), raw, exp.encode())]]


def test_records_become_the_ledger_they_describe() -> None:
    # listed out of admission order: the ledger takes them by their admission counter a
    reply = _reply(
        [("lease-b", _lease(NOW_MS - 1000, 2, tk=90, f1=1, pk="p1", pb=4)),
         ("lease-a", _lease(NOW_MS - 4000, 1, h=7, p=1, o=3, tk=100, f1=1))],
        [("w1", _waiter(NOW_MS - 500, o=4, d=NOW_MS + 4500, tp=40, q=NOW_MS + 9500), "9999999999999"),
         ("w2", _waiter(NOW_MS - 300, b=10, p=1, o=5), "9999999999999")])
    snap = ledger_from_snapshot(reply)
    assert snap is not None
    led = snap.ledger
    assert snap.now == NOW_MS / 1000 and snap.block_size == BS
    assert led.limit == 30 and led.policy.name == "elastic" and led.starvation_bound_s == 10.0
    assert list(led.leases) == ["lease-a", "lease-b"]
    a, b = led.leases["lease-a"], led.leases["lease-b"]
    assert (a.bound, a.held, a.priority, a.ticket.order) == (15, 7, 1, 3)
    assert a.granted_at == (NOW_MS - 4000) / 1000
    assert a.meta == {"prompt_tokens": 80, "forecast_tokens": 160, "streaming": True,
                      "max_output_tokens": 160, "tokens": 100, "first_token": True}
    assert b.meta["prefix_key"] == "p1" and b.meta["prefix_blocks"] == 4
    assert [w.id for w in led.line()] == ["w1", "w2"]
    w1 = led.waiter("w1")
    assert w1 is not None and w1.since == (NOW_MS - 500) / 1000 and w1.ticket.order == 4
    assert w1.deadline == (NOW_MS + 4500) / 1000
    assert w1.meta["forecast_tokens"] == 160
    assert snap.leave_at == {"w1": (NOW_MS + 9500) / 1000}  # w2 sent no timeout
    assert led.bound_sum == 30 and led.held_sum == 13


def test_a_waiter_whose_heartbeat_lapsed_or_whose_record_is_gone_is_left_out() -> None:
    reply = _reply([("lease-a", _lease(NOW_MS - 1000, 1))],
                   [("gone", b"", ""), ("lapsed", _waiter(NOW_MS - 900), str(NOW_MS - 1)),
                    ("live", _waiter(NOW_MS - 800, o=1), str(NOW_MS + 1000))])
    snap = ledger_from_snapshot(reply)
    assert snap is not None and [w.id for w in snap.ledger.line()] == ["live"]


def test_the_line_keeps_its_order_and_settings() -> None:
    reply = _reply([], [("late-ticket", _waiter(NOW_MS - 100, o=1), ""),
                        ("urgent", _waiter(NOW_MS - 50, p=-1, o=2), "")],
                   line="slo", lb="30000", lpt="2000")
    snap = ledger_from_snapshot(reply)
    assert snap is not None
    led = snap.ledger
    assert [w.id for w in led.line()] == ["urgent", "late-ticket"]
    assert led.line_discipline == "slo" and led.late_bound_s == 30.0 and led.longest_first_s == 2.0


@pytest.mark.parametrize("reply", [
    [b"A"], [b"F"], [b"C", 300, 2],
    _reply([], [("w", _waiter(NOW_MS), "")], rec=str(NOW_MS + 5000)),  # recovering: nothing admitted yet
    _reply([("bad", b"{not json")], []),
])
def test_no_ledger_when_there_is_nothing_sound_to_predict_on(reply: list[Any]) -> None:
    assert ledger_from_snapshot(reply) is None


def test_a_size_limit_above_the_limit_is_kept() -> None:
    reply = _reply([], [("big", _waiter(NOW_MS - 10, b=40), "")], limit="30", slimit="48")
    snap = ledger_from_snapshot(reply)
    assert snap is not None and snap.ledger.limit == 30 and snap.ledger.size_limit == 48


def test_the_replay_on_the_snapshot_predicts_what_it_predicts_on_the_ledger_it_copies() -> None:
    """The same state built directly as a Ledger (the model) and as a snapshot reply: the same waits."""
    t = NOW_MS / 1000
    model = Ledger(24, policy=make_policy("elastic", block_size=BS), starvation_bound_s=10.0)
    for lid, g, gen, ft in (("lease-a", 4.0, 40, 160), ("lease-b", 1.0, 10, 60)):
        model.enqueue(lid, 15, 5, 0, t - g, meta={"prompt_tokens": 80, "forecast_tokens": ft,
                                                  "streaming": True})
        assert model.grant(t - g) == [lid]
        model.update_meta(lid, tokens=80 + gen, first_token=True)
        model.report_held(lid, -(-(80 + gen) // BS))
    model.enqueue("w1", 15, 5, 0, t - 0.5, meta={"prompt_tokens": 80, "forecast_tokens": 160,
                                                 "streaming": True})
    model.enqueue("w2", 10, 5, 1, t - 0.3, meta={"prompt_tokens": 80, "forecast_tokens": 40,
                                                 "streaming": True})
    assert model.grant(t) == []
    leave = {"w2": t + 60.0}

    def lease(lid: str, a: int) -> bytes:
        r = model.leases[lid]
        return _lease(round(r.granted_at * 1000), a, h=r.held, o=r.ticket.order,
                      mo=r.meta["max_output_tokens"], ft=r.meta["forecast_tokens"], tk=r.meta["tokens"], f1=1)

    def waiter(wid: str, **extra: Any) -> bytes:
        w = model.waiter(wid)
        assert w is not None
        rec = json.loads(_waiter(round(w.since * 1000), b=w.bound, h=w.held, p=w.priority, o=w.ticket.order,
                                 **extra))
        rec["mt"] = {"pt": 80, "ft": w.meta["forecast_tokens"], "st": 1, "mo": w.meta["max_output_tokens"]}
        return json.dumps(rec).encode()

    reply = _reply([("lease-a", lease("lease-a", 1)), ("lease-b", lease("lease-b", 2))],
                   [("w1", waiter("w1"), ""), ("w2", waiter("w2", q=NOW_MS + 60_000), "")], limit="24")
    reply[2] = [*reply[2], b"500", b"250", b"2000"]  # rz, rk, ru: the model's policy, elastic's defaults
    snap = ledger_from_snapshot(reply)
    assert snap is not None and snap.leave_at == leave
    for wid in ("w1", "w2"):
        others = {k: v for k, v in leave.items() if k != wid}
        want = predict_wait_of(model, wid, t, block_size=BS, leave_at=others)
        got = predict_waiter(snap, wid, None)
        assert want is not None and got is not None
        assert (got.wait_s, got.exact, got.timing) == (pytest.approx(want.wait_s), want.exact, want.timing)
    heads = predict_waits(model, t, block_size=BS, leave_at=leave, only=["w1", "w2"])
    assert class_heads_predicted(snap, None) == {0: pytest.approx(heads["w1"]), 1: pytest.approx(heads["w2"])}
    assert heads["w1"] > 0 and heads["w2"] > 0  # w2 (smaller, class 1) backfills before w1


def test_a_process_learns_its_errors_for_fail_fast_margin_and_bias() -> None:
    """RedisBudget's share of LocalBudget's error window (docs/admission.md#predicted-wait-and-fail-fast):
    each fail-fast prediction that is not refused waits for its grant, which records the error; once the
    class has 20, a prediction within the errors seen of the deadline is not refused, one beyond them is,
    and what is reported (the refusal, status' heads) is the replay's less the class's bias. No Redis: the
    process's Core on hand-built snapshot replies (a lease 10 s into its stream at 0.1 s a token, 60 tokens
    left: the waiter's replay says 6 s; 110 left at 0.2 s: 22 s)."""
    from zp_client.budget.predict import FAIL_FAST_MIN_SAMPLES
    from zp_client.budget.redis import RedisBudget

    def reply(wid: str, tokens: int = 180) -> list[Any]:
        lease = ("L1", _lease(NOW_MS - 10000, 1, h=-(-tokens // BS), tk=tokens, f1=1))
        return _reply([lease], [(wid, _waiter(NOW_MS), "9999999999999")], limit="20")

    b = RedisBudget("redis://127.0.0.1:1/0", "unit-errors", 20, BS)  # never connects: no call is made
    core = b._core
    try:
        # no errors yet: refused only beyond twice the time left (FAIL_FAST_COLD_FACTOR)
        assert core.fail_fast_refusal(reply("fresh"), "fresh", 2.0) is not None  # 6 s > 2 x 2 s
        assert core.fail_fast_refusal(reply("cold"), "cold", 4.0) is None  # 6 s <= 2 x 4 s: waits
        core.forget_prediction("cold")
        for i in range(FAIL_FAST_MIN_SAMPLES):
            rid = f"w{i}"
            assert core.fail_fast_refusal(reply(rid), rid, 60.0) is None
            assert rid in core.predicted
            core.prediction_granted(rid)  # granted at once: predicted 6 s too long
        assert core.predicted == {} and core.errors.samples(0) == FAIL_FAST_MIN_SAMPLES
        assert core.errors.margin(0) == pytest.approx(6.0, abs=0.5)
        assert core.fail_fast_refusal(reply("near"), "near", 2.0) is None  # 6 - 6 < 2: waits
        core.forget_prediction("near")  # it timed out, say: nothing recorded
        assert core.predicted == {} and core.errors.samples(0) == FAIL_FAST_MIN_SAMPLES
        refused = core.fail_fast_refusal(reply("far", tokens=130), "far", 2.0)  # 22 s: 22 - 6 > 2
        assert refused is not None and refused.predicted_wait_s == pytest.approx(16.0, abs=0.5)
        assert "recent prediction error" in str(refused)
        assert core.predicted_heads(reply("head")) == {0: pytest.approx(0.0, abs=0.5)}  # 6 s less 6 s
    finally:
        b.close_sync()


def test_the_reserves_come_back_with_the_policy() -> None:
    from zp_client.budget.elastic import ElasticPolicy

    # snapshot.lua's meta ends with rz, rk and ru (reserve_z, reserve_k, urgent_reserve in thousandths):
    # the replay's policy keeps the same reserves, and the leases their upper forecasts (fh)
    reply = _reply([("lease-a", _lease(NOW_MS - 1000, 1, fh=480))], [])
    reply[2] = [*reply[2], b"1500", b"250", b"1333"]
    snap = ledger_from_snapshot(reply)
    assert snap is not None
    policy = snap.ledger.policy
    assert isinstance(policy, ElasticPolicy) and (policy.reserve_z, policy.reserve_k) == (1.5, 0.25)
    assert policy.urgent_reserve == 1.333
    assert policy.block_size == BS
    assert snap.ledger.leases["lease-a"].meta["forecast_hi"] == 480
    # absent (HMGET's nil, sent as ''), or a reply of a script before them: no reserve
    for extra in ([b"", b"", b""], [b"", b""], []):
        reply = _reply([("lease-a", _lease(NOW_MS - 1000, 1))], [])
        reply[2] = [*reply[2], *extra]
        snap = ledger_from_snapshot(reply)
        assert snap is not None
        assert (snap.ledger.policy.reserve_z, snap.ledger.policy.reserve_k) == (0.0, 0.0)  # type: ignore[attr-defined]
        assert snap.ledger.policy.urgent_reserve == 0.0  # type: ignore[attr-defined]
