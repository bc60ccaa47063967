"""The adaptive limit (zp_client.adaptive): its AIMD rules against a scripted /metrics source and the
simulator, LocalBudget's compare-and-set, the controller's lifecycle, status and metrics.

The Redis leader election (three processes, a SIGKILLed leader) is in tests/estimate/test_adaptive_redis.py.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from zp_client import LocalBudget
from zp_client.adaptive import (
    POLLER_HEADER,
    AdaptiveLimit,
    Decision,
    recovery_polls,
)
from zp_client.errors import ConfigurationError, LeaseTooLarge
from zp_client.metrics import ZPMetrics
from zp_client.status_cli import format_status, local_budget_status

N_BLOCKS = 1001  # 1000 usable
CAL = 950  # floor(1000 x 0.95)


class Clock:
    """A clock the test moves by hand (poll_once is driven directly)."""

    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.t += max(0.0, seconds)

    def sleep_sync(self, seconds: float) -> None:
        self.t += max(0.0, seconds)


class FakeServer:
    """A scripted vLLM /metrics: KV blocks in use and the preemption counter, set by the test."""

    def __init__(self, num_gpu_blocks: int = N_BLOCKS) -> None:
        self.n = num_gpu_blocks
        self.used_blocks = 0
        self.preemptions = 0
        self.status = 200
        self.pollers: list[str | None] = []
        self.on_scrape: Any = None

    def text(self) -> str:
        usage = self.used_blocks / (self.n - 1)
        return (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
            "# TYPE vllm:num_preemptions counter\n"
            f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {float(self.preemptions)}\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{self.n}"}} 1.0\n'
        )

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        self.pollers.append(request.headers.get(POLLER_HEADER))
        if self.on_scrape is not None:
            self.on_scrape()
        if self.status != 200:
            return httpx.Response(self.status, text="Not Found")
        return httpx.Response(200, text=self.text())

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def _controller(budget: LocalBudget, server: FakeServer, clock: Clock, **kw: Any) -> AdaptiveLimit:
    return AdaptiveLimit(budget, "http://vllm.test:8000/v1", calibrated_limit=CAL,
                         http_client=server.client(), clock=clock, **kw)


async def _poll(ctl: AdaptiveLimit, clock: Clock, dt: float = 1.0) -> Decision:
    clock.t += dt
    return await ctl.poll_once()


# ------------------------------------------------------------------------------------------ compare-and-set


def test_local_compare_and_set_applies_only_to_the_expected_limit() -> None:
    b = LocalBudget(100)
    assert b.compare_and_set_limit_sync(100, 80) is True
    assert b.limit == 80
    assert b.compare_and_set_limit_sync(100, 60) is False  # stale expectation: nothing changes
    assert b.limit == 80
    assert asyncio.run(b.compare_and_set_limit(80, 120)) is True
    assert b.limit == 120
    with pytest.raises(ConfigurationError):
        b.compare_and_set_limit_sync(120, 0)


def test_local_compare_and_set_never_revokes_and_fails_waiters_too_large_for_the_new_limit() -> None:
    async def main() -> None:
        b = LocalBudget(100, policy="strict")
        held = await b.acquire(70)
        big = asyncio.ensure_future(b.acquire(60))
        small = asyncio.ensure_future(b.acquire(40))  # 70 + 40 > 100: waits
        await asyncio.sleep(0)
        assert b.compare_and_set_limit_sync(100, 50) is True
        await asyncio.sleep(0)
        with pytest.raises(LeaseTooLarge):
            await big  # 60 > 50: could never be admitted
        assert not held.released  # the live lease stays, above the new limit
        st = await b.status()
        assert (st.limit, st.used, st.leases) == (50, 70, 1)
        assert not small.done()  # admission pauses until enough is released
        await held.release()
        lease = await asyncio.wait_for(small, 5)
        assert lease.bound == 40
        assert await b.compare_and_set_limit(50, 100) is True
        await lease.release()

    asyncio.run(main())


def test_local_compare_and_set_from_racing_threads_lets_exactly_one_win() -> None:
    b = LocalBudget(1000)
    start = threading.Barrier(8)
    wins: list[int] = []

    def racer(i: int) -> None:
        start.wait()
        if b.compare_and_set_limit_sync(1000, 900 - i):
            wins.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert b.limit == 900 - wins[0]


# ------------------------------------------------------------------------------------------ the AIMD rules


def test_a_preemption_cuts_the_limit_once_per_cooldown_and_quiet_polls_add_it_back() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock)
        d = await _poll(ctl, clock)
        assert (d.limit, d.new_limit, d.reason, d.preemptions) == (CAL, CAL, None, 0)  # the baseline
        srv.preemptions = 3
        d = await _poll(ctl, clock)
        assert (d.new_limit, d.reason, d.preemptions, d.applied) == (760, "preemption", 3, True)
        assert budget.limit == 760
        for more in (9, 20, 21):  # the same burst goes on within the cooldown: counted once
            srv.preemptions = more
            d = await _poll(ctl, clock)
            assert d.preemptions > 0 and d.reason is None and budget.limit == 760
        limits = []
        for _ in range(6):  # quiet, and the cooldown is over: +48 a poll (5% of 950) up to 950
            d = await _poll(ctl, clock)
            limits.append(budget.limit)
        assert limits == [760, 808, 856, 904, 950, 950]  # the first quiet poll is still 5 s after the cut
        assert [c.reason for c in ctl.changes] == ["preemption", "recover", "recover", "recover", "recover"]
        assert [(c.old, c.new) for c in ctl.changes][:2] == [(950, 760), (760, 808)]
        assert ctl.limit_timeline()[0][1] == CAL and ctl.limit_timeline()[-1][1] == CAL
        await ctl.aclose()

    asyncio.run(main())


def test_decreases_stop_at_the_floor() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock, cooldown_s=0, preemption_threshold=1)
        await _poll(ctl, clock)
        seen = []
        for i in range(1, 9):
            srv.preemptions = i
            await _poll(ctl, clock)
            seen.append(budget.limit)
        assert ctl.floor == 475
        assert seen == [760, 608, 486, 475, 475, 475, 475, 475]
        await ctl.aclose()

    asyncio.run(main())


def test_overload_answers_cut_the_limit_and_a_server_without_metrics_still_gets_aimd() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        srv.status = 404  # not vLLM: no /metrics
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock)
        d = await _poll(ctl, clock)
        assert not d.metrics_ok and d.reason is None and "acting on overload answers only" in d.note
        for status in (200, 400, 500, 504):
            ctl.note_overload(status)  # not overload answers
        d = await _poll(ctl, clock)
        assert d.overloads == 0 and d.reason is None
        ctl.note_overload(429)
        ctl.note_overload(529)
        ctl.note_overload(503)
        d = await _poll(ctl, clock)
        assert (d.overloads, d.reason, budget.limit) == (3, "overload", 760)
        assert "1x 429" in ctl.changes[-1].detail and "1x 529" in ctl.changes[-1].detail
        clock.t += 5
        d = await _poll(ctl, clock)
        assert (d.reason, budget.limit) == ("recover", 808)
        await ctl.aclose()

    asyncio.run(main())


def test_the_budget_reports_overload_answers_to_its_started_controller_only() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock, poll_interval_s=3600)
        budget.note_overload(429)  # nobody attached yet: nothing to tell
        async with ctl:
            for _ in range(20):
                await asyncio.sleep(0)
            assert budget.adaptive is ctl and ctl.decisions  # the loop polled once, then sleeps an hour
            budget.note_overload(503)
            budget.note_overload(503)
            d = await _poll(ctl, clock)
            assert (d.overloads, d.reason) == (2, "overload")
        assert budget.adaptive is None
        budget.note_overload(429)  # detached: no longer counted
        assert ctl._overloads == 0

    asyncio.run(main())


def test_bypass_traffic_lowers_the_limit_to_the_room_it_leaves_and_the_limit_returns_when_it_stops() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock, policy="strict")
        ctl = _controller(budget, srv, clock)
        ours = [await budget.acquire(100), await budget.acquire(80)]  # the budget's own: 180 held
        srv.used_blocks = 180 + 40  # 40 beyond the leases: within the 5% margin (50 blocks)
        d = await _poll(ctl, clock)
        assert (d.held_blocks, d.bypass_blocks, d.reason) == (180, 40, None)
        srv.used_blocks = 180 + 300  # 300 blocks of traffic that does not go through the budget
        got = []
        for _ in range(4):
            d = await _poll(ctl, clock)
            got.append((budget.limit, d.reason, d.ceiling))
        # straight down to calibrated - bypass - margin (the room is measured; the margin is bypass the
        # measure cannot tell from the lag of held reports), and no further while it stays
        assert got == [(600, "bypass", 600), (600, None, 600), (600, None, 600), (600, None, 600)]
        for _ in range(10):
            await _poll(ctl, clock)
        assert budget.limit == 600  # a steady bypass does not ratchet the limit down to the floor
        for lease in ours:
            await lease.release()
        srv.used_blocks = 0  # the bypass stopped
        polls = 0
        while budget.limit < 0.95 * CAL:
            await _poll(ctl, clock)
            polls += 1
            assert polls <= recovery_polls()
        # the bypass is held for 5 s (4 more polls at 600), then the ceiling is gone and the limit is back
        # at the AIMD level, which no preemption lowered: the calibrated limit, in one step
        assert polls == 4 + 1
        assert budget.limit == CAL
        assert [c.reason for c in ctl.changes] == ["bypass", "recover"]
        await ctl.aclose()

    asyncio.run(main())


def test_the_stated_recovery_bound_holds_from_the_floor_right_after_a_decrease() -> None:
    """The worst case of recovery_polls(): preemptions during the bypass cut the AIMD level to the floor,
    the last cut right before the bypass ends."""

    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock)
        await _poll(ctl, clock)
        srv.used_blocks = 300  # a bypass: the ceiling is 950 - 300 - 50 = 600
        while ctl.changes == [] or budget.limit > ctl.floor:
            srv.preemptions += 2  # and the server preempts at every poll
            await _poll(ctl, clock)
        assert budget.limit == 475 and ctl.changes[-1].reason == "preemption"
        srv.used_blocks = 0  # the bypass and the preemptions end right after the cut to the floor
        polls = 0
        while budget.limit < 0.95 * CAL:
            await _poll(ctl, clock)
            polls += 1
        assert recovery_polls() == 13
        assert polls == 13  # 4 polls still in the cooldown and the hold (5 s), then 475 -> 907 in 9 steps

    asyncio.run(main())


def test_a_bypass_alone_is_over_once_its_hold_runs_out() -> None:
    """Without a preemption or overload answer the AIMD level stays at the calibrated limit: once the
    bypass is gone (and held for bypass_hold_s) the limit is back in one step."""

    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock)
        await _poll(ctl, clock)
        srv.used_blocks = 900  # 90% of the pool: the ceiling is the floor
        d = await _poll(ctl, clock)
        assert (d.reason, budget.limit) == ("bypass", 475)
        srv.used_blocks = 0
        polls = 0
        while budget.limit < 0.95 * CAL:
            await _poll(ctl, clock)
            polls += 1
        assert (polls, budget.limit) == (5, CAL)  # ceil(bypass_hold_s / poll_interval_s) polls

    asyncio.run(main())


def test_a_preamble_the_leases_share_is_counted_once_as_the_server_holds_it() -> None:
    """Leases that share a prefix (an agent's system prompt) each report it in their held blocks; the
    server's prefix cache holds it once. The bypass estimate compares the server's KV with the budget's
    held blocks counted the server's way (``held_distinct``), so it is neither hidden by the sharing
    (10 leases x 125 shared blocks would hide 1,125 blocks of bypass) nor mistaken for it."""

    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)  # elastic: it counts shared prefixes once
        ctl = _controller(budget, srv, clock)
        meta = {"prompt_tokens": 2400, "forecast_tokens": 200, "streaming": True, "prefix_key": "agent",
                "prefix_blocks": 125, "first_token": True}
        leases = [await budget.acquire(180, held=150, meta=meta) for _ in range(4)]
        st = await budget.status()
        assert (st.held, st.held_distinct) == (600, 600 - 3 * 125)
        srv.used_blocks = 225  # what the server holds for them: the preamble once, 25 blocks each
        d = await _poll(ctl, clock)
        assert (d.held_blocks, d.bypass_blocks, d.reason) == (225, 0, None)
        srv.used_blocks = 225 + 300  # and 300 blocks of traffic the budget does not see
        d = await _poll(ctl, clock)
        assert (d.bypass_blocks, d.reason, budget.limit) == (300, "bypass", 600)
        for lease in leases:
            await lease.release()
        strict = LocalBudget(CAL, clock=clock, policy="strict")
        lease = await strict.acquire(180, held=150, meta=meta)
        assert (await strict.status()).held_distinct == 150  # strict knows no prefixes: held as reported
        await lease.release()
        await ctl.aclose()

    asyncio.run(main())


def test_a_bypass_that_pauses_for_a_poll_does_not_let_the_limit_up_until_the_hold_runs_out() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock, policy="strict")
        ctl = _controller(budget, srv, clock, cooldown_s=0)
        await _poll(ctl, clock)
        srv.used_blocks = 300
        d = await _poll(ctl, clock)
        assert (d.reason, budget.limit) == ("bypass", 600)
        srv.used_blocks = 0  # the foreign client between two of its requests
        got = []
        for _ in range(6):
            d = await _poll(ctl, clock)
            got.append((budget.limit, d.ceiling))
        # held for bypass_hold_s (5 s: the polls at +1..+4 s still see 300), then back at once
        assert got == [(600, 600), (600, 600), (600, 600), (600, 600), (950, 950), (950, 950)]
        ctl0 = _controller(LocalBudget(CAL, clock=clock), srv, clock, cooldown_s=0, bypass_hold_s=0)
        srv.used_blocks = 300
        await _poll(ctl0, clock)
        srv.used_blocks = 0
        d = await _poll(ctl0, clock)
        assert (d.ceiling, d.reason) == (950, "recover")  # without the hold: the last poll alone

    asyncio.run(main())


def test_a_lone_preemption_changes_nothing_and_a_second_within_the_cooldown_cuts() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock)
        await _poll(ctl, clock)
        srv.preemptions = 1
        d = await _poll(ctl, clock)
        assert (d.preemptions, d.reason, budget.limit) == (1, None, CAL)
        for _ in range(5):  # 5 s later the first one is out of the window: another lone one, nothing
            d = await _poll(ctl, clock)
        srv.preemptions = 2
        d = await _poll(ctl, clock)
        assert (d.preemptions, d.reason, budget.limit) == (1, None, CAL)
        clock.t += 2
        srv.preemptions = 3  # within cooldown_s of the last: two in the window
        d = await _poll(ctl, clock)
        assert (d.reason, budget.limit) == ("preemption", 760)

    asyncio.run(main())


def test_a_request_the_calibrated_limit_admits_waits_out_a_lowered_limit_instead_of_failing() -> None:
    """While a controller runs, a lease larger than the limit it lowered but within the calibrated limit
    waits for the limit to come back (without a controller, LeaseTooLarge at once, as before)."""

    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock, policy="strict")
        ctl = _controller(budget, srv, clock, poll_interval_s=3600)
        async with ctl:
            await asyncio.sleep(0)
            srv.used_blocks = 400  # a bypass of 400: the ceiling is 950 - 400 - 50 = 500
            await _poll(ctl, clock)
            assert budget.limit == 500
            big = asyncio.ensure_future(budget.acquire(700))  # 700 > 500, <= 950: waits
            await asyncio.sleep(0)
            assert not big.done()
            with pytest.raises(LeaseTooLarge):
                await budget.acquire(951)  # more than the calibrated limit: could never be admitted
            srv.used_blocks = 0
            for _ in range(5):
                await _poll(ctl, clock)
            assert budget.limit == CAL
            lease = await asyncio.wait_for(big, 5)
            assert lease.bound == 700
            await lease.release()
            await _poll(ctl, clock)
            srv.used_blocks = 400
            await _poll(ctl, clock)
            assert budget.limit == 500
        with pytest.raises(LeaseTooLarge):
            await budget.acquire(700)  # the controller is gone: the limit is the limit again

    asyncio.run(main())


class RacyBudget(LocalBudget):
    """A LocalBudget whose limit someone else sets right after the controller's n-th status read."""

    race: tuple[int, int] | None = None  # (reads to go, the limit to set)

    async def status(self) -> Any:
        s = self.status_sync()
        if self.race is not None:
            n, limit = self.race
            self.race = (n - 1, limit) if n > 1 else None
            if n == 1:
                self.set_limit_sync(limit)
        return s


def test_a_limit_changed_meanwhile_is_left_alone() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = RacyBudget(CAL, clock=clock)
        ctl = _controller(budget, srv, clock)
        await _poll(ctl, clock)
        srv.preemptions = 5
        budget.race = (1, 900)  # an operator, between the first read and the scrape
        d = await _poll(ctl, clock)
        assert d.limit == 900 and d.new_limit == 720 and d.applied  # decided from the latest read
        srv.preemptions = 10
        clock.t += 10
        budget.race = (2, 800)  # ... between the last read and the compare-and-set
        d = await _poll(ctl, clock)
        assert d.limit == 720 and d.new_limit == 576 and not d.applied
        assert budget.limit == 800 and "compare-and-set lost" in d.note
        assert [(c.old, c.new) for c in ctl.changes] == [(900, 720)]
        await ctl.aclose()

    asyncio.run(main())


def test_changes_feed_metrics_and_show_in_the_budget_status() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock, name="adaptive-local")
        m = ZPMetrics()
        ctl = _controller(budget, srv, clock, metrics=m, poll_interval_s=3600)
        async with ctl:
            await asyncio.sleep(0)
            srv.preemptions = 2
            await _poll(ctl, clock)
            st = budget.status_sync().extra["adaptive"]
            assert isinstance(st, dict)
            assert (st["calibrated"], st["floor"], st["last_old"], st["last_new"], st["last_reason"]) == (
                CAL, 475, CAL, 760, "preemption")
            assert st["leader"] == ctl.id and st["is_leader"] and st["running"] and st["metrics"] == "ok"
            text = format_status({"budget": local_budget_status(budget)})
            assert "budget 'adaptive-local' (in this process)" in text
            assert f"adaptive limit:   leader {ctl.id}; calibrated 950, floor 475" in text
            assert "last change:      950 -> 760 blocks (preemption) 0.0 s ago; 1 changes" in text
            assert "last poll:        /metrics ok; +2 preemptions, 0 overload answers, bypass 0 blocks" \
                in text
            limit = m.registry.get_sample_value("zp_budget_limit_blocks", {"budget": "adaptive-local"})
            assert limit == 760
        assert m.registry.get_sample_value(
            "zp_limit_changes_total", {"budget": "adaptive-local", "direction": "down"}) == 1
        assert all(p == ctl.id for p in srv.pollers)  # every poll says who polls
        assert "adaptive" not in budget.status_sync().extra  # detached on close

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ lifecycle


