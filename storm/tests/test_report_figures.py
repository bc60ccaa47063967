"""The storm's report side: checks with their numbers, the verdict, the figures, the sweep report.

Reports are built by the real :func:`build_report` from synthetic :class:`SetupRun` objects (records made
by hand), so every number a check or verdict prints is known here.
"""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from typing import Any

import pytest

from zp_storm import figures
from zp_storm.loadgen import RequestRecord
from zp_storm.report import (
    COLLAPSE_DROP,
    build_report,
    build_sweep_report,
    checks_by_name,
    collapse_point,
    print_checks,
    print_sweep_table,
    seed_burst_checks,
    storm_verdict,
    sweep_markdown_table,
    write_report,
    write_sweep_report,
)
from zp_storm.runner import SetupRun, StormConfig
from zp_storm.workloads import SLO, ServerFacts, Workload

FACTS = ServerFacts(num_gpu_blocks=513, block_size=16, max_model_len=4096, unloaded_itl_s=0.004)
SPEEDUP = 4.0
MAKESPAN = 10.0
T0 = 100.0  # the runs' server clock starts here; reports are relative to it


def _workload(name: str = "seed-burst") -> Workload:
    return Workload(name=name, description="synthetic", sessions=[], slo=SLO(ttft_s=5.0, tpot_s=0.04),
                    gateway_timeout_s=None if name != "seed-burst" else 4.0)


def _cfg(load_scale: float | None = None) -> StormConfig:
    return StormConfig(workload="seed-burst", seed=7, profile="tiny", num_gpu_blocks=None, speedup=SPEEDUP,
                       load_scale=load_scale)


def _run(name: str, good: int, late: int = 0, preemptions: int = 0, makespan: float = MAKESPAN,
         ttft: float = 0.5, attempts: int | None = None) -> SetupRun:
    """``good`` streamed requests within the SLO (TTFT ``ttft``), ``late`` ones outside it (TTFT 8 s), the
    last ending at ``makespan``; the server preempted ``preemptions`` times, one every second from t=1."""
    recs = []
    n = good + late
    for i in range(n):
        t_first = i * 0.01 + (ttft if i < good else 8.0)
        times = [t_first + k * 0.03 for k in range(10)]  # TPOT 30 ms, within the SLO's 40 ms
        t_end = makespan if i == n - 1 else times[-1]
        recs.append(RequestRecord(id=f"r{i}", session=f"s{i}", kind="stream", prompt_tokens=100, max_tokens=64,
                                  true_out=10, t_submit=i * 0.01, t_first=t_first, t_end=t_end, out_tokens=10,
                                  attempts=1, ok=True, sent=True, stream=True, token_times=times))
    timeline = [(T0 + t * 0.5, min(1.0, 0.5 + t * 0.05), min(preemptions, int(t * 0.5)), 3, 0)
                for t in range(int(makespan * 2) + 1)]
    stats = {"engine": {"preemptions_total": preemptions, "recomputed_tokens": 100 * preemptions},
             "requests": attempts if attempts is not None else n, "gateway_504": 0, "max_lag_s": 0.0}
    harness = {"wall_s": makespan / SPEEDUP, "cpu_frac": 0.5, "loop_lag_p99_ms": 1.0, "loop_lag_max_ms": 2.0}
    return SetupRun(name, recs, stats, timeline, T0, harness, gateway_timeout_s=4.0, limit_blocks=485)


def _report(runs: list[SetupRun], workload: str = "seed-burst", load_scale: float | None = None) -> dict[str, Any]:
    return build_report(_workload(workload), FACTS, runs, _cfg(load_scale), "pytest")


