"""Unit tests of the simulated engine: one test (or more) per SIM behaviour of shared/VLLM_FACTS.md."""

from __future__ import annotations

import itertools

import pytest

from zp_sim.engine import DEFAULT_STEP_TIME, Engine, EngineConfig, output_token_id
from zp_sim.profiles import PROFILES, StepProfile, get_profile

_ids = itertools.count(10_000, 1000)


def prompt(n: int) -> list[int]:
    """A prompt of n tokens no other prompt shares."""
    start = next(_ids) * 10
    return list(range(start, start + n))


def engine(**kw: object) -> Engine:
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("max_model_len", 512)
    return Engine(EngineConfig(**kw))  # type: ignore[arg-type]


def run_all(e: Engine, limit: int = 10_000) -> list:
    outs = []
    for _ in range(limit):
        if not e.has_unfinished():
            return outs
        outs.append(e.step())
    raise AssertionError("engine did not finish")


# ------------------------------------------------------------------------------ block pool


def test_null_block_is_never_handed_out_and_usage_counts_n_minus_1() -> None:
    e = engine(num_gpu_blocks=5, max_model_len=64)
    assert e.stats.num_free_blocks == 4  # block 0 is the null block
    assert e.kv_usage == 0.0
    e.add_request("a", prompt(48), 10)
    e.step()
    assert e.kv_usage == 0.75  # 3 of the 4 usable blocks
    e.step()
    # Position 48 needs a 4th block: the whole usable pool, none of them block 0.
    assert e.kv_usage == 1.0
    assert 0 not in [b.block_id for b in e._requests["a"].blocks]


def test_block_boundaries_prefill_and_decode() -> None:
    e = engine(num_gpu_blocks=11, max_model_len=64, enable_prefix_caching=False)
    e.add_request("a", prompt(16), 3)
    e.step()  # prefill 16 tokens: exactly 1 block
    assert e.stats.num_free_blocks == 9
    e.step()  # computes position 16: the 17th token needs a 2nd block
    assert e.stats.num_free_blocks == 8
    e2 = engine(num_gpu_blocks=11, max_model_len=64, enable_prefix_caching=False)
    e2.add_request("b", prompt(17), 10)
    e2.step()  # 17 tokens = 2 blocks
    assert e2.stats.num_free_blocks == 8
    for _ in range(4):  # positions 17..20 stay inside the 2nd block
        e2.step()
    assert e2.stats.num_free_blocks == 8


def test_last_sampled_token_never_gets_kv() -> None:
    # Two requests of 16 + 17 tokens need ceil((16 + 17 - 1) / 16) = 2 blocks each: 4 blocks
    # (N = 5 with the null block) run without preemption, one block less preempts.
    for n_blocks, expect in ((5, 0), (4, 1)):
        e = engine(num_gpu_blocks=n_blocks, max_model_len=33)
        e.add_request("a", prompt(16), 17)
        e.add_request("b", prompt(16), 17)
        run_all(e)
        assert e.stats.preemptions_total == expect, n_blocks
        assert e.request_record("a").output_tokens_done == 17


def test_config_refuses_a_pool_smaller_than_one_max_len_sequence() -> None:
    with pytest.raises(ValueError, match="usable blocks"):
        engine(num_gpu_blocks=4, max_model_len=64)  # 4 blocks needed, 3 usable
    with pytest.raises(ValueError, match="null block"):
        engine(num_gpu_blocks=1)


def test_free_queue_order_allocation_front_hashed_back_unhashed_front_tail_first() -> None:
    e = engine(num_gpu_blocks=10, max_model_len=128)
    assert e._pool.free.ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    e.add_request("a", prompt(40), 1)  # 2 full blocks + 8 tokens
    out = e.step()
    assert out.finished == ["a"]
    # Allocation popped 1, 2, 3 from the front. Freed tail first: block 3 (partial, no hash)
    # to the FRONT, then blocks 2 and 1 (hashed) to the BACK in that order.
    assert e._pool.free.ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert e._pool.blocks[2].block_hash is not None
    assert e._pool.blocks[3].block_hash is None


