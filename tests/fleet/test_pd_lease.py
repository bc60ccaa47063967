"""The two-phase lease as a sub-machine (zp_client/fleet/pd.py, :class:`TwoPhaseLease`), driven by hand
with no I/O: which actions it asks of the attempt loop, and when the prefill leg ends."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import httpx
import pytest

from zp_client._admission.actions import Acquire, Action, Close, ReadAll, Release, Send
from zp_client._admission.httplib import HTTPX
from zp_client._admission.plan import Plan
from zp_client._admission.release import Holder
from zp_client.budget.base import Budget, Lease
from zp_client.config import Settings
from zp_client.estimate import Estimator
from zp_client.fleet import Fleet
from zp_client.fleet.pd import PDSettings, TwoPhaseLease

URL = "http://dec.test/v1/chat/completions"
BODY: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi " * 600}],
                           "max_tokens": 8}
KV = {"remote_engine_id": "e1", "remote_block_ids": [1, 2]}


class Ctx:
    """The AttemptContext port, on a hand-moved clock."""

    block_size = 16

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def remaining(self, plan: Plan) -> float | None:
        return None

    def lease_meta(self, plan: Plan, meta: dict[str, object] | None) -> dict[str, object] | None:
        return meta

    def hold(self, lease: Lease, *, is_async: bool, budget: Budget) -> Holder:
        return Holder(lease, 60.0, is_async=is_async, budget=budget)

    def request(self, original: Any, plan: Plan, url: Any = None) -> Any:
        return HTTPX.request(original, plan, url)

    def is_event_stream(self, resp: Any) -> bool:
        return HTTPX.is_event_stream(resp)


def _plan(prompt_tokens: int = 600) -> Plan:
    est = Estimator(Settings(estimator="heuristic")).estimate("/v1/chat/completions", BODY)
    return Plan(content=json.dumps(BODY).encode(), headers=[(b"X-Request-Id", b"req-1")], blocks=60, held=40,
                priority=0, deadline=None, strip_usage=False, stream=False, prompt_tokens=prompt_tokens, n=1,
                estimate=est)


def _fleets(threshold: float = 0) -> tuple[Fleet, Fleet, PDSettings]:
    pre = Fleet(["http://pre.test/v1"], limit_blocks=200, policy="strict")
    dec = Fleet(["http://dec.test/v1"], limit_blocks=200, policy="strict").disaggregate(pre,
                                                                                       threshold_tokens=threshold)
    assert dec.pd is not None
    return dec, pre, dec.pd


def _drive(gen: Generator[Action, object, Any], answer: Any) -> tuple[list[Action], Any]:
    """Run ``gen``: Acquire gets a real lease from its budget, Send ``answer`` (or raises it), ReadAll
    feeds the answer's body to its sink, everything else None."""
    actions: list[Action] = []
    result: object = None
    throw: BaseException | None = None
    try:
        while True:
            action = gen.throw(throw) if throw is not None else gen.send(result)
            throw, result = None, None
            actions.append(action)
            if isinstance(action, Acquire):
                assert action.budget is not None
                result = action.budget.acquire_sync(action.blocks, held=action.held)
            elif isinstance(action, Send):
                if isinstance(answer, BaseException):
                    throw = answer
                else:
                    result = answer
            elif isinstance(action, ReadAll):
                action.sink(answer.content)
            elif isinstance(action, Release):
                action.holder.release_sync()
    except StopIteration as stop:
        return actions, stop.value


