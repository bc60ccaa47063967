"""RedisFleet: a fleet's budgets, its one fair line and its prefix index shared in Redis.

:class:`RedisFleet` is to :class:`~zp_client.fleet.Fleet` what :class:`~zp_client.RedisBudget` is to
:class:`~zp_client.LocalBudget`: the same duck-typed routing surface (``is_fleet``, ``route_url``,
``routing_meta``, ``note_failure``...), so ``wrap()`` and the clients route through it, with the state in
Redis so every process on every host shares one line and one budget per replica::

    fleet = RedisFleet("redis://redis:6379/0", "llama-70b",
                       ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"], limit_blocks=1945)
    client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)

It is a :class:`~zp_client.Budget` whose line is a (private, composed) :class:`~zp_client.RedisBudget`
in **fleet mode**: the same scripts (``lua/``), whose grant pass
places each waiter on a replica (each replica admits under the fleet's policy, over its own leases:
``elastic``, the default, while the projected peak of its pool stays within its limit, as
:class:`~zp_client.fleet.Fleet`'s replicas; ``strict``, while its sum of bounds does; session replica
first, then the longest prefix match, then the least projected load; the affinity wait; a waiter past
the starvation bound that fits nowhere holds one replica, not the whole line; ejected replicas skipped,
all of them used when all are ejected), so waiting, mailboxes, renewals, recovery and fail-closed
behaviour are RedisBudget's. An uncontended request costs two script calls:
acquire (route and admit) and release (which also carries the request's success). Health
(:meth:`note_failure`, ejection, readmission) and membership go through ``lua/fleet.lua``.

The placement is :class:`~zp_client.fleet.ledger.FleetLedger`'s, ported to Lua; a conformance test drives
both with the same requests (tests/fleet/test_fleet_redis_elastic.py). See docs/redis.md, "Redis fleets".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zp_client._redact import check_redis_url
from zp_client._tasks import deferred
from zp_client.budget.base import Budget, BudgetStatus, ClassStatus, Lease, Ticket
from zp_client.budget.ledger import validate_blocks, validate_seconds
from zp_client.budget.redis._budget import RedisBudget
from zp_client.budget.redis._clients import AsyncRedisClient
from zp_client.budget.redis._meta import text
from zp_client.budget.redis._script import CALL_FAILED, Config, RedisBudgetEvent, RedisLease
from zp_client.errors import ConfigurationError
from zp_client.fleet._routing import FleetRouting, normalize, replica_limits
from zp_client.fleet.ledger import (
    AVOID_META,
    DEFAULT_AFFINITY_WAIT_S,
    DEFAULT_FLEET_STARVATION_BOUND_S,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MIN_AFFINITY_BLOCKS,
    PREFIX_META,
    SESSION_META,
    HealthRules,
)
from zp_client.fleet.prefix import DEFAULT_MAX_ENTRIES

if TYPE_CHECKING:
    from zp_client.budget.redis._async import AsyncFace
    from zp_client.budget.redis._retry import RedisRetryBudget
    from zp_client.budget.redis._sync import SyncFace
    from zp_client.config import Settings
    from zp_client.forecast import LengthForecaster
    from zp_client.retry import RetryBudget

__all__ = ["MAX_ROUTE_KEYS", "RedisFleet", "replica_id"]

log = logging.getLogger("zp_client.fleet")

MAX_ROUTE_KEYS = 32
"""Prefix keys a request sends (a long conversation has one per message): the first 8 (the shared head,
a system prompt) and the last 24 (the longest prefixes), so a script call stays bounded."""

DEFAULT_FLEET_TTL_S = 86_400.0


def replica_id(url: str) -> str:
    """A replica's id in Redis: 12 hex digits of the SHA-1 of its normalized base URL (the same in every
    process; short keys)."""
    return hashlib.sha1(url.encode()).hexdigest()[:12]


def _route_keys(keys: Sequence[tuple[int, int]]) -> list[list[object]]:
    seq = list(keys)
    if len(seq) > MAX_ROUTE_KEYS:
        seq = seq[:8] + seq[-(MAX_ROUTE_KEYS - 8):]
    return [[f"{int(k) & 0xFFFFFFFFFFFFFFFF:016x}", max(0, int(b))] for k, b in seq]


class _Hooks:
    """The script layer's fleet hooks (``Core.fleet``): routing argument, init argument, replica ids."""

    def __init__(self, fleet: RedisFleet) -> None:
        self._fleet = fleet

    def route_arg(self, meta: Mapping[str, Any] | None) -> dict[str, Any]:
        if not meta:
            return {}
        out: dict[str, Any] = {}
        keys = meta.get(PREFIX_META)
        if keys:
            out["k"] = _route_keys(keys)
        session = meta.get(SESSION_META)
        if session is not None:
            s = str(session)
            out["s"] = s if len(s) <= 256 else hashlib.sha1(s.encode()).hexdigest()
        avoid = meta.get(AVOID_META)
        if avoid:
            out["a"] = [replica_id(str(u)) for u in avoid][-16:]
        return out

    def init_arg(self) -> str:
        return self._fleet._init_arg()

    def replica_id(self, url: str | None) -> str:
        return "" if url is None else replica_id(url)

    def replica_url(self, rid: str) -> str | None:
        return self._fleet._urls.get(rid)


