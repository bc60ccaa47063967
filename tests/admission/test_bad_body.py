"""Bad input is refused, never rewritten (issue 33, item 8): a body field zp reads (``max_tokens``,
``max_completion_tokens``, ``n``, ``stream``, ``priority``, ``messages``, ``prompt``) that is malformed is an
:class:`InvalidRequest` naming the field before any lease is taken and before anything is sent, on the
``AsyncClient``, the ``Client`` and ``wrap()`` (async and sync), and on a RedisBudget.

``max_tokens="100"`` once became 4096 (the server then generated 405 tokens), ``messages="hello"`` once
became ``['h', 'e', ...]``. Through real openai against a loopback server: ``openai_compat``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests._asgi_server import LoopbackServer
from tests._meta_spy import MetaSpy
from tests._redis_keys import delete_keys
from zp_client import AsyncClient, Client, InvalidRequest, RedisBudget, Settings, wrap
from zp_client._admission.plan import read_body

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

MSGS = [{"role": "user", "content": "hello there"}]
BAD_LIMITS = ["100", "abc", 1.5, True, False, -1, 0, [8], {"n": 8}]
# (field, value) pairs of a chat body that must be refused, whatever the front.
BAD_CHAT = ([("max_tokens", v) for v in BAD_LIMITS] + [("max_completion_tokens", v) for v in BAD_LIMITS]
            + [("n", "2"), ("n", 0), ("n", 1.0), ("n", True), ("stream", "true"), ("stream", 1),
               ("priority", "5"), ("priority", 1.5), ("stream_options", "include_usage"),
               ("stream_options", True)])

BAD_CLIENT = BAD_CHAT + [("messages", "hello"), ("messages", {"role": "user"})]


@pytest.fixture(scope="module")
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer() as s:
        yield s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _settings() -> Settings:
    return Settings(estimator="heuristic")


def _params(field: str, value: Any) -> dict[str, Any]:
    """openai's keyword for a field it names, ``extra_body`` for one it does not (``priority``)."""
    if field in ("max_tokens", "max_completion_tokens", "n", "stream", "stream_options"):
        return {"max_tokens": 8, field: value}
    return {"max_tokens": 8, "extra_body": {field: value}}


def _check(err: InvalidRequest, field: str, b: MetaSpy, server: LoopbackServer, before: int) -> None:
    assert err.field == field and field in str(err)
    assert isinstance(err, ValueError)
    assert b.calls == [] and b.granted() == 0  # refused before any lease was asked for
    assert len(server.llm_requests()) == before  # nothing sent


# --------------------------------------------------------------------------------------------- the reader


@pytest.mark.parametrize(("field", "value"), BAD_CHAT)
def test_read_body_refuses_each_malformed_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as bad:
        read_body({"model": "m", "messages": MSGS, field: value}, responses=False)
    assert bad.value.field == field


@pytest.mark.parametrize("value", BAD_LIMITS)
def test_read_body_refuses_a_malformed_max_output_tokens(value: Any) -> None:
    with pytest.raises(InvalidRequest) as bad:
        read_body({"model": "m", "input": "hi", "max_output_tokens": value}, responses=True)
    assert bad.value.field == "max_output_tokens"


@pytest.mark.parametrize("prompt", [7, {"text": "x"}, ["a", 1], [[1, 2], 3], [True, False], [[1, "a"]], None])
def test_read_body_refuses_a_malformed_prompt(prompt: Any) -> None:
    with pytest.raises(InvalidRequest) as bad:
        read_body({"model": "m", "prompt": prompt}, responses=False)
    assert bad.value.field == "prompt"


@pytest.mark.parametrize("messages", ["hello", {"role": "user", "content": "x"}, ["hello"], None])
def test_read_body_refuses_malformed_messages(messages: Any) -> None:
    with pytest.raises(InvalidRequest) as bad:
        read_body({"model": "m", "messages": messages}, responses=False)
    assert bad.value.field == "messages"


def test_read_body_takes_what_is_well_formed() -> None:
    assert read_body({"messages": MSGS, "max_tokens": 100, "n": 2, "stream": True, "priority": -3},
                     responses=False) == 100
    both = {"messages": MSGS, "max_tokens": 100, "max_completion_tokens": 50}
    assert read_body(both, responses=False) == 50
    nulls = {"messages": MSGS, "max_tokens": None, "n": None, "stream": None}
    assert read_body(nulls, responses=False) is None
    for prompt in ("x", ["a", "b"], [1, 2, 3], [[1, 2], [3]], []):
        assert read_body({"prompt": prompt, "max_tokens": 1}, responses=False) == 1
    responses = {"input": "x", "max_output_tokens": 9, "max_tokens": "not read there"}
    assert read_body(responses, responses=True) == 9


# ----------------------------------------------------------------------------------------------- the fronts


