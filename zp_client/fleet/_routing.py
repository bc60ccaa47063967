"""What the admission core asks of any fleet (local or Redis), in one place: the fleet's own base URL,
where an attempt goes, where metadata is read, the routing meta of a request. Duck-typed by the core
(``is_fleet``), which never imports this package."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from zp_client.budget.ledger import validate_blocks
from zp_client.errors import ConfigurationError
from zp_client.fleet.ledger import AVOID_META, PREFIX_META, SESSION_META
from zp_client.fleet.prefix import prefix_keys

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

    def route_url(self, lease: Any, url: Any) -> Any:
        """``url`` (an httpx/httpx2 URL) sent to ``lease``'s replica: its scheme, host and port."""
        replica = getattr(lease, "replica", None)
        if replica is None:
            return url
        scheme, host, port = origin(replica)
        return url.copy_with(scheme=scheme, host=host, port=port)

    def passthrough_url(self, url: Any) -> Any:
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

    def routing_meta(self, body: Mapping[str, Any], prompt_tokens: int,
                     session: str | None) -> dict[str, Any]:
        """What the core adds to a request's lease meta for routing: its prefix keys and session."""
        meta: dict[str, Any] = {PREFIX_META: prefix_keys(body, prompt_tokens, self.block_size)}
        if session is not None:
            meta[SESSION_META] = session
        return meta

    def avoiding(self, meta: Mapping[str, Any] | None, lease: Any) -> dict[str, Any]:
        """``meta`` for the request's next placement: not on ``lease``'s replica, which just failed it
        (unless no other replica is available)."""
        out = dict(meta or {})
        replica = getattr(lease, "replica", None)
        if replica is not None:
            out[AVOID_META] = (*out.get(AVOID_META, ()), replica)
        return out
