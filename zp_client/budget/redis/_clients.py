"""The redis-py client types a Redis budget accepts (typing only: nothing here is imported at run time)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import redis
    import redis.asyncio
    from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
    from redis.cluster import RedisCluster

__all__ = ["AsyncRedisClient", "SyncRedisClient"]

AsyncRedisClient: TypeAlias = "redis.asyncio.Redis | AsyncRedisCluster"
"""A ``redis.asyncio`` client (``Redis`` or ``cluster.RedisCluster``) given instead of a URL."""
SyncRedisClient: TypeAlias = "redis.Redis | RedisCluster"
"""A blocking ``redis`` client (``Redis`` or ``cluster.RedisCluster``), e.g. a budget's ``sync_client``."""
