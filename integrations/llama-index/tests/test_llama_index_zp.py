"""LlamaIndex's real OpenAILike LLM and FunctionAgent, admission-gated, against the simulated vLLM server on
loopback (behind a proxy that answers 503 to chosen requests).

LlamaIndex's openai integration needs openai < 3, so these tests run only in the openai 2.x environment
(``make test-openai2`` adds this folder; it is not in the main testpaths).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

# the zp-client clone's test helpers (tests/_frameworks.py, tests/_budget_probes.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("llama_index.llms.openai_like")

from _budget_probes import granted, wait_until
from _frameworks import FAIL_MARK, CountingBudget, FailProxy, released
from _meta_spy import MetaSpy, targets
from llama_index.core.agent.workflow import AgentStream, FunctionAgent
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

from llama_index_zp import ZPOpenAILike
from zp_client import LocalBudget, RetryPolicy, Settings, unwrap_error, wrap
from zp_client.errors import ConfigurationError, LeaseTooLarge, MissingIntegration, ZPError
from zp_client.retry import testing
from zp_sim.server import SimServer

SETTINGS = Settings(estimator="heuristic")
CHAT = "/v1/chat/completions"
ZP_ATTEMPTS = RetryPolicy().max_attempts  # zp's default: the most upstream attempts one call may make


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with SimServer(profile="tiny", speedup=4.0) as sim, FailProxy(sim.url, model=sim.model) as p:
        yield p


def llm_of(proxy: FailProxy, budget: LocalBudget, **kw: Any) -> ZPOpenAILike:
    kw.setdefault("max_tokens", 12)
    return ZPOpenAILike(model=proxy.model, api_base=proxy.base_url, api_key="sk-test", budget=budget,
                        zp_settings=SETTINGS, is_chat_model=True, is_function_calling_model=True, **kw)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


WEATHER = FunctionTool.from_defaults(get_weather)


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


# ------------------------------------------------------------------------------------- normal paths


def test_sync_chat_stream_complete_and_tool_call_take_one_lease_each(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget)
    before = proxy.forwarded[CHAT]
    assert llm.chat(user("hello")).message.content
    held = []
    text = ""
    for chunk in llm.stream_chat(user("hello")):
        held.append(budget.status_sync().used)
        text += chunk.delta or ""
    assert text and max(held) > 0  # the stream holds its lease while it runs
    assert llm.complete("hello").text
    # a tool call, LlamaIndex's sync path: the model asks for the tool, LlamaIndex calls it
    out = llm.predict_and_call([WEATHER], "what is the weather in Paris?")
    assert "sunny in" in out.response
    calls = proxy.forwarded[CHAT] - before
    assert calls == 4 and granted(budget) == calls and released(budget)


def test_async_function_agent_streams_a_tool_run_one_lease_per_llm_call(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget)
    agent = FunctionAgent(tools=[WEATHER], llm=llm, system_prompt="You answer with tools.")
    before = proxy.forwarded[CHAT]

    async def run() -> tuple[str, int]:
        assert (await llm.achat(user("hello"))).message.content
        handler = agent.run(user_msg="what is the weather in Paris?")
        deltas = 0
        async for ev in handler.stream_events():
            if isinstance(ev, AgentStream):
                deltas += 1
        return str(await handler), deltas

    answer, deltas = asyncio.run(run())
    assert answer and deltas > 0  # the agent streamed its answer
    # achat, then the agent: a tool call, then the answer from the tool's result
    calls = proxy.forwarded[CHAT] - before
    assert calls == 3 and granted(budget) == calls and released(budget)


def test_zp_options_become_the_clients_headers_and_both_clients_share_the_budget(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget, zp_priority=2, zp_deadline=30.0, default_headers={"x-mine": "1"})
    from zp_client import admitted_budget

    for client in (llm._get_client(), llm._get_aclient()):
        assert admitted_budget(client) is budget and client.max_retries == 0
        assert client.default_headers["x-zp-priority"] == "2" and client.default_headers["x-mine"] == "1"
        assert float(client.default_headers["x-zp-deadline"]) == 30.0
    assert llm.max_retries == 0
    # reuse_client=False: a fresh client per call, admitted on the same budget all the same
    fresh = llm_of(proxy, budget, reuse_client=False)
    assert fresh._get_client() is not fresh._get_client()
    assert admitted_budget(fresh._get_client()) is budget and admitted_budget(fresh._get_aclient()) is budget
    assert fresh.chat(user("hi")).message.content and released(budget)


def test_zp_targets_reach_the_budgets_acquire_meta_sync_and_async(proxy: FailProxy) -> None:
    spy = MetaSpy(policy="elastic")
    llm = llm_of(proxy, spy, zp_ttft_target=1.5, zp_tpot_target=0.05)
    assert llm.chat(user("hi")).message.content
    assert targets(spy.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert asyncio.run(llm.acomplete("hi")).text
    assert targets(spy.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert len(spy.calls) == 2 and released(spy)
    with pytest.raises(ConfigurationError, match="ttft_target"):
        llm_of(proxy, spy, zp_ttft_target=0.0)


def test_a_cancelled_async_stream_gives_its_lease_back(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget, max_tokens=400, additional_kwargs={"extra_body": {"sim_output_tokens": 300}})

    async def run() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in await llm.astream_chat(user("a long answer")):
                first.set()

        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(first.wait(), 30)
        assert budget.status_sync().used > 0  # mid-stream: the lease is held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: released(budget), "the cancelled stream's lease to be released")

    asyncio.run(run())
    assert granted(budget) == 1


# ----------------------------------------------------------------------------------- failing paths


def test_an_always_failing_call_makes_at_most_zps_attempts_sync_async_and_agent(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, budget)
    agent = FunctionAgent(tools=[WEATHER], llm=llm)
    with testing():  # zp's backoff is skipped; LlamaIndex's tenacity loop, if it ran, would sleep 1-20 s
        with pytest.raises(openai.InternalServerError):
            llm.chat(user(FAIL_MARK + "li-sync"))
        with pytest.raises(openai.InternalServerError):
            list(llm.stream_chat(user(FAIL_MARK + "li-stream")))

        async def arun() -> None:
            with pytest.raises(openai.InternalServerError):
                await llm.achat(user(FAIL_MARK + "li-async"))
            with pytest.raises(Exception) as info:  # noqa: PT011 - the workflow's own wrapper, checked below
                await agent.run(user_msg=FAIL_MARK + "li-agent")
            assert isinstance(info.value, openai.InternalServerError) or isinstance(
                info.value.__cause__, openai.InternalServerError), repr(info.value)

        asyncio.run(arun())
    tags = ("li-sync", "li-stream", "li-async", "li-agent")
    assert {t: proxy.attempts[t] for t in tags} == {t: ZP_ATTEMPTS for t in tags}
    assert granted(budget) == 4 * ZP_ATTEMPTS and released(budget)  # one lease per attempt
    # every attempt was zp's: the SDK never retried (openai counts its retries in this header)
    assert set(proxy.retry_counts) <= {"0"}


def test_a_refusal_reaches_the_caller_as_zps_type_after_one_acquire(proxy: FailProxy) -> None:
    budget = CountingBudget(limit_blocks=8, policy="strict")
    llm = llm_of(proxy, budget, max_tokens=1000)
    before = proxy.forwarded[CHAT]
    with pytest.raises(ZPError) as info:
        llm.chat(user("hello"))
    assert isinstance(info.value, LeaseTooLarge) and budget.acquires == 1

    async def agent_run() -> BaseException:
        try:
            await FunctionAgent(tools=[WEATHER], llm=llm).run(user_msg="weather in Paris?")
        except Exception as exc:  # noqa: BLE001 - what the caller sees, checked below
            return exc
        raise AssertionError("the agent ran although its call can never be admitted")

    seen = asyncio.run(agent_run())
    assert isinstance(unwrap_error(seen), LeaseTooLarge), repr(seen)
    assert budget.acquires == 2  # the agent's one LLM call asked once: nobody retried the refusal
    assert proxy.forwarded[CHAT] == before and released(budget)


# ------------------------------------------------------------------------------------- bad input


def test_bad_input_says_so(proxy: FailProxy) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    other = LocalBudget(limit_blocks=400, policy="strict")
    with pytest.raises(ConfigurationError, match="max_retries"):
        llm_of(proxy, budget, max_retries=3)
    plain = openai.OpenAI(base_url=proxy.base_url, api_key="sk-test")
    with pytest.raises(ConfigurationError, match="already admitted .* another budget"):
        llm_of(proxy, budget, openai_client=wrap(plain, other))
    with pytest.raises(ConfigurationError, match="already admitted .* this budget"):
        llm_of(proxy, budget, async_openai_client=wrap(openai.AsyncOpenAI(base_url=proxy.base_url,
                                                                          api_key="sk-test"), budget))
    with pytest.raises(ConfigurationError, match="budget"):
        llm_of(proxy, "not a budget")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="deadline"):
        llm_of(proxy, budget, zp_deadline=0)
    # an unwrapped client of the caller's is admitted on the budget
    mine = llm_of(proxy, budget, openai_client=plain)
    assert mine.chat(user("hi")).message.content and granted(budget) == 1 and released(budget)


def test_plain_openailike_with_a_wrapped_client_is_what_the_adapter_replaces(proxy: FailProxy) -> None:
    # LlamaIndex's own class keeps max_retries=3: the loop the adapter turns off is really there
    llm = OpenAILike(model=proxy.model, api_base=proxy.base_url, api_key="sk-test", is_chat_model=True,
                     openai_client=wrap(openai.OpenAI(base_url=proxy.base_url, api_key="sk-test"),
                                        LocalBudget(limit_blocks=400)))
    assert llm.max_retries == 3
    assert ZPOpenAILike.model_fields["max_retries"].default == 0


def test_missing_llama_index_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_index.llms.openai_like", None)
    monkeypatch.delitem(sys.modules, "llama_index_zp")
    with pytest.raises(MissingIntegration, match="llama-index-llms-openai-like"):
        import llama_index_zp  # noqa: F401
