"""``zp-client status --watch``: the watch loop reads a real RedisBudget again on every iteration."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests._redis_keys import drop_keys
from zp_client.cli import main
from zp_client.status_cli import format_status, read_status, watch


@pytest.mark.redis
def test_watch_shows_each_reads_numbers(redis_url: str, redis_prefix: str) -> None:
    import redis

    from zp_client import RedisBudget

    async def scenario() -> None:
        budget = RedisBudget(redis_url, redis_prefix, limit_blocks=100, recovery_s=0, lease_ttl_s=300,
                             poll_interval_s=60)
        r = redis.Redis.from_url(redis_url)
        try:
            first = await budget.acquire(10)
            args = argparse.Namespace(server=None, redis=redis_url, name=redis_prefix, headroom=0.95,
                                      timeout=5.0)
            renders: list[str] = []
            leases = []
            loop = asyncio.get_running_loop()

            def between(_interval: float) -> None:  # runs in the watch thread: take another lease
                leases.append(asyncio.run_coroutine_threadsafe(budget.acquire(25), loop).result(30))

            rc = await asyncio.to_thread(watch, lambda: read_status(args),
                                         lambda res: renders.append(format_status(res)), 0.5, 2, between)
            assert rc == 0 and len(renders) == 2 and len(leases) == 1
            assert "limit:            100 blocks" in renders[0]
            assert "used:             10 blocks reserved by 1 leases (90 free)" in renders[0]
            assert "used:             35 blocks reserved by 2 leases (65 free)" in renders[1]
            await first.release()
            await leases[0].release()
        finally:
            await budget.aclose()
            drop_keys(r, redis_prefix)
            r.close()

    asyncio.run(scenario())


def test_watch_stops_on_ctrl_c_with_0() -> None:
    shown: list[dict] = []

    def interrupt(_interval: float) -> None:
        raise KeyboardInterrupt

    assert watch(lambda: {"n": len(shown)}, shown.append, 1.0, None, interrupt) == 0
    assert shown == [{"n": 0}]


@pytest.mark.redis
def test_watch_cli_runs_with_rich(redis_url: str, redis_prefix: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    rc = main(["status", "--redis", redis_url, "--name", redis_prefix, "--watch", "--interval", "0.01",
               "--count", "2"])
    assert rc == 0
    assert "does not exist" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--watch", "--json"], "does not take --json"),
    (["--watch", "--interval", "0"], "--interval must be > 0"),
])
def test_bad_watch_arguments_exit_2(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--server", "http://127.0.0.1:1/v1", *argv]) == 2
    assert message in capsys.readouterr().err
