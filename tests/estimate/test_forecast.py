"""The output-length forecaster: conditional quantiles on known distributions, cold start, per-key."""

from __future__ import annotations

import math
import random

import pytest

from zp_client.errors import ConfigurationError
from zp_client.forecast import BUCKET_RATIO, LengthForecaster, Prior


def _close(x: float, expected: float, rel: float = BUCKET_RATIO - 1) -> bool:
    return abs(x - expected) <= rel * expected + 1


def test_cold_start_answers_from_the_prior() -> None:
    fc = LengthForecaster(prior=Prior(median=300, sigma=1.0, weight=20))
    assert _close(fc.quantile("m", 0.5), 300)
    # p90 of lognormal(ln 300, 1.0) = 300 * e^(1.2816)
    assert _close(fc.quantile("m", 0.9), 300 * math.exp(1.2816))


def test_learns_a_known_distribution_and_forgets_the_prior() -> None:
    rng = random.Random(1)
    fc = LengthForecaster(prior=Prior(median=2000, sigma=0.5, weight=20), half_life=None)
    samples = [int(rng.lognormvariate(math.log(220), 1.2)) for _ in range(20_000)]
    fc.observe_many("agent", samples)
    srt = sorted(samples)
    for q in (0.5, 0.9, 0.99):
        assert _close(fc.quantile("agent", q), srt[int(q * len(srt))], rel=0.2), q


def test_conditional_quantile_given_tokens_so_far() -> None:
    # Exponential lengths are memoryless: L - g | L > g has the same law, so the conditional median of L
    # given g is g + median.
    rng = random.Random(2)
    fc = LengthForecaster(prior=Prior(weight=1e-9), half_life=None)
    samples = [int(rng.expovariate(1 / 400)) for _ in range(50_000)]
    fc.observe_many("exp", samples)
    median = 400 * math.log(2)
    for g in (0, 200, 800):
        expected = g + median
        assert _close(fc.quantile("exp", 0.5, generated=g), expected, rel=0.12), g
    # Conditional quantiles move out as the stream grows and always exceed what was generated.
    assert fc.quantile("exp", 0.9, generated=3000) > 3000


def test_forecast_is_capped_by_max_tokens_and_outlives_generated() -> None:
    fc = LengthForecaster(q=0.9)
    fc.observe_many("k", [100] * 200)
    assert fc.forecast("k", max_tokens=50) == 50
    assert fc.forecast("k", generated=5000) > 5000


def test_keys_are_separate() -> None:
    fc = LengthForecaster(prior=Prior(weight=1e-6), half_life=None)
    fc.observe_many("short", [20] * 500)
    fc.observe_many("long", [2000] * 500)
    assert fc.forecast("short") < 30
    assert fc.forecast("long") > 1500
    assert fc.observations("short") == 500 and fc.observations("none") == 0


def test_decay_follows_a_drifting_workload() -> None:
    fc = LengthForecaster(prior=Prior(weight=1e-6), half_life=200)
    fc.observe_many("k", [100] * 2000)
    fc.observe_many("k", [1000] * 2000)
    assert _close(fc.quantile("k", 0.5), 1000)


def test_snapshot_round_trips_through_merge() -> None:
    a, b = LengthForecaster(), LengthForecaster()
    a.observe_many("k", [50, 60, 70] * 100)
    b.merge_counts("k", a.snapshot("k"))
    assert b.forecast("k") == a.forecast("k")


def test_bad_input_is_a_typed_error() -> None:
    with pytest.raises(ConfigurationError):
        LengthForecaster(q=1.5)
    with pytest.raises(ConfigurationError):
        LengthForecaster().observe("k", -1)
    with pytest.raises(ConfigurationError):
        LengthForecaster().merge_counts("k", [1.0, 2.0])


def test_default_forecast_is_the_median_for_streams_and_the_blind_quantile_otherwise() -> None:
    from zp_client.forecast import DEFAULT_Q, DEFAULT_Q_BLIND

    fc = LengthForecaster(prior=Prior(median=300, sigma=1.0, weight=1e6))
    assert fc.q == DEFAULT_Q and fc.q_blind == DEFAULT_Q_BLIND and DEFAULT_Q < DEFAULT_Q_BLIND
    seen = fc.forecast("m")
    blind = fc.forecast("m", streaming=False)
    assert _close(seen, fc.quantile("m", DEFAULT_Q), 0.05) and _close(blind, fc.quantile("m", DEFAULT_Q_BLIND), 0.05)
    assert blind > seen
    # an explicit q above the blind default is kept for both; q_blind can be set on its own
    assert LengthForecaster(q=0.95).q_blind == 0.95
    assert LengthForecaster(q=0.5, q_blind=0.99).forecast("m", streaming=False) > blind
    with pytest.raises(ConfigurationError):
        LengthForecaster(q_blind=1.0)


