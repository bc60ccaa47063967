"""The client setups the storm compares. Each replays the same workload against a fresh server.

``no-admission``, ``naive``, ``rate-limited``, ``zp-strict``, ``zp-redis`` and ``clairvoyant`` are
registered here (the elastic ones in :mod:`zp_storm.elastic_setups`). What each setup is, how the
zp limit is read from the server, and the scaling of client-side sleeps to virtual time: see
docs/benchmark.md#setups.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import time as _time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from zp_client.errors import ConfigurationError
from zp_storm.loadgen import Caller, RequestRecord, VirtualClock, stream_chat
from zp_storm.tuning import ElasticTuning
from zp_storm.workloads import Turn

__all__ = [
    "ALL_SETUPS",
    "DEFAULT_SETUPS",
    "HEADROOM",
    "SETUPS",
    "APP_RETRY",
    "AppCaller",
    "SetupContext",
    "SetupFactory",
    "SetupSpec",
    "open_caller",
    "openai_client",
    "parse_setups",
    "register_setup",
    "zp_client_for",
    "zp_limit_blocks",
]

log = logging.getLogger("zp_storm.setups")

#: Fraction of the usable pool the zp setups (and clairvoyant) may lease. The 5% margin covers the
#: difference between zp's prompt estimate (cl100k) and the server's tokenizer and chat template.
HEADROOM = 0.95

#: The app-level retry of every setup but ``no-admission`` (LangChain's base retry decorator's shape).
APP_RETRY: dict[str, Any] = {"attempts": 3, "wait_exponential": {"multiplier": 1, "min": 4, "max": 10},
                             "on": "openai.APIError"}


@dataclass(frozen=True)
class SetupSpec:
    name: str
    gateway: bool
    """Whether the server gets the workload's gateway timeout."""
    needs_redis: bool = False
    workers: int = 1
    description: str = ""
    default: bool = True
    """Whether a storm without ``--setups`` runs it (False: only when named, e.g. ``zp-adaptive``)."""
    requires: str | None = None
    """A module the setup needs (imported by its factory only); :func:`parse_setups` refuses the setup
    with a clear error when it cannot be found."""
    fleet: bool = False
    """A setup built for several replicas (:mod:`~zp_storm.fleet_setups`): with ``--replicas N``
    (N > 1) the default setups are the fleet ones; with one replica they run only when named."""
    min_replicas: int = 1
    """The fewest replicas the setup makes sense with (:func:`parse_setups` refuses fewer)."""
    fleet_default: bool = True
    """A :attr:`fleet` setup that ``--replicas N`` runs without ``--setups`` (False: only when named)."""
    pd: bool = False
    """A prefill/decode setup (``--pd P:D``, :mod:`~zp_storm.pd_setups`): its servers are P
    prefill and D decode ones; every other setup runs colocated on P + D plain servers."""
    sim_extra: dict[str, Any] | None = None
    """Server settings of this setup's simulators (``long_prefill_token_threshold``: the knob a vLLM user
    tries first for ITL; ``policy``: vLLM's ``--scheduling-policy``)."""
    sim_for: Callable[[Any, Any], dict[str, Any]] | None = None
    """Server settings derived from the run: ``sim_for(workload, facts)`` (the
    :class:`~zp_storm.workloads.Workload` and the measured
    :class:`~zp_storm.workloads.ServerFacts`), merged over :attr:`sim_extra` (``vllm-queue-cap``'s
    ``max_num_queued_tokens``)."""


SETUPS: dict[str, SetupSpec] = {
    s.name: s
    for s in (
        SetupSpec("no-admission", False, description="openai AsyncOpenAI, max_retries=0, no gateway timeout"),
        SetupSpec("naive", True,
                  description="openai defaults (2 retries) + app retry (3 attempts, exp. backoff 4-10 s)"),
        SetupSpec("rate-limited", True,
                  description="naive + LangChain InMemoryRateLimiter at the sustainable rate"),
        SetupSpec("zp-strict", True,
                  description="wrap(AsyncOpenAI) + LocalBudget (strict), default estimation"),
        SetupSpec("zp-redis", True, needs_redis=True, workers=3,
                  description="wrap(AsyncOpenAI) + RedisBudget shared by 3 worker processes"),
        SetupSpec("clairvoyant", True, description="lease of prompt + TRUE output per attempt (reference)"),
    )
}
ALL_SETUPS: tuple[str, ...] = tuple(SETUPS)
DEFAULT_SETUPS: tuple[str, ...] = tuple(n for n in ALL_SETUPS if n != "zp-redis")


