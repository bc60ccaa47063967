"""The simulated vLLM server over real HTTP on loopback, driven with the real ``openai`` package."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from _sim_probes import wait_until
from prometheus_client.parser import text_string_to_metric_families

from zp_sim import tokenizer as tok
from zp_sim.server import SimServer

pytestmark = pytest.mark.anyio

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                           "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def server(close_clients: None) -> AsyncIterator[SimServer]:
    async with SimServer(profile="tiny", speedup=20) as s:
        yield s


_open_clients: list[openai.AsyncOpenAI] = []


@pytest.fixture
async def close_clients() -> AsyncIterator[None]:
    # close every openai client on the test's own event loop (its pool must not outlive the loop)
    yield
    while _open_clients:
        await _open_clients.pop().close()


def _client(server: SimServer) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="sim", max_retries=0)
    _open_clients.append(client)
    return client


# ---------------------------------------------------------------------------------------- openai


@pytest.mark.openai_compat
async def test_chat_completion_reports_usage_and_honours_sim_output_tokens(server: SimServer) -> None:
    client = _client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    r = await client.chat.completions.create(model=server.model, messages=messages, max_tokens=50,
                                             extra_body={"sim_output_tokens": 12})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(tok.encode(tok.render_chat(messages)))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


@pytest.mark.openai_compat
async def test_max_tokens_caps_the_true_length_and_ignore_eos_fills_it(server: SimServer) -> None:
    client = _client(server)
    r = await client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=7,
                                        extra_body={"sim_output_tokens": 100})
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"
    r = await client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=9,
                                        extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 9
    assert r.usage.prompt_tokens == len(tok.encode("Once upon a time", add_special_tokens=True))


@pytest.mark.openai_compat
async def test_too_large_max_tokens_is_clamped_not_rejected(server: SimServer) -> None:
    client = _client(server)
    prompt = list(range(100, 100 + server.max_model_len - 5))  # leaves room for 5 tokens
    r = await client.completions.create(model=server.model, prompt=prompt, max_tokens=10_000,
                                        extra_body={"ignore_eos": True})
    assert r.usage is not None
    assert r.usage.prompt_tokens == server.max_model_len - 5
    assert r.usage.completion_tokens == 5


@pytest.mark.openai_compat
async def test_default_output_length_is_seeded(server: SimServer) -> None:
    client = _client(server)
    lengths = []
    for _ in range(2):
        r = await client.completions.create(model=server.model, prompt="tell me a story", max_tokens=4000,
                                            seed=1234)
        assert r.usage is not None
        lengths.append(r.usage.completion_tokens)
    assert lengths[0] == lengths[1]
    assert 1 <= lengths[0] < 4000


@pytest.mark.openai_compat
async def test_streaming_chat_with_include_usage(server: SimServer) -> None:
    client = _client(server)
    stream = await client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "count to five"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finish, usage, roles = [], None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        if delta.content:
            text.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"]
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 6
    assert "".join(text).strip()


@pytest.mark.openai_compat
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: SimServer, path: str) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk carries prompt and completion tokens
    so far (the role chunk 0), then the usual usage-only chunk; without include_usage it is ignored."""
    body: dict[str, Any] = {"model": server.model, "max_tokens": 7, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if path == "/chat/completions":
        body["messages"] = [{"role": "user", "content": "count to seven"}]
    else:
        body["prompt"] = "count to seven"
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        async with http.stream("POST", path, json=body) as resp:
            events = [json.loads(line[5:]) async for line in resp.aiter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        prompt = events[-1]["usage"]["prompt_tokens"]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 7
        seen = []
        for ev in events[:-1]:
            u = ev["usage"]
            assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
            seen.append(u["completion_tokens"])
        assert seen == sorted(seen) and seen[-1] == 7
        if path == "/chat/completions":
            assert events[0]["choices"][0]["delta"].get("role") == "assistant" and seen[0] == 0

        body["stream_options"] = {"continuous_usage_stats": True}
        async with http.stream("POST", path, json=body) as resp:
            events = [json.loads(line[5:]) async for line in resp.aiter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        assert events and all("usage" not in ev for ev in events)


@pytest.mark.openai_compat
async def test_streaming_completion_ends_with_done(server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as http:
        async with http.stream("POST", "/completions", json={
                "model": server.model, "prompt": "abc", "max_tokens": 4, "stream": True,
                "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in resp.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.openai_compat
async def test_tool_call_when_tool_choice_is_required(server: SimServer) -> None:
    client = _client(server)
    r = await client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "weather in Paris for 3 days?"}],
        tools=[WEATHER_TOOL], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert set(args) == {"city", "days"}
    assert isinstance(args["city"], str) and isinstance(args["days"], int) and args["days"] >= 1


@pytest.mark.openai_compat
async def test_streamed_tool_call_assembles_to_valid_json(server: SimServer) -> None:
    client = _client(server)
    stream = await client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    name, args, finish = None, "", None
    async for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            name = call.function.name or name
            args += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather"
    assert set(json.loads(args)) == {"city", "days"}
    assert finish == "tool_calls"


@pytest.mark.openai_compat
async def test_auto_tool_choice_answers_a_tool_result_with_text(server: SimServer) -> None:
    client = _client(server)
    first = await client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    followup = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = await client.chat.completions.create(model=server.model, messages=followup, tools=[WEATHER_TOOL],
                                                  max_tokens=20)
    assert not second.choices[0].message.tool_calls
    assert second.choices[0].message.content


@pytest.mark.openai_compat
def test_sync_openai_client_against_server_on_a_thread() -> None:
    with SimServer(profile="tiny", speedup=20) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="sim", max_retries=0)
        r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3, n=2, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1]
        assert r.usage is not None and r.usage.completion_tokens == 6
        models = client.models.list()
        assert [m.id for m in models.data] == [server.model]
    # stopped: the port no longer answers
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)


@pytest.mark.openai_compat
async def test_prompt_longer_than_max_model_len_is_a_400_with_vllms_shape(server: SimServer) -> None:
    client = _client(server)
    too_long = list(range(1000, 1000 + server.max_model_len + 3))
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=server.model, prompt=too_long, max_tokens=5)
    body = info.value.response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert err["message"].startswith(f"This model's maximum context length is {server.max_model_len} tokens.")
    assert f"{server.max_model_len + 3} input tokens" in err["message"]
    assert server.engine.stats.num_waiting == 0 and server.engine.stats.num_running == 0


