"""The simulator engine's side of prefill/decode disaggregation (vLLM's NixlConnector, issue 20): a
prefill engine's request that keeps its blocks after finishing (``hold_kv``) and a decode engine's
request whose prompt KV is pulled from a peer (``remote_kv``)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest

from zp_client.testing import MemoryNetwork, MemoryTransport, run_virtual
from zp_sim.engine import Engine, EngineConfig
from zp_sim.server import SimServer
from zp_sim.tokenizer import make_text

BS = 16


def engine(blocks: int = 64, per_block: float = 0.001, **kw: object) -> Engine:
    return Engine(EngineConfig(num_gpu_blocks=blocks, block_size=BS, max_model_len=min(512, (blocks - 1) * BS),
                               max_num_batched_tokens=256, kv_transfer_s_per_block=per_block, **kw))


def prompt(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def run_until_idle(e: Engine, limit: int = 10_000) -> list:
    outs = []
    for _ in range(limit):
        if not e.has_unfinished():
            break
        out = e.step()
        if out.step is None:
            ready = e.next_kv_ready()
            assert ready is not None, "an idle engine with work must be waiting for a transfer"
            e.advance_idle(ready)
        outs.append(out)
    return outs


def test_a_hold_kv_request_keeps_its_blocks_until_freed() -> None:
    e = engine()
    e.add_request("p", prompt(100), 1, hold_kv=True)
    run_until_idle(e)
    rec = e.request_record("p")
    assert rec.finished and rec.output_tokens_done == 1
    assert e.held_kv_ids == ["p"] and e.held_kv_blocks == 7  # 101 tokens: 7 blocks
    assert e.stats.num_free_blocks == 63 - 7 and e.stats.kv_held_blocks == 7
    assert e.free_held("p") == 7 and e.free_held("p") == 0
    assert e.stats.num_free_blocks == 63 and e.held_kv_blocks == 0
    # freed into the prefix cache: the same prompt hits its 6 full blocks
    e.add_request("again", prompt(100), 1)
    run_until_idle(e)
    assert e.request_record("again").num_cached_tokens == 96


def test_a_remote_kv_request_pulls_its_prompt_then_recomputes_the_last_token() -> None:
    e = engine(per_block=0.002)
    e.add_request("d", prompt(100), 3, remote_kv=True)
    first = e.step()
    assert first.step is None and first.kv_loading == ["d"]  # admitted, nothing to compute yet
    assert e.stats.num_free_blocks == 63 - 7  # every prompt block allocated at admission
    assert e.next_kv_ready() == pytest.approx(7 * 0.002)
    assert e.kv_pulled_blocks_total == 7
    e.advance_idle(e.next_kv_ready())
    out = e.step()
    assert out.kv_loaded == ["d"] and out.scheduled == {"d": 1} and out.first_token == ["d"]
    run_until_idle(e)
    rec = e.request_record("d")
    assert rec.finished and rec.output_tokens_done == 3 and rec.num_cached_tokens == 0
    assert rec.recomputed_tokens == 0


def test_only_the_blocks_missing_from_the_local_cache_are_pulled() -> None:
    e = engine()
    shared = prompt(64)  # 4 full blocks, cached by an earlier request
    e.add_request("warm", [*shared, *prompt(10, 5000)], 1)
    run_until_idle(e)
    e.add_request("d", [*shared, *prompt(40, 7000)], 2, remote_kv=True)
    e.step()
    assert e.kv_pulled_blocks_total == 7 - 4  # 104 tokens = 7 blocks, 4 of them hit locally
    run_until_idle(e)
    assert e.request_record("d").num_cached_tokens == 64


def test_a_transfer_in_flight_does_not_hold_up_the_line_and_keeps_its_place() -> None:
    e = engine(per_block=0.5)  # a slow pull: 7 blocks take 3.5 s
    e.add_request("d", prompt(100), 2, remote_kv=True)
    e.add_request("local", prompt(20, 9000), 2)
    out = e.step()
    assert out.kv_loading == ["d"] and "local" in out.scheduled
    assert e.waiting_ids == ["d"]
    run_until_idle(e)
    assert e.request_record("local").finish_time < e.request_record("d").first_token_time


def test_the_whole_prompt_must_fit_before_a_remote_kv_request_is_admitted() -> None:
    e = engine(blocks=12)  # 11 usable blocks
    e.add_request("big", prompt(150), 40)  # 10 blocks now, growing
    e.step()
    e.add_request("d", prompt(100, 3000), 2, remote_kv=True)  # needs 7 blocks: waits
    out = e.step()
    assert out.kv_loading == [] and "d" in e.waiting_ids
    run_until_idle(e)
    assert e.request_record("d").finished


def test_aborting_a_request_whose_kv_is_on_its_way_frees_its_blocks() -> None:
    e = engine(per_block=1.0)
    e.add_request("d", prompt(100), 2, remote_kv=True)
    e.step()
    assert e.stats.num_free_blocks == 63 - 7
    assert e.abort("d")
    assert e.stats.num_free_blocks == 63 and e.next_kv_ready() is None and not e.has_unfinished()


def test_a_preempted_remote_kv_request_recomputes_its_prompt_locally() -> None:
    e = engine(blocks=16, per_block=0.0)  # 15 usable blocks
    e.add_request("d", prompt(100), 60, remote_kv=True)  # 7 blocks, grows to 10
    e.add_request("other", prompt(90, 4000), 80)  # 6 blocks, grows to 11
    run_until_idle(e)
    d, other = e.request_record("d"), e.request_record("other")
    assert d.finished and other.finished
    # d joined the running list last (after its pull), so it is the one preempted (FCFS: the last)
    assert d.num_preemptions >= 1 and other.num_preemptions == 0
    assert d.recomputed_tokens > 0  # its prompt computed here the second time...
    assert e.kv_pulled_blocks_total == 7  # ...not pulled again


def test_the_transfer_time_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="kv_transfer_s_per_block"):
        engine(per_block=-1.0)


# --------------------------------------------------------------------------------------- the HTTP roles


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-llama", "messages": [{"role": "system", "content": text},
                                               {"role": "user", "content": "go"}], **extra}


PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def _prefill(c: httpx.AsyncClient, url: str, text: str, rid: str) -> dict[str, Any]:
    r = await c.post(f"{url}/v1/chat/completions", headers={"X-Request-Id": rid},
                     json=_body(text, max_tokens=1, stream=False, kv_transfer_params=PREFILL))
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.anyio
async def test_prefill_then_decode_moves_the_kv_and_frees_the_prefill_blocks() -> None:
    text = make_text(600, random.Random(1), "pd")
    async with SimServer("tiny", speedup=20.0, role="prefill") as p, \
            SimServer("tiny", speedup=20.0, role="decode", kv_transfer_s_per_block=0.001) as d, \
            httpx.AsyncClient(timeout=30) as c:
        out = await _prefill(c, p.url, text, "req-1")
        kv = out["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == p.stats()["kv"]["engine_id"]
        assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.port
        held = p.stats()["kv"]["held_blocks"]
        assert held == len(kv["remote_block_ids"]) > 30 and p.stats()["kv"]["engine_held_blocks"] == held
        r = await c.post(f"{d.url}/v1/chat/completions", headers={"X-Request-Id": "req-1"},
                         json=_body(text, max_tokens=20, sim_output_tokens=20, kv_transfer_params=kv))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        ds, ps = d.stats(), p.stats()
        assert ds["kv"]["kv_remote"] == 1 and ds["kv"]["pulled_blocks_total"] == held - 1 + 1
        assert ds["engine"]["recomputed_tokens"] == 0
        assert ps["kv"]["held_blocks"] == 0 and ps["kv"]["kv_freed_read"] == 1 and ps["kv"]["kv_expired"] == 0
        assert ps["kv"]["kv_heartbeats"] >= 1
        metrics = (await c.get(f"{d.url}/metrics")).text
        assert "vllm:nixl_xfer_time_seconds_count" in metrics


@pytest.mark.anyio
async def test_a_decode_call_without_usable_params_prefills_locally() -> None:
    text = make_text(300, random.Random(2), "pd")
    async with SimServer("tiny", speedup=20.0, role="decode") as d, httpx.AsyncClient(timeout=30) as c:
        for kv in (None, {"do_remote_prefill": True, "remote_engine_id": "nobody", "remote_request_id": "x"}):
            extra = {} if kv is None else {"kv_transfer_params": kv}
            r = await c.post(f"{d.url}/v1/chat/completions", json=_body(text, max_tokens=5, **extra))
            assert r.status_code == 200
        assert d.stats()["kv"]["kv_remote"] == 0 and d.stats()["kv"]["kv_local_fallback"] == 1
        assert d.stats()["engine"]["prompt_tokens_total"] > 0


@pytest.mark.anyio
async def test_an_unread_prefill_expires_after_its_lease() -> None:
    text = make_text(300, random.Random(3), "pd")
    async with SimServer("tiny", speedup=50.0, role="prefill", kv_lease_s=2.0) as p, \
            httpx.AsyncClient(timeout=30) as c:
        await _prefill(c, p.url, text, "req-2")
        assert p.stats()["kv"]["held_blocks"] > 0
        for _ in range(100):  # 2 virtual s = 40 ms at speedup 50
            if p.stats()["kv"]["kv_expired"]:
                break
            await asyncio.sleep(0.01)
        st = p.stats()
        assert st["kv"]["kv_expired"] == 1 and st["kv"]["held_blocks"] == 0
        assert st["kv"]["engine_held_blocks"] == 0
        assert "vllm:nixl_num_kv_expired_reqs_total 1.0" in (await c.get(f"{p.url}/metrics")).text.replace(
            '{engine="0",model_name="sim-llama"}', "")


# The next two run on the virtual clock (zp_client.testing: the servers in memory on a VirtualTimeLoop,
# whose clock is the loop time the simulator maps to its virtual time, i.e. the "wall clock" of the run).
# On the real clock at speedup 20 a busy machine broke them: 1 s leases are 50 ms of wall time, which a
# starved loop overran (kv_expired 1), and a late loop shows as engine lag (max_lag_s 0.65). On the
# virtual clock both check only the simulator's logic, exactly.


@pytest.mark.slow
def test_a_prefill_pool_full_of_held_kv_idles_on_the_wall_clock_until_a_lease_frees_room() -> None:
    # three held prefills fill the 511-block pool; a fourth waits with nothing schedulable until their
    # leases expire (20 virtual s). The engine idles meanwhile: its clock must follow the loop's clock (the
    # run's wall clock), not fall behind it (it would then run the next steps back to back, faster than
    # the profile, and show as lag)
    texts = [make_text(2600, random.Random(10 + i), "hold") for i in range(4)]

    async def main() -> tuple[float, dict[str, Any]]:
        p = SimServer("tiny", speedup=20.0, role="prefill", kv_lease_s=20.0)
        async with p.in_memory(), httpx.AsyncClient(transport=MemoryTransport(p.app), timeout=30) as c:
            t0 = p.stats()["clock_s"]  # before the first hold: its lease ends at least 20 virtual s later
            for i in range(3):
                await _prefill(c, p.url, texts[i], f"h{i}")
            assert p.stats()["kv"]["held_blocks"] > 400
            await _prefill(c, p.url, texts[3], "h3")  # waits for the first expiry
            return t0, p.stats()

    t0, st = run_virtual(main())
    assert st["kv"]["kv_expired"] >= 1
    assert st["clock_s"] - t0 >= 20.0  # it waited the lease out, on the loop's clock
    assert st["max_lag_s"] < 0.1  # and was never behind it


@pytest.mark.slow
def test_a_decode_that_waits_longer_than_the_lease_keeps_it_alive_by_heartbeats() -> None:
    """The decode pool is full for longer than the lease: the waiting request heartbeats its prefill
    server, so nothing expires; it gets its KV once the pool drains."""
    text = make_text(600, random.Random(4), "pd")  # ~38 blocks
    busy = [make_text(2600, random.Random(5 + k), f"busy {k}") for k in range(3)]

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        p = SimServer("tiny", speedup=20.0, role="prefill", kv_lease_s=1.0)
        d = SimServer("tiny", speedup=20.0, role="decode")
        async with p.in_memory("p.memory"), d.in_memory("d.memory"):
            net = MemoryNetwork({"p.memory": p.app, "d.memory": d.app})
            async with httpx.AsyncClient(transport=MemoryTransport(net), timeout=60) as c:
                kv = (await _prefill(c, p.url, text, "req-3"))["kv_transfer_params"]
                # three calls of ~2,600 prompt tokens hold ~490 of the 511 blocks, then grow by 500 tokens
                # each (~3 virtual s of ~5 ms decode steps): the decode call's 38 blocks wait in its scheduler
                hogs = [asyncio.create_task(c.post(f"{d.url}/v1/chat/completions", json=_body(
                    b, max_tokens=500, sim_output_tokens=500))) for b in busy]
                await asyncio.sleep(0.02)  # 0.4 virtual s: under the 1 s lease
                r = await c.post(f"{d.url}/v1/chat/completions",
                                 json=_body(text, max_tokens=3, kv_transfer_params=kv))
                assert r.status_code == 200
                await asyncio.gather(*hogs)
                return d.stats(requests=True), p.stats()

    ds, pst = run_virtual(main())
    rec = [x for x in ds["requests"] if x["prompt_tokens"] < 1000][0]
    assert rec["first_token_s"] - rec["arrival_s"] > 1.5  # it waited longer than the lease
    ps = pst["kv"]
    assert ps["kv_expired"] == 0 and ps["kv_freed_read"] == 1 and ps["kv_heartbeats"] >= 3


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_decode_call_cancelled_before_its_kv_arrived_frees_the_prefill_at_once() -> None:
    text = make_text(600, random.Random(6), "pd")
    async with SimServer("tiny", speedup=1.0, role="prefill") as p, \
            SimServer("tiny", speedup=1.0, role="decode", kv_transfer_s_per_block=0.2) as d, \
            httpx.AsyncClient(timeout=30) as c:
        kv = (await _prefill(c, p.url, text, "req-4"))["kv_transfer_params"]
        task = asyncio.create_task(c.post(f"{d.url}/v1/chat/completions", json=_body(
            text, max_tokens=3, kv_transfer_params=kv)))
        await asyncio.sleep(0.3)  # the pull takes ~8 s at speedup 1
        assert d.stats()["kv"]["pulling"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if p.stats()["kv"]["kv_freed_abort"]:
                break
            await asyncio.sleep(0.01)
        ps = p.stats()["kv"]
        assert ps["kv_freed_abort"] == 1 and ps["held_blocks"] == 0 and d.stats()["kv"]["pulling"] == 0


def test_roles_are_checked() -> None:
    with pytest.raises(ValueError, match="role"):
        SimServer("tiny", role="both")
