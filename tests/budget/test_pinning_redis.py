"""Pinned prefixes on a RedisBudget (pin.lua and common.lua's pins section) against the Python model
(LocalBudget's ledger and its PinBook): the same calls give the same keep-warm decisions; several
processes share one pin and one keep-warm; and the keep-warm keeps a prefix cached on the simulator
through three pools of traffic from 3 processes."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import multiprocessing as mp
import random
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from tests._redis_keys import delete_keys
from zp_client import PinnedPrefix, PinRefused, wrap
from zp_client.budget.local import LocalBudget
from zp_client.budget.redis import RedisBudget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
    from zp_sim.tokenizer import count_chat_tokens, make_text
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]
    count_chat_tokens = None  # type: ignore[assignment,misc]
    make_text = None  # type: ignore[assignment,misc]

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def rnames(redis_url: str, redis_prefix: str) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    delete_keys(redis_url, *names)


def member(prompt_blocks: int, key: str = "K", pblocks: int = 100, *, forecast: int = 64) -> dict[str, Any]:
    return {"prompt_tokens": prompt_blocks * 16, "forecast_tokens": forecast, "streaming": True,
            "prefix_key": key, "prefix_blocks": pblocks}


async def _scenario(budget: Any) -> list[Any]:
    """The ledger test's keep-warm scenario through the public budget API; returns what was observed."""
    seen: list[Any] = []

    async def flush() -> None:
        if hasattr(budget, "flush"):
            await budget.flush()

    await budget.pin("K", 100, margin=20)
    seen.append(("due", await budget.keepwarm_due()))
    kw = await budget.acquire(8, held=7, meta=member(7, forecast=1), priority=-100)
    kw.report_progress(7, first_token=True)
    await flush()
    await kw.release()
    seen.append(("due", await budget.keepwarm_due()))
    x = await budget.acquire(600, held=400, meta=member(400, key="X", pblocks=0))
    x.report_progress(500)
    await flush()
    await x.release()
    y = await budget.acquire(300, held=200, meta=member(200, key="Y", pblocks=0))
    seen.append(("due", await budget.keepwarm_due()))
    y.report_progress(290)
    await flush()
    await y.release()
    seen.append(("due", await budget.keepwarm_due()))
    # 100 more blocks would cross the line (1000 - 100 - 20 = 880 after 790): z waits for a keep-warm
    z = asyncio.create_task(budget.acquire(120, held=100, meta=member(100, key="Z", pblocks=0)))
    await asyncio.sleep(0.3)
    seen.append(("z waits", not z.done()))
    seen.append(("due", await budget.keepwarm_due()))
    seen.append(("claim", await budget.claim_keepwarm("K", 5.0), await budget.claim_keepwarm("K", 5.0)))
    kw2 = await budget.acquire(8, held=7, meta=member(7, forecast=1), priority=-100)
    await asyncio.sleep(0.3)
    seen.append(("z waits for the first token", not z.done()))
    kw2.report_progress(7, first_token=True)
    await flush()
    lz = await asyncio.wait_for(z, 5.0)
    seen.append(("z admitted", True))
    await kw2.release()
    await lz.release()
    st = await budget.status()
    seen.append(("after", st.used, st.leases))
    seen.append(("unpin", await budget.unpin("K"), await budget.unpin("K")))
    st = await budget.status()
    seen.append(("end", st.used, st.leases))
    return seen


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_redis_pins_decide_as_the_python_model(redis_url: str, rnames: list[str],
                                                     redis_prefix: str) -> None:
    local = LocalBudget(1000, 16)
    rnames.append(f"{redis_prefix}-conf")
    rb = RedisBudget(redis_url, rnames[-1], 1000, 16, recovery_s=0, poll_interval_s=0.05)
    try:
        expected = await _scenario(local)
        got = await _scenario(rb)
    finally:
        await rb.aclose()
    assert got == expected
    assert ("due", ["K"]) in expected and ("z waits for the first token", True) in expected


