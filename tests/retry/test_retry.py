"""The retry policy's rules, one behaviour per test (zp_client.retry).

Pure decisions are checked by calling ``RetryPolicy.decide`` directly; the fleet-wide budget runs
against the real Redis of the ``redis_url`` fixture, under this test's own ``redis_prefix`` name.
"""

from __future__ import annotations

import email.utils
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import redis

from zp_client.config import Settings
from zp_client.errors import (
    AdmissionTimeout,
    ConfigurationError,
    DeadlineExceeded,
    RetryBudgetExhausted,
)
from zp_client.retry import (
    LocalRetryBudget,
    RedisRetryBudget,
    RetryDecision,
    RetryDetails,
    RetryPolicy,
    RetryState,
    is_testing,
    parse_retry_after,
    retry_budget_for,
    set_testing,
    testing,
)

# The openai 2.x environment (make test-openai2) has no httpx2; these tests belong to the main one.
httpx2 = pytest.importorskip("httpx2")


def decide(policy: RetryPolicy, state: RetryState | None = None, **kw: Any) -> RetryDecision:
    args: dict[str, Any] = {"status": None, "headers": None, "error": None, "delivered": False, "remaining_s": None}
    args.update(kw)
    return policy.decide(state if state is not None else policy.new_request(), **args)


def unlimited(**kw: Any) -> RetryPolicy:
    """A policy without a retry budget, so a rule under test is the only thing deciding."""
    kw.setdefault("budget", None)
    return RetryPolicy(**kw)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- Retry-After ------------------------------------------------------------------------------------


def test_retry_after_ms_is_the_delay() -> None:
    d = decide(unlimited(), status=503, headers={"retry-after-ms": "1500"})
    assert d.retry and d.delay_s == pytest.approx(1.5)
    assert "retry-after" in d.reason


@pytest.mark.parametrize(("value", "expected"), [("2", 2.0), ("0.25", 0.25), ("0", 0.0), (" 7 ", 7.0)])
def test_retry_after_seconds_is_the_delay(value: str, expected: float) -> None:
    d = decide(unlimited(), status=429, headers={"retry-after": value})
    assert d.retry and d.delay_s == pytest.approx(expected)


def test_retry_after_ms_wins_over_seconds() -> None:
    assert parse_retry_after({"retry-after": "9", "retry-after-ms": "250"}) == pytest.approx(0.25)


def test_retry_after_http_date_is_relative_to_now() -> None:
    now = 1_700_000_000.0
    header = email.utils.formatdate(now + 12, usegmt=True)
    assert parse_retry_after({"Retry-After": header}, now=now) == pytest.approx(12.0)


def test_retry_after_http_date_in_decide_uses_the_wall_clock() -> None:
    header = email.utils.formatdate(time.time() + 6, usegmt=True)  # whole seconds: 5 < delay <= 6
    d = decide(unlimited(), status=503, headers={"retry-after": header})
    assert d.retry and 4.0 < d.delay_s <= 6.0


def test_retry_after_date_in_the_past_means_now() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after({"retry-after": email.utils.formatdate(now - 60, usegmt=True)}, now=now) == 0.0


@pytest.mark.parametrize("value", ["soon", "-3", "nan", ""])
def test_invalid_retry_after_is_ignored_and_backoff_used(value: str) -> None:
    assert parse_retry_after({"retry-after": value}) is None
    policy = unlimited(backoff_initial_s=0.5)
    d = decide(policy, status=503, headers={"retry-after": value})
    assert d.retry and 0.0 <= d.delay_s <= 0.5 and "retry-after" not in d.reason


def test_retry_after_header_names_are_case_insensitive() -> None:
    assert parse_retry_after({"Retry-After-Ms": "100"}) == pytest.approx(0.1)
    assert parse_retry_after(httpx.Headers({"RETRY-AFTER": "3"})) == 3.0
    assert parse_retry_after(httpx2.Headers({"Retry-After": "4"})) == 4.0


