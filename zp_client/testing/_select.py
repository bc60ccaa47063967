"""Which in-memory transport: :func:`memory_transport` picks httpx's (:mod:`._memory`) or httpx2's
(:mod:`._memory2`, which builds on the first), for the HTTP library the installed openai is built on."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import httpx

from zp_client.testing._memory import ASGIApp, MemoryNetwork, MemoryTransport, ReadPauses

__all__ = ["memory_transport", "openai_http_module"]


def openai_http_module() -> ModuleType:
    """The HTTP library the installed openai SDK is built on: ``httpx`` (2.x) or ``httpx2`` (3.x)."""
    import openai

    for name in ("httpx", "httpx2"):
        try:
            mod = __import__(name)
        except ImportError:
            continue
        if issubclass(openai.DefaultAsyncHttpxClient, mod.AsyncClient):
            return mod
    raise RuntimeError("cannot tell which HTTP library openai's DefaultAsyncHttpxClient is built on")


def memory_transport(app: ASGIApp | MemoryNetwork | Mapping[str, ASGIApp], module: ModuleType | None = None,
                     *, pauses: ReadPauses | None = None) -> Any:
    """A streaming in-memory transport to ``app`` for ``module`` (httpx or httpx2; default: openai's);
    ``app`` may be a :class:`MemoryNetwork` or a ``{host: app}`` mapping (one network: requests go to the
    app of their URL's host); ``pauses``: read like a busy client (:class:`ReadPauses`)."""
    if isinstance(app, Mapping):
        app = MemoryNetwork(app)
    mod = module if module is not None else openai_http_module()
    if mod is httpx:
        return MemoryTransport(app, pauses=pauses)
    if mod.__name__ == "httpx2":
        from zp_client.testing._memory2 import Memory2Transport  # httpx2 is optional

        return Memory2Transport(app, pauses=pauses)
    raise ValueError(f"no in-memory transport for {mod.__name__}")