def test_popped_cached_block_is_evicted_at_allocation() -> None:
    e = engine(num_gpu_blocks=10, max_model_len=128)
    shared = prompt(40)
    e.add_request("a", shared, 1)
    e.step()  # free queue now [3, 4, ..., 9, 2, 1]; blocks 2 and 1 cached
    e.add_request("b", prompt(128), 1)  # 8 blocks: pops 3..9 then block 2, evicting its hash
    e.step()
    assert e._pool.blocks[2].block_hash is not None  # re-hashed with b's tokens now
    e.add_request("c", shared, 1)
    e.step()
    # Only a's first block survived; its second was evicted when b popped it.
    assert e.request_record("c").num_cached_tokens == 16


def test_prefix_hit_capped_at_num_tokens_minus_1_and_ref_counts() -> None:
    e = engine(num_gpu_blocks=20, max_model_len=128)
    p = prompt(48)  # exactly 3 full blocks
    e.add_request("a", p, 10)
    e.step()
    free_before = e.stats.num_free_blocks
    e.add_request("b", p, 10)
    e.step()
    rec = e.request_record("b")
    # A fully cached prompt still recomputes its last block: hit = 2 blocks, not 3.
    assert rec.num_cached_tokens == 32
    a_blocks = e._requests["a"].blocks
    b_blocks = e._requests["b"].blocks
    assert a_blocks[:2] == b_blocks[:2]
    assert [blk.ref_cnt for blk in b_blocks[:2]] == [2, 2]
    assert b_blocks[2] is not a_blocks[2]
    # b took 1 new block for its 3rd block plus the block a's decode needed (position 48).
    assert e.stats.num_free_blocks == free_before - 2
    assert e.stats.prefix_cache_queries_total == 96
    assert e.stats.prefix_cache_hits_total == 32


def test_hit_on_unreferenced_cached_blocks_takes_them_out_of_the_free_queue() -> None:
    e = engine(num_gpu_blocks=20, max_model_len=128)
    p = prompt(49)  # 3 full blocks + 1 token
    e.add_request("a", p, 1)
    e.step()
    assert e.stats.num_free_blocks == 19  # all freed, 3 of them still cached
    assert e.kv_usage == 0.0  # cached-but-unreferenced blocks count as free
    e.add_request("b", p, 5)
    e.step()
    assert e.request_record("b").num_cached_tokens == 48
    ids = e._pool.free.ids()
    for blk in e._requests["b"].blocks[:3]:
        assert blk.ref_cnt == 1 and blk.block_id not in ids
    assert e.stats.num_free_blocks == 19 - 4


def test_output_tokens_are_hashed_once_their_block_is_full() -> None:
    e = engine(num_gpu_blocks=20, max_model_len=128)
    p = prompt(16)
    e.add_request("a", p, 17)
    run_all(e)
    out_ids = e.output_token_ids("a")
    assert out_ids == [output_token_id("a", i) for i in range(17)]
    # The block of tokens 16..31 (16 output tokens) is cached: a prompt continuing the
    # conversation hits 32 tokens.
    e.add_request("b", p + out_ids[:16] + [7, 8, 9], 1)
    e.step()
    assert e.request_record("b").num_cached_tokens == 32


def test_prefix_caching_off_never_hits() -> None:
    e = engine(num_gpu_blocks=20, max_model_len=128, enable_prefix_caching=False)
    p = prompt(48)
    e.add_request("a", p, 1)
    e.step()
    e.add_request("b", p, 1)
    e.step()
    assert e.request_record("b").num_cached_tokens == 0
    assert e.stats.prefix_cache_queries_total == 0


# ------------------------------------------------------------------------------- scheduler


