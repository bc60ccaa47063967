"""The planner (zp_client/_admission/planner.py): what a request's plan says, from its body, headers and
the budget's policy, with no I/O."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import httpx
import pytest

from zp_client._admission.core import Core
from zp_client._admission.httplib import HTTPX
from zp_client._admission.parts import SharedState
from zp_client._admission.plan import AGE_META, ANSWER_META, TPOT_TARGET_META, TTFT_TARGET_META, Parsed, Plan
from zp_client.budget.ledger import ANSWER_KEY
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import InvalidRequest, PromptTooLong
from zp_client.forecast import LengthForecaster

URL = "http://upstream.test/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello there"}]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds

    def sleep_sync(self, seconds: float) -> None:
        self.now += seconds


class KnowingForecaster(LengthForecaster):
    """Knows the answer's length from the request (as the benchmark's oracle does)."""

    def forecast_request(self, route: str, body: Mapping[str, object], *, max_tokens: int,
                         streaming: bool) -> int | None:
        known = body.get("expected")
        return known if isinstance(known, int) else None


def _core(policy: str = "strict", *, clock: FakeClock | None = None, shared: SharedState | None = None,
          forecaster: LengthForecaster | None = None, default_max_tokens: int = 4096,
          ttft_target_s: float | None = None, answer_allowance: bool = False) -> Core:
    s = Settings(estimator="heuristic", max_model_len=4096, stream_upstream=False,
                 default_max_tokens=default_max_tokens, ttft_target_s=ttft_target_s,
                 answer_allowance=answer_allowance)
    return Core(LocalBudget(1000, policy=policy), s, None, False, forecaster, lib=HTTPX, clock=clock,
                shared=shared or SharedState())


def _request(body: dict[str, object], headers: dict[str, str] | None = None) -> httpx.Request:
    return httpx.Request("POST", URL, content=json.dumps(body).encode(), headers=headers or {})


def _plan(core: Core, body: dict[str, object], headers: dict[str, str] | None = None) -> tuple[Parsed, Plan]:
    request = _request(body, headers)
    p = core.planner.parse(request)
    assert p is not None
    est = core.estimator.estimate(request.url.path, p.body)
    return p, core.planner.finish_plan(request, p, est, 4096)


def test_a_body_that_is_not_a_json_object_is_not_planned() -> None:
    core = _core()
    assert core.planner.parse(httpx.Request("POST", URL, content=b"not json")) is None
    assert core.planner.parse(httpx.Request("POST", URL, content=b"[1, 2]")) is None


def test_a_request_without_max_tokens_gets_the_default_and_it_is_logged_once_per_shared_state(
        caplog: pytest.LogCaptureFixture) -> None:
    shared = SharedState()
    core = _core(shared=shared, default_max_tokens=64)
    with caplog.at_level(logging.INFO, logger="zp_client.transport"):
        for _ in range(3):
            p, plan = _plan(core, {"model": "m", "messages": MESSAGES})
            assert p.max_tokens == 64 and json.loads(plan.content)["max_tokens"] == 64
    assert sum("without max_tokens" in r.getMessage() for r in caplog.records) == 1


def test_the_lease_bounds_prompt_and_output_and_holds_the_prompt() -> None:
    p, plan = _plan(_core(), {"model": "m", "messages": MESSAGES, "max_tokens": 100})
    assert plan.max_tokens == 100 and plan.prompt_tokens > 0
    assert plan.blocks == -(-(plan.prompt_tokens + 100) // 16)  # the prompt and every output token
    assert plan.held == -(-plan.prompt_tokens // 16)  # what the server holds at once: the prompt
    assert plan.meta is None  # strict: no elastic metadata, no routing, no targets


def test_a_prompt_surely_longer_than_the_context_is_refused_before_anything_is_held() -> None:
    core = _core()
    request = _request({"model": "m", "messages": [{"role": "user", "content": "word " * 400}],
                        "max_tokens": 8})
    p = core.planner.parse(request)
    assert p is not None
    est = core.estimator.estimate(request.url.path, p.body)
    with pytest.raises(PromptTooLong):
        core.planner.finish_plan(request, p, est, 50)


def test_a_malformed_field_zp_reads_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="max_tokens"):
        _core().planner.parse(_request({"model": "m", "messages": MESSAGES, "max_tokens": "100"}))


def test_a_streamed_call_asks_for_usage_and_strips_it_from_what_the_caller_reads() -> None:
    p, plan = _plan(_core(), {"model": "m", "messages": MESSAGES, "max_tokens": 8, "stream": True})
    assert json.loads(plan.content)["stream_options"] == {"include_usage": True}
    assert plan.stream and plan.strip_usage


def test_an_elastic_plan_carries_the_forecast_and_a_forecast_known_from_the_request_is_capped() -> None:
    core = _core("elastic", forecaster=KnowingForecaster())
    _, plan = _plan(core, {"model": "m", "messages": MESSAGES, "max_tokens": 50, "expected": 500})
    assert plan.forecast == 50 and plan.forecast_known  # capped at max_tokens
    assert plan.meta is not None and plan.meta["forecast_tokens"] == 50 and plan.meta["streaming"] is False
    _, unknown = _plan(core, {"model": "m", "messages": MESSAGES, "max_tokens": 50})
    assert not unknown.forecast_known and 0 < unknown.forecast <= 50


def test_targets_come_from_the_header_else_the_settings_and_each_acquire_adds_the_age() -> None:
    clock = FakeClock()
    core = _core(clock=clock, ttft_target_s=2.0)
    _, plan = _plan(core, {"model": "m", "messages": MESSAGES, "max_tokens": 8},
                    {"X-ZP-TPOT-Target": "0.05"})
    assert plan.targeted and plan.meta == {TTFT_TARGET_META: 2.0, TPOT_TARGET_META: 0.05}
    clock.now += 1.5
    meta = core.planner.lease_meta(plan, plan.meta)
    assert meta is not None and meta[AGE_META] == pytest.approx(1.5) and meta[TTFT_TARGET_META] == 2.0


def test_a_non_streamed_call_gets_its_answer_allowance_only_when_opted_in() -> None:
    # Settings.answer_allowance: forecast output (per choice) x TPOT target, the ledger's answer_s key;
    # carried by every acquire of the request beside its targets
    assert ANSWER_META == ANSWER_KEY
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 50, "expected": 40, "n": 2}
    both = {"X-ZP-TTFT-Target": "2", "X-ZP-TPOT-Target": "0.05"}
    on = _core("elastic", forecaster=KnowingForecaster(), answer_allowance=True)
    _, plan = _plan(on, body, both)
    assert plan.meta is not None and plan.meta[ANSWER_META] == pytest.approx(40 * 0.05)
    meta = on.planner.lease_meta(plan, plan.meta)
    assert meta is not None and meta[ANSWER_META] == pytest.approx(2.0)
    _, streamed = _plan(on, {**body, "stream": True}, both)
    off = _core("elastic", forecaster=KnowingForecaster())
    for p in (streamed, _plan(off, body, both)[1], _plan(on, body, {"X-ZP-TTFT-Target": "2"})[1]):
        assert p.meta is not None and ANSWER_META not in p.meta


def test_the_deadline_counts_from_arrival_on_the_cores_clock() -> None:
    clock = FakeClock()
    p, plan = _plan(_core(clock=clock), {"model": "m", "messages": MESSAGES, "max_tokens": 8},
                    {"X-ZP-Deadline": "3"})
    assert p.arrival == 100.0 and plan.deadline == 103.0


def test_the_shared_prefix_counts_full_blocks_of_the_system_preamble_only() -> None:
    core = _core()
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    est = core.estimator.estimate("/v1/chat/completions", {"model": "m", "messages": [system, *MESSAGES]})
    key, blocks = core.planner.shared_prefix(est)
    assert key is not None and 0 < blocks * 16 <= est.tokens
    bare = core.estimator.estimate("/v1/chat/completions", {"model": "m", "messages": MESSAGES})
    assert core.planner.shared_prefix(bare) == (None, 0)
