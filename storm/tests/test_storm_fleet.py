"""The storm's fleets (``--replicas N``, ``--kill-replica``): the in-memory network, the reference endpoint
picker's prefix affinity, a tiny two-replica storm through rr / rr-zp / epp, and a kill."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from zp_client.errors import ConfigurationError
from zp_client.testing import MemoryNetwork, memory_transport, run_virtual
from zp_storm.fleet_setups import EPP_DEFAULTS, HttpxEndpointPicker, prompt_block_hashes
from zp_storm.report import build_report, markdown_table, write_report
from zp_storm.runner import StormConfig, run_storm
from zp_storm.setups import DEFAULT_SETUPS, SETUPS, parse_setups, zp_limit_blocks
from zp_storm.workloads import ServerFacts, build_workload

# A seed-burst small enough for a fleet of two in a few seconds (the load doubles with the replicas).
SMALL = {"streams": 3, "stream_out": 256, "rounds": 2, "burst": 2, "burst_prompt": 900,
         "burst_max_tokens": 128}


def test_one_replica_keeps_the_default_setups_and_a_fleet_gets_its_own() -> None:
    assert parse_setups(None, None) == list(DEFAULT_SETUPS)
    assert not any(SETUPS[n].fleet for n in DEFAULT_SETUPS)
    assert parse_setups(None, None, 3) == ["no-admission", "rr", "rr-zp", "epp", "zp-fleet"]
    assert parse_setups(None, "redis://x", 3)[-1] == "zp-fleet-redis"  # with --redis only
    assert "zp-fleet-strict" in parse_setups("zp-fleet-strict", None, 2)  # when named
    with pytest.raises(ConfigurationError, match="replica 0 only"):
        parse_setups("naive,rr", None, 2)
    assert parse_setups("epp", None, 1) == ["no-admission", "epp"]  # named: a fleet of one
    with pytest.raises(ConfigurationError, match="replicas"):
        StormConfig(replicas=0)


def test_agentic_scales_its_conversations_with_the_replicas_over_the_same_window() -> None:
    facts = ServerFacts(2049, 16, 32768, 0.008)
    one = build_workload("agentic", facts, 0, conversations=2, turns_hi=3)
    three = build_workload("agentic", facts, 0, replicas=3, conversations=2, turns_hi=3)
    assert three.params["conversations"] == 3 * one.params["conversations"]
    assert three.params["window_s"] == pytest.approx(one.params["window_s"])
    burst = build_workload("seed-burst", facts, 0, replicas=2, **SMALL)
    assert burst.params["scale"] == 2.0


async def _slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(10):
        await send({"type": "http.response.body", "body": f"{i};".encode(), "more_body": True})
        await asyncio.sleep(1.0)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_the_memory_network_dispatches_by_host_and_a_kill_resets_and_refuses() -> None:
    async def main() -> None:
        net = MemoryNetwork({"a.memory": _slow_app, "b.memory": _slow_app})
        async with httpx.AsyncClient(transport=memory_transport(net, httpx)) as http:
            got: list[bytes] = []

            async def read_a() -> None:
                async with http.stream("GET", "http://a.memory/x") as r:
                    async for chunk in r.aiter_raw():
                        got.append(chunk)

            task = asyncio.ensure_future(read_a())
            await asyncio.sleep(2.5)
            assert net.open_exchanges("a.memory") == 1
            assert net.kill("a.memory") == 1
            with pytest.raises(httpx.ReadError):
                await task
            assert got == [b"0;", b"1;", b"2;"]
            for path in ("/v1/chat/completions", "/health", "/metrics"):
                with pytest.raises(httpx.ConnectError):
                    await http.get("http://a.memory" + path)
            r = await http.get("http://b.memory/x")  # the other host lives on
            assert r.status_code == 200 and r.content.startswith(b"0;1;")
            with pytest.raises(httpx.ConnectError):
                await http.get("http://nowhere.memory/x")

    run_virtual(main())


class _Ok(httpx.AsyncBaseTransport):
    """Answers every request 200 and remembers its host."""

    def __init__(self) -> None:
        self.hosts: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.hosts.append(request.url.host)
        return httpx.Response(200, json={})


class _Metrics:
    """Each replica's /metrics: unsaturated, with a little load noise from ``rng``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def get(self, url: str, timeout: float = 1.0) -> httpx.Response:
        kv, waiting = self.rng.uniform(0.05, 0.3), self.rng.randint(0, 2)
        text = f"vllm:kv_cache_usage_perc {kv}\nvllm:num_requests_waiting {waiting}\n"
        return httpx.Response(200, text=text)


