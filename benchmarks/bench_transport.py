"""Admission transport + LocalBudget overhead per request, against a bare httpx call to the same server.

Run:  .venv/bin/python benchmarks/bench_transport.py [--requests 400] [--rounds 7]

A tiny OpenAI-shaped server (Starlette under uvicorn, in a child process on 127.0.0.1) answers a
chat completion with a fixed JSON body, or with a short SSE stream. In each round the same client code
sends ``--requests`` sequential requests bare (``httpx.AsyncClient()``) and through
``AsyncAdmissionTransport(budget=LocalBudget(...))``; the two are interleaved round by round so drift in
machine load hits both. Printed: median per-request time of each, the added microseconds, and the
ratio admitted / bare, for plain and streamed requests (and for httpx2 when installed). A second table
repeats the measurement with an in-memory inner transport (no sockets), which isolates zp's own CPU
cost per request (estimate, lease, body rewrite, stream scanning).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from zp_client.config import Settings
from zp_client.transport import transport_classes

_PLAIN = json.dumps({
    "id": "c", "object": "chat.completion", "created": 1, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22},
}).encode()
_CHUNK = b"data: " + json.dumps({
    "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
    "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
}).encode() + b"\n\n"
_USAGE = b"data: " + json.dumps({
    "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
    "usage": {"prompt_tokens": 20, "completion_tokens": 16, "total_tokens": 36},
}).encode() + b"\n\n"


async def _chat(request: Request) -> Response:
    body = json.loads(await request.body())
    if not body.get("stream"):
        return Response(_PLAIN, media_type="application/json")
    usage = bool((body.get("stream_options") or {}).get("include_usage"))

    async def gen() -> Any:
        for _ in range(16):
            yield _CHUNK
        if usage:
            yield _USAGE
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


async def _models(request: Request) -> Response:
    return Response(json.dumps({"data": [{"id": "m", "max_model_len": 8192}]}).encode(),
                    media_type="application/json")


def _serve(port: int) -> None:
    app = Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"]),
                            Route("/v1/models", _models, methods=["GET"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off", access_log=False)


def _start_server() -> tuple[subprocess.Popen[bytes], int]:
    # The server runs in its own process: sharing the GIL with the client would add tens of ms of
    # thread hand-off per request and hide the overhead being measured.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, port
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("benchmark server did not start") from None
            time.sleep(0.05)


BODY = {"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 20},
                                   {"role": "user", "content": "say hello"}], "max_tokens": 64}


async def _run(client: Any, n: int, stream: bool) -> float:
    body = {**BODY, "stream": stream}
    t0 = time.perf_counter()
    for _ in range(n):
        if stream:
            async with client.stream("POST", "/chat/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
        else:
            r = await client.post("/chat/completions", json=body)
            r.read()
    return (time.perf_counter() - t0) / n


async def _bench(mod: Any, base: str, n: int, rounds: int, stream: bool) -> tuple[float, float]:
    from zp_client.budget.local import LocalBudget

    budget = LocalBudget(limit_blocks=100_000, block_size=16)
    settings = Settings(estimator="auto")
    zp = mod.AsyncClient(base_url=base, transport=transport_classes(mod).AsyncAdmissionTransport(
        budget=budget, settings=settings))
    bare = mod.AsyncClient(base_url=base)
    await _run(bare, 20, stream)  # warm up connections, tokenizer, max_model_len cache
    await _run(zp, 20, stream)
    b_times, z_times = [], []
    for _ in range(rounds):
        b_times.append(await _run(bare, n, stream))
        z_times.append(await _run(zp, n, stream))
    await zp.aclose()
    await bare.aclose()
    st = await budget.status()
    assert st.used == 0, f"leak: {st.used} blocks still used"
    return statistics.median(b_times), statistics.median(z_times)


class _MemoryServer:
    """An in-memory inner transport answering like the loopback server: isolates zp's CPU cost."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod

    def _stream(self, parts: list[bytes]) -> Any:
        mod = self.mod

        class _S(mod.AsyncByteStream):  # type: ignore[misc,name-defined]
            async def __aiter__(self) -> Any:
                for p in parts:
                    yield p

        return _S()

    async def handle_async_request(self, request: Any) -> Any:
        body = await request.aread()
        mod = self.mod
        if request.url.path.endswith("/models"):
            return mod.Response(200, content=b'{"data":[{"id":"m","max_model_len":8192}]}')
        if b'"stream":true' in body:
            parts = [_CHUNK] * 16 + ([_USAGE] if b"include_usage" in body else []) + [b"data: [DONE]\n\n"]
            return mod.Response(200, headers={"content-type": "text/event-stream"}, stream=self._stream(parts))
        return mod.Response(200, headers={"content-type": "application/json"}, stream=self._stream([_PLAIN]))

    async def aclose(self) -> None:
        pass


async def _bench_memory(mod: Any, n: int, rounds: int, stream: bool) -> tuple[float, float]:
    from zp_client.budget.local import LocalBudget

    budget = LocalBudget(limit_blocks=100_000, block_size=16)
    inner = type("Mem", (_MemoryServer, mod.AsyncBaseTransport), {})(mod)
    bare = mod.AsyncClient(base_url="http://mem/v1", transport=inner)
    zp = mod.AsyncClient(base_url="http://mem/v1", transport=transport_classes(mod).AsyncAdmissionTransport(
        inner, budget=budget, settings=Settings()))
    await _run(bare, 50, stream)
    await _run(zp, 50, stream)
    b_times, z_times = [], []
    for _ in range(rounds):
        b_times.append(await _run(bare, n, stream))
        z_times.append(await _run(zp, n, stream))
    assert (await budget.status()).used == 0
    return min(b_times), min(z_times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="sequential requests per round and side")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve(args.serve)
        return
    server, port = _start_server()
    base = f"http://127.0.0.1:{port}/v1"
    mods: list[Any] = [httpx]
    try:
        import httpx2

        mods.append(httpx2)
    except ImportError:
        pass
    print(f"{'module':8} {'kind':8} {'bare us':>9} {'zp us':>9} {'added us':>9} {'ratio':>6}")
    for mod in mods:
        for stream in (False, True):
            bare, zp = asyncio.run(_bench(mod, base, args.requests, args.rounds, stream))
            print(f"{mod.__name__:8} {'stream' if stream else 'plain':8} {bare * 1e6:9.0f} {zp * 1e6:9.0f} "
                  f"{(zp - bare) * 1e6:9.0f} {zp / bare:6.3f}")
    server.terminate()
    server.wait(10)
    print("\nin-memory server (no sockets): zp's own CPU time per request (min over rounds)")
    print(f"{'module':8} {'kind':8} {'bare us':>9} {'zp us':>9} {'added us':>9}")
    for mod in mods:
        for stream in (False, True):
            bare, zp = asyncio.run(_bench_memory(mod, args.requests, args.rounds, stream))
            print(f"{mod.__name__:8} {'stream' if stream else 'plain':8} {bare * 1e6:9.0f} {zp * 1e6:9.0f} "
                  f"{(zp - bare) * 1e6:9.0f}")


if __name__ == "__main__":
    main()
