"""Every task and thread zp starts has an owner that stops it (zp_client/_tasks.py, docs/admission.md
#background-work): after ``aclose()`` nothing of zp's runs, whatever was used; the owners stop their work
in a defined order; under trio a lease goes back through the async release, never ``release_sync``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

import zp_client
from tests._asgi_server import LoopbackServer
from tests._redis_keys import delete_keys_containing
from zp_client import Fleet, LocalBudget, RedisBudget, Settings, wrap
from zp_client._admission.release import Holder
from zp_client._tasks import LoopRef, ServiceThread, Supervisor, wait_event
from zp_client.fleet.redis import RedisFleet

PACKAGE = str(Path(zp_client.__file__).parent)
REPLICAS = ["http://127.0.0.1:9/v1", "http://127.0.0.2:9/v1"]  # never answered: the checks just fail


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def redis_name(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield redis_prefix
    delete_keys_containing(redis_url, redis_prefix)


def zp_tasks() -> list[str]:
    """The running loop's tasks that are zp's: named ``zp-...`` or running a coroutine of the package."""
    found = []
    for t in asyncio.all_tasks():
        if t is asyncio.current_task():
            continue
        code = getattr(t.get_coro(), "cr_code", None)
        if t.get_name().startswith("zp-") or (code is not None and code.co_filename.startswith(PACKAGE)):
            found.append(t.get_name())
    return found


def zp_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zp-")]


async def _stream(client: Any) -> None:
    stream = await client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True)
    async for _ in stream:
        pass


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_local_budget_closes() -> None:
    budget = LocalBudget(limit_blocks=100)
    async with budget.lease(3):
        pass
    await anyio.to_thread.run_sync(lambda: budget.lease_sync(2).__enter__().release_sync())
    await budget.aclose()
    assert zp_tasks() == [] and zp_threads() == []


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_redis_budget_closes(redis_url: str, redis_name: str) -> None:
    budget = await RedisBudget.create(redis_url, redis_name, limit_blocks=100)
    async with budget.lease(3):
        assert any(name.startswith("zp-redis") for name in zp_tasks())  # its owner started them
    # the blocking face starts its own threads (keeper, pump)
    await anyio.to_thread.run_sync(lambda: budget.lease_sync(2).__enter__().release_sync())
    await budget.aclose()
    assert zp_tasks() == [] and zp_threads() == []


@pytest.mark.anyio
async def test_wait_event_never_swallows_a_cancellation_that_arrives_as_the_event_is_set() -> None:
    # asyncio.wait_for(event.wait(), t) on Python 3.11 returns the event's result to a caller cancelled in
    # the same tick as the event is set (gh-86296): a loop waiting so runs on after one cancel
    ev = asyncio.Event()

    async def loop() -> None:
        while True:
            await wait_event(ev, 10)
            ev.clear()

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0)  # waiting on the event
    ev.set()
    task.cancel()
    await asyncio.wait({task}, timeout=2)
    assert task.cancelled()
    # and it waits as it should: until the event, or the timeout
    t0 = asyncio.get_running_loop().time()
    await wait_event(asyncio.Event(), 0.05)
    assert asyncio.get_running_loop().time() - t0 >= 0.04
    ev2 = asyncio.Event()
    asyncio.get_running_loop().call_later(0.01, ev2.set)
    await asyncio.wait_for(wait_event(ev2, 30), 5)


@pytest.mark.anyio
async def test_a_redis_budgets_keeper_ends_on_one_cancel_that_meets_its_wake_up(
        redis_url: str, redis_name: str) -> None:
    # What asyncio.run does at exit to a budget not closed: cancel each task once. The keeper's wake-up
    # set in the same tick must not make it run on (the hang behind a flaky fleet test under load).
    budget = await RedisBudget.create(redis_url, redis_name, limit_blocks=100)
    lease = await budget.acquire(3)
    keeper = next(t for t in asyncio.all_tasks() if t.get_name() == "zp-redis-keeper")
    await asyncio.sleep(0.3)  # its connections opened: it waits for its round (TTL / 3) or a wake-up
    budget._get_side().fresh_hint.set()
    keeper.cancel()
    await asyncio.wait({keeper}, timeout=2)
    assert keeper.cancelled()
    await lease.release()
    await budget.aclose()


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_fleet_closes() -> None:
    fleet = await Fleet(REPLICAS, limit_blocks=100).start()
    async with fleet.lease(3):
        assert zp_tasks()  # the health checks run
    await fleet.aclose()
    assert zp_tasks() == [] and zp_threads() == []


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_redis_fleet_closes(redis_url: str, redis_name: str) -> None:
    fleet = RedisFleet(redis_url, redis_name, REPLICAS, 100, recovery_s=0)
    async with fleet.lease(3):
        pass
    await fleet.aclose()
    assert zp_tasks() == [] and zp_threads() == []


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_wrapped_client_closes(server: LoopbackServer) -> None:
    budget = LocalBudget(limit_blocks=1000)
    client = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="k", timeout=30), budget=budget,
                  settings=Settings(estimator="heuristic"))
    await _stream(client)
    assert "zp-idle-watchdog" in zp_threads()  # a streamed body is watched while open
    await client.close()
    await budget.aclose()
    assert zp_tasks() == [] and zp_threads() == []


def test_nothing_of_zp_runs_after_a_blocking_wrapped_client_closes(server: LoopbackServer) -> None:
    budget = LocalBudget(limit_blocks=1000)
    client = wrap(openai.OpenAI(base_url=server.base_url, api_key="k", timeout=30), budget=budget,
                  settings=Settings(estimator="heuristic", deadline_s=30))
    for _ in client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, stream=True):
        pass
    assert zp_threads()  # the deadline's alarm and the watchdog ran
    client.close()
    assert zp_threads() == []


@pytest.mark.anyio
async def test_a_supervisor_finishes_background_work_then_cancels_tasks_newest_first_then_joins_threads(
) -> None:
    sup = Supervisor("test")
    events: list[str] = []
    stop = threading.Event()

    async def forever(name: str) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            events.append(f"cancelled {name}")

    async def short() -> None:
        await asyncio.sleep(0.01)
        events.append("background done")

    def worker() -> None:
        stop.wait()
        events.append("thread stopped")

    sup.spawn(forever("first"), name="zp-test-first")
    sup.spawn(forever("second"), name="zp-test-second")
    sup.background(short())
    t = sup.thread(worker, name="zp-test-thread", stop=stop.set)
    await asyncio.sleep(0)
    await sup.aclose()
    assert events == ["background done", "cancelled second", "cancelled first", "thread stopped"]
    assert not t.is_alive() and sup.closed and zp_tasks() == []


@pytest.mark.anyio
async def test_a_supervisor_cancels_again_a_task_that_lost_its_cancellation() -> None:
    """On Python 3.10/3.11 ``asyncio.wait_for`` (redis-py runs every call under it) can return the reply
    and drop a cancellation that lands with it: the task goes on. The close cancels it again."""
    sup = Supervisor("test")
    lost: list[int] = []

    async def loses_the_first_cancellation() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost.append(1)  # as wait_for does: the reply returned, the cancellation gone
        await asyncio.sleep(3600)

    task = sup.spawn(loses_the_first_cancellation(), name="zp-test-lossy")
    await asyncio.sleep(0)
    await sup.aclose()
    assert lost == [1] and task.cancelled() and zp_tasks() == []


def test_a_service_thread_runs_while_it_has_work_and_ends_without() -> None:
    work: list[int] = [3]
    done = threading.Event()

    def step() -> float | None:
        if not work[0]:
            done.set()
            return None
        work[0] -= 1
        return 0.001

    service = ServiceThread("zp-test-service", step, lambda: bool(work[0]))
    try:
        service.wake()
        assert done.wait(5)
        service.quiesce()
        assert not service.running and "zp-test-service" not in zp_threads()
        work[0] = 1  # new work starts it again
        done.clear()
        service.wake()
        assert done.wait(5)
        service.quiesce()
        assert not service.running
    finally:
        ServiceThread._all.remove(service)


# ---------------------------------------------------------------- trio
class _Spy:
    """Wraps a lease: counts the two ways of releasing it."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease
        self.async_releases = 0
        self.sync_releases = 0
        self.priority = lease.priority

    async def release(self) -> None:
        self.async_releases += 1
        await self.lease.release()

    def release_sync(self) -> None:
        self.sync_releases += 1
        self.lease.release_sync()


