"""RedisBudget benchmark (not a test): prints measured numbers side by side with their references.

1. acquire + release round trip, uncontended, p50/p99, as a ratio to Redis PING on the same client
   (target: <= 2x at p50; redis-py's Lock acquire + release is measured alongside for reference).
2. wake-up latency with 1,000 waiters over 4 processes: time from a holder calling release() to the next
   waiter (in another process) running, p50/p99 (target p99 < 5 ms).
3. Redis commands per second per idle waiter, from INFO commandstats deltas (target <= 1): 1,000 idle
   waiters over 4 processes, and the worst case of a single waiter in a single process.

Everything runs against a throw-away redis-server on a free loopback port (needs ``redis-server``).

    .venv/bin/python benchmarks/bench_redis.py [--iterations 3000] [--idle-seconds 10] [--round-trip-only]

``pip install 'zp-client[hiredis]'`` gives redis-py its C reply parser (faster round trips).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis() -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench_redis needs redis-server on PATH")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", tempfile.mkdtemp(prefix="zp-bench-redis-")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    r = redis.Redis(port=port)
    for _ in range(500):
        try:
            r.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    r.close()
    return proc, port


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------------------------------- round trip
async def bench_round_trip(url: str, iterations: int) -> dict[str, float]:
    import redis.asyncio as redis_async

    from zp_client.budget.redis import RedisBudget

    budget = RedisBudget(url, "bench-rt", 1000, recovery_s=0)
    side = budget._get_side()
    client = side.client  # the same client (pool) the budget uses
    lock = client.lock("bench-rt-lock", timeout=30)
    for _ in range(200):  # warm up: connections, scripts loaded
        await client.ping()
        await (await budget.acquire(1)).release()
        await lock.acquire()
        await lock.release()
    ping: list[float] = []
    rt: list[float] = []
    lk: list[float] = []
    pc = time.perf_counter
    for _ in range(iterations):  # interleaved, so load drifts hit all three alike
        t = pc()
        await client.ping()
        ping.append(pc() - t)
        t = pc()
        lease = await budget.acquire(1)
        await lease.release()
        rt.append(pc() - t)
        t = pc()
        await lock.acquire()
        await lock.release()
        lk.append(pc() - t)
    await budget.aclose()
    if isinstance(client, redis_async.Redis):
        await client.aclose()
    return {
        "ping_p50_us": _q(ping, 0.5) * 1e6, "ping_p99_us": _q(ping, 0.99) * 1e6,
        "rt_p50_us": _q(rt, 0.5) * 1e6, "rt_p99_us": _q(rt, 0.99) * 1e6,
        "lock_p50_us": _q(lk, 0.5) * 1e6,
        "ratio_p50": _q(rt, 0.5) / _q(ping, 0.5), "ratio_p99": _q(rt, 0.99) / _q(ping, 0.99),
        "lock_ratio_p50": _q(lk, 0.5) / _q(ping, 0.5),
    }


# ----------------------------------------------------------------------------------- worker processes
async def _worker(a: dict[str, Any]) -> dict[str, Any]:
    """Run ``waiters`` tasks, each taking one 1-block lease; report wake-up latencies."""
    import redis.asyncio as redis_async

    from zp_client.budget.redis import RedisBudget

    budget = RedisBudget(a["url"], a["name"], 1, recovery_s=0, poll_interval_s=a["poll"], lease_ttl_s=30)
    r = redis_async.Redis.from_url(a["url"])
    lat: list[float] = []

    async def one() -> None:
        lease = await budget.acquire(1)
        woke = time.time()
        released_at = await r.get("bench:released_at")
        if released_at is not None:
            lat.append(woke - float(released_at))
        if a["hold_s"]:
            await asyncio.sleep(a["hold_s"])
        await r.set("bench:released_at", repr(time.time()))
        await lease.release()

    await asyncio.gather(*(one() for _ in range(a["waiters"])))
    await budget.aclose()
    await r.aclose()
    return {"lat": lat}


def _spawn(args: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(args)],
                            stdout=subprocess.PIPE, text=True)


async def _until_waiters(url: str, name: str, n: int) -> None:
    from zp_client.budget.redis import RedisBudget

    b = RedisBudget(url, name, 1, recovery_s=0)
    for _ in range(6000):
        st = await b.status()
        if sum(c.waiters for c in st.waiters.values()) >= n:
            break
        await asyncio.sleep(0.01)
    else:
        raise SystemExit(f"only {st.waiters} waiters arrived")
    await b.aclose()


async def bench_wakeups(url: str, processes: int, per_process: int) -> dict[str, float]:
    from zp_client.budget.redis import RedisBudget

    holder = RedisBudget(url, "bench-wake", 1, recovery_s=0)
    lease = await holder.acquire(1)  # everyone else waits behind this
    procs = [_spawn({"url": url, "name": "bench-wake", "waiters": per_process, "poll": 2.0, "hold_s": 0})
             for _ in range(processes)]
    await _until_waiters(url, "bench-wake", processes * per_process)
    import redis.asyncio as redis_async

    r = redis_async.Redis.from_url(url)
    await r.set("bench:released_at", repr(time.time()))
    await lease.release()
    await r.aclose()
    lat: list[float] = []
    for p in procs:
        out, _ = await asyncio.to_thread(p.communicate)
        lat += json.loads(out.strip().splitlines()[-1])["lat"]
    await holder.aclose()
    return {"wakeups": len(lat), "wake_p50_ms": _q(lat, 0.5) * 1e3, "wake_p99_ms": _q(lat, 0.99) * 1e3,
            "wake_max_ms": max(lat) * 1e3}


async def bench_idle(url: str, name: str, processes: int, per_process: int, seconds: float) -> dict[str, float]:
    import redis.asyncio as redis_async

    from zp_client.budget.redis import RedisBudget

    holder = RedisBudget(url, name, 1, recovery_s=0, lease_ttl_s=max(30.0, seconds * 3))
    lease = await holder.acquire(1)
    procs = [_spawn({"url": url, "name": name, "waiters": per_process, "poll": 2.0, "hold_s": 0})
             for _ in range(processes)]
    await _until_waiters(url, name, processes * per_process)
    await asyncio.sleep(2.5)  # let every process settle into its steady state
    r = redis_async.Redis.from_url(url)

    async def calls() -> tuple[int, int]:
        """(commands sent by clients, all commands including those run inside scripts)."""
        stats = await r.info("commandstats")
        total = sum(int(v["calls"]) for v in stats.values())
        # Only these arrive over the network from RedisBudget; the rest are redis.call()s inside scripts.
        client = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval", "blpop", "info"))
        return client, total

    before, before_all = await calls()
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    after, after_all = await calls()
    elapsed = time.monotonic() - t0
    n_waiters = processes * per_process
    per_waiter = (after - before - 1) / elapsed / n_waiters  # - 1: the second INFO itself
    per_waiter_all = (after_all - before_all - 1) / elapsed / n_waiters
    await lease.release()  # let them finish
    for p in procs:
        await asyncio.to_thread(p.communicate)
    await holder.aclose()
    await r.aclose()
    return {"waiters": n_waiters, "commands": after - before - 1, "seconds": elapsed, "per_waiter_per_s": per_waiter,
            "per_waiter_per_s_all": per_waiter_all}


async def main(iterations: int, idle_seconds: float, round_trip_only: bool) -> None:
    from redis.utils import HIREDIS_AVAILABLE

    proc, port = _start_redis()
    url = f"redis://127.0.0.1:{port}/0"
    try:
        rt = await bench_round_trip(url, iterations)
        print(f"acquire+release round trip (hiredis parser: {'yes' if HIREDIS_AVAILABLE else 'no'}): "
              f"p50 {rt['rt_p50_us']:.0f} us, p99 {rt['rt_p99_us']:.0f} us | "
              f"PING p50 {rt['ping_p50_us']:.0f} us, p99 {rt['ping_p99_us']:.0f} us")
        print(f"  ratio to PING: p50 {rt['ratio_p50']:.2f}x (target <= 2x, and <= Lock's), p99 "
              f"{rt['ratio_p99']:.2f}x; redis-py Lock acquire+release p50 {rt['lock_ratio_p50']:.2f}x PING")
        if round_trip_only:
            return
        wk = await bench_wakeups(url, 4, 250)
        print(f"wake-up latency, 1,000 waiters over 4 processes ({wk['wakeups']} wake-ups): "
              f"p50 {wk['wake_p50_ms']:.2f} ms, p99 {wk['wake_p99_ms']:.2f} ms (target < 5 ms), "
              f"max {wk['wake_max_ms']:.2f} ms")
        idle = await bench_idle(url, "bench-idle", 4, 250, idle_seconds)
        print(f"idle waiters: {idle['waiters']} over 4 processes -> {idle['commands']} commands in "
              f"{idle['seconds']:.1f} s = {idle['per_waiter_per_s']:.4f} commands/s per waiter (target <= 1); "
              f"counting commands run inside scripts too: {idle['per_waiter_per_s_all']:.4f}")
        one = await bench_idle(url, "bench-idle-1", 1, 1, idle_seconds)
        print(f"worst case, 1 waiter in 1 process: {one['per_waiter_per_s']:.2f} commands/s per waiter "
              f"({one['per_waiter_per_s_all']:.2f} counting commands inside scripts)")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(asyncio.run(_worker(json.loads(sys.argv[2])))), flush=True)
        raise SystemExit(0)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--round-trip-only", action="store_true", help="only part 1 (the round trip)")
    ns = ap.parse_args()
    asyncio.run(main(ns.iterations, ns.idle_seconds, ns.round_trip_only))
