"""The simulator is the judge of zp-client and shares no code with it (issue 32): ``zp_sim`` imports
nothing of ``zp_client`` (not even ``zp_client.clock``) nor of the storm, on any path (the check reads
the source, deferred imports and ``import_module("...")`` strings included), and its distribution does
not depend on zp-client."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import zp_sim

SIM = Path(zp_sim.__file__).parent
FORBIDDEN = ("zp_client", "zp_storm")


def _imported(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and isinstance(node.func, (ast.Name, ast.Attribute)) \
                and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) in (
                    "import_module", "__import__"):
            found.append((node.lineno, node.args[0].value))
    return sorted(found, key=lambda f: f[0])  # ast.walk is breadth-first: in source order


def _offences(root: Path) -> list[str]:
    return [f"{p.name}:{line} {mod}" for p in sorted(root.rglob("*.py")) for line, mod in _imported(p)
            if mod.split(".")[0] in FORBIDDEN]


def test_the_simulator_imports_nothing_of_zp_client() -> None:
    assert len(list(SIM.glob("*.py"))) >= 8
    assert _offences(SIM) == []
    # what it does import: the standard library, itself and its declared requirements
    tops = {mod.split(".")[0] for p in SIM.rglob("*.py") for _, mod in _imported(p)}
    assert sorted(t for t in tops if t not in sys.stdlib_module_names) == [
        "prometheus_client", "starlette", "uvicorn", "zp_sim"]


def test_the_check_sees_deferred_and_dynamic_imports(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("def f():\n    from zp_client.clock import SYSTEM_CLOCK\n"
                                   "    importlib.import_module('zp_storm.runner')\n    import zp_client\n")
    assert _offences(tmp_path) == ["m.py:2 zp_client.clock", "m.py:3 zp_storm.runner", "m.py:4 zp_client"]


def test_the_distribution_does_not_depend_on_zp_client() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((SIM.parent / "pyproject.toml").read_text())["project"]
    assert project["name"] == "zp-sim"
    assert not [r for r in project["dependencies"] if r.startswith(("zp-client", "zp-storm"))]
    assert project["entry-points"]["zp_client.commands"] == {"sim": "zp_sim.cli"}