def _module_missing(name: str | None) -> bool:
    if name is None:
        return False
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # a parent package is missing
        return True


def parse_setups(text: str | None, redis_url: str | None, replicas: int = 1, pd: bool = False) -> list[str]:
    """The setups to run, in canonical order; ``no-admission`` is always included (it is the
    denominator and ``rate-limited`` needs its measured rate). Unknown names raise ConfigurationError.

    With ``replicas`` > 1 the default setups are the fleet ones (``no-admission``, which then balances
    round-robin, and the :attr:`SetupSpec.fleet` setups); a one-server setup named there runs against
    replica 0 only and is refused, as is a setup whose :attr:`SetupSpec.min_replicas` exceeds ``replicas``."""
    if not text and pd:
        # --pd P:D: the P/D setups and the colocated ones they are measured against
        names = [n for n, sp in SETUPS.items() if sp.pd] + ["zp-fleet", "zp-fleet-chunk512"]
    elif not text:
        if replicas > 1:
            names = [n for n, sp in SETUPS.items()
                     if sp.fleet and sp.fleet_default and (redis_url or not sp.needs_redis)]
        else:
            names = [n for n, sp in SETUPS.items() if sp.default and not sp.fleet
                     and (redis_url or not sp.needs_redis)]
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in SETUPS]
        if unknown:
            raise ConfigurationError(f"unknown setup(s) {', '.join(unknown)}; "
                                     f"choose from: {', '.join(SETUPS)}")
    missing = [f"{n} needs {SETUPS[n].requires}" for n in names if _module_missing(SETUPS[n].requires)]
    if missing:
        raise ConfigurationError(f"setup {'; '.join(missing)}, which this installation does not have")
    needs = [n for n in names if SETUPS[n].needs_redis]
    if needs and not redis_url:
        raise ConfigurationError(f"setup {', '.join(needs)} needs --redis URL (make demo never touches a "
                                 "Redis it was not given)")
    if replicas > 1:
        single = [n for n in names if n != "no-admission" and not SETUPS[n].fleet]
        if single:
            raise ConfigurationError(f"setup {', '.join(single)} sends to one server and would reach "
                                     f"replica 0 only: with --replicas {replicas} choose from: "
                                     f"{', '.join(n for n, sp in SETUPS.items() if sp.fleet)}")
    if not pd and any(SETUPS[n].pd for n in names):
        raise ConfigurationError(f"setup {', '.join(n for n in names if SETUPS[n].pd)} needs --pd P:D")
    few = [n for n in names if SETUPS[n].min_replicas > replicas]
    if few:
        raise ConfigurationError(f"setup {', '.join(few)} needs --replicas >= "
                                 f"{max(SETUPS[n].min_replicas for n in few)}")
    names = ["no-admission", *[n for n in names if n != "no-admission"]]
    return [n for n in SETUPS if n in names]


