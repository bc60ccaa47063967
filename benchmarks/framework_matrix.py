"""Issue 31's acceptance table: every agent framework through zp, by default and with its common retry
setting on, against the simulator (``zp_sim``) behind a loopback proxy that answers 503 to tagged
requests (tests/_frameworks.py's FailProxy).

Per row: ``--calls`` concurrent calls (agent runs where the framework has agents), ``--failing`` of them
always answered 503; reported: upstream attempts per always-failing call (max and the list), calls that
succeeded, leases granted = LLM calls that reached the upstream (forwarded + failed attempts), every lease
released; then one call on a budget too small for it (``LeaseTooLarge``): acquires made, and whether
``zp_client.unwrap_error`` finds the refusal in what the caller caught (``isinstance(..., ZPError)`` in the
caught exception itself: ``own type``).

Frameworks are looked up in the running environment; run it once per venv (the frameworks pin
incompatible versions) and read the tables together::

    .venv/bin/python benchmarks/framework_matrix.py            # LiteLLM, LangGraph, Agents SDK, ...
    .venv-openai2/bin/python benchmarks/framework_matrix.py    # LlamaIndex
    .venv-crewai/bin/python benchmarks/framework_matrix.py     # CrewAI

zp's retry sleeps are skipped (``zp_client.retry.testing()``): attempts are counted, not time. Each row is
bounded (``--row-timeout`` s). Set PYTHONPATH to the clone's root and integrations (see COMMON.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
for sub in ("langchain", "litellm", "llama-index", "crewai"):
    sys.path.insert(0, str(ROOT / "integrations" / sub))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

import openai  # noqa: E402
from _frameworks import FAIL_MARK, CountingBudget, FailProxy, released  # noqa: E402

from zp_client import LocalBudget, Settings, unwrap_error, wrap  # noqa: E402
from zp_client.errors import ZPError  # noqa: E402
from zp_client.retry import testing  # noqa: E402
from zp_sim.server import SimServer  # noqa: E402

SETTINGS = Settings(estimator="heuristic")
CHAT = "/v1/chat/completions"
Call = Callable[[str], Awaitable[Any]]
Builder = Callable[[FailProxy, LocalBudget, int], Call]


def has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v(dist)
    except PackageNotFoundError:
        return "?"


def aclient(proxy: FailProxy, budget: LocalBudget, sdk_retries: int | None = None) -> openai.AsyncOpenAI:
    c = wrap(openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"), budget, settings=SETTINGS)
    if sdk_retries is not None:
        c.max_retries = sdk_retries  # the SDK's own retries, as LiteLLM sets them back on every call
    return c


# ------------------------------------------------------------------------------------------ builders

def litellm_zp(num_retries: int) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from litellm_zp import ZPLiteLLM

        llm = ZPLiteLLM(budget, api_base=proxy.base_url, api_key="sk-test", settings=SETTINGS)
        return lambda p: llm.acompletion(model=proxy.model, messages=[{"role": "user", "content": p}],
                                         max_tokens=max_tokens, num_retries=num_retries)
    return build


def litellm_glue(num_retries: int) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        import litellm

        c = aclient(proxy, budget)
        return lambda p: litellm.acompletion(
            model=f"openai/{proxy.model}", client=c, max_tokens=max_tokens,
            messages=[{"role": "user", "content": p}], num_retries=num_retries)
    return build


def langgraph(policy: bool) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from typing import TypedDict

        from langgraph.graph import END, START, StateGraph
        from langgraph.types import RetryPolicy

        from langchain_zp import ZPChatOpenAI

        llm = ZPChatOpenAI(model=proxy.model, base_url=proxy.base_url, api_key="sk-test", budget=budget,
                           max_tokens=max_tokens, zp_settings=SETTINGS)

        class S(TypedDict):
            q: str
            a: str

        async def node(s: S) -> dict[str, str]:
            return {"a": str((await llm.ainvoke(s["q"])).content)}

        g = StateGraph(S)
        g.add_node("model", node, retry_policy=RetryPolicy() if policy else None)
        g.add_edge(START, "model")
        g.add_edge("model", END)
        graph = g.compile()
        return lambda p: graph.ainvoke({"q": p, "a": ""})
    return build


def agents_sdk(sdk_retries: int | None) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

        set_tracing_disabled(True)
        client = aclient(proxy, budget, sdk_retries)
        model = OpenAIChatCompletionsModel(model=proxy.model, openai_client=client)
        agent = Agent(name="a", instructions="answer", model=model,
                      model_settings=ModelSettings(max_tokens=max_tokens))
        return lambda p: Runner.run(agent, p)
    return build


def pydantic_ai(sdk_retries: int | None) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        model = OpenAIChatModel(proxy.model,
                                provider=OpenAIProvider(openai_client=aclient(proxy, budget, sdk_retries)))
        agent: Any = Agent(model, model_settings={"max_tokens": max_tokens})
        return lambda p: agent.run(p)
    return build


def agent_framework(sdk_retries: int | None) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from agent_framework import Agent
        from agent_framework.openai import OpenAIChatCompletionClient

        chat = OpenAIChatCompletionClient(proxy.model, async_client=aclient(proxy, budget, sdk_retries))
        agent: Any = Agent(chat, "answer", default_options={"max_tokens": max_tokens})
        return lambda p: agent.run(p)
    return build


def llama_index(adapter: bool) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from llama_index.core.llms import ChatMessage

        kw: dict[str, Any] = {"model": proxy.model, "api_base": proxy.base_url, "api_key": "sk-test",
                              "is_chat_model": True, "max_tokens": max_tokens}
        if adapter:
            from llama_index_zp import ZPOpenAILike

            llm: Any = ZPOpenAILike(budget=budget, zp_settings=SETTINGS, **kw)
        else:  # the glue: LlamaIndex's own class, its default max_retries=3
            from llama_index.llms.openai_like import OpenAILike

            sync = wrap(openai.OpenAI(base_url=proxy.base_url, api_key="sk-test"), budget, settings=SETTINGS)
            llm = OpenAILike(openai_client=sync, async_openai_client=aclient(proxy, budget), **kw)
        return lambda p: llm.achat([ChatMessage(role="user", content=p)])
    return build


def crewai(max_retry_limit: int | None) -> Builder:
    def build(proxy: FailProxy, budget: LocalBudget, max_tokens: int) -> Call:
        from crewai import Agent, Crew, Task

        from crewai_zp import ZPLLM

        llm = ZPLLM(model=proxy.model, base_url=proxy.base_url, api_key="sk-test", budget=budget,
                    zp_settings=SETTINGS, max_tokens=max_tokens)
        kw = {} if max_retry_limit is None else {"max_retry_limit": max_retry_limit}

        async def run(p: str) -> Any:
            agent = Agent(role="r", goal="answer", backstory="b", llm=llm, verbose=False, **kw)
            task = Task(description=p, expected_output="an answer", agent=agent)
            return await Crew(agents=[agent], tasks=[task], verbose=False).kickoff_async()
        return run
    return build


@dataclass
class Row:
    name: str
    module: str  # what must be importable
    dist: str  # the distribution whose version is reported
    build: Builder


ROWS = [
    Row("LiteLLM + litellm-zp (default)", "litellm", "litellm", litellm_zp(0)),
    Row("LiteLLM + litellm-zp, num_retries=2", "litellm", "litellm", litellm_zp(2)),
    Row("LiteLLM client=wrap(), num_retries=2", "litellm", "litellm", litellm_glue(2)),
    Row("LangGraph + langchain-zp (default)", "langgraph", "langgraph", langgraph(False)),
    Row("LangGraph + langchain-zp, RetryPolicy()", "langgraph", "langgraph", langgraph(True)),
    Row("OpenAI Agents SDK (default)", "agents", "openai-agents", agents_sdk(None)),
    Row("OpenAI Agents SDK, client max_retries=2", "agents", "openai-agents", agents_sdk(2)),
    Row("pydantic-ai (default)", "pydantic_ai.models.openai", "pydantic-ai-slim", pydantic_ai(None)),
    Row("pydantic-ai, client max_retries=2", "pydantic_ai.models.openai", "pydantic-ai-slim", pydantic_ai(2)),
    Row("Agent Framework (default)", "agent_framework_openai", "agent-framework-core", agent_framework(None)),
    Row("Agent Framework, client max_retries=2", "agent_framework_openai", "agent-framework-core",
        agent_framework(2)),
    Row("LlamaIndex + llama-index-llms-zp", "llama_index.llms.openai_like", "llama-index-core",
        llama_index(True)),
    Row("LlamaIndex OpenAILike(wrap()), max_retries=3", "llama_index.llms.openai_like", "llama-index-core",
        llama_index(False)),
    Row("CrewAI + crewai-zp, default agent (max_retry_limit=2)", "crewai", "crewai", crewai(None)),
    Row("CrewAI + crewai-zp, max_retry_limit=0", "crewai", "crewai", crewai(0)),
]


async def measure(row: Row, proxy: FailProxy, calls: int, failing: int, n: int) -> dict[str, Any]:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    call = row.build(proxy, budget, 12)
    tags = [f"m{n}x{i}" for i in range(failing)]
    prompts = [f"{FAIL_MARK}{tags[i]} hello" if i < failing else f"hello number {i}" for i in range(calls)]
    before = proxy.forwarded[CHAT]

    async def one(p: str) -> bool:
        try:
            await call(p)
            return True
        except Exception:  # noqa: BLE001 - a failing call fails: counted below
            return False

    t0 = time.monotonic()
    ok = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.monotonic() - t0
    per = [proxy.attempts[t] for t in tags]
    reached = proxy.forwarded[CHAT] - before + sum(per)
    granted = int(budget.status_sync().extra["granted"])
    # a refusal: one call on a budget too small for it
    small = CountingBudget(limit_blocks=8, policy="strict")
    refuse = row.build(proxy, small, 1000)
    caught: BaseException | None = None
    try:
        await refuse("hello, refuse me")
    except Exception as exc:  # noqa: BLE001 - inspected below
        caught = exc
    zp = unwrap_error(caught) if caught is not None else None
    return {"per": per, "ok": sum(ok[failing:]), "wall": wall, "reached": reached, "granted": granted,
            "released": released(budget) and released(small), "acquires": small.acquires,
            "refusal": type(zp).__name__ if zp else repr(caught),
            "own": isinstance(caught, ZPError)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--failing", type=int, default=3)
    ap.add_argument("--row-timeout", type=float, default=120.0)
    ap.add_argument("--only", default="", help="rows whose name contains this")
    args = ap.parse_args()
    if has("litellm"):
        import litellm

        litellm.suppress_debug_info = True
    rows = [r for r in ROWS if has(r.module) and args.only.lower() in r.name.lower()]
    print(f"python {sys.version.split()[0]}, openai {version('openai')}; {args.calls} concurrent calls, "
          f"{args.failing} always answered 503; zp's default RetryPolicy (3 attempts)")
    print("| framework (version) | attempts per always-failing call (max; each) | other calls ok | "
          "leases = LLM calls | all released | acquires for a LeaseTooLarge | refusal found | own type |")
    print("|---|---|---|---|---|---|---|---|")
    with SimServer(profile="tiny", speedup=20.0) as sim, FailProxy(sim.url, model=sim.model) as proxy:
        for n, row in enumerate(rows):
            try:
                with testing():
                    r = await asyncio.wait_for(measure(row, proxy, args.calls, args.failing, n),
                                               args.row_timeout)
            except Exception as exc:  # noqa: BLE001 - a row that cannot run says why and the rest go on
                print(f"| {row.name} ({version(row.dist)}) | not run: {type(exc).__name__}: {exc} |")
                continue
            print(f"| {row.name} ({version(row.dist)}) | {max(r['per'])}; {r['per']} | "
                  f"{r['ok']}/{args.calls - args.failing} | {r['granted']} = {r['reached']} "
                  f"({'yes' if r['granted'] == r['reached'] else 'NO'}) | {'yes' if r['released'] else 'NO'} "
                  f"| {r['acquires']} | {r['refusal']} | {'yes' if r['own'] else 'no'} |", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
