"""Upstreams that fail chosen requests, on loopback: for the one-retry-loop tests (tests/retry/test_one_loop.py,
integrations/litellm/tests).

* :class:`FailProxy`: an HTTP proxy in front of ``upstream`` (e.g. the simulator, ``zp_client.sim``)
  that answers 503 to every chat request whose ``user`` (without one: ``model``) starts with ``fail``
  (``slow``: after 5 s) and forwards everything else (streams too). Without an upstream it answers a
  fixed OK itself. Records each chat arrival's ``user`` (or ``model``) and headers.
* :class:`DropServer`: a TCP server that reads each request and closes the connection without an
  answer (the client sees ``RemoteProtocolError``, a transport error); counts the requests.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

import httpx
from _asgi_server import ThreadedApp
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_HOP = {"host", "content-length", "transfer-encoding", "connection"}


class FailProxy(ThreadedApp):
    def __init__(self, upstream: str | None = None) -> None:
        self.upstream = upstream.rstrip("/") if upstream else None
        self.arrivals: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.bodies: list[bytes] = []
        self._client: httpx.AsyncClient | None = None
        super().__init__(Starlette(routes=[
            Route("/{path:path}", self._any, methods=["GET", "POST"]),
        ]))

    def count(self, user: str) -> int:
        return self.arrivals.count(user)

    async def _any(self, request: Request) -> Response:
        raw = await request.body()
        if request.method == "POST" and request.url.path.endswith("/chat/completions"):
            body = json.loads(raw)
            user = str(body.get("user") or body.get("model") or "")  # LiteLLM drops ``user``: the model then
            self.arrivals.append(user)
            self.headers.append(dict(request.headers))
            self.bodies.append(raw)
            if user.startswith("slow"):  # a call to cancel while it is upstream
                await asyncio.sleep(5)
            if user.startswith(("fail", "slow")):
                return JSONResponse({"error": {"message": "overloaded", "type": "ServiceUnavailable",
                                               "param": None, "code": 503}}, status_code=503)
            if self.upstream is None:
                return JSONResponse({
                    "id": "x", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
                })
        if self.upstream is None:
            return JSONResponse({"error": "not found"}, status_code=404)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=30.0)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        up = self._client.build_request(request.method, self.upstream + request.url.path, headers=headers,
                                        content=raw)
        resp = await self._client.send(up, stream=True)
        out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=out,
                                 background=BackgroundTask(resp.aclose))


class DropServer:
    """Accepts, reads one request per connection, closes without answering. A context manager."""

    def __init__(self) -> None:
        self.requests = 0
        self.port = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> DropServer:
        s = self._sock = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        s.settimeout(0.1)
        self.port = s.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        data += chunk
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value.strip())
                    while len(rest) < length:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        rest += chunk
                except OSError:
                    continue
                if head.startswith(b"POST"):
                    self.requests += 1
