"""Herd benchmark (not a test): many concurrent acquires in one process, LocalBudget vs RedisBudget.

The async herd: ``--tasks`` (1,000) concurrent one-block acquires, room for ``--limit`` (50) at a time,
each lease held ``--hold-ms`` (10 ms), under each ``--policy`` (strict and elastic). The sync herd:
``--threads`` (300) threads on ``acquire_sync``.
Each herd runs on a LocalBudget and on a RedisBudget in the same run; the script prints both wall times,
their ratio (target: RedisBudget within 10x LocalBudget), errors, and the "unreachable" log records
(target 0: pool exhaustion is back-pressure, not an outage).

Runs against a throw-away redis-server on a free loopback port (needs ``redis-server``) or ``--url``.

    .venv/bin/python benchmarks/bench_redis_herd.py [--tasks 1000] [--threads 300] [--limit 50]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_redis import _start_redis  # noqa: E402  (after the sys.path set-up above)


class _Records(logging.Handler):
    """Counts the budget's "unreachable" records (the outage log the herd must not trigger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.unreachable = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "unreachable" in record.getMessage():
            self.unreachable += 1


async def async_herd(budget: Any, tasks: int, hold_s: float) -> tuple[float, int, int]:
    """(seconds, leases admitted and released, errors) for ``tasks`` concurrent one-block leases."""
    done = 0

    async def one() -> None:
        nonlocal done
        async with budget.lease(1):
            await asyncio.sleep(hold_s)
        done += 1

    t = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(tasks)), return_exceptions=True)
    return time.perf_counter() - t, done, sum(isinstance(r, BaseException) for r in results)


def sync_herd(budget: Any, threads: int, hold_s: float) -> tuple[float, int, int]:
    """(seconds, leases admitted and released, errors) for ``threads`` threads on ``lease_sync``."""
    done: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def one() -> None:
        start.wait()
        try:
            with budget.lease_sync(1):
                time.sleep(hold_s)
            done.append(1)
        except Exception as exc:  # noqa: BLE001  (counted and printed: the herd must have none)
            errors.append(exc)

    ts = [threading.Thread(target=one) for _ in range(threads)]
    for th in ts:
        th.start()
    start.wait()
    t = time.perf_counter()
    for th in ts:
        th.join()
    if errors:
        print(f"  first sync error: {errors[0]!r}")
    return time.perf_counter() - t, len(done), len(errors)


async def main(
    url: str | None, tasks: int, threads: int, limit: int, hold_ms: float, policies: list[str]
) -> None:
    from zp_client.budget.local import LocalBudget
    from zp_client.budget.redis import RedisBudget

    proc = None
    if url is None:
        proc, port = _start_redis()
        url = f"redis://127.0.0.1:{port}/0"
    rec = _Records()
    logging.getLogger("zp_client").addHandler(rec)
    hold = hold_ms / 1000
    names: list[str] = []
    try:
        for policy in policies:
            rec.unreachable = 0
            lt, ln, le = await async_herd(LocalBudget(limit, policy=policy), tasks, hold)
            name = f"bench-herd-{secrets.token_hex(4)}"
            names.append(name)
            rb = RedisBudget(url, name, limit, policy=policy, recovery_s=0)
            await (await rb.acquire(1)).release()  # creates the budget (not the herd's cost)
            rt, rn, re_ = await async_herd(rb, tasks, hold)
            await rb.aclose()
            print(f"async herd ({policy}), {tasks} one-block leases, limit {limit}, held {hold_ms:g} ms:")
            print(f"  LocalBudget {lt:.3f} s ({ln} leases, {le} errors) | RedisBudget {rt:.3f} s "
                  f"({rn} leases, {re_} errors) | ratio {rt / lt:.2f}x (target <= 10x) | "
                  f"unreachable records {rec.unreachable}")

            rec.unreachable = 0
            lb = LocalBudget(limit, policy=policy)
            slt, sln, sle = await asyncio.to_thread(sync_herd, lb, threads, hold)
            names.append(name + "-sync")
            rbs = RedisBudget(url, name + "-sync", limit, policy=policy, recovery_s=0)
            rbs.acquire_sync(1).release_sync()
            srt, srn, sre = await asyncio.to_thread(sync_herd, rbs, threads, hold)
            rbs.close_sync()
            print(f"sync herd ({policy}), {threads} threads on acquire_sync, limit {limit}, "
                  f"held {hold_ms:g} ms:")
            print(f"  LocalBudget {slt:.3f} s ({sln} leases, {sle} errors) | RedisBudget {srt:.3f} s "
                  f"({srn} leases, {sre} errors) | ratio {srt / slt:.2f}x | "
                  f"unreachable records {rec.unreachable}")
        import redis

        r = redis.Redis.from_url(url)
        for n in names:
            keys = list(r.scan_iter(match=f"{{zp:{n}}}*"))
            if keys:
                r.delete(*keys)
        r.close()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an existing Redis (default: start a throw-away one)")
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=300)
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--hold-ms", type=float, default=10.0)
    ap.add_argument("--policy", choices=["strict", "elastic", "both"], default="both")
    ns = ap.parse_args()
    pols = ["strict", "elastic"] if ns.policy == "both" else [ns.policy]
    asyncio.run(main(ns.url, ns.tasks, ns.threads, ns.limit, ns.hold_ms, pols))
