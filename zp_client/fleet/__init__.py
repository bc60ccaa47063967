"""Fleets: a budget per replica, one fair line, client-side routing with prefix affinity, ejection.

:class:`Fleet` goes wherever a budget goes; see docs/fleet.md.
"""

from zp_client.fleet.ledger import FleetLedger, HealthRules, ReplicaState
from zp_client.fleet.local import Fleet, FleetLease, Resolver, system_resolver
from zp_client.fleet.prefix import PrefixIndex, prefix_keys

__all__ = ["Fleet", "FleetLease", "FleetLedger", "HealthRules", "PrefixIndex", "ReplicaState", "Resolver",
           "prefix_keys", "system_resolver"]