def test_retry_after_up_to_the_cap_is_honoured() -> None:
    d = decide(unlimited(retry_after_cap_s=30), status=429, headers={"retry-after": "30"})
    assert d.retry and d.delay_s == 30.0


def test_retry_after_over_the_cap_is_not_shortened_but_given_up() -> None:
    gave_up: list[RetryDetails] = []
    policy = unlimited(retry_after_cap_s=30, on_give_up=[gave_up.append])
    d = decide(policy, status=429, headers={"retry-after": "31"})
    assert not d.retry and d.error is None  # the 429 passes through to the caller unchanged
    assert "exceeds cap" in d.reason
    assert len(gave_up) == 1 and gave_up[0].status == 429


def test_infinite_retry_after_is_over_any_cap() -> None:
    d = decide(unlimited(retry_after_cap_s=1e9), status=503, headers={"retry-after": "inf"})
    assert not d.retry and "exceeds cap" in d.reason


def test_retry_after_on_a_connect_error_is_not_consulted() -> None:
    # Errors carry no headers; a stray headers mapping must not change the delay source.
    d = decide(unlimited(backoff_initial_s=0.5), error=httpx.ConnectError("refused"), headers={"retry-after": "20"})
    assert d.retry and d.delay_s <= 0.5


# --- x-should-retry ---------------------------------------------------------------------------------


def test_x_should_retry_true_retries_a_status_not_retried_otherwise() -> None:
    assert decide(unlimited(), status=400, headers={"x-should-retry": "true"}).retry
    assert decide(unlimited(retry_on_504=False), status=504, headers={"X-Should-Retry": "true"}).retry


def test_x_should_retry_false_stops_a_status_retried_otherwise() -> None:
    d = decide(unlimited(), status=503, headers={"x-should-retry": "false"})
    assert not d.retry and d.error is None and "x-should-retry: false" in d.reason


def test_x_should_retry_does_not_lift_the_limits() -> None:
    headers = {"x-should-retry": "true"}
    assert not decide(unlimited(), status=503, headers=headers, delivered=True).retry
    assert not decide(unlimited(max_attempts=1), status=503, headers=headers).retry
    assert not decide(unlimited(), status=200, headers=headers).retry


def test_x_should_retry_other_values_are_ignored() -> None:
    assert decide(unlimited(), status=503, headers={"x-should-retry": "maybe"}).retry
    assert not decide(unlimited(), status=400, headers={"x-should-retry": "1"}).retry


# --- which outcomes are retried ---------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 502, 503, 529])
def test_default_statuses_are_retried(status: int) -> None:
    d = decide(unlimited(), status=status, headers={})
    assert d.retry and d.reason == f"status {status}"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 408, 409, 413, 422, 499])
def test_other_4xx_are_never_retried(status: int) -> None:
    d = decide(unlimited(retry_on_504=True), status=status, headers={"retry-after": "1"})
    assert not d.retry and d.error is None


@pytest.mark.parametrize("status", [200, 201, 304, 500, 501])
def test_success_and_other_5xx_are_not_retried_by_default(status: int) -> None:
    assert not decide(unlimited(), status=status, headers={}).retry


def test_504_is_not_retried_by_default() -> None:
    d = decide(unlimited(), status=504, headers={})
    assert not d.retry and "upstream may still be running" in d.reason


def test_504_is_retried_when_the_upstream_aborts() -> None:
    assert decide(unlimited(retry_on_504=True), status=504, headers={}).retry


@pytest.mark.parametrize("module", [httpx, httpx2], ids=["httpx", "httpx2"])
@pytest.mark.parametrize("name", ["ConnectError", "ConnectTimeout", "RemoteProtocolError", "WriteError"])
def test_connection_errors_are_retried(module: Any, name: str) -> None:
    d = decide(unlimited(), error=getattr(module, name)("boom"))
    assert d.retry and d.reason.startswith("connect error")


