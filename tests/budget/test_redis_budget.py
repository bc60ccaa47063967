"""RedisBudget behaviour beyond the shared conformance suite: idempotency, argument validation in the
scripts, cancellation, expiry, epochs and recovery, held reports, limits, the sync path, an unreachable
Redis, AUTH, and Redis Cluster.

Every test uses its own budget name (``redis_prefix``) and deletes its keys afterwards. Waits are
liveness bounds (generous), never timing assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as redis_async

from tests._redis_keys import delete_keys
from tests.conftest import _free_port, _redis_answers, start_redis_server
from zp_client.budget.redis import RedisBudget, RedisBudgetEvent
from zp_client.budget.redis._script import scripts as _scripts
from zp_client.errors import AdmissionTimeout, BudgetUnavailable, ConfigurationError, LeaseTooLarge

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture
def budgets(redis_url: str, redis_prefix: str) -> Iterator[Any]:
    """Factory of RedisBudgets on the test's name; closes them and deletes the keys afterwards."""
    made: list[RedisBudget] = []

    def make(limit: int = 10, **kw: Any) -> RedisBudget:
        kw.setdefault("recovery_s", 0)
        b = RedisBudget(kw.pop("url", redis_url), kw.pop("name", redis_prefix), limit, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close_sync()
    delete_keys(redis_url, redis_prefix)


async def _until(pred: Any, what: str, limit_s: float = 20.0) -> None:
    """Liveness bound: wait until ``pred()`` (sync or async) is true."""
    deadline = time.monotonic() + limit_s
    while True:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.02)


def _raw(client: redis.Redis, budget: RedisBudget, script: str, *args: Any) -> Any:
    text, sha = _scripts()[script]
    client.script_load(text)
    return client.evalsha(sha, len(budget._core.keys), *budget._core.keys, *args)


# ---------------------------------------------------------------------------------------------- basics
async def test_lease_is_released_when_the_body_raises(budgets: Any) -> None:
    b = budgets(10)
    with pytest.raises(RuntimeError):
        async with b.lease(7) as lease:
            assert (await b.status()).used == 7
            raise RuntimeError("boom")
    assert lease.released
    st = await b.status()
    assert (st.used, st.leases) == (0, 0)
    await b.aclose()


async def test_a_release_wakes_a_waiter_of_another_process(budgets: Any) -> None:
    a, b = budgets(10), budgets(10)
    held = await a.acquire(8)
    waiter = asyncio.create_task(b.acquire(5))
    await _until(lambda: _waiting(b, 1), "waiter queued")
    assert not waiter.done()
    await held.release()
    lease = await asyncio.wait_for(waiter, 20)
    assert (await b.status()).used == 5
    await lease.release()
    await a.aclose()
    await b.aclose()


async def _waiting(b: RedisBudget, n: int) -> bool:
    st = await b.status()
    return sum(c.waiters for c in st.waiters.values()) == n


async def test_too_large_request_fails_at_once(budgets: Any) -> None:
    b = budgets(10)
    with pytest.raises(LeaseTooLarge):
        await b.acquire(11)
    assert (await b.status()).leases == 0
    await b.aclose()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3", True])
async def test_bad_weights_are_refused_by_the_client(budgets: Any, bad: Any) -> None:
    b = budgets(10)
    with pytest.raises(ConfigurationError):
        await b.acquire(bad)
    await b.aclose()


def test_scripts_validate_their_arguments(budgets: Any, redis_url: str) -> None:
    b = budgets(10)
    b.acquire_sync(1).release_sync()  # creates the budget
    r = redis.Redis.from_url(redis_url)
    rid = "x" * 24
    for blocks, held in [(-1, 0), (2.5, 1), ("nan", 0), (3, 4), (3, -1)]:
        with pytest.raises(redis.ResponseError, match="zp:"):
            _raw(r, b, "acquire", rid, blocks, held, 0, -1, 1000, "mb", "owner", 1000)
    with pytest.raises(redis.ResponseError, match="request id"):
        _raw(r, b, "acquire", "short", 1, 1, 0, -1, 1000, "mb", "owner", 1000)
    assert b.status_sync().leases == 0
    r.close()


