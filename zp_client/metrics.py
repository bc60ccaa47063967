"""Prometheus metrics of admission, opt-in: ``m = ZPMetrics()``, then ``wrap(client, budget, metrics=m)``.

Nothing is recorded, and no registry is touched, unless a :class:`ZPMetrics` is passed to a front end
(:func:`~zp_client.wrap`, :class:`~zp_client.AsyncClient` / :class:`~zp_client.Client`, the admission
transports). Importing this module has no side effect. prometheus-client is a core dependency of
zp-client (its parser reads the server's ``/metrics``), so no extra is needed.

The admission core (:mod:`zp_client._admission`) records, once per event whatever the driver (async or
blocking): the queue wait of every attempt, the hold time of every lease, the retries by reason, the
refusals by error type and the forecast error. The budget's limit, blocks used and waiters per class are
gauges read when the registry is scraped. Names, labels and units: docs/admission.md#metrics. Time is
the core's clock (:mod:`zp_client.clock`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from zp_client.budget.base import Budget, BudgetStatus
from zp_client.clock import real_monotonic
from zp_client.errors import ConfigurationError
from zp_client.retry import _classify_error

__all__ = ["ZPMetrics", "as_metrics", "retry_reason", "QUEUE_WAIT_BUCKETS", "LEASE_HOLD_BUCKETS",
           "FORECAST_ERROR_BUCKETS", "MAX_PRIORITY_LABELS", "OTHER_PRIORITY", "PREDICTION_ERROR_BUCKETS"]

logger = logging.getLogger("zp_client.metrics")

#: Seconds from the start of an acquire to its grant.
QUEUE_WAIT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                         10.0, 30.0, 60.0, 120.0, 300.0)
#: Seconds from a lease's grant to its release.
LEASE_HOLD_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                                         600.0)
#: Observed minus forecast output tokens per choice (negative: the forecast was too high).
FORECAST_ERROR_BUCKETS: tuple[float, ...] = (-4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 16.0, 64.0,
                                             256.0, 1024.0, 4096.0)
#: Actual minus predicted wait, seconds (negative: admitted sooner than predicted).
PREDICTION_ERROR_BUCKETS: tuple[float, ...] = (-30.0, -10.0, -5.0, -2.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5,
                                               1.0, 2.0, 5.0, 10.0, 30.0)


#: Most distinct values of the ``priority`` label, ``other`` included: a priority comes from a per-call
#: header, and every label value is a time series kept for the life of the process.
MAX_PRIORITY_LABELS = 16
#: The ``priority`` label of every priority past the first ``MAX_PRIORITY_LABELS - 1`` seen.
OTHER_PRIORITY = "other"


class _PriorityLabels:
    """The bounded ``priority`` label of a priority: its own text for the first ``limit - 1`` distinct
    priorities seen (first come, kept for the life of the process), :data:`OTHER_PRIORITY` for the rest."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        self._own = limit - 1
        self._seen: dict[int, str] = {}
        self._lock = threading.Lock()

    def __call__(self, priority: int) -> str:
        got = self._seen.get(priority)
        if got is not None:
            return got
        with self._lock:
            got = self._seen.get(priority)
            if got is None:
                if len(self._seen) >= self._own:
                    return OTHER_PRIORITY
                got = self._seen[priority] = str(priority)
            return got


def retry_reason(status: int | None, error: BaseException | None) -> str:
    """The bounded ``reason`` label of a retry: ``http_<status>`` for an HTTP answer, ``connect_error`` /
    ``read_error`` for the transport errors the retry policy retries, else the error's type name."""
    if error is None:
        return f"http_{status}" if status is not None else "unknown"
    kind = _classify_error(error)
    return f"{kind}_error" if kind is not None else type(error).__name__


def _budget_name(budget: Budget) -> str:
    name = getattr(budget, "name", None)
    return str(name) if name else f"budget-{id(budget):x}"


