"""Who releases a lease and when (zp_client/_admission/release.py): a holder releases once, deferred
releases go at once when their budget closes, alarms fire unless cancelled."""

from __future__ import annotations

import threading

import anyio
import pytest

from zp_client._admission.release import Holder, alarms, deadline_exceeded, deferred
from zp_client.clock import SYSTEM_CLOCK
from zp_client.budget.local import LocalBudget
from zp_client.errors import DeadlineExceeded


def _held(budget: LocalBudget, blocks: int = 4, *, is_async: bool = False) -> Holder:
    return Holder(budget.acquire_sync(blocks), 60.0, is_async=is_async, budget=budget)


def test_a_holder_releases_its_lease_once_however_often_it_is_asked() -> None:
    budget = LocalBudget(100, policy="strict")
    holder = _held(budget)
    assert budget.status_sync().used == 4 and not holder.done
    holder.release_sync()
    holder.release_sync()
    holder.abandon()
    assert holder.done and budget.status_sync().used == 0 and budget.status_sync().leases == 0


@pytest.mark.anyio
async def test_an_async_release_and_a_racing_one_leave_the_budget_whole() -> None:
    budget = LocalBudget(100, policy="strict")
    holder = _held(budget, is_async=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(holder.release)
        tg.start_soon(holder.release)
    assert budget.status_sync().used == 0


def test_deferred_releases_of_a_closing_budget_go_at_once_and_only_its_own() -> None:
    # the process's one timer (a test's own would leave another thread behind)
    before = deferred.pending()
    mine, other = LocalBudget(100, policy="strict"), LocalBudget(100, policy="strict")
    a, b = _held(mine), _held(other)
    a.release_later(3600.0)  # through the process's one DeferredCalls (zp_client._tasks), keyed by budget
    b.release_later(3600.0)
    assert deferred.pending() == before + 2
    assert deferred.run_now(mine) == 1
    assert a.done and mine.status_sync().used == 0
    assert not b.done and other.status_sync().used == 4 and deferred.pending() == before + 1
    assert deferred.run_now(other) == 1 and deferred.pending() == before


def test_a_deferred_release_goes_when_it_is_due() -> None:
    budget = LocalBudget(100, policy="strict")
    holder = _held(budget)
    holder.release_later(0.0)
    for _ in range(500):  # the timer thread runs it: wait for it, never for a fixed time
        if holder.done:
            break
        threading.Event().wait(0.01)
    assert holder.done and budget.status_sync().used == 0


def test_an_alarm_fires_when_due_and_a_cancelled_one_never() -> None:
    fired = threading.Event()
    cancelled: list[str] = []
    token = alarms.at(SYSTEM_CLOCK.monotonic() + 0.05, lambda: cancelled.append("fired"))
    alarms.cancel(token)
    alarms.at(SYSTEM_CLOCK.monotonic() + 0.1, fired.set)  # due after the cancelled one
    assert fired.wait(10.0)
    assert cancelled == []


def test_the_deadline_error_says_where_the_call_was() -> None:
    err = deadline_exceeded("while reading the server's answer")
    assert isinstance(err, DeadlineExceeded) and "while reading the server's answer" in str(err)
