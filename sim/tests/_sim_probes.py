"""Helpers for the simulator's tests (they need nothing of zp-client's test suite)."""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_until(predicate: Any, what: str, limit_s: float = 30.0) -> None:
    """Poll until ``predicate()`` holds (a liveness limit, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"gave up waiting for: {what}")
        await asyncio.sleep(0.01)
