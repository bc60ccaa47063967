"""The report's split of requests (in SLO / completed late / failed), per class and per conversation, and
the sweep verdict's best setup per load: built by the real report code from records made by hand."""

from __future__ import annotations

from typing import Any

import pytest

from zp_storm import figures
from zp_storm.loadgen import RequestRecord
from zp_storm.report import build_report, build_sweep_report, outcome_counts, sweep_markdown_table
from zp_storm.runner import SetupRun, StormConfig
from zp_storm.workloads import SLO, RequestClass, ServerFacts, Workload

FACTS = ServerFacts(num_gpu_blocks=513, block_size=16, max_model_len=4096, unloaded_itl_s=0.004)
CLASSES = {"interactive": RequestClass("interactive", SLO(1.0, 0.04), 0),
           "batch": RequestClass("batch", SLO(30.0, None), 1)}


def _wl(classes: bool = True) -> Workload:
    return Workload("mixed" if classes else "agentic", "synthetic", [], SLO(1.0, 0.04) if classes
                    else SLO(5.0, 0.04), None, classes=dict(CLASSES) if classes else {})


def _rec(rid: str, cls: str | None, ttft: float | None, *, ok: bool = True, sent: bool = True,
         root: str = "", kind: str = "agent", submit: float = 0.0, tpot: float = 0.02) -> RequestRecord:
    times = [] if ttft is None else [submit + ttft + k * tpot for k in range(5)]
    return RequestRecord(rid, root or rid, kind, 100, 64, 5, t_submit=submit if sent else None,
                         t_first=times[0] if times else None, t_end=times[-1] if times else (submit if sent
                                                                                             else None),
                         out_tokens=5 if ok else 0, attempts=1 if sent else 0, ok=ok and sent, sent=sent,
                         token_times=times, slo_class=cls, root=root or rid,
                         error=None if ok and sent else ("APIError" if sent else "conversation stopped"))


def _setup_run(name: str, recs: list[RequestRecord], makespan: float) -> SetupRun:
    timeline = [(0.0, 0.5, 0, 1, 0), (makespan, 0.5, 0, 0, 0)]
    stats = {"engine": {"preemptions_total": 0}, "requests": len([r for r in recs if r.sent]),
             "gateway_504": 0}
    return SetupRun(name, recs, stats, timeline, 0.0, {"wall_s": 1.0, "clock": "virtual"}, None)


def _cfg() -> StormConfig:
    return StormConfig(workload="mixed", seed=4, profile="tiny", num_gpu_blocks=None)


def test_each_request_is_scored_against_its_own_class() -> None:
    wl = _wl()
    recs = [
        _rec("i0", "interactive", 0.5, kind="interactive"),   # in SLO
        _rec("i1", "interactive", 3.0, kind="interactive"),   # late for 1 s
        _rec("i2", "interactive", 0.5, kind="interactive", tpot=0.06),  # late: TPOT 60 ms > 40 ms
        _rec("b0", "batch", 3.0, root="c0"),                  # in SLO for 30 s
        _rec("b1", "batch", 29.0, root="c0", tpot=0.5),       # in SLO: no TPOT target
        _rec("b2", "batch", 31.0, root="c1"),                 # late
        _rec("b3", "batch", None, ok=False, root="c1"),       # failed (error)
        _rec("b4", "batch", None, sent=False, root="c1"),     # failed (never sent)
    ]
    split = outcome_counts(recs, wl)
    got = (split["in_slo"], split["late"], split["failed"], split["errors"], split["unsent"])
    assert got == (3, 3, 2, 1, 1)
    assert split["late_ttft_max"] == 31.0
    report = build_report(wl, FACTS, [_setup_run("zp-elastic", recs, 40.0)], _cfg(), "pytest")
    m = report["setups"][0]
    assert (m["in_slo"], m["late"], m["failed"], m["good"]) == (3, 3, 2, 3)
    c = m["classes"]
    assert (c["interactive"]["in_slo"], c["interactive"]["late"], c["interactive"]["failed"]) == (1, 2, 0)
    assert (c["batch"]["in_slo"], c["batch"]["late"], c["batch"]["failed"]) == (2, 1, 2)
    assert c["batch"]["ttft_target_s"] == 30.0 and c["batch"]["tpot_target_s"] is None
    assert c["interactive"]["priority"] == 0 and c["batch"]["priority"] == 1
    # conversations: c0 completed (b0, b1), c1 did not (an error, an unsent request)
    assert (m["conversations"], m["conversations_completed"]) == (2, 1)
    assert m["conversation_time_p50"] == m["conversation_time_p99"] == round(29.0 + 4 * 0.5, 3)
    assert report["classes"]["batch"] == {"ttft_s": 30.0, "tpot_s": None, "priority": 1}
    assert "interactive in SLO / late / failed: zp-elastic 1 / 2 / 0" in report["verdict"]
    assert "batch in SLO / late / failed: zp-elastic 2 / 1 / 2" in report["verdict"]
    # the same records on a one-class workload (SLO 5 s, 40 ms): no per-class breakdown
    one = build_report(_wl(classes=False), FACTS, [_setup_run("zp-elastic", recs, 40.0)], _cfg(), "pytest")
    m1 = one["setups"][0]
    assert "classes" not in m1 and (m1["in_slo"], m1["late"], m1["failed"]) == (3, 3, 2)


