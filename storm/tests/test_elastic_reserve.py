"""The elastic policy's spread-sized reserve (``ElasticPolicy(reserve_z=...)``): the per-lease spread,
the quadrature sum, and admission against a brute force (projected peak stepped through every instant)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zp_client.budget.elastic import (
    ElasticPolicy,
    _terms_for,
    brute_force_peak,
    excess_blocks,
    risk_reserve,
    spread_blocks,
    spread_reserve,
)
from zp_client.budget.ledger import Ledger, WaiterRecord
from zp_client.errors import ConfigurationError

BS = 16


def test_spread_is_the_blocks_between_the_forecast_end_and_the_upper_forecast() -> None:
    meta = {"prompt_tokens": 100, "forecast_tokens": 60, "forecast_hi": 300, "streaming": True}
    # forecast end 160 tokens = 10 blocks; upper end 400 tokens = 25 blocks.
    assert spread_blocks(held=7, bound=100, block_size=BS, meta=meta) == 15
    # Both ends are capped at the lease's cap (its bound here: 20 blocks = 320 tokens).
    assert spread_blocks(held=7, bound=20, block_size=BS, meta=meta) == 10
    # An upper forecast below the forecast counts as none.
    assert spread_blocks(held=7, bound=100, block_size=BS, meta={**meta, "forecast_hi": 10}) == 0


def test_leases_that_carry_no_spread_count_zero() -> None:
    base = {"prompt_tokens": 100, "forecast_tokens": 60, "forecast_hi": 300}
    assert spread_blocks(held=7, bound=100, block_size=BS, meta={}) == 0  # at its bound for life
    assert spread_blocks(held=7, bound=100, block_size=BS, meta={**base, "streaming": False}) == 0
    assert spread_blocks(held=7, bound=100, block_size=BS,
                         meta={"prompt_tokens": 100, "forecast_tokens": 60}) == 0  # no forecast_hi
    # Outgrew its forecast: the projection already runs it to its cap.
    assert spread_blocks(held=11, bound=100, block_size=BS, meta={**base, "tokens": 170}) == 0
    # A candidate is read at its prompt: a stale ``tokens`` is ignored.
    stale = {**base, "tokens": 170}
    assert spread_blocks(held=11, bound=100, block_size=BS, meta=stale, candidate=True) == 15


def _brute_reserve(sum_sq: int, z: float) -> int:
    """The smallest integer r >= z * sqrt(sum_sq), by search (z taken in thousandths, as the policy does)."""
    zf = Fraction(round(z * 1000), 1000)
    r = 0
    while Fraction(r * r) < zf * zf * sum_sq:
        r += 1
    return r


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.floats(0, 4, allow_nan=False))
def test_reserve_is_ceil_z_sqrt_sum_of_squares(sum_sq: int, z: float) -> None:
    assert spread_reserve(sum_sq, z) == _brute_reserve(sum_sq, z)


def test_reserve_adds_spreads_in_quadrature() -> None:
    # Independent errors: four leases of spread 3 need 2 x 3 = 6 blocks at z=1, not 12.
    assert spread_reserve(4 * 9, 1.0) == 6
    assert spread_reserve(4 * 9, 1.5) == 9
    assert spread_reserve(4 * 9, 0.0) == 0


def test_reserve_z_is_validated() -> None:
    for bad in (-1, math.inf, math.nan, True, "1"):
        with pytest.raises(ConfigurationError):
            ElasticPolicy(BS, reserve_z=bad, reserve_k=0.0)  # type: ignore[arg-type]
    assert "reserve_z=0.5" in repr(ElasticPolicy(BS, reserve_z=0.5, reserve_k=0.0))
    assert repr(ElasticPolicy(BS, reserve_z=0, reserve_k=0, urgent_reserve=0)) == "ElasticPolicy(block_size=16)"
    # the defaults since issue 30
    assert repr(ElasticPolicy(BS)) == "ElasticPolicy(block_size=16, reserve_z=0.5, reserve_k=0.25, urgent_reserve=2.0)"


def test_the_reserve_keeps_blocks_free_that_the_flat_rule_would_lease() -> None:
    # a: 20 blocks, forecast 160 tokens more (peak 30), upper forecast 480 more (spread 20 blocks).
    a = {"prompt_tokens": 320, "forecast_tokens": 160, "forecast_hi": 480}
    b = {"prompt_tokens": 320, "forecast_tokens": 160, "forecast_hi": 160}  # no spread
    for z, admitted in ((0.0, ["a", "b"]), (1.0, ["a"])):
        led = Ledger(limit=70, policy=ElasticPolicy(BS, reserve_z=z, reserve_k=0.0))
        led.enqueue("a", bound=60, held=20, priority=0, now=0, meta=a)
        led.enqueue("b", bound=60, held=20, priority=0, now=0, meta=b)
        # bounds 120 > 70: no fast path. Peak together 60; the reserve (z=1) 20 more: 80 > 70.
        assert led.grant(0) == admitted
    led = Ledger(limit=80, policy=ElasticPolicy(BS, reserve_z=1.0, reserve_k=0.0))
    led.enqueue("a", bound=60, held=20, priority=0, now=0, meta=a)
    led.enqueue("b", bound=60, held=20, priority=0, now=0, meta=b)
    assert led.grant(0) == ["a", "b"]


def test_bounds_that_fit_need_no_reserve() -> None:
    # The fast path: bounds are what no forecast error can exceed, so they fit without the reserve.
    led = Ledger(limit=130, policy=ElasticPolicy(BS, reserve_z=5.0, reserve_k=0.0))
    for i in "ab":
        led.enqueue(i, bound=60, held=20, priority=0, now=0,
                    meta={"prompt_tokens": 320, "forecast_tokens": 16, "forecast_hi": 640})
    assert led.grant(0) == ["a", "b"]


def test_exhausted_leaves_room_for_what_the_bound_test_admits() -> None:
    # One lease: 5 blocks held, forecast 16 tokens more (peak 6), upper forecast at its bound (15 blocks):
    # spread 9, reserve ceil(2.5 x 9) = 23, so the projection plus the reserve (29) exceeds a limit of 18;
    # yet a 1-block waiter's bounds fit (15 + 1 live + 1 + 1 = 18): exhausted must not stop the grant.
    policy = ElasticPolicy(BS, reserve_z=2.5, reserve_k=0.0)
    led = Ledger(limit=100, policy=policy)
    led.enqueue("a", bound=15, held=5, priority=0, now=0,
                meta={"prompt_tokens": 65, "forecast_tokens": 16, "forecast_hi": 600, "streaming": True})
    assert led.grant(0) == ["a"]
    assert policy.reserve(led) == 23 and policy._prepare(led).peak() == 6
    led.set_limit(18, 0.0)
    assert not policy.exhausted(led)
    led.enqueue("b", bound=1, held=1, priority=0, now=0)
    assert led.grant(0) == ["b"]
    led.set_limit(19, 0.0)  # 2 live leases now: a third 1-block waiter needs 16 + 2 + 2 = 20
    assert policy.exhausted(led)


def test_the_policy_adds_the_leases_spreads_in_quadrature() -> None:
    # Four leases of spread 3 blocks each (forecast end 2 blocks, upper 5): z=1 keeps ceil(sqrt(36)) = 6
    # blocks free, where a linear sum would keep 12.
    policy = ElasticPolicy(BS, reserve_z=1.0, reserve_k=0.0)
    led = Ledger(limit=1000, policy=policy)
    meta = {"prompt_tokens": 16, "forecast_tokens": 16, "forecast_hi": 64, "streaming": True}
    for i in range(4):
        led.enqueue(f"l{i}", bound=20, held=1, priority=0, now=0, meta=meta)
    assert led.grant(0) == ["l0", "l1", "l2", "l3"]
    assert policy.reserve(led) == 6 and policy._prepare(led).peak() == 8
    # A no-metadata waiter of 10 blocks: 8 + 10 + 6 = 24; the bounds (80 + 4 + 10 + 1) do not fit 24.
    led.set_limit(24, 0.0)
    led.enqueue("w", bound=10, held=10, priority=0, now=0)
    assert led.grant(0) == ["w"]
    led.release("w", 0.0)
    led.set_limit(23, 0.0)
    led.enqueue("w2", bound=10, held=10, priority=0, now=0)
    assert led.grant(0) == []


_lease = st.tuples(
    st.integers(1, 30),        # held
    st.integers(0, 40),        # extra bound over held
    st.integers(0, 400),       # forecast tokens
    st.integers(0, 600),       # forecast_hi tokens
    st.sampled_from([True, True, False]),  # streaming
    st.integers(0, 20),        # tokens beyond the prompt (progress)
    st.booleans(),             # carries metadata at all
)


def _meta(held: int, forecast: int, hi: int, streaming: bool, progress: int,
          has_meta: bool) -> dict[str, Any]:
    if not has_meta:
        return {}
    prompt = (held - 1) * BS + 1
    return {"prompt_tokens": prompt, "forecast_tokens": forecast, "forecast_hi": hi, "streaming": streaming,
            "tokens": min(held * BS, prompt + progress)}


def _brute_fits(rows: list[tuple[int, int, dict[str, Any]]], held: int, bound: int, cmeta: dict[str, Any],
                limit: int, z: float) -> tuple[bool, int, int]:
    """(fits, the reserve-free threshold of the bound test, peak + reserve): the candidate joins as a lease
    holding its prompt, the peak stepped through every instant."""
    joined = [*rows, (held, bound, cmeta)]
    terms, _ = _terms_for(joined, BS)
    peak = brute_force_peak(terms, BS)
    sq = sum(spread_blocks(held=h, bound=b, block_size=BS, meta=m) ** 2 for h, b, m in joined)
    need = peak + spread_reserve(sq, z)
    # the candidate's rounding block, but not on an empty pool (a lone lease holds at most its cap)
    fast_need = (sum(b for _, b, _ in rows) + bound + len(rows) + (1 if rows else 0)
                 + sum(excess_blocks(b, BS, m) for _, b, m in joined))
    fast = fast_need <= limit and int(cmeta.get("prompt_tokens", 0)) <= bound * BS
    return fast or need <= limit, fast_need, need


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@settings(max_examples=400, deadline=None)
@given(st.lists(_lease, max_size=8), _lease, st.sampled_from(["reserve", "bounds", "small", "free"]),
       st.integers(-3, 3), st.sampled_from([0.0, 0.5, 1.0, 2.5]))
def test_fits_and_exhausted_agree_with_a_brute_force(
    leases: list[tuple[int, int, int, int, bool, int, bool]],
    cand: tuple[int, int, int, int, bool, int, bool],
    anchor: str,
    offset: int,
    z: float,
) -> None:
    policy = ElasticPolicy(BS, reserve_z=z, reserve_k=0.0)
    led = Ledger(limit=100_000, policy=policy)
    rows = []
    for i, (held, extra, fc, hi, streaming, progress, has_meta) in enumerate(leases):
        meta = _meta(held, fc, hi, streaming, progress, has_meta)
        led.enqueue(f"l{i}", bound=held + extra, held=held, priority=0, now=0, meta=meta)
        assert led.grant(0) == [f"l{i}"]
        rows.append((held, held + extra, dict(led.leases[f"l{i}"].meta)))
    held, extra, fc, hi, streaming, _, has_meta = cand
    cmeta = _meta(held, fc, hi, streaming, 0, has_meta)
    cmeta.pop("tokens", None)
    cmeta = dict(policy.admission_meta(held + extra, cmeta))
    # The limit at an edge that decides: the peak plus the reserve, or the bound test's threshold for
    # this candidate or for the smallest one (what exhausted must leave room for).
    _, fast_need, need = _brute_fits(rows, held, held + extra, cmeta, 0, z)
    small_need = sum(b for _, b, _ in rows) + len(rows) + 2 + sum(excess_blocks(b, BS, m) for _, b, m in rows)
    edges = {"reserve": need, "bounds": fast_need, "small": small_need, "free": need + 40}
    limit = max(0, edges[anchor] + offset)
    led.set_limit(limit, 0.0)
    w = WaiterRecord(id="c", bound=held + extra, held=held, priority=0, ticket=None,  # type: ignore[arg-type]
                     since=0.0, seq=0, meta=cmeta)
    expected, _, _ = _brute_fits(rows, held, held + extra, cmeta, limit, z)
    assert policy.fits(led, w) == expected
    if policy.exhausted(led):
        # a shortcut for "nobody fits": not even the smallest waiters, with or without metadata
        assert not expected
        for small in ({}, {"prompt_tokens": 1, "forecast_tokens": 0, "streaming": True}):
            sm = dict(policy.admission_meta(1, small))
            assert not _brute_fits(rows, 1, 1, sm, limit, z)[0]


def test_the_ureserve_storm_setup_is_optional_and_builds_the_reserve_on_the_whole_pool(monkeypatch: Any) -> None:
    import asyncio
    import contextlib

    from zp_storm import elastic_setups
    from zp_storm.setups import DEFAULT_SETUPS, SETUPS, SetupContext, parse_setups
    from zp_storm.tuning import ElasticTuning

    assert not SETUPS["zp-elastic-ureserve"].default
    assert "zp-elastic-ureserve" not in DEFAULT_SETUPS and "zp-elastic-ureserve" not in parse_setups(None, None)
    assert parse_setups("zp-elastic-ureserve", None) == ["no-admission", "zp-elastic-ureserve"]
    built: list[Any] = []

    async def capture(ctx: Any, stack: Any, budget: Any, **kw: Any) -> Any:
        built.append(budget)
        return object()

    monkeypatch.setattr(elastic_setups, "zp_client_for", capture)

    async def build(tuning: ElasticTuning) -> Any:
        ctx = SetupContext("http://127.0.0.1:1/v1", "http://127.0.0.1:1", "m", 4.0, 1001, 16, 950, elastic=tuning)
        async with contextlib.AsyncExitStack() as stack:
            await elastic_setups._zp_elastic_ureserve(ctx, stack)
        return built[-1]

    default = asyncio.run(build(ElasticTuning()))
    assert default.limit == 1000  # floor((1001 - 1) x 1.0): the whole usable pool
    assert default._ledger.policy.reserve_z == elastic_setups.URESERVE_Z
    tuned = asyncio.run(build(ElasticTuning(reserve_z=0.8, headroom=0.9)))
    assert tuned.limit == 900 and tuned._ledger.policy.reserve_z == 0.8


def test_the_forecasters_spread_is_its_upper_conditional_quantile() -> None:
    from zp_client.forecast import DEFAULT_Q_SPREAD, LengthForecaster

    fc = LengthForecaster(q=0.5)  # the median beside the spread (the default q is 0.7)
    fc.observe_many("r", list(range(1, 1001)))
    assert fc.q_spread == DEFAULT_Q_SPREAD == 0.9
    median, hi = fc.forecast("r"), fc.spread("r")
    assert 400 <= median <= 600 and 800 <= hi <= 1000 and hi == math.ceil(fc.quantile("r", 0.9))
    # conditional, like forecast: given 950 tokens so far, and capped at max_tokens
    assert fc.spread("r", generated=950) > 950 and fc.spread("r", max_tokens=300) == 300
    lower = LengthForecaster(q_spread=0.75)
    lower.observe_many("r", list(range(1, 1001)))
    assert median < lower.spread("r") < hi
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigurationError, match="q_spread"):
            LengthForecaster(q_spread=bad)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5000), st.floats(0, 4, allow_nan=False))
def test_risk_reserve_is_ceil_k_sum(spread_sum: int, k: float) -> None:
    km = round(k * 1000)
    assert risk_reserve(spread_sum, k) == (-(-(km * spread_sum) // 1000) if km and spread_sum else 0)
    assert risk_reserve(spread_sum, k) >= km * spread_sum / 1000


def test_the_risk_reserve_adds_spreads_linearly() -> None:
    # The same four leases of spread 3 as above: reserve_k=1 keeps 12 blocks free (errors that move
    # together add), where reserve_z=1 keeps 6; both together keep 18.
    for kw, reserve in (({"reserve_k": 1.0, "reserve_z": 0.0}, 12), ({"reserve_k": 0.5, "reserve_z": 0.0}, 6),
                        ({"reserve_k": 1.0, "reserve_z": 1.0}, 18)):
        policy = ElasticPolicy(BS, **kw)
        led = Ledger(limit=1000, policy=policy)
        meta = {"prompt_tokens": 16, "forecast_tokens": 16, "forecast_hi": 64, "streaming": True}
        for i in range(4):
            led.enqueue(f"l{i}", bound=20, held=1, priority=0, now=0, meta=meta)
        assert led.grant(0) == ["l0", "l1", "l2", "l3"]
        assert policy.reserve(led) == reserve
        # a 10-block waiter without metadata fits exactly at peak 8 + 10 + the reserve, not one below
        led.set_limit(8 + 10 + reserve, 0.0)
        led.enqueue("x", bound=10, held=10, priority=0, now=0)
        led.set_limit(8 + 10 + reserve - 1, 0.0)
        assert led.grant(0) == []
        led.set_limit(8 + 10 + reserve, 0.0)
        assert led.grant(0) == ["x"]
    for bad in (-1, math.inf, math.nan, True):
        with pytest.raises(ConfigurationError):
            ElasticPolicy(BS, reserve_k=bad)  # type: ignore[arg-type]
    assert "reserve_k=0.5" in repr(ElasticPolicy(BS, reserve_k=0.5))
