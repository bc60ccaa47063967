"""Per-call headers cannot grow state without bound (issue 33, item 9): 10,000 distinct ``X-ZP-Priority``
values make at most 16 ``priority`` label values in the Prometheus metrics (the rest ``other``); 10,000
distinct ``X-ZP-Route`` values keep at most ``max_keys`` histograms in process (least recently used
dropped) and at most ``max_keys`` forecaster hashes in Redis, each with a TTL of at most 7 days.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests._asgi_server import LoopbackServer
from tests._redis_keys import drop_keys
from zp_client import LocalBudget, Settings, wrap
from zp_client.budget._types import BudgetStatus, ClassStatus
from zp_client.budget.redis_forecast import DEFAULT_KEY_TTL_S, RedisLengthForecaster
from zp_client.errors import ConfigurationError
from zp_client.forecast import DEFAULT_MAX_KEYS, LengthForecaster
from zp_client.metrics import MAX_PRIORITY_LABELS, OTHER_PRIORITY, ZPMetrics

N = 10_000
WEEK = 7 * 24 * 3600


def _labels(m: ZPMetrics, metric: str) -> dict[str, float]:
    """``priority`` label -> value of ``metric``'s samples (a histogram: its ``_count``)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            if s.name in (metric, metric + "_count") and "priority" in s.labels:
                out[s.labels["priority"]] = out.get(s.labels["priority"], 0.0) + s.value
    return out


# ------------------------------------------------------------------------------------------------ metrics


def test_ten_thousand_priorities_make_at_most_16_label_values() -> None:
    m = ZPMetrics()
    for p in range(N):
        m.waited(p, 0.01)
    for p in range(N):
        m.held(p, 0.5)
    for metric in ("zp_queue_wait_seconds", "zp_lease_hold_seconds"):
        got = _labels(m, metric)
        assert len(got) <= MAX_PRIORITY_LABELS == 16
        assert sum(got.values()) == N  # nothing lost: the rest is counted under "other"
        assert got[OTHER_PRIORITY] == N - (MAX_PRIORITY_LABELS - 1)
    # the first priorities seen keep their own label
    assert _labels(m, "zp_queue_wait_seconds")["0"] == 1 and _labels(m, "zp_lease_hold_seconds")["14"] == 1


class _ManyClasses:
    """A budget whose status has waiters in 10,000 priority classes (as a busy RedisBudget may report)."""

    name = "many"
    limit = 100
    _status_in_process = False  # as a RedisBudget's: its status is read as a remote one

    def status_sync(self) -> BudgetStatus:
        return BudgetStatus(limit=100, used=0, free=100, held=0, leases=0,
                            waiters={p: ClassStatus(waiters=1, weight=1) for p in range(N)})


def test_the_waiters_gauge_of_ten_thousand_classes_has_at_most_16_label_values() -> None:
    m = ZPMetrics(remote_status_ttl_s=0)
    budget = _ManyClasses()
    m.track(budget)  # type: ignore[arg-type]
    got = _labels(m, "zp_budget_waiters")
    assert len(got) <= MAX_PRIORITY_LABELS and sum(got.values()) == N


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
@pytest.mark.openai_compat
def test_priority_headers_through_wrap_are_bounded() -> None:
    m = ZPMetrics()
    b = LocalBudget(1000, name="hdr")
    with LoopbackServer() as server:
        c = wrap(openai.OpenAI(base_url=server.base_url, api_key="sk-test", timeout=30), budget=b,
                 settings=Settings(estimator="heuristic"), metrics=m)
        for p in range(20):
            c.chat.completions.create(model="ok", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      extra_headers={"X-ZP-Priority": str(1000 + p)})
    got = _labels(m, "zp_queue_wait_seconds")
    assert len(got) <= MAX_PRIORITY_LABELS and sum(got.values()) == 20 and got[OTHER_PRIORITY] == 20 - 15


# --------------------------------------------------------------------------------------------- forecaster


@pytest.mark.slow
def test_ten_thousand_routes_keep_at_most_max_keys_histograms() -> None:
    fc = LengthForecaster()
    assert DEFAULT_MAX_KEYS == 1000
    for i in range(N):
        fc.observe(f"route-{i}", 10 + i % 50)
        if i % 100 == 0:
            fc.observe("hot", 500)  # used all along: never the least recently used
    assert len(fc._hists) == DEFAULT_MAX_KEYS
    assert fc.observations("hot") == N // 100 and fc.observations(f"route-{N - 1}") == 1
    assert fc.observations("route-0") == 0  # dropped: starts again from its prior
    assert fc.forecast("route-0", max_tokens=4096) == LengthForecaster().forecast("x", max_tokens=4096)


