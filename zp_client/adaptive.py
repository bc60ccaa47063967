"""The adaptive limit (opt-in): a controller that lowers a budget's limit when the server shows trouble
and raises it back toward the calibrated limit when all is quiet.

    budget = LocalBudget.from_server("http://127.0.0.1:8000/v1")
    async with budget.adapt() as ctl:          # AdaptiveLimit(budget, url), started; stopped on exit
        ...                                     # use the budget as usual; ctl.changes lists what it did

Every ``poll_interval_s`` the controller reads the server's ``/metrics`` (with the header
``X-ZP-Poller: <its id>``) and the budget's status. The limit is the lower of two levels:

* the **AIMD level**, probed: **multiplicative decrease** (``x decrease_factor``, never below
  ``floor_fraction`` of the calibrated limit) when the server preempted (``vllm:num_preemptions_total``
  rose) at least ``preemption_threshold`` times within ``cooldown_s``, or when requests of the budget were
  answered 429, 503 or 529 (the admission core reports them through :meth:`Budget.note_overload
  <zp_client.budget.base.Budget.note_overload>`); then a ``cooldown_s`` follows in which these signals
  change nothing more, so one burst is counted once (the leases admitted before the decrease still run:
  lowering a limit never revokes one). **Additive increase** by ``increase_fraction`` of the calibrated
  limit per quiet poll (no new preemption, no overload answer, ``cooldown_s`` since the last decrease), up
  to the calibrated limit;
* the **bypass ceiling**, measured: the server's KV in use (``vllm:kv_cache_usage_perc x (num_gpu_blocks -
  1)``) above what the budget's live leases hold (``BudgetStatus.held_distinct``: shared prefixes counted
  once, as the server's prefix cache holds them) by more than ``bypass_margin`` of the pool is traffic
  that does not go through the budget. The ceiling is then ``calibrated - bypass - margin`` (the margin:
  bypass the measure cannot tell from held reports' lag, and no flat reserve absorbs it now that the
  calibrated limit is the whole pool; with ``calibrated - bypass`` the agentic storm at ``--bypass 0.25``
  preempted 14 times on seed 0, with the margin 3, docs/benchmark.md), the bypass being the
  largest measured over the last ``bypass_hold_s``; it follows the bypass both ways (the limit goes
  straight down to it, and back up once the hold ran out), without AIMD steps: the room is measured, not
  probed for.

Every change goes through the budget's compare-and-set (``compare_and_set_limit``: a limit someone else
changed meanwhile is left alone), is logged at INFO, is recorded in :attr:`AdaptiveLimit.changes`,
counted by :meth:`ZPMetrics.limit_changed <zp_client.metrics.ZPMetrics.limit_changed>` and shown by
the budget's status (``status().extra["adaptive"]``, ``zp-client status``).

A :class:`~zp_client.RedisBudget` is shared by a fleet of processes, each of which may run a controller:
exactly one of them, the holder of a leader lease in Redis (``SET NX PX``, renewed by a Lua
compare-and-renew every third of ``leader_ttl_s``), polls and changes the limit; when it dies another
takes over once the lease lapses, within one ``leader_ttl_s``. Its changes are fenced: they apply only
while it holds the lease. The others pass the 429/503/529 answers they saw to it through Redis. When
Redis does not answer, no controller changes anything (the last limit stays) and each logs it.

What it cannot see (docs/admission.md#the-adaptive-limit): the server between two polls and what
``/metrics`` lags behind; a server without ``/metrics`` (then only the overload answers count); bypass
traffic hidden by prefix sharing the budget does not know of (a ``RedisBudget`` reports no
``held_distinct``: its shared prefixes hide that much bypass); and preemptions caused by traffic it
cannot tell apart from its own.
Time is the budget's clock (:mod:`zp_client.clock`): the controller runs on a virtual-time loop too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zp_client._tasks import Supervisor
from zp_client.budget.base import Budget, BudgetStatus
from zp_client.calibration import server_root
from zp_client.clock import Clock
from zp_client.errors import BudgetUnavailable, ConfigurationError, ServerInfoError
from zp_client.server import ServerMetrics, parse_metrics

if TYPE_CHECKING:
    from types import TracebackType

    from zp_client.metrics import ZPMetrics

__all__ = [
    "AdaptiveLimit",
    "Decision",
    "LimitChange",
    "POLLER_HEADER",
    "OVERLOAD_STATUSES",
    "DEFAULT_POLL_INTERVAL_S",
    "DEFAULT_DECREASE_FACTOR",
    "DEFAULT_INCREASE_FRACTION",
    "DEFAULT_FLOOR_FRACTION",
    "DEFAULT_COOLDOWN_S",
    "DEFAULT_BYPASS_MARGIN",
    "DEFAULT_BYPASS_HOLD_S",
    "DEFAULT_PREEMPTION_THRESHOLD",
    "DEFAULT_LEADER_TTL_S",
    "recovery_polls",
]

logger = logging.getLogger("zp_client.adaptive")

#: The header every ``/metrics`` poll carries, valued with the controller's id (the simulator counts
#: pollers by it: ``GET /sim/pollers``).
POLLER_HEADER = "X-ZP-Poller"
#: The answers that count as overload (each one reported by the admission core).
OVERLOAD_STATUSES = frozenset({429, 503, 529})

#: Seconds between two polls of ``/metrics``: vLLM updates its gauges every engine step, so a second
#: sees a preemption burst or a bypass within about one request's prefill, at one small GET per second.
DEFAULT_POLL_INTERVAL_S = 1.0
#: A decrease keeps this share of the limit (-20%): a preemption means the pool ran out by roughly the
#: KV of the newest requests; 0.8 recovers from a 3x overestimate in 5 decreases without the halving
#: that leaves most of the pool idle after a single preemption.
DEFAULT_DECREASE_FACTOR = 0.8
#: An increase adds this share of the calibrated limit per quiet poll (from the floor back to within 5%
#: of the calibrated limit in 9 polls).
DEFAULT_INCREASE_FRACTION = 0.05
#: The limit never goes below this share of the calibrated limit.
DEFAULT_FLOOR_FRACTION = 0.5
#: After a decrease, preemptions and overload answers change nothing for this long (the leases admitted
#: before it drain in a few request lifetimes), and no increase happens.
DEFAULT_COOLDOWN_S = 5.0
#: KV use beyond the live leases' held blocks, as a share of the usable pool, that counts as bypass: held
#: reports lag the server by a block or two per stream. Less than this is not seen; it was absorbed by the
#: calibrated limit's flat reserve while that was 10% of the pool (headroom 0.90, until issue 30); with
#: the whole pool as the limit only the elastic policy's spread reserve absorbs it.
DEFAULT_BYPASS_MARGIN = 0.05
#: The bypass ceiling follows the largest bypass measured over this many seconds of polls, not the last
#: one alone: foreign traffic comes and goes between two of its requests (an agent's tool call, the next
#: turn of a conversation), and a limit raised into such a gap admits leases that the next burst then
#: preempts (lowering a limit never revokes a lease). The cooldown's length: one burst, held once.
DEFAULT_BYPASS_HOLD_S = 5.0
#: Preemptions cut the limit once at least this many were seen within ``cooldown_s`` (the polls of
#: that window, the current one included): the elastic policy's reserve against its own forecast
#: error lets a lone preemption through now and then by design, and cutting 20% of the pool for it costs
#: more than the one request's recompute; a limit that is too large (a smaller pool than calibrated)
#: preempts again within seconds.
DEFAULT_PREEMPTION_THRESHOLD = 2
#: The Redis leader lease: a dead leader's successor polls within this many seconds.
DEFAULT_LEADER_TTL_S = 5.0


def recovery_polls(*, poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                   cooldown_s: float = DEFAULT_COOLDOWN_S, floor_fraction: float = DEFAULT_FLOOR_FRACTION,
                   increase_fraction: float = DEFAULT_INCREASE_FRACTION,
                   bypass_hold_s: float = DEFAULT_BYPASS_HOLD_S, within: float = 0.05) -> int:
    """The most polls it takes the limit to return within ``within`` of the calibrated one once the
    bypass stopped (or the last preemption / overload answer), counting from the first poll whose
    ``/metrics`` no longer shows it: the rest of the cooldown after the last decrease and of the bypass
    hold (at most ``ceil(max(cooldown_s, bypass_hold_s) / poll_interval_s) - 1`` polls; they run at
    once), then at most ``ceil((1 - within - floor_fraction) / increase_fraction)`` increases from the
    floor: 13 polls with the defaults. Holds while the polls stay quiet (no new preemption or overload
    answer) and come ``poll_interval_s`` apart."""
    cool = math.ceil(max(cooldown_s, bypass_hold_s) / poll_interval_s - 1e-9)
    climb = max(0, math.ceil((1 - within - floor_fraction) / increase_fraction - 1e-9))
    return max(cool, 1) - 1 + climb


@dataclass(frozen=True)
class LimitChange:
    """One change of the limit the controller made."""

    at: float
    """When, on the controller's clock (seconds, :mod:`zp_client.clock`)."""
    old: int
    new: int
    reason: str
    """``preemption``, ``overload``, ``bypass`` (decreases; several joined by ``+``) or ``recover``."""
    detail: str = ""
    """The signals, in words (``+3 preemptions``, ``bypass 120 blocks``...)."""


