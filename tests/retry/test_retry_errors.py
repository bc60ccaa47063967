"""zp's errors as agent frameworks see them: permanent refusals are ValueErrors (LangGraph's
default_retry_on and the like leave them alone), AdmissionTimeout/DeadlineExceeded stay TimeoutErrors,
``retry_on`` / ``unwrap_error`` look through frameworks' wrapping (cycles included), and an unreachable
server ends in ServerUnreachable naming the URL, with no chained errors, few frames of zp and nothing
charged to the retry budget. The unreachable server is a real closed loopback port."""

from __future__ import annotations

import pickle
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import zp_client
from zp_client import (
    AdmissionTimeout,
    AsyncClient,
    Client,
    ConfigurationError,
    DeadlineExceeded,
    InvalidRequest,
    LeaseTooLarge,
    LocalBudget,
    PromptTooLong,
    RetryBudgetExhausted,
    RetryPolicy,
    ServerUnreachable,
    StreamCut,
    ZPError,
    retry_on,
    unwrap_error,
    wrap,
)
from zp_client._wrap import openai_compatible_error
from zp_client.client import APIConnectionError
from zp_client.retry import LocalRetryBudget, testing

if sys.version_info < (3, 11):  # pragma: no cover - the builtin came with 3.11; anyio brings the backport
    from exceptiongroup import BaseExceptionGroup

PERMANENT = [LeaseTooLarge(33, 10), PromptTooLong(5000, 4096), InvalidRequest("bad", field="X-ZP-Deadline"),
             RetryBudgetExhausted("spent")]


@pytest.mark.parametrize("err", PERMANENT, ids=lambda e: type(e).__name__)
def test_permanent_refusals_are_value_errors_also_through_wrap(err: ZPError) -> None:
    assert isinstance(err, ValueError) and isinstance(err, ZPError)
    compat = openai_compatible_error(err)
    assert isinstance(compat, type(err)) and isinstance(compat, ValueError)
    assert isinstance(compat, openai.OpenAIError) and not isinstance(compat, openai.APIError)
    assert str(compat) == str(err) and compat.__dict__ == {**err.__dict__, **compat.__dict__}
    assert not retry_on(err) and not retry_on(compat)


def test_timeouts_stay_timeout_errors() -> None:
    for err in (AdmissionTimeout("waited"), DeadlineExceeded("late")):
        assert isinstance(err, TimeoutError) and not isinstance(err, ValueError)
        assert isinstance(openai_compatible_error(err), TimeoutError)
    assert retry_on(AdmissionTimeout("waited"))  # the line may be shorter later
    assert not retry_on(DeadlineExceeded("late"))  # the caller's time is up


def _langgraph_default_retry_on(exc: Exception) -> bool:
    """langgraph 1.x ``langgraph/_internal/_retry.py::default_retry_on`` as read (docs/retries.md), without
    its httpx/requests status branches (zp errors carry neither)."""
    if isinstance(exc, ConnectionError):
        return True
    return not isinstance(exc, (ValueError, TypeError, ArithmeticError, ImportError, LookupError, NameError,
                                SyntaxError, RuntimeError, ReferenceError, StopIteration, StopAsyncIteration,
                                OSError))


def test_langgraphs_default_predicate_leaves_permanent_refusals_alone() -> None:
    for err in PERMANENT:
        assert not _langgraph_default_retry_on(openai_compatible_error(err))
    # before this change they were plain Exceptions, which it retries
    assert _langgraph_default_retry_on(ZPError("plain"))


def test_unwrap_error_walks_cause_and_context_and_ends_on_a_cycle() -> None:
    zp = LeaseTooLarge(33, 10)

    class FrameworkError(Exception):
        pass

    outer = FrameworkError("litellm.InternalServerError: ...")
    outer.__context__ = RuntimeError("mapping")  # LiteLLM re-raises while handling the openai error
    outer.__context__.__context__ = openai_compatible_error(zp)
    assert isinstance(unwrap_error(outer), LeaseTooLarge)
    assert not retry_on(outer)
    by_cause = FrameworkError("ChatClientException")
    by_cause.__cause__ = zp
    assert unwrap_error(by_cause) is zp

    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a  # a cycle: the walk must end
    assert unwrap_error(a) is None
    assert retry_on(a) is False
    a.__cause__ = StreamCut("cut")
    assert isinstance(unwrap_error(b), StreamCut) and retry_on(b)


def test_unwrap_error_finds_a_member_of_an_exception_group() -> None:
    group = BaseExceptionGroup("tasks", [KeyError("x"), PromptTooLong(9, 8)])
    assert isinstance(unwrap_error(group), PromptTooLong)
    assert unwrap_error(KeyError("x")) is None


def test_retry_on_without_zp_errors_follows_status_and_transport_type() -> None:
    req = httpx.Request("POST", "http://x/v1/chat/completions")
    for status, want in ((400, False), (404, False), (408, True), (429, True), (500, True), (503, True)):
        err = openai.APIStatusError("e", response=httpx.Response(status, request=req), body=None)
        assert retry_on(err) is want, status
    assert retry_on(httpx.ConnectError("refused"))
    assert retry_on(ConnectionResetError())
    assert retry_on(TimeoutError())
    assert not retry_on(KeyError("bug"))
    assert not retry_on(ConfigurationError("bad setting"))


