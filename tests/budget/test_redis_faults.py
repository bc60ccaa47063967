"""RedisBudget under faults and races (issue 33 items 1, 4, 11, 12): a cancellation redis-py swallows,
renewals behind a saturated connection pool, a release racing its renewal, the first-use window and a
Redis restart after an explicit create.

Tests that restart Redis start their own ``redis-server`` on a free port (never the machine's 6379).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from conftest import start_redis_server

from zp_client import AdmissionTimeout, RedisBudget
from zp_client.budget.redis import RedisBudgetEvent
from zp_client.budget.redis._script import RENEW_BATCH
from zp_client.cli import main as cli_main

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.faults]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


def _delete_keys(url: str, name: str) -> None:
    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(match=f"{{zp:{name}}}*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


@pytest.fixture
def cleanup(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield redis_prefix
    _delete_keys(redis_url, redis_prefix)


@pytest.fixture
def own_redis() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A throw-away redis-server this test may kill and restart (the holder is a list: restarts swap it)."""
    proc, port = start_redis_server()
    box = [proc]
    yield box, port  # type: ignore[misc]
    for p in box:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


# ---------------------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("timeout", [None, 30.0])
async def test_a_cancel_within_a_millisecond_always_raises_and_leaves_no_lease(
    redis_url: str, cleanup: str, timeout: float | None
) -> None:
    """redis-py runs each command under ``asyncio.wait_for``, which on 3.10/3.11 returns the reply instead
    of raising when the cancellation arrives as the reply does: the acquire ran to completion (20/20
    trials in the issue). Every accepted ``task.cancel()`` must raise, and no lease may be left."""
    b = RedisBudget(redis_url, cleanup, 10_000, recovery_s=0, lease_ttl_s=30)
    loop = asyncio.get_running_loop()
    rng = random.Random(33)
    accepted = swallowed = 0
    try:
        await b.status()  # the budget's client is made and connected before the trials
        for _ in range(400):
            t = asyncio.ensure_future(b.acquire(1, timeout=timeout))
            took: list[bool] = []
            loop.call_later(rng.uniform(0, 0.001), lambda t=t, took=took: took.append(t.cancel()))
            try:
                lease = await t
            except asyncio.CancelledError:
                pass
            else:
                if took == [True]:
                    swallowed += 1
                if not took:  # the cancel has not fired yet: wait for it, so trials do not overlap
                    await asyncio.sleep(0.002)
                await lease.release()
            accepted += took == [True]
            if accepted >= 40:
                break
        side = b._side
        assert side is not None
        while side.background:  # clean-ups of cancelled acquires still in flight
            await asyncio.gather(*list(side.background), return_exceptions=True)
        st = await b.status()
    finally:
        await b.aclose()
    assert accepted >= 20, f"only {accepted} cancellations landed while the call ran"
    assert swallowed == 0, f"{swallowed} of {accepted} accepted cancellations were ignored"
    assert st.leases == 0 and st.used == 0 and not st.waiters, st


# ---------------------------------------------------------------------------------------- item 4
@pytest.mark.slow
async def test_renewals_do_not_wait_behind_a_saturated_pool(redis_url: str, cleanup: str) -> None:
    """A burst fills all 100 connections of the shared pool for longer than the lease TTL (blocking
    commands stand in for a burst of acquires in flight, so the test holds on any machine) while more
    acquires queue for a connection: live leases must still be renewed (0 lost)."""
    events: list[RedisBudgetEvent] = []
    b = RedisBudget(redis_url, cleanup, 10_000, recovery_s=0, lease_ttl_s=0.45, on_event=events.append)
    try:
        held = [await b.acquire(1) for _ in range(20)]
        side = b._side
        assert side is not None
        jam_key = f"{{zp:{cleanup}}}:jam"
        jam = [asyncio.ensure_future(side.client.blpop([jam_key], timeout=1.5)) for _ in range(100)]
        burst = [asyncio.ensure_future(b.acquire(1)) for _ in range(500)]  # queue behind the jam
        await asyncio.gather(*jam)
        granted = await asyncio.gather(*burst)
        await side.renew_round()  # one more round after the jam: every holder still holds
        lost = [le for le in held if le.lost]
        st = await b.status()
        for le in [*held, *granted]:
            await le.release()
    finally:
        await b.aclose()
    assert not lost and b.counters["lease_lost"] == 0, f"{len(lost)} live leases lost: {events[:3]}"
    assert st.leases == 520, st


