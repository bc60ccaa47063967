"""The package's layering, as one table: every module of ``zp_client`` belongs to one layer, and a layer
imports only the layers it lists (its own included). Every import counts, at the top of a module or
inside a function (a deferred import is still an import); those under ``if TYPE_CHECKING:`` name types
and run nothing, and are held to the same table except for the few listed in TYPE_ONLY. Beside it: no
import circle in ``zp_client``, and the budget ledger's finer rule (sans I/O: its value types, its pin book
and the errors only).

The simulator and the storm are distributions of their own (``zp_sim``, ``zp_storm``): not in the table;
tests/test_distributions.py holds them apart.
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import zp_client
from zp_client.budget import _types, base

PACKAGE = Path(zp_client.__file__).parent
BUDGET = PACKAGE / "budget"
EXCLUDED = ("zp_client.sim", "zp_client.bench")

# layer -> the module prefixes it holds (a prefix matches the module itself and everything under it)
LAYERS: dict[str, tuple[str, ...]] = {
    "foundation": ("zp_client.errors", "zp_client.clock", "zp_client._hooks", "zp_client.config",
                   "zp_client.types", "zp_client._redact", "zp_client._private", "zp_client._tasks"),
    "models": ("zp_client.server", "zp_client.calibration", "zp_client.forecast", "zp_client.estimate"),
    "budget": ("zp_client.budget",),
    "policies": ("zp_client.retry", "zp_client.adaptive", "zp_client.metrics", "zp_client.observe"),
    "admission": ("zp_client._admission", "zp_client._sse", "zp_client._repeat"),
    # above the admission core, which never imports it (tests/test_layout.py): the fleet implements the
    # core's ports (Fleet, TwoPhaseCall) and its P/D two-phase lease yields the core's actions
    "fleet": ("zp_client.fleet",),
    "transport": ("zp_client.transport", "zp_client._transport2", "zp_client._httpx2"),
    "front ends": ("zp_client.client", "zp_client._wrap", "zp_client._integration", "zp_client.pinning",
                   "zp_client.integrations"),
    # what users' own tests and the storm use: virtual time and an in-memory transport over the library
    "testing": ("zp_client.testing",),
    "cli": ("zp_client.cli", "zp_client.status_cli", "zp_client.budget_cli", "zp_client.calibrate_cli"),
}
# the package root is the composition root: it may import anything (lazily) and wires the hooks

_ORDER = list(LAYERS)
# layer -> the layers it may import: every layer below it, and itself
MAY_IMPORT: dict[str, set[str]] = {layer: set(_ORDER[: i + 1]) for i, layer in enumerate(_ORDER)}

# Upward names a type annotation needs and nothing runs: (importing module, imported module).
TYPE_ONLY = {
    # Budget.adapt() -> AdaptiveLimit, a public signature; the factory comes through zp_client._hooks
    ("zp_client.budget.base", "zp_client.adaptive"),
}

# Constants of the package root anyone may read (the root runs before any submodule anyway).
ROOT_CONSTANTS = {"__version__"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["zp_client", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if not name.startswith(EXCLUDED):
            found[name] = path
    return found


MODULES = _modules()


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str | None:
    """The layer of a module (the root: None)."""
    hits = [layer for layer, prefixes in LAYERS.items() if any(_matches(module, p) for p in prefixes)]
    assert len(hits) <= 1, f"{module} is in layers {hits}"
    return hits[0] if hits else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str) -> Iterator[tuple[str, bool]]:
    """(imported ``zp_client`` module, whether only a type checker runs it) for every import of a
    module, wherever it is written. ``from pkg import name`` counts as ``pkg.name`` when that is a
    module, else as ``pkg``."""
    path = MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def absolute(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base_parts = package[: len(package) - (node.level - 1)]
        return ".".join(base_parts + ([node.module] if node.module else []))

    def own(name: str) -> str | None:
        if name.startswith(EXCLUDED):
            return name
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, type_only: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            typed = type_only or (isinstance(child, ast.If) and _is_type_checking(child.test))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == "zp_client" or alias.name.startswith("zp_client."):
                        target = own(alias.name)
                        if target:
                            yield target, typed
            elif isinstance(child, ast.ImportFrom):
                mod = absolute(child)
                if mod == "zp_client" or mod.startswith("zp_client."):
                    for alias in child.names:
                        if mod == "zp_client" and alias.name in ROOT_CONSTANTS:
                            continue
                        target = own(f"{mod}.{alias.name}")
                        if target:
                            yield target, typed
            yield from visit(child, typed)

    yield from visit(ast.parse(path.read_text()), False)


def _runtime_graph() -> dict[str, set[str]]:
    return {m: {t for t, typed in imports(m) if not typed and t != m} for m in MODULES}


def test_every_module_of_the_package_has_a_layer() -> None:
    unplaced = [m for m in MODULES if m != "zp_client" and layer_of(m) is None]
    assert not unplaced, f"put these modules in a layer of LAYERS: {unplaced}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_those_below(module: str) -> None:
    layer = layer_of(module)
    if layer is None:  # the package root, the composition root
        return
    wrong = sorted(
        f"{target} ({layer_of(target)}{', type only' if typed else ''})"
        for target, typed in imports(module)
        if not target.startswith(EXCLUDED)
        and layer_of(target) not in MAY_IMPORT[layer]
        and not (typed and (module, target) in TYPE_ONLY)
    )
    assert not wrong, f"{module} ({layer}) may import only {sorted(MAY_IMPORT[layer])}; it imports {wrong}"


def test_the_library_imports_nothing_of_the_simulator_or_the_benchmark() -> None:
    wrong = sorted(f"{m} -> {t}" for m in MODULES for t, _ in imports(m) if t.startswith(EXCLUDED))
    assert not wrong, wrong


def test_the_type_only_exceptions_are_still_needed() -> None:
    for module, target in TYPE_ONLY:
        assert (target, True) in set(imports(module)), f"{module} no longer names {target}: drop it"


def test_there_is_no_import_circle() -> None:
    graph = _runtime_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    circles: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_circle_check_finds_a_circle() -> None:
    # the check itself: the graph it reads has the edges written in the modules, deferred ones included
    graph = _runtime_graph()
    assert "zp_client.budget.base" in graph["zp_client.budget.local"]
    assert "zp_client.config" in graph["zp_client.budget.base"]  # a deferred import (Budget.retry_budget)
    assert "zp_client.adaptive" not in graph["zp_client.budget.base"]  # type only


# ---------------------------------------------------------------- the ledger: sans I/O
def _package_imports(path: Path) -> set[str]:
    """Every ``zp_client...`` module a file imports, at top level or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zp_client"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("zp_client"))
    return found


