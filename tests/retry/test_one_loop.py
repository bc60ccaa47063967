"""One retry loop (zp_client._repeat), through wrap() and the real openai SDK on loopback HTTP.

* the SDK's own retries (``max_retries`` set back to 2 on the wrapped client, as LiteLLM does on every
  call) add no attempt: error answers say ``x-should-retry: false``, and an SDK retry of a call whose
  transport raised gets zp's error again without being sent;
* a repeat of a call zp gave up on, from the same context (a framework's retry), gets the failure again:
  no lease, no upstream attempt; a success in between clears it;
* identical calls from different tasks or threads stay independent; a task created after a failure
  inherits it; ``X-ZP-Call`` keys a call explicitly and is not sent upstream;
* a cancelled call is not remembered; the memory is bounded (cap, expiry).

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest
from _fail_proxy import DropServer, FailProxy

from zp_client import LocalBudget, Settings, _repeat, wrap
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
    """zp's backoff and the openai SDK's are skipped: the tests count attempts, not time."""
    from openai import _base_client

    monkeypatch.setattr(_base_client.BaseClient, "_calculate_retry_timeout", lambda *a, **k: 0.0)
    with testing():
        yield


def budget() -> LocalBudget:
    return LocalBudget(limit_blocks=400, policy="strict")


def granted(b: LocalBudget) -> int:
    return int(b.status_sync().extra["granted"])


def awrapped(base_url: str, b: LocalBudget, **kw: Any) -> openai.AsyncOpenAI:
    c = wrap(openai.AsyncOpenAI(base_url=base_url, api_key="sk-test"), b, settings=SETTINGS,
             retry=RetryPolicy(budget=None), **kw)
    c.max_retries = 2  # what LiteLLM's _set_dynamic_params_on_client does on every call
    return c


def wrapped(base_url: str, b: LocalBudget) -> openai.OpenAI:
    c = wrap(openai.OpenAI(base_url=base_url, api_key="sk-test"), b, settings=SETTINGS,
             retry=RetryPolicy(budget=None))
    c.max_retries = 2
    return c


async def call(c: openai.AsyncOpenAI, user: str, **kw: Any) -> Any:
    return await c.chat.completions.create(model="m", messages=MSGS, max_tokens=8, user=user, **kw)


async def test_sdk_retries_set_back_to_two_add_no_attempt(proxy: FailProxy) -> None:
    b = budget()
    c = awrapped(proxy.base_url, b)
    with pytest.raises(openai.InternalServerError) as err:
        await call(c, "fail-sdk-async")
    assert err.value.response.headers["x-should-retry"] == "false"
    assert proxy.count("fail-sdk-async") == 3 and granted(b) == 3  # zp's three attempts, one lease each
    assert (await b.status()).used == 0


def test_sdk_retries_set_back_to_two_add_no_attempt_sync(proxy: FailProxy) -> None:
    b = budget()
    c = wrapped(proxy.base_url, b)
    with pytest.raises(openai.InternalServerError):
        c.chat.completions.create(model="m", messages=MSGS, max_tokens=8, user="fail-sdk-sync")  # type: ignore[call-overload]
    assert proxy.count("fail-sdk-sync") == 3 and granted(b) == 3
    with pytest.raises(openai.InternalServerError) as again:  # a repeat in the same thread: not sent
        c.chat.completions.create(model="m", messages=MSGS, max_tokens=8, user="fail-sdk-sync")  # type: ignore[call-overload]
    assert "x-zp-repeat" in again.value.response.headers
    assert proxy.count("fail-sdk-sync") == 3 and granted(b) == 3 and b.status_sync().used == 0


async def test_a_repeat_in_the_same_task_gets_the_failure_again(proxy: FailProxy) -> None:
    b = budget()
    c = awrapped(proxy.base_url, b)
    with pytest.raises(openai.InternalServerError):
        await call(c, "fail-repeat")
    for _ in range(3):  # LiteLLM num_retries, tenacity, CrewAI's loop: fresh SDK calls, same context
        with pytest.raises(openai.InternalServerError) as again:
            await call(c, "fail-repeat")
        assert again.value.status_code == 503 and "x-zp-repeat" in again.value.response.headers
        assert again.value.response.headers["x-should-retry"] == "false"
    assert proxy.count("fail-repeat") == 3 and granted(b) == 3
    # another call is not a repeat; a success clears the context's failure
    reply = await call(c, "ok-between")
    assert reply.choices[0].message.content == "ok"
    with pytest.raises(openai.InternalServerError):
        await call(c, "fail-repeat")
    assert proxy.count("fail-repeat") == 6 and (await b.status()).used == 0


async def test_window_zero_turns_it_off(proxy: FailProxy) -> None:
    b = budget()
    c = wrap(openai.AsyncOpenAI(base_url=proxy.base_url, api_key="sk-test"), b, settings=SETTINGS,
             retry=RetryPolicy(budget=None), repeat_window_s=0)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as err:
            await call(c, "fail-off")
        assert "x-should-retry" not in err.value.response.headers
    assert proxy.count("fail-off") == 6  # the feature is what keeps the second call from going out


async def test_identical_calls_from_different_tasks_stay_independent(proxy: FailProxy) -> None:
    b = budget()
    c = awrapped(proxy.base_url, b)

    async def one() -> None:
        with pytest.raises(openai.InternalServerError):
            await call(c, "fail-tasks")

    await asyncio.gather(one(), one())  # concurrent siblings
    assert proxy.count("fail-tasks") == 6
    await asyncio.create_task(one())  # a later sibling: its creator's context saw no failure
    assert proxy.count("fail-tasks") == 9

    async def fail_then_spawn() -> None:
        await one()
        await asyncio.create_task(one())  # created after the failure: inherits it, a repeat

    await asyncio.create_task(fail_then_spawn())
    assert proxy.count("fail-tasks") == 12 and granted(b) == 12 and (await b.status()).used == 0


def test_identical_calls_from_different_threads_stay_independent(proxy: FailProxy) -> None:
    b = budget()
    c = wrapped(proxy.base_url, b)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def one() -> None:
        start.wait()
        for _ in range(2):  # the second is a repeat in the same thread
            try:
                c.chat.completions.create(model="m", messages=MSGS, max_tokens=8, user="fail-threads")  # type: ignore[call-overload]
            except openai.InternalServerError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 4 and proxy.count("fail-threads") == 6 and granted(b) == 6
    # a context copy run elsewhere (asyncio.to_thread, copy_context().run) keeps its failure to itself
    ctx = contextvars.copy_context()
    with pytest.raises(openai.InternalServerError):
        ctx.run(c.chat.completions.create, model="m", messages=MSGS, max_tokens=8, user="fail-threads")
    assert proxy.count("fail-threads") == 9
    with pytest.raises(openai.InternalServerError):
        ctx.run(c.chat.completions.create, model="m", messages=MSGS, max_tokens=8, user="fail-threads")
    assert proxy.count("fail-threads") == 9 and b.status_sync().used == 0


async def test_an_sdk_retry_of_a_raised_error_is_not_sent() -> None:
    with DropServer() as drop:
        b = budget()
        c = awrapped(drop.base_url, b)
        with pytest.raises(openai.APIConnectionError):
            await call(c, "drop")
        assert drop.requests == 3 and granted(b) == 3  # zp's attempts only: the SDK's 2 retries not sent
        with pytest.raises(openai.APIConnectionError):  # and a framework's repeat neither
            await call(c, "drop")
        assert drop.requests == 3 and granted(b) == 3 and (await b.status()).used == 0


def test_an_sdk_retry_of_a_raised_error_is_not_sent_sync() -> None:
    with DropServer() as drop:
        b = budget()
        c = wrapped(drop.base_url, b)
        with pytest.raises(openai.APIConnectionError):
            c.chat.completions.create(model="m", messages=MSGS, max_tokens=8, user="drop")  # type: ignore[call-overload]
        assert drop.requests == 3 and granted(b) == 3 and b.status_sync().used == 0


async def test_an_explicit_call_key_spans_fresh_contexts_and_is_not_sent(proxy: FailProxy) -> None:
    b = budget()
    c = awrapped(proxy.base_url, b)

    async def attempt(key: str) -> None:  # each attempt in its own task, as LangGraph's node runner does
        with pytest.raises(openai.InternalServerError):
            await call(c, "fail-keyed", extra_headers={"X-ZP-Call": key})

    await asyncio.create_task(attempt("job-1"))
    await asyncio.create_task(attempt("job-1"))
    assert proxy.count("fail-keyed") == 3
    await asyncio.create_task(attempt("job-2"))  # another logical call
    assert proxy.count("fail-keyed") == 6 and granted(b) == 6
    assert not any("x-zp-call" in h for h in proxy.headers)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
async def test_a_cancelled_call_is_not_remembered(proxy: FailProxy) -> None:
    b = budget()
    c = awrapped(proxy.base_url, b)
    before = _repeat.remembered()
    with anyio.move_on_after(0.5) as scope:
        await call(c, "slow-cancelled")
    assert scope.cancelled_caught and proxy.count("slow-cancelled") == 1
    assert _repeat.remembered() == before
    with anyio.move_on_after(0.5):  # the same call again is sent: cancellation is no verdict
        await call(c, "slow-cancelled")
    assert proxy.count("slow-cancelled") == 2
    for _ in range(200):
        if (await b.status()).used == 0:
            break
        await anyio.sleep(0.01)
    assert (await b.status()).used == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_memory_is_bounded_by_cap_and_window() -> None:
    clock = _Clock()
    reg = _repeat._Registry(cap=3)

    def failure(window: float = 10.0) -> Any:
        return _repeat._Failure(b"fp", clock.now, window, clock, ValueError("x"), None)  # type: ignore[arg-type]

    for k in range(5):
        reg.put(k, failure())
    assert len(reg) == 3 and reg.get(0) is None and reg.get(4) is not None  # oldest dropped first
    clock.now = 10.5
    assert reg.get(4) is None  # expired: dropped when looked up
    reg.put("new", failure())
    assert len(reg) == 1  # the expired ones went as a new one came
