"""A non-streamed call is streamed upstream (docs/admission.md#non-streamed-calls-are-streamed-upstream):
once the server's answer started (its first body byte), a cut or an end without ``[DONE]`` is not retried
(the server did the work; only failures before it started are, docs/retries.md) and ends in one typed
error. Against a raw asyncio HTTP/1.1 server on loopback that misbehaves on purpose (issue 33, item 7)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from zp_client import wrap
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.retry import RetryPolicy, testing
from zp_client.transport import AsyncAdmissionTransport

pytestmark = [pytest.mark.anyio, pytest.mark.openai_compat]

MSGS = [{"role": "user", "content": "q"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    obj = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class RawServer:
    """Answers every POST (and every GET with a 404) with a 200 event stream shaped by ``mode``:

    - ``cut``: a role chunk and a content chunk, then the connection closes mid-body (no final chunk);
    - ``no-done``: a whole stream (finish_reason, usage) whose body ends cleanly without ``[DONE]``;
    - ``ok``: the same with ``[DONE]``.
    Counts the requests it got (``calls``)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            if not head.startswith(b"POST "):  # the client's metadata reads (GET /metrics...): none here
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                await writer.drain()
                return
            self.calls += 1
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
            writer.write(_chunk(_event({"role": "assistant", "content": ""})))
            writer.write(_chunk(_event({"content": "partial "})))
            await writer.drain()
            if self.mode != "cut":
                writer.write(_chunk(_event({}, "stop")))
                usage = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": [],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
                writer.write(_chunk(b"data: " + json.dumps(usage).encode() + b"\n\n"))
                if self.mode == "ok":
                    writer.write(_chunk(b"data: [DONE]\n\n"))
                writer.write(b"0\r\n\r\n")  # the body ends cleanly
                await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RawServer, str]]:
    srv = RawServer(request.param)
    async with srv as url:
        yield srv, url


SETTINGS = Settings(estimator="heuristic", max_model_len=4096)
RETRY = RetryPolicy(max_attempts=3, budget=None, backoff_initial_s=0.001, backoff_max_s=0.001)


@pytest.mark.parametrize("served", ["cut", "no-done"], indirect=True)
@pytest.mark.parametrize("retry", ["default", "explicit"])
async def test_an_answer_cut_after_its_first_byte_gets_one_attempt_and_a_typed_error(
        served: tuple[RawServer, str], retry: str) -> None:
    srv, url = served
    budget = LocalBudget(limit_blocks=1000)
    kw: dict[str, Any] = {"retry": RETRY} if retry == "explicit" else {}
    client = wrap(openai.AsyncOpenAI(base_url=url, api_key="x", timeout=10), budget=budget, settings=SETTINGS,
                  **kw)
    with testing(), pytest.raises(openai.APIConnectionError) as info:  # testing(): no real backoff sleep
        await client.chat.completions.create(model="m", messages=MSGS, max_tokens=20)  # type: ignore[arg-type]
    assert srv.calls == 1  # one attempt: the server had started answering
    cause = info.value.__cause__
    assert isinstance(cause, Exception) and "incomplete" in str(cause)
    assert (await budget.status()).used == 0
    await client.close()


@pytest.mark.parametrize("served", ["cut", "no-done"], indirect=True)
async def test_through_the_httpx_transport_too(served: tuple[RawServer, str]) -> None:
    srv, url = served
    budget = LocalBudget(limit_blocks=1000)
    t = AsyncAdmissionTransport(httpx.AsyncHTTPTransport(), budget=budget, settings=SETTINGS, retry=RETRY)
    async with httpx.AsyncClient(transport=t, base_url=url, timeout=10) as http:
        with testing(), pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
            await http.post("/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 20})
    assert srv.calls == 1
    assert (await budget.status()).used == 0


@pytest.mark.parametrize("served", ["ok"], indirect=True)
async def test_a_whole_answer_is_reassembled(served: tuple[RawServer, str]) -> None:
    """The server above is a fair one in this mode: the same client gets the whole answer."""
    srv, url = served
    budget = LocalBudget(limit_blocks=1000)
    client = wrap(openai.AsyncOpenAI(base_url=url, api_key="x", timeout=10), budget=budget, settings=SETTINGS,
                  retry=RETRY)
    r = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=20)  # type: ignore[arg-type]
    assert r.choices[0].message.content == "partial " and srv.calls == 1
    assert (await budget.status()).used == 0
    await client.close()
