"""The client's two-phase lease on a disaggregated fleet (``Fleet.disaggregate``, issue 20), against the
simulator's prefill and decode servers over real HTTP on loopback: every exit path releases both legs,
the prefill leg lives exactly as long as the prefill server holds the KV, and a decode pool saturated for
longer than vLLM's lease lets no lease expire."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from tests._redis_keys import delete_keys
from tests.fleet.test_fleet import _dead_url  # a port nothing listens on
from zp_client import Fleet, wrap
from zp_client.errors import ConfigurationError
from zp_client.fleet.pd import PREFILL_KV_PARAMS, decode_body, kv_params_of, prefill_body
from zp_sim.server import SimServer
from zp_sim.tokenizer import make_text

LIMIT = 480  # the tiny profile's pool is 511 blocks


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _messages(tokens: int, seed: int = 1) -> list[dict[str, str]]:
    return [{"role": "system", "content": make_text(tokens, random.Random(seed), f"pd{seed}")},
            {"role": "user", "content": "go"}]


def _fleets(prefill: list[str], decode: list[str], **kw: Any) -> tuple[Fleet, Fleet]:
    pre = Fleet(prefill, limit_blocks=LIMIT, policy="strict")
    dec = Fleet(decode, limit_blocks=kw.pop("decode_limit", LIMIT), policy="elastic")
    return dec.disaggregate(pre, **kw), pre


async def _settled(*checks: Any, timeout: float = 5.0) -> None:
    """Wait until every check (a callable) holds: the servers free and the budgets release on their own
    schedule."""
    for _ in range(int(timeout / 0.02)):
        if all(c() for c in checks):
            return
        await asyncio.sleep(0.02)
    assert all(c() for c in checks), [c() for c in checks]


async def _streamed_text(client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int) -> str:
    out = []
    stream = await client.chat.completions.create(model="sim-llama", messages=messages,
                                                  max_tokens=max_tokens, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
    return "".join(out)


def _idle(fleet: Fleet) -> bool:
    st = fleet.status_sync()
    return st.leases == 0 and st.held == 0 and st.used == 0


@contextlib.asynccontextmanager
async def _pd(prefill_kw: dict[str, Any] | None = None, decode_kw: dict[str, Any] | None = None,
              ) -> AsyncIterator[tuple[SimServer, SimServer]]:
    async with SimServer("tiny", speedup=20.0, role="prefill", **(prefill_kw or {})) as p, \
            SimServer("tiny", speedup=20.0, role="decode", kv_transfer_s_per_block=0.001,
                      **(decode_kw or {})) as d:
        yield p, d


@contextlib.asynccontextmanager
async def _pd_client(threshold_tokens: float = 0, **fleet_kw: Any
                     ) -> AsyncIterator[tuple[SimServer, SimServer, Fleet, Fleet, openai.AsyncOpenAI]]:
    """A prefill and a decode simulator, the disaggregated fleet over them and a wrapped openai client."""
    async with _pd() as (p, d):
        fleet, pre = _fleets([p.base_url], [d.base_url], threshold_tokens=threshold_tokens, **fleet_kw)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)
        try:
            yield p, d, fleet, pre, client
        finally:
            await client.close()


def test_the_bodies_are_the_example_proxys() -> None:
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 3}
    pre = prefill_body(body)
    assert pre["kv_transfer_params"] == PREFILL_KV_PARAMS and pre["stream"] is False
    assert pre["max_tokens"] == pre["max_completion_tokens"] == 1
    assert "stream_options" not in pre and "min_tokens" not in pre and body["max_tokens"] == 50
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}
    assert decode_body(body, kv)["kv_transfer_params"] == kv and decode_body(body, None) == body
    assert kv_params_of(b'{"kv_transfer_params": {"a": 1}}') == {"a": 1}
    for bad in (b"", b"[]", b"{}", b'{"kv_transfer_params": null}', b'{"kv_transfer_params": {}}', b"\xff"):
        assert kv_params_of(bad) is None


def test_disaggregate_checks_its_arguments() -> None:
    dec = Fleet(["http://127.0.0.1:1/v1"], limit_blocks=LIMIT)
    pre = Fleet(["http://127.0.0.1:2/v1"], limit_blocks=LIMIT, policy="strict")
    with pytest.raises(ConfigurationError, match="strict"):
        dec.disaggregate(Fleet(["http://127.0.0.1:2/v1"], limit_blocks=LIMIT))
    with pytest.raises(ConfigurationError, match="own prefill"):
        dec.disaggregate(dec)
    with pytest.raises(ConfigurationError, match="fleet of the prefill"):
        dec.disaggregate(object())
    for bad in (-1, float("nan"), "512", True):
        with pytest.raises(ConfigurationError, match="threshold_tokens"):
            dec.disaggregate(pre, threshold_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="kv_lease_s"):
        dec.disaggregate(pre, kv_lease_s=0)
    with pytest.raises(ConfigurationError, match="block_size"):
        dec.disaggregate(Fleet(["http://127.0.0.1:3/v1"], limit_blocks=LIMIT, policy="strict", block_size=32))
    assert dec.disaggregate(pre, threshold_tokens=math.inf) is dec and dec.pd is not None
    with pytest.raises(ConfigurationError, match="itself disaggregated"):
        Fleet(["http://127.0.0.1:4/v1"], limit_blocks=LIMIT).disaggregate(dec)


@pytest.mark.anyio
@pytest.mark.slow
async def test_streamed_and_non_streamed_calls_take_both_legs_and_release_both() -> None:
    async with _pd_client(threshold_tokens=256) as (p, d, fleet, pre, client):
        def streamed(i: int) -> Any:
            return _streamed_text(client, _messages(600, i), 12)

        async def plain(i: int) -> str:
            r = await client.chat.completions.create(model="sim-llama", messages=_messages(600, i),
                                                     max_tokens=12)
            return r.choices[0].message.content or ""

        texts = await asyncio.gather(streamed(1), streamed(2), plain(3), plain(4))
        assert all(texts)
        assert fleet.pd.counts["prefills"] == 4 and "direct" not in fleet.pd.counts
        extra = fleet.status_sync().extra["pd"]
        assert extra["counts"]["prefills"] == 4 and extra["prefill"]["limit"] == LIMIT
        await _settled(lambda: _idle(fleet), lambda: _idle(pre),
                       lambda: p.stats()["kv"]["held_blocks"] == 0)
        kv_p, kv_d = p.stats()["kv"], d.stats()["kv"]
        assert kv_p["kv_freed_read"] == 4 and kv_p["kv_expired"] == 0
        assert kv_d["kv_remote"] == 4 and kv_d["kv_local_fallback"] == 0
        assert kv_d["kv_read_freed"] == 0
        # each ~600-token prompt's blocks came from the prefill server (about 37 each)
        assert kv_d["pulled_blocks_total"] >= 4 * 30


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_short_uncached_prompt_goes_straight_to_its_decode_replica() -> None:
    async with _pd_client(threshold_tokens=256) as (p, d, fleet, pre, client):
        r = await client.chat.completions.create(model="sim-llama", messages=_messages(40), max_tokens=5)
        assert r.choices[0].message.content
        assert fleet.pd.counts == {"direct": 1} and p.stats()["engine"]["prompt_tokens_total"] == 0
        # a long prompt whose prefix the decode replica has cached: only the uncached suffix counts
        long = _messages(600, 7)
        await client.chat.completions.create(model="sim-llama", messages=long, max_tokens=5)
        assert fleet.pd.counts["prefills"] == 1
        long[-1]["content"] = "go on"
        await client.chat.completions.create(model="sim-llama", messages=long, max_tokens=5)
        assert fleet.pd.counts["direct"] == 2 and fleet.pd.counts["prefills"] == 1
        await _settled(lambda: _idle(fleet), lambda: _idle(pre))


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_prefill_answer_without_kv_transfer_params_is_prefilled_on_the_decode_replica() -> None:
    async with SimServer("tiny", speedup=20.0) as plain, SimServer("tiny", speedup=20.0, role="decode") as d:
        fleet, pre = _fleets([plain.base_url], [d.base_url], threshold_tokens=0)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)
        try:
            r = await client.chat.completions.create(model="sim-llama", messages=_messages(600), max_tokens=6)
            assert r.choices[0].message.content
            assert fleet.pd.counts == {"prefills": 1, "local": 1}
            kv = d.stats()["kv"]
            assert kv["kv_remote"] == 0 and kv["pulled_blocks_total"] == 0  # the whole prompt, locally
            await _settled(lambda: _idle(fleet), lambda: _idle(pre))
        finally:
            await client.close()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
async def test_a_decode_replica_that_rejects_is_retried_elsewhere_with_the_prefills_params() -> None:
    # a 2 s lease (40 virtual s at speedup 20): longer than the first retry's backoff (at most 0.5 s), so
    # the first prefill leg is dropped before its KV's lease ends and is held to it
    async with _pd(prefill_kw={"kv_lease_s": 40.0}) as (p, d), \
            SimServer("tiny", speedup=20.0, role="decode", max_num_queued_reqs=0) as full:
        # the full replica comes first: the two are equally loaded, so it is placed there first
        fleet, pre = _fleets([p.base_url], [full.base_url, d.base_url], threshold_tokens=0, kv_lease_s=2.0)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x", max_retries=0), budget=fleet)
        try:
            r = await client.chat.completions.create(model="sim-llama", messages=_messages(600), max_tokens=6)
            assert r.choices[0].message.content
            assert full.stats()["rejected_queue_full"] == 1
            # an error answer may come after the scheduler saw the call (the rejecting replica told the
            # prefill server to free): those parameters are never sent again, the retry prefills again
            assert fleet.pd.counts["prefills"] == 2 and "reused" not in fleet.pd.counts
            assert p.stats()["kv"]["kv_freed_abort"] == 1 and p.stats()["kv"]["kv_freed_read"] == 1
            assert d.stats()["kv"]["kv_remote"] == 1 and d.stats()["kv"]["kv_read_freed"] == 0
            # its first prefill leg is held until vLLM's lease on that KV would have ended (unknown to zp
            # whether the replica freed it), then released
            assert fleet.pd.counts["held_to_expiry"] == 1
            await _settled(lambda: _idle(fleet), lambda: _idle(pre))
        finally:
            await client.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_decode_call_that_reached_no_replica_reuses_the_prefill_on_another() -> None:
    async with _pd() as (p, d):
        fleet, pre = _fleets([p.base_url], [_dead_url(), d.base_url], threshold_tokens=0)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x", max_retries=0), budget=fleet)
        try:
            r = await client.chat.completions.create(model="sim-llama", messages=_messages(600), max_tokens=6)
            assert r.choices[0].message.content
            # refused connection: no decode replica had it, so its KV went to the live one unrecomputed
            assert fleet.pd.counts["prefills"] == 1 and fleet.pd.counts["reused"] == 1
            assert d.stats()["kv"]["kv_remote"] == 1 and d.stats()["kv"]["kv_read_freed"] == 0
            assert p.stats()["kv"]["kv_freed_read"] == 1
            await _settled(lambda: _idle(fleet), lambda: _idle(pre))
        finally:
            await client.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_cancelled_before_the_prefill_answered_releases_both_legs_and_the_server_aborts() -> None:
    async with SimServer("tiny", speedup=0.01, role="prefill") as p, \
            SimServer("tiny", speedup=20.0, role="decode") as d:
        fleet, pre = _fleets([p.base_url], [d.base_url], threshold_tokens=0)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)
        try:
            task = asyncio.create_task(client.chat.completions.create(
                model="sim-llama", messages=_messages(1500), max_tokens=6))
            await _settled(lambda: p.stats()["in_flight"] > 0)
            assert pre.status_sync().leases == 1 and fleet.status_sync().leases == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert _idle(fleet) and _idle(pre)  # at once: the prefill server aborts it
            await _settled(lambda: p.stats()["in_flight"] == 0)
            assert p.stats()["aborted_disconnect"] == 1
            assert p.stats()["kv"]["held_blocks"] == 0 and d.stats()["engine"]["prompt_tokens_total"] == 0
        finally:
            await client.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_cancelled_mid_decode_stream_releases_both_legs_once() -> None:
    async with _pd_client(threshold_tokens=0) as (p, d, fleet, pre, client):
        stream = await client.chat.completions.create(model="sim-llama", messages=_messages(600),
                                                      max_tokens=400, stream=True)
        async for _ in stream:
            break  # first bytes: the decode replica has read the KV, the prefill leg is gone
        assert _idle(pre) and fleet.status_sync().leases == 1
        await stream.close()
        assert _idle(fleet)
        await _settled(lambda: d.stats()["engine"]["num_running"] == 0)
        assert p.stats()["kv"]["kv_freed_read"] == 1 and p.stats()["kv"]["held_blocks"] == 0


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
async def test_cancelled_between_the_two_calls_holds_the_prefill_leg_until_vllms_lease_ends() -> None:
    # a decode replica that accepts connections and never answers: the call is cancelled after the
    # prefill answered and before any decode replica has the request, so the KV waits on the prefill
    # server until its lease expires, and the prefill leg with it (released once, then)
    hung: list[asyncio.StreamWriter] = []

    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (await reader.readline()).startswith(b"GET"):  # metadata: not found (the core goes on)
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        hung.append(writer)

    server = await asyncio.start_server(never, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with SimServer("tiny", speedup=20.0, role="prefill", kv_lease_s=40.0) as p:  # 2 s real
        fleet, pre = _fleets([p.base_url], [f"http://127.0.0.1:{port}/v1"], threshold_tokens=0,
                             kv_lease_s=2.0)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x", max_retries=0), budget=fleet)
        try:
            task = asyncio.create_task(client.chat.completions.create(
                model="sim-llama", messages=_messages(600), max_tokens=6))
            await _settled(lambda: bool(hung))  # the prefill answered and the decode call is out
            assert p.stats()["kv"]["held_blocks"] > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert _idle(fleet) and pre.status_sync().leases == 1  # the KV is still on the prefill server
            assert fleet.pd.counts["held_to_expiry"] == 1
            await _settled(lambda: _idle(pre))
            await _settled(lambda: p.stats()["kv"]["kv_expired"] == 1)
            assert p.stats()["kv"]["held_blocks"] == 0
        finally:
            await client.close()
            for w in hung:
                w.close()
            server.close()


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_decode_pool_saturated_longer_than_the_lease_expires_no_prefill_lease() -> None:
    # the decode fleet admits about one of these at a time, each decoding for ~3 virtual s; vLLM's lease
    # is 1 virtual s: the waiters wait in zp's line with nothing on the prefill server
    async with _pd(prefill_kw={"kv_lease_s": 1.0}) as (p, d):
        fleet, pre = _fleets([p.base_url], [d.base_url], threshold_tokens=0, decode_limit=160,
                             kv_lease_s=1.0 / 20)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)
        try:
            async def one(i: int) -> None:
                r = await client.chat.completions.create(
                    model="sim-llama", messages=_messages(1200, i), max_tokens=500,
                    extra_body={"sim_output_tokens": 500})
                assert r.usage is not None and r.usage.completion_tokens == 500

            await asyncio.gather(*(one(i) for i in range(4)))
            kv = p.stats()["kv"]
            assert kv["kv_expired"] == 0 and kv["kv_freed_read"] == 4
            assert d.stats()["engine"]["preemptions_total"] == 0
            assert fleet.pd.counts["prefills"] == 4 and "held_to_expiry" not in fleet.pd.counts
            await _settled(lambda: _idle(fleet), lambda: _idle(pre))
        finally:
            await client.close()


def test_the_blocking_client_takes_both_legs_too() -> None:
    async def main() -> None:
        async with _pd() as (p, d):
            fleet, pre = _fleets([p.base_url], [d.base_url], threshold_tokens=0)

            def call() -> str:
                client = wrap(openai.OpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)
                with client:
                    r = client.chat.completions.create(model="sim-llama", messages=_messages(600),
                                                       max_tokens=6)
                    return r.choices[0].message.content or ""

            assert await asyncio.to_thread(call)
            assert fleet.pd.counts["prefills"] == 1
            await _settled(lambda: _idle(fleet), lambda: _idle(pre))
            assert p.stats()["kv"]["kv_freed_read"] == 1

    asyncio.run(main())


@pytest.mark.anyio
async def test_both_legs_on_redis_fleets(redis_url: str, redis_prefix: str) -> None:
    from zp_client.fleet.redis import RedisFleet

    names = (f"{redis_prefix}-decode", f"{redis_prefix}-prefill")
    async with _pd() as (p, d):
        dec = RedisFleet(redis_url, names[0], [d.base_url], LIMIT, policy="elastic", recovery_s=0)
        pre = RedisFleet(redis_url, names[1], [p.base_url], LIMIT, policy="strict", recovery_s=0)
        fleet = dec.disaggregate(pre, threshold_tokens=0)
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)
        try:
            plain = client.chat.completions.create(model="sim-llama", messages=_messages(600, 2),
                                                   max_tokens=8)
            s, r = await asyncio.gather(_streamed_text(client, _messages(600, 1), 8), plain)
            assert s and r.choices[0].message.content
            assert fleet.pd.counts["prefills"] == 2
            assert (await fleet.status()).extra["pd"]["prefill"]["leases"] == 0
            for f in (dec, pre):
                st = await f.status()
                assert st.leases == 0 and st.held == 0, st
            await _settled(lambda: p.stats()["kv"]["held_blocks"] == 0)
            assert p.stats()["kv"]["kv_freed_read"] == 2 and d.stats()["kv"]["kv_remote"] == 2
        finally:
            await client.close()
            await fleet.aclose()  # closes its prefill fleet too
            delete_keys(redis_url, *names)


@pytest.mark.anyio
@pytest.mark.slow
async def test_the_drop_in_async_client_takes_both_legs() -> None:
    from zp_client import AsyncClient

    async with _pd() as (p, d):
        fleet, pre = _fleets([p.base_url], [d.base_url], threshold_tokens=0)
        async with AsyncClient(fleet.base_url, api_key="x", budget=fleet) as client:
            r = await client.chat.completions.create(model="sim-llama", messages=_messages(600), max_tokens=6)
            assert r.choices[0].message.content
        assert fleet.pd.counts["prefills"] == 1 and d.stats()["kv"]["kv_remote"] == 1
        await _settled(lambda: _idle(fleet), lambda: _idle(pre))


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
async def test_a_kept_prefill_waits_for_decode_room_only_while_its_kv_lives_then_prefills_again() -> None:
    # the decode call's first replica refuses connections (ejected at once); the other is full (a lease
    # the test holds), so the decode leg that would reuse the prefill's KV waits only while that KV may
    # still be read (kv_lease_s / 2), then the prefill leg goes (held until the KV's lease ends) and the
    # request prefills again once room comes
    async with _pd(prefill_kw={"kv_lease_s": 20.0}) as (p, d):  # 1 s real at speedup 20
        dead = _dead_url()
        pre = Fleet([p.base_url], limit_blocks=LIMIT, policy="strict")
        fleet = Fleet({dead: 100, d.base_url: LIMIT}, policy="elastic").disaggregate(
            pre, threshold_tokens=0, kv_lease_s=1.0)
        blocker = await fleet.acquire(LIMIT - 10)  # too large for the dead replica's 100: on the live one
        assert getattr(blocker, "replica", None) == d.base_url.rstrip("/")
        client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x", max_retries=0), budget=fleet)
        try:
            task = asyncio.create_task(client.chat.completions.create(
                model="sim-llama", messages=_messages(600), max_tokens=6))
            await _settled(lambda: fleet.pd.counts.get("held_to_expiry", 0) == 1)
            assert fleet.pd.counts["prefills"] == 1 and "reused" not in fleet.pd.counts
            assert not task.done()
            await blocker.release()
            r = await task
            assert r.choices[0].message.content
            assert fleet.pd.counts["prefills"] == 2
            assert d.stats()["kv"]["kv_remote"] == 1 and d.stats()["kv"]["kv_read_freed"] == 0
            await _settled(lambda: _idle(fleet), lambda: _idle(pre),
                           lambda: p.stats()["kv"]["kv_expired"] == 1)  # the first KV, never read
        finally:
            await client.close()


@pytest.mark.anyio
async def test_the_deadline_bounds_both_legs_waits() -> None:
    from zp_client.errors import AdmissionTimeout

    async with _pd_client(threshold_tokens=0) as (p, d, fleet, pre, client):
        blocker = await pre.acquire(LIMIT)  # the prefill pool is full: the prefill leg waits
        try:
            with pytest.raises(AdmissionTimeout):  # DeadlineExceeded is one
                await client.chat.completions.create(model="sim-llama", messages=_messages(600), max_tokens=6,
                                                     extra_headers={"X-ZP-Deadline": "0.3"})
        finally:
            await blocker.release()
        assert _idle(fleet) and _idle(pre) and fleet.pd.counts == {}
        for server in (p, d):  # neither was sent anything
            assert server.stats()["engine"]["prompt_tokens_total"] == 0
