"""The storm benchmark: the same burst against the same simulated server, with and without zp-client."""

# The setups register themselves in setups.SETUPS when their module is imported; each builds on the ones
# before it (the elastic setups on setups.py's, issue 30's on the elastic ones, P/D on the fleet's), so
# they are imported here, in that order, whichever zp_storm module is imported first (no import circle).
import importlib as _importlib

for _name in ("setups", "elastic_setups", "slo_setups", "fleet_setups", "pd_setups"):
    _importlib.import_module(f"zp_storm.{_name}")
