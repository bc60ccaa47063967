"""zp_client.metrics: what a scrape says equals what the harness recorded itself, per request and lease.

The harness's records are kept outside the code under test: a budget wrapper (``Recorder``) notes every
acquire (priority, wait, bound, forecast) and every lease's grant and release on the core's clock, the
test counts its own calls and caught errors, and the retry upstream logs every arrival. The metrics are
scraped with prometheus-client's text exposition and parsed back with its parser.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import openai
import pytest
from _retry_upstream import RetryUpstream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zp_client import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    AdmissionTimeout,
    Budget,
    BudgetStatus,
    ConfigurationError,
    Lease,
    LeaseTooLarge,
    LocalBudget,
    RetryBudgetExhausted,
    Settings,
    Ticket,
    ZPMetrics,
    wrap,
)
from zp_client.budget.base import ClassStatus
from zp_client.retry import testing

try:  # the simulator (zp-sim); without it (`make test-wheel`) the tests marked needs_sim are skipped
    from zp_sim.server import SimServer
except ModuleNotFoundError:
    SimServer = None  # type: ignore[assignment,misc]

pytestmark = [pytest.mark.anyio, pytest.mark.openai_compat]

SETTINGS = Settings(estimator="heuristic")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=50.0) as s:
        yield s


# --------------------------------------------------------------------------------------------------
# the harness's own records
# --------------------------------------------------------------------------------------------------


@dataclass
class Records:
    waits: list[tuple[int, float]] = field(default_factory=list)  # (priority, seconds) per granted acquire
    holds: list[tuple[int, float]] = field(default_factory=list)  # (priority, seconds) per released lease
    forecasts: list[int] = field(default_factory=list)  # forecast_tokens of each granted acquire
    pending: Counter[int] = field(default_factory=Counter)  # acquires in flight, per priority
    live_bounds: int = 0  # bounds of the leases granted and not released


class RecordedLease(Lease):
    """Delegates to the real lease; notes its hold from grant to the first release call."""

    def __init__(self, inner: Lease, rec: Records, clock: Any) -> None:
        self.inner, self.rec, self.clock = inner, rec, clock
        self.id, self.bound, self.priority, self.ticket = inner.id, inner.bound, inner.priority, inner.ticket
        self.granted = clock.monotonic()
        self.noted = False

    @property
    def held(self) -> int:
        return self.inner.held

    @property
    def released(self) -> bool:
        return self.inner.released

    def report_held(self, blocks: int) -> None:
        self.inner.report_held(blocks)

    def update_meta(self, **fields: Any) -> None:
        self.inner.update_meta(**fields)

    def report_progress(self, held: int | None = None, **fields: Any) -> None:
        self.inner.report_progress(held, **fields)

    def _note(self) -> None:
        if not self.noted:
            self.noted = True
            self.rec.holds.append((self.priority, self.clock.monotonic() - self.granted))
            self.rec.live_bounds -= self.bound

    async def release(self) -> None:
        self._note()
        await self.inner.release()

    def release_sync(self) -> None:
        self._note()
        self.inner.release_sync()


class Recorder(Budget):
    """A LocalBudget seen through a recording wrapper (the harness's instrument, not the metrics')."""

    def __init__(self, inner: LocalBudget) -> None:
        self.inner = inner
        self.block_size = inner.block_size
        self.clock = inner.clock
        self.name = inner.name
        self.rec = Records()

    @property
    def limit(self) -> int:
        return self.inner.limit

    @property
    def policy_name(self) -> str:
        return self.inner.policy_name

    def _granted(self, lease: Lease, priority: int, started: float, meta: Mapping[str, Any] | None) -> Lease:
        self.rec.waits.append((priority, self.clock.monotonic() - started))
        if meta is not None:
            self.rec.forecasts.append(int(meta["forecast_tokens"]))
        self.rec.live_bounds += lease.bound
        return RecordedLease(lease, self.rec, self.clock)

    async def acquire(self, blocks: int, *, priority: int = 0, timeout: float | None = None,
                      ticket: Ticket | None = None, held: int | None = None,
                      meta: Mapping[str, Any] | None = None) -> Lease:
        started = self.clock.monotonic()
        self.rec.pending[priority] += 1
        try:
            lease = await self.inner.acquire(blocks, priority=priority, timeout=timeout, ticket=ticket,
                                             held=held, meta=meta)
        finally:
            self.rec.pending[priority] -= 1
        return self._granted(lease, priority, started, meta)

    def acquire_sync(self, blocks: int, *, priority: int = 0, timeout: float | None = None,
                     ticket: Ticket | None = None, held: int | None = None,
                     meta: Mapping[str, Any] | None = None) -> Lease:
        started = self.clock.monotonic()
        lease = self.inner.acquire_sync(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                        meta=meta)
        return self._granted(lease, priority, started, meta)

    async def status(self) -> BudgetStatus:
        return self.inner.status_sync()

    def status_sync(self) -> BudgetStatus:
        return self.inner.status_sync()

    async def set_limit(self, limit: int) -> None:
        await self.inner.set_limit(limit)


# --------------------------------------------------------------------------------------------------
# scraping
# --------------------------------------------------------------------------------------------------


def scrape(m: ZPMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's text exposition, parsed back: (name, sorted labels) -> value."""
    text = generate_latest(m.registry).decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


