"""What RedisBudget's predicted wait costs: the ``snapshot`` script call, the replay, and a fail-fast
refusal, against a real Redis (docs/admission.md#predicted-wait-and-fail-fast).

Not a test. Builds an elastic budget (``--limit`` blocks) with up to ``--leases`` live leases (each
reporting progress after ``--age`` seconds, so the pace is measured) and ``--waiters`` waiters in two
priority classes (the shapes of ``benchmarks/status_lock.py``), then times, median of ``--reps``:
``status()`` with its predicted waits (status.lua + snapshot.lua + the replay) against status.lua alone;
the snapshot call alone and the replay alone; and a fail-fast acquire that is refused (enqueue, snapshot,
replay, the waiter's removal) against a plain acquire that queues and is cancelled at once::

    python benchmarks/redis_predict.py --waiters 157
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from zp_client import RedisBudget  # noqa: E402
from zp_client.budget.predict import FAIL_FAST_KEY  # noqa: E402
from zp_client.budget.redis._snapshot import SNAPSHOT_CAP, class_heads_predicted, ledger_from_snapshot  # noqa: E402
from zp_client.errors import DeadlineExceeded  # noqa: E402

BS = 16


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms"


async def run(a: argparse.Namespace) -> None:
    name = f"zpbench-predict-{uuid.uuid4().hex[:10]}"
    b = RedisBudget(a.url, name, a.limit, BS, recovery_s=0)
    leases, tasks = [], []
    try:
        for i in range(a.leases):
            prompt, forecast = 400 + 37 * (i % 11), 100 + 53 * (i % 7)
            try:
                lease = await b.acquire((prompt + 1024) // BS + 1, held=prompt // BS, timeout=0.05,
                                        meta={"prompt_tokens": prompt, "forecast_tokens": forecast,
                                              "streaming": True})
            except TimeoutError:
                break
            leases.append((lease, prompt, forecast, i))
        await asyncio.sleep(a.age)
        for lease, prompt, forecast, i in leases:
            lease.report_progress(None, tokens=prompt + 1, first_token=True)
            lease.report_progress(None, tokens=prompt + 1 + (i * 13) % forecast)
        await b.flush()
        for j in range(a.waiters):
            prompt = 300 + 41 * (j % 13)
            tasks.append(asyncio.ensure_future(b.acquire(
                (prompt + 1024) // BS + 1, held=prompt // BS, priority=j % 2, timeout=3600,
                meta={"prompt_tokens": prompt, "forecast_tokens": 120 + 17 * (j % 5), "streaming": True})))
        r = redis.Redis.from_url(a.url)
        wait_key = f"{{zp:{name}}}:wait"
        until = time.monotonic() + 60
        # every waiter in line (or granted: a waiter that fits is admitted, and holds its lease)
        while r.hlen(wait_key) + sum(t.done() for t in tasks) < a.waiters and time.monotonic() < until:
            await asyncio.sleep(0.05)
        base = r.hlen(wait_key)
        side = b._get_side()
        st = await b.status()
        print(f"budget: {st.leases} leases, {sum(c.waiters for c in st.waiters.values())} waiters, limit "
              f"{a.limit} blocks; predicted head waits {st.predicted_wait_s}")
        plain, full, snap_s, replay_s, reply_kb = [], [], [], [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            await side.eval("status", [], init=False)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            await b.status()
            full.append(time.perf_counter() - t)
            t = time.perf_counter()
            reply = await side.eval("snapshot", [SNAPSHOT_CAP], init=False)
            snap_s.append(time.perf_counter() - t)
            if reply[0] != b"S":
                raise SystemExit(f"no snapshot ({reply!r}: over the cap of {SNAPSHOT_CAP}?)")
            reply_kb.append(sum(len(x) for x in reply[3]) + sum(len(x) for x in reply[4]))
            t = time.perf_counter()
            snap = ledger_from_snapshot(reply)
            assert snap is not None
            class_heads_predicted(snap, None)
            replay_s.append(time.perf_counter() - t)
        print(f"status.lua alone: {ms(plain)}; status() with predicted waits: {ms(full)}")
        print(f"snapshot call: {ms(snap_s)} ({statistics.median(reply_kb) / 1024:.0f} KB of records); "
              f"its ledger + replay of the class heads: {ms(replay_s)}")
        refused, queued, outcomes = [], [], []
        for _ in range(a.reps):
            t = time.perf_counter()
            try:
                got = await b.acquire(60, held=20, priority=1, timeout=a.deadline,
                                      meta={"prompt_tokens": 320, "forecast_tokens": 200, "streaming": True,
                                            FAIL_FAST_KEY: True})
                await got.release()
                outcomes.append("granted")
            except DeadlineExceeded:
                outcomes.append("refused")
            except TimeoutError:
                outcomes.append("timed out")
            refused.append(time.perf_counter() - t)
            task = asyncio.ensure_future(b.acquire(60, held=20, priority=1, timeout=3600,
                                                   meta={"prompt_tokens": 320, "forecast_tokens": 200,
                                                         "streaming": True}))
            t = time.perf_counter()
            while r.hlen(wait_key) <= base and not task.done() and time.perf_counter() - t < 10:
                await asyncio.sleep(0.001)
            queued.append(time.perf_counter() - t)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        print(f"fail-fast acquire, deadline {a.deadline} s: {ms(refused)} "
              f"({outcomes.count('refused')} of {len(outcomes)} refused); "
              f"a plain acquire until it is in line: {ms(queued)}")
        r.close()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for lease, *_ in leases:
            await lease.release()
        await b.aclose()
        rc = redis.Redis.from_url(a.url)
        keys = list(rc.scan_iter(match=f"{{zp:{name}}}*", count=1000))
        if keys:
            rc.delete(*keys)
        rc.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--leases", type=int, default=60)
    ap.add_argument("--waiters", type=int, default=157)
    ap.add_argument("--limit", type=int, default=1843)
    ap.add_argument("--age", type=float, default=1.0)
    ap.add_argument("--deadline", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=20)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
