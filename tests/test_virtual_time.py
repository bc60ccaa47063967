"""The storm's virtual time: the loop, the in-memory streaming transport, the library's one clock, and
runs that are exactly reproducible from their seed.

Everything here talks to the real simulator app and the real openai SDK (and zp's transport through
``wrap()``), over :mod:`zp_client.bench.memory` instead of a socket; both openai majors (openai_compat).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from zp_client import LocalBudget, wrap
from zp_client._clock import LoopClock
from zp_client.bench.memory import memory_transport, openai_http_module
from zp_client.bench.runner import StormConfig, run_storm
from zp_client.bench.vloop import VirtualTimeDeadlock, VirtualTimeLoop, run_virtual
from zp_client.errors import ConfigurationError, RetryBudgetExhausted
from zp_client.retry import RetryPolicy
from zp_client.sim.server import SimServer

pytestmark = pytest.mark.openai_compat

ROOT = Path(__file__).resolve().parents[1]
TINY = {"streams": 6, "stream_out": 512, "rounds": 2, "burst": 3, "burst_prompt": 1200, "burst_max_tokens": 256}
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


def test_langchains_rate_limiter_runs_on_the_loops_clock_in_the_storm() -> None:
    """The rate-limited setup's limiter (LangChain's own InMemoryRateLimiter) paces in virtual time."""
    pytest.importorskip("langchain_core")
    import contextlib

    from zp_client.bench.setups import _rate_limiter_on_loop_time

    async def main() -> list[float]:
        from langchain_core.rate_limiters import InMemoryRateLimiter

        loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            _rate_limiter_on_loop_time(stack)
            limiter = InMemoryRateLimiter(requests_per_second=0.5, check_every_n_seconds=0.1, max_bucket_size=1)
            times = []
            for _ in range(4):
                await limiter.aacquire()
                times.append(loop.time())
        return times

    times = run_virtual(main())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g == pytest.approx(2.0, abs=0.11) for g in gaps), gaps
    import langchain_core.rate_limiters as rl

    assert rl.time is time  # restored after the run


# --------------------------------------------------------------------------------- determinism


def _tiny_storm(seed: int = 0) -> list[Any]:
    cfg = StormConfig(workload="seed-burst", seed=seed, setups=["no-admission", "naive", "zp-elastic"],
                      profile="tiny", num_gpu_blocks=None, workload_overrides=dict(TINY))
    _, _, runs = run_storm(cfg)
    return [(r.name, [x.to_json() for x in r.records], r.server_stats["engine"]) for r in runs]


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_virtual_time import _tiny_storm
print(json.dumps(_tiny_storm()))
"""


@pytest.mark.slow
def test_two_runs_of_one_seed_give_identical_records_even_with_another_hash_seed_and_a_busy_cpu() -> None:
    first = _tiny_storm()
    burner = threading.Event()

    def burn() -> None:  # CPU-heavy work in the same process: it takes CPU, never virtual time
        x = 0
        while not burner.is_set():
            x += sum(range(1000))

    t = threading.Thread(target=burn, daemon=True)
    t.start()
    try:
        second = _tiny_storm()
    finally:
        burner.set()
        t.join()
    assert json.dumps(first) == json.dumps(second)
    # another process with another string-hash seed: no result depends on set or dict-of-str order
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests"))], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    third = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.dumps(first) == json.dumps(third)
    # and the runs are real ones: every request was sent and answered, and the storm overflowed the
    # pool without admission (records of an empty or idle run would compare equal too)
    names = [name for name, _, _ in first]
    assert names == ["no-admission", "naive", "zp-elastic"]
    for _, recs, engine in first:
        assert len(recs) == 15 and all(rec["sent"] and rec["ok"] and rec["out_tokens"] > 0 for rec in recs)
    assert first[0][2]["preemptions_total"] > 0
    assert first[2][2]["preemptions_total"] == 0


@pytest.mark.slow
def test_another_seed_gives_another_run() -> None:
    a, b = _tiny_storm(0), _tiny_storm(1)
    assert json.dumps(a) != json.dumps(b)


# ------------------------------------------------------------------------------------ the CLI


def test_sweep_loads_are_parsed_and_bad_ones_named() -> None:
    from zp_client.bench.cli import _parse_sweep

    assert _parse_sweep("2,0.5,1,1") == [0.5, 1.0, 2.0]
    assert _parse_sweep(None) == []
    for bad in ("a,b", "0,1", "-1", ",", "inf", "nan"):
        with pytest.raises(ConfigurationError, match="--sweep"):
            _parse_sweep(bad)


def test_worker_setups_need_the_real_clock() -> None:
    cfg = StormConfig(workload="seed-burst", setups=["no-admission", "zp-redis"], profile="tiny",
                      num_gpu_blocks=None, redis_url="redis://127.0.0.1:1/0", workload_overrides=dict(TINY))
    with pytest.raises(ConfigurationError, match="--clock real"):
        run_storm(cfg)
    with pytest.raises(ConfigurationError, match="clock must be one of"):
        StormConfig(clock="wall")


