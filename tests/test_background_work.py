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
import redis

import zp_client
from tests._asgi_server import LoopbackServer
from zp_client import Fleet, LocalBudget, RedisBudget, Settings, wrap
from zp_client._admission.release import Holder
from zp_client._tasks import LoopRef, ServiceThread, Supervisor
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
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"*{redis_prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


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
