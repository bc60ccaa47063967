"""The admission core, sans I/O: one configuration's planner, attempt loop and delivery.

:meth:`Core.admit` returns a :class:`~zp_client._admission.actions.Machine`, the attempt loop of one
request as a state machine; the drivers (:mod:`zp_client._admission.drivers`) perform its actions, async
or blocking. Time comes from an injectable :class:`~zp_client.clock.Clock`. See docs/admission.md.

The rooms: :mod:`~zp_client._admission.planner` (the request's plan), :mod:`~zp_client._admission.servers`
(server metadata and the pool check), :mod:`~zp_client._admission.attempts` (lease, send, retry),
:mod:`~zp_client._admission.delivery` (the response handed over, streaming, learning from usage); what
they talk to is typed in :mod:`~zp_client._admission.ports`.
"""

from __future__ import annotations

from collections.abc import Callable

from zp_client._admission.actions import Machine
from zp_client._admission.attempts import AttemptLoop
from zp_client._admission.delivery import Delivery
from zp_client._admission.httplib import HttpLib
from zp_client._admission.loop_ports import Fleet
from zp_client._admission.parts import SHARED, Parts, SharedState
from zp_client._admission.planner import Planner
from zp_client._admission.ports import (
    AsyncInner,
    Estimator,
    Forecaster,
    HttpRequest,
    Metrics,
    ReadsSpread,
    RetryPolicy,
    SyncInner,
)
from zp_client._admission.servers import Servers
from zp_client._repeat import one_loop
from zp_client.budget.base import Budget
from zp_client.clock import Clock
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, ZPError
from zp_client.estimate import PromptEstimate

__all__ = ["Core", "default_retry", "forecaster_for"]


def default_retry(budget: Budget, settings: Settings, clock: Clock | None = None) -> RetryPolicy:
    """The retry policy a front end gets when it is given none: :meth:`RetryPolicy.from_settings`
    (``Settings.retry_*``) drawing on the KV budget's own shared retry budget
    (:meth:`Budget.retry_budget`, fleet-wide for a RedisBudget), sleeping on ``clock`` (the core's)."""
    from zp_client.retry import RetryPolicy as Policy

    return Policy.from_settings(settings, budget=budget.retry_budget(settings), clock=clock)


def forecaster_for(budget: Budget) -> Forecaster:
    """The :class:`~zp_client.forecast.LengthForecaster` every transport of ``budget`` shares by
    default (made on first use with the forecaster's defaults: ``DEFAULT_Q`` for streams,
    ``DEFAULT_Q_BLIND`` for requests whose growth is not seen), so wrapped clients of one budget learn
    together. A budget with a ``shared_forecaster()`` method (RedisBudget) supplies it: the fleet
    learns together."""
    return SHARED.forecaster_for(budget)


