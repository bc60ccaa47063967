"""AutoGen's real OpenAIChatCompletionClient, admission-gated, against the simulated vLLM server on loopback.

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

# the zp-client clone's test helpers (tests/_budget_probes.py, tests/_retry_upstream.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
pytest.importorskip("autogen_ext.models.openai")
pytest.importorskip("autogen_zp", reason="not installed: pip install -e integrations/autogen")

from _budget_probes import granted, overlapped, wait_until, waiters
from _retry_upstream import RetryUpstream
from autogen_core import EVENT_LOGGER_NAME, CancellationToken
from autogen_core.models import CreateResult, UserMessage
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

from autogen_zp import ZPAdmissionEvent, ZPOpenAIChatCompletionClient
from zp_client import LocalBudget, Settings
from zp_client.errors import ConfigurationError, LeaseTooLarge, MissingIntegration, PromptTooLong, ZPError
from zp_client.retry import testing
from zp_sim.server import SimServer

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

SETTINGS = Settings(estimator="heuristic")
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": True, "family": "unknown",
              "structured_output": True}
HI = [UserMessage(content="hello", source="user")]
# tiny profile: 4 ms per engine step at speedup 1, so a 150-token answer runs ~0.6 s.
LONG = {"extra_body": {"sim_output_tokens": 150}}
SHORT = {"extra_body": {"sim_output_tokens": 8}}
ONE_CALL_LIMIT = 16  # one call's bound is ceil((~10 prompt + 160 max_tokens) / 16) = 11 blocks


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


_open: list[Any] = []


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    async with SimServer(profile="tiny", speedup=1.0) as s:
        yield s
        while _open:  # close every model client on the test's own event loop
            await _open.pop().close()


def client(server: SimServer, budget: LocalBudget, **kw: Any) -> ZPOpenAIChatCompletionClient:
    kw.setdefault("max_tokens", 160)
    c = ZPOpenAIChatCompletionClient(model=server.model, base_url=server.base_url, api_key="sk-test",
                                     model_info=MODEL_INFO, budget=budget, zp_settings=SETTINGS, **kw)
    _open.append(c)
    return c


def records(server: SimServer) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in server.stats(requests=True)["requests"]}  # same loop: no race


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


# ------------------------------------------------------------------------------------------- basics


async def test_create_takes_one_lease_and_returns_it(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    result = await client(server, budget).create(HI, extra_create_args=SHORT)
    assert isinstance(result.content, str) and result.content and result.usage.completion_tokens == 8
    assert granted(budget) == 1 and (await budget.status()).used == 0


async def test_zp_metrics_records_each_calls_admission(server: SimServer) -> None:
    from zp_client.metrics import ZPMetrics

    budget = LocalBudget(limit_blocks=400, policy="strict")
    metrics = ZPMetrics()
    await client(server, budget, zp_metrics=metrics).create(HI, extra_create_args=SHORT)
    assert metrics.registry.get_sample_value("zp_queue_wait_seconds_count", {"priority": "0"}) == 1
    assert metrics.registry.get_sample_value("zp_lease_hold_seconds_count", {"priority": "0"}) == 1


async def test_create_stream_holds_its_lease_until_the_end(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    used_while_streaming = []
    final = None
    twenty = {"extra_body": {"sim_output_tokens": 20}}
    async for item in client(server, budget).create_stream(HI, extra_create_args=twenty):
        if isinstance(item, CreateResult):
            final = item
        else:
            used_while_streaming.append((await budget.status()).used)
    assert final is not None and final.content and used_while_streaming and min(used_while_streaming) > 0
    assert (await budget.status()).used == 0 and granted(budget) == 1


async def test_tool_calling_goes_through_the_budget(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    tool = FunctionTool(get_weather, description="The weather in a city.")
    result = await client(server, budget).create(
        [UserMessage(content="What is the weather in Paris?", source="user")], tools=[tool],
        tool_choice="required")
    assert result.finish_reason == "function_calls"
    assert isinstance(result.content, list) and result.content[0].name == "get_weather"
    assert granted(budget) == 1 and (await budget.status()).used == 0


# -------------------------------------------------------------------------------------- admission


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_two_concurrent_calls_with_room_for_one_never_run_together(server: SimServer) -> None:
    before = set(records(server))
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    c = client(server, budget)
    first = asyncio.create_task(c.create(HI, extra_create_args=LONG))
    second = asyncio.create_task(c.create(HI, extra_create_args=LONG))
    await wait_until(lambda: waiters(budget) == {0: 1}, "one call waiting for the other's lease")
    await asyncio.gather(first, second)
    mine = [r for rid, r in records(server).items() if rid not in before]
    assert not overlapped(mine)
    assert (await budget.status()).used == 0 and granted(budget) == 2


@pytest.mark.slow
async def test_without_zp_the_same_two_calls_run_together(server: SimServer) -> None:
    before = set(records(server))
    c = OpenAIChatCompletionClient(model=server.model, base_url=server.base_url, api_key="sk-test",
                                   model_info=MODEL_INFO, max_tokens=160)
    _open.append(c)
    await asyncio.gather(c.create(HI, extra_create_args=LONG), c.create(HI, extra_create_args=LONG))
    mine = [r for rid, r in records(server).items() if rid not in before]
    assert overlapped(mine)


async def test_zp_priority_is_the_waiting_calls_class(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict")
    blocker = await budget.acquire(ONE_CALL_LIMIT)
    call = asyncio.create_task(client(server, budget, zp_priority=2).create(HI, extra_create_args=SHORT))
    await wait_until(lambda: waiters(budget) == {2: 1}, "the call waiting in priority class 2")
    await blocker.release()
    assert (await call).content
    assert (await budget.status()).used == 0


async def test_cancellation_token_releases_the_lease_of_an_in_flight_stream(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    token = CancellationToken()
    got_chunk = asyncio.Event()

    async def consume() -> None:
        async for _ in client(server, budget, max_tokens=2000).create_stream(
                HI, cancellation_token=token, extra_create_args={"extra_body": {"sim_output_tokens": 2000}}):
            got_chunk.set()

    task = asyncio.create_task(consume())
    await got_chunk.wait()
    assert (await budget.status()).used > 0
    token.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: budget.status_sync().used == 0, "the lease released after cancellation")
    assert budget.status_sync().leases == 0


async def test_cancelling_an_in_flight_create_releases_its_lease(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    task = asyncio.create_task(client(server, budget, max_tokens=2000).create(
        HI, extra_create_args={"extra_body": {"sim_output_tokens": 2000}}))
    await wait_until(lambda: budget.status_sync().leases == 1, "the lease")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: budget.status_sync().used == 0, "the lease released after cancellation")


# ----------------------------------------------------------------------------------------- refusals


async def test_prompt_too_long_is_a_typed_error(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    long_prompt = [UserMessage(content="hello world " * (2 * server.max_model_len), source="user")]
    with pytest.raises(PromptTooLong) as info:
        await client(server, budget).create(long_prompt)
    assert isinstance(info.value, ZPError)
    with pytest.raises(PromptTooLong):
        async for _ in client(server, budget).create_stream(long_prompt):
            pass
    assert (await budget.status()).used == 0 and granted(budget) == 0


async def test_a_call_larger_than_the_budget_is_refused_at_once(server: SimServer) -> None:
    with pytest.raises(LeaseTooLarge):
        await client(server, LocalBudget(limit_blocks=8, policy="strict"), max_tokens=1000).create(HI)


# ------------------------------------------------------------------------------- configuration


async def test_max_retries_defaults_to_zero_and_an_explicit_value_is_kept(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    assert client(server, budget)._client.max_retries == 0
    assert client(server, budget, max_retries=2)._client.max_retries == 2


@pytest.mark.slow
async def test_component_round_trip(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    dumped = client(server, budget, zp_priority=1).dump_component()
    assert dumped.provider == "autogen_ext.models.openai.OpenAIChatCompletionClient"
    assert "budget" not in dumped.config and dumped.config["model"] == server.model

    plain = OpenAIChatCompletionClient.load_component(dumped)  # loads, but unadmitted: no live budget
    _open.append(plain)
    await plain.create(HI, extra_create_args=SHORT)
    assert granted(budget) == 0

    again = ZPOpenAIChatCompletionClient.from_component(dumped.model_dump(), budget=budget)
    _open.append(again)
    assert (await again.create(HI, extra_create_args=SHORT)).content
    assert granted(budget) == 1 and (await budget.status()).used == 0


async def test_a_budget_is_required(server: SimServer) -> None:
    with pytest.raises(TypeError):
        ZPOpenAIChatCompletionClient(model="m", base_url=server.base_url, model_info=MODEL_INFO)  # type: ignore[call-arg]  # no budget: the point
    with pytest.raises(ConfigurationError):
        ZPOpenAIChatCompletionClient(model="m", base_url=server.base_url, api_key="x", model_info=MODEL_INFO,
                                     budget="not a budget")  # type: ignore[arg-type]  # the point of the test


def test_missing_autogen_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "autogen_ext.models.openai", None)
    monkeypatch.delitem(sys.modules, "autogen_zp")
    with pytest.raises(MissingIntegration) as info:
        importlib.import_module("autogen_zp")
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ImportError)
    assert "pip install 'zp-client[autogen]'" in str(info.value)
    assert "pip install -e integrations/autogen" in str(info.value)


# -------------------------------------------------------------------------------------------- retries


@pytest.fixture
async def flaky() -> AsyncIterator[RetryUpstream]:
    with RetryUpstream() as s:
        yield s
        while _open:  # close every model client on the test's own event loop
            await _open.pop().close()


def flaky_client(flaky: RetryUpstream, **kw: Any) -> ZPOpenAIChatCompletionClient:
    c = ZPOpenAIChatCompletionClient(model="m", base_url=flaky.base_url, api_key="sk-test", max_tokens=8,
                                     model_info=MODEL_INFO, budget=LocalBudget(limit_blocks=1_000),
                                     zp_settings=Settings(max_model_len=4096), **kw)
    _open.append(c)
    return c


@pytest.mark.slow
async def test_zp_retries_a_503_by_default(flaky: RetryUpstream) -> None:
    with testing():
        result = await flaky_client(flaky).create(HI, extra_create_args={"user": "503-a"})
    assert result.content == "ok" and flaky.users() == ["503-a#1", "503-a#2"]


async def test_zp_retry_false_sends_one_attempt(flaky: RetryUpstream) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        await flaky_client(flaky, zp_retry=False).create(HI, extra_create_args={"user": "503-off"})
    assert info.value.status_code == 503 and flaky.users() == ["503-off#1"]


# ---------------------------------------------------------------------------------------- visibility
#
# A call is made to wait: the test holds the whole budget and releases it after at least HOLD_S of the
# budget's own clock. The reported wait cannot be shorter than that hold and must exceed it by less than
# 20%. It is looked for where AutoGen users look: the records of autogen_core's event logger.

HOLD_S = 1.0  # the 20% bound then leaves 200 ms for the wake-ups on a loaded CI machine


class Events(logging.Handler):
    """A handler on EVENT_LOGGER_NAME: every event record, as AutoGen's own tools would see it."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def of(self, cls: type) -> list[Any]:
        return [r.msg for r in self.records if isinstance(r.msg, cls)]

    def kinds(self) -> list[str]:
        return [type(r.msg).__name__ for r in self.records]


