"""The SLO-aware line (docs/admission.md#the-slo-aware-line): its order, its guarantees as hypothesis
properties on the ledger (virtual clock), the settings, and the Redis port's order on real Redis (the
conformance machines in tests/budget/test_budget_conformance.py hold the port to the ledger step by step)."""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from tests._redis_keys import delete_keys
from zp_client.budget._types import Ticket
from zp_client.budget.ledger import DEFAULT_LATE_BOUND_S, Ledger, WaiterRecord, line_deadline
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, InvalidRequest


def _t(target: float, age: float = 0.0) -> dict[str, float]:
    return {"ttft_target_s": target, "age_s": age}


def _full(led: Ledger, now: float = 0.0) -> None:
    led.enqueue("hold", led.limit, None, 0, now)
    assert led.grant(now) == ["hold"]


# ----------------------------------------------------------------------------- the order, by example


def test_earliest_deadline_first_then_missed_and_untargeted_in_line_order() -> None:
    led = Ledger(10, line="slo", starvation_bound_s=0.0)
    _full(led)
    led.enqueue("late", 10, None, 0, 0.0, meta=_t(1.0, age=5.0))    # deadline -4: already missed
    led.enqueue("none", 10, None, 0, 0.0)                            # no target
    led.enqueue("slow", 10, None, 0, 0.0, meta=_t(30.0))             # deadline 30
    led.enqueue("fast", 10, None, 0, 0.0, meta=_t(2.0))              # deadline 2
    order = []
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        led.release(order[-1] if order else "hold", now)
        order += led.grant(now)
    assert order == ["fast", "slow", "late", "none"]


def test_fifo_line_ignores_targets() -> None:
    led = Ledger(10, line="fifo", starvation_bound_s=0.0)
    _full(led)
    led.enqueue("slow", 10, None, 0, 0.0, meta=_t(30.0))
    led.enqueue("fast", 10, None, 0, 0.0, meta=_t(2.0))
    led.release("hold", 1.0)
    assert led.grant(1.0) == ["slow"]


def test_a_deadline_that_passes_in_line_moves_the_waiter_behind_those_that_can_still_make_theirs() -> None:
    led = Ledger(10, line="slo", starvation_bound_s=100.0)
    _full(led)
    led.enqueue("a", 10, None, 0, 0.0, meta=_t(1.0))
    led.enqueue("b", 10, None, 0, 0.5, meta=_t(9.0))
    led.release("hold", 2.0)  # a's deadline (1.0) passed: b (9.5) can still make it
    assert led.grant(2.0) == ["b"]


def test_a_late_bound_waiter_goes_first_and_past_the_starvation_bound_is_a_barrier() -> None:
    led = Ledger(10, line="slo", late_bound_s=5.0, starvation_bound_s=2.0)
    _full(led)
    led.enqueue("old", 8, None, 0, 0.0, meta=_t(1.0))
    led.enqueue("new", 2, None, 0, 5.5, meta=_t(3.0))
    led.enqueue("new8", 8, None, 0, 5.5, meta=_t(3.0))
    led.release("hold", 6.0)
    # "old" waited >= late_bound_s: it is tried first, in line order, and it fits
    assert led.grant(6.0) == ["old", "new"]
    led2 = Ledger(10, line="slo", late_bound_s=5.0, starvation_bound_s=2.0)
    led2.enqueue("h", 3, None, 0, 0.0)
    assert led2.grant(0.0) == ["h"]
    led2.enqueue("big", 10, None, 0, 0.0, meta=_t(1.0))   # does not fit next to h
    led2.enqueue("small", 2, None, 0, 5.5, meta=_t(3.0))  # fits, deadline ahead
    # big waited 6 s >= late bound and >= starvation bound: a barrier, small waits behind it
    assert led2.grant(6.0) == []
    led2.enqueue("small2", 2, None, 0, 6.0, meta=_t(3.0))
    assert led2.grant(6.0) == []
    led2.release("h", 7.0)
    assert led2.grant(7.0) == ["big"]


