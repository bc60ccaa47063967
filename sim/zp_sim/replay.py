"""Replay a JSONL workload through the engine in virtual time (``zp-client sim replay``).

The format and the step semantics are those of shared/REPLAY.md: one request a line with
``arrival_step`` or ``arrival_s``, ``prompt_tokens``, ``max_tokens`` (the true output length),
optional ``prefix_id`` + ``prefix_len``, ``priority`` and ``id``. Prompt token ids are synthesized:
the first ``prefix_len`` tokens are identical for requests with the same ``prefix_id``, every
other token is unique to its request, so prefix caching hits exactly where the workload says.

The run is deterministic: the same workload and config give the same JSON, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zp_sim.engine import Engine, EngineConfig
from zp_sim.profiles import PROFILES, get_profile

__all__ = [
    "ReplayError",
    "ReplayRequest",
    "add_replay_arguments",
    "load_workload",
    "parse_workload",
    "run_replay",
    "run_replay_command",
]

logger = logging.getLogger("zp_sim.replay")


class ReplayError(ValueError):
    """The workload or the replay settings are invalid; the message says what to fix."""


@dataclass(frozen=True)
class ReplayRequest:
    """One workload line, validated."""

    id: str
    prompt_tokens: int
    max_tokens: int
    arrival_step: int | None = None
    arrival_s: float | None = None
    prefix_id: str | None = None
    prefix_len: int = 0
    priority: int = 0


def _int_field(rec: Mapping[str, Any], key: str, where: str, *, minimum: int) -> int:
    value = rec.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReplayError(f"{where}: {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ReplayError(f"{where}: {key!r} must be >= {minimum}, got {value}")
    return value


def parse_workload(records: Iterable[object]) -> list[ReplayRequest]:
    """Validate workload records (dicts as in REPLAY.md); raise :class:`ReplayError` on bad input
    (anything that is not a mapping included)."""
    out: list[ReplayRequest] = []
    seen: set[str] = set()
    modes: set[str] = set()
    for index, rec in enumerate(records):
        where = f"workload line {index + 1}"
        if not isinstance(rec, Mapping):
            raise ReplayError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        rid = str(rec.get("id", index))
        if rid in seen:
            raise ReplayError(f"{where}: duplicate id {rid!r}")
        seen.add(rid)
        prompt = _int_field(rec, "prompt_tokens", where, minimum=1)
        max_tokens = _int_field(rec, "max_tokens", where, minimum=1)
        has_step = rec.get("arrival_step") is not None
        has_s = rec.get("arrival_s") is not None
        if has_step and has_s:
            raise ReplayError(f"{where}: give arrival_step or arrival_s, not both")
        arrival_step = None
        arrival_s = None
        if has_step:
            arrival_step = _int_field(rec, "arrival_step", where, minimum=0)
            modes.add("step")
        elif has_s:
            value = rec["arrival_s"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ReplayError(f"{where}: 'arrival_s' must be a number >= 0, got {value!r}")
            arrival_s = float(value)
            modes.add("s")
        else:
            arrival_step = 0
            modes.add("step")
        prefix_id = rec.get("prefix_id")
        prefix_len = 0
        if prefix_id is not None:
            prefix_len = _int_field(rec, "prefix_len", where, minimum=0)
            if prefix_len > prompt:
                raise ReplayError(
                    f"{where}: prefix_len {prefix_len} is longer than prompt_tokens {prompt}"
                )
            prefix_id = str(prefix_id)
        priority = rec.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ReplayError(f"{where}: 'priority' must be an integer, got {priority!r}")
        out.append(
            ReplayRequest(
                id=rid,
                prompt_tokens=prompt,
                max_tokens=max_tokens,
                arrival_step=arrival_step,
                arrival_s=arrival_s,
                prefix_id=prefix_id,
                prefix_len=prefix_len,
                priority=priority,
            )
        )
    if len(modes) > 1:
        raise ReplayError("a workload must use arrival_step on every line or arrival_s on every line")
    return out


def load_workload(path: str | Path) -> list[ReplayRequest]:
    """Read and validate a JSONL workload file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReplayError(f"cannot read workload {p}: {exc}") from exc
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ReplayError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from exc
    return parse_workload(records)