async def test_redis_pin_cap_sizes_and_policy(redis_url: str, rnames: list[str], redis_prefix: str) -> None:
    rnames += [f"{redis_prefix}-cap", f"{redis_prefix}-strict"]
    rb = RedisBudget(redis_url, rnames[0], 1000, 16, recovery_s=0)
    strict = RedisBudget(redis_url, rnames[1], 1000, 16, recovery_s=0, policy="strict")
    try:
        await rb.pin("a", 150)
        with pytest.raises(PinRefused, match="cap of 200"):
            await rb.pin("b", 51)
        await rb.pin("b", 50)
        await rb.pin("b", 50)  # idempotent (renews)
        with pytest.raises(ConfigurationError, match="already pinned with 50"):
            await rb.pin("b", 40)
        assert (await rb.status()).used == 200
        with pytest.raises(ConfigurationError, match="elastic"):
            await strict.pin("a", 10)
    finally:
        await rb.aclose()
        await strict.aclose()


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_pin_is_shared_by_processes_and_expires_with_its_holder(redis_url: str, rnames: list[str],
                                                                        redis_prefix: str) -> None:
    """Two budgets (two processes' handles) pin the same key: one lease, one keep-warm claim at a time;
    when the holder stops renewing, the other takes the pin over at its next renewal."""
    rnames.append(f"{redis_prefix}-share")
    a = RedisBudget(redis_url, rnames[0], 1000, 16, recovery_s=0, lease_ttl_s=0.6)
    b = RedisBudget(redis_url, rnames[0], 1000, 16, recovery_s=0, lease_ttl_s=0.6)
    try:
        await a.pin("K", 100)
        await b.pin("K", 100)
        assert (await a.status()).used == 100  # held once
        # warm it once, then make a keep-warm due: both see it, exactly one claims it
        le = await a.acquire(8, held=7, meta=member(7, forecast=1))
        le.report_progress(7, first_token=True)
        await a.flush()
        await le.release()
        big = await b.acquire(900, held=850, meta=member(850, key="X", pblocks=0))
        await big.release()
        assert await a.keepwarm_due() == ["K"] and await b.keepwarm_due() == ["K"]
        claims = await asyncio.gather(a.claim_keepwarm("K", 5.0), b.claim_keepwarm("K", 5.0))
        assert sorted(claims) == [False, True]
        # a stops (its pin lease is no longer renewed): b's renewal takes the pin over
        await a.aclose()
        await asyncio.sleep(1.2)
        st = await b.status()
        assert st.used == 100 and st.leases == 1
        assert await b.unpin("K") and (await b.status()).used == 0
    finally:
        await a.aclose()
        await b.aclose()


# --------------------------------------------------------------------------------------- 3 processes, the simulator's LRU


SIM_BLOCKS = 512


def _system(seed: int) -> dict[str, str]:
    return {"role": "system", "content": make_text(1200, random.Random(seed), "pinned agent")}


def _worker(url: str, name: str, base_url: str, model: str, seed: int, pinned: bool, target_blocks: int,
            out: Any) -> None:
    asyncio.run(_work(url, name, base_url, model, seed, pinned, target_blocks, out))


async def _work(url: str, name: str, base_url: str, model: str, seed: int, pinned: bool, target_blocks: int,
                out: Any) -> None:
    budget = RedisBudget(url, name, SIM_BLOCKS - 1, 16, recovery_s=0, poll_interval_s=0.05,
                         server_blocks=SIM_BLOCKS - 1)
    oc = wrap(openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0), budget,
              settings=Settings(estimator="heuristic"))
    pin = None
    try:
        if pinned:  # every process pins the same prefix: one pin, one keep-warm at a time
            pin = await PinnedPrefix(oc, model=model, messages=[_system(7)], poll_s=0.05).start()
        rng = random.Random(seed)
        doc = {"role": "system", "content": make_text(320, rng, f"doc {seed}")}
        sent = 0
        i = 0
        while sent < target_blocks:
            msgs = [{"role": "user", "content": make_text(rng.randint(250, 600), rng, f"other {seed}.{i}")}]
            if i % 3 == 2:
                msgs = [doc, *msgs]  # hits the document's blocks in the free queue
            n_out = rng.randint(40, 160)
            stream = await oc.chat.completions.create(model=model, messages=msgs, max_tokens=n_out, stream=True,
                                                      extra_body={"sim_output_tokens": n_out})
            async for _ in stream:
                pass
            sent += (count_chat_tokens(msgs) + n_out) // 16
            i += 1
        out.put(("ok", sent, pin.keepwarms_sent if pin else 0))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", repr(exc), 0))
    finally:
        # a cleanup that hangs (seen once in CI, after the result was sent: issue 20's note) prints every
        # thread's stack to this worker's stderr and exits, instead of outliving the test
        faulthandler.dump_traceback_later(20, exit=True)
        if pin is not None:
            await pin.aclose()
        await oc.close()
        await budget.aclose()


