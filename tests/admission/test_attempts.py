"""The attempt loop's one retry-or-raise (zp_client/_admission/attempts.py), driven by hand: each test
feeds the actions' results and asserts on the actions asked for and on what is raised or returned."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import httpx
import pytest

from zp_client._admission.actions import Close, Decide, Release, Sleep, WaitBudget
from zp_client._admission.core import Core
from zp_client._admission.httplib import HTTPX
from zp_client._admission.plan import Plan
from zp_client._admission.release import Holder
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import ServerUnreachable
from zp_client.estimate import Estimator
from zp_client.retry import RetryDecision, RetryPolicy

URL = "http://upstream.test/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def _core() -> Core:
    return Core(LocalBudget(100, policy="strict"), Settings(estimator="heuristic", max_model_len=4096), None,
                False, lib=HTTPX)


def _plan() -> Plan:
    return Plan(content=b"{}", headers=[], blocks=4, held=1, priority=0, deadline=None, strip_usage=False,
                stream=False, prompt_tokens=10, n=1,
                estimate=Estimator(Settings(estimator="heuristic")).estimate("/v1/chat/completions", BODY))


def _run(gen: Generator[Any, object, bool], decision: RetryDecision) -> tuple[list[Any], bool]:
    """Drive ``gen``: the Decide gets ``decision``, every other action None. (actions, returned)."""
    actions: list[Any] = []
    result: object = None
    try:
        while True:
            action = gen.send(result)
            actions.append(action)
            result = decision if isinstance(action, Decide) else None
    except StopIteration as stop:
        return actions, bool(stop.value)


def _lease_and_holder() -> tuple[Any, Holder]:
    budget = LocalBudget(100, policy="strict")
    lease = budget.acquire_sync(4)
    return lease, Holder(lease, 60.0, is_async=False, budget=budget)


def retry_or_raise(core: Core, request: httpx.Request, lease: Any, attempt: int,
                   **outcome: Any) -> Generator[Any, object, bool]:
    policy = RetryPolicy()
    return core.attempts.retry_or_raise(request, _plan(), policy, policy.new_request(), lease, attempt,
                                        **outcome)


def _request() -> httpx.Request:
    return httpx.Request("POST", URL, content=b"{}")


def test_an_answer_the_policy_keeps_goes_to_the_caller_with_only_a_decision_asked() -> None:
    core = _core()
    lease, holder = _lease_and_holder()
    resp = httpx.Response(200)
    gen = retry_or_raise(core, _request(), lease, 0,
                                       answer=(resp, holder))
    actions, retrying = _run(gen, RetryDecision(retry=False, delay_s=0.0, reason="ok"))
    assert [type(a) for a in actions] == [Decide] and actions[0].status == 200 and actions[0].error is None
    assert retrying is False


def test_a_retried_answer_is_closed_released_slept_on_and_waits_for_the_retry_budget() -> None:
    core = _core()
    lease, holder = _lease_and_holder()
    resp = httpx.Response(503)
    gen = retry_or_raise(core, _request(), lease, 0,
                                       answer=(resp, holder))
    decision = RetryDecision(retry=True, delay_s=0.25, reason="503", budget_owed=True)
    actions, retrying = _run(gen, decision)
    assert [type(a) for a in actions] == [Decide, Close, Release, Sleep, WaitBudget]
    assert actions[1].shield is False and actions[2].holder is holder and actions[3].seconds == 0.25
    assert retrying is True


def test_an_answer_the_policy_refuses_raises_its_error_after_closing_and_releasing() -> None:
    core = _core()
    lease, holder = _lease_and_holder()
    refusal = RuntimeError("retry budget exhausted")
    gen = retry_or_raise(core, _request(), lease, 0,
                                       answer=(httpx.Response(429), holder))
    with pytest.raises(RuntimeError, match="exhausted"):
        _run(gen, RetryDecision(retry=False, delay_s=0.0, reason="429", error=refusal))


def test_a_failed_connection_given_up_on_says_the_server_is_unreachable() -> None:
    core = _core()
    lease, _ = _lease_and_holder()
    request = _request()
    err = httpx.ConnectError("connection refused", request=request)
    gen = core.attempts.retry_or_raise(request, _plan(), RetryPolicy(), RetryPolicy().new_request(), lease, 2,
                                       error=err)
    with pytest.raises(ServerUnreachable) as info:
        _run(gen, RetryDecision(retry=False, delay_s=0.0, reason="attempts"))
    assert info.value.__cause__ is None and "3" in str(info.value) and "refused" in str(info.value)


def test_the_policys_own_error_is_raised_from_the_attempts_error() -> None:
    core = _core()
    lease, _ = _lease_and_holder()
    err = httpx.ReadTimeout("slow")
    mine = TimeoutError("the deadline leaves no time for another attempt")
    gen = retry_or_raise(core, _request(), lease, 0, error=err)
    with pytest.raises(TimeoutError) as info:
        _run(gen, RetryDecision(retry=False, delay_s=0.0, reason="deadline", error=mine))
    assert info.value.__cause__ is err


def test_a_retried_error_sleeps_without_closing_anything() -> None:
    core = _core()
    lease, _ = _lease_and_holder()
    gen = retry_or_raise(core, _request(), lease, 0,
                                       error=httpx.ReadError("reset"))
    actions, retrying = _run(gen, RetryDecision(retry=True, delay_s=0.5, reason="read error"))
    assert [type(a) for a in actions] == [Decide, Sleep] and actions[1].seconds == 0.5 and retrying


def test_the_deadline_check_refuses_an_attempt_past_it() -> None:
    from zp_client.errors import DeadlineExceeded

    core = _core()
    plan = _plan()
    plan.deadline = core.clock.monotonic() - 1.0
    with pytest.raises(DeadlineExceeded, match="attempt 2"):
        core.attempts.check_deadline(plan, 1)
    plan.deadline = core.clock.monotonic() + 100.0
    remaining = core.attempts.check_deadline(plan, 0)
    assert remaining is not None and 99.0 < remaining <= 100.0