class _TokenSynth:
    """Prompt ids: shared per prefix_id for the prefix, unique everywhere else."""

    def __init__(self) -> None:
        self._next = 1_000_000  # above any real vocabulary: cannot collide with output ids
        self._prefixes: dict[str, list[int]] = {}

    def _fresh(self, n: int) -> list[int]:
        start = self._next
        self._next += n
        return list(range(start, start + n))

    def prompt(self, req: ReplayRequest) -> list[int]:
        if req.prefix_id is None or req.prefix_len == 0:
            return self._fresh(req.prompt_tokens)
        shared = self._prefixes.setdefault(req.prefix_id, [])
        if len(shared) < req.prefix_len:
            shared.extend(self._fresh(req.prefix_len - len(shared)))
        return shared[: req.prefix_len] + self._fresh(req.prompt_tokens - req.prefix_len)


def run_replay(
    path_or_records: str | Path | Iterable[Mapping[str, Any]] | Iterable[ReplayRequest],
    config: EngineConfig,
) -> dict[str, Any]:
    """Run a workload to completion and return the REPLAY.md result dict.

    ``config.max_model_len`` is used as given; the CLI defaults it to the longest request.
    Raises :class:`ReplayError` for bad workloads and for requests longer than max_model_len.
    """
    if isinstance(path_or_records, (str, Path)):
        reqs = load_workload(path_or_records)
    else:
        items = list(path_or_records)
        given = [r for r in items if isinstance(r, ReplayRequest)]
        reqs = given if items and len(given) == len(items) else parse_workload(items)
    for r in reqs:
        if r.prompt_tokens > config.max_model_len:
            raise ReplayError(
                f"request {r.id!r}: prompt_tokens {r.prompt_tokens} exceeds max_model_len "
                f"{config.max_model_len}; pass a larger --max-model-len"
            )
    try:
        engine = Engine(config)
    except ValueError as exc:
        raise ReplayError(str(exc)) from exc

    by_time = bool(reqs) and reqs[0].arrival_s is not None
    # Stable order: by arrival, then file order.
    order = sorted(
        range(len(reqs)),
        key=lambda i: ((reqs[i].arrival_s if by_time else reqs[i].arrival_step), i),
    )
    synth = _TokenSynth()
    prompts = {reqs[i].id: synth.prompt(reqs[i]) for i in range(len(reqs))}

    nxt = 0
    max_running = 0
    max_kv = 0.0
    while nxt < len(order) or engine.has_unfinished():
        # Add everything that has arrived by now.
        while nxt < len(order):
            r = reqs[order[nxt]]
            if by_time:
                assert r.arrival_s is not None
                if r.arrival_s > engine.now + 1e-12:
                    break
                arrival = r.arrival_s
            else:
                assert r.arrival_step is not None
                if r.arrival_step > engine.step_index:
                    break
                arrival = engine.now
            engine.add_request(
                r.id,
                prompts[r.id],
                r.max_tokens,
                priority=r.priority,
                arrival_time=arrival,
            )
            nxt += 1
        if not engine.has_unfinished():
            # Idle: jump to the next arrival.
            r = reqs[order[nxt]]
            if by_time:
                assert r.arrival_s is not None
                engine.advance_idle(r.arrival_s)
            else:
                assert r.arrival_step is not None
                engine.skip_to_step(r.arrival_step)
            continue
        out = engine.step()
        if out.step is None:
            # Cannot happen while max_model_len fits the pool (EngineConfig.validate); guard
            # against an endless loop all the same.
            raise ReplayError("the engine cannot schedule any waiting request (pool too small?)")
        max_running = max(max_running, out.num_running + len(out.finished))
        max_kv = max(max_kv, out.kv_usage)

    stats = engine.stats
    requests = []
    for r in reqs:
        rec = engine.request_record(r.id)
        requests.append(
            {
                "id": r.id,
                "prompt_tokens": r.prompt_tokens,
                "max_tokens": r.max_tokens,
                "first_scheduled_step": rec.first_scheduled_step,
                "first_token_step": rec.first_token_step,
                "finish_step": rec.finish_step,
                "num_preemptions": rec.num_preemptions,
                "num_cached_tokens": rec.num_cached_tokens,
                "recomputed_tokens": rec.recomputed_tokens,
                "first_token_s": _round(rec.first_token_time),
                "finish_s": _round(rec.finish_time),
            }
        )
    records = [engine.request_record(r.id) for r in reqs]
    ttft_steps = [
        rec.first_token_step - (r.arrival_step or 0)
        for r, rec in zip(reqs, records, strict=True)
        if rec.first_token_step is not None and not by_time
    ]
    ttft_s = [
        rec.first_token_time - rec.arrival
        for rec in records
        if rec.first_token_time is not None
    ]
    profile = config.profile
    return {
        "config": {
            "num_gpu_blocks": config.num_gpu_blocks,
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": config.max_model_len,
            "enable_prefix_caching": config.enable_prefix_caching,
            "policy": config.policy,
            "reserve_full_isl": config.reserve_full_isl,
            "watermark": config.watermark,
            "long_prefill_token_threshold": config.long_prefill_token_threshold,
            "profile": None if profile is None else profile.name,
        },
        "num_requests": len(reqs),
        "finished": sum(1 for q in requests if q["finish_step"] is not None),
        "preemptions": stats.preemptions_total,
        "preempted_requests": sum(1 for q in requests if q["num_preemptions"]),
        "recomputed_tokens": stats.recomputed_tokens,
        "steps": stats.steps,
        "last_step": engine.step_index - 1,
        "max_running": max_running,
        "max_kv_usage": round(max_kv, 6),
        "sim_time_s": _round(engine.now),
        "prompt_tokens_total": stats.prompt_tokens_total,
        "generation_tokens_total": stats.generation_tokens_total,
        "prefix_cache_queries_total": stats.prefix_cache_queries_total,
        "prefix_cache_hits_total": stats.prefix_cache_hits_total,
        "prefix_cache_hit_tokens_all_admissions": stats.cache_hit_tokens_all_admissions,
        "mean_ttft_steps": (sum(ttft_steps) / len(ttft_steps)) if ttft_steps else None,
        "mean_ttft_s": _round(sum(ttft_s) / len(ttft_s)) if ttft_s else None,
        "requests": requests,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 9)


