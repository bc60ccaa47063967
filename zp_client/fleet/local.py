"""The in-process fleet: a budget per replica, one fair line, routing with prefix affinity, ejection.

:class:`Fleet` is a :class:`~zp_client.Budget` (a :class:`~zp_client.LocalBudget`'s shell around a
:class:`~zp_client.fleet.ledger.FleetLedger`), so it goes wherever a budget goes — ``wrap()``,
``AsyncClient``/``Client``, the LangChain and AutoGen classes — and they route through it::

    fleet = Fleet(["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"], limit_blocks=1945)
    client = wrap(openai.AsyncOpenAI(base_url=fleet.base_url, api_key="x"), budget=fleet)

Each lease carries the replica it was placed on (``lease.replica``); the admission transport sends the
attempt there. Give the client ``fleet.base_url`` (a name only the fleet resolves) or any replica's URL.
See docs/fleet.md for the rules.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import anyio

from zp_client._tasks import Supervisor, deferred, quiesce
from zp_client.budget.base import Budget, Lease, Ticket
from zp_client.budget.ledger import (
    DEFAULT_LATE_BOUND_S,
    DEFAULT_LINE,
    LineName,
    ReservationPolicy,
    validate_blocks,
    validate_seconds,
)
from zp_client.budget.local import LocalBudget, _LocalLease, _Waiter
from zp_client.clock import Clock
from zp_client.errors import ConfigurationError, LeaseTooLarge
from zp_client.fleet._routing import FleetRouting, normalize, origin, replica_limits
from zp_client.fleet.ledger import (
    DEFAULT_AFFINITY_WAIT_S,
    DEFAULT_FLEET_STARVATION_BOUND_S,
    DEFAULT_MIN_AFFINITY_BLOCKS,
    PREFIX_META,
    SESSION_META,
    FleetLedger,
    HealthRules,
    default_factory,
)
from zp_client.fleet.prefix import DEFAULT_MAX_ENTRIES

if TYPE_CHECKING:
    from zp_client.budget._types import BudgetStatus
    from zp_client.config import Settings

__all__ = ["Fleet", "FleetLease", "Resolver", "system_resolver"]

logger = logging.getLogger("zp_client.fleet")

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``await resolver(host, port)`` -> the addresses (IPs) a DNS name has now."""