@dataclass
class SetupContext:
    """What a setup needs to build its client (all picklable: worker processes get a copy)."""

    base_url: str
    """The server's OpenAI base URL (ends with /v1)."""
    root_url: str
    model: str
    speedup: float
    num_gpu_blocks: int
    block_size: int
    limit_blocks: int
    rate_rps: float | None = None
    """Sustainable request rate (virtual requests per second), for ``rate-limited``."""
    redis_url: str | None = None
    budget_name: str = "zp-storm"
    elastic: ElasticTuning = field(default_factory=ElasticTuning)
    """The elastic setups' measurement overrides (default: none, the library's defaults)."""
    clock: str = "real"
    """``"virtual"``: the run is on a :class:`~zp_client.testing.VirtualTimeLoop` and clients reach
    the simulator's ``app`` in memory; ``"real"``: over loopback HTTP, sleeps scaled by ``speedup``."""
    app: Any = field(default=None, repr=False, compare=False)
    """The simulator's ASGI app (virtual clock only; never pickled to a worker: workers are real-time)."""
    read_pauses: Any = field(default=None, repr=False, compare=False)
    """A busy client on the virtual clock (:class:`~zp_client.testing.ReadPauses`, shared by every
    client of the run), or None."""
    replica_base_urls: list[str] = field(default_factory=list)
    """Every replica's OpenAI base URL (``--replicas N``; replica 0's is :attr:`base_url`); filled with
    ``[base_url]`` for one server."""
    replica_root_urls: list[str] = field(default_factory=list)
    replica_apps: list[Any] = field(default_factory=list, repr=False, compare=False)
    """Each replica's ASGI app (virtual clock; never pickled)."""
    replica_limit_blocks: list[int] = field(default_factory=list)
    """The zp limit of each replica's pool (:func:`zp_limit_blocks` of its /metrics ``num_gpu_blocks``)."""
    built_limit: int | None = None
    """The limit of the budget the setup built, where it is not ``limit_blocks`` (the elastic setups' own
    headroom): what the run reports as its limit."""
    network: Any = field(default=None, repr=False, compare=False)
    """A fleet on the virtual clock: the :class:`~zp_client.testing.MemoryNetwork` of the replicas'
    hosts (what :meth:`http_client` and :meth:`metrics_client` reach, and what a kill resets); None with
    one server and no kill (the app itself, as before) and on the real clock (loopback TCP)."""
    seed: int = 0
    """The storm's seed (a setup's own deterministic randomness, e.g. the epp's tie breaks)."""
    pin_prefixes: list[Any] = field(default_factory=list, repr=False)
    """The workload's prefixes to pin (:attr:`~zp_storm.workloads.Workload.pin_prefixes`)."""
    keepwarm_period_s: float | None = None
    """``zp-pinned-timer``'s period: set so it sends as many keep-warms as ``zp-pinned`` did in the same
    run (None before ``zp-pinned`` ran: its default)."""
    kv_lease_s: float | None = None
    """A P/D run's (scaled) ``kv_lease_duration`` of its prefill servers (None: not a P/D run)."""
    replica_roles: list[str | None] = field(default_factory=list)
    """Each replica's P/D role (``"prefill"``, ``"decode"``; None: colocated), in
    :attr:`replica_base_urls`' order."""
    slo_classes: dict[str, tuple[float, float | None, int]] = field(default_factory=dict)
    """The workload's request classes, ``{class: (TTFT target s, TPOT target s or None, priority)}``, its
    one class under ``""`` (:func:`~zp_storm.runner.slo_classes`): what an app knows of its own
    requests (``zp-slo`` sends the target, ``vllm-priority`` the priority)."""

    def slo_class(self, name: str | None) -> tuple[float, float | None, int]:
        """The targets and priority of class ``name`` (the workload's one class for None or an unknown
        name; TTFT 5 s, no TPOT, priority 0 when the context has no classes)."""
        if name is not None and name in self.slo_classes:
            return self.slo_classes[name]
        return self.slo_classes.get("", (5.0, None, 0))

    def __post_init__(self) -> None:
        if not self.replica_base_urls:
            self.replica_base_urls = [self.base_url]
        if not self.replica_root_urls:
            self.replica_root_urls = [self.root_url]
        if not self.replica_apps and self.app is not None:
            self.replica_apps = [self.app]
        if not self.replica_limit_blocks:
            self.replica_limit_blocks = [self.limit_blocks]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "app": None, "read_pauses": None, "replica_apps": [], "network": None}

    @property
    def replicas(self) -> int:
        """How many servers the run has."""
        return len(self.replica_base_urls)

    @property
    def virtual(self) -> bool:
        return self.clock == "virtual"

    def http_client(self) -> Any:
        """The ``http_client`` an openai client of this run gets: openai's default client over the
        in-memory transport (virtual clock), or None (openai's own, over loopback TCP)."""
        if not self.virtual:
            return None
        import openai

        from zp_client.testing import memory_transport

        target = self.network if self.network is not None else self.app
        return openai.DefaultAsyncHttpxClient(transport=memory_transport(target, pauses=self.read_pauses))

    def raw_transport(self) -> Any:
        """The transport under :meth:`http_client`, for a setup that wraps it (a balancer, a router):
        the in-memory one reaching every replica (virtual clock) or a fresh TCP transport of openai's
        HTTP library (real clock)."""
        from zp_client.testing import memory_transport, openai_http_module

        if self.virtual:
            target = self.network if self.network is not None else self.app
            return memory_transport(target, pauses=self.read_pauses)
        return openai_http_module().AsyncHTTPTransport()

    def metrics_client(self) -> Any:
        """An ``httpx.AsyncClient`` for a controller's own calls to the server (``/metrics``): over the
        in-memory transport on the virtual clock, or None (the caller's own client, over loopback TCP).
        httpx, not openai's HTTP library (httpx2 under openai 3): what zp's own server readers use."""
        if not self.virtual:
            return None
        import httpx

        from zp_client.testing import memory_transport

        target = self.network if self.network is not None else self.app
        transport = memory_transport(target, httpx, pauses=self.read_pauses)
        return httpx.AsyncClient(transport=transport, timeout=30)

    def budget_clock(self) -> Any:
        """The clock zp's budgets get: the running loop's (virtual time) or None (the system clock)."""
        if not self.virtual:
            return None
        from zp_client.clock import LoopClock

        return LoopClock()


