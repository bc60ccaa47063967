"""The grant -> claim handshake (docs/redis.md, "Grants are claimed"): Lua against the Python ledger.

A grant pass's grant to another process's waiter is *pending* (reserved in the bound sum, nobody's held
lease) until that process claims it with a call of its own (acquire repeated after the wake-up, poll, a
renewal); at the end of its claim window it goes back to the pool and the room is granted to the next
waiter. A hypothesis state machine drives the scripts directly for two processes (raw acquire / poll /
renew / release calls with two owners, as their faces would send them) and the sans-I/O
:class:`~zp_client.budget.ledger.Ledger` (``claim_s``, :meth:`~zp_client.budget.ledger.Ledger.claim`,
:meth:`~zp_client.budget.ledger.Ledger.expire`'s ``unclaimed``) with the same steps: claims, claim
timeouts (the claim window's end is forced in Redis by moving the pending grants' expiry to the past, not
waited for on the real clock), late claims that enqueue again with the same ticket, and re-grants. After
every step the leases (held or pending), the line and the status counters must agree exactly.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from zp_client.budget.base import Ticket
from zp_client.budget.elastic import ElasticPolicy
from zp_client.budget.ledger import Ledger
from zp_client.budget.redis import RedisBudget

pytestmark = pytest.mark.redis

LIMIT = 12
BS = 4
LONG_MS = 600_000  # lease TTL, waiter TTL and claim window in Redis: nothing expires on the real clock
CLAIM_S = 1.0  # the model's claim window (the model's clock only moves when a rule ends the window)
OWNERS = ("proc-a-000000000", "proc-b-000000000")


def _make_machine(redis_url: str, names: list[str], policy: str, starvation: float) -> type:
    counter = itertools.count()

    class ClaimMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            name = f"{names[0]}-c{next(counter)}"
            names.append(name)
            self.budget = RedisBudget(redis_url, name, LIMIT, BS, policy=policy, recovery_s=0,
                                      starvation_bound_s=starvation)
            self.face = self.budget._sync_face
            self.core = self.budget._core
            self.model = Ledger(LIMIT, policy=ElasticPolicy(BS) if policy == "elastic" else None,
                                starvation_bound_s=starvation)
            self.r = redis.Redis.from_url(redis_url)
            self.labels = itertools.count()
            self.now = 0.0  # the model's clock: moves only when a claim window is ended
            self.args: dict[str, list[Any]] = {}  # request id -> its acquire arguments (its process's)
            self.owner: dict[str, str] = {}
            self.unclaimed: set[str] = set()  # grants returned to the pool whose process has not looked

        def teardown(self) -> None:
            self.r.close()
            self.budget.close_sync()

        # ----------------------------------------------------------------- helpers
        def eval(self, script: str, args: list[Any]) -> Any:
            return self.face.eval(script, args)

        def _enqueue_model(self, rid: str, bound: int, prio: int, ticket: Ticket | None) -> Ticket:
            return self.model.enqueue(rid, bound, bound, prio, self.now, ticket, claim_s=CLAIM_S)

        def _acquire(self, rid: str) -> str:
            """The raw acquire (a new request, a claim or an enqueue-again); returns 'G' or 'W'."""
            r = self.eval("acquire", self.args[rid])
            code = r[0].decode()
            self.args[rid][4] = int(r[1])  # the ticket order: a re-enqueue keeps its place (the faces do)
            return code

        def grant(self, caller: str | None) -> None:
            """The model's grant pass in a script called by ``caller`` (None: poll, which names no
            owner): the caller's own waiters' grants are claimed as they are made (its call proves it
            lives), other processes' are pending."""
            for g in self.model.grant(self.now):
                if self.owner[g] == caller:
                    self.model.claim(g, self.now, None)

        def check(self) -> None:
            want = self.model.status(self.now)
            got = self.core.status_from(self.eval("status", []))
            assert (got.used, got.held, got.leases, got.waiters) == (
                want.used, want.held, want.leases, want.waiters), (got, want)
            assert got.extra["bound_sum"] == want.extra["bound_sum"]
            assert (got.extra["pending_grants"], got.extra["pending_blocks"]) == (
                self.model.pending, self.model.pending_blocks)
            raw = self.r.hgetall(f"{self.core.prefix}:leases")
            leases = {k.decode(): bool(json.loads(v).get("c")) for k, v in raw.items()}
            assert leases == {lid: rec.pending for lid, rec in self.model.leases.items()}

        def pending(self) -> list[str]:
            return sorted(lid for lid, rec in self.model.leases.items() if rec.pending)

        def held(self) -> list[str]:
            return sorted(lid for lid, rec in self.model.leases.items() if not rec.pending)

        def waiting(self) -> list[str]:
            return sorted(w.id for w in self.model.line())

        # ----------------------------------------------------------------- rules
        @rule(proc=st.sampled_from(OWNERS), blocks=st.integers(1, LIMIT), prio=st.integers(0, 1))
        def acquire(self, proc: str, blocks: int, prio: int) -> None:
            rid = f"req-{next(self.labels):06d}-{proc[:6]}-claimtest"
            self.args[rid] = [rid, blocks, blocks, prio, -1, LONG_MS, "", proc, LONG_MS, "", LONG_MS, LONG_MS]
            self.owner[rid] = proc
            code = self._acquire(rid)
            self._enqueue_model(rid, blocks, prio, None)
            self.grant(proc)  # its own call: granted to it is claimed by it
            assert code == ("G" if rid in self.model.leases else "W"), (rid, code)
            self.check()

        @precondition(lambda self: self.pending())
        @rule(data=st.data())
        def claim(self, data: st.DataObject) -> None:
            """The wake-up's idempotent acquire claims a pending grant."""
            rid = data.draw(st.sampled_from(self.pending()))
            assert self._acquire(rid) == "G"
            assert self.model.claim(rid, self.now, None)
            self.check()

        @precondition(lambda self: self.pending() or self.waiting())
        @rule(proc=st.sampled_from(OWNERS))
        def poll(self, proc: str) -> None:
            """A process's poll (its waiters and the grants it was told of): each 'G' is claimed."""
            ids = [i for i in [*self.waiting(), *self.pending()] if self.owner[i] == proc]
            if not ids:
                return
            r = self.eval("poll", [LONG_MS, proc, *ids])
            self.grant(None)
            for rid, state in zip(ids, r[1:], strict=True):
                assert state.decode() == ("G" if rid in self.model.leases else "W"), (rid, state)
                self.model.claim(rid, self.now, None)
            self.check()

        @precondition(lambda self: self.pending())
        @rule(data=st.data())
        def renew_claims(self, data: st.DataObject) -> None:
            """A renewal of a grant its holder was told of (its claim reply lost) claims it."""
            rid = data.draw(st.sampled_from(self.pending()))
            a = self.args[rid]
            r = self.eval("renew", [self.owner[rid], LONG_MS, rid, self.core.epoch or "", a[1], a[2], a[3],
                                    a[4], ""])
            assert int(r[1]) == 1
            self.model.claim(rid, self.now, None)
            self.grant(self.owner[rid])
            self.check()

        @precondition(lambda self: self.pending())
        @rule()
        def claim_window_ends(self) -> None:
            """Nobody claimed: every pending grant goes back to the pool, and the room to the next
            waiters (re-grant)."""
            for rid in self.pending():
                self.r.zadd(f"{self.core.prefix}:lexp", {rid: 1}, xx=True)
            # any reaping call: a release of an unknown id (reap, then a grant pass)
            self.eval("release", ["nobody-holds-this-id", OWNERS[0]])
            self.now += CLAIM_S
            gone = self.model.expire(self.now)
            assert not gone.leases and not gone.waiters
            self.unclaimed |= set(gone.unclaimed)
            self.grant(OWNERS[0])
            self.check()

        @precondition(lambda self: self.unclaimed)
        @rule(data=st.data())
        def late_claim(self, data: st.DataObject) -> None:
            """A live process late past the claim window: its claim finds nothing and enqueues the
            request again with the same ticket (it may be granted at once, to itself: claimed)."""
            rid = data.draw(st.sampled_from(sorted(self.unclaimed)))
            self.unclaimed.discard(rid)
            a = self.args[rid]
            order = a[4]
            code = self._acquire(rid)
            self._enqueue_model(rid, a[1], a[3], Ticket(a[3], order))
            self.grant(self.owner[rid])
            assert code == ("G" if rid in self.model.leases else "W"), (rid, code)
            self.check()

        @precondition(lambda self: self.model.leases or self.waiting())
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            """Release a lease (held or pending: a cancelled waiter's grant) or cancel a waiter."""
            rid = data.draw(st.sampled_from(sorted([*self.model.leases, *self.waiting()])))
            self.eval("release", [rid, self.owner[rid]])
            if not self.model.release(rid, self.now):
                assert self.model.cancel(rid)
            self.grant(self.owner[rid])
            self.check()

    return ClaimMachine


