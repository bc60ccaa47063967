"""What the admission core asks of any fleet (local or Redis), in one place: the fleet's own base URL,
where an attempt goes, where metadata is read, the routing meta of a request. Duck-typed by the core
(``is_fleet``), which never imports this package."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

from zp_client.budget.ledger import validate_blocks
from zp_client.errors import ConfigurationError
from zp_client.fleet.ledger import AVOID_META, PREFIX_META, SESSION_META
from zp_client.fleet.pd import DEFAULT_KV_LEASE_S, DEFAULT_THRESHOLD_TOKENS, PDSettings
from zp_client.fleet.prefix import prefix_keys

if TYPE_CHECKING:
    from typing_extensions import Self

    from zp_client._admission.ports import HttpURL
    from zp_client.budget.base import BudgetStatus, Lease

VIRTUAL_DOMAIN = "zp-fleet.invalid"
"""``base_url``'s host is ``<name>.zp-fleet.invalid``: a name only the fleet resolves (``.invalid``
never resolves in DNS, so a request that bypassed the fleet fails loudly instead of going astray)."""


def normalize(url: str) -> str:
    """A replica's base URL checked and normalized (no trailing slash, query or fragment)."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(f"a replica is a base URL like http://host:8000/v1, got {url!r}")
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"a replica is an http(s) base URL like http://host:8000/v1, got {url!r}")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def replica_limits(replicas: Sequence[str] | Mapping[str, int], limit_blocks: int | None, *,
                   missing_limit: str) -> dict[str, int]:
    """Normalized replica URL -> limit from a fleet constructor's arguments: a list of base URLs with one
    ``limit_blocks`` for each, or a mapping URL -> limit. ``missing_limit`` is the error's text when a
    list comes without ``limit_blocks``."""
    if isinstance(replicas, str):
        raise ConfigurationError("replicas is a list of base URLs (or a mapping URL -> limit), not one "
                                 f"string; got {replicas!r}")
    if isinstance(replicas, Mapping):
        out = {normalize(u): validate_blocks(v, f"limit of {u}") for u, v in replicas.items()}
    else:
        if limit_blocks is None:
            raise ConfigurationError(missing_limit)
        validate_blocks(limit_blocks, "limit_blocks")
        out = {normalize(u): limit_blocks for u in replicas}
    if not out:
        raise ConfigurationError("a fleet needs at least one replica")
    return out


def origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port


