"""``zp-client calibrate``: size a budget from a server's ``/metrics`` and ``/v1/models``, and say how.

    zp-client calibrate http://127.0.0.1:8000/v1 [--headroom 0.9] [--policy strict|elastic] [--json]

Read-only. Prints the pool, the context length, the headroom, the derived ``limit_blocks`` and the line
to paste; exit 0, or 2 with one line when the server cannot be calibrated (no ``/metrics``, no
``vllm:cache_config_info``, no answer) or an argument is bad. See docs/admission.md#calibration.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from zp_client.errors import ZPError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``calibrate`` options to ``parser``."""
    parser.add_argument("url", metavar="URL", help="the server: http://host:8000 or http://host:8000/v1")
    parser.add_argument("--headroom", type=float, default=None,
                        help="share of the usable KV pool to lease, in (0, 1] (default: the policy's, "
                             "elastic 0.90, strict 0.95); lower it when clients outside zp share the server")
    parser.add_argument("--policy", choices=("elastic", "strict"), default="elastic",
                        help="the budget's policy, whose default headroom applies (default elastic)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each answer from the server (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Run ``zp-client calibrate``; returns the exit status."""
    from zp_client.calibration import calibrate

    # errors are reported below, in one line; the logger's level is restored for an in-process caller
    log = logging.getLogger("zp_client")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        cal = calibrate(args.url, headroom=args.headroom, policy=args.policy, timeout_s=args.timeout)
    except ZPError as exc:
        print(f"zp-client calibrate: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    finally:
        log.setLevel(level)
    if args.json:
        print(json.dumps(cal.as_dict(), sort_keys=True))
        return 0
    for line in cal.explain():
        print(line)
    print()
    print(f"    budget = {cal.code()}")
    print(f"    # or, read at startup: LocalBudget.from_server({cal.url!r}"
          f"{', policy=' + repr(cal.policy) if cal.policy == 'strict' else ''}"
          f"{'' if cal.headroom_is_default else f', headroom={cal.headroom:g}'})")
    return 0
