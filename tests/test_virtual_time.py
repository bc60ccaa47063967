"""zp_client.testing's virtual time: the loop, the in-memory streaming transport and the library's one
clock (the storm's runs on it: storm/tests/test_storm_virtual_time.py).

Everything here talks to the real simulator app and the real openai SDK (and zp's transport through
``wrap()``), over :mod:`zp_client.testing` instead of a socket; both openai majors (openai_compat).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Any

import openai
import pytest

from zp_client import LocalBudget, wrap
from zp_client.clock import LoopClock
from zp_client.errors import ConfigurationError, RetryBudgetExhausted
from zp_client.retry import RetryPolicy
from zp_client.testing import (
    VirtualTimeDeadlock,
    VirtualTimeLoop,
    memory_transport,
    openai_http_module,
    run_virtual,
)
from zp_sim.server import SimServer

pytestmark = pytest.mark.openai_compat

MSGS = [{"role": "user", "content": "tell me about virtual time, please, in some detail"}]


def _client(app: Any, **kwargs: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://sim.memory/v1", api_key="sk-test",
                              http_client=openai.DefaultAsyncHttpxClient(transport=memory_transport(app)),
                              **kwargs)


# ------------------------------------------------------------------------------------------ the loop


def test_the_loop_jumps_to_each_timer_exactly_and_takes_no_real_time() -> None:
    async def main() -> tuple[list[tuple[float, float]], float]:
        loop = asyncio.get_running_loop()
        woke: list[tuple[float, float]] = []

        async def nap(d: float) -> None:
            await asyncio.sleep(d)
            woke.append((d, loop.time()))

        t = time.perf_counter()
        await asyncio.gather(*(nap(d) for d in (3600.0, 0.25, 10.0)))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 100)
        woke.append((-1.0, loop.time()))
        return woke, time.perf_counter() - t

    woke, real = run_virtual(main())
    assert woke == [(0.25, 0.25), (10.0, 10.0), (3600.0, 3600.0), (-1.0, 3700.0)]
    assert real < 5.0  # an hour and more of virtual time; generous bound on a loaded machine


def test_the_clock_is_frozen_while_an_executor_job_runs() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        sleeper = asyncio.ensure_future(asyncio.sleep(100.0))
        await asyncio.sleep(0)
        await loop.run_in_executor(None, time.sleep, 0.2)  # outside work: no jump meanwhile
        during = loop.time()
        await sleeper
        return during, loop.time()

    during, after = run_virtual(main())
    assert during == 0.0
    assert after == 100.0


def test_a_deadlocked_loop_raises_instead_of_hanging() -> None:
    loop = VirtualTimeLoop(deadlock_s=0.1)
    try:
        with pytest.raises(VirtualTimeDeadlock, match="nothing is in flight"):
            loop.run_until_complete(asyncio.Event().wait())
    finally:
        loop.close()


def test_loop_clock_reads_the_loop_and_refuses_to_block_a_thread() -> None:
    async def main() -> tuple[float, float]:
        clock = LoopClock()
        a = clock.monotonic()
        await clock.sleep(42.0)
        with pytest.raises(ConfigurationError):
            clock.sleep_sync(1.0)
        return a, clock.monotonic()

    assert run_virtual(main(), start=5.0) == (5.0, 47.0)


# ---------------------------------------------------------------------------------- the transport


def test_chunks_arrive_at_the_virtual_time_the_simulator_emitted_them() -> None:
    """Through zp's transport (wrap) and the openai SDK: every content chunk's arrival time, read on
    the loop's clock, is exactly the engine step that produced it."""

    async def main() -> tuple[list[float], list[float]]:
        loop = asyncio.get_running_loop()
        server = SimServer("tiny", num_gpu_blocks=512)
        async with server.in_memory():
            budget = LocalBudget(limit_blocks=400, policy="strict", clock=LoopClock())
            client = wrap(_client(server.app), budget=budget)
            got: list[float] = []
            stream = await client.chat.completions.create(
                model="sim-llama", messages=MSGS, max_tokens=64, stream=True,
                extra_body={"sim_output_tokens": 40})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got.append(loop.time())
            await client.close()
            (record,) = server._sim.records.values()
            return got, list(record.token_times)

    got, emitted = run_virtual(main())
    assert len(got) == 40
    assert got == emitted
    assert got == sorted(got) and got[-1] > got[0]


