"""What differs between ``httpx`` and ``httpx2`` for the transports, in one place.

An :class:`HttpLib` names the module and its two response-body classes (httpx checks
``isinstance(response.stream, AsyncByteStream)``, so each library needs its own, kept tiny over the
shared :class:`AsyncBody` / :class:`SyncBody`); its methods build the requests and responses the core
hands back. See docs/admission.md.
"""

from __future__ import annotations

import json
import logging
import sys
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

import anyio
import httpx

from zp_client._admission.loop_ports import BodyObserver
from zp_client._admission.ports import (
    AsyncClosable,
    AsyncInner,
    HttpHeaders,
    HttpRequest,
    HttpResponse,
    HttpURL,
    SyncInner,
)
from zp_client._admission.release import (
    Holder,
    ReaderWatch,
    alarms,
    cut_connection,
    deadline_exceeded,
    finalize,
)
from zp_client._private import (
    detach_sdk_stream,
    has_read_body,
    patch_sdk_stream_inits,
    response_body_stream,
    sdk_stream_response,
)
from zp_client._sse import REASSEMBLY_DROPPED_HEADERS, Scanner
from zp_client.clock import SYSTEM_CLOCK
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, DeadlineExceeded

if TYPE_CHECKING:
    from zp_client._admission.actions import Prefetched
    from zp_client._admission.plan import Plan
    from zp_client.server import ServerInfo

__all__ = ["HttpLib", "HTTPX", "AsyncBody", "SyncBody", "module_of", "watch_sdk_streams"]

logger = logging.getLogger("zp_client.transport")

_METADATA_TIMEOUT = {"connect": 10.0, "read": 10.0, "write": 10.0, "pool": 10.0}
# GET /metrics is read only for the pool check (Core._pool_probe): one short read, never a long wait.
#: The pool check's bound on its one GET /metrics: per phase here, and for the whole read in the async
#: driver (the sync driver has only the per-phase bounds).
POOL_CHECK_S = 2.0
_METRICS_TIMEOUT = dict.fromkeys(("connect", "read", "write", "pool"), POOL_CHECK_S)


class _Body:
    """A response body handed to the caller: feeds its scanner, owns the lease through its holder."""

    def __init__(self, core: BodyObserver, plan: Plan, resp: HttpResponse, holder: Holder, scanner: Scanner,
                 prefetched: Prefetched | None = None) -> None:
        self._core, self._plan, self._resp, self._holder, self._scanner = core, plan, resp, holder, scanner
        self._prefetched = prefetched
        self._completed = False
        weakref.finalize(self, finalize, holder).atexit = False
        if not _sdk_watched:  # an openai client over this transport without wrap(): the same release
            _watch_loaded_sdk()

    def _end(self) -> bytes:
        """The body ended: the rest to hand over; learn from its usage."""
        tail = self._scanner.flush()
        self._completed = True
        self._core.observe(self._plan, self._scanner)
        return tail


_sdk_watched = False


def _watch_loaded_sdk() -> None:
    """:func:`watch_sdk_streams` once openai is imported (it is before any of its streams exists)."""
    global _sdk_watched
    openai_module = sys.modules.get("openai")
    if openai_module is not None:
        _sdk_watched = True
        watch_sdk_streams(openai_module)


def adopt_sdk_stream(stream: object) -> None:
    """An openai ``Stream`` / ``AsyncStream`` over a body of ours: its caller dropping it abandons the
    body at once (closes the connection, so the server aborts, then releases the lease) instead of when
    the garbage collector finds the stream's reference cycle, which it breaks (``detach_sdk_stream``).
    Streams over other bodies (a client zp does not admit) are left as they are."""
    body = response_body_stream(sdk_stream_response(stream))
    if not isinstance(body, _Body) or body._holder.done:
        return
    try:
        detach_sdk_stream(stream)
    except ConfigurationError:  # a newer openai: the garbage collector (or the watchdog) releases it
        logger.debug("cannot detach an openai stream's iterator", exc_info=True)
        return
    weakref.finalize(stream, finalize, body._holder).atexit = False


