"""RedisBudget's predicted wait and fail-fast (docs/admission.md#predicted-wait-and-fail-fast), against a
real Redis: a fail-fast call whose predicted wait (on a measured pace) exceeds its timeout is refused at
once and leaves nothing behind; a call without the opt-in makes no snapshot call and waits as before; a
guessed pace never refuses; a fail-fast call whose deadline allows it waits and is admitted; and on the
same state (the same leases, reports and waiters at the same instants) ``status().predicted_wait_s`` and
each waiter's prediction equal a LocalBudget's.

Every test uses its own budget name (``redis_prefix``) and deletes its keys afterwards. Waits are
liveness bounds (generous); the one timing assertion (a refusal comes at once) allows half the timeout.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from tests._asgi_server import LoopbackServer
from tests._redis_keys import delete_keys
from zp_client import LocalBudget, Settings, observe_admissions, wrap
from zp_client.budget.base import Lease
from zp_client.budget.predict import FAIL_FAST_KEY, predict_wait_of
from zp_client.budget.redis import RedisBudget
from zp_client.budget.redis._snapshot import SNAPSHOT_CAP, ledger_from_snapshot, predict_waiter
from zp_client.errors import AdmissionTimeout, DeadlineExceeded, LeaseTooLarge

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

BS = 16
STARVE = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture
def budgets(redis_url: str, redis_prefix: str) -> Iterator[Any]:
    made: list[RedisBudget] = []

    def make(limit: int = 20, **kw: Any) -> RedisBudget:
        b = RedisBudget(redis_url, redis_prefix, limit, BS, recovery_s=0, starvation_bound_s=STARVE,
                        longest_first_s=0, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close_sync()
    delete_keys(redis_url, redis_prefix)


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


def meta(prompt: int = 80, forecast: int = 160, **kw: Any) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "forecast_tokens": forecast, "streaming": True, **kw}


def _until(pred: Any, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        time.sleep(0.01)


def _lease_meta(r: redis.Redis, name: str, lid: str) -> dict[str, Any]:
    raw_rec = r.hget(f"{{zp:{name}}}:leases", lid)
    return json.loads(raw_rec)["m"] if raw_rec else {}


def _line(r: redis.Redis, name: str) -> tuple[list[bytes], int]:
    """The line's members and the number of waiter records."""
    return r.zrange(f"{{zp:{name}}}:line", 0, -1), r.hlen(f"{{zp:{name}}}:wait")


def busy(b: RedisBudget, r: redis.Redis, *, report: bool = True) -> Lease:
    """A lease of 15 of the 20 blocks that reported one output token about 0.5 s after its grant: a
    measured pace of ~0.5 s a token, 159 tokens (~80 s) left."""
    lease = b.acquire_sync(15, held=5, meta=meta())
    if report:
        time.sleep(0.5)
        lease.report_progress(6, tokens=81, first_token=True)
        _until(lambda: _lease_meta(r, b.name, lease.id).get("tk") == 81, "the report reached Redis")
    return lease


def spy(face: Any) -> list[str]:
    """Record the scripts a face runs."""
    calls: list[str] = []
    inner = face.eval

    def recording(script: str, *a: Any, **kw: Any) -> Any:
        calls.append(script)
        return inner(script, *a, **kw)

    face.eval = recording
    return calls


def test_fail_fast_refuses_at_once_and_leaves_the_line_as_it_was(budgets: Any, raw: redis.Redis,
                                                                  redis_url: str) -> None:
    b = budgets()
    lease = busy(b, raw)
    # another process's waiter, behind in class 1: the refusal must leave it where it is
    other = RedisBudget(redis_url, b.name, 20, BS, recovery_s=0)
    got: list[Any] = []

    def wait_other() -> None:
        try:
            got.append(other.acquire_sync(10, held=5, priority=1, timeout=60, meta=meta()))
        except Exception as exc:  # noqa: BLE001 - reported through got
            got.append(exc)

    th = threading.Thread(target=wait_other)
    th.start()
    try:
        _until(lambda: _line(raw, b.name)[1] == 1, "the other waiter queued")
        before, line_before = b.status_sync(), _line(raw, b.name)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            b.acquire_sync(15, held=5, timeout=10.0, meta=meta(**{FAIL_FAST_KEY: True}))
        took = time.monotonic() - t0
        err = info.value
        assert isinstance(err, AdmissionTimeout) and isinstance(err, TimeoutError)
        assert took < 5.0, took  # refused at enqueue, not after waiting out its 10 s
        assert err.predicted_wait_s is not None and err.predicted_wait_s > 10.0
        assert err.retry_after_s == pytest.approx(err.predicted_wait_s - 10.0, abs=took + 0.05)
        after = b.status_sync()
        assert _line(raw, b.name) == line_before  # the same members, no waiter record left behind
        assert (after.leases, after.used, after.held, after.waiters) == (
            before.leases, before.used, before.held, before.waiters)
        assert raw.hlen(f"{{zp:{b.name}}}:leases") == 1
    finally:
        lease.release_sync()
        th.join(30)
        other_lease = got[0]
        assert not isinstance(other_lease, Exception), other_lease
        other_lease.release_sync()
        other.close_sync()


