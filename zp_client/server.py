"""What the client reads from the server: ``/v1/models``, ``POST /tokenize`` and ``/metrics``.

:class:`ServerInfo` does no HTTP of its own: it calls a *fetch* function the caller provides (so it runs
over ``httpx`` or ``httpx2``, and the transport can hand it one that bypasses admission).
:func:`suggest_limit_blocks` turns ``num_gpu_blocks`` into a budget limit. The fetch convention: see
docs/admission.md#reading-the-server; choosing the limit: docs/admission.md#choosing-limit_blocks.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import ConfigurationError, ServerInfoError, install_hint

if TYPE_CHECKING:  # pragma: no cover
    import anyio

    from zp_client.config import Settings

__all__ = [
    "ELASTIC_HEADROOM",
    "STRICT_HEADROOM",
    "AsyncFetch",
    "SyncFetch",
    "ServerInfo",
    "ServerMetrics",
    "parse_metrics",
    "resolve_url",
    "suggest_limit_blocks",
    "tokenize_request",
]

logger = logging.getLogger("zp_client.server")
_now = SYSTEM_CLOCK.monotonic  # the failed-GET-models back-off is real time

AsyncFetch = Callable[[str, str, object], Awaitable[tuple[int, bytes]]]
"""(method, path, json_body or None) -> (status, body). ``path``: docs/admission.md#reading-the-server."""
SyncFetch = Callable[[str, str, object], tuple[int, bytes]]
_F = TypeVar("_F", AsyncFetch, SyncFetch)

# After a failed GET models, ask again no sooner than this: a down server must not be asked on
# every request.
_MODELS_RETRY_S = 30.0


def resolve_url(base_url: str, path: str) -> str:
    """The absolute URL of ``path`` under the fetch convention (see docs/admission.md#reading-the-server).

    >>> resolve_url("http://h:8000/v1", "models")
    'http://h:8000/v1/models'
    >>> resolve_url("http://h:8000/v1/", "/tokenize")
    'http://h:8000/tokenize'
    """
    base = base_url.rstrip("/")
    if path.startswith("/"):
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        return base + path
    return f"{base}/{path}"


#: Share of the usable pool an ``elastic`` budget leases when every client goes through zp: all of it.
#: The reserve for forecast error lives in the policy (``ElasticPolicy``'s ``reserve_k`` and ``reserve_z``,
#: sized by the live leases' forecast spread), not in the suggested limit: a limit set by hand is used as
#: given, and the policy's reserve is kept below it (a hand-set limit that already leaves a share of the
#: pool free keeps both). Until issue 30 the reserve was this headroom, 0.90: a flat 10% that cost 5-37
#: points of requests within their TTFT target at 1x (docs/benchmark.md#the-overload-curve) and still
#: preempted under overload with lengths read short (docs/elastic.md#censored-lengths). With the
#: censoring-aware forecaster and the spread reserve, 1.0 held 0 preemptions at every load up to 4x on
#: the tuning and held-out seeds (docs/elastic.md#the-default-reserve, ``benchmarks/reserve_overload.py``).
ELASTIC_HEADROOM = 1.0
#: Share of the usable pool a ``strict`` budget leases (the original, conservative margin).
STRICT_HEADROOM = 0.95


def suggest_limit_blocks(
    num_gpu_blocks: int, headroom: float | None = None, *, policy: str = "elastic"
) -> int:
    """A budget limit for a server with ``num_gpu_blocks`` KV blocks: ``floor((N - 1) * headroom)``.

    vLLM's pool includes one null block, so ``N - 1`` are usable. ``headroom`` defaults to the policy's:
    :data:`ELASTIC_HEADROOM` for ``"elastic"`` (1.0), :data:`STRICT_HEADROOM` for ``"strict"`` (0.95).
    Lower it to leave room for what the budget does not see (requests from clients without zp-client).
    """
    if policy not in ("elastic", "strict"):
        raise ConfigurationError(f"policy must be 'elastic' or 'strict', got {policy!r}")
    if headroom is None:
        headroom = ELASTIC_HEADROOM if policy == "elastic" else STRICT_HEADROOM
    if num_gpu_blocks < 1:
        raise ConfigurationError(f"num_gpu_blocks must be >= 1, got {num_gpu_blocks}")
    if not 0 < headroom <= 1:
        raise ConfigurationError(f"headroom must be in (0, 1], got {headroom}")
    return max(0, math.floor((num_gpu_blocks - 1) * headroom))


