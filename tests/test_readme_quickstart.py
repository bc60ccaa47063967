"""The README's first sections run as written: the install lines name extras that exist, and the quick
start (its ``zp-client sim`` line, its ``zp-client status`` line and its Python block, run as a program)
works against the simulator it starts. Only the port is changed (8000 -> a free one); nothing else in
the snippet is touched, so a snippet that breaks (a model the simulator does not serve, a renamed API)
fails here."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from zp_client.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
README_HOST = "127.0.0.1:8000"  # where the quick start says the simulator listens

# openai_compat: the snippet's wrap() of openai.AsyncOpenAI runs under openai 3.x (httpx2) and 2.x (httpx)
pytestmark = [pytest.mark.slow, pytest.mark.openai_compat]


def section(title: str) -> str:
    """The text of the README's ``## title`` section, up to the next ``## `` heading."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert found, f"README.md has no '## {title}' section"
    return found[1]


def indented_lines(text: str) -> list[str]:
    """The shell lines of a section (markdown code indented by four spaces)."""
    return [line[4:] for line in text.splitlines() if line.startswith("    ") and line.strip()]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def command_line(lines: list[str], prefix: str) -> list[str]:
    """The section's one shell line starting with ``prefix``, as argv (its comment and ``&`` dropped)."""
    matches = [line for line in lines if line.startswith(prefix)]
    assert len(matches) == 1, f"expected one '{prefix}' line in the quick start, got {matches}"
    argv = shlex.split(matches[0], comments=True)
    return argv[:-1] if argv[-1] == "&" else argv


def _env() -> dict[str, str]:
    # nothing from the caller's environment steers the snippet (OPENAI_BASE_URL, ZP_* settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZP_", "OPENAI_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The quick start's ``zp-client sim`` line, run as written but on a free port; its root URL."""
    argv = command_line(indented_lines(section("Quick start")), "zp-client sim")
    assert argv[argv.index("--port") + 1] == README_HOST.split(":")[1]
    argv[argv.index("--port") + 1] = "0"
    log = tmp_path_factory.mktemp("sim") / "stderr.log"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "zp_client.cli", *argv[1:]], stdout=subprocess.DEVNULL,
                                stderr=err, env={**_env(), "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        base_url = None
        while base_url is None:
            found = re.search(r"serving model 'sim-llama' .* at (http://\S+)/v1", log.read_text())
            if found:
                base_url = found[1]
            elif proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"zp-client sim did not start:\n{log.read_text()}")
            else:
                time.sleep(0.05)
        yield base_url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_snippet(code: str, root: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert README_HOST in code, f"the quick start no longer talks to {README_HOST}; update this test"
    program = tmp_path / "quick_start.py"
    program.write_text(code.replace(README_HOST, root.removeprefix("http://")), encoding="utf-8")
    return subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=180,
                          env=_env(), cwd=tmp_path)


def quick_start_code() -> str:
    blocks = python_blocks(section("Quick start"))
    assert len(blocks) == 1, "the quick start has one Python block"
    return blocks[0]


def test_the_quick_start_runs_as_written(sim_root: str, tmp_path: Path) -> None:
    proc = run_snippet(quick_start_code(), sim_root, tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.startswith("20 answers; "), proc.stdout
    assert "used=0" in proc.stdout and "leases=0" in proc.stdout  # every lease returned
    assert "larger than the KV pool" not in proc.stderr  # its budget fits the pool it names
    assert "Traceback" not in proc.stderr, proc.stderr


def test_the_status_line_prints_the_limit_the_snippet_uses(
    sim_root: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = command_line(indented_lines(section("Quick start")), "zp-client status")
    claimed = re.search(r"limit_blocks=(\d+)", section("Quick start").split("zp-client status", 1)[1])
    assert claimed, "the status line's comment says the suggested limit"
    argv[argv.index("--server") + 1] = argv[argv.index("--server") + 1].replace(README_HOST,
                                                                                sim_root.removeprefix("http://"))
    assert main(argv[1:]) == 0
    out = capsys.readouterr().out
    assert f"suggested limit:  limit_blocks={claimed[1]} " in out, out
    assert f"LocalBudget(limit_blocks={claimed[1]})" in quick_start_code()


def test_a_snippet_that_breaks_fails_here(sim_root: str, tmp_path: Path) -> None:
    """The harness can fail: the model name the old README had gets the simulator's 404."""
    broken = quick_start_code().replace('model="sim-llama"', 'model="m"')
    assert broken != quick_start_code()
    proc = run_snippet(broken, sim_root, tmp_path)
    assert proc.returncode != 0
    assert "NotFoundError" in proc.stderr and "404" in proc.stderr, proc.stderr


def test_the_quick_start_with_an_oversized_budget_warns_once(sim_root: str, tmp_path: Path) -> None:
    """Written with a limit larger than the simulator's pool, the same program is told so, once."""
    code = quick_start_code()
    oversized = code.replace("LocalBudget(limit_blocks=511)", "LocalBudget(limit_blocks=25_000)")
    assert oversized != code
    proc = run_snippet(oversized, sim_root, tmp_path)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "larger than the KV pool" in line]
    assert len(warned) == 1, proc.stderr
    assert "limit_blocks=25000" in warned[0] and "511 usable blocks" in warned[0], warned[0]


def test_the_quick_start_against_a_stopped_server_says_it_is_unreachable(tmp_path: Path) -> None:
    """No simulator listening: the program ends in ServerUnreachable naming the URL, with no chained
    errors, at most 3 frames of zp_client, and no word of overload (issue 31)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    root = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()  # nothing listens there: connections are refused
    proc = run_snippet(quick_start_code(), root, tmp_path)
    assert proc.returncode != 0
    said = (f"zp_client.errors.ServerUnreachable: the server at {root}/v1/chat/completions is unreachable: "
            "connection refused")
    assert any(line.startswith(said) for line in proc.stderr.splitlines()), proc.stderr
    assert "During handling" not in proc.stderr and "direct cause" not in proc.stderr, proc.stderr
    assert "overload" not in proc.stderr
    # each traceback printed (the program's, and asyncio's for a gathered task nobody awaited) is short
    tracebacks = proc.stderr.split("Traceback (most recent call last):")[1:]
    assert tracebacks, proc.stderr
    for tb in tracebacks:
        zp_frames = [line for line in tb.splitlines()
                     if line.strip().startswith("File ") and f"{os.sep}zp_client{os.sep}" in line]
        assert 1 <= len(zp_frames) <= 3, tb


def test_the_install_lines_name_extras_that_exist() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([a-z0-9_-]+) = \[", table, re.M))
    lines = indented_lines(section("Install"))
    assert any(line.startswith("pip install -e .") for line in lines)
    named = {e.strip() for line in lines for group in re.findall(r'\.\[([^\]]+)\]', line)
             for e in group.split(",")}
    assert named and named <= extras, f"README names extras pyproject.toml lacks: {named - extras}"
    assert "not published on PyPI" in section("Install")
    paths = re.findall(r"-e ((?:integrations/)?[a-z][\w-]*/?)(?:\s|$)", "\n".join(lines))
    assert {"sim/", "storm/"} <= set(paths), paths  # the simulator's and the storm's distributions
    for path in paths:
        assert (ROOT / path / "pyproject.toml").exists(), path