class RedisFleet(FleetRouting, Budget):
    """A fleet of vLLM replicas whose budgets, line and prefix index live in Redis (module docstring).

    ``replicas``: base URLs (all with the same path), each leased up to ``limit_blocks``, or a mapping of
    URL to its own limit. ``policy``: each replica's reservation policy, ``"elastic"`` (default, as
    :class:`~zp_client.fleet.Fleet`'s) or ``"strict"``; the fleet's creator chooses, as RedisBudget's.
    ``starvation_bound_s`` defaults to a fleet's 10 s (``DEFAULT_FLEET_STARVATION_BOUND_S``); a fleet's
    line has no longest-first window. ``capacities``: a replica's pool in blocks for the prefix index
    (default its limit). ``affinity_wait_s`` / ``min_affinity_blocks`` / ``health`` / ``max_prefix_entries`` /
    ``max_sessions``: as :class:`~zp_client.fleet.Fleet`'s (stored by the fleet's creator; the first
    process to create it wins, as RedisBudget's limit). ``fleet_ttl_s``: the routing keys (sessions, the
    prefix index, the replicas and their counters) expire this long after their last write or lease
    renewal; the replicas are registered again from the configuration when they expired. The rest are
    :class:`~zp_client.RedisBudget`'s keyword arguments (``lease_ttl_s``, ``poll_interval_s``,
    ``recovery_s``, ``on_unavailable``..., and ``line`` / ``late_bound_s``: the fleet's line runs the
    SLO-aware order too).

    A RedisFleet is a :class:`~zp_client.Budget`; it composes its line (a private
    :class:`_RedisFleetLine`: a RedisBudget in fleet mode over the fleet's keys and scripts) rather than
    being a RedisBudget, and offers every public method a RedisBudget offers.
    """

    def __init__(
        self,
        url_or_client: str | AsyncRedisClient,
        name: str,
        replicas: Sequence[str] | Mapping[str, int],
        limit_blocks: int | None = None,
        block_size: int = 16,
        *,
        policy: str = "elastic",
        affinity_wait_s: float = DEFAULT_AFFINITY_WAIT_S,
        min_affinity_blocks: int = DEFAULT_MIN_AFFINITY_BLOCKS,
        health: HealthRules | None = None,
        max_prefix_entries: int = DEFAULT_MAX_ENTRIES,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        capacities: Mapping[str, int] | None = None,
        fleet_ttl_s: float = DEFAULT_FLEET_TTL_S,
        **kwargs: Any,
    ) -> None:
        if isinstance(url_or_client, str):  # first: no other error may come before it (nor show the URL)
            check_redis_url(url_or_client)
        if kwargs.get("longest_first_s", 0):
            raise ConfigurationError("a fleet's line has no longest-first window (longest_first_s): it is "
                                     "FIFO within a class, as Fleet's")
        kwargs["longest_first_s"] = 0.0
        kwargs.setdefault("starvation_bound_s", DEFAULT_FLEET_STARVATION_BOUND_S)
        if kwargs.get("on_unavailable", "fail_closed") != "fail_closed":
            raise ConfigurationError("RedisFleet fails closed only (on_unavailable='fail_closed'): a local "
                                     "fallback would admit without placing requests on replicas")
        limits = replica_limits(replicas, limit_blocks, missing_limit=(
            "RedisFleet(url, name, replicas) needs limit_blocks (or a mapping of URL to limit)"))
        self._line = _RedisFleetLine(url_or_client, name, max(limits.values()), block_size, policy=policy,
                                     **kwargs)
        self._line.fleet = self
        self.name = name
        self.block_size = self._line.block_size
        self._core = self._line._core
        self.counters = self._line.counters
        self.created: bool | None = None
        """As RedisBudget's (a fleet is not made by :meth:`create`: always None)."""
        self.health = health or HealthRules()
        self.affinity_wait_s = validate_seconds(affinity_wait_s, "affinity_wait_s")
        self.min_affinity_blocks = validate_blocks(min_affinity_blocks, "min_affinity_blocks", minimum=0)
        self.max_prefix_entries = validate_blocks(max_prefix_entries, "max_prefix_entries")
        self.max_sessions = validate_blocks(max_sessions, "max_sessions")
        self.fleet_ttl_s = validate_seconds(fleet_ttl_s, "fleet_ttl_s")
        if self.fleet_ttl_s < 3 * self._core.cfg.lease_ttl_s or self.fleet_ttl_s < 1:
            raise ConfigurationError("fleet_ttl_s must be at least 3 x lease_ttl_s (and 1 s): live leases "
                                     "keep the replicas' keys alive through their renewals")
        caps = {normalize(u): validate_blocks(c, "capacity") for u, c in (capacities or {}).items()}
        self._config = {u: (lim, caps.get(u, lim)) for u, lim in limits.items()}
        self._default_limit = limit_blocks
        self._urls: dict[str, str] = {replica_id(u): u for u in limits}
        self._ejected: set[str] = set()  # what this process last learned (status, its own health calls)
        self._path = urlsplit(next(iter(limits))).path
        self._pending: set[asyncio.Task[object]] = set()
        self.moves = 0
        """Requests this process moved off a failed replica without spending a retry."""
        self.max_moves = 1
        """Moves per request off failing replicas, per replica in the fleet (as Fleet's)."""
        self._core.fleet = _Hooks(self)

    @classmethod
    async def create(
        cls, url_or_client: str | AsyncRedisClient, name: str, limit_blocks: int, block_size: int = 16,
        **kwargs: Any,
    ) -> RedisBudget:
        """A RedisBudget's constructor, which a fleet has not: raises
        :class:`~zp_client.ConfigurationError` (``RedisFleet(url, name, replicas, limit_blocks)``)."""
        raise ConfigurationError("RedisFleet(url, name, replicas, limit_blocks, ...) is its constructor")

    @classmethod
    def create_sync(
        cls, url_or_client: str | AsyncRedisClient, name: str, limit_blocks: int, block_size: int = 16,
        **kwargs: Any,
    ) -> RedisBudget:
        """Blocking form of :meth:`create`: raises :class:`~zp_client.ConfigurationError`."""
        raise ConfigurationError("RedisFleet(url, name, replicas, limit_blocks, ...) is its constructor")

    @classmethod
    def from_settings(cls, *args: Any, **kwargs: Any) -> RedisFleet:
        raise ConfigurationError("RedisFleet(url, name, replicas, limit_blocks, ...) is its constructor")

    @classmethod
    def from_server(cls, *args: Any, **kwargs: Any) -> RedisFleet:
        raise ConfigurationError("RedisFleet sizes replicas from its arguments (replicas may be a mapping "
                                 "URL -> limit: calibrate each with zp_client.calibration.calibrate)")

    def _init_arg(self) -> str:
        h = self.health
        return json.dumps({
            "aff": int(self.affinity_wait_s * 1000), "mab": self.min_affinity_blocks,
            "cf": h.consecutive_failures, "be": int(h.base_ejection_s * 1000),
            "me": int(h.max_ejection_s * 1000), "pxmax": self.max_prefix_entries, "smax": self.max_sessions,
            "fttl": int(self.fleet_ttl_s * 1000),
            "reps": [[replica_id(u), u, lim, cap] for u, (lim, cap) in self._config.items()],
        }, separators=(",", ":"))

    # ------------------------------------------------------------------ routing (the core calls these)
    @property
    def replicas(self) -> list[str]:
        """The replicas' base URLs as this process last saw them (its configuration, then status and
        membership calls)."""
        return list(self._urls.values())

    def _target(self) -> str:
        for url in self._urls.values():
            if replica_id(url) not in self._ejected:
                return url
        return next(iter(self._urls.values()))

    # ------------------------------------------------------------------ health
    def note_failure(self, lease: Lease, *, connect: bool = False) -> bool:
        """The attempt on ``lease``'s replica failed. Sent to Redis in the background from an event loop
        (one script call; the admission path does not wait for it), at once from a thread. Returns
        whether this process believes the replica ejected (a connect error: yes). Never raises."""
        replica = getattr(lease, "replica", None)
        if replica is None:
            return False
        rid = replica_id(replica)
        args = ["fail", rid, "1" if connect else "0"]
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        side = self._line._side
        if loop is not None and side is not None and side.loop is loop:
            # fire-and-forget, owned by the line's async face (its supervisor lets it land at close);
            # kept in _pending too: a release waits for the health reports made before it
            task = side.sup.background(self._health_async(args), loop=loop)
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
            if connect:
                self._ejected.add(rid)
            return connect
        try:
            return self._after_health(rid, self._sync_face.eval("fleet", args, patient=False))
        except CALL_FAILED as exc:
            log.warning("fleet %s: could not report a failure of %s: %r", self.name, replica, exc)
            return connect

    async def _health_async(self, args: list[str]) -> bool:
        try:
            side = self._get_side()
            return self._after_health(args[1], await side.eval("fleet", args, patient=False))
        except CALL_FAILED as exc:
            log.warning("fleet %s: could not report a failure of %s: %r", self.name,
                        self._urls.get(args[1], args[1]), exc)
            return False

    def _after_health(self, rid: str, r: Any) -> bool:
        ejected = bool(int(r[0])) if r and text(r[0]) != "I" else False
        if ejected:
            if rid not in self._ejected:
                log.warning("fleet %s: replica %s ejected (its leases released)", self.name,
                            self._urls.get(rid, rid))
            self._ejected.add(rid)
        return ejected

    def note_success(self, lease: Lease) -> None:
        """The attempt on ``lease``'s replica succeeded: told with the lease's release (no call of its
        own), which ends the replica's run of consecutive failures."""
        if getattr(lease, "replica", None) is not None:
            self._core.fleet_ok.add(lease.id)

    def note_move(self) -> None:
        """A request moved off a failed replica without spending a retry (this process's count)."""
        self.moves += 1

    async def _op(self, *args: Any) -> Any:
        side = self._get_side()
        return await side.eval("fleet", [str(a) for a in args])

    def _op_sync(self, *args: Any) -> Any:
        return self._sync_face.eval("fleet", [str(a) for a in args])

    def _rid(self, url: str) -> str:
        return replica_id(normalize(url))

    async def eject(self, url: str) -> None:
        """Eject ``url`` now for its backoff; its leases are released at once."""
        self._after_health(self._rid(url), await self._op("eject", self._rid(url)))

    def eject_sync(self, url: str) -> None:
        self._after_health(self._rid(url), self._op_sync("eject", self._rid(url)))

    async def readmit(self, url: str) -> bool:
        """Bring an ejected replica back now (its prefix index is forgotten); True if it was ejected."""
        self._ejected.discard(self._rid(url))
        return bool(int((await self._op("readmit", self._rid(url)))[0]))

    def readmit_sync(self, url: str) -> bool:
        self._ejected.discard(self._rid(url))
        return bool(int(self._op_sync("readmit", self._rid(url))[0]))

    # ------------------------------------------------------------------ membership
    def _add_args(self, url: str, limit_blocks: int | None, capacity: int | None) -> list[object]:
        limit = limit_blocks if limit_blocks is not None else self._default_limit
        if limit is None:
            raise ConfigurationError("add_replica needs limit_blocks (this fleet has no default limit)")
        validate_blocks(limit, "limit_blocks")
        u = normalize(url)
        self._urls[replica_id(u)] = u
        self._config[u] = (limit, capacity or limit)
        return ["add", replica_id(u), u, limit, validate_blocks(capacity or limit, "capacity")]

    async def add_replica(self, url: str, limit_blocks: int | None = None,
                          capacity: int | None = None) -> None:
        """Add a replica for every process of the fleet (waiters may go there at once)."""
        await self._op(*self._add_args(url, limit_blocks, capacity))

    def add_replica_sync(self, url: str, limit_blocks: int | None = None,
                         capacity: int | None = None) -> None:
        self._op_sync(*self._add_args(url, limit_blocks, capacity))

    async def remove_replica(self, url: str) -> None:
        """Drain a replica: no new request goes there; it is forgotten once its leases end. Waiters no
        remaining replica could take fail with LeaseTooLarge."""
        self._config.pop(normalize(url), None)
        await self._op("remove", self._rid(url))
        self._urls.pop(self._rid(url), None)

    def remove_replica_sync(self, url: str) -> None:
        self._config.pop(normalize(url), None)
        self._op_sync("remove", self._rid(url))
        self._urls.pop(self._rid(url), None)

    async def set_replica_limit(self, url: str, limit_blocks: int) -> None:
        """One replica's limit (lowering never revokes a lease)."""
        validate_blocks(limit_blocks, "limit_blocks", minimum=0)
        await self._op("limit", self._rid(url), limit_blocks)

    def set_replica_limit_sync(self, url: str, limit_blocks: int) -> None:
        validate_blocks(limit_blocks, "limit_blocks", minimum=0)
        self._op_sync("limit", self._rid(url), limit_blocks)

    async def set_limit(self, limit: int) -> None:
        raise ConfigurationError("a fleet's limit is per replica: use fleet.set_replica_limit(url, blocks)")

    async def compare_and_set_limit(self, expected: int, limit: int, *, fence: str | None = None,
                                    keep_size: bool = False) -> bool:
        raise ConfigurationError("a fleet has no single limit to adapt: use set_replica_limit")

    # ------------------------------------------------------------------ status
    async def status(self) -> BudgetStatus:
        """The line (as RedisBudget's status) and ``extra["replicas"]``: per replica its limit, used
        (as its policy counts: the projected peak of its leases under elastic, their sum of bounds under
        strict), leases, ejection state, prefix hit rate; the fleet's sessions and index size."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        side = self._get_side()
        line = self._core.status_from(await side.eval("status", [], init=False))
        fl = await side.eval("fleet", ["status", ""], init=False)
        st = self._fleet_status(line, fl)
        if self.pd is not None:
            st.extra["pd"] = self.pd_extra(await self.pd.prefill.status())
        return st

    def status_sync(self) -> BudgetStatus:
        line = self._core.status_from(self._sync_face.eval("status", [], init=False))
        st = self._fleet_status(line, self._sync_face.eval("fleet", ["status", ""], init=False))
        if self.pd is not None:
            st.extra["pd"] = self.pd_extra(self.pd.prefill.status_sync())
        return st

    def _fleet_status(self, line: BudgetStatus, fl: Any) -> BudgetStatus:
        if not line.extra.get("exists") or (fl and text(fl[0]) == "I"):
            return line
        now = int(fl[0])
        reps_flat = [text(x) for x in fl[1]]
        sums_flat = [text(x) for x in fl[2]]
        sums = {k: int(v) for k, v in zip(sums_flat[::2], sums_flat[1::2], strict=False)}
        px_flat = fl[4]
        px = {text(px_flat[i]): int(px_flat[i + 1]) for i in range(0, len(px_flat), 2)}
        peak_flat = fl[6] if len(fl) > 6 else []
        peaks = {text(peak_flat[i]): int(peak_flat[i + 1]) for i in range(0, len(peak_flat), 2)}
        replicas: dict[str, dict[str, object]] = {}
        limit = used = 0
        prompt = hits = 0
        ejected: set[str] = set()
        for rid, raw in zip(reps_flat[::2], reps_flat[1::2], strict=False):
            r = json.loads(raw)
            url = str(r["u"])
            self._urls[rid] = url
            ej = int(r.get("ej") or 0)
            is_ej = ej > now
            if is_ej:
                ejected.add(rid)
            draining = r.get("dr") == 1
            b, q, h = sums.get("b" + rid, 0), sums.get("q" + rid, 0), sums.get("h" + rid, 0)
            u = peaks.get(rid, b)
            if not draining and not is_ej:
                limit += int(r["lim"])
            used += u
            prompt, hits = prompt + q, hits + h
            replicas[url] = {
                "id": rid, "limit": int(r["lim"]), "used": u, "bound_sum": b,
                "leases": sums.get("n" + rid, 0),
                "ejected": is_ej, "ejected_for_s": max(0, ej - now) / 1000 if is_ej else None,
                "ejections": int(r.get("x") or 0), "failures": sums.get("f" + rid, 0), "draining": draining,
                "placed": sums.get("p" + rid, 0), "prefix_hit_rate": round(h / q, 4) if q else None,
                "prefix_entries": px.get(rid, 0), "prefix_blocks": sums.get("k" + rid, 0),
                "lost_leases": sums.get("l" + rid, 0),
            }
        self._ejected = ejected
        extra = dict(line.extra)
        extra.update({
            "replicas": replicas,
            "prefix_hit_rate": round(hits / prompt, 4) if prompt else None,
            "prefix_index_entries": sum(px.values()),
            "prefix_evictions": int(fl[5]),
            "sessions": int(fl[3]),
            "moves": self.moves,
            "line_size_limit": line.limit,
        })
        return BudgetStatus(
            limit=limit, used=used, free=max(0, limit - used), held=line.held, leases=line.leases,
            waiters={p: ClassStatus(c.waiters, c.weight) for p, c in line.waiters.items()},
            head_wait_s=line.head_wait_s, policy=line.policy, block_size=line.block_size, extra=extra,
        )

    async def acquire(
        self, blocks: int, *, priority: int = 0, timeout: float | None = None, ticket: Ticket | None = None,
        held: int | None = None, meta: Mapping[str, object] | None = None,
    ) -> Lease:
        """As :meth:`RedisBudget.acquire`; the lease's ``replica`` is the base URL it was placed on (the
        first call also checks that the name holds a fleet: one more script call, once)."""
        return await self._line.acquire(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                        meta=meta)

    def acquire_sync(
        self, blocks: int, *, priority: int = 0, timeout: float | None = None, ticket: Ticket | None = None,
        held: int | None = None, meta: Mapping[str, object] | None = None,
    ) -> Lease:
        return self._line.acquire_sync(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                       meta=meta)

    async def aclose(self) -> None:
        """Stop what attached to it, then its line's background tasks and threads (as RedisBudget's);
        the prefill legs it keeps (fleet/pd.py) are released and its prefill pool closed."""
        await self._close_attached()
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)
        if deferred.pending():  # prefill legs kept for their KV's lease (fleet/pd.py): the fleet goes away
            await asyncio.to_thread(deferred.run_now, self)
        await self._line.aclose()
        if self.pd is not None:  # its prefill pool (disaggregate()) goes with it
            await self.pd.prefill.aclose()

    # ------------------------------------------------------------------ the budget: its line's
    @property
    def _side(self) -> AsyncFace | None:
        return self._line._side

    @property
    def _sync_face(self) -> SyncFace:
        return self._line._sync_face

    def _get_side(self) -> AsyncFace:
        return self._line._get_side()

    @property
    def _closed(self) -> bool:
        return self._line._closed

    @property
    def limit(self) -> int:
        """The line's limit last seen in Redis (the largest replica's; per replica: ``status()``)."""
        return self._line.limit

    @property
    def policy_name(self) -> str:
        return self._line.policy_name

    @property
    def reads_forecast_spread(self) -> bool:
        """As RedisBudget's: the replicas' policy has a forecast-error reserve (``reserve_z`` /
        ``reserve_k``), so the transport sends upper forecasts."""
        return self._line.reads_forecast_spread

    @property
    def config(self) -> Config:
        """The validated settings the fleet's line was made with."""
        return self._line.config

    @property
    def supports_pins(self) -> bool:
        return self._line.supports_pins

    def shared_forecaster(self, **kwargs: Any) -> LengthForecaster:
        """As :meth:`RedisBudget.shared_forecaster` (the fleet's name, every process of the fleet)."""
        return self._line.shared_forecaster(**kwargs)

    def new_retry_budget(
        self, *, ratio: float = 0.5, floor_per_s: float = 0.5, window_s: float = 20.0
    ) -> RedisRetryBudget:
        """As :meth:`RedisBudget.new_retry_budget`: one retry budget for every process of the fleet."""
        return self._line.new_retry_budget(ratio=ratio, floor_per_s=floor_per_s, window_s=window_s)

    def retry_budget(self, settings: Settings | None = None) -> RetryBudget:
        """The line's shared retry budget (:meth:`Budget.retry_budget`; closed with the fleet)."""
        return self._line.retry_budget(settings)

    def add_event_hook(self, hook: Callable[[RedisBudgetEvent], None]) -> None:
        self._line.add_event_hook(hook)

    async def _adaptive(self, op: str, controller: str, ttl_ms: int = 0, overloads: int = 0,
                        fields: Mapping[str, object] | None = None) -> list[object]:
        return await self._line._adaptive(op, controller, ttl_ms, overloads, fields)

    async def pin(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                  span: int | None = None) -> None:
        await self._line.pin(key, blocks, margin=margin, track=track, span=span)

    async def unpin(self, key: str) -> bool:
        return await self._line.unpin(key)

    async def keepwarm_due(self) -> list[str]:
        return await self._line.keepwarm_due()

    async def claim_keepwarm(self, key: str, ttl_s: float) -> bool:
        return await self._line.claim_keepwarm(key, ttl_s)

    async def flush(self) -> None:
        """Send every lease's latest held report now (as :meth:`RedisBudget.flush`)."""
        await self._line.flush()

    def close_sync(self) -> None:
        """Stop what attached to it on a thread of its own, then the line's threads (as
        :meth:`RedisBudget.close_sync`; for programs without an event loop)."""
        self._close_attached_sync()
        self._line.close_sync()

    async def _loop_ending(self) -> None:
        await self._line._loop_ending()

    def __repr__(self) -> str:
        return f"<RedisFleet {self.name} replicas={len(self._urls)}>"


