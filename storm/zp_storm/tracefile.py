"""Request traces for the storm, read and validated line by line.

Three formats (docs/benchmark.md#your-own-traffic):

* ``replay``: a team's own requests, one JSON object a line, with the field names of shared/REPLAY.md:
  ``arrival_s`` (seconds) or ``arrival_step`` (engine steps), ``prompt_tokens``, ``max_tokens`` (the
  client's bound), optional ``output_tokens`` (the true length; default ``max_tokens``, REPLAY.md's
  meaning), ``id``, ``prefix_id`` + ``prefix_len``, ``priority`` (int, lower = more urgent), ``stream``.
* ``azure``: the Azure LLM inference trace CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``).
* ``mooncake``: the Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``).

``auto`` picks one from the extension (``.csv``: azure) or the first record's fields. Arrivals must not
decrease (a file out of order is rejected, not sorted: the line says where). Every malformed line raises
:class:`TraceFileError` naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from zp_client.errors import ConfigurationError

__all__ = [
    "REPLAY_FIELDS",
    "TRACE_FORMATS",
    "TraceFile",
    "TraceFileError",
    "TraceRow",
    "detect_format",
    "read_trace",
    "trace_context_len",
]

#: What ``--trace-format`` accepts.
TRACE_FORMATS: tuple[str, ...] = ("auto", "replay", "azure", "mooncake")

#: Every field a ``replay`` line may carry (anything else is rejected as a likely typo).
REPLAY_FIELDS: tuple[str, ...] = ("id", "arrival_s", "arrival_step", "prompt_tokens", "max_tokens",
                                  "output_tokens", "prefix_id", "prefix_len", "priority", "stream")

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFileError(ConfigurationError):
    """A trace file is unreadable or a line of it is malformed. ``path``, ``line`` (1-based, None for the
    whole file) and ``field`` (None when no single field is at fault) say where; the message is one line."""

    def __init__(self, path: Path | str, line: int | None, field: str | None, problem: str) -> None:
        self.path = Path(path)
        self.line = line
        self.field = field
        where = str(path)
        if line is not None:
            where += f", line {line}"
        if field is not None:
            where += f", field {field!r}"
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace. ``t`` is in the file's time unit (:attr:`TraceFile.time_unit`) from its
    start; ``max_tokens`` is None when the format has no client bound (Azure, Mooncake)."""

    t: float
    prompt: int
    out: int
    hash_ids: tuple[int, ...] = ()
    max_tokens: int | None = None
    id: str | None = None
    prefix_id: str | None = None
    prefix_len: int = 0
    priority: int | None = None
    stream: bool = True
    line: int = 0


