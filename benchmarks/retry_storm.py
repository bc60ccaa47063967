"""Issue 31's retry storm, for real: a proxy answers 503 to every chat request for ``--duration`` s (the
issue's 60 s by default); ``--callers`` closed-loop callers (200) over ``--processes`` processes (3), each
process with its own ``wrap()``'d AsyncOpenAI on one RedisBudget (a unique name, deleted afterwards), zp's
documented defaults otherwise (RetryPolicy() on the budget's shared RedisRetryBudget: 0.5 retries per
answered request, floor 0.5/s over a 20 s window, a spent budget waits up to 30 s).

Each caller sends a fresh request (its own ``user``) as soon as the previous one ends; amplification =
upstream attempts / logical calls started, both counted over the run (calls still in flight at the end are
cancelled and counted as started). Target: <= 1.10. Loopback only; Redis at ``--redis`` (127.0.0.1:6379).

    python benchmarks/retry_storm.py                    # the issue's run, about 70 s
    python benchmarks/retry_storm.py --duration 20      # shorter (the 10-retry reserve weighs more)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def worker(proxy_url: str, redis_url: str, name: str, callers: int, start_at: float, duration: float,
           wid: int, out: Any) -> None:
    import openai

    from zp_client import RedisBudget, Settings, wrap

    settings = Settings(estimator="heuristic", max_model_len=4096, pool_check=False)

    async def main() -> None:
        # recovery_s=0: the name is fresh, there is no crashed holder to wait out
        budget = RedisBudget(redis_url, name, limit_blocks=4000, recovery_s=0)
        client = wrap(openai.AsyncOpenAI(base_url=proxy_url, api_key="x"), budget, settings=settings)
        started = 0
        ended: Counter[str] = Counter()

        async def caller(c: int) -> None:
            nonlocal started
            seq = 0
            while True:
                seq += 1
                started += 1
                try:
                    await client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                        user=f"fail-{wid}-{c}-{seq}")
                    ended["ok"] += 1
                except Exception as exc:  # noqa: BLE001 - the type is what is reported
                    ended[type(exc).__name__] += 1

        await asyncio.sleep(max(0.0, start_at - time.time()))
        tasks = [asyncio.create_task(caller(c)) for c in range(callers)]
        await asyncio.sleep(max(0.0, start_at + duration - time.time()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out.put((started, dict(ended)))
        await client.close()
        await budget.aclose() if hasattr(budget, "aclose") else None

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--callers", type=int, default=200)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = ap.parse_args()
    import redis
    from _fail_proxy import FailProxy

    name = f"storm31-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    share = [args.callers // args.processes + (1 if i < args.callers % args.processes else 0)
             for i in range(args.processes)]
    with FailProxy() as proxy:
        start_at = time.time() + 8.0  # the workers import and connect first
        procs = [ctx.Process(target=worker, args=(proxy.base_url, args.redis, name, n, start_at,
                                                  args.duration, i, out)) for i, n in enumerate(share)]
        for p in procs:
            p.start()
        time.sleep(max(0.0, start_at + args.duration - time.time()))
        attempts = len(proxy.arrivals)  # every arrival is answered 503: an upstream attempt
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=30)
    r = redis.Redis.from_url(args.redis)
    keys = list(r.scan_iter(match=f"{{zp:{name}}}*"))
    if keys:
        r.delete(*keys)
    started = sum(s for s, _ in results)
    ended: Counter[str] = Counter()
    for _, e in results:
        ended.update(e)
    amp = attempts / started if started else float("nan")
    print("| duration | callers / processes | logical calls | upstream attempts | amplification | "
          "calls ended by |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.duration:g} s | {args.callers} / {args.processes} | {started} | {attempts} | {amp:.3f} "
          f"({'<= 1.10: ok' if amp <= 1.10 else '> 1.10: FAIL'}) | {dict(ended)} |")


if __name__ == "__main__":
    main()
