"""observe_admissions(): one AdmissionInfo per lease grant, to the observers of the caller's context.

Real openai SDK (both majors: the module is ``openai_compat``) wrapped on a LocalBudget, against the
simulated vLLM server or the retry upstream on loopback. A wait is made by holding the whole budget and
releasing it after at least HOLD_S of the budget's own clock; the reported wait must cover that hold (it
cannot be shorter: the call asked before the hold's end) and exceed it by less than 20%.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from _budget_probes import wait_until, waiters
from _retry_upstream import RetryUpstream

import zp_client
from zp_client import AdmissionInfo, LocalBudget, Settings, observe_admissions, summarize_admissions, wrap
from zp_client.retry import testing

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]

pytestmark = [pytest.mark.anyio, pytest.mark.openai_compat]

SETTINGS = Settings(estimator="heuristic")
HOLD_S = 1.0  # the 20% bound then leaves 200 ms for the wake-ups on a loaded CI machine
LIMIT = 16  # one call's bound is ceil((~10 prompt + 64 max_tokens) / 16) = 5 blocks


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=50.0) as s:
        yield s


@pytest.fixture
async def aclient(sim: SimServer) -> AsyncIterator[Any]:
    async with openai.AsyncOpenAI(base_url=sim.base_url, api_key="x") as original:
        yield original


def ask(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
            "extra_body": {"sim_output_tokens": 4}, **kw}


async def hold_then_release(budget: LocalBudget, blocker: Any) -> float:
    """Wait until someone waits behind ``blocker``, keep it HOLD_S more of the budget's clock, release it;
    returns how long the waiter surely waited (from first seeing it to the release)."""
    await wait_until(lambda: waiters(budget), "a call waiting for the held budget")
    seen = budget.clock.monotonic()
    while budget.clock.monotonic() - seen < HOLD_S:
        await asyncio.sleep(0.01)
    held = budget.clock.monotonic() - seen
    await blocker.release()
    return held


def assert_wait(info: AdmissionInfo, held: float) -> None:
    assert held <= info.queue_wait_s <= 1.2 * held, (info.queue_wait_s, held)


# ------------------------------------------------------------------------------------ one record per grant


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.needs_sim
async def test_a_call_that_waited_reports_its_wait_bound_and_class(sim: SimServer, aclient: Any) -> None:
    budget = LocalBudget(limit_blocks=LIMIT, policy="strict", name="obs-a")
    zp = wrap(aclient, budget, settings=SETTINGS)
    used_at_grant: list[int] = []
    blocker = await budget.acquire(LIMIT)
    with observe_admissions(lambda info: used_at_grant.append(budget.status_sync().used)) as seen:
        call = asyncio.create_task(zp.chat.completions.create(**ask(sim.model),
                                                              extra_headers={"X-ZP-Priority": "2"}))
        held = await hold_then_release(budget, blocker)
        reply = await call
    assert reply.choices[0].message.content
    [info] = seen
    assert_wait(info, held)
    # the callback ran at the grant, while the call's lease was the only one: it holds leased_blocks
    assert used_at_grant == [info.leased_blocks] and 0 < info.held_blocks <= info.leased_blocks < LIMIT
    assert (info.priority, info.attempt, info.budget, info.policy, info.route) == (2, 1, "obs-a", "strict",
                                                                                  sim.model)
    summary = summarize_admissions(seen)
    assert summary["queue_wait_s"] == info.queue_wait_s and summary["leases"] == 1
    assert summary["admissions"] == [info.as_dict()] and summary["leased_blocks"] == info.leased_blocks


@pytest.mark.needs_sim
async def test_a_call_with_room_waits_about_nothing(sim: SimServer, aclient: Any) -> None:
    budget = LocalBudget(limit_blocks=400, policy="elastic")
    zp = wrap(aclient, budget, settings=SETTINGS)
    with observe_admissions() as seen:
        await zp.chat.completions.create(**ask(sim.model))
        await zp.chat.completions.create(**ask(sim.model, stream=True, extra_body={"sim_output_tokens": 8}))
    assert [i.policy for i in seen] == ["elastic", "elastic"]
    assert all(0 <= i.queue_wait_s < HOLD_S for i in seen)
    assert seen[0].lease_id != seen[1].lease_id


def test_a_retried_call_gives_one_record_per_attempt() -> None:
    budget = LocalBudget(limit_blocks=1_000)
    with RetryUpstream() as upstream, openai.OpenAI(base_url=upstream.base_url, api_key="x") as original:
        zp = wrap(original, budget, max_model_len=4096)
        with testing(), observe_admissions() as seen:
            zp.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       user="503-obs")
    assert upstream.users() == ["503-obs#1", "503-obs#2"]
    assert [i.attempt for i in seen] == [1, 2] and seen[0].lease_id != seen[1].lease_id
    assert summarize_admissions(seen)["leases"] == 2


# ---------------------------------------------------------------------------------------------- scopes


@pytest.mark.needs_sim
async def test_scopes_nest_and_end(sim: SimServer, aclient: Any) -> None:
    zp = wrap(aclient, LocalBudget(limit_blocks=400), settings=SETTINGS)
    with observe_admissions() as outer:
        await zp.chat.completions.create(**ask(sim.model, user="one"))
        with observe_admissions() as inner:
            await zp.chat.completions.create(**ask(sim.model, user="two"))
        await zp.chat.completions.create(**ask(sim.model, user="three"))
    await zp.chat.completions.create(**ask(sim.model, user="after"))
    assert len(inner) == 1 and len(outer) == 3
    assert outer[1] is inner[0]


@pytest.mark.needs_sim
async def test_concurrent_tasks_see_only_their_own_calls(sim: SimServer, aclient: Any) -> None:
    zp = wrap(aclient, LocalBudget(limit_blocks=400), settings=SETTINGS)

    async def one(n: int) -> list[AdmissionInfo]:
        with observe_admissions() as seen:
            for _ in range(n):
                await zp.chat.completions.create(**ask(sim.model))
        return seen

    unobserved = asyncio.create_task(zp.chat.completions.create(**ask(sim.model)))
    a, b = await asyncio.gather(one(1), one(2))
    await unobserved
    assert len(a) == 1 and len(b) == 2
    assert not {i.lease_id for i in a} & {i.lease_id for i in b}

    # a task started inside a scope (with a copy of its context) reports to it
    with observe_admissions() as parent:
        await asyncio.create_task(zp.chat.completions.create(**ask(sim.model)))
    assert len(parent) == 1


@pytest.mark.needs_sim
def test_sync_calls_report_in_their_own_thread(sim: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400)
    with openai.OpenAI(base_url=sim.base_url, api_key="x") as original:
        zp = wrap(original, budget, settings=SETTINGS)
        per_thread: dict[int, list[AdmissionInfo]] = {}

        def work(i: int) -> None:
            with observe_admissions() as seen:
                for _ in range(i + 1):
                    zp.chat.completions.create(**ask(sim.model))
            per_thread[i] = seen

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert {i: len(s) for i, s in per_thread.items()} == {0: 1, 1: 2, 2: 3}


@pytest.mark.needs_sim
async def test_without_an_observer_no_record_is_made(sim: SimServer, aclient: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    zp = wrap(aclient, LocalBudget(limit_blocks=400), settings=SETTINGS)

    def refuse(**_: Any) -> AdmissionInfo:
        raise AssertionError("a record was made with nobody observing")

    with observe_admissions() as before:
        pass
    monkeypatch.setattr("zp_client._admission.attempts.AdmissionInfo", refuse)
    assert (await zp.chat.completions.create(**ask(sim.model))).choices  # would raise if a record were made
    monkeypatch.undo()
    assert before == []
    with observe_admissions() as seen:  # and the same call does make one inside a scope
        await zp.chat.completions.create(**ask(sim.model))
    assert len(seen) == 1


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.needs_sim
async def test_a_raising_callback_never_breaks_the_call(sim: SimServer, aclient: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    zp = wrap(aclient, LocalBudget(limit_blocks=400), settings=SETTINGS)
    log, records = logging.getLogger("zp_client.transport"), Records()
    # on the logger itself: another test's logging.config (uvicorn's) may have disabled existing loggers
    monkeypatch.setattr(log, "disabled", False)
    level = log.level
    log.setLevel(logging.ERROR)
    log.addHandler(records)

    def boom(info: AdmissionInfo) -> None:
        raise RuntimeError("observer bug")

    try:
        with observe_admissions(boom) as seen:
            reply = await zp.chat.completions.create(**ask(sim.model))
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    assert reply.choices and len(seen) == 1
    assert any("observe_admissions() callback raised" in m for m in records.messages)


def test_summarize_needs_a_record_and_exports_are_public() -> None:
    with pytest.raises(ValueError):
        summarize_admissions([])
    assert zp_client.observe_admissions is observe_admissions