@pytest.mark.parametrize("module", [httpx, httpx2], ids=["httpx", "httpx2"])
@pytest.mark.parametrize("name", ["ReadTimeout", "ReadError"])
def test_read_timeouts_only_when_the_upstream_aborts(module: Any, name: str) -> None:
    err = getattr(module, name)("slow")
    assert not decide(unlimited(), error=err).retry
    assert decide(unlimited(retry_on_504=True), error=err).retry
    assert decide(unlimited(retry_read_timeouts=True), error=err).retry
    assert not decide(unlimited(retry_on_504=True, retry_read_timeouts=False), error=err).retry


@pytest.mark.parametrize(
    "error", [ValueError("x"), httpx.PoolTimeout("pool"), AdmissionTimeout("queued too long"), RuntimeError()]
)
def test_other_errors_are_not_retried(error: BaseException) -> None:
    d = decide(unlimited(), error=error)
    assert not d.retry and d.error is None


def test_httpx2_is_never_imported_by_the_policy() -> None:
    code = (
        "import sys, httpx\n"
        "from zp_client.retry import RetryPolicy\n"
        "p = RetryPolicy(budget=None)\n"
        "d = p.decide(p.new_request(), status=None, headers=None, error=httpx.ConnectError('x'),"
        " delivered=False, remaining_s=None)\n"
        "assert d.retry, d\n"
        "assert 'httpx2' not in sys.modules, 'httpx2 was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- delivered bytes, attempts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "outcome", [{"status": 503, "headers": {}}, {"error": httpx.RemoteProtocolError("peer closed mid-body")}]
)
def test_nothing_is_retried_after_bytes_reached_the_caller(outcome: dict[str, Any]) -> None:
    budget = LocalRetryBudget(ratio=0, floor_per_s=1, window_s=10)
    policy = RetryPolicy(budget=budget)
    d = decide(policy, delivered=True, **outcome)
    assert not d.retry and d.error is None and "delivered" in d.reason
    assert budget.snapshot() == (0, 0)  # a failure earns nothing (only answers deposit), no retry was spent


def test_max_attempts_bounds_the_attempts() -> None:
    gave_up: list[RetryDetails] = []
    policy = unlimited(max_attempts=3, on_give_up=[gave_up.append])
    state = policy.new_request()
    decisions = [decide(policy, state, status=503, headers={}) for _ in range(3)]
    assert [d.retry for d in decisions] == [True, True, False]
    assert decisions[-1].error is None and "max attempts (3)" in decisions[-1].reason
    assert state.attempts == 3 and state.retries == 2
    assert [g.attempt for g in gave_up] == [3]


def test_max_attempts_one_never_retries() -> None:
    assert not decide(unlimited(max_attempts=1), status=503, headers={}).retry


# --- deadline ---------------------------------------------------------------------------------------


def test_deadline_that_cannot_fit_wait_plus_attempt_fails_with_deadline_exceeded() -> None:
    budget = LocalRetryBudget()
    policy = RetryPolicy(budget=budget, min_attempt_s=0.5)
    original = httpx.ConnectError("refused")
    d = decide(policy, status=503, headers={"retry-after": "2"}, remaining_s=2.4)
    assert not d.retry and isinstance(d.error, DeadlineExceeded) and "deadline" in d.reason
    d2 = decide(policy, error=original, remaining_s=0.2)  # backoff >= 0, plus 0.5 s > 0.2 s
    assert isinstance(d2.error, DeadlineExceeded) and d2.error.__cause__ is original
    assert budget.snapshot()[1] == 0  # a retry that could not happen spent nothing


def test_deadline_with_room_for_wait_plus_attempt_retries() -> None:
    d = decide(unlimited(min_attempt_s=0.5), status=503, headers={"retry-after": "2"}, remaining_s=2.6)
    assert d.retry and d.delay_s == 2.0


