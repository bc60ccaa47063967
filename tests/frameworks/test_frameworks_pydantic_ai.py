"""pydantic-ai's real Agent on a wrap()'d AsyncOpenAI, against the simulated vLLM server on loopback (behind
a proxy that answers 503 to chosen requests): the one-liner of docs/integrations.md.

pydantic-ai 2.x needs openai >= 3 (httpx2): main environment only (``zp-client[dev]`` installs it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest

pytest.importorskip("pydantic_ai.models.openai")

from _budget_probes import granted
from _frameworks import FAIL_MARK, CountingBudget, FailProxy, released
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelHTTPError
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from zp_client import AdmissionOptions, LocalBudget, RetryPolicy, Settings, admitted_budget, wrap
from zp_client.errors import LeaseTooLarge, ZPError, unwrap_error
from zp_client.retry import testing
from zp_sim.server import SimServer

SETTINGS = Settings(estimator="heuristic")
CHAT = "/v1/chat/completions"
ZP_ATTEMPTS = RetryPolicy().max_attempts
MODEL_SETTINGS: Any = {"max_tokens": 12}


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with SimServer(profile="tiny", speedup=4.0) as sim, FailProxy(sim.url, model=sim.model) as p:
        yield p


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def agent_of(proxy: FailProxy, budget: LocalBudget) -> Agent[None, str]:
    # the documented one-liner: pydantic-ai's OpenAI provider takes the admitted client as it is
    client = wrap(openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"), budget, settings=SETTINGS)
    model = OpenAIChatModel(proxy.model, provider=OpenAIProvider(openai_client=client))
    return Agent(model, tools=[get_weather], model_settings=MODEL_SETTINGS)


@pytest.mark.slow
def test_tool_runs_sync_async_and_streamed_take_one_lease_per_llm_call(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    agent = agent_of(proxy, budget)
    before = proxy.forwarded[CHAT]
    ran = agent.run_sync("what is the weather in Paris?")
    assert ran.output and any(p.part_kind == "tool-return" for m in ran.all_messages() for p in m.parts)

    async def runs() -> tuple[str, int]:
        # an async client's connections belong to one event loop: run_sync ran on pydantic-ai's own
        agent = agent_of(proxy, budget)
        assert (await agent.run("what is the weather in Rome?")).output
        chunks = 0
        held = []
        long: Any = {"max_tokens": 40, "extra_body": {"sim_output_tokens": 30}}
        async with agent.run_stream("what is the weather in Oslo?", model_settings=long) as streamed:
            async for _ in streamed.stream_text(delta=True, debounce_by=None):
                chunks += 1
                held.append(budget.status_sync().used)
            text = await streamed.get_output()
        assert max(held) > 0  # the stream holds its lease while it runs
        return text, chunks

    text, chunks = asyncio.run(runs())
    assert text and chunks > 0
    # three runs, each a tool call then an answer from the tool's result
    calls = proxy.forwarded[CHAT] - before
    assert calls == 6 and granted(budget) == calls and released(budget)


def test_zp_options_ride_on_the_client(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    client = AdmissionOptions(budget=budget, settings=SETTINGS, priority=2, deadline=30.0).admit(
        openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"))
    agent = Agent(OpenAIChatModel(proxy.model, provider=OpenAIProvider(openai_client=client)),
                  model_settings=MODEL_SETTINGS)
    assert admitted_budget(client) is budget and client.default_headers["x-zp-priority"] == "2"
    assert agent.run_sync("hello").output and granted(budget) == 1 and released(budget)


def test_an_always_failing_run_makes_at_most_zps_attempts(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")

    async def async_and_streamed() -> None:
        agent = agent_of(proxy, budget)  # on this event loop
        with pytest.raises(ModelHTTPError):
            await agent.run(FAIL_MARK + "pai-async")
        with pytest.raises(ModelHTTPError):
            async with agent.run_stream(FAIL_MARK + "pai-stream") as s:
                await s.get_output()

    with testing():
        with pytest.raises(ModelHTTPError) as info:
            agent_of(proxy, budget).run_sync(FAIL_MARK + "pai-sync")
        assert info.value.status_code == 503
        asyncio.run(async_and_streamed())
    tags = ("pai-sync", "pai-async", "pai-stream")
    assert {t: proxy.attempts[t] for t in tags} == {t: ZP_ATTEMPTS for t in tags}
    assert granted(budget) == 3 * ZP_ATTEMPTS and released(budget)
    assert set(proxy.retry_counts) <= {"0"}  # no SDK retry: every attempt was zp's


def test_a_refusal_reaches_the_caller_as_zps_type_after_one_acquire(proxy: FailProxy) -> None:
    budget = CountingBudget(limit_blocks=8, policy="strict")
    client = wrap(openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"), budget, settings=SETTINGS)
    agent = Agent(OpenAIChatModel(proxy.model, provider=OpenAIProvider(openai_client=client)),
                  tools=[get_weather], model_settings={"max_tokens": 1000})
    before = proxy.forwarded[CHAT]
    with pytest.raises(ZPError) as info:
        agent.run_sync("what is the weather in Paris?")
    assert isinstance(unwrap_error(info.value), LeaseTooLarge) and budget.acquires == 1
    assert proxy.forwarded[CHAT] == before and released(budget)
