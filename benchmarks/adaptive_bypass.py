"""The adaptive limit against bypass traffic on the simulator, in virtual time (exactly reproducible).

Not a test. A LocalBudget sized from the simulator's pool (``floor((N - 1) x 0.95)``) runs an
:class:`~zp_client.adaptive.AdaptiveLimit`; ``--streams`` long streams go straight to the simulator (not
through the budget) and hold ``--prompt`` + up to ``--max-tokens`` tokens each. The script prints, per
poll, the limit, the bypass the controller measured and the rule that fired, then how many polls after
the bypass ended the limit was back within 5% of the calibrated one, next to the stated bound
(:func:`zp_client.adaptive.recovery_polls`).

    .venv/bin/python benchmarks/adaptive_bypass.py
    .venv/bin/python benchmarks/adaptive_bypass.py --streams 3 --prompt 800 --max-tokens 1200 --poll 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx

from zp_client import LocalBudget
from zp_client.adaptive import AdaptiveLimit, recovery_polls
from zp_client.clock import LoopClock
from zp_client.server import suggest_limit_blocks
from zp_client.testing import MemoryTransport, run_virtual
from zp_sim.server import SimServer


async def _bypass(http: httpx.AsyncClient, i: int, prompt: int, max_tokens: int) -> None:
    body = {"model": "sim-llama", "prompt": [11 + i] * prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_bytes():
            pass


async def _run(a: argparse.Namespace) -> dict[str, Any]:
    server = SimServer(profile=a.profile, num_gpu_blocks=a.blocks)
    cal = suggest_limit_blocks(server.num_gpu_blocks)
    async with server.in_memory():
        http = httpx.AsyncClient(transport=MemoryTransport(server.app), base_url=server.url)
        budget = LocalBudget(cal, clock=LoopClock())
        ctl = AdaptiveLimit(budget, server.url, calibrated_limit=cal, http_client=http,
                            poll_interval_s=a.poll, cooldown_s=a.cooldown, bypass_hold_s=a.hold)
        async with ctl:
            await asyncio.sleep(a.quiet)
            started = len(ctl.decisions)
            await asyncio.gather(*(_bypass(http, i, a.prompt, a.max_tokens) for i in range(a.streams)))
            ended = len(ctl.decisions)
            while budget.limit < 0.95 * cal:
                await asyncio.sleep(a.poll)
            back = len(ctl.decisions) - ended
            await asyncio.sleep(a.quiet)
        await http.aclose()
    rows = [{"t": round(d.at, 3), "limit": d.limit, "new": d.new_limit, "bypass": d.bypass_blocks,
             "ceiling": d.ceiling, "reason": d.reason} for d in ctl.decisions]
    return {"calibrated": cal, "floor": ctl.floor, "bypass_polls": ended - started, "recovery_polls": back,
            "bound": recovery_polls(poll_interval_s=a.poll, cooldown_s=a.cooldown, bypass_hold_s=a.hold),
            "min_limit": min(r["new"] for r in rows if r["new"] is not None),
            "max_bypass": max(r["bypass"] or 0 for r in rows), "pollers": server.pollers()["pollers"],
            "polls": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="tiny")
    p.add_argument("--blocks", type=int, default=None, help="num_gpu_blocks (default: the profile's)")
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--prompt", type=int, default=1200, help="prompt tokens per bypass stream")
    p.add_argument("--max-tokens", type=int, default=1500, help="output tokens per bypass stream")
    p.add_argument("--poll", type=float, default=1.0, help="poll_interval_s")
    p.add_argument("--cooldown", type=float, default=5.0, help="cooldown_s")
    p.add_argument("--hold", type=float, default=5.0, help="bypass_hold_s")
    p.add_argument("--quiet", type=float, default=3.0, help="virtual seconds without bypass before and after")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    a = p.parse_args()
    out = run_virtual(_run(a))
    for r in out["polls"]:
        print(f"t={r['t']:8.2f}  limit {r['limit']!s:>5} -> {r['new']!s:>5}  bypass {r['bypass']!s:>5}  "
              f"ceiling {r['ceiling']!s:>5}  {r['reason'] or ''}")
    print(f"calibrated {out['calibrated']}, floor {out['floor']}; max bypass {out['max_bypass']} blocks, "
          f"min limit {out['min_limit']}; {out['bypass_polls']} polls during the bypass; back within 5% "
          f"{out['recovery_polls']} polls after it ended (bound {out['bound']}); pollers seen by the "
          f"simulator: {len(out['pollers'])}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
