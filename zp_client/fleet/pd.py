"""Prefill/decode disaggregation driven by the client: the protocol of vLLM's NixlConnector as its example
proxy speaks it, and the settings of a fleet's prefill pool (docs/pd.md).

A decode fleet paired with a prefill fleet (:meth:`~zp_client.fleet.local.Fleet.disaggregate`) serves
each admitted request in two calls, under a **two-phase lease** (:class:`TwoPhaseLease`, a sub-machine the
admission core's attempt loop runs through its ``TwoPhaseCall`` port), one plan with two legs:

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
import uuid
from collections import Counter
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import cast

from zp_client._admission.actions import Acquire, Action, Close, ReadAll, Release, Send
from zp_client._admission.loop_ports import AttemptContext
from zp_client._admission.loop_ports import Fleet as FleetPort
from zp_client._admission.plan import Plan
from zp_client._admission.ports import HttpRequest, HttpResponse
from zp_client._admission.release import Holder
from zp_client.budget.base import Budget, Lease
from zp_client.errors import ConfigurationError, LeaseTooLarge

__all__ = ["DEFAULT_KV_LEASE_S", "DEFAULT_THRESHOLD_TOKENS", "PREFILL_KV_PARAMS", "PDSettings",
           "TwoPhaseLease", "decode_body", "kv_params_of", "prefill_body"]

DEFAULT_KV_LEASE_S = 30.0
"""vLLM's ``kv_lease_duration`` default (seconds): how long a prefill replica keeps a finished prefill's
blocks for its decode side without a heartbeat."""

DEFAULT_THRESHOLD_TOKENS = 512
"""Uncached prompt tokens below which a request goes straight to its decode replica. Chosen from the sweep
in docs/pd.md (0, 256, 512, 2,048, never on the agentic workload at ``--pd 1:1``)."""

PREFILL_KV_PARAMS: dict[str, object] = {"do_remote_decode": True, "do_remote_prefill": False,
                                     "remote_engine_id": None, "remote_block_ids": None,
                                     "remote_host": None, "remote_port": None}
"""What the example proxy sends a prefill server in ``kv_transfer_params``."""

_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: Mapping[str, object]) -> dict[str, object]:
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


def decode_body(body: Mapping[str, object], kv: Mapping[str, object] | None) -> dict[str, object]:
    """The decode call's body: the caller's, with the prefill's ``kv_transfer_params`` passed back
    verbatim (none: the body as it is, and the decode replica prefills locally)."""
    out = dict(body)
    if kv:
        out["kv_transfer_params"] = dict(kv)
    return out


def kv_params_of(answer: bytes) -> dict[str, object] | None:
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

    prefill: FleetPort
    threshold_tokens: float = DEFAULT_THRESHOLD_TOKENS
    kv_lease_s: float = DEFAULT_KV_LEASE_S
    counts: Counter[str] = field(default_factory=Counter, compare=False)
    """What the two-phase lease did, by kind: ``prefills`` (prefill calls made), ``direct`` (requests
    sent straight to their decode replica), ``local`` (a prefill answered without
    ``kv_transfer_params``), ``prefill_failed``, ``reused`` (a decode retry with a live prefill's
    parameters), ``held_to_expiry`` (prefill legs kept until vLLM's lease on their KV ended)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.prefill, FleetPort) and self.prefill.is_fleet):
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

    def call(self, decode: FleetPort, plan: Plan, body: Mapping[str, object],
             ctx: AttemptContext) -> TwoPhaseLease:
        """The two-phase lease of one request on ``decode`` (the fleet this is the prefill side of)."""
        return TwoPhaseLease(self, decode, plan, body, ctx)

    def disaggregates(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a request with this prompt and this much of it cached on its decode replica goes
        through the prefill pool."""
        return max(0, prompt_tokens - cached_tokens) >= self.threshold_tokens


# --------------------------------------------------------------------------------------------------
# The two-phase lease of one request: a sub-machine of the attempt loop (the TwoPhaseCall port)
# --------------------------------------------------------------------------------------------------

_CONNECT_ERRORS = ("ConnectError", "ConnectTimeout")


class TwoPhaseLease:
    """One disaggregated request's prefill side across its attempts (the module docstring's rules). The
    attempt loop runs it through :class:`~zp_client._admission.loop_ports.TwoPhaseCall`: its methods yield the
    loop's actions (acquire the prefill leg, send the prefill call, release) and take their results."""

    __slots__ = ("pd", "decode", "ctx", "body", "holder", "kv", "at", "until", "is_reached", "shipped",
                 "_rid", "_n", "_headers")

    def __init__(self, pd: PDSettings, decode: FleetPort, plan: Plan, body: Mapping[str, object],
                 ctx: AttemptContext) -> None:
        self.pd = pd
        self.decode = decode
        self.ctx = ctx
        self.body: dict[str, object] = json.loads(plan.content) if plan.content else dict(body)
        self.holder: Holder | None = None
        """The prefill leg, while held."""
        self.kv: dict[str, object] | None = None
        """The prefill's ``kv_transfer_params``, while its KV may still be read."""
        self.at = 0.0
        self.until: float | None = None
        """When vLLM's lease on the prefill's KV expires (None: the prefill replica holds nothing)."""
        self.is_reached = False
        """A decode replica has read ``kv`` (its first bytes came)."""
        self.shipped = False
        """``kv`` went out in a decode call that may have reached a replica's scheduler: never again."""
        rid = next((v for k, v in plan.headers if k.lower() == b"x-request-id"), None)
        self._rid = rid.decode("latin-1") if rid else f"zp-pd-{uuid.uuid4().hex}"
        self._n = 0
        self._headers: list[tuple[bytes, bytes]] = []

    @property
    def leg(self) -> Holder | None:
        """The prefill leg while held."""
        return self.holder

    def reusable_for(self, now: float) -> float | None:
        """Seconds the KV may still go to another decode replica (None: nothing to reuse)."""
        if self.kv is None or self.shipped or self.holder is None or self.holder.done:
            return None
        left = self.at + self.pd.reuse_s - now
        return left if left > 0 else None

    def _with_rid(self, plan: Plan, rid: str) -> list[tuple[bytes, bytes]]:
        return [*((k, v) for k, v in plan.headers if k.lower() != b"x-request-id"),
                (b"X-Request-Id", rid.encode("latin-1"))]

    def prefill_plan(self, plan: Plan) -> Plan:
        """The plan of the prefill call (:func:`prefill_body`), with its own request id."""
        self._n += 1  # one id per prefill, shared with its decode calls
        rid = self._rid if self._n == 1 else f"{self._rid}-{self._n}"
        self._headers = self._with_rid(plan, rid)
        content = json.dumps(prefill_body(self.body), separators=(",", ":"), ensure_ascii=False).encode()
        return replace(plan, content=content, headers=self._headers)

    def decode_plan(self, plan: Plan) -> Plan:
        """The plan of the decode call (:func:`decode_body` with the prefill's parameters)."""
        content = json.dumps(decode_body(self.body, self.kv), separators=(",", ":"),
                             ensure_ascii=False).encode()
        return replace(plan, content=content, headers=self._headers or plan.headers)

    # -- the sub-machine ----------------------------------------------------------------------------
    def before_attempt(self, plan: Plan, is_async: bool) -> Generator[Action, object, bool]:
        """Before an attempt that reuses no live prefill: end the old leg (its KV is too old to hand to
        another decode replica) and, when the request is disaggregated on its best decode match, take
        the prefill leg first; True then."""
        yield from self.drop()
        if not self.pd.disaggregates(plan.prompt_tokens, self.decode.best_matched_tokens(plan.meta)):
            return False
        yield from self._take_leg(plan, is_async)
        return True

    def _take_leg(self, plan: Plan, is_async: bool) -> Generator[Action, object, None]:
        """Take the prefill leg: the prompt's blocks (and one) on the prefill fleet, placed by prefix."""
        pre = self.pd.prefill
        budget = cast(Budget, pre)  # a fleet is a budget (PDSettings checks it)
        ctx = self.ctx
        blocks = max(1, -(-(plan.prompt_tokens + 1) // ctx.block_size))
        try:
            meta = ctx.lease_meta(plan, pre.routing_only(plan.meta))
            plea = cast(Lease, (yield Acquire(blocks, plan.priority, ctx.remaining(plan), None, blocks, meta,
                                              budget=budget)))
        except LeaseTooLarge:  # larger than any prefill replica takes: its decode replica prefills it
            return
        self.holder = ctx.hold(plea, is_async=is_async, budget=budget)
        self.kv, self.until, self.is_reached, self.shipped = None, None, False, False

    def prefill(self, plan: Plan, request: HttpRequest, lease: Lease,
                granted_at: float) -> Generator[Action, object, Plan]:
        """The prefill phase of one attempt, both legs held (``lease`` the decode leg): returns the plan
        the decode call sends. Reuses a live prefill's ``kv_transfer_params``; sends a request whose
        uncached prompt on its decode replica is short (or that took no prefill leg) straight there;
        otherwise makes the prefill call and passes its ``kv_transfer_params`` on (none: the decode
        replica prefills locally)."""
        pd, ctx = self.pd, self.ctx
        counts = pd.counts
        if self.kv is not None and self.holder is not None and not self.holder.done:
            counts["reused"] += 1
            self.is_reached, self.shipped = False, True
            return self.decode_plan(plan)
        if self.holder is None or not pd.disaggregates(plan.prompt_tokens, self.decode.matched_tokens(lease)):
            yield from self.drop()  # a leg taken on the best match elsewhere: not needed here
            counts["direct"] += 1
            return plan
        pre = pd.prefill
        plea = self.holder.lease
        counts["prefills"] += 1
        try:
            resp = cast(HttpResponse, (yield Send(ctx.request(request, self.prefill_plan(plan),
                                                              pre.route_url(plea, request.url)))))
        except Exception as exc:  # noqa: BLE001 - no answer: the decode replica prefills locally
            yield from self.drop()
            _failed(pre, plea, exc)
            counts["prefill_failed"] += 1
            return plan
        # an answer: a finished prefill's blocks stay there until read, aborted or vLLM's lease expires
        self.until = ctx.now() + pd.kv_lease_s
        chunks: list[bytes] = []
        try:
            yield ReadAll(resp, chunks.append)
        except Exception as exc:  # noqa: BLE001 - a cut answer: the decode replica prefills locally
            yield Close(resp, shield=True)
            yield from self.drop()  # kept until the lease expires: nobody will read it
            _failed(pre, plea, exc)
            counts["prefill_failed"] += 1
            return plan
        except BaseException:
            yield Close(resp, shield=True)
            raise
        if resp.status_code >= 500:
            pre.note_failure(plea)
        elif resp.status_code < 400:
            pre.note_success(plea)
        kv = kv_params_of(b"".join(chunks)) if resp.status_code == 200 else None
        if kv is None:  # nothing held for us there (an error, a server without P/D): prefill locally
            self.until = None
            yield from self.drop()
            counts["local"] += 1
            return plan
        self.kv, self.at = kv, ctx.now()
        self.until = self.at + pd.kv_lease_s
        # the decode leg's wait for its KV: held on the decode pool, not yet used by the server
        idle_ms = round(1000 * (self.at - granted_at))
        counts["decode_leg_idle_ms"] += idle_ms
        self.shipped = True
        return self.decode_plan(plan)

    def answered(self, resp: HttpResponse) -> None:
        """A decode replica answered the call carrying ``kv``. A complete (non-streamed) success means
        it read the KV; a stream's first bytes do (:meth:`decode_started`). An error answer may come from
        before its scheduler (a proxy, a full queue) or after (it then told the prefill replica to free):
        zp cannot tell, so those parameters are never sent again (vLLM's read is one-sided: blocks freed
        and reused would be read as if they were the prompt's) and the prefill leg stays until vLLM's
        lease on them has expired; the next attempt prefills again."""
        if resp.status_code < 400 and not self.ctx.is_event_stream(resp):
            self.is_reached = True

    def decode_started(self) -> Generator[Action, object, None]:
        """The decode stream's first bytes came: the decode replica has read the KV; the leg ends."""
        self.is_reached = True
        yield from self.drop()

    def connect_failed(self) -> None:
        """The decode call reached no replica: its KV may go to another one."""
        self.shipped = False

    def drop(self) -> Generator[Action, object, None]:
        """End the prefill leg, once: at once when nothing waits on the prefill replica for us (never
        answered, no KV, or a decode replica has the request), else when vLLM's lease on the KV ends."""
        h, self.holder = self.holder, None
        kv_alive = self.until is not None and not self.is_reached
        until, self.kv, self.until = self.until, None, None
        if h is None or h.done:
            return
        now = self.ctx.now()
        if kv_alive and until is not None and until > now:
            self.pd.counts["held_to_expiry"] += 1
            yield Release(h, after_s=until - now)
        else:
            yield Release(h)


def _failed(pre: FleetPort, lease: Lease, exc: BaseException) -> None:
    """A prefill call that failed counts against its replica's health (a connection error at once)."""
    from zp_client.retry import classify_error

    if classify_error(exc) is not None:
        pre.note_failure(lease, connect=type(exc).__name__ in _CONNECT_ERRORS)
