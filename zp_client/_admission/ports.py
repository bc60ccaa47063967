"""The seams of the admission core: one :class:`typing.Protocol` per collaborator it talks to (those that
speak the attempt loop's own vocabulary, the fleet's and the response body's, are in
:mod:`~zp_client._admission.loop_ports`).

The core (:mod:`zp_client._admission.core`) and its modules are typed against these, never against a
concrete fleet, forecaster, estimator, retry policy, metrics sink or HTTP library: the real classes
satisfy them structurally (``mypy`` checks it where they are handed in), a test double needs only the
members named here. Optional abilities (a forecaster that can read the request, a budget that reads the
forecast's spread, a fleet) are their own small protocols, checked with ``isinstance``.
"""

from __future__ import annotations

from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Iterator,
    Mapping,
)
from typing import TYPE_CHECKING, Protocol, TypedDict, overload, runtime_checkable

if TYPE_CHECKING:
    from zp_client.budget.base import Budget
    from zp_client.clock import Clock
    from zp_client.estimate import PromptEstimate
    from zp_client.retry import RetryDecision, RetryState
    from zp_client.server import ServerInfo

__all__ = [
    "JSONObject", "LeaseMeta", "HttpURL", "HttpHeaders", "HttpRequest", "HttpResponse",
    "AsyncClosable", "AsyncInner", "SyncInner", "Forecaster", "RequestForecaster", "BlindForecaster",
    "SpreadForecaster",
    "SharesForecasts", "ReadsSpread", "Estimator", "RetryPolicy",
    "Metrics", "Placed", "Predicted", "Named", "TransportOptions",
]

JSONObject = dict[str, object]
"""A request's parsed JSON body."""
LeaseMeta = dict[str, object]
"""What an acquire tells the budget about the request (elastic projection, routing, targets)."""


# --------------------------------------------------------------------------------------------------
# The HTTP library's values (httpx or httpx2): what the core reads of them
# --------------------------------------------------------------------------------------------------


class HttpURL(Protocol):
    @property
    def scheme(self) -> str: ...

    @property
    def port(self) -> int | None: ...

    @property
    def path(self) -> str: ...

    @property
    def netloc(self) -> bytes: ...

    @property
    def host(self) -> str: ...

    def copy_with(self, **kwargs: object) -> HttpURL: ...


class HttpHeaders(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]: ...

    @overload
    def get(self, key: str, /) -> str | None: ...

    @overload
    def get(self, key: str, default: str, /) -> str: ...

    def items(self) -> Iterable[tuple[str, str]]: ...


class HttpRequest(Protocol):
    method: str
    extensions: dict[str, object]

    @property
    def url(self) -> HttpURL: ...

    @property
    def headers(self) -> HttpHeaders: ...

    @property
    def content(self) -> bytes: ...

    @property
    def stream(self) -> object: ...

    def read(self) -> bytes: ...

    async def aread(self) -> bytes: ...


class HttpResponse(Protocol):
    status_code: int
    extensions: dict[str, object]

    @property
    def headers(self) -> HttpHeaders: ...

    @property
    def content(self) -> bytes: ...

    @property
    def is_closed(self) -> bool: ...

    @property
    def stream(self) -> Iterable[bytes] | AsyncIterable[bytes]: ...

    def read(self) -> bytes: ...

    async def aread(self) -> bytes: ...

    def iter_bytes(self) -> Iterator[bytes]: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class AsyncClosable(Protocol):
    """An async iterator that can be closed (``aclose``)."""

    async def aclose(self) -> None: ...


@runtime_checkable
class AsyncInner(Protocol):
    """An async inner transport (``handle_async_request``)."""

    async def handle_async_request(self, request: HttpRequest) -> HttpResponse: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SyncInner(Protocol):
    """A blocking inner transport (``handle_request``)."""

    def handle_request(self, request: HttpRequest) -> HttpResponse: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------------
# Learning: the length forecaster and the prompt estimator
# --------------------------------------------------------------------------------------------------


class Forecaster(Protocol):
    """What the core asks of an elastic budget's forecaster (a :class:`~zp_client.forecast.LengthForecaster`
    has all of it; the abilities below are optional)."""

    def forecast(self, key: str, *, generated: int = 0, max_tokens: int | None = None,
                 streaming: bool = True, tail: bool = False) -> int:
        """Total output tokens expected (``tail``: a stream that outlived its forecast, re-forecast at the
        tail quantile; a forecaster without the argument answers with its usual one at run time)."""

    def observe(self, key: str, completion_tokens: int) -> None: ...


