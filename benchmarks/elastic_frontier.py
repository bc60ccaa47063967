"""The elastic policy's frontier on the storm: preemptions against TTFT p99 for several q (and headroom),
and issue 8's acceptance ratios, on ``agentic`` and ``seed-burst`` at two load levels over several seeds.

Not a test: runs the storm (``zp_storm``) programmatically, one setup per storm so runs can go in
parallel processes (``--jobs``), appends every run's metrics to a JSON-lines file (``--out``; a rerun
skips runs already there, so it can be resumed) and prints, per workload and load, the medians over seeds:

* the frontier: for each (q, headroom) of ``zp-elastic``: preemptions (median and max), TTFT p50/p99,
  TTFT p99 / zp-oracle's, makespan / no-admission's, ITL p99 / zp-strict's;
* the acceptance table of issue 8 for the library's default zp-elastic (q and headroom unset).

Every time figure is virtual (the simulator's clock). Tune on seeds 1-3; evaluate on 11 12 13.

    .venv/bin/python benchmarks/elastic_frontier.py --seeds 1 2 3 --qs 0.5 0.7 0.9 --out /tmp/tune.jsonl
    .venv/bin/python benchmarks/elastic_frontier.py --seeds 11 12 13 --out /tmp/eval.jsonl --jobs 2
    .venv/bin/python benchmarks/elastic_frontier.py --out /tmp/eval.jsonl --report-only
    .venv/bin/python benchmarks/elastic_frontier.py --workloads seed-burst --longest-first-s 15 --out /tmp/lpt.jsonl

``--longest-first-s`` / ``--starvation-bound-s`` set the local elastic budgets' longest-first window and
backfill bound for every run (use a separate ``--out`` per value: the tables do not split on them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

#: Storm defaults per workload (as ``zp-client storm``) and the two load levels (``--load-scale``).
LOADS = {"agentic": (1.0, 1.25), "seed-burst": (1.0, 1.25)}
BASELINES = ("no-admission", "zp-strict", "zp-oracle", "zp-elastic")


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["workload"], r["load"], r["seed"], r["setup"], r.get("q"), r.get("headroom"), r.get("prior_weight"),
            r.get("q_tail"), r.get("starvation_bound_s"), r.get("longest_first_s"))


def run_one(workload: str, load: float, seed: int, setup: str, q: float | None, headroom: float | None,
            prior_weight: float | None, q_tail: float | None, speedup: float | None,
            starvation_bound_s: float | None = None, longest_first_s: float | None = None) -> dict[str, Any]:
    """One storm with one setup; returns its metrics row (virtual time)."""
    from zp_storm import cli
    from zp_storm.report import build_report
    from zp_storm.runner import StormConfig, run_storm
    from zp_storm.tuning import ElasticTuning

    logging.basicConfig(level=logging.ERROR)
    tuning = ElasticTuning(q=q, headroom=headroom, prior_weight=prior_weight, q_tail=q_tail,
                           starvation_bound_s=starvation_bound_s, longest_first_s=longest_first_s)
    profile, blocks, mml, default_speedup = cli._DEFAULTS[workload]
    cfg = StormConfig(workload=workload, seed=seed, setups=[setup], profile=profile, num_gpu_blocks=blocks,
                      max_model_len=mml, speedup=speedup or default_speedup, load_scale=load, elastic=tuning)
    wall = time.monotonic()
    wl, facts, runs = run_storm(cfg)
    m = build_report(wl, facts, runs, cfg, "elastic_frontier")["setups"][0]
    keep = ("preemptions", "kv_usage_max", "ttft_p50", "ttft_p99", "itl_p99", "makespan", "errors", "ok", "sent",
            "valid", "effective_speedup")
    row = {k: m.get(k) for k in keep}
    row.update(workload=workload, load=load, seed=seed, setup=setup, q=q, headroom=headroom, prior_weight=prior_weight,
               q_tail=q_tail, wall_s=round(time.monotonic() - wall, 1))
    if starvation_bound_s is not None:
        row["starvation_bound_s"] = starvation_bound_s
    if longest_first_s is not None:
        row["longest_first_s"] = longest_first_s
    return row


def _med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def report(rows: list[dict[str, Any]]) -> str:
    """Markdown tables: the frontier and the acceptance check, medians over seeds."""
    out: list[str] = []
    cells = sorted({(r["workload"], r["load"]) for r in rows})
    for wl, load in cells:
        rs = [r for r in rows if r["workload"] == wl and r["load"] == load]
        seeds = sorted({r["seed"] for r in rs})

        def per_seed(setup: str, q: Any = None, h: Any = None, w: Any = None, t: Any = None) -> dict[int, dict[str, Any]]:
            return {r["seed"]: r for r in rs if r["setup"] == setup and r.get("q") == q and r.get("headroom") == h
                    and r.get("prior_weight") == w and r.get("q_tail") == t}

        base = {s: per_seed(s) for s in ("no-admission", "zp-strict", "zp-oracle")}

        def ratio_med(var: dict[int, dict[str, Any]], metric: str, ref: str, ref_metric: str | None = None) -> Any:
            return _med([_ratio(var[s].get(metric), base[ref][s].get(ref_metric or metric))
                         for s in seeds if s in var and s in base[ref]])

        out.append(f"\n### {wl}, load x{load} (seeds {' '.join(map(str, seeds))}; medians over seeds)\n")
        out.append("| setup | q | q tail | headroom | prior weight | preempt med (max) | KV max | TTFT p50 s | TTFT p99 s "
                   "| p50 / no-adm | p99 / oracle | makespan / no-adm | ITL p99 / strict | invalid |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        variants = sorted({(r["setup"], r.get("q"), r.get("headroom"), r.get("prior_weight"), r.get("q_tail"))
                           for r in rs},
                          key=lambda v: (BASELINES.index(v[0]) if v[0] in BASELINES else 9, v[1] or 0, v[2] or 0,
                                         v[3] or 0, v[4] or 0))
        for setup, q, h, w, t in variants:
            var = per_seed(setup, q, h, w, t)
            pre = [var[s]["preemptions"] for s in seeds if s in var]
            out.append(
                f"| {setup} | {_f(q) if q else 'default'} | {_f(t) if t else 'default'} | {_f(h) if h else 'default'} | "
                f"{_f(w, '{:g}') if w else 'default'} | "
                f"{_f(_med(pre), '{:.0f}')} ({max(pre) if pre else '-'}) | "
                f"{_f(_med([var[s]['kv_usage_max'] for s in var]))} | "
                f"{_f(_med([var[s]['ttft_p50'] for s in var]))} | {_f(_med([var[s]['ttft_p99'] for s in var]))} | "
                f"{_f(ratio_med(var, 'ttft_p50', 'no-admission'))}x | {_f(ratio_med(var, 'ttft_p99', 'zp-oracle'))}x | "
                f"{_f(ratio_med(var, 'makespan', 'no-admission'), '{:.3f}')}x | "
                f"{_f(ratio_med(var, 'itl_p99', 'zp-strict'))}x | {sum(1 for s in var if not var[s]['valid'])} |")
        el = per_seed("zp-elastic")
        if el:
            pre = _med([el[s]["preemptions"] for s in el])
            checks = [
                ("zp-elastic preemptions (median) == 0", _f(pre, "{:.0f}"), pre == 0),
                ("makespan <= 1.02x no-admission", _f(ratio_med(el, "makespan", "no-admission"), "{:.3f}x"),
                 (ratio_med(el, "makespan", "no-admission") or 9) <= 1.02),
                ("TTFT p50 <= 1.1x no-admission", _f(ratio_med(el, "ttft_p50", "no-admission"), "{:.2f}x"),
                 (ratio_med(el, "ttft_p50", "no-admission") or 9) <= 1.1),
                ("TTFT p99 <= 3x zp-oracle", _f(ratio_med(el, "ttft_p99", "zp-oracle"), "{:.2f}x"),
                 (ratio_med(el, "ttft_p99", "zp-oracle") or 9) <= 3.0),
                ("ITL p99 <= 1.05x zp-strict", _f(ratio_med(el, "itl_p99", "zp-strict"), "{:.2f}x"),
                 (ratio_med(el, "itl_p99", "zp-strict") or 9) <= 1.05),
            ]
            na = base["no-admission"]
            if wl == "agentic" and na:
                checks += [
                    ("hard: no-admission preemptions >= 5", _f(_med([na[s]["preemptions"] for s in na]), "{:.0f}"),
                     (_med([na[s]["preemptions"] for s in na]) or 0) >= 5),
                    ("hard: no-admission KV max == 1.0", _f(_med([na[s]["kv_usage_max"] for s in na])),
                     (_med([na[s]["kv_usage_max"] for s in na]) or 0) >= 1.0),
                    ("hard: zp-strict TTFT p50 >= 5x no-admission",
                     _f(_med([_ratio(base["zp-strict"][s]["ttft_p50"], na[s]["ttft_p50"])
                              for s in seeds if s in base["zp-strict"] and s in na]), "{:.1f}x"),
                     (_med([_ratio(base["zp-strict"][s]["ttft_p50"], na[s]["ttft_p50"])
                            for s in seeds if s in base["zp-strict"] and s in na]) or 0) >= 5),
                ]
            out.append("\n| acceptance (default zp-elastic) | value | met |\n|---|---|---|")
            out.extend(f"| {name} | {v} | {'yes' if ok else 'NO'} |" for name, v, ok in checks)
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["agentic", "seed-burst"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[11, 12, 13])
    ap.add_argument("--loads", nargs="+", type=float, default=None,
                    help="load scales (default: 1.0 and 1.25 for both workloads)")
    ap.add_argument("--qs", nargs="*", type=float, default=[], help="extra zp-elastic runs at these q")
    ap.add_argument("--headrooms", nargs="*", type=float, default=[], help="extra zp-elastic runs at these headrooms")
    ap.add_argument("--q-tails", nargs="*", type=float, default=[],
                    help="extra zp-elastic runs at these re-forecast (tail) quantiles")
    ap.add_argument("--prior-weights", nargs="*", type=float, default=[],
                    help="extra zp-elastic runs at these prior weights (pseudo-observations)")
    ap.add_argument("--baselines", nargs="*", default=list(BASELINES))
    ap.add_argument("--speedup", type=float, default=None, help="override the storm's speedup")
    ap.add_argument("--longest-first-s", type=float, default=None,
                    help="the local elastic budgets' longest-first window for every run (default: the library's)")
    ap.add_argument("--starvation-bound-s", type=float, default=None,
                    help="the local elastic budgets' backfill bound for every run (default: the library's)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel processes")
    ap.add_argument("--out", default="elastic_frontier.jsonl")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    path = Path(args.out)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    if not args.report_only:
        done = {_key(r) for r in rows}
        tasks = []
        for wl in args.workloads:
            for load in (args.loads or LOADS[wl]):
                for seed in args.seeds:
                    variants = [(s, None, None, None, None) for s in args.baselines]
                    variants += [("zp-elastic", q, None, None, None) for q in args.qs]
                    variants += [("zp-elastic", None, h, None, None) for h in args.headrooms]
                    variants += [("zp-elastic", None, None, w, None) for w in args.prior_weights]
                    variants += [("zp-elastic", None, None, None, t) for t in args.q_tails]
                    for setup, q, h, w, t in variants:
                        if (wl, load, seed, setup, q, h, w, t, args.starvation_bound_s,
                                args.longest_first_s) not in done:
                            tasks.append((wl, load, seed, setup, q, h, w, t, args.speedup, args.starvation_bound_s,
                                          args.longest_first_s))
        print(f"{len(tasks)} runs to do, {len(rows)} already in {path}", file=sys.stderr, flush=True)
        with ProcessPoolExecutor(max_workers=args.jobs) as pool, path.open("a") as f:
            futs = [pool.submit(run_one, *t) for t in tasks]
            for fut in as_completed(futs):
                row = fut.result()
                rows.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(f"{row['workload']} x{row['load']} seed {row['seed']} {row['setup']} q={row['q']} "
                      f"t={row['q_tail']} h={row['headroom']} w={row['prior_weight']}: preempt {row['preemptions']} TTFT p50 {row['ttft_p50']} "
                      f"p99 {row['ttft_p99']} makespan {row['makespan']} valid {row['valid']} "
                      f"({row['wall_s']} s)", file=sys.stderr, flush=True)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
