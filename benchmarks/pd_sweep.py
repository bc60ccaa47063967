"""``zp-pd``'s knobs: one storm per (seed, variant) at ``--pd P:D``, each in its own process, a JSON row
per run with the issue-20 columns (decode-pool ITL, TTFT, goodput under the plain and the tail SLO).

    .venv/bin/python benchmarks/pd_sweep.py --workload agentic --thresholds 0,256,512,2048,inf --seeds 1,2,3
    .venv/bin/python benchmarks/pd_sweep.py --workload seed-burst --setups pd-proxy,zp-fleet --seeds 1,2,3
    .venv/bin/python benchmarks/pd_sweep.py --table rows.jsonl [more.jsonl ...]   # medians, markdown

A variant is a conditional-disaggregation threshold (``ElasticTuning.pd_threshold_tokens``; ``inf``:
never disaggregate) for ``zp-pd``; ``--setups`` adds reference setups. Virtual clock: each row depends
only on its seed, workload and variant.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
from typing import Any


def _one(args: tuple[Any, ...]) -> dict[str, Any]:
    from zp_storm.cli import _DEFAULTS
    from zp_storm.report import build_report
    from zp_storm.runner import StormConfig, run_storm
    from zp_storm.tuning import ElasticTuning

    workload, seed, pd, setup, threshold, extra = args
    profile, blocks, mml, _ = _DEFAULTS[workload]  # what `zp-client storm --workload W` runs
    tune = dict(extra)
    if threshold is not None:
        tune["pd_threshold_tokens"] = threshold
    cfg = StormConfig(workload=workload, seed=seed, setups=[setup], replicas=pd[0] + pd[1], pd=pd,
                      profile=profile, num_gpu_blocks=blocks, max_model_len=mml,
                      elastic=ElasticTuning(**tune))
    wl, facts, runs = run_storm(cfg)
    rep = build_report(wl, facts, runs, cfg, "pd_sweep")
    m = {x["setup"]: x for x in rep["setups"]}[setup]
    pools = m.get("pd") or {}
    keys = ("preemptions", "errors", "ttft_p50", "ttft_p99", "itl_p99", "itl_p99_vs_unloaded",
            "slo_attainment", "goodput_rps", "goodput_tail_rps", "makespan", "held_deficit")
    row: dict[str, Any] = {"setup": setup, "seed": seed, "threshold": threshold, **extra,
                           **{k: m.get(k) for k in keys}}
    dec = pools.get("decode") or {}
    row["decode_itl_p99_ms"] = dec.get("itl_p99_ms")
    row["decode_preempt"] = dec.get("preemptions")
    row["prefill_preempt"] = (pools.get("prefill") or {}).get("preemptions")
    row["expired"] = sum(int(p.get("expired") or 0) for p in pools.values())
    row["pd_counts"] = m.get("pd_counts")
    return row


def table(paths: list[str]) -> str:
    """Markdown: per (setup, threshold), medians over the seeds of the rows in ``paths``."""
    import statistics

    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    r = json.loads(line)
                    groups.setdefault((r["setup"], r["threshold"]), []).append(r)

    def med(rows: list[dict[str, Any]], key: str) -> Any:
        xs = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    out = ["| setup | threshold | preempt (P / D) | expired leases | ITL p99 / unloaded | TTFT p50 s "
           "| TTFT p99 s | in SLO | good req/s (range) | tail-SLO good req/s | deficit samples |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (setup, thr), rows in groups.items():
        pre = (f"{med(rows, 'prefill_preempt'):g} / {med(rows, 'decode_preempt'):g}"
               if med(rows, "decode_preempt") is not None else f"{med(rows, 'preemptions'):g}")
        good = [r["goodput_rps"] for r in rows]
        deficit = [(r.get("held_deficit") or {}).get("deficit_samples") for r in rows]
        thr_text = "" if thr is None else f"{thr:g}"
        out.append(f"| {setup} | {thr_text} | {pre} | {med(rows, 'expired'):g} "
                   f"| {med(rows, 'itl_p99_vs_unloaded'):.2f}x | {med(rows, 'ttft_p50'):.2f} "
                   f"| {med(rows, 'ttft_p99'):.1f} | {med(rows, 'slo_attainment'):.0%} "
                   f"| {med(rows, 'goodput_rps'):.3f} ({min(good):.3f}-{max(good):.3f}) "
                   f"| {med(rows, 'goodput_tail_rps'):.3f} "
                   f"| {'-' if deficit[0] is None else ', '.join(str(d) for d in deficit)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="agentic")
    ap.add_argument("--pd", default="1:1")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--thresholds", default="", help="zp-pd thresholds, comma-separated (inf: never)")
    ap.add_argument("--setups", default="", help="reference setups to run beside (e.g. pd-proxy,zp-fleet)")
    ap.add_argument("--tune", default="", help="more ElasticTuning fields for zp-pd: headroom=1.0")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--table", nargs="+", default=None, metavar="JSONL", help="print the medians of rows")
    a = ap.parse_args()
    if a.table:
        print(table(a.table))
        return
    p, d = (int(x) for x in a.pd.split(":"))
    extra: dict[str, Any] = {k: float(v) for k, v in (kv.split("=", 1) for kv in a.tune.split(",") if kv)}
    jobs: list[tuple[Any, ...]] = []
    for seed in (int(x) for x in a.seeds.split(",")):
        jobs += [(a.workload, seed, (p, d), "zp-pd", float(t), extra) for t in a.thresholds.split(",") if t]
        jobs += [(a.workload, seed, (p, d), s, None, {}) for s in a.setups.split(",") if s]
    with mp.get_context("spawn").Pool(a.procs) as pool:
        for row in pool.imap(_one, jobs):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
