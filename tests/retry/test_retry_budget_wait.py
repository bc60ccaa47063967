"""A retry the spent retry budget refuses waits for it (holding no lease) instead of failing at once,
bounded by the request's deadline or ``budget_wait_s``; answers earn retries, failures do not; connect
errors are not charged. Policy-level tests run on the virtual clock (zp_client.testing: no real
sleeping); the end-to-end ones go through wrap()'d openai against a real loopback upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx
import openai
import pytest
from _retry_upstream import RetryUpstream

from zp_client import LocalBudget, RetryBudgetExhausted, Settings, ZPError, wrap
from zp_client.clock import LoopClock
from zp_client.retry import LocalRetryBudget, RetryDetails, RetryPolicy, RetryState
from zp_client.testing import run_virtual


def _policy(**kw: Any) -> tuple[RetryPolicy, LocalRetryBudget]:
    """A policy and its local retry budget, both on the running (virtual) loop's clock."""
    clock = LoopClock()
    ratio = kw.pop("ratio", 0.0)
    floor = kw.pop("floor_per_s", 0.1)
    budget = LocalRetryBudget(ratio=ratio, floor_per_s=floor, window_s=10.0, clock=clock.monotonic)
    return RetryPolicy(budget=budget, clock=clock, **kw), budget


async def _failed(policy: RetryPolicy, state: RetryState, *, status: int | None = 503,
                  error: BaseException | None = None, remaining_s: float | None = None) -> Any:
    """decide_async as the transports call it (waiting allowed) after an attempt with this outcome."""
    return await policy.decide_async(state, status=status, headers={}, error=error, delivered=False,
                                     remaining_s=remaining_s, wait_for_budget=True)


def test_a_refused_retry_waits_until_the_window_frees_a_retry() -> None:
    async def main() -> tuple[float, int, bool, int]:
        policy, budget = _policy()  # floor 0.1/s x 10 s: one retry per window, nothing earned
        first = await _failed(policy, policy.new_request())
        assert first.retry and not first.budget_owed  # the window's one retry
        state = policy.new_request()
        d = await _failed(policy, state)
        assert d.retry and d.budget_owed and "waiting for the retry budget" in d.reason
        assert budget.snapshot() == (0, 1)  # owed, not spent
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await policy.wait_for_budget_async(state, remaining_s=None)
        return loop.time() - t0, state.retries, state.owed is None, budget.snapshot()[1]

    waited, retries, cleared, spent = run_virtual(main())
    # the first retry's bucket ages out of the 10 s window; asked again about once a bucket (1 s)
    assert 9.0 <= waited <= 11.0, waited
    assert retries == 1 and cleared and spent == 1  # the first aged out; the waiter's took its place


def test_answers_earn_retries_and_a_waiting_retry_takes_one_as_it_arrives() -> None:
    async def main() -> float:
        policy, budget = _policy(ratio=0.5, floor_per_s=0.0)
        state = policy.new_request()
        assert (await _failed(policy, state)).budget_owed  # nothing answered yet: nothing earned
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def answers() -> None:
            await asyncio.sleep(3.0)
            for _ in range(2):  # two answered requests x 0.5 = one retry
                d = await _failed(policy, policy.new_request(), status=200)
                assert not d.retry

        async with anyio.create_task_group() as tg:
            tg.start_soon(answers)
            await policy.wait_for_budget_async(state, remaining_s=None)
        assert budget.snapshot() == (2, 1)
        return loop.time() - t0

    waited = run_virtual(main())
    assert 3.0 <= waited <= 4.1, waited  # granted at the first poll after the answers


def test_failures_earn_nothing_and_successes_are_deposited_once() -> None:
    async def main() -> tuple[int, int]:
        policy, budget = _policy(ratio=0.5, floor_per_s=0.0, max_attempts=1)
        for status in (200, 201, 400, 404):  # answered on purpose: deposits
            await _failed(policy, policy.new_request(), status=status)
        for status in (500, 503, 429, 504):  # failures and overload answers: none
            await _failed(policy, policy.new_request(), status=status)
        await _failed(policy, policy.new_request(), status=None, error=httpx.ReadTimeout("slow"))
        return budget.snapshot()

    assert run_virtual(main()) == (4, 0)


def test_the_wait_is_bounded_by_budget_wait_s_then_fails_with_the_reason() -> None:
    gave_up: list[RetryDetails] = []

    async def main() -> tuple[float, BaseException]:
        policy, _ = _policy(floor_per_s=0.0, budget_wait_s=5.0, on_give_up=[gave_up.append])
        state = policy.new_request()
        original = httpx.RemoteProtocolError("peer closed")
        assert (await _failed(policy, state, status=None, error=original)).budget_owed
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(RetryBudgetExhausted) as info:
            await policy.wait_for_budget_async(state, remaining_s=None)
        assert info.value.__cause__ is original
        return loop.time() - t0, info.value

    waited, err = run_virtual(main())
    assert 5.0 <= waited <= 5.01, waited
    assert "stayed spent for 5 s" in str(err) and "retry_budget_wait_s (5 s) ran out" in str(err)
    assert isinstance(err, ValueError) and isinstance(err, ZPError)
    assert gave_up and gave_up[-1].give_up_error is err


