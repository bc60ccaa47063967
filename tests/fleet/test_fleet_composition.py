"""A Fleet is a Budget that composes its line (a LocalBudget's shell over the fleet ledger) rather than
being a LocalBudget, and still offers everything a LocalBudget offers, with the same signatures."""

from __future__ import annotations

import inspect

import pytest

from zp_client import Budget, Fleet, LocalBudget
from zp_client.errors import ConfigurationError
from zp_client.fleet import FleetLease

REPLICAS = ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]


def _public(cls: type) -> dict[str, str]:
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property):
            out[name] = "property"
        elif callable(getattr(cls, name)):
            out[name] = str(inspect.signature(getattr(cls, name)))
    return out


def test_a_fleet_is_a_budget_and_not_a_local_budget() -> None:
    fleet = Fleet(REPLICAS, limit_blocks=10)
    assert isinstance(fleet, Budget) and not isinstance(fleet, LocalBudget)


def test_a_fleet_offers_every_public_method_of_a_local_budget_with_its_signature() -> None:
    local, fleet = _public(LocalBudget), _public(Fleet)
    missing = sorted(set(local) - set(fleet))
    differ = sorted(n for n in local if n in fleet and local[n] != fleet[n])
    assert not missing and not differ, (missing, differ)


@pytest.mark.anyio
async def test_a_fleets_leases_come_from_its_line_and_go_back_to_it() -> None:
    fleet = Fleet(REPLICAS, limit_blocks=10)
    lease = await fleet.acquire(4)
    assert isinstance(lease, FleetLease) and lease.replica in REPLICAS
    assert (await fleet.status()).used == 4
    await lease.release()
    assert (await fleet.status()).used == 0 and fleet.status_sync().extra["name"] == "fleet"


def test_the_local_budget_constructors_a_fleet_inherited_say_what_to_use() -> None:
    with pytest.raises(ConfigurationError, match="from_servers"):
        Fleet.from_server("http://10.0.0.1:8000")
    with pytest.raises(ConfigurationError, match="Fleet"):
        Fleet.from_settings(10)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
