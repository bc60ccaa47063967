"""Issue 30's setups (``zp-oracle-h1``, ``zp-slo``, ``zp-oracle-slo``, ``vllm-priority``, ``vllm-queue-cap``)
and the report fields they are judged by, end to end on the virtual clock against the real simulator."""

from __future__ import annotations

import math
from typing import Any

import pytest

import zp_client.budget.local as local_budget
from zp_storm import setups as bench_setups
from zp_storm.report import build_report, header_lines, markdown_table
from zp_storm.runner import StormConfig, run_storm
from zp_storm.setups import SETUPS, parse_setups
from zp_storm.slo_setups import TARGET_HEADER, TPOT_HEADER, queue_cap_tokens, slo_line_kwargs

# A tiny mixed storm on the "tiny" profile (511 usable blocks, max_model_len 4096): 3 short agent
# conversations and interactive calls at 3/s for 3 s.
TINY_MIXED = {"conversations": 3, "preamble_tokens": 300, "max_tokens": 256, "turns_lo": 2, "turns_hi": 3,
              "subagent_p": 0.0, "rate_per_s": 3.0, "span_s": 3.0, "prompt_median": 300, "out_max": 64,
              "out_median": 30}
NEW = ["zp-oracle-h1", "zp-slo", "zp-oracle-slo", "vllm-priority", "vllm-queue-cap"]


def test_the_new_setups_are_registered_named_only_and_described() -> None:
    for name in NEW:
        assert name in SETUPS and SETUPS[name].description
        assert not SETUPS[name].default  # make demo's default set is unchanged
    assert SETUPS["vllm-priority"].sim_extra == {"policy": "priority"}
    assert not SETUPS["vllm-priority"].gateway  # no-admission's client: no gateway, no retries
    assert SETUPS["vllm-queue-cap"].gateway and SETUPS["vllm-queue-cap"].sim_for is not None
    assert parse_setups(",".join(NEW), None) == ["no-admission", "vllm-priority", "vllm-queue-cap",
                                                 "zp-oracle-h1", "zp-slo", "zp-oracle-slo"]


def test_the_slo_setups_build_their_budget_on_the_slo_line() -> None:
    assert slo_line_kwargs() == {"line": "slo"}
    assert local_budget.LocalBudget(limit_blocks=100, **slo_line_kwargs())._ledger.line_discipline == "slo"


@pytest.fixture(scope="module")
def tiny_mixed() -> tuple[Any, dict[str, Any], dict[str, list[dict[str, Any]]], list[Any]]:
    """One tiny mixed storm with every new setup; what each app sent, per setup: the extra kwargs of every
    ``stream_chat`` call (recorded around the real one)."""
    sent: dict[str, list[dict[str, Any]]] = {}
    current: list[str] = [""]
    real = bench_setups.stream_chat

    async def spy(client: Any, model: str, turn: Any, rec: Any, clock: Any, **extra: Any) -> None:
        sent.setdefault(current[0], []).append({"class": turn.slo_class, **extra})
        await real(client, model, turn, rec, clock, **extra)

    def progress(names: list[str], total: int) -> Any:
        class P:  # the runner's progress hooks: the setup starting tells the spy whose calls follow
            def start(self, name: str) -> None:
                current[0] = name

            def advance(self, name: str, k: int) -> None:
                pass

            def finish(self, name: str) -> None:
                pass

        return P()

    mp = pytest.MonkeyPatch()
    mp.setattr(bench_setups, "stream_chat", spy)
    try:
        cfg = StormConfig(workload="mixed", seed=1, setups=["no-admission", *NEW], profile="tiny",
                          num_gpu_blocks=None, workload_overrides=dict(TINY_MIXED))
        wl, facts, runs = run_storm(cfg, progress)
    finally:
        mp.undo()
    report = build_report(wl, facts, runs, cfg, "pytest")
    report["_facts"] = facts
    return wl, report, sent, runs


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_each_setup_sends_what_its_real_counterpart_would(tiny_mixed: Any) -> None:
    wl, report, sent, runs = tiny_mixed
    targets = {"interactive": "1", "batch": "30"}
    for name in ("zp-slo", "zp-oracle-slo"):
        calls = sent[name]
        assert len(calls) == wl.num_requests
        for c in calls:
            tpot = wl.slo_of(c["class"]).tpot_s  # the interactive class's TPOT target; batch has none
            assert c["extra_headers"] == {TARGET_HEADER: targets[c["class"]],
                                          **({} if tpot is None else {TPOT_HEADER: f"{tpot:g}"}),
                                          "X-ZP-Priority": {"interactive": "0", "batch": "1"}[c["class"]]}
        assert any(TPOT_HEADER in c["extra_headers"] for c in calls)
    for name in ("no-admission", "zp-oracle-h1", "vllm-queue-cap"):
        assert all(c.keys() == {"class"} for c in sent[name])  # nothing added
    prio = {c["class"]: c["extra_body"]["priority"] for c in sent["vllm-priority"]}
    assert prio == {"interactive": 0, "batch": 1}
    by = {r.name: r for r in runs}
    # the server ran the priority policy and saw each request's class priority in its body
    sim = by["vllm-priority"].server_stats["requests"]
    expect = {r.id: wl.priority_of(r.slo_class) for r in by["vllm-priority"].records}
    assert sim and all(s["priority"] == expect[str(s["id"]).removeprefix("chatcmpl-")] for s in sim)
    assert by["vllm-priority"].sim_settings == {"policy": "priority"}
    assert {s["priority"] for s in by["no-admission"].server_stats["requests"]} == {0}


