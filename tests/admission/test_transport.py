"""Admission transport against a real uvicorn server on loopback, for httpx and httpx2."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from tests._asgi_server import MAX_MODEL_LEN, LoopbackServer
from zp_client.budget.local import LocalBudget as _Budget
from zp_client.config import Settings
from zp_client.errors import (
    AdmissionTimeout,
    ConfigurationError,
    InvalidRequest,
    LeaseTooLarge,
    PromptTooLong,
)
from zp_client.transport import admission_transport_for, transport_classes

# The openai 2.x environment (make test-openai2) has no httpx2; these tests belong to the main one.
httpx2 = pytest.importorskip("httpx2")

MODULES = [httpx, httpx2]
CHAT = {"model": "ok", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 32}


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_budget(limit: int = 1000) -> Any:
    return _Budget(limit_blocks=limit, block_size=16)


def settings(**kw: Any) -> Settings:
    return Settings(estimator="heuristic", **kw)


async def used(budget: Any) -> int:
    return (await budget.status()).used


async def wait_released(budget: Any, timeout: float = 15.0) -> int:
    """Wait (bounded) until the budget is empty; returns what is still used."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if await used(budget) == 0:
            return 0
        await anyio.sleep(0.02)
    return await used(budget)


def wait_released_sync(budget: Any, timeout: float = 15.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        u = anyio.run(used, budget)
        if u == 0:
            return 0
        time.sleep(0.02)
    return anyio.run(used, budget)


def server_streams_closed(server: LoopbackServer, timeout: float = 15.0) -> bool:
    """Wait (bounded) until the server saw every slow stream's client go away."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.slow_streams_open == 0:
            return True
        gc.collect()
        time.sleep(0.02)
    return False


def async_client(mod: Any, server: LoopbackServer, budget: Any, **kw: Any) -> Any:
    t = transport_classes(mod).AsyncAdmissionTransport(budget=budget, settings=kw.pop("settings", settings()), **kw)
    return mod.AsyncClient(transport=t, base_url=server.base_url, timeout=30)


def sync_client(mod: Any, server: LoopbackServer, budget: Any, **kw: Any) -> Any:
    t = transport_classes(mod).AdmissionTransport(budget=budget, settings=kw.pop("settings", settings()), **kw)
    return mod.Client(transport=t, base_url=server.base_url, timeout=30)


async def hold_all(budget: Any) -> Any:
    return await budget.acquire(budget.limit)


async def wait_waiting(budget: Any) -> None:
    for _ in range(1000):
        st = await budget.status()
        if sum(c.waiters for c in st.waiters.values()) > 0:
            return
        await anyio.sleep(0.01)
    raise AssertionError("request never queued")


# ---------------------------------------------------------------------------------------------------
# The acceptance matrix, async
# ---------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
class TestAsyncMatrix:
    async def test_plain_success(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        async with async_client(mod, server, b) as c:
            r = await c.post("/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 12
        assert await used(b) == 0

    async def test_streamed_success_holds_then_releases(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        async with async_client(mod, server, b) as c:
            async with c.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as r:
                it = r.aiter_raw()
                first = await it.__anext__()
                assert first.startswith(b"data:")
                assert await used(b) > 0  # the lease is held while the stream is open
                rest = b"".join([x async for x in it])
            assert rest.endswith(b"data: [DONE]\n\n")
        assert await used(b) == 0

    @pytest.mark.parametrize("model,status", [("err400", 400), ("err500", 500)])
    async def test_http_errors(self, mod: Any, server: LoopbackServer, model: str, status: int) -> None:
        b = make_budget()
        async with async_client(mod, server, b) as c:
            r = await c.post("/chat/completions", json={**CHAT, "model": model})
            assert r.status_code == status
            async with c.stream("POST", "/chat/completions", json={**CHAT, "model": model, "stream": True}) as r:
                assert r.status_code == status
                await r.aread()
        assert await used(b) == 0

    async def test_connection_reset_mid_stream(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        async with async_client(mod, server, b) as c:
            with pytest.raises(mod.TransportError):
                async with c.stream("POST", "/chat/completions", json={**CHAT, "model": "reset", "stream": True}) as r:
                    async for _ in r.aiter_raw():
                        pass
        assert await used(b) == 0

    async def test_cancel_while_queued(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget(100)
        blocker = await hold_all(b)
        before = len(server.llm_requests())
        async with async_client(mod, server, b) as c:
            async with anyio.create_task_group() as tg:
                async def call() -> None:
                    await c.post("/chat/completions", json=CHAT)

                tg.start_soon(call)
                await wait_waiting(b)
                tg.cancel_scope.cancel()
        st = await b.status()
        assert sum(w.waiters for w in st.waiters.values()) == 0
        await blocker.release()
        assert await used(b) == 0
        assert len(server.llm_requests()) == before  # nothing was sent

    async def test_cancel_while_streaming(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        got_chunk = anyio.Event()
        async with async_client(mod, server, b) as c:
            async with anyio.create_task_group() as tg:
                async def call() -> None:
                    async with c.stream("POST", "/chat/completions",
                                        json={**CHAT, "model": "slow", "stream": True}) as r:
                        async for _ in r.aiter_raw():
                            got_chunk.set()

                tg.start_soon(call)
                await got_chunk.wait()
                assert await used(b) > 0
                tg.cancel_scope.cancel()
        assert await used(b) == 0

    @pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
    async def test_stream_abandoned_after_two_chunks(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        c = async_client(mod, server, b)
        req = c.build_request("POST", "/chat/completions", json={**CHAT, "model": "slow", "stream": True})
        r = await c.send(req, stream=True)
        it = r.aiter_raw()
        await it.__anext__()
        await it.__anext__()
        assert await used(b) > 0
        del it, r, req  # the caller walks away without closing anything
        assert await wait_released(b) == 0
        # the connection was closed too, so the server aborted the request (its KV is free as well)
        assert await anyio.to_thread.run_sync(server_streams_closed, server)
        await c.aclose()


# ---------------------------------------------------------------------------------------------------
# The acceptance matrix, sync
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
class TestSyncMatrix:
    def test_plain_stream_errors(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        with sync_client(mod, server, b) as c:
            assert c.post("/chat/completions", json=CHAT).status_code == 200
            assert anyio.run(used, b) == 0
            with c.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as r:
                it = r.iter_raw()
                next(it)
                assert anyio.run(used, b) > 0
                assert b"".join(it).endswith(b"[DONE]\n\n")
            assert anyio.run(used, b) == 0
            for model, status in (("err400", 400), ("err500", 500)):
                assert c.post("/chat/completions", json={**CHAT, "model": model}).status_code == status
                assert anyio.run(used, b) == 0
            with pytest.raises(mod.TransportError):
                with c.stream("POST", "/chat/completions", json={**CHAT, "model": "reset", "stream": True}) as r:
                    for _ in r.iter_raw():
                        pass
            assert anyio.run(used, b) == 0

    @pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
    def test_abandoned_stream(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget()
        c = sync_client(mod, server, b)
        r = c.send(c.build_request("POST", "/chat/completions", json={**CHAT, "model": "slow", "stream": True}),
                   stream=True)
        it = r.iter_raw()
        next(it), next(it)
        assert anyio.run(used, b) > 0
        del it, r
        assert wait_released_sync(b) == 0
        assert server_streams_closed(server)
        c.close()

    def test_waits_while_budget_full(self, mod: Any, server: LoopbackServer) -> None:
        b = make_budget(100)
        blocker = b.acquire_sync(100)
        result: dict[str, Any] = {}
        with sync_client(mod, server, b) as c:
            th = threading.Thread(target=lambda: result.setdefault("r", c.post("/chat/completions", json=CHAT)))
            th.start()
            for _ in range(1000):
                st = anyio.run(b.status)
                if sum(w.waiters for w in st.waiters.values()):
                    break
                time.sleep(0.01)
            assert "r" not in result  # still waiting for blocks, not sent
            blocker.release_sync()
            th.join(30)
        assert result["r"].status_code == 200
        assert anyio.run(used, b) == 0


# ---------------------------------------------------------------------------------------------------
# Request shaping and per-call options
# ---------------------------------------------------------------------------------------------------


async def test_default_max_tokens_inserted_and_bodies_untouched_otherwise(server: LoopbackServer) -> None:
    b = make_budget()
    # stream_upstream off: this is about the bytes of a body sent as it is.
    s = settings(default_max_tokens=77, stream_upstream=False)
    async with async_client(httpx, server, b, settings=s) as c:
        body = {"model": "ok", "messages": [{"role": "user", "content": "x"}]}
        await c.post("/chat/completions", json=body)
        assert server.llm_requests()[-1]["body"]["max_tokens"] == 77
        # a complete request is sent byte for byte
        raw = json.dumps({**CHAT, "priority": 3}).encode()
        await c.post("/chat/completions", content=raw, headers={"content-type": "application/json"})
        last = server.llm_requests()[-1]
        assert last["body"] == {**CHAT, "priority": 3}
        assert int(last["headers"]["content-length"]) == len(raw)


async def test_stream_usage_chunk_invisible_to_caller(server: LoopbackServer) -> None:
    b = make_budget()
    body = {**CHAT, "stream": True}
    async with httpx.AsyncClient(base_url=server.base_url) as bare:
        expected = (await bare.post("/chat/completions", json=body)).content
    assert b'"usage"' not in expected
    async with async_client(httpx, server, b) as c:
        got = (await c.post("/chat/completions", json=body)).content
        sent = server.llm_requests()[-1]["body"]
        assert sent["stream_options"] == {"include_usage": True}  # zp asked for usage on the wire...
        assert got == expected  # ...but the caller sees exactly what the server sends without zp
        # a caller that asked for usage gets it
        asked = {**body, "stream_options": {"include_usage": True}}
        got_usage = (await c.post("/chat/completions", json=asked)).content
        assert b'"usage": {' in got_usage and b'"usage": null' in got_usage  # untouched
        async with httpx.AsyncClient(base_url=server.base_url) as bare:
            assert got_usage == (await bare.post("/chat/completions", json=asked)).content
    assert await used(b) == 0


async def test_priority_and_deadline_headers(server: LoopbackServer) -> None:
    seen: list[int] = []

    class Spy(_Budget):  # type: ignore[misc,valid-type]
        async def acquire(self, blocks: int, **kw: Any) -> Any:
            seen.append(kw["priority"])
            return await super().acquire(blocks, **kw)

    b = Spy(limit_blocks=1000, block_size=16)
    async with async_client(httpx, server, b) as c:
        await c.post("/chat/completions", json=CHAT, headers={"X-ZP-Priority": "-2", "X-ZP-Deadline": "20"})
        hdrs = server.llm_requests()[-1]["headers"]
        assert "x-zp-priority" not in hdrs and "x-zp-deadline" not in hdrs
        await c.post("/chat/completions", json={**CHAT, "priority": 7})
        assert server.llm_requests()[-1]["body"]["priority"] == 7
        with pytest.raises(InvalidRequest) as bad:  # a request's bad zp input (was ConfigurationError)
            await c.post("/chat/completions", json=CHAT, headers={"X-ZP-Priority": "high"})
        assert bad.value.field == "X-ZP-Priority"
    assert seen == [-2, 7]


async def test_deadline_bounds_queue_wait(server: LoopbackServer) -> None:
    b = make_budget(100)
    blocker = await hold_all(b)
    before = len(server.llm_requests())
    async with async_client(httpx2, server, b) as c:
        with pytest.raises(AdmissionTimeout):
            await c.post("/chat/completions", json=CHAT, headers={"X-ZP-Deadline": "0.2"})
    await blocker.release()
    assert await used(b) == 0 and len(server.llm_requests()) == before


async def test_refusals_send_nothing(server: LoopbackServer) -> None:
    before = len(server.llm_requests())
    b = make_budget(10)
    async with async_client(httpx, server, b) as c:
        with pytest.raises(LeaseTooLarge):
            await c.post("/chat/completions", json={**CHAT, "max_tokens": 1000})
        long_prompt = "word " * (MAX_MODEL_LEN * 2)
        with pytest.raises(PromptTooLong):
            await c.post("/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": long_prompt}]})
    assert len(server.llm_requests()) == before
    assert await used(b) == 0


async def test_max_model_len_caps_the_bound(server: LoopbackServer) -> None:
    """max_tokens far above the context: the bound is capped by max_model_len read from /v1/models."""
    b = make_budget(MAX_MODEL_LEN // 16)

    def model_fetches() -> int:
        return sum(x["path"] == "/v1/models" for x in server.requests)

    before = model_fetches()
    async with async_client(httpx, server, b) as c:
        for _ in range(3):
            r = await c.post("/chat/completions", json={**CHAT, "max_tokens": 100_000})
            assert r.status_code == 200
    assert model_fetches() == before + 1  # read lazily, once, then cached
    assert server.llm_requests()[-1]["headers"]["content-type"] == "application/json"


async def test_non_llm_paths_pass_through_without_lease(server: LoopbackServer) -> None:
    b = make_budget(100)
    blocker = await hold_all(b)  # any admitted request would now wait forever
    async with async_client(httpx, server, b) as c:
        assert (await c.get("/models")).status_code == 200
        assert (await c.post("/files", content=b"abc")).json() == {"received": 3}
        assert (await c.get(server.root_url + "/health")).status_code == 200
    await blocker.release()
    assert await used(b) == 0


async def test_preread_response_releases_at_once() -> None:
    body = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}'
    inner = httpx.MockTransport(lambda req: httpx.Response(200, content=body))
    b = make_budget()
    t = admission_transport_for(inner, budget=b, settings=settings(max_model_len=1024))
    resp = await t.handle_async_request(httpx.Request("POST", "http://x/v1/completions",
                                                      json={"model": "m", "prompt": "hi", "max_tokens": 4}))
    assert await used(b) == 0
    assert await resp.aread() == body


def test_admission_transport_for_places_a_user_defined_transport_once_openai_is_imported() -> None:
    # openai re-exports httpx's (or httpx2's) BaseTransport and rewrites its __module__ to "openai":
    # the library is found by isinstance, not by the class's module name.
    import openai  # noqa: F401 - the import is the premise of this test

    mods = [httpx]
    try:
        import httpx2

        mods.append(httpx2)
    except ImportError:
        pass
    for mod in mods:
        class UserSync(mod.BaseTransport):  # type: ignore[misc,name-defined]
            def handle_request(self, request: Any) -> Any:
                return mod.Response(200, json={"ok": True})

        class UserAsync(mod.AsyncBaseTransport):  # type: ignore[misc,name-defined]
            async def handle_async_request(self, request: Any) -> Any:
                return mod.Response(200, json={"ok": True})

        classes = transport_classes(mod)
        sync_t = admission_transport_for(UserSync(), budget=make_budget())
        async_t = admission_transport_for(UserAsync(), budget=make_budget())
        assert isinstance(sync_t, classes.AdmissionTransport)
        assert isinstance(async_t, classes.AsyncAdmissionTransport)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_idle_stream_watchdog(server: LoopbackServer) -> None:
    b = make_budget()
    async with async_client(httpx, server, b, settings=settings(idle_stream_timeout_s=0.2)) as c:
        async with c.stream("POST", "/chat/completions", json={**CHAT, "model": "slow", "stream": True}) as r:
            it = r.aiter_raw()
            await it.__anext__()
            assert await used(b) > 0
            # keep `r` referenced but stop reading: the watchdog closes the stream and releases the lease
            assert await wait_released(b) == 0
            assert await anyio.to_thread.run_sync(server_streams_closed, server)
            with pytest.raises(httpx.TransportError):  # reading on finds the connection closed
                async for _ in it:
                    pass


@pytest.mark.slow
async def test_watchdog_spares_a_caller_waiting_on_a_slow_server(server: LoopbackServer) -> None:
    b = make_budget()
    async with async_client(httpx, server, b, settings=settings(idle_stream_timeout_s=0.2)) as c:
        body = {**CHAT, "model": "delay", "stream": True}
        async with c.stream("POST", "/chat/completions", json=body) as r:
            data = b"".join([x async for x in r.aiter_raw()])  # the server is silent 4x the idle timeout
    assert data.endswith(b"data: [DONE]\n\n") and data.count(b"data:") == 1 + 6 + 1 + 1
    assert await used(b) == 0


async def test_retry_releases_and_keeps_ticket(server: LoopbackServer) -> None:
    from zp_client.retry import RetryPolicy, testing

    tickets: list[Any] = []

    class Spy(_Budget):  # type: ignore[misc,valid-type]
        async def acquire(self, blocks: int, **kw: Any) -> Any:
            lease = await super().acquire(blocks, **kw)
            tickets.append((kw.get("ticket"), lease.ticket))
            return lease

    b = Spy(limit_blocks=1000, block_size=16)
    with testing():
        async with async_client(httpx, server, b, retry=RetryPolicy(budget=None)) as c:
            r = await c.post("/chat/completions", json={**CHAT, "model": "flaky", "user": "retry-test"})
    assert r.status_code == 200
    attempts = [x for x in server.llm_requests() if x["body"].get("user") == "retry-test"]
    assert len(attempts) == 2
    assert tickets[0][0] is None and tickets[1][0] == tickets[0][1]  # the retry reused its ticket
    assert await used(b) == 0


# ---------------------------------------------------------------------------------------------------
# The same lifecycle against the vLLM simulator (the loopback app above shapes 500s and resets, which
# the simulator does not produce). The simulator's engine tells us the server side freed the request.
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim() -> Iterator[Any]:
    from zp_sim.server import SimServer

    with SimServer(profile="tiny", speedup=5.0, max_model_len=2048) as s:
        yield s


def sim_idle(sim: Any, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        eng = sim.stats()["engine"]
        if eng["num_running"] == 0 and eng["num_waiting"] == 0:
            return True
        gc.collect()
        time.sleep(0.02)
    return False


SIM_CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": 24, "ignore_eos": True, "seed": 7}


@pytest.mark.needs_sim
@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
class TestAgainstSimulator:
    def _client(self, mod: Any, sim: Any, b: Any, **kw: Any) -> Any:
        t = transport_classes(mod).AsyncAdmissionTransport(budget=b, settings=settings(**kw))
        return mod.AsyncClient(transport=t, base_url=sim.base_url, timeout=60)

    async def test_success_errors_and_usage_hidden(self, mod: Any, sim: Any) -> None:
        b = make_budget()
        async with self._client(mod, sim, b) as c:
            r = await c.post("/chat/completions", json=SIM_CHAT)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
            assert await used(b) == 0
            async with c.stream("POST", "/chat/completions", json={**SIM_CHAT, "stream": True}) as r:
                events = [line async for line in r.aiter_lines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            assert not any('"usage"' in e for e in events)  # zp's include_usage is invisible
            async with mod.AsyncClient(base_url=sim.base_url, timeout=60) as bare:
                async with bare.stream("POST", "/chat/completions", json={**SIM_CHAT, "stream": True}) as r:
                    bare_events = [line async for line in r.aiter_lines() if line.startswith("data:")]

            def text(evs: list[str]) -> str:
                return "".join(json.loads(e[5:])["choices"][0]["delta"].get("content", "") for e in evs[:-1])

            # same seeded output, same shape (ids and chunking by engine step may differ)
            assert text(events) == text(bare_events) and len(text(events)) > 0
            assert await used(b) == 0
            r = await c.post("/chat/completions", json={**SIM_CHAT, "model": "no-such-model"})
            assert r.status_code == 404 and await used(b) == 0
        # zp read max_model_len (2048) from the simulator's /v1/models and refuses locally
        async with self._client(mod, sim, b) as c:
            with pytest.raises(PromptTooLong):
                await c.post("/chat/completions", json={**SIM_CHAT, "messages": [
                    {"role": "user", "content": "many words here " * 2000}]})
        # told a larger context than the server has, zp sends it and the server's 400 comes back
        async with self._client(mod, sim, b, max_model_len=1_000_000) as c:
            r = await c.post("/chat/completions", json={**SIM_CHAT, "messages": [
                {"role": "user", "content": "many words here " * 2000}]})
            assert r.status_code == 400 and await used(b) == 0

    @pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
    async def test_cancel_and_abandon_free_both_sides(self, mod: Any, sim: Any) -> None:
        b = make_budget()
        long = {**SIM_CHAT, "max_tokens": 1500, "stream": True}
        async with self._client(mod, sim, b) as c:
            got = anyio.Event()
            async with anyio.create_task_group() as tg:
                async def call() -> None:
                    async with c.stream("POST", "/chat/completions", json=long) as r:
                        async for _ in r.aiter_raw():
                            got.set()

                tg.start_soon(call)
                await got.wait()
                assert await used(b) > 0
                tg.cancel_scope.cancel()
            assert await used(b) == 0
            assert await anyio.to_thread.run_sync(sim_idle, sim)

            r = await c.send(c.build_request("POST", "/chat/completions", json=long), stream=True)
            it = r.aiter_raw()
            await it.__anext__()
            await it.__anext__()
            del it, r
            assert await wait_released(b) == 0
            assert await anyio.to_thread.run_sync(sim_idle, sim)


async def test_responses_and_completions_are_admitted(server: LoopbackServer) -> None:
    b = make_budget(100)
    blocker = await hold_all(b)
    async with async_client(httpx, server, b, settings=settings(default_max_tokens=50)) as c:
        for path, body in (("/responses", {"model": "ok", "input": "hi"}),
                           ("/completions", {"model": "ok", "prompt": "hi"})):
            with pytest.raises(AdmissionTimeout):  # admitted: it waits for blocks like a chat call
                await c.post(path, json=body, headers={"X-ZP-Deadline": "0.1"})
        await blocker.release()
        r = await c.post("/responses", json={"model": "ok", "input": "hi"})
        assert r.json()["usage"]["input_tokens"] == 9
        assert server.llm_requests()[-1]["body"]["max_output_tokens"] == 50  # the /responses name
        r = await c.post("/completions", json={"model": "ok", "prompt": "hi"})
        assert r.json()["choices"][0]["text"]
        assert server.llm_requests()[-1]["body"]["max_tokens"] == 50
    assert await used(b) == 0


async def test_stream_growth_is_reported(server: LoopbackServer) -> None:
    """held starts at the prompt's blocks and grows as the stream advances, reported in steps."""
    b = make_budget()
    body = {**CHAT, "model": "slow", "stream": True, "max_tokens": 2000}
    async with async_client(httpx, server, b) as c:
        async with c.stream("POST", "/chat/completions", json=body) as r:
            it = r.aiter_raw()
            await it.__anext__()
            start = (await b.status()).held
            n = 1
            while (await b.status()).held <= start and n < 400:
                await it.__anext__()
                n += 1
            grown = (await b.status()).held
    assert 0 < start < grown
    assert n < 400
    assert await used(b) == 0


@pytest.mark.needs_sim
@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
async def test_cancel_while_server_generates_unstreamed(mod: Any, sim: Any) -> None:
    """Cancelled after sending, before the response headers: blocks return on both sides."""
    b = make_budget()
    t = transport_classes(mod).AsyncAdmissionTransport(budget=b, settings=settings())
    async with mod.AsyncClient(transport=t, base_url=sim.base_url, timeout=60) as c:
        async with anyio.create_task_group() as tg:
            async def call() -> None:
                await c.post("/chat/completions", json={**SIM_CHAT, "max_tokens": 1500})

            tg.start_soon(call)
            for _ in range(1500):
                if sim.stats()["engine"]["num_running"] > 0:
                    break
                await anyio.sleep(0.01)
            assert sim.stats()["engine"]["num_running"] == 1 and await used(b) > 0
            tg.cancel_scope.cancel()
    assert await used(b) == 0
    assert await anyio.to_thread.run_sync(sim_idle, sim)


@pytest.mark.needs_sim
@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
@pytest.mark.slow
async def test_server_estimator_counts_through_the_inner_transport(mod: Any, sim: Any) -> None:
    """estimator="server" asks the simulator's /tokenize (through the inner transport, unadmitted)."""
    from zp_client.estimate import Estimator

    seen: list[Any] = []

    class Spy(Estimator):
        async def estimate_async(self, path: str, body: Any, server: Any) -> Any:
            est = await super().estimate_async(path, body, server)
            seen.append(est)
            return est

    s = Settings(estimator="server")
    b = make_budget(100)
    t = transport_classes(mod).AsyncAdmissionTransport(budget=b, settings=s, estimator=Spy(s))
    async with mod.AsyncClient(transport=t, base_url=sim.base_url, timeout=60) as c:
        r = await c.post("/chat/completions", json=SIM_CHAT)
    assert r.status_code == 200
    assert len(seen) == 1 and seen[0].exact and seen[0].tokens == r.json()["usage"]["prompt_tokens"]
    assert await used(b) == 0
