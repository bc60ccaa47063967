"""RedisBudget when Redis answers slowly (issue 33: the 8-process over-admission).

Under a queue of scripts (a herd of acquires on a loaded machine) every round trip to Redis takes
0.5-2 s. Before these fixes a process's heartbeat (its poll, spaced by its round trip) then arrived after
``waiter_ttl_s``: every waiter of the process lapsed and re-enqueued with its own acquire, the queue
grew, renewal rounds (spaced TTL/3 *plus* their own round trip) arrived further apart than a lease TTL,
and live leases expired while used (``tests/budget/test_redis_multiprocess.py`` over-admitted on main in
5 of 10 runs at load 7-15). A delaying proxy makes the slow round trip deterministic here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests._redis_keys import delete_keys
from zp_client import RedisBudget
from zp_client.budget.redis import _async

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.faults]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture
def cleanup(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield redis_prefix
    delete_keys(redis_url, redis_prefix)


def _port(url: str) -> int:
    return int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


@pytest.mark.slow
async def test_a_waiter_behind_a_slow_round_trip_keeps_its_place(
    redis_url: str, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process 0.35 s away from Redis each way (round trip 0.7 s, more than the 0.25 s margin of
    ``waiter_ttl_s`` = 0.55 s with polls every 0.3 s) waits behind a full budget. Its heartbeats carry
    their measured round trip as slack, so its waiter stays in line: at most one poll finds it gone
    (before the first round trip was measured), not every poll (every one before)."""
    from _fault_report import LatencyProxy

    states: list[str] = []  # the far process's waiter states as its polls and mailbox report them
    real_resolve = _async.AsyncFace._resolve

    def recording_resolve(self: _async.AsyncFace, rid: str, state: str) -> None:
        if self.core.owner == far_owner[0]:
            states.append(state)
        real_resolve(self, rid, state)

    far_owner = [""]
    monkeypatch.setattr(_async.AsyncFace, "_resolve", recording_resolve)
    holder = RedisBudget(redis_url, cleanup, 10, policy="strict", recovery_s=0, lease_ttl_s=3.0,
                         poll_interval_s=0.3)
    with LatencyProxy(_port(redis_url), 0.35) as proxy:
        far = RedisBudget(f"redis://127.0.0.1:{proxy.port}/0", cleanup, 10, policy="strict", recovery_s=0,
                          lease_ttl_s=3.0, poll_interval_s=0.3)
        far_owner[0] = far._core.owner
        try:
            # connected before the wait (a new connection's handshake is several slow round trips)
            warm = await far.acquire(1)
            await warm.release()
            await asyncio.sleep(3.0)
            lease = await holder.acquire(10)
            waiter = asyncio.ensure_future(far.acquire(10))
            await asyncio.sleep(5.0)
            assert not waiter.done()
            released = time.monotonic()
            await lease.release()
            got = await asyncio.wait_for(waiter, 15)
            took = time.monotonic() - released
            await got.release()
            slack = getattr(far._core, "hb_slack_s", 0.0)  # (before the slack: none)
        finally:
            await far.aclose()
            await holder.aclose()
    # until its grant: a poll sent just before the lease was released may still report its id ('N')
    waited = states[: min((i for i, st in enumerate(states) if st[0] in "MG"), default=len(states))]
    gone = waited.count("N")
    print(f"far process: polls found its waiter gone {gone} times ({states}); granted {took:.2f} s after the "
          f"release; slack {slack:.2f} s")
    assert waited.count("W") >= 3  # it did wait through several heartbeats
    assert gone <= 1, f"its waiter lapsed {gone} times: {states}"
    assert 0.5 <= slack <= getattr(far._core, "hb_slack_cap_s", 0.0)


async def test_the_heartbeat_slack_is_the_recent_round_trip_capped_by_the_dead_process_bound(
    redis_url: str, cleanup: str
) -> None:
    """The slack is the longest heartbeat round trip of the last one to two windows, never more than
    ``(lease_ttl_s + poll_interval_s) / 2 - waiter_ttl_s`` (a dead process's waiters and pending grants
    are then back within ``lease_ttl_s + poll_interval_s``), and it is what the waiter TTL and the claim
    window sent carry."""
    b = RedisBudget(redis_url, cleanup, 10, lease_ttl_s=3.0, poll_interval_s=1.0)
    core = b._core
    assert core.cfg.waiter_ttl_s == 1.5 and core.hb_slack_cap_s == 0.5
    assert core.hb_slack_s == 0 and core.waiter_ttl_ms() == 1500
    core.observe_rtt(0.2, 100.0)
    core.observe_rtt(0.1, 100.5)
    assert core.hb_slack_s == 0.2 and core.waiter_ttl_ms() == 1700
    args = core.acquire_args("id", 1, 0, 0, 0, "box", "")
    assert args[8] == args[11] == b"1700"  # waiter TTL and claim window
    core.observe_rtt(0.05, 101.2)  # a new window: the previous one still counts
    assert core.hb_slack_s == 0.2
    core.observe_rtt(0.05, 102.3)  # two windows on: forgotten
    assert core.hb_slack_s == 0.05
    core.observe_rtt(9.0, 102.4)
    assert core.hb_slack_s == 0.5 and core.waiter_ttl_ms() == 2000  # capped
    core.observe_rtt(0.01, 110.0)  # after a silence: the old windows are forgotten
    assert core.hb_slack_s == 0.01
    await b.aclose()


@pytest.mark.slow
async def test_renewal_rounds_start_at_a_fixed_rate_when_each_takes_long(
    redis_url: str, cleanup: str
) -> None:
    """Each renewal round takes twice the renewal period here (a slow Redis). Rounds start back to back
    (one every 2 periods), not a period after the previous one ended (one every 3 periods): when a round
    trip is slow, renewals must not arrive further apart than its own length plus a period."""
    period = 0.1
    b = RedisBudget(redis_url, cleanup, 10, lease_ttl_s=3 * period, recovery_s=0)
    starts: list[float] = []
    lease = await b.acquire(1)
    face = b._side
    assert face is not None

    async def slow_round() -> None:
        starts.append(time.monotonic())
        await asyncio.sleep(2 * period)

    face.renew_round = slow_round  # type: ignore[method-assign]
    await asyncio.sleep(12 * period)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    await lease.release()
    await b.aclose()
    assert len(gaps) >= 3, starts
    mean = sum(gaps) / len(gaps)
    print(f"round starts every {mean:.3f} s (period {period} s, each round {2 * period} s)")
    assert mean < 2.5 * period, gaps
