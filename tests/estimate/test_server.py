"""ServerInfo against a real loopback HTTP server: /v1/models, /tokenize, /metrics; estimator server mode."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests._asgi_server import PromptExitServer
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, ServerInfoError
from zp_client.estimate import Estimator
from zp_client.server import ServerInfo, parse_metrics, resolve_url, suggest_limit_blocks

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="2001"} 1.0
"""

OLD_METRICS = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""


def _count(text: str) -> int:
    return len(text.split())


class _Server:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.models_status = 200
        self.metrics_text = METRICS

        async def models(request: Request) -> Response:
            self.calls.append(("GET", request.url.path, None))
            if self.models_status != 200:
                return JSONResponse({"error": {"message": "models are resting"}}, status_code=self.models_status)
            return JSONResponse({"object": "list", "data": [
                {"id": "small", "object": "model", "max_model_len": 4096},
                {"id": "big", "object": "model", "max_model_len": 32768},
                {"id": "odd", "object": "model"}]})

        async def tokenize(request: Request) -> Response:
            body = await request.json()
            self.calls.append(("POST", request.url.path, body))
            if body.get("model") == "broken":
                return JSONResponse({"error": {"message": "The model `broken` does not exist.", "type": "NotFound"}},
                                    status_code=404)
            if "messages" in body:
                n = sum(_count(m.get("content") or "") + 5 for m in body["messages"]) + 2
                n += 100 * len(body.get("tools") or [])
            else:
                n = _count(body["prompt"]) + 1
            return JSONResponse({"count": n, "max_model_len": 4096, "tokens": list(range(n))})

        async def metrics(request: Request) -> Response:
            self.calls.append(("GET", request.url.path, None))
            return PlainTextResponse(self.metrics_text)

        app = Starlette(routes=[Route("/v1/models", models), Route("/tokenize", tokenize, methods=["POST"]),
                                Route("/metrics", metrics)])
        self._server = PromptExitServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                                     lifespan="off"))

    def __enter__(self) -> _Server:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "test server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.exit_now()
        self._thread.join(timeout=10)

    def count(self, method: str, path: str) -> int:
        return sum(1 for m, p, _ in self.calls if (m, p) == (method, path))


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    with _Server() as s:
        yield s


@pytest.fixture(autouse=True)
def _reset(server: _Server) -> None:
    server.calls.clear()
    server.models_status = 200
    server.metrics_text = METRICS


def _fetchers(base_url: str) -> tuple[Any, Any]:
    async def fetch(method: str, path: str, body: Any) -> tuple[int, bytes]:
        async with httpx.AsyncClient() as c:
            r = await c.request(method, resolve_url(base_url, path), json=body)
            return r.status_code, r.content

    def fetch_sync(method: str, path: str, body: Any) -> tuple[int, bytes]:
        with httpx.Client() as c:
            r = c.request(method, resolve_url(base_url, path), json=body)
            return r.status_code, r.content

    return fetch, fetch_sync


def _info(server: _Server, **settings: Any) -> ServerInfo:
    fetch, fetch_sync = _fetchers(server.base_url)
    return ServerInfo(fetch=fetch, fetch_sync=fetch_sync, settings=Settings(**settings))


def test_resolve_url_convention() -> None:
    assert resolve_url("http://h:8000/v1", "models") == "http://h:8000/v1/models"
    assert resolve_url("http://h:8000/v1/", "/tokenize") == "http://h:8000/tokenize"
    assert resolve_url("https://gw.example/llm/v1", "/metrics") == "https://gw.example/llm/metrics"
    assert resolve_url("http://h:8000", "/tokenize") == "http://h:8000/tokenize"


def test_suggest_limit_blocks() -> None:
    # elastic (the default policy) keeps 10% for forecast error (docs/elastic.md#the-reserve-under-overload)
    assert suggest_limit_blocks(2001) == 2000  # elastic: the whole usable pool (its reserve is the policy's)
    assert suggest_limit_blocks(2001, policy="strict") == 1900
    assert suggest_limit_blocks(2001, headroom=0.9, policy="strict") == 1800
    assert suggest_limit_blocks(201, headroom=1.0) == 200
    with pytest.raises(ConfigurationError):
        suggest_limit_blocks(100, policy="greedy")
    assert suggest_limit_blocks(1) == 0
    with pytest.raises(ConfigurationError):
        suggest_limit_blocks(100, headroom=1.5)
    with pytest.raises(ConfigurationError):
        suggest_limit_blocks(0)


def test_max_model_len_is_fetched_once_and_cached(server: _Server) -> None:
    info = _info(server)

    async def main() -> list[int | None]:
        # concurrent first callers share one GET
        results: list[int | None] = []

        async def ask(model: str | None) -> None:
            results.append(await info.max_model_len(model))

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(ask, "small")
        results.append(await info.max_model_len("big"))
        results.append(await info.max_model_len("odd"))
        results.append(await info.max_model_len("unknown"))
        results.append(await info.max_model_len(None))
        return results

    results = anyio.run(main)
    assert results == [4096] * 5 + [32768, None, 32768, 32768]
    assert server.count("GET", "/v1/models") == 1


def test_max_model_len_sync_and_configured_value_wins(server: _Server) -> None:
    assert _info(server).max_model_len_sync("small") == 4096
    assert server.count("GET", "/v1/models") == 1
    configured = _info(server, max_model_len=1234)
    assert configured.max_model_len_sync("big") == 1234
    assert anyio.run(configured.max_model_len, "big") == 1234
    assert server.count("GET", "/v1/models") == 1


