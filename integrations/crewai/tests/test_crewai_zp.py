"""CrewAI's real LLM, Agent and Crew, admission-gated by crewai-zp, against the simulated vLLM server on
loopback (behind a proxy that answers 503 to chosen requests).

CrewAI 1.15 pins openai < 3, httpx ~= 0.28 and pydantic < 2.13: these tests run only in `.venv-crewai`
(``make test-crewai``; the folder is not in the main testpaths).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# no telemetry or trace upload from a test run (read when crewai is imported)
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

import openai
import pytest

# the zp-client clone's test helpers (tests/_frameworks.py, tests/_budget_probes.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("crewai")

from _budget_probes import granted
from _frameworks import FAIL_MARK, CountingBudget, FailProxy, released
from _meta_spy import MetaSpy, targets
from crewai import Agent, Crew, Task
from crewai.llms.providers.openai.completion import OpenAICompletion
from crewai.tools import tool

from crewai_zp import ZPLLM
from zp_client import LocalBudget, RetryPolicy, Settings, admitted_budget, unwrap_error
from zp_client._private import replace_crewai_clients
from zp_client.errors import ConfigurationError, LeaseTooLarge, MissingIntegration, ZPError
from zp_client.retry import testing
from zp_sim.server import SimServer

SETTINGS = Settings(estimator="heuristic")
CHAT = "/v1/chat/completions"
ZP_ATTEMPTS = RetryPolicy().max_attempts


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with SimServer(profile="tiny", speedup=4.0) as sim, FailProxy(sim.url, model=sim.model) as p:
        yield p


def llm_of(proxy: FailProxy, budget: LocalBudget, **kw: Any) -> ZPLLM:
    kw.setdefault("max_tokens", 12)
    return ZPLLM(model=proxy.model, base_url=proxy.base_url, api_key="sk-test", budget=budget,
                 zp_settings=SETTINGS, **kw)


ASKED: list[str] = []  # the cities the tool was called for


@tool("get_weather")
def get_weather(city: str) -> str:
    """The weather in a city."""
    ASKED.append(city)
    return f"sunny in {city}"


def crew_of(llm: ZPLLM, question: str, **agent_kw: Any) -> Crew:
    agent = Agent(role="forecaster", goal="answer weather questions with the tool", backstory="a forecaster",
                  llm=llm, tools=[get_weather], verbose=False, **agent_kw)
    task = Task(description=question, expected_output="the weather", agent=agent)
    return Crew(agents=[agent], tasks=[task], verbose=False)


def clients(llm: OpenAICompletion) -> list[Any]:
    seen: list[Any] = []
    replace_crewai_clients(llm, lambda c: seen.append(c) or c)
    return seen


# ------------------------------------------------------------------------------------- normal paths


def test_crewai_keeps_its_clients_where_zp_replaces_them(proxy: FailProxy) -> None:
    # fails when CrewAI renames or drops OpenAICompletion._client / _async_client (zp_client/_private.py)
    plain = OpenAICompletion(model=proxy.model, base_url=proxy.base_url, api_key="sk-test")
    sync, async_ = clients(plain)
    assert isinstance(sync, openai.OpenAI) and isinstance(async_, openai.AsyncOpenAI)
    assert plain._get_sync_client() is sync and plain._get_async_client() is async_  # what its calls use


def test_llm_calls_sync_async_and_streamed_take_one_lease_each(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget)
    assert [admitted_budget(c) for c in clients(llm)] == [budget, budget]
    assert llm._get_sync_client().max_retries == 0
    before = proxy.forwarded[CHAT]
    assert llm.call("hello")
    assert asyncio.run(llm.acall("hello"))
    streaming = llm_of(proxy, budget, stream=True)
    assert streaming.call("hello") and asyncio.run(streaming.acall("hello"))
    calls = proxy.forwarded[CHAT] - before
    assert calls == 4 and granted(budget) == calls and released(budget)


def test_a_crew_runs_a_tool_sync_and_async_one_lease_per_llm_call(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    before, asked = proxy.forwarded[CHAT], len(ASKED)
    result = crew_of(llm_of(proxy, budget), "What is the weather in Paris?").kickoff()
    assert result.raw and len(ASKED) == asked + 1  # the agent called the tool
    mid = proxy.forwarded[CHAT]
    assert mid - before >= 2  # the tool call, then the answer from its result

    async def arun() -> Any:
        crew = crew_of(llm_of(proxy, budget, stream=True), "What is the weather in Rome?")
        return await crew.kickoff_async()

    assert asyncio.run(arun()).raw and len(ASKED) == asked + 2
    calls = proxy.forwarded[CHAT] - before
    assert proxy.forwarded[CHAT] - mid >= 2 and granted(budget) == calls and released(budget)


# ----------------------------------------------------------------------------------- failing paths


def test_an_always_failing_llm_call_makes_at_most_zps_attempts(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget)
    with testing():
        with pytest.raises(openai.InternalServerError):
            llm.call(FAIL_MARK + "crew-call")
        with pytest.raises(openai.InternalServerError):
            asyncio.run(llm.acall(FAIL_MARK + "crew-acall"))
        # an agent without CrewAI's own task retries (max_retry_limit, default 2: see docs/integrations.md)
        with pytest.raises(openai.InternalServerError):
            crew_of(llm, FAIL_MARK + "crew-agent", max_retry_limit=0).kickoff()
    tags = ("crew-call", "crew-acall", "crew-agent")
    assert {t: proxy.attempts[t] for t in tags} == {t: ZP_ATTEMPTS for t in tags}
    assert granted(budget) == 3 * ZP_ATTEMPTS and released(budget)
    assert set(proxy.retry_counts) <= {"0"}  # no SDK retry: every attempt was zp's


def test_a_refusal_reaches_the_caller_as_zps_type(proxy: FailProxy) -> None:
    budget = CountingBudget(limit_blocks=8, policy="strict")
    llm = llm_of(proxy, budget, max_tokens=1000)
    before = proxy.forwarded[CHAT]
    with pytest.raises(ZPError) as info:
        llm.call("hello")
    assert isinstance(info.value, LeaseTooLarge) and budget.acquires == 1
    with pytest.raises(Exception) as crew_info:  # noqa: PT011 - what the caller sees, checked below
        crew_of(llm, "What is the weather in Paris?", max_retry_limit=0).kickoff()
    assert isinstance(unwrap_error(crew_info.value), LeaseTooLarge), repr(crew_info.value)
    assert budget.acquires == 2 and proxy.forwarded[CHAT] == before and released(budget)


def test_crewais_default_agent_retries_are_one_loop(proxy: FailProxy) -> None:
    # CrewAI's default agent (max_retry_limit=2) retries a failed task with a fresh LLM call of the same
    # messages: each is a repeat of the call zp gave up on (zp_client._repeat), not new upstream attempts
    # (measured 9 attempts and 3 acquires for a refusal before the repeat detection)
    assert Agent(role="r", goal="g", backstory="b", llm=llm_of(proxy, LocalBudget(limit_blocks=400))
                 ).max_retry_limit == 2
    budget = LocalBudget(limit_blocks=400, policy="strict")
    with testing(), pytest.raises(openai.InternalServerError):
        crew_of(llm_of(proxy, budget), FAIL_MARK + "crew-default").kickoff()
    assert 1 <= proxy.attempts["crew-default"] <= ZP_ATTEMPTS
    assert granted(budget) == proxy.attempts["crew-default"] and released(budget)
    refusing = CountingBudget(limit_blocks=8, policy="strict")
    with pytest.raises(Exception) as info:  # noqa: PT011 - what the caller sees, checked below
        crew_of(llm_of(proxy, refusing, max_tokens=1000), "What is the weather in Oslo?").kickoff()
    assert isinstance(unwrap_error(info.value), LeaseTooLarge), repr(info.value)
    assert refusing.acquires == 1 and released(refusing)


def test_zp_targets_reach_the_budgets_acquire_meta(proxy: FailProxy) -> None:
    spy = MetaSpy(policy="elastic")
    llm = llm_of(proxy, spy, zp_ttft_target=1.5, zp_tpot_target=0.05)
    assert llm.call("hello")
    assert targets(spy.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert asyncio.run(llm.acall("hello"))
    assert targets(spy.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert len(spy.calls) == 2 and released(spy)
    with pytest.raises(ConfigurationError, match="tpot_target"):
        llm_of(proxy, spy, zp_tpot_target=-1.0)


# ------------------------------------------------------------------------------------- bad input


def test_bad_input_says_so(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    with pytest.raises(ConfigurationError, match="api_key"):
        ZPLLM(model=proxy.model, base_url=proxy.base_url, budget=budget, api_key=None)
    with pytest.raises(ConfigurationError, match="deadline"):
        llm_of(proxy, budget, zp_deadline=0)
    explicit = llm_of(proxy, budget, max_retries=2)
    assert explicit._get_sync_client().max_retries == 2  # asked for: the SDK's retries, around zp's


def test_missing_crewai_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "crewai.llms.providers.openai.completion", None)
    monkeypatch.delitem(sys.modules, "crewai_zp")
    with pytest.raises(MissingIntegration, match="crewai"):
        import crewai_zp  # noqa: F401
