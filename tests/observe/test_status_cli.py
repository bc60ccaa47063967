"""``zp-client status``: a server's KV pool from /metrics, and a RedisBudget's status read without
creating or changing anything."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator

import httpx
import pytest

from tests._redis_keys import drop_keys
from zp_client.cli import main

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    # A pool of 300 blocks (not the profile's 512), so the numbers printed must come from the server.
    with SimServer(profile="tiny", num_gpu_blocks=300, speedup=20) as server:
        yield server


def status_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    rc = main(["status", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


# ------------------------------------------------------------------------------------------- server


@pytest.mark.needs_sim
def test_server_status_reads_pool_from_metrics(sim: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = status_json(capsys, "--server", sim.base_url, "--headroom", "0.9")
    assert rc == 0
    s = doc["server"]
    assert s["num_gpu_blocks"] == 300
    assert s["block_size"] == 16
    assert s["usable_blocks"] == 299
    assert s["suggested_limit_blocks"] == math.floor(299 * 0.9)
    assert s["headroom"] == 0.9
    assert 0.0 <= s["kv_cache_usage"] <= 1.0


@pytest.mark.needs_sim
def test_server_url_without_v1_works(sim: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = status_json(capsys, "--server", sim.url)
    assert rc == 0
    assert doc["server"]["num_gpu_blocks"] == 300
    assert doc["server"]["suggested_limit_blocks"] == 299  # ELASTIC_HEADROOM 1.0: the whole usable pool


@pytest.mark.needs_sim
def test_server_status_reports_the_servers_preemptions(capsys: pytest.CaptureFixture[str]) -> None:
    # A burst with no admission on a small pool: 12 x (~400 prompt + 200 output) tokens >> 99 blocks.
    with SimServer(profile="tiny", num_gpu_blocks=100, speedup=50) as server:
        body = {"model": server.model, "max_tokens": 200, "ignore_eos": True}

        async def burst() -> None:
            async with httpx.AsyncClient(timeout=120) as http:
                replies = await asyncio.gather(*(
                    http.post(server.base_url + "/chat/completions",
                              json={**body, "messages": [{"role": "user",
                                                          "content": f"{i} " + "word " * 300}]})
                    for i in range(12)))
            assert all(r.status_code == 200 for r in replies)

        asyncio.run(burst())
        expected = server.stats()["engine"]["preemptions_total"]
        rc, doc = status_json(capsys, "--server", server.base_url)
    assert rc == 0
    assert expected > 0, "the burst was sized to force preemptions"
    assert doc["server"]["num_preemptions_total"] == expected
    assert doc["server"]["num_requests_running"] == 0


@pytest.mark.needs_sim
def test_server_status_text(sim: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["status", "--server", sim.base_url])
    out = capsys.readouterr().out
    assert rc == 0
    assert "KV pool:          300 blocks of 16 tokens (299 usable)" in out
    assert "suggested limit:  limit_blocks=299 (headroom 1)" in out
    assert "preemptions:" in out and "KV usage:" in out


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["status", "--server", f"http://127.0.0.1:{port}/v1", "--timeout", "2"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "/metrics did not answer" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give --server URL and/or --redis URL --name NAME"),
        (["--redis", "redis://127.0.0.1:6379/0"], "--redis needs --name"),
        (["--name", "x"], "--name needs --redis"),
        (["--server", "http://127.0.0.1:1/v1", "--headroom", "1.5"], "--headroom must be in (0, 1]"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", *argv]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- redis


def _snapshot(r, name: str) -> dict[bytes, tuple[bytes | None, int]]:  # type: ignore[no-untyped-def]
    """Every key of the budget with its serialized value and TTL: any write would change it."""
    keys = sorted(r.scan_iter(match=f"{{zp:{name}}}*", count=1000))
    return {k: (r.dump(k), r.pttl(k) // 1000) for k in keys}


@pytest.mark.redis
def test_missing_budget_is_reported_and_not_created(redis_url: str, redis_prefix: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import redis

    rc, doc = status_json(capsys, "--redis", redis_url, "--name", redis_prefix)
    assert rc == 1
    assert doc["budget"] == {"name": redis_prefix, "redis": redis_url, "exists": False}
    r = redis.Redis.from_url(redis_url)
    try:
        assert list(r.scan_iter(match=f"{{zp:{redis_prefix}}}*")) == []
    finally:
        r.close()
    rc = main(["status", "--redis", redis_url, "--name", redis_prefix])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().out


@pytest.mark.redis
def test_budget_status_is_read_only_and_complete(redis_url: str, redis_prefix: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import redis

    from zp_client import RedisBudget

    async def scenario() -> None:
        # Long poll/TTL: the budget's own background tasks write nothing during the test, so any
        # change to the keys would be the status command's.
        # (urgent_reserve 0: the scenario's three classes are about counting, not the room one keeps for
        # another, docs/admission.md#the-urgent-reserve)
        budget = RedisBudget(redis_url, redis_prefix, limit_blocks=100, recovery_s=0, lease_ttl_s=300,
                             poll_interval_s=60, held_report_blocks=1, urgent_reserve=0)
        r = redis.Redis.from_url(redis_url)
        try:
            a = await budget.acquire(40, held=10)
            b = await budget.acquire(30, priority=1)
            waiter = asyncio.create_task(budget.acquire(50, priority=2))  # 40 + 30 + 50 > 100: waits
            while sum(c.waiters for c in (await budget.status()).waiters.values()) == 0:
                await asyncio.sleep(0.01)
            await budget.flush()  # held reports are batched; make Redis current

            argv = ("--redis", redis_url, "--name", redis_prefix)
            before = _snapshot(r, redis_prefix)
            rc, doc = await asyncio.to_thread(status_json, capsys, *argv)
            after = _snapshot(r, redis_prefix)
            assert before == after, "zp-client status changed the budget's keys"

            assert rc == 0
            s = doc["budget"]
            assert s["exists"] is True
            assert (s["limit"], s["used"], s["free"], s["leases"]) == (100, 70, 30, 2)
            assert s["held"] == 10 + 30
            assert s["waiters"] == {"2": {"waiters": 1, "weight": 50}}
            assert s["head_wait_s"] >= 0
            assert s["policy"] == "elastic" and s["block_size"] == 16
            assert s["recovering"] is False

            rc = await asyncio.to_thread(main, ["status", "--redis", redis_url, "--name", redis_prefix])
            out = capsys.readouterr().out
            assert rc == 0
            assert "used:             70 blocks reserved by 2 leases (30 free)" in out
            assert "waiters (prio 2): 1 waiting for 50 blocks" in out

            await a.release()  # 30 + 50 fits now: the waiter gets its lease
            c = await asyncio.wait_for(waiter, 30)
            await b.release()
            await c.release()
            rc, doc = await asyncio.to_thread(status_json, capsys, *argv)
            assert (doc["budget"]["used"], doc["budget"]["leases"], doc["budget"]["waiters"]) == (0, 0, {})
        finally:
            await budget.aclose()
            drop_keys(r, redis_prefix)
            r.close()

    asyncio.run(scenario())


@pytest.mark.redis
def test_unreachable_redis_is_a_clear_error_without_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    rc = main(["status", "--redis", url, "--name", "x", "--timeout", "0.3"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "did not answer" in captured.err
    assert "hunter2" not in captured.err + captured.out
    assert f"redis://:***@127.0.0.1:{port}/0" in captured.err


def test_reading_a_stalled_redis_in_a_loop_leaves_at_most_one_reader_thread() -> None:
    """budget_status() called again and again against a Redis that accepts and never answers: each call
    fails within its timeout, and the reads it gave up on do not pile up (one reader at a time, each
    ending within about its timeout); after the last, none is left."""
    import socket
    import threading
    import time

    from zp_client.errors import BudgetUnavailable
    from zp_client.status_cli import budget_status

    def readers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "zp-status-read")

    with socket.socket() as stalled:  # connections queue in the backlog; nothing ever answers
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(64)
        url = f"redis://127.0.0.1:{stalled.getsockname()[1]}/0"
        peak = 0
        for _ in range(6):
            t0 = time.monotonic()
            with pytest.raises(BudgetUnavailable):
                budget_status(url, "stalled", timeout=0.2)
            assert time.monotonic() - t0 < 2.0
            peak = max(peak, readers())
        assert peak <= 1
        deadline = time.monotonic() + 5
        while readers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert readers() == 0
