"""Predicted wait and fail-fast on the virtual-clock storm (issue 30).

docs/admission.md#predicted-wait-and-fail-fast has the results.

Not a test. Two setups, both ``zp-elastic``'s budget (``LocalBudget(predict=True)``) and client, each
request with a deadline = its class's TTFT target x ``--deadline-factor`` (default 1: the target), no
app-level retry (a refusal is the app's answer, not something to retry):

* ``zp-deadline``: fail-fast off. A request waits in line until admitted or its deadline passes.
* ``zp-failfast``: the same plus ``X-ZP-Fail-Fast: 1``: the budget refuses at enqueue a request whose
  predicted wait exceeds its deadline.

On a one-class workload (``seed-burst``, ``agentic``) the deadline is ``--target`` (checked against the
workload's target) and the app sends nothing else. On a workload with several classes (``mixed``) each
request's deadline is its own class's TTFT target (read from the workload), and the app also sends what
``zp-slo``'s app sends (:class:`zp_storm.slo_setups.TargetCaller`: ``X-ZP-TTFT-Target``,
``X-ZP-TPOT-Target`` where the class has one, ``X-ZP-Priority``) to a budget with ``zp-slo``'s line
(:func:`zp_storm.slo_setups.slo_line_kwargs`): ``zp-slo`` is issue 30's acceptance row.

``--deadline-scope`` says what the deadline bounds:

* ``call`` (default): the app sends it as ``X-ZP-Deadline``, which (since a58a832, issue 33) bounds the
  whole call up to its last byte: a stream still running at the deadline is cut (``DeadlineExceeded``).
* ``admission``: the deadline bounds the wait for a lease only (what ``X-ZP-Deadline`` bounded when the
  seed-burst table in the docs was measured): the app sends no ``X-ZP-Deadline``; the budget's
  ``acquire`` gets the time left before the deadline as its timeout (and, with fail-fast, the lease meta
  ``fail_fast``), so the prediction and the refusal are the library's own, and an admitted stream runs
  to its end.

``--lengths oracle`` gives both setups the simulator's true output lengths (``zp-oracle``'s forecaster)
instead of the client's forecaster: the same replay, told the right lengths, which separates the replay's
own error from the forecast's.

It prints, per load, one JSON line: the refusals of ``zp-failfast`` and their virtual time from the
call's start (must be <= 1 ms), the false refusals (refused, yet within the deadline in
``zp-deadline``'s run of the same seed: succeeded with TTFT <= deadline), the misses of ``zp-deadline``
(failed or TTFT > deadline), requests in SLO of both, and the predicted wait's error (``zp-deadline``'s
attempts that queued: predicted vs actual wait in line) as median / p90 absolute and relative error.
On a workload with several classes the line also has the same per class (``classes``), each request
scored against its own class's targets (``zp_storm.report.in_slo``), and a PASS/FAIL verdict per
criterion follows (overall and per class).

    .venv/bin/python benchmarks/failfast_eval.py --workload seed-burst --loads 1,2 --seed 4
    .venv/bin/python benchmarks/failfast_eval.py --workload mixed --loads 1,2 --seed 4 \
        --deadline-scope admission
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zp_client.budget.predict import FAIL_FAST_KEY  # noqa: E402
from zp_client.errors import AdmissionTimeout, DeadlineExceeded, unwrap_error  # noqa: E402
from zp_client.observe import observe_admissions  # noqa: E402
from zp_storm.cli import _DEFAULTS  # noqa: E402
from zp_storm.elastic_setups import _forecaster, _local_elastic  # noqa: E402
from zp_storm.report import in_slo as class_in_slo  # noqa: E402
from zp_storm.runner import StormConfig, run_storm  # noqa: E402
from zp_storm.setups import SetupContext, SetupSpec, register_setup, zp_client_for  # noqa: E402
from zp_storm.slo_setups import TargetCaller, slo_line_kwargs  # noqa: E402

#: Filled by the callers (virtual runs are in-process): setup -> request id -> what it saw.
SEEN: dict[str, dict[str, dict[str, Any]]] = {}
#: The one-class deadline (``--target`` x ``--deadline-factor``).
DEADLINE_S = [5.0]
#: ``--deadline-factor`` (a class's deadline is its TTFT target x it) and ``--deadline-scope``.
FACTOR = [1.0]
SCOPE = ["call"]
SCOPES = ("call", "admission")
#: ``--lengths``: ``forecast`` (the default: the client's own length forecaster, what a user runs) or
#: ``oracle`` (the simulator's true output length of each request, as ``zp-oracle``'s forecaster: what
#: the replay itself is worth when the lengths it is given are right).
LENGTHS = ["forecast"]
#: The call in progress (``admission`` scope): its deadline, fail-fast and start on the budget's clock.
_CALL: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("failfast_call", default=None)
#: The bound on a refusal's delay from the call's start (virtual seconds) and on the predicted wait's
#: median error (absolute seconds, or relative): issue 30's acceptance.
REFUSAL_DELAY_MAX_S = 0.001
FALSE_SHARE_MAX = 0.05
ABS_ERR_MAX_S = 0.5
REL_ERR_MAX = 0.25


class _Caller(TargetCaller):
    """One request per call, no app retry; on a workload with several classes it sends what ``zp-slo``'s
    app sends (:meth:`TargetCaller.request_extra`), on one class nothing but the deadline headers."""

    def __init__(self, name: str, client: Any, ctx: SetupContext, fail_fast: bool, multi: bool) -> None:
        super().__init__(client, ctx.model, ctx)
        self.app_retry = False
        self.name = name
        self.fail_fast = fail_fast
        self.multi = multi

    def deadline_s(self, turn: Any) -> float:
        if not self.multi:
            return DEADLINE_S[0]
        return self.ctx.slo_class(turn.slo_class)[0] * FACTOR[0]

    def request_extra(self, turn: Any) -> dict[str, Any]:
        return super().request_extra(turn) if self.multi else {}

    async def __call__(self, turn: Any, rec: Any, clock: Any) -> None:
        from zp_storm.loadgen import stream_chat

        deadline = self.deadline_s(turn)
        headers: dict[str, str] = {}
        if SCOPE[0] == "call":
            headers["X-ZP-Deadline"] = f"{deadline:g}"
            if self.fail_fast:
                headers["X-ZP-Fail-Fast"] = "1"
        extra = self.request_extra(turn)
        extra["extra_headers"] = {**extra.get("extra_headers", {}), **headers}
        out = SEEN.setdefault(self.name, {}).setdefault(rec.id, {})
        out["deadline_s"] = deadline
        start = clock.now()
        rec.attempts += 1
        token = _CALL.set({"deadline_s": deadline, "fail_fast": self.fail_fast}
                          if SCOPE[0] == "admission" else None)
        try:
            with observe_admissions() as seen:
                try:
                    await stream_chat(self.client, self.model, turn, rec, clock, **extra)
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
        finally:
            _CALL.reset(token)


def _bound_admission(budget: Any) -> Any:
    """``budget`` whose ``acquire`` (``admission`` scope) waits at most the time left before the call's
    deadline (counted from its first acquire, on the budget's clock) and, for a fail-fast call, carries
    the lease meta ``fail_fast``: the deadline bounds the wait for a lease, not the stream."""
    inner = budget.acquire

    async def acquire(blocks: int, **kw: Any) -> Any:
        call = _CALL.get()
        if call is None:
            return await inner(blocks, **kw)
        now = budget.clock.monotonic()
        left = call["deadline_s"] - (now - call.setdefault("start", now))
        if left <= 0:
            raise AdmissionTimeout("the call's admission deadline passed before this attempt")
        timeout = kw.get("timeout")
        kw["timeout"] = left if timeout is None else min(timeout, left)
        if call["fail_fast"]:
            kw["meta"] = {**(kw.get("meta") or {}), FAIL_FAST_KEY: True}
        return await inner(blocks, **kw)

    budget.acquire = acquire
    return budget


def _factory(name: str, fail_fast: bool) -> Any:
    async def build(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Any:
        multi = len(ctx.slo_classes) > 1  # the "" entry is the workload's one class
        budget = _local_elastic(ctx, predict=True, **(slo_line_kwargs() if multi else {}))
        if SCOPE[0] == "admission":
            _bound_admission(budget)
        if LENGTHS[0] == "oracle":
            from zp_client.transport import forecaster_for
            from zp_storm.oracle import SimOracleForecaster

            forecaster: Any = SimOracleForecaster(forecaster_for(budget))
        else:
            forecaster = _forecaster(ctx.elastic)
        client = await zp_client_for(ctx, stack, budget, forecaster=forecaster)
        return _Caller(name, client, ctx, fail_fast, multi)

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


def _criteria(rids: set[str], base: dict[str, Any], ff: dict[str, Any], met: Any,
              in_slo: Any, signed: bool = False) -> dict[str, Any]:
    """The criteria over the requests ``rids`` (their ids in either run); ``signed``: with the signed
    error's median (actual minus predicted: > 0, the wait ran longer than predicted)."""
    refused = {rid for rid in rids if "refused_after_s" in SEEN.get("zp-failfast", {}).get(rid, {})}
    false_ref = sorted(rid for rid in refused if rid in base and met(base[rid]))
    misses = [rid for rid, rec in base.items() if rid in rids and not met(rec)]
    delays = [SEEN["zp-failfast"][rid]["refused_after_s"] for rid in refused]
    errs: list[float] = []
    rel: list[float] = []
    diffs: list[float] = []
    for rid, s in SEEN.get("zp-deadline", {}).items():
        p, a = s.get("predicted_s"), s.get("waited_s")
        if rid not in rids or p is None or a is None:
            continue
        errs.append(abs(p - a))
        diffs.append(a - p)
        if a > 0:
            rel.append(abs(p - a) / a)
    out = {
        "sent": sum(1 for rid in base if rid in rids), "refusals": len(refused),
        "false_refusals": len(false_ref),
        "false_refusal_share": len(false_ref) / len(refused) if refused else 0.0,
        "misses_without_failfast": len(misses),
        "refusal_delay_max_s": max(delays, default=0.0),
        "in_slo": {"zp-deadline": sum(1 for rid, r in base.items() if rid in rids and in_slo(r)),
                   "zp-failfast": sum(1 for rid, r in ff.items() if rid in rids and in_slo(r))},
        "predicted": len(errs),
        "abs_err_median_s": statistics.median(errs) if errs else None,
        "abs_err_p90_s": _q(errs, 0.9),
        "rel_err_median": statistics.median(rel) if rel else None,
        "rel_err_p90": _q(rel, 0.9),
    }
    if signed:
        out["signed_err_median_s"] = statistics.median(diffs) if diffs else None
    return out


def evaluate(workload: str, load: float, seed: int, factor: float) -> dict[str, Any]:
    profile, blocks, mml, _ = _DEFAULTS[workload]
    cfg = StormConfig(workload=workload, seed=seed, profile=profile, num_gpu_blocks=blocks, max_model_len=mml,
                      load_scale=load, setups=["zp-deadline", "zp-failfast"])
    SEEN.clear()
    wl, _, runs = run_storm(cfg)
    target = wl.slo.ttft_s
    multi = bool(wl.classes)
    if not multi and abs(target * factor - DEADLINE_S[0]) > 1e-9:
        raise SystemExit(f"the workload's TTFT target is {target} s: run with --target {target}")
    by = {r.name: {rec.id: rec for rec in r.records if rec.sent} for r in runs}
    base, ff = by["zp-deadline"], by["zp-failfast"]

    def deadline_of(rec: Any) -> float:
        return wl.slo_of(rec.slo_class).ttft_s * factor if multi else DEADLINE_S[0]

    def met(rec: Any) -> bool:
        return bool(rec.ok and rec.ttft is not None and rec.ttft <= deadline_of(rec))

    def in_slo(rec: Any) -> bool:
        if multi:  # each request against its own class's targets, as the storm's report scores it
            return class_in_slo(wl, rec)
        return bool(rec.ok and rec.ttft is not None and rec.ttft <= target
                    and (rec.tpot is None or rec.tpot <= wl.slo.tpot_s))

    if multi:  # the caller's deadline is the class's target, read from the workload here too
        for name in ("zp-deadline", "zp-failfast"):
            for rid, s in SEEN.get(name, {}).items():
                rec = by[name].get(rid)
                if rec is not None and abs(s["deadline_s"] - deadline_of(rec)) > 1e-9:
                    raise AssertionError(f"{rid}: sent deadline {s['deadline_s']} != {deadline_of(rec)}")
    head: dict[str, Any] = {"workload": workload, "load": load, "seed": seed, "lengths": LENGTHS[0]}
    if multi:
        head["deadline_scope"] = SCOPE[0]
        head["deadline_s"] = {n: c.slo.ttft_s * factor for n, c in wl.classes.items()}
    else:
        head["deadline_s"] = DEADLINE_S[0]
    out = {**head, **_criteria(set(base) | set(ff), base, ff, met, in_slo, signed=multi)}
    if multi:
        out["classes"] = {n: _criteria({rid for rid, r in {**ff, **base}.items() if r.slo_class == n},
                                       base, ff, met, in_slo, signed=True)
                          for n in wl.classes}
    return out


def verdicts(r: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issue 30's fail-fast criteria on one result (overall or one class): (criterion, passed, numbers)."""
    share = r["false_refusal_share"]
    med, rel = r["abs_err_median_s"], r["rel_err_median"]
    pred_ok = med is not None and (med <= ABS_ERR_MAX_S or (rel is not None and rel <= REL_ERR_MAX))

    def fmt(x: float | None, f: str) -> str:
        return "n/a" if x is None else f.format(x)

    return [
        ("false refusals <= 5% of refusals", share <= FALSE_SHARE_MAX,
         f"{r['false_refusals']} of {r['refusals']} ({share:.0%})"),
        ("refusals <= misses without fail-fast", r["refusals"] <= r["misses_without_failfast"],
         f"{r['refusals']} <= {r['misses_without_failfast']}"),
        ("every refusal within 1 ms of enqueue", r["refusal_delay_max_s"] <= REFUSAL_DELAY_MAX_S,
         f"max {r['refusal_delay_max_s'] * 1000:.3f} ms over {r['refusals']}"),
        ("predicted wait median error <= 25% or <= 0.5 s", pred_ok,
         f"median {fmt(med, '{:.2f}')} s / {fmt(rel, '{:.0%}')}, p90 {fmt(r['abs_err_p90_s'], '{:.2f}')} s / "
         f"{fmt(r['rel_err_p90'], '{:.0%}')} over {r['predicted']} waits; signed median (actual - predicted) "
         f"{fmt(r.get('signed_err_median_s'), '{:+.2f}')} s"),
    ]


def print_verdicts(r: dict[str, Any]) -> None:
    parts = [("all", r), *r.get("classes", {}).items()]
    for name, x in parts:
        print(f"# seed {r['seed']} load {r['load']:g}x {name}: sent {x['sent']}, in SLO off/on "
              f"{x['in_slo']['zp-deadline']}/{x['in_slo']['zp-failfast']}")
        for crit, ok, nums in verdicts(x):
            print(f"#   {'PASS' if ok else 'FAIL'}  {crit}: {nums}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="seed-burst", choices=sorted(_DEFAULTS))
    ap.add_argument("--loads", default="1,2")
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--target", type=float, default=5.0,
                    help="the workload's TTFT target (s; one-class workloads: a class's own is read)")
    ap.add_argument("--deadline-factor", type=float, default=1.0)
    ap.add_argument("--deadline-scope", default="call", choices=SCOPES,
                    help="call: X-ZP-Deadline (bounds the whole call); admission: the wait for a lease only")
    ap.add_argument("--lengths", default="forecast", choices=("forecast", "oracle"),
                    help="forecast: the client's length forecaster; oracle: each request's true output "
                         "length (what the replay is worth with right lengths)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    LENGTHS[0] = args.lengths
    DEADLINE_S[0] = args.target * args.deadline_factor
    FACTOR[0] = args.deadline_factor
    SCOPE[0] = args.deadline_scope
    out = [evaluate(args.workload, float(x), args.seed, args.deadline_factor) for x in args.loads.split(",")]
    for r in out:
        print(json.dumps(r))
    for r in out:
        if "classes" in r:
            print_verdicts(r)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
