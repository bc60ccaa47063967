"""LangGraph's node ``RetryPolicy`` around a langchain-zp model: one retry loop (issue 31).

LangGraph runs each attempt of a node in a fresh copy of a context taken before the first attempt, so
zp's context record of the failed call is not seen by the next attempt; langchain-zp keys the call with
the node's task id (the same for every attempt), and the retry gets zp's failure again with no upstream
attempt. Real LangGraph (StateGraph, its default retry predicate) and the real ChatOpenAI against a
loopback proxy that answers 503; the refusal (``LeaseTooLarge``) is not retried at all (a ValueError:
LangGraph's default ``retry_on`` says permanent).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("langchain_openai")
pytest.importorskip("langgraph", reason="not installed: the dev extra has langgraph")
pytest.importorskip("langchain_zp", reason="not installed: pip install -e integrations/langchain")

from _fail_proxy import FailProxy
from _frameworks import CountingBudget
from langgraph.graph import END, START, StateGraph
from langgraph.types import RetryPolicy as GraphRetryPolicy

from langchain_zp import ZPChatOpenAI
from zp_client import LocalBudget, Settings
from zp_client.errors import LeaseTooLarge
from zp_client.retry import RetryPolicy, testing

SETTINGS = Settings(estimator="heuristic", max_model_len=4096, pool_check=False)
ZP_ATTEMPTS = RetryPolicy().max_attempts
# LangGraph's default policy (max_attempts=3, its default retry_on) with its waits shortened for a test
FAST_DEFAULT = GraphRetryPolicy(initial_interval=0.01, jitter=False)


class State(TypedDict):
    q: str
    a: str


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with FailProxy() as p:
        yield p


@pytest.fixture(autouse=True)
def no_sleeps() -> Iterator[None]:
    with testing():
        yield


def graph_of(llm: ZPChatOpenAI, policy: GraphRetryPolicy, *, is_async: bool) -> Any:
    if is_async:
        async def anode(state: State) -> dict[str, str]:
            return {"a": str((await llm.ainvoke(state["q"])).content)}
        node: Any = anode
    else:
        def snode(state: State) -> dict[str, str]:
            return {"a": str(llm.invoke(state["q"]).content)}
        node = snode
    g = StateGraph(State)
    g.add_node("model", node, retry_policy=policy)
    g.add_edge(START, "model")
    g.add_edge("model", END)
    return g.compile()


def llm_of(proxy: FailProxy, budget: LocalBudget, model: str, **kw: Any) -> ZPChatOpenAI:
    return ZPChatOpenAI(model=model, base_url=proxy.base_url, api_key="sk-test", budget=budget,
                        max_tokens=kw.pop("max_tokens", 8), zp_settings=SETTINGS,
                        zp_retry=RetryPolicy(budget=None), **kw)


def granted(b: LocalBudget) -> int:
    return int(b.status_sync().extra["granted"])


def test_the_default_retry_policy_makes_zps_attempts_only_sync_and_async(proxy: FailProxy) -> None:
    assert GraphRetryPolicy().max_attempts == FAST_DEFAULT.max_attempts == 3
    b = LocalBudget(limit_blocks=400, policy="strict")
    sync_graph = graph_of(llm_of(proxy, b, "fail-lg-sync"), FAST_DEFAULT, is_async=False)
    with pytest.raises(openai.InternalServerError):
        sync_graph.invoke({"q": "hello", "a": ""})
    assert proxy.count("fail-lg-sync") == ZP_ATTEMPTS  # LangGraph's 2 retries: repeats, nothing sent
    async_graph = graph_of(llm_of(proxy, b, "fail-lg-async"), FAST_DEFAULT, is_async=True)
    with pytest.raises(openai.InternalServerError):
        asyncio.run(async_graph.ainvoke({"q": "hello", "a": ""}))
    assert proxy.count("fail-lg-async") == ZP_ATTEMPTS
    assert granted(b) == 2 * ZP_ATTEMPTS and b.status_sync().used == 0
    # another run of the graph is another logical call (another task id): zp's attempts again, no more
    with pytest.raises(openai.InternalServerError):
        sync_graph.invoke({"q": "hello", "a": ""})
    assert proxy.count("fail-lg-sync") == 2 * ZP_ATTEMPTS


def test_a_node_that_succeeds_after_a_failure_is_not_replayed(proxy: FailProxy) -> None:
    # the key only replays an identical call that failed: the node's next (different) call goes out
    b = LocalBudget(limit_blocks=400, policy="strict")
    llm = llm_of(proxy, b, "ok-model")
    graph = graph_of(llm, FAST_DEFAULT, is_async=False)
    assert graph.invoke({"q": "hello", "a": ""})["a"]
    assert graph.invoke({"q": "hello", "a": ""})["a"]
    assert proxy.count("ok-model") == 2 and b.status_sync().used == 0


def test_a_refusal_is_one_acquire_under_the_default_policy(proxy: FailProxy) -> None:
    b = CountingBudget(limit_blocks=8, policy="strict")
    graph = graph_of(llm_of(proxy, b, "ok-model", max_tokens=1000), FAST_DEFAULT, is_async=False)
    with pytest.raises(LeaseTooLarge):
        graph.invoke({"q": "hello", "a": ""})
    assert b.acquires == 1 and b.status_sync().used == 0
