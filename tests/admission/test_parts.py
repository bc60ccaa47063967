"""What the transports of one budget share (zp_client/_admission/parts.py), held on an object rather
than in module globals, and the pool check's once-per-budget-and-server claim (servers.py)."""

from __future__ import annotations

import json

import httpx

from zp_client._admission.core import Core
from zp_client._admission.httplib import HTTPX
from zp_client._admission.parts import SharedState
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.forecast import LengthForecaster

URL = "http://upstream.test/v1/chat/completions"


def test_a_notice_is_given_once_per_shared_state() -> None:
    shared, other = SharedState(), SharedState()
    assert shared.once("x") and not shared.once("x") and shared.once("y")
    assert other.once("x")  # its own record


def test_each_budget_has_one_default_forecaster() -> None:
    shared = SharedState()
    a, b = LocalBudget(10), LocalBudget(10)
    fa = shared.forecaster_for(a)
    assert isinstance(fa, LengthForecaster) and shared.forecaster_for(a) is fa
    assert shared.forecaster_for(b) is not fa


def test_two_cores_of_one_budget_learn_together() -> None:
    shared = SharedState()
    budget = LocalBudget(100, policy="elastic")
    one = Core(budget, None, None, False, lib=HTTPX, shared=shared)
    two = Core(budget, None, None, False, lib=HTTPX, shared=shared)
    assert one.forecaster is not None and one.forecaster is two.forecaster


def test_the_pool_of_a_server_is_claimed_once_per_budget_across_cores() -> None:
    shared = SharedState()
    budget = LocalBudget(100, policy="strict")
    assert shared.claim_pool_check(budget, "http://s1") is True
    assert shared.claim_pool_check(budget, "http://s1") is False
    assert shared.claim_pool_check(budget, "http://s2") is True
    assert shared.claim_pool_check(LocalBudget(100), "http://s1") is True  # another budget


class Unhashable(LocalBudget):
    __hash__ = None  # type: ignore[assignment]


def test_a_budget_that_cannot_be_a_weak_key_is_checked_once_per_core() -> None:
    shared = SharedState()
    budget = Unhashable(100, policy="strict")
    assert shared.claim_pool_check(budget, "http://s1") is None
    settings = Settings(estimator="heuristic", pool_check=True)
    core = Core(budget, settings, None, False, lib=HTTPX, shared=shared)
    request = httpx.Request("POST", URL, content=json.dumps({"model": "m", "messages": []}).encode())
    p = core.planner.parse(request)
    assert p is not None
    assert core.servers.claim_pool_check(p) is True
    assert core.servers.claim_pool_check(p) is False
