"""vLLM's ``stream_options.continuous_usage_stats`` under an elastic budget (``Settings.continuous_usage``).

With it, every chunk carries the exact prompt and completion tokens so far, so the lease (a) holds the
server's prompt count from the first token on instead of the estimate plus its error bound, and (b) counts
growth exactly when the server packs several tokens into one chunk (vLLM merges the deltas of a slow
reader). The caller reads what it asked for: the per-chunk usage is removed unless it asked for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests._asgi_server import LoopbackServer, ThreadedApp
from zp_client import wrap
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.sim.server import SimServer
from zp_client.transport import transport_classes

pytestmark = pytest.mark.anyio

PROMPT_TOKENS = 1000  # what the server says the prompt is (the estimate of SYSTEM differs)
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 120}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class VLLMShaped(ThreadedApp):
    """Streams like vLLM with a slow reader: ``per_chunk`` tokens per content chunk, continuous usage when
    asked. ``hold`` (the request's ``max_tokens`` is the total) pauses the stream after that many content
    chunks until :meth:`resume`, so a test can look at the lease mid-stream."""

    def __init__(self, per_chunk: int = 5, hold: int | None = None) -> None:
        self.per_chunk = per_chunk
        self.hold = hold
        self.bodies: list[dict[str, Any]] = []
        self.resume_flag = False
        super().__init__(Starlette(routes=[
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ]))

    def resume(self) -> None:
        self.resume_flag = True

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 32768}]})

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        so = body.get("stream_options") or {}
        usage_on = bool(so.get("include_usage"))
        continuous = usage_on and bool(so.get("continuous_usage_stats"))
        total = int(body.get("max_tokens") or 16)

        def chunk(delta: dict[str, Any], done: int, finish: str | None = None) -> bytes:
            obj: dict[str, Any] = {"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 1,
                                   "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                              "finish_reason": finish}]}
            if continuous:  # vLLM's field order: prompt, total, completion
                obj["usage"] = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + done,
                                "completion_tokens": done}
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        async def stream() -> Any:
            yield chunk({"role": "assistant", "content": ""}, 0)
            done = 0
            chunks = 0
            while done < total:
                k = min(self.per_chunk, total - done)
                done += k
                chunks += 1
                yield chunk({"content": "x" * k}, done)
                if self.hold is not None and chunks == self.hold:
                    while not self.resume_flag:
                        await asyncio.sleep(0.005)
            yield chunk({}, done, "length")
            if usage_on:
                final = {"id": "chatcmpl-v", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + done,
                                                  "completion_tokens": done}}
                yield b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def client(server: Any, budget: Any, **settings: Any) -> httpx.AsyncClient:
    t = transport_classes(httpx).AsyncAdmissionTransport(
        budget=budget, settings=Settings(estimator="heuristic", **settings))
    return httpx.AsyncClient(transport=t, base_url=server.base_url, timeout=30)


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in raw.decode().split("\n")
            if line.startswith("data:") and line.strip() != "data: [DONE]"]


def live_meta(budget: LocalBudget) -> tuple[int, dict[str, Any]]:
    (rec,) = budget._ledger.leases.values()
    return rec.held, dict(rec.meta)


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "stream": True, **extra}


async def test_packed_chunks_are_counted_exactly_and_the_prompt_is_the_servers() -> None:
    """8 tokens per chunk: after 4 content chunks the lease holds exactly prompt + 32 tokens (each chunk
    here starts a new block, so each is reported); counting events (the fallback) would say 4. The prompt
    is the server's 1000, not the estimate."""
    with VLLMShaped(per_chunk=8, hold=4) as server:
        budget = LocalBudget(10_000, 16, policy="elastic")
        async with client(server, budget) as c:
            async with c.stream("POST", "/chat/completions", json=body(200)) as r:
                it = r.aiter_raw()  # (breaking out of an async for would close the stream)
                got = bytearray()
                while got.count(b"data:") < 5:  # role + 4 content chunks
                    got += await it.__anext__()
                await asyncio.sleep(0.05)
                held, meta = live_meta(budget)
                assert meta["prompt_tokens"] == PROMPT_TOKENS
                assert meta["tokens"] == PROMPT_TOKENS + 32
                assert held == -(-(PROMPT_TOKENS + 32) // 16)
                server.resume()
                async for part in it:
                    got += part
        sent = server.bodies[-1]["stream_options"]
        assert sent == {"include_usage": True, "continuous_usage_stats": True}
        # The caller asked for neither: no usage anywhere in what it read, content intact.
        evs = events(bytes(got))
        assert all("usage" not in e for e in evs)
        assert sum(len(e["choices"][0]["delta"].get("content") or "") for e in evs) == 200
        assert len(evs) == 1 + 25 + 1  # role, 200 / 8 content chunks, finish
        assert (await budget.status()).used == 0


async def test_without_continuous_usage_packed_chunks_are_undercounted() -> None:
    """The control for the test above: with the option off, the same stream is counted one token per
    chunk, so the lease trails the server by 7 tokens per chunk."""
    with VLLMShaped(per_chunk=8, hold=4) as server:
        budget = LocalBudget(10_000, 16, policy="elastic")
        async with client(server, budget, continuous_usage="never") as c:
            async with c.stream("POST", "/chat/completions", json=body(200)) as r:
                it = r.aiter_raw()
                got = bytearray()
                while got.count(b"data:") < 5:
                    got += await it.__anext__()
                await asyncio.sleep(0.05)
                _, meta = live_meta(budget)
                assert meta["prompt_tokens"] != PROMPT_TOKENS  # the estimate plus its error bound
                assert meta["tokens"] - meta["prompt_tokens"] <= 4
                server.resume()
                async for _ in it:
                    pass
        assert "continuous_usage_stats" not in server.bodies[-1]["stream_options"]


@pytest.mark.parametrize("asked", [{"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}],
                         ids=["include_usage", "continuous"])
async def test_the_caller_reads_the_usage_it_asked_for(asked: dict[str, Any]) -> None:
    with VLLMShaped(per_chunk=3) as server:
        budget = LocalBudget(10_000, 16, policy="elastic")
        async with client(server, budget) as c:
            r = await c.post("/chat/completions", json=body(30, stream_options=asked))
        evs = events(r.content)
        final = evs[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 30
        per_chunk = [e for e in evs[:-1] if "usage" in e]
        if asked.get("continuous_usage_stats"):
            # asked by the caller: handed back untouched
            assert len(per_chunk) == len(evs) - 1
            assert [e["usage"]["completion_tokens"] for e in per_chunk][-1] == 30
        else:
            assert per_chunk == []
        assert (await budget.status()).used == 0


@pytest.mark.parametrize("mode,expected", [("auto", False), ("always", True), ("never", False)])
async def test_auto_asks_only_a_server_that_said_it_is_vllm(mode: str, expected: bool) -> None:
    """LoopbackServer is OpenAI-shaped (its cards do not say vLLM): "auto" does not send vLLM's field to
    a server that may refuse it."""
    with LoopbackServer() as server:
        budget = LocalBudget(10_000, 16, policy="elastic")
        async with client(server, budget, continuous_usage=mode) as c:
            r = await c.post("/chat/completions", json={**body(6), "model": "ok"})
            assert r.status_code == 200
        (req,) = server.llm_requests()
        assert ("continuous_usage_stats" in req["body"]["stream_options"]) is expected


async def test_responses_streams_are_never_asked() -> None:
    """``/responses`` events carry ``usage`` in another shape (inside ``response.completed``): zp neither
    asks vLLM's chat/completions option there nor touches those events."""
    with LoopbackServer() as server:
        budget = LocalBudget(10_000, 16, policy="elastic")
        async with client(server, budget, continuous_usage="always") as c:
            r = await c.post("/responses", json={"model": "ok", "input": "hi", "stream": True, "max_output_tokens": 8})
            assert r.status_code == 200
        (req,) = server.llm_requests()
        assert "continuous_usage_stats" not in (req["body"].get("stream_options") or {})


async def test_continuous_usage_without_include_usage_reads_no_usage() -> None:
    """A caller asking continuous_usage_stats without include_usage gets what vLLM sends it without zp:
    no usage at all (vLLM ignores the option without include_usage, which zp adds for itself)."""
    with VLLMShaped(per_chunk=2) as server:
        budget = LocalBudget(10_000, 16, policy="elastic")
        async with client(server, budget) as c:
            r = await c.post("/chat/completions", json=body(12, stream_options={"continuous_usage_stats": True}))
        assert server.bodies[-1]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        evs = events(r.content)
        assert evs and all("usage" not in e for e in evs)
        assert sum(len(e["choices"][0]["delta"].get("content") or "") for e in evs) == 12


async def test_a_strict_budget_never_asks() -> None:
    with VLLMShaped() as server:
        budget = LocalBudget(10_000, 16, policy="strict")
        async with client(server, budget, continuous_usage="always") as c:
            r = await c.post("/chat/completions", json=body(10))
            assert r.status_code == 200
        assert "continuous_usage_stats" not in server.bodies[-1]["stream_options"]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=50.0) as s:
        yield s


@pytest.mark.openai_compat
async def test_openai_stream_through_the_simulator(sim: SimServer) -> None:
    """The real openai SDK on the simulator (vLLM's continuous usage): the caller who asked include_usage
    gets usage only in the final chunk, the same text, and the lease returns."""
    budget = LocalBudget(sim.num_gpu_blocks - 1, 16, policy="elastic")
    oc = wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0), budget,
              settings=Settings(estimator="heuristic"))
    msgs = [SYSTEM, {"role": "user", "content": "count"}]
    stream = await oc.chat.completions.create(model=sim.model, messages=msgs, max_tokens=40, seed=3, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    usages, text = [], []
    async for ch in stream:
        usages.append(ch.usage)
        if ch.choices and ch.choices[0].delta.content:
            text.append(ch.choices[0].delta.content)
    assert all(u is None for u in usages[:-1])
    assert usages[-1] is not None and usages[-1].completion_tokens == 40
    plain = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0)
    ref = await plain.chat.completions.create(model=sim.model, messages=msgs, max_tokens=40, seed=3,
                                              extra_body={"ignore_eos": True})
    assert "".join(text) == ref.choices[0].message.content
    assert usages[-1].prompt_tokens == ref.usage.prompt_tokens
    assert (await budget.status()).used == 0
    await oc.close()
    await plain.close()


@pytest.mark.parametrize("event", [
    b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2}}\n\n',
    b'data: {"usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}, "id": "x", "choices": []}\n\n',
    b'data: {"id":"x","usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":3}},"choices":[{"index":0}]}\n\n',
    b'data: {"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\n',
])
def test_removing_a_chunks_usage_leaves_the_same_json_without_it(event: bytes) -> None:
    from zp_client._sse import usage_member as _usage_member

    start, end, a, b = _usage_member(event)
    doc = json.loads(event[5:])
    assert json.loads(event[a:b]) == doc.pop("usage")
    assert json.loads((event[:start] + event[end:])[5:]) == doc


def test_text_that_looks_like_usage_is_not_usage() -> None:
    from zp_client._sse import usage_member as _usage_member

    ev = b"data: " + json.dumps({"choices": [{"delta": {"content": '"usage": {"prompt_tokens": 1}'}}]}).encode() + b"\n\n"
    assert _usage_member(ev) is None
