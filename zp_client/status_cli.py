"""``zp-client status``: what a server's KV pool and a shared budget look like right now.

    zp-client status --server http://127.0.0.1:8000/v1 [--headroom 0.9]
    zp-client status --redis redis://127.0.0.1:6379/0 --name NAME [--json]
    zp-client status ... --watch [--interval S]     (a live view until Ctrl-C; needs rich, the bench extra)

Strictly read-only. What it prints and its exit statuses: see docs/admission.md#zp-client-status.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, TypeVar

from zp_client.clock import SYSTEM_CLOCK
from zp_client.errors import BudgetUnavailable, ZPError

if TYPE_CHECKING:
    from zp_client.budget.base import BudgetStatus
    from zp_client.budget.local import LocalBudget

__all__ = ["add_arguments", "run", "server_status", "budget_status", "local_budget_status", "read_status",
           "format_status", "watch"]

logger = logging.getLogger("zp_client.status_cli")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``status`` options to ``parser``."""
    parser.add_argument("--server", metavar="URL",
                        help="the server's base URL (http://host:8000/v1 or http://host:8000); "
                        "reads /metrics")
    parser.add_argument("--headroom", type=float, default=None,
                        help="fraction of the usable KV pool to suggest as limit_blocks (default: the "
                             "elastic policy's, zp_client.server.ELASTIC_HEADROOM = 1.0; lower when clients "
                             "outside zp share the server)")
    parser.add_argument("--redis", metavar="URL", help="Redis URL of a shared budget (redis://host:6379/0)")
    parser.add_argument("--name", help="the RedisBudget's name (with --redis)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for the server / Redis before giving up (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--watch", action="store_true",
                        help="a live view, read again every --interval seconds until Ctrl-C (needs rich: "
                             "the bench extra)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between two reads with --watch (default 1)")
    # how many reads --watch makes before it stops (tests, scripts); default: until Ctrl-C
    parser.add_argument("--count", type=int, default=None, help=argparse.SUPPRESS)


def server_status(url: str, headroom: float | None = None, timeout: float = 5.0) -> dict[str, object]:
    """Read ``url``'s ``/metrics`` and summarise its KV pool. Raises a ZPError subclass on failure.
    ``headroom`` None: the elastic policy's default (:data:`~zp_client.server.ELASTIC_HEADROOM`)."""
    import httpx

    from zp_client.server import ELASTIC_HEADROOM, ServerInfo, resolve_url, suggest_limit_blocks

    if headroom is None:
        headroom = ELASTIC_HEADROOM

    base = url.rstrip("/")

    def fetch(method: str, path: str, body: object) -> tuple[int, bytes]:
        resp = httpx.request(method, resolve_url(base, path), json=body, timeout=timeout)
        return resp.status_code, resp.content

    m = ServerInfo(fetch_sync=fetch).metrics_sync()
    out: dict[str, object] = {
        "url": base,
        "num_gpu_blocks": m.num_gpu_blocks,
        "block_size": m.block_size,
        "usable_blocks": m.num_gpu_blocks - 1 if m.num_gpu_blocks else None,
        "kv_cache_usage": m.kv_cache_usage_perc,
        "num_requests_running": _int_or_none(m.num_requests_running),
        "num_requests_waiting": _int_or_none(m.num_requests_waiting),
        "num_preemptions_total": _int_or_none(m.num_preemptions_total),
        "headroom": headroom,
        "suggested_limit_blocks": (
            suggest_limit_blocks(m.num_gpu_blocks, headroom) if m.num_gpu_blocks else None),
    }
    return out


_T = TypeVar("_T")


class StatusResult(TypedDict, total=False):
    """What :func:`read_status` returns: each key only when asked for."""

    server: dict[str, object]
    servers: list[dict[str, object]]
    budget: dict[str, object]


_readers: dict[object, threading.Thread] = {}  # key -> the reader thread of that key still running
_readers_lock = threading.Lock()