def test_only_the_holder_may_release_or_renew(budgets: Any, redis_url: str) -> None:
    b = budgets(10)
    lease = b.acquire_sync(4)
    r = redis.Redis.from_url(redis_url)
    with pytest.raises(redis.ResponseError, match="not held by this caller"):
        _raw(r, b, "release", lease.id, "intruder")
    renewed = _raw(r, b, "renew", "intruder", 1000, lease.id, lease.epoch, 4, 4, 0, 0)
    assert int(renewed[1]) == -1
    assert b.status_sync().used == 4
    lease.release_sync()
    assert b.status_sync().used == 0
    r.close()


async def test_acquire_retried_after_a_lost_reply_counts_once(budgets: Any) -> None:
    b = budgets(10)
    side = b._get_side()
    args = ["r" * 24, 6, 6, 0, -1, 5000, b._core.owner, b._core.owner, 5000]
    first = await side.eval("acquire", args)
    again = await side.eval("acquire", args)  # the same request id: a retry
    assert first[0] == again[0] == b"G" and first[1] == again[1]
    st = await b.status()
    assert (st.used, st.leases) == (6, 1)
    # A retry of a waiting request keeps its single place in line.
    args2 = ["s" * 24, 6, 6, 0, -1, 5000, b._core.owner, b._core.owner, 5000]
    assert (await side.eval("acquire", args2))[0] == b"W"
    assert (await side.eval("acquire", args2))[0] == b"W"
    assert (await b.status()).waiters[0].waiters == 1
    await side.eval("release", ["s" * 24, b._core.owner])
    await side.eval("release", ["r" * 24, b._core.owner])
    await b.aclose()


def test_from_settings_takes_the_budget_settings(redis_url: str) -> None:
    from zp_client.config import Settings

    b = RedisBudget.from_settings(redis_url, "zptest-settings", 10, Settings(starvation_bound_s=0.5, lease_ttl_s=7))
    assert (b.config.starvation_bound_s, b.config.lease_ttl_s, b.block_size) == (0.5, 7.0, 16)
    assert RedisBudget(redis_url, "zptest-x", 10, starvation_bound_s=0.25).config.starvation_bound_s == 0.25


@pytest.mark.parametrize("old, new", [
    ("lease_ttl", "lease_ttl_s"), ("poll_interval", "poll_interval_s"), ("waiter_ttl", "waiter_ttl_s"),
    ("starvation_bound", "starvation_bound_s"), ("recovery", "recovery_s"),
    ("unavailable_timeout", "unavailable_timeout_s"),
])
def test_a_removed_spelling_fails_naming_the_new_one(redis_url: str, old: str, new: str) -> None:
    with pytest.raises(TypeError, match=f"removed keyword argument '{old}' \\(now '{new}'\\)"):
        RedisBudget(redis_url, "zptest-x", 10, **{old: 1.0})
    assert getattr(RedisBudget(redis_url, "zptest-x", 10, **{new: 1.0}).config, new) == 1.0


def test_an_unknown_keyword_fails() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'lease_tll_s'"):
        RedisBudget("redis://127.0.0.1:6379/0", "zptest-x", 10, lease_tll_s=1.0)


async def test_status_is_read_only(budgets: Any, redis_url: str, redis_prefix: str) -> None:
    b = budgets(10)
    st = await b.status()
    assert st.extra["exists"] is False and st.limit == 10
    r = redis.Redis.from_url(redis_url)
    assert list(r.scan_iter(match=f"{{zp:{redis_prefix}}}*")) == []
    r.close()
    await b.aclose()


