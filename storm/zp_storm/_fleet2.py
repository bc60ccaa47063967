"""The httpx2 (openai 3.x) forms of :mod:`zp_storm.fleet_setups`' replica routers and of
:mod:`zp_storm.pd_setups`' P/D proxy.

Imported only where httpx2 is installed; see :mod:`zp_storm.fleet_setups`.
"""

from __future__ import annotations

import httpx2

from zp_storm.fleet_setups import EndpointPicker, RoundRobin, _WatchedStream
from zp_storm.pd_setups import PDProxy

__all__ = ["Httpx2EndpointPicker", "Httpx2PDProxy", "Httpx2RoundRobin"]


class _Httpx2Stream(_WatchedStream, httpx2.AsyncByteStream):
    """httpx2's body class over :class:`~zp_storm.fleet_setups._WatchedStream`."""


class Httpx2RoundRobin(RoundRobin, httpx2.AsyncBaseTransport):
    """:class:`~zp_storm.fleet_setups.RoundRobin` as an ``httpx2`` transport (openai 3.x)."""

    _lib = httpx2
    _stream_cls = _Httpx2Stream


class Httpx2EndpointPicker(EndpointPicker, httpx2.AsyncBaseTransport):
    """:class:`~zp_storm.fleet_setups.EndpointPicker` as an ``httpx2`` transport (openai 3.x)."""

    _lib = httpx2
    _stream_cls = _Httpx2Stream


class Httpx2PDProxy(PDProxy, httpx2.AsyncBaseTransport):
    """:class:`~zp_storm.pd_setups.PDProxy` as an ``httpx2`` transport (openai 3.x)."""

    _lib = httpx2