@pytest.mark.parametrize("how", ["abandon", "server_ended"])
def test_under_trio_a_lease_released_from_another_thread_goes_back_without_release_sync(how: str) -> None:
    pytest.importorskip("trio")
    budget = LocalBudget(limit_blocks=100)

    async def main() -> tuple[int, _Spy, int]:
        spy = _Spy(await budget.acquire(5))
        holder = Holder(spy, 300.0, is_async=True)  # type: ignore[arg-type]  # a Lease by duck typing
        assert holder.loop is None and holder.where is not None and holder.where.trio_token is not None
        assert LoopRef().trio_token is not None
        # from another thread, as the watchdog or a finalizer does
        await anyio.to_thread.run_sync(getattr(holder, how))
        for _ in range(100):
            if spy.async_releases:
                break
            await anyio.sleep(0.01)
        await anyio.sleep(0.01)
        return (await budget.status()).used, spy, int(holder.done)

    used, spy, done = anyio.run(main, backend="trio")
    assert (used, spy.async_releases, spy.sync_releases, done) == (0, 1, 0, 1)


@pytest.mark.anyio
async def test_closing_a_budget_first_stops_what_attached_to_it() -> None:
    from zp_client import AdaptiveLimit

    budget = LocalBudget(limit_blocks=100)
    ctl = AdaptiveLimit(budget, "http://127.0.0.1:9", poll_interval_s=3600)  # never answered: no change
    await ctl.start()
    assert budget.adaptive is ctl and "zp-adaptive-" + ctl.id in zp_tasks()
    await budget.aclose()  # the controller goes first, as if its owner had closed it
    assert budget.adaptive is None and zp_tasks() == [] and zp_threads() == []
    await ctl.aclose()  # idempotent: its owner's own close finds nothing left
    assert budget.limit == 100