# ------------------------------------------------------------------------------ cancellation, timeouts
# Cancellation and timeouts leave no trace (docs/redis.md, "Cancellation"): the caller's CancelledError /
# AdmissionTimeout comes at once, and the waiter's removal (or the racing grant's release) lands just
# after: when the acquire call still in flight lands, then one release (which a caller waits for at most
# RELEASE_WAIT_S). So these tests wait for that, as a liveness bound (_until, 20 s). Their budgets keep a
# waiter and a lease 60 s without a heartbeat (waiter_ttl_s, lease_ttl_s), so the expiry of a forgotten
# waiter or lease cannot pass for its removal within that bound. (Before, a status read right after the
# cancellation failed on a busy machine: the acquire's reply, already applied in Redis, was read late.)
_NO_EXPIRY = {"waiter_ttl_s": 60.0, "lease_ttl_s": 60.0}


async def _no_trace(b: RedisBudget, what: str, used: int = 0, leases: int = 0) -> None:
    """Wait until ``b`` has no waiter and exactly ``used`` blocks in ``leases`` leases."""
    async def clean() -> bool:
        st = await b.status()
        return (st.used, st.leases, st.waiters) == (used, leases, {})

    await _until(clean, what)


async def test_cancelled_waiter_leaves_no_trace(budgets: Any) -> None:
    b = budgets(10, **_NO_EXPIRY)
    held = await b.acquire(10)
    task = asyncio.create_task(b.acquire(3, priority=1))
    await _until(lambda: _waiting(b, 1), "waiter queued")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _no_trace(b, "the cancelled waiter removed", used=10, leases=1)  # held still holds every block
    await held.release()
    await _no_trace(b, "everything back")
    await b.aclose()


async def test_a_waiter_cancelled_while_its_acquire_call_is_in_flight_is_removed_when_it_lands(
        budgets: Any) -> None:
    """What a starved event loop does, made certain: Redis queued the waiter, but the acquire's reply is
    read late (here: held until after the cancellation), so the caller is cancelled while the call is in
    flight. CancelledError at once; the waiter is removed once the call lands (a status read at once
    still saw it: the flaky failure)."""
    b = budgets(10, **_NO_EXPIRY)
    held = await b.acquire(10)
    side = b._get_side()
    real_eval = side.eval
    reply_read = asyncio.Event()

    async def late_reply(script: str, args: Any, **kw: Any) -> Any:
        reply = await real_eval(script, args, **kw)
        if script == "acquire":
            await reply_read.wait()
        return reply

    side.eval = late_reply  # type: ignore[method-assign]
    task = asyncio.create_task(b.acquire(3, priority=1))
    await _until(lambda: _waiting(b, 1), "waiter queued in Redis")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task  # at once: the call is still in flight
    reply_read.set()  # now it lands
    await _no_trace(b, "the waiter of the call in flight removed once it landed", used=10, leases=1)
    await held.release()
    await _no_trace(b, "everything back")
    await b.aclose()


async def test_timeout_raises_admission_timeout_and_leaves_no_trace(budgets: Any) -> None:
    b = budgets(10, **_NO_EXPIRY)
    held = await b.acquire(10)
    with pytest.raises(AdmissionTimeout):
        await b.acquire(3, timeout=0.2)
    await _no_trace(b, "the timed-out waiter removed", used=10, leases=1)
    await held.release()
    await _no_trace(b, "everything back")
    await b.aclose()


async def test_grant_racing_a_cancellation_is_released(budgets: Any) -> None:
    a, b = budgets(10, **_NO_EXPIRY), budgets(10, **_NO_EXPIRY)
    held = await a.acquire(10)
    task = asyncio.create_task(b.acquire(4))
    await _until(lambda: _waiting(b, 1), "waiter queued")
    await held.release()  # grants b's waiter inside Redis ...
    task.cancel()  # ... while b's task may not have seen it yet
    try:
        lease = await task
        await lease.release()
    except asyncio.CancelledError:
        pass
    await _no_trace(a, "the grant that raced the cancellation released")
    await a.aclose()
    await b.aclose()


