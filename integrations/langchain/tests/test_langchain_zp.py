"""LangChain's real ChatOpenAI / OpenAI, admission-gated, against the simulated vLLM server on loopback.

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx); langchain-openai
picks the HTTP library of the installed openai SDK.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import openai
import pytest

# the zp-client clone's test helpers (tests/_budget_probes.py, tests/_retry_upstream.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("langchain_openai")
pytest.importorskip("langchain_zp", reason="not installed: pip install -e integrations/langchain")

from _budget_probes import granted, overlapped, wait_until, waiters
from _retry_upstream import RetryUpstream
from langchain_core.caches import InMemoryCache
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import ConfigurableField
from langchain_core.tools import tool
from langchain_core.tracers.run_collector import RunCollectorCallbackHandler
from langchain_openai import ChatOpenAI
from pydantic import ValidationError

from langchain_zp import ADMISSION_EVENT, ADMISSION_KEY, ZPChatOpenAI, ZPOpenAI, admit_langchain
from zp_client import LocalBudget, Settings, observe_admissions
from zp_client.errors import ConfigurationError, LeaseTooLarge, MissingIntegration, PromptTooLong, ZPError
from zp_client.metrics import ZPMetrics
from zp_client.retry import testing
from zp_sim.server import SimServer

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

SETTINGS = Settings(estimator="heuristic")
# tiny profile: 4 ms per engine step at speedup 1, so a 150-token answer runs ~0.6 s: long enough to be
# seen in flight, short enough for the suite.
LONG = {"sim_output_tokens": 150}
# One call's bound: ceil((~10 prompt + 160 max_tokens) / 16) = 11 blocks; 16 fits one call, not two.
ONE_CALL_LIMIT = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def server() -> Iterator[SimServer]:
    # One server (one port) per test: LangChain caches its default HTTP client per base URL, and an async
    # pool must not outlive the test's event loop.
    with SimServer(profile="tiny", speedup=1.0) as s:
        yield s


def chat(server: SimServer, budget: LocalBudget, **kw: Any) -> ZPChatOpenAI:
    kw.setdefault("max_tokens", 160)
    return ZPChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", budget=budget,
                        zp_settings=SETTINGS, **kw)


def records(server: SimServer) -> dict[str, dict[str, Any]]:
    import httpx

    body = httpx.get(server.url + "/sim/stats", params={"requests": "1"}).json()
    return {r["id"]: r for r in body["requests"]}


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


# ------------------------------------------------------------------------------------------- basics


def test_invoke_takes_one_lease_and_returns_it(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    reply = llm.invoke("hello", extra_body={"sim_output_tokens": 8})
    assert reply.content and reply.usage_metadata["output_tokens"] == 8
    assert granted(budget) == 1 and budget.status_sync().used == 0


def test_zp_metrics_records_each_calls_admission(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    metrics = ZPMetrics()
    llm = chat(server, budget, zp_metrics=metrics)
    llm.invoke("hello", extra_body={"sim_output_tokens": 8})
    reg = metrics.registry
    assert reg.get_sample_value("zp_queue_wait_seconds_count", {"priority": "0"}) == 1
    assert reg.get_sample_value("zp_lease_hold_seconds_count", {"priority": "0"}) == 1
    # admit_langchain takes the same option
    plain = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=16)
    admitted = admit_langchain(plain, budget, settings=SETTINGS, metrics=metrics)
    admitted.invoke("hi", extra_body={"sim_output_tokens": 4})
    assert reg.get_sample_value("zp_queue_wait_seconds_count", {"priority": "0"}) == 2
    with pytest.raises(ValidationError):
        chat(server, budget, zp_metrics="not metrics")


def test_stream_holds_its_lease_until_the_last_chunk(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    used_while_streaming = []
    text = ""
    for chunk in llm.stream("hello", extra_body={"sim_output_tokens": 20}):
        used_while_streaming.append(budget.status_sync().used)
        text += chunk.content
    # held from the first chunk on (LangChain's own last chunk may come after the stream closed)
    assert text and used_while_streaming[0] > 0
    assert budget.status_sync().used == 0 and granted(budget) == 1


async def test_ainvoke_and_astream_go_through_the_budget(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    reply = await llm.ainvoke("hello", extra_body={"sim_output_tokens": 8})
    assert reply.content
    seen = []
    async for _ in llm.astream("hello", extra_body={"sim_output_tokens": 20}):
        seen.append((await budget.status()).used)
    assert seen and seen[0] > 0
    assert (await budget.status()).used == 0 and granted(budget) == 2


def test_batch_takes_a_lease_per_prompt(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")  # the three calls take turns
    llm = chat(server, budget)
    replies = llm.batch(["one", "two", "three"], extra_body={"sim_output_tokens": 8})
    assert len(replies) == 3 and all(r.content for r in replies)
    assert granted(budget) == 3 and budget.status_sync().used == 0


def test_tool_calling_goes_through_the_budget(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget).bind_tools([get_weather], tool_choice="get_weather")
    reply = llm.invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert set(reply.tool_calls[0]["args"]) == {"city"}
    assert granted(budget) == 1 and budget.status_sync().used == 0


def test_completions_llm_goes_through_the_budget(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = ZPOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", budget=budget,
                   zp_settings=SETTINGS, max_tokens=16)
    text = llm.invoke("Once upon a time", extra_body={"sim_output_tokens": 8})
    assert text and granted(budget) == 1 and budget.status_sync().used == 0


def test_an_elastic_budget_admits_the_same_calls(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="elastic")
    llm = chat(server, budget)
    assert llm.invoke("hello", extra_body={"sim_output_tokens": 8}).content
    assert "".join(c.content for c in llm.stream("hello", extra_body={"sim_output_tokens": 8}))
    assert granted(budget) == 2 and budget.status_sync().used == 0


# -------------------------------------------------------------------------------------- admission


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_two_concurrent_calls_with_room_for_one_never_run_together(server: SimServer) -> None:
    before = set(records(server))
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    llm = chat(server, budget)
    first = asyncio.create_task(llm.ainvoke("one", extra_body=LONG))
    second = asyncio.create_task(llm.ainvoke("two", extra_body=LONG))
    await wait_until(lambda: waiters(budget) == {0: 1}, "one call waiting for the other's lease")
    await asyncio.gather(first, second)
    mine = [r for rid, r in records(server).items() if rid not in before]
    assert not overlapped(mine)
    assert (await budget.status()).used == 0 and granted(budget) == 2


@pytest.mark.slow
async def test_without_zp_the_same_two_calls_run_together(server: SimServer) -> None:
    # the control of the test above: the server does run both at once when nothing admits them
    before = set(records(server))
    llm = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=160)
    await asyncio.gather(llm.ainvoke("one", extra_body=LONG), llm.ainvoke("two", extra_body=LONG))
    mine = [r for rid, r in records(server).items() if rid not in before]
    assert overlapped(mine)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_sync_calls_from_two_threads_take_turns(server: SimServer) -> None:
    before = set(records(server))
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    llm = chat(server, budget)
    threads = [threading.Thread(target=llm.invoke, args=(p,), kwargs={"extra_body": LONG})
               for p in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mine = [r for rid, r in records(server).items() if rid not in before]
    assert not overlapped(mine) and granted(budget) == 2


async def test_zp_priority_is_the_waiting_calls_class(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    blocker = await budget.acquire(ONE_CALL_LIMIT)
    llm = chat(server, budget, zp_priority=3)
    call = asyncio.create_task(llm.ainvoke("hi", extra_body={"sim_output_tokens": 4}))
    await wait_until(lambda: waiters(budget) == {3: 1}, "the call waiting in priority class 3")
    await blocker.release()
    assert (await call).content
    assert (await budget.status()).used == 0


async def test_cancelling_an_in_flight_call_releases_its_lease(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    call = asyncio.create_task(llm.ainvoke("hello", extra_body={"sim_output_tokens": 2000}, max_tokens=2000))
    await wait_until(lambda: budget.status_sync().used > 0 and budget.status_sync().leases == 1, "the lease")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_until(lambda: budget.status_sync().used == 0, "the lease released after cancellation")
    assert budget.status_sync().leases == 0


async def test_cancelling_an_in_flight_stream_releases_its_lease(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    # langchain-openai bounds each chunk's wait with asyncio.wait_for, which on Python < 3.12 can swallow
    # a cancellation that races a chunk (the stream then runs to its end); 0 turns that bound off.
    llm = chat(server, budget, max_tokens=2000, stream_chunk_timeout=0)
    got_chunk = asyncio.Event()

    async def consume() -> None:
        async for _ in llm.astream("hello", extra_body={"sim_output_tokens": 2000}):
            got_chunk.set()

    task = asyncio.create_task(consume())
    await got_chunk.wait()
    assert (await budget.status()).used > 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: budget.status_sync().used == 0, "the lease released after cancellation")


async def test_cancelling_a_call_waiting_for_its_lease_leaves_the_line(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    blocker = await budget.acquire(ONE_CALL_LIMIT)
    before = set(records(server))
    call = asyncio.create_task(chat(server, budget).ainvoke("hello"))
    await wait_until(lambda: waiters(budget) == {0: 1}, "the call waiting")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert waiters(budget) == {}
    await blocker.release()
    assert (await budget.status()).used == 0 and set(records(server)) == before  # nothing was sent


# ----------------------------------------------------------------------------------------- refusals


async def test_prompt_too_long_is_a_typed_error_sync_and_async(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    long_prompt = "hello world " * (2 * server.max_model_len)
    with pytest.raises(PromptTooLong) as info:
        await llm.ainvoke(long_prompt)
    assert isinstance(info.value, ZPError)
    with pytest.raises(PromptTooLong):
        await asyncio.to_thread(llm.invoke, long_prompt)
    assert (await budget.status()).used == 0 and granted(budget) == 0


def test_a_call_larger_than_the_budget_is_refused_at_once(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=8, policy="strict")
    with pytest.raises(LeaseTooLarge):
        chat(server, budget, max_tokens=1000).invoke("hello")
    with pytest.raises(LeaseTooLarge):
        list(chat(server, budget, max_tokens=1000).stream("hello"))


# ------------------------------------------------------------------------------- configuration


def test_max_retries_defaults_to_zero_and_an_explicit_value_is_kept(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    assert llm.max_retries == 0
    assert llm.root_client.max_retries == 0 and llm.root_async_client.max_retries == 0
    explicit = chat(server, budget, max_retries=2)
    assert explicit.root_client.max_retries == 2 and explicit.root_async_client.max_retries == 2


def test_a_budget_is_required() -> None:
    with pytest.raises(ValidationError):
        ZPChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key="x")  # type: ignore[call-arg]  # no budget: the point of the test
    with pytest.raises(ValidationError):
        ZPChatOpenAI(model="m", base_url="http://127.0.0.1:9/v1", api_key="x", budget="not a budget")


def test_admit_langchain_admits_a_copy_and_leaves_the_original_alone(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    plain = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=16,
                       max_retries=3)
    admitted = admit_langchain(plain, budget, settings=SETTINGS)
    assert type(admitted) is ChatOpenAI and admitted.max_retries == 0 and plain.max_retries == 3
    plain.invoke("hi", extra_body={"sim_output_tokens": 4})
    assert granted(budget) == 0
    admitted.invoke("hi", extra_body={"sim_output_tokens": 4})
    assert granted(budget) == 1 and budget.status_sync().used == 0


def test_admitting_twice_never_takes_two_leases_per_call(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget)
    again = admit_langchain(llm, budget)
    again.invoke("hi", extra_body={"sim_output_tokens": 4})
    assert granted(budget) == 1
    with pytest.raises(ConfigurationError):
        admit_langchain(llm, LocalBudget(limit_blocks=400, policy="strict"))
    with pytest.raises(ConfigurationError):
        admit_langchain("not a model", budget)  # type: ignore[type-var]  # not a model: the point of the test


def test_a_model_rebuilt_by_configurable_fields_is_admitted_once(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget).configurable_fields(temperature=ConfigurableField(id="temperature"))
    configured = llm.with_config(configurable={"temperature": 0.5})
    reply = configured.invoke("hi", extra_body={"sim_output_tokens": 4})
    assert reply.content and granted(budget) == 1


def test_missing_langchain_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langchain_openai", None)  # what an uninstalled package looks like
    monkeypatch.delitem(sys.modules, "langchain_zp")
    with pytest.raises(MissingIntegration) as info:
        importlib.import_module("langchain_zp")
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ImportError)
    assert "pip install 'zp-client[langchain]'" in str(info.value)
    assert "pip install -e integrations/langchain" in str(info.value)


# -------------------------------------------------------------------------------------------- retries


@pytest.fixture
def flaky() -> Iterator[RetryUpstream]:
    with RetryUpstream() as s:
        yield s


def flaky_chat(flaky: RetryUpstream, **kw: Any) -> ZPChatOpenAI:
    return ZPChatOpenAI(model="m", base_url=flaky.base_url, api_key="sk-test", max_tokens=8,
                        budget=LocalBudget(limit_blocks=1_000), zp_settings=Settings(max_model_len=4096),
                        **kw)


@pytest.mark.slow
def test_zp_retries_a_503_by_default_sync_and_async(flaky: RetryUpstream) -> None:
    llm = flaky_chat(flaky)
    with testing():
        assert llm.invoke("hi", user="503-sync").content == "ok"
        assert asyncio.run(llm.ainvoke("hi", user="503-async")).content == "ok"
    assert flaky.users() == ["503-sync#1", "503-sync#2", "503-async#1", "503-async#2"]
    assert llm.root_client.max_retries == 0  # the retry was zp's, not the SDK's


@pytest.mark.slow
def test_zp_retry_false_sends_one_attempt(flaky: RetryUpstream) -> None:
    llm = flaky_chat(flaky, zp_retry=False)
    with pytest.raises(openai.APIStatusError) as info:
        llm.invoke("hi", user="503-off")
    assert info.value.status_code == 503 and flaky.users() == ["503-off#1"]


# ---------------------------------------------------------------------------------------- visibility
#
# A call is made to wait: the test holds the whole budget and releases it after at least HOLD_S of the
# budget's own clock. The reported wait cannot be shorter than that hold (the call asked before it ended)
# and must exceed it by less than 20%. It is looked for where LangChain users look: a callback handler's
# on_custom_event, and the run's output as a tracer records it (RunCollectorCallbackHandler is a BaseTracer,
# as LangSmith's LangChainTracer is: run.outputs is on_llm_end's LLMResult).

HOLD_S = 1.0  # the 20% bound then leaves 200 ms for the wake-ups on a loaded CI machine


class Seen(BaseCallbackHandler):
    """What the run's callbacks received, in order (``order`` also gets the caller's chunks)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], UUID]] = []
        self.starts: list[UUID] = []
        self.order: list[str] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, *, run_id: UUID, **kw: Any) -> None:
        self.starts.append(run_id)

    def on_llm_start(self, serialized: Any, prompts: Any, *, run_id: UUID, **kw: Any) -> None:
        self.starts.append(run_id)

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kw: Any) -> None:
        self.events.append((name, data, run_id))
        self.order.append("event")


