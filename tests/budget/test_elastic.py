"""The elastic policy's projected-peak rule: hand-computed cases and a property test against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zp_client.budget.elastic import (
    ElasticPolicy,
    Projection,
    _Profile,
    _terms_for,
    brute_force_peak,
    project,
    projected_peak,
)
from zp_client.budget.ledger import Ledger

BS = 16


def test_single_lease_peaks_just_before_its_end() -> None:
    # 10 blocks now, 40 more tokens to go: ceil(40/16) = 3 more blocks at its last step.
    assert brute_force_peak([Projection(10, 40)], BS) == 13
    assert _Profile([Projection(10, 40)], BS, {}).peak() == 13


def test_a_lease_ending_early_frees_room_for_a_long_one() -> None:
    # A: 50 blocks, ends in 16 steps (peak 51). B: 20 blocks, grows for 160 steps (peak 30 alone).
    # Together: at t=16 -> 51 + 21 = 72; after A ends B peaks at 30. A static sum would say 51 + 30 = 81.
    terms = [Projection(50, 16), Projection(20, 160)]
    assert brute_force_peak(terms, BS) == 72
    assert _Profile(terms, BS, {}).peak() == 72


def test_candidate_admitted_against_projected_peak_not_static_sum() -> None:
    led = Ledger(limit=75, policy=ElasticPolicy(BS))
    led.enqueue("a", bound=75, held=50, priority=0, now=0,
                meta={"prompt_tokens": 800, "forecast_tokens": 16})
    assert led.grant(0) == ["a"]
    # b: prompt 320 tokens (20 blocks), forecast 160 tokens: peak with a is 72 <= 75 though 51+30 > 75.
    led.enqueue("b", bound=75, held=20, priority=0, now=0,
                meta={"prompt_tokens": 320, "forecast_tokens": 160})
    assert led.grant(0) == ["b"]
    led.enqueue("c", bound=75, held=5, priority=0, now=0,
                meta={"prompt_tokens": 80, "forecast_tokens": 16})
    assert led.grant(0) == []  # 72 + 5 + 1 > 75


def test_shared_prefix_counted_once_only_after_first_token() -> None:
    meta = {"prompt_tokens": 640, "forecast_tokens": 32, "prefix_key": "sys", "prefix_blocks": 30}
    leases = [(40, 100, dict(meta, first_token=False)), (40, 100, dict(meta, first_token=False))]
    cold = projected_peak(leases, BS)
    assert cold == 2 * (40 + 2)
    warm_leases = [(40, 100, dict(meta, first_token=True)), (40, 100, dict(meta, first_token=False))]
    warm = projected_peak(warm_leases, BS)
    assert warm == cold - 30


def test_candidate_sharing_a_warm_prefix_needs_only_its_own_blocks() -> None:
    pol = ElasticPolicy(BS)
    led = Ledger(limit=60, policy=pol)
    base = {"prompt_tokens": 640, "forecast_tokens": 32, "prefix_key": "sys", "prefix_blocks": 30}
    led.enqueue("a", bound=60, held=40, priority=0, now=0, meta=dict(base, first_token=True))
    assert led.grant(0) == ["a"]  # peak 42
    # Without sharing, b would need 42 more blocks (84 > 60); with the warm prefix only 12 (54 <= 60).
    led.enqueue("b", bound=60, held=40, priority=0, now=0, meta=dict(base))
    assert led.grant(0) == ["b"]
    led.enqueue("c", bound=60, held=40, priority=0, now=0, meta=dict(base, prefix_key="other"))
    assert led.grant(0) == []


def test_lease_outgrowing_its_forecast_is_projected_to_its_bound() -> None:
    p = project(held=30, bound=40, block_size=BS, meta={"prompt_tokens": 320, "forecast_tokens": 64})
    assert p.remaining == 40 * BS - (29 * BS + 1)


def test_non_streamed_lease_holds_its_forecast_end() -> None:
    p = project(held=20, bound=100, block_size=BS,
                meta={"prompt_tokens": 320, "forecast_tokens": 160, "streaming": False})
    assert p == Projection(30, 160, grows=False)


_terms = st.lists(
    st.builds(Projection, st.integers(0, 60), st.integers(0, 300), st.booleans()), max_size=12
)


@settings(max_examples=300, deadline=None)
@given(_terms)
@pytest.mark.slow
def test_profile_peak_equals_brute_force(terms: list[Projection]) -> None:
    assert _Profile(terms, BS, {}).peak() == brute_force_peak(terms, BS)


@settings(max_examples=300, deadline=None)
@given(_terms, st.builds(Projection, st.integers(0, 60), st.integers(0, 300), st.booleans()))
def test_peak_with_candidate_equals_brute_force(terms: list[Projection], c: Projection) -> None:
    assert _Profile(terms, BS, {}).peak_with(c) == brute_force_peak(terms + [c], BS)


@settings(max_examples=300, deadline=None)
@given(
    _terms,
    st.integers(1, 40),
    st.integers(0, 300),
    st.integers(0, 300),
    st.integers(0, 60),
)
@pytest.mark.slow
def test_peak_with_candidate_extending_a_prefix_equals_brute_force(
    terms: list[Projection], pblocks: int, group_end: int, c_end: int, c_blocks: int
) -> None:
    # The group's prefix pseudo-term lives until group_end; a candidate of the group that outlives it
    # keeps the prefix alive until its own end.
    group_term = Projection(pblocks, group_end, grows=False)
    all_terms = terms + [group_term]
    c = Projection(c_blocks, c_end, True)
    extra = (pblocks, group_end) if c_end > group_end else None
    got = _Profile(all_terms, BS, {"k": (pblocks, group_end)}).peak_with(c, extra)
    expected_terms = terms + [Projection(pblocks, max(group_end, c_end), grows=False), c]
    assert got == brute_force_peak(expected_terms, BS)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 300), st.booleans(), st.sampled_from([None, "p", "q"]),
                          st.booleans()), max_size=10))
@pytest.mark.slow
def test_prefix_terms_never_count_a_warm_prefix_twice(rows: list[tuple[int, int, bool, str | None, bool]]) -> None:
    leases = []
    for held, forecast, streaming, key, first in rows:
        meta = {"prompt_tokens": held * BS, "forecast_tokens": forecast, "streaming": streaming,
                "prefix_key": key, "prefix_blocks": 8, "first_token": first}
        leases.append((held, held + 40, meta))
    terms, groups = _terms_for(leases, BS)
    cold = [(h, b, dict(m, first_token=False)) for h, b, m in leases]
    cold_terms, _ = _terms_for(cold, BS)
    # Sharing a warm prefix can only lower the projection, by at most the prefix per extra member...
    saved = brute_force_peak(cold_terms, BS) - brute_force_peak(terms, BS)
    assert 0 <= saved <= 8 * len(leases)
    # ...and the prepared profile agrees with brute force on the shared terms.
    assert brute_force_peak(terms, BS) == _Profile(terms, BS, groups).peak()