def zp_limit_blocks(num_gpu_blocks: int, headroom: float = HEADROOM) -> int:
    """The zp budget's limit for a pool of ``num_gpu_blocks`` (one of them vLLM's null block)."""
    try:
        from zp_client.server import suggest_limit_blocks
    except ImportError:  # the server helper is not there yet: same rule, written out
        return int((num_gpu_blocks - 1) * headroom)
    return int(suggest_limit_blocks(num_gpu_blocks, headroom))


class AppCaller:
    """One logical request: the app-level retry (``APP_RETRY``) around attempts; each attempt optionally
    waits for ``limiter`` and, with ``budget``, holds a lease of the request's TRUE length (clairvoyant)."""

    def __init__(self, client: Any, model: str, *, app_retry: bool, limiter: Any = None,
                 budget: Any = None, block_size: int = 16) -> None:
        self.client = client
        self.model = model
        self.app_retry = app_retry
        self.limiter = limiter
        self.budget = budget
        self.block_size = block_size

    def request_extra(self, turn: Turn) -> dict[str, Any]:
        """What the app adds to ``turn``'s call (``extra_headers``, ``extra_body``); nothing by default
        (a subclass sends a class's target or priority: :mod:`zp_storm.slo_setups`)."""
        return {}

    async def _attempt(self, turn: Turn, rec: RequestRecord, clock: VirtualClock) -> None:
        rec.attempts += 1
        if self.limiter is not None:
            await self.limiter.aacquire()
        extra = self.request_extra(turn)
        if self.budget is not None:
            bs = self.block_size
            blocks = math.ceil((turn.prompt_tokens + turn.true_out) / bs)
            async with self.budget.lease(blocks, held=math.ceil(turn.prompt_tokens / bs)):
                await stream_chat(self.client, self.model, turn, rec, clock, **extra)
        else:
            await stream_chat(self.client, self.model, turn, rec, clock, **extra)

    async def __call__(self, turn: Turn, rec: RequestRecord, clock: VirtualClock) -> None:
        if not self.app_retry:
            await self._attempt(turn, rec, clock)
            return
        import openai
        import tenacity

        async def vsleep(seconds: float) -> None:
            await clock.sleep(seconds)

        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(APP_RETRY["attempts"]),
            wait=tenacity.wait_exponential(**APP_RETRY["wait_exponential"]),
            retry=tenacity.retry_if_exception_type(openai.APIError),
            sleep=vsleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._attempt(turn, rec, clock)


