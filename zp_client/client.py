"""The drop-in client: ``AsyncClient`` and ``Client``, OpenAI-shaped, admitted by the budget.

Every LLM call goes through :class:`~zp_client.transport.AsyncAdmissionTransport` (sync:
:class:`~zp_client.transport.AdmissionTransport`); this module adds no admission logic of its own::

    async with AsyncClient(base_url="http://localhost:8000/v1", budget=LocalBudget(limit_blocks=24_000)) as c:
        reply = await c.chat.completions.create(model="m", messages=[...], max_tokens=64)

Errors and per-call options: see docs/wrap.md#the-drop-in-client.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Generic, Literal, TypedDict, TypeVar, cast, overload

import anyio
import httpx
from httpx_sse import EventSource, ServerSentEvent, SSEError
from pydantic import BaseModel, SecretStr

from zp_client._admission.ports import TransportOptions
from zp_client._private import http_transport
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, InvalidRequest, ServerUnreachable, ZPError
from zp_client.types import ChatCompletion, ChatCompletionChunk, Completion, Model, ModelList

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Unpack

    from zp_client.budget.base import Budget
    from zp_client.transport import AdmissionTransport, AsyncAdmissionTransport

__all__ = [
    "AsyncClient",
    "Client",
    "AsyncStream",
    "Stream",
    "APIError",
    "APIStatusError",
    "APIConnectionError",
    "APITimeoutError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "UnprocessableEntityError",
    "RateLimitError",
    "InternalServerError",
]

logger = logging.getLogger("zp_client.client")

T = TypeVar("T", bound=BaseModel)
Prompt = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]
"""A completions prompt: text, texts, token ids or lists of them."""
TimeoutArg = float | httpx.Timeout | None
"""A call's ``timeout=``: seconds, an ``httpx.Timeout``, or None for the client's."""


# --------------------------------------------------------------------------------------------------
# errors


class APIError(ZPError):
    """The server did not give a usable answer. ``message`` is the server's message (or ours)."""

    def __init__(self, message: str, *, body: object = None) -> None:
        self.message = message
        self.body = body
        super().__init__(message)


class APIStatusError(APIError):
    """The server answered with an HTTP error status.

    ``status_code``: the status; ``message``: the server's error message (vLLM/OpenAI
    ``{"error": {"message": ...}}``, FastAPI ``detail``, or the start of a non-JSON body);
    ``body``: the decoded JSON body (or the text); ``response``: the ``httpx.Response``.
    """

    def __init__(self, message: str, *, response: httpx.Response, body: object) -> None:
        self.status_code = response.status_code
        self.response = response
        super().__init__(f"HTTP {response.status_code}: {message}", body=body)
        self.message = message


class BadRequestError(APIStatusError):
    """400: the request is invalid (for vLLM, also a prompt longer than the context)."""


class AuthenticationError(APIStatusError):
    """401: check the API key (``api_key=``, ``ZP_API_KEY`` or ``OPENAI_API_KEY``)."""


class PermissionDeniedError(APIStatusError):
    """403."""


class NotFoundError(APIStatusError):
    """404: for vLLM, usually an unknown ``model`` or a base URL without ``/v1``."""


class ConflictError(APIStatusError):
    """409."""


class UnprocessableEntityError(APIStatusError):
    """422: the body failed the server's validation."""


class RateLimitError(APIStatusError):
    """429: the server or a gateway rate-limited the request."""


class InternalServerError(APIStatusError):
    """5xx: the server (or a gateway: 502, 503, 504) failed."""


class APIConnectionError(APIError):
    """No response arrived (connection refused or reset, DNS failure...)."""


class APITimeoutError(APIConnectionError):
    """The HTTP request timed out (``timeout=``)."""


class _ServerUnreachable(ServerUnreachable, APIConnectionError):
    """:class:`~zp_client.ServerUnreachable` as this client raises it: also its :class:`APIConnectionError`
    (``message`` is the text, ``body`` None), so one ``except APIConnectionError`` handles both."""


_ServerUnreachable.__name__ = _ServerUnreachable.__qualname__ = "ServerUnreachable"


def _client_error(err: ZPError) -> ZPError:
    """The error this client's caller sees for a zp error (the admission transport's convert_error)."""
    if not isinstance(err, ServerUnreachable) or isinstance(err, APIConnectionError):
        return err
    new = _ServerUnreachable.__new__(_ServerUnreachable, *err.args)
    new.__dict__.update(err.__dict__)
    new.message, new.body = str(err), None
    return new


_STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def _status_error(response: httpx.Response) -> APIStatusError:
    raw = response.content
    body: object
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw.decode("utf-8", "replace")
    message = ""
    if isinstance(body, Mapping):
        err = body.get("error", body)
        if isinstance(err, Mapping):
            message = str(err.get("message") or err.get("detail") or "")
        elif isinstance(err, str):
            message = err
        if not message and "detail" in body:
            message = str(body["detail"])
        if not message and "message" in body:
            message = str(body["message"])
    elif isinstance(body, str):
        message = " ".join(body.split())[:500]
    if not message:
        message = response.reason_phrase or "error"
    cls = _STATUS_ERRORS.get(response.status_code)
    if cls is None:
        cls = InternalServerError if response.status_code >= 500 else APIStatusError
    return cls(message, response=response, body=body)


def _connection_error(exc: httpx.TransportError) -> APIConnectionError:
    # httpx's messages name the URL at most, never headers; keep the type for callers that retry.
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"request timed out ({type(exc).__name__}: {exc})")
    return APIConnectionError(f"connection error ({type(exc).__name__}: {exc})")


@contextlib.contextmanager
def _transport_errors() -> Iterator[None]:
    """No response (or a broken one): :class:`APIConnectionError` / :class:`APITimeoutError`."""
    try:
        yield
    except httpx.TransportError as exc:
        raise _connection_error(exc) from exc


