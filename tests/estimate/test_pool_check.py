"""The pool check (``Settings.pool_check``): the admission transport reads the server's ``GET /metrics``
once per budget and server, on the first admitted request, and warns (``logging``, logger
``zp_client.transport``) when the budget's limit is larger than the KV pool (``num_gpu_blocks - 1``
usable blocks). Real HTTP on loopback to the simulator; a server without vLLM's ``/metrics`` is left
alone and its requests are served as before."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests._asgi_server import LoopbackServer
from zp_client import LocalBudget, Settings, wrap
from zp_client._admission.servers import check_pool
from zp_client.server import ServerMetrics
from zp_client.transport import transport_classes

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]

LIBS: list[Any] = [httpx]
if importlib.util.find_spec("httpx2") is not None:
    import httpx2

    LIBS.append(httpx2)

POOL = 64  # num_gpu_blocks of the simulator: 63 usable blocks
BODY = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
LOGGER = "zp_client.transport"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", num_gpu_blocks=POOL, speedup=50) as s:
        yield s


@pytest.fixture(autouse=True)
def _no_zp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("ZP_")]:
        monkeypatch.delenv(name)


class Recording:
    """An inner transport (async or sync, httpx or httpx2) that forwards to the real one and records
    ``(method, path)`` of every request; ``metrics`` replaces the server's ``/metrics`` answer:
    ``"connect-error"``, or ``(status, text)``."""

    def __init__(self, mod: Any, is_async: bool, metrics: Any = None) -> None:
        self.mod, self.metrics = mod, metrics
        self.inner = mod.AsyncHTTPTransport() if is_async else mod.HTTPTransport()
        self.calls: list[tuple[str, str]] = []
        self.metrics_headers: list[dict[str, str]] = []

    def _record(self, request: Any) -> Any:
        self.calls.append((request.method, request.url.path))
        if request.url.path != "/metrics":
            return None
        self.metrics_headers.append({k.lower(): v for k, v in request.headers.items()})
        if self.metrics == "connect-error":
            raise self.mod.ConnectError("connection refused", request=request)
        if self.metrics is not None:
            status, text = self.metrics
            return self.mod.Response(status, text=text)
        return None

    async def handle_async_request(self, request: Any) -> Any:
        canned = self._record(request)
        return canned if canned is not None else await self.inner.handle_async_request(request)

    def handle_request(self, request: Any) -> Any:
        canned = self._record(request)
        return canned if canned is not None else self.inner.handle_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def close(self) -> None:
        self.inner.close()


def _run_calls(mod: Any, flavour: str, base_url: str, budget: LocalBudget, inner: Recording,
               settings: Settings | None = None, n: int = 6) -> list[int]:
    """``n`` admitted chat calls through the admission transport (concurrent when async); their statuses."""
    settings = settings or Settings(estimator="heuristic")
    classes = transport_classes(mod)
    headers = {"Authorization": "Bearer k"}
    if flavour == "sync":
        transport = classes.AdmissionTransport(inner, budget=budget, settings=settings)
        with mod.Client(transport=transport, base_url=base_url) as c:
            return [c.post("/chat/completions", json=BODY, headers=headers).status_code for _ in range(n)]

    async def main() -> list[int]:
        transport = classes.AsyncAdmissionTransport(inner, budget=budget, settings=settings)
        async with mod.AsyncClient(transport=transport, base_url=base_url) as c:
            replies = await asyncio.gather(*(c.post("/chat/completions", json=BODY, headers=headers)
                                             for _ in range(n)))
            return [r.status_code for r in replies]

    return asyncio.run(main())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.needs_sim
@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize("mod", LIBS, ids=lambda m: m.__name__)
def test_an_oversized_budget_warns_once_with_both_numbers(
    sim: SimServer, mod: Any, flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    budget = LocalBudget(limit_blocks=25_000)
    inner = Recording(mod, flavour == "async")
    assert _run_calls(mod, flavour, sim.base_url, budget, inner) == [200] * 6
    # a second transport on the same budget and server: no second read, no second warning
    inner2 = Recording(mod, flavour == "async")
    assert _run_calls(mod, flavour, sim.base_url, budget, inner2, n=2) == [200] * 2

    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    msg = warned[0]
    assert "limit_blocks=25000" in msg and "blocks of 16 tokens" in msg
    assert f"{POOL - 1} usable blocks" in msg and f"num_gpu_blocks={POOL}" in msg
    assert f"at {sim.url.rstrip('/')}" in msg
    assert "limit_blocks=63" in msg  # the suggestion: floor(63 x 1.0)
    # one GET /metrics, before the first admitted request was sent, with the caller's credentials
    assert inner.calls.count(("GET", "/metrics")) == 1
    assert inner.calls.index(("GET", "/metrics")) < inner.calls.index(("POST", "/v1/chat/completions"))
    assert inner.metrics_headers[0]["authorization"] == "Bearer k"
    assert ("GET", "/metrics") not in inner2.calls


@pytest.mark.needs_sim
@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_a_budget_that_fits_the_pool_does_not_warn(
    sim: SimServer, flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    budget = LocalBudget(limit_blocks=POOL - 1)  # exactly the usable pool
    inner = Recording(httpx, flavour == "async")
    assert _run_calls(httpx, flavour, sim.base_url, budget, inner) == [200] * 6
    assert inner.calls.count(("GET", "/metrics")) == 1
    assert _warnings(caplog) == []


@pytest.mark.needs_sim
@pytest.mark.slow
def test_wrapped_openai_clients_warn_once_per_budget(
    sim: SimServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The quick start's path: ``wrap(openai.AsyncOpenAI(...), budget=...)`` with nothing else set."""
    openai = pytest.importorskip("openai")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    shared, other = LocalBudget(limit_blocks=25_000), LocalBudget(limit_blocks=1_000)

    async def main() -> None:
        clients = [wrap(openai.AsyncOpenAI(base_url=sim.base_url, api_key="x"), budget=b)
                   for b in (shared, shared, other)]
        await asyncio.gather(*(c.chat.completions.create(**BODY) for c in clients for _ in range(3)))

    asyncio.run(main())
    warned = _warnings(caplog)
    assert len(warned) == 2, warned  # one per budget, however many clients share it
    assert sorted(m.split(" ", 2)[1] for m in warned) == ["limit_blocks=1000", "limit_blocks=25000"]