def watch_sdk_streams(openai_module: ModuleType) -> None:
    """Make every openai ``Stream`` / ``AsyncStream`` built from now on call :func:`adopt_sdk_stream`
    (once per process; a no-op for streams that zp did not admit). Idempotent."""
    patch_sdk_stream_inits(openai_module, adopt_sdk_stream)


class AsyncBody(_Body):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        # Per chunk, inline (this is the hot path): the caller is not idle while it waits for the server.
        holder, feed, mono = self._holder, self._scanner.feed, self._holder.clock.monotonic
        reader = ReaderWatch(holder)  # a reading task cancelled mid-body leaves it: released at once
        try:
            reader.follow()
            holder.waiting = True
            try:
                # the upstream stream itself unless a fleet's peek read its first chunk (no extra layer)
                upstream = cast(AsyncIterable[bytes], self._resp.stream)
                source = upstream if self._prefetched is None else self._source()
                if self._plan.deadline is not None:  # each read bounded by what is left of the deadline
                    source = _until(source, self._plan.deadline, mono)
                async for chunk in source:
                    holder.waiting = False
                    holder.last_activity = mono()
                    if out := feed(chunk):
                        yield out
                        holder.last_activity = mono()
                        reader.follow()
                    holder.waiting = True
            except DeadlineExceeded as exc:
                raise self._core.surface(exc) from exc.__cause__
            except Exception as exc:
                cut = self._core.stream_cut(holder.lease, exc)
                if cut is None:
                    raise
                raise cut from exc
            if tail := self._end():
                yield tail
        finally:
            reader.stop()
            if not self._completed:
                # Error, cancellation or an abandoned iterator: close the connection first so the
                # server aborts the request and frees its KV before the blocks return to the budget.
                with anyio.CancelScope(shield=True):
                    try:
                        await self._resp.aclose()
                    except Exception:
                        logger.debug("closing the inner response failed", exc_info=True)
                self._core.observe_seen(self._plan, self._scanner)
            await self._holder.release()

    async def _source(self) -> AsyncIterator[bytes]:
        """The body's chunks: the upstream stream, after the chunk a fleet's peek read (if any)."""
        pre, self._prefetched = self._prefetched, None
        if pre is None:
            async for chunk in cast(AsyncIterable[bytes], self._resp.stream):
                yield chunk
            return
        first, rest = pre
        if first is not None:
            yield first
            async for chunk in cast(AsyncIterable[bytes], rest):
                yield chunk

    async def aclose(self) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await self._resp.aclose()
        finally:
            self._core.observe_seen(self._plan, self._scanner)
            await self._holder.release()


class SyncBody(_Body):
    def __iter__(self) -> Iterator[bytes]:
        holder, feed, mono = self._holder, self._scanner.feed, self._holder.clock.monotonic  # as __aiter__
        try:
            holder.waiting = True
            deadline = self._plan.deadline
            # a blocking read cannot be bounded from its thread: at the deadline its connection is cut
            token = None if deadline is None else alarms.at(
                deadline - mono() + SYSTEM_CLOCK.monotonic(), lambda: cut_connection(self._resp))
            try:
                upstream = cast(Iterable[bytes], self._resp.stream)
                for chunk in (upstream if self._prefetched is None else self._source()):
                    if deadline is not None and mono() >= deadline:  # a trickle ends there too
                        raise self._core.surface(deadline_exceeded(_READING))
                    holder.waiting = False
                    holder.last_activity = mono()
                    if out := feed(chunk):
                        yield out
                        holder.last_activity = mono()
                    holder.waiting = True
            except DeadlineExceeded:
                raise
            except Exception as exc:
                if deadline is not None and deadline - mono() <= _SLACK_S:  # the cut (or a capped timeout)
                    raise self._core.surface(deadline_exceeded(_READING)) from exc
                cut = self._core.stream_cut(holder.lease, exc)
                if cut is None:
                    raise
                raise cut from exc
            if tail := self._end():
                yield tail
        finally:
            if token is not None:
                alarms.cancel(token)
            if not self._completed:  # see the async form: the server must see the disconnect first
                try:
                    self._resp.close()
                except Exception:
                    logger.debug("closing the inner response failed", exc_info=True)
                self._core.observe_seen(self._plan, self._scanner)
            self._holder.release_sync()

    def _source(self) -> Iterator[bytes]:
        """As :meth:`AsyncBody._source`."""
        pre, self._prefetched = self._prefetched, None
        if pre is None:
            yield from cast(Iterable[bytes], self._resp.stream)
            return
        first, rest = pre
        if first is not None:
            yield first
            yield from cast(Iterable[bytes], rest)

    def close(self) -> None:
        try:
            self._resp.close()
        finally:
            self._core.observe_seen(self._plan, self._scanner)
            self._holder.release_sync()