@runtime_checkable
class RequestForecaster(Protocol):
    """A forecaster that reads the request itself (the benchmark's oracle): an int is taken as known
    (capped at ``max_tokens``), None falls back to :meth:`Forecaster.forecast`. See docs/elastic.md."""

    def forecast_request(self, route: str, body: JSONObject, *, max_tokens: int,
                         streaming: bool) -> int | None: ...


@runtime_checkable
class CensorsLengths(Protocol):
    """A forecaster that reads completions ended at their ``max_tokens`` as censored (``censored``)."""

    censored: bool

    def observe(self, key: str, completion_tokens: int, *, capped: bool = False) -> None: ...


@runtime_checkable
class BlindForecaster(Protocol):
    """A forecaster with a separate quantile for requests whose growth is not seen."""

    q_blind: float | None


@runtime_checkable
class SpreadForecaster(Protocol):
    """A forecaster with an upper forecast (``spread``), for a spread-sized reserve."""

    def spread(self, key: str, *, generated: int = 0, max_tokens: int | None = None) -> int: ...


@runtime_checkable
class SharesForecasts(Protocol):
    """A budget that shares one forecaster across processes (RedisBudget)."""

    def shared_forecaster(self) -> Forecaster: ...


@runtime_checkable
class ReadsSpread(Protocol):
    """A budget whose policy reads the forecast's spread (a spread-sized reserve)."""

    @property
    def reads_forecast_spread(self) -> bool: ...


@runtime_checkable
class Named(Protocol):
    """A budget with a name (every shipped one)."""

    name: str


class Estimator(Protocol):
    """The prompt estimator (:class:`zp_client.estimate.Estimator`)."""

    def estimate(self, path: str, body: Mapping[str, object]) -> PromptEstimate: ...

    async def estimate_async(self, path: str, body: Mapping[str, object],
                             server: ServerInfo | None) -> PromptEstimate: ...

    def estimate_sync_server(self, path: str, body: Mapping[str, object],
                             server: ServerInfo | None) -> PromptEstimate: ...

    def reserve_tokens(self, est: PromptEstimate) -> int: ...

    def lower_bound_tokens(self, est: PromptEstimate) -> int: ...

    def observe(self, est: PromptEstimate, prompt_tokens: int) -> None: ...


# --------------------------------------------------------------------------------------------------
# The retry decision and metrics
# --------------------------------------------------------------------------------------------------


class RetryPolicy(Protocol):
    """The retry decision (:class:`zp_client.retry.RetryPolicy`): one state per request, a decision per
    failed (or answered) attempt, the sleeps between attempts."""

    @property
    def retry_statuses(self) -> frozenset[int]: ...

    def new_request(self) -> RetryState: ...

    async def new_request_async(self) -> RetryState: ...

    def decide(self, state: RetryState, *, status: int | None, headers: HttpHeaders | None,
               error: BaseException | None, delivered: bool, remaining_s: float | None,
               wait_for_budget: bool) -> RetryDecision: ...

    async def decide_async(self, state: RetryState, *, status: int | None, headers: HttpHeaders | None,
                           error: BaseException | None, delivered: bool, remaining_s: float | None,
                           wait_for_budget: bool) -> RetryDecision: ...

    def wait_for_budget(self, state: RetryState, *, remaining_s: float | None) -> None: ...

    async def wait_for_budget_async(self, state: RetryState, *, remaining_s: float | None) -> None: ...

    async def sleep(self, seconds: float) -> None: ...

    def sleep_sync(self, seconds: float) -> None: ...


class Metrics(Protocol):
    """What the core records (:class:`zp_client.metrics.ZPMetrics`)."""

    def track(self, budget: Budget) -> None: ...

    def waited(self, priority: int, seconds: float) -> None: ...

    def predicted(self, priority: int, predicted_s: float, actual_s: float) -> None: ...

    def held(self, priority: int, seconds: float) -> None: ...

    def retried(self, status: int | None, error: BaseException | None) -> None: ...

    def refused(self, error: BaseException) -> None: ...

    def repeated(self, error: BaseException | None, status: int | None) -> None: ...

    def forecast_missed(self, observed: int, forecast: int) -> None: ...


# --------------------------------------------------------------------------------------------------
# Leases as a fleet places them
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Placed(Protocol):
    """A lease a fleet placed on a replica."""

    replica: str | None


@runtime_checkable
class Predicted(Protocol):
    """A lease that carries the budget's predicted wait for it."""

    predicted_wait_s: float | None


class TransportOptions(TypedDict, total=False):
    """The admission options a client passes on to its transport (``AsyncClient(..., retry=...)``)."""

    estimator: Estimator | None
    retry: RetryPolicy | bool | None
    forecaster: Forecaster | None
    stream_upstream: bool | None
    clock: Clock | None
    metrics: Metrics | None
