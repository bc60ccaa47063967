"""An in-memory, streaming ASGI transport for httpx and httpx2: client and simulator in one event loop.

httpx's own ``ASGITransport`` (and httpx2's) collects the whole response before returning it, so a
streamed completion would reach the client at once, when it ends. :class:`MemoryTransport` hands each
``http.response.body`` message to the caller as the app sends it, so on the storm's virtual-time loop
(:mod:`zp_client.testing`) a chunk arrives at the virtual time the simulator emitted it. No socket
and no thread is involved: the loop's clock never has to wait for the outside world.

What a socket would give is kept: the request's ``timeout`` extension is honoured (``read`` bounds the
wait for the response head and for each body chunk, raising the library's ``ReadTimeout``, so
openai's default timeout and its retries behave as over TCP); closing a response early, or cancelling
the caller, is an ``http.disconnect`` for the app (the simulator aborts the request and frees its
blocks); an app that fails before its response head answers 500, and one that fails mid-body ends the
body with ``RemoteProtocolError``, as a dropped connection would.

:func:`memory_transport` picks the class for the HTTP library a client is built on (openai 2.x: httpx,
openai 3.x: httpx2; :func:`openai_http_module` tells which).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import ModuleType
from typing import Any

import httpx

__all__ = ["MemoryNetwork", "MemoryTransport", "ReadPauses"]

log = logging.getLogger("zp_client.testing")

ASGIApp = Callable[..., Awaitable[None]]

_APP_DONE = {"type": "zp.app.done"}
_RESET = {"type": "zp.connection.reset"}


class MemoryNetwork:
    """Host names -> ASGI apps, shared by every in-memory transport of a run, with abrupt kills.

    ``apps`` maps a URL host (e.g. ``sim-0.memory``) to its app. :meth:`kill` resets every open
    exchange of a host and refuses new connections to it from then on; :attr:`dead` says when."""

    def __init__(self, apps: Mapping[str, ASGIApp]) -> None:
        if not apps:
            raise ValueError("a memory network needs at least one host")
        self.apps: dict[str, ASGIApp] = dict(apps)
        self.dead: dict[str, float] = {}
        """Killed hosts -> the loop time of the kill."""
        self._open: dict[str, set[_Exchange]] = {h: set() for h in self.apps}
        self.reset_exchanges: dict[str, int] = {}
        """Killed hosts -> open exchanges (requests in flight) that the kill reset."""

    def app_for(self, host: str) -> ASGIApp | None:
        """The live app serving ``host``, or None (unknown or killed: a connect fails)."""
        if host in self.dead:
            return None
        return self.apps.get(host)

    def open_exchanges(self, host: str) -> int:
        """Requests to ``host`` whose exchange is still open."""
        return len(self._open.get(host, ()))

    def track(self, host: str, ex: _Exchange) -> None:
        opened = self._open.setdefault(host, set())
        opened.add(ex)
        ex.task.add_done_callback(lambda _t: opened.discard(ex))

    def kill(self, host: str) -> int:
        """Kill ``host`` abruptly: no drain, every open exchange reset (its app task cancelled), later
        connects refused. Returns how many exchanges were reset."""
        if host not in self.apps:
            raise KeyError(f"no host {host!r} on this memory network")
        loop = asyncio.get_running_loop()
        self.dead.setdefault(host, loop.time())
        exchanges = list(self._open.get(host, ()))
        for ex in exchanges:
            ex.reset()
        self.reset_exchanges[host] = self.reset_exchanges.get(host, 0) + len(exchanges)
        return len(exchanges)


class ReadPauses:
    """A client that reads late, on the loop's clock: out of every ``burst_s / fraction`` seconds (from
    the loop's time 0) it is busy for the last ``burst_s``, and whatever reaches it then (a response
    head, a body chunk) is handed over only when the busy part ends; the backlog then drains at once.

    The virtual-clock model of :class:`~zp_storm.loadgen.ClientLoad`, whose spinning takes no
    virtual time: it delays the client's *reads* only (sends, timers and the budget run on time), which
    is what makes its streams' growth reports late. Deterministic, like the rest of the virtual run."""

    def __init__(self, fraction: float, burst_s: float = 0.05) -> None:
        if not 0.0 < fraction < 1.0 or burst_s <= 0:
            raise ValueError(
                f"read pauses need 0 < fraction < 1 and burst_s > 0, got {fraction!r}, {burst_s!r}")
        self.fraction = float(fraction)
        self.burst_s = float(burst_s)
        self.period_s = self.burst_s / self.fraction
        self.held = 0
        """Messages handed over late so far."""
        self.lags: list[float] = []
        """How late each of them was handed over (seconds)."""

    def resume_at(self, now: float) -> float | None:
        """The end of the busy part ``now`` falls in, or None when the client is reading."""
        phase = now % self.period_s
        if phase < self.period_s - self.burst_s:
            return None
        return now - phase + self.period_s

    async def wait(self) -> None:
        """Return when the client would read what arrived now."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        end = self.resume_at(now)
        if end is None or end <= now:
            return
        self.held += 1
        self.lags.append(end - now)
        await asyncio.sleep(end - now)


class _Exchange:
    """One request/response between a caller and the app, running as a task on the caller's loop."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes) -> None:
        self._body: bytes | None = body
        self._disconnected = asyncio.Event()
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.error: BaseException | None = None
        # a fresh context: the app (the server side) does not see the caller's context variables
        loop = asyncio.get_running_loop()
        self.task = contextvars.Context().run(loop.create_task, self._run(app, scope))

    async def _run(self, app: ASGIApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._receive, self._send)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the caller as a 500 or a truncated body
            log.exception("the ASGI app failed")
            self.error = exc
        finally:
            self.messages.put_nowait(_APP_DONE)

    async def _receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        # After the body, receive() returns only when the client goes away (as uvicorn's does).
        await self._disconnected.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if not self._disconnected.is_set():
            self.messages.put_nowait(message)

    def disconnect(self) -> None:
        self._disconnected.set()

    def reset(self) -> None:
        """The connection dies under both sides: the caller reads a reset, the app task is cancelled."""
        self._disconnected.set()
        self.messages.put_nowait(_RESET)
        self.task.cancel()

    async def next(self, timeout: float | None, on_timeout: Callable[[], BaseException]) -> dict[str, Any]:
        try:
            if timeout is None:
                return await self.messages.get()
            return await asyncio.wait_for(self.messages.get(), timeout)
        except asyncio.TimeoutError:  # TimeoutError's alias from Python 3.11
            self.disconnect()
            raise on_timeout() from None
        except BaseException:
            self.disconnect()  # the caller was cancelled: the app sees the client leave
            raise


