"""Elastic's urgent reserve (``ElasticPolicy(urgent_reserve=...)``, docs/admission.md#the-urgent-reserve): a
waiter is admitted only while it fits under the limit less ``urgent_reserve`` times the largest bound among
the live leases of a more urgent class. The Python ledger is the model; the Lua port is held to it here on
hand-built cases and by the conformance machines (tests/budget/test_redis_elastic.py,
tests/fleet/test_fleet_redis_elastic.py), which draw it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._redis_keys import delete_keys
from zp_client.budget.elastic import DEFAULT_URGENT_RESERVE, ElasticPolicy, urgent_room
from zp_client.budget.ledger import Ledger
from zp_client.budget.local import LocalBudget
from zp_client.budget.redis import RedisBudget
from zp_client.errors import ConfigurationError


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


def _ledger(limit: int, urgent: float = DEFAULT_URGENT_RESERVE) -> Ledger:
    # no forecast-error reserves: the cases count bounds only (no meta: each lease reserved at its bound)
    return Ledger(limit, policy=ElasticPolicy(16, reserve_z=0, reserve_k=0, urgent_reserve=urgent))


def test_a_less_urgent_waiter_leaves_room_for_two_of_the_urgent_class() -> None:
    led = _ledger(100)
    led.enqueue("i", 20, 0, 0, 0.0)
    assert led.grant(0.0) == ["i"]
    # 20 + 50 <= 100, but the batch waiter must leave 2 x 20 free: 20 + 50 > 60
    led.enqueue("b", 50, 0, 1, 0.0)
    assert led.grant(0.0) == []
    policy = led.policy
    assert isinstance(policy, ElasticPolicy)
    w = led.waiter("b")
    assert w is not None and policy.urgent_blocks(led, w) == 40
    # a waiter of the urgent class itself keeps nothing back: it takes the room
    led.enqueue("i2", 60, 0, 0, 0.0)
    assert led.grant(0.0) == ["i2"]
    # once the urgent class has no live lease, the batch waiter fits the whole pool again
    led.release("i", 1.0)
    led.release("i2", 1.0)
    assert led.grant(1.0) == ["b"]


def test_one_class_keeps_nothing_and_zero_turns_it_off() -> None:
    for urgent in (DEFAULT_URGENT_RESERVE, 0.0):
        led = _ledger(100, urgent)
        led.enqueue("a", 20, 0, 1, 0.0)
        led.enqueue("b", 80, 0, 1, 0.0)
        assert led.grant(0.0) == ["a", "b"]
    led = _ledger(100, 0.0)
    led.enqueue("i", 20, 0, 0, 0.0)
    led.enqueue("b", 80, 0, 1, 0.0)
    assert led.grant(0.0) == ["i", "b"]


def test_the_room_is_sized_on_the_largest_bound_of_every_more_urgent_class() -> None:
    led = _ledger(200, 1.5)
    led.enqueue("p0", 5, 0, 0, 0.0)
    led.enqueue("p1", 11, 0, 1, 0.0)
    led.enqueue("p3", 7, 0, 3, 0.0)
    assert led.grant(0.0) == ["p0", "p1", "p3"]
    policy = led.policy
    assert isinstance(policy, ElasticPolicy)
    for prio, want in ((-1, 0), (0, 0), (1, 8), (2, 17), (3, 17), (4, 17)):
        led.enqueue(f"w{prio}", 1, 0, prio, 0.0)
        w = led.waiter(f"w{prio}")
        assert w is not None
        assert policy.urgent_blocks(led, w) == want, prio  # ceil(1.5 x 5) = 8, ceil(1.5 x 11) = 17
        led.cancel(f"w{prio}")


def test_a_pin_is_not_a_request_of_the_urgent_class() -> None:
    led = _ledger(200)
    led.pin("sys", 30, 0.0)  # a pin's lease has priority 0 and meta pinned
    led.enqueue("b", 150, 0, 1, 0.0)  # 30 + 150 fits 200; counted as urgent, 2 x 30 would not leave room
    assert led.grant(0.0) == ["b"]


@given(st.integers(1, 10**12), st.integers(0, 100_000))
def test_urgent_room_is_the_exact_ceiling(bound: int, milli: int) -> None:
    assert urgent_room(bound, milli / 1000) == -(-bound * milli // 1000)


@pytest.mark.parametrize("bad", [-0.1, 100.5, float("nan"), float("inf"), True, "2"])
def test_the_urgent_reserve_is_validated(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="urgent_reserve"):
        ElasticPolicy(16, urgent_reserve=bad)
    with pytest.raises(ConfigurationError, match="urgent_reserve"):
        RedisBudget("redis://127.0.0.1:1/0", "zp-test-urgent-bad", 10, urgent_reserve=bad)


def test_the_default_and_its_repr() -> None:
    assert ElasticPolicy(16).urgent_reserve == DEFAULT_URGENT_RESERVE == 2.0
    assert "urgent_reserve=2.0" in repr(ElasticPolicy(16))
    assert "urgent_reserve" not in repr(ElasticPolicy(16, urgent_reserve=0))
    b = RedisBudget("redis://127.0.0.1:1/0", "zp-test-urgent-args", 10, urgent_reserve=1.23456)
    assert b.config.urgent_reserve == 1.235  # rounded to thousandths as the policy rounds it
    b.close_sync()


# ------------------------------------------------------------------------------------------ both backends
@pytest.fixture
def budgets(redis_url: str, redis_prefix: str) -> Iterator[Any]:
    names: list[str] = []
    counter = itertools.count()

    def make(limit: int, block_size: int = 16, **kw: Any) -> RedisBudget:
        name = f"{redis_prefix}-{next(counter)}"
        names.append(name)
        kw.setdefault("recovery_s", 0)
        kw.setdefault("reserve_z", 0)
        kw.setdefault("reserve_k", 0)
        return RedisBudget(redis_url, name, limit, block_size, policy="elastic", **kw)

    yield make
    delete_keys(redis_url, *names)


@pytest.mark.anyio
@pytest.mark.parametrize(("urgent", "admitted"), [(2.0, False), (1.0, True), (0.0, True)])
async def test_both_backends_keep_the_room(budgets: Any, urgent: float, admitted: bool) -> None:
    # limit 100, an urgent lease of 20: a batch request of 55 fits under 100 - 20 (1x) but not 100 - 40
    # (2x); the fast path (nobody waits) and the grant pass agree
    local = LocalBudget(100, 16, policy=ElasticPolicy(16, reserve_z=0, reserve_k=0, urgent_reserve=urgent))
    redis_b = budgets(100, urgent_reserve=urgent)
    for b in (local, redis_b):
        li = await b.acquire(20, priority=0)
        batch = asyncio.ensure_future(b.acquire(55, priority=1))
        await asyncio.sleep(0.3)
        assert batch.done() == admitted, (b, urgent)
        if not admitted:
            # an urgent request behind it is admitted at once: the room was kept for it
            li2 = await asyncio.wait_for(b.acquire(30, priority=0), 10)
            await li2.release()
        await li.release()
        lb = await asyncio.wait_for(batch, 10)  # with no urgent lease live it fits the pool
        await lb.release()
    await redis_b.aclose()


@pytest.mark.anyio
async def test_a_later_process_follows_the_stored_urgent_reserve(budgets: Any, caplog: Any) -> None:
    first = budgets(100, urgent_reserve=0.0)
    other = RedisBudget(first._core.url, first.name, 100, 16, policy="elastic", recovery_s=0,
                        poll_interval_s=30, reserve_z=0, reserve_k=0)  # the default, 2.0
    with caplog.at_level("WARNING", logger="zp_client.budget.redis"):
        li = await first.acquire(20, priority=0)
        await other.status()
    assert other._core.urgent == 0.0 and "urgent_reserve=0" in caplog.text
    # the stored 0 is the budget's: the other process's batch request is admitted beside the urgent one
    lb = await asyncio.wait_for(other.acquire(55, priority=1), 10)
    await lb.release()
    await li.release()
    await other.aclose()
    await first.aclose()


@pytest.mark.anyio
async def test_the_snapshot_replays_the_stored_urgent_reserve(budgets: Any) -> None:
    from zp_client.budget.redis._snapshot import SNAPSHOT_CAP, ledger_from_snapshot

    b = budgets(100, urgent_reserve=2.0)
    li = await b.acquire(20, priority=0)
    batch = asyncio.ensure_future(b.acquire(55, priority=1))
    await asyncio.sleep(0.3)
    assert not batch.done()
    snap = ledger_from_snapshot(await b._get_side().eval("snapshot", [SNAPSHOT_CAP], init=False))
    assert snap is not None
    policy = snap.ledger.policy
    assert isinstance(policy, ElasticPolicy) and policy.urgent_reserve == 2.0
    assert snap.ledger.grant(snap.now) == []
    policy.urgent_reserve = 0.0
    assert len(snap.ledger.grant(snap.now)) == 1
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    await li.release()
    await b.aclose()


@pytest.mark.anyio
async def test_a_room_larger_than_the_limit_admits_nobody_less_urgent(budgets: Any) -> None:
    # ceil(3 x 14) = 42 > 24: the limit left is negative. The Lua reserves cap themselves at limit + 1,
    # which below 0 once turned the forecast-error reserves into room (found by the conformance machine).
    policy = ElasticPolicy(4, reserve_z=1.732, reserve_k=0.25, urgent_reserve=3.0)
    local = LocalBudget(24, 4, policy=policy)
    redis_b = budgets(24, 4, reserve_z=1.732, reserve_k=0.25, urgent_reserve=3.0)
    for b in (local, redis_b):
        li = await b.acquire(14, priority=0, meta={})
        li.report_progress(0, prompt_tokens=0, forecast_hi=5)  # a spread for the reserves to read
        li.report_progress(0, prompt_tokens=0, tokens=0, forecast_tokens=1)
        if isinstance(b, RedisBudget):
            await b.flush()  # the reports travel batched
        batch = asyncio.ensure_future(b.acquire(1, priority=1, meta={}))
        await asyncio.sleep(0.3)
        assert not batch.done(), b
        await li.release()
        await (await asyncio.wait_for(batch, 10)).release()
    await redis_b.aclose()


@pytest.mark.anyio
async def test_the_room_reads_the_64_nearest_more_urgent_classes_in_both_backends(budgets: Any) -> None:
    # 70 more urgent classes: the farthest (-100) holds bound 50, the 69 nearer ones bound 1. Both
    # backends read the URGENT_CLASSES_MAX (64) nearest: room 2 x 1, not 2 x 50. A waiter of 800 then
    # fits (119 + 70 + 800 + 1 <= 1000 - 2), which it would not under 1000 - 100.
    from zp_client.budget.elastic import URGENT_CLASSES_MAX

    assert URGENT_CLASSES_MAX == 64
    local = LocalBudget(1000, 16, policy=ElasticPolicy(16, reserve_z=0, reserve_k=0))
    redis_b = budgets(1000)
    for b in (local, redis_b):
        live = [await b.acquire(50, priority=-100)]
        live += [await b.acquire(1, priority=p) for p in range(-99, -30)]
        lw = await asyncio.wait_for(b.acquire(800, priority=0), 10)
        for le in [lw, *live]:
            await le.release()
    led = _ledger(1000)
    led.enqueue("far", 50, 0, -100, 0.0)
    for p in range(-99, -30):
        led.enqueue(f"c{p}", 1, 0, p, 0.0)
    led.grant(0.0)
    led.enqueue("w", 800, 0, 0, 0.0)
    w = led.waiter("w")
    policy = led.policy
    assert w is not None and isinstance(policy, ElasticPolicy) and policy.urgent_blocks(led, w) == 2
    await redis_b.aclose()


@pytest.mark.anyio
async def test_a_member_whose_lease_is_gone_is_removed_as_it_is_met(budgets: Any, redis_url: str) -> None:
    # A script before the urgent reserve drops a lease without removing it from :up; the next read heals.
    import redis

    b = budgets(100)
    r = redis.Redis.from_url(redis_url)
    try:
        await b.status()  # creates the budget
        key = f"{{zp:{b.name}}}:up"
        r.zadd(key, {"ghost-lease-of-an-older-script": 50})  # priority 0, bound 50, no lease
        lb = await asyncio.wait_for(b.acquire(90, priority=1), 10)  # no urgent lease: the whole pool
        assert r.zscore(key, "ghost-lease-of-an-older-script") is None
        await lb.release()
    finally:
        r.close()
    await b.aclose()
