"""The Redis tests' key cleanup: delete the keys a test made, and nothing else.

Every Redis test works under its own name (``redis_prefix``, or names derived from it): a budget or fleet
named ``N`` keeps all its keys under the hash tag ``{zp:N}``, so ``{zp:N}*`` matches them and no other
budget's (the tag's closing brace ends the name: ``{zp:N}*`` does not match ``{zp:N-1}...``). The tests
share db 0 with each other and with whatever else uses the server, so they never flush: they delete the
keys they made by name.

redis is imported when a function runs, so a test module that imports this one needs redis only when
it deletes something.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis


def delete_matching(r: redis.Redis, pattern: str) -> None:
    """Delete every key that matches the SCAN ``pattern``, through an open client."""
    keys = list(r.scan_iter(match=pattern, count=1000))
    if keys:
        r.delete(*keys)


def drop_keys(r: redis.Redis, *names: str) -> None:
    """Delete every key of the named budgets / fleets (``{zp:<name>}*``), through an open client."""
    for name in names:
        delete_matching(r, f"{{zp:{name}}}*")


@contextlib.contextmanager
def _client(url: str) -> Iterator[redis.Redis]:
    import redis

    r = redis.Redis.from_url(url)
    try:
        yield r
    finally:
        r.close()


def delete_keys(url: str, *names: str) -> None:
    """Delete every key of the named budgets / fleets (``{zp:<name>}*``) on the Redis at ``url``."""
    with _client(url) as r:
        drop_keys(r, *names)


def delete_keys_containing(url: str, text: str) -> None:
    """Delete every key whose name contains ``text`` (``*<text>*``) on the Redis at ``url``: for tests whose
    keys are not all a budget's (their own counters) or whose names are derived from ``text``."""
    with _client(url) as r:
        delete_matching(r, f"*{text}*")