class Core:
    """Shared by the transports of one configuration: the plan, the attempt loop, learning from usage."""

    def __init__(
        self,
        budget: Budget,
        settings: Settings | None,
        estimator: Estimator | None,
        retry: RetryPolicy | bool | None,
        forecaster: Forecaster | None = None,
        stream_upstream: bool | None = None,
        *,
        lib: HttpLib,
        clock: Clock | None = None,
        metrics: Metrics | None = None,  # a zp_client.metrics.ZPMetrics (checked)
        shared: SharedState = SHARED,
    ) -> None:
        if not isinstance(budget, Budget):
            raise ConfigurationError(
                f"budget must be a zp_client Budget (LocalBudget, RedisBudget), got {type(budget).__name__}"
            )
        settings = settings or Settings()
        if estimator is None:
            from zp_client.estimate import Estimator as DefaultEstimator

            resolved: Estimator = DefaultEstimator(settings)
        else:
            resolved = estimator
        elastic = budget.policy_name == "elastic"
        if forecaster is None and elastic:
            forecaster = shared.forecaster_for(budget)
        # the budget's clock unless told otherwise: one ``LocalBudget(clock=...)`` moves the whole client
        clock = clock if clock is not None else budget.clock
        policy: RetryPolicy | None
        if retry is None:
            policy = default_retry(budget, settings, clock)
        elif isinstance(retry, bool):
            policy = None  # False: one attempt (True is not a policy either)
        else:
            policy = retry
        checked: Metrics | None = None
        if metrics is not None:
            from zp_client.metrics import as_metrics  # imported only when asked for

            checked = as_metrics(metrics)
            checked.track(budget)
        self.parts = parts = Parts(
            budget=budget,
            settings=settings,
            estimator=resolved,
            forecaster=forecaster,
            retry=policy,
            metrics=checked,
            lib=lib,
            clock=clock,
            # A fleet (zp_client.fleet.Fleet) routes: each lease says which replica the attempt goes to.
            fleet=budget if isinstance(budget, Fleet) and budget.is_fleet else None,
            elastic=elastic,
            # Upper forecasts only for a policy that reads them (a spread-sized reserve): otherwise unsent.
            spread=elastic and isinstance(budget, ReadsSpread) and bool(budget.reads_forecast_spread),
            stream_upstream=settings.stream_upstream if stream_upstream is None else bool(stream_upstream),
            shared=shared,
        )
        self.servers = Servers(parts)
        self.planner = Planner(parts, self.servers)
        self.delivery = Delivery(parts)
        self.attempts = AttemptLoop(parts, self.planner, self.servers, self.delivery)

    # -- what the transports, front ends and the repeat guard read ----------------------------------
    @property
    def budget(self) -> Budget:
        return self.parts.budget

    @property
    def settings(self) -> Settings:
        return self.parts.settings

    @property
    def estimator(self) -> Estimator:
        return self.parts.estimator

    @property
    def forecaster(self) -> Forecaster | None:
        return self.parts.forecaster

    @property
    def retry(self) -> RetryPolicy | None:
        return self.parts.retry

    @property
    def metrics(self) -> Metrics | None:
        return self.parts.metrics

    @property
    def clock(self) -> Clock:
        return self.parts.clock

    @property
    def lib(self) -> HttpLib:
        return self.parts.lib

    @property
    def fleet(self) -> Fleet | None:
        return self.parts.fleet

    @property
    def convert_error(self) -> Callable[[ZPError], BaseException] | None:
        """wrap() sets this so zp refusals pass through the openai SDK as a catchable type."""
        return self.parts.convert_error

    @convert_error.setter
    def convert_error(self, fn: Callable[[ZPError], BaseException] | None) -> None:
        self.parts.convert_error = fn

    def shared_prefix(self, est: PromptEstimate, low: int | None = None) -> tuple[str | None, int]:
        """See :meth:`Planner.shared_prefix` (what a pinned prefix carries)."""
        return self.planner.shared_prefix(est, low)

    def surface(self, exc: BaseException) -> BaseException:
        """The error the caller sees for a zp error (wrap() makes it openai-compatible)."""
        return self.delivery.surface(exc)

    def passthrough(self, request: HttpRequest) -> HttpRequest:
        """A request the core does not admit, aimed at a fleet's own name: sent to one of its replicas."""
        fleet = self.parts.fleet
        if fleet is None:
            return request
        url = fleet.passthrough_url(request.url)
        if url == request.url:
            return request
        headers = [(b"Host", url.netloc), *((k, v) for k, v in request.headers.raw if k.lower() != b"host")]
        return self.lib.new_request(request, url, headers, request.stream)

    # -- the attempt loop ---------------------------------------------------------------------------
    def admit(self, request: HttpRequest, inner: AsyncInner | SyncInner, *, is_async: bool) -> Machine:
        """The state machine of one admitted request (already read), for a driver to run."""
        steps = self.attempts.admit(request, inner, is_async)
        if self.metrics is not None:
            steps = self.attempts.metered(steps)  # inside one_loop: a replayed refusal is a repeat
        if self.retry is not None and self.settings.repeat_window_s > 0:
            steps = one_loop(self, request, steps)  # zp's loop is the only one (zp_client._repeat)
        return Machine(steps)
