"""Strict vs elastic LocalBudget on the simulator: an agentic-like burst through ``wrap(openai.AsyncOpenAI)``.

Not a test: prints, per setup, the server's preemptions, client-side TTFT (p50/p99, virtual seconds, the
zp queue included), makespan and peak KV usage, side by side on the same workload and seed.

Setups: ``none`` (the bare SDK), ``strict`` (LocalBudget, prompt + max_tokens reserved), ``elastic``
(projected peak, forecaster learned online from usage, cold start on the default prior) and ``oracle``
(elastic fed each request's true length by a ``SimOracleForecaster``: the limit a forecaster can reach).

Workload: ``--conversations`` agent conversations arriving over ``--window`` virtual seconds, sharing a
~``--preamble``-token system prompt; each turn's prompt grows by the previous answer and a tool result;
``max_tokens`` is large (default 1024) while true outputs are lognormal (median 150): the tension the
elastic policy addresses. True lengths go to the simulator as ``sim_output_tokens``.

    .venv/bin/python benchmarks/elastic_local.py                      # defaults (tiny profile)
    .venv/bin/python benchmarks/elastic_local.py --seeds 1 2 3 --setups strict elastic
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import openai

from zp_client import wrap
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.forecast import LengthForecaster, Prior
from zp_client.server import suggest_limit_blocks
from zp_sim.server import SimServer
from zp_storm.oracle import SimOracleForecaster

WORDS = ("alpha beta gamma delta tool file read write patch test run shell diff search code path value "
         "error trace module class function return import result output input state index").split()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))


def lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0, sigma)))))


@dataclass
class Turn:
    delay_s: float
    user: str
    true_len: int


def workload(seed: int, conversations: int, window: float, preamble: int, turns: tuple[int, int],
             max_tokens: int) -> tuple[str, list[tuple[float, list[Turn]]]]:
    rng = random.Random(seed)
    system = "You are a coding agent. " + text(rng, preamble)
    convs = []
    for _ in range(conversations):
        start = rng.uniform(0, window)
        n = rng.randint(*turns)
        ts = [Turn(0.0 if k == 0 else lognormal(rng, 0.5, 0.6, 0, 5) * 1.0 + rng.random(),
                   text(rng, lognormal(rng, 150 if k == 0 else 200, 0.7, 20, 800)),
                   lognormal(rng, 150, 1.0, 1, max_tokens))
              for k in range(n)]
        convs.append((start, ts))
    return system, convs


async def run_setup(setup: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    system, convs = workload(seed, args.conversations, args.window, args.preamble, (args.turns_lo, args.turns_hi),
                             args.max_tokens)
    async with SimServer(profile=args.profile, speedup=args.speedup, seed=seed,
                         num_gpu_blocks=args.blocks) as server:
        limit = suggest_limit_blocks(server.num_gpu_blocks, args.headroom)
        base = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600)
        budget = None
        if setup == "none":
            client = base
        else:
            budget = LocalBudget(limit, 16, policy="strict" if setup == "strict" else "elastic")
            fc = LengthForecaster(q=args.q, prior=Prior(weight=args.prior_weight)) if setup != "strict" else None
            client = wrap(base, budget=budget, settings=Settings(estimator=args.estimator, deadline_s=None),
                          forecaster=SimOracleForecaster(fc) if setup == "oracle" else fc)
        ttfts: list[float] = []
        errors = 0
        t0 = server.clock()

        async def conversation(start: float, turns: list[Turn]) -> None:
            nonlocal errors
            await asyncio.sleep(start / args.speedup)
            msgs: list[dict[str, str]] = [{"role": "system", "content": system}]
            for turn in turns:
                await asyncio.sleep(turn.delay_s / args.speedup)
                msgs.append({"role": "user", "content": turn.user})
                sent = server.clock()
                first = None
                out = 0
                try:
                    stream = await client.chat.completions.create(
                        model=server.model, messages=msgs, max_tokens=args.max_tokens, stream=True,
                        extra_body={"sim_output_tokens": turn.true_len})
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = server.clock()
                        out += 1
                except openai.OpenAIError:
                    errors += 1
                    return
                if first is not None:
                    ttfts.append(first - sent)
                msgs.append({"role": "assistant", "content": text(random.Random(out), turn.true_len)})

        wall = time.monotonic()
        await asyncio.gather(*(conversation(s, t) for s, t in convs))
        makespan = server.clock() - t0
        st = server.stats()
        peak_kv = max((u for _, u, *_ in server.timeline), default=0.0)
        await base.close()
        ttfts.sort()
        return {
            "setup": setup, "seed": seed, "requests": len(ttfts), "errors": errors,
            "preemptions": st["engine"]["preemptions_total"],
            "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan"),
            "makespan": makespan, "peak_kv": peak_kv, "lag": st["max_lag_s"],
            "wall": time.monotonic() - wall, "limit": limit,
        }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", nargs="+", default=["none", "strict", "elastic", "oracle"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1])
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--blocks", type=int, default=None, help="num_gpu_blocks (default: the profile's)")
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--headroom", type=float, default=0.95)
    ap.add_argument("--conversations", type=int, default=14)
    ap.add_argument("--window", type=float, default=3.0, help="virtual seconds over which conversations start")
    ap.add_argument("--preamble", type=int, default=700)
    ap.add_argument("--turns-lo", type=int, default=2)
    ap.add_argument("--turns-hi", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--estimator", default="heuristic",
                    help="prompt estimator: heuristic (over-reserves, slack) or server (exact /tokenize)")
    ap.add_argument("--q", type=float, default=0.9, help="the forecaster's quantile")
    ap.add_argument("--prior-weight", type=float, default=20.0, help="pseudo-observations of the cold-start prior")
    args = ap.parse_args()
    print(f"{'setup':8} {'seed':>4} {'reqs':>4} {'err':>3} {'preempt':>7} {'ttft_p50':>8} {'ttft_p99':>8} "
          f"{'makespan':>8} {'peak_kv':>7} {'lag':>5} {'wall':>5}")
    for seed in args.seeds:
        for setup in args.setups:
            r = await run_setup(setup, seed, args)
            print(f"{r['setup']:8} {r['seed']:>4} {r['requests']:>4} {r['errors']:>3} {r['preemptions']:>7} "
                  f"{r['ttft_p50']:>8.3f} {r['ttft_p99']:>8.3f} {r['makespan']:>8.2f} {r['peak_kv']:>7.2f} "
                  f"{r['lag']:>5.2f} {r['wall']:>5.1f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