def _warm_openai(client: Any) -> None:
    """Do the openai SDK's lazy imports (resources, response models, SSE decoding) now, before the run:
    a fresh process would otherwise block its event loop for a few hundred ms on its first request."""
    for module in ("openai.types.chat.chat_completion", "openai.types.chat.chat_completion_chunk",
                   "openai._streaming"):
        importlib.import_module(module)
    _ = client.chat.completions


SetupFactory = Callable[[SetupContext, contextlib.AsyncExitStack], Awaitable[Caller]]
"""Builds one setup's :class:`Caller` in the current process; registers cleanups on the exit stack."""

_FACTORIES: dict[str, SetupFactory] = {}


def register_setup(spec: SetupSpec, factory: SetupFactory, *, after: str | None = None) -> None:
    """Add a setup to the storm (issue 8's ``zp-elastic`` / ``zp-oracle`` plug in here).

    ``factory(ctx, stack)`` builds the client (closing it via ``stack``) and returns a :class:`Caller`;
    the caller gets each :class:`~zp_storm.workloads.Turn`, so an oracle can read ``true_out``.
    Helpers for factories: :func:`openai_client`, :func:`zp_client_for`, :class:`AppCaller`.
    ``after`` places it in the canonical order after that setup (default: at the end).
    Re-registering a name replaces it.
    """
    SETUPS.pop(spec.name, None)
    items = list(SETUPS.items())
    pos = len(items) if after is None else [n for n, _ in items].index(after) + 1
    items.insert(pos, (spec.name, spec))
    SETUPS.clear()
    SETUPS.update(items)
    _FACTORIES[spec.name] = factory
    global ALL_SETUPS, DEFAULT_SETUPS
    ALL_SETUPS = tuple(SETUPS)
    DEFAULT_SETUPS = tuple(n for n, sp in SETUPS.items() if sp.default and not sp.needs_redis)


def openai_client(ctx: SetupContext, stack: contextlib.AsyncExitStack, **kwargs: Any) -> Any:
    """An ``openai.AsyncOpenAI`` for the run's server whose retry backoff runs in virtual time."""
    from zp_client.testing import VirtualTimeAsyncOpenAI

    http_client = ctx.http_client()
    if http_client is not None:
        kwargs.setdefault("http_client", http_client)
    client = VirtualTimeAsyncOpenAI(speedup=ctx.speedup, base_url=ctx.base_url, api_key="sk-storm-bench",
                                    **kwargs)
    stack.push_async_callback(client.close)
    return client


async def zp_client_for(ctx: SetupContext, stack: contextlib.AsyncExitStack, budget: Any, *,
                        http_client: Any = None, **wrap_options: Any) -> Any:
    """``wrap(AsyncOpenAI)`` on ``budget`` with zp's default estimator (warmed up before the run) and
    default retry policy (sleeping in virtual time: on the budget's clock under the virtual clock, scaled
    by ``speedup`` under the real one); closes client and budget with ``stack``. ``http_client``: the
    openai client's own (e.g. a fleet's balancer, which zp's admission transport then wraps); default
    :meth:`SetupContext.http_client`."""
    from zp_client import wrap
    from zp_client.config import Settings
    from zp_client.estimate import Estimator
    from zp_client.testing import VirtualTimeRetryPolicy

    stack.push_async_callback(budget.aclose)
    raw = openai_client(ctx, stack, **({"http_client": http_client} if http_client is not None else {}))
    # loading the BPE file takes a few hundred ms of blocking work that would otherwise land on the
    # first request of the run
    estimator = wrap_options.pop("estimator", None) or Estimator(Settings())
    estimator.count_text("warm up the tokenizer")
    retry = wrap_options.pop("retry", None)
    if retry is None and not ctx.virtual:
        retry = VirtualTimeRetryPolicy.from_settings(Settings(), budget=budget.retry_budget(),
                                                     speedup=ctx.speedup)
    client = wrap(raw, budget=budget, retry=retry, estimator=estimator, **wrap_options)
    stack.push_async_callback(client.close)
    return client


