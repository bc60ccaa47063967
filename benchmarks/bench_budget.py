"""Micro-benchmark: LocalBudget acquire+release cost per lease (not a test; prints numbers).

    .venv/bin/python benchmarks/bench_budget.py [--quick]

Scenarios:
  uncontended async    one task: ``lease = await acquire(4); await lease.release()``  (target < 50 us)
  uncontended lease()  the same through ``async with budget.lease(4)``
  uncontended sync     one thread: ``acquire_sync`` / ``release_sync``
  1000 waiters churn   1,000 tasks cycle leases on a budget of 64 blocks, so ~1,000 are parked at any time;
                       cost = wall time / leases granted (every release grants and wakes the next)
  backfill past 1000   1,000 large waiters parked (none fits); one task acquires+releases small leases that
                       backfill past all of them (starvation bound off, so every grant scans the line)
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from zp_client.budget.local import LocalBudget


def _best(samples: list[float]) -> tuple[float, float]:
    return min(samples), statistics.median(samples)


async def uncontended_async(n: int) -> float:
    budget = LocalBudget(1000)
    t0 = time.perf_counter()
    for _ in range(n):
        lease = await budget.acquire(4)
        await lease.release()
    return (time.perf_counter() - t0) / n


async def uncontended_ctx(n: int) -> float:
    budget = LocalBudget(1000)
    t0 = time.perf_counter()
    for _ in range(n):
        async with budget.lease(4):
            pass
    return (time.perf_counter() - t0) / n


def uncontended_sync(n: int) -> float:
    budget = LocalBudget(1000)
    t0 = time.perf_counter()
    for _ in range(n):
        lease = budget.acquire_sync(4)
        lease.release_sync()
    return (time.perf_counter() - t0) / n


async def churn_1000(cycles: int) -> tuple[float, int]:
    budget = LocalBudget(64)

    async def worker(i: int) -> None:
        for _ in range(cycles):
            lease = await budget.acquire(1 + i % 8)
            await anyio.sleep(0)  # hold across one scheduling round
            await lease.release()

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(1000):
            tg.start_soon(worker, i)
    dt = time.perf_counter() - t0
    granted = int(budget.status_sync().extra["granted"])  # type: ignore[call-overload]
    return dt / granted, granted


async def backfill_past_1000(n: int) -> float:
    budget = LocalBudget(1000, starvation_bound_s=float("inf"))
    holder = await budget.acquire(900)
    async with anyio.create_task_group() as tg:
        for _ in range(1000):
            tg.start_soon(budget.acquire, 200)
        while sum(c.waiters for c in budget.status_sync().waiters.values()) < 1000:
            await anyio.sleep(0.001)
        t0 = time.perf_counter()
        for _ in range(n):
            lease = await budget.acquire(50)
            await lease.release()
        dt = (time.perf_counter() - t0) / n
        tg.cancel_scope.cancel()
    await holder.release()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    args = ap.parse_args()
    n = 5_000 if args.quick else 50_000
    reps = 3 if args.quick else 5

    us = 1e6
    rows: list[tuple[str, str]] = []
    a = [anyio.run(uncontended_async, n) for _ in range(reps)]
    rows.append(("uncontended async acquire+release", "best %.1f us, median %.1f us" % tuple(x * us for x in _best(a))))
    c = [anyio.run(uncontended_ctx, n) for _ in range(reps)]
    rows.append(("uncontended async with lease()", "best %.1f us, median %.1f us" % tuple(x * us for x in _best(c))))
    s = [uncontended_sync(n) for _ in range(reps)]
    rows.append(("uncontended sync acquire+release", "best %.1f us, median %.1f us" % tuple(x * us for x in _best(s))))
    ch = [anyio.run(churn_1000, 5 if args.quick else 20) for _ in range(reps)]
    per = [x for x, _ in ch]
    rows.append((f"1000 waiters churn ({ch[0][1]} leases)", "best %.1f us, median %.1f us per lease" % tuple(x * us for x in _best(per))))
    bf = [anyio.run(backfill_past_1000, 500 if args.quick else 2000) for _ in range(reps)]
    rows.append(("backfill past 1000 parked waiters", "best %.1f us, median %.1f us per lease" % tuple(x * us for x in _best(bf))))

    target = 50.0
    width = max(len(k) for k, _ in rows)
    print("LocalBudget acquire+release cost per lease")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    verdict = "meets" if min(a) * us < target else "MISSES"
    print(f"uncontended async: {min(a) * us:.1f} us vs target {target:.0f} us -> {verdict} the target "
          f"(ratio {min(a) * us / target:.2f})")


if __name__ == "__main__":
    main()
