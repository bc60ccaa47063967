"""The script layer of RedisBudget, written once for both faces: keys, Lua loading, arguments, replies,
error mapping, and the budget's view of Redis (limit, epoch, policy, availability, events). No I/O:
``_async.py`` and ``_sync.py`` run the commands it builds. See docs/redis.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Protocol

from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    MaxConnectionsError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from zp_client.budget.base import BudgetStatus, ClassStatus, Lease, Ticket
from zp_client.budget.elastic import (
    DEFAULT_RESERVE_K,
    DEFAULT_RESERVE_Z,
    DEFAULT_URGENT_RESERVE,
    admission_meta,
)
from zp_client.budget.ledger import AGE_KEY, ANSWER_KEY, TPOT_TARGET_KEY, TTFT_TARGET_KEY, line_deadline
from zp_client.budget.predict import ErrorWindow, PoolTiming, refusal
from zp_client.budget.redis._meta import META_FLAGS, META_KEYS, SHORT_KEYS, text
from zp_client.budget.redis._snapshot import class_heads_predicted, ledger_from_snapshot, predict_waiter
from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import BudgetUnavailable, ConfigurationError, DeadlineExceeded, LeaseTooLarge, ZPError

log = logging.getLogger("zp_client.budget.redis")

# Real connection failures: only these count as Redis being unavailable.
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# What a script call may raise once mapped (for background loops that log a failure and go on).
CALL_FAILED = (ZPError, RedisError, OSError)
# What a face catches around a script call and hands to Attempts.after.
HANDLED = (RedisError, OSError)
# The pools of the clients a budget makes itself: commands beyond them wait for a free connection.
POOL_SIZE = 100
_POOL_FULL_BACKOFF_CAP_S = 0.05
PRIORITY_RANGE = 4096
SCRIPTS = ("init", "acquire", "release", "renew", "poll", "held", "set_limit", "status", "adaptive", "fleet",
           "pin", "snapshot")
_KEY_SUFFIXES = ("meta", "leases", "lexp", "line", "wait", "wexp", "cls")
RENEW_BATCH = 200
RELEASE_WAIT_S = 1.0  # the longest a caller's release waits for Redis; the rest goes on in the background
MAILBOX_BLOCK_S = 30.0  # BLPOP timeout; wake-ups end it at once, the poller covers lost ones
SYNC_PUMP_BLOCK_S = 5.0  # the sync pump's BLPOP timeout (each sync waiter also polls every poll_interval_s)
POLICIES = ("strict", "elastic")


def compact_meta(meta: Mapping[str, Any], *, update: bool) -> dict[str, Any]:
    """The policy-relevant part of ``meta`` with short keys (see ``lua/common.lua``).

    Flags keep Python truthiness (``streaming=None`` reads as not streamed, as in ElasticPolicy). In an
    update, ``None`` removes a field. Raises :class:`ConfigurationError` for a negative or non-integer
    count or an over-long prefix key (the Lua scripts refuse them too).
    """
    out: dict[str, Any] = {}
    for k, v in meta.items():
        short = META_KEYS.get(k)
        if short is None:
            continue
        if short in META_FLAGS:
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
                raise ConfigurationError(
                    f"meta {k} must be a number of tokens/blocks in [0, 1e12], got {v!r}")
            out[short] = int(v)
    return out


#: The line's fields (zp_client.budget.ledger: TTFT_TARGET_KEY...), sent in milliseconds under any policy.
_LINE_KEYS = {TTFT_TARGET_KEY: "tt", TPOT_TARGET_KEY: "tp", AGE_KEY: "ag", ANSWER_KEY: "an"}


def line_meta(meta: Mapping[str, Any]) -> dict[str, int]:
    """The SLO-aware line's fields of ``meta`` in whole milliseconds, short keys ``tt`` (TTFT target),
    ``tp`` (TPOT target), ``ag`` (the request's age at this enqueue) and ``an`` (a non-streamed call's
    answer allowance); acquire.lua computes the waiter's deadline ``now - ag + tt + an`` on Redis TIME
    (:func:`~zp_client.budget.ledger.line_deadline`). Raises
    :class:`~zp_client.errors.InvalidRequest` as :func:`~zp_client.budget.ledger.line_deadline` does.
    A target is rounded up to at least 1 ms (it is positive)."""
    line_deadline(meta, 0.0)  # validates
    out: dict[str, int] = {}
    for k, short in _LINE_KEYS.items():
        v = meta.get(k)
        if v is not None:
            ms = min(round(float(v) * 1000), 10**12)
            out[short] = ms if short in ("ag", "an") else max(1, ms)
    return out


def thousandths(v: float) -> int:
    """A reserve factor as init.lua takes it (``ElasticPolicy``'s exact integer rule reads it so too)."""
    return round(v * 1000)


def meta_json(compact: Mapping[str, Any]) -> str:
    return json.dumps(compact, separators=(",", ":")) if compact else ""


def load_lua(name: str) -> str:
    """The text of ``lua/<name>`` (without ``common.lua``)."""
    return (resources.files("zp_client.budget.redis") / "lua" / name).read_text(encoding="utf-8")


def _load_scripts() -> dict[str, tuple[str, str]]:
    common = load_lua("common.lua")
    out: dict[str, tuple[str, str]] = {}
    for name in SCRIPTS:
        text = common + "\n" + load_lua(f"{name}.lua")
        out[name] = (text, hashlib.sha1(text.encode()).hexdigest())
    return out


_SCRIPT_CACHE: dict[str, tuple[str, str]] | None = None


def scripts() -> dict[str, tuple[str, str]]:
    """``{script name: (text, sha1)}``, each budget script with ``common.lua`` in front."""
    global _SCRIPT_CACHE
    if _SCRIPT_CACHE is None:
        _SCRIPT_CACHE = _load_scripts()
    return _SCRIPT_CACHE


_SHAS: dict[str, bytes] = {}


def _shas() -> dict[str, bytes]:
    _SHAS.update({k: sha.encode() for k, (_, sha) in scripts().items()})
    return _SHAS


def adaptive_from(r: list[Any]) -> dict[str, Any]:
    """The adaptive limit's state from status.lua's tail ``[hash fields, leader id, leader PTTL ms, now ms]``
    (see adaptive.lua): the hash's fields (numbers where they are numbers), ``leader`` the current
    holder (None when the lease lapsed), ``leader_ttl_s`` its lease's time left, ``last_change_age_s``
    seconds since the last change on Redis's clock."""
    flat = [text(x) for x in r[0]]
    out: dict[str, Any] = {}
    for k, v in zip(flat[::2], flat[1::2], strict=False):
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    leader, pttl, now = text(r[1]), int(r[2]), int(r[3])
    out["leader"] = leader or None
    out["leader_ttl_s"] = pttl / 1000 if leader and pttl >= 0 else None
    at = out.get("last_change_ms")
    out["last_change_age_s"] = max(0, now - at) / 1000 if isinstance(at, int) else None
    return out


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


@dataclass(frozen=True)
class Config:
    """A RedisBudget's validated settings (seconds in ``_s`` fields)."""

    name: str
    limit: int
    block_size: int
    lease_ttl_s: float
    poll_interval_s: float
    waiter_ttl_s: float
    starvation_bound_s: float
    longest_first_s: float
    line: str
    late_bound_s: float
    policy: str
    recovery_s: float
    on_unavailable: str
    unavailable_timeout_s: float
    local_share: float
    held_report_blocks: int | None
    reserve_z: float = DEFAULT_RESERVE_Z
    """elastic's spread-sized reserve (``ElasticPolicy(reserve_z=...)``), validated and rounded as the
    policy does; stored at creation (the creator's wins)."""
    reserve_k: float = DEFAULT_RESERVE_K
    """elastic's risk reserve (``ElasticPolicy(reserve_k=...)``), likewise."""
    urgent_reserve: float = DEFAULT_URGENT_RESERVE
    """elastic's urgent reserve (``ElasticPolicy(urgent_reserve=...)``), likewise."""


@dataclass(frozen=True)
class AcquireReply:
    """acquire.lua's answer: ``granted`` with the lease's ticket and epoch, or waiting in line."""

    granted: bool
    ticket: Ticket
    epoch: str
    recovery_left_s: float
    replica: str | None = None
    """Fleet mode: the base URL of the replica the lease was placed on."""


class FleetHooks(Protocol):
    """What a Redis fleet (``zp_client.fleet.redis``) adds to its budget's script layer."""

    def route_arg(self, meta: Mapping[str, Any] | None) -> dict[str, Any]: ...

    def init_arg(self) -> str: ...

    def replica_id(self, url: str | None) -> str: ...

    def replica_url(self, rid: str) -> str | None: ...


Report = tuple["RedisLease", int, dict[str, Any]]  # a lease, the held value sent, the metadata sent


class Attempts:
    """The retry rules of one script call. A face runs the command and, when it fails, sleeps for
    :meth:`after`'s answer and tries again (loading the script first when :attr:`load` is set).

    Made at a call's first failure (the fast path builds nothing). A full pool (``MaxConnectionsError``
    from a caller's non-blocking pool) is back-pressure: waited out with a short backoff, never reported
    as an outage nor bounded by ``unavailable_timeout_s``. Real connection failures are retried for
    ``unavailable_timeout_s`` from the first one (``patient=False``: not at all), then
    :class:`BudgetUnavailable` is raised.
    """

    def __init__(self, core: Core, script: str, patient: bool) -> None:
        self.core = core
        self.text, self.sha = scripts()[script]
        self.patient = patient
        self.load = False
        self._deadline: float | None = None  # set at the first real connection failure, not a full pool
        self._delay = 0.02
        self._full_delay = 0.001

    def after(self, exc: BaseException) -> float:
        """Seconds to wait before the next try, or raise the error the caller sees."""
        core = self.core
        if isinstance(exc, (AuthenticationError, AuthorizationError)):
            raise core.credentials_error(exc) from exc
        if isinstance(exc, NoScriptError) or (isinstance(exc, ResponseError) and "NOSCRIPT" in str(exc)):
            self.load = True
            return 0.0
        if isinstance(exc, ResponseError):
            raise core.refused_error(exc) from exc
        if isinstance(exc, MaxConnectionsError):
            delay, self._full_delay = self._full_delay, min(self._full_delay * 2, _POOL_FULL_BACKOFF_CAP_S)
            return delay
        if isinstance(exc, UNAVAILABLE):
            core.mark_available(False)
            now = SYSTEM_CLOCK.monotonic()
            if self._deadline is None:
                self._deadline = now + core.cfg.unavailable_timeout_s
            if not self.patient or now + self._delay > self._deadline:
                raise core.unavailable_error(exc) from exc
            delay, self._delay = self._delay, min(self._delay * 2, core.backoff_cap_s)
            return delay
        raise exc


class Core:
    """What both faces of one RedisBudget share: its keys and configuration, the arguments of each
    script and the reading of each reply, error mapping, and what it learned from Redis."""

    def __init__(self, cfg: Config, url: str | None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.url = url
        self.prefix = f"{{zp:{cfg.name}}}"
        self.keys = [f"{self.prefix}:{s}" for s in _KEY_SUFFIXES]
        # EVALSHA's numkeys and keys: the meta key alone (the scripts derive the others from its prefix).
        # Constant arguments are encoded once (bytes skip redis-py's per-argument encoding).
        self.key_args = (b"1", self.keys[0].encode())
        self.owner = secrets.token_urlsafe(12)
        self._owner_b = self.owner.encode()
        self._ttl_b = str(int(cfg.lease_ttl_s * 1000)).encode()
        self._wttl_b = str(int(cfg.waiter_ttl_s * 1000)).encode()
        self._hb_b = str(max(1, int(cfg.poll_interval_s * 1000))).encode()
        # The claim window of this process's grants (docs/redis.md, "Grants are claimed"): a grant pass's
        # grant to one of its waiters is pending until its acquire (repeated after the wake-up) or its poll
        # claims it, and goes back to the pool after this long. waiter_ttl_s: the slowest way a live
        # process learns of a grant is its next poll (a lost wake-up), at most poll_interval_s later, and
        # a process that cannot poll within waiter_ttl_s loses its waiters anyway.
        self._claim_b = str(max(1, int(cfg.waiter_ttl_s * 1000))).encode()
        # The heartbeat slack (docs/redis.md, "Heartbeats measured against the round trip"): the longest
        # round trip of this process's recent heartbeats (polls, the sync face's repeated acquires), added
        # to the waiter TTL and the claim window it sends, so that a Redis slowed by a queue of scripts
        # does not expire a live process's waiters (a heartbeat arrives a round trip after the previous
        # reply at the earliest). Capped so that a dead process's blocks are still back within
        # lease_ttl_s + poll_interval_s (waiters and pending grants: 2 x (waiter_ttl_s + slack)).
        self.hb_slack_cap_s = max(0.0, (cfg.lease_ttl_s + cfg.poll_interval_s) / 2 - cfg.waiter_ttl_s)
        self._rtt_window_s = max(1.0, cfg.poll_interval_s)
        self._rtt_cur = 0.0  # the longest heartbeat round trip in the current window
        self._rtt_prev = 0.0  # ... in the window before it
        self._rtt_since = -math.inf  # when the current window began (monotonic)
        self.sync_box = self.owner + ".s"  # the sync waiters' mailbox (the async side's is the owner's)
        self.policy = cfg.policy
        self.policy_known = False  # the stored policy is read once (the creator's choice wins)
        # elastic's forecast-error reserves (reserve_z, reserve_k): the configured ones until the stored
        # ones (the creator's) are read with the policy
        self.reserve = (cfg.reserve_z, cfg.reserve_k)
        self.urgent = cfg.urgent_reserve  # elastic's urgent reserve, likewise
        self.warned_reserve = False
        self.limit = cfg.limit
        self.epoch: str | None = None
        # Reconnect attempts stay frequent enough that holders re-adopt well within a recovery window.
        self.backoff_cap_s = min(1.0, cfg.lease_ttl_s / 4)
        self.hooks: list[Callable[[RedisBudgetEvent], None]] = []
        self.counters: dict[str, int] = {
            "readopted": 0, "lease_lost": 0, "unavailable": 0, "fallback_local": 0, "release_retried": 0,
        }
        self.was_unavailable = False
        self.fallback_logged = False
        self.warned_limit = False
        self.fleet: FleetHooks | None = None  # set by a RedisFleet: fleet mode of the same scripts
        self.fleet_ok: set[str] = set()  # fleet: leases whose request succeeded (told with the release)
        self.pins: dict[str, list[Any]] = {}  # prefix key -> pin.lua's arguments (renewed with the leases)
        self.first_tokens: set[str] = set()  # elastic leases that saw their first token (release.lua)
        # the pace last measured on the live leases by a wait prediction of this process (its fallback
        # while no lease has reported tokens, as LocalBudget's)
        self.timing: PoolTiming | None = None
        # this process's fail-fast predictions and their errors (LocalBudget's margin and bias): request id
        # -> (when predicted, its class, the replay's prediction) until its grant records the error; both
        # faces use them (the async one on its loop, the sync one on the callers' threads): under the lock
        self.errors = ErrorWindow()
        self.predicted: dict[str, tuple[float, int, float]] = {}
        self.errors_lock = threading.Lock()

    # ------------------------------------------------------------------ keys and arguments
    def attempts(self, script: str, patient: bool) -> Attempts:
        return Attempts(self, script, patient)

    @staticmethod
    def sha(script: str) -> bytes:
        return _SHAS[script] if _SHAS else _shas()[script]

    def mailbox(self, box: str) -> str:
        return f"{self.prefix}:mb:{box}"

    @property
    def held_report_blocks(self) -> int:
        """Held growth that makes a report urgent: ``held_report_blocks`` when given, else 1 block under
        elastic (the projected peak reads held as the present) and 2 under strict (accounting only)."""
        if self.cfg.held_report_blocks is not None:
            return self.cfg.held_report_blocks
        return 1 if self.policy == "elastic" else 2

    def meta_arg(self, meta: Mapping[str, Any] | None, bound: int, timeout: float | None = None) -> str:
        """acquire.lua's meta argument: the compact policy fields, ``max_output_tokens`` derived from the
        bound as the Ledger does (:func:`~zp_client.budget.elastic.admission_meta`). In fleet mode the
        request's routing (``k``, ``s``, ``a``: never a policy field's name) travels in the same object.
        ``timeout`` (the acquire's, seconds; not in fleet mode): sent as ``gu`` in whole milliseconds, the
        waiter's give-up time for the wait prediction (docs/admission.md#predicted-wait-and-fail-fast)."""
        if meta is not None and not isinstance(meta, Mapping):
            raise ConfigurationError(f"meta must be a mapping (see zp_client.budget.elastic), got {meta!r}")
        out: dict[str, Any] = {}
        if self.policy == "elastic" and meta:
            out = compact_meta(admission_meta(meta, bound, self.cfg.block_size), update=False)
        if meta:
            out.update(line_meta(meta))
        if self.fleet is not None:
            out.update(self.fleet.route_arg(meta))
        elif timeout is not None and math.isfinite(timeout):
            out["gu"] = min(10**12, max(0, math.ceil(timeout * 1000)))
        return meta_json(out)

    def observe_rtt(self, rtt_s: float, now: float) -> None:
        """A heartbeat's round trip (send to reply, monotonic seconds) measured at ``now``."""
        if now - self._rtt_since >= self._rtt_window_s:
            fresh = now - self._rtt_since < 2 * self._rtt_window_s
            self._rtt_prev = self._rtt_cur if fresh else 0.0
            self._rtt_cur, self._rtt_since = 0.0, now
        self._rtt_cur = max(self._rtt_cur, rtt_s)

    @property
    def hb_slack_s(self) -> float:
        """The slack added to the waiter TTL and the claim window: the longest heartbeat round trip of the
        last one to two windows of ``max(1 s, poll_interval_s)``, at most :attr:`hb_slack_cap_s`."""
        return min(self.hb_slack_cap_s, max(self._rtt_cur, self._rtt_prev))

    def waiter_ttl_ms(self) -> int:
        """The waiter TTL a heartbeat sends now: ``waiter_ttl_s`` plus :attr:`hb_slack_s`."""
        return max(1, int((self.cfg.waiter_ttl_s + self.hb_slack_s) * 1000))

    def refresh_waiter_ttl(self, args: list[Any]) -> None:
        """Update acquire arguments made earlier (a repeated acquire) to the waiter TTL and claim window
        with the current slack."""
        args[8] = args[11] = str(self.waiter_ttl_ms()).encode()

    def acquire_args(
        self, rid: str, bound: int, held: int, prio: int, order: int, box: str, meta: str
    ) -> list[Any]:
        args = [rid, bound, held, prio, order, self._ttl_b, box, self._owner_b, self._wttl_b, meta,
                self._hb_b, self._claim_b]
        self.refresh_waiter_ttl(args)
        return args

    def release_args(self, lid: str) -> list[Any]:
        # ARGV[4]: the lease saw its first token (a report still batched may not have reached Redis: a
        # pinned prefix's member must count as touching it, pins.py)
        f1 = b"1" if lid in self.first_tokens else b""
        self.first_tokens.discard(lid)
        if self.fleet is not None and lid in self.fleet_ok:
            self.fleet_ok.discard(lid)
            return [lid, self._owner_b, b"1", f1]
        return [lid, self._owner_b, b"", f1] if f1 else [lid, self._owner_b]

    def poll_args(self, ids: Iterable[str]) -> list[Any]:
        return [self.waiter_ttl_ms(), self._owner_b, *ids]

    def init_args(self, recovery_s: float | None = None) -> list[Any]:
        """init.lua's arguments; ``recovery_s`` overrides the configured recovery window (0 for an explicit
        create: see :meth:`RedisBudget.create <zp_client.budget.redis.RedisBudget.create>`)."""
        cfg = self.cfg
        rec_s = cfg.recovery_s if recovery_s is None else recovery_s
        starve_ms = int(min(cfg.starvation_bound_s, 1e12) * 1000)  # inf: unbounded backfill
        lpt_ms = math.ceil(min(cfg.longest_first_s, 1e12) * 1000)  # never rounded down to "off"
        args: list[Any] = [cfg.limit, cfg.block_size, secrets.token_urlsafe(12), int(rec_s * 1000),
                           cfg.policy, starve_ms, lpt_ms]
        args.append(self.fleet.init_arg() if self.fleet is not None else "")
        args += [cfg.line, int(min(cfg.late_bound_s, 1e12) * 1000)]  # inf: never late-bound
        args += [thousandths(cfg.reserve_z), thousandths(cfg.reserve_k), thousandths(cfg.urgent_reserve)]
        return args

    def renew_args(self, batch: list[RedisLease]) -> list[Any]:
        args: list[Any] = [self.owner, int(self.cfg.lease_ttl_s * 1000)]
        for le in batch:
            extra = meta_json(le._meta_all) if self.policy == "elastic" else ""
            if self.fleet is not None:
                extra = f"{self.fleet.replica_id(le.replica)}|{extra}"
            args += [le.id, le.epoch, le.bound, le._held, le.priority, le.ticket.order, extra]
        return args

    def take_reports(
        self, leases: Iterable[RedisLease], *, changed_only: bool
    ) -> tuple[list[Any], list[Report]]:
        """held.lua's arguments for ``leases`` (``changed_only``: those with something unsent) and what
        was taken from each (give it to :meth:`reports_sent` or :meth:`reports_failed`)."""
        args: list[Any] = [self.owner]
        sent: list[Report] = []
        for le in leases:
            if le._released or (changed_only and le._held == le._sent_held and not le._meta_pending):
                continue
            v, mj, pending = le._take_report()
            args += [le.id, v, mj]
            sent.append((le, v, pending))
        return args, sent

    @staticmethod
    def reports_sent(sent: list[Report]) -> None:
        for le, v, _ in sent:
            le._sent_held = v

    @staticmethod
    def reports_failed(sent: list[Report], exc: BaseException | None) -> None:
        """The next renewal carries held; metadata waits for the next report."""
        for le, _, pending in sent:
            le._report_failed(pending)
        if exc is not None:
            log.debug("zp_client: held report failed: %r", exc)

    # ------------------------------------------------------------------ replies
    @staticmethod
    def needs_init(r: Any) -> bool:
        """True for a ``{'I'}`` reply: the budget does not exist yet (init.lua first)."""
        return isinstance(r, list) and bool(r) and r[0] in (b"I", "I")

    def acquire_reply(self, r: list[Any], bound: int) -> AcquireReply:
        code = text(r[0])
        if code == "X":  # r[1]: the size limit (the limit, or more while a temporary cut keeps it)
            raise LeaseTooLarge(bound, int(r[1]))
        self.learn_limit(int(r[4]))
        ticket = Ticket(int(r[2]), int(r[1]))
        if code == "G":
            return AcquireReply(True, ticket, text(r[3]), 0.0, text(r[5]) if len(r) > 5 else None)
        return AcquireReply(False, ticket, text(r[3]), int(r[5]) / 1000)

    def after_init(self, r: list[Any]) -> None:
        created, limit, epoch, policy, rec_left = int(r[0]), int(r[1]), text(r[3]), text(r[4]), int(r[6])
        if self.fleet is not None and (len(r) < 8 or int(r[7]) != 1):
            raise ConfigurationError(
                f"Redis budget {self.name!r} exists and is not a fleet; give the RedisFleet another name")
        self.limit = limit
        self.epoch = epoch
        self.learn_policy(policy)
        if len(r) > 9:
            self.learn_reserve(int(r[8]), int(r[9]), int(r[10]) if len(r) > 10 else 0)
        if created:
            self.warned_limit = True  # our own limit is the stored one
            if rec_left > 0:
                log.warning(
                    "zp_client: created Redis budget %r (limit %d blocks) as its state was absent (a new "
                    "name, or Redis lost it); recovery: admitting nothing new for %.3g s while holders that "
                    "survived a Redis restart re-adopt their leases. A new budget skips this wait when "
                    "created explicitly first: RedisBudget.create(...) or 'zp-client budget create'",
                    self.name, limit, rec_left / 1000,
                )
            else:
                log.info("zp_client: created Redis budget %r (limit %d blocks) with no recovery window",
                         self.name, limit)
            self.emit("created", recovery_s=rec_left / 1000)
        else:
            self.learn_limit(limit)

    def learn_limit(self, limit: int) -> None:
        self.limit = limit
        if limit != self.cfg.limit and not self.warned_limit:
            self.warned_limit = True
            log.warning(
                "zp_client: Redis budget %r already exists with limit %d blocks; this process was configured "
                "with %d and follows the stored limit (use set_limit to change it for the fleet)",
                self.name, limit, self.cfg.limit,
            )
            self.emit("limit_mismatch", stored=limit, configured=self.cfg.limit)

    def learn_policy(self, policy: str) -> None:
        self.policy_known = True
        if policy != self.policy and policy in POLICIES:
            log.warning("zp_client: Redis budget %r exists with policy %r; this process was configured with "
                        "%r and follows the stored one (configure every process alike: the transport picks "
                        "what to report from the configured policy)", self.name, policy, self.policy)
            self.policy = policy

    def learn_reserve(self, rz: int, rk: int, ru: int = 0) -> None:
        """The stored reserves (thousandths: init.lua, status.lua; ``ru`` the urgent reserve) replace the
        configured ones; a process configured otherwise is told once, as for the policy."""
        stored = (rz / 1000, rk / 1000)
        urgent = ru / 1000
        if (stored != self.reserve or urgent != self.urgent) and not self.warned_reserve:
            self.warned_reserve = True
            log.warning("zp_client: Redis budget %r exists with reserve_z=%g, reserve_k=%g, "
                        "urgent_reserve=%g; this process was configured with reserve_z=%g, reserve_k=%g, "
                        "urgent_reserve=%g and "
                        "follows the stored ones (the budget's creator chooses them; configure every process "
                        "alike)", self.name, *stored, urgent, *self.reserve, self.urgent)
        self.reserve = stored
        self.urgent = urgent

    def learn_status(self, r: list[Any]) -> None:
        if int(r[0]) == 1:
            self.learn_policy(text(r[6]))
            if len(r) > 23:
                self.learn_reserve(int(r[22]), int(r[23]), int(r[24]) if len(r) > 24 else 0)

    def status_from(self, r: list[Any]) -> BudgetStatus:
        if int(r[0]) == 0:
            return BudgetStatus(
                limit=self.cfg.limit, used=0, free=self.cfg.limit, held=0, leases=0,
                policy=self.policy, block_size=self.cfg.block_size,
                extra={"exists": False, "name": self.name, "counters": dict(self.counters)},
            )
        limit, bsum, hsum, nl = int(r[1]), int(r[2]), int(r[3]), int(r[4])
        used = int(r[13]) if len(r) > 13 else bsum  # elastic: the projected peak
        self.limit = limit
        self.learn_status(r)
        flat = [text(x) for x in r[12]]
        cls: dict[int, list[int]] = {}
        for k, v in zip(flat[::2], flat[1::2], strict=False):
            p = int(k[1:])
            cls.setdefault(p, [0, 0])[0 if k[0] == "n" else 1] = int(v)
        waiters = {p: ClassStatus(waiters=n, weight=w) for p, (n, w) in sorted(cls.items()) if n > 0}
        return BudgetStatus(
            limit=limit, used=used, free=max(0, limit - used), held=hsum, leases=nl, waiters=waiters,
            head_wait_s=int(r[10]) / 1000, policy=text(r[6]), block_size=int(r[8]),
            extra={
                "exists": True, "name": self.name, "epoch": text(r[5]),
                "starvation_bound_s": int(r[7]) / 1000,
                "recovering": int(r[9]) > 0, "recovery_left_s": int(r[9]) / 1000, "limit_version": int(r[11]),
                "bound_sum": bsum,
                # grants made, not yet claimed by their process (reserved: part of bound_sum and used)
                "pending_grants": int(r[18]) if len(r) > 20 else 0,
                "pending_blocks": int(r[19]) if len(r) > 20 else 0,
                "unclaimed_grants": int(r[20]) if len(r) > 20 else 0,
                # held leases whose renewal came late while their process talked to Redis: kept (reap_late)
                "deferred_reclaims": int(r[21]) if len(r) > 21 else 0,
                "counters": dict(self.counters),
                **({"adaptive": adaptive_from(r[14:18])} if len(r) > 17 and (r[14] or text(r[15])) else {}),
            },
        )

    def fail_fast_refusal(self, reply: list[Any], rid: str, left_s: float,
                          t0: float | None = None) -> DeadlineExceeded | None:
        """A fail-fast waiter that just queued: its refusal when the wait predicted from ``reply`` (a
        ``snapshot.lua`` reply read after the enqueue) on a measured pace exceeds ``left_s``, the time
        left before its deadline; None when not predicted (docs/admission.md#predicted-wait-and-fail-fast).
        ``t0``: this process's clock just before the snapshot call, from which the actual wait is counted
        for the error window (default: now). Never raises: a prediction that cannot be made leaves the
        waiter waiting, as without it."""
        try:
            snap = ledger_from_snapshot(reply)
            pred = None if snap is None else predict_waiter(snap, rid, self.timing)
        except Exception:  # noqa: BLE001 - a prediction must never fail the acquire
            log.debug("zp_client: wait prediction failed; the waiter waits as without it", exc_info=True)
            return None
        if pred is None:
            return None
        if pred.timing is not None and pred.timing.samples > 0:
            self.timing = pred.timing
        rec = snap.ledger.waiter(rid) if snap is not None else None
        prio = rec.priority if rec is not None else 0
        with self.errors_lock:
            refused = refusal(pred, left_s, margin=self.errors.margin(prio), bias=self.errors.bias(prio),
                              calibrated=self.errors.calibrated())
            if refused is None and pred.exact:
                # the actual wait counts from t0 (before the snapshot call: the prediction's origin)
                self.predicted[rid] = (SYSTEM_CLOCK.monotonic() if t0 is None else t0, prio, pred.wait_s)
        return refused

    def prediction_granted(self, rid: str) -> None:
        """The request ``rid`` was granted: its prediction's error (if it was predicted) joins the window
        its class's margin and bias come from."""
        if not self.predicted:
            return
        with self.errors_lock:
            p = self.predicted.pop(rid, None)
            if p is not None:
                self.errors.record(p[1], p[2], SYSTEM_CLOCK.monotonic() - p[0])

    def forget_prediction(self, rid: str) -> None:
        """The request ``rid`` left without a grant (refused, timed out, cancelled): no error to record."""
        if self.predicted:
            with self.errors_lock:
                self.predicted.pop(rid, None)

    def predicted_heads(self, reply: list[Any]) -> dict[int, float] | None:
        """``BudgetStatus.predicted_wait_s`` from a ``snapshot.lua`` reply; None: no prediction made."""
        try:
            snap = ledger_from_snapshot(reply)
            if snap is None:
                return None
            heads = class_heads_predicted(snap, self.timing)
            with self.errors_lock:
                return {p: max(0.0, w - self.errors.bias(p)) for p, w in heads.items()}
        except Exception:  # noqa: BLE001 - status must answer even when the replay cannot run
            log.debug("zp_client: wait prediction failed; status has none", exc_info=True)
            return None

    def after_renew(
        self, batch: list[RedisLease], r: list[Any], registry: dict[str, RedisLease]
    ) -> list[RedisLease]:
        """Read renew.lua's reply for ``batch``; returns the leases whose holder released them while the
        renewal was in flight but which the renewal re-adopted (release them again)."""
        epoch = text(r[0])
        self.epoch = epoch
        again: list[RedisLease] = []
        for le, code in zip(batch, r[1:], strict=False):
            code = int(code)
            if le._released:
                # Released by its holder while this renewal was in flight: the release may have reached
                # Redis first, so "not found" here is that release, not a loss (no lease_lost). A lease
                # the renewal re-adopted meanwhile (new epoch) would be counted again: release it again.
                if code == 2:
                    again.append(le)
                continue
            if code == 2:
                le.epoch = epoch
                le._sent_held = le._held
                log.warning("zp_client: re-adopted lease %s... (%d blocks) in Redis budget %r after Redis "
                            "lost it", le.id[:8], le.bound, self.name)
                self.emit("readopted", le.id, bound=le.bound, epoch=epoch)
            elif code == -2:  # a fleet replica's ejection released it (expected: not a pause)
                le._lost = True
                registry.pop(le.id, None)
                log.warning("zp_client: lease %s... (%d blocks) in Redis fleet %r was released by its "
                            "replica's ejection", le.id[:8], le.bound, self.name)
                self.emit("lease_lost", le.id, bound=le.bound, reason="ejected")
            elif code in (0, -1):
                le._lost = True
                registry.pop(le.id, None)
                log.error("zp_client: lease %s... (%d blocks) in Redis budget %r was lost (expired while its "
                          "holder ran: event loop or process paused longer than lease_ttl_s?)",
                          le.id[:8], le.bound, self.name)
                self.emit("lease_lost", le.id, bound=le.bound)
        return again

    # ------------------------------------------------------------------ errors, availability, events
    def credentials_error(self, exc: BaseException) -> ConfigurationError:
        return ConfigurationError(
            f"Redis refused the credentials for budget {self.name!r} ({exc}); check the user/password "
            "in the URL (redis://user:password@host:port/db) and the ACL"
        )

    def refused_error(self, exc: BaseException) -> ConfigurationError:
        return ConfigurationError(f"Redis budget {self.name!r} refused the call: {exc}")

    def unavailable_error(self, exc: BaseException) -> BudgetUnavailable:
        return BudgetUnavailable(
            f"Redis budget {self.name!r} unreachable for {self.cfg.unavailable_timeout_s:.3g} s "
            f"({exc}); nothing was admitted. Check the Redis URL/server, or use "
            "on_unavailable='fail_local' to degrade to a per-process share"
        )

    def release_failed(self, lid: str, exc: BaseException | None) -> float:
        """Log and count a release that must be retried in the background; returns when to give up
        (monotonic: the lease has expired by its TTL then)."""
        log.warning("zp_client: release of %s... in Redis budget %r failed (%r); retrying in the background",
                    lid[:8], self.name, exc)
        self.counters["release_retried"] += 1
        return SYSTEM_CLOCK.monotonic() + self.cfg.lease_ttl_s

    def mark_available(self, ok: bool) -> None:
        if ok and self.was_unavailable:
            self.was_unavailable = False
            self.fallback_logged = False
            log.warning("zp_client: Redis budget %r reachable again", self.name)
            self.emit("available")
        elif not ok and not self.was_unavailable:
            self.was_unavailable = True
            log.error("zp_client: Redis budget %r unreachable; retrying (policy %s)", self.name,
                      self.cfg.on_unavailable)
            self.emit("unavailable")

    def emit(self, kind: str, lease_id: str | None = None, **detail: Any) -> None:
        if kind in self.counters:
            self.counters[kind] += 1
        ev = RedisBudgetEvent(kind, lease_id, detail)
        for hook in list(self.hooks):
            try:
                hook(ev)
            except Exception:  # a broken hook must not break admission (logged with its traceback)
                log.exception("zp_client RedisBudget event hook failed for %s", kind)


class LeaseOwner(Protocol):
    """What a :class:`RedisLease` calls back: the RedisBudget that made it."""

    _core: Core

    def _lease_dirty(self, lease: RedisLease) -> None: ...

    async def _release_lease(self, lease: RedisLease) -> None: ...

    def _release_lease_sync(self, lease: RedisLease) -> None: ...


class RedisLease(Lease):
    """A lease held in a :class:`RedisBudget`. Release is idempotent and never raises."""

    def __init__(
        self, owner: LeaseOwner, lease_id: str, bound: int, held: int, ticket: Ticket, epoch: str, sync: bool,
        meta: str = "",
    ) -> None:
        self.id = lease_id
        self.bound = bound
        self.priority = ticket.priority
        self.ticket = ticket
        self.epoch = epoch
        self._owner = owner
        self._held = held
        self._sent_held = held
        self._released = False
        self._lost = False
        self.sync = sync  # made by acquire_sync (renewed by the keeper thread)
        self.replica: str | None = None
        """In a Redis fleet: the base URL of the replica the lease was placed on (else None)."""
        self._meta_pending: dict[str, Any] = {}  # elastic: compact meta fields not yet sent
        # elastic: the whole compact meta, for re-adoption (a fleet's routing fields left out)
        self._meta_all: dict[str, Any] = (
            {k: v for k, v in json.loads(meta).items() if k in SHORT_KEYS} if meta else {})

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
        core = self._owner._core
        urgent = False
        if held is not None:
            try:
                value = min(max(int(held), 0), self.bound)
            except (TypeError, ValueError):
                value = self._held
            self._held = value
            urgent = abs(value - self._sent_held) >= core.held_report_blocks
        if fields and core.policy == "elastic":
            try:
                compact = compact_meta(fields, update=True)
            except ConfigurationError as exc:
                log.warning("zp_client: ignored progress metadata on lease %s...: %s", self.id[:8], exc)
                compact = {}
            if compact:
                if compact.get("f1") == 1:
                    core.first_tokens.add(self.id)
                self._meta_pending.update(compact)
                for k, v in compact.items():
                    if v is None:
                        self._meta_all.pop(k, None)
                    else:
                        self._meta_all[k] = v
                urgent = urgent or any(k != "tk" for k in compact)
        if urgent:
            self._owner._lease_dirty(self)

    def _take_report(self) -> tuple[int, str, dict[str, Any]]:
        """(held, meta JSON, the meta taken) for a held.lua triple; the meta is cleared until sent."""
        pending, self._meta_pending = self._meta_pending, {}
        return self._held, meta_json(pending), pending

    def _report_failed(self, pending: dict[str, Any]) -> None:
        # Keep newer fields that arrived meanwhile; resend the rest with the next report.
        for k, v in pending.items():
            self._meta_pending.setdefault(k, v)

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        await self._owner._release_lease(self)

    def release_sync(self) -> None:
        if self._released:
            return
        self._released = True
        self._owner._release_lease_sync(self)

    def __repr__(self) -> str:
        on = f", replica={self.replica}" if self.replica is not None else ""
        return (f"RedisLease(id={self.id[:8]}..., bound={self.bound}, held={self._held}, "
                f"ticket={self.ticket}{on})")
