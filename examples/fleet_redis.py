"""A fleet: several processes share one KV budget through Redis.

Every process that talks to the server makes a ``RedisBudget`` with the same Redis URL and budget
name; admission is one atomic Lua script in Redis, so the sum of live leases never exceeds the limit
across all of them, and a waiter is woken by whichever process releases. This program starts
``--processes`` worker processes (copies of itself with ``--worker``), each sending a burst through a
wrapped ``openai.AsyncOpenAI``, while the parent watches the budget's status in Redis.

Run (needs a Redis server)::

    python examples/fleet_redis.py --redis redis://127.0.0.1:6379/0 --sim
    python examples/fleet_redis.py --redis redis://127.0.0.1:6379/0 --base-url http://127.0.0.1:8000/v1

Watch it from another terminal meanwhile::

    zp-client status --redis redis://127.0.0.1:6379/0 --name zp-example-fleet
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

DEFAULT_BASE_URL = os.environ.get("ZP_BASE_URL", "http://127.0.0.1:8000/v1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", required=True, help="Redis URL, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--name", default="zp-example-fleet", help="budget name (one per server/model)")
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI base URL (env ZP_BASE_URL)")
    p.add_argument("--sim", action="store_true", help="start a simulated vLLM server (in the parent)")
    p.add_argument("--speedup", type=float, default=5.0, help="with --sim: virtual seconds per real second")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--processes", type=int, default=3, help="worker processes")
    p.add_argument("--requests", type=int, default=8, help="calls per worker")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each call")
    p.add_argument("--limit-blocks", type=int, default=120, help="the fleet-wide limit in KV blocks")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # internal: worker index
    return p.parse_args()


def make_budget(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from zp_client import RedisBudget

    # The first process to create the budget sets its limit; later ones follow the stored limit.
    # recovery_s=0: a budget created from scratch normally admits nothing for one lease TTL (30 s), in
    # case lease holders survived a Redis restart and need to re-adopt. This demo uses a fresh budget,
    # so it skips that; in production keep the default.
    # strict: the limit caps the blocks reserved fleet-wide at any moment (the peak printed below)
    return RedisBudget(args.redis, args.name, limit_blocks=args.limit_blocks, recovery_s=0, policy="strict")


async def worker(args: argparse.Namespace) -> int:
    """One member of the fleet: a burst of chat calls admitted by the shared budget."""
    import openai

    from zp_client import wrap

    budget = make_budget(args)
    raw = openai.AsyncOpenAI(base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    client = wrap(raw, budget=budget)
    try:
        model = args.model or (await client.models.list()).data[0].id

        async def ask(i: int) -> None:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Worker {args.worker} job {i}: " + "fleet " * 150}],
                max_tokens=args.max_tokens,
            )

        await asyncio.gather(*(ask(i) for i in range(args.requests)))
        print(f"worker {args.worker}: {args.requests}/{args.requests} requests done", flush=True)
        return 0
    finally:
        await client.close()
        await raw.close()
        await budget.aclose()  # stops the background renew/wake-up tasks; leases were released already


def parent(args: argparse.Namespace, base_url: str) -> int:
    budget = make_budget(args)  # the parent only reads status; it never takes a lease
    cmd = [sys.executable, os.path.abspath(__file__), "--redis", args.redis, "--name", args.name,
           "--base-url", base_url, "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
           "--limit-blocks", str(args.limit_blocks)] + (["--model", args.model] if args.model else [])
    procs = [subprocess.Popen([*cmd, "--worker", str(k)], stdout=subprocess.PIPE, text=True)
             for k in range(args.processes)]
    peak_used = peak_leases = peak_waiters = 0
    limit = args.limit_blocks
    t0 = time.perf_counter()
    try:
        while any(p.poll() is None for p in procs):
            s = budget.status_sync()  # read-only snapshot from Redis
            limit = s.limit
            peak_used = max(peak_used, s.used)
            peak_leases = max(peak_leases, s.leases)
            peak_waiters = max(peak_waiters, sum(c.waiters for c in s.waiters.values()))
            time.sleep(0.01)
        outputs = [p.communicate()[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.perf_counter() - t0
    for out in outputs:
        print(out.strip())
    done = sum(1 for out in outputs if "requests done" in out)
    final = budget.status_sync()
    budget.close_sync()
    print(f"fleet: {done}/{args.processes} workers finished {done * args.requests} requests "
          f"in {elapsed:.2f} s")
    print(f"peak reserved {peak_used} of {limit} blocks across the fleet, peak leases {peak_leases}, "
          f"peak waiters {peak_waiters}")
    print(f"budget {args.name!r} after the run: used={final.used} leases={final.leases}")
    ok = done == args.processes and all(p.returncode == 0 for p in procs) and final.used == 0
    return 0 if ok and peak_used <= limit else 1


def main() -> int:
    args = parse_args()
    if args.worker is not None:
        return asyncio.run(worker(args))
    if not args.sim:
        return parent(args, args.base_url)
    from zp_sim.server import SimServer

    # One simulator on a background thread of the parent; the workers reach it over loopback HTTP.
    with SimServer(profile="tiny", speedup=args.speedup) as server:
        return parent(args, server.base_url)


if __name__ == "__main__":
    raise SystemExit(main())
