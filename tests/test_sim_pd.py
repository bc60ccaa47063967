"""The simulator engine's side of prefill/decode disaggregation (vLLM's NixlConnector, issue 20): a
prefill engine's request that keeps its blocks after finishing (``hold_kv``) and a decode engine's
request whose prompt KV is pulled from a peer (``remote_kv``)."""

from __future__ import annotations

import pytest

from zp_client.sim.engine import Engine, EngineConfig

BS = 16


def engine(blocks: int = 64, per_block: float = 0.001, **kw: object) -> Engine:
    return Engine(EngineConfig(num_gpu_blocks=blocks, block_size=BS, max_model_len=min(512, (blocks - 1) * BS),
                               max_num_batched_tokens=256, kv_transfer_s_per_block=per_block, **kw))


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def run_until_idle(e: Engine, limit: int = 10_000) -> list:
    outs = []
    for _ in range(limit):
        if not e.has_unfinished():
            break
        out = e.step()
        if out.step is None:
            ready = e.next_kv_ready()
            assert ready is not None, "an idle engine with work must be waiting for a transfer"
            e.advance_idle(ready)
        outs.append(out)
    return outs


def test_a_hold_kv_request_keeps_its_blocks_until_freed() -> None:
    e = engine()
    e.add_request("p", prompt(100), 1, hold_kv=True)
    run_until_idle(e)
    rec = e.request_record("p")
    assert rec.finished and rec.output_tokens_done == 1
    assert e.held_kv_ids == ["p"] and e.held_kv_blocks == 7  # 101 tokens: 7 blocks
    assert e.stats.num_free_blocks == 63 - 7 and e.stats.kv_held_blocks == 7
    assert e.free_held("p") == 7 and e.free_held("p") == 0
    assert e.stats.num_free_blocks == 63 and e.held_kv_blocks == 0
    # freed into the prefix cache: the same prompt hits its 6 full blocks
    e.add_request("again", prompt(100), 1)
    run_until_idle(e)
    assert e.request_record("again").num_cached_tokens == 96


def test_a_remote_kv_request_pulls_its_prompt_then_recomputes_the_last_token() -> None:
    e = engine(per_block=0.002)
    e.add_request("d", prompt(100), 3, remote_kv=True)
    first = e.step()
    assert first.step is None and first.kv_loading == ["d"]  # admitted, nothing to compute yet
    assert e.stats.num_free_blocks == 63 - 7  # every prompt block allocated at admission
    assert e.next_kv_ready() == pytest.approx(7 * 0.002)
    assert e.kv_pulled_blocks_total == 7
    e.advance_idle(e.next_kv_ready())
    out = e.step()
    assert out.kv_loaded == ["d"] and out.scheduled == {"d": 1} and out.first_token == ["d"]
    run_until_idle(e)
    rec = e.request_record("d")
    assert rec.finished and rec.output_tokens_done == 3 and rec.num_cached_tokens == 0
    assert rec.recomputed_tokens == 0


def test_only_the_blocks_missing_from_the_local_cache_are_pulled() -> None:
    e = engine()
    shared = prompt(64)  # 4 full blocks, cached by an earlier request
    e.add_request("warm", [*shared, *prompt(10, 5000)], 1)
    run_until_idle(e)
    e.add_request("d", [*shared, *prompt(40, 7000)], 2, remote_kv=True)
    e.step()
    assert e.kv_pulled_blocks_total == 7 - 4  # 104 tokens = 7 blocks, 4 of them hit locally
    run_until_idle(e)
    assert e.request_record("d").num_cached_tokens == 64


def test_a_transfer_in_flight_does_not_hold_up_the_line_and_keeps_its_place() -> None:
    e = engine(per_block=0.5)  # a slow pull: 7 blocks take 3.5 s
    e.add_request("d", prompt(100), 2, remote_kv=True)
    e.add_request("local", prompt(20, 9000), 2)
    out = e.step()
    assert out.kv_loading == ["d"] and "local" in out.scheduled
    assert e.waiting_ids == ["d"]
    run_until_idle(e)
    assert e.request_record("local").finish_time < e.request_record("d").first_token_time


def test_the_whole_prompt_must_fit_before_a_remote_kv_request_is_admitted() -> None:
    e = engine(blocks=12)  # 11 usable blocks
    e.add_request("big", prompt(150), 40)  # 10 blocks now, growing
    e.step()
    e.add_request("d", prompt(100, 3000), 2, remote_kv=True)  # needs 7 blocks: waits
    out = e.step()
    assert out.kv_loading == [] and "d" in e.waiting_ids
    run_until_idle(e)
    assert e.request_record("d").finished


def test_aborting_a_request_whose_kv_is_on_its_way_frees_its_blocks() -> None:
    e = engine(per_block=1.0)
    e.add_request("d", prompt(100), 2, remote_kv=True)
    e.step()
    assert e.stats.num_free_blocks == 63 - 7
    assert e.abort("d")
    assert e.stats.num_free_blocks == 63 and e.next_kv_ready() is None and not e.has_unfinished()


def test_a_preempted_remote_kv_request_recomputes_its_prompt_locally() -> None:
    e = engine(blocks=16, per_block=0.0)  # 15 usable blocks
    e.add_request("d", prompt(100), 60, remote_kv=True)  # 7 blocks, grows to 10
    e.add_request("other", prompt(90, 4000), 80)  # 6 blocks, grows to 11
    run_until_idle(e)
    d, other = e.request_record("d"), e.request_record("other")
    assert d.finished and other.finished
    # d joined the running list last (after its pull), so it is the one preempted (FCFS: the last)
    assert d.num_preemptions >= 1 and other.num_preemptions == 0
    assert d.recomputed_tokens > 0  # its prompt computed here the second time...
    assert e.kv_pulled_blocks_total == 7  # ...not pulled again


def test_the_transfer_time_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="kv_transfer_s_per_block"):
        engine(per_block=-1.0)
