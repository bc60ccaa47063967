"""The storm on virtual time: runs exactly reproducible from their seed, the sweep and the busy client
(moved here from tests/test_virtual_time.py, whose loop and transport they run on)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from zp_client.errors import ConfigurationError
from zp_client.testing import run_virtual
from zp_storm.runner import StormConfig, run_storm

ROOT = Path(__file__).resolve().parents[2]
TINY = {"streams": 6, "stream_out": 512, "rounds": 2, "burst": 3, "burst_prompt": 1200,
        "burst_max_tokens": 256}


def test_langchains_rate_limiter_runs_on_the_loops_clock_in_the_storm() -> None:
    """The rate-limited setup's limiter (LangChain's own InMemoryRateLimiter) paces in virtual time."""
    pytest.importorskip("langchain_core")
    import contextlib

    from zp_storm.setups import _rate_limiter_on_loop_time

    async def main() -> list[float]:
        from langchain_core.rate_limiters import InMemoryRateLimiter

        loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            _rate_limiter_on_loop_time(stack)
            limiter = InMemoryRateLimiter(requests_per_second=0.5, check_every_n_seconds=0.1,
                                          max_bucket_size=1)
            times = []
            for _ in range(4):
                await limiter.aacquire()
                times.append(loop.time())
        return times

    times = run_virtual(main())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g == pytest.approx(2.0, abs=0.11) for g in gaps), gaps
    import langchain_core.rate_limiters as rl

    assert rl.time is time  # restored after the run


def _tiny_storm(seed: int = 0) -> list[Any]:
    cfg = StormConfig(workload="seed-burst", seed=seed, setups=["no-admission", "naive", "zp-elastic"],
                      profile="tiny", num_gpu_blocks=None, workload_overrides=dict(TINY))
    _, _, runs = run_storm(cfg)
    return [(r.name, [x.to_json() for x in r.records], r.server_stats["engine"]) for r in runs]


_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from test_storm_virtual_time import _tiny_storm
print(json.dumps(_tiny_storm()))
"""


@pytest.mark.slow
def test_two_runs_of_one_seed_give_identical_records_even_with_another_hash_seed_and_a_busy_cpu() -> None:
    first = _tiny_storm()
    burner = threading.Event()

    def burn() -> None:  # CPU-heavy work in the same process: it takes CPU, never virtual time
        x = 0
        while not burner.is_set():
            x += sum(range(1000))

    t = threading.Thread(target=burn, daemon=True)
    t.start()
    try:
        second = _tiny_storm()
    finally:
        burner.set()
        t.join()
    assert json.dumps(first) == json.dumps(second)
    # another process with another string-hash seed: no result depends on set or dict-of-str order
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(
        [*(str(ROOT / d) for d in (".", "sim", "storm")), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(ROOT / "storm" / "tests"))], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    third = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.dumps(first) == json.dumps(third)
    # and the runs are real ones: every request was sent and answered, and the storm overflowed the
    # pool without admission (records of an empty or idle run would compare equal too)
    names = [name for name, _, _ in first]
    assert names == ["no-admission", "naive", "zp-elastic"]
    for _, recs, _engine in first:
        assert len(recs) == 15 and all(rec["sent"] and rec["ok"] and rec["out_tokens"] > 0 for rec in recs)
    assert first[0][2]["preemptions_total"] > 0
    assert first[2][2]["preemptions_total"] == 0


@pytest.mark.slow
def test_another_seed_gives_another_run() -> None:
    a, b = _tiny_storm(0), _tiny_storm(1)
    assert json.dumps(a) != json.dumps(b)


def test_sweep_loads_are_parsed_and_bad_ones_named() -> None:
    from zp_storm.cli import _parse_sweep

    assert _parse_sweep("2,0.5,1,1") == [0.5, 1.0, 2.0]
    assert _parse_sweep(None) == []
    for bad in ("a,b", "0,1", "-1", ",", "inf", "nan"):
        with pytest.raises(ConfigurationError, match="--sweep"):
            _parse_sweep(bad)


