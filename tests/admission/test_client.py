"""The drop-in client against real loopback servers: the simulator for the API, a tiny app for errors."""

from __future__ import annotations

import gc
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests._asgi_server import PromptExitServer
from zp_client.budget.local import LocalBudget
from zp_client.client import (
    APIConnectionError,
    APIStatusError,
    AsyncClient,
    AsyncStream,
    BadRequestError,
    Client,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    Stream,
)
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, InvalidRequest, LeaseTooLarge
from zp_client.types import ChatCompletion, ChatCompletionChunk, Completion
from zp_sim.server import SimServer

SECRET = "sk-zp-test-SECRET-0123456789"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}]
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=50) as s:
        yield s


def _budget() -> LocalBudget:
    return LocalBudget(limit_blocks=200)


def _used(budget: LocalBudget) -> int:
    return budget.status_sync().used


# --- the simulator: happy paths ------------------------------------------------------------------------


def test_async_chat_not_streamed(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> ChatCompletion:
        async with AsyncClient(sim.base_url, api_key=SECRET, budget=budget) as client:
            return await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=12,
                                                        extra_body={"ignore_eos": True})

    reply = anyio.run(main)
    assert isinstance(reply, ChatCompletion)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 5
    assert reply.model == sim.model
    assert _used(budget) == 0


def test_async_chat_streamed(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> tuple[list[ChatCompletionChunk], int]:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            stream = await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=8,
                                                          stream=True, extra_body={"ignore_eos": True})
            assert isinstance(stream, AsyncStream)
            chunks = []
            used_while_streaming = _used(budget)
            async with stream:
                async for chunk in stream:
                    chunks.append(chunk)
            return chunks, used_while_streaming

    chunks, used_while = anyio.run(main)
    assert used_while > 0  # the lease is held while the stream is open
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks)  # the caller did not ask for usage, so none shows
    assert _used(budget) == 0


def test_stream_with_usage_and_early_close(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> tuple[Any, int]:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            full = await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=5, stream=True,
                                                        stream_options={"include_usage": True})
            chunks = [c async for c in full]
            long = await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=400,
                                                        stream=True, extra_body={"ignore_eos": True})
            async for _ in long:
                break
            await long.aclose()
            await long.aclose()  # idempotent
            return chunks[-1], _used(budget)

    last, used_after_close = anyio.run(main)
    assert last.choices == [] and last.usage is not None and last.usage.prompt_tokens > 0
    assert used_after_close == 0


def test_completions(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> tuple[Completion, list[Completion]]:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            plain = await client.completions.create(model=sim.model, prompt="Once upon a time", max_tokens=6)
            streamed = await client.completions.create(model=sim.model, prompt="Once upon a time", max_tokens=6,
                                                       stream=True, extra_body={"ignore_eos": True})
            return plain, [c async for c in streamed]

    plain, chunks = anyio.run(main)
    assert isinstance(plain, Completion) and plain.choices[0].text and plain.usage is not None
    assert all(isinstance(c, Completion) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert _used(budget) == 0


def test_tool_calls_parsed_plain_and_streamed(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> tuple[ChatCompletion, list[ChatCompletionChunk]]:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            msgs = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
            plain = await client.chat.completions.create(model=sim.model, messages=msgs, tools=TOOLS,
                                                         tool_choice="required", max_tokens=200)
            stream = await client.chat.completions.create(model=sim.model, messages=msgs, tools=TOOLS,
                                                          tool_choice="required", max_tokens=200, stream=True)
            return plain, [c async for c in stream]

    plain, chunks = anyio.run(main)
    calls = plain.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].type == "function" and calls[0].id
    args = calls[0].function.parsed_arguments()
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
    assert plain.choices[0].finish_reason == "tool_calls"
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function is not None and pieces[0].function.name == "get_weather"
    streamed_args = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert set(json.loads(streamed_args)) == {"city", "days"}


def test_models_list(sim: SimServer) -> None:
    async def main() -> Any:
        async with AsyncClient(sim.base_url, budget=_budget()) as client:
            return await client.models.list(), await client.models.retrieve(sim.model)

    models, card = anyio.run(main)
    assert [m.id for m in models] == [sim.model]
    assert card.max_model_len == sim.max_model_len
    with Client(sim.base_url, budget=_budget()) as client:
        assert client.models.list().data[0].id == sim.model
        with pytest.raises(NotFoundError):
            client.models.retrieve("nope")


def test_sync_client(sim: SimServer) -> None:
    budget = _budget()
    with Client(sim.base_url, api_key=SECRET, budget=budget) as client:
        reply = client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=4)
        assert reply.choices[0].message.content
        stream = client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=4, stream=True,
                                                extra_body={"ignore_eos": True})
        assert isinstance(stream, Stream)
        with stream:
            chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        comp = client.completions.create(model=sim.model, prompt=[1, 2, 3, 4], max_tokens=3)
        assert comp.choices[0].text
        long = client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=300, stream=True,
                                              extra_body={"ignore_eos": True})
        next(iter(long))
        long.close()
        assert _used(budget) == 0
        # max_tokens=0 is refused before anything is sent (issue 33): the server's 400 comes from a field
        # only the simulator reads.
        with pytest.raises(InvalidRequest, match="max_tokens"):
            client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=0)
        with pytest.raises(BadRequestError, match="sim_output_tokens must be at least 1") as exc:
            client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=3,
                                           extra_body={"sim_output_tokens": 0})
        assert exc.value.status_code == 400
    assert _used(budget) == 0


