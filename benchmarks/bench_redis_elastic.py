"""RedisBudget under ``elastic`` (not a test): what the projected-peak rule in Lua costs.

For n background leases already live (each with elastic metadata, a shared prefix for half of them),
measures the acquire + release round trip of one more lease, p50/p99, interleaved with Redis PING on
the same client, for ``strict`` and ``elastic`` side by side. An uncontended acquire takes the fast path
under both (elastic: when the bounds of the live leases plus one block each, plus the newcomer's bound
and one, fit the limit; the limits here leave that room). A contended elastic acquire runs a grant pass
over the live leases (O(n log n) in Lua): the ``flush`` line (a progress report with a waiter in line)
shows that cost.

Also measures one held/progress report (``flush``) with a waiter in line (it runs a grant pass).

``--urgent`` adds a line per lease count: two priority classes (the live leases alternate 0 and 1, the
measured acquires are of class 1), elastic with ``urgent_reserve`` 0 and 2.0 side by side, so the
urgent reserve's Lua work (a ZADD per lease written, one ZREVRANGEBYSCORE per more urgent class per
candidate) shows beside the same work without it.

Runs against a throw-away redis-server on a free loopback port (needs ``redis-server``).

    .venv/bin/python benchmarks/bench_redis_elastic.py [--iterations 500] [--leases 0,100,1000] [--urgent]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_redis import _q, _start_redis  # noqa: E402


async def bench(url: str, policy: str, n: int, iterations: int,
                urgent: float | None = None) -> dict[str, float]:
    """``urgent`` None: one class (priority 0) and the policy's defaults; else two classes and that
    ``urgent_reserve``."""
    from zp_client.budget.redis import RedisBudget

    name = f"bench-el-{policy}-{n}-{urgent}"
    kw = {} if urgent is None else {"urgent_reserve": urgent}
    budget = RedisBudget(url, name, 64 * n + 10_000, 16, recovery_s=0, policy=policy, **kw)
    prio = 0 if urgent is None else 1
    side = budget._get_side()
    client = side.client
    live = []
    for i in range(n):
        meta = {"prompt_tokens": 400 + i % 50, "forecast_tokens": 200, "streaming": True}
        if i % 2:
            meta.update(prefix_key=f"sys{i % 7}", prefix_blocks=20, first_token=True)
        live.append(await budget.acquire(64, held=26, meta=meta, priority=0 if urgent is None else i % 2))
    meta = {"prompt_tokens": 300, "forecast_tokens": 100}
    for _ in range(50):
        await (await budget.acquire(32, held=19, meta=meta, priority=prio)).release()
    ping: list[float] = []
    rt: list[float] = []
    pc = time.perf_counter
    for _ in range(iterations):
        t = pc()
        await client.ping()
        ping.append(pc() - t)
        t = pc()
        lease = await budget.acquire(32, held=19, meta=meta, priority=prio)
        await lease.release()
        rt.append(pc() - t)
    for le in live:
        await le.release()
    await budget.aclose()
    return {"ping_p50_us": _q(ping, 0.5) * 1e6, "rt_p50_us": _q(rt, 0.5) * 1e6,
            "rt_p99_us": _q(rt, 0.99) * 1e6,
            "ratio_p50": _q(rt, 0.5) / _q(ping, 0.5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=500)
    ap.add_argument("--leases", default="0,100,1000")
    ap.add_argument("--urgent", action="store_true", help="also two classes, urgent_reserve 0 vs 2.0")
    args = ap.parse_args()
    proc, port = _start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    try:
        for n in [int(x) for x in args.leases.split(",")]:
            row = []
            for policy in ("strict", "elastic"):
                r = asyncio.run(bench(url, policy, n, args.iterations))
                row.append(f"{policy}: p50 {r['rt_p50_us']:.0f} us ({r['ratio_p50']:.2f}x PING), "
                           f"p99 {r['rt_p99_us']:.0f} us")
            print(f"{n:5d} live leases | " + " | ".join(row), flush=True)
            if args.urgent:
                row = []
                for urgent in (0.0, 2.0):
                    r = asyncio.run(bench(url, "elastic", n, args.iterations, urgent))
                    row.append(f"urgent_reserve {urgent}: p50 {r['rt_p50_us']:.0f} us "
                               f"({r['ratio_p50']:.2f}x PING), "
                               f"p99 {r['rt_p99_us']:.0f} us")
                print(f"{n:5d} live leases, two classes | " + " | ".join(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
