"""Pinned prefixes kept warm in vLLM's prefix cache, with no server patch.

vLLM evicts a cached prefix that nobody used for a while even when its pool has room: freed blocks queue
up in LRU order and every allocation takes the oldest. A budget that admits every request of the server
knows how many blocks were allocated since the prefix was last released, so it knows when the prefix is
about to reach the head of that queue (:mod:`zp_client.budget.pins`). :class:`PinnedPrefix` pins a
prefix on the budget (its blocks held once, requests sharing it not charged for it again) and sends a
**keep-warm** exactly when the budget says one is due: the prefix plus a one-token user turn, one output
token, streamed, so vLLM hits every full block of the prefix, computes a dozen tokens and puts the prefix
back at the tail of its queue. One keep-warm per prefix at a time, across every sender on the budget.

Example::

    client = zp_client.wrap(openai.AsyncOpenAI(base_url=url), budget)
    async with zp_client.PinnedPrefix(client, model="m", messages=[system], tools=tools) as pin:
        ...  # calls whose leading system messages and tools are `system` and `tools` stay warm

Needs an elastic budget that supports pins (``LocalBudget``). See docs/pinning.md for the assumptions
(every request to the server is admitted; growth is reported in time) and what breaks them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from zp_client._admission.plan import PRIORITY_HEADER
from zp_client._private import http_transport, sdk_http_client
from zp_client._tasks import Supervisor, wait_event
from zp_client.errors import ConfigurationError

__all__ = ["KEEPWARM_PRIORITY", "KEEPWARM_REQUEST_PREFIX", "PinnedPrefix"]

logger = logging.getLogger("zp_client.pinning")

KEEPWARM_PRIORITY = -100
"""Keep-warms go ahead of every request class (lower = more urgent): they are tiny and others wait on
them."""

KEEPWARM_REQUEST_PREFIX = "zp-keepwarm-"
"""Every keep-warm's ``X-Request-Id`` starts with this (what a benchmark excludes from workload
figures)."""

#: The keep-warm's user turn: one short word after the prefix.
KEEPWARM_TEXT = "ok"

_serial = itertools.count(1)


def _core_of(client: object) -> Any:
    """The admission core behind a zp front end (``AsyncClient``, or an openai client from ``wrap``)."""
    http = getattr(client, "_http", None)
    if http is None:
        try:
            http = sdk_http_client(client)
        except ConfigurationError:
            http = None
    transport = http_transport(http) if http is not None else None
    core = getattr(transport, "core", None)
    if core is None or not hasattr(core, "estimator"):
        raise ConfigurationError(
            f"PinnedPrefix needs a zp-admitted async client (zp_client.AsyncClient or "
            f"zp_client.wrap(openai.AsyncOpenAI(...), budget)), got {type(client).__name__}")
    return core


class PinnedPrefix:
    """A prefix pinned on a zp client's budget and kept warm on its server (see the module docstring).

    ``client``: a zp-admitted async client (``AsyncClient`` or a wrapped ``openai.AsyncOpenAI``); the
    keep-warms go through it, admitted like any call. ``messages``: the leading system (or developer)
    messages every call shares, ``tools`` their tool schemas; the prefix key and its full blocks are the
    ones zp computes for each such call's lease, so those calls are charged without it. ``margin``:
    blocks between the charged count and the prefix's eviction (default: the budget's, 2% of its
    limit). ``poll_s``: how often the sender asks a budget that does not notify (a budget that does
    wakes it at once). ``period_s``: instead, a keep-warm every ``period_s`` seconds whatever the
    budget says, the first one a period after the start (a baseline: the budget then holds and shares
    the blocks but tracks nothing). Use ``async with`` (or :meth:`start` / :meth:`aclose`):
    leaving unpins it.
    """

    def __init__(self, client: Any, *, model: str, messages: Sequence[Mapping[str, object]],
                 tools: Sequence[Mapping[str, object]] | None = None, margin: int | None = None,
                 priority: int = KEEPWARM_PRIORITY, poll_s: float = 1.0,
                 claim_ttl_s: float = 10.0, period_s: float | None = None) -> None:
        if not messages or any(not isinstance(m, Mapping) or m.get("role") not in ("system", "developer")
                               for m in messages):
            raise ConfigurationError(
                "a pinned prefix is the leading system/developer messages of a call (and its tools); "
                f"got {[m.get('role') if isinstance(m, Mapping) else type(m).__name__ for m in messages]}")
        if not isinstance(poll_s, (int, float)) or poll_s <= 0:
            raise ConfigurationError(f"poll_s must be seconds > 0, got {poll_s!r}")
        if period_s is not None and (not isinstance(period_s, (int, float)) or period_s <= 0):
            raise ConfigurationError(f"period_s must be seconds > 0 or None, got {period_s!r}")
        self.period_s = None if period_s is None else float(period_s)
        self.client = client
        self.model = model
        self.messages = [dict(m) for m in messages]
        self.tools = [dict(t) for t in tools] if tools else None
        self.margin = margin
        self.priority = priority
        self.poll_s = float(poll_s)
        self.claim_ttl_s = float(claim_ttl_s)
        core = _core_of(client)
        self.budget = core.budget
        if not self.budget.supports_pins:
            raise ConfigurationError(f"{type(self.budget).__name__} does not support pinned prefixes")
        if self.budget.policy_name != "elastic":
            raise ConfigurationError(
                "pinned prefixes need an elastic budget (policy='elastic'): only it shares a prefix's "
                "blocks between leases and sees the first tokens that keep the prefix warm")
        body: dict[str, object] = {"model": model, "messages": self.messages}
        if self.tools:
            body["tools"] = self.tools
        est = core.estimator.estimate("/v1/chat/completions", body)
        key, blocks = core.shared_prefix(est)
        if key is None:
            raise ConfigurationError("the prefix is shorter than one KV block: nothing to pin")
        self.key: str = key
        self.blocks: int = blocks
        """The prefix's full blocks from the estimate's lower bound: what calls sharing it are not charged."""
        # and from its upper bound: where the prefix may reach on the server, what the keep-warm rule needs
        hi = int(core.estimator.reserve_tokens(est))
        self.span: int = max(blocks, -(-int(est.prefix_tokens) * hi // max(1, int(est.tokens))
                                       // self.budget.block_size))
        self.keepwarms_sent = 0
        self.keepwarm_errors = 0
        self._task: asyncio.Task[object] | None = None
        self._sup: Supervisor | None = None  # owns the keep-warm task while started (zp_client/_tasks.py)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> PinnedPrefix:
        """Pin the prefix and start the keep-warm sender (keep-warms begin after the prefix's first use:
        that call prefills it). Raises :class:`~zp_client.errors.PinRefused` past the
        budget's pin cap."""
        if self._task is not None:
            return self
        await self.budget.pin(self.key, self.blocks, margin=self.margin, track=self.period_s is None,
                              span=self.span)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if self.period_s is None:
            self.budget.add_keepwarm_listener(self._nudge)
            run = self._run()
        else:
            run = self._run_timer(self.period_s)
        self._sup = Supervisor(f"keep-warm {self.key[:8]}")  # one per start: a pin may start again
        self._task = self._sup.spawn(run, name=f"zp-keepwarm-{self.key[:8]}")
        self.budget._attach(self._close_with_budget)  # the budget's aclose() stops it first
        return self

    async def aclose(self) -> None:
        """Stop sending keep-warms and unpin (idempotent)."""
        task, self._task = self._task, None
        sup, self._sup = self._sup, None
        if task is None or sup is None:
            return
        self.budget._detach(self._close_with_budget)
        self.budget.remove_keepwarm_listener(self._nudge)
        await sup.aclose()  # the sender, cancelled (a keep-warm in flight with it) and awaited
        await self.budget.unpin(self.key)

    async def _close_with_budget(self) -> None:
        """Its budget is closing: stop sending and unpin (as :meth:`aclose`) when on the loop it runs on."""
        if self._loop is asyncio.get_running_loop():
            await self.aclose()

    async def __aenter__(self) -> PinnedPrefix:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ the sender
    def _nudge(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                due = await self.budget.keepwarm_due()
                if self.key in due and await self.budget.claim_keepwarm(self.key, self.claim_ttl_s):
                    await self.keep_warm()
                    continue  # the keep-warm's own end may make the next one due: ask again
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed keep-warm must not stop the pin
                self.keepwarm_errors += 1
                logger.warning("keep-warm of prefix %s failed", self.key[:12], exc_info=True)
            self._wake.clear()
            await wait_event(self._wake, self.poll_s)

    async def _run_timer(self, period: float) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time() + period
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            try:
                await self.keep_warm()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one failed keep-warm must not stop the pin
                self.keepwarm_errors += 1
                logger.warning("keep-warm of prefix %s failed", self.key[:12], exc_info=True)
            next_at += period

    async def keep_warm(self) -> None:
        """Send one keep-warm now (admitted like any call; the sender calls it when one is due)."""
        self.keepwarms_sent += 1
        params: dict[str, object] = {}
        if self.tools:
            params["tools"] = self.tools
        rid = f"{KEEPWARM_REQUEST_PREFIX}{self.key[:12]}-{next(_serial)}"
        stream = await self.client.chat.completions.create(
            model=self.model, messages=[*self.messages, {"role": "user", "content": KEEPWARM_TEXT}],
            max_tokens=1, stream=True,
            extra_headers={PRIORITY_HEADER: str(self.priority), "X-Request-Id": rid}, **params)
        async for _ in stream:
            pass

    def __repr__(self) -> str:
        return (f"PinnedPrefix(key={self.key[:12]}..., blocks={self.blocks}, "
                f"keepwarms_sent={self.keepwarms_sent}, running={self._task is not None})")
