"""Per-call admission records: what each lease grant cost the call that waited for it.

Every front end (``wrap()``, ``AsyncClient`` / ``Client``, the transports, langchain-zp, autogen-zp) runs
the same admission core, and the core hands one :class:`AdmissionInfo` to every observer active in the
caller's context when it grants a lease: the seconds the call waited in line, the blocks leased, the
priority class, the attempt... A retried call takes a new lease per attempt, so it gives one record per
attempt::

    with zp_client.observe_admissions() as seen:
        reply = await client.chat.completions.create(...)
    print(seen[-1].queue_wait_s, seen[-1].leased_blocks)

The scope is a :mod:`contextvars` one, so it follows the call into its transport (openai awaits its
transport in the caller's task, and a sync client sends from the caller's thread), into tasks and threads
started with a copy of the context (``asyncio.create_task``, ``asyncio.to_thread``, LangChain's batch
executor), and not into concurrent calls of other tasks. Scopes nest: each active one receives every
record. Nothing is recorded and no extra time is read while no scope is active. Times are read from the
budget's clock (virtual under the storm benchmark). See docs/admission.md#per-call-admission-records.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

__all__ = ["AdmissionInfo", "observe_admissions", "summarize_admissions"]

logger = logging.getLogger("zp_client.transport")


@dataclass(frozen=True)
class AdmissionInfo:
    """One lease grant, as the call that waited for it saw it."""

    queue_wait_s: float
    """Seconds from asking the budget for the lease to holding it (the budget's clock): the time spent
    waiting in line for KV blocks. About 0 when the budget had room."""
    leased_blocks: int
    """The lease's bound: the most KV blocks the request may occupy (prompt plus ``max_tokens``)."""
    held_blocks: int
    """The blocks the request occupies at admission (its prompt's)."""
    priority: int
    """The priority class it waited in (lower = earlier)."""
    attempt: int
    """1 for the first attempt, 2 for the first retry, ...: the attempt this lease was taken for."""
    budget: str | None
    """The budget's name (``LocalBudget(name=)``, ``RedisBudget``'s name); None for a budget without one."""
    policy: str
    """The budget's reservation policy (``"strict"``, ``"elastic"``)."""
    route: str
    """The forecaster's key of the request (``X-ZP-Route``, else the model name)."""
    lease_id: str
    """The lease's id in the budget."""
    replica: str | None = None
    """The replica the attempt went to (a :class:`~zp_client.fleet.Fleet`'s lease), else None."""
    predicted_wait_s: float | None = None
    """The wait the budget predicted for this attempt when it queued, to set beside ``queue_wait_s``
    (None: granted at once, or the budget did not predict: see
    docs/admission.md#predicted-wait-and-fail-fast)."""

    def as_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict (for event payloads and run metadata)."""
        return asdict(self)


def summarize_admissions(records: Sequence[AdmissionInfo]) -> dict[str, object]:
    """One call's admission as a JSON-ready dict: ``queue_wait_s`` (summed over its attempts),
    ``leased_blocks`` / ``held_blocks`` / ``priority`` (its last lease's), ``leases`` (how many it took:
    one per attempt), ``budget``, ``policy`` and ``admissions`` (every record's
    :meth:`~AdmissionInfo.as_dict`). This is what langchain-zp puts in a generation's metadata.
    ``records`` must not be empty (:class:`ValueError`)."""
    if not records:
        raise ValueError("summarize_admissions() needs at least one record")
    last = records[-1]
    return {
        "queue_wait_s": sum(r.queue_wait_s for r in records),
        "leased_blocks": last.leased_blocks,
        "held_blocks": last.held_blocks,
        "priority": last.priority,
        "leases": len(records),
        "budget": last.budget,
        "policy": last.policy,
        "admissions": [r.as_dict() for r in records],
    }


class _Observer:
    __slots__ = ("records", "callback")

    def __init__(self, callback: Callable[[AdmissionInfo], None] | None) -> None:
        self.records: list[AdmissionInfo] = []
        self.callback = callback


# The observers active in this context, innermost last. An empty tuple costs the core one get() per lease.
_observers: contextvars.ContextVar[tuple[_Observer, ...]] = contextvars.ContextVar("zp_admission_observers",
                                                                                   default=())


@contextlib.contextmanager
def observe_admissions(
    callback: Callable[[AdmissionInfo], None] | None = None,
) -> Iterator[list[AdmissionInfo]]:
    """Record every lease granted to a call made in this context until the block ends.

    Yields the list the records are appended to, in grant order (one per lease: a retried call gives
    one per attempt). ``callback``, if given, is also called with each record as soon as the lease is
    granted, before the request is sent, in the thread or task that waited for it: keep it short and
    non-blocking (an exception it raises is logged, never raised into the call). Works the same in sync
    and async code; see the module docstring for where the scope reaches.
    """
    obs = _Observer(callback)
    token = _observers.set((*_observers.get(), obs))
    try:
        yield obs.records
    finally:
        _observers.reset(token)


def active() -> tuple[_Observer, ...]:
    """The observers of the current context (empty: nobody observes). For the admission core."""
    return _observers.get()


def notify(observers: tuple[_Observer, ...], info: AdmissionInfo) -> None:
    """Hand ``info`` to ``observers`` (the admission core calls this once per lease grant)."""
    for obs in observers:
        obs.records.append(info)
        if obs.callback is not None:
            try:
                obs.callback(info)
            except Exception:  # an observer must never break the call it observes
                logger.exception("an observe_admissions() callback raised; the call goes on")
