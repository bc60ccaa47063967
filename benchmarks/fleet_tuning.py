"""zp-fleet's knobs on one seed (the tuning seed; evaluate on others): one storm per variant, each in its
own process, printed side by side with the same seed's no-admission and epp when asked.

    .venv/bin/python benchmarks/fleet_tuning.py --seed 0 --replicas 4 --affinity 0.5,0 [--setups epp]

A variant is an ``affinity_wait_s`` (``ElasticTuning.affinity_wait_s``); every other setting is the
library's default. Virtual clock: the records depend only on the seed, the workload and the variant.
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

    workload, seed, replicas, affinity, setup, load, kill, extra = args
    profile, blocks, mml, _ = _DEFAULTS[workload]  # what `zp-client storm --workload W` runs
    cfg = StormConfig(workload=workload, seed=seed, setups=[setup], replicas=replicas, load_scale=load,
                      profile=profile, num_gpu_blocks=blocks, max_model_len=mml,
                      elastic=ElasticTuning(affinity_wait_s=affinity, **extra), kill_replica_s=kill)
    wl, facts, runs = run_storm(cfg)
    rep = build_report(wl, facts, runs, cfg, "fleet_tuning")
    m = {x["setup"]: x for x in rep["setups"]}[setup]
    keys = ("preemptions", "errors", "ttft_p50", "ttft_p99", "slo_attainment", "goodput_rps", "makespan",
            "prefix_cache_hit_rate", "cut_streams", "cut_requests", "moved_off_dead", "preemptions_per_replica",
            "kv_usage_max", "error_kinds", "unsent", "killed_in_flight")
    row = {"setup": setup, "seed": seed, "affinity_wait_s": affinity, "kill": kill, **extra,
           **{k: m.get(k) for k in keys}}
    if kill is not None:  # the acceptance's kill checks, from the records
        recs = runs[0].records
        row["failed_sent"] = sum(1 for r in recs if not r.ok and r.sent)
        row["failed_kinds"] = sorted({(r.error or "").split(":")[0] for r in recs if not r.ok and r.sent})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="agentic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--load-scale", type=float, default=None)
    ap.add_argument("--affinity", default="0.5,0", help="affinity_wait_s values, comma-separated")
    ap.add_argument("--setups", default="", help="reference setups to run beside (e.g. no-admission,epp)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--seeds", default=None, help="seeds, comma-separated (default: --seed)")
    ap.add_argument("--kill", type=float, default=None, help="--kill-replica AT_S for every run")
    ap.add_argument("--starvation", type=float, default=None, help="zp-fleet's starvation_bound_s")
    ap.add_argument("--headroom", type=float, default=None, help="zp-fleet's elastic headroom")
    ap.add_argument("--tune", default="", help="more ElasticTuning fields for zp-fleet: q=0.5,q_tail=0.9")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else [a.seed]
    extra: dict[str, Any] = {k: v for k, v in (("starvation_bound_s", a.starvation), ("headroom", a.headroom))
                             if v is not None}
    extra.update({k: float(v) for k, v in (kv.split("=", 1) for kv in a.tune.split(",") if kv)})
    jobs: list[tuple[Any, ...]] = []
    for seed in seeds:
        jobs += [(a.workload, seed, a.replicas, float(x), "zp-fleet", a.load_scale, a.kill, extra)
                 for x in a.affinity.split(",") if x]
        jobs += [(a.workload, seed, a.replicas, None, s, a.load_scale, a.kill, {})
                 for s in a.setups.split(",") if s]
    with mp.get_context("spawn").Pool(a.procs) as pool:
        for row in pool.imap(_one, jobs):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