def _sweep_point(load: float, rows: dict[str, tuple[int, int, float]]) -> dict[str, Any]:
    """A one-load report where each setup has ``in_slo`` good and ``late`` late requests ending by
    ``makespan``."""
    runs = []
    for name, (good, late, makespan) in rows.items():
        recs = [_rec(f"r{i}", None, 0.5 if i < good else 8.0, kind="stream", submit=i * 0.01)
                for i in range(good + late)]
        recs[-1].t_end = makespan
        runs.append(_setup_run(name, recs, makespan))
    return build_report(_wl(classes=False), FACTS, runs, StormConfig(workload="agentic", profile="tiny",
                                                                     load_scale=load), "pytest")


def test_the_sweep_verdict_names_the_best_setup_per_load_by_in_slo_count_and_by_makespan(tmp_path) -> None:
    reports = [
        _sweep_point(1.0, {"no-admission": (10, 0, 20.0), "naive": (9, 1, 21.0), "zp-slo": (10, 0, 19.5)}),
        _sweep_point(2.0, {"no-admission": (12, 8, 40.0), "naive": (14, 6, 48.0), "zp-slo": (13, 7, 41.0)}),
    ]
    sweep = build_sweep_report([1.0, 2.0], reports)
    lines = sweep["verdict"]
    assert "best by requests within SLO: 1x no-admission = zp-slo (10 / 10); 2x naive (14 / 20)" in lines
    assert "best by makespan: 1x zp-slo (19.5 s); 2x no-admission (40.0 s)" in lines
    assert sweep["metrics"]["naive"]["late"] == [1, 6] and sweep["metrics"]["naive"]["failed"] == [0, 0]
    assert "| 48.0 | 14 / 6 / 0 |" in next(line for line in sweep_markdown_table(sweep).splitlines()
                                          if line.startswith("| naive | 2x |"))


def test_a_queue_caps_503s_count_as_requests_that_reached_the_server() -> None:
    recs = [_rec(f"r{i}", None, 0.5, kind="stream") for i in range(4)]
    run = _setup_run("vllm-queue-cap", recs, 10.0)
    run.server_stats["rejected_queue_full"] = 6  # six attempts answered 503: the server keeps no record
    m = build_report(_wl(classes=False), FACTS, [run], _cfg(), "pytest")["setups"][0]
    assert (m["rejected_503"], m["attempts_server"], m["amplification"]) == (6, 10, 2.5)
    fig = figures.storm_figure(build_report(_wl(classes=False), FACTS, [run], _cfg(), "pytest"))
    assert "4 / 0 / 0; 504s 0, 503s 6, ampl 2.50" in [t.get_text() for ax in fig.axes for t in ax.texts]


@pytest.mark.slow
def test_the_storm_figure_draws_the_outcome_panel(tmp_path) -> None:
    recs = [_rec("i0", "interactive", 0.5, kind="interactive"), _rec("b0", "batch", 40.0, root="c0"),
            _rec("b1", "batch", None, ok=False, root="c1")]
    report = build_report(_wl(), FACTS, [_setup_run("no-admission", recs, 50.0),
                                         _setup_run("zp-slo", recs[:2], 45.0)], _cfg(), "pytest")
    fig = figures.storm_figure(report)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert "requests: in SLO / completed late / failed; gateway 504s, amplification" in titles
    ax = fig.axes[titles.index("requests: in SLO / completed late / failed; gateway 504s, amplification")]
    labels = [t.get_text() for t in ax.texts]
    assert "1 / 1 / 1; 504s 0, ampl 1.00" in labels and "1 / 1 / 0; 504s 0, ampl 1.00" in labels
    widths = sorted(round(p.get_width()) for p in ax.patches)
    assert widths.count(1) == 5 and widths.count(0) == 1  # no-admission 1+1+1, zp-slo 1+1+0
    path = tmp_path / "storm.png"
    figures.write_storm_png(report, path)
    assert path.stat().st_size > 10_000
