"""The three distributions of this repository (issue 32): zp-client (the library), zp-sim (the simulated
vLLM server, sim/) and zp-storm (the benchmark, storm/).

The library imports nothing of the other two, not even lazily: ``zp-client sim`` / ``zp-client storm``
reach them through the ``zp_client.commands`` entry-point group only. (What zp_sim and zp_storm may
import is checked in their own tests: sim/tests/test_sim_imports.py, storm/tests/test_storm_imports.py.)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zp_client
from zp_client import cli

LIB = Path(zp_client.__file__).parent
REPO = LIB.parent
OTHERS = ("zp_sim", "zp_storm")


_MODULE_PATH = re.compile(r"(zp_sim|zp_storm)(\.\w+)*(:\w+)?")


def _mentions(path: Path) -> list[str]:
    """Every import of zp_sim or zp_storm in ``path`` (deferred ones included), and every string that is
    a module path of theirs (what ``import_module`` or an entry point would load: a lazy import)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] in OTHERS]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OTHERS:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and _MODULE_PATH.fullmatch(node.value.strip()):
            names = [node.value.strip()]
        found += [(node.lineno, f"{path.relative_to(REPO)}:{node.lineno} {n}")  # type: ignore[attr-defined]
                  for n in names]
    return [text for _, text in sorted(found)]


@pytest.mark.slow
def test_the_library_imports_nothing_of_the_simulator_or_the_storm() -> None:
    paths = sorted(LIB.rglob("*.py"))
    assert len(paths) > 50
    offences = [o for p in paths for o in _mentions(p)]
    assert offences == []
    assert not (LIB / "sim").exists() and not (LIB / "bench").exists()
    # nor is either loaded by importing every public module of the library (in a fresh interpreter)
    code = ("import sys, zp_client, zp_client.testing, zp_client.cli, zp_client.clock, zp_client.transport\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('zp_sim', 'zp_storm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_check_sees_deferred_imports_and_module_strings(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "m.py").write_text("def f():\n    import zp_sim.server\n"
                                   "    importlib.import_module('zp_storm.cli')\n"
                                   "    return 'see the zp_storm docs', {'x': 'zp_sim.cli'}\n")
    assert _mentions(tmp_path / "m.py") == ["m.py:2 zp_sim.server", "m.py:3 zp_storm.cli",
                                            "m.py:4 zp_sim.cli"]


def test_the_library_distribution_ships_the_library_only() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["zp_client"]
    deps = " ".join(project["project"]["dependencies"]).lower()
    for other in ("zp-sim", "zp-storm", "starlette", "uvicorn", "matplotlib", "rich", "langchain-core"):
        assert other not in deps, other
    extras = project["project"]["optional-dependencies"]
    assert "sim" not in extras and "bench" not in extras  # distributions now, not extras
    # each of the other two declares its command in the entry-point group the CLI reads
    for folder, name, command in (("sim", "zp-sim", "sim"), ("storm", "zp-storm", "storm")):
        other = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        assert other["name"] == name
        assert other["entry-points"][cli.COMMAND_GROUP] == {command: f"{name.replace('-', '_')}.cli"}


def test_installed_commands_are_found_through_the_entry_point_group() -> None:
    eps = cli.command_entry_points()
    missing = [c for c in cli.DISTRIBUTION_COMMANDS if c not in eps]
    if missing:
        pytest.skip(f"not installed here: {missing} (pip install -e sim/ -e storm/)")
    for command in cli.DISTRIBUTION_COMMANDS:
        module = eps[command].load()
        assert callable(module.add_arguments) and callable(module.run)
        assert eps[command].dist is not None
        assert eps[command].dist.name == cli.DISTRIBUTION_COMMANDS[command][0]
    parser = cli.build_parser()
    assert parser.parse_args(["storm", "--workload", "agentic"]).workload == "agentic"


def test_without_the_entry_points_the_command_names_its_distribution(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "command_entry_points", dict)
    for command, dist in (("sim", "zp-sim"), ("storm", "zp-storm")):
        assert cli.main([command, "--anything", "x"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == cli.missing_distribution(command) and "\n" not in err
        assert f"needs the {dist} distribution" in err and f"pip install {dist}" in err
