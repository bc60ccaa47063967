"""Admission as an HTTP transport: the one hook every OpenAI front end shares.

:class:`AsyncAdmissionTransport` and :class:`AdmissionTransport` wrap any inner ``httpx`` transport;
:class:`AsyncAdmissionTransport2` and :class:`AdmissionTransport2` do the same for ``httpx2`` (the HTTP
library openai 3.x is built on). Both pairs are built from one generic core by :func:`transport_classes`,
so the behaviour is identical; :func:`admission_transport_for` picks the right class from the inner
transport's type. Each class subclasses its module's ``BaseTransport`` / ``AsyncBaseTransport``, so it
plugs into ``httpx.AsyncClient(transport=...)`` or ``httpx2.Client(transport=...)``.

What callers may rely on:

- Only LLM calls are admitted: ``POST`` to a path ending in ``/chat/completions``, ``/completions`` or
  ``/responses``. Every other request goes to the inner transport untouched.
- Before an admitted request is sent, its KV bound is computed as
  ``ceil(min(prompt + max_tokens, max_model_len) / block_size) x n`` (prompt = the estimator's calibrated
  reservation) and a lease of that many blocks is taken from the budget. A request without
  ``max_tokens`` / ``max_completion_tokens`` (``max_output_tokens`` for ``/responses``) gets
  ``Settings.default_max_tokens`` inserted into the body sent, so the bound is true (logged once).
  ``max_model_len`` comes from ``Settings.max_model_len`` or, lazily, from the server's ``/v1/models``
  (cached). A prompt longer than ``max_model_len`` raises :class:`~zp_client.PromptTooLong` and nothing
  is sent.
- The lease is released when the response body closes: end of a plain body, end of a stream, a read
  error, caller cancellation, ``close()``, a stream the caller abandons (garbage collection), or a body
  the caller has not asked to read for ``Settings.idle_stream_timeout_s`` (watchdog thread; time the
  caller spends waiting for a slow server does not count). Whenever the body did not finish, the
  connection is closed BEFORE the lease is released, so the server aborts the request and frees its KV
  (a caller reading on after the watchdog fired gets the HTTP library's read error). A response that
  arrives already read releases at once.
- While a stream advances, the lease's occupancy is reported with ``lease.report_held`` every 4 blocks
  under strict, at every new block under elastic (counted from SSE ``data:`` events, about one token
  each, or read from vLLM's continuous usage, below). At the end, the response's ``usage`` (when
  present) calibrates the estimator.
- For streams, ``stream_options.include_usage`` is added to the request so usage is known; when the
  caller did not ask for it, the usage-only chunk is removed from the stream the caller reads, so the
  caller sees exactly the bytes the server would have sent without zp (vLLM does not put ``"usage":null``
  in ordinary chunks, so nothing else differs). The request body is the only change on the wire; for a
  non-streamed call that change makes the answer travel as a stream (next item).
- Non-streamed calls are streamed upstream (``Settings.stream_upstream``, default on; per transport
  ``stream_upstream=``): a ``/chat/completions`` or ``/completions`` body without ``"stream": true`` is
  sent with ``"stream": true`` and ``stream_options.include_usage``, the whole stream is read inside the
  transport (growth reported as for any stream, the lease released at its end) and the caller gets the
  JSON answer the server would have sent: status 200, ``content-type: application/json``, the other
  upstream headers, the body rebuilt from the chunks (texts concatenated, tool calls and choices merged
  by ``index``, ``finish_reason`` and ``usage`` as sent, ``tool_calls`` always a list as vLLM answers;
  ``id`` / ``created`` are the stream's). Bytes flow while the answer is generated, so a proxy's idle
  timeout does not cut a long generation. Not done for bodies asking for ``logprobs`` /
  ``top_logprobs`` / ``prompt_logprobs`` / ``echo`` / beam search / ``best_of > n`` (sent as they are),
  nor is an answer that is not a 200 event stream touched (an error status comes back as sent). A
  mid-stream error event becomes that error's answer (status = its ``code`` when 400-599, else 500;
  body ``{"error": {...}}``) and goes through the retry decision like any error status; a stream that
  ends without ``[DONE]`` raises the HTTP library's ``RemoteProtocolError``, a broken connection its
  read error, as a cut non-streamed read would. Cancellation while the stream is read closes the
  connection before the lease is released.
- Per-call options: header ``X-ZP-Priority`` (int, lower = earlier) sets the queue priority; without it a
  body ``priority`` field (vLLM's) is used and left in the body. Header ``X-ZP-Deadline`` (seconds) or
  ``Settings.deadline_s`` bounds the wait for a lease and every retry attempt. Header ``X-ZP-Route`` names
  the route whose output lengths the forecaster learns (default: the body's ``model``). All three
  headers are stripped.
- Elastic budgets (``budget.policy_name == "elastic"``): the lease is taken with ``meta`` for
  :class:`~zp_client.budget.elastic.ElasticPolicy`: ``prompt_tokens`` (the reserved prompt estimate),
  ``forecast_tokens`` (a :class:`~zp_client.forecast.LengthForecaster` quantile for the route, capped at
  max_tokens), ``streaming``, and ``prefix_key`` / ``prefix_blocks`` (full blocks of the shared preamble,
  from the estimator's lower bound). As a stream advances the transport reports ``first_token=True`` at
  its first event (vLLM sends the first chunk once the prompt is prefilled, so the prefix is cached),
  the held growth with the exact ``tokens`` count, and a re-forecast (conditional quantile given the
  tokens so far) whenever the stream reaches its forecast. A non-streamed call streamed upstream is a
  stream here (``streaming`` True, the streams' quantile); one sent as it is keeps its forecast (the
  blind quantile) until it completes. Every complete response's ``usage.completion_tokens`` (per
  choice) teaches the forecaster. The forecaster is ``forecaster=`` or, by default, one shared by every
  transport of the same budget.
- Elastic streams on vLLM also ask for ``stream_options.continuous_usage_stats``
  (``Settings.continuous_usage``: "auto" = when the server's ``GET models`` cards say ``owned_by:
  "vllm"``; "always"; "never"): every chunk then carries the prompt and completion tokens so far. From the
  first chunk on, the lease's ``prompt_tokens`` is the server's count (the estimate kept its error bound
  until then) and its ``tokens`` are exact even when vLLM merges several tokens into one chunk for a slow
  reader (counting events undercounts them: the lease would trail the server). Unless the caller asked
  for continuous usage itself, the per-chunk ``usage`` is removed from what it reads. ``oracle=True`` (benchmarks only, never the default) uses the simulator's body field
  ``sim_output_tokens`` as the forecast: the limit a forecaster can reach. Strict budgets get none of
  this (no metadata, no extra work).
- The transport runs the attempt loop with its :class:`~zp_client.retry.RetryPolicy` (``retry=``; by
  default the one built from ``Settings.retry_*`` on the budget's shared retry budget, see
  :func:`default_retry`): on a retryable outcome the lease is released, the policy sleeps, and the lease
  is re-acquired with the same ticket (the request keeps its place in line). Nothing is retried once the
  response was handed to the caller. ``retry=False``: one attempt.
- API keys and ``Authorization`` headers never appear in logs or error messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import anyio
import httpx

from zp_client.budget.base import Budget, Lease, Ticket
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, DeadlineExceeded, PromptTooLong, ZPError

# AsyncAdmissionTransport2 / AdmissionTransport2 (httpx2) are importable by name but left out of
# __all__: they import httpx2, which only openai 3.x environments have.
__all__ = [
    "AsyncAdmissionTransport",
    "AdmissionTransport",
    "TransportClasses",
    "transport_classes",
    "admission_transport_for",
    "is_admitted",
    "PRIORITY_HEADER",
    "DEADLINE_HEADER",
    "ROUTE_HEADER",
    "forecaster_for",
]

logger = logging.getLogger("zp_client.transport")

PRIORITY_HEADER = "x-zp-priority"
DEADLINE_HEADER = "x-zp-deadline"
ROUTE_HEADER = "x-zp-route"
_ADMITTED_SUFFIXES = ("/chat/completions", "/completions", "/responses")
# Growth is reported every few blocks under strict (accounting only), and at every new block under
# elastic: the projected peak reads ``held`` as the lease's occupancy now, and a stream reporting every 4
# blocks runs up to 3 blocks ahead of what the policy sees (with 40 live streams, up to 120 blocks of the
# pool unseen). Reports are a lock and a dict update locally; RedisBudget batches them
# (``held_report_blocks``), so a Redis backend is still not hit per block.
_REPORT_STEP_BLOCKS = 4
_ELASTIC_REPORT_STEP_BLOCKS = 1
# Non-streamed bodies are kept (up to this size) only to read their ``usage`` at the end.
_MAX_USAGE_BODY = 4 * 1024 * 1024
_METADATA_TIMEOUT = {"connect": 10.0, "read": 10.0, "write": 10.0, "pool": 10.0}
_SSE_SEPARATOR = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_USAGE_NULL = re.compile(rb'\s*,\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')
# vLLM's continuous usage in a chunk: a flat object, or one with one level of nested details
# (prompt_tokens_details), matched where the key is (found with rfind: vLLM writes it last).
_USAGE_AT = re.compile(rb'"usage"\s*:\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')
_JSON_WS = b" \t\r\n"
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def is_admitted(method: str, path: str) -> bool:
    """True when a request is an LLM call the transport takes a lease for."""
    return method.upper() == "POST" and path.rstrip("/").endswith(_ADMITTED_SUFFIXES)


# --------------------------------------------------------------------------------------------------
# The generic core: everything that does not depend on which HTTP module carries the bytes.
# --------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """What the core decided for one admitted request."""

    content: bytes
    headers: list[tuple[bytes, bytes]]
    blocks: int
    held: int
    priority: int
    deadline: float | None  # monotonic time
    strip_usage: bool
    stream: bool
    prompt_tokens: int
    n: int
    estimate: Any
    meta: dict[str, Any] | None = None
    """Lease metadata for an elastic budget (None under strict)."""
    route: str = "default"
    """The forecaster's key."""
    max_tokens: int = 0
    forecast: int = 0
    """Forecast output tokens per choice (elastic only)."""
    oracle: bool = False
    chat: bool = False
    upstream: bool = False
    """A non-streamed call sent upstream as a stream: the transport reassembles the JSON answer."""
    continuous: bool = False
    """zp asked vLLM for ``continuous_usage_stats``: every chunk carries the exact counts so far."""
    strip_continuous: bool = False
    """...and the caller did not: the per-chunk usage is removed from what it reads."""

    def acquire_kwargs(self) -> dict[str, Any]:
        # meta only when there is some: a backend written before it existed keeps working.
        return {"meta": dict(self.meta)} if self.meta is not None else {}


