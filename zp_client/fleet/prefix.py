"""The fleet's client-side prefix index: which replica most likely holds a request's prompt prefix in its
prefix cache.

A request's prompt is cut at message boundaries (chat, ``/responses`` input lists) or in fixed chunks of
text (``/completions``): each cut is a **prefix key**, a chained 64-bit hash of everything up to it (the
model and the tool schemas first), with the blocks that prefix fills (:func:`prefix_keys`). Two requests
that share their first messages share those keys, as vLLM's prefix cache shares their blocks.

:class:`PrefixIndex` records, per replica, the keys of the requests routed there, in an LRU sized in
blocks like the replica's pool: vLLM keeps a finished request's blocks cached in an LRU free queue,
freed tail first, and allocates from its head, so a prefix not used for a while is evicted. The index
evicts the same way: a request's keys are touched from its longest prefix to its shortest, so the
shortest (the system prompt every turn shares) is the most recent and the last to go. It is an
approximation (the server also keeps running requests' blocks, and other clients' traffic evicts what
this client cannot see), used only to prefer a replica; the budgets alone decide what fits.

Bounded: at most ``max_entries`` keys in all (the oldest of the replica being written go first).
Pure and not thread-safe: the fleet's ledger calls it under its lock.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from zp_client.errors import ConfigurationError

__all__ = ["DEFAULT_MAX_ENTRIES", "PrefixIndex", "PrefixKeys", "indexed", "prefix_keys"]

DEFAULT_MAX_ENTRIES = 100_000
"""Default bound on the index's keys, all replicas together (a key costs ~200 bytes: ~20 MB)."""

#: Text chunk of a ``/completions`` prompt (characters; ~256 tokens of English).
TEXT_CHUNK_CHARS = 1024

PrefixKeys = tuple[tuple[int, int], ...]
"""``((key, blocks), ...)`` from the shortest prefix to the longest; ``blocks`` is cumulative."""


def _bytes_of(message: object) -> bytes:
    """A message's identity as bytes: role and content for the common case (cheap), its JSON otherwise."""
    if type(message) is dict or isinstance(message, Mapping):  # dict first: isinstance(ABC) is slow
        content = message.get("content")
        if type(content) is str and len(message) <= 2:
            try:
                return f"{message.get('role', '')}\x00{content}\x1e".encode()
            except UnicodeEncodeError:  # a lone surrogate
                return f"{message.get('role', '')}\x00{content}\x1e".encode("utf-8", "surrogatepass")
    try:
        text = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(message)
    return (text + "\x1e").encode("utf-8", "surrogatepass")


_HEADS: dict[tuple[object, ...], bytes] = {}


def _head(body: Mapping[str, object]) -> bytes:
    """What every prefix of a request starts with: the model and its tool schemas (cached per identity
    of the tool list: agents send the same schemas object with every call)."""
    tools, functions = body.get("tools"), body.get("functions")
    key = (body.get("model"), id(tools), id(functions))
    hit = _HEADS.get(key)
    if hit is None or tools is not None or functions is not None:
        # a list's id can be reused after it is freed: only the no-tools head is cached blindly
        obj = {"model": body.get("model"), "tools": tools, "functions": functions}
        hit = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                         default=str).encode("utf-8", "surrogatepass")
        if tools is None and functions is None:
            if len(_HEADS) > 256:
                _HEADS.clear()
            _HEADS[key] = hit
    return hit


def _parts(body: Mapping[str, object]) -> list[bytes]:
    """The successive parts of the prompt (messages, or text chunks), as bytes."""
    messages = body.get("messages")
    if messages is None:
        messages = body.get("input")
    if isinstance(messages, list):
        return [_bytes_of(m) for m in messages]
    prompt = body.get("prompt") if "prompt" in body else messages
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return [prompt[i:i + TEXT_CHUNK_CHARS].encode("utf-8", "surrogatepass")
                for i in range(0, len(prompt), TEXT_CHUNK_CHARS)]
    return [] if prompt is None else [_bytes_of(prompt)]


def prefix_keys(body: Mapping[str, object], prompt_tokens: int, block_size: int) -> PrefixKeys:
    """The prefix keys of a request body (see the module docstring): one per message (or text chunk),
    with the full blocks the prompt up to it fills, estimated from ``prompt_tokens`` (the whole prompt's
    estimate) in proportion to its bytes. Empty for a body without a prompt.

    A key is a running CRC-32 and Adler-32 of the head and the parts so far, as one 64-bit int: both
    extend over concatenation, so the whole prompt is read once (a cryptographic hash read it at a third
    of the speed). Keys only steer routing (the budgets decide what fits), so a rare collision costs at
    most one cold prefill; they are the same in every process (the Redis fleet shares them)."""
    parts = _parts(body)
    if not parts:
        return ()
    total = sum(len(p) for p in parts) or 1
    head = _head(body)
    crc, adler = zlib.crc32(head), zlib.adler32(head)
    out: list[tuple[int, int]] = []
    size = 0
    scale = max(0, int(prompt_tokens)) / total / max(1, int(block_size))
    crc32, adler32 = zlib.crc32, zlib.adler32
    for part in parts:
        crc, adler = crc32(part, crc), adler32(part, adler)
        size += len(part)
        out.append(((crc << 32) | adler, int(size * scale)))
    return tuple(out)