def test_worker_setups_need_the_real_clock() -> None:
    cfg = StormConfig(workload="seed-burst", setups=["no-admission", "zp-redis"], profile="tiny",
                      num_gpu_blocks=None, redis_url="redis://127.0.0.1:1/0", workload_overrides=dict(TINY))
    with pytest.raises(ConfigurationError, match="--clock real"):
        run_storm(cfg)
    with pytest.raises(ConfigurationError, match="clock must be one of"):
        StormConfig(clock="wall")


@pytest.mark.slow
def test_storm_cli_runs_a_sweep_on_the_virtual_clock(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    from zp_client.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": 0.05 * i, "prompt_tokens": 300 + 40 * i,
                                         "max_tokens": 256, "output_tokens": 60 + 10 * i}) + "\n"
                             for i in range(12)))
    out = tmp_path / "sweep"
    rc = main(["storm", "--trace", str(trace), "--profile", "tiny", "--num-gpu-blocks", "128",
               "--setups", "no-admission,zp-elastic", "--sweep", "1,2", "--quiet", "--out", str(out)])
    assert rc == 0  # a virtual run cannot saturate the harness
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["loads"] == [1.0, 2.0]
    assert (out / "sweep.png").stat().st_size > 10_000
    sizes = {}
    for x in ("1", "2"):
        report = json.loads((out / f"load-{x}" / "report.json").read_text())
        assert report["server"]["clock"] == "virtual"
        assert [m["setup"] for m in report["setups"]] == ["no-admission", "zp-elastic"]
        sizes[x] = len(report["requests"]["no-admission"])
    assert sizes == {"1": 12, "2": 24}  # twice the offered load: every request twice


def test_client_load_takes_a_sane_fraction_and_on_the_virtual_clock_keeps_the_simulator_in_process() -> None:
    with pytest.raises(ConfigurationError, match=r"\[0, 1\)"):
        StormConfig(clock="real", client_load=1.0)
    assert StormConfig(client_load=0.5).sim_in_process  # virtual: modelled by read pauses
    assert not StormConfig(clock="real", client_load=0.5).sim_in_process


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_a_modelled_busy_client_reads_late_and_deterministically() -> None:
    """--client-load on the virtual clock: the same storm twice gives identical records, chunks are
    handed over late (the harness reports how late), and it differs from the storm without the load."""
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "zp-elastic"], profile="tiny",
                      num_gpu_blocks=None, client_load=0.5, workload_overrides=dict(TINY))
    def records(run: Any) -> list[Any]:
        return [x.to_json() for x in run.records]

    runs = [run_storm(cfg)[2] for _ in range(2)]
    calm = run_storm(dataclasses.replace(cfg, client_load=0.0))[2]
    for a, b, c in zip(*runs, calm, strict=True):
        assert records(a) == records(b), a.name
        assert records(a) != records(c), a.name
        assert all(r.ok for r in a.records)
        h = a.harness
        assert h["client_load"] == 0.5 and h["client_load_model"] == "read pauses"
        assert h["read_pauses_held"] > 0 and 0 < h["read_lag_p99_ms"] <= 50.0


@pytest.mark.slow
def test_a_busy_client_storm_runs_the_simulator_in_its_own_process() -> None:
    """--client-load on the real clock: the client's loop is blocked in 50 ms bursts, the simulator is
    served from another process and its records, timeline and metrics come back over HTTP."""
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "zp-elastic"], profile="tiny",
                      num_gpu_blocks=None, speedup=4.0, clock="real", client_load=0.3,
                      workload_overrides=dict(TINY))
    _, _, runs = run_storm(cfg)
    for run in runs:
        assert len(run.records) == 15 and all(r.ok for r in run.records), run.name
        assert len(run.server_stats["requests"]) >= 15  # the simulator's own records, over HTTP
        assert len(run.timeline) > 10 and run.metrics_preemptions is not None
        h = run.harness
        assert h["client_load"] == 0.3 and h["client_load_bursts"] > 0
        assert h["loop_lag_max_ms"] >= 40.0  # a 50 ms spin delays some 10 ms nap by most of it