@pytest.mark.needs_sim
@pytest.mark.parametrize(
    "metrics",
    ["connect-error", (404, '{"detail":"Not Found"}'), (200, "# TYPE up gauge\nup 1\n"), (200, "not {prom")],
    ids=["connect-error", "404", "not-vllm", "unparseable"],
)
@pytest.mark.parametrize("flavour", ["async", "sync"])
def test_a_server_without_vllm_metrics_serves_requests_and_says_nothing(
    sim: SimServer, metrics: Any, flavour: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    budget = LocalBudget(limit_blocks=25_000)
    inner = Recording(httpx, flavour == "async", metrics=metrics)
    assert _run_calls(httpx, flavour, sim.base_url, budget, inner) == [200] * 6
    assert inner.calls.count(("GET", "/metrics")) == 1  # read once, never again after a failure
    assert _warnings(caplog) == []
    assert any(r.levelno == logging.DEBUG and "pool check" in r.getMessage() for r in caplog.records)


def test_a_real_server_without_metrics_route(caplog: pytest.LogCaptureFixture) -> None:
    """An OpenAI-shaped server that answers 404 to /metrics (tests/_asgi_server.py), on loopback."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with LoopbackServer() as server:
        budget = LocalBudget(limit_blocks=25_000)
        inner = Recording(httpx, True)
        body = {**BODY, "model": "ok"}

        async def main() -> list[int]:
            transport = transport_classes(httpx).AsyncAdmissionTransport(
                inner, budget=budget, settings=Settings(estimator="heuristic"))
            async with httpx.AsyncClient(transport=transport, base_url=server.base_url) as c:
                return [(await c.post("/chat/completions", json=body)).status_code for _ in range(3)]

        assert asyncio.run(main()) == [200, 200, 200]
    assert len(server.llm_requests()) == 3
    assert inner.calls.count(("GET", "/metrics")) == 1
    assert _warnings(caplog) == []


@pytest.mark.needs_sim
def test_the_opt_out_reads_nothing(
    sim: SimServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    inner = Recording(httpx, True)
    settings = Settings(estimator="heuristic", pool_check=False)
    budget = LocalBudget(limit_blocks=25_000)
    assert _run_calls(httpx, "async", sim.base_url, budget, inner, settings) == [200] * 6
    assert ("GET", "/metrics") not in inner.calls
    assert _warnings(caplog) == []
    monkeypatch.setenv("ZP_POOL_CHECK", "false")
    assert Settings().pool_check is False


def _metrics(num_gpu_blocks: int | None, block_size: int | None = 16) -> ServerMetrics:
    return ServerMetrics(kv_cache_usage_perc=None, num_requests_running=None, num_requests_waiting=None,
                         num_preemptions_total=None, block_size=block_size, num_gpu_blocks=num_gpu_blocks)


def test_check_pool_compares_usable_blocks_and_tokens(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    root = "http://h:8000"
    assert not check_pool(LocalBudget(limit_blocks=511), root, _metrics(512))  # the whole usable pool
    assert check_pool(LocalBudget(limit_blocks=512), root, _metrics(512))  # the null block is not usable
    # different block sizes compare in tokens: 300 x 32 = 9600 > 511 x 16 = 8176; 255 x 32 = 8160 fits
    assert check_pool(LocalBudget(limit_blocks=300, block_size=32), root, _metrics(512))
    assert not check_pool(LocalBudget(limit_blocks=255, block_size=32), root, _metrics(512))
    assert not check_pool(LocalBudget(limit_blocks=25_000), root, _metrics(None))  # no pool stated
    warned = _warnings(caplog)
    assert len(warned) == 2
    assert "limit_blocks=300 (blocks of 32 tokens)" in warned[1] and "of 16 tokens" in warned[1]
    assert "limit_blocks=255" in warned[1]  # floor(511 x 1.0) = 511 blocks of 16 = 255 blocks of 32
