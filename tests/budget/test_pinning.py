"""Pinned prefixes: the ledger's bookkeeping (pins.py, the elastic projection's pinned groups) and the
keep-warm against the simulator's own LRU prefix cache, over real HTTP on loopback."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from zp_client import PinnedPrefix, PinRefused, wrap
from zp_client.budget.elastic import make_policy, projected_peak
from zp_client.budget.ledger import Ledger
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError
from zp_client.pinning import KEEPWARM_REQUEST_PREFIX

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


def member(prompt_blocks: int, key: str = "K", pblocks: int = 100, *, forecast: int = 64,
           streaming: bool = True, **extra: Any) -> dict[str, Any]:
    return {"prompt_tokens": prompt_blocks * 16, "forecast_tokens": forecast, "streaming": streaming,
            "prefix_key": key, "prefix_blocks": pblocks, **extra}


def elastic_ledger(limit: int = 1000) -> Ledger:
    return Ledger(limit, policy=make_policy("elastic", block_size=16))


# --------------------------------------------------------------------------------------- the ledger


def test_a_pin_holds_its_blocks_once_and_members_are_charged_without_them() -> None:
    led = elastic_ledger()
    led.pin("K", 100, 0.0)
    assert led.used == 100 and led.held_distinct == 100
    led.enqueue("a", 400, 160, 0, 0.0, meta=member(160))
    led.enqueue("b", 400, 160, 0, 0.0, meta=member(160))
    led.enqueue("c", 400, 160, 0, 0.0, meta=member(160, streaming=False, forecast=32))
    assert led.grant(0.0) == ["a", "b", "c"]
    # each member adds its 60 blocks past the prefix (and its projected growth), never the prefix again
    without_pin = [(r.held, r.bound, r.meta) for r in led.leases.values() if not r.meta.get("pinned")]
    assert projected_peak(without_pin, 16) >= 3 * 160  # no pin: each holds the prefix itself
    assert led.held_distinct == 100 + 3 * 60
    # the peak is when the non-streamed one ends (32 tokens): the growers hold 2 more blocks each then
    assert led.used == 100 + 2 * (60 + 2) + (60 + 2)


def test_a_candidate_sharing_a_pin_fits_where_it_would_not_without_it() -> None:
    for key, admitted in (("K", ["a"]), ("unpinned", [])):
        led = elastic_ledger(250)
        led.pin("K", 40, 0.0)
        led.enqueue("other", 200, 150, 0, 0.0, meta=member(150, key="X", pblocks=0))
        assert led.grant(0.0) == ["other"]  # 40 + 150 + 4 blocks of growth
        # 70 prompt blocks, 40 of them the pinned prefix: adds 30 + 4 (228); unpinned it adds 74 (268)
        led.enqueue("a", 100, 70, 0, 0.0, meta=member(70, key=key, pblocks=40))
        assert led.grant(0.0) == admitted, key


def test_the_cap_refuses_a_pin_past_20_percent_and_unpin_returns_the_blocks() -> None:
    led = elastic_ledger(1000)
    led.pin("a", 150, 0.0)
    with pytest.raises(PinRefused, match="cap of 200"):
        led.pin("b", 51, 0.0)
    led.pin("b", 50, 0.0)
    assert led.pin("b", 50, 0.0).blocks == 50  # idempotent
    with pytest.raises(ConfigurationError, match="already pinned with 50"):
        led.pin("b", 40, 0.0)
    with pytest.raises(ConfigurationError):
        led.pin("", 4, 0.0)
    with pytest.raises(ConfigurationError):
        led.pin("c", 0, 0.0)
    assert led.unpin("a", 1.0) and not led.unpin("a", 1.0)
    assert led.used == 50 and "a" not in led.pins


def test_keepwarm_due_at_once_then_after_the_line_and_waiters_wait_for_its_first_token() -> None:
    led = elastic_ledger(1000)
    led.pin("K", 100, 0.0, margin=20)
    assert led.pins.due(0.0) == [] and not led.pins.claim("K", 0.0, 5.0)  # its first use warms it
    # the first use: a member of the prefix, admitted, first token, released
    led.enqueue("kw", 8, 7, -100, 0.0, meta=member(7, pblocks=100, forecast=1))
    assert led.grant(0.0) == ["kw"]
    led.update_meta("kw", now=0.1, first_token=True)
    led.release("kw", 0.2)
    rec = led.pins.get("K")
    assert rec is not None and rec.free_at_release == 1000 and rec.line() == 1000 - 100 - 20
    assert led.pins.due(0.2) == []
    # other traffic: 700 blocks charged (admissions and growth), under line - margin = 860
    led.enqueue("x", 600, 400, 0, 0.3, meta=member(400, key="X", pblocks=0))
    assert led.grant(0.3) == ["x"]
    led.report_held("x", 500)
    led.release("x", 0.4)
    led.enqueue("y", 300, 200, 0, 0.5, meta=member(200, key="Y", pblocks=0))
    assert led.grant(0.5) == ["y"]
    assert led.pins.charged - rec.mark == 700 and led.pins.due(0.5) == []
    led.report_held("y", 290)  # 790 charged
    led.release("y", 0.6)
    # a 100-block waiter would take the count to 890 > the line (880): it waits; the keep-warm is due
    led.enqueue("z", 120, 100, 0, 0.7, meta=member(100, key="Z", pblocks=0))
    assert led.grant(0.7) == []
    assert led.pins.due(0.7) == ["K"]
    assert led.pins.claim("K", 0.7, 5.0) and not led.pins.claim("K", 0.7, 5.0)  # one sender
    led.enqueue("kw2", 8, 7, -100, 0.7, meta=member(7, pblocks=100, forecast=1))
    assert led.grant(0.7) == ["kw2"]  # the keep-warm itself is not held back by its own prefix
    assert led.grant(0.8) == []  # still no first token: z waits
    led.update_meta("kw2", now=0.9, first_token=True)
    assert led.grant(0.9) == ["z"]  # the prefix is referenced: nothing can evict it
    led.release("kw2", 1.0)
    assert rec.mark == led.pins.charged and rec.free_at_release == 1000 - 100


def test_a_waiter_is_held_back_at_most_the_gate_timeout() -> None:
    led = elastic_ledger(1000)
    led.pin("K", 100, 0.0, margin=20)
    led.enqueue("kw", 8, 7, -100, 0.0, meta=member(7, pblocks=100, forecast=1))
    led.grant(0.0)
    led.update_meta("kw", now=0.0, first_token=True)
    led.release("kw", 0.0)
    led.enqueue("x", 900, 850, 0, 0.0, meta=member(850, key="X", pblocks=0))
    assert led.grant(0.0) == ["x"]
    led.release("x", 0.1)
    led.enqueue("z", 120, 100, 0, 0.2, meta=member(100, key="Z", pblocks=0))
    assert led.grant(0.2) == []
    assert led.grant(0.2 + led.pins.gate_timeout_s) == ["z"]  # no keep-warm came: the line moves on


def test_a_cancelled_member_does_not_count_as_a_release() -> None:
    led = elastic_ledger(1000)
    led.pin("K", 100, 0.0)
    led.enqueue("a", 400, 160, 0, 0.0, meta=member(160))
    led.grant(0.0)
    led.release("a", 0.1)  # never had its first token: the prefix was not touched
    rec = led.pins.get("K")
    assert rec is not None and rec.free_at_release is None and led.pins.due(0.1) == []


def test_pins_need_an_elastic_budget() -> None:
    with pytest.raises(ConfigurationError, match="elastic"):
        LocalBudget(100, policy="strict").pin_sync("K", 4)
    with pytest.raises(ConfigurationError, match="pin_cap"):
        LocalBudget(100, pin_cap=1.5)


# --------------------------------------------------------------------------------------- the simulator's LRU


SIM_BLOCKS = 512  # the tiny profile: 511 usable blocks


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=5.0) as s:
        yield s


def _system(rng: random.Random) -> dict[str, str]:
    return {"role": "system", "content": make_text(1200, rng, "pinned agent")}


async def _traffic(oc: Any, model: str, seed: int, pool_blocks: int) -> int:
    """Other traffic worth 3x the pool's blocks: unique prompts with decode growth, and calls that hit
    free cached blocks of earlier ones (a shared document prefix), in 4 concurrent streams. Returns the
    blocks sent (prompt + output)."""
    rng = random.Random(seed)
    doc = {"role": "system", "content": make_text(320, rng, f"doc {seed}")}
    sent = 0
    jobs: list[tuple[list[dict[str, str]], int]] = []
    i = 0
    while sent < 3 * pool_blocks:
        msgs = [{"role": "user", "content": make_text(rng.randint(250, 600), rng, f"other {seed}.{i}")}]
        if i % 3 == 2:
            msgs = [doc, *msgs]  # hits the document's blocks in the free queue
        out = rng.randint(40, 160)
        jobs.append((msgs, out))
        sent += (count_chat_tokens(msgs) + out) // 16
        i += 1

    async def one(msgs: list[dict[str, str]], out: int) -> None:
        stream = await oc.chat.completions.create(
            model=model, messages=msgs, max_tokens=out, stream=True,
            extra_body={"sim_output_tokens": out})
        async for _ in stream:
            pass

    for k in range(0, len(jobs), 4):
        await asyncio.gather(*(one(m, o) for m, o in jobs[k:k + 4]))
    return sent


async def _probe(oc: Any, sim: SimServer, system: dict[str, str], rid: str) -> int:
    stream = await oc.chat.completions.create(
        model=sim.model, messages=[system, {"role": "user", "content": "probe"}], max_tokens=2,
        stream=True, extra_headers={"X-Request-Id": rid}, extra_body={"sim_output_tokens": 2})
    async for _ in stream:
        pass
    recs = [r for r in sim.stats(requests=True)["requests"] if r["id"] == f"chatcmpl-{rid}"]
    assert len(recs) == 1
    return int(recs[0]["cached_tokens"])


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.needs_sim
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
async def test_keepwarm_keeps_the_prefix_cached_through_three_pools_of_other_traffic(
        sim: SimServer, pinned: bool) -> None:
    """After 3x the pool's blocks of other traffic (decode growth, hits on free blocks), the pinned
    prefix still hits; without the pin the same traffic evicts it."""
    rng = random.Random(7)
    system = _system(rng)
    prefix_full = count_chat_tokens([system]) // 16 * 16
    budget = LocalBudget(SIM_BLOCKS - 1, 16, policy="elastic")
    oc = wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0), budget,
              settings=Settings(estimator="heuristic"))
    try:
        pin = PinnedPrefix(oc, model=sim.model, messages=[system]) if pinned else None
        if pin is not None:
            await pin.start()
        # first use: the prefix gets cached (nothing is sent for a pin before it)
        first = await _probe(oc, sim, system, "first")
        assert first == 0
        if pin is not None:
            assert pin.keepwarms_sent == 0
        sent = await _traffic(oc, sim.model, 11, SIM_BLOCKS - 1)
        assert sent >= 3 * (SIM_BLOCKS - 1)
        cached = await _probe(oc, sim, system, "after")
        if pin is not None:
            assert cached >= 0.9 * prefix_full, (cached, prefix_full, pin)
            assert 1 <= pin.keepwarms_sent <= 12 and pin.keepwarm_errors == 0
            kws = [r for r in sim.stats(requests=True)["requests"]
                   if r["id"].startswith("chatcmpl-" + KEEPWARM_REQUEST_PREFIX)]
            assert len(kws) == pin.keepwarms_sent
            # each keep-warm computes only the tail past the prefix's full blocks
            tails = [(r["prompt_tokens"], r["cached_tokens"]) for r in kws]
            assert all(p - c <= 16 + 8 for p, c in tails), tails
            await pin.aclose()
        else:
            assert cached < 0.5 * prefix_full, cached
        st = await budget.status()
        assert st.used == 0 and st.leases == 0
    finally:
        await oc.close()


# --------------------------------------------------------------------------------------- the API and its exit paths


def test_the_exact_prompt_corrects_what_the_estimate_charged() -> None:
    led = elastic_ledger(1000)
    led.pin("K", 100, 0.0)
    led.enqueue("a", 400, 180, 0, 0.0, meta=member(180))  # estimated 180 prompt blocks
    led.grant(0.0)
    assert led.pins.charged == 80
    led.report_held("a", 170)  # the server's count: 170
    assert led.pins.charged == 70


@pytest.mark.needs_sim
async def test_pinned_prefix_refuses_what_it_cannot_pin(sim: SimServer) -> None:
    rng = random.Random(3)
    system = _system(rng)
    strict = wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0),
                  LocalBudget(SIM_BLOCKS - 1, 16, policy="strict"), settings=Settings(estimator="heuristic"))
    elastic = wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0),
                   LocalBudget(SIM_BLOCKS - 1, 16), settings=Settings(estimator="heuristic"))
    try:
        with pytest.raises(ConfigurationError, match="elastic"):
            PinnedPrefix(strict, model=sim.model, messages=[system])
        with pytest.raises(ConfigurationError, match="system/developer"):
            PinnedPrefix(elastic, model=sim.model, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(ConfigurationError, match="shorter than one KV block"):
            PinnedPrefix(elastic, model=sim.model, messages=[{"role": "system", "content": "be brief"}])
        with pytest.raises(ConfigurationError, match="zp-admitted"):
            PinnedPrefix(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x"), model=sim.model,
                         messages=[system])
        # the cap: 20% of 511 blocks is 102; the first prefix shares ~50 blocks (the heuristic estimate's
        # lower bound of its 75), a second of 1,600 tokens ~67 more: refused
        other = {"role": "system", "content": make_text(1600, rng, "another agent")}
        async with PinnedPrefix(elastic, model=sim.model, messages=[system]):
            with pytest.raises(PinRefused, match="cap of 102"):
                await PinnedPrefix(elastic, model=sim.model, messages=[other]).start()
        st = await admitted_status(elastic)
        assert st.leases == 0 and st.used == 0
    finally:
        await strict.close()
        await elastic.close()


async def admitted_status(client: Any) -> Any:
    from zp_client import admitted_budget

    budget = admitted_budget(client)
    assert budget is not None
    return await budget.status()


@pytest.mark.needs_sim
async def test_closing_a_pin_mid_keepwarm_leaves_nothing_held(sim: SimServer) -> None:
    """aclose() while a keep-warm is on the wire: the keep-warm's lease and the pin are both returned;
    a keep-warm that fails (the server refuses it) is counted and the sender goes on."""
    rng = random.Random(5)
    system = _system(rng)
    budget = LocalBudget(SIM_BLOCKS - 1, 16)
    oc = wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0), budget,
              settings=Settings(estimator="heuristic"))
    try:
        pin = await PinnedPrefix(oc, model=sim.model, messages=[system], poll_s=0.05).start()
        inflight = asyncio.create_task(pin.keep_warm())
        await asyncio.sleep(0.02)
        inflight.cancel()
        with pytest.raises(asyncio.CancelledError):
            await inflight
        await asyncio.sleep(0.05)
        st = await budget.status()
        assert st.leases == 1 and st.extra["pinned_blocks"] == pin.blocks  # only the pin itself
        await pin.aclose()
        await pin.aclose()  # idempotent
        st = await budget.status()
        assert st.leases == 0 and st.used == 0 and "pins" not in st.extra
    finally:
        await oc.close()


def test_a_fleet_refuses_pins_clearly() -> None:
    from zp_client.fleet import Fleet

    fleet = Fleet(["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"], limit_blocks=100)
    assert not fleet.supports_pins
    with pytest.raises(ConfigurationError, match="Fleet does not support pinned prefixes"):
        fleet.pin_sync("K", 4)
    assert not fleet.unpin_sync("K")


def test_a_member_outliving_its_pin_returns_its_share() -> None:
    led = elastic_ledger(1000)
    led.pin("K", 100, 0.0)
    led.enqueue("a", 400, 160, 0, 0.0, meta=member(160))
    led.grant(0.0)
    assert led.pins.member_shares == 100
    led.unpin("K", 0.1)
    led.release("a", 0.2)
    assert led.pins.member_shares == 0 and not led.pins.is_member("a")
    led.pin("K", 100, 0.3)
    assert led.server_free() == 1000  # nothing live, the new pin idle