def test_the_deadline_bounds_the_wait_instead_of_budget_wait_s() -> None:
    async def main() -> tuple[float, str]:
        policy, _ = _policy(floor_per_s=0.0, budget_wait_s=30.0, min_attempt_s=0.5)
        state = policy.new_request()
        assert (await _failed(policy, state, remaining_s=3.0)).budget_owed
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(RetryBudgetExhausted) as info:
            await policy.wait_for_budget_async(state, remaining_s=3.0)
        return loop.time() - t0, str(info.value)

    waited, msg = run_virtual(main())
    assert 2.5 <= waited <= 2.51, waited  # what the deadline leaves minus one attempt's min_attempt_s
    assert "deadline left no room" in msg


def test_cancelling_a_waiting_retry_spends_nothing_and_leaves_nothing_owed() -> None:
    async def main() -> tuple[float, tuple[int, int], Any]:
        policy, budget = _policy(floor_per_s=0.0)
        state = policy.new_request()
        assert (await _failed(policy, state)).budget_owed
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with anyio.move_on_after(2.0) as scope:
            await policy.wait_for_budget_async(state, remaining_s=None)
        assert scope.cancelled_caught
        return loop.time() - t0, budget.snapshot(), state.owed

    waited, snap, owed = run_virtual(main())
    assert waited == pytest.approx(2.0)
    assert snap == (0, 0) and owed is None


def test_sync_wait_matches_the_async_one_in_testing_mode() -> None:
    from zp_client.retry import testing

    budget = LocalRetryBudget(ratio=0.0, floor_per_s=0.0, window_s=10.0)
    policy = RetryPolicy(budget=budget, budget_wait_s=4.0)
    state = policy.new_request()
    d = policy.decide(state, status=503, headers={}, error=None, delivered=False, remaining_s=None,
                      wait_for_budget=True)
    assert d.budget_owed
    with testing() as rec, pytest.raises(RetryBudgetExhausted):
        policy.wait_for_budget(state, remaining_s=None)
    assert sum(rec.sleeps) == pytest.approx(4.0)  # the skipped polls add up to the bound
    assert all(s <= 1.0 for s in rec.sleeps)


def test_connect_errors_are_not_charged_to_the_retry_budget() -> None:
    async def main() -> tuple[bool, bool, tuple[int, int]]:
        policy, budget = _policy(floor_per_s=0.0)  # nothing would be granted
        d = await _failed(policy, policy.new_request(), status=None, error=httpx.ConnectError("refused"))
        return d.retry, d.budget_owed, budget.snapshot()

    assert run_virtual(main()) == (True, False, (0, 0))


def test_settings_default_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings()
    assert (s.retry_budget_ratio, s.retry_budget_floor_per_s, s.retry_budget_window_s,
            s.retry_budget_wait_s) == (0.5, 0.5, 20.0, 30.0)
    monkeypatch.setenv("ZP_RETRY_BUDGET_WAIT_S", "7.5")
    assert RetryPolicy.from_settings(Settings()).budget_wait_s == 7.5


# -- end to end: wrap()'d openai, a real loopback upstream --------------------------------------------

@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _ask(user: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "user": user}


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
@pytest.mark.openai_compat
async def test_through_wrap_a_waiting_retry_holds_no_lease_then_goes_through() -> None:
    kv = LocalBudget(limit_blocks=100)
    # one retry per 1 s window (floor 1/s, nothing earned): the second 503 must wait about a second
    retry_budget = LocalRetryBudget(ratio=0.0, floor_per_s=1.0, window_s=1.0)
    seen_while_waiting: list[Any] = []

    class Watching(RetryPolicy):
        async def wait_for_budget_async(self, state: RetryState, *, remaining_s: float | None) -> None:
            seen_while_waiting.append(await kv.status())
            await super().wait_for_budget_async(state, remaining_s=remaining_s)

    with RetryUpstream() as upstream:
        async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x") as original:
            client = wrap(original, kv, retry=Watching(budget=retry_budget, backoff_initial_s=0.01),
                          max_model_len=4096, stream_upstream=False)
            a = await client.chat.completions.create(**_ask("503-a"))
            b = await client.chat.completions.create(**_ask("503-b"))
        users = upstream.users()
    assert a.choices[0].message.content == b.choices[0].message.content == "ok"
    assert users == ["503-a#1", "503-a#2", "503-b#1", "503-b#2"]  # b waited, then retried: no failure
    assert len(seen_while_waiting) == 1
    status = seen_while_waiting[0]
    assert status.used == 0 and status.leases == 0  # no lease held while waiting for the budget
    assert sum(c.waiters for c in status.waiters.values()) == 0  # and not in the KV line either
    assert (await kv.status()).used == 0


