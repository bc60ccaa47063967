"""``zp-client storm --bypass F``: traffic the zp budget cannot see, and the ``zp-adaptive`` setup's limit
trajectory in the report.

The storms here are real ones (the simulator app over the in-memory transport, the real openai SDK and
zp's transport through ``wrap()``) on the tiny profile, on the virtual clock unless a test says otherwise:
their records are exact for their seed, so runs can be compared as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from zp_client.errors import ConfigurationError
from zp_client.testing import run_virtual
from zp_storm.bypass import (
    BypassCaller,
    BypassPlan,
    occurrence_keys,
    parse_window,
    plan_bypass,
    request_ids,
)
from zp_storm.loadgen import LoopTimeClock, RequestRecord, run_sessions
from zp_storm.report import build_report, markdown_table, print_table, storm_verdict
from zp_storm.runner import SetupRun, StormConfig, run_storm
from zp_storm.setups import SETUPS, parse_setups
from zp_storm.workloads import SLO, ServerFacts, Session, Turn, Workload

pytestmark = pytest.mark.openai_compat

ROOT = Path(__file__).resolve().parents[2]
# a child interpreter finds the three distributions from this clone (whatever else is installed)
CHILD_PATH = os.pathsep.join(str(ROOT / d) for d in (".", "sim", "storm"))
TINY = {"streams": 6, "stream_out": 512, "rounds": 2, "burst": 3, "burst_prompt": 1200,
        "burst_max_tokens": 256}
MSGS = [{"role": "user", "content": "hello"}]


def _sessions(n: int = 40, children: bool = True) -> list[Session]:
    """``n`` conversations of 3 turns; with ``children``, every 4th conversation's first and second turns
    each spawn 2 sub-agents of 2 turns, named alike at both turns (``c<i>-<j>``, as the agentic workload
    names its sub-agents: their record ids repeat)."""
    out = []
    for i in range(n):
        turns = [Turn(list(MSGS), 10, 8, 4, delay_s=0.1 * k) for k in range(3)]
        if children and i % 4 == 0:
            for turn in turns[:2]:
                turn.children = [Session(f"c{i}-{j}", 0.0, "subagent",
                                         [Turn(list(MSGS), 10, 8, 4, delay_s=0.01 * (k + j))
                                          for k in range(2)])
                                 for j in range(2)]
        out.append(Session(f"s{i}", 0.05 * i, "agent", turns))
    return out


def _cfg(**kw: Any) -> StormConfig:
    base: dict[str, Any] = dict(workload="seed-burst", seed=0, setups=["no-admission", "zp-elastic"],
                                profile="tiny", num_gpu_blocks=None, workload_overrides=dict(TINY))
    base.update(kw)
    return StormConfig(**base)


# --------------------------------------------------------------------------------- the selection


@pytest.mark.slow
def test_the_selection_is_exact_deterministic_nested_and_names_the_load_generators_requests() -> None:
    sessions = _sessions()
    ids = list(request_ids(sessions))
    assert len(ids) == len(set(ids)) == 40 * 3 + 10 * 2 * 2 * 2
    assert "c0-1/t1#2" in ids  # the second set of c0-1's requests
    for f in (0.0, 0.1, 0.25, 0.5, 1.0):
        plan = plan_bypass(sessions, f, seed=3)
        assert len(plan.ids) == round(f * len(ids)) and plan.total == len(ids)
        assert plan.ids <= set(ids)
    a, b = plan_bypass(sessions, 0.25, seed=3), plan_bypass(sessions, 0.25, seed=3)
    assert a.ids == b.ids  # the same requests in every setup
    assert plan_bypass(sessions, 0.1, seed=3).ids < a.ids  # a smaller fraction is a subset
    assert plan_bypass(sessions, 0.25, seed=4).ids != a.ids  # another seed, other requests
    # sub-agent requests are drawn like any other: neither excluded nor favoured wholesale
    assert any(rid.startswith("c") for rid in plan_bypass(sessions, 0.5, seed=3).ids)
    # the same ids in another process with another string-hash seed (nothing depends on hash())
    code = ("import sys, json; sys.path.insert(0, {t!r}); from test_storm_bypass import _sessions; "
            "from zp_storm.bypass import plan_bypass; "
            "print(json.dumps(sorted(plan_bypass(_sessions(), 0.25, seed=3).ids)))"
            ).format(t=str(ROOT / "storm" / "tests"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "999", "PYTHONPATH": CHILD_PATH, "PATH": ""})
    assert json.loads(out.stdout) == sorted(a.ids)

    # the keys are the load generator's record ids (in submit order), and a BypassCaller sends exactly
    # the planned requests around the budget, the second set of a repeated id apart from the first
    plan = plan_bypass(sessions, 0.5, seed=3)

    async def replay() -> tuple[list[RequestRecord], list[str]]:
        admitted: list[str] = []

        async def caller(turn: Turn, rec: RequestRecord, clock: Any) -> None:
            await clock.sleep(0.01)
            rec.t_first = clock.now()

        async def counting(turn: Turn, rec: RequestRecord, clock: Any) -> None:
            admitted.append(rec.id)
            await caller(turn, rec, clock)

        clock = LoopTimeClock()
        t0 = clock.now()
        recs = await run_sessions(sessions, BypassCaller(counting, caller, plan, t0), clock, t0=t0)
        return recs, admitted

    recs, admitted = run_virtual(replay())
    keys = list(occurrence_keys(r.id for r in recs))
    assert sorted(keys) == sorted(ids)
    assert {k for k, r in zip(keys, recs, strict=True) if r.bypass} == plan.ids
    assert len(admitted) == len(ids) - len(plan.ids)


def test_the_window_and_bad_arguments() -> None:
    plan = BypassPlan(0.5, 0, frozenset({"a/t0"}), 2, window=(2.0, 5.0))
    assert [plan.active("a/t0", t) for t in (1.99, 2.0, 4.99, 5.0)] == [False, True, True, False]
    assert not plan.active("b/t0", 3.0)
    assert parse_window("2:5") == (2.0, 5.0)
    assert parse_window(":5") == (0.0, 5.0)
    assert parse_window("10:") == (10.0, math.inf)
    assert parse_window(None) is None
    for bad in ("5:2", "3:3", "a:b", "1", "1:2:3", "-1:2", "nan:1"):
        with pytest.raises(ConfigurationError, match="--bypass-window"):
            parse_window(bad)
    for f in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigurationError, match="bypass"):
            plan_bypass(_sessions(2), f, seed=0)
        with pytest.raises(ConfigurationError, match="bypass"):
            StormConfig(bypass=f)
    with pytest.raises(ConfigurationError, match="bypass_window"):
        StormConfig(bypass=0.5, bypass_window=(3.0, 1.0))


def test_the_cli_refuses_bad_bypass_flags_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    from zp_client.cli import main

    for argv, message in ((["--bypass", "2"], "--bypass takes a fraction"),
                          (["--bypass", "0.2", "--bypass-window", "9:3"], "--bypass-window takes"),
                          (["--bypass-window", "1:3"], "needs --bypass")):
        assert main(["storm", "--profile", "tiny", "--quiet", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------- the traffic


@pytest.mark.slow
def test_bypass_requests_reach_the_server_without_a_lease_and_the_report_splits_them(tmp_path: Path) -> None:
    cfg = _cfg(setups=["no-admission", "zp-strict", "zp-elastic"], bypass=0.4, seed=1)
    wl, facts, runs = run_storm(cfg)
    plan = plan_bypass(wl.sessions, 0.4, seed=1)
    assert len(plan.ids) == 6 and plan.total == wl.num_requests == 15
    by = {r.name: r for r in runs}
    # no-admission has no budget to go around: untouched
    assert not any(r.bypass for r in by["no-admission"].records)
    assert by["no-admission"].leases_granted is None
    for name in ("zp-strict", "zp-elastic"):
        run = by[name]
        recs = {r.id: r for r in run.records}
        assert {rid for rid, r in recs.items() if r.bypass} == plan.ids  # the same requests in every zp setup
        assert all(r.ok and r.sent for r in recs.values())
        # the server saw every request, bypass ones included, by its X-Request-Id...
        seen = {s["id"] for s in run.server_stats["requests"]}
        assert seen == {f"chatcmpl-{rid}" for rid in recs}
        # ...and the budget only the admitted ones: one lease per admitted attempt, none for the bypass
        assert run.leases_granted == sum(r.attempts for r in recs.values() if not r.bypass) == 9

    report = build_report(wl, facts, runs, cfg, "pytest")
    assert report["bypass"]["fraction"] == 0.4 and report["bypass"]["selected"] == 6
    assert report["bypass"]["setups"] == ["zp-strict", "zp-elastic"]
    data = json.loads(json.dumps(report))  # what report.json holds
    for m in data["setups"]:
        split = m["bypass"]
        assert split["applies"] is (m["setup"] != "no-admission")
        assert split["admitted"]["requests"] == 9 and split["bypass"]["requests"] == 6
        recs = data["requests"][m["setup"]]
        byp = [r for r in recs if r["id"] in plan.ids]
        # TTFT p99 of 6 requests is their largest; goodput shares the run's makespan, so the parts add up
        assert split["bypass"]["ttft_p99"] == round(max(r["ttft"] for r in byp), 4)
        assert m["bypass_ttft_p99"] == split["bypass"]["ttft_p99"]
        assert m["admitted_goodput_rps"] == split["admitted"]["goodput_rps"]
        assert split["admitted"]["good"] + split["bypass"]["good"] == m["good"]
        assert (split["admitted"]["goodput_rps"] + split["bypass"]["goodput_rps"]
                == pytest.approx(m["goodput_rps"], abs=2e-4))
        assert m["bypass_sent"] == (6 if split["applies"] else 0)
    table = markdown_table(report)
    assert "| zp-elastic | 6 | 9 |" in table and "| no-admission (ref) | 0 | 9 |" in table
    verdict = storm_verdict(report)
    assert any(line.startswith("bypass 40% (6 requests around the budget): zp-elastic admitted ")
               for line in verdict)


@pytest.mark.slow
def test_bypass_on_the_real_clock() -> None:
    cfg = _cfg(setups=["no-admission", "zp-elastic"], bypass=0.4, seed=1, clock="real", speedup=4.0)
    wl, _, runs = run_storm(cfg)
    run = runs[1]
    plan = plan_bypass(wl.sessions, 0.4, seed=1)
    assert {r.id for r in run.records if r.bypass} == plan.ids
    assert {s["id"] for s in run.server_stats["requests"]} == {f"chatcmpl-{r.id}" for r in run.records}
    assert run.leases_granted == sum(r.attempts for r in run.records if not r.bypass)


@pytest.mark.slow
def test_the_window_stops_the_bypass_mid_run() -> None:
    full = run_storm(_cfg(setups=["no-admission", "zp-elastic"]))[2][1]
    submits = sorted(r.t_submit for r in full.records if r.t_submit is not None)
    cut = submits[len(submits) // 2]  # half the requests are submitted before this virtual second
    wl, _, runs = run_storm(_cfg(setups=["no-admission", "zp-elastic"], bypass=1.0, bypass_window=(0.0, cut)))
    run = runs[1]
    before = [r for r in run.records if r.t_submit is not None and r.t_submit < cut]
    after = [r for r in run.records if r.t_submit is not None and r.t_submit >= cut]
    assert before and after
    assert all(r.bypass for r in before)  # every request is selected: inside the window each bypasses
    assert not any(r.bypass for r in after)  # once the window closed, each one is admitted
    assert run.leases_granted == sum(r.attempts for r in after)
    assert run.bypass is not None and run.bypass["window"] == [0.0, cut]


@pytest.mark.slow
def test_bypass_zero_and_a_window_after_the_run_give_the_records_of_no_flag(tmp_path: Path) -> None:
    """``--bypass 0`` changes nothing at all; nor does a bypass whose window opens after the last request
    (so the bypass machinery itself does not perturb the admitted traffic); a sweep keeps the split."""
    pytest.importorskip("rich")
    from zp_client.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": 0.05 * i, "prompt_tokens": 300 + 40 * i,
                                         "max_tokens": 256, "output_tokens": 60 + 10 * i}) + "\n"
                             for i in range(16)))
    common = ["storm", "--trace", str(trace), "--profile", "tiny", "--num-gpu-blocks", "96",
              "--setups", "no-admission,zp-elastic", "--quiet", "--seed", "2"]
    outs = {}
    for key, extra in (("none", []), ("zero", ["--bypass", "0"]),
                       ("late", ["--bypass", "0.5", "--bypass-window", "1000:"]),
                       ("half", ["--bypass", "0.5"])):
        assert main([*common, *extra, "--out", str(tmp_path / key)]) == 0
        outs[key] = json.loads((tmp_path / key / "report.json").read_text())
    assert json.dumps(outs["none"]["requests"]) == json.dumps(outs["zero"]["requests"])
    assert json.dumps(outs["none"]["requests"]) == json.dumps(outs["late"]["requests"])
    assert outs["none"]["bypass"] is None and outs["late"]["bypass"]["window"] == [1000.0, None]
    # and the comparison is not vacuous: the storm preempts without admission, and a real bypass changes
    # zp-elastic's run (8 of its 16 requests go around the budget)
    by = {m["setup"]: m for m in outs["none"]["setups"]}
    assert by["no-admission"]["preemptions"] > 0
    half = outs["half"]["requests"]["zp-elastic"]
    assert sum(r["bypass"] for r in half) == 8
    assert json.dumps(half) != json.dumps(outs["none"]["requests"]["zp-elastic"])
    assert "admitted vs bypass" not in (tmp_path / "none" / "table.md").read_text()
    assert "| zp-elastic | 8 |" in (tmp_path / "half" / "table.md").read_text()

    # a sweep with --bypass keeps the split per load
    assert main([*common, "--bypass", "0.5", "--sweep", "1,2", "--out", str(tmp_path / "sweep")]) == 0
    sweep = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    met = sweep["metrics"]["zp-elastic"]
    assert met["bypass_sent"] == [8, 16]
    assert all(v is not None for v in met["admitted_goodput_rps"] + met["bypass_ttft_p99"])
    assert met["bypass_sent"] and sweep["metrics"]["no-admission"]["bypass_sent"] == [0, 0]


# ------------------------------------------------------------------------- synthetic report


def _rec(i: int, ttft: float, bypass: bool) -> RequestRecord:
    times = [ttft + i * 0.01 + k * 0.02 for k in range(5)]
    return RequestRecord(f"s{i}/t0", f"s{i}", "agent", 100, 64, 5, t_submit=i * 0.01, t_first=times[0],
                         t_end=times[-1], out_tokens=5, attempts=1, ok=True, sent=True, token_times=times,
                         bypass=bypass)


def test_the_split_counts_each_group_against_the_runs_makespan() -> None:
    """Hand-made records: 6 admitted within the SLO, 4 bypass of which 2 miss its TTFT (8 s): each group's
    goodput is its good requests over the run's makespan (10 s), its TTFT p99 its own tail."""
    pytest.importorskip("rich")
    recs = [_rec(i, 0.5, False) for i in range(6)] + [_rec(6, 1.0, True), _rec(7, 2.0, True),
                                                      _rec(8, 8.0, True), _rec(9, 9.0, True)]
    recs[-1].t_end = 10.0  # the makespan
    plan = {"fraction": 0.4, "seed": 0, "selected": 4, "total": 10, "window": None,
            "applies_to": "zp-* setups", "client": "naive's", "ids": [r.id for r in recs if r.bypass]}
    stats = {"engine": {"preemptions_total": 3, "recomputed_tokens": 10}, "requests": 10}
    late = _rec(9, 9.0, False)
    late.t_end = 10.0
    harness = {"clock": "virtual", "wall_s": 1.0, "cpu_frac": 0.5}
    runs = [SetupRun("no-admission", [_rec(i, 0.5, False) for i in range(9)] + [late], stats, [], 0.0,
                     dict(harness), None, bypass={**plan, "applies": False}),
            SetupRun("zp-elastic", recs, stats, [], 0.0, dict(harness), None,
                     bypass={**plan, "applies": True}, leases_granted=6)]
    wl = Workload(name="agentic", description="synthetic", sessions=[], slo=SLO(ttft_s=5.0, tpot_s=0.04),
                  gateway_timeout_s=None)
    facts = ServerFacts(num_gpu_blocks=513, block_size=16, max_model_len=4096, unloaded_itl_s=0.004)
    report = build_report(wl, facts, runs, StormConfig(profile="tiny", num_gpu_blocks=None), "pytest")
    zp = report["setups"][1]
    assert zp["bypass"]["admitted"] == {"requests": 6, "sent": 6, "ok": 6, "errors": 0, "good": 6,
                                        "slo_attainment": 1.0, "goodput_rps": 0.6, "goodput_tps": 3.0,
                                        "ttft_p50": 0.5, "ttft_p99": 0.5}
    b = zp["bypass"]["bypass"]
    assert (b["good"], b["goodput_rps"], b["slo_attainment"], b["ttft_p99"]) == (2, 0.2, 0.5, 9.0)
    assert zp["goodput_rps"] == 0.8 and zp["leases_granted"] == 6
    ref = report["setups"][0]["bypass"]  # no-admission: the same ids, for comparison
    assert ref["applies"] is False and ref["bypass"]["requests"] == 4 and ref["bypass"]["good"] == 3
    assert report["bypass"]["setups"] == ["zp-elastic"] and "ids" not in report["bypass"]
    import io

    from rich.console import Console

    buf = io.StringIO()
    print_table(report, Console(file=buf, width=250))
    text = buf.getvalue()
    assert "admitted vs bypass" in text and "4 of 10, chosen from seed 0" in text