# ------------------------------------------------- the owners of the rest (issue 32, second part)
class _Starts:
    """Records the zp threads started from the moment ``closed`` is set: a closed owner starts nothing."""

    def __init__(self) -> None:
        self.closed = False
        self.after_close: list[str] = []


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> _Starts:
    rec = _Starts()
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if rec.closed and self.name.startswith("zp-"):
            rec.after_close.append(self.name)
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return rec


def _wait_for(cond: Any, what: str, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_redis_budget_with_sync_waiters_closes(
        redis_url: str, redis_name: str, starts: _Starts) -> None:
    budget = await RedisBudget.create(redis_url, redis_name, limit_blocks=10, poll_interval_s=0.05)
    held = await anyio.to_thread.run_sync(lambda: budget.acquire_sync(10))
    results: list[object] = []

    def waiter() -> None:
        try:
            lease = budget.acquire_sync(5, timeout=20)
            lease.release_sync()
            results.append(lease)
        except Exception as exc:  # noqa: BLE001 - recorded
            results.append(exc)

    waiters = [threading.Thread(target=waiter, name=f"user-waiter-{i}") for i in range(3)]
    for t in waiters:
        t.start()
    await anyio.to_thread.run_sync(lambda: _wait_for(
        lambda: sum(c.waiters for c in budget.status_sync().waiters.values()) == 3, "3 sync waiters"))
    names = zp_threads()
    assert f"zp-redis-pump-{redis_name}" in names and f"zp-redis-keeper-{redis_name}" in names
    await budget.aclose()  # while three threads wait in acquire_sync
    starts.closed = True
    assert zp_tasks() == [] and zp_threads() == []
    # what the waiting threads do after the close (granted, they hold a lease) starts nothing of zp's
    await anyio.to_thread.run_sync(held.release_sync)
    for t in waiters:
        await anyio.to_thread.run_sync(t.join, 30)
    assert len(results) == 3 and zp_threads() == [] and starts.after_close == []


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_redis_budgets_shared_forecaster_closes(
        redis_url: str, redis_name: str, starts: _Starts) -> None:
    budget = await RedisBudget.create(redis_url, redis_name, limit_blocks=100)
    fc = budget.shared_forecaster(sync_interval_s=0.05)
    fc.observe("route", 120)
    assert f"zp-forecast-{redis_name}" in zp_threads()
    await budget.aclose()
    starts.closed = True
    assert zp_tasks() == [] and zp_threads() == []
    # asked for after the close (a client wrapped late): it forecasts, and starts no thread of its own
    late = budget.shared_forecaster(sync_interval_s=0.05)
    late.observe("route", 80)
    assert late.forecast("route") > 0
    assert zp_threads() == [] and starts.after_close == []


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_redis_budget_with_an_attached_adaptive_limit_closes(
        redis_url: str, redis_name: str) -> None:
    from zp_client import AdaptiveLimit

    budget = await RedisBudget.create(redis_url, redis_name, limit_blocks=100)
    ctl = await AdaptiveLimit(budget, "http://127.0.0.1:9", poll_interval_s=0.05).start()
    await anyio.sleep(0.2)  # it polls (and leads) a few times
    assert "zp-adaptive-" + ctl.id in zp_tasks() and ctl.leader
    await budget.aclose()
    assert budget.adaptive is None and zp_tasks() == [] and zp_threads() == []


def test_nothing_of_zp_runs_after_a_blocking_redis_budget_with_a_threaded_adaptive_limit_closes(
        redis_url: str, redis_name: str) -> None:
    """A program without an event loop: the controller on its own thread, the budget closed with
    ``close_sync()``. The close stops the controller first, and the budget's async work on the
    controller's loop (its pump, poller, keeper) goes with that loop."""
    from zp_client import AdaptiveLimit

    budget = RedisBudget.create_sync(redis_url, redis_name, limit_blocks=100)
    ctl = AdaptiveLimit(budget, "http://127.0.0.1:9", poll_interval_s=0.05).start_in_thread()
    loop = ctl._thread_loop
    assert loop is not None
    with budget.lease_sync(5):
        _wait_for(lambda: ctl.leader, "the controller leads")
    assert "zp-adaptive-" + ctl.id in zp_threads()
    budget.close_sync()
    assert zp_threads() == []
    left = [t.get_name() for t in asyncio.all_tasks(loop) if not t.done()]
    assert left == []


@pytest.mark.anyio
async def test_nothing_of_zp_runs_after_a_pinned_prefixs_budget_closes_mid_keep_warm(
        server: LoopbackServer) -> None:
    from zp_client import PinnedPrefix

    budget = LocalBudget(limit_blocks=2000, policy="elastic")
    client = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="k", timeout=30, max_retries=0),
                  budget=budget, settings=Settings(estimator="heuristic"))
    system = {"role": "system", "content": "you are a careful agent. " * 40}
    pin = await PinnedPrefix(client, model="slow", messages=[system], period_s=0.01).start()
    for _ in range(200):  # a keep-warm in flight: the "slow" model streams until the client goes away
        if pin.keepwarms_sent:
            break
        await anyio.sleep(0.01)
    await anyio.sleep(0.1)
    assert pin.keepwarms_sent and any(n.startswith("zp-keepwarm-") for n in zp_tasks())
    await budget.aclose()  # the pin goes first, its keep-warm cancelled mid-stream
    assert zp_tasks() == [] and zp_threads() == []
    assert (await budget.status()).used == 0
    await client.close()
