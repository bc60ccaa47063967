"""RedisBudget(policy="elastic") and the Redis-shared length forecaster.

* Conformance: a hypothesis state machine drives random acquire (with elastic metadata) / progress
  (held, tokens, first_token, re-forecast) / release / cancel sequences against a RedisBudget and the
  sans-I/O :class:`~zp_client.budget.ledger.Ledger` with :class:`~zp_client.budget.elastic.ElasticPolicy`
  (the model). After every step the grants, the projected peak (``status().used``), held and the line
  must agree exactly. The Lua port of the projected-peak rule is therefore checked against the Python one
  on prefixes shared or not, first tokens, non-streamed leases, outgrown forecasts and re-forecasts.
* Hand-made cases: a first token makes a prefix shared and the progress report alone (no flush, no
  release) admits a waiter of another process through its mailbox; metadata is validated.
* The forecaster shared through Redis: a subprocess observes lengths; this process's forecaster and an
  elastic admission that depends on the forecast reflect them.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_redis_budget import redis_cluster  # noqa: F401 - the 3-master cluster fixture

from tests._elastic_strategies import PROGRESS, RESERVES, SPREAD_META
from tests._redis_keys import delete_keys
from zp_client.budget.base import Lease
from zp_client.budget.elastic import (
    DEFAULT_RESERVE_K,
    DEFAULT_RESERVE_Z,
    DEFAULT_URGENT_RESERVE,
    ElasticPolicy,
    projected_peak,
)
from zp_client.budget.ledger import Ledger
from zp_client.budget.local import LocalBudget
from zp_client.budget.redis import RedisBudget
from zp_client.errors import ConfigurationError

pytestmark = pytest.mark.redis


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio is asyncio-only

BS = 4
LIMIT = 24
NO_BACKFILL = 0.0
FULL_BACKFILL = 1e9


@pytest.fixture
def budgets(redis_url: str, redis_prefix: str) -> Iterator[Any]:
    names: list[str] = []
    counter = itertools.count()

    def make(limit: int, block_size: int = 16, **kw: Any) -> RedisBudget:
        name = f"{redis_prefix}-{next(counter)}"
        names.append(name)
        kw.setdefault("recovery_s", 0)
        return RedisBudget(redis_url, name, limit, block_size, policy="elastic", **kw)

    yield make
    delete_keys(redis_url, *names)


# --------------------------------------------------------------------------------------------- conformance
_meta = st.fixed_dictionaries(
    {},
    optional={
        "prompt_tokens": st.integers(0, 14 * BS),
        "forecast_tokens": st.integers(0, 14 * BS),
        "streaming": st.sampled_from([True, True, False]),
        "prefix_key": st.sampled_from(["A", "B"]),
        "prefix_blocks": st.integers(0, 4),
        "first_token": st.booleans(),
        # the upper forecast the forecast-error reserves read (total output tokens; below the forecast too)
        "forecast_hi": st.integers(0, 20 * BS),
    },
)
_progress, _reserves, _spread_meta = PROGRESS, RESERVES, SPREAD_META


def _make_machine(redis_url: str, names: list[str], starvation: float, longest_first_s: float = 0.0,
                  draw_reserves: bool = True) -> type:
    """The machine; ``draw_reserves`` False: the library's default forecast-error reserves, the budget made
    at once (for a subclass whose own ``initialize`` rules use it: tests/budget/test_pinning_redis.py)."""
    counter = itertools.count()

    class ElasticMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.labels = itertools.count()
            self.tasks: dict[str, asyncio.Task[Lease]] = {}
            self.leases: dict[str, Lease] = {}
            if not draw_reserves:
                self._make((DEFAULT_RESERVE_Z, DEFAULT_RESERVE_K, DEFAULT_URGENT_RESERVE))

        if draw_reserves:
            @initialize(reserves=_reserves)
            def make(self, reserves: tuple[float, float, float]) -> None:
                self._make(reserves)

        def _make(self, reserves: tuple[float, float, float]) -> None:
            # The reserves (drawn, 0 included) are stored in Redis by the budget's creator and applied by
            # the Lua grant pass; the model is the Python policy with the same ones.
            z, k, u = reserves
            self.model = Ledger(LIMIT, policy=ElasticPolicy(BS, reserve_z=z, reserve_k=k, urgent_reserve=u),
                                starvation_bound_s=starvation, longest_first_s=longest_first_s)
            name = f"{names[0]}-m{next(counter)}"
            names.append(name)
            self.budget = RedisBudget(redis_url, name, LIMIT, BS, policy="elastic", recovery_s=0,
                                      starvation_bound_s=starvation, held_report_blocks=1,
                                      longest_first_s=longest_first_s, reserve_z=z, reserve_k=k,
                                      urgent_reserve=u)

        def run(self, coro: Any) -> Any:
            return self.loop.run_until_complete(coro)

        def settle(self) -> None:
            want = self.model.status(0.0)
            got = None
            # Bounded wait for liveness only: reports in flight must land. A wrong grant never heals.
            for _ in range(300):
                self.run(self.budget.flush())
                got = self.run(self.budget.status())
                if (got.used, got.held, got.leases, got.waiters) == (want.used, want.held, want.leases,
                                                                      want.waiters):
                    break
                self.run(asyncio.sleep(0.01))
            assert got is not None
            assert (got.limit, got.used, got.free, got.held, got.leases) == (
                want.limit, want.used, want.free, want.held, want.leases), (got, want)
            assert got.waiters == want.waiters
            # (a pinned prefix's lease, tests/budget/test_pinning_redis.py, is nobody's grant)
            granted = [lbl for lbl in self.model.leases if lbl not in self.leases and not lbl.startswith("pin:")]
            if granted:
                _, pending = self.run(asyncio.wait([self.tasks[lbl] for lbl in granted], timeout=20))
                assert not pending, f"Redis did not hand out the grants the model made: {granted}"
            for lbl in granted:
                lease = self.tasks.pop(lbl).result()
                assert lease.ticket == self.model.lease(lbl).ticket
                self.leases[lbl] = lease
            for lbl, task in self.tasks.items():
                assert not task.done(), f"{lbl} finished ({task!r}) but the model says it waits"

        @rule(blocks=st.integers(1, 14), held_frac=st.integers(0, 4), priority=st.integers(0, 2),
              meta=st.one_of(_meta, _spread_meta))
        def acquire(self, blocks: int, held_frac: int, priority: int, meta: dict[str, Any]) -> None:
            held = blocks * held_frac // 4
            lbl = f"r{next(self.labels)}"
            self.model.enqueue(lbl, blocks, held, priority, 0.0, meta=meta)
            self.tasks[lbl] = self.loop.create_task(
                self.budget.acquire(blocks, held=held, priority=priority, meta=meta))
            self.run(self._until_registered(lbl))
            self.model.grant(0.0)
            self.settle()

        async def _until_registered(self, lbl: str) -> None:
            for _ in range(2000):
                st_ = await self.budget.status()
                n = st_.leases + sum(c.waiters for c in st_.waiters.values())
                if n >= len(self.leases) + len(self.tasks) or self.tasks[lbl].done():
                    return
                await asyncio.sleep(0.001)
            raise AssertionError("acquire never reached Redis")

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data(), held=st.integers(-1, 16), fields=_progress)
        def progress(self, data: st.DataObject, held: int, fields: dict[str, Any]) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            self.leases[lbl].report_progress(held, **fields)
            self.model.report_held(lbl, held)
            if fields:
                self.model.update_meta(lbl, **fields)
            self.model.grant(0.0)
            self.settle()

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.leases)))
            self.run(self.leases.pop(lbl).release())
            self.model.release(lbl, 0.0)
            self.model.grant(0.0)
            self.settle()

        @precondition(lambda self: bool(self.tasks))
        @rule(data=st.data())
        def cancel(self, data: st.DataObject) -> None:
            lbl = data.draw(st.sampled_from(sorted(self.tasks)))
            task = self.tasks.pop(lbl)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                self.run(task)
            assert self.model.cancel(lbl)
            self.model.grant(0.0)
            self.settle()

        def teardown(self) -> None:
            if not hasattr(self, "budget"):  # failed before make
                self.loop.close()
                return
            try:
                for task in self.tasks.values():
                    task.cancel()
                for task in self.tasks.values():
                    try:
                        lease = self.run(task)
                    except asyncio.CancelledError:
                        continue
                    self.run(lease.release())
                for lease in self.leases.values():
                    self.run(lease.release())
                st_ = self.run(self.budget.status())
                assert st_.leases == 0 and not st_.waiters, f"leaked: {st_}"
                self.run(self.budget.aclose())
            finally:
                self.loop.close()

    return ElasticMachine


@pytest.mark.parametrize(("starvation", "longest_first_s"),
                         [(NO_BACKFILL, 0.0), (FULL_BACKFILL, 0.0), (FULL_BACKFILL, FULL_BACKFILL)],
                         ids=["fifo", "backfill", "backfill-longest-first"])
@pytest.mark.slow  # a hypothesis state machine: make test-fast skips it, make test runs it
def test_elastic_redis_budget_conforms_to_the_elastic_ledger(
    starvation: float, longest_first_s: float, redis_url: str, redis_prefix: str
) -> None:
    # The windows are either 0 or far beyond the run, so the model's clock and Redis's never disagree.
    names = [redis_prefix]
    try:
        machine = _make_machine(redis_url, names, starvation, longest_first_s)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=30, stateful_step_count=25, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ))
    finally:
        delete_keys(redis_url, *names[1:])


# --------------------------------------------------------------------------------------------- hand-made
@pytest.mark.anyio
async def test_used_is_the_projected_peak_and_a_waiter_is_admitted_on_it(budgets: Any) -> None:
    # bs 16, limit 30. A: 8 blocks held (prompt 120 tokens), forecast 40 more tokens: 40 steps, growing
    # ceil(40/16) = 3 blocks from its 8 -> peak 11. B asks for 25 blocks: prompt 100 (7 blocks), 50 more
    # tokens -> 7 + 4 at its end. Just before A ends (t = 40): 11 + 7 + 3 = 21 <= 30, then B alone 11.
    # Strict would need 20 + 25 = 45 > 30.
    b = budgets(30)
    ma = {"prompt_tokens": 120, "forecast_tokens": 40}
    la = await b.acquire(20, held=8, meta=ma)
    assert (await b.status()).used == projected_peak([(8, 20, ma)], 16) == 11
    mb = {"prompt_tokens": 100, "forecast_tokens": 50}
    lb = await asyncio.wait_for(b.acquire(25, held=7, meta=mb), 20)
    st_ = await b.status()
    assert st_.used == projected_peak([(8, 20, ma), (7, 25, mb)], 16) == 21 and st_.extra["bound_sum"] == 45
    # A third without a forecast is projected to its bound (200 -> 320 tokens): 13 blocks now, 37 just
    # before A ends (21 + 13 + 3): it must wait until A and B leave.
    third = asyncio.ensure_future(b.acquire(20, held=13, meta={"prompt_tokens": 200}))
    await asyncio.sleep(0.3)
    assert not third.done()
    await la.release()
    await lb.release()
    lc = await asyncio.wait_for(third, 20)
    await lc.release()
    await b.aclose()


@pytest.mark.anyio
async def test_the_uncontended_fast_path_never_admits_what_the_projection_refuses(budgets: Any) -> None:
    # An acquire with nobody in line skips the grant pass when bsum + live leases + bound + 1 <= limit
    # (acquire.lua). Its edge: bs 16, limit 20. A (bound 10, held 1, prompt 1 token, no forecast) is
    # projected from its fewest tokens to its bound: 1 + ceil(159 / 16) = 11 blocks just before it ends,
    # one above its bound. B, the same, would hold 11 then too: 22 > 20, although the bounds sum to 20.
    b = budgets(20)
    m = {"prompt_tokens": 1}
    la = await b.acquire(10, held=1, meta=m)
    assert (await b.status()).used == projected_peak([(1, 10, m)], 16) == 11
    assert projected_peak([(1, 10, m), (1, 10, m)], 16) == 22
    pending = asyncio.ensure_future(b.acquire(10, held=1, meta=m))
    await asyncio.sleep(0.3)
    assert not pending.done()
    # A lease that fits with room to spare takes the fast path and keeps its metadata: the projection
    # (status().used) counts its forecast (2 + ceil(4 / 16) = 3 blocks), not its bound (9 blocks).
    await la.release()
    lb = await asyncio.wait_for(pending, 20)
    await lb.release()
    small = {"prompt_tokens": 20, "forecast_tokens": 4}
    lc = await b.acquire(8, held=2, meta=small)
    assert (await b.status()).used == projected_peak([(2, 8, small)], 16) == 3
    await lc.release()
    await b.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["local", "redis"])
async def test_a_lone_request_whose_bound_is_the_whole_limit_is_admitted(budgets: Any, backend: str) -> None:
    # A cold route forecasts at the bound (LengthForecaster's cold_n): a stream whose bound is the whole
    # limit (bound 256 of limit 256, prompt 17 tokens in 2 blocks, 4,079 more to its cap of 4,096 tokens)
    # projects 2 + ceil(4079 / 16) = 257 blocks, one above what it can hold (256, its cap): the rounding
    # of a partly filled prompt block. On an empty pool that block is dropped (fits' fast path), so the
    # request is admitted as strict would admit it (before, it waited forever); while a lease is live it
    # waits for the pool to empty.
    m = {"prompt_tokens": 17, "forecast_tokens": 100_000, "forecast_hi": 100_000, "max_output_tokens": 4079,
         "streaming": True}
    small_meta = {"prompt_tokens": 1}
    assert projected_peak([(2, 256, m)], 16) == 257
    b = budgets(256) if backend == "redis" else LocalBudget(256, 16, policy="elastic")
    lease = await asyncio.wait_for(b.acquire(256, held=2, meta=m, timeout=5), 20)
    pending = asyncio.ensure_future(b.acquire(1, held=1, meta=small_meta))
    await asyncio.sleep(0.3)
    assert not pending.done()  # the pool is full
    await lease.release()
    small = await asyncio.wait_for(pending, 20)
    pending = asyncio.ensure_future(b.acquire(256, held=2, meta=m))
    await asyncio.sleep(0.3)
    assert not pending.done()  # a lease is live: the big one waits for the pool to empty
    await small.release()
    again = await asyncio.wait_for(pending, 20)
    await again.release()
    await b.aclose()


@pytest.mark.anyio
async def test_an_exact_prompt_above_the_estimate_raises_the_cap_and_the_fast_path_counts_it(
    budgets: Any,
) -> None:
    # Nine leases sized on a 572-token estimate (bound 52 blocks with 256 output tokens) whose server
    # count is 615: each truly peaks at 55 blocks. At 540 the bounds alone (9 x 52 + 9 + 52 + 1 = 530)
    # pass acquire.lua's fast path, while the projection with a tenth peaks at 547
    # (tests/admission/test_elastic_exact_prompt.py has the same case on the Ledger and LocalBudget).
    b = budgets(540, 16)
    meta = {"prompt_tokens": 572, "forecast_tokens": 256, "streaming": True}
    leases = [await b.acquire(52, held=36, meta=meta) for _ in range(9)]
    assert (await b.status()).used == 9 * 52
    for lease in leases:
        lease.report_progress(39, prompt_tokens=615, first_token=True, tokens=615)
    await b.flush()
    assert (await b.status()).used == 9 * 55
    tenth = asyncio.ensure_future(b.acquire(52, held=36, meta=meta))
    await asyncio.sleep(0.3)
    assert not tenth.done()
    await leases.pop().release()
    lease = await asyncio.wait_for(tenth, 10)
    await lease.release()
    for le in leases:
        await le.release()
    assert (await b.status()).used == 0
    await b.aclose()


@pytest.mark.anyio
async def test_a_lease_without_metadata_is_reserved_at_its_bound(budgets: Any) -> None:
    # As tests/budget/test_elastic_budget.py: A (bound 10, held 1, no metadata) is not projected to end after 144
    # steps but counted at 10 for its whole life, so B (1 + 11 = 12 blocks at its end, t = 170) waits.
    b = budgets(20)
    la = await b.acquire(10, held=1)
    assert (await b.status()).used == 10
    late = {"prompt_tokens": 16, "forecast_tokens": 170}
    pending = asyncio.ensure_future(b.acquire(12, held=1, meta=late))
    await asyncio.sleep(0.3)
    assert not pending.done()
    await la.release()
    lb = await asyncio.wait_for(pending, 20)
    await lb.release()
    await b.aclose()


@pytest.mark.anyio
async def test_first_token_report_admits_a_waiter_of_another_process(budgets: Any) -> None:
    # Two budget handles (two "processes", separate owners and mailboxes). A holds 10 blocks of which
    # 8 are a shared prefix. B (same prefix, 10 blocks) does not fit beside A's own copy (limit 14),
    # but fits once A's first token makes the prefix shared: the progress report alone admits B.
    a = budgets(14)
    other = RedisBudget(a._core.url, a.name, 14, 16, policy="elastic", recovery_s=0, poll_interval_s=30)
    meta = {"prompt_tokens": 160, "forecast_tokens": 0, "prefix_key": "sys", "prefix_blocks": 8}
    la = await a.acquire(10, held=10, meta=meta)
    waiter = asyncio.ensure_future(other.acquire(10, held=10, meta=meta))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    assert (await a.status()).waiters[0].waiters == 1
    la.update_meta(first_token=True)  # no flush: the batched report goes at once for metadata
    lb = await asyncio.wait_for(waiter, 10)  # poll_interval is 30 s: this is the mailbox push
    st_ = await a.status()
    assert st_.leases == 2 and st_.used <= 14
    await lb.release()
    await la.release()
    await other.aclose()
    await a.aclose()


@pytest.mark.anyio
async def test_growth_reports_reach_redis_without_a_flush(budgets: Any) -> None:
    b = budgets(100, held_report_blocks=2)
    lease = await b.acquire(40, held=4, meta={"prompt_tokens": 60, "forecast_tokens": 100})
    lease.report_progress(7, tokens=110)
    for _ in range(500):
        st_ = await b.status()
        if st_.held == 7:
            break
        await asyncio.sleep(0.01)
    assert st_.held == 7
    assert st_.used == projected_peak([(7, 40, {"prompt_tokens": 60, "forecast_tokens": 100, "tokens": 110})], 16)
    await lease.release()
    await b.aclose()


@pytest.mark.anyio
async def test_the_servers_prompt_count_at_first_token_admits_a_waiter(budgets: Any) -> None:
    # What the transport reports with vLLM's continuous usage. bs 16, limit 30. A was admitted on an
    # estimated prompt of 320 tokens (20 blocks) + 16 forecast tokens: 21 blocks at its end. B (prompt 160
    # tokens, 16 more: 10 + 1 blocks at its end, the same instant) does not fit: 21 + 11 = 32 > 30. The
    # server says A's prompt is 160 tokens: A is projected at 10 + 1 blocks, 11 + 11 = 22, and B fits.
    b = budgets(30)
    other = RedisBudget(b._core.url, b.name, 30, 16, policy="elastic", recovery_s=0, poll_interval_s=30)
    ma = {"prompt_tokens": 320, "forecast_tokens": 16}
    la = await b.acquire(24, held=20, meta=ma)
    assert (await b.status()).used == 21
    mb = {"prompt_tokens": 160, "forecast_tokens": 16}
    waiter = asyncio.ensure_future(other.acquire(24, held=10, meta=mb))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    la.report_progress(10, tokens=161, prompt_tokens=160, first_token=True)
    lb = await asyncio.wait_for(waiter, 10)  # the mailbox push after the report, not a poll
    st_ = await b.status()
    assert st_.used == projected_peak([(10, 24, {**ma, "prompt_tokens": 160, "tokens": 161, "first_token": True}),
                                       (10, 24, mb)], 16) <= 30
    await lb.release()
    await la.release()
    await other.aclose()
    await b.aclose()


@pytest.mark.anyio
async def test_meta_is_validated(budgets: Any, redis_url: str) -> None:
    b = budgets(50)
    with pytest.raises(ConfigurationError, match="forecast_tokens"):
        await b.acquire(5, meta={"forecast_tokens": -3})
    with pytest.raises(ConfigurationError, match="prefix_key"):
        await b.acquire(5, meta={"prefix_key": "x" * 300})
    lease = await b.acquire(5, meta={"prompt_tokens": 10})
    lease.report_progress(2, forecast_tokens=-1)  # progress never raises; the bad field is dropped
    await b.flush()
    assert (await b.status()).held == 2
    # The script refuses bad metadata from a caller that bypasses the client.
    from zp_client.budget.redis._script import scripts as _scripts

    r = redis.Redis.from_url(redis_url)
    try:
        text, _ = _scripts()["acquire"]
        with pytest.raises(redis.ResponseError, match="meta pt"):
            r.eval(text, len(b._core.keys), *b._core.keys, "x" * 20, 5, 5, 0, -1, 1000, "mb", "o", 1000, '{"pt":-4}')
    finally:
        r.close()
    await lease.release()
    await b.aclose()


@pytest.mark.anyio
async def test_a_process_configured_strict_follows_a_stored_elastic_policy(budgets: Any) -> None:
    b = budgets(20)
    lease = await b.acquire(5, meta={"prompt_tokens": 10})
    s = RedisBudget(b._core.url, b.name, 20, 16, policy="strict", recovery_s=0)
    st_ = await s.status()
    assert st_.policy == "elastic"
    l2 = await s.acquire(5, meta={"prompt_tokens": 10, "forecast_tokens": 5})
    assert s.policy_name == "elastic"
    await l2.release()
    await lease.release()
    await s.aclose()
    await b.aclose()


# --------------------------------------------------------------------------------------------- forecaster
_LEARNER = textwrap.dedent(
    """
    import sys
    from zp_client.budget.redis import RedisBudget

    url, name = sys.argv[1], sys.argv[2]
    b = RedisBudget(url, name, 40, 16, policy="elastic", recovery_s=0)
    fc = b.shared_forecaster(sync_interval_s=30)
    for i in range(300):
        fc.observe("agent", 18 + i % 5)   # short replies: 18..22 tokens
    b.close_sync()                         # sends what is pending
    print("ok")
    """
)


@pytest.mark.anyio
@pytest.mark.slow
async def test_one_process_admits_on_a_forecaster_learned_by_another(budgets: Any) -> None:
    # bs 16, limit 40. Leases of 30 blocks: a 160-token prompt (10 blocks) and max_tokens 320. Cold, the
    # prior's 0.9 quantile (~1,200 tokens) is capped at 320: each lease projects 10 + 20 = 30 blocks, so a
    # second one does not fit. Once another process has taught the fleet that replies are ~20 tokens, a
    # lease projects 10 + 2 blocks and two fit easily.
    b = budgets(40)
    fc = b.shared_forecaster(sync_interval_s=0.2, q=0.9)  # the cold case below needs the 0.9 quantile
    assert fc is b.shared_forecaster()
    from zp_client.transport import forecaster_for

    assert forecaster_for(b) is fc  # the transport's default for this budget
    cold = fc.forecast("agent", max_tokens=320)
    assert cold == 320
    proc = subprocess.run([sys.executable, "-c", _LEARNER, b._core.url, b.name], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    learned = cold
    for _ in range(200):  # the periodic sync (0.2 s) picks the fleet's counts up; bounded for liveness
        learned = fc.forecast("agent", max_tokens=320)
        if learned < 64:
            break
        await asyncio.sleep(0.05)
    assert 18 <= learned < 64, learned
    assert fc.observations("agent") == 0  # this process observed nothing itself

    def meta(forecast: int) -> dict[str, Any]:
        return {"prompt_tokens": 160, "forecast_tokens": forecast}

    # With the cold forecast a second request must wait (both project to 30 blocks at the end) ...
    first = await b.acquire(30, held=10, meta=meta(cold))
    cold_waiter = asyncio.ensure_future(b.acquire(30, held=10, meta=meta(cold)))
    await asyncio.sleep(0.3)
    assert not cold_waiter.done()
    cold_waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cold_waiter
    await first.release()
    # ... with the learned one it is admitted next to the first at once.
    first = await b.acquire(30, held=10, meta=meta(learned))
    second = await asyncio.wait_for(b.acquire(30, held=10, meta=meta(learned)), 20)
    assert (await b.status()).used <= 40
    await second.release()
    await first.release()
    await b.aclose()


def test_forecaster_observations_reach_redis_and_local_view_includes_them(budgets: Any) -> None:
    b = budgets(40)
    fc = b.shared_forecaster(sync_interval_s=60)
    fc.observe_many("k", [100] * 50)
    local = fc.forecast("k")  # local at once, before any sync
    fc.sync()
    assert fc.forecast("k") == local  # the fleet view (prior + the same 50) equals the local one
    other = RedisBudget(b._core.url, b.name, 40, 16, policy="elastic", recovery_s=0)
    fc2 = other.shared_forecaster(sync_interval_s=60)
    fc2.sync()
    assert fc2.forecast("k") == local
    other.close_sync()
    b.close_sync()


@pytest.mark.anyio
async def test_a_lease_redis_lost_is_readopted_with_its_metadata(budgets: Any, redis_url: str) -> None:
    b = budgets(60, lease_ttl_s=30.0)
    meta = {"prompt_tokens": 100, "forecast_tokens": 30, "prefix_key": "p", "prefix_blocks": 3}
    lease = await b.acquire(40, held=7, meta=meta)
    lease.report_progress(8, tokens=120, first_token=True)
    await b.flush()
    want = projected_peak([(8, 40, {**meta, "tokens": 120, "first_token": True})], 16)
    assert (await b.status()).used == want
    delete_keys(redis_url, b.name)  # Redis lost its state
    await b._side.renew_round()
    assert b.counters["readopted"] == 1
    st_ = await b.status()
    # Without its metadata the lease would project to its bound (40 + 1 blocks).
    assert (st_.leases, st_.held, st_.used) == (1, 8, want)
    await lease.release()
    await b.aclose()


def test_lease_sync_carries_metadata_and_progress(budgets: Any) -> None:
    b = budgets(30)
    meta = {"prompt_tokens": 100, "forecast_tokens": 20}
    with b.lease_sync(25, held=7, meta=meta) as lease:
        assert b.status_sync().used == projected_peak([(7, 25, meta)], 16)
        lease.report_progress(9, tokens=140, forecast_tokens=60)
        want = projected_peak([(9, 25, {**meta, "tokens": 140, "forecast_tokens": 60})], 16)
        for _ in range(500):  # the sync keeper thread sends it (metadata goes at once)
            if b.status_sync().used == want:
                break
            time.sleep(0.01)
        st_ = b.status_sync()
        assert (st_.held, st_.used) == (9, want)
    assert b.status_sync().leases == 0
    b.close_sync()


# --------------------------------------------------------------------------------------------- transport
@pytest.fixture(scope="module")
def http_server() -> Iterator[Any]:
    from tests._asgi_server import LoopbackServer

    with LoopbackServer() as s:
        yield s


@pytest.mark.anyio
@pytest.mark.parametrize("reserve_z", [0.0, 0.5], ids=["no-reserve", "reserve"])
async def test_transport_over_an_elastic_redis_budget(budgets: Any, http_server: Any, redis_url: str,
                                                      reserve_z: float) -> None:
    import json as _json

    import httpx

    from zp_client.budget.redis_forecast import RedisLengthForecaster
    from zp_client.config import Settings
    from zp_client.transport import forecaster_for, transport_classes

    b = budgets(1000, reserve_z=reserve_z, reserve_k=0.0)
    t = transport_classes(httpx).AsyncAdmissionTransport(budget=b, settings=Settings(estimator="heuristic"))
    assert isinstance(t.forecaster, RedisLengthForecaster) and t.forecaster is forecaster_for(b)
    system = {"role": "system", "content": "You are a careful coding agent. " * 120}
    body = {"model": "slow", "stream": True, "max_tokens": 2000,
            "messages": [system, {"role": "user", "content": "hello there"}]}
    r = redis.Redis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(transport=t, base_url=http_server.base_url, timeout=30) as c:
            async with c.stream("POST", "/chat/completions", json=body) as resp:
                it = resp.aiter_raw()
                await it.__anext__()
                rec: dict[str, Any] = {}
                for _ in range(500):  # the first-token report is sent at once, in the background
                    (raw,) = r.hvals(b._core.keys[1]) or [b"{}"]
                    rec = _json.loads(raw)
                    if rec.get("m", {}).get("f1") == 1:
                        break
                    await asyncio.sleep(0.01)
                m = rec["m"]
                assert m["f1"] == 1 and m["st"] == 1 and m["pt"] > 200 and m["pb"] > 0 and m["pk"]
                assert 0 < m["ft"] <= 2000
                # the upper forecast travels only to a budget whose reserve reads it (as to LocalBudget)
                assert ("fh" in m) == bool(reserve_z)
                assert m.get("fh", m["ft"]) >= m["ft"]
            ok = {"model": "ok", "stream": True, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
            for _ in range(3):
                async with c.stream("POST", "/chat/completions", json=ok, headers={"X-ZP-Route": "planner"}) as resp:
                    await resp.aread()
        assert t.forecaster.observations("planner") == 3
        t.forecaster.sync()
        other = RedisBudget(b._core.url, b.name, 1000, 16, policy="elastic", recovery_s=0)
        fc2 = other.shared_forecaster(sync_interval_s=60)
        fc2.sync()  # another process sees what this one learned: replies of 6 tokens
        assert fc2.quantile("planner", 0.5) < fc2.quantile("never-seen", 0.5)
        other.close_sync()
    finally:
        r.close()
    assert (await b.status()).leases == 0
    await b.aclose()



@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.anyio
async def test_elastic_on_redis_cluster(redis_cluster: list[int], redis_prefix: str) -> None:
    # Everything elastic adds (the projection mirror, the forecaster's keys) lives under the hash tag.
    from redis.asyncio.cluster import RedisCluster
    from redis.cluster import RedisCluster as SyncRedisCluster

    client = RedisCluster(host="127.0.0.1", port=redis_cluster[0])
    sync_client = SyncRedisCluster(host="127.0.0.1", port=redis_cluster[0])
    a = RedisBudget(client, redis_prefix, 14, 16, policy="elastic", recovery_s=0, sync_client=sync_client,
                    poll_interval_s=30)
    b = RedisBudget(client, redis_prefix, 14, 16, policy="elastic", recovery_s=0, sync_client=sync_client,
                    poll_interval_s=30)
    meta = {"prompt_tokens": 160, "forecast_tokens": 0, "prefix_key": "sys", "prefix_blocks": 8}
    la = await a.acquire(10, held=10, meta=meta)
    waiter = asyncio.ensure_future(b.acquire(10, held=10, meta=meta))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    la.update_meta(first_token=True)
    lb = await asyncio.wait_for(waiter, 20)
    fc = a.shared_forecaster(sync_interval_s=60)
    fc.observe_many("k", [50] * 20)
    fc.sync()
    fc2 = b.shared_forecaster(sync_interval_s=60)
    fc2.sync()
    assert fc2.forecast("k") == fc.forecast("k")
    await lb.release()
    await la.release()
    assert (await a.status()).used == 0
    await a.aclose()
    await b.aclose()
    await client.aclose()
    sync_client.close()


@pytest.mark.anyio
async def test_above_the_lease_cap_a_pass_admits_by_the_strict_rule(budgets: Any, redis_url: str) -> None:
    b = budgets(40)
    r = redis.Redis.from_url(redis_url)
    try:
        meta = {"prompt_tokens": 16, "forecast_tokens": 16}  # each projects to 2 blocks at most
        leases = [await b.acquire(10, held=1, meta=meta)]  # creates the budget
        r.hset(b._core.keys[0], "emax", 2)  # the cap (4,096 by default), lowered for the test
        leases += [await b.acquire(10, held=1, meta=meta) for _ in range(2)]  # elastic passes: they fit
        assert (await b.status()).used == 30  # above the cap: used is the sum of bounds
        # Elastic would admit a fourth and a fifth (tiny projections); strict admits one more only.
        w4 = asyncio.ensure_future(b.acquire(10, held=1, meta=meta))
        w5 = asyncio.ensure_future(b.acquire(10, held=1, meta=meta))
        l4 = await asyncio.wait_for(w4, 20)
        await asyncio.sleep(0.3)
        assert not w5.done()
        # Every lease, admitted either way, stays in the projection mirror: none is lost to elastic.
        assert r.hlen(f"{{zp:{b.name}}}:em") == 4
        r.hdel(b._core.keys[0], "emax")
        await l4.release()  # a pass under the cap again: the elastic rule admits the fifth
        l5 = await asyncio.wait_for(w5, 20)
        st_ = await b.status()
        assert st_.used == projected_peak([(1, 10, meta)] * 4, 16) and st_.extra["bound_sum"] == 40
        for le in [*leases, l5]:
            await le.release()
        assert r.hlen(f"{{zp:{b.name}}}:em") == 0
    finally:
        r.close()
    await b.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("longest_first_s", [60.0, 0.0], ids=["longest-first", "off"])
@pytest.mark.slow
async def test_the_longer_of_two_young_waiters_goes_first_only_with_the_window(
    budgets: Any, longest_first_s: float
) -> None:
    # The Lua walk. limit 20, bs 16: SHORT and LONG start at 10 blocks, end at 11 and 14; together they
    # project 22 > 20, so only one fits. SHORT waits first; with the window LONG goes first.
    b = budgets(20, starvation_bound_s=60.0, longest_first_s=longest_first_s)
    blocker = await b.acquire(20)
    short = asyncio.ensure_future(b.acquire(14, held=10, meta={"prompt_tokens": 160, "forecast_tokens": 16}))
    await asyncio.sleep(0.2)
    long_ = asyncio.ensure_future(b.acquire(14, held=10, meta={"prompt_tokens": 160, "forecast_tokens": 64}))
    await asyncio.sleep(0.2)
    await blocker.release()
    first, second = (long_, short) if longest_first_s else (short, long_)
    lease = await asyncio.wait_for(first, 10)
    await asyncio.sleep(0.3)
    assert not second.done()
    await lease.release()
    await (await asyncio.wait_for(second, 10)).release()
    await b.aclose()


def test_longest_first_is_validated_and_read_from_settings(redis_url: str) -> None:
    from zp_client.config import Settings

    with pytest.raises(ConfigurationError, match="longest_first_s"):
        RedisBudget(redis_url, "zp-test-lpt-invalid", 10, longest_first_s=-1)
    b = RedisBudget.from_settings(redis_url, "zp-test-lpt-settings", 10, Settings(longest_first_s=4.0))
    assert b.config.longest_first_s == 4.0 and b._core.init_args()[6] == 4000  # ARGV[7] of init.lua
    b.close_sync()


# --------------------------------------------------------------------------------------------- reserves
# elastic's forecast-error reserves (ElasticPolicy reserve_z / reserve_k) in the Lua port: docs/elastic.md,
# "spread-reserve" and "risk-reserve". The conformance machine above draws them; these are the edges.
_SPREAD = {"prompt_tokens": 160, "forecast_tokens": 32, "forecast_hi": 192, "streaming": True}


@pytest.mark.parametrize("bad", [-0.5, 100.5, float("nan"), float("inf"), True, "1"])
@pytest.mark.parametrize("which", ["reserve_z", "reserve_k"])
def test_the_reserves_are_validated_as_the_policy_validates_them(which: str, bad: Any) -> None:
    with pytest.raises(ConfigurationError) as want:
        ElasticPolicy(16, **{which: bad})
    # a port nothing listens on: the constructor calls nothing, so the error comes before any Redis call
    with pytest.raises(ConfigurationError) as got:
        RedisBudget("redis://127.0.0.1:1/0", "zp-test-reserve-invalid", 10, **{which: bad})
    assert str(got.value) == str(want.value)


def test_the_reserves_are_rounded_as_the_policy_rounds_them_and_sent_in_thousandths() -> None:
    b = RedisBudget("redis://127.0.0.1:1/0", "zp-test-reserve-args", 10, reserve_z=1.23456, reserve_k=0.0004)
    p = ElasticPolicy(16, reserve_z=1.23456, reserve_k=0.0004)
    assert (b.config.reserve_z, b.config.reserve_k) == (p.reserve_z, p.reserve_k) == (1.235, 0.0)
    assert b._core.init_args()[10:] == [1235, 0, 2000]  # init.lua's ARGV[11..13]: the urgent reserve's default
    assert b.reads_forecast_spread
    # the defaults (ElasticPolicy's) read them
    assert RedisBudget("redis://127.0.0.1:1/0", "zp-test-reserve-default", 10).reads_forecast_spread
    off = RedisBudget("redis://127.0.0.1:1/0", "zp-test-reserve-off", 10, reserve_z=0, reserve_k=0)
    assert not off.reads_forecast_spread
    b.close_sync()


# bs 16, limit 40. A and B alike: bound 30, 10 blocks held (a 160-token prompt), forecast 32 more tokens
# (12 blocks at the end), upper forecast 192 (22 blocks): a spread of 10 blocks each. Together they project
# 24 blocks, and their bounds (30 + 30 + 2 > 40) miss the fast path. The reserve with B: spread
# ceil(z sqrt(200)) (z = 1: 15, z = 1.5: 22), risk ceil(k 20) (k = 0.8: 16, k = 0.85: 17); B is admitted
# while 24 <= 40 - reserve.
_BLOCKING = [(0.0, 0.0, True), (1.0, 0.0, True), (1.5, 0.0, False), (0.0, 0.8, True), (0.0, 0.85, False),
             (0.5, 0.5, False)]


@pytest.mark.parametrize(("z", "k", "admitted"), _BLOCKING)
def test_the_model_admits_b_only_while_the_reserve_leaves_room(z: float, k: float, admitted: bool) -> None:
    led = Ledger(40, policy=ElasticPolicy(16, reserve_z=z, reserve_k=k))
    led.enqueue("a", 30, 10, 0, 0.0, meta=_SPREAD)
    led.enqueue("b", 30, 10, 0, 0.0, meta=_SPREAD)
    assert led.grant(0.0) == (["a", "b"] if admitted else ["a"])


@pytest.mark.anyio
@pytest.mark.parametrize(("z", "k", "admitted"), _BLOCKING)
async def test_the_reserve_blocks_an_admission_in_both_backends(
    budgets: Any, z: float, k: float, admitted: bool
) -> None:
    from zp_client.budget.local import LocalBudget

    local = LocalBudget(40, 16, policy=ElasticPolicy(16, reserve_z=z, reserve_k=k))
    redis_b = budgets(40, reserve_z=z, reserve_k=k)
    for b in (local, redis_b):
        la = await b.acquire(30, held=10, meta=_SPREAD)
        second = asyncio.ensure_future(b.acquire(30, held=10, meta=_SPREAD))
        await asyncio.sleep(0.3)
        assert second.done() == admitted, (b, z, k)
        await la.release()
        lb = await asyncio.wait_for(second, 10)  # alone it fits (its bound takes the fast path)
        await lb.release()
    await redis_b.aclose()


@pytest.mark.anyio
async def test_a_later_process_follows_the_stored_reserves(budgets: Any, caplog: Any) -> None:
    first = budgets(40, reserve_z=1.5, reserve_k=0.0)
    la = await first.acquire(30, held=10, meta=_SPREAD)
    other = RedisBudget(first._core.url, first.name, 40, 16, policy="elastic", recovery_s=0,
                        poll_interval_s=30, reserve_z=0.0, reserve_k=0.0)
    assert not other.reads_forecast_spread  # configured without, until it reads the stored ones
    with caplog.at_level("WARNING", logger="zp_client.budget.redis"):
        await other.status()
    assert other._core.reserve == (1.5, 0.0) and other.reads_forecast_spread
    assert "reserve_z=1.5" in caplog.text
    # the stored reserve is the budget's: the other process's B waits as the creator's would
    second = asyncio.ensure_future(other.acquire(30, held=10, meta=_SPREAD))
    await asyncio.sleep(0.3)
    assert not second.done()
    await la.release()
    await (await asyncio.wait_for(second, 10)).release()
    await other.aclose()
    await first.aclose()


@pytest.mark.anyio
async def test_strict_stores_the_reserves_and_ignores_them(budgets: Any, redis_url: str) -> None:
    name = f"{budgets(40).name}-strict"
    b = RedisBudget(redis_url, name, 60, 16, policy="strict", recovery_s=0, reserve_z=3.0, reserve_k=2.0)
    try:
        assert not b.reads_forecast_spread
        la = await b.acquire(30, held=10, meta=_SPREAD)
        lb = await asyncio.wait_for(b.acquire(30, held=10, meta=_SPREAD), 10)  # 60 <= 60: bounds only
        await lb.release()
        await la.release()
        await b.aclose()
    finally:
        delete_keys(redis_url, name)


def _lua_reserves(redis_url: str, us: list[int], zm: int, km: int, cap: int) -> tuple[int, int]:
    from zp_client.budget.redis._script import load_lua

    body = """
    local s, lin = {0}, 0
    for i = 4, #ARGV do
      local u = tonumber(ARGV[i])
      bn_add_sq(s, u)
      lin = math.min(lin + u, LIN_MAX)
    end
    local zm, km, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
    return {string.format('%.0f', e_spread_reserve(s, zm, cap)),
            string.format('%.0f', e_risk_reserve(lin, km, cap))}
    """
    r = redis.Redis.from_url(redis_url)
    try:
        out = r.eval(load_lua("common.lua") + body, 1, "{zp:zp-test-reserve-math}:meta", zm, km, cap, *us)
    finally:
        r.close()
    return int(out[0]), int(out[1])


@pytest.mark.parametrize("seed", range(6))
def test_the_lua_reserves_are_exact_beyond_2_to_the_53(redis_url: str, seed: int) -> None:
    # Spreads up to 2^41 blocks (the largest a cap of 1e12 tokens allows), their squares summed far past
    # 2^53: the Lua's limbs give Python's integers, capped at limit + 1 (a reserve above the limit
    # refuses every candidate, as any larger one does).
    import random

    from zp_client.budget.elastic import risk_reserve, spread_reserve

    rng = random.Random(seed)
    for _ in range(40):
        n = rng.choice([1, 2, 7, 300])
        top = rng.choice([10, 10**4, 10**8, 2**41 - 1])
        us = [rng.randint(0, top) for _ in range(n)]
        zm, km = rng.choice([1, 7, 999, 1000, 1732, 100000]), rng.choice([0, 1, 250, 1000, 100000])
        cap = rng.choice([1, 41, 10**6, 10**12 + 1])
        lin = min(sum(us), 2**52)
        want = (min(cap, spread_reserve(sum(u * u for u in us), zm / 1000)),
                min(cap, risk_reserve(lin, km / 1000)))
        assert _lua_reserves(redis_url, us, zm, km, cap) == want, (us, zm, km, cap)
    # perfect squares and their neighbours (where a float sqrt is one off)
    for root in (10**6, 3 * 10**7 + 1, 94906265, 10**12 - 1, 2**40 + 3):
        for s in (root * root - 1, root * root, root * root + 1):
            want_z = min(10**12 + 1, spread_reserve(s, 1.0))
            got_z, _ = _lua_reserves_sum(redis_url, s, 1000, 10**12 + 1)
            assert got_z == want_z, s


def _lua_reserves_sum(redis_url: str, s: int, zm: int, cap: int) -> tuple[int, int]:
    """As _lua_reserves for one sum of squares ``s`` given directly (as limbs of 2^24)."""
    from zp_client.budget.redis._script import load_lua

    limbs = []
    while s:
        limbs.append(s % 2**24)
        s //= 2**24
    body = """
    local s = {}
    for i = 3, #ARGV do s[#s + 1] = tonumber(ARGV[i]) end
    return {string.format('%.0f', e_spread_reserve(s, tonumber(ARGV[1]), tonumber(ARGV[2]))), 0}
    """
    r = redis.Redis.from_url(redis_url)
    try:
        out = r.eval(load_lua("common.lua") + body, 1, "{zp:zp-test-reserve-math}:meta", zm, cap,
                     *(limbs or [0]))
    finally:
        r.close()
    return int(out[0]), int(out[1])


@pytest.mark.anyio
async def test_the_snapshot_replays_the_stored_reserves(budgets: Any) -> None:
    # The wait prediction's copy of the budget (snapshot.lua -> ledger_from_snapshot) carries the stored
    # reserves: its replay refuses B as the Lua grant pass did, and admits it without the reserve.
    from zp_client.budget.redis._snapshot import SNAPSHOT_CAP, ledger_from_snapshot

    b = budgets(40, reserve_z=1.5)
    la = await b.acquire(30, held=10, meta=_SPREAD)
    second = asyncio.ensure_future(b.acquire(30, held=10, meta=_SPREAD))
    await asyncio.sleep(0.3)
    assert not second.done()
    snap = ledger_from_snapshot(await b._get_side().eval("snapshot", [SNAPSHOT_CAP], init=False))
    assert snap is not None
    policy = snap.ledger.policy
    assert isinstance(policy, ElasticPolicy) and policy.reserve_z == 1.5
    lease = next(iter(snap.ledger.leases.values()))
    assert lease.meta["forecast_hi"] == 192
    assert snap.ledger.grant(snap.now) == []
    policy.reserve_z = 0.0
    assert len(snap.ledger.grant(snap.now)) == 1
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await la.release()
    await b.aclose()


@pytest.mark.anyio
async def test_a_mirror_written_before_forecast_hi_still_parses(budgets: Any, redis_url: str) -> None:
    # A lease of a client before fh has an 11-field mirror ("... mo pk"): read as fh absent, its prefix
    # key (which may hold spaces) intact.
    b = budgets(40, reserve_z=1.5)
    meta = {**_SPREAD, "prefix_key": "sys a", "prefix_blocks": 2, "first_token": True}
    la = await b.acquire(30, held=10, meta=meta)
    lb = await b.acquire(5, held=3, meta={"prompt_tokens": 40, "forecast_tokens": 8, "prefix_key": "sys a",
                                          "prefix_blocks": 2, "first_token": True})
    want = (await b.status()).used
    r = redis.Redis.from_url(redis_url)
    try:
        key = f"{{zp:{b.name}}}:em"
        stripped = 0
        for lid, raw in r.hgetall(key).items():
            parts = raw.decode().split(" ", 11)
            if parts[10].lstrip("-").isdigit():  # A: "... mo fh pk"
                assert parts[11] == "=sys a"
                r.hset(key, lid, " ".join(parts[:10] + parts[11:]))  # without fh
                stripped += 1
            else:  # B has no upper forecast: its mirror is written without fh, the format before it
                assert " ".join(parts[10:]) == "=sys a"
        assert stripped == 1
        assert (await b.status()).used == want
        # with fh gone A has no spread, so no reserve: C (12 + 2 blocks at its end, no spread of its own)
        # fits, 26 <= 40 (with A's spread of 10 blocks the reserve, 15, would refuse it: 26 > 25)
        c = {"prompt_tokens": 192, "forecast_tokens": 32, "forecast_hi": 32}
        extra = await asyncio.wait_for(b.acquire(30, held=11, meta=c), 10)
        await extra.release()
    finally:
        r.close()
    await lb.release()
    await la.release()
    await b.aclose()