async def hold_then_release(budget: LocalBudget, blocker: Any) -> float:
    """Keep ``blocker`` HOLD_S of the budget's clock after a call queued behind it; returns the hold."""
    await wait_until(lambda: waiters(budget), "a call waiting for the held budget")
    seen = budget.clock.monotonic()
    while budget.clock.monotonic() - seen < HOLD_S:
        await asyncio.sleep(0.01)
    held = budget.clock.monotonic() - seen
    await blocker.release()
    return held


def check_reports(seen: Seen, collector: RunCollectorCallbackHandler, held: float, *,
                  chat_model: bool) -> dict[str, Any]:
    """One zp_admission event for the model's run, and the same wait in the run's recorded output."""
    [run_id] = seen.starts
    [(name, data, event_run)] = seen.events
    assert name == ADMISSION_EVENT == "zp_admission" and event_run == run_id
    assert held <= data["queue_wait_s"] <= 1.2 * held, (data["queue_wait_s"], held)
    assert 0 < data["held_blocks"] <= data["leased_blocks"] <= ONE_CALL_LIMIT and data["attempt"] == 1
    [run] = [r for r in collector.traced_runs if r.id == run_id]
    recorded = run.outputs["generations"][0][0]
    summary = recorded["generation_info"][ADMISSION_KEY]
    assert summary["queue_wait_s"] == data["queue_wait_s"] and summary["admissions"] == [data]
    assert summary["leases"] == 1 and summary["leased_blocks"] == data["leased_blocks"]
    if chat_model:
        assert recorded["message"]["kwargs"]["response_metadata"][ADMISSION_KEY] == summary
    return summary


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.parametrize("mode", ["invoke", "ainvoke", "stream", "astream", "invoke-streaming"])
async def test_a_calls_queue_wait_reaches_callbacks_and_the_recorded_run(server: SimServer,
                                                                        mode: str) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    llm = chat(server, budget, streaming=mode == "invoke-streaming")
    seen, collector = Seen(), RunCollectorCallbackHandler()
    config: Any = {"callbacks": [seen, collector]}
    short = {"sim_output_tokens": 6}
    chunks: list[Any] = []

    def sync_stream() -> None:
        for c in llm.stream("hello", config, extra_body=short):
            seen.order.append("chunk")
            chunks.append(c)

    async def async_stream() -> None:
        async for c in llm.astream("hello", config, extra_body=short):
            seen.order.append("chunk")
            chunks.append(c)

    calls = {
        "invoke": lambda: asyncio.to_thread(llm.invoke, "hello", config, extra_body=short),
        "invoke-streaming": lambda: asyncio.to_thread(llm.invoke, "hello", config, extra_body=short),
        "ainvoke": lambda: llm.ainvoke("hello", config, extra_body=short),
        "stream": lambda: asyncio.to_thread(sync_stream),
        "astream": async_stream,
    }
    blocker = await budget.acquire(ONE_CALL_LIMIT)
    call = asyncio.ensure_future(calls[mode]())
    held = await hold_then_release(budget, blocker)
    reply = await call
    summary = check_reports(seen, collector, held, chat_model=True)
    if mode in ("stream", "astream"):
        # reported as soon as the lease was granted: before the first chunk, which carries the summary
        assert seen.order[:2] == ["event", "chunk"] and chunks[0].response_metadata[ADMISSION_KEY] == summary
        assert sum(ADMISSION_KEY in c.response_metadata for c in chunks) == 1
    else:
        assert reply.response_metadata[ADMISSION_KEY] == summary  # on the AIMessage the caller gets
    assert (await budget.status()).used == 0


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.parametrize("mode", ["invoke", "astream"])
async def test_the_completions_llm_reports_its_queue_wait(server: SimServer, mode: str) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    # its own async pool, closed on this test's loop (openai's default one closes itself when collected,
    # on whatever loop runs then: a later test's)
    http = openai.DefaultAsyncHttpxClient()
    llm = ZPOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", budget=budget,
                   zp_settings=SETTINGS, max_tokens=16, http_async_client=http)
    seen, collector = Seen(), RunCollectorCallbackHandler()
    config: Any = {"callbacks": [seen, collector]}

    async def astream() -> str:
        chunks = [t async for t in llm.astream("Once upon", config, extra_body={"sim_output_tokens": 6})]
        return "".join(chunks)

    blocker = await budget.acquire(ONE_CALL_LIMIT)
    if mode == "invoke":
        call = asyncio.ensure_future(asyncio.to_thread(llm.invoke, "Once upon", config,
                                                       extra_body={"sim_output_tokens": 6}))
    else:
        call = asyncio.ensure_future(astream())
    held = await hold_then_release(budget, blocker)
    assert await call
    await http.aclose()
    check_reports(seen, collector, held, chat_model=False)
    if mode == "invoke":  # the LLM's llm_output carries it too
        [run] = collector.traced_runs
        assert run.outputs["llm_output"][ADMISSION_KEY]["queue_wait_s"] == seen.events[0][1]["queue_wait_s"]


