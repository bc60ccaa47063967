"""Where zp-elastic's goodput goes against no-admission's: a breakdown from per-request records and the
server's timeline, on the virtual clock (every run below is exactly reproducible from its seed).

Not a test. For one workload and offered load it runs, in virtual time:

* ``no-admission``, ``zp-elastic`` and ``zp-oracle`` with the library defaults, and
* ``zp-elastic`` and ``zp-oracle`` again with the headroom at 1.0 (no reserve: the whole usable pool),

and prints

1. the counterfactual ladder of goodput (good requests per virtual second of makespan):
   no-admission -> zp-oracle at headroom 1.0 (what admitting by a projected peak costs with perfect
   forecasts and no reserve: the line itself and its ordering) -> zp-oracle at the default headroom
   (the reserve) -> zp-elastic (forecast error);
2. for zp-elastic: how goodput splits into requests within the SLO and makespan against no-admission;
   the requests that met the SLO without admission and missed it with zp, and why (TTFT or TPOT);
3. the time requests spent in zp's line (client submit to the server's first arrival of the request,
   joined by ``X-Request-Id``), and how much of it passed while the server had room for the request's
   prompt (free blocks >= its prompt's blocks; vLLM admits on that), i.e. line wait the server could
   have absorbed at that moment.

    .venv/bin/python benchmarks/gap_breakdown.py --workload seed-burst --load-scale 2
    .venv/bin/python benchmarks/gap_breakdown.py --workload agentic --load-scale 1.5 --json /tmp/gap.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zp_storm.cli import _DEFAULTS  # noqa: E402
from zp_storm.report import compute_metrics  # noqa: E402
from zp_storm.runner import SetupRun, StormConfig, run_storm  # noqa: E402
from zp_storm.tuning import ElasticTuning  # noqa: E402


def _storm(cfg: StormConfig, setups: list[str]) -> tuple[Any, Any, dict[str, SetupRun]]:
    wl, facts, runs = run_storm(replace(cfg, setups=setups))
    return wl, facts, {r.name: r for r in runs}


def _line_waits(run: SetupRun, facts: Any) -> dict[str, float]:
    """Per logical request: virtual seconds in zp's line before the server first saw it, and the part of
    that wait during which the server had free blocks for its prompt."""
    t0 = run.t0
    arrivals: dict[str, float] = {}
    for s in run.server_stats.get("requests", []):
        rid = str(s["id"]).removeprefix("chatcmpl-")
        a = float(s["arrival_s"]) - t0
        arrivals[rid] = min(a, arrivals.get(rid, math.inf))
    times = [t - t0 for t, *_ in run.timeline]
    usable = facts.num_gpu_blocks - 1
    free = [usable * (1.0 - kv) for _, kv, *_ in run.timeline]
    total = with_room = 0.0
    waited = 0
    for rec in run.records:
        if not rec.sent or rec.t_submit is None or rec.id not in arrivals:
            continue
        a, b = rec.t_submit, arrivals[rec.id]
        if b <= a:
            continue
        waited += 1
        total += b - a
        need = math.ceil(rec.prompt_tokens / facts.block_size)
        # the timeline is per engine step: free blocks hold from one sample to the next
        i = max(0, bisect.bisect_right(times, a) - 1)
        t = a
        while t < b and i < len(times):
            nxt = times[i + 1] if i + 1 < len(times) else b
            seg_end = min(b, nxt)
            if seg_end > t and free[i] >= need:
                with_room += seg_end - t
            t = max(t, seg_end)
            i += 1
    return {"requests_waited": waited, "wait_s": total, "wait_with_room_s": with_room}


def _good_ids(run: SetupRun, wl: Any) -> dict[str, str]:
    """Per sent request: "good", "ttft" / "tpot" / "e2e" (the SLO part it missed) or "failed"."""
    out = {}
    for r in run.records:
        if not r.sent:
            continue
        if not r.ok:
            out[r.id] = "failed"
        elif wl.slo.met(r.ttft, r.tpot, streamed=r.stream, out_tokens=r.out_tokens,
                        e2e=None if r.t_end is None or r.t_submit is None else r.t_end - r.t_submit):
            out[r.id] = "good"
        elif not r.stream:
            out[r.id] = "e2e"
        elif r.ttft is not None and r.ttft > wl.slo.ttft_s:
            out[r.id] = "ttft"
        else:
            out[r.id] = "tpot"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seed-burst", choices=sorted(_DEFAULTS))
    ap.add_argument("--load-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()
    profile, blocks, mml, _ = _DEFAULTS[args.workload]
    cfg = StormConfig(workload=args.workload, seed=args.seed, profile=profile, num_gpu_blocks=blocks,
                      max_model_len=mml, load_scale=args.load_scale)
    wl, facts, base = _storm(cfg, ["no-admission", "zp-elastic", "zp-oracle"])
    _, _, full = _storm(replace(cfg, elastic=ElasticTuning(headroom=1.0)), ["zp-elastic", "zp-oracle"])
    m = {k: compute_metrics(v, wl, facts, 1.0) for k, v in base.items()}
    m.update({f"{k}@1.0": compute_metrics(v, wl, facts, 1.0) for k, v in full.items()})
    na = m["no-admission"]

    def ratio(k: str) -> float:
        return (m[k]["goodput_rps"] or 0.0) / na["goodput_rps"] if na["goodput_rps"] else float("nan")

    print(f"workload {args.workload}, load {args.load_scale:g}x, seed {args.seed} (virtual clock)")
    print("\n1. goodput ladder (vs no-admission)")
    for k, label in (("no-admission", "no-admission"),
                     ("zp-oracle@1.0", "zp-oracle, headroom 1.0 (line + ordering)"),
                     ("zp-oracle", "zp-oracle, default headroom (+ the reserve)"),
                     ("zp-elastic", "zp-elastic (+ forecast error)"),
                     ("zp-elastic@1.0", "zp-elastic, headroom 1.0 (for reference)")):
        x = m[k]
        print(f"   {label:46s} {x['goodput_rps']:.3f} req/s = {ratio(k):.3f}x   good {x['good']:4d}/{x['sent']}"
              f"  makespan {x['makespan']:.1f} s  preemptions {x['preemptions']}  TTFT p50 {x['ttft_p50']}"
              f" p99 {x['ttft_p99']}")
    ze = m["zp-elastic"]
    good_ratio = ze["good"] / na["good"] if na["good"] else float("nan")
    span_ratio = na["makespan"] / ze["makespan"] if ze["makespan"] else float("nan")
    print(f"\n2. zp-elastic goodput {ratio('zp-elastic'):.3f}x = good requests {good_ratio:.3f}x "
          f"x (1 / makespan) {span_ratio:.3f}x")
    a, b = _good_ids(base["no-admission"], wl), _good_ids(base["zp-elastic"], wl)
    lost = [i for i, v in a.items() if v == "good" and b.get(i) != "good"]
    won = [i for i, v in b.items() if v == "good" and a.get(i) != "good"]
    why: dict[str, int] = {}
    for i in lost:
        why[b.get(i, "unsent")] = why.get(b.get(i, "unsent"), 0) + 1
    print(f"   met the SLO without admission but not with zp-elastic: {len(lost)} (missed: {why}); "
          f"the reverse: {len(won)}")
    waits = {k: _line_waits(v, facts) for k, v in (("zp-elastic", base["zp-elastic"]),
                                                    ("zp-oracle", base["zp-oracle"]),
                                                    ("zp-oracle@1.0", full["zp-oracle"]))}
    na_wait = _line_waits(base["no-admission"], facts)
    print("\n3. time in zp's line (client submit -> the server's first arrival of the request)")
    for k, w in (("no-admission", na_wait), *waits.items()):
        share = w["wait_with_room_s"] / w["wait_s"] if w["wait_s"] else 0.0
        print(f"   {k:16s} {w['requests_waited']:4d} requests waited {w['wait_s']:8.1f} s in all; "
              f"{w['wait_with_room_s']:8.1f} s ({share:.0%}) of it while the server had room for the prompt")
    if args.json:
        Path(args.json).write_text(json.dumps({"metrics": m, "waits": waits, "lost": lost, "why": why},
                                              indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