class _RedisFleetLine(RedisBudget):
    """A fleet's line (private; each :class:`RedisFleet` composes one): a RedisBudget in fleet mode (its
    scripts place each waiter on a replica). The hooks below are the fleet's: the first acquire checks
    the name holds a fleet, and a release carries the request's success and lands after the health
    reports made before it."""

    fleet: RedisFleet
    """The fleet that composes this line (set by it at once)."""
    _checked = False

    async def acquire(
        self, blocks: int, *, priority: int = 0, timeout: float | None = None, ticket: Ticket | None = None,
        held: int | None = None, meta: Mapping[str, object] | None = None,
    ) -> Lease:
        if not self._checked:
            await self._get_side().eval("fleet", ["status", ""])  # creates the fleet, or refuses the name
            self._checked = True
        return await super().acquire(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                     meta=meta)

    def acquire_sync(
        self, blocks: int, *, priority: int = 0, timeout: float | None = None, ticket: Ticket | None = None,
        held: int | None = None, meta: Mapping[str, object] | None = None,
    ) -> Lease:
        if not self._checked:
            self._sync_face.eval("fleet", ["status", ""])
            self._checked = True
        return super().acquire_sync(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                    meta=meta)

    def _release_lease_sync(self, lease: RedisLease) -> None:
        if lease.lost:
            self._core.fleet_ok.discard(lease.id)  # no release call will carry it
        super()._release_lease_sync(lease)

    async def _release_lease(self, lease: RedisLease) -> None:
        if lease.lost:
            self._core.fleet_ok.discard(lease.id)
        pending = self.fleet._pending
        if pending:  # health reports made before the release land first (its success resets them)
            await asyncio.gather(*list(pending), return_exceptions=True)
        await super()._release_lease(lease)