# ---------------------------------------------------------------------------------- zp-adaptive


def _adaptive_present() -> bool:
    try:
        return importlib.util.find_spec("zp_client.adaptive") is not None
    except ModuleNotFoundError:
        return False


def test_zp_adaptive_is_registered_but_not_run_by_default() -> None:
    assert "zp-adaptive" in SETUPS and SETUPS["zp-adaptive"].requires == "zp_client.adaptive"
    assert "zp-adaptive" not in parse_setups(None, None)
    assert "zp-elastic" in parse_setups(None, None)
    if _adaptive_present():
        assert parse_setups("zp-adaptive", None) == ["no-admission", "zp-adaptive"]
    else:
        with pytest.raises(ConfigurationError, match="zp-adaptive needs zp_client.adaptive"):
            parse_setups("zp-adaptive", None)
    # the bench never imports the module on its own
    code = ("import sys; import zp_storm.runner, zp_storm.cli; "
            "print('zp_client.adaptive' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": CHILD_PATH, "PATH": ""})
    assert out.stdout.strip() == "False"


class _StandInAdaptiveLimit:
    """The agreed ``zp_client.adaptive.AdaptiveLimit`` surface, standing in where the module is absent: it
    polls ``/metrics`` through the client it is given, on the clock it is given, and lowers the limit by
    ``step`` blocks at every poll after the first (as if the server kept preempting). Records what it saw."""

    instances: list[_StandInAdaptiveLimit] = []

    def __init__(self, budget: Any, server_url: str, *, calibrated_limit: int | None = None,
                 poll_interval_s: float = 1.0, http_client: Any = None, clock: Any = None,
                 metrics: Any = None) -> None:
        self.budget, self.server_url, self.calibrated = budget, server_url, calibrated_limit
        self.poll, self.http, self.clock = poll_interval_s, http_client, clock
        self.changes: list[Any] = []
        self.polls: list[tuple[float, int, bool]] = []
        self.closed = False
        self._task: asyncio.Task[None] | None = None
        _StandInAdaptiveLimit.instances.append(self)

    async def __aenter__(self) -> _StandInAdaptiveLimit:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        self.closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            r = await self.http.get(self.server_url + "/metrics")
            self.polls.append((self.clock.monotonic(), r.status_code, "vllm:num_preemptions" in r.text))
            if len(self.polls) > 1:
                old = self.budget.limit
                self.budget.set_limit_sync(old - 5)
                self.changes.append(types.SimpleNamespace(at=self.clock.monotonic(), old=old, new=old - 5,
                                                          reason="stand-in"))
            await self.clock.sleep(self.poll)