def test_the_simulator_receives_the_openai_sdks_own_headers_through_wrap() -> None:
    seen: list[dict[str, str]] = []

    async def main() -> None:
        server = SimServer("tiny", num_gpu_blocks=512)

        async def recording_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
                seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await server.app(scope, receive, send)

        async with server.in_memory():
            budget = LocalBudget(limit_blocks=400, clock=LoopClock())
            client = wrap(_client(recording_app), budget=budget)
            r = await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=8,
                                                     extra_body={"sim_output_tokens": 8})
            assert r.usage is not None and r.usage.completion_tokens == 8
            await client.close()

    run_virtual(main())
    (headers,) = seen
    for name in ("x-stainless-lang", "x-stainless-package-version", "x-stainless-retry-count",
                 "x-stainless-runtime", "x-stainless-async"):
        assert name in headers, name
    assert headers["x-stainless-package-version"] == openai.__version__
    assert headers["x-stainless-async"].startswith("async")


def test_the_http_library_matches_openais_major() -> None:
    mod = openai_http_module()
    assert mod.__name__ == ("httpx" if openai.__version__.startswith("2.") else "httpx2")


def test_a_read_timeout_is_the_librarys_own_and_the_server_sees_the_client_leave() -> None:
    """openai's read timeout applies as over TCP (the SDK raises APITimeoutError after its own
    retries), and the simulator aborts what the client stopped waiting for."""

    async def main() -> tuple[float, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        # a slow profile step: 2,000 output tokens cannot finish within 1 virtual second
        server = SimServer("tiny", num_gpu_blocks=512)
        async with server.in_memory():
            client = _client(server.app, max_retries=0, timeout=1.0)
            t0 = loop.time()
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=2000,
                                                     extra_body={"sim_output_tokens": 2000})
            waited = loop.time() - t0
            for _ in range(3):
                await asyncio.sleep(0)
            stats = server.stats(requests=True)
            await client.close()
            return waited, stats

    waited, stats = run_virtual(main())
    assert waited == pytest.approx(1.0)
    assert stats["aborted_disconnect"] == 1
    assert stats["in_flight"] == 0


def test_closing_a_stream_early_aborts_it_on_the_server_and_frees_its_blocks() -> None:
    async def main() -> dict[str, Any]:
        server = SimServer("tiny", num_gpu_blocks=512)
        async with server.in_memory():
            client = _client(server.app)
            stream = await client.chat.completions.create(
                model="sim-llama", messages=MSGS, max_tokens=500, stream=True,
                extra_body={"sim_output_tokens": 500})
            n = 0
            async for chunk in stream:
                n += bool(chunk.choices and chunk.choices[0].delta.content)
                if n == 3:
                    break
            await stream.close()
            await asyncio.sleep(1.0)
            stats = server.stats()
            await client.close()
            return stats

    stats = run_virtual(main())
    assert stats["aborted_disconnect"] == 1
    assert stats["engine"]["kv_usage"] == 0.0


# ------------------------------------------------------------------------- retries in virtual time


async def _flaky_app(scope: dict[str, Any], receive: Any, send: Any, *, script: list[tuple[int, dict[str, str]]],
                     calls: list[float]) -> None:
    """An upstream answering from ``script`` (status, headers) in order, then 200 with a completion."""
    assert scope["type"] == "http"
    await receive()
    if not scope["path"].endswith("/chat/completions"):  # GET models and the like: not served here
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"not found"})
        return
    calls.append(asyncio.get_running_loop().time())
    status, headers = script.pop(0) if script else (200, {})
    if status == 200:
        body = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}).encode()
    else:
        body = json.dumps({"error": {"message": f"status {status}", "type": "x"}}).encode()
    raw = [(b"content-type", b"application/json"), *((k.encode(), v.encode()) for k, v in headers.items())]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _wrapped(script: list[tuple[int, dict[str, str]]], calls: list[float], **wrap_kw: Any) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _flaky_app(scope, receive, send, script=script, calls=calls)

    budget = LocalBudget(limit_blocks=10_000, clock=LoopClock())
    return wrap(_client(app, max_retries=0), budget=budget, **wrap_kw)


@pytest.mark.parametrize(("script", "attempts"), [
    ([(429, {"retry-after-ms": "7000"})], 2),
    ([(503, {})], 2),
    ([(400, {})], 1),
])
def test_zp_retry_rules_hold_in_virtual_time(script: list[tuple[int, dict[str, str]]], attempts: int) -> None:
    calls: list[float] = []

    async def main() -> Exception | None:
        client = _wrapped(list(script), calls)
        try:
            await client.chat.completions.create(model="m", messages=MSGS, max_tokens=4)
            return None
        except openai.APIStatusError as exc:
            return exc
        finally:
            await client.close()

    t = time.perf_counter()
    err = run_virtual(main())
    assert len(calls) == attempts
    if script[0][0] == 429:
        assert err is None
        assert calls[1] - calls[0] >= 7.0  # the server's retry-after-ms, in virtual seconds
        assert time.perf_counter() - t < 5.0  # ... and not in real ones
    elif script[0][0] == 503:
        assert err is None
    else:
        assert isinstance(err, openai.BadRequestError)


