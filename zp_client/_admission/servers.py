"""What the core reads of the servers it admits to: their metadata (a cached
:class:`~zp_client.server.ServerInfo` per API base), the model's context length, and the one check of a
server's KV pool against the budget's limit (``Settings.pool_check``)."""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import cast

from zp_client._admission.actions import Action, ModelLen, PoolSize
from zp_client._admission.parts import Parts
from zp_client._admission.plan import Parsed
from zp_client._admission.ports import AsyncInner, SyncInner
from zp_client.budget.base import Budget
from zp_client.errors import ZPError
from zp_client.server import ServerInfo, ServerMetrics

__all__ = ["Servers", "check_pool"]

logger = logging.getLogger("zp_client.transport")

MetaSteps = Generator[Action, object, None]


def check_pool(budget: Budget, root: str, metrics: ServerMetrics) -> bool:
    """Warn (``logging``, logger ``zp_client.transport``) when ``budget``'s limit is larger than the KV pool
    ``metrics`` describes; True when it warned. The pool has ``num_gpu_blocks - 1`` usable blocks (vLLM's
    null block); with different block sizes the comparison is in tokens. A pool the metrics do not state
    is logged at debug level."""
    n = metrics.num_gpu_blocks
    if not isinstance(n, int) or n < 1:
        logger.debug("pool check: %s/metrics has no vllm:cache_config_info num_gpu_blocks", root)
        return False
    usable = n - 1
    server_bs = metrics.block_size or budget.block_size
    limit, bs = budget.limit, budget.block_size
    if limit * bs <= usable * server_bs:
        return False
    from zp_client.server import suggest_limit_blocks

    policy = "elastic" if budget.policy_name == "elastic" else "strict"
    suggested = suggest_limit_blocks(n, policy=policy) * server_bs // bs  # in the budget's blocks
    logger.warning(
        "budget limit_blocks=%d (blocks of %d tokens) is larger than the KV pool of the server at %s: %d "
        "usable blocks (num_gpu_blocks=%d minus vLLM's null block) of %d tokens, so it cannot keep the "
        "server from preempting; size it from the pool: limit_blocks=%d (suggest_limit_blocks(%d), or "
        "zp-client status --server URL). Settings.pool_check=False (ZP_POOL_CHECK=false) turns this "
        "check off.",
        limit, bs, root, usable, n, server_bs, suggested, n,
    )
    return True


class Servers:
    """Server metadata for one core: fetched through the inner transport (no admission), cached."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts
        self._servers: dict[str, ServerInfo] = {}
        self._mml: dict[tuple[str, str | None], int | None] = {}
        self._pool_roots: set[str] = set()  # the fallback registry for a budget that is no weak key
        self._pool_roots_seen: set[str] = set()  # roots this core has asked about (no lock after the first)

    def known(self, base: str) -> ServerInfo | None:
        """The server at ``base`` if its metadata was read already (None: not asked yet)."""
        return self._servers.get(base)

    def server_for(self, p: Parsed, inner: AsyncInner | SyncInner) -> ServerInfo:
        """A ServerInfo for this request's server, fetching through the inner transport (no admission)."""
        server = self._servers.get(p.base)
        if server is None:
            server = self._parts.lib.server_info(inner, p.base, p.root, p.auth_headers, self._parts.settings)
            self._servers[p.base] = server
        return server

    def max_model_len(self, p: Parsed,
                      inner: AsyncInner | SyncInner) -> Generator[Action, object, int | None]:
        """The model's context length: the setting, else the server's answer (cached when known)."""
        if self._parts.settings.max_model_len is not None:
            return self._parts.settings.max_model_len
        key = (p.base, p.model)
        if key in self._mml:
            return self._mml[key]
        value: int | None
        try:
            got = yield ModelLen(self.server_for(p, inner), p.model)
            value = got if isinstance(got, int) else None
        except Exception as exc:  # noqa: BLE001 - metadata only tightens the bound: logged, never fatal
            self._mml_failed(p, exc)
            value = None
        if value is not None:  # unknown stays uncached: ServerInfo retries (no sooner than 30 s apart)
            self._mml[key] = value
        return value

    def _mml_failed(self, p: Parsed, exc: BaseException) -> None:
        if self._parts.shared.once(f"max_model_len:{p.base}"):
            logger.warning(
                "could not read max_model_len from %s/models (%s); bounds are not capped by the context "
                "length and long prompts are not refused locally. Set Settings.max_model_len to fix.",
                p.base,
                type(exc).__name__,
            )

    def claim_pool_check(self, p: Parsed) -> bool:
        """True for the one request that reads this server's pool for this budget (``Settings.pool_check``);
        claimed before the read, so concurrent first requests do not wait on it nor read it again."""
        parts = self._parts
        if not parts.settings.pool_check or p.root in self._pool_roots_seen or parts.fleet is not None:
            return False  # the fast path: this core already knows the root was claimed
        self._pool_roots_seen.add(p.root)
        claimed = parts.shared.claim_pool_check(parts.budget, p.root)
        if claimed is not None:
            return claimed
        if p.root in self._pool_roots:  # a budget that cannot be a weak key: once per core instead
            return False
        self._pool_roots.add(p.root)
        return True

    def pool_probe(self, p: Parsed, inner: AsyncInner | SyncInner) -> MetaSteps:
        """Read the server's KV pool once per budget and server and warn when the limit exceeds it. A
        server that cannot answer (no /metrics, not vLLM, no answer within the short read: every such case
        is a ServerInfoError) is logged at debug level and otherwise ignored: the check never fails a
        request and is not retried."""
        try:
            metrics = yield PoolSize(self.server_for(p, inner))
        except ZPError as exc:
            logger.debug("pool check: could not read %s/metrics (%s: %s)", p.root, type(exc).__name__, exc)
            return
        check_pool(self._parts.budget, p.root, cast(ServerMetrics, metrics))
