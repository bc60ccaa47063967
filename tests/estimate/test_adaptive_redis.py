"""The adaptive limit on a RedisBudget: one leader per budget through a Redis lease, fenced changes, the
fleet's overload answers, the state in status, Redis down; and three real processes on one budget with
the simulator as the judge of who polls /metrics (one poller; a SIGKILLed leader's successor polls
within one lease TTL).

This file is also the worker program: ``python tests/estimate/test_adaptive_redis.py <json-args>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.redis]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository (this file is in tests/<area>/)


# ------------------------------------------------------------------------------------------ the worker
async def _worker(a: dict[str, Any]) -> None:
    from zp_client.adaptive import AdaptiveLimit
    from zp_client.budget.redis import RedisBudget

    budget = RedisBudget(a["url"], a["name"], a["limit"])
    ctl = AdaptiveLimit(budget, a["server"], calibrated_limit=a["limit"], poll_interval_s=a["poll"],
                        leader_ttl_s=a["ttl"])
    await ctl.start()
    while not ctl.decisions:
        await asyncio.sleep(0.01)
    print(json.dumps({"id": ctl.id, "pid": os.getpid(), "leader": ctl.leader}), flush=True)
    await asyncio.sleep(3600)  # until SIGKILL / SIGTERM


if __name__ == "__main__":
    asyncio.run(_worker(json.loads(sys.argv[1])))
    sys.exit(0)


# ------------------------------------------------------------------------------------------ in-process
import httpx  # noqa: E402 - the worker above imports only what it needs
from test_adaptive import FakeServer  # noqa: E402

from zp_client.adaptive import AdaptiveLimit  # noqa: E402
from zp_client.budget.redis import RedisBudget  # noqa: E402
from zp_client.status_cli import budget_status, format_status  # noqa: E402

CAL = 950


def _pair(redis_url: str, name: str, srv: FakeServer,
          **kw: Any) -> tuple[list[RedisBudget], list[AdaptiveLimit]]:
    budgets = [RedisBudget(redis_url, name, CAL) for _ in range(2)]
    ctls = [AdaptiveLimit(b, "http://vllm.test:8000", calibrated_limit=CAL, http_client=srv.client(),
                          leader_ttl_s=kw.pop("leader_ttl_s", 5.0), controller_id=f"ctl-{i}", **kw)
            for i, b in enumerate(budgets)]
    return budgets, ctls


def test_one_leader_polls_its_changes_are_fenced_and_the_fleets_overloads_reach_it(
        redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        srv = FakeServer()
        budgets, (a, b) = _pair(redis_url, redis_prefix, srv)
        da, db = await a.poll_once(), await b.poll_once()
        assert da.leader and not db.leader and db.note == "follower of ctl-0"
        assert srv.pollers == ["ctl-0"]  # only the leader read /metrics
        # the follower cannot change the limit through the fence; the leader can
        assert not await budgets[1].compare_and_set_limit(CAL, 500, fence="ctl-1")
        assert (await budgets[1].status()).limit == CAL
        # a 429 seen by the follower's process reaches the leader through Redis
        b.note_overload(429)
        await b.poll_once()
        d = await a.poll_once()
        assert (d.overloads, d.reason, d.new_limit, d.applied) == (1, "overload", 760, True)
        assert (await budgets[1].status()).limit == 760  # fleet-wide
        st = (await budgets[1].status()).extra["adaptive"]
        assert isinstance(st, dict)
        assert (st["leader"], st["calibrated"], st["floor"], st["last_old"], st["last_new"],
                st["last_reason"]) == ("ctl-0", CAL, 475, CAL, 760, "overload")
        assert 0 < st["leader_ttl_s"] <= 5.0 and st["last_change_age_s"] is not None
        assert srv.pollers == ["ctl-0", "ctl-0"]
        for bud in budgets:
            await bud.aclose()

    asyncio.run(main())
    out = budget_status(redis_url, redis_prefix)
    text = format_status({"budget": out})
    assert "adaptive limit:   leader ctl-0" in text and "calibrated 950, floor 475" in text
    assert "last change:      950 -> 760 blocks (overload)" in text


def test_a_closed_leader_resigns_and_the_other_takes_over_at_its_next_poll(
        redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        srv = FakeServer()
        budgets, (a, b) = _pair(redis_url, redis_prefix, srv, poll_interval_s=3600)
        await a.start()
        while not a.decisions:
            await asyncio.sleep(0.01)
        assert a.leader and not (await b.poll_once()).leader
        srv.preemptions = 7
        await a.aclose()  # gives the lease up
        d = await b.poll_once()
        assert d.leader and b.leader_id == "ctl-1"
        # the successor took the preemption counter over: the 7 since the last poll count
        assert d.preemptions == 7 and d.reason == "preemption"
        for bud in budgets:
            await bud.aclose()

    asyncio.run(main())


def test_with_redis_down_the_controller_keeps_the_last_limit_and_says_so() -> None:
    async def main() -> None:
        srv = FakeServer()
        budget = RedisBudget("redis://127.0.0.1:1/0", "down", CAL, unavailable_timeout_s=0.2)
        ctl = AdaptiveLimit(budget, "http://vllm.test:8000", calibrated_limit=CAL, http_client=srv.client())
        ctl.note_overload(503)
        d = await ctl.poll_once()
        assert not d.leader and d.limit is None and "Redis did not answer" in d.note
        assert srv.pollers == []  # no leader: nobody polls
        assert ctl._overloads == 1  # kept for when Redis is back
        await budget.aclose()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ three processes
def _spawn(args: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _pollers(sim_url: str) -> dict[str, Any]:
    r = httpx.get(sim_url + "/sim/pollers", timeout=10)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.needs_sim
@pytest.mark.slow
def test_three_processes_run_exactly_one_poller_and_a_killed_leaders_successor_polls_within_one_ttl(
        redis_url: str, redis_prefix: str) -> None:
    import redis

    from zp_sim.server import SimServer

    ttl, poll = 4.0, 1.0  # the leader renews every poll: its lease's PTTL runs from 4 s down to 3 s
    leader_key = f"{{zp:{redis_prefix}}}:adaptive:leader"
    rc = redis.Redis.from_url(redis_url)
    with SimServer(num_gpu_blocks=1001) as sim:
        args = {"url": redis_url, "name": redis_prefix, "limit": CAL, "server": sim.url, "poll": poll,
                "ttl": ttl}
        procs = [_spawn(args) for _ in range(3)]
        try:
            hello = [json.loads(p.stdout.readline() or "{}") for p in procs]  # type: ignore[union-attr]
            assert all("id" in h for h in hello), [p.stderr.read() for p in procs if p.poll() is not None]  # type: ignore[union-attr]
            by_id = {h["id"]: p for h, p in zip(hello, procs, strict=True)}
            # watch the judge for three poll intervals: one poller, the lease's holder
            t0 = sim.clock()
            while sim.clock() - t0 < 3 * poll:
                time.sleep(0.1)
            seen = _pollers(sim.url)["pollers"]
            leader = rc.get(leader_key).decode()
            assert list(seen) == [leader], seen
            assert seen[leader]["polls"] >= 3
            # kill the leader 0.55-0.75 s after a renewal (and as long before the next), so "within one TTL
            # of the kill" leaves the successor at least 0.55 s for its wake-up and first poll
            while not ((ttl - 0.75) * 1000 <= rc.pttl(leader_key) <= (ttl - 0.55) * 1000):
                time.sleep(0.01)
            by_id[leader].send_signal(signal.SIGKILL)
            killed_at = sim.clock()
            by_id[leader].wait(10)
            while len(_pollers(sim.url)["pollers"]) < 2 and sim.clock() - killed_at < 4 * ttl:
                time.sleep(0.05)
            seen = _pollers(sim.url)["pollers"]
            new = [k for k in seen if k != leader]
            assert len(new) == 1, seen
            took = seen[new[0]]["first_s"] - killed_at
            print(f"successor's first poll {took:.3f} s after the kill (lease TTL {ttl} s)")
            assert took <= ttl  # took over within one lease TTL
            assert seen[leader]["last_s"] <= killed_at
            # and it alone polls from then on
            t1 = sim.clock()
            while sim.clock() - t1 < 3 * poll:
                time.sleep(0.1)
            after = _pollers(sim.url)["pollers"]
            assert set(after) == {leader, new[0]} and after[leader] == seen[leader]
            assert after[new[0]]["polls"] >= seen[new[0]]["polls"] + 2
            assert rc.get(leader_key).decode() == new[0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
                for f in (p.stdout, p.stderr):
                    if f is not None:
                        f.close()
            rc.delete(leader_key, f"{{zp:{redis_prefix}}}:adaptive")
            rc.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_overload_answers_noted_between_polls_survive_a_lease_renewal(redis_url: str, redis_prefix: str) -> None:
    """A leader renews its lease between polls when the poll interval exceeds a third of the TTL; the
    renewal takes the fleet's overload answers from Redis, and they must count at the next poll."""

    async def main() -> None:
        srv = FakeServer()
        budget = RedisBudget(redis_url, redis_prefix, CAL)
        ctl = AdaptiveLimit(budget, "http://vllm.test:8000", calibrated_limit=CAL, http_client=srv.client(),
                            poll_interval_s=1.5, leader_ttl_s=0.9, controller_id="ctl-r")
        try:
            async with ctl:
                while not ctl.decisions:
                    await asyncio.sleep(0.01)
                for _ in range(5):
                    ctl.note_overload(429)
                while len(ctl.decisions) < 2:  # renewals run every 0.3 s in between
                    await asyncio.sleep(0.05)
            d = ctl.decisions[1]
            assert d.leader and d.overloads == 5 and d.reason == "overload", d
        finally:
            await budget.aclose()

    asyncio.run(main())


def test_a_successor_inherits_the_cooldown_of_the_leader_that_cut(redis_url: str, redis_prefix: str) -> None:
    """One burst is cut once fleet-wide: a leader that cut and resigned hands its cooldown to the next."""

    async def main() -> None:
        srv = FakeServer()
        budgets, (a, b) = _pair(redis_url, redis_prefix, srv)
        await a.poll_once()
        a.note_overload(503)
        d = await a.poll_once()
        assert (d.reason, d.applied) == ("overload", True)
        await a.aclose()  # resigns the lease
        b.note_overload(503)  # the same burst, seen by the next leader's process
        d = await b.poll_once()
        assert d.leader and d.overloads == 1
        assert (d.reason, d.applied) == (None, False), d  # within the inherited cooldown: no second cut
        assert (await budgets[1].status()).limit == 760
        for bud in budgets:
            await bud.aclose()

    asyncio.run(main())