@pytest.fixture
def events() -> Iterator[Events]:
    handler = Events()
    log = logging.getLogger(EVENT_LOGGER_NAME)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


async def hold_then_release(budget: LocalBudget, blocker: Any) -> float:
    await wait_until(lambda: waiters(budget), "a call waiting for the held budget")
    seen = budget.clock.monotonic()
    while budget.clock.monotonic() - seen < HOLD_S:
        await asyncio.sleep(0.01)
    held = budget.clock.monotonic() - seen
    await blocker.release()
    return held


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.parametrize("mode", ["create", "create_stream"])
async def test_each_calls_queue_wait_is_an_event_on_autogens_event_logger(server: SimServer, events: Events,
                                                                           mode: str) -> None:
    budget = LocalBudget(limit_blocks=ONE_CALL_LIMIT, policy="strict", name="ag-visible")
    c = client(server, budget, zp_priority=1)

    async def stream() -> Any:
        return [item async for item in c.create_stream(HI, extra_create_args=SHORT)][-1]

    blocker = await budget.acquire(ONE_CALL_LIMIT)
    call = asyncio.ensure_future(c.create(HI, extra_create_args=SHORT) if mode == "create" else stream())
    held = await hold_then_release(budget, blocker)
    assert isinstance(await call, CreateResult)
    [event] = events.of(ZPAdmissionEvent)
    assert held <= event.queue_wait_s <= 1.2 * held, (event.queue_wait_s, held)
    assert 0 < event.admission.held_blocks <= event.leased_blocks <= ONE_CALL_LIMIT
    as_json = json.loads(str(event))  # the JSON line AutoGen's event consumers read
    assert as_json["type"] == "ZPAdmission" and as_json["queue_wait_s"] == event.queue_wait_s
    assert (as_json["leased_blocks"], as_json["priority"], as_json["attempt"], as_json["budget"]) == (
        event.leased_blocks, 1, 1, "ag-visible")
    # logged at the grant, before AutoGen's own record of the call's end
    kinds = events.kinds()
    end = "LLMCallEvent" if mode == "create" else "LLMStreamEndEvent"
    assert kinds.index("ZPAdmissionEvent") < kinds.index(end)
    assert (await budget.status()).used == 0


async def test_a_retried_create_logs_each_lease(flaky: RetryUpstream, events: Events) -> None:
    with testing():
        await flaky_client(flaky).create(HI, extra_create_args={"user": "503-events"})
    assert flaky.users() == ["503-events#1", "503-events#2"]
    assert [e.admission.attempt for e in events.of(ZPAdmissionEvent)] == [1, 2]


async def test_a_plain_client_logs_no_admission(server: SimServer, events: Events) -> None:
    c = OpenAIChatCompletionClient(model=server.model, base_url=server.base_url, api_key="sk-test",
                                   model_info=MODEL_INFO, max_tokens=16)
    _open.append(c)
    await c.create(HI, extra_create_args=SHORT)
    assert events.of(ZPAdmissionEvent) == [] and "LLMCallEvent" in events.kinds()
