"""The ports that speak the attempt loop's own vocabulary (its plan, actions, lease holders and body
scanner): the fleet it routes through, a disaggregated fleet's two-phase lease, and the response body that
reports back. The other collaborators' ports are in :mod:`~zp_client._admission.ports`; these are kept
apart so that module imports nothing of the package."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from zp_client._admission.ports import HttpRequest, HttpResponse, HttpURL, LeaseMeta

if TYPE_CHECKING:
    from zp_client._admission.actions import Action
    from zp_client._admission.plan import Plan
    from zp_client._admission.release import Holder
    from zp_client._sse import Scanner
    from zp_client.budget.base import Budget, Lease

__all__ = ["BodyObserver", "Fleet", "TwoPhase", "TwoPhaseCall", "AttemptContext"]


# --------------------------------------------------------------------------------------------------
# The body handed to the caller calls back through this (not into the core)
# --------------------------------------------------------------------------------------------------


class BodyObserver(Protocol):
    """What a response body handed to the caller reports back while it is read."""

    def observe(self, plan: Plan, scanner: Scanner) -> None:
        """The body ended: learn from its usage."""

    def observe_seen(self, plan: Plan, scanner: Scanner) -> None:
        """The body was closed early: learn only if its usage already went by."""

    def surface(self, exc: BaseException) -> BaseException:
        """The error the caller sees for ``exc`` (wrap() makes zp errors openai-compatible)."""

    def stream_cut(self, lease: Lease, exc: BaseException) -> BaseException | None:
        """The error for a fleet replica's stream cut under its reader; None: ``exc`` as it is."""


# --------------------------------------------------------------------------------------------------
# The fleet, and a disaggregated fleet's two-phase lease
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class Fleet(Protocol):
    """What the core asks of a fleet (:class:`zp_client.fleet.Fleet`,
    :class:`~zp_client.fleet.redis.RedisFleet`): where an attempt goes, what routing adds to a lease's
    meta, the replicas' health."""

    is_fleet: bool
    max_moves: int

    @property
    def replicas(self) -> list[str]: ...

    @property
    def pd(self) -> TwoPhase | None: ...

    def route_url(self, lease: Lease, url: HttpURL) -> HttpURL: ...

    def passthrough_url(self, url: HttpURL) -> HttpURL: ...

    def metadata_base(self, base: str, root: str) -> tuple[str, str]: ...

    def routing_meta(self, body: Mapping[str, object], prompt_tokens: int,
                     session: str | None) -> dict[str, object]: ...

    def routing_only(self, meta: Mapping[str, object] | None) -> dict[str, object] | None: ...

    def avoiding(self, meta: Mapping[str, object] | None, lease: Lease) -> dict[str, object]: ...

    def matched_tokens(self, lease: Lease) -> int: ...

    def best_matched_tokens(self, meta: Mapping[str, object] | None) -> int: ...

    def note_failure(self, lease: Lease, *, connect: bool = False) -> bool: ...

    def note_success(self, lease: Lease) -> None: ...

    def note_move(self) -> None: ...


class AttemptContext(Protocol):
    """What the two-phase lease asks of the attempt loop that runs it."""

    @property
    def block_size(self) -> int: ...

    def now(self) -> float: ...

    def remaining(self, plan: Plan) -> float | None: ...

    def lease_meta(self, plan: Plan, meta: LeaseMeta | None) -> LeaseMeta | None: ...

    def hold(self, lease: Lease, *, is_async: bool, budget: Budget) -> Holder:
        """A holder for ``lease``, taken from ``budget``."""

    def request(self, original: HttpRequest, plan: Plan, url: HttpURL | None = None) -> HttpRequest: ...

    def is_event_stream(self, resp: HttpResponse) -> bool: ...


class TwoPhaseCall(Protocol):
    """One disaggregated request's prefill side across its attempts (:mod:`zp_client.fleet.pd`)."""

    @property
    def leg(self) -> Holder | None:
        """The prefill leg while held (released at the decode stream's first chunk)."""

    def reusable_for(self, now: float) -> float | None: ...

    def before_attempt(self, plan: Plan, is_async: bool) -> Generator[Action, object, bool]:
        """Before an attempt that reuses nothing: end the old leg, take a new one if the request is
        disaggregated. True when it took one (the deadline's remainder is to be read again)."""

    def prefill(self, plan: Plan, request: HttpRequest, lease: Lease,
                granted_at: float) -> Generator[Action, object, Plan]: ...

    def answered(self, resp: HttpResponse) -> None: ...

    def decode_started(self) -> Generator[Action, object, None]: ...

    def connect_failed(self) -> None: ...

    def drop(self) -> Generator[Action, object, None]: ...


class TwoPhase(Protocol):
    """A decode fleet's prefill side (:class:`zp_client.fleet.pd.PDSettings`)."""

    def call(self, decode: Fleet, plan: Plan, body: Mapping[str, object],
             ctx: AttemptContext) -> TwoPhaseCall: ...