def test_failed_models_fetch_is_not_repeated_on_every_call(server: _Server) -> None:
    server.models_status = 503
    info = _info(server)
    assert info.max_model_len_sync("small") is None
    assert info.max_model_len_sync("small") is None
    assert server.count("GET", "/v1/models") == 1
    info._models_failed_at = time.monotonic() - 31  # the retry interval elapsed
    server.models_status = 200
    assert info.max_model_len_sync("small") == 4096


def test_unreachable_server_gives_none_not_an_exception() -> None:
    async def refused(method: str, path: str, body: Any) -> tuple[int, bytes]:
        async with httpx.AsyncClient() as c:
            r = await c.request(method, resolve_url("http://127.0.0.1:9/v1", path), json=body)
            return r.status_code, r.content

    info = ServerInfo(fetch=refused, settings=Settings())
    assert anyio.run(info.max_model_len, "m") is None
    with pytest.raises(ServerInfoError, match="did not answer"):
        anyio.run(info.tokenize, "/v1/completions", {"prompt": "x"})


def test_tokenize_chat_form(server: _Server) -> None:
    info = _info(server)
    body = {"model": "small", "messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "one two three"}],
            "tools": [{"type": "function", "function": {"name": "f"}}], "max_tokens": 5, "stream": True}
    assert anyio.run(info.tokenize, "/v1/chat/completions", body) == (2 + 5) + (3 + 5) + 2 + 100
    sent = [b for m, p, b in server.calls if p == "/tokenize"][0]
    assert sent == {"model": "small", "messages": body["messages"], "add_generation_prompt": True,
                    "tools": body["tools"]}
    assert info.tokenize_sync("/v1/chat/completions", body) == 117


def test_tokenize_completion_forms(server: _Server) -> None:
    info = _info(server)
    assert info.tokenize_sync("/v1/completions", {"model": "small", "prompt": "a b c d"}) == 5
    assert server.calls[-1][2] == {"model": "small", "prompt": "a b c d", "add_special_tokens": True}
    assert info.tokenize_sync("/v1/completions", {"prompt": ["a", "a b c d e f"]}) == 7  # the longest
    before = len(server.calls)
    assert info.tokenize_sync("/v1/completions", {"prompt": [5, 6, 7]}) == 3  # token ids: no request
    assert len(server.calls) == before


def test_tokenize_error_carries_the_servers_message(server: _Server) -> None:
    info = _info(server)
    with pytest.raises(ServerInfoError, match="does not exist") as exc:
        info.tokenize_sync("/v1/completions", {"model": "broken", "prompt": "x"})
    assert exc.value.status == 404


def test_metrics(server: _Server) -> None:
    m = anyio.run(_info(server).metrics)
    assert m.kv_cache_usage_perc == 0.75  # the fullest engine
    assert m.num_requests_running == 5.0 and m.num_requests_waiting == 7.0
    assert m.num_preemptions_total == 12.0
    assert m.block_size == 16 and m.num_gpu_blocks == 2001
    assert m.cache_config["enable_prefix_caching"] == "True"
    assert suggest_limit_blocks(m.num_gpu_blocks) == 2000 and suggest_limit_blocks(2001, headroom=0.9) == 1800
    assert _info(server).metrics_sync() == m


def test_metrics_of_older_servers_and_garbage() -> None:
    old = parse_metrics(OLD_METRICS)
    assert old.kv_cache_usage_perc == 0.25 and old.num_gpu_blocks is None and old.num_preemptions_total is None
    with pytest.raises(ServerInfoError):
        parse_metrics("this is { not prometheus")


def test_missing_fetch_is_a_configuration_error() -> None:
    info = ServerInfo(settings=Settings())
    with pytest.raises(ConfigurationError, match="fetch"):
        info.metrics_sync()
    with pytest.raises(ConfigurationError, match="fetch_sync"):
        info.tokenize_sync("/v1/completions", {"prompt": "x"})


# --- estimator server mode ----------------------------------------------------------------------------


def test_server_mode_asks_tokenize_once_per_content(server: _Server) -> None:
    info = _info(server)
    est = Estimator(Settings(estimator="server"))
    body = {"model": "small", "messages": [{"role": "user", "content": "alpha beta gamma"}], "max_tokens": 9}

    async def main() -> list[Any]:
        return [await est.estimate_async("/v1/chat/completions", json.loads(json.dumps(body)), info)
                for _ in range(3)]

    results = anyio.run(main)
    assert all(r.exact and r.tokens == 3 + 5 + 2 and r.max_tokens == 9 for r in results)
    assert server.count("POST", "/tokenize") == 1
    sync = est.estimate_sync_server("/v1/chat/completions", body, info)
    assert sync == results[0] and server.count("POST", "/tokenize") == 1
    other = est.estimate_sync_server("/v1/chat/completions", {**body, "model": "big"}, info)
    assert other.exact and server.count("POST", "/tokenize") == 2
    assert est.reserve_tokens(results[0]) == 10  # exact counts are reserved as they are


def test_server_mode_falls_back_offline_when_tokenize_fails(server: _Server) -> None:
    info = _info(server)
    est = Estimator(Settings(estimator="server"))
    r = est.estimate_sync_server("/v1/completions", {"model": "broken", "prompt": "one two three"}, info)
    assert not r.exact and r.tokens == est.estimate("/v1/completions", {"prompt": "one two three"}).tokens


def test_offline_modes_never_ask_the_server(server: _Server) -> None:
    info = _info(server)
    est = Estimator(Settings(estimator="auto"))
    r = anyio.run(est.estimate_async, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": "hello"}]}, info)
    assert not r.exact and server.count("POST", "/tokenize") == 0
