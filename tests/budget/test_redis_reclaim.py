"""A late renewal of a live process (docs/redis.md, "A late renewal of a live process"; issue 33).

A held lease whose expiry came is reclaimed only one TTL after the *later* of its last renewal and its
process's last script call of any kind, and at most one TTL after the expiry its last renewal gave it.
When Redis answers slowly (a queue of scripts: a herd of acquires on a loaded machine) a renewal can
land after its lease's TTL while the same process's other calls keep reaching Redis: the process is
alive, and reclaiming its lease would grant its blocks to someone else while it still uses them (the
last over-admission of ``test_redis_multiprocess.py::test_eight_processes_never_exceed_the_limit``).

1. A hypothesis state machine holds the Lua (``heard``, ``reap_late`` in common.lua) to the ledger
   (:meth:`~zp_client.budget.ledger.Ledger.heard`, :meth:`~zp_client.budget.ledger.Ledger.expire`) for two
   processes: acquires, claims, renewals, calls of other kinds, releases and the passing of time (moved
   in Redis by shifting every expiry and liveness score back, not waited for), under strict and elastic,
   and checks after every step that the leases agree and that no lease outlives its bound.
2. Through a proxy that delays one process's every byte, its renewals land after the TTL while its polls
   reach Redis: its lease is kept and nobody else is granted its blocks (before: reclaimed and granted).
3. The cap and the dead-process bound, on the raw scripts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from tests._redis_keys import delete_keys
from zp_client import RedisBudget
from zp_client.budget.elastic import ElasticPolicy
from zp_client.budget.ledger import Ledger

pytestmark = pytest.mark.redis

LIMIT = 12
BS = 4
U_MS = 60_000  # one step of time; every distance in the machine is a multiple of it, +- what runs take
TTL_MS = 138_000  # 2.3 units: no expiry, extension or cap ever falls within 0.3 units (18 s) of a step
FAR_MS = 900_000_000  # waiter TTL and claim window: nothing but leases expires in the machine
OWNERS = ("proc-a-000000000", "proc-b-000000000")


def _make_machine(redis_url: str, names: list[str], policy: str) -> type:
    counter = itertools.count()
    ttl, far = TTL_MS / 1000, FAR_MS / 1000

    class ReclaimMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            name = f"{names[0]}-r{next(counter)}"
            names.append(name)
            self.budget = RedisBudget(redis_url, name, LIMIT, BS, policy=policy, recovery_s=0,
                                      starvation_bound_s=1e9)
            self.face = self.budget._sync_face
            self.core = self.budget._core
            self.model = Ledger(LIMIT, policy=ElasticPolicy(BS) if policy == "elastic" else None,
                                starvation_bound_s=1e9)
            self.r = redis.Redis.from_url(redis_url)
            self.labels = itertools.count()
            self.now = 0.0  # the model's clock (s); Redis's moves with it (tick), plus what runs take
            self.args: dict[str, list[Any]] = {}
            self.owner: dict[str, str] = {}
            self.renewed: dict[str, float] = {}  # held lease -> its last claim or renewal (model clock)
            self.called: dict[str, float] = {}  # process -> its last call (model clock)
            self.eval("init", self.core.init_args(0))  # the budget exists before any rule runs
            self.epoch = self.r.hget(f"{self.core.prefix}:meta", "epoch")

        def teardown(self) -> None:
            self.r.close()
            self.budget.close_sync()

        # ----------------------------------------------------------------- helpers
        def eval(self, script: str, args: list[Any]) -> Any:
            return self.face.eval(script, args)

        def call(self, proc: str) -> None:
            """The model's side of a script call by ``proc``: heard first, then the reap."""
            self.model.heard(proc, self.now)
            self.called[proc] = self.now
            self.model.expire(self.now)

        def grant(self, caller: str | None) -> None:
            for g in self.model.grant(self.now):
                if self.owner[g] == caller:
                    self.model.claim(g, self.now, ttl)
                    self.renewed[g] = self.now

        def check(self) -> None:
            want = self.model.status(self.now)
            got = self.core.status_from(self.eval("status", []))
            assert (got.used, got.held, got.leases, got.waiters) == (
                want.used, want.held, want.leases, want.waiters), (got, want)
            assert got.extra["bound_sum"] == want.extra["bound_sum"] <= LIMIT
            raw = self.r.hgetall(f"{self.core.prefix}:leases")
            leases = {k.decode(): bool(json.loads(v).get("c")) for k, v in raw.items()}
            assert leases == {lid: rec.pending for lid, rec in self.model.leases.items()}

        def check_bound(self) -> None:
            """After a reaping call: no held lease outlives one TTL after the later of its renewal and
            its process's last call, nor one more TTL after the expiry its renewal gave it."""
            for lid, rec in self.model.leases.items():
                if rec.pending:
                    continue
                last = max(self.renewed[lid], self.called[self.owner[lid]])
                assert self.now < min(last + ttl, self.renewed[lid] + 2 * ttl), (lid, self.now)

        def pending(self) -> list[str]:
            return sorted(lid for lid, rec in self.model.leases.items() if rec.pending)

        def held(self, proc: str | None = None) -> list[str]:
            return sorted(lid for lid, rec in self.model.leases.items()
                          if not rec.pending and (proc is None or self.owner[lid] == proc))

        def waiting(self) -> list[str]:
            return sorted(w.id for w in self.model.line())

        # ----------------------------------------------------------------- rules
        @rule(proc=st.sampled_from(OWNERS), blocks=st.integers(1, LIMIT // 2), prio=st.integers(0, 1))
        def acquire(self, proc: str, blocks: int, prio: int) -> None:
            rid = f"req-{next(self.labels):06d}-{proc[:6]}-reclaim"
            self.args[rid] = [rid, blocks, blocks, prio, -1, TTL_MS, "", proc, FAR_MS, "", FAR_MS, FAR_MS]
            self.owner[rid] = proc
            r = self.eval("acquire", self.args[rid])
            self.args[rid][4] = int(r[1])
            self.epoch = r[3]  # a renewal of a lease Redis no longer has reports it lost (same epoch)
            self.call(proc)
            self.model.enqueue(rid, blocks, blocks, prio, self.now, claim_s=far, owner=proc)
            self.grant(proc)
            assert r[0].decode() == ("G" if rid in self.model.leases else "W"), (rid, r[0])
            self.check()
            self.check_bound()

        @precondition(lambda self: self.pending())
        @rule(data=st.data())
        def claim(self, data: st.DataObject) -> None:
            """The wake-up's idempotent acquire claims a pending grant (a full TTL from now)."""
            rid = data.draw(st.sampled_from(self.pending()))
            proc = self.owner[rid]
            assert self.eval("acquire", self.args[rid])[0] == b"G"
            self.call(proc)
            assert self.model.claim(rid, self.now, ttl)
            self.renewed[rid] = self.now
            self.check()
            self.check_bound()

        @rule(proc=st.sampled_from(OWNERS), data=st.data())
        def renew(self, proc: str, data: st.DataObject) -> None:
            """A renewal round of ``proc`` for some of the leases it holds (a subset: a batch that has
            not landed yet, or a lease it stopped renewing)."""
            mine = [lid for lid in sorted(self.renewed) if self.owner[lid] == proc]
            ids = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
            args: list[Any] = [proc, TTL_MS]
            for lid in ids:
                a = self.args[lid]
                args += [lid, self.epoch, a[1], a[2], a[3], a[4], ""]
            r = self.eval("renew", args)
            self.call(proc)
            for lid, code in zip(ids, r[1:], strict=True):
                alive = lid in self.model.leases
                assert int(code) == (1 if alive else 0), (lid, code)
                if alive:
                    self.model.renew(lid, self.now, ttl)
                    self.renewed[lid] = self.now
                else:
                    self.renewed.pop(lid)  # lost: its holder drops it
            self.grant(proc)
            self.check()
            self.check_bound()

        @rule(proc=st.sampled_from(OWNERS))
        def other_call(self, proc: str) -> None:
            """A call of another kind from ``proc`` (here a release of an id it does not hold, which
            reaps and runs a grant pass like any call): proof that the process lives."""
            self.eval("release", [f"nothing-{proc}", proc])
            self.call(proc)
            self.grant(proc)
            self.check()
            self.check_bound()

        @rule(units=st.integers(1, 2))
        def tick(self, units: int) -> None:
            """Time passes (no call): every expiry and liveness time in Redis moves back by as much."""
            dt = units * U_MS
            for z in ("lexp", "wexp", "pl"):
                key = f"{self.core.prefix}:{z}"
                items = self.r.zrange(key, 0, -1, withscores=True)
                if items:
                    self.r.zadd(key, {m: s - dt for m, s in items}, xx=True)
            self.now += dt / 1000

        @precondition(lambda self: self.model.leases or self.waiting())
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted([*self.model.leases, *self.waiting()])))
            proc = self.owner[rid]
            self.eval("release", [rid, proc])
            if not self.model.release(rid, self.now):
                assert self.model.cancel(rid)
            self.renewed.pop(rid, None)
            self.call(proc)
            self.grant(proc)
            self.check()
            self.check_bound()

    return ReclaimMachine


