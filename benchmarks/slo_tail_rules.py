"""Issue 30's late tail: candidate SLO-line rules, measured in the storm (not a test, not the library).

The SLO-aware line (``zp_client.budget.ledger.slo_walk``) puts a waiter whose deadline has passed behind
every waiter of its class that can still make its target, until it has waited ``late_bound_s`` (60 s).
That wins in-SLO counts at 2x-4x and makes the few late requests at 1x wait longer than FIFO's
(docs/benchmark.md, "The late tail: candidate rules"). This script runs ``zp-slo`` with the line's walk
replaced, in the worker process only, by one candidate rule, so a rule can be measured before anything
is ported to the Lua script:

* ``main``: the line as it is.
* ``grace:G``: a waiter becomes late-bound (tried first, in line order; a barrier) ``G`` seconds after
  its deadline, as well as after ``late_bound_s``.
* ``grace:G:blocks:F``: ``grace:G`` only while the class's waiters hold at most ``F`` x the limit in
  bounds (the line is "transient"); otherwise the line as it is.
* ``grace:G:missed:F``: ``grace:G`` only while the class's *missed* waiters hold at most ``F`` x the
  limit in bounds.
* ``grace:G:count:N``: ``grace:G`` only while the class has at most ``N`` missed waiters.
* ``urgent:S``: waiters whose deadline is more than ``S`` seconds ahead go behind the missed and
  untargeted ones (EDF only for the waiters close to their deadline).
* ``share:PHI``: while the leases granted to waiters already past their deadline ("missed") hold less
  than ``PHI`` x the limit in bounds, the class's missed waiters are tried first, in line order (so the
  oldest is a barrier, as any waiter past the starvation bound); otherwise the line as it is.
* ``interleave:N``: after ``N`` on-time grants of a class while one of its missed waiters waits, its
  missed waiters are tried first (line order) until one is granted.
* ``ileaveb:F``: ``interleave`` counted in blocks: after on-time grants of ``F`` x the limit.
* ``both:N:PHI``: ``interleave:N`` or ``share:PHI``.
* ``duo:G:PHI``: the missed waiters first while the oldest fits in ``PHI`` x the limit beside the live
  late-granted leases; else ``interleave:1`` over the waiters missed by at least ``G`` s.
* options, appended to the stateful rules above: ``:count:N`` (act only while the class has at most ``N``
  missed waiters), ``:after:G`` (a waiter counts as missed ``G`` s past its deadline), ``:afterf:F``
  (plus ``F`` s x its bound / the limit).
* ``soft:G``: the missed waiters first, in line order, but a missed waiter is a barrier only ``G`` s past
  its deadline (``inf``: never before ``late_bound_s``).
* ``ttft-only``: the app sends only the TTFT target (no ``X-ZP-TPOT-Target``, as before the allowance
  was measured; with ``Settings.answer_allowance`` off, ``main``'s records).
* ``answer:F``: ``Settings.answer_allowance`` on (``ZP_ANSWER_ALLOWANCE=1`` in the worker), and a
  non-streamed call's deadline gets ``F`` x its answer allowance (forecast output x TPOT target);
  ``F`` < 1 stands for subtracting the answer's own decode time when the server decodes at
  ``(1 - F)`` x the TPOT target per token.

Each point ``(workload, seed, load, rule)`` runs in its own process (``slo_acceptance.run_point``, the
storm's own code) and is cached as ``CACHE/rule-<rule>/<workload>-s<seed>-x<load>-zp-slo.json``; the
FIFO and baseline rows are ``slo_acceptance.py``'s (``--tag``)::

    nice -n 5 python benchmarks/slo_tail_rules.py --cache DIR --rules main,grace:2:count:10 \\
        --workloads seed-burst --seeds 0,1,2 --loads 1,2 --jobs 2
    python benchmarks/slo_tail_rules.py --cache DIR --rules main,grace:2:count:10 --report-only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

BASELINES = ("no-admission", "naive", "vllm-priority", "vllm-queue-cap")


def _install(rule: str) -> None:
    """Replace the ledger's SLO walk by ``rule`` in this process."""
    from zp_client.budget import ledger as L

    if rule == "main":
        return
    parts = rule.split(":")
    if parts[0] == "ttft-only":  # the app sends no TPOT target: no answer allowance (the line before it)
        import zp_storm.slo_setups as S

        S.SEND_TPOT = False
        return
    if parts[0] == "answer":  # a non-streamed call's deadline gets F x its answer allowance
        os.environ["ZP_ANSWER_ALLOWANCE"] = "1"  # Settings.answer_allowance, opt-in
        frac = float(parts[1])
        orig_deadline = L.line_deadline

        def line_deadline(meta: Any, now: float) -> float | None:
            if meta and meta.get(L.ANSWER_KEY) is not None:
                meta = {**meta, L.ANSWER_KEY: frac * meta[L.ANSWER_KEY]}
            return orig_deadline(meta, now)

        L.line_deadline = line_deadline
        return
    orig_walk = L.slo_walk
    limit = {"v": 0}
    orig_grant = L.Ledger.grant

    def grant(self: Any, now: float) -> list[str]:
        limit["v"] = self.limit
        return orig_grant(self, now)

    L.Ledger.grant = grant  # type: ignore[method-assign]

    def missed(ws: Sequence[Any], now: float) -> list[Any]:
        return [w for w in ws if w.deadline is not None and w.deadline <= now]

    if parts[0] == "grace":
        grace = float(parts[1])
        mode, k = (parts[2], float(parts[3])) if len(parts) > 2 else ("always", 0.0)

        def walk(ws: Sequence[Any], now: float, late_bound_s: float) -> list[int] | None:
            if mode == "blocks":
                on = sum(w.bound for w in ws) <= k * limit["v"]
            elif mode == "missed":
                on = sum(w.bound for w in missed(ws, now)) <= k * limit["v"]
            elif mode == "count":
                on = len(missed(ws, now)) <= k
            else:
                on = True
            if not on:
                return orig_walk(ws, now, late_bound_s)
            old: list[int] = []
            edf: list[int] = []
            rest: list[int] = []
            for i, w in enumerate(ws):
                if now - w.since >= late_bound_s or (w.deadline is not None and now - w.deadline >= grace):
                    old.append(i)
                elif w.deadline is not None and w.deadline > now:
                    edf.append(i)
                else:
                    rest.append(i)
            if not edf:
                return None
            edf.sort(key=lambda i: (ws[i].deadline, i))
            return old + edf + rest

    elif parts[0] == "urgent":
        window = float(parts[1])

        def walk(ws: Sequence[Any], now: float, late_bound_s: float) -> list[int] | None:
            order = orig_walk(ws, now, late_bound_s)
            if order is None:
                return None
            lax = [i for i in order if now - ws[i].since < late_bound_s and ws[i].deadline is not None
                   and ws[i].deadline > now + window]
            drop = set(lax)
            return [i for i in order if i not in drop] + lax

    elif parts[0] in ("share", "interleave", "ileaveb", "both", "duo"):
        # stateful rules: the ledger of the pass (grant) and its admissions (_admit) are watched
        k = float(parts[1])
        tail = parts[3:] if parts[0] == "duo" else parts[2:]
        opt = dict(zip(tail[::2], tail[1::2], strict=True))
        cap = float(opt.get("count", "inf"))  # the rule acts only while the class has <= cap missed waiters
        after = float(opt.get("after", 0.0))  # a waiter counts as missed `after` s past its deadline
        frac = float(opt.get("afterf", 0.0))  # ... plus frac s x its share of the limit (bound / limit)
        if parts[0] == "duo":  # duo:G:PHI: share:PHI over every missed waiter, else interleave:1:after:G
            after, k = k, 1.0
        st: dict[str, Any] = {"led": None, "late": set(), "c": 0, "cb": 0}
        orig_admit = L.Ledger._admit

        def missed_by(w: Any, now: float, limit: int, late_bound_s: float, grace: float) -> bool:
            return (now - w.since < late_bound_s and w.deadline is not None
                    and w.deadline + grace + frac * w.bound / max(limit, 1) <= now)

        def grant2(self: Any, now: float) -> list[str]:
            st["led"] = self
            return grant(self, now)

        def _admit(self: Any, w: Any, now: float) -> None:
            if w.deadline is not None and w.deadline <= now:
                st["late"].add(w.id)
                st["c"] = st["cb"] = 0
            elif any(o.priority == w.priority and o.id != w.id
                     and missed_by(o, now, self.limit, self._late_bound, after)
                     for o in self._waiters.values()):
                st["c"] += 1  # an on-time grant while a missed waiter of its class waits
                st["cb"] += w.bound
            orig_admit(self, w, now)

        L.Ledger.grant = grant2  # type: ignore[method-assign]
        L.Ledger._admit = _admit  # type: ignore[method-assign]

        def walk(ws: Sequence[Any], now: float, late_bound_s: float) -> list[int] | None:
            order = orig_walk(ws, now, late_bound_s)
            if order is None:
                return None
            led = st["led"]
            leases = led._leases
            st["late"] = {i for i in st["late"] if i in leases}
            live = sum(leases[i].bound for i in st["late"])  # bounds of live leases granted while missed
            old = [i for i in range(len(ws)) if now - ws[i].since >= late_bound_s]
            if parts[0] == "duo":
                missa = [i for i in range(len(ws)) if missed_by(ws[i], now, led.limit, late_bound_s, 0.0)]
                if len(missa) > cap:
                    return order
                if missa and live + ws[missa[0]].bound <= float(parts[2]) * led.limit:
                    seen = set(old + missa)
                    return old + missa + [i for i in order if i not in seen]
            miss = [i for i in range(len(ws)) if missed_by(ws[i], now, led.limit, late_bound_s, after)]
            if not miss or len(miss) > cap:
                return order
            if parts[0] == "both":  # both:N:PHI: interleave:N or share:PHI
                on = st["c"] >= k or live < float(parts[2]) * led.limit
            elif parts[0] == "share":
                on = live < k * led.limit
            elif parts[0] == "ileaveb":
                on = st["cb"] >= k * led.limit
            else:  # interleave and duo
                on = st["c"] >= k
            if not on:
                return order
            seen = set(old + miss)
            return old + miss + [i for i in order if i not in seen]
    elif parts[0] == "soft":
        # missed waiters first, in line order, but a missed waiter is a barrier only G s after its
        # deadline (or once late-bound); the on-time ones keep the starvation-bound barrier rule
        import inspect
        import textwrap

        g = float(parts[1])
        cap = float(parts[3]) if len(parts) > 3 and parts[2] == "count" else float("inf")
        src = textwrap.dedent(inspect.getsource(orig_grant))
        line = "elif now - w.since >= bound_s:"
        assert src.count(line) == 1
        src = src.replace(line, "elif now - w.since >= bound_s and _tail_barrier(w, now, self._late_bound):")
        ns = dict(vars(L))

        def _tail_barrier(w: Any, now: float, late_bound_s: float) -> bool:
            if w.deadline is None or w.deadline > now or now - w.since >= late_bound_s:
                return True
            return bool(now - w.deadline >= g)

        ns["_tail_barrier"] = _tail_barrier
        exec(compile(src, "<soft grant>", "exec"), ns)
        L.Ledger.grant = ns["grant"]  # type: ignore[method-assign]

        def walk(ws: Sequence[Any], now: float, late_bound_s: float) -> list[int] | None:
            order = orig_walk(ws, now, late_bound_s)
            if order is None:
                return None
            miss = [i for i in range(len(ws)) if now - ws[i].since < late_bound_s
                    and ws[i].deadline is not None and ws[i].deadline <= now]
            if (not miss and parts[0] != "duo") or len(miss) > cap:
                return order
            first = [i for i in range(len(ws)) if now - ws[i].since >= late_bound_s] + miss
            seen = set(first)
            return first + [i for i in order if i not in seen]

        ns["slo_walk"] = walk  # the copied grant reads the walk from its own namespace

    else:
        raise SystemExit(f"unknown rule {rule!r}")
    L.slo_walk = walk