async def test_aclose_finishes_a_release_cancelled_mid_flight(budgets: Any) -> None:
    """A release cancelled while its script is in flight is finished by a background task; aclose waits
    for it (bounded) instead of leaving it to die with the loop (its coroutine was once closed mid-connect
    at garbage collection: an unraisable-exception warning in a later test, and the lease left to its TTL)."""
    b = budgets(10)
    lease = await b.acquire(4)
    client = b._side.client
    real = client.evalsha

    async def slow_evalsha(*args: Any) -> Any:  # a slow network: every script takes 0.3 s more
        await asyncio.sleep(0.3)
        return await real(*args)

    client.evalsha = slow_evalsha
    task = asyncio.create_task(lease.release())
    await asyncio.sleep(0.1)  # the release script is in flight
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert b._side is not None and len(b._side.background) == 1  # the background path was taken
    await b.aclose()
    left = [t for t in asyncio.all_tasks() if not t.done() and "RedisBudget." in t.get_coro().__qualname__]
    assert left == []
    other = budgets(10)
    assert (await other.status()).leases == 0
    await other.aclose()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_aclose_is_bounded_when_redis_stops_answering(budgets: Any) -> None:
    """A black-holed network: the background release never ends. aclose gives up after its bound
    (the lease expires by TTL) instead of waiting, or queueing a retry, forever."""
    b = budgets(10)
    lease = await b.acquire(4)
    side = b._side
    never = asyncio.Event()

    async def black_hole(*args: Any) -> Any:
        await never.wait()

    side.client.evalsha = black_hole
    task = asyncio.create_task(lease.release())
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    started = time.monotonic()
    await asyncio.wait_for(b.aclose(), 15)
    assert time.monotonic() - started < 10
    assert side.closed and not side.retry_releases and all(t.done() for t in side.tasks)
    assert not [t for t in side.background if not t.done()]


async def test_cancelling_aclose_still_stops_the_budgets_tasks(budgets: Any) -> None:
    b = budgets(10)
    lease = await b.acquire(4)
    side = b._side
    real = side.client.evalsha

    async def slow_evalsha(*args: Any) -> Any:
        await asyncio.sleep(1.0)
        return await real(*args)

    side.client.evalsha = slow_evalsha
    task = asyncio.create_task(lease.release())
    await asyncio.sleep(0.05)
    task.cancel()  # the release goes on in the background, which aclose waits for ...
    with contextlib.suppress(asyncio.CancelledError):
        await task
    closing = asyncio.create_task(b.aclose())
    await asyncio.sleep(0.1)
    closing.cancel()  # ... until aclose itself is cancelled (a caller's own shutdown timeout)
    with contextlib.suppress(asyncio.CancelledError):
        await closing
    await asyncio.sleep(0.1)
    assert side.closed and all(t.done() for t in side.tasks)


# ------------------------------------------------------------------------------ expiry, epochs, recovery
@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_dead_holders_lease_expires_and_the_waiter_proceeds(budgets: Any) -> None:
    dead, alive = budgets(10, lease_ttl_s=1.0, poll_interval_s=0.2), budgets(10, lease_ttl_s=1.0, poll_interval_s=0.2)
    await dead.acquire(10)
    await dead.aclose()  # stops renewals without releasing: as if the process died
    lease = await asyncio.wait_for(alive.acquire(10), 20)
    assert (await alive.status()).leases == 1
    await lease.release()
    await alive.aclose()


async def test_dead_waiter_leaves_the_line(budgets: Any) -> None:
    holder = budgets(10)
    ghost = budgets(10, poll_interval_s=0.1, waiter_ttl_s=0.5)
    held = await holder.acquire(10)
    task = asyncio.create_task(ghost.acquire(5))
    await _until(lambda: _waiting(holder, 1), "waiter queued")
    # The acquire starts its process's background tasks (mailbox pump, poller: the heartbeat) only after
    # its enqueue's reply; on a loaded machine the holder can see the waiter first. Stop them once they
    # exist, or a start after the "death" would heartbeat for the ghost forever.
    await _until(lambda: ghost._side.started, "the ghost's background tasks started")
    for t in ghost._side.tasks:  # the ghost's process stops heartbeating (no cancel reaches Redis)
        t.cancel()
    ghost._side.tasks = [asyncio.create_task(asyncio.sleep(3600))]

    async def reaped() -> bool:
        side = holder._get_side()
        await side.eval("poll", [1000])  # any script call reaps
        return await _waiting(holder, 0)

    await _until(reaped, "dead waiter reaped")
    task.cancel()
    await held.release()
    await holder.aclose()