def test_one_controller_per_budget_and_a_closed_controller_does_not_restart() -> None:
    async def main() -> None:
        clock, srv = Clock(), FakeServer()
        budget = LocalBudget(CAL, clock=clock)
        a = _controller(budget, srv, clock, poll_interval_s=3600)
        b = _controller(budget, srv, clock, poll_interval_s=3600)
        async with a:
            with pytest.raises(ConfigurationError, match="one controller per budget"):
                await b.start()
        async with b:
            assert budget.adaptive is b
        with pytest.raises(ConfigurationError):
            await a.start()

    asyncio.run(main())


def test_aclose_and_cancellation_stop_the_loop_and_detach() -> None:
    async def main() -> None:
        srv = FakeServer()
        budget = LocalBudget(CAL)
        ctl = AdaptiveLimit(budget, "http://vllm.test:8000", calibrated_limit=CAL, http_client=srv.client(),
                            poll_interval_s=0.01)
        await ctl.start()
        await ctl.start()  # idempotent
        while len(srv.pollers) < 3:
            await asyncio.sleep(0.01)
        task = ctl._task
        assert task is not None and ctl.running
        await ctl.aclose()
        await ctl.aclose()  # idempotent
        assert task.done() and not ctl.running and budget.adaptive is None
        n = len(srv.pollers)
        await asyncio.sleep(0.05)
        assert len(srv.pollers) == n  # no poll after aclose

        # cancelling the task that runs `async with` closes the controller too
        ctl2 = AdaptiveLimit(budget, "http://vllm.test:8000", calibrated_limit=CAL, http_client=srv.client(),
                             poll_interval_s=0.01)

        async def user() -> None:
            async with ctl2:
                await asyncio.sleep(3600)

        t = asyncio.ensure_future(user())
        while budget.adaptive is not ctl2:
            await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert budget.adaptive is None and not ctl2.running

    asyncio.run(main())


