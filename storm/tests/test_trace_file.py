"""``zp-client storm --trace FILE``: a team's own requests (replay JSONL, Azure CSV, Mooncake JSONL), read
line by line with errors that name the file, the line and the field, replayed through the storm's setups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zp_client.cli import main
from zp_client.errors import ConfigurationError
from zp_sim.tokenizer import encode, render_chat
from zp_storm.tracefile import TraceFileError, read_trace, trace_context_len
from zp_storm.workloads import ServerFacts, build_workload, find_shared_dir

FACTS = ServerFacts(num_gpu_blocks=2049, block_size=16, max_model_len=8192, unloaded_itl_s=0.0085)


def _write(tmp_path: Path, name: str, lines: list[str | dict]) -> Path:
    p = tmp_path / name
    p.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return p


def _req(t: float, prompt: int = 100, bound: int = 32, **extra: object) -> dict:
    return {"arrival_s": t, "prompt_tokens": prompt, "max_tokens": bound, **extra}


def _tokens(turn) -> list[int]:  # noqa: ANN001 - a Turn
    return encode(render_chat(turn.messages))


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------- formats


def test_replay_lines_keep_every_field_and_default_the_rest(tmp_path: Path) -> None:
    p = _write(tmp_path, "own.jsonl", [
        _req(0.0, 300, 64, output_tokens=20, id="a", priority=-1),
        "",  # blank lines are skipped
        _req(0.5, 120, 32, stream=False),
        _req(0.5, 400, 64.0, prefix_id=7, prefix_len=128),
    ])
    trace = read_trace(p)
    assert trace.format == "replay" and trace.time_unit == "s"
    a, b, c = trace.rows
    assert (a.t, a.prompt, a.max_tokens, a.out, a.id, a.priority, a.stream, a.line) == (
        0.0, 300, 64, 20, "a", -1, True, 1)
    # REPLAY.md's defaults: the id is the record's index, the true output is max_tokens
    assert (b.id, b.out, b.max_tokens, b.stream, b.priority, b.line) == ("1", 32, 32, False, None, 3)
    assert (c.prefix_id, c.prefix_len, c.max_tokens) == ("7", 128, 64)

    wl = build_workload("trace", FACTS, seed=0, path=str(p))
    assert wl.name == "trace:own.jsonl" and str(p) in wl.description
    assert [s.id for s in wl.sessions] == ["a", "1", "2"]
    assert [s.start_s for s in wl.sessions] == [0.0, 0.5, 0.5]
    ta, tb, tc = wl.iter_turns()
    assert (ta.max_tokens, ta.true_out, ta.priority, ta.stream) == (64, 20, -1, True)
    assert (tb.max_tokens, tb.true_out, tb.priority, tb.stream) == (32, 32, None, False)
    assert abs(tb.prompt_tokens - 120) <= 3 and abs(ta.prompt_tokens - 300) <= 3
    assert tc.prompt_tokens == 400  # a prefixed prompt is exact
    # the SLO and the gateway of the built-in trace replays: the interactive SLO, no gateway timeout
    assert wl.slo.ttft_s == 5.0 and wl.slo.tpot_s == pytest.approx(5 * FACTS.unloaded_itl_s)
    assert wl.gateway_timeout_s is None
    assert wl.params["format"] == "replay" and wl.params["lines"] == 3


def test_arrival_steps_become_unloaded_decode_steps(tmp_path: Path) -> None:
    p = _write(tmp_path, "steps.jsonl", [{"arrival_step": 0, "prompt_tokens": 50, "max_tokens": 8},
                                          {"arrival_step": 200, "prompt_tokens": 50, "max_tokens": 8}])
    wl = build_workload("trace", FACTS, seed=0, path=str(p))
    assert wl.params["time_unit"] == "step" and wl.params["step_s"] == FACTS.unloaded_itl_s
    assert wl.sessions[1].start_s == pytest.approx(200 * FACTS.unloaded_itl_s)


def test_azure_csv_is_read_with_the_built_in_bound_rule(tmp_path: Path) -> None:
    p = tmp_path / "mine.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.9799600,1000,10\n"
                 "2023-11-16 18:17:04.4799600,3000,1500\n"
                 "2023-11-16 18:17:05.9799600,7900,100\n")
    trace = read_trace(p)
    assert trace.format == "azure"
    assert [(r.t, r.prompt, r.out, r.max_tokens, r.line) for r in trace.rows] == [
        (0.0, 1000, 10, None, 2), (0.5, 3000, 1500, None, 3), (2.0, 7900, 100, None, 4)]
    wl = build_workload("trace", FACTS, seed=0, path=str(p), time_scale=0.5)
    t1, t2, t3 = wl.iter_turns()
    assert [s.start_s for s in wl.sessions] == [0.0, 0.25, 1.0]
    assert (t1.max_tokens, t1.true_out) == (1024, 10)
    assert (t2.max_tokens, t2.true_out) == (1500, 1500)
    assert t3.max_tokens == 1024 and t3.prompt_tokens + t3.max_tokens <= FACTS.max_model_len
    assert wl.params["prompts_capped_to_context"] == 1


def test_mooncake_jsonl_spreads_grid_steps_and_shares_hash_blocks(tmp_path: Path) -> None:
    p = _write(tmp_path, "mc.jsonl", [
        {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [1, 4]},
        {"timestamp": 3000, "input_length": 300, "output_length": 5, "hash_ids": [9]},
    ])
    trace = read_trace(p)
    assert trace.format == "mooncake"
    assert [r.t for r in trace.rows] == [0.0, 1.5, 3.0]  # the two at t=0 spread over the 3 s step
    assert trace.rows[0].hash_ids == (1, 2, 3)
    wl = build_workload("trace", FACTS, seed=0, path=str(p))
    a, b, _ = (t.messages[0]["content"] for t in wl.iter_turns())
    assert a.split("\n", 1)[0] == b.split("\n", 1)[0] and a != b  # the shared first 512-token block


def test_the_format_is_detected_from_the_extension_or_the_first_record_or_given(tmp_path: Path) -> None:
    replay = _write(tmp_path, "r.log", [_req(0.0)])
    moon = _write(tmp_path, "m.txt", [{"timestamp": 0, "input_length": 5, "output_length": 1}])
    azure = tmp_path / "a.trace"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97996,10,1\n")
    assert [read_trace(x).format for x in (replay, moon, azure)] == ["replay", "mooncake", "azure"]
    assert read_trace(replay, "replay").format == "replay"
    # a format given explicitly wins over detection (and then judges the lines by its own fields)
    with pytest.raises(TraceFileError) as err:
        read_trace(replay, "mooncake")
    assert (err.value.line, err.value.field) == (1, "timestamp")


def _traces_available() -> bool:
    try:
        return (find_shared_dir() / "traces").is_dir()
    except ConfigurationError:
        return False


@pytest.mark.skipif(not _traces_available(), reason="no shared traces folder (set ZP_SHARED_DIR)")
def test_a_file_and_a_built_in_trace_take_the_same_path(tmp_path: Path) -> None:
    src = find_shared_dir() / "traces/azure2023/AzureLLMInferenceTrace_conv.csv"
    p = tmp_path / "conv_head.csv"
    p.write_text("".join(src.read_text().splitlines(keepends=True)[:41]))
    kw = {"time_scale": 0.25, "load_scale": 1.5, "max_requests": 30}
    built_in = build_workload("azure-conv", FACTS, seed=3, **kw)
    mine = build_workload("trace", FACTS, seed=3, path=str(p), **kw)
    assert [(s.id, s.start_s, s.turns[0].messages, s.turns[0].max_tokens, s.turns[0].true_out)
            for s in mine.sessions] == [
        (s.id, s.start_s, s.turns[0].messages, s.turns[0].max_tokens, s.turns[0].true_out)
        for s in built_in.sessions]


# ----------------------------------------------------------------------------------------------- scaling


def test_time_and_load_scale_work_as_for_the_built_in_traces(tmp_path: Path) -> None:
    p = _write(tmp_path, "own.jsonl", [_req(float(k), id=f"r{k}") for k in range(40)])
    one = build_workload("trace", FACTS, seed=0, path=str(p))
    assert one.num_requests == 40 and one.params["time_scale"] == 1.0 and one.params["load_scale"] == 1.0
    fast = build_workload("trace", FACTS, seed=0, path=str(p), time_scale=0.1)
    assert [s.start_s for s in fast.sessions] == pytest.approx([0.1 * s.start_s for s in one.sessions])
    double = build_workload("trace", FACTS, seed=0, path=str(p), load_scale=2.0)
    assert double.num_requests == 80
    assert [s.id for s in double.sessions[:4]] == ["r0", "r0+1", "r1", "r1+1"]
    assert double.sessions[1].start_s == pytest.approx(0.001)
    half = build_workload("trace", FACTS, seed=0, path=str(p), load_scale=0.5)
    assert 8 <= half.num_requests <= 32 and {s.id for s in half.sessions} < {s.id for s in one.sessions}
    assert build_workload("trace", FACTS, seed=0, path=str(p), max_requests=5).num_requests == 5
    # deterministic in the seed
    again = build_workload("trace", FACTS, seed=0, path=str(p), load_scale=0.5)
    assert [t.messages for t in again.iter_turns()] == [t.messages for t in half.iter_turns()]
    with pytest.raises(ConfigurationError, match="load_scale"):
        build_workload("trace", FACTS, seed=0, path=str(p), load_scale=-1.0)


def test_requests_that_do_not_fit_the_context_are_capped_and_counted(tmp_path: Path) -> None:
    p = _write(tmp_path, "long.jsonl", [_req(0.0, 7000, 4000, output_tokens=3000), _req(1.0, 2000, 512)])
    wl = build_workload("trace", FACTS, seed=0, path=str(p))
    big, small = wl.iter_turns()
    assert (big.max_tokens, big.true_out) == (2048, 2048)  # bound capped to max_model_len / 4
    assert big.prompt_tokens + big.max_tokens <= FACTS.max_model_len
    assert (small.max_tokens, small.true_out) == (512, 512) and abs(small.prompt_tokens - 2000) <= 3
    assert wl.params["prompts_capped_to_context"] == 1
    # the CLI's default context holds the longest request instead (in whole blocks, never below the floor)
    trace = read_trace(p)
    assert trace_context_len(trace, floor=8192) == 11024
    assert trace_context_len(trace, floor=16384) == 16384


# ----------------------------------------------------------------------------------------------- prefixes


def test_a_shared_prefix_id_becomes_an_identical_text_prefix_of_the_stated_length(tmp_path: Path) -> None:
    p = _write(tmp_path, "prefix.jsonl", [
        _req(0.0, 600, id="a", prefix_id="sys", prefix_len=400),
        _req(0.1, 900, id="b", prefix_id="sys", prefix_len=400),
        _req(0.2, 500, id="c", prefix_id="sys", prefix_len=250),  # shorter: a prefix of the same text
        _req(0.3, 600, id="d", prefix_id="other", prefix_len=400),
        _req(0.4, 400, id="e", prefix_id="sys", prefix_len=400),  # the whole prompt but the template's tail
    ])
    wl = build_workload("trace", FACTS, seed=0, path=str(p), load_scale=2.0)
    turns = {s.id: s.turns[0] for s in wl.sessions}
    toks = {k: _tokens(t) for k, t in turns.items()}
    for k, n in (("a", 600), ("b", 900), ("c", 500), ("d", 600), ("e", 400)):
        assert turns[k].prompt_tokens == len(toks[k]) == n, k
    assert _common(toks["a"], toks["b"]) == 400
    assert _common(toks["a"], toks["a+1"]) == 400  # a replicated request shares the prefix, not the rest
    assert _common(toks["a"], toks["c"]) == _common(toks["b"], toks["c"]) == 250
    # e's prompt is all prefix: it shares everything up to the chat template's closing tokens
    closing = encode(render_chat([{"role": "user", "content": "the"}]))[6:]
    assert _common(toks["a"], toks["e"]) == 400 - len(closing) and toks["e"][-len(closing):] == closing
    assert _common(toks["a"], toks["d"]) < 16  # another prefix id shares only the chat template's header
    assert turns["a"].messages[0]["content"].startswith(turns["c"].messages[0]["content"][:1000])


# ----------------------------------------------------------------------------------------------- errors


_OK = _req(0.0)

# (lines of the file, the line and field the error must name (None: no single field), words of the message)
BAD_REPLAY: list[tuple[str, list[str | dict], int, str | None, str]] = [
    ("invalid JSON", [_OK, '{"arrival_s": 1, "prompt_tokens": 10,'], 2, None, "invalid JSON"),
    ("not an object", [_OK, "[1, 2]"], 2, None, "expected a JSON object"),
    ("missing prompt_tokens", [_OK, {"arrival_s": 1, "max_tokens": 5}], 2, "prompt_tokens", "missing"),
    ("missing max_tokens", [_OK, "", {"arrival_s": 1, "prompt_tokens": 5}], 3, "max_tokens", "missing"),
    ("missing arrival", [{"prompt_tokens": 5, "max_tokens": 5}], 1, "arrival_s", "missing"),
    ("string count", [_OK, _req(1.0, "ten")], 2, "prompt_tokens", "must be an integer, got 'ten'"),
    ("bool count", [_req(0.0, True)], 1, "prompt_tokens", "must be an integer"),
    ("fractional count", [_OK, _req(1.0, 100, 2.5)], 2, "max_tokens", "must be an integer, got 2.5"),
    ("string arrival", [_OK, _req("1.0")], 2, "arrival_s", "must be a number"),
    ("string stream", [_req(0.0, stream="yes")], 1, "stream", "true or false"),
    ("list id", [_req(0.0, id=[1])], 1, "id", "a string or an integer"),
    ("string priority", [_OK, _req(1.0, priority="high")], 2, "priority", "must be an integer"),
    ("zero prompt", [_OK, _req(1.0, 0)], 2, "prompt_tokens", "must be >= 1, got 0"),
    ("negative bound", [_req(0.0, 10, -4)], 1, "max_tokens", "must be >= 1, got -4"),
    ("zero output", [_OK, _req(1.0, output_tokens=0)], 2, "output_tokens", "must be >= 1"),
    ("negative arrival", [_req(-1.0)], 1, "arrival_s", "must be >= 0"),
    ("negative prefix", [_req(0.0, prefix_id="p", prefix_len=-2)], 1, "prefix_len", "must be >= 0"),
    ("output over bound", [_OK, _req(1.0, 100, 32, output_tokens=33)], 2, "output_tokens",
     "exceeds max_tokens"),
    ("prefix over prompt", [_req(0.0, 100, prefix_id="p", prefix_len=101)], 1, "prefix_len", "longer than"),
    ("prefix without id", [_req(0.0, prefix_len=10)], 1, "prefix_id", "needs a prefix_id"),
    ("prefix id without len", [_req(0.0, prefix_id="p")], 1, "prefix_len", "missing"),
    ("unknown field", [_OK, _req(1.0, priorty=1)], 2, "priorty", "unknown field"),
    ("duplicate id", [_req(0.0, id="x"), _req(1.0, id="x")], 2, "id", "duplicate id 'x' (first on line 1)"),
    ("both arrivals", [_req(0.0, arrival_step=3)], 1, "arrival_step", "not both"),
    ("mixed arrivals", [_OK, {"arrival_step": 3, "prompt_tokens": 5, "max_tokens": 5}], 2, "arrival_step",
     "line 1 uses arrival_s"),
    ("arrivals out of order", [_OK, _req(2.0), _req(1.5)], 3, "arrival_s",
     "1.5 is earlier than line 2's 2.0; arrivals must not decrease"),
]


@pytest.mark.parametrize(("case", "lines", "line", "field", "words"), BAD_REPLAY,
                         ids=[c[0] for c in BAD_REPLAY])
def test_a_malformed_replay_line_names_the_file_the_line_and_the_field(
        tmp_path: Path, case: str, lines: list[str | dict], line: int, field: str | None, words: str) -> None:
    p = _write(tmp_path, "own.jsonl", lines)
    with pytest.raises(TraceFileError) as err:
        read_trace(p)
    e = err.value
    assert isinstance(e, ConfigurationError)
    assert (e.path, e.line, e.field) == (p, line, field)
    where = f"{p}, line {line}" + (f", field {field!r}" if field else "")
    assert str(e).startswith(where + ": ") and words in str(e) and "\n" not in str(e)


BAD_OTHER: list[tuple[str, str, str, int, str | None, str]] = [
    ("azure bad timestamp", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,1\n"
     "yesterday,10,1\n", 3, "TIMESTAMP", "not a date and time"),
    ("azure zero output", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,0\n",
     2, "GeneratedTokens", "must be >= 1, got 0"),
    ("azure text count", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,ten,1\n",
     2, "ContextTokens", "must be an integer, got 'ten'"),
    ("azure short row", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10\n",
     2, "GeneratedTokens", "missing"),
    ("azure missing column", "a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9,10\n",
     1, "GeneratedTokens", "missing column"),
    ("azure out of order", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9,10,1\n"
     "2023-11-16 18:17:02.9,10,1\n", 3, "TIMESTAMP", "is earlier than line 2's 2023-11-16 18:17:03.9"),
    ("mooncake missing length", "m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
     '{"timestamp": 0, "output_length": 1}\n', 2, "input_length", "missing"),
    ("mooncake bad hash ids", "m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, '
     '"hash_ids": ["a"]}\n', 1, "hash_ids", "list of integers"),
    ("mooncake out of order", "m.jsonl", '{"timestamp": 3000, "input_length": 5, "output_length": 1}\n'
     '{"timestamp": 0, "input_length": 5, "output_length": 1}\n', 2, "timestamp", "earlier than line 1"),
    ("mooncake invalid JSON", "m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n{oops\n',
     2, None, "invalid JSON"),
    ("unknown format", "x.jsonl", '{"when": 1, "tokens": 5}\n', 1, None, "unknown trace format"),
    ("unknown text format", "x.txt", "\nhello world\n", 2, None, "unknown trace format"),
]


@pytest.mark.parametrize(("case", "name", "text", "line", "field", "words"), BAD_OTHER,
                         ids=[c[0] for c in BAD_OTHER])
def test_malformed_azure_and_mooncake_lines_and_unknown_formats_are_named(
        tmp_path: Path, case: str, name: str, text: str, line: int, field: str | None, words: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(TraceFileError) as err:
        read_trace(p)
    assert (err.value.line, err.value.field) == (line, field)
    where = f"{p}, line {line}" + (f", field {field!r}" if field else "")
    assert str(err.value).startswith(where + ": ") and words in str(err.value)


@pytest.mark.parametrize("text", ["", "\n  \n", "TIMESTAMP,ContextTokens,GeneratedTokens\n"])
def test_an_empty_trace_is_an_error(tmp_path: Path, text: str) -> None:
    p = tmp_path / ("e.csv" if text.startswith("T") else "e.jsonl")
    p.write_text(text)
    with pytest.raises(TraceFileError, match="empty trace: no requests") as err:
        read_trace(p)
    assert err.value.line is None and str(err.value).startswith(f"{p}: ")


def test_a_missing_file_and_an_unknown_format_name_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceFileError, match="cannot read the trace"):
        read_trace(tmp_path / "nope.jsonl")
    p = _write(tmp_path, "ok.jsonl", [_OK])
    with pytest.raises(TraceFileError, match="unknown trace format 'parquet'"):
        read_trace(p, "parquet")


# ----------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(("lines", "extra", "message"), [
    ([_OK, _req(1.0, "ten")], [], "line 2, field 'prompt_tokens': must be an integer, got 'ten'"),
    ([_OK, _req(0.5), "{oops"], [], "line 3: invalid JSON"),
    ([], [], "empty trace"),
    ([_OK], ["--workload", "agentic"], "give --workload or --trace, not both"),
])
def test_the_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             lines: list[str | dict], extra: list[str], message: str) -> None:
    p = _write(tmp_path, "own.jsonl", lines) if lines else tmp_path / "own.jsonl"
    if not lines:
        p.write_text("")
    rc = main(["storm", "--trace", str(p), "--quiet", "--out", str(tmp_path / "out"), *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("zp-client storm: ") and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


TINY_TRACE: list[str | dict] = [
    _req(0.0, 200, 64, output_tokens=16, id="chat-1", prefix_id="sys", prefix_len=128),
    _req(0.05, 300, 64, output_tokens=24, id="chat-2", prefix_id="sys", prefix_len=128, priority=1),
    _req(0.1, 120, 32, id="tool-1", stream=False),
    _req(0.1, 150, 48, output_tokens=8, id="chat-3"),
    _req(0.2, 400, 64, output_tokens=30, id="chat-4"),
]


@pytest.mark.slow
def test_storm_replays_a_trace_file_through_every_setup(tmp_path: Path) -> None:
    p = _write(tmp_path, "tiny.jsonl", TINY_TRACE)
    out = tmp_path / "out"
    rc = main(["storm", "--trace", str(p), "--setups", "no-admission,zp-strict", "--quiet", "--out", str(out),
               "--profile", "tiny", "--num-gpu-blocks", "128"])
    assert rc == 0  # the virtual clock: a run cannot saturate the harness
    data = json.loads((out / "report.json").read_text())
    assert data["workload"]["name"] == "trace:tiny.jsonl" and str(p) in data["workload"]["description"]
    assert [m["setup"] for m in data["setups"]] == ["no-admission", "zp-strict"]
    ids = [str(line["id"]) for line in TINY_TRACE if isinstance(line, dict)]
    for setup in ("no-admission", "zp-strict"):
        records = data["requests"][setup]
        assert sorted(r["session"] for r in records) == sorted(ids), setup
        assert all(r["ok"] for r in records), setup
        by = {r["session"]: r for r in records}
        assert by["tool-1"]["stream"] is False and by["chat-1"]["max_tokens"] == 64
        assert by["chat-3"]["out_tokens"] == 8