def test_token_budget_chunked_prefill_and_partial_chunk_yields_no_token() -> None:
    e = engine(max_num_batched_tokens=100)
    for rid in "abc":
        e.add_request(rid, prompt(60), 5)
    o0 = e.step()
    assert o0.scheduled == {"a": 60, "b": 40}
    assert o0.new_tokens == {"a": 1, "b": 0}
    assert o0.first_token == ["a"]
    o1 = e.step()
    # Running first, in order: a decodes, b finishes its prefill, c gets the rest.
    assert list(o1.scheduled.items()) == [("a", 1), ("b", 20), ("c", 60)]
    assert o1.new_tokens == {"a": 1, "b": 1, "c": 1}
    assert e.request_record("b").first_token_step == 1
    assert e.request_record("b").first_scheduled_step == 0


def test_max_num_seqs_caps_running() -> None:
    e = engine(max_num_seqs=2)
    for rid in "abc":
        e.add_request(rid, prompt(10), 3)
    out = e.step()
    assert set(out.scheduled) == {"a", "b"}
    assert e.stats.num_running == 2 and e.stats.num_waiting == 1
    run_all(e)
    assert e.request_record("c").first_scheduled_step == 3  # after a and b finish at step 2


def test_admission_stops_at_first_waiting_request_that_does_not_fit() -> None:
    e = engine(num_gpu_blocks=9, max_model_len=128)  # 8 usable blocks
    e.add_request("a", prompt(64), 20)  # 4 blocks
    e.add_request("big", prompt(80), 2)  # 5 blocks: does not fit next to a
    e.add_request("small", prompt(16), 2)  # would fit, but is behind big
    out = e.step()
    assert list(out.scheduled) == ["a"]
    assert e.waiting_ids == ["big", "small"]


def test_full_sequence_admission_check_toggle() -> None:
    # A 100-token prompt under a 40-token budget: the first chunk (39 tokens next to a's
    # decode) needs 3 blocks, the whole prompt 7. With 5 of 7 blocks free only the
    # first-chunk check (older V1) admits it.
    for reserve, expect in ((True, []), (False, ["b"])):
        e = engine(num_gpu_blocks=8, max_model_len=112, max_num_batched_tokens=40, reserve_full_isl=reserve)
        e.add_request("a", prompt(16), 50)
        e.step()
        e.add_request("b", prompt(100), 5)
        out = e.step()
        assert [r for r in out.scheduled if r != "a"] == expect, reserve


def test_watermark_keeps_a_fraction_free_for_admissions() -> None:
    for watermark, expect in ((0.0, ["b"]), (0.25, [])):
        e = engine(num_gpu_blocks=20, max_model_len=256, watermark=watermark)
        e.add_request("a", prompt(16), 50)
        e.step()  # a holds 1 block (2 after its next decode); 19 usable
        e.add_request("b", prompt(200), 5)  # 13 of 17 free blocks: fits, but not with 5 held back
        out = e.step()
        assert [r for r in out.scheduled if r != "a"] == expect, watermark
    # The watermark does not apply when nothing runs (a lone request is never blocked by it).
    e = engine(num_gpu_blocks=20, max_model_len=256, watermark=0.5)
    e.add_request("x", prompt(250), 1)
    assert e.step().scheduled == {"x": 250}


def _fcfs_preemption_engine() -> Engine:
    # 8 usable blocks; a and b need their 3rd block at step 1 while c holds 4.
    e = engine(num_gpu_blocks=9, max_model_len=128, enable_prefix_caching=False)
    e.add_request("a", prompt(32), 40)  # 2 blocks after prefill, 3rd at position 32
    e.add_request("b", prompt(32), 40)
    e.add_request("c", prompt(63), 40)  # 4 blocks
    return e


