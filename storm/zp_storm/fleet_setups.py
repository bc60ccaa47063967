"""The storm's fleet setups (``zp-client storm --replicas N``): several replicas behind a balancer.

Registered here (imported by :mod:`zp_storm.setups`, like the elastic setups):

* ``rr``: round-robin over the replicas (a Kubernetes Service's default), no admission, ``naive``'s
  retries (openai's 2 + the app retry), behind the gateway timeout. Balanced **per request** (each
  attempt, retries included, goes to the next replica): a Service balances per TCP connection, and
  openai keeps a pool of them, so per-request round-robin is the evenest version of it and the usual
  model of "round-robin".
* ``rr-zp``: ``rr`` under zp: ONE ``LocalBudget`` (strict, like ``zp-strict``) whose limit is the sum of
  the replicas' zp limits, ``zp-strict``'s retries; the round-robin transport sits UNDER zp's admission
  transport (``wrap()`` wraps the openai client's own transport, here the balancer).
* ``epp``: a reference endpoint picker shaped like llm-d's / the Gateway API Inference Extension's
  (GIE) EPP, built to win (:class:`EndpointPicker`): per request it scores every replica with fresh
  metrics and picks the best, and holds requests in a FIFO line while every replica is saturated;
  ``naive``'s retries (the EPP is a gateway: clients keep their own).

With ``--replicas N`` (N > 1) ``no-admission`` also balances round-robin (no retries, no gateway
timeout: the denominator). Defaults of the ``epp`` and their sources:

* prefix-cache scorer (GIE ``prefix-cache-scorer``, ``pkg/epp/scheduling/framework/plugins/multi/prefix/
  plugin.go``, https://github.com/kubernetes-sigs/gateway-api-inference-extension): the prompt (for chat,
  the JSON of the messages) cut into blocks of 64 characters (``DefaultBlockSize`` = 64: vLLM's 16-token
  block x 4 characters per token), chained hashes seeded with the model name, at most 256 blocks
  (``DefaultMaxPrefixBlocks``), an LRU index of 31250 entries per server
  (``DefaultLRUCapacityPerServer``); score = blocks matched from the start / blocks of the prompt; on
  pick the prompt's hashes are recorded on the chosen server.
* kv-cache-utilization scorer: ``1 - vllm:kv_cache_usage_perc``; queue scorer: ``(max - q) / (max -
  min)`` over the candidates' ``vllm:num_requests_waiting`` (1 when all are equal).
* weights prefix 3, queue 2, kv-cache-utilization 2: llm-d's default scheduling profile
  (``default-plugins.yaml`` of the llm-d router chart, also KServe's LLMInferenceService default
  EndpointPickerConfig); the max-score picker, ties broken at random (here: the run's seeded RNG).
* saturation detector (GIE ``pkg/epp/saturationdetector/config.go`` and ``saturationdetector.go``):
  ``QueueDepthThreshold`` 5, ``KVCacheUtilThreshold`` 0.8, ``MetricsStalenessThreshold`` 200 ms; a
  replica has capacity when its metrics are fresh and waiting <= 5 and KV <= 0.8; the fleet is saturated
  when no replica has capacity (a replica over either threshold has none).
* metrics refresh every 50 ms (GIE's pod metrics refresh interval).

What "built to win" adds to the reference: a replica's metrics count a request dispatched since its last
refresh as waiting (so a burst released from the line does not pile onto one replica between two
refreshes), and replicas with stale metrics (a dead one's /metrics fails) are not candidates. Each
router counts ``replica_requests`` (HTTP requests per replica) and ``moved_off_dead`` (attempts of a
request whose previous attempt failed at the transport level on one replica and that went to another).

For a setup of one's own (e.g. a ``zp.fleet.Fleet`` budget that routes itself): ``openai_client(ctx,
stack)`` reaches every replica through ``ctx.http_client()`` (its base URL is replica 0's; rewrite the
host per request), ``ctx.replica_base_urls`` / ``replica_root_urls`` / ``replica_limit_blocks`` describe
them; register with ``register_setup(SetupSpec(name, gateway=True, fleet=True, min_replicas=2,
default=False), factory)``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx

from zp_storm.loadgen import Caller
from zp_storm.setups import (
    AppCaller,
    SetupContext,
    SetupSpec,
    openai_client,
    register_setup,
    zp_client_for,
)

__all__ = [
    "EPP_DEFAULTS",
    "EndpointPicker",
    "HttpxEndpointPicker",
    "HttpxRoundRobin",
    "ReplicaRouter",
    "RoundRobin",
    "prompt_block_hashes",
    "router_http_client",
]

log = logging.getLogger("zp_storm.fleet_setups")

#: The ``epp``'s defaults (sources in the module docstring).
EPP_DEFAULTS: dict[str, Any] = {
    "block_chars": 64, "max_prefix_blocks": 256, "lru_capacity_per_server": 31250,
    "weight_prefix": 3.0, "weight_queue": 2.0, "weight_kv": 2.0,
    "queue_depth_threshold": 5, "kv_cache_util_threshold": 0.8,
    "metrics_staleness_s": 0.2, "refresh_s": 0.05,
}


def prompt_block_hashes(model: str, prompt: str, block_chars: int = 64, max_blocks: int = 256) -> list[int]:
    """GIE's approximate prefix hashes: ``prompt`` in blocks of ``block_chars`` characters (a shorter
    tail is dropped; at most ``max_blocks``), each block's hash chained to the previous one, the first
    seeded with the model name (blake2b-64 here, xxhash64 there)."""
    data = prompt.encode()[: block_chars * max_blocks]
    prev = hashlib.blake2b(model.encode(), digest_size=8).digest()
    out: list[int] = []
    for i in range(0, len(data) - block_chars + 1, block_chars):
        prev = hashlib.blake2b(data[i:i + block_chars] + prev, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


def _request_prompt(body: bytes) -> tuple[str, str]:
    """(model, prompt text) of an OpenAI request body: a chat's messages as JSON, or ``prompt``."""
    try:
        obj = json.loads(body or b"{}")
    except ValueError:
        return "", ""
    if not isinstance(obj, dict):
        return "", ""
    model = str(obj.get("model", ""))
    if "messages" in obj:
        return model, json.dumps(obj["messages"], separators=(",", ":"))
    return model, str(obj.get("prompt", ""))


