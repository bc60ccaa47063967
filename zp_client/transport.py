"""Admission as an HTTP transport: the one hook every OpenAI front end shares.

:class:`AsyncAdmissionTransport` and :class:`AdmissionTransport` wrap any inner ``httpx`` transport;
``AsyncAdmissionTransport2`` / ``AdmissionTransport2`` do the same for ``httpx2`` (openai 3.x). All four
drive one sans-I/O core (:mod:`zp_client._admission`), so they behave identically; only LLM calls (``POST``
to ``/chat/completions``, ``/completions``, ``/responses``) are admitted. What callers may rely on:
docs/admission.md (leases, release, streams, per-call headers), docs/elastic.md, docs/retries.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx

from zp_client._admission.core import default_retry, forecaster_for
from zp_client._admission.drivers import AsyncDriver, SyncDriver
from zp_client._admission.httplib import HTTPX, module_of
from zp_client._admission.plan import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    ROUTE_HEADER,
    TPOT_TARGET_HEADER,
    TTFT_TARGET_HEADER,
    is_admitted,
)
from zp_client._admission.ports import HttpResponse, TransportOptions
from zp_client.budget.base import Budget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError

if TYPE_CHECKING:
    from typing_extensions import Unpack

# AsyncAdmissionTransport2 / AdmissionTransport2 (httpx2) are importable by name but left out of
# __all__: they import httpx2, which only openai 3.x environments have.
__all__ = [
    "AsyncAdmissionTransport",
    "AdmissionTransport",
    "TransportClasses",
    "transport_classes",
    "admission_transport_for",
    "is_admitted",
    "default_retry",
    "PRIORITY_HEADER",
    "DEADLINE_HEADER",
    "ROUTE_HEADER",
    "TTFT_TARGET_HEADER",
    "TPOT_TARGET_HEADER",
    "forecaster_for",
]


class AsyncAdmissionTransport(AsyncDriver[httpx.Response], httpx.AsyncBaseTransport):
    """Async admission transport for ``httpx`` (openai 2.x, LangChain, AutoGen).

    ``AsyncAdmissionTransport(inner, budget=..., settings=, estimator=, retry=, forecaster=,
    stream_upstream=, close_inner=True, clock=, metrics=)``; ``retry``: a :class:`~zp_client.RetryPolicy`,
    None for :func:`default_retry`, False for one attempt; ``metrics``: a :class:`~zp_client.ZPMetrics`
    (docs/admission.md#metrics). See docs/admission.md.
    """

    lib = HTTPX


class AdmissionTransport(SyncDriver[httpx.Response], httpx.BaseTransport):
    """Blocking admission transport for ``httpx`` (same options as :class:`AsyncAdmissionTransport`)."""

    lib = HTTPX


@dataclass(frozen=True)
class TransportClasses:
    """The admission transports for one HTTP module (``httpx`` or ``httpx2``)."""

    module: ModuleType
    AsyncAdmissionTransport: type[AsyncDriver[HttpResponse]]
    AdmissionTransport: type[SyncDriver[HttpResponse]]


_HTTPX_CLASSES = TransportClasses(httpx, AsyncAdmissionTransport, AdmissionTransport)


def transport_classes(module: ModuleType) -> TransportClasses:
    """The (async, sync) admission transport classes for ``httpx`` or ``httpx2``."""
    if module.__name__ == "httpx":
        return _HTTPX_CLASSES
    if module.__name__ == "httpx2":
        from zp_client import _transport2  # imports nothing of this module: no circle

        return TransportClasses(module, _transport2.AsyncAdmissionTransport2, _transport2.AdmissionTransport2)
    raise ConfigurationError(f"no admission transports for module {module.__name__!r} (httpx or httpx2)")


def admission_transport_for(
    inner: object, *, budget: Budget, settings: Settings | None = None, close_inner: bool = True,
    **options: Unpack[TransportOptions],
) -> AsyncDriver[HttpResponse] | SyncDriver[HttpResponse]:
    """An admission transport of the right module and flavour (async or sync) for ``inner``."""
    classes = transport_classes(module_of(inner))
    mod = classes.module
    if isinstance(inner, mod.AsyncBaseTransport):
        return classes.AsyncAdmissionTransport(inner, budget=budget, settings=settings,
                                               close_inner=close_inner, **options)
    if isinstance(inner, mod.BaseTransport):
        return classes.AdmissionTransport(inner, budget=budget, settings=settings, close_inner=close_inner,
                                          **options)
    raise ConfigurationError(f"{type(inner).__name__} is not an httpx/httpx2 transport")


def __getattr__(name: str) -> Any:
    # httpx2 is optional (openai 3.x brings it): its classes load on first use.
    if name in ("AsyncAdmissionTransport2", "AdmissionTransport2"):
        from zp_client import _transport2

        return getattr(_transport2, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
