"""The admission transports for ``httpx2`` (openai 3.x), exported by :mod:`zp_client.transport` as
``AsyncAdmissionTransport2`` / ``AdmissionTransport2``. See docs/admission.md.
"""

from __future__ import annotations

from typing import cast

import httpx2

from zp_client._admission.drivers import AsyncDriver, SyncDriver
from zp_client._admission.ports import HttpRequest
from zp_client._httpx2 import HTTPX2
from zp_client.transport import TransportClasses

__all__ = ["AsyncAdmissionTransport2", "AdmissionTransport2", "CLASSES"]


class AsyncAdmissionTransport2(AsyncDriver, httpx2.AsyncBaseTransport):
    """Async admission transport for ``httpx2`` (see :class:`zp_client.AsyncAdmissionTransport`)."""

    lib = HTTPX2

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        return cast(httpx2.Response, await self.handle_async(cast(HttpRequest, request)))


class AdmissionTransport2(SyncDriver, httpx2.BaseTransport):
    """Blocking admission transport for ``httpx2`` (see :class:`zp_client.AdmissionTransport`)."""

    lib = HTTPX2

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        return cast(httpx2.Response, self.handle_sync(cast(HttpRequest, request)))


CLASSES = TransportClasses(httpx2, AsyncAdmissionTransport2, AdmissionTransport2)
