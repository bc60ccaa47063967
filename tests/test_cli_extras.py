"""A missing extra or distribution ends in one line naming it (no traceback), and ``zp-client --version``.

Each case runs the command in a fresh interpreter whose prelude blocks the extra's packages
(``sys.modules[name] = None`` makes every ``import name`` / ``import name.sub`` fail with
ModuleNotFoundError, as on a machine where they were never installed), or hides the zp-sim / zp-storm
distributions' ``zp_client.commands`` entry points (as where they were never installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zp_client
from zp_client.cli import main, version

ROOT = Path(__file__).resolve().parent.parent

SIM_ONLY = ["starlette", "uvicorn"]
BENCH_ONLY = ["rich", "matplotlib", "langchain_core"]
# Hides every zp_client.commands entry point: zp-sim and zp-storm as if not installed.
NO_COMMANDS = ("import importlib.metadata as _md\n_eps = _md.entry_points\n"
               "def _no_commands(**kw):\n"
               "    return _md.EntryPoints([]) if kw.get('group') == 'zp_client.commands' else _eps(**kw)\n"
               "_md.entry_points = _no_commands\n")


def _installed(command: str) -> bool:
    from zp_client.cli import command_entry_points

    return command in command_entry_points()


needs_sim = pytest.mark.skipif(not _installed("sim"), reason="zp-sim is not installed: pip install -e sim/")
needs_storm = pytest.mark.skipif(not _installed("storm"),
                                 reason="zp-storm is not installed: pip install -e sim/ -e storm/")


def _run(blocked: list[str], code: str, *args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor _m in {blocked!r}:\n    sys.modules[_m] = None\n" + prelude
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


CLI = "from zp_client.cli import main\nraise SystemExit(main())"


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@needs_sim
@pytest.mark.slow
def test_sim_without_its_requirements_names_the_distribution() -> None:
    proc = _run(SIM_ONLY, CLI, "sim", "--port", "0", "--profile", "tiny")
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc)
    assert line.startswith("zp-client sim needs zp-sim's requirements"), line
    assert f"pip install -e {ROOT / 'sim'}" in line and "pip install zp-sim" in line
    assert re.search(r"no module named '(starlette|uvicorn)'", line), line


@needs_storm
@pytest.mark.parametrize("args", [["storm", "--workload", "seed-burst", "--out", "x"], ["storm"]])
def test_storm_without_its_requirements_names_the_distribution(args: list[str]) -> None:
    proc = _run(BENCH_ONLY, CLI, *args)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc)
    assert line.startswith("zp-client storm needs zp-storm's requirements"), line
    # both distributions, the simulator first (zp-storm requires zp-sim, which is not on PyPI either)
    assert f"pip install -e {ROOT / 'sim'} -e {ROOT / 'storm'}" in line and "pip install zp-storm" in line


@needs_storm
@pytest.mark.slow
def test_storm_without_the_sim_packages_also_names_the_storm() -> None:
    """zp-storm requires zp-sim: what storm lacks, installing both brings."""
    proc = _run(SIM_ONLY, CLI, "storm", "--workload", "seed-burst", "--out", "x")
    assert proc.returncode == 2, proc.stderr
    assert "pip install zp-storm" in _one_line(proc)


@pytest.mark.parametrize("command, dist", [("sim", "zp-sim"), ("storm", "zp-storm")])
def test_a_command_whose_distribution_is_not_installed_names_it(command: str, dist: str) -> None:
    for args in ([command], [command, "--workload", "seed-burst", "--out", "x"]):
        proc = _run([], CLI, *args, prelude=NO_COMMANDS)
        assert proc.returncode == 2, proc.stderr
        line = _one_line(proc)
        assert line.startswith(f"zp-client {command} needs the {dist} distribution (not installed"), line
        assert f"pip install {dist}" in line and f"-e {ROOT / command}" in line
    # and it is still listed by --help
    proc = _run([], CLI, "--help", prelude=NO_COMMANDS)
    assert proc.returncode == 0 and command in proc.stdout, proc.stderr


def test_a_missing_module_that_is_not_a_requirement_keeps_its_traceback() -> None:
    from importlib.metadata import EntryPoint

    from zp_client.cli import command_entry_points, missing_dependency

    eps = command_entry_points()
    if "storm" not in eps:
        pytest.skip("zp-storm is not installed: pip install -e sim/ -e storm/")
    assert missing_dependency("storm", eps["storm"], ModuleNotFoundError(name="notapackage")) is None
    line = missing_dependency("storm", eps["storm"], ModuleNotFoundError(name="matplotlib.pyplot"))
    assert line is not None and "'matplotlib'" in line
    # an entry point without a distribution (none to read requirements from): always the traceback
    bare = EntryPoint(name="x", value="x.cli", group="zp_client.commands")
    assert missing_dependency("x", bare, ModuleNotFoundError(name="matplotlib")) is None


def test_redis_budget_without_redis_is_an_import_error_naming_the_extra() -> None:
    code = (
        "try:\n"
        "    from zp_client import RedisBudget\n"
        "except ImportError as exc:\n"
        "    from zp_client.errors import MissingIntegration\n"
        "    assert isinstance(exc, MissingIntegration), type(exc)\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported')\n"
    )
    proc = _run(["redis"], code)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'zp-client[redis]'" in proc.stdout and "RedisBudget" in proc.stdout


def test_status_of_a_redis_budget_without_redis_names_the_extra() -> None:
    proc = _run(["redis"], CLI, "status", "--redis", "redis://127.0.0.1:1/0", "--name", "n")
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'zp-client[redis]'" in _one_line(proc)


@pytest.mark.slow
def test_every_help_works_without_any_extra() -> None:
    """The parser is built for every subcommand, so no subcommand's extra may be needed to build it."""
    blocked = SIM_ONLY + BENCH_ONLY + ["redis", "openai"]
    for args in (["--help"], ["status", "--help"], ["calibrate", "--help"]):
        proc = _run(blocked, CLI, *args)
        assert proc.returncode == 0 and "usage: zp-client" in proc.stdout, proc.stderr


@pytest.mark.slow
def test_version_prints_the_distribution_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"zp-client {version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version())
    proc = _run([], CLI, "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"zp-client {version()}", proc.stderr


def test_version_falls_back_to_the_package_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version() == zp_client.__version__


def test_package_version_matches_pyproject() -> None:
    found = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found and found[1] == zp_client.__version__
