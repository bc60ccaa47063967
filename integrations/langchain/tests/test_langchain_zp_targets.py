"""langchain-zp's TTFT / TPOT targets (issue 30): ``zp_ttft_target`` / ``zp_tpot_target`` reach the budget in
the acquire call's meta, a call's own header wins, a retry keeps its arrival, and bad values are refused
before any lease. Real ChatOpenAI / OpenAI against loopback servers.

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

# the zp-client clone's test helpers (tests/_meta_spy.py, tests/_retry_upstream.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("langchain_openai")
pytest.importorskip("langchain_zp", reason="not installed: pip install -e integrations/langchain")

from _meta_spy import MetaSpy, targets
from _retry_upstream import RETRY_AFTER_MS, RetryUpstream
from langchain_openai import ChatOpenAI
from pydantic import ValidationError

from langchain_zp import ZPChatOpenAI, ZPOpenAI, admit_langchain
from zp_client import InvalidRequest, Settings
from zp_client.errors import ConfigurationError
from zp_sim.server import SimServer

pytestmark = [pytest.mark.openai_compat]

SETTINGS = Settings(estimator="heuristic")
SHORT = {"sim_output_tokens": 4}


@pytest.fixture
def server() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=10.0) as s:
        yield s


def chat(server: SimServer, budget: MetaSpy, **kw: Any) -> ZPChatOpenAI:
    return ZPChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=16,
                        budget=budget, zp_settings=SETTINGS, **kw)


@pytest.mark.slow
def test_zp_targets_reach_the_budget_and_a_calls_header_wins(server: SimServer) -> None:
    budget = MetaSpy(policy="elastic")
    llm = chat(server, budget, zp_ttft_target=1.5, zp_tpot_target=0.05)
    assert llm.invoke("hello", extra_body=SHORT).content
    meta = budget.metas[-1]
    assert targets(meta) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert meta is not None and meta["age_s"] >= 0 and "prompt_tokens" in meta
    call = llm.ainvoke("hello", extra_body=SHORT, extra_headers={"X-ZP-TTFT-Target": "0.25"})
    assert asyncio.run(call).content
    assert targets(budget.metas[-1]) == {"ttft_target_s": 0.25, "tpot_target_s": 0.05}
    assert list(llm.stream("hello", extra_body=SHORT))
    assert targets(budget.metas[-1]) == {"ttft_target_s": 1.5, "tpot_target_s": 0.05}
    assert budget.status_sync().used == 0


def test_no_zp_target_sends_no_target_keys(server: SimServer) -> None:
    budget = MetaSpy(policy="elastic")
    assert chat(server, budget).invoke("hello", extra_body=SHORT).content
    meta = budget.metas[-1]
    assert meta is not None and not {"ttft_target_s", "tpot_target_s", "age_s"} & set(meta)


def test_the_completions_llm_and_admit_langchain_take_targets(server: SimServer) -> None:
    budget = MetaSpy()
    llm = ZPOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=16,
                   budget=budget, zp_settings=SETTINGS, zp_ttft_target=2.0)
    assert llm.invoke("hello", extra_body=SHORT)
    assert targets(budget.metas[-1]) == {"ttft_target_s": 2.0}
    plain = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=16)
    admitted = admit_langchain(plain, budget, settings=SETTINGS, tpot_target=0.03)
    assert admitted.invoke("hello", extra_body=SHORT).content
    assert targets(budget.metas[-1]) == {"tpot_target_s": 0.03}
    assert budget.status_sync().used == 0


@pytest.mark.parametrize("field", ["zp_ttft_target", "zp_tpot_target", "zp_deadline"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_a_bad_zp_target_is_refused_when_the_model_is_built(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=field):
        ZPChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key="x", budget=MetaSpy(),
                     **{field: value})


def test_admit_langchain_refuses_a_bad_target_as_configuration_error() -> None:
    plain = ChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key="x")
    with pytest.raises(ConfigurationError, match="ttft_target"):
        admit_langchain(plain, MetaSpy(), ttft_target=math.inf)


@pytest.mark.parametrize("header,value", [("X-ZP-TTFT-Target", "nan"), ("X-ZP-TPOT-Target", "-1"),
                                          ("X-ZP-Deadline", "inf"), ("X-ZP-Priority", "soon")])
def test_a_calls_bad_zp_header_is_invalid_request_with_no_lease(server: SimServer, header: str,
                                                                  value: str) -> None:
    budget = MetaSpy()
    llm = chat(server, budget)
    with pytest.raises(InvalidRequest) as bad:
        llm.invoke("hello", extra_body=SHORT, extra_headers={header: value})
    assert bad.value.field == header and isinstance(bad.value, openai.OpenAIError)
    with pytest.raises(InvalidRequest):
        asyncio.run(llm.ainvoke("hello", extra_body=SHORT, extra_headers={header: value}))
    assert budget.calls == [] and budget.granted() == 0  # refused before any lease was asked for
    assert server.stats()["requests"] == 0  # nothing sent


@pytest.fixture
def flaky() -> Iterator[RetryUpstream]:
    with RetryUpstream() as s:
        yield s


@pytest.mark.slow
def test_a_retried_call_keeps_its_target_and_its_first_arrival(flaky: RetryUpstream) -> None:
    budget = MetaSpy(policy="elastic")
    llm = ZPChatOpenAI(model="m", base_url=flaky.base_url, api_key="sk-test", max_tokens=8, budget=budget,
                       zp_settings=Settings(max_model_len=4096), zp_ttft_target=3.0)
    # "429-*": the first attempt is a 429 with retry-after-ms 300, which zp honours before its retry
    assert llm.invoke("hi", user="429-age").content == "ok"
    assert flaky.users() == ["429-age#1", "429-age#2"]
    (first, t1), (second, t2) = budget.calls
    assert first is not None and second is not None and t1 is None and t2 is not None
    assert targets(first) == targets(second) == {"ttft_target_s": 3.0}
    assert second["age_s"] >= first["age_s"] + 0.9 * RETRY_AFTER_MS / 1000  # counted from the first arrival