async def test_fail_fast_refuses_at_once_on_the_async_face(budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = await asyncio.to_thread(busy, b, raw)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        await b.acquire(15, held=5, timeout=10.0, meta=meta(**{FAIL_FAST_KEY: True}))
    assert time.monotonic() - t0 < 5.0
    assert info.value.predicted_wait_s is not None and info.value.predicted_wait_s > 10.0
    st = await b.status()
    assert (st.leases, st.waiters) == (1, {}) and _line(raw, b.name) == ([], 0)
    await lease.release()


async def test_without_fail_fast_no_snapshot_is_read_and_the_call_waits_as_before(
        budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = await asyncio.to_thread(busy, b, raw)
    side = b._get_side()
    calls = spy(side)
    t0 = time.monotonic()
    with pytest.raises(AdmissionTimeout) as info:
        await b.acquire(15, held=5, timeout=0.5, meta=meta())
    assert type(info.value) is AdmissionTimeout and time.monotonic() - t0 >= 0.5
    # nor with the opt-in but no timeout to refuse on: a fail_fast call without a deadline is never refused
    task = asyncio.ensure_future(b.acquire(15, held=5, meta=meta(**{FAIL_FAST_KEY: True})))
    await asyncio.sleep(0.3)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "snapshot" not in calls and "acquire" in calls
    sync_calls = spy(b._sync_face)
    with pytest.raises(AdmissionTimeout) as info2:
        b.acquire_sync(15, held=5, timeout=0.3, meta=meta())
    assert type(info2.value) is AdmissionTimeout and "snapshot" not in sync_calls
    await lease.release()


def test_fail_fast_does_not_refuse_on_a_guessed_pace(budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = busy(b, raw, report=False)  # no token reported: the pace is the defaults', a guess
    calls = spy(b._sync_face)
    with pytest.raises(AdmissionTimeout) as info:
        b.acquire_sync(15, held=5, timeout=0.3, meta=meta(**{FAIL_FAST_KEY: True}))
    assert type(info.value) is AdmissionTimeout  # it waited its timeout, as without fail-fast
    assert "snapshot" in calls  # predicted, not refused
    assert _line(raw, b.name) == ([], 0)
    lease.release_sync()


async def test_fail_fast_waits_when_the_deadline_allows_it_and_status_predicts_the_head(
        budgets: Any, raw: redis.Redis) -> None:
    b = budgets(predict=True)  # status() predicts only when asked (the snapshot and replay cost)
    lease = await asyncio.to_thread(busy, b, raw)
    task = asyncio.ensure_future(b.acquire(15, held=5, timeout=600.0, meta=meta(**{FAIL_FAST_KEY: True})))
    for _ in range(2000):
        if _line(raw, b.name)[1] == 1:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert not task.done()  # predicted ~80 s, within its 600 s: it waits
    st = await b.status()
    assert list(st.predicted_wait_s) == [0] and 10.0 < st.predicted_wait_s[0] < 600.0
    assert st.head_predicted_wait_s == st.predicted_wait_s[0]
    await lease.release()
    got = await asyncio.wait_for(task, 30)
    assert got.bound == 15
    # its grant recorded its prediction's error (this process's margin and bias learn from it)
    assert b._core.errors.samples(0) == 1 and b._core.predicted == {}
    st2 = await b.status()
    assert st2.predicted_wait_s == {}  # nobody waits
    await got.release()


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t


async def test_the_prediction_equals_local_budgets_on_the_same_state(budgets: Any, raw: redis.Redis) -> None:
    """Two leases with reported tokens and two waiters (two classes, with timeouts) in a RedisBudget;
    then the same leases, reports and waiters at the same instants (Redis's, read back from its records) in
    a LocalBudget on a manual clock: the status' per-class predictions and every waiter's own prediction
    (the fail-fast one) are the same numbers."""
    b = budgets(24)
    name = b.name
    ra = await b.acquire(15, held=5, meta=meta(80, 160))
    rb = await b.acquire(15, held=5, meta=meta(80, 60))
    await asyncio.sleep(0.4)
    ra.report_progress(6, tokens=90, first_token=True)
    rb.report_progress(6, tokens=85, first_token=True)
    for _ in range(2000):
        if _lease_meta(raw, name, ra.id).get("tk") == 90 and _lease_meta(raw, name, rb.id).get("tk") == 85:
            break
        await asyncio.sleep(0.01)
    w1 = asyncio.ensure_future(b.acquire(15, held=5, timeout=60.0, meta=meta(80, 160)))
    await asyncio.sleep(0.05)
    w2 = asyncio.ensure_future(b.acquire(10, held=5, priority=1, timeout=30.0, meta=meta(80, 40)))
    for _ in range(2000):
        if _line(raw, name)[1] == 2:
            break
        await asyncio.sleep(0.01)
    reply = await b._get_side().eval("snapshot", [SNAPSHOT_CAP], init=False)
    assert reply[0] == b"S"
    leases = {k.decode(): json.loads(v) for k, v in raw.hgetall(f"{{zp:{name}}}:leases").items()}
    waiters = {k.decode(): json.loads(v) for k, v in raw.hgetall(f"{{zp:{name}}}:wait").items()}
    assert len(leases) == 2 and len(waiters) == 2, (leases, waiters)

    # the same history in a LocalBudget, at Redis's instants
    clock = _Clock()
    local = LocalBudget(24, BS, clock=clock, starvation_bound_s=STARVE, longest_first_s=0)
    clock.t = leases[ra.id]["g"] / 1000
    la = local.acquire_sync(15, held=5, meta=meta(80, 160))
    clock.t = leases[rb.id]["g"] / 1000
    lb = local.acquire_sync(15, held=5, meta=meta(80, 60))
    la.report_progress(6, tokens=90, first_token=True)
    lb.report_progress(6, tokens=85, first_token=True)
    by_order = sorted(waiters.items(), key=lambda kv: kv[1]["o"])
    local_tasks = []
    for (_wid, w), (blocks, prio, timeout, fc) in zip(by_order, ((15, 0, 60.0, 160), (10, 1, 30.0, 40)),
                                                     strict=True):
        assert (w["b"], w["p"]) == (blocks, prio)
        assert w["q"] - w["s"] == timeout * 1000  # the give-up time the prediction reads
        clock.t = w["s"] / 1000
        local_tasks.append(asyncio.ensure_future(
            local.acquire(blocks, held=5, priority=prio, timeout=timeout, meta=meta(80, fc))))
        await asyncio.sleep(0)  # it enqueues at clock.t
    assert local.status_sync().waiters.keys() == {0, 1}
    clock.t = int(reply[1]) / 1000
    try:
        want = local.status_sync().predicted_wait_s
        got = b._core.predicted_heads(reply)
        assert got is not None and want.keys() == got.keys() == {0, 1}, (want, got)
        for p in want:
            assert got[p] == pytest.approx(want[p], abs=1e-6)
        snap = ledger_from_snapshot(reply)
        assert snap is not None
        local_ids = [w.id for w in local._ledger.line()]
        redis_ids = [w.id for w in snap.ledger.line()]
        assert len(local_ids) == len(redis_ids) == 2
        for lid, rid in zip(local_ids, redis_ids, strict=True):
            others = {k: v for k, v in local._leave_at.items() if k != lid}
            want_w = predict_wait_of(local._ledger, lid, clock.t, block_size=BS, leave_at=others)
            got_w = predict_waiter(snap, rid, None)
            assert want_w is not None and got_w is not None
            assert (got_w.wait_s, got_w.exact) == (pytest.approx(want_w.wait_s, abs=1e-6), want_w.exact)
            assert got_w.timing is not None and want_w.timing is not None
            assert got_w.timing.samples == want_w.timing.samples == 2
            assert got_w.timing.step_s == pytest.approx(want_w.timing.step_s, rel=1e-9)
    finally:
        for t in (w1, w2, *local_tasks):
            t.cancel()
        await asyncio.gather(w1, w2, *local_tasks, return_exceptions=True)
        await ra.release()
        await rb.release()
        la.release_sync()
        lb.release_sync()


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


async def test_a_refused_call_through_wrap_is_deadline_exceeded_and_sends_nothing(
        budgets: Any, raw: redis.Redis, server: LoopbackServer) -> None:
    """The header reaches RedisBudget as LocalBudget's: ``X-ZP-Fail-Fast`` with ``X-ZP-Deadline``."""
    b = budgets()
    lease = await asyncio.to_thread(busy, b, raw)
    c = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="x", timeout=30), budget=b,
             settings=Settings(estimator="heuristic", default_max_tokens=8))
    sent_before = len(server.llm_requests())
    msgs = [{"role": "user", "content": "hello there"}]
    with observe_admissions() as seen, pytest.raises(DeadlineExceeded) as info:
        await c.chat.completions.create(model="ok", messages=msgs, max_tokens=200,
                                        extra_headers={"X-ZP-Deadline": "1", "X-ZP-Fail-Fast": "1"})
    assert info.value.predicted_wait_s is not None and info.value.predicted_wait_s > 1
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    assert seen == [] and len(server.llm_requests()) == sent_before  # no lease, nothing sent
    st = await b.status()
    assert st.leases == 1 and not st.waiters and _line(raw, b.name) == ([], 0)
    await lease.release()


# Review rev31: every way a fail-fast waiter that was predicted (not refused) leaves -- timed out, cancelled,
# too large, granted on the blocking face -- leaves no waiter in Redis and no entry in Core.predicted.
FF = {FAIL_FAST_KEY: True}


def test_sync_timeout_after_an_unrefused_prediction_leaves_nothing(budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = busy(b, raw, report=False)  # a guessed pace: predicted (exactly), never refused
    with pytest.raises(AdmissionTimeout) as info:
        b.acquire_sync(15, held=5, timeout=0.3, meta=meta(**FF))
    assert type(info.value) is AdmissionTimeout
    assert b._core.predicted == {} and _line(raw, b.name) == ([], 0)
    lease.release_sync()


async def test_async_timeout_and_cancel_after_an_unrefused_prediction_leave_nothing(
        budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = await asyncio.to_thread(busy, b, raw, report=False)
    with pytest.raises(AdmissionTimeout):
        await b.acquire(15, held=5, timeout=0.3, meta=meta(**FF))
    assert b._core.predicted == {} and _line(raw, b.name) == ([], 0)
    task = asyncio.ensure_future(b.acquire(15, held=5, timeout=600.0, meta=meta(**FF)))
    for _ in range(3000):
        if b._core.predicted:
            break
        await asyncio.sleep(0.01)
    assert len(b._core.predicted) == 1  # predicted, not refused
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.2)
    assert b._core.predicted == {} and _line(raw, b.name) == ([], 0)
    await lease.release()


async def test_lease_too_large_while_waiting_leaves_nothing(budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = await asyncio.to_thread(busy, b, raw)
    task = asyncio.ensure_future(b.acquire(15, held=5, timeout=600.0, meta=meta(**FF)))
    for _ in range(3000):
        if b._core.predicted:
            break
        await asyncio.sleep(0.01)
    assert len(b._core.predicted) == 1
    await b.set_limit(10)
    with pytest.raises(LeaseTooLarge):
        await asyncio.wait_for(task, 30)
    assert b._core.predicted == {} and _line(raw, b.name) == ([], 0)
    await lease.release()


def test_sync_grant_records_the_error(budgets: Any, raw: redis.Redis) -> None:
    b = budgets()
    lease = busy(b, raw)
    got: list[Any] = []

    def wait() -> None:
        try:
            got.append(b.acquire_sync(15, held=5, timeout=600.0, meta=meta(**FF)))
        except Exception as exc:  # noqa: BLE001
            got.append(exc)

    th = threading.Thread(target=wait)
    th.start()
    _until(lambda: len(b._core.predicted) == 1, "the sync waiter was predicted")
    lease.release_sync()
    th.join(30)
    assert got and not isinstance(got[0], Exception), got
    assert b._core.errors.samples(0) == 1 and b._core.predicted == {}
    got[0].release_sync()


@pytest.mark.parametrize("face", ["async", "sync"])
async def test_a_grant_that_lands_during_the_prediction_is_released_with_the_refusal(
        budgets: Any, raw: redis.Redis, redis_url: str, face: str) -> None:
    """docs/admission.md (RedisBudget): "A grant that came in the meantime is released the same way"."""
    b = budgets()
    other = RedisBudget(redis_url, b.name, 20, BS, recovery_s=0)
    try:
        held = other.acquire_sync(15, held=5, meta=meta())
        core = b._core

        def refuse_after_a_grant(reply: Any, rid: str, left_s: float, *_: Any) -> DeadlineExceeded:
            held.release_sync()  # the waiter is granted while its prediction runs
            _until(lambda: raw.hexists(f"{{zp:{b.name}}}:leases", rid), "the waiter was granted")
            return DeadlineExceeded("refused for the test", predicted_wait_s=99.0, retry_after_s=1.0)

        core.fail_fast_refusal = refuse_after_a_grant  # type: ignore[method-assign]
        with pytest.raises(DeadlineExceeded):
            if face == "async":
                await b.acquire(15, held=5, timeout=30.0, meta=meta(**FF))
            else:
                await asyncio.to_thread(b.acquire_sync, 15, held=5, timeout=30.0, meta=meta(**FF))
        _until(lambda: raw.hlen(f"{{zp:{b.name}}}:leases") == 0, "the grant was released")
        st = await b.status()
        assert (st.leases, st.used, st.waiters) == (0, 0, {}) and _line(raw, b.name) == ([], 0)
        assert core.predicted == {}
    finally:
        other.close_sync()


@pytest.mark.parametrize("face", ["async", "sync"])
async def test_the_refusal_compares_with_the_time_left_after_the_enqueue(
        budgets: Any, raw: redis.Redis, face: str) -> None:
    """The prediction is compared with the timeout less what the enqueue took (docs/admission.md, "its
    timeout less what the enqueue took"): an enqueue slowed by 0.5 s leaves at most 1.5 of 2 s."""
    b = budgets()
    lease = await asyncio.to_thread(busy, b, raw, report=False)
    core = b._core
    seen: list[float] = []
    real = core.fail_fast_refusal

    def spy_left(reply: Any, rid: str, left_s: float, *rest: Any) -> Any:
        seen.append(left_s)
        return real(reply, rid, left_s, *rest)

    core.fail_fast_refusal = spy_left  # type: ignore[method-assign]
    target = b._get_side() if face == "async" else b._sync_face
    inner = target.eval
    if face == "async":
        async def slow(script: str, *a: Any, **kw: Any) -> Any:
            if script == "acquire":
                await asyncio.sleep(0.5)
            return await inner(script, *a, **kw)
        target.eval = slow
        task = asyncio.ensure_future(b.acquire(15, held=5, timeout=2.0, meta=meta(**FF)))
    else:
        def slow_sync(script: str, *a: Any, **kw: Any) -> Any:
            if script == "acquire":
                time.sleep(0.5)
            return inner(script, *a, **kw)
        target.eval = slow_sync
        task = asyncio.ensure_future(asyncio.to_thread(b.acquire_sync, 15, held=5, timeout=2.0,
                                                       meta=meta(**FF)))
    for _ in range(3000):
        if seen:
            break
        await asyncio.sleep(0.01)
    await asyncio.gather(task, return_exceptions=True)  # a guessed pace: it waits out its 2 s
    assert seen and 0 < seen[0] <= 1.5, seen
    await lease.release()


def test_status_predicts_only_when_asked(budgets: Any, raw: redis.Redis) -> None:
    """``status()`` with waiters reads the snapshot and replays it only with ``predict=True``: the
    default (``predict=False``) makes no ``snapshot`` call and reports no predicted wait; the waiter is
    the same one in both."""
    b = budgets()
    lease = busy(b, raw)
    got: list[Any] = []
    # a timeout past its ~80 s predicted wait: the replay takes a waiter out of line at its give-up time
    th = threading.Thread(target=lambda: got.append(b.acquire_sync(15, held=5, timeout=600.0, meta=meta())))
    th.start()
    try:
        _until(lambda: _line(raw, b.name)[1] == 1, "the waiter is in line")
        calls = spy(b._sync_face)
        st = b.status_sync()
        assert st.waiters and st.predicted_wait_s == {} and calls == ["status"]
        asked = RedisBudget(b._core.url, b.name, 20, BS, predict=True)
        try:
            st2 = asked.status_sync()
            assert list(st2.predicted_wait_s) == [0] and st2.predicted_wait_s[0] > 10.0
        finally:
            asked.close_sync()
    finally:
        lease.release_sync()
        th.join(30)
    assert got and got[0].bound == 15
    got[0].release_sync()