class _WatchedStream:
    """A response body that reports a transport error while it is read (a reset mid-stream)."""

    def __init__(self, inner: Any, on_error: Any, errors: tuple[type[BaseException], ...]) -> None:
        self._inner, self._on_error, self._errors = inner, on_error, errors

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._inner:
                yield chunk
        except self._errors:
            self._on_error()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()


class ReplicaRouter:
    """An httpx / httpx2 transport that sends each request to one replica: :meth:`pick` chooses it, the
    request's URL gets that replica's scheme, host and port, and ``inner`` (a transport reaching every
    replica) carries it. Subclasses implement :meth:`pick`; build one with :func:`router_http_client`."""

    _lib: Any = httpx
    _stream_cls: Any = None

    def __init__(self, inner: Any, root_urls: list[str]) -> None:
        if not root_urls:
            raise ValueError("a replica router needs at least one replica")
        self.inner = inner
        lib = self._lib
        self._roots = [lib.URL(u) for u in root_urls]
        self.replica_requests = [0] * len(root_urls)
        """HTTP requests sent to each replica."""
        self.moved_off_dead = 0
        """Attempts of a request whose previous attempt failed at the transport level (refused, reset)
        on one replica and that went to another."""
        self.failed_attempts = [0] * len(root_urls)
        """Transport-level failures seen per replica."""
        self._failed_on: dict[str, int] = {}

    @property
    def replicas(self) -> int:
        return len(self._roots)

    async def pick(self, request: Any) -> int:
        raise NotImplementedError

    def _failed(self, rid: str | None, index: int) -> None:
        self.failed_attempts[index] += 1
        if rid:
            self._failed_on[rid] = index

    async def handle_async_request(self, request: Any) -> Any:
        index = await self.pick(request)
        rid = request.headers.get("x-request-id")
        prev = self._failed_on.pop(rid, None) if rid else None
        if prev is not None and prev != index:
            self.moved_off_dead += 1
        root = self._roots[index]
        request.url = request.url.copy_with(scheme=root.scheme, host=root.host, port=root.port)
        request.headers["Host"] = root.netloc.decode("ascii")
        self.replica_requests[index] += 1
        errors = (self._lib.TransportError,)
        try:
            response = await self.inner.handle_async_request(request)
        except errors:
            self._failed(rid, index)
            raise
        response.stream = self._stream_cls(response.stream, lambda: self._failed(rid, index), errors)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class RoundRobin(ReplicaRouter):
    """Per-request round-robin: replica 0, 1, ..., N-1, 0, ... (retries included)."""

    def __init__(self, inner: Any, root_urls: list[str]) -> None:
        super().__init__(inner, root_urls)
        self._next = 0

    async def pick(self, request: Any) -> int:
        index = self._next % self.replicas
        self._next += 1
        return index