def test_a_retry_keeps_its_ticket_and_deadline() -> None:
    led = Ledger(10, line="slo", starvation_bound_s=0.0)
    _full(led)
    t1 = led.enqueue("first", 10, None, 0, 0.0, meta=_t(4.0))
    d1 = led.waiter("first").deadline  # type: ignore[union-attr]
    led.cancel("first")  # the attempt failed; the retry comes back 1.5 s later with its age and ticket
    led.enqueue("other", 10, None, 0, 1.0, meta=_t(3.5))  # deadline 4.5: after the retry's 4.0
    t2 = led.enqueue("retry", 10, None, 0, 1.5, ticket=t1, meta=_t(4.0, age=1.5))
    assert t2 == t1 and led.waiter("retry").deadline == d1 == 4.0  # type: ignore[union-attr]
    led.release("hold", 2.0)
    assert led.grant(2.0) == ["retry"]


def test_priority_classes_stay_strict_under_the_slo_line() -> None:
    led = Ledger(10, line="slo", starvation_bound_s=0.0)
    _full(led)
    led.enqueue("batch", 10, None, 1, 0.0, meta=_t(0.5))
    led.enqueue("urgent", 10, None, 0, 0.1, meta=_t(100.0))
    led.release("hold", 0.2)
    assert led.grant(0.2) == ["urgent"]


@pytest.mark.parametrize("meta", [
    {"ttft_target_s": 0}, {"ttft_target_s": -1.0}, {"ttft_target_s": math.nan}, {"ttft_target_s": math.inf},
    {"ttft_target_s": "1"}, {"ttft_target_s": True}, {"ttft_target_s": 1.0, "age_s": -0.5},
    {"ttft_target_s": 1.0, "age_s": math.inf}, {"tpot_target_s": 0.0},
    {"ttft_target_s": 1.0, "answer_s": -0.1}, {"ttft_target_s": 1.0, "answer_s": math.nan},
    {"ttft_target_s": 1.0, "answer_s": "3"},
])
def test_bad_targets_are_invalid_requests_and_change_nothing(meta: dict[str, Any]) -> None:
    led = Ledger(10, line="slo")
    with pytest.raises(InvalidRequest) as exc:
        led.enqueue("w", 2, None, 0, 0.0, meta=meta)
    assert exc.value.field in meta
    assert "w" not in led and len(led) == 0
    assert led.enqueue("w2", 2, None, 0, 0.0).order == 0  # no ticket was spent


