"""Golden-trace recording for the admission transport (tests/admission/test_golden_traces.py).

One trace per logical request: every budget call (acquire, lease reports, release), every request the
inner (upstream) transport saw and every close of an upstream body, and what the caller finally got, in
the order they happened. Everything is normalised so two runs of one scenario give the same JSON: lease
and ticket ids become ordinals, headers are filtered to the meaningful ones, timeouts become "set"/None.
Only public entry points are used (``transport_classes``, ``zp_client.wrap``, ``zp_client.AsyncClient``,
``Budget`` / ``Lease``), so the traces survive a refactor of the transport's internals.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from zp_client.budget.base import Budget, BudgetStatus, Lease, Ticket
from zp_client.budget.local import LocalBudget

GOLDEN_DIR = Path(__file__).parent / "golden"
RECORD = os.environ.get("ZP_GOLDEN_RECORD") == "1"

# Request headers that are HTTP-library noise (they differ between httpx and httpx2 or openai versions
# and zp neither adds nor strips them). Everything else is kept: content-type, authorization, x-zp-*.
_NOISE_HEADERS = {"host", "user-agent", "content-length", "accept-encoding", "connection", "accept"}


def _keep_header(name: str) -> bool:
    name = name.lower()
    if name in _NOISE_HEADERS:
        return False
    # openai's platform / version headers differ between SDK versions; its retry counter is kept.
    return not (name.startswith("x-stainless-") and name != "x-stainless-retry-count")


def _norm(value: Any) -> Any:
    """JSON-safe and stable: floats rounded, tuples as lists, mappings with sorted keys."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, Mapping):
        return {str(k): _norm(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


class Trace:
    """The ordered events of one scenario, with ids normalised to ordinals."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._tickets: dict[Ticket, int] = {}
        self._leases = 0

    def add(self, kind: str, **fields: Any) -> None:
        self.events.append({"event": kind, **_norm(fields)})

    def ticket(self, ticket: Ticket | None) -> int | None:
        if ticket is None:
            return None
        if ticket not in self._tickets:
            self._tickets[ticket] = len(self._tickets) + 1
        return self._tickets[ticket]

    def next_lease(self) -> int:
        self._leases += 1
        return self._leases


# --------------------------------------------------------------------------------------------------
# The budget: a real LocalBudget behind a recording wrapper
# --------------------------------------------------------------------------------------------------


class RecordingLease(Lease):
    """Delegates to the real lease and records every call the transport makes on it."""

    def __init__(self, inner: Lease, trace: Trace, ordinal: int) -> None:
        self._inner, self._trace, self._n = inner, trace, ordinal
        self.id, self.bound, self.priority, self.ticket = inner.id, inner.bound, inner.priority, inner.ticket
        self._released = False

    @property
    def held(self) -> int:
        return self._inner.held

    @property
    def released(self) -> bool:
        return self._inner.released

    def report_held(self, blocks: int) -> None:
        self._trace.add("report_held", lease=self._n, blocks=blocks)
        self._inner.report_held(blocks)

    def update_meta(self, **fields: Any) -> None:
        self._trace.add("update_meta", lease=self._n, fields=fields)
        self._inner.update_meta(**fields)

    def report_progress(self, held: int | None = None, **fields: Any) -> None:
        self._trace.add("report_progress", lease=self._n, held=held, fields=fields)
        self._inner.report_progress(held, **fields)

    def _record_release(self) -> None:
        # Release is idempotent; the trace shows the first one (when the blocks went back).
        if not self._released:
            self._released = True
            self._trace.add("release", lease=self._n)

    async def release(self) -> None:
        self._record_release()
        await self._inner.release()

    def release_sync(self) -> None:
        self._record_release()
        self._inner.release_sync()


class RecordingBudget(Budget):
    """A real :class:`LocalBudget` (strict or elastic) whose acquires and leases are recorded."""

    def __init__(self, trace: Trace, limit: int = 1000, policy: str = "strict") -> None:
        self.real = LocalBudget(limit_blocks=limit, block_size=16, policy=policy)
        self.block_size = self.real.block_size
        self._trace = trace

    @property
    def limit(self) -> int:
        return self.real.limit

    @property
    def policy_name(self) -> str:
        return self.real.policy_name

    def _record(
        self,
        blocks: int,
        priority: int,
        timeout: float | None,
        ticket: Ticket | None,
        held: int | None,
        meta: Mapping[str, Any] | None,
        flavour: str,
    ) -> None:
        self._trace.add(
            "acquire",
            flavour=flavour,
            blocks=blocks,
            priority=priority,
            timeout=None if timeout is None else "set",
            ticket=self._trace.ticket(ticket),
            held=held,
            meta=dict(meta) if meta is not None else None,
        )

    def _granted(self, lease: Lease) -> Lease:
        n = self._trace.next_lease()
        self._trace.add("granted", lease=n, bound=lease.bound, ticket=self._trace.ticket(lease.ticket))
        return RecordingLease(lease, self._trace, n)

    def _refused(self, exc: BaseException) -> None:
        self._trace.add("acquire_failed", error=type(exc).__name__)

    async def acquire(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Lease:
        self._record(blocks, priority, timeout, ticket, held, meta, "async")
        try:
            lease = await self.real.acquire(
                blocks, priority=priority, timeout=timeout, ticket=ticket, held=held, meta=meta
            )
        except Exception as exc:
            self._refused(exc)
            raise
        return self._granted(lease)

    def acquire_sync(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Lease:
        self._record(blocks, priority, timeout, ticket, held, meta, "sync")
        try:
            lease = self.real.acquire_sync(
                blocks, priority=priority, timeout=timeout, ticket=ticket, held=held, meta=meta
            )
        except Exception as exc:
            self._refused(exc)
            raise
        return self._granted(lease)

    async def status(self) -> BudgetStatus:
        return await self.real.status()

    async def set_limit(self, limit: int) -> None:
        await self.real.set_limit(limit)


# --------------------------------------------------------------------------------------------------
# The upstream: an inner transport of httpx or httpx2 that answers from a script
# --------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One upstream answer: ``chunks`` are sent one by one; ``error`` (an exception class name of the HTTP
    module, e.g. ``"ConnectError"``) is raised before anything is sent when ``chunks`` is None, else after
    the chunks (a cut connection)."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] | None = None
    error: str | None = None
    preread: bool = False  # a response whose body is already in memory (httpx.MockTransport style)


def json_reply(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None, chunked: bool = True
) -> Reply:
    data = json.dumps(body).encode()
    return Reply(status, {"content-type": "application/json", **(headers or {})}, [data], preread=not chunked)


def sse_reply(
    events: list[Any], done: bool = True, error: str | None = None, headers: Mapping[str, str] | None = None
) -> Reply:
    chunks = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    if done:
        chunks.append(b"data: [DONE]\n\n")
    return Reply(200, {"content-type": "text/event-stream", **(headers or {})}, chunks, error=error)


Handler = Callable[[str, str, Any, int], Reply]
"""(method, path, parsed JSON body or None, how many requests this path saw before) -> Reply."""


def upstream_transport(mod: ModuleType, trace: Trace, handler: Handler, is_async: bool) -> Any:
    """An inner transport of ``mod`` (async or sync) that records requests and answers with ``handler``."""

    def record(request: Any, body: bytes) -> Reply:
        path = request.url.path
        counts = trace.__dict__.setdefault("_path_counts", {})
        seen = counts.get(path, 0)
        counts[path] = seen + 1
        parsed = json.loads(body) if body else None
        headers = {k.lower(): v for k, v in request.headers.items() if _keep_header(k)}
        trace.add(
            "upstream_request",
            method=request.method,
            path=path,
            query=str(request.url.query or ""),
            headers=headers,
            json=parsed,
        )
        return handler(request.method, path, parsed, seen)

    def fail(reply: Reply, request: Any) -> BaseException:
        assert reply.error is not None
        exc: BaseException = getattr(mod, reply.error)(f"scripted {reply.error}", request=request)
        return exc

    class AsyncBody(mod.AsyncByteStream):  # type: ignore[name-defined,misc]  # mod: httpx or httpx2, at run time
        def __init__(self, reply: Reply, request: Any) -> None:
            self._reply, self._request, self._closed = reply, request, False

        async def __aiter__(self) -> AsyncIterator[bytes]:
            for chunk in self._reply.chunks or ():
                yield chunk
            if self._reply.error is not None:
                raise fail(self._reply, self._request)

        async def aclose(self) -> None:
            if not self._closed:
                self._closed = True
                trace.add("upstream_close")

    class SyncBody(mod.SyncByteStream):  # type: ignore[name-defined,misc]  # mod: httpx or httpx2, at run time
        def __init__(self, reply: Reply, request: Any) -> None:
            self._reply, self._request, self._closed = reply, request, False

        def __iter__(self) -> Iterator[bytes]:
            yield from self._reply.chunks or ()
            if self._reply.error is not None:
                raise fail(self._reply, self._request)

        def close(self) -> None:
            if not self._closed:
                self._closed = True
                trace.add("upstream_close")

    def respond(reply: Reply, request: Any, body_cls: type) -> Any:
        if reply.chunks is None:
            raise fail(reply, request)
        if reply.preread:
            return mod.Response(reply.status, headers=reply.headers, content=b"".join(reply.chunks))
        return mod.Response(reply.status, headers=reply.headers, stream=body_cls(reply, request))

    class AsyncUpstream(mod.AsyncBaseTransport):  # type: ignore[name-defined,misc]  # mod: httpx or httpx2, at run time
        async def handle_async_request(self, request: Any) -> Any:
            return respond(record(request, await request.aread()), request, AsyncBody)

    class SyncUpstream(mod.BaseTransport):  # type: ignore[name-defined,misc]  # mod: httpx or httpx2, at run time
        def handle_request(self, request: Any) -> Any:
            return respond(record(request, request.read()), request, SyncBody)

    return AsyncUpstream() if is_async else SyncUpstream()


def error_name(exc: BaseException) -> str:
    """``package.ClassName``: which library raised (httpx / httpx2 / openai / zp_client) and what."""
    return f"{type(exc).__module__.split('.')[0]}.{type(exc).__name__}"


# --------------------------------------------------------------------------------------------------
# Stored traces
# --------------------------------------------------------------------------------------------------


def golden_path(group: str, lib: str) -> Path:
    return GOLDEN_DIR / f"{group}_{lib}.json"


def _line(event: Any) -> str:
    """One event as one line of JSON, its kind first."""
    if isinstance(event, dict) and "event" in event:
        event = {"event": event["event"], **{k: event[k] for k in sorted(event) if k != "event"}}
    return json.dumps(event, ensure_ascii=False)


def _diff(old: list[str], new: list[str]) -> list[str]:
    """A unified diff of event lines (no autojunk: a stream repeats many identical ``read`` lines)."""
    out = ["--- golden", "+++ now"]
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for group in matcher.get_grouped_opcodes(3):
        (_, i1, _, j1, _), (_, i2, _, j2, _) = group[0], group[-1]
        out.append(f"@@ event {i1 + 1}-{i2} (golden) / {j1 + 1}-{j2} (now) @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in old[a1:a2]]
                continue
            out += ["-" + line for line in old[a1:a2]]
            out += ["+" + line for line in new[b1:b2]]
    return out


def write(path: Path, traces: Mapping[str, list[Any]]) -> None:
    """One event per line, so a changed behaviour reads as a few changed lines in ``git diff``."""
    parts = []
    for name in sorted(traces):
        events = ",\n".join("  " + _line(e) for e in traces[name])
        parts.append(f" {json.dumps(name)}: [\n{events}\n ]")
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n", encoding="utf-8")


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def check(path: Path, name: str, events: list[dict[str, Any]]) -> None:
    """Record (``ZP_GOLDEN_RECORD=1``) or compare ``events`` with the stored trace ``name`` of ``path``."""
    fresh = json.loads(json.dumps(events))  # what a round trip through the file gives
    if RECORD:
        GOLDEN_DIR.mkdir(exist_ok=True)
        stored = load(path)
        stored[name] = fresh
        write(path, stored)
        return
    stored = load(path)
    if name not in stored:
        raise AssertionError(
            f"no golden trace {name!r} in {path.name}; record with ZP_GOLDEN_RECORD=1 python -m pytest "
            "tests/admission/test_golden_traces.py (on the commit whose behaviour is the reference)"
        )
    if stored[name] != fresh:
        old = [_line(e) for e in stored[name]]
        new = [_line(e) for e in fresh]
        diff = "\n".join(_diff(old, new))
        raise AssertionError(f"trace {name!r} differs from {path.name}:\n{diff}")
