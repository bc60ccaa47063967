"""The setups of issue 30 (goodput under overload), registered into :mod:`zp_storm.setups` on import.

* ``zp-oracle-h1``: ``zp-oracle`` (true output lengths) on the whole usable pool (headroom 1.0), FIFO
  line: what admission costs with perfect forecasts and no reserve.
* ``zp-slo``: ``zp-elastic`` (library defaults) whose app sends each request's class TTFT target as
  ``X-ZP-TTFT-Target`` (its TPOT target as ``X-ZP-TPOT-Target`` where the class has one; and, on a
  workload with several classes, the class's ``X-ZP-Priority``), as a real app would, on a budget built
  with ``line="slo"``.
* ``zp-oracle-slo``: ``zp-oracle-h1`` with the targets sent and ``line="slo"``: the bound on what
  ordering can reach.
* ``vllm-priority``: no client admission (``no-admission``'s client); the server runs vLLM's
  ``--scheduling-policy priority`` and each request's body carries its class's ``priority`` (0 on a
  one-class workload: every request the same, so the order is arrival order).
* ``vllm-queue-cap``: no client admission, ``naive``'s retry stack behind the same gateway; the server
  runs with ``--max-num-queued-tokens`` = the workload's (tightest) TTFT target x the measured prefill
  throughput, and answers 503 when its prefill backlog is full.

The two ``*-slo`` setups build their budget with ``line="slo"`` (:func:`slo_line_kwargs`, the one place
they get their line from). See docs/benchmark.md#setups.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from zp_storm.elastic_setups import _local_elastic
from zp_storm.loadgen import Caller
from zp_storm.setups import (
    AppCaller,
    SetupContext,
    SetupSpec,
    openai_client,
    register_setup,
    zp_client_for,
    zp_limit_blocks,
)
from zp_storm.workloads import Turn

__all__ = ["PRIORITY_SETUP", "QUEUE_CAP_SETUP", "SLO_SETUPS", "TARGET_HEADER", "TPOT_HEADER", "TargetCaller",
           "PriorityCaller", "queue_cap_tokens", "slo_line_kwargs"]

#: The header an app sends with each request's TTFT target (seconds).
TARGET_HEADER = "X-ZP-TTFT-Target"
#: The header an app sends with each request's TPOT target (seconds), where its class has one.
TPOT_HEADER = "X-ZP-TPOT-Target"
#: The setups that send targets and ask for the SLO line.
SLO_SETUPS: tuple[str, ...] = ("zp-slo", "zp-oracle-slo")
#: Whether the app sends the TPOT target too (benchmarks/slo_tail_rules.py's ``ttft-only`` rule turns it
#: off to measure the line as it was before the answer allowance).
SEND_TPOT = True
PRIORITY_SETUP = "vllm-priority"
QUEUE_CAP_SETUP = "vllm-queue-cap"


def slo_line_kwargs() -> dict[str, Any]:
    """The ``*-slo`` setups' budget arguments: the SLO-aware line (docs/admission.md#the-slo-aware-line)."""
    return {"line": "slo"}


def _fmt_s(x: float) -> str:
    return f"{x:g}"


class TargetCaller(AppCaller):
    """``AppCaller`` whose app sends each request's class TTFT target as ``X-ZP-TTFT-Target``, its TPOT
    target (where the class has one) as ``X-ZP-TPOT-Target`` and, for a request of a named class (a
    workload with several), the class's priority as ``X-ZP-Priority``. The TPOT target is what gives a
    non-streamed call its real deadline (TTFT + output x TPOT, the benchmark's SLO for it)."""

    def __init__(self, client: Any, model: str, ctx: SetupContext) -> None:
        super().__init__(client, model, app_retry=True)
        self.ctx = ctx

    def request_extra(self, turn: Turn) -> dict[str, Any]:
        ttft, tpot, priority = self.ctx.slo_class(turn.slo_class)
        headers = {TARGET_HEADER: _fmt_s(ttft)}
        if tpot is not None and SEND_TPOT:
            headers[TPOT_HEADER] = _fmt_s(tpot)
        if turn.slo_class is not None:
            headers["X-ZP-Priority"] = str(priority)
        return {"extra_headers": headers}


