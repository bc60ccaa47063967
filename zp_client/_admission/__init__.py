"""The admission core, private (like httpx's ``_transports``): what the transports in
:mod:`zp_client.transport` run. One module per job:

- :mod:`.ports`: the ``Protocol`` of every collaborator the core talks to;
- :mod:`.actions`: what the attempt loop asks a driver to do, and the :class:`~.actions.Machine`;
- :mod:`.plan`: the per-call headers and the plan's data; :mod:`.planner`: reading and planning a request;
- :mod:`.servers`: server metadata and the KV pool check;
- :mod:`.attempts`: lease, send, one retry-or-raise;
- :mod:`.delivery`: the response handed over, streaming, learning from usage;
- :mod:`.release`: who releases a lease, and when (holders, the watchdog, deferred releases, alarms);
- :mod:`.httplib`: what differs between httpx and httpx2 (their requests, responses and body classes);
- :mod:`.drivers`: the async and blocking drivers that perform the actions;
- :mod:`.parts`: one configuration's resolved collaborators; :mod:`.core`: the :class:`~.core.Core`.

A disaggregated fleet's two-phase lease is not here: it lives beside the fleet (:mod:`zp_client.fleet.pd`)
and the attempt loop reaches it through :class:`~.ports.TwoPhaseCall`. See docs/admission.md.
"""