async def test_lease_that_expired_in_this_epoch_is_reported_lost(budgets: Any, redis_url: str) -> None:
    events: list[RedisBudgetEvent] = []
    b = budgets(10, on_event=events.append)
    lease = await b.acquire(6)
    r = redis_async.Redis.from_url(redis_url)
    await r.zadd(b._core.keys[2], {lease.id: 0})  # its expiry passed (a long pause)
    await r.aclose()
    await b._side.renew_round()
    assert lease.lost and [e.kind for e in events if e.lease_id] == ["lease_lost"]
    assert b.counters["lease_lost"] == 1
    st = await b.status()
    assert (st.used, st.leases) == (0, 0)  # not re-adopted
    await lease.release()  # a no-op, never raises
    await b.aclose()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_lease_redis_lost_is_readopted_and_admission_waits_out_recovery(
    budgets: Any, redis_url: str, redis_prefix: str
) -> None:
    events: list[RedisBudgetEvent] = []
    b = budgets(10, on_event=events.append, recovery_s=1.0, lease_ttl_s=1.0, poll_interval_s=0.2)
    # The budget starts in recovery, so the first lease is granted once recovery ends.
    lease = await asyncio.wait_for(b.acquire(6), 20)
    delete_keys(redis_url, redis_prefix)  # Redis lost its state (restart without persistence)
    newcomer = budgets(10, recovery_s=1.0)
    waiter = asyncio.create_task(newcomer.acquire(4))  # creates the state anew: recovery starts
    await _until(lambda: _waiting(newcomer, 1), "newcomer queued in recovery")
    assert (await newcomer.status()).extra["recovering"]
    await b._side.renew_round()
    assert [e.kind for e in events if e.lease_id] == ["readopted"] and b.counters["readopted"] == 1
    st = await b.status()
    assert (st.used, st.leases) == (6, 1)
    late = await asyncio.wait_for(waiter, 20)  # admitted once recovery is over, next to the re-adopted lease
    assert (await b.status()).used == 10
    await late.release()
    await lease.release()
    assert (await b.status()).used == 0
    await b.aclose()
    await newcomer.aclose()


async def test_first_creator_sets_the_limit_and_others_follow_it(budgets: Any, caplog: Any) -> None:
    a = budgets(10)
    (await a.acquire(1)).release_sync()
    events: list[RedisBudgetEvent] = []
    b = budgets(50, on_event=events.append)
    with caplog.at_level(logging.WARNING, logger="zp_client"):
        lease = await b.acquire(2)
    assert b.limit == 10
    assert any("follows the stored limit" in r.message for r in caplog.records)
    assert [e.kind for e in events] == ["limit_mismatch"]
    with pytest.raises(LeaseTooLarge):
        await b.acquire(20)
    await lease.release()
    await a.aclose()
    await b.aclose()


async def test_set_limit_compare_and_set_and_waiters_too_large_fail(budgets: Any) -> None:
    a, b = budgets(12), budgets(12)
    held = await a.acquire(10)
    big = asyncio.create_task(b.acquire(11))
    await _until(lambda: _waiting(a, 1), "queued")
    assert not await a.compare_and_set_limit(99, 8)  # stale expectation: nothing changes
    assert (await a.status()).limit == 12
    assert await a.compare_and_set_limit(12, 8)  # lowering never revokes ...
    with pytest.raises(LeaseTooLarge):
        await asyncio.wait_for(big, 20)  # ... but fails a waiter that could never fit
    st = await a.status()
    assert (st.limit, st.used, st.leases) == (8, 10, 1)
    small = asyncio.create_task(b.acquire(1))
    await _until(lambda: _waiting(a, 1), "paused admission")
    await a.set_limit(11)  # raising admits
    (await asyncio.wait_for(small, 20)).release_sync()
    await held.release()
    await a.aclose()
    await b.aclose()


