"""Renewal-burst benchmark (not a test; issue 33 item 4): a burst of ``--n`` (2,000) one-block acquires in
one process on a RedisBudget with ``--ttl`` (3 s) leases, each held ``--hold`` (7 s, over two TTLs):
prints the live leases lost (target 0: renewals run on their own connection, never behind the burst's
acquires in the shared pool of 100), the ``lease_lost`` events and the wall time.

Runs against ``--url`` (default redis://127.0.0.1:6379/0) on a fresh budget name, deleted afterwards.

    .venv/bin/python benchmarks/bench_redis_renewal_burst.py [--n 2000] [--ttl 3] [--hold 7]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import redis  # noqa: E402

from zp_client import RedisBudget  # noqa: E402


async def run(url: str, n: int, ttl: float, hold: float) -> tuple[int, int, float]:
    name = f"zpbench-burst-{secrets.token_hex(4)}"
    b = RedisBudget(url, name, 1_000_000, recovery_s=0, lease_ttl_s=ttl)
    try:
        await b.status()
        t0 = time.monotonic()

        async def one() -> bool:
            lease = await b.acquire(1)
            await asyncio.sleep(hold)
            lost = lease.lost
            await lease.release()
            return lost

        lost = sum(await asyncio.gather(*[one() for _ in range(n)]))
        return lost, b.counters["lease_lost"], time.monotonic() - t0
    finally:
        await b.aclose()
        r = redis.Redis.from_url(url)
        keys = list(r.scan_iter(match=f"{{zp:{name}}}*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0", help="Redis URL")
    ap.add_argument("--n", type=int, default=2000, help="acquires in the burst (default 2000)")
    ap.add_argument("--ttl", type=float, default=3.0, help="lease_ttl_s (default 3)")
    ap.add_argument("--hold", type=float, default=7.0, help="seconds each lease is held (default 7)")
    args = ap.parse_args()
    logging.getLogger("zp_client").setLevel(logging.CRITICAL)
    lost, events, wall = asyncio.run(run(args.url, args.n, args.ttl, args.hold))
    print(f"burst of {args.n} acquires, lease_ttl_s={args.ttl:g}, held {args.hold:g} s: "
          f"{lost} live leases lost, {events} lease_lost events, wall {wall:.1f} s")


if __name__ == "__main__":
    main()
