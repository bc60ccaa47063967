"""RedisBudget: one KV-block budget shared by many processes on many hosts, through Redis.

The semantics are those of :class:`~zp_client.budget.ledger.Ledger` (and of
:class:`~zp_client.budget.local.LocalBudget`): one fair line (priority class, then ticket order), the
``strict`` policy (sum of live bounds <= limit) or the ``elastic`` one (projected peak <= limit; see
:mod:`zp_client.budget.elastic`; with ``longest_first_s`` its walk tries young waiters longest forecast first),
bounded backfill with the starvation bound, limit changes that never
revoke. The ledger's rules are ported to Lua (``budget/lua/*.lua``, one job per
script, sharing ``common.lua``); every decision is one atomic script call, timed by Redis ``TIME``.

Example::

    budget = RedisBudget("redis://localhost:6379/0", "llama-70b", limit_blocks=20_000)
    async with budget.lease(120, priority=0, timeout=30) as lease:
        ...                      # send the request; lease.report_held(n) as the stream grows
    with budget.lease_sync(120) as lease:   # threads, no event loop needed
        ...

What callers may rely on:

* **Safety** — under ``strict`` the sum of live leases' bounds never exceeds the limit, across every
  process sharing the budget (admission is a single Lua script). A Redis that lost its state starts in
  *recovery*: for one lease TTL it admits nothing new while surviving holders re-adopt their leases.
* **Idempotent acquire** — each attempt carries an unguessable request id; a call retried after a lost
  reply finds its lease or its place in line.
* **Wake-ups** — a release runs a grant pass and pushes the admitted ids to the waiting processes'
  mailbox lists (``BLPOP``, one blocked connection per process, not per waiter); a lost wake-up costs at
  most ``poll_interval``, and the same poll heartbeats the process's waiters so dead waiters leave.
* **Leases** — renewed in batches every ``lease_ttl / 3`` by a background task (an event-loop task for
  ``acquire``, a daemon thread for ``acquire_sync``). A holder that dies stops renewing and its blocks
  return after ``lease_ttl`` (reaped by the next script call, at the latest one ``poll_interval`` later
  while anyone waits). A renewal that finds its lease gone because Redis lost it (the budget's *epoch*
  changed) re-adopts it (event ``"readopted"``); a lease that expired in the current epoch is reported
  lost (event ``"lease_lost"``, ``lease.lost`` becomes True) and is not re-adopted.
* **Release** never raises; if Redis cannot be reached it is retried in the background until the lease
  would have expired anyway.
* **Unavailable Redis** — ``on_unavailable="fail_closed"`` (default) retries for ``unavailable_timeout``
  seconds and then raises :class:`~zp_client.BudgetUnavailable`; it never admits without Redis.
  ``"fail_local"`` falls back to a per-process :class:`LocalBudget` holding ``local_share`` of the limit,
  logged at ERROR level.
* **Limit** — the first process to create the budget sets its limit; a process configured with another
  value logs a warning and follows the stored one. :meth:`set_limit` / :meth:`compare_and_set_limit`
  change it.

* **Elastic** (``policy="elastic"``, the default; ``policy="strict"`` reserves every lease's bound) — ``acquire(..., meta=...)`` stores the lease's metadata in Redis
  (compactly: prompt_tokens, tokens, forecast_tokens, streaming, prefix_key, prefix_blocks,
  first_token; other keys are ignored). ``lease.report_progress(held, **fields)`` /
  ``lease.update_meta(**fields)`` travel on the batched held reports: held growth once it moved by
  ``held_report_blocks`` (default 1 block under elastic, 2 under strict), any metadata other than ``tokens`` at once; when waiters exist the report
  runs a grant pass and the admitted waiters are woken through their mailboxes. The projected-peak rule
  runs in Lua with exactly ElasticPolicy's semantics (tests/test_redis_elastic.py checks it against the
  Python ledger); a grant pass costs O(n log n) in the n live leases plus O(n) per waiter examined, and
  above 4,096 live leases falls back to the strict rule (conservative). A renewal that re-adopts a lease
  Redis lost restores its metadata. The budget's creator chooses the policy; a process configured
  otherwise logs a warning and follows the stored one. :meth:`RedisBudget.shared_forecaster` is the
  fleet's output-length forecaster (:mod:`zp_client.budget.redis_forecast`).

Keys: everything lives under the hash tag ``{zp:<name>}`` (one Cluster slot). Priorities must lie in
``[-4096, 4096]`` (they are packed into a sorted-set score).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import redis as redis_sync
import redis.asyncio as redis_async
from redis.exceptions import AuthenticationError, AuthorizationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from zp_client.budget.base import Budget, BudgetStatus, ClassStatus, Lease, Ticket
from zp_client.budget.ledger import (
    DEFAULT_LONGEST_FIRST_S,
    DEFAULT_STARVATION_BOUND_S,
    validate_blocks,
    validate_seconds,
)
from zp_client.errors import AdmissionTimeout, BudgetUnavailable, ConfigurationError, LeaseTooLarge

__all__ = ["RedisBudget", "RedisLease", "RedisBudgetEvent"]

log = logging.getLogger("zp_client.budget.redis")

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# A full connection pool is back-pressure, not an outage (MaxConnectionsError subclasses ConnectionError,
# so it is caught first): the command waits for a connection, without the outage log or its deadline.
_POOL_FULL = MaxConnectionsError
_POOL_FULL_BACKOFF_CAP_S = 0.05
# The pools of the clients a budget makes itself: commands beyond them wait for a free connection.
_POOL_SIZE = 100
_PRIORITY_RANGE = 4096
_SCRIPTS = ("init", "acquire", "release", "renew", "poll", "held", "set_limit", "status")
_KEY_SUFFIXES = ("meta", "leases", "lexp", "line", "wait", "wexp", "cls")
_RENEW_BATCH = 200
_MAILBOX_BLOCK_S = 30.0  # BLPOP timeout; wake-ups end it at once, the poller covers lost ones
_SYNC_PUMP_BLOCK_S = 5.0  # the sync pump's BLPOP timeout (each sync waiter also polls every poll_interval)
_POLICIES = ("strict", "elastic")
# Lease metadata the elastic policy reads (zp_client.budget.elastic), stored compactly in Redis.
_META_KEYS = {
    "prompt_tokens": "pt", "tokens": "tk", "forecast_tokens": "ft", "streaming": "st",
    "prefix_key": "pk", "prefix_blocks": "pb", "first_token": "f1",
}
_META_FLAGS = ("st", "f1")


def _compact_meta(meta: Mapping[str, Any], *, update: bool) -> dict[str, Any]:
    """The policy-relevant part of ``meta`` with short keys (see ``lua/common.lua``).

    Flags keep Python truthiness (``streaming=None`` reads as not streamed, as in ElasticPolicy). In an
    update, ``None`` removes a field. Raises :class:`ConfigurationError` for a negative or non-integer
    count or an over-long prefix key (the Lua scripts refuse them too).
    """
    out: dict[str, Any] = {}
    for k, v in meta.items():
        short = _META_KEYS.get(k)
        if short is None:
            continue
        if short in _META_FLAGS:
            out[short] = 1 if v else 0
        elif v is None:
            if update:
                out[short] = None
        elif short == "pk":
            key = str(v)
            if len(key) > 256:
                raise ConfigurationError(f"meta prefix_key must be at most 256 characters, got {len(key)}")
            out[short] = key
        else:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v > 1e12:
                raise ConfigurationError(f"meta {k} must be a number of tokens/blocks in [0, 1e12], got {v!r}")
            out[short] = int(v)
    return out


def _meta_json(compact: Mapping[str, Any]) -> str:
    return json.dumps(compact, separators=(",", ":")) if compact else ""


def _load_scripts() -> dict[str, tuple[str, str]]:
    pkg = resources.files("zp_client.budget") / "lua"
    common = (pkg / "common.lua").read_text(encoding="utf-8")
    out: dict[str, tuple[str, str]] = {}
    for name in _SCRIPTS:
        text = common + "\n" + (pkg / f"{name}.lua").read_text(encoding="utf-8")
        out[name] = (text, hashlib.sha1(text.encode()).hexdigest())
    return out


_SCRIPT_CACHE: dict[str, tuple[str, str]] | None = None


def _scripts() -> dict[str, tuple[str, str]]:
    global _SCRIPT_CACHE
    if _SCRIPT_CACHE is None:
        _SCRIPT_CACHE = _load_scripts()
    return _SCRIPT_CACHE


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@dataclass(frozen=True)
class RedisBudgetEvent:
    """Something a RedisBudget wants its operator to know (passed to ``on_event`` hooks).

    ``kind`` is one of ``"readopted"`` (a lease Redis lost was counted again), ``"lease_lost"`` (a
    lease expired while its holder ran), ``"unavailable"`` / ``"available"`` (Redis went away / came
    back), ``"fallback_local"`` (``fail_local`` admitted locally), ``"limit_mismatch"`` (the stored limit
    differs from the configured one), ``"created"`` (this process created the budget's state; recovery
    runs for ``detail["recovery_s"]``).
    """

    kind: str
    lease_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


class RedisLease(Lease):
    """A lease held in a :class:`RedisBudget`. Release is idempotent and never raises."""

    def __init__(
        self, budget: RedisBudget, lease_id: str, bound: int, held: int, ticket: Ticket, epoch: str, sync: bool
    ) -> None:
        self.id = lease_id
        self.bound = bound
        self.priority = ticket.priority
        self.ticket = ticket
        self.epoch = epoch
        self._budget = budget
        self._held = held
        self._sent_held = held
        self._released = False
        self._lost = False
        self._sync = sync
        self._meta_pending: dict[str, Any] = {}  # elastic: compact meta fields not yet sent
        self._meta_all: dict[str, Any] = {}  # elastic: the whole compact meta, for re-adoption

    @property
    def held(self) -> int:
        return self._held

    @property
    def released(self) -> bool:
        return self._released

    @property
    def lost(self) -> bool:
        """True once a renewal found the lease expired in the current epoch (see ``"lease_lost"``)."""
        return self._lost

    def report_held(self, blocks: int) -> None:
        self.report_progress(blocks)

    def update_meta(self, **fields: Any) -> None:
        """Record progress metadata (``first_token``, a re-forecast ``forecast_tokens``...). Under
        ``elastic`` it is sent at once (batched with other leases' reports) and the grant pass it triggers
        may admit waiters; under ``strict`` it is ignored."""
        self.report_progress(None, **fields)

    def report_progress(self, held: int | None = None, **fields: Any) -> None:
        """Occupancy and metadata in one report. Held growth is sent once it moved by
        ``held_report_blocks`` (the next renewal carries smaller moves); a metadata change other than
        ``tokens`` is sent at once; ``tokens`` travels with the next report. Never raises."""
        if self._released:
            return
        urgent = False
        if held is not None:
            try:
                value = min(max(int(held), 0), self.bound)
            except (TypeError, ValueError):
                value = self._held
            self._held = value
            urgent = abs(value - self._sent_held) >= self._budget._held_report_blocks
        if fields and self._budget._policy == "elastic":
            try:
                compact = _compact_meta(fields, update=True)
            except ConfigurationError as exc:
                log.warning("zp_client: ignored progress metadata on lease %s...: %s", self.id[:8], exc)
                compact = {}
            if compact:
                self._meta_pending.update(compact)
                for k, v in compact.items():
                    if v is None:
                        self._meta_all.pop(k, None)
                    else:
                        self._meta_all[k] = v
                urgent = urgent or any(k != "tk" for k in compact)
        if urgent:
            self._budget._held_dirty(self)

    def _take_report(self) -> tuple[int, str, dict[str, Any]]:
        """(held, meta JSON, the meta taken) for a held.lua triple; the meta is cleared until sent."""
        pending, self._meta_pending = self._meta_pending, {}
        return self._held, _meta_json(pending), pending

    def _report_failed(self, pending: dict[str, Any]) -> None:
        # Keep newer fields that arrived meanwhile; resend the rest with the next report.
        for k, v in pending.items():
            self._meta_pending.setdefault(k, v)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        await self._budget._release_lease(self)

    def release_sync(self) -> None:
        if self._released:
            return
        self._released = True
        self._budget._release_lease_sync(self)

    def __repr__(self) -> str:
        return f"RedisLease(id={self.id[:8]}..., bound={self.bound}, held={self._held}, ticket={self.ticket})"


class _Waiter:
    __slots__ = ("id", "fut", "order")

    def __init__(self, rid: str, fut: asyncio.Future[str], order: int) -> None:
        self.id = rid
        self.fut = fut
        self.order = order


class _SyncWaiter:
    __slots__ = ("event", "too_large")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.too_large = False


class _AsyncSide:
    """State bound to the event loop RedisBudget is used from (redis.asyncio clients are loop-bound)."""

    def __init__(self, budget: RedisBudget, client: Any, owns_client: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.client = client
        self.owns_client = owns_client
        self.waiters: dict[str, _Waiter] = {}
        self.leases: dict[str, RedisLease] = {}
        self.dirty: set[str] = set()
        self.retry_releases: dict[str, float] = {}  # lease id -> give up at (monotonic)
        self.poll_at = math.inf  # an earlier poll wanted (recovery ends), monotonic seconds
        self.waiters_changed = asyncio.Event()
        self.poll_hint = asyncio.Event()
        self.dirty_event = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False
        self.background: set[asyncio.Task[Any]] = set()  # strong refs to fire-and-forget releases
        self.closing = False  # aclose has begun
        self.budget = budget

    def start(self) -> None:
        if not self.tasks:
            b = self.budget
            self.tasks = [
                self.loop.create_task(b._pump(self), name="zp-redis-pump"),
                self.loop.create_task(b._poller(self), name="zp-redis-poller"),
                self.loop.create_task(b._keeper(self), name="zp-redis-keeper"),
                self.loop.create_task(b._held_flusher(self), name="zp-redis-held"),
            ]


class RedisBudget(Budget):
    """A :class:`~zp_client.budget.base.Budget` shared through Redis; see the module docstring.

    ``url_or_client`` is a ``redis://`` / ``rediss://`` URL (AUTH and TLS go in the URL, e.g.
    ``rediss://:password@host:6380/0``) or a ``redis.asyncio`` client (``Redis`` or
    ``cluster.RedisCluster``). ``sync_client`` (a ``redis.Redis`` / ``redis.cluster.RedisCluster``) is
    needed for :meth:`acquire_sync` only when a client object rather than a URL was given.
    """

    def __init__(
        self,
        url_or_client: str | Any,
        name: str,
        limit_blocks: int,
        block_size: int = 16,
        *,
        lease_ttl: float = 30.0,
        poll_interval: float = 2.0,
        waiter_ttl: float | None = None,
        starvation_bound: float = DEFAULT_STARVATION_BOUND_S,
        policy: str = "elastic",
        recovery: float | None = None,
        on_unavailable: Literal["fail_closed", "fail_local"] = "fail_closed",
        unavailable_timeout: float = 10.0,
        local_share: float = 0.1,
        held_report_blocks: int | None = None,
        sync_client: Any | None = None,
        on_event: Callable[[RedisBudgetEvent], None] | None = None,
        starvation_bound_s: float | None = None,
        longest_first_s: float = DEFAULT_LONGEST_FIRST_S,
    ) -> None:
        if starvation_bound_s is not None:  # LocalBudget's spelling
            starvation_bound = starvation_bound_s
        if not isinstance(name, str) or not name or any(c in name for c in "{}") or len(name) > 200:
            raise ConfigurationError(
                f"budget name must be a non-empty string of at most 200 characters without braces, got {name!r}"
            )
        # 0 is allowed for read-only handles (status); a budget created with it admits nothing.
        self._configured_limit = validate_blocks(limit_blocks, "limit_blocks", minimum=0)
        self.block_size = validate_blocks(block_size, "block_size")
        for what, v in (("lease_ttl", lease_ttl), ("poll_interval", poll_interval),
                        ("unavailable_timeout", unavailable_timeout)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0) or math.isinf(v):
                raise ConfigurationError(f"{what} must be a positive number of seconds, got {v!r}")
        if policy not in _POLICIES:
            raise ConfigurationError(
                f"RedisBudget policy must be 'strict' or 'elastic' (see zp_client.budget.elastic), got {policy!r}"
            )
        if on_unavailable not in ("fail_closed", "fail_local"):
            raise ConfigurationError(
                f"on_unavailable must be 'fail_closed' or 'fail_local', got {on_unavailable!r}"
            )
        if not (0 < local_share <= 1):
            raise ConfigurationError(f"local_share must be in (0, 1], got {local_share!r}")
        if not isinstance(starvation_bound, (int, float)) or not (starvation_bound >= 0):
            raise ConfigurationError(f"starvation_bound must be seconds >= 0, got {starvation_bound!r}")
        self.name = name
        self._prefix = f"{{zp:{name}}}"
        self._keys = [f"{self._prefix}:{s}" for s in _KEY_SUFFIXES]
        self._lease_ttl = float(lease_ttl)
        self._poll_interval = float(poll_interval)
        self._waiter_ttl = float(waiter_ttl) if waiter_ttl is not None else 3 * self._poll_interval + 1.0
        self._starvation_bound = float(starvation_bound)
        self._longest_first = validate_seconds(longest_first_s, "longest_first_s")
        self._policy = policy
        self._recovery = self._lease_ttl if recovery is None else float(recovery)
        self._on_unavailable = on_unavailable
        self._unavailable_timeout = float(unavailable_timeout)
        self._local_share = float(local_share)
        self._held_report_cfg = None if held_report_blocks is None else max(1, int(held_report_blocks))
        # Reconnect attempts stay frequent enough that holders re-adopt well within a recovery window.
        self._backoff_cap = min(1.0, self._lease_ttl / 4)
        self._owner = secrets.token_urlsafe(12)
        self._limit = self._configured_limit
        self._epoch: str | None = None
        self._hooks: list[Callable[[RedisBudgetEvent], None]] = [on_event] if on_event else []
        self.counters: dict[str, int] = {
            "readopted": 0, "lease_lost": 0, "unavailable": 0, "fallback_local": 0, "release_retried": 0,
        }
        self._url: str | None = url_or_client if isinstance(url_or_client, str) else None
        self._given_client = None if isinstance(url_or_client, str) else url_or_client
        self._sync_client = sync_client
        self._owns_sync = False
        self._side: _AsyncSide | None = None
        self._sync_lock = threading.Lock()
        self._sync_leases: dict[str, RedisLease] = {}
        self._sync_dirty: set[str] = set()
        self._sync_retry: dict[str, float] = {}
        self._sync_thread: threading.Thread | None = None
        self._sync_waiters: dict[str, _SyncWaiter] = {}
        self._sync_box = self._owner + ".s"  # the sync waiters' mailbox (the async side's is the owner's)
        self._sync_pump: threading.Thread | None = None
        self._sync_pump_wake = threading.Event()
        self._sync_wake = threading.Event()
        self._closed = False
        self._fallback: Any = None
        self._was_unavailable = False
        self._fallback_logged = False
        self._warned_limit = False
        self._policy_known = False  # the stored policy is read once (the creator's choice wins)
        self._forecaster: Any = None

    @classmethod
    def from_settings(
        cls, url_or_client: str | Any, name: str, limit_blocks: int, settings: Any = None, **kwargs: Any
    ) -> RedisBudget:
        """A budget using ``block_size``, ``starvation_bound_s``, ``longest_first_s`` and ``lease_ttl_s`` from
        :class:`~zp_client.Settings` (explicit keyword arguments win)."""
        if settings is None:
            from zp_client.config import Settings

            settings = Settings()
        kwargs.setdefault("starvation_bound", settings.starvation_bound_s)
        kwargs.setdefault("longest_first_s", settings.longest_first_s)
        kwargs.setdefault("lease_ttl", settings.lease_ttl_s)
        return cls(url_or_client, name, limit_blocks, settings.block_size, **kwargs)

    # ------------------------------------------------------------------ public API
    @property
    def limit(self) -> int:
        """The limit last seen in Redis (the configured one until the first call)."""
        return self._limit

    @property
    def _held_report_blocks(self) -> int:
        """Held growth that makes a report urgent: ``held_report_blocks`` when given, else 1 block under
        elastic (the projected peak reads held as the present) and 2 under strict (accounting only)."""
        if self._held_report_cfg is not None:
            return self._held_report_cfg
        return 1 if self._policy == "elastic" else 2

    @property
    def policy_name(self) -> str:
        """``"strict"`` or ``"elastic"`` (the stored policy once Redis was reached: the budget's creator
        chose it). Under ``strict`` the ``meta`` given to :meth:`acquire` is accepted and ignored."""
        return self._policy

    def shared_forecaster(self, **kwargs: Any) -> Any:
        """The :class:`~zp_client.budget.redis_forecast.RedisLengthForecaster` of this budget: output
        lengths learned by every process of the fleet (made on first call; ``kwargs`` such as ``q`` or
        ``sync_interval`` apply then). The transport uses it by default for an elastic RedisBudget.
        Needs a URL or ``sync_client`` (it syncs from a daemon thread); closed with the budget."""
        with self._sync_lock:
            fc = self._forecaster
        if fc is None:
            from zp_client.budget.redis_forecast import RedisLengthForecaster

            try:
                client = self._sync()
            except ConfigurationError as exc:
                from zp_client.forecast import LengthForecaster

                log.warning("zp_client: Redis budget %r forecasts from this process only: %s", self.name, exc)
                kwargs = {k: v for k, v in kwargs.items() if k in ("q", "prior", "half_life", "priors")}
                with self._sync_lock:
                    if self._forecaster is None:
                        self._forecaster = LengthForecaster(**kwargs)
                    return self._forecaster
            with self._sync_lock:
                if self._forecaster is None:
                    self._forecaster = RedisLengthForecaster(client, self.name, **kwargs)
                fc = self._forecaster
        return fc

    def new_retry_budget(
        self, *, ratio: float = 0.1, floor_per_s: float = 1.0, window_s: float = 10.0
    ) -> Any:
        """A :class:`~zp_client.retry.RedisRetryBudget` with this budget's name (so the same
        ``{zp:<name>}`` hash tag) on the same Redis: one retry budget for the whole fleet. Made from the
        budget's URL when it was given one, else on the client(s) the caller passed to it (a client the
        budget made itself may be closed by it)."""
        from zp_client.retry import RedisRetryBudget

        if self._url is not None:
            return RedisRetryBudget(self.name, url=self._url, ratio=ratio, floor_per_s=floor_per_s,
                                    window_s=window_s)
        sync_client = None if self._owns_sync else self._sync_client
        return RedisRetryBudget(self.name, client=sync_client, async_client=self._given_client, ratio=ratio,
                                floor_per_s=floor_per_s, window_s=window_s)

    def add_event_hook(self, hook: Callable[[RedisBudgetEvent], None]) -> None:
        """Call ``hook(event)`` for every :class:`RedisBudgetEvent` (from a background task or thread)."""
        self._hooks.append(hook)

    async def acquire(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Lease:
        bound, held_v, prio, order = self._validate(blocks, priority, ticket, held)
        self._meta_arg(meta)  # bad metadata fails here, before any I/O
        try:
            if timeout is None:
                return await self._acquire(bound, held_v, prio, order, meta)
            return await asyncio.wait_for(self._acquire(bound, held_v, prio, order, meta), timeout)
        except asyncio.TimeoutError as exc:
            if isinstance(exc, AdmissionTimeout):
                raise
            raise AdmissionTimeout(
                f"waited {timeout:.3g} s for {bound} KV blocks in Redis budget {self.name!r} without "
                "admission; raise the timeout, lower max_tokens, or add capacity"
            ) from None
        except BudgetUnavailable:
            if self._on_unavailable != "fail_local":
                raise
            return await self._local().acquire(bound, priority=prio, timeout=timeout, ticket=ticket, held=held_v,
                                               meta=meta)

    def acquire_sync(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Lease:
        bound, held_v, prio, order = self._validate(blocks, priority, ticket, held)
        self._meta_arg(meta)  # bad metadata fails here, before any I/O
        try:
            return self._acquire_sync(bound, held_v, prio, order, timeout, meta)
        except BudgetUnavailable:
            if self._on_unavailable != "fail_local":
                raise
            return self._local().acquire_sync(bound, priority=prio, timeout=timeout, ticket=ticket, held=held_v,
                                              meta=meta)

    async def status(self) -> BudgetStatus:
        """A read-only snapshot from Redis (``extra`` holds epoch, recovery, counters)."""
        side = await self._get_side()
        r = await self._eval(side, "status", [], init=False)
        return self._status_from(r)

    def status_sync(self) -> BudgetStatus:
        """Blocking form of :meth:`status`."""
        return self._status_from(self._eval_sync("status", [], init=False))

    async def set_limit(self, limit: int) -> None:
        """Set the limit for the whole fleet. Raising it admits waiters; lowering never revokes a lease."""
        validate_blocks(limit, "limit")
        side = await self._get_side()
        r = await self._eval(side, "set_limit", [limit, ""])
        self._limit = int(r[1])

    async def compare_and_set_limit(self, expected: int, limit: int) -> bool:
        """Set the limit only if it is still ``expected``; returns False (and changes nothing) otherwise."""
        validate_blocks(limit, "limit")
        validate_blocks(expected, "expected")
        side = await self._get_side()
        r = await self._eval(side, "set_limit", [limit, expected])
        self._limit = int(r[1])
        return bool(int(r[0]))

    async def flush(self) -> None:
        """Send every lease's latest held report now (normally batched; see ``held_report_blocks``)."""
        side = await self._get_side()
        args: list[Any] = [self._owner]
        sent: list[tuple[RedisLease, int, dict[str, Any]]] = []
        for le in [*side.leases.values(), *list(self._sync_leases.values())]:
            if not le._released and (le._held != le._sent_held or le._meta_pending):
                v, mj, pending = le._take_report()
                args += [le.id, v, mj]
                sent.append((le, v, pending))
        if sent:
            try:
                await self._eval(side, "held", args, init=False)
            except BaseException:
                for le, _, pending in sent:
                    le._report_failed(pending)
                raise
            for le, v, _ in sent:
                le._sent_held = v

    async def aclose(self) -> None:
        """Stop background tasks and threads; live leases are not released (they expire by TTL)."""
        self._closed = True
        side, self._side = self._side, None
        if side is not None:
            side.closing = True  # a release failing from here on is not queued for a retry
            try:
                await self._drain_releases(side)
            finally:  # even when aclose itself is cancelled: the side's tasks must not outlive it
                side.closed = True
                side.waiters_changed.set()
                side.poll_hint.set()
                side.dirty_event.set()
                for t in side.tasks:
                    t.cancel()
            if side.tasks:
                # bounded: a task stuck inside a client call must not hang aclose
                await asyncio.wait(side.tasks, timeout=2.0)
            if side.owns_client:
                with contextlib.suppress(Exception):
                    await side.client.aclose()
        self._stop_sync()

    async def _drain_releases(self, side: _AsyncSide, budget_s: float = 2.0) -> None:
        """Before the tasks go, within ``budget_s``: let releases finishing in the background (their
        caller was cancelled mid-flight) land, rather than leave them to die with the loop and their
        leases to the TTL; then one last attempt at releases that failed earlier."""
        loop = asyncio.get_running_loop()
        if side.loop is not loop:
            return  # closed from another loop: its tasks cannot be awaited here
        deadline = loop.time() + budget_s
        pending = [t for t in side.background if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=budget_s)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=0.5)
        for lid in list(side.retry_releases):
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(Exception):  # TimeoutError included: the lease expires by TTL
                await asyncio.wait_for(
                    self._eval(side, "release", [lid, self._owner], init=False, patient=False), left)

    def close_sync(self) -> None:
        """Stop the sync keeper thread (for programs without an event loop)."""
        self._closed = True
        self._stop_sync()

    # ------------------------------------------------------------------ validation / events
    def _validate(
        self, blocks: int, priority: int, ticket: Ticket | None, held: int | None
    ) -> tuple[int, int, int, int]:
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
        if not -_PRIORITY_RANGE <= priority <= _PRIORITY_RANGE:
            raise ConfigurationError(
                f"RedisBudget priorities must lie in [-{_PRIORITY_RANGE}, {_PRIORITY_RANGE}], got {priority}"
            )
        return bound, held_v, priority, order

    def _learn_policy(self, policy: str) -> None:
        self._policy_known = True
        if policy != self._policy and policy in _POLICIES:
            log.warning("zp_client: Redis budget %r exists with policy %r; this process was configured with %r "
                        "and follows the stored one (configure every process alike: the transport picks what "
                        "to report from the configured policy)", self.name, policy, self._policy)
            self._policy = policy

    def _learn_status(self, r: list[Any]) -> None:
        if int(r[0]) == 1:
            self._learn_policy(_s(r[6]))

    def _meta_arg(self, meta: Mapping[str, Any] | None) -> str:
        if self._policy != "elastic" or not meta:
            return ""
        if not isinstance(meta, Mapping):
            raise ConfigurationError(f"meta must be a mapping (see zp_client.budget.elastic), got {meta!r}")
        return _meta_json(_compact_meta(meta, update=False))

    def _emit(self, kind: str, lease_id: str | None = None, **detail: Any) -> None:
        if kind in self.counters:
            self.counters[kind] += 1
        ev = RedisBudgetEvent(kind, lease_id, detail)
        for hook in list(self._hooks):
            try:
                hook(ev)
            except Exception:  # a broken hook must not break admission
                log.exception("zp_client RedisBudget event hook failed for %s", kind)

    def _local(self) -> Any:
        if self._fallback is None:
            from zp_client.budget.local import LocalBudget

            share = max(1, int(self._limit * self._local_share))
            self._fallback = LocalBudget(share, self.block_size, starvation_bound_s=self._starvation_bound,
                                         name=f"{self.name}-local-fallback", policy=self._policy,
                                         longest_first_s=self._longest_first)
        self.counters["fallback_local"] += 1
        if self._fallback_logged:
            return self._fallback
        self._fallback_logged = True
        log.error(
            "zp_client: Redis budget %r unreachable; admitting through a per-process LocalBudget of %d "
            "blocks (local_share=%.3g of %d). The fleet-wide limit is NOT enforced until Redis is back.",
            self.name, self._fallback.limit, self._local_share, self._limit,
        )
        self._emit("fallback_local", blocks=self._fallback.limit)
        return self._fallback

    def _mark_available(self, ok: bool) -> None:
        if ok and self._was_unavailable:
            self._was_unavailable = False
            self._fallback_logged = False
            log.warning("zp_client: Redis budget %r reachable again", self.name)
            self._emit("available")
        elif not ok and not self._was_unavailable:
            self._was_unavailable = True
            log.error("zp_client: Redis budget %r unreachable; retrying (policy %s)", self.name,
                      self._on_unavailable)
            self._emit("unavailable")

    def _after_init(self, r: list[Any]) -> None:
        created, limit, _bs, epoch, policy, _starve, rec_left = (
            int(r[0]), int(r[1]), int(r[2]), _s(r[3]), _s(r[4]), int(r[5]), int(r[6]))
        self._limit = limit
        self._epoch = epoch
        self._learn_policy(policy)
        if created:
            self._warned_limit = True  # our own limit is the stored one
            log.warning(
                "zp_client: created Redis budget %r (limit %d blocks); recovery: admitting nothing new for "
                "%.3g s while holders that survived a Redis restart re-adopt their leases",
                self.name, limit, rec_left / 1000,
            )
            self._emit("created", recovery_s=rec_left / 1000)
        else:
            self._learn_limit(limit)

    def _learn_limit(self, limit: int) -> None:
        self._limit = limit
        if limit != self._configured_limit and not self._warned_limit:
            self._warned_limit = True
            log.warning(
                "zp_client: Redis budget %r already exists with limit %d blocks; this process was configured "
                "with %d and follows the stored limit (use set_limit to change it for the fleet)",
                self.name, limit, self._configured_limit,
            )
            self._emit("limit_mismatch", stored=limit, configured=self._configured_limit)

    def _init_args(self) -> list[Any]:
        starve_ms = int(min(self._starvation_bound, 1e12) * 1000)  # inf: unbounded backfill
        lpt_ms = math.ceil(min(self._longest_first, 1e12) * 1000)  # never rounded down to "off"
        return [self._configured_limit, self.block_size, secrets.token_urlsafe(12),
                int(self._recovery * 1000), self._policy, starve_ms, lpt_ms]

    def _status_from(self, r: list[Any]) -> BudgetStatus:
        if int(r[0]) == 0:
            return BudgetStatus(
                limit=self._configured_limit, used=0, free=self._configured_limit, held=0, leases=0,
                policy=self._policy, block_size=self.block_size,
                extra={"exists": False, "name": self.name, "counters": dict(self.counters)},
            )
        limit, bsum, hsum, nl = int(r[1]), int(r[2]), int(r[3]), int(r[4])
        used = int(r[13]) if len(r) > 13 else bsum  # elastic: the projected peak
        self._limit = limit
        self._learn_policy(_s(r[6]))
        flat = [_s(x) for x in r[12]]
        cls: dict[int, list[int]] = {}
        for k, v in zip(flat[::2], flat[1::2]):
            p = int(k[1:])
            cls.setdefault(p, [0, 0])[0 if k[0] == "n" else 1] = int(v)
        waiters = {p: ClassStatus(waiters=n, weight=w) for p, (n, w) in sorted(cls.items()) if n > 0}
        return BudgetStatus(
            limit=limit, used=used, free=max(0, limit - used), held=hsum, leases=nl, waiters=waiters,
            head_wait_s=int(r[10]) / 1000, policy=_s(r[6]), block_size=int(r[8]),
            extra={
                "exists": True, "name": self.name, "epoch": _s(r[5]), "starvation_bound_s": int(r[7]) / 1000,
                "recovering": int(r[9]) > 0, "recovery_left_s": int(r[9]) / 1000, "limit_version": int(r[11]),
                "bound_sum": bsum,
                "counters": dict(self.counters),
            },
        )

    # ------------------------------------------------------------------ async plumbing
    async def _get_side(self) -> _AsyncSide:
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
            client, owns = self._given_client, False
        else:
            pool = redis_async.BlockingConnectionPool.from_url(
                self._url, max_connections=_POOL_SIZE, timeout=None)  # type: ignore[arg-type]  # _url is set without a given client
            client, owns = redis_async.Redis.from_pool(pool), True
        self._side = _AsyncSide(self, client, owns)
        return self._side

    # The async and sync script paths fail with the same errors and messages.
    def _credentials_error(self, exc: BaseException) -> ConfigurationError:
        return ConfigurationError(
            f"Redis refused the credentials for budget {self.name!r} ({exc}); check the user/password "
            "in the URL (redis://user:password@host:port/db) and the ACL"
        )

    def _refused_error(self, exc: BaseException) -> ConfigurationError:
        return ConfigurationError(f"Redis budget {self.name!r} refused the call: {exc}")

    def _unavailable_error(self, exc: BaseException) -> BudgetUnavailable:
        return BudgetUnavailable(
            f"Redis budget {self.name!r} unreachable for {self._unavailable_timeout:.3g} s "
            f"({exc}); nothing was admitted. Check the Redis URL/server, or use "
            "on_unavailable='fail_local' to degrade to a per-process share"
        )

    async def _eval(
        self, side: _AsyncSide, script: str, args: list[Any], *, init: bool = True, patient: bool = True
    ) -> Any:
        """Run a script by SHA (loading it on NOSCRIPT); create the budget on an ``{'I'}`` reply.

        Connection errors are retried with backoff for ``unavailable_timeout`` (``patient=False``: once),
        then :class:`BudgetUnavailable` is raised.
        """
        text, sha = _scripts()[script]
        deadline = time.monotonic() + self._unavailable_timeout
        delay = 0.02
        full_delay = 0.001
        while True:
            try:
                try:
                    r = await side.client.evalsha(sha, len(self._keys), *self._keys, *args)
                except NoScriptError:
                    await side.client.script_load(text)
                    r = await side.client.evalsha(sha, len(self._keys), *self._keys, *args)
                if init and isinstance(r, list) and r and r[0] in (b"I", "I"):
                    ri = await self._eval(side, "init", self._init_args(), init=False, patient=patient)
                    self._after_init(ri)
                    continue
                self._mark_available(True)
                return r
            except (AuthenticationError, AuthorizationError) as exc:
                raise self._credentials_error(exc) from exc
            except ResponseError as exc:
                if "NOSCRIPT" in str(exc):
                    continue
                raise self._refused_error(exc) from exc
            except _POOL_FULL:  # a caller's non-blocking pool: wait for a connection
                await asyncio.sleep(full_delay)
                full_delay = min(full_delay * 2, _POOL_FULL_BACKOFF_CAP_S)
            except _UNAVAILABLE as exc:
                self._mark_available(False)
                if not patient or time.monotonic() + delay > deadline:
                    raise self._unavailable_error(exc) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff_cap)

    async def _acquire(
        self, bound: int, held: int, prio: int, order: int, meta: Mapping[str, Any] | None = None
    ) -> RedisLease:
        side = await self._get_side()
        if not self._policy_known:
            self._learn_status(await self._eval(side, "status", [], init=False))
        meta_json = self._meta_arg(meta)
        rid = secrets.token_urlsafe(18)
        fut: asyncio.Future[str] = side.loop.create_future()
        w = _Waiter(rid, fut, order)
        side.waiters[rid] = w  # registered before the call so a mailbox grant cannot be missed
        args = [rid, bound, held, prio, order, int(self._lease_ttl * 1000), self._owner, self._owner,
                int(self._waiter_ttl * 1000), meta_json]
        try:
            while True:
                # fail_local degrades at once instead of waiting out unavailable_timeout
                r = await self._eval(side, "acquire", args, patient=self._on_unavailable == "fail_closed")
                code = _s(r[0])
                if code in ("G", "W"):
                    self._learn_limit(int(r[4]))
                if code == "G":
                    return self._new_lease(side, rid, bound, held, Ticket(int(r[2]), int(r[1])), _s(r[3]), meta_json)
                if code == "X":
                    self._limit = int(r[1])
                    raise LeaseTooLarge(bound, self._limit)
                ticket = Ticket(int(r[2]), int(r[1]))
                args[4] = w.order = ticket.order  # a re-enqueue (after 'N') keeps the place in line
                rec_left = int(r[5]) / 1000
                if rec_left > 0:  # recovery ends: look again then rather than a poll interval later
                    side.poll_at = min(side.poll_at, time.monotonic() + rec_left + 0.005)
                    side.poll_hint.set()
                side.start()
                side.waiters_changed.set()
                while True:
                    res = await fut
                    if res == "G":
                        return self._new_lease(side, rid, bound, held, ticket, self._epoch or _s(r[3]), meta_json)
                    if res == "X":
                        raise LeaseTooLarge(bound, self._limit, "the limit was lowered while waiting")
                    # 'N': Redis forgot the waiter (state lost, or reaped): enqueue again, same ticket
                    fut = side.loop.create_future()
                    w.fut = fut
                    break
        except BaseException:
            side.waiters.pop(rid, None)
            # Leave no trace: remove the waiter, or release a grant that raced the cancellation.
            await self._remote_release(side, rid)
            raise
        finally:
            side.waiters.pop(rid, None)

    def _new_lease(
        self, side: _AsyncSide, rid: str, bound: int, held: int, ticket: Ticket, epoch: str, meta_json: str = ""
    ) -> RedisLease:
        lease = RedisLease(self, rid, bound, held, ticket, epoch, sync=False)
        if meta_json:
            lease._meta_all = json.loads(meta_json)
        side.leases[rid] = lease
        side.start()
        return lease

    async def _pump(self, side: _AsyncSide) -> None:
        """Deliver wake-ups pushed to this process's mailbox (one blocked connection per process).

        The BLPOP timeout is long: the bounded poll is a separate task (:meth:`_poller`), so an idle
        waiter costs one poll per ``poll_interval`` plus one BLPOP per ``_MAILBOX_BLOCK_S``.
        """
        mailbox = f"{self._prefix}:mb:{self._owner}"
        while not side.closed:
            if not side.waiters:
                side.waiters_changed.clear()
                await side.waiters_changed.wait()
                continue
            try:
                item = await side.client.blpop([mailbox], timeout=_MAILBOX_BLOCK_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the poller retries patiently; try again shortly
                log.debug("zp_client: mailbox BLPOP failed: %r", exc)
                await asyncio.sleep(min(self._poll_interval, 0.2))
                continue
            if item is not None:
                self._deliver(side, _s(item[1]))

    async def _poller(self, side: _AsyncSide) -> None:
        """The bounded-poll fallback: every ``poll_interval`` while this process has waiters, one script
        call heartbeats all of them, reaps, runs a grant pass and reports each waiter's state, so a lost
        wake-up costs at most one interval. Polls early when recovery is about to end."""
        deadline = time.monotonic() + self._poll_interval
        while not side.closed:
            if not side.waiters:
                side.waiters_changed.clear()
                await side.waiters_changed.wait()
                deadline = time.monotonic() + self._poll_interval
                continue
            delay = min(deadline, side.poll_at) - time.monotonic()
            if delay > 0:
                side.poll_hint.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(side.poll_hint.wait(), delay)
                continue  # recompute: the time came, or an earlier poll was asked for
            side.poll_at = math.inf
            deadline = time.monotonic() + self._poll_interval
            ids = list(side.waiters)
            if not ids:
                continue
            try:
                r = await self._eval(side, "poll", [int(self._waiter_ttl * 1000), *ids])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("zp_client: poll of Redis budget %r failed: %r", self.name, exc)
                continue
            rec_left = int(r[0]) / 1000
            for rid, st in zip(ids, r[1:]):
                self._resolve(side, rid, _s(st))
            if rec_left > 0:  # recovery ends: look again then rather than a full interval later
                side.poll_at = min(side.poll_at, time.monotonic() + rec_left + 0.005)

    def _deliver(self, side: _AsyncSide, msg: str) -> None:
        for rid in msg.split(","):
            if rid.startswith("!"):
                self._resolve(side, rid[1:], "X")
            else:
                self._resolve(side, rid, "G")

    def _resolve(self, side: _AsyncSide, rid: str, state: str) -> None:
        w = side.waiters.get(rid)
        if w is None or w.fut.done() or state == "W":
            return
        w.fut.set_result(state)

    async def _keeper(self, side: _AsyncSide) -> None:
        """Renew this loop's leases every TTL/3; retry releases that could not reach Redis."""
        period = self._lease_ttl / 3
        while not side.closed:
            await asyncio.sleep(period)
            for lid, give_up in list(side.retry_releases.items()):
                if time.monotonic() > give_up:
                    side.retry_releases.pop(lid, None)  # it has expired by TTL anyway
                    continue
                try:
                    await self._eval(side, "release", [lid, self._owner], init=False, patient=False)
                    side.retry_releases.pop(lid, None)
                except Exception:
                    pass
            await self._renew_round(side)

    async def _renew_round(self, side: _AsyncSide) -> None:
        leases = [le for le in side.leases.values() if not le._released and not le._lost]
        for i in range(0, len(leases), _RENEW_BATCH):
            batch = leases[i : i + _RENEW_BATCH]
            try:
                r = await self._eval(side, "renew", self._renew_args(batch))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("zp_client: renewing leases in Redis budget %r failed: %r", self.name, exc)
                continue
            self._after_renew(batch, r, side.leases)

    def _renew_args(self, batch: list[RedisLease]) -> list[Any]:
        args: list[Any] = [self._owner, int(self._lease_ttl * 1000)]
        for le in batch:
            args += [le.id, le.epoch, le.bound, le._held, le.priority, le.ticket.order,
                     _meta_json(le._meta_all) if self._policy == "elastic" else ""]
        return args

    def _after_renew(self, batch: list[RedisLease], r: list[Any], registry: dict[str, RedisLease]) -> None:
        epoch = _s(r[0])
        self._epoch = epoch
        for le, code in zip(batch, r[1:]):
            code = int(code)
            if code == 2:
                le.epoch = epoch
                le._sent_held = le._held
                log.warning("zp_client: re-adopted lease %s... (%d blocks) in Redis budget %r after Redis lost it",
                            le.id[:8], le.bound, self.name)
                self._emit("readopted", le.id, bound=le.bound, epoch=epoch)
            elif code in (0, -1):
                le._lost = True
                registry.pop(le.id, None)
                log.error("zp_client: lease %s... (%d blocks) in Redis budget %r was lost (expired while its "
                          "holder ran: event loop or process paused longer than lease_ttl?)",
                          le.id[:8], le.bound, self.name)
                self._emit("lease_lost", le.id, bound=le.bound)

    def _held_dirty(self, lease: RedisLease) -> None:
        if lease._sync:
            with self._sync_lock:
                self._sync_dirty.add(lease.id)
            self._sync_wake.set()
            return
        side = self._side
        if side is None:
            return
        if threading.get_ident() == side.thread:
            side.dirty.add(lease.id)
            side.dirty_event.set()
        else:
            side.loop.call_soon_threadsafe(lambda: (side.dirty.add(lease.id), side.dirty_event.set()))

    async def _held_flusher(self, side: _AsyncSide) -> None:
        """Send held reports in batches: one script call carries every lease that grew meanwhile."""
        while not side.closed:
            await side.dirty_event.wait()
            side.dirty_event.clear()
            ids, side.dirty = side.dirty, set()
            args: list[Any] = [self._owner]
            sent: list[tuple[RedisLease, int, dict[str, Any]]] = []
            for lid in ids:
                le = side.leases.get(lid)
                if le is not None and not le._released:
                    v, mj, pending = le._take_report()
                    args += [lid, v, mj]
                    sent.append((le, v, pending))
            if not sent:
                continue
            try:
                await self._eval(side, "held", args, init=False, patient=False)
                for le, v, _ in sent:
                    le._sent_held = v
            except asyncio.CancelledError:
                for le, _, pending in sent:
                    le._report_failed(pending)
                raise
            except Exception as exc:  # the next renewal carries held; metadata waits for the next report
                for le, _, pending in sent:
                    le._report_failed(pending)
                log.debug("zp_client: held report failed: %r", exc)

    async def _release_lease(self, lease: RedisLease) -> None:
        if lease._sync or self._side is None or self._side.loop is not asyncio.get_running_loop():
            await asyncio.to_thread(self._release_lease_sync, lease)
            return
        side = self._side
        side.leases.pop(lease.id, None)
        side.dirty.discard(lease.id)
        if lease._lost:
            return
        await self._remote_release(side, lease.id)

    async def _remote_release(self, side: _AsyncSide, lid: str) -> None:
        """Release a lease / cancel a waiter in Redis. Never raises except the caller's own
        cancellation; a cancelled or failed release is finished by a background task / retried until
        the lease would have expired anyway (release is idempotent, so a repeat is harmless)."""
        try:
            await self._eval(side, "release", [lid, self._owner], init=False, patient=False)
        except asyncio.CancelledError:
            self._release_in_background(side, lid)
            raise
        except Exception as exc:
            self._retry_later(side, lid, exc)

    def _release_in_background(self, side: _AsyncSide, lid: str) -> None:
        def done(t: asyncio.Task[Any]) -> None:
            if t.cancelled() or t.exception() is not None:
                self._retry_later(side, lid, None if t.cancelled() else t.exception())

        task = side.loop.create_task(self._eval(side, "release", [lid, self._owner], init=False, patient=False))
        side.background.add(task)
        task.add_done_callback(side.background.discard)
        task.add_done_callback(done)

    def _retry_later(self, side: _AsyncSide, lid: str, exc: BaseException | None) -> None:
        if side.closing:
            return  # aclose gave up on it (bounded): the lease expires by its TTL
        log.warning("zp_client: release of %s... in Redis budget %r failed (%r); retrying in the background",
                    lid[:8], self.name, exc)
        self.counters["release_retried"] += 1
        side.retry_releases[lid] = time.monotonic() + self._lease_ttl

    # ------------------------------------------------------------------ sync plumbing
    def _sync(self) -> Any:
        if self._sync_client is None:
            with self._sync_lock:
                if self._sync_client is None:
                    if self._url is None:
                        raise ConfigurationError(
                            "acquire_sync/lease_sync need a sync Redis client: pass a URL, or "
                            "sync_client=redis.Redis(...) next to the async client"
                        )
                    pool = redis_sync.BlockingConnectionPool.from_url(
                        self._url, max_connections=_POOL_SIZE, timeout=None)
                    self._sync_client = redis_sync.Redis.from_pool(pool)
                    self._owns_sync = True
        return self._sync_client

    def _eval_sync(self, script: str, args: list[Any], *, init: bool = True, patient: bool = True) -> Any:
        client = self._sync()
        text, sha = _scripts()[script]
        deadline = time.monotonic() + self._unavailable_timeout
        delay = 0.02
        full_delay = 0.001
        while True:
            try:
                try:
                    r = client.evalsha(sha, len(self._keys), *self._keys, *args)
                except NoScriptError:
                    client.script_load(text)
                    r = client.evalsha(sha, len(self._keys), *self._keys, *args)
                if init and isinstance(r, list) and r and r[0] in (b"I", "I"):
                    self._after_init(self._eval_sync("init", self._init_args(), init=False, patient=patient))
                    continue
                self._mark_available(True)
                return r
            except (AuthenticationError, AuthorizationError) as exc:
                raise self._credentials_error(exc) from exc
            except ResponseError as exc:
                if "NOSCRIPT" in str(exc):
                    continue
                raise self._refused_error(exc) from exc
            except _POOL_FULL:  # a caller's non-blocking pool: wait for a connection
                time.sleep(full_delay)
                full_delay = min(full_delay * 2, _POOL_FULL_BACKOFF_CAP_S)
            except _UNAVAILABLE as exc:
                self._mark_available(False)
                if not patient or time.monotonic() + delay > deadline:
                    raise self._unavailable_error(exc) from exc
                time.sleep(delay)
                delay = min(delay * 2, self._backoff_cap)

    def _acquire_sync(
        self, bound: int, held: int, prio: int, order: int, timeout: float | None,
        meta: Mapping[str, Any] | None = None,
    ) -> RedisLease:
        client = self._sync()
        if not self._policy_known:
            self._learn_status(self._eval_sync("status", [], init=False))
        meta_json = self._meta_arg(meta)
        rid = secrets.token_urlsafe(18)
        # Sync waiters share one mailbox, read by one pump thread (one connection per process, not per
        # waiting thread: a herd of threads must not hold the pool's connections in BLPOP).
        args = [rid, bound, held, prio, order, int(self._lease_ttl * 1000), self._sync_box, self._owner,
                int(self._waiter_ttl * 1000), meta_json]
        deadline = None if timeout is None else time.monotonic() + timeout
        wake = _SyncWaiter()
        with self._sync_lock:
            self._sync_waiters[rid] = wake  # registered before the call so a mailbox grant cannot be missed
        self._ensure_sync_pump()
        try:
            r = self._eval_sync("acquire", args, patient=self._on_unavailable == "fail_closed")
            while True:
                code = _s(r[0])
                if code in ("G", "W"):
                    self._learn_limit(int(r[4]))
                if code == "G":
                    return self._new_sync_lease(rid, bound, held, Ticket(int(r[2]), int(r[1])), _s(r[3]), meta_json)
                if code == "X":
                    self._limit = int(r[1])
                    raise LeaseTooLarge(bound, self._limit)
                args[4] = int(r[1])
                rec_left = int(r[5]) / 1000
                wait = self._poll_interval if rec_left <= 0 else min(self._poll_interval, rec_left + 0.005)
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise AdmissionTimeout(
                            f"waited {timeout:.3g} s for {bound} KV blocks in Redis budget {self.name!r} "
                            "without admission; raise the timeout, lower max_tokens, or add capacity"
                        )
                    wait = min(wait, left)
                self._sync_pump_wake.set()
                wake.event.wait(max(0.01, wait))
                wake.event.clear()
                if wake.too_large:
                    raise LeaseTooLarge(bound, self._limit, "the limit was lowered while waiting")
                # Granted or not, one idempotent acquire call answers (and heartbeats the waiter).
                r = self._eval_sync("acquire", args)
        except BaseException:
            try:
                self._eval_sync("release", [rid, self._owner], init=False, patient=False)
            except Exception:
                with self._sync_lock:
                    self._sync_retry[rid] = time.monotonic() + self._lease_ttl
                self._ensure_sync_thread()
            raise
        finally:
            with self._sync_lock:
                self._sync_waiters.pop(rid, None)

    def _ensure_sync_pump(self) -> None:
        with self._sync_lock:
            if self._sync_pump is None or not self._sync_pump.is_alive():
                self._sync_pump = threading.Thread(
                    target=self._sync_pump_loop, name=f"zp-redis-pump-{self.name}", daemon=True
                )
                self._sync_pump.start()

    def _sync_pump_loop(self) -> None:
        """Thread: deliver wake-ups pushed to the sync waiters' mailbox (the sync face of :meth:`_pump`)."""
        client = self._sync()
        mailbox = f"{self._prefix}:mb:{self._sync_box}"
        while not self._closed:
            with self._sync_lock:
                idle = not self._sync_waiters
            if idle:
                self._sync_pump_wake.wait(timeout=_MAILBOX_BLOCK_S)
                self._sync_pump_wake.clear()
                continue
            try:
                item = client.blpop([mailbox], timeout=_SYNC_PUMP_BLOCK_S)
            except (*_UNAVAILABLE, ValueError) as exc:  # ValueError: the client was closed under us
                if self._closed:
                    return
                # Redis away: each waiter's own acquire call retries patiently
                log.debug("zp_client: sync mailbox BLPOP failed: %r", exc)
                time.sleep(min(self._poll_interval, 0.2))
                continue
            if item is None:
                continue
            with self._sync_lock:
                for rid in _s(item[1]).split(","):
                    w = self._sync_waiters.get(rid.lstrip("!"))
                    if w is not None:
                        w.too_large = w.too_large or rid.startswith("!")
                        w.event.set()

    def _new_sync_lease(
        self, rid: str, bound: int, held: int, ticket: Ticket, epoch: str, meta_json: str = ""
    ) -> RedisLease:
        lease = RedisLease(self, rid, bound, held, ticket, epoch, sync=True)
        if meta_json:
            lease._meta_all = json.loads(meta_json)
        with self._sync_lock:
            self._sync_leases[rid] = lease
        self._ensure_sync_thread()
        return lease

    def _release_lease_sync(self, lease: RedisLease) -> None:
        if not lease._sync and self._side is not None:
            self._side.leases.pop(lease.id, None)
        with self._sync_lock:
            self._sync_leases.pop(lease.id, None)
            self._sync_dirty.discard(lease.id)
        if lease._lost:
            return
        try:
            self._eval_sync("release", [lease.id, self._owner], init=False, patient=False)
        except Exception as exc:
            log.warning("zp_client: release of lease %s... in Redis budget %r failed (%r); retrying in the "
                        "background", lease.id[:8], self.name, exc)
            self.counters["release_retried"] += 1
            with self._sync_lock:
                self._sync_retry[lease.id] = time.monotonic() + self._lease_ttl
            self._ensure_sync_thread()

    def _ensure_sync_thread(self) -> None:
        with self._sync_lock:
            if self._sync_thread is None or not self._sync_thread.is_alive():
                self._sync_thread = threading.Thread(
                    target=self._sync_keeper, name=f"zp-redis-keeper-{self.name}", daemon=True
                )
                self._sync_thread.start()

    def _sync_keeper(self) -> None:
        """Thread: renew sync leases every TTL/3, flush their held reports, retry failed releases."""
        period = self._lease_ttl / 3
        next_renew = time.monotonic() + period
        while not self._closed:
            self._sync_wake.wait(timeout=max(0.0, next_renew - time.monotonic()))
            self._sync_wake.clear()
            if self._closed:
                return
            with self._sync_lock:
                dirty, self._sync_dirty = self._sync_dirty, set()
                pending = [(le, *le._take_report()) for lid in dirty
                           if (le := self._sync_leases.get(lid)) is not None]
                retry = list(self._sync_retry.items())
            if pending:
                args: list[Any] = [self._owner]
                for le, v, mj, _ in pending:
                    args += [le.id, v, mj]
                try:
                    self._eval_sync("held", args, init=False, patient=False)
                    for le, v, _, _ in pending:
                        le._sent_held = v
                except Exception as exc:
                    for le, _, _, meta in pending:
                        le._report_failed(meta)
                    log.debug("zp_client: held report failed: %r", exc)
            if time.monotonic() < next_renew:
                continue
            next_renew = time.monotonic() + period
            for lid, give_up in retry:
                try:
                    if time.monotonic() <= give_up:
                        self._eval_sync("release", [lid, self._owner], init=False, patient=False)
                    with self._sync_lock:
                        self._sync_retry.pop(lid, None)
                except Exception:
                    pass
            with self._sync_lock:
                leases = [le for le in self._sync_leases.values() if not le._released and not le._lost]
            for i in range(0, len(leases), _RENEW_BATCH):
                batch = leases[i : i + _RENEW_BATCH]
                try:
                    r = self._eval_sync("renew", self._renew_args(batch), patient=False)
                except Exception as exc:
                    log.warning("zp_client: renewing leases in Redis budget %r failed: %r", self.name, exc)
                    continue
                with self._sync_lock:
                    self._after_renew(batch, r, self._sync_leases)

    def _stop_sync(self) -> None:
        fc, self._forecaster = self._forecaster, None
        if fc is not None and hasattr(fc, "close"):
            fc.close()  # sends its pending observations with the sync client, before that closes
        self._sync_wake.set()
        self._sync_pump_wake.set()
        pump = self._sync_pump
        if pump is not None and pump.is_alive() and self._sync_client is not None:
            try:  # end the pump's BLPOP now rather than after its timeout
                self._sync_client.rpush(f"{self._prefix}:mb:{self._sync_box}", "")
                self._sync_client.pexpire(f"{self._prefix}:mb:{self._sync_box}", 60_000)
            except _UNAVAILABLE as exc:
                log.debug("zp_client: could not wake the sync mailbox pump: %r", exc)
            pump.join(timeout=2)
        t = self._sync_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2)
        if self._owns_sync and self._sync_client is not None:
            with contextlib.suppress(Exception):
                self._sync_client.close()
            self._sync_client = None
            self._owns_sync = False
