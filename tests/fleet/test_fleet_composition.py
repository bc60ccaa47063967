"""A Fleet is a Budget that composes its line (a LocalBudget's shell over the fleet ledger) rather than
being a LocalBudget, and still offers everything a LocalBudget offers, with the same signatures; a
RedisFleet likewise composes a RedisBudget in fleet mode rather than being one."""

from __future__ import annotations

import inspect

import pytest

from zp_client import Budget, Fleet, LocalBudget
from zp_client.budget.redis import RedisBudget
from zp_client.errors import ConfigurationError
from zp_client.fleet import FleetLease
from zp_client.fleet.redis import RedisFleet

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


REDIS = "redis://127.0.0.1:6379/0"


def test_a_redis_fleet_is_a_budget_composing_a_redis_budget_and_not_one() -> None:
    fleet = RedisFleet(REDIS, "zp-test-composition", REPLICAS, limit_blocks=10)  # no I/O until used
    line = fleet._line
    assert isinstance(fleet, Budget) and not isinstance(fleet, RedisBudget)
    assert isinstance(line, RedisBudget) and line._core is fleet._core and line.name == fleet.name
    assert fleet.limit == 10 and fleet.block_size == 16 and fleet.config is line.config
    assert hasattr(fleet, "_adaptive")  # what AdaptiveLimit takes a shared (leader-elected) budget by
    fleet.close_sync()


def test_a_redis_fleet_offers_every_public_method_of_a_redis_budget_with_its_signature() -> None:
    redis, fleet = _public(RedisBudget), _public(RedisFleet)
    missing = sorted(set(redis) - set(fleet))
    # the two constructors a RedisFleet always answered with its own message (the snapshot freezes them)
    differ = sorted(n for n in redis if n in fleet and redis[n] != fleet[n])
    assert not missing and differ == ["from_server", "from_settings"], (missing, differ)


@pytest.mark.anyio
async def test_the_redis_budget_constructors_a_redis_fleet_inherited_say_what_to_use() -> None:
    with pytest.raises(ConfigurationError, match="RedisFleet"):
        await RedisFleet.create(REDIS, "zp-test-composition", 10)
    with pytest.raises(ConfigurationError, match="RedisFleet"):
        RedisFleet.create_sync(REDIS, "zp-test-composition", 10)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