def _by(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def _holding() -> list[SetupRun]:
    """no-admission 10 good, naive 8 good + 2 late and 5 preemptions, zp-strict 9 good, zp-elastic 10."""
    return [_run("no-admission", 10, preemptions=3), _run("naive", 8, late=2, preemptions=5),
            _run("zp-strict", 9, late=1), _run("zp-elastic", 10)]


def test_checks_that_hold_say_so_with_their_numbers() -> None:
    report = _report(_holding())
    assert [c["name"] for c in report["checks"]] == ["zp_zero_preemptions", "naive_preempts",
                                                     "zp_goodput_at_least_naive"]
    assert checks_by_name(report) == {"zp_zero_preemptions": True, "naive_preempts": True,
                                      "zp_goodput_at_least_naive": True}
    c = _by(report)
    assert c["zp_zero_preemptions"]["detail"] == "zp-strict 0, zp-elastic 0 preemptions (no-admission 3, naive 5)"
    assert c["naive_preempts"]["detail"].startswith("naive preempted 5 times (500 tokens recomputed)")
    assert c["zp_goodput_at_least_naive"]["detail"] == (
        "good req/s vs naive's: zp-strict 0.900 >= 0.800 (1.12x); zp-elastic 1.000 >= 0.800 (1.25x)")
    # report.json carries them as plain data
    assert json.loads(json.dumps(report))["checks"] == report["checks"]


def test_failed_checks_say_which_setup_missed_by_how_much_and_why() -> None:
    runs = [_run("no-admission", 10, preemptions=3), _run("naive", 8, late=2, preemptions=0),
            _run("zp-strict", 6, late=4), _run("zp-elastic", 10, preemptions=2, makespan=12.5)]
    c = _by(_report(runs))
    assert c["zp_zero_preemptions"]["passed"] is False
    assert c["zp_zero_preemptions"]["detail"] == ("zp-elastic preempted 2 times (200 tokens recomputed); "
                                                  "zp-strict 0 (no-admission 3, naive 0)")
    assert c["naive_preempts"]["passed"] is False
    assert c["naive_preempts"]["detail"].startswith("naive preempted 0 times: this run's load did not overflow")
    assert c["naive_preempts"]["detail"].endswith("(no-admission 3)")
    g = c["zp_goodput_at_least_naive"]
    assert g["passed"] is False
    # the failure first, with the two factors of goodput (requests within SLO, makespan); then what held
    assert g["detail"] == ("good req/s vs naive's: zp-strict 0.600 < 0.800 (0.75x: 6 vs 8 in SLO, makespan 10.0 vs "
                           "10.0 s); zp-elastic 0.800 >= 0.800 (1.00x)")


def test_a_near_miss_is_printed_with_enough_digits_to_see_it() -> None:
    # 8 / 10.004 = 0.7997 vs 0.8: alike at 3 decimals and at 1.00x or 1.000x, so both get more digits
    runs = [_run("no-admission", 10), _run("naive", 8, late=2, preemptions=1),
            _run("zp-elastic", 8, late=2, makespan=10.004)]
    g = _by(_report(runs))["zp_goodput_at_least_naive"]
    assert g["passed"] is False
    assert g["detail"].startswith("good req/s vs naive's: zp-elastic 0.7997 < 0.8000 (0.9996x: 8 vs 8 in SLO, "
                                  "makespan 10.0 vs 10.0 s)")


def test_checks_that_cannot_apply_say_what_is_missing() -> None:
    c = _by(_report([_run("no-admission", 10, preemptions=3), _run("zp-strict", 10)]))
    assert c["zp_zero_preemptions"]["passed"] is True
    assert c["naive_preempts"] == {"name": "naive_preempts", "passed": None, "detail": "no naive setup in this run"}
    assert c["zp_goodput_at_least_naive"]["passed"] is None
    assert "no naive" in c["zp_goodput_at_least_naive"]["detail"]
    c = _by(_report([_run("no-admission", 10), _run("naive", 10, preemptions=1)]))
    assert c["zp_zero_preemptions"]["passed"] is None and c["zp_zero_preemptions"]["detail"] == "no zp-* setup in this run"
    assert c["zp_goodput_at_least_naive"]["passed"] is None
    # only seed-burst defines checks
    report = _report(_holding(), workload="agentic")
    assert report["checks"] == []
    assert "no checks are defined for this workload" in report["verdict"][0]


def _legacy_checks(metrics: list[dict[str, Any]]) -> dict[str, bool | None]:
    """The checks as build_report computed them before they carried details (the rule they must keep)."""
    naive = {m["setup"]: m for m in metrics}.get("naive")
    zp = [m for m in metrics if m["setup"].startswith("zp-")]
    return {
        "zp_zero_preemptions": all(m["preemptions"] == 0 for m in zp) if zp else None,
        "naive_preempts": (naive["preemptions"] > 0) if naive else None,
        "zp_goodput_at_least_naive": (all((m["goodput_rps"] or 0) >= (naive["goodput_rps"] or 0) for m in zp)
                                      if (zp and naive) else None),
    }


def test_checks_keep_their_exact_rules_on_random_metrics() -> None:
    rng = random.Random(17)
    names = ["no-admission", "naive", "rate-limited", "zp-strict", "zp-elastic", "zp-oracle", "zp-redis",
             "clairvoyant"]
    seen = set()
    for _ in range(3000):
        metrics = []
        for n in names:
            if n != "no-admission" and rng.random() < 0.3:
                continue
            g = rng.choice([None, 0.0, 0.5, 0.5, 0.4999, 0.5001, rng.random()])
            metrics.append({"setup": n, "preemptions": rng.choice([0, 0, 0, 1, 7]), "recomputed_tokens": 5,
                            "goodput_rps": g, "good": 3, "makespan": 9.0})
        got = {c["name"]: c["passed"] for c in seed_burst_checks(metrics)}
        assert got == _legacy_checks(metrics), metrics
        seen.update(got.items())
    assert seen == {(k, v) for k in _legacy_checks([]) for v in (True, False, None)}  # every outcome was tried


def _printed(fn: Any, data: dict[str, Any], width: int = 100) -> list[str]:
    from rich.console import Console

    buf = io.StringIO()
    fn(data, Console(file=buf, width=width, color_system=None))
    return buf.getvalue().splitlines()


def test_print_checks_prints_one_line_per_check_with_its_detail_then_the_verdict() -> None:
    runs = [_run("no-admission", 10, preemptions=3), _run("naive", 8, late=2, preemptions=5),
            _run("zp-strict", 7, late=3), _run("zp-elastic", 10)]
    report = _report(runs)
    lines = _printed(print_checks, report)
    checks = [ln for ln in lines if ln.startswith("check ")]
    assert len(checks) == 3  # one line each, however long (no wrapping at the console's width)
    assert checks[0] == "check zp_zero_preemptions: PASS - zp-strict 0, zp-elastic 0 preemptions (no-admission 3, naive 5)"
    assert checks[2].startswith("check zp_goodput_at_least_naive: FAIL - good req/s vs naive's: zp-strict 0.700 < 0.800")
    verdict = [ln for ln in lines if not ln.startswith("check ")]
    assert verdict[0] == "verdict: " + report["verdict"][0]
    assert [ln.strip() for ln in verdict[1:]] == report["verdict"][1:]
    # a workload without checks says so instead of printing nothing
    assert _printed(print_checks, _report(_holding(), workload="agentic"))[0].startswith(
        "checks: none defined for workload agentic")


def test_the_verdict_states_the_checks_and_the_measured_ratios() -> None:
    runs = [_run("no-admission", 10, preemptions=3), _run("naive", 8, late=2, preemptions=5),
            _run("zp-strict", 6, late=4), _run("zp-elastic", 10), _run("clairvoyant", 5, late=5)]
    v = storm_verdict(_report(runs))
    assert v[0] == ("storm seed-burst (seed 7): every zp setup 0 preemptions: PASS;  naive preempts: PASS;  "
                    "every zp setup's goodput >= naive's: FAIL")
    assert v[1] == ("zp-elastic: 0 preemptions (no-admission 3, naive 5); goodput 1.000 good req/s = 1.00x "
                    "no-admission's, 1.25x naive's; 100% of requests within SLO (no-admission 100%, naive 80%)")
    assert v[2] == ("goodput vs no-admission's (naive's): naive 0.80x, zp-strict 0.60x (0.75x), "
                    "clairvoyant 0.50x (0.62x)")
    # the verdict never speaks for a setup that did not run, and marks an invalid run
    runs = [_run("no-admission", 10), _run("naive", 8, late=2, preemptions=1)]
    runs[1].harness["cpu_frac"] = 0.99
    v = storm_verdict(_report(runs))
    assert v[0].endswith("[SATURATED: not valid]")
    assert len(v) == 2 and v[1] == "goodput vs no-admission's (naive's): naive 0.80x"


def test_header_states_what_goodput_measures() -> None:
    from zp_storm.report import header_lines

    lines = header_lines(_report(_holding()))
    measured = [ln for ln in lines if ln.startswith("measured: ")]
    assert measured and "goodput = logical requests that succeeded within the SLO (TTFT <= 5 s, TPOT <= 40.0 ms) " \
        "per virtual second of makespan" in measured[0]


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.slow
def test_storm_png_is_written_and_titled_by_the_verdict(tmp_path) -> None:
    runs = [*_holding(), _run("rate-limited", 6, late=4), _run("zp-oracle", 10), _run("clairvoyant", 9, late=1)]
    report = _report(runs)
    jp, pp = write_report(report, tmp_path)
    assert pp.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pp.stat().st_size > 20_000
    assert json.loads(jp.read_text())["verdict"] == report["verdict"]
    fig = figures.storm_figure(report)
    assert _words(fig._suptitle.get_text()) == _words(report["verdict"][0])  # wrapped to the figure's width
    assert any(_words(" ".join(report["verdict"][1:])) == _words(t.get_text()) for t in fig.texts)
    ax_g, ax_s, ax_p, ax_t = fig.axes
    names = [m["setup"] for m in report["setups"]]
    # every setup has its own bar row and its own preemption lane, labelled with its name
    assert [t.get_text() for t in ax_g.get_yticklabels()] == names
    assert [t.get_text() for t in ax_s.get_yticklabels()] == names
    lanes = {t.get_text(): y for t, y in zip(ax_p.get_yticklabels(), ax_p.get_yticks(), strict=True)}
    assert sorted(lanes) == sorted(names) and len(set(lanes.values())) == len(names)
    assert "5 preempted, KV max 1.00" in [t.get_text() for t in ax_p.texts]
    # TTFT: log axis, one legend entry per setup plus the SLO line
    assert ax_t.get_xscale() == "log"
    legend = [t.get_text() for t in ax_t.get_legend().get_texts()]
    assert legend == [f"{n} (n={m['ok']})" for n, m in zip(names, report["setups"], strict=True)] + [
        "SLO: TTFT <= 5 s"]


def test_every_setup_keeps_one_style_and_the_default_setups_are_told_apart() -> None:
    from zp_storm.setups import ALL_SETUPS

    styles = {n: figures.setup_style(n) for n in ALL_SETUPS}
    assert styles == {n: figures.setup_style(n) for n in ALL_SETUPS}
    assert all(s.color in figures.OKABE_ITO.values() for s in styles.values())
    assert figures.setup_style("zp-elastic").color == figures.OKABE_ITO["blue"]
    assert figures.setup_style("naive").color == figures.OKABE_ITO["vermillion"]
    # never colour alone: (colour, dash, marker) differ for every pair, and so do the markers
    keys = [(s.color, str(s.linestyle), s.marker) for s in styles.values()]
    assert len(set(keys)) == len(keys) and len({s.marker for s in styles.values()}) == len(keys)
    # a name the benchmark does not know gets a style that does not change between processes
    code = "from zp_storm.figures import setup_style; print(setup_style('my-setup'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(figures.setup_style("my-setup"))


def test_collapse_is_the_first_load_more_than_the_drop_below_the_best_at_a_lower_load() -> None:
    assert COLLAPSE_DROP == 0.20
    c = collapse_point([0.5, 1, 2, 4], [1.0, 2.0, 1.7, 1.5])
    assert c["collapse_load"] == 4 and c["best_before"] == 2.0 and c["best_before_load"] == 1
    assert c["drop"] == 0.25 and c["goodput_at_collapse"] == 1.5
    assert c["peak_load"] == 1 and c["peak_goodput"] == 2.0
    # exactly 20% below is not a collapse; a plateau is not; a load where the setup did not run is skipped
    assert collapse_point([1, 2], [2.0, 1.6])["collapse_load"] is None
    assert collapse_point([1, 2, 4], [2.0, 2.0, 2.0])["collapse_load"] is None
    assert collapse_point([1, 2, 4], [2.0, None, 1.0])["collapse_load"] == 4
    # the first such load counts, even if goodput recovers later
    assert collapse_point([1, 2, 4], [2.0, 1.0, 3.0])["collapse_load"] == 2
    assert collapse_point([1], [None])["peak_load"] is None


def _sweep_reports() -> tuple[list[float], list[dict[str, Any]]]:
    """Four loads, given out of order: naive's goodput collapses at 2x, zp-elastic's does not."""
    shape = {  # load: (no-admission good, naive good, naive preemptions, zp-elastic good)
        1.0: (10, 9, 2, 10), 0.5: (5, 5, 0, 5), 4.0: (16, 3, 30, 18), 2.0: (14, 6, 9, 15),
    }
    loads, reports = [], []
    for load, (na, nv, npre, ze) in shape.items():
        runs = [_run("no-admission", na, late=1, preemptions=npre // 2), _run("naive", nv, late=10 - nv, preemptions=npre),
                _run("zp-elastic", ze, late=1)]
        loads.append(load)
        reports.append(_report(runs, load_scale=load))
    return loads, reports


def test_sweep_report_lines_up_every_metric_by_load() -> None:
    loads, reports = _sweep_reports()
    sweep = build_sweep_report(loads, reports)
    assert sweep["loads"] == [0.5, 1.0, 2.0, 4.0]
    assert sweep["setups"] == ["no-admission", "naive", "zp-elastic"]
    order = [loads.index(x) for x in sweep["loads"]]
    for name in sweep["setups"]:
        m = sweep["metrics"][name]
        for key in ("goodput_rps", "slo_attainment", "amplification", "preemptions", "gateway_504", "ttft_p50",
                    "ttft_p99"):
            want = [next(s[key] for s in reports[i]["setups"] if s["setup"] == name) for i in order]
            assert m[key] == want, (name, key)
    assert sweep["metrics"]["naive"]["goodput_rps"] == [0.5, 0.9, 0.6, 0.3]
    assert sweep["metrics"]["zp-elastic"]["goodput_vs_no_admission"] == [1.0, 1.0, 1.071, 1.125]
    assert sweep["metrics"]["zp-elastic"]["goodput_vs_naive"] == [1.0, 1.111, 2.5, 6.0]
    assert sweep["collapse"]["naive"]["collapse_load"] == 2.0
    assert sweep["collapse"]["zp-elastic"]["collapse_load"] is None
    assert {(c["load"], c["name"]) for c in sweep["checks"]} == {(x, n) for x in sweep["loads"] for n in (
        "zp_zero_preemptions", "naive_preempts", "zp_goodput_at_least_naive")}
    assert sweep["valid"] is True
    v = sweep["verdict"]
    assert v[0] == ("zp-client storm sweep seed-burst (seed 7), offered load 0.5x, 1x, 2x, 4x: naive's goodput "
                    "collapses at 2x (0.600 good req/s, 33% below its 0.900 at 1x)")
    assert v[1] == "zp-elastic goodput x no-admission's: 0.5x 1.00x, 1x 1.00x, 2x 1.07x, 4x 1.12x"
    assert v[2] == "zp-elastic goodput x naive's: 0.5x 1.00x, 1x 1.11x, 2x 2.50x, 4x 6.00x"
    assert v[3] == "preemptions per load (0.5x / 1x / 2x / 4x): zp-elastic 0/0/0/0; no-admission 0/1/4/15; naive 0/2/9/30"
    assert v[4].endswith(": no-admission none, zp-elastic none")
    with pytest.raises(ValueError, match="one report per load"):
        build_sweep_report([1.0], reports)
    with pytest.raises(ValueError, match="distinct"):
        build_sweep_report([1.0, 1.0], reports[:2])


def test_a_setup_missing_at_a_load_is_none_there_and_naive_that_holds_is_said_to_hold() -> None:
    a = _report([_run("no-admission", 10), _run("naive", 10, preemptions=1)], load_scale=1.0)
    b = _report([_run("no-admission", 12), _run("naive", 11, preemptions=2), _run("zp-strict", 12)], load_scale=2.0)
    sweep = build_sweep_report([1.0, 2.0], [a, b])
    assert sweep["metrics"]["zp-strict"]["goodput_rps"] == [None, 1.2]
    assert sweep["verdict"][0].endswith("naive's goodput does not collapse up to 2x")
    head, *_ = _printed(print_sweep_table, sweep)
    assert head.startswith("measured: goodput = logical requests that succeeded within the SLO")


@pytest.mark.slow
def test_sweep_table_and_files(tmp_path) -> None:
    loads, reports = _sweep_reports()
    sweep = build_sweep_report(loads, reports)
    out = "\n".join(_printed(print_sweep_table, sweep, width=200))
    for x in ("0.5x", "1x", "2x", "4x"):
        assert f"│ naive        │ {x}" in out
    assert "verdict: zp-client storm sweep seed-burst" in out
    assert "load 2x: 3 of 3 checks hold" in out and "check zp_goodput_at_least_naive" not in out  # all zp >= naive
    assert "check zp_zero_preemptions" not in out and "load 0.5x: 2 of 3 checks hold" in out
    assert "  check naive_preempts: FAIL - naive preempted 0 times" in out
    md = sweep_markdown_table(sweep).splitlines()
    assert md[0].startswith("| setup | load | good req/s | x no-adm | x naive | in SLO |") and len(md) == 2 + 12
    assert "| naive | 2x | 0.600 | 0.43x | 1.00x | 60% |" in md[2 + 4 + 2]
    jp, pp = write_sweep_report(sweep, tmp_path / "sweep")
    assert json.loads(jp.read_text()) == json.loads(json.dumps(sweep))
    assert pp.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pp.stat().st_size > 20_000
    fig = figures.sweep_figure(sweep)
    assert _words(fig._suptitle.get_text()) == _words(sweep["verdict"][0])
    assert [ax.get_xscale() for ax in fig.axes] == ["log"] * 4  # 0.5x-4x spans 8x
    assert [t.get_text() for t in fig.legends[0].get_texts()] == sweep["setups"]  # one legend for all panels
    narrow = build_sweep_report([1.0, 4.0], [reports[loads.index(1.0)], reports[loads.index(4.0)]])
    assert [ax.get_xscale() for ax in figures.sweep_figure(narrow).axes] == ["linear"] * 4