class _Body:
    """The response body: yields the app's body messages as they are sent."""

    def __init__(self, lib: ModuleType, exchange: _Exchange, request: Any,
                 read_timeout: float | None, pauses: ReadPauses | None = None) -> None:
        self._lib, self._ex, self._request, self._timeout = lib, exchange, request, read_timeout
        self._pauses = pauses
        self._ended = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while not self._ended:
            msg = await self._ex.next(self._timeout, self._read_timeout)
            if msg is _RESET:
                self._ended = True
                raise self._lib.ReadError("[Errno 104] Connection reset by peer", request=self._request)
            if msg is _APP_DONE:  # the app ended before its last body message: a truncated body
                self._ended = True
                raise self._lib.RemoteProtocolError(
                    "peer closed connection without sending complete message body", request=self._request)
            if msg.get("type") != "http.response.body":
                continue
            if chunk := msg.get("body", b""):
                if self._pauses is not None:
                    await self._pauses.wait()
                yield bytes(chunk)
            if not msg.get("more_body", False):
                self._ended = True

    def _read_timeout(self) -> BaseException:
        exc: BaseException = self._lib.ReadTimeout("timed out reading the response body",
                                                    request=self._request)
        return exc

    async def aclose(self) -> None:
        self._ended = True
        self._ex.disconnect()


class _HttpxBody(_Body, httpx.AsyncByteStream):
    """httpx's body class over :class:`_Body`."""


class _TransportBase:
    """The shared logic of :class:`MemoryTransport` and its httpx2 counterpart."""

    _lib: ModuleType
    _body_cls: type[_Body]

    def __init__(self, app: ASGIApp | MemoryNetwork, *, client: tuple[str, int] = ("127.0.0.1", 50000),
                 pauses: ReadPauses | None = None) -> None:
        self.network: MemoryNetwork | None = app if isinstance(app, MemoryNetwork) else None
        """The hosts this transport dispatches to (by the request's URL host), or None: one app."""
        self.app: ASGIApp | None = None if isinstance(app, MemoryNetwork) else app
        self.client = client
        self.pauses = pauses
        """A late reader's busy periods (:class:`ReadPauses`), or None: every message is read on arrival."""
        self.requests = 0
        """Requests handled so far."""
        self._open: set[_Exchange] = set()

    def _scope(self, request: Any) -> dict[str, Any]:
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        return {
            "type": "http",
            # 2.3: Starlette's StreamingResponse then listens for http.disconnect while it streams
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": url.scheme,
            "path": url.path,
            "raw_path": url.raw_path.split(b"?")[0],
            "root_path": "",
            "query_string": url.query,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": self.client,
            "server": (url.host, port),
            "extensions": {},
        }

    async def handle_async_request(self, request: Any) -> Any:
        lib = self._lib
        body = await request.aread()
        timeouts = request.extensions.get("timeout") or {}
        read_timeout = timeouts.get("read")
        app = self.app
        host = request.url.host
        if self.network is not None:
            app = self.network.app_for(host)
        if app is None:
            why = "killed" if self.network is not None and host in self.network.dead else "unknown host"
            raise lib.ConnectError(f"[Errno 111] Connection refused ({host}: {why})", request=request)
        self.requests += 1
        ex = _Exchange(app, self._scope(request), body)
        self._open.add(ex)
        ex.task.add_done_callback(lambda _t: self._open.discard(ex))
        if self.network is not None:
            self.network.track(host, ex)

        def head_timeout() -> BaseException:
            exc: BaseException = lib.ReadTimeout("timed out waiting for the response head", request=request)
            return exc

        while True:
            msg = await ex.next(read_timeout, head_timeout)
            if msg is _RESET:
                raise lib.RemoteProtocolError("Server disconnected without sending a response.",
                                              request=request)
            if msg is _APP_DONE:  # the app ended (or failed) before sending its head
                detail = repr(ex.error) if ex.error is not None else "no response"
                return lib.Response(500, content=f"Internal Server Error ({detail})".encode(),
                                    request=request)
            if msg.get("type") == "http.response.start":
                break
        if self.pauses is not None:
            await self.pauses.wait()
        headers = [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
        stream = self._body_cls(lib, ex, request, read_timeout, self.pauses)
        return lib.Response(int(msg["status"]), headers=headers, stream=stream,
                            extensions={"http_version": b"HTTP/1.1"}, request=request)

    async def aclose(self) -> None:
        """Tell every open exchange's app the client left; cancel those that do not end within a
        second (an app that ignores ``http.disconnect``)."""
        tasks = [ex.task for ex in self._open]
        for ex in list(self._open):
            ex.disconnect()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=1.0)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


class MemoryTransport(_TransportBase, httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` that calls an ASGI ``app`` in this event loop, streaming."""

    _lib = httpx
    _body_cls = _HttpxBody
