"""One retry loop: a call zp already gave up on is not sent again when something above zp retries it.

zp's attempt loop (:mod:`zp_client._admission`) is meant to be the only retry loop. Two kinds of retry still
arrive at the transport from above it:

* the openai SDK's own (its ``max_retries``, which LiteLLM sets back to 2 on every call). The SDK sends
  ``x-stainless-retry-count: N`` on every attempt (N > 0 on a retry). It obeys ``x-should-retry: false``
  on an error answer, which zp sets on every error answer it hands over (see :func:`one_loop`), but it
  also retries when the transport *raises* (a connection error or timeout after zp's attempts);
* agent frameworks' (LangGraph ``RetryPolicy``, LiteLLM ``num_retries``, CrewAI's loop, LlamaIndex's
  tenacity): fresh SDK calls, ``x-stainless-retry-count: 0``, no idempotency key.

Both are recognised the same way. A call's **fingerprint** hashes the transport's core, the method, the
URL, zp's own ``X-ZP-*`` headers (another priority, deadline or target is another call) and the body as
the caller sent it. Its **logical-call key** is a token in a
:class:`~contextvars.ContextVar` naming the last call of this context that zp gave up on (or, when the
request carries ``X-ZP-Call``, that header's value: an adapter's own key for a framework that runs each
attempt in a fresh copy of its context, see below). A call whose key names a failure with the same
fingerprint that ended at most ``Settings.repeat_window_s`` ago (default 60 s; 0 turns this off) is a
repeat: it gets that failure again (a copy of the same exception, or the same error answer with
``x-zp-repeat`` added), with no lease and no upstream attempt. A call that succeeds clears its context's
key. Nothing else changes: only a retry-enabled transport (a retry policy, the default) does this.

Why a context variable, and what its copy semantics give:

* a retry loop runs its attempts in the context of the call it retries (the same asyncio task or
  thread: the openai SDK, LiteLLM, tenacity, CrewAI): every attempt sees the token the failed one set;
* an asyncio task (and ``contextvars.copy_context().run``, ``asyncio.to_thread``) starts from a *copy* of
  its creator's context: a token set inside it never reaches its creator nor its siblings, so two
  identical calls made concurrently by different tasks stay independent, and so do threads (each starts
  with its own context);
* a task created *after* a failure in its creator's context inherits the token: a repeat of that call
  from there is a repeat;
* a framework that runs each *call* in a task or context copy of its own (LangChain's ``agenerate``
  gathers one task per prompt, AutoGen's ``create`` one task per request) records the failure where its
  caller never looks: its adapter calls :func:`call_scope` at its entry point, in the caller's context,
  which puts a shared, mutable scope there that the copies record into (langchain-zp and autogen-zp do);
  in a shared scope a call is a repeat only if it started after the identical call failed;
* a framework that runs each *attempt* in a fresh copy of a context taken *before* the first attempt
  (LangGraph's node runner does) gives each attempt a clean context: its attempts are not recognised by
  the context key; an adapter passes ``X-ZP-Call`` (e.g. the framework's task id) for them.

Memory is bounded: at most :data:`CAP` failures are remembered process-wide (oldest dropped first), each
for its window only (expired ones are dropped as new ones arrive or when looked up); a remembered failure
holds the exception (traceback dropped) or an error answer of at most :data:`MAX_ANSWER_BYTES` (a larger
one is handed over but not remembered). The context variables hold an integer token and, in a
:func:`call_scope`, a map of at most :data:`SCOPE_CAP` fingerprints to tokens.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, cast

from zp_client._admission.actions import ReadAll
from zp_client._private import has_read_body
from zp_client.clock import Clock

if TYPE_CHECKING:
    from zp_client._admission.actions import Steps
    from zp_client._admission.ports import HttpRequest, HttpResponse, Metrics
    from zp_client.config import Settings


class _Lib(Protocol):
    @property
    def module(self) -> ModuleType: ...


class Core(Protocol):
    """What the repeat guard reads of the admission core (:class:`zp_client._admission.core.Core`)."""

    @property
    def clock(self) -> Clock: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def retry(self) -> object: ...

    @property
    def metrics(self) -> Metrics | None: ...

    @property
    def lib(self) -> _Lib: ...

__all__ = ["CAP", "SCOPE_CAP", "MAX_ANSWER_BYTES", "CALL_HEADER", "RETRY_COUNT_HEADER", "call_key",
           "call_scope", "one_loop",
           "remembered"]

logger = logging.getLogger("zp_client.transport")

CAP = 4096
"""Most failures remembered at once, process-wide."""
MAX_ANSWER_BYTES = 64 * 1024
"""Largest error answer remembered for a repeat (error bodies are small JSON)."""
CALL_HEADER = "x-zp-call"
"""An explicit logical-call key (stripped before the request is sent)."""
RETRY_COUNT_HEADER = "x-stainless-retry-count"
"""What the openai SDK sends on every attempt: 0 on the first, N on its N-th retry."""
# the body handed over is the decoded whole: its framing headers are recomputed; zp's verdict replaces any
_DROPPED = frozenset({b"content-length", b"content-encoding", b"transfer-encoding", b"x-should-retry"})

_last_failed: ContextVar[int | None] = ContextVar("zp_client_last_failed_call", default=None)
_tokens = itertools.count(1)
SCOPE_CAP = 256
"""Most failed calls one scope keeps track of (the oldest is forgotten first)."""


class _Scope:
    """One caller's failed calls, by fingerprint: shared by every context copied from the one that entered
    it (see :func:`call_scope`), so a failure recorded in a task a framework spawned for one call is seen
    by that caller's next call."""

    __slots__ = ("failed", "lock")

    def __init__(self) -> None:
        self.failed: OrderedDict[bytes, int] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, fp: bytes) -> int | None:
        with self.lock:
            return self.failed.get(fp)

    def put(self, fp: bytes, key: int) -> None:
        with self.lock:
            self.failed.pop(fp, None)
            self.failed[fp] = key
            while len(self.failed) > SCOPE_CAP:
                self.failed.popitem(last=False)

    def drop(self, fp: bytes) -> None:
        with self.lock:
            self.failed.pop(fp, None)


