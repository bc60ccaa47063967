"""Storm workloads: the request sequences every client setup replays against a fresh simulated server.

A workload is a list of :class:`Session` chains of :class:`Turn` calls, built from :class:`ServerFacts`
read from a fresh server; every builder is deterministic in ``seed``, all times virtual seconds. See
docs/benchmark.md#workloads.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zp_client.errors import ConfigurationError
from zp_sim.tokenizer import WORDS, count_chat_tokens, count_tokens, make_text

__all__ = [
    "MIXED_BATCH_TTFT_S",
    "MIXED_INTERACTIVE_TPOT_S",
    "MIXED_INTERACTIVE_TTFT_S",
    "REAL_GATEWAY_TIMEOUT_S",
    "RequestClass",
    "SEED_CASE_PROFILE",
    "SLO",
    "SLO_TPOT_ITL_FACTOR",
    "SLO_TTFT_S",
    "ServerFacts",
    "SimConfig",
    "TRACE_WORKLOAD",
    "Session",
    "Turn",
    "Workload",
    "WORKLOADS",
    "build_workload",
    "count_chat_tokens",
    "find_shared_dir",
    "gateway_time_scale",
    "interactive_slo",
    "loaded_step_s",
    "make_text",
    "mixed",
    "seed_burst",
    "trace_replay",
]

Message = dict[str, str]


# --------------------------------------------------------------------------------------- data model


@dataclass
class Turn:
    """One call to ``/v1/chat/completions``.

    ``messages`` is the full prompt; ``prompt_tokens`` its length under the simulator's chat template.
    ``max_tokens`` is the client's bound (what zp reserves), ``true_out`` the real output length (sent
    to the simulator as ``sim_output_tokens``). ``delay_s`` is the virtual think time before the call
    (after the previous turn and its children ended). ``children`` run in parallel after this turn.
    """

    messages: list[Message]
    prompt_tokens: int
    max_tokens: int
    true_out: int
    delay_s: float = 0.0
    children: list[Session] = field(default_factory=list)
    stream: bool = True
    """Streamed (SSE) or not. A non-streamed call's first byte is its whole response, so a gateway
    timeout applies to its full duration, as for agent frameworks' usual non-streamed tool calls."""
    priority: int | None = None
    """The request's priority (lower = more urgent, as zp's ``X-ZP-Priority`` header and vLLM's
    ``priority`` field), from a trace file's ``priority``; None: the caller's default."""
    slo_class: str | None = None
    """The request's class (a key of :attr:`Workload.classes`: its own SLO targets and priority); None:
    the workload's one class (:attr:`Workload.slo`)."""


@dataclass
class Session:
    """A chain of turns. ``start_s`` is the virtual arrival of its first turn, relative to the run's
    start (ignored for a child session, which starts when its parent spawns it)."""

    id: str
    start_s: float
    kind: str
    turns: list[Turn]


@dataclass(frozen=True)
class SimConfig:
    """How every fresh :class:`~zp_sim.server.SimServer` of a run is configured."""

    profile: str
    num_gpu_blocks: int | None
    speedup: float
    gateway_timeout_s: float | None
    max_model_len: int | None = None


@dataclass(frozen=True)
class SLO:
    """A logical request counts toward goodput when it succeeded with TTFT (client queue wait included)
    <= ``ttft_s`` and mean time per output token after the first <= ``tpot_s`` (virtual seconds).
    A non-streamed request must finish within ``ttft_s + output_tokens x tpot_s`` (when a streamed
    request meeting both limits would have finished). ``tpot_s`` None: no TPOT target (a non-streamed
    request must then finish within ``ttft_s``)."""

    ttft_s: float
    tpot_s: float | None

    def met(self, ttft: float | None, tpot: float | None, *, streamed: bool = True,
            e2e: float | None = None, out_tokens: int = 0) -> bool:
        if not streamed:
            return e2e is not None and e2e <= self.ttft_s + out_tokens * (self.tpot_s or 0.0)
        return (ttft is not None and ttft <= self.ttft_s
                and (tpot is None or self.tpot_s is None or tpot <= self.tpot_s))


@dataclass(frozen=True)
class RequestClass:
    """A class of requests sharing one server with others: its own SLO targets (each request is scored
    against its class's) and the priority an app sends for it (lower = more urgent, as vLLM's body
    ``priority`` and zp's ``X-ZP-Priority``)."""

    name: str
    slo: SLO
    priority: int = 0


