"""RedisFleet benchmark (not a test): what the fleet's one Cluster slot costs.

Every call of a fleet lands on the one Redis node that owns its hash tag, so a fleet's admission
throughput is one shard's, whatever the cluster's size. This measures, on a throw-away redis-server on
loopback, side by side with a plain strict RedisBudget:

1. acquire + release, uncontended, p50/p99 (a fleet request carries its prefix keys and a session);
2. throughput with ``--tasks`` concurrent loops of acquire + release (room for all: no waiting), and the
   Redis server's CPU time per admission (``INFO cpu`` deltas): the shard's ceiling is about
   1 / (CPU per admission).

    .venv/bin/python benchmarks/bench_redis_fleet.py [--replicas 8] [--seconds 3] [--tasks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_redis import _start_redis  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _cpu(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def _run(budget: Any, meta_of: Any, iterations: int, seconds: float, tasks: int,
               r: Any) -> dict[str, float]:
    warm = await budget.acquire(1, meta=meta_of(0))
    await warm.release()
    lat: list[float] = []
    for i in range(iterations):
        t0 = time.perf_counter()
        le = await budget.acquire(2, meta=meta_of(i))
        await le.release()
        lat.append(time.perf_counter() - t0)
    done = 0
    stop = time.perf_counter() + seconds
    cpu0 = _cpu(r)

    async def loop(k: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            le = await budget.acquire(2, meta=meta_of(k * 100_000 + i))
            await le.release()
            done += 1
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(k) for k in range(tasks)))
    wall = time.perf_counter() - t0
    cpu = _cpu(r) - cpu0
    await budget.aclose()
    return {"p50_ms": _pct(lat, 0.5) * 1000, "p99_ms": _pct(lat, 0.99) * 1000, "ops_s": done / wall,
            "redis_cpu_us_per_op": cpu / max(1, done) * 1e6}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=1000)
    a = ap.parse_args()
    import redis

    from zp_client.budget.redis import RedisBudget
    from zp_client.fleet.redis import RedisFleet

    proc, port = _start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis(port=port)
    try:
        plain = RedisBudget(url, "bench-plain", 1_000_000, policy="strict", recovery_s=0)
        res_plain = await _run(plain, lambda i: None, a.iterations, a.seconds, a.tasks, r)
        urls = [f"http://10.0.0.{i}:8000/v1" for i in range(1, a.replicas + 1)]
        fleet = RedisFleet(url, "bench-fleet", urls, 1_000_000, recovery_s=0)
        system = "You are a helpful agent. " * 40

        def meta_of(i: int) -> dict[str, Any]:
            conv = i % 200  # 200 conversations of up to 8 turns
            msgs = [{"role": "system", "content": system}] + [
                {"role": "user", "content": f"conversation {conv} turn {t}"} for t in range(1 + i % 8)]
            return fleet.routing_meta({"model": "m", "messages": msgs}, 2000, f"s{conv}")

        res_fleet = await _run(fleet, meta_of, a.iterations, a.seconds, a.tasks, r)
        print(f"{'':28}{'p50 ms':>9}{'p99 ms':>9}{'ops/s':>10}{'Redis CPU us/op':>17}")
        rows = (("RedisBudget strict", res_plain), (f"RedisFleet {a.replicas} replicas", res_fleet))
        for name, res in rows:
            print(f"{name:28}{res['p50_ms']:9.3f}{res['p99_ms']:9.3f}{res['ops_s']:10.0f}"
                  f"{res['redis_cpu_us_per_op']:17.1f}")
        ceiling = 1e6 / max(1e-9, res_fleet["redis_cpu_us_per_op"])
        print(f"one shard's ceiling for this fleet: ~{ceiling:,.0f} "
              "admissions/s (1 / Redis CPU per acquire + release)")
    finally:
        r.close()
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