_scope: ContextVar[_Scope | None] = ContextVar("zp_client_call_scope", default=None)
_call_key: ContextVar[str | None] = ContextVar("zp_client_call_key", default=None)


@contextmanager
def call_key(key: str | None) -> Iterator[None]:
    """Calls made inside carry ``key`` as their logical-call key, as if each request had ``X-ZP-Call:
    key`` (a request's own header wins; None leaves the key as it is). For an adapter whose framework runs
    each *attempt* in a fresh copy of a context taken before the first one (LangGraph's ``RetryPolicy``)
    or whose retries start from a context where the failure was never recorded (CrewAI's agent loop): it
    passes something stable across those attempts (LangGraph's task id, CrewAI's agent and task). Two
    calls with one key are still two calls unless their fingerprints match and one started after the
    other failed."""
    if key is None:
        yield
        return
    token = _call_key.set(key)
    try:
        yield
    finally:
        _call_key.reset(token)


def call_scope() -> None:
    """Make the current context one caller's scope, if it is not in one yet (it stays for the rest of the
    context: the task or thread). A framework adapter calls it at its entry point, in its caller's context,
    when the framework runs each call in a task (or context copy) of its own: a failure recorded in that
    task is then seen by the caller's next identical call, its retry. Contexts copied from here share the
    scope, so two identical calls are still independent while both are in flight (only a call that starts
    after an identical one failed repeats it)."""
    if _scope.get() is None:
        _scope.set(_Scope())


