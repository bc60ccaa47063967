"""An abandoned stream releases its lease at once, without the garbage collector (issue 33, item 2).

openai's ``Stream`` / ``AsyncStream`` hold their own iterator, whose frame holds the stream: a
reference cycle, so a stream its caller dropped (``del``, a ``break`` out of ``async for`` and
returning, a task cancelled between two chunks) kept its connection and its lease until the garbage
collector ran, or the 300 s idle watchdog. Every test here runs with ``gc.disable()`` against real HTTP
on loopback (tests/_asgi_server.py's ``slow`` model streams a chunk every 20 ms until the client goes
away), through ``wrap()`` and zp's own clients."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest
from _asgi_server import LoopbackServer

from zp_client import AsyncClient, Client, wrap
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings

pytestmark = [pytest.mark.anyio, pytest.mark.openai_compat]

MSGS = [{"role": "user", "content": "q"}]
SETTINGS = Settings(estimator="heuristic", max_model_len=4096)
N = 50


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def no_gc() -> Iterator[None]:
    gc.collect()  # what earlier tests left: not ours to count
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _released_within(budget: LocalBudget, seconds: float) -> float:
    """Seconds until the budget holds no lease (polled), or fails after ``seconds``."""
    start = time.monotonic()
    while (st := await budget.status()).leases:
        if time.monotonic() - start > seconds:
            raise AssertionError(f"{st.leases} leases ({st.used} blocks) still held {seconds} s after "
                                 "abandonment")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def _server_aborted(server: LoopbackServer) -> None:
    deadline = time.monotonic() + 10
    while server.slow_streams_open and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert server.slow_streams_open == 0


def _async_wrapped(server: LoopbackServer, budget: LocalBudget) -> Any:
    return wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="x", timeout=30), budget=budget,
                settings=SETTINGS)


@pytest.mark.faults
@pytest.mark.parametrize("how", ["del", "break", "never-read"])
async def test_fifty_dropped_openai_streams_are_released_at_once(server: LoopbackServer, no_gc: None,
                                                                 how: str, fault_report: Any) -> None:
    budget = LocalBudget(limit_blocks=100_000)
    client = _async_wrapped(server, budget)

    async def one() -> None:
        stream = await client.chat.completions.create(model="slow", max_tokens=3000, stream=True,
                                                     messages=MSGS)  # type: ignore[arg-type]
        if how != "never-read":
            async for _ in stream:
                break  # no close(): the caller walks away
        if how == "del":
            del stream

    try:
        await asyncio.gather(*(one() for _ in range(N)))
        abandoned_with = (await budget.status()).used
        try:
            took = await _released_within(budget, 1.0)
        finally:
            st = await budget.status()
            fault_report(f"{N} abandoned streams ({how}, gc disabled)",
                         f"the caller drops each stream ({how}) without close()", leaked_blocks=st.used,
                         recover_s=None if st.leases else took, recover_bound_s=1.0,
                         notes=f"{abandoned_with} blocks held just after the last drop; recover: until all "
                               "leases are back")
        await _server_aborted(server)  # the connection was closed: the server stopped generating
    finally:
        await client.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_dropped_sync_openai_stream_is_released_at_once(server: LoopbackServer, no_gc: None) -> None:
    budget = LocalBudget(limit_blocks=100_000)
    client = wrap(openai.OpenAI(base_url=server.base_url, api_key="x", timeout=30), budget=budget,
                  settings=SETTINGS)

    def one() -> None:
        stream = client.chat.completions.create(model="slow", max_tokens=3000, stream=True,
                                               messages=MSGS)  # type: ignore[arg-type]
        for _ in stream:
            break

    try:
        for _ in range(5):
            await anyio.to_thread.run_sync(one)
        await _released_within(budget, 1.0)
        await _server_aborted(server)
    finally:
        client.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_zp_clients_dropped_streams_are_released_at_once(server: LoopbackServer, no_gc: None) -> None:
    budget = LocalBudget(limit_blocks=100_000)
    aclient = AsyncClient(base_url=server.base_url, api_key="x", budget=budget, settings=SETTINGS)
    sclient = Client(base_url=server.base_url, api_key="x", budget=budget, settings=SETTINGS)

    async def one_async() -> None:
        stream = await aclient.chat.completions.create(model="slow", max_tokens=3000, stream=True,
                                                      messages=MSGS)
        async for _ in stream:
            break

    def one_sync() -> None:
        stream = sclient.chat.completions.create(model="slow", max_tokens=3000, stream=True, messages=MSGS)
        for _ in stream:
            break

    try:
        await asyncio.gather(*(one_async() for _ in range(10)))
        await anyio.to_thread.run_sync(one_sync)
        await _released_within(budget, 1.0)
        await _server_aborted(server)
    finally:
        await aclient.aclose()
        sclient.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_randomly_cancelled_requests_leak_nothing_without_the_collector(server: LoopbackServer,
                                                                               no_gc: None) -> None:
    """Tasks cancelled at random points (waiting for the answer, inside a read, between two reads while
    the caller does its own work) and streams dropped half-read: nothing stays held, and the requests
    nobody cancelled complete."""
    rng = random.Random(33)
    budget = LocalBudget(limit_blocks=100_000)
    client = _async_wrapped(server, budget)
    done: list[int] = []

    async def one(i: int) -> None:
        model = "slow" if i % 2 else "ok"
        stream = await client.chat.completions.create(model=model, max_tokens=6, stream=True,
                                                     messages=MSGS)  # type: ignore[arg-type]
        got = 0
        async for _ in stream:
            got += 1
            await asyncio.sleep(rng.random() * 0.01)  # the caller's own work between two chunks
            if model == "slow" and got >= 3:
                return  # a half-read stream, dropped
        done.append(i)

    try:
        tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
        cancelled = set(rng.sample(range(200), 100))
        for i in sorted(cancelled, key=lambda _: rng.random()):
            await asyncio.sleep(rng.random() * 0.002)
            tasks[i].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results
        finished_ok = {i for i in range(0, 200, 2) if i not in cancelled}
        assert finished_ok <= set(done)  # the ones nobody cancelled got their whole answer
        # a cancelled task's error holds its frames (and the stream in them): the caller lets go of them
        del results, tasks
        await _released_within(budget, 1.0)
        assert (await budget.status()).used == 0
        await _server_aborted(server)
    finally:
        await client.close()


_DIRECT = r"""
import asyncio, gc, sys, time
import httpx, openai
from _asgi_server import LoopbackServer
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.transport import transport_classes
from zp_client._admission.httplib import module_of

