"""Prefill/decode disaggregation driven by the client: the protocol of vLLM's NixlConnector as its example
proxy speaks it, and the settings of a fleet's prefill pool (docs/pd.md).

A decode fleet paired with a prefill fleet (:meth:`~zp_client.fleet.local.Fleet.disaggregate`) serves
each admitted request in two calls, under a **two-phase lease** the admission core takes
(``zp_client._core``):

1. **decode leg** first: the request's usual lease on the decode fleet (prompt plus growth, elastic),
   placed on a decode replica by the fleet's routing;
2. **prefill leg** second: the prompt's blocks on the prefill fleet, placed on a prefill replica;
3. the prefill call (:func:`prefill_body`: ``max_tokens`` 1, not streamed, ``kv_transfer_params``
   asking for a remote decode), then at once the decode call (:func:`decode_body`: the caller's body with
   the ``kv_transfer_params`` the prefill answered), with one ``X-Request-Id``;
4. the prefill leg is released when the decode call's first bytes arrive (the decode replica has read
   the KV: vLLM frees the prefill's blocks then), or at once when the prefill call failed or answered
   without ``kv_transfer_params`` (nothing is held there; the decode replica prefills locally, as the
   proxy does), or when the decode replica answered an error (it tells the prefill replica to free); a
   request that ends any other way between the two calls (cancelled, the decode call's connection
   failed) keeps it until vLLM's own lease on those blocks has expired (``kv_lease_s`` after the prefill
   answered), the latest the prefill replica frees them.

Why the decode leg first: the KV the prefill produces must never wait on the prefill replica for decode
room, and vLLM's lease on it must never expire because zp held the decode call back. With the decode
room already held, the decode call goes out the moment the prefill answers, and a burst that saturates
the decode pool waits in zp's line *before* any prefill runs (with nothing on any GPU). The cost: a
decode leg is held, unused by the server, while its prefill leg waits and its prefill runs (about one
prefill batch). Both legs are always taken in that order, and a prefill leg never waits for a decode
leg, so the two lines cannot deadlock.

**Conditional disaggregation.** A request whose *uncached* prompt on its decode replica (the prompt less
the blocks the decode fleet's prefix index expects cached there) is under ``threshold_tokens`` skips the
prefill pool: prefilling a short suffix locally costs the decode batch less than a transfer and a second
call cost the request (Dynamo's ``isl_bounding`` and llm-d's decider make the same call).

**Retries.** A decode attempt whose connection failed (the request never reached a decode replica) moves
or retries on another decode replica with the same ``kv_transfer_params`` while vLLM's lease on them is
alive (half of ``kv_lease_s`` since the prefill answered, so the decode replica's first heartbeat comes in
time), keeping the prefill leg through the backoff; past that, or after a decode replica answered, the
next attempt prefills again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zp_client.errors import ConfigurationError

__all__ = ["DEFAULT_KV_LEASE_S", "DEFAULT_THRESHOLD_TOKENS", "PREFILL_KV_PARAMS", "PDSettings", "decode_body",
           "kv_params_of", "prefill_body"]

DEFAULT_KV_LEASE_S = 30.0
"""vLLM's ``kv_lease_duration`` default (seconds): how long a prefill replica keeps a finished prefill's
blocks for its decode side without a heartbeat."""

DEFAULT_THRESHOLD_TOKENS = 512
"""Uncached prompt tokens below which a request goes straight to its decode replica. Chosen from the sweep
in docs/pd.md (0, 256, 512, 2,048, never on the agentic workload at ``--pd 1:1``)."""

PREFILL_KV_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}
"""What the example proxy sends a prefill server in ``kv_transfer_params``."""

_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill call's body for a caller's: ``kv_transfer_params`` asking for a remote decode,
    ``max_tokens`` (and ``max_completion_tokens`` when present) 1, not streamed, ``stream_options``,
    ``min_tokens`` and ``min_completion_tokens`` dropped (the example proxy's rules)."""
    out = dict(body)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in _PREFILL_DROPPED:
        out.pop(key, None)
    return out


def decode_body(body: Mapping[str, Any], kv: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode call's body: the caller's, with the prefill's ``kv_transfer_params`` passed back
    verbatim (none: the body as it is, and the decode replica prefills locally)."""
    out = dict(body)
    if kv:
        out["kv_transfer_params"] = dict(kv)
    return out


def kv_params_of(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` object of a prefill answer's JSON body, or None (not JSON, missing,
    empty, not an object)."""
    try:
        data = json.loads(answer)
    except (ValueError, UnicodeDecodeError):
        return None
    kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return dict(kv) if isinstance(kv, dict) and kv else None


@dataclass(frozen=True)
class PDSettings:
    """A decode fleet's prefill side: the prefill fleet and the rules of the two-phase lease (module
    docstring). ``prefill``: a :class:`~zp_client.fleet.Fleet` or :class:`~zp_client.fleet.redis.RedisFleet`
    of the prefill replicas; ``threshold_tokens``: uncached prompt tokens below which a request is not
    disaggregated (0: every request is; ``math.inf``: none is); ``kv_lease_s``: the prefill replicas'
    ``kv_lease_duration``."""

    prefill: Any
    threshold_tokens: float = DEFAULT_THRESHOLD_TOKENS
    kv_lease_s: float = DEFAULT_KV_LEASE_S
    counts: dict[str, int] = field(default_factory=dict, compare=False)
    """What the two-phase lease did, by kind: ``prefills`` (prefill calls made), ``direct`` (requests
    sent straight to their decode replica), ``local`` (a prefill answered without
    ``kv_transfer_params``), ``prefill_failed``, ``reused`` (a decode retry with a live prefill's
    parameters), ``held_to_expiry`` (prefill legs kept until vLLM's lease on their KV ended)."""

    def __post_init__(self) -> None:
        if not getattr(self.prefill, "is_fleet", False):
            raise ConfigurationError(
                "disaggregate(prefill) takes a fleet of the prefill replicas (Fleet or RedisFleet), got "
                f"{type(self.prefill).__name__}")
        t = self.threshold_tokens
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise ConfigurationError(f"threshold_tokens must be a number >= 0 (math.inf: never), got {t!r}")
        s = self.kv_lease_s
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (s > 0 and math.isfinite(s)):
            raise ConfigurationError(f"kv_lease_s must be a positive number of seconds, got {s!r}")

    @property
    def reuse_s(self) -> float:
        """How long after the prefill answered its ``kv_transfer_params`` may go to another decode
        replica: half the lease, so that replica's first heartbeat still finds the blocks."""
        return self.kv_lease_s / 2

    def disaggregates(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a request with this prompt and this much of it cached on its decode replica goes
        through the prefill pool."""
        return max(0, prompt_tokens - cached_tokens) >= self.threshold_tokens
