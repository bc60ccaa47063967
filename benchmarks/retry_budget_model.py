"""The retry budget's defaults against issue 31's two cases, on virtual time (seconds to run, no server).

Drives zp's real RetryPolicy and LocalRetryBudget the way the admission transport does (decide after each
attempt, the backoff sleep, then waiting for the budget when it owes the retry), with a modelled upstream:

* ``storm``: 200 closed-loop callers, every attempt answered 503 (after 10 ms) for 60 s; amplification =
  attempts / logical requests started in those 60 s. One budget for all callers, as the fleet's one
  RedisRetryBudget is for 3 processes.
* ``agents``: 30 runs of 2 sequential calls each; the first attempt of every third call is answered 503
  (after 50 ms), every other attempt succeeds after 1 s of generation. Compared with plain openai's own
  retry (openai's backoff, 0.5 s x 2**n less up to 25 %, no budget).

``--before`` models the previous rule (every request deposits 0.1 retry, floor 1/s, a refused retry fails
at once). Run: ``python benchmarks/retry_budget_model.py`` (add ``--before`` for the old rule).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from dataclasses import dataclass

from zp_client.clock import LoopClock
from zp_client.errors import RetryBudgetExhausted
from zp_client.retry import LocalRetryBudget, RetryPolicy
from zp_client.testing import run_virtual


@dataclass
class Tally:
    requests: int = 0
    attempts: int = 0
    failed: int = 0
    failed_runs: int = 0


def _policy(before: bool) -> RetryPolicy:
    clock = LoopClock()
    if before:
        budget = LocalRetryBudget(ratio=0.1, floor_per_s=1.0, window_s=10.0, clock=clock.monotonic)
    else:
        budget = LocalRetryBudget(clock=clock.monotonic)  # the defaults
    return RetryPolicy(budget=budget, clock=clock)


async def _call(policy: RetryPolicy, tally: Tally, outcome: object, before: bool) -> bool:
    """One logical request through the transport's loop; ``outcome(attempt)`` -> (seconds, status)."""
    tally.requests += 1
    state = policy.new_request()
    if before:
        policy.budget.record_request()  # type: ignore[union-attr]  # the old rule: every request deposits
    attempt = 0
    while True:
        seconds, status = outcome(attempt)  # type: ignore[operator]
        tally.attempts += 1
        await asyncio.sleep(seconds)
        d = await policy.decide_async(state, status=status, headers={}, error=None, delivered=False,
                                      remaining_s=None, wait_for_budget=not before)
        if status < 400:  # answered (decide deposited it)
            return True
        if not d.retry:
            tally.failed += 1
            return False
        await asyncio.sleep(d.delay_s)
        if d.budget_owed:
            try:
                await policy.wait_for_budget_async(state, remaining_s=None)
            except RetryBudgetExhausted:
                tally.failed += 1
                return False
        attempt += 1


def storm(before: bool, callers: int = 200, seconds: float = 60.0) -> Tally:
    async def main() -> Tally:
        policy, tally = _policy(before), Tally()
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds

        async def caller() -> None:
            while loop.time() < end:
                await _call(policy, tally, lambda a: (0.01, 503), before)

        tasks = [asyncio.ensure_future(caller()) for _ in range(callers)]
        await asyncio.sleep(seconds)
        counted = Tally(tally.requests, tally.attempts, tally.failed)  # what the 60 s saw
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return counted

    return run_virtual(main())


def agents(before: bool | None, runs: int = 30) -> tuple[float, Tally]:
    """Wall time of all runs and the tally; ``before=None``: plain openai (its own retry, no budget)."""
    async def main() -> tuple[float, Tally]:
        policy, tally = _policy(bool(before)), Tally()
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def run(r: int) -> None:
            for k in range(2):
                failing = (2 * r + k) % 3 == 0

                def outcome(attempt: int, failing: bool = failing) -> tuple[float, int]:
                    return (0.05, 503) if failing and attempt == 0 else (1.0, 200)

                if before is None:  # plain openai: max_retries=2, its backoff, no budget
                    for attempt in range(3):
                        seconds, status = outcome(attempt)
                        tally.attempts += 1
                        await asyncio.sleep(seconds)
                        if status < 400:
                            break
                        await asyncio.sleep(min(0.5 * 2 ** attempt, 8.0) * (1 - 0.25 * random.random()))
                    tally.requests += 1
                elif not await _call(policy, tally, outcome, before):
                    tally.failed_runs += 1
                    return  # the run fails

        await asyncio.gather(*(run(r) for r in range(runs)))
        return loop.time() - t0, tally

    return run_virtual(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", action="store_true", help="the previous rule, for comparison")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    random.seed(args.seed)
    rule = "before (0.1 x requests + 1/s x 10 s, fail at once)" if args.before else \
        "now (0.5 x answered + 0.5/s x 20 s, wait up to 30 s)"
    print(f"rule: {rule}")
    s = storm(args.before)
    print(f"storm: {s.requests} requests, {s.attempts} attempts in 60 s of 503s, 200 callers: "
          f"amplification {s.attempts / s.requests:.3f}, {s.failed} failed")
    wall, a = agents(args.before)
    plain_wall, _ = agents(None)
    print(f"agents: {a.attempts} attempts for {a.requests} calls, {a.failed} calls failed "
          f"({a.failed_runs} of 30 runs), wall {wall:.2f} s vs plain openai {plain_wall:.2f} s "
          f"({wall / plain_wall:.2f}x)")


if __name__ == "__main__":
    main()