def indexed(keys: Sequence[tuple[int, int]], head: int = 2, tail: int = 6) -> Sequence[tuple[int, int]]:
    """The keys a placement records in the index: the first ``head`` (a system prompt and what follows it,
    shared across conversations) and the last ``tail`` (where this conversation's next turn continues).
    Lookups read every key; recording only these bounds the index's work per request whatever the
    number of messages."""
    if len(keys) <= head + tail:
        return keys
    return (*keys[:head], *keys[-tail:])


class PrefixIndex:
    """Per replica, the prefix keys of the requests routed there (an LRU in blocks); see the module
    docstring. ``capacity`` maps a replica to its pool in blocks (what its cache can hold)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigurationError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._holders: dict[int, dict[str, None]] = {}
        self._lru: dict[str, OrderedDict[int, int]] = {}
        self._blocks: dict[str, int] = {}
        self._capacity: dict[str, int] = {}
        self._entries = 0
        self.evictions = 0

    # -- replicas ---------------------------------------------------------------------------------
    def set_capacity(self, replica: str, blocks: int) -> None:
        """Declare ``replica`` with a cache of ``blocks`` blocks (evicting at once if it shrank)."""
        self._capacity[replica] = max(1, int(blocks))
        self._lru.setdefault(replica, OrderedDict())
        self._blocks.setdefault(replica, 0)
        self._evict(replica)

    def forget(self, replica: str) -> None:
        """Drop everything recorded for ``replica`` (it left the fleet, or lost its cache: a restart)."""
        lru = self._lru.get(replica)
        if lru is None:
            return
        for key in lru:
            self._unhold(key, replica)
        self._entries -= len(lru)
        lru.clear()
        self._blocks[replica] = 0

    def remove(self, replica: str) -> None:
        self.forget(replica)
        self._lru.pop(replica, None)
        self._blocks.pop(replica, None)
        self._capacity.pop(replica, None)

    # -- lookups ----------------------------------------------------------------------------------
    def match(self, keys: Sequence[tuple[int, int]], limit: int | None = None) -> dict[str, int]:
        """Per replica holding some prefix of ``keys``: the blocks of its longest one. ``limit`` stops
        once that many replicas are found (all of them: nothing more to learn)."""
        found: dict[str, int] = {}
        holders_of = self._holders
        for key, blocks in reversed(keys):
            holders = holders_of.get(key)
            if not holders:
                continue
            for r in holders:
                if r not in found:
                    found[r] = blocks
            if limit is not None and len(found) >= limit:
                break
        return found

    def insert(self, replica: str, keys: Iterable[tuple[int, int]]) -> None:
        """Record that ``replica`` now holds these prefixes (it was just sent the request): touched from
        the longest to the shortest, then evicted down to its capacity and to ``max_entries``."""
        lru = self._lru.get(replica)
        if lru is None:
            self.set_capacity(replica, 1 << 30)
            lru = self._lru[replica]
        seq = keys if isinstance(keys, (tuple, list)) else tuple(keys)
        # What each new key adds: its blocks beyond the longest shorter prefix of this request that is
        # held (already indexed, or added just before it), so a request sharing a held prefix, even
        # below its recorded keys, counts only what it adds.
        deltas: list[int] = []
        covered = 0
        for key, blocks in seq:
            if key in lru:
                deltas.append(-1)
            else:
                deltas.append(max(0, blocks - covered))
            covered = max(covered, blocks)
        holders_of = self._holders
        added = new = 0
        for i in range(len(seq) - 1, -1, -1):  # touched longest first: the shortest is the most recent
            key = seq[i][0]
            delta = deltas[i]
            if delta < 0:
                lru.move_to_end(key)
                continue
            lru[key] = delta
            added += delta
            new += 1
            holders = holders_of.get(key)
            if holders is None:
                holders_of[key] = {replica: None}
            else:
                holders[replica] = None
        self._entries += new
        self._blocks[replica] += added
        if self._blocks[replica] > self._capacity.get(replica, 1 << 30) or self._entries > self.max_entries:
            self._evict(replica)

    def _evict(self, replica: str) -> None:
        """Down to ``replica``'s capacity (its own LRU), then to ``max_entries`` over all replicas: the
        oldest entries of whichever replica holds the most go first, so one busy replica cannot starve
        the others' share of the bound."""
        lru = self._lru[replica]
        cap = self._capacity.get(replica, 1 << 30)
        while lru and self._blocks[replica] > cap:
            self._pop_oldest(replica)
        while self._entries > self.max_entries:
            largest = max(self._lru, key=lambda r: len(self._lru[r]))
            if not self._lru[largest]:
                break
            # evict a batch from the largest (cheap: the max is not recomputed per entry)
            share = max(1, self.max_entries // max(1, len(self._lru)))
            n = min(self._entries - self.max_entries, max(1, len(self._lru[largest]) - share))
            for _ in range(n):
                self._pop_oldest(largest)

    def _pop_oldest(self, replica: str) -> None:
        key, delta = self._lru[replica].popitem(last=False)
        self._blocks[replica] -= delta
        self._entries -= 1
        self._unhold(key, replica)
        self.evictions += 1

    def _unhold(self, key: int, replica: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.pop(replica, None)
            if not holders:
                del self._holders[key]

    # -- status -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._entries

    def entries(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def blocks(self, replica: str) -> int:
        return self._blocks.get(replica, 0)