@pytest.mark.slow
def test_the_queue_cap_is_the_tightest_target_times_the_measured_prefill_throughput(tiny_mixed: Any) -> None:
    wl, report, _, runs = tiny_mixed
    tps = report["server"]["prefill_tokens_per_s"]
    # the tiny profile: c0 4 ms + 2 us per prefill token, a ~4k-token probe in one or two 2048-token steps
    assert 2.5e5 < tps < 5.0e5
    facts = report["_facts"]
    cap = {r.name: r for r in runs}["vllm-queue-cap"].sim_settings["max_num_queued_tokens"]
    assert cap == queue_cap_tokens(wl, facts) == math.floor(1.0 * facts.prefill_tokens_per_s)
    assert facts.prefill_tokens_per_s == pytest.approx(tps, abs=0.1)
    assert wl.tightest_ttft_s() == 1.0
    lines = "\n".join(header_lines(report))
    assert f"--max-num-queued-tokens {cap} = TTFT target 1 s x measured prefill throughput" in lines
    assert "vllm-priority: server --scheduling-policy priority" in lines
    assert "classes (each request scored against its own): interactive: TTFT <= 1 s, TPOT <= 40 ms" in lines


def test_the_report_splits_every_setup_and_class_into_in_slo_late_and_failed(tiny_mixed: Any) -> None:
    wl, report, _, runs = tiny_mixed
    by_run = {r.name: r for r in runs}
    for m in report["setups"]:
        assert m["in_slo"] + m["late"] + m["failed"] == m["requests"] == wl.num_requests
        assert m["in_slo"] == m["good"]
        assert sum(c["requests"] for c in m["classes"].values()) == m["requests"]
        for name, c in m["classes"].items():
            recs = [r for r in by_run[m["setup"]].records if r.slo_class == name]
            slo = wl.slo_of(name)
            good = [r for r in recs if r.ok and slo.met(r.ttft, r.tpot, streamed=r.stream)]
            assert c["in_slo"] == len(good) and c["late"] == sum(r.ok for r in recs) - len(good)
        assert m["conversations"] == 3 and 0 <= m["conversations_completed"] <= 3
        if m["conversations_completed"]:
            assert 0 < m["conversation_time_p50"] <= m["conversation_time_p99"] <= m["makespan"]
        assert m["preemptions"] == 0 or not m["setup"].startswith("zp-")
    table = markdown_table(report)
    assert "in SLO / late / failed" in table and "per class in SLO / late / failed" in table
    assert "convs done" in table


def test_a_one_class_workload_says_vllm_priority_sends_zero() -> None:
    from test_report_figures import FACTS, _cfg, _report, _run  # synthetic runs, the real report code

    from zp_storm.workloads import SLO, Session, Turn, Workload

    runs = [_run("no-admission", 10), _run("vllm-priority", 9, late=1)]
    report = _report(runs)
    assert report["setup_notes"]["vllm-priority"] == "one class: every request sends priority 0"
    assert "vllm-priority (one class: every request sends priority 0)" in markdown_table(report)
    assert "one class here: every request sends 0" in "\n".join(header_lines(report))
    # a trace whose requests carry their own priority sends those: no such note
    turn = Turn([], 10, 8, 8, priority=-1)
    trace = Workload("trace:t.jsonl", "synthetic", [Session("a", 0.0, "trace", [turn])], SLO(5.0, 0.04), None)
    own = build_report(trace, FACTS, runs, _cfg(), "pytest")
    assert "vllm-priority" not in own["setup_notes"]
    assert "one class here" not in "\n".join(header_lines(own))
