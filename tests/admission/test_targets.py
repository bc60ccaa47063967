"""Targets known to the budget (issue 30): a request's TTFT / TPOT target reaches the budget in the acquire
call's ``meta`` (``ttft_target_s``, ``tpot_target_s``, ``age_s``), resolved call header > route > class >
global; a retry keeps its original arrival and its target. Bad zp input (a target, deadline or priority
that cannot be read) is an :class:`InvalidRequest` before any lease is taken: nothing held, nothing sent.

Through ``wrap()``'d real openai against a loopback server: marked ``openai_compat`` (both majors).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import ValidationError

from tests._asgi_server import LoopbackServer
from tests._meta_spy import MetaSpy, targets
from tests._redis_keys import delete_keys
from zp_client import (
    TPOT_TARGET_HEADER,
    TTFT_TARGET_HEADER,
    AdmissionOptions,
    Fleet,
    InvalidRequest,
    LocalBudget,
    Settings,
    wrap,
)
from zp_client._admission.plan import read_headers, seconds
from zp_client.errors import AdmissionError, ConfigurationError
from zp_client.transport import transport_classes

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

MSGS = [{"role": "user", "content": "hello there"}]
TARGET_KEYS = ("ttft_target_s", "tpot_target_s", "age_s")


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def awrapped(server: LoopbackServer, b: Any, **settings: Any) -> Any:
    orig = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test", timeout=30)
    return wrap(orig, budget=b, settings=Settings(estimator="heuristic", **settings))


def swrapped(server: LoopbackServer, b: Any, **settings: Any) -> Any:
    orig = openai.OpenAI(base_url=server.base_url, api_key="sk-test", timeout=30)
    return wrap(orig, budget=b, settings=Settings(estimator="heuristic", **settings))


# ------------------------------------------------------------------------------------------ resolution


async def test_targets_resolve_header_over_route_over_class_over_global(server: LoopbackServer) -> None:
    b = MetaSpy()
    c = awrapped(server, b, ttft_target_s=10.0, ttft_targets={1: 5.0},
                 ttft_route_targets={"planner": 2.0, "ok": 3.0},
                 tpot_target_s=0.1, tpot_targets={1: 0.05}, tpot_route_targets={"planner": 0.02})
    cases: list[tuple[dict[str, str], dict[str, float]]] = [
        ({"X-ZP-Route": "other"}, {"ttft_target_s": 10.0, "tpot_target_s": 0.1}),  # global
        ({"X-ZP-Route": "other", "X-ZP-Priority": "1"}, {"ttft_target_s": 5.0, "tpot_target_s": 0.05}),
        ({"X-ZP-Route": "planner", "X-ZP-Priority": "1"}, {"ttft_target_s": 2.0, "tpot_target_s": 0.02}),
        ({"X-ZP-Route": "planner", "X-ZP-Priority": "1", "X-ZP-TTFT-Target": "0.5",
          "X-ZP-TPOT-Target": " 0.04 "}, {"ttft_target_s": 0.5, "tpot_target_s": 0.04}),
        ({}, {"ttft_target_s": 3.0, "tpot_target_s": 0.1}),  # no X-ZP-Route: the model is the route
    ]
    for headers, want in cases:
        await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, extra_headers=headers)
        meta = b.metas[-1]
        assert targets(meta) == want, headers
        assert meta is not None and 0 <= meta["age_s"] < 30  # seconds since it arrived, at this enqueue
        sent = server.llm_requests()[-1]["headers"]
        assert not any(k.startswith("x-zp-") for k in sent)  # zp's headers never reach the server
    # the body's priority field is the class when no X-ZP-Priority is given
    await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, extra_body={"priority": 1},
                                    extra_headers={"X-ZP-Route": "other"})
    assert targets(b.metas[-1]) == {"ttft_target_s": 5.0, "tpot_target_s": 0.05}
    assert (await b.status()).used == 0


@pytest.mark.parametrize("policy", ["strict", "elastic"])
def test_no_target_set_sends_no_target_keys(server: LoopbackServer, policy: str) -> None:
    b = MetaSpy(policy=policy)
    c = swrapped(server, b)
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                              extra_headers={"X-ZP-Deadline": "30"})
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, stream=True).close()
    assert len(b.metas) == 2
    for meta in b.metas:
        if policy == "strict":
            assert meta is None  # nothing for a strict budget to read: no meta at all, as before
        else:
            assert meta is not None and "prompt_tokens" in meta
            assert not set(TARGET_KEYS) & set(meta)


@pytest.mark.parametrize("policy", ["strict", "elastic"])
def test_a_target_alone_travels_under_either_policy_sync(server: LoopbackServer, policy: str) -> None:
    b = MetaSpy(policy=policy)
    c = swrapped(server, b)
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                              extra_headers={TTFT_TARGET_HEADER: "1.5"})
    meta = b.metas[-1]
    assert meta is not None and meta["ttft_target_s"] == 1.5 and "tpot_target_s" not in meta
    assert meta["age_s"] >= 0
    assert ("prompt_tokens" in meta) == (policy == "elastic")  # elastic's own meta is kept beside it
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                              extra_headers={TPOT_TARGET_HEADER: "0.03"})
    assert targets(b.metas[-1]) == {"tpot_target_s": 0.03}
    assert b.status_sync().used == 0


@pytest.mark.parametrize("stream_upstream", [True, False])
def test_a_non_streamed_call_with_both_targets_carries_its_answer_allowance(
        server: LoopbackServer, stream_upstream: bool) -> None:
    # Opt-in (Settings.answer_allowance). Its SLO is the whole answer within TTFT + output x TPOT: the
    # line's deadline is later by its forecast output at the TPOT target (answer_s, ledger.line_deadline),
    # whether or not zp streams it upstream; a streamed call, a call without a TPOT target, a strict budget
    # (no forecast) and the default settings get none.
    both = {TTFT_TARGET_HEADER: "2", TPOT_TARGET_HEADER: "0.05"}
    off = MetaSpy(policy="elastic")
    swrapped(server, off, stream_upstream=stream_upstream).chat.completions.create(
        model="ok", messages=MSGS, max_tokens=64, extra_headers=both)
    b = MetaSpy(policy="elastic")
    c = swrapped(server, b, stream_upstream=stream_upstream, answer_allowance=True)
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=64, extra_headers=both)
    meta = b.metas[-1]
    assert meta is not None and meta["forecast_tokens"] > 0
    assert meta["answer_s"] == pytest.approx(meta["forecast_tokens"] * 0.05)
    c.chat.completions.create(model="ok", messages=MSGS, max_tokens=64, stream=True,
                              extra_headers=both).close()
    for one in ({TTFT_TARGET_HEADER: "2"}, {TPOT_TARGET_HEADER: "0.05"}):
        c.chat.completions.create(model="ok", messages=MSGS, max_tokens=64, extra_headers=one)
    strict = MetaSpy(policy="strict")
    swrapped(server, strict, answer_allowance=True).chat.completions.create(
        model="ok", messages=MSGS, max_tokens=64, extra_headers=both)
    for meta in b.metas[1:] + strict.metas + off.metas:
        assert meta is not None and "answer_s" not in meta
    assert b.status_sync().used == 0


async def test_a_retry_keeps_its_target_and_its_first_arrival(server: LoopbackServer) -> None:
    b = MetaSpy(policy="elastic")
    c = awrapped(server, b)
    # "flaky": the first attempt of each user is a 503 with retry-after-ms 10, the second one succeeds
    headers = {"X-ZP-TTFT-Target": "2.5", "X-ZP-TPOT-Target": "0.05"}
    reply = await c.chat.completions.create(model="flaky", messages=MSGS, max_tokens=8, user="retry-age-1",
                                            extra_headers=headers)
    assert reply.choices[0].message.content
    assert len(b.calls) == 2
    (first, t1), (second, t2) = b.calls
    assert first is not None and second is not None
    assert targets(first) == targets(second) == {"ttft_target_s": 2.5, "tpot_target_s": 0.05}
    assert t1 is None and t2 is not None  # the retry re-enters with its ticket...
    # ...and its age counts from the first arrival: it grew by at least the 10 ms the retry slept (a retry
    # counted from its own start would be younger than that)
    assert second["age_s"] >= first["age_s"] + 0.009
    assert (await b.status()).used == 0


async def test_the_target_reaches_each_replica_ledger_of_a_fleet(server: LoopbackServer) -> None:
    with LoopbackServer() as other:
        fleet = Fleet([server.base_url, other.base_url], limit_blocks=1000, policy="elastic")
        c = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet,
                 settings=Settings(estimator="heuristic", ttft_target_s=4.0))
        stream = await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8, stream=True,
                                                 extra_headers={"X-ZP-TPOT-Target": "0.02"})
        try:  # while the stream is open its lease lives on the replica it was placed on
            live = [lease for rep in fleet.ledger.replicas.values() for lease in rep.ledger.leases.values()]
            assert len(live) == 1
            meta = live[0].meta
            assert meta["ttft_target_s"] == 4.0 and meta["tpot_target_s"] == 0.02 and meta["age_s"] >= 0
            assert "prompt_tokens" in meta  # beside the elastic policy's own fields
        finally:
            await stream.close()
        assert (await fleet.status()).leases == 0


# ------------------------------------------------------------------------------------------ bad input

BAD_SECONDS = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "0", "-0.0", "abc", "", "1s", "true"]


@pytest.mark.parametrize("header", ["X-ZP-TTFT-Target", "X-ZP-TPOT-Target", "X-ZP-Deadline"])
@pytest.mark.parametrize("value", BAD_SECONDS)
async def test_a_bad_target_or_deadline_header_is_invalid_request_before_any_lease(
        server: LoopbackServer, header: str, value: str) -> None:
    b = MetaSpy()
    c = awrapped(server, b)
    before = len(server.llm_requests())
    with pytest.raises(InvalidRequest) as bad:
        await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                                        extra_headers={header: value})
    err = bad.value
    assert err.field == header and header in str(err)
    assert isinstance(err, ValueError) and isinstance(err, AdmissionError)
    assert isinstance(err, openai.OpenAIError) and not isinstance(err, openai.APIConnectionError)
    assert b.calls == [] and b.granted() == 0 and (await b.status()).used == 0  # no lease asked for
    assert len(server.llm_requests()) == before  # nothing sent


def test_a_bad_priority_header_is_invalid_request_sync(server: LoopbackServer) -> None:
    b = MetaSpy()
    c = swrapped(server, b)
    before = len(server.llm_requests())
    for value in ("high", "1.5", ""):
        with pytest.raises(InvalidRequest) as bad:
            c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                                      extra_headers={"X-ZP-Priority": value})
        assert bad.value.field == "X-ZP-Priority" and isinstance(bad.value, openai.OpenAIError)
    with pytest.raises(InvalidRequest, match="X-ZP-TTFT-Target"):
        c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                                  extra_headers={"X-ZP-TTFT-Target": "inf"})
    assert b.calls == [] and b.granted() == 0 and len(server.llm_requests()) == before


@pytest.mark.parametrize("mod_name", ["httpx", "httpx2"])
@pytest.mark.parametrize("header", ["X-ZP-Priority", "X-ZP-TTFT-Target", "X-ZP-TPOT-Target", "X-ZP-Deadline"])
async def test_header_bytes_that_are_not_text_are_invalid_request(server: LoopbackServer, mod_name: str,
                                                                    header: str) -> None:
    mod = pytest.importorskip(mod_name)  # httpx2 only where openai 3.x is installed
    b = MetaSpy()
    t = transport_classes(mod).AsyncAdmissionTransport(budget=b, settings=Settings(estimator="heuristic"))
    before = len(server.llm_requests())
    async with mod.AsyncClient(transport=t, base_url=server.base_url, timeout=30) as c:
        with pytest.raises(InvalidRequest) as bad:  # not an untyped UnicodeDecodeError
            await c.post("/chat/completions", json={"model": "ok", "messages": MSGS, "max_tokens": 8},
                         headers={header: b"\xff\xfe1"})
    assert bad.value.field == header and not isinstance(bad.value, UnicodeDecodeError)
    assert b.calls == [] and b.granted() == 0 and len(server.llm_requests()) == before


def test_read_headers_reads_and_strips_every_zp_header() -> None:
    opts = read_headers([(b"X-ZP-TTFT-Target", b" 1.25 "), (b"x-zp-tpot-target", b"0.04"),
                         (b"X-ZP-Deadline", b"30"), (b"X-ZP-Priority", b"-2"), (b"X-ZP-Route", b"r"),
                         (b"Authorization", b"Bearer k"), (b"Content-Length", b"12"), (b"X-Trace", b"t")])
    assert (opts.ttft_target_s, opts.tpot_target_s, opts.deadline_s, opts.priority, opts.route) == (
        1.25, 0.04, 30.0, -2, "r")
    assert [k for k, _ in opts.headers] == [b"Authorization", b"X-Trace"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, 0.0, -1, True, False, None, "x", b"\xff",
                                   [1.0]])
def test_seconds_refuses_what_is_not_a_positive_finite_number(value: Any) -> None:
    with pytest.raises(InvalidRequest) as bad:
        seconds(value, "ttft_target", kind="option")
    assert bad.value.field == "ttft_target" and "ttft_target" in str(bad.value)


def test_seconds_reads_numbers_and_their_text() -> None:
    assert seconds(2, "f") == 2.0 and seconds("0.5", "f") == 0.5 and seconds(b" 3e-2 ", "f") == 0.03


# ------------------------------------------------------------------------------------------ settings


def test_settings_targets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZP_TTFT_TARGET_S", "5")
    monkeypatch.setenv("ZP_TTFT_TARGETS", '{"0": 1, "1": 30}')
    monkeypatch.setenv("ZP_TTFT_ROUTE_TARGETS", '{"planner": 2.5}')
    monkeypatch.setenv("ZP_TPOT_TARGET_S", "0.05")
    monkeypatch.setenv("ZP_TPOT_TARGETS", '{"0": 0.04}')
    s = Settings()
    assert (s.ttft_target_s, s.ttft_targets) == (5.0, {0: 1.0, 1: 30.0})
    assert s.ttft_route_targets == {"planner": 2.5}
    assert (s.tpot_target_s, s.tpot_targets, s.tpot_route_targets) == (0.05, {0: 0.04}, {})


def test_settings_default_is_no_target() -> None:
    s = Settings()
    assert s.ttft_target_s is None and s.tpot_target_s is None
    assert s.ttft_targets == s.tpot_targets == {} and s.ttft_route_targets == s.tpot_route_targets == {}


@pytest.mark.parametrize("field,value", [
    ("ttft_target_s", math.nan), ("ttft_target_s", math.inf), ("ttft_target_s", 0), ("ttft_target_s", -1),
    ("ttft_target_s", "soon"), ("tpot_target_s", math.inf), ("ttft_targets", {0: math.nan}),
    ("ttft_targets", {0: -1.0}), ("ttft_route_targets", {"r": 0}), ("tpot_targets", {1: math.inf}),
    ("tpot_route_targets", {"r": "x"}), ("deadline_s", math.inf), ("deadline_s", math.nan),
])
def test_settings_refuse_a_target_or_deadline_that_is_not_positive_finite(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):  # a setting: refused at construction, named
        Settings(**{field: value})


def test_wrap_refuses_a_bad_target_setting_as_configuration_error(server: LoopbackServer) -> None:
    with pytest.raises(ConfigurationError, match="ttft_target_s"):
        wrap(openai.OpenAI(base_url=server.base_url, api_key="x"), budget=MetaSpy(), ttft_target_s=math.inf)


# ------------------------------------------------------------------------------------------ AdmissionOptions


def test_admission_options_targets_become_default_headers() -> None:
    b = LocalBudget(limit_blocks=100)
    assert AdmissionOptions(budget=b, ttft_target=1.5, tpot_target=0.05).headers() == {
        TTFT_TARGET_HEADER: "1.5", TPOT_TARGET_HEADER: "0.05"}
    assert AdmissionOptions(budget=b).headers() == {}


@pytest.mark.parametrize("name", ["ttft_target", "tpot_target", "deadline"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0, -2.0, True, "1"])
def test_admission_options_refuse_bad_seconds_at_construction(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=name):
        AdmissionOptions(budget=LocalBudget(limit_blocks=100), **{name: value})


async def test_admission_options_targets_reach_the_budget_and_a_call_header_wins(
        server: LoopbackServer) -> None:
    b = MetaSpy()
    raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test")
    c = AdmissionOptions(budget=b, settings=Settings(estimator="heuristic", ttft_target_s=9.0),
                         ttft_target=1.5, tpot_target=0.05).admit(raw)
    await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8)
    assert targets(b.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                                    extra_headers={TTFT_TARGET_HEADER: "0.75"})
    assert targets(b.metas[-1]) == {"ttft_target_s": 0.75, "tpot_target_s": 0.05}
    await c.close()
    await raw.close()



# ------------------------------------------------------------------------------------------ RedisBudget


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["strict", "elastic"])
def test_the_targets_reach_a_redis_budget(server: LoopbackServer, redis_url: str, redis_prefix: str,
                                          policy: str) -> None:
    from zp_client import RedisBudget

    calls: list[dict[str, Any] | None] = []

    class RedisSpy(RedisBudget):
        def acquire_sync(self, blocks: int, **kw: Any) -> Any:
            calls.append(kw.get("meta"))
            return super().acquire_sync(blocks, **kw)

    b = RedisSpy(redis_url, redis_prefix, 1000, 16, policy=policy, recovery_s=0)
    try:
        c = swrapped(server, b, tpot_target_s=0.05)
        reply = c.chat.completions.create(model="ok", messages=MSGS, max_tokens=8,
                                          extra_headers={TTFT_TARGET_HEADER: "2"})
        assert reply.choices[0].message.content
        assert len(calls) == 1 and targets(calls[0]) == {"ttft_target_s": 2.0, "tpot_target_s": 0.05}
        assert calls[0] is not None and calls[0]["age_s"] >= 0
        assert b.status_sync().used == 0
    finally:
        b.close_sync()
        delete_keys(redis_url, redis_prefix)


# ------------------------------------------------------------------------------------------ disaggregated


async def test_the_prefill_leg_of_a_disaggregated_fleet_carries_the_targets() -> None:
    from zp_sim.server import SimServer

    prefill_metas: list[dict[str, Any] | None] = []

    class PrefillSpy(Fleet):
        async def acquire(self, blocks: int, **kw: Any) -> Any:
            prefill_metas.append(kw.get("meta"))
            return await super().acquire(blocks, **kw)

    async with SimServer("tiny", speedup=20.0, role="prefill") as p, \
            SimServer("tiny", speedup=20.0, role="decode", kv_transfer_s_per_block=0.001) as d:
        pre = PrefillSpy([p.base_url], limit_blocks=480, policy="strict")
        dec = Fleet([d.base_url], limit_blocks=480, policy="elastic").disaggregate(pre, threshold_tokens=0)
        client = wrap(openai.AsyncOpenAI(base_url=dec.base_url, api_key="x"), budget=dec,
                      settings=Settings(estimator="heuristic", ttft_target_s=1.25))
        try:
            reply = await client.chat.completions.create(
                model="sim-llama", max_tokens=4, messages=[{"role": "user", "content": "word " * 300}])
            assert reply.choices[0].message.content is not None
        finally:
            await client.close()
    assert dec.pd is not None and dec.pd.counts["prefills"] == 1  # it took the prefill leg
    assert len(prefill_metas) == 1
    meta = prefill_metas[0]
    assert targets(meta) == {"ttft_target_s": 1.25} and meta is not None and meta["age_s"] >= 0
