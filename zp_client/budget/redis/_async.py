"""The asyncio face of RedisBudget: runs the script layer's commands on a ``redis.asyncio`` client bound to
one event loop, with one mailbox pump, one poller, one lease keeper and one held-report flusher per loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
from collections.abc import Sequence
from typing import Any

from zp_client._tasks import Supervisor, wait_event, wait_within
from zp_client.budget.base import Ticket
from zp_client.budget.redis._clients import AsyncRedisClient
from zp_client.budget.redis._meta import text
from zp_client.budget.redis._script import (
    CALL_FAILED,
    HANDLED,
    MAILBOX_BLOCK_S,
    RELEASE_WAIT_S,
    RENEW_BATCH,
    AcquireReply,
    Attempts,
    Core,
    LeaseOwner,
    RedisLease,
)
from zp_client.budget.redis._snapshot import SNAPSHOT_CAP
from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import LeaseTooLarge

log = logging.getLogger("zp_client.budget.redis")


def _mark_read(task: asyncio.Task[Any]) -> None:
    """Read a finished task's outcome so that an exception its abandoned awaiter never saw is not logged
    at garbage collection; whoever awaits the task still gets the exception."""
    if not task.cancelled():
        task.exception()


class _Waiter:
    __slots__ = ("id", "fut", "order", "sent")

    def __init__(self, rid: str, fut: asyncio.Future[str], order: int) -> None:
        self.id = rid
        self.fut = fut
        self.order = order
        # when its last acquire call was sent (monotonic): a grant from the line came later, so the TTL of a
        # lease reported 'G' (by a poll, or the mailbox: granted by this process's own call) started later
        self.sent = 0.0


class AsyncFace:
    """State bound to the event loop a RedisBudget is used from (redis.asyncio clients are loop-bound)."""

    def __init__(self, owner: LeaseOwner, core: Core, client: AsyncRedisClient, owns_client: bool,
                 renew_client: AsyncRedisClient | None = None) -> None:
        self.owner = owner
        self.core = core
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()
        self.client = client
        self.owns_client = owns_client
        # The keeper's own connection (renewals, retried releases, pins): a renewal must never queue for a
        # connection behind a burst of acquires in the shared pool, or live leases expire (issue 33).
        # None: a caller's client we cannot clone (a cluster): renewals share it.
        self.renew_client = renew_client
        self.waiters: dict[str, _Waiter] = {}
        self.leases: dict[str, RedisLease] = {}
        # Leases not renewed yet -> when the call that told this process of the grant was sent (monotonic):
        # their TTL started no earlier. The keeper renews early those the next round would reach more than
        # two renewal periods after that (granted while the event loop was late; see _keeper).
        self.fresh: dict[str, float] = {}
        self.fresh_wake = math.inf  # the earliest such early renewal wanted (monotonic)
        self.renew_due = math.inf  # when the keeper's next round starts (monotonic)
        self.fresh_hint = asyncio.Event()
        self.dirty: set[str] = set()
        self.retry_releases: dict[str, float] = {}  # lease id -> give up at (monotonic)
        self.poll_at = math.inf  # an earlier poll wanted (recovery ends), monotonic seconds
        self.waiters_changed = asyncio.Event()
        self.poll_hint = asyncio.Event()
        self.dirty_event = asyncio.Event()
        # owns the four long-lived tasks and the fire-and-forget releases (zp_client/_tasks.py)
        self.sup = Supervisor(f"redis budget {core.name}")
        self.status_call: asyncio.Task[Any] | None = None  # the one status call that learns the policy
        self.started = False
        self.closed = False
        self.closing = False  # aclose has begun

    @property
    def tasks(self) -> list[asyncio.Task[object]]:
        """The long-lived tasks (pump, poller, keeper, held flusher), owned by :attr:`sup`."""
        return self.sup.tasks

    @tasks.setter
    def tasks(self, tasks: list[asyncio.Task[object]]) -> None:
        self.sup.tasks = tasks

    @property
    def background(self) -> set[asyncio.Task[object]]:
        """The fire-and-forget releases in flight, owned by :attr:`sup`."""
        return self.sup.background_tasks

    def start(self) -> None:
        if not self.started:
            self.started = True
            self.sup.spawn(self._pump(), name="zp-redis-pump", loop=self.loop)
            self.sup.spawn(self._poller(), name="zp-redis-poller", loop=self.loop)
            self.sup.spawn(self._keeper(), name="zp-redis-keeper", loop=self.loop)
            self.sup.spawn(self._held_flusher(), name="zp-redis-held", loop=self.loop)

    # ------------------------------------------------------------------ one script call
    async def eval(self, script: str, args: Sequence[object], *, init: bool = True, patient: bool = True,
                   client: AsyncRedisClient | None = None) -> Any:
        """Run a script by SHA (loading it on NOSCRIPT); create the budget on an ``{'I'}`` reply. Errors
        are those of :class:`~zp_client.budget.redis._script.Attempts`. ``client``: another client of the
        same server (the renewal client), default the shared one."""
        core = self.core
        # redis-py types evalsha(sha: str, numkeys: int, ...); the core hands over bytes (the SHA, the key
        # count and keys as encoded once): the connection itself is used untyped
        conn: Any = self.client if client is None else client
        sha = core.sha(script)
        tries: Attempts | None = None  # made at the first failure: the fast path builds nothing
        while True:
            try:
                if tries is not None and tries.load:
                    await conn.script_load(tries.text)
                r = await conn.evalsha(sha, *core.key_args, *args)
            except HANDLED as exc:
                tries = tries or core.attempts(script, patient)
                await asyncio.sleep(tries.after(exc))
                continue
            if init and core.needs_init(r):
                core.after_init(await self.eval("init", core.init_args(), init=False, patient=patient,
                                                client=conn))
                continue
            core.mark_available(True)
            return r

    # ------------------------------------------------------------------ acquire
    def _start(self, script: str, args: Sequence[object], **kw: Any) -> asyncio.Task[Any]:
        """One script call on the acquire path, run as its own task: the caller awaits it through
        :func:`asyncio.shield` so that the caller's cancellation always raises.

        redis-py runs each command under ``asyncio.wait_for``, which on Python 3.10/3.11 returns the reply
        instead of raising when the caller is cancelled just as the reply arrives (fixed in 3.12): the
        cancellation would be lost and the acquire would go on. A shielded task's awaiter gets its
        cancellation whatever the task does; the call itself goes on, so a cancelled caller lets it land
        before undoing it (:meth:`_undo_after`). Its exception, when its awaiter was cancelled and nobody
        else reads it, is marked read (asyncio would log "Task exception was never retrieved")."""
        task = self.loop.create_task(self.eval(script, args, **kw))
        task.add_done_callback(_mark_read)
        return task

    async def acquire(self, bound: int, held: int, prio: int, order: int, meta_json: str,
                      fail_fast_s: float | None = None) -> RedisLease:
        """``fail_fast_s``: the call opted into fail-fast with this timeout (its deadline's time left):
        once it queues, one ``snapshot`` call predicts its wait and a refusal leaves the line through the
        same clean-up as a cancellation (docs/admission.md#predicted-wait-and-fail-fast)."""
        core = self.core
        started = SYSTEM_CLOCK.monotonic()
        if not core.policy_known:
            # one status call for a herd of first acquires, not one each (a thousand concurrent first
            # acquires would each queue a script in Redis before any of them enqueues)
            if self.status_call is None or self.status_call.done():
                self.status_call = self._start("status", [], init=False)
            core.learn_status(await asyncio.shield(self.status_call))
        rid = secrets.token_urlsafe(18)
        fut: asyncio.Future[str] = self.loop.create_future()
        w = _Waiter(rid, fut, order)
        self.waiters[rid] = w  # registered before the call so a mailbox grant cannot be missed
        args = core.acquire_args(rid, bound, held, prio, order, core.owner, meta_json)
        call: asyncio.Task[Any] | None = None
        claiming = False  # the call in flight is the claim of a grant this process was told of
        enqueue = True  # False: the last claim's reply enqueued the waiter again already
        try:
            while True:
                if enqueue:
                    core.refresh_waiter_ttl(args)  # the heartbeat slack of now
                    # fail_local degrades at once instead of waiting out unavailable_timeout_s
                    call = self._start("acquire", args, patient=core.cfg.on_unavailable == "fail_closed")
                    w.sent = sent = SYSTEM_CLOCK.monotonic()
                    r = core.acquire_reply(await asyncio.shield(call), bound)
                    now = SYSTEM_CLOCK.monotonic()
                    core.observe_rtt(now - sent, now)  # an enqueue is a heartbeat too: its round trip counts
                    if r.granted:
                        return self._new_lease(rid, bound, held, r.ticket, r.epoch, meta_json, r.replica,
                                               since=sent)
                    self._waiting(w, args, r)  # a re-enqueue (after 'N') keeps the place in line
                    if fail_fast_s is not None:
                        await self._fail_fast(rid, fail_fast_s - (SYSTEM_CLOCK.monotonic() - started))
                        fail_fast_s = None  # at its first enqueue only, as LocalBudget's
                enqueue = True
                self.start()
                self.waiters_changed.set()
                res = await fut
                if res.startswith("M"):
                    # A mailbox wake-up: the grant is pending until this process claims it, and the claim
                    # is the same idempotent acquire (docs/redis.md, "Grants are claimed"). 'G': claimed,
                    # the lease is ours; 'W': the claim window ended first (the grant went back to the
                    # pool) and this call enqueued the waiter again, same ticket: wait on.
                    claiming = True
                    core.refresh_waiter_ttl(args)
                    call = self._start("acquire", args)
                    w.sent = sent = SYSTEM_CLOCK.monotonic()
                    r = core.acquire_reply(await asyncio.shield(call), bound)
                    claiming = False
                    if r.granted:
                        return self._new_lease(rid, bound, held, r.ticket, r.epoch, meta_json, r.replica,
                                               since=sent)
                    self._waiting(w, args, r)
                    fut = self.loop.create_future()
                    w.fut = fut
                    enqueue = False
                    continue
                if res.startswith("G"):  # claimed: by the poll that said so, or by the call that granted it
                    since = w.sent  # granted after its last call was sent (by whichever call)
                    replica = None
                    if core.fleet is not None:  # 'G@<replica id>'; unknown here: ask (idempotent acquire)
                        replica = core.fleet.replica_url(res[2:]) if res.startswith("G@") else None
                        if replica is None:
                            call = self._start("acquire", args)
                            r = core.acquire_reply(await asyncio.shield(call), bound)
                            replica = r.replica
                    return self._new_lease(rid, bound, held, r.ticket, core.epoch or r.epoch, meta_json,
                                           replica, since=since)
                if res == "X":
                    raise LeaseTooLarge(bound, core.limit, "the limit was lowered while waiting")
                # 'N': Redis forgot the waiter (state lost, or reaped): enqueue again, same ticket
                fut = self.loop.create_future()
                w.fut = fut
        except BaseException:
            self.waiters.pop(rid, None)
            # Leave no trace: remove the waiter, or release a grant that raced the cancellation. A call
            # still in flight (its caller was cancelled) may yet grant: release after it lands.
            if call is not None and not call.done():
                undo = self._undo_after(call, rid)
                if claiming:  # the grant is known to be there: release it as a plain release would
                    await asyncio.wait({undo}, timeout=RELEASE_WAIT_S)
            else:
                await self.release_id(rid)
            raise
        finally:
            self.waiters.pop(rid, None)
            self.core.forget_prediction(rid)

    async def _fail_fast(self, rid: str, left_s: float) -> None:
        """Predict the waiter ``rid`` that just queued from one bounded snapshot of the budget; raise
        :class:`~zp_client.errors.DeadlineExceeded` when it is refused (the caller's clean-up removes the
        waiter). A snapshot that fails costs the prediction only."""
        if self.core.policy != "elastic":
            return  # strict: Redis keeps no lease metadata, nothing to project (never refused)
        t0 = SYSTEM_CLOCK.monotonic()  # the prediction counts from the snapshot, Redis granting meanwhile
        try:
            reply = await asyncio.shield(self._start("snapshot", [SNAPSHOT_CAP], init=False, patient=False))
        except CALL_FAILED as exc:
            log.debug("zp_client: no snapshot for the wait prediction: %r", exc)
            return
        refused = self.core.fail_fast_refusal(reply, rid, left_s, t0)
        if refused is not None:
            raise refused

    def _waiting(self, w: _Waiter, args: list[Any], r: AcquireReply) -> None:
        """An acquire answered 'W': keep the ticket (a re-enqueue keeps the place in line) and, when the
        recovery window ends soon, poll then rather than a poll interval later."""
        args[4] = w.order = r.ticket.order
        if r.recovery_left_s > 0:
            self.poll_at = min(self.poll_at, SYSTEM_CLOCK.monotonic() + r.recovery_left_s + 0.005)
            self.poll_hint.set()

    def _undo_after(self, call: asyncio.Task[object], rid: str) -> asyncio.Task[object]:
        """Release ``rid`` (lease or waiter) once ``call``, an acquire still in flight, has landed."""

        async def undo() -> None:
            await asyncio.wait({call})  # its outcome does not matter (nor is it raised): undo it either way
            await self.release_id(rid)

        return self.sup.background(undo(), loop=self.loop)

    def release_when_done(self, task: asyncio.Task[RedisLease]) -> None:
        """``task`` (an :meth:`acquire`) was abandoned by a cancelled caller: release the lease it may
        still return."""

        def done(t: asyncio.Task[RedisLease]) -> None:
            if t.cancelled() or t.exception() is not None:
                return  # it left no trace (acquire's own clean-up)
            lease = t.result()
            self.sup.background(lease.release(), loop=self.loop)

        task.add_done_callback(done)

    def _new_lease(
        self, rid: str, bound: int, held: int, ticket: Ticket, epoch: str, meta_json: str,
        replica: str | None = None, *, since: float,
    ) -> RedisLease:
        """Register a granted lease with the keeper. ``since``: when the call that told this process of the
        grant was sent (the lease's TTL started no earlier)."""
        self.core.prediction_granted(rid)
        lease = RedisLease(self.owner, rid, bound, held, ticket, epoch, sync=False,
                           meta=meta_json)
        lease.replica = replica
        self.leases[rid] = lease
        self.fresh[rid] = since
        early = since + 2 * self.core.cfg.lease_ttl_s / 3  # its first renewal, at the latest, like any
        if early < self.fresh_wake:
            self.fresh_wake = early
            if early < self.renew_due:
                self.fresh_hint.set()  # before the next round: the keeper looks again
        self.start()
        return lease

    async def _pump(self) -> None:
        """Deliver wake-ups pushed to this process's mailbox (one blocked connection per process).

        The BLPOP timeout is long: the bounded poll is a separate task (:meth:`_poller`), so an idle
        waiter costs one poll per ``poll_interval_s`` plus one BLPOP per ``MAILBOX_BLOCK_S``.
        """
        mailbox = self.core.mailbox(self.core.owner)
        while not self.closed:
            if not self.waiters:
                self.waiters_changed.clear()
                await self.waiters_changed.wait()
                continue
            try:
                item = await self.client.blpop([mailbox], timeout=MAILBOX_BLOCK_S)
            except CALL_FAILED as exc:  # Redis away: the poller retries patiently; try again shortly
                log.debug("zp_client: mailbox BLPOP failed: %r", exc)
                await asyncio.sleep(min(self.core.cfg.poll_interval_s, 0.2))
                continue
            if item is not None:
                self._deliver(text(item[1]))

    async def _poller(self) -> None:
        """The bounded-poll fallback: every ``poll_interval_s`` while this process has waiters, one script
        call heartbeats all of them, reaps, runs a grant pass and reports each waiter's state, so a lost
        wake-up costs at most one interval. Polls early when recovery is about to end."""
        interval = self.core.cfg.poll_interval_s
        deadline = SYSTEM_CLOCK.monotonic() + interval
        while not self.closed:
            if not self.waiters:
                self.waiters_changed.clear()
                await self.waiters_changed.wait()
                deadline = SYSTEM_CLOCK.monotonic() + interval
                continue
            delay = min(deadline, self.poll_at) - SYSTEM_CLOCK.monotonic()
            if delay > 0:
                self.poll_hint.clear()
                await wait_event(self.poll_hint, delay)  # the time came (poll), or a hint
                continue  # recompute: the time came, or an earlier poll was asked for
            self.poll_at = math.inf
            deadline = SYSTEM_CLOCK.monotonic() + interval
            ids = list(self.waiters)
            if not ids:
                continue
            sent = SYSTEM_CLOCK.monotonic()
            try:
                # the heartbeat of this process's waiters: on the renewal connection, never queued
                # behind a burst of acquires (a late heartbeat drops the waiters from the line)
                r = await self.eval("poll", self.core.poll_args(ids), client=self.renew_client)
            except CALL_FAILED as exc:
                log.warning("zp_client: poll of Redis budget %r failed: %r", self.core.name, exc)
                continue
            now = SYSTEM_CLOCK.monotonic()
            self.core.observe_rtt(now - sent, now)  # the next heartbeats' slack
            rec_left = int(r[0]) / 1000
            for rid, st in zip(ids, r[1:], strict=False):
                state = text(st)
                if state == "W" and (w := self.waiters.get(rid)) is not None:
                    w.sent = max(w.sent, sent)  # still in line when this poll ran: any grant comes later
                self._resolve(rid, state)
            if rec_left > 0:  # recovery ends: look again then rather than a full interval later
                self.poll_at = min(self.poll_at, SYSTEM_CLOCK.monotonic() + rec_left + 0.005)

    def _deliver(self, msg: str) -> None:
        for rid in msg.split(","):
            if rid.startswith("!"):
                self._resolve(rid[1:], "X")
            elif rid.startswith("+"):  # a grant this process's own call made: claimed already
                lid, _, rep = rid[1:].partition("@")  # a fleet's names its replica: 'id@replica id'
                self._resolve(lid, "G@" + rep if rep else "G")
            else:  # a grant to claim ('M'): a fleet's 'id@replica id' too (the claim's reply has the URL)
                self._resolve(rid.partition("@")[0], "M")

    def _resolve(self, rid: str, state: str) -> None:
        w = self.waiters.get(rid)
        if w is None or w.fut.done() or state == "W":
            return
        w.fut.set_result(state)

    # ------------------------------------------------------------------ leases: renew, report, release
    async def _keeper(self) -> None:
        """Renew this loop's leases every TTL/3; retry releases that could not reach Redis.

        Rounds start at a fixed rate (every TTL/3 from the keeper's start), not TTL/3 after the previous
        round ended: when Redis answers slowly (a queue of scripts ahead of each call), a round that
        took its time must not push every later renewal back by as much, or renewals arrive further
        apart than a lease TTL and live leases expire. A round that overran its period is followed by
        the next at once (missed rounds are not made up)."""
        period = self.core.cfg.lease_ttl_s / 3
        self.renew_due = SYSTEM_CLOCK.monotonic() + period
        await self._warm_renewals(self.core.cfg.lease_ttl_s)
        while not self.closed:
            now = SYSTEM_CLOCK.monotonic()
            delay = min(self.renew_due, self.fresh_wake) - now
            if delay > 0:
                self.fresh_hint.clear()
                await wait_event(self.fresh_hint, delay)  # the time came, or a hint
                continue  # recompute: the round is due, or a lease granted late wants an early renewal
            if now < self.renew_due:
                await self.renew_fresh(period)
                continue
            self.renew_due = max(self.renew_due + period, now)
            for lid, give_up in list(self.retry_releases.items()):
                if SYSTEM_CLOCK.monotonic() > give_up:
                    self.retry_releases.pop(lid, None)  # it has expired by TTL anyway
                    continue
                try:
                    await self.eval("release", self.core.release_args(lid), init=False, patient=False,
                                    client=self.renew_client)
                    self.retry_releases.pop(lid, None)
                except CALL_FAILED as exc:
                    log.debug("zp_client: retried release of %s... failed again: %r", lid[:8], exc)
            await self.renew_round()

    async def _warm_renewals(self, within_s: float) -> None:
        """Open the renewal client's connections before they are needed: a new connection's handshake is
        several round trips (HELLO, CLIENT SETINFO), each queued behind whatever Redis is running, and the
        first renewal round (or the first poll) must not pay for them."""
        client = self.renew_client
        if client is None:
            return

        async def ping_all() -> None:
            # A coroutine, not the gather itself, goes to wait_for: a keeper cancelled at aclose() left
            # the gather's CancelledError unread ("_GatheringFuture exception was never retrieved" at
            # garbage collection; on CPython 3.11 that log line can break an ast.parse, gh-106905).
            await asyncio.gather(*(client.ping() for _ in range(RENEW_POOL_SIZE)))

        # Bounded: a stalled Redis must not hold the keeper for longer than a lease TTL. asyncio.wait, not
        # wait_for: on Python 3.11 wait_for returns the pings' result to a keeper cancelled as they finish
        # (gh-86296), and the keeper then ran on after one cancel (asyncio.run's at exit; _tasks.wait_event).
        task: asyncio.Future[object] = asyncio.ensure_future(ping_all())
        await wait_within(task, within_s)  # cancelled past it: the first round reconnects as it always did
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, CALL_FAILED):
            log.debug("zp_client: opening the renewal connections of %r failed: %r", self.core.name, exc)
        elif exc is not None:
            raise exc

    async def renew_round(self) -> None:
        """Renew every live lease of this loop: batches of ``RENEW_BATCH``, all sent at once (over the
        renewal client's ``RENEW_POOL_SIZE`` connections), so a round takes about one round trip however
        many batches it has. Sent one after the other, a round of n batches took n round trips, each one
        also waiting for the event loop: under a burst of acquires on a loaded machine (2,000 leases, 10
        batches, a queue of scripts ahead of each in Redis and a loop seconds late) the last batches arrived
        after their leases had expired (issue 33). Batches go out oldest leases first (the registry's
        order), so the leases nearest their expiry reach Redis first."""
        leases = [le for le in self.leases.values() if not le.released and not le.lost]
        self.fresh.clear()  # every lease registered so far is in this round
        self.fresh_wake = math.inf
        await self._renew_leases(leases)
        for key, args in list(self.core.pins.items()):  # pinned prefixes: renew (or take over) the pin
            try:
                await self.eval("pin", args, client=self.renew_client)
            except CALL_FAILED as exc:
                log.warning("zp_client: renewing the pin of %s... in Redis budget %r failed: %r", key[:12],
                            self.core.name, exc)

    async def renew_fresh(self, period: float) -> None:
        """Renew now the leases granted since the last round that the next round would reach more than two
        renewal periods after their TTL started (the most a lease waits between two renewals when rounds
        are on time): a lease granted while the event loop ran late (a burst of acquires on a loaded
        machine) was registered here seconds after Redis granted it, and waiting for the next round as
        well lost it (issue 33). They go in one call per ``RENEW_BATCH``."""
        early = self.renew_due - 2 * period
        due = [lid for lid, since in self.fresh.items() if since <= early]
        for lid in due:
            del self.fresh[lid]
        self.fresh_wake = min(self.fresh.values(), default=math.inf) + 2 * period
        await self._renew_leases([le for lid in due if (le := self.leases.get(lid)) is not None
                                  and not le.released and not le.lost])

    async def _renew_leases(self, leases: list[RedisLease]) -> None:
        batches = [leases[i : i + RENEW_BATCH] for i in range(0, len(leases), RENEW_BATCH)]
        if len(batches) == 1:
            await self._renew_batch(batches[0])
        elif batches:
            # each batch catches its own call's failures: anything else (a bug) is raised after all landed
            outcomes = await asyncio.gather(*(self._renew_batch(batch) for batch in batches),
                                            return_exceptions=True)
            for out in outcomes:
                if isinstance(out, BaseException):
                    raise out

    async def _renew_batch(self, batch: list[RedisLease]) -> None:
        """One renew.lua call for ``batch``; a failure is logged (the next round tries again)."""
        try:
            r = await self.eval("renew", self.core.renew_args(batch), client=self.renew_client)
        except CALL_FAILED as exc:
            log.warning("zp_client: renewing leases in Redis budget %r failed: %r", self.core.name, exc)
            return
        for le in self.core.after_renew(batch, r, self.leases):
            self._release_in_background(le.id)  # released while the renewal re-adopted it

    def lease_dirty(self, lease: RedisLease) -> None:
        if threading.get_ident() == self.thread:
            self._mark_dirty(lease.id)
        else:
            self.loop.call_soon_threadsafe(self._mark_dirty, lease.id)

    def _mark_dirty(self, lid: str) -> None:
        self.dirty.add(lid)
        self.dirty_event.set()

    async def _held_flusher(self) -> None:
        """Send held reports in batches: one script call carries every lease that grew meanwhile."""
        while not self.closed:
            await self.dirty_event.wait()
            self.dirty_event.clear()
            ids, self.dirty = self.dirty, set()
            await self.send_reports([le for lid in ids if (le := self.leases.get(lid)) is not None],
                                    changed_only=False, patient=False)

    async def send_reports(self, leases: list[RedisLease], *, changed_only: bool, patient: bool) -> None:
        """One held.lua call for ``leases``; a failure is logged unless ``patient`` (then it raises)."""
        args, sent = self.core.take_reports(leases, changed_only=changed_only)
        if not sent:
            return
        try:
            await self.eval("held", args, init=False, patient=patient)
        except CALL_FAILED as exc:
            self.core.reports_failed(sent, None if patient else exc)
            if patient:
                raise
            return
        except BaseException:
            self.core.reports_failed(sent, None)
            raise
        self.core.reports_sent(sent)

    async def release(self, lease: RedisLease) -> None:
        self.leases.pop(lease.id, None)
        self.fresh.pop(lease.id, None)
        self.dirty.discard(lease.id)
        if not lease.lost:
            await self.release_id(lease.id)

    async def release_id(self, lid: str) -> None:
        """Release a lease / cancel a waiter in Redis. Never raises except the caller's own
        cancellation; a cancelled or failed release is finished by a background task / retried until
        the lease would have expired anyway (release is idempotent, so a repeat is harmless)."""
        # The call runs as a task the caller waits for at most RELEASE_WAIT_S: a stalled Redis (SIGSTOP,
        # a long fork) answers nothing until its socket timeout or the end of the stall, and a release
        # must not hold its caller for that (issue 33). Past the bound, or when the caller is cancelled,
        # the task goes on in the background and a failure is retried like any failed release.
        task = self._release_in_background(lid)
        await asyncio.wait({task}, timeout=RELEASE_WAIT_S)  # neither cancels the task nor raises its error

    def _release_in_background(self, lid: str) -> asyncio.Task[object]:
        def done(t: asyncio.Task[object]) -> None:
            if t.cancelled() or t.exception() is not None:
                self._retry_later(lid, None if t.cancelled() else t.exception())

        call = self.eval("release", self.core.release_args(lid), init=False, patient=False)
        task = self.sup.background(call, loop=self.loop)
        task.add_done_callback(done)
        return task

    def _retry_later(self, lid: str, exc: BaseException | None) -> None:
        if self.closing:
            return  # aclose gave up on it (bounded): the lease expires by its TTL
        self.retry_releases[lid] = self.core.release_failed(lid, exc)

    # ------------------------------------------------------------------ closing
    async def aclose(self) -> None:
        self.closing = True  # a release failing from here on is not queued for a retry
        try:
            await self._drain_releases()
        finally:  # even when aclose itself is cancelled: the tasks must not outlive it
            self.closed = True
            self.waiters_changed.set()
            self.poll_hint.set()
            self.fresh_hint.set()
            self.dirty_event.set()
            self.sup.cancel_tasks()
        if self.loop is asyncio.get_running_loop():
            # the releases were drained above (one still starting finishes on its own, as before); the
            # tasks are cancelled, newest first, and awaited (bounded: a task stuck inside a client call
            # must not hang aclose)
            await self.sup.stop_tasks(wait_s=2.0)
        if self.owns_client:
            try:
                await self.client.aclose()
            except CALL_FAILED as exc:
                log.debug("zp_client: closing the Redis client of budget %r failed: %r", self.core.name, exc)
        if self.renew_client is not None:  # always ours (made from the URL or cloned from the caller's)
            try:
                await self.renew_client.aclose()
            except CALL_FAILED as exc:
                log.debug("zp_client: closing the renewal client of budget %r failed: %r", self.core.name,
                          exc)

    async def _drain_releases(self, budget_s: float = 2.0) -> None:
        """Before the tasks go, within ``budget_s``: let releases finishing in the background (their
        caller was cancelled mid-flight) land, rather than leave them to die with the loop and their
        leases to the TTL; then one last attempt at releases that failed earlier."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            return  # closed from another loop: its tasks cannot be awaited here
        deadline = loop.time() + budget_s
        pending = self.sup.pending_background()
        if pending:
            _, late = await asyncio.wait(pending, timeout=budget_s)
            for t in late:
                t.cancel()
            if late:
                await asyncio.wait(late, timeout=0.5)
        for lid in list(self.retry_releases):
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(
                    self.eval("release", self.core.release_args(lid), init=False, patient=False), left)
            except (*CALL_FAILED, asyncio.TimeoutError) as exc:  # the lease expires by its TTL
                log.debug("zp_client: last release attempt of %s... failed: %r", lid[:8], exc)


# The keeper's connections: a renewal round sends its batches at once, one per connection (2,000 leases
# are 10 batches: two round trips on 8 connections), and the poller's heartbeat shares them.
RENEW_POOL_SIZE = 8


def renewal_client(url: str | None, client: AsyncRedisClient | None) -> AsyncRedisClient | None:
    """A client with its own small pool for the keeper (renewals), made from ``url`` or cloned from the
    caller's ``redis.asyncio.Redis`` (same connection settings); None for a client that cannot be cloned
    (e.g. ``RedisCluster``: renewals then share its pool)."""
    import redis.asyncio as redis_async

    if url is not None:
        pool = redis_async.BlockingConnectionPool.from_url(url, max_connections=RENEW_POOL_SIZE, timeout=None)
        return redis_async.Redis.from_pool(pool)
    if type(client) is not redis_async.Redis:
        return None
    src = client.connection_pool
    pool = redis_async.BlockingConnectionPool(
        connection_class=src.connection_class, max_connections=RENEW_POOL_SIZE, timeout=None,
        **src.connection_kwargs)
    return redis_async.Redis.from_pool(pool)
