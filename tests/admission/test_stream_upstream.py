"""Non-streamed calls are streamed upstream and reassembled inside the transport (Settings.stream_upstream).

Against the real simulated vLLM server (threaded, real HTTP on loopback) and a tiny uvicorn app for the
stream edge cases (an error event, a cut connection, a stream without ``[DONE]``). The equivalence and
gateway tests are ``openai_compat``: they run on openai 3.x (httpx2) and 2.x (httpx).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from _asgi_server import ThreadedApp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from zp_client import wrap
from zp_client._sse import Reassembler as _Reassembler
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.forecast import LengthForecaster
from zp_client.retry import RetryPolicy, testing
from zp_client.transport import AsyncAdmissionTransport
from zp_sim.server import SimServer

pytestmark = pytest.mark.anyio

MSGS = [{"role": "user", "content": "write a short poem about the sea"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]},
}}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Recorder:
    """ASGI middleware in front of the simulator: keeps every LLM request body the server received."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await self.app(scope, receive, send)
        parts: list[bytes] = []

        async def recording_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(json.loads(b"".join(parts)))
            return message

        await self.app(scope, recording_receive, send)


def sim_server(**kw: Any) -> tuple[SimServer, Recorder]:
    server = SimServer(profile="tiny", seed=3, **kw)
    recorder = server.app = Recorder(server.app)
    return server, recorder


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[SimServer, Recorder]]:
    server, recorder = sim_server(speedup=50)
    with server:
        yield server, recorder


def settings(**kw: Any) -> Settings:
    return Settings(estimator="heuristic", **kw)


def wrapped(server: SimServer, budget: Any, *, sync: bool = False, **kw: Any) -> Any:
    cls = openai.OpenAI if sync else openai.AsyncOpenAI
    return wrap(cls(base_url=server.base_url, api_key="x", timeout=60), budget=budget, **kw)


async def call(client: Any, kind: str, **extra: Any) -> Any:
    """One non-streamed call of ``kind`` (sync clients run on a worker thread)."""
    if kind == "completion":
        fn, args = client.completions.create, {"prompt": "once upon a time", "max_tokens": 40}
    else:
        fn, args = client.chat.completions.create, {"messages": MSGS, "max_tokens": 40}
        if kind == "tool":
            args.update(tools=TOOLS, max_tokens=200)
        if kind == "n2":
            args["n"] = 2
    args.update(model="sim-llama", seed=11, **extra)
    if isinstance(client, openai.AsyncOpenAI):
        return await fn(**args)
    return await anyio.to_thread.run_sync(lambda: fn(**args))


def comparable(result: Any) -> dict[str, Any]:
    """A parsed answer without what differs between two runs of one request (ids, creation time) and
    without null fields (vLLM's non-streamed answer spells out ``"reasoning_content": null``)."""
    d = result.model_dump(exclude_none=True)
    d.pop("id", None)
    d.pop("created", None)
    for choice in d["choices"]:
        for call_ in (choice.get("message") or {}).get("tool_calls") or ():
            call_.pop("id", None)
    return d


# ---------------------------------------------------------------------------------------------------
# The caller gets what the server would have answered
# ---------------------------------------------------------------------------------------------------


@pytest.mark.openai_compat
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("kind", ["chat", "tool", "completion", "n2"])
async def test_answer_equals_the_non_streamed_answer(sim: tuple[SimServer, Recorder], kind: str,
                                                     sync: bool) -> None:
    server, recorder = sim
    budget = LocalBudget(limit_blocks=server.num_gpu_blocks - 1)
    results = {}
    for on in (True, False):
        client = wrapped(server, budget, sync=sync, settings=settings(stream_upstream=on))
        before = len(recorder.bodies)
        results[on] = await call(client, kind)
        (sent,) = recorder.bodies[before:]
        # The server saw a stream (usage asked for) only with the option on; the elastic budget also
        # asks vLLM (the simulator's cards say so) for per-chunk usage, except for n > 1.
        if on:
            expected = {"include_usage": True}
            if kind != "n2":
                expected["continuous_usage_stats"] = True
            assert sent["stream"] is True and sent["stream_options"] == expected
        else:
            assert "stream" not in sent and "stream_options" not in sent
    assert comparable(results[True]) == comparable(results[False])
    assert results[True].id.startswith("chatcmpl-" if kind != "completion" else "cmpl-")
    assert (await budget.status()).used == 0
    if kind == "tool":
        msg = results[True].choices[0].message
        assert msg.content is None and results[True].choices[0].finish_reason == "tool_calls"
        (tc,) = msg.tool_calls
        assert tc.id and tc.type == "function" and tc.function.name == "get_weather"
        assert set(json.loads(tc.function.arguments)) == {"city", "days"}
    if kind == "n2":
        assert [c.index for c in results[True].choices] == [0, 1]


