"""The ``zp-client`` command. Each subcommand lives with the code it drives and loads on demand.

``status``, ``budget`` and ``calibrate`` are the library's own. ``sim`` and ``storm`` belong to the
zp-sim and zp-storm distributions, which declare them in the ``zp_client.commands`` entry-point group
(``zp_client`` imports nothing of either); without the distribution the command ends with one line
naming it and how to install it, and exit status 2. A library subcommand whose extra is not installed
(``status --redis`` and ``budget``: ``zp-client[redis]``; ``status --watch``: ``zp-client[watch]``;
``calibrate`` needs none) ends the same way, naming the extra.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from pathlib import Path
from types import ModuleType

from zp_client.errors import MissingIntegration, install_hint

#: The entry-point group another distribution adds ``zp-client`` subcommands through: each entry point
#: names a module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
COMMAND_GROUP = "zp_client.commands"

# The library's subcommands -> (module exposing ``add_arguments(parser)`` and ``run(args) -> int``, help,
# its extra)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "status": ("zp_client.status_cli",
               "print a server's KV pool and suggested limit, or a shared budget's status", "redis"),
    "budget": ("zp_client.budget_cli",
               "manage a shared RedisBudget: 'budget create' makes one with no first-use wait", "redis"),
    # core dependencies only (httpx, prometheus-client): no extra
    "calibrate": ("zp_client.calibrate_cli",
                  "size limit_blocks from a server's /metrics and say how it was reached", "core"),
}

#: The subcommands this repository's other distributions provide -> (distribution, the folders of the
#: clone to install, in order, help). Named here so that ``zp-client --help`` lists them and their
#: absence is one line that says what to install; the code is found through :data:`COMMAND_GROUP` only.
DISTRIBUTION_COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "sim": ("zp-sim", ("sim",), "run the simulated vLLM server, or replay a workload in virtual time"),
    "storm": ("zp-storm", ("sim", "storm"),
              "the storm benchmark: the same burst with and without zp-client"),
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


#: The top-level modules each extra installs (pyproject.toml's optional dependencies); a missing module
#: outside its command's extra is a bug or a broken install, and keeps its traceback.
_EXTRA_MODULES: dict[str, frozenset[str]] = {
    "redis": frozenset({"redis"}),
    "watch": frozenset({"rich"}),
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


def distribution_hint(command: str) -> str:
    """How to install the distribution behind ``zp-client COMMAND`` (:data:`DISTRIBUTION_COMMANDS`): from
    the clone this zp-client runs from when it runs from one (the three distributions are folders of
    it), else from PyPI; the other way is named after it."""
    dist, folders, _help = DISTRIBUTION_COMMANDS[command]
    root = Path(__file__).resolve().parent.parent
    pypi = f"pip install {dist}"
    if all((root / f / "pyproject.toml").is_file() for f in folders):
        clone = "pip install " + " ".join(f"-e {shlex.quote(str(root / f))}" for f in folders)
        return f"{clone} (zp-client runs from the clone at {root}; from PyPI: {pypi})"
    return f"{pypi} (from a clone: pip install {' '.join(f'-e {f}/' for f in folders)})"


def missing_distribution(command: str) -> str:
    """The one line for ``zp-client COMMAND`` when no installed distribution provides it."""
    dist = DISTRIBUTION_COMMANDS[command][0]
    return (f"zp-client {command} needs the {dist} distribution (not installed: no '{command}' entry point "
            f"in the {COMMAND_GROUP!r} group): {distribution_hint(command)}")


def _requirement_name(requirement: str) -> str:
    """``langchain-core>=0.3; extra == 'x'`` -> ``langchain_core`` (a requirement's name as a module)."""
    name = re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0]
    return name.lower().replace("-", "_").replace(".", "_")


def _requirement_modules(ep: EntryPoint) -> frozenset[str]:
    """The top-level module names of what the distribution that declares ``ep`` requires, and what its
    installed requirements require in turn (zp-storm requires zp-sim, which requires starlette)."""
    if ep.dist is None:
        return frozenset()
    seen: set[str] = set()
    todo = [r for r in ep.dist.requires or [] if "extra ==" not in r]
    while todo:
        name = _requirement_name(todo.pop())
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            todo += [r for r in distribution(name).requires or [] if "extra ==" not in r]
        except PackageNotFoundError:  # not installed: its own requirements are unknown
            continue
    return frozenset(seen)


def missing_dependency(command: str, ep: EntryPoint, exc: ImportError) -> str | None:
    """The one line for ``zp-client COMMAND`` (an entry-point command) when a requirement of the
    distribution that provides it is missing; None for any other missing module (the traceback stays)."""
    if isinstance(exc, MissingIntegration):
        return f"zp-client {command}: {exc}"
    module = (exc.name or "").split(".")[0]
    if not module or module not in _requirement_modules(ep):
        return None
    dist = ep.dist.name if ep.dist is not None else command
    how = (distribution_hint(command) if command in DISTRIBUTION_COMMANDS
           else f"pip install --force-reinstall {dist}")
    return f"zp-client {command} needs {dist}'s requirements (no module named {module!r}): {how}"


def command_entry_points() -> dict[str, EntryPoint]:
    """The installed ``zp_client.commands`` entry points by name (the first one of a name wins)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        found.setdefault(ep.name, ep)
    return found


def _take_anything(p: argparse.ArgumentParser, line: str) -> None:
    # Take any arguments, so the line is what the user sees (not an argparse error).
    p.add_argument("_rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(_missing=line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zp-client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"zp-client {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = command_entry_points()
    others = sorted(set(plugins) - set(DISTRIBUTION_COMMANDS) - set(_COMMANDS))  # a third party's commands
    names = [*DISTRIBUTION_COMMANDS, *_COMMANDS, *others]
    for name in names:
        mod: ModuleType
        if name in _COMMANDS:
            module, help_text, extra = _COMMANDS[name]
            p = sub.add_parser(name, help=help_text, description=help_text)
            p.set_defaults(_name=name, _extra=extra, _ep=None)
            try:
                mod = importlib.import_module(module)
                mod.add_arguments(p)
            except ModuleNotFoundError as exc:
                line = missing_extra(name, extra, exc)
                if line is None:
                    raise
                _take_anything(p, line)
                continue
        else:
            ep = plugins.get(name)
            about = DISTRIBUTION_COMMANDS[name][2] if name in DISTRIBUTION_COMMANDS else None
            p = sub.add_parser(name, help=about, description=about)
            p.set_defaults(_name=name, _extra=None, _ep=ep)
            if ep is None:
                _take_anything(p, missing_distribution(name))
                continue
            try:
                mod = ep.load()
                mod.add_arguments(p)
            except ModuleNotFoundError as exc:
                line = missing_dependency(name, ep, exc)
                if line is None:
                    raise
                _take_anything(p, line)
                continue
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # a command that cannot load takes any arguments: its one line, not an argparse error, is the answer
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args._run(args) or 0)
    except (ModuleNotFoundError, MissingIntegration) as exc:  # MissingIntegration: RedisBudget, no redis
        line = (missing_dependency(args._name, args._ep, exc) if args._ep is not None
                else missing_extra(args._name, args._extra, exc))
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