def test_a_disaggregated_attempt_takes_the_prefill_leg_on_the_prefill_fleet_first() -> None:
    dec, pre, pd = _fleets()
    call = TwoPhaseLease(pd, dec, _plan(), BODY, Ctx())
    actions, took = _drive(call.before_attempt(_plan(), False), None)
    assert took and [type(a) for a in actions] == [Acquire]
    acquire = actions[0]
    assert isinstance(acquire, Acquire) and acquire.budget is pre and acquire.blocks == -(-601 // 16)
    assert call.leg is not None and pre.status_sync().used == acquire.blocks


def test_a_short_prompt_is_not_disaggregated() -> None:
    dec, pre, pd = _fleets(threshold=10_000)
    call = TwoPhaseLease(pd, dec, _plan(), BODY, Ctx())
    actions, took = _drive(call.before_attempt(_plan(), False), None)
    assert not took and actions == [] and call.leg is None


def test_the_prefill_answer_s_kv_params_go_into_the_decode_call_with_one_request_id() -> None:
    dec, pre, pd = _fleets()
    ctx = Ctx()
    call = TwoPhaseLease(pd, dec, _plan(), BODY, ctx)
    _drive(call.before_attempt(_plan(), False), None)
    decode_lease = dec.acquire_sync(60, held=40)
    answer = httpx.Response(200, json={"kv_transfer_params": KV})
    request = httpx.Request("POST", URL, content=_plan().content)
    actions, out = _drive(call.prefill(_plan(), request, decode_lease, 0.0), answer)
    assert [type(a) for a in actions] == [Send, ReadAll]
    send = actions[0]
    assert isinstance(send, Send) and send.request.url.host == "pre.test"
    sent = json.loads(send.request.read())
    assert sent["max_tokens"] == 1 and sent["kv_transfer_params"]["do_remote_decode"] is True
    assert json.loads(out.content)["kv_transfer_params"] == KV
    assert dict(out.headers)[b"X-Request-Id"] == b"req-1" and pd.counts["prefills"] == 1
    assert call.reusable_for(ctx.now()) is None  # shipped: it may have reached a decode replica
    call.connect_failed()  # ...but the decode call reached none: another replica may read it for a while
    ctx.t = 3.0
    assert call.reusable_for(ctx.now()) == pd.kv_lease_s / 2 - 3.0


def test_a_failed_prefill_call_releases_the_leg_and_the_decode_replica_prefills_locally() -> None:
    dec, pre, pd = _fleets()
    call = TwoPhaseLease(pd, dec, _plan(), BODY, Ctx())
    _drive(call.before_attempt(_plan(), False), None)
    request = httpx.Request("POST", URL, content=_plan().content)
    err = httpx.ConnectError("refused", request=request)
    actions, out = _drive(call.prefill(_plan(), request, dec.acquire_sync(60, held=40), 0.0), err)
    assert [type(a) for a in actions] == [Send, Release] and out.content == _plan().content
    assert pd.counts["prefill_failed"] == 1 and pre.status_sync().used == 0


def test_an_unread_kv_keeps_the_prefill_leg_until_vllms_lease_on_it_expires() -> None:
    dec, pre, pd = _fleets()
    ctx = Ctx()
    call = TwoPhaseLease(pd, dec, _plan(), BODY, ctx)
    _drive(call.before_attempt(_plan(), False), None)
    request = httpx.Request("POST", URL, content=_plan().content)
    _drive(call.prefill(_plan(), request, dec.acquire_sync(60, held=40), 0.0),
           httpx.Response(200, json={"kv_transfer_params": KV}))
    ctx.t = 5.0
    actions: list[Action] = list(call.drop())  # no decode replica read it: held to the lease's end
    assert len(actions) == 1 and isinstance(actions[0], Release)
    assert actions[0].after_s == pd.kv_lease_s - 5.0 and pd.counts["held_to_expiry"] == 1
    assert list(call.drop()) == []  # once


def test_once_the_decode_stream_started_the_leg_ends_at_once() -> None:
    dec, pre, pd = _fleets()
    call = TwoPhaseLease(pd, dec, _plan(), BODY, Ctx())
    _drive(call.before_attempt(_plan(), False), None)
    request = httpx.Request("POST", URL, content=_plan().content)
    _drive(call.prefill(_plan(), request, dec.acquire_sync(60, held=40), 0.0),
           httpx.Response(200, json={"kv_transfer_params": KV}))
    actions, _ = _drive(call.decode_started(), None)
    assert len(actions) == 1 and isinstance(actions[0], Release) and actions[0].after_s == 0.0
    assert pre.status_sync().used == 0


def test_a_cut_prefill_answer_is_closed_and_counted() -> None:
    dec, pre, pd = _fleets()
    call = TwoPhaseLease(pd, dec, _plan(), BODY, Ctx())
    _drive(call.before_attempt(_plan(), False), None)
    request = httpx.Request("POST", URL, content=_plan().content)
    gen = call.prefill(_plan(), request, dec.acquire_sync(60, held=40), 0.0)
    assert isinstance(gen.send(None), Send)
    assert isinstance(gen.send(httpx.Response(200, content=b"{")), ReadAll)
    close = gen.throw(httpx.ReadError("cut"))
    assert isinstance(close, Close) and close.shield  # the server sees the disconnect first
    release = gen.send(None)
    # nobody will read that KV: the leg is kept only until vLLM's lease on it ends
    assert isinstance(release, Release) and release.after_s == pd.kv_lease_s
    with pytest.raises(StopIteration) as stop:
        gen.send(None)
    assert stop.value.value.content == _plan().content  # the decode replica prefills locally
    assert pd.counts["prefill_failed"] == 1
