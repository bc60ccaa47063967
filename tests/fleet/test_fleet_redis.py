"""RedisFleet (zp_client.fleet.redis) on a real Redis: placement across replicas, one fair line across
processes (two fleets on one name stand for two processes, and one real subprocess), prefix and session
affinity, the affinity wait, ejection and readmission, membership, the prefix index's bound, TTLs on the
routing keys, the round trips of an uncontended request, fail-closed, and a real openai client through
``wrap`` against two loopback servers.

Every test uses its own fleet name (``redis_prefix``) and deletes its keys afterwards. Waits are
liveness bounds, never timing assertions (except the affinity wait's lower bound).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis
import redis.asyncio as redis_async

from tests._asgi_server import LoopbackServer
from tests._redis_keys import delete_keys as _delete_keys
from tests.conftest import _free_port
from zp_client import observe_admissions, wrap
from zp_client.errors import BudgetUnavailable, ConfigurationError, LeaseTooLarge
from zp_client.fleet.redis import RedisFleet, replica_id

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

A, B, C = "http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository (this file is in tests/<area>/)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fleets(redis_url: str, redis_prefix: str) -> Iterator[Any]:
    """Factory of RedisFleets on the test's name (each one a "process"); keys deleted afterwards."""
    made: list[RedisFleet] = []

    def make(replicas: Any = (A, B), limit: int | None = 10, **kw: Any) -> RedisFleet:
        kw.setdefault("recovery_s", 0)
        f = RedisFleet(kw.pop("url", redis_url), kw.pop("name", redis_prefix), list(replicas)
                       if not isinstance(replicas, dict) else replicas, limit, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close_sync()
    _delete_keys(redis_url, redis_prefix)


def _meta(fleet: RedisFleet, *turns: str, session: str | None = None, tokens: int = 96) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": t} for t in turns]}
    return fleet.routing_meta(body, tokens, session)


async def _reps(fleet: RedisFleet) -> dict[str, dict[str, Any]]:
    return (await fleet.status()).extra["replicas"]  # type: ignore[return-value]


# ------------------------------------------------------------------------------ placement and the line
async def test_placement_and_one_fair_line_across_two_processes(fleets: Any) -> None:
    p1, p2 = fleets(), fleets()
    x = await p1.acquire(10)
    y = await p2.acquire(10)
    assert {x.replica, y.replica} == {A, B}  # one per replica: neither fits twice
    late = asyncio.create_task(p2.acquire(10, priority=5))
    await asyncio.sleep(0.05)
    urgent = asyncio.create_task(p1.acquire(10, priority=0))
    fifo1 = asyncio.create_task(p2.acquire(10, priority=5))
    await asyncio.sleep(0.1)
    assert not (late.done() or urgent.done() or fifo1.done())
    st = await p1.status()
    assert st.limit == 20 and st.used == 20 and st.waiters[5].waiters == 2
    await x.release()  # the other process's urgent waiter comes first, on the freed replica
    u = await asyncio.wait_for(urgent, 5)
    assert u.replica == x.replica and not late.done()
    await y.release()
    first = await asyncio.wait_for(late, 5)  # FIFO within the class, across processes
    assert first.replica == y.replica and not fifo1.done()
    await u.release()
    second = await asyncio.wait_for(fifo1, 5)
    await first.release()
    await second.release()
    st = await p2.status()
    assert st.used == 0 and st.leases == 0
    assert all(r["leases"] == 0 and r["used"] == 0 for r in st.extra["replicas"].values())


async def test_least_load_then_too_large_for_every_replica(fleets: Any) -> None:
    f = fleets({A: 10, B: 20}, None)
    a = await f.acquire(4)
    assert a.replica == B  # 4/20 < 4/10
    b = await f.acquire(2)
    assert b.replica == A  # 2/10 < 6/20
    with pytest.raises(LeaseTooLarge):
        await f.acquire(21)
    big = await f.acquire(16)
    assert big.replica == B
    for le in (a, b, big):
        await le.release()


def test_the_sync_face_routes_too(fleets: Any) -> None:
    f = fleets()
    x = f.acquire_sync(6, meta=_meta(f, "hello"))
    y = f.acquire_sync(6)
    assert {x.replica, y.replica} == {A, B}
    assert f.note_failure(x, connect=True)  # no event loop: told at once
    reps = f.status_sync().extra["replicas"]
    assert reps[x.replica]["ejected"] and reps[x.replica]["leases"] == 1  # its lease stays until released
    x.release_sync()
    y.release_sync()
    assert f.status_sync().used == 0


# ------------------------------------------------------------------------------ affinity
async def test_prefix_affinity_beats_load(fleets: Any) -> None:
    f = fleets({A: 100, B: 100}, None)
    first = await f.acquire(10, meta=_meta(f, "system prompt " * 20, "turn 1"))
    home = first.replica
    # same conversation, one more turn: its home is busier, but it holds the prefix
    second = await f.acquire(10, meta=_meta(f, "system prompt " * 20, "turn 1", "turn 2"))
    assert second.replica == home
    other = await f.acquire(10, meta=_meta(f, "something else"))
    assert other.replica != home  # no match: least load
    st = await f.status()
    assert st.extra["prefix_hit_rate"] and st.extra["prefix_index_entries"] >= 3
    for le in (first, second, other):
        await le.release()


async def test_session_affinity(fleets: Any) -> None:
    f = fleets({A: 100, B: 100}, None)
    s1 = await f.acquire(10, meta=_meta(f, "q1", session="conv-1"))
    home = s1.replica
    load = await f.acquire(30)  # makes the other replica the less loaded one... or this one
    s2 = await f.acquire(10, meta=_meta(f, "a different prompt", session="conv-1"))
    assert s2.replica == home
    assert (await f.status()).extra["sessions"] == 1
    for le in (s1, load, s2):
        await le.release()


async def test_affinity_waits_a_bounded_time_then_goes_elsewhere(fleets: Any) -> None:
    f = fleets({A: 20, B: 20}, None, affinity_wait_s=0.3, min_affinity_blocks=1)
    warm = await f.acquire(20, meta=_meta(f, "shared head " * 40))  # fills its home
    home = warm.replica
    t0 = time.monotonic()
    again = await asyncio.wait_for(f.acquire(5, meta=_meta(f, "shared head " * 40, "more")), 5)
    waited = time.monotonic() - t0
    assert again.replica != home
    assert waited >= 0.25  # it waited for its prefix's replica first
    await warm.release()
    await again.release()


# ------------------------------------------------------------------------------ health
async def test_ejection_routes_around_keeps_what_the_replica_holds_and_readmit(fleets: Any) -> None:
    p1, p2 = fleets(), fleets()
    on = [await p1.acquire(5) for _ in range(4)]
    a_leases = [le for le in on if le.replica == A]
    assert len(a_leases) == 2
    await p2.eject(A)  # another process ejects: A's leases stay until their holders release them
    reps = await _reps(p1)
    assert reps[A]["ejected"] and reps[A]["leases"] == 2 and reps[A]["used"] == 10
    assert reps[A]["lost_leases"] == 2 and reps[B]["leases"] == 2
    for le in a_leases:
        await le.release()
    for le in on:
        if le.replica == B:
            await le.release()
    routed = [await p1.acquire(5) for _ in range(2)]
    assert {le.replica for le in routed} == {B}  # routed around A
    with pytest.raises(asyncio.TimeoutError):  # B is full and A is out
        await asyncio.wait_for(p1.acquire(5), 0.3)
    assert await p2.readmit(A)
    back = await asyncio.wait_for(p1.acquire(5), 5)
    assert back.replica == A
    assert not await p2.readmit(A)  # not ejected any more
    for le in (*routed, back):
        await le.release()
    assert (await p1.status()).used == 0


async def test_a_holder_keeps_its_lease_through_an_ejection(fleets: Any) -> None:
    f = fleets(lease_ttl_s=0.6, fleet_ttl_s=2)
    le = await f.acquire(3)
    await f.eject(le.replica or "")
    await asyncio.sleep(0.5)  # renewals go on
    assert not le.lost  # type: ignore[attr-defined]
    reps = await _reps(f)
    assert reps[le.replica]["leases"] == 1
    await le.release()
    assert (await _reps(f))[le.replica]["leases"] == 0


async def test_failures_eject_and_a_success_resets_the_count(fleets: Any) -> None:
    from zp_client.fleet.ledger import HealthRules

    f = fleets(health=HealthRules(consecutive_failures=3))
    lease = await f.acquire(1)
    rep = lease.replica
    f.note_failure(lease)
    f.note_failure(lease)
    f.note_success(lease)
    await lease.release()  # the success rides on the release
    assert (await _reps(f))[rep]["failures"] == 0
    lease = await f.acquire(1)
    while lease.replica != rep:  # get one on the same replica
        other = lease
        lease = await f.acquire(1)
        await other.release()
    for _ in range(3):
        f.note_failure(lease)
    reps = await _reps(f)
    assert reps[rep]["ejected"] and reps[rep]["ejections"] == 1
    await lease.release()
    dead = await f.acquire(1)
    assert dead.replica != rep
    f.note_failure(dead, connect=True)  # a connection that cannot be made ejects at once
    reps = await _reps(f)
    assert reps[dead.replica]["ejected"]
    panic = await f.acquire(1)  # every replica ejected: panic mode still routes
    assert panic.replica in (A, B)
    await dead.release()
    await panic.release()


async def test_membership_add_drain_and_limits(fleets: Any) -> None:
    p1, p2 = fleets(), fleets()
    held = [await p1.acquire(10), await p1.acquire(10)]
    waiter = asyncio.create_task(p1.acquire(8))
    await asyncio.sleep(0.05)
    await p2.add_replica(C, 10)  # another process adds a replica: the waiter goes there
    got = await asyncio.wait_for(waiter, 5)
    assert got.replica == C
    assert C in p1.replicas or C in (await _reps(p1))
    await p2.remove_replica(C)  # drains: its lease lives on, no new request goes there
    reps = await _reps(p1)
    assert reps[C]["draining"] and reps[C]["leases"] == 1
    await got.release()
    await held[0].release()
    nxt = await p1.acquire(8)
    assert nxt.replica != C and C not in await _reps(p1)  # forgotten once its last lease ended
    await p2.set_replica_limit(A, 30)
    assert (await p1.status()).extra["line_size_limit"] == 30
    big = await asyncio.wait_for(p1.acquire(20), 5)  # fits only A (10 or 8 used of 30)
    assert big.replica == A
    for le in (held[1], nxt, big):
        await le.release()


# ------------------------------------------------------------------------------ bounds and TTLs
async def test_the_prefix_index_and_sessions_are_bounded(fleets: Any, redis_url: str,
                                                         redis_prefix: str) -> None:
    f = fleets({A: 1000, B: 1000}, None, max_prefix_entries=10, max_sessions=3)
    r = redis.Redis.from_url(redis_url)
    try:
        for i in range(12):
            le = await f.acquire(1, meta=_meta(f, f"head {i}", "two", "three", session=f"s{i}"))
            await le.release()
            total = sum(r.zcard(f"{{zp:{redis_prefix}}}:px:{replica_id(u)}") for u in (A, B))
            assert total <= 10
            assert r.zcard(f"{{zp:{redis_prefix}}}:sessz") <= 3 and r.hlen(f"{{zp:{redis_prefix}}}:sess") <= 3
        st = await f.status()
        assert st.extra["prefix_index_entries"] <= 10 and st.extra["prefix_evictions"] > 0
        assert st.extra["sessions"] == 3
    finally:
        r.close()


async def test_a_replica_cache_bounds_its_prefix_blocks(fleets: Any) -> None:
    f = fleets({A: 100}, None, capacities={A: 30})
    for i in range(6):
        le = await f.acquire(1, meta=_meta(f, f"prompt {i}", tokens=16 * 12))
        await le.release()
        assert (await _reps(f))[A]["prefix_blocks"] <= 30


async def test_routing_keys_have_ttls(fleets: Any, redis_url: str, redis_prefix: str) -> None:
    f = fleets(fleet_ttl_s=600)
    le = await f.acquire(2, meta=_meta(f, "a prompt", session="s"))
    r = redis.Redis.from_url(redis_url)
    try:
        p = f"{{zp:{redis_prefix}}}"
        rid = replica_id(le.replica or "")
        for key in (":reps", ":rsum", ":sess", ":sessz", f":px:{rid}", f":pxb:{rid}"):
            ttl = r.pttl(p + key)
            assert 0 < ttl <= 600_000, (key, ttl)
        await le.release()
        # the replicas expired (fttl): the next call registers them again from the configuration
        r.delete(p + ":reps", p + ":rsum")
        again = await f.acquire(2)
        assert again.replica in (A, B)
        await again.release()
    finally:
        r.close()


async def test_a_lease_redis_lost_is_readopted_on_its_replica(fleets: Any, redis_url: str,
                                                               redis_prefix: str) -> None:
    f = fleets(lease_ttl_s=0.6, fleet_ttl_s=2)
    le = await f.acquire(7)
    _delete_keys(redis_url, redis_prefix)  # Redis lost the fleet's state (a restart without persistence)
    other = await f.acquire(1)  # registers the replicas again; the renewal re-adopts the lease
    for _ in range(100):
        reps = await _reps(f)
        if reps[le.replica or ""]["used"] >= 7:
            break
        await asyncio.sleep(0.05)
    assert reps[le.replica or ""]["used"] >= 7 and f.counters["readopted"] == 1
    await le.release()
    await other.release()
    assert (await f.status()).used == 0


# ------------------------------------------------------------------------------ round trips, failures
async def test_an_uncontended_request_costs_two_script_calls(fleets: Any, redis_url: str) -> None:
    client = redis_async.Redis.from_url(redis_url)
    calls: list[str] = []
    real = client.evalsha

    async def counting(sha: Any, *args: Any) -> Any:
        calls.append(str(sha))
        return await real(sha, *args)

    setattr(client, "evalsha", counting)  # noqa: B010 - counts the script calls
    f = fleets(url=client)
    warm = await f.acquire(1)  # first call: reads the stored policy, creates the fleet
    await warm.release()
    calls.clear()
    le = await f.acquire(3, meta=_meta(f, "system", "user turn", session="conv"))
    assert le.replica in (A, B)
    f.note_success(le)
    await le.release()
    assert len(calls) == 2  # acquire (route + admit) and release (with the success): nothing else
    await f.aclose()
    await client.aclose()


async def test_redis_down_fails_closed() -> None:
    f = RedisFleet(f"redis://127.0.0.1:{_free_port()}/0", "zptest-nowhere", [A, B], 10,
                   unavailable_timeout_s=0.3)
    with pytest.raises(BudgetUnavailable, match="unreachable"):
        await f.acquire(1)
    with pytest.raises(BudgetUnavailable):
        f.acquire_sync(1)
    await f.aclose()


def test_arguments_are_checked(redis_url: str) -> None:
    with pytest.raises(ConfigurationError, match="policy must be 'strict' or 'elastic'"):
        RedisFleet(redis_url, "zptest-x", [A], 10, policy="greedy")
    with pytest.raises(ConfigurationError, match="longest-first"):
        RedisFleet(redis_url, "zptest-x", [A], 10, longest_first_s=1.0)
    with pytest.raises(ConfigurationError, match="limit_blocks"):
        RedisFleet(redis_url, "zptest-x", [A])
    with pytest.raises(ConfigurationError, match="not one string"):
        RedisFleet(redis_url, "zptest-x", "http://a:8000/v1", 10)
    with pytest.raises(ConfigurationError, match="at least one replica"):
        RedisFleet(redis_url, "zptest-x", {}, None)
    with pytest.raises(ConfigurationError, match="fails closed"):
        RedisFleet(redis_url, "zptest-x", [A], 10, on_unavailable="fail_local")
    with pytest.raises(ConfigurationError, match="fleet_ttl_s"):
        RedisFleet(redis_url, "zptest-x", [A], 10, lease_ttl_s=30, fleet_ttl_s=60)


async def test_a_plain_budget_name_is_not_a_fleet(fleets: Any, redis_url: str, redis_prefix: str) -> None:
    from zp_client.budget.redis import RedisBudget

    plain = RedisBudget(redis_url, redis_prefix, 10, policy="strict", recovery_s=0)
    await (await plain.acquire(1)).release()
    await plain.aclose()
    with pytest.raises(ConfigurationError, match="not a fleet"):
        await fleets().acquire(1)


# ------------------------------------------------------------------------------ a real second process
_CHILD = """
import asyncio, json, sys
from zp_client.fleet.redis import RedisFleet
async def main(url, name):
    f = RedisFleet(url, name, ["http://a:8000/v1", "http://b:8000/v1"], 10, recovery_s=0)
    lease = await f.acquire(10, priority=0)
    print(json.dumps({"replica": lease.replica}), flush=True)
    await lease.release()
    await f.aclose()
asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


async def test_a_waiter_in_another_process_gets_the_freed_replica(fleets: Any, redis_url: str,
                                                                  redis_prefix: str) -> None:
    f = fleets()
    x, y = await f.acquire(10), await f.acquire(10)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, redis_url, redis_prefix], stdout=subprocess.PIPE,
                             env=env, text=True)
    try:
        for _ in range(200):  # the child's waiter is in line
            st = await f.status()
            if st.waiters:
                break
            await asyncio.sleep(0.05)
        assert st.waiters
        await y.release()
        out, _ = await asyncio.to_thread(child.communicate, timeout=30)
        assert json.loads(out.strip().splitlines()[-1])["replica"] == y.replica
    finally:
        if child.poll() is None:
            child.kill()
    await x.release()


# ------------------------------------------------------------------------------ end to end
@pytest.mark.openai_compat
@pytest.mark.slow
async def test_requests_route_through_wrap_across_two_servers(fleets: Any) -> None:
    with LoopbackServer() as s1, LoopbackServer() as s2:
        f = fleets([s1.base_url, s2.base_url], 4000)
        client = wrap(openai.AsyncOpenAI(base_url=f.base_url, api_key="x"), budget=f)
        try:
            with observe_admissions() as seen:
                replies = await asyncio.gather(*(client.chat.completions.create(
                    model="ok", max_tokens=8, messages=[{"role": "user", "content": f"q{i} " * 50}])
                    for i in range(8)))
            assert all(r.choices[0].message.content for r in replies)
            assert s1.llm_requests() and s2.llm_requests()
            assert len(s1.llm_requests()) + len(s2.llm_requests()) == 8
            assert {i.replica for i in seen} == {s1.base_url, s2.base_url}
            models = await client.models.list()  # not admitted: sent to a replica
            assert [m.id for m in models.data]
            st = await f.status()
            assert set(st.extra["replicas"]) == {s1.base_url, s2.base_url}
            assert st.leases == 0 and st.limit == 8000
            # a conversation stays on its replica
            msgs: list[Any] = [{"role": "system", "content": "You are an agent. " * 200}]
            homes = []
            for turn in range(3):
                msgs.append({"role": "user", "content": f"step {turn} " * 30})
                with observe_admissions() as seen:
                    r = await client.chat.completions.create(model="ok", max_tokens=8, messages=msgs)
                homes.append(seen[0].replica)
                msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            assert len(set(homes)) == 1, homes
        finally:
            await client.close()


@pytest.mark.openai_compat
@pytest.mark.slow
async def test_a_dead_replica_is_ejected_and_requests_move(fleets: Any) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    with LoopbackServer() as live:
        f = fleets([dead, live.base_url], 4000)
        client = wrap(openai.AsyncOpenAI(base_url=f.base_url, api_key="x"), budget=f)
        try:
            replies = await asyncio.gather(*(client.chat.completions.create(
                model="ok", max_tokens=8, messages=[{"role": "user", "content": f"q{i}"}]) for i in range(6)))
            assert len(replies) == 6 and len(live.llm_requests()) == 6
            st = await f.status()
            reps = st.extra["replicas"]
            assert reps[dead]["ejected"] and not reps[live.base_url]["ejected"]
            assert st.leases == 0 and f.moves >= 1
        finally:
            await client.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_stream_cut_before_its_first_byte_moves_and_avoids_that_replica(fleets: Any) -> None:
    from tests.fleet.test_fleet import _ResetBeforeFirstByte

    with _ResetBeforeFirstByte() as bad, LoopbackServer() as good:
        f = fleets([bad.base_url, good.base_url], 4000)
        client = wrap(openai.AsyncOpenAI(base_url=f.base_url, api_key="x"), budget=f)
        # load the good replica, so least-load sends the first request to the bad one
        held = [await f.acquire(1000), await f.acquire(1000)]
        for le in [le for le in held if le.replica != good.base_url]:
            await le.release()
        try:
            for i in range(3):
                stream = await client.chat.completions.create(
                    model="ok", max_tokens=8, stream=True, messages=[{"role": "user", "content": f"q{i}"}])
                assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            # each request failed at most once on the bad replica, then went to the good one
            assert 1 <= bad.calls <= 3 and f.moves == bad.calls
        finally:
            for le in held:
                await le.release()
            await client.close()
        assert (await f.status()).leases == 0
