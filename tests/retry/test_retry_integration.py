"""The retry policy inside the admission transport, against real HTTP on loopback.

* lease accounting during backoff: while a retry sleeps it holds no blocks, and when it comes back it
  is admitted ahead of a request of its class that arrived during the sleep (it kept its ticket);
* one retry loop: a wrapped openai client (whose own default is 2 retries) makes exactly
  ``max_attempts`` attempts at the server;
* amplification: against the simulator with its gateway timeout on, the plain openai client with its
  defaults sends > 1.5 attempts per logical request, zp-client stays within its retry budget's rule
  (1 + (ratio x answered + floor x window per window) / requests) and surfaces no more errors. Both are
  printed. These storms run on the virtual clock (the simulator in memory), so they do not depend on
  how busy the machine is.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import openai
import pytest
from _asgi_server import ThreadedApp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zp_client import wrap
from zp_client.budget.local import LocalBudget
from zp_client.retry import LocalRetryBudget, RetryPolicy
from zp_client.clock import LoopClock
from zp_client.testing import memory_transport, run_virtual

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]

MAX_MODEL_LEN = 4096


class _Upstream(ThreadedApp):
    """A minimal OpenAI-shaped server: records arrivals; ``user`` picks the behaviour.

    ``flaky-*``: 503 (Retry-After 0) on its first attempt, then OK. ``down-*``: always 503. Else OK.
    """

    def __init__(self) -> None:
        self.arrivals: list[str] = []
        self._seen: dict[str, int] = {}
        super().__init__(Starlette(routes=[Route("/v1/chat/completions", self._chat, methods=["POST"])]))

    async def _chat(self, request: Request) -> Response:
        body = json.loads(await request.body())
        user = str(body.get("user", ""))
        self._seen[user] = self._seen.get(user, 0) + 1
        self.arrivals.append(f"{user}#{self._seen[user]}")
        if user.startswith("down-") or (user.startswith("flaky-") and self._seen[user] == 1):
            return JSONResponse(
                {"error": {"message": "overloaded", "type": "ServiceUnavailable", "param": None, "code": 503}},
                status_code=503,
                headers={"retry-after": "0"},
            )
        return JSONResponse(
            {
                "id": "x", "object": "chat.completion", "created": 0, "model": body.get("model", "m"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
            }
        )


@pytest.fixture
def upstream() -> Iterator[_Upstream]:
    with _Upstream() as server:
        yield server


async def _wait_for_waiters(budget: LocalBudget, n: int) -> None:
    while sum(c.waiters for c in (await budget.status()).waiters.values()) < n:
        await anyio.sleep(0.005)


def test_lease_released_while_sleeping_and_retry_keeps_its_place(upstream: _Upstream) -> None:
    max_tokens = 1000
    limit = 100  # a request here needs ~64 blocks (1000 output tokens + a tiny prompt): one fits, two never
    budget = LocalBudget(limit_blocks=limit, policy="strict")  # strict: the bound is what fits
    seen_while_sleeping: list[Any] = []

    async def main() -> None:
        with anyio.fail_after(60):  # a broken ordering would leave tasks waiting forever
            await _scenario()

    async def _scenario() -> None:
        async with anyio.create_task_group() as tg:
            client = openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x")

            async def call(user: str) -> None:
                await zp.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=max_tokens, user=user
                )

            class Observing(RetryPolicy):
                async def sleep(self, seconds: float) -> None:
                    seen_while_sleeping.append(await budget.status())
                    # Someone else takes the whole budget, and request B of the same class arrives
                    # while A sleeps: B must queue (waiters == 1) ...
                    blocker = await budget.acquire(limit)
                    tg.start_soon(call, "later-B")
                    await _wait_for_waiters(budget, 1)

                    async def release_when_both_wait() -> None:
                        await _wait_for_waiters(budget, 2)  # ... and so must A's retry
                        await blocker.release()

                    tg.start_soon(release_when_both_wait)

            zp = wrap(client, budget, retry=Observing(budget=None), max_model_len=MAX_MODEL_LEN)
            await call("flaky-A")

    anyio.run(main)
    assert len(seen_while_sleeping) == 1
    status = seen_while_sleeping[0]
    assert status.leases == 0 and status.used == 0  # no blocks held during backoff
    # A's retry went ahead of B, which arrived while A slept (it kept its original ticket).
    assert upstream.arrivals == ["flaky-A#1", "flaky-A#2", "later-B#1"]


def test_only_zp_retry_loop_runs_in_a_wrapped_openai_client(upstream: _Upstream) -> None:
    client = openai.OpenAI(base_url=upstream.base_url, api_key="x")  # openai's default: max_retries=2
    zp = wrap(client, LocalBudget(limit_blocks=10_000), retry=RetryPolicy(max_attempts=3, budget=None),
              max_model_len=MAX_MODEL_LEN)
    with pytest.raises(openai.APIStatusError) as info:
        zp.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                   user="down-1")
    assert info.value.status_code == 503
    assert upstream.arrivals == ["down-1#1", "down-1#2", "down-1#3"]  # 3, not 3 x (1 + 2)


# --- amplification against the simulator -----------------------------------------------------------
# On the virtual clock (zp_client.testing): the simulator served in memory on a VirtualTimeLoop, so the
# storm is the same on a quiet and on a starved machine (on the real clock, a starved loop sent the 40
# requests so slowly that the gateway never timed out: no retry at all, "it proves nothing"). The loop's
# clock plays the wall clock: the simulator runs SPEEDUP times faster than it, as it did on the real
# clock, and openai's backoff, zp's retry policy and the retry budget's window read it.

REQUESTS = 40
GATEWAY_TIMEOUT_S = 3.0  # virtual seconds
SPEEDUP = 5.0


class _CountingRetryBudget(LocalRetryBudget):
    """The default retry budget, counting every deposit and every retry it granted over the whole run
    (``snapshot()`` covers the current window only: a run longer than ``window_s`` drops the first ones)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__(clock=clock)  # the defaults: 0.5 x answered requests + 0.5/s x 20 s
        self.deposits = 0
        self.retries = 0

    def record_request(self) -> None:
        super().record_request()
        self.deposits += 1

    def try_spend(self) -> bool:
        granted = super().try_spend()
        self.retries += granted
        return granted


