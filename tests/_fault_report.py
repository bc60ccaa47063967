"""The fault tests' results table (``make faults``; issue 33) and what the tests measure it with.

Each fault scenario records one row through the ``fault_report`` fixture (tests/conftest.py): the values
the test measured, never constants. Rows go to a JSON-lines file when ``--fault-report PATH`` or the
``ZP_FAULT_REPORT`` environment variable names one (``make faults`` does), and pytest's terminal summary
then prints them as a markdown table (:func:`format_table`). Columns:

- ``over_admission``: blocks above the limit, the most seen. Under strict: the sum of the bounds of the
  leases their holders still believe they hold (granted, not released, not lost), sampled every 10 ms
  (:class:`HeldSampler`); across processes, the sum of live leases' bounds on Redis's own clock.
- ``leaked_blocks``: blocks still held when everything should be back.
- ``recover_s``: from the fault's end (kill, SIGCONT, restart, abandonment) until the budget is whole.
- ``error`` / ``error_latency_s``: what the caller saw and how long after its own deadline or timeout
  (or after its cancel) it saw it; reported against :data:`LATENCY_TARGET_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LATENCY_TARGET_S = 0.100
ENV = "ZP_FAULT_REPORT"


@dataclass
class FaultRow:
    scenario: str
    fault: str
    over_admission: int | None = None
    leaked_blocks: int | None = None
    recover_s: float | None = None
    recover_bound_s: float | None = None
    error: str | None = None
    error_latency_s: float | None = None
    notes: str = ""
    test: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class FaultReport:
    """What ``fault_report`` gives a test: call it once per scenario with the measured values."""

    def __init__(self, path: Path | None, nodeid: str) -> None:
        self.path = path
        self.nodeid = nodeid
        self.rows: list[FaultRow] = []

    def __call__(self, scenario: str, fault: str, **values: Any) -> FaultRow:
        row = FaultRow(scenario=scenario, fault=fault, test=self.nodeid, **values)
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
        return row


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _num(v: float | None, unit: str = "", fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v) + unit


def format_table(rows: Iterable[dict[str, Any]], failed: set[str] | frozenset[str] = frozenset()) -> str:
    """The rows as a markdown table (a failed test's rows say so in the last column)."""
    head = ["scenario", "injected fault", "over-admission (blocks)", "leaked blocks", "time to recover",
            "caller-visible error", f"error latency (target {LATENCY_TARGET_S * 1000:.0f} ms)", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rec = _num(r["recover_s"], " s")
        if r["recover_s"] is not None and r.get("recover_bound_s") is not None:
            rec += f" (bound {r['recover_bound_s']:g} s)"
        lat = r["error_latency_s"]
        lat_s = "—" if lat is None else (
            f"{lat * 1000:.0f} ms " + ("ok" if lat <= LATENCY_TARGET_S else "OVER target"))
        notes = r["notes"] + (" **TEST FAILED**" if r["test"] in failed else "")
        cells = [r["scenario"], r["fault"], _num(r["over_admission"], fmt="{:d}"),
                 _num(r["leaked_blocks"], fmt="{:d}"), rec, r["error"] or "none", lat_s, notes]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ measurements
class HeldSampler:
    """Samples every ``interval_s`` (10 ms) the blocks bound by the leases their holders still believe
    they hold (``leases()``: every lease granted so far; released or lost ones do not count) and keeps
    the most seen above ``limit``: the over-admission of a strict budget. An async context manager."""

    def __init__(self, limit: int, leases: Callable[[], Iterable[Any]], interval_s: float = 0.010) -> None:
        self.limit = limit
        self.leases = leases
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self.max_lag_s = 0.0  # the event loop's longest lateness waking the sampler (a starved machine)
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> int:
        held = sum(le.bound for le in list(self.leases()) if not le.released and not le.lost)
        self.peak = max(self.peak, held)
        self.samples += 1
        return held

    @property
    def over_admission(self) -> int:
        return max(0, self.peak - self.limit)

    async def _run(self) -> None:
        while True:
            self.sample()
            t0 = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.max_lag_s = max(self.max_lag_s, time.monotonic() - t0 - self.interval_s)

    async def __aenter__(self) -> HeldSampler:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sample()


class LatencyProxy:
    """A TCP proxy on loopback that delays every byte by ``delay_s`` in each direction (order and
    pipelining kept: a chunk is written ``delay_s`` after it was read, whatever came before it). It runs
    in a process of its own (as a real network's delay would: it takes no time from the test's process).
    A context manager; ``port`` is where to connect."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LatencyProxy:
        self._proc = subprocess.Popen([sys.executable, __file__, str(self.target_port), repr(self.delay_s)],
                                      stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], 20)
        line = self._proc.stdout.readline() if ready else b""
        if not line.strip():
            self._proc.kill()
            raise RuntimeError("the latency proxy did not start within 20 s")
        self.port = int(line)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.ensure_future(send())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((time.monotonic() + delay_s, data))
    except OSError:
        pass
    queue.put_nowait((0.0, b""))
    with contextlib.suppress(OSError):
        await sender


async def _proxy_main(target_port: int, delay_s: float) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_w, delay_s), _pump(up_r, writer, delay_s),
                             return_exceptions=True)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(handle, sock=sock)
    print(sock.getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def report_path(option: str | None) -> Path | None:
    where = option or os.environ.get(ENV)
    return Path(where) if where else None


if __name__ == "__main__":  # the latency proxy's process: target port, delay in seconds
    asyncio.run(_proxy_main(int(sys.argv[1]), float(sys.argv[2])))
