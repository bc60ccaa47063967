"""Elastic under a client that reads its streams late: does the projection undercount, and what does the
late-reader extrapolation (docs/elastic.md#late-readers) change?

Not a test. Runs the agentic storm with a busy client for ``no-admission``, ``zp-elastic`` (the library's
default: every report read as the present), ``zp-elastic-late`` (the same budget with
``ElasticPolicy(late_readers=True)``: reports stamped, leases extrapolated while the client reads late)
and the same pair for ``zp-oracle`` (true lengths, so forecast error is excluded and what preempts it is
the lag). ``--clock virtual`` (default) models the busy client by holding its reads through 50 ms busy
periods (:class:`~zp_client.testing.ReadPauses`; deterministic); ``--clock real`` spins the client's
event loop (``--client-load``'s real mode; needs a quiet machine). ``--headroom 1.0`` removes the 5%
reserve that otherwise absorbs an undercount. One line per setup and seed:

    .venv/bin/python benchmarks/late_reader.py --client-load 0.5 --seeds 0 1 2
    .venv/bin/python benchmarks/late_reader.py --client-load 0.5 --seeds 0 1 2 --headroom 1.0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zp_storm import elastic_setups  # noqa: E402
from zp_storm.cli import _DEFAULTS  # noqa: E402
from zp_storm.report import compute_metrics  # noqa: E402
from zp_storm.runner import StormConfig, run_storm  # noqa: E402
from zp_storm.setups import AppCaller, SetupContext, SetupSpec, register_setup, zp_client_for  # noqa: E402
from zp_storm.tuning import ElasticTuning  # noqa: E402


def _late_budget(ctx: SetupContext) -> Any:
    from zp_client.budget.elastic import ElasticPolicy
    from zp_client.budget.local import LocalBudget

    return LocalBudget(limit_blocks=elastic_setups._limit(ctx), block_size=ctx.block_size,
                       policy=ElasticPolicy(ctx.block_size, late_readers=True), clock=ctx.budget_clock())


async def _elastic_late(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Any:
    client = await zp_client_for(ctx, stack, _late_budget(ctx))
    return AppCaller(client, ctx.model, app_retry=True)


async def _oracle_late(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Any:
    from zp_client.transport import forecaster_for
    from zp_storm.oracle import SimOracleForecaster

    budget = _late_budget(ctx)
    client = await zp_client_for(ctx, stack, budget, forecaster=SimOracleForecaster(forecaster_for(budget)))
    return AppCaller(client, ctx.model, app_retry=True)


register_setup(SetupSpec("zp-elastic-late", True, default=False, description="zp-elastic, late_readers=True"),
               _elastic_late, after="zp-elastic")
register_setup(SetupSpec("zp-oracle-late", True, default=False, description="zp-oracle, late_readers=True"),
               _oracle_late, after="zp-oracle")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--client-load", type=float, default=0.5)
    ap.add_argument("--clock", choices=("virtual", "real"), default="virtual")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--headroom", type=float, default=None,
                    help="the elastic setups' headroom (default: the library's)")
    ap.add_argument("--setups", default="no-admission,zp-elastic,zp-elastic-late,zp-oracle,zp-oracle-late")
    ap.add_argument("--json", default=None, help="append one JSON line per setup and seed here")
    args = ap.parse_args()
    profile, blocks, mml, speedup = _DEFAULTS["agentic"]
    base = StormConfig(workload="agentic", profile=profile, num_gpu_blocks=blocks, max_model_len=mml,
                       speedup=speedup, clock=args.clock, client_load=args.client_load,
                       setups=args.setups.split(","), elastic=ElasticTuning(headroom=args.headroom))
    for seed in args.seeds:
        wl, facts, runs = run_storm(replace(base, seed=seed))
        ms = {r.name: compute_metrics(r, wl, facts, base.speedup) for r in runs}
        ref = ms.get("no-admission")
        for run in runs:
            m, h = ms[run.name], run.harness
            row = {"seed": seed, "setup": run.name, "clock": args.clock, "client_load": args.client_load,
                   "headroom": args.headroom, "preemptions": m["preemptions"], "ttft_p50": m["ttft_p50"],
                   "ttft_p99": m["ttft_p99"], "makespan": m["makespan"], "goodput_rps": m["goodput_rps"],
                   "errors": m["errors"], "sim_max_lag_s": m.get("sim_max_lag_s"),
                   "read_lag_p99_ms": h.get("read_lag_p99_ms", h.get("loop_lag_p99_ms"))}
            if ref is not None and ref is not m and ref["ttft_p50"] and ref["makespan"]:
                row["ttft_p50_vs_noadm"] = m["ttft_p50"] / ref["ttft_p50"]
                row["makespan_vs_noadm"] = m["makespan"] / ref["makespan"]
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
