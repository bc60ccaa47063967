"""A simulated vLLM server: a step-driven engine faithful to vLLM's V1 scheduler, and its HTTP API.

The simulator is the judge of the client: it shares no code with the budget, the transport or the
client (it imports nothing from ``zp_client`` outside ``zp_sim``).
"""
