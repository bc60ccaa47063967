"""A herd on one RedisBudget: a full connection pool is back-pressure, not an outage.

Many concurrent acquires in one process exhaust the Redis client's connection pool. The commands
beyond it must wait for a connection (the budget's own clients use a blocking pool; a caller's
non-blocking pool raises ``MaxConnectionsError``, which the budget waits out): every lease is admitted
and released, nothing is reported unreachable, nothing fails. The time ratio to a LocalBudget is
measured by ``benchmarks/bench_redis_herd.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as redis_async
from redis.exceptions import MaxConnectionsError

from tests._redis_keys import delete_keys
from zp_client.budget.redis import RedisBudget

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture
def keys_cleanup(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield redis_prefix
    delete_keys(redis_url, redis_prefix)


def _outage_records(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "unreachable" in r.getMessage() or "retrying in the background" in r.getMessage()]


async def _async_herd(
    budget: RedisBudget, tasks: int, hold_s: float = 0.01
) -> tuple[int, list[BaseException]]:
    admitted = 0

    async def one() -> None:
        nonlocal admitted
        async with budget.lease(1, timeout=120) as lease:
            admitted += 1
            await asyncio.sleep(hold_s)
        assert lease.released

    results = await asyncio.gather(*(one() for _ in range(tasks)), return_exceptions=True)
    return admitted, [r for r in results if isinstance(r, BaseException)]


def _sync_herd(budget: RedisBudget, threads: int, hold_s: float = 0.01) -> tuple[int, list[BaseException]]:
    admitted: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def one() -> None:
        start.wait()
        try:
            with budget.lease_sync(1, timeout=120) as lease:
                admitted.append(1)
                time.sleep(hold_s)
            assert lease.released
        except BaseException as exc:  # noqa: BLE001  (collected: the test asserts there are none)
            errors.append(exc)

    ts = [threading.Thread(target=one) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    return len(admitted), errors


async def _assert_empty(budget: RedisBudget) -> None:
    st = await budget.status()
    assert (st.used, st.leases, sum(c.waiters for c in st.waiters.values())) == (0, 0, 0)
    assert budget.counters["unavailable"] == 0
    assert budget.counters["release_retried"] == 0


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_thousand_concurrent_acquires_are_all_admitted_without_an_outage(
    redis_url: str, keys_cleanup: str, caplog: Any
) -> None:
    b = RedisBudget(redis_url, keys_cleanup, 50, recovery_s=0)
    with caplog.at_level(logging.DEBUG, logger="zp_client"):
        admitted, errors = await _async_herd(b, 1000)
    assert errors == []
    assert admitted == 1000
    assert _outage_records(caplog) == []
    await _assert_empty(b)
    await b.aclose()


@pytest.mark.slow
async def test_three_hundred_threads_on_acquire_sync_are_all_admitted_without_an_outage(
    redis_url: str, keys_cleanup: str, caplog: Any
) -> None:
    b = RedisBudget(redis_url, keys_cleanup, 50, recovery_s=0)
    with caplog.at_level(logging.DEBUG, logger="zp_client"):
        admitted, errors = await asyncio.to_thread(_sync_herd, b, 300)
    assert errors == []
    assert admitted == 300
    assert _outage_records(caplog) == []
    await _assert_empty(b)
    b.close_sync()
    await b.aclose()


class _CountingPool(redis_async.ConnectionPool):
    """A caller's non-blocking pool that counts the MaxConnectionsError it raises."""

    full = 0

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)
        except MaxConnectionsError:
            type(self).full += 1
            raise


class _CountingSyncPool(redis.ConnectionPool):
    full = 0

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().get_connection(*args, **kwargs)
        except MaxConnectionsError:
            type(self).full += 1
            raise


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_callers_exhausted_async_pool_is_back_pressure_not_an_outage(
    redis_url: str, keys_cleanup: str, caplog: Any
) -> None:
    pool = _CountingPool.from_url(redis_url, max_connections=4)
    client = redis_async.Redis.from_pool(pool)
    b = RedisBudget(client, keys_cleanup, 10, recovery_s=0)
    with caplog.at_level(logging.DEBUG, logger="zp_client"):
        admitted, errors = await _async_herd(b, 200)
    assert errors == []
    assert admitted == 200
    assert _CountingPool.full > 0  # the pool did run out: the budget waited, it did not fail
    assert _outage_records(caplog) == []
    await _assert_empty(b)
    await b.aclose()
    await client.aclose()


