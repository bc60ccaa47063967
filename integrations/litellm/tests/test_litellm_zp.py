"""litellm-zp through LiteLLM's real code path (litellm.acompletion / completion, its openai provider with
``client=``) against the simulator (zp_sim) behind a proxy that answers 503 for chosen models.

Asserted: one lease per successful call, all released; upstream attempts per always-failing call <= zp's
3 by default and with ``num_retries=2`` (the adapter's and the issue's one-line glue,
``litellm.acompletion(client=wrap(...))``, alike); a refusal reaches the caller as zp's own type after
one acquire; options and bad input.

Runs in the main environment (openai 3.x), where the Makefile installs litellm-zp.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
# LiteLLM fetches a model price map from the network when imported unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")
pytest.importorskip("litellm_zp", reason="not installed: pip install -e integrations/litellm")

from _fail_proxy import FailProxy  # noqa: E402
from _meta_spy import MetaSpy, targets  # noqa: E402

from litellm_zp import ZPLiteLLM  # noqa: E402
from zp_client import LocalBudget, Settings, observe_admissions, unwrap_error, wrap  # noqa: E402
from zp_client.errors import ConfigurationError, LeaseTooLarge, RetryBudgetExhausted, ZPError  # noqa: E402
from zp_client.retry import LocalRetryBudget, RetryPolicy, testing  # noqa: E402
from zp_sim.server import SimServer  # noqa: E402

pytestmark = pytest.mark.anyio
litellm.suppress_debug_info = True

SETTINGS = Settings(estimator="heuristic")
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=20.0) as s:
        yield s


@pytest.fixture(scope="module")
def proxy(sim: SimServer) -> Iterator[FailProxy]:
    with FailProxy(sim.url) as p:
        yield p


@pytest.fixture(autouse=True)
def no_sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """zp's backoff and the openai SDK's are skipped: the tests count attempts, not time."""
    from openai import _base_client

    monkeypatch.setattr(_base_client.BaseClient, "_calculate_retry_timeout", lambda *a, **k: 0.0)
    with testing():
        yield


def budget(limit: int = 400) -> LocalBudget:
    return LocalBudget(limit_blocks=limit, policy="strict")


def granted(b: LocalBudget) -> int:
    return int(b.status_sync().extra["granted"])


_made: list[Any] = []


async def close_clients() -> None:
    """An async test's clients are closed on its own event loop at its end (one collected later would
    close its connections on another test's loop)."""
    while _made:
        c = _made.pop()
        await (c.aclose() if isinstance(c, ZPLiteLLM) else c.close())


def adapter(proxy: FailProxy, b: LocalBudget, **kw: Any) -> ZPLiteLLM:
    kw.setdefault("retry", RetryPolicy(budget=None))
    llm = ZPLiteLLM(b, api_base=proxy.base_url, api_key="sk-test", settings=SETTINGS, **kw)
    _made.append(llm)
    return llm


def glue(proxy: FailProxy, b: LocalBudget, **kw: Any) -> openai.AsyncOpenAI:
    raw = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test")
    client = wrap(raw, b, settings=SETTINGS, **kw)
    _made.extend((raw, client))  # the wrapped client sends through raw's connection pool
    return client


@pytest.mark.slow
async def test_calls_take_one_lease_each_and_release_it(proxy: FailProxy, sim: SimServer) -> None:
    b = budget()
    llm = adapter(proxy, b)
    reply = await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=8)
    assert reply.choices[0].message.content and granted(b) == 1
    reply = llm.completion(model=sim.model, messages=MSGS, max_tokens=8)
    assert reply.choices[0].message.content and granted(b) == 2
    stream = await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=8, stream=True)
    chunks = [c async for c in stream]
    assert chunks and granted(b) == 3
    assert (await b.status()).used == 0 and proxy.count(sim.model) >= 3
    await close_clients()