def test_fcfs_preemption_victim_is_last_running_and_goes_to_queue_front() -> None:
    e = _fcfs_preemption_engine()
    e.step()
    assert e.running_ids == ["a", "b", "c"]
    e.add_request("d", prompt(8), 1)
    out = e.step()  # a needs a 3rd block: pool empty -> preempt the LAST running (c)
    assert out.preempted == ["c"]
    assert e.running_ids == ["a", "b"]
    assert e.waiting_ids == ["c", "d"]  # the victim goes back to the FRONT
    assert e.stats.preemptions_total == 1
    rec = e.request_record("c")
    assert rec.num_preemptions == 1
    assert e._requests["c"].num_computed == 0 and e._requests["c"].blocks == []
    run_all(e)
    rec = e.request_record("c")
    assert rec.finished and rec.output_tokens_done == 40
    assert rec.num_preemptions == 1
    # c had computed its 63 prompt tokens; on resumption it recomputes those 63 (below its
    # high-water mark) and computes its first output token (position 63) for the first time.
    assert rec.recomputed_tokens == 63
    assert e.stats.recomputed_tokens == sum(e.request_record(r).recomputed_tokens for r in "abcd")


def test_requester_preempts_itself_when_it_is_the_last() -> None:
    e = engine(num_gpu_blocks=5, max_model_len=64, enable_prefix_caching=False)
    e.add_request("a", prompt(16), 30)  # 1 block, grows to 3
    e.add_request("b", prompt(32), 30)  # 2 blocks, grows to 4
    e.step()
    e.step()  # a takes block 3 (position 16); b (position 32) needs one more: only 1 left
    e.step()
    outs = run_all(e)
    assert e.stats.preemptions_total >= 1
    assert e.request_record("b").num_preemptions >= 1
    assert e.request_record("a").num_preemptions == 0
    assert all(e.request_record(r).finished for r in "ab")
    assert outs  # the run made progress after the self-preemption


