"""Prefill/decode disaggregation driven by the client: the protocol of vLLM's NixlConnector as its example
proxy speaks it, and the settings of a fleet's prefill pool (docs/pd.md).

A decode fleet paired with a prefill fleet (:meth:`~zp_client.fleet.local.Fleet.disaggregate`) serves
each admitted request in two calls, under a **two-phase lease** the admission core takes
(``zp_client._core``), one plan with two legs:

1. **prefill leg** first: the prompt's blocks (and one) on the prefill fleet (strict), placed on the
   prefill replica most likely to have its prefix cached;
2. **decode leg** second: the request's usual lease on the decode fleet (prompt plus growth, elastic),
   placed by the fleet's routing;
3. with both held, the prefill call (:func:`prefill_body`: ``max_tokens`` 1, not streamed,
   ``kv_transfer_params`` asking for a remote decode), then at once the decode call (:func:`decode_body`:
   the caller's body with the ``kv_transfer_params`` the prefill answered), with one ``X-Request-Id``;
4. the prefill leg is released when the decode call's first bytes arrive (the decode replica has read
   the KV: vLLM frees the prefill's blocks then; a call not streamed upstream holds it to its answer),
   or at once when the prefill call failed without an answer or answered without
   ``kv_transfer_params`` (nothing is held there; the decode replica prefills locally, as the proxy
   does). A request that ends any other way after the prefill answered and before a decode replica sent
   its first bytes (cancelled, a cut prefill answer, a decode call that failed or answered an error)
   keeps it until vLLM's own lease on those blocks has expired (``kv_lease_s`` after the prefill
   answered), the latest the prefill replica frees them. The decode leg ends as any lease does, with the
   response.

**Why this order.** Both legs are held before the prefill call is sent, so the KV a prefill produces
never waits on the prefill replica for decode room (its decode call goes out the moment the prefill
answers), and vLLM's lease on it cannot expire because zp held the decode call back: a burst that
saturates the decode pool waits in zp's lines with nothing on any GPU. Of the two legs, the one taken
first idles while the second is waited for: the prefill leg (the prefill pool is used one prefill at a
time and is rarely the scarce one), not the decode leg. The decode leg still idles while its prefill runs
(the ``decode_leg_idle_ms`` count: on seed-burst at ``--pd 1:1`` about 0.9 s a request, docs/pd.md).
Every request takes the legs in the same order and a decode leg never waits for a prefill leg, so the two
lines cannot deadlock; a decode retry that keeps a live prefill leg waits for its new decode leg only
while the KV may still be read, then drops it.

**Conditional disaggregation.** A request whose *uncached* prompt on its decode replica (the prompt less
the blocks the decode fleet's prefix index expects cached there) is under ``threshold_tokens`` skips the
prefill pool (decided before the legs on the best match among the decode replicas it may be placed on,
and again on the one it is placed on): prefilling a short suffix locally costs the decode batch less
than a transfer and a second call cost the request (Dynamo's ``isl_bounding`` and llm-d's decider make
the same call).

**Retries.** A decode attempt whose connection was refused (no decode replica has the request) moves
or retries on another decode replica with the same ``kv_transfer_params`` while the KV may still be read
(half of ``kv_lease_s`` since the prefill answered, so the next replica's first heartbeat is in time),
keeping the prefill leg through the backoff. Any other failure (an error answer, a cut stream, a timeout)
may have reached a decode replica's scheduler, which then tells the prefill replica to free the KV; and
vLLM's read is one-sided (a decode replica handed the parameters of freed, reused blocks would read them
as the prompt's), so those parameters are never sent again: the next attempt prefills again, and the old
prefill leg stays until vLLM's lease on its KV has expired.

**Budgets.** Either fleet may be local (:class:`~zp_client.fleet.Fleet`) or in Redis
(:class:`~zp_client.fleet.redis.RedisFleet`). With Redis the legs are two scripts, one per fleet, in
the order above (not one script: the two fleets are separate budgets with separate lines, and the order
alone rules out a deadlock); the prefix index of a RedisFleet lives in Redis, so the conditional
decision takes the whole prompt as uncached there.
"""

from __future__ import annotations

import json
import math
from collections import Counter
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
    counts: Counter[str] = field(default_factory=Counter, compare=False)
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