class FleetRouting:
    """The routing surface both fleets share; a fleet provides ``name``, ``block_size``, ``_path`` (the
    replicas' path) and ``_target()`` (a replica for requests that are not admitted, or None)."""

    is_fleet = True
    """What the admission core looks for to route (duck-typed: it never imports this module)."""

    pd: Any = None  # a PDSettings once disaggregated (its prefill fleet's own class is the fleet's)
    """The prefill side (a :class:`~zp_client.fleet.pd.PDSettings`) once :meth:`disaggregate` paired this
    fleet, as the decode pool, with a prefill fleet; None: colocated."""

    name: str
    block_size: int
    _path: str

    def _target(self) -> str | None:
        raise NotImplementedError

    @property
    def base_url(self) -> str:
        """The base URL to give a client of this fleet: ``http://<name>.zp-fleet.invalid/v1`` (the
        replicas' path); the admission transport sends each request to its lease's replica."""
        return f"http://{self.name}.{VIRTUAL_DOMAIN}{self._path}"

    def disaggregate(self, prefill: Any, *, threshold_tokens: float | None = None,
                     kv_lease_s: float | None = None) -> Self:
        """Make this fleet the **decode** pool of a prefill/decode deployment whose prefill replicas are
        the fleet ``prefill`` (docs/pd.md), and return this fleet (give it to the client as usual)::

            fleet = Fleet(decode_urls, limit_blocks=1945).disaggregate(
                Fleet(prefill_urls, limit_blocks=1945, policy="strict"))

        Each admitted request then takes a two-phase lease (:mod:`zp_client.fleet.pd`): its prompt's
        blocks on ``prefill``, then its decode leg here, and is served by a prefill call and a decode
        call with vLLM's ``kv_transfer_params``. ``threshold_tokens``: uncached prompt tokens below which a
        request skips the prefill pool (default :data:`~zp_client.fleet.pd.DEFAULT_THRESHOLD_TOKENS`;
        0: never skip; ``math.inf``: never disaggregate). ``kv_lease_s``: the prefill servers'
        ``kv_lease_duration`` (vLLM's default 30 s)."""
        if prefill is self:
            raise ConfigurationError("a fleet cannot be its own prefill pool: pass a fleet of the prefill "
                                     "replicas")
        if getattr(prefill, "pd", None) is not None:
            raise ConfigurationError("the prefill fleet is itself disaggregated: pass a plain fleet")
        if getattr(prefill, "policy_name", "strict") != "strict":
            raise ConfigurationError(
                f"the prefill fleet's policy must be 'strict' (a prefill leg is its prompt, known at "
                f"admission, held until the decode replica read it), got {prefill.policy_name!r}")
        if getattr(prefill, "block_size", self.block_size) != self.block_size:
            raise ConfigurationError(f"the prefill fleet's block_size ({prefill.block_size}) differs from "
                                     f"this fleet's ({self.block_size})")
        self.pd = PDSettings(prefill,
                             DEFAULT_THRESHOLD_TOKENS if threshold_tokens is None else threshold_tokens,
                             DEFAULT_KV_LEASE_S if kv_lease_s is None else kv_lease_s)
        return self

    def pd_extra(self, prefill_status: BudgetStatus) -> dict[str, object]:
        """``status().extra["pd"]`` of a disaggregated fleet: the two-phase lease's settings and counts,
        and its prefill fleet's limit, used and held blocks and leases."""
        pd = self.pd
        return {"threshold_tokens": pd.threshold_tokens, "kv_lease_s": pd.kv_lease_s,
                "counts": dict(pd.counts),
                "prefill": {"limit": prefill_status.limit, "used": prefill_status.used,
                            "held": prefill_status.held, "leases": prefill_status.leases,
                            "replicas": prefill_status.extra.get("replicas")}}

    def matched_tokens(self, lease: Lease) -> int:
        """The tokens of ``lease``'s prompt its replica most likely has cached (the prefix index's match
        when it was placed; 0 when the fleet does not know)."""
        ledger = getattr(self, "ledger", None)
        matched = getattr(ledger, "matched_blocks", None)
        return 0 if matched is None else int(matched(str(getattr(lease, "id", "")))) * self.block_size

    def best_matched_tokens(self, meta: Mapping[str, object] | None) -> int:
        """The most tokens of a request's prompt (its lease meta's prefix keys) any replica most likely
        has cached (0 when the fleet does not know): before it is placed."""
        keys = (meta or {}).get(PREFIX_META)
        ledger: Any = getattr(self, "ledger", None)
        index = getattr(ledger, "index", None)
        if not keys or index is None:
            return 0
        # only where it may be placed: not a replica it avoids (that failed it, whose index holds its own
        # prompt from that placement), nor an ejected or draining one
        avoid = set(cast("tuple[str, ...]", (meta or {}).get(AVOID_META) or ()))
        usable = {u for u, r in tuple(ledger.replicas.items())
                  if not r.draining and not r.ejected and u not in avoid}
        lock = getattr(self, "_lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            matched = index.match(keys)
        return max((b for u, b in matched.items() if u in usable), default=0) * self.block_size

    def route_url(self, lease: Lease, url: HttpURL) -> HttpURL:
        """``url`` (an httpx/httpx2 URL) sent to ``lease``'s replica: its scheme, host and port."""
        replica = getattr(lease, "replica", None)
        if replica is None:
            return url
        scheme, host, port = origin(replica)
        return url.copy_with(scheme=scheme, host=host, port=port)

    def passthrough_url(self, url: HttpURL) -> HttpURL:
        """A request the fleet does not admit (``GET /v1/models``...) aimed at ``base_url`` goes to an
        available replica; any other URL is left alone."""
        if not str(url.host).endswith(VIRTUAL_DOMAIN):
            return url
        target = self._target()
        if target is None:
            return url
        scheme, host, port = origin(target)
        return url.copy_with(scheme=scheme, host=host, port=port)

    def metadata_base(self, base: str, root: str) -> tuple[str, str]:
        """Where the core reads server metadata (``/v1/models``, ``/tokenize``) for a request aimed at
        ``base``: an available replica when ``base`` is the fleet's own name."""
        if VIRTUAL_DOMAIN not in root:
            return base, root
        target = self._target()
        if target is None:
            return base, root
        scheme, host, port = origin(target)
        new_root = f"{scheme}://{host}" + (f":{port}" if port else "")
        return new_root + urlsplit(base).path, new_root

    def routing_meta(self, body: Mapping[str, object], prompt_tokens: int,
                     session: str | None) -> dict[str, object]:
        """What the core adds to a request's lease meta for routing: its prefix keys and session."""
        meta: dict[str, object] = {PREFIX_META: prefix_keys(body, prompt_tokens, self.block_size)}
        if session is not None:
            meta[SESSION_META] = session
        return meta

    @staticmethod
    def routing_only(meta: Mapping[str, object] | None) -> dict[str, object] | None:
        """The prefix keys of a request's lease meta, for its prefill leg on this (prefill) fleet: the
        replica with its prefix cached prefills it fastest (sessions and avoided replicas are the
        decode pool's)."""
        keys = (meta or {}).get(PREFIX_META)
        return {PREFIX_META: keys} if keys else None

    def avoiding(self, meta: Mapping[str, object] | None, lease: Lease) -> dict[str, object]:
        """``meta`` for the request's next placement: not on ``lease``'s replica, which just failed it
        (unless no other replica is available)."""
        out = dict(meta or {})
        replica = getattr(lease, "replica", None)
        if replica is not None:
            out[AVOID_META] = (*cast("tuple[str, ...]", out.get(AVOID_META, ())), replica)
        return out
