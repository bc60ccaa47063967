"""The clock the admission core reads: monotonic time and sleeping, injectable for tests.

The core (:mod:`zp_client._core`) never calls :func:`time.monotonic` itself; it asks the
:class:`Clock` it was given, by default :data:`SYSTEM_CLOCK`. See docs/admission.md.
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio

__all__ = ["Clock", "SystemClock", "SYSTEM_CLOCK"]


class Clock(Protocol):
    """Monotonic seconds and sleeps. ``monotonic`` is called per stream chunk: keep it cheap."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def sleep_sync(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: :func:`time.monotonic`, :func:`anyio.sleep` and :func:`time.sleep`."""

    # A staticmethod, so ``clock.monotonic`` is the builtin itself: no extra call per chunk.
    monotonic = staticmethod(time.monotonic)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))

    def sleep_sync(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


SYSTEM_CLOCK: Clock = SystemClock()
