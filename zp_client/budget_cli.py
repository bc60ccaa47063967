"""``zp-client budget``: manage a shared RedisBudget. ``zp-client budget create`` writes a new budget's
state explicitly, so its first request is admitted at once instead of after the recovery window a
budget found absent waits out (see docs/redis.md, "Creating a budget").
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from zp_client.errors import BudgetUnavailable, ZPError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``budget`` subcommand's arguments (one action: ``create``)."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser(
        "create", help="create a RedisBudget's state now, with no first-use recovery window",
        description="Create a RedisBudget's state in Redis now, so its first request is admitted at once. "
                    "Run it once when you provision the budget, not at every process start: after a Redis "
                    "restart it would skip the window that protects surviving holders' leases. An "
                    "existing budget is left as it is (exit status 0, 'exists').")
    p.add_argument("--redis", metavar="URL", required=True, help="Redis URL (redis://host:6379/0)")
    p.add_argument("--name", required=True, help="the budget's name")
    p.add_argument("--limit", type=int, required=True, metavar="BLOCKS", help="the limit in KV blocks")
    p.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                   help="tokens per KV block (default 16)")
    p.add_argument("--policy", choices=("elastic", "strict"), default="elastic",
                   help="admission policy (default elastic)")
    p.add_argument("--line", choices=("fifo", "slo"), default="fifo", help="the line's order (default fifo)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                   help="give up when Redis does not answer within this many seconds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Run ``zp-client budget ACTION``; returns the exit status."""
    from zp_client._redact import redact_url
    from zp_client.budget.redis import RedisBudget

    if not args.timeout > 0:
        print(f"zp-client budget create: --timeout must be > 0, got {args.timeout}", file=sys.stderr)
        return 2
    logging.getLogger("zp_client").setLevel(logging.CRITICAL)  # the CLI reports itself
    try:
        budget = RedisBudget.create_sync(args.redis, args.name, args.limit, args.block_size,
                                         policy=args.policy, line=args.line,
                                         unavailable_timeout_s=args.timeout)
    except BudgetUnavailable as exc:
        print(f"zp-client budget create: Redis at {redact_url(args.redis)} did not answer within "
              f"{args.timeout:g} s ({exc.__cause__ or exc})", file=sys.stderr)
        return 2
    except (ZPError, ValueError) as exc:
        print(f"zp-client budget create: {exc}", file=sys.stderr)
        return 2
    try:
        out = {"name": args.name, "redis": redact_url(args.redis), "created": bool(budget.created),
               "limit": budget.limit, "policy": budget.policy_name}
    finally:
        budget.close_sync()
    if args.json:
        print(json.dumps(out, sort_keys=True))
    elif out["created"]:
        print(f"created budget {args.name!r}: limit {out['limit']} blocks, policy {out['policy']}, "
              "no recovery window")
    else:
        print(f"budget {args.name!r} exists: limit {out['limit']} blocks, policy {out['policy']} (unchanged)")
    return 0
