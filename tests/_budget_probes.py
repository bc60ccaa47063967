"""Probes shared by the integration tests: what a budget and the simulated server saw."""

from __future__ import annotations

import asyncio
from typing import Any

from zp_client import LocalBudget


def granted(budget: LocalBudget) -> int:
    return int(budget.status_sync().extra["granted"])


def waiters(budget: LocalBudget) -> dict[int, int]:
    return {cls: st.waiters for cls, st in budget.status_sync().waiters.items() if st.waiters}


def overlapped(recs: list[dict[str, Any]]) -> bool:
    """Did the server run these requests at the same time (virtual clock)?"""
    assert len(recs) == 2 and all(r["status"] == "finished" for r in recs)
    a, b = sorted(recs, key=lambda r: r["arrival_s"])
    return b["arrival_s"] < a["finish_s"]


async def wait_until(predicate: Any, what: str, limit_s: float = 30.0) -> None:
    """Poll until ``predicate()`` holds (a liveness limit, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"gave up waiting for: {what}")
        await asyncio.sleep(0.01)
