"""What the attempt loop asks its driver to do, and the machine that asks.

:class:`Machine` is the attempt loop of one request as a state machine: it yields actions
(:class:`Acquire`, :class:`Send`, :class:`Decide`, :class:`Sleep`, :class:`Release`...) and takes their
results, the way ``h11`` or :mod:`zp_client.budget.ledger` keep decisions apart from I/O. The drivers
(:mod:`zp_client._admission.drivers`) perform the actions, async or blocking. Each action's docstring
says what the driver sends back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zp_client._admission.ports import (
    HttpHeaders,
    HttpRequest,
    HttpResponse,
    JSONObject,
    LeaseMeta,
    RetryPolicy,
)
from zp_client._admission.release import Holder
from zp_client.budget.base import Budget, Ticket

if TYPE_CHECKING:
    from zp_client.retry import RetryState
    from zp_client.server import ServerInfo

__all__ = ["Estimate", "ModelLen", "PoolSize", "NewRetryState", "Acquire", "Send", "ReadAll", "Peek", "Close",
           "Release", "Decide", "WaitBudget", "Sleep", "Action", "Done", "Machine", "Prefetched", "Steps"]

Prefetched = tuple[bytes | None, "Iterator[bytes] | AsyncIterator[bytes]"]
"""A body's first chunk (None: it was empty) and an iterator over the rest (sync or async)."""


@dataclass(frozen=True)
class Estimate:
    """Estimate the prompt with the server's tokenizer (``Settings.estimator == "server"``) -> estimate."""

    path: str
    body: JSONObject
    server: ServerInfo


@dataclass(frozen=True)
class ModelLen:
    """Read the model's context length from the server -> int or None."""

    server: ServerInfo
    model: str | None


@dataclass(frozen=True)
class PoolSize:
    """Read the server's ``GET /metrics`` (its KV pool, ``vllm:cache_config_info``) -> ServerMetrics."""

    server: ServerInfo


@dataclass(frozen=True)
class NewRetryState:
    """Start the retry policy's state for this request -> RetryState."""

    policy: RetryPolicy


@dataclass(frozen=True)
class Acquire:
    """Take a lease from the budget -> Lease."""

    blocks: int
    priority: int
    timeout: float | None
    ticket: Ticket | None
    held: int
    meta: LeaseMeta | None
    budget: Budget | None = None
    """The budget to take it from (None: the core's; a disaggregated fleet's prefill leg names its prefill
    fleet)."""

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``Budget.acquire``; ``meta`` only when there is some (a backend written
        before it existed keeps working)."""
        kw: dict[str, object] = {"priority": self.priority, "timeout": self.timeout, "ticket": self.ticket,
                                 "held": self.held}
        if self.meta is not None:
            kw["meta"] = dict(self.meta)
        return kw


@dataclass(frozen=True)
class Send:
    """Send the request through the inner transport -> its response (headers read, body not)."""

    request: HttpRequest
    deadline: float | None = None
    """The call's deadline (monotonic): the driver ends the wait for the headers there with
    :class:`DeadlineExceeded` (the deadline bounds the whole call up to its last byte)."""


@dataclass(frozen=True)
class ReadAll:
    """Read the response body to its end, passing each chunk to ``sink`` -> None."""

    response: HttpResponse
    sink: Callable[[bytes], None]
    on_first: Holder | None = None
    """Released (shielded) as soon as the first chunk arrived: a prefill leg, whose KV the decode replica
    has read once it answers."""
    deadline: float | None = None
    """As :attr:`Send.deadline`: the whole read ends there (idle or trickling alike)."""


@dataclass(frozen=True)
class Peek:
    """Read the response body's first chunk -> ``(chunk, rest)``: the chunk (None: the body was empty)
    and an iterator over the rest of the body (a fleet's stream is handed to its caller only once its
    first bytes came: a replica that fails before them is not the caller's problem)."""

    response: HttpResponse
    deadline: float | None = None
    """As :attr:`Send.deadline`."""


@dataclass(frozen=True)
class Close:
    """Close the response (``shield``: even while the caller is being cancelled) -> None."""

    response: HttpResponse
    shield: bool


@dataclass(frozen=True)
class Release:
    """Release the holder's lease (once; shielded from cancellation) -> None. ``after_s`` > 0: in that
    many seconds, without waiting for it (a prefill leg whose KV the prefill replica keeps until vLLM's
    lease on it expires)."""

    holder: Holder
    after_s: float = 0.0


@dataclass(frozen=True)
class Decide:
    """Ask the retry policy about an attempt -> RetryDecision."""

    policy: RetryPolicy
    state: RetryState
    status: int | None
    headers: HttpHeaders | None
    error: BaseException | None
    remaining_s: float | None

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``RetryPolicy.decide`` (what a driver passes with ``state``)."""
        return {"status": self.status, "headers": self.headers, "error": self.error, "delivered": False,
                "remaining_s": self.remaining_s, "wait_for_budget": True}


@dataclass(frozen=True)
class WaitBudget:
    """Wait, holding no lease, until the retry budget grants the retry a decision said it owes -> None
    (or raises RetryBudgetExhausted)."""

    policy: RetryPolicy
    state: RetryState
    remaining_s: float | None


@dataclass(frozen=True)
class Sleep:
    """Sleep before the next attempt (the retry policy's sleep) -> None."""

    policy: RetryPolicy
    seconds: float


Action = (Estimate | ModelLen | PoolSize | NewRetryState | Acquire | Send | ReadAll | Peek | Close | Release
          | Decide | Sleep | WaitBudget)
Steps = Generator[Action, object, HttpResponse]
"""A piece of the attempt loop: yields actions, is sent their results, returns the response."""


@dataclass(frozen=True)
class Done:
    """The request is over: ``response`` goes to the caller."""

    response: HttpResponse


class Machine:
    """One request's attempt loop. A driver calls :meth:`start`, performs each action it gets and hands
    back the result (:meth:`send`) or the exception it raised (:meth:`throw`) until it gets
    :class:`Done`; an exception the loop does not handle propagates out of ``send``/``throw``."""

    __slots__ = ("_steps",)

    def __init__(self, steps: Steps) -> None:
        self._steps = steps

    def start(self) -> Action | Done:
        return self.send(None)

    def send(self, result: object) -> Action | Done:
        try:
            return self._steps.send(result)
        except StopIteration as stop:
            return Done(stop.value)

    def throw(self, error: BaseException) -> Action | Done:
        try:
            return self._steps.throw(error)
        except StopIteration as stop:
            return Done(stop.value)
