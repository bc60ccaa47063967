"""Storm metrics, the terminal table, ``report.json`` and the PNG.

Every time figure is virtual seconds (the simulator's clock). A run is ``valid`` only if the harness kept
up (``SPEEDUP_KEPT``, ``CPU_SATURATED``). What each metric measures: see docs/benchmark.md#metrics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from zp_client.bench.loadgen import RequestRecord
from zp_client.bench.runner import SetupRun
from zp_client.bench.workloads import ServerFacts, Workload

__all__ = ["CPU_SATURATED", "compute_metrics", "build_report", "print_table", "write_png", "write_report"]

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


def compute_metrics(run: SetupRun, wl: Workload, facts: ServerFacts, speedup: float) -> dict[str, Any]:
    recs = run.records
    sent = [r for r in recs if r.sent]
    ok = [r for r in sent if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls()]
    ends = [r.t_end for r in sent if r.t_end is not None]
    makespan = max(ends) if ends else 0.0
    good = [r for r in ok if wl.slo.met(r.ttft, r.tpot, streamed=r.stream, out_tokens=r.out_tokens,
                                        e2e=_e2e(r))]
    st = run.server_stats
    eng = st.get("engine", {})
    reqs = st.get("requests", 0)
    # with ?requests=1 the count is replaced by the per-request records (one per HTTP request)
    attempts_server = len(reqs) if isinstance(reqs, list) else int(reqs)
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
        "slo_attainment": _r(len(good) / len(sent) if sent else None, 3),
        "attempts_server": attempts_server,
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
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[str(i)] = out.get(str(i), 0) + 1
    return out


def _thin(timeline: list[tuple[float, float, int, int, int]], t0: float, n: int = 600) -> list[list[float]]:
    step = max(1, len(timeline) // n)
    return [[round(t - t0, 4), round(kv, 4), p, run, wait] for (t, kv, p, run, wait) in timeline[::step]]


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
    checks: dict[str, Any] = {}
    if wl.name == "seed-burst":
        zp = [m for m in metrics if m["setup"].startswith("zp-")]
        checks = {
            "zp_zero_preemptions": all(m["preemptions"] == 0 for m in zp) if zp else None,
            "naive_preempts": (naive["preemptions"] > 0) if naive else None,
            "zp_goodput_at_least_naive": (all((m["goodput_rps"] or 0) >= (naive["goodput_rps"] or 0)
                                              for m in zp) if (zp and naive) else None),
        }
    return {
        "command": command,
        "workload": {"name": wl.name, "description": wl.description, "params": wl.params,
                     "summary": wl.summary(), "seed": cfg.seed,
                     "time_scale": cfg.time_scale, "load_scale": cfg.load_scale,
                     "gateway_timeout_s": wl.gateway_timeout_s},
        "slo": {"ttft_s": wl.slo.ttft_s, "tpot_s": wl.slo.tpot_s},
        "elastic_tuning": cfg.elastic.as_dict() if getattr(cfg, "elastic", None) is not None else {},
        "server": {"profile": cfg.profile, "num_gpu_blocks": facts.num_gpu_blocks,
                   "block_size": facts.block_size,
                   "max_model_len": facts.max_model_len, "speedup": cfg.speedup,
                   "unloaded_itl_s": round(facts.unloaded_itl_s, 6),
                   "unloaded_ttft_s": round(facts.unloaded_ttft_s, 6)},
        "valid": all(m["valid"] for m in metrics),
        "setups": metrics,
        "ratios": ratios,
        "checks": checks,
        "timelines": {r.name: _thin(r.timeline, r.t0) for r in runs},
        "ttfts": {r.name: sorted(round(x.ttft, 4) for x in r.records if x.ok and x.ttft is not None)
                  for r in runs},
        "requests": {r.name: [x.to_json() for x in r.records] for r in runs},
    }


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
    if f:
        return f.format(v)
    return str(v)


def table_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = [c[0] for c in _COLUMNS]
    rows = []
    for m in report["setups"]:
        row = [_fmt(m.get(k), f) for _, k, f in _COLUMNS]
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


def header_lines(report: dict[str, Any]) -> list[str]:
    w, s, slo = report["workload"], report["server"], report["slo"]
    lines = [
        f"workload {w['name']} (seed {w['seed']}): {w['description']}",
        f"server: profile {s['profile']}, {s['num_gpu_blocks']} blocks x {s['block_size']} tokens, "
        f"max_model_len {s['max_model_len']}, speedup {s['speedup']}; unloaded ITL "
        f"{s['unloaded_itl_s'] * 1000:.1f} ms, TTFT {s['unloaded_ttft_s'] * 1000:.0f} ms (virtual)",
        f"time_scale {_eff(w, 'time_scale')}, load_scale {_eff(w, 'load_scale', 'scale')}; "
        + (f"gateway timeout {w['gateway_timeout_s']} s (all setups but no-admission)"
           if w["gateway_timeout_s"] is not None else "no gateway timeout")
        + f"; SLO: TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s'] * 1000:.1f} ms "
        "(virtual; a non-streamed call must end within TTFT + output x TPOT)",
    ]
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


def markdown_table(report: dict[str, Any]) -> str:
    head, rows = table_rows(report)
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


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
    for k, v in report["ratios"].items():
        console.print(f"{k}: {v if v is not None else '-'}x", highlight=False)
    for k, v in report["checks"].items():
        console.print(f"check {k}: {'PASS' if v else ('n/a' if v is None else 'FAIL')}", highlight=False)
    for m in report["setups"]:
        h = m["harness"]
        console.print(f"harness {m['setup']}: effective speedup {m['effective_speedup']}x, event-loop lag "
                      f"p99 {h['loop_lag_p99_ms']} ms / max {h['loop_lag_max_ms']} ms (wall), "
                      f"CPU {h['cpu_frac']:.0%} of a core, simulator max lag {m['sim_max_lag_s']} virtual s",
                      highlight=False)
    for m in report["setups"]:
        if not m["valid"]:
            console.print(f"[bold red]{m['setup']}: harness saturated, numbers not valid:[/] "
                          + "; ".join(m["saturation"]))


def write_png(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 11))
    ax_kv, ax_pre, ax_cdf = axes
    for name, tl in report["timelines"].items():
        if not tl:
            continue
        ts = [p[0] for p in tl]
        ax_kv.plot(ts, [p[1] for p in tl], label=name, lw=1)
        ax_pre.step(ts, [p[2] for p in tl], where="post", label=name, lw=1)
    for name, ttfts in report["ttfts"].items():
        if ttfts:
            n = len(ttfts)
            ax_cdf.step(ttfts, [(i + 1) / n for i in range(n)], where="post", label=name, lw=1)
    ax_kv.set(title="KV cache usage (server)", xlabel="virtual s", ylabel="usage", ylim=(0, 1.05))
    ax_pre.set(title="preemptions (cumulative, server)", xlabel="virtual s", ylabel="preemptions")
    ax_cdf.set(title="TTFT CDF (client-observed, queue wait included)", xlabel="TTFT, virtual s (log)",
               ylabel="fraction of requests")
    ax_cdf.set_xscale("symlog", linthresh=0.1)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    w = report["workload"]
    fig.suptitle(f"zp-client storm: {w['name']} (seed {w['seed']})"
                 + ("" if report["valid"] else "  [SATURATED]"))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(report: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    jp = out_dir / "report.json"
    jp.write_text(json.dumps(report, indent=1))
    pp = out_dir / "storm.png"
    write_png(report, pp)
    return jp, pp