def test_exhausted_deadline_never_retries() -> None:
    for remaining in (0.0, -1.0):
        d = decide(unlimited(min_attempt_s=0.0), status=503, headers={"retry-after": "0"}, remaining_s=remaining)
        assert not d.retry and isinstance(d.error, DeadlineExceeded)


def test_deadline_exceeded_is_an_admission_timeout() -> None:
    d = decide(unlimited(), status=503, headers={"retry-after": "5"}, remaining_s=1.0)
    assert isinstance(d.error, AdmissionTimeout) and isinstance(d.error, TimeoutError)


# --- local retry budget -----------------------------------------------------------------------------


def test_local_budget_defaults_are_ratio_0_5_floor_0_5_per_s_window_20_s() -> None:
    b = LocalRetryBudget()
    assert (b.ratio, b.floor_per_s, b.window_s) == (0.5, 0.5, 20.0)
    assert isinstance(RetryPolicy().budget, LocalRetryBudget)
    assert RetryPolicy().budget is not RetryPolicy().budget  # no budget shared by accident


def test_local_budget_allows_ratio_times_requests() -> None:
    budget = LocalRetryBudget(ratio=0.1, floor_per_s=0, window_s=10, clock=FakeClock())
    for _ in range(20):
        budget.record_request()
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]


def test_local_budget_floor_allows_retries_without_traffic() -> None:
    budget = LocalRetryBudget(ratio=0.1, floor_per_s=1.0, window_s=10, clock=FakeClock())
    assert sum(budget.try_spend() for _ in range(15)) == 10


def test_local_budget_window_slides() -> None:
    clock = FakeClock()
    budget = LocalRetryBudget(ratio=0, floor_per_s=0.2, window_s=10, clock=clock)
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    clock.now += 5
    assert not budget.try_spend()  # the spent retries are still in the window
    clock.now += 6
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]


def test_spent_budget_fails_fast_with_retry_budget_exhausted_when_not_asked_to_wait() -> None:
    # decide(wait_for_budget=False), the policy API's default: no waiting (the transports ask to wait,
    # tests/retry/test_retry_budget_wait.py)
    gave_up: list[RetryDetails] = []
    budget = LocalRetryBudget(ratio=0.5, floor_per_s=0, window_s=10, clock=FakeClock())
    policy = RetryPolicy(budget=budget, on_give_up=[gave_up.append])
    original = httpx.RemoteProtocolError("peer closed")
    for _ in range(2):  # 2 answered requests x 0.5 = 1 retry
        assert not decide(policy, policy.new_request(), status=200, headers={}).retry
    s1, s2 = policy.new_request(), policy.new_request()
    assert decide(policy, s1, status=503, headers={}).retry
    d = decide(policy, s2, error=original)
    assert not d.retry and d.delay_s == 0.0
    assert isinstance(d.error, RetryBudgetExhausted) and d.error.__cause__ is original
    assert "retry budget exhausted" in d.reason
    assert "0.5 x answered requests" in str(d.error)
    assert gave_up[-1].give_up_error is d.error


def test_no_budget_means_no_retry_cap() -> None:
    policy = unlimited(max_attempts=1000)
    state = policy.new_request()
    assert all(decide(policy, state, status=503, headers={"retry-after": "0"}).retry for _ in range(200))


def test_decide_async_matches_decide_for_a_local_budget() -> None:
    async def main() -> list[bool]:
        budget = LocalRetryBudget(ratio=0, floor_per_s=0.2, window_s=10, clock=FakeClock())
        policy = RetryPolicy(budget=budget)
        out = []
        for _ in range(3):
            state = await policy.new_request_async()
            d = await policy.decide_async(
                state, status=503, headers={}, error=None, delivered=False, remaining_s=None
            )
            out.append(d.retry)
        return out

    assert anyio.run(main) == [True, True, False]


# --- Redis (fleet-wide) retry budget ----------------------------------------------------------------


