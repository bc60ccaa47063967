"""The line discipline at the budget level: FIFO vs the SLO-aware line on a virtual clock.

A stream of requests with TTFT targets arrives at one :class:`~zp_client.budget.ledger.Ledger` (strict
policy: each request holds its blocks for its service time), Poisson arrivals at ``load`` x the pool's
throughput for ``--duration`` virtual seconds, then the line drains. A request's TTFT is its wait in
line plus its prefill time; it is *in SLO* when that is within its class's target. Every request is
served (nothing is refused), so the disciplines differ only in order. No server, no HTTP: this measures
what the order alone can buy, before the storm benchmark's full stack (docs/admission.md#the-slo-aware-line).

    python benchmarks/line_eval.py                       # loads 0.5,1,2,4; seeds 0-4; two workloads
    python benchmarks/line_eval.py --duration 300 --late 10,60,120,inf   # sustained overload
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from dataclasses import dataclass

from zp_client.budget.ledger import Ledger

LIMIT = 1000  # blocks
TOKEN_S = 0.03  # decode seconds per output token
PREFILL_S_PER_BLOCK = 0.004


@dataclass
class Req:
    rid: str
    arrival: float
    blocks: int
    service_s: float
    prefill_s: float
    target_s: float
    cls: str
    ttft: float | None = None


def workload(kind: str, load: float, duration: float, seed: int) -> list[Req]:
    """``one``: one class, TTFT target 5 s. ``mixed``: 30% interactive (small, 1 s target), 70% batch
    (large, 30 s target), one priority class, so only the order within a class differs."""
    rng = random.Random(seed)
    reqs: list[Req] = []

    def draw(i: int, t: float) -> Req:
        if kind == "mixed" and rng.random() < 0.3:
            prompt = rng.randint(20, 40)
            out = min(256, int(rng.lognormvariate(math.log(120), 0.6)))
            target, cls = 1.0, "interactive"
        else:
            prompt = rng.randint(20, 120)
            out = min(2048, int(rng.lognormvariate(math.log(300), 0.8)))
            target, cls = (30.0, "batch") if kind == "mixed" else (5.0, "one")
        blocks = prompt + math.ceil(out / 16)
        prefill = prompt * PREFILL_S_PER_BLOCK
        return Req(f"r{i}", t, blocks, prefill + out * TOKEN_S, prefill, target, cls)

    # calibrate the rate: mean blocks x seconds of a request, by sampling
    sample = [draw(-1, 0.0) for _ in range(4000)]
    rng.seed(seed)
    work = statistics.fmean(r.blocks * r.service_s for r in sample)
    rate = load * LIMIT / work
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        reqs.append(draw(i, t))
        i += 1
    return reqs


def simulate(reqs: list[Req], line: str, late_bound_s: float,
             starvation_bound_s: float = 2.0) -> dict[str, float]:
    led = Ledger(LIMIT, line=line, late_bound_s=late_bound_s,  # type: ignore[arg-type]
                 starvation_bound_s=starvation_bound_s)
    by_id = {r.rid: r for r in reqs}
    events: list[tuple[float, int, str, str]] = []  # (time, tie, kind, id)
    for k, r in enumerate(reqs):
        heapq.heappush(events, (r.arrival, k, "arrive", r.rid))
    tie = len(reqs)
    end = 0.0
    while events:
        now, _, kind, rid = heapq.heappop(events)
        if kind == "arrive":
            r = by_id[rid]
            led.enqueue(rid, r.blocks, None, 0, now, meta={"ttft_target_s": r.target_s})
        else:
            led.release(rid, now)
            end = now
        for g in led.grant(now):
            r = by_id[g]
            r.ttft = now - r.arrival + r.prefill_s
            tie += 1
            heapq.heappush(events, (now + r.service_s, tie, "done", g))
    good = [r for r in reqs if r.ttft is not None and r.ttft <= r.target_s]
    late = sorted(r.ttft for r in reqs if r.ttft is not None and r.ttft > r.target_s)
    out = {"n": len(reqs), "good": len(good), "makespan": end,
           "late_p99": late[min(len(late) - 1, int(0.99 * len(late)))] if late else 0.0,
           "late_max": late[-1] if late else 0.0}
    for cls in sorted({r.cls for r in reqs}):
        mine = [r for r in reqs if r.cls == cls]
        out[f"good_{cls}"] = sum(1 for r in mine if r.ttft is not None and r.ttft <= r.target_s)
        out[f"n_{cls}"] = len(mine)
    return out


def _seeds(spec: str) -> list[int]:
    if "-" in spec:
        a, b = spec.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in spec.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loads", default="0.5,1,2,4")
    ap.add_argument("--late", default="10,60,inf", help="late_bound_s values for the slo line")
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--duration", type=float, default=60.0, help="virtual seconds of arrivals")
    ap.add_argument("--workloads", default="one,mixed")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    lates = [float(x) for x in args.late.split(",")]
    seeds = _seeds(args.seeds)
    setups = [("fifo", 0.0)] + [("slo", lb) for lb in lates]
    for kind in args.workloads.split(","):
        print(f"\n## workload {kind} (median over seeds {args.seeds}; in SLO / sent, late TTFT p99 / max s, "
              "makespan s)")
        print("| load | setup | in SLO | " + ("interactive in SLO | " if kind == "mixed" else "")
              + "late p99 | late max | makespan |")
        print("|---|---|---|" + ("---|" if kind == "mixed" else "") + "---|---|---|")
        for load in loads:
            for line, lb in setups:
                rows = [simulate(workload(kind, load, args.duration, s), line, lb) for s in seeds]
                med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                name = "fifo" if line == "fifo" else f"slo late_bound={lb:g}"
                extra = (f"{med['good_interactive']:.0f} / {med['n_interactive']:.0f} | "
                         if kind == "mixed" else "")
                print(f"| {load:g}x | {name} | {med['good']:.0f} / {med['n']:.0f} | {extra}"
                      f"{med['late_p99']:.1f} | {med['late_max']:.1f} | {med['makespan']:.1f} |")


if __name__ == "__main__":
    main()
