"""Microsoft Agent Framework's real Agent on a wrap()'d AsyncOpenAI (``OpenAIChatCompletionClient(
async_client=wrap(...))``, the one-liner of docs/integrations.md), against the simulated vLLM server on
loopback behind a proxy that answers 503 to chosen requests.

Agent Framework re-raises a provider error as its own ``ChatClientException`` (``raise ... from``): a zp
refusal is found with ``zp_client.unwrap_error``. Main environment only (``agent-framework-core`` and
``agent-framework-openai`` in the dev extra, openai 3.x).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest

pytest.importorskip("agent_framework.openai")
pytest.importorskip("agent_framework_openai")

from _budget_probes import granted
from _frameworks import FAIL_MARK, CountingBudget, FailProxy, released
from agent_framework import Agent, tool
from agent_framework.openai import OpenAIChatCompletionClient

from zp_client import LocalBudget, RetryPolicy, Settings, wrap
from zp_client.errors import LeaseTooLarge, unwrap_error
from zp_client.retry import testing
from zp_sim.server import SimServer

SETTINGS = Settings(estimator="heuristic")
CHAT = "/v1/chat/completions"
ZP_ATTEMPTS = RetryPolicy().max_attempts
OPTIONS: Any = {"max_tokens": 12}
ASKED: list[str] = []


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with SimServer(profile="tiny", speedup=4.0) as sim, FailProxy(sim.url, model=sim.model) as p:
        yield p


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    ASKED.append(city)
    return f"sunny in {city}"


def agent_of(proxy: FailProxy, budget: LocalBudget, **options: Any) -> Agent[Any]:
    # the documented one-liner: the chat client takes the admitted AsyncOpenAI as it is
    client = wrap(openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"), budget, settings=SETTINGS)
    chat = OpenAIChatCompletionClient(proxy.model, async_client=client)
    return Agent(chat, "You answer weather questions with the tool.", tools=[get_weather],
                 default_options={**OPTIONS, **options})


@pytest.mark.slow
def test_a_tool_run_and_a_stream_take_one_lease_per_llm_call(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    before, asked = proxy.forwarded[CHAT], len(ASKED)

    async def runs() -> int:
        agent = agent_of(proxy, budget)
        assert (await agent.run("What is the weather in Paris?")).text
        updates = 0
        async for _ in agent.run("What is the weather in Rome?", stream=True):
            updates += 1
        return updates

    assert asyncio.run(runs()) > 0
    calls = proxy.forwarded[CHAT] - before
    assert len(ASKED) > asked  # the agent called the tool
    assert calls >= 2 and granted(budget) == calls and released(budget)


def test_an_always_failing_run_makes_at_most_zps_attempts(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")

    async def run() -> None:
        with pytest.raises(Exception):  # noqa: B017,PT011 - Agent Framework's own type, not zp's
            await agent_of(proxy, budget).run(FAIL_MARK + "maf-async")

    with testing():
        asyncio.run(run())
    assert 1 <= proxy.attempts["maf-async"] <= ZP_ATTEMPTS
    assert granted(budget) == proxy.attempts["maf-async"] and released(budget)


def test_a_refusal_is_found_with_unwrap_error_after_one_acquire(proxy: FailProxy) -> None:
    budget = CountingBudget(limit_blocks=8, policy="strict")
    before = proxy.forwarded[CHAT]

    async def run() -> BaseException:
        try:
            await agent_of(proxy, budget, max_tokens=1000).run("What is the weather in Paris?")
        except Exception as exc:  # noqa: BLE001 - what the caller sees, checked below
            return exc
        raise AssertionError("the refusal did not reach the caller")

    seen = asyncio.run(run())
    assert isinstance(unwrap_error(seen), LeaseTooLarge), repr(seen)
    assert budget.acquires == 1 and proxy.forwarded[CHAT] == before and released(budget)
