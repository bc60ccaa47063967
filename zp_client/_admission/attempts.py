"""The attempt loop: lease, send, and one place that decides between retrying and raising.

:meth:`AttemptLoop.admit` plans a request (:mod:`~zp_client._admission.planner`, reading server metadata
first) and runs its attempts: acquire a lease, send, hand the answer to delivery
(:mod:`~zp_client._admission.delivery`); a failed or refused attempt goes to
:meth:`AttemptLoop.retry_or_raise`. On a fleet a failed connection moves the request to another replica
without spending a retry; a disaggregated fleet's two-phase lease is its own sub-machine
(:mod:`zp_client.fleet.pd`), reached through the :class:`~zp_client._admission.loop_ports.TwoPhaseCall` port.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Generator
from typing import TYPE_CHECKING, cast

from zp_client._admission.actions import (
    Acquire,
    Action,
    Close,
    Decide,
    Estimate,
    NewRetryState,
    Release,
    Send,
    Sleep,
    Steps,
    WaitBudget,
)
from zp_client._admission.delivery import Delivery, is_answered, is_incomplete
from zp_client._admission.loop_ports import Fleet, TwoPhaseCall
from zp_client._admission.parts import Parts
from zp_client._admission.plan import Plan
from zp_client._admission.planner import Planner
from zp_client._admission.ports import (
    AsyncInner,
    HttpRequest,
    HttpResponse,
    HttpURL,
    LeaseMeta,
    Placed,
    Predicted,
    RetryPolicy,
    SyncInner,
)
from zp_client._admission.release import Holder
from zp_client._admission.servers import Servers
from zp_client.budget.base import Budget, Lease, Ticket
from zp_client.errors import AdmissionTimeout, DeadlineExceeded, ServerUnreachable, ZPError, error_chain
from zp_client.estimate import PromptEstimate
from zp_client.observe import AdmissionInfo
from zp_client.observe import active as active_observers
from zp_client.observe import notify as notify_observers

if TYPE_CHECKING:
    from zp_client.observe import _Observer
    from zp_client.retry import RetryDecision, RetryState

__all__ = ["AttemptLoop", "OVERLOAD_STATUSES", "is_unreachable", "unreachable"]

logger = logging.getLogger("zp_client.transport")

# Answers that mean the server is overloaded: each is reported to the budget (Budget.note_overload), which
# tells an attached adaptive limit (zp_client.adaptive).
OVERLOAD_STATUSES = frozenset({429, 503, 529})
_CONNECT_ERRORS = ("ConnectError", "ConnectTimeout")


def is_unreachable(exc: BaseException) -> bool:
    """An httpx/httpx2 connect error or connect timeout: the attempt reached no server."""
    from zp_client.retry import is_unreachable as _is

    return _is(exc)


def _refused(e: BaseException) -> bool:
    return (isinstance(e, ConnectionRefusedError)
            or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED) or "refused" in str(e).lower())


def unreachable(request: HttpRequest, exc: BaseException, attempts: int) -> ServerUnreachable:
    """The :class:`ServerUnreachable` for a request whose last attempt could not connect."""
    try:
        url = str(request.url.copy_with(query=None))
    except Exception:  # noqa: BLE001 - any URL type: its text is enough
        url = str(request.url)
    if type(exc).__name__ == "ConnectTimeout":
        reason = "timed out connecting"
    elif any(_refused(e) for e in error_chain(exc)):
        reason = "connection refused"
    else:
        reason = f"could not connect ({exc})" if str(exc) else "could not connect"
    err = ServerUnreachable(url, reason, attempts)
    err.request = request  # type: ignore[attr-defined]  # what openai.APIConnectionError carries
    return err


class AttemptLoop:
    """Runs the attempts of the admitted requests of one core; the
    :class:`~zp_client._admission.loop_ports.AttemptContext` of a two-phase lease."""

    def __init__(self, parts: Parts, planner: Planner, servers: Servers, delivery: Delivery) -> None:
        self._parts = parts
        self._planner = planner
        self._servers = servers
        self._delivery = delivery

    # -- the AttemptContext port --------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._parts.budget.block_size

    def now(self) -> float:
        return self._parts.clock.monotonic()

    def remaining(self, plan: Plan) -> float | None:
        return None if plan.deadline is None else plan.deadline - self._parts.clock.monotonic()

    def lease_meta(self, plan: Plan, meta: LeaseMeta | None) -> LeaseMeta | None:
        return self._planner.lease_meta(plan, meta)

    def hold(self, lease: Lease, *, is_async: bool, budget: Budget) -> Holder:
        parts = self._parts
        return Holder(lease, parts.settings.idle_stream_timeout_s, is_async=is_async, clock=parts.clock,
                      budget=budget)

    def request(self, original: HttpRequest, plan: Plan, url: HttpURL | None = None) -> HttpRequest:
        return self._parts.lib.request(original, plan, url)

    def is_event_stream(self, resp: HttpResponse) -> bool:
        return self._parts.lib.is_event_stream(resp)

    # -- deadlines ----------------------------------------------------------------------------------
    def check_deadline(self, plan: Plan, attempt: int) -> float | None:
        rem = self.remaining(plan)
        if rem is not None and rem <= 0:
            raise DeadlineExceeded(
                f"the request's deadline passed before attempt {attempt + 1} could be admitted; "
                "raise X-ZP-Deadline / Settings.deadline_s or lower the load"
            )
        return rem

    # -- one request --------------------------------------------------------------------------------
    def metered(self, steps: Steps) -> Steps:
        """``steps`` counting the zp error that ends the request, if one does (refusals by type)."""
        try:
            return (yield from steps)
        except ZPError as exc:
            assert self._parts.metrics is not None
            self._parts.metrics.refused(exc)
            raise

    def admit(self, request: HttpRequest, inner: AsyncInner | SyncInner, is_async: bool) -> Steps:
        """Plan ``request`` (reading what it needs of its server) and run its attempts."""
        parts, planner, servers = self._parts, self._planner, self._servers
        p = planner.parse(request)
        if p is None:  # not JSON: not admitted, sent as it is
            return cast(HttpResponse, (yield Send(request)))
        est: PromptEstimate
        if parts.settings.estimator == "server":
            server = servers.server_for(p, inner)
            est = cast(PromptEstimate, (yield Estimate(request.url.path, p.body, server)))
        else:
            est = parts.estimator.estimate(request.url.path, p.body)
        mml = yield from servers.max_model_len(p, inner)
        if servers.claim_pool_check(p):
            yield from servers.pool_probe(p, inner)
        plan = planner.finish_plan(request, p, est, mml)
        fleet = parts.fleet
        pd = fleet.pd if fleet is not None else None
        if (fleet is None or pd is None or not p.chat_or_completions or "kv_transfer_params" in p.body
                or plan.n > 1):
            return (yield from self._attempts(request, plan, is_async, None))
        st = pd.call(fleet, plan, p.body, self)  # a disaggregated fleet: the two-phase lease (fleet/pd.py)
        try:
            resp = yield from self._attempts(request, plan, is_async, st)
        except BaseException:
            yield from st.drop()
            raise
        yield from st.drop()
        return resp

    def _attempts(self, request: HttpRequest, plan: Plan, is_async: bool, st: TwoPhaseCall | None) -> Steps:
        """The attempt loop: lease, send, retry; ``st``: a disaggregated request's prefill side."""
        parts = self._parts
        retry = parts.retry
        state = cast("RetryState", (yield NewRetryState(retry))) if retry is not None else None
        ticket: Ticket | None = None
        attempt = 0
        moves = 0
        fleet = parts.fleet
        m = parts.metrics
        clock = parts.clock
        while True:
            timeout = self.check_deadline(plan, attempt)
            observers = active_observers()  # () unless the caller is inside observe_admissions()
            asked = clock.monotonic() if m is not None or observers else 0.0
            reuse = None if st is None else st.reusable_for(clock.monotonic())
            if st is not None and reuse is None and (yield from st.before_attempt(plan, is_async)):
                timeout = self.check_deadline(plan, attempt)  # what is left after the prefill leg's wait
            if st is not None and reuse is not None and (timeout is None or reuse < timeout):
                # a prefill leg kept for a decode retry waits for decode room only while its KV is alive
                try:
                    lease = cast(Lease, (yield Acquire(plan.blocks, plan.priority, reuse, ticket, plan.held,
                                                       self.lease_meta(plan, plan.meta))))
                except AdmissionTimeout:
                    yield from st.drop()
                    continue
            else:
                lease = cast(Lease, (yield Acquire(plan.blocks, plan.priority, timeout, ticket, plan.held,
                                                   self.lease_meta(plan, plan.meta))))
            holder = Holder(lease, parts.settings.idle_stream_timeout_s, is_async=is_async, clock=clock,
                            metrics=m, budget=parts.budget)
            try:
                if m is not None:
                    m.waited(plan.priority, holder.granted_at - asked)
                    predicted = lease.predicted_wait_s if isinstance(lease, Predicted) else None
                    if predicted is not None:
                        m.predicted(plan.priority, predicted, holder.granted_at - asked)
                if observers:
                    self._notify(observers, plan, lease, holder.granted_at - asked, attempt)
            except BaseException:  # an observer's KeyboardInterrupt / SystemExit: the lease goes back
                yield Release(holder)
                raise
            ticket = lease.ticket
            if state is not None:
                state.ticket = ticket
            assembled = False
            prefetched = None
            try:
                url = request.url if fleet is None else fleet.route_url(lease, request.url)
                out = plan
                if st is not None:  # a disaggregated fleet: the prefill phase first
                    out = yield from st.prefill(plan, request, lease, holder.granted_at)
                resp = cast(HttpResponse, (yield Send(parts.lib.request(request, out, url), plan.deadline)))
                if st is not None:
                    st.answered(resp)
                if plan.upstream and parts.lib.is_event_stream(resp):
                    resp = yield from self._delivery.consume(plan, request, resp, holder,
                                                             None if st is None else st.leg)
                    assembled = True
                elif fleet is not None and plan.stream and parts.lib.is_event_stream(resp):
                    # on a fleet the stream reaches its caller with its first bytes: a replica that
                    # fails before them moves the request like a refused connection
                    prefetched = yield from self._delivery.peek(resp, plan.deadline)
                    if st is not None:  # the decode replica has read the KV: the prefill leg ends
                        yield from st.decode_started()
            except Exception as exc:
                yield Release(holder)
                if st is not None and type(exc).__name__ in _CONNECT_ERRORS:
                    st.connect_failed()  # no decode replica has the request: its KV may go to another
                if fleet is not None and self._move(fleet, lease, exc, moves):
                    moves += 1  # sent elsewhere, keeping its place: no retry spent, no attempt counted
                    plan.meta = fleet.avoiding(plan.meta, lease)
                    continue
                if is_answered(exc):  # the server answered: only its caller may retry
                    raise
                if retry is None or state is None:
                    if is_unreachable(exc):
                        raise unreachable(request, exc, attempt + 1) from None
                    raise
                yield from self.retry_or_raise(request, plan, retry, state, lease, attempt, error=exc)
                attempt += 1
                continue
            except BaseException:
                yield Release(holder)
                raise
            try:
                if resp.status_code in OVERLOAD_STATUSES:
                    parts.budget.note_overload(resp.status_code)  # an adaptive limit's signal
                elif fleet is not None:  # the replica's health: 5xx answers count against it
                    if resp.status_code >= 500:
                        fleet.note_failure(lease)
                    else:
                        fleet.note_success(lease)
                # successes too: an answer is the retry budget's deposit
                if (retry is not None and state is not None
                        and (yield from self.retry_or_raise(request, plan, retry, state, lease, attempt,
                                                            answer=(resp, holder)))):
                    attempt += 1
                    continue
                if assembled:  # consumed, observed and released already
                    return resp
                return (yield from self._delivery.deliver(plan, resp, holder, is_async, prefetched))
            except BaseException:
                yield Close(resp, shield=True)
                yield Release(holder)
                raise

    def retry_or_raise(self, request: HttpRequest, plan: Plan, retry: RetryPolicy, state: RetryState,
                       lease: Lease, attempt: int, *, error: BaseException | None = None,
                       answer: tuple[HttpResponse, Holder] | None = None) -> Generator[Action, object, bool]:
        """Ask the retry policy about an attempt that failed with ``error`` or was answered (``answer``:
        the response and its lease's holder) and act on it: raise when it gives up (the policy's error,
        :class:`ServerUnreachable` when no server answered, else ``error`` itself); otherwise sleep (and
        wait for the retry budget when it owes one) and return True: the next attempt. False: an answer
        that goes to the caller as it is."""
        resp = None if answer is None else answer[0]
        status = None if resp is None else resp.status_code
        d = cast("RetryDecision", (yield Decide(retry, state, status, None if resp is None else resp.headers,
                                              error, self.remaining(plan))))
        if answer is not None:
            if not d.retry and d.error is None:
                return False
            resp, holder = answer
            yield Close(resp, shield=False)
            yield Release(holder)
            if not d.retry:
                assert d.error is not None
                raise d.error
            logger.info("attempt %d got HTTP %d (%s): retrying in %.3f s", attempt + 1, resp.status_code,
                        d.reason, d.delay_s)
        else:
            assert error is not None
            if not d.retry:
                if d.error is not None and d.error is not error:
                    raise d.error from error
                if is_unreachable(error):  # no server answered: say so, not "overloaded"
                    raise unreachable(request, error, attempt + 1) from None
                raise error
            logger.info("attempt %d failed (%s): retrying in %.3f s", attempt + 1, d.reason, d.delay_s)
        fleet = self._parts.fleet
        if fleet is not None:
            plan.meta = fleet.avoiding(plan.meta, lease)
        yield Sleep(retry, d.delay_s)
        if d.budget_owed:
            yield WaitBudget(retry, state, self.remaining(plan))
        if self._parts.metrics is not None:  # granted now
            self._parts.metrics.retried(status, error)
        return True

    def _move(self, fleet: Fleet, lease: Lease, exc: BaseException, moves: int) -> bool:
        """Whether a failed attempt on a fleet replica moves to another one: the request never reached
        the caller and the connection failed (no connection, reset, cut: not a timeout, where the server
        may still be working). Tells the fleet either way; bounded by ``fleet.max_moves`` per replica."""
        from zp_client.retry import classify_error

        kind = classify_error(exc)
        name = type(exc).__name__
        if kind is None or name in ("ReadTimeout", "WriteTimeout", "PoolTimeout"):
            return False
        fleet.note_failure(lease, connect=name in _CONNECT_ERRORS)
        if is_incomplete(exc):  # the server ended it: moving would redo the work
            return False
        if moves >= fleet.max_moves * max(1, len(fleet.replicas)):
            return False
        fleet.note_move()
        logger.info("attempt on %s failed (%s): moving the request to another replica",
                    lease.replica if isinstance(lease, Placed) else "?", name)
        return True

    def _notify(self, observers: tuple[_Observer, ...], plan: Plan, lease: Lease, waited: float,
                attempt: int) -> None:
        """One :class:`~zp_client.observe.AdmissionInfo` for this grant, to the caller's observers."""
        from zp_client._admission.ports import Named

        budget = self._parts.budget
        info = AdmissionInfo(
            queue_wait_s=max(0.0, waited),
            leased_blocks=int(lease.bound),
            held_blocks=plan.held,
            priority=plan.priority,
            attempt=attempt + 1,
            budget=budget.name if isinstance(budget, Named) else None,
            policy=budget.policy_name,
            route=plan.route,
            lease_id=str(lease.id),
            replica=lease.replica if isinstance(lease, Placed) else None,
            predicted_wait_s=lease.predicted_wait_s if isinstance(lease, Predicted) else None,
        )
        notify_observers(observers, info)
