"""A :class:`~zp_client.forecast.LengthForecaster` shared by the fleet through Redis.

:class:`RedisLengthForecaster` keeps the local forecaster's API (``observe``, ``forecast``, ``quantile``)
and, in a daemon thread, sends its observations in batches and reads back the fleet's counts, so every
process forecasts from what the whole fleet saw. Keys, sync timing, decay and Redis outages: see
docs/redis.md#the-shared-forecaster.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from zp_client._redact import check_redis_url
from zp_client._tasks import Supervisor
from zp_client.errors import ConfigurationError
from zp_client.forecast import DEFAULT_CENSORED, DEFAULT_COLD_N, DEFAULT_Q, LengthForecaster, Prior, _bucket

__all__ = ["RedisLengthForecaster"]

log = logging.getLogger("zp_client.budget.redis_forecast")

# KEYS: counts hash, keys set. ARGV: key name, halve-at total, max keys, TTL seconds, counts-hash prefix, then
# pairs bucket, weight. Field "t" holds the total. Keys come from per-call headers (X-ZP-Route), so what
# they leave in Redis is bounded: a key outside a full set writes nothing (its observations stay local),
# and both hashes and set expire TTL seconds after their last write. A full set first drops up to 8
# members whose counts already expired. Bounded: one HINCRBYFLOAT per distinct bucket of the batch, a
# halving rewrites at most the ~100 buckets of one key.
_ADD_LUA = """
local ttl = tonumber(ARGV[4])
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 0 then
  local cap_keys = tonumber(ARGV[3])
  if redis.call('SCARD', KEYS[2]) >= cap_keys then
    for _, k in ipairs(redis.call('SRANDMEMBER', KEYS[2], 8)) do
      if redis.call('EXISTS', ARGV[5] .. k) == 0 then redis.call('SREM', KEYS[2], k) end
    end
    if redis.call('SCARD', KEYS[2]) >= cap_keys then return 0 end
  end
  redis.call('SADD', KEYS[2], ARGV[1])
end
redis.call('EXPIRE', KEYS[2], ttl)
local total = 0
for i = 6, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
  total = total + tonumber(ARGV[i + 1])
end
local t = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 't', total))
local cap = tonumber(ARGV[2])
if cap > 0 and t > cap then
  local flat = redis.call('HGETALL', KEYS[1])
  for i = 1, #flat, 2 do
    redis.call('HSET', KEYS[1], flat[i], tonumber(flat[i + 1]) / 2)
  end
