"""Elastic's projection under a client that reads its streams late (issue 18, "elastic zero under a busy
client"): ``ElasticPolicy(late_readers=True)``, opt-in (docs/elastic.md#late-readers has why).

The projection reads each lease's last growth report. A process that is busy (application work holding
the GIL, a blocked event loop) reads its streams late, so its reports lag what the server has generated,
and a grant run in between undercounts the pool. The policy stamps every growth report with its arrival
time (the budget's clock), learns each lease's step time from its reports, notices lateness (a block
crossing reported tokens after the crossing token), and while it is late projects each lease from where
it probably is. With no lateness seen it reads reports as the present, exactly as before.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zp_client import LocalBudget
from zp_client.budget.elastic import (
    LATE_GRACE_STEPS,
    LATE_WINDOW_S,
    TOKENS_AT_KEY,
    ElasticPolicy,
    late_tokens,
    lease_step_s,
    projected_peak,
)
from zp_client.budget.ledger import Ledger

BS = 16
PROMPT = 160  # 10 blocks
FORECAST = 640  # ends at 800 tokens = 50 blocks
STEP = 0.01  # seconds per token on the server


def _meta() -> dict[str, Any]:
    return {"prompt_tokens": PROMPT, "forecast_tokens": FORECAST, "streaming": True}


def _report(led: Ledger, lid: str, tokens: int, now: float, **fields: Any) -> None:
    led.report_held(lid, -(-tokens // BS))
    led.update_meta(lid, now=now, tokens=tokens, **fields)


def _on_time(led: Ledger, lid: str, t_first: float, until_tokens: int) -> float:
    """Report lease ``lid``'s first token at ``t_first`` and every block crossing on time up to
    ``until_tokens`` (the transport reports the crossing token itself); returns the last report's time."""
    tokens = PROMPT + 1
    _report(led, lid, tokens, t_first, first_token=True)
    t = t_first
    while True:
        nxt = -(-tokens // BS) * BS + 1
        if nxt > until_tokens:
            return t
        t = t_first + (nxt - PROMPT - 1) * STEP
        tokens = nxt
        _report(led, lid, tokens, t)


def _ledger(limit: int = 10_000, late_readers: bool = True) -> tuple[Ledger, ElasticPolicy]:
    pol = ElasticPolicy(BS, late_readers=late_readers)
    return Ledger(limit, policy=pol), pol


def _lease(led: Ledger, lid: str, now: float = 0.0) -> None:
    led.enqueue(lid, 60, PROMPT // BS, 0, now, meta=_meta())
    assert led.grant(now) == [lid]


def test_reports_are_stamped_and_the_step_time_is_learned() -> None:
    led, pol = _ledger()
    _lease(led, "a")
    last = _on_time(led, "a", 0.1, PROMPT + 1 + 80)
    meta = led.leases["a"].meta
    assert meta[TOKENS_AT_KEY] == last
    assert lease_step_s(meta) == pytest.approx(STEP)
    assert pol.step_s == pytest.approx(STEP)
    assert pol.late_at is None  # reported at the server's pace


def test_without_report_times_or_by_default_nothing_is_stamped() -> None:
    led, pol = _ledger()
    _lease(led, "a")
    led.update_meta("a", first_token=True, tokens=PROMPT + 1)  # no now: a backend without a clock
    assert TOKENS_AT_KEY not in led.leases["a"].meta
    assert pol.late_at is None
    # the default policy (late_readers off) reads reports as the present: no stamps, even a backlog
    led, pol = _ledger(late_readers=False)
    _lease(led, "a")
    for i in range(5):
        _report(led, "a", PROMPT + 1 + 16 * i, 1.0, first_token=True)
    assert TOKENS_AT_KEY not in led.leases["a"].meta and pol.late_at is None
    assert ElasticPolicy(BS).late_readers is False
    assert "late_readers=True" in repr(ElasticPolicy(BS, late_readers=True))


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.floats(min_value=0.001, max_value=0.5), min_size=3, max_size=40),
       probe=st.floats(min_value=0.0, max_value=5.0))
