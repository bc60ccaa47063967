"""How fast the simulated server runs: engine steps per real second, over HTTP, with the tiny profile.

    .venv/bin/python benchmarks/sim_server_speed.py [--requests 32] [--tokens 400] [--stream]

Prints steps/s of the bare engine (no HTTP) and of the server loop while N concurrent requests stream
(or not), with speedup high enough that the loop never sleeps (so this is its ceiling), plus the
highest speedup the tiny profile could sustain at that load (virtual step time x steps/s).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

from zp_sim.engine import Engine, EngineConfig
from zp_sim.profiles import get_profile
from zp_sim.server import SimServer


def bare_engine(n: int, prompt: int, tokens: int) -> tuple[float, float, int]:
    eng = Engine(EngineConfig.from_profile(get_profile("tiny")))
    for i in range(n):
        eng.add_request(f"r{i}", [(i * 997 + j) % 120000 for j in range(prompt)], tokens)
    t0 = time.perf_counter()
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    dt = time.perf_counter() - t0
    return steps / dt, eng.now / steps, steps


async def over_http(n: int, prompt: int, tokens: int, stream: bool) -> tuple[float, float, dict]:
    async with SimServer(profile="tiny", speedup=1e6) as server:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)

        async def one(i: int) -> None:
            ids = [(i * 991 + j) % 120000 for j in range(prompt)]
            if stream:
                s = await client.completions.create(model=server.model, prompt=ids, max_tokens=tokens,
                                                    stream=True, extra_body={"ignore_eos": True})
                async for _ in s:
                    pass
            else:
                await client.completions.create(model=server.model, prompt=ids, max_tokens=tokens,
                                                extra_body={"ignore_eos": True})

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        dt = time.perf_counter() - t0
        st = server.stats()
        await client.close()
        steps = st["engine"]["steps"]
        # the server's own count: steps per real second while it had work (client overhead in this
        # process is included, as it would be in the storm benchmark)
        span = server.timeline[-1][0] - server.timeline[0][0]
        return st["steps_per_real_s"], span / max(1, steps - 1), st


def tokenizer_speed() -> None:
    from zp_sim import tokenizer as tok

    words = [tok.decode([i]).strip() or "x" for i in range(1, 3000)]
    text = " ".join(words[(i * 7) % len(words)] + ("," if i % 13 == 0 else "") for i in range(14000))
    tok._MEMO.clear()
    t0 = time.perf_counter()
    n = len(tok.encode(text))
    t1 = time.perf_counter()
    tok.encode(text)
    t2 = time.perf_counter()
    print(f"tokenizer: {n} tokens, cold {1e3 * (t1 - t0):.1f} ms, warm {1e3 * (t2 - t1):.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--stream", action="store_true")
    a = ap.parse_args()
    tokenizer_speed()
    sps, vstep, steps = bare_engine(a.requests, a.prompt, a.tokens)
    print(f"bare engine: {steps} steps, {sps:,.0f} steps/s real; mean virtual step {vstep * 1e3:.2f} ms "
          f"-> sustainable speedup ~{sps * vstep:,.0f}x")
    for stream in ([a.stream] if a.stream else [False, True]):
        sps, vstep, st = asyncio.run(over_http(a.requests, a.prompt, a.tokens, stream))
        kind = "stream" if stream else "non-stream"
        print(f"server ({kind}, {a.requests} concurrent x {a.tokens} tokens): "
              f"{st['engine']['steps']} steps, {sps:,.0f} steps/s real; "
              f"mean virtual step {vstep * 1e3:.2f} ms -> sustainable speedup ~{sps * vstep:,.0f}x "
              f"(engine compute {st['real_step_compute_s']:.2f} s)")


if __name__ == "__main__":
    main()
