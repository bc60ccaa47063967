"""RedisBudget: one KV-block budget shared through Redis by many processes on many hosts, and the
fleet-wide retry budget beside it. Semantics, keys and failure modes: docs/redis.md.

Layout (the way redis-py splits ``redis/lock.py`` and ``redis/asyncio/lock.py``): ``_script.py`` is the
script layer written once (keys, Lua, arguments, replies, error mapping, the lease), ``_async.py`` and
``_sync.py`` are the thin faces that do the I/O, ``_budget.py`` is the public class.
"""

try:
    import redis as _redis  # noqa: F401 - the 'redis' extra: without it, one line saying so
except ModuleNotFoundError as _exc:
    from zp_client.errors import MissingIntegration, install_hint

    raise MissingIntegration(
        f"RedisBudget needs the 'redis' extra (no module named {(_exc.name or 'redis').split('.')[0]!r}): "
        + install_hint("redis")
    ) from _exc

from zp_client.budget.redis._budget import RedisBudget
from zp_client.budget.redis._retry import RedisRetryBudget
from zp_client.budget.redis._script import RedisBudgetEvent, RedisLease

__all__ = ["RedisBudget", "RedisLease", "RedisBudgetEvent", "RedisRetryBudget"]
