"""Layering numbers for a source tree: deferred imports, import circles, `Any` density, background work.

Usage: python benchmarks/import_stats.py [TREE] [--package zp_client] [--exclude sim bench] [--circles]

TREE is a checkout (default: this repository); nothing of it is imported, every number comes from its
files' ASTs, so two revisions are measured the same way. Prints one ``name: value`` line per number:

- ``modules``: the package's modules (``__init__`` counts as its package), the excluded subpackages aside.
- ``deferred_imports`` / ``deferred_import_files``: imports of the package's own modules written inside a
  function (what a module does when a top-level import would close a circle).
- ``circles`` / ``circle_modules`` / ``largest_circle``: strongly connected components of more than one
  module in the graph of every import of the package's own modules (top level and deferred; those under
  ``if TYPE_CHECKING:`` are not executed and are left out). ``from pkg import name`` is an edge to
  ``pkg.name`` when that is a module, else to ``pkg``. With ``--circles`` each circle is listed.
- ``lines`` / ``any_names`` / ``any_per_1000_lines``: ``Any`` as a name in the code (annotations, casts,
  aliases; not in strings or comments) per 1,000 physical lines.
- ``create_task_calls`` / ``thread_starts``: calls of ``create_task`` and of ``threading.Thread``.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path


def modules(tree: Path, package: str, exclude: set[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` outside the excluded subpackages."""
    found: dict[str, Path] = {}
    for path in sorted((tree / package).rglob("*.py")):
        parts = list(path.relative_to(tree).with_suffix("").parts)
        if len(parts) > 1 and parts[1] in exclude:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, name: str, known: set[str]) -> Iterator[tuple[str, bool]]:
    """(imported module of the package, whether the import is inside a function) for every executed
    import of ``path`` (module ``name``); ``if TYPE_CHECKING:`` blocks are skipped."""
    is_pkg = path.name == "__init__.py"

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, deferred: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    yield from visit(other, deferred)
                continue
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name in known:
                        yield alias.name, inner
            elif isinstance(child, ast.ImportFrom):
                mod = resolve(child)
                targets = {f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in child.names}
                for target in sorted(targets & known):  # one per module a statement imports
                    yield target, inner
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text()), False)


def graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (executed imports, deferred ones included)."""
    known = set(mods)
    return {m: {t for t, _ in imports(p, m, known) if t != m} for m, p in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out, key=lambda c: (-len(c), c))


def _calls(tree: ast.AST, attr: str) -> int:
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Attribute) and n.func.attr == attr)
        or (isinstance(n.func, ast.Name) and n.func.id == attr)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--package", default="zp_client")
    ap.add_argument("--exclude", nargs="*", default=["sim", "bench"])
    ap.add_argument("--circles", action="store_true", help="list every circle's modules")
    args = ap.parse_args()
    import sys

    sys.setrecursionlimit(10_000)
    mods = modules(Path(args.tree), args.package, set(args.exclude))
    known = set(mods)
    deferred = [(m, t) for m, p in mods.items() for t, d in imports(p, m, known) if d]
    found = circles(graph(mods))
    lines = any_names = tasks = threads = 0
    for p in mods.values():
        text = p.read_text()
        tree = ast.parse(text)
        lines += len(text.splitlines())
        any_names += sum(1 for n in ast.walk(tree) if (isinstance(n, ast.Name) and n.id == "Any") or (
            isinstance(n, ast.Attribute) and n.attr == "Any"))
        tasks += _calls(tree, "create_task")
        threads += _calls(tree, "Thread")
    print(f"modules: {len(mods)}")
    print(f"deferred_imports: {len(deferred)}")
    print(f"deferred_import_files: {len({m for m, _ in deferred})}")
    print(f"circles: {len(found)}")
    print(f"circle_modules: {sum(len(c) for c in found)}")
    print(f"largest_circle: {max((len(c) for c in found), default=0)}")
    print(f"lines: {lines}")
    print(f"any_names: {any_names}")
    print(f"any_per_1000_lines: {1000 * any_names / max(lines, 1):.1f}")
    print(f"create_task_calls: {tasks}")
    print(f"thread_starts: {threads}")
    if args.circles:
        for c in found:
            print(f"circle ({len(c)}): {' '.join(c)}")


if __name__ == "__main__":
    main()
