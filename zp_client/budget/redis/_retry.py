"""RedisRetryBudget: the fleet-wide retry budget, in the same Redis (and hash tag) as the RedisBudget of
the same name; :meth:`RedisBudget.new_retry_budget <zp_client.RedisBudget.new_retry_budget>` makes it.
See docs/retries.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from typing import Any

import anyio
import redis
import redis.asyncio
from redis.exceptions import MaxConnectionsError, RedisError

from zp_client._redact import check_redis_url
from zp_client.budget.redis._clients import SyncRedisClient
from zp_client.budget.redis._script import POOL_SIZE, load_lua
from zp_client.budget.retries import (
    DEFAULT_BUDGET_FLOOR_PER_S,
    DEFAULT_BUDGET_RATIO,
    DEFAULT_BUDGET_WINDOW_S,
    validate_retry_budget_params,
)
from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import ConfigurationError

# A full pool (only a caller's non-blocking one: the budget's own pools block) is back-pressure: waited
# out for up to ~10 s in growing steps before it counts as a failure like any other Redis error.
_POOL_FULL_BACKOFF_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05) + (0.1,) * 99

log = logging.getLogger("zp_client.retry")


_Reply = list[int | bytes | str]
"""A reply of the retry-budget script: counters as Redis integers or strings."""


class RedisRetryBudget:
    """The fleet-wide retry budget: every process using the same ``name`` shares one window in Redis.

    Same rule and defaults as :class:`LocalRetryBudget` (retries <= ratio 0.5 x answered requests +
    floor 0.5/s x window 20 s, 10 buckets), counted by ``budget/redis/lua/retry_budget.lua`` with Redis
    ``TIME``, in one hash ``{<prefix>:<name>}:retry_budget`` — the same hash tag as the RedisBudget of
    that name, so it works on Redis Cluster. Idle budgets expire one window after their last use.

    Clients: pass ``url=`` (a sync and an async client are made lazily), or ``client=`` (a
    ``redis.Redis``) and/or ``async_client=`` (a ``redis.asyncio.Redis``). Without an async client the
    async methods run the sync ones in a worker thread; without a sync client the sync methods raise
    :class:`~zp_client.ConfigurationError`.

    Deposits (answered requests; the policy makes them) are batched: ``record_request()`` counts locally
    and writes to Redis at most every ``flush_interval_s`` seconds (and with every ``try_spend``), so an
    answer costs no round trip.
    Undeposited requests only make the budget stricter, never looser. ``flush_interval_s=0`` writes
    through. If Redis fails, ``try_spend`` raises the redis error (the policy then does not retry) and
    deposits stay pending for the next flush.
    """

    def __init__(
        self,
        name: str,
        *,
        url: str | None = None,
        client: SyncRedisClient | None = None,
        async_client: Any = None,
        ratio: float = DEFAULT_BUDGET_RATIO,
        floor_per_s: float = DEFAULT_BUDGET_FLOOR_PER_S,
        window_s: float = DEFAULT_BUDGET_WINDOW_S,
        buckets: int = 10,
        prefix: str = "zp",
        flush_interval_s: float = 1.0,
    ) -> None:
        validate_retry_budget_params(ratio, floor_per_s, window_s, buckets)
        if not name or "{" in name or "}" in name:
            raise ConfigurationError(
                f"retry budget name must be non-empty and contain no braces, got {name!r}")
        if url is None and client is None and async_client is None:
            raise ConfigurationError("RedisRetryBudget needs url=, client= (redis.Redis) or async_client=")
        if flush_interval_s < 0:
            raise ConfigurationError(f"flush_interval_s must be >= 0, got {flush_interval_s!r}")
        if url is not None:
            check_redis_url(url)  # now: redis-py reads it at first use, and its error can show the password
        self.name = name
        self.ratio = float(ratio)
        self.floor_per_s = float(floor_per_s)
        self.window_s = float(window_s)
        self.key = f"{{{prefix}:{name}}}:retry_budget"
        self._window_ms = max(1, int(round(self.window_s * 1000)))
        self._bucket_ms = max(1, self._window_ms // buckets)
        self.bucket_s = self._bucket_ms / 1000.0
        """Length of one bucket of the window: how often a refused retry asks again."""
        self._url = url
        self._client = client
        self._async_client = async_client
        self._owns_async = False
        self._owns_sync = False
        self._script: Any = None
        self._async_script: Any = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self._init_lock = threading.Lock()
        self._flush_interval_s = float(flush_interval_s)
        self._pending = 0
        self._last_flush = -math.inf
        self._lock = threading.Lock()

    # -- clients -------------------------------------------------------------------------------------

    def _sync_script(self) -> Any:
        with self._init_lock:
            return self._sync_script_locked()

    def _sync_script_locked(self) -> Any:
        if self._script is None:
            if self._client is None:
                if self._url is None:
                    raise ConfigurationError(
                        "this RedisRetryBudget has only an async client; use the *_async methods "
                        "(RetryPolicy.new_request_async / decide_async) or pass url= or client="
                    )
                # Blocking pool: a herd of retries waits for a connection (back-pressure, not an outage).
                pool = redis.BlockingConnectionPool.from_url(self._url, max_connections=POOL_SIZE,
                                                             timeout=None)
                self._client = redis.Redis.from_pool(pool)
                self._owns_sync = True
            self._script = self._client.register_script(load_lua("retry_budget.lua"))
        return self._script

    def _aio_script(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._owns_async and self._async_loop is not loop:
            # redis.asyncio connections belong to the loop that made them; a client made on another
            # (finished) loop cannot be reused, so this budget makes a fresh one for this loop. The old
            # one's sockets are dropped without awaiting on a loop that may be gone.
            old = self._async_client
            if old is not None:
                old.connection_pool.reset()
            self._async_client = None
            self._async_script = None
            self._owns_async = False
        if self._async_script is None:
            if self._async_client is None:
                if self._url is None:
                    return None
                pool = redis.asyncio.BlockingConnectionPool.from_url(
                    self._url, max_connections=POOL_SIZE, timeout=None)
                self._async_client = redis.asyncio.Redis.from_pool(pool)
                self._owns_async = True
                self._async_loop = loop
            self._async_script = self._async_client.register_script(load_lua("retry_budget.lua"))
        return self._async_script

    def _args(self, deposits: int, spend: bool) -> _Reply:
        return [deposits, 1 if spend else 0, repr(self.ratio), repr(self.floor_per_s), self._window_ms,
                self._bucket_ms]

    def _take_pending(self, force: bool) -> int:
        with self._lock:
            now = SYSTEM_CLOCK.monotonic()
            if not force and self._pending and now - self._last_flush < self._flush_interval_s:
                return 0
            taken, self._pending = self._pending, 0
            if taken or force:
                self._last_flush = now
            return taken

    def _return_pending(self, n: int) -> None:
        with self._lock:
            self._pending += n

    # -- sync ----------------------------------------------------------------------------------------

    def record_request(self) -> None:
        """Count one answered logical request; written to Redis with the next flush (class docstring)."""
        with self._lock:
            self._pending += 1
        deposits = self._take_pending(force=False)
        if deposits:
            self._call_sync(deposits, spend=False, swallow=True)

    def try_spend(self) -> bool:
        """Ask the fleet-wide window for one retry (one round trip, pending deposits included)."""
        return bool(self._call_sync(self._take_pending(force=True), spend=True, swallow=False)[0])

    def flush(self) -> None:
        """Write pending deposits now."""
        deposits = self._take_pending(force=True)
        if deposits:
            self._call_sync(deposits, spend=False, swallow=False)

    def snapshot(self) -> tuple[int, int, float]:
        """``(requests, retries, allowance)`` in the fleet's current window (flushes pending deposits)."""
        r = self._call_sync(self._take_pending(force=True), spend=False, swallow=False)
        return int(r[1]), int(r[2]), float(r[3])

    def _call_sync(self, deposits: int, *, spend: bool, swallow: bool) -> _Reply:
        try:
            for wait_s in _POOL_FULL_BACKOFF_S:
                try:
                    return list(self._sync_script()(keys=[self.key], args=self._args(deposits, spend)))
                except MaxConnectionsError:  # a caller's full non-blocking pool: wait for a connection
                    SYSTEM_CLOCK.sleep_sync(wait_s)
            return list(self._sync_script()(keys=[self.key], args=self._args(deposits, spend)))
        except (RedisError, OSError):
            self._return_pending(deposits)
            if not swallow:
                raise
            return self._deposit_failed()
        except BaseException:
            self._return_pending(deposits)
            raise

    # -- async ---------------------------------------------------------------------------------------

    async def record_request_async(self) -> None:
        with self._lock:
            self._pending += 1
        deposits = self._take_pending(force=False)
        if deposits:
            await self._call_async(deposits, spend=False, swallow=True)

    async def try_spend_async(self) -> bool:
        return bool((await self._call_async(self._take_pending(force=True), spend=True, swallow=False))[0])

    async def flush_async(self) -> None:
        deposits = self._take_pending(force=True)
        if deposits:
            await self._call_async(deposits, spend=False, swallow=False)

    async def snapshot_async(self) -> tuple[int, int, float]:
        r = await self._call_async(self._take_pending(force=True), spend=False, swallow=False)
        return int(r[1]), int(r[2]), float(r[3])

    async def _call_async(self, deposits: int, *, spend: bool, swallow: bool) -> _Reply:
        try:
            script = self._aio_script()
            if script is None:
                # Only a sync client: keep the event loop free by running it in a worker thread.
                return await anyio.to_thread.run_sync(
                    lambda: list(self._sync_script()(keys=[self.key], args=self._args(deposits, spend)))
                )
            for wait_s in _POOL_FULL_BACKOFF_S:
                try:
                    result = await script(keys=[self.key], args=self._args(deposits, spend))
                    break
                except MaxConnectionsError:  # a caller's full non-blocking pool: wait for a connection
                    await anyio.sleep(wait_s)
            else:
                result = await script(keys=[self.key], args=self._args(deposits, spend))
            return [x.decode() if isinstance(x, bytes) else x for x in result]
        except (RedisError, OSError):
            self._return_pending(deposits)
            if not swallow:
                raise
            return self._deposit_failed()
        except BaseException:
            self._return_pending(deposits)
            raise

    def _deposit_failed(self) -> _Reply:
        """Inside an ``except``: the deposits wait for the next flush (logged with the error)."""
        log.warning("retry budget %r: could not write deposits to Redis; will retry", self.name,
                    exc_info=True)
        return [0, 0, 0, "0"]

    async def aclose(self) -> None:
        """Write pending deposits, then close the clients this budget created itself (not the ones
        passed in). A failed final write is logged, not raised."""
        try:
            await self.flush_async()
        except (RedisError, OSError) as exc:
            log.warning("retry budget %r: pending deposits not written at close: %r", self.name, exc)
        if self._owns_async and self._async_client is not None:
            await self._async_client.aclose()
        self.close()

    def close(self) -> None:
        """Close the sync client this budget created itself (not one passed in)."""
        if self._owns_sync and self._client is not None:
            self._client.close()
