"""Quick start: put a KV-block budget in front of the official openai client.

A burst of concurrent chat calls goes through ``zp_client.wrap(openai.AsyncOpenAI(...), budget=...)``.
Each call first takes a lease on the budget: under the default ``elastic`` policy a call is admitted only
while the projected peak of every live lease (each growing to its forecast end) stays within the limit;
calls that do not fit wait in a fair line in this process instead of being preempted on the GPU. While
the burst runs we sample the budget: the blocks the streams hold (as the server reports them) and the
projected peak, which is checked at each admission and can move above the limit afterwards when a reply
or a prompt turns out longer than forecast (``policy="strict"`` reserves max_tokens and never does).
At the end: every lease returned, and the server's preemption counter.

Run it against a simulator started in this process (no setup at all)::

    python examples/quickstart_wrap.py --sim

or against a running server (``zp-client sim --port 8000 --profile tiny`` or a real vLLM)::

    python examples/quickstart_wrap.py --base-url http://127.0.0.1:8000/v1 --limit-blocks 400
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time

import openai

from zp_client import LocalBudget, wrap
from zp_client.budget.base import Budget

DEFAULT_BASE_URL = os.environ.get("ZP_BASE_URL", "http://127.0.0.1:8000/v1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI base URL (env ZP_BASE_URL)")
    p.add_argument("--sim", action="store_true", help="start a simulated vLLM server in this process")
    p.add_argument("--speedup", type=float, default=5.0, help="with --sim: virtual seconds per real second")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--requests", type=int, default=24, help="calls in the burst")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each call")
    # The 'tiny' simulator profile has 511 usable blocks; 400 leaves headroom. For a real server,
    # size it from the server itself: see limit_from_server.py.
    p.add_argument("--limit-blocks", type=int, default=400, help="the budget's limit in KV blocks")
    return p.parse_args()


async def watch(budget: Budget, peaks: dict[str, int], stop: asyncio.Event) -> None:
    """Sample the budget every 10 ms and remember the peaks (status() is a cheap snapshot)."""
    while not stop.is_set():
        s = await budget.status()
        peaks["used"] = max(peaks["used"], s.used)
        peaks["held"] = max(peaks["held"], s.held)
        peaks["waiters"] = max(peaks["waiters"], sum(c.waiters for c in s.waiters.values()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.01)


async def run(args: argparse.Namespace, base_url: str) -> int:
    # One budget per server, shared by every client object and task of this process.
    budget = LocalBudget(limit_blocks=args.limit_blocks)
    # wrap() returns a new AsyncOpenAI whose calls are admitted by the budget; the original is untouched.
    raw = openai.AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    client = wrap(raw, budget=budget)
    try:
        model = args.model or (await client.models.list()).data[0].id  # not admitted: only LLM calls are

        async def ask(i: int) -> int:
            # A long-ish prompt so a few calls fill the budget and the rest have to wait their turn.
            prompt = f"Request {i}. Summarise the following notes. " + "notes about KV caches " * 60
            reply = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens,  # this is what makes the lease a true upper bound
            )
            return reply.usage.completion_tokens if reply.usage else 0

        peaks = {"used": 0, "held": 0, "waiters": 0}
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(budget, peaks, stop))
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(ask(i) for i in range(args.requests)))
        elapsed = time.perf_counter() - t0
        stop.set()
        await watcher

        status = await budget.status()
        print(f"completed {len(tokens)}/{args.requests} requests in {elapsed:.2f} s, "
              f"{sum(tokens)} completion tokens")
        print(f"peak held {peaks['held']} blocks, peak projected {peaks['used']} (limit {status.limit}), "
              f"peak waiters {peaks['waiters']}")
        print(f"budget after the burst: used={status.used} leases={status.leases} "
              f"waiters={sum(c.waiters for c in status.waiters.values())}")
        return 0 if len(tokens) == args.requests and status.used == 0 else 1
    finally:
        await client.close()
        await raw.close()  # wrap() shares the original's connection pool; close the original too


async def main() -> int:
    args = parse_args()
    if not args.sim:
        return await run(args, args.base_url)
    from zp_sim.server import SimServer  # needs zp-sim: pip install -e sim/

    async with SimServer(profile="tiny", speedup=args.speedup) as server:
        print(f"simulator: {server.num_gpu_blocks} KV blocks at {server.base_url}")
        rc = await run(args, server.base_url)
        # The point of the budget: the server never had to preempt (recompute) a request.
        print(f"simulator preemptions: {server.stats()['engine']['preemptions_total']}")
        return rc


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
