"""Helpers of the agent-framework tests (tests/frameworks/test_frameworks_*.py, integrations/llama-index/tests).

:class:`FailProxy`: a proxy on loopback in front of an upstream (the simulator) that answers 503 to chosen
requests: how many upstream attempts does an always-failing call make through a framework?

A POST whose body contains :data:`FAIL_MARK` followed by a tag (``"always-503:<tag>"``, e.g. in the user's
prompt) is answered 503 every time, and counted per tag; everything else (``/v1/models``, ``/metrics``, chat
calls, streams) is forwarded to the upstream unchanged.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
from _asgi_server import ThreadedApp
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from zp_client import LocalBudget
from zp_client.budget.base import Lease

FAIL_MARK = "always-503:"
_TAG = re.compile(re.escape(FAIL_MARK) + r"([A-Za-z0-9_-]+)")
# hop-by-hop headers and those the forwarded body's framing decides
_DROP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


class FailProxy(ThreadedApp):
    """``attempts[tag]``: how many times a request tagged ``always-503:<tag>`` reached the proxy;
    ``forwarded``: how many requests went through to the upstream (by path)."""

    def __init__(self, upstream_url: str, model: str = "sim-llama") -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.model = model  # the upstream's model name, for the tests' convenience
        self.attempts: Counter[str] = Counter()
        self.forwarded: Counter[str] = Counter()
        self.retry_counts: list[str] = []  # x-stainless-retry-count of each failed attempt (openai's SDK)
        route = Route("/{path:path}", self._handle, methods=["GET", "POST"])
        super().__init__(Starlette(routes=[route]))

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        if request.method == "POST":
            found = _TAG.search(body.decode("utf-8", "replace"))
            if found:
                self.attempts[found.group(1)] += 1
                self.retry_counts.append(request.headers.get("x-stainless-retry-count", ""))
                return JSONResponse({"error": {"message": "upstream overloaded", "type": "x", "param": None,
                                               "code": 503}}, status_code=503)
        self.forwarded[request.url.path] += 1
        client = httpx.AsyncClient(timeout=60)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        upstream = await client.send(
            client.build_request(request.method, self.upstream_url + request.url.path,
                                 params=request.query_params, headers=headers, content=body),
            stream=True)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP}

        async def close() -> None:
            await upstream.aclose()
            await client.aclose()

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in upstream.aiter_raw():
                yield chunk

        return StreamingResponse(chunks(), status_code=upstream.status_code, headers=out_headers,
                                 background=BackgroundTask(close))


class CountingBudget(LocalBudget):
    """A LocalBudget that counts its acquires (sync and async), refused ones included: how many times a
    framework's call asked zp for a lease, e.g. exactly once for a refusal that must not be retried."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acquires = 0

    async def acquire(self, blocks: int, **kwargs: Any) -> Lease:
        self.acquires += 1
        return await super().acquire(blocks, **kwargs)

    def acquire_sync(self, blocks: int, **kwargs: Any) -> Lease:
        self.acquires += 1
        return super().acquire_sync(blocks, **kwargs)


def released(budget: LocalBudget) -> bool:
    """Every lease given back: no block used, none held."""
    status = budget.status_sync()
    return status.used == 0 and status.leases == 0