@contextlib.contextmanager
def _stream_errors() -> Iterator[None]:
    with _transport_errors():
        try:
            yield
        except SSEError as exc:
            raise APIError(f"the response is not an event stream: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# streams


def _chunk_or_error(data: str, cls: type[T], response: httpx.Response) -> T:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise APIError(f"the server sent an unreadable stream event: {data[:200]!r}") from exc
    if isinstance(doc, Mapping) and doc.get("error") is not None and "choices" not in doc:
        err = doc["error"]
        msg = err.get("message") if isinstance(err, Mapping) else str(err)
        raise APIError(f"the server reported an error mid-stream: {msg}", body=doc)
    return cls.model_validate(doc)


class AsyncStream(Generic[T]):
    """An async iterator of streamed events (``ChatCompletionChunk`` or ``Completion``).

    It ends at the server's ``data: [DONE]``. Closing it (``await stream.aclose()``, leaving ``async
    with``, or reaching the end) closes the HTTP response, which releases the request's lease. Close a
    stream you stop reading early.
    """

    def __init__(self, response: httpx.Response, cls: type[T]) -> None:
        self.response = response
        self._cls = cls
        self._events = EventSource(response).aiter_sse()
        self._closed = False

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        try:
            with _stream_errors():
                async for sse in self._events:
                    if sse.data == "[DONE]":
                        break
                    if sse.data:
                        yield _chunk_or_error(sse.data, self._cls, self.response)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close the response (idempotent). Shielded: it completes even inside a cancelled scope, so a
        cancelled reader still closes the connection and releases the lease at once."""
        if not self._closed:
            self._closed = True
            with anyio.CancelScope(shield=True):
                try:
                    await self._events.aclose()
                finally:
                    await self.response.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Stream(Generic[T]):
    """The blocking counterpart of :class:`AsyncStream`: an iterator, closable, a context manager."""

    def __init__(self, response: httpx.Response, cls: type[T]) -> None:
        self.response = response
        self._cls = cls
        # iter_sse is a generator function (typed as returning an Iterator): it has close()
        self._events = cast("Generator[ServerSentEvent, None, None]", EventSource(response).iter_sse())
        self._closed = False

    def __iter__(self) -> Iterator[T]:
        return self._iterate()

    def _iterate(self) -> Iterator[T]:
        try:
            with _stream_errors():
                for sse in self._events:
                    if sse.data == "[DONE]":
                        break
                    if sse.data:
                        yield _chunk_or_error(sse.data, self._cls, self.response)
        finally:
            self.close()

    def close(self) -> None:
        """Close the response (idempotent)."""
        if not self._closed:
            self._closed = True
            try:
                self._events.close()
            finally:
                self.response.close()

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# shared request building


def _resolve(base_url: str | None, api_key: str | None, settings: Settings) -> tuple[str, SecretStr | None]:
    url = base_url or settings.base_url or os.environ.get("OPENAI_BASE_URL")
    if not url:
        raise ConfigurationError(
            "no server URL: pass base_url='http://host:8000/v1', or set ZP_BASE_URL (or OPENAI_BASE_URL)")
    key: SecretStr | None
    if api_key is not None:
        key = SecretStr(api_key)
    elif settings.api_key is not None:
        key = settings.api_key
    else:
        env = os.environ.get("OPENAI_API_KEY")
        key = SecretStr(env) if env else None
    return url.rstrip("/") + "/", key


_CHAT_PARAMS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "seed", "tools",
                "tool_choice", "response_format", "stream_options")
"""The OpenAI parameters of ``chat.completions.create``, in the order the body lists them: ``max_tokens``
(int | None), ``max_completion_tokens`` (int | None), ``temperature`` / ``top_p`` (float | None), ``n``
(int | None), ``stop`` (str | Sequence[str] | None), ``seed`` (int | None), ``tools`` (Sequence of mappings |
None), ``tool_choice``, ``response_format`` / ``stream_options`` (mapping | None)."""
_COMPLETION_PARAMS = ("max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream_options")
"""The OpenAI parameters of ``completions.create``, in body order (typed as in :data:`_CHAT_PARAMS`)."""


def _body(first: dict[str, object], named: tuple[str, ...], params: Mapping[str, object],
          stream: bool) -> dict[str, object]:
    """``first``, then the ``named`` parameters given, in that order, then the others as given, then
    ``params["extra_body"]`` (a mapping) merged in; parameters left unset are not sent."""
    body = dict(first)
    body.update((k, params[k]) for k in named if k in params)
    body.update((k, v) for k, v in params.items() if k != "extra_body" and k not in body)
    extra_body = params.get("extra_body")
    if extra_body:
        body.update(cast("Mapping[str, object]", extra_body))
    if _stream(stream):
        body["stream"] = True
    return body


def _chat_body(*, model: str, messages: Sequence[Mapping[str, object]], stream: bool,
               **params: object) -> dict[str, object]:
    """The JSON body of ``chat.completions.create`` (both clients): the named OpenAI parameters
    (:data:`_CHAT_PARAMS`) in this order, then the others, then ``extra_body`` merged in."""
    return _body({"model": model, "messages": _messages(messages)}, _CHAT_PARAMS, params, stream)


def _stream(stream: object) -> bool:
    # Not truthiness: stream="false" once asked for a stream.
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be True or False, got {stream!r:.80}", field="stream")
    return stream


def _messages(messages: object) -> list[object]:
    # A list as given; any other sequence of messages becomes one. A string or a single message object is
    # refused: list("hello") once sent ['h', 'e', ...].
    if isinstance(messages, list):
        return messages
    if isinstance(messages, (str, bytes, bytearray, Mapping)) or not isinstance(messages, Iterable):
        raise InvalidRequest(f"messages must be a list of message objects, got {type(messages).__name__}: "
                             f"{messages!r:.80}", field="messages")
    return list(messages)


def _completion_body(*, model: str, prompt: Prompt, stream: bool, **params: object) -> dict[str, object]:
    """The JSON body of ``completions.create`` (both clients), as :func:`_chat_body`."""
    return _body({"model": model, "prompt": prompt}, _COMPLETION_PARAMS, params, stream)


def _headers(stream: bool, extra_headers: Mapping[str, str] | None) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"} if stream else {}
    if extra_headers:
        headers.update(extra_headers)
    return headers


def _post_request(http: httpx.AsyncClient | httpx.Client, path: str, body: dict[str, object], stream: bool,
                  extra_headers: Mapping[str, str] | None, timeout: TimeoutArg) -> httpx.Request:
    headers = _headers(stream, extra_headers)
    if timeout is None:  # the client's own (httpx.USE_CLIENT_DEFAULT, build_request's default)
        return http.build_request("POST", path, json=body, headers=headers)
    return http.build_request("POST", path, json=body, headers=headers, timeout=timeout)


def _parse(response: httpx.Response, cls: type[T]) -> T:
    try:
        return cls.model_validate_json(response.content)
    except ValueError as exc:
        raise APIError(f"the server's answer is not a valid {cls.__name__}: {exc}",
                       body=response.content[:2000].decode("utf-8", "replace")) from exc


class _ClientKwargs(TypedDict, total=False):
    """The keyword arguments both clients give their ``httpx`` client."""

    base_url: str
    headers: dict[str, str]
    timeout: float | httpx.Timeout
    event_hooks: Mapping[str, list[Callable[..., object]]]
    follow_redirects: bool


def _client_kwargs(url: str, key: SecretStr | None, timeout: float | httpx.Timeout,
                   http_client: httpx.AsyncClient | httpx.Client | None) -> _ClientKwargs:
    headers = {"User-Agent": "zp-client"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key.get_secret_value()}"
    kwargs: _ClientKwargs = {"base_url": url, "headers": headers, "timeout": timeout}
    if http_client is not None:  # keep what the caller's client was given
        kwargs["headers"] = {**dict(http_client.headers), **headers}
        kwargs["event_hooks"] = http_client.event_hooks
        kwargs["follow_redirects"] = http_client.follow_redirects
    return kwargs


D = TypeVar("D", "AsyncAdmissionTransport", "AdmissionTransport")


def _admitted(cls: type[D], default_inner: Callable[[], object],
              http_client: httpx.AsyncClient | httpx.Client | None, budget: Budget, settings: Settings,
              options: TransportOptions) -> D:
    """The admission transport of a client: over ``http_client``'s transport (the caller owns and closes
    it; one already admitting is used as it is) or a new one of ``default_inner``."""
    if http_client is None:
        transport = cls(default_inner(), budget=budget, settings=settings, close_inner=True, **options)
    else:
        inner = http_transport(http_client)
        if isinstance(inner, cls):
            return inner
        transport = cls(inner, budget=budget, settings=settings, close_inner=False, **options)
    transport.core.convert_error = _client_error
    return transport


def _not_found(url: str) -> httpx.Response:
    return httpx.Response(404, request=httpx.Request("GET", url))


def _repr(kind: str, url: str, key: SecretStr | None) -> str:
    return f"{kind}(base_url={url!r}, api_key={'***' if key is not None else None})"


# --------------------------------------------------------------------------------------------------
# the clients' shared construction

H = TypeVar("H", httpx.AsyncClient, httpx.Client)


class _ClientBase(Generic[H]):
    """What both clients share: where to send, the key, the admission transport."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        budget: Budget,
        settings: Settings | None = None,
        timeout: float | httpx.Timeout = 600,
        http_client: H | None = None,
        **transport_options: Unpack[TransportOptions],
    ) -> None:
        self.settings = settings or Settings()
        self.budget = budget
        self._url, self._key = _resolve(base_url, api_key, self.settings)
        kwargs = _client_kwargs(self._url, self._key, timeout, http_client)
        self._setup(kwargs, http_client, transport_options)

    def _transport(self, http_client: H | None,
                   options: TransportOptions) -> httpx.AsyncBaseTransport | httpx.BaseTransport:
        raise NotImplementedError

    def _setup(self, kwargs: _ClientKwargs, http_client: H | None, options: TransportOptions) -> None:
        """Make ``self._http`` from ``kwargs`` and the admission transport over ``http_client``'s."""
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        return self._url


