"""Calibration: the budget's limit and block size read from a real server on loopback.

The simulator (``SimServer``) runs with pools that are not its profile's default, so every number checked
must have come from its ``/metrics``; small Starlette apps stand in for servers without ``/metrics`` or
without ``vllm:cache_config_info``, and for an older vLLM that exports ``vllm:gpu_cache_usage_perc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from _asgi_server import ThreadedApp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests._redis_keys import delete_keys
from zp_client import LocalBudget
from zp_client.budget.redis import RedisBudget
from zp_client.calibration import Calibration, calibrate, calibrate_async, server_root
from zp_client.cli import main
from zp_client.errors import CalibrationError, ConfigurationError, ServerInfoError
from zp_client.server import ELASTIC_HEADROOM, STRICT_HEADROOM, suggest_limit_blocks

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]

N = 300  # the simulator's pool in these tests (the tiny profile's own is 512)


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", num_gpu_blocks=N, speedup=20) as server:
        yield server


# --------------------------------------------------------------------------- stand-in servers


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": "m-small", "object": "model", "owned_by": "vllm", "max_model_len": 2048},
        {"id": "m-large", "object": "model", "owned_by": "vllm", "max_model_len": 8192}]})


def _cache_info(labels: str) -> str:
    return ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{labels}}} 1.0\n")


OLD_VLLM_METRICS = (
    "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.\n# TYPE vllm:gpu_cache_usage_perc gauge\n"
    'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
    + _cache_info('block_size="32",num_gpu_blocks="1001",enable_prefix_caching="False"'))
NO_CACHE_INFO = ("# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
                 'vllm:num_requests_running{model_name="m"} 2.0\n')
NO_POOL = _cache_info('block_size="16",num_gpu_blocks="None"')


class StandIn(ThreadedApp):
    """``/v1/models`` with two cards, and ``/metrics`` serving ``metrics`` (404 when None); ``models``
    False answers 404 on ``/v1/models`` too."""

    def __init__(self, metrics: str | None, models: bool = True) -> None:
        routes = [Route("/v1/models", _models, methods=["GET"])] if models else []
        if metrics is not None:
            text = metrics

            async def serve(request: Request) -> Response:
                return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

            routes.append(Route("/metrics", serve, methods=["GET"]))
        super().__init__(Starlette(routes=routes))

    @property
    def url(self) -> str:
        return self.root_url


# --------------------------------------------------------------------------- calibrate()


@pytest.mark.needs_sim
@pytest.mark.parametrize("policy", ["elastic", "strict"])
def test_calibration_reads_the_simulators_pool(sim: SimServer, policy: str) -> None:
    cal = calibrate(sim.base_url, policy=policy)
    assert cal.num_gpu_blocks == N
    assert cal.usable_blocks == N - 1
    assert cal.block_size == 16
    assert cal.max_model_len == sim.max_model_len
    assert cal.models == (sim.model,)
    assert cal.limit_blocks == suggest_limit_blocks(N, policy=policy)
    assert cal.headroom == (ELASTIC_HEADROOM if policy == "elastic" else STRICT_HEADROOM)
    assert cal.headroom_is_default and cal.policy == policy
    assert cal.kv_usage_metric == "vllm:kv_cache_usage_perc" and cal.kv_cache_usage == 0.0
    assert cal.prefix_caching is True
    assert cal.cache_config["num_gpu_blocks"] == str(N)


@pytest.mark.needs_sim
@pytest.mark.parametrize("policy", ["elastic", "strict"])
def test_a_given_headroom_is_used_and_said(sim: SimServer, policy: str) -> None:
    cal = calibrate(sim.url, headroom=0.8, policy=policy)
    assert cal.limit_blocks == suggest_limit_blocks(N, 0.8, policy=policy) == 239
    assert cal.headroom == 0.8 and not cal.headroom_is_default
    lines = cal.explain()
    assert any("num_gpu_blocks:  300" in line for line in lines)
    assert any("limit_blocks:    239 = floor(299 x 0.8)" in line for line in lines)
    assert any("headroom:        0.8 (given)" in line for line in lines)


@pytest.mark.needs_sim
@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_the_root_and_the_v1_base_url_are_the_same_server(sim: SimServer, suffix: str) -> None:
    cal = calibrate(sim.url + suffix)
    assert cal.url == sim.url
    assert cal.num_gpu_blocks == N and cal.max_model_len == sim.max_model_len


def test_server_root_keeps_a_gateway_prefix() -> None:
    assert server_root("http://gw/llm/v1") == "http://gw/llm"
    assert server_root("https://h:8000/") == "https://h:8000"
    with pytest.raises(ConfigurationError):
        server_root("h:8000/v1")


@pytest.mark.needs_sim
def test_async_calibration_equals_the_sync_one(sim: SimServer) -> None:
    import anyio

    got = anyio.run(lambda: calibrate_async(sim.base_url, policy="strict", headroom=0.9))
    assert got == calibrate(sim.base_url, policy="strict", headroom=0.9)


@pytest.mark.needs_sim
def test_calibration_is_a_frozen_value(sim: SimServer) -> None:
    cal = calibrate(sim.base_url)
    with pytest.raises(AttributeError):
        cal.limit_blocks = 1  # type: ignore[misc]
    doc = json.loads(json.dumps(cal.as_dict()))
    assert doc["limit_blocks"] == cal.limit_blocks and doc["usable_blocks"] == N - 1
    assert doc["code"] == f"LocalBudget(limit_blocks={cal.limit_blocks}, block_size=16)"


def test_an_older_vllm_metric_name_and_several_models() -> None:
    with StandIn(OLD_VLLM_METRICS) as s:
        cal = calibrate(s.base_url)
    assert cal.num_gpu_blocks == 1001 and cal.block_size == 32
    assert cal.limit_blocks == suggest_limit_blocks(1001) == 1000  # floor(1000 x 1.0): the whole usable pool
    assert cal.kv_usage_metric == "vllm:gpu_cache_usage_perc" and cal.kv_cache_usage == 0.25
    assert cal.max_model_len == 8192 and cal.models == ("m-small", "m-large")  # the largest context
    assert cal.max_request_blocks == 256
    assert cal.prefix_caching is False
    assert any("prefix caching is off" in line for line in cal.explain())


def test_a_models_endpoint_that_fails_leaves_max_model_len_unknown_not_the_limit() -> None:
    with StandIn(OLD_VLLM_METRICS, models=False) as s:
        cal = calibrate(s.url)
    assert cal.max_model_len is None and cal.max_request_blocks is None
    assert cal.models_note == "GET /v1/models answered HTTP 404"
    assert cal.limit_blocks == 1000
    unknown = "max_model_len:   unknown (GET /v1/models answered HTTP 404)"
    assert any(unknown in line for line in cal.explain())


@pytest.mark.needs_sim
def test_a_limit_below_one_full_context_request_is_flagged() -> None:
    with SimServer(profile="tiny", num_gpu_blocks=40, max_model_len=600) as s:
        cal = calibrate(s.url, headroom=0.5)
    assert cal.limit_blocks == 19 and cal.max_request_blocks == 38
    assert any("LeaseTooLarge" in line for line in cal.explain())


# --------------------------------------------------------------------------- errors


def test_a_server_without_metrics_is_a_clear_error() -> None:
    with StandIn(None) as s, pytest.raises(CalibrationError) as info:
        calibrate(s.base_url)
    err = info.value
    assert isinstance(err, ServerInfoError) and err.status == 404
    assert err.url == f"{s.url}/metrics" and err.missing == "no /metrics"
    assert f"cannot calibrate from {s.url}/metrics: no /metrics (HTTP 404" in str(err)


@pytest.mark.parametrize(("text", "missing"), [
    (NO_CACHE_INFO, "no vllm:cache_config_info in /metrics"),
    (NO_POOL, "vllm:cache_config_info has no num_gpu_blocks"),
])
def test_metrics_without_the_pool_is_a_clear_error(text: str, missing: str) -> None:
    with StandIn(text) as s, pytest.raises(CalibrationError) as info:
        LocalBudget.from_server(s.url)
    assert info.value.missing == missing and info.value.status == 200
    assert f"{s.url}/metrics" in str(info.value) and missing in str(info.value)


def test_no_server_is_a_clear_error() -> None:
    with StandIn(None) as s:
        url = s.url
    with pytest.raises(CalibrationError) as info:  # the server is gone: nothing listens there now
        calibrate(url, timeout_s=2)
    assert info.value.status == 0 and "/metrics did not answer" in str(info.value)


@pytest.mark.parametrize("kwargs", [{"headroom": 0.0}, {"headroom": 1.5}, {"policy": "lax"},
                                    {"timeout_s": 0}])
def test_bad_arguments_fail_before_any_request(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        calibrate("http://127.0.0.1:9/v1", **kwargs)  # port 9 (discard): never asked


# --------------------------------------------------------------------------- budgets


@pytest.mark.needs_sim
@pytest.mark.parametrize("policy", ["elastic", "strict"])
def test_local_budget_from_server(sim: SimServer, policy: str) -> None:
    budget = LocalBudget.from_server(sim.base_url, policy=policy, starvation_bound_s=1.0)
    assert budget.limit == suggest_limit_blocks(N, policy=policy)
    assert budget.block_size == 16
    assert budget.policy_name == policy
    assert isinstance(budget.calibration, Calibration)
    assert budget.calibration.limit_blocks == budget.limit
    with budget.lease_sync(budget.limit) as lease:  # the whole limit is one admissible lease
        assert lease.bound == budget.limit


def test_local_budget_takes_the_servers_block_size() -> None:
    with StandIn(OLD_VLLM_METRICS) as s:
        budget = LocalBudget.from_server(s.url, headroom=0.9)
    assert budget.block_size == 32 and budget.limit == suggest_limit_blocks(1001, 0.9) == 900


@pytest.mark.needs_sim
@pytest.mark.redis
@pytest.mark.parametrize("policy", ["elastic", "strict"])
def test_redis_budget_from_server(sim: SimServer, redis_url: str, redis_prefix: str, policy: str) -> None:
    budget = RedisBudget.from_server(redis_url, redis_prefix, sim.base_url, policy=policy, recovery_s=0)
    try:
        assert budget.limit == suggest_limit_blocks(N, policy=policy)
        assert budget.block_size == 16
        assert budget.calibration is not None and budget.calibration.num_gpu_blocks == N
        with budget.lease_sync(10):  # creates the budget in Redis with the calibrated limit
            pass
        stored = budget.status_sync()
        assert stored.limit == suggest_limit_blocks(N, policy=policy)
        assert stored.block_size == 16 and stored.policy == policy
    finally:
        budget.close_sync()
        delete_keys(redis_url, redis_prefix)


@pytest.mark.needs_sim
@pytest.mark.redis
def test_an_existing_redis_budget_keeps_its_stored_limit(sim: SimServer, redis_url: str,
                                                         redis_prefix: str) -> None:
    first = RedisBudget(redis_url, redis_prefix, 50, recovery_s=0)
    later = None
    try:
        with first.lease_sync(5):
            pass
        later = RedisBudget.from_server(redis_url, redis_prefix, sim.url, recovery_s=0)
        assert later.calibration is not None and later.calibration.limit_blocks == 299  # floor(299 x 1.0)
        with later.lease_sync(5):
            pass
        assert later.limit == 50  # the creator's limit stands; set_limit applies a new calibration
    finally:
        first.close_sync()
        if later is not None:
            later.close_sync()
        delete_keys(redis_url, redis_prefix)


# --------------------------------------------------------------------------- zp-client calibrate


@pytest.mark.needs_sim
def test_cli_prints_the_pool_and_the_limit(sim: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", sim.base_url]) == 0
    out = capsys.readouterr().out
    limit = suggest_limit_blocks(N)
    assert f"num_gpu_blocks:  {N}" in out
    assert "block_size:      16 tokens" in out
    assert f"max_model_len:   {sim.max_model_len} tokens" in out
    assert f"usable blocks:   {N - 1}" in out
    assert f"headroom:        {ELASTIC_HEADROOM:g}" in out
    assert f"limit_blocks:    {limit} = floor({N - 1} x {ELASTIC_HEADROOM:g})" in out
    assert f"budget = LocalBudget(limit_blocks={limit}, block_size=16)" in out


@pytest.mark.needs_sim
def test_cli_json(sim: SimServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", sim.url, "--json", "--policy", "strict", "--headroom", "0.9"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_gpu_blocks"] == N and doc["block_size"] == 16 and doc["usable_blocks"] == N - 1
    assert doc["max_model_len"] == sim.max_model_len
    assert doc["policy"] == "strict" and doc["headroom"] == 0.9
    assert doc["limit_blocks"] == suggest_limit_blocks(N, 0.9, policy="strict")
    assert doc["code"] == f"LocalBudget(limit_blocks={doc['limit_blocks']}, block_size=16, policy='strict')"


def test_cli_on_a_server_without_metrics_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with StandIn(None) as s:
        assert main(["calibrate", s.base_url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"zp-client calibrate: cannot calibrate from {s.url}/metrics: no /metrics")


def test_cli_bad_headroom_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "http://127.0.0.1:9", "--headroom", "2"]) == 2
    assert "headroom must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.needs_sim
@pytest.mark.slow
def test_cli_against_the_sim_command(tmp_path: Any) -> None:
    """End to end, as the acceptance reads: `zp-client calibrate` against `zp-client sim --num-gpu-blocks`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "zp_client.cli", "sim", "--port", "0", "--profile", "tiny",
         "--num-gpu-blocks", "777"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        base_url = None
        for line in proc.stderr:
            if "serving model" in line:
                base_url = line.rsplit(" at ", 1)[1].strip()
                break
        assert base_url, "the sim command prints where it serves"
        done = subprocess.run([sys.executable, "-m", "zp_client.cli", "calibrate", base_url],
                              capture_output=True, text=True, env=env, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert done.returncode == 0, done.stderr
    assert "num_gpu_blocks:  777" in done.stdout
    assert f"limit_blocks:    {suggest_limit_blocks(777)} = floor(776 x {ELASTIC_HEADROOM:g})" in done.stdout