async def _no_admission(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    if ctx.replicas > 1:  # a fleet: round-robin over the replicas (zp_storm.fleet_setups)
        from zp_storm.fleet_setups import fleet_no_admission

        return await fleet_no_admission(ctx, stack)
    return AppCaller(openai_client(ctx, stack, max_retries=0), ctx.model, app_retry=False)


async def _naive(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    return AppCaller(openai_client(ctx, stack), ctx.model, app_retry=True)  # openai's max_retries=2


async def _rate_limited(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from langchain_core.rate_limiters import InMemoryRateLimiter

    if not ctx.rate_rps:
        raise ConfigurationError("rate-limited needs the sustainable rate measured by no-admission")
    if ctx.virtual:
        _rate_limiter_on_loop_time(stack)
    limiter = InMemoryRateLimiter(requests_per_second=ctx.rate_rps * ctx.speedup,
                                  check_every_n_seconds=max(0.002, 0.05 / ctx.speedup), max_bucket_size=1)
    return AppCaller(openai_client(ctx, stack), ctx.model, app_retry=True, limiter=limiter)


class _LoopTime:
    """The ``time`` module as LangChain's rate limiter sees it on a virtual-time run: its ``monotonic``
    is the event loop's clock; everything else is the real module's."""

    def __init__(self, loop: Any) -> None:
        self.monotonic = loop.time

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


def _rate_limiter_on_loop_time(stack: contextlib.AsyncExitStack) -> None:
    """Point ``langchain_core.rate_limiters``' clock at the running loop's for this run (its token
    bucket reads ``time.monotonic()``, its waits are ``asyncio.sleep``); restored when ``stack`` closes.
    LangChain's own code runs unchanged."""
    import asyncio

    import langchain_core.rate_limiters as rl

    original = getattr(rl, "time")  # noqa: B009 - the module's own import of time, not an export
    setattr(rl, "time", _LoopTime(asyncio.get_running_loop()))  # noqa: B010 - a stand-in, on purpose
    stack.callback(setattr, rl, "time", original)


async def _zp_strict(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.budget.local import LocalBudget

    budget = LocalBudget(limit_blocks=ctx.limit_blocks, block_size=ctx.block_size, policy="strict",
                         clock=ctx.budget_clock())
    return AppCaller(await zp_client_for(ctx, stack, budget), ctx.model, app_retry=True)


async def _zp_redis(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.budget.redis import RedisBudget

    if not ctx.redis_url:
        raise ConfigurationError("zp-redis needs --redis URL")
    # a fresh budget name per run: no earlier holders can exist, so no recovery window
    budget = RedisBudget(ctx.redis_url, ctx.budget_name, limit_blocks=ctx.limit_blocks,
                         block_size=ctx.block_size, recovery_s=0.0, policy="strict")
    return AppCaller(await zp_client_for(ctx, stack, budget), ctx.model, app_retry=True)


async def _clairvoyant(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.budget.local import LocalBudget

    budget = LocalBudget(limit_blocks=ctx.limit_blocks, block_size=ctx.block_size, policy="strict",
                         clock=ctx.budget_clock())
    stack.push_async_callback(budget.aclose)
    return AppCaller(openai_client(ctx, stack, max_retries=0), ctx.model, app_retry=True, budget=budget,
                     block_size=ctx.block_size)


_FACTORIES.update({
    "no-admission": _no_admission,
    "naive": _naive,
    "rate-limited": _rate_limited,
    "zp-strict": _zp_strict,
    "zp-redis": _zp_redis,
    "clairvoyant": _clairvoyant,
})


def factory_module(name: str) -> str:
    """The module that defines setup ``name``'s factory (worker processes import it)."""
    return _FACTORIES[name].__module__


@contextlib.asynccontextmanager
async def open_caller(name: str, ctx: SetupContext) -> AsyncIterator[Caller]:
    """Build setup ``name``'s client for one process and yield its :class:`Caller`; closes it after."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigurationError(f"unknown setup {name!r}; choose from: {', '.join(SETUPS)}")
    from zp_client.testing import VirtualTimeAsyncOpenAI

    _warm_openai(VirtualTimeAsyncOpenAI(speedup=ctx.speedup, base_url=ctx.base_url, api_key="sk-storm-bench"))
    async with contextlib.AsyncExitStack() as stack:
        yield await factory(ctx, stack)
