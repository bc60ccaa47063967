"""Shared fixtures.

Redis: the session reuses the server on 127.0.0.1:6379 when it answers; otherwise it starts its own
``redis-server`` on a free port (and fails with a clear message when there is no binary). Tests never
touch keys they did not create: every test gets a unique budget name / key prefix (``redis_prefix``).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(port: int | None = None, extra_args: list[str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """Start a throw-away redis-server on loopback; returns (process, port)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "these tests need Redis: nothing answers on 127.0.0.1:6379 and no 'redis-server' binary is on "
            "PATH (install it, e.g. 'apt-get install redis-server')",
            pytrace=False,
        )
    port = port or _free_port()
    workdir = tempfile.mkdtemp(prefix="zp-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, *(extra_args or [])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _redis_answers("127.0.0.1", port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"redis-server did not start on port {port}", pytrace=False)
        time.sleep(0.02)
    return proc, port


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis server for the tests (db 0; keys are always prefixed per test)."""
    forced = os.environ.get("ZP_TEST_REDIS_URL")
    if forced:
        yield forced
        return
    if os.environ.get("ZP_TEST_OWN_REDIS") != "1" and _redis_answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    proc, port = start_redis_server()
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def redis_prefix() -> str:
    """A unique name for this test's Redis keys / budget (never collides with other tests or users)."""
    return f"zptest-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def names(redis_url: str, redis_prefix: str) -> Iterator[list[str]]:
    """Budget names for a test, starting with ``redis_prefix``; the test may append more. Every name's
    keys are deleted afterwards."""
    from tests._redis_keys import delete_keys

    out = [redis_prefix]
    yield out
    delete_keys(redis_url, *out)


# ------------------------------------------------------------------- the fault tests' results table
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fault-report", default=None, metavar="PATH",
                     help="append the fault tests' rows (JSON lines) to PATH and print them as a table at "
                          "the end (default: $ZP_FAULT_REPORT; `make faults` sets it)")
    parser.addoption("--full-scale", action="store_true", default=False,
                     help="run the CPU-bound fault storms at the issue's scale (the 5,000 cancelled "
                          "requests; `make faults` sets it); without it they run smaller, beside everything "
                          "else in `make test`")


_FAULT_ROWS: list[dict[str, Any]] = []


