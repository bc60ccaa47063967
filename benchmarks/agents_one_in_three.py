"""Issue 31's agent case: ``--runs`` (30) concurrent OpenAI Agents SDK tool runs (a tool call, then the
answer: 2 LLM calls each) against the simulator behind a proxy that answers 503 to the first attempt of
every third call (its retry, the same body, goes through). Through zp (``wrap()``, the documented
defaults) and with plain openai (its own retries, ``max_retries=2``); reported: runs finished, wall time,
the ratio (target: 30/30 within 1.5x plain openai's wall time). Loopback only, real sleeps.

    python benchmarks/agents_one_in_three.py            # about 40 s
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
import openai  # noqa: E402
from _asgi_server import ThreadedApp  # noqa: E402
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,  # noqa: E402
)
from starlette.applications import Starlette  # noqa: E402
from starlette.background import BackgroundTask  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from zp_client import LocalBudget, Settings, wrap  # noqa: E402
from zp_sim.server import SimServer  # noqa: E402

_DROP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


class OneInThree(ThreadedApp):
    """Answers 503 to the first attempt of every third new chat request (by body); forwards the rest."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.new = 0
        self.failed: set[bytes] = set()
        self.attempts = 0
        super().__init__(Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST"])]))

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        if request.method == "POST" and request.url.path.endswith("/chat/completions"):
            self.attempts += 1
            key = hashlib.sha256(body).digest()
            if key not in self.failed:
                self.new += 1
                if self.new % 3 == 0:
                    self.failed.add(key)
                    return JSONResponse({"error": {"message": "overloaded", "type": "x", "param": None,
                                                   "code": 503}}, status_code=503)
        client = httpx.AsyncClient(timeout=60)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        up = await client.send(client.build_request(request.method, self.upstream + request.url.path,
                                                    params=request.query_params, headers=headers,
                                                    content=body), stream=True)

        async def close() -> None:
            await up.aclose()
            await client.aclose()

        async def chunks() -> AsyncIterator[bytes]:
            async for c in up.aiter_raw():
                yield c

        out = {k: v for k, v in up.headers.items() if k.lower() not in _DROP}
        return StreamingResponse(chunks(), status_code=up.status_code, headers=out,
                                 background=BackgroundTask(close))


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def runs(client: openai.AsyncOpenAI, model: str, n: int) -> tuple[int, float]:
    set_tracing_disabled(True)
    agent = Agent(name="w", instructions="Answer weather questions with the tool.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=48))

    async def one(i: int) -> bool:
        try:
            await Runner.run(agent, f"What is the weather in city number {i}?")
            return True
        except Exception as exc:  # noqa: BLE001 - a failed run is counted, its type printed
            print(f"  run {i} failed: {type(exc).__name__}: {str(exc)[:120]}")
            return False

    t0 = time.monotonic()
    ok = await asyncio.gather(*(one(i) for i in range(n)))
    wall = time.monotonic() - t0
    await client.close()  # on this event loop (one collected later would close on a closed loop)
    return sum(ok), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--limit-blocks", type=int, default=480,
                    help="the KV budget (480: about the simulator's pool of 512 blocks)")
    ap.add_argument("--estimator", default="heuristic")
    ap.add_argument("--trials", type=int, default=3, help="each client this many times, alternating; medians")
    args = ap.parse_args()
    labels = ("plain openai (max_retries=2)", "zp wrap() (defaults)")
    seen: dict[str, list[tuple[int, float, int]]] = {label: [] for label in labels}
    with SimServer(profile="tiny", speedup=1.0) as sim:
        for t in range(args.trials):
            for label in (labels if t % 2 == 0 else labels[::-1]):  # alternate: neither always goes first
                with OneInThree(sim.url) as proxy:
                    raw = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="x", max_retries=2)
                    budget = LocalBudget(limit_blocks=args.limit_blocks)
                    client: Any = raw if label.startswith("plain") else wrap(
                        raw, budget, settings=Settings(estimator=args.estimator))
                    done, wall = asyncio.run(runs(client, sim.model, args.runs))
                    seen[label].append((done, wall, proxy.attempts))
    base = statistics.median(w for _, w, _ in seen[labels[0]])
    print(f"{args.runs} concurrent tool runs, {args.trials} trials each (median wall time); zp: "
          f"limit_blocks={args.limit_blocks}, estimator={args.estimator}")
    print("| client | runs finished (each trial) | wall time, median (each) | vs plain openai | "
          "upstream attempts (each) |")
    print("|---|---|---|---|---|")
    for label in labels:
        rs = seen[label]
        med = statistics.median(w for _, w, _ in rs)
        print(f"| {label} | {[d for d, _, _ in rs]} of {args.runs} | {med:.1f} s "
              f"({', '.join(f'{w:.1f}' for _, w, _ in rs)}) | {med / base:.2f}x | {[a for _, _, a in rs]} |")

if __name__ == "__main__":
    main()