_READING = "while reading the server's answer"
_SLACK_S = 0.05  # as zp_client._admission.drivers.DEADLINE_SLACK_S


async def _until(source: AsyncIterable[bytes], deadline: float,
                 mono: Callable[[], float]) -> AsyncIterator[bytes]:
    """``source``'s chunks, each read bounded by what is left of ``deadline`` (``mono``'s time): an idle
    or trickling server ends the body with DeadlineExceeded there."""
    it = source.__aiter__()
    try:
        while True:
            with anyio.move_on_after(max(0.0, deadline - mono())) as scope:  # never around the yield
                try:
                    chunk = await it.__anext__()
                except StopAsyncIteration:
                    return
            if scope.cancelled_caught:
                raise deadline_exceeded(_READING)
            yield chunk
    finally:
        if isinstance(it, AsyncClosable):
            with anyio.CancelScope(shield=True):
                await it.aclose()


class _HttpxAsyncBody(AsyncBody, httpx.AsyncByteStream):
    """httpx's async body class over :class:`AsyncBody`."""


class _HttpxSyncBody(SyncBody, httpx.SyncByteStream):
    """httpx's blocking body class over :class:`SyncBody`."""


@dataclass(frozen=True)
class HttpLib:
    """One HTTP library (``httpx`` or ``httpx2``) as the core and the transports use it."""

    module: ModuleType
    async_body: type[AsyncBody]
    sync_body: type[SyncBody]

    def request(self, original: HttpRequest, plan: Plan, url: HttpURL | None = None) -> HttpRequest:
        """A fresh request per attempt (the caller's object is never mutated, so it can be re-sent);
        ``url``: where this attempt goes (a fleet's replica), default the caller's."""
        headers = [*plan.headers, (b"Content-Length", str(len(plan.content)).encode())]
        if url is not None and url != original.url:  # another server: its own Host header
            headers = [(b"Host", url.netloc), *((k, v) for k, v in headers if k.lower() != b"host")]
        stream = self.module.ByteStream(plan.content)
        return cast(HttpRequest, self.module.Request(original.method, original.url if url is None else url,
                                                     headers=headers, stream=stream,
                                                     extensions=original.extensions))

    @staticmethod
    def is_event_stream(resp: HttpResponse) -> bool:
        ctype = resp.headers.get("content-type", "")
        return bool(resp.status_code == 200 and ctype.startswith("text/event-stream"))

    @staticmethod
    def is_preread(resp: HttpResponse) -> bool:
        """The response arrived already read (closed, or holding its body: see ``_private.read_body``)."""
        return bool(resp.is_closed) or has_read_body(resp)

    def preread_response(self, resp: HttpResponse, content: bytes, rewritten: bool) -> HttpResponse:
        if not rewritten:
            return resp
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() != b"content-length"]
        return cast(HttpResponse, self.module.Response(resp.status_code, headers=headers, content=content,
                                                       extensions=resp.extensions))

    def streamed_response(self, resp: HttpResponse, core: BodyObserver, plan: Plan, holder: Holder,
                          scanner: Scanner, *, is_async: bool,
                          prefetched: Prefetched | None = None) -> HttpResponse:
        body_cls = self.async_body if is_async else self.sync_body
        stream = body_cls(core, plan, resp, holder, scanner, prefetched)
        headers: HttpHeaders | list[tuple[bytes, bytes]] = resp.headers
        if scanner.rewrites:
            # Bytes may be removed from the body, so a declared length would be wrong.
            headers = [(k, v) for k, v in resp.headers.raw if k.lower() != b"content-length"]
        return cast(HttpResponse, self.module.Response(resp.status_code, headers=headers, stream=stream,
                                                       extensions=resp.extensions))

    def reassembled_response(self, resp: HttpResponse, status: int,
                             payload: dict[str, object]) -> HttpResponse:
        """A consumed stream's answer as the JSON response a non-streamed call gets."""
        content = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in REASSEMBLY_DROPPED_HEADERS]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
        # The reason phrase was the stream's (an error answer has its own); the connection is gone.
        dropped = ("reason_phrase", "network_stream")
        extensions = {k: v for k, v in resp.extensions.items() if k not in dropped}
        return cast(HttpResponse, self.module.Response(status, headers=headers, content=content,
                                                       extensions=extensions))

    def new_request(self, original: HttpRequest, url: HttpURL, headers: list[tuple[bytes, bytes]],
                    stream: object) -> HttpRequest:
        """``original`` sent elsewhere: its method and extensions, these URL, headers and body stream."""
        return cast(HttpRequest, self.module.Request(original.method, url, headers=headers, stream=stream,
                                                     extensions=original.extensions))

    def server_info(self, inner: AsyncInner | SyncInner, base: str, root: str, auth: dict[str, str],
                    settings: Settings) -> ServerInfo:
        """A :class:`~zp_client.server.ServerInfo` fetching through ``inner`` (no admission)."""
        from zp_client.server import ServerInfo

        auth = dict(auth)
        module = self.module

        def build(method: str, path: str, payload: object) -> HttpRequest:
            # Metadata calls bypass admission; bounded so a silent server cannot hang the first request.
            url = root + path if path.startswith("/") else base.rstrip("/") + "/" + path
            metrics = path == "/metrics"
            kw: dict[str, object] = {
                "headers": {**auth, "accept": "text/plain" if metrics else "application/json"},
                "extensions": {"timeout": dict(_METRICS_TIMEOUT if metrics else _METADATA_TIMEOUT)},
            }
            if payload is not None:
                kw["json"] = payload
            return cast(HttpRequest, module.Request(method, url, **kw))

        async def fetch(method: str, path: str, payload: object = None) -> tuple[int, bytes]:
            if not isinstance(inner, AsyncInner):
                raise TypeError(f"{type(inner).__name__} is not an async transport")
            resp = await inner.handle_async_request(build(method, path, payload))
            try:
                return resp.status_code, await resp.aread()
            finally:
                await resp.aclose()

        def fetch_sync(method: str, path: str, payload: object = None) -> tuple[int, bytes]:
            if not isinstance(inner, SyncInner):
                raise TypeError(f"{type(inner).__name__} is not a blocking transport")
            resp = inner.handle_request(build(method, path, payload))
            try:
                return resp.status_code, resp.read()
            finally:
                resp.close()

        return ServerInfo(fetch=fetch, fetch_sync=fetch_sync, settings=settings)


HTTPX = HttpLib(httpx, _HttpxAsyncBody, _HttpxSyncBody)


def module_of(obj: object) -> ModuleType:
    """``httpx`` or ``httpx2``, whichever ``obj`` (a transport or client) is an instance of.

    By ``isinstance`` against each loaded library's base classes, not by ``__module__``: openai re-exports
    ``BaseTransport`` and rewrites its ``__module__`` to ``"openai"``, so a user's transport class would
    not be placed. ``httpx2`` is only looked up when already imported (an object of it implies that).
    """
    for name in ("httpx", "httpx2"):
        mod = sys.modules.get(name)
        if mod is not None and isinstance(
                obj, (mod.AsyncBaseTransport, mod.BaseTransport, mod.AsyncClient, mod.Client)):
            return mod
    raise ConfigurationError(
        f"cannot tell whether {type(obj).__name__} belongs to httpx or httpx2; pass an httpx or httpx2 "
        "transport (or use transport_classes(module) directly)"
    )