@pytest.mark.parametrize(("policy", "starvation"), [("strict", 1e9), ("strict", 0.0), ("elastic", 1e9)])
def test_the_claim_handshake_in_lua_conforms_to_the_ledger(redis_url: str, names: list[str], policy: str,
                                                           starvation: float) -> None:
    machine = _make_machine(redis_url, names, policy, starvation)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "starvation"), [("strict", 1e9), ("strict", 0.0), ("elastic", 1e9),
                                                    ("elastic", 0.0)])
def test_the_claim_handshake_conforms_long(redis_url: str, names: list[str], policy: str,
                                           starvation: float) -> None:
    machine = _make_machine(redis_url, names, policy, starvation)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=300, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_a_pending_grant_is_reserved_not_held_and_a_claim_is_idempotent(redis_url: str,
                                                                          names: list[str]) -> None:
    """Hand-made: the grant pass's grant to another process is pending (status counts it in used and
    pending_grants), the wake-up's acquire claims it (twice is once), and an unclaimed one is returned."""
    b = RedisBudget(redis_url, f"{names[0]}-h", 10, 4, policy="strict", recovery_s=0)
    names.append(f"{names[0]}-h")
    face, core = b._sync_face, b._core
    r = redis.Redis.from_url(redis_url)
    try:
        def args(rid: str, owner: str, blocks: int) -> list[Any]:
            return [rid, blocks, blocks, 0, -1, LONG_MS, "", owner, LONG_MS, "", LONG_MS, LONG_MS]

        a1, b1, b2 = "a1-holds-everything-x", "b1-waits-for-six-xxx", "b2-waits-for-four-xx"
        assert face.eval("acquire", args(a1, OWNERS[0], 10))[0] == b"G"
        assert face.eval("acquire", args(b1, OWNERS[1], 6))[0] == b"W"
        assert face.eval("acquire", args(b2, OWNERS[1], 4))[0] == b"W"
        face.eval("release", [a1, OWNERS[0]])  # the grant pass: both pending
        st0 = core.status_from(face.eval("status", []))
        assert (st0.used, st0.extra["pending_grants"], st0.extra["pending_blocks"]) == (10, 2, 10)
        assert face.eval("acquire", args(b1, OWNERS[1], 6))[0] == b"G"  # the claim
        assert face.eval("acquire", args(b1, OWNERS[1], 6))[0] == b"G"  # idempotent
        st1 = core.status_from(face.eval("status", []))
        assert (st1.used, st1.extra["pending_grants"], st1.extra["pending_blocks"]) == (10, 1, 4)
        r.zadd(f"{core.prefix}:lexp", {b2: 1}, xx=True)  # b2's claim window ends
        face.eval("release", ["nobody-holds-this-id", OWNERS[0]])
        st2 = core.status_from(face.eval("status", []))
        assert (st2.used, st2.leases, st2.extra["pending_grants"], st2.extra["unclaimed_grants"]) == (6, 1, 0, 1)
        assert not r.hexists(f"{core.prefix}:wait", b2)  # it left the line with its grant
        assert face.eval("poll", [LONG_MS, "", b2])[1] == b"N"  # its process learns it: enqueue again
    finally:
        r.close()
        b.close_sync()


