"""One conformance suite for every Budget backend, with the sans-I/O ledger as the model.

A hypothesis state machine drives random acquire (with and without a retried ticket) / release /
double release / cancel / held report / limit change sequences against a real backend (LocalBudget,
and RedisBudget on the test Redis, both with their default policy, elastic) and against
:class:`~zp_client.budget.ledger.Ledger` with the same policy. After every
step the backend must agree with the model exactly: which requests hold leases (and with which
tickets), which were refused, and the status snapshot (limit, used, held, live leases, waiters and
their weight per class).

The starvation bound is 0 (pure FIFO: every non-fitting waiter is a barrier) or effectively infinite
(unbounded backfill), so the outcome never depends on timing. Under the SLO-aware line (``line="slo"``)
requests carry TTFT targets 1,000 s and more apart (every deadline stays ahead for the whole run, in
the same order on every clock), targets already missed (an ``age_s`` far beyond the target) or none,
and the late bound is effectively infinite: the order (earliest deadline first, then the rest in line
order) is the ledger's, on the backend's own clock. Expiry is time-based and is tested per
backend (tests/budget/test_redis_budget.py, tests/budget/test_redis_multiprocess.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests._redis_keys import delete_keys
from zp_client.budget.base import Budget, Lease, Ticket
from zp_client.budget.elastic import ElasticPolicy
from zp_client.budget.ledger import Ledger
from zp_client.errors import ConfigurationError, LeaseTooLarge

LIMIT = 12
NO_BACKFILL = 0.0
FULL_BACKFILL = 1e9  # seconds; no wait in a test comes near it

NEVER_LATE = 1e9  # late_bound_s of the SLO runs: no waiter of a test gets near it

BudgetFactory = Callable[[int, float, str], Budget]
#: a drawn target: None (no target), "missed" (a deadline long past), k (TTFT target ~k x 1,000 s) or
#: "ak" (a non-streamed call due at the same time: TTFT target 1 s, the rest its answer allowance)
_TARGETS = st.sampled_from([None, "missed", 1, 2, 3, 4, 5, 6, "a2", "a5"])


def _local_factory(limit: int, starvation: float, line: str) -> Budget:
    from zp_client.budget.local import LocalBudget

    return LocalBudget(limit, starvation_bound_s=starvation, line=line, late_bound_s=NEVER_LATE)  # type: ignore[arg-type]


def _make_machine(factory: BudgetFactory, starvation: float, cleanup: Callable[[], None],
                  line: str = "fifo") -> type:
    class BudgetMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            # the backends' default policy, elastic: the requests carry no metadata, so each lease is
            # reserved at its bound (strict's sums), and across priority classes the urgent reserve
            # holds a less urgent waiter back (docs/admission.md#the-urgent-reserve)
            self.model = Ledger(LIMIT, policy=ElasticPolicy(16), starvation_bound_s=starvation,
                                line=line, late_bound_s=NEVER_LATE)  # type: ignore[arg-type]
            self.budget = factory(LIMIT, starvation, line)
            self.labels = itertools.count()
            self.tasks: dict[str, asyncio.Task[Lease]] = {}
            self.leases: dict[str, Lease] = {}
            self.released: list[Lease] = []
            self.tickets: list[Ticket] = []
            self.rejected: set[str] = set()

        # ----------------------------------------------------------------- helpers
        def run(self, coro: Any) -> Any:
            return self.loop.run_until_complete(coro)

        def settle(self) -> None:
            """Wait (bounded, for liveness only) for every grant the model made; check refusals."""
            granted = [lbl for lbl in self.model.leases if lbl not in self.leases]
            waiting = [self.tasks[lbl] for lbl in granted]
            rejected = [self.tasks[lbl] for lbl in self.rejected]
            if waiting or rejected:
                done, pending = self.run(asyncio.wait(waiting + rejected, timeout=20))
                assert not pending, f"the backend did not grant/refuse what the model did: {granted} {self.rejected}"
            for lbl in granted:
                lease = self.tasks.pop(lbl).result()
                assert lease.ticket == self.model.lease(lbl).ticket, "ticket order differs from the ledger's"
                assert lease.bound == self.model.lease(lbl).bound
                self.leases[lbl] = lease
                self.tickets.append(lease.ticket)
            for lbl in self.rejected:
                exc = self.tasks.pop(lbl).exception()
                assert isinstance(exc, LeaseTooLarge), f"expected LeaseTooLarge for a waiter above the limit, got {exc!r}"
            self.rejected.clear()
            # Let any (wrong) extra grant surface before comparing.
            self.run(asyncio.sleep(0.002))
            for lbl, task in self.tasks.items():
                assert not task.done(), f"{lbl} finished ({task!r}) but the model says it waits"
            flush = getattr(self.budget, "flush", None)
            if flush is not None:
                self.run(flush())
            got = self.run(self.budget.status())
            want = self.model.status(0.0)
            assert (got.limit, got.used, got.free, got.held, got.leases) == (
                want.limit, want.used, want.free, want.held, want.leases)
            assert got.waiters == want.waiters

        # ----------------------------------------------------------------- rules
        @rule(blocks=st.integers(1, LIMIT + 2), priority=st.integers(0, 2), retry=st.booleans(),
              goal=_TARGETS)
        def acquire(self, blocks: int, priority: int, retry: bool, goal: int | str | None) -> None:
            ticket = self.tickets.pop(0) if retry and self.tickets else None
            n = next(self.labels)
            lbl = f"r{n}"
            # Targets k x 1,000 s (+ n s: no two deadlines tie, whichever clock): the model's clock stays
            # at 0, the backend's runs for the few seconds of a run, so the order of deadlines is the same.
            meta: dict[str, float] | None = (
                None if goal is None else {"ttft_target_s": 1.0, "age_s": 1e6} if goal == "missed"
                else {"ttft_target_s": 1.0, "answer_s": 1000.0 * int(goal[1:]) + n - 1.0}
                if isinstance(goal, str) else {"ttft_target_s": 1000.0 * int(goal) + n})
            try:
                self.model.enqueue(lbl, blocks, None, priority, 0.0, ticket, meta=meta)
            except LeaseTooLarge:
                with pytest.raises(LeaseTooLarge):
                    self.run(self.budget.acquire(blocks, priority=priority, ticket=ticket, meta=meta))
                return
            self.tasks[lbl] = self.loop.create_task(
                self.budget.acquire(blocks, priority=priority, ticket=ticket, meta=meta))
            self.run(asyncio.sleep(0))  # let it reach the backend before the model grants
            self.run(self._until_registered(lbl))
            self.model.grant(0.0)
            self.settle()

        async def _until_registered(self, lbl: str) -> None:
            # The acquire call's own round trip: wait until the backend has the request (granted or queued).
            for _ in range(2000):
                st_ = await self.budget.status()
                n = st_.leases + sum(c.waiters for c in st_.waiters.values())
                if n >= len(self.leases) + len(self.tasks) or self.tasks[lbl].done():
                    return
                await asyncio.sleep(0.001)
            raise AssertionError("acquire never reached the backend")

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            lease = self.leases.pop(lbl)
            self.run(lease.release())
            assert lease.released
            self.released.append(lease)
            self.model.release(lbl, 0.0)
            self.model.grant(0.0)
            self.settle()

        @precondition(lambda self: bool(self.released))
        @rule(data=st.data())
        def release_again_is_a_no_op(self, data: st.DataObject) -> None:
            lease = data.draw(st.sampled_from(self.released))
            self.run(lease.release())
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

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data(), value=st.integers(-2, LIMIT + 2))
        def report_held(self, data: st.DataObject, value: int) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            self.leases[lbl].report_held(value)
            self.model.report_held(lbl, value)
            assert self.leases[lbl].held == self.model.lease(lbl).held
            self.settle()

        @rule(limit=st.sampled_from([0, -1, 2.5]))
        def set_limit_refuses_a_limit_below_one_block(self, limit: Any) -> None:
            with pytest.raises(ConfigurationError):
                self.run(self.budget.set_limit(limit))
            self.settle()

        @rule(limit=st.integers(1, LIMIT + 4))
        def set_limit(self, limit: int) -> None:
            self.run(self.budget.set_limit(limit))
            self.rejected |= set(self.model.set_limit(limit, 0.0))
            self.model.grant(0.0)
            self.settle()

        @invariant()
        def strict_invariant(self) -> None:
            st_ = self.model
            assert all(0 <= le.held <= le.bound for le in st_.leases.values())

        def teardown(self) -> None:
            try:
                for task in self.tasks.values():
                    task.cancel()
                for task in self.tasks.values():
                    try:
                        lease = self.run(task)
                    except (asyncio.CancelledError, LeaseTooLarge):
                        continue
                    self.run(lease.release())  # only after a failed step: a grant the model did not make
                for lease in self.leases.values():
                    self.run(lease.release())
                st_ = self.run(self.budget.status())
                assert st_.leases == 0 and not st_.waiters, f"leaked: {st_}"
                self.run(self.budget.aclose())
            finally:
                self.loop.close()
                cleanup()

    return BudgetMachine


_SETTINGS = settings(
    max_examples=25, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# The SLO line reorders only once several waiters queue behind a full pool: longer runs reach that often.
_SLO_SETTINGS = settings(_SETTINGS, stateful_step_count=45)


def _settings(line: str) -> settings:
    return _SLO_SETTINGS if line == "slo" else _SETTINGS


_LINES = pytest.mark.parametrize(("starvation", "line"), [
    (NO_BACKFILL, "fifo"), (FULL_BACKFILL, "fifo"), (NO_BACKFILL, "slo"), (FULL_BACKFILL, "slo")],
    ids=["fifo", "backfill", "slo", "slo-backfill"])


@_LINES
@pytest.mark.slow  # a hypothesis state machine: make test-fast skips it, make test runs it
def test_local_budget_conforms_to_the_ledger(starvation: float, line: str) -> None:
    pytest.importorskip("zp_client.budget.local")
    machine = _make_machine(_local_factory, starvation, lambda: None, line)
    run_state_machine_as_test(machine, settings=_settings(line))


@pytest.mark.redis
@_LINES
@pytest.mark.slow  # a hypothesis state machine: make test-fast skips it, make test runs it
def test_redis_budget_conforms_to_the_ledger(starvation: float, line: str, redis_url: str,
                                             redis_prefix: str) -> None:
    from zp_client.budget.redis import RedisBudget

    names: list[str] = []
    counter = itertools.count()

    def factory(limit: int, starve: float, line: str) -> Budget:
        name = f"{redis_prefix}-{next(counter)}"
        names.append(name)
        # recovery_s=0: a fresh budget would otherwise admit nothing for one lease TTL (tested elsewhere)
        return RedisBudget(redis_url, name, limit, recovery_s=0, starvation_bound_s=starve, held_report_blocks=1,
                           line=line, late_bound_s=NEVER_LATE)  # type: ignore[arg-type]

    def cleanup() -> None:
        delete_keys(redis_url, *names)

    machine = _make_machine(factory, starvation, cleanup, line)
    run_state_machine_as_test(machine, settings=_settings(line))
