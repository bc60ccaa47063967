"""The prefill/decode storm setups (``--pd P:D``, issue 20), registered into :mod:`zp_storm.setups`
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
two-phase lease, :mod:`zp_client.fleet.pd`) runs on the P/D servers.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from typing import Any

import httpx

from zp_client.fleet.pd import PREFILL_KV_PARAMS, decode_body, prefill_body
from zp_storm.fleet_setups import ZPFleetCaller, _zp_fleet
from zp_storm.loadgen import Caller
from zp_storm.setups import (
    AppCaller,
    SetupContext,
    SetupSpec,
    openai_client,
    register_setup,
    zp_client_for,
)

__all__ = ["PD_SETUPS", "PREFILL_KV_PARAMS", "PDProxy", "decode_body", "prefill_body"]

PD_SETUPS: tuple[str, ...] = ("pd-proxy", "pd-noadmission", "zp-pd")

#: The chunk ``zp-fleet-chunk512`` gives its servers (vLLM's ``long_prefill_token_threshold``).
CHUNK_TOKENS = 512


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
    from zp_storm._fleet2 import Httpx2PDProxy

    return Httpx2PDProxy


class PDCaller(AppCaller):
    """An :class:`~zp_storm.setups.AppCaller` over the proxy (its counters for the report)."""

    def __init__(self, client: Any, model: str, proxy: PDProxy, **kwargs: Any) -> None:
        super().__init__(client, model, **kwargs)
        self.proxy = proxy


def _proxy_client(ctx: SetupContext, stack: contextlib.AsyncExitStack,
                  **kwargs: Any) -> tuple[Any, PDProxy]:
    import openai

    from zp_client.testing import openai_http_module

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


class ZPPDCaller(ZPFleetCaller):
    """``zp-pd``'s caller: the decode fleet's counters, the two-phase lease's, and each replica's charged
    blocks for the held-vs-allocated timeline (in the run's replica order)."""

    def __init__(self, client: Any, model: str, fleet: Any, prefill: Any, roles: list[str | None],
                 urls: list[str]) -> None:
        super().__init__(client, model, fleet, urls)
        self.prefill = prefill
        self._order = [(prefill if r == "prefill" else fleet, u) for u, r in zip(urls, roles, strict=True)]
        self.limit_blocks = fleet.limit + prefill.limit

    @property
    def pd_counts(self) -> dict[str, int]:
        return dict(self.fleet.pd.counts)

    @property
    def replica_requests(self) -> list[int]:
        out = []
        for f, u in self._order:
            reps = f.status_sync().extra["replicas"]
            out.append(int(reps[u]["placed"]) if u in reps else 0)
        return out

    def charged_blocks(self) -> list[int]:
        """Per replica (run order): the blocks its budget counts against it now (the policy's used)."""
        out = []
        for f, u in self._order:
            rep = f.ledger.replicas.get(u)
            out.append(0 if rep is None else int(rep.ledger.used))
        return out


async def _zp_pd(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """``zp-pd``: the client's own two-phase lease (:mod:`zp_client.fleet.pd`). An elastic
    :class:`~zp_client.fleet.Fleet` of the decode servers (``zp-fleet``'s settings and limit per replica)
    disaggregated with a strict Fleet of the prefill servers (the same limit), the run's scaled
    ``kv_lease_s``; zp's default retries and the app retry, as ``zp-fleet``."""
    from zp_client.fleet import Fleet
    from zp_storm.elastic_setups import _forecaster, _limit

    limit = _limit(ctx)
    urls = [u.rstrip("/") for u in ctx.replica_base_urls]
    roles = ctx.replica_roles
    pre = [u for u, r in zip(urls, roles, strict=True) if r == "prefill"]
    dec = [u for u, r in zip(urls, roles, strict=True) if r == "decode"]
    kw: dict[str, Any] = {}
    if ctx.elastic.starvation_bound_s is not None:
        kw["starvation_bound_s"] = ctx.elastic.starvation_bound_s
    caps = {u: ctx.num_gpu_blocks - 1 for u in urls}
    prefill = Fleet(dict.fromkeys(pre, limit), block_size=ctx.block_size, policy="strict",
                    capacities={u: caps[u] for u in pre}, clock=ctx.budget_clock(),
                    name=ctx.budget_name + "-prefill")
    fleet = Fleet(dict.fromkeys(dec, limit), block_size=ctx.block_size, policy="elastic",
                  capacities={u: caps[u] for u in dec}, clock=ctx.budget_clock(), name=ctx.budget_name,
                  **kw).disaggregate(prefill, threshold_tokens=ctx.elastic.pd_threshold_tokens,
                                     kv_lease_s=ctx.kv_lease_s)
    client = await zp_client_for(ctx, stack, fleet, forecaster=_forecaster(ctx.elastic))
    return ZPPDCaller(client, ctx.model, fleet, prefill, list(roles), urls)


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
register_setup(SetupSpec("zp-pd", True, description="zp's two-phase lease: an elastic decode fleet "
                         "disaggregated with a strict prefill fleet, conditional on the uncached prompt",
                         fleet=True, default=False, fleet_default=False, min_replicas=2, pd=True),
               _zp_pd, after="zp-fleet-chunk512")
