"""The httpx2 (openai 3.x) form of :class:`~zp_client.testing.MemoryTransport`.

Imported only where httpx2 is installed; see :mod:`zp_client.testing`.
"""

from __future__ import annotations

import httpx2

from zp_client.testing._memory import _Body, _TransportBase

__all__ = ["Memory2Transport"]


class _Httpx2Body(_Body, httpx2.AsyncByteStream):
    """httpx2's body class over :class:`~zp_client.testing._Body`."""


class Memory2Transport(_TransportBase, httpx2.AsyncBaseTransport):
    """An ``httpx2.AsyncBaseTransport`` that calls an ASGI ``app`` in this event loop, streaming."""

    _lib = httpx2
    _body_cls = _Httpx2Body