class _BudgetGauges(Collector):
    """Gauges read from the tracked budgets at scrape time.

    A :class:`~zp_client.LocalBudget`'s ``status_sync()`` only takes its lock, so it is read on every
    scrape. Any other budget (a :class:`~zp_client.RedisBudget`'s status is a Redis call) is read at most
    once per ``remote_status_ttl_s`` seconds of real time and its snapshot served in between; with
    ``remote_status_ttl_s=None`` only its ``limit`` (kept in the process) is exported, with no network
    call at all. A status read that fails is logged at debug level; that scrape then has only the limit.
    """

    def __init__(self, namespace: str, remote_status_ttl_s: float | None,
                 priority_label: _PriorityLabels | None = None) -> None:
        self._ns = namespace
        self._priority = priority_label or _PriorityLabels()
        self._ttl = remote_status_ttl_s
        self._lock = threading.Lock()
        self._budgets: weakref.WeakKeyDictionary[Budget, str] = weakref.WeakKeyDictionary()
        self._cache: weakref.WeakKeyDictionary[Budget, tuple[float, BudgetStatus]] = (
            weakref.WeakKeyDictionary())

    def track(self, budget: Budget) -> None:
        with self._lock:
            if budget not in self._budgets:
                self._budgets[budget] = _budget_name(budget)

    def _status(self, budget: Budget) -> BudgetStatus | None:
        read = getattr(budget, "status_sync", None)
        if read is None:
            return None
        local = budget._status_in_process  # in-process: its status only takes a lock
        if not local:
            if self._ttl is None:
                return None
            with self._lock:
                cached = self._cache.get(budget)
            if cached is not None and real_monotonic() - cached[0] < self._ttl:
                return cached[1]
        try:
            status: BudgetStatus = read()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail because a budget cannot answer
            logger.debug("metrics: status of budget %s failed (%s)", _budget_name(budget), exc)
            return None
        if not local:
            with self._lock:
                self._cache[budget] = (real_monotonic(), status)
        return status

    def describe(self) -> list[Metric]:
        # No names claimed up front: registering must not read a budget (a RedisBudget's is a network call).
        return []

    def collect(self) -> Iterator[Metric]:
        ns = self._ns
        limit = GaugeMetricFamily(f"{ns}_budget_limit_blocks", "The budget's limit in KV blocks.",
                                  labels=["budget"])
        used = GaugeMetricFamily(
            f"{ns}_budget_used_blocks",
            "KV blocks the budget's policy counts as taken (strict: live bounds; elastic: projected peak).",
            labels=["budget"])
        held = GaugeMetricFamily(f"{ns}_budget_held_blocks",
                                 "KV blocks the live leases report they occupy now.", labels=["budget"])
        leases = GaugeMetricFamily(f"{ns}_budget_leases", "Live leases.", labels=["budget"])
        waiters = GaugeMetricFamily(f"{ns}_budget_waiters", "Requests waiting in line, per priority class.",
                                    labels=["budget", "priority"])
        predicted = GaugeMetricFamily(
            f"{ns}_budget_predicted_wait_seconds",
            "Predicted wait of each priority class's head of line (LocalBudget; "
            "docs/admission.md#predicted-wait-and-fail-fast).", labels=["budget", "priority"])
        with self._lock:
            budgets = list(self._budgets.items())
        for budget, name in budgets:
            status = self._status(budget)
            if status is None:
                limit.add_metric([name], float(budget.limit))
                continue
            limit.add_metric([name], float(status.limit))
            used.add_metric([name], float(status.used))
            held.add_metric([name], float(status.held))
            leases.add_metric([name], float(status.leases))
            per_label: dict[str, float] = {}
            for prio, cls in sorted(status.waiters.items()):
                label = self._priority(prio)
                per_label[label] = per_label.get(label, 0.0) + float(cls.waiters)
            for label, count in per_label.items():
                waiters.add_metric([name, label], count)
            per_wait: dict[str, float] = {}  # classes sharing a label ("other"): the longest wait
            for prio, wait in sorted(getattr(status, "predicted_wait_s", {}).items()):
                label = self._priority(prio)
                per_wait[label] = max(per_wait.get(label, 0.0), float(wait))
            for label, wait in per_wait.items():
                predicted.add_metric([name, label], wait)
        yield from (limit, used, held, leases, waiters, predicted)