@dataclass(frozen=True)
class Decision:
    """What one poll saw and did (:meth:`AdaptiveLimit.poll_once`)."""

    at: float
    leader: bool
    """False for a RedisBudget controller that does not hold the leader lease (it did nothing else)."""
    limit: int | None
    """The limit before the poll (None when the budget could not be read)."""
    new_limit: int | None
    """What the rules asked for (== ``limit`` when nothing)."""
    reason: str | None
    """The change's reason, or None."""
    applied: bool
    """The compare-and-set succeeded (False when nothing was asked, or the limit had changed meanwhile)."""
    preemptions: int = 0
    """New preemptions since the last poll."""
    overloads: int = 0
    """429/503/529 answers since the last poll (the fleet's, for a RedisBudget leader)."""
    server_used_blocks: int | None = None
    held_blocks: int | None = None
    bypass_blocks: int | None = None
    """Server KV in use beyond the live leases' held blocks (None without /metrics)."""
    ceiling: int | None = None
    """The most the limit may be now: the calibrated limit, less a bypass beyond the margin."""
    metrics_ok: bool = False
    note: str = ""

    @property
    def changed(self) -> bool:
        return self.applied and self.new_limit != self.limit


@dataclass
class _Signals:
    preemptions: int = 0
    overloads: int = 0
    server_used: int | None = None
    held: int | None = None
    bypass: int | None = None
    usable: int | None = None
    notes: list[str] = field(default_factory=list)