@pytest.mark.slow
def test_zp_adaptive_wires_the_controller_to_the_runs_server_and_clock_and_reports_its_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where zp_client.adaptive is absent a stand-in with its agreed API takes its place: the factory gives
    it the elastic budget, the calibrated limit, the run's server over the in-memory transport and the
    budget's (virtual) clock; the report carries its limit trajectory, and limit.png draws it."""
    pytest.importorskip("matplotlib")
    if not _adaptive_present():
        module = types.ModuleType("zp_client.adaptive")
        module.__spec__ = importlib.machinery.ModuleSpec("zp_client.adaptive", None)
        module.AdaptiveLimit = _StandInAdaptiveLimit  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "zp_client.adaptive", module)
        _StandInAdaptiveLimit.instances.clear()
    else:
        pytest.skip("needs zp_client.adaptive absent (the stand-in); see the test below for the real module")
    from zp_storm.report import write_report

    cfg = _cfg(setups=parse_setups("zp-adaptive", None), bypass=0.4)
    wl, facts, runs = run_storm(cfg)
    (ctrl,) = _StandInAdaptiveLimit.instances
    run = runs[1]
    assert run.name == "zp-adaptive" and ctrl.closed
    assert ctrl.calibrated == run.limit_blocks
    assert ctrl.server_url == "http://sim.memory:80"
    assert ctrl.polls and all(status == 200 and has for _, status, has in ctrl.polls)  # the sim's /metrics
    times = [t for t, _, _ in ctrl.polls]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert gaps == pytest.approx([1.0] * len(gaps))  # one virtual second apart
    assert run.leases_granted == sum(r.attempts for r in run.records if not r.bypass)
    tl = run.limit_timeline
    assert tl is not None and tl[0] == (0.0, ctrl.calibrated)
    assert [lim for _, lim in tl[1:]] == [c.new for c in ctrl.changes] and len(tl) > 2
    makespan = max(r.t_end for r in run.records if r.t_end is not None)
    assert all(0.0 <= t <= makespan + 1.0 for t, _ in tl)
    report = build_report(wl, facts, runs, cfg, "pytest")
    m = report["setups"][1]
    assert report["limit_timelines"]["zp-adaptive"] == [list(p) for p in tl]
    assert m["limit_changes"] == len(tl) - 1 and m["limit_final"] == tl[-1][1]
    assert "no-admission" not in report["limit_timelines"]
    write_report(report, tmp_path)
    assert (tmp_path / "limit.png").stat().st_size > 10_000