async def test_unknown_model_is_a_404(server: SimServer) -> None:
    with pytest.raises(openai.NotFoundError):
        await _client(server).completions.create(model="not-served", prompt="x", max_tokens=1)


# -------------------------------------------------------------------------------- the rest of the API


async def test_tokenize_chat_form_counts_what_the_chat_request_counts(server: SimServer) -> None:
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "List three colours, then explain why the sky is blue."}]
    async with httpx.AsyncClient(base_url=server.url) as http:
        for tools in (None, [WEATHER_TOOL]):
            body: dict[str, Any] = {"model": server.model, "messages": messages}
            if tools:
                body["tools"] = tools
            t = (await http.post("/tokenize", json=body)).json()
            chat: dict[str, Any] = {**body, "max_tokens": 2, "tool_choice": "none"}
            r = (await http.post("/v1/chat/completions", json=chat)).json()
            assert t["count"] == r["usage"]["prompt_tokens"] == len(t["tokens"])
            assert t["max_model_len"] == server.max_model_len
        plain = (await http.post("/tokenize", json={"prompt": "hello world"})).json()
        assert plain["tokens"] == tok.encode("hello world", add_special_tokens=True)
        no_bos = (await http.post("/tokenize", json={"prompt": "hello world",
                                                     "add_special_tokens": False})).json()
        assert no_bos["count"] == plain["count"] - 1
        detok = (await http.post("/detokenize", json={"tokens": no_bos["tokens"]})).json()
        assert detok["prompt"] == tok.decode(no_bos["tokens"])
        bad = await http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}


