"""The simulated server's prefill/decode roles, modelled on vLLM's NixlConnector as its example proxy
drives it (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``; issue 20).

- A **prefill** server takes a request whose ``kv_transfer_params`` has ``do_remote_decode: true`` (the
  proxy sends ``max_tokens=1``), runs its prefill, and keeps its blocks when it finishes (the engine's
  ``hold_kv``). Its answer carries ``kv_transfer_params`` for the decode server: ``do_remote_prefill``,
  the remote engine id, block ids, host, port, request id, tp size and token count. The blocks stay
  allocated until the decode server has read them, the request is aborted, or its lease expires
  (``kv_lease_s``, vLLM's ``kv_lease_duration``, 30 s by default); heartbeats from the decode server push
  the expiry on; an expiry is counted in ``vllm:nixl_num_kv_expired_reqs``.
- A **decode** server takes a request whose ``kv_transfer_params`` has ``do_remote_prefill: true``: the
  engine admits it FCFS when its whole prompt fits and pulls the blocks its cache lacks (``remote_kv``);
  from the moment it enters the scheduler until its KV arrived it heartbeats the prefill server every
  ``kv_lease_s / 3``; once read, or when it aborts or rejects the request, it tells the prefill server to
  free at once. Without usable parameters (missing, or a prefill server it does not know) it prefills
  locally, as vLLM does. Transfer times land in ``vllm:nixl_xfer_time_seconds``.

Where it is not vLLM: the servers reach each other in process (a registry of live simulators by engine
id), not over NIXL's side channel, so a prefill and a decode server must run in one process (every
virtual-clock storm does); the transfer is a fixed time per block (``kv_transfer_s_per_block``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_KV_LEASE_S", "ROLES", "KVRole", "kv_params"]

ROLES = ("prefill", "decode")

DEFAULT_KV_LEASE_S = 30.0
"""vLLM's ``kv_lease_duration`` default: a prefill's blocks wait this long for their decode side."""

_ENGINE_IDS = itertools.count(1)
_PEERS: weakref.WeakValueDictionary[str, KVRole] = weakref.WeakValueDictionary()


def kv_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` object, or None."""
    v = body.get("kv_transfer_params")
    return dict(v) if isinstance(v, Mapping) else None


@dataclass
class _Held:
    expires: float
    blocks: list[int]
    tokens: int