def test_an_unsaturated_epp_keeps_a_repeated_conversation_on_one_replica() -> None:
    async def main() -> None:
        inner = _Ok()
        roots = [f"http://sim-{i}.memory:80" for i in range(4)]
        epp = HttpxEndpointPicker(inner, roots, _Metrics(random.Random(1)), rng=random.Random(2))
        rng = random.Random(3)
        convs = {c: [{"role": "system", "content": f"agent {c}: a coding agent; tools: " + "x" * 3000},
                     {"role": "user", "content": f"task {c} " + "y" * 400}] for c in range(6)}
        for turn in range(12):
            for c, msgs in convs.items():
                await epp.refresh()
                body = json.dumps({"model": "sim-llama", "messages": msgs}).encode()
                req = httpx.Request("POST", "http://sim-0.memory:80/v1/chat/completions", content=body,
                                    headers={"X-Request-Id": f"c{c}/t{turn}"})
                await epp.handle_async_request(req)
                msgs.append({"role": "assistant", "content": f"step {turn} " + "z" * rng.randint(50, 400)})
        # every conversation's requests, in order: the hosts they went to
        per_conv: dict[int, list[str]] = {c: [] for c in convs}
        for k, host in enumerate(inner.hosts):
            per_conv[k % len(convs)].append(host)
        for c, hosts in per_conv.items():
            top = max(set(hosts), key=hosts.count)
            assert hosts.count(top) / len(hosts) >= 0.9, (c, hosts)
        assert len(set(inner.hosts)) > 1  # not everything on one replica
        assert not epp.saturated() and epp.held == 0

    run_virtual(main())


def test_the_epp_holds_requests_while_every_replica_is_saturated() -> None:
    class Busy(_Metrics):
        waiting = 9

        async def get(self, url: str, timeout: float = 1.0) -> httpx.Response:
            return httpx.Response(200, text=f"vllm:kv_cache_usage_perc 0.5\nvllm:num_requests_waiting "
                                            f"{self.waiting}\n")

    async def main() -> None:
        metrics = Busy(random.Random(0))
        epp = HttpxEndpointPicker(_Ok(), ["http://a:80", "http://b:80"], metrics, rng=random.Random(0))
        epp.start()
        await asyncio.sleep(0.01)
        assert epp.saturated()  # waiting 9 > QueueDepthThreshold 5 everywhere
        req = httpx.Request("POST", "http://a:80/v1/completions", content=b'{"model": "m", "prompt": "hi"}')
        task = asyncio.ensure_future(epp.handle_async_request(req))
        await asyncio.sleep(1.0)
        assert not task.done() and epp.held == 1
        metrics.waiting = 5  # at the threshold: capacity again (GIE: above it is saturated)
        await asyncio.wait_for(task, 1.0)
        assert 0.9 < epp.held_s < 1.2
        await epp.stop()

    run_virtual(main())
    assert EPP_DEFAULTS["weight_prefix"] == 3.0 and EPP_DEFAULTS["lru_capacity_per_server"] == 31250
    assert len(prompt_block_hashes("m", "a" * 130)) == 2  # 64-character blocks, the tail dropped
    assert prompt_block_hashes("m", "a" * 128) != prompt_block_hashes("n", "a" * 128)  # seeded by the model


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_two_replicas_rr_rr_zp_and_epp_spread_the_load_and_report_the_fleet(tmp_path: Path) -> None:
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "rr", "rr-zp", "epp"],
                      profile="tiny", num_gpu_blocks=None, workload_overrides=dict(SMALL), replicas=2)
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    by = {m["setup"]: m for m in report["setups"]}
    assert wl.params["scale"] == 2.0
    for run in runs:
        assert run.replicas == 2 and run.replica_stats is not None
        served = [st["requests"] for st in run.replica_stats]
        assert all(n > 0 for n in served), (run.name, served)  # each replica gets traffic
        assert sum(served) == len(run.server_stats["requests"])
        m = by[run.name]
        assert m["ok"] == m["sent"] == len(run.records)
        assert m["preemptions"] == sum(m["preemptions_per_replica"])
        assert m["prefix_cache_hit_rate"] is not None and 0.0 <= m["prefix_cache_hit_rate"] <= 1.0
        assert m["cut_streams"] == 0 and m["killed_replica"] is None
    assert by["rr"]["routed_per_replica"] == by["rr"]["server_requests_per_replica"]
    pools = [st["num_gpu_blocks"] for st in runs[0].replica_stats or []]
    assert by["rr-zp"]["limit_blocks"] == sum(zp_limit_blocks(n) for n in pools)
    assert by["rr-zp"]["preemptions"] == 0  # admitted within the fleet's summed budget, balanced evenly
    assert report["fleet"]["replicas"] == 2 and set(report["fleet"]["replica_timelines"]) == set(by)
    assert "prefix hit" in markdown_table(report)
    if importlib.util.find_spec("matplotlib") is not None:  # write_report draws the figure with it
        jp, _ = write_report(report, tmp_path)
        assert json.loads(jp.read_text())["fleet"]["replicas"] == 2