@pytest.fixture
def redis_client(redis_url: str, redis_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.delete(f"{{zp:{redis_prefix}}}:retry_budget")  # only this test's key
    client.close()


@pytest.mark.redis
def test_redis_budget_is_shared_by_two_instances(redis_url: str, redis_prefix: str, redis_client: redis.Redis) -> None:
    # floor 0.05/s x 60 s = 3 retries for the whole fleet.
    a = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0, floor_per_s=0.05, window_s=60)
    b = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0, floor_per_s=0.05, window_s=60)
    other = RedisRetryBudget(redis_prefix + "-other", url=redis_url, ratio=0, floor_per_s=0.05, window_s=60)
    try:
        assert [a.try_spend(), a.try_spend(), b.try_spend()] == [True, True, True]
        assert not a.try_spend() and not b.try_spend()
        assert other.try_spend()  # another budget name is another window
        assert b.snapshot() == (0, 3, pytest.approx(3.0))
    finally:
        redis_client.delete(other.key)
        for x in (a, b, other):
            x.close()


@pytest.mark.redis
def test_redis_budget_deposits_from_one_instance_fund_anothers_retries(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    a = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0.5, floor_per_s=0, window_s=60, flush_interval_s=0)
    b = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0.5, floor_per_s=0, window_s=60, flush_interval_s=0)
    try:
        assert not b.try_spend()
        for _ in range(4):
            a.record_request()
        assert [b.try_spend(), b.try_spend(), b.try_spend()] == [True, True, False]
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_redis_budget_batched_deposits_count_after_flush(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    a = RedisRetryBudget(redis_prefix, url=redis_url, ratio=1, floor_per_s=0, window_s=60, flush_interval_s=3600)
    b = RedisRetryBudget(redis_prefix, url=redis_url, ratio=1, floor_per_s=0, window_s=60)
    try:
        a.record_request()  # the first deposit is written at once (nothing flushed yet)
        a.record_request()
        a.record_request()  # these two wait for the next flush: the budget is stricter, never looser
        assert b.snapshot()[0] == 1
        a.flush()
        assert b.snapshot()[0] == 3
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_redis_budget_key_is_under_the_budget_hash_tag_and_expires(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    budget = RedisRetryBudget(redis_prefix, url=redis_url, window_s=10)
    try:
        assert budget.try_spend()
        key = f"{{zp:{redis_prefix}}}:retry_budget"
        assert budget.key == key and redis_client.exists(key) == 1
        assert 0 < redis_client.pttl(key) <= 11_000
    finally:
        budget.close()


@pytest.mark.redis
def test_policy_with_redis_budget_fails_fast_when_the_fleet_spent_it(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    other_process = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0, floor_per_s=0.05, window_s=60)
    mine = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0, floor_per_s=0.05, window_s=60)
    policy = RetryPolicy(budget=mine)
    try:
        assert all(other_process.try_spend() for _ in range(3))
        d = decide(policy, status=503, headers={})
        assert not d.retry and isinstance(d.error, RetryBudgetExhausted)
    finally:
        other_process.close()
        mine.close()


@pytest.mark.redis
def test_redis_budget_async_path_shares_the_window_with_the_sync_path(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    async def main() -> list[bool]:
        budget = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0.5, floor_per_s=0, window_s=60,
                                  flush_interval_s=0)
        policy = RetryPolicy(budget=budget)
        try:
            for _ in range(4):  # 4 answered requests x 0.5 = 2 retries
                await policy.decide_async(await policy.new_request_async(), status=200, headers={},
                                          error=None, delivered=False, remaining_s=None)
            states = [await policy.new_request_async() for _ in range(3)]
            out = []
            for state in states[:3]:
                d = await policy.decide_async(state, status=503, headers={}, error=None, delivered=False,
                                              remaining_s=None)
                out.append(d.retry)
            return out
        finally:
            await budget.aclose()

    assert anyio.run(main) == [True, True, False]
    sync_view = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0.5, floor_per_s=0, window_s=60)
    try:
        assert sync_view.snapshot()[:2] == (4, 2)
    finally:
        sync_view.close()


