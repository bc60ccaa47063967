"""The benchmark's oracle: a forecaster that knows each request's true output length.

The simulator (:mod:`zp_sim`) reads ``sim_output_tokens`` from the request body and generates
exactly that many tokens; :class:`SimOracleForecaster` forecasts it through the core's
``forecast_request`` hook, the limit a forecaster can reach (setup ``zp-oracle``). See docs/elastic.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["SimOracleForecaster"]


class SimOracleForecaster:
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