def test_line_settings_are_checked() -> None:
    for bad in ("edf", None, 1):
        with pytest.raises(ConfigurationError):
            Ledger(10, line=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            LocalBudget(10, line=bad)  # type: ignore[arg-type]
    for bad_s in (-1.0, math.nan, "3"):
        with pytest.raises(ConfigurationError):
            Ledger(10, late_bound_s=bad_s)  # type: ignore[arg-type]
    assert Ledger(10).line_discipline == "slo" and Ledger(10).late_bound_s == DEFAULT_LATE_BOUND_S == 60.0
    assert Settings().line == "slo" and Settings().late_bound_s == DEFAULT_LATE_BOUND_S


def test_settings_carry_the_line_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZP_LINE", "slo")
    monkeypatch.setenv("ZP_LATE_BOUND_S", "12.5")
    s = Settings()
    assert (s.line, s.late_bound_s) == ("slo", 12.5)
    b = LocalBudget.from_settings(10, s)
    st_ = asyncio.run(b.status())
    assert st_.extra["line"] == "slo" and st_.extra["late_bound_s"] == 12.5
    assert Settings(line="fifo").line == "fifo"
    with pytest.raises(ValueError):
        Settings(line="lifo")  # type: ignore[arg-type]


def test_line_deadline_is_relative_to_the_callers_arrival() -> None:
    assert line_deadline(None, 5.0) is None
    assert line_deadline({"tpot_target_s": 0.05}, 5.0) is None
    assert line_deadline({"ttft_target_s": 2.0, "age_s": 0.5}, 10.0) == 11.5
    # a non-streamed call's answer allowance (forecast output x TPOT target) moves its deadline later
    assert line_deadline({"ttft_target_s": 2.0, "age_s": 0.5, "answer_s": 3.0}, 10.0) == 14.5
    assert line_deadline({"ttft_target_s": 2.0, "answer_s": 0.0}, 10.0) == 12.0
    assert line_deadline({"answer_s": 3.0}, 10.0) is None  # no TTFT target: no deadline


def test_a_non_streamed_call_is_ordered_by_its_answer_deadline() -> None:
    # TTFT target 1 s and 4 s of answer at its TPOT target: due at 5 s, after the streamed call due at 3 s
    # and ahead of the one due at 6 s; past 1 s it has not missed anything yet
    led = Ledger(10, line="slo")
    _full(led)
    led.enqueue("late6", 10, None, 0, 0.0, meta=_t(6.0))
    led.enqueue("answer5", 10, None, 0, 0.0, meta={**_t(1.0), "answer_s": 4.0})
    led.enqueue("soon3", 10, None, 0, 0.0, meta=_t(3.0))
    order = []
    for now in (2.0, 2.5, 2.8):
        led.release(order[-1] if order else "hold", now)
        order += led.grant(now)
    assert order == ["soon3", "answer5", "late6"]


# ----------------------------------------------------------------------------- properties (ledger)


def _spec_order(waiters: list[WaiterRecord], now: float, late: float) -> list[str]:
    """The documented walk of one class (independent of the ledger's code): late-bound waiters in line
    order; then deadlines still ahead, earliest first; then the rest in line order. Without a deadline
    ahead among the young: line order."""
    line = sorted(waiters, key=lambda w: (w.ticket.order, w.seq))
    old = [w for w in line if now - w.since >= late]
    young = [w for w in line if now - w.since < late]
    ahead = [w for w in young if w.deadline is not None and w.deadline > now]
    if not ahead:
        return [w.id for w in line]
    ahead.sort(key=lambda w: (w.deadline, w.ticket.order, w.seq))
    rest = [w for w in young if w not in ahead]
    return [w.id for w in old + ahead + rest]


class SloLineMachine(RuleBasedStateMachine):
    """Random arrivals with targets, retries, releases and cancels on a virtual clock; after every grant
    the four guarantees of docs/admission.md#the-slo-aware-line are checked (strict policy: fits means
    ``used + bound <= limit``)."""

    @initialize(limit=st.integers(4, 20), starve=st.sampled_from([0.0, 0.5, 2.0, 1e9]),
                late=st.sampled_from([0.0, 1.5, 4.0, math.inf]))
    def setup(self, limit: int, starve: float, late: float) -> None:
        self.led = Ledger(limit, line="slo", starvation_bound_s=starve, late_bound_s=late)
        self.limit, self.starve, self.late = limit, starve, late
        self.now = 0.0
        self.ids = itertools.count()
        self.arrival: dict[str, tuple[float, dict[str, float] | None, Ticket, int, int]] = {}
        self.done: list[str] = []  # granted then released: a retry may bring one back

    def _used(self) -> int:
        return self.led.bound_sum

    def _grant_and_check(self) -> None:
        led, now = self.led, self.now
        before = {w.id: w for w in led.line()}
        classes: dict[int, list[WaiterRecord]] = {}
        for w in before.values():
            classes.setdefault(w.priority, []).append(w)
        used = self._used()
        granted = led.grant(now)
        waiting = dict(before)
        for g in granted:
            gw = waiting.pop(g)
            for w in waiting.values():
                fits = used + w.bound <= self.limit
                waited = now - w.since
                if w.priority < gw.priority:
                    # priority: never granted while a more urgent waiter that fits waits; backfill past a
                    # more urgent one only while it is younger than the starvation bound
                    assert not fits, f"{g} (class {gw.priority}) granted while {w.id} ({w.priority}) fits"
                    assert waited < self.starve, f"{g} passed the starving {w.id} of a more urgent class"
                elif (w.priority == gw.priority and (w.ticket.order, w.seq) < (gw.ticket.order, gw.seq)
                      and waited >= self.late):
                    # no starvation: passed by a later arrival for at most late_bound_s; after that only
                    # by backfill (it does not fit) while younger than the starvation bound
                    assert not fits and waited < self.starve, f"{g} overtook late-bound {w.id}"
            used += gw.bound
        assert used == self._used() and (not granted or used <= self.limit)
        # the grant follows the documented order within each class
        for p, ws in classes.items():
            spec = _spec_order(ws, now, self.late)
            mine = [g for g in granted if before[g].priority == p]
            assert mine == [i for i in spec if i in set(mine)], f"class {p}: {mine} not in order {spec}"
        # work-conserving: nothing that fits is left unless a barrier stands ahead of it in the walk
        free = self.limit - used
        barrier = False
        for p in sorted(classes):
            for wid in _spec_order(classes[p], now, self.late):
                if wid in granted:
                    continue
                w = before[wid]
                if w.bound > free:
                    barrier = barrier or now - w.since >= self.starve
                    continue
                assert barrier, f"{wid} fits ({w.bound} <= {free} free) but was left waiting"
        # nothing refused or dropped
        assert set(led.leases) | {w.id for w in led.line()} >= set(before)

    @rule(dt=st.sampled_from([0.0, 0.3, 1.0, 2.5]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._grant_and_check()

    @rule(bound=st.integers(1, 12), priority=st.integers(0, 2),
          goal=st.sampled_from([None, 0.5, 1.0, 3.0, 10.0]), age=st.sampled_from([0.0, 0.0, 0.7, 4.0]),
          answer=st.sampled_from([None, None, 0.0, 0.8, 5.0]))
    def arrive(self, bound: int, priority: int, goal: float | None, age: float, answer: float | None) -> None:
        if bound > self.limit:
            return
        wid = f"w{next(self.ids)}"
        meta = None if goal is None else _t(goal, age)
        if meta is not None and answer is not None:  # a non-streamed call: its answer allowance
            meta["answer_s"] = answer
        t = self.led.enqueue(wid, bound, None, priority, self.now, meta=meta)
        self.arrival[wid] = (self.now - age, meta, t, bound, priority)
        self._grant_and_check()

    @precondition(lambda self: bool(self.done))
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        # an attempt failed after its grant: the retry comes back with its ticket, original arrival and
        # target (age_s = now - arrival on the caller's clock) and is ordered as the request it is
        old = data.draw(st.sampled_from(self.done))
        self.done.remove(old)
        arrived, meta, t, bound, priority = self.arrival[old]
        if bound > self.limit:
            return
        new = f"{old}r{next(self.ids)}"
        m = None if meta is None else {**meta, "age_s": self.now - arrived}
        assert self.led.enqueue(new, bound, None, priority, self.now, ticket=t, meta=m) == t
        w = self.led.waiter(new)
        assert w is not None
        if meta is not None:
            want = arrived + meta["ttft_target_s"] + meta.get("answer_s", 0.0)
            assert w.deadline is not None and math.isclose(w.deadline, want, abs_tol=1e-9)
        self.arrival[new] = (arrived, meta, t, bound, priority)
        self._grant_and_check()

    @precondition(lambda self: bool(self.led.leases))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = data.draw(st.sampled_from(sorted(self.led.leases)))
        self.led.release(lid, self.now)
        self.done.append(lid)
        self._grant_and_check()

    @precondition(lambda self: len(self.led) > 0)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        wid = data.draw(st.sampled_from([w.id for w in self.led.line()]))
        assert self.led.cancel(wid)
        self._grant_and_check()


SloLineMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestSloLineProperties = pytest.mark.slow(SloLineMachine.TestCase)  # a state machine: make test-fast skips it


_OPS = st.lists(st.tuples(st.sampled_from(["arrive", "release", "cancel", "advance"]), st.integers(1, 12),
                          st.integers(0, 2), st.sampled_from([0.0, 0.4, 1.1, 3.0])), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS, starve=st.sampled_from([0.0, 1.0, 1e9]), late=st.sampled_from([0.0, 2.0, math.inf]))
def test_without_targets_the_slo_line_is_the_fifo_line(ops: list[tuple[str, int, int, float]], starve: float,
                                                       late: float) -> None:
    fifo = Ledger(12, line="fifo", starvation_bound_s=starve)
    slo = Ledger(12, starvation_bound_s=starve, line="slo", late_bound_s=late)
    now, n = 0.0, 0
    for op, bound, prio, dt in ops:
        if op == "arrive":
            n += 1
            for led in (fifo, slo):
                led.enqueue(f"w{n}", bound, None, prio, now)
        elif op == "release" and fifo.leases:
            lid = sorted(fifo.leases)[bound % len(fifo.leases)]
            for led in (fifo, slo):
                led.release(lid, now)
        elif op == "cancel" and len(fifo):
            wid = [w.id for w in fifo.line()][bound % len(fifo)]
            for led in (fifo, slo):
                led.cancel(wid)
        else:
            now += dt
        assert fifo.grant(now) == slo.grant(now)


# ----------------------------------------------------------------------------- the Redis port


@pytest.mark.redis
def test_redis_slo_line_orders_by_deadline_on_redis_time(redis_url: str, redis_prefix: str) -> None:
    from zp_client.budget.redis import RedisBudget

    async def main() -> list[str]:
        b = RedisBudget(redis_url, redis_prefix, 10, policy="strict", recovery_s=0, line="slo",
                        starvation_bound_s=0.0)
        try:
            hold = await b.acquire(10)
            metas = {"missed": _t(1.0, age=500.0), "none": None, "slow": _t(300.0), "fast": _t(100.0),
                     "answer": {**_t(50.0), "answer_s": 150.0}}  # non-streamed: due at 200 s
            tasks: dict[str, asyncio.Task[Any]] = {}
            for k, m in metas.items():
                tasks[k] = asyncio.create_task(b.acquire(10, meta=m))
                while sum(c.waiters for c in (await b.status()).waiters.values()) < len(tasks):
                    await asyncio.sleep(0.01)
            order: list[str] = []
            lease = hold
            for _ in metas:
                await lease.release()
                done, _p = await asyncio.wait(list(tasks.values()), return_when=asyncio.FIRST_COMPLETED,
                                              timeout=20)
                (name,) = [k for k, t in tasks.items() if t in done]
                lease = tasks.pop(name).result()
                order.append(name)
            await lease.release()
            return order
        finally:
            await b.aclose()

    try:
        assert asyncio.run(main()) == ["fast", "answer", "slow", "missed", "none"]
    finally:
        delete_keys(redis_url, redis_prefix)


@pytest.mark.redis
def test_redis_rejects_bad_targets_before_any_lease(redis_url: str, redis_prefix: str) -> None:
    from zp_client.budget.redis import RedisBudget

    async def main() -> None:
        b = RedisBudget(redis_url, redis_prefix, 10, recovery_s=0, line="slo")
        try:
            with pytest.raises(InvalidRequest):
                await b.acquire(2, meta={"ttft_target_s": -1})
            st_ = await b.status()
            assert st_.leases == 0 and not st_.waiters
        finally:
            await b.aclose()

    try:
        asyncio.run(main())
    finally:
        delete_keys(redis_url, redis_prefix)


@pytest.mark.redis
@pytest.mark.parametrize("late_bound_s", [0.3, 1e9])
def test_redis_late_bound_waiter_goes_ahead_of_earlier_deadlines(late_bound_s: float, redis_url: str,
                                                                 redis_prefix: str) -> None:
    """A waiter that has waited late_bound_s (on Redis TIME) is tried before the deadlines still ahead."""
    from zp_client.budget.redis import RedisBudget

    async def main() -> str:
        b = RedisBudget(redis_url, redis_prefix, 10, policy="strict", recovery_s=0, line="slo",
                        late_bound_s=late_bound_s, starvation_bound_s=0.0)
        try:
            hold = await b.acquire(10)
            old = asyncio.create_task(b.acquire(10))  # no target
            await asyncio.sleep(0.5)  # at least: old has waited past a 0.3 s late bound by any clock
            new = asyncio.create_task(b.acquire(10, meta=_t(100.0)))
            while sum(c.waiters for c in (await b.status()).waiters.values()) < 2:
                await asyncio.sleep(0.01)
            await hold.release()
            done, _p = await asyncio.wait([old, new], return_when=asyncio.FIRST_COMPLETED, timeout=20)
            first = "old" if old in done else "new"
            lease = (old if old in done else new).result()
            await lease.release()
            await (await asyncio.wait_for(new if first == "old" else old, 20)).release()
            return first
        finally:
            await b.aclose()

    try:
        assert asyncio.run(main()) == ("old" if late_bound_s < 1 else "new")
    finally:
        delete_keys(redis_url, redis_prefix)


@pytest.mark.redis
def test_redis_budget_reads_the_line_from_settings(redis_url: str) -> None:
    from zp_client.budget.redis import RedisBudget

    b = RedisBudget.from_settings(redis_url, "zp-test-line-settings", 10,
                                  Settings(line="slo", late_bound_s=12.5))
    assert (b.config.line, b.config.late_bound_s) == ("slo", 12.5)
    assert b._core.init_args()[8:10] == ["slo", 12500]  # ARGV[9], ARGV[10] of init.lua (11, 12: reserves)
    b.close_sync()
    with pytest.raises(ConfigurationError):
        RedisBudget(redis_url, "zp-test-line-bad", 10, line="edf")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        RedisBudget(redis_url, "zp-test-line-bad", 10, late_bound_s=-1)


# ----------------------------------------------------------------------------- fleets


def test_fleet_ledger_runs_the_slo_line() -> None:
    from zp_client.fleet.ledger import FleetLedger, default_factory

    for line, want in (("fifo", "slow"), ("slo", "fast")):
        fl = FleetLedger({"http://a:8000/v1": 10}, default_factory("strict", 16), line=line)  # type: ignore[arg-type]
        fl.enqueue("hold", 10, None, 0, 0.0)
        assert fl.grant(0.0) == ["hold"]
        fl.enqueue("slow", 6, None, 0, 0.0, meta=_t(300.0))
        fl.enqueue("fast", 6, None, 0, 0.1, meta=_t(100.0))
        fl.release("hold", 1.0)
        assert fl.grant(1.0) == [want]


@pytest.mark.redis
@pytest.mark.parametrize("line", ["fifo", "slo"])
def test_redis_fleet_runs_the_slo_line(line: str, redis_url: str, redis_prefix: str) -> None:
    from zp_client.fleet.redis import RedisFleet

    async def main() -> str:
        f = RedisFleet(redis_url, redis_prefix, ["http://a:8000/v1"], 10, recovery_s=0, line=line)
        try:
            hold = await f.acquire(10)
            slow = asyncio.create_task(f.acquire(6, meta=_t(300.0)))
            while sum(c.waiters for c in (await f.status()).waiters.values()) < 1:
                await asyncio.sleep(0.01)
            fast = asyncio.create_task(f.acquire(6, meta=_t(100.0)))
            while sum(c.waiters for c in (await f.status()).waiters.values()) < 2:
                await asyncio.sleep(0.01)
            await hold.release()
            done, _p = await asyncio.wait([slow, fast], return_when=asyncio.FIRST_COMPLETED, timeout=20)
            first = "fast" if fast in done else "slow"
            await (fast if fast in done else slow).result().release()
            await (await asyncio.wait_for(slow if first == "fast" else fast, 20)).release()
            return first
        finally:
            await f.aclose()

    try:
        assert asyncio.run(main()) == ("fast" if line == "slo" else "slow")
    finally:
        delete_keys(redis_url, redis_prefix)


@pytest.mark.redis
def test_redis_finds_a_deadline_deep_in_the_line(redis_url: str, redis_prefix: str) -> None:
    """A grant pass scans 64 waiters at the head of the line; the :dl sorted set finds a waiter whose
    deadline is ahead however far behind them it stands."""
    from zp_client.budget.redis import RedisBudget

    async def main() -> bool:
        b = RedisBudget(redis_url, redis_prefix, 10, policy="strict", recovery_s=0, line="slo",
                        starvation_bound_s=0.0)
        try:
            hold = await b.acquire(10)
            crowd = [asyncio.create_task(b.acquire(10)) for _ in range(70)]  # no targets
            while sum(c.waiters for c in (await b.status()).waiters.values()) < len(crowd):
                await asyncio.sleep(0.02)
            urgent = asyncio.create_task(b.acquire(10, meta=_t(100.0)))
            while sum(c.waiters for c in (await b.status()).waiters.values()) < len(crowd) + 1:
                await asyncio.sleep(0.02)
            await hold.release()
            lease = await asyncio.wait_for(urgent, 20)
            ok = not any(t.done() for t in crowd)
            for t in crowd:
                t.cancel()
            await asyncio.gather(*crowd, return_exceptions=True)
            await lease.release()
            return ok
        finally:
            await b.aclose()

    try:
        assert asyncio.run(main())
    finally:
        delete_keys(redis_url, redis_prefix)