def _controller_id() -> str:
    host = socket.gethostname().split(".")[0][:40] or "host"
    return f"{host}:{os.getpid()}:{secrets.token_hex(3)}"


def _positive(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ConfigurationError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _fraction(value: float, what: str, *, closed: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        0 < value <= 1 if closed else 0 < value < 1)
    if not ok:
        raise ConfigurationError(f"{what} must be in (0, 1{']' if closed else ')'}, got {value!r}")
    return float(value)


def _held(st: BudgetStatus) -> int:
    """The budget's held blocks as the server counts them: shared prefixes once where the budget says."""
    return st.held if st.held_distinct is None else st.held_distinct


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class AdaptiveLimit:
    """The adaptive limit of one budget; see the module's docstring for the rules.

    ``budget``: a :class:`~zp_client.LocalBudget` or :class:`~zp_client.RedisBudget` (anything with
    ``compare_and_set_limit``). ``server_url``: the server's ``http://host:port`` or ``.../v1``.
    ``calibrated_limit``: what the limit returns to; default ``budget.calibration.limit_blocks`` (a
    budget from ``from_server``), else for a RedisBudget the calibrated limit a previous leader stored,
    else the budget's limit when the controller first reads it. ``http_client``: an ``httpx``-like async
    client to poll with (its ``get(url, headers=...)``; the storm passes one on its in-memory transport);
    default a plain ``httpx.AsyncClient`` of the controller's own. ``clock``: default ``budget.clock``.
    ``metrics``: a :class:`~zp_client.metrics.ZPMetrics` whose ``limit_changed`` each change feeds.
    ``headers`` go with every poll (``Authorization``...). Tuning, with the defaults' reasons at the
    ``DEFAULT_*`` constants: ``decrease_factor``, ``increase_fraction``, ``floor_fraction``,
    ``cooldown_s``, ``bypass_margin`` (a share of the usable pool), ``bypass_hold_s``,
    ``preemption_threshold``, ``leader_ttl_s`` (RedisBudget),
    ``timeout_s`` (one poll's HTTP timeout, for the default client). ``controller_id`` names it in
    logs, Redis and the poll header (default ``host:pid:random``); it is also its leader-lease token, so
    it must be unique per controller (two processes given the same id would both lead).

    ``async with AdaptiveLimit(...)`` / :meth:`start` and :meth:`aclose` run it as a task on the
    running loop (:meth:`start_in_thread` / :meth:`stop` on a thread of its own, for programs without
    one); :meth:`poll_once` is one poll (tests and benchmarks drive it by hand).
    """

    def __init__(
        self,
        budget: Budget,
        server_url: str,
        *,
        calibrated_limit: int | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        http_client: Any | None = None,
        clock: Clock | None = None,
        metrics: ZPMetrics | None = None,
        decrease_factor: float = DEFAULT_DECREASE_FACTOR,
        increase_fraction: float = DEFAULT_INCREASE_FRACTION,
        floor_fraction: float = DEFAULT_FLOOR_FRACTION,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        bypass_margin: float = DEFAULT_BYPASS_MARGIN,
        bypass_hold_s: float = DEFAULT_BYPASS_HOLD_S,
        preemption_threshold: int = DEFAULT_PREEMPTION_THRESHOLD,
        leader_ttl_s: float = DEFAULT_LEADER_TTL_S,
        timeout_s: float = 2.0,
        headers: Mapping[str, str] | None = None,
        controller_id: str | None = None,
    ) -> None:
        if not isinstance(budget, Budget):
            raise ConfigurationError(f"budget must be a zp_client Budget, got {type(budget).__name__}")
        if type(budget).compare_and_set_limit is Budget.compare_and_set_limit:
            raise ConfigurationError(
                f"{type(budget).__name__} has no compare_and_set_limit: the adaptive limit needs one")
        self.budget = budget
        self.server_url = server_root(server_url)
        self._metrics_url = self.server_url + "/metrics"
        if calibrated_limit is None and budget.calibration is not None:
            calibrated_limit = budget.calibration.limit_blocks
        cl = calibrated_limit
        if cl is not None and (isinstance(cl, bool) or not isinstance(cl, int) or cl < 1):
            raise ConfigurationError(f"calibrated_limit must be an int >= 1, got {calibrated_limit!r}")
        self._given_calibrated = calibrated_limit
        self._redis = hasattr(budget, "_adaptive")
        if calibrated_limit is None and not self._redis:
            calibrated_limit = budget.limit  # a RedisBudget's is known once Redis answered (poll_once)
        self._calibrated: int | None = calibrated_limit
        self.poll_interval_s = _positive(poll_interval_s, "poll_interval_s")
        self.decrease_factor = _fraction(decrease_factor, "decrease_factor")
        self.increase_fraction = _fraction(increase_fraction, "increase_fraction", closed=True)
        self.floor_fraction = _fraction(floor_fraction, "floor_fraction", closed=True)
        if isinstance(cooldown_s, bool) or not isinstance(cooldown_s, (int, float)) or not cooldown_s >= 0:
            raise ConfigurationError(f"cooldown_s must be a number of seconds >= 0, got {cooldown_s!r}")
        self.cooldown_s = float(cooldown_s)
        if isinstance(bypass_margin, bool) or not isinstance(bypass_margin, (int, float)) or not (
                0 <= bypass_margin < 1):
            raise ConfigurationError(f"bypass_margin must be in [0, 1), got {bypass_margin!r}")
        self.bypass_margin = float(bypass_margin)
        if isinstance(bypass_hold_s, bool) or not isinstance(bypass_hold_s, (int, float)) or not (
                0 <= bypass_hold_s < math.inf):
            raise ConfigurationError(f"bypass_hold_s must be a number of seconds >= 0, got {bypass_hold_s!r}")
        self.bypass_hold_s = float(bypass_hold_s)
        pt = preemption_threshold
        if isinstance(pt, bool) or not isinstance(pt, int) or pt < 1:
            raise ConfigurationError(f"preemption_threshold must be an int >= 1, got {pt!r}")
        self.preemption_threshold = pt
        self.leader_ttl_s = _positive(leader_ttl_s, "leader_ttl_s")
        self.timeout_s = _positive(timeout_s, "timeout_s")
        self.clock: Clock = clock if clock is not None else budget.clock
        self.metrics = metrics
        if controller_id is not None and (not isinstance(controller_id, str) or not controller_id.strip()):
            raise ConfigurationError(f"controller_id must be a non-empty string, got {controller_id!r}")
        self.id = controller_id or _controller_id()
        self._headers = {"accept": "text/plain", **dict(headers or {}), POLLER_HEADER: self.id}
        self._http = http_client
        self._own_http = False
        self.changes: list[LimitChange] = []
        """Every change this controller made, oldest first (the benchmark's limit plot)."""
        self.decisions: list[Decision] = []
        """The last polls' decisions (at most 1000), oldest first."""
        self._lock = threading.Lock()
        self._overloads = 0
        self._overload_statuses: dict[int, int] = {}
        self._last_preemptions: float | None = None
        self._last_decrease_at: float | None = None
        self._aimd: int | None = None  # the AIMD level (the limit is the lower of it and the bypass ceiling)
        self._expected: int | None = None  # the limit the last poll left (None: a lost compare-and-set)
        self._bypass_seen: list[tuple[float, int]] = []  # (poll time, bypass blocks) within bypass_hold_s
        self._preempt_seen: list[tuple[float, int]] = []  # (poll time, new preemptions) within cooldown_s
        self._started_at: float | None = None
        self._first_limit: int | None = None
        self._task: asyncio.Task[object] | None = None
        # owns its polling task, or the thread it runs on (start_in_thread): zp_client/_tasks.py
        self._sup = Supervisor(f"adaptive limit {self.id}")
        self._closed = False
        self.leader = not self._redis
        """True while this controller is the one that polls (always, for a LocalBudget)."""
        self.leader_id: str | None = self.id if not self._redis else None
        self._follower_wait = self.leader_ttl_s / 3
        self._polls = 0
        self._last: Decision | None = None
        self._limit_seen: int | None = None
        self._problem: dict[str, str] = {}  # what is failing now ("metrics", "budget") -> message

    # ------------------------------------------------------------------ public
    @property
    def calibrated_limit(self) -> int | None:
        """What the limit returns to when quiet (None until known: a RedisBudget's before the first poll)."""
        return self._calibrated

    @property
    def floor(self) -> int | None:
        """The lowest limit a decrease sets: ``floor_fraction`` of the calibrated limit (at least 1)."""
        cal = self._calibrated
        return None if cal is None else max(1, math.floor(cal * self.floor_fraction))

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def note_overload(self, status: int) -> None:
        """Count an overload answer (429, 503, 529; other statuses are ignored). Thread-safe and cheap:
        the budget calls it from the admission core; the next poll acts on the count."""
        if status not in OVERLOAD_STATUSES:
            return
        with self._lock:
            self._overloads += 1
            self._overload_statuses[status] = self._overload_statuses.get(status, 0) + 1

    def limit_timeline(self) -> list[tuple[float, int]]:
        """``[(at, limit), ...]``: the limit when the controller first read it, then after each change."""
        out: list[tuple[float, int]] = []
        if self._started_at is not None and self._first_limit is not None:
            out.append((self._started_at, self._first_limit))
        out += [(c.at, c.new) for c in self.changes]
        return out

    def state(self) -> dict[str, object]:
        """The controller as the budget's status shows it (``status().extra["adaptive"]``; a RedisBudget's
        status shows the fleet leader's from Redis): ids, calibrated limit and floor, the last change, the
        last poll's signals."""
        last = self.changes[-1] if self.changes else None
        d = self._last
        now = self.clock.monotonic()
        return {
            "controller": self.id, "leader": self.leader_id, "is_leader": self.leader,
            "running": self.running,
            "server": self.server_url, "calibrated": self._calibrated, "floor": self.floor,
            "limit": self._limit_seen, "poll_interval_s": self.poll_interval_s,
            "leader_ttl_s": self.leader_ttl_s if self._redis else None,
            "polls": self._polls, "changes": len(self.changes),
            "last_old": last.old if last else None, "last_new": last.new if last else None,
            "last_reason": last.reason if last else None,
            "last_change_age_s": (now - last.at) if last else None,
            "metrics": "not read" if d is None else (
                "ok" if d.metrics_ok else self._problem.get("metrics", "not read")),
            "last_preemptions": d.preemptions if d else None, "last_overloads": d.overloads if d else None,
            "last_bypass_blocks": d.bypass_blocks if d else None,
        }

    async def start(self) -> AdaptiveLimit:
        """Attach to the budget and run the polling loop as a task on the running loop (idempotent)."""
        if self._closed:
            raise ConfigurationError("this AdaptiveLimit was closed; make a new one")
        if self._task is not None:
            return self
        other = self.budget.adaptive
        if other is not None and other is not self:
            raise ConfigurationError(
                f"budget {getattr(self.budget, 'name', self.budget)!r} already has an adaptive limit "
                f"({other.id}) in this process: one controller per budget")
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
            self._own_http = True
        self.budget.adaptive = self
        self.budget.add_overload_listener(self.note_overload)
        # the budget's aclose() stops it first (its close_sync() too, when it runs on a thread of its own)
        self.budget._attach(self._close_with_budget, sync=self._close_with_budget_sync)
        if self.metrics is not None:
            self.metrics.track(self.budget)  # its limit gauge shows the changes, front end or not
        self._task = self._sup.spawn(self._run(), name=f"zp-adaptive-{self.id}")
        logger.info("adaptive limit %s started on budget %s (server %s, every %g s)", self.id,
                    getattr(self.budget, "name", "?"), self.server_url, self.poll_interval_s)
        return self

    async def aclose(self) -> None:
        """Stop polling, give up the leader lease (a RedisBudget's successor then takes over at once) and
        detach from the budget. The limit stays as it is; on a LocalBudget the size limit its cuts kept
        goes (a request larger than the limit fails again, see ``compare_and_set_limit(keep_size=)``).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._task = None
        await self._sup.stop_tasks(wait_s=5.0)  # the polling task: cancelled and awaited (bounded)
        if self.budget.adaptive is self:
            self.budget.adaptive = None
        self.budget.remove_overload_listener(self.note_overload)
        self.budget._detach(self._close_with_budget)
        if not self._redis:
            # Nobody will raise a limit it lowered now: the size limit its cuts kept (keep_size) follows
            # the limit again, so a request larger than the limit fails at once instead of waiting for
            # nothing. (A RedisBudget keeps it: another process's controller may take over.)
            with contextlib.suppress(Exception):
                cur = self.budget.limit
                await self.budget.compare_and_set_limit(cur, cur)
        if self._redis and self.leader and not getattr(self.budget, "_closed", False):
            try:
                await asyncio.wait_for(self.budget._adaptive("resign", self.id), 2.0)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - best effort: the lease lapses by itself
                logger.info("adaptive limit %s: could not resign the leader lease (%s); it lapses in %g s",
                            self.id, exc, self.leader_ttl_s)
            self.leader = False
        if self._own_http and self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.aclose()
            self._http = None

    async def _close_with_budget(self) -> None:
        """Its budget is closing: stop as :meth:`aclose` (or :meth:`stop`, when it runs on a thread of its
        own); a controller running on another event loop is left to its owner."""
        if self._thread is not None:
            await asyncio.to_thread(self.stop)
        elif self._task is None or self._task.get_loop() is asyncio.get_running_loop():
            await self.aclose()

    def _close_with_budget_sync(self) -> None:
        """Its budget's ``close_sync()``: stop a controller on a thread of its own (:meth:`stop`); one on
        an event loop is left to its owner (a blocking close cannot await it)."""
        if self._thread is not None:
            self.stop()

    def start_in_thread(self) -> AdaptiveLimit:
        """Run the controller on a daemon thread with an event loop of its own, for programs without one
        (threads calling ``acquire_sync`` / sync openai clients); returns once it started. :meth:`stop`
        ends it. The controller's clock must not be a :class:`~zp_client.clock.LoopClock` of another
        loop, and a RedisBudget run this way must not be used from another event loop (its async calls
        are bound to the controller's)."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stop_event = asyncio.Event()
            try:
                await self.start()
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread, which re-raises it
                failure.append(exc)
                ready.set()
                return
            ready.set()
            try:
                await self._stop_event.wait()
            finally:
                await self.aclose()
                # the loop ends with this thread: the budget's work on it (a RedisBudget's async face,
                # made by the polls) stops now, in order, rather than die pending with the loop
                await self.budget._loop_ending()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._thread_loop = loop
            try:
                loop.run_until_complete(main())
            finally:
                loop.close()

        self._thread = self._sup.thread(run, name=f"zp-adaptive-{self.id}", stop=self._signal_stop)
        if self._thread is None:
            raise ConfigurationError("this AdaptiveLimit was closed; make a new one")
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        """Stop a controller started with :meth:`start_in_thread` (as :meth:`aclose`; waits for the
        thread). Idempotent."""
        if self._thread is None:
            return
        self._sup.close_threads(wait_s=30.0)  # _signal_stop(), then the join
        self._thread = None

    def _signal_stop(self) -> None:
        loop, event = self._thread_loop, self._stop_event
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)

    _thread: threading.Thread | None = None
    _thread_loop: asyncio.AbstractEventLoop | None = None
    _stop_event: asyncio.Event | None = None

    async def __aenter__(self) -> AdaptiveLimit:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def poll_once(self) -> Decision:
        """One poll: (RedisBudget) take or renew the leader lease, and if this controller leads, read
        ``/metrics`` and the budget, apply the rules and change the limit by compare-and-set. Never raises
        for an unreachable server or Redis (the decision's ``note`` says what failed; the limit stays)."""
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
            self._own_http = True
        now = self.clock.monotonic()
        fleet_overloads = 0
        if self._redis:
            try:
                fleet_overloads = await self._elect()
            except Exception as exc:  # noqa: BLE001 - Redis down: keep the last limit, say so
                down = isinstance(exc, BudgetUnavailable)
                what = "Redis did not answer" if down else "the leader lease failed"
                self._fail("budget", f"{what} ({exc}); the limit stays as it is")
                self.leader = False
                self._follower_wait = self.leader_ttl_s / 3
                return self._record(Decision(now, False, None, None, None, False,
                                             note=self._problem["budget"]))
            if not self.leader:
                return self._record(Decision(now, False, None, None, None, False,
                                             note=f"follower of {self.leader_id}"))
        try:
            st1 = await self.budget.status()
        except Exception as exc:  # noqa: BLE001 - a budget that cannot answer changes nothing
            self._fail("budget", f"budget status failed ({exc}); the limit stays as it is")
            return self._record(Decision(now, self.leader, None, None, None, False,
                                         note=self._problem["budget"]))
        self._ok("budget")
        sig = _Signals()
        m = await self._read_metrics(sig)
        st2 = st1
        if m is not None:
            with contextlib.suppress(Exception):
                st2 = await self.budget.status()
        with self._lock:
            sig.overloads, self._overloads = self._overloads + fleet_overloads, 0
            statuses, self._overload_statuses = self._overload_statuses, {}
        cur = st2.limit
        self._limit_seen = cur
        if self._calibrated is None:
            self._calibrated = cur
        if self._first_limit is None:
            self._started_at, self._first_limit = now, cur
        if m is not None:
            self._measure(m, st1, st2, sig)
        new, reason, ceiling = self._rule(cur, now, sig)
        detail = self._detail(sig, statuses)
        applied = False
        note = "; ".join(sig.notes)
        if new != cur and reason is not None:
            applied = await self._apply(cur, new, reason, detail, now)
            if not applied:
                note = "; ".join([*sig.notes,
                                  "the limit changed meanwhile (compare-and-set lost): left alone"])
        self._expected = new if applied else (cur if new == cur else None)
        if self._redis:
            await self._note_state(sig, m is not None)
        return self._record(Decision(
            now, True, cur, new, reason, applied, sig.preemptions, sig.overloads, sig.server_used, sig.held,
            sig.bypass, ceiling, m is not None, note))

    # ------------------------------------------------------------------ the rules
    def _rule(self, cur: int, now: float, sig: _Signals) -> tuple[int, str | None, int]:
        """(new limit, reason, ceiling) from this poll's signals: the AIMD rules of the module docstring."""
        cal = self._calibrated if self._calibrated is not None else cur
        floor = self.floor or 1
        ceiling = cal
        bypassing = False
        held_bypass = self._held_bypass(now, sig.bypass)
        if held_bypass is not None and sig.usable is not None:
            margin = math.ceil(self.bypass_margin * sig.usable)
            if held_bypass > margin:
                bypassing = True
                # less the margin too: the bypass it hides is room the leases do not have (the calibrated
                # limit is the whole usable pool, ELASTIC_HEADROOM 1.0, with no flat share to absorb it)
                ceiling = max(floor, cal - held_bypass - margin)
        cooling = self._last_decrease_at is not None and now - self._last_decrease_at < self.cooldown_s
        recent = [(t, n) for t, n in self._preempt_seen if now - t < self.cooldown_s]
        if sig.preemptions > 0:
            recent.append((now, sig.preemptions))
        self._preempt_seen = recent
        preempting = sig.preemptions > 0 and sum(n for _, n in recent) >= self.preemption_threshold
        # Two levels, the limit the lower: the AIMD level (probed: preemptions and overload answers cut it,
        # quiet polls add to it) and the bypass ceiling (measured: it follows the bypass both ways).
        # it starts from the limit it finds, and from one someone else set meanwhile (left alone: it goes on
        # from there)
        aimd = cur if self._aimd is None or self._expected != cur else self._aimd
        reasons: list[str] = []
        if not cooling and (preempting or sig.overloads > 0) and min(cur, aimd) > floor:
            aimd = max(floor, math.floor(min(cur, aimd) * self.decrease_factor))
            if preempting:
                reasons.append("preemption")
            if sig.overloads > 0:
                reasons.append("overload")
        elif sig.preemptions == 0 and sig.overloads == 0 and not cooling and aimd < cal:
            aimd = min(cal, aimd + max(1, math.ceil(self.increase_fraction * cal)))
        self._aimd = aimd
        # a limit above the calibrated one (set by someone else) is lowered by a bypass only
        new = max(floor, min(aimd, ceiling if bypassing else max(cal, aimd)))
        if new < cur:
            if bypassing and ceiling < aimd:
                reasons.append("bypass")
            return new, "+".join(reasons) or "bypass", ceiling
        if new > cur:
            return new, "recover", ceiling
        return cur, None, ceiling

    def _held_bypass(self, now: float, bypass: int | None) -> int | None:
        """The largest bypass measured over the last ``bypass_hold_s`` (this poll's included), or None
        when this poll measured none (no /metrics: no bypass rule)."""
        if bypass is None:
            self._bypass_seen = []
            return None
        seen = [(t, b) for t, b in self._bypass_seen if now - t < self.bypass_hold_s]
        seen.append((now, bypass))
        self._bypass_seen = seen
        return max(b for _, b in seen)

    def _measure(self, m: ServerMetrics, st1: BudgetStatus, st2: BudgetStatus, sig: _Signals) -> None:
        p = m.num_preemptions_total
        if p is not None:
            last = self._last_preemptions
            if last is not None and p >= last:
                sig.preemptions = int(p - last)
            elif last is not None:
                sig.notes.append("the preemption counter went back (server restarted?): new baseline")
            self._last_preemptions = p
        else:
            sig.notes.append("no vllm:num_preemptions_total in /metrics")
        n = m.num_gpu_blocks
        if n is None and self.budget.calibration is not None:
            n = self.budget.calibration.num_gpu_blocks
        if m.kv_cache_usage_perc is None or n is None or n < 2:
            sig.notes.append("no KV usage or pool size in /metrics: bypass not measured")
            return
        sig.usable = n - 1
        sig.server_used = round(m.kv_cache_usage_perc * (n - 1))
        # before and after the scrape: a lease released in between was counted by the server, one granted
        # in between may not be yet; the larger of the two never mistakes the budget's own KV for bypass
        # shared prefixes counted once (held_distinct), as the server's prefix cache holds them: the sum of
        # the leases' held counts a preamble shared by k of them k times and hides that much bypass
        sig.held = max(_held(st1), _held(st2))
        sig.bypass = max(0, sig.server_used - sig.held)

    @staticmethod
    def _detail(sig: _Signals, statuses: Mapping[int, int]) -> str:
        parts = []
        if sig.preemptions:
            parts.append(f"+{sig.preemptions} preemptions")
        if sig.overloads:
            by = ", ".join(f"{n}x {s}" for s, n in sorted(statuses.items()))
            parts.append(f"{sig.overloads} overload answers" + (f" ({by})" if by else ""))
        if sig.bypass is not None:
            parts.append(f"server KV {sig.server_used} blocks, leases hold {sig.held}, bypass {sig.bypass}")
        return "; ".join(parts)

    async def _apply(self, cur: int, new: int, reason: str, detail: str, now: float) -> bool:
        b = self.budget
        try:
            if self._redis:
                ok = await b.compare_and_set_limit(cur, new, fence=self.id,  # type: ignore[call-arg]
                                                   keep_size=True)
            else:
                ok = await b.compare_and_set_limit(cur, new, keep_size=True)
        except Exception as exc:  # noqa: BLE001 - keep the last limit
            self._fail("budget", f"compare-and-set failed ({exc}); the limit stays as it is")
            return False
        if not ok:
            logger.info("adaptive limit %s: budget %s's limit is no longer %d; %s left alone", self.id,
                        getattr(b, "name", "?"), cur, reason)
            return False
        self.changes.append(LimitChange(now, cur, new, reason, detail))
        if new < cur:
            self._last_decrease_at = now
        self._limit_seen = new
        logger.info("adaptive limit %s: budget %s limit %d -> %d blocks (%s%s)", self.id,
                    getattr(b, "name", "?"), cur, new, reason, f": {detail}" if detail else "")
        if self.metrics is not None:
            self.metrics.limit_changed(b, cur, new)
        return True

    # ------------------------------------------------------------------ I/O
    async def _read_metrics(self, sig: _Signals) -> ServerMetrics | None:
        http = self._http
        assert http is not None
        try:
            r = await http.get(self._metrics_url, headers=self._headers)
            if r.status_code != 200:
                raise ServerInfoError("GET /metrics", r.status_code, _text(r.content)[:200])
            m = parse_metrics(_text(r.content))
        except Exception as exc:  # noqa: BLE001 - a server without /metrics: only overloads count
            self._fail("metrics", f"GET {self._metrics_url} failed ({exc}); acting on overload answers only")
            sig.notes.append(self._problem["metrics"])
            return None
        self._ok("metrics")
        return m

    async def _elect(self) -> int:
        """Take or renew the leader lease; returns the fleet's overload answers when leading."""
        with self._lock:
            mine = self._overloads
        fields = {"server": self.server_url, "poll_interval_s": self.poll_interval_s,
                  "leader_ttl_ms": int(self.leader_ttl_s * 1000)}
        r = await self.budget._adaptive(  # type: ignore[attr-defined]
            "lead", self.id, int(self.leader_ttl_s * 1000), mine, fields)
        with self._lock:
            self._overloads -= mine  # handed to Redis (leader: counted in the reply)
        self._ok("budget")
        if int(r[0]) == 1:
            if not self.leader:
                logger.info("adaptive limit %s leads budget %s%s", self.id, getattr(self.budget, "name", "?"),
                            " (took the lease)" if int(r[2]) else "")
                self._became_leader(_text(r[4]), _text(r[5]), _text(r[6]) if len(r) > 6 else "")
            self.leader, self.leader_id = True, self.id
            return int(r[3])
        holder = _text(r[2])
        if self.leader:
            logger.warning("adaptive limit %s lost the leader lease of budget %s to %s", self.id,
                           getattr(self.budget, "name", "?"), holder)
        self.leader, self.leader_id = False, holder
        pttl = int(r[1])
        # wake just after the holder's lease would lapse (a renewal pushes it back; we look again then)
        self._follower_wait = min(self.leader_ttl_s / 3, pttl / 1000 + 0.02) if pttl >= 0 else 0.02
        return 0

    def _became_leader(self, preemptions: str, calibrated: str, since_decrease_ms: str = "") -> None:
        # the previous leader's preemption counter: preemptions during the takeover still count (and a
        # counter of our own from an earlier tenure is stale)
        self._last_preemptions = None
        with contextlib.suppress(ValueError):
            self._last_preemptions = float(preemptions)
        # the previous leader's cooldown: the burst it cut for is not cut for again
        with contextlib.suppress(ValueError):
            at = self.clock.monotonic() - float(since_decrease_ms) / 1000
            if self._last_decrease_at is None or at > self._last_decrease_at:
                self._last_decrease_at = at
        if self._given_calibrated is None and self._calibrated is None and calibrated:
            with contextlib.suppress(ValueError):
                self._calibrated = int(calibrated)

    async def _note_state(self, sig: _Signals, metrics_ok: bool) -> None:
        last = self.changes[-1] if self.changes else None
        fields: dict[str, object] = {
            "calibrated": self._calibrated, "floor": self.floor, "limit": self._limit_seen,
            "polls": self._polls + 1,
            "metrics": "ok" if metrics_ok else self._problem.get("metrics", "not read"),
            "last_preemptions": sig.preemptions, "last_overloads": sig.overloads,
            "last_bypass_blocks": "" if sig.bypass is None else sig.bypass,
            "changes": len(self.changes),
        }
        if self._last_preemptions is not None:
            fields["preemptions"] = int(self._last_preemptions)
        if last is not None and self._noted_changes != len(self.changes):
            fields.update({"last_old": last.old, "last_new": last.new, "last_reason": last.reason,
                           "last_change_ms": "@now"})
            if last.new < last.old:
                fields["last_decrease_ms"] = "@now"  # a successor inherits the cooldown
        try:
            await self.budget._adaptive("note", self.id, 0, 0, fields)  # type: ignore[attr-defined]
            self._noted_changes = len(self.changes)
        except Exception as exc:  # noqa: BLE001 - the state is informational
            logger.debug("adaptive limit %s: state not written (%s)", self.id, exc)

    _noted_changes = 0

    async def _run(self) -> None:
        clock = self.clock
        next_poll = clock.monotonic()
        renew_every = self.leader_ttl_s / 3
        while True:
            now = clock.monotonic()
            try:
                if now >= next_poll or not self.leader:
                    was_leader = self.leader
                    d = await self.poll_once()
                    if d.leader or was_leader:
                        next_poll = now + self.poll_interval_s
                elif self._redis:
                    # a renewal between polls: the fleet's overload answers it collected (Redis hands
                    # them over once) count at the next poll
                    fleet = await self._elect()
                    if fleet:
                        with self._lock:
                            self._overloads += fleet
            except asyncio.CancelledError:
                raise
            except BudgetUnavailable as exc:  # Redis down during a renewal: said once, as in a poll
                self._fail("budget", f"Redis did not answer ({exc}); the limit stays as it is")
                self.leader = False
                self._follower_wait = self.leader_ttl_s / 3
            except Exception:  # noqa: BLE001 - the loop must outlive any one poll
                logger.exception("adaptive limit %s: poll failed", self.id)
                next_poll = now + self.poll_interval_s
            now = clock.monotonic()
            wait = next_poll - now
            if self._redis:
                wait = min(wait, renew_every) if self.leader else self._follower_wait
            await clock.sleep(max(0.0, wait))

    def _record(self, d: Decision) -> Decision:
        if d.leader:
            self._polls += 1
        self._last = d
        self.decisions.append(d)
        if len(self.decisions) > 1000:
            del self.decisions[:100]
        return d

    def _fail(self, what: str, message: str) -> None:
        if what not in self._problem:
            logger.warning("adaptive limit %s: %s", self.id, message)
        else:
            logger.debug("adaptive limit %s: %s", self.id, message)
        self._problem[what] = message

    def _ok(self, what: str) -> None:
        if self._problem.pop(what, None) is not None:
            logger.info("adaptive limit %s: %s answers again", self.id, "the server's /metrics"
                        if what == "metrics" else "the budget")

    def __repr__(self) -> str:
        return (f"<AdaptiveLimit {self.id} budget={getattr(self.budget, 'name', '?')} leader={self.leader} "
                f"calibrated={self._calibrated} changes={len(self.changes)}>")
