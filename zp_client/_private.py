"""Every private attribute of another library zp reads, each owned by one function.

openai and httpx/httpx2 (and CrewAI, for its LLM's clients) offer no public accessor for these; if a
release renames one, the function raises :class:`~zp_client.ConfigurationError` saying which, and
tests/test_private_access.py (integrations/crewai/tests for CrewAI) fails. See docs/integrations.md.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

from zp_client.errors import ConfigurationError

__all__ = ["sdk_http_client", "resource_client", "http_transport", "http_mounts", "has_read_body",
           "replace_crewai_clients", "response_body_stream", "detach_sdk_stream", "sdk_stream_response",
           "patch_sdk_stream_inits"]


def _missing(obj: object, attr: str) -> ConfigurationError:
    return ConfigurationError(
        f"{type(obj).__module__}.{type(obj).__name__} has no {attr!r} attribute any more: this version of "
        "the library is not supported by zp-client yet (see zp_client/_private.py)"
    )


def _attr(obj: object, attr: str) -> object:
    """``obj``'s attribute ``attr``; ConfigurationError (:func:`_missing`) when it has none."""
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise _missing(obj, attr) from None


def sdk_http_client(client: object) -> Any:
    """The httpx / httpx2 client an ``openai.OpenAI`` / ``AsyncOpenAI`` sends with (``client._client``)."""
    return _attr(client, "_client")


def resource_client(resource: object) -> object:
    """The openai client an SDK API resource (``client.completions``...) calls (``resource._client``),
    or None when ``resource`` has none (the caller checks what it got)."""
    return getattr(resource, "_client", None)


def http_transport(http: object) -> Any:
    """The transport of an ``httpx`` / ``httpx2`` client (``Client._transport``)."""
    return _attr(http, "_transport")


class URLPattern(Protocol):
    """What zp reads of an ``httpx`` / ``httpx2`` ``URLPattern`` (a mount's key)."""

    @property
    def pattern(self) -> str: ...


def http_mounts(http: object) -> Mapping[URLPattern, Any]:
    """The mounted transports of an ``httpx`` / ``httpx2`` client, ``{URLPattern: transport or None}``
    (``Client._mounts``)."""
    return cast("Mapping[URLPattern, Any]", _attr(http, "_mounts"))


def has_read_body(resp: object) -> bool:
    """Whether an ``httpx`` / ``httpx2`` response already holds its whole body (``Response._content``,
    set by ``read()`` or by a response built with ``content=``; httpx has no public flag for it)."""
    return hasattr(resp, "_content")


def response_body_stream(resp: object) -> object:
    """The body stream a transport returned, under an ``httpx`` / ``httpx2`` client's response: the client
    wraps it in its ``BoundAsyncStream`` / ``BoundSyncStream`` as ``_stream``; a response built without a
    client holds it as ``stream`` itself."""
    stream: object = getattr(resp, "stream", None)
    if type(stream).__name__ in ("BoundAsyncStream", "BoundSyncStream"):
        return _attr(stream, "_stream")
    return stream


_ITERATOR = "_iterator"  # openai.Stream's iterator attribute


def detach_sdk_stream(stream: object) -> None:
    """Let an ``openai.Stream`` / ``AsyncStream`` be freed as soon as its caller drops it.

    openai builds its iterator as ``self._iterator = self.__stream__()``: a generator whose frame holds
    the stream, a reference cycle, so a dropped stream (and the connection and lease under it) waits for
    the garbage collector. The iterator is rebuilt on a shallow copy of the stream (the same response,
    decoder and client) that does not hold it: nothing then refers back to the stream. Raises
    :class:`~zp_client.ConfigurationError` when openai renamed either attribute."""
    make = getattr(type(stream), "__stream__", None)
    if make is None or not hasattr(stream, _ITERATOR):
        raise _missing(stream, _ITERATOR if make is not None else "__stream__")
    twin = copy.copy(stream)
    # the twin never iterates itself: only the stream does, through the new one
    setattr(twin, _ITERATOR, None)
    # the one openai made was never started: dropping it is free (no finalizer runs for it)
    setattr(stream, _ITERATOR, make(twin))


def replace_crewai_clients(llm: object, replace: Callable[[object], object]) -> None:
    """Set the openai clients a CrewAI native OpenAI LLM (``crewai.llms.providers.openai.completion.
    OpenAICompletion``) keeps, ``llm._client`` and ``llm._async_client``, to ``replace(client)``; one it
    has not built (None) stays None. CrewAI has no public hook for them (its ``interceptor`` sees single
    HTTP requests, not a call and its retries)."""
    for attr in ("_client", "_async_client"):
        try:
            current = getattr(llm, attr)
        except AttributeError:
            raise _missing(llm, attr) from None
        if current is not None:
            setattr(llm, attr, replace(current))


def sdk_stream_response(stream: object) -> object:
    """The response an ``openai.Stream`` / ``AsyncStream`` reads (``stream.response``; None when it has
    none: not an openai stream)."""
    return getattr(stream, "response", None)


def patch_sdk_stream_inits(openai_module: object, after_init: Callable[[object], None]) -> None:
    """Make every openai ``Stream`` / ``AsyncStream`` built from now on call ``after_init(stream)`` once
    built (openai has no hook for it: its classes' ``__init__`` is wrapped, marked so that a second call
    wraps nothing). An exception in ``after_init`` is logged at debug level and never breaks the stream."""
    for name in ("Stream", "AsyncStream"):
        cls = getattr(openai_module, name, None)
        init = getattr(cls, "__init__", None)
        if cls is None or init is None or getattr(init, "_zp_adopts", False):
            continue
        cls.__init__ = _calling_after(init, after_init)


def _calling_after(init: Callable[..., None], after_init: Callable[[object], None]) -> Callable[..., None]:
    def __init__(self: object, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        try:
            after_init(self)
        except Exception:  # never break the caller's stream for this; the GC path still releases
            logging.getLogger("zp_client.transport").debug("adopting an openai stream failed", exc_info=True)

    __init__._zp_adopts = True  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    __init__.__doc__ = init.__doc__
    return __init__
