"""A forecaster that knows each request's true output length, for the library's tests.

The simulator generates exactly ``sim_output_tokens`` tokens when the request body carries it;
:class:`BodyOracleForecaster` forecasts that through the core's ``forecast_request`` hook (what the
storm's ``zp-oracle`` setup does with its own oracle), deferring everything else to the wrapped
forecaster. Kept here so that the library's tests import nothing of the storm benchmark.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BodyOracleForecaster"]


class BodyOracleForecaster:
    """Forecasts a request from its body's ``sim_output_tokens``; everything else (requests without the
    field, learning, ``q_blind``) is the wrapped forecaster's, usually ``forecaster_for(budget)``."""

    def __init__(self, forecaster: Any) -> None:
        self.forecaster = forecaster

    def forecast_request(self, route: str, body: Mapping[str, Any], *, max_tokens: int,
                         streaming: bool) -> int | None:
        """The true length when the body carries one (a non-negative int), else None."""
        true_len = body.get("sim_output_tokens")
        if isinstance(true_len, int) and not isinstance(true_len, bool) and true_len >= 0:
            return true_len
        return None

    def __getattr__(self, name: str) -> Any:
        # forecast, observe, observations, q_blind...: the wrapped forecaster's own
        return getattr(self.forecaster, name)
