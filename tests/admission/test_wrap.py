"""wrap(openai.AsyncOpenAI / openai.OpenAI) against a real uvicorn server on loopback.

Marked ``openai_compat``: CI runs this file with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

import zp_client
from tests._asgi_server import MAX_MODEL_LEN, LoopbackServer
from zp_client import wrap
from zp_client.budget.local import LocalBudget as _Budget
from zp_client.config import Settings
from zp_client.errors import AdmissionTimeout, LeaseTooLarge, PromptTooLong, ZPError

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

API_KEY = "sk-zp-test-SECRET-0123456789"
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_budget(limit: int = 1000) -> Any:
    return _Budget(limit_blocks=limit, block_size=16)


def status_sync(b: Any) -> Any:
    return anyio.run(b.status)


async def used(b: Any) -> int:
    return (await b.status()).used


async def wait_released(b: Any, timeout: float = 15.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if await used(b) == 0:
            return 0
        await anyio.sleep(0.02)
    return await used(b)


def waiters(st: Any) -> int:
    return sum(w.waiters for w in st.waiters.values())


def awrapped(server: LoopbackServer, b: Any, **kw: Any) -> Any:
    orig = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, timeout=30)
    return wrap(orig, budget=b, settings=Settings(estimator="heuristic"), **kw)


def swrapped(server: LoopbackServer, b: Any, **kw: Any) -> Any:
    orig = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=30)
    return wrap(orig, budget=b, settings=Settings(estimator="heuristic"), **kw)


# ---------------------------------------------------------------------------------------------------
# async client
# ---------------------------------------------------------------------------------------------------


async def test_async_plain_and_stream(server: LoopbackServer) -> None:
    b = make_budget()
    c = awrapped(server, b)
    r = await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=32)
    assert r.choices[0].message.content and await used(b) == 0
    stream = await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=32, stream=True)
    chunks = []
    async for chunk in stream:
        if not chunks:
            assert await used(b) > 0
        chunks.append(chunk)
    assert await used(b) == 0
    # zp asked the server for usage, but the caller sees no usage chunk it did not ask for
    assert server.llm_requests()[-1]["body"]["stream_options"] == {"include_usage": True}
    assert chunks and all(ch.choices and ch.usage is None for ch in chunks)


@pytest.mark.parametrize("model,exc", [("err400", openai.BadRequestError), ("err500", openai.InternalServerError)])
async def test_async_http_errors_single_attempt(server: LoopbackServer, model: str, exc: type) -> None:
    b = make_budget()
    c = awrapped(server, b)
    before = len(server.llm_requests())
    with pytest.raises(exc):
        await c.chat.completions.create(model=model, messages=MSGS, max_tokens=8)
    with pytest.raises(exc):
        await c.chat.completions.create(model=model, messages=MSGS, max_tokens=8, stream=True)
    assert len(server.llm_requests()) == before + 2  # the SDK's own retries are off
    assert await used(b) == 0


async def test_async_reset_mid_stream(server: LoopbackServer) -> None:
    b = make_budget()
    c = awrapped(server, b)
    stream = await c.chat.completions.create(model="reset", messages=MSGS, max_tokens=8, stream=True)
    with pytest.raises(Exception) as info:
        async for _ in stream:
            pass
    assert not isinstance(info.value, AssertionError)
    assert await used(b) == 0


async def test_async_cancel_while_queued(server: LoopbackServer) -> None:
    b = make_budget(100)
    blocker = await b.acquire(100)
    c = awrapped(server, b)
    before = len(server.llm_requests())
    async with anyio.create_task_group() as tg:
        async def call() -> None:
            await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8)

        tg.start_soon(call)
        for _ in range(1000):
            if waiters(await b.status()):
                break
            await anyio.sleep(0.01)
        assert waiters(await b.status()) == 1
        tg.cancel_scope.cancel()
    assert waiters(await b.status()) == 0
    await blocker.release()
    assert await used(b) == 0 and len(server.llm_requests()) == before


async def test_async_cancel_while_streaming(server: LoopbackServer) -> None:
    b = make_budget()
    c = awrapped(server, b)
    got = anyio.Event()
    async with anyio.create_task_group() as tg:
        async def call() -> None:
            stream = await c.chat.completions.create(model="slow", messages=MSGS, max_tokens=8, stream=True)
            async for _ in stream:
                got.set()

        tg.start_soon(call)
        await got.wait()
        assert await used(b) > 0
        tg.cancel_scope.cancel()
    assert await used(b) == 0


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_async_stream_abandoned_after_two_chunks(server: LoopbackServer) -> None:
    b = make_budget()
    c = awrapped(server, b)
    stream = await c.chat.completions.create(model="slow", messages=MSGS, max_tokens=8, stream=True)
    it = stream.__aiter__()
    await it.__anext__()
    await it.__anext__()
    assert await used(b) > 0
    del it, stream
    assert await wait_released(b) == 0
    for _ in range(750):  # the connection was closed too: the server aborted the request
        if server.slow_streams_open == 0:
            break
        await anyio.sleep(0.02)
    assert server.slow_streams_open == 0


async def test_async_refusal_types(server: LoopbackServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    b = make_budget(10)
    c = awrapped(server, b)
    before = len(server.llm_requests())
    with pytest.raises(LeaseTooLarge) as too_large:
        await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=1000)
    with pytest.raises(PromptTooLong):
        await c.chat.completions.create(
            model="ok", messages=[{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}], max_tokens=8
        )
    blocker = await b.acquire(10)
    with pytest.raises(AdmissionTimeout):
        await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                                        extra_headers={"X-ZP-Deadline": "0.2"})
    await blocker.release()
    err = too_large.value
    assert isinstance(err, ZPError) and isinstance(err, openai.OpenAIError)
    assert not isinstance(err, openai.APIConnectionError)
    assert err.blocks > err.limit == 10
    assert API_KEY not in str(err) and API_KEY not in caplog.text
    assert len(server.llm_requests()) == before and await used(b) == 0


@pytest.mark.slow
async def test_wrap_keeps_original_untouched_and_shares_transport(server: LoopbackServer) -> None:
    calls: list[str] = []

    async def hook(request: Any) -> None:
        calls.append(request.url.path)

    from zp_client._admission.httplib import module_of as _module_of

    mod = _module_of(openai.AsyncOpenAI(api_key="x")._client)  # httpx2 on openai 3.x, httpx on 2.x
    transport = mod.AsyncHTTPTransport()
    http = mod.AsyncClient(transport=transport, event_hooks={"request": [hook]})
    orig = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, http_client=http, max_retries=5)
    b = make_budget()
    c = wrap(orig, budget=b)
    assert type(c) is type(orig) and c is not orig
    assert orig.max_retries == 5 and c.max_retries == 0
    assert orig._client is http and http._transport is transport
    assert c._client._transport._inner is transport  # same connection pool / proxy / TLS
    expected = "httpx2" if int(openai.__version__.split(".")[0]) >= 3 else "httpx"
    assert mod.__name__ == expected and isinstance(c._client, mod.AsyncClient)
    assert isinstance(c._client._transport, mod.AsyncBaseTransport)
    await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=4)
    assert calls == ["/v1/chat/completions"]  # event hooks kept
    again = c.with_options(timeout=10)  # the SDK's own copies keep the admission client and no retries
    assert again._client is c._client and again.max_retries == 0
    await c.close()
    await orig.models.list()  # closing the wrapped client leaves the original working
    await orig.close()


def test_zp_client_exports_wrap(server: LoopbackServer) -> None:
    # no submodule shadows the function: zp_client.wrap is the function itself
    import zp_client._wrap

    assert zp_client.wrap is zp_client._wrap.wrap and callable(zp_client.wrap)
    c = zp_client.wrap(openai.OpenAI(base_url=server.base_url, api_key=API_KEY), budget=make_budget())
    assert isinstance(c, openai.OpenAI) and c.max_retries == 0


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_wrapping_an_unreferenced_client_keeps_its_connection_pool_open(server: LoopbackServer) -> None:
    # wrap(openai.OpenAI(...)): nothing else holds the original, and openai closes its HTTP client (the
    # pool the wrapped client sends through) when the original is collected. The wrapped client keeps it.
    import weakref

    original = openai.OpenAI(base_url=server.base_url, api_key=API_KEY)
    alive = weakref.ref(original)
    pool = original._client
    c = zp_client.wrap(original, budget=make_budget())
    del original
    gc.collect()
    assert alive() is not None and not pool.is_closed
    assert c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8).choices
    del c
    gc.collect()
    assert alive() is None  # no leak: it goes with the wrapped client


# ---------------------------------------------------------------------------------------------------
# sync client
# ---------------------------------------------------------------------------------------------------


def test_sync_matrix(server: LoopbackServer) -> None:
    b = make_budget()
    c = swrapped(server, b)
    assert c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8).choices
    assert status_sync(b).used == 0
    chunks = []
    for chunk in c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, stream=True):
        if not chunks:
            assert status_sync(b).used > 0
        chunks.append(chunk)
    assert all(ch.usage is None for ch in chunks) and status_sync(b).used == 0
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="err400", messages=MSGS, max_tokens=8)
    with pytest.raises(openai.InternalServerError):
        c.chat.completions.create(model="err500", messages=MSGS, max_tokens=8)
    assert status_sync(b).used == 0
    with pytest.raises(Exception) as info:
        for _ in c.chat.completions.create(model="reset", messages=MSGS, max_tokens=8, stream=True):
            pass
    assert not isinstance(info.value, AssertionError)
    assert status_sync(b).used == 0
    stream = c.chat.completions.create(model="slow", messages=MSGS, max_tokens=8, stream=True)
    it = iter(stream)
    next(it), next(it)
    assert status_sync(b).used > 0
    del it, stream
    for _ in range(750):
        gc.collect()
        if status_sync(b).used == 0 and server.slow_streams_open == 0:
            break
        time.sleep(0.02)
    assert status_sync(b).used == 0
    assert server.slow_streams_open == 0  # the connection was closed: the server aborted the request


def test_sync_waits_while_budget_full(server: LoopbackServer) -> None:
    b = make_budget(100)
    blocker = b.acquire_sync(100)
    c = swrapped(server, b)
    before = len(server.llm_requests())
    out: dict[str, Any] = {}
    th = threading.Thread(
        target=lambda: out.setdefault("r", c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8))
    )
    th.start()
    for _ in range(1000):
        if waiters(status_sync(b)):
            break
        time.sleep(0.01)
    assert waiters(status_sync(b)) == 1
    assert "r" not in out and len(server.llm_requests()) == before  # waiting, nothing sent
    blocker.release_sync()
    th.join(30)
    assert out["r"].choices and status_sync(b).used == 0


def test_sync_refusal_types(server: LoopbackServer) -> None:
    b = make_budget(10)
    c = swrapped(server, b)
    with pytest.raises(LeaseTooLarge) as info:
        c.chat.completions.create(model="ok", messages=MSGS, max_tokens=1000)
    assert isinstance(info.value, openai.OpenAIError) and not isinstance(info.value, openai.APIConnectionError)
    with pytest.raises(PromptTooLong):
        c.chat.completions.create(model="ok", messages=[{"role": "user", "content": "w " * (3 * MAX_MODEL_LEN)}],
                                  max_tokens=8)
    blocker = b.acquire_sync(10)
    with pytest.raises(AdmissionTimeout) as tmo:
        c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, extra_headers={"X-ZP-Deadline": "0.2"})
    blocker.release_sync()
    assert API_KEY not in str(tmo.value)
    assert status_sync(b).used == 0


def test_openai3_with_a_legacy_httpx_client(server: LoopbackServer) -> None:
    """openai 3.x also accepts a plain httpx client; wrap() then builds an httpx (not httpx2) client."""
    if int(openai.__version__.split(".")[0]) < 3:
        pytest.skip("openai 2.x is built on httpx: covered by every other test here")
    b = make_budget(10)
    orig = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, http_client=httpx.Client())
    c = wrap(orig, budget=b, settings=Settings(estimator="heuristic"))
    assert isinstance(c._client, httpx.Client)
    assert c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8).choices
    with pytest.raises(LeaseTooLarge):
        c.chat.completions.create(model="ok", messages=MSGS, max_tokens=1000)
    assert status_sync(b).used == 0


def test_wrap_rejects_other_objects() -> None:
    with pytest.raises(zp_client.ConfigurationError):
        wrap(httpx.Client(), budget=make_budget())


# ---------------------------------------------------------------------------------------------------
# elastic budgets through the SDK
# ---------------------------------------------------------------------------------------------------


async def test_async_elastic_route_oracle_and_learning(server: LoopbackServer) -> None:
    from tests._oracle import BodyOracleForecaster
    from zp_client.forecast import LengthForecaster

    b = _Budget(limit_blocks=1000, block_size=16, policy="elastic")
    metas: list[dict[str, Any]] = []
    real = b.acquire

    async def spy(blocks: int, **kw: Any) -> Any:
        metas.append(dict(kw.get("meta") or {}))
        return await real(blocks, **kw)

    b.acquire = spy  # type: ignore[method-assign]
    fc = LengthForecaster()
    # stream_upstream off: the second call is about a non-streamed request's (blind) metadata.
    c = awrapped(server, b, forecaster=BodyOracleForecaster(fc), stream_upstream=False)
    stream = await c.chat.completions.create(
        model="ok", messages=MSGS, max_tokens=500, stream=True,
        extra_headers={"X-ZP-Route": "coder"}, extra_body={"sim_output_tokens": 9},
    )
    async for _ in stream:
        pass
    r = await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=500)
    assert r.usage is not None and await used(b) == 0
    assert metas[0]["forecast_tokens"] == 9 and metas[0]["streaming"] is True
    assert metas[1]["streaming"] is False and metas[1]["forecast_tokens"] > 9  # no field: the forecaster
    assert "x-zp-route" not in server.llm_requests()[-2]["headers"]
    # Both responses taught the forecaster, keyed by route and by model.
    assert fc.observations("coder") == 1 and fc.observations("ok") == 1


def test_sync_elastic_waits_and_releases(server: LoopbackServer) -> None:
    b = _Budget(limit_blocks=1000, block_size=16, policy="elastic")
    c = swrapped(server, b)
    for _ in c.chat.completions.create(model="ok", messages=MSGS, max_tokens=32, stream=True):
        assert b.status_sync().used > 0
    assert b.status_sync().used == 0
    from zp_client.transport import forecaster_for

    assert forecaster_for(b).observations("ok") == 1