def test_a_stream_that_outlived_its_forecast_is_re_forecast_at_the_tail_quantile() -> None:
    from zp_client.forecast import DEFAULT_Q_TAIL

    fc = LengthForecaster(prior=Prior(median=300, sigma=1.0, weight=1e6), q_tail=0.9)
    g = 400
    tail = fc.forecast("m", generated=g, tail=True)
    assert _close(tail, fc.quantile("m", 0.9, generated=g), 0.05)
    assert tail > fc.forecast("m", generated=g) > g  # above the usual quantile's answer given the same tokens
    assert fc.forecast("m", generated=g, tail=True, max_tokens=500) == 500
    # not streamed: the blind quantile wins (nothing re-forecasts a request whose growth is not seen)
    assert fc.forecast("m", generated=0, streaming=False, tail=True) == fc.forecast("m", streaming=False)
    # defaults: the larger of q and DEFAULT_Q_TAIL
    assert LengthForecaster().q_tail == max(LengthForecaster().q, DEFAULT_Q_TAIL)
    assert LengthForecaster(q=0.95).q_tail == 0.95
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigurationError):
            LengthForecaster(q_tail=bad)


def test_censored_completions_move_the_forecast_to_the_bound() -> None:
    """With ``censored``, completions that ended at their ``max_tokens`` are read as censored: once their
    share of the route's weight (prior included) reaches ``1 - q`` a request is forecast at its bound."""
    prior = Prior(median=256, sigma=1.2, weight=20)
    plain = LengthForecaster(prior=prior, half_life=None, censored=False, cold_n=0)
    cens = LengthForecaster(prior=prior, half_life=None, censored=True, cold_n=0)
    assert LengthForecaster().censored  # the default since issue 30 (docs/elastic.md#the-default-reserve)
    for fc in (plain, cens):
        for _ in range(30):
            fc.observe("r", 300, capped=True)  # ran to its max_tokens of 300
    assert cens.capped_share("r") == pytest.approx(30 / 50)
    assert plain.capped_share("r") == 0.0  # not read without censored
    assert cens.forecast("r", max_tokens=1024) == 1024
    assert cens.spread("r", max_tokens=1024) == 1024
    assert plain.forecast("r", max_tokens=1024) < 600
    # without a bound nothing is censored against: the histogram answers
    assert cens.forecast("r") == plain.forecast("r")


def test_a_small_capped_share_raises_the_quantile_read() -> None:
    prior = Prior(median=256, sigma=1.2, weight=20)
    cens = LengthForecaster(prior=prior, half_life=None, censored=True, cold_n=0)
    plain = LengthForecaster(prior=prior, half_life=None, censored=False, cold_n=0)
    for fc in (plain, cens):
        fc.observe_many("r", [200] * 70)
        fc.observe("r", 4096, capped=True)
    c = cens.capped_share("r")
    assert 0 < c < 0.3
    expected = math.ceil(plain.quantile("r", 0.7 / (1 - c)))
    assert cens.forecast("r", max_tokens=8192) == min(expected, 8192)
    assert cens.forecast("r", max_tokens=8192) >= plain.forecast("r", max_tokens=8192)


def test_capped_share_is_the_own_observations_not_a_fleet_snapshot() -> None:
    # merge_counts replaces the histogram by a fleet's: the share stays this process's own, and the
    # snapshot's observations count toward cold_n
    fc = LengthForecaster(prior=Prior(weight=20), half_life=None, censored=True, cold_n=10)
    for _ in range(5):
        fc.observe("r", 64, capped=True)
    assert fc.capped_share("r") == pytest.approx(5 / 25)
    snap = [c * 10 for c in fc.snapshot("r")]
    assert fc.forecast("r", max_tokens=5000) == 5000  # 5 observations: cold
    fc.merge_counts("r", snap)
    assert fc.capped_share("r") == pytest.approx(5 / 25)
    assert fc.observations("r") == 5  # its own
    assert fc.forecast("r", max_tokens=5000) < 5000  # the snapshot's weight counts toward cold_n


def test_cold_n_forecasts_the_bound_until_learned() -> None:
    assert LengthForecaster().cold_n == 10  # the default since issue 30
    fc = LengthForecaster(cold_n=3, censored=False)
    assert fc.forecast("r", max_tokens=900) == 900
    assert fc.forecast("r", max_tokens=900, streaming=False) == 900
    fc.observe_many("r", [100, 100])
    assert fc.forecast("r", max_tokens=900) == 900
    fc.observe("r", 100)
    assert fc.forecast("r", max_tokens=900) < 900
    assert fc.forecast("other", max_tokens=50) == 50  # per key
    with pytest.raises(ConfigurationError):
        LengthForecaster(cold_n=-1)
