"""An OpenAI-shaped server on loopback whose requests fail (429, 503, 400, 500) on their first attempt,
chosen by the request's ``user`` field: for the tests that every front end retries by default."""

from __future__ import annotations

import json
import time

from _asgi_server import ThreadedApp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

RETRY_AFTER_MS = 300


def _error(status: int, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse({"error": {"message": f"status {status}", "type": "x", "param": None, "code": status}},
                        status_code=status, headers=headers)


class RetryUpstream(ThreadedApp):
    """``user`` picks the behaviour of a request's FIRST attempt; later attempts succeed.

    ``429-*``: 429 with ``retry-after-ms: 300``; ``503-*``: 503 (no Retry-After); ``529-*``: 529 (overloaded) with ``retry-after-ms: 300``; ``400-*``: 400;
    ``500-*``: 500; anything else: OK. Records each arrival with its time.
    """

    def __init__(self) -> None:
        self.arrivals: list[tuple[str, float]] = []
        self._seen: dict[str, int] = {}
        super().__init__(Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])]))

    def users(self) -> list[str]:
        return [u for u, _ in self.arrivals]

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        user = str(body.get("user", ""))
        self._seen[user] = n = self._seen.get(user, 0) + 1
        self.arrivals.append((f"{user}#{n}", time.monotonic()))
        kind = user.split("-")[0]
        if n == 1 and kind == "429":
            return _error(429, {"retry-after-ms": str(RETRY_AFTER_MS)})
        if n == 1 and kind == "529":
            return _error(529, {"retry-after-ms": str(RETRY_AFTER_MS)})
        if n == 1 and kind == "503":
            return _error(503)
        if kind == "400":
            return _error(400)
        if kind == "500":
            return _error(500)
        return JSONResponse({
            "id": "x", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        })
