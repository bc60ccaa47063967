"""The ``mixed`` workload (issue 30): an interactive class and agentic's conversations on one server, each
request scored against its own class's targets."""

from __future__ import annotations

import pytest

from zp_storm.report import build_report
from zp_storm.runner import StormConfig, run_storm
from zp_storm.workloads import (
    MIXED_BATCH_TTFT_S,
    MIXED_INTERACTIVE_TPOT_S,
    MIXED_INTERACTIVE_TTFT_S,
    SLO,
    ServerFacts,
    build_workload,
)

FACTS = ServerFacts(num_gpu_blocks=2049, block_size=16, max_model_len=32768, unloaded_itl_s=0.008)


def _turns(sessions):  # every turn of every session, sub-agents included
    out = []
    for s in sessions:
        for t in s.turns:
            out.append((s, t))
            out += _turns(t.children)
    return out


@pytest.mark.slow
def test_mixed_is_agentic_plus_an_interactive_class_with_its_own_targets() -> None:
    wl = build_workload("mixed", FACTS, seed=3, conversations=4, rate_per_s=2.0, span_s=20.0)
    agentic = build_workload("agentic", FACTS, seed=3, conversations=4)
    batch = [s for s in wl.sessions if s.kind == "agent"]
    inter = [s for s in wl.sessions if s.kind == "interactive"]
    # the batch class is agentic's, request for request (the interactive draws have their own RNG)
    assert [(s.id, s.start_s) for s in batch] == [(s.id, s.start_s) for s in agentic.sessions]
    assert [(t.prompt_tokens, t.true_out, t.max_tokens) for _, t in _turns(batch)] == [
        (t.prompt_tokens, t.true_out, t.max_tokens) for _, t in _turns(agentic.sessions)]
    assert {t.slo_class for _, t in _turns(batch)} == {"batch"}
    # interactive: single streamed calls, prompts ~500 tokens, outputs <= 256, within the span
    assert 20 <= len(inter) <= 60  # 2/s over 20 s, Poisson
    prompts = sorted(s.turns[0].prompt_tokens for s in inter)
    assert 350 <= prompts[len(prompts) // 2] <= 650 and prompts[0] >= 240 and prompts[-1] <= 1020
    assert all(len(s.turns) == 1 and s.turns[0].slo_class == "interactive" and s.turns[0].stream
               and s.turns[0].max_tokens == 256 and 1 <= s.turns[0].true_out <= 256 for s in inter)
    assert all(0 < s.start_s < 20.0 for s in inter)
    assert [s.start_s for s in wl.sessions] == sorted(s.start_s for s in wl.sessions)
    # the classes and how a request is scored
    assert wl.classes["interactive"].slo == SLO(MIXED_INTERACTIVE_TTFT_S, MIXED_INTERACTIVE_TPOT_S)
    assert wl.classes["interactive"].priority == 0
    assert wl.classes["batch"].slo == SLO(MIXED_BATCH_TTFT_S, None) and wl.classes["batch"].priority == 1
    assert (MIXED_INTERACTIVE_TTFT_S, MIXED_INTERACTIVE_TPOT_S, MIXED_BATCH_TTFT_S) == (1.0, 0.04, 30.0)
    assert wl.slo_of("batch").met(3.0, 0.2) and not wl.slo_of("interactive").met(3.0, 0.02)
    assert wl.slo_of(None) == wl.slo == wl.classes["interactive"].slo and wl.tightest_ttft_s() == 1.0
    assert wl.priority_of("batch") == 1 and wl.priority_of(None) == 0
    # deterministic in the seed; offered load scales both classes
    again = build_workload("mixed", FACTS, seed=3, conversations=4, rate_per_s=2.0, span_s=20.0)
    assert [(s.id, s.start_s) for s in again.sessions] == [(s.id, s.start_s) for s in wl.sessions]
    double = build_workload("mixed", FACTS, seed=3, load_scale=2.0, conversations=4, rate_per_s=2.0,
                            span_s=20.0)
    assert sum(s.kind == "agent" for s in double.sessions) == 8
    assert double.params["interactive_rate_per_s"] == 4.0
    # x2 is twice the interactive rate over the same span (agentic's own window grows with its count)
    default = build_workload("mixed", FACTS, seed=3, conversations=4)
    default2 = build_workload("mixed", FACTS, seed=3, load_scale=2.0, conversations=4)
    assert default.params["interactive_span_s"] == default2.params["interactive_span_s"] == pytest.approx(
        2 * 4 * 400 * FACTS.unloaded_itl_s)
    assert 1.6 < default2.params["interactive_calls"] / default.params["interactive_calls"] < 2.4
    assert wl.params["interactive_tokens_per_s"] == pytest.approx(
        sum(s.turns[0].prompt_tokens + s.turns[0].true_out for s in inter) / 20.0, abs=0.1)


def test_a_tpot_target_left_out_scores_ttft_only() -> None:
    slo = SLO(30.0, None)
    assert slo.met(29.0, 5.0) and not slo.met(31.0, 0.001)
    assert slo.met(None, None, streamed=False, e2e=29.9, out_tokens=500)
    assert not slo.met(None, None, streamed=False, e2e=30.1, out_tokens=500)


@pytest.mark.slow
def test_mixed_at_1x_preempts_without_admission_and_the_interactive_class_is_under_30pct() -> None:
    """The calibration issue 30 asks for, measured: at 1x ``no-admission`` preempts at least once, and the
    interactive class alone offers <= 30% of the tokens the server computed per second in that run
    (prefill tokens not served from the prefix cache + generated tokens, over the makespan)."""
    cfg = StormConfig(workload="mixed", seed=0, setups=["no-admission"], num_gpu_blocks=2049,
                      max_model_len=32768)
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    m = report["setups"][0]
    eng = runs[0].server_stats["engine"]
    computed = (eng["prompt_tokens_total"] - eng["prefix_cache_hits_total"] + eng["generation_tokens_total"])
    server_tps = computed / m["makespan"]
    offered = wl.params["interactive_tokens_per_s"]
    print(f"mixed 1x seed 0: no-admission preempted {m['preemptions']} times; interactive offers "
          f"{offered:.0f} tokens/s = {offered / server_tps:.1%} of the server's {server_tps:.0f} computed "
          f"tokens/s; classes {m['classes']}")
    assert m["preemptions"] >= 1
    assert offered <= 0.30 * server_tps
    assert m["in_slo"] + m["late"] + m["failed"] == m["requests"] == wl.num_requests
    assert m["conversations"] == wl.params["conversations"]
    assert set(m["classes"]) == {"interactive", "batch"}
    assert sum(c["requests"] for c in m["classes"].values()) == m["requests"]
