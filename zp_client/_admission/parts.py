"""The collaborators of one admission configuration, resolved once (:class:`Parts`), and the state the
transports of one budget share across configurations (:class:`SharedState`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from zp_client._admission.httplib import HttpLib
from zp_client._admission.loop_ports import Fleet
from zp_client._admission.ports import Estimator, Forecaster, Metrics, RetryPolicy, SharesForecasts
from zp_client.budget.base import Budget
from zp_client.clock import Clock
from zp_client.config import Settings
from zp_client.errors import ZPError

__all__ = ["Parts", "SharedState", "SHARED"]


@dataclass
class Parts:
    """What every module of the admission core reads: the budget and its collaborators, resolved."""

    budget: Budget
    settings: Settings
    estimator: Estimator
    forecaster: Forecaster | None
    retry: RetryPolicy | None
    metrics: Metrics | None
    lib: HttpLib
    clock: Clock
    fleet: Fleet | None
    elastic: bool
    """The budget's policy reads elastic metadata (worth its cost only then)."""
    spread: bool
    """...and the forecast's spread (upper forecasts are sent only then)."""
    stream_upstream: bool
    shared: SharedState
    convert_error: Callable[[ZPError], BaseException] | None = None
    """wrap() sets this so zp refusals pass through the openai SDK as a catchable type."""


@dataclass
class SharedState:
    """What the transports of one budget share however many configurations there are: the default
    forecaster (wrapped clients of one budget learn together), the servers whose KV pool was checked for
    the budget (a warning once, however many transports), and the notices logged once per process."""

    _forecasters: weakref.WeakKeyDictionary[Budget, Forecaster] = field(
        default_factory=weakref.WeakKeyDictionary)
    _pool_checked: weakref.WeakKeyDictionary[Budget, set[str]] = field(
        default_factory=weakref.WeakKeyDictionary)
    _notices: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def forecaster_for(self, budget: Budget) -> Forecaster:
        """``budget``'s shared forecaster: its own when it shares one across processes (RedisBudget),
        else a :class:`~zp_client.forecast.LengthForecaster` made on first use with its defaults."""
        from zp_client.forecast import LengthForecaster

        with self._lock:
            fc = self._forecasters.get(budget)
            if fc is None:
                fc = budget.shared_forecaster() if isinstance(budget, SharesForecasts) else LengthForecaster()
                self._forecasters[budget] = fc
            return fc

    def claim_pool_check(self, budget: Budget, root: str) -> bool | None:
        """True for the first claim of ``root``'s pool check for ``budget``, False after it; None when
        ``budget`` cannot be a weak key (the caller keeps its own record)."""
        with self._lock:
            try:
                roots = self._pool_checked.setdefault(budget, set())
            except TypeError:  # a budget that cannot be a weak key (unhashable)
                return None
            if root in roots:
                return False
            roots.add(root)
            return True

    def once(self, notice: str) -> bool:
        """True the first time ``notice`` is asked about in this process (a warning logged once)."""
        with self._lock:
            if notice in self._notices:
                return False
            self._notices.add(notice)
            return True


SHARED = SharedState()
"""The process's shared state (a core may be given its own, e.g. in a test)."""