async def test_held_reports_reach_redis_batched_without_a_flush(budgets: Any) -> None:
    b = budgets(40, held_report_blocks=2)
    lease = await b.acquire(30, held=5)
    assert (await b.status()).held == 5
    for v in range(6, 20):
        lease.report_held(v)

    async def caught_up() -> bool:
        return (await b.status()).held >= 18  # within held_report_blocks of the latest report

    await _until(caught_up, "held reports reached Redis")
    lease.report_held(100)  # clamped to the bound
    assert lease.held == 30
    await b.flush()
    assert (await b.status()).held == 30
    await lease.release()
    assert (await b.status()).held == 0
    await b.aclose()


async def test_renewal_carries_held_reports_below_the_batching_threshold(budgets: Any) -> None:
    b = budgets(40, held_report_blocks=10)
    lease = await b.acquire(30, held=5)
    lease.report_held(8)  # below the threshold: not sent on its own
    await b._side.renew_round()
    assert (await b.status()).held == 8
    await lease.release()
    await b.aclose()


# ------------------------------------------------------------------------------------------ sync path
def test_lease_sync_works_without_an_event_loop_and_shares_the_limit(budgets: Any, redis_url: str, redis_prefix: str) -> None:
    b = budgets(10, poll_interval_s=0.2)
    counter = redis.Redis.from_url(redis_url)
    key = f"{{zp:{redis_prefix}}}:test-count"
    peak = 0
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        nonlocal peak
        try:
            for j in range(5):
                w = 1 + (i + j) % 4
                with b.lease_sync(w, timeout=30):
                    v = counter.incrby(key, w)
                    with lock:
                        peak = max(peak, v)
                    time.sleep(0.002)
                    counter.decrby(key, w)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert 0 < peak <= 10
    st = b.status_sync()
    assert (st.used, st.leases, st.waiters) == (0, 0, {})
    counter.close()


async def test_sync_and_async_callers_share_one_line(budgets: Any) -> None:
    b = budgets(10, poll_interval_s=0.2)
    held = await b.acquire(10)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(b.acquire_sync(6, timeout=30)))
    t.start()
    await _until(lambda: _waiting(b, 1), "sync waiter queued")
    await held.release()
    await asyncio.to_thread(t.join, 30)
    assert len(got) == 1 and (await b.status()).used == 6
    got[0].release_sync()
    await b.aclose()


# ----------------------------------------------------------------------------------- unreachable Redis
async def test_fail_closed_raises_budget_unavailable() -> None:
    b = RedisBudget(f"redis://127.0.0.1:{_free_port()}/0", "zptest-nowhere", 10, unavailable_timeout_s=0.3)
    with pytest.raises(BudgetUnavailable, match="unreachable"):
        await b.acquire(1)
    with pytest.raises(BudgetUnavailable):
        b.acquire_sync(1)
    await b.aclose()


async def test_fail_local_falls_back_to_a_local_share(caplog: Any) -> None:
    pytest.importorskip("zp_client.budget.local")
    events: list[RedisBudgetEvent] = []
    b = RedisBudget(f"redis://127.0.0.1:{_free_port()}/0", "zptest-nowhere", 100, on_unavailable="fail_local",
                    local_share=0.25, on_event=events.append, unavailable_timeout_s=0.5)
    with caplog.at_level(logging.ERROR, logger="zp_client"):
        async with b.lease(20) as lease:
            assert lease.bound == 20
        with pytest.raises(LeaseTooLarge):
            await b.acquire(30)  # above the 25-block local share
    assert any("NOT enforced" in r.message for r in caplog.records)
    assert "fallback_local" in [e.kind for e in events]
    await b.aclose()


