"""RedisBudget across real processes: many holders, a SIGKILLed holder, a Redis restart under load.

Holdings are counted *outside* the budget: inside each lease body a worker adds its weight to a
separate counter key (INCRBY returns the new sum, so every peak is observed) and subtracts it before
releasing; the test process also samples the counter throughout. Neither may ever exceed the limit.

This file is also the worker program: ``python tests/budget/test_redis_multiprocess.py <mode> <json-args>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests._redis_keys import delete_keys_containing

pytestmark = [pytest.mark.redis]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository (this file is in tests/<area>/)


# ------------------------------------------------------------------------------------------ the worker
async def _worker_load(a: dict[str, Any]) -> dict[str, Any]:
    import redis.asyncio as redis_async

    from zp_client.budget.redis import RedisBudget

    budget = RedisBudget(a["url"], a["name"], a["limit"], lease_ttl_s=a["ttl"], poll_interval_s=a["poll"],
                         recovery_s=a["recovery"], unavailable_timeout_s=30)
    counter = redis_async.Redis.from_url(a["count_url"])
    rng = random.Random(a["seed"])
    peak = 0
    done = 0

    async def one(i: int) -> None:
        nonlocal peak, done
        for _ in range(a["rounds"]):
            w = rng.randint(1, a["max_weight"])
            async with budget.lease(w, priority=i % 2):
                v = await counter.incrby(a["count_key"], w)
                peak = max(peak, v)
                await asyncio.sleep(rng.uniform(0, a["body_s"]))
                await counter.decrby(a["count_key"], w)
            done += 1
            await counter.incr(a["count_key"] + ":done")

    await asyncio.gather(*(one(i) for i in range(a["tasks"])))
    await budget.aclose()
    await counter.aclose()
    return {"peak": peak, "done": done, "readopted": budget.counters["readopted"],
            "lost": budget.counters["lease_lost"]}


async def _worker_hold(a: dict[str, Any]) -> None:
    import redis.asyncio as redis_async

    from zp_client.budget.redis import RedisBudget

    budget = RedisBudget(a["url"], a["name"], a["limit"], lease_ttl_s=a["ttl"], poll_interval_s=a["poll"], recovery_s=0)
    counter = redis_async.Redis.from_url(a["count_url"])
    await budget.acquire(a["limit"])
    await counter.incrby(a["count_key"], a["limit"])
    print("HELD", flush=True)
    await asyncio.sleep(3600)  # until SIGKILL


def _spawn(mode: str, args: dict[str, Any]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


class _Sampler:
    """Samples the external holdings counter in a thread until stopped; keeps the maximum."""

    def __init__(self, url: str, key: str) -> None:
        import redis

        self._r = redis.Redis.from_url(url)
        self._key = key
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            v = int(self._r.get(self._key) or 0)
            self.peak = max(self.peak, v)
            self.samples += 1
            time.sleep(0.001)

    def done_count(self) -> int:
        return int(self._r.get(self._key + ":done") or 0)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(5)
        self._r.close()


@pytest.fixture
def cleanup(redis_url: str, redis_prefix: str) -> Iterator[None]:
    yield
    delete_keys_containing(redis_url, redis_prefix)


def _args(redis_url: str, name: str, **kw: Any) -> dict[str, Any]:
    base = {"url": redis_url, "name": name, "limit": 48, "ttl": 2.0, "poll": 0.3, "recovery": 0,
            "count_url": redis_url, "count_key": f"{{zp:{name}}}:test-held", "tasks": 100, "rounds": 1,
            "max_weight": 12, "body_s": 0.004, "seed": 0}
    base.update(kw)
    return base


# ------------------------------------------------------------------------------------------- the tests
@pytest.mark.slow
def test_eight_processes_never_exceed_the_limit(redis_url: str, redis_prefix: str, cleanup: None) -> None:
    args = _args(redis_url, redis_prefix)
    sampler = _Sampler(redis_url, args["count_key"])
    try:
        procs = [_spawn("load", dict(args, seed=i)) for i in range(8)]
        results = [_result(p) for p in procs]
    finally:
        sampler.stop()
    assert [r["done"] for r in results] == [100] * 8
    assert max(r["peak"] for r in results) <= args["limit"], results
    assert sampler.peak <= args["limit"] and sampler.samples > 0
    assert max(r["peak"] for r in results) > args["limit"] // 2  # the budget was really contended

    from zp_client.budget.redis import RedisBudget

    st = RedisBudget(redis_url, redis_prefix, args["limit"]).status_sync()
    assert (st.used, st.leases, st.waiters) == (0, 0, {})


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_sigkilled_holders_blocks_return_and_waiters_proceed(redis_url: str, redis_prefix: str, cleanup: None) -> None:
    from zp_client.budget.redis import RedisBudget

    args = _args(redis_url, redis_prefix, limit=10, ttl=1.5, poll=0.3)
    holder = _spawn("hold", args)
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        assert line.strip() == "HELD", holder.stderr.read() if holder.stderr else line
        budget = RedisBudget(redis_url, redis_prefix, 10, lease_ttl_s=1.5, poll_interval_s=0.3, recovery_s=0)

        async def scenario() -> tuple[float, float]:
            waiter = asyncio.create_task(budget.acquire(10))
            for _ in range(500):
                st = await budget.status()
                if st.waiters:
                    break
                await asyncio.sleep(0.01)
            assert st.leases == 1 and st.waiters[0].waiters == 1 and not waiter.done()
            os.kill(holder.pid, signal.SIGKILL)
            killed = time.monotonic()
            lease = await asyncio.wait_for(waiter, 60)  # liveness bound only
            took = time.monotonic() - killed
            await lease.release()
            await budget.aclose()
            return took, killed

        took, _ = asyncio.run(scenario())
        # Reported, not asserted (no timed assertions): expected about lease_ttl + one poll interval.
        print(f"blocks returned {took:.2f} s after SIGKILL (lease_ttl 1.5 s, poll 0.3 s)")
    finally:
        holder.kill()
        holder.wait(10)


@pytest.mark.slow
def test_redis_restart_under_load_never_over_admits(redis_url: str, redis_prefix: str, cleanup: None) -> None:
    from tests.conftest import start_redis_server

    proc, port = start_redis_server()
    budget_url = f"redis://127.0.0.1:{port}/0"
    # The counter lives on the session Redis, which is not restarted.
    args = _args(budget_url, redis_prefix, count_url=redis_url, limit=24, ttl=1.5, poll=0.3, recovery=1.5,
                 tasks=30, rounds=6, max_weight=8, body_s=0.05)
    args["count_key"] = f"{redis_prefix}:test-held"
    sampler = _Sampler(redis_url, args["count_key"])
    procs: list[subprocess.Popen[str]] = []
    try:
        procs = [_spawn("load", dict(args, seed=i)) for i in range(3)]
        deadline = time.monotonic() + 60
        while sampler.done_count() < 40:  # under load
            assert time.monotonic() < deadline, "workers made no progress before the restart"
            assert all(p.poll() is None for p in procs), "a worker exited early"
            time.sleep(0.01)
        proc.kill()
        proc.wait(10)
        proc, _ = start_redis_server(port=port)  # same port, empty state
        procs.append(_spawn("load", dict(args, seed=99)))  # a process started after the restart
        results = [_result(p, timeout=180) for p in procs]
    finally:
        sampler.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
        proc.kill()
        proc.wait(10)
    assert [r["done"] for r in results] == [args["tasks"] * args["rounds"]] * 4  # work resumed and finished
    assert max(r["peak"] for r in results) <= args["limit"], results
    assert sampler.peak <= args["limit"]
    print(f"re-adopted leases after the restart: {sum(r['readopted'] for r in results)}; "
          f"lost: {sum(r['lost'] for r in results)}; counter samples: {sampler.samples}")


if __name__ == "__main__":
    mode, raw = sys.argv[1], json.loads(sys.argv[2])
    if mode == "load":
        print(json.dumps(asyncio.run(_worker_load(raw))), flush=True)
    elif mode == "hold":
        asyncio.run(_worker_hold(raw))
    else:
        raise SystemExit(f"unknown mode {mode}")
