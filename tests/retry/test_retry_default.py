"""Every front end retries by default: the policy from ``Settings.retry_*`` on the KV budget's own
retry budget (one per KV budget; fleet-wide, in Redis, for a RedisBudget). ``retry=False`` opts out.

Real HTTP on loopback against a small OpenAI-shaped server, through the real openai SDK (both majors:
the module is ``openai_compat``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest
from _retry_upstream import RETRY_AFTER_MS, RetryUpstream

from zp_client import AsyncClient, Client, LocalBudget, RetryBudgetExhausted, Settings, wrap
from zp_client.retry import LocalRetryBudget, RedisRetryBudget, testing

pytestmark = pytest.mark.openai_compat

MAX_MODEL_LEN = 4096


@pytest.fixture
def upstream() -> Iterator[RetryUpstream]:
    with RetryUpstream() as server:
        yield server


def _ask(user: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "user": user}


@pytest.mark.slow
def test_wrapped_async_client_retries_429_after_retry_after_and_releases_the_lease_meanwhile(
        upstream: RetryUpstream) -> None:
    budget = LocalBudget(limit_blocks=1_000)
    seen_while_backing_off: list[Any] = []

    async def main() -> None:
        with anyio.fail_after(30):
            async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x") as original:
                await scenario(wrap(original, budget, max_model_len=MAX_MODEL_LEN))

    async def scenario(zp: Any) -> None:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while len(upstream.arrivals) < 1:
                    await anyio.sleep(0.005)
                await anyio.sleep(RETRY_AFTER_MS / 3000)  # well inside the Retry-After wait
                seen_while_backing_off.append(await budget.status())

            tg.start_soon(watch)
            reply = await zp.chat.completions.create(**_ask("429-a"))
        assert reply.choices[0].message.content == "ok"

    anyio.run(main)
    assert upstream.users() == ["429-a#1", "429-a#2"]
    (_, t0), (_, t1) = upstream.arrivals
    assert t1 - t0 >= RETRY_AFTER_MS / 1000 * 0.95  # waited what the server asked (retry-after-ms)
    assert seen_while_backing_off[0].leases == 0 and seen_while_backing_off[0].used == 0
    status = anyio.run(budget.status)
    assert status.leases == 0


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.slow
def test_wrapped_client_retries_503_but_not_400_or_500(upstream: RetryUpstream, flavour: str) -> None:
    budget = LocalBudget(limit_blocks=1_000)
    if flavour == "sync":
        zp_sync = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), budget, max_model_len=MAX_MODEL_LEN)

        def call(user: str) -> Any:
            return zp_sync.chat.completions.create(**_ask(user))
    else:
        def call(user: str) -> Any:
            async def one() -> Any:  # one client per event loop
                async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x") as original:
                    zp = wrap(original, budget, max_model_len=MAX_MODEL_LEN)
                    return await zp.chat.completions.create(**_ask(user))
            return anyio.run(one)

    with testing():  # skip the jittered backoff sleeps (503 carries no Retry-After)
        assert call("503-a").choices[0].message.content == "ok"
        for status in (400, 500):
            with pytest.raises(openai.APIStatusError) as info:
                call(f"{status}-a")
            assert info.value.status_code == status
    assert upstream.users() == ["503-a#1", "503-a#2", "400-a#1", "500-a#1"]
    assert anyio.run(budget.status).leases == 0


def test_retry_false_opts_out(upstream: RetryUpstream) -> None:
    zp = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), LocalBudget(limit_blocks=1_000),
              retry=False, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(openai.APIStatusError) as info:
        zp.chat.completions.create(**_ask("503-a"))
    assert info.value.status_code == 503
    assert upstream.users() == ["503-a#1"]


@pytest.mark.slow
def test_drop_in_clients_retry_by_default(upstream: RetryUpstream) -> None:
    budget = LocalBudget(limit_blocks=1_000)
    settings = Settings(max_model_len=MAX_MODEL_LEN)

    async def main() -> None:
        async with AsyncClient(base_url=upstream.base_url, api_key="x", budget=budget, settings=settings) as c:
            await c.chat.completions.create(**_ask("503-async"))

    with testing():
        anyio.run(main)
        with Client(base_url=upstream.base_url, api_key="x", budget=budget, settings=settings) as c:
            c.chat.completions.create(**_ask("503-sync"))
    assert upstream.users() == ["503-async#1", "503-async#2", "503-sync#1", "503-sync#2"]


@pytest.mark.slow
def test_one_retry_budget_per_kv_budget_shared_by_every_front_end(upstream: RetryUpstream) -> None:
    budget = LocalBudget(limit_blocks=1_000)
    # ratio 0 and floor 0.1/s over 10 s: every front end on this KV budget together may retry once.
    settings = Settings(retry_budget_ratio=0.0, retry_budget_floor_per_s=0.1, retry_budget_window_s=10.0,
                        max_model_len=MAX_MODEL_LEN)
    shared = budget.retry_budget(settings)
    assert isinstance(shared, LocalRetryBudget)
    assert budget.retry_budget() is shared and budget.retry_budget(settings) is shared
    assert LocalBudget(limit_blocks=1_000).retry_budget() is not shared
    wrapped = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), budget, settings=settings)
    with testing():
        wrapped.chat.completions.create(**_ask("503-a"))  # spends the one retry
        with pytest.raises(RetryBudgetExhausted), \
                Client(base_url=upstream.base_url, api_key="x", budget=budget, settings=settings) as drop_in:
            drop_in.chat.completions.create(**_ask("503-b"))
    assert upstream.users() == ["503-a#1", "503-a#2", "503-b#1"]


@pytest.mark.redis
@pytest.mark.slow
def test_two_wrapped_clients_on_one_redis_budget_draw_from_one_redis_retry_budget(
        upstream: RetryUpstream, redis_url: str, redis_prefix: str) -> None:
    from zp_client import RedisBudget

    # ratio 0 and floor 0.1/s over 10 s: the whole fleet may retry once in the window.
    settings = Settings(retry_budget_ratio=0.0, retry_budget_floor_per_s=0.1, retry_budget_window_s=10.0,
                        max_model_len=MAX_MODEL_LEN)
    # recovery_s=0: a budget new to this Redis admits at once (no holders of an earlier epoch to wait for)
    budget = RedisBudget(redis_url, redis_prefix, limit_blocks=1_000, recovery_s=0)
    second_process = RedisBudget(redis_url, redis_prefix, limit_blocks=1_000, recovery_s=0)  # another process
    try:
        assert isinstance(budget.retry_budget(settings), RedisRetryBudget)
        a = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), budget, settings=settings)
        b = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), budget, settings=settings)
        c = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), second_process, settings=settings)
        with testing():
            a.chat.completions.create(**_ask("503-a"))  # spends the fleet's one retry
            with pytest.raises(RetryBudgetExhausted):
                b.chat.completions.create(**_ask("503-b"))
            with pytest.raises(RetryBudgetExhausted):
                c.chat.completions.create(**_ask("503-c"))
        assert upstream.users() == ["503-a#1", "503-a#2", "503-b#1", "503-c#1"]
    finally:
        budget.close_sync()
        second_process.close_sync()


class _FakeClock:
    """Virtual time: sleeping advances it at once."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def sleep_sync(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_the_default_policy_sleeps_on_the_transports_clock(flavour: str) -> None:
    import httpx

    from zp_client import AdmissionTransport, AsyncAdmissionTransport

    seen: list[int] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/chat/completions"):
            return httpx.Response(404)  # a server without /metrics: the pool check reads nothing
        seen.append(1)
        if len(seen) == 1:
            return httpx.Response(429, headers={"retry-after": "7"}, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})

    clock = _FakeClock()
    settings = Settings(max_model_len=MAX_MODEL_LEN, stream_upstream=False)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    started = time.monotonic()
    if flavour == "sync":
        t = AdmissionTransport(httpx.MockTransport(upstream), budget=LocalBudget(limit_blocks=100),
                               settings=settings, clock=clock)
        with httpx.Client(transport=t, base_url="http://up/v1") as c:
            assert c.post("/chat/completions", json=body).status_code == 200
    else:
        async def main() -> None:
            t = AsyncAdmissionTransport(httpx.MockTransport(upstream), budget=LocalBudget(limit_blocks=100),
                                        settings=settings, clock=clock)
            async with httpx.AsyncClient(transport=t, base_url="http://up/v1") as c:
                assert (await c.post("/chat/completions", json=body)).status_code == 200
        anyio.run(main)
    assert clock.slept == [7.0] and clock.now == 1007.0  # the server's Retry-After, in virtual time
    assert time.monotonic() - started < 5.0  # not 7 real seconds
    assert len(seen) == 2


@pytest.mark.slow
def test_wrapped_client_retries_529_after_retry_after(upstream: RetryUpstream) -> None:
    """529 (an overload answer, e.g. NVIDIA Dynamo with every worker busy) is retried like 503."""
    budget = LocalBudget(limit_blocks=1_000)
    zp = wrap(openai.OpenAI(base_url=upstream.base_url, api_key="x"), budget, max_model_len=MAX_MODEL_LEN)
    assert zp.chat.completions.create(**_ask("529-a")).choices[0].message.content == "ok"
    assert upstream.users() == ["529-a#1", "529-a#2"]
    (_, t0), (_, t1) = upstream.arrivals
    assert t1 - t0 >= RETRY_AFTER_MS / 1000 * 0.95  # waited what the server asked (retry-after-ms)
    assert anyio.run(budget.status).leases == 0