@dataclass
class _Parsed:
    body: dict[str, Any]
    changed: bool
    headers: list[tuple[bytes, bytes]]
    priority: int
    deadline: float | None
    stream: bool
    strip_usage: bool
    max_tokens: int
    model: str | None
    base: str
    root: str
    auth_headers: dict[str, str] = field(default_factory=dict)
    route: str | None = None
    upstream: bool = False
    chat_or_completions: bool = True
    """``/chat/completions`` or ``/completions`` (not ``/responses``, whose events carry no such usage)."""


_logged_default_max_tokens = False
_logged_compressed = False
_logged_no_max_model_len: set[str] = set()


def _api_base(url: Any) -> tuple[str, str]:
    """(API base, server root) of an admitted request's URL: ``http://h:p/v1``, ``http://h:p``."""
    key = (url.scheme, url.host, url.port, url.path)
    hit = _bases.get(key)
    if hit is None:
        if len(_bases) > 1024:
            _bases.clear()
        hit = _bases[key] = _api_base_uncached(url)
    return hit


_bases: dict[tuple[Any, ...], tuple[str, str]] = {}


def _api_base_uncached(url: Any) -> tuple[str, str]:
    path = url.path.rstrip("/")
    for suffix in _ADMITTED_SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    port = f":{url.port}" if url.port else ""
    root = f"{url.scheme}://{url.host}{port}"
    return root + path, root


def default_retry(budget: Budget, settings: Settings) -> Any:
    """The retry policy a front end gets when it is given none: :meth:`RetryPolicy.from_settings`
    (``Settings.retry_*``) drawing on the KV budget's own shared retry budget
    (:meth:`Budget.retry_budget`, fleet-wide for a RedisBudget)."""
    from zp_client.retry import RetryPolicy

    return RetryPolicy.from_settings(settings, budget=budget.retry_budget(settings))


