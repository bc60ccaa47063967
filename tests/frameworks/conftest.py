"""The agent-framework tests drive async openai clients from event loops of their own (``asyncio.run``,
``run_sync``) and leave them to the frameworks, which do not close them. Collected later, during another
test's event loop, such a client's ``__del__`` (openai's ``AsyncHttpxClientWrapper``) schedules its
``aclose()`` on that loop, which then touches a connection of the closed loop: "Event loop is closed",
reported by anyio in whichever test runs then (seen once in CI, in test_integration_support.py).
Collected here, after each test and outside any running loop, their ``__del__`` does nothing."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_the_tests_own_clients() -> Iterator[None]:
    yield
    gc.collect()
