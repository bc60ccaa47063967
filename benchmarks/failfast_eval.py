"""Predicted wait and fail-fast on the virtual-clock storm (issue 30).

docs/admission.md#predicted-wait-and-fail-fast has the results.

Not a test. Two setups, both ``zp-elastic``'s budget (``LocalBudget(predict=True)``) and client, each
request sending ``X-ZP-Deadline`` = the workload's TTFT target x ``--deadline-factor`` (default 1: the
target), no app-level retry (a refusal is the app's answer, not something to retry):

* ``zp-deadline``: fail-fast off. A request waits in line until admitted or its deadline passes.
* ``zp-failfast``: the same plus ``X-ZP-Fail-Fast: 1``: the budget refuses at enqueue a request whose
  predicted wait exceeds its deadline.

It prints, per load: the refusals of ``zp-failfast`` and their virtual time from the call's start
(must be <= 1 ms), the false refusals (refused, yet within the deadline in ``zp-deadline``'s run of the
same seed: TTFT <= deadline), the misses of ``zp-deadline`` (failed or TTFT > deadline), requests in SLO
of both, and the predicted wait's error (``zp-deadline``'s attempts that queued: predicted vs actual
wait in line) as median / p90 absolute error and median relative error.

    .venv/bin/python benchmarks/failfast_eval.py --workload seed-burst --loads 1,2 --seed 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zp_client.errors import DeadlineExceeded, unwrap_error  # noqa: E402
from zp_client.observe import observe_admissions  # noqa: E402
from zp_storm.cli import _DEFAULTS  # noqa: E402
from zp_storm.elastic_setups import _forecaster, _local_elastic  # noqa: E402
from zp_storm.runner import StormConfig, run_storm  # noqa: E402
from zp_storm.setups import AppCaller, SetupContext, SetupSpec, register_setup, zp_client_for  # noqa: E402

#: Filled by the callers (virtual runs are in-process): setup -> request id -> what it saw.
SEEN: dict[str, dict[str, dict[str, Any]]] = {}
DEADLINE_S = [5.0]


class _Caller(AppCaller):
    def __init__(self, name: str, client: Any, model: str, fail_fast: bool) -> None:
        super().__init__(client, model, app_retry=False)
        self.name = name
        self.fail_fast = fail_fast

    async def __call__(self, turn: Any, rec: Any, clock: Any) -> None:
        from zp_storm.loadgen import stream_chat

        headers = {"X-ZP-Deadline": f"{DEADLINE_S[0]:g}"}
        if self.fail_fast:
            headers["X-ZP-Fail-Fast"] = "1"
        out = SEEN.setdefault(self.name, {}).setdefault(rec.id, {})
        start = clock.now()
        rec.attempts += 1
        with observe_admissions() as seen:
            try:
                await stream_chat(self.client, self.model, turn, rec, clock, extra_headers=headers)
            except Exception as exc:
                err = unwrap_error(exc)
                if isinstance(err, DeadlineExceeded) and err.predicted_wait_s is not None:
                    out["refused_after_s"] = clock.now() - start
                    out["refused_predicted_s"] = err.predicted_wait_s
                raise
            finally:
                if seen:
                    out["waited_s"] = seen[0].queue_wait_s
                    out["predicted_s"] = seen[0].predicted_wait_s


def _factory(name: str, fail_fast: bool) -> Any:
    async def build(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Any:
        budget = _local_elastic(ctx, predict=True)
        client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster(ctx.elastic))
        return _Caller(name, client, ctx.model, fail_fast)

    return build


register_setup(SetupSpec("zp-deadline", False, default=False,
                         description="zp-elastic, X-ZP-Deadline, predicted waits"),
               _factory("zp-deadline", False))
register_setup(SetupSpec("zp-failfast", False, default=False,
                         description="zp-elastic, X-ZP-Deadline, X-ZP-Fail-Fast: 1"),
               _factory("zp-failfast", True))


def _q(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def evaluate(workload: str, load: float, seed: int, factor: float) -> dict[str, Any]:
    profile, blocks, mml, _ = _DEFAULTS[workload]
    cfg = StormConfig(workload=workload, seed=seed, profile=profile, num_gpu_blocks=blocks, max_model_len=mml,
                      load_scale=load, setups=["zp-deadline", "zp-failfast"])
    SEEN.clear()
    wl, _, runs = run_storm(cfg)
    target = wl.slo.ttft_s
    if abs(target * factor - DEADLINE_S[0]) > 1e-9:
        raise SystemExit(f"the workload's TTFT target is {target} s: run with --target {target}")
    by = {r.name: {rec.id: rec for rec in r.records if rec.sent} for r in runs}
    base, ff = by["zp-deadline"], by["zp-failfast"]

    def met(rec: Any) -> bool:
        return bool(rec.ok and rec.ttft is not None and rec.ttft <= DEADLINE_S[0])

    def in_slo(rec: Any) -> bool:
        return bool(rec.ok and rec.ttft is not None and rec.ttft <= target
                    and (rec.tpot is None or rec.tpot <= wl.slo.tpot_s))

    refused = {rid for rid, s in SEEN.get("zp-failfast", {}).items() if "refused_after_s" in s}
    false_ref = sorted(rid for rid in refused if rid in base and met(base[rid]))
    misses = [rid for rid, rec in base.items() if not met(rec)]
    delays = [SEEN["zp-failfast"][rid]["refused_after_s"] for rid in refused]
    errs: list[float] = []
    rel: list[float] = []
    for s in SEEN.get("zp-deadline", {}).values():
        p, a = s.get("predicted_s"), s.get("waited_s")
        if p is None or a is None:
            continue
        errs.append(abs(p - a))
        if a > 0:
            rel.append(abs(p - a) / a)
    return {
        "workload": workload, "load": load, "seed": seed, "deadline_s": DEADLINE_S[0],
        "sent": len(base), "refusals": len(refused), "false_refusals": len(false_ref),
        "false_refusal_share": len(false_ref) / len(refused) if refused else 0.0,
        "misses_without_failfast": len(misses),
        "refusal_delay_max_s": max(delays, default=0.0),
        "in_slo": {"zp-deadline": sum(map(in_slo, base.values())),
                   "zp-failfast": sum(map(in_slo, ff.values()))},
        "predicted": len(errs),
        "abs_err_median_s": statistics.median(errs) if errs else None,
        "abs_err_p90_s": _q(errs, 0.9),
        "rel_err_median": statistics.median(rel) if rel else None,
        "rel_err_p90": _q(rel, 0.9),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seed-burst", choices=sorted(_DEFAULTS))
    ap.add_argument("--loads", default="1,2")
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--target", type=float, default=5.0, help="the workload's TTFT target (s)")
    ap.add_argument("--deadline-factor", type=float, default=1.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    DEADLINE_S[0] = args.target * args.deadline_factor
    out = [evaluate(args.workload, float(x), args.seed, args.deadline_factor) for x in args.loads.split(",")]
    for r in out:
        print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
