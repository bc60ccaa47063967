"""Predicted wait and fail-fast (issue 30; docs/admission.md#predicted-wait-and-fail-fast): the predictor
on hand-built ledgers (virtual time: every ``now`` is given), fail-fast refusing at once with its fields
and nothing held, and the opt-in: without it nothing changes."""

from __future__ import annotations

import math
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest

from tests._asgi_server import LoopbackServer
from tests._meta_spy import MetaSpy
from zp_client import LocalBudget, Settings, observe_admissions, wrap
from zp_client._admission.plan import FAIL_FAST_META, read_headers
from zp_client.budget.elastic import make_policy
from zp_client.budget.ledger import Ledger
from zp_client.budget.predict import (
    DEFAULT_STEP_S,
    FAIL_FAST_COLD_FACTOR,
    FAIL_FAST_KEY,
    FAIL_FAST_MIN_SAMPLES,
    ErrorWindow,
    pool_timing,
    predict_wait_of,
    predict_waits,
)
from zp_client.errors import AdmissionTimeout, DeadlineExceeded, InvalidRequest, LeaseTooLarge

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

BS = 16


def meta(prompt: int = 80, forecast: int = 160, **kw: Any) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "forecast_tokens": forecast, "streaming": True, **kw}


def elastic(limit: int) -> Ledger:
    return Ledger(limit, policy=make_policy("elastic", block_size=BS))