def test_the_new_names_are_exported() -> None:
    for name in ("ServerUnreachable", "retry_on", "unwrap_error"):
        assert name in zp_client.__all__ and getattr(zp_client, name) is not None


def test_server_unreachable_pickles_and_says_what_happened() -> None:
    err = ServerUnreachable("http://127.0.0.1:9/v1/chat/completions", "connection refused", 3)
    again = pickle.loads(pickle.dumps(err))
    assert (again.url, again.reason, again.attempts, str(again)) == (err.url, err.reason, 3, str(err))
    assert "http://127.0.0.1:9/v1/chat/completions" in str(err) and "connection refused" in str(err)
    assert "overload" not in str(err)
    assert retry_on(err)


# -- a real closed port ----------------------------------------------------------------------------------


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return f"http://127.0.0.1:{port}/v1"


def _zp_frames(err: BaseException) -> list[str]:
    pkg = str(Path(zp_client.__file__).parent)
    return [f.filename for f in traceback.extract_tb(err.__traceback__) if f.filename.startswith(pkg)]


def _assert_bare(err: BaseException, url: str) -> None:
    assert isinstance(err, ServerUnreachable)
    assert url + "/chat/completions" in str(err) and "connection refused" in str(err)
    assert err.__cause__ is None and err.__suppress_context__
    text = "".join(traceback.format_exception(err))
    assert "During handling" not in text and "direct cause" not in text
    assert "overload" not in text
    assert len(_zp_frames(err)) <= 3, _zp_frames(err)


def _ask() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _unspendable() -> tuple[RetryPolicy, LocalRetryBudget]:
    rb = LocalRetryBudget(ratio=0.0, floor_per_s=0.0)  # grants nothing: connect retries must not need it
    return RetryPolicy(budget=rb, budget_wait_s=0.0), rb


@pytest.mark.anyio
@pytest.mark.openai_compat
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_wrapped_async_openai_against_a_closed_port(anyio_backend: str) -> None:
    url = _dead_url()
    policy, rb = _unspendable()
    budget = LocalBudget(limit_blocks=100)
    async with openai.AsyncOpenAI(base_url=url, api_key="x") as original:
        client = wrap(original, budget, retry=policy, max_model_len=4096)
        with testing(), pytest.raises(ServerUnreachable) as info:
            await client.chat.completions.create(**_ask())
    err = info.value
    _assert_bare(err, url)
    assert isinstance(err, openai.APIConnectionError) and err.message == str(err)
    assert err.attempts == 3  # connect errors are retried, without the retry budget
    assert rb.snapshot() == (0, 0)
    assert (await budget.status()).used == 0


@pytest.mark.openai_compat
def test_wrapped_sync_openai_against_a_closed_port_without_retries() -> None:
    url = _dead_url()
    with openai.OpenAI(base_url=url, api_key="x") as original:
        client = wrap(original, LocalBudget(limit_blocks=100), retry=False, max_model_len=4096)
        with pytest.raises(openai.APIConnectionError) as info:
            client.chat.completions.create(**_ask())
    _assert_bare(info.value, url)
    assert info.value.attempts == 1


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_zp_async_client_against_a_closed_port(anyio_backend: str) -> None:
    url = _dead_url()
    policy, _ = _unspendable()
    async with AsyncClient(base_url=url, api_key="x", budget=LocalBudget(limit_blocks=100), retry=policy,
                           settings=zp_client.Settings(max_model_len=4096)) as client:
        with testing(), pytest.raises(APIConnectionError) as info:
            await client.chat.completions.create(**_ask())
    _assert_bare(info.value, url)
    assert type(info.value).__name__ == "ServerUnreachable"


def test_zp_sync_client_against_a_closed_port() -> None:
    url = _dead_url()
    policy, _ = _unspendable()
    client = Client(base_url=url, api_key="x", budget=LocalBudget(limit_blocks=100), retry=policy,
                    settings=zp_client.Settings(max_model_len=4096))
    with client, testing(), pytest.raises(ServerUnreachable) as info:
        client.chat.completions.create(**_ask())
    _assert_bare(info.value, url)
    assert isinstance(info.value, APIConnectionError)


@pytest.mark.anyio
@pytest.mark.openai_compat
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.slow
async def test_a_real_lease_too_large_is_a_value_error_through_wrap_and_zp_clients(
    anyio_backend: str,
) -> None:
    from _retry_upstream import RetryUpstream

    ask = {**_ask(), "max_tokens": 1000}  # 63 blocks of 16 tokens, over a 10-block budget
    with RetryUpstream() as upstream:
        async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x") as original:
            client = wrap(original, LocalBudget(limit_blocks=10), max_model_len=4096)
            with pytest.raises(ValueError) as via_wrap:
                await client.chat.completions.create(**ask)
        async with AsyncClient(base_url=upstream.base_url, api_key="x", budget=LocalBudget(limit_blocks=10),
                               settings=zp_client.Settings(max_model_len=4096)) as zp:
            with pytest.raises(ValueError) as via_zp:
                await zp.chat.completions.create(**ask)
        arrivals = upstream.users()
    for err in (via_wrap.value, via_zp.value):
        assert isinstance(err, LeaseTooLarge) and not retry_on(err) and unwrap_error(err) is err
    assert isinstance(via_wrap.value, openai.OpenAIError)
    assert arrivals == []  # refused before sending
