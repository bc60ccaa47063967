"""The prefill/decode storm setups (``--pd P:D``, issue 20), registered into :mod:`zp_client.bench.setups`
on import.

- ``pd-proxy``: vLLM's example P/D proxy (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``)
  as the app's HTTP transport: per request, round-robin over the prefill servers and, separately, over
  the decode servers; the prefill call is the caller's body with ``kv_transfer_params``
  (``do_remote_decode: true``), ``max_tokens`` and ``max_completion_tokens`` 1, ``stream`` false,
  ``stream_options``, ``min_tokens`` and ``min_completion_tokens`` dropped, one ``X-Request-Id`` shared
  with the decode call; the decode call is the caller's body with the ``kv_transfer_params`` the prefill
  answered (none: the decode server prefills locally, as the proxy does). No admission; ``naive``'s
  retry stack (openai's ``max_retries=2`` inside the app's tenacity retry), behind the gateway.
- ``pd-noadmission``: the same proxy, no retries, no gateway.
- ``zp-fleet-chunk512``: colocated ``zp-fleet`` with the knob a vLLM user tries first for ITL, a smaller
  prefill chunk (``long_prefill_token_threshold`` 512) on every server.

Colocated setups (``no-admission``, ``zp-fleet``, ``zp-fleet-chunk512``) run on P + D plain servers:
every server has the same blocks and step profile, whatever its role. ``zp-pd`` (the client's own
two-phase lease) is not built yet.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from typing import Any

import httpx

from zp_client.bench.fleet_setups import ZPFleetCaller, _zp_fleet
from zp_client.bench.loadgen import Caller
from zp_client.bench.setups import AppCaller, SetupContext, SetupSpec, openai_client, register_setup

__all__ = ["PD_SETUPS", "PREFILL_KV_PARAMS", "PDProxy", "decode_body", "prefill_body"]

PD_SETUPS: tuple[str, ...] = ("pd-proxy", "pd-noadmission")

#: What the toy proxy sends a prefill server.
PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}

#: The chunk ``zp-fleet-chunk512`` gives its servers (vLLM's ``long_prefill_token_threshold``).
CHUNK_TOKENS = 512


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The toy proxy's prefill request for a caller's body."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    return out


def decode_body(body: dict[str, Any], kv: Any) -> dict[str, Any]:
    """The toy proxy's decode request: the caller's body with the prefill's ``kv_transfer_params``."""
    out = dict(body)
    if isinstance(kv, dict) and kv:
        out["kv_transfer_params"] = kv
    return out


class PDProxy:
    """An httpx / httpx2 transport that is the toy proxy (module docstring). ``inner`` reaches every
    server; ``prefill_roots`` / ``decode_roots`` are the two pools' root URLs."""

    _lib: Any = httpx

    def __init__(self, inner: Any, prefill_roots: list[str], decode_roots: list[str]) -> None:
        if not prefill_roots or not decode_roots:
            raise ValueError("a P/D proxy needs at least one prefill and one decode server")
        self.inner = inner
        self._p = [self._lib.URL(u) for u in prefill_roots]
        self._d = [self._lib.URL(u) for u in decode_roots]
        self._pi = itertools.count()
        self._di = itertools.count()
        self.prefill_calls = 0
        self.prefill_failures = 0
        self.decode_without_kv = 0

    def _to(self, request: Any, root: Any, content: bytes) -> Any:
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"host", b"content-length")]
        headers.append((b"host", root.netloc))
        return self._lib.Request(request.method, request.url.copy_with(scheme=root.scheme, host=root.host,
                                                                         port=root.port),
                                 headers=headers, content=content, extensions=request.extensions)

    async def handle_async_request(self, request: Any) -> Any:
        if request.method != "POST" or not request.url.path.rstrip("/").endswith("/chat/completions"):
            root = self._d[next(self._di) % len(self._d)]
            return await self.inner.handle_async_request(self._to(request, root, request.content))
        body = json.loads(request.content)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        request.headers["X-Request-Id"] = rid
        proot = self._p[next(self._pi) % len(self._p)]
        self.prefill_calls += 1
        pre = await self.inner.handle_async_request(
            self._to(request, proot, json.dumps(prefill_body(body)).encode()))
        raw = await pre.aread()
        await pre.aclose()
        if pre.status_code >= 400:
            self.prefill_failures += 1
            return self._lib.Response(pre.status_code, headers=pre.headers, content=raw)
        try:
            kv = json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not kv:
            self.decode_without_kv += 1
        droot = self._d[next(self._di) % len(self._d)]
        return await self.inner.handle_async_request(
            self._to(request, droot, json.dumps(decode_body(body, kv)).encode()))

    async def aclose(self) -> None:
        await self.inner.aclose()


class HttpxPDProxy(PDProxy, httpx.AsyncBaseTransport):
    """:class:`PDProxy` as an ``httpx`` transport (openai 2.x)."""


def _proxy_class(lib: Any) -> type[PDProxy]:
    if lib is httpx:
        return HttpxPDProxy
    from zp_client.bench._fleet2 import Httpx2PDProxy

    return Httpx2PDProxy


class PDCaller(AppCaller):
    """An :class:`~zp_client.bench.setups.AppCaller` over the proxy (its counters for the report)."""

    def __init__(self, client: Any, model: str, proxy: PDProxy, **kwargs: Any) -> None:
        super().__init__(client, model, **kwargs)
        self.proxy = proxy


def _proxy_client(ctx: SetupContext, stack: contextlib.AsyncExitStack,
                  **kwargs: Any) -> tuple[Any, PDProxy]:
    import openai

    from zp_client.bench.memory import openai_http_module

    roles = ctx.replica_roles
    pre = [u for u, r in zip(ctx.replica_root_urls, roles, strict=True) if r == "prefill"]
    dec = [u for u, r in zip(ctx.replica_root_urls, roles, strict=True) if r == "decode"]
    proxy: Any = _proxy_class(openai_http_module())(ctx.raw_transport(), pre, dec)
    http_client = openai.DefaultAsyncHttpxClient(transport=proxy)
    return openai_client(ctx, stack, http_client=http_client, **kwargs), proxy


async def _pd_proxy(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    client, proxy = _proxy_client(ctx, stack)  # openai's max_retries=2
    return PDCaller(client, ctx.model, proxy, app_retry=True)


async def _pd_noadmission(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    client, proxy = _proxy_client(ctx, stack, max_retries=0)
    return PDCaller(client, ctx.model, proxy, app_retry=False)


async def _zp_fleet_chunk(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    caller = await _zp_fleet(ctx, stack)
    assert isinstance(caller, ZPFleetCaller)
    return caller


register_setup(SetupSpec("pd-proxy", True, description="vLLM's toy P/D proxy (round-robin per pool), no "
                         "admission, naive's retries", fleet=True, default=False, fleet_default=False,
                         min_replicas=2, pd=True), _pd_proxy, after="zp-fleet-redis-strict")
register_setup(SetupSpec("pd-noadmission", False, description="the toy P/D proxy, no retries, no gateway",
                         fleet=True, default=False, fleet_default=False, min_replicas=2, pd=True),
               _pd_noadmission, after="pd-proxy")
register_setup(SetupSpec("zp-fleet-chunk512", True, description="zp-fleet on servers with a 512-token "
                         "prefill chunk (long_prefill_token_threshold)", fleet=True, default=False,
                         fleet_default=False, sim_extra={"long_prefill_token_threshold": CHUNK_TOKENS}),
               _zp_fleet_chunk, after="pd-noadmission")
