"""The blocking face of RedisBudget: runs the script layer's commands on a ``redis.Redis`` client from any
thread, with one mailbox pump thread and one keeper thread (renewals, held reports, retried releases),
both owned by the face's :class:`~zp_client._tasks.Supervisor` (started there, stopped by
:meth:`SyncFace.close`).
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import redis as redis_sync

from zp_client._tasks import Supervisor
from zp_client.budget.base import Ticket
from zp_client.budget.redis._clients import SyncRedisClient
from zp_client.budget.redis._meta import text
from zp_client.budget.redis._script import (
    CALL_FAILED,
    HANDLED,
    MAILBOX_BLOCK_S,
    POOL_SIZE,
    RENEW_BATCH,
    SYNC_PUMP_BLOCK_S,
    UNAVAILABLE,
    Attempts,
    Core,
    LeaseOwner,
    RedisLease,
)
from zp_client.budget.redis._snapshot import SNAPSHOT_CAP
from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import AdmissionTimeout, ConfigurationError, LeaseTooLarge

log = logging.getLogger("zp_client.budget.redis")


class _SyncWaiter:
    __slots__ = ("event", "too_large")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.too_large = False


class SyncFace:
    """The blocking face: thread-safe; its client is made on first use from the budget's URL unless the
    caller passed one."""

    def __init__(self, owner: LeaseOwner, core: Core, client: SyncRedisClient | None) -> None:
        self.owner = owner
        self.core = core
        self.client = client
        self.owns_client = False
        self.lock = threading.Lock()
        self.leases: dict[str, RedisLease] = {}
        self.dirty: set[str] = set()
        self.retry: dict[str, float] = {}  # lease id -> give up at (monotonic)
        self.waiters: dict[str, _SyncWaiter] = {}
        self.keeper: threading.Thread | None = None
        self.keeper_wake = threading.Event()
        self.pump: threading.Thread | None = None
        self.pump_wake = threading.Event()
        # owns the pump and keeper threads: a closed face starts neither again (a thread still waiting in
        # acquire when the budget closed, granted afterwards, does not bring the keeper back)
        self.sup = Supervisor(f"redis budget {core.name} (blocking face)")
        self.closed = False
        # The keeper thread's own connection (renewals, retried releases): never queued behind a burst of
        # threads' acquires in the shared pool (see AsyncFace.renew_client). Made with the client.
        self.renew_client: SyncRedisClient | None = None

    def get_client(self) -> SyncRedisClient:
        if self.client is None:
            with self.lock:
                if self.client is None:
                    if self.core.url is None:
                        raise ConfigurationError(
                            "acquire_sync/lease_sync need a sync Redis client: pass a URL, or "
                            "sync_client=redis.Redis(...) next to the async client"
                        )
                    pool = redis_sync.BlockingConnectionPool.from_url(
                        self.core.url, max_connections=POOL_SIZE, timeout=None)
                    self.client = redis_sync.Redis.from_pool(pool)
                    self.owns_client = True
        return self.client

    def get_renew_client(self) -> SyncRedisClient:
        """The keeper's client: its own pool of 2 from the URL or cloned from the caller's ``redis.Redis``
        (same connection settings); the shared client for one that cannot be cloned (a cluster)."""
        client = self.get_client()
        with self.lock:
            if self.renew_client is None:
                if self.core.url is not None:
                    pool = redis_sync.BlockingConnectionPool.from_url(self.core.url, max_connections=2,
                                                                      timeout=None)
                elif type(client) is redis_sync.Redis:
                    src = client.connection_pool
                    pool = redis_sync.BlockingConnectionPool(  # type: ignore[no-untyped-call]
                        connection_class=src.connection_class, max_connections=2, timeout=None,
                        **src.connection_kwargs)
                else:
                    return client
                self.renew_client = redis_sync.Redis.from_pool(pool)
            return self.renew_client

    # ------------------------------------------------------------------ one script call
    def eval(self, script: str, args: Sequence[object], *, init: bool = True, patient: bool = True,
             client: SyncRedisClient | None = None) -> Any:
        """Blocking form of :meth:`AsyncFace.eval <zp_client.budget.redis._async.AsyncFace.eval>`."""
        # redis-py types evalsha(sha: str, numkeys: int, ...); the core hands over bytes (the SHA, the key
        # count and keys as encoded once): the connection itself is used untyped
        conn: Any = client or self.get_client()
        core = self.core
        sha = core.sha(script)
        tries: Attempts | None = None  # made at the first failure: the fast path builds nothing
        while True:
            try:
                if tries is not None and tries.load:
                    conn.script_load(tries.text)
                r = conn.evalsha(sha, *core.key_args, *args)
            except HANDLED as exc:
                tries = tries or core.attempts(script, patient)
                SYSTEM_CLOCK.sleep_sync(tries.after(exc))
                continue
            if init and core.needs_init(r):
                core.after_init(self.eval("init", core.init_args(), init=False, patient=patient,
                                          client=conn))
                continue
            core.mark_available(True)
            return r

    # ------------------------------------------------------------------ acquire
    def acquire(
        self, bound: int, held: int, prio: int, order: int, timeout: float | None, meta_json: str,
        fail_fast: bool = False,
    ) -> RedisLease:
        """``fail_fast`` (with a ``timeout``): once the call queues, one ``snapshot`` call predicts its wait
        and a refusal leaves the line through the same clean-up as any failure
        (docs/admission.md#predicted-wait-and-fail-fast)."""
        core = self.core
        self.get_client()
        if not core.policy_known:
            core.learn_status(self.eval("status", [], init=False))
        rid = secrets.token_urlsafe(18)
        # Sync waiters share one mailbox, read by one pump thread (one connection per process, not per
        # waiting thread: a herd of threads must not hold the pool's connections in BLPOP).
        args = core.acquire_args(rid, bound, held, prio, order, core.sync_box, meta_json)
        deadline = None if timeout is None else SYSTEM_CLOCK.monotonic() + timeout
        wake = _SyncWaiter()
        with self.lock:
            self.waiters[rid] = wake  # registered before the call so a mailbox grant cannot be missed
        self._ensure_pump()
        try:
            patient = core.cfg.on_unavailable == "fail_closed"  # fail_local degrades at once
            r = core.acquire_reply(self.eval("acquire", args, patient=patient), bound)
            if fail_fast and deadline is not None and not r.granted:
                self._fail_fast(rid, deadline - SYSTEM_CLOCK.monotonic())
            while not r.granted:
                args[4] = r.ticket.order
                poll = core.cfg.poll_interval_s
                wait = poll if r.recovery_left_s <= 0 else min(poll, r.recovery_left_s + 0.005)
                if deadline is not None:
                    left = deadline - SYSTEM_CLOCK.monotonic()
                    if left <= 0:
                        raise AdmissionTimeout(
                            f"waited {timeout:.3g} s for {bound} KV blocks in Redis budget {core.name!r} "
                            "without admission; raise the timeout, lower max_tokens, or add capacity"
                        )
                    wait = min(wait, left)
                wake.event.wait(max(0.01, wait))
                wake.event.clear()
                if wake.too_large:
                    raise LeaseTooLarge(bound, core.limit, "the limit was lowered while waiting")
                # Granted or not, one idempotent acquire call answers (and heartbeats the waiter).
                core.refresh_waiter_ttl(args)  # the heartbeat slack of now
                sent = SYSTEM_CLOCK.monotonic()
                r = core.acquire_reply(self.eval("acquire", args), bound)
                core.observe_rtt(SYSTEM_CLOCK.monotonic() - sent, SYSTEM_CLOCK.monotonic())
            return self._new_lease(rid, bound, held, r.ticket, r.epoch, meta_json, r.replica)
        except BaseException:
            try:
                self.eval("release", core.release_args(rid), init=False, patient=False)
            except CALL_FAILED as exc:
                self._retry_later(rid, exc)
            raise
        finally:
            with self.lock:
                self.waiters.pop(rid, None)
            self.core.forget_prediction(rid)

    def _fail_fast(self, rid: str, left_s: float) -> None:
        """The blocking form of the async face's ``_fail_fast``: raise the refusal of the waiter ``rid``
        that just queued, if its predicted wait exceeds ``left_s``."""
        if self.core.policy != "elastic":
            return  # strict: Redis keeps no lease metadata, nothing to project (never refused)
        t0 = SYSTEM_CLOCK.monotonic()  # the prediction counts from the snapshot, Redis granting meanwhile
        try:
            reply = self.eval("snapshot", [SNAPSHOT_CAP], init=False, patient=False)
        except CALL_FAILED as exc:
            log.debug("zp_client: no snapshot for the wait prediction: %r", exc)
            return
        refused = self.core.fail_fast_refusal(reply, rid, left_s, t0)
        if refused is not None:
            raise refused

    def _new_lease(
        self, rid: str, bound: int, held: int, ticket: Ticket, epoch: str, meta_json: str,
        replica: str | None = None,
    ) -> RedisLease:
        self.core.prediction_granted(rid)
        lease = RedisLease(self.owner, rid, bound, held, ticket, epoch, sync=True,
                           meta=meta_json)
        lease.replica = replica
        with self.lock:
            self.leases[rid] = lease
        self._ensure_keeper()
        return lease

    def _ensure_pump(self) -> None:
        with self.lock:
            if not self.closed and (self.pump is None or not self.pump.is_alive()):
                self.pump = self.sup.thread(self._pump_loop, name=f"zp-redis-pump-{self.core.name}",
                                            stop=self._stop_pump)
        self.pump_wake.set()

    def _stop_pump(self) -> None:
        """End the pump's wait now: its idle wait by the event, its BLPOP by an empty wake-up."""
        self.pump_wake.set()
        pump, client = self.pump, self.client
        if pump is None or not pump.is_alive() or client is None:
            return
        mailbox = self.core.mailbox(self.core.sync_box)
        try:  # end the pump's BLPOP now rather than after its timeout
            client.rpush(mailbox, "")
            client.pexpire(mailbox, 60_000)
        except CALL_FAILED as exc:
            log.debug("zp_client: could not wake the sync mailbox pump: %r", exc)

    def _pump_loop(self) -> None:
        """Thread: deliver wake-ups pushed to the sync waiters' mailbox (the sync form of the async pump)."""
        client = self.get_client()
        mailbox = self.core.mailbox(self.core.sync_box)
        while not self.closed:
            with self.lock:
                idle = not self.waiters
            if idle:
                self.pump_wake.wait(timeout=MAILBOX_BLOCK_S)
                self.pump_wake.clear()
                continue
            try:
                item = client.blpop([mailbox], timeout=SYNC_PUMP_BLOCK_S)
            except (*UNAVAILABLE, ValueError) as exc:  # ValueError: the client was closed under us
                if self.closed:
                    return
                # Redis away: each waiter's own acquire call retries patiently
                log.debug("zp_client: sync mailbox BLPOP failed: %r", exc)
                SYSTEM_CLOCK.sleep_sync(min(self.core.cfg.poll_interval_s, 0.2))
                continue
            except CALL_FAILED as exc:  # e.g. NOPERM: the thread lives on; waiters fall back to polling
                if self.closed:
                    return
                log.warning("zp_client: sync mailbox BLPOP of Redis budget %r failed: %r",
                            self.core.name, exc)
                SYSTEM_CLOCK.sleep_sync(self.core.cfg.poll_interval_s)
                continue
            if item is None:
                continue
            with self.lock:
                for rid in text(item[1]).split(","):
                    w = self.waiters.get(rid.lstrip("!+").partition("@")[0])
                    if w is not None:
                        w.too_large = w.too_large or rid.startswith("!")
                        w.event.set()

    # ------------------------------------------------------------------ leases: renew, report, release
    def lease_dirty(self, lease: RedisLease) -> None:
        with self.lock:
            self.dirty.add(lease.id)
        self.keeper_wake.set()

    def release(self, lease: RedisLease) -> None:
        with self.lock:
            self.leases.pop(lease.id, None)
            self.dirty.discard(lease.id)
        if lease.lost:
            return
        try:
            self.eval("release", self.core.release_args(lease.id), init=False, patient=False)
        except CALL_FAILED as exc:
            self._retry_later(lease.id, exc)

    def _retry_later(self, lid: str, exc: BaseException) -> None:
        give_up = self.core.release_failed(lid, exc)
        with self.lock:
            self.retry[lid] = give_up
        self._ensure_keeper()

    def _ensure_keeper(self) -> None:
        with self.lock:
            if not self.closed and (self.keeper is None or not self.keeper.is_alive()):
                self.keeper = self.sup.thread(self._keeper_loop, name=f"zp-redis-keeper-{self.core.name}",
                                              stop=self.keeper_wake.set)

    def _keeper_loop(self) -> None:
        """Thread: renew sync leases every TTL/3, flush their held reports, retry failed releases."""
        period = self.core.cfg.lease_ttl_s / 3
        next_renew = SYSTEM_CLOCK.monotonic() + period
        while not self.closed:
            self.keeper_wake.wait(timeout=max(0.0, next_renew - SYSTEM_CLOCK.monotonic()))
            self.keeper_wake.clear()
            if self.closed:
                return
            with self.lock:
                dirty, self.dirty = self.dirty, set()
                reports = [le for lid in dirty if (le := self.leases.get(lid)) is not None]
                retry = list(self.retry.items())
            self.send_reports(reports)
            if SYSTEM_CLOCK.monotonic() < next_renew:
                continue
            next_renew = SYSTEM_CLOCK.monotonic() + period
            for lid, give_up in retry:
                try:
                    if SYSTEM_CLOCK.monotonic() <= give_up:
                        self.eval("release", self.core.release_args(lid), init=False, patient=False,
                                  client=self.get_renew_client())
                    with self.lock:
                        self.retry.pop(lid, None)
                except CALL_FAILED as exc:
                    log.debug("zp_client: retried release of %s... failed again: %r", lid[:8], exc)
            self._renew_round()

    def send_reports(self, leases: list[RedisLease]) -> None:
        """One held.lua call for ``leases``; a failure is logged (the next renewal carries held)."""
        with self.lock:
            args, sent = self.core.take_reports(leases, changed_only=False)
        if not sent:
            return
        try:
            self.eval("held", args, init=False, patient=False)
        except CALL_FAILED as exc:
            self.core.reports_failed(sent, exc)
            return
        self.core.reports_sent(sent)

    def _renew_round(self) -> None:
        with self.lock:
            leases = [le for le in self.leases.values() if not le.released and not le.lost]
        for i in range(0, len(leases), RENEW_BATCH):
            batch = leases[i : i + RENEW_BATCH]
            try:
                r = self.eval("renew", self.core.renew_args(batch), patient=False,
                              client=self.get_renew_client())
            except CALL_FAILED as exc:
                log.warning("zp_client: renewing leases in Redis budget %r failed: %r", self.core.name, exc)
                continue
            with self.lock:
                again = self.core.after_renew(batch, r, self.leases)
            for le in again:  # released while the renewal re-adopted it: release it again
                try:
                    self.eval("release", self.core.release_args(le.id), init=False, patient=False)
                except CALL_FAILED as exc:
                    self._retry_later(le.id, exc)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop the threads (through the supervisor: newest first, each woken, then joined, bounded), then
        close the clients the face made."""
        with self.lock:
            self.closed = True  # under the lock: an _ensure_* racing this starts nothing
        self.sup.close_threads(wait_s=2.0)
        if self.owns_client and self.client is not None:
            try:
                self.client.close()
            except CALL_FAILED as exc:
                log.debug("zp_client: closing the Redis client of budget %r failed: %r", self.core.name, exc)
            self.client = None
            self.owns_client = False
        renew, self.renew_client = self.renew_client, None
        if renew is not None:  # always ours
            try:
                renew.close()
            except CALL_FAILED as exc:
                log.debug("zp_client: closing the renewal client of budget %r failed: %r", self.core.name,
                          exc)
