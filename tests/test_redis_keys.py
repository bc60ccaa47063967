"""The Redis tests' key cleanup (tests/_redis_keys.py) deletes the keys of the names it is given and no
other key: not a budget whose name only starts with the same text, not a key outside the hash tag."""

from __future__ import annotations

import pytest
import redis

from tests._redis_keys import delete_keys, delete_keys_containing, drop_keys

pytestmark = pytest.mark.redis


def _present(r: redis.Redis, keys: list[str]) -> list[str]:
    return [k for k in keys if r.exists(k)]


def test_only_the_named_budgets_keys_go(redis_url: str, redis_prefix: str) -> None:
    a, b = f"{redis_prefix}-a", f"{redis_prefix}-b"
    theirs = [f"{{zp:{a}}}:limit", f"{{zp:{a}}}:leases", f"{{zp:{b}}}:limit"]
    others = [f"{{zp:{a}-1}}:limit", f"{{zp:{redis_prefix}}}:limit", f"{a}:plain", f"x{{zp:{a}}}:limit"]
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for k in theirs + others:
            r.set(k, "1", ex=60)
        delete_keys(redis_url, a, b)
        assert _present(r, theirs) == [] and _present(r, others) == others
        delete_keys(redis_url)  # no names: nothing goes
        assert _present(r, others) == others
        drop_keys(r, f"{a}-1")  # through an open client, which stays open
        assert _present(r, others) == others[1:] and r.ping()
        delete_keys_containing(redis_url, a)
        assert _present(r, others) == [f"{{zp:{redis_prefix}}}:limit"]
    finally:
        r.delete(*theirs, *others)
        r.close()
