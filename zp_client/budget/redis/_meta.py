"""The compact lease metadata Redis stores (``lua/common.lua``'s header) and reply decoding, shared by the
scripts' arguments (``_script``) and the snapshot's reading back (``_snapshot``)."""

from __future__ import annotations

from typing import Any

# Lease metadata the elastic policy reads (zp_client.budget.elastic), stored compactly in Redis.
META_KEYS = {
    "prompt_tokens": "pt", "tokens": "tk", "forecast_tokens": "ft", "streaming": "st",
    "prefix_key": "pk", "prefix_blocks": "pb", "first_token": "f1", "max_output_tokens": "mo",
    "forecast_hi": "fh",
}
#: The compact keys that are flags (stored as 1 / 0).
META_FLAGS = frozenset(("st", "f1"))
SHORT_KEYS = frozenset(META_KEYS.values())
#: compact key -> the policy's key
LONG_KEYS = {short: long for long, short in META_KEYS.items()}


def text(v: Any) -> str:
    """A Redis reply value as text."""
    return v.decode() if isinstance(v, bytes) else str(v)
