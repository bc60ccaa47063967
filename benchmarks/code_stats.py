"""Code-health numbers for a source tree: lint and type findings, suppressions, sizes.

Usage: python benchmarks/code_stats.py [TREE] [--package zp_client] [--files F ...] [--no-mypy]

TREE is a checkout (default: this repository). The numbers do not depend on the tree's own
pyproject settings: ruff runs isolated with explicit rules and mypy with a temporary config, so
two revisions are measured the same way. ruff and mypy are taken from the running interpreter's
bin directory (or PATH). Prints one `name: value` line per number.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OLD_RUFF = ["--line-length", "110", "--target-version", "py310"]  # ruff's default rule set (E4,E7,E9,F)
NEW_RULES = "E,F,B,I,UP,SIM,BLE001,S110"
NEW_RUFF = [*OLD_RUFF, "--select", NEW_RULES]  # what `make lint` runs: these rules only
BOTH_RUFF = [*OLD_RUFF, "--extend-select", NEW_RULES]  # ruff's default rules plus these
PYDANTIC_MYPY = """
[mypy]
plugins = pydantic.mypy

[pydantic-mypy]
init_forbid_extra = True
init_typed = True
warn_required_dynamic_aliases = True
"""
TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore")
NOQA = re.compile(r"#\s*noqa\b")


def _tool(name: str) -> str:
    """The path of a console script beside the running interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found beside {sys.executable} or on PATH")
    return found


def ruff_counts(tree: Path, targets: list[str], args: list[str]) -> tuple[int, dict[str, int]]:
    """Total ruff findings and the count per rule code."""
    cmd = [_tool("ruff"), "check", "--isolated", "--output-format", "json", *args, *targets]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    findings = json.loads(out.stdout or "[]")
    per_code: dict[str, int] = {}
    for f in findings:
        code = f.get("code") or "syntax"
        per_code[code] = per_code.get(code, 0) + 1
    return len(findings), per_code


def mypy_errors(tree: Path, targets: list[str], plugin: bool) -> int:
    """Errors of `mypy --strict --python-version 3.10` in the targets, with or without the pydantic plugin."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "mypy.ini"
        cfg.write_text(PYDANTIC_MYPY if plugin else "[mypy]\n")
        cmd = [
            _tool("mypy"), "--strict", "--python-version", "3.10", "--config-file", str(cfg),
            "--cache-dir", str(Path(tmp) / "cache"), "--no-error-summary", "--hide-error-context",
            "--no-pretty", *targets,
        ]
        env = {**os.environ, "PYTHONPATH": str(tree), "MYPY_FORCE_COLOR": "0"}
        out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env, check=False)
    # mypy follows imports and reports on them too: count only the errors in the targets
    return sum(1 for line in out.stdout.splitlines()
               if ": error:" in line and any(line.startswith(t.rstrip("/")) for t in targets))


def python_files(tree: Path, targets: list[str]) -> list[Path]:
    """Every .py file under the targets (files or folders), sorted."""
    files: list[Path] = []
    for t in targets:
        p = tree / t
        files.extend([p] if p.is_file() else sorted(p.rglob("*.py")))
    return files


def suppressions(files: list[Path]) -> tuple[int, int]:
    """Lines carrying `# type: ignore` and lines carrying `# noqa` (as `grep -c` sums them)."""
    ignores = noqa = 0
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            ignores += bool(TYPE_IGNORE.search(line))
            noqa += bool(NOQA.search(line))
    return ignores, noqa


def sizes(tree: Path, files: list[Path]) -> tuple[tuple[int, str], tuple[int, str]]:
    """(lines, path) of the largest module and (lines, qualified name) of the longest function."""
    largest = (0, "")
    longest = (0, "")
    for f in files:
        text = f.read_text(encoding="utf-8")
        rel = str(f.relative_to(tree))
        largest = max(largest, (len(text.splitlines()), rel))
        for name, node in _functions(ast.parse(text), ""):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            longest = max(longest, (length, f"{rel}:{name}"))
    return largest, longest


def _functions(node: ast.AST, prefix: str) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{child.name}"
            out.append((name, child))
            out.extend(_functions(child, f"{name}."))
        elif isinstance(child, ast.ClassDef):
            out.extend(_functions(child, f"{prefix}{child.name}."))
        else:
            out.extend(_functions(child, prefix))
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the numbers for one tree."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--package", default="zp_client")
    ap.add_argument("--files", nargs="*", help="paths (relative to TREE) to measure instead of the package")
    ap.add_argument("--no-mypy", action="store_true")
    args = ap.parse_args(argv)
    tree = Path(args.tree).resolve()
    targets = args.files or [args.package]

    total, _ = ruff_counts(tree, targets, OLD_RUFF)
    print(f"ruff (default rules, line 110): {total}")
    total, per = ruff_counts(tree, targets, NEW_RUFF)
    print(f"ruff ({NEW_RULES}, line 110): {total}")
    print(f"  BLE001: {per.get('BLE001', 0)}  S110: {per.get('S110', 0)}")
    top = ", ".join(f"{c} {n}" for c, n in sorted(per.items(), key=lambda kv: -kv[1])[:12])
    print(f"  by code: {top}")
    total, _ = ruff_counts(tree, targets, BOTH_RUFF)
    print(f"ruff (default rules + {NEW_RULES}, line 110): {total}")
    if not args.no_mypy:
        print(f"mypy --strict (no plugin): {mypy_errors(tree, targets, plugin=False)}")
        print(f"mypy --strict (pydantic plugin): {mypy_errors(tree, targets, plugin=True)}")
    files = python_files(tree, targets)
    ignores, noqa = suppressions(files)
    print(f"type: ignore lines: {ignores}")
    print(f"noqa lines: {noqa}")
    (mod_lines, mod), (fn_lines, fn) = sizes(tree, files)
    print(f"largest module: {mod_lines} lines ({mod})")
    print(f"longest function: {fn_lines} lines ({fn})")
    readme = tree / "README.md"
    if readme.exists():
        print(f"README.md: {readme.stat().st_size} bytes")


if __name__ == "__main__":
    main()