def test_bad_arguments_fail_fast() -> None:
    budget = LocalBudget(CAL)
    for kw in ({"poll_interval_s": 0}, {"decrease_factor": 1.0}, {"floor_fraction": 0},
               {"increase_fraction": 2}, {"cooldown_s": -1}, {"bypass_margin": 1.0}, {"calibrated_limit": 0},
               {"bypass_hold_s": -1}, {"preemption_threshold": 0}, {"preemption_threshold": 1.5}):
        with pytest.raises(ConfigurationError):
            AdaptiveLimit(budget, "http://h:8000", **kw)
    with pytest.raises(ConfigurationError):
        AdaptiveLimit(budget, "h:8000")
    with pytest.raises(ConfigurationError, match="needs the server's URL"):
        budget.adapt()
    assert budget.adapt("http://h:8000/v1").server_url == "http://h:8000"


# ------------------------------------------------------------------------------------------ the simulator


@pytest.mark.needs_sim
def test_on_the_simulator_in_virtual_time_a_bypass_is_tracked_and_the_limit_returns_in_bound() -> None:
    """Traffic sent straight to the simulator (not through the budget) holds its KV; the controller,
    polling the simulator's /metrics on the virtual clock, lowers the limit to the room that leaves and
    raises it back once that traffic ends. The simulator counts one poller, this controller."""
    from zp_client.clock import LoopClock
    from zp_client.testing import MemoryTransport, run_virtual
    from zp_sim.server import SimServer

    poll, cooldown = 0.5, 2.0
    cal = 486  # floor(511 x 0.95)

    async def bypass(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "sim-llama", "prompt": [7 + i] * 1200, "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                pass

    async def main() -> tuple[AdaptiveLimit, dict[str, Any], int, list[int]]:
        server = SimServer(profile="tiny")
        async with server.in_memory():
            http = httpx.AsyncClient(transport=MemoryTransport(server.app), base_url=server.url)
            budget = LocalBudget(cal, clock=LoopClock())
            ctl = AdaptiveLimit(budget, server.url, calibrated_limit=cal, http_client=http,
                                poll_interval_s=poll, cooldown_s=cooldown, bypass_hold_s=cooldown)
            async with ctl:
                await asyncio.sleep(2.0)  # quiet: nothing changes
                assert budget.limit == cal and not ctl.changes
                await asyncio.gather(bypass(http, 0), bypass(http, 1))  # ~6 virtual s, 150 -> 338 blocks
                during = [d.new_limit for d in ctl.decisions if d.new_limit is not None]
                ended = len(ctl.decisions)
                while budget.limit < 0.95 * cal:
                    await asyncio.sleep(poll)
                polls = len(ctl.decisions) - ended
            await http.aclose()
            return ctl, server.pollers(), polls, during

    ctl, pollers, polls, during = run_virtual(main())
    bypass_seen = max(d.bypass_blocks or 0 for d in ctl.decisions)
    assert bypass_seen > 300  # two streams of 1,200 + up to 1,500 tokens: 338 blocks at the end
    assert ctl.floor == 243
    assert min(during) == max(ctl.floor, cal - bypass_seen) == 243  # the room left, never below the floor
    assert {c.reason for c in ctl.changes} == {"bypass", "recover"}
    # every poll that saw the limit above the room the bypass left moved it down toward it, not past it
    above = [d for d in ctl.decisions
             if d.limit is not None and d.ceiling is not None and d.limit > d.ceiling]
    assert len(above) >= 2
    for d in above:
        assert d.new_limit is not None and d.ceiling <= d.new_limit < d.limit and d.reason == "bypass"
    assert 1 <= polls <= recovery_polls(poll_interval_s=poll, cooldown_s=cooldown, bypass_hold_s=cooldown)
    # the judge: one poller, this controller, one scrape per poll
    assert list(pollers["pollers"]) == [ctl.id]
    assert pollers["pollers"][ctl.id]["polls"] == pollers["scrapes"] == len(ctl.decisions)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.openai_compat
def test_the_admission_core_reports_overload_answers_to_the_budget() -> None:
    import openai
    from _retry_upstream import RetryUpstream

    from zp_client import Settings, wrap

    async def main(url: str) -> AdaptiveLimit:
        srv = FakeServer()
        budget = LocalBudget(100)
        ctl = AdaptiveLimit(budget, "http://vllm.test:8000", http_client=srv.client(), poll_interval_s=3600)
        async with ctl, openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as original:
            client = wrap(original, budget, settings=Settings(estimator="heuristic"), max_model_len=4096)
            for user in ("429-a", "529-b", "503-c", "ok-d"):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, user=user)
            with pytest.raises(openai.APIStatusError):
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, user="400-e")
            return ctl

    with RetryUpstream() as upstream:
        ctl = asyncio.run(main(upstream.base_url))
    assert ctl._overloads == 3 and ctl._overload_statuses == {429: 1, 503: 1, 529: 1}