end
redis.call('EXPIRE', KEYS[1], ttl)
return 1
"""

_FLUSH_CHUNK = 256

#: Seconds a forecaster's Redis hash (and its key set) outlives its last write: 7 days.
DEFAULT_KEY_TTL_S = 7 * 24 * 3600


class RedisLengthForecaster(LengthForecaster):
    """Per-key length distributions learned by the whole fleet; see docs/redis.md#the-shared-forecaster.

    ``client`` is a sync ``redis.Redis`` (or ``RedisCluster``) or a URL; ``name`` the budget's name (its
    hash tag ``{zp:<name>}``). ``max_keys``: most keys kept, in memory (least recently used dropped) and in
    Redis (a key past it stays local); ``key_ttl_s``: a key's Redis hash expires that long after its last
    write (default 7 days). Thread-safe. Call :meth:`close` to send what is pending and stop the
    thread (a :class:`RedisBudget` does it in ``aclose``/``close_sync``).
    """

    def __init__(
        self,
        client: Any,
        name: str,
        *,
        q: float = DEFAULT_Q,
        q_blind: float | None = None,
        q_tail: float | None = None,
        prior: Prior | None = None,
        half_life: float | None = 2000.0,
        priors: Mapping[str, Prior] | None = None,
        sync_interval_s: float = 5.0,
        batch: int = 64,
        max_keys: int = 1000,
        max_pending: int = 100_000,
        key_ttl_s: int = DEFAULT_KEY_TTL_S,
        censored: bool = DEFAULT_CENSORED,
        cold_n: int = DEFAULT_COLD_N,
    ) -> None:
        super().__init__(q=q, q_blind=q_blind, q_tail=q_tail, prior=prior, half_life=None, priors=priors,
                         max_keys=max_keys, censored=censored, cold_n=cold_n)
        if isinstance(key_ttl_s, bool) or not isinstance(key_ttl_s, int) or key_ttl_s < 1:
            raise ConfigurationError(f"key_ttl_s must be a positive integer of seconds, got {key_ttl_s!r}")
        if not (isinstance(sync_interval_s, (int, float)) and sync_interval_s > 0):
            raise ConfigurationError(
                f"sync_interval_s must be a positive number of seconds, got {sync_interval_s!r}")
        if isinstance(client, str):
            import redis as redis_sync

            check_redis_url(client)

            client, self._owns = redis_sync.Redis.from_url(client), True
        else:
            self._owns = False
        self._client = client
        self._prefix = f"{{zp:{name}}}"
        self._keys_key = f"{self._prefix}:fckeys"
        self._halve_at = 2.0 * half_life if half_life else 0.0
        self._interval = float(sync_interval_s)
        self._batch = max(1, int(batch))
        self._key_ttl_s = key_ttl_s
        self._max_pending = int(max_pending)
        self._pending: dict[str, dict[int, float]] = {}
        self._n_pending = 0
        self._plock = threading.Lock()
        self._io_lock = threading.Lock()  # one sync at a time (the thread, or a caller's sync())
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._closed = False
        self._warned = False
        self._script = client.register_script(_ADD_LUA)
        # owns the sync thread (zp_client/_tasks.py): close() stops and joins it
        self._sup = Supervisor(f"forecaster {name}")
        self._thread = self._sup.thread(self._run, name=f"zp-forecast-{name}", stop=self._stop)

    # ------------------------------------------------------------------ learning
    def observe(self, key: str, completion_tokens: int, *, capped: bool = False) -> None:
        """Learn one length locally at once; it reaches the fleet with the next batch (the lengths only:
        a ``censored`` forecaster's capped share is this process's own)."""
        super().observe(key, completion_tokens, capped=capped)
        self._queue(key, [completion_tokens])

    def observe_many(self, key: str, lengths: Any) -> None:
        lengths = list(lengths)
        super().observe_many(key, lengths)
        self._queue(key, lengths)

    def _queue(self, key: str, lengths: list[int]) -> None:
        with self._plock:
            if self._n_pending >= self._max_pending:
                return  # Redis away for long: the fleet misses these, the local view has them
            d = self._pending.setdefault(key, {})
            for n in lengths:
                b = _bucket(float(n))
                d[b] = d.get(b, 0.0) + 1.0
            self._n_pending += len(lengths)
            full = self._n_pending >= self._batch
        if full:
            self._wake.set()

    # ------------------------------------------------------------------ sync
    def sync(self) -> None:
        """Send pending observations and adopt the fleet's counts now. Raises on Redis errors."""
        with self._io_lock:
            self._flush()
            self._pull()

    def _flush(self) -> None:
        with self._plock:
            pending, self._pending, self._n_pending = self._pending, {}, 0
        try:
            # Pipelined in chunks: a burst of distinct keys costs a round trip per chunk, not per key.
            items = list(pending.items())
            for start in range(0, len(items), _FLUSH_CHUNK):
                chunk = items[start:start + _FLUSH_CHUNK]
                try:
                    self._send(chunk)
                except NoScriptError:  # a cluster pipeline loads no script; a restarted Redis lost it
                    self._client.script_load(_ADD_LUA)  # every key is in one slot: nothing was applied
                    self._send(chunk)
                for _, buckets in chunk:
                    buckets.clear()
        except Exception:
            with self._plock:  # put back what was not sent
                for key, buckets in pending.items():
                    d = self._pending.setdefault(key, {})
                    for b, w in buckets.items():
                        d[b] = d.get(b, 0.0) + w
                        self._n_pending += int(w)
            raise

    def _send(self, chunk: list[tuple[str, dict[int, float]]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, buckets in chunk:
            args: list[Any] = [key, self._halve_at, self._max_keys, self._key_ttl_s, self._hkey("")]
            for b, w in buckets.items():
                args += [b, w]
            self._script(keys=[self._hkey(key), self._keys_key], args=args, client=pipe)
        pipe.execute()

    def _pull(self) -> None:
        keys = [k.decode() if isinstance(k, bytes) else str(k) for k in self._client.smembers(self._keys_key)]
        keys = keys[: self._max_keys]
        if not keys:
            return
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.hgetall(self._hkey(k))
        for k, flat in zip(keys, pipe.execute(), strict=False):
            if not flat:
                continue
            counts = self._priors.get(k, self.prior).masses()
            for field, v in flat.items():
                f = field.decode() if isinstance(field, bytes) else str(field)
                if f.isdigit() and int(f) < len(counts):
                    counts[int(f)] += float(v)
            self.merge_counts(k, counts)

    def _hkey(self, key: str) -> str:
        return f"{self._prefix}:fc:{key}"

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=self._interval)
            self._wake.clear()
            if self._closed:
                return
            try:
                self.sync()
                if self._warned:
                    self._warned = False
                    log.warning("zp_client: fleet length forecaster %s reachable again", self._prefix)
            except (RedisError, OSError) as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("zp_client: fleet length forecaster %s cannot reach Redis (%r); forecasting "
                                "from this process's observations until it is back", self._prefix, exc)
                self._stopped.wait(min(self._interval, 1.0))  # a close ends the pause at once

    def _stop(self) -> None:
        self._closed = True
        self._stopped.set()
        self._wake.set()

    def close(self) -> None:
        """Send what is pending (best effort) and stop the thread. Idempotent."""
        if self._closed:
            return
        self._sup.close_threads(wait_s=5.0)  # _stop(), then the join (not from its own thread)
        try:
            with self._io_lock:
                self._flush()
        except (RedisError, OSError) as exc:
            log.warning("zp_client: fleet length forecaster %s could not send its last observations: %r",
                        self._prefix, exc)
        if self._owns:
            try:
                self._client.close()
            except (RedisError, OSError) as exc:
                log.debug("zp_client: closing the forecaster's Redis client failed: %r", exc)
