"""Replay tests: fidelity against vLLM's own scheduler (shared/fidelity), determinism, CLI."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from pathlib import Path

import pytest

from zp_sim.engine import EngineConfig
from zp_sim.profiles import get_profile
from zp_sim.replay import (
    ReplayError,
    add_replay_arguments,
    parse_workload,
    run_replay,
    run_replay_command,
)


def _shared_dir() -> Path:
    env = os.environ.get("ZP_SHARED_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared"


FIDELITY = _shared_dir() / "fidelity"
REFERENCES = sorted(FIDELITY.glob("vllm_*.json")) if FIDELITY.is_dir() else []
needs_fidelity = pytest.mark.skipif(
    not REFERENCES, reason=f"no vLLM fidelity references under {FIDELITY} (set ZP_SHARED_DIR)"
)


def _workload_for(ref: Path) -> Path:
    # vllm_<workload>_<num_blocks>.json -> <workload>.jsonl
    m = re.fullmatch(r"vllm_(.+)_\d+", ref.stem)
    assert m, ref
    return ref.with_name(m.group(1) + ".jsonl")


def _config_for(ref_cfg: dict) -> EngineConfig:
    return EngineConfig.from_profile(
        get_profile("fidelity"),
        num_gpu_blocks=ref_cfg["num_blocks"],
        block_size=ref_cfg["block_size"],
        max_num_seqs=ref_cfg["max_num_seqs"],
        max_num_batched_tokens=ref_cfg["max_num_batched_tokens"],
        max_model_len=ref_cfg["max_model_len"],
        enable_prefix_caching=ref_cfg["enable_prefix_caching"],
        reserve_full_isl=ref_cfg["scheduler_reserve_full_isl"],
        watermark=ref_cfg["watermark"],
        long_prefill_token_threshold=ref_cfg["long_prefill_token_threshold"],
    )


@needs_fidelity
@pytest.mark.parametrize("ref_path", REFERENCES, ids=[p.stem for p in REFERENCES])
def test_fidelity_against_vllm_scheduler(ref_path: Path) -> None:
    ref = json.loads(ref_path.read_text())
    out = run_replay(_workload_for(ref_path), _config_for(ref["config"]))
    mine = {q["id"]: q for q in out["requests"]}
    assert set(mine) == {q["id"] for q in ref["requests"]}
    errors = [
        abs(mine[q["id"]]["finish_step"] - q["finish_step"]) / max(q["finish_step"], 1)
        for q in ref["requests"]
    ]
    median_err = statistics.median(errors)
    ttft = statistics.mean(
        mine[q["id"]]["first_token_step"] - (q["arrival_step"] or 0) for q in ref["requests"]
    )
    print(
        f"\n{ref_path.name}: preemptions {out['preemptions']} vs vLLM {ref['preemptions']}; "
        f"median finish-step error {median_err:.4f}; mean TTFT steps {ttft:.2f} vs "
        f"{ref['mean_ttft_steps']:.2f}; recomputed {out['recomputed_tokens']} vs "
        f"{ref['recomputed_tokens']}"
    )
    assert abs(out["preemptions"] - ref["preemptions"]) <= max(1, 0.05 * ref["preemptions"])
    assert median_err <= 0.05
    assert out["finished"] == ref["finished"]


@needs_fidelity
@pytest.mark.parametrize("ref_path", REFERENCES, ids=[p.stem for p in REFERENCES])
def test_fidelity_exact_per_request(ref_path: Path) -> None:
    # Stricter than the acceptance bound: the engine reproduces vLLM's scheduler step for step,
    # including recomputed tokens and cache hits on resumption (which depend on the free
    # queue's eviction order).
    ref = json.loads(ref_path.read_text())
    out = run_replay(_workload_for(ref_path), _config_for(ref["config"]))
    keys = ("first_scheduled_step", "first_token_step", "finish_step", "num_preemptions", "recomputed_tokens")
    mine = {q["id"]: tuple(q[k] for k in keys) for q in out["requests"]}
    theirs = {q["id"]: tuple(q[k] for k in keys) for q in ref["requests"]}
    assert mine == theirs
    totals = ("preemptions", "recomputed_tokens", "max_running", "max_kv_usage")
    for key in (*totals, "prefix_cache_hit_tokens_all_admissions"):
        assert out[key] == ref[key], key


@needs_fidelity
def test_nullblock_fits_at_201_and_preempts_at_200() -> None:
    # 8 requests of ceil((prompt + max_tokens - 1) / 16) = 25 blocks: 200 usable blocks need
    # num_gpu_blocks = 201 because block 0 is the null block.
    workload = FIDELITY / "nullblock.jsonl"
    base = dict(max_model_len=401)
    fits = run_replay(workload, EngineConfig(num_gpu_blocks=201, **base))  # type: ignore[arg-type]
    short = run_replay(workload, EngineConfig(num_gpu_blocks=200, **base))  # type: ignore[arg-type]
    assert fits["preemptions"] == 0
    assert short["preemptions"] == 1
    assert fits["max_kv_usage"] == 1.0


@needs_fidelity
def test_replay_is_deterministic() -> None:
    workload = FIDELITY / "a_burst.jsonl"
    cfg = EngineConfig(num_gpu_blocks=2000, max_model_len=9216)
    a = json.dumps(run_replay(workload, cfg), sort_keys=True)
    b = json.dumps(run_replay(workload, cfg), sort_keys=True)
    assert a == b
    assert json.loads(a)["preemptions"] > 0


def test_replay_is_deterministic_with_prefixes_and_priorities() -> None:
    records = [
        {
            "id": f"r{i}",
            "arrival_step": i * 3,
            "prompt_tokens": 100 + 17 * (i % 5),
            "max_tokens": 30 + i,
            "prefix_id": f"p{i % 3}",
            "prefix_len": 64,
            "priority": i % 4,
        }
        for i in range(40)
    ]
    cfg = EngineConfig(num_gpu_blocks=60, max_model_len=256, policy="priority")
    a = run_replay(records, cfg)
    b = run_replay(records, cfg)
    assert a == b
    assert a["preemptions"] > 0 and a["finished"] == 40


def test_shared_prefixes_hit_the_cache_and_unique_ones_do_not() -> None:
    def rec(rid: str, step: int, prompt: int, prefix: str | None) -> dict:
        out = {"id": rid, "arrival_step": step, "prompt_tokens": prompt, "max_tokens": 5}
        if prefix:
            out.update(prefix_id=prefix, prefix_len=64)
        return out

    records = [rec("a", 0, 100, "x"), rec("b", 10, 90, "x"), rec("c", 20, 100, "y"), rec("d", 30, 100, None)]
    out = run_replay(records, EngineConfig(num_gpu_blocks=64, max_model_len=128))
    cached = {q["id"]: q["num_cached_tokens"] for q in out["requests"]}
    assert cached == {"a": 0, "b": 64, "c": 0, "d": 0}
    assert out["prefix_cache_hits_total"] == 64
    no_cache = EngineConfig(num_gpu_blocks=64, max_model_len=128, enable_prefix_caching=False)
    off = run_replay(records, no_cache)
    assert all(q["num_cached_tokens"] == 0 for q in off["requests"])


def test_idle_engine_jumps_to_next_arrival_step_and_time() -> None:
    steps = run_replay(
        [
            {"id": "a", "arrival_step": 0, "prompt_tokens": 10, "max_tokens": 3},
            {"id": "b", "arrival_step": 100, "prompt_tokens": 10, "max_tokens": 3},
        ],
        EngineConfig(num_gpu_blocks=16, max_model_len=64),
    )
    b = steps["requests"][1]
    assert (b["first_token_step"], b["finish_step"]) == (100, 102)
    assert steps["steps"] == 6  # only steps that scheduled tokens count
    timed = run_replay(
        [
            {"id": "a", "arrival_s": 0.0, "prompt_tokens": 10, "max_tokens": 3},
            {"id": "b", "arrival_s": 10.0, "prompt_tokens": 10, "max_tokens": 3},
        ],
        EngineConfig(num_gpu_blocks=16, max_model_len=64),
    )
    b = timed["requests"][1]
    assert b["first_token_s"] == pytest.approx(10.02)
    assert b["finish_s"] == pytest.approx(10.06)
    assert b["first_token_step"] == 3


def test_arrival_s_uses_profile_step_times() -> None:
    prof = get_profile("tiny")
    out = run_replay(
        [{"id": "a", "arrival_s": 1.5, "prompt_tokens": 1000, "max_tokens": 2}],
        EngineConfig.from_profile(prof),
    )
    q = out["requests"][0]
    assert q["first_token_s"] == pytest.approx(1.5 + prof.step_time(1000, 1000 * 1000, 0, 0))


def test_workload_validation_errors() -> None:
    with pytest.raises(ReplayError, match="not both"):
        parse_workload([{"arrival_step": 0, "arrival_s": 1.0, "prompt_tokens": 5, "max_tokens": 1}])
    with pytest.raises(ReplayError, match="prompt_tokens"):
        parse_workload([{"arrival_step": 0, "max_tokens": 1}])
    with pytest.raises(ReplayError, match="prefix_len"):
        parse_workload([{"prompt_tokens": 5, "max_tokens": 1, "prefix_id": "x", "prefix_len": 9}])
    with pytest.raises(ReplayError, match="duplicate"):
        parse_workload([{"id": "a", "prompt_tokens": 5, "max_tokens": 1}] * 2)
    with pytest.raises(ReplayError, match="every line"):
        parse_workload(
            [
                {"arrival_step": 0, "prompt_tokens": 5, "max_tokens": 1},
                {"arrival_s": 0, "prompt_tokens": 5, "max_tokens": 1},
            ]
        )
    with pytest.raises(ReplayError, match="max-model-len"):
        run_replay(
            [{"prompt_tokens": 100, "max_tokens": 1}], EngineConfig(num_gpu_blocks=16, max_model_len=64)
        )


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_replay_arguments(parser)
    return parser.parse_args(argv)


def test_cli_prints_json_and_defaults_max_model_len(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.jsonl"
    # 4 x (385 + 16) and 4 x (384 + 17): 25 blocks each; the 384-token prompts cross into
    # their 25th block on their first decode, so 200 blocks preempt and 201 do not.
    lines = [{"arrival_step": 0, "prompt_tokens": 385, "max_tokens": 16}] * 4
    lines += [{"arrival_step": 0, "prompt_tokens": 384, "max_tokens": 17}] * 4
    wl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert run_replay_command(_cli([str(wl), "--num-gpu-blocks", "201"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["max_model_len"] == 401
    assert out["preemptions"] == 0
    assert [q["id"] for q in out["requests"]] == [str(i) for i in range(8)]
    assert run_replay_command(_cli([str(wl), "--num-gpu-blocks", "200", "--policy", "priority"])) == 0
    assert json.loads(capsys.readouterr().out)["preemptions"] >= 1


def test_cli_reports_bad_input_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.jsonl"
    wl.write_text('{"prompt_tokens": 10, "max_tokens": 5}\nnot json\n')
    assert run_replay_command(_cli([str(wl), "--num-gpu-blocks", "64"])) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert run_replay_command(_cli([str(tmp_path / "missing.jsonl")])) == 2
    wl.write_text('{"prompt_tokens": 10, "max_tokens": 5}\n')
    assert run_replay_command(_cli([str(wl), "--profile", "nope"])) == 2
    assert "fidelity" in capsys.readouterr().err
    # A pool that cannot hold one max_model_len sequence is refused up front.
    assert run_replay_command(_cli([str(wl), "--num-gpu-blocks", "1"])) == 2
