"""A temporary cut of the limit (``compare_and_set_limit(..., keep_size=True)``, what the adaptive limit
does) must not turn requests that fit the limit before it into :class:`LeaseTooLarge`: they wait for the
limit to come back. A plain ``set_limit`` keeps its meaning: waiters larger than the new limit fail.
LocalBudget, the Ledger and RedisBudget (Lua) alike."""

from __future__ import annotations

import asyncio

import pytest

from zp_client import AdmissionTimeout, LeaseTooLarge, LocalBudget
from zp_client.budget.ledger import Ledger
from zp_client.budget.redis import RedisBudget


def test_the_ledger_keeps_its_size_limit_through_a_temporary_cut() -> None:
    led = Ledger(100)
    led.enqueue("big", 70, 70, 0, 0.0)
    led.enqueue("filler", 40, 40, 0, 0.0)
    assert led.grant(0.0) == ["big"]
    led.enqueue("w", 70, 70, 0, 0.0)  # waits behind big
    assert led.set_limit(50, 1.0, keep_size=True) == []  # nobody fails
    assert led.size_limit == 100 and led.limit == 50
    led.enqueue("new", 90, 90, 0, 1.0)  # up to the size limit: queued, not refused
    with pytest.raises(LeaseTooLarge):
        led.enqueue("huge", 101, 101, 0, 1.0)
    assert led.set_limit(40, 2.0, keep_size=True) == []  # a second cut keeps the first's size
    assert led.size_limit == 100
    assert sorted(led.set_limit(60, 3.0)) == ["new", "w"]  # a plain set_limit: size follows the limit
    assert led.size_limit == 60


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_local_budget_waiters_and_new_requests_wait_out_a_temporary_cut() -> None:
    budget = LocalBudget(limit_blocks=100, block_size=16)
    first = await budget.acquire(70)
    waiter = asyncio.ensure_future(budget.acquire(70, timeout=30))
    await asyncio.sleep(0.01)
    assert await budget.compare_and_set_limit(100, 50, keep_size=True)
    await asyncio.sleep(0.01)
    assert not waiter.done()  # still waiting: no LeaseTooLarge
    assert budget.size_limit == 100
    with pytest.raises(AdmissionTimeout):
        await budget.acquire(70, timeout=0.05)  # a new one the size limit takes waits, then times out
    with pytest.raises(LeaseTooLarge):
        await budget.acquire(101)
    await first.release()
    await asyncio.sleep(0.01)
    assert not waiter.done()  # 70 > 50: the cut holds it back
    assert await budget.compare_and_set_limit(50, 100, keep_size=True)
    lease = await asyncio.wait_for(waiter, 5)
    assert lease.bound == 70
    await lease.release()
    await budget.set_limit(50)  # a plain set_limit: the size follows
    assert budget.size_limit == 50
    with pytest.raises(LeaseTooLarge):
        await budget.acquire(70)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.redis
def test_redis_budget_keeps_the_size_limit_through_a_fenced_or_plain_cut(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        budget = RedisBudget(redis_url, redis_prefix, 100, recovery_s=0)  # a fresh budget: no recovery wait
        try:
            first = await budget.acquire(70)
            waiter = asyncio.ensure_future(budget.acquire(70, timeout=30))
            await asyncio.sleep(0.2)
            assert await budget.compare_and_set_limit(100, 50, keep_size=True)
            await asyncio.sleep(0.3)
            assert not waiter.done()
            with pytest.raises(AdmissionTimeout):
                await budget.acquire(70, timeout=0.3)
            with pytest.raises(LeaseTooLarge):
                await budget.acquire(101)
            await first.release()
            assert await budget.compare_and_set_limit(50, 100, keep_size=True)
            lease = await asyncio.wait_for(waiter, 10)
            await lease.release()
            # a plain cut: size follows the limit, a waiter above it fails
            second = await budget.acquire(70)
            w2 = asyncio.ensure_future(budget.acquire(70, timeout=30))
            await asyncio.sleep(0.2)
            await budget.set_limit(50)
            with pytest.raises(LeaseTooLarge):
                await asyncio.wait_for(w2, 10)
            await second.release()
        finally:
            await budget.aclose()

    asyncio.run(main())
