"""Unadmitted traffic: ``zp-client storm --bypass F`` (docs/benchmark.md#bypass-traffic).

A fraction ``F`` of the workload's logical requests is sent straight to the server by every ``zp-*``
setup, around its budget: the traffic a zp budget cannot see (another team's service, a batch job
pointed at the same vLLM). The bypass requests are chosen once per storm from the seed, so the same
requests bypass in every zp setup; the other setups (``no-admission``, ``naive``, ...) have no budget to
go around, and the flag changes nothing for them.

A bypass request goes through a plain ``openai.AsyncOpenAI`` on the setup's own transport (the in-memory
one on the virtual clock, loopback HTTP on the real one): no zp budget, no zp retry policy, openai's
default ``max_retries=2`` inside the app retry every zp setup already has
(:data:`~zp_storm.setups.APP_RETRY`): exactly the ``naive`` setup's client. Its record says
``bypass=True``.

``--bypass-window START:END`` limits the bypass to requests submitted in ``[START, END)`` virtual seconds
of the run (a selected request submitted outside it is admitted like any other), so a run can switch
the foreign load off, or on, midway.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from zp_client.errors import ConfigurationError
from zp_storm.loadgen import Caller, RequestRecord, VirtualClock
from zp_storm.workloads import Session, Turn

__all__ = [
    "BYPASS_APP_RETRY",
    "BypassCaller",
    "BypassPlan",
    "bypass_applies",
    "occurrence_keys",
    "open_bypass",
    "parse_window",
    "plan_bypass",
    "request_ids",
]

#: How a bypass request is retried (what the report and docs say): the ``naive`` setup's client.
BYPASS_APP_RETRY = ("openai AsyncOpenAI defaults (max_retries=2) inside the zp setups' app retry "
                    "(tenacity, 3 attempts, exponential backoff 4-10 s): the naive setup's client")


def bypass_applies(setup: str) -> bool:
    """Whether setup ``setup`` sends bypass traffic: the ``zp-*`` setups (the ones with a zp budget to go
    around). For every other setup ``--bypass`` is a no-op."""
    return setup.startswith("zp-")


def _tree_ids(sessions: list[Session]) -> Iterator[str]:
    for s in sessions:
        for k, turn in enumerate(s.turns):
            yield f"{s.id}/t{k}"
            yield from _tree_ids(turn.children)


def occurrence_keys(ids: Iterable[str]) -> Iterator[str]:
    """One key per request: its id, or ``<id>#<n>`` for the n-th (n >= 2) request of that id. Record ids
    can repeat: an agentic conversation that spawns sub-agents at two turns names both sets
    ``<conv>.sub<j>``; the later set always runs after the earlier one ended (a turn's sub-agents finish
    before the next turn), so the n-th occurrence is the same request in every setup."""
    seen: dict[str, int] = {}
    for rid in ids:
        n = seen[rid] = seen.get(rid, 0) + 1
        yield rid if n == 1 else f"{rid}#{n}"


def request_ids(sessions: list[Session]) -> Iterator[str]:
    """A key for every logical request of a workload: the id :func:`~zp_storm.loadgen.run_sessions`
    gives its record (``<session id>/t<k>``), made unique by :func:`occurrence_keys`, sub-agent sessions
    included, in a fixed order (a conversation's requests in the order it sends them)."""
    return occurrence_keys(_tree_ids(sessions))


def _rank(seed: int, rid: str) -> bytes:
    return hashlib.blake2b(f"zp-storm-bypass:{seed}:{rid}".encode(), digest_size=16).digest()


@dataclass(frozen=True)
class BypassPlan:
    """Which requests bypass zp (``ids``: keys of :func:`request_ids`), and when (``window``: ``[start,
    end)`` virtual seconds of the run, or None: the whole run)."""

    fraction: float
    seed: int
    ids: frozenset[str]
    total: int
    """Logical requests in the workload (``len(ids)`` = round(fraction x total))."""
    window: tuple[float, float] | None = None

    def active(self, rid: str, t_rel: float | None) -> bool:
        """Whether request ``rid`` (a key of :func:`request_ids`), submitted ``t_rel`` virtual seconds
        after the run's start, bypasses."""
        if rid not in self.ids:
            return False
        if self.window is None:
            return True
        return t_rel is not None and self.window[0] <= t_rel < self.window[1]

    def as_dict(self) -> dict[str, Any]:
        """The plan as the report keeps it (the ids themselves are in the per-request records)."""
        return {"fraction": self.fraction, "seed": self.seed, "selected": len(self.ids), "total": self.total,
                "window": None if self.window is None else
                [self.window[0], None if math.isinf(self.window[1]) else self.window[1]],
                "applies_to": "zp-* setups", "client": BYPASS_APP_RETRY}


def plan_bypass(sessions: list[Session], fraction: float, seed: int,
                window: tuple[float, float] | None = None) -> BypassPlan:
    """Choose round(``fraction`` x N) of the workload's N logical requests, by a hash of the seed and
    each request's id (BLAKE2b: the same in every process and setup, whatever ``PYTHONHASHSEED``):
    the requests whose hashes rank lowest. Exact in count, uniform over requests, and nested: the
    requests of a smaller fraction also bypass at a larger one (same seed)."""
    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise ConfigurationError(f"--bypass takes a fraction in [0, 1], got {fraction!r}")
    ids = list(request_ids(sessions))
    k = round(fraction * len(ids))
    chosen = sorted(ids, key=lambda rid: _rank(seed, rid))[:k]
    return BypassPlan(float(fraction), int(seed), frozenset(chosen), len(ids), window)


def parse_window(text: str | None) -> tuple[float, float] | None:
    """``--bypass-window START:END`` (virtual seconds of the run; either side may be empty: from the
    start / to the end) as ``(start, end)``, or None without the flag."""
    if text is None:
        return None
    parts = text.split(":")
    bad = ConfigurationError("--bypass-window takes START:END in virtual seconds (START < END, either "
                             f"may be empty), got {text!r}")
    if len(parts) != 2:
        raise bad
    try:
        start = float(parts[0]) if parts[0].strip() else 0.0
        end = float(parts[1]) if parts[1].strip() else math.inf
    except ValueError:
        raise bad from None
    if math.isnan(start) or math.isnan(end) or start < 0 or not start < end:
        raise bad
    return start, end


class BypassCaller:
    """A zp setup's caller with a way around it: a request the plan selects (and whose submit time is
    inside the window) goes through ``bypass`` and is marked ``rec.bypass = True``; every other one
    through the setup's own ``admitted`` caller. ``t0`` is the run's start on the run's clock (set once
    the run starts)."""

    def __init__(self, admitted: Caller, bypass: Caller, plan: BypassPlan, t0: float = 0.0) -> None:
        self.admitted = admitted
        self.bypass = bypass
        self.plan = plan
        self.t0 = t0
        self.sent = 0
        """Requests sent around the budget so far."""
        self._seen: dict[str, int] = {}

    async def __call__(self, turn: Turn, rec: RequestRecord, clock: VirtualClock) -> None:
        t_rel = None if rec.t_submit is None else rec.t_submit - self.t0
        n = self._seen[rec.id] = self._seen.get(rec.id, 0) + 1  # the key of occurrence_keys
        if self.plan.active(rec.id if n == 1 else f"{rec.id}#{n}", t_rel):
            rec.bypass = True
            self.sent += 1
            await self.bypass(turn, rec, clock)
        else:
            await self.admitted(turn, rec, clock)


@contextlib.asynccontextmanager
async def open_bypass(ctx: Any, caller: Caller, plan: BypassPlan | None) -> AsyncIterator[Caller]:
    """``caller`` as it runs with ``plan``: itself when there is no plan (or it selects nothing), else a
    :class:`BypassCaller` whose bypass client (the naive setup's: openai defaults and the app retry, on
    ``ctx``'s transport) is closed on exit. Set the returned caller's ``t0`` when the run starts."""
    if plan is None or not plan.ids:
        yield caller
        return
    from zp_storm.setups import AppCaller, openai_client

    async with contextlib.AsyncExitStack() as stack:
        plain = AppCaller(openai_client(ctx, stack), ctx.model, app_retry=True)
        yield BypassCaller(caller, plain, plan)
