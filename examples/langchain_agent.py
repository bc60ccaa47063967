"""LangChain agents sharing one KV-block budget: ``ZPChatOpenAI`` with tool calling.

Several small tool-calling agents run at once. Each is a plain LangChain loop: the model (bound to a
``get_weather`` tool) asks for the tool, the tool answers, the model replies in text. The model is
``langchain_zp.ZPChatOpenAI``, a ``ChatOpenAI`` whose every call first takes a lease
on the budget, so when the agents' calls do not all fit they wait their turn in this process instead
of being preempted on the server. LangChain's ``max_retries`` is 0: zp's retry policy is the only one.

Run it against a simulator started in this process (no setup at all)::

    python examples/langchain_agent.py --sim

or against a running server (``zp-client sim --port 8000 --profile tiny`` or a real vLLM)::

    python examples/langchain_agent.py --base-url http://127.0.0.1:8000/v1 --limit-blocks 60

Needs ``pip install -e . -e integrations/langchain`` (from the zp-client clone).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.tools import tool

from langchain_zp import ZPChatOpenAI
from zp_client import LocalBudget
from zp_client.budget.base import Budget

DEFAULT_BASE_URL = os.environ.get("ZP_BASE_URL", "http://127.0.0.1:8000/v1")
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Perth", "Quito", "Sofia"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI base URL (env ZP_BASE_URL)")
    p.add_argument("--sim", action="store_true", help="start a simulated vLLM server in this process")
    p.add_argument("--speedup", type=float, default=5.0, help="with --sim: virtual seconds per real second")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--agents", type=int, default=8, help="agents running at once")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each model call")
    # Each call's lease is about (prompt ~250 tokens with the tool schema + max_tokens) / 16 = 24 blocks:
    # 60 lets two calls run at a time, so most of the agents' calls wait for a lease.
    p.add_argument("--limit-blocks", type=int, default=60, help="the budget's limit in KV blocks")
    return p.parse_args()


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"sunny and 21 C in {city}"


async def watch(budget: Budget, peaks: dict[str, int], stop: asyncio.Event) -> None:
    """Sample the budget every 10 ms and remember the peaks (status() is a cheap snapshot)."""
    while not stop.is_set():
        s = await budget.status()
        peaks["used"] = max(peaks["used"], s.used)
        peaks["waiters"] = max(peaks["waiters"], sum(c.waiters for c in s.waiters.values()))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.01)


async def model_name(base_url: str) -> str:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused") as c:
        return (await c.models.list()).data[0].id


async def run(args: argparse.Namespace, base_url: str) -> int:
    # strict: every call reserves its prompt + max_tokens, so the limit below is a hard cap on the server
    budget = LocalBudget(limit_blocks=args.limit_blocks, policy="strict")
    llm = ZPChatOpenAI(
        model=args.model or await model_name(base_url),
        base_url=base_url,
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),
        max_tokens=args.max_tokens,  # what makes the lease a true upper bound
        budget=budget,
    )
    agent_model = llm.bind_tools([get_weather])

    async def agent(i: int) -> int:
        """One agent: model -> tool -> model, until the model answers in text. Returns its model calls."""
        city = CITIES[i % len(CITIES)]
        messages: list[BaseMessage] = [HumanMessage(f"Agent {i}: what is the weather in {city}?")]
        for calls in range(1, 6):
            reply = await agent_model.ainvoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                return calls
            for call in reply.tool_calls:
                messages.append(await get_weather.ainvoke(call))  # a ToolMessage answering the call
        return 0  # never answered: counted as not completed

    peaks = {"used": 0, "waiters": 0}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(budget, peaks, stop))
    t0 = time.perf_counter()
    calls = await asyncio.gather(*(agent(i) for i in range(args.agents)))
    elapsed = time.perf_counter() - t0
    stop.set()
    await watcher

    status = await budget.status()
    done = sum(1 for c in calls if c)
    print(f"completed {done}/{args.agents} agents in {elapsed:.2f} s, {sum(calls)} model calls")
    print(f"peak reserved {peaks['used']} of {status.limit} blocks, peak waiters {peaks['waiters']}")
    print(f"budget after the agents: used={status.used} leases={status.leases} "
          f"waiters={sum(c.waiters for c in status.waiters.values())}")
    return 0 if done == args.agents and status.used == 0 else 1


async def main() -> int:
    args = parse_args()
    if not args.sim:
        return await run(args, args.base_url)
    from zp_sim.server import SimServer  # needs zp-sim: pip install -e sim/

    async with SimServer(profile="tiny", speedup=args.speedup) as server:
        print(f"simulator: {server.num_gpu_blocks} KV blocks at {server.base_url}")
        rc = await run(args, server.base_url)
        print(f"simulator preemptions: {server.stats()['engine']['preemptions_total']}")
        return rc


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