# --------------------------------------------------------------------------------------------------
# async client


class AsyncClient(_ClientBase[httpx.AsyncClient]):
    """OpenAI-compatible async client whose every LLM call is admitted by ``budget``.

    ``base_url`` / ``api_key`` fall back to ``Settings.base_url`` / ``api_key`` (``ZP_BASE_URL``,
    ``ZP_API_KEY``), then ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``. Without a key no ``Authorization``
    header is sent. ``http_client``: an ``httpx.AsyncClient`` whose transport (proxy, TLS, limits), headers,
    timeout and event hooks to keep; it is not modified, and its transport is wrapped for admission.
    ``transport_options`` go to :class:`~zp_client.transport.AsyncAdmissionTransport` (``estimator=``,
    ``retry=``...).
    """

    def _transport(self, http_client: httpx.AsyncClient | None,
                   options: TransportOptions) -> httpx.AsyncBaseTransport:
        from zp_client.transport import AsyncAdmissionTransport

        return _admitted(AsyncAdmissionTransport, httpx.AsyncHTTPTransport, http_client, self.budget,
                         self.settings, options)

    def _setup(self, kwargs: _ClientKwargs, http_client: httpx.AsyncClient | None,
               options: TransportOptions) -> None:
        self._http = httpx.AsyncClient(**kwargs, transport=self._transport(http_client, options))
        self.chat = _AsyncChat(self)
        self.completions = _AsyncCompletions(self)
        self.models = _AsyncModels(self)

    def __repr__(self) -> str:
        return _repr("AsyncClient", self._url, self._key)

    async def _post(self, path: str, body: dict[str, object], stream: bool,
                    extra_headers: Mapping[str, str] | None, timeout: TimeoutArg) -> httpx.Response:
        """The response of an admitted POST (an error status raises; a stream's body is not read yet)."""
        request = _post_request(self._http, path, body, stream, extra_headers, timeout)
        with _transport_errors():
            response = await self._http.send(request, stream=stream)
            if response.status_code >= 400:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                raise _status_error(response)
        return response

    async def _get(self, path: str, cls: type[T], extra_headers: Mapping[str, str] | None,
                   timeout: TimeoutArg) -> T:
        with _transport_errors():
            headers = dict(extra_headers or {})
            if timeout is None:  # the client's own
                response = await self._http.get(path, headers=headers)
            else:
                response = await self._http.get(path, headers=headers, timeout=timeout)
        if response.status_code >= 400:
            raise _status_error(response)
        return _parse(response, cls)

    async def aclose(self) -> None:
        """Close the HTTP client (and the transport this client created)."""
        await self._http.aclose()

    close = aclose

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class _AsyncChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(self, *, model: str, messages: Sequence[Mapping[str, object]],
                     stream: Literal[False] = ...,
                     extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
                     **kwargs: object) -> ChatCompletion: ...

    @overload
    async def create(self, *, model: str, messages: Sequence[Mapping[str, object]], stream: Literal[True],
                     extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
                     **kwargs: object) -> AsyncStream[ChatCompletionChunk]: ...

    async def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, object]],
        stream: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        **params: object,
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``POST chat/completions``. Returns a :class:`~zp_client.types.ChatCompletion`, or with
        ``stream=True`` an :class:`AsyncStream` of :class:`~zp_client.types.ChatCompletionChunk`.
        ``params``: the OpenAI parameters of :func:`_chat_body` (``max_tokens``, ``tools``...),
        ``extra_body``, and any other vLLM parameter; parameters left unset are not sent."""
        body = _chat_body(model=model, messages=messages, stream=stream, **params)
        response = await self._client._post("chat/completions", body, stream, extra_headers, timeout)
        return AsyncStream(response, ChatCompletionChunk) if stream else _parse(response, ChatCompletion)


class _AsyncChat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = _AsyncChatCompletions(client)


class _AsyncCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(self, *, model: str, prompt: Prompt, stream: Literal[False] = ...,
                     extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
                     **kwargs: object) -> Completion: ...

    @overload
    async def create(self, *, model: str, prompt: Prompt, stream: Literal[True],
                     extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
                     **kwargs: object) -> AsyncStream[Completion]: ...

    async def create(
        self,
        *,
        model: str,
        prompt: Prompt,
        stream: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        **params: object,
    ) -> Completion | AsyncStream[Completion]:
        """``POST completions``. Returns a :class:`~zp_client.types.Completion`, or with ``stream=True`` an
        :class:`AsyncStream` of them."""
        body = _completion_body(model=model, prompt=prompt, stream=stream, **params)
        response = await self._client._post("completions", body, stream, extra_headers, timeout)
        return AsyncStream(response, Completion) if stream else _parse(response, Completion)


class _AsyncModels:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self, *, extra_headers: Mapping[str, str] | None = None,
                   timeout: float | httpx.Timeout | None = None) -> ModelList:
        """``GET models`` (not admitted: it uses no KV cache)."""
        return await self._client._get("models", ModelList, extra_headers, timeout)

    async def retrieve(self, model: str, *, extra_headers: Mapping[str, str] | None = None,
                       timeout: float | httpx.Timeout | None = None) -> Model:
        """The card of ``model`` from ``GET models`` (raises :class:`NotFoundError` when absent)."""
        for card in (await self.list(extra_headers=extra_headers, timeout=timeout)).data:
            if card.id == model:
                return card
        raise NotFoundError(f"model {model!r} is not served here",
                            response=_not_found(self._client._url + "models"),
                            body=None)


# --------------------------------------------------------------------------------------------------
# sync client


class Client(_ClientBase[httpx.Client]):
    """The blocking counterpart of :class:`AsyncClient` (same arguments, same methods, same errors)."""

    def _transport(self, http_client: httpx.Client | None, options: TransportOptions) -> httpx.BaseTransport:
        from zp_client.transport import AdmissionTransport

        return _admitted(AdmissionTransport, httpx.HTTPTransport, http_client, self.budget, self.settings,
                         options)

    def _setup(self, kwargs: _ClientKwargs, http_client: httpx.Client | None,
               options: TransportOptions) -> None:
        self._http = httpx.Client(**kwargs, transport=self._transport(http_client, options))
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self.models = _Models(self)

    def __repr__(self) -> str:
        return _repr("Client", self._url, self._key)

    def _post(self, path: str, body: dict[str, object], stream: bool, extra_headers: Mapping[str, str] | None,
              timeout: TimeoutArg) -> httpx.Response:
        request = _post_request(self._http, path, body, stream, extra_headers, timeout)
        with _transport_errors():
            response = self._http.send(request, stream=stream)
            if response.status_code >= 400:
                try:
                    response.read()
                finally:
                    response.close()
                raise _status_error(response)
        return response

    def _get(self, path: str, cls: type[T], extra_headers: Mapping[str, str] | None,
             timeout: TimeoutArg) -> T:
        with _transport_errors():
            headers = dict(extra_headers or {})
            if timeout is None:  # the client's own
                response = self._http.get(path, headers=headers)
            else:
                response = self._http.get(path, headers=headers, timeout=timeout)
        if response.status_code >= 400:
            raise _status_error(response)
        return _parse(response, cls)

    def close(self) -> None:
        """Close the HTTP client (and the transport this client created)."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _ChatCompletions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def create(self, *, model: str, messages: Sequence[Mapping[str, object]], stream: Literal[False] = ...,
               extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
               **kwargs: object) -> ChatCompletion: ...

    @overload
    def create(self, *, model: str, messages: Sequence[Mapping[str, object]], stream: Literal[True],
               extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
               **kwargs: object) -> Stream[ChatCompletionChunk]: ...

    def create(
        self,
        *,
        model: str,
        messages: Sequence[Mapping[str, object]],
        stream: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        **params: object,
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """See :meth:`AsyncClient.chat.completions.create <_AsyncChatCompletions.create>`."""
        body = _chat_body(model=model, messages=messages, stream=stream, **params)
        response = self._client._post("chat/completions", body, stream, extra_headers, timeout)
        return Stream(response, ChatCompletionChunk) if stream else _parse(response, ChatCompletion)


class _Chat:
    def __init__(self, client: Client) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def create(self, *, model: str, prompt: Prompt, stream: Literal[False] = ...,
               extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
               **kwargs: object) -> Completion: ...

    @overload
    def create(self, *, model: str, prompt: Prompt, stream: Literal[True],
               extra_headers: Mapping[str, str] | None = ..., timeout: TimeoutArg = ...,
               **kwargs: object) -> Stream[Completion]: ...

    def create(
        self,
        *,
        model: str,
        prompt: Prompt,
        stream: bool = False,
        extra_headers: Mapping[str, str] | None = None,
        timeout: float | httpx.Timeout | None = None,
        **params: object,
    ) -> Completion | Stream[Completion]:
        """See :meth:`AsyncClient.completions.create <_AsyncCompletions.create>`."""
        body = _completion_body(model=model, prompt=prompt, stream=stream, **params)
        response = self._client._post("completions", body, stream, extra_headers, timeout)
        return Stream(response, Completion) if stream else _parse(response, Completion)


class _Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self, *, extra_headers: Mapping[str, str] | None = None,
             timeout: float | httpx.Timeout | None = None) -> ModelList:
        """``GET models`` (not admitted: it uses no KV cache)."""
        return self._client._get("models", ModelList, extra_headers, timeout)

    def retrieve(self, model: str, *, extra_headers: Mapping[str, str] | None = None,
                 timeout: float | httpx.Timeout | None = None) -> Model:
        """The card of ``model`` from ``GET models`` (raises :class:`NotFoundError` when absent)."""
        for card in self.list(extra_headers=extra_headers, timeout=timeout).data:
            if card.id == model:
                return card
        raise NotFoundError(f"model {model!r} is not served here",
                            response=_not_found(self._client._url + "models"),
                            body=None)