@pytest.mark.parametrize("num_retries", [None, 2])
async def test_an_always_failing_call_makes_at_most_zps_attempts(proxy: FailProxy,
                                                                 num_retries: int | None) -> None:
    b = budget()
    llm = adapter(proxy, b)
    model = f"fail-adapter-{num_retries}"
    kw = {} if num_retries is None else {"num_retries": num_retries}
    with pytest.raises(openai.APIStatusError) as err:
        await llm.acompletion(model=model, messages=MSGS, max_tokens=8, **kw)
    assert err.value.status_code == 503
    assert proxy.count(model) == 3 and granted(b) == 3 and (await b.status()).used == 0
    await close_clients()


@pytest.mark.parametrize("num_retries", [None, 2])
async def test_the_one_line_glue_makes_at_most_zps_attempts(proxy: FailProxy,
                                                             num_retries: int | None) -> None:
    """``litellm.acompletion(client=wrap(...))``: LiteLLM sets the client's max_retries back to 2 and, with
    num_retries, repeats the call; zp's attempts are still the only ones sent."""
    b = budget()
    client = glue(proxy, b, retry=RetryPolicy(budget=None))
    model = f"fail-glue-{num_retries}"
    kw = {} if num_retries is None else {"num_retries": num_retries}
    with pytest.raises(openai.APIStatusError):
        await litellm.acompletion(model=f"openai/{model}", client=client, messages=MSGS, max_tokens=8, **kw)
    if num_retries is None:
        assert client.max_retries == 2  # what LiteLLM did to it (its num_retries repeats then set 0)
    assert proxy.count(model) == 3 and granted(b) == 3 and (await b.status()).used == 0
    await close_clients()


def test_an_always_failing_sync_call_with_num_retries(proxy: FailProxy) -> None:
    b = budget()
    llm = adapter(proxy, b)
    with pytest.raises(openai.APIStatusError):
        llm.completion(model="fail-sync", messages=MSGS, max_tokens=8, num_retries=2)
    assert proxy.count("fail-sync") == 3 and granted(b) == 3 and b.status_sync().used == 0


async def test_concurrent_calls_some_always_failing(proxy: FailProxy, sim: SimServer) -> None:
    b = budget()
    llm = adapter(proxy, b)
    models = [f"fail-many-{i}" if i % 4 == 0 else sim.model for i in range(12)]

    async def one(model: str) -> bool:
        try:
            await llm.acompletion(model=model, messages=MSGS, max_tokens=8, num_retries=2)
            return True
        except openai.APIStatusError:
            return False

    before_ok = proxy.count(sim.model)
    results = await asyncio.gather(*(one(m) for m in models))
    failing = [m for m in models if m.startswith("fail")]
    assert results == [not m.startswith("fail") for m in models]
    assert all(proxy.count(m) == 3 for m in failing)  # each independent: 3 attempts, no more
    assert proxy.count(sim.model) - before_ok == 9
    assert granted(b) == 9 + 3 * len(failing) and (await b.status()).used == 0
    await close_clients()


async def counting_acquires(b: LocalBudget, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = b.acquire

    async def acquire(blocks: int, **kw: Any) -> Any:
        calls.append(blocks)
        return await original(blocks, **kw)

    monkeypatch.setattr(b, "acquire", acquire)
    return calls


@pytest.mark.parametrize("num_retries", [None, 2])
async def test_a_refusal_keeps_its_type_after_one_acquire(proxy: FailProxy, sim: SimServer,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          num_retries: int | None) -> None:
    b = budget(limit=10)
    acquires = await counting_acquires(b, monkeypatch)
    llm = adapter(proxy, b)
    kw = {} if num_retries is None else {"num_retries": num_retries}
    before = proxy.count(sim.model)
    with pytest.raises(LeaseTooLarge) as err:
        await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=1000, **kw)
    assert isinstance(err.value, ZPError) and err.value.limit == 10
    assert len(acquires) == 1 and proxy.count(sim.model) == before
    await close_clients()


