"""Issue 30 (found in review): a process still on the scripts before ``fh`` (a7b8101) reads the projection
mirror a new process wrote. changes.md says such a reader only loses prefix keys and counts shared prefixes
in full (conservative); for a pinned prefix's lease ("*key") it lost the pin marker too, projected the pin
with remaining 0 (held only at instant 0) and over-admitted beside it, until the mirror wrote fh only for a
lease that has one."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from zp_client.budget.redis import RedisBudget

OLD = "a7b8101"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis.asyncio


def _old_acquire() -> str:
    try:
        parts = [subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD}:zp_client/budget/redis/lua/{n}"],
                                check=True, capture_output=True, text=True).stdout
                 for n in ("common.lua", "acquire.lua")]
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git history with {OLD} not available")
    return parts[0] + "\n" + parts[1]


@pytest.mark.anyio
async def test_an_old_process_does_not_over_admit_beside_a_new_pin(redis_url: str) -> None:
    import redis as redis_sync

    old = _old_acquire()
    name = f"zp-test-mirror-{uuid.uuid4().hex[:8]}"
    b = RedisBudget(redis_url, name, 100, 16, policy="elastic", recovery_s=0, reserve_z=0, reserve_k=0)
    r: Any = redis_sync.Redis.from_url(redis_url)
    try:
        await b.pin("P", 20)  # 20 blocks held for as long as pinned
        # bound 90, one prompt block, forecast to 90 blocks: 20 + 91 > 100 at its end
        meta = json.dumps({"pt": 16, "ft": 1424, "st": 1, "mo": 1424})
        rep = r.eval(old, 1, f"{{zp:{name}}}:meta", uuid.uuid4().hex, 90, 1, 0, -1, 30000, "mbx", "own",
                     30000, meta)
        used = (await b.status()).used
        assert rep[0] == b"W", f"the old script admitted it: projected {used} of 100"
    finally:
        await b.aclose()
        for k in r.scan_iter(f"{{zp:{name}}}*"):
            r.delete(k)