# ---------------------------------------------------------------------------------------- item 11
async def test_a_release_racing_its_renewal_is_never_reported_lost(redis_url: str, cleanup: str) -> None:
    """A renewal round renews in batches (``RENEW_BATCH``), one after the other; leases released while the
    round is in flight reach Redis before their batch does, which then finds them gone. No ``lease_lost``
    event for a lease its holder released, and every lease released in the end."""
    events: list[RedisBudgetEvent] = []
    b = RedisBudget(redis_url, cleanup, 100_000, recovery_s=0, lease_ttl_s=30, on_event=events.append)
    rng = random.Random(11)
    try:
        side = b._get_side()
        for _ in range(3):
            leases = list(await asyncio.gather(*[b.acquire(1) for _ in range(3 * RENEW_BATCH)]))
            rng.shuffle(leases)
            round_ = asyncio.ensure_future(side.renew_round())
            await asyncio.sleep(0)  # the round took its snapshot of every lease and sent its first batch
            await asyncio.gather(round_, *[le.release() for le in leases])
        st = await b.status()
    finally:
        await b.aclose()
    false = [e for e in events if e.kind == "lease_lost"]
    assert not false and b.counters["lease_lost"] == 0, f"{len(false)} false lease_lost events"
    assert st.leases == 0, st


# ---------------------------------------------------------------------------------------- item 12
async def test_an_explicitly_created_budget_admits_its_first_request_at_once(
    redis_url: str, cleanup: str
) -> None:
    b = await RedisBudget.create(redis_url, cleanup, 100)  # lease_ttl_s 30: the implicit window is 30 s
    try:
        assert b.created is True
        st = await b.status()
        assert st.extra["recovering"] is False and st.extra["recovery_left_s"] == 0, st.extra
        lease = await b.acquire(5, timeout=5)  # granted on the first script call: no recovery wait
        await lease.release()
        again = await RedisBudget.create(redis_url, cleanup, 999)  # exists: left as it is
        assert again.created is False and again.limit == 100
        await again.aclose()
    finally:
        await b.aclose()


async def test_a_budget_found_absent_still_waits_out_recovery(redis_url: str, cleanup: str) -> None:
    """Without an explicit create, absent state may be a restart: the window stays (restart safety)."""
    b = RedisBudget(redis_url, cleanup, 100, lease_ttl_s=30)
    try:
        with pytest.raises(AdmissionTimeout):
            await b.acquire(1, timeout=0.3)
        st = await b.status()
        assert st.extra["recovering"] is True and st.leases == 0
    finally:
        await b.aclose()


def test_the_cli_creates_a_budget_with_no_first_use_wait(
    redis_url: str, cleanup: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["budget", "create", "--redis", redis_url, "--name", cleanup, "--limit", "50"]) == 0
    assert "created budget" in capsys.readouterr().out
    assert cli_main(["budget", "create", "--redis", redis_url, "--name", cleanup, "--limit", "70"]) == 0
    assert "exists" in capsys.readouterr().out
    b = RedisBudget(redis_url, cleanup, 50)
    try:
        st = b.status_sync()
        assert st.limit == 50 and st.extra["recovering"] is False
        b.acquire_sync(1, timeout=5).release_sync()
    finally:
        b.close_sync()