@pytest.mark.slow
async def test_a_callers_exhausted_sync_pool_is_back_pressure_not_an_outage(
    redis_url: str, keys_cleanup: str, caplog: Any
) -> None:
    client = redis.Redis(connection_pool=_CountingSyncPool.from_url(redis_url, max_connections=3))
    aclient = redis_async.Redis.from_url(redis_url)
    b = RedisBudget(aclient, keys_cleanup, 10, recovery_s=0, sync_client=client)
    with caplog.at_level(logging.DEBUG, logger="zp_client"):
        admitted, errors = await asyncio.to_thread(_sync_herd, b, 60)
    assert errors == []
    assert admitted == 60
    assert _CountingSyncPool.full > 0
    assert _outage_records(caplog) == []
    await _assert_empty(b)
    b.close_sync()
    await b.aclose()
    client.close()
    await aclient.aclose()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_herd_of_default_retries_on_a_redis_budget_is_retried_not_refused(
    redis_url: str, keys_cleanup: str, caplog: Any
) -> None:
    """Every front end retries by default on the KV budget's fleet-wide retry budget: a herd of 400
    requests each answered 503 once must all be retried (the retry budget's own Redis pool is
    back-pressure too), none refused for an "unavailable" retry budget."""
    import httpx

    from zp_client import AsyncAdmissionTransport, Settings
    from zp_client.retry import testing

    seen: dict[str, int] = {}

    async def upstream(request: httpx.Request) -> httpx.Response:
        user = request.headers["x-user"]
        seen[user] = seen.get(user, 0) + 1
        if seen[user] == 1:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "ok"}}],
                                         "usage": {"prompt_tokens": 5, "completion_tokens": 1}})

    # floor 40/s x 10 s = 400 retries in the window, one for each request (all first attempts fail, so
    # answers earn nothing until retries succeed): only a broken retry budget can refuse one
    settings = Settings(retry_budget_floor_per_s=40.0, max_model_len=1024, stream_upstream=False)
    # room for all 400 at once: their 400 retry decisions then reach Redis together
    budget = RedisBudget(redis_url, keys_cleanup, limit_blocks=1_000, recovery_s=0, policy="strict")
    transport = AsyncAdmissionTransport(httpx.MockTransport(upstream), budget=budget, settings=settings)
    caplog.set_level(logging.INFO)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://up/v1") as client:
            async def one(i: int) -> int:
                r = await client.post("/chat/completions", headers={"x-user": str(i)},
                                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 8})
                return r.status_code

            with testing():
                codes = await asyncio.gather(*(one(i) for i in range(400)))
    finally:
        await budget.aclose()
    assert codes == [200] * 400
    assert all(n == 2 for n in seen.values()) and len(seen) == 400
    assert not [r for r in caplog.records if "retry budget" in r.getMessage()]
    assert _outage_records(caplog) == []


def test_the_outage_deadline_starts_at_the_first_connection_failure_not_at_a_full_pool() -> None:
    """A long wait on a caller's full pool is back-pressure: it must not use up ``unavailable_timeout_s``,
    so a connection error after it is still retried (for the whole timeout) instead of raising at once."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from zp_client.budget.redis._script import Attempts
    from zp_client.errors import BudgetUnavailable

    budget = RedisBudget("redis://127.0.0.1:1/0", "zptest-deadline", 10, unavailable_timeout_s=0.2)
    attempts = Attempts(budget._core, "acquire", patient=True)
    for _ in range(3):
        assert attempts.after(MaxConnectionsError("pool full")) >= 0
    time.sleep(0.3)  # longer than unavailable_timeout_s, all of it waiting for a connection
    assert attempts.after(RedisConnectionError("refused")) > 0  # retried, not BudgetUnavailable
    time.sleep(0.3)
    with pytest.raises(BudgetUnavailable):
        attempts.after(RedisConnectionError("refused"))
