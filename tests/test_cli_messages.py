"""The CLI's own messages (issue 33, item 13): a bad ``--profile`` is one line, ``sim --help`` shows
readable placeholders and a help text for every option, a missing extra names the install command that
fits where zp-client runs from (its clone first when it runs from one)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import zp_client.errors as errors
from zp_client.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "zp_client.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=ROOT)


@pytest.mark.slow
def test_storm_with_an_unknown_profile_is_one_line_and_exit_code_2() -> None:
    proc = _cli("storm", "--profile", "nosuch", "--out", "unused")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "nosuch" in lines[0] and "tiny" in lines[0] and lines[0].startswith("zp-client storm:")
    assert not (ROOT / "unused").exists()  # refused before anything ran


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_sim_help_has_no_dest_placeholders_and_every_option_has_help(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sim", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--port PORT" in out
    assert "SIM_" not in out, out
    sim = _subparser("sim")
    helpless = [a.option_strings for a in sim._actions if a.option_strings and not a.help]
    assert helpless == [], helpless


def test_storm_profile_option_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["storm", "--help"])
    assert "--profile NAME" in capsys.readouterr().out


def test_install_hint_from_a_clone_names_the_clone_first() -> None:
    # the tests run from the clone (a source tree with zp-client's pyproject.toml)
    hint = errors.install_hint("redis")
    clone = f"pip install -e '{ROOT}[redis]'"
    assert hint.startswith(clone), hint
    assert "pip install 'zp-client[redis]'" in hint  # the PyPI way is named too


def test_install_hint_outside_a_clone_names_pypi_first(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site-packages" / "zp_client"
    pkg.mkdir(parents=True)
    monkeypatch.setattr(errors, "__file__", str(pkg / "errors.py"))
    hint = errors.install_hint("redis")
    assert hint.startswith("pip install 'zp-client[redis]'"), hint
    assert "pip install -e '.[redis]'" in hint


def test_a_missing_extra_on_the_cli_names_the_clone_first() -> None:
    prelude = ("import sys\nsys.modules['redis'] = None\n"
               "from zp_client.cli import main\nraise SystemExit(main())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = ["status", "--redis", "redis://127.0.0.1:1/0", "--name", "n"]
    proc = subprocess.run([sys.executable, "-c", prelude, *args], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line
    assert line.index(f"pip install -e '{ROOT}[redis]'") < line.index("pip install 'zp-client[redis]'"), line


def test_a_distributions_hint_names_the_clone_first_and_pypi_outside_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zp_client import cli

    hint = cli.distribution_hint("storm")  # the tests run from the clone: sim/ and storm/ are in it
    assert hint.startswith(f"pip install -e {ROOT / 'sim'} -e {ROOT / 'storm'}"), hint
    assert "pip install zp-storm" in hint
    assert cli.distribution_hint("sim").startswith(f"pip install -e {ROOT / 'sim'} ")
    pkg = tmp_path / "site-packages" / "zp_client"
    pkg.mkdir(parents=True)
    monkeypatch.setattr(cli, "__file__", str(pkg / "cli.py"))
    hint = cli.distribution_hint("storm")
    assert hint.startswith("pip install zp-storm"), hint
    assert "pip install -e sim/ -e storm/" in hint