class KVRole:
    """One simulator's P/D side: the prefill leases it holds, the decode pulls it waits for."""

    def __init__(self, role: str | None, *, lease_s: float = DEFAULT_KV_LEASE_S, seed: int = 0) -> None:
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)} or None, got {role!r}")
        if not lease_s > 0:
            raise ValueError(f"kv_lease_s must be > 0, got {lease_s!r}")
        self.role = role
        self.lease_s = float(lease_s)
        self.engine_id = f"zp-sim-{seed}-{next(_ENGINE_IDS)}"
        self.host = "127.0.0.1"
        self.port = 0
        self.engine: Any = None
        self.clock: Any = None
        self.held: dict[str, _Held] = {}  # prefill: engine id -> lease
        # decode: engine id -> (prefill peer, its request id, next heartbeat, pull start)
        self.pulls: dict[str, tuple[KVRole, str, float, float]] = {}
        self.counts = {"kv_expired": 0, "kv_freed_read": 0, "kv_freed_abort": 0, "kv_heartbeats": 0,
                       "kv_remote": 0, "kv_local_fallback": 0, "kv_read_freed": 0}
        self.xfer_times: list[float] = []
        self.wake: Any = None
        """Called when held blocks are freed (the server's engine loop may have work it can now do)."""
        if role is not None:
            _PEERS[self.engine_id] = self

    def bind(self, engine: Any, clock: Any) -> None:
        self.engine = engine
        self.clock = clock

    # ------------------------------------------------------------------ prefill side
    def wants_hold(self, kv: Mapping[str, Any] | None) -> bool:
        return self.role == "prefill" and bool(kv and kv.get("do_remote_decode"))

    def held_now(self, eid: str, prompt_tokens: int, block_ids: list[int]) -> dict[str, Any]:
        """A hold_kv request finished: start its lease; returns the kv_transfer_params of its answer."""
        self.held[eid] = _Held(self.clock() + self.lease_s, block_ids, prompt_tokens)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": block_ids, "remote_host": self.host, "remote_port": self.port,
                "remote_request_id": eid, "tp_size": 1, "num_tokens": prompt_tokens}

    def heartbeat(self, eid: str) -> bool:
        h = self.held.get(eid)
        if h is None:
            return False
        h.expires = self.clock() + self.lease_s
        self.counts["kv_heartbeats"] += 1
        return True

    def free(self, eid: str, reason: str) -> bool:
        if self.held.pop(eid, None) is None:
            return False
        self.engine.free_held(eid)
        self.counts["kv_freed_read" if reason == "read" else "kv_freed_abort"] += 1
        if self.wake is not None:
            self.wake()
        return True

    def expire(self) -> int:
        now = self.clock()
        dead = [eid for eid, h in self.held.items() if h.expires <= now]
        for eid in dead:
            self.held.pop(eid)
            self.engine.free_held(eid)
        self.counts["kv_expired"] += len(dead)
        return len(dead)

    # ------------------------------------------------------------------ decode side
    def peer_for(self, kv: Mapping[str, Any] | None) -> tuple[KVRole, str] | None:
        """The prefill server and request a decode call's KV comes from, or None (prefill locally)."""
        if self.role != "decode" or not kv or not kv.get("do_remote_prefill"):
            return None
        peer = _PEERS.get(str(kv.get("remote_engine_id")))
        rid = kv.get("remote_request_id")
        if peer is not None and isinstance(rid, str) and rid not in peer.held:
            # parameters of a KV its prefill server freed already (read, aborted, expired): vLLM's read is
            # one-sided, so it would read whatever those blocks hold now (the prefill side only logs
            # "Potentially invalid KV blocks"). Counted as the client's error; prefilled locally here.
            self.counts["kv_read_freed"] += 1
            self.counts["kv_local_fallback"] += 1
            return None
        if peer is None or not isinstance(rid, str):
            self.counts["kv_local_fallback"] += 1
            return None
        return peer, rid

    def pulling(self, eid: str, peer: KVRole, rid: str) -> None:
        """A remote_kv request entered the scheduler: heartbeat its prefill server from now on."""
        peer.heartbeat(rid)
        self.pulls[eid] = (peer, rid, peer.clock() + peer.lease_s / 3, self.clock())
        self.counts["kv_remote"] += 1

    def loaded(self, eid: str) -> None:
        p = self.pulls.pop(eid, None)
        if p is not None:
            peer, rid, _, t0 = p
            self.xfer_times.append(self.clock() - t0)
            peer.free(rid, "read")

    def dropped(self, eid: str) -> None:
        """The decode request was aborted or rejected before its KV arrived: the prefill frees now."""
        p = self.pulls.pop(eid, None)
        if p is not None:
            p[0].free(p[1], "aborted")

    def tick(self) -> float | None:
        """Expire leases, send due heartbeats; returns when the next of either is due (virtual s)."""
        nxt: float | None = None
        if self.held:
            self.expire()
            if self.held:
                nxt = min(h.expires for h in self.held.values())
        if self.pulls:
            for eid, (peer, rid, due, t0) in list(self.pulls.items()):
                # due on the prefill server's clock (its lease's), so a lagging decode engine still
                # heartbeats in time for it
                pnow = peer.clock()
                if due <= pnow:
                    peer.heartbeat(rid)
                    due = pnow + peer.lease_s / 3
                    self.pulls[eid] = (peer, rid, due, t0)
                nxt = due if nxt is None else min(nxt, due)
        return nxt

    def stats(self) -> dict[str, Any]:
        return {"role": self.role, "engine_id": self.engine_id, "lease_s": self.lease_s,
                "held_requests": len(self.held),
                "held_blocks": sum(len(h.blocks) for h in self.held.values()),
                "pulling": len(self.pulls), **self.counts,
                "xfer_waits_s": [round(x, 6) for x in self.xfer_times]}