# ----------------------------------------------------------------------------------- CLI


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``replay`` sub-subcommand's arguments to ``parser``."""
    parser.add_argument("workload", help="JSONL workload (shared/REPLAY.md format)")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV pool size including the null block (default: the profile's)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the longest request in the workload (prompt + max_tokens)",
    )
    parser.add_argument(
        "--profile",
        default="fidelity",
        help=f"step-time profile ({', '.join(sorted(PROFILES))}); default fidelity = 0.02 s/step",
    )
    parser.add_argument("--watermark", type=float, default=0.0)
    parser.add_argument(
        "--no-reserve-full-isl",
        action="store_true",
        help="admit on the first chunk only (older vLLM V1) instead of the whole sequence",
    )
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0)
    parser.add_argument("--output", "-o", default=None, help="write the JSON here instead of stdout")
    parser.add_argument("--summary", action="store_true", help="omit the per-request list")


def run_replay_command(args: argparse.Namespace) -> int:
    """Run ``zp-client sim replay``; print the JSON; return the exit code (2 on bad input)."""
    try:
        profile = get_profile(args.profile)
        reqs = load_workload(args.workload)
        max_model_len = args.max_model_len
        if max_model_len is None:
            max_model_len = max((r.prompt_tokens + r.max_tokens for r in reqs), default=1)
        overrides: dict[str, Any] = {
            "max_model_len": max_model_len,
            "policy": args.policy,
            "enable_prefix_caching": not args.no_prefix_caching,
            "watermark": args.watermark,
            "reserve_full_isl": not args.no_reserve_full_isl,
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
        }
        if args.num_gpu_blocks is not None:
            overrides["num_gpu_blocks"] = args.num_gpu_blocks
        if args.max_num_seqs is not None:
            overrides["max_num_seqs"] = args.max_num_seqs
        if args.max_num_batched_tokens is not None:
            overrides["max_num_batched_tokens"] = args.max_num_batched_tokens
        config = EngineConfig.from_profile(profile, **overrides)
        result = run_replay(reqs, config)
    except ValueError as exc:
        print(f"zp-client sim replay: error: {exc}", file=sys.stderr)
        return 2
    if args.summary:
        result = {k: v for k, v in result.items() if k != "requests"}
    text = json.dumps(result, indent=None, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")
    return 0