@dataclass(frozen=True)
class _Failure:
    """A call zp gave up on: what a repeat of it gets."""

    fingerprint: bytes
    ended: float
    window_s: float
    clock: Clock
    error: BaseException | None
    answer: tuple[int, list[tuple[bytes, bytes]], bytes] | None

    def alive(self) -> bool:
        return self.clock.monotonic() - self.ended <= self.window_s


class _Registry:
    """The remembered failures, by key, oldest first; at most :data:`CAP`."""

    def __init__(self, cap: int = CAP) -> None:
        self._cap = cap
        self._items: OrderedDict[Hashable, _Failure] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> _Failure | None:
        with self._lock:
            f = self._items.get(key)
            if f is not None and not f.alive():
                del self._items[key]
                return None
            return f

    def put(self, key: Hashable, failure: _Failure) -> None:
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = failure
            # the oldest first: drop what expired, then whatever exceeds the cap
            while self._items:
                k, f = next(iter(self._items.items()))
                if len(self._items) <= self._cap and f.alive():
                    break
                del self._items[k]

    def drop(self, key: Hashable) -> None:
        with self._lock:
            self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


_registry = _Registry()


def remembered() -> int:
    """How many failures are remembered now (for tests and diagnostics)."""
    return len(_registry)


# Each core's serial number: never reused, where id() is (a core collected and a new one made at the same
# address, with the same URL and body, would have been taken for the same client: a false repeat).
_serials: weakref.WeakKeyDictionary[Core, int] = weakref.WeakKeyDictionary()
_next_serial = itertools.count(1)
_serials_lock = threading.Lock()


def _serial(core: Core) -> int:
    with _serials_lock:
        n = _serials.get(core)
        if n is None:
            n = _serials[core] = next(_next_serial)
        return n


def _fingerprint(core: Core, request: HttpRequest) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(str(_serial(core)).encode())
    h.update(b"\0" + request.method.encode() + b"\0" + str(request.url).encode() + b"\0")
    # zp's own headers (priority, deadline, targets, route, session) make another call of the same body
    for k, v in sorted((k.lower(), v) for k, v in request.headers.raw if k.lower().startswith(b"x-zp-")):
        h.update(k + b"=" + v + b"\0")
    h.update(request.content)
    return h.digest()


def _copy(exc: BaseException) -> BaseException:
    """A fresh instance of a remembered error (same type, arguments and attributes), so each repeat raises
    its own object with its own traceback."""
    cls = type(exc)
    try:
        new = cls.__new__(cls, *exc.args)
        new.__dict__.update(exc.__dict__)
    except Exception:  # noqa: BLE001 - an exotic exception class: the same object, traceback cleared
        return exc.with_traceback(None)
    new.__cause__ = exc.__cause__
    new.__context__ = exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    return new


class _Guard:
    """One admitted call's view of the mechanism."""

    __slots__ = ("fp", "key", "explicit", "sdk_retry", "core", "scope", "started")

    def __init__(self, core: Core, request: HttpRequest) -> None:
        self.core = core
        self.fp = _fingerprint(core, request)
        self.started = core.clock.monotonic()
        explicit = request.headers.get(CALL_HEADER) or _call_key.get()
        self.explicit = bool(explicit)
        self.scope = None if explicit else _scope.get()
        key: Hashable | None = ("call", _serial(core), explicit) if explicit else None
        if key is None and self.scope is not None:
            key = self.scope.get(self.fp)
        self.key = key if key is not None else _last_failed.get()
        try:
            self.sdk_retry = int(request.headers.get(RETRY_COUNT_HEADER, "0")) > 0
        except ValueError:
            self.sdk_retry = False

    def repeat_of(self) -> _Failure | None:
        if self.key is None:
            return None
        f = _registry.get(self.key)
        # a call already in flight when an identical one failed is its own (concurrent siblings)
        return f if f is not None and f.fingerprint == self.fp and f.ended <= self.started else None

    def failed(self, error: BaseException | None,
               answer: tuple[int, list[tuple[bytes, bytes]], bytes] | None) -> None:
        core = self.core
        if error is not None:
            error = _copy(error).with_traceback(None)  # the caller keeps its own; frames are not kept alive
        key: Hashable = self.key if self.explicit and self.key is not None else next(_tokens)
        _registry.put(key, _Failure(self.fp, core.clock.monotonic(), core.settings.repeat_window_s,
                                    core.clock, error, answer))
        if not self.explicit:
            assert isinstance(key, int)
            _last_failed.set(key)
            if self.scope is not None:
                self.scope.put(self.fp, key)

    def succeeded(self) -> None:
        if self.scope is not None:
            self.scope.drop(self.fp)
        if self.key is None:
            return
        if self.explicit:
            _registry.drop(self.key)
        else:
            _last_failed.set(None)


