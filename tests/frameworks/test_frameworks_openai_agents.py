"""The OpenAI Agents SDK's real Runner on a wrap()'d AsyncOpenAI, against the simulated vLLM server on
loopback (behind a proxy that answers 503 to chosen requests): the one-liner of docs/integrations.md.

openai-agents needs openai >= 3 (httpx2) and websockets < 17; skipped where it is not installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

pytest.importorskip("agents")

from _budget_probes import granted
from _frameworks import FAIL_MARK, CountingBudget, FailProxy, released
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import ResponseTextDeltaEvent

from zp_client import AdmissionOptions, LocalBudget, RetryPolicy, Settings, admitted_budget, wrap
from zp_client.errors import LeaseTooLarge, ZPError, unwrap_error
from zp_client.retry import testing
from zp_sim.server import SimServer

SETTINGS = Settings(estimator="heuristic")
CHAT = "/v1/chat/completions"
ZP_ATTEMPTS = RetryPolicy().max_attempts


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's platform
    try:
        with SimServer(profile="tiny", speedup=4.0) as sim, FailProxy(sim.url, model=sim.model) as p:
            yield p
    finally:
        set_tracing_disabled(False)


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def agent_of(proxy: FailProxy, budget: LocalBudget, max_tokens: int = 12) -> Agent:
    # the documented one-liner: the SDK's chat-completions model takes the admitted client as it is
    client = wrap(openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"), budget, settings=SETTINGS)
    return Agent(name="weather", instructions="Answer with tools.", tools=[get_weather],
                 model=OpenAIChatCompletionsModel(model=proxy.model, openai_client=client),
                 model_settings=ModelSettings(max_tokens=max_tokens))


@pytest.mark.slow
def test_tool_runs_sync_async_and_streamed_take_one_lease_per_llm_call(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    before = proxy.forwarded[CHAT]
    ran = Runner.run_sync(agent_of(proxy, budget), "what is the weather in Paris?")
    assert ran.final_output and any(item.type == "tool_call_output_item" for item in ran.new_items)

    async def runs() -> int:
        agent = agent_of(proxy, budget, max_tokens=40)  # an async client belongs to one event loop
        assert (await Runner.run(agent, "what is the weather in Rome?")).final_output
        streamed = Runner.run_streamed(agent, "what is the weather in Oslo?")
        deltas, held = 0, []
        async for event in streamed.stream_events():
            if event.type == "raw_response_event" and isinstance(event.data, ResponseTextDeltaEvent):
                deltas += 1
                held.append(budget.status_sync().used)
        assert streamed.final_output and max(held) > 0  # the stream holds its lease while it runs
        return deltas

    assert asyncio.run(runs()) > 0
    # three runs, each a tool call then an answer from the tool's result
    calls = proxy.forwarded[CHAT] - before
    assert calls == 6 and granted(budget) == calls and released(budget)


def test_zp_options_ride_on_the_client(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    client = AdmissionOptions(budget=budget, settings=SETTINGS, priority=2).admit(
        openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"))
    agent = Agent(name="plain", model=OpenAIChatCompletionsModel(model=proxy.model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=12))
    assert admitted_budget(client) is budget and client.default_headers["x-zp-priority"] == "2"
    assert Runner.run_sync(agent, "hello").final_output and granted(budget) == 1 and released(budget)


def test_an_always_failing_run_makes_at_most_zps_attempts(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")

    async def async_and_streamed() -> None:
        agent = agent_of(proxy, budget)
        with pytest.raises(openai.InternalServerError):
            await Runner.run(agent, FAIL_MARK + "oa-async")
        streamed = Runner.run_streamed(agent, FAIL_MARK + "oa-stream")
        with pytest.raises(openai.InternalServerError):
            async for _ in streamed.stream_events():
                pass

    with testing():
        with pytest.raises(openai.InternalServerError):
            Runner.run_sync(agent_of(proxy, budget), FAIL_MARK + "oa-sync")
        asyncio.run(async_and_streamed())
    tags = ("oa-sync", "oa-async", "oa-stream")
    assert {t: proxy.attempts[t] for t in tags} == {t: ZP_ATTEMPTS for t in tags}
    assert granted(budget) == 3 * ZP_ATTEMPTS and released(budget)
    assert set(proxy.retry_counts) <= {"0"}  # no SDK retry: every attempt was zp's


def test_a_refusal_reaches_the_caller_as_zps_type_after_one_acquire(proxy: FailProxy) -> None:
    budget = CountingBudget(limit_blocks=8, policy="strict")
    before = proxy.forwarded[CHAT]
    with pytest.raises(ZPError) as info:
        Runner.run_sync(agent_of(proxy, budget, max_tokens=1000), "what is the weather in Paris?")
    assert isinstance(unwrap_error(info.value), LeaseTooLarge) and budget.acquires == 1
    assert proxy.forwarded[CHAT] == before and released(budget)