class PriorityCaller(AppCaller):
    """``no-admission``'s caller (``max_retries=0``, no app retry) whose requests carry vLLM's body field
    ``priority``: the request's class's (0 on a one-class workload), else the trace's own."""

    def __init__(self, client: Any, model: str, ctx: SetupContext) -> None:
        super().__init__(client, model, app_retry=False)
        self.ctx = ctx

    def request_extra(self, turn: Turn) -> dict[str, Any]:
        if turn.slo_class is None and turn.priority is not None:
            priority = turn.priority
        else:
            priority = self.ctx.slo_class(turn.slo_class)[2]
        return {"extra_body": {"priority": int(priority)}}


def _h1_limit(ctx: SetupContext) -> int:
    return zp_limit_blocks(ctx.num_gpu_blocks, 1.0)


async def _oracle_client(ctx: SetupContext, stack: contextlib.AsyncExitStack, **budget_kw: Any) -> Any:
    from zp_client.transport import forecaster_for
    from zp_storm.oracle import SimOracleForecaster

    budget = _local_elastic(ctx, limit=_h1_limit(ctx), **budget_kw)
    return await zp_client_for(ctx, stack, budget, forecaster=SimOracleForecaster(forecaster_for(budget)))


async def _zp_oracle_h1(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    return AppCaller(await _oracle_client(ctx, stack), ctx.model, app_retry=True)


async def _zp_slo(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    from zp_storm.elastic_setups import _forecaster

    budget = _local_elastic(ctx, **slo_line_kwargs())
    client = await zp_client_for(ctx, stack, budget, forecaster=_forecaster(ctx.elastic))
    return TargetCaller(client, ctx.model, ctx)


async def _zp_oracle_slo(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    return TargetCaller(await _oracle_client(ctx, stack, **slo_line_kwargs()), ctx.model, ctx)


async def _vllm_priority(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    return PriorityCaller(openai_client(ctx, stack, max_retries=0), ctx.model, ctx)


async def _vllm_queue_cap(ctx: SetupContext, stack: contextlib.AsyncExitStack) -> Caller:
    return AppCaller(openai_client(ctx, stack), ctx.model, app_retry=True)  # naive's: openai's 2 + the app's


def queue_cap_tokens(wl: Any, facts: Any) -> int:
    """``vllm-queue-cap``'s ``--max-num-queued-tokens``: the workload's TTFT target (the tightest of its
    classes) x the server's measured prefill throughput (tokens per second), at least 1."""
    return max(1, math.floor(float(wl.tightest_ttft_s()) * float(facts.prefill_tokens_per_s)))


def _queue_cap_sim(wl: Any, facts: Any) -> dict[str, Any]:
    if not facts.prefill_tokens_per_s > 0:
        from zp_client.errors import ConfigurationError

        raise ConfigurationError("vllm-queue-cap needs the server's measured prefill throughput")
    return {"max_num_queued_tokens": queue_cap_tokens(wl, facts)}


register_setup(SetupSpec("zp-oracle-h1", True, default=False,
                         description="zp-oracle (true output lengths), headroom 1.0, FIFO line (reference)"),
               _zp_oracle_h1, after="zp-oracle")
register_setup(SetupSpec("zp-slo", True, default=False,
                         description="zp-elastic + the app sends each class's TTFT target "
                                     "(X-ZP-TTFT-Target), budget line='slo'"),
               _zp_slo, after="zp-oracle-h1")
register_setup(SetupSpec("zp-oracle-slo", True, default=False,
                         description="zp-oracle-h1 + targets sent, line='slo' (the bound on ordering)"),
               _zp_oracle_slo, after="zp-slo")
register_setup(SetupSpec(PRIORITY_SETUP, False, default=False, sim_extra={"policy": "priority"},
                         description="no admission; server --scheduling-policy priority, body priority "
                                     "per class"),
               _vllm_priority, after="naive")
register_setup(SetupSpec(QUEUE_CAP_SETUP, True, default=False, sim_for=_queue_cap_sim,
                         description="naive behind the gateway; server --max-num-queued-tokens = TTFT "
                                     "target x measured prefill throughput (503 when full)"),
               _vllm_queue_cap, after=PRIORITY_SETUP)