def test_the_limit_figure_draws_each_setups_trajectory(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from zp_storm import figures

    report = {"workload": {"name": "agentic", "seed": 0}, "server": {"num_gpu_blocks": 2049},
              "setups": [{"setup": "zp-adaptive", "makespan": 30.0}],
              "bypass": {"fraction": 0.25, "window": [5.0, None]},
              "limit_timelines": {"zp-adaptive": [[0.0, 1945], [3.0, 1900], [9.5, 1800], [20.0, 1850]]}}
    fig = figures.limit_figure(report)
    (ax,) = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    step = lines["zp-adaptive: 3 changes, 1800-1945 blocks"]
    assert list(step.get_ydata()) == [1945, 1900, 1800, 1850, 1850]
    assert list(step.get_xdata())[-1] == 30.0
    assert "usable pool: 2048 blocks" in lines
    assert any(p.get_label() == "bypass window" for p in ax.patches)
    figures.write_limit_png(report, tmp_path / "limit.png")
    assert (tmp_path / "limit.png").stat().st_size > 10_000


@pytest.mark.slow
def test_zp_adaptive_with_the_real_module() -> None:
    if not _adaptive_present():
        pytest.skip("needs zp_client.adaptive")
    cfg = _cfg(setups=parse_setups("zp-adaptive", None), bypass=0.4)
    _, _, runs = run_storm(cfg)
    run = runs[1]
    assert run.limit_timeline is not None and run.limit_timeline[0] == (0.0, run.limit_blocks)
    assert all(r.ok for r in run.records)


@pytest.mark.slow
@pytest.mark.redis
def test_zp_redis_workers_bypass_the_same_requests(redis_url: str) -> None:
    cfg = _cfg(setups=["no-admission", "zp-redis"], redis_url=redis_url, seed=1, speedup=4.0, workers=2,
               clock="real", bypass=0.4)
    wl, _, runs = run_storm(cfg)
    run = runs[1]
    plan = plan_bypass(wl.sessions, 0.4, seed=1)
    assert {r.id for r in run.records if r.bypass} == plan.ids  # split over two worker processes
    assert all(r.ok for r in run.records)
    assert {s["id"] for s in run.server_stats["requests"]} == {f"chatcmpl-{r.id}" for r in run.records}