@pytest.mark.parametrize("policy", ["strict", "elastic"])
def test_late_renewals_of_live_processes_conform_to_the_ledger(redis_url: str, names: list[str],
                                                               policy: str) -> None:
    machine = _make_machine(redis_url, names, policy)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["strict", "elastic"])
def test_late_renewals_conform_long(redis_url: str, names: list[str], policy: str) -> None:
    machine = _make_machine(redis_url, names, policy)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=250, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


# --------------------------------------------------------------------------- the faces, the real clock
@pytest.fixture
def cleanup(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield redis_prefix
    delete_keys(redis_url, redis_prefix)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only


@pytest.mark.anyio
@pytest.mark.faults
async def test_a_lease_whose_renewal_lands_late_is_kept_while_its_process_talks_to_redis(
    redis_url: str, cleanup: str
) -> None:
    """A process's renewals reach Redis 1.3 s after they were sent (queued behind scripts), more than the
    1 s lease TTL, while its other calls (its waiter's polls every 0.3 s) reach it at once. Its lease
    is kept (the first renewal lands 1.3-1.7 s after the grant, within one more TTL) and nobody is
    granted its blocks: not another process's waiter, not its own. On the commit before, the first
    reap after the TTL reclaimed it and granted the blocks while the holder still used them (its
    renewal then reported the lease lost)."""
    delay, ttl = 1.3, 1.0
    lost: list[str | None] = []
    far = RedisBudget(redis_url, cleanup, 4, policy="strict", recovery_s=0, lease_ttl_s=ttl,
                      poll_interval_s=0.3,
                      on_event=lambda ev: lost.append(ev.lease_id) if ev.kind == "lease_lost" else None)
    near = RedisBudget(redis_url, cleanup, 4, policy="strict", recovery_s=0, lease_ttl_s=ttl,
                       poll_interval_s=0.3)
    try:
        warm = await far.acquire(1)  # the face and its keeper run before the test's lease
        await warm.release()
        face = far._side
        assert face is not None
        real_eval = face.eval

        async def late_renewals(script: str, args: Any, **kw: Any) -> Any:
            if script == "renew":  # a renewal queued behind the scripts of a herd
                await asyncio.sleep(delay)
            return await real_eval(script, args, **kw)

        face.eval = late_renewals  # type: ignore[method-assign]
        lease = await far.acquire(4)
        granted = time.monotonic()
        own = asyncio.ensure_future(far.acquire(1))  # polls every 0.3 s: its process talks to Redis
        other = asyncio.ensure_future(near.acquire(1))  # reaps every 0.3 s
        while time.monotonic() - granted < 4.0:  # four TTLs: renewals land 1.3 s apart throughout
            await asyncio.sleep(0.01)
            assert not own.done() and not other.done(), "the held lease's blocks were granted again"
            assert not lease.lost and not lost
        st = await near.status()
        assert st.extra["deferred_reclaims"] >= 1  # it was due, and kept
        await lease.release()
        for t in (own, other):
            got = await asyncio.wait_for(t, 10)
            await got.release()
    finally:
        await far.aclose()
        await near.aclose()


def _raw(budget: RedisBudget, script: str, args: list[Any]) -> Any:
    return budget._sync_face.eval(script, args)


def _acquire_args(rid: str, blocks: int, owner: str, ttl_ms: int) -> list[Any]:
    return [rid, blocks, blocks, 0, -1, ttl_ms, "", owner, FAR_MS, "", FAR_MS, FAR_MS]


def test_a_live_process_that_stops_renewing_loses_its_lease_one_ttl_late(redis_url: str,
                                                                         cleanup: str) -> None:
    """The extension is capped: a process that keeps calling but never renews a lease loses it one TTL
    after the expiry its last renewal gave it (here its grant: TTL 0.6 s, so by 1.2 s), never later."""
    b = RedisBudget(redis_url, cleanup, 4, policy="strict", recovery_s=0)
    try:
        _raw(b, "init", b._core.init_args(0))
        assert _raw(b, "acquire", _acquire_args("held-lease-000000000", 4, "alive", 600))[0] == b"G"
        t0 = time.monotonic()
        kept_after_ttl = False
        while _raw(b, "status", [])[4] == 1:  # live leases
            _raw(b, "release", ["nothing", "alive"])  # its process calls (a reap each)
            if time.monotonic() - t0 > 0.8:
                kept_after_ttl = True
            assert time.monotonic() - t0 < 1.2 + 1.0, "kept past the cap"
            time.sleep(0.02)
        took = time.monotonic() - t0
        assert kept_after_ttl, f"reclaimed after {took:.2f} s although its process called"
        assert took < 1.2 + 1.0
        print(f"a lease never renewed, its process calling every 20 ms: reclaimed {took:.2f} s after its "
              "grant (TTL 0.6 s, cap 1.2 s)")
    finally:
        b.close_sync()


def test_a_dead_process_lease_is_reclaimed_one_ttl_after_its_last_call(redis_url: str, cleanup: str) -> None:
    """The dead-process bound: a process heard from last at its grant (then silent, as the dead are) gets
    no extension, however late; another process's calls reclaim its lease one TTL after its grant."""
    b = RedisBudget(redis_url, cleanup, 4, policy="strict", recovery_s=0)
    r = redis.Redis.from_url(redis_url)
    try:
        _raw(b, "init", b._core.init_args(0))
        assert _raw(b, "acquire", _acquire_args("dead-lease-000000000", 4, "dead", 600))[0] == b"G"
        t0 = time.monotonic()
        assert _raw(b, "acquire", _acquire_args("next-in-line-0000000", 1, "other", 600))[0] == b"W"
        while _raw(b, "status", [])[4] != 1 or r.hexists(f"{b._core.prefix}:leases", "dead-lease-000000000"):
            _raw(b, "release", ["nothing", "other"])  # only the other process calls
            assert time.monotonic() - t0 < 0.6 + 1.0, "a dead process's lease outlived its TTL"
            time.sleep(0.02)
        assert time.monotonic() - t0 >= 0.5
        assert _raw(b, "status", [])[2] == 1  # the blocks went to the next in line
        assert int(r.hget(f"{b._core.prefix}:meta", "dfr") or 0) == 0
    finally:
        r.close()
        b.close_sync()
