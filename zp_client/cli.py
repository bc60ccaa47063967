"""The ``zp-client`` command. Each subcommand lives with the code it drives and loads on demand."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module exposing ``add_arguments(parser)`` and ``run(args) -> int``
_COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("zp_client.sim.cli", "run the simulated vLLM server, or replay a workload in virtual time"),
    "storm": ("zp_client.bench.cli", "the storm benchmark: the same burst with and without zp-client"),
    "status": ("zp_client.status_cli", "print a budget's status (limit, used, waiters)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zp-client", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # an extra is missing: say which
            p.set_defaults(_missing=f"'zp-client {name}' is unavailable: {exc}. Install zp-client[bench].")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
