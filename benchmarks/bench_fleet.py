"""Micro-benchmark: the fleet's routing decision against one LocalBudget acquire+release (prints ratios).

    .venv/bin/python benchmarks/bench_fleet.py [--replicas 64] [--entries 100000] [--n 2000]

The issue's case: 64 replicas, a prefix index holding 100,000 entries, a chat request with a 4k-token
prompt in 20 messages whose prefixes are in no replica's index (cold lookups: every key is looked up and
misses). Measured side by side in one run, best of 5 rounds of ``--n`` each:

  local acquire+release   ``LocalBudget.acquire_sync(blocks, meta=...) + release_sync()`` (elastic, the
                          default policy), the denominator
  fleet acquire+release   ``Fleet.acquire_sync + release_sync`` with the request's routing meta: the
                          line, the prefix match over 64 replicas, every replica's fits, the placement
                          and its index insert (the index is kept at its bound: each insert evicts)
  routing meta            ``Fleet.routing_meta``: hashing the 20 messages into prefix keys (the core
                          does it once per request, before the first attempt)
  routing decision        routing meta + fleet acquire+release: what a request pays for routing

Target (issue 19): routing decision <= 3x local acquire+release.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from zp_client.budget.local import LocalBudget
from zp_client.fleet import Fleet


def _request(seed: int, prompt_tokens: int = 4096, messages: int = 20) -> dict[str, Any]:
    rng = random.Random(seed)
    chars = prompt_tokens * 4 // messages
    words = ["plan", "tool", "call", "result", "agent", "step", "search", "file", "read", "write"]

    def text() -> str:
        out: list[str] = []
        n = 0
        while n < chars:
            w = rng.choice(words)
            out.append(w)
            n += len(w) + 1
        return " ".join(out)

    msgs = [{"role": "system", "content": text()}]
    msgs += [{"role": "user" if i % 2 else "assistant", "content": text()} for i in range(1, messages)]
    return {"model": "sim-llama", "messages": msgs, "max_tokens": 256}


def _fill(fleet: Fleet, entries: int, seed: int) -> None:
    """Put ``entries`` keys into the fleet's index, spread over its replicas (as past traffic would)."""
    led = fleet.ledger
    rng = random.Random(seed)
    urls = list(led.replicas)
    per = max(1, entries // 10)
    for i in range(per):
        keys = tuple((rng.getrandbits(64), 8 * (j + 1)) for j in range(10))
        led.index.insert(urls[i % len(urls)], keys)


def _time(fn: Any, n: int, rounds: int = 5) -> float:
    best = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t0) / n)
    return min(best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()

    prompt_tokens = 4096
    body = _request(1)
    bound = (prompt_tokens + 256) // 16 + 1
    held = prompt_tokens // 16
    elastic_meta = {"prompt_tokens": prompt_tokens, "forecast_tokens": 200, "streaming": True}

    local = LocalBudget(20_000, policy="elastic")

    def local_cycle() -> None:
        local.acquire_sync(bound, held=held, meta=elastic_meta).release_sync()

    urls = [f"http://10.0.{i // 250}.{i % 250}:8000/v1" for i in range(args.replicas)]
    fleet = Fleet(urls, limit_blocks=20_000, policy="elastic", max_prefix_entries=args.entries)
    _fill(fleet, args.entries, 7)
    filled = len(fleet.ledger.index)
    routing = fleet.routing_meta(body, prompt_tokens, None)
    assert len(routing["zp_prefix"]) == 20
    assert not fleet.ledger.index.match(routing["zp_prefix"]), "the lookups must be cold"
    meta = {**elastic_meta, **routing}
    rng = random.Random(3)

    def fleet_cycle() -> None:
        # a fresh request each time (new keys): the lookups stay cold and every insert evicts
        m = dict(meta)
        m["zp_prefix"] = tuple((rng.getrandbits(64), b) for _, b in routing["zp_prefix"])
        fleet.acquire_sync(bound, held=held, meta=m).release_sync()

    def meta_only() -> None:
        fleet.routing_meta(body, prompt_tokens, None)

    t_local = _time(local_cycle, args.n)
    t_fleet = _time(fleet_cycle, args.n)
    t_meta = _time(meta_only, args.n)
    t_local2 = _time(local_cycle, args.n)  # again, after: the machine's drift shows in the spread
    base = statistics.mean([t_local, t_local2])
    print(f"fleet: {args.replicas} replicas, prefix index {filled:,} entries (bound {args.entries:,}), "
          f"request: {prompt_tokens} tokens in 20 messages, cold lookups")
    rows = [
        ("local acquire+release (elastic)", base),
        ("fleet acquire+release (placement)", t_fleet),
        ("routing meta (hash 20 messages)", t_meta),
        ("routing decision (meta + fleet)", t_meta + t_fleet),
    ]
    for name, t in rows:
        print(f"  {name:36s} {t * 1e6:8.1f} us   {t / base:5.2f}x local")
    print(f"  local before/after: {t_local * 1e6:.1f} / {t_local2 * 1e6:.1f} us")
    ratio = (t_meta + t_fleet) / base
    print(f"routing decision / local acquire+release = {ratio:.2f}x (target <= 3x): "
          f"{'OK' if ratio <= 3 else 'OVER'}")


if __name__ == "__main__":
    main()