def test_a_grant_made_by_the_waiters_own_process_is_claimed_as_made(redis_url: str, names: list[str]) -> None:
    """A process's own call (here its release) that grants its own waiter is the proof that it lives: the
    grant is claimed at once and its mailbox item says so ('+id': no claim call), while the same
    process's grant to another process's waiter is pending ('id': that process claims it)."""
    b = RedisBudget(redis_url, f"{names[0]}-o", 10, 4, policy="strict", recovery_s=0)
    names.append(f"{names[0]}-o")
    face, core = b._sync_face, b._core
    r = redis.Redis.from_url(redis_url)
    try:
        def args(rid: str, owner: str, blocks: int) -> list[Any]:
            return [rid, blocks, blocks, 0, -1, LONG_MS, owner, owner, LONG_MS, "", LONG_MS, LONG_MS]

        a1, a2, b1 = "a1-holds-everything-x", "a2-same-process-xxxx", "b2-other-process-xxxx"
        assert face.eval("acquire", args(a1, OWNERS[0], 10))[0] == b"G"
        assert face.eval("acquire", args(a2, OWNERS[0], 5))[0] == b"W"
        assert face.eval("acquire", args(b1, OWNERS[1], 5))[0] == b"W"
        face.eval("release", [a1, OWNERS[0]])  # a's own call grants a2 (claimed) and b1 (pending)
        leases = {k.decode(): json.loads(v) for k, v in r.hgetall(f"{core.prefix}:leases").items()}
        assert (leases[a2].get("c"), leases[b1].get("c")) == (None, 1)
        assert r.lrange(core.mailbox(OWNERS[0]), 0, -1) == [f"+{a2}".encode()]
        assert r.lrange(core.mailbox(OWNERS[1]), 0, -1) == [b1.encode()]
        st0 = core.status_from(face.eval("status", []))
        assert (st0.used, st0.extra["pending_grants"], st0.extra["pending_blocks"]) == (10, 1, 5)
    finally:
        r.close()
        b.close_sync()
