"""The transport with an elastic budget: lease metadata, progress, forecasts and the oracle; and the
transport follow-ups (async retry recording, the PromptTooLong lower bound, ServerInfo.from_url)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from tests._asgi_server import MAX_MODEL_LEN, LoopbackServer
from tests._oracle import BodyOracleForecaster
from zp_client.budget.local import LocalBudget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, PromptTooLong
from zp_client.estimate import PromptEstimate
from zp_client.forecast import LengthForecaster, Prior
from zp_client.server import ServerInfo
from zp_client.transport import forecaster_for, transport_classes

# The openai 2.x environment (make test-openai2) has no httpx2; these tests belong to the main one.
httpx2 = pytest.importorskip("httpx2")

pytestmark = pytest.mark.anyio

CHAT = {"model": "ok", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 32}
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 120}


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def settings(**kw: Any) -> Settings:
    return Settings(estimator="heuristic", **kw)


def async_client(mod: Any, server: LoopbackServer, budget: Any, **kw: Any) -> Any:
    t = transport_classes(mod).AsyncAdmissionTransport(budget=budget, settings=kw.pop("settings", settings()), **kw)
    return mod.AsyncClient(transport=t, base_url=server.base_url, timeout=30)


def sync_client(mod: Any, server: LoopbackServer, budget: Any, **kw: Any) -> Any:
    t = transport_classes(mod).AdmissionTransport(budget=budget, settings=kw.pop("settings", settings()), **kw)
    return mod.Client(transport=t, base_url=server.base_url, timeout=30)


def live_meta(budget: LocalBudget) -> dict[str, Any]:
    (rec,) = budget._ledger.leases.values()
    return dict(rec.meta)


def short_forecaster() -> LengthForecaster:
    """Believes outputs are ~3 tokens long (a tight prior, plus observations)."""
    fc = LengthForecaster(q=0.9, prior=Prior(median=3, sigma=0.2, weight=50))
    fc.observe_many("slow", [3] * 50)
    return fc


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.parametrize("mod", [httpx, httpx2], ids=lambda m: m.__name__)
async def test_elastic_stream_sends_meta_and_progress(mod: Any, server: LoopbackServer) -> None:
    budget = LocalBudget(1000, 16, policy="elastic")
    fc = short_forecaster()
    body = {**CHAT, "model": "slow", "stream": True, "max_tokens": 2000, "messages": [SYSTEM, *CHAT["messages"]]}
    async with async_client(mod, server, budget, forecaster=fc) as c:
        async with c.stream("POST", "/chat/completions", json=body, headers={"X-ZP-Route": "slow"}) as r:
            it = r.aiter_raw()
            await it.__anext__()
            meta0 = live_meta(budget)
            assert meta0["streaming"] is True
            assert 3 <= meta0["forecast_tokens"] <= 10  # the forecaster's q=0.9 for "slow"
            assert meta0["prompt_tokens"] > 200 and meta0["first_token"] is True
            # The preamble's full blocks, from the estimator's lower bound: positive, below the prompt.
            assert meta0["prefix_key"] and 0 < meta0["prefix_blocks"] * 16 <= meta0["prompt_tokens"]
            seen = 1
            async for _ in it:
                seen += 1
                m = live_meta(budget)
                if m.get("tokens", 0) - m["prompt_tokens"] >= 80:
                    break
            held = budget._ledger.leases[next(iter(budget._ledger.leases))].held
            # Held growth is reported with the exact token count; the stream outgrew its forecast and
            # was re-forecast beyond what it generated so far (conditional quantile).
            assert m["tokens"] >= m["prompt_tokens"] + 80
            assert held == -(-m["tokens"] // 16)
            assert m["forecast_tokens"] > m["tokens"] - m["prompt_tokens"] > meta0["forecast_tokens"]
    assert (await budget.status()).used == 0
    sent = server.llm_requests()[-1]
    assert "x-zp-route" not in sent["headers"]


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.parametrize("reserve_z", [0.0, 0.5])
async def test_upper_forecasts_are_sent_only_to_a_spread_sized_reserve(reserve_z: float,
                                                                       server: LoopbackServer) -> None:
    """A policy with a spread-sized reserve (``ElasticPolicy(reserve_z > 0)``) reads each stream's upper
    forecast, ``forecast_hi``: the forecaster's ``spread`` at admission and again at every re-forecast.
    Without it the field is never sent (nor computed)."""
    from zp_client.budget.elastic import ElasticPolicy

    budget = LocalBudget(1000, 16, policy=ElasticPolicy(16, reserve_z=reserve_z, reserve_k=0.0))
    assert budget.reads_forecast_spread is (reserve_z > 0)
    # cold_n=0: forecast from the prior at once (a cold route's first requests are forecast at their bound)
    fc = LengthForecaster(q=0.5, prior=Prior(median=3, sigma=0.6, weight=50), cold_n=0)
    body = {**CHAT, "model": "slow", "stream": True, "max_tokens": 2000}
    async with async_client(httpx2, server, budget, forecaster=fc) as c:
        async with c.stream("POST", "/chat/completions", json=body, headers={"X-ZP-Route": "slow"}) as r:
            it = r.aiter_raw()
            await it.__anext__()
            meta0 = live_meta(budget)
            async for _ in it:
                m = live_meta(budget)
                if m.get("tokens", 0) - m["prompt_tokens"] >= 80:
                    break
    assert m["forecast_tokens"] > meta0["forecast_tokens"]  # re-forecast on the way
    if not reserve_z:
        assert "forecast_hi" not in meta0 and "forecast_hi" not in m
        return
    assert meta0["forecast_hi"] == max(meta0["forecast_tokens"], fc.spread("slow", max_tokens=2000))
    assert meta0["forecast_hi"] > meta0["forecast_tokens"]  # the 0.9 quantile above the median
    assert m["forecast_hi"] >= m["forecast_tokens"] and m["forecast_hi"] > meta0["forecast_hi"]


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_elastic_stream_reports_every_new_block(server: LoopbackServer) -> None:
    """The projected peak reads ``held`` as the lease's occupancy now: an elastic stream reports each block
    it enters, so the policy never sees it more than a block behind (strict reports every 4)."""
    budget = LocalBudget(1000, 16, policy="elastic")
    seen: list[int] = []
    real = budget._ledger.report_held

    def spy(lease_id: str, held: int) -> bool:
        seen.append(held)
        return real(lease_id, held)

    budget._ledger.report_held = spy  # type: ignore[method-assign]
    body = {**CHAT, "model": "slow", "stream": True, "max_tokens": 2000}
    async with async_client(httpx2, server, budget, forecaster=LengthForecaster(q=0.9)) as c:
        async with c.stream("POST", "/chat/completions", json=body) as r:
            events = 0
            async for chunk in r.aiter_raw():  # the "slow" model: one token every 20 ms
                events += chunk.count(b"data:")
                if events >= 100:
                    break
    growth = sorted(set(seen))
    assert len(growth) >= 5, seen  # 100 tokens: six blocks
    assert growth == list(range(growth[0], growth[-1] + 1)), f"a block was skipped: {seen}"
    assert (await budget.status()).used == 0


async def test_elastic_completed_stream_teaches_the_forecaster(server: LoopbackServer) -> None:
    budget = LocalBudget(1000, 16, policy="elastic")
    body = {**CHAT, "stream": True}
    async with async_client(httpx, server, budget) as c:
        for _ in range(3):
            async with c.stream("POST", "/chat/completions", json=body, headers={"X-ZP-Route": "planner"}) as r:
                await r.aread()
        r2 = await c.post("/chat/completions", json=CHAT)  # non-streamed, keyed by model
        assert r2.status_code == 200
    fc = forecaster_for(budget)
    assert c._transport.forecaster is fc
    assert fc.observations("planner") == 3 and fc.observations("ok") == 1
    assert fc.observations("default") == 0
    # The loopback server answers 6 completion tokens: the learned distribution moved towards it.
    assert fc.quantile("planner", 0.5) < fc.quantile("never-seen", 0.5)


async def test_a_completion_at_its_max_tokens_is_learned_as_censored(server: LoopbackServer) -> None:
    """The loopback server answers 6 completion tokens: with ``max_tokens`` 6 the answer ended at its bound,
    and a ``censored`` forecaster learns it as capped; with 32 it did not. A forecaster without
    ``censored`` (the default since issue 30) learns both as plain lengths."""
    budget = LocalBudget(1000, 16, policy="elastic")
    cens = LengthForecaster()
    assert cens.censored  # the default
    plain = LengthForecaster(censored=False)
    for fc in (cens, plain):
        async with async_client(httpx, server, budget, forecaster=fc) as c:
            for max_tokens, route in ((6, "capped"), (32, "free")):
                body = {**CHAT, "stream": True, "max_tokens": max_tokens}
                hdrs = {"X-ZP-Route": route}
                async with c.stream("POST", "/chat/completions", json=body, headers=hdrs) as r:
                    await r.aread()
        assert fc.observations("capped") == 1 and fc.observations("free") == 1
    assert cens.capped_share("capped") > 0 and cens.capped_share("free") == 0
    assert plain.capped_share("capped") == 0


def test_a_risk_reserve_reads_the_upper_forecasts() -> None:
    from zp_client.budget.elastic import ElasticPolicy

    assert LocalBudget(1000, 16, policy=ElasticPolicy(16, reserve_k=0.5, reserve_z=0.0)).reads_forecast_spread
    assert LocalBudget(1000, 16, policy=ElasticPolicy(16)).reads_forecast_spread  # the default reserves
    off = ElasticPolicy(16, reserve_k=0.0, reserve_z=0.0)
    assert not LocalBudget(1000, 16, policy=off).reads_forecast_spread


async def test_non_streamed_elastic_request_holds_its_forecast(server: LoopbackServer) -> None:
    budget = LocalBudget(1000, 16, policy="elastic")
    seen: list[dict[str, Any]] = []
    real = budget.acquire

    async def spy(blocks: int, **kw: Any) -> Any:
        seen.append(dict(kw.get("meta") or {}))
        return await real(blocks, **kw)

    budget.acquire = spy  # type: ignore[method-assign]
    # stream_upstream off: this is about requests sent upstream non-streamed.
    async with async_client(httpx, server, budget, forecaster=short_forecaster(), stream_upstream=False) as c:
        r = await c.post("/chat/completions", json={**CHAT, "model": "ok"}, headers={"X-ZP-Route": "slow"})
        assert r.status_code == 200
        r = await c.post("/chat/completions", json={**CHAT, "n": 2})
        assert r.status_code == 200
    assert seen[0]["streaming"] is False and "first_token" not in seen[0]
    # n = 2 grows two tokens a step: projected as non-streamed, prompt and forecast for both choices.
    assert seen[1]["streaming"] is False
    assert seen[1]["forecast_tokens"] % 2 == 0 and seen[1]["prompt_tokens"] % 2 == 0


async def test_a_request_forecaster_gives_the_true_length_only_when_asked(server: LoopbackServer) -> None:
    budget = LocalBudget(1000, 16, policy="elastic")
    metas: list[dict[str, Any]] = []
    real = budget.acquire

    async def spy(blocks: int, **kw: Any) -> Any:
        metas.append(dict(kw.get("meta") or {}))
        return await real(blocks, **kw)

    budget.acquire = spy  # type: ignore[method-assign]
    body = {**CHAT, "max_tokens": 1000, "sim_output_tokens": 7}
    async with async_client(httpx, server, budget, forecaster=BodyOracleForecaster(forecaster_for(budget))) as c:
        await c.post("/chat/completions", json=body)
        await c.post("/chat/completions", json={**body, "sim_output_tokens": 5000})  # capped at max_tokens
        await c.post("/chat/completions", json=CHAT)  # no field: the forecaster
    async with async_client(httpx, server, budget) as c:
        await c.post("/chat/completions", json=body)  # not asked: the field is ignored
    assert [m["forecast_tokens"] for m in metas[:2]] == [7, 1000]
    # Without the field: the forecaster's 0.9 quantile, still mostly the wide prior (median 256): capped at
    # max_tokens for the 32-token request, far above the true 7 for the 1000-token one.
    assert metas[2]["forecast_tokens"] == 32
    assert metas[3]["forecast_tokens"] > 100
    assert server.llm_requests()[-1]["body"]["sim_output_tokens"] == 7  # the body goes as it is


async def test_strict_budget_gets_no_metadata(server: LoopbackServer) -> None:
    budget = LocalBudget(1000, 16, policy="strict")
    kws: list[dict[str, Any]] = []
    real = budget.acquire

    async def spy(blocks: int, **kw: Any) -> Any:
        kws.append(kw)
        return await real(blocks, **kw)

    budget.acquire = spy  # type: ignore[method-assign]
    async with async_client(httpx, server, budget) as c:
        assert c._transport.forecaster is None
        async with c.stream("POST", "/chat/completions", json={**CHAT, "stream": True},
                            headers={"X-ZP-Route": "r"}) as r:
            await r.aread()
    assert "meta" not in kws[0]
    assert "x-zp-route" not in server.llm_requests()[-1]["headers"]
    assert (await budget.status()).used == 0


def test_sync_elastic_stream_reports_first_token(server: LoopbackServer) -> None:
    budget = LocalBudget(1000, 16, policy="elastic")
    with sync_client(httpx2, server, budget) as c:
        with c.stream("POST", "/chat/completions", json={**CHAT, "model": "slow", "stream": True}) as r:
            it = r.iter_raw()
            next(it)
            assert live_meta(budget)["first_token"] is True
    assert budget.status_sync().used == 0


async def test_a_waiter_is_admitted_when_a_stream_reports_its_first_token(server: LoopbackServer) -> None:
    """End to end: two requests sharing a long preamble under a limit that fits them only if the preamble
    is counted once. The second waits while the first has produced nothing, and is admitted as soon as
    the caller reads the first's first event (the transport reports ``first_token``)."""
    body = {**CHAT, "model": "slow", "stream": True, "max_tokens": 40, "messages": [SYSTEM, *CHAT["messages"]]}
    probe = LocalBudget(10_000, 16, policy="elastic")
    async with async_client(httpx, server, probe) as c:
        async with c.stream("POST", "/chat/completions", json=body):
            m = live_meta(probe)
    peak_one = -(-m["prompt_tokens"] // 16) + -(-m["forecast_tokens"] // 16)
    assert m["forecast_tokens"] == 40 and m["prefix_blocks"] > 0
    limit = 2 * peak_one - m["prefix_blocks"]  # two cold copies do not fit, a warm shared one does
    budget = LocalBudget(limit, 16, policy="elastic")
    admitted, done = anyio.Event(), anyio.Event()
    async with async_client(httpx, server, budget) as c:
        async with c.stream("POST", "/chat/completions", json=body) as r1:
            assert "first_token" not in live_meta(budget)  # headers only: nothing read yet

            async def second() -> None:
                async with c.stream("POST", "/chat/completions", json=body) as r2:
                    admitted.set()
                    it2 = r2.aiter_raw()  # kept: a dropped iterator abandons the stream
                    await it2.__anext__()
                    await done.wait()

            async with anyio.create_task_group() as tg:
                tg.start_soon(second)
                while not (await budget.status()).waiters:
                    await anyio.sleep(0.005)
                assert not admitted.is_set()
                it1 = r1.aiter_raw()
                await it1.__anext__()  # the first event: prefix warm, the waiter fits
                await admitted.wait()
                st = await budget.status()
                assert st.leases == 2 and st.used <= limit
                done.set()
    assert (await budget.status()).used == 0


# ------------------------------------------------------------------------------------------ follow-ups
async def test_async_path_records_the_request_without_blocking_io(server: LoopbackServer) -> None:
    from zp_client.retry import RetryPolicy

    calls: list[str] = []

    class Policy(RetryPolicy):
        def new_request(self) -> Any:  # the blocking form must not run on the event loop
            calls.append("sync")
            return super().new_request()

        async def new_request_async(self) -> Any:
            calls.append("async")
            return await super().new_request_async()

    budget = LocalBudget(1000, 16)
    async with async_client(httpx, server, budget, retry=Policy(budget=None)) as c:
        r = await c.post("/chat/completions", json=CHAT)
        assert r.status_code == 200
    assert calls == ["async"]


class _FixedEstimator:
    """An estimator whose raw count over-estimates a prompt that truly fits."""

    def __init__(self, tokens: int, lower: int) -> None:
        self.tokens, self.lower = tokens, lower

    def estimate(self, path: str, body: Any) -> PromptEstimate:
        return PromptEstimate(self.tokens, 1, None, body.get("model"), None, 0, False)

    def reserve_tokens(self, est: PromptEstimate) -> int:
        return est.tokens

    def lower_bound_tokens(self, est: PromptEstimate) -> int:
        return self.lower

    def observe(self, est: PromptEstimate, prompt_tokens: int) -> None:
        pass


@pytest.mark.parametrize("lower,refused", [(MAX_MODEL_LEN - 100, False), (MAX_MODEL_LEN + 1, True)])
async def test_prompt_too_long_uses_the_lower_bound(server: LoopbackServer, lower: int, refused: bool) -> None:
    budget = LocalBudget(10_000, 16)
    est = _FixedEstimator(MAX_MODEL_LEN + 200, lower)
    before = len(server.llm_requests())
    async with async_client(httpx, server, budget, estimator=est) as c:
        if refused:
            with pytest.raises(PromptTooLong):
                await c.post("/chat/completions", json=CHAT)
        else:
            r = await c.post("/chat/completions", json=CHAT)
            assert r.status_code == 200
    assert len(server.llm_requests()) - before == (0 if refused else 1)
    assert (await budget.status()).used == 0


async def test_server_info_from_url(server: LoopbackServer) -> None:
    info = ServerInfo.from_url(server.base_url, headers={"Authorization": "Bearer x"}, settings=Settings())
    assert await info.max_model_len("ok") == MAX_MODEL_LEN
    assert server.requests[-1]["path"] == "/v1/models"
    assert server.requests[-1]["headers"]["authorization"] == "Bearer x"
    async with httpx.AsyncClient() as http:
        info2 = ServerInfo.from_url(server.base_url + "/", http=http, settings=Settings())
        assert await info2.max_model_len("ok") == MAX_MODEL_LEN
        with pytest.raises(ConfigurationError, match="fetch_sync"):
            info2.metrics_sync()  # an async client serves only the async methods
    with httpx2.Client() as http2:
        info3 = ServerInfo.from_url(server.base_url, http=http2, settings=Settings())
        assert info3.max_model_len_sync("ok") == MAX_MODEL_LEN
    assert ServerInfo.from_url(server.base_url, settings=Settings()).max_model_len_sync("ok") == MAX_MODEL_LEN
    with pytest.raises(ConfigurationError, match="http"):
        ServerInfo.from_url("localhost:8000")