@pytest.fixture
def fault_report(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Records one row per fault scenario, from what the test measured (tests/_fault_report.py)."""
    from dataclasses import asdict

    from _fault_report import FaultReport, report_path

    rep = FaultReport(report_path(request.config.getoption("--fault-report")), request.node.nodeid)
    try:
        yield rep
    finally:
        _FAULT_ROWS.extend(asdict(r) for r in rep.rows)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from _fault_report import format_table, report_path

    if not _FAULT_ROWS or report_path(config.getoption("--fault-report", None)) is None:
        return
    failed = {r.nodeid for r in terminalreporter.stats.get("failed", [])}
    terminalreporter.section("fault scenarios (issue 33)")
    for line in format_table(_FAULT_ROWS, failed).splitlines():
        terminalreporter.write_line(line)


# ------------------------------------------------------------------- the collector's heap (make test-fast)
class _FreezeTheLongLived:
    """Moves what lives for the whole session into the garbage collector's permanent generation: what
    collection built (the test modules and every library they import: about 670,000 objects with the
    frameworks' tests) and the modules a test imports lazily (after that test, once its garbage is
    collected, so that none of it is pinned).

    Those objects were walked again by every full collection: about 0.5 s each on 2 cores, dozens of
    times per process (the automatic ones and the tests' own ``gc.collect()``), a third of
    `make test-fast`'s CPU and a pause of every thread (a loopback server's included) while it ran. The
    objects a test creates are not frozen while it runs: their cycles are collected as before.
    Registered as a plugin, not as this conftest's hooks: those would see only the reports of nodes
    under tests/, not sim/tests, storm/tests or the integrations' tests (docs/testing.md)."""

    def __init__(self) -> None:
        self._modules = 0

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        gc.freeze()
        self._modules = len(sys.modules)

    def pytest_runtest_logfinish(self, nodeid: str, location: object) -> None:
        if len(sys.modules) > self._modules:
            gc.collect()
            gc.freeze()
            self._modules = len(sys.modules)


# ------------------------------------------------------------------- make test: the serial share
# Slow tests that read no wall clock (state machines on the ledger or on Redis's scripts with explicit
# times, virtual-clock storms): they may run beside the tests marked ``serial`` below.
_BESIDE_THE_SERIAL_ONES = (
    "tests/budget/test_redis_claim.py::test_the_claim_handshake_conforms_long",
    "tests/budget/test_redis_reclaim.py::test_late_renewals_conform_long",
    "tests/budget/test_budget_conformance.py::",
    "tests/budget/test_ledger.py::TestLedgerStateful",
    "tests/budget/test_pinning_redis.py::test_redis_pins_conform_to_the_pin_book",
    "storm/tests/test_storm_mixed.py::",
    "storm/tests/test_storm_virtual_time.py::test_two_runs_of_one_seed_give_identical_records",
    "storm/tests/test_storm_bypass.py::test_bypass_zero_and_a_window_after_the_run",
    "storm/tests/test_storm_bypass.py::test_the_selection_is_exact_deterministic",
)


class _SerialMark:
    """Marks ``serial`` every test marked ``slow`` or ``faults`` (real-clock storms, several processes on
    one Redis, SIGSTOP/SIGKILL of a redis-server, timing-bound races) except the few that read no wall
    clock (``_BESIDE_THE_SERIAL_ONES``). `make test` (.ci/pytest-halves) runs ``-m serial`` in one process,
    one test at a time as before, beside a second process running the rest (docs/testing.md#make-test).
    A plugin's ``pytest_itemcollected``, so the mark is there before ``-m`` selects (for every test
    path, not only tests/)."""

    def pytest_itemcollected(self, item: pytest.Item) -> None:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("faults") is None:
            return
        if not item.nodeid.startswith(_BESIDE_THE_SERIAL_ONES):
            item.add_marker(pytest.mark.serial)



# ------------------------------------------------------------------- nothing left unretrieved
class _NothingUnretrieved(logging.Handler):
    """Fails the test during which asyncio logged "... exception was never retrieved": a future or task
    that ended with an exception nobody read, a bug in the code under test (the garbage collector meets
    it later, so the test named is the one running then; the origin is in the traceback printed).
    Besides being a bug, on CPython 3.11 that log line can break an ``ast.parse`` running in the same
    thread ("AST constructor recursion depth mismatch", gh-106905): CI failed so in unrelated tests."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "never retrieved" in record.getMessage():
            self.seen.append(self.format(record))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Any:
        result = yield
        if self.seen:
            seen, self.seen = self.seen, []
            raise AssertionError("asyncio logged an exception nobody retrieved (garbage collected during "
                                 f"{item.nodeid}):\n" + "\n".join(seen))
        return result


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_FreezeTheLongLived(), "zp-freeze-the-long-lived")
    config.pluginmanager.register(_SerialMark(), "zp-serial-mark")
    unretrieved = _NothingUnretrieved()
    logging.getLogger("asyncio").addHandler(unretrieved)
    config.pluginmanager.register(unretrieved, "zp-nothing-unretrieved")


# ------------------------------------------------------------------- the wheel alone (make test-wheel)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``needs_sim`` where the simulator (zp-sim) is not installed.

    `make test-wheel` runs the library's tests against the zp-client wheel alone; every other run has
    zp-sim installed (editable), so nothing is skipped there.
    """
    if importlib.util.find_spec("zp_sim") is not None:
        return
    skip = pytest.mark.skip(reason="needs the simulator: zp-sim is not installed (pip install -e sim/)")
    for item in items:
        if item.get_closest_marker("needs_sim") is not None:
            item.add_marker(skip)