async def test_models_health_and_clock(server: SimServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as http:
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["id"] == server.model
        assert models["data"][0]["max_model_len"] == server.max_model_len == 4096
        assert (await http.get("/health")).status_code == 200
        c1 = (await http.get("/sim/clock")).json()["clock_s"]
        await asyncio.sleep(0.05)
        c2 = (await http.get("/sim/clock")).json()["clock_s"]
        assert c2 > c1  # idle virtual time follows real time


async def test_metrics_parse_with_vllms_names_and_labels(server: SimServer) -> None:
    client = _client(server)
    await client.completions.create(model=server.model, prompt="warm up the counters", max_tokens=3,
                                    extra_body={"ignore_eos": True})
    async with httpx.AsyncClient(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # the parser strips _total from counter family names
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:cache_config_info",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert name in families, name
    samples = {s.name: s for f in families.values() for s in f.samples}
    for name in ("vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert families[name[: -len("_total")]].type == "counter"
        assert samples[name].labels == {"model_name": server.model, "engine": "0"}
    assert samples["vllm:generation_tokens_total"].value == 3
    prompt = tok.encode("warm up the counters", add_special_tokens=True)
    assert samples["vllm:prompt_tokens_total"].value == len(prompt)
    assert samples["vllm:e2e_request_latency_seconds_count"].value == 1
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1
    assert samples["vllm:inter_token_latency_seconds_count"].value == 2
    info = samples["vllm:cache_config_info"]
    assert info.value == 1
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == str(server.num_gpu_blocks)
    assert info.labels["enable_prefix_caching"] == "True"
    assert float(info.labels["gpu_memory_utilization"]) == pytest.approx(0.92)
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[gauge].type == "gauge"
        assert samples[gauge].labels == {"model_name": server.model, "engine": "0"}


async def test_shared_chat_prefix_hits_the_prefix_cache_over_http(server: SimServer) -> None:
    client = _client(server)
    system = {"role": "system", "content": "You are an agent with a long shared system prompt. " * 20}
    for q in ("first question", "second, different question"):
        messages = [system, {"role": "user", "content": q}]
        await client.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    st = server.engine.stats
    shared = len(tok.encode(tok.render_chat([system], add_generation_prompt=False)))
    assert st.prefix_cache_hits_total >= (shared // 16) * 16 > 0


# ----------------------------------------------------------------------- disconnects and gateway


async def test_stream_disconnect_aborts_the_request_and_frees_its_blocks() -> None:
    async with SimServer(profile="tiny", speedup=1) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            async with http.stream("POST", "/completions", json={
                    "model": server.model, "prompt": "x " * 600, "max_tokens": 3000, "stream": True,
                    "ignore_eos": True}) as resp:
                lines = resp.aiter_lines()
                first = await lines.__anext__()
                assert first.startswith("data: ")
                assert server.engine.stats.num_running == 1
                assert server.engine.kv_usage > 0
            # leaving the block closes the connection mid-stream
        await wait_until(lambda: server.stats()["aborted_disconnect"] == 1, "the server to see the disconnect")
        assert server.engine.stats.num_running == 0 and server.engine.stats.num_waiting == 0
        assert server.engine.kv_usage == 0.0
        record = server.stats(requests=True)["requests"][0]
        assert record["status"] == "aborted" and record["finish_s"] is not None


async def test_non_streamed_disconnect_aborts_the_request() -> None:
    async with SimServer(profile="tiny", speedup=1) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=httpx.Timeout(5, read=0.3)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/completions", json={"model": server.model, "prompt": "y " * 300,
                                                      "max_tokens": 3000, "ignore_eos": True})
        await wait_until(lambda: server.stats()["aborted_disconnect"] == 1, "the server to see the disconnect")
        assert server.engine.stats.num_running == 0 and server.engine.stats.num_waiting == 0
        assert server.engine.kv_usage == 0.0
        assert server.stats()["finished"] == 0


async def test_gateway_timeout_answers_504_and_aborts() -> None:
    # one sequence at a time: requests queued behind a long stream never start and time out
    async with SimServer(profile="tiny", speedup=20, gateway_timeout_s=1.0, max_num_seqs=1) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            async with http.stream("POST", "/completions", json={
                    "model": server.model, "prompt": "a b c", "max_tokens": 3000, "ignore_eos": True,
                    "stream": True}) as running:
                assert running.status_code == 200  # streaming started in time: no 504
                queued_stream = http.post("/chat/completions", json={
                    "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "stream": True})
                queued_plain = http.post("/completions", json={"model": server.model, "prompt": "q",
                                                               "max_tokens": 5})
                r1, r2 = await asyncio.gather(queued_stream, queued_plain)
                assert r1.status_code == 504 and r2.status_code == 504
                assert "504 Gateway Time-out" in r1.text
                assert r1.headers["content-type"].startswith("text/html")
                assert server.engine.stats.num_waiting == 0  # both were aborted in the engine
            # the long stream was closed by the client; a short request now gets through
            await wait_until(lambda: server.engine.stats.num_running == 0, "the closed stream to be aborted")
            ok = await http.post("/completions", json={"model": server.model, "prompt": "q", "max_tokens": 2})
            assert ok.status_code == 200
        st = server.stats(requests=True)
        assert st["gateway_504"] == 2 and st["aborted_disconnect"] == 1
        assert sorted(r["status"] for r in st["requests"]) == ["aborted", "finished", "gateway_timeout",
                                                              "gateway_timeout"]
        assert server.engine.stats.num_running == 0 and server.engine.kv_usage == 0.0


# --------------------------------------------------------------------------------------- storms


def _storm_requests(count: int, prompt_len: int, max_tokens: int) -> list[list[int]]:
    # distinct prompts (no prefix sharing) so the KV need of each request is exactly its own
    return [[(i * 7919 + j * 31) % 120_000 for j in range(prompt_len)] for i in range(count)]


async def _preemptions_on_metrics(server: SimServer) -> float:
    async with httpx.AsyncClient(base_url=server.url) as http:
        text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_preemptions_total":
                return sample.value
    raise AssertionError("vllm:num_preemptions_total missing from /metrics")


@pytest.mark.openai_compat
@pytest.mark.usefixtures("close_clients")
@pytest.mark.slow
async def test_storm_open_loop_burst_preempts_and_block_gated_sends_never_do() -> None:
    pool = 200  # 199 usable blocks of 16 tokens
    prompt_len, max_tokens, count = 300, 300, 12
    need = math.ceil((prompt_len + max_tokens) / 16)  # 38 blocks per request; 12 x 38 = 456 >> 199
    prompts = _storm_requests(count, prompt_len, max_tokens)

    async def send(client: openai.AsyncOpenAI, server: SimServer, prompt: list[int]) -> int:
        r = await client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True})
        assert r.usage is not None
        return r.usage.completion_tokens

    async with SimServer(profile="tiny", num_gpu_blocks=pool, speedup=50) as server:
        client = _client(server)
        done = await asyncio.gather(*(send(client, server, p) for p in prompts))
        assert done == [max_tokens] * count
        burst_preemptions = await _preemptions_on_metrics(server)
    assert burst_preemptions > 0

    async with SimServer(profile="tiny", num_gpu_blocks=pool, speedup=50) as server:
        client = _client(server)
        free = pool - 1
        cond = asyncio.Condition()

        async def gated(prompt: list[int]) -> int:
            nonlocal free
            async with cond:
                await cond.wait_for(lambda: free >= need)
                free -= need
            try:
                return await send(client, server, prompt)
            finally:
                async with cond:
                    free += need
                    cond.notify_all()

        done = await asyncio.gather(*(gated(p) for p in prompts))
        assert done == [max_tokens] * count
        gated_preemptions = await _preemptions_on_metrics(server)
        assert server.stats()["engine"]["preemptions_total"] == 0
    assert gated_preemptions == 0


async def test_timeline_and_per_request_records(server: SimServer) -> None:
    client = _client(server)
    await asyncio.gather(*(client.completions.create(model=server.model, prompt=f"request {i}", max_tokens=4,
                                                      extra_body={"ignore_eos": True}) for i in range(3)))
    assert server.timeline, "one sample per step"
    times = [t for t, *_ in server.timeline]
    assert times == sorted(times)
    assert all(0.0 <= kv <= 1.0 for _, kv, *_ in server.timeline)
    async with httpx.AsyncClient(base_url=server.url) as http:
        st = (await http.get("/sim/stats", params={"requests": "1"})).json()
    assert st["finished"] == 3 and len(st["requests"]) == 3
    for r in st["requests"]:
        assert r["status"] == "finished" and r["output_tokens"] == 4 and r["num_preemptions"] == 0
        assert r["arrival_s"] <= r["first_scheduled_s"] <= r["first_token_s"] <= r["finish_s"]
    assert {"lag_s", "max_lag_s", "lagging", "clock_s"} <= set(st)


async def test_a_run_that_cannot_keep_up_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # a million-fold speed-up asks for 5 ms virtual steps in 5 ns of real time: impossible
    caplog.set_level("WARNING", logger="zp_sim.server")
    async with SimServer(profile="tiny", speedup=1e6) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post("/completions", json={"model": server.model, "prompt": "p", "max_tokens": 50,
                                                      "ignore_eos": True})
            assert r.status_code == 200
            st = (await http.get(server.url + "/sim/stats")).json()
    assert st["lagging"] is True and st["max_lag_s"] > 0.25
    assert any("cannot keep up" in rec.getMessage() for rec in caplog.records)


async def test_priority_field_reaches_the_engine() -> None:
    async with SimServer(profile="tiny", speedup=1, policy="priority") as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            async with http.stream("POST", "/completions", json={
                    "model": server.model, "prompt": "p", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True, "priority": 7}) as resp:
                first = json.loads((await resp.aiter_lines().__anext__())[len("data: "):])
                record = server.engine.request_record(first["id"] + "-0")
                assert record.priority == 7
        await wait_until(lambda: server.engine.stats.num_running == 0, "the closed stream to be aborted")
        assert server.stats(requests=True)["requests"][0]["priority"] == 7


@pytest.mark.slow
def test_cli_serves_and_replays(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from zp_client.cli import main

    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"arrival_step": 0, "prompt_tokens": 100, "max_tokens": 20}) + "\n"
                                for _ in range(3)))
    out = tmp_path / "out.json"
    assert main(["sim", "replay", str(workload), "--num-gpu-blocks", "64", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["preemptions"] == 0 and len(result["requests"]) == 3

    proc = subprocess.Popen(
        [sys.executable, "-m", "zp_client.cli", "sim", "--port", "0", "--profile", "tiny",
         "--num-gpu-blocks", "300", "--speedup", "5", "--gateway-timeout", "30"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        base_url = None
        for line in proc.stderr:
            if "serving model" in line:
                base_url = line.rsplit(" at ", 1)[1].strip()
                break
        assert base_url and base_url.endswith("/v1"), "the CLI prints where it serves"
        client = openai.OpenAI(base_url=base_url, api_key="sim", max_retries=0)
        r = client.completions.create(model="sim-llama", prompt="hello", max_tokens=3,
                                      extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 3
        metrics = httpx.get(base_url[: -len("/v1")] + "/metrics").text
        assert 'num_gpu_blocks="300"' in metrics
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------ admission limits (vLLM 503s)


async def _hold_stream(http: httpx.AsyncClient, model: str, prompt: list[int], first: asyncio.Event) -> None:
    """A long streamed completion that stays open (running or waiting) until the task is cancelled."""
    async with http.stream("POST", "/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 3000, "stream": True, "ignore_eos": True}) as resp:
        async for _ in resp.aiter_lines():
            first.set()


async def test_max_num_queued_reqs_counts_waiting_and_running_and_answers_503() -> None:
    async with SimServer(profile="tiny", speedup=1, max_num_seqs=1, max_num_queued_reqs=3) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            events = [asyncio.Event() for _ in range(3)]
            tasks = [asyncio.create_task(_hold_stream(http, server.model, [7] * 16, e)) for e in events]
            # the third arrival can land before the engine's first step schedules the first: wait for it
            await wait_until(
                lambda: server.stats()["in_flight"] == 3 and server.engine.stats.num_running == 1,
                "three requests in flight, one of them scheduled")
            # one running and two waiting: vLLM's limit counts both
            assert server.engine.stats.num_running == 1 and server.engine.stats.num_waiting == 2
            r = await http.post("/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503
            assert r.json() == {"error": {
                "message": "The engine is currently busy and cannot accept new requests. "
                           "Please try again later or on a different instance.",
                "type": "Service Unavailable", "param": None, "code": 503}}
            assert server.stats()["in_flight"] == 3  # not enqueued
            assert server.stats()["rejected_queue_full"] == 1 and server.stats()["errors_4xx"] == 0
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await wait_until(lambda: server.stats()["in_flight"] == 0, "the held streams to be aborted")
            ok = await http.post("/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


async def test_max_num_queued_tokens_counts_prompts_without_a_first_token() -> None:
    async with SimServer(profile="tiny", speedup=1, max_num_seqs=1, max_num_queued_tokens=32) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
            started = asyncio.Event()
            running = asyncio.create_task(_hold_stream(http, server.model, [5] * 40, started))
            await started.wait()  # it has its first token: its 40 prompt tokens no longer count
            waiting = asyncio.create_task(_hold_stream(http, server.model, [6] * 32, asyncio.Event()))
            await wait_until(lambda: server.engine.stats.num_waiting == 1, "the second request to wait")
            r = await http.post("/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503
            body = r.json()["error"]
            assert body["type"] == "Service Unavailable" and body["code"] == 503 and body["param"] is None
            assert body["message"].startswith("The engine has reached its prefill token backlog limit.")
            assert server.stats()["in_flight"] == 2
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await wait_until(lambda: server.stats()["in_flight"] == 1, "the waiting request to be aborted")
            # the backlog is empty again (only the running request, past its prefill): admitted
            third = asyncio.create_task(_hold_stream(http, server.model, [8] * 8, asyncio.Event()))
            await wait_until(lambda: server.stats()["in_flight"] == 2, "the third request to be admitted")
            for t in (running, third):
                t.cancel()
            await asyncio.gather(running, third, return_exceptions=True)
