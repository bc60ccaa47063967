"""zp's CPU per streamed chunk with vLLM's continuous usage, against counting events, side by side.

Run:  .venv/bin/python benchmarks/bench_continuous_usage.py [--chunks 2000] [--rounds 7]

An elastic stream's chunks go through the transport's scanner (``zp_client._sse.Scanner``), the code
every streamed byte passes, with a real ``LocalBudget(policy="elastic")`` lease receiving the progress
reports (one per new block). Three variants of the same vLLM-shaped stream (role chunk, one token per
content chunk, finish chunk), measured interleaved round by round:

* ``events``: no usage in the chunks; growth counted one token per event (what zp did before, and still
  does on servers without continuous usage);
* ``continuous, kept``: every chunk carries ``usage`` (prompt / completion so far), read with regexes; the
  caller asked for it, so the bytes pass unchanged;
* ``continuous, stripped``: the same, but the usage is removed from each chunk the caller reads (the
  default: the caller did not ask for it).

Printed: median microseconds per chunk of each, and each ratio to ``events``. A chunk of vLLM takes
milliseconds of GPU time per step; this is the client's share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from zp_client._admission.plan import Plan as _Plan
from zp_client._sse import Scanner as _Scanner
from zp_client.budget.local import LocalBudget

PROMPT = 3000


def _stream(chunks: int, continuous: bool) -> list[bytes]:
    def chunk(delta: dict[str, Any], done: int, finish: str | None = None) -> bytes:
        obj: dict[str, Any] = {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1,
                               "model": "meta-llama/Llama-3.1-70B-Instruct",
                               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if continuous:
            obj["usage"] = {"prompt_tokens": PROMPT, "total_tokens": PROMPT + done, "completion_tokens": done}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    out = [chunk({"role": "assistant", "content": ""}, 0)]
    out += [chunk({"content": " word"}, i + 1) for i in range(chunks)]
    out.append(chunk({}, chunks, "length"))
    return out


def _plan(continuous: bool, strip: bool, chunks: int) -> _Plan:
    return _Plan(content=b"", headers=[], blocks=(PROMPT + chunks) // 16 + 8, held=PROMPT // 16 + 1, priority=0,
                 deadline=None, strip_usage=False, stream=True, prompt_tokens=PROMPT + 300, n=1, estimate=None,
                 meta={"prompt_tokens": PROMPT + 300, "forecast_tokens": chunks + 100, "streaming": True},
                 route="m", max_tokens=chunks + 100, forecast=chunks + 100, chat=True,
                 continuous=continuous, strip_continuous=strip)


async def _one(budget: LocalBudget, events: list[bytes], continuous: bool, strip: bool, chunks: int) -> float:
    plan = _plan(continuous, strip, chunks)
    lease = await budget.acquire(plan.blocks, held=plan.held, meta=dict(plan.meta or {}))
    try:
        sc = _Scanner(plan, 16, lease.bound, lease, True)
        t0 = time.perf_counter()
        for ev in events:
            sc.feed(ev)
        dt = time.perf_counter() - t0
        if continuous:
            assert sc.counts == (PROMPT, chunks), sc.counts
        return dt / len(events) * 1e6
    finally:
        await lease.release()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    budget = LocalBudget(1_000_000, 16, policy="elastic")
    plain, cont = _stream(args.chunks, False), _stream(args.chunks, True)
    variants = {"events": (plain, False, False), "continuous, kept": (cont, True, False),
                "continuous, stripped": (cont, True, True)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, (evs, c, s) in variants.items():
            times[name].append(await _one(budget, evs, c, s, args.chunks))
    base = statistics.median(times["events"])
    print(f"{args.chunks} chunks per stream, {args.rounds} rounds (median us per chunk)")
    for name in variants:
        med = statistics.median(times[name])
        print(f"  {name:22s} {med:7.2f} us   {med / base:5.2f}x events")


if __name__ == "__main__":
    asyncio.run(main())