def run_lease(led: Ledger, lid: str, *, at: float, generated: int, prompt: int = 80,
              forecast: int = 160) -> None:
    """A lease granted at ``at`` that has reported ``generated`` output tokens."""
    led.enqueue(lid, 15, prompt // BS, 0, at, meta=meta(prompt, forecast))
    assert led.grant(at) == [lid]
    led.update_meta(lid, tokens=prompt + 1, first_token=True)
    led.update_meta(lid, tokens=prompt + generated)
    led.report_held(lid, -(-(prompt + generated) // BS))


class ManualClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
        await anyio.sleep(0)

    def sleep_sync(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


# ------------------------------------------------------------------------------------------ predictor


def test_a_waiter_is_predicted_at_the_end_of_the_lease_it_waits_for() -> None:
    led = elastic(20)
    run_lease(led, "a", at=0.0, generated=100)  # 100 tokens in 10 s: 0.1 s a token, 60 left
    led.enqueue("b", 15, 5, 0, 0.0, meta=meta())
    assert led.grant(10.0) == []
    t = pool_timing(led.leases, 10.0)
    assert t.step_s == pytest.approx(0.1) and t.samples == 1
    p = predict_wait_of(led, "b", 10.0, block_size=BS)
    assert p is not None and p.exact and p.wait_s == pytest.approx(6.0)
    # the ledger itself is untouched by the replay
    assert list(led.leases) == ["a"] and led.waiter("b") is not None and led.leases["a"].held == 12


def test_the_line_ahead_adds_the_leases_it_will_take() -> None:
    led = elastic(20)
    run_lease(led, "a", at=0.0, generated=100)
    led.enqueue("b", 15, 5, 0, 1.0, meta=meta())
    led.enqueue("c", 15, 5, 0, 2.0, meta=meta())
    led.grant(10.0)
    waits = predict_waits(led, 10.0, block_size=BS)
    # b: when a ends (6 s); c: when b ends, its first token (no fitted ttft with one sample: 0) and 160
    # output tokens at 0.1 s later
    assert waits["b"] == pytest.approx(6.0)
    assert waits["c"] == pytest.approx(6.0 + 160 * 0.1)
    only_c = predict_wait_of(led, "c", 10.0, block_size=BS)
    assert only_c is not None and only_c.exact and only_c.wait_s == pytest.approx(waits["c"])


def test_a_waiter_ahead_that_gives_up_leaves_the_replay_at_its_timeout() -> None:
    led = elastic(20)
    run_lease(led, "a", at=0.0, generated=100)
    led.enqueue("b", 15, 5, 0, 1.0, meta=meta())
    led.enqueue("c", 15, 5, 0, 2.0, meta=meta())
    led.grant(10.0)
    # b gives up at 12 s, before a ends at 16 s: c takes a's place
    p = predict_wait_of(led, "c", 10.0, block_size=BS, leave_at={"b": 12.0})
    assert p is not None and p.exact and p.wait_s == pytest.approx(6.0)
    # b gives up after a ends: it is admitted first, c waits for it as before
    waits = predict_waits(led, 10.0, block_size=BS, leave_at={"b": 30.0})
    assert waits["c"] == pytest.approx(6.0 + 16.0)
    # the target itself giving up first: a lower bound at its own give-up time
    own = predict_wait_of(led, "c", 10.0, block_size=BS, leave_at={"c": 13.0})
    assert own is not None and not own.exact and own.wait_s == pytest.approx(3.0)


def test_a_more_urgent_class_goes_first_in_the_replay() -> None:
    led = elastic(20)
    run_lease(led, "a", at=0.0, generated=100)
    led.enqueue("low", 15, 5, 1, 1.0, meta=meta())
    led.enqueue("high", 15, 5, 0, 2.0, meta=meta())
    led.grant(10.0)
    waits = predict_waits(led, 10.0, block_size=BS)
    assert waits["high"] == pytest.approx(6.0)
    assert waits["low"] > waits["high"] + 10


def test_the_step_time_is_fitted_on_the_live_leases() -> None:
    led = elastic(1000)
    # ttft 0.5 s and 0.05 s a token: age = 0.5 + 0.05 x generated
    for i, gen in enumerate((20, 60, 100, 140)):
        age = 0.5 + 0.05 * gen
        run_lease(led, f"l{i}", at=10.0 - age, generated=gen)
    t = pool_timing(led.leases, 10.0)
    assert t.samples == 4
    assert t.step_s == pytest.approx(0.05) and t.ttft_s == pytest.approx(0.5)
    assert pool_timing({}, 10.0).step_s == DEFAULT_STEP_S


def test_a_lease_without_projection_gives_a_lower_bound() -> None:
    led = Ledger(20)  # strict, no meta: the lease holds its bound for as long as the ledger can tell
    led.enqueue("a", 15, 15, 0, 0.0)
    led.grant(0.0)
    led.enqueue("b", 15, 5, 0, 0.0)
    led.grant(1.0)
    p = predict_wait_of(led, "b", 1.0)
    assert p is not None and not p.exact and p.wait_s == 0.0
    assert predict_waits(led, 1.0) == {}
    assert predict_wait_of(led, "nobody", 1.0) is None


# ------------------------------------------------------------------------------------------ LocalBudget


def budget_with_a_busy_lease(**kw: Any) -> tuple[LocalBudget, ManualClock, Any]:
    clock = ManualClock()
    b = LocalBudget(20, BS, clock=clock, **kw)
    lease = b.acquire_sync(15, held=5, meta=meta())
    lease.report_progress(6, tokens=81, first_token=True)
    clock.t = 10.0
    lease.report_progress(12, tokens=180)  # 0.1 s a token, 60 tokens (6 s) left
    return b, clock, lease


def test_fail_fast_refuses_at_once_with_its_fields_and_holds_nothing() -> None:
    b, clock, lease = budget_with_a_busy_lease()
    before = b.status_sync()
    assert before.leases == 1 and not before.waiters
    with pytest.raises(DeadlineExceeded) as info:
        b.acquire_sync(15, held=5, timeout=2.0, meta=meta(**{FAIL_FAST_KEY: True}))
    err = info.value
    assert isinstance(err, AdmissionTimeout) and isinstance(err, TimeoutError)
    assert err.predicted_wait_s == pytest.approx(6.0)
    assert err.retry_after_s == pytest.approx(4.0)
    assert clock.t == 10.0  # refused at enqueue: no time passed
    after = b.status_sync()
    assert after.leases == 1 and not after.waiters and after.used == before.used
    assert b.status_sync().extra["granted"] == 1
    # the fields survive pickling (a worker process hands errors back pickled)
    again = pickle.loads(pickle.dumps(err))
    assert again.predicted_wait_s == err.predicted_wait_s and again.retry_after_s == err.retry_after_s


def test_fail_fast_does_not_refuse_on_a_guessed_pace() -> None:
    clock = ManualClock()
    b = LocalBudget(20, BS, clock=clock)
    lease = b.acquire_sync(15, held=5, meta=meta())  # no token reported yet: the pace is the defaults'
    clock.t = 1.0
    with pytest.raises(AdmissionTimeout) as info:
        b.acquire_sync(15, held=5, timeout=0.01, meta=meta(**{FAIL_FAST_KEY: True}))
    assert type(info.value) is AdmissionTimeout  # it waited its timeout, as without fail-fast
    st = b.status_sync()
    assert not st.waiters and st.leases == 1
    lease.release_sync()


async def test_fail_fast_waits_when_the_deadline_allows_it() -> None:
    b, clock, lease = budget_with_a_busy_lease()
    got: list[Any] = []

    async def wait() -> None:
        got.append(await b.acquire(15, held=5, timeout=8.0, meta=meta(**{FAIL_FAST_KEY: True})))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.05)
        assert b.status_sync().waiters[0].waiters == 1
        st = b.status_sync()
        assert st.predicted_wait_s == {0: pytest.approx(6.0)}
        assert st.head_predicted_wait_s == pytest.approx(6.0)
        clock.t = 16.0
        lease.release_sync()
    assert got[0].predicted_wait_s == pytest.approx(6.0)
    got[0].release_sync()


def test_without_fail_fast_nothing_is_predicted_or_refused() -> None:
    b, clock, lease = budget_with_a_busy_lease()
    # the same call without the opt-in waits its whole timeout and ends as before: a plain AdmissionTimeout
    with pytest.raises(AdmissionTimeout) as info:
        b.acquire_sync(15, held=5, timeout=0.01, meta=meta())
    assert type(info.value) is AdmissionTimeout
    assert b._predicted == {}
    # fail_fast without a timeout (no deadline) cannot be refused either
    b2, _, lease2 = budget_with_a_busy_lease()
    with pytest.raises(AdmissionTimeout) as info2:
        b2.acquire_sync(15, held=5, timeout=0.01, meta=meta(**{FAIL_FAST_KEY: False}))
    assert type(info2.value) is AdmissionTimeout


def test_predict_records_the_wait_beside_the_actual_one() -> None:
    b, clock, lease = budget_with_a_busy_lease(predict=True)
    done: list[Any] = []

    def take() -> None:
        done.append(b.acquire_sync(15, held=5, timeout=60, meta=meta()))

    th = threading.Thread(target=take)
    th.start()
    while not b.status_sync().waiters:
        th.join(0.01)
    clock.t = 16.0
    lease.release_sync()
    th.join(10)
    assert done and done[0].predicted_wait_s == pytest.approx(6.0)


def test_the_error_window_margin_is_the_quantile_of_recent_over_predictions() -> None:
    w = ErrorWindow(quantile=0.9, min_samples=10, window=20)
    for i in range(9):
        w.record(0, 5.0, 5.0 - i)  # over-predicted by 0..8 s
    assert w.samples(0) == 9 and w.margin(0) == 0.0  # too few: no margin, the raw prediction decides
    w.record(0, 5.0, -4.0)  # 9 s
    assert w.margin(0) == pytest.approx(8.0)  # the 9th of the 10 sorted errors 0..9
    assert w.margin(1) == pytest.approx(8.0)  # class 1 has seen nothing: every class's errors say 8 s
    w.record(1, 20.0, 0.0)
    assert w.margin(1) == pytest.approx(20.0)  # and its own, while too few, only ever add to that
    w2 = ErrorWindow(quantile=0.9, min_samples=10, window=20)
    for _ in range(10):
        w2.record(1, 1.0, 1.0)
    assert w2.margin(0) == 0.0 and w2.margin(1) == 0.0
    for _ in range(20):
        w.record(0, 1.0, 3.0)  # under-predicted by 2 s, 20 times: the window keeps the last 20
    assert w.samples(0) == 20 and w.margin(0) == 0.0  # never below 0: a margin only ever refuses less
    w.record(0, math.inf, 1.0)
    w.record(0, 1.0, math.nan)
    assert w.samples(0) == 20  # not finite: ignored
    w3 = ErrorWindow(min_samples=3, window=4)
    for e in (1.0, 7.0):
        w3.record(2, e, 0.0)
    assert w3.bias(2) == 0.0  # too few
    w3.record(2, 2.0, 0.0)
    assert w3.bias(2) == pytest.approx(2.0)  # the median of 1, 7, 2
    w3.record(2, 10.0, 0.0)
    assert w3.bias(2) == pytest.approx(4.5)  # of 1, 7, 2, 10: between 2 and 7
    w3.record(2, -3.0, 0.0)  # the window keeps 4: 7, 2, 10, -3
    assert w3.bias(2) == pytest.approx(4.5) and w3.bias(0) == 0.0
    with pytest.raises(ValueError):
        ErrorWindow(quantile=1.0)
    with pytest.raises(ValueError):
        ErrorWindow(min_samples=30, window=20)


class Rounds:
    """A LocalBudget (limit 20, manual clock, ``predict=True``) and what its error-window tests repeat: a
    lease of 15 blocks 10 s into its stream, and a waiter of 15 queued behind it on a thread."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.b = LocalBudget(20, BS, clock=self.clock, predict=True)
        self.waiting: Any = None  # the status seen while the last round's waiter waited

    def busy_lease(self, tokens: int = 180) -> Any:
        """180 tokens: 0.1 s a token, 60 tokens (6 s) left; 130: 0.2 s a token, 110 left (22 s)."""
        lease = self.b.acquire_sync(15, held=5, meta=meta())
        lease.report_progress(6, tokens=81, first_token=True)
        self.clock.t += 10.0
        lease.report_progress(-(-tokens // BS), tokens=tokens)
        return lease

    def queue(self, priority: int = 0, **kw: Any) -> tuple[threading.Thread, list[Any]]:
        got: list[Any] = []
        extra = kw.pop("extra", {})

        def take() -> None:
            try:
                got.append(self.b.acquire_sync(15, held=5, priority=priority, meta=meta(**extra), **kw))
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                got.append(exc)

        th = threading.Thread(target=take)
        th.start()
        while not self.b.status_sync().waiters and not got:
            th.join(0.01)
        return th, got

    def round(self, after_s: float, priority: int = 0, *, timeout: float = 60.0,
              fail_fast: bool = False) -> Any:
        """One waiter behind a busy lease (the replay says 6 s), admitted ``after_s`` later (it must wait,
        not be refused); returns what it reported as its predicted wait. ``self.waiting``: the budget's
        status while it waited."""
        lease = self.busy_lease()
        th, got = self.queue(priority, timeout=timeout, extra={FAIL_FAST_KEY: True} if fail_fast else {})
        assert not got, got  # waiting, not refused
        self.waiting = self.b.status_sync()
        assert self.waiting.waiters[priority].waiters == 1
        self.clock.t += after_s
        lease.release_sync()
        th.join(10)
        assert got and not isinstance(got[0], BaseException), got
        got[0].release_sync()
        return got[0].predicted_wait_s


def test_fail_fast_refuses_only_beyond_the_errors_its_class_has_shown() -> None:
    """A budget whose predictions for class 0 ran 5 s long (each waiter predicted at 6 s, admitted after
    1 s, as a lease ended early) does not refuse a 6 s prediction against a 2 s deadline: its recent
    errors say such a waiter is admitted in about 1 s; and it reports its predictions less that bias. A
    fresh budget refuses the same call (test_fail_fast_refuses_at_once_with_its_fields_and_holds_nothing)."""
    r = Rounds()
    b = r.b
    for _ in range(FAIL_FAST_MIN_SAMPLES):
        assert r.round(1.0) == pytest.approx(6.0)  # no bias before 20 errors
    # reported: the replay's 6 s less the class's bias (its errors' median, 5 s), in status too
    assert r.round(1.0) == pytest.approx(1.0)
    assert r.waiting.predicted_wait_s == {0: pytest.approx(1.0)}
    # 6 s predicted, 2 s left, the errors seen say 5 s too long: it waits (admitted after 1 s)
    assert r.round(1.0, timeout=2.0, fail_fast=True) == pytest.approx(1.0)
    # a prediction beyond the deadline by more than the errors seen is still refused at once
    lease = r.busy_lease(tokens=130)  # 22 s: 22 - 5 > 2
    with pytest.raises(DeadlineExceeded) as info:
        b.acquire_sync(15, held=5, timeout=2.0, meta=meta(**{FAIL_FAST_KEY: True}))
    assert info.value.predicted_wait_s == pytest.approx(17.0)  # 22 s less the bias
    assert info.value.retry_after_s == pytest.approx(15.0)
    msg = str(info.value)
    assert "the replay's wait 22.000 s exceeds the 2.000 s left" in msg  # what the rule compared
    assert "recent prediction error (5.000 s)" in msg and "predicted wait 17.000 s" in msg
    assert not b.status_sync().waiters
    lease.release_sync()


def test_until_it_has_seen_its_errors_a_budget_refuses_only_beyond_twice_the_time_left() -> None:
    """Before every class's errors together number 20 the budget has no margin to go by: it refuses only
    a prediction of more than FAIL_FAST_COLD_FACTOR (2) times the time left (a 6 s prediction with 4 s
    left waits, with 2 s left it is refused: test_fail_fast_refuses_at_once_with_its_fields_and_holds_
    nothing). Once it has seen 20 right predictions (margin 0) the same 6 s against 4 s is refused."""
    assert FAIL_FAST_COLD_FACTOR == 2.0
    r = Rounds()
    b = r.b
    assert r.round(6.0, timeout=4.0, fail_fast=True) == pytest.approx(6.0)  # 6 <= 2 x 4: it waits
    for _ in range(FAIL_FAST_MIN_SAMPLES - 1):
        r.round(6.0)  # the predictions were right: errors 0
    lease = r.busy_lease()
    with pytest.raises(DeadlineExceeded) as info:
        b.acquire_sync(15, held=5, timeout=4.0, meta=meta(**{FAIL_FAST_KEY: True}))
    assert info.value.predicted_wait_s == pytest.approx(6.0)
    assert not b.status_sync().waiters
    lease.release_sync()


def test_the_window_keeps_the_replays_errors_not_the_corrected_ones() -> None:
    """The bias corrects what is reported; the window must keep learning from the replay's own
    predictions, else the correction feeds back on itself: 20 more waiters reported at 1 s (6 s less
    the 5 s bias) and admitted after 1 s leave the bias at 5 s (their replay errors are 5 s; the
    corrected ones would be 0, and the median of 20 fives and 20 zeros would report 3.5 s)."""
    r = Rounds()
    for _ in range(FAIL_FAST_MIN_SAMPLES):
        r.round(1.0)
    for _ in range(FAIL_FAST_MIN_SAMPLES):
        assert r.round(1.0) == pytest.approx(1.0)
    assert r.round(1.0) == pytest.approx(1.0)


def test_each_class_has_its_own_margin_and_bias() -> None:
    """Class 0's predictions ran 5 s long, class 1's were right (admitted after the 6 s predicted). A
    class-1 fail-fast call with 2 s left, predicted 6 s: before class 1 has 20 errors it borrows every
    class's margin (5 s: waits); once it has its own (0 s), it is refused, while class 0's is not; and
    each class's bias is its own (class 0 reports 1 s, class 1 6 s)."""
    r = Rounds()
    b = r.b
    for _ in range(FAIL_FAST_MIN_SAMPLES):
        r.round(1.0)
    # class 1 has no errors of its own: the pooled margin (5 s) lets it wait; no bias of its own yet
    assert r.round(1.0, priority=1, timeout=2.0, fail_fast=True) == pytest.approx(6.0)
    for _ in range(FAIL_FAST_MIN_SAMPLES):
        assert r.round(6.0, priority=1) == pytest.approx(6.0)
    assert r.round(6.0, priority=1) == pytest.approx(6.0)  # class 1's bias: about 0
    lease = r.busy_lease()
    with pytest.raises(DeadlineExceeded):  # class 1's own margin now: about 0
        b.acquire_sync(15, held=5, priority=1, timeout=2.0, meta=meta(**{FAIL_FAST_KEY: True}))
    th, got = r.queue(0, timeout=2.0, extra={FAIL_FAST_KEY: True})
    assert not got  # class 0's margin is still 5 s
    r.clock.t += 1.0
    lease.release_sync()
    th.join(10)
    assert got and got[0].predicted_wait_s == pytest.approx(1.0)
    got[0].release_sync()


def test_a_waiter_failed_by_a_lowered_limit_leaves_no_prediction_behind() -> None:
    """Every way a predicted waiter leaves the line drops its prediction: a grant, a timeout, a refusal,
    and a limit lowered below its size (LeaseTooLarge), which must not leave its replay record
    (_predicted_from) behind: one entry a failed waiter, for the budget's lifetime."""
    b, clock, lease = budget_with_a_busy_lease(predict=True)
    got: list[Any] = []

    def take() -> None:
        try:
            got.append(b.acquire_sync(15, held=5, timeout=60, meta=meta()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    th = threading.Thread(target=take)
    th.start()
    while not b.status_sync().waiters:
        th.join(0.01)
    assert len(b._predicted) == 1 and len(b._predicted_from) == 1  # predicted exactly
    b.set_limit_sync(10)  # 15 blocks can never fit: the waiter fails
    th.join(10)
    assert got and isinstance(got[0], LeaseTooLarge)
    assert b._predicted == {}
    assert b._predicted_from == {}
    lease.release_sync()


# ------------------------------------------------------------------------------------------ through wrap()


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


MSGS = [{"role": "user", "content": "hello there"}]


def test_the_fail_fast_header_and_setting_reach_the_budget_only_with_a_deadline(
        server: LoopbackServer) -> None:
    assert FAIL_FAST_META == FAIL_FAST_KEY
    b = MetaSpy(policy="elastic")
    c = wrap(openai.OpenAI(base_url=server.base_url, api_key="x", timeout=30), budget=b,
             settings=Settings(estimator="heuristic"))
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8)
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, extra_headers={"X-ZP-Deadline": "30"})
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, extra_headers={"X-ZP-Fail-Fast": "1"})
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                              extra_headers={"X-ZP-Fail-Fast": "true", "X-ZP-Deadline": "30"})
    assert not any(k.startswith("x-zp-") for k in server.llm_requests()[-1]["headers"])  # consumed
    flags = [bool(m and m.get(FAIL_FAST_KEY)) for m in b.metas]
    assert flags == [False, False, False, True]  # opt-in, and only with a deadline to refuse on
    c2 = wrap(openai.OpenAI(base_url=server.base_url, api_key="x", timeout=30), budget=b,
              settings=Settings(estimator="heuristic", fail_fast=True, deadline_s=30))
    c2.chat.completions.create(model="ok", messages=MSGS, max_tokens=8)
    c2.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, extra_headers={"X-ZP-Fail-Fast": "0"})
    assert [bool(m and m.get(FAIL_FAST_KEY)) for m in b.metas[4:]] == [True, False]
    assert b.status_sync().used == 0


