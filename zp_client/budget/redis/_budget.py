"""RedisBudget: the public class. It validates, keeps the script layer (``_script.Core``) and hands each
call to its asyncio face (one per event loop) or its blocking face. See docs/redis.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import redis.asyncio as redis_async

from zp_client._redact import check_redis_url
from zp_client._tasks import quiesce
from zp_client.budget.base import Budget, BudgetStatus, Lease, Ticket
from zp_client.budget.elastic import (
    DEFAULT_RESERVE_K,
    DEFAULT_RESERVE_Z,
    DEFAULT_URGENT_RESERVE,
    ElasticPolicy,
)
from zp_client.budget.ledger import (
    DEFAULT_LATE_BOUND_S,
    DEFAULT_LINE,
    DEFAULT_LONGEST_FIRST_S,
    DEFAULT_STARVATION_BOUND_S,
    LineName,
    validate_blocks,
    validate_line,
    validate_seconds,
)
from zp_client.budget.pins import DEFAULT_PIN_CAP_FRACTION
from zp_client.budget.predict import FAIL_FAST_KEY
from zp_client.budget.redis._async import AsyncFace, renewal_client
from zp_client.budget.redis._clients import AsyncRedisClient, SyncRedisClient
from zp_client.budget.redis._meta import text
from zp_client.budget.redis._retry import RedisRetryBudget
from zp_client.budget.redis._script import (
    CALL_FAILED,
    POLICIES,
    POOL_SIZE,
    PRIORITY_RANGE,
    Config,
    Core,
    RedisBudgetEvent,
    RedisLease,
)
from zp_client.budget.redis._snapshot import SNAPSHOT_CAP
from zp_client.budget.redis._sync import SyncFace
from zp_client.errors import AdmissionTimeout, BudgetUnavailable, ConfigurationError, PinRefused

if TYPE_CHECKING:
    from zp_client.config import Settings
    from zp_client.forecast import LengthForecaster


log = logging.getLogger("zp_client.budget.redis")
# The keyword arguments shared_forecaster passes on to a process-local LengthForecaster (its fallback).
_LOCAL_FORECASTER_KWARGS = frozenset({"q", "q_blind", "q_tail", "q_spread", "prior", "half_life", "priors",
                                      "max_keys", "censored", "cold_n"})

# Spellings removed before 1.0 (one spelling per parameter, seconds end in _s): old name -> new name.
_RENAMED = {
    "lease_ttl": "lease_ttl_s", "poll_interval": "poll_interval_s", "waiter_ttl": "waiter_ttl_s",
    "starvation_bound": "starvation_bound_s", "recovery": "recovery_s",
    "unavailable_timeout": "unavailable_timeout_s",
}


def default_waiter_ttl_s(poll_interval_s: float) -> float:
    """The default ``waiter_ttl_s``: one poll interval (a waiter's heartbeat) plus a margin for a late
    poll (half an interval, 0.25-1 s). A waiter not heartbeated for this long belongs to a dead or
    stalled process: no grant pass grants it (a live one that was only late enqueues again, same
    ticket, at its next poll)."""
    return poll_interval_s + min(1.0, max(0.25, poll_interval_s / 2))


def _renamed_error(kwargs: dict[str, object]) -> TypeError:
    """The error for keyword arguments RedisBudget() does not take, naming the new spelling if renamed."""
    parts = [f"the removed keyword argument {k!r} (now {_RENAMED[k]!r})" if k in _RENAMED
             else f"an unexpected keyword argument {k!r}" for k in kwargs]
    return TypeError(f"RedisBudget() got {', '.join(parts)}")


class RedisBudget(Budget):
    """A :class:`~zp_client.budget.base.Budget` shared through Redis by many processes on many hosts.

    ``url_or_client`` is a ``redis://`` / ``rediss://`` URL (AUTH and TLS go in the URL, e.g.
    ``rediss://:password@host:6380/0``) or a ``redis.asyncio`` client (``Redis`` or
    ``cluster.RedisCluster``). ``sync_client`` (a ``redis.Redis`` / ``redis.cluster.RedisCluster``) is
    needed for :meth:`acquire_sync` only when a client object rather than a URL was given. The clients a
    budget makes from a URL use a blocking pool of 100 connections: commands beyond it wait for one.

    Example::

        budget = RedisBudget("redis://localhost:6379/0", "llama-70b", limit_blocks=20_000)
        async with budget.lease(120, priority=0, timeout=30) as lease:
            ...                      # send the request; lease.report_held(n) as the stream grows
        with budget.lease_sync(120) as lease:   # threads, no event loop needed
            ...

    Parameters (seconds end in ``_s``, as in LocalBudget and :class:`~zp_client.Settings`): ``policy``
    (``"elastic"`` or ``"strict"``; the budget's creator chooses), ``lease_ttl_s`` (a lease not renewed
    for this long is reclaimed), ``poll_interval_s`` (the bound on a lost wake-up), ``waiter_ttl_s``
    (default ``poll_interval_s`` plus half of it, at least 0.25 s and at most 1 s: a dead process's
    waiters are granted nothing once it elapsed), ``starvation_bound_s``, ``longest_first_s``, ``line`` and
    ``late_bound_s`` (the line's rules, as in LocalBudget; the budget's creator chooses), ``recovery_s``
    (default ``lease_ttl_s``: a budget created from scratch admits nothing new for this long),
    ``on_unavailable`` with ``unavailable_timeout_s`` and ``local_share``, ``held_report_blocks``,
    ``sync_client``, ``on_event``, ``predict`` (``status()`` reports each class head's predicted wait:
    one more bounded script call and a replay in this process per ``status()`` with waiters, elastic
    only; off by default, as the adaptive limit reads ``status()`` every second. A fail-fast call is
    predicted regardless: docs/admission.md#predicted-wait-and-fail-fast), ``reserve_z`` and
    ``reserve_k`` (elastic's forecast-error reserves, as :class:`~zp_client.budget.elastic.ElasticPolicy`
    takes them, validated alike, and with its defaults, ``elastic.DEFAULT_RESERVE_Z`` and
    ``DEFAULT_RESERVE_K``; 0: off; the budget's creator chooses, a process configured otherwise follows the
    stored ones with a warning; read only under ``elastic``: ``strict`` stores and ignores them, as it
    does ``longest_first_s``; docs/elastic.md#reserves-on-redis), ``urgent_reserve`` (elastic's room
    kept for more urgent classes, ``ElasticPolicy(urgent_reserve=...)``, default
    ``elastic.DEFAULT_URGENT_RESERVE``; stored and followed like the reserves). Semantics (safety,
    recovery, wake-ups, renewal, unavailability, the elastic policy in Lua, keys): docs/redis.md.
    """

    def __init__(
        self,
        url_or_client: str | AsyncRedisClient,
        name: str,
        limit_blocks: int,
        block_size: int = 16,
        *,
        policy: str = "elastic",
        lease_ttl_s: float = 30.0,
        poll_interval_s: float = 2.0,
        waiter_ttl_s: float | None = None,
        starvation_bound_s: float = DEFAULT_STARVATION_BOUND_S,
        longest_first_s: float = DEFAULT_LONGEST_FIRST_S,
        line: LineName = DEFAULT_LINE,
        late_bound_s: float = DEFAULT_LATE_BOUND_S,
        recovery_s: float | None = None,
        on_unavailable: Literal["fail_closed", "fail_local"] = "fail_closed",
        unavailable_timeout_s: float = 10.0,
        local_share: float = 0.1,
        held_report_blocks: int | None = None,
        sync_client: SyncRedisClient | None = None,
        on_event: Callable[[RedisBudgetEvent], None] | None = None,
        pin_cap: float = DEFAULT_PIN_CAP_FRACTION,
        server_blocks: int | None = None,
        predict: bool = False,
        reserve_z: float = DEFAULT_RESERVE_Z,
        reserve_k: float = DEFAULT_RESERVE_K,
        urgent_reserve: float = DEFAULT_URGENT_RESERVE,
        **renamed: object,
    ) -> None:
        if renamed:
            raise _renamed_error(renamed)
        # elastic's forecast-error reserves, validated (and rounded to thousandths) as the policy does
        reserves = ElasticPolicy(reserve_z=reserve_z, reserve_k=reserve_k, urgent_reserve=urgent_reserve)
        if not isinstance(name, str) or not name or any(c in name for c in "{}") or len(name) > 200:
            raise ConfigurationError(
                "budget name must be a non-empty string of at most 200 characters without braces, "
                f"got {name!r}"
            )
        for what, v in (("lease_ttl_s", lease_ttl_s), ("poll_interval_s", poll_interval_s),
                        ("unavailable_timeout_s", unavailable_timeout_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0) or math.isinf(v):
                raise ConfigurationError(f"{what} must be a positive number of seconds, got {v!r}")
        if policy not in POLICIES:
            raise ConfigurationError(
                "RedisBudget policy must be 'strict' or 'elastic' (see zp_client.budget.elastic), "
                f"got {policy!r}"
            )
        if on_unavailable not in ("fail_closed", "fail_local"):
            raise ConfigurationError(
                f"on_unavailable must be 'fail_closed' or 'fail_local', got {on_unavailable!r}"
            )
        if not (0 < local_share <= 1):
            raise ConfigurationError(f"local_share must be in (0, 1], got {local_share!r}")
        if not isinstance(pin_cap, (int, float)) or not 0 <= pin_cap <= 1:
            raise ConfigurationError(f"pin_cap must be a share of the limit in [0, 1], got {pin_cap!r}")
        self._pin_cap = float(pin_cap)
        self._server_blocks = (None if server_blocks is None
                               else validate_blocks(server_blocks, "server_blocks"))
        if not isinstance(starvation_bound_s, (int, float)) or not (starvation_bound_s >= 0):
            raise ConfigurationError(f"starvation_bound_s must be seconds >= 0, got {starvation_bound_s!r}")
        poll = float(poll_interval_s)
        cfg = Config(
            name=name,
            # 0 is allowed for read-only handles (status); a budget created with it admits nothing.
            limit=validate_blocks(limit_blocks, "limit_blocks", minimum=0),
            block_size=validate_blocks(block_size, "block_size"),
            lease_ttl_s=float(lease_ttl_s),
            poll_interval_s=poll,
            waiter_ttl_s=float(waiter_ttl_s) if waiter_ttl_s is not None else default_waiter_ttl_s(poll),
            starvation_bound_s=float(starvation_bound_s),
            longest_first_s=validate_seconds(longest_first_s, "longest_first_s"),
            line=validate_line(line),
            late_bound_s=validate_seconds(late_bound_s, "late_bound_s"),
            policy=policy,
            recovery_s=float(lease_ttl_s) if recovery_s is None else float(recovery_s),
            on_unavailable=on_unavailable,
            unavailable_timeout_s=float(unavailable_timeout_s),
            local_share=float(local_share),
            held_report_blocks=None if held_report_blocks is None else max(1, int(held_report_blocks)),
            reserve_z=reserves.reserve_z,
            reserve_k=reserves.reserve_k,
            urgent_reserve=reserves.urgent_reserve,
        )
        self.name = name
        self.block_size = cfg.block_size
        if isinstance(url_or_client, str):
            check_redis_url(url_or_client)  # before redis-py's ValueError can print a piece of a password
        self.predict = bool(predict)
        """``status()`` reports predicted waits (see the class doc)."""
        self._core = Core(cfg, url_or_client if isinstance(url_or_client, str) else None)
        if on_event is not None:
            self._core.hooks.append(on_event)
        self.counters = self._core.counters
        self._given_client = None if isinstance(url_or_client, str) else url_or_client
        self._side: AsyncFace | None = None
        self._sync_face = SyncFace(self, self._core, sync_client)
        self._lock = threading.Lock()
        self._closed = False
        self._fallback: Budget | None = None
        self._forecaster: LengthForecaster | None = None
        self.created: bool | None = None
        """Set by :meth:`create`: True if it created the state, False if the budget already existed."""

    @classmethod
    async def create(
        cls, url_or_client: str | AsyncRedisClient, name: str, limit_blocks: int, block_size: int = 16,
        **kwargs: Any,
    ) -> RedisBudget:
        """Create the budget's state in Redis now, explicitly, and return the budget (use it, or
        ``aclose()`` it). Arguments as for the constructor.

        A budget whose state is absent when a process first uses it starts in recovery: it admits nothing
        new for ``recovery_s`` (one ``lease_ttl_s``), because Redis cannot tell a name never used from a
        budget whose state a restart or failover wiped while holders still run. Creating it explicitly is
        the operator's statement that no lease of it exists: the state is written with no recovery window,
        so the first request is admitted at once. Run it once when you provision a budget (a deploy
        step, ``zp-client budget create``), not at every process start: after a Redis restart it would
        skip the window that protects the survivors' leases.

        When the state already exists nothing changes (the stored limit and settings win, a recovery in
        progress goes on); :attr:`created` says which happened.
        """
        budget = cls(url_or_client, name, limit_blocks, block_size, **kwargs)
        core = budget._core
        r = await budget._get_side().eval("init", core.init_args(recovery_s=0.0), init=False)
        core.after_init(r)
        budget.created = bool(int(r[0]))
        return budget

    @classmethod
    def create_sync(
        cls, url_or_client: str | AsyncRedisClient, name: str, limit_blocks: int, block_size: int = 16,
        **kwargs: Any,
    ) -> RedisBudget:
        """Blocking form of :meth:`create` (needs a URL or ``sync_client``); ``close_sync()`` it when done."""
        budget = cls(url_or_client, name, limit_blocks, block_size, **kwargs)
        core = budget._core
        r = budget._sync_face.eval("init", core.init_args(recovery_s=0.0), init=False)
        core.after_init(r)
        budget.created = bool(int(r[0]))
        return budget

    @classmethod
    def from_settings(
        cls, url_or_client: str | AsyncRedisClient, name: str, limit_blocks: int,
        settings: Settings | None = None, **kwargs: Any,
    ) -> RedisBudget:
        """A budget using ``block_size``, ``starvation_bound_s``, ``longest_first_s``, ``line``,
        ``late_bound_s`` and ``lease_ttl_s`` from :class:`~zp_client.Settings` (explicit keyword arguments
        win)."""
        if settings is None:
            from zp_client.config import Settings

            settings = Settings()
        kwargs.setdefault("starvation_bound_s", settings.starvation_bound_s)
        kwargs.setdefault("longest_first_s", settings.longest_first_s)
        kwargs.setdefault("line", settings.line)
        kwargs.setdefault("late_bound_s", settings.late_bound_s)
        kwargs.setdefault("lease_ttl_s", settings.lease_ttl_s)
        return cls(url_or_client, name, limit_blocks, settings.block_size, **kwargs)

    @classmethod
    def from_server(
        cls,
        url_or_client: str | AsyncRedisClient,
        name: str,
        server_url: str,
        *,
        headroom: float | None = None,
        policy: str = "elastic",
        timeout_s: float = 5.0,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> RedisBudget:
        """A budget whose limit and block size come from the server at ``server_url``, read once now.

        As :meth:`LocalBudget.from_server <zp_client.LocalBudget.from_server>` (blocking; call it at
        startup): :func:`~zp_client.calibration.calibrate` reads ``/metrics`` and ``/v1/models``, and the
        result is ``RedisBudget(url_or_client, name, limit, block_size, policy=policy, **kwargs)`` with
        ``budget.calibration`` recording how. As with any RedisBudget the first process to create the
        budget sets the stored limit; a budget that already exists keeps its own (apply a new calibration
        with ``await budget.set_limit(budget.calibration.limit_blocks)``). Raises
        :class:`~zp_client.errors.CalibrationError` when the server has no usable ``/metrics``.
        """
        from zp_client.calibration import calibrate

        cal = calibrate(server_url, headroom=headroom, policy=policy, timeout_s=timeout_s, headers=headers)
        budget = cls(url_or_client, name, cal.limit_blocks, cal.block_size, policy=policy, **kwargs)
        budget.calibration = cal
        return budget

    # ------------------------------------------------------------------ public API
    @property
    def limit(self) -> int:
        """The limit last seen in Redis (the configured one until the first call)."""
        return self._core.limit

    @property
    def policy_name(self) -> str:
        """``"strict"`` or ``"elastic"`` (the stored policy once Redis was reached: the budget's creator
        chose it). Under ``strict`` the ``meta`` given to :meth:`acquire` is accepted and ignored."""
        return self._core.policy

    @property
    def reads_forecast_spread(self) -> bool:
        """Whether the policy reads the leases' upper forecasts (``forecast_hi``): ``elastic`` with a
        forecast-error reserve (``reserve_z`` or ``reserve_k`` above 0; the stored ones once Redis was
        reached). The transport sends them only then, as for LocalBudget."""
        core = self._core
        return core.policy == "elastic" and any(core.reserve)

    @property
    def config(self) -> Config:
        """The validated settings this budget was made with."""
        return self._core.cfg

    def shared_forecaster(self, **kwargs: Any) -> LengthForecaster:
        """The :class:`~zp_client.budget.redis_forecast.RedisLengthForecaster` of this budget: output
        lengths learned by every process of the fleet (made on first call; ``kwargs`` such as ``q`` or
        ``sync_interval_s`` apply then). The transport uses it by default for an elastic RedisBudget.
        Needs a URL or ``sync_client`` (it syncs from a daemon thread); closed with the budget."""
        with self._lock:
            if self._forecaster is not None:
                return self._forecaster
        try:
            if self._closed:  # nothing would close a forecaster made now, nor its thread
                raise ConfigurationError("the budget is closed")
            client = self._sync_face.get_client()
        except ConfigurationError as exc:
            from zp_client.forecast import LengthForecaster

            log.warning("zp_client: Redis budget %r forecasts from this process only: %s", self.name, exc)
            # what a local forecaster takes (max_keys too: routes come from per-call headers, so the
            # fallback stays as bounded as the shared one); the Redis-only ones (sync_interval_s...) go
            kwargs = {k: v for k, v in kwargs.items() if k in _LOCAL_FORECASTER_KWARGS}
            with self._lock:
                if self._forecaster is None:
                    self._forecaster = LengthForecaster(**kwargs)
                return self._forecaster
        from zp_client.budget.redis_forecast import RedisLengthForecaster

        with self._lock:
            if self._forecaster is None:
                self._forecaster = RedisLengthForecaster(client, self.name, **kwargs)
            return self._forecaster

    def new_retry_budget(
        self, *, ratio: float = 0.5, floor_per_s: float = 0.5, window_s: float = 20.0
    ) -> RedisRetryBudget:
        """A :class:`~zp_client.budget.redis.RedisRetryBudget` with this budget's name (so the same
        ``{zp:<name>}`` hash tag) on the same Redis: one retry budget for the whole fleet. Made from the
        budget's URL when it was given one, else on the client(s) the caller passed to it (a client the
        budget made itself may be closed by it)."""
        if self._core.url is not None:
            return RedisRetryBudget(self.name, url=self._core.url, ratio=ratio, floor_per_s=floor_per_s,
                                    window_s=window_s)
        face = self._sync_face
        sync_client = None if face.owns_client else face.client
        return RedisRetryBudget(self.name, client=sync_client, async_client=self._given_client, ratio=ratio,
                                floor_per_s=floor_per_s, window_s=window_s)

    def add_event_hook(self, hook: Callable[[RedisBudgetEvent], None]) -> None:
        """Call ``hook(event)`` for every :class:`RedisBudgetEvent` (from a background task or thread)."""
        self._core.hooks.append(hook)

    async def acquire(
        self, blocks: int, *, priority: int = 0, timeout: float | None = None, ticket: Ticket | None = None,
        held: int | None = None, meta: Mapping[str, object] | None = None,
    ) -> Lease:
        bound, held_v, prio, order, meta_json = self._validate(blocks, priority, ticket, held, meta, timeout)
        try:
            side = self._get_side()
            if timeout is None:
                return await side.acquire(bound, held_v, prio, order, meta_json)
            fail_fast = timeout if self._fail_fast(meta) else None
            args = (bound, held_v, prio, order, meta_json, fail_fast)
            return await self._acquire_within(side, args, timeout)
        except asyncio.TimeoutError as exc:
            if isinstance(exc, AdmissionTimeout):
                raise
            raise AdmissionTimeout(
                f"waited {timeout:.3g} s for {bound} KV blocks in Redis budget {self.name!r} without "
                "admission; raise the timeout, lower max_tokens, or add capacity"
            ) from None
        except BudgetUnavailable:
            if self._core.cfg.on_unavailable != "fail_local":
                raise
            return await self._local().acquire(bound, priority=prio, timeout=timeout, ticket=ticket,
                                               held=held_v, meta=meta)

    @staticmethod
    async def _acquire_within(side: AsyncFace, args: tuple[int, int, int, int, str, float | None],
                              timeout: float) -> Lease:
        """``side.acquire(*args)`` bounded by ``timeout`` (raises ``asyncio.TimeoutError``).

        Not ``asyncio.wait_for``: on Python 3.10/3.11 it returns the inner result when its caller is
        cancelled just as the inner call finishes, so a caller's ``task.cancel()`` could be lost. Here a
        caller's cancellation always raises, and a lease the abandoned acquire still returns is released.
        """
        task = asyncio.ensure_future(side.acquire(*args))
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                # it unwinds at its next await (every Redis call on its path is shielded) or was granted
                await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            side.release_when_done(task)
            raise
        if task.cancelled():
            raise asyncio.TimeoutError
        return task.result()  # a grant that landed as the timeout fired is the caller's

    def acquire_sync(
        self, blocks: int, *, priority: int = 0, timeout: float | None = None, ticket: Ticket | None = None,
        held: int | None = None, meta: Mapping[str, object] | None = None,
    ) -> Lease:
        bound, held_v, prio, order, meta_json = self._validate(blocks, priority, ticket, held, meta, timeout)
        try:
            return self._sync_face.acquire(bound, held_v, prio, order, timeout, meta_json,
                                           timeout is not None and self._fail_fast(meta))
        except BudgetUnavailable:
            if self._core.cfg.on_unavailable != "fail_local":
                raise
            return self._local().acquire_sync(bound, priority=prio, timeout=timeout, ticket=ticket,
                                              held=held_v, meta=meta)

    async def status(self) -> BudgetStatus:
        """A read-only snapshot from Redis (``extra`` holds epoch, recovery, counters). With waiters in
        line, ``predicted_wait_s`` per class from one more read-only script call (``snapshot``, bounded:
        docs/admission.md#predicted-wait-and-fail-fast)."""
        side = self._get_side()
        s = self._core.status_from(await side.eval("status", [], init=False))
        if not self._predicts(s):
            return s
        try:
            reply = await side.eval("snapshot", [SNAPSHOT_CAP], init=False, patient=False)
        except CALL_FAILED as exc:
            log.debug("zp_client: no snapshot for the status' predicted waits: %r", exc)
            return s
        return self._with_predicted(s, reply)

    def status_sync(self) -> BudgetStatus:
        """Blocking form of :meth:`status`."""
        face = self._sync_face
        s = self._core.status_from(face.eval("status", [], init=False))
        if not self._predicts(s):
            return s
        try:
            reply = face.eval("snapshot", [SNAPSHOT_CAP], init=False, patient=False)
        except CALL_FAILED as exc:
            log.debug("zp_client: no snapshot for the status' predicted waits: %r", exc)
            return s
        return self._with_predicted(s, reply)

    def _predicts(self, s: BudgetStatus) -> bool:
        """Whether a status has waiters to predict: only with ``predict=True`` and the elastic policy (under
        strict Redis keeps no lease metadata: nothing to project); a fleet never predicts, nor a budget
        recovering."""
        return (self.predict and bool(s.waiters) and self._core.fleet is None and s.policy == "elastic"
                and not s.extra.get("recovering"))

    def _with_predicted(self, s: BudgetStatus, reply: Any) -> BudgetStatus:
        heads = self._core.predicted_heads(reply)
        return s if heads is None else dataclasses.replace(s, predicted_wait_s=heads)

    async def set_limit(self, limit: int) -> None:
        """Set the limit for the whole fleet. Raising it admits waiters; lowering never revokes a lease."""
        validate_blocks(limit, "limit")
        side = self._get_side()
        r = await side.eval("set_limit", [limit, ""])
        self._core.limit = int(r[1])

    async def compare_and_set_limit(self, expected: int, limit: int, *, fence: str | None = None,
                                    keep_size: bool = False) -> bool:
        """Set the limit only if it is still ``expected``; returns False (and changes nothing) otherwise.

        ``fence``: an :class:`~zp_client.adaptive.AdaptiveLimit`'s id; the change then applies only while
        that controller holds the budget's leader lease (False otherwise), so a leader that lost its
        lease (a long pause, a partition) cannot change the limit after its successor took over.
        ``keep_size``: a temporary cut (the adaptive limit's): requests up to the size limit before it
        wait for room instead of failing with :class:`~zp_client.LeaseTooLarge` (stored as the budget's
        ``slimit``; a plain :meth:`set_limit` clears it).
        """
        validate_blocks(limit, "limit")
        validate_blocks(expected, "expected")
        side = self._get_side()
        r = await side.eval("set_limit", [limit, expected, fence or "", "1" if keep_size else ""])
        self._core.limit = int(r[1])
        return bool(int(r[0]))

    async def _adaptive(self, op: str, controller: str, ttl_ms: int = 0, overloads: int = 0,
                        fields: Mapping[str, object] | None = None) -> list[object]:
        """adaptive.lua (the adaptive limit's leader lease and state): ``op`` is ``lead``, ``note`` or
        ``resign``. Impatient: a Redis that does not answer raises :class:`BudgetUnavailable` at once (the
        controller logs it and keeps the last limit)."""
        args: list[object] = [op, controller, max(1, int(ttl_ms)), max(0, int(overloads))]
        for k, v in (fields or {}).items():
            args += [k, str(v)]
        side = self._get_side()
        r = await side.eval("adaptive", args, init=False, patient=False)
        return list(r)

    # ------------------------------------------------------------------ pinned prefixes
    @property
    def supports_pins(self) -> bool:
        return self._core.fleet is None

    async def pin(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                  span: int | None = None) -> None:
        """As :meth:`Budget.pin`, shared by every process of the budget (pin.lua, common.lua's pins
        section: the port of :mod:`zp_client.budget.pins`). The pin's blocks are one lease held by the
        first process that pins the key; this budget renews its pins with its leases, so a pin whose
        every process died expires with them (another process pinning the same key takes it over at its
        next renewal). Needs ``policy="elastic"``."""
        if not isinstance(key, str) or not key or len(key) > 256:
            raise ConfigurationError(f"a prefix key must be a string of 1..256 characters, got {key!r}")
        validate_blocks(blocks, "blocks")
        if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < blocks):
            raise ConfigurationError(f"span must be a number of blocks >= blocks ({blocks}), got {span!r}")
        if margin is not None:
            validate_blocks(margin, "margin", minimum=0)
        if self.policy_name != "elastic":
            raise ConfigurationError(
                f"pinned prefixes need policy='elastic', this budget is {self.policy_name!r}")
        core = self._core
        args: list[object] = ["pin", key, blocks, blocks if span is None else span,
                           "" if margin is None else margin, 1 if track else 0, core.owner,
                           int(core.cfg.lease_ttl_s * 1000), self._pin_cap,
                           "" if self._server_blocks is None else self._server_blocks]
        side = self._get_side()
        r = await side.eval("pin", args)
        code = text(r[0])
        if code == "R":
            raise PinRefused(blocks, int(r[1]), int(r[2]))
        if code == "E":
            raise ConfigurationError(
                f"prefix {key!r} is already pinned with {int(r[1])} blocks, not {blocks}; unpin it first")
        core.pins[key] = args

    async def unpin(self, key: str) -> bool:
        """Stop pinning ``key`` in this process; drops the pin if this process holds its lease (True)."""
        core = self._core
        if core.pins.pop(key, None) is None:
            return False
        side = self._get_side()
        return bool(int(await side.eval("pin", ["unpin", key, core.owner])))

    async def keepwarm_due(self) -> list[str]:
        side = self._get_side()
        return [text(k) for k in await side.eval("pin", ["due"])]

    async def claim_keepwarm(self, key: str, ttl_s: float) -> bool:
        side = self._get_side()
        return bool(int(await side.eval("pin", ["claim", key, max(1, int(ttl_s * 1000))])))

    async def flush(self) -> None:
        """Send every lease's latest held report now (normally batched; see ``held_report_blocks``)."""
        side = self._get_side()
        with self._sync_face.lock:
            sync_leases = list(self._sync_face.leases.values())
        await side.send_reports([*side.leases.values(), *sync_leases], changed_only=True, patient=True)

    async def aclose(self) -> None:
        """Stop what attached to it (an adaptive limit, a keep-warm sender), then its background tasks and
        threads; live leases are not released (they expire by TTL)."""
        await self._close_attached()
        self._closed = True
        side, self._side = self._side, None
        if side is not None:
            await side.aclose()
        await asyncio.to_thread(self._stop_sync)  # joins threads (bounded): not on the event loop
        shared = self._shared_retry_budget()
        if isinstance(shared, RedisRetryBudget):
            await shared.aclose()
        quiesce()  # the process-wide service threads, once nothing is left for them

    async def _loop_ending(self) -> None:
        """The running loop ends (an adaptive limit's own thread): its async face stops now, in order (its
        releases drained, its tasks cancelled and awaited, its clients closed); another loop may use the
        budget afterwards."""
        side = self._side
        if side is not None and side.loop is asyncio.get_running_loop():
            self._side = None
            await side.aclose()

    def close_sync(self) -> None:
        """Stop what attached to it that runs on a thread of its own (an adaptive limit's
        ``start_in_thread()``), then the blocking face's threads and the shared forecaster's (for programs
        without an event loop)."""
        self._close_attached_sync()
        self._closed = True
        self._stop_sync()
        shared = self._shared_retry_budget()
        if isinstance(shared, RedisRetryBudget):
            shared.close()
        quiesce()

    # ------------------------------------------------------------------ internals
    def _fail_fast(self, meta: Mapping[str, object] | None) -> bool:
        """The call opted into fail-fast (meta ``fail_fast``, set by the core from ``Settings.fail_fast``
        or ``X-ZP-Fail-Fast``); a fleet never predicts (docs/admission.md#predicted-wait-and-fail-fast)."""
        return bool(meta and meta.get(FAIL_FAST_KEY)) and self._core.fleet is None

    def _validate(
        self, blocks: int, priority: int, ticket: Ticket | None, held: int | None,
        meta: Mapping[str, object] | None, timeout: float | None = None,
    ) -> tuple[int, int, int, int, str]:
        """(bound, held, priority, ticket order, meta JSON); bad arguments fail here, before any I/O."""
        if self._closed:
            raise ConfigurationError(f"RedisBudget {self.name!r} is closed")
        bound = validate_blocks(blocks, "blocks")
        held_v = bound if held is None else validate_blocks(held, "held", minimum=0)
        if held_v > bound:
            raise ConfigurationError(f"held ({held_v}) must not exceed the lease's blocks ({bound})")
        order = -1
        if ticket is not None:
            if not isinstance(ticket, Ticket):
                raise ConfigurationError(f"ticket must be a zp_client.Ticket, got {ticket!r}")
            priority, order = ticket.priority, ticket.order
            if isinstance(order, bool) or not isinstance(order, int) or order < 0:
                raise ConfigurationError(f"ticket order must be an int >= 0, got {order!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ConfigurationError(f"priority must be an int (lower = more urgent), got {priority!r}")
        if not -PRIORITY_RANGE <= priority <= PRIORITY_RANGE:
            raise ConfigurationError(
                f"RedisBudget priorities must lie in [-{PRIORITY_RANGE}, {PRIORITY_RANGE}], got {priority}"
            )
        return bound, held_v, priority, order, self._core.meta_arg(meta, bound, timeout)

    def _local(self) -> Budget:
        core, cfg = self._core, self._core.cfg
        fallback = self._fallback
        if fallback is None:
            from zp_client.budget.local import LocalBudget  # imported late: local.py is the sibling backend

            share = max(1, int(core.limit * cfg.local_share))
            z, k = core.reserve
            policy: str | ElasticPolicy = core.policy
            if policy == "elastic":  # the stored reserves, 0 included (not ElasticPolicy's defaults)
                policy = ElasticPolicy(self.block_size, reserve_z=z, reserve_k=k, urgent_reserve=core.urgent)
            fallback = self._fallback = LocalBudget(
                share, self.block_size, starvation_bound_s=cfg.starvation_bound_s,
                name=f"{self.name}-local-fallback", policy=policy, longest_first_s=cfg.longest_first_s,
                line=validate_line(cfg.line), late_bound_s=cfg.late_bound_s)
        core.counters["fallback_local"] += 1
        if core.fallback_logged:
            return fallback
        core.fallback_logged = True
        log.error(
            "zp_client: Redis budget %r unreachable; admitting through a per-process LocalBudget of %d "
            "blocks (local_share=%.3g of %d). The fleet-wide limit is NOT enforced until Redis is back.",
            self.name, fallback.limit, cfg.local_share, core.limit,
        )
        core.emit("fallback_local", blocks=fallback.limit)
        return fallback

    def _get_side(self) -> AsyncFace:
        side = self._side
        loop = asyncio.get_running_loop()
        if side is not None:
            if side.loop is loop:
                return side
            if side.loop.is_closed():
                self._side = None
            else:
                raise ConfigurationError(
                    f"RedisBudget {self.name!r} is already used from another event loop; create one "
                    "RedisBudget per event loop (redis.asyncio clients are bound to their loop)"
                )
        if self._given_client is not None:
            self._side = AsyncFace(self, self._core, self._given_client, owns_client=False,
                                   renew_client=renewal_client(None, self._given_client))
        else:
            url = self._core.url
            if url is None:  # unreachable: a budget is given a URL or a client
                raise ConfigurationError(f"RedisBudget {self.name!r} has neither a URL nor a client")
            pool = redis_async.BlockingConnectionPool.from_url(url, max_connections=POOL_SIZE, timeout=None)
            self._side = AsyncFace(self, self._core, redis_async.Redis.from_pool(pool), owns_client=True,
                                   renew_client=renewal_client(url, None))
        return self._side

    # LeaseOwner: what a RedisLease calls back
    def _lease_dirty(self, lease: RedisLease) -> None:
        if lease.sync:
            self._sync_face.lease_dirty(lease)
        elif self._side is not None:
            self._side.lease_dirty(lease)

    async def _release_lease(self, lease: RedisLease) -> None:
        side = self._side
        if lease.sync or side is None or side.loop is not asyncio.get_running_loop():
            await asyncio.to_thread(self._release_lease_sync, lease)
            return
        await side.release(lease)

    def _release_lease_sync(self, lease: RedisLease) -> None:
        if not lease.sync and self._side is not None:
            self._side.leases.pop(lease.id, None)
        self._sync_face.release(lease)

    def _stop_sync(self) -> None:
        with self._lock:
            fc, self._forecaster = self._forecaster, None
        if fc is not None and hasattr(fc, "close"):
            fc.close()  # sends its pending observations with the sync client, before that closes
        self._sync_face.close()