class ZPMetrics:
    """Admission metrics in a prometheus-client registry; pass it as ``metrics=`` to a front end.

    ``registry``: where the metrics live; default a new :class:`prometheus_client.CollectorRegistry` of
    their own (:attr:`registry`; serve it with ``start_http_server(port, registry=m.registry)``). Pass
    ``prometheus_client.REGISTRY`` to export them with the process's default metrics; one registry takes
    one ZPMetrics per ``namespace``. ``namespace`` prefixes every name (default ``zp``). One ZPMetrics
    may serve many front ends and budgets; the gauges carry a ``budget`` label (the budget's name).
    ``remote_status_ttl_s``: how long a scrape reuses the status of a budget that is not in-process
    (RedisBudget: one Redis call per that many seconds at most; None: export only its limit, no call).
    The bucket arguments replace the default histogram buckets. The ``priority`` label takes at most
    :data:`MAX_PRIORITY_LABELS` values: the first 15 priorities seen have their own, the rest share
    ``other`` (a priority comes from a per-call header; each label value is a series kept forever).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "zp",
        remote_status_ttl_s: float | None = 10.0,
        queue_wait_buckets: Sequence[float] = QUEUE_WAIT_BUCKETS,
        lease_hold_buckets: Sequence[float] = LEASE_HOLD_BUCKETS,
        forecast_error_buckets: Sequence[float] = FORECAST_ERROR_BUCKETS,
    ) -> None:
        if remote_status_ttl_s is not None and not remote_status_ttl_s >= 0:
            raise ConfigurationError(f"remote_status_ttl_s must be >= 0 or None, got {remote_status_ttl_s!r}")
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        self.namespace = namespace
        reg = self.registry
        self.queue_wait = Histogram(
            "queue_wait_seconds", "Seconds an attempt waited in the budget's line, from acquire to grant.",
            ["priority"], namespace=namespace, registry=reg, buckets=tuple(queue_wait_buckets))
        self.lease_hold = Histogram(
            "lease_hold_seconds", "Seconds a lease was held, from its grant to its release.",
            ["priority"], namespace=namespace, registry=reg, buckets=tuple(lease_hold_buckets))
        self.retries = Counter(
            "retries", "Retries granted by the retry policy, by reason (http_<status>, connect_error, ...).",
            ["reason"], namespace=namespace, registry=reg)
        self.refusals = Counter(
            "refusals", "Requests ended by zp-client's own error (LeaseTooLarge, AdmissionTimeout, ...).",
            ["error"], namespace=namespace, registry=reg)
        self.repeats = Counter(
            "repeats", "Calls answered with the failure of the identical call zp gave up on, replayed "
            "without a lease or an upstream attempt (a retry from above zp), by error or http_<status>.",
            ["error"], namespace=namespace, registry=reg)
        self.forecast_error = Histogram(
            "forecast_error_tokens",
            "Observed minus forecast output tokens per choice, per request of an elastic budget.",
            namespace=namespace, registry=reg, buckets=tuple(forecast_error_buckets))
        self.limit_changes = Counter(
            "limit_changes", "Run-time limit changes reported to limit_changed(), by direction.",
            ["budget", "direction"], namespace=namespace, registry=reg)
        self.prediction_error = Histogram(
            "predicted_wait_error_seconds",
            "Actual minus predicted wait in line per attempt whose wait the budget predicted "
            "(docs/admission.md#predicted-wait-and-fail-fast).",
            ["priority"], namespace=namespace, registry=reg, buckets=PREDICTION_ERROR_BUCKETS)
        self._priority = _PriorityLabels()
        self._gauges = _BudgetGauges(namespace, remote_status_ttl_s, self._priority)
        reg.register(self._gauges)

    # -- what the admission core calls ------------------------------------------------------------
    def track(self, budget: Budget) -> None:
        """Export ``budget``'s gauges (a front end built with this ZPMetrics calls it). Held weakly."""
        self._gauges.track(budget)

    def waited(self, priority: int, seconds: float) -> None:
        """An attempt was granted its lease after ``seconds`` in line."""
        self.queue_wait.labels(self._priority(priority)).observe(max(0.0, seconds))

    def predicted(self, priority: int, predicted_s: float, actual_s: float) -> None:
        """An attempt whose wait the budget predicted at ``predicted_s`` waited ``actual_s``."""
        self.prediction_error.labels(self._priority(priority)).observe(actual_s - predicted_s)

    def held(self, priority: int, seconds: float) -> None:
        """A lease was released ``seconds`` after its grant."""
        self.lease_hold.labels(self._priority(priority)).observe(max(0.0, seconds))

    def retried(self, status: int | None, error: BaseException | None) -> None:
        """The retry policy granted a retry of an attempt that got ``status`` or raised ``error``."""
        self.retries.labels(retry_reason(status, error)).inc()

    def refused(self, error: BaseException) -> None:
        """A request ended with zp-client's own ``error``."""
        self.refusals.labels(type(error).__name__).inc()

    def repeated(self, error: BaseException | None, status: int | None) -> None:
        """A call was a repeat of one zp gave up on: its ``error`` (or error answer's ``status``) replayed.
        Not counted in ``refusals`` again: those count calls zp itself ended."""
        self.repeats.labels(type(error).__name__ if error is not None else f"http_{status}").inc()

    def forecast_missed(self, observed: int, forecast: int) -> None:
        """A request produced ``observed`` output tokens per choice where ``forecast`` were forecast."""
        self.forecast_error.observe(float(observed - forecast))

    def limit_changed(self, budget: Budget | str, old: int, new: int) -> None:
        """A controller (an adaptive limit) changed ``budget``'s limit from ``old`` to ``new`` blocks; the
        new value itself shows in ``<namespace>_budget_limit_blocks`` at the next scrape."""
        if new == old:
            return
        name = budget if isinstance(budget, str) else _budget_name(budget)
        self.limit_changes.labels(name, "up" if new > old else "down").inc()

    def __repr__(self) -> str:
        return f"ZPMetrics(namespace={self.namespace!r})"


def as_metrics(value: object) -> ZPMetrics:
    """``value`` checked as a front end's ``metrics=`` option."""
    if isinstance(value, ZPMetrics):
        return value
    raise ConfigurationError(
        f"metrics must be a zp_client.metrics.ZPMetrics or None, got {type(value).__name__}")