@pytest.mark.openai_compat
async def test_reassembled_response_headers(sim: tuple[SimServer, Recorder]) -> None:
    server, _ = sim
    client = wrapped(server, LocalBudget(limit_blocks=server.num_gpu_blocks - 1), settings=settings())
    raw = await client.chat.completions.with_raw_response.create(model="sim-llama", messages=MSGS,
                                                                  max_tokens=20)
    assert raw.status_code == 200
    assert raw.headers["content-type"] == "application/json"
    assert int(raw.headers["content-length"]) == len(raw.content)
    assert "transfer-encoding" not in raw.headers
    assert raw.headers.get("server") == "uvicorn"  # the other upstream headers are kept
    assert json.loads(raw.content)["object"] == "chat.completion"


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.openai_compat
async def test_a_proxy_idle_timeout_no_longer_cuts_a_long_generation() -> None:
    # The gateway answers 504 when no byte came within 2 virtual s; the generation takes ~6.
    server, recorder = sim_server(speedup=5, gateway_timeout_s=2.0)
    with server:
        budget = LocalBudget(limit_blocks=server.num_gpu_blocks - 1)
        long_call = {"max_tokens": 2000, "extra_body": {"sim_output_tokens": 1500}}
        off = wrapped(server, budget, settings=settings(stream_upstream=False))
        with pytest.raises(openai.APIStatusError) as info:
            await call(off, "chat", **long_call)
        assert info.value.status_code == 504
        on = wrapped(server, budget, settings=settings(stream_upstream=True))
        r = await call(on, "chat", **long_call)
        assert r.usage.completion_tokens == 1500 and r.choices[0].finish_reason == "stop"
        assert server.stats()["gateway_504"] == 1
        assert [b.get("stream") for b in recorder.bodies] == [None, True]
        assert (await budget.status()).used == 0


# ---------------------------------------------------------------------------------------------------
# Elastic budgets see the growth
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_elastic_sees_a_non_streamed_call_grow_and_learns_its_length() -> None:
    # Slow enough that the simulator sends about one token per event (events are what is counted).
    server, _ = sim_server(speedup=2)
    with server:
        await _elastic_growth(server)


async def _elastic_growth(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=server.num_gpu_blocks - 1, policy="elastic")
    fc = LengthForecaster(q=0.5, q_blind=0.9, cold_n=0)  # from the prior at once (not the cold bound)
    metas: list[dict[str, Any]] = []
    in_flight: list[tuple[int, dict[str, Any]]] = []
    real_acquire, real_progress = budget.acquire, budget._progress

    async def acquire(blocks: int, **kw: Any) -> Any:
        metas.append(dict(kw.get("meta") or {}))
        return await real_acquire(blocks, **kw)

    def progress(lease_id: str, held: Any, fields: Any) -> None:
        real_progress(lease_id, held, fields)
        rec = budget._ledger.leases[lease_id]
        in_flight.append((rec.held, dict(rec.meta)))

    budget.acquire = acquire  # type: ignore[method-assign]
    budget._progress = progress  # type: ignore[method-assign]
    stream_q = fc.forecast("writer", generated=0, max_tokens=1000)
    blind_q = fc.forecast("writer", generated=0, max_tokens=1000, streaming=False)
    client = wrapped(server, budget, settings=settings(), forecaster=fc)
    r = await call(client, "chat", max_tokens=1000, extra_body={"sim_output_tokens": 300},
                   extra_headers={"X-ZP-Route": "writer"})
    assert r.usage.completion_tokens == 300
    # Projected as a stream: the streams' quantile (q 0.5), not the blind one (q 0.9).
    (meta,) = metas
    assert meta["streaming"] is True
    assert meta["forecast_tokens"] == stream_q < blind_q
    # While in flight: first token reported, then held growing with the exact token count.
    assert in_flight[0][1]["first_token"] is True
    helds = [h for h, _ in in_flight]
    assert helds == sorted(helds) and helds[-1] > helds[0]
    assert in_flight[-1][1]["tokens"] > in_flight[0][1]["tokens"] + 4 * 16
    # Its length taught the forecaster, under its route.
    assert fc.observations("writer") == 1
    assert (await budget.status()).used == 0