def test_a_reader_on_time_projects_exactly_as_without_stamps(steps: list[float], probe: float) -> None:
    """Irregular server steps (prefill chunks make some long), every token read when emitted: the gate
    never opens, so at any later instant the projection equals the unstamped one."""
    stamped, pol = _ledger()
    plain, _ = _ledger()
    for led in (stamped, plain):
        _lease(led, "a")
        _lease(led, "b")
    t = 0.1
    tokens = {"a": PROMPT, "b": PROMPT + 7}
    for i, dt in enumerate(steps):
        t += dt
        for lid in ("a", "b"):
            prev = tokens[lid]
            tokens[lid] = prev + 1
            first = i == 0
            crossing = -(-prev // BS) * BS + 1
            if first or tokens[lid] == crossing:
                fields: dict[str, Any] = {"first_token": True} if first else {}
                _report(stamped, lid, tokens[lid], t, **fields)
                plain.report_held(lid, -(-tokens[lid] // BS))
                plain.update_meta(lid, tokens=tokens[lid], **fields)
    assert pol.late_at is None
    now = t + probe
    assert stamped.status(now, block_size=BS).used == plain.status(now, block_size=BS).used


@settings(max_examples=80, deadline=None)
@given(reports=st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 40), st.floats(0.0, 0.3)),
                        min_size=1, max_size=30),
       probe=st.floats(min_value=0.0, max_value=2.0))