async def _probe(oc: Any, sim: SimServer, rid: str) -> int:
    stream = await oc.chat.completions.create(
        model=sim.model, messages=[_system(7), {"role": "user", "content": "probe"}], max_tokens=2,
        stream=True, extra_headers={"X-Request-Id": rid}, extra_body={"sim_output_tokens": 2})
    async for _ in stream:
        pass
    recs = [r for r in sim.stats(requests=True)["requests"] if r["id"] == f"chatcmpl-{rid}"]
    return int(recs[-1]["cached_tokens"])


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.needs_sim
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
async def test_three_processes_keep_the_pinned_prefix_cached(redis_url: str, rnames: list[str],
                                                             redis_prefix: str, pinned: bool) -> None:
    rnames.append(f"{redis_prefix}-lru-{uuid.uuid4().hex[:6]}")
    name = rnames[-1]
    prefix_full = count_chat_tokens([_system(7)]) // 16 * 16
    with SimServer(profile="tiny", speedup=5.0) as sim:
        budget = RedisBudget(redis_url, name, SIM_BLOCKS - 1, 16, recovery_s=0, poll_interval_s=0.05,
                             server_blocks=SIM_BLOCKS - 1)
        oc = wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0), budget,
                  settings=Settings(estimator="heuristic"))
        pin = None
        try:
            if pinned:
                pin = await PinnedPrefix(oc, model=sim.model, messages=[_system(7)], poll_s=0.05).start()
            assert await _probe(oc, sim, "first") == 0  # its first use prefills it
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            procs = [ctx.Process(target=_worker, args=(redis_url, name, sim.base_url, sim.model, 20 + k,
                                                       pinned, SIM_BLOCKS, out)) for k in range(3)]
            for p in procs:
                p.start()
            results = [await asyncio.to_thread(out.get, True, 240) for _ in procs]
            for p in procs:
                p.join(30)
            for p in procs:  # never left running into the next tests (they count live child processes)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            assert all(r[0] == "ok" for r in results), results
            assert sum(r[1] for r in results) >= 3 * (SIM_BLOCKS - 1)
            cached = await _probe(oc, sim, "after")
            kws = [r for r in sim.stats(requests=True)["requests"] if r["id"].startswith("chatcmpl-zp-keepwarm-")]
            if pinned:
                assert cached >= 0.9 * prefix_full, (cached, prefix_full, len(kws))
                assert len(kws) >= 1
                # one keep-warm at a time across the four processes: none overlaps another
                spans = sorted((r["arrival_s"], r["finish_s"] or r["arrival_s"]) for r in kws)
                assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
            else:
                assert cached < 0.5 * prefix_full and not kws
        finally:
            if pin is not None:
                await pin.aclose()
            await oc.close()
            with contextlib.suppress(Exception):
                st = await budget.status()
                assert st.used == 0 or not pinned
            await budget.aclose()