@pytest.mark.slow
async def test_a_redis_restart_after_an_explicit_create_still_waits(own_redis: Any) -> None:
    """create skips the window only for the state it writes: after a restart wiped it, the budget
    admits nothing new until the survivors re-adopted their leases (one lease TTL)."""
    box, port = own_redis
    url = f"redis://127.0.0.1:{port}/0"
    b = await RedisBudget.create(url, "restart", 10, lease_ttl_s=1.5, unavailable_timeout_s=10)
    try:
        lease = await b.acquire(8, timeout=5)
        box[0].kill()
        box[0].wait(timeout=10)
        box[0] = start_redis_server(port)[0]  # same port, no state
        with pytest.raises(AdmissionTimeout):  # state absent: recovery, even for the creator's process
            await b.acquire(8, timeout=0.5)
        st = await b.status()
        assert st.extra["recovering"] is True, st.extra
        side = b._side
        assert side is not None
        await side.renew_round()  # the survivor re-adopts its lease
        assert b.counters["readopted"] == 1 and not lease.lost
        await lease.release()
        second = await b.acquire(8, timeout=5)  # after the window (a poll at its end admits it)
        await second.release()
    finally:
        await b.aclose()


@pytest.mark.slow
def test_sync_renewals_do_not_wait_behind_a_saturated_pool_of_the_callers_client(
    redis_url: str, cleanup: str
) -> None:
    """The blocking face: the caller's own ``redis.Redis`` (a pool of 2 here) is jammed for longer than
    the lease TTL; the keeper thread renews on a clone with its own connections, so nothing is lost."""
    import threading

    import redis.asyncio as redis_async

    pool = redis.BlockingConnectionPool.from_url(redis_url, max_connections=2, timeout=None)
    sync_client = redis.Redis.from_pool(pool)
    b = RedisBudget(redis_async.Redis.from_url(redis_url), cleanup, 1000, recovery_s=0, lease_ttl_s=0.45,
                    sync_client=sync_client)
    try:
        held = [b.acquire_sync(1) for _ in range(5)]
        jam_key = f"{{zp:{cleanup}}}:jam"
        jam = [threading.Thread(target=sync_client.blpop, args=([jam_key],), kwargs={"timeout": 1.5})
               for _ in range(2)]
        for t in jam:
            t.start()
        for t in jam:
            t.join(timeout=20)
        b._sync_face._renew_round()  # one more round after the jam: every holder still holds
        lost = [le for le in held if le.lost]
        st = b.status_sync()
        for le in held:
            le.release_sync()
    finally:
        b.close_sync()
        sync_client.close()
    assert not lost and b.counters["lease_lost"] == 0, f"{len(lost)} of 5 live leases lost"
    assert st.leases == 5, st


@pytest.mark.slow
async def test_a_wrapped_call_cancelled_within_a_millisecond_raises_and_leaves_no_lease(
    redis_url: str, cleanup: str
) -> None:
    """The same through ``wrap()`` on a real server on loopback: each accepted ``task.cancel()`` in the
    first millisecond of a call raises ``CancelledError``, and no lease is left."""
    import openai

    from tests._asgi_server import LoopbackServer
    from zp_client import Settings, wrap

    b = RedisBudget(redis_url, cleanup, 10_000, recovery_s=0, lease_ttl_s=30)
    loop = asyncio.get_running_loop()
    rng = random.Random(1)
    accepted = completed = 0
    with LoopbackServer() as server:
        c = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=b,
                 settings=Settings(estimator="heuristic"))
        msgs = [{"role": "user", "content": "hello"}]
        try:
            await c.chat.completions.create(model="ok", messages=msgs, max_tokens=4)  # warm up
            for _ in range(300):
                t = asyncio.ensure_future(c.chat.completions.create(model="ok", messages=msgs, max_tokens=4))
                took: list[bool] = []
                loop.call_later(rng.uniform(0, 0.001), lambda t=t, took=took: took.append(t.cancel()))
                try:
                    await t
                except asyncio.CancelledError:
                    pass
                else:
                    completed += took == [True]
                    if not took:
                        await asyncio.sleep(0.002)
                accepted += took == [True]
                if accepted >= 20:
                    break
            side = b._side
            assert side is not None
            while side.background:
                await asyncio.gather(*list(side.background), return_exceptions=True)
            st = await b.status()
        finally:
            await b.aclose()
    assert accepted >= 20, f"only {accepted} cancellations landed while the call ran"
    assert completed == 0, f"{completed} of {accepted} accepted cancellations were ignored"
    assert st.leases == 0 and st.used == 0 and not st.waiters, st
