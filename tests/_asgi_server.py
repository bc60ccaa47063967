"""A small OpenAI-shaped HTTP server on loopback for transport tests (real uvicorn, real sockets).

Behaviour is chosen by the request's ``model``:

- ``ok``: a normal answer; streamed when ``stream`` is true (role chunk, ``min(max_tokens, 6)`` content
  chunks, a finish chunk, the usage-only chunk when ``stream_options.include_usage``, ``[DONE]``). With
  ``include_usage`` every chunk also carries ``"usage": null``, as OpenAI's API does.
- ``err400`` / ``err500``: an error body in vLLM's shape with that status.
- ``reset``: streams two chunks, then drops the connection without finishing the chunked body.
- ``slow``: streams a chunk every 20 ms, up to 3000 chunks, until the client goes away.
- ``delay``: streams the role chunk, stays silent for 0.8 s, then goes on like ``ok``.

Every request is recorded (method, path, headers, JSON body) in ``server.requests``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MAX_MODEL_LEN = 4096


class PromptExitServer(uvicorn.Server):
    """A uvicorn server that stops as soon as it is asked: uvicorn's main loop looks at ``should_exit``
    every 0.1 s, which every test paid on each server it stopped; :meth:`exit_now` also wakes it."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    def exit_now(self) -> None:
        """Ask the server to stop, from any thread."""
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                loop.call_soon_threadsafe(wake.set)


class ThreadedApp:
    """Serves a Starlette ``app`` with uvicorn on a free loopback port in a daemon thread (a context
    manager); subclasses build their routes and call ``super().__init__(app)``."""

    def __init__(self, app: Starlette) -> None:
        self._server = PromptExitServer(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off")
        )
        self._thread: threading.Thread | None = None
        self.port = 0

    def __enter__(self) -> Any:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"{type(self).__name__} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.exit_now()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LoopbackServer(ThreadedApp):
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.slow_streams_open = 0
        self._flaky_seen: dict[str, int] = {}
        app = Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._chat, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/files", self._files, methods=["POST"]),
            ]
        )
        super().__init__(app)

    def llm_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["path"].endswith(("completions", "responses"))]

    # -- endpoints -----------------------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        self._record(request, None)
        return Response(b"", status_code=200)

    async def _files(self, request: Request) -> Response:
        body = await request.body()
        self._record(request, None)
        return JSONResponse({"received": len(body)})

    async def _responses(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self._record(request, body)
        return JSONResponse({"id": "resp-1", "object": "response", "status": "completed", "output": [],
                             "usage": {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}})

    async def _models(self, request: Request) -> Response:
        self._record(request, None)
        return JSONResponse(
            {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": MAX_MODEL_LEN}
                                        for m in ("ok", "err400", "err500", "reset", "slow", "flaky", "delay")]}
        )

    def _record(self, request: Request, body: Any) -> None:
        self.requests.append(
            {"method": request.method, "path": request.url.path, "headers": dict(request.headers), "body": body}
        )

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self._record(request, body)
        model = body.get("model", "ok")
        chat = request.url.path.endswith("chat/completions")
        if model == "flaky":
            # 503 with Retry-After on the first attempt of each distinct "user", then a normal answer.
            key = body.get("user", "")
            self._flaky_seen[key] = self._flaky_seen.get(key, 0) + 1
            if self._flaky_seen[key] == 1:
                return JSONResponse({"error": {"message": "overloaded", "type": "ServiceUnavailable",
                                               "param": None, "code": 503}},
                                    status_code=503, headers={"retry-after-ms": "10"})
        if model in ("err400", "err500"):
            status = 400 if model == "err400" else 500
            return JSONResponse(
                {"error": {"message": f"test error {status}", "type": "BadRequestError", "param": None,
                           "code": status}},
                status_code=status,
            )
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        n_chunks = min(int(max_tokens), 6)
        usage = {"prompt_tokens": 12, "completion_tokens": n_chunks, "total_tokens": 12 + n_chunks}
        if not body.get("stream"):
            if chat:
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "hi " * n_chunks},
                                          "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "hi " * n_chunks, "finish_reason": "length"}
            return JSONResponse({"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                 "created": 1, "model": model, "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(self._stream(model, chat, n_chunks, include_usage, usage),
                                 media_type="text/event-stream")

    async def _stream(self, model: str, chat: bool, n_chunks: int, include_usage: bool, usage: dict[str, Any]):
        def chunk(delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
            if chat:
                choices = [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}]
                obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
                       "choices": choices}
            else:
                obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model,
                       "choices": [{"index": 0, "text": (delta or {}).get("content", ""), "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None  # as OpenAI does: every chunk says "usage": null once usage is on
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        yield chunk({"role": "assistant", "content": ""})
        if model == "reset":
            yield chunk({"content": "a"})
            yield chunk({"content": "b"})
            await asyncio.sleep(0.05)
            raise ConnectionResetError("test server drops the connection mid-stream")
        if model == "delay":  # a server slow to produce: silence after the role chunk
            await asyncio.sleep(0.8)
        if model == "slow":
            self.slow_streams_open += 1
            try:
                for i in range(3000):
                    yield chunk({"content": f"t{i} "})
                    await asyncio.sleep(0.02)
            finally:
                self.slow_streams_open -= 1
            return
        for i in range(n_chunks):
            yield chunk({"content": f"t{i} "})
        yield chunk({}, "length")
        if include_usage:
            obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
                   "choices": [], "usage": usage}
            yield b"data: " + json.dumps(obj).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
