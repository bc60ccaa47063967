"""Hypothesis strategies the elastic conformance machines share (tests/budget/test_redis_elastic.py, the
budget's; tests/fleet/test_fleet_redis_elastic.py, the fleet's): progress reports, the forecast-error
reserves, and leases with an upper forecast. Blocks of ``BS`` tokens, as both machines use."""

from __future__ import annotations

from hypothesis import strategies as st

BS = 4

#: a progress report: the server's exact prompt count (vLLM's continuous usage), tokens so far, a re-forecast
PROGRESS = st.fixed_dictionaries(
    {},
    optional={
        # the server's exact prompt count (vLLM's continuous usage), replacing the estimate
        "prompt_tokens": st.integers(0, 14 * BS),
        "tokens": st.integers(0, 16 * BS),
        "first_token": st.just(True),
        "forecast_tokens": st.integers(0, 16 * BS),
        "forecast_hi": st.integers(0, 20 * BS),
    },
)
#: elastic's forecast-error reserves and its urgent reserve, drawn per run (0 included: off): reserve_z,
#: reserve_k, urgent_reserve
RESERVES = st.tuples(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.732, 3.0]),
                     st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.0]),
                     st.sampled_from([0.0, 0.5, 1.0, 1.333, 2.0, 3.0]))
#: a streamed lease with a forecast and an upper forecast (a spread for the reserves to read), half the time
SPREAD_META = st.fixed_dictionaries(
    {
        "prompt_tokens": st.integers(0, 3 * BS),
        "forecast_tokens": st.integers(0, 3 * BS),
        "forecast_hi": st.integers(2 * BS, 20 * BS),
    },
    optional={
        "streaming": st.sampled_from([True, True, True, False]),
        "prefix_key": st.sampled_from(["A", "B"]),
        "prefix_blocks": st.integers(0, 4),
        "first_token": st.booleans(),
    },
)
