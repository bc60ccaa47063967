"""Run in a spawned process by tests/test_storm_elastic.py: what the elastic setups build from the
:class:`~zp_storm.setups.SetupContext` a worker process receives."""

from __future__ import annotations

from typing import Any

from zp_storm import elastic_setups
from zp_storm.setups import SetupContext


def probe(ctx: SetupContext, out: Any) -> None:
    budget = elastic_setups._local_elastic(ctx)
    fc = elastic_setups._forecaster(ctx.elastic)
    out.put({
        "limit": budget.limit,
        "starvation_bound_s": budget._ledger.starvation_bound_s,
        "longest_first_s": budget._ledger.longest_first_s,
        "q": None if fc is None else fc.q,
    })
