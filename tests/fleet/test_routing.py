"""What the admission core asks of any fleet (zp_client/fleet/_routing.py): replica URLs checked and
normalized, where an attempt and a passthrough request go, where metadata is read, the routing meta."""

from __future__ import annotations

from typing import cast

import httpx
import pytest

from zp_client.errors import ConfigurationError
from zp_client.fleet import Fleet
from zp_client.fleet._routing import VIRTUAL_DOMAIN, normalize, origin, replica_limits
from zp_client.fleet.ledger import AVOID_META, PREFIX_META, SESSION_META

R1, R2 = "http://10.0.0.1:8000/v1", "https://10.0.0.2/v1"


def _fleet() -> Fleet:
    return Fleet([R1, R2], limit_blocks=100, policy="strict", name="pool")


def test_a_replica_url_is_normalized_and_a_bad_one_refused() -> None:
    assert normalize("http://h:8000/v1/") == "http://h:8000/v1"
    assert normalize("http://h:8000/v1?x=1#f") == "http://h:8000/v1"
    for bad in ("h:8000/v1", "ftp://h/v1", "http:///v1", cast(str, 8000)):
        with pytest.raises(ConfigurationError):
            normalize(bad)


def test_replica_limits_take_a_list_with_one_limit_or_a_mapping() -> None:
    assert replica_limits([R1, R2], 10, missing_limit="?") == {R1: 10, R2: 10}
    assert replica_limits({R1: 3, R2 + "/": 4}, None, missing_limit="?") == {R1: 3, R2: 4}
    with pytest.raises(ConfigurationError, match="needs limit"):
        replica_limits([R1], None, missing_limit="needs limit")
    with pytest.raises(ConfigurationError, match="not one string"):
        replica_limits(cast(list[str], R1), 10, missing_limit="?")
    with pytest.raises(ConfigurationError, match="at least one"):
        replica_limits([], 10, missing_limit="?")


def test_the_base_url_is_the_fleets_own_name_under_the_invalid_domain() -> None:
    assert _fleet().base_url == f"http://pool.{VIRTUAL_DOMAIN}/v1"
    assert origin(R2) == ("https", "10.0.0.2", None)


def test_an_attempt_goes_to_its_leases_replica() -> None:
    fleet = _fleet()
    lease = fleet.acquire_sync(4)
    url = fleet.route_url(lease, httpx.URL(f"http://pool.{VIRTUAL_DOMAIN}/v1/chat/completions?x=1"))
    assert lease.replica is not None and str(url).startswith(lease.replica.rsplit("/v1", 1)[0])
    assert url.path == "/v1/chat/completions" and url.query == b"x=1"
    lease.release_sync()


def test_a_passthrough_request_to_the_fleets_name_goes_to_a_replica_and_others_are_left_alone() -> None:
    fleet = _fleet()
    moved = fleet.passthrough_url(httpx.URL(f"http://pool.{VIRTUAL_DOMAIN}/v1/models"))
    assert moved.host in ("10.0.0.1", "10.0.0.2") and moved.path == "/v1/models"
    other = httpx.URL("http://elsewhere.test/v1/models")
    assert fleet.passthrough_url(other) is other


def test_metadata_for_the_fleets_name_is_read_from_a_replica() -> None:
    fleet = _fleet()
    base, root = fleet.metadata_base(f"http://pool.{VIRTUAL_DOMAIN}/v1", f"http://pool.{VIRTUAL_DOMAIN}")
    assert root in ("http://10.0.0.1:8000", "https://10.0.0.2") and base == root + "/v1"
    assert fleet.metadata_base("http://h/v1", "http://h") == ("http://h/v1", "http://h")


def test_routing_meta_carries_prefix_keys_and_the_session_and_avoiding_adds_the_failed_replica() -> None:
    fleet = _fleet()
    body = {"model": "m", "messages": [{"role": "system", "content": "x " * 200},
                                       {"role": "user", "content": "hi"}]}
    meta = fleet.routing_meta(body, 400, "s-1")
    assert meta[SESSION_META] == "s-1" and meta[PREFIX_META]
    assert fleet.routing_only(meta) == {PREFIX_META: meta[PREFIX_META]}  # the session is the decode pool's
    assert fleet.routing_only({}) is None
    lease = fleet.acquire_sync(4)
    avoided = fleet.avoiding(meta, lease)
    assert avoided[AVOID_META] == (lease.replica,) and AVOID_META not in meta  # a copy
    again = fleet.avoiding(avoided, lease)
    assert again[AVOID_META] == (lease.replica, lease.replica)
    lease.release_sync()


def test_a_prefix_is_known_cached_only_where_a_request_with_it_was_placed() -> None:
    fleet = _fleet()
    body = {"model": "m", "messages": [{"role": "system", "content": "x " * 400},
                                       {"role": "user", "content": "hi"}]}
    meta = fleet.routing_meta(body, 800, None)
    assert fleet.best_matched_tokens(None) == 0 and fleet.best_matched_tokens(meta) == 0
    lease = fleet.acquire_sync(60, meta=meta)
    assert fleet.best_matched_tokens(meta) > 0  # its replica now holds that prefix
    assert fleet.best_matched_tokens(fleet.avoiding(meta, lease)) == 0  # ...unless it is avoided
    lease.release_sync()
