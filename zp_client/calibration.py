"""Size a budget from the server itself: :func:`calibrate` reads vLLM's ``/metrics`` and ``/v1/models``.

    cal = calibrate("http://127.0.0.1:8000/v1")          # or "http://127.0.0.1:8000"
    print("\\n".join(cal.explain()))
    budget = LocalBudget(limit_blocks=cal.limit_blocks, block_size=cal.block_size)
    # the same in one call: LocalBudget.from_server(url) / RedisBudget.from_server(redis_url, name, url)

The limit is :func:`~zp_client.server.suggest_limit_blocks` of the pool ``vllm:cache_config_info``
reports (``floor((num_gpu_blocks - 1) x headroom)``, the policy's headroom by default), computed once:
nothing tracks the pool afterwards. A server whose ``/metrics`` is missing or lacks the pool raises
:class:`~zp_client.errors.CalibrationError`; nothing is guessed. See docs/admission.md#calibration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from zp_client.errors import CalibrationError, ConfigurationError, ServerInfoError
from zp_client.server import (
    ELASTIC_HEADROOM,
    STRICT_HEADROOM,
    ServerInfo,
    ServerMetrics,
    suggest_limit_blocks,
)

__all__ = ["Calibration", "calibrate", "calibrate_async", "server_root"]

#: The two names vLLM has exported KV usage under (``gpu_cache_usage_perc`` on older servers).
KV_USAGE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def server_root(url: str) -> str:
    """The server root of ``url``: ``http://h:8000/v1``, ``http://h:8000/v1/`` and ``http://h:8000`` all
    give ``http://h:8000`` (a gateway prefix stays: ``http://gw/llm/v1`` gives ``http://gw/llm``)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigurationError(f"the server URL must be http(s)://host:port[/v1], got {url!r}")
    root = url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` read from a server and the limit it derived; :meth:`explain` says how."""

    url: str
    """The server root that was asked (``/metrics`` there, ``/v1/models`` under it)."""
    num_gpu_blocks: int
    """vLLM's pool (``vllm:cache_config_info``), including its one null block."""
    block_size: int
    """Tokens per KV block (``vllm:cache_config_info``); the budget must use the same."""
    policy: str
    """``"elastic"`` or ``"strict"``: whose default headroom applies, and the budget's policy."""
    headroom: float
    """Share of the usable pool the budget leases."""
    headroom_is_default: bool
    """True when ``headroom`` is the policy's default (:data:`~zp_client.server.ELASTIC_HEADROOM` or
    :data:`~zp_client.server.STRICT_HEADROOM`), False when the caller chose it."""
    limit_blocks: int
    """``floor((num_gpu_blocks - 1) x headroom)``, as :func:`~zp_client.server.suggest_limit_blocks`."""
    max_model_len: int | None
    """The largest ``max_model_len`` of the cards in ``GET /v1/models``; None when unknown (see
    ``models_note``). Informational: the limit does not depend on it."""
    models: tuple[str, ...] = ()
    """The model ids ``GET /v1/models`` listed."""
    models_note: str | None = None
    """Why ``max_model_len`` is unknown (the models endpoint failed or its cards lack it); else None."""
    kv_cache_usage: float | None = None
    """KV usage when calibrated (0..1), from whichever of :data:`KV_USAGE_METRICS` the server exports."""
    kv_usage_metric: str | None = None
    """The metric name ``kv_cache_usage`` came from; None when the server exports neither."""
    num_requests_running: int | None = None
    """Requests running when calibrated (a busy server is fine: the pool does not depend on load)."""
    cache_config: Mapping[str, str] = field(default_factory=dict)
    """Every label of ``vllm:cache_config_info``, as exported (strings)."""

    @property
    def usable_blocks(self) -> int:
        """``num_gpu_blocks - 1``: vLLM's pool less its null block."""
        return self.num_gpu_blocks - 1

    @property
    def max_request_blocks(self) -> int | None:
        """Blocks one request of ``max_model_len`` tokens can hold (``ceil(max_model_len / block_size)``);
        None when ``max_model_len`` is unknown."""
        if self.max_model_len is None:
            return None
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def prefix_caching(self) -> bool | None:
        """The server's ``enable_prefix_caching`` label; None when not exported."""
        v = self.cache_config.get("enable_prefix_caching")
        return None if v is None else v.strip().lower() == "true"

    def code(self, cls: str = "LocalBudget") -> str:
        """The line to paste: ``LocalBudget(limit_blocks=..., block_size=...)`` (``policy`` when strict)."""
        extra = ", policy='strict'" if self.policy == "strict" else ""
        return f"{cls}(limit_blocks={self.limit_blocks}, block_size={self.block_size}{extra})"

    def explain(self) -> list[str]:
        """How the limit was reached, one fact per line (what ``zp-client calibrate`` prints)."""
        if self.headroom_is_default:
            const = "ELASTIC_HEADROOM" if self.policy == "elastic" else "STRICT_HEADROOM"
            why = f"the {self.policy} policy's default, zp_client.server.{const}"
        else:
            why = "given"
        lines = [
            f"server {self.url} (/metrics, /v1/models)",
            f"  num_gpu_blocks:  {self.num_gpu_blocks} (vllm:cache_config_info; includes 1 null block)",
            f"  block_size:      {self.block_size} tokens",
            f"  usable blocks:   {self.usable_blocks} (num_gpu_blocks - 1)",
        ]
        if self.max_model_len is not None:
            lines.append(f"  max_model_len:   {self.max_model_len} tokens "
                         f"({self.max_request_blocks} blocks for one request of full context)")
        else:
            lines.append(f"  max_model_len:   unknown ({self.models_note})")
        lines += [
            f"  policy:          {self.policy}",
            f"  headroom:        {self.headroom:g} ({why})",
            f"  limit_blocks:    {self.limit_blocks} = floor({self.usable_blocks} x {self.headroom:g})",
        ]
        if self.kv_cache_usage is not None:
            lines.append(f"  KV usage now:    {self.kv_cache_usage:.1%} "
                         f"({self.kv_usage_metric}; the limit does not depend on it)")
        if self.max_request_blocks is not None and self.max_request_blocks > self.limit_blocks:
            lines.append(f"  note: a request of max_model_len needs {self.max_request_blocks} blocks, "
                         "more than the limit: such requests fail with LeaseTooLarge")
        if self.prefix_caching is False:
            lines.append("  note: prefix caching is off on the server, so leases sharing a prefix do not "
                         "share its blocks there: start vLLM with prefix caching on (the V1 default)")
        lines.append("  computed once, not tracked: recalibrate after changing the model, the GPU, "
                     "--gpu-memory-utilization, --max-num-seqs or --block-size")
        return lines

    def as_dict(self) -> dict[str, object]:
        """Every field, the derived values and the line to paste, JSON-ready (``calibrate --json``)."""
        d = asdict(self)
        d["models"] = list(self.models)
        d["cache_config"] = dict(self.cache_config)
        d["usable_blocks"] = self.usable_blocks
        d["max_request_blocks"] = self.max_request_blocks
        d["code"] = self.code()
        return d


def _check_timeout(timeout_s: float) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigurationError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")


def _pool_error(root: str, exc: ServerInfoError) -> CalibrationError:
    """The calibration error for a ``/metrics`` that did not answer, answered an error, or was unreadable."""
    if exc.status == 0:
        missing = "/metrics did not answer"
    elif exc.status == 200:
        missing = "/metrics is not Prometheus text"
    else:
        missing = "no /metrics"
    return CalibrationError(f"{root}/metrics", missing, exc.status, " ".join(exc.detail.split())[:200])


def _read_models(status: int, body: bytes) -> tuple[tuple[str, ...], int | None, str | None]:
    """(model ids, largest max_model_len, why it is unknown) from a ``GET /v1/models`` answer."""
    if status != 200:
        why = f"GET /v1/models answered HTTP {status}" if status else "GET /v1/models did not answer"
        return (), None, why
    try:
        doc = json.loads(body)
        cards = doc.get("data", []) if isinstance(doc, dict) else []
    except ValueError:
        return (), None, "GET /v1/models returned no JSON"
    ids: list[str] = []
    lens: list[int] = []
    for card in cards if isinstance(cards, list) else []:
        if not isinstance(card, dict):
            continue
        if isinstance(card.get("id"), str):
            ids.append(card["id"])
        v = card.get("max_model_len")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            lens.append(int(v))
    if not lens:
        return tuple(ids), None, "the cards of GET /v1/models carry no max_model_len (not vLLM?)"
    return tuple(ids), max(lens), None


def _derive(root: str, m: ServerMetrics, models: tuple[tuple[str, ...], int | None, str | None],
            policy: str, headroom: float | None) -> Calibration:
    """The calibration from what was read (no I/O)."""
    url = f"{root}/metrics"
    if not m.cache_config:
        raise CalibrationError(url, "no vllm:cache_config_info in /metrics", 200,
                               "the server exports metrics but not vLLM's cache config")
    for key, value in (("num_gpu_blocks", m.num_gpu_blocks), ("block_size", m.block_size)):
        if value is None:
            raise CalibrationError(url, f"vllm:cache_config_info has no {key}", 200,
                                   f"its labels: {', '.join(sorted(m.cache_config)) or 'none'}")
    assert m.num_gpu_blocks is not None and m.block_size is not None  # checked just above
    limit = suggest_limit_blocks(m.num_gpu_blocks, headroom, policy=policy)
    default = ELASTIC_HEADROOM if policy == "elastic" else STRICT_HEADROOM
    used = headroom if headroom is not None else default
    if limit < 1:
        raise ConfigurationError(
            f"{root}: floor(({m.num_gpu_blocks} - 1) x {used:g}) = {limit} leaves the budget no block; "
            "raise the headroom or give the server a larger pool")
    metric = next((name for name in KV_USAGE_METRICS if name in m.samples), None)
    ids, max_len, note = models
    return Calibration(
        url=root, num_gpu_blocks=m.num_gpu_blocks, block_size=m.block_size, policy=policy, headroom=used,
        headroom_is_default=headroom is None, limit_blocks=limit, max_model_len=max_len, models=ids,
        models_note=note, kv_cache_usage=m.kv_cache_usage_perc, kv_usage_metric=metric,
        num_requests_running=None if m.num_requests_running is None else int(m.num_requests_running),
        cache_config=dict(m.cache_config),
    )


def _validate(url: str, policy: str, headroom: float | None, timeout_s: float) -> str:
    root = server_root(url)
    suggest_limit_blocks(2, headroom, policy=policy)  # the policy and headroom errors, before any I/O
    _check_timeout(timeout_s)
    return root


def calibrate(
    url: str,
    *,
    headroom: float | None = None,
    policy: str = "elastic",
    timeout_s: float = 5.0,
    headers: Mapping[str, str] | None = None,
) -> Calibration:
    """Read ``url``'s pool and context length and derive a budget limit (blocking, ``httpx``).

    ``url``: ``http://host:port`` or ``http://host:port/v1`` (a gateway prefix is kept). ``headroom``:
    share of the usable pool, default the ``policy``'s. ``headers`` go with both requests (e.g.
    ``Authorization`` for a server started with ``--api-key``); ``timeout_s`` bounds each request.
    Raises :class:`~zp_client.errors.CalibrationError` when ``/metrics`` does not answer 200 or lacks
    the pool, :class:`~zp_client.errors.ConfigurationError` for a bad argument. ``GET /v1/models``
    failing only leaves ``max_model_len`` unknown (it does not enter the limit).
    """
    import httpx

    root = _validate(url, policy, headroom, timeout_s)
    hdrs = {"accept": "application/json", **dict(headers or {})}
    with httpx.Client(timeout=timeout_s, trust_env=False, headers=hdrs) as http:

        def fetch(method: str, path: str, body: object) -> tuple[int, bytes]:
            r = http.request(method, root + path)
            return r.status_code, r.content

        try:
            m = ServerInfo(fetch_sync=fetch).metrics_sync()
        except ServerInfoError as exc:
            raise _pool_error(root, exc) from exc
        try:
            status, body = fetch("GET", "/v1/models", None)
        except httpx.HTTPError as exc:
            status, body = 0, str(exc).encode()
    return _derive(root, m, _read_models(status, body), policy, headroom)


async def calibrate_async(
    url: str,
    *,
    headroom: float | None = None,
    policy: str = "elastic",
    timeout_s: float = 5.0,
    headers: Mapping[str, str] | None = None,
) -> Calibration:
    """:func:`calibrate` on ``httpx.AsyncClient``, for code already in an event loop."""
    import httpx

    root = _validate(url, policy, headroom, timeout_s)
    hdrs = {"accept": "application/json", **dict(headers or {})}
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=hdrs) as http:

        async def fetch(method: str, path: str, body: object) -> tuple[int, bytes]:
            r = await http.request(method, root + path)
            return r.status_code, r.content

        try:
            m = await ServerInfo(fetch=fetch).metrics()
        except ServerInfoError as exc:
            raise _pool_error(root, exc) from exc
        try:
            status, body = await fetch("GET", "/v1/models", None)
        except httpx.HTTPError as exc:
            status, body = 0, str(exc).encode()
    return _derive(root, m, _read_models(status, body), policy, headroom)
