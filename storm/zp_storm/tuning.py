"""The elastic storm setups' measurement switches, as one picklable value.

A :class:`ElasticTuning` travels with the run: :class:`~zp_storm.runner.StormConfig` carries it
and every :class:`~zp_storm.setups.SetupContext` (the object each worker process gets) holds a
copy, so a worker builds its setup from the same settings as the parent. Unset fields (``None``) mean
the library's defaults: what a user gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from zp_client.errors import ConfigurationError

__all__ = ["ElasticTuning"]


@dataclass(frozen=True)
class ElasticTuning:
    """Overrides for ``zp-elastic``, ``zp-oracle`` and ``zp-redis-elastic`` (``elastic_frontier.py``).

    * ``q``, ``q_tail``, ``prior_weight``: the :class:`~zp_client.forecast.LengthForecaster`'s quantile,
      re-forecast (tail) quantile and prior weight, for the setups that learn a forecast;
    * ``headroom``: the share of the usable pool the elastic setups lease, in (0, 1] (default
      :data:`~zp_client.server.ELASTIC_HEADROOM`);
    * ``starvation_bound_s``, ``longest_first_s``: the local elastic budgets' backfill bound and
      longest-first window (default the :class:`~zp_client.budget.local.LocalBudget` defaults);
    * ``reserve_z``: ``zp-elastic-ureserve``'s spread-sized reserve factor
      (:class:`~zp_client.budget.elastic.ElasticPolicy`'s ``reserve_z``; default
      :data:`~zp_storm.elastic_setups.URESERVE_Z`);
    * ``affinity_wait_s``: ``zp-fleet``'s affinity wait (default the Fleet's);
    * ``pd_threshold_tokens``: ``zp-pd``'s uncached-prompt threshold for disaggregating.

    Invalid values raise :class:`~zp_client.ConfigurationError` naming the field.
    """

    q: float | None = None
    q_tail: float | None = None
    prior_weight: float | None = None
    headroom: float | None = None
    starvation_bound_s: float | None = None
    longest_first_s: float | None = None
    reserve_z: float | None = None
    affinity_wait_s: float | None = None
    """``zp-fleet``'s :class:`~zp_client.fleet.Fleet` ``affinity_wait_s`` (default the library's)."""
    pd_threshold_tokens: float | None = None
    """``zp-pd``'s conditional-disaggregation threshold (``Fleet.disaggregate(threshold_tokens=)``;
    ``math.inf``: never disaggregate; default the library's)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigurationError(f"ElasticTuning.{f.name} must be a number, got {value!r}")
            object.__setattr__(self, f.name, float(value))
        if self.headroom is not None and not 0.0 < self.headroom <= 1.0:
            raise ConfigurationError(f"elastic headroom must be in (0, 1], got {self.headroom!r}")
        if self.reserve_z is not None and not 0.0 <= self.reserve_z <= 100.0:
            raise ConfigurationError(f"reserve_z must be in [0, 100], got {self.reserve_z!r}")

    @property
    def forecaster_overridden(self) -> bool:
        """Whether any forecaster field is set (else the setups use the budget's shared default)."""
        return self.q is not None or self.q_tail is not None or self.prior_weight is not None

    def as_dict(self) -> dict[str, float]:
        """The fields that are set (for the report)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
