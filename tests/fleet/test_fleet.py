"""Fleets (zp_client.fleet): the sans-I/O ledger (the fair line across replicas, placement, affinity,
ejection), the prefix index's bound and eviction, and the Fleet through the real openai SDK against real
servers on loopback (routing, moves off a dead replica, cut streams, ejection and return, DNS)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import openai
import pytest

from tests._asgi_server import LoopbackServer
from zp_client import Fleet, HealthRules, StreamCut, observe_admissions, wrap
from zp_client.budget.elastic import make_policy
from zp_client.errors import ConfigurationError, LeaseTooLarge
from zp_client.fleet.ledger import PREFIX_META, SESSION_META, FleetLedger
from zp_client.fleet.prefix import PrefixIndex, prefix_keys

pytestmark = [pytest.mark.openai_compat]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"

A, B, C = "http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"


def _ledger(limits: dict[str, int], **kw: Any) -> FleetLedger:
    return FleetLedger(limits, lambda: make_policy("strict"), **kw)


def _keys(*names: str, blocks_each: int = 10) -> tuple[tuple[int, int], ...]:
    msgs = [{"role": "user", "content": n} for n in names]
    keys = prefix_keys({"model": "m", "messages": msgs}, 16 * blocks_each * len(names), 16)
    return tuple((k, blocks_each * (i + 1)) for i, (k, _) in enumerate(keys))


# ------------------------------------------------------------------------------ the ledger


def test_one_line_across_replicas_priority_then_fifo() -> None:
    led = _ledger({A: 10, B: 10})
    for wid in ("x", "y"):
        led.enqueue(wid, 10, 1, 0, now=0.0)
    assert sorted(led.grant(0.0)) == ["x", "y"]
    assert {led.replica_of("x"), led.replica_of("y")} == {A, B}  # one per replica: neither fits twice
    led.enqueue("late", 10, 1, 5, now=1.0)
    led.enqueue("urgent", 10, 1, 0, now=2.0)
    assert led.grant(2.0) == []
    led.release("x", 3.0)
    assert led.grant(3.0) == ["urgent"]  # priority class first, whichever replica frees
    led.release("y", 4.0)
    assert led.grant(4.0) == ["late"]


def test_backfill_is_bounded_by_the_starvation_bound_on_one_replica() -> None:
    led = _ledger({A: 10, B: 10}, starvation_bound_s=2.0)
    led.enqueue("big0", 8, 1, 0, now=0.0)
    led.enqueue("big1", 8, 1, 0, now=0.0)
    assert len(led.grant(0.0)) == 2
    on_a = "big0" if led.replica_of("big0") == A else "big1"
    led.enqueue("head", 10, 1, 0, now=0.0)  # fits nowhere while the bigs run
    led.enqueue("small", 2, 1, 0, now=0.1)
    assert led.grant(0.5) == ["small"]  # backfill while the head is young
    led.release("small", 0.6)
    led.enqueue("small2", 2, 1, 0, now=2.5)
    led.enqueue("small3", 2, 1, 0, now=2.5)
    # the head starves: the replica it will fit on first (A, the first of two equally short) takes
    # nobody behind it; the other replica still backfills
    assert led.grant(2.5) == ["small2"] and led.replica_of("small2") == B
    led.release(on_a, 3.0)
    assert led.grant(3.0) == ["head"] and led.replica_of("head") == A  # the held replica drained to it


def test_too_large_for_every_replica() -> None:
    led = _ledger({A: 10, B: 20})
    with pytest.raises(LeaseTooLarge):
        led.enqueue("w", 21, 1, 0, now=0.0)
    led.enqueue("ok", 20, 1, 0, now=0.0)
    assert led.grant(0.0) == ["ok"] and led.replica_of("ok") == B


def test_prefix_affinity_prefers_the_replica_that_has_it() -> None:
    led = _ledger({A: 100, B: 100, C: 100})
    convo = _keys("system", "turn1")
    led.enqueue("t1", 30, 20, 0, now=0.0, meta={PREFIX_META: convo})
    led.grant(0.0)
    first = led.replica_of("t1")
    led.release("t1", 1.0)
    for i in range(20):  # other traffic, least-loaded placement spreads it
        led.enqueue(f"o{i}", 5, 1, 0, now=1.0, meta={PREFIX_META: _keys(f"other{i}")})
    led.grant(1.0)
    longer = _keys("system", "turn1", "turn2")
    led.enqueue("t2", 30, 25, 0, now=2.0, meta={PREFIX_META: longer})
    assert led.grant(2.0) == ["t2"]
    assert led.replica_of("t2") == first


def test_affinity_waits_a_bounded_time_then_goes_elsewhere() -> None:
    led = _ledger({A: 40, B: 40}, affinity_wait_s=0.5)
    convo = _keys("system", "turn1")
    led.enqueue("t1", 30, 20, 0, now=0.0, meta={PREFIX_META: convo})
    led.grant(0.0)
    home = led.replica_of("t1")
    led.enqueue("t2", 30, 25, 0, now=1.0, meta={PREFIX_META: _keys("system", "turn1", "turn2")})
    assert led.grant(1.0) == []  # the other replica has room, but t2's prefix is at home: it waits
    assert led.grant(1.4) == []
    assert led.grant(1.5) == ["t2"] and led.replica_of("t2") != home  # waited long enough: cold elsewhere


def test_session_key_pins_a_conversation() -> None:
    led = _ledger({A: 100, B: 100})
    led.enqueue("s1", 10, 1, 0, now=0.0, meta={SESSION_META: "alice"})
    led.grant(0.0)
    home = led.replica_of("s1")
    for i in range(3):
        led.enqueue(f"f{i}", 10, 1, 0, now=0.0)  # fill the home replica more than the other
    led.grant(0.0)
    led.enqueue("s2", 10, 1, 0, now=1.0, meta={SESSION_META: "alice"})
    led.grant(1.0)
    assert led.replica_of("s2") == home


def test_ejection_routes_around_and_keeps_what_the_replica_still_holds() -> None:
    led = _ledger({A: 10, B: 10}, health=HealthRules(consecutive_failures=3, base_ejection_s=10.0))
    led.enqueue("x", 10, 1, 0, now=0.0)
    led.enqueue("y", 10, 1, 0, now=0.0)
    led.grant(0.0)
    dead = led.replica_of("x")
    assert dead is not None
    assert not led.note_failure(dead, 1.0) and not led.note_failure(dead, 1.1)
    assert led.note_failure(dead, 1.2)  # the third consecutive failure ejects
    # its lease stays: its stream may still run (a replica ejected for 5xx answers is alive)
    assert led.replica_of("x") == dead and led.replicas[dead].lost_leases == 1
    assert led.limit == 10
    led.enqueue("z", 10, 1, 0, now=2.0)
    assert led.grant(2.0) == []  # only the live replica is available, and it is full
    assert led.due(5.0) == [] and led.due(11.2) == [dead]
    assert led.readmit(dead) and led.grant(11.2) == []  # back, but x still holds its blocks there
    led.release("x", 12.0)
    assert led.grant(12.0) == ["z"] and led.replica_of("z") == dead


def test_panic_mode_does_not_overcommit_an_ejected_replica() -> None:
    led = _ledger({A: 100})
    led.enqueue("a", 100, 1, 0, now=0.0)
    assert led.grant(0.0) == ["a"]
    led.note_failure(A, 0.5, connect=True)  # every replica ejected: panic mode routes to it anyway
    led.enqueue("b", 100, 1, 0, now=1.0)
    assert led.grant(1.0) == []  # ...but only within what it has room for


def test_an_affinity_wait_keeps_the_fallback_room_for_the_waiter() -> None:
    led = _ledger({A: 40, B: 40}, affinity_wait_s=0.5)
    led.enqueue("t1", 30, 20, 0, now=0.0, meta={SESSION_META: "s"})
    led.grant(0.0)
    home = led.replica_of("t1")
    led.enqueue("t2", 30, 25, 0, now=1.0, meta={SESSION_META: "s"})  # waits for its session's replica
    led.enqueue("batch", 30, 1, 9, now=1.0)  # lower priority, fits the other replica
    assert led.grant(1.0) == []  # the other replica is held for t2 while it waits
    assert led.grant(1.5) == ["t2"] and led.replica_of("t2") != home


def test_an_affinity_wait_never_outlives_the_starvation_bound() -> None:
    led = _ledger({A: 40, B: 40}, affinity_wait_s=5.0, starvation_bound_s=1.0)
    led.enqueue("t1", 30, 20, 0, now=0.0, meta={SESSION_META: "s"})
    led.grant(0.0)
    led.enqueue("t2", 30, 25, 0, now=1.0, meta={SESSION_META: "s"})
    assert led.grant(1.5) == []
    assert led.grant(2.0) == ["t2"]  # at the starvation bound it goes where there is room


def test_connect_error_ejects_at_once_and_backoff_grows() -> None:
    led = _ledger({A: 10, B: 10}, health=HealthRules(base_ejection_s=10.0, max_ejection_s=25.0))
    assert led.note_failure(A, 0.0, connect=True)
    assert led.replicas[A].ejected_until == 10.0
    led.readmit(A)
    led.note_failure(A, 11.0, connect=True)
    assert led.replicas[A].ejected_until == 31.0  # 2 x base
    led.readmit(A)
    led.note_failure(A, 32.0, connect=True)
    assert led.replicas[A].ejected_until == 57.0  # capped at max_ejection_s


def test_every_replica_ejected_is_panic_mode() -> None:
    led = _ledger({A: 10, B: 10})
    led.note_failure(A, 0.0, connect=True)
    led.note_failure(B, 0.0, connect=True)
    led.enqueue("w", 5, 1, 0, now=1.0)
    assert led.grant(1.0) == ["w"]  # sent rather than failed locally


def test_replicas_join_and_drain() -> None:
    led = _ledger({A: 10})
    led.enqueue("x", 10, 1, 0, now=0.0)
    led.grant(0.0)
    led.add_replica(B, 20)
    led.enqueue("y", 20, 1, 0, now=1.0)
    assert led.grant(1.0) == ["y"] and led.replica_of("y") == B
    led.remove_replica(A)
    assert A in led.replicas and led.replicas[A].draining  # its lease still runs
    led.release("x", 2.0)
    assert A not in led.replicas
    with pytest.raises(ConfigurationError):
        _ledger({})


# ------------------------------------------------------------------------------ the prefix index


def test_prefix_keys_share_message_prefixes() -> None:
    a = prefix_keys({"model": "m", "messages": [{"role": "system", "content": "s" * 400},
                                                {"role": "user", "content": "q1"}]}, 100, 16)
    b = prefix_keys({"model": "m", "messages": [{"role": "system", "content": "s" * 400},
                                                {"role": "user", "content": "q2"}]}, 100, 16)
    other_model = prefix_keys({"model": "n", "messages": [{"role": "system", "content": "s" * 400}]}, 100, 16)
    assert a[0][0] == b[0][0] and a[1][0] != b[1][0]
    assert other_model[0][0] != a[0][0]
    assert a[-1][1] == 100 // 16 and a[0][1] <= a[-1][1]
    text = prefix_keys({"model": "m", "prompt": "x" * 3000}, 750, 16)
    assert len(text) == 3 and text[-1][1] == 750 // 16
    assert prefix_keys({"model": "m"}, 10, 16) == ()


def test_prefix_index_lru_evicts_the_tail_first_and_is_bounded() -> None:
    idx = PrefixIndex(max_entries=1000)
    idx.set_capacity(A, 30)
    convo = _keys("sys", "t1", "t2")  # 10, 20, 30 blocks
    idx.insert(A, convo)
    assert idx.match(convo) == {A: 30}
    idx.insert(A, _keys("zzz"))  # 10 more blocks: over capacity, the LRU goes
    assert idx.blocks(A) <= 30
    assert idx.match(convo) == {A: 20}  # the tail (t2) went first; the shared head stays
    small = PrefixIndex(max_entries=5)
    small.set_capacity(A, 10**6)
    for i in range(20):
        small.insert(A, _keys(f"c{i}"))
    assert len(small) <= 5 and small.evictions == 15
    assert small.match(_keys("c19")) == {A: 10} and small.match(_keys("c0")) == {}
    idx.forget(A)
    assert len(idx) == 0 and idx.match(convo) == {}


def test_prefix_index_bound_is_shared_across_replicas() -> None:
    idx = PrefixIndex(max_entries=10)
    for i in range(10):
        idx.insert(A, _keys(f"a{i}"))
    idx.insert(B, _keys("b0"))  # a newcomer gets room: the busiest replica gives it up
    assert len(idx) <= 10 and idx.match(_keys("b0")) == {B: 10}


def test_prefix_index_counts_a_fork_below_the_recorded_keys_once() -> None:
    idx = PrefixIndex()
    idx.set_capacity(A, 10**6)
    msgs = [f"m{i}" for i in range(20)]
    convo = _keys(*msgs)  # 10 blocks per message
    idx.insert(A, convo)
    fork = _keys(*msgs[:10], "x", "y")
    idx.insert(A, fork)
    assert idx.blocks(A) == 200 + 20  # the shared 100 blocks are not counted twice


# ------------------------------------------------------------------------------ real HTTP


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return f"http://127.0.0.1:{port}/v1"


def _client(fleet: Fleet) -> openai.AsyncOpenAI:
    return wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)


@pytest.mark.anyio
@pytest.mark.slow
async def test_requests_route_across_replicas_and_metadata_passes_through() -> None:
    with LoopbackServer() as s1, LoopbackServer() as s2:
        fleet = Fleet([s1.base_url, s2.base_url], limit_blocks=4000, policy="strict")
        client = _client(fleet)
        try:
            with observe_admissions() as seen:
                replies = await asyncio.gather(*(client.chat.completions.create(
                    model="ok", max_tokens=8, messages=[{"role": "user", "content": f"q{i} " * 50}])
                    for i in range(8)))
            assert all(r.choices[0].message.content for r in replies)
            assert s1.llm_requests() and s2.llm_requests()  # both replicas served
            assert len(s1.llm_requests()) + len(s2.llm_requests()) == 8
            assert {i.replica for i in seen} == {s1.base_url, s2.base_url}
            models = await client.models.list()  # not admitted: sent to a replica, not the .invalid name
            assert [m.id for m in models.data]
            st = await fleet.status()
            assert set(st.extra["replicas"]) == {s1.base_url, s2.base_url}  # type: ignore[arg-type]
            assert st.leases == 0 and st.limit == 8000
        finally:
            await client.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
async def test_a_conversation_stays_on_its_replica() -> None:
    with LoopbackServer() as s1, LoopbackServer() as s2, LoopbackServer() as s3:
        fleet = Fleet([s1.base_url, s2.base_url, s3.base_url], limit_blocks=4000, policy="strict")
        client = _client(fleet)
        try:
            msgs: list[dict[str, str]] = [{"role": "system", "content": "You are an agent. " * 200}]
            homes = []
            for turn in range(6):
                msgs.append({"role": "user", "content": f"step {turn} " * 30})
                with observe_admissions() as seen:
                    r = await client.chat.completions.create(model="ok", max_tokens=8, messages=msgs)
                    # other conversations between the turns
                    await asyncio.gather(*(client.chat.completions.create(
                        model="ok", max_tokens=8, messages=[{"role": "user", "content": f"x{turn}{j} " * 40}])
                        for j in range(3)))
                homes.append(seen[0].replica)
                msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            assert len(set(homes)) == 1, homes
            rate = (await fleet.status()).extra["prefix_hit_rate"]
            assert isinstance(rate, float) and rate > 0
        finally:
            await client.close()


@pytest.mark.anyio
async def test_a_dead_replica_is_ejected_and_requests_move_without_spending_retries() -> None:
    dead = _dead_url()
    with LoopbackServer() as live:
        fleet = Fleet([dead, live.base_url], limit_blocks=4000, policy="strict")
        client = _client(fleet)
        try:
            with observe_admissions() as seen:
                replies = await asyncio.gather(*(client.chat.completions.create(
                    model="ok", max_tokens=8, messages=[{"role": "user", "content": f"q{i}"}])
                    for i in range(6)))
            assert len(replies) == 6 and len(live.llm_requests()) == 6
            assert all(i.attempt == 1 for i in seen)  # moves are not attempts
            st = await fleet.status()
            reps = st.extra["replicas"]
            assert reps[dead]["ejected"] and not reps[live.base_url]["ejected"]  # type: ignore[index]
            assert st.extra["moves"] >= 1  # type: ignore[operator]
            assert st.leases == 0
        finally:
            await client.close()


@pytest.mark.anyio
async def test_a_cut_stream_ends_with_a_typed_error() -> None:
    with LoopbackServer() as s1:
        fleet = Fleet([s1.base_url], limit_blocks=4000, policy="strict",
                      health=HealthRules(consecutive_failures=1))
        client = _client(fleet)
        try:
            stream = await client.chat.completions.create(
                model="reset", max_tokens=8, stream=True, messages=[{"role": "user", "content": "q"}])
            got = []
            with pytest.raises(StreamCut) as info:
                async for chunk in stream:
                    got.append(chunk)
            assert got  # it had started delivering
            assert info.value.replica == s1.base_url
            assert isinstance(info.value, (httpx.RemoteProtocolError, Exception))
            st = await fleet.status()
            assert st.leases == 0 and st.extra["replicas"][s1.base_url]["ejected"]  # type: ignore[index]
        finally:
            await client.close()


@pytest.mark.anyio
async def test_health_checks_eject_and_bring_back() -> None:
    with LoopbackServer() as s1, LoopbackServer() as s2:
        fleet = Fleet([s1.base_url, s2.base_url], limit_blocks=4000, policy="strict",
                      health=HealthRules(base_ejection_s=0.0))
        try:
            probes = {s1.base_url: True, s2.base_url: True}

            async def probe(url: str) -> bool:
                return probes[url]

            fleet._http = object()  # the probes below never use it
            fleet._probe = probe  # type: ignore[method-assign]
            probes[s2.base_url] = False
            await fleet.check_once()
            assert (await fleet.status()).extra["replicas"][s2.base_url]["ejected"]  # type: ignore[index]
            probes[s2.base_url] = True
            await fleet.check_once()
            assert not (await fleet.status()).extra["replicas"][s2.base_url]["ejected"]  # type: ignore[index]
        finally:
            fleet._http = None
            await fleet.aclose()
        # the real probe, against real /health endpoints and a dead port
        dead = _dead_url()
        fleet2 = Fleet([s1.base_url, dead], limit_blocks=100, policy="strict")
        async with fleet2:
            await fleet2.check_once()
            reps = (await fleet2.status()).extra["replicas"]
            assert reps[dead]["ejected"] and not reps[s1.base_url]["ejected"]  # type: ignore[index]


@pytest.mark.anyio
async def test_dns_re_resolution_adds_and_drains_replicas() -> None:
    answers = [["10.0.0.1", "10.0.0.2"]]

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "vllm.ns.svc" and port == 8000
        return answers[-1]

    fleet = await Fleet.from_dns("http://vllm.ns.svc:8000/v1", 100, resolver=resolver, policy="strict")
    fleet._probe = _true  # type: ignore[method-assign, assignment]
    fleet._http = object()
    assert fleet.replicas == ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]
    answers.append(["10.0.0.2", "10.0.0.3"])
    await fleet.check_once()
    assert fleet.replicas == ["http://10.0.0.2:8000/v1", "http://10.0.0.3:8000/v1"]
    answers.append([])  # a resolver that answers nothing keeps what it had
    await fleet.check_once()
    assert len(fleet.replicas) == 2
    fleet._http = None


async def _true(url: str) -> bool:
    return True


def test_fleet_arguments_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="not one string"):
        Fleet("http://a:8000/v1", limit_blocks=10)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="limit_blocks"):
        Fleet(["http://a:8000/v1"])
    with pytest.raises(ConfigurationError):
        Fleet(["not a url"], limit_blocks=10)
    for empty in ([], {}):  # a list or a mapping: no replica is an error, not an idle fleet
        with pytest.raises(ConfigurationError, match="at least one replica"):
            Fleet(empty, limit_blocks=10)
    fleet = Fleet({"http://a:8000/v1/": 10, "http://b:8000/v1": 20})
    assert fleet.limit == 30 and fleet.base_url == "http://fleet.zp-fleet.invalid/v1"
    with pytest.raises(ConfigurationError):
        fleet.set_limit_sync(5)


def test_status_shows_every_replica() -> None:
    from zp_client.status_cli import format_status, local_budget_status

    fleet = Fleet({A: 100, B: 50}, policy="strict")
    lease = fleet.acquire_sync(10, meta={PREFIX_META: _keys("sys")})
    fleet.eject(B)
    text = format_status({"budget": local_budget_status(fleet)})
    assert "replicas:         2" in text
    assert f"{A}: ok; limit 100, used 10, 1 leases" in text
    assert f"{B}: EJECTED; limit 50" in text
    lease.release_sync()


class _ResetBeforeFirstByte:
    """An OpenAI-shaped server whose streams answer 200 and then drop the connection before any byte."""

    def __init__(self) -> None:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        from tests._asgi_server import ThreadedApp

        self.calls = 0

        async def chat(request: Any) -> Any:
            self.calls += 1

            async def body() -> Any:
                raise ConnectionResetError("dropped before the first byte")
                yield b""  # pragma: no cover - makes this an async generator

            return StreamingResponse(body(), media_type="text/event-stream")

        async def models(request: Any) -> Any:
            return JSONResponse({"object": "list", "data": [{"id": "ok", "object": "model",
                                                             "max_model_len": 4096}]})

        app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                Route("/v1/models", models)])
        self.server = ThreadedApp(app)

    def __enter__(self) -> Any:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)

    @property
    def base_url(self) -> str:
        return str(self.server.base_url)


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_stream_cut_before_its_first_byte_moves_to_another_replica() -> None:
    with _ResetBeforeFirstByte() as bad, LoopbackServer() as good:
        fleet = Fleet([bad.base_url, good.base_url], limit_blocks=4000, policy="strict")
        client = _client(fleet)
        try:
            for i in range(4):
                with observe_admissions() as seen:
                    stream = await client.chat.completions.create(
                        model="ok", max_tokens=8, stream=True,
                        messages=[{"role": "user", "content": f"q{i}"}])
                    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                assert text  # complete, from the good replica
                assert seen[-1].replica == good.base_url and all(s.attempt == 1 for s in seen), seen
            assert bad.calls >= 1  # it was tried, and the caller never saw it
            st = await fleet.status()
            assert st.extra["moves"] == bad.calls and st.leases == 0
        finally:
            await client.close()


class _Always503(_ResetBeforeFirstByte):
    """A replica that answers every call 503 (overloaded)."""

    def __init__(self) -> None:
        super().__init__()
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from tests._asgi_server import ThreadedApp

        async def chat(request: Any) -> Any:
            self.calls += 1
            return JSONResponse({"error": {"message": "busy"}}, status_code=503)

        self.server = ThreadedApp(Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]))


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
async def test_a_retry_avoids_the_replica_that_failed_it() -> None:
    with _Always503() as bad, LoopbackServer() as good:
        fleet = Fleet([bad.base_url, good.base_url], limit_blocks=4000, policy="strict")
        client = _client(fleet)
        try:
            for i in range(4):
                with observe_admissions() as seen:
                    await client.chat.completions.create(model="ok", max_tokens=8,
                                                         messages=[{"role": "user", "content": f"q{i}"}])
                replicas = [s.replica for s in seen]
                assert replicas[-1] == good.base_url and replicas.count(bad.base_url) <= 1, replicas
        finally:
            await client.close()