async def _storm(kind: str, overcommit: int = 1) -> tuple[int, int, float, tuple[int, int]]:
    """Send REQUESTS large chat requests at once; return (attempts at server, errors, seconds, budget):
    seconds on the loop's clock, budget = (deposits, retries) over the whole run."""
    loop = asyncio.get_running_loop()
    sim = SimServer(profile="tiny", speedup=SPEEDUP, gateway_timeout_s=GATEWAY_TIMEOUT_S, seed=7)
    async with sim.in_memory():
        http = openai.DefaultAsyncHttpxClient(transport=memory_transport(sim.app))
        client: Any = openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", http_client=http)  # its defaults
        retry_budget = _CountingRetryBudget(clock=loop.time)
        if kind == "zp":
            # The simulated gateway aborts the upstream request on timeout, so 504s are safe to retry.
            # stream_upstream off: the storm is about retrying the 504s of calls sent non-streamed.
            client = wrap(client, LocalBudget(limit_blocks=overcommit * (sim.num_gpu_blocks - 1),
                                              clock=LoopClock()),
                          retry=RetryPolicy(retry_on_504=True, budget=retry_budget), stream_upstream=False)
        errors = 0

        async def one(i: int) -> None:
            nonlocal errors
            try:
                # Distinct prompts (no shared prefix) of ~900 tokens, 300 output tokens each.
                await client.chat.completions.create(
                    model=sim.model, messages=[{"role": "user", "content": f"request {i} " + "word " * 900}],
                    max_tokens=512, extra_body={"sim_output_tokens": 300},
                )
            except openai.OpenAIError:
                errors += 1

        started = loop.time()
        async with anyio.create_task_group() as tg:
            for i in range(REQUESTS):
                tg.start_soon(one, i)
        duration = loop.time() - started
        await client.close()
        return int(sim.stats()["requests"]), errors, duration, (retry_budget.deposits, retry_budget.retries)


def _run_storm(kind: str, overcommit: int = 1) -> tuple[int, int, float, tuple[int, int]]:
    state = random.getstate()
    random.seed(7)  # openai's backoff jitter: the same storm on every run
    try:
        return run_virtual(_storm(kind, overcommit))
    finally:
        random.setstate(state)  # other tests' randomness stays theirs


@pytest.mark.needs_sim
@pytest.mark.slow
def test_amplification_against_the_simulator_gateway_timeout() -> None:
    plain_attempts, plain_errors, plain_s, _ = _run_storm("plain")
    zp_attempts, zp_errors, zp_s, (deposits, retries) = _run_storm("zp")
    plain_amp = plain_attempts / REQUESTS
    zp_amp = zp_attempts / REQUESTS
    # the retry budget's rule over the run: retries <= ratio x answered + floor x window, per window
    rb = LocalRetryBudget()
    windows = max(1, math.ceil(zp_s / rb.window_s))
    bound = 1 + (rb.ratio * deposits + rb.floor_per_s * rb.window_s * windows) / REQUESTS
    print(
        f"\nplain openai: {plain_attempts} attempts / {REQUESTS} requests = amplification {plain_amp:.2f}, "
        f"{plain_errors} errors, {plain_s:.2f} s"
        f"\nzp-client:    {zp_attempts} attempts / {REQUESTS} requests = amplification {zp_amp:.2f}, "
        f"{zp_errors} errors, {zp_s:.2f} s, retries {retries}, bound {bound:.2f}"
    )
    assert plain_amp > 1.5, "the scenario did not overload the plain client; it proves nothing"
    assert deposits == REQUESTS - zp_errors  # every answered request earned, no failure did
    assert zp_amp <= bound
    assert zp_errors <= plain_errors


@pytest.mark.needs_sim
@pytest.mark.slow
def test_retry_budget_caps_amplification_even_when_admission_overcommits() -> None:
    # A budget limit of 3x the server's pool lets the server queue, so the gateway answers 504 and
    # zp-client does retry: only the retry budget stands between the storm and the server.
    attempts, errors, seconds, (deposits, retries) = _run_storm("zp", 3)
    # What the sliding window guarantees: per window, retries <= ratio x answered + floor x window.
    rb = LocalRetryBudget()
    windows = max(1, math.ceil(seconds / rb.window_s))
    cap = rb.ratio * deposits + rb.floor_per_s * rb.window_s * windows
    print(
        f"\nzp-client, limit 3x pool: {attempts} attempts / {REQUESTS} requests = amplification "
        f"{attempts / REQUESTS:.2f}, {retries} retries (cap {cap:g}), {errors} errors, {seconds:.2f} s"
    )
    assert retries > 0, "the scenario produced no retryable failures; it proves nothing"
    assert deposits == REQUESTS - errors  # every answered request earned, no failure did
    assert retries <= cap
    assert attempts <= REQUESTS + retries  # every attempt beyond the first was granted by the budget
