"""The ``httpx2`` library (openai 3.x) for the transports: its body classes and :data:`HTTPX2`.

Imported only where httpx2 is installed; see :mod:`zp_client._admission.httplib` and docs/admission.md.
"""

from __future__ import annotations

import httpx2

from zp_client._admission.httplib import AsyncBody, HttpLib, SyncBody

__all__ = ["HTTPX2"]


class _Httpx2AsyncBody(AsyncBody, httpx2.AsyncByteStream):
    """httpx2's async body class over :class:`~zp_client._admission.httplib.AsyncBody`."""


class _Httpx2SyncBody(SyncBody, httpx2.SyncByteStream):
    """httpx2's blocking body class over :class:`~zp_client._admission.httplib.SyncBody`."""


HTTPX2 = HttpLib(httpx2, _Httpx2AsyncBody, _Httpx2SyncBody)
