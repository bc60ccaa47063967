"""The drop-in client: ``zp_client.AsyncClient`` with streaming.

``AsyncClient`` speaks the OpenAI HTTP API (``client.chat.completions.create(...)``) and admits every
call through the budget; no openai package needed. Here several chat streams run at once:

* each stream holds a lease from the moment it is admitted until the stream ends;
* while a stream advances, its lease reports how many blocks it occupies *now* (``held``), which
  grows from the prompt's blocks toward its end (``used`` is what the budget reserves: under the default
  ``elastic`` policy the projected peak of the live leases, each growing to its forecast end);
* one stream is abandoned after its first text: closing it releases its lease at once (and the server
  aborts the request, freeing its KV blocks).

Run::

    python examples/drop_in_client.py --sim                       # self-contained
    python examples/drop_in_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import os

from zp_client import AsyncClient, LocalBudget

DEFAULT_BASE_URL = os.environ.get("ZP_BASE_URL", "http://127.0.0.1:8000/v1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI base URL (env ZP_BASE_URL)")
    p.add_argument("--sim", action="store_true", help="start a simulated vLLM server in this process")
    p.add_argument("--speedup", type=float, default=2.0, help="with --sim: virtual seconds per real second")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--streams", type=int, default=6, help="concurrent streams")
    p.add_argument("--max-tokens", type=int, default=200, help="max_tokens of each stream")
    p.add_argument("--limit-blocks", type=int, default=400, help="the budget's limit in KV blocks")
    p.add_argument("--quiet", action="store_true", help="do not echo the first stream's text")
    return p.parse_args()


async def run(args: argparse.Namespace, base_url: str) -> int:
    budget = LocalBudget(limit_blocks=args.limit_blocks)
    # api_key falls back to ZP_API_KEY / OPENAI_API_KEY; without one no Authorization header is sent.
    async with AsyncClient(base_url=base_url, budget=budget) as client:
        model = args.model or (await client.models.list()).data[0].id
        peak = {"used": 0, "held": 0}

        async def consume(i: int) -> tuple[int, str]:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Story {i}: " + "once upon a time " * 40}],
                max_tokens=args.max_tokens,
                stream=True,
            )
            chunks = 0
            # `async with` closes the stream on every exit path, which is what returns the lease.
            async with stream:
                async for chunk in stream:
                    chunks += 1
                    if i == 0 and not args.quiet and chunk.choices:
                        print(chunk.choices[0].delta.content or "", end="", flush=True)
                    s = await budget.status()  # a LocalBudget's status is cheap: sampled at every chunk
                    peak["used"], peak["held"] = max(peak["used"], s.used), max(peak["held"], s.held)
                    # the first chunk carries the role, the second the first text: a server sends a lagging
                    # reader fewer, larger chunks (vLLM merges the deltas it could not deliver yet), so a
                    # later chunk number may never come
                    if i == 1 and chunks == 2:
                        return chunks, "abandoned"  # leaving `async with` closes it: lease released now
            return chunks, "finished"

        results = await asyncio.gather(*(consume(i) for i in range(args.streams)))
        if not args.quiet:
            print()
        for i, (chunks, how) in enumerate(results):
            print(f"stream {i}: {how} after {chunks} chunks")
        status = await budget.status()
        # held <= used: the budget reserves each lease's projected end; leases report what they occupy now.
        print(f"peak reserved (used) {peak['used']} blocks, peak occupied (held) {peak['held']} blocks, "
              f"limit {status.limit}")
        finished = sum(1 for _, how in results if how == "finished")
        print(f"all {args.streams} streams done ({finished} finished, {args.streams - finished} abandoned); "
              f"budget used={status.used} leases={status.leases}")
        return 0 if status.used == 0 and status.leases == 0 else 1


async def main() -> int:
    args = parse_args()
    if not args.sim:
        return await run(args, args.base_url)
    from zp_sim.server import SimServer

    async with SimServer(profile="tiny", speedup=args.speedup) as server:
        return await run(args, server.base_url)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
