"""Retry budgets: a cap on retries relative to answered requests (docs/retries.md#the-retry-budget).

The per-process :class:`LocalRetryBudget` and the :class:`RetryBudget` protocol every retry budget
satisfies (the fleet-wide one, :class:`~zp_client.budget.redis.RedisRetryBudget`, lives beside the Redis
budget). They sit in the budget layer because a KV budget hands out the retry budget that matches it
(:meth:`~zp_client.Budget.retry_budget`); the retry policy that spends them (:mod:`zp_client.retry`)
re-exports them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import ConfigurationError

__all__ = ["DEFAULT_BUDGET_RATIO", "DEFAULT_BUDGET_FLOOR_PER_S", "DEFAULT_BUDGET_WINDOW_S", "RetryBudget",
           "LocalRetryBudget", "validate_retry_budget_params"]

# The retry budget's defaults (Settings.retry_budget_*; docs/retries.md#the-retry-budget): retries <= RATIO x
# answered requests + FLOOR_PER_S x WINDOW_S over a sliding window of WINDOW_S seconds.
DEFAULT_BUDGET_RATIO = 0.5
DEFAULT_BUDGET_FLOOR_PER_S = 0.5
DEFAULT_BUDGET_WINDOW_S = 20.0


@runtime_checkable
class RetryBudget(Protocol):
    """A cap on retries relative to answered requests, shared by the policy's users.

    ``record_request()`` is called once per logical request the server answered (a status that is neither
    5xx nor a retryable one: a deposit), ``try_spend()`` once per retry the policy would like to make; it
    returns ``False`` when the retry may not happen now (the policy then waits and asks again). Both are
    synchronous and cheap. A budget doing network I/O also offers ``async record_request_async()`` /
    ``async try_spend_async()``, which :meth:`RetryPolicy.new_request_async` / ``decide_async`` use.
    """

    def record_request(self) -> None: ...

    def try_spend(self) -> bool: ...


def validate_retry_budget_params(ratio: float, floor_per_s: float, window_s: float, buckets: int) -> None:
    """Raise :class:`~zp_client.ConfigurationError` unless the retry budget parameters are usable."""
    if not (ratio >= 0 and math.isfinite(ratio)):
        raise ConfigurationError(f"retry budget ratio must be a finite number >= 0, got {ratio!r}")
    if not (floor_per_s >= 0 and math.isfinite(floor_per_s)):
        raise ConfigurationError(
            f"retry budget floor_per_s must be a finite number >= 0, got {floor_per_s!r}")
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ConfigurationError(f"retry budget window_s must be a finite number > 0, got {window_s!r}")
    if buckets < 1:
        raise ConfigurationError(f"retry budget buckets must be >= 1, got {buckets!r}")


class LocalRetryBudget:
    """An in-process retry budget: retries <= ``ratio`` x answered requests + ``floor_per_s`` x ``window_s``.

    Counted over a sliding window of ``window_s`` seconds made of ``buckets`` fixed buckets (so the
    window really spans between ``window_s - window_s/buckets`` and ``window_s``). Defaults: ratio 0.5
    (one retry per two answered requests), floor 0.5 retry per second, window 20 s, i.e. when nothing is
    answered (a server that fails everything) 10 retries per 20 s still go through. Retries refused now
    become possible as the window slides (old retries age out) or as answers arrive: the policy waits for
    that (docs/retries.md#the-retry-budget). Thread-safe; ``clock`` (monotonic seconds) is for tests.
    """

    def __init__(
        self,
        ratio: float = DEFAULT_BUDGET_RATIO,
        floor_per_s: float = DEFAULT_BUDGET_FLOOR_PER_S,
        window_s: float = DEFAULT_BUDGET_WINDOW_S,
        *,
        buckets: int = 10,
        clock: Callable[[], float] = SYSTEM_CLOCK.monotonic,
    ) -> None:
        validate_retry_budget_params(ratio, floor_per_s, window_s, buckets)
        self.ratio = float(ratio)
        self.floor_per_s = float(floor_per_s)
        self.window_s = float(window_s)
        self._bucket_s = self.window_s / buckets
        self.bucket_s = self._bucket_s
        """Length of one bucket of the window: how often a refused retry asks again."""
        self._nbuckets = buckets
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[int, list[int]] = {}  # bucket -> [requests, retries]

    def _current(self) -> int:
        current = math.floor(self._clock() / self._bucket_s)
        oldest = current - self._nbuckets + 1
        for bucket in [b for b in self._counts if b < oldest]:
            del self._counts[bucket]
        return current

    def record_request(self) -> None:
        """Count one answered logical request (a deposit that earns ``ratio`` of a retry)."""
        with self._lock:
            self._counts.setdefault(self._current(), [0, 0])[0] += 1

    def try_spend(self) -> bool:
        """Take one retry if the window allows it; ``False`` means: do not retry."""
        with self._lock:
            current = self._current()
            requests = sum(c[0] for c in self._counts.values())
            retries = sum(c[1] for c in self._counts.values())
            if retries + 1 > self.ratio * requests + self.floor_per_s * self.window_s:
                return False
            self._counts.setdefault(current, [0, 0])[1] += 1
            return True

    async def record_request_async(self) -> None:
        self.record_request()

    async def try_spend_async(self) -> bool:
        return self.try_spend()

    def snapshot(self) -> tuple[int, int]:
        """``(requests, retries)`` in the current window."""
        with self._lock:
            self._current()
            return (sum(c[0] for c in self._counts.values()), sum(c[1] for c in self._counts.values()))
