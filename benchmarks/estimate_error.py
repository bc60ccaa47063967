"""Estimation error against the simulator's ``POST /tokenize`` (chat form) on chat requests of 100-16k tokens.

Run: ``.venv/bin/python benchmarks/estimate_error.py``

The judge is the simulator's tokenizer (:mod:`zp_sim.tokenizer`, a Llama-3-like chat template over
a deterministic BPE-like tokenizer that is deliberately not cl100k), asked over real HTTP. Requests mix
content types (English prose from docstrings, Python source, JSON tool schemas, multi-turn agent
transcripts with tool calls, CJK text when the interpreter ships its test data) at sizes from ~100 to ~16k
tokens. For each estimator backend it reports:

- raw error: estimate / truth - 1 (mean, median absolute, p95 absolute, worst under-estimate);
- calibrated reservation: the estimator observes ``usage``-like truths for a training half (per model),
  then on the held-out half ``reserve_tokens`` / truth - 1 and the fraction of requests under-reserved.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx

from zp_client.config import Settings
from zp_client.estimate import Estimator
from zp_sim.server import SimServer

CHAT = "/v1/chat/completions"


def _corpora() -> dict[str, str]:
    import argparse as ap
    import asyncio
    import collections
    import email
    import functools
    import logging
    import typing

    prose = "\n\n".join(inspect.cleandoc(m.__doc__ or "") for m in (ap, asyncio.base_events, collections,
                                                                     functools, typing, logging, email))
    for obj in (collections.OrderedDict, functools.lru_cache, logging.Logger, typing.Generic, json.JSONDecoder):
        prose += "\n\n" + inspect.cleandoc(obj.__doc__ or "")
    code = "".join(Path(m.__file__).read_text() for m in (json.decoder, functools, logging))  # type: ignore[arg-type]
    out = {"prose": prose, "code": code}
    cjk_dir = Path(json.__file__).parent.parent / "test" / "cjkencodings"
    if cjk_dir.is_dir():
        out["cjk"] = "".join((cjk_dir / f).read_text("utf-8") for f in ("gb2312-utf8.txt", "big5-utf8.txt",
                                                                          "euc_jp-utf8.txt", "euc_kr-utf8.txt"))
    return out


def _tools(rng: random.Random, n: int) -> list[dict[str, Any]]:
    words = "search fetch summarise translate classify rank extract plan schedule notify".split()
    return [{"type": "function", "function": {
        "name": f"{rng.choice(words)}_{i}",
        "description": f"Use this tool to {rng.choice(words)} documents; returns JSON with the results.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "at most this many results"},
            "filters": {"type": "array", "items": {"type": "string"}}}, "required": ["query"]}}}
        for i in range(n)]


def _slice(text: str, chars: int, rng: random.Random) -> str:
    while len(text) < chars:
        text += text
    start = rng.randrange(0, max(1, len(text) - chars))
    return text[start:start + chars]


def requests(rng: random.Random, corpora: dict[str, str]) -> list[dict[str, Any]]:
    """Chat requests spanning ~100 to ~16k tokens (about 4 characters per token)."""
    out = []
    sizes = [100, 200, 400, 800, 1500, 3000, 6000, 10000, 16000]
    for target in sizes:
        for kind in ("plain", "agent"):
            for src in corpora:
                chars = target * (4 if src != "cjk" else 1)
                if kind == "plain":
                    msgs = [{"role": "system", "content": _slice(corpora["prose"], min(chars // 4, 4000), rng)},
                            {"role": "user", "content": _slice(corpora[src], chars, rng)}]
                    body: dict[str, Any] = {"model": "sim-llama", "messages": msgs}
                else:
                    msgs = [{"role": "system", "content": _slice(corpora["prose"], chars // 3, rng)}]
                    for turn in range(4):
                        msgs.append({"role": "user", "content": _slice(corpora[src], chars // 12, rng)})
                        args = json.dumps({"query": _slice(corpora["prose"], 60, rng), "limit": turn + 3})
                        msgs.append({"role": "assistant", "content": None, "tool_calls": [
                            {"id": f"call_{turn}", "type": "function",
                             "function": {"name": f"search_{turn}", "arguments": args}}]})
                        msgs.append({"role": "tool", "tool_call_id": f"call_{turn}",
                                     "content": _slice(corpora[src], chars // 12, rng)})
                    body = {"model": "sim-llama", "messages": msgs, "tools": _tools(rng, 6)}
                body["_label"] = f"{kind}/{src}/{target}"
                out.append(body)
    return out


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    reqs = requests(rng, _corpora())
    with SimServer(profile="tiny", max_model_len=200_000) as sim, httpx.Client(timeout=60) as http:
        truths = []
        for body in reqs:
            tk = {k: v for k, v in body.items() if k in ("model", "messages", "tools")}
            r = http.post(sim.url + "/tokenize", json={**tk, "add_generation_prompt": True})
            r.raise_for_status()
            truths.append(r.json()["count"])
    print(f"Judge: the simulator's /tokenize (chat form), {len(reqs)} chat requests, "
          f"{min(truths)}..{max(truths)} tokens (seed {args.seed})")
    order = list(range(len(reqs)))
    rng.shuffle(order)
    groups = {"prose+code": [i for i, b in enumerate(reqs) if "/cjk/" not in b["_label"]],
              "cjk": [i for i, b in enumerate(reqs) if "/cjk/" in b["_label"]],
              "all": list(range(len(reqs)))}
    print("err = estimate / truth - 1.  Calibrated: the estimator observed the truths of a random half (one")
    print("model), then reserve_tokens / truth - 1 on the other half; under = share of requests under-reserved.")
    for backend in ("tiktoken", "heuristic"):
        probe = Estimator(Settings(estimator=backend))
        assert probe.backend == backend
        print(f"\n[{backend}]")
        print(f"{'requests':11} {'n':>3} {'mean err':>9} {'med |err|':>10} {'p95 |err|':>10} {'worst under':>12} | "
              f"{'calib. mean over':>17} {'p95 over':>9} {'under':>6}")
        for name, idx in groups.items():
            if not idx:
                continue
            est = Estimator(Settings(estimator=backend))
            ests = {i: est.estimate(CHAT, {k: v for k, v in reqs[i].items() if k != "_label"}) for i in idx}
            errs = [ests[i].tokens / truths[i] - 1 for i in idx]
            sub = [i for i in order if i in ests]
            train, test = sub[: len(sub) // 2], sub[len(sub) // 2:]
            for i in train:
                est.observe(ests[i], truths[i])
            over = [est.reserve_tokens(ests[i]) / truths[i] - 1 for i in test]
            under = sum(1 for x in over if x < 0) / len(over)
            print(f"{name:11} {len(idx):3d} {statistics.mean(errs):+9.1%} {statistics.median(map(abs, errs)):10.1%} "
                  f"{_q([abs(e) for e in errs], 0.95):10.1%} {min(errs):+12.1%} | {statistics.mean(over):+17.1%} "
                  f"{_q(over, 0.95):+9.1%} {under:6.0%}")
            if name == "prose+code":
                by_size: dict[int, list[float]] = {}
                for i, e in zip(idx, errs):
                    by_size.setdefault(int(reqs[i]["_label"].rsplit("/", 1)[1]), []).append(e)
                size_line = ", ".join(f"{k}:{statistics.mean(v):+.0%}" for k, v in sorted(by_size.items()))
                worst = sorted(zip(errs, (reqs[i]["_label"] for i in idx)))[:2]
        print(f"  prose+code raw error by target size: {size_line}")
        print("  most under-estimated: " + ", ".join(f"{lab} {e:+.1%}" for e, lab in worst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