@dataclass(frozen=True)
class ServerFacts:
    """What a workload builder may know about the server (read from a fresh server before the run)."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    unloaded_itl_s: float
    unloaded_ttft_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    """The server's measured prefill throughput: the prompt tokens of one long unloaded request over its
    TTFT (0: not measured). ``vllm-queue-cap`` sizes ``--max-num-queued-tokens`` from it."""

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1


@dataclass
class Workload:
    """A request sequence plus the knobs it was built with (printed with every result)."""

    name: str
    description: str
    sessions: list[Session]
    slo: SLO
    gateway_timeout_s: float | None
    params: dict[str, Any] = field(default_factory=dict)
    pin_prefixes: list[list[Message]] = field(default_factory=list, repr=False)
    """Prefixes a setup may pin (``zp-pinned``): each the leading system messages some turns start with;
    a session of kind ``"type<i>"`` uses prefix ``i`` (see :func:`agent_types`). Not in ``params``."""
    classes: dict[str, RequestClass] = field(default_factory=dict)
    """The request classes of a workload with several (``mixed``), by name; a turn's
    :attr:`Turn.slo_class` names its own. Empty: one class, :attr:`slo`, priority 0."""

    def slo_of(self, slo_class: str | None) -> SLO:
        """The SLO a request of ``slo_class`` is scored against (the workload's :attr:`slo` for None or a
        class it does not define)."""
        c = self.classes.get(slo_class) if slo_class is not None else None
        return c.slo if c is not None else self.slo

    def priority_of(self, slo_class: str | None) -> int:
        """The priority an app sends for ``slo_class`` (0 for the workload's one class)."""
        c = self.classes.get(slo_class) if slo_class is not None else None
        return c.priority if c is not None else 0

    def tightest_ttft_s(self) -> float:
        """The smallest TTFT target of the workload's classes (its :attr:`slo`'s with one class)."""
        return min([c.slo.ttft_s for c in self.classes.values()] or [self.slo.ttft_s])

    def iter_turns(self) -> list[Turn]:
        out: list[Turn] = []

        def walk(sessions: Sequence[Session]) -> None:
            for s in sessions:
                for t in s.turns:
                    out.append(t)
                    walk(t.children)

        walk(self.sessions)
        return out

    @property
    def num_requests(self) -> int:
        """Logical requests in the workload (every turn of every session, children included)."""
        return len(self.iter_turns())

    def summary(self) -> dict[str, Any]:
        turns = self.iter_turns()
        prompts = sorted(t.prompt_tokens for t in turns)
        outs = sorted(t.true_out for t in turns)

        def q(xs: list[int], p: float) -> int:
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0

        return {
            "sessions": len(self.sessions),
            "requests": len(turns),
            "prompt_tokens_p50": q(prompts, 0.5),
            "prompt_tokens_p99": q(prompts, 0.99),
            "true_out_p50": q(outs, 0.5),
            "true_out_p99": q(outs, 0.99),
            "max_tokens_max": max((t.max_tokens for t in turns), default=0),
        }


# --------------------------------------------------------------------------------------- text


# The simulator's tokenizer writes the prompts' text (zp_sim.tokenizer.make_text: a few hundred short
# words, one token each, so text length in tokens is easy to steer).
_WORDS = WORDS


def _token_counter() -> Callable[[str], int]:
    return count_tokens


# --------------------------------------------------------------------------------------- helpers


def _lognormal_int(rng: random.Random, median: float, p99: float, lo: int, hi: int) -> int:
    sigma = math.log(p99 / median) / 2.3263
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def find_shared_dir() -> Path:
    """The shared data folder: ``$ZP_SHARED_DIR``, else ``../shared`` next to the repository."""
    env = os.environ.get("ZP_SHARED_DIR")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    candidates += [repo.parent / "shared", repo / "shared"]
    for c in candidates:
        if (c / "traces").is_dir():
            return c
    raise ConfigurationError(
        "cannot find the shared traces folder; set ZP_SHARED_DIR to the folder holding traces/ "
        f"(looked in: {', '.join(str(c) for c in candidates)})"
    )


# --------------------------------------------------------------------------------------- seed-burst


#: The seed case's deployment (Llama-3-70B FP8 on 8x H100, shared/VLLM_FACTS.md): the simulated server of
#: seed-burst is this profile with a pool scaled down so a storm runs in minutes.
SEED_CASE_PROFILE = "llama3-70b-fp8-8xh100"

#: The gateway in front of vLLM in the seed case: nginx's default ``proxy_read_timeout`` (and the AWS ALB
#: idle timeout) is 60 s: the time a non-streamed response may take before the proxy answers 504.
REAL_GATEWAY_TIMEOUT_S = 60.0

#: The goodput SLO of every workload, fixed here and printed with every result: TTFT (client queue wait,
#: retries and backoff included) at most 5 s; mean time per output token after the first at most 5x the
#: unloaded inter-token latency (40 ms on the 70B profile: 25 tokens/s, faster than anyone reads).
SLO_TTFT_S = 5.0
SLO_TPOT_ITL_FACTOR = 5.0


def interactive_slo(facts: ServerFacts) -> SLO:
    """The fixed goodput SLO (``SLO_TTFT_S`` / ``SLO_TPOT_ITL_FACTOR`` x the unloaded ITL)."""
    return SLO(ttft_s=round(max(SLO_TTFT_S, 200 * facts.unloaded_itl_s), 2),
               tpot_s=round(SLO_TPOT_ITL_FACTOR * facts.unloaded_itl_s, 4))


def loaded_step_s(pool_tokens: float, seq_tokens: float, profile: str = SEED_CASE_PROFILE) -> float:
    """Duration of a pure decode step of ``profile`` when ``pool_tokens`` of KV are held by sequences of
    ``seq_tokens`` each (the profile's step-time formula: c0 + c3 x context + c4 x batch)."""
    from zp_sim.profiles import get_profile

    p = get_profile(profile)
    return p.step_time(0, 0.0, int(pool_tokens), max(1, round(pool_tokens / seq_tokens)))


def gateway_time_scale(facts: ServerFacts, seq_tokens: float, profile: str = SEED_CASE_PROFILE) -> float:
    """How much faster the scaled-down simulated server runs a loaded decode step than the real one.

    A gateway timeout is a budget of decode steps for a non-streamed call: on the real deployment, with
    its whole pool held by ``seq_tokens``-token sequences, a step costs ``loaded_step_s(real pool)``
    (53 ms for the 70B profile's 206k blocks held by ~4k-token sequences); the simulated pool holds
    25x fewer sequences, so its loaded step is shorter (~9.8 ms). ``REAL_GATEWAY_TIMEOUT_S`` x this
    ratio gives the simulated gateway the same number of loaded decode steps as the real 60 s.
    """
    from zp_sim.profiles import get_profile

    real_pool = (get_profile(profile).num_gpu_blocks - 1) * facts.block_size
    sim_pool = facts.usable_blocks * facts.block_size
    return loaded_step_s(sim_pool, seq_tokens, profile) / loaded_step_s(real_pool, seq_tokens, profile)


def seed_burst(facts: ServerFacts, seed: int, *, streams: int = 24, burst: int = 16,
               burst_prompt: int = 8192, burst_max_tokens: int = 1024, burst_out_median: int = 300,
               burst_out_p99: int = 1000, stream_out: int = 1024, rounds: int = 2, hold: float = 0.75,
               burst_at_frac: float = 0.5, gateway_s: float | None = None, scale: float = 1.0) -> Workload:
    """The seed case: steady decode streams holding ~``hold`` of the KV pool, then a simultaneous burst
    of 8k-token agent prompts whose KV, with the streams' growth, far exceeds the pool.

    Each choice, and why (the printed ``params`` carry the derived numbers; defaults on the 8193-block
    pool that ``zp-client storm`` uses):

    * **Streams.** ``streams`` (24) chat clients each generate ``rounds`` (2) requests back to back (a
      fresh prompt, streamed, ``max_tokens`` = the true output: generations that run to their bound, so
      zp reserves exactly what the streams will use). They are *decode* streams: the output
      (``stream_out`` = 1024) keeps growing every sequence after the burst is admitted; their total
      growth (``params['stream_growth_blocks']``, 24 x 1024 tokens = 1536 blocks) is three quarters of
      the pool's free share. Prompts are sized so the streams hold ``hold`` (75%) of the usable pool on
      average (prompt + half the output each: ~3.6k-token prompts); the first round's outputs are
      staggered (25%..100% of ``stream_out``) so the streams end at different times and the pool churns
      as in a steady state; the second round is the interactive traffic that arrives *during* the burst.
      Growth, not the burst's size, is what makes vLLM preempt: it admits a prompt only when its whole
      sequence fits, so preemptions are bounded by (growth after the burst) / (a victim's size). With
      half this growth (16 streams x 768 tokens) the server preempted 1-3 times per run, with 16 x 1024
      not at all (one run), with 16 x 1536 3-6 times but too slowly for ``make demo``'s 3 minutes with
      every setup; 24 x 1024 preempts 3-6 times and keeps a whole storm near 2 minutes.
    * **Burst.** ``burst`` (16) non-streamed agent calls (agent frameworks' tool calls usually are not
      streamed) of ``burst_prompt`` = 8k tokens (capped to fit ``max_model_len`` with
      ``burst_max_tokens``: ~7.1k), ``max_tokens`` = 1024, true outputs lognormal (median 300, p99
      1000), all arriving at the same instant, when the streams are ``burst_at_frac`` (half) into their
      first round. Their prompts alone (16 x ~7.1k tokens) are ~3.5x the pool's free quarter and ~0.9x
      the whole pool: vLLM admits what fits *now* (``params['burst_fits_free_pool']`` calls), never
      reserving anyone's future tokens; the streams' growth plus the admitted calls' outputs then exceed
      the pool, so it preempts (recompute) and re-admits the victims as soon as they fit again.
    * **Gateway.** A proxy answers 504 to a response that has not begun within ``REAL_GATEWAY_TIMEOUT_S``
      (60 s, nginx's default ``proxy_read_timeout``), scaled to the simulator by
      :func:`gateway_time_scale` (the same number of loaded decode steps: ~11 s virtual). It is a
      property of the deployment, the same for every setup but ``no-admission``, never derived from the
      burst's own calls; ``gateway_s`` overrides it (printed).
    * **SLO.** :func:`interactive_slo`, the same fixed rule as every other workload: TTFT <= 5 s, TPOT
      <= 5x the unloaded ITL; a non-streamed call must end within 5 s + output x TPOT.

    ``scale`` (``--load-scale``, the x of ``--sweep``) is the offered load: it multiplies ``streams`` and
    ``burst`` and keeps every request's size (the prompts sized for ``streams`` at scale 1), so at scale x
    the streams alone hold ``hold`` x x of the pool (above 1 they overflow it without any burst).
    """
    rng = random.Random(seed)
    base_streams = streams
    streams = max(1, round(streams * scale))
    burst = max(1, round(burst * scale))
    bs = facts.block_size
    burst_prompt = min(burst_prompt, facts.max_model_len - burst_max_tokens - 64)
    per_stream = hold * facts.usable_blocks * bs / base_streams
    stream_prompt = int(per_stream - stream_out / 2) - 8  # minus the chat template's tokens
    if stream_prompt < 64 or stream_prompt + stream_out > facts.max_model_len:
        raise ConfigurationError(
            f"seed-burst: {base_streams} streams cannot hold {hold:.0%} of a {facts.usable_blocks}-block "
            f"pool with {stream_out}-token outputs within max_model_len {facts.max_model_len}; "
            "change the number of streams or the pool size"
        )
    sessions: list[Session] = []
    ramp = 0.5
    for i in range(streams):
        turns = []
        for k in range(rounds):
            out = int(stream_out * (0.25 + 0.75 * (i + 1) / streams)) if k == 0 else stream_out
            msgs = [{"role": "user", "content": make_text(stream_prompt, rng, f"stream {i} round {k}")}]
            turns.append(Turn(msgs, count_chat_tokens(msgs), out, out))
        sessions.append(Session(f"stream-{i}", ramp * i / streams, "stream", turns))
    # prefill of all streams (one 8k-token budget per step, ~0.35 s per full step on the 70B profile)
    # plus burst_at_frac of the first round's full output
    prefill_s = streams * stream_prompt / 8192 * 0.35
    burst_at = ramp + prefill_s + burst_at_frac * stream_out * facts.unloaded_itl_s
    burst_turns: list[Turn] = []
    for j in range(burst):
        msgs = [{"role": "system", "content": make_text(400, rng, f"agent {j} system")},
                {"role": "user", "content": make_text(burst_prompt - 420, rng, f"agent {j} task")}]
        out = _lognormal_int(rng, burst_out_median, burst_out_p99, 16, burst_max_tokens)
        burst_turns.append(Turn(msgs, count_chat_tokens(msgs), burst_max_tokens, out, stream=False))
        sessions.append(Session(f"burst-{j}", burst_at, "burst", [burst_turns[-1]]))
    seq_tokens = stream_prompt + stream_out / 2
    if gateway_s is None:
        gateway = round(REAL_GATEWAY_TIMEOUT_S * gateway_time_scale(facts, seq_tokens), 2)
        gateway_rule = (f"{REAL_GATEWAY_TIMEOUT_S:.0f} s x loaded decode step sim/real "
                        f"({gateway_time_scale(facts, seq_tokens):.3f})")
    else:
        gateway, gateway_rule = round(gateway_s, 2), "given"
    free_blocks = facts.usable_blocks * (1 - hold)
    burst_blocks = sum(math.ceil(t.prompt_tokens / bs) for t in burst_turns)
    slo = interactive_slo(facts)
    return Workload(
        "seed-burst",
        f"{streams} decode streams x {rounds} requests (prompt {stream_prompt}, "
        f"output <= {stream_out} tokens) holding ~{hold:.0%} of the pool, "
        f"then {burst} agent prompts of ~{burst_prompt} tokens "
        f"(KV {burst_blocks / free_blocks:.1f}x the free pool) at t={burst_at:.2f}s",
        sessions, slo, gateway,
        {"streams": streams, "burst": burst, "stream_prompt": stream_prompt, "stream_out": stream_out,
         "burst_prompt": burst_prompt, "burst_max_tokens": burst_max_tokens,
         "burst_out": [burst_out_median, burst_out_p99], "burst_at_s": round(burst_at, 3),
         "rounds": rounds, "gateway_timeout_s": gateway, "gateway_rule": gateway_rule,
         "hold": hold, "scale": scale,
         "free_pool_blocks": int(free_blocks), "burst_prompt_blocks": burst_blocks,
         "burst_fits_free_pool": int(free_blocks // max(1, burst_blocks / burst)),
         "stream_growth_blocks": streams * stream_out // bs,
         "slo_rule": f"TTFT <= {SLO_TTFT_S} s, TPOT <= {SLO_TPOT_ITL_FACTOR}x unloaded ITL"},
    )


# --------------------------------------------------------------------------------------- agentic


_TOOL_NAMES = ["read_file", "write_file", "run_tests", "search_code", "list_dir", "apply_patch",
               "run_shell", "git_diff", "open_url", "ask_user"]


def _agent_preamble(rng: random.Random, tokens: int) -> str:
    parts = ["You are a coding agent working in a repository. Use the tools to inspect, edit and test "
             "code. Think step by step, call one tool at a time, and report when the task is done.\n"]
    per_tool = max(40, (tokens - 60) // len(_TOOL_NAMES))
    for name in _TOOL_NAMES:
        params = {"type": "object",
                  "properties": {"path": {"type": "string"}, "args": {"type": "string"}}}
        schema = {"type": "function", "function": {"name": name, "description": make_text(per_tool - 30, rng),
                                                   "parameters": params}}
        parts.append(json.dumps(schema) + "\n")
    return "".join(parts)


_AGENTIC_CONVERSATIONS = 24
"""``agentic``'s default number of conversations (see its docstring for why 24)."""


def agentic(facts: ServerFacts, seed: int, *, conversations: int = _AGENTIC_CONVERSATIONS,
            window_s: float | None = None,
            preamble_tokens: int = 2000, max_tokens: int = 4096, turns_lo: int = 3, turns_hi: int = 10,
            subagent_p: float = 0.12, scale: float = 1.0) -> Workload:
    """Coding-agent conversations sharing a ~2k-token tool+system preamble (prefix-cacheable).

    Each conversation: a user task (lognormal, median 300 tokens), then turns whose context grows by
    the previous output and a tool result (lognormal, median 400, p99 2500 tokens); ``max_tokens`` is
    4096 on every call while true outputs are lognormal (median 220, p99 3700); think time between
    turns lognormal (median 1 s). With probability ``subagent_p`` a turn spawns 2-5 parallel
    sub-agents (2-3 turns each, same preamble) and waits for them. A conversation ends when its next
    prompt would not leave ``max_tokens`` within the context length (an agent would compact there).
    Conversations arrive as a Poisson process over ``window_s`` (default: 400 unloaded decode steps
    per conversation, about 3 s on the 70B profile, so a dozen or more overlap).

    Sizing: 24 conversations is the default because the workload must be hard for the server (issue 8):
    with 16, ``no-admission`` preempted a median of 1-2 times over seeds (0-11); with 24 it preempts
    about 20 times per run and reaches KV usage 1.0, and reserving max_tokens (``zp-strict``) queues
    requests for tens of seconds. ``scale`` multiplies it (the storm's ``--load-scale``).
    """
    rng = random.Random(seed)
    conversations = max(1, round(conversations * scale))
    ctx_cap = facts.max_model_len - max_tokens - 32
    if preamble_tokens + 600 > ctx_cap:
        raise ConfigurationError(
            f"agentic: max_model_len {facts.max_model_len} leaves no room for a {preamble_tokens}-token "
            f"preamble plus max_tokens {max_tokens}; use a profile with a longer context"
        )
    preamble = {"role": "system", "content": _agent_preamble(rng, preamble_tokens)}
    window = window_s if window_s is not None else conversations * 400 * facts.unloaded_itl_s
    counter = [0]

    def conversation(cid: str, n_turns: int, depth: int) -> list[Turn]:
        msgs: list[Message] = [preamble, {"role": "user", "content": make_text(
            _lognormal_int(rng, 300, 1500, 30, 3000), rng, f"task {cid}")}]
        turns: list[Turn] = []
        for k in range(n_turns):
            ptoks = count_chat_tokens(msgs)
            if ptoks > ctx_cap:
                break
            out = _lognormal_int(rng, 220, 3700, 1, max_tokens)
            turn = Turn(list(msgs), ptoks, max_tokens, out,
                        delay_s=0.0 if k == 0 else _lognormal_int(rng, 1000, 6000, 50, 20000) / 1000)
            if depth == 0 and k < n_turns - 1 and rng.random() < subagent_p:
                n_sub = rng.randint(2, 5)
                for s in range(n_sub):
                    counter[0] += 1
                    sid = f"{cid}.sub{s}"
                    sub = conversation(sid, rng.randint(2, 3), 1)
                    turn.children.append(Session(sid, 0.0, "subagent", sub))
            turns.append(turn)
            msgs = msgs + [{"role": "assistant", "content": make_text(out, rng)},
                           {"role": "user", "content": make_text(
                               _lognormal_int(rng, 400, 2500, 20, 6000), rng, f"tool result {cid}.{k}")}]
        return turns

    sessions: list[Session] = []
    t = 0.0
    for c in range(conversations):
        cid = f"conv-{c}"
        conv_turns = conversation(cid, rng.randint(turns_lo, turns_hi), 0)
        sessions.append(Session(cid, round(t, 4), "agent", conv_turns))
        t += rng.expovariate(conversations / window) if window > 0 else 0.0
    slo = SLO(ttft_s=round(max(5.0, 200 * facts.unloaded_itl_s), 2),
              tpot_s=round(5 * facts.unloaded_itl_s, 4))
    return Workload(
        "agentic",
        f"{conversations} coding-agent conversations over {window:.1f}s sharing a {preamble_tokens}-token "
        f"preamble; max_tokens {max_tokens}, true outputs lognormal median 220 / p99 3700",
        sessions, slo, None,
        {"conversations": conversations, "window_s": round(window, 3), "preamble_tokens": preamble_tokens,
         "max_tokens": max_tokens, "turns": [turns_lo, turns_hi], "subagent_p": subagent_p, "scale": scale},
    )


# --------------------------------------------------------------------------------------- mixed


#: ``mixed``'s interactive class: TTFT target 1 s, TPOT 40 ms (5x the 70B profile's unloaded ITL).
MIXED_INTERACTIVE_TTFT_S = 1.0
MIXED_INTERACTIVE_TPOT_S = 0.04
#: ``mixed``'s batch agent class: TTFT target 30 s, no TPOT target.
MIXED_BATCH_TTFT_S = 30.0


def _set_class(sessions: Sequence[Session], slo_class: str) -> None:
    for s in sessions:
        for t in s.turns:
            t.slo_class = slo_class
            _set_class(t.children, slo_class)


def mixed(facts: ServerFacts, seed: int, *, rate_per_s: float = 1.0, span_s: float | None = None,
          prompt_median: int = 500, out_median: int = 120, out_max: int = 256, scale: float = 1.0,
          **agentic_kw: Any) -> Workload:
    """Two classes on one server: ``interactive`` chat calls and ``batch`` agent conversations.

    * **batch** (priority 1, TTFT target :data:`MIXED_BATCH_TTFT_S` = 30 s, no TPOT target): exactly
      :func:`agentic`'s conversations for the same ``seed`` and ``scale`` (``agentic_kw`` reach it).
    * **interactive** (priority 0, TTFT target :data:`MIXED_INTERACTIVE_TTFT_S` = 1 s, TPOT
      :data:`MIXED_INTERACTIVE_TPOT_S` = 40 ms): single streamed calls arriving as a Poisson process at
      ``rate_per_s`` x ``scale`` over ``span_s`` (default twice the conversations' arrival window, so they
      keep arriving while the conversations run; the one-x window's, whatever ``scale``: agentic's grows
      with its conversations), each with a unique prompt (lognormal, median
      ``prompt_median`` = 500 tokens, 250-1000), ``max_tokens`` = ``out_max`` (256) and a true output
      lognormal median ``out_median`` (120) capped at 256. They are drawn from their own RNG, so the
      batch class is agentic's, request for request.

    Calibration (``tests/test_storm_mixed.py`` measures both on the storm at 1x): without admission the
    server preempts (agentic alone preempts ~20-40 times per run), and the interactive class alone offers
    under 30% of the tokens the server computes per second in that run (``params['interactive_tokens_per_s']``
    is its offer: prompt + true output tokens per second of its span). The workload's :attr:`Workload.slo`
    is the interactive class's (the tightest); each request is scored against its own class's.
    """
    batch = agentic(facts, seed, scale=scale, **agentic_kw)
    _set_class(batch.sessions, "batch")
    # agentic's own default window grows with its conversations (scale x: x times as many over x times
    # the window); the interactive span is the one-x window's, so that scale x is x times their rate
    base = int(agentic_kw.get("conversations", _AGENTIC_CONVERSATIONS))
    span = span_s if span_s is not None else 2.0 * base * 400 * facts.unloaded_itl_s
    rng = random.Random(f"{seed}:mixed-interactive")
    rate = rate_per_s * scale
    sessions: list[Session] = []
    t = rng.expovariate(rate) if rate > 0 else span
    offered = 0
    i = 0
    while t < span:
        prompt = _lognormal_int(rng, prompt_median, 2 * prompt_median * 0.95, prompt_median // 2,
                                2 * prompt_median)
        msgs = [{"role": "user", "content": make_text(prompt - 8, rng, f"chat {i}")}]
        out = _lognormal_int(rng, out_median, out_max, 1, out_max)
        turn = Turn(msgs, count_chat_tokens(msgs), out_max, out, slo_class="interactive")
        offered += turn.prompt_tokens + out
        sessions.append(Session(f"chat-{i}", round(t, 4), "interactive", [turn]))
        i += 1
        t += rng.expovariate(rate)
    inter = RequestClass("interactive", SLO(MIXED_INTERACTIVE_TTFT_S, MIXED_INTERACTIVE_TPOT_S), priority=0)
    batch_class = RequestClass("batch", SLO(MIXED_BATCH_TTFT_S, None), priority=1)
    merged = sorted(batch.sessions + sessions, key=lambda s: s.start_s)
    params = {**batch.params, "interactive_calls": len(sessions), "interactive_rate_per_s": round(rate, 4),
              "interactive_span_s": round(span, 3), "interactive_prompt_median": prompt_median,
              "interactive_out": [out_median, out_max],
              "interactive_tokens_per_s": round(offered / span, 1) if span > 0 else 0.0,
              "classes": {"interactive": {"ttft_s": MIXED_INTERACTIVE_TTFT_S,
                                          "tpot_s": MIXED_INTERACTIVE_TPOT_S, "priority": 0},
                          "batch": {"ttft_s": MIXED_BATCH_TTFT_S, "tpot_s": None, "priority": 1}}}
    return Workload(
        "mixed",
        f"{len(sessions)} interactive calls (prompt ~{prompt_median}, output <= {out_max} tokens, "
        f"{rate:.2f}/s over {span:.1f}s; TTFT <= {MIXED_INTERACTIVE_TTFT_S:g} s, TPOT <= "
        f"{MIXED_INTERACTIVE_TPOT_S * 1000:.0f} ms, priority 0) + {batch.description} (batch: TTFT <= "
        f"{MIXED_BATCH_TTFT_S:g} s, priority 1)",
        merged, inter.slo, None, params, classes={"interactive": inter, "batch": batch_class},
    )


# --------------------------------------------------------------------------------------- agent-types


#: ``agent-types``' system prompts (tokens): 6 agent types, 24k tokens = 1,500 blocks in all, under 20% of
#: the storm's limit on the 8,193-block pool (0.2 x 7,782 = 1,556 blocks), so all six can be pinned.
AGENT_TYPE_PROMPTS = (3000, 3400, 3800, 4200, 4600, 5000)


def agent_types(facts: ServerFacts, seed: int, *, calls: int = 600, zipf_s: float = 1.6,
                rate_per_s: float | None = None, context_median: int = 4000, context_p99: int = 9000,
                max_tokens: int = 1024, out_median: int = 200, out_p99: int = 900,
                scale: float = 1.0) -> Workload:
    """Single calls of 6 agent types, each with its own 3-5k-token system prompt, the types drawn with
    Zipf frequencies (type 0 the most frequent, exponent ``zipf_s``), each call with its own context
    (lognormal, median 4,000 / p99 9,000 tokens, unique: it shares nothing with other calls) and output
    (median 200 / p99 900 tokens, ``max_tokens`` 1024), streamed, arriving as a Poisson process.

    The pressure is on the prefix cache, not the pool: a rare type's prompt is released long before its
    next call, and the blocks the other calls allocate meanwhile push it through vLLM's free queue until
    it is evicted. ``rate_per_s`` (default: what keeps about 60% of the pool busy, from the unloaded step
    time) sets the arrival rate; ``scale`` (``--load-scale``) multiplies the calls and the rate (the same
    window). Sessions are of kind ``"type<i>"``; :attr:`Workload.pin_prefixes` holds
    the 6 system prompts. The storm's setups ``zp-pinned`` and ``zp-pinned-timer`` pin them.

    Sizing (issue 20: under ``zp-elastic`` at least 25% of the two rarest types' later calls must be
    cold, else raise the pressure once): with contexts of median 2,500 / p99 6,000 tokens, seed 1 had
    12% (KV max 0.57); the pressure was raised once, to 4,000 / 9,000 (41% and 46% on seeds 0 and 1,
    KV max 0.98 without admission). See docs/pinning.md."""
    rng = random.Random(seed)
    calls = max(1, round(calls * scale))
    prompts: list[list[Message]] = []
    for i, n in enumerate(AGENT_TYPE_PROMPTS):
        text = _agent_preamble(rng, n - 200) + make_text(150, rng, f"agent type {i} rules")
        prompts.append([{"role": "system", "content": f"[agent type {i}] " + text}])
    weights = [1.0 / (k + 1) ** zipf_s for k in range(len(prompts))]
    bs = facts.block_size
    mean_ctx = context_median * 1.2
    if rate_per_s is None:
        # hold ~60% of the usable pool: calls alive at once x their blocks; a call lives for its
        # output's decode steps at the unloaded ITL, x2 for the load
        call_blocks = (sum(AGENT_TYPE_PROMPTS) / len(AGENT_TYPE_PROMPTS) + mean_ctx + out_median) / bs
        alive = 0.6 * facts.usable_blocks / call_blocks
        life = 2 * out_median * 1.3 * facts.unloaded_itl_s + facts.unloaded_ttft_s
        rate_per_s = alive / max(life, 1e-3)
    rate_per_s *= scale  # the storm's --load-scale: more calls over the same window
    sessions: list[Session] = []
    t = 0.0
    for c in range(calls):
        k = rng.choices(range(len(prompts)), weights)[0]
        ctx_tokens = _lognormal_int(rng, context_median, context_p99, 100, 12000)
        msgs = [*prompts[k], {"role": "user", "content": make_text(ctx_tokens, rng, f"call {c} context")}]
        ptoks = count_chat_tokens(msgs)
        if ptoks + max_tokens > facts.max_model_len:
            continue
        out = _lognormal_int(rng, out_median, out_p99, 1, max_tokens)
        sessions.append(Session(f"call-{c}", round(t, 4), f"type{k}", [Turn(msgs, ptoks, max_tokens, out)]))
        t += rng.expovariate(rate_per_s)
    counts = [sum(1 for s in sessions if s.kind == f"type{k}") for k in range(len(prompts))]
    return Workload(
        "agent-types",
        f"{len(sessions)} calls of 6 agent types (system prompts {AGENT_TYPE_PROMPTS[0]}-"
        f"{AGENT_TYPE_PROMPTS[-1]} tokens, Zipf s={zipf_s}) at {rate_per_s:.2f}/s, unique contexts "
        f"median {context_median} tokens",
        sessions, interactive_slo(facts), None,
        {"calls": len(sessions), "zipf_s": zipf_s, "rate_per_s": round(rate_per_s, 4),
         "prompt_tokens": list(AGENT_TYPE_PROMPTS), "calls_per_type": counts,
         "context_median": context_median, "context_p99": context_p99, "max_tokens": max_tokens,
         "out_median": out_median, "out_p99": out_p99, "scale": scale},
        pin_prefixes=prompts,
    )


# --------------------------------------------------------------------------------------- trace replays


_TRACES = {
    "azure-code": ("traces/azure2023/AzureLLMInferenceTrace_code.csv", "azure"),
    "azure-conv": ("traces/azure2023/AzureLLMInferenceTrace_conv.csv", "azure"),
    "mooncake": ("traces/mooncake/conversation_trace.jsonl", "mooncake"),
}

#: The workload name of a trace file of one's own (``zp-client storm --trace FILE``); its report names the
#: file (``trace:<file name>``).
TRACE_WORKLOAD = "trace"


@functools.cache
def _one_token_words() -> tuple[str, ...]:
    """The words of ``_WORDS`` that cost exactly one token with or without a leading space."""
    count = _token_counter()
    return tuple(w for w in _WORDS if count(w) == 1 and count(" " + w) == 1)


@functools.cache
def _chat_overhead() -> tuple[int, int]:
    """Tokens the simulator's chat template puts before and after a single user message's content."""
    from zp_sim.tokenizer import encode, render_chat

    a = encode(render_chat([{"role": "user", "content": "the"}]))
    b = encode(render_chat([{"role": "user", "content": "of"}]))
    head = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return head, len(a) - head - 1


def _unique_word(i: int) -> str:
    """A letters-only word that no other request index gives (its first token differs from any other's)."""
    letters = "qzxjkv"
    word = ""
    i += 1
    while i:
        i, r = divmod(i - 1, len(letters))
        word = letters[r] + word
    return "zq" + word


def _exact_words(n_tokens: int, rng: random.Random, head: str) -> str:
    """``head`` followed by one-token words, ``n_tokens`` simulator tokens in all (``head`` alone when it is
    longer)."""
    words = _one_token_words()
    rest = max(0, n_tokens - _token_counter()(head))
    return " ".join([head, *(rng.choice(words) for _ in range(rest))])


def _prefixed_content(words: list[str], prefix_len: int, prompt: int, rng: random.Random, i: int) -> str:
    """A user message of ``prompt`` chat tokens whose first ``prefix_len`` are ``words``' (shared by every
    request of the same prefix id), the rest unique to request ``i``."""
    head, tail = _chat_overhead()
    content = max(1, prompt - head - tail)
    k = min(max(0, prefix_len - head), content)
    shared = " ".join(words[:k])
    if content - k <= 0:
        return shared
    unique = _exact_words(content - k, rng, _unique_word(i))
    return f"{shared} {unique}" if shared else unique


def trace_replay(source: str | Path, facts: ServerFacts, seed: int, *, trace_format: str = "auto",
                 time_scale: float = 1.0, load_scale: float = 1.0, max_requests: int | None = 200,
                 start_s: float = 0.0, max_tokens: int = 1024, length_scale: float = 1.0) -> Workload:
    """Replay a window of a trace: a public one by name (``azure-code``, ``azure-conv``, ``mooncake``,
    read from the shared folder) or a trace file of one's own (a path; ``trace_format`` as in
    :func:`zp_storm.tracefile.read_trace`). Both take the same path from here on.

    ``time_scale`` multiplies the trace's clock (0.1 runs ten times faster: virtual arrival = trace
    offset x time_scale). ``load_scale`` thins (< 1: each request kept with that probability) or
    replicates (> 1: each request sent floor(y) or ceil(y) times, copies 1 ms apart) the requests.
    ``length_scale`` multiplies prompt lengths (to fit long-context traces to a small simulated pool;
    output lengths are kept). Lengths are then capped to the context. A request without a client bound
    (Azure, Mooncake) gets ``max_tokens' = min(max(max_tokens, true output), max_model_len / 4)``, its
    true output capped to it, and its prompt capped to ``max_model_len - max_tokens' - 16``. A request
    with its own ``max_tokens`` (a replay file) keeps it and its prompt unless the two do not fit: then
    the bound is capped to ``max_model_len / 4`` and the prompt as above. The count of changed requests is
    reported as ``prompts_capped_to_context``. The window starts at trace offset ``start_s`` and holds
    the first ``max_requests`` requests (all when None) after load scaling. Mooncake's shared 512-token
    prefix blocks (``hash_ids``) become shared prompt text; so do a replay file's ``prefix_id`` /
    ``prefix_len``: requests of one prefix id share their first ``prefix_len`` chat tokens exactly (the
    template's header included), and every other token is unique to the request. A replay file in
    ``arrival_step`` counts each engine step as one unloaded decode step (``facts.unloaded_itl_s``).
    """
    from zp_storm.tracefile import read_trace

    if time_scale < 0 or load_scale <= 0 or length_scale <= 0:
        raise ConfigurationError(f"trace replay: time_scale must be >= 0 (got {time_scale}), load_scale > 0 "
                                 f"(got {load_scale}) and length_scale > 0 (got {length_scale})")
    if isinstance(source, str) and source in _TRACES:
        rel, fmt = _TRACES[source]
        name, label = source, rel
        trace = read_trace(find_shared_dir() / rel, fmt)
    else:
        trace = read_trace(Path(source), trace_format)
        name, label = f"{TRACE_WORKLOAD}:{trace.path.name}", str(trace.path)
    unit_s = facts.unloaded_itl_s if trace.time_unit == "step" else 1.0
    rows = [(r.t * unit_s, r) for r in trace.rows if r.t * unit_s >= start_s]
    rng = random.Random(seed)
    picked: list[tuple[float, int, Any]] = []
    for t_row, r in rows:
        copies = int(load_scale) + (1 if rng.random() < load_scale - int(load_scale) else 0)
        for c in range(copies):
            picked.append(((t_row - start_s) * time_scale + c * 0.001, c, r))
        if max_requests is not None and len(picked) >= max_requests:
            break
    if max_requests is not None:
        picked = picked[:max_requests]
    if not picked:
        raise ConfigurationError(f"{name}: no requests in the window (load_scale {load_scale} too small?)")
    bound_cap = facts.max_model_len // 4
    chunk_text: dict[int, str] = {}
    chunk_tokens = max(16, int(512 * length_scale))
    prefix_words: dict[str, tuple[random.Random, list[str]]] = {}
    sessions: list[Session] = []
    capped = 0
    for i, (t, copy, r) in enumerate(picked):
        out = max(1, r.out)
        prompt = max(16, int(r.prompt * length_scale))
        if r.max_tokens is None:
            bound = min(max(max_tokens, out), bound_cap)
            out = min(out, bound)
            limit = facts.max_model_len - bound - 16
            if prompt > limit:
                prompt, capped = limit, capped + 1
        else:
            bound = r.max_tokens
            if prompt + bound + 16 > facts.max_model_len:
                bound = min(bound, bound_cap)
                out = min(out, bound)
                prompt, capped = min(prompt, facts.max_model_len - bound - 16), capped + 1
        if r.hash_ids:
            # shared prefix blocks become identical text; the remainder is unique to the request
            parts = []
            for h in r.hash_ids[: max(0, prompt // chunk_tokens)]:
                if h not in chunk_text:
                    rng_h = random.Random(h * 7919 + seed)
                    chunk_text[h] = make_text(chunk_tokens - 2, rng_h, f"b{h}") + "\n"
                parts.append(chunk_text[h])
            used = len(parts) * chunk_tokens
            parts.append(make_text(max(1, prompt - used - 8), rng, f"req {i}"))
            content = "".join(parts)
        elif r.prefix_id is not None and r.prefix_len > 0:
            # one word stream per prefix id: a shorter prefix of the same id is a prefix of a longer one
            plen = min(prompt, max(1, int(r.prefix_len * length_scale)))
            rng_p, words = prefix_words.setdefault(r.prefix_id, (random.Random(f"{seed}:{r.prefix_id}"), []))
            vocab = _one_token_words()
            words.extend(rng_p.choice(vocab) for _ in range(plen - len(words)))
            content = _prefixed_content(words, plen, prompt, rng, i)
        else:
            content = make_text(prompt - 8, rng, f"req {i}")
        msgs = [{"role": "user", "content": content}]
        turn = Turn(msgs, count_chat_tokens(msgs), bound, out, stream=r.stream, priority=r.priority)
        sid = f"req-{i}" if r.id is None else (r.id if copy == 0 else f"{r.id}+{copy}")
        sessions.append(Session(sid, round(t, 6), "trace", [turn]))
    span = picked[-1][0]
    slo = SLO(ttft_s=round(max(5.0, 200 * facts.unloaded_itl_s), 2),
              tpot_s=round(5 * facts.unloaded_itl_s, 4))
    params: dict[str, Any] = {
        "trace": label, "time_scale": time_scale, "load_scale": load_scale, "length_scale": length_scale,
        "start_s": start_s, "max_requests": max_requests, "max_tokens": max_tokens,
        "prompts_capped_to_context": capped,
        "cap_rule": "bound = min(max(max_tokens, true_out), max_model_len/4); "
                    "prompt = min(prompt, max_model_len - bound - 16)"}
    if name in _TRACES:
        description = (f"{len(sessions)} requests of {rel} from offset {start_s:.0f}s, "
                       f"time_scale {time_scale}, load_scale {load_scale}, length_scale {length_scale} "
                       f"({span:.1f}s virtual)")
    else:
        params.update(format=trace.format, lines=len(trace.rows), time_unit=trace.time_unit,
                      prefix_ids=len({r.prefix_id for r in trace.rows if r.prefix_id is not None}))
        if trace.format == "replay":
            del params["max_tokens"]  # every line has its own
            params["cap_rule"] = ("the file's max_tokens and prompt, unless prompt + max_tokens + 16 > "
                                  "max_model_len: then bound = min(max_tokens, max_model_len/4), "
                                  "prompt = min(prompt, max_model_len - bound - 16)")
        if trace.time_unit == "step":
            params["step_s"] = unit_s
        description = (f"{len(sessions)} requests of {label} ({trace.format} format, "
                       f"{len(trace.rows)} lines), time_scale {time_scale}, load_scale {load_scale}, "
                       f"length_scale {length_scale} ({span:.1f}s virtual)")
    return Workload(name, description, sessions, slo, None, params)


WORKLOADS: tuple[str, ...] = ("seed-burst", "agentic", "mixed", "agent-types", "azure-code", "azure-conv",
                               "mooncake")


def build_workload(name: str, facts: ServerFacts, seed: int, *, time_scale: float | None = None,
                   load_scale: float | None = None, replicas: int = 1, **overrides: Any) -> Workload:
    """Build workload ``name`` for a server described by ``facts``: one of :data:`WORKLOADS`, or
    :data:`TRACE_WORKLOAD` with ``path=`` a trace file (see :func:`trace_replay`). Unknown names raise
    :class:`~zp_client.errors.ConfigurationError` listing the known ones.

    ``replicas`` (a fleet of that many servers like ``facts``'): the offered load is multiplied by it, so
    that each replica is as loaded as one server at ``replicas=1``: ``agentic`` runs ``replicas`` x the
    conversations over the one-server window (the same arrival window, N x the arrival rate);
    ``seed-burst`` multiplies its streams and burst (its ``scale``); a trace replay replicates each
    request (its ``load_scale``). ``replicas=1`` changes nothing."""
    if replicas < 1:
        raise ConfigurationError(f"replicas must be >= 1, got {replicas!r}")
    if replicas > 1:
        base = load_scale if load_scale is not None else 1.0
        if name in ("agentic", "mixed") and "window_s" not in overrides:
            n = int(overrides.get("conversations", _AGENTIC_CONVERSATIONS))
            overrides["window_s"] = round(n * base) * 400 * facts.unloaded_itl_s * (
                time_scale if time_scale is not None else 1.0)
        load_scale = base * replicas
    if name == "seed-burst":
        if load_scale is not None:
            overrides.setdefault("scale", load_scale)
        return seed_burst(facts, seed, **overrides)
    if name == "agentic":
        if load_scale is not None:
            overrides.setdefault("scale", load_scale)
        if time_scale is not None and "window_s" not in overrides:
            n = int(overrides.get("conversations", _AGENTIC_CONVERSATIONS))
            overrides["window_s"] = round(n * (load_scale or 1.0)) * 400 * facts.unloaded_itl_s * time_scale
        return agentic(facts, seed, **overrides)
    if name == "mixed":
        if load_scale is not None:
            overrides.setdefault("scale", load_scale)
        if time_scale is not None and "window_s" not in overrides:
            n = int(overrides.get("conversations", _AGENTIC_CONVERSATIONS))
            overrides["window_s"] = round(n * (load_scale or 1.0)) * 400 * facts.unloaded_itl_s * time_scale
            overrides.setdefault("span_s", 2 * n * 400 * facts.unloaded_itl_s * time_scale)
        return mixed(facts, seed, **overrides)
    if name == "agent-types":
        if load_scale is not None:
            overrides.setdefault("scale", load_scale)
        return agent_types(facts, seed, **overrides)
    if name in _TRACES:
        defaults = _TRACE_DEFAULTS[name]
        kw = {**defaults, **overrides}
        if time_scale is not None:
            kw["time_scale"] = time_scale
        if load_scale is not None:
            kw["load_scale"] = load_scale
        return trace_replay(name, facts, seed, **kw)
    if name == TRACE_WORKLOAD:
        # a trace file of one's own: overrides carry its ``path`` (and ``trace_format``, ``max_requests``...)
        kw = {"time_scale": 1.0, "load_scale": 1.0, "max_requests": None, **overrides}
        if "path" not in kw:
            raise ConfigurationError("workload 'trace' needs the trace file: pass path= "
                                     "(zp-client storm --trace FILE)")
        if time_scale is not None:
            kw["time_scale"] = time_scale
        if load_scale is not None:
            kw["load_scale"] = load_scale
        return trace_replay(Path(kw.pop("path")), facts, seed, **kw)
    raise ConfigurationError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")


# Defaults chosen so a replay of a few hundred requests loads a small simulated pool (see the storm tables in
# docs/benchmark.md for the exact values printed with each result).
_TRACE_DEFAULTS: dict[str, dict[str, Any]] = {
    "azure-code": {"time_scale": 0.1, "load_scale": 1.0, "max_requests": 200, "length_scale": 1.0},
    "azure-conv": {"time_scale": 0.25, "load_scale": 1.0, "max_requests": 200, "length_scale": 1.0},
    "mooncake": {"time_scale": 1.0, "load_scale": 1.0, "max_requests": 200, "length_scale": 0.25},
}
