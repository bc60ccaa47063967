"""The admission transports for ``httpx2`` (openai 3.x), exported by :mod:`zp_client.transport` as
``AsyncAdmissionTransport2`` / ``AdmissionTransport2``. See docs/admission.md.
"""

from __future__ import annotations

import httpx2

from zp_client._admission.drivers import AsyncDriver, SyncDriver
from zp_client._httpx2 import HTTPX2

__all__ = ["AsyncAdmissionTransport2", "AdmissionTransport2"]


class AsyncAdmissionTransport2(AsyncDriver[httpx2.Response], httpx2.AsyncBaseTransport):
    """Async admission transport for ``httpx2`` (see :class:`zp_client.AsyncAdmissionTransport`)."""

    lib = HTTPX2


class AdmissionTransport2(SyncDriver[httpx2.Response], httpx2.BaseTransport):
    """Blocking admission transport for ``httpx2`` (see :class:`zp_client.AdmissionTransport`)."""

    lib = HTTPX2

