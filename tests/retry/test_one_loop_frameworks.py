"""One retry loop for every client zp admits besides wrap() (tests/retry/test_one_loop.py): langchain-zp with
the SDK's ``max_retries=2`` and LangChain's ``.with_retry()`` (LangChain sends each prompt from a task of
its own: the adapter's call scope carries the failure back), identical calls in flight together staying
independent, autogen-zp with ``max_retries=2`` and a
caller's retry loop, and zp_client's own ``AsyncClient``. Each always-failing call reaches the server
zp's 3 times, no more; every lease is released.

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from _fail_proxy import FailProxy

from zp_client import AsyncClient, LocalBudget, Settings, call_scope
from zp_client.client import InternalServerError
from zp_client.retry import RetryPolicy, testing

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

SETTINGS = Settings(estimator="heuristic", max_model_len=4096, pool_check=False)
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with FailProxy() as p:
        yield p


@pytest.fixture(autouse=True)
def no_sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from openai import _base_client

    monkeypatch.setattr(_base_client.BaseClient, "_calculate_retry_timeout", lambda *a, **k: 0.0)
    with testing():
        yield


def budget() -> LocalBudget:
    return LocalBudget(limit_blocks=400, policy="strict")


def granted(b: LocalBudget) -> int:
    return int(b.status_sync().extra["granted"])


async def test_langchain_zp_with_sdk_retries_and_with_retry(proxy: FailProxy) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations" / "langchain"))
    langchain_zp = pytest.importorskip("langchain_zp")
    b = budget()
    llm = langchain_zp.ZPChatOpenAI(model="fail-lc", base_url=proxy.base_url, api_key="sk-test", budget=b,
                                    max_tokens=8, max_retries=2, zp_settings=SETTINGS,
                                    zp_retry=RetryPolicy(budget=None))
    retrying = llm.with_retry(stop_after_attempt=3, wait_exponential_jitter=False)
    with pytest.raises(openai.InternalServerError):
        await retrying.ainvoke("hello")
    assert proxy.count("fail-lc") == 3 and granted(b) == 3
    with pytest.raises(openai.InternalServerError):
        retrying.invoke("hello")  # the blocking path, in this thread: its own context, zp's 3 attempts
    assert proxy.count("fail-lc") == 6 and granted(b) == 6 and (await b.status()).used == 0
    # plain ainvoke: LangChain sends from a task of its own; the second is a repeat all the same
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            await llm.ainvoke("once more")
    assert proxy.count("fail-lc") == 9
    # two identical calls in flight together in one scope (abatch gathers them in tasks that share this
    # context's scope): each is its own; a call started after they failed is a repeat
    call_scope()
    out = await llm.abatch(["again", "again"], return_exceptions=True)
    assert all(isinstance(e, openai.InternalServerError) for e in out)
    assert proxy.count("fail-lc") == 15
    with pytest.raises(openai.InternalServerError):
        await llm.ainvoke("again")
    assert proxy.count("fail-lc") == 15 and granted(b) == 15 and (await b.status()).used == 0


async def test_autogen_zp_with_sdk_retries_and_a_retry_loop(proxy: FailProxy) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations" / "autogen"))
    autogen_zp = pytest.importorskip("autogen_zp")
    from autogen_core.models import UserMessage

    b = budget()
    client = autogen_zp.ZPOpenAIChatCompletionClient(
        model="fail-ag", base_url=proxy.base_url, api_key="sk-test", budget=b, max_retries=2,
        zp_settings=SETTINGS, zp_retry=RetryPolicy(budget=None),
        model_info={"vision": False, "function_calling": True, "json_output": True, "family": "unknown",
                    "structured_output": True})
    for _ in range(3):  # an agent's retry loop
        with pytest.raises(openai.InternalServerError):
            await client.create([UserMessage(content="hello", source="user")])
    assert proxy.count("fail-ag") == 3 and granted(b) == 3 and (await b.status()).used == 0
    await client.close()


async def test_zp_async_client_repeats(proxy: FailProxy) -> None:
    b = budget()
    client = AsyncClient(proxy.base_url, "sk-test", budget=b, settings=SETTINGS,
                         retry=RetryPolicy(budget=None))
    for _ in range(3):
        with pytest.raises(InternalServerError):
            await client.chat.completions.create(model="fail-zp", messages=MSGS, max_tokens=8)
    assert proxy.count("fail-zp") == 3 and granted(b) == 3 and (await b.status()).used == 0