async def system_resolver(host: str, port: int) -> list[str]:
    """The system's resolver (``getaddrinfo``, TCP), addresses sorted and deduplicated."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class FleetLease(_LocalLease):
    """A lease on one replica of a :class:`Fleet`: ``replica`` is its base URL."""

    __slots__ = ("replica",)

    def __init__(self, budget: LocalBudget, lease_id: str, bound: int, held: int, priority: int,
                 ticket: Ticket, replica: str) -> None:
        super().__init__(budget, lease_id, bound, held, priority, ticket)
        self.replica = replica

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f" on {self.replica}>"


class Fleet(FleetRouting, Budget):
    """A budget per replica of one model, one fair line for all of them, and routing (docs/fleet.md).

    ``replicas``: base URLs (``http://host:port/v1``, all with the same path), each leased up to
    ``limit_blocks``, or a mapping of URL to its own limit (replicas with different pools).
    ``policy``: each replica's reservation policy (a name, as LocalBudget's; a fresh one per replica).
    ``line`` / ``late_bound_s``: the fleet line's discipline, as LocalBudget's (``"slo"``: the SLO-aware
    line, docs/admission.md#the-slo-aware-line).
    ``affinity_wait_s`` / ``min_affinity_blocks``: how long a request waits for the replica that holds
    its prefix (or its session) when another one has room, and what match is worth it.
    ``health``: the outlier-detection rules (:class:`~zp_client.fleet.ledger.HealthRules`).
    ``max_prefix_entries``: the prefix index's bound. ``clock``: as LocalBudget's.

    Active checks (``/health`` probes, DNS re-resolution) run only while the fleet is started
    (``async with fleet:`` or ``await fleet.start()``), every ``check_interval_s``, through
    ``http_client`` (an ``httpx.AsyncClient``; default: a new one). Without them an ejected replica comes
    back when its ejection time is over, on the next request (and is ejected again at once if it still
    refuses connections). A request never costs a network call of the fleet's own.

    A Fleet is a :class:`~zp_client.Budget`; it composes its line (a private :class:`_FleetLine`: the
    lock, the parked waiters and the wake-ups of a :class:`~zp_client.LocalBudget`, over the fleet's
    ledger, which keeps a ledger per replica) rather than being a LocalBudget.
    """

    _status_in_process = True

    def __init__(
        self,
        replicas: Sequence[str] | Mapping[str, int],
        limit_blocks: int | None = None,
        block_size: int = 16,
        *,
        policy: str | ReservationPolicy = "elastic",
        starvation_bound_s: float = DEFAULT_FLEET_STARVATION_BOUND_S,
        affinity_wait_s: float = DEFAULT_AFFINITY_WAIT_S,
        min_affinity_blocks: int = DEFAULT_MIN_AFFINITY_BLOCKS,
        health: HealthRules | None = None,
        max_prefix_entries: int = DEFAULT_MAX_ENTRIES,
        capacities: Mapping[str, int] | None = None,
        name: str = "fleet",
        clock: Clock | None = None,
        http_client: Any = None,
        check_interval_s: float = 5.0,
        resolver: Resolver | None = None,
        dns_url: str | None = None,
        line: LineName = DEFAULT_LINE,
        late_bound_s: float = DEFAULT_LATE_BOUND_S,
    ) -> None:
        self._line = _FleetLine(self, block_size, starvation_bound_s=starvation_bound_s, name=name,
                                clock=clock)
        self.block_size = self._line.block_size
        self.name = name
        self.clock = self._line.clock
        limits = replica_limits(replicas, limit_blocks, missing_limit=(
            "Fleet(urls) needs limit_blocks (or a mapping of URL to limit, or Fleet.from_servers(urls) to "
            "size each replica from its /metrics; Fleet.from_dns for a DNS name)"))
        caps = {normalize(u): validate_blocks(c, "capacity") for u, c in (capacities or {}).items()}
        self._default_limit = limit_blocks
        self._line._ledger = FleetLedger(  # type: ignore[assignment]  # the Ledger surface LocalBudget drives
            limits, default_factory(policy, self.block_size), starvation_bound_s=starvation_bound_s,
            affinity_wait_s=affinity_wait_s, min_affinity_blocks=min_affinity_blocks, health=health,
            max_prefix_entries=max_prefix_entries, capacities=caps, line=line, late_bound_s=late_bound_s,
        )
        self._path = urlsplit(next(iter(limits))).path
        self.check_interval_s = validate_seconds(check_interval_s, "check_interval_s")
        self._http = http_client
        self._own_http = False
        self._resolver = resolver or system_resolver
        self._dns = urlsplit(normalize(dns_url)) if dns_url is not None else None
        self._task: asyncio.Task[object] | None = None
        self._sup = Supervisor(f"fleet {name}")  # owns the active checks' task
        self._next_due: float | None = None
        self.max_moves = 1
        """Moves per request off failing replicas, per replica in the fleet (each move avoids the
        replicas that failed the request already), before the retry policy decides: a guard against a
        fleet whose every replica fails."""

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_servers(cls, urls: Iterable[str], *, headroom: float | None = None, policy: str = "elastic",
                     timeout_s: float = 5.0, headers: Mapping[str, str] | None = None,
                     **kwargs: Any) -> Fleet:
        """A fleet sized replica by replica from each server's ``/metrics`` (blocking; at startup), as
        :meth:`LocalBudget.from_server` sizes one. Every replica must answer (CalibrationError names the
        one that did not); they must agree on the block size."""
        from zp_client.calibration import calibrate

        limits: dict[str, int] = {}
        caps: dict[str, int] = {}
        block_sizes: set[int] = set()
        for url in urls:
            cal = calibrate(url, headroom=headroom, policy=policy, timeout_s=timeout_s, headers=headers)
            base = normalize(url if urlsplit(url).path.rstrip("/") else url.rstrip("/") + "/v1")
            limits[base] = cal.limit_blocks
            caps[base] = max(cal.limit_blocks, cal.num_gpu_blocks - 1)
            block_sizes.add(cal.block_size)
        if len(block_sizes) > 1:
            raise ConfigurationError(f"the replicas have different block sizes {sorted(block_sizes)}; a "
                                     "fleet counts blocks of one size")
        return cls(limits, None, block_sizes.pop() if block_sizes else 16, policy=policy, capacities=caps,
                   **kwargs)

    @classmethod
    async def from_dns(cls, url: str, limit_blocks: int, *, resolver: Resolver | None = None,
                       **kwargs: Any) -> Fleet:
        """A fleet of every address a DNS name has (a Kubernetes headless Service), resolved now and
        again every ``check_interval_s`` while the fleet runs (``async with fleet:``): addresses that
        appear join with ``limit_blocks``, addresses that disappear drain. ``url`` is the replicas' base
        URL with the name as host (``http://vllm.ns.svc:8000/v1``); ``resolver`` swaps the system's."""
        dns = urlsplit(normalize(url))
        resolve = resolver or system_resolver
        port = dns.port or (443 if dns.scheme == "https" else 80)
        addrs = await resolve(dns.hostname or "", port)
        if not addrs:
            raise ConfigurationError(f"{dns.hostname} resolves to no address")
        urls = [cls._url_for(dns, a) for a in addrs]
        return cls(urls, limit_blocks, resolver=resolve, dns_url=url, **kwargs)

    @staticmethod
    def _url_for(dns: SplitResult, addr: str) -> str:
        host = f"[{addr}]" if ":" in addr else addr
        port = f":{dns.port}" if dns.port else ""
        return str(urlunsplit((dns.scheme, host + port, dns.path, "", "")))

    # ------------------------------------------------------------------ routing (the core calls these)
    @property
    def ledger(self) -> FleetLedger:
        return self._line._ledger  # type: ignore[return-value]

    @property
    def _lock(self) -> threading.Lock:
        return self._line._lock

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self.ledger.replicas)

    def _target(self) -> str | None:
        with self._lock:
            avail = self.ledger.available(self.clock.monotonic())
            return avail[0].url if avail else next(iter(self.ledger.replicas), None)

    # ------------------------------------------------------------------ health
    def note_failure(self, lease: Lease, *, connect: bool = False) -> bool:
        """The attempt on ``lease``'s replica failed (a 5xx answer, a cut stream; ``connect``: no
        connection could be made). Returns True when the replica is now ejected."""
        replica = getattr(lease, "replica", None)
        if replica is None:
            return False
        now = self.clock.monotonic()
        with self._lock:
            was = self.ledger.replicas.get(replica)
            was_ejected = was is not None and was.ejected
            ejected = self.ledger.note_failure(replica, now, connect=connect)
            to_wake: list[_Waiter] = []
            if ejected and not was_ejected:
                self._after_eject(replica, now)
                _, to_wake = self._line._hand_out(self.ledger.grant(now))
        self._line._wake(to_wake)
        return ejected

    def note_success(self, lease: Lease) -> None:
        replica = getattr(lease, "replica", None)
        if replica is not None:
            with self._lock:
                self.ledger.note_success(replica)

    def note_move(self) -> None:
        """A request moved off a failed replica without spending a retry (counted in ``status``)."""
        with self._lock:
            self.ledger.moves += 1

    def eject(self, url: str) -> None:
        """Eject ``url`` now (as failures would): no new request goes there until it returns. A replica
        that is not in the fleet (or is draining) is ignored."""
        now = self.clock.monotonic()
        url = normalize(url)
        with self._lock:
            rep = self.ledger.replicas.get(url)
            if rep is None or rep.draining:
                return
            self.ledger.eject(url, now)
            self._after_eject(url, now)
            _, to_wake = self._line._hand_out(self.ledger.grant(now))
        self._line._wake(to_wake)

    def _after_eject(self, url: str, now: float) -> None:
        rep = self.ledger.replicas.get(url)
        if rep is None:  # a draining replica forgotten meanwhile
            return
        logger.warning("fleet %s: replica %s ejected until +%.1f s (ejection %d, %d leases live on it)",
                       self.name, url, (rep.ejected_until or now) - now, rep.ejections,
                       len(rep.ledger.leases))
        self._next_due = min(t for t in (self._next_due, rep.ejected_until) if t is not None)

    def readmit(self, url: str) -> bool:
        """Bring an ejected replica back now; True if it was ejected."""
        now = self.clock.monotonic()
        with self._lock:
            back = self.ledger.readmit(normalize(url))
            _, to_wake = self._line._hand_out(self.ledger.grant(now)) if back else (None, [])
        if back:
            logger.info("fleet %s: replica %s is back", self.name, url)
        self._line._wake(to_wake)
        return back

    def _readmit_due(self, now: float) -> None:
        """Passive return (no active checks running): ejected replicas whose time is over (lock held)."""
        due = self.ledger.due(now)
        for url in due:
            self.ledger.readmit(url)
            logger.info("fleet %s: replica %s back on trial (its ejection time is over)", self.name, url)
        times = [r.ejected_until for r in self.ledger.replicas.values() if r.ejected_until is not None]
        self._next_due = min(times) if times else None

    # ------------------------------------------------------------------ membership
    def add_replica(self, url: str, limit_blocks: int | None = None, capacity: int | None = None) -> None:
        """Add a replica at run time (waiters may go there at once)."""
        limit = limit_blocks if limit_blocks is not None else self._default_limit
        if limit is None:
            raise ConfigurationError("add_replica needs limit_blocks (this fleet has no default limit)")
        now = self.clock.monotonic()
        with self._lock:
            failed = self._fail_rejected(self.ledger.add_replica(normalize(url), limit, capacity))
            _, to_wake = self._line._hand_out(self.ledger.grant(now))
        logger.info("fleet %s: replica %s joined (limit %d blocks)", self.name, url, limit)
        self._line._wake(failed + to_wake)

    def _fail_rejected(self, rejected: list[str]) -> list[_Waiter]:
        """Fail the waiters the line dropped (no replica can ever take them now; lock held)."""
        waiters = self._line._waiters
        failed = [waiters.pop(w) for w in rejected if w in waiters]
        for w in failed:
            w.error = LeaseTooLarge(w.bound, self.ledger.size_limit,
                                    "no replica of the fleet can take it now")
        return failed

    def remove_replica(self, url: str) -> None:
        """Take a replica out (it drains: its live requests finish; no new one goes there). Waiters no
        remaining replica could ever take fail with LeaseTooLarge."""
        now = self.clock.monotonic()
        with self._lock:
            failed = self._fail_rejected(self.ledger.remove_replica(normalize(url)))
            _, to_wake = self._line._hand_out(self.ledger.grant(now))
        logger.info("fleet %s: replica %s left", self.name, url)
        self._line._wake(failed + to_wake)

    def set_replica_limit(self, url: str, limit_blocks: int) -> None:
        now = self.clock.monotonic()
        with self._lock:
            failed = self._fail_rejected(self.ledger.set_replica_limit(normalize(url), limit_blocks, now))
            _, to_wake = self._line._hand_out(self.ledger.grant(now))
        self._line._wake(failed + to_wake)

    # ------------------------------------------------------------------ active checks
    async def start(self) -> Fleet:
        """Start the active checks (``/health`` probes, DNS re-resolution) on the running loop."""
        if self._task is None:
            if self._http is None:
                import httpx

                self._http = httpx.AsyncClient(timeout=2.0, trust_env=False)
                self._own_http = True
            self._task = self._sup.spawn(self._checks(), name=f"zp-fleet-{self.name}")
        if self.pd is not None and hasattr(self.pd.prefill, "start"):
            await self.pd.prefill.start()
        return self

    async def __aenter__(self) -> Fleet:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the active checks and close the fleet's own HTTP client. Live leases are not released,
        except the prefill legs kept until vLLM's lease on their KV expires (:mod:`zp_client.fleet.pd`):
        those are released now, the fleet is going away. What attached to it stops first."""
        await self._close_attached()
        deferred.run_now(self)  # the P/D prefill legs it holds (their holders name this fleet)
        self._task = None
        await self._sup.aclose()  # the checks' task: cancelled and awaited
        self._sup = Supervisor(f"fleet {self.name}")  # a closed fleet may be started again
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http, self._own_http = None, False
        if self.pd is not None:  # its prefill pool (disaggregate()) goes with it
            await self.pd.prefill.aclose()
        quiesce()

    async def _checks(self) -> None:
        while True:
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the checks must keep running
                logger.exception("fleet %s: a health/DNS check failed", self.name)
            await anyio.sleep(self.check_interval_s)

    async def check_once(self) -> None:
        """One round of active checks: re-resolve the DNS name (if any), then probe every replica's
        ``/health``: a failed probe ejects a replica; an ejected one whose time is over comes back when
        its probe answers 200."""
        if self._dns is not None:
            await self._resolve()
        now = self.clock.monotonic()
        with self._lock:
            reps = [(r.url, r.ejected, r.ejected_until) for r in self.ledger.replicas.values()
                    if not r.draining]
        results = await asyncio.gather(*(self._probe(url) for url, _, _ in reps))
        for (url, ejected, until), ok in zip(reps, results, strict=False):
            if ejected:
                if ok and until is not None and until <= now:
                    self.readmit(url)
            elif not ok:
                logger.warning("fleet %s: replica %s failed its /health probe", self.name, url)
                self.eject(url)

    async def _probe(self, url: str) -> bool:
        scheme, host, port = origin(url)
        root = f"{scheme}://{host}" + (f":{port}" if port else "")
        try:
            assert self._http is not None
            r = await self._http.get(root + "/health")
            return bool(r.status_code == 200)
        except Exception:  # noqa: BLE001 - any failure to answer is a failed probe
            return False

    async def _resolve(self) -> None:
        dns = self._dns
        assert dns is not None
        port = dns.port or (443 if dns.scheme == "https" else 80)
        try:
            addrs = await self._resolver(dns.hostname or "", port)
        except Exception as exc:  # noqa: BLE001 - keep the last known replicas
            logger.warning("fleet %s: resolving %s failed (%r); keeping the replicas it had", self.name,
                           dns.hostname, exc)
            return
        wanted = {self._url_for(dns, a) for a in addrs}
        if not wanted:
            logger.warning("fleet %s: %s resolves to no address; keeping the replicas it had", self.name,
                           dns.hostname)
            return
        with self._lock:
            have = {u for u, r in self.ledger.replicas.items() if not r.draining}
        for url in sorted(wanted - have):
            self.add_replica(url)
        for url in sorted(have - wanted):
            self.remove_replica(url)

    # ------------------------------------------------------------------ the budget: its line's
    @classmethod
    def from_settings(cls, limit_blocks: int, settings: Settings | None = None, **kwargs: Any) -> LocalBudget:
        """A LocalBudget's constructor, which a fleet has not: raises :class:`~zp_client.ConfigurationError`
        (``Fleet(urls, limit_blocks)``, :meth:`from_servers` or :meth:`from_dns` make one)."""
        raise ConfigurationError("a Fleet is made from its replicas: Fleet(urls, limit_blocks), "
                                 "Fleet.from_servers(urls) or Fleet.from_dns(url, limit_blocks)")

    @classmethod
    def from_server(
        cls,
        url: str,
        *,
        headroom: float | None = None,
        policy: str = "elastic",
        timeout_s: float = 5.0,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> LocalBudget:
        """A LocalBudget's constructor (one server), which a fleet has not: raises
        :class:`~zp_client.ConfigurationError` (:meth:`from_servers` sizes a fleet from its servers)."""
        raise ConfigurationError("a Fleet is sized replica by replica: Fleet.from_servers(urls)")

    @property
    def limit(self) -> int:
        return self._line.limit

    @property
    def size_limit(self) -> int:
        return self._line.size_limit

    @property
    def policy_name(self) -> str:
        return self._line.policy_name

    @property
    def reads_forecast_spread(self) -> bool:
        return self._line.reads_forecast_spread

    async def acquire(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, object] | None = None,
    ) -> Lease:
        """Wait in the fleet's line for a lease on one replica (a :class:`FleetLease`); as
        :meth:`zp_client.Budget.acquire`."""
        return await self._line.acquire(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                        meta=meta)

    def acquire_sync(
        self,
        blocks: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        ticket: Ticket | None = None,
        held: int | None = None,
        meta: Mapping[str, object] | None = None,
    ) -> Lease:
        """Blocking form of :meth:`acquire`."""
        return self._line.acquire_sync(blocks, priority=priority, timeout=timeout, ticket=ticket, held=held,
                                       meta=meta)

    async def status(self) -> BudgetStatus:
        return self.status_sync()

    def status_sync(self) -> BudgetStatus:
        """As LocalBudget's, with ``extra["replicas"]``: per replica its limit, used and held blocks,
        leases, ejection state and prefix hit rate (the share of its prompts' blocks the index expected
        cached there), and the fleet's moves, index size and sessions; disaggregated, ``extra["pd"]``
        (:meth:`~zp_client.fleet._routing.FleetRouting.pd_extra`)."""
        st = self._line.status_sync()
        ctl = self.adaptive
        if ctl is not None:
            st.extra["adaptive"] = ctl.state()
        if self.pd is not None:
            st.extra["pd"] = self.pd_extra(self.pd.prefill.status_sync())
        return st

    async def set_limit(self, limit: int) -> None:
        self.set_limit_sync(limit)

    def set_limit_sync(self, limit: int) -> None:
        """A fleet's limit is per replica: raises :class:`~zp_client.ConfigurationError`
        (:meth:`set_replica_limit`)."""
        self._line.set_limit_sync(limit)

    async def compare_and_set_limit(self, expected: int, limit: int, *, keep_size: bool = False) -> bool:
        return self.compare_and_set_limit_sync(expected, limit, keep_size=keep_size)

    def compare_and_set_limit_sync(self, expected: int, limit: int, *, keep_size: bool = False) -> bool:
        """A fleet has no single limit to adapt: raises :class:`~zp_client.ConfigurationError`."""
        return self._line.compare_and_set_limit_sync(expected, limit, keep_size=keep_size)

    @property
    def supports_pins(self) -> bool:
        return self._line.supports_pins

    async def pin(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                  span: int | None = None) -> None:
        self.pin_sync(key, blocks, margin=margin, track=track, span=span)

    def pin_sync(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                 span: int | None = None) -> None:
        """Not built for fleets yet: raises :class:`~zp_client.ConfigurationError`."""
        self._line.pin_sync(key, blocks, margin=margin, track=track, span=span)

    async def unpin(self, key: str) -> bool:
        return self.unpin_sync(key)

    def unpin_sync(self, key: str) -> bool:
        return self._line.unpin_sync(key)

    async def keepwarm_due(self) -> list[str]:
        return await self._line.keepwarm_due()

    async def claim_keepwarm(self, key: str, ttl_s: float) -> bool:
        return await self._line.claim_keepwarm(key, ttl_s)

    def add_keepwarm_listener(self, fn: Callable[[], None]) -> None:
        self._line.add_keepwarm_listener(fn)

    def remove_keepwarm_listener(self, fn: Callable[[], None]) -> None:
        self._line.remove_keepwarm_listener(fn)

    def __repr__(self) -> str:
        with self._lock:
            n = len(self.ledger.replicas)
        return f"<Fleet {self.name} replicas={n} limit={self.limit}>"


class _FleetLine(LocalBudget):
    """A fleet's line (private; each :class:`Fleet` composes one): a LocalBudget's shell (the lock, the
    parked waiters, the wake-ups, async and blocking waits) over the fleet's ledger, which keeps a ledger
    per replica. The hooks below are the fleet's: passive readmission, leases that name their replica,
    affinity waits; and what a fleet refuses (one limit, pins)."""

    def __init__(self, fleet: Fleet, block_size: int, *, starvation_bound_s: float, name: str,
                 clock: Clock | None) -> None:
        # the fleet's ledger replaces the placeholder one once the block size is validated here
        super().__init__(1, block_size, starvation_bound_s=starvation_bound_s, policy="strict", name=name,
                         clock=clock)
        self.fleet = fleet

    def set_limit_sync(self, limit: int) -> None:
        raise ConfigurationError("a fleet's limit is per replica: use fleet.set_replica_limit(url, blocks)")

    def compare_and_set_limit_sync(self, expected: int, limit: int, *, keep_size: bool = False) -> bool:
        raise ConfigurationError("a fleet has no single limit to adapt (per-replica adaptive limits are "
                                 "not built): use set_replica_limit")

    # ------------------------------------------------------------------ the shell's hooks
    def _enter(self, blocks: int, priority: int, ticket: Ticket | None, held: int | None,
               meta: Mapping[str, object] | None = None) -> tuple[str, _LocalLease | None, list[_Waiter]]:
        fleet = self.fleet
        if fleet._next_due is not None and fleet._task is None:
            now = self.clock.monotonic()
            if now >= fleet._next_due:
                fleet._readmit_due(now)
        return super()._enter(blocks, priority, ticket, held, meta)

    def _new_lease(self, gid: str) -> FleetLease:
        led = self.fleet.ledger
        rec = led.leases[gid]
        return FleetLease(self, gid, rec.bound, rec.held, rec.priority, rec.ticket, led.replica_of(gid) or "")

    def _affinity_poke(self, meta: Mapping[str, object] | None) -> float | None:
        if not meta or not (meta.get(PREFIX_META) or meta.get(SESSION_META) is not None):
            return None
        return self.fleet.ledger.affinity_wait_s + 1e-6

    def _poke(self) -> None:
        now = self.clock.monotonic()
        with self._lock:
            _, to_wake = self._hand_out(self.fleet.ledger.grant(now))
        self._wake(to_wake)

    async def _wait_async(self, waiter: _Waiter, timeout: float | None,
                          meta: Mapping[str, object] | None) -> None:
        poke = self._affinity_poke(meta)
        if poke is not None and (timeout is None or poke < timeout):
            with anyio.move_on_after(poke):
                await waiter.event.wait()
            if waiter.lease is not None or waiter.error is not None:
                self._count_wakeup()
                return
            self._poke()  # its affinity wait is over: the line is walked again without it
            timeout = None if timeout is None else timeout - poke
        await super()._wait_async(waiter, timeout, meta)

    def _wait_sync(self, waiter: _Waiter, timeout: float | None, meta: Mapping[str, object] | None) -> None:
        poke = self._affinity_poke(meta)
        if poke is not None and (timeout is None or poke < timeout):
            if waiter.event.wait(poke):
                self._count_wakeup()
                return
            self._poke()
            timeout = None if timeout is None else timeout - poke
        super()._wait_sync(waiter, timeout, meta)

    @property
    def supports_pins(self) -> bool:
        return False  # per-replica pins are not built yet (issue 20)

    def pin_sync(self, key: str, blocks: int, *, margin: int | None = None, track: bool = True,
                 span: int | None = None) -> None:
        raise ConfigurationError("a Fleet does not support pinned prefixes yet; pin on a LocalBudget or "
                                 "RedisBudget of one server")

    def unpin_sync(self, key: str) -> bool:
        return False

    async def keepwarm_due(self) -> list[str]:
        return []

    async def claim_keepwarm(self, key: str, ttl_s: float) -> bool:
        return False

    def _nudge_keepwarm(self) -> None:
        return