def test_a_bad_fail_fast_header_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest) as info:
        read_headers([(b"X-ZP-Fail-Fast", b"maybe")])
    assert info.value.field == "X-ZP-Fail-Fast"
    assert read_headers([(b"x-zp-fail-fast", b" Yes ")]).fail_fast is True
    assert read_headers([]).fail_fast is None


def test_settings_fail_fast_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().fail_fast is False
    monkeypatch.setenv("ZP_FAIL_FAST", "true")
    assert Settings().fail_fast is True


async def test_a_refused_call_through_wrap_is_deadline_exceeded_with_its_prediction(
        server: LoopbackServer) -> None:
    b, clock, lease = budget_with_a_busy_lease()
    c = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="x", timeout=30), budget=b,
             settings=Settings(estimator="heuristic", default_max_tokens=8))
    sent_before = len(server.llm_requests())
    with observe_admissions() as seen, pytest.raises(DeadlineExceeded) as info:
        await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=200,
                                        extra_headers={"X-ZP-Deadline": "1", "X-ZP-Fail-Fast": "1"})
    assert info.value.predicted_wait_s is not None and info.value.predicted_wait_s > 1
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    assert seen == [] and len(server.llm_requests()) == sent_before  # no lease, nothing sent
    assert b.status_sync().leases == 1 and not b.status_sync().waiters
    lease.release_sync()