def test_a_retried_call_reports_each_lease(flaky: RetryUpstream) -> None:
    llm = flaky_chat(flaky)
    seen = Seen()
    with testing():
        reply = llm.invoke("hi", {"callbacks": [seen]}, user="503-seen")
    assert flaky.users() == ["503-seen#1", "503-seen#2"]
    assert [data["attempt"] for _, data, _ in seen.events] == [1, 2]
    assert reply.response_metadata[ADMISSION_KEY]["leases"] == 2


def test_no_admission_no_report_and_admit_langchain_copies_are_observable(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    seen = Seen()
    # a call zp did not admit (a plain model) reports nothing, and LangChain runs fine around it
    plain = ChatOpenAI(model=server.model, base_url=server.base_url, api_key="sk-test", max_tokens=16)
    assert ADMISSION_KEY not in plain.invoke("hi", {"callbacks": [seen]},
                                             extra_body={"sim_output_tokens": 4}).response_metadata
    assert seen.events == []
    # admit_langchain returns the model's own class, which zp does not extend: observe_admissions() sees it
    admitted = admit_langchain(plain, budget, settings=SETTINGS)
    with observe_admissions() as records:
        admitted.invoke("hi", extra_body={"sim_output_tokens": 4})
    assert len(records) == 1 and records[0].leased_blocks > 0


def test_an_answer_from_langchains_cache_reports_no_admission(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    llm = chat(server, budget, cache=InMemoryCache())
    first = llm.invoke("cache me", extra_body={"sim_output_tokens": 4})
    assert first.response_metadata[ADMISSION_KEY]["leases"] == 1
    seen = Seen()
    again = llm.invoke("cache me", {"callbacks": [seen]}, extra_body={"sim_output_tokens": 4})
    assert again.content == first.content and granted(budget) == 1  # served by the cache, not admitted
    assert ADMISSION_KEY not in again.response_metadata and seen.events == []
