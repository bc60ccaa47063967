"""RedisBudget under faults and races (issue 33 items 1, 4, 11, 12): a cancellation redis-py swallows,
renewals behind a saturated connection pool, a release racing its renewal, the first-use window and a
Redis restart after an explicit create.

Tests that restart Redis start their own ``redis-server`` on a free port (never the machine's 6379).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests._redis_keys import delete_keys
from tests.conftest import start_redis_server
from zp_client import AdmissionTimeout, RedisBudget
from zp_client.budget.redis import RedisBudgetEvent
from zp_client.budget.redis._script import RENEW_BATCH
from zp_client.cli import main as cli_main

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.faults]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture
def cleanup(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield redis_prefix
    delete_keys(redis_url, redis_prefix)


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
    redis_url: str, cleanup: str, timeout: float | None, fault_report: Any
) -> None:
    """redis-py runs each command under ``asyncio.wait_for``, which on 3.10/3.11 returns the reply instead
    of raising when the cancellation arrives as the reply does: the acquire ran to completion (20/20
    trials in the issue). Every accepted ``task.cancel()`` must raise, and no lease may be left."""
    b = RedisBudget(redis_url, cleanup, 10_000, recovery_s=0, lease_ttl_s=30)
    loop = asyncio.get_running_loop()
    rng = random.Random(33)
    accepted = swallowed = 0
    late = 0.0  # the longest from an accepted cancel() to the caller's CancelledError
    cancelled_at: list[float] = []
    try:
        await b.status()  # the budget's client is made and connected before the trials
        for _ in range(400):
            t = asyncio.ensure_future(b.acquire(1, timeout=timeout))
            took: list[bool] = []

            def cancel(t: asyncio.Future[Any] = t, took: list[bool] = took) -> None:
                cancelled_at[:] = [time.monotonic()]
                took.append(t.cancel())

            loop.call_later(rng.uniform(0, 0.001), cancel)
            try:
                lease = await t
            except asyncio.CancelledError:
                late = max(late, time.monotonic() - cancelled_at[0])
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
        # clean-ups of cancelled acquires still in flight (a 30 s liveness bound with what is left, rather
        # than pytest's 120 s timeout: CI on 3.12 once spun here on a finished task still in the set)
        until = time.monotonic() + 30.0
        while side.background:
            left = list(side.background)
            assert time.monotonic() < until, f"background clean-ups not gone after 30 s: {left!r}"
            await asyncio.gather(*left, return_exceptions=True)
        st = await b.status()
    finally:
        await b.aclose()
    fault_report(f"task.cancel() within 1 ms of RedisBudget.acquire (timeout={timeout})",
                 f"cancel at a random 0-1 ms, {accepted} trials", leaked_blocks=st.used,
                 error="CancelledError" if accepted > swallowed else None, error_latency_s=late,
                 notes=f"{swallowed} of {accepted} accepted cancellations ignored; latency: cancel() to "
                       "the caller's CancelledError, the longest")
    assert accepted >= 20, f"only {accepted} cancellations landed while the call ran"
    assert swallowed == 0, f"{swallowed} of {accepted} accepted cancellations were ignored"
    assert st.leases == 0 and st.used == 0 and not st.waiters, st


# ---------------------------------------------------------------------------------------- item 4
@pytest.mark.slow
async def test_renewals_do_not_wait_behind_a_saturated_pool(redis_url: str, cleanup: str,
                                                            fault_report: Any) -> None:
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
        after = await b.status()
    finally:
        await b.aclose()
    fault_report("renewals behind a saturated pool", "100 blocking commands fill the pool 1.5 s, 500 "
                 "acquires queue (TTL 0.45 s)", leaked_blocks=after.used,
                 notes=f"{len(lost)} of 20 live leases lost, lease_lost events {b.counters['lease_lost']}")
    assert not lost and b.counters["lease_lost"] == 0, f"{len(lost)} live leases lost: {events[:3]}"
    assert st.leases == 520, st


def _port(url: str) -> int:
    return int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


BURST = 2000
BURST_LIMIT = 1500


@pytest.mark.slow
async def test_a_burst_of_2000_acquires_at_20ms_latency_expires_no_live_lease(
    redis_url: str, cleanup: str, fault_report: Any
) -> None:
    """Issue 33 item 4 as the issue saw it: 2,000 acquires at once in one process, Redis 20 ms away (each
    way, through a delaying proxy), lease TTL 3 s, each holder keeping its lease 0.3-4 s (longer than the
    TTL: it lives by its renewals), 500 of them in line behind the limit. No live lease expires (0 lost,
    0 lease_lost), the limit holds (sampled every 10 ms), and everything is back at the end."""
    from _fault_report import HeldSampler, LatencyProxy

    events: list[RedisBudgetEvent] = []
    rng = random.Random(2000)
    holds = [rng.uniform(0.3, 4.0) for _ in range(BURST)]
    leases: list[Any] = []
    lost_while_held = 0
    waits: list[float] = []

    with LatencyProxy(_port(redis_url), 0.020) as proxy:
        b = RedisBudget(f"redis://127.0.0.1:{proxy.port}/0", cleanup, BURST_LIMIT, policy="strict",
                        recovery_s=0, lease_ttl_s=3.0, on_event=events.append)

        async def one(hold: float) -> None:
            nonlocal lost_while_held
            t0 = time.monotonic()
            lease = await b.acquire(1, timeout=25)
            waits.append(time.monotonic() - t0)
            leases.append(lease)
            await asyncio.sleep(hold)
            lost_while_held += lease.lost
            await lease.release()

        try:
            await b.status()  # connected before the burst
            t0 = time.monotonic()
            async with HeldSampler(BURST_LIMIT, lambda: leases) as sampler:
                await asyncio.gather(*(one(h) for h in holds))
            took = time.monotonic() - t0
            st = await b.status()
        finally:
            await b.aclose()
    waits.sort()
    fault_report(f"{BURST}-acquire burst at 20 ms latency (strict)",
                 f"{BURST} acquires at once, +20 ms each way (proxy), TTL 3 s, holds 0.3-4 s",
                 over_admission=sampler.over_admission, leaked_blocks=st.used,
                 notes=f"{lost_while_held} live leases expired (lease_lost {b.counters['lease_lost']}); "
                       f"wait p50 {waits[len(waits) // 2]:.2f} s, max {waits[-1]:.2f} s; "
                       f"all done in {took:.1f} s; event loop late by up to {sampler.max_lag_s:.2f} s")
    assert lost_while_held == 0 and b.counters["lease_lost"] == 0, events[:3]
    assert sampler.over_admission == 0
    assert st.used == 0 and st.leases == 0, st


ROUND_DELAY_S = 0.15  # each way: a round trip through the proxy takes at least 0.3 s


async def test_a_renewal_round_sends_its_batches_at_once(redis_url: str, cleanup: str) -> None:
    """A round's batches go out together (over the renewal connections), so a round of 5 batches takes
    about one round trip, not five: renewals one batch after the other arrived up to a whole round late
    when every round trip was slow (a burst's queue, a loaded event loop). Through a proxy delaying
    every byte 0.15 s each way, five batches in a row take at least 1.5 s; the bound is 3 round trips."""
    from _fault_report import LatencyProxy

    with LatencyProxy(_port(redis_url), ROUND_DELAY_S) as proxy:
        b = RedisBudget(f"redis://127.0.0.1:{proxy.port}/0", cleanup, 100_000, recovery_s=0,
                        lease_ttl_s=60)  # the keeper's own rounds (every 20 s) stay out of the way
        try:
            leases = list(await asyncio.gather(*[b.acquire(1) for _ in range(5 * RENEW_BATCH)]))
            side = b._get_side()
            await side.renew_round()  # the renewal connections are open (and the scripts loaded)
            t0 = time.monotonic()
            await side.renew_round()
            took = time.monotonic() - t0
            lost = sum(le.lost for le in leases)
            await asyncio.gather(*[le.release() for le in leases])
        finally:
            await b.aclose()
    assert lost == 0
    assert took < 3 * 2 * ROUND_DELAY_S, f"a round of 5 batches took {took:.2f} s (round trip 0.3 s)"


async def test_a_lease_registered_late_is_renewed_before_its_ttl_runs_out(
        redis_url: str, cleanup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grant's reply that reaches its acquire late (an event loop seconds behind under a burst) registers
    the lease with the keeper long after Redis started its TTL; registered just after a round began, it
    waited a whole period for the next one and expired (issue 33: a burst at load ~15 lost leases whose
    rounds were on time). Here the acquire is sent 0.6 s after a round began (TTL 3 s, rounds every 1 s)
    and its reply handed over just after the round 2.4 s later began: the next round, 3.4 s after the
    grant, would come too late (lost on the commit before, every run); the keeper renews it at once."""
    from zp_client.budget.redis import _async

    late = [False]
    round_began = asyncio.Event()
    real_start, real_round = _async.AsyncFace._start, _async.AsyncFace.renew_round

    def start(self: _async.AsyncFace, script: str, args: Any, **kw: Any) -> Any:
        call = real_start(self, script, args, **kw)
        if script != "acquire" or not late[0]:
            return call

        async def handed_over_late() -> Any:
            reply = await call
            sent = time.monotonic()
            while time.monotonic() - sent < 2.0:  # registered just after a round took its list of leases
                round_began.clear()
                await round_began.wait()
            return reply

        return self.loop.create_task(handed_over_late())

    async def renew_round(self: _async.AsyncFace) -> None:
        round_began.set()
        await real_round(self)

    monkeypatch.setattr(_async.AsyncFace, "_start", start)
    monkeypatch.setattr(_async.AsyncFace, "renew_round", renew_round)
    b = RedisBudget(redis_url, cleanup, 100, recovery_s=0, lease_ttl_s=3.0)
    try:
        first = await b.acquire(1)  # the keeper runs
        round_began.clear()
        await round_began.wait()
        await asyncio.sleep(0.6)  # the rounds come 0.4, 1.4 and 2.4 s after the grant below
        late[0] = True
        t0 = time.monotonic()
        lease = await b.acquire(1)
        late[0] = False
        await asyncio.sleep(max(0.0, 4.2 - (time.monotonic() - t0)))  # past its TTL, a round after it
        lost = lease.lost or (await b.status()).leases < 2
        await first.release()
        await lease.release()
    finally:
        await b.aclose()
    assert not lost and b.counters["lease_lost"] == 0, "the late-registered lease expired"


async def test_a_grant_from_the_line_reported_late_is_renewed_before_its_ttl_runs_out(
        redis_url: str, cleanup: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiter granted from the line by this process's own release (its lease's TTL starts then) hears
    of it through the mailbox or a poll, which can come seconds later under a burst: here the grant comes
    0.6 s after a round began (TTL 3 s, rounds every 1 s) and the report just after the round 2.4 s later
    began (lost on main 0086266: its next round came 3.4 s after the grant). The keeper renews it at
    once."""
    from zp_client.budget.redis import _async

    round_began = asyncio.Event()
    real_resolve, real_round = _async.AsyncFace._resolve, _async.AsyncFace.renew_round
    delayed: list[asyncio.Task[None]] = []

    def resolve(self: _async.AsyncFace, rid: str, state: str) -> None:
        if not state.startswith("G"):
            real_resolve(self, rid, state)
            return

        async def reported_late() -> None:
            at = time.monotonic()
            while time.monotonic() - at < 2.0:
                round_began.clear()
                await round_began.wait()
            real_resolve(self, rid, state)

        delayed.append(asyncio.ensure_future(reported_late()))

    async def renew_round(self: _async.AsyncFace) -> None:
        round_began.set()
        await real_round(self)

    monkeypatch.setattr(_async.AsyncFace, "_resolve", resolve)
    monkeypatch.setattr(_async.AsyncFace, "renew_round", renew_round)
    b = RedisBudget(redis_url, cleanup, 2, policy="strict", recovery_s=0, lease_ttl_s=3.0)
    try:
        # renewed every round: Redis hears from this process every second (after a silence longer than
        # half the TTL, Redis would take it for a stall and push every expiry back; see "A Redis stall")
        other = await b.acquire(1)
        first = await b.acquire(1)
        waiting = asyncio.ensure_future(b.acquire(1))
        while not (await b.status()).waiters:
            await asyncio.sleep(0.01)
        round_began.clear()
        await round_began.wait()
        await asyncio.sleep(0.6)  # the rounds come 0.4, 1.4 and 2.4 s after the grant below
        t0 = time.monotonic()
        await first.release()  # grants the waiter: its TTL starts now
        lease = await waiting
        await asyncio.sleep(max(0.0, 4.2 - (time.monotonic() - t0)))  # past its TTL, a round after it
        lost = lease.lost or (await b.status()).leases < 2
        await lease.release()
        await other.release()
    finally:
        await b.aclose()
        for t in delayed:
            t.cancel()
    assert not lost and b.counters["lease_lost"] == 0, "the lease granted from the line expired"


# ---------------------------------------------------------------------------------------- item 11
@pytest.mark.parametrize("latency_s", [0.0, 0.020], ids=["loopback", "20ms"])
async def test_a_release_racing_its_renewal_is_never_reported_lost(
        redis_url: str, cleanup: str, fault_report: Any, latency_s: float) -> None:
    """A renewal round renews in batches (``RENEW_BATCH``), several in flight at once; leases released
    while the round is in flight reach Redis before their batch does, which then finds them gone. No
    ``lease_lost`` event for a lease its holder released, and every lease released in the end."""
    from contextlib import ExitStack

    from _fault_report import LatencyProxy

    events: list[RedisBudgetEvent] = []
    stack = ExitStack()
    if latency_s:
        proxy = stack.enter_context(LatencyProxy(_port(redis_url), latency_s))
        redis_url = f"redis://127.0.0.1:{proxy.port}/0"
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
        # a release waits for Redis at most RELEASE_WAIT_S (1 s) and goes on in the background: on a
        # starved loop (3.10 beside two CPU burners: 44 of 600 still in flight) the status read can come
        # first. A liveness bound: every lease is gone once those land (a lost release never lands).
        deadline = time.monotonic() + 20
        st = await b.status()
        while st.leases and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            st = await b.status()
    finally:
        await b.aclose()
        stack.close()
    false = [e for e in events if e.kind == "lease_lost"]
    fault_report(f"a release racing its renewal ({latency_s * 1000:.0f} ms latency)",
                 f"{9 * RENEW_BATCH} releases while a renewal round runs",
                 leaked_blocks=st.used, notes=f"{len(false)} false lease_lost events, counter "
                                              f"{b.counters['lease_lost']}")
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
async def test_a_redis_restart_after_an_explicit_create_still_waits(own_redis: Any,
                                                                    fault_report: Any) -> None:
    """create skips the window only for the state it writes: after a restart wiped it, the budget
    admits nothing new until the survivors re-adopted their leases (one lease TTL)."""
    from _fault_report import HeldSampler

    box, port = own_redis
    url = f"redis://127.0.0.1:{port}/0"
    b = await RedisBudget.create(url, "restart", 10, lease_ttl_s=1.5, unavailable_timeout_s=10)
    leases: list[Any] = []
    try:
        async with HeldSampler(10, lambda: leases) as sampler:
            lease = await b.acquire(8, timeout=5)
            leases.append(lease)
            box[0].kill()
            box[0].wait(timeout=10)
            box[0] = start_redis_server(port)[0]  # same port, no state
            restarted = time.monotonic()
            with pytest.raises(AdmissionTimeout) as info:  # state absent: recovery, even for the creator
                leases.append(await b.acquire(8, timeout=0.5))
            err_late = time.monotonic() - restarted - 0.5
            st = await b.status()
            assert st.extra["recovering"] is True, st.extra
            side = b._side
            assert side is not None
            await side.renew_round()  # the survivor re-adopts its lease
            readopted, lost = b.counters["readopted"], lease.lost
            await lease.release()
            second = await b.acquire(8, timeout=5)  # after the window (a poll at its end admits it)
            leases.append(second)
            recover = time.monotonic() - restarted
            await second.release()
        after = await b.status()
    finally:
        await b.aclose()
    cfg = b._core.cfg
    fault_report("Redis restart (strict)", "SIGKILL of redis-server, restarted empty on the same port",
                 over_admission=sampler.over_admission, leaked_blocks=after.used, recover_s=recover,
                 recover_bound_s=cfg.lease_ttl_s + cfg.poll_interval_s,
                 error=type(info.value).__name__, error_latency_s=err_late,
                 notes=f"{readopted} lease re-adopted (lost: {lost}); recover: restart until a new lease "
                       "is granted (the recovery window by design); error: an acquire (timeout 0.5 s) "
                       "in the window")
    assert readopted == 1 and not lost
    assert sampler.over_admission == 0


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
    redis_url: str, cleanup: str, fault_report: Any
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
    late = 0.0
    cancelled_at: list[float] = []
    with LoopbackServer() as server:
        c = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=b,
                 settings=Settings(estimator="heuristic"))
        msgs = [{"role": "user", "content": "hello"}]
        try:
            await c.chat.completions.create(model="ok", messages=msgs, max_tokens=4)  # warm up
            for _ in range(300):
                t = asyncio.ensure_future(c.chat.completions.create(model="ok", messages=msgs, max_tokens=4))
                took: list[bool] = []

                def cancel(t: asyncio.Future[Any] = t, took: list[bool] = took) -> None:
                    cancelled_at[:] = [time.monotonic()]
                    took.append(t.cancel())

                loop.call_later(rng.uniform(0, 0.001), cancel)
                try:
                    await t
                except asyncio.CancelledError:
                    late = max(late, time.monotonic() - cancelled_at[0])
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
    fault_report("task.cancel() within 1 ms of a wrap()ped call on RedisBudget",
                 f"cancel at a random 0-1 ms, {accepted} trials", leaked_blocks=st.used,
                 error="CancelledError" if accepted > completed else None, error_latency_s=late,
                 notes=f"{completed} of {accepted} accepted cancellations ignored; latency: cancel() to "
                       "the caller's CancelledError, the longest")
    assert accepted >= 20, f"only {accepted} cancellations landed while the call ran"
    assert completed == 0, f"{completed} of {accepted} accepted cancellations were ignored"
    assert st.leases == 0 and st.used == 0 and not st.waiters, st