def test_server_errors_are_typed_with_the_servers_message(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> None:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            with pytest.raises(BadRequestError) as exc:
                await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=3,
                                                     extra_body={"sim_output_tokens": 0})
            assert exc.value.status_code == 400
            assert exc.value.message == "sim_output_tokens must be at least 1, got 0."
            assert exc.value.body["error"]["param"] == "sim_output_tokens"
            with pytest.raises(NotFoundError, match="does not exist"):
                await client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=3, stream=True)

    anyio.run(main)
    assert _used(budget) == 0


def test_admission_refusal_reaches_the_caller_unchanged(sim: SimServer) -> None:
    tiny = LocalBudget(limit_blocks=2)
    with Client(sim.base_url, budget=tiny) as client:
        with pytest.raises(LeaseTooLarge):
            client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=1000)
    assert _used(tiny) == 0


# --- a tiny app for the error matrix and what goes on the wire --------------------------------------------


class _App:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.seen.append({"headers": dict(request.headers), "body": body})
            kind = body.get("model")
            if kind == "e400":
                return JSONResponse({"error": {"message": "bad thing: fix field x", "type": "BadRequestError",
                                               "param": "x", "code": 400}}, status_code=400)
            if kind == "e429":
                return JSONResponse({"detail": "slow down"}, status_code=429)
            if kind == "e500":
                return JSONResponse({"error": {"message": "engine died"}}, status_code=500)
            if kind == "e504":
                return HTMLResponse("<html><body><h1>504 Gateway Time-out</h1></body></html>", status_code=504)
            if kind == "e418":
                return PlainTextResponse("short and stout", status_code=418)
            if kind == "garbage":
                return PlainTextResponse("not json")
            return JSONResponse({"id": "x", "object": "chat.completion", "created": 1, "model": kind,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok",
                                                                      "vendor_field": 7},
                                              "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                                 "kv_transfer_params": None})

        async def models(request: Request) -> Response:
            self.seen.append({"headers": dict(request.headers), "body": None})
            return JSONResponse({"object": "list", "data": [{"id": "m", "max_model_len": 2048}]})

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])
        self._server = PromptExitServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                                     lifespan="off"))

    def __enter__(self) -> _App:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive()
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.exit_now()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def app() -> Iterator[_App]:
    with _App() as a:
        yield a


@pytest.mark.parametrize(("model", "cls", "status", "message"), [
    ("e400", BadRequestError, 400, "bad thing: fix field x"),
    ("e429", RateLimitError, 429, "slow down"),
    ("e500", InternalServerError, 500, "engine died"),
    ("e504", InternalServerError, 504, "504 Gateway Time-out"),
    ("e418", APIStatusError, 418, "short and stout"),
])
@pytest.mark.slow
def test_error_matrix(app: _App, model: str, cls: type[APIStatusError], status: int, message: str) -> None:
    budget = _budget()
    with Client(app.base_url, api_key=SECRET, budget=budget) as client:
        with pytest.raises(cls) as exc:
            client.chat.completions.create(model=model, messages=MSGS, max_tokens=5)
    assert type(exc.value) is cls
    assert exc.value.status_code == status and message in exc.value.message and message in str(exc.value)
    assert _used(budget) == 0


def test_tolerates_extra_fields_and_rejects_garbage(app: _App) -> None:
    from zp_client.client import APIError

    with Client(app.base_url, budget=_budget()) as client:
        reply = client.chat.completions.create(model="ok", messages=MSGS, max_tokens=5)
        assert reply.choices[0].message.content == "ok"
        assert reply.choices[0].message.model_extra == {"vendor_field": 7}
        with pytest.raises(APIError, match="not a valid ChatCompletion"):
            client.chat.completions.create(model="garbage", messages=MSGS, max_tokens=5)


