"""How long ``LocalBudget.status()`` holds the budget's lock for its predicted waits.

Not a test. Builds an elastic :class:`~zp_client.budget.ledger.Ledger` with ``--leases`` live leases
(each reporting progress, so the predictor has a pace) and ``--waiters`` waiters in two priority classes,
then times what ``status()`` does for ``predicted_wait_s``: before, the replay ran under the lock
(:func:`~zp_client.budget.predict.predict_waits` on the ledger, which copies it); now only the copy is
taken under the lock and the replay runs on it afterwards (``in_place=True``). Median of ``--reps``::

    python benchmarks/status_lock.py --waiters 157
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zp_client.budget.elastic import make_policy  # noqa: E402
from zp_client.budget.ledger import Ledger  # noqa: E402
from zp_client.budget.predict import predict_waits  # noqa: E402

BS = 16


def build(leases: int, waiters: int, limit: int) -> Ledger:
    led = Ledger(limit, policy=make_policy("elastic", block_size=BS))
    for i in range(leases):
        prompt, forecast = 400 + 37 * (i % 11), 100 + 53 * (i % 7)
        lid = f"l{i}"
        led.enqueue(lid, (prompt + 1024) // BS + 1, prompt // BS, 0, 0.0,
                    meta={"prompt_tokens": prompt, "forecast_tokens": forecast, "streaming": True})
        if not led.grant(0.0):
            led.cancel(lid)
            break
        led.update_meta(lid, tokens=prompt + 1, first_token=True)
        led.update_meta(lid, tokens=prompt + 1 + (i * 13) % forecast)
    for j in range(waiters):
        prompt = 300 + 41 * (j % 13)
        led.enqueue(f"w{j}", (prompt + 1024) // BS + 1, prompt // BS, j % 2, 1.0,
                    meta={"prompt_tokens": prompt, "forecast_tokens": 120 + 17 * (j % 5), "streaming": True,
                          "ttft_target_s": 1.0 if j % 2 == 0 else 30.0})
    return led


def heads(led: Ledger) -> list[str]:
    h: dict[int, str] = {}
    for w in led.line():
        h.setdefault(w.priority, w.id)
    return list(h.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leases", type=int, default=60)
    ap.add_argument("--waiters", type=int, default=157)
    ap.add_argument("--limit", type=int, default=1843)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    led = build(a.leases, a.waiters, a.limit)
    print(f"ledger: {len(led.leases)} leases, {len(led)} waiters, limit {a.limit} blocks")
    old, copy_s, total = [], [], []
    for _ in range(a.reps):
        t = time.perf_counter()
        w_old = predict_waits(led, 2.0, block_size=BS, only=heads(led))
        old.append(time.perf_counter() - t)
        t = time.perf_counter()
        snap = copy.deepcopy(led)
        copy_s.append(time.perf_counter() - t)
        w_new = predict_waits(snap, 2.0, block_size=BS, only=heads(snap), in_place=True)
        total.append(time.perf_counter() - t)
        assert w_new == w_old, (w_new, w_old)
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms"  # noqa: E731
    print(f"lock held, replay under the lock (before): {ms(old)}")
    print(f"lock held, copy only (now):                {ms(copy_s)}; status() in all {ms(total)}")


if __name__ == "__main__":
    main()