Samples = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def ask(content: str = "count to ten", max_tokens: int = 24) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "extra_body": {"ignore_eos": True}}


# --------------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------------


N = 12  # requests of the storm, half of them at priority 1


@pytest.mark.needs_sim
async def test_a_storm_scraped_mid_run_and_after_matches_the_harness_records(sim: SimServer) -> None:
    # strict: the used gauge is the sum of the live bounds, which the harness tracks
    budget = Recorder(LocalBudget(limit_blocks=8, block_size=16, policy="strict", name="storm"))
    m = ZPMetrics(remote_status_ttl_s=0)  # the Recorder is not a LocalBudget: read it on every scrape
    rec = budget.rec
    async with openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0) as original:
        client = wrap(original, budget, settings=SETTINGS, metrics=m)
        done: Counter[str] = Counter()

        async def one(i: int) -> None:
            prio = i % 2
            if i % 3 == 0:  # streamed, read to its end
                stream = await client.chat.completions.create(
                    model=sim.model, stream=True, extra_headers={PRIORITY_HEADER: str(prio)}, **ask())
                async for _ in stream:
                    pass
            else:
                await client.chat.completions.create(
                    model=sim.model, extra_headers={PRIORITY_HEADER: str(prio)}, **ask())
            done[str(prio)] += 1

        # The whole pool is taken, so every request of the storm waits in line.
        blocker = await budget.inner.acquire(8)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(N):
                    tg.start_soon(one, i)
                while sum(rec.pending.values()) < N:
                    await asyncio.sleep(0.01)
                mid = scrape(m)  # during the storm: nothing granted yet, everyone waits
                mid_pending, mid_live = dict(rec.pending), rec.live_bounds
                await blocker.release()
        with pytest.raises(LeaseTooLarge):  # its bound can never fit the 8 blocks
            await client.chat.completions.create(model=sim.model, **ask(max_tokens=2000))

    # mid-run gauges: the harness's own view of the line and of the leases at that moment
    assert value(mid, "zp_budget_limit_blocks", budget="storm") == 8
    assert value(mid, "zp_budget_used_blocks", budget="storm") == 8 + mid_live == 8  # the blocker's
    assert value(mid, "zp_budget_waiters", budget="storm", priority="0") == mid_pending[0] == N // 2
    assert value(mid, "zp_budget_waiters", budget="storm", priority="1") == mid_pending[1] == N // 2
    assert value(mid, "zp_queue_wait_seconds_count", priority="0") == 0

    after = scrape(m)
    assert done == {"0": N // 2, "1": N // 2}
    assert len(rec.waits) == N and rec.live_bounds == 0
    for prio in ("0", "1"):
        waits = [w for p, w in rec.waits if str(p) == prio]
        holds = [h for p, h in rec.holds if str(p) == prio]
        assert value(after, "zp_queue_wait_seconds_count", priority=prio) == len(waits) == N // 2
        assert value(after, "zp_lease_hold_seconds_count", priority=prio) == len(holds) == N // 2
        # The core's wait spans the budget's acquire (it reads its clock just outside it) and its hold
        # lies inside the lease's: equal up to the few steps between, with slack for thread switches.
        core_wait = value(after, "zp_queue_wait_seconds_sum", priority=prio)
        assert sum(waits) <= core_wait <= sum(waits) + 0.05 * len(waits)
        core_hold = value(after, "zp_lease_hold_seconds_sum", priority=prio)
        assert sum(holds) - 0.05 * len(holds) <= core_hold <= sum(holds)
        # every bucket count is a count of the harness's waits at most that long (le is inclusive)
        assert value(after, "zp_queue_wait_seconds_bucket", priority=prio, le="+Inf") == len(waits)
    assert max(w for _, w in rec.waits) > 0  # they did wait (the blocker held the whole pool)
    assert value(after, "zp_refusals_total", error="LeaseTooLarge") == 1
    assert value(after, "zp_budget_used_blocks", budget="storm") == 0
    assert value(after, "zp_budget_waiters", budget="storm", priority="0") == 0
    assert not [k for k in after if k[0] == "zp_retries_total"]
    assert value(after, "zp_forecast_error_tokens_count") == 0  # forecasts are an elastic budget's


@pytest.mark.needs_sim
async def test_forecast_error_is_observed_minus_forecast_per_request(sim: SimServer) -> None:
    budget = Recorder(LocalBudget(limit_blocks=200, block_size=16, policy="elastic", name="elastic"))
    m = ZPMetrics(remote_status_ttl_s=0)
    observed: list[int] = []
    async with openai.AsyncOpenAI(base_url=sim.base_url, api_key="x", max_retries=0) as original:
        client = wrap(original, budget, settings=SETTINGS, metrics=m)

        async def one(i: int) -> None:
            reply = await client.chat.completions.create(model=sim.model, **ask(max_tokens=8 + 4 * i))
            assert reply.usage is not None
            observed.append(reply.usage.completion_tokens)

        with anyio.fail_after(60):
            for batch in (range(0, 3), range(3, 6)):  # the second batch is forecast from the first
                async with anyio.create_task_group() as tg:
                    for i in batch:
                        tg.start_soon(one, i)
    s = scrape(m)
    assert len(observed) == len(budget.rec.forecasts) == 6
    assert value(s, "zp_forecast_error_tokens_count") == 6
    assert value(s, "zp_forecast_error_tokens_sum") == sum(observed) - sum(budget.rec.forecasts)


def _ask_user(user: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "user": user}


@pytest.mark.slow
async def test_retries_by_reason_and_refusals_by_type_match_the_upstream_log() -> None:
    inner = LocalBudget(limit_blocks=100, name="retry")
    budget = Recorder(inner)
    m = ZPMetrics()
    caught: Counter[str] = Counter()
    with RetryUpstream() as upstream, testing():
        async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x", max_retries=0) as original:
            client = wrap(original, budget, settings=SETTINGS, max_model_len=4096, metrics=m)
            for user in ("503-a", "503-b", "429-c", "ok-d"):
                await client.chat.completions.create(**_ask_user(user))
            with pytest.raises(openai.APIStatusError):  # not retried and not a refusal: the caller's error
                await client.chat.completions.create(**_ask_user("400-e"))
            # a full budget and a 0.2 s deadline: refused in line
            blocker = await inner.acquire(100)
            with pytest.raises(AdmissionTimeout) as info:
                await client.chat.completions.create(**_ask_user("ok-f"),
                                                     extra_headers={DEADLINE_HEADER: "0.2"})
            caught[type(info.value).__name__] += 1  # wrap() raises an openai-compatible subclass of that name
            await blocker.release()
        # one retry in the whole window (ratio 0, floor 0.1/s over 10 s), on a second budget
        tight = Settings(estimator="heuristic", retry_budget_ratio=0.0, retry_budget_floor_per_s=0.1,
                         retry_budget_window_s=10.0)
        other = LocalBudget(limit_blocks=100, name="tight")
        async with openai.AsyncOpenAI(base_url=upstream.base_url, api_key="x", max_retries=0) as original:
            client = wrap(original, other, settings=tight, max_model_len=4096, metrics=m)
            await client.chat.completions.create(**_ask_user("503-g"))  # spends the one retry
            with pytest.raises(RetryBudgetExhausted):
                await client.chat.completions.create(**_ask_user("503-h"))
            caught["RetryBudgetExhausted"] += 1
        arrivals = upstream.users()
    s = scrape(m)
    # the upstream's log: a user that arrived twice was retried once, for its first answer's status
    retried = Counter(f"http_{u.split('-')[0]}" for u in arrivals if u.endswith("#2"))
    assert retried == {"http_503": 3, "http_429": 1}
    scraped = {dict(k[1])["reason"]: v for k, v in s.items() if k[0] == "zp_retries_total"}
    assert scraped == retried
    assert caught == {"AdmissionTimeout": 1, "RetryBudgetExhausted": 1}
    refusals = {dict(k[1])["error"]: v for k, v in s.items() if k[0] == "zp_refusals_total"}
    assert refusals == caught
    # every attempt that reached the upstream through the recorded budget was granted a lease first
    recorded_arrivals = [u for u in arrivals if u.split("#")[0][-1] in "abcdef"]
    assert len(budget.rec.waits) == len(recorded_arrivals)
    total = sum(v for k, v in s.items() if k[0] == "zp_queue_wait_seconds_count")
    assert total == len(arrivals)  # both budgets' attempts, one ZPMetrics
    assert value(s, "zp_budget_limit_blocks", budget="retry") == 100
    assert value(s, "zp_budget_limit_blocks", budget="tight") == 100


@pytest.mark.needs_sim
def test_the_blocking_driver_records_the_same(sim: SimServer) -> None:
    budget = Recorder(LocalBudget(limit_blocks=64, name="sync"))
    m = ZPMetrics(remote_status_ttl_s=0)
    client = wrap(openai.OpenAI(base_url=sim.base_url, api_key="x", max_retries=0), budget, settings=SETTINGS,
                  metrics=m)
    calls = 0
    for i in range(3):
        if i == 1:
            for _ in client.chat.completions.create(model=sim.model, stream=True, **ask()):
                pass
        else:
            client.chat.completions.create(model=sim.model, **ask())
        calls += 1
    client.close()
    s = scrape(m)
    assert value(s, "zp_queue_wait_seconds_count", priority="0") == calls == len(budget.rec.waits)
    assert value(s, "zp_lease_hold_seconds_count", priority="0") == len(budget.rec.holds) == calls
    assert value(s, "zp_lease_hold_seconds_sum", priority="0") <= sum(h for _, h in budget.rec.holds)


# --------------------------------------------------------------------------------------------------
# the budget gauges' reads, and the option's checks
# --------------------------------------------------------------------------------------------------


class RemoteLike(Recorder):
    """A budget that is not in-process (as a RedisBudget): counts its status reads."""

    def __init__(self, inner: LocalBudget) -> None:
        super().__init__(inner)
        self.reads = 0

    def status_sync(self) -> BudgetStatus:
        self.reads += 1
        s = self.inner.status_sync()
        return BudgetStatus(limit=s.limit, used=3, free=s.limit - 3, held=1, leases=1,
                            waiters={2: ClassStatus(waiters=4, weight=1)})


def test_a_remote_budget_is_read_at_most_once_per_ttl_or_never() -> None:
    cached, never = RemoteLike(LocalBudget(10, name="r1")), RemoteLike(LocalBudget(20, name="r2"))
    m1, m2 = ZPMetrics(remote_status_ttl_s=3600), ZPMetrics(remote_status_ttl_s=None)
    m1.track(cached)
    m2.track(never)
    for _ in range(3):
        s1, s2 = scrape(m1), scrape(m2)
    assert cached.reads == 1 and never.reads == 0
    assert value(s1, "zp_budget_used_blocks", budget="r1") == 3
    assert value(s1, "zp_budget_waiters", budget="r1", priority="2") == 4
    assert value(s2, "zp_budget_limit_blocks", budget="r2") == 20
    assert ("zp_budget_used_blocks", (("budget", "r2"),)) not in s2


def test_limit_changes_are_counted_by_direction_and_the_gauge_follows() -> None:
    budget = LocalBudget(40, name="adaptive")
    m = ZPMetrics()
    m.track(budget)
    changes = [(40, 30), (30, 20), (20, 20), (20, 25)]
    for old, new in changes:
        budget.set_limit_sync(new)
        m.limit_changed(budget, old, new)
    s = scrape(m)
    assert value(s, "zp_limit_changes_total", budget="adaptive", direction="down") == 2
    assert value(s, "zp_limit_changes_total", budget="adaptive", direction="up") == 1
    assert value(s, "zp_budget_limit_blocks", budget="adaptive") == 25


def test_metrics_are_opt_in_and_checked() -> None:
    registry = CollectorRegistry()
    m = ZPMetrics(registry, namespace="app_zp")
    assert m.registry is registry
    assert "app_zp_queue_wait_seconds" in generate_latest(registry).decode()
    with pytest.raises(ConfigurationError, match="ZPMetrics"):
        wrap(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x"), LocalBudget(10), metrics=object())
    with pytest.raises(ConfigurationError):
        ZPMetrics(remote_status_ttl_s=-1)
    plain = wrap(openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x"), LocalBudget(10))
    from zp_client._private import http_transport, sdk_http_client

    assert http_transport(sdk_http_client(plain)).core.metrics is None