@pytest.mark.anyio
@pytest.mark.openai_compat
async def test_through_wrap_an_exhausted_wait_is_a_valueerror_the_caller_can_catch() -> None:
    kv = LocalBudget(limit_blocks=100)
    policy = RetryPolicy(budget=LocalRetryBudget(ratio=0.0, floor_per_s=0.0), budget_wait_s=0.2,
                         backoff_initial_s=0.01)
    with RetryUpstream() as upstream:
        async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x") as original:
            client = wrap(original, kv, retry=policy, max_model_len=4096, stream_upstream=False)
            with pytest.raises(RetryBudgetExhausted) as info:
                await client.chat.completions.create(**_ask("503-c"))
        users = upstream.users()
    assert users == ["503-c#1"]  # one attempt, no retry without the budget's grant
    err = info.value
    assert isinstance(err, openai.OpenAIError) and isinstance(err, ValueError)
    assert "stayed spent" in str(err)
    assert (await kv.status()).used == 0


@pytest.mark.redis
@pytest.mark.slow
def test_a_waiting_retry_on_a_redis_budget_takes_the_retry_another_process_earned(
    redis_url: str, redis_prefix: str
) -> None:
    from zp_client.budget.redis import RedisRetryBudget

    async def main() -> tuple[int, tuple[int, int, float]]:
        mine = RedisRetryBudget(redis_prefix, url=redis_url, ratio=1.0, floor_per_s=0.0, window_s=10.0,
                                flush_interval_s=0)
        other = RedisRetryBudget(redis_prefix, url=redis_url, ratio=1.0, floor_per_s=0.0, window_s=10.0,
                                 flush_interval_s=0)  # the same name: another process's view
        policy = RetryPolicy(budget=mine, budget_wait_s=20.0)
        try:
            state = policy.new_request()
            d = await _failed(policy, state)
            assert d.budget_owed  # nothing answered anywhere yet

            async def elsewhere() -> None:
                await anyio.sleep(0.3)
                await RetryPolicy(budget=other).decide_async(  # an answer there earns one retry
                    RetryPolicy(budget=other).new_request(), status=200, headers={}, error=None,
                    delivered=False, remaining_s=None)

            async with anyio.create_task_group() as tg:
                tg.start_soon(elsewhere)
                await policy.wait_for_budget_async(state, remaining_s=None)
            return state.retries, await mine.snapshot_async()
        finally:
            await mine.aclose()
            await other.aclose()

    retries, (requests, spent, _) = anyio.run(main)
    assert retries == 1 and (requests, spent) == (1, 1)


@pytest.mark.openai_compat
def test_through_a_wrapped_sync_client_the_wait_blocks_then_fails_with_the_reason() -> None:
    kv = LocalBudget(limit_blocks=100)
    policy = RetryPolicy(budget=LocalRetryBudget(ratio=0.0, floor_per_s=0.0), budget_wait_s=0.2,
                         backoff_initial_s=0.01)
    with RetryUpstream() as upstream, openai.OpenAI(base_url=upstream.base_url, api_key="x") as original:
        client = wrap(original, kv, retry=policy, max_model_len=4096, stream_upstream=False)
        with pytest.raises(RetryBudgetExhausted) as info:
            client.chat.completions.create(**_ask("503-d"))
        users = upstream.users()
    assert users == ["503-d#1"]
    assert "retry_budget_wait_s (0.2 s) ran out" in str(info.value)
    assert isinstance(info.value, openai.OpenAIError)


@pytest.mark.redis
def test_local_and_redis_retry_budgets_grant_the_same_sequence(redis_url: str, redis_prefix: str) -> None:
    from zp_client.budget.redis import RedisRetryBudget

    # a 60 s window: the whole sequence falls in it, whatever the machine's speed
    local = LocalRetryBudget(ratio=0.5, floor_per_s=0.05, window_s=60.0)
    shared = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0.5, floor_per_s=0.05, window_s=60.0,
                              flush_interval_s=0)
    steps = ["spend"] * 4 + ["answer"] * 3 + ["spend"] * 3 + ["answer"] + ["spend"] * 2
    try:
        seen = []
        for budget in (local, shared):
            out = []
            for step in steps:
                if step == "answer":
                    budget.record_request()
                else:
                    out.append(budget.try_spend())
            seen.append(out)
        assert seen[0] == seen[1] == [True, True, True, False, True, False, False, True, False]
        assert shared.snapshot()[:2] == local.snapshot() == (4, 5)
    finally:
        shared.close()
