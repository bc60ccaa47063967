"""The two drivers of the admission core: async and blocking. Each performs the actions of the
attempt loop (:class:`zp_client._admission.actions.Machine`) with its I/O; neither decides anything itself.

The public transport classes (:mod:`zp_client.transport`) are these drivers over one HTTP library's
base classes. See docs/admission.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable
from typing import ClassVar, Generic, TypeVar, cast

import anyio

from zp_client._admission.actions import (
    Acquire,
    Action,
    Close,
    Decide,
    Done,
    Estimate,
    Machine,
    ModelLen,
    NewRetryState,
    Peek,
    PoolSize,
    ReadAll,
    Release,
    Send,
    Sleep,
    WaitBudget,
)
from zp_client._admission.core import Core
from zp_client._admission.httplib import POOL_CHECK_S, HttpLib
from zp_client._admission.plan import is_admitted
from zp_client._admission.ports import (
    AsyncInner,
    Estimator,
    Forecaster,
    HttpRequest,
    HttpResponse,
    Metrics,
    RetryPolicy,
    SyncInner,
)
from zp_client._admission.release import alarms, cut_connection, deadline_exceeded
from zp_client._tasks import quiesce
from zp_client.budget.base import Budget
from zp_client.clock import SYSTEM_CLOCK, Clock
from zp_client.config import Settings
from zp_client.errors import ServerInfoError, ServerUnreachable, ZPError

__all__ = ["AsyncDriver", "SyncDriver"]

Resp = TypeVar("Resp", bound=HttpResponse, covariant=True)
"""The HTTP library's response class (``httpx.Response``...): what a transport of that library returns."""

#: A transport error this close to (or past) a call's deadline is the deadline's doing (a per-phase timeout
#: capped to it, or the connection cut at it): the caller gets DeadlineExceeded.
DEADLINE_SLACK_S = 0.05
_WAITING = "while waiting for the server's answer"
_READING = "while reading the server's answer"


def _sys_now() -> float:
    return SYSTEM_CLOCK.monotonic()


def capped_timeouts(request: HttpRequest, remaining: float) -> None:
    """Cap ``request``'s per-phase timeouts (connect, read, write, pool) at ``remaining`` seconds: a
    blocking attempt cannot wait past its call's deadline for headers. A new extensions dict: the
    caller's request shares the old one."""
    ext = request.extensions
    old = cast("dict[str, float | None]", ext.get("timeout") or {})
    rem = max(0.001, remaining)
    capped: dict[str, float] = {}
    for k in ("connect", "read", "write", "pool"):
        given = old.get(k)
        capped[k] = rem if given is None or given > rem else given
    request.extensions = {**ext, "timeout": capped}


