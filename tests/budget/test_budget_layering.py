"""The budget package's layering: the sans-I/O ledger depends on nothing in the package but its own value
types and ``zp_client.errors``, and the public value types keep their public names."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import zp_client
from zp_client.budget import _types, base

BUDGET = Path(zp_client.__file__).parent / "budget"


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


def test_the_value_types_keep_their_public_names() -> None:
    for name in ("Ticket", "BudgetStatus", "ClassStatus"):
        assert getattr(base, name) is getattr(_types, name)
        assert name in base.__all__
    assert zp_client.Ticket is base.Ticket and zp_client.BudgetStatus is base.BudgetStatus
    t = base.Ticket(1, 7)
    assert pickle.loads(pickle.dumps(t)) == t  # worker processes pass tickets around
