"""LocalBudget: the in-process backend. Concurrency, cancellation, timeouts, threads and limit changes.

No assertion here depends on timing: sleeps only give other tasks a chance to run, and waits for a state
are bounded by generous fail_after scopes that fail loudly instead of hanging.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import anyio
import pytest

from zp_client import AdmissionTimeout, ConfigurationError, LeaseTooLarge, LocalBudget, Ticket
from zp_client.budget.base import Lease

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class LiveCounter:
    """Blocks held right now by callers inside their lease, and the most ever seen (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def enter(self, n: int) -> None:
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def leave(self, n: int) -> None:
        with self._lock:
            self.now -= n


async def wait_until(cond: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll a condition (not a timing assertion: the bound only turns a hang into a clear failure)."""
    with anyio.fail_after(limit_s):
        while not cond():
            await anyio.sleep(0.001)
    assert cond(), what


def waiting(budget: LocalBudget) -> int:
    return sum(c.waiters for c in budget.status_sync().waiters.values())


def assert_empty(budget: LocalBudget) -> None:
    s = budget.status_sync()
    assert (s.used, s.held, s.leases, s.waiters) == (0, 0, 0, {}), s
    assert budget._waiters == {}


# ----------------------------------------------------------------------------- load


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_500_tasks_with_mixed_weights_never_exceed_the_limit_and_all_finish() -> None:
    budget = LocalBudget(100)
    live = LiveCounter()
    rng = random.Random(1)
    done = 0

    async def worker(blocks: int, priority: int, pauses: int) -> None:
        nonlocal done
        async with budget.lease(blocks, priority=priority) as lease:
            live.enter(lease.bound)
            assert live.now <= budget.limit
            for _ in range(pauses):
                await anyio.sleep(0)
            live.leave(lease.bound)
        done += 1

    async with anyio.create_task_group() as tg:
        for _ in range(500):
            tg.start_soon(worker, rng.randint(1, 60), rng.randint(0, 2), rng.randint(0, 5))
    assert done == 500
    assert live.peak <= 100
    assert live.peak > 60  # the budget really was contended and filled
    assert budget.status_sync().extra["granted"] == 500
    assert_empty(budget)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_cancellation_at_random_points_leaks_nothing() -> None:
    budget = LocalBudget(50, starvation_bound_s=0.01)
    live = LiveCounter()
    rng = random.Random(7)
    outcomes = {"held": 0, "cancelled": 0}

    async def worker(blocks: int, deadline: float, hold: float) -> None:
        with anyio.move_on_after(deadline) as scope:
            async with budget.lease(blocks) as lease:
                live.enter(lease.bound)
                try:
                    assert live.now <= budget.limit
                    await anyio.sleep(hold)
                finally:
                    live.leave(lease.bound)
            outcomes["held"] += 1
        if scope.cancelled_caught:
            outcomes["cancelled"] += 1

    async def canceller(scopes: list[anyio.CancelScope]) -> None:
        for scope in scopes:
            await anyio.sleep(rng.random() * 0.002)
            scope.cancel()

    scopes: list[anyio.CancelScope] = []

    async def cancellable(blocks: int) -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await worker(blocks, 10.0, 0.001)

    async with anyio.create_task_group() as tg:
        for _ in range(300):
            tg.start_soon(worker, rng.randint(1, 30), rng.random() * 0.02, rng.random() * 0.005)
        for _ in range(200):
            tg.start_soon(cancellable, rng.randint(1, 30))
        await anyio.sleep(0)
        tg.start_soon(canceller, scopes)
    assert outcomes["cancelled"] > 0 and outcomes["held"] > 0
    assert live.peak <= 50
    assert_empty(budget)


async def test_threads_and_tasks_share_one_limit() -> None:
    budget = LocalBudget(64)
    live = LiveCounter()
    errors: list[BaseException] = []
    rng = random.Random(3)

    def thread_main(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(25):
                with budget.lease_sync(r.randint(1, 24), priority=r.randint(0, 1)) as lease:
                    live.enter(lease.bound)
                    assert live.now <= 64
                    time.sleep(r.random() * 0.001)
                    live.leave(lease.bound)
        except BaseException as exc:  # surfaced in the main test
            errors.append(exc)

    async def task_main(blocks: int) -> None:
        for _ in range(3):
            async with budget.lease(blocks) as lease:
                live.enter(lease.bound)
                assert live.now <= 64
                await anyio.sleep(rng.random() * 0.001)
                live.leave(lease.bound)

    threads = [threading.Thread(target=thread_main, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    async with anyio.create_task_group() as tg:
        for _ in range(100):
            tg.start_soon(task_main, rng.randint(1, 24))
    for t in threads:
        await anyio.to_thread.run_sync(t.join)
    assert errors == []
    assert live.peak <= 64
    assert budget.status_sync().extra["granted"] == 16 * 25 + 100 * 3
    assert_empty(budget)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_one_release_wakes_only_the_waiters_it_admits() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(10)
    got: list[Lease] = []
    finish = anyio.Event()

    async def waiter() -> None:
        lease = await budget.acquire(1)
        got.append(lease)
        await finish.wait()
        await lease.release()

    async with anyio.create_task_group() as tg:
        for _ in range(1000):
            tg.start_soon(waiter)
        await wait_until(lambda: waiting(budget) == 1000, "1000 waiters parked")
        assert budget.status_sync().extra["wakeups"] == 0

        await holder.release()  # frees 10 blocks: exactly 10 one-block waiters fit
        await wait_until(lambda: len(got) == 10, "10 admitted")
        for _ in range(50):  # let any wrongly woken waiter run, if there were any
            await anyio.sleep(0)
        s = budget.status_sync()
        assert s.extra["wakeups"] == 10
        assert len(got) == 10 and waiting(budget) == 990 and s.used == 10

        released = got.pop()  # one more release admits exactly one more
        await released.release()
        await wait_until(lambda: len(got) == 10, "1 more admitted")
        for _ in range(50):
            await anyio.sleep(0)
        assert budget.status_sync().extra["wakeups"] == 11 and waiting(budget) == 989
        finish.set()
    # every waiter was woken exactly once, by its own grant
    assert budget.status_sync().extra["wakeups"] == 1000
    assert_empty(budget)


# ----------------------------------------------------------------------------- cancellation, races


async def test_cancellation_while_waiting_removes_the_waiter() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(10)
    outcome: list[str] = []

    async def waiter(scope_box: list[anyio.CancelScope]) -> None:
        with anyio.CancelScope() as scope:
            scope_box.append(scope)
            await budget.acquire(4)
            outcome.append("admitted")
        outcome.append("cancelled" if scope.cancelled_caught else "done")

    box: list[anyio.CancelScope] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, box)
        await wait_until(lambda: waiting(budget) == 1, "parked")
        box[0].cancel()
    assert outcome == ["cancelled"]
    assert waiting(budget) == 0
    await holder.release()
    assert_empty(budget)  # nothing was granted to the departed waiter


async def test_cancelling_a_starving_head_lets_the_line_move() -> None:
    budget = LocalBudget(10, starvation_bound_s=0)  # no backfill: the big head blocks the small one
    holder = await budget.acquire(6)
    box: list[anyio.CancelScope] = []
    got: list[Lease] = []

    async def big() -> None:
        with anyio.CancelScope() as scope:
            box.append(scope)
            await budget.acquire(8)

    async def small() -> None:
        got.append(await budget.acquire(2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(big)
        await wait_until(lambda: waiting(budget) == 1, "big parked")
        tg.start_soon(small)
        await wait_until(lambda: waiting(budget) == 2, "small parked behind big")
        box[0].cancel()
        await wait_until(lambda: len(got) == 1, "small admitted once big left")
    await got[0].release()
    await holder.release()
    assert_empty(budget)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_grant_racing_a_cancellation_is_released_not_leaked() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(10)
    task = asyncio.get_running_loop().create_task(budget.acquire(10))
    await wait_until(lambda: waiting(budget) == 1, "parked")
    # In one step, without yielding: the release grants the waiter, then the waiter is cancelled
    # before it can run. The cancellation is thrown into its wait; it must give the lease back.
    holder.release_sync()
    assert budget.status_sync().leases == 1  # the grant happened
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budget.status_sync().extra["granted"] == 2
    assert_empty(budget)


async def test_scope_cancelled_right_after_grant_leaks_nothing() -> None:
    # anyio does not throw into a task whose wait already completed, so the waiter may either get the
    # lease (and release it on leaving the block, at its next checkpoint) or be cancelled; never a leak.
    budget = LocalBudget(10)
    holder = await budget.acquire(10)
    box: list[anyio.CancelScope] = []
    result: list[str] = []

    async def waiter() -> None:
        with anyio.CancelScope() as scope:
            box.append(scope)
            async with budget.lease(10):
                result.append("admitted")
                await anyio.sleep(3600)
        result.append("cancelled" if scope.cancelled_caught else "not cancelled")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_until(lambda: waiting(budget) == 1, "parked")
        holder.release_sync()
        box[0].cancel()
    assert result[-1] == "cancelled"
    assert_empty(budget)


async def test_sync_waiter_interrupted_after_grant_releases_the_lease() -> None:
    budget = LocalBudget(5)
    holder = budget.acquire_sync(5)
    box: dict[str, object] = {}

    class Interrupt(BaseException):
        pass

    class InterruptedAfterWake(threading.Event):
        # A wait that ends with an exception right after the grant (like KeyboardInterrupt).
        def wait(self, timeout: float | None = None) -> bool:
            super().wait(timeout)
            raise Interrupt

    budget._new_sync_event = InterruptedAfterWake  # type: ignore[method-assign]

    def thread_main() -> None:
        try:
            budget.acquire_sync(5)
        except Interrupt:
            box["interrupted"] = True

    t = threading.Thread(target=thread_main)
    t.start()
    await wait_until(lambda: waiting(budget) == 1, "thread parked")
    await holder.release()
    await anyio.to_thread.run_sync(t.join)
    assert box == {"interrupted": True}
    assert_empty(budget)


async def test_release_is_idempotent() -> None:
    budget = LocalBudget(10)
    a = await budget.acquire(4)
    b = await budget.acquire(3)
    await a.release()
    await a.release()
    a.release_sync()
    assert a.released
    s = budget.status_sync()
    assert (s.used, s.leases) == (3, 1)
    a.report_held(2)  # after release: ignored, never raises
    assert budget.status_sync().held == 3
    b.release_sync()
    await b.release()
    assert_empty(budget)


async def test_lease_context_releases_on_error() -> None:
    budget = LocalBudget(10)
    with pytest.raises(RuntimeError, match="boom"):
        async with budget.lease(7):
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with budget.lease_sync(7):
            raise RuntimeError("boom")
    assert_empty(budget)


# ----------------------------------------------------------------------------- errors and timeouts


async def test_lease_too_large_fails_at_once_even_when_busy() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(10)
    with pytest.raises(LeaseTooLarge) as exc:
        await budget.acquire(11, timeout=None)  # would hang forever if it queued
    assert exc.value.blocks == 11 and exc.value.limit == 10 and "limit_blocks" in str(exc.value)
    with pytest.raises(LeaseTooLarge):
        budget.acquire_sync(11)
    await holder.release()
    assert_empty(budget)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4", True, None])
async def test_bad_weights_are_configuration_errors(bad: object) -> None:
    budget = LocalBudget(10)
    with pytest.raises(ConfigurationError):
        await budget.acquire(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        budget.acquire_sync(bad)  # type: ignore[arg-type]
    assert_empty(budget)


def test_bad_constructor_arguments_are_configuration_errors() -> None:
    for kwargs in ({"limit_blocks": 0}, {"limit_blocks": 1.5}, {"limit_blocks": 10, "block_size": 0},
                   {"limit_blocks": 10, "starvation_bound_s": -1}, {"limit_blocks": 10, "policy": "nope"}):
        with pytest.raises(ConfigurationError):
            LocalBudget(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="timeout"):
        LocalBudget(10).acquire_sync(1, timeout=-1)


async def test_admission_timeout_removes_the_waiter() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(8)
    with pytest.raises(AdmissionTimeout, match="raise the timeout"):
        await budget.acquire(5, timeout=0.05)
    assert waiting(budget) == 0
    with pytest.raises(AdmissionTimeout):
        budget.acquire_sync(5, timeout=0.05)
    with pytest.raises(AdmissionTimeout):
        await budget.acquire(5, timeout=0)
    assert waiting(budget) == 0
    ok = await budget.acquire(2, timeout=0)  # fits: admitted without waiting
    await ok.release()
    await holder.release()
    assert_empty(budget)


# ----------------------------------------------------------------------------- limit changes


async def test_raising_the_limit_admits_waiters() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(10)
    got: list[Lease] = []

    async def waiter() -> None:
        got.append(await budget.acquire(5))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        tg.start_soon(waiter)
        await wait_until(lambda: waiting(budget) == 2, "parked")
        await budget.set_limit(20)
        await wait_until(lambda: len(got) == 2, "both admitted by the raise")
    assert budget.limit == 20 and budget.status_sync().used == 20
    for lease in [holder, *got]:
        await lease.release()
    assert_empty(budget)


async def test_lowering_the_limit_pauses_admission_without_revoking() -> None:
    budget = LocalBudget(10)
    holder = await budget.acquire(8)
    await budget.set_limit(5)
    assert not holder.released and budget.status_sync().used == 8  # not revoked
    got: list[Lease] = []
    rejected: list[BaseException] = []

    async def waiter(blocks: int) -> None:
        try:
            got.append(await budget.acquire(blocks))
        except LeaseTooLarge as exc:
            rejected.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, 1)
        tg.start_soon(waiter, 5)
        await wait_until(lambda: waiting(budget) == 2, "paused")
        await budget.set_limit(4)  # the 5-block waiter can now never fit: it fails
        await wait_until(lambda: len(rejected) == 1, "rejected")
        assert got == [] and waiting(budget) == 1
        await holder.release()
        await wait_until(lambda: len(got) == 1, "admitted once used fits")
    assert "lowered" in str(rejected[0])
    await got[0].release()
    assert_empty(budget)


# ----------------------------------------------------------------------------- sync / cross-thread


async def test_sync_release_in_a_thread_wakes_an_async_waiter_and_vice_versa() -> None:
    budget = LocalBudget(4)
    thread_lease = await anyio.to_thread.run_sync(budget.acquire_sync, 4)
    got: list[Lease] = []

    async def waiter() -> None:
        got.append(await budget.acquire(4))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_until(lambda: waiting(budget) == 1, "task parked")
        await anyio.to_thread.run_sync(thread_lease.release_sync)  # released from another thread
        await wait_until(lambda: len(got) == 1, "task woken by the thread's release")

    thread_got: list[Lease] = []
    t = threading.Thread(target=lambda: thread_got.append(budget.acquire_sync(4, timeout=60)))
    t.start()
    await wait_until(lambda: waiting(budget) == 1, "thread parked")
    await got[0].release()  # the task's release wakes the thread
    await anyio.to_thread.run_sync(t.join)
    assert len(thread_got) == 1
    thread_got[0].release_sync()
    assert_empty(budget)


def test_lease_sync_works_in_a_program_that_never_starts_an_event_loop() -> None:
    script = textwrap.dedent(
        """
        import asyncio, threading, time

        def no_loops(*a, **k):
            raise AssertionError("an event loop was started")

        asyncio.new_event_loop = no_loops
        asyncio.run = no_loops
        from zp_client import LocalBudget

        budget = LocalBudget(10)
        lock = threading.Lock()
        live = [0, 0]

        def work(seed):
            for i in range(40):
                with budget.lease_sync(1 + (seed + i) % 6, timeout=60) as lease:
                    with lock:
                        live[0] += lease.bound
                        live[1] = max(live[1], live[0])
                    time.sleep(0.0005)
                    with lock:
                        live[0] -= lease.bound

        threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        s = budget.status_sync()
        assert live[1] <= 10, live
        assert (s.used, s.leases, s.extra["granted"]) == (0, 0, 320), s
        print("ok", live[1])
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


# ----------------------------------------------------------------------------- tickets, status


async def test_ticket_reuse_keeps_place_in_line() -> None:
    budget = LocalBudget(10)
    first = await budget.acquire(10)
    order: list[str] = []
    urgent_box: list[Lease] = []

    async def waiter(name: str, priority: int = 0, ticket: Ticket | None = None) -> None:
        lease = await budget.acquire(10, priority=priority, ticket=ticket)
        order.append(name)
        if name == "urgent":
            urgent_box.append(lease)
            return
        await lease.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter, "later1")
        await wait_until(lambda: waiting(budget) == 1, "later1 parked")
        tg.start_soon(waiter, "later2")
        tg.start_soon(waiter, "urgent", -1)
        await wait_until(lambda: waiting(budget) == 3, "all parked")
        await first.release()  # the first attempt failed; the urgent one takes the blocks
        await wait_until(lambda: order == ["urgent"], "urgent admitted")
        tg.start_soon(waiter, "retry", 0, first.ticket)  # the retry comes back with its ticket
        await wait_until(lambda: waiting(budget) == 3, "retry parked")
        await urgent_box[0].release()
    assert order == ["urgent", "retry", "later1", "later2"]
    assert_empty(budget)


async def test_status_reports_held_waiters_and_head_age() -> None:
    budget = LocalBudget(10, block_size=32)
    lease = await budget.acquire(6, held=2)
    lease.report_held(4)
    lease.report_held(99)  # clamped to the bound
    s = await budget.status()
    assert (s.limit, s.used, s.free, s.held, s.leases, s.block_size) == (10, 6, 4, 6, 1, 32)
    assert lease.held == 6

    async def waiter() -> None:
        async with budget.lease(5, priority=2):
            pass

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await wait_until(lambda: waiting(budget) == 1, "parked")
        s = await budget.status()
        assert s.waiters[2].waiters == 1 and s.waiters[2].weight == 5 and s.head_wait_s >= 0
        await lease.release()
    assert_empty(budget)
    await budget.aclose()


async def test_a_timeout_that_loses_the_race_to_a_grant_returns_the_lease() -> None:
    budget = LocalBudget(5)
    holder = budget.acquire_sync(5)

    class GrantedButTimedOut(threading.Event):
        # The wait reports a timeout although the grant arrived just before it.
        def wait(self, timeout: float | None = None) -> bool:
            super().wait(None)
            return False

    budget._new_sync_event = GrantedButTimedOut  # type: ignore[method-assign]
    got: list[Lease] = []
    t = threading.Thread(target=lambda: got.append(budget.acquire_sync(5, timeout=60)))
    t.start()
    await wait_until(lambda: waiting(budget) == 1, "thread parked")
    holder.release_sync()
    await anyio.to_thread.run_sync(t.join)
    assert len(got) == 1 and not got[0].released  # admitted, not AdmissionTimeout
    assert budget.status_sync().used == 5
    got[0].release_sync()
    assert_empty(budget)


def test_from_settings_takes_block_size_and_starvation_bound() -> None:
    from zp_client.config import Settings

    budget = LocalBudget.from_settings(100, Settings(block_size=32, starvation_bound_s=0.5))
    s = budget.status_sync()
    assert (s.limit, s.block_size, s.extra["starvation_bound_s"]) == (100, 32, 0.5)