@dataclass(frozen=True)
class ServerMetrics:
    """The part of vLLM's ``/metrics`` the client uses. Values are summed over engines (label sets);
    KV usage is the highest engine's. A field is None when the server does not export it."""

    kv_cache_usage_perc: float | None
    """0..1 (``vllm:kv_cache_usage_perc``, or ``vllm:gpu_cache_usage_perc`` on older servers)."""
    num_requests_running: float | None
    num_requests_waiting: float | None
    num_preemptions_total: float | None
    block_size: int | None
    """From ``vllm:cache_config_info``."""
    num_gpu_blocks: int | None
    """From ``vllm:cache_config_info``; includes vLLM's null block."""
    cache_config: dict[str, str] = field(default_factory=dict)
    """All labels of ``vllm:cache_config_info`` (strings, as exported)."""
    samples: dict[str, float] = field(default_factory=dict)
    """Every sample, by full sample name (``vllm:prompt_tokens_total``...), summed over label sets."""


def parse_metrics(text: str) -> ServerMetrics:
    """Parse Prometheus text exposition (vLLM's ``/metrics``) with ``prometheus_client``'s parser."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigurationError(
            f"reading /metrics needs prometheus-client: {install_hint('sim')} "
            "(or pip install prometheus-client)"
        ) from exc
    samples: dict[str, float] = {}
    maxima: dict[str, float] = {}
    cache_config: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                samples[s.name] = samples.get(s.name, 0.0) + float(s.value)
                maxima[s.name] = max(maxima.get(s.name, float("-inf")), float(s.value))
                if s.name == "vllm:cache_config_info" and not cache_config:
                    cache_config = dict(s.labels)
    except ValueError as exc:
        raise ServerInfoError("/metrics", 200, f"unparseable Prometheus text ({exc})") from exc

    def _int(key: str) -> int | None:
        try:
            v = cache_config.get(key)
            return int(float(v)) if v not in (None, "", "None") else None
        except ValueError:
            return None

    usage = maxima.get("vllm:kv_cache_usage_perc", maxima.get("vllm:gpu_cache_usage_perc"))
    return ServerMetrics(
        kv_cache_usage_perc=usage,
        num_requests_running=samples.get("vllm:num_requests_running"),
        num_requests_waiting=samples.get("vllm:num_requests_waiting"),
        num_preemptions_total=samples.get("vllm:num_preemptions_total"),
        block_size=_int("block_size"),
        num_gpu_blocks=_int("num_gpu_blocks"),
        cache_config=cache_config,
        samples=samples,
    )


def tokenize_request(path: str, body: Mapping[str, object]) -> list[dict[str, object]]:
    """The ``POST /tokenize`` bodies that count ``body``'s prompt: one chat-form request for a chat
    body, one completion-form request per prompt for a completions body (token-id prompts need none)."""
    model = body.get("model")
    base: dict[str, object] = {"model": model} if isinstance(model, str) else {}
    if "messages" in body or path.rstrip("/").endswith("chat/completions"):
        req = dict(base, messages=body.get("messages") or [], add_generation_prompt=True)
        if body.get("tools"):
            req["tools"] = body["tools"]
        for key in ("chat_template", "chat_template_kwargs"):
            if body.get(key) is not None:
                req[key] = body[key]
        return [req]
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    return [dict(base, prompt=p, add_special_tokens=True) for p in prompts if isinstance(p, str)]


def _token_count(prompt: object) -> int | None:
    """Length of a token-id prompt (the longest, for a batch of token-id lists); None for text."""
    if isinstance(prompt, list) and prompt:
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)
        lens = [len(p) for p in prompt if isinstance(p, list) and all(isinstance(x, int) for x in p)]
        return max(lens) if lens else None
    return None


async def _ask(fetch: AsyncFetch, what: str, method: str, path: str, payload: object) -> tuple[int, bytes]:
    """One fetch. By the fetch convention a raise means no response arrived: that becomes a
    :class:`~zp_client.errors.ServerInfoError` with status 0, the original error as its cause."""
    try:
        return await fetch(method, path, payload)
    except Exception as exc:
        raise ServerInfoError(what, 0, str(exc)) from exc


def _ask_sync(fetch: SyncFetch, what: str, method: str, path: str, payload: object) -> tuple[int, bytes]:
    """Synchronous counterpart of :func:`_ask`."""
    try:
        return fetch(method, path, payload)
    except Exception as exc:
        raise ServerInfoError(what, 0, str(exc)) from exc


def _error_detail(body: bytes) -> str:
    try:
        doc = json.loads(body)
        err = doc.get("error", doc) if isinstance(doc, dict) else doc
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    except ValueError:
        return body[:300].decode("utf-8", "replace")


class ServerInfo:
    """Facts about one server, fetched lazily and cached. Safe to share between tasks and threads.

    ``fetch`` serves the async methods and ``fetch_sync`` the ``*_sync`` ones; calling a method whose
    fetch is missing raises :class:`~zp_client.errors.ConfigurationError`.
    """

    def __init__(
        self,
        *,
        fetch: AsyncFetch | None = None,
        fetch_sync: SyncFetch | None = None,
        settings: Settings | None = None,
    ) -> None:
        self._fetch = fetch
        self._fetch_sync = fetch_sync
        self._settings = settings
        self._models: dict[str, int | None] | None = None
        self._models_failed_at: float | None = None
        self._vllm = False
        self._lock = threading.Lock()
        self._alock: anyio.Lock | None = None  # made on first async use

    @classmethod
    def from_url(
        cls,
        base_url: str,
        *,
        http: Any | None = None,
        headers: Mapping[str, str] | None = None,
        settings: Settings | None = None,
        timeout: float = 10.0,
    ) -> ServerInfo:
        """A ServerInfo for the server at ``base_url`` (the OpenAI base URL, e.g. ``http://h:8000/v1``).

        ``http`` is an ``httpx`` / ``httpx2`` client to send through: an ``AsyncClient`` serves the async
        methods, a ``Client`` the ``*_sync`` ones (the other flavour then raises ConfigurationError).
        Without it every fetch uses a short-lived ``httpx`` client (metadata calls are rare: models are
        cached), and both flavours work. ``headers`` (e.g. ``Authorization``) go with every call;
        ``timeout`` bounds each call when no client is given.
        """
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ConfigurationError(
                f"base_url must be an http(s) URL such as http://host:8000/v1, got {base_url!r}")
        hdrs = {"accept": "application/json", **dict(headers or {})}

        def kwargs(payload: object) -> dict[str, Any]:
            kw: dict[str, Any] = {"headers": hdrs}
            if payload is not None:
                kw["json"] = payload
            return kw

        fetch: AsyncFetch | None = None
        fetch_sync: SyncFetch | None = None
        is_async = http is not None and hasattr(http, "aclose")
        if http is None or is_async:

            async def fetch(method: str, path: str, payload: object = None) -> tuple[int, bytes]:
                url = resolve_url(base_url, path)
                if http is not None:
                    r = await http.request(method, url, **kwargs(payload))
                    return r.status_code, r.content
                import httpx

                async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
                    r = await client.request(method, url, **kwargs(payload))
                    return r.status_code, r.content

        if http is None or not is_async:

            def fetch_sync(method: str, path: str, payload: object = None) -> tuple[int, bytes]:
                url = resolve_url(base_url, path)
                if http is not None:
                    r = http.request(method, url, **kwargs(payload))
                    return r.status_code, r.content
                import httpx

                with httpx.Client(timeout=timeout, trust_env=False) as client:
                    r = client.request(method, url, **kwargs(payload))
                    return r.status_code, r.content

        return cls(fetch=fetch, fetch_sync=fetch_sync, settings=settings)

    # --- max_model_len ---------------------------------------------------------------------------
    def _configured_len(self) -> int | None:
        if self._settings is None:
            from zp_client.config import Settings

            self._settings = Settings()
        return self._settings.max_model_len

    def _lookup(self, model: str | None) -> int | None:
        models = self._models or {}
        if model is not None and model in models:
            return models[model]
        # Unknown or unnamed model: the largest context served is the bound that never refuses a
        # request the server would take (and keeps the KV bound an upper bound).
        lens = [v for v in models.values() if v is not None]
        return max(lens) if lens else None

    def _should_fetch_models(self) -> bool:
        if self._models is not None:
            return False
        return self._models_failed_at is None or _now() - self._models_failed_at >= _MODELS_RETRY_S

    def _store_models(self, status: int, body: bytes) -> None:
        if status != 200:
            self._models_failed_at = _now()
            logger.warning("GET models answered HTTP %s; max_model_len unknown for now (%s)", status,
                           _error_detail(body))
            return
        try:
            doc = json.loads(body)
            cards = doc.get("data", []) if isinstance(doc, dict) else []
            models: dict[str, int | None] = {}
            vllm = False
            for card in cards:
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    v = card.get("max_model_len")
                    models[card["id"]] = (
                        int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None)
                    # vLLM's cards say owned_by "vllm" (OpenAI's name the organisation)
                    vllm = vllm or card.get("owned_by") == "vllm"
        except (ValueError, AttributeError) as exc:
            self._models_failed_at = _now()
            logger.warning("GET models returned an unreadable body (%s); max_model_len unknown for now", exc)
            return
        self._models = models
        self._vllm = vllm

    @property
    def is_vllm(self) -> bool:
        """True once ``GET models`` was read and a card says ``owned_by: "vllm"``. Never fetches: False
        until some call fetched the models (``max_model_len``), and whenever that failed."""
        return self._vllm

    async def max_model_len(self, model: str | None) -> int | None:
        """The model's context length: ``Settings.max_model_len`` when set, else the ``max_model_len`` of
        its card in ``GET models`` (fetched once, then cached; after a failure, asked again no sooner
        than 30 s later). None when unknown. For an unknown model name, the largest served length."""
        configured = self._configured_len()
        if configured is not None:
            return configured
        if self._should_fetch_models():
            if self._alock is None:
                import anyio

                self._alock = anyio.Lock()
            async with self._alock:
                if self._should_fetch_models():
                    fetch = self._need(self._fetch, "fetch")
                    try:
                        status, body = await _ask(fetch, "GET models", "GET", "models", None)
                    except ServerInfoError as exc:
                        self._models_failed_at = _now()
                        logger.warning("GET models failed (%s); max_model_len unknown for now", exc.__cause__)
                        return None
                    self._store_models(status, body)
        return self._lookup(model)

    def max_model_len_sync(self, model: str | None) -> int | None:
        """Synchronous counterpart of :meth:`max_model_len`."""
        configured = self._configured_len()
        if configured is not None:
            return configured
        if self._should_fetch_models():
            with self._lock:
                if self._should_fetch_models():
                    fetch = self._need(self._fetch_sync, "fetch_sync")
                    try:
                        status, body = _ask_sync(fetch, "GET models", "GET", "models", None)
                    except ServerInfoError as exc:
                        self._models_failed_at = _now()
                        logger.warning("GET models failed (%s); max_model_len unknown for now", exc.__cause__)
                        return None
                    self._store_models(status, body)
        return self._lookup(model)

    # --- tokenize --------------------------------------------------------------------------------
    def _read_count(self, status: int, body: bytes) -> int:
        if status != 200:
            raise ServerInfoError("POST /tokenize", status, _error_detail(body))
        try:
            doc = json.loads(body)
            if isinstance(doc.get("count"), int):
                return int(doc["count"])
            return len(doc["tokens"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ServerInfoError("POST /tokenize", status, f"unexpected body ({exc})") from exc

    async def tokenize(self, path: str, body: Mapping[str, object]) -> int:
        """Exact prompt tokens of one sequence of the request ``body`` sent to ``path``, from the
        server's ``POST /tokenize`` (chat form for chat bodies; for several prompts, the longest).
        Raises :class:`~zp_client.errors.ServerInfoError` when the server cannot answer."""
        fetch = self._need(self._fetch, "fetch")
        best = _token_count(body.get("prompt")) or 0
        for req in tokenize_request(path, body):
            status, raw = await _ask(fetch, "POST /tokenize", "POST", "/tokenize", req)
            best = max(best, self._read_count(status, raw))
        return best

    def tokenize_sync(self, path: str, body: Mapping[str, object]) -> int:
        """Synchronous counterpart of :meth:`tokenize`."""
        fetch = self._need(self._fetch_sync, "fetch_sync")
        best = _token_count(body.get("prompt")) or 0
        for req in tokenize_request(path, body):
            status, raw = _ask_sync(fetch, "POST /tokenize", "POST", "/tokenize", req)
            best = max(best, self._read_count(status, raw))
        return best

    # --- metrics ---------------------------------------------------------------------------------
    async def metrics(self) -> ServerMetrics:
        """``GET /metrics`` (server root), parsed. Not cached: each call asks the server."""
        fetch = self._need(self._fetch, "fetch")
        status, raw = await _ask(fetch, "GET /metrics", "GET", "/metrics", None)
        if status != 200:
            raise ServerInfoError("GET /metrics", status, _error_detail(raw))
        return parse_metrics(raw.decode("utf-8", "replace"))

    def metrics_sync(self) -> ServerMetrics:
        """Synchronous counterpart of :meth:`metrics`."""
        fetch = self._need(self._fetch_sync, "fetch_sync")
        status, raw = _ask_sync(fetch, "GET /metrics", "GET", "/metrics", None)
        if status != 200:
            raise ServerInfoError("GET /metrics", status, _error_detail(raw))
        return parse_metrics(raw.decode("utf-8", "replace"))

    @staticmethod
    def _need(fn: _F | None, name: str) -> _F:
        if fn is None:
            raise ConfigurationError(
                f"ServerInfo was built without {name!r}; pass {name}=... to use this method")
        return fn