@pytest.fixture
def own_redis() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    proc, port = start_redis_server()
    yield proc, port
    proc.kill()
    proc.wait(10)


async def test_release_that_cannot_reach_redis_never_raises(own_redis: Any, redis_prefix: str) -> None:
    proc, port = own_redis
    b = RedisBudget(f"redis://127.0.0.1:{port}/0", redis_prefix, 10, recovery_s=0, unavailable_timeout_s=0.5)
    async with b.lease(4):
        proc.kill()
        proc.wait(10)
    assert b.counters["release_retried"] == 1
    await b.aclose()


async def test_auth_through_the_url() -> None:
    proc, port = start_redis_server()
    try:
        admin = redis.Redis(port=port)
        admin.config_set("requirepass", "s3cret")
        admin.close()
        ok = RedisBudget(f"redis://:s3cret@127.0.0.1:{port}/0", "zptest-auth", 10, recovery_s=0)
        async with ok.lease(3):
            assert (await ok.status()).used == 3
        await ok.aclose()
        bad = RedisBudget(f"redis://:wrong@127.0.0.1:{port}/0", "zptest-auth", 10, recovery_s=0)
        with pytest.raises(ConfigurationError, match="password"):
            await bad.acquire(1)
        await bad.aclose()
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------------------- Redis Cluster
def _cluster_state(r: redis.Redis) -> str:
    info = r.execute_command("CLUSTER INFO")  # parsed into a dict by redis-py, or raw text
    if isinstance(info, dict):
        v = info.get("cluster_state", info.get(b"cluster_state"))
        return v.decode() if isinstance(v, bytes) else str(v)
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "ok" if "cluster_state:ok" in text else "fail"


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    import socket

    for _ in range(200):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture
def redis_cluster() -> Iterator[list[int]]:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Redis Cluster test needs {' and '.join(missing)} on PATH")
    procs, ports = [], []
    try:
        for _ in range(3):
            port = _cluster_port()
            workdir = tempfile.mkdtemp(prefix="zp-cluster-")
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", f"{workdir}/nodes.conf", "--save", "", "--appendonly", "no",
                 "--dir", workdir],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            ports.append(port)
        for port in ports:
            deadline = time.monotonic() + 10
            while not _redis_answers("127.0.0.1", port):
                assert time.monotonic() < deadline, f"cluster node on {port} did not start"
                time.sleep(0.02)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in ports], "--cluster-replicas", "0",
             "--cluster-yes"], check=True, capture_output=True, timeout=60)
        r = redis.Redis(port=ports[0])
        deadline = time.monotonic() + 90  # gossip is slow on a loaded 2-core machine
        while _cluster_state(r) != "ok":
            assert time.monotonic() < deadline, "cluster never reached state ok"
            time.sleep(0.05)
        r.close()
        yield ports
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_redis_cluster(redis_cluster: list[int], redis_prefix: str) -> None:
    from redis.asyncio.cluster import RedisCluster
    from redis.cluster import RedisCluster as SyncRedisCluster

    client = RedisCluster(host="127.0.0.1", port=redis_cluster[0])
    sync_client = SyncRedisCluster(host="127.0.0.1", port=redis_cluster[0])
    a = RedisBudget(client, redis_prefix, 10, recovery_s=0, sync_client=sync_client, poll_interval_s=0.2)
    b = RedisBudget(client, redis_prefix, 10, recovery_s=0, sync_client=sync_client, poll_interval_s=0.2)
    held = await a.acquire(8)
    waiter = asyncio.create_task(b.acquire(5))
    await _until(lambda: _waiting(b, 1), "waiter queued on the cluster")
    await held.release()
    lease = await asyncio.wait_for(waiter, 20)
    with pytest.raises(AdmissionTimeout):
        a.acquire_sync(6, timeout=0.3)
    await lease.release()
    with a.lease_sync(6):
        assert (await a.status()).used == 6
    assert (await a.status()).used == 0
    await a.aclose()
    await b.aclose()
    await client.aclose()
    sync_client.close()
