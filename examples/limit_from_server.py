"""Size the budget from the server itself: ``num_gpu_blocks`` from vLLM's ``/metrics``.

vLLM exports its KV cache configuration as the labels of the ``vllm:cache_config_info`` gauge, among
them ``num_gpu_blocks`` (the pool, including one null block) and ``block_size``. ``ServerInfo`` reads
and parses ``/metrics``; ``suggest_limit_blocks(N, headroom)`` turns the pool into a budget limit,
``floor((N - 1) * headroom)``, leaving room for traffic the budget does not see.

The program then sends a burst through a budget of that size and reads ``/metrics`` again to count the
preemptions the burst caused, and says what the number means.

Zero is what a well-sized budget aims at, not a guarantee: the budget admits on estimates. The first
requests of a burst are sized before any answer has calibrated the prompt estimate to the server's
tokenizer, and under the default ``elastic`` policy on forecast output lengths too; traffic from clients
without zp is not seen at all. Against the in-process simulator, the simulator counts each prompt as
615 tokens while the uncalibrated estimate reserves 572 (cl100k_base plus its error bound), so every first
lease's bound is about 3 blocks short of its true peak. Under ``elastic`` a lease's projection follows the
server's exact count from its first token on (it may end at ``exact prompt + max_tokens``, beyond its
bound; docs/elastic.md, "The cap"); before that, this burst preempted once in some runs, when a tenth
lease was admitted next to nine projected to end early. Under ``strict`` the bounds alone are reserved:
a lower ``--headroom`` leaves more room for such errors.

Run::

    python examples/limit_from_server.py --sim
    python examples/limit_from_server.py --base-url http://127.0.0.1:8000/v1 --headroom 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import httpx

from zp_client import AsyncClient, LocalBudget
from zp_client.server import ServerInfo, resolve_url, suggest_limit_blocks

DEFAULT_BASE_URL = os.environ.get("ZP_BASE_URL", "http://127.0.0.1:8000/v1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI base URL (env ZP_BASE_URL)")
    p.add_argument("--sim", action="store_true", help="start a simulated vLLM server in this process")
    p.add_argument("--speedup", type=float, default=5.0, help="with --sim: virtual seconds per real second")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--headroom", type=float, default=0.95, help="fraction of the usable pool to budget")
    p.add_argument("--requests", type=int, default=16, help="calls in the burst")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each call")
    p.add_argument("--compare", action="store_true",
                   help="first send the same burst WITHOUT a budget (a storm: not against production!)")
    return p.parse_args()


def server_info(http: httpx.AsyncClient, base_url: str) -> ServerInfo:
    """A ServerInfo that fetches with ``http``.

    ServerInfo does no HTTP itself; it calls ``fetch(method, path, json_body)``, where a path with a
    leading slash (``/metrics``) is relative to the server root (``base_url`` minus ``/v1``).
    """

    async def fetch(method: str, path: str, body: Any) -> tuple[int, bytes]:
        resp = await http.request(method, resolve_url(base_url, path), json=body)
        return resp.status_code, resp.content

    return ServerInfo(fetch=fetch)


def request_body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Task {i}: " + "plan the next step " * 120}],
        "max_tokens": max_tokens,
        # the simulator's output-length knob (ignored by real vLLM): long answers, real pressure
        "ignore_eos": True,
    }


async def unbudgeted_burst(http: httpx.AsyncClient, info: ServerInfo, base_url: str, model: str,
                           args: argparse.Namespace) -> float:
    """The same burst straight to the server, no admission: how many preemptions does it cause?"""
    before = await info.metrics()
    url = resolve_url(base_url, "chat/completions")
    replies = await asyncio.gather(*(http.post(url, json=request_body(model, i, args.max_tokens), timeout=600)
                                     for i in range(args.requests)))
    for r in replies:
        r.raise_for_status()
    after = await info.metrics()
    return (after.num_preemptions_total or 0) - (before.num_preemptions_total or 0)


async def run(args: argparse.Namespace, base_url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        info = server_info(http, base_url)
        if args.compare:
            models = (await http.get(resolve_url(base_url, "models"))).json()
            model = args.model or models["data"][0]["id"]
            print(f"without a budget: server preemptions during the burst: "
                  f"{await unbudgeted_burst(http, info, base_url, model, args):g}")
        before = await info.metrics()
        if before.num_gpu_blocks is None:
            print("the server's /metrics has no vllm:cache_config_info with num_gpu_blocks; "
                  "set the limit by hand")
            return 2
        limit = suggest_limit_blocks(before.num_gpu_blocks, args.headroom)
        print(f"server pool: num_gpu_blocks={before.num_gpu_blocks} block_size={before.block_size} "
              f"-> limit_blocks={limit} (headroom {args.headroom:g})")

        # The block size must match the server's, or the bounds are computed in the wrong unit.
        budget = LocalBudget(limit_blocks=limit, block_size=before.block_size or 16)
        async with AsyncClient(base_url=base_url, budget=budget) as client:
            model = args.model or (await client.models.list()).data[0].id

            async def ask(i: int) -> None:
                body = request_body(model, i, args.max_tokens)
                await client.chat.completions.create(
                    model=model, messages=body["messages"], max_tokens=body["max_tokens"],
                    extra_body={"ignore_eos": body["ignore_eos"]},
                )

            await asyncio.gather(*(ask(i) for i in range(args.requests)))

        after = await info.metrics()
        status = await budget.status()
        preempted = (after.num_preemptions_total or 0) - (before.num_preemptions_total or 0)
        print(f"with the budget: completed {args.requests} requests; server preemptions during the burst: "
              f"{preempted:g}; budget used={status.used} leases={status.leases}")
        if preempted:
            print(f"the server preempted {preempted:g} time(s) all the same: the budget admits on estimates "
                  "(prompts before the first answers calibrate them, forecast output lengths under the "
                  "elastic policy) and does not see other clients; see this program's docstring")
        else:
            print("the server preempted nothing")
        return 0 if status.used == 0 else 1


async def main() -> int:
    args = parse_args()
    if not args.sim:
        return await run(args, args.base_url)
    from zp_sim.server import SimServer

    async with SimServer(profile="tiny", speedup=args.speedup) as server:
        return await run(args, server.base_url)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
