"""autogen-zp's TTFT / TPOT targets (issue 30): ``zp_ttft_target`` / ``zp_tpot_target`` reach the budget in
the acquire call's meta, a retry keeps its arrival, and bad values are refused
before any lease. Real OpenAIChatCompletionClient against loopback servers.

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

import math
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

# the zp-client clone's test helpers (tests/_meta_spy.py, tests/_retry_upstream.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("autogen_ext.models.openai")
pytest.importorskip("autogen_zp", reason="not installed: pip install -e integrations/autogen")

from _meta_spy import MetaSpy, targets
from _retry_upstream import RETRY_AFTER_MS, RetryUpstream
from autogen_core.models import UserMessage

from autogen_zp import ZPOpenAIChatCompletionClient
from zp_client import InvalidRequest, Settings
from zp_client.errors import ConfigurationError
from zp_sim.server import SimServer

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

SETTINGS = Settings(estimator="heuristic")
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": True, "family": "unknown",
              "structured_output": True}
HI = [UserMessage(content="hello", source="user")]
SHORT = {"extra_body": {"sim_output_tokens": 4}}

_open: list[Any] = []


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    async with SimServer(profile="tiny", speedup=10.0) as s:
        yield s
        while _open:  # close every model client on the test's own event loop
            await _open.pop().close()


def client(server: SimServer, budget: MetaSpy, **kw: Any) -> ZPOpenAIChatCompletionClient:
    c = ZPOpenAIChatCompletionClient(model=server.model, base_url=server.base_url, api_key="sk-test",
                                     model_info=MODEL_INFO, max_tokens=16, budget=budget,
                                     zp_settings=SETTINGS, **kw)
    _open.append(c)
    return c


async def test_zp_targets_reach_the_budget(server: SimServer) -> None:
    budget = MetaSpy(policy="elastic")
    c = client(server, budget, zp_ttft_target=1.5, zp_tpot_target=0.05)
    assert (await c.create(HI, extra_create_args=SHORT)).content
    meta = budget.metas[-1]
    assert targets(meta) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert meta is not None and meta["age_s"] >= 0 and "prompt_tokens" in meta
    assert [chunk async for chunk in c.create_stream(HI, extra_create_args=SHORT)]
    assert targets(budget.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert (await budget.status()).used == 0


async def test_a_target_in_the_configurations_default_headers_reaches_the_budget(server: SimServer) -> None:
    # AutoGen's create() refuses extra_headers in extra_create_args: a client's headers are its
    # configuration's default_headers, which zp reads like any call's headers (a zp_* option wins)
    budget = MetaSpy()
    c = client(server, budget, default_headers={"X-ZP-TTFT-Target": "0.5", "X-ZP-TPOT-Target": "0.02"},
               zp_tpot_target=0.04)
    assert (await c.create(HI, extra_create_args=SHORT)).content
    assert targets(budget.metas[-1]) == {"ttft_target_s": 0.5, "tpot_target_s": 0.04}


async def test_no_zp_target_sends_no_target_keys(server: SimServer) -> None:
    budget = MetaSpy(policy="elastic")
    assert (await client(server, budget).create(HI, extra_create_args=SHORT)).content
    meta = budget.metas[-1]
    assert meta is not None and not {"ttft_target_s", "tpot_target_s", "age_s"} & set(meta)


@pytest.mark.slow
async def test_from_component_takes_the_targets(server: SimServer) -> None:
    budget = MetaSpy()
    dumped = client(server, budget).dump_component()
    loaded = ZPOpenAIChatCompletionClient.from_component(dumped, budget=budget, zp_settings=SETTINGS,
                                                         zp_ttft_target=4.0)
    _open.append(loaded)
    assert (await loaded.create(HI, extra_create_args=SHORT)).content
    assert targets(budget.metas[-1]) == {"ttft_target_s": 4.0}


@pytest.mark.parametrize("field", ["zp_ttft_target", "zp_tpot_target", "zp_deadline"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_a_bad_zp_target_is_refused_when_the_client_is_built(field: str, value: float) -> None:
    with pytest.raises(ConfigurationError, match=field.removeprefix("zp_")):
        ZPOpenAIChatCompletionClient(model="m", base_url="http://127.0.0.1:9/v1", api_key="x",
                                     model_info=MODEL_INFO, budget=MetaSpy(), **{field: value})


@pytest.mark.parametrize("header,value", [("X-ZP-TTFT-Target", "nan"), ("X-ZP-TPOT-Target", "0"),
                                          ("X-ZP-Deadline", "-inf"), ("X-ZP-Priority", "1.5")])
async def test_a_bad_zp_header_is_invalid_request_with_no_lease(server: SimServer, header: str,
                                                                  value: str) -> None:
    budget = MetaSpy()
    c = client(server, budget, default_headers={header: value})
    with pytest.raises(InvalidRequest) as bad:
        await c.create(HI, extra_create_args=SHORT)
    assert bad.value.field == header and isinstance(bad.value, openai.OpenAIError)
    with pytest.raises(InvalidRequest):
        async for _ in c.create_stream(HI, extra_create_args=SHORT):
            pass
    assert budget.calls == [] and budget.granted() == 0  # refused before any lease was asked for
    assert server.stats()["requests"] == 0  # nothing sent


@pytest.fixture
async def flaky() -> AsyncIterator[RetryUpstream]:
    with RetryUpstream() as s:
        yield s
        while _open:
            await _open.pop().close()


@pytest.mark.slow
async def test_a_retried_create_keeps_its_target_and_its_first_arrival(flaky: RetryUpstream) -> None:
    budget = MetaSpy(policy="elastic")
    c = ZPOpenAIChatCompletionClient(model="m", base_url=flaky.base_url, api_key="sk-test", max_tokens=8,
                                     model_info=MODEL_INFO, budget=budget,
                                     zp_settings=Settings(max_model_len=4096), zp_ttft_target=3.0)
    _open.append(c)
    # "429-*": the first attempt is a 429 with retry-after-ms 300, which zp honours before its retry
    assert (await c.create(HI, extra_create_args={"user": "429-age"})).content == "ok"
    assert flaky.users() == ["429-age#1", "429-age#2"]
    (first, t1), (second, t2) = budget.calls
    assert first is not None and second is not None and t1 is None and t2 is not None
    assert targets(first) == targets(second) == {"ttft_target_s": 3.0}
    assert second["age_s"] >= first["age_s"] + 0.9 * RETRY_AFTER_MS / 1000  # counted from the first arrival
