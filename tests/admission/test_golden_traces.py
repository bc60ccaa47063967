"""Golden traces of the admission transport: the same scenarios must give the same budget calls, upstream
requests and caller results as the recorded reference (tests/golden/*.json, recorded on a548a23).

Each scenario runs with both flavours (async / sync) and every HTTP library the environment has (httpx,
httpx2), through public entry points only: ``transport_classes(mod).AsyncAdmissionTransport(inner, ...)``
/ ``.AdmissionTransport(inner, ...)`` (the inner transport is a scripted upstream), ``zp_client.wrap``
(openai) and ``zp_client.AsyncClient`` / ``Client``. The budget is a real LocalBudget behind a recording
wrapper (tests/_golden.py). Every scenario passes ``retry=`` explicitly.

Re-record (only on purpose, on the commit whose behaviour is the reference), in both environments:
``ZP_GOLDEN_RECORD=1 .venv/bin/python -m pytest tests/admission/test_golden_traces.py`` and the same with
``.venv-openai2/bin/python``; then check ``git diff tests/golden``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

import zp_client
from tests._golden import (
    RECORD,
    RecordingBudget,
    Reply,
    Trace,
    check,
    error_name,
    golden_path,
    json_reply,
    load,
    sse_reply,
    upstream_transport,
    write,
)
from zp_client import LengthForecaster, Prior, RetryPolicy, Settings
from zp_client.retry import testing
from zp_client.transport import transport_classes

pytestmark = pytest.mark.openai_compat

LIBS: list[Any] = [httpx]
if importlib.util.find_spec("httpx2") is not None:
    import httpx2

    LIBS.append(httpx2)

BASE = "http://upstream.test"
MML = 4096
PROMPT = 12  # the scripted server's prompt count
MSGS = [{"role": "user", "content": "hello there"}]
CHAT = {"model": "ok", "messages": MSGS, "max_tokens": 32}
SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 120}


@pytest.fixture(autouse=True)
def _no_zp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read ZP_* variables: the traces must not depend on the caller's environment.

    The pool check (``Settings.pool_check``: one ``GET /metrics`` per budget and server before the first
    admitted request) came after the reference was recorded and would add that request to every trace; it
    is switched off here through its public opt-out, ``ZP_POOL_CHECK`` (every Settings of these scenarios
    reads it), and traced on its own in tests/estimate/test_pool_check.py."""
    for name in list(os.environ):
        if name.startswith("ZP_") and not name.startswith(("ZP_GOLDEN_", "ZP_TEST_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ZP_POOL_CHECK", "false")


def no_retry() -> RetryPolicy:
    return RetryPolicy(max_attempts=1, budget=None)


def retry3() -> RetryPolicy:
    return RetryPolicy(max_attempts=3, budget=None)


# --------------------------------------------------------------------------------------------------
# The scripted server: vLLM-shaped answers; the model name picks the behaviour
# --------------------------------------------------------------------------------------------------

OUTPUT_TOKENS = {"long": 100, "packed": 20}
TOKENS_PER_CHUNK = {"packed": 5}


def _chunk(
    kind: str, delta_text: str | None, finish: str | None, usage: dict[str, int] | None, role: bool = False
) -> dict[str, Any]:
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if delta_text is not None:
            delta["content"] = delta_text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj: dict[str, Any] = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }
    else:
        choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    if usage is not None:
        obj["usage"] = usage
    return obj


def _usage(prompt: int, done: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}


def _error(status: int, message: str) -> Reply:
    return json_reply({"error": {"message": message, "type": "Err", "param": None, "code": status}}, status)


