"""Cost of one elastic admission decision against N live leases, kept projections vs recomputed.

Each decision follows one lease's growth report (a new ledger version, as in a stream), then asks
whether a waiter fits with the bounds over the limit (the projection's slow path). ``before`` is the
policy recomputing every lease's projection per version (what it did before per-lease projections were
kept); ``after`` is :class:`~zp_client.budget.elastic.ElasticPolicy` as it is. Both must decide alike.

    python benchmarks/elastic_prepare.py [--decisions 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from typing import Any

from zp_client.budget.elastic import ElasticPolicy, Projection, project
from zp_client.budget.ledger import Ledger, LedgerView, Ticket, WaiterRecord

BS = 16


class RecomputeAll(ElasticPolicy):
    """Every lease re-projected on every new version (the behaviour before the per-lease cache)."""

    def _projected(self, view: LedgerView, now: float | None) -> list[tuple[Projection, Mapping[str, Any]]]:
        return [(project(held=r.held, bound=r.bound, block_size=BS, meta=r.meta, now=now,
                         step_s=self.step_s), r.meta) for r in view.leases.values()]


def run(policy: ElasticPolicy, n: int, decisions: int) -> tuple[float, list[bool]]:
    led = Ledger(10**6, policy=policy)
    for i in range(n):
        meta = {"prompt_tokens": 200 + 7 * i % 300, "forecast_tokens": 100 + 13 * i % 400,
                "first_token": True, "tokens": 0}
        if i % 5 == 0:
            meta.update(prefix_key=f"p{i % 3}", prefix_blocks=4)
        led.enqueue(f"l{i}", 64, 13 + i % 20, 0, 0.0, meta=meta)
    led.grant(0.0)
    assert len(led.leases) == n
    # The bounds (n * 64) far over the limit: every decision takes the projection's path. The limit sits
    # 25 blocks over the projected peak: the small waiter fits, the large one does not.
    led.set_limit(policy.used(led) + 25, 0.0)
    ws = [WaiterRecord(id=f"w{b}", bound=b, held=h, priority=0, since=0.0, ticket=Ticket(0, 10**9), seq=0,
                       meta=led.prepare_meta(b, {"prompt_tokens": p, "forecast_tokens": f}))
          for b, h, p, f in ((16, 7, 100, 50), (64, 19, 300, 400))]
    out: list[bool] = []
    lids = list(led.leases)
    t0 = time.process_time()
    for d in range(decisions):
        lid = lids[d % n]
        rec = led.leases[lid]
        led.update_meta(lid, tokens=int(rec.meta["tokens"]) + 1)
        out.append(led.fits_now(ws[d % 2]))
    return (time.process_time() - t0) / decisions, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"{'leases':>7} {'before us':>10} {'after us':>9} {'ratio':>6}")
    for n in (100, 500, 1000):
        # CPU time of this process (the machine may be shared), best of --repeats alternating runs.
        before = after = float("inf")
        for _ in range(a.repeats):
            tb, ob = run(RecomputeAll(BS), n, a.decisions)
            ta, oa = run(ElasticPolicy(BS), n, a.decisions)
            before, after = min(before, tb), min(after, ta)
        assert ob == oa, "decisions differ"
        assert any(oa) and not all(oa), "decisions should be mixed"
        print(f"{n:>7} {before * 1e6:>10.1f} {after * 1e6:>9.1f} {before / after:>6.2f}")


if __name__ == "__main__":
    main()
