"""The drivers (zp_client/_admission/drivers.py) perform actions and decide nothing: a blocking attempt's
per-phase timeouts are capped at its deadline, requests zp does not admit pass through untouched, an
acquire without lease meta is asked without it (a budget written before meta keeps working)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from zp_client._admission.actions import Acquire
from zp_client._admission.drivers import capped_timeouts
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.transport import AdmissionTransport

URL = "http://upstream.test/v1/chat/completions"


def test_a_blocking_attempts_timeouts_are_capped_at_what_is_left_of_its_deadline() -> None:
    request = httpx.Request("POST", URL, extensions={"timeout": {"connect": 1.0, "read": 60.0,
                                                                 "write": None, "pool": 0.5}})
    shared = request.extensions
    capped_timeouts(request, 2.0)
    assert request.extensions["timeout"] == {"connect": 1.0, "read": 2.0, "write": 2.0, "pool": 0.5}
    assert shared["timeout"]["read"] == 60.0  # a new dict: the caller's request is not changed
    capped_timeouts(request, -5.0)  # already past: the smallest bound, never zero or negative
    assert min(request.extensions["timeout"].values()) == 0.001


def test_a_request_zp_does_not_admit_passes_through_untouched() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"data": []})

    budget = LocalBudget(10, policy="strict")
    transport = AdmissionTransport(httpx.MockTransport(handler), budget=budget,
                                   settings=Settings(estimator="heuristic"), retry=False)
    with httpx.Client(transport=transport) as client:
        assert client.get("http://upstream.test/v1/models").json() == {"data": []}
    assert len(seen) == 1 and seen[0].method == "GET" and budget.status_sync().used == 0


class MetaLessBudget(LocalBudget):
    """A budget whose acquire predates lease meta: it takes no ``meta`` argument."""

    calls: list[dict[str, Any]]

    def acquire_sync(self, blocks: int, *, priority: int = 0, timeout: float | None = None,  # type: ignore[override]
                     ticket: Any = None, held: int | None = None) -> Any:
        self.calls.append({"blocks": blocks, "priority": priority, "held": held})
        return super().acquire_sync(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held)


def test_an_acquire_without_meta_does_not_pass_one() -> None:
    budget = MetaLessBudget(100, policy="strict")
    budget.calls = []
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def handler(request: httpx.Request) -> httpx.Response:
        usage = {"prompt_tokens": 3, "completion_tokens": 1}
        return httpx.Response(200, json={"choices": [], "usage": usage})

    transport = AdmissionTransport(httpx.MockTransport(handler), budget=budget, retry=False,
                                   settings=Settings(estimator="heuristic", max_model_len=4096,
                                                     stream_upstream=False, pool_check=False))
    with httpx.Client(transport=transport) as client:
        assert client.post(URL, content=json.dumps(body)).status_code == 200
    assert len(budget.calls) == 1 and budget.calls[0]["blocks"] >= 1 and budget.status_sync().used == 0
    assert Acquire(4, 0, None, None, 1, None).kwargs() == {"priority": 0, "timeout": None, "ticket": None,
                                                             "held": 1}