# --------------------------------------------------------------------------------------- conformance (hypothesis)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_redis_pins_conform_to_the_pin_book(redis_url: str, redis_prefix: str) -> None:
    """test_redis_elastic's state machine (RedisBudget against the elastic Ledger: acquire with prefix
    keys, progress with first tokens, release, cancel) with pins, unpins and keep-warm claims added; after
    every step both must also agree on which keep-warms are due and on every pin's count since its
    release, free blocks then and members."""
    import json

    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

    from tests.budget.test_redis_elastic import FULL_BACKFILL, _make_machine
    from tests.budget.test_redis_elastic import _progress as progress_fields

    names = [redis_prefix]
    base = _make_machine(redis_url, names, FULL_BACKFILL, draw_reserves=False)
    r = redis.Redis.from_url(redis_url)
    seen = {"steps": 0, "due": 0, "released": 0, "waiting": 0, "gated": 0}

    class PinMachine(base):  # type: ignore[misc, valid-type]
        @initialize(blocks=st.integers(1, 3), margin=st.integers(0, 2))
        def start_pinned(self, blocks: int, margin: int) -> None:
            """Every run starts with A pinned and used once (so its count has begun)."""
            self.pin("A", blocks, margin, 0)
            self.touch("A", blocks + 1, blocks, False)
        @rule(key=st.sampled_from(["A", "B"]), blocks=st.integers(1, 4), margin=st.integers(0, 3),
              span=st.integers(0, 2))
        def pin(self, key: str, blocks: int, margin: int, span: int) -> None:
            err_model = err_redis = None
            try:
                self.model.pin(key, blocks, 0.0, margin=margin, span=blocks + span)
            except Exception as exc:  # noqa: BLE001 - compared with Redis's
                err_model = type(exc)
            try:
                self.run(self.budget.pin(key, blocks, margin=margin, span=blocks + span))
            except Exception as exc:  # noqa: BLE001
                err_redis = type(exc)
            assert err_model == err_redis  # (pin.lua runs no grant pass: a new pin admits nobody)
            self.settle()

        @rule(key=st.sampled_from(["A", "B"]), blocks=st.integers(1, 6), pb=st.integers(1, 4),
              hold=st.booleans())
        def touch(self, key: str, blocks: int, pb: int, hold: bool) -> None:
            """A member's whole life when it is admitted at once: first token, then (unless ``hold``)
            its end, the prefix's release."""
            meta = {"prompt_tokens": blocks * 4, "forecast_tokens": 2, "streaming": True, "prefix_key": key,
                    "prefix_blocks": pb}
            before = set(self.leases)
            self.acquire(blocks, 4, 0, meta)
            new = [lbl for lbl in self.leases if lbl not in before]
            if not new:
                return
            lbl = new[0]
            self.leases[lbl].report_progress(blocks, first_token=True)
            self.model.report_held(lbl, blocks)
            self.model.update_meta(lbl, first_token=True)
            self.model.grant(0.0)
            self.settle()
            if not hold:
                self.run(self.leases.pop(lbl).release())
                self.model.release(lbl, 0.0)
                self.model.grant(0.0)
                self.settle()

        @rule(blocks=st.integers(4, 14), grow=st.integers(0, 3))
        def churn(self, blocks: int, grow: int) -> None:
            """Other traffic (no pinned prefix) admitted at once, growing, then ending: what pushes a
            pinned prefix towards eviction."""
            meta = {"prompt_tokens": blocks * 4, "forecast_tokens": 8, "streaming": True, "prefix_key": "X"}
            before = set(self.leases)
            self.acquire(min(14, blocks + grow), 4 * blocks // min(14, blocks + grow), 0, meta)
            new = [lbl for lbl in self.leases if lbl not in before]
            if not new:
                return
            lbl = new[0]
            held = self.model.lease(lbl).held + grow
            self.leases[lbl].report_progress(held)
            self.model.report_held(lbl, held)
            if grow:  # a report goes out (and Redis runs a grant pass) only when held moved
                self.model.grant(0.0)
            self.settle()
            self.run(self.leases.pop(lbl).release())
            self.model.release(lbl, 0.0)
            self.model.grant(0.0)
            self.settle()

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data(), held=st.integers(-1, 16), fields=progress_fields)
        def progress(self, data: st.DataObject, held: int, fields: dict[str, Any]) -> None:
            """The base rule, with the model's grant pass only when Redis runs one: when a report goes
            out (held moved, or any metadata: ``settle`` flushes what is batched). With pins a pass is
            not idempotent (it marks the pins a waiter would cross), so an extra one in the model alone
            would diverge."""
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            lease = self.leases[lbl]
            before = self.model.lease(lbl).held
            lease.report_progress(held, **fields)
            self.model.report_held(lbl, held)
            if fields:
                self.model.update_meta(lbl, **fields)
            if min(max(held, 0), lease.bound) != before or fields:
                self.model.grant(0.0)
            self.settle()

        @rule(key=st.sampled_from(["A", "B"]))
        def unpin(self, key: str) -> None:
            done = self.run(self.budget.unpin(key))
            assert done == self.model.unpin(key, 0.0)
            if done:  # its lease went back: a grant pass (pin.lua runs none for a key not pinned)
                self.model.grant(0.0)
            self.settle()

        @rule(key=st.sampled_from(["A", "B"]))
        def claim(self, key: str) -> None:
            assert self.run(self.budget.claim_keepwarm(key, 100.0)) == self.model.pins.claim(key, 0.0, 100.0)
            self.settle()

        def teardown(self) -> None:
            for key in ("A", "B"):
                self.run(self.budget.unpin(key))
            super().teardown()

        def settle(self) -> None:
            super().settle()
            assert sorted(self.run(self.budget.keepwarm_due())) == sorted(self.model.pins.due(0.0))
            prefix = f"{{zp:{self.budget.name}}}"
            raw = {k.decode(): json.loads(v) for k, v in r.hgetall(f"{prefix}:pins").items()}
            chg = int(r.hget(f"{prefix}:meta", "chg") or 0)
            book = self.model.pins
            seen["steps"] += 1
            seen["due"] += bool(book.due(0.0))
            seen["released"] += any(p.free_at_release is not None for p in book)
            seen["waiting"] += bool(self.tasks) and bool(len(book))
            seen["gated"] += any(p.gated_since is not None for p in book)
            assert sorted(raw) == sorted(p.key for p in book)
            for p in book:
                q = raw[p.key]
                assert (chg - q["mk"], q.get("f"), q.get("iu", 0), q.get("wu", 0), q["mg"], q["s"]) == (
                    book.charged - p.mark, p.free_at_release, len(p.in_use), len(p.warming), p.margin,
                    p.span), (p, q)

    try:
        # derandomized: the same runs every time (a random draw can miss the due and gated states the
        # last assertion asks for: seed 35 reached neither in 2,127 steps)
        run_state_machine_as_test(PinMachine, settings=settings(
            max_examples=60, stateful_step_count=30, deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ))
    finally:
        r.close()
        delete_keys(redis_url, *names[1:])
    # the runs reach the states that matter (a run measured ~1,200 of ~2,200 steps with a released pin,
    # ~50 with a keep-warm due, ~85 with a waiter held back)
    assert seen["released"] > 0 and seen["due"] + seen["gated"] > 0, seen