def test_no_admission_in_a_step_that_preempted() -> None:
    # Without the full-sequence check a preempted request's first chunk can fit at once;
    # vLLM still admits nobody in the step that preempted.
    e = engine(
        num_gpu_blocks=9,
        max_num_batched_tokens=20,
        max_model_len=128,
        reserve_full_isl=False,
        enable_prefix_caching=False,
    )
    e.add_request("A", prompt(16), 40)
    e.add_request("B", prompt(16), 40)
    e.add_request("C", prompt(48), 40)
    outs = run_all(e)
    first = next(i for i, o in enumerate(outs) if o.preempted)
    pre, nxt = outs[first], outs[first + 1]
    assert pre.preempted == ["C"]
    assert "C" not in pre.scheduled
    budget_left = 20 - sum(pre.scheduled.values())
    # It would have fitted: the next step (same running decodes) admits its chunk.
    assert nxt.scheduled["C"] == budget_left
    free_after_pre = -(-budget_left // 16)
    assert e.config.num_gpu_blocks - 1 - round(pre.kv_usage * 8) >= free_after_pre
    assert nxt.preempted == []


def test_priority_victim_is_max_priority_then_arrival() -> None:
    e = engine(num_gpu_blocks=9, max_model_len=128, enable_prefix_caching=False, policy="priority")
    e.add_request("a", prompt(32), 40, priority=0, arrival_time=0.0)
    e.add_request("c", prompt(32), 40, priority=5, arrival_time=0.0)  # least urgent
    e.add_request("b", prompt(63), 40, priority=1, arrival_time=0.0)
    e.step()
    assert e.running_ids == ["a", "b", "c"]  # admitted in priority order
    out = e.step()
    assert out.preempted == ["c"]  # largest (priority, arrival), although not last
    assert out.scheduled["a"] == 1 and out.scheduled["b"] == 1
    # Same priority: the later arrival is the victim.
    e = engine(num_gpu_blocks=9, max_model_len=128, enable_prefix_caching=False, policy="priority")
    e.add_request("a", prompt(32), 40, arrival_time=0.0)
    e.add_request("late", prompt(32), 40, arrival_time=2.0)
    e.add_request("b", prompt(63), 40, arrival_time=1.0)
    e.step()
    out = e.step()
    assert out.preempted == ["late"]


def test_priority_victim_already_scheduled_returns_its_budget() -> None:
    e = engine(num_gpu_blocks=9, max_model_len=128, enable_prefix_caching=False, policy="priority")
    e.add_request("low", prompt(20), 40, priority=9)  # admitted first: runs before "hi"
    e.step()
    e.add_request("hi", prompt(95), 40, priority=0)  # 6 blocks
    e.step()
    assert e.running_ids == ["low", "hi"]
    outs = run_all(e)
    pre = next(o for o in outs if o.preempted)
    # "hi" needed a block after "low" was scheduled in the same step: "low" is the victim
    # and its already-scheduled token is taken back out of the batch.
    assert pre.preempted == ["low"]
    assert "low" not in pre.scheduled
    assert e.request_record("hi").num_preemptions == 0


def test_priority_waiting_queue_orders_by_priority() -> None:
    e = engine(max_num_seqs=1, policy="priority")
    e.add_request("x", prompt(8), 1, priority=3)
    e.add_request("y", prompt(8), 1, priority=1)
    e.add_request("z", prompt(8), 1, priority=2)
    order = [next(iter(e.step().scheduled)) for _ in range(3)]
    assert order == ["y", "z", "x"]


def test_abort_frees_blocks_at_once_running_and_waiting() -> None:
    e = engine(num_gpu_blocks=20, max_model_len=256, enable_prefix_caching=False)
    e.add_request("a", prompt(100), 50)
    e.add_request("w", prompt(250), 5)  # does not fit next to a: waits
    e.step()
    assert e.stats.num_free_blocks == 19 - 7
    assert e.abort("a") is True
    assert e.stats.num_free_blocks == 19
    assert e.abort("a") is False
    assert e.stats.num_waiting == 1
    assert e.abort("w") is True
    assert not e.has_unfinished()
    assert e.request_record("a").aborted and not e.request_record("a").finished
    assert e.abort("nope") is False


# ----------------------------------------------------------------------------- time, stats


def test_idle_step_does_not_advance_and_advance_idle_jumps() -> None:
    e = engine()
    out = e.step()
    assert out.step is None and e.now == 0.0 and e.step_index == 0
    e.advance_idle(5.0)
    e.add_request("a", prompt(8), 2)
    out = e.step()
    assert out.step == 0 and out.start_time == 5.0
    assert out.end_time == pytest.approx(5.0 + DEFAULT_STEP_TIME)
    assert e.request_record("a").arrival == 5.0


def test_step_time_follows_profile() -> None:
    prof = StepProfile(
        name="t", c0=1.0, c1=0.1, c2=0.001, c3=0.01, c4=0.5, num_gpu_blocks=64, max_model_len=256
    )
    e = Engine(EngineConfig.from_profile(prof))
    e.add_request("a", prompt(20), 3)
    o = e.step()  # prefill 20 tokens
    assert o.end_time - o.start_time == pytest.approx(1.0 + 0.1 * 20 + 0.001 * 400)
    e.add_request("b", prompt(10), 2)
    o = e.step()  # a decodes with context 21, b prefills 10
    assert o.end_time - o.start_time == pytest.approx(1.0 + 0.1 * 10 + 0.001 * 100 + 0.01 * 21 + 0.5)
    assert e.now == pytest.approx(o.end_time)


def test_stats_counters() -> None:
    e = engine()
    e.add_request("a", prompt(30), 4)
    e.add_request("b", prompt(20), 2)
    run_all(e)
    s = e.stats
    assert s.prompt_tokens_total == 50
    assert s.generation_tokens_total == 6
    assert s.steps == 4
    assert s.num_running == 0 and s.num_waiting == 0 and s.kv_usage == 0.0
    rec = e.request_record("a")
    assert (rec.first_token_step, rec.finish_step) == (0, 3)
    assert rec.finish_time == pytest.approx(4 * DEFAULT_STEP_TIME)


def test_add_request_validation() -> None:
    e = engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        e.add_request("a", prompt(65), 1)
    with pytest.raises(ValueError, match="empty"):
        e.add_request("a", [], 1)
    with pytest.raises(ValueError, match="output_tokens"):
        e.add_request("a", prompt(5), 0)
    e.add_request("a", prompt(5), 1)
    with pytest.raises(ValueError, match="already"):
        e.add_request("a", prompt(5), 1)


def test_generation_stops_at_max_model_len() -> None:
    e = engine(max_model_len=40)
    e.add_request("a", prompt(30), 100)
    run_all(e)
    assert e.request_record("a").output_tokens_done == 10


def test_engine_is_deterministic() -> None:
    def run() -> list:
        e = engine(num_gpu_blocks=30, max_model_len=256, max_num_batched_tokens=64)
        for i in range(12):
            e.add_request(f"r{i}", list(range(i * 7, i * 7 + 40 + 5 * i)), 20 + i)
        return [(o.step, o.scheduled, o.preempted, o.finished) for o in run_all(e)]

    assert run() == run()


def test_profiles_are_documented_and_lookup_errors_list_names() -> None:
    for p in PROFILES.values():
        assert p.source
        Engine(EngineConfig.from_profile(p))  # every profile is a valid engine config
    assert get_profile("fidelity").step_time(100, 1e6, 1000, 10) == 0.02
    seed = get_profile("llama3-70b-fp8-8xh100")
    # (8 x 85.52e9 x 0.92 - 72.7e9 weights - 16e9 overhead) / (16 x 160 KiB)
    assert 200_000 < seed.num_gpu_blocks < 215_000
    with pytest.raises(ValueError, match="tiny"):
        get_profile("nope")
    cfg = EngineConfig.from_profile(get_profile("tiny"), num_gpu_blocks=300)
    assert cfg.num_gpu_blocks == 300 and cfg.max_model_len == 4096


def test_step_output_carries_token_ids_and_caller_ids_are_used() -> None:
    e = engine()
    e.add_request("a", prompt(10), 3, output_token_ids=[5, 6, 7])
    e.add_request("b", prompt(10), 2)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for o in run_all(e):
        for rid, tok in o.token_ids.items():
            got[rid].append(tok)
    assert got["a"] == [5, 6, 7] == e.output_token_ids("a")
    assert got["b"] == [output_token_id("b", 0), output_token_id("b", 1)]
    with pytest.raises(ValueError, match="output_token_ids"):
        e.add_request("c", prompt(10), 3, output_token_ids=[1])


def test_long_prefill_token_threshold_caps_a_request_per_step() -> None:
    e = engine(long_prefill_token_threshold=32, max_model_len=256)
    e.add_request("a", prompt(100), 2)
    e.add_request("b", prompt(10), 2)
    o = e.step()
    assert o.scheduled == {"a": 32, "b": 10}
    assert [e.step().scheduled["a"] for _ in range(3)] == [32, 32, 4]


# ------------------------------------------------------------------ invariants, property tests

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def check_invariants(e: Engine) -> None:
    pool = e._pool
    free_ids = pool.free.ids()
    assert len(free_ids) == pool.free.num_free == len(set(free_ids))
    assert 0 not in free_ids  # the null block never enters the free queue
    holders: dict[int, int] = {}
    for req in e._running:
        assert len(req.blocks) == -(-req.num_computed // e.config.block_size)
        assert all(b.block_hash is not None for b in req.blocks[: req.num_cached_blocks])
        for b in req.blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    for req in e._requests.values():
        if req not in e._running:
            assert req.blocks == []
    for blk in pool.blocks[1:]:
        if blk.block_id in holders:
            assert blk.ref_cnt == holders[blk.block_id] and blk.block_id not in free_ids
        else:
            assert blk.ref_cnt == 0
    assert len(free_ids) + len(holders) == e.config.num_gpu_blocks - 1
    for h, entry in pool.cached.items():
        for blk in entry.values():
            assert blk.block_hash == h
    assert len(e._running) <= e.config.max_num_seqs


request_st = st.tuples(
    st.integers(1, 120),  # prompt length
    st.integers(1, 60),  # output tokens
    st.integers(0, 3),  # shared prefix id (0 = unique)
    st.integers(0, 3),  # priority
    st.integers(0, 6),  # steps to run before the next request arrives
    st.booleans(),  # abort an earlier request now
)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(request_st, min_size=1, max_size=25),
    blocks=st.integers(13, 60),
    budget=st.sampled_from([16, 48, 256]),
    policy=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    reserve=st.booleans(),
)
def test_random_workloads_keep_pool_invariants(  # type: ignore[no-untyped-def]
    reqs, blocks, budget, policy, caching, reserve
) -> None:
    e = engine(
        num_gpu_blocks=blocks,
        max_model_len=180,
        max_num_batched_tokens=budget,
        max_num_seqs=6,
        policy=policy,
        enable_prefix_caching=caching,
        reserve_full_isl=reserve,
    )
    prefixes = {k: list(range(k * 1_000_000, k * 1_000_000 + 64)) for k in (1, 2, 3)}
    added: list[str] = []
    for i, (p, o, pre, prio, gap, abort) in enumerate(reqs):
        toks = (prefixes[pre][: min(p, 64)] if pre else []) + prompt(max(p - (64 if pre else 0), 0))
        toks = toks[:p] or prompt(1)
        e.add_request(f"r{i}", toks, o, priority=prio)
        added.append(f"r{i}")
        if abort and len(added) > 1:
            e.abort(added[(i * 7) % (len(added) - 1)])
            check_invariants(e)
        for _ in range(gap):
            out = e.step()
            assert out.scheduled_tokens <= budget
            check_invariants(e)
    for _ in range(20_000):
        if not e.has_unfinished():
            break
        e.step()
        check_invariants(e)
    assert not e.has_unfinished()
    for rid in added:
        rec = e.request_record(rid)
        assert rec.finished or rec.aborted
        if rec.finished:
            assert rec.output_tokens_done == min(rec.output_tokens, 180 - rec.prompt_tokens)


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 200), st.integers(0, 5)), min_size=1, max_size=20
    ),
    slack=st.integers(0, 3),
)
def test_requests_whose_kv_need_fits_the_pool_never_preempt(  # type: ignore[no-untyped-def]
    reqs, slack
) -> None:
    # VLLM_FACTS: a request can ever hold ceil((prompt + max_tokens - 1) / 16) blocks. If the
    # sum over all requests fits the N - 1 usable blocks, no arrival pattern preempts.
    need = sum(-(-(p + o - 1) // 16) for p, o, _ in reqs)
    e = engine(num_gpu_blocks=max(need, 32) + 1 + slack, max_model_len=500, max_num_batched_tokens=64)
    for i, (p, o, gap) in enumerate(reqs):
        e.add_request(f"r{i}", prompt(p), o)
        for _ in range(gap):
            e.step()
    run_all(e)
    assert e.stats.preemptions_total == 0


def test_preempt_only_iteration_is_followed_at_once_by_the_next() -> None:
    # Priority policy: the least urgent running request (a, first in the running list) needs a
    # block, is itself the victim, and vLLM breaks out of the running loop with nothing
    # scheduled. The engine runs the next iteration at once and reports the preemption there.
    e = engine(num_gpu_blocks=9, max_model_len=128, enable_prefix_caching=False, policy="priority")
    e.add_request("a", prompt(47), 40, priority=5)  # 3 blocks; needs a 4th at position 48
    e.step()
    e.add_request("b", prompt(75), 40, priority=0)  # 5 blocks: the pool is then full
    assert e.step().scheduled == {"a": 1, "b": 75}
    assert e.stats.num_free_blocks == 0
    out = e.step()
    assert out.step == 2
    assert out.preempted == ["a"]
    assert out.scheduled == {"b": 1}
    assert e.waiting_ids == ["a"]
    assert e.stats.preemptions_total == 1
