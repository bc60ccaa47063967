"""The retry policy: one retry loop for every front end, which never adds load the budget did not admit.

The admission transport asks a :class:`RetryPolicy` what to do after each attempt
(``new_request`` once per logical request, ``decide`` after each attempt, ``sleep`` between them).
What is retried, backoff, deadlines and retry budgets: see docs/retries.md; the loop a transport runs:
docs/retries.md#the-policy-api.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import logging
import math
import random
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import tenacity

from zp_client.budget.retries import (
    DEFAULT_BUDGET_FLOOR_PER_S,
    DEFAULT_BUDGET_RATIO,
    DEFAULT_BUDGET_WINDOW_S,
    LocalRetryBudget,
    RetryBudget,
)
from zp_client.budget.retries import (
    validate_retry_budget_params as validate_retry_budget_params,
)
from zp_client.clock import SYSTEM_CLOCK, Clock, wall_time
from zp_client.errors import ConfigurationError, DeadlineExceeded, RetryBudgetExhausted, ZPError

if TYPE_CHECKING:
    from zp_client.budget.base import Ticket
    from zp_client.budget.redis import RedisRetryBudget
    from zp_client.config import Settings

__all__ = [
    "RetryDecision",
    "RetryState",
    "RetryDetails",
    "RetryPolicy",
    "RetryBudget",
    "LocalRetryBudget",
    "RedisRetryBudget",
    "retry_budget_for",
    "parse_retry_after",
    "set_testing",
    "is_testing",
    "testing",
    "TestingRecorder",
]

log = logging.getLogger("zp_client.retry")

DEFAULT_RETRY_STATUSES: frozenset[int] = frozenset({429, 502, 503, 529})

DEFAULT_BUDGET_WAIT_S = 30.0


# --------------------------------------------------------------------------------------------------
# testing switch
# --------------------------------------------------------------------------------------------------


@dataclass
class TestingRecorder:
    """What :func:`testing` saw: the delays that were requested but skipped, in order."""

    __test__ = False  # not a pytest test class

    sleeps: list[float] = field(default_factory=list)


_testing_recorders: list[TestingRecorder] = []
_testing_flag = False
_testing_lock = threading.Lock()


def set_testing(enabled: bool) -> None:
    """Globally skip (``True``) or restore (``False``) the sleeping between attempts.

    Decisions and their delays are unchanged; only :meth:`RetryPolicy.sleep` / ``sleep_sync`` return
    at once. Meant for test suites, like stamina's ``set_testing``.
    """
    global _testing_flag
    _testing_flag = bool(enabled)


def is_testing() -> bool:
    """Whether the sleeping is currently skipped (by :func:`set_testing` or :func:`testing`)."""
    return _testing_flag or bool(_testing_recorders)


@contextlib.contextmanager
def testing() -> Iterator[TestingRecorder]:
    """``with testing() as rec:`` skips the sleeping inside the block; ``rec.sleeps`` lists the delays."""
    recorder = TestingRecorder()
    with _testing_lock:
        _testing_recorders.append(recorder)
    try:
        yield recorder
    finally:
        with _testing_lock:
            _testing_recorders.remove(recorder)


testing.__test__ = False  # type: ignore[attr-defined]  # keep pytest from collecting an imported `testing`


def _record_skipped_sleep(seconds: float) -> None:
    with _testing_lock:
        for recorder in _testing_recorders:
            recorder.sleeps.append(seconds)


# --------------------------------------------------------------------------------------------------
# Retry-After
# --------------------------------------------------------------------------------------------------



class HeaderItems(Protocol):
    """Response headers as the retry rules read them: ``(name, value)`` pairs (a mapping's ``items()``,
    an httpx ``Headers``)."""

    def items(self) -> Iterable[tuple[str, str]]: ...


def _lower_headers(headers: HeaderItems | None) -> dict[str, str]:
    # httpx.Headers is case-insensitive, a plain dict is not; lower-case once so both behave the same.
    if not headers:
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items()}


def parse_retry_after(headers: HeaderItems | None, *, now: float | None = None) -> float | None:
    """Seconds the server asked the client to wait, or ``None`` when it did not say (or said nonsense).

    Forms, in order of preference: ``retry-after-ms`` (milliseconds, float), ``retry-after`` as
    (possibly fractional) seconds, ``retry-after`` as an HTTP date (RFC 9110; relative to ``now``, a
    Unix time, default ``time.time()``; a date in the past means 0). Negative or NaN numbers are
    ignored; an infinite one is returned as ``math.inf`` (the caller's cap then refuses it).
    """
    h = _lower_headers(headers)
    for name, divisor in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        raw = h.get(name)
        if raw is None:
            continue
        try:
            value = float(raw.strip())
        except ValueError:
            continue
        if math.isnan(value) or value < 0:
            continue
        return value / divisor
    raw = h.get("retry-after")
    if raw is None:
        return None
    try:
        when = email.utils.parsedate_to_datetime(raw.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:  # pragma: no cover - older Pythons returned None instead of raising
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are GMT; a naive result means the zone was "-0000", which also means UTC.
        import datetime as _dt

        when = when.replace(tzinfo=_dt.timezone.utc)
    current = wall_time() if now is None else now
    return max(0.0, when.timestamp() - current)


def _should_retry_header(headers: HeaderItems | None) -> bool | None:
    raw = _lower_headers(headers).get("x-should-retry")
    if raw is None:
        return None
    value = raw.strip().lower()
    if value == "true":
        return True
    if value == "false":
        return False
    return None


# --------------------------------------------------------------------------------------------------
# error classification (httpx and httpx2, without importing httpx2)
# --------------------------------------------------------------------------------------------------

# Request never reached (or never fully reached) the server: retrying cannot double its work.
_CONNECT_ERROR_NAMES = ("ConnectError", "ConnectTimeout", "WriteError", "WriteTimeout", "RemoteProtocolError")
# The request may still be running upstream: retried only with retry_on_504 / retry_read_timeouts.
_READ_ERROR_NAMES = ("ReadTimeout", "ReadError")


def _exception_classes(names: Iterable[str]) -> tuple[type[BaseException], ...]:
    # An exception of an httpx2 class can only exist if httpx2 was imported by someone, so looking in
    # sys.modules finds every class that matters and never imports httpx2 (absent in openai 2.x envs).
    found: list[type[BaseException]] = []
    for module_name in ("httpx", "httpx2"):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


def classify_error(error: BaseException) -> str | None:
    """``"connect"`` (the request never, or never fully, reached the server), ``"read"`` (it may still
    run upstream) or None (not an httpx/httpx2 transport error we know)."""
    return _classify_error(error)


def _classify_error(error: BaseException) -> str | None:
    """``"connect"``, ``"read"`` or ``None`` (not a transport error we know how to retry)."""
    if isinstance(error, _exception_classes(_CONNECT_ERROR_NAMES)):
        return "connect"
    if isinstance(error, _exception_classes(_READ_ERROR_NAMES)):
        return "read"
    return None


# --------------------------------------------------------------------------------------------------
# retry budgets
# --------------------------------------------------------------------------------------------------


def __getattr__(name: str) -> Any:
    # RedisRetryBudget lives beside the Redis budget; re-exported lazily so importing this module never
    # imports redis.
    if name == "RedisRetryBudget":
        from zp_client.budget.redis import RedisRetryBudget

        return RedisRetryBudget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def retry_budget_for(
    budget: object, *, ratio: float = DEFAULT_BUDGET_RATIO, floor_per_s: float = DEFAULT_BUDGET_FLOOR_PER_S,
    window_s: float = DEFAULT_BUDGET_WINDOW_S,
) -> RetryBudget:
    """A new retry budget matching a KV budget: fleet-wide for a ``RedisBudget``, per process otherwise.

    Calls the budget's public :meth:`~zp_client.Budget.new_retry_budget`; anything that is not a budget
    gets a :class:`LocalRetryBudget`. Defaults: ratio 0.5, floor 0.5/s, window 20 s. Front ends share
    :meth:`~zp_client.Budget.retry_budget` (one per KV budget) instead.
    """
    factory = getattr(budget, "new_retry_budget", None)
    if callable(factory):
        rb: RetryBudget = factory(ratio=ratio, floor_per_s=floor_per_s, window_s=window_s)
        return rb
    return LocalRetryBudget(ratio=ratio, floor_per_s=floor_per_s, window_s=window_s)


# --------------------------------------------------------------------------------------------------
# the policy
# --------------------------------------------------------------------------------------------------


@dataclass
class RetryDecision:
    """What the transport does after an attempt.

    ``retry``: sleep ``delay_s`` (lease released), re-acquire with the original ticket, send again. When
    ``budget_owed`` is set the retry budget has not granted it yet: after the sleep the transport calls
    :meth:`RetryPolicy.wait_for_budget` / ``wait_for_budget_async`` (still holding no lease), which
    returns once the budget grants it or raises :class:`~zp_client.RetryBudgetExhausted`. Otherwise: if
    ``error`` is set, raise it (zp-client's own :class:`~zp_client.RetryBudgetExhausted` or
    :class:`~zp_client.DeadlineExceeded`, chained to the attempt's error via ``__cause__`` when there was
    one); if ``error`` is ``None``, return the response / re-raise the original error unchanged.
    """

    retry: bool
    delay_s: float
    reason: str
    error: BaseException | None = None
    budget_owed: bool = False


@dataclass
class RetryState:
    """One logical request's progress. Made by :meth:`RetryPolicy.new_request`; opaque to callers except
    for the read-only counters and ``ticket``, a free slot where the transport keeps the first attempt's
    budget ticket so a retry keeps its place in line."""

    started_at: float = field(default_factory=SYSTEM_CLOCK.monotonic)
    """When the logical request began, on the policy's clock (:func:`time.monotonic` by default)."""
    attempts: int = 0
    """Attempts decided on so far (incremented by each :meth:`RetryPolicy.decide`)."""
    retries: int = 0
    """Retries granted so far."""
    total_delay_s: float = 0.0
    """Sum of the delays of the granted retries."""
    last_reason: str = ""
    ticket: Ticket | None = None
    now: Callable[[], float] = field(default=SYSTEM_CLOCK.monotonic, repr=False, compare=False)
    owed: _Pending | None = field(default=None, repr=False, compare=False)
    """The retry a ``budget_owed`` decision still waits to be granted (internal)."""
    """The clock ``started_at`` and :attr:`elapsed_s` read (the policy's ``clock.monotonic``)."""

    @property
    def elapsed_s(self) -> float:
        return self.now() - self.started_at


@dataclass(frozen=True)
class RetryDetails:
    """What the hooks receive. ``attempt`` is the 1-based number of the attempt that just failed."""

    attempt: int
    reason: str
    delay_s: float
    status: int | None
    error: BaseException | None
    elapsed_s: float
    remaining_s: float | None
    give_up_error: BaseException | None = None
    """On give-up: the error zp-client will raise (``None`` when the original outcome passes through)."""


Hook = Callable[[RetryDetails], object]

_DEFAULT_BUDGET: Any = object()


@dataclass
class _Pending:
    """A retry the rules allow, waiting for the retry budget to agree."""

    delay_s: float
    reason: str
    details: RetryDetails
    free: bool = False
    """A retry that cannot add load (the connection was refused or never opened): not charged to the
    retry budget."""


# Connection failures that never reached a server: retrying them adds no load, so they do not spend the
# retry budget, and when they end a request it fails with ServerUnreachable (never "overloaded").
UNREACHABLE_ERROR_NAMES = ("ConnectError", "ConnectTimeout")


def is_unreachable(error: BaseException | None) -> bool:
    """Whether ``error`` is an httpx/httpx2 connect error or connect timeout (no server reached)."""
    return error is not None and isinstance(error, _exception_classes(UNREACHABLE_ERROR_NAMES))


class RetryPolicy:
    """The retry rules of zp-client (see docs/retries.md for the reasoning).

    Parameters and defaults:

    * ``max_attempts=3``: attempts per logical request, the first included (1 disables retries).
    * ``backoff_initial_s=0.5``, ``backoff_max_s=8.0``: full-jitter exponential backoff, delay before
      retry n (0-based) uniform in ``[0, min(backoff_max_s, backoff_initial_s * 2**n)]``.
    * ``retry_after_cap_s=30.0``: the longest ``Retry-After`` honoured; a longer one gives up.
    * ``retry_statuses={429, 502, 503, 529}`` (529: an overload answer, e.g. NVIDIA Dynamo's "all workers
      busy"; treated like 503).
    * ``retry_on_504=False``: also retry 504 — only when the upstream aborts abandoned requests.
    * ``retry_read_timeouts=None``: retry read timeouts / read errors; ``None`` follows ``retry_on_504``.
    * ``budget``: a :class:`RetryBudget`; default a new :class:`LocalRetryBudget` (ratio 0.5, floor 0.5/s,
      window 20 s) per policy; ``None`` disables the retry budget.
    * ``budget_wait_s=30.0``: how long a retry the budget refuses waits for it (holding no lease) when
      the request has no deadline; with a deadline, the deadline bounds the wait instead. Then the request
      fails with :class:`~zp_client.RetryBudgetExhausted`. Connect errors (nothing reached a server) are
      not charged to the budget.
    * ``on_retry``, ``on_give_up``: hook lists, each called with a :class:`RetryDetails`. A hook that
      raises is logged and ignored. ``on_give_up`` fires when a retryable failure is not retried
      (attempts, Retry-After cap, deadline, budget), not for successes or non-retryable outcomes.
    * ``min_attempt_s=0.5``: the least time an attempt needs; a retry whose delay plus this does not fit
      in ``remaining_s`` fails with :class:`~zp_client.DeadlineExceeded`.

    Invalid values raise :class:`~zp_client.ConfigurationError`. A policy is safe to share between
    threads and tasks; per-request state lives in :class:`RetryState`.
    """

    def __init__(
        self,
        *,
        max_attempts: int = 3,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 8.0,
        retry_after_cap_s: float = 30.0,
        retry_statuses: Iterable[int] = DEFAULT_RETRY_STATUSES,
        retry_on_504: bool = False,
        retry_read_timeouts: bool | None = None,
        budget: RetryBudget | None = _DEFAULT_BUDGET,
        on_retry: Iterable[Hook] = (),
        on_give_up: Iterable[Hook] = (),
        min_attempt_s: float = 0.5,
        clock: Clock | None = None,
        budget_wait_s: float = DEFAULT_BUDGET_WAIT_S,
    ) -> None:
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if not (backoff_initial_s > 0 and math.isfinite(backoff_initial_s)):
            raise ConfigurationError(
                f"backoff_initial_s must be a finite number > 0, got {backoff_initial_s!r}")
        if not (backoff_max_s >= backoff_initial_s and math.isfinite(backoff_max_s)):
            raise ConfigurationError(
                f"backoff_max_s must be finite and >= backoff_initial_s ({backoff_initial_s}), "
                f"got {backoff_max_s!r}"
            )
        if not retry_after_cap_s >= 0:
            raise ConfigurationError(f"retry_after_cap_s must be >= 0, got {retry_after_cap_s!r}")
        if not (min_attempt_s >= 0 and math.isfinite(min_attempt_s)):
            raise ConfigurationError(f"min_attempt_s must be a finite number >= 0, got {min_attempt_s!r}")
        if not (budget_wait_s >= 0 and math.isfinite(budget_wait_s)):
            raise ConfigurationError(f"budget_wait_s must be a finite number >= 0, got {budget_wait_s!r}")
        statuses = frozenset(int(s) for s in retry_statuses)
        if any(not 100 <= s <= 599 for s in statuses):
            raise ConfigurationError(f"retry_statuses must be HTTP status codes, got {sorted(statuses)}")
        self.max_attempts = max_attempts
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.retry_after_cap_s = float(retry_after_cap_s)
        self.retry_statuses = statuses
        self.retry_on_504 = bool(retry_on_504)
        self.retry_read_timeouts = (
            self.retry_on_504 if retry_read_timeouts is None else bool(retry_read_timeouts))
        self.clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        self.budget: RetryBudget | None = (
            LocalRetryBudget(clock=self.clock.monotonic) if budget is _DEFAULT_BUDGET else budget)
        self.on_retry: list[Hook] = list(on_retry)
        self.on_give_up: list[Hook] = list(on_give_up)
        self.min_attempt_s = float(min_attempt_s)
        self.budget_wait_s = float(budget_wait_s)
        # tenacity's "Full Jitter": uniform(0, min(max, multiplier * 2 ** (attempt_number - 1))).
        self._wait = tenacity.wait_random_exponential(multiplier=self.backoff_initial_s,
                                                      max=self.backoff_max_s)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> RetryPolicy:
        """A policy from :class:`~zp_client.Settings` (``ZP_RETRY_*``); keyword arguments win."""
        clock: Clock = overrides.get("clock") or SYSTEM_CLOCK
        kwargs: dict[str, Any] = {
            "max_attempts": settings.retry_max_attempts,
            "backoff_initial_s": settings.retry_backoff_initial_s,
            "backoff_max_s": settings.retry_backoff_max_s,
            "retry_after_cap_s": settings.retry_after_cap_s,
            "retry_on_504": settings.retry_on_504,
            "min_attempt_s": settings.retry_min_attempt_s,
            "budget_wait_s": settings.retry_budget_wait_s,
            "budget": LocalRetryBudget(
                ratio=settings.retry_budget_ratio,
                floor_per_s=settings.retry_budget_floor_per_s,
                window_s=settings.retry_budget_window_s,
                clock=clock.monotonic,
            ),
        }
        kwargs.update(overrides)
        return cls(**kwargs)

    # -- backoff -------------------------------------------------------------------------------------

    def backoff(self, retry_number: int) -> float:
        """A full-jitter delay before retry ``retry_number`` (0-based): uniform in
        ``[0, min(backoff_max_s, backoff_initial_s * 2**retry_number)]``."""
        call_state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]  # tenacity types retry_object as required; wait strategies never read it
        call_state.attempt_number = retry_number + 1
        return float(self._wait(call_state))

    # -- per request ---------------------------------------------------------------------------------

    def new_request(self) -> RetryState:
        """Start a logical request. Deposits nothing: the retry budget earns from answers
        (:meth:`decide` deposits when an attempt is answered). Never raises."""
        return self._new_state()

    def _new_state(self) -> RetryState:
        now = self.clock.monotonic
        return RetryState(started_at=now(), now=now)

    async def new_request_async(self) -> RetryState:
        """:meth:`new_request` for async transports."""
        return self._new_state()

    def _answered(self, status: int | None, error: BaseException | None) -> bool:
        # An answer the server gave on purpose (2xx-4xx, not an overload status): it earns retries.
        return error is None and status is not None and status < 500 and status not in self.retry_statuses

    def _deposit(self) -> None:
        if self.budget is not None:
            try:
                self.budget.record_request()
            except Exception:
                log.warning("retry budget: could not record an answered request", exc_info=True)

    async def _deposit_async(self) -> None:
        if self.budget is not None:
            try:
                fn = getattr(self.budget, "record_request_async", None)
                if fn is not None:
                    await fn()
                else:
                    self.budget.record_request()
            except Exception:
                log.warning("retry budget: could not record an answered request", exc_info=True)

    def decide(
        self,
        state: RetryState,
        *,
        status: int | None,
        headers: HeaderItems | None,
        error: BaseException | None,
        delivered: bool,
        remaining_s: float | None,
        wait_for_budget: bool = False,
    ) -> RetryDecision:
        """Decide after one finished attempt (call exactly once per attempt).

        ``status``/``headers``: the response's, when one arrived; ``error``: the exception the attempt
        raised, if any; ``delivered``: whether any response bytes already reached the caller;
        ``remaining_s``: what is left of the logical request's deadline (``None``: no deadline).
        Call it for successes too: an answered attempt is the retry budget's deposit. May spend from the
        retry budget (a round trip for :class:`RedisRetryBudget`). ``wait_for_budget``: when the budget
        refuses the retry now, answer ``RetryDecision(retry=True, budget_owed=True)`` and let the caller
        wait for it with :meth:`wait_for_budget` (the transports do); ``False`` (the default) gives up at
        once with :class:`~zp_client.RetryBudgetExhausted`.
        """
        step = self._rules(state, status, headers, error, delivered, remaining_s)
        if isinstance(step, RetryDecision):
            if self._answered(status, error):
                self._deposit()
            return step
        if step.free or self.budget is None:
            return self._finish(state, step, True)
        try:
            granted = self.budget.try_spend()
        except Exception:  # any RetryBudget's failure (Redis down...): logged with its traceback
            log.warning("retry budget unavailable; not retrying (%s)", step.reason, exc_info=True)
            return self._budget_failed(step)
        if not granted and wait_for_budget:
            return self._owe(state, step)
        return self._finish(state, step, granted)

    async def decide_async(
        self,
        state: RetryState,
        *,
        status: int | None,
        headers: HeaderItems | None,
        error: BaseException | None,
        delivered: bool,
        remaining_s: float | None,
        wait_for_budget: bool = False,
    ) -> RetryDecision:
        """:meth:`decide` for async transports: the retry budget's I/O does not block the event loop."""
        step = self._rules(state, status, headers, error, delivered, remaining_s)
        if isinstance(step, RetryDecision):
            if self._answered(status, error):
                await self._deposit_async()
            return step
        if step.free or self.budget is None:
            return self._finish(state, step, True)
        try:
            granted = await self._try_spend_async()
        except Exception:  # any RetryBudget's failure (Redis down...): logged with its traceback
            log.warning("retry budget unavailable; not retrying (%s)", step.reason, exc_info=True)
            return self._budget_failed(step)
        if not granted and wait_for_budget:
            return self._owe(state, step)
        return self._finish(state, step, granted)

    async def _try_spend_async(self) -> bool:
        assert self.budget is not None
        fn = getattr(self.budget, "try_spend_async", None)
        return bool(await fn()) if fn is not None else self.budget.try_spend()

    # -- waiting for the retry budget ----------------------------------------------------------------

    def _owe(self, state: RetryState, step: _Pending) -> RetryDecision:
        state.owed = step
        reason = f"{step.reason}; waiting for the retry budget"
        log.debug("attempt %d: retry budget spent, the retry waits for it", step.details.attempt)
        return RetryDecision(True, step.delay_s, reason, budget_owed=True)

    def _wait_bound(self, remaining_s: float | None) -> tuple[float, str]:
        if remaining_s is not None:
            return remaining_s - self.min_attempt_s, "the request's deadline left no room for another attempt"
        return self.budget_wait_s, f"retry_budget_wait_s ({self.budget_wait_s:g} s) ran out"

    def _poll_s(self) -> float:
        # Ask again about once per bucket of the window (when old retries age out), jittered so that
        # waiters spread out instead of polling in step.
        bucket = getattr(self.budget, "bucket_s", None)
        if not isinstance(bucket, (int, float)) or not bucket > 0:
            bucket = 1.0
        return min(float(bucket), 1.0) * random.uniform(0.5, 1.0)

    def wait_for_budget(self, state: RetryState, *, remaining_s: float | None) -> None:
        """Blocking form of :meth:`wait_for_budget_async`."""
        step = self._take_owed(state)
        if step is None:
            return
        wait = _BudgetWait(self, step, remaining_s)
        while True:
            try:
                granted = self.budget.try_spend() if self.budget is not None else True
            except Exception as exc:  # noqa: BLE001 - logged, then the retry's typed refusal
                raise wait.unreadable(exc) from None
            if granted:
                self._finish(state, step, True)
                return
            pause = wait.next_pause()
            self.sleep_sync(pause)
            wait.slept += pause

    async def wait_for_budget_async(self, state: RetryState, *, remaining_s: float | None) -> None:
        """Wait until the retry budget grants the retry a ``budget_owed`` decision announced (the caller
        holds no lease meanwhile), asking again about once per bucket of the budget's window. Bounded by
        ``remaining_s`` minus ``min_attempt_s`` when the request has a deadline, else by
        ``budget_wait_s``; then raises :class:`~zp_client.RetryBudgetExhausted` (``__cause__``: the
        failed attempt's error, if any). Cancellable at any point; returns at once when nothing is owed.
        """
        step = self._take_owed(state)
        if step is None:
            return
        wait = _BudgetWait(self, step, remaining_s)
        while True:
            try:
                granted = await self._try_spend_async() if self.budget is not None else True
            except Exception as exc:  # noqa: BLE001 - logged, then the retry's typed refusal
                raise wait.unreadable(exc) from None
            if granted:
                self._finish(state, step, True)
                return
            pause = wait.next_pause()
            await self.sleep(pause)
            wait.slept += pause

    @staticmethod
    def _take_owed(state: RetryState) -> _Pending | None:
        step, state.owed = state.owed, None
        return step if isinstance(step, _Pending) else None

    def _exhausted(self, step: _Pending, waited: float, why: str) -> RetryBudgetExhausted:
        err = RetryBudgetExhausted(
            f"the retry budget stayed spent for {waited:.3g} s (retries are capped at {self._budget_rule()}) "
            f"until {why}, so the failed attempt {step.details.attempt} ({step.reason}) is not retried; "
            "most of this budget's recent attempts failed, so the server is failing or overloaded — slow "
            "down, or raise the retry budget's ratio/floor or retry_budget_wait_s"
        )
        err.__cause__ = step.details.error
        self._give_up(dataclasses.replace(step.details, reason=f"{step.reason}; retry budget exhausted",
                                          delay_s=0.0), err)
        return err

    # -- sleeping ------------------------------------------------------------------------------------

    async def sleep(self, seconds: float) -> None:
        """Sleep between attempts (cancellable); returns at once in testing mode (still a checkpoint)."""
        if is_testing():
            _record_skipped_sleep(seconds)
            await anyio.sleep(0)
            return
        await self.clock.sleep(max(0.0, seconds))

    def sleep_sync(self, seconds: float) -> None:
        """Blocking form of :meth:`sleep`."""
        if is_testing():
            _record_skipped_sleep(seconds)
            return
        self.clock.sleep_sync(max(0.0, seconds))

    # -- internals -----------------------------------------------------------------------------------

    def _classify(
        self, status: int | None, headers: HeaderItems | None, error: BaseException | None
    ) -> tuple[bool, str]:
        if error is not None:
            if isinstance(error, ZPError):
                return False, f"zp-client error {type(error).__name__}"
            kind = _classify_error(error)
            if kind == "connect":
                return True, f"connect error ({type(error).__name__})"
            if kind == "read":
                if self.retry_read_timeouts:
                    return True, f"read error ({type(error).__name__}), upstream aborts"
                return False, (f"read error ({type(error).__name__}) not retried: "
                               "the upstream may still be running it")
            return False, f"error {type(error).__name__} not retryable"
        if status is None:
            return False, "no status and no error"
        # x-should-retry speaks about failures only; a success is never retried whatever it says.
        should = _should_retry_header(headers) if status >= 400 else None
        if should is True:
            return True, f"status {status}, x-should-retry: true"
        if should is False:
            return False, f"status {status}, x-should-retry: false"
        if status in self.retry_statuses:
            return True, f"status {status}"
        if status == 504:
            if self.retry_on_504:
                return True, "status 504, upstream aborts"
            return False, "status 504 not retried: the upstream may still be running it"
        return False, f"status {status}"

    def _rules(
        self,
        state: RetryState,
        status: int | None,
        headers: HeaderItems | None,
        error: BaseException | None,
        delivered: bool,
        remaining_s: float | None,
    ) -> RetryDecision | _Pending:
        state.attempts += 1
        attempt = state.attempts

        def details(reason: str, delay: float = 0.0) -> RetryDetails:
            return RetryDetails(attempt, reason, delay, status, error, state.elapsed_s, remaining_s)

        if delivered:
            reason = "response bytes already delivered to the caller"
            state.last_reason = reason
            return RetryDecision(False, 0.0, reason)
        retryable, reason = self._classify(status, headers, error)
        state.last_reason = reason
        if not retryable:
            return RetryDecision(False, 0.0, reason)
        if attempt >= self.max_attempts:
            return self._give_up(details(f"{reason}; max attempts ({self.max_attempts}) reached"), None)

        retry_after = parse_retry_after(headers) if status is not None else None
        if retry_after is not None:
            if retry_after > self.retry_after_cap_s:
                return self._give_up(
                    details(f"{reason}; retry-after {retry_after:g} s exceeds cap "
                            f"{self.retry_after_cap_s:g} s"),
                    None,
                )
            delay, reason = retry_after, f"{reason}, retry-after {retry_after:g} s"
        else:
            delay = self.backoff(state.retries)

        if remaining_s is not None and (remaining_s <= 0 or remaining_s < delay + self.min_attempt_s):
            err = DeadlineExceeded(
                f"the request's deadline has {max(0.0, remaining_s):.3g} s left, which cannot fit the "
                f"{delay:.3g} s wait plus a {self.min_attempt_s:g} s attempt after attempt {attempt} "
                f"failed ({reason}); not retrying — raise the deadline or lower the backoff"
            )
            err.__cause__ = error
            return self._give_up(details(f"{reason}; deadline"), err)
        return _Pending(delay, reason, details(reason, delay), free=is_unreachable(error))

    def _finish(self, state: RetryState, step: _Pending, granted: bool) -> RetryDecision:
        if not granted:
            err = RetryBudgetExhausted(
                f"the retry budget is spent (retries are capped at {self._budget_rule()}), so the failed "
                f"attempt {step.details.attempt} ({step.reason}) is not retried; most of this budget's "
                "recent attempts failed, so the server is failing or overloaded — slow down, or raise the "
                "retry budget's ratio/floor"
            )
            err.__cause__ = step.details.error
            return self._give_up(
                dataclasses.replace(step.details, reason=f"{step.reason}; retry budget exhausted",
                                    delay_s=0.0),
                err,
            )
        state.retries += 1
        state.total_delay_s += step.delay_s
        state.last_reason = step.reason
        self._call_hooks(self.on_retry, step.details)
        log.debug("retrying after attempt %d: %s; sleeping %.3f s", step.details.attempt, step.reason,
                  step.delay_s)
        return RetryDecision(True, step.delay_s, step.reason)

    def _budget_failed(self, step: _Pending) -> RetryDecision:
        # The budget cannot be consulted (Redis down): not retrying is the safe side — a retry that no
        # budget admitted is exactly the load this module exists to prevent.
        return self._give_up(
            dataclasses.replace(step.details, reason=f"{step.reason}; retry budget unavailable", delay_s=0.0),
            None,
        )

    def _budget_rule(self) -> str:
        b = self.budget
        ratio, floor, window = (getattr(b, "ratio", None), getattr(b, "floor_per_s", None),
                                getattr(b, "window_s", None))
        if ratio is None or floor is None or window is None:
            return "the budget's rule"
        return f"{ratio:g} x answered requests + {floor:g}/s x {window:g} s"

    def _give_up(self, details: RetryDetails, error: BaseException | None) -> RetryDecision:
        final = dataclasses.replace(details, delay_s=0.0, give_up_error=error)
        self._call_hooks(self.on_give_up, final)
        log.debug("giving up after attempt %d: %s", details.attempt, details.reason)
        return RetryDecision(False, 0.0, details.reason, error)

    @staticmethod
    def _call_hooks(hooks: list[Hook], details: RetryDetails) -> None:
        for hook in hooks:
            try:
                hook(details)
            except Exception:
                log.warning("retry hook %r raised; ignored", hook, exc_info=True)