def _repeat_answer(core: Core, f: _Failure, status: int, headers: list[tuple[bytes, bytes]],
                   content: bytes) -> HttpResponse:
    ago = core.clock.monotonic() - f.ended
    return _answer(core, status, [*headers, (b"x-zp-repeat", f"{ago:.3f}".encode())], content, {})


def _failed_status(core: Core, status: int) -> bool:
    """An answer zp's retry policy gave up on (or would retry): what a repeat would only get again."""
    statuses = getattr(core.retry, "retry_statuses", None) or frozenset({429})
    return status >= 500 or status in statuses


def one_loop(core: Core, request: HttpRequest, steps: Steps) -> Steps:
    """``steps`` (one admitted call's attempt loop) as the one retry loop: a repeat of a call zp gave up
    on gets its failure again without running ``steps``; every error answer handed over says
    ``x-should-retry: false`` (read here in full: error answers are small) so the openai SDK does not
    retry it; a call that fails is remembered for its repeats."""
    guard = _Guard(core, request)
    hit = guard.repeat_of()
    if hit is not None:
        who = "the openai SDK's retry" if guard.sdk_retry else "a repeat"
        logger.info("%s of a call zp gave up on %.3f s ago: its failure again, nothing sent "
                    "(Settings.repeat_window_s)", who, core.clock.monotonic() - hit.ended)
        if core.metrics is not None:
            core.metrics.repeated(hit.error, hit.answer[0] if hit.answer is not None else None)
        if hit.error is not None:
            raise _copy(hit.error)
        assert hit.answer is not None
        return _repeat_answer(core, hit, *hit.answer)
    try:
        resp = yield from steps
    except Exception as exc:  # cancellation (BaseException) is not a verdict: not remembered
        guard.failed(exc, None)
        raise
    status = resp.status_code
    if status < 400:
        guard.succeeded()
        return resp
    if has_read_body(resp):
        content = resp.content
    elif resp.is_closed:  # closed unread: nothing to hand over again, nor to remember
        return resp
    else:
        chunks: list[bytes] = []
        yield ReadAll(resp, chunks.append)  # the body wrapper releases the lease at its end
        content = b"".join(chunks)
    headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in _DROPPED]
    headers.append((b"x-should-retry", b"false"))
    if _failed_status(core, status) and len(content) <= MAX_ANSWER_BYTES:
        guard.failed(None, (status, headers, content))
    else:
        guard.succeeded()  # a verdict about the request itself (4xx): sent again if asked again
    extensions = {k: v for k, v in resp.extensions.items() if k != "network_stream"}  # the body was read
    return _answer(core, status, headers, content, extensions)


def _answer(core: Core, status: int, headers: list[tuple[bytes, bytes]], content: bytes,
            extensions: dict[str, object]) -> HttpResponse:
    """An error answer handed over from bytes already read. Built on a byte *stream*, not ``content=``: a
    response made from ``content`` counts as already streamed, so a caller reading it raw (``aiter_raw``,
    ``iter_raw``) would get ``StreamConsumed``."""
    mod = core.lib.module
    return cast("HttpResponse", mod.Response(status, headers=headers, stream=mod.ByteStream(content),
                                             extensions=extensions))