def test_the_ledger_imports_only_its_value_types_its_pin_book_and_the_errors() -> None:
    assert _package_imports(BUDGET / "ledger.py") == {"zp_client.budget._types", "zp_client.budget.pins",
                                                      "zp_client.errors"}
    assert _package_imports(BUDGET / "_types.py") == set()
    assert _package_imports(BUDGET / "pins.py") == {"zp_client.errors"}  # sans-I/O, as the ledger


def test_importing_the_ledger_loads_no_other_budget_module() -> None:
    code = ("import sys, zp_client.budget.ledger; "
            "print(sorted(m for m in sys.modules if m.startswith('zp_client.budget.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['zp_client.budget._types', 'zp_client.budget.ledger', 'zp_client.budget.pins']"


def test_importing_the_budget_interface_loads_nothing_above_the_budget() -> None:
    code = ("import sys, zp_client.budget.base, zp_client.budget.local; "
            "print(sorted(m for m in sys.modules if m.startswith('zp_client')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)  # noqa: S307 - a list literal printed by the line above
    above = [m for m in loaded if m != "zp_client" and layer_of(m) not in MAY_IMPORT["budget"]]
    assert loaded and not above, above


def test_the_value_types_keep_their_public_names() -> None:
    for name in ("Ticket", "BudgetStatus", "ClassStatus"):
        assert getattr(base, name) is getattr(_types, name)
        assert name in base.__all__
    assert zp_client.Ticket is base.Ticket and zp_client.BudgetStatus is base.BudgetStatus
    t = base.Ticket(1, 7)
    assert pickle.loads(pickle.dumps(t)) == t  # worker processes pass tickets around