class EndpointPicker(ReplicaRouter):
    """The reference llm-d / GIE endpoint picker (module docstring): prefix-cache, KV-utilization and
    queue scorers over metrics refreshed every 50 ms, a saturation detector, and a FIFO line for requests
    while every replica is saturated. :meth:`start` begins the metrics refresh (on the running loop);
    :meth:`stop` ends it."""

    def __init__(self, inner: Any, root_urls: list[str], metrics_client: Any, *, rng: random.Random,
                 **options: Any) -> None:
        super().__init__(inner, root_urls)
        unknown = set(options) - set(EPP_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown epp option(s): {', '.join(sorted(unknown))}")
        self.options = {**EPP_DEFAULTS, **options}
        self._metrics_client = metrics_client
        self._metrics_urls = [u.rstrip("/") + "/metrics" for u in root_urls]
        self.rng = rng
        n = len(root_urls)
        self.kv: list[float | None] = [None] * n
        self.waiting: list[float | None] = [None] * n
        self.read_at: list[float | None] = [None] * n
        self.dispatched_since = [0] * n
        """Requests sent to each replica since its last metrics refresh (counted as waiting)."""
        self._index: list[collections.OrderedDict[int, None]] = [collections.OrderedDict() for _ in range(n)]
        self._line: collections.deque[asyncio.Future[None]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._releasing = False
        self.held = 0
        """Requests that waited in the line (the fleet was saturated when they arrived)."""
        self.held_s = 0.0
        """Seconds they waited, in total."""
        self.prefix_hits = 0
        """Picks whose chosen replica matched at least one block of the prompt."""
        self.picks = 0

    # -- metrics ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh_loop(), name="zp-epp-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for fut in self._line:
            if not fut.done():
                fut.cancel()

    async def _read_one(self, i: int) -> None:
        try:
            r = await self._metrics_client.get(self._metrics_urls[i], timeout=1.0)
            text = r.text
        except Exception as exc:  # noqa: BLE001 - a dead or slow replica: its metrics go stale
            log.debug("epp: %s unreadable: %r", self._metrics_urls[i], exc)
            return
        kv = waiting = None
        for line in text.splitlines():
            if line.startswith("vllm:kv_cache_usage_perc"):
                kv = float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:num_requests_waiting"):
                waiting = float(line.rsplit(" ", 1)[1])
        if kv is None or waiting is None:
            return
        self.kv[i], self.waiting[i] = kv, waiting
        self.read_at[i] = asyncio.get_running_loop().time()
        self.dispatched_since[i] = 0

    async def refresh(self) -> None:
        """Read every replica's /metrics once, then release what the line can send."""
        await asyncio.gather(*(self._read_one(i) for i in range(self.replicas)))
        self._release()

    async def _refresh_loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(float(self.options["refresh_s"]))

    # -- scheduling ---------------------------------------------------------------------------------
    def _fresh(self) -> list[int]:
        now = asyncio.get_running_loop().time()
        stale = float(self.options["metrics_staleness_s"])
        return [i for i, t in enumerate(self.read_at) if t is not None and now - t <= stale]

    def _queue(self, i: int) -> float:
        return float(self.waiting[i] or 0.0) + self.dispatched_since[i]

    def has_capacity(self, i: int) -> bool:
        return bool(self._queue(i) <= float(self.options["queue_depth_threshold"])
                    and float(self.kv[i] or 0.0) <= float(self.options["kv_cache_util_threshold"]))

    def saturated(self) -> bool:
        """GIE's rule: saturated when no replica with fresh metrics has capacity."""
        return not any(self.has_capacity(i) for i in self._fresh())

    def _release(self) -> None:
        """Wake the head of the line when a replica has capacity, one at a time (the next is woken when
        this one has picked and counted its dispatch)."""
        while self._line and not self._releasing and not self.saturated():
            fut = self._line.popleft()
            if not fut.done():
                fut.set_result(None)
                self._releasing = True

    def _match(self, hashes: list[int]) -> list[int]:
        out = []
        for idx in self._index:
            n = 0
            for h in hashes:
                if h not in idx:
                    break
                n += 1
            out.append(n)
        return out

    def _record(self, i: int, hashes: list[int]) -> None:
        idx = self._index[i]
        cap = int(self.options["lru_capacity_per_server"])
        for h in hashes:
            if h in idx:
                idx.move_to_end(h)
            else:
                idx[h] = None
        while len(idx) > cap:
            idx.popitem(last=False)

    def scores(self, hashes: list[int], candidates: list[int]) -> dict[int, float]:
        """The weighted sum of the three scorers for each candidate replica."""
        o = self.options
        matched = self._match(hashes)
        total = len(hashes)
        queues = {i: self._queue(i) for i in candidates}
        qmax, qmin = max(queues.values()), min(queues.values())
        out = {}
        for i in candidates:
            prefix = matched[i] / total if total else 0.0
            queue = 1.0 if qmax == qmin else (qmax - queues[i]) / (qmax - qmin)
            kv = 1.0 - float(self.kv[i] or 0.0)
            out[i] = o["weight_prefix"] * prefix + o["weight_queue"] * queue + o["weight_kv"] * kv
        return out

    async def pick(self, request: Any) -> int:
        """The replica for ``request`` (waits in the line while the fleet is saturated)."""
        body = await request.aread()
        model, prompt = _request_prompt(body)
        hashes = prompt_block_hashes(model, prompt, int(self.options["block_chars"]),
                                     int(self.options["max_prefix_blocks"]))
        loop = asyncio.get_running_loop()
        if self._line or self._releasing or self.saturated():
            self.held += 1
            t = loop.time()
            head = False
            while True:
                fut: asyncio.Future[None] = loop.create_future()
                if head:
                    self._line.appendleft(fut)
                else:
                    self._line.append(fut)
                try:
                    await fut
                except BaseException:  # cancelled (the caller gave up): leave the line, pass the turn on
                    if fut in self._line:
                        self._line.remove(fut)
                    elif fut.done() and not fut.cancelled():
                        self._releasing = False
                        self._release()
                    raise
                self._releasing = False
                if not self.saturated():
                    break
                head = True  # saturated again before it ran: back to the head of the line
            self.held_s += loop.time() - t
        candidates = self._fresh() or list(range(self.replicas))
        scores = self.scores(hashes, candidates)
        best = max(scores.values())
        top = [i for i in candidates if scores[i] == best]
        index = top[0] if len(top) == 1 else self.rng.choice(top)
        self.picks += 1
        if hashes and self._match(hashes)[index]:
            self.prefix_hits += 1
        self._record(index, hashes)
        self.dispatched_since[index] += 1
        self._release()
        return index


class _HttpxStream(_WatchedStream, httpx.AsyncByteStream):
    """httpx's body class over :class:`_WatchedStream`."""


class HttpxRoundRobin(RoundRobin, httpx.AsyncBaseTransport):
    """:class:`RoundRobin` as an ``httpx`` transport (openai 2.x)."""

    _lib = httpx
    _stream_cls = _HttpxStream


class HttpxEndpointPicker(EndpointPicker, httpx.AsyncBaseTransport):
    """:class:`EndpointPicker` as an ``httpx`` transport (openai 2.x)."""

    _lib = httpx
    _stream_cls = _HttpxStream


def _router_classes(lib: Any) -> dict[str, type[ReplicaRouter]]:
    if lib is httpx:
        return {"rr": HttpxRoundRobin, "epp": HttpxEndpointPicker}
    if lib.__name__ == "httpx2":
        from zp_storm import _fleet2

        return {"rr": _fleet2.Httpx2RoundRobin, "epp": _fleet2.Httpx2EndpointPicker}
    raise ValueError(f"no replica router for {lib.__name__}")


def router_http_client(ctx: SetupContext, kind: str, **kwargs: Any) -> tuple[Any, Any]:
    """``(http_client, router)``: openai's default async HTTP client over a replica router (``kind``
    ``"rr"``: :class:`RoundRobin`, ``"epp"``: :class:`EndpointPicker`, with ``kwargs``) over
    :meth:`SetupContext.raw_transport`, routing among ``ctx``'s replicas."""
    import openai

    from zp_client.testing import openai_http_module

    cls = _router_classes(openai_http_module())[kind]
    router: Any = cls(ctx.raw_transport(), ctx.replica_root_urls, **kwargs)
    return openai.DefaultAsyncHttpxClient(transport=router), router


class FleetCaller(AppCaller):
    """An :class:`~zp_storm.setups.AppCaller` whose router's counters the storm reports."""

    def __init__(self, client: Any, model: str, router: ReplicaRouter, *, limit_blocks: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(client, model, **kwargs)
        self.router = router
        self.limit_blocks = limit_blocks
        """The setup's zp limit, for the report (None: no budget)."""

    @property
    def moved_off_dead(self) -> int:
        return self.router.moved_off_dead

    @property
    def replica_requests(self) -> list[int]:
        return list(self.router.replica_requests)


def _rr_client(ctx: SetupContext, stack: contextlib.AsyncExitStack,
               **kwargs: Any) -> tuple[Any, ReplicaRouter]:
    http_client, router = router_http_client(ctx, "rr")
    return openai_client(ctx, stack, http_client=http_client, **kwargs), router


async def fleet_no_admission(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """``no-admission`` for a fleet: round-robin, ``max_retries=0``, no app retry."""
    client, router = _rr_client(ctx, stack, max_retries=0)
    return FleetCaller(client, ctx.model, router, app_retry=False)


async def _rr(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    client, router = _rr_client(ctx, stack)  # openai's max_retries=2
    return FleetCaller(client, ctx.model, router, app_retry=True)


async def _rr_zp(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.budget.local import LocalBudget

    http_client, router = router_http_client(ctx, "rr")
    budget = LocalBudget(limit_blocks=sum(ctx.replica_limit_blocks), block_size=ctx.block_size,
                         policy="strict", clock=ctx.budget_clock())
    # the budget is the fleet's sum: the pool check against one replica's /metrics would warn wrongly
    client = await zp_client_for(ctx, stack, budget, http_client=http_client, pool_check=False)
    return FleetCaller(client, ctx.model, router, app_retry=True, limit_blocks=sum(ctx.replica_limit_blocks))


async def _epp(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    import httpx

    metrics = ctx.metrics_client()
    if metrics is None:
        metrics = httpx.AsyncClient(timeout=5)
    stack.push_async_callback(metrics.aclose)
    http_client, router = router_http_client(ctx, "epp", metrics_client=metrics,
                                             rng=random.Random(f"zp-storm-epp:{ctx.seed}"))
    assert isinstance(router, EndpointPicker)
    router.start()
    stack.push_async_callback(router.stop)
    await router.refresh()  # the first metrics before the first request
    client = openai_client(ctx, stack, http_client=http_client)
    return FleetCaller(client, ctx.model, router, app_retry=True)


# fleet setups: the defaults of --replicas N > 1; with one server they run only when named
register_setup(SetupSpec("rr", True, description="round-robin per request, no admission, naive's retries",
                         fleet=True, default=False), _rr)
register_setup(SetupSpec("rr-zp", True, description="round-robin under one zp LocalBudget (strict) of the "
                         "replicas' summed limits, zp-strict's retries", fleet=True, default=False),
               _rr_zp, after="rr")
register_setup(SetupSpec("epp", True, description="reference llm-d-style endpoint picker (prefix 3, queue 2, "
                         "KV 2; holds while saturated), naive's retries", fleet=True, default=False),
               _epp, after="rr-zp")


class ZPFleetCaller(AppCaller):
    """``zp-fleet``'s caller: its :class:`~zp_client.fleet.Fleet`'s counters, in the report's terms."""

    def __init__(self, client: Any, model: str, fleet: Any, urls: list[str]) -> None:
        super().__init__(client, model, app_retry=True)
        self.fleet = fleet
        self.urls = urls
        self.limit_blocks = fleet.limit

    @property
    def moved_off_dead(self) -> int:
        return int(self.fleet.status_sync().extra["moves"])

    @property
    def replica_requests(self) -> list[int]:
        reps = self.fleet.status_sync().extra["replicas"]
        return [int(reps[u]["placed"]) if u in reps else 0 for u in self.urls]


async def _zp_fleet(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """A :class:`zp_client.fleet.Fleet` of elastic budgets, one per replica (each sized like
    ``zp-elastic``'s from its pool), routing by prefix affinity then load, with zp's default retries and
    the app retry (``zp-elastic``'s stack). The openai client's base URL is replica 0's; the fleet sends
    each attempt to its lease's replica through ``ctx.http_client()``, which reaches them all."""
    from zp_client.fleet import Fleet
    from zp_storm.elastic_setups import _forecaster, _limit

    limit = _limit(ctx)  # every replica has the run's pool
    urls = [u.rstrip("/") for u in ctx.replica_base_urls]
    kw: dict[str, Any] = {}
    if ctx.elastic.starvation_bound_s is not None:
        kw["starvation_bound_s"] = ctx.elastic.starvation_bound_s
    if ctx.elastic.affinity_wait_s is not None:
        kw["affinity_wait_s"] = ctx.elastic.affinity_wait_s
    fleet = Fleet(dict.fromkeys(urls, limit), block_size=ctx.block_size, policy="elastic",
                  capacities=dict.fromkeys(urls, ctx.num_gpu_blocks - 1), clock=ctx.budget_clock(),
                  name=ctx.budget_name, **kw)
    client = await zp_client_for(ctx, stack, fleet, forecaster=_forecaster(ctx.elastic))
    return ZPFleetCaller(client, ctx.model, fleet, urls)


register_setup(SetupSpec("zp-fleet", True, description="zp Fleet: an elastic budget per replica, one fair "
                         "line, prefix-affinity routing, ejection; zp-elastic's retries", fleet=True,
                         default=False), _zp_fleet, after="epp")


async def _zp_fleet_strict(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """``zp-fleet`` with strict budgets (each replica's ``zp-strict`` limit): what ``zp-fleet-redis``
    runs in Redis (strict only there), in one process, so the two compare the backend alone."""
    from zp_client.fleet import Fleet

    urls = [u.rstrip("/") for u in ctx.replica_base_urls]
    fleet = Fleet(dict(zip(urls, ctx.replica_limit_blocks, strict=True)), block_size=ctx.block_size,
                  policy="strict", capacities=dict.fromkeys(urls, ctx.num_gpu_blocks - 1),
                  clock=ctx.budget_clock(), name=ctx.budget_name)
    client = await zp_client_for(ctx, stack, fleet)
    return ZPFleetCaller(client, ctx.model, fleet, urls)


async def _zp_fleet_redis(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """A :class:`zp_client.fleet.redis.RedisFleet` of elastic budgets (``zp-fleet``'s policy, limits and
    fleet settings) shared by the worker processes, each with its own client: the fleet's line, the
    replicas' budgets, the prefix index and the sessions live in Redis."""
    from zp_storm.elastic_setups import _forecaster, _limit

    urls = [u.rstrip("/") for u in ctx.replica_base_urls]
    fleet = _redis_fleet(ctx, dict.fromkeys(urls, _limit(ctx)), "elastic")
    client = await zp_client_for(ctx, stack, fleet, forecaster=_forecaster(ctx.elastic))
    return ZPFleetCaller(client, ctx.model, fleet, urls)


async def _zp_fleet_redis_strict(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """``zp-fleet-strict`` in Redis: a strict :class:`zp_client.fleet.redis.RedisFleet` shared by the
    worker processes (each replica's ``zp-strict`` limit)."""
    urls = [u.rstrip("/") for u in ctx.replica_base_urls]
    fleet = _redis_fleet(ctx, dict(zip(urls, ctx.replica_limit_blocks, strict=True)), "strict")
    client = await zp_client_for(ctx, stack, fleet)
    return ZPFleetCaller(client, ctx.model, fleet, urls)


def _redis_fleet(ctx: SetupContext, limits: dict[str, int], policy: str) -> Any:
    from zp_client.errors import ConfigurationError
    from zp_client.fleet.redis import RedisFleet

    if not ctx.redis_url:
        raise ConfigurationError("the zp-fleet-redis setups need --redis URL")
    kw: dict[str, Any] = {}
    if ctx.elastic.starvation_bound_s is not None:
        kw["starvation_bound_s"] = ctx.elastic.starvation_bound_s
    if ctx.elastic.affinity_wait_s is not None:
        kw["affinity_wait_s"] = ctx.elastic.affinity_wait_s
    return RedisFleet(ctx.redis_url, ctx.budget_name, limits, block_size=ctx.block_size, policy=policy,
                      capacities=dict.fromkeys(limits, ctx.num_gpu_blocks - 1), recovery_s=0.0, **kw)


register_setup(SetupSpec("zp-fleet-strict", True, description="zp-fleet with strict budgets "
                         "(each replica's zp-strict limit)", fleet=True, default=False,
                         min_replicas=2, fleet_default=False),
               _zp_fleet_strict, after="zp-fleet")
register_setup(SetupSpec("zp-fleet-redis", True, needs_redis=True, workers=3, description="RedisFleet "
                         "(zp-fleet's elastic budgets) shared by 3 worker processes", fleet=True,
                         default=False, min_replicas=2),
               _zp_fleet_redis, after="zp-fleet-strict")
register_setup(SetupSpec("zp-fleet-redis-strict", True, needs_redis=True, workers=3, description="RedisFleet "
                         "(strict, zp-fleet-strict's limits) shared by 3 worker processes", fleet=True,
                         default=False, min_replicas=2, fleet_default=False),
               _zp_fleet_redis_strict, after="zp-fleet-redis")