def test_max_keys_is_checked() -> None:
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(ConfigurationError, match="max_keys"):
            LengthForecaster(max_keys=bad)  # type: ignore[arg-type]
    small = LengthForecaster(max_keys=2)
    for k in ("a", "b", "a", "c"):  # "a" was used after "b": "b" goes
        small.observe(k, 5)
    assert sorted(small._hists) == ["a", "c"]


# ------------------------------------------------------------------------------------ the Redis forecaster


@pytest.fixture
def fc_redis(redis_url: str, redis_prefix: str) -> Iterator[tuple[redis.Redis, str]]:
    r = redis.Redis.from_url(redis_url)
    yield r, redis_prefix
    drop_keys(r, redis_prefix)
    r.close()


def _fc_keys(r: redis.Redis, name: str) -> list[bytes]:
    return list(r.scan_iter(match=f"{{zp:{name}}}:fc:*", count=5000))


@pytest.mark.redis
@pytest.mark.slow
def test_ten_thousand_routes_make_at_most_max_keys_redis_hashes_each_with_a_ttl(
        fc_redis: tuple[redis.Redis, str]) -> None:
    r, name = fc_redis
    fc = RedisLengthForecaster(r, name, sync_interval_s=3600, batch=10 * N)
    try:
        for i in range(N):
            fc.observe(f"route-{i}", 10 + i % 50)
        assert len(fc._hists) <= DEFAULT_MAX_KEYS
        fc.sync()
        keys = _fc_keys(r, name)
        assert 0 < len(keys) <= DEFAULT_MAX_KEYS
        assert r.scard(f"{{zp:{name}}}:fckeys") <= DEFAULT_MAX_KEYS
        pipe = r.pipeline(transaction=False)
        for k in keys:
            pipe.ttl(k)
        ttls = pipe.execute()
        assert all(0 < t <= WEEK for t in ttls), sorted(set(ttls))[:5]
        assert 0 < r.ttl(f"{{zp:{name}}}:fckeys") <= WEEK
        assert DEFAULT_KEY_TTL_S == WEEK
    finally:
        fc.close()


@pytest.mark.redis
def test_a_write_refreshes_the_ttl_and_an_expired_key_frees_its_place(
        fc_redis: tuple[redis.Redis, str]) -> None:
    r, name = fc_redis
    fc = RedisLengthForecaster(r, name, sync_interval_s=3600, max_keys=2, key_ttl_s=1000)
    try:
        fc.observe("a", 5)
        fc.observe("b", 7)
        fc.sync()
        ha, hb, hc = (f"{{zp:{name}}}:fc:{k}" for k in "abc")
        r.expire(ha, 10)
        fc.observe("a", 6)
        fc.sync()
        assert 10 < r.ttl(ha) <= 1000  # refreshed on write
        fc.observe("c", 9)  # the set is full: "c" stays local, nothing written for it
        fc.sync()
        assert not r.exists(hc)
        r.delete(hb)  # as if "b" had expired: its place is free again
        fc.observe("c", 9)
        fc.sync()
        assert r.exists(hc) and 0 < r.ttl(hc) <= 1000
        assert sorted(r.smembers(f"{{zp:{name}}}:fckeys")) == [b"a", b"c"]
    finally:
        fc.close()


@pytest.mark.redis
def test_key_ttl_s_is_checked(fc_redis: tuple[redis.Redis, str]) -> None:
    r, name = fc_redis
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigurationError, match="key_ttl_s"):
            RedisLengthForecaster(r, name, key_ttl_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_keys", [50, None])
@pytest.mark.slow
def test_the_process_local_fallback_of_shared_forecaster_keeps_max_keys(max_keys: int | None) -> None:
    """A RedisBudget given only an async client forecasts from this process (shared_forecaster's
    fallback): that forecaster took q/prior/half_life/priors only, so max_keys was dropped. It keeps the
    given bound (and the default one): 10,000 distinct routes never hold more."""
    import redis.asyncio as redis_async

    from zp_client import RedisBudget

    b = RedisBudget(redis_async.Redis(), "zptest-never-used", 100, policy="elastic")  # connects to nothing
    kw = {} if max_keys is None else {"max_keys": max_keys}
    fc = b.shared_forecaster(sync_interval_s=5, **kw)
    assert type(fc) is LengthForecaster  # the fallback, not the Redis one
    bound = DEFAULT_MAX_KEYS if max_keys is None else max_keys
    most = 0
    for i in range(N):
        fc.observe(f"route-{i}", 10)
        most = max(most, len(fc._hists))
    assert most == bound
