"""Threads: one wrapped ``openai.OpenAI`` client shared by a thread pool.

``wrap(openai.OpenAI(...), budget=...)`` gives a blocking client whose calls take their lease with the
budget's blocking API (``acquire_sync`` / ``lease_sync``): a thread that does not fit parks on a
``threading.Event`` (no event loop, no busy polling) and is woken by the release that makes room for
it, in fair first-come order. The same ``LocalBudget`` can also be used directly with
``with budget.lease_sync(blocks):`` for work that is not an HTTP call; both share one line.

Run::

    python examples/threads_sync.py --sim
    python examples/threads_sync.py --base-url http://127.0.0.1:8000/v1 --threads 16
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai

from zp_client import LocalBudget, wrap

DEFAULT_BASE_URL = os.environ.get("ZP_BASE_URL", "http://127.0.0.1:8000/v1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI base URL (env ZP_BASE_URL)")
    p.add_argument("--sim", action="store_true", help="start a simulated vLLM server on a background thread")
    p.add_argument("--speedup", type=float, default=5.0, help="with --sim: virtual seconds per real second")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--threads", type=int, default=8, help="worker threads")
    p.add_argument("--requests", type=int, default=24, help="calls in total")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each call")
    p.add_argument("--limit-blocks", type=int, default=60,
                   help="the budget's limit in KV blocks (small, so threads have to take turns)")
    return p.parse_args()


@contextlib.contextmanager
def sampling(budget: LocalBudget, peaks: dict[str, int]) -> Iterator[None]:
    """Sample the budget from a monitor thread while the block runs (status_sync never blocks long)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.005):
            s = budget.status_sync()
            peaks["used"] = max(peaks["used"], s.used)
            peaks["waiters"] = max(peaks["waiters"], sum(c.waiters for c in s.waiters.values()))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def run(args: argparse.Namespace, base_url: str) -> int:
    # strict: the limit caps the blocks reserved at any moment (the peak printed below); the default elastic
    # policy caps the projected peak at admission instead, which growth may later pass
    budget = LocalBudget(limit_blocks=args.limit_blocks, policy="strict")
    raw = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    client = wrap(raw, budget=budget)  # one client, safe to share between threads (like openai.OpenAI)
    try:
        model = args.model or client.models.list().data[0].id

        def ask(i: int) -> str:
            reply = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Thread job {i}: " + "explain paging " * 50}],
                max_tokens=args.max_tokens,
            )
            return reply.choices[0].finish_reason or "?"

        def batch_job(i: int) -> str:
            # Work that is not an HTTP call can hold blocks too, in the same line as the HTTP calls:
            # lease_sync waits (blocking this thread only) and releases on every exit path.
            with budget.lease_sync(10, timeout=60) as lease:
                time.sleep(0.01)
                return f"batch job held {lease.bound} blocks"

        peaks = {"used": 0, "waiters": 0}
        t0 = time.perf_counter()
        with sampling(budget, peaks), ThreadPoolExecutor(max_workers=args.threads) as pool:
            calls = list(pool.map(ask, range(args.requests)))
            jobs = list(pool.map(batch_job, range(args.threads)))
        elapsed = time.perf_counter() - t0

        status = budget.status_sync()
        print(f"completed {len(calls)}/{args.requests} calls and {len(jobs)} batch jobs on {args.threads} "
              f"threads in {elapsed:.2f} s (finish reasons: {sorted(set(calls))})")
        print(f"peak reserved {peaks['used']} of {status.limit} blocks, "
              f"peak waiting threads {peaks['waiters']}")
        print(f"budget after the run: used={status.used} leases={status.leases} "
              f"granted={status.extra.get('granted')}")
        return 0 if len(calls) == args.requests and status.used == 0 else 1
    finally:
        client.close()
        raw.close()


def main() -> int:
    args = parse_args()
    if not args.sim:
        return run(args, args.base_url)
    from zp_sim.server import SimServer

    # `with SimServer(...)` runs the simulator on its own thread, so plain blocking code can use it.
    with SimServer(profile="tiny", speedup=args.speedup) as server:
        return run(args, server.base_url)


if __name__ == "__main__":
    raise SystemExit(main())