async def test_without_the_adapter_a_refusal_is_litellms_but_carries_zps(proxy: FailProxy,
                                                                          sim: SimServer) -> None:
    b = budget(limit=10)
    client = glue(proxy, b)
    with pytest.raises(Exception) as err:
        await litellm.acompletion(model=f"openai/{sim.model}", client=client, messages=MSGS, max_tokens=1000)
    assert not isinstance(err.value, ZPError)  # LiteLLM's mapping (litellm.InternalServerError)
    assert isinstance(unwrap_error(err.value), LeaseTooLarge)
    await close_clients()


async def test_retry_budget_exhausted_keeps_its_type_and_is_not_retried(proxy: FailProxy) -> None:
    b = budget()
    spent = RetryPolicy(budget=LocalRetryBudget(ratio=0.0, floor_per_s=0.0))
    llm = adapter(proxy, b, retry=spent)
    with pytest.raises(RetryBudgetExhausted):
        await llm.acompletion(model="fail-budget", messages=MSGS, max_tokens=8, num_retries=2)
    assert proxy.count("fail-budget") == 1 and granted(b) == 1 and (await b.status()).used == 0
    await close_clients()


async def test_options_become_each_calls_admission(proxy: FailProxy, sim: SimServer) -> None:
    b = budget()
    llm = adapter(proxy, b, zp_priority=2, zp_deadline=30)
    with observe_admissions() as seen:
        await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=8)
        await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=8, zp_priority=5)
    assert [i.priority for i in seen] == [2, 5]
    assert not any(k.startswith("x-zp-") for h in proxy.headers for k in h)  # zp's headers stay here
    await close_clients()


async def test_targets_reach_the_budgets_acquire_meta(proxy: FailProxy, sim: SimServer) -> None:
    spy = MetaSpy(policy="elastic")
    llm = adapter(proxy, spy, zp_ttft_target=1.5, zp_tpot_target=0.05)
    await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=8)
    assert targets(spy.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    llm.completion(model=sim.model, messages=MSGS, max_tokens=8, zp_ttft_target=0.25)  # a call's own wins
    assert targets(spy.metas[-1]) == {"ttft_target_s": 0.25, "tpot_target_s": 0.05}
    with pytest.raises(ConfigurationError, match="tpot_target"):
        await llm.acompletion(model=sim.model, messages=MSGS, max_tokens=8, zp_tpot_target=-1)
    with pytest.raises(ConfigurationError, match="ttft_target"):
        adapter(proxy, spy, zp_ttft_target=0)
    assert len(spy.calls) == 2 and spy.status_sync().used == 0  # bad targets: refused before any lease
    await close_clients()


def test_bad_input_says_so(proxy: FailProxy, sim: SimServer) -> None:
    b = budget()
    with pytest.raises(ConfigurationError, match="api_base"):
        ZPLiteLLM(b)
    with pytest.raises(ConfigurationError, match="deadline"):
        adapter(proxy, b, zp_deadline=0)
    other = wrap(openai.OpenAI(base_url=proxy.base_url, api_key="x"), budget())
    with pytest.raises(ConfigurationError, match="another budget"):
        ZPLiteLLM(b, client=other)
    mine = wrap(openai.OpenAI(base_url=proxy.base_url, api_key="x"), b)
    assert ZPLiteLLM(b, client=mine).client is mine  # already admitted here: used as it is
    with pytest.raises(ConfigurationError, match="async_client must be"):
        ZPLiteLLM(b, async_client=mine)
    llm = adapter(proxy, b)
    with pytest.raises(ConfigurationError, match="client= is the adapter's"):
        llm.completion(model=sim.model, messages=MSGS, client=mine)
    with pytest.raises(ConfigurationError, match="custom_llm_provider"):
        llm.completion(model=sim.model, messages=MSGS, custom_llm_provider="hosted_vllm")
    with pytest.raises(ConfigurationError, match="deadline"):
        llm.completion(model=sim.model, messages=MSGS, zp_deadline=-1)
    assert granted(b) == 0