@pytest.mark.slow
def test_a_kill_cuts_the_busiest_replicas_streams() -> None:
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "rr"], profile="tiny",
                      num_gpu_blocks=None, workload_overrides=dict(SMALL), replicas=2, kill_replica_s=1.0)
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    by = {m["setup"]: m for m in report["setups"]}
    for run in runs:
        assert run.kill is not None and run.kill["t_s"] == pytest.approx(1.0)
        loads = run.kill["in_flight_per_replica"]
        assert run.kill["in_flight"] == max(loads) > 0 and loads[run.kill["replica"]] == max(loads)
    na, rr = by["no-admission"], by["rr"]
    assert na["errors"] > 0 and na["cut_streams"] > 0  # no retries: the cut streams surface
    assert set(na["error_kinds"]) <= {"APIConnectionError"}, na["error_kinds"]
    assert rr["cut_streams"] > 0 and rr["moved_off_dead"] > 0  # retried elsewhere
    dead = rr["killed_replica"]
    assert dead == runs[1].kill["replica"]  # type: ignore[index]
    # round-robin keeps sending to the dead replica (no readiness probe): refused at connect
    assert rr["routed_per_replica"][dead] > rr["server_requests_per_replica"][dead]
    assert report["fleet"]["kill_replica_s"] == 1.0


def test_a_one_server_run_reports_no_fleet() -> None:
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission"], profile="tiny",
                      num_gpu_blocks=None, workload_overrides=dict(SMALL))
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    assert "fleet" not in report and "prefix_cache_hit_rate" not in report["setups"][0]
    assert runs[0].replica_stats is None and runs[0].kill is None
    assert "prefix hit" not in markdown_table(report)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_zp_fleet_spreads_without_preemptions_and_survives_a_kill() -> None:
    """zp-fleet in miniature: balanced across both replicas with no preemption; with the busiest replica
    killed mid-run, every request that had not started streaming completes on the other replica (moved
    without a retry), and the only errors are the cut streams, typed StreamCut."""
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "zp-fleet"], profile="tiny",
                      num_gpu_blocks=None, workload_overrides=dict(SMALL), replicas=2)
    wl, facts, runs = run_storm(cfg)
    m = {x["setup"]: x for x in build_report(wl, facts, runs, cfg, "pytest")["setups"]}["zp-fleet"]
    assert m["preemptions"] == 0 and m["errors"] == 0 and m["ok"] == m["sent"]
    assert all(n > 0 for n in m["server_requests_per_replica"])
    assert sum(m["routed_per_replica"]) >= m["sent"]

    cfg.kill_replica_s = 1.0
    wl, facts, runs = run_storm(cfg)
    run = runs[1]
    m = {x["setup"]: x for x in build_report(wl, facts, runs, cfg, "pytest")["setups"]}["zp-fleet"]
    assert run.kill is not None and run.kill["in_flight"] > 0
    # a conversation whose turn was cut stops there: its later turns are never sent (not errors of theirs)
    failed = [r for r in run.records if not r.ok and r.sent]
    assert all(r.error == "conversation stopped" for r in run.records if not r.ok and not r.sent)
    assert failed and len(failed) == m["cut_requests"] <= run.kill["in_flight"]  # at most those streaming
    assert all("StreamCut" in (r.error or "") for r in failed), [r.error for r in failed]
    assert m["moved_off_dead"] >= 0 and m["ok"] == len([r for r in run.records if r.ok])