def test_storm_cli_runs_a_sweep_on_the_virtual_clock(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    from zp_client.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": 0.05 * i, "prompt_tokens": 300 + 40 * i,
                                         "max_tokens": 256, "output_tokens": 60 + 10 * i}) + "\n"
                             for i in range(12)))
    out = tmp_path / "sweep"
    rc = main(["storm", "--trace", str(trace), "--profile", "tiny", "--num-gpu-blocks", "128",
               "--setups", "no-admission,zp-elastic", "--sweep", "1,2", "--quiet", "--out", str(out)])
    assert rc == 0  # a virtual run cannot saturate the harness
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["loads"] == [1.0, 2.0]
    assert (out / "sweep.png").stat().st_size > 10_000
    sizes = {}
    for x in ("1", "2"):
        report = json.loads((out / f"load-{x}" / "report.json").read_text())
        assert report["server"]["clock"] == "virtual"
        assert [m["setup"] for m in report["setups"]] == ["no-admission", "zp-elastic"]
        sizes[x] = len(report["requests"]["no-admission"])
    assert sizes == {"1": 12, "2": 24}  # twice the offered load: every request twice


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
    from zp_client.bench.memory import MemoryTransport

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

    assert missing_extra("storm", "bench", ModuleNotFoundError(name="notapackage")) is None
    assert missing_extra("status", "redis", ModuleNotFoundError(name="rich")) is None
    line = missing_extra("storm", "bench", ModuleNotFoundError(name="rich.console"))
    assert line is not None and "[bench]" in line


# ------------------------------------------------------------------------------- a busy client


def test_client_load_takes_a_sane_fraction_and_on_the_virtual_clock_keeps_the_simulator_in_process() -> None:
    with pytest.raises(ConfigurationError, match=r"\[0, 1\)"):
        StormConfig(clock="real", client_load=1.0)
    assert StormConfig(client_load=0.5).sim_in_process  # virtual: modelled by read pauses
    assert not StormConfig(clock="real", client_load=0.5).sim_in_process


def test_read_pauses_hold_what_arrives_in_a_busy_part_until_it_ends() -> None:
    from zp_client.bench.memory import ReadPauses

    p = ReadPauses(0.5, burst_s=0.05)  # period 0.1 s: reading in [0, 0.05), busy in [0.05, 0.1)
    assert p.resume_at(0.0) is None and p.resume_at(0.049) is None
    assert p.resume_at(0.05) == pytest.approx(0.1) and p.resume_at(0.099) == pytest.approx(0.1)
    assert p.resume_at(1.02) is None and p.resume_at(1.07) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        ReadPauses(1.0)


def test_a_modelled_busy_client_reads_late_and_deterministically() -> None:
    """--client-load on the virtual clock: the same storm twice gives identical records, chunks are
    handed over late (the harness reports how late), and it differs from the storm without the load."""
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "zp-elastic"], profile="tiny",
                      num_gpu_blocks=None, client_load=0.5, workload_overrides=dict(TINY))
    def records(run: Any) -> list[Any]:
        return [x.to_json() for x in run.records]

    runs = [run_storm(cfg)[2] for _ in range(2)]
    calm = run_storm(dataclasses.replace(cfg, client_load=0.0))[2]
    for a, b, c in zip(*runs, calm, strict=True):
        assert records(a) == records(b), a.name
        assert records(a) != records(c), a.name
        assert all(r.ok for r in a.records)
        h = a.harness
        assert h["client_load"] == 0.5 and h["client_load_model"] == "read pauses"
        assert h["read_pauses_held"] > 0 and 0 < h["read_lag_p99_ms"] <= 50.0


@pytest.mark.slow
def test_a_busy_client_storm_runs_the_simulator_in_its_own_process() -> None:
    """--client-load on the real clock: the client's loop is blocked in 50 ms bursts, the simulator is
    served from another process and its records, timeline and metrics come back over HTTP."""
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "zp-elastic"], profile="tiny",
                      num_gpu_blocks=None, speedup=4.0, clock="real", client_load=0.3,
                      workload_overrides=dict(TINY))
    _, _, runs = run_storm(cfg)
    for run in runs:
        assert len(run.records) == 15 and all(r.ok for r in run.records), run.name
        assert len(run.server_stats["requests"]) >= 15  # the simulator's own records, over HTTP
        assert len(run.timeline) > 10 and run.metrics_preemptions is not None
        h = run.harness
        assert h["client_load"] == 0.3 and h["client_load_bursts"] > 0
        assert h["loop_lag_max_ms"] >= 40.0  # a 50 ms spin delays some 10 ms nap by most of it