def test_stamps_only_ever_count_more(reports: list[tuple[str, int, float]], probe: float) -> None:
    """Whatever the reports (late, early, bursty), the stamped projection is at least the unstamped one:
    extrapolation makes the pool look fuller, never emptier."""
    stamped, _ = _ledger()
    plain, _ = _ledger()
    for led in (stamped, plain):
        _lease(led, "a")
        _lease(led, "b")
    t = 0.1
    tokens = {"a": PROMPT, "b": PROMPT}
    for lid, adv, dt in reports:
        t += dt
        tokens[lid] = min(PROMPT + FORECAST - 1, tokens[lid] + adv)
        held = -(-tokens[lid] // BS)
        stamped.report_held(lid, held)
        stamped.update_meta(lid, now=t, first_token=True, tokens=tokens[lid])
        plain.report_held(lid, held)
        plain.update_meta(lid, first_token=True, tokens=tokens[lid])
    now = t + probe
    assert stamped.status(now, block_size=BS).used >= plain.status(now, block_size=BS).used


def test_late_tokens_counts_silence_beyond_the_grace() -> None:
    meta = {"tokens": 300, TOKENS_AT_KEY: 2.0, "rate_t0": 1.0, "rate_n0": 200}  # 10 ms per token
    assert late_tokens(meta, 2.0) == 0
    assert late_tokens(meta, 2.0 + STEP * (LATE_GRACE_STEPS + 0.5)) == 0
    assert late_tokens(meta, 2.5) == 50 - LATE_GRACE_STEPS
    # A lease too young for its own rate uses the budget's; without either, nothing is extrapolated.
    young = {"tokens": 300, TOKENS_AT_KEY: 2.0, "rate_t0": 2.0, "rate_n0": 300}
    assert late_tokens(young, 2.5) == 0
    assert late_tokens(young, 2.5, step_s=0.02) == 25 - LATE_GRACE_STEPS


def _stale_and_true(block_s: float) -> tuple[Ledger, ElasticPolicy, float, dict[str, int]]:
    """Two leases read on time until t=1.0; then the client blocks for ``block_s``. At its end lease a's
    read comes first: it drains its backlog at once (the window opens); b's report is still from before."""
    led, pol = _ledger()
    _lease(led, "a")
    _lease(led, "b")
    t_first = 0.1
    upto = PROMPT + 1 + int((1.0 - t_first) / STEP)
    _on_time(led, "a", t_first, upto)
    _on_time(led, "b", t_first, upto)
    now = 1.0 + block_s
    true_tokens = PROMPT + 1 + round((now - t_first) / STEP)
    # a drains its backlog: every crossing it missed, reported at once (the transport reports each)
    tokens = led.leases["a"].meta["tokens"]
    while (nxt := -(-tokens // BS) * BS + 1) <= true_tokens:
        tokens = nxt
        _report(led, "a", tokens, now)
    if tokens < true_tokens:
        led.update_meta("a", now=now, tokens=true_tokens)  # its last events, within the block
    return led, pol, now, {"a": true_tokens, "b": true_tokens}


def test_a_drained_backlog_opens_the_window_and_it_closes_after_late_window_s() -> None:
    led, pol, now, _ = _stale_and_true(0.3)
    assert pol.late_at == now
    assert pol._late_now(led) == now
    led.status(now + LATE_WINDOW_S + 0.01)
    assert pol._late_now(led) is None


def _peak_of(states: dict[str, int], extra: bool) -> int:
    """The projected peak of the true state (every lease reported at its true count), plus candidate c."""
    leases = [(-(-tok // BS), 60, {**_meta(), "first_token": True, "tokens": tok}) for tok in states.values()]
    if extra:
        leases.append((PROMPT // BS, 60, _meta()))
    return projected_peak(leases, BS)


def test_while_late_the_projection_follows_the_server_not_the_stale_report() -> None:
    led, _, now, truth = _stale_and_true(0.3)
    stale = projected_peak(((r.held, r.bound, r.meta) for r in led.leases.values()), BS)  # no now
    late = led.status(now, block_size=BS).used
    # b's true count, less the grace step the extrapolation allows for a report due at this instant.
    near_truth = _peak_of({"a": truth["a"], "b": truth["b"] - LATE_GRACE_STEPS}, extra=False)
    assert stale < near_truth, "the stale report undercounts the pool"
    assert late >= near_truth
    # b keeps the stale report's end (it may still be there), so it counts at most its lag more.
    assert late <= near_truth + -(-(truth["b"] - led.leases["b"].meta["tokens"]) // BS) + 1


def test_a_candidate_the_stale_view_admits_is_refused_while_late() -> None:
    """The undercount made concrete: with b's report 30 tokens stale, the stale view admits a third
    request that the pool cannot hold once b's real growth is counted."""
    probe, _, now, truth = _stale_and_true(0.3)
    stale_with_c = projected_peak(
        [*((r.held, r.bound, r.meta) for r in probe.leases.values()), (PROMPT // BS, 60, _meta())], BS)
    true_with_c = _peak_of({"a": truth["a"], "b": truth["b"] - LATE_GRACE_STEPS}, extra=True)
    assert stale_with_c < true_with_c, "the scenario must make the stale view undercount"
    limit = stale_with_c  # room for c by the stale view only
    results = {}
    for stamped in (False, True):
        led, _, _, _ = _stale_and_true(0.3)
        if not stamped:
            for r in led.leases.values():  # what the policy saw before report times existed
                r.meta = {k: v for k, v in r.meta.items() if k not in (TOKENS_AT_KEY, "rate_t0", "rate_n0")}
            led.policy.late_at = None  # type: ignore[attr-defined]
        led.set_limit(limit, now)
        led.enqueue("c", 60, PROMPT // BS, 0, now, meta=_meta())
        results[stamped] = led.grant(now)
    assert results[False] == ["c"]  # before: admitted into a pool it overflows
    assert results[True] == []  # now: waits until the pool really has room


def test_local_budget_stamps_reports_with_its_clock() -> None:
    class Manual:
        t = 5.0

        def monotonic(self) -> float:
            return self.t

        async def sleep(self, seconds: float) -> None:  # pragma: no cover - unused here
            self.t += seconds

        def sleep_sync(self, seconds: float) -> None:  # pragma: no cover - unused here
            self.t += seconds

    clock = Manual()
    budget = LocalBudget(limit_blocks=100, block_size=BS, policy=ElasticPolicy(BS, late_readers=True),
                         clock=clock)
    lease = budget.acquire_sync(60, held=PROMPT // BS, meta=_meta())
    lease.report_progress(11, first_token=True, tokens=PROMPT + 1)
    clock.t = 5.25
    lease.report_progress(12, tokens=PROMPT + 1 + 16)
    meta = budget._ledger.leases[lease.id].meta
    assert meta[TOKENS_AT_KEY] == 5.25 and meta["rate_t0"] == 5.0
    assert lease_step_s(meta) == pytest.approx(0.25 / 16)
    lease.release_sync()


def test_a_lone_request_on_an_empty_pool_is_admitted_while_late() -> None:
    """Review (issue 30, fits' empty-pool fast path): on an empty pool nothing is extrapolated, so the
    late window must not turn the fast path off. A lone request whose bound is the whole limit, forecast
    at its bound (cold_n), projects one rounding block above its cap; refused by the slow path while the
    window is open, it waits with no event left to grant it (LocalBudget grants only on events)."""
    m = {"prompt_tokens": 17, "forecast_tokens": 100_000, "max_output_tokens": 4079, "streaming": True}
    led, pol, now, _ = _stale_and_true(0.3)
    assert pol._late_now(led) == now
    for lid in list(led.leases):
        led.release(lid, now)
    assert not led.leases
    led.set_limit(256, now)
    led.enqueue("lone", 256, 2, 0, now, meta=m)
    assert led.grant(now) == ["lone"]
