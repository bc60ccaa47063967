"""Test helpers for code built on zp-client: virtual time and an in-memory streaming transport.

What the storm benchmark (``zp-storm``) runs on, public so that an application's own tests can run its
zp-wrapped clients the same way, deterministically and without a socket:

- :class:`VirtualTimeLoop` / :func:`run_virtual`: an asyncio loop whose clock jumps to the next timer
  whenever nothing is ready (a 30 s backoff takes no real time; a run depends only on its inputs);
  :class:`VirtualTimeDeadlock` when nothing can ever run again.
- :class:`MemoryTransport` (httpx) and :func:`memory_transport` (httpx or httpx2, whichever the
  installed openai is built on: :func:`openai_http_module`): an ASGI app served in memory, each body
  chunk handed over as the app sends it; :class:`MemoryNetwork` serves several apps by host;
  :class:`ReadPauses` reads like a busy client.
- :class:`VirtualTimeAsyncOpenAI` / :class:`VirtualTimeRetryPolicy`: openai's and zp's retry waits
  measured in virtual seconds at a given ``speedup`` (imports openai on first use).

This module imports nothing of the simulator (``zp-sim``): any ASGI app can be served. Example::

    from zp_client import LocalBudget, wrap
    from zp_client.testing import memory_transport, run_virtual

    async def main() -> None:
        http = openai.DefaultAsyncHttpxClient(transport=memory_transport(app))
        client = wrap(openai.AsyncOpenAI(base_url="http://app/v1", api_key="x", http_client=http),
                      budget=LocalBudget(limit_blocks=400))
        ...

    run_virtual(main())
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zp_client.testing._loop import VirtualTimeDeadlock, VirtualTimeLoop, run_virtual
from zp_client.testing._memory import MemoryNetwork, MemoryTransport, ReadPauses
from zp_client.testing._select import memory_transport, openai_http_module

__all__ = [
    "MemoryNetwork",
    "MemoryTransport",
    "ReadPauses",
    "VirtualTimeAsyncOpenAI",
    "VirtualTimeDeadlock",
    "VirtualTimeLoop",
    "VirtualTimeRetryPolicy",
    "memory_transport",
    "openai_http_module",
    "run_virtual",
]

#: Loaded on first use: they subclass openai's client, which is an extra (``zp-client[openai]``).
_LAZY = {"VirtualTimeAsyncOpenAI": "zp_client.testing._virtual_time",
         "VirtualTimeRetryPolicy": "zp_client.testing._virtual_time"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zp_client.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from zp_client.testing._virtual_time import VirtualTimeAsyncOpenAI, VirtualTimeRetryPolicy