@dataclass(frozen=True)
class TraceFile:
    """A validated trace: its rows in arrival order, the format it was read as, and the unit of ``t``
    (``"s"``, or ``"step"`` for a replay file with ``arrival_step``)."""

    path: Path
    format: str
    rows: tuple[TraceRow, ...]
    time_unit: str = "s"


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(path: Path, line: int, rec: Mapping[str, Any], key: str, minimum: int | None) -> int:
    """An integer field (an integral float such as ``12.0`` counts), at least ``minimum``."""
    value = rec[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFileError(path, line, key, f"must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise TraceFileError(path, line, key, f"must be >= {minimum}, got {value}")
    return value


def _number(path: Path, line: int, rec: Mapping[str, Any], key: str) -> float:
    """A finite number >= 0."""
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceFileError(path, line, key, f"must be a number, got {_show(value)}")
    if value < 0:
        raise TraceFileError(path, line, key, f"must be >= 0, got {value}")
    return float(value)


def _require(path: Path, line: int, rec: Mapping[str, Any], *keys: str) -> None:
    for key in keys:
        if key not in rec or rec[key] is None:
            raise TraceFileError(path, line, key, "missing required field")


def _check_order(path: Path, line: int, key: str, t: float, prev: tuple[float, int, str] | None,
                 shown: str) -> tuple[float, int, str]:
    """Reject an arrival earlier than the previous line's; return this line's, for the next check."""
    if prev is not None and t < prev[0]:
        raise TraceFileError(
            path, line, key,
            f"{shown} is earlier than line {prev[1]}'s {prev[2]}; arrivals must not decrease "
            "(sort the file by arrival first)")
    return t, line, shown


def _invalid_json(path: Path, line: int, exc: json.JSONDecodeError) -> TraceFileError:
    return TraceFileError(path, line, None, f"invalid JSON: {exc.msg} (column {exc.colno})")


def _json_lines(path: Path, text: str) -> list[tuple[int, dict[str, Any]]]:
    out: list[tuple[int, dict[str, Any]]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _invalid_json(path, lineno, exc) from None
        if not isinstance(rec, dict):
            raise TraceFileError(path, lineno, None, f"expected a JSON object, got {type(rec).__name__}")
        out.append((lineno, rec))
    return out


def _read_replay(path: Path, text: str) -> TraceFile:
    rows: list[TraceRow] = []
    seen: dict[str, int] = {}
    unit: tuple[str, int] | None = None  # the arrival field of the first line, and that line
    prev: tuple[float, int, str] | None = None
    for index, (line, rec) in enumerate(_json_lines(path, text)):
        for key in rec:
            if key not in REPLAY_FIELDS:
                raise TraceFileError(path, line, key, f"unknown field (known: {', '.join(REPLAY_FIELDS)})")
        has_s, has_step = rec.get("arrival_s") is not None, rec.get("arrival_step") is not None
        if has_s and has_step:
            raise TraceFileError(path, line, "arrival_step", "give arrival_s or arrival_step, not both")
        if not (has_s or has_step):
            raise TraceFileError(path, line, "arrival_s", "missing required field (or give arrival_step)")
        key = "arrival_s" if has_s else "arrival_step"
        if unit is None:
            unit = (key, line)
        elif key != unit[0]:
            raise TraceFileError(path, line, key,
                                 f"line {unit[1]} uses {unit[0]}; every line must use the same arrival field")
        t = _number(path, line, rec, key) if has_s else float(_int(path, line, rec, key, 0))
        prev = _check_order(path, line, key, t, prev, f"{rec[key]}")
        _require(path, line, rec, "prompt_tokens", "max_tokens")
        prompt = _int(path, line, rec, "prompt_tokens", 1)
        bound = _int(path, line, rec, "max_tokens", 1)
        out = bound
        if rec.get("output_tokens") is not None:
            out = _int(path, line, rec, "output_tokens", 1)
            if out > bound:
                raise TraceFileError(path, line, "output_tokens",
                                     f"{out} exceeds max_tokens {bound} (a request stops at its bound)")
        rid = rec.get("id", str(index))
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise TraceFileError(path, line, "id", f"must be a string or an integer, got {_show(rid)}")
        rid = str(rid)
        if rid in seen:
            raise TraceFileError(path, line, "id", f"duplicate id {rid!r} (first on line {seen[rid]})")
        seen[rid] = line
        prefix_id: str | None = None
        prefix_len = 0
        if rec.get("prefix_id") is not None:
            pid = rec["prefix_id"]
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise TraceFileError(path, line, "prefix_id",
                                     f"must be a string or an integer, got {_show(pid)}")
            prefix_id = str(pid)
            _require(path, line, rec, "prefix_len")
            prefix_len = _int(path, line, rec, "prefix_len", 0)
            if prefix_len > prompt:
                raise TraceFileError(path, line, "prefix_len",
                                     f"{prefix_len} is longer than prompt_tokens {prompt}")
        elif rec.get("prefix_len") is not None:
            raise TraceFileError(path, line, "prefix_id", "missing (prefix_len needs a prefix_id)")
        priority = _int(path, line, rec, "priority", None) if rec.get("priority") is not None else None
        stream = rec.get("stream", True)
        if not isinstance(stream, bool):
            raise TraceFileError(path, line, "stream", f"must be true or false, got {_show(stream)}")
        rows.append(TraceRow(t, prompt, out, max_tokens=bound, id=rid, prefix_id=prefix_id,
                             prefix_len=prefix_len, priority=priority, stream=stream, line=line))
    if not rows:
        raise TraceFileError(path, None, None, "empty trace: no requests")
    time_unit = "s" if unit is not None and unit[0] == "arrival_s" else "step"
    return TraceFile(path, "replay", tuple(rows), time_unit)


def _read_azure(path: Path, text: str) -> TraceFile:
    rows: list[TraceRow] = []
    t0: datetime | None = None
    prev: tuple[float, int, str] | None = None
    reader = csv.DictReader(text.splitlines())
    header = reader.fieldnames or []
    for col in _AZURE_COLUMNS:
        if header and col not in header:
            raise TraceFileError(path, 1, col, f"missing column (the header is {','.join(header)})")
    for rec in reader:
        line = reader.line_num
        _require(path, line, rec, *_AZURE_COLUMNS)
        ts = rec["TIMESTAMP"].strip()
        # 7 fractional digits: trim to the 6 that datetime parses
        head, _, frac = ts.partition(".")
        try:
            when = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")
        except ValueError:
            raise TraceFileError(path, line, "TIMESTAMP",
                                 f"not a date and time (YYYY-MM-DD HH:MM:SS.ffffff): {_show(ts)}") from None
        t0 = t0 or when
        t = (when - t0).total_seconds()
        prev = _check_order(path, line, "TIMESTAMP", t, prev, ts)
        values: dict[str, Any] = {}
        for col in _AZURE_COLUMNS[1:]:
            raw = rec[col].strip()
            try:
                values[col] = int(raw)
            except ValueError:
                values[col] = raw
        rows.append(TraceRow(t, _int(path, line, values, "ContextTokens", 1),
                             _int(path, line, values, "GeneratedTokens", 1), line=line))
    if not rows:
        raise TraceFileError(path, None, None, "empty trace: no requests")
    return TraceFile(path, "azure", tuple(rows))


def _read_mooncake(path: Path, text: str) -> TraceFile:
    raw: list[tuple[int, float, int, int, tuple[int, ...]]] = []
    prev: tuple[float, int, str] | None = None
    for line, rec in _json_lines(path, text):
        _require(path, line, rec, "timestamp", "input_length", "output_length")
        ts = _number(path, line, rec, "timestamp")
        prev = _check_order(path, line, "timestamp", ts, prev, f"{rec['timestamp']}")
        hashes = rec.get("hash_ids", [])
        if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hashes):
            raise TraceFileError(path, line, "hash_ids", "must be a list of integers")
        prompt = _int(path, line, rec, "input_length", 1)
        raw.append((line, ts, prompt, _int(path, line, rec, "output_length", 1), tuple(hashes)))
    if not raw:
        raise TraceFileError(path, None, None, "empty trace: no requests")
    # Timestamps sit on a ~3 s grid (most gaps are 0): spread the requests of one grid step evenly
    # over the step that ends at the next distinct timestamp, keeping their order.
    out: list[TraceRow] = []
    i = 0
    while i < len(raw):
        j = i
        while j < len(raw) and raw[j][1] == raw[i][1]:
            j += 1
        start = raw[i][1] / 1000
        end = raw[j][1] / 1000 if j < len(raw) else start + 3.0
        step = (end - start) / (j - i)
        for k in range(i, j):
            line, _, prompt, n_out, hashes = raw[k]
            out.append(TraceRow(start + (k - i) * step, prompt, n_out, hashes, line=line))
        i = j
    return TraceFile(path, "mooncake", tuple(out))


_READERS = {"replay": _read_replay, "azure": _read_azure, "mooncake": _read_mooncake}


def detect_format(path: Path, text: str) -> str:
    """The format of a trace: ``.csv`` is azure; otherwise the first record decides (``prompt_tokens``:
    replay, ``input_length``: mooncake, an Azure CSV header: azure)."""
    if path.suffix.lower() == ".csv":
        return "azure"
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        first = raw.strip()
        if first.startswith("{"):
            try:
                rec = json.loads(first)
            except json.JSONDecodeError as exc:
                raise _invalid_json(path, lineno, exc) from None
            if isinstance(rec, dict) and "prompt_tokens" in rec:
                return "replay"
            if isinstance(rec, dict) and "input_length" in rec:
                return "mooncake"
        elif all(col in first for col in _AZURE_COLUMNS):
            return "azure"
        raise TraceFileError(
            path, lineno, None,
            "unknown trace format: expected JSON lines with prompt_tokens (replay) or input_length "
            "(Mooncake), or an Azure CSV header (TIMESTAMP,ContextTokens,GeneratedTokens); "
            "or give --trace-format")
    raise TraceFileError(path, None, None, "empty trace: no requests")


def read_trace(path: Path | str, fmt: str = "auto") -> TraceFile:
    """Read and validate a trace file; ``fmt`` is one of :data:`TRACE_FORMATS`. Any problem raises
    :class:`TraceFileError` (a :class:`~zp_client.errors.ConfigurationError`)."""
    p = Path(path)
    if fmt not in TRACE_FORMATS:
        raise TraceFileError(p, None, None,
                             f"unknown trace format {fmt!r}; choose one of: {', '.join(TRACE_FORMATS)}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(p, None, None, f"cannot read the trace: {exc}") from None
    if fmt == "auto":
        fmt = detect_format(p, text)
    return _READERS[fmt](p, text)


def trace_context_len(trace: TraceFile, *, floor: int, default_bound: int = 1024,
                      block_size: int = 16) -> int:
    """A ``max_model_len`` that holds the trace's longest request (prompt + client bound + 16 tokens of
    slack, in whole blocks), at least ``floor``. Rows without a bound count ``max(default_bound, output)``,
    the bound the built-in trace replays give them."""
    need = max(r.prompt + (r.max_tokens if r.max_tokens is not None else max(default_bound, r.out)) + 16
               for r in trace.rows)
    return max(floor, -(-need // block_size) * block_size)
