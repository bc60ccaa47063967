"""A simulated vLLM server: a step-driven engine faithful to vLLM's V1 scheduler, and its HTTP API.

The simulator is the judge of the client: it shares no code with the budget, the transport or the
client: it imports nothing of ``zp_client`` (the zp-sim distribution; sim/tests/test_sim_imports.py).
"""