class _Core:
    """Shared by every transport class: estimation, block math, retry loop decisions."""

    def __init__(
        self,
        budget: Budget,
        settings: Settings | None,
        estimator: Any | None,
        retry: Any | None,
        forecaster: Any | None = None,
        oracle: bool = False,
        stream_upstream: bool | None = None,
    ) -> None:
        if not isinstance(budget, Budget):
            raise ConfigurationError(
                f"budget must be a zp_client Budget (LocalBudget, RedisBudget), got {type(budget).__name__}"
            )
        self.budget = budget
        self.settings = settings or Settings()
        if estimator is None:
            from zp_client.estimate import Estimator

            estimator = Estimator(self.settings)
        self.estimator = estimator
        self.retry = default_retry(budget, self.settings) if retry is None else (retry or None)
        # Elastic metadata is worth its cost only when the budget's policy reads it.
        self.elastic = getattr(budget, "policy_name", "strict") == "elastic"
        self.forecaster = forecaster if forecaster is not None else (forecaster_for(budget) if self.elastic else None)
        self.oracle = bool(oracle)
        self.stream_upstream = (
            self.settings.stream_upstream if stream_upstream is None else bool(stream_upstream)
        )
        self._servers: dict[str, Any] = {}
        self._mml: dict[tuple[str, str | None], int | None] = {}
        # wrap() sets this so zp refusals pass through the openai SDK as a catchable type.
        self.convert_error: Callable[[ZPError], BaseException] | None = None

    # -- parsing ------------------------------------------------------------------------------------
    def parse(self, request: Any) -> _Parsed | None:
        """Read the request's JSON and per-call options; None when it cannot be admitted (not JSON)."""
        try:
            body = json.loads(request.content)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict):
            return None
        priority: int | None = None
        deadline_s: float | None = self.settings.deadline_s
        headers: list[tuple[bytes, bytes]] = []
        auth: dict[str, str] = {}
        route: str | None = None
        for k, v in request.headers.raw:
            lk = k.lower()
            if lk == ROUTE_HEADER.encode():
                route = v.decode("utf-8", "replace").strip() or None
                continue
            if lk == PRIORITY_HEADER.encode():
                try:
                    priority = int(v.decode().strip())
                except ValueError:
                    raise ConfigurationError(
                        f"header X-ZP-Priority must be an integer (lower = earlier), got {v.decode()!r}"
                    ) from None
                continue
            if lk == DEADLINE_HEADER.encode():
                try:
                    deadline_s = float(v.decode().strip())
                except ValueError:
                    deadline_s = -1.0
                if not (deadline_s > 0 and math.isfinite(deadline_s)):
                    raise ConfigurationError(
                        f"header X-ZP-Deadline must be a positive number of seconds, got {v.decode()!r}"
                    )
                continue
            if lk in (b"content-length", b"transfer-encoding"):
                continue  # recomputed for the body actually sent
            if lk in (b"authorization", b"api-key", b"x-api-key") or lk.startswith(b"openai-"):
                auth[k.decode("latin-1")] = v.decode("latin-1")
            headers.append((k, v))
        if priority is None:
            bp = body.get("priority")
            priority = bp if isinstance(bp, int) and not isinstance(bp, bool) else 0

        path = request.url.path.rstrip("/")
        changed = False
        keys = ("max_output_tokens",) if path.endswith("/responses") else ("max_completion_tokens", "max_tokens")
        max_tokens = next((body[k] for k in keys if isinstance(body.get(k), int)), None)
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
            body[keys[-1]] = max_tokens
            changed = True
            global _logged_default_max_tokens
            if not _logged_default_max_tokens:
                _logged_default_max_tokens = True
                logger.info(
                    "request without max_tokens: sending %s=%d (Settings.default_max_tokens) so the KV "
                    "lease is a true upper bound; set max_tokens to silence this",
                    keys[-1],
                    max_tokens,
                )
        stream = body.get("stream") is True
        strip_usage = False
        upstream = False
        if (
            not stream
            and self.stream_upstream
            and not path.endswith("/responses")
            and body.get("stream") in (None, False)
            and _reassembly_faithful(body)
        ):
            # Streamed upstream, reassembled here: bytes flow while the answer is generated (no proxy
            # idle timeout) and the lease sees its growth. The usage chunk is always asked for.
            upstream = stream = True
            body["stream"] = True
            so = body.get("stream_options")
            so = dict(so) if isinstance(so, dict) else {}
            so["include_usage"] = True
            body["stream_options"] = so
            changed = True
        elif stream and not path.endswith("/responses"):
            so = body.get("stream_options")
            if not (isinstance(so, dict) and so.get("include_usage") is True):
                so = dict(so) if isinstance(so, dict) else {}
                so["include_usage"] = True
                body["stream_options"] = so
                changed = True
                strip_usage = True
        base, root = _api_base(request.url)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        return _Parsed(
            body=body,
            changed=changed,
            headers=headers,
            priority=priority,
            deadline=None if deadline_s is None else time.monotonic() + deadline_s,
            stream=stream,
            strip_usage=strip_usage,
            max_tokens=max_tokens,
            model=model,
            base=base,
            root=root,
            auth_headers=auth,
            route=route,
            upstream=upstream,
            chat_or_completions=not path.endswith("/responses"),
        )

    def finish_plan(self, request: Any, p: _Parsed, est: Any, mml: int | None) -> _Plan:
        from zp_client.estimate import kv_blocks

        lower = getattr(self.estimator, "lower_bound_tokens", None)
        # Refuse only what surely does not fit: an over-estimate must never refuse a prompt that fits.
        low = int(lower(est)) if lower is not None else int(est.tokens)
        if mml is not None and low > mml:
            raise PromptTooLong(low, mml)
        prompt = int(self.estimator.reserve_tokens(est))
        n = int(getattr(est, "n", 1) or 1)
        bs = self.budget.block_size
        blocks = kv_blocks(prompt, p.max_tokens, block_size=bs, max_model_len=mml, n=n)
        held = min(blocks, kv_blocks(prompt, 0, block_size=bs, max_model_len=mml, n=n))
        route = p.route or p.model or "default"
        meta: dict[str, Any] | None = None
        forecast = 0
        oracle = False
        continuous = strip_continuous = False
        if self.elastic:
            # n > 1 grows n tokens per step, which the one-token-per-step projection cannot express:
            # project it as non-streamed (its forecast end held from now), which is conservative.
            streaming = p.stream and n == 1
            forecast, oracle = self._forecast(p, route, streaming)
            meta = {"prompt_tokens": prompt * n, "forecast_tokens": forecast * n, "streaming": streaming}
            if streaming and p.chat_or_completions and self._continuous_usage(p):
                so = p.body.get("stream_options")
                so = dict(so) if isinstance(so, dict) else {}
                continuous = True
                # The caller reads per-chunk usage only if it asked for it with include_usage (vLLM
                # ignores continuous_usage_stats without it, and zp added include_usage if missing).
                strip_continuous = p.strip_usage or so.get("continuous_usage_stats") is not True
                if so.get("continuous_usage_stats") is not True:
                    so["continuous_usage_stats"] = True
                    p.body["stream_options"] = so
                    p.changed = True
            key = getattr(est, "prefix_key", None)
            ptok = int(getattr(est, "prefix_tokens", 0) or 0)
            if key is not None and ptok > 0:
                # vLLM shares only full blocks; count the prefix from the estimate's lower bound so an
                # over-estimate never claims sharing that does not happen.
                if est.tokens > 0 and lower is not None:
                    ptok = min(ptok, ptok * low // int(est.tokens))
                pblocks = ptok // bs
                if pblocks > 0:
                    meta["prefix_key"] = key
                    meta["prefix_blocks"] = pblocks
        content = (
            json.dumps(p.body, separators=(",", ":"), ensure_ascii=False).encode() if p.changed else request.content
        )
        return _Plan(
            content=content,
            headers=p.headers,
            blocks=blocks,
            held=held,
            priority=p.priority,
            deadline=p.deadline,
            strip_usage=p.strip_usage,
            stream=p.stream,
            prompt_tokens=prompt,
            n=n,
            estimate=est,
            meta=meta,
            route=route,
            max_tokens=p.max_tokens,
            forecast=forecast,
            oracle=oracle,
            chat=request.url.path.rstrip("/").endswith("/chat/completions"),
            upstream=p.upstream,
            continuous=continuous,
            strip_continuous=strip_continuous,
        )

    def _continuous_usage(self, p: _Parsed) -> bool:
        """Whether to ask for vLLM's ``continuous_usage_stats`` (``Settings.continuous_usage``; under
        "auto" only for a server whose ``GET models`` said vLLM: others may refuse the unknown field)."""
        mode = self.settings.continuous_usage
        if mode == "auto":
            server = self._servers.get(p.base)
            return bool(getattr(server, "is_vllm", False))
        return mode == "always"

    def _forecast(self, p: _Parsed, route: str, streaming: bool = True) -> tuple[int, bool]:
        """(forecast output tokens per choice, from the oracle?). A request whose growth is not seen
        (``streaming`` False) is forecast at the forecaster's ``q_blind``: nothing corrects it later."""
        if self.oracle:
            true_len = p.body.get("sim_output_tokens")
            if isinstance(true_len, int) and not isinstance(true_len, bool) and true_len >= 0:
                return min(true_len, p.max_tokens), True
        fc = self.forecaster
        if streaming:
            return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens)), False
        q_blind = getattr(fc, "q_blind", None)
        if q_blind is None:  # a forecaster without the blind quantile: its single q
            return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens)), False
        return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens, streaming=False)), False

    # -- server metadata ----------------------------------------------------------------------------
    def server_for(self, p: _Parsed, mod: ModuleType, inner: Any) -> Any:
        """A ServerInfo for this request's server, fetching through the inner transport (no admission)."""
        server = self._servers.get(p.base)
        if server is not None:
            return server
        from zp_client.server import ServerInfo

        base, root, auth = p.base, p.root, dict(p.auth_headers)

        def url_of(path: str) -> str:
            return root + path if path.startswith("/") else base.rstrip("/") + "/" + path

        def build(method: str, path: str, payload: Any) -> Any:
            # Metadata calls bypass admission; bounded so a silent server cannot hang the first request.
            kw: dict[str, Any] = {"headers": {**auth, "accept": "application/json"},
                                  "extensions": {"timeout": dict(_METADATA_TIMEOUT)}}
            if payload is not None:
                kw["json"] = payload
            return mod.Request(method, url_of(path), **kw)

        async def fetch(method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
            resp = await inner.handle_async_request(build(method, path, payload))
            try:
                return resp.status_code, await resp.aread()
            finally:
                await resp.aclose()

        def fetch_sync(method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
            resp = inner.handle_request(build(method, path, payload))
            try:
                return resp.status_code, resp.read()
            finally:
                resp.close()

        server = ServerInfo(fetch=fetch, fetch_sync=fetch_sync, settings=self.settings)
        self._servers[p.base] = server
        return server

    def _mml_failed(self, p: _Parsed, exc: BaseException) -> None:
        if p.base not in _logged_no_max_model_len:
            _logged_no_max_model_len.add(p.base)
            logger.warning(
                "could not read max_model_len from %s/models (%s); bounds are not capped by the context "
                "length and long prompts are not refused locally. Set Settings.max_model_len to fix.",
                p.base,
                type(exc).__name__,
            )

    async def max_model_len(self, p: _Parsed, mod: ModuleType, inner: Any) -> int | None:
        if self.settings.max_model_len is not None:
            return self.settings.max_model_len
        key = (p.base, p.model)
        if key in self._mml:
            return self._mml[key]
        try:
            value = await self.server_for(p, mod, inner).max_model_len(p.model)
        except Exception as exc:  # metadata is an optimisation of the bound, never a reason to fail
            self._mml_failed(p, exc)
            value = None
        if value is not None:  # unknown stays uncached: ServerInfo retries (no sooner than 30 s apart)
            self._mml[key] = value
        return value

    def max_model_len_sync(self, p: _Parsed, mod: ModuleType, inner: Any) -> int | None:
        if self.settings.max_model_len is not None:
            return self.settings.max_model_len
        key = (p.base, p.model)
        if key in self._mml:
            return self._mml[key]
        try:
            value = self.server_for(p, mod, inner).max_model_len_sync(p.model)
        except Exception as exc:
            self._mml_failed(p, exc)
            value = None
        if value is not None:  # unknown stays uncached: ServerInfo retries (no sooner than 30 s apart)
            self._mml[key] = value
        return value

    # -- errors and retry ---------------------------------------------------------------------------
    def surface(self, exc: BaseException) -> BaseException:
        if isinstance(exc, ZPError) and self.convert_error is not None:
            return self.convert_error(exc)
        return exc

    async def decide_async(self, state: Any, **kw: Any) -> Any:
        fn = getattr(self.retry, "decide_async", None)
        if fn is not None:
            return await fn(state, delivered=False, **kw)
        return self.retry.decide(state, delivered=False, **kw)

    @staticmethod
    def remaining(plan: _Plan) -> float | None:
        return None if plan.deadline is None else plan.deadline - time.monotonic()

    def check_deadline(self, plan: _Plan, attempt: int) -> float | None:
        rem = self.remaining(plan)
        if rem is not None and rem <= 0:
            raise DeadlineExceeded(
                f"the request's deadline passed before attempt {attempt + 1} could be admitted; "
                "raise X-ZP-Deadline / Settings.deadline_s or lower the load"
            )
        return rem


# --------------------------------------------------------------------------------------------------
# Lease holding for a response body: one object per response, released exactly once.
# --------------------------------------------------------------------------------------------------


class _Holder:
    """Owns one lease while a response body is open. Never references the stream wrapper, so the
    wrapper can be garbage collected (its finalizer then calls :meth:`abandon`)."""

    __slots__ = ("lease", "done", "loop", "resp", "last_activity", "waiting", "idle_timeout", "__weakref__")

    def __init__(self, lease: Lease, idle_timeout: float, *, is_async: bool) -> None:
        self.lease = lease
        self.done = False
        self.resp: Any = None  # the inner response, once its body is handed to the caller
        self.last_activity = time.monotonic()
        # True while the caller waits for the server's next chunk: a slow server is not an idle caller.
        self.waiting = False
        self.idle_timeout = idle_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        if is_async:
            try:
                self.loop = asyncio.get_running_loop()
            except RuntimeError:  # trio: finalizers fall back to release_sync
                self.loop = None

    async def release(self) -> None:
        if self.done:
            return
        self.done = True
        # Shielded: this runs on cancellation paths and must finish so no blocks leak.
        with anyio.CancelScope(shield=True):
            try:
                await self.lease.release()
            except Exception:  # release never raises by contract; a backend bug must not mask ours
                logger.exception("lease release failed")

    def release_sync(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.lease.release_sync()
        except Exception:
            logger.exception("lease release failed")

    def abandon(self) -> None:
        """The caller walked away (garbage collection) or stopped reading (watchdog).

        Closes the inner response first, so the server sees the disconnect, aborts the request and
        frees its KV (releasing the lease while the server still generated would break the bound),
        then releases the lease. Callable from any thread; never blocks an event loop.
        """
        if self.done:
            return
        resp, self.resp = self.resp, None
        loop = self.loop
        if loop is None or loop.is_closed():
            if resp is not None and loop is None:
                try:
                    resp.close()
                except Exception:
                    logger.debug("closing an abandoned response failed", exc_info=True)
            self.release_sync()
            return
        self.done = True
        coro = _abandon_async(resp, self.lease)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task = loop.create_task(coro)
            _pending.add(task)
            task.add_done_callback(_pending.discard)
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(coro, loop)
        else:
            coro.close()
            try:
                self.lease.release_sync()
            except Exception:
                logger.exception("lease release failed")


async def _abandon_async(resp: Any, lease: Lease) -> None:
    try:
        if resp is not None:
            await resp.aclose()
    except Exception:
        logger.debug("closing an abandoned response failed", exc_info=True)
    finally:
        try:
            await lease.release()
        except Exception:
            logger.exception("lease release failed")


_pending: set[asyncio.Task[None]] = set()


def _finalize(holder: _Holder) -> None:
    if not holder.done:
        logger.debug("response abandoned without close: closing it and releasing its lease")
        holder.abandon()


class _Watchdog:
    """One daemon thread for the process: releases leases of streams nobody has read for a while."""

    def __init__(self) -> None:
        self._holders: weakref.WeakSet[_Holder] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._interval = 5.0

    def add(self, holder: _Holder) -> None:
        with self._lock:
            self._holders.add(holder)
            if self._thread is None or not self._thread.is_alive():
                self._interval = holder.idle_timeout / 4
                self._thread = threading.Thread(target=self._run, name="zp-idle-watchdog", daemon=True)
                self._thread.start()
                return
            wake = holder.idle_timeout / 4 < self._interval
        if wake:
            # Only a shorter timeout than any seen needs an earlier check; waking the thread on every
            # request would cost a GIL hand-off per request.
            self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                holders = [h for h in self._holders if not h.done]
                if holders:
                    self._interval = max(0.01, min(h.idle_timeout for h in holders) / 4)
                interval = self._interval
            now = time.monotonic()
            for h in holders:
                if not h.done and not h.waiting and now - h.last_activity > h.idle_timeout:
                    logger.warning(
                        "stream idle for more than %.1f s (Settings.idle_stream_timeout_s): closing it and "
                        "releasing its lease",
                        h.idle_timeout,
                    )
                    h.abandon()
            self._wake.wait(interval)
            self._wake.clear()


_watchdog = _Watchdog()


def _usage_member(event: bytes) -> tuple[int, int, int, int] | None:
    """Where the ``"usage": {...}`` member of a chunk is: (start, end) of the member with one of its
    commas, so that cutting it leaves valid JSON, and (start, end) of the object. None without one.
    Inside a JSON string a quote is escaped, so ``"usage"`` found here is a key."""
    i = event.rfind(b'"usage"')
    if i < 0:
        return None
    m = _USAGE_AT.match(event, i)
    if m is None:
        return None
    start, end = i, m.end()
    j = start
    while j > 0 and event[j - 1] in _JSON_WS:
        j -= 1
    if j > 0 and event[j - 1] == 0x2C:  # ',' before it: take that one
        start = j - 1
    else:  # the first member: take the comma after it, if any
        k = end
        while k < len(event) and event[k] in _JSON_WS:
            k += 1
        if k < len(event) and event[k] == 0x2C:
            end = k + 1
            while end < len(event) and event[end] in _JSON_WS:
                end += 1
    return start, end, m.start(1), m.end(1)


def _reforecast(fc: Any, route: str, generated: int, max_tokens: int) -> int:
    """A stream that reached its forecast, re-forecast given its length so far at the tail quantile (a
    forecaster without one, e.g. a custom duck-typed one, answers with its usual quantile)."""
    try:
        return int(fc.forecast(route, generated=generated, max_tokens=max_tokens, tail=True))
    except TypeError:
        return int(fc.forecast(route, generated=generated, max_tokens=max_tokens))


class _Scanner:
    """Watches a response body go by: counts SSE events, finds ``usage``, strips the one zp added."""

    def __init__(self, plan: _Plan, block_size: int, bound: int, lease: Lease, is_sse: bool,
                 forecaster: Any | None = None) -> None:
        self.plan = plan
        # Elastic progress: first token, exact tokens with each held report, re-forecasts.
        self.elastic = plan.meta is not None and plan.meta.get("streaming", False) and is_sse
        self.forecaster = forecaster
        self.forecast = plan.forecast
        self.first_sent = False
        # A chat stream's first event is the role chunk: it carries no token.
        self.skip = 1 if plan.chat else 0
        self.block_size = block_size
        self.bound = bound
        self.lease = lease
        self.sse = is_sse
        self.strip = plan.strip_usage and is_sse
        # Exact counts from vLLM's continuous usage: (prompt tokens, completion tokens so far).
        self.continuous = self.elastic and plan.continuous
        self.strip_continuous = self.continuous and plan.strip_continuous
        self.counts: tuple[int, int] | None = None
        self.prompt_reported = False
        # The bytes handed back may differ from the server's (a usage removed): no Content-Length then.
        self.rewrites = self.strip or self.strip_continuous
        self.buf = bytearray()
        self.events = 0
        self.reported = plan.held
        self.usage: dict[str, Any] | None = None
        self.pending: bytes | None = None
        self.body = bytearray() if not is_sse else None
        self.observed = False

    def feed(self, chunk: bytes) -> bytes:
        if not self.sse:
            if self.body is not None:
                if len(self.body) + len(chunk) <= _MAX_USAGE_BODY:
                    self.body += chunk
                else:
                    self.body = None
            return chunk
        if not self.buf and b'"usage"' not in chunk and chunk.endswith((b"\n\n", b"\r\r")):
            # Fast path, the usual case: whole events and nothing to strip or read, so just count them.
            n = chunk.count(b"data:")
            if n:
                self._grow(n)
            return chunk
        if self.continuous and not self.buf and chunk.find(b"\n\n") == len(chunk) - 2:
            # One whole event (vLLM writes one per chunk): every event carries usage, so skip the buffer.
            keep = self._event(chunk)
            if not self.rewrites:
                return chunk
            return self._take(chunk) if keep else b""
        self.buf += chunk
        out = bytearray() if self.rewrites else None
        start = 0
        for m in _SSE_SEPARATOR.finditer(self.buf):
            event = bytes(self.buf[start : m.end()])
            start = m.end()
            if self._event(event) and out is not None:
                out += self._take(event)
        del self.buf[:start]
        if out is None:
            return chunk
        return bytes(out)

    def flush(self) -> bytes:
        """Whatever is left after the last separator (a server that ends without a blank line)."""
        if not self.sse or not self.buf:
            return b""
        rest = bytes(self.buf)
        self.buf.clear()
        keep = self._event(rest)
        return self._take(rest) if (self.rewrites and keep) else b""

    def _take(self, event: bytes) -> bytes:
        """The event as the caller gets it (with an added ``"usage": null`` removed)."""
        if self.pending is not None:
            event, self.pending = self.pending, None
        return event

    def _event(self, event: bytes) -> bool:
        """Account one SSE event; False when it is the usage-only chunk zp asked for."""
        if b"data:" not in event:
            return True
        if self.continuous and not (b"[]" in event and _EMPTY_CHOICES.search(event)):
            found = _usage_member(event)
            if found is not None:
                start, end, a, b = found
                pt, ct = _PROMPT_TOKENS.search(event, a, b), _COMPLETION_TOKENS.search(event, a, b)
                if pt is not None and ct is not None:
                    self.counts = (int(pt.group(1)), int(ct.group(1)))
                    if self.strip_continuous:
                        self.pending = event[:start] + event[end:]
                    self._grow(1)
                    return True
        if b'"usage"' in event:
            data = b"".join(
                line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
            )
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if obj.get("choices") == []:
                    return not self.strip
            elif self.strip and isinstance(obj, dict) and "usage" in obj:
                # OpenAI-style servers put "usage": null in every chunk once include_usage is on;
                # without it they send no such key, so drop the key to hand back the original bytes.
                self.pending = _USAGE_NULL.sub(b"", event)
        self._grow(1)
        return True

    def _grow(self, events: int) -> None:
        self.events += events
        if self.elastic:
            self._progress()
            return
        # About one token per choice per event; the first (role) event carries none, which only makes
        # this a slight overestimate of growth: fine for accounting.
        generated = self.events // self.plan.n
        held = min(
            self.bound,
            -(-(self.plan.prompt_tokens + generated) // self.block_size) * self.plan.n,
        )
        if held >= self.reported + _REPORT_STEP_BLOCKS:
            self.reported = held
            self.lease.report_held(held)

    def _progress(self) -> None:
        """Elastic (n == 1, streamed): report first token, growth with exact tokens, re-forecasts."""
        plan = self.plan
        counts = self.counts
        if counts is not None:
            # vLLM's continuous usage: exact, also when one chunk carries several tokens
            prompt, generated = counts
            tokens = prompt + generated
        else:
            prompt = plan.prompt_tokens
            generated = max(0, self.events - self.skip)
            tokens = prompt + generated
        if (
            self.first_sent
            and generated < self.forecast
            and tokens < (self.reported + _ELASTIC_REPORT_STEP_BLOCKS - 1) * self.block_size + 1
            and (counts is None or self.prompt_reported)
        ):
            return  # the common case, per event: nothing to report yet
        fields: dict[str, Any] = {}
        if not self.first_sent:
            # vLLM sends a stream's first event once the prompt is prefilled: its prefix is cached now.
            self.first_sent = True
            fields["first_token"] = True
        if counts is not None and not self.prompt_reported:
            # The server's count replaces the estimate (and its error bound) for the rest of the lease.
            self.prompt_reported = True
            if prompt != plan.prompt_tokens:
                fields["prompt_tokens"] = prompt
        if generated >= self.forecast and self.forecast < plan.max_tokens:
            # Reached its forecast and still going: ask again, given the tokens so far. At the forecast
            # end itself the policy already reads the lease as outgrown (projected to its bound), so a
            # new forecast here loosens that as soon as it is known.
            if plan.oracle or self.forecaster is None:
                new = min(plan.max_tokens, generated + self.block_size)
            else:
                new = _reforecast(self.forecaster, plan.route, generated, plan.max_tokens)
            if new > self.forecast:
                self.forecast = new
                fields["forecast_tokens"] = new
        held = min(self.bound, -(-tokens // self.block_size))
        if fields or held >= self.reported + _ELASTIC_REPORT_STEP_BLOCKS:
            self.reported = held
            try:
                self.lease.report_progress(held, tokens=tokens, **fields)
            except Exception:  # progress is advisory; it must never break the caller's stream
                logger.debug("progress report failed", exc_info=True)

    def advance(self, events: int, usage: dict[str, Any] | None = None) -> None:
        """Account ``events`` SSE data events already split and parsed elsewhere (a stream the transport
        reassembles itself): the same growth, first-token and re-forecast reports as :meth:`feed`."""
        if usage is not None:
            self.usage = usage
            if self.continuous:
                pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if isinstance(pt, int) and isinstance(ct, int):
                    self.counts = (pt, ct)
        if events:
            self._grow(events)

    def final_usage(self) -> dict[str, Any] | None:
        if self.usage is None and self.body is not None:
            try:
                obj = json.loads(bytes(self.body))
            except ValueError:
                return None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
        return self.usage


def _observe(core: _Core, plan: _Plan, scanner: _Scanner) -> None:
    """Learn from the response's usage, once (calibration and the length forecaster)."""
    if scanner.observed:
        return
    scanner.observed = True
    try:
        usage = scanner.final_usage()
        if usage:
            # chat/completions say prompt_tokens; /responses says input_tokens
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            if isinstance(prompt, int):
                core.estimator.observe(plan.estimate, prompt)
            if core.forecaster is not None:
                out = usage.get("completion_tokens", usage.get("output_tokens"))
                if isinstance(out, int) and not isinstance(out, bool) and out >= 0:
                    # Per choice: what one sequence of this route produces.
                    core.forecaster.observe(plan.route, round(out / max(1, plan.n)))
    except Exception:  # calibration must never break a response
        logger.debug("usage reconciliation failed", exc_info=True)


def _observe_seen(core: _Core, plan: _Plan, scanner: _Scanner) -> None:
    """A stream closed before its body ended: learn only if its usage chunk already went by (SDKs stop
    reading at ``[DONE]`` and close; the usage chunk comes before it, so the answer was complete)."""
    if scanner.sse and scanner.usage is not None:
        _observe(core, plan, scanner)


# --------------------------------------------------------------------------------------------------
# Non-streamed calls streamed upstream: the answer is rebuilt from the stream (sans I/O).
# --------------------------------------------------------------------------------------------------

# Body fields whose answer a stream cannot carry faithfully into the non-streamed shape (logprobs are
# laid out differently; echo, beam search and best_of behave differently or are refused when streamed).
_UNFAITHFUL_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "use_beam_search")
# Delta fields that name something rather than accumulate text: the first non-null value wins.
_IDENTITY_FIELDS = frozenset(("id", "type", "role", "name"))
# Chunk-level fields that only make sense in a stream.
_STREAM_ONLY_FIELDS = frozenset(("choices", "usage", "object", "obfuscation"))
# Upstream headers that described the stream, not the JSON body handed to the caller.
_REASSEMBLY_DROPPED_HEADERS = (b"content-length", b"transfer-encoding", b"content-type", b"content-encoding")


def _reassembly_faithful(body: dict[str, Any]) -> bool:
    """True when a stream of this request can be turned back into its exact non-streamed answer."""
    for key in _UNFAITHFUL_FIELDS:
        value = body.get(key)
        if value is not None and value is not False:
            return False
    best_of, n = body.get("best_of"), body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 1
    return not (isinstance(best_of, int) and not isinstance(best_of, bool) and best_of > n)


class _BadEvent(ValueError):
    """An SSE event that cannot be reassembled (surfaced as the HTTP library's DecodingError)."""


def _merge_delta(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """Fold one streamed delta into the message built so far (see :class:`_Reassembler`)."""
    for key, value in delta.items():
        if value is None:
            into.setdefault(key, None)
            continue
        current = into.get(key)
        if key == "tool_calls" and isinstance(value, list):
            # Built as {index: call} (an earlier "tool_calls": null left None); a list in body().
            calls: dict[int, dict[str, Any]] = current if isinstance(current, dict) else {}
            into[key] = calls
            for call in value:
                if not isinstance(call, dict):
                    continue
                i = call.get("index")
                if not isinstance(i, int) or isinstance(i, bool):
                    # A server without indices: a call with an id starts a new one, the rest continue.
                    i = len(calls) if (call.get("id") or not calls) else max(calls)
                _merge_delta(calls.setdefault(i, {}), {k: v for k, v in call.items() if k != "index"})
        elif isinstance(value, str):
            if key in _IDENTITY_FIELDS:
                if current is None:
                    into[key] = value
            else:
                into[key] = (current if isinstance(current, str) else "") + value
        elif isinstance(value, dict):
            if not isinstance(current, dict):
                current = into[key] = {}
            _merge_delta(current, value)
        else:
            into[key] = value


class _Reassembler:
    """Rebuilds the JSON answer a server gives a non-streamed call from the SSE stream of the same call.

    Chat deltas merge per choice ``index``: strings concatenate (``content``, ``reasoning_content``,
    ``refusal``, ``function.arguments``...) except identity fields (``id``, ``type``, ``role``,
    ``name``: first non-null wins); ``tool_calls`` merge by their ``index`` (dropped from the result);
    other choice fields (``finish_reason``, vLLM's ``stop_reason``) keep their last non-null value.
    ``content`` is null when only tool calls were generated; ``tool_calls`` is always a list, as vLLM
    answers. Completions concatenate ``text``. Top-level fields (``id``, ``created``, ``model``,
    ``system_fingerprint``...) keep their first non-null value; ``usage`` comes from the usage chunk.
    An ``{"error": ...}`` event (vLLM's mid-stream error) is kept as :attr:`error`.
    """

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.buf = bytearray()
        self.top: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.done = False

    def feed(self, chunk: bytes) -> int:
        """Take bytes of the stream; returns how many ``data:`` events they completed."""
        self.buf += chunk
        start = events = 0
        for m in _SSE_SEPARATOR.finditer(self.buf):
            events += self._event(bytes(self.buf[start : m.start()]))
            start = m.end()
        if start:
            del self.buf[:start]
        return events

    def end(self) -> int:
        """The stream ended: whatever follows the last separator is a last event."""
        rest, self.buf = bytes(self.buf), bytearray()
        return self._event(rest) if rest.strip() else 0

    def _event(self, raw: bytes) -> int:
        lines = [line[5:] for line in raw.splitlines() if line.startswith(b"data:")]
        if not lines:
            return 0  # a comment, a keep-alive, an event: line alone
        data = b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines).strip()
        if data == b"[DONE]":
            self.done = True
            return 1
        try:
            obj = json.loads(data)
        except ValueError:
            raise _BadEvent(f"the server sent an event that is not JSON: {data[:200]!r}") from None
        if not isinstance(obj, dict):
            raise _BadEvent(f"the server sent an event that is not a JSON object: {data[:200]!r}")
        if isinstance(obj.get("error"), dict) and not obj.get("choices"):
            self.error = obj["error"]
            return 1
        if obj.get("object") == "error":  # older vLLM: the error fields at the top level
            self.error = {k: obj.get(k) for k in ("message", "type", "param", "code")}
            return 1
        for key, value in obj.items():
            if key not in _STREAM_ONLY_FIELDS and self.top.get(key) is None:
                self.top[key] = value
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                self._choice(choice)
        return 1

    def _choice(self, choice: dict[str, Any]) -> None:
        i = choice.get("index", 0)
        i = i if isinstance(i, int) and not isinstance(i, bool) else 0
        state = self.choices.get(i)
        if state is None:
            state = self.choices[i] = {"message": {}, "text": "", "fields": {}}
        fields = state["fields"]
        for key, value in choice.items():
            if key in ("index", "logprobs"):
                continue
            if self.chat and key == "delta":
                if isinstance(value, dict):
                    _merge_delta(state["message"], value)
            elif not self.chat and key == "text":
                if isinstance(value, str):
                    state["text"] += value
            elif value is not None or key not in fields:
                fields[key] = value

    def body(self) -> dict[str, Any]:
        """The non-streamed answer (call after the stream ended with ``[DONE]`` and no error)."""
        choices = []
        for i in sorted(self.choices):
            state = self.choices[i]
            fields = dict(state["fields"])
            out: dict[str, Any] = {"index": i}
            if self.chat:
                msg = dict(state["message"])
                role = msg.pop("role", None) or "assistant"
                content = msg.pop("content", None)
                calls = msg.pop("tool_calls", None) or {}
                tool_calls = [calls[k] for k in sorted(calls)]
                if not content:  # nothing generated: null beside tool calls (or when never sent)
                    content = None if (tool_calls or content is None) else ""
                out["message"] = {"role": role, "content": content, **msg, "tool_calls": tool_calls}
            else:
                out["text"] = state["text"]
            out["logprobs"] = None
            out["finish_reason"] = fields.pop("finish_reason", None)
            out.update(fields)
            choices.append(out)
        top = dict(self.top)
        return {
            "id": top.pop("id", None),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": top.pop("created", None),
            "model": top.pop("model", None),
            "choices": choices,
            "usage": self.usage,
            **top,
        }

    def error_body(self) -> tuple[int, dict[str, Any]]:
        """(status, body) of the error answer a server gives a non-streamed call that failed so."""
        error = self.error or {}
        code = error.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else 500
        return status, {"error": error}


_forecasters: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_forecasters_lock = threading.Lock()


def forecaster_for(budget: Budget) -> Any:
    """The :class:`~zp_client.forecast.LengthForecaster` every transport of ``budget`` shares by
    default (made on first use with the forecaster's defaults: ``DEFAULT_Q`` for streams,
    ``DEFAULT_Q_BLIND`` for requests whose growth is not seen), so wrapped clients of one budget learn
    together. A budget with a ``shared_forecaster()`` method (RedisBudget) supplies it: the fleet learns together."""
    from zp_client.forecast import LengthForecaster

    with _forecasters_lock:
        fc = _forecasters.get(budget)
        if fc is None:
            # A budget that shares forecasts across processes (RedisBudget) provides its own.
            shared = getattr(budget, "shared_forecaster", None)
            fc = _forecasters[budget] = shared() if shared is not None else LengthForecaster()
        return fc


# --------------------------------------------------------------------------------------------------
# Per-module classes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransportClasses:
    """The admission transports for one HTTP module (``httpx`` or ``httpx2``)."""

    module: ModuleType
    AsyncAdmissionTransport: type
    AdmissionTransport: type


_classes: dict[str, TransportClasses] = {}


def transport_classes(module: ModuleType) -> TransportClasses:
    """The (async, sync) admission transport classes for ``httpx`` or ``httpx2``; built once per module."""
    name = module.__name__
    if name not in _classes:
        _classes[name] = _build(module)
    return _classes[name]


def _build(mod: ModuleType) -> TransportClasses:
    class _AsyncBody(mod.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, core: _Core, plan: _Plan, resp: Any, holder: _Holder, scanner: _Scanner) -> None:
            self._core, self._plan, self._resp, self._holder, self._scanner = core, plan, resp, holder, scanner
            weakref.finalize(self, _finalize, holder).atexit = False

        async def __aiter__(self) -> AsyncIterator[bytes]:
            holder, scanner = self._holder, self._scanner
            completed = False
            try:
                holder.waiting = True
                async for chunk in self._resp.stream:
                    holder.waiting = False
                    holder.last_activity = time.monotonic()
                    out = scanner.feed(chunk)
                    if out:
                        yield out
                        holder.last_activity = time.monotonic()
                    holder.waiting = True
                tail = scanner.flush()
                if tail:
                    yield tail
                completed = True
                _observe(self._core, self._plan, scanner)
            finally:
                if not completed:
                    # Error, cancellation or an abandoned iterator: close the connection first so the
                    # server aborts the request and frees its KV before the blocks return to the budget.
                    with anyio.CancelScope(shield=True):
                        try:
                            await self._resp.aclose()
                        except Exception:
                            logger.debug("closing the inner response failed", exc_info=True)
                    _observe_seen(self._core, self._plan, scanner)
                await holder.release()

        async def aclose(self) -> None:
            try:
                with anyio.CancelScope(shield=True):
                    await self._resp.aclose()
            finally:
                _observe_seen(self._core, self._plan, self._scanner)
                await self._holder.release()

    class _SyncBody(mod.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, core: _Core, plan: _Plan, resp: Any, holder: _Holder, scanner: _Scanner) -> None:
            self._core, self._plan, self._resp, self._holder, self._scanner = core, plan, resp, holder, scanner
            weakref.finalize(self, _finalize, holder).atexit = False

        def __iter__(self) -> Iterator[bytes]:
            holder, scanner = self._holder, self._scanner
            completed = False
            try:
                holder.waiting = True
                for chunk in self._resp.stream:
                    holder.waiting = False
                    holder.last_activity = time.monotonic()
                    out = scanner.feed(chunk)
                    if out:
                        yield out
                        holder.last_activity = time.monotonic()
                    holder.waiting = True
                tail = scanner.flush()
                if tail:
                    yield tail
                completed = True
                _observe(self._core, self._plan, scanner)
            finally:
                if not completed:  # see the async form: the server must see the disconnect first
                    try:
                        self._resp.close()
                    except Exception:
                        logger.debug("closing the inner response failed", exc_info=True)
                    _observe_seen(self._core, self._plan, scanner)
                holder.release_sync()

        def close(self) -> None:
            try:
                self._resp.close()
            finally:
                _observe_seen(self._core, self._plan, self._scanner)
                self._holder.release_sync()

    def _scanner_for(core: _Core, plan: _Plan, resp: Any, lease: Lease) -> _Scanner:
        ctype = resp.headers.get("content-type", "")
        is_sse = plan.stream and ctype.startswith("text/event-stream")
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # A compressed body cannot be scanned without decoding it (vLLM never compresses SSE; a
            # proxy might). Growth is then not reported and an added usage chunk is not removed.
            global _logged_compressed
            if is_sse and not _logged_compressed:
                _logged_compressed = True
                logger.warning(
                    "server compressed an event stream (%s): zp cannot report its growth or remove the "
                    "usage chunk it asked for; turn compression off for text/event-stream",
                    encoding,
                )
            is_sse = False
            scanner = _Scanner(plan, core.budget.block_size, lease.bound, lease, False)
            scanner.body = None  # nor parse usage out of compressed bytes
            return scanner
        return _Scanner(plan, core.budget.block_size, lease.bound, lease, is_sse, core.forecaster)

    def _request(original: Any, plan: _Plan) -> Any:
        # A fresh request per attempt (the caller's object is never mutated, so it can be re-sent).
        headers = [*plan.headers, (b"Content-Length", str(len(plan.content)).encode())]
        return mod.Request(
            original.method,
            original.url,
            headers=headers,
            stream=mod.ByteStream(plan.content),
            extensions=original.extensions,
        )

    def _response(resp: Any, stream: Any, scanner: _Scanner) -> Any:
        headers = resp.headers
        if scanner.rewrites:
            # Bytes may be removed from the body, so a declared length would be wrong.
            headers = [(k, v) for k, v in resp.headers.raw if k.lower() != b"content-length"]
        return mod.Response(resp.status_code, headers=headers, stream=stream, extensions=resp.extensions)

    def _preread_response(core: _Core, plan: _Plan, resp: Any, scanner: _Scanner) -> Any:
        content = scanner.feed(resp.content) + scanner.flush()
        _observe(core, plan, scanner)
        if not scanner.rewrites:
            return resp
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() != b"content-length"]
        return mod.Response(resp.status_code, headers=headers, content=content, extensions=resp.extensions)

    def _preread(resp: Any) -> bool:
        return bool(getattr(resp, "is_closed", False)) or hasattr(resp, "_content")

    def _is_event_stream(resp: Any) -> bool:
        ctype = resp.headers.get("content-type", "")
        return bool(resp.status_code == 200 and ctype.startswith("text/event-stream"))

    def _new_reassembly(core: _Core, plan: _Plan, holder: _Holder) -> tuple[_Scanner, _Reassembler]:
        lease = holder.lease
        scanner = _Scanner(plan, core.budget.block_size, lease.bound, lease, True, core.forecaster)
        return scanner, _Reassembler(plan.chat)

    def _reassembled(core: _Core, plan: _Plan, original: Any, resp: Any, scanner: _Scanner,
                     asm: _Reassembler) -> Any:
        """The consumed stream as the non-streamed answer, or its error answer; raises like a body read
        that was cut short when the stream ended without ``[DONE]``."""
        if asm.error is not None:
            status, payload = asm.error_body()
        elif not asm.done:
            raise mod.RemoteProtocolError(
                "the server ended the event stream without 'data: [DONE]': the answer is incomplete",
                request=original,
            )
        else:
            _observe(core, plan, scanner)
            status, payload = 200, asm.body()
        content = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in _REASSEMBLY_DROPPED_HEADERS]
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
        # The reason phrase was the stream's (an error answer has its own); the connection is gone.
        extensions = {k: v for k, v in resp.extensions.items() if k not in ("reason_phrase", "network_stream")}
        return mod.Response(status, headers=headers, content=content, extensions=extensions)

    async def _consume_async(core: _Core, plan: _Plan, original: Any, resp: Any, holder: _Holder) -> Any:
        """Read the upstream stream of a non-streamed call to its end inside the transport, reporting its
        growth; the lease is released once it is consumed. Any other exit (error, cancellation) closes
        the connection first, so the server aborts the request before the blocks return."""
        scanner, asm = _new_reassembly(core, plan, holder)
        completed = False
        try:
            async for chunk in resp.aiter_bytes():
                scanner.advance(asm.feed(chunk), asm.usage)
            scanner.advance(asm.end(), asm.usage)
            completed = True
        except _BadEvent as exc:
            raise mod.DecodingError(str(exc), request=original) from None
        finally:
            if not completed:
                with anyio.CancelScope(shield=True):
                    try:
                        await resp.aclose()
                    except Exception:
                        logger.debug("closing the inner response failed", exc_info=True)
        await holder.release()
        return _reassembled(core, plan, original, resp, scanner, asm)

    def _consume_sync(core: _Core, plan: _Plan, original: Any, resp: Any, holder: _Holder) -> Any:
        """Blocking form of ``_consume_async``."""
        scanner, asm = _new_reassembly(core, plan, holder)
        completed = False
        try:
            for chunk in resp.iter_bytes():
                scanner.advance(asm.feed(chunk), asm.usage)
            scanner.advance(asm.end(), asm.usage)
            completed = True
        except _BadEvent as exc:
            raise mod.DecodingError(str(exc), request=original) from None
        finally:
            if not completed:
                try:
                    resp.close()
                except Exception:
                    logger.debug("closing the inner response failed", exc_info=True)
        holder.release_sync()
        return _reassembled(core, plan, original, resp, scanner, asm)

    class AsyncAdmissionTransport(mod.AsyncBaseTransport):  # type: ignore[name-defined,misc]
        """Async admission transport (see :mod:`zp_client.transport`)."""

        def __init__(
            self,
            inner: Any | None = None,
            *,
            budget: Budget,
            settings: Settings | None = None,
            estimator: Any | None = None,
            retry: Any | None = None,
            close_inner: bool = True,
            forecaster: Any | None = None,
            oracle: bool = False,
            stream_upstream: bool | None = None,
        ) -> None:
            self._inner = inner if inner is not None else mod.AsyncHTTPTransport()
            self._core = _Core(budget, settings, estimator, retry, forecaster, oracle, stream_upstream)
            self._close_inner = close_inner

        @property
        def budget(self) -> Budget:
            return self._core.budget

        @property
        def forecaster(self) -> Any | None:
            """The output-length forecaster (elastic budgets; None under strict unless one was given)."""
            return self._core.forecaster

        async def handle_async_request(self, request: Any) -> Any:
            if not is_admitted(request.method, request.url.path):
                return await self._inner.handle_async_request(request)
            await request.aread()
            try:
                return await self._admitted(request)
            except ZPError as exc:
                surfaced = self._core.surface(exc)
                if surfaced is exc:
                    raise
                raise surfaced from exc

        async def _admitted(self, request: Any) -> Any:
            core = self._core
            p = core.parse(request)
            if p is None:
                return await self._inner.handle_async_request(request)
            if core.settings.estimator == "server":
                est = await core.estimator.estimate_async(
                    request.url.path, p.body, core.server_for(p, mod, self._inner)
                )
            else:
                est = core.estimator.estimate(request.url.path, p.body)
            mml = await core.max_model_len(p, mod, self._inner)
            plan = core.finish_plan(request, p, est, mml)
            retry = core.retry
            state = None
            if retry is not None:
                # RedisRetryBudget records the request over the network: not on the event loop's thread.
                nra = getattr(retry, "new_request_async", None)
                state = await nra() if nra is not None else retry.new_request()
            ticket: Ticket | None = None
            attempt = 0
            while True:
                rem = core.check_deadline(plan, attempt)
                lease = await core.budget.acquire(
                    plan.blocks, priority=plan.priority, timeout=rem, ticket=ticket, held=plan.held,
                    **plan.acquire_kwargs(),
                )
                ticket = lease.ticket
                if state is not None:
                    state.ticket = ticket
                holder = _Holder(lease, core.settings.idle_stream_timeout_s, is_async=True)
                assembled = False
                try:
                    resp = await self._inner.handle_async_request(_request(request, plan))
                    if plan.upstream and _is_event_stream(resp):
                        resp = await _consume_async(core, plan, request, resp, holder)
                        assembled = True
                except Exception as exc:
                    await holder.release()
                    if state is None:
                        raise
                    d = await core.decide_async(
                        state, status=None, headers=None, error=exc, remaining_s=core.remaining(plan)
                    )
                    if not d.retry:
                        if d.error is not None and d.error is not exc:
                            raise d.error from exc
                        raise
                    logger.info("attempt %d failed (%s): retrying in %.3f s", attempt + 1, d.reason, d.delay_s)
                    await retry.sleep(d.delay_s)
                    attempt += 1
                    continue
                except BaseException:
                    await holder.release()
                    raise
                try:
                    if state is not None and resp.status_code >= 400:
                        d = await core.decide_async(
                            state, status=resp.status_code, headers=resp.headers, error=None,
                            remaining_s=core.remaining(plan),
                        )
                        if d.retry or d.error is not None:
                            await resp.aclose()
                            await holder.release()
                            if not d.retry:
                                raise d.error
                            logger.info(
                                "attempt %d got HTTP %d (%s): retrying in %.3f s",
                                attempt + 1, resp.status_code, d.reason, d.delay_s,
                            )
                            await retry.sleep(d.delay_s)
                            attempt += 1
                            continue
                    if assembled:  # consumed, observed and released already
                        return resp
                    scanner = _scanner_for(core, plan, resp, lease)
                    if _preread(resp):
                        await holder.release()
                        return _preread_response(core, plan, resp, scanner)
                    holder.resp = resp
                    _watchdog.add(holder)
                    return _response(resp, _AsyncBody(core, plan, resp, holder, scanner), scanner)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await resp.aclose()
                    await holder.release()
                    raise

        async def aclose(self) -> None:
            if self._close_inner:
                await self._inner.aclose()

    class AdmissionTransport(mod.BaseTransport):  # type: ignore[name-defined,misc]
        """Blocking admission transport (see :mod:`zp_client.transport`)."""

        def __init__(
            self,
            inner: Any | None = None,
            *,
            budget: Budget,
            settings: Settings | None = None,
            estimator: Any | None = None,
            retry: Any | None = None,
            close_inner: bool = True,
            forecaster: Any | None = None,
            oracle: bool = False,
            stream_upstream: bool | None = None,
        ) -> None:
            self._inner = inner if inner is not None else mod.HTTPTransport()
            self._core = _Core(budget, settings, estimator, retry, forecaster, oracle, stream_upstream)
            self._close_inner = close_inner

        @property
        def budget(self) -> Budget:
            return self._core.budget

        @property
        def forecaster(self) -> Any | None:
            """The output-length forecaster (elastic budgets; None under strict unless one was given)."""
            return self._core.forecaster

        def handle_request(self, request: Any) -> Any:
            if not is_admitted(request.method, request.url.path):
                return self._inner.handle_request(request)
            request.read()
            try:
                return self._admitted(request)
            except ZPError as exc:
                surfaced = self._core.surface(exc)
                if surfaced is exc:
                    raise
                raise surfaced from exc

        def _admitted(self, request: Any) -> Any:
            core = self._core
            p = core.parse(request)
            if p is None:
                return self._inner.handle_request(request)
            if core.settings.estimator == "server":
                est = core.estimator.estimate_sync_server(
                    request.url.path, p.body, core.server_for(p, mod, self._inner)
                )
            else:
                est = core.estimator.estimate(request.url.path, p.body)
            mml = core.max_model_len_sync(p, mod, self._inner)
            plan = core.finish_plan(request, p, est, mml)
            retry = core.retry
            state = retry.new_request() if retry is not None else None
            ticket: Ticket | None = None
            attempt = 0
            while True:
                rem = core.check_deadline(plan, attempt)
                lease = core.budget.acquire_sync(
                    plan.blocks, priority=plan.priority, timeout=rem, ticket=ticket, held=plan.held,
                    **plan.acquire_kwargs(),
                )
                ticket = lease.ticket
                if state is not None:
                    state.ticket = ticket
                holder = _Holder(lease, core.settings.idle_stream_timeout_s, is_async=False)
                assembled = False
                try:
                    resp = self._inner.handle_request(_request(request, plan))
                    if plan.upstream and _is_event_stream(resp):
                        resp = _consume_sync(core, plan, request, resp, holder)
                        assembled = True
                except Exception as exc:
                    holder.release_sync()
                    if state is None:
                        raise
                    d = retry.decide(
                        state, status=None, headers=None, error=exc, delivered=False,
                        remaining_s=core.remaining(plan),
                    )
                    if not d.retry:
                        if d.error is not None and d.error is not exc:
                            raise d.error from exc
                        raise
                    logger.info("attempt %d failed (%s): retrying in %.3f s", attempt + 1, d.reason, d.delay_s)
                    retry.sleep_sync(d.delay_s)
                    attempt += 1
                    continue
                except BaseException:
                    holder.release_sync()
                    raise
                try:
                    if state is not None and resp.status_code >= 400:
                        d = retry.decide(
                            state, status=resp.status_code, headers=resp.headers, error=None,
                            delivered=False, remaining_s=core.remaining(plan),
                        )
                        if d.retry or d.error is not None:
                            resp.close()
                            holder.release_sync()
                            if not d.retry:
                                raise d.error
                            logger.info(
                                "attempt %d got HTTP %d (%s): retrying in %.3f s",
                                attempt + 1, resp.status_code, d.reason, d.delay_s,
                            )
                            retry.sleep_sync(d.delay_s)
                            attempt += 1
                            continue
                    if assembled:  # consumed, observed and released already
                        return resp
                    scanner = _scanner_for(core, plan, resp, lease)
                    if _preread(resp):
                        holder.release_sync()
                        return _preread_response(core, plan, resp, scanner)
                    holder.resp = resp
                    _watchdog.add(holder)
                    return _response(resp, _SyncBody(core, plan, resp, holder, scanner), scanner)
                except BaseException:
                    resp.close()
                    holder.release_sync()
                    raise

        def close(self) -> None:
            if self._close_inner:
                self._inner.close()

    # httpx's classes keep the plain names; httpx2's carry a "2" so reprs and tracebacks tell them apart.
    suffix = "" if mod.__name__ == "httpx" else "2"
    for c in (AsyncAdmissionTransport, AdmissionTransport):
        c.__name__ = c.__qualname__ = c.__name__ + suffix
    AsyncAdmissionTransport.__module__ = __name__
    AdmissionTransport.__module__ = __name__
    return TransportClasses(mod, AsyncAdmissionTransport, AdmissionTransport)


_httpx_classes = transport_classes(httpx)
AsyncAdmissionTransport = _httpx_classes.AsyncAdmissionTransport
"""Async admission transport for ``httpx`` (openai 2.x, LangChain, AutoGen)."""
AdmissionTransport = _httpx_classes.AdmissionTransport
"""Blocking admission transport for ``httpx``."""


def _module_of(obj: Any) -> ModuleType:
    """``httpx`` or ``httpx2``, whichever defines the class of ``obj`` (a transport or client)."""
    top = type(obj).__module__.split(".")[0]
    for cls in type(obj).__mro__:
        top = cls.__module__.split(".")[0]
        if top in ("httpx", "httpx2"):
            break
    if top == "httpx2":
        import httpx2

        return httpx2
    if top == "httpx":
        return httpx
    raise ConfigurationError(
        f"cannot tell whether {type(obj).__name__} belongs to httpx or httpx2; pass an httpx or httpx2 "
        "transport (or use transport_classes(module) directly)"
    )


def admission_transport_for(inner: Any, *, budget: Budget, **options: Any) -> Any:
    """An admission transport of the right module and flavour (async or sync) for ``inner``."""
    classes = transport_classes(_module_of(inner))
    mod = classes.module
    if isinstance(inner, mod.AsyncBaseTransport):
        return classes.AsyncAdmissionTransport(inner, budget=budget, **options)
    if isinstance(inner, mod.BaseTransport):
        return classes.AdmissionTransport(inner, budget=budget, **options)
    raise ConfigurationError(f"{type(inner).__name__} is not an httpx/httpx2 transport")


def __getattr__(name: str) -> Any:
    # httpx2 is optional (openai 3.x brings it); its classes are built on first use.
    if name == "AsyncAdmissionTransport2":
        import httpx2

        return transport_classes(httpx2).AsyncAdmissionTransport
    if name == "AdmissionTransport2":
        import httpx2

        return transport_classes(httpx2).AdmissionTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