@pytest.mark.parametrize(("field", "value"), BAD_CHAT)
async def test_wrap_async_refuses_before_a_lease(server: LoopbackServer, field: str, value: Any) -> None:
    b = MetaSpy()
    c = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=b,
             settings=_settings())
    before = len(server.llm_requests())
    with pytest.raises(InvalidRequest) as bad:
        await c.chat.completions.create(model="ok", messages=MSGS, **_params(field, value))
    assert isinstance(bad.value, openai.OpenAIError)  # wrap(): catchable as the SDK's own error
    _check(bad.value, field, b, server, before)


@pytest.mark.parametrize(("field", "value"), BAD_CHAT)
def test_wrap_sync_refuses_before_a_lease(server: LoopbackServer, field: str, value: Any) -> None:
    b = MetaSpy()
    c = wrap(openai.OpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=b,
             settings=_settings())
    before = len(server.llm_requests())
    with pytest.raises(InvalidRequest) as bad:
        c.chat.completions.create(model="ok", messages=MSGS, **_params(field, value))
    _check(bad.value, field, b, server, before)


def test_wrap_sync_refuses_a_string_for_messages_and_a_bad_prompt(server: LoopbackServer) -> None:
    b = MetaSpy()
    c = wrap(openai.OpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=b,
             settings=_settings())
    before = len(server.llm_requests())
    with pytest.raises(InvalidRequest) as bad:
        c.chat.completions.create(model="ok", messages="hello", max_tokens=8)  # type: ignore[arg-type]
    _check(bad.value, "messages", b, server, before)
    with pytest.raises(InvalidRequest) as bad:
        c.completions.create(model="ok", prompt={"text": "x"}, max_tokens=8)  # type: ignore[arg-type]
    _check(bad.value, "prompt", b, server, before)


@pytest.mark.parametrize(("field", "value"), BAD_CLIENT)
async def test_async_client_refuses_before_a_lease(server: LoopbackServer, field: str, value: Any) -> None:
    b = MetaSpy()
    before = len(server.llm_requests())
    async with AsyncClient(server.base_url, budget=b, settings=_settings()) as c:
        params: dict[str, Any] = {"model": "ok", "messages": MSGS, "max_tokens": 8, field: value}
        with pytest.raises(InvalidRequest) as bad:
            await c.chat.completions.create(**params)
    _check(bad.value, field, b, server, before)


@pytest.mark.parametrize(("field", "value"), BAD_CLIENT)
def test_client_refuses_before_a_lease(server: LoopbackServer, field: str, value: Any) -> None:
    b = MetaSpy()
    before = len(server.llm_requests())
    with Client(server.base_url, budget=b, settings=_settings()) as c:
        params: dict[str, Any] = {"model": "ok", "messages": MSGS, "max_tokens": 8, field: value}
        with pytest.raises(InvalidRequest) as bad:
            c.chat.completions.create(**params)
    _check(bad.value, field, b, server, before)


def test_client_completions_refuse_a_bad_prompt_or_limit(server: LoopbackServer) -> None:
    b = MetaSpy()
    before = len(server.llm_requests())
    with Client(server.base_url, budget=b, settings=_settings()) as c:
        for params, field in (({"prompt": 12, "max_tokens": 8}, "prompt"),
                              ({"prompt": "hi", "max_tokens": "100"}, "max_tokens")):
            with pytest.raises(InvalidRequest) as bad:
                c.completions.create(model="ok", **params)
            _check(bad.value, field, b, server, before)


def test_a_tuple_of_messages_is_still_sent_as_a_list(server: LoopbackServer) -> None:
    b = MetaSpy()
    with Client(server.base_url, budget=b, settings=_settings()) as c:
        c.chat.completions.create(model="ok", messages=tuple(MSGS), max_tokens=8)
    assert server.llm_requests()[-1]["body"]["messages"] == MSGS
    assert b.granted() == 1 and b.status_sync().used == 0  # admitted, then released


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["strict", "elastic"])
async def test_a_negative_max_tokens_on_redis_is_invalid_request(server: LoopbackServer, redis_url: str,
                                                                 redis_prefix: str, policy: str) -> None:
    # It once failed inside the Lua script on "meta forecast_tokens" (elastic) instead of naming the field.
    budget = RedisBudget(redis_url, redis_prefix, 1000, 16, policy=policy)
    c = wrap(openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=budget,
             settings=_settings())
    before = len(server.llm_requests())
    try:
        for value in (-1, 0, "100"):
            with pytest.raises(InvalidRequest) as bad:
                await c.chat.completions.create(model="ok", messages=MSGS, max_tokens=value)
            assert bad.value.field == "max_tokens"
        assert len(server.llm_requests()) == before
    finally:
        await budget.aclose()
        delete_keys(redis_url, redis_prefix)
