"""The elastic storm setups (``zp-elastic``, ``zp-oracle``, ``zp-redis-elastic``, ``zp-adaptive``),
registered into :mod:`zp_storm.setups` on import.

Measurements override the forecaster, headroom and budget knobs with an
:class:`~zp_storm.tuning.ElasticTuning` (``SetupContext.elastic``); unset, the library defaults
apply. See docs/benchmark.md#setups.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

from zp_client.errors import ConfigurationError
from zp_storm.loadgen import Caller
from zp_storm.setups import (
    AppCaller,
    SetupContext,
    SetupSpec,
    register_setup,
    zp_client_for,
    zp_limit_blocks,
)
from zp_storm.tuning import ElasticTuning

__all__ = ["ADAPTIVE_MODULE", "AdaptiveCaller", "ELASTIC_SETUPS", "URESERVE_HEADROOM", "URESERVE_Z",
           "redis_elastic_available"]

log = logging.getLogger("zp_storm.elastic_setups")

ELASTIC_SETUPS: tuple[str, ...] = ("zp-elastic", "zp-oracle")

#: ``zp-elastic-ureserve``: the whole usable pool is the limit, and the reserve for forecast error is
#: sized from the live leases' spread (``ElasticPolicy(reserve_z=...)``) instead of a flat 5%.
URESERVE_HEADROOM = 1.0
URESERVE_Z = 0.5


def _forecaster(tuning: ElasticTuning) -> Any | None:
    """The forecaster for one setup: the library default (None: the budget's shared one) unless
    ``tuning`` overrides it."""
    if not tuning.forecaster_overridden:
        return None
    from zp_client.forecast import LengthForecaster, Prior

    kwargs: dict[str, Any] = {}
    if tuning.q is not None:
        kwargs["q"] = tuning.q
    if tuning.q_tail is not None:
        kwargs["q_tail"] = tuning.q_tail
    if tuning.prior_weight is not None:
        kwargs["prior"] = Prior(weight=tuning.prior_weight)
    return LengthForecaster(**kwargs)


def _limit(ctx: SetupContext) -> int:
    """The elastic setups' limit: the usable pool x :data:`~zp_client.server.ELASTIC_HEADROOM` (what
    ``suggest_limit_blocks`` recommends for an elastic budget), or ``ctx.elastic.headroom`` when set."""
    from zp_client.server import ELASTIC_HEADROOM

    h = ctx.elastic.headroom  # validated by ElasticTuning
    return zp_limit_blocks(ctx.num_gpu_blocks, ELASTIC_HEADROOM if h is None else h)


def _local_elastic(ctx: SetupContext, *, policy: Any = "elastic", limit: int | None = None,
                   **kw: Any) -> Any:
    from zp_client.budget.local import LocalBudget

    # measurements only: without them the library's defaults apply
    if ctx.elastic.starvation_bound_s is not None:
        kw["starvation_bound_s"] = ctx.elastic.starvation_bound_s
    if ctx.elastic.longest_first_s is not None:
        kw["longest_first_s"] = ctx.elastic.longest_first_s
    ctx.built_limit = _limit(ctx) if limit is None else limit
    return LocalBudget(limit_blocks=ctx.built_limit, block_size=ctx.block_size,
                       policy=policy, clock=ctx.budget_clock(), **kw)


async def _zp_elastic(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    client = await zp_client_for(ctx, stack, _local_elastic(ctx), forecaster=_forecaster(ctx.elastic))
    return AppCaller(client, ctx.model, app_retry=True)


async def _zp_elastic_ureserve(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.budget.elastic import ElasticPolicy

    h = ctx.elastic.headroom
    z = ctx.elastic.reserve_z
    policy = ElasticPolicy(ctx.block_size, reserve_z=URESERVE_Z if z is None else z)
    limit = zp_limit_blocks(ctx.num_gpu_blocks, URESERVE_HEADROOM if h is None else h)
    budget = _local_elastic(ctx, policy=policy, limit=limit)
    client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster(ctx.elastic))
    return AppCaller(client, ctx.model, app_retry=True)


async def _zp_oracle(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.transport import forecaster_for
    from zp_storm.oracle import SimOracleForecaster

    budget = _local_elastic(ctx)
    oracle = SimOracleForecaster(forecaster_for(budget))
    client = await zp_client_for(ctx, stack, budget, forecaster=oracle)
    return AppCaller(client, ctx.model, app_retry=True)


#: ``zp-pinned-timer``'s keep-warm period when ``zp-pinned`` did not run before it (virtual seconds).
DEFAULT_TIMER_PERIOD_S = 20.0


class PinnedCaller(AppCaller):
    """``zp-elastic``'s caller with the workload's prefixes pinned (:class:`zp_client.PinnedPrefix`);
    exposes ``keepwarms`` (sent so far) for the report."""

    def __init__(self, client: Any, model: str, pins: list[Any]) -> None:
        super().__init__(client, model, app_retry=True)
        self.pins = pins

    def keepwarms(self) -> int:
        return sum(p.keepwarms_sent for p in self.pins)


async def _pinned(ctx: SetupContext, stack: contextlib.AsyncExitStack, period_s: float | None) -> Caller:
    from zp_client.pinning import PinnedPrefix

    if not ctx.pin_prefixes:
        raise ConfigurationError("zp-pinned and zp-pinned-timer need a workload with prefixes to pin "
                                 "(--workload agent-types)")
    # the pool as the server's /metrics reports it, as LocalBudget.from_server reads it
    budget = _local_elastic(ctx, server_blocks=ctx.num_gpu_blocks - 1)
    client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster(ctx.elastic))
    pins = []
    for msgs in ctx.pin_prefixes:
        pin = PinnedPrefix(client, model=ctx.model, messages=msgs, period_s=period_s)
        await pin.start()
        stack.push_async_callback(pin.aclose)
        pins.append(pin)
    return PinnedCaller(client, ctx.model, pins)


async def _zp_pinned(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    return await _pinned(ctx, stack, None)


async def _zp_pinned_timer(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    period = ctx.keepwarm_period_s if ctx.keepwarm_period_s is not None else DEFAULT_TIMER_PERIOD_S
    return await _pinned(ctx, stack, period)


#: The module ``zp-adaptive`` needs (imported only when the setup is built).
ADAPTIVE_MODULE = "zp_client.adaptive"


class AdaptiveCaller(AppCaller):
    """``zp-elastic``'s caller with the budget's adaptive limit controller beside it: exposes
    :attr:`limit_timeline` (the storm report's limit trajectory)."""

    def __init__(self, client: Any, model: str, controller: Any, *, start: float, start_limit: int) -> None:
        super().__init__(client, model, app_retry=True)
        self.controller = controller
        self._start = (float(start), int(start_limit))

    @property
    def limit_timeline(self) -> list[tuple[float, int]]:
        """``(t, limit)``: the controller's own ``limit_timeline()`` where it has one, else the limit when
        it started, then every change it made (``t`` on the budget's clock, as ``changes[i].at``)."""
        own = getattr(self.controller, "limit_timeline", None)
        if callable(own):
            tl = [(float(t), int(lim)) for t, lim in own()]
            if tl:
                return tl
        out = [self._start]
        out += [(float(c.at), int(c.new)) for c in getattr(self.controller, "changes", [])]
        return out


async def _zp_adaptive(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    """``zp-elastic`` with :class:`zp_client.adaptive.AdaptiveLimit` on its budget: the controller polls the
    run's server (``ctx.root_url``'s ``/metrics``) through the run's transport (the in-memory one on the
    virtual clock) on the budget's clock, every virtual second, from the calibrated elastic limit."""
    import importlib

    try:
        adaptive = importlib.import_module(ADAPTIVE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != ADAPTIVE_MODULE:
            raise
        raise ConfigurationError(f"zp-adaptive needs {ADAPTIVE_MODULE}, which this installation does not "
                                 "have") from None
    budget = _local_elastic(ctx)
    client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster(ctx.elastic))
    http = ctx.metrics_client()
    if http is not None:
        stack.push_async_callback(http.aclose)
    # one virtual second between polls: on the real clock the budget's clock is the system's
    poll = 1.0 if ctx.virtual else 1.0 / ctx.speedup
    controller = adaptive.AdaptiveLimit(budget, ctx.root_url, calibrated_limit=budget.limit,
                                        poll_interval_s=poll, http_client=http, clock=budget.clock)
    start = budget.clock.monotonic()
    await stack.enter_async_context(controller)  # closed before the budget and the client (LIFO)
    return AdaptiveCaller(client, ctx.model, controller, start=start, start_limit=budget.limit)


def redis_elastic_available() -> bool:
    """Whether the installed :class:`~zp_client.budget.redis.RedisBudget` takes ``policy="elastic"``."""
    try:
        from zp_client.budget.redis import RedisBudget
    except ImportError:
        return False
    try:
        return "policy" in inspect.signature(RedisBudget).parameters
    except (TypeError, ValueError):
        return False


async def _zp_redis_elastic(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_client.budget.redis import RedisBudget

    if not ctx.redis_url:
        raise ConfigurationError("zp-redis-elastic needs --redis URL")
    ctx.built_limit = _limit(ctx)
    budget = RedisBudget(ctx.redis_url, ctx.budget_name, limit_blocks=ctx.built_limit,
                         block_size=ctx.block_size, recovery_s=0.0, policy="elastic")
    client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster(ctx.elastic))
    return AppCaller(client, ctx.model, app_retry=True)


register_setup(SetupSpec("zp-elastic", True,
                         description="wrap(AsyncOpenAI) + LocalBudget(policy='elastic'), default estimation"),
               _zp_elastic, after="zp-strict")
register_setup(SetupSpec("zp-oracle", True,
                         description="zp-elastic forecasting each request's TRUE length (reference)"),
               _zp_oracle, after="zp-elastic")
register_setup(SetupSpec("zp-adaptive", True, default=False, requires=ADAPTIVE_MODULE,
                         description="zp-elastic + AdaptiveLimit (the limit follows the server's /metrics)"),
               _zp_adaptive, after="zp-oracle")
register_setup(SetupSpec("zp-pinned", True, default=False,
                         description="zp-elastic + the workload's prefixes pinned, keep-warms when due"),
               _zp_pinned, after="zp-oracle")
register_setup(SetupSpec("zp-pinned-timer", True, default=False,
                         description="zp-elastic + the prefixes pinned, keep-warms on a fixed period "
                                     "(as many as zp-pinned sent)"),
               _zp_pinned_timer, after="zp-pinned")
register_setup(SetupSpec("zp-elastic-ureserve", True, default=False,
                         description="zp-elastic on the whole pool, reserve sized by the live leases' "
                                     "forecast spread"),
               _zp_elastic_ureserve, after="zp-oracle")
if redis_elastic_available():
    register_setup(SetupSpec("zp-redis-elastic", True, needs_redis=True, workers=3,
                             description="wrap(AsyncOpenAI) + RedisBudget(policy='elastic') shared by 3 "
                                         "workers"),
                   _zp_redis_elastic, after="zp-redis")