def test_metrics_export_the_head_prediction_and_the_prediction_error() -> None:
    from prometheus_client import generate_latest

    from zp_client.metrics import ZPMetrics

    b, clock, lease = budget_with_a_busy_lease()
    m = ZPMetrics()
    m.track(b)
    assert b"predicted_wait_seconds{" not in generate_latest(m.registry)  # nobody waits: no sample
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(b.acquire_sync(15, held=5, timeout=30, meta=meta())))
    th.start()
    while not b.status_sync().waiters:
        th.join(0.01)
    text = generate_latest(m.registry).decode()
    assert 'zp_budget_predicted_wait_seconds{budget="local",priority="0"} 6.0' in text
    lease.release_sync()
    th.join(10)
    got[0].release_sync()
    m.predicted(0, 6.0, 4.5)
    text = generate_latest(m.registry).decode()
    assert 'zp_predicted_wait_error_seconds_count{priority="0"} 1.0' in text
    assert 'zp_predicted_wait_error_seconds_bucket{le="-1.0",priority="0"} 1.0' in text


def test_a_policy_the_replay_cannot_copy_costs_the_prediction_only() -> None:
    from zp_client.budget.ledger import StrictPolicy

    class Uncopyable(StrictPolicy):
        def __deepcopy__(self, memo: Any) -> Any:
            raise TypeError("holds a lock")

    clock = ManualClock()
    b = LocalBudget(20, BS, clock=clock, policy=Uncopyable(), predict=True)
    lease = b.acquire_sync(15)
    with pytest.raises(AdmissionTimeout) as info:  # waited as without a prediction, not refused
        b.acquire_sync(15, timeout=0.01, meta={FAIL_FAST_KEY: True})
    assert type(info.value) is AdmissionTimeout
    got: list[Any] = []
    th = threading.Thread(target=lambda: got.append(b.acquire_sync(15, timeout=30)))
    th.start()
    while not b.status_sync().waiters:
        th.join(0.01)
    assert b.status_sync().predicted_wait_s == {}  # status still answers
    lease.release_sync()
    th.join(10)
    assert got and got[0].predicted_wait_s is None
    got[0].release_sync()