class _BudgetWait:
    """One retry's wait for the retry budget, sans I/O: the bound, the time waited, the verdicts. The
    sync and async loops of :class:`RetryPolicy` only ask the budget and sleep."""

    __slots__ = ("policy", "step", "bound", "why", "started", "slept")

    def __init__(self, policy: RetryPolicy, step: _Pending, remaining_s: float | None) -> None:
        self.policy, self.step = policy, step
        self.bound, self.why = policy._wait_bound(remaining_s)
        self.started, self.slept = policy.clock.monotonic(), 0.0

    def waited(self) -> float:
        # the clock's, or the sleeps asked for when testing mode skips them
        return max(self.slept, self.policy.clock.monotonic() - self.started)

    def unreadable(self, exc: BaseException) -> RetryBudgetExhausted:
        log.warning("retry budget unavailable while waiting; not retrying (%s)", self.step.reason,
                    exc_info=exc)
        return self.policy._exhausted(self.step, self.waited(),
                                      f"the retry budget could not be read ({type(exc).__name__})")

    def next_pause(self) -> float:
        """How long to sleep before asking again; raises :class:`~zp_client.RetryBudgetExhausted` when
        the bound is reached."""
        waited = self.waited()
        if waited >= self.bound:
            raise self.policy._exhausted(self.step, waited, self.why)
        return min(self.bound - waited, self.policy._poll_s())