@pytest.mark.needs_sim
@pytest.mark.slow
@pytest.mark.openai_compat
def test_on_the_simulator_preemptions_under_an_oversized_limit_cut_it_and_own_traffic_is_not_bypass() -> None:
    """A limit three times the pool (a wrong calibration): the server preempts, the controller cuts the
    limit; the budget's own streams, reported as they grow, never read as bypass."""
    import openai

    from zp_client import wrap
    from zp_client.clock import LoopClock
    from zp_client.testing import MemoryTransport, memory_transport, run_virtual
    from zp_sim.server import SimServer

    cal = 1500  # the pool has 511 usable blocks

    async def main() -> tuple[AdaptiveLimit, int]:
        server = SimServer(profile="tiny")
        async with server.in_memory():
            http = httpx.AsyncClient(transport=MemoryTransport(server.app), base_url=server.url)
            budget = LocalBudget(cal, clock=LoopClock())
            client = wrap(openai.AsyncOpenAI(
                base_url="http://sim.memory/v1", api_key="x",
                http_client=openai.DefaultAsyncHttpxClient(transport=memory_transport(server.app))), budget)
            ctl = AdaptiveLimit(budget, server.url, http_client=http, poll_interval_s=0.5, cooldown_s=2.0)

            async def ask(i: int) -> None:
                stream = await client.chat.completions.create(
                    model="sim-llama",
                    messages=[{"role": "user", "content": f"task {i}: " + "plan it " * 60}],
                    max_tokens=1200, stream=True, extra_body={"sim_output_tokens": 1000})
                async for _ in stream:
                    pass

            async with ctl:
                await asyncio.gather(*(ask(i) for i in range(12)))
            await client.close()
            await http.aclose()
            return ctl, int(server.stats()["engine"]["preemptions_total"])

    ctl, preempted = run_virtual(main())
    assert preempted > 0
    assert ctl.calibrated_limit == cal and ctl.changes
    assert ctl.changes[0].reason == "preemption" and ctl.changes[0].new == 1200
    assert all(c.new >= ctl.floor == 750 for c in ctl.changes)
    assert {c.reason for c in ctl.changes} <= {"preemption", "recover"}  # never "bypass": all of it is ours
    seen = [d.preemptions for d in ctl.decisions]
    assert sum(seen) == preempted  # every preemption was seen, once
    print(f"{preempted} preemptions; changes: {[(c.old, c.new, c.reason) for c in ctl.changes]}")


