"""The storm benchmark: workloads, setups and an end-to-end tiny storm against the real simulator."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from zp_client.errors import ConfigurationError
from zp_storm.report import build_report, write_report
from zp_storm.runner import StormConfig, run_storm
from zp_storm.setups import DEFAULT_SETUPS, parse_setups
from zp_storm.workloads import SLO, ServerFacts, build_workload, count_chat_tokens, make_text

FACTS = ServerFacts(num_gpu_blocks=2049, block_size=16, max_model_len=8192, unloaded_itl_s=0.0085)

# A tiny seed-burst on the "tiny" profile (511 usable blocks): six streams hold ~75% of the pool and
# run two requests each; three 1200-token agent prompts land mid-way. Without admission the server must
# preempt (the running requests' outputs outgrow the pool); zp's reservations make that impossible.
TINY = {"streams": 6, "stream_out": 512, "rounds": 2, "burst": 3, "burst_prompt": 1200, "burst_max_tokens": 256}


def test_make_text_hits_the_requested_token_count() -> None:
    import random

    from zp_sim.tokenizer import count_tokens

    for n in (50, 700, 4000):
        text = make_text(n, random.Random(n), "tag")
        assert abs(count_tokens(text) - n) <= 3


@pytest.mark.slow
def test_seed_burst_is_deterministic_and_holds_the_requested_share_of_the_pool() -> None:
    a = build_workload("seed-burst", FACTS, seed=3)
    b = build_workload("seed-burst", FACTS, seed=3)
    assert [t.messages for t in a.iter_turns()] == [t.messages for t in b.iter_turns()]
    streams = [s for s in a.sessions if s.kind == "stream"]
    burst = [s for s in a.sessions if s.kind == "burst"]
    assert len(streams) == 24 and len(burst) == 16
    # average occupancy of the streams: prompt plus half of their output, over the usable pool
    first = [s.turns[1] for s in streams]
    avg_blocks = sum((t.prompt_tokens + t.true_out / 2) / 16 for t in first)
    assert 0.70 <= avg_blocks / FACTS.usable_blocks <= 0.80
    # every burst call arrives at once, is not streamed, and fits the context with its bound
    assert len({s.start_s for s in burst}) == 1
    assert all(not s.turns[0].stream and s.turns[0].prompt_tokens + s.turns[0].max_tokens <= 8192 for s in burst)
    assert a.gateway_timeout_s is not None and a.gateway_timeout_s > 0


@pytest.mark.slow
def test_seed_burst_matches_the_seed_case() -> None:
    """The burst's prompts far exceed the pool's free share, the streams keep growing after it, the
    gateway is the real 60 s scaled to the simulator (not derived from the workload's own calls), and
    the SLO is the fixed rule every workload uses."""
    from zp_storm.workloads import REAL_GATEWAY_TIMEOUT_S, gateway_time_scale, interactive_slo, loaded_step_s

    facts = ServerFacts(num_gpu_blocks=8193, block_size=16, max_model_len=8192, unloaded_itl_s=0.008)
    wl = build_workload("seed-burst", facts, seed=0)
    p = wl.params
    free = facts.usable_blocks * (1 - p["hold"])
    burst = [s.turns[0] for s in wl.sessions if s.kind == "burst"]
    assert all(t.prompt_tokens >= 7000 for t in burst)  # 8k-token agent prompts, capped by the context
    assert sum(math.ceil(t.prompt_tokens / 16) for t in burst) >= 3 * free
    # vLLM admits several at once on their current tokens (the free quarter holds 4 prompts) ...
    assert p["burst_fits_free_pool"] >= 3
    # ... and the streams' growth alone is of the order of the whole free share
    assert p["stream_growth_blocks"] >= 0.5 * free
    # the gateway: 60 s x the loaded-step ratio (about 0.2 for a 25x smaller pool of the 70B profile)
    scale = gateway_time_scale(facts, p["stream_prompt"] + p["stream_out"] / 2)
    assert 0.1 < scale < 0.3
    assert wl.gateway_timeout_s == pytest.approx(REAL_GATEWAY_TIMEOUT_S * scale, abs=0.01)
    # it does not depend on the burst's own size or output bound (not tuned to the calls it times out)
    other = build_workload("seed-burst", facts, seed=0, burst_max_tokens=512, burst=8)
    assert other.gateway_timeout_s == wl.gateway_timeout_s
    # a healthy admitted agent call (prefill + max_tokens loaded decode steps) fits within it
    step = loaded_step_s(facts.usable_blocks * 16, p["stream_prompt"] + p["stream_out"] / 2)
    assert p["burst_prompt"] / 8192 * 0.35 + p["burst_max_tokens"] * step < wl.gateway_timeout_s
    assert build_workload("seed-burst", facts, seed=0, gateway_s=30.0).gateway_timeout_s == 30.0
    assert wl.slo == interactive_slo(facts) == SLO(ttft_s=5.0, tpot_s=0.04)
    # the same SLO rule as the other workloads
    assert build_workload("agentic", facts, seed=0, conversations=2).slo == wl.slo


def test_agentic_shares_the_preamble_grows_context_and_bounds_max_tokens() -> None:
    wl = build_workload("agentic", FACTS, seed=1, conversations=6)
    convs = [s for s in wl.sessions if s.kind == "agent"]
    preambles = {s.turns[0].messages[0]["content"] for s in convs}
    assert len(preambles) == 1
    assert 1700 <= count_chat_tokens([convs[0].turns[0].messages[0]]) <= 2300
    for s in convs:
        lens = [t.prompt_tokens for t in s.turns]
        assert lens == sorted(lens) and len(set(lens)) == len(lens)
        assert all(t.max_tokens == 4096 and 1 <= t.true_out <= 4096 for t in s.turns)
        assert all(t.prompt_tokens + t.max_tokens <= FACTS.max_model_len for t in s.turns)


@pytest.mark.slow
def test_agentic_output_lengths_follow_the_stated_distribution() -> None:
    wl = build_workload("agentic", FACTS, seed=7, conversations=120)
    outs = sorted(t.true_out for t in wl.iter_turns())
    median = outs[len(outs) // 2]
    assert 150 <= median <= 320
    assert outs[math.ceil(0.99 * len(outs)) - 1] >= 1500


def _traces_available() -> bool:
    from zp_storm.workloads import find_shared_dir

    try:
        return (find_shared_dir() / "traces").is_dir()
    except ConfigurationError:
        return False


# The trace files live in the shared folder next to the repository (or $ZP_SHARED_DIR), not in it.
needs_traces = pytest.mark.skipif(not _traces_available(),
                                  reason="no shared traces folder (set ZP_SHARED_DIR to the folder holding traces/)")


@needs_traces
@pytest.mark.parametrize("name", ["azure-code", "azure-conv", "mooncake"])
def test_trace_replays_scale_time_and_cap_lengths_to_the_context(name: str) -> None:
    wl = build_workload(name, FACTS, seed=0, time_scale=0.5, load_scale=1.0, max_requests=60)
    full = build_workload(name, FACTS, seed=0, time_scale=1.0, load_scale=1.0, max_requests=60)
    assert wl.num_requests == 60
    assert wl.params["time_scale"] == 0.5
    starts = [s.start_s for s in wl.sessions]
    assert starts == sorted(starts)
    assert max(starts) == pytest.approx(0.5 * max(s.start_s for s in full.sessions), rel=1e-3, abs=1e-3)
    for t in wl.iter_turns():
        assert t.prompt_tokens + t.max_tokens <= FACTS.max_model_len
        assert t.true_out <= t.max_tokens


@needs_traces
def test_load_scale_thins_and_replicates_trace_requests() -> None:
    def span(load: float) -> float:
        wl = build_workload("azure-conv", FACTS, seed=0, load_scale=load, time_scale=1.0, max_requests=80)
        assert wl.num_requests == 80
        return wl.sessions[-1].start_s

    one, half, double = span(1.0), span(0.5), span(2.0)
    # the same number of requests takes about twice the trace time at half the load, half at double
    assert 1.4 * one < half < 2.8 * one
    assert 0.3 * one < double < 0.7 * one


@needs_traces
def test_mooncake_shared_prefix_blocks_become_identical_text() -> None:
    wl = build_workload("mooncake", FACTS, seed=0, max_requests=5)
    # the first two requests of the trace share their first 512-token block (hash id 0)
    a, b = (s.turns[0].messages[0]["content"] for s in wl.sessions[:2])
    assert a.split("\n", 1)[0] == b.split("\n", 1)[0]
    assert a != b


def test_unknown_workload_and_setups_are_clear_errors() -> None:
    with pytest.raises(ConfigurationError, match="choose one of"):
        build_workload("nope", FACTS, seed=0)
    with pytest.raises(ConfigurationError, match="unknown setup"):
        parse_setups("naive,bogus", None)
    with pytest.raises(ConfigurationError, match="--redis"):
        parse_setups("zp-redis", None)
    assert parse_setups(None, None) == list(DEFAULT_SETUPS)
    assert parse_setups("zp-strict", None) == ["no-admission", "zp-strict"]


def test_slo_for_non_streamed_calls_allows_the_streamed_equivalent_duration() -> None:
    slo = SLO(ttft_s=2.0, tpot_s=0.1)
    assert slo.met(1.0, 0.05)
    assert not slo.met(3.0, 0.05)
    assert not slo.met(1.0, 0.2)
    assert slo.met(None, None, streamed=False, e2e=11.9, out_tokens=100)
    assert not slo.met(None, None, streamed=False, e2e=12.1, out_tokens=100)


@pytest.mark.slow
def test_tiny_storm_end_to_end_preempts_without_admission_and_never_with_zp(tmp_path) -> None:
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "naive", "zp-strict"],
                      profile="tiny", num_gpu_blocks=None, speedup=4.0, workload_overrides=dict(TINY))
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    jp, pp = write_report(report, tmp_path)
    assert pp.stat().st_size > 10_000  # a real PNG with three panels
    data = json.loads(jp.read_text())
    assert [m["setup"] for m in data["setups"]] == ["no-admission", "naive", "zp-strict"]
    for key in ("workload", "slo", "server", "setups", "ratios", "checks", "timelines", "ttfts", "requests"):
        assert key in data
    by = {m["setup"]: m for m in data["setups"]}
    for m in data["setups"]:
        for key in ("preemptions", "recomputed_tokens", "kv_usage_max", "ttft_p50", "ttft_p99", "itl_p50",
                    "itl_p99", "itl_p99_vs_unloaded", "goodput_rps", "goodput_tps", "amplification", "errors",
                    "makespan", "valid", "harness", "effective_speedup"):
            assert key in m, key
        assert m["sent"] == wl.num_requests
        assert m["amplification"] >= 1.0
        assert len(data["timelines"][m["setup"]]) > 10
    # the ordering the benchmark exists to show
    assert by["naive"]["preemptions"] > 0
    assert by["no-admission"]["preemptions"] > 0
    assert by["zp-strict"]["preemptions"] == 0
    assert by["zp-strict"]["kv_usage_max"] < 1.0
    checks = {c["name"]: c["passed"] for c in data["checks"]}
    assert checks["zp_zero_preemptions"] is True and checks["naive_preempts"] is True
    # the server's own /metrics counter agrees with /sim/stats
    assert by["naive"]["preemptions_metrics"] == by["naive"]["preemptions"]
    # no-admission never sees a gateway; every zp request completed
    assert by["no-admission"]["gateway_504"] == 0
    assert by["zp-strict"]["errors"] == 0


@pytest.mark.slow
@pytest.mark.redis
def test_zp_redis_workers_share_one_budget_and_never_preempt(redis_url: str) -> None:
    cfg = StormConfig(workload="seed-burst", seed=1, setups=["no-admission", "zp-redis"], redis_url=redis_url,
                      profile="tiny", num_gpu_blocks=None, speedup=4.0, workers=2, clock="real", workload_overrides=dict(TINY))
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    by = {m["setup"]: m for m in report["setups"]}
    zr = by["zp-redis"]
    # every request of every worker came back, once, and succeeded; the server never preempted
    ids = [r["id"] for r in report["requests"]["zp-redis"]]
    assert sorted(ids) == sorted(r["id"] for r in report["requests"]["no-admission"])
    assert zr["ok"] == wl.num_requests and zr["errors"] == 0
    assert zr["preemptions"] == 0
    assert by["no-admission"]["preemptions"] > 0
    assert len(zr["harness"]["workers"]) == 2


@pytest.fixture
def restore_setups():
    from zp_storm import setups

    saved_specs, saved_factories = dict(setups.SETUPS), dict(setups._FACTORIES)
    saved_names = setups.ALL_SETUPS, setups.DEFAULT_SETUPS  # register_setup rebuilds these tuples
    yield setups
    setups.SETUPS.clear()
    setups.SETUPS.update(saved_specs)
    setups._FACTORIES.clear()
    setups._FACTORIES.update(saved_factories)
    setups.ALL_SETUPS, setups.DEFAULT_SETUPS = saved_names


def test_register_setup_adds_a_setup_in_canonical_order(restore_setups) -> None:
    setups = restore_setups

    async def factory(ctx, stack):  # pragma: no cover - not run here
        raise AssertionError

    setups.register_setup(setups.SetupSpec("zp-elastic", True, description="test"), factory, after="zp-strict")
    assert list(setups.SETUPS).index("zp-elastic") == list(setups.SETUPS).index("zp-strict") + 1
    assert parse_setups("zp-elastic,naive", None) == ["no-admission", "naive", "zp-elastic"]
    assert "zp-elastic" in parse_setups(None, None)
    assert setups.factory_module("zp-elastic") == __name__
    redis_only = setups.SetupSpec("zp-elastic-redis", True, needs_redis=True, workers=2)
    setups.register_setup(redis_only, factory)
    assert "zp-elastic-redis" not in parse_setups(None, None)
    with pytest.raises(ConfigurationError, match="--redis"):
        parse_setups("zp-elastic-redis", None)


@pytest.mark.slow
@pytest.mark.parametrize(("setup", "message"), [("crash-exit", "worker died"), ("crash-raise", "factory exploded")])
def test_a_failing_worker_process_fails_the_run_with_a_clear_error(restore_setups, setup: str, message: str) -> None:
    import importlib
    import multiprocessing

    importlib.reload(importlib.import_module("_storm_crash_setups"))  # registers its setups again
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", setup], profile="tiny",
                      num_gpu_blocks=None, speedup=4.0, workers=2, clock="real", workload_overrides=dict(TINY))
    with pytest.raises(RuntimeError, match=message):
        run_storm(cfg)
    # no worker is left behind
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------------ the load generator's stream reader


def _openai_http() -> tuple[object, object]:
    """openai and the HTTP library it is built on (httpx for 2.x, httpx2 for 3.x)."""
    import importlib

    import openai

    major = int(openai.__version__.split(".")[0])
    return openai, importlib.import_module("httpx2" if major >= 3 else "httpx")


def _sse(*chunks: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _content(text: str) -> dict[str, object]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


@pytest.mark.openai_compat
@pytest.mark.parametrize("case", ["ok", "error-chunk", "reset"])
def test_stream_chat_reads_chunks_as_openais_stream_does(case: str) -> None:
    """The load generator parses the raw stream itself (openai's per-chunk models were half a fleet
    storm's CPU); it must keep openai's Stream semantics: content chunks are stamped, usage is read,
    ``[DONE]`` ends it, an ``error`` chunk is an ``openai.APIError`` and a reset an
    ``APIConnectionError``, both counted as a cut stream once content was read."""
    from zp_storm.loadgen import RequestRecord, VirtualClock, stream_chat
    from zp_storm.workloads import Turn

    openai, http = _openai_http()
    usage = {**_content(""), "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                      "total_tokens": 7}}

    class Body:
        async def __aiter__(self):  # type: ignore[no-untyped-def]
            yield _sse(_content("a"), done=False)
            if case == "reset":
                raise http.ReadError("connection reset by peer")  # type: ignore[attr-defined]
            if case == "error-chunk":
                yield _sse({"error": {"message": "engine died", "code": 500}}, done=False)
            yield _sse(_content("b"), usage)

    seen: list[object] = []

    def handler(request: object) -> object:
        seen.append(json.loads(request.content))  # type: ignore[attr-defined]
        return http.Response(200, headers={"content-type": "text/event-stream"},  # type: ignore[attr-defined]
                             content=Body())

    now = [0.0]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    async def main() -> RequestRecord:
        client = openai.AsyncOpenAI(  # type: ignore[attr-defined]
            base_url="http://sim/v1", api_key="k", max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(transport=http.MockTransport(handler)))  # type: ignore[attr-defined]
        turn = Turn(messages=[{"role": "user", "content": "hi"}], prompt_tokens=5, max_tokens=8, true_out=2)
        rec = RequestRecord("r0", "s", "chat", 5, 8, 2)
        try:
            await stream_chat(client, "m", turn, rec, VirtualClock(tick, 1.0))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            rec.error = type(exc).__name__
            assert isinstance(exc, openai.OpenAIError)  # type: ignore[attr-defined]
        finally:
            await client.close()
        return rec

    rec = asyncio.run(main())
    assert seen and seen[0]["stream"] is True and seen[0]["sim_output_tokens"] == 2  # type: ignore[index]
    if case == "ok":
        assert rec.error is None and rec.out_tokens == 2 and rec.token_times == [1.0, 2.0]
        assert rec.t_first == 1.0 and rec.cut_streams == 0
    else:
        assert rec.error == {"error-chunk": "APIError", "reset": "APIConnectionError"}[case]
        assert rec.cut_streams == 1  # content ("a") had reached the caller
