"""Delivery (zp_client/_admission/delivery.py): which error a caller gets for a cut answer, and that
usage learnt at the end reaches the estimator's calibration and the forecaster, once."""

from __future__ import annotations

import httpx

from zp_client._admission.core import Core
from zp_client._admission.delivery import is_answered, is_incomplete, mark
from zp_client._admission.httplib import HTTPX
from zp_client._admission.parts import SharedState
from zp_client._admission.plan import Plan
from zp_client._sse import Scanner
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import ZPError
from zp_client.forecast import LengthForecaster

URL = "http://upstream.test/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def _core(policy: str = "strict", forecaster: LengthForecaster | None = None) -> Core:
    return Core(LocalBudget(100, policy=policy), Settings(estimator="heuristic"), None, False, forecaster,
                lib=HTTPX, shared=SharedState())


def _plan(core: Core) -> Plan:
    est = core.estimator.estimate("/v1/chat/completions", BODY)
    return Plan(content=b"{}", headers=[], blocks=8, held=1, priority=0, deadline=None, strip_usage=False,
                stream=False, prompt_tokens=est.tokens, n=1, estimate=est, route="r")


def test_an_error_is_marked_answered_and_incomplete_without_touching_its_class() -> None:
    err = httpx.ReadError("x")
    assert not is_answered(err) and not is_incomplete(err)
    mark(err, incomplete=True, answered=False)
    assert is_incomplete(err) and not is_answered(err) and type(err) is httpx.ReadError


def test_a_cut_answer_is_a_protocol_error_not_retried_and_a_timeout_stays_a_timeout() -> None:
    core = _core()
    request = httpx.Request("POST", URL)
    cut = core.delivery.cut_answer(request, httpx.ReadError("reset"))
    assert isinstance(cut, httpx.RemoteProtocolError) and "not retried" in str(cut)
    assert is_answered(cut) and is_incomplete(cut)
    slow = httpx.ReadTimeout("slow")
    assert core.delivery.cut_answer(request, slow) is slow and is_answered(slow)
    other = ValueError("not a transport error")
    assert core.delivery.cut_answer(request, other) is other and not is_answered(other)


def test_outside_a_fleet_a_cut_stream_surfaces_as_it_is() -> None:
    core = _core()
    lease = core.budget.acquire_sync(2)
    assert core.delivery.stream_cut(lease, httpx.ReadError("reset")) is None
    lease.release_sync()


def test_zp_errors_surface_through_the_conversion_wrap_sets() -> None:
    core = _core()
    err = ZPError("refused")
    assert core.surface(err) is err
    core.convert_error = lambda e: RuntimeError(f"converted: {e}")
    assert str(core.surface(err)) == "converted: refused"
    other = ValueError("x")
    assert core.surface(other) is other


def test_usage_at_the_end_is_learnt_once_per_choice() -> None:
    fc = LengthForecaster()
    core = _core("elastic", fc)
    plan = _plan(core)
    lease = core.budget.acquire_sync(8)
    scanner = Scanner(plan, 16, lease.bound, lease, False, fc)
    scanner.feed(b'{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":40}}')
    scanner.flush()
    core.delivery.observe(plan, scanner)
    core.delivery.observe(plan, scanner)
    assert fc.observations("r") == 1  # once, however often it is asked
    lease.release_sync()