@pytest.mark.needs_sim
def test_budget_adapt_on_a_calibrated_budget_polls_its_server_over_loopback() -> None:
    from zp_sim.server import SimServer

    with SimServer(num_gpu_blocks=513) as sim:
        budget = LocalBudget.from_server(sim.base_url)
        ctl = budget.adapt(poll_interval_s=0.05)
        # floor(512 x 1.0): the elastic policy's default headroom, the whole usable pool
        assert ctl.server_url == sim.url and ctl.calibrated_limit == budget.calibration.limit_blocks == 512

        async def main() -> None:
            async with ctl:
                while len(ctl.decisions) < 3:
                    await asyncio.sleep(0.02)

        asyncio.run(main())
        pollers = sim.pollers()["pollers"]
    assert list(pollers) == [ctl.id] and pollers[ctl.id]["polls"] >= 3
    assert all(d.metrics_ok and d.reason is None for d in ctl.decisions)  # an idle server: nothing to do
    assert budget.limit == 512


def test_a_controller_on_its_own_thread_serves_a_program_without_an_event_loop() -> None:
    srv = FakeServer()
    budget = LocalBudget(CAL)
    ctl = AdaptiveLimit(budget, "http://vllm.test:8000", http_client=srv.client(), poll_interval_s=0.01,
                        cooldown_s=3600)  # no increase after the cut: the limit stays where it put it
    ctl.start_in_thread()
    assert budget.adaptive is ctl
    with budget.lease_sync(10):
        pass
    budget.note_overload(429)  # from this thread, as the sync driver would
    while not ctl.changes:
        threading.Event().wait(0.01)
    ctl.stop()
    ctl.stop()  # idempotent
    assert not ctl.running and budget.adaptive is None
    assert ctl.changes[0].reason == "overload" and budget.limit == 760
