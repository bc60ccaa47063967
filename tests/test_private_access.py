"""The private attributes of openai and httpx/httpx2 that zp reads, one function each
(zp_client/_private.py). These tests fail loudly when a release of either library renames one."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import httpx
import openai
import pytest

from zp_client._admission.httplib import module_of
from zp_client._private import (
    has_read_body,
    http_mounts,
    http_transport,
    replace_crewai_clients,
    sdk_http_client,
)
from zp_client.errors import ConfigurationError

try:
    import httpx2
except ImportError:  # openai 2.x environments have no httpx2
    httpx2 = None

LIBS: list[ModuleType] = [httpx] + ([httpx2] if httpx2 is not None else [])


@pytest.mark.openai_compat
@pytest.mark.parametrize("cls", [openai.AsyncOpenAI, openai.OpenAI])
def test_sdk_http_client_is_the_client_given_as_http_client(cls: Any) -> None:
    own = cls(base_url="http://127.0.0.1:9/v1", api_key="k")
    http = sdk_http_client(own)
    mod = module_of(http)  # openai subclasses the library's client
    is_async = cls is openai.AsyncOpenAI
    assert isinstance(http, mod.AsyncClient if is_async else mod.Client)
    given = mod.AsyncClient() if is_async else mod.Client()
    other = cls(base_url="http://127.0.0.1:9/v1", api_key="k", http_client=given)
    assert sdk_http_client(other) is given


@pytest.mark.openai_compat
@pytest.mark.parametrize("mod", LIBS, ids=lambda m: m.__name__)
def test_http_transport_and_mounts(mod: ModuleType) -> None:
    main, mounted = mod.HTTPTransport(), mod.HTTPTransport()
    with mod.Client(transport=main, mounts={"http://proxied.test": mounted, "http://off.test": None}) as http:
        assert http_transport(http) is main
        mounts = {pattern.pattern: t for pattern, t in http_mounts(http).items()}
        assert mounts == {"http://proxied.test": mounted, "http://off.test": None}


def test_a_renamed_attribute_raises_a_configuration_error() -> None:
    class Renamed:
        pass

    for fn, attr in ((sdk_http_client, "_client"), (http_transport, "_transport"), (http_mounts, "_mounts")):
        with pytest.raises(ConfigurationError, match=attr):
            fn(Renamed())
    with pytest.raises(ConfigurationError, match="_client"):
        replace_crewai_clients(Renamed(), lambda c: c)


def test_replace_crewai_clients_replaces_the_clients_built_and_leaves_the_others() -> None:
    # CrewAI's own class is checked in integrations/crewai/tests (its environment); this is the contract
    class LLM:
        _client: object | None = "sync"
        _async_client: object | None = None

    llm = LLM()
    replace_crewai_clients(llm, lambda c: ("admitted", c))
    assert llm._client == ("admitted", "sync") and llm._async_client is None


@pytest.mark.openai_compat
@pytest.mark.parametrize("mod", LIBS, ids=lambda m: m.__name__)
def test_has_read_body_tells_a_read_response_from_a_stream(mod: ModuleType) -> None:
    assert has_read_body(mod.Response(200, content=b"abc"))  # built with its body
    streamed = mod.Response(200, stream=mod.ByteStream(b"abc"))
    assert not has_read_body(streamed)
    streamed.read()
    assert has_read_body(streamed)


@pytest.mark.openai_compat
@pytest.mark.parametrize("cls_name", ["Stream", "AsyncStream"])
def test_detach_sdk_stream_breaks_the_streams_cycle(cls_name: str) -> None:
    """openai's stream holds ``_iterator = self.__stream__()`` (its frame holds the stream): after
    ``detach_sdk_stream`` the iterator runs on a twin and nothing refers back to the stream."""
    import gc
    import weakref

    from zp_client._private import detach_sdk_stream, response_body_stream

    is_async = cls_name == "AsyncStream"
    client = (openai.AsyncOpenAI if is_async else openai.OpenAI)(base_url="http://127.0.0.1:9/v1",
                                                                 api_key="k")
    mod = module_of(sdk_http_client(client))
    given: list[Any] = []

    def handler(request: Any) -> Any:
        answer = mod.Response(200, content=b"data: [DONE]\n\n")
        given.append(answer.stream)  # the client rebinds answer.stream to its own wrapper
        return answer

    with mod.Client(transport=mod.MockTransport(handler)) as http:
        resp = http.send(http.build_request("POST", "http://127.0.0.1:9/v1"), stream=True)
        assert response_body_stream(resp) is given[0] is not resp.stream  # under the client's bound stream
    stream = getattr(openai, cls_name)(cast_to=dict, response=resp, client=client)
    frame = stream._iterator.ag_frame if is_async else stream._iterator.gi_frame
    assert frame.f_locals["self"] is stream  # the cycle openai makes
    detach_sdk_stream(stream)
    frame = stream._iterator.ag_frame if is_async else stream._iterator.gi_frame
    assert frame.f_locals["self"] is not stream
    gone = weakref.ref(stream)
    gc.disable()
    try:
        del stream
        assert gone() is None  # freed by reference counting alone
    finally:
        gc.enable()

    class Renamed:
        pass

    with pytest.raises(ConfigurationError, match="__stream__"):
        detach_sdk_stream(Renamed())