def run(wl: str, seed: int, load: float, rule: str, out: str, setup: str = "zp-slo") -> tuple[str, float]:
    _install(rule)
    from slo_acceptance import run_point

    return run_point(wl, seed, load, setup, out)


def _path(cache: Path, rule: str, wl: str, seed: int, load: float, setup: str = "zp-slo") -> Path:
    return cache / f"rule-{rule.replace(':', '_')}" / f"{wl}-s{seed}-x{load:g}-{setup}.json"


def _get(p: Path) -> dict[str, Any] | None:
    return json.loads(p.read_text()) if p.exists() else None


def report(args: argparse.Namespace) -> None:
    cache = Path(args.cache)
    print("| workload, load, seed | best baseline | FIFO zp-elastic in SLO / late, late TTFT p99 / max | "
          + " | ".join(args.rules) + " |")
    print("|---" * (3 + len(args.rules)) + "|")
    for wl in args.workloads:
        for x in args.loads:
            for s in args.seeds:
                fifo = _get(cache / args.tag / f"{wl}-s{s}-x{x:g}-zp-elastic.json")
                bases = [(r["in_slo"], b) for b in BASELINES
                         if (r := _get(cache / "base" / f"{wl}-s{s}-x{x:g}-{b}.json"))]
                best = max(bases)[0] if bases else None
                cells = []
                for rule in args.rules:
                    r = _get(_path(cache, rule, wl, s, x, args.setup))
                    if r is None:
                        cells.append("-")
                        continue
                    cell = (f"{r['in_slo']} / {r['late']}, {r['late_ttft_p99'] or 0:.1f} / "
                            f"{r['late_ttft_max'] or 0:.1f}")
                    if fifo and fifo.get("late_ttft_max"):
                        rm = max((r["late_ttft_p99"] or 0) / fifo["late_ttft_p99"],
                                 (r["late_ttft_max"] or 0) / fifo["late_ttft_max"])
                        cell += f" ({rm:.2f}x)" if rm <= 1.5 else f" (**{rm:.2f}x**)"
                    if best is not None and r["in_slo"] < best:
                        cell += " **< best**"
                    if r["preemptions"] or r["failed"]:
                        cell += f" [{r['preemptions']} preempt, {r['failed']} failed]"
                    cells.append(cell)
                f = (f"{fifo['in_slo']} / {fifo['late']}, {fifo['late_ttft_p99'] or 0:.1f} / "
                     f"{fifo['late_ttft_max'] or 0:.1f}") if fifo else "-"
                bb = "-" if best is None else f"{best} ({'='.join(b for n, b in bases if n == best)})"
                print(f"| {wl} {x:g}x s{s} | {bb} | {f} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(ROOT / ".slo-acceptance"))
    ap.add_argument("--tag", default="current", help="slo_acceptance.py's tag holding FIFO zp-elastic")
    ap.add_argument("--rules", default="main", type=lambda s: s.split(","))
    ap.add_argument("--seeds", default="0,1,2", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--workloads", default="seed-burst,agentic", type=lambda s: s.split(","))
    ap.add_argument("--loads", default="1,2", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--setup", default="zp-slo", choices=("zp-slo", "zp-oracle-slo"),
                    help="the setup whose walk is replaced (zp-oracle-slo: true output lengths)")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if not args.report_only:
        todo = [(wl, s, x, rule, str(_path(Path(args.cache), rule, wl, s, x, args.setup)), args.setup)
                for rule in args.rules for wl in args.workloads for x in args.loads for s in args.seeds]
        todo = [t for t in todo if not Path(t[4]).exists()]
        print(f"{len(todo)} points to run", file=sys.stderr)
        t0 = time.monotonic()
        ctx = multiprocessing.get_context("spawn")  # a fresh process per point: the patch stays in it
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, max_tasks_per_child=1) as pool:
            futs = {pool.submit(run, *t): t for t in todo}
            for f in as_completed(futs):
                wl, s, x, rule, _, _ = futs[f]
                _, wall = f.result()
                print(f"[{time.monotonic() - t0:.0f}s] {wl} s{s} {x:g}x {rule}: {wall:.0f}s", file=sys.stderr,
                      flush=True)
    report(args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
