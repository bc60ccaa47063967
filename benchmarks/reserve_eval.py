"""The spread-sized reserve against the flat 5%: ``zp-elastic`` (headroom 0.95) beside
``zp-elastic-ureserve`` (the whole usable pool, ``ElasticPolicy(reserve_z=Z)``) on the virtual clock.

Not a test. One setup per storm, so runs go in parallel processes (``--jobs``); every run's metrics are
appended to a JSON-lines file (``--out``; a rerun skips runs already there) and the script prints, per
workload and seed, preemptions, makespan / no-admission, TTFT p50 and p99 / no-admission and goodput /
no-admission, then the same as medians (and maxima of preemptions) over the seeds. Every time figure is
virtual (the simulator's clock), so the numbers do not depend on the machine's load.

    .venv/bin/python benchmarks/reserve_eval.py --seeds 0 1 2 --zs 0.5 1.0 --jobs 2 --out /tmp/reserve.jsonl
    .venv/bin/python benchmarks/reserve_eval.py --out /tmp/reserve.jsonl --report-only
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINES = ("no-admission", "zp-elastic", "zp-oracle")
KEEP = ("preemptions", "kv_usage_max", "ttft_p50", "ttft_p99", "itl_p99", "makespan", "goodput_rps", "good",
        "errors", "ok", "sent", "valid")


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["workload"], r["load"], r["seed"], r["setup"], r.get("reserve_z"), r.get("headroom"))


def run_one(workload: str, load: float, seed: int, setup: str, reserve_z: float | None,
            headroom: float | None) -> dict[str, Any]:
    """One storm with one setup; its metrics row (virtual time)."""
    from zp_storm import cli
    from zp_storm.report import build_report
    from zp_storm.runner import StormConfig, run_storm
    from zp_storm.tuning import ElasticTuning

    logging.basicConfig(level=logging.ERROR)
    profile, blocks, mml, speedup = cli._DEFAULTS[workload]
    cfg = StormConfig(workload=workload, seed=seed, setups=[setup], profile=profile, num_gpu_blocks=blocks,
                      max_model_len=mml, speedup=speedup, load_scale=load,
                      elastic=ElasticTuning(reserve_z=reserve_z, headroom=headroom))
    wall = time.monotonic()
    wl, facts, runs = run_storm(cfg)
    m = build_report(wl, facts, runs, cfg, "reserve_eval")["setups"][0]
    row = {k: m.get(k) for k in KEEP}
    row.update(workload=workload, load=load, seed=seed, setup=setup, reserve_z=reserve_z, headroom=headroom,
               wall_s=round(time.monotonic() - wall, 1))
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _label(r: dict[str, Any]) -> str:
    name = r["setup"]
    extra = []
    if r.get("reserve_z") is not None:
        extra.append(f"z={r['reserve_z']:g}")
    if r.get("headroom") is not None:
        extra.append(f"h={r['headroom']:g}")
    return f"{name} ({', '.join(extra)})" if extra else name


def report(rows: list[dict[str, Any]]) -> str:
    out: list[str] = []
    cells = sorted({(r["workload"], r["load"]) for r in rows})
    for wl, load in cells:
        here = [r for r in rows if r["workload"] == wl and r["load"] == load]
        na = {r["seed"]: r for r in here if r["setup"] == "no-admission"}
        labels = sorted({_label(r) for r in here}, key=lambda s: (s != "no-admission", s))
        out.append(f"\n{wl} x{load:g} (virtual seconds; ratios against no-admission of the same seed)\n")
        out.append("| setup | seed | preemptions | KV max | makespan / no-adm | TTFT p50 s (/ no-adm) | "
                   "TTFT p99 s (/ no-adm) | goodput / no-adm |")
        out.append("|---|---|---|---|---|---|---|---|")
        summary: list[str] = []
        for lab in labels:
            rs = sorted((r for r in here if _label(r) == lab), key=lambda r: r["seed"])
            ms, p50s, p99s, gps = [], [], [], []
            for r in rs:
                base = na.get(r["seed"], {})
                m = _ratio(r["makespan"], base.get("makespan"))
                a = _ratio(r["ttft_p50"], base.get("ttft_p50"))
                b = _ratio(r["ttft_p99"], base.get("ttft_p99"))
                g = _ratio(r["goodput_rps"], base.get("goodput_rps"))
                ms.append(m)
                p50s.append(a)
                p99s.append(b)
                gps.append(g)
                valid = "" if r.get("valid", True) else " (INVALID)"
                kv = _f(r["kv_usage_max"], "{:.2f}")
                out.append(f"| {lab}{valid} | {r['seed']} | {r['preemptions']} | {kv} | "
                           f"{_f(m)}x | {_f(r['ttft_p50'], '{:.2f}')} ({_f(a, '{:.2f}')}x) | "
                           f"{_f(r['ttft_p99'], '{:.2f}')} ({_f(b, '{:.2f}')}x) | {_f(g)}x |")

            def med(xs: list[float | None]) -> float | None:
                v = [x for x in xs if x is not None]
                return statistics.median(v) if v else None

            pre = [r["preemptions"] for r in rs]
            hit = sum(1 for p in pre if p)
            summary.append(f"| {lab} | {len(rs)} | {statistics.median(pre):g} ({max(pre)}) | "
                           f"{hit}/{len(rs)} | {_f(med(ms))}x | {_f(med(p50s), '{:.2f}')}x | "
                           f"{_f(med(p99s), '{:.2f}')}x | {_f(med(gps))}x |")
        out.append("\n| setup | seeds | preempt med (max) | runs that preempted | makespan / no-adm | "
                   "TTFT p50 / no-adm | TTFT p99 / no-adm | goodput / no-adm |")
        out.append("|---|---|---|---|---|---|---|---|")
        out.extend(summary)
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["agentic", "seed-burst"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--loads", nargs="+", type=float, default=[1.0])
    ap.add_argument("--baselines", nargs="*", default=list(BASELINES))
    ap.add_argument("--zs", nargs="*", type=float, default=[],
                    help="zp-elastic-ureserve runs at these reserve_z (default: its own default)")
    ap.add_argument("--headroom", type=float, default=None,
                    help="zp-elastic-ureserve's headroom (default 1.0)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default="reserve_eval.jsonl")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    if not args.report_only:
        todo: list[tuple[Any, ...]] = []
        for wl in args.workloads:
            for load in args.loads:
                for seed in args.seeds:
                    for setup in args.baselines:
                        todo.append((wl, load, seed, setup, None, None))
                    for z in args.zs:
                        todo.append((wl, load, seed, "zp-elastic-ureserve", z, args.headroom))
        have = {_key(r) for r in rows}
        todo = [t for t in todo if (t[0], t[1], t[2], t[3], t[4], t[5]) not in have]
        print(f"{len(todo)} runs to do", flush=True)
        with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futs = {pool.submit(run_one, *t): t for t in todo}
            for fut in as_completed(futs):
                row = fut.result()
                rows.append(row)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{_label(row)} {row['workload']} x{row['load']:g} seed {row['seed']}: preempt "
                      f"{row['preemptions']} makespan {row['makespan']} TTFT p50 {row['ttft_p50']} p99 "
                      f"{row['ttft_p99']} ({row['wall_s']} s)", flush=True)
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