class _Driver:
    """What both drivers share: construction, the core, the properties."""

    lib: ClassVar[HttpLib]

    def __init__(
        self,
        inner: object | None = None,
        *,
        budget: Budget,
        settings: Settings | None = None,
        estimator: Estimator | None = None,
        retry: RetryPolicy | bool | None = None,
        close_inner: bool = True,
        forecaster: Forecaster | None = None,
        stream_upstream: bool | None = None,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        # the library's own transport (httpx or httpx2, checked by the library when it is used)
        self._inner = cast("AsyncInner | SyncInner", inner) if inner is not None else self._default_inner()
        self._core = Core(budget, settings, estimator, retry, forecaster, stream_upstream, lib=self.lib,
                          clock=clock, metrics=metrics)
        self._close_inner = close_inner
        self._keep_alive: object = None

    def _default_inner(self) -> AsyncInner | SyncInner:
        raise NotImplementedError

    def share_core(self, other: _Driver) -> None:
        """Use ``other``'s core (one estimator, one metadata cache, one error conversion), as
        :func:`zp_client.wrap` does for a client's mounted transports."""
        self._core = other._core

    def keep_alive(self, obj: object) -> None:
        """Keep ``obj`` alive as long as this transport (wrap() keeps a sync openai original so)."""
        self._keep_alive = obj

    @property
    def budget(self) -> Budget:
        """The KV budget this transport admits on."""
        return self._core.budget

    @property
    def forecaster(self) -> Forecaster | None:
        """The output-length forecaster (elastic budgets; None under strict unless one was given)."""
        return self._core.forecaster

    @property
    def core(self) -> Core:
        """The admission core (internal; wrap() sets its error conversion)."""
        return self._core

    def _surface(self, exc: ZPError) -> BaseException:
        return self._core.surface(exc)


class AsyncDriver(_Driver, Generic[Resp]):
    """Runs the attempt loop with async I/O (``handle_async_request``)."""

    def _default_inner(self) -> AsyncInner:
        return cast(AsyncInner, self.lib.module.AsyncHTTPTransport())

    @property
    def _async_inner(self) -> AsyncInner:
        return cast(AsyncInner, self._inner)

    async def handle_async_request(self, request: HttpRequest) -> Resp:
        """Admit ``request`` (an LLM call; any other passes through) and return its response."""
        if not is_admitted(request.method, request.url.path):
            return cast(Resp, await self._async_inner.handle_async_request(self._core.passthrough(request)))
        await request.aread()
        machine = self._core.admit(request, self._inner, is_async=True)
        try:
            return cast(Resp, await self._run(machine))
        except ZPError as exc:
            surfaced = self._surface(exc)
            if isinstance(exc, ServerUnreachable):
                # the whole story is in its message: no chained transport errors, no frames of the loop
                raise surfaced.with_traceback(None) from None
            if surfaced is exc:
                raise
            raise surfaced from exc

    async def _run(self, machine: Machine) -> HttpResponse:
        step = machine.start()
        while not isinstance(step, Done):
            try:
                result = await self._perform(step)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop; it re-raises what it does not handle
                step = machine.throw(exc)
            else:
                step = machine.send(result)
        return step.response

    async def _perform(self, action: Action) -> object:
        core = self._core
        if isinstance(action, Acquire):
            budget = action.budget or core.budget
            if action.meta is None:  # no meta argument: a backend written before it existed keeps working
                return await budget.acquire(action.blocks, priority=action.priority, timeout=action.timeout,
                                            ticket=action.ticket, held=action.held)
            return await budget.acquire(action.blocks, priority=action.priority, timeout=action.timeout,
                                        ticket=action.ticket, held=action.held, meta=dict(action.meta))
        if isinstance(action, Send):
            if action.deadline is None:
                return await self._async_inner.handle_async_request(action.request)
            with anyio.move_on_after(max(0.0, action.deadline - core.clock.monotonic())):
                return await self._async_inner.handle_async_request(action.request)
            raise deadline_exceeded(_WAITING)
        if isinstance(action, Release):
            if action.after_s > 0:
                action.holder.release_later(action.after_s)
                return None
            await action.holder.release()
            return None
        if isinstance(action, Decide):
            return await action.policy.decide_async(
                action.state, status=action.status, headers=action.headers, error=action.error,
                delivered=False, remaining_s=action.remaining_s, wait_for_budget=True)
        if isinstance(action, Sleep):
            await action.policy.sleep(action.seconds)
            return None
        if isinstance(action, WaitBudget):
            await action.policy.wait_for_budget_async(action.state, remaining_s=action.remaining_s)
            return None
        if isinstance(action, Close):
            if action.shield:
                with anyio.CancelScope(shield=True):
                    await action.response.aclose()
                    return None
            await action.response.aclose()
            return None
        if isinstance(action, ReadAll):
            if action.deadline is None:
                await self._read_all(action)
                return None
            with anyio.move_on_after(max(0.0, action.deadline - core.clock.monotonic())):
                await self._read_all(action)
                return None
            raise deadline_exceeded(_READING)
        if isinstance(action, Peek):
            rest = cast(AsyncIterable[bytes], action.response.stream).__aiter__()
            try:
                if action.deadline is None:
                    first = await rest.__anext__()
                else:
                    with anyio.move_on_after(max(0.0, action.deadline - core.clock.monotonic())):
                        first = await rest.__anext__()
                        return first, rest
                    raise deadline_exceeded(_WAITING)
            except StopAsyncIteration:
                first = None
            return first, rest
        if isinstance(action, NewRetryState):
            # RedisRetryBudget records the request over the network: not on the event loop's thread.
            return await action.policy.new_request_async()
        if isinstance(action, Estimate):
            return await core.estimator.estimate_async(action.path, action.body, action.server)
        if isinstance(action, ModelLen):
            return await action.server.max_model_len(action.model)
        if isinstance(action, PoolSize):
            # one bound for the whole read (the request's timeouts are per phase)
            with anyio.move_on_after(POOL_CHECK_S) as scope:
                return await action.server.metrics()
            if scope.cancelled_caught:
                raise ServerInfoError("/metrics", 0, f"no answer within {POOL_CHECK_S:g} s")
        raise TypeError(f"unknown action {action!r}")

    @staticmethod
    async def _read_all(action: ReadAll) -> None:
        first = action.on_first
        async for chunk in action.response.aiter_bytes():
            action.sink(chunk)
            if first is not None:
                await first.release()
                first = None

    async def aclose(self) -> None:
        if self._close_inner:
            await self._async_inner.aclose()
        quiesce()  # the process-wide service threads end once nothing is left for them to do


class SyncDriver(_Driver, Generic[Resp]):
    """Runs the attempt loop with blocking I/O (``handle_request``)."""

    def _default_inner(self) -> SyncInner:
        return cast(SyncInner, self.lib.module.HTTPTransport())

    @property
    def _sync_inner(self) -> SyncInner:
        return cast(SyncInner, self._inner)

    def handle_request(self, request: HttpRequest) -> Resp:
        """Admit ``request`` (an LLM call; any other passes through) and return its response."""
        if not is_admitted(request.method, request.url.path):
            return cast(Resp, self._sync_inner.handle_request(self._core.passthrough(request)))
        request.read()
        machine = self._core.admit(request, self._inner, is_async=False)
        try:
            return cast(Resp, self._run(machine))
        except ZPError as exc:
            surfaced = self._surface(exc)
            if isinstance(exc, ServerUnreachable):
                # the whole story is in its message: no chained transport errors, no frames of the loop
                raise surfaced.with_traceback(None) from None
            if surfaced is exc:
                raise
            raise surfaced from exc

    def _run(self, machine: Machine) -> HttpResponse:
        step = machine.start()
        while not isinstance(step, Done):
            try:
                result = self._perform(step)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop; it re-raises what it does not handle
                step = machine.throw(exc)
            else:
                step = machine.send(result)
        return step.response

    def _perform(self, action: Action) -> object:
        core = self._core
        if isinstance(action, Acquire):
            budget = action.budget or core.budget
            if action.meta is None:  # as the async driver
                return budget.acquire_sync(action.blocks, priority=action.priority, timeout=action.timeout,
                                           ticket=action.ticket, held=action.held)
            return budget.acquire_sync(action.blocks, priority=action.priority, timeout=action.timeout,
                                       ticket=action.ticket, held=action.held, meta=dict(action.meta))
        if isinstance(action, Send):
            if action.deadline is None:
                return self._sync_inner.handle_request(action.request)
            capped_timeouts(action.request, action.deadline - core.clock.monotonic())
            try:
                return self._sync_inner.handle_request(action.request)
            except Exception as exc:
                self._check_deadline(action.deadline, exc, _WAITING)
                raise
        if isinstance(action, Release):
            if action.after_s > 0:
                action.holder.release_later(action.after_s)
                return None
            action.holder.release_sync()
            return None
        if isinstance(action, Decide):
            return action.policy.decide(
                action.state, status=action.status, headers=action.headers, error=action.error,
                delivered=False, remaining_s=action.remaining_s, wait_for_budget=True)
        if isinstance(action, Sleep):
            action.policy.sleep_sync(action.seconds)
            return None
        if isinstance(action, WaitBudget):
            action.policy.wait_for_budget(action.state, remaining_s=action.remaining_s)
            return None
        if isinstance(action, Close):
            action.response.close()
            return None
        if isinstance(action, ReadAll):
            first = action.on_first
            token = self._alarm(action.deadline, action.response)
            try:
                for chunk in action.response.iter_bytes():
                    self._check_deadline(action.deadline, None, _READING)  # a trickle ends there too
                    action.sink(chunk)
                    if first is not None:
                        first.release_sync()
                        first = None
            except Exception as exc:
                self._check_deadline(action.deadline, exc, _READING)
                raise
            finally:
                if token is not None:
                    alarms.cancel(token)
            return None
        if isinstance(action, Peek):
            rest = iter(cast(Iterable[bytes], action.response.stream))
            token = self._alarm(action.deadline, action.response)
            try:
                return next(rest, None), rest
            except Exception as exc:
                self._check_deadline(action.deadline, exc, _WAITING)
                raise
            finally:
                if token is not None:
                    alarms.cancel(token)
        if isinstance(action, NewRetryState):
            return action.policy.new_request()
        if isinstance(action, Estimate):
            return core.estimator.estimate_sync_server(action.path, action.body, action.server)
        if isinstance(action, ModelLen):
            return action.server.max_model_len_sync(action.model)
        if isinstance(action, PoolSize):
            return action.server.metrics_sync()
        raise TypeError(f"unknown action {action!r}")

    def _alarm(self, deadline: float | None, resp: HttpResponse) -> int | None:
        """At ``deadline``, cut ``resp``'s connection (a blocking read in progress then returns)."""
        if deadline is None:
            return None
        return alarms.at(deadline - self._core.clock.monotonic() + _sys_now(), lambda: cut_connection(resp))

    def _check_deadline(self, deadline: float | None, exc: BaseException | None, where: str) -> None:
        """Raise DeadlineExceeded (from ``exc``) when ``deadline`` has passed (a transport error within
        :data:`DEADLINE_SLACK_S` of it counts: the capped timeout or the cut connection was the cause)."""
        if deadline is None:
            return
        left = deadline - self._core.clock.monotonic()
        if left <= 0 or (exc is not None and left <= DEADLINE_SLACK_S):
            if exc is None:
                raise deadline_exceeded(where)
            raise deadline_exceeded(where) from exc

    def close(self) -> None:
        if self._close_inner:
            self._sync_inner.close()
        quiesce()