# ---------------------------------------------------------------------------------------------------
# Ineligible bodies and the setting
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("chat", {"logprobs": True, "top_logprobs": 2}), ("completion", {"logprobs": 0}),
     ("completion", {"echo": True}), ("chat", {"extra_body": {"prompt_logprobs": 1}})],
    ids=["chat-logprobs", "completion-logprobs-0", "completion-echo", "prompt-logprobs"],
)
async def test_bodies_asking_for_logprobs_or_echo_are_sent_non_streamed(
    sim: tuple[SimServer, Recorder], kind: str, extra: dict[str, Any]
) -> None:
    server, recorder = sim
    client = wrapped(server, LocalBudget(limit_blocks=server.num_gpu_blocks - 1), settings=settings())
    before = len(recorder.bodies)
    r = await call(client, kind, **extra)
    assert r.usage is not None
    (sent,) = recorder.bodies[before:]
    assert "stream" not in sent and "stream_options" not in sent


async def test_the_setting_is_read_from_the_environment_and_a_transport_option_overrides_it(
    sim: tuple[SimServer, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZP_STREAM_UPSTREAM", "0")
    assert Settings().stream_upstream is False
    server, recorder = sim
    budget = LocalBudget(limit_blocks=server.num_gpu_blocks - 1)
    for option, streamed in ((None, None), (True, True)):
        t = AsyncAdmissionTransport(budget=budget, settings=Settings(estimator="heuristic"),
                                    stream_upstream=option)
        async with httpx.AsyncClient(transport=t, base_url=server.base_url, timeout=30) as c:
            before = len(recorder.bodies)
            body = {"model": "sim-llama", "messages": MSGS, "max_tokens": 8}
            r = await c.post("/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
            assert recorder.bodies[before].get("stream") is streamed


# ---------------------------------------------------------------------------------------------------
# Streams that go wrong (a tiny uvicorn app) and cancellation (the simulator)
# ---------------------------------------------------------------------------------------------------


class EdgeServer(ThreadedApp):
    """Answers every chat call with a stream chosen by ``model``:

    - ``error-<code>``: a role chunk, a content chunk, then vLLM's error event with that ``code``
      (``error-x``: a non-numeric code), then ``[DONE]``;
    - ``flaky``: the 503 error event on the first call of each ``user``, a normal stream afterwards;
    - ``cut``: two chunks, then the connection drops mid-body;
    - ``no-done``: a complete-looking stream whose body ends without ``[DONE]``.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        super().__init__(Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])]))

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        model, user = body["model"], body.get("user", "")
        self.calls[user] = self.calls.get(user, 0) + 1
        if model == "flaky":
            model = "error-503" if self.calls[user] == 1 else "ok"
        return StreamingResponse(self._stream(model), media_type="text/event-stream")

    @staticmethod
    async def _stream(model: str) -> AsyncIterator[bytes]:
        def event(obj: Any) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return event({"id": "chatcmpl-e", "object": "chat.completion.chunk", "created": 1, "model": model,
                          "choices": [choice]})

        yield chunk({"role": "assistant", "content": ""})
        yield chunk({"content": "partial "})
        if model.startswith("error-"):
            code: Any = model.removeprefix("error-")
            code = int(code) if code.isdigit() else code
            yield event({"error": {"message": "engine failed mid-generation", "type": "InternalServerError",
                                   "param": None, "code": code}})
            yield b"data: [DONE]\n\n"
            return
        if model == "cut":
            await asyncio.sleep(0.05)
            raise ConnectionResetError("the edge server drops the connection mid-stream")
        yield chunk({}, "stop")
        yield event({"id": "chatcmpl-e", "object": "chat.completion.chunk", "created": 1, "model": model,
                     "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})
        if model != "no-done":
            yield b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def edge() -> Iterator[EdgeServer]:
    with EdgeServer() as s:
        yield s


def edge_client(edge: EdgeServer, budget: Any, **kw: Any) -> Any:
    orig = openai.AsyncOpenAI(base_url=edge.base_url, api_key="x", timeout=30)
    return wrap(orig, budget=budget, settings=Settings(estimator="heuristic", max_model_len=4096), **kw)


@pytest.mark.parametrize(("model", "error", "status"),
                         [("error-400", openai.BadRequestError, 400),
                          ("error-503", openai.InternalServerError, 503),
                          ("error-x", openai.InternalServerError, 500)])
async def test_an_error_event_becomes_the_error_answer(edge: EdgeServer, model: str, error: type,
                                                       status: int) -> None:
    budget = LocalBudget(limit_blocks=1000)
    client = edge_client(edge, budget)
    with pytest.raises(error) as info:
        await client.chat.completions.create(model=model, messages=MSGS, max_tokens=20)
    assert info.value.status_code == status
    assert info.value.body["message"] == "engine failed mid-generation"  # type: ignore[index]
    assert (await budget.status()).used == 0


async def test_an_error_event_goes_through_the_retry_decision(edge: EdgeServer) -> None:
    budget = LocalBudget(limit_blocks=1000)
    client = edge_client(edge, budget, retry=RetryPolicy(max_attempts=3, budget=None))
    with testing() as rec:
        r = await client.chat.completions.create(model="flaky", messages=MSGS, max_tokens=20, user="retry-me")
    assert r.choices[0].message.content == "partial " and r.usage.completion_tokens == 2
    assert edge.calls["retry-me"] == 2 and len(rec.sleeps) == 1
    assert (await budget.status()).used == 0


@pytest.mark.parametrize("model", ["cut", "no-done"])
async def test_a_stream_cut_short_is_a_connection_error(edge: EdgeServer, model: str) -> None:
    budget = LocalBudget(limit_blocks=1000)
    client = edge_client(edge, budget)
    with pytest.raises(openai.APIConnectionError):
        await client.chat.completions.create(model=model, messages=MSGS, max_tokens=20)
    assert (await budget.status()).used == 0


@pytest.mark.parametrize("front", ["openai", "httpx"])
async def test_cancellation_while_consuming_aborts_upstream_then_releases(front: str) -> None:
    server, _ = sim_server(speedup=5)
    with server:
        budget = LocalBudget(limit_blocks=server.num_gpu_blocks - 1)
        body = {"model": "sim-llama", "messages": MSGS, "max_tokens": 2000, "sim_output_tokens": 1500}
        if front == "openai":  # httpx2 under openai 3.x, whose body iterator closes on its own too
            client = wrapped(server, budget, settings=settings())
            inner = client._client._transport._inner

            async def long_call() -> None:
                await call(client, "chat", max_tokens=2000, extra_body={"sim_output_tokens": 1500})
        else:  # plain httpx: only the transport closes the connection
            inner = httpx.AsyncHTTPTransport()
            t = AsyncAdmissionTransport(inner, budget=budget, settings=settings())
            http = httpx.AsyncClient(transport=t, base_url=server.base_url, timeout=60)

            async def long_call() -> None:
                await http.post("/chat/completions", json=body)

        growing = anyio.Event()
        responses: list[Any] = []
        closed_at_release: list[bool] = []
        real_progress, real_release = budget._progress, budget._release
        real_handle = inner.handle_async_request

        def progress(lease_id: str, held: Any, fields: Any) -> None:
            real_progress(lease_id, held, fields)
            growing.set()

        def release(lease_id: str) -> None:
            closed_at_release.append(all(r.is_closed for r in responses))
            real_release(lease_id)

        async def handle(request: Any) -> Any:
            resp = await real_handle(request)
            if request.url.path.endswith("/chat/completions"):
                responses.append(resp)
            return resp

        budget._progress = progress  # type: ignore[method-assign]
        budget._release = release  # type: ignore[method-assign]
        inner.handle_async_request = handle
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_call)
            await growing.wait()  # the stream is being consumed inside the transport
            assert (await budget.status()).used > 0
            tg.cancel_scope.cancel()
        assert (await budget.status()).used == 0
        # The upstream response was closed before the lease was released ...
        assert len(responses) == 1 and closed_at_release == [True]
        # ... so the server aborted the request (it notices the disconnect asynchronously).
        deadline = time.monotonic() + 10
        while server.stats()["aborted_disconnect"] == 0 and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        stats = server.stats()
        assert stats["aborted_disconnect"] == 1 and stats["finished"] == 0


# ---------------------------------------------------------------------------------------------------
# The merge rules (sans I/O)
# ---------------------------------------------------------------------------------------------------


def sse(*objs: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def test_reassembly_merges_deltas_tool_calls_and_choices_by_index() -> None:
    def ch(i: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
                "system_fingerprint": "fp", "choices": [{"index": i, "delta": delta, "logprobs": None,
                                                         "finish_reason": finish, **extra}]}

    stream = sse(
        ch(1, {"role": "assistant", "content": ""}),
        ch(0, {"role": "assistant", "reasoning_content": "think"}),
        ch(0, {"reasoning_content": "ing", "tool_calls": [
            {"index": 1, "id": "t1", "type": "function", "function": {"name": "b", "arguments": "{\"x\""}},
            {"index": 0, "id": "t0", "type": "function", "function": {"name": "a", "arguments": ""}}]}),
        ch(1, {"content": "hel"}),
        ch(0, {"tool_calls": [{"index": 1, "function": {"arguments": ": 1}"}},
                              {"index": 0, "function": {"arguments": "{}"}}]}),
        ch(1, {"content": "lo", "refusal": None}),
        ch(0, {}, "tool_calls", stop_reason=None),
        ch(1, {}, "stop", stop_reason=42),
        {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}},
    )
    asm = _Reassembler(chat=True)
    mid = len(stream) // 2  # split mid-event: events complete across feeds
    events = asm.feed(stream[:mid]) + asm.feed(stream[mid:]) + asm.end()
    assert events == 10 and asm.done and asm.error is None
    assert asm.body() == {
        "id": "c1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": None, "reasoning_content": "thinking",
                                     "tool_calls": [
                                         {"id": "t0", "type": "function",
                                          "function": {"name": "a", "arguments": "{}"}},
                                         {"id": "t1", "type": "function",
                                          "function": {"name": "b", "arguments": "{\"x\": 1}"}}]},
             "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None},
            {"index": 1,
             "message": {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": []},
             "logprobs": None, "finish_reason": "stop", "stop_reason": 42},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12},
        "system_fingerprint": "fp",
    }


def test_reassembly_of_completions_and_of_an_error_event() -> None:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    asm = _Reassembler(chat=False)
    asm.feed(sse({**chunk, "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]},
                 {**chunk, "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}))
    assert asm.body()["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}]
    assert asm.body()["object"] == "text_completion" and asm.body()["usage"] is None

    err = _Reassembler(chat=True)
    err.feed(b'data: {"error": {"message": "boom", "type": "BadRequestError", "param": null, '
             b'"code": 422}}\n\n')
    assert err.error_body() == (422, {"error": {"message": "boom", "type": "BadRequestError", "param": None,
                                                "code": 422}})
    old = _Reassembler(chat=True)  # older vLLM: the error's fields at the top level
    old.feed(b'data: {"object": "error", "message": "boom", "type": "X", "param": null, "code": true}\n\n')
    assert old.error_body() == (500, {"error": {"message": "boom", "type": "X", "param": None, "code": True}})
