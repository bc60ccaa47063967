"""The elastic storm setups (issue 8), registered into :mod:`zp_client.bench.setups` on import.

=================  ==========================================================================================
``zp-elastic``     ``wrap(AsyncOpenAI)`` on ``LocalBudget(limit, policy="elastic")`` with default estimation
                   and the default :class:`~zp_client.forecast.LengthForecaster` (learned online from each
                   response's ``usage.completion_tokens``, cold start on its prior). The limit is what
                   ``suggest_limit_blocks`` recommends for elastic (the whole usable pool,
                   ``ELASTIC_HEADROOM``); ``zp-strict`` keeps the storm's 5% headroom. Same retry policy
                   and app-level retry as ``zp-strict``.
``zp-oracle``      a reference, not a product setup: ``zp-elastic`` with ``oracle=True``, so the transport
                   forecasts each request from the simulator's body field ``sim_output_tokens`` (its true
                   length). The limit a forecaster can reach.
``zp-redis-elastic`` ``zp-redis`` with ``RedisBudget(policy="elastic")`` (held reported every block) shared by the worker
                   processes, at the elastic limit. Only with ``--redis URL``.
=================  ==========================================================================================

The forecaster's quantiles and prior can be overridden for measurements (``benchmarks/elastic_frontier.py``)
with :func:`configure`, or in worker processes through the environment (``ZP_STORM_ELASTIC_Q``,
``ZP_STORM_ELASTIC_Q_TAIL``, ``ZP_STORM_ELASTIC_PRIOR_WEIGHT``, ``ZP_STORM_ELASTIC_HEADROOM``); without either, the library defaults apply — what a user gets.
``ZP_STORM_ELASTIC_STARVATION_S`` and ``ZP_STORM_ELASTIC_LONGEST_FIRST_S`` set the local elastic setups'
starvation bound (backfill) and longest-first window, environment only.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any

from zp_client.bench.loadgen import Caller
from zp_client.bench.setups import AppCaller, SetupContext, SetupSpec, register_setup, zp_client_for, zp_limit_blocks
from zp_client.errors import ConfigurationError

__all__ = ["ELASTIC_SETUPS", "configure", "redis_elastic_available"]

log = logging.getLogger("zp_client.bench.elastic_setups")

ELASTIC_SETUPS: tuple[str, ...] = ("zp-elastic", "zp-oracle")

_overrides: dict[str, float] = {}


def configure(*, q: float | None = None, prior_weight: float | None = None, headroom: float | None = None,
              q_tail: float | None = None) -> None:
    """Override the forecaster's quantile / prior weight, and the share of the pool leased (``headroom``,
    default :data:`~zp_client.bench.setups.HEADROOM`), for ``zp-elastic`` (and ``headroom`` also for
    ``zp-oracle``) built in this process and, through the environment, in worker processes started after
    this call. ``None`` restores the default."""
    for key, env, value in (("q", "ZP_STORM_ELASTIC_Q", q),
                            ("q_tail", "ZP_STORM_ELASTIC_Q_TAIL", q_tail),
                            ("prior_weight", "ZP_STORM_ELASTIC_PRIOR_WEIGHT", prior_weight),
                            ("headroom", "ZP_STORM_ELASTIC_HEADROOM", headroom)):
        if value is None:
            _overrides.pop(key, None)
            os.environ.pop(env, None)
        else:
            _overrides[key] = float(value)
            os.environ[env] = repr(float(value))


def _forecaster() -> Any | None:
    """The forecaster for one setup: the library default (None: the budget's shared one) unless overridden."""
    q = _overrides.get("q", _env_float("ZP_STORM_ELASTIC_Q"))
    q_tail = _overrides.get("q_tail", _env_float("ZP_STORM_ELASTIC_Q_TAIL"))
    w = _overrides.get("prior_weight", _env_float("ZP_STORM_ELASTIC_PRIOR_WEIGHT"))
    if q is None and w is None and q_tail is None:
        return None
    from zp_client.forecast import LengthForecaster, Prior

    kwargs: dict[str, Any] = {}
    if q is not None:
        kwargs["q"] = q
    if q_tail is not None:
        kwargs["q_tail"] = q_tail
    if w is not None:
        kwargs["prior"] = Prior(weight=w)
    return LengthForecaster(**kwargs)


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number, got {raw!r}") from None


def _limit(ctx: SetupContext) -> int:
    """The elastic setups' limit: the usable pool x :data:`~zp_client.server.ELASTIC_HEADROOM` (what
    ``suggest_limit_blocks`` recommends for an elastic budget), or the configured headroom."""
    from zp_client.server import ELASTIC_HEADROOM

    h = _overrides.get("headroom", _env_float("ZP_STORM_ELASTIC_HEADROOM"))
    if h is None:
        h = ELASTIC_HEADROOM
    if not 0.0 < h <= 1.0:
        raise ConfigurationError(f"elastic headroom must be in (0, 1], got {h!r}")
    return zp_limit_blocks(ctx.num_gpu_blocks, h)


def _local_elastic(ctx: SetupContext) -> Any:
    from zp_client.budget.local import LocalBudget

    kw: dict[str, Any] = {}
    # measurements only: without them the library's defaults apply
    for env, arg in (("ZP_STORM_ELASTIC_STARVATION_S", "starvation_bound_s"),
                     ("ZP_STORM_ELASTIC_LONGEST_FIRST_S", "longest_first_s")):
        value = _env_float(env)
        if value is not None:
            kw[arg] = value
    return LocalBudget(limit_blocks=_limit(ctx), block_size=ctx.block_size, policy="elastic", **kw)


async def _zp_elastic(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    client = await zp_client_for(ctx, stack, _local_elastic(ctx), forecaster=_forecaster())
    return AppCaller(client, ctx.model, app_retry=True)


async def _zp_oracle(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    client = await zp_client_for(ctx, stack, _local_elastic(ctx), oracle=True)
    return AppCaller(client, ctx.model, app_retry=True)


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
    budget = RedisBudget(ctx.redis_url, ctx.budget_name, limit_blocks=_limit(ctx),
                         block_size=ctx.block_size, recovery_s=0.0, policy="elastic")
    client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster())
    return AppCaller(client, ctx.model, app_retry=True)


register_setup(SetupSpec("zp-elastic", True,
                         description="wrap(AsyncOpenAI) + LocalBudget(policy='elastic'), default estimation"),
               _zp_elastic, after="zp-strict")
register_setup(SetupSpec("zp-oracle", True,
                         description="zp-elastic forecasting each request's TRUE length (reference)"),
               _zp_oracle, after="zp-elastic")
if redis_elastic_available():
    register_setup(SetupSpec("zp-redis-elastic", True, needs_redis=True, workers=3,
                             description="wrap(AsyncOpenAI) + RedisBudget(policy='elastic') shared by 3 workers"),
                   _zp_redis_elastic, after="zp-redis")
