"""Every program in examples/ runs as a newcomer would run it (``python examples/X.py --sim``), with
small sizes, and reports what it promises: all requests completed, the budget's used back at 0, and
(where the program measures it) no preemption on the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._redis_keys import delete_keys

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 90) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZP_")}  # no stray ZP_BASE_URL etc.
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, (
        f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc.stdout


def test_readme_lists_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    programs = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert programs == sorted(["quickstart_wrap.py", "drop_in_client.py", "threads_sync.py", "fleet_redis.py",
                               "limit_from_server.py", "langchain_agent.py"])
    for name in programs:
        assert name in readme, f"examples/README.md does not mention {name}"


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_quickstart_wrap_burst_completes_and_returns_every_block() -> None:
    out = run_example("quickstart_wrap.py", "--sim", "--requests", "12", "--max-tokens", "48",
                      "--limit-blocks", "100", "--speedup", "10")
    assert "completed 12/12 requests" in out
    peak = re.search(r"peak held (\d+) blocks, peak projected (\d+) \(limit (\d+)\), peak waiters (\d+)", out)
    assert peak, out
    assert 0 < int(peak[1]) and int(peak[3]) == 100
    assert int(peak[4]) > 0, "the limit was chosen so some calls had to wait"
    assert "budget after the burst: used=0 leases=0 waiters=0" in out
    assert "simulator preemptions: 0" in out


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_drop_in_client_streams_and_abandoned_stream_releases() -> None:
    out = run_example("drop_in_client.py", "--sim", "--streams", "4", "--max-tokens", "40", "--quiet",
                      "--speedup", "5")
    assert "stream 1: abandoned after 2 chunks" in out, out
    for i in (0, 2, 3):
        assert re.search(rf"stream {i}: finished after \d+ chunks", out), out
    peak = re.search(r"peak reserved \(used\) (\d+) blocks, peak occupied \(held\) (\d+) blocks", out)
    assert peak, out
    assert 0 < int(peak[2]) <= int(peak[1])  # sampled while the streams held blocks
    assert "all 4 streams done (3 finished, 1 abandoned); budget used=0 leases=0" in out


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_langchain_agent_tool_loops_complete_and_return_every_block() -> None:
    pytest.importorskip("langchain_openai")
    pytest.importorskip("langchain_zp", reason="not installed: pip install -e integrations/langchain")
    out = run_example("langchain_agent.py", "--sim", "--agents", "6", "--speedup", "10")
    assert "completed 6/6 agents" in out
    peak = re.search(r"peak reserved (\d+) of (\d+) blocks, peak waiters (\d+)", out)
    assert peak, out
    assert 0 < int(peak[1]) <= int(peak[2]) == 60 and int(peak[3]) > 0
    assert "budget after the agents: used=0 leases=0 waiters=0" in out
    assert "simulator preemptions: 0" in out


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_threads_sync_shared_wrapped_client() -> None:
    out = run_example("threads_sync.py", "--sim", "--threads", "4", "--requests", "8", "--max-tokens", "32",
                      "--limit-blocks", "30", "--speedup", "10")
    assert "completed 8/8 calls and 4 batch jobs on 4 threads" in out
    peak = re.search(r"peak reserved (\d+) of (\d+) blocks", out)
    assert peak and int(peak[1]) <= int(peak[2]) == 30, out
    # 8 calls + 4 batch jobs were granted, and nothing is left behind
    assert "budget after the run: used=0 leases=0 granted=12" in out


@pytest.mark.slow
def test_limit_from_server_sizes_budget_from_metrics() -> None:
    out = run_example("limit_from_server.py", "--sim", "--requests", "8", "--max-tokens", "64",
                      "--headroom", "0.9", "--speedup", "10")
    # the tiny profile's pool is 512 blocks: floor(511 * 0.9) = 459
    assert "server pool: num_gpu_blocks=512 block_size=16 -> limit_blocks=459 (headroom 0.9)" in out
    assert ("with the budget: completed 8 requests; server preemptions during the burst: 0; "
            "budget used=0 leases=0") in out
    assert "the server preempted nothing" in out  # what it says follows what it measured


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_limit_from_server_says_what_it_measured() -> None:
    """The default burst can preempt (see the program's docstring): whatever the count, the sentence
    after it agrees with it."""
    out = run_example("limit_from_server.py", "--sim", "--speedup", "10")
    count = re.search(r"with the budget: completed 16 requests; server preemptions during the burst: (\d+)",
                      out)
    assert count, out
    if int(count[1]) == 0:
        assert "the server preempted nothing" in out, out
    else:
        assert f"the server preempted {count[1]} time(s) all the same" in out, out
        assert "the server preempted nothing" not in out


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.redis
def test_fleet_redis_processes_share_one_budget(redis_url: str, redis_prefix: str) -> None:
    try:
        out = run_example("fleet_redis.py", "--sim", "--redis", redis_url, "--name", redis_prefix,
                          "--processes", "2", "--requests", "4", "--max-tokens", "32", "--limit-blocks", "60",
                          "--speedup", "10")
    finally:
        delete_keys(redis_url, redis_prefix)
    assert "worker 0: 4/4 requests done" in out and "worker 1: 4/4 requests done" in out
    assert "fleet: 2/2 workers finished 8 requests" in out
    peak = re.search(r"peak reserved (\d+) of (\d+) blocks across the fleet, peak leases (\d+)", out)
    assert peak, out
    assert 0 < int(peak[1]) <= int(peak[2]) == 60
    assert f"budget '{redis_prefix}' after the run: used=0 leases=0" in out