async def main():
    gc.disable()
    with LoopbackServer() as server:
        budget = LocalBudget(limit_blocks=100_000)
        probe = openai.AsyncOpenAI(api_key="x")
        mod = module_of(probe._client)
        t = transport_classes(mod).AsyncAdmissionTransport(
            budget=budget, settings=Settings(estimator="heuristic", max_model_len=4096))
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x",
                                    http_client=mod.AsyncClient(transport=t, timeout=30))
        for _ in range(10):
            stream = await client.chat.completions.create(model="slow", max_tokens=3000, stream=True,
                                                         messages=[{"role": "user", "content": "q"}])
            async for _ in stream:
                break
            del stream
        start = time.monotonic()
        while (await budget.status()).leases and time.monotonic() - start < 1.0:
            await asyncio.sleep(0.01)
        print("held", (await budget.status()).leases)

asyncio.run(main())
"""


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_an_openai_client_over_the_transport_without_wrap_releases_dropped_streams_too() -> None:
    """The documented other way in (``AsyncAdmissionTransport`` as an openai client's transport, no
    ``wrap()``), in a fresh interpreter: no earlier ``wrap()`` has prepared openai's streams there."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _DIRECT], capture_output=True, text=True, timeout=60,
                          env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "held 0", proc.stdout


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.skipif(not getattr(__import__("select"), "POLLRDHUP", 0),
                    reason="needs poll()'s POLLRDHUP (Linux)")
async def test_a_connection_the_server_ended_releases_an_unread_stream(server: LoopbackServer,
                                                                        no_gc: None) -> None:
    """The ``reset`` model sends two chunks, then the server drops the connection: the server holds no KV
    for the request any more. Fifty callers still hold their streams but read no further: the leases go
    back anyway (the idle watchdog would wait 300 s), and what was sent stays readable."""
    budget = LocalBudget(limit_blocks=100_000)
    client = _async_wrapped(server, budget)
    streams = []
    try:
        for _ in range(N):
            stream = await client.chat.completions.create(model="reset", max_tokens=100, stream=True,
                                                         messages=MSGS)  # type: ignore[arg-type]
            streams.append(stream)
        await _released_within(budget, 1.0)
        got = []
        with pytest.raises(Exception) as info:  # the cut still surfaces to whoever reads on  # noqa: PT011
            async for chunk in streams[0]:
                got.append(chunk)
        # openai 3.x says APIConnectionError; 2.x passes the transport's error on as it is
        assert type(info.value).__name__ in ("APIConnectionError", "RemoteProtocolError"), info.value
        assert got  # the chunks the server sent before it ended
        assert len(streams) == N  # all still referenced: released because the server ended them
    finally:
        await client.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_task_cancelled_between_two_reads_releases_its_stream(server: LoopbackServer,
                                                                      no_gc: None) -> None:
    """The reading task is cancelled while it does its own work between two chunks, the stream in its
    frame: asyncio keeps that frame (task <-> CancelledError <-> traceback: a cycle), so the stream is not
    dropped until the garbage collector runs. The task's end releases it (before: held until then)."""
    budget = LocalBudget(limit_blocks=100_000)
    client = _async_wrapped(server, budget)
    reading = asyncio.Event()

    async def reader() -> None:
        stream = await client.chat.completions.create(model="slow", max_tokens=3000, stream=True,
                                                     messages=MSGS)  # type: ignore[arg-type]
        async for _ in stream:
            reading.set()
            await asyncio.sleep(10)  # the caller's own work: cancelled here

    try:
        tasks = [asyncio.ensure_future(reader()) for _ in range(20)]
        await asyncio.wait_for(reading.wait(), 10)
        await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the tasks (and their errors) stay referenced
        await _released_within(budget, 1.0)
        await _server_aborted(server)
        assert all(t.cancelled() for t in tasks)
    finally:
        await client.close()