def test_attempts_are_bounded_in_virtual_time() -> None:
    calls: list[float] = []

    async def main() -> BaseException:
        client = _wrapped([(503, {})] * 20, calls, retry=RetryPolicy(max_attempts=3, clock=LoopClock()))
        try:
            with pytest.raises((openai.APIStatusError, RetryBudgetExhausted)) as info:
                await client.chat.completions.create(model="m", messages=MSGS, max_tokens=4)
            return info.value
        finally:
            await client.close()

    err = run_virtual(main())
    assert len(calls) == 3
    assert getattr(err, "status_code", None) == 503

# ---------------------------------------------------------------------------------- the loop, again


def test_timers_due_together_run_in_the_order_they_were_scheduled() -> None:
    """However unrelated timers shaped asyncio's heap, equal deadlines run first-scheduled first."""

    async def main() -> list[int]:
        order: list[int] = []
        loop = asyncio.get_running_loop()
        noise = [loop.call_at(t, lambda: None) for t in (5.0, 3.0, 9.0, 1.0, 7.0, 5.0, 2.0)]
        for i in range(12):
            loop.call_at(5.0, order.append, i)
        noise[1].cancel()
        await asyncio.sleep(6.0)
        return order

    assert run_virtual(main()) == list(range(12))


def test_a_socket_freezes_the_clock_and_an_idle_one_ends_in_an_error_not_a_hang() -> None:
    import socket

    a, b = socket.socketpair()
    loop = VirtualTimeLoop(deadlock_s=0.3)

    async def main() -> float:
        loop.add_reader(a.fileno(), lambda: a.recv(10))
        try:
            await asyncio.sleep(5.0)  # due in virtual time, but a socket is registered: frozen
        finally:
            loop.remove_reader(a.fileno())
        return loop.time()

    try:
        t = time.perf_counter()
        with pytest.raises(VirtualTimeDeadlock, match="frozen"):
            loop.run_until_complete(main())
        assert time.perf_counter() - t >= 0.3
        assert loop.time() == 0.0
    finally:
        loop.close()
        a.close()
        b.close()


def test_bytes_on_a_socket_are_delivered_while_frozen() -> None:
    import socket

    a, b = socket.socketpair()
    got: list[bytes] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def readable() -> None:
            got.append(a.recv(10))
            loop.remove_reader(a.fileno())
            done.set_result(None)

        loop.add_reader(a.fileno(), readable)
        threading.Timer(0.05, b.send, args=(b"hello",)).start()
        await done

    try:
        run_virtual(main())
    finally:
        a.close()
        b.close()
    assert got == [b"hello"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.Runner is Python 3.11+")
def test_asyncio_runner_works_and_executor_shutdown_does_not_jump_the_clock() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, time.sleep, 0.01)
        await asyncio.sleep(3.0)
        return loop.time()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        assert runner.run(main()) == 3.0


def test_closing_the_memory_transport_cancels_an_app_that_ignores_the_disconnect() -> None:
    from zp_client.testing import MemoryTransport

    stuck: list[str] = []

    async def deaf_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await asyncio.sleep(10_000)  # never looks at receive() again
        except asyncio.CancelledError:
            stuck.append("cancelled")
            raise

    async def main() -> None:
        import httpx

        transport = MemoryTransport(deaf_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            async with http.stream("GET", "/") as resp:
                assert resp.status_code == 200
                await transport.aclose()

    run_virtual(main())
    assert stuck == ["cancelled"]


def test_a_missing_module_outside_the_commands_extra_keeps_its_traceback() -> None:
    from zp_client.cli import missing_extra

    assert missing_extra("status --watch", "watch", ModuleNotFoundError(name="notapackage")) is None
    assert missing_extra("status", "redis", ModuleNotFoundError(name="rich")) is None
    line = missing_extra("status --watch", "watch", ModuleNotFoundError(name="rich.console"))
    assert line is not None and "[watch]" in line


# ------------------------------------------------------------------------------- a busy client


def test_read_pauses_hold_what_arrives_in_a_busy_part_until_it_ends() -> None:
    from zp_client.testing import ReadPauses

    p = ReadPauses(0.5, burst_s=0.05)  # period 0.1 s: reading in [0, 0.05), busy in [0.05, 0.1)
    assert p.resume_at(0.0) is None and p.resume_at(0.049) is None
    assert p.resume_at(0.05) == pytest.approx(0.1) and p.resume_at(0.099) == pytest.approx(0.1)
    assert p.resume_at(1.02) is None and p.resume_at(1.07) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        ReadPauses(1.0)

