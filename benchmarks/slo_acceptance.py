"""Issue 30's acceptance grid for the SLO-aware line, one table per criterion with PASS / FAIL per row.

Not a test. Runs ``zp-client storm``'s own code (:func:`~zp_storm.runner.run_storm`, the CLI's
per-workload server defaults) one setup at a time, each point ``(workload, seed, load, setup)`` in its
own process, and caches every point's metrics as JSON, so a line change reruns only the zp rows:

* the baselines (``no-admission``, ``naive``, ``vllm-priority``, ``vllm-queue-cap``) do not touch the
  client's budget: they are cached once under ``CACHE/base``;
* the zp rows (``zp-slo``, ``zp-elastic``, ``zp-oracle-h1``, ``zp-oracle-slo``) are cached under
  ``CACHE/TAG`` (``--tag``: one tag per code state, e.g. ``before`` and ``after``); ``--link
  SETUP=TAG`` reads a setup's rows from another tag (a change that cannot move them);
  ``--fifo-tag TAG`` names the code state whose FIFO ``zp-elastic`` is "today's" (the default must
  lose nothing against it at 0.5x and 1x).

A point's records depend only on the seed, the workload, the load and the setup (the virtual clock), so
each point equals the same setup's row of ``zp-client storm --workload W --load-scale X --seed S
--setups ...``. Medians are over ``--seeds`` (held out: 4-6; seeds 0-3 are for tuning)::

    nice -n 5 python benchmarks/slo_acceptance.py --tag after --seeds 4,5,6 --jobs 2
    python benchmarks/slo_acceptance.py --tag after --seeds 4,5,6 --report-only

The criteria (issue 30, "Acceptance"): binding in-SLO vs the best baseline (median); 0 failed and 0
preemptions (every seed and load); stretch (1.3x the best at 2x / 4x, 0.9x ``zp-oracle-slo``); late
requests' TTFT p99 / max <= 1.5x FIFO ``zp-elastic``'s and conversation time p50 / p99 <= 1.1x FIFO's
(every seed); makespan <= 1.03x no-admission's (every seed); at 1x the default >= 0.97x
``zp-oracle-h1`` (median) and at 0.5x / 1x the default >= today's FIFO ``zp-elastic`` (every seed);
``mixed`` 2x interactive >= 95% and every batch request complete (every seed). Fail-fast and the
Redis real-clock line are measured elsewhere (benchmarks/failfast_eval.py, docs/benchmark.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASELINES = ("no-admission", "naive", "vllm-priority", "vllm-queue-cap")
ZP = ("zp-slo", "zp-elastic", "zp-oracle-h1", "zp-oracle-slo")
LOADS = {"seed-burst": (0.5, 1.0, 2.0, 4.0), "agentic": (0.5, 1.0, 2.0, 4.0), "mixed": (1.0, 2.0, 4.0)}
KEEP = ("in_slo", "late", "failed", "requests", "preemptions", "late_ttft_p99", "late_ttft_max", "makespan",
        "conversations", "conversations_completed", "conversation_time_p50", "conversation_time_p99",
        "errors", "unsent", "gateway_504", "rejected_503", "valid")


def _path(cache: Path, tag: str, wl: str, seed: int, load: float, setup: str) -> Path:
    return cache / tag / f"{wl}-s{seed}-x{load:g}-{setup}.json"


def run_point(wl: str, seed: int, load: float, setup: str, out: str) -> tuple[str, float]:
    """Run one setup of one storm and write its slim metrics to ``out``; returns (out, wall seconds)."""
    import logging

    from zp_storm.cli import _DEFAULTS
    from zp_storm.report import compute_metrics
    from zp_storm.runner import StormConfig, run_storm

    logging.getLogger("zp_sim.server").setLevel(logging.ERROR)
    profile, blocks, mml, speedup = _DEFAULTS[wl]
    cfg = StormConfig(workload=wl, seed=seed, setups=[setup], profile=profile, num_gpu_blocks=blocks,
                      max_model_len=mml, speedup=speedup, load_scale=load)
    t = time.monotonic()
    w, facts, runs = run_storm(cfg)
    m = compute_metrics(runs[0], w, facts, cfg.speedup)
    slim = {k: m.get(k) for k in KEEP}
    slim["classes"] = {n: {k: c.get(k) for k in ("in_slo", "late", "failed", "sent", "requests",
                                                   "slo_attainment")}
                       for n, c in (m.get("classes") or {}).items()}
    slim["wall_s"] = round(time.monotonic() - t, 1)
    p = Path(out)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(slim))
    tmp.replace(p)
    return out, slim["wall_s"]


def _tag_of(setup: str, args: argparse.Namespace) -> str:
    if setup in BASELINES:
        return "base"
    return dict(args.link).get(setup, args.tag)


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None and b is None:
        return None
    if not b:
        return float("inf") if a else None
    return (a or 0.0) / b


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


class Grid:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache = Path(args.cache)

    def get(self, wl: str, seed: int, load: float, setup: str,
            tag: str | None = None) -> dict[str, Any] | None:
        p = _path(self.cache, tag or _tag_of(setup, self.args), wl, seed, load, setup)
        return json.loads(p.read_text()) if p.exists() else None

    def best_baseline(self, wl: str, seed: int, load: float) -> tuple[int | None, str]:
        rows = [(self.get(wl, seed, load, b), b) for b in BASELINES]
        have = [(r["in_slo"], b) for r, b in rows if r]
        if not have:
            return None, "-"
        best = max(v for v, _ in have)
        return best, "=".join(b for v, b in have if v == best) + ("" if len(have) == 4 else " (partial)")


def _table(title: str, head: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def report(args: argparse.Namespace) -> int:
    g = Grid(args)
    seeds: list[int] = args.seeds
    fails = 0

    def verdict(ok: bool | None) -> str:
        nonlocal fails
        if ok is None:
            return "n/a"
        if not ok:
            fails += 1
        return "PASS" if ok else "**FAIL**"

    def partial(ok: bool, missing: bool) -> str:
        """A criterion over every seed: FAIL on any failing seed, else n/a while a seed is missing."""
        return verdict(ok) if not ok or not missing else "n/a (partial)"

    pts = [(wl, x) for wl in args.workloads for x in LOADS[wl] if x in args.loads]
    # 1. binding: zp-slo in SLO >= best baseline (median of seeds)
    rows = []
    for wl, x in pts:
        slo = [g.get(wl, s, x, "zp-slo") for s in seeds]
        best = [g.best_baseline(wl, s, x) for s in seeds]
        if any(r is None for r in slo) or any(b[0] is None for b in best):
            ran = sum(r is not None for r in slo)
            rows.append([wl, f"{x:g}x", "not run" if not ran else f"zp-slo on {ran} seeds, a seed's "
                         "baselines not run", "", "n/a"])
            continue
        a = _med([r["in_slo"] for r in slo])  # type: ignore[index]
        b = _med([float(v) for v, _ in best])  # type: ignore[misc]
        per = ", ".join(f"s{s}: {r['in_slo']} / {r['requests']} vs {v} ({n})"  # type: ignore[index]
                        for s, r, (v, n) in zip(seeds, slo, best, strict=True))
        rows.append([wl, f"{x:g}x", f"{a:g} vs {b:g} ({a / b:.2f}x)", per, verdict(a >= b)])
    _table("binding: zp-slo in SLO >= best of no-admission / naive / vllm-priority / vllm-queue-cap "
           "(median of seeds " + ",".join(map(str, seeds)) + "; '(partial)': not every baseline ran)",
           ["workload", "load", "median zp-slo vs best", "per seed: zp-slo / requests vs best (who)",
            "verdict"], rows)
    # 2. zeros, every seed and load
    rows = []
    for wl, x in pts:
        cells, ok, missing = [], True, False
        if all(g.get(wl, s, x, "zp-slo") is None for s in seeds):
            rows.append([wl, f"{x:g}x", "not run", "", "n/a"])
            continue
        for s in seeds:
            r = g.get(wl, s, x, "zp-slo")
            if r is None:
                cells.append(f"s{s}: missing")
                missing = True
                continue
            cells.append(f"s{s}: {r['failed']} / {r['preemptions']}")
            ok = ok and r["failed"] == 0 and r["preemptions"] == 0
        fifo = [g.get(wl, s, x, "zp-elastic") for s in seeds]
        fcell = ", ".join(f"{r['failed']} / {r['preemptions']}" if r else "-" for r in fifo)
        rows.append([wl, f"{x:g}x", ", ".join(cells), fcell, partial(ok, missing)])
    _table("binding: zp-slo 0 failed / 0 preemptions on every seed", ["workload", "load",
           "zp-slo failed / preempt", "zp-elastic (default) failed / preempt", "verdict"], rows)
    # 3. stretch
    rows = []
    for wl, x in pts:
        slo = [g.get(wl, s, x, "zp-slo") for s in seeds]
        ora = [g.get(wl, s, x, "zp-oracle-slo") for s in seeds]
        best = [g.best_baseline(wl, s, x)[0] for s in seeds]
        if any(r is None for r in slo) or any(b is None for b in best):
            continue
        a = _med([r["in_slo"] for r in slo])  # type: ignore[index]
        b = _med([float(v) for v in best])  # type: ignore[arg-type]
        r13 = verdict(a >= 1.3 * b) if x >= 2 else "n/a"
        if all(o is not None for o in ora):
            o = _med([r["in_slo"] for r in ora])  # type: ignore[index]
            oc, ov = f"{a:g} vs {o:g} ({a / o:.2f}x)", verdict(a >= 0.9 * o)
        else:
            oc, ov = "missing", "n/a"
        rows.append([wl, f"{x:g}x", f"{a / b:.2f}x", r13, oc, ov])
    _table("stretch (not blocking): >= 1.3x best at 2x / 4x; >= 0.9x zp-oracle-slo (medians)",
           ["workload", "load", "x best", ">= 1.3x", "zp-slo vs zp-oracle-slo", ">= 0.9x"], rows)
    # 4. late tail and conversations vs FIFO zp-elastic, every seed
    rows = []
    for wl, x in pts:
        cells, ok, missing = [], True, False
        conv_cells, conv_ok = [], None
        if all(g.get(wl, s, x, "zp-slo") is None for s in seeds):
            continue
        if all(g.get(wl, s, x, "zp-elastic") is None for s in seeds):
            rows.append([wl, f"{x:g}x", "FIFO zp-elastic not run", "n/a", "-", "n/a"])
            continue
        for s in seeds:
            a, f = g.get(wl, s, x, "zp-slo"), g.get(wl, s, x, "zp-elastic")
            if a is None or f is None:
                cells.append(f"s{s}: missing")
                missing = True
                continue
            r99 = _ratio(a["late_ttft_p99"], f["late_ttft_p99"])
            rmax = _ratio(a["late_ttft_max"], f["late_ttft_max"])
            cells.append(f"s{s}: {_fmt(a['late_ttft_p99'])} / {_fmt(a['late_ttft_max'])} vs "
                         f"{_fmt(f['late_ttft_p99'])} / {_fmt(f['late_ttft_max'])} "
                         f"({_fmt(r99, 2)}x / {_fmt(rmax, 2)}x)")
            ok = ok and (r99 is None or r99 <= 1.5) and (rmax is None or rmax <= 1.5)
            if a.get("conversation_time_p50") is not None and f.get("conversation_time_p50"):
                c50 = a["conversation_time_p50"] / f["conversation_time_p50"]
                c99 = a["conversation_time_p99"] / f["conversation_time_p99"]
                conv_cells.append(f"s{s}: {c50:.2f}x / {c99:.2f}x")
                conv_ok = (conv_ok is not False) and c50 <= 1.1 and c99 <= 1.1
        rows.append([wl, f"{x:g}x", "; ".join(cells), partial(ok, missing), ", ".join(conv_cells) or "-",
                     verdict(conv_ok)])
    _table("late requests: zp-slo late TTFT p99 / max <= 1.5x FIFO zp-elastic's; conversation time "
           "p50 / p99 <= 1.1x FIFO's (every seed)", ["workload", "load", "late TTFT p99 / max s (x FIFO)",
                                                      "tail", "conv time p50 / p99 x FIFO", "conv"], rows)
    # 5. makespan
    rows = []
    for wl, x in pts:
        cells, ok, missing = [], True, False
        if all(g.get(wl, s, x, "zp-slo") is None for s in seeds):
            continue
        for s in seeds:
            a, n = g.get(wl, s, x, "zp-slo"), g.get(wl, s, x, "no-admission")
            if a is None or n is None:
                cells.append(f"s{s}: missing")
                missing = True
                continue
            r = a["makespan"] / n["makespan"]
            cells.append(f"s{s}: {a['makespan']:.1f} / {n['makespan']:.1f} = {r:.3f}x")
            ok = ok and r <= 1.03
        rows.append([wl, f"{x:g}x", "; ".join(cells), partial(ok, missing)])
    _table("makespan: zp-slo <= 1.03x no-admission's (every seed)", ["workload", "load",
           "zp-slo / no-admission", "verdict"], rows)
    # 6. the default (no targets)
    rows = []
    for wl, x in pts:
        if x > 1:
            continue
        d = [g.get(wl, s, x, "zp-elastic") for s in seeds]
        if any(r is None for r in d):
            continue
        if x == 1 and wl in ("seed-burst", "agentic"):
            o = [g.get(wl, s, x, "zp-oracle-h1") for s in seeds]
            if all(r is not None for r in o):
                a, b = _med([r["in_slo"] for r in d]), _med([r["in_slo"] for r in o])  # type: ignore[index]
                rows.append([wl, f"{x:g}x", "default >= 0.97x zp-oracle-h1 (median)",
                             f"{a:g} vs {b:g} ({a / b:.3f}x)", verdict(a >= 0.97 * b)])
        if args.fifo_tag:
            t = [g.get(wl, s, x, "zp-elastic", args.fifo_tag) for s in seeds]
            if all(r is not None for r in t):
                cells = [f"s{s}: {r['in_slo']} vs {q['in_slo']}" for s, r, q in zip(seeds, d, t, strict=True)]  # type: ignore[index]
                ok = all(r["in_slo"] >= q["in_slo"] for r, q in zip(d, t, strict=True))  # type: ignore[index]
                rows.append([wl, f"{x:g}x", f"default >= today's FIFO zp-elastic ({args.fifo_tag}), "
                             "every seed",
                             ", ".join(cells), verdict(ok)])
    _table("the default (no targets sent)", ["workload", "load", "criterion", "numbers", "verdict"], rows)
    # 7. mixed 2x classes
    rows = []
    if "mixed" in args.workloads and 2.0 in args.loads:
        for s in seeds:
            r = g.get("mixed", s, 2.0, "zp-slo")
            if r is None:
                continue
            i, b = r["classes"]["interactive"], r["classes"]["batch"]
            share = i["in_slo"] / i["requests"]
            rows.append([f"seed {s}", f"{i['in_slo']} / {i['requests']} = {share:.1%}",
                         f"{b['failed']} failed of {b['requests']}",
                         verdict(share >= 0.95 and b["failed"] == 0)])
    _table("mixed 2x: interactive >= 95% within target; every batch request completes (every seed)",
           ["seed", "zp-slo interactive in SLO", "batch", "verdict"], rows)
    print(f"\n{fails} FAIL rows")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(ROOT / ".slo-acceptance"),
                    help="point cache (default .slo-acceptance)")
    ap.add_argument("--tag", default="current", help="code state the zp rows are cached under")
    ap.add_argument("--link", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
                    metavar="SETUP=TAG", help="read SETUP's rows from TAG (repeatable)")
    ap.add_argument("--fifo-tag", default=None, help="tag whose zp-elastic is today's FIFO default")
    ap.add_argument("--seeds", default="4,5,6", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--workloads", default="seed-burst,agentic,mixed", type=lambda s: s.split(","))
    ap.add_argument("--loads", default="0.5,1,2,4", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--setups", default=",".join(ZP + BASELINES), type=lambda s: s.split(","))
    ap.add_argument("--jobs", type=int, default=1, help="points run in parallel (processes)")
    ap.add_argument("--rerun", action="store_true", help="rerun the zp points of --tag even if cached")
    ap.add_argument("--report-only", action="store_true", help="print the tables from the cache only")
    args = ap.parse_args()
    if not args.report_only:
        todo = []
        for wl in args.workloads:
            for x in LOADS[wl]:
                if x not in args.loads:
                    continue
                for s in args.seeds:
                    for setup in args.setups:
                        tag = _tag_of(setup, args)
                        if tag != args.tag and setup not in BASELINES:
                            continue  # linked: read, never run
                        p = _path(Path(args.cache), tag, wl, s, x, setup)
                        if p.exists() and not (args.rerun and setup not in BASELINES):
                            continue
                        todo.append((wl, s, x, setup, str(p)))
        # in --setups order (the binding rows first), the largest points first within a setup
        todo.sort(key=lambda t: (args.setups.index(t[3]), -t[2] * (3 if t[0] == "mixed" else 1)))
        print(f"{len(todo)} points to run, {args.jobs} at a time", file=sys.stderr)
        t0 = time.monotonic()
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futs = {pool.submit(run_point, *t): t for t in todo}
            for i, f in enumerate(as_completed(futs), 1):
                wl, s, x, setup, _ = futs[f]
                try:
                    _, wall = f.result()
                    print(f"[{i}/{len(todo)} {time.monotonic() - t0:.0f}s] {wl} s{s} {x:g}x {setup}: "
                          f"{wall:.0f}s", file=sys.stderr, flush=True)
                except Exception as exc:  # noqa: BLE001 - report and go on with the grid
                    print(f"[{i}/{len(todo)}] {wl} s{s} {x:g}x {setup}: FAILED {exc!r}", file=sys.stderr)
    return report(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