@pytest.mark.redis
def test_redis_budget_from_url_works_from_one_event_loop_after_another(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    budget = RedisRetryBudget(redis_prefix, url=redis_url, ratio=0, floor_per_s=0.05, window_s=60)

    async def spend() -> bool:
        return await budget.try_spend_async()

    # Each anyio.run is a new event loop; redis.asyncio clients cannot cross loops.
    assert [anyio.run(spend) for _ in range(4)] == [True, True, True, False]
    budget.close()


@pytest.mark.redis
def test_redis_budget_with_only_a_sync_client_works_from_async_code(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    budget = RedisRetryBudget(redis_prefix, client=redis_client, ratio=0, floor_per_s=0.05, window_s=60)

    async def main() -> list[bool]:
        return [await budget.try_spend_async() for _ in range(4)]

    assert anyio.run(main) == [True, True, True, False]


@pytest.mark.redis
def test_retry_budget_for_a_redis_budget_is_fleet_wide_under_its_hash_tag(
    redis_url: str, redis_prefix: str, redis_client: redis.Redis
) -> None:
    from zp_client.budget.redis import RedisBudget

    # Two processes' worth of RedisBudget objects of one name: their retry budgets share one window.
    budgets = [RedisBudget(redis_url, redis_prefix, limit_blocks=100) for _ in range(2)]
    a, b = (retry_budget_for(x, ratio=0, floor_per_s=0.05, window_s=60) for x in budgets)
    try:
        assert isinstance(a, RedisRetryBudget) and a.key == f"{{zp:{redis_prefix}}}:retry_budget"
        assert [a.try_spend(), b.try_spend(), a.try_spend(), b.try_spend()] == [True, True, True, False]
    finally:
        a.close()
        b.close()


def test_retry_budget_for_any_other_budget_is_local() -> None:
    rb = retry_budget_for(object(), ratio=0.2)
    assert isinstance(rb, LocalRetryBudget) and rb.ratio == 0.2 and rb.window_s == 20.0  # the default window


def test_redis_budget_with_only_an_async_client_refuses_sync_calls_clearly() -> None:
    import redis.asyncio

    budget = RedisRetryBudget("x", async_client=redis.asyncio.Redis())
    with pytest.raises(ConfigurationError, match="async"):
        budget.try_spend()


def test_unreachable_redis_budget_means_no_retry_and_no_crash() -> None:
    with socketless_port() as port:
        budget = RedisRetryBudget("down", url=f"redis://127.0.0.1:{port}/0")
        policy = RetryPolicy(budget=budget)
        state = policy.new_request()  # the deposit fails quietly (logged)
        d = decide(policy, state, status=503, headers={})
    assert not d.retry and d.error is None and "retry budget unavailable" in d.reason


class socketless_port:
    """A loopback port with nothing listening on it (bound, not listening, so nobody else takes it)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        return int(self._sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


# --- jitter -----------------------------------------------------------------------------------------


def test_backoff_is_full_jitter_within_the_capped_exponential_window() -> None:
    policy = unlimited(backoff_initial_s=0.5, backoff_max_s=8.0)
    for n in range(8):
        bound = min(8.0, 0.5 * 2**n)
        samples = [policy.backoff(n) for _ in range(300)]
        assert all(0.0 <= s <= bound for s in samples), (n, max(samples))
        # Full jitter spreads over the whole window: 300 draws all in its lower half has odds 2**-300.
        assert max(samples) > bound / 2 and min(samples) < bound / 2


def test_decide_delays_follow_the_backoff_window_per_retry() -> None:
    policy = unlimited(backoff_initial_s=0.5, backoff_max_s=4.0, max_attempts=50)
    state = policy.new_request()
    for n in range(30):
        d = decide(policy, state, status=502, headers={})
        assert d.retry and 0.0 <= d.delay_s <= min(4.0, 0.5 * 2**n)
    assert state.retries == 30 and state.total_delay_s <= 30 * 4.0


# --- hooks ------------------------------------------------------------------------------------------


def test_on_retry_hooks_receive_the_details() -> None:
    seen: list[RetryDetails] = []
    also: list[int] = []
    policy = unlimited(on_retry=[seen.append, lambda d: also.append(d.attempt)])
    state = policy.new_request()
    decide(policy, state, status=429, headers={"retry-after": "1"}, remaining_s=100.0)
    decide(policy, state, error=httpx.ConnectError("refused"))
    assert [d.attempt for d in seen] == [1, 2] and also == [1, 2]
    assert seen[0].status == 429 and seen[0].delay_s == 1.0 and seen[0].remaining_s == 100.0
    assert isinstance(seen[1].error, httpx.ConnectError)


def test_on_give_up_is_not_called_for_outcomes_that_are_not_retryable() -> None:
    gave_up: list[RetryDetails] = []
    policy = unlimited(on_give_up=[gave_up.append])
    decide(policy, status=200, headers={})
    decide(policy, status=400, headers={})
    assert gave_up == []


def test_a_raising_hook_does_not_change_the_decision() -> None:
    def broken(_: RetryDetails) -> None:
        raise RuntimeError("metrics backend down")

    calls: list[int] = []
    policy = unlimited(on_retry=[broken, lambda d: calls.append(d.attempt)])
    assert decide(policy, status=503, headers={}).retry
    assert calls == [1]


# --- testing switch ---------------------------------------------------------------------------------


def test_testing_context_skips_the_sleeping_and_records_it() -> None:
    policy = unlimited()

    async def main() -> None:
        with anyio.fail_after(60):  # a real 10000 s sleep would trip this
            await policy.sleep(10_000)

    with testing() as rec:
        assert is_testing()
        anyio.run(main)
        policy.sleep_sync(10_000)
    assert rec.sleeps == [10_000, 10_000]
    assert not is_testing()


def test_set_testing_skips_the_sleeping_globally() -> None:
    set_testing(True)
    try:
        unlimited().sleep_sync(10_000)
        assert is_testing()
    finally:
        set_testing(False)
    assert not is_testing()


def test_without_testing_mode_sleep_really_waits() -> None:
    async def main() -> bool:
        with anyio.move_on_after(0.05) as scope:
            await unlimited().sleep(10)
        return scope.cancelled_caught

    assert anyio.run(main)


# --- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"backoff_initial_s": 0},
        {"backoff_initial_s": 2, "backoff_max_s": 1},
        {"retry_after_cap_s": -1},
        {"min_attempt_s": -0.1},
        {"retry_statuses": {99}},
    ],
)
def test_invalid_policy_settings_raise_configuration_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)


@pytest.mark.parametrize("kwargs", [{"ratio": -1}, {"floor_per_s": math.inf}, {"window_s": 0}])
def test_invalid_budget_settings_raise_configuration_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        LocalRetryBudget(**kwargs)
    with pytest.raises(ConfigurationError):
        RedisRetryBudget("n", url="redis://127.0.0.1:1/0", **kwargs)


def test_policy_from_settings_reads_the_zp_retry_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZP_RETRY_MAX_ATTEMPTS", "5")
    monkeypatch.setenv("ZP_RETRY_ON_504", "true")
    monkeypatch.setenv("ZP_RETRY_BUDGET_RATIO", "0.2")
    policy = RetryPolicy.from_settings(Settings())
    assert policy.max_attempts == 5 and policy.retry_on_504 and policy.retry_read_timeouts
    assert isinstance(policy.budget, LocalRetryBudget) and policy.budget.ratio == 0.2
    assert RetryPolicy.from_settings(Settings(), max_attempts=2).max_attempts == 2