def within(seconds: float, fn: Callable[..., _T], *args: object, key: object = None) -> _T:
    """``fn(*args)`` run in a daemon thread, given at most ``seconds``: its result or its error, or
    :class:`TimeoutError` when it has not ended by then (the thread is left to end on its own socket
    timeouts). One bound for a whole read, whatever the client library retries or waits inside it.

    ``key``: one reader of that key at a time. While a read given up on earlier is still running, a new
    call waits for it (within its own ``seconds``) instead of starting a second thread, and raises
    :class:`TimeoutError` if it is still running then: a caller polling a stalled server in a loop
    never has more than one thread stuck on it."""
    deadline = SYSTEM_CLOCK.monotonic() + seconds
    if key is not None:
        with _readers_lock:
            earlier = _readers.get(key)
        if earlier is not None:
            earlier.join(max(0.0, deadline - SYSTEM_CLOCK.monotonic()))
            if earlier.is_alive():
                raise TimeoutError(f"no answer within {seconds:g} s (the previous read is still waiting)")
    results: list[_T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            results.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append(exc)
        finally:
            if key is not None:
                with _readers_lock:
                    if _readers.get(key) is threading.current_thread():
                        del _readers[key]

    t = threading.Thread(target=target, name="zp-status-read", daemon=True)
    if key is not None:
        with _readers_lock:
            _readers[key] = t
    t.start()
    t.join(max(0.0, deadline - SYSTEM_CLOCK.monotonic()))
    if t.is_alive():
        raise TimeoutError(f"no answer within {seconds:g} s")
    if errors:
        raise errors[0]
    return results[0]


def budget_status(redis_url: str, name: str, timeout: float = 5.0) -> dict[str, object]:
    """A RedisBudget's status, read without creating or changing it.

    Returns ``{"exists": False, ...}`` when no budget of that name is stored. Raises
    :class:`~zp_client.BudgetUnavailable` when Redis does not answer within ``timeout`` seconds: one bound
    for the whole read (each socket operation is bounded by half of it, with no retries inside redis-py,
    and the retries stop after the other half; a stalled Redis, SIGSTOPped say, took 10 s and more with a
    2 s timeout before). The read's thread ends within about ``timeout`` too, and while one given up on
    is still running for this URL and name, a new call waits for it rather than start another: a loop
    polling a stalled Redis leaves at most one thread on it.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from zp_client._redact import check_redis_url
    from zp_client.budget.redis import RedisBudget

    check_redis_url(redis_url)  # before redis-py reads it (its errors can show a piece of a password)
    # The read ends within about ``timeout`` (retries for half of it, each attempt bounded by the other
    # half), so the thread ``within`` runs it in ends with it rather than outlive the call.
    half = timeout / 2
    client = redis.Redis.from_url(redis_url, socket_timeout=half, socket_connect_timeout=half,
                                  retry=Retry(NoBackoff(), 0))

    def read() -> BudgetStatus:
        # limit_blocks is only what a *creating* call would store; status never creates, so 0 is inert.
        budget = RedisBudget(redis_url, name, limit_blocks=0, unavailable_timeout_s=half,
                             sync_client=client)
        try:
            return budget.status_sync()
        finally:
            budget.close_sync()
            client.close()

    try:
        s = within(timeout, read, key=("budget", redis_url, name))
    except TimeoutError:
        raise BudgetUnavailable(f"Redis did not answer within {timeout:g} s") from TimeoutError(
            "no reply to the status read")
    exists = bool(s.extra.get("exists"))
    out: dict[str, object] = {"name": name, "redis": _redact(redis_url), "exists": exists}
    if not exists:
        return out
    return _from_status(out, s)


def local_budget_status(budget: LocalBudget) -> dict[str, object]:
    """An in-process budget's status (a :class:`~zp_client.LocalBudget`'s, its adaptive limit's state
    included) in :func:`budget_status`'s shape: ``format_status({"budget": local_budget_status(b)})``
    prints what ``zp-client status`` prints for a RedisBudget."""
    s = budget.status_sync()
    out: dict[str, object] = {"name": str(getattr(budget, "name", "local")), "redis": None, "exists": True}
    return _from_status(out, s)


def _from_status(out: dict[str, object], s: BudgetStatus) -> dict[str, object]:
    out.update({
        "limit": s.limit,
        "used": s.used,
        "free": s.free,
        "held": s.held,
        "leases": s.leases,
        "waiters": {str(p): {"waiters": c.waiters, "weight": c.weight} for p, c in sorted(s.waiters.items())},
        "head_wait_s": s.head_wait_s,
        "policy": s.policy,
        "block_size": s.block_size,
    })
    for key in ("epoch", "recovering", "recovery_left_s", "starvation_bound_s", "limit_version", "adaptive",
                "replicas", "prefix_hit_rate", "moves"):
        if key in s.extra:
            out[key] = s.extra[key]
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``zp-client status``; returns the exit status."""
    if args.redis and not args.name:
        print("zp-client status: --redis needs --name (the budget's name)", file=sys.stderr)
        return 2
    if args.name and not args.redis:
        print("zp-client status: --name needs --redis URL", file=sys.stderr)
        return 2
    if not args.server and not args.redis:
        print("zp-client status: give --server URL and/or --redis URL --name NAME", file=sys.stderr)
        return 2
    if args.headroom is not None and not 0 < args.headroom <= 1:
        print(f"zp-client status: --headroom must be in (0, 1], got {args.headroom}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"zp-client status: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    # The library logs (e.g. "Redis unreachable") at WARNING/ERROR; the CLI reports errors itself.
    logging.getLogger("zp_client").setLevel(logging.CRITICAL)

    if args.watch:
        if args.json:
            print("zp-client status: --watch shows text; it does not take --json", file=sys.stderr)
            return 2
        if not args.interval > 0:
            print(f"zp-client status: --interval must be > 0, got {args.interval}", file=sys.stderr)
            return 2
        if args.count is not None and args.count < 1:
            print(f"zp-client status: --count must be >= 1, got {args.count}", file=sys.stderr)
            return 2

    try:
        if args.watch:
            return _run_watch(args)
        # --timeout bounds the whole command: every read together (each is bounded by it as well)
        result = within(args.timeout + _GRACE_S, read_status, args)
    except TimeoutError:
        what = " and ".join(w for w in (args.server, args.redis and _redact(args.redis)) if w)
        print(f"zp-client status: no answer from {what} within {args.timeout:g} s", file=sys.stderr)
        return 2
    except BudgetUnavailable as exc:
        # The library's message speaks of admission; here nothing is admitted, only read.
        print(f"zp-client status: Redis at {_redact(args.redis)} did not answer within {args.timeout:g} s "
              f"({exc.__cause__ or exc}); check the URL and that Redis is running", file=sys.stderr)
        return 2
    except ZPError as exc:
        print(f"zp-client status: {exc}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(format_status(result))
    budget = result.get("budget")
    return 1 if budget is not None and not budget["exists"] else 0


_GRACE_S = 0.25  # the whole command's bound past --timeout: a Redis read's own (typed) error comes first


def read_status(args: argparse.Namespace) -> StatusResult:
    """What ``args`` ask for: ``{"server": server_status(...), "budget": budget_status(...)}`` (either key
    only when asked). Raises a ZPError subclass on failure."""
    result: StatusResult = {}
    if args.server and "," in args.server:  # a fleet's replicas: each one's pool and load
        urls = [u.strip() for u in args.server.split(",") if u.strip()]
        result["servers"] = [server_status(u, args.headroom, args.timeout) for u in urls]
    elif args.server:
        result["server"] = server_status(args.server, args.headroom, args.timeout)
    if args.redis:
        result["budget"] = budget_status(args.redis, args.name, args.timeout)
    return result


def format_status(result: StatusResult) -> str:
    """``result`` (as :func:`read_status` returns it) as the text ``zp-client status`` prints."""
    lines: list[str] = []
    if "server" in result:
        lines += _server_lines(result["server"])
    for s in result.get("servers", ()):
        lines += _server_lines(s)
    if "budget" in result:
        lines += _budget_lines(result["budget"])
    return "\n".join(lines)


def watch(read: Callable[[], StatusResult], show: Callable[[StatusResult], None], interval: float,
          count: int | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``show(read())`` every ``interval`` seconds, ``count`` times (None: until Ctrl-C); returns 0.

    Reading and showing are separate so that the loop runs without a terminal; an error ``read`` raises
    ends the loop (``run`` reports it). Ctrl-C (KeyboardInterrupt) ends it with 0.
    """
    done = 0
    try:
        while count is None or done < count:
            show(read())
            done += 1
            if count is None or done < count:
                sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0


def _run_watch(args: argparse.Namespace) -> int:
    from zp_client.cli import missing_extra

    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError as exc:
        line = missing_extra("status --watch", "watch", exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2

    console = Console()

    def render(result: StatusResult) -> Text:
        stamp = time.strftime("%H:%M:%S")
        return Text(f"{format_status(result)}\n\n{stamp}, every {args.interval:g} s; Ctrl-C to stop")

    with Live(Text("reading..."), console=console, auto_refresh=False) as live:
        return watch(lambda: read_status(args), lambda r: live.update(render(r), refresh=True),
                     args.interval, args.count)


def _server_lines(s: dict[str, object]) -> list[str]:
    out = [f"server {s['url']}"]
    if s["num_gpu_blocks"] is None:
        out.append("  KV pool:          unknown (no vllm:cache_config_info with num_gpu_blocks in /metrics)")
    else:
        out.append(f"  KV pool:          {s['num_gpu_blocks']} blocks of {s['block_size']} tokens "
                   f"({s['usable_blocks']} usable)")
    usage = s["kv_cache_usage"]
    out.append(f"  KV usage:         {'unknown' if usage is None else f'{usage:.1%}'}")
    out.append(f"  requests:         {_show(s['num_requests_running'])} running, "
               f"{_show(s['num_requests_waiting'])} waiting")
    out.append(f"  preemptions:      {_show(s['num_preemptions_total'])} since start")
    if s["suggested_limit_blocks"] is not None:
        out.append(f"  suggested limit:  limit_blocks={s['suggested_limit_blocks']} "
                   f"(headroom {s['headroom']:g})")
    return out


def _budget_lines(b: dict[str, object]) -> list[str]:
    out: list[str] = []
    if not b["exists"]:
        out.append(f"budget {b['name']!r} at {b['redis']}: does not exist (no client has used it yet; "
                   "nothing was created)")
        return out
    where = f" at {b['redis']}" if b.get("redis") else " (in this process)"
    out.append(f"budget {b['name']!r}{where} (policy {b['policy']}, block size {b['block_size']})")
    out.append(f"  limit:            {b['limit']} blocks")
    out.append(f"  used:             {b['used']} blocks reserved by {b['leases']} leases ({b['free']} free)")
    out.append(f"  held:             {b['held']} blocks occupied now (as reported by the streams)")
    waiters = b["waiters"]
    if isinstance(waiters, dict) and waiters:
        for prio, c in waiters.items():
            out.append(f"  waiters (prio {prio}): {c['waiters']} waiting for {c['weight']} blocks")
    else:
        out.append("  waiters:          none")
    out.append(f"  head wait:        {b['head_wait_s']:.3f} s")
    if b.get("recovering"):
        out.append(f"  recovering:       admitting nothing new for {b['recovery_left_s']:.1f} s more")
    ad = b.get("adaptive")
    if isinstance(ad, dict):
        out += _adaptive_lines(ad)
    reps = b.get("replicas")
    if isinstance(reps, dict):
        out += _replica_lines(b, reps)
    return out


def _replica_lines(b: dict[str, object], reps: dict[str, dict[str, object]]) -> list[str]:
    """A fleet's replicas (zp_client.fleet): per replica its limit, used, leases, ejection, prefix hits."""
    rate = b.get("prefix_hit_rate")
    out = [f"  replicas:         {len(reps)}; prefix hit rate {'n/a' if rate is None else f'{rate:.1%}'}, "
           f"{_show(b.get('moves'))} requests moved off failed replicas"]
    for url, r in reps.items():
        state = "EJECTED" if r.get("ejected") else ("draining" if r.get("draining") else "ok")
        hit = r.get("prefix_hit_rate")
        hits = "n/a" if hit is None else f"{hit:.0%}"
        out.append(f"    {_redact(url)}: {state}; limit {r['limit']}, used {r['used']}, "
                   f"{r['leases']} leases, prefix hits {hits}, {r.get('ejections', 0)} ejections")
    return out


def _adaptive_lines(a: dict[str, object]) -> list[str]:
    """The adaptive limit's lines (zp_client.adaptive): leader, calibrated limit and floor, last change."""
    leader = a.get("leader")
    ttl = a.get("leader_ttl_s")
    if leader:
        who = f"leader {leader}" + (f" (lease {ttl:.1f} s left)" if isinstance(ttl, (int, float)) else "")
    else:
        who = "no leader now (the last one's lease lapsed; the limit stays as it is)"
    cal, floor = _show(a.get("calibrated")), _show(a.get("floor"))
    out = [f"  adaptive limit:   {who}; calibrated {cal}, floor {floor}"]
    if a.get("last_reason"):
        age = a.get("last_change_age_s")
        when = f" {age:.1f} s ago" if isinstance(age, (int, float)) else ""
        out.append(f"  last change:      {a.get('last_old')} -> {a.get('last_new')} blocks "
                   f"({a['last_reason']}){when}; {_show(a.get('changes'))} changes")
    else:
        out.append("  last change:      none")
    if a.get("polls"):
        bypass = a.get("last_bypass_blocks")
        out.append(f"  last poll:        /metrics {a.get('metrics')}; +{_show(a.get('last_preemptions'))} "
                   f"preemptions, {_show(a.get('last_overloads'))} overload answers, bypass "
                   f"{'unknown' if bypass in (None, '') else f'{bypass} blocks'}")
    return out


def _show(v: object) -> str:
    return "unknown" if v is None else str(v)


def _int_or_none(v: float | None) -> int | None:
    return None if v is None else int(v)


def _redact(url: str) -> str:
    """The URL without a password, in its userinfo or its query (a status line must never print
    credentials)."""
    from zp_client._redact import redact_url

    return redact_url(url)
