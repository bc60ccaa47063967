"""Pinned prefixes: the bookkeeping that keeps a prefix warm in vLLM's prefix cache (sans-I/O).

vLLM has no pinning. A finished request's blocks go to the tail of the free queue (its last block first,
so its first blocks, the shared prefix, are the last to be evicted) and every allocation takes the queue's
head. A prefix released when the server had ``F`` free blocks (its own included) therefore survives as
long as fewer than ``F - P`` blocks are allocated after it (``P``: its blocks); a request that touches it
(a cache hit) takes it out of the queue until that request ends, and its end puts it at the tail again.

A budget that admits every request of a server knows, conservatively, how many blocks that server has
allocated: every admitted lease's prompt blocks (less a pinned prefix it shares) and every block of
growth it reports. :class:`PinBook` keeps that count (``charged``) and, per pinned prefix, the count and
the free blocks at its last release. Its **line** is ``F - P - margin`` blocks charged since then:

* a keep-warm request (the prefix plus a token, so nothing of the prefix is recomputed) is *due* once
  the blocks charged since the release reach ``line - margin``;
* a waiter whose admission would push the charged count past the line *waits* (the ledger treats it as
  not fitting) until a request using the prefix has its first token: the prefix is then in use, so no
  allocation can evict it, and its release starts a new count.

Assumptions: every request to the server is admitted by this budget (bypass traffic allocates blocks
nobody counts) and growth is reported in time (a client reading a stream late reports growth late); the
margin absorbs some of both. The count overestimates allocation (a prompt's cache hits on other free
blocks are counted as allocations), which only makes keep-warms earlier. See docs/pinning.md.

:class:`PinBook` is driven by :class:`~zp_client.budget.ledger.Ledger`, which calls its hooks on every
admission, growth report, first token and release.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from zp_client.errors import ConfigurationError, PinRefused

__all__ = [
    "DEFAULT_PIN_CAP_FRACTION",
    "DEFAULT_PIN_GATE_TIMEOUT_S",
    "DEFAULT_PIN_MARGIN_FRACTION",
    "PIN_LEASE_PREFIX",
    "PinBook",
    "PinRecord",
    "pin_lease_id",
]

DEFAULT_PIN_CAP_FRACTION = 0.20
"""Pinned blocks may take at most this share of the limit (vLLM's closed pin-prefix PR proposed 20%)."""

DEFAULT_PIN_MARGIN_FRACTION = 0.02
"""Default margin of a pin's line, as a share of the limit (at least 16 blocks and a quarter of the
prefix's): what may be allocated between a keep-warm's dispatch and its first token, growth reported
late, and the estimator's error on the prefix's length (the sim's tokenizer is within 0.8-1.25x of
cl100k)."""

DEFAULT_PIN_GATE_TIMEOUT_S = 10.0
"""How long waiters are held back for a keep-warm's first token before the pin stops holding them (a
keep-warm that never comes must not stop the line: the prefix then goes cold, and the next release
starts a new count)."""

PIN_LEASE_PREFIX = "pin:"
"""The id of a pin's lease in its ledger is this plus the prefix key."""


def pin_lease_id(key: str) -> str:
    """The ledger lease id of the pin of ``key``."""
    return PIN_LEASE_PREFIX + key


@dataclass(slots=True)
class PinRecord:
    """One pinned prefix. Read-only for callers; the :class:`PinBook` owns it."""

    key: str
    blocks: int
    margin: int
    pinned_at: float
    span: int = 0
    """The prefix's blocks on the server, an upper bound (``blocks`` is a lower one: what is shared);
    the line counts from it."""
    mark: int = 0
    """The book's ``charged`` at the prefix's last release (or at the pin)."""
    free_at_release: int | None = None
    """The server's free blocks at that release; None until a request using the prefix has finished
    (the prefix is not known to be cached yet, and no keep-warm is due: its first use warms it)."""
    warming: set[str] = field(default_factory=set)
    """Live leases using the prefix, admitted, first token not seen yet."""
    in_use: set[str] = field(default_factory=set)
    """Live leases using the prefix past their first token: the prefix is referenced, not evictable."""
    claimed_until: float | None = None
    """A keep-warm was claimed (:meth:`PinBook.claim`) and is on its way until then."""
    gated_since: float | None = None
    """When a waiter was first held back for this prefix's keep-warm (None: none is)."""
    keepwarms: int = 0
    """Keep-warms claimed so far."""
    track: bool = True
    """False: the blocks are held and shared, but no keep-warm is ever due and nobody is held back (a
    caller that keeps the prefix warm its own way, e.g. on a timer)."""

    def line(self) -> int | None:
        """Blocks that may be charged after the last release before the prefix may be evicted, less the
        margin; None before the first release."""
        if self.free_at_release is None:
            return None
        return self.free_at_release - max(self.blocks, self.span) - self.margin

    def as_dict(self, charged: int) -> dict[str, object]:
        line = self.line()
        return {"key": self.key, "blocks": self.blocks, "span": self.span, "margin": self.margin,
                "charged_since_release": charged - self.mark, "line": line,
                "in_use": len(self.in_use), "warming": len(self.warming), "keepwarms": self.keepwarms}


class PinBook:
    """The pins of one server's ledger and the blocks charged on that server (see the module docstring).

    ``cap_fraction``: pinned blocks may total at most this share of the ledger's limit."""

    def __init__(self, *, cap_fraction: float = DEFAULT_PIN_CAP_FRACTION,
                 gate_timeout_s: float = DEFAULT_PIN_GATE_TIMEOUT_S, server_blocks: int | None = None,
                 margin_fraction: float = DEFAULT_PIN_MARGIN_FRACTION) -> None:
        if not isinstance(cap_fraction, (int, float)) or not 0 <= cap_fraction <= 1:
            raise ConfigurationError(
                f"cap_fraction must be a share of the limit in [0, 1], got {cap_fraction!r}")
        if not isinstance(gate_timeout_s, (int, float)) or not gate_timeout_s > 0:
            raise ConfigurationError(f"gate_timeout_s must be seconds > 0, got {gate_timeout_s!r}")
        if server_blocks is not None and (
                isinstance(server_blocks, bool) or not isinstance(server_blocks, int) or server_blocks < 1):
            raise ConfigurationError(f"server_blocks must be a number of blocks >= 1, got {server_blocks!r}")
        if not isinstance(margin_fraction, (int, float)) or not 0 <= margin_fraction < 1:
            raise ConfigurationError(f"margin_fraction must be a share in [0, 1), got {margin_fraction!r}")
        self.cap_fraction = float(cap_fraction)
        self.gate_timeout_s = float(gate_timeout_s)
        self.server_blocks = server_blocks
        """The server's usable pool (``num_gpu_blocks - 1``), where its free blocks are counted from;
        None: the ledger's limit (smaller, so conservative: keep-warms come earlier)."""
        self.margin_fraction = float(margin_fraction)
        self.charged = 0
        """Blocks charged on the server since the book began: admissions' new blocks and growth."""
        self._pins: dict[str, PinRecord] = {}
        self._member_of: dict[str, str] = {}  # lease id -> prefix key
        self._shares: dict[str, int] = {}  # lease id -> blocks of its prompt its pin covers (at admission)
        self.member_shares = 0
        """Sum of the live members' shares: what they hold that the pin holds too."""

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[PinRecord]:
        return iter(self._pins.values())

    def __contains__(self, key: object) -> bool:
        return key in self._pins

    def get(self, key: str) -> PinRecord | None:
        return self._pins.get(key)

    @property
    def pinned_blocks(self) -> int:
        return sum(p.blocks for p in self._pins.values())

    def idle_blocks(self) -> int:
        """Blocks of pinned prefixes no live request references: held by the budget, free (cached) on
        the server."""
        return sum(p.blocks for p in self._pins.values() if not p.in_use and not p.warming)

    def cap(self, limit: int) -> int:
        return int(self.cap_fraction * limit)

    # ------------------------------------------------------------------ pin / unpin
    def add(self, key: str, blocks: int, limit: int, now: float, *, margin: int | None = None,
            track: bool = True, span: int | None = None) -> PinRecord:
        """Pin ``key`` for ``blocks``; idempotent for the same size. Raises :class:`PinRefused` past the
        cap, :class:`ConfigurationError` for bad arguments or another size of a pinned key."""
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"a prefix key must be a non-empty string, got {key!r}")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise ConfigurationError(f"a pinned prefix must be at least one full block, got {blocks!r}")
        if margin is None:
            # a quarter of the prefix too: the estimator's count of its tokens may be that far off
            margin = max(16, int(self.margin_fraction * limit), blocks // 4)
        elif isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ConfigurationError(f"margin must be a number of blocks >= 0, got {margin!r}")
        if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < blocks):
            raise ConfigurationError(f"span must be a number of blocks >= blocks ({blocks}), got {span!r}")
        old = self._pins.get(key)
        if old is not None:
            if old.blocks != blocks:
                raise ConfigurationError(
                    f"prefix {key!r} is already pinned with {old.blocks} blocks, not {blocks}; "
                    "unpin it first")
            return old
        cap = self.cap(limit)
        if self.pinned_blocks + blocks > cap:
            raise PinRefused(blocks, self.pinned_blocks, cap)
        rec = PinRecord(key=key, blocks=blocks, margin=margin, pinned_at=now, mark=self.charged,
                        track=bool(track), span=blocks if span is None else span)
        self._pins[key] = rec
        return rec

    def remove(self, key: str) -> PinRecord | None:
        """Drop the pin of ``key``. Its live members keep their share in :attr:`member_shares` until
        they end (they hold those blocks; the Redis port counts them so too)."""
        return self._pins.pop(key, None)

    # ------------------------------------------------------------------ ledger hooks
    def shared_blocks(self, meta: Mapping[str, object], held: int) -> int:
        """Blocks of a lease's prompt a pinned prefix covers (not allocated again by the server)."""
        rec = self._pin_of(meta)
        if rec is None or meta.get("pinned"):
            return 0
        prefix_blocks = meta.get("prefix_blocks", rec.blocks)
        if not isinstance(prefix_blocks, (int, float, str)):  # set by the transport: an int
            prefix_blocks = rec.blocks
        return max(0, min(rec.blocks, int(prefix_blocks), held))

    def _pin_of(self, meta: Mapping[str, object]) -> PinRecord | None:
        key = meta.get("prefix_key")
        return self._pins.get(key) if isinstance(key, str) else None

    def admitted(self, lease_id: str, held: int, meta: Mapping[str, object]) -> None:
        """A lease was admitted holding ``held`` blocks."""
        if meta.get("pinned"):
            return
        share = self.shared_blocks(meta, held)
        self.charged += max(0, held - share)
        rec = self._pin_of(meta)
        if rec is not None:
            self._member_of[lease_id] = rec.key
            self._shares[lease_id] = share
            self.member_shares += share
            (rec.in_use if meta.get("first_token") else rec.warming).add(lease_id)

    def is_member(self, lease_id: str) -> bool:
        """Whether ``lease_id`` was admitted sharing a pinned prefix (and has not been released)."""
        return lease_id in self._member_of

    def grew(self, delta: int) -> None:
        """A lease's held blocks changed by ``delta``: growth, or (negative) the server's exact prompt
        count replacing a larger estimate, which was charged at admission but never allocated."""
        self.charged += delta

    def first_token(self, lease_id: str) -> None:
        key = self._member_of.get(lease_id)
        rec = self._pins.get(key) if key is not None else None
        if rec is not None and lease_id in rec.warming:
            rec.warming.discard(lease_id)
            rec.in_use.add(lease_id)
            rec.claimed_until = None
            rec.gated_since = None

    def released(self, lease_id: str, server_free: Callable[[], int]) -> None:
        """A lease ended; ``server_free()``: the server's free blocks after it (the caller's estimate,
        read once this book has taken the lease out)."""
        key = self._member_of.pop(lease_id, None)
        self.member_shares -= self._shares.pop(lease_id, 0)
        rec = self._pins.get(key) if key is not None else None
        if rec is None:
            return
        was_in_use = lease_id in rec.in_use
        rec.in_use.discard(lease_id)
        rec.warming.discard(lease_id)
        if was_in_use and not rec.in_use:
            # The prefix went back to the free queue's tail: a new count starts.
            rec.mark = self.charged
            rec.free_at_release = max(0, server_free())
            rec.gated_since = None

    # ------------------------------------------------------------------ admission
    def holds_back(self, meta: Mapping[str, object], held: int, now: float) -> bool:
        """Whether a waiter (prompt ``held`` blocks, ``meta``) must wait for a keep-warm's first token:
        its admission would push the blocks charged since some idle prefix's release past its line."""
        if not self._pins:
            return False
        own = meta.get("prefix_key")
        charge = max(0, held - self.shared_blocks(meta, held))
        held_back = False
        for rec in self._pins.values():  # all of them: every pin it would cross is marked gated
            if rec.key == own or rec.in_use or not rec.track:
                continue
            line = rec.line()
            since = self.charged - rec.mark
            if line is None or since == 0 or since + charge <= line:
                continue
            if rec.gated_since is None:
                rec.gated_since = now
            if now - rec.gated_since < self.gate_timeout_s:
                held_back = True
        return held_back

    def due(self, now: float) -> list[str]:
        """Keys whose keep-warm is due now and not claimed: no request references the prefix nor is on
        its way to, and the blocks charged since its release reached ``line - margin`` (or a waiter is
        held back for it). A prefix no request has used yet is not due: its first use warms it."""
        out: list[str] = []
        for rec in self._pins.values():
            if rec.in_use or rec.warming or not rec.track:
                continue
            if rec.claimed_until is not None and rec.claimed_until > now:
                continue
            line = rec.line()
            if line is None:
                continue  # never used yet: its first use warms it (a keep-warm would be a cold prefill)
            if rec.gated_since is not None or self.charged - rec.mark >= line - rec.margin:
                out.append(rec.key)
        return out

    def claim(self, key: str, now: float, ttl_s: float) -> bool:
        """Claim the keep-warm of ``key`` for ``ttl_s`` seconds (one sender per prefix). False when it is
        not pinned, not due, or already claimed."""
        if key not in self.due(now):
            return False
        rec = self._pins[key]
        rec.claimed_until = now + ttl_s
        rec.keepwarms += 1
        return True

    def status(self) -> list[dict[str, object]]:
        return [rec.as_dict(self.charged) for rec in self._pins.values()]

