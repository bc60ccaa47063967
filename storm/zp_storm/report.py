"""Storm metrics, the terminal table, ``report.json`` and the PNG.

Every time figure is virtual seconds (the simulator's clock). A run is ``valid`` only if the harness kept
up (``SPEEDUP_KEPT``, ``CPU_SATURATED``). What each metric measures: see docs/benchmark.md#metrics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zp_storm.loadgen import RequestRecord
from zp_storm.runner import SetupRun
from zp_storm.workloads import SLO_TPOT_ITL_FACTOR, ServerFacts, Workload

__all__ = [
    "COLLAPSE_DROP",
    "CPU_SATURATED",
    "build_report",
    "build_sweep_report",
    "checks_by_name",
    "collapse_point",
    "compute_metrics",
    "focus_setup",
    "print_checks",
    "print_sweep_table",
    "print_table",
    "seed_burst_checks",
    "storm_verdict",
    "sweep_markdown_table",
    "sweep_verdict",
    "write_png",
    "write_report",
    "write_sweep_png",
    "write_sweep_report",
]

#: Process CPU time over wall time above which the harness (single event loop) counts as saturated.
CPU_SATURATED = 0.95
#: A run whose virtual makespan over its wall time falls below this fraction of the nominal speedup was
#: CPU-bound for a sizeable part of it: virtual time stretched, client-side waits shrank, so invalid.
#: Short lags that the simulator catches up (it runs steps back to back, letting the harness read
#: between them) leave the virtual-time figures intact; they are reported as ``sim_max_lag_s``.
SPEEDUP_KEPT = 0.85


def _q(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, math.ceil(p * len(xs)) - 1))
    return xs[k]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def _e2e(r: RequestRecord) -> float | None:
    return None if r.t_end is None or r.t_submit is None else r.t_end - r.t_submit


def bypass_selector(run: SetupRun) -> Callable[[RequestRecord], bool] | None:
    """Which of ``run``'s records count as bypass traffic in its report's split: those it sent around
    its budget (``rec.bypass``) where ``--bypass`` applied to the setup; for the other setups, the same
    requests (the plan's ids, submitted inside the window) for reference; None without ``--bypass``."""
    b = run.bypass
    if b is None:
        return None
    if b.get("applies"):
        return lambda r: r.bypass
    from zp_storm.bypass import occurrence_keys

    ids = frozenset(b.get("ids") or ())
    window = b.get("window")
    # records are in submit order, so a repeated id's n-th record is its n-th request, as in the plan
    keys = dict(zip(map(id, run.records), occurrence_keys(r.id for r in run.records), strict=True))

    def selected(r: RequestRecord) -> bool:
        if keys.get(id(r)) not in ids:
            return False
        if window is None:
            return True
        start, end = window
        return r.t_submit is not None and start <= r.t_submit and (end is None or r.t_submit < end)

    return selected


#: The per-group metrics of the admitted / bypass split (keys of each group's dictionary).
GROUP_METRICS = ("requests", "sent", "ok", "errors", "good", "slo_attainment", "goodput_rps", "goodput_tps",
                 "ttft_p50", "ttft_p99")


def in_slo(wl: Workload, r: RequestRecord) -> bool:
    """Whether ``r`` succeeded within its own class's SLO (:meth:`Workload.slo_of`)."""
    return r.ok and wl.slo_of(r.slo_class).met(r.ttft, r.tpot, streamed=r.stream, out_tokens=r.out_tokens,
                                               e2e=_e2e(r))


def outcome_counts(recs: list[RequestRecord], wl: Workload) -> dict[str, Any]:
    """How ``recs`` split: ``in_slo`` (succeeded within their class's SLO), ``late`` (succeeded outside it),
    ``failed`` (every other request: an error surfaced to the app, or never sent because its conversation
    had stopped after one; ``errors`` and ``unsent`` count those two), so in_slo + late + failed =
    ``requests``; and the TTFT p99 / max of the late ones."""
    good = [r for r in recs if in_slo(wl, r)]
    late = [r for r in recs if r.sent and r.ok and not in_slo(wl, r)]
    late_ttfts = [r.ttft for r in late if r.ttft is not None]
    return {"requests": len(recs), "in_slo": len(good), "late": len(late),
            "failed": len(recs) - len(good) - len(late),
            "errors": sum(1 for r in recs if r.sent and not r.ok),
            "unsent": sum(1 for r in recs if not r.sent),
            "late_ttft_p99": _r(_q(late_ttfts, 0.99)), "late_ttft_max": _r(max(late_ttfts, default=None))}


def _class_metrics(recs: list[RequestRecord], wl: Workload) -> dict[str, Any]:
    """Per request class of a workload with several (``mixed``): its targets and priority, the split of
    :func:`outcome_counts` and its TTFT p50 / p99 over successful requests. Nothing for one class."""
    if not wl.classes:
        return {}
    out: dict[str, Any] = {}
    for name, c in wl.classes.items():
        mine = [r for r in recs if r.slo_class == name]
        ttfts = [r.ttft for r in mine if r.ok and r.ttft is not None]
        sent = sum(1 for r in mine if r.sent)
        split = outcome_counts(mine, wl)
        out[name] = {"ttft_target_s": c.slo.ttft_s, "tpot_target_s": c.slo.tpot_s, "priority": c.priority,
                     **split, "sent": sent, "slo_attainment": _r(split["in_slo"] / sent if sent else None, 3),
                     "ttft_p50": _r(_q(ttfts, 0.5)), "ttft_p99": _r(_q(ttfts, 0.99))}
    return {"classes": out}


#: Sessions of these kinds are conversations (``agentic``'s, and ``mixed``'s batch class): the report
#: counts those completed (every request of the conversation and of its sub-agents succeeded) and their
#: time (first submit to last end).
CONVERSATION_KINDS = ("agent",)


def _conversation_metrics(recs: list[RequestRecord]) -> dict[str, Any]:
    """Conversations (top-level sessions of :data:`CONVERSATION_KINDS`, their sub-agents included):
    ``conversations``, ``conversations_completed`` and, over the completed ones, ``conversation_time_p50``
    / ``_p99`` (virtual s from the first request's submit to the last one's end). Nothing for a workload
    without conversations."""
    roots = {r.root for r in recs if r.kind in CONVERSATION_KINDS and r.root}
    if not roots:
        return {}
    by: dict[str, list[RequestRecord]] = {}
    for r in recs:
        if r.root in roots:
            by.setdefault(r.root, []).append(r)
    times = []
    for rs in by.values():
        if all(r.ok for r in rs):
            start = min(r.t_submit for r in rs if r.t_submit is not None)
            end = max(r.t_end for r in rs if r.t_end is not None)
            times.append(end - start)
    return {"conversations": len(roots), "conversations_completed": len(times),
            "conversation_time_p50": _r(_q(times, 0.5), 3), "conversation_time_p99": _r(_q(times, 0.99), 3)}


def _group(recs: list[RequestRecord], wl: Workload, makespan: float) -> dict[str, Any]:
    """One group's goodput and TTFT over the WHOLE run's makespan (so the groups' goodputs add up to the
    setup's)."""
    sent = [r for r in recs if r.sent]
    ok = [r for r in sent if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    good = [r for r in ok if in_slo(wl, r)]
    return {
        "requests": len(recs), "sent": len(sent), "ok": len(ok), "errors": len(sent) - len(ok),
        "good": len(good), "slo_attainment": _r(len(good) / len(sent) if sent else None, 3),
        "goodput_rps": _r(len(good) / makespan if makespan else 0.0),
        "goodput_tps": _r(sum(r.out_tokens for r in good) / makespan if makespan else 0.0, 1),
        "ttft_p50": _r(_q(ttfts, 0.5)), "ttft_p99": _r(_q(ttfts, 0.99)),
    }


def _bypass_metrics(run: SetupRun, wl: Workload, makespan: float) -> dict[str, Any]:
    """The admitted / bypass split of one setup (empty without ``--bypass``): ``bypass`` = {``applies``,
    ``admitted``, ``bypass``} (each :data:`GROUP_METRICS`) and the flat keys a sweep keeps."""
    sel = bypass_selector(run)
    if sel is None:
        return {}
    byp = [r for r in run.records if sel(r)]
    adm = [r for r in run.records if not sel(r)]
    a, b = _group(adm, wl, makespan), _group(byp, wl, makespan)
    applies = bool(run.bypass and run.bypass.get("applies"))
    return {
        "bypass": {"applies": applies, "admitted": a, "bypass": b},
        "bypass_sent": sum(1 for r in run.records if r.bypass),
        "admitted_goodput_rps": a["goodput_rps"], "admitted_ttft_p99": a["ttft_p99"],
        "bypass_goodput_rps": b["goodput_rps"], "bypass_ttft_p99": b["ttft_p99"],
    }


def _limit_metrics(run: SetupRun) -> dict[str, Any]:
    tl = run.limit_timeline
    if not tl:
        return {}
    limits = [lim for _, lim in tl]
    return {"limit_changes": len(tl) - 1, "limit_min": min(limits), "limit_max": max(limits),
            "limit_final": limits[-1]}


#: A workload request is a cold prefill when its cached tokens cover under this share of its pinned
#: prefix's full blocks.
COLD_SHARE = 0.9

#: Sim request ids of keep-warms (``X-Request-Id`` ``zp-keepwarm-...`` under the simulator's prefix).
_KEEPWARM_ID = "chatcmpl-zp-keepwarm-"


def _prefix_metrics(run: SetupRun, wl: Workload, block_size: int) -> dict[str, Any]:
    """For a workload with prefixes to pin (``agent-types``): per agent type, cold prefills of workload
    requests (keep-warms excluded) after the type's first call, the prefix-cache hit rate of workload
    requests, and the keep-warms' cost (requests, computed tokens) against the server's."""
    if not wl.pin_prefixes:
        return {}
    from zp_sim.tokenizer import encode, render_chat

    full = [len(encode(render_chat(p, add_generation_prompt=False))) // block_size * block_size
            for p in wl.pin_prefixes]
    sim = run.server_stats.get("requests")
    if not isinstance(sim, list):
        return {}
    by_id: dict[str, dict[str, Any]] = {}
    kw_reqs = kw_tokens = all_tokens = 0
    for r in sim:
        rid = str(r.get("id", ""))
        computed = int(r.get("prompt_tokens", 0)) - int(r.get("cached_tokens", 0)) + int(
            r.get("output_tokens", 0))
        if r.get("first_scheduled_s") is None:
            computed = 0
        all_tokens += computed
        if rid.startswith(_KEEPWARM_ID):
            kw_reqs += 1
            kw_tokens += computed
            continue
        if r.get("first_scheduled_s") is not None:
            by_id[rid.removeprefix("chatcmpl-")] = r  # the last scheduled attempt of a logical request
    types = len(wl.pin_prefixes)
    cold = [0] * types
    later = [0] * types
    seen = [False] * types
    ttfts: list[list[float]] = [[] for _ in range(types)]
    queried = hits = 0
    for rec in sorted(run.records, key=lambda r: (r.t_submit is None, r.t_submit or 0.0)):
        if not rec.kind.startswith("type") or rec.bypass:
            continue
        k = int(rec.kind[4:])
        sr = by_id.get(rec.id)
        if sr is None:
            continue
        cached = int(sr.get("cached_tokens", 0))
        queried += int(sr.get("prompt_tokens", 0))
        hits += cached
        if rec.ok and rec.ttft is not None:
            ttfts[k].append(rec.ttft)
        if seen[k]:
            later[k] += 1
            if cached < COLD_SHARE * full[k]:
                cold[k] += 1
        seen[k] = True
    workload_requests = sum(1 for r in run.records if r.sent)
    return {"prefix": {
        "cold_prefills": sum(cold),
        "cold_per_type": cold,
        "later_calls_per_type": later,
        "cold_share_rarest2": _r((cold[-1] + cold[-2]) / max(1, later[-1] + later[-2]), 3),
        "hit_rate": _r(hits / queried if queried else None, 4),
        "ttft_p50_per_type": [_r(_q(t, 0.5)) for t in ttfts],
        "keepwarm_requests": kw_reqs,
        "keepwarm_requests_share": _r(kw_reqs / workload_requests if workload_requests else None, 4),
        "keepwarm_computed_tokens": kw_tokens,
        "keepwarm_tokens_share": _r(kw_tokens / all_tokens if all_tokens else None, 5),
        "keepwarms_sent": run.keepwarms,
    }}


def compute_metrics(run: SetupRun, wl: Workload, facts: ServerFacts, speedup: float) -> dict[str, Any]:
    recs = run.records
    sent = [r for r in recs if r.sent]
    ok = [r for r in sent if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls()]
    ends = [r.t_end for r in sent if r.t_end is not None]
    makespan = max(ends) if ends else 0.0
    good = [r for r in ok if in_slo(wl, r)]
    # the tail SLO (issue 20): also every streamed request's largest inter-token gap <= 5x unloaded ITL
    tail_gap = SLO_TPOT_ITL_FACTOR * facts.unloaded_itl_s
    good_tail = [r for r in good if not r.stream or max(r.itls(), default=0.0) <= tail_gap]
    st = run.server_stats
    eng = st.get("engine", {})
    reqs = st.get("requests", 0)
    # with ?requests=1 the count is replaced by the per-request records (one per HTTP request)
    attempts_server = len(reqs) if isinstance(reqs, list) else int(reqs)
    # a queue cap's 503s reached the server too, but it keeps no record of them, only their count
    rejected = int(st.get("rejected_queue_full") or 0)
    attempts_server += rejected
    kv = [s[1] for s in run.timeline]
    itl_p99 = _q(itls, 0.99)
    reasons = []
    wall = run.harness.get("wall_s", 0.0)
    effective = makespan / wall if wall > 0 else 0.0
    virtual = run.harness.get("clock") == "virtual"  # CPU is free in virtual time: nothing to saturate
    if virtual:
        pass
    elif makespan > 0 and effective < SPEEDUP_KEPT * speedup:
        reasons.append(f"the simulator ran at {effective:.2f}x real time instead of {speedup:g}x "
                       "(the process could not keep up)")
    if not virtual and run.harness.get("cpu_frac", 0) > CPU_SATURATED:
        reasons.append(f"process CPU {run.harness['cpu_frac']:.2f} of a core")
    for i, w in enumerate(run.harness.get("workers", [])):
        if w.get("cpu_frac", 0) > CPU_SATURATED:
            reasons.append(f"worker {i} CPU {w['cpu_frac']:.2f} of a core")
    return {
        "setup": run.name,
        "valid": not reasons,
        "saturation": reasons,
        "requests": len(recs),
        "sent": len(sent),
        "ok": len(ok),
        "errors": len(sent) - len(ok),
        "unsent": len(recs) - len(sent),
        "error_kinds": _count(r.error for r in sent if not r.ok),
        "preemptions": int(eng.get("preemptions_total") or 0),
        "preemptions_metrics": run.metrics_preemptions,
        "recomputed_tokens": int(eng.get("recomputed_tokens") or 0),
        "kv_usage_max": _r(max(kv) if kv else None),
        "kv_usage_mean": _r(sum(kv) / len(kv) if kv else None),
        "ttft_p50": _r(_q(ttfts, 0.5)),
        "ttft_p99": _r(_q(ttfts, 0.99)),
        "itl_p50": _r(_q(itls, 0.5), 5),
        "itl_p99": _r(itl_p99, 5),
        "itl_p99_vs_unloaded": _r(itl_p99 / facts.unloaded_itl_s
                                  if itl_p99 and facts.unloaded_itl_s else None, 2),
        "goodput_rps": _r(len(good) / makespan if makespan else 0.0),
        "goodput_tps": _r(sum(r.out_tokens for r in good) / makespan if makespan else 0.0, 1),
        "good": len(good),
        "goodput_tail_rps": _r(len(good_tail) / makespan if makespan else 0.0),
        "good_tail": len(good_tail),
        "slo_attainment": _r(len(good) / len(sent) if sent else None, 3),
        "attempts_server": attempts_server,
        "rejected_503": rejected,
        "attempts_client": sum(r.attempts for r in sent),
        "amplification": _r(attempts_server / len(sent) if sent else None, 3),
        "gateway_504": int(st.get("gateway_504", 0)),
        "makespan": _r(makespan, 3),
        "gateway_timeout_s": run.gateway_timeout_s,
        "limit_blocks": run.limit_blocks,
        "rate_rps": _r(run.rate_rps),
        "harness": run.harness,
        "sim_max_lag_s": _r(st.get("max_lag_s")),
        "effective_speedup": _r(effective, 3),
        "sim_lagging": bool(st.get("lagging")),
        "leases_granted": run.leases_granted,
        "sim_settings": run.sim_settings,
        **{k: v for k, v in outcome_counts(recs, wl).items() if k not in ("requests", "errors", "unsent")},
        **_class_metrics(recs, wl),
        **_conversation_metrics(recs),
        **_bypass_metrics(run, wl, makespan),
        **_prefix_metrics(run, wl, facts.block_size),
        **_limit_metrics(run),
        **_fleet_metrics(run),
        **_pd_metrics(run),
        **_held_metrics(run),
    }


def is_fleet_run(run: SetupRun) -> bool:
    """Whether ``run`` had several replicas or a kill (its report gets the fleet metrics)."""
    return run.replicas > 1 or run.kill is not None or run.replica_stats is not None


def _fleet_metrics(run: SetupRun) -> dict[str, Any]:
    """The fleet's metrics (``--replicas N`` / ``--kill-replica``), or nothing for a one-server run:
    the prefix-cache hit rate over the replicas (hit tokens / queried tokens, the engines' counters),
    each replica's preemptions, HTTP requests and KV maximum, the kill, the requests a setup moved off a
    failed replica (its router's count; None: the setup does not say) and the cut streams (attempts whose
    stream had delivered content to the caller and then failed; ``cut_requests``: logical requests with
    one)."""
    if not is_fleet_run(run):
        return {}
    eng = run.server_stats.get("engine", {})
    queries = float(eng.get("prefix_cache_queries_total") or 0)
    hits = float(eng.get("prefix_cache_hits_total") or 0)
    per = run.replica_stats or []
    kill = run.kill or {}
    return {
        "replicas": run.replicas,
        "prefix_cache_hit_rate": _r(hits / queries if queries else None, 4),
        "preemptions_per_replica": [int((st.get("engine") or {}).get("preemptions_total") or 0)
                                    for st in per],
        "server_requests_per_replica": [int(st.get("requests") or 0) for st in per],
        "routed_per_replica": run.replica_requests,
        "kv_usage_max_per_replica": [_r(max((x[1] for x in tl), default=None))
                                     for tl in (run.replica_timelines or [])],
        "killed_replica": kill.get("replica"),
        "killed_at_s": kill.get("t_s"),
        "killed_in_flight": kill.get("in_flight"),
        "moved_off_dead": run.moved_off_dead,
        "cut_streams": sum(r.cut_streams for r in run.records),
        "cut_requests": sum(1 for r in run.records if r.cut_streams),
    }


def _pd_metrics(run: SetupRun) -> dict[str, Any]:
    """Per pool of a P/D run (``--pd``; servers whose stats carry ``kv``): preemptions, KV maximum,
    expired prefill leases, frees on read / abort, heartbeats, KV transfers and the decode calls that
    prefilled locally. Nothing for a colocated run."""
    per = run.replica_stats or []
    if not any(st.get("kv") for st in per):
        return {}
    tls = run.replica_timelines or [[] for _ in per]
    pools: dict[str, dict[str, Any]] = {}
    for st, tl in zip(per, tls, strict=False):
        kv = st.get("kv") or {}
        role = str(kv.get("role"))
        p = pools.setdefault(role, {"servers": 0, "preemptions": 0, "kv_usage_max": 0.0, "expired": 0,
                                    "freed_read": 0, "freed_abort": 0, "heartbeats": 0, "remote": 0,
                                    "local_fallback": 0, "read_freed": 0, "pulled_blocks": 0})
        p["servers"] += 1
        p["preemptions"] += int((st.get("engine") or {}).get("preemptions_total") or 0)
        p["kv_usage_max"] = max(p["kv_usage_max"], max((x[1] for x in tl), default=0.0))
        for key, src in (("expired", "kv_expired"), ("freed_read", "kv_freed_read"),
                         ("freed_abort", "kv_freed_abort"), ("heartbeats", "kv_heartbeats"),
                         ("remote", "kv_remote"), ("local_fallback", "kv_local_fallback"),
                         ("read_freed", "kv_read_freed"),
                         ("pulled_blocks", "pulled_blocks_total")):
            p[key] += int(kv.get(src) or 0)
    for p in pools.values():
        p["kv_usage_max"] = _r(p["kv_usage_max"])
    waits = sorted(w for st in per for w in ((st.get("kv") or {}).get("xfer_waits_s") or []))
    dec = pools.get("decode")
    if dec is not None:
        itls = sorted(x for r in run.records if r.ok for x in r.itls())
        dec["itl_p50_ms"] = _r(1000 * (_q(itls, 0.5) or 0.0)) if itls else None
        dec["itl_p99_ms"] = _r(1000 * (_q(itls, 0.99) or 0.0)) if itls else None
        dec["transfer_wait_p50_s"] = _r(_q(waits, 0.5), 4) if waits else None
        dec["transfer_wait_p99_s"] = _r(_q(waits, 0.99), 4) if waits else None
    out: dict[str, Any] = {"pd": pools}
    counts = getattr(run, "pd_counts", None)
    if counts is not None:
        out["pd_counts"] = counts
    return out


def _held_metrics(run: SetupRun) -> dict[str, Any]:
    """The budget's charged blocks against the simulator's allocated blocks per replica (``zp-pd``):
    samples where a replica had more allocated than charged (a deficit: blocks the budget did not count),
    the largest deficit per replica, and what both held after the run (both 0 when every leg was
    released and every transfer ended)."""
    tl = run.held_timeline
    if not tl:
        return {}
    n = len(tl[0][1])
    worst = [0] * n
    bad = 0
    for _, charged, alloc in tl:
        d = [a - c for c, a in zip(charged, alloc, strict=True)]
        if any(x > 0 for x in d):
            bad += 1
        worst = [max(w, x) for w, x in zip(worst, d, strict=True)]
    return {"held_deficit": {"samples": len(tl), "deficit_samples": bad, "max_deficit_blocks": worst,
                             "charged_after": tl[-1][1], "allocated_after": tl[-1][2]}}


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[str(i)] = out.get(str(i), 0) + 1
    return out


def _thin_held(timeline: list[tuple[float, list[int], list[int]]], n: int = 600) -> list[list[Any]]:
    """A held-vs-allocated timeline (``[t, charged per replica, allocated per replica]``), at most ``n``
    samples plus the last, and every sample with a deficit."""
    step = max(1, len(timeline) // n)
    keep = [i for i, (_, c, a) in enumerate(timeline)
            if i % step == 0 or i == len(timeline) - 1 or any(x > y for y, x in zip(c, a, strict=True))]
    return [[round(timeline[i][0], 4), list(timeline[i][1]), list(timeline[i][2])] for i in keep]


def _thin(timeline: list[tuple[float, float, int, int, int]], t0: float, n: int = 600) -> list[list[float]]:
    step = max(1, len(timeline) // n)
    return [[round(t - t0, 4), round(kv, 4), p, run, wait] for (t, kv, p, run, wait) in timeline[::step]]


#: The benchmark's own setups whose names the checks and verdicts mention as references.
_REFERENCES = ("no-admission", "naive")


def _num(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` with 3 decimals, or 4 where 3 would print two different numbers alike."""
    sa, sb = f"{a:.3f}", f"{b:.3f}"
    return (sa, sb) if sa != sb or a == b else (f"{a:.4f}", f"{b:.4f}")


def _refs(metrics: list[dict[str, Any]], key: str, fmt: str = "{}") -> str:
    """`` (no-admission 3, naive 4)``: the reference setups' ``key`` in brackets, if any ran."""
    by = {m["setup"]: m for m in metrics}
    parts = [f"{n} {fmt.format(by[n][key])}" for n in _REFERENCES if n in by and by[n].get(key) is not None]
    return f" ({', '.join(parts)})" if parts else ""


def _check(name: str, passed: bool | None, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": passed, "detail": detail}


def seed_burst_checks(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seed-burst demo's checks, each ``{"name", "passed", "detail"}``.

    ``passed`` is True, False, or None when the run lacks a setup the check needs; ``detail`` is one line
    with the numbers the verdict rests on (and, for a failure, which setup missed by how much and why).

    - ``zp_zero_preemptions``: every ``zp-*`` setup ran with 0 server preemptions.
    - ``naive_preempts``: ``naive`` preempted at least once (the load overflows the pool without
      admission, so the first check is not vacuous).
    - ``zp_goodput_at_least_naive``: every ``zp-*`` setup's goodput (good requests per virtual second,
      as rounded in the report) is >= ``naive``'s.
    """
    by = {m["setup"]: m for m in metrics}
    zp = [m for m in metrics if m["setup"].startswith("zp-")]
    naive = by.get("naive")
    out: list[dict[str, Any]] = []

    if not zp:
        out.append(_check("zp_zero_preemptions", None, "no zp-* setup in this run"))
    else:
        bad = [m for m in zp if m["preemptions"] != 0]
        zeros = ", ".join(f"{m['setup']} 0" for m in zp if m["preemptions"] == 0)
        if bad:
            detail = "; ".join(f"{m['setup']} preempted {m['preemptions']} times ({m['recomputed_tokens']} "
                               "tokens recomputed)" for m in bad)
            detail += (f"; {zeros}" if zeros else "") + _refs(metrics, "preemptions")
        else:
            detail = f"{zeros} preemptions" + _refs(metrics, "preemptions")
        out.append(_check("zp_zero_preemptions", not bad, detail))

    if naive is None:
        out.append(_check("naive_preempts", None, "no naive setup in this run"))
    elif naive["preemptions"] > 0:
        out.append(_check("naive_preempts", True, f"naive preempted {naive['preemptions']} times "
                          f"({naive['recomputed_tokens']} tokens recomputed): without admission this load "
                          "overflows the KV pool"))
    else:
        out.append(_check("naive_preempts", False, "naive preempted 0 times: this run's load did not "
                          "overflow the KV pool without admission, so 0 preemptions elsewhere show nothing"
                          + _refs([m for m in metrics if m["setup"] != "naive"], "preemptions")))

    if not (zp and naive):
        out.append(_check("zp_goodput_at_least_naive", None,
                          "needs naive and a zp-* setup; this run has "
                          + ("no naive" if naive is None else "no zp-* setup")))
    else:
        ng = naive["goodput_rps"] or 0
        short, held = [], []  # the failures first
        for m in zp:
            g = m["goodput_rps"] or 0
            a, b = _num(g, ng)
            ratio = _ratio(g, ng)
            if g >= ng:
                held.append(f"{m['setup']} {a} >= {b} ({ratio})")
            else:
                short.append(f"{m['setup']} {a} < {b} ({ratio}: {m['good']} vs {naive['good']} in SLO, "
                             f"makespan {m['makespan']:.1f} vs {naive['makespan']:.1f} s)")
        out.append(_check("zp_goodput_at_least_naive", not short,
                          "good req/s vs naive's: " + "; ".join(short + held)))
    return out


def checks_by_name(report: dict[str, Any]) -> dict[str, bool | None]:
    """``{check name: passed}`` of a report (True, False, or None where the check could not apply)."""
    return {c["name"]: c["passed"] for c in report.get("checks", [])}


def _status(passed: bool | None) -> str:
    return "PASS" if passed else ("n/a" if passed is None else "FAIL")


def focus_setup(names: list[str]) -> str | None:
    """The setup a verdict speaks for: ``zp-elastic`` (the library's default) if it ran, else the first
    ``zp-*`` setup, else None."""
    if "zp-elastic" in names:
        return "zp-elastic"
    return next((n for n in names if n.startswith("zp-")), None)


def _ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``0.97x``, with up to 5 decimals where 2 would round a ratio other than 1 to 1."""
    if a is None or not b:
        return "n/a"
    r = a / b
    for nd in (2, 3, 4):
        text = f"{r:.{nd}f}"
        if r == 1 or float(text) != 1:
            return text + "x"
    return f"{r:.5f}x"


#: What each check asserts, in words (the figure's title and the verdict use them).
CHECK_TITLES = {
    "zp_zero_preemptions": "every zp setup 0 preemptions",
    "naive_preempts": "naive preempts",
    "zp_goodput_at_least_naive": "every zp setup's goodput >= naive's",
}


def storm_verdict(report: dict[str, Any]) -> list[str]:
    """The run's verdict, computed from its checks and metrics (the figure's title, printed last).

    Line 1: workload and every check in words with PASS/FAIL/n/a. Line 2: the focus setup
    (:func:`focus_setup`) against no-admission and naive: preemptions, goodput ratios, share within SLO.
    Line 3: every other setup's goodput relative to no-admission's (and naive's). Measurements only.
    """
    w = report["workload"]
    checks = report.get("checks", [])
    head = f"storm {w['name']} (seed {w['seed']}): "
    if checks:
        head += ";  ".join(f"{CHECK_TITLES.get(c['name'], c['name'])}: {_status(c['passed'])}"
                           for c in checks)
    else:
        head += "no checks are defined for this workload (only seed-burst has them)"
    if not report.get("valid", True):
        head += "  [SATURATED: not valid]"
    lines = [head]
    setups = report["setups"]
    by = {m["setup"]: m for m in setups}
    base, naive = by.get("no-admission"), by.get("naive")
    focus = focus_setup([m["setup"] for m in setups])
    if focus is not None:
        f = by[focus]
        refs = [r for r in (base, naive) if r is not None]
        pre = ", ".join(f"{r['setup']} {r['preemptions']}" for r in refs)
        gp = ", ".join(f"{_ratio(f['goodput_rps'], r['goodput_rps'])} {r['setup']}'s" for r in refs)
        slo = ", ".join(f"{r['setup']} {_pct(r['slo_attainment'])}" for r in refs)
        lines.append(f"{focus}: {f['preemptions']} preemptions" + (f" ({pre})" if pre else "")
                     + f"; goodput {f['goodput_rps']:.3f} good req/s" + (f" = {gp}" if gp else "")
                     + f"; {_pct(f['slo_attainment'])} of requests within SLO" + (f" ({slo})" if slo else ""))
        if report.get("bypass") and f.get("bypass"):
            lines.append(_bypass_verdict(report["bypass"], f, base))
    for cname in report.get("classes") or {}:
        lines.append(f"{cname} in SLO / late / failed: " + ", ".join(
            f"{m['setup']} {_split(m['classes'][cname])}" for m in setups
            if cname in (m.get("classes") or {})))
    if base is not None and base.get("goodput_rps"):
        others = [m for m in setups if m["setup"] not in ("no-admission", focus)]
        vs_naive = naive is not None and bool(naive.get("goodput_rps"))
        if others:
            lines.append("goodput vs no-admission's" + (" (naive's)" if vs_naive else "") + ": " + ", ".join(
                f"{m['setup']} {_ratio(m['goodput_rps'], base['goodput_rps'])}"
                + (f" ({_ratio(m['goodput_rps'], naive['goodput_rps'])})"
                   if vs_naive and naive is not None and m is not naive else "")
                for m in others))
    return lines


def _bypass_verdict(plan: dict[str, Any], f: dict[str, Any], base: dict[str, Any] | None) -> str:
    """The verdict's bypass line: the focus setup's admitted and bypass goodput and TTFT p99 (and
    no-admission's for the same requests)."""

    def both(m: dict[str, Any]) -> str:
        a, b = m["bypass"]["admitted"], m["bypass"]["bypass"]
        return (f"admitted {a['goodput_rps']:.3f} good req/s (TTFT p99 {_secs(a['ttft_p99'])}), bypass "
                f"{b['goodput_rps']:.3f} (TTFT p99 {_secs(b['ttft_p99'])})")

    line = (f"bypass {plan['fraction']:.0%} ({f.get('bypass_sent', 0)} requests around the budget): "
            f"{f['setup']} " + both(f))
    if base is not None and base.get("bypass"):
        line += "; no-admission, same requests: " + both(base)
    return line


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _pct2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def build_report(wl: Workload, facts: ServerFacts, runs: list[SetupRun], cfg: Any,
                 command: str) -> dict[str, Any]:
    metrics = [compute_metrics(r, wl, facts, cfg.speedup) for r in runs]
    by = {m["setup"]: m for m in metrics}
    ratios: dict[str, Any] = {}
    naive = by.get("naive")
    for m in metrics:
        if naive and naive["goodput_rps"]:
            m["goodput_vs_naive"] = _r(m["goodput_rps"] / naive["goodput_rps"], 3)
        else:
            m["goodput_vs_naive"] = None
    if naive:
        for name in ("zp-strict", "zp-elastic", "zp-oracle", "zp-redis", "zp-redis-elastic", "clairvoyant"):
            if name in by:
                ratios[f"{name}_goodput_vs_naive"] = by[name]["goodput_vs_naive"]
    checks = seed_burst_checks(metrics) if wl.name == "seed-burst" else []
    report = {
        "command": command,
        "workload": {"name": wl.name, "description": wl.description, "params": wl.params,
                     "summary": wl.summary(), "seed": cfg.seed,
                     "time_scale": cfg.time_scale, "load_scale": cfg.load_scale,
                     "gateway_timeout_s": wl.gateway_timeout_s},
        "slo": {"ttft_s": wl.slo.ttft_s, "tpot_s": wl.slo.tpot_s},
        "classes": {n: {"ttft_s": c.slo.ttft_s, "tpot_s": c.slo.tpot_s, "priority": c.priority}
                    for n, c in wl.classes.items()},
        "elastic_tuning": cfg.elastic.as_dict() if getattr(cfg, "elastic", None) is not None else {},
        "server": {"profile": cfg.profile, "num_gpu_blocks": facts.num_gpu_blocks,
                   "block_size": facts.block_size,
                   "max_model_len": facts.max_model_len, "speedup": cfg.speedup,
                   "clock": getattr(cfg, "clock", "real"),
                   "unloaded_itl_s": round(facts.unloaded_itl_s, 6),
                   "unloaded_ttft_s": round(facts.unloaded_ttft_s, 6),
                   "prefill_tokens_per_s": round(facts.prefill_tokens_per_s, 1)},
        "valid": all(m["valid"] for m in metrics),
        "setups": metrics,
        "ratios": ratios,
        "checks": checks,
        "timelines": {r.name: _thin(r.timeline, r.t0) for r in runs},
        "ttfts": {r.name: sorted(round(x.ttft, 4) for x in r.records if x.ok and x.ttft is not None)
                  for r in runs},
        "requests": {r.name: [x.to_json() for x in r.records] for r in runs},
        "bypass": _bypass_plan(runs),
        "limit_timelines": {r.name: [[t, lim] for t, lim in r.limit_timeline] for r in runs
                            if r.limit_timeline},
    }
    if any(is_fleet_run(r) for r in runs):
        report["fleet"] = {
            "replicas": getattr(cfg, "replicas", 1),
            "kill_replica_s": getattr(cfg, "kill_replica_s", None),
            "timeline": "per setup: the largest KV usage of any replica, the fleet's total preemptions, "
                        "running and waiting requests; replica_timelines: each replica's own",
            "replica_timelines": {r.name: [_thin(tl, r.t0) for tl in (r.replica_timelines or [])]
                                  for r in runs},
            "held_timelines": {r.name: _thin_held(r.held_timeline) for r in runs if r.held_timeline},
        }
    pd = getattr(cfg, "pd", None)
    if pd is not None:
        from zp_storm.runner import REAL_KV_LEASE_S, kv_lease_s

        report["pd"] = {"prefill": pd[0], "decode": pd[1], "kv_lease_s": kv_lease_s(wl, facts),
                        "kv_lease_rule": f"vLLM's kv_lease_duration {REAL_KV_LEASE_S:g} s scaled to the "
                                         "simulator as the gateway timeout is"}
    report["setup_notes"] = _setup_notes(wl, facts, metrics, runs)
    report["verdict"] = storm_verdict(report)
    return report


def _setup_notes(wl: Workload, facts: ServerFacts, metrics: list[dict[str, Any]],
                 runs: list[SetupRun]) -> dict[str, str]:
    """What the table must say next to a setup's name (``vllm-priority`` on a one-class workload, the
    ``*-slo`` setups' line) and the lines the header prints for the issue-30 setups."""
    from zp_storm.slo_setups import PRIORITY_SETUP, QUEUE_CAP_SETUP

    names = {m["setup"] for m in metrics}
    notes: dict[str, str] = {}
    if PRIORITY_SETUP in names and not wl.classes and all(t.priority is None for t in wl.iter_turns()):
        notes[PRIORITY_SETUP] = "one class: every request sends priority 0"
    if QUEUE_CAP_SETUP in names:
        cap = next((m.get("sim_settings") or {} for m in metrics if m["setup"] == QUEUE_CAP_SETUP), {})
        if cap.get("max_num_queued_tokens") is not None:
            notes[QUEUE_CAP_SETUP] = f"cap {cap['max_num_queued_tokens']} tokens"
    return notes


def setup_lines(report: dict[str, Any]) -> list[str]:
    """Header lines for the issue-30 setups that ran: the queue cap and its rule, the priority policy, the
    SLO line; and, for a workload with classes, each class's targets."""
    from zp_storm.slo_setups import PRIORITY_SETUP, QUEUE_CAP_SETUP, SLO_SETUPS, TARGET_HEADER

    lines: list[str] = []
    by = {m["setup"]: m for m in report["setups"]}
    classes = report.get("classes") or {}
    srv = report.get("server", {})
    if classes:
        lines.append("classes (each request scored against its own): " + "; ".join(
            f"{n}: TTFT <= {c['ttft_s']:g} s"
            + (f", TPOT <= {c['tpot_s'] * 1000:.0f} ms" if c.get("tpot_s") is not None
               else ", no TPOT target")
            + f", priority {c['priority']}" for n, c in classes.items()))
    q = by.get(QUEUE_CAP_SETUP)
    if q and (q.get("sim_settings") or {}).get("max_num_queued_tokens") is not None:
        ttft = min([c["ttft_s"] for c in classes.values()] or [report["slo"]["ttft_s"]])
        cap = q["sim_settings"]["max_num_queued_tokens"]
        lines.append(f"{QUEUE_CAP_SETUP}: --max-num-queued-tokens {cap} = "
                     f"TTFT target {ttft:g} s x measured prefill throughput "
                     f"{srv.get('prefill_tokens_per_s', 0):.0f} tokens/s (an ~8k-token prompt alone: prompt "
                     "tokens / TTFT); 503 when full, no Retry-After (as vLLM); naive's retries")
    if PRIORITY_SETUP in by:
        one = PRIORITY_SETUP in (report.get("setup_notes") or {})
        lines.append(f"{PRIORITY_SETUP}: server --scheduling-policy priority, no client admission; body "
                     "priority = the request's class's (a trace's own where it gives one)"
                     + (" (one class here: every request sends 0, i.e. arrival order)" if one else ""))
    ran = [n for n in SLO_SETUPS if n in by]
    if ran:
        note = report.get("setup_notes", {}).get(ran[0])
        lines.append(f"{', '.join(ran)}: the app sends each request's class TTFT target as {TARGET_HEADER}"
                     + (" and its priority as X-ZP-Priority" if classes else "") + "; budget line "
                     + ("FIFO (the installed LocalBudget takes no line=)" if note else "'slo'"))
    return lines


def _bypass_plan(runs: list[SetupRun]) -> dict[str, Any] | None:
    """The storm's bypass plan as the report keeps it (without the ids: the records carry ``bypass``),
    with the setups it applied to; None without ``--bypass``."""
    plan = next((r.bypass for r in runs if r.bypass is not None), None)
    if plan is None:
        return None
    out = {k: v for k, v in plan.items() if k not in ("ids", "applies")}
    out["setups"] = [r.name for r in runs if r.bypass and r.bypass.get("applies")]
    return out


_COLUMNS = [
    ("setup", "setup", None),
    ("preempt", "preemptions", None),
    ("recomp tok", "recomputed_tokens", None),
    ("KV max", "kv_usage_max", "{:.2f}"),
    ("TTFT p50", "ttft_p50", "{:.2f}"),
    ("TTFT p99", "ttft_p99", "{:.2f}"),
    ("ITL p50 ms", "itl_p50", "ms"),
    ("ITL p99 ms", "itl_p99", "ms"),
    ("p99 ITL/unl", "itl_p99_vs_unloaded", "{:.1f}x"),
    ("in SLO", "slo_attainment", "pct"),
    ("in SLO / late / failed", "outcome", "split"),
    ("good req/s", "goodput_rps", "{:.3f}"),
    ("good tok/s", "goodput_tps", "{:.0f}"),
    ("vs naive", "goodput_vs_naive", "{:.2f}x"),
    ("ampl", "amplification", "{:.2f}"),
    ("504s", "gateway_504", None),
    ("errors", "errors", None),
    ("makespan s", "makespan", "{:.1f}"),
]


def _fmt(v: Any, f: str | None) -> str:
    if v is None:
        return "-"
    if f == "ms":
        return f"{v * 1000:.1f}"
    if f == "pct":
        return f"{v * 100:.0f}%"
    if f == "list":
        return "/".join(str(x) for x in v)
    if f:
        return f.format(v)
    return str(v)


#: Extra columns of a fleet storm's table (``--replicas N`` / ``--kill-replica``).
_FLEET_COLUMNS = [
    ("prefix hit", "prefix_cache_hit_rate", "pct"),
    ("preempt/replica", "preemptions_per_replica", "list"),
    ("moved", "moved_off_dead", None),
    ("cut", "cut_streams", None),
]


#: Extra columns of a storm whose workload has conversations (``agentic``, ``mixed``) or classes.
_CONVERSATION_COLUMNS: list[tuple[str, str, str | None]] = [
    ("convs done", "conversations_completed", None),
    ("conv time p50", "conversation_time_p50", "{:.1f}"),
    ("conv time p99", "conversation_time_p99", "{:.1f}"),
]
_CLASS_COLUMNS: list[tuple[str, str, str | None]] = [
    ("per class in SLO / late / failed", "classes", "classes")]


def _split(m: dict[str, Any]) -> str:
    """``in SLO / late / failed`` of a metrics dictionary (a setup's or a class's)."""
    if m.get("in_slo") is None:
        return "-"
    return f"{m['in_slo']} / {m['late']} / {m['failed']}"


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    columns = _COLUMNS + (_FLEET_COLUMNS if report.get("fleet") else [])
    setups = report["setups"]
    if any(m.get("conversations") for m in setups):
        columns = columns + _CONVERSATION_COLUMNS
    if any(m.get("classes") for m in setups):
        columns = columns + _CLASS_COLUMNS
    notes = report.get("setup_notes") or {}
    head = [c[0] for c in columns]
    rows = []
    for m in setups:
        row = []
        for _, k, f in columns:
            if f == "split":
                row.append(_split(m))
            elif f == "classes":
                row.append("; ".join(f"{n} {_split(c)}" for n, c in (m.get("classes") or {}).items()) or "-")
            else:
                row.append(_fmt(m.get(k), f))
        if m["setup"] in notes:
            row[0] += f" ({notes[m['setup']]})"
        if not m["valid"]:
            row[0] += " (SATURATED)"
        rows.append(row)
    return head, rows


def _eff(w: dict[str, Any], key: str, alt: str | None = None) -> str:
    """The value a workload actually used (the CLI's, else the workload's default)."""
    if w.get(key) is not None:
        return str(w[key])
    p = w.get("params", {})
    v = p.get(key, p.get(alt) if alt else None)
    return "n/a" if v is None else f"{v} (default)"


#: The headline: what the demo measures, printed with every run.
MEASURES = ("measured: goodput = logical requests that succeeded within the SLO (TTFT <= {ttft:g} s, "
            "TPOT <= {tpot:.1f} ms) per virtual second of makespan; in SLO = those / requests sent; "
            "preemptions = the server's count; ampl = HTTP requests reaching the server / logical requests; "
            "in SLO / late / failed = requests that succeeded within their class's SLO / succeeded outside "
            "it / failed or were never sent (their conversation stopped after an error)")


def header_lines(report: dict[str, Any]) -> list[str]:
    w, s, slo = report["workload"], report["server"], report["slo"]
    lines = [
        f"workload {w['name']} (seed {w['seed']}): {w['description']}",
        f"server: profile {s['profile']}, {s['num_gpu_blocks']} blocks x {s['block_size']} tokens, "
        f"max_model_len {s['max_model_len']}, "
        + ("virtual clock (deterministic)" if s.get("clock") == "virtual" else
           f"real clock, speedup {s['speedup']}")
        + "; unloaded ITL "
        f"{s['unloaded_itl_s'] * 1000:.1f} ms, TTFT {s['unloaded_ttft_s'] * 1000:.0f} ms (virtual)",
        f"time_scale {_eff(w, 'time_scale')}, load_scale {_eff(w, 'load_scale', 'scale')}; "
        + (f"gateway timeout {w['gateway_timeout_s']} s (all setups but no-admission)"
           if w["gateway_timeout_s"] is not None else "no gateway timeout")
        + f"; SLO: TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s'] * 1000:.1f} ms "
        "(virtual; a non-streamed call must end within TTFT + output x TPOT)",
    ]
    lines.append(MEASURES.format(ttft=slo["ttft_s"], tpot=slo["tpot_s"] * 1000))
    lines += setup_lines(report)
    pdr = report.get("pd")
    if pdr:
        lines.append(f"P/D: {pdr['prefill']} prefill + {pdr['decode']} decode servers for the pd-* setups, "
                     f"the other setups colocated on {pdr['prefill'] + pdr['decode']} plain ones; prefill KV "
                     f"lease {pdr['kv_lease_s']:g} s virtual ({pdr['kv_lease_rule']})")
    fleet = report.get("fleet")
    if fleet:
        lines.append(f"fleet: {fleet['replicas']} replicas of that server per setup, the load scaled by "
                     f"{fleet['replicas']}; KV max: the largest of any replica; preempt: the fleet's sum; "
                     "prefix hit: cached / queried prompt tokens over the replicas; moved: attempts a "
                     "setup's router sent elsewhere after a transport failure; cut: streams cut after "
                     "content reached the caller")
        if fleet.get("kill_replica_s") is not None:
            kills = [f"{m['setup']}: replica {m['killed_replica']} at {m['killed_at_s']:g} s "
                     f"({m['killed_in_flight']} in flight)" if m.get("killed_replica") is not None
                     else f"{m['setup']}: none (the run ended first)" for m in report["setups"]]
            lines.append(f"kill at {fleet['kill_replica_s']:g} s (the replica with the most requests in "
                         "flight, abruptly): " + "; ".join(kills))
        for m in report["setups"]:
            if m["setup"] == "rr-zp" and m.get("limit_blocks") is not None:
                lines.append(f"rr-zp limit: {m['limit_blocks']} blocks, the sum of the replicas' zp limits "
                             "(floor((num_gpu_blocks - 1) x 0.95) each)")
    for m in report["setups"]:
        if m["setup"] == "rate-limited" and m.get("rate_rps") is not None:
            lines.append(f"rate-limited: InMemoryRateLimiter at {m['rate_rps']:.3f} req/s (virtual), the "
                         "no-admission run's completed requests per second")
        if m["setup"] == "zp-strict" and m.get("limit_blocks") is not None:
            lines.append(f"zp limit: {m['limit_blocks']} blocks = floor((num_gpu_blocks - 1) x 0.95) for the "
                         "strict setups, num_gpu_blocks read from /metrics vllm:cache_config_info")
    if any(m["setup"] in ("zp-elastic", "zp-oracle", "zp-redis-elastic") for m in report["setups"]):
        from zp_client.server import ELASTIC_HEADROOM, suggest_limit_blocks

        n = report.get("server", {}).get("num_gpu_blocks")
        tuned = report.get("elastic_tuning", {}).get("headroom")
        if n and tuned is not None:
            lines.append(f"elastic limit: {suggest_limit_blocks(n, tuned)} blocks = "
                         f"floor((num_gpu_blocks - 1) x {tuned:g}), the run's tuned headroom "
                         f"(default {ELASTIC_HEADROOM:g})")
        elif n:
            lines.append(f"elastic limit: {suggest_limit_blocks(n)} blocks = floor((num_gpu_blocks - 1) x "
                         f"{ELASTIC_HEADROOM:g}), what suggest_limit_blocks recommends for elastic")
    return lines


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


_BYPASS_COLUMNS = [
    ("requests", "requests", None),
    ("in SLO", "slo_attainment", "pct"),
    ("good req/s", "goodput_rps", "{:.3f}"),
    ("good tok/s", "goodput_tps", "{:.0f}"),
    ("TTFT p50", "ttft_p50", "{:.2f}"),
    ("TTFT p99", "ttft_p99", "{:.2f}"),
    ("errors", "errors", None),
]


def bypass_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]] | None:
    """The admitted / bypass table (one row per setup: each group's metrics side by side), or None
    without ``--bypass``. Setups the bypass does not apply to show the same requests, marked ``(ref)``."""
    if not report.get("bypass"):
        return None
    head = ["setup", "bypassed"] + [f"adm {h}" for h, _, _ in _BYPASS_COLUMNS] + [
        f"byp {h}" for h, _, _ in _BYPASS_COLUMNS]
    rows = []
    for m in report["setups"]:
        split = m.get("bypass")
        if not split:
            continue
        label = m["setup"] + ("" if split["applies"] else " (ref)")
        rows.append([label, str(m.get("bypass_sent", 0))]
                    + [_fmt(split["admitted"].get(k), f) for _, k, f in _BYPASS_COLUMNS]
                    + [_fmt(split["bypass"].get(k), f) for _, k, f in _BYPASS_COLUMNS])
    return head, rows


def bypass_lines(report: dict[str, Any]) -> list[str]:
    """What the bypass split means, in words (printed above its table); empty without ``--bypass``."""
    b = report.get("bypass")
    if not b:
        return []
    window = b.get("window")
    when = ("the whole run" if window is None else
            f"requests submitted in [{window[0]:g}, {'end' if window[1] is None else f'{window[1]:g}'}) "
            "virtual s of the run")
    return [f"bypass: {b['fraction']:.0%} of the logical requests ({b['selected']} of {b['total']}, chosen "
            f"from seed {b['seed']}) sent by {', '.join(b['setups']) or 'no setup'} straight to the server, "
            f"unadmitted, during {when}; client: {b['client']}",
            "adm = admitted (the rest), byp = bypass; goodput per virtual second of the whole run's "
            "makespan (the two add up to the setup's); setups marked (ref) have no budget to go around: "
            "their columns split the same requests for comparison"]


def markdown_table(report: dict[str, Any]) -> str:
    """The storm table as GitHub markdown (and, with ``--bypass``, the admitted / bypass table)."""
    out = _markdown(*table_rows(report))
    split = bypass_rows(report)
    if split is not None:
        out += "\n\n" + _markdown(*split)
    return out


def print_table(report: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for line in header_lines(report):
        console.print(line, highlight=False, soft_wrap=True)
    head, rows = table_rows(report)
    table = Table(title=f"storm: {report['workload']['name']}", show_lines=False)
    for h in head:
        table.add_column(h, justify="left" if h == "setup" else "right", no_wrap=h == "setup")
    for r in rows:
        table.add_row(*r)
    console.print(table)
    split = bypass_rows(report)
    if split is not None:
        for line in bypass_lines(report):
            console.print(line, highlight=False, soft_wrap=True)
        bt = Table(title=f"storm: {report['workload']['name']}, admitted vs bypass")
        for h in split[0]:
            bt.add_column(h, justify="left" if h == "setup" else "right", no_wrap=h == "setup")
        for r in split[1]:
            bt.add_row(*r)
        console.print(bt)
    for name, tl in (report.get("limit_timelines") or {}).items():
        limits = [lim for _, lim in tl]
        console.print(f"limit {name}: {limits[0]} blocks at the start, {len(tl) - 1} changes, min "
                      f"{min(limits)}, max {max(limits)}, final {limits[-1]} (limit.png)", highlight=False)
    for k, v in report["ratios"].items():
        console.print(f"{k}: {v if v is not None else '-'}x", highlight=False)
    for m in report["setups"]:
        h = m["harness"]
        if h.get("clock") == "virtual":
            busy = ""
            if "read_pauses_held" in h:
                busy = (f"; busy client (modelled, duty {h['client_load']:g}): {h['read_pauses_held']} reads "
                        f"held, read lag p99 {h['read_lag_p99_ms']} ms (virtual)")
            console.print(f"harness {m['setup']}: virtual clock, {h['wall_s']:.1f} s wall for "
                          f"{m['makespan']:.1f} virtual s ({m['effective_speedup']}x), "
                          f"CPU {h['cpu_frac']:.0%} of a core{busy}", highlight=False)
            continue
        console.print(f"harness {m['setup']}: effective speedup {m['effective_speedup']}x, event-loop lag "
                      f"p99 {h['loop_lag_p99_ms']} ms / max {h['loop_lag_max_ms']} ms (wall), "
                      f"CPU {h['cpu_frac']:.0%} of a core, simulator max lag {m['sim_max_lag_s']} virtual s",
                      highlight=False)
    if any(m.get("pd") for m in report["setups"]):
        for m in report["setups"]:
            line = (f"tail SLO {m['setup']}: {m['good_tail']} of {m['sent']} requests also with every "
                    f"inter-token gap <= 5x the unloaded ITL: {m['goodput_tail_rps']} good req/s")
            for role, p in (m.get("pd") or {}).items():
                line += (f"; {role} pool ({p['servers']}): preempt {p['preemptions']}, KV max "
                         f"{p['kv_usage_max']}, expired leases {p['expired']}, freed on read "
                         f"{p['freed_read']} / abort {p['freed_abort']}, pulls {p['remote']} "
                         f"({p['pulled_blocks']} blocks), local prefills {p['local_fallback']}, reads of "
                         f"freed KV {p.get('read_freed', 0)}")
                if role == "decode" and p.get("itl_p99_ms") is not None:
                    line += (f", ITL p50/p99 {p['itl_p50_ms']}/{p['itl_p99_ms']} ms, transfer wait p50/p99 "
                             f"{p['transfer_wait_p50_s']}/{p['transfer_wait_p99_s']} s")
            held = m.get("held_deficit")
            if held:
                line += (f"; budget vs server blocks: {held['deficit_samples']} of {held['samples']} samples "
                         f"with a replica allocated above charged (largest {held['max_deficit_blocks']}), "
                         f"after the run charged {held['charged_after']} / allocated "
                         f"{held['allocated_after']}")
            if m.get("pd_counts"):
                line += f"; two-phase lease {m['pd_counts']}"
            console.print(line, highlight=False)
    for m in report["setups"]:
        pf = m.get("prefix")
        if pf:
            console.print(
                f"prefix {m['setup']}: cold prefills {pf['cold_prefills']} (per type "
                f"{pf['cold_per_type']} of {pf['later_calls_per_type']} later calls; two rarest "
                f"{_pct(pf['cold_share_rarest2'])}), "
                f"hit {_pct(pf['hit_rate'])}, TTFT p50 per type {pf['ttft_p50_per_type']}, keep-warms "
                f"{pf['keepwarm_requests']} ({_pct2(pf['keepwarm_requests_share'])} of requests, "
                f"{pf['keepwarm_computed_tokens']} computed tokens = "
                f"{_pct2(pf['keepwarm_tokens_share'])} of the server's)",
                highlight=False)
    for m in report["setups"]:
        if not m["valid"]:
            console.print(f"[bold red]{m['setup']}: harness saturated, numbers not valid:[/] "
                          + "; ".join(m["saturation"]))


def print_checks(report: dict[str, Any], console: Any = None) -> None:
    """Print every check as one line, ``check NAME: PASS|FAIL|n/a - detail`` with its numbers, then the
    verdict (:func:`storm_verdict`)."""
    from rich.console import Console
    from rich.text import Text

    console = console or Console()
    checks = report.get("checks", [])
    if not checks:
        console.print(f"checks: none defined for workload {report['workload']['name']} (only seed-burst has "
                      "them)", highlight=False, soft_wrap=True)
    style = {True: "bold green", False: "bold red", None: "yellow"}
    for c in checks:
        console.print(Text.assemble(f"check {c['name']}: ", (_status(c["passed"]), style[c["passed"]]),
                                    f" - {c['detail']}"), soft_wrap=True)
    for i, line in enumerate(report.get("verdict") or storm_verdict(report)):
        console.print(Text.assemble(("verdict: " if i == 0 else "         ", "bold"), line), soft_wrap=True)


def write_png(report: dict[str, Any], path: Path) -> None:
    """Draw ``storm.png`` (see :func:`zp_storm.figures.write_storm_png`), titled by the verdict."""
    from zp_storm.figures import write_storm_png

    write_storm_png(report, path, report.get("verdict") or storm_verdict(report))


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jp = out_dir / "report.json"
    jp.write_text(json.dumps(report, indent=1))
    pp = out_dir / "storm.png"
    write_png(report, pp)
    if report.get("limit_timelines"):
        from zp_storm.figures import write_limit_png

        write_limit_png(report, out_dir / "limit.png")
    return jp, pp


# --- the sweep over offered load (``zp-client storm --sweep 0.5,1,2,4``) ---

#: A setup's goodput *collapses* at the first load where it is more than this fraction below the best
#: goodput the same setup reached at any lower load (goodput, unlike throughput, falls when retries
#: and thrashing push requests out of the SLO; a plateau is not a collapse).
COLLAPSE_DROP = 0.20
COLLAPSE_RULE = (f"collapse = the first offered load whose goodput is more than {COLLAPSE_DROP:.0%} below "
                 "the best goodput of the same setup at a lower load")

#: Per setup and load, the metrics a sweep keeps (keys of :func:`compute_metrics`), plus the ratios
#: ``goodput_vs_no_admission`` and ``goodput_vs_naive`` it computes.
SWEEP_METRICS = ("goodput_rps", "goodput_tps", "slo_attainment", "amplification", "preemptions",
                 "gateway_504", "ttft_p50", "ttft_p99", "makespan", "errors", "sent", "good", "valid",
                 "bypass_sent", "admitted_goodput_rps", "admitted_ttft_p99", "bypass_goodput_rps",
                 "bypass_ttft_p99", "in_slo", "late", "failed", "late_ttft_p99", "late_ttft_max",
                 "conversations", "conversations_completed", "conversation_time_p50", "conversation_time_p99",
                 "classes")


def collapse_point(loads: list[float], goodputs: list[float | None]) -> dict[str, Any]:
    """Where one setup's goodput collapses by :data:`COLLAPSE_DROP` (``loads`` ascending).

    Returns ``collapse_load`` (None if it never does), ``goodput_at_collapse``, ``best_before`` /
    ``best_before_load`` (the best goodput below that load), ``drop`` (fraction below it), and the
    sweep's ``peak_goodput`` / ``peak_load``. Loads where the setup did not run (None) are skipped.
    """
    pts = [(x, g) for x, g in zip(loads, goodputs, strict=True) if g is not None]
    out: dict[str, Any] = {"collapse_load": None, "goodput_at_collapse": None, "best_before": None,
                           "best_before_load": None, "drop": None, "peak_goodput": None, "peak_load": None}
    if pts:
        peak = max(pts, key=lambda p: p[1])
        out["peak_load"], out["peak_goodput"] = peak
    best: tuple[float, float] | None = None
    for x, g in pts:
        if best is not None and g < (1 - COLLAPSE_DROP) * best[1]:
            out.update(collapse_load=x, goodput_at_collapse=g, best_before=best[1], best_before_load=best[0],
                       drop=_r(1 - g / best[1], 3))
            break
        if best is None or g > best[1]:
            best = (x, g)
    return out


def build_sweep_report(loads: list[float], reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One sweep from one :func:`build_report` per offered load (``loads[i]`` x the arrival rate).

    ``metrics[setup][key]`` is a list aligned with ``loads`` (sorted ascending), None where the setup did
    not run at that load; keys: :data:`SWEEP_METRICS` plus ``goodput_vs_no_admission`` and
    ``goodput_vs_naive``. ``collapse[setup]`` is :func:`collapse_point`; ``checks`` holds every load's
    checks with their load; ``verdict`` is :func:`sweep_verdict`.
    """
    if not loads or len(loads) != len(reports):
        raise ValueError(f"a sweep needs one report per load: {len(loads)} loads, {len(reports)} reports")
    if len(set(loads)) != len(loads) or any(not x > 0 for x in loads):
        raise ValueError(f"sweep loads must be distinct and > 0, got {loads}")
    pairs = sorted(zip(loads, reports, strict=True), key=lambda p: p[0])
    xs = [float(x) for x, _ in pairs]
    names: list[str] = []
    for _, rep in pairs:
        names += [m["setup"] for m in rep["setups"] if m["setup"] not in names]
    metrics: dict[str, dict[str, list[Any]]] = {n: {k: [] for k in SWEEP_METRICS} for n in names}
    for _, rep in pairs:
        by = {m["setup"]: m for m in rep["setups"]}
        base, naive = by.get("no-admission"), by.get("naive")
        for n in names:
            m = by.get(n)
            for k in SWEEP_METRICS:
                metrics[n][k].append(m.get(k) if m else None)
            for key, ref in (("goodput_vs_no_admission", base), ("goodput_vs_naive", naive)):
                v = (_r(m["goodput_rps"] / ref["goodput_rps"], 3)
                     if m and ref and ref.get("goodput_rps") and m.get("goodput_rps") is not None else None)
                metrics[n].setdefault(key, []).append(v)
    first = pairs[0][1]
    w = first["workload"]
    sweep: dict[str, Any] = {
        "loads": xs,
        "workload": {"name": w["name"], "seed": w["seed"], "descriptions": [r["workload"]["description"]
                                                                            for _, r in pairs]},
        "slo": first.get("slo", {}),
        "server": first.get("server", {}),
        "commands": [r.get("command") for _, r in pairs],
        "setups": names,
        "metrics": metrics,
        "collapse_rule": COLLAPSE_RULE,
        "collapse": {n: collapse_point(xs, metrics[n]["goodput_rps"]) for n in names},
        "checks": [{"load": x, **c} for x, r in pairs for c in r.get("checks", [])],
        "valid_per_load": [bool(r.get("valid", True)) for _, r in pairs],
    }
    sweep["valid"] = all(sweep["valid_per_load"])
    sweep["verdict"] = sweep_verdict(sweep)
    return sweep


def _load(x: float) -> str:
    return f"{x:g}x"


def sweep_verdict(sweep: dict[str, Any]) -> list[str]:
    """The sweep's verdict, computed from its numbers: where naive's goodput collapses (by
    :data:`COLLAPSE_RULE`) or that it does not; the focus setup's goodput relative to no-admission's
    and naive's at every load, and its preemptions; which other setups collapse."""
    xs, w = sweep["loads"], sweep["workload"]
    met, col = sweep["metrics"], sweep["collapse"]
    head = f"zp-client storm sweep {w['name']} (seed {w['seed']}), offered load {', '.join(map(_load, xs))}: "
    if "naive" in col:
        c = col["naive"]
        if c["collapse_load"] is not None:
            head += (f"naive's goodput collapses at {_load(c['collapse_load'])} "
                     f"({c['goodput_at_collapse']:.3f} good req/s, {c['drop']:.0%} below its "
                     f"{c['best_before']:.3f} at "
                     f"{_load(c['best_before_load'])})")
        else:
            head += f"naive's goodput does not collapse up to {_load(xs[-1])}"
    else:
        head += "no naive setup in this sweep"
    if not sweep.get("valid", True):
        bad = [_load(x) for x, v in zip(xs, sweep["valid_per_load"], strict=True) if not v]
        head += f"  [SATURATED at {', '.join(bad)}: not valid]"
    lines = [head]
    focus = focus_setup(sweep["setups"])
    if focus is not None:
        f = met[focus]
        for key, ref in (("goodput_vs_no_admission", "no-admission"), ("goodput_vs_naive", "naive")):
            if ref in met:
                vals = zip(xs, f[key], strict=True)
                lines.append(f"{focus} goodput x {ref}'s: " + ", ".join(
                    f"{_load(x)} {'n/a' if v is None else f'{v:.2f}x'}" for x, v in vals))
        lines.append("preemptions per load (" + " / ".join(map(_load, xs)) + "): " + "; ".join(
            f"{n} " + "/".join("-" if v is None else str(v) for v in met[n]["preemptions"])
            for n in [focus, *[r for r in _REFERENCES if r in met]]))
    others = [n for n in sweep["setups"] if n != "naive"]
    if others:
        lines.append(COLLAPSE_RULE + ": " + ", ".join(
            f"{n} " + ("none" if col[n]["collapse_load"] is None
                       else f"at {_load(col[n]['collapse_load'])} (-{col[n]['drop']:.0%})") for n in others))
    return lines + best_per_load(sweep)


def best_at(sweep: dict[str, Any], i: int, key: str, *, lowest: bool = False) -> tuple[list[str], Any]:
    """The setups with the best ``key`` at load index ``i`` (the highest, or the lowest with ``lowest``;
    several on a tie) and that value; ``([], None)`` when no setup has it there."""
    vals = {n: sweep["metrics"][n][key][i] for n in sweep["setups"]
            if key in sweep["metrics"][n] and sweep["metrics"][n][key][i] is not None}
    if not vals:
        return [], None
    best = min(vals.values()) if lowest else max(vals.values())
    return [n for n in sweep["setups"] if vals.get(n) == best], best


def best_per_load(sweep: dict[str, Any]) -> list[str]:
    """The verdict's lines naming, per load, the best setup by requests within the SLO (count) and by
    makespan (shortest), with their values."""
    xs = sweep["loads"]
    by_slo, by_span = [], []
    for i, x in enumerate(xs):
        names, v = best_at(sweep, i, "in_slo")
        if not names:
            names, v = best_at(sweep, i, "good")
        if names:
            sent = sweep["metrics"][names[0]]["sent"][i]
            by_slo.append(f"{_load(x)} {' = '.join(names)} ({v}" + (f" / {sent})" if sent else ")"))
        names, v = best_at(sweep, i, "makespan", lowest=True)
        if names:
            by_span.append(f"{_load(x)} {' = '.join(names)} ({v:.1f} s)")
    out = []
    if by_slo:
        out.append("best by requests within SLO: " + "; ".join(by_slo))
    if by_span:
        out.append("best by makespan: " + "; ".join(by_span))
    return out


_SWEEP_COLUMNS = [
    ("good req/s", "goodput_rps", "{:.3f}"),
    ("x no-adm", "goodput_vs_no_admission", "{:.2f}x"),
    ("x naive", "goodput_vs_naive", "{:.2f}x"),
    ("in SLO", "slo_attainment", "pct"),
    ("ampl", "amplification", "{:.2f}"),
    ("preempt", "preemptions", None),
    ("504s", "gateway_504", None),
    ("TTFT p50", "ttft_p50", "{:.2f}"),
    ("TTFT p99", "ttft_p99", "{:.2f}"),
    ("makespan s", "makespan", "{:.1f}"),
    ("in SLO / late / failed", "in_slo", "split"),
]


_SWEEP_BYPASS_COLUMNS = [
    ("bypassed", "bypass_sent", None),
    ("adm good/s", "admitted_goodput_rps", "{:.3f}"),
    ("adm TTFT p99", "admitted_ttft_p99", "{:.2f}"),
    ("byp good/s", "bypass_goodput_rps", "{:.3f}"),
    ("byp TTFT p99", "bypass_ttft_p99", "{:.2f}"),
]


def sweep_rows(sweep: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The sweep table: one row per (setup, load), setups in run order, loads ascending; with
    ``--bypass``, the admitted / bypass columns too."""
    columns = list(_SWEEP_COLUMNS)
    met = sweep["metrics"]
    if any(v is not None for n in sweep["setups"] for v in met[n].get("admitted_goodput_rps", [])):
        columns += _SWEEP_BYPASS_COLUMNS
    head = ["setup", "load"] + [c[0] for c in columns]
    rows = []
    for n in sweep["setups"]:
        m = sweep["metrics"][n]
        for i, x in enumerate(sweep["loads"]):
            if m["goodput_rps"][i] is None and m["sent"][i] is None:
                continue
            label = n + ("" if m["valid"][i] in (True, None) else " (SATURATED)")
            rows.append([label, _load(x)] + [
                _split({k2: m.get(k2, [None] * (i + 1))[i] for k2 in ("in_slo", "late", "failed")})
                if f == "split" else _fmt(m[k][i], f) for _, k, f in columns])
    return head, rows


def sweep_markdown_table(sweep: dict[str, Any]) -> str:
    """The sweep table as GitHub markdown."""
    return _markdown(*sweep_rows(sweep))


def print_sweep_table(sweep: dict[str, Any], console: Any = None) -> None:
    """Print the sweep: what it measures, one table (a section per setup, a row per load), the verdict,
    and per load how many checks held (the failed ones with their detail)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    slo = sweep.get("slo", {})
    if slo:
        console.print(MEASURES.format(ttft=slo["ttft_s"], tpot=slo["tpot_s"] * 1000), highlight=False,
                      soft_wrap=True)
    console.print("offered load = the workload's arrival rate x load (request sizes unchanged)",
                  highlight=False)
    head, rows = sweep_rows(sweep)
    table = Table(title=f"storm sweep: {sweep['workload']['name']}")
    for h in head:
        table.add_column(h, justify="left" if h in ("setup", "load") else "right", no_wrap=h == "setup")
    prev = None
    for r in rows:
        name = r[0].split(" ")[0]
        if prev is not None and name != prev:
            table.add_section()
        table.add_row(*r)
        prev = name
    console.print(table)
    for i, line in enumerate(sweep["verdict"]):
        console.print(Text.assemble(("verdict: " if i == 0 else "         ", "bold"), line), soft_wrap=True)
    for x in sweep["loads"]:
        cs = [c for c in sweep["checks"] if c["load"] == x]
        if not cs:
            continue
        held = sum(1 for c in cs if c["passed"])
        console.print(f"load {_load(x)}: {held} of {len(cs)} checks hold", highlight=False)
        for c in cs:
            if not c["passed"]:
                console.print(f"  check {c['name']}: {_status(c['passed'])} - {c['detail']}", highlight=False,
                              soft_wrap=True)


def write_sweep_png(sweep: dict[str, Any], path: Path) -> None:
    """Draw ``sweep.png`` (see :func:`zp_storm.figures.write_sweep_png`)."""
    from zp_storm.figures import write_sweep_png as draw

    draw(sweep, path)


def write_sweep_report(sweep: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``sweep.json`` and ``sweep.png`` to ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    jp = out_dir / "sweep.json"
    jp.write_text(json.dumps(sweep, indent=1))
    pp = out_dir / "sweep.png"
    write_sweep_png(sweep, pp)
    return jp, pp
