"""The plain value types of a budget (:class:`Ticket`, :class:`BudgetStatus`, :class:`ClassStatus`).

Private home: they are public as ``zp_client.budget.base.*`` and ``zp_client.*``. This module imports
nothing from the package, so the sans-I/O ledger can depend on it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BudgetStatus", "ClassStatus", "Ticket"]


@dataclass(frozen=True, order=True)
class Ticket:
    """A place in a budget's line: priority class (lower = more urgent), then arrival order.

    A retried request passes its first attempt's ticket back to
    :meth:`~zp_client.budget.base.Budget.acquire` so it keeps
    its place: it goes after every earlier arrival of its class and before every later one.
    ``order`` is only comparable within one budget.
    """

    priority: int
    order: int


@dataclass(frozen=True)
class ClassStatus:
    """Waiters of one priority class."""

    waiters: int
    weight: int


@dataclass(frozen=True)
class BudgetStatus:
    """A read-only snapshot of a budget."""

    limit: int
    """Usable blocks the budget may hand out."""
    used: int
    """Blocks the reservation policy counts as taken (under ``strict``: the sum of live bounds; under
    ``elastic``: the projected peak of the live leases, which may exceed ``limit`` between admissions
    when leases outgrow their forecasts)."""
    free: int
    """``max(0, limit - used)``."""
    held: int
    """Blocks the live leases report they occupy now (prompt plus tokens generated so far)."""
    leases: int
    """Live leases."""
    waiters: dict[int, ClassStatus] = field(default_factory=dict)
    """Waiters and their weight per priority class."""
    head_wait_s: float = 0.0
    """How long the head of the line has waited, in seconds."""
    policy: str = "strict"
    block_size: int = 16
    extra: dict[str, object] = field(default_factory=dict)
    """Backend-specific facts (Redis epoch, recovery state, ...)."""
    held_distinct: int | None = None
    """``held`` with each shared prefix counted once among the leases that share it, as the server's
    prefix cache holds it once (the ``elastic`` policy's present term; ``held`` under ``strict``, which
    knows no prefixes). None where the backend does not compute it (``RedisBudget``): read ``held``.
    A pinned prefix no live request uses is not in it (the server holds its blocks as free, cached ones:
    see docs/pinning.md); while one does, it is counted once, with that request."""
    predicted_wait_s: dict[int, float] = field(default_factory=dict)
    """Per priority class with waiters, its head's predicted wait in seconds from now (a replay of the
    ledger on the live leases' projections: docs/admission.md#predicted-wait-and-fail-fast). Empty with
    nobody waiting and where the backend does not predict (fleets; a ``RedisBudget`` beyond its snapshot's
    bound, under ``strict``, with pinned prefixes or recovering); a class whose head the bounded replay
    does not reach is absent."""

    @property
    def head_predicted_wait_s(self) -> float | None:
        """The predicted wait of the most urgent class's head (None: not predicted)."""
        return self.predicted_wait_s[min(self.predicted_wait_s)] if self.predicted_wait_s else None