def vllm(method: str, path: str, body: Any, seen: int) -> Reply:
    if method == "GET" and path.endswith("/models"):
        return json_reply(
            {
                "object": "list",
                "data": [{"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": MML}],
            }
        )
    kind = "chat" if path.endswith("/chat/completions") else "completion"
    model = str(body.get("model", ""))
    if model == "err400":
        return _error(400, "bad request")
    if model == "err500":
        return _error(500, "boom")
    if model == "flaky429" and seen == 0:
        return Reply(
            429,
            {"content-type": "application/json", "retry-after-ms": "250"},
            [b'{"error": {"message": "slow down", "code": 429}}'],
        )
    if model == "slow-retry":
        return Reply(
            503,
            {"content-type": "application/json", "retry-after": "5"},
            [b'{"error": {"message": "overloaded", "code": 503}}'],
        )
    if model == "down503":
        return _error(503, "overloaded")
    if model == "connfail" and seen == 0:
        return Reply(chunks=None, error="ConnectError")
    total = min(
        int(body.get("max_tokens") or body.get("max_completion_tokens") or 16), OUTPUT_TOKENS.get(model, 5)
    )
    per = TOKENS_PER_CHUNK.get(model, 1)
    prompt = 1000 if model == "packed" else PROMPT
    if not body.get("stream"):
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * total},
                "logprobs": None,
                "finish_reason": "length",
            }
            obj = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m"}
        else:
            choice = {"index": 0, "text": "x" * total, "logprobs": None, "finish_reason": "length"}
            obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
        return json_reply(
            {**obj, "choices": [choice], "usage": _usage(prompt, total)}, chunked=model != "preread"
        )
    so = body.get("stream_options") or {}
    usage_on = bool(so.get("include_usage"))
    continuous = usage_on and bool(so.get("continuous_usage_stats"))
    events: list[Any] = []
    if kind == "chat":
        events.append(_chunk(kind, None, None, _usage(prompt, 0) if continuous else None, role=True))
    done = 0
    while done < total:
        k = min(per, total - done)
        done += k
        events.append(_chunk(kind, "x" * k, None, _usage(prompt, done) if continuous else None))
        if model == "errevent" and done == 2:
            events.append({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
            return sse_reply(events, done=False)
    events.append(_chunk(kind, None, "length", _usage(prompt, done) if continuous else None))
    if usage_on:
        final = _chunk(kind, None, None, _usage(prompt, done))
        final["choices"] = []
        events.append(final)
    if model == "reset":
        return sse_reply(events[:3], done=False, error="ReadError")
    return sse_reply(events, done=model != "nodone")


# --------------------------------------------------------------------------------------------------
# Scenarios through the transport (transport_classes(mod)), httpx and httpx2, async and sync
# --------------------------------------------------------------------------------------------------


@dataclass
class Call:
    json: Any = None
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False  # the caller reads the answer as a stream (raw chunks)


@dataclass
class Scenario:
    name: str
    calls: list[Call]
    retry: Callable[[], RetryPolicy] = no_retry
    policy: str = "strict"
    limit: int = 1000
    settings: dict[str, Any] = field(default_factory=lambda: {"max_model_len": MML})
    options: dict[str, Any] = field(default_factory=dict)
    forecaster: Callable[[], Any] | None = None
    sleeps: bool = False  # record the (deterministic: Retry-After) retry delays
    hold_all: bool = False  # the budget is full (held outside the trace) when the calls start


def short_forecaster() -> LengthForecaster:
    fc = LengthForecaster(q=0.9, prior=Prior(median=3, sigma=0.2, weight=50))
    fc.observe_many("long", [3] * 50)
    return fc


STREAM = {**CHAT, "stream": True}
SCENARIOS = [
    Scenario("chat_upstream_streamed", [Call(CHAT), Call(CHAT)]),
    Scenario("chat_sent_as_is", [Call(CHAT)], options={"stream_upstream": False}),
    Scenario("chat_preread_answer", [Call({**CHAT, "model": "preread"})], options={"stream_upstream": False}),
    Scenario("chat_stream", [Call(STREAM, stream=True)]),
    Scenario(
        "chat_stream_caller_usage", [Call({**STREAM, "stream_options": {"include_usage": True}}, stream=True)]
    ),
    Scenario(
        "chat_stream_long_strict_reports", [Call({**STREAM, "model": "long", "max_tokens": 200}, stream=True)]
    ),
    Scenario(
        "completion_upstream_streamed",
        [Call({"model": "ok", "prompt": "once upon", "max_tokens": 20}, path="/v1/completions")],
    ),
    Scenario(
        "completion_stream",
        [
            Call(
                {"model": "ok", "prompt": "once upon", "max_tokens": 20, "stream": True},
                path="/v1/completions",
                stream=True,
            )
        ],
    ),
    Scenario("logprobs_not_streamed_upstream", [Call({**CHAT, "logprobs": True, "top_logprobs": 2})]),
    Scenario(
        "default_max_tokens_inserted",
        [Call({"model": "ok", "messages": MSGS})],
        settings={"max_model_len": MML, "default_max_tokens": 100},
    ),
    Scenario(
        "zp_headers_stripped",
        [
            Call(
                {**CHAT, "priority": 3},
                headers={
                    "X-ZP-Priority": "-2",
                    "X-ZP-Route": "r1",
                    "X-ZP-Deadline": "30",
                    "Authorization": "Bearer k",
                },
            ),
            Call({**CHAT, "priority": 3}),
        ],
    ),
    Scenario("max_model_len_from_models", [Call(CHAT), Call(CHAT)], settings={}),
    Scenario(
        "not_admitted_passthrough",
        [
            Call(None, path="/v1/models", method="GET"),
            Call({"input": "x", "model": "e"}, path="/v1/embeddings"),
        ],
    ),
    Scenario(
        "http_400",
        [Call({**CHAT, "model": "err400"}), Call({**STREAM, "model": "err400"}, stream=True)],
        retry=retry3,
    ),
    Scenario(
        "http_500_not_retried",
        [Call({**CHAT, "model": "err500"}), Call({**STREAM, "model": "err500"}, stream=True)],
        retry=retry3,
    ),
    Scenario("read_error_mid_stream", [Call({**STREAM, "model": "reset"}, stream=True)]),
    Scenario("read_error_upstream_streamed", [Call({**CHAT, "model": "reset"})]),
    Scenario("stream_without_done_upstream", [Call({**CHAT, "model": "nodone"})]),
    Scenario("error_event_upstream_streamed", [Call({**CHAT, "model": "errevent"})], retry=retry3),
    Scenario("prompt_too_long", [Call({**CHAT, "messages": [SYSTEM]})], settings={"max_model_len": 256}),
    Scenario("lease_too_large", [Call({**CHAT, "max_tokens": 3000})], limit=50),
    # retry
    Scenario("retry_429_retry_after_ms", [Call({**CHAT, "model": "flaky429"})], retry=retry3, sleeps=True),
    Scenario(
        "retry_429_stream", [Call({**STREAM, "model": "flaky429"}, stream=True)], retry=retry3, sleeps=True
    ),
    Scenario("retry_503_gives_up", [Call({**CHAT, "model": "down503"})], retry=retry3),
    Scenario("retry_connect_error_before_send", [Call({**CHAT, "model": "connfail"})], retry=retry3),
    Scenario("connect_error_no_retry", [Call({**CHAT, "model": "connfail"})]),
    Scenario(
        "retry_deadline_exceeded",
        [Call({**CHAT, "model": "slow-retry"}, headers={"X-ZP-Deadline": "2"})],
        retry=retry3,
    ),
    Scenario(
        "admission_deadline_budget_full", [Call(CHAT, headers={"X-ZP-Deadline": "0.05"})], hold_all=True
    ),
    # elastic
    Scenario(
        "elastic_stream_reports",
        [
            Call(
                {**STREAM, "model": "long", "max_tokens": 2000, "messages": [SYSTEM, *MSGS]},
                headers={"X-ZP-Route": "long"},
                stream=True,
            )
        ],
        policy="elastic",
        forecaster=short_forecaster,
        settings={"max_model_len": MML, "continuous_usage": "never"},
    ),
    Scenario(
        "elastic_upstream_streamed_default_forecaster",
        [Call({**CHAT, "max_tokens": 64}), Call({**CHAT, "max_tokens": 64})],
        policy="elastic",
        settings={"max_model_len": MML, "continuous_usage": "never"},
    ),
    Scenario(
        "elastic_sent_as_is",
        [Call({**CHAT, "max_tokens": 64})],
        policy="elastic",
        options={"stream_upstream": False},
        settings={"max_model_len": MML, "continuous_usage": "never"},
    ),
    Scenario(
        "continuous_usage_always",
        [Call({**STREAM, "model": "packed", "messages": [SYSTEM, *MSGS], "max_tokens": 20}, stream=True)],
        policy="elastic",
        settings={"max_model_len": MML, "continuous_usage": "always"},
    ),
    Scenario(
        "continuous_usage_caller_asked",
        [
            Call(
                {
                    **STREAM,
                    "model": "packed",
                    "max_tokens": 20,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                },
                stream=True,
            )
        ],
        policy="elastic",
        settings={"max_model_len": MML, "continuous_usage": "always"},
    ),
    Scenario(
        "continuous_usage_auto_from_models",
        [Call({**CHAT, "model": "packed", "max_tokens": 20})],
        policy="elastic",
        settings={"continuous_usage": "auto"},
    ),
]

_FLOAT = re.compile(r"\d+\.\d+")
_LEFT = re.compile(r"has [\d.]+ s left")


def _message(exc: BaseException) -> str:
    # Elapsed / remaining seconds are not deterministic (the rest of a message is).
    return _FLOAT.sub("<float>", _LEFT.sub("has <float> s left", str(exc)))


def _response_headers(resp: Any) -> dict[str, str]:
    return {
        k.lower(): v
        for k, v in resp.headers.items()
        if k.lower() not in ("content-length", "transfer-encoding")
    }


def _body(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode()


async def _run_async(sc: Scenario, mod: Any, trace: Trace, transport: Any) -> None:
    async with mod.AsyncClient(transport=transport, base_url=BASE) as c:
        for call in sc.calls:
            trace.add("call", method=call.method, path=call.path, stream=call.stream)
            try:
                if call.stream:
                    async with c.stream(call.method, call.path, json=call.json, headers=call.headers) as r:
                        trace.add("response", status=r.status_code, headers=_response_headers(r))
                        async for chunk in r.aiter_raw():
                            trace.add("read", data=chunk.decode())
                    trace.add("closed")
                else:
                    r = await c.request(call.method, call.path, json=call.json, headers=call.headers)
                    trace.add(
                        "response", status=r.status_code, headers=_response_headers(r), body=_body(r.content)
                    )
            except Exception as exc:  # noqa: BLE001 - the caller's outcome is what the trace records
                trace.add("raised", error=error_name(exc), message=_message(exc))


def _run_sync(sc: Scenario, mod: Any, trace: Trace, transport: Any) -> None:
    with mod.Client(transport=transport, base_url=BASE) as c:
        for call in sc.calls:
            trace.add("call", method=call.method, path=call.path, stream=call.stream)
            try:
                if call.stream:
                    with c.stream(call.method, call.path, json=call.json, headers=call.headers) as r:
                        trace.add("response", status=r.status_code, headers=_response_headers(r))
                        for chunk in r.iter_raw():
                            trace.add("read", data=chunk.decode())
                    trace.add("closed")
                else:
                    r = c.request(call.method, call.path, json=call.json, headers=call.headers)
                    trace.add(
                        "response", status=r.status_code, headers=_response_headers(r), body=_body(r.content)
                    )
            except Exception as exc:  # noqa: BLE001 - the caller's outcome is what the trace records
                trace.add("raised", error=error_name(exc), message=_message(exc))


def run_scenario(sc: Scenario, mod: Any, flavour: str) -> list[dict[str, Any]]:
    trace = Trace()
    budget = RecordingBudget(trace, limit=sc.limit, policy=sc.policy)
    is_async = flavour == "async"
    inner = upstream_transport(mod, trace, vllm, is_async)
    options = dict(sc.options)
    if sc.forecaster is not None:
        options["forecaster"] = sc.forecaster()
    classes = transport_classes(mod)
    cls = classes.AsyncAdmissionTransport if is_async else classes.AdmissionTransport
    transport = cls(
        inner,
        budget=budget,
        retry=sc.retry(),
        settings=Settings(estimator="heuristic", **sc.settings),
        **options,
    )
    blocker = budget.real.acquire_sync(budget.limit) if sc.hold_all else None
    with testing() as rec:
        if is_async:
            anyio.run(_run_async, sc, mod, trace, transport)
        else:
            _run_sync(sc, mod, trace, transport)
    if blocker is not None:
        blocker.release_sync()
    if sc.sleeps:
        trace.add("retry_sleeps", seconds=rec.sleeps)
    else:
        trace.add("retry_sleeps", count=len(rec.sleeps))
    trace.add("budget_after", used=budget.real.status_sync().used)
    return trace.events


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize("mod", LIBS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_transport_trace(sc: Scenario, mod: Any, flavour: str) -> None:
    check(golden_path("transport", mod.__name__), f"{sc.name}[{flavour}]", run_scenario(sc, mod, flavour))


# --------------------------------------------------------------------------------------------------
# The front ends: zp_client.wrap (openai, on whichever HTTP library it is built) and zp_client.AsyncClient
# --------------------------------------------------------------------------------------------------

OPENAI_CALLS = {
    "chat": {"model": "ok", "messages": MSGS, "max_tokens": 32},
    "chat_stream": {"model": "ok", "messages": MSGS, "max_tokens": 32, "stream": True},
    "retry_429": {"model": "flaky429", "messages": MSGS, "max_tokens": 32},
    "http_400": {"model": "err400", "messages": MSGS, "max_tokens": 32},
    "retry_503_gives_up": {"model": "down503", "messages": MSGS, "max_tokens": 32},
}


def _dump(obj: Any) -> Any:
    return obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else obj


def _openai_module() -> tuple[Any, Any] | None:
    try:
        import openai
    except ImportError:
        return None
    probe = openai.OpenAI(base_url=BASE, api_key="k")
    tops = [c.__module__.split(".")[0] for c in type(probe._client).__mro__]  # the SDK's HTTP library
    return openai, importlib.import_module(next(t for t in tops if t in ("httpx", "httpx2")))


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize("case", sorted(OPENAI_CALLS))
def test_wrap_trace(case: str, flavour: str) -> None:
    found = _openai_module()
    if found is None:
        pytest.skip("openai is not installed")
    openai, mod = found
    trace = Trace()
    budget = RecordingBudget(trace)
    is_async = flavour == "async"
    inner = upstream_transport(mod, trace, vllm, is_async)
    http = (mod.AsyncClient if is_async else mod.Client)(transport=inner)
    cls = openai.AsyncOpenAI if is_async else openai.OpenAI
    client = zp_client.wrap(
        cls(base_url=BASE + "/v1", api_key="k", http_client=http),
        budget,
        retry=retry3(),
        settings=Settings(estimator="heuristic", max_model_len=MML),
    )
    args = OPENAI_CALLS[case]

    async def go_async() -> None:
        result = await client.chat.completions.create(**args)
        if args.get("stream"):
            async for chunk in result:
                trace.add("chunk", value=_dump(chunk))
        else:
            trace.add("result", value=_dump(result))

    def go_sync() -> None:
        result = client.chat.completions.create(**args)
        if args.get("stream"):
            for chunk in result:
                trace.add("chunk", value=_dump(chunk))
        else:
            trace.add("result", value=_dump(result))

    with testing() as rec:
        try:
            anyio.run(go_async) if is_async else go_sync()
        except Exception as exc:  # noqa: BLE001 - the caller's outcome is what the trace records
            trace.add("raised", error=error_name(exc), status=getattr(exc, "status_code", None))
    if case == "retry_429":  # Retry-After: the delay is deterministic
        trace.add("retry_sleeps", seconds=rec.sleeps)
    else:
        trace.add("retry_sleeps", count=len(rec.sleeps))
    trace.add("budget_after", used=budget.real.status_sync().used)
    check(golden_path("wrap", mod.__name__), f"{case}[{flavour}]", trace.events)


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize("case", sorted(OPENAI_CALLS))
def test_client_trace(case: str, flavour: str) -> None:
    """zp_client.AsyncClient / Client (httpx) over a caller-supplied http_client whose transport is the
    scripted upstream."""
    trace = Trace()
    budget = RecordingBudget(trace)
    is_async = flavour == "async"
    inner = upstream_transport(httpx, trace, vllm, is_async)
    settings = Settings(estimator="heuristic", max_model_len=MML)
    args = OPENAI_CALLS[case]

    async def go_async() -> None:
        async with (
            httpx.AsyncClient(transport=inner) as http,
            zp_client.AsyncClient(
                base_url=BASE + "/v1",
                api_key="k",
                budget=budget,
                settings=settings,
                http_client=http,
                retry=retry3(),
            ) as c,
        ):
            result = await c.chat.completions.create(**args)
            if args.get("stream"):
                async with result as stream:
                    async for chunk in stream:
                        trace.add("chunk", value=_dump(chunk))
            else:
                trace.add("result", value=_dump(result))

    def go_sync() -> None:
        with (
            httpx.Client(transport=inner) as http,
            zp_client.Client(
                base_url=BASE + "/v1",
                api_key="k",
                budget=budget,
                settings=settings,
                http_client=http,
                retry=retry3(),
            ) as c,
        ):
            result = c.chat.completions.create(**args)
            if args.get("stream"):
                with result as stream:
                    for chunk in stream:
                        trace.add("chunk", value=_dump(chunk))
            else:
                trace.add("result", value=_dump(result))

    with testing() as rec:
        try:
            anyio.run(go_async) if is_async else go_sync()
        except Exception as exc:  # noqa: BLE001 - the caller's outcome is what the trace records
            trace.add(
                "raised",
                error=error_name(exc),
                status=getattr(exc, "status_code", None),
                message=_message(exc),
            )
    if case == "retry_429":  # Retry-After: the delay is deterministic
        trace.add("retry_sleeps", seconds=rec.sleeps)
    else:
        trace.add("retry_sleeps", count=len(rec.sleeps))
    trace.add("budget_after", used=budget.real.status_sync().used)
    check(golden_path("client", "httpx"), f"{case}[{flavour}]", trace.events)


# --------------------------------------------------------------------------------------------------
# The stored files hold exactly the scenarios above
# --------------------------------------------------------------------------------------------------


def _expected() -> dict[str, set[str]]:
    flavours = ("async", "sync")
    out = {f"transport_{m.__name__}": {f"{s.name}[{f}]" for s in SCENARIOS for f in flavours} for m in LIBS}
    out["client_httpx"] = {f"{c}[{f}]" for c in OPENAI_CALLS for f in flavours}
    found = _openai_module()
    if found is not None:
        out[f"wrap_{found[1].__name__}"] = {f"{c}[{f}]" for c in OPENAI_CALLS for f in flavours}
    return out


def test_public_entry_points() -> None:
    """What the traces are driven through: transport_classes(mod) gives each library's (async, sync) pair,
    subclasses of its base transports; for httpx, the root exports zp_client.(Async)AdmissionTransport.
    (Not admission_transport_for: on a548a23 it cannot place a user-defined sync transport once openai is
    imported, because openai rewrites BaseTransport.__module__ to "openai".)"""
    for mod in LIBS:
        classes = transport_classes(mod)
        assert issubclass(classes.AsyncAdmissionTransport, mod.AsyncBaseTransport)
        assert issubclass(classes.AdmissionTransport, mod.BaseTransport)
    assert transport_classes(httpx).AsyncAdmissionTransport is zp_client.AsyncAdmissionTransport
    assert transport_classes(httpx).AdmissionTransport is zp_client.AdmissionTransport


def test_a_changed_trace_fails_with_a_diff(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import tests._golden as golden

    monkeypatch.setattr(golden, "RECORD", False)
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"s": [{"event": "acquire", "blocks": 4}]}))
    check(path, "s", [{"event": "acquire", "blocks": 4}])
    with pytest.raises(
        AssertionError, match=r'-\{"event": "acquire", "blocks": 4\}\n\+\{"event": "acquire", "blocks": 5\}'
    ):
        check(path, "s", [{"event": "acquire", "blocks": 5}])
    with pytest.raises(AssertionError, match="no golden trace"):
        check(path, "other", [])


def test_no_stale_golden_traces() -> None:
    for stem, names in _expected().items():
        path = golden_path(*stem.split("_", 1))
        stored = load(path)
        stale = set(stored) - names
        if RECORD and stale:
            write(path, {k: v for k, v in stored.items() if k in names})
            continue
        assert not stale, f"{path.name} holds traces no scenario produces: {sorted(stale)}"
        assert path.exists(), f"{path.name} is missing; record with ZP_GOLDEN_RECORD=1"
