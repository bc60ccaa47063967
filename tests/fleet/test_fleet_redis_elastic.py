"""RedisFleet under the elastic policy, checked against the sans-I/O FleetLedger (the model).

A hypothesis state machine drives random acquire (elastic metadata, and routing: a conversation's prefix
keys and a session) / progress (held, tokens, first token, re-forecast) / release / cancel sequences
against a RedisFleet of two replicas of different limits and a :class:`~zp_client.fleet.ledger.FleetLedger`
whose replicas run :class:`~zp_client.budget.elastic.ElasticPolicy`. After every step the two must agree
exactly: which requests hold a lease, on which replica, each replica's projected peak (``used``), held and
the line. So the Lua port of placement (session, then the longest prefix match in the index with its LRU
eviction, then the least projected load; the starving waiter's hold on one replica) and of the projected
peak per replica is checked against the Python one. The strict fleet's placement is the same code with
the strict rule (tests/fleet/test_fleet_redis.py).

Hand-made cases: an elastic fleet admits on a replica what its sum of bounds would refuse (and the strict
one does not); a starving waiter holds one replica while the others keep admitting (a line that stopped
at the barrier would not); a lease Redis lost is re-adopted on its replica with its metadata.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests._elastic_strategies import PROGRESS, RESERVES, SPREAD_META
from tests._redis_keys import delete_keys
from zp_client.budget.base import Lease
from zp_client.budget.elastic import ElasticPolicy
from zp_client.fleet.ledger import FleetLedger
from zp_client.fleet.redis import RedisFleet

pytestmark = pytest.mark.redis

A, B = "http://a:8000/v1", "http://b:8000/v1"  # URL order: ties go to A in both
LIMITS = {A: 24, B: 16}
BS = 4
NO_BACKFILL = 0.0  # a waiter that fits nowhere holds a replica at once
FULL_BACKFILL = 1e9  # never


# Conversations of at most 8 messages: both fleets index every key (FleetLedger records the first 2 and the
# last 6, RedisFleet the first 8 and the last 24).
_CONVERSATIONS = [("sys", "a"), ("sys", "a", "b"), ("sys", "a", "b", "c"), ("sys", "x"), ("other",)]
_meta = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": st.integers(0, 14 * BS),
        "forecast_tokens": st.integers(0, 14 * BS),
        "streaming": st.sampled_from([True, True, False]),
        "prefix_key": st.sampled_from(["A", "B"]),
        "prefix_blocks": st.integers(0, 4),
        "first_token": st.booleans(),
    },
)
_progress, _reserves, _spread_meta = PROGRESS, RESERVES, SPREAD_META


def _make_machine(redis_url: str, names: list[str], starvation: float) -> type:
    counter = itertools.count()

    class FleetMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.labels = itertools.count()
            self.tasks: dict[str, asyncio.Task[Lease]] = {}
            self.leases: dict[str, Lease] = {}

        @initialize(reserves=_reserves)
        def make(self, reserves: tuple[float, float, float]) -> None:
            # The reserves (drawn, 0 included) apply per replica, over its own leases, in both.
            z, k, u = reserves
            self.model = FleetLedger(LIMITS, lambda: ElasticPolicy(BS, reserve_z=z, reserve_k=k,
                                                                   urgent_reserve=u),
                                     starvation_bound_s=starvation)
            name = f"{names[0]}-m{next(counter)}"
            names.append(name)
            self.fleet = RedisFleet(redis_url, name, LIMITS, None, BS, recovery_s=0,
                                    starvation_bound_s=starvation, held_report_blocks=1,
                                    reserve_z=z, reserve_k=k, urgent_reserve=u)

        def run(self, coro: Any) -> Any:
            return self.loop.run_until_complete(coro)

        def settle(self) -> None:
            want = self.model.status(0.0, block_size=BS)
            want_reps = {u: (r["used"], r["leases"]) for u, r in want.extra["replicas"].items()}
            got = None
            # Bounded wait for liveness only: reports in flight must land. A wrong grant never heals.
            for _ in range(300):
                self.run(self.fleet.flush())
                got = self.run(self.fleet.status())
                got_reps = {u: (r["used"], r["leases"]) for u, r in got.extra["replicas"].items()}
                if (got.used, got.held, got.leases, got.waiters, got_reps) == (
                        want.used, want.held, want.leases, want.waiters, want_reps):
                    break
                self.run(asyncio.sleep(0.01))
            assert got is not None
            assert (got.limit, got.used, got.held, got.leases) == (
                want.limit, want.used, want.held, want.leases), (got, want)
            assert got_reps == want_reps
            assert got.waiters == want.waiters
            granted = [lbl for lbl in self.model.leases if lbl not in self.leases]
            if granted:
                _, pending = self.run(asyncio.wait([self.tasks[lbl] for lbl in granted], timeout=20))
                assert not pending, f"Redis did not hand out the grants the model made: {granted}"
            for lbl in granted:
                lease = self.tasks.pop(lbl).result()
                assert lease.ticket == self.model.leases[lbl].ticket
                assert getattr(lease, "replica", None) == self.model.replica_of(lbl), lbl
                self.leases[lbl] = lease
            for lbl, task in self.tasks.items():
                assert not task.done(), f"{lbl} finished ({task!r}) but the model says it waits"

        @rule(blocks=st.integers(1, 14), held_frac=st.integers(0, 4), priority=st.integers(0, 2),
              meta=st.one_of(_meta, _spread_meta), turns=st.sampled_from(_CONVERSATIONS),
              session=st.sampled_from([None, None, "s1", "s2"]))
        def acquire(self, blocks: int, held_frac: int, priority: int, meta: dict[str, Any],
                    turns: tuple[str, ...], session: str | None) -> None:
            held = blocks * held_frac // 4
            lbl = f"r{next(self.labels)}"
            body = {"model": "m", "messages": [{"role": "user", "content": t * 40} for t in turns]}
            full = {**meta, **self.fleet.routing_meta(body, blocks * BS, session)}
            self.model.enqueue(lbl, blocks, held, priority, 0.0, meta=full)
            self.tasks[lbl] = self.loop.create_task(
                self.fleet.acquire(blocks, held=held, priority=priority, meta=full))
            self.run(self._until_registered(lbl))
            self.model.grant(0.0)
            self.settle()

        async def _until_registered(self, lbl: str) -> None:
            for _ in range(2000):
                st_ = await self.fleet.status()
                n = st_.leases + sum(c.waiters for c in st_.waiters.values())
                if n >= len(self.leases) + len(self.tasks) or self.tasks[lbl].done():
                    return
                await asyncio.sleep(0.001)
            raise AssertionError("acquire never reached Redis")

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data(), held=st.integers(-1, 16), fields=_progress)
        def progress(self, data: st.DataObject, held: int, fields: dict[str, Any]) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            self.leases[lbl].report_progress(held, **fields)
            self.model.report_held(lbl, held)
            if fields:
                self.model.update_meta(lbl, **fields)
            self.model.grant(0.0)
            self.settle()

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            self.run(self.leases.pop(lbl).release())
            self.model.release(lbl, 0.0)
            self.model.grant(0.0)
            self.settle()

        @precondition(lambda self: bool(self.tasks))
        @rule(data=st.data())
        def cancel(self, data: st.DataObject) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.tasks)))
            task = self.tasks.pop(lbl)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                self.run(task)
            assert self.model.cancel(lbl)
            self.model.grant(0.0)
            self.settle()

        def teardown(self) -> None:
            if not hasattr(self, "fleet"):  # failed before make
                self.loop.close()
                return
            try:
                for task in self.tasks.values():
                    task.cancel()
                for task in self.tasks.values():
                    try:
                        lease = self.run(task)
                    except asyncio.CancelledError:
                        continue
                    self.run(lease.release())
                for lease in self.leases.values():
                    self.run(lease.release())
                st_ = self.run(self.fleet.status())
                assert st_.leases == 0 and not st_.waiters, f"leaked: {st_}"
                self.run(self.fleet.aclose())
            finally:
                self.loop.close()

    return FleetMachine


@pytest.mark.parametrize("starvation", [NO_BACKFILL, FULL_BACKFILL], ids=["hold-at-once", "backfill"])
@pytest.mark.slow  # a hypothesis state machine: make test-fast skips it, make test runs it
def test_elastic_redis_fleet_conforms_to_the_fleet_ledger(
    starvation: float, redis_url: str, redis_prefix: str
) -> None:
    # The starvation bound is either 0 or far beyond the run, so the model's clock and Redis's never disagree.
    names = [redis_prefix]
    try:
        machine = _make_machine(redis_url, names, starvation)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=40, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ))
    finally:
        delete_keys(redis_url, *names[1:])


# --------------------------------------------------------------------------------------------- hand-made
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.fixture
def fleets(redis_url: str, redis_prefix: str) -> Iterator[Any]:
    names: list[str] = []
    made: list[RedisFleet] = []
    counter = itertools.count()

    def make(policy: str = "elastic", limits: dict[str, int] | None = None, **kw: Any) -> RedisFleet:
        name = kw.pop("name", None) or f"{redis_prefix}-{next(counter)}"
        names.append(name)
        kw.setdefault("recovery_s", 0)
        f = RedisFleet(redis_url, name, limits or {A: 20, B: 20}, None, 16, policy=policy, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close_sync()
    delete_keys(redis_url, *names)


# A streamed request with a 64-token prompt (4 blocks, held from the start) forecast to write 32 tokens
# (2 blocks), bounded at 12 blocks: it projects 6 blocks at its peak, while strict counts its 12.
SMALL = {"prompt_tokens": 64, "forecast_tokens": 32, "streaming": True}


@pytest.mark.anyio
async def test_elastic_admits_on_a_replica_what_its_sum_of_bounds_refuses(fleets: Any) -> None:
    el = fleets(limits={A: 20})
    st = fleets("strict", limits={A: 20})
    e = [await asyncio.wait_for(el.acquire(12, held=4, meta=SMALL), 5) for _ in range(3)]  # 3 x 6 = 18 <= 20
    assert {le.replica for le in e} == {A}
    status = await el.status()
    assert status.policy == "elastic" and status.used == 18
    assert status.extra["replicas"][A]["used"] == 18 and status.extra["replicas"][A]["bound_sum"] == 36
    s1 = await st.acquire(12, held=4, meta=SMALL)
    second = asyncio.create_task(st.acquire(12, held=4, meta=SMALL))  # 12 + 12 > 20: waits under strict
    await asyncio.sleep(0.2)
    assert not second.done()
    await s1.release()
    await (await asyncio.wait_for(second, 5)).release()
    for le in e:
        await le.release()
    assert (await el.status()).used == 0


@pytest.mark.anyio
async def test_a_starving_waiter_holds_one_replica_while_the_others_keep_admitting(fleets: Any) -> None:
    f = fleets("strict", starvation_bound_s=0.0)
    a = await f.acquire(15)
    b = await f.acquire(10)
    assert {a.replica, b.replica} == {A, B}
    big = asyncio.create_task(f.acquire(18))  # fits nowhere now; starving at once: holds the replica
    await asyncio.sleep(0.2)  # least short of room for it (B's 10 + 18 - 20 = 8 beats A's 13)
    assert not big.done()
    small = await asyncio.wait_for(f.acquire(4), 5)  # a line stopped at a barrier would keep it waiting
    assert small.replica == a.replica  # the held replica takes nobody behind the starving waiter
    await b.release()
    got = await asyncio.wait_for(big, 5)
    assert got.replica == b.replica
    for le in (a, small, got):
        await le.release()


@pytest.mark.anyio
async def test_a_lease_redis_lost_is_readopted_on_its_replica_with_its_metadata(
    fleets: Any, redis_url: str
) -> None:
    f = fleets(lease_ttl_s=0.6, fleet_ttl_s=2)
    le = await f.acquire(12, held=4, meta=SMALL)
    assert (await f.status()).extra["replicas"][le.replica]["used"] == 6
    delete_keys(redis_url, f.name)  # Redis lost the fleet's state (a restart without persistence)
    other = await f.acquire(1)  # registers the replicas again; the renewal re-adopts the lease
    for _ in range(100):
        reps = (await f.status()).extra["replicas"]
        if f.counters["readopted"] == 1:
            break
        await asyncio.sleep(0.05)
    assert f.counters["readopted"] == 1
    # on its replica again, projected from its metadata (6 blocks), not reserved at its bound (12)
    same = int(other.replica == le.replica)
    assert reps[le.replica]["leases"] == 1 + same and reps[le.replica]["used"] == 6 + same, reps
    await le.release()
    await other.release()
    assert (await f.status()).used == 0