def test_extra_headers_and_body_go_on_the_wire(app: _App) -> None:
    app.seen.clear()

    async def main() -> None:
        async with AsyncClient(app.base_url, api_key=SECRET, budget=_budget()) as client:
            await client.chat.completions.create(
                model="ok", messages=MSGS, max_tokens=5, temperature=0.5,
                extra_headers={"X-Trace": "t-1", "X-ZP-Priority": "0"}, extra_body={"priority": -3, "top_k": 4})

    anyio.run(main)
    sent = app.seen[-1]
    assert sent["headers"]["x-trace"] == "t-1"
    assert "x-zp-priority" not in sent["headers"]  # zp's own header is consumed by the transport
    assert sent["headers"]["authorization"] == f"Bearer {SECRET}"
    assert sent["body"]["priority"] == -3 and sent["body"]["top_k"] == 4 and sent["body"]["temperature"] == 0.5
    assert "top_p" not in sent["body"] and "tools" not in sent["body"]  # unset parameters are not sent


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_api_key_never_in_repr_logs_or_errors(app: _App, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with Client(app.base_url, api_key=SECRET, budget=_budget()) as client:
        assert SECRET not in repr(client) and "***" in repr(client)
        with pytest.raises(BadRequestError) as exc:
            client.chat.completions.create(model="e400", messages=MSGS, max_tokens=5)
        client.models.list()
        assert SECRET not in str(exc.value) and SECRET not in repr(exc.value)
        assert SECRET not in repr(exc.value.response.request.headers)
    bad = Client("http://127.0.0.1:9/v1", api_key=SECRET, budget=_budget(), settings=Settings(max_model_len=2048))
    with pytest.raises(APIConnectionError) as conn:
        bad.chat.completions.create(model="m", messages=MSGS, max_tokens=5)
    bad.close()
    assert SECRET not in str(conn.value)
    assert caplog.records  # httpx and zp_client did log at DEBUG
    assert SECRET not in caplog.text


def test_base_url_and_api_key_fallbacks(app: _App, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="base_url"):
        Client(budget=_budget(), settings=Settings())
    monkeypatch.setenv("OPENAI_BASE_URL", "http://openai-env.invalid/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-openai-env")
    c = Client(budget=_budget(), settings=Settings())
    assert c.base_url == "http://openai-env.invalid/v1/" and c._key is not None
    assert c._key.get_secret_value() == "sk-from-openai-env"
    c.close()
    s = Settings(base_url=app.base_url, api_key="sk-from-settings")
    app.seen.clear()
    with Client(budget=_budget(), settings=s) as c2:
        c2.models.list()
    assert app.seen[-1]["headers"]["authorization"] == "Bearer sk-from-settings"
    with Client(app.base_url, api_key="sk-explicit", budget=_budget(), settings=s) as c3:
        c3.models.list()
    assert app.seen[-1]["headers"]["authorization"] == "Bearer sk-explicit"
    monkeypatch.delenv("OPENAI_API_KEY")
    with Client(app.base_url, budget=_budget(), settings=Settings()) as c4:
        c4.models.list()
    assert "authorization" not in app.seen[-1]["headers"]


def test_given_http_client_is_reused_not_modified(app: _App) -> None:
    hooks: list[str] = []

    async def on_request(request: httpx.Request) -> None:
        hooks.append(request.url.path)

    async def main() -> None:
        async with httpx.AsyncClient(headers={"X-Org": "acme"}, event_hooks={"request": [on_request]}) as mine:
            original_transport = mine._transport
            client = AsyncClient(app.base_url, budget=_budget(), http_client=mine)
            await client.chat.completions.create(model="ok", messages=MSGS, max_tokens=5)
            await client.aclose()
            assert mine._transport is original_transport and not mine.is_closed
            r = await mine.get(app.base_url + "/models")  # still usable: we did not close the caller's client
            assert r.status_code == 200

    app.seen.clear()
    anyio.run(main)
    chat = [r for r in app.seen if r["body"] is not None]
    assert chat[0]["headers"]["x-org"] == "acme"
    assert hooks[0] == "/v1/chat/completions"


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_connection_errors_are_typed() -> None:
    async def main() -> None:
        async with AsyncClient("http://127.0.0.1:9/v1", budget=_budget(), settings=Settings(max_model_len=2048)) as c:
            with pytest.raises(APIConnectionError):
                await c.chat.completions.create(model="m", messages=MSGS, max_tokens=5)

    anyio.run(main)
    gc.collect()


@pytest.mark.slow
def test_cancelling_a_stream_reader_releases_the_lease(sim: SimServer) -> None:
    budget = _budget()

    async def main() -> tuple[int, int]:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            stream = await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=1000,
                                                          stream=True, extra_body={"ignore_eos": True})
            got = 0
            with anyio.CancelScope() as scope:
                async for _ in stream:
                    got += 1
                    if got == 2:
                        scope.cancel()
            return got, _used(budget)

    got, used = anyio.run(main)
    # cancellation lands at the next real checkpoint (chunks already buffered are still yielded), but
    # well before the 1000-token stream ends
    assert 2 <= got < 900 and used == 0


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_cancelling_a_waiting_request_releases_nothing_and_leaks_nothing(sim: SimServer) -> None:
    budget = LocalBudget(limit_blocks=70, policy="strict")  # the second request surely cannot fit

    async def main() -> tuple[int, int]:
        async with AsyncClient(sim.base_url, budget=budget) as client:
            hog = await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=1000, stream=True,
                                                       extra_body={"ignore_eos": True})
            held = _used(budget)
            with anyio.move_on_after(0.3):  # the second request cannot fit and waits for a lease
                await client.chat.completions.create(model=sim.model, messages=MSGS, max_tokens=1000)
            await hog.aclose()
            return held, _used(budget)

    held, used = anyio.run(main)
    assert held > 35 and used == 0
