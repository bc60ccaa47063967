"""The elastic policy through the ledger's version/meta API and through LocalBudget (async and threads)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest

from zp_client.budget.elastic import POLICIES, ElasticPolicy, make_policy
from zp_client.budget.ledger import Ledger, StrictPolicy
from zp_client.budget.local import LocalBudget
from zp_client.errors import AdmissionTimeout, ConfigurationError, LeaseTooLarge

BS = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---------------------------------------------------------------------------------------------- ledger
def test_make_policy_elastic_takes_the_block_size() -> None:
    pol = make_policy("elastic", block_size=32)
    assert isinstance(pol, ElasticPolicy) and pol.block_size == 32
    assert isinstance(make_policy("strict", block_size=32), StrictPolicy)
    assert Ledger(10, policy=ElasticPolicy(8)).policy.block_size == 8  # type: ignore[attr-defined]
    assert Ledger(10, policy=ElasticPolicy()).progress_sensitive
    assert not Ledger(10).progress_sensitive
    with pytest.raises(ConfigurationError):
        make_policy("elastic", block_size=0)
    assert sorted(POLICIES) == ["elastic", "strict"]
    assert make_policy(pol) is pol  # an object passes through


def test_the_ledger_takes_a_policy_object_and_knows_no_policy_by_name() -> None:
    with pytest.raises(ConfigurationError, match="make_policy"):
        Ledger(10, policy="elastic")  # type: ignore[arg-type]  # a name is the budgets' job
    with pytest.raises(ConfigurationError, match="ReservationPolicy"):
        Ledger(10, policy=object())  # type: ignore[arg-type]  # not a policy
    assert isinstance(Ledger(10).policy, StrictPolicy)
    # the budgets resolve the name and pass the object in
    assert LocalBudget(10, 8, policy="elastic")._ledger.policy.block_size == 8  # type: ignore[attr-defined]
    assert isinstance(LocalBudget(10, 8, policy="strict")._ledger.policy, StrictPolicy)


def test_version_bumps_on_every_mutation() -> None:
    led = Ledger(100, policy=ElasticPolicy())
    seen = [led.version]

    def bumped() -> None:
        assert led.version > seen[-1]
        seen.append(led.version)

    led.enqueue("a", 10, 2, 0, 0.0, meta={"prompt_tokens": 32})
    bumped()
    led.grant(0.0)
    bumped()
    led.report_held("a", 3)
    bumped()
    led.update_meta("a", first_token=True)
    bumped()
    led.renew("a", 0.0, 5.0)
    bumped()
    led.set_limit(90, 0.0)
    bumped()
    led.enqueue("b", 95 - 10, None, 0, 0.0)
    bumped()
    led.cancel("b")
    bumped()
    led.release("a", 0.0)
    bumped()
    led.enqueue("c", 5, None, 0, 0.0, expires_at=1.0)
    bumped()
    led.expire(2.0)
    bumped()
    # No-ops leave it alone: an unchanged held, unknown ids, a grant with nobody waiting.
    v = led.version
    led.release("a", 3.0)
    led.cancel("zzz")
    led.grant(3.0)
    assert not led.update_meta("zzz", x=1)
    assert led.version == v


def test_update_meta_merges_into_the_lease() -> None:
    led = Ledger(100, policy=ElasticPolicy())
    led.enqueue("a", 10, 2, 0, 0.0, meta={"prompt_tokens": 32, "forecast_tokens": 10})
    assert led.grant(0.0) == ["a"]
    assert led.update_meta("a", first_token=True, forecast_tokens=40)
    # max_output_tokens: derived at enqueue from the bound (10 blocks of 16 tokens) and the prompt
    assert dict(led.leases["a"].meta) == {"prompt_tokens": 32, "forecast_tokens": 40, "first_token": True,
                                          "max_output_tokens": 128}


def test_cached_projection_follows_meta_updates() -> None:
    # The policy caches its profile on (ledger, version): a re-forecast must tighten admission at once.
    led = Ledger(40, policy=ElasticPolicy())
    led.enqueue("a", 40, 20, 0, 0.0, meta={"prompt_tokens": 320, "forecast_tokens": 16})
    assert led.grant(0.0) == ["a"]
    assert led.used == 21
    led.update_meta("a", forecast_tokens=320)  # peak 40 now
    assert led.used == 40
    # b is small now but outlives a's growth: at a's end (t=320) 40 + 21 > 40.
    led.enqueue("b", 40, 1, 0, 0.0, meta={"prompt_tokens": 16, "forecast_tokens": 400})
    assert led.grant(0.0) == []
    led.update_meta("a", forecast_tokens=16)
    assert led.grant(0.0) == ["b"]


def test_elastic_keeps_the_lease_too_large_rule() -> None:
    led = Ledger(50, policy=ElasticPolicy())
    with pytest.raises(LeaseTooLarge):
        led.enqueue("a", 51, 1, 0, 0.0, meta={"prompt_tokens": 16, "forecast_tokens": 1})


def test_exhausted_agrees_with_fits() -> None:
    pol = ElasticPolicy(BS)
    led = Ledger(30, policy=pol)
    led.enqueue("a", 30, 20, 0, 0.0, meta={"prompt_tokens": 320, "forecast_tokens": 400})
    assert led.grant(0.0) == ["a"]
    assert not pol.exhausted(led)
    led.report_held("a", 30)  # grew to its bound
    led.set_limit(29, 0.0)  # lowered under it: nothing can fit now
    assert pol.exhausted(led)
    led.enqueue("b", 1, 0, 0, 0.0, meta={"prompt_tokens": 0, "forecast_tokens": 0})
    assert not pol.fits(led, led.waiter("b"))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- LocalBudget
A_META = {"prompt_tokens": 800, "forecast_tokens": 16}
B_META = {"prompt_tokens": 320, "forecast_tokens": 160}


@pytest.mark.anyio
async def test_local_budget_admits_on_the_projected_peak() -> None:
    budget = LocalBudget(75, BS, policy="elastic")
    assert budget.policy_name == "elastic"
    a = await budget.acquire(75, held=50, meta=A_META)
    # Static sum 51 + 30 = 81 > 75, projected peak 72: admitted at once.
    b = await budget.acquire(75, held=20, meta=B_META)
    st = await budget.status()
    assert st.policy == "elastic" and st.used == 72 and st.leases == 2
    with pytest.raises(AdmissionTimeout):
        await budget.acquire(75, held=5, meta={"prompt_tokens": 80, "forecast_tokens": 16}, timeout=0)
    await a.release()
    await b.release()
    assert (await budget.status()).used == 0


async def _wait_waiters(budget: LocalBudget, n: int) -> None:
    while sum(c.waiters for c in (await budget.status()).waiters.values()) != n:
        await anyio.sleep(0.001)


@pytest.mark.anyio
async def test_held_growth_lets_a_waiter_in() -> None:
    # A: 20 blocks of prompt, forecast 160 tokens. B the same. Together both peak at their common end:
    # 30 + 30 = 60 > 55. Once A reports 29 blocks held it has <= 31 steps left: peak 53 <= 55.
    budget = LocalBudget(55, BS, policy="elastic")
    a = await budget.acquire(55, held=20, meta=B_META)
    got: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def waiter() -> None:
            got.append(await budget.acquire(55, held=20, meta=B_META))

        tg.start_soon(waiter)
        await _wait_waiters(budget, 1)
        a.report_progress(24)  # 111 steps left: at A's end 31 + 27 = 58 > 55, still waiting
        assert (await budget.status()).waiters[0].waiters == 1
        a.report_progress(29)  # 31 steps left: 31 + 22 = 53, and B alone peaks at 30
    assert len(got) == 1 and not got[0].released
    assert (await budget.status()).used <= 55
    await a.release()
    await got[0].release()


@pytest.mark.anyio
async def test_first_token_makes_a_shared_prefix_count_once() -> None:
    budget = LocalBudget(60, BS, policy="elastic")
    meta = {"prompt_tokens": 640, "forecast_tokens": 32, "prefix_key": "sys", "prefix_blocks": 30}
    a = await budget.acquire(60, held=40, meta=meta)  # peak 42
    got: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def waiter() -> None:
            got.append(await budget.acquire(60, held=40, meta=meta))

        tg.start_soon(waiter)
        await _wait_waiters(budget, 1)
        # Before A's first token the prefix may not be cached yet: B would need its own copy (84 > 60).
        assert not got
        a.update_meta(first_token=True)  # now B only adds its 12 own blocks
    assert len(got) == 1
    assert (await budget.status()).used == 54
    await a.release()
    await got[0].release()


@pytest.mark.anyio
async def test_reforecast_tightens_admission_at_once() -> None:
    budget = LocalBudget(40, BS, policy="elastic")
    a = await budget.acquire(40, held=20, meta={"prompt_tokens": 320, "forecast_tokens": 16})
    late = {"prompt_tokens": 16, "forecast_tokens": 400}
    b = await budget.acquire(40, held=1, meta=late)  # a ends at t=16: fits
    await b.release()
    a.update_meta(forecast_tokens=320)  # a now peaks at 40 at t=320
    with pytest.raises(AdmissionTimeout):
        await budget.acquire(40, held=1, meta=late, timeout=0)
    assert (await budget.status()).waiters == {}
    await a.release()


@pytest.mark.anyio
async def test_progress_without_waiters_does_not_run_admission(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = LocalBudget(100, BS, policy="elastic")
    a = await budget.acquire(50, held=10, meta={"prompt_tokens": 160, "forecast_tokens": 100})
    calls = []
    real = budget._ledger.grant
    monkeypatch.setattr(budget._ledger, "grant", lambda now: calls.append(now) or real(now))
    for held in range(11, 20):
        a.report_progress(held, first_token=True)
    assert calls == []
    assert budget._ledger.leases[a.id].held == 19
    await a.release()


@pytest.mark.anyio
async def test_strict_ignores_meta_and_progress() -> None:
    budget = LocalBudget(75, BS, policy="strict")
    assert budget.policy_name == "strict"
    a = await budget.acquire(50, held=10, meta=A_META)
    with pytest.raises(AdmissionTimeout):
        await budget.acquire(30, held=10, meta=B_META, timeout=0)
    got: list[Any] = []
    with anyio.move_on_after(5):  # bounded: the assertion is that it is still waiting, not how fast
        async with anyio.create_task_group() as tg:
            async def waiter() -> None:
                got.append(await budget.acquire(30, held=10, meta=B_META))

            tg.start_soon(waiter)
            await _wait_waiters(budget, 1)
            a.report_progress(50, first_token=True, forecast_tokens=1)
            assert not got  # strict counts bounds: progress never admits
            await a.release()
    assert len(got) == 1
    await got[0].release()
    assert (await budget.status()).used == 0


@pytest.mark.anyio
async def test_cancelled_elastic_waiter_leaves_no_trace() -> None:
    budget = LocalBudget(40, BS, policy="elastic")
    a = await budget.acquire(40, held=30, meta={"prompt_tokens": 480, "forecast_tokens": 160})
    with anyio.move_on_after(0.05):
        await budget.acquire(40, held=20, meta=B_META)
    st = await budget.status()
    assert st.waiters == {} and st.leases == 1
    await a.release()
    assert (await budget.status()).used == 0


def test_progress_from_a_thread_wakes_a_sync_waiter() -> None:
    budget = LocalBudget(60, BS, policy="elastic")
    meta = {"prompt_tokens": 640, "forecast_tokens": 32, "prefix_key": "sys", "prefix_blocks": 30}
    a = budget.acquire_sync(60, held=40, meta=meta)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(budget.acquire_sync(60, held=40, meta=meta, timeout=30)))
    t.start()
    while not budget.status_sync().waiters:
        threading.Event().wait(0.001)
    a.report_progress(None, first_token=True)
    t.join(30)
    assert len(got) == 1 and got[0].held == 40
    got[0].release_sync()
    a.release_sync()
    assert budget.status_sync().used == 0


def test_policy_object_must_match_the_block_size() -> None:
    with pytest.raises(ConfigurationError, match="block_size"):
        LocalBudget(100, 16, policy=ElasticPolicy(32))
    assert LocalBudget(100, 32, policy=ElasticPolicy(32)).policy_name == "elastic"
    with pytest.raises(ConfigurationError):
        LocalBudget(100, policy="elastic-someday")


@pytest.mark.anyio
async def test_every_admission_keeps_the_projected_peak_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many tasks, progress reports out of lockstep: right after every grant that admits someone, the
    projected peak (computed afresh) is within the limit. (Between admissions it may exceed the limit:
    streams progressing out of lockstep legitimately move the projection; growth is never blocked.)"""
    budget = LocalBudget(120, BS, policy="elastic")
    led = budget._ledger
    real_grant = led.grant
    at_admission: list[int] = []

    def checked_grant(now: float) -> list[str]:
        granted = real_grant(now)
        if granted:
            fresh = ElasticPolicy(BS)  # no cache: recompute from the ledger's state
            at_admission.append(fresh.used(led))
        return granted

    monkeypatch.setattr(led, "grant", checked_grant)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        prompt = 16 * (5 + i % 7)
        fc = 16 * (1 + i % 5)
        meta = {"prompt_tokens": prompt, "forecast_tokens": fc}
        lease = await budget.acquire(60, held=-(-prompt // BS), meta=meta)
        for step in range(1, fc // 16):  # at its forecast end it finishes (a report there reads as outgrown)
            lease.report_progress(-(-(prompt + 16 * step) // BS), first_token=True, tokens=prompt + 16 * step)
            await anyio.sleep(0)
        await lease.release()
        done += 1

    async with anyio.create_task_group() as tg:
        for i in range(60):
            tg.start_soon(one, i)
    assert done == 60 and len(at_admission) >= 2
    assert max(at_admission) <= 120
    assert (await budget.status()).used == 0


# ---------------------------------------------------------------------------------------------- property
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_op = st.one_of(
    st.tuples(st.just("enqueue"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 200),
              st.sampled_from([None, "p", "q"]), st.booleans()),
    st.tuples(st.just("held"), st.integers(0, 50), st.integers(0, 40)),
    st.tuples(st.just("meta"), st.integers(0, 50), st.integers(0, 300), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("limit"), st.integers(20, 80)),
)


@settings(max_examples=150, deadline=None)
@pytest.mark.parametrize("longest_first_s", [0.0, 0.75], ids=["line-order", "longest-first"])
@given(ops=st.lists(_op, min_size=1, max_size=40))
def test_cached_projection_matches_a_fresh_one_and_admissions_respect_the_limit(
    longest_first_s: float, ops: list[Any]
) -> None:
    """Random ledger histories under elastic: the policy's cache (keyed on the ledger's version) always
    agrees with a projection computed from scratch, every grant that admits leaves it within the
    limit, and the line holds exactly the waiters, in order."""
    pol = ElasticPolicy(BS)
    led = Ledger(60, policy=pol, starvation_bound_s=1.0, longest_first_s=longest_first_s)
    ids: list[str] = []
    now = 0.0
    for op in ops:
        now += 0.25
        kind = op[0]
        if kind == "enqueue":
            _, bound, prompt_blocks, forecast, prefix, streaming = op
            prompt_blocks = min(prompt_blocks, bound)
            meta: dict[str, Any] = {"prompt_tokens": prompt_blocks * BS, "forecast_tokens": forecast,
                                    "streaming": streaming}
            if prefix is not None:
                meta.update(prefix_key=prefix, prefix_blocks=max(1, prompt_blocks // 2))
            wid = f"w{len(ids)}"
            ids.append(wid)
            try:
                led.enqueue(wid, bound, prompt_blocks, 0, now, meta=meta)
            except LeaseTooLarge:
                continue
        elif kind == "held" and ids:
            led.report_held(ids[op[1] % len(ids)], op[2])
        elif kind == "meta" and ids:
            led.update_meta(ids[op[1] % len(ids)], forecast_tokens=op[2], first_token=op[3])
        elif kind == "release" and ids:
            led.release(ids[op[1] % len(ids)], now)
        elif kind == "cancel" and ids:
            led.cancel(ids[op[1] % len(ids)])
        elif kind == "limit":
            led.set_limit(op[1], now)
        assert pol.used(led) == ElasticPolicy(BS).used(led)
        if led.grant(now):
            assert ElasticPolicy(BS).used(led) <= led.limit
        assert pol.used(led) == ElasticPolicy(BS).used(led)
        # The line holds exactly the waiters, in order, whichever of them backfill admitted.
        line = [w.id for w in led.line()]
        assert len(line) == len(set(line)) == len(led)
        assert all(led.waiter(i) is not None and i not in led.leases for i in line)
        assert [(w.priority, w.key) for w in led.line()] == sorted((w.priority, w.key) for w in led.line())


@pytest.mark.anyio
async def test_a_backend_without_meta_keeps_working_with_the_base_helpers() -> None:
    """base.Budget.lease passes ``meta`` only when given, and Lease.update_meta/report_progress have
    defaults, so a backend written before elastic existed still works unchanged."""

    class OldBudget(LocalBudget):
        async def acquire(self, blocks: int, *, priority: int = 0, timeout: float | None = None,  # type: ignore[override]
                          ticket: Any = None, held: int | None = None) -> Any:
            return await super().acquire(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held)

    b = OldBudget(10, BS, policy="strict")  # backends written before elastic were strict
    assert b.policy_name == "strict"
    async with b.lease(3, held=1) as lease:
        lease.report_progress(2, first_token=True)
        assert lease.held == 2
    assert (await b.status()).used == 0
    with pytest.raises(TypeError):
        async with b.lease(3, meta={"x": 1}):
            pass


# ------------------------------------------------------------------------------ leases without metadata
# A: acquire(10, held=1) with no metadata. Projected as a stream it would grow from 16 tokens to its bound
# in 144 steps and end there (1 + 9 = 10 blocks at t = 144), so B (prompt 16 tokens, forecast 170, bound 12:
# 1 + 11 = 12 blocks at t = 170) would fit a limit of 20 (10 + 10 at t = 144, B alone after). But A reports
# nothing: it may live as long as it likes at its bound. It is reserved at 10 for its whole life, so B
# (12 more at its end) does not fit; C, a lease of 10 blocks without metadata, fits exactly, as under strict.
B_LATE = {"prompt_tokens": 16, "forecast_tokens": 170}


def test_a_lease_without_metadata_is_projected_at_its_bound_forever() -> None:
    from zp_client.budget.elastic import FOREVER, Projection, project, projected_peak

    assert project(held=1, bound=10, block_size=BS, meta={}) == Projection(10, FOREVER, False)
    assert project(held=1, bound=10, block_size=BS, meta={"unrelated": 1}) == Projection(10, FOREVER, False)
    assert projected_peak([(1, 10, {}), (1, 12, B_LATE)], BS) == 22
    # with one field the lease is projected (here to its bound from its prompt: it ends at t = 144)
    assert projected_peak([(1, 10, {"prompt_tokens": 16}), (1, 12, B_LATE)], BS) == 20
    led = Ledger(20, policy=ElasticPolicy())
    led.enqueue("a", 10, 1, 0, 0.0)
    assert led.grant(0.0) == ["a"]
    led.enqueue("b", 12, 1, 0, 0.0, meta=dict(B_LATE))
    assert led.grant(0.0) == []
    led.enqueue("c", 10, 1, 0, 0.0)
    led.cancel("b")
    assert led.grant(0.0) == ["c"]


@pytest.mark.anyio
async def test_local_budget_reserves_a_lease_without_metadata_at_its_bound() -> None:
    budget = LocalBudget(limit_blocks=20, block_size=BS, policy="elastic")
    a = await budget.acquire(10, held=1)
    with pytest.raises(AdmissionTimeout):
        await budget.acquire(12, held=1, meta=dict(B_LATE), timeout=0)
    c = await budget.acquire(10, held=1, timeout=0)
    assert (await budget.status()).used == 20
    await a.release()
    await c.release()
    await budget.aclose()


# ---------------------------------------------------------------------------------------------- longest first
# limit 20, bs 16. SHORT and LONG each start at 10 blocks (160-token prompts); SHORT ends after 16 more
# tokens (11 blocks), LONG after 64 (14). Together, just before SHORT ends: 11 + 11 = 22 > 20, so only
# one of them fits at a time.
SHORT = {"prompt_tokens": 160, "forecast_tokens": 16}
LONG = {"prompt_tokens": 160, "forecast_tokens": 64}


def _pair(longest_first_s: float, starvation: float = 2.0, long_at: float = 0.5) -> Ledger:
    led = Ledger(20, policy=ElasticPolicy(BS), starvation_bound_s=starvation, longest_first_s=longest_first_s)
    led.enqueue("short", 14, 10, 0, 0.0, meta=SHORT)
    led.enqueue("long", 14, 10, 0, long_at, meta=LONG)
    return led


def test_longest_first_is_off_by_default_the_line_goes_first() -> None:
    led = Ledger(20, policy=ElasticPolicy(BS))
    assert led.longest_first_s == 0.0
    led.enqueue("short", 14, 10, 0, 0.0, meta=SHORT)
    led.enqueue("long", 14, 10, 0, 0.5, meta=LONG)
    assert led.grant(1.0) == ["short"]


def test_young_waiters_go_longest_forecast_first() -> None:
    led = _pair(longest_first_s=10.0)
    assert [w.id for w in led.line()] == ["short", "long"]  # the line itself stays FIFO
    assert led.grant(1.0) == ["long"]
    led.release("long", 2.0)
    assert led.grant(2.0) == ["short"]


def test_a_waiter_older_than_the_window_goes_before_any_younger_one() -> None:
    # At t=2 SHORT has waited 2 s >= the 1.5 s window, LONG 0.5 s: SHORT is tried first and fits.
    led = _pair(longest_first_s=1.5, long_at=1.5)
    assert led.grant(2.0) == ["short"]
    assert led.waiter("long") is not None


def test_a_starving_waiter_that_does_not_fit_still_blocks_what_is_walked_after_it() -> None:
    led = Ledger(20, policy=ElasticPolicy(BS), starvation_bound_s=1.0, longest_first_s=1.0)
    led.enqueue("live", 8, 8, 0, 0.0, meta={"prompt_tokens": 128, "forecast_tokens": 0})
    assert led.grant(0.0) == ["live"]
    # BIG (13 blocks) cannot fit next to the 8 held; SMALL_LONG (4 blocks, ends at 8) could.
    led.enqueue("big", 14, 13, 0, 0.0, meta={"prompt_tokens": 208, "forecast_tokens": 16})
    led.enqueue("small_long", 8, 4, 0, 0.5, meta={"prompt_tokens": 64, "forecast_tokens": 64})
    assert led.grant(0.6) == ["small_long"]  # both young: the longer first (and it fits)
    led.release("small_long", 0.7)
    led.enqueue("small_long2", 8, 4, 0, 1.5, meta={"prompt_tokens": 64, "forecast_tokens": 64})
    assert led.grant(1.6) == []  # BIG has waited 1.6 s: walked first, a barrier; nothing passes it
    led.release("live", 1.7)
    assert led.grant(1.7) == ["big", "small_long2"]  # the starving one first, then what still fits


def test_no_backfill_or_no_window_means_the_plain_walk() -> None:
    assert _pair(longest_first_s=10.0, starvation=0.0).grant(1.0) == ["short"]
    assert _pair(longest_first_s=0.0).grant(1.0) == ["short"]


def test_walk_orders_by_forecast_keeps_line_order_among_equals_and_counts_no_forecast_as_zero() -> None:
    led = Ledger(1000, policy=ElasticPolicy(BS))
    metas = {"a": {"prompt_tokens": 16, "forecast_tokens": 10}, "b": {"prompt_tokens": 16},
             "c": {"prompt_tokens": 16, "forecast_tokens": 300}, "d": {"prompt_tokens": 16, "forecast_tokens": 10},
             "e": {"prompt_tokens": 16, "forecast_tokens": 5}}
    for i, (wid, meta) in enumerate(metas.items()):
        led.enqueue(wid, 30, 1, 0, float(i), meta=meta)
    cls = list(led.line())
    # At t=5.5, a (t=0) has waited 5.5 s >= 5: first, in line order. Then c, d, e, b by forecast.
    assert [cls[i].id for i in ElasticPolicy.walk(cls, 5.5, 2.0, 5.0)] == ["a", "c", "d", "e", "b"]
    assert [cls[i].id for i in ElasticPolicy.walk(cls, 100.0, 2.0, 5.0)] == ["a", "b", "c", "d", "e"]
    assert list(ElasticPolicy.walk(cls, 5.5, 2.0, 0.0)) == [0, 1, 2, 3, 4]


def test_admissions_out_of_line_order_leave_exactly_the_rest_in_line() -> None:
    # Forecasts grow with arrival, so the walk tries c, b, a. Only two fit (10 blocks each, 25 at most):
    # c and b are admitted, the line keeps a and only a (removing the admitted as if they were the
    # line's first two would drop a and keep b, admitted already).
    led = Ledger(25, policy=ElasticPolicy(BS), longest_first_s=10.0)
    for i, wid in enumerate("abc"):
        led.enqueue(wid, 12, 10, 0, 0.1 * i, meta={"prompt_tokens": 160, "forecast_tokens": 8 * (i + 1)})
    assert led.grant(1.0) == ["c", "b"]
    assert [w.id for w in led.line()] == ["a"] and len(led) == 1
    led.release("c", 1.1)
    assert led.grant(1.1) == ["a"]
    assert list(led.line()) == [] and sorted(led.leases) == ["a", "b"]


def test_longest_first_is_validated() -> None:
    with pytest.raises(ConfigurationError, match="longest_first_s"):
        Ledger(10, longest_first_s=-1.0)
    with pytest.raises(ConfigurationError, match="longest_first_s"):
        LocalBudget(10, longest_first_s=float("nan"))
    with pytest.raises(ConfigurationError, match="longest_first_s"):
        Ledger(10, longest_first_s=True)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_local_budget_admits_the_longer_of_two_waiters_first_when_one_fits() -> None:
    budget = LocalBudget(20, BS, policy="elastic", longest_first_s=60.0)
    blocker = await budget.acquire(20)  # no metadata: reserved at its bound
    short = asyncio.ensure_future(budget.acquire(14, held=10, meta=SHORT))
    await asyncio.sleep(0.05)
    long_ = asyncio.ensure_future(budget.acquire(14, held=10, meta=LONG))
    await asyncio.sleep(0.05)
    await blocker.release()
    lease = await asyncio.wait_for(long_, 5)
    await asyncio.sleep(0.05)
    assert not short.done()
    await lease.release()
    await (await asyncio.wait_for(short, 5)).release()


def test_settings_carry_the_window_to_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from zp_client.config import Settings

    monkeypatch.setenv("ZP_LONGEST_FIRST_S", "7.5")
    assert LocalBudget.from_settings(10)._ledger.longest_first_s == 7.5
    assert LocalBudget.from_settings(10, Settings(longest_first_s=0))._ledger.longest_first_s == 0.0
