"""The planner: one admitted request read (:class:`~zp_client._admission.plan.Parsed`) and planned
(:class:`~zp_client._admission.plan.Plan`): its blocks, priority, deadline, targets, the elastic
forecast, a fleet's routing meta, and the body to send. No I/O: the metadata it needs is read first
(:mod:`zp_client._admission.servers`)."""

from __future__ import annotations

import json
import logging

from zp_client._admission.parts import Parts
from zp_client._admission.plan import (
    AGE_META,
    ANSWER_META,
    FAIL_FAST_META,
    TPOT_TARGET_META,
    TTFT_TARGET_META,
    Options,
    Parsed,
    Plan,
    api_base,
    read_body,
    read_headers,
)
from zp_client._admission.ports import (
    BlindForecaster,
    HttpRequest,
    LeaseMeta,
    RequestForecaster,
)
from zp_client._admission.servers import Servers
from zp_client._sse import forecast_hi, reassembly_faithful
from zp_client.errors import PromptTooLong
from zp_client.estimate import PromptEstimate

__all__ = ["Planner"]

logger = logging.getLogger("zp_client.transport")


class Planner:
    """Reads and plans the admitted requests of one core."""

    def __init__(self, parts: Parts, servers: Servers) -> None:
        self._parts = parts
        self._servers = servers

    # -- parsing ------------------------------------------------------------------------------------
    def parse(self, request: HttpRequest) -> Parsed | None:
        """Read the request's JSON and per-call options; None when it cannot be admitted (not JSON)."""
        parts = self._parts
        settings = parts.settings
        try:
            body = json.loads(request.content)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict):
            return None
        opts = read_headers(request.headers.raw)  # a bad zp header: InvalidRequest, before anything is held
        headers, auth, route, priority = opts.headers, opts.auth, opts.route, opts.priority
        deadline_s = opts.deadline_s if opts.deadline_s is not None else settings.deadline_s
        if priority is None:
            bp = body.get("priority")
            priority = bp if isinstance(bp, int) and not isinstance(bp, bool) else 0
        arrival = parts.clock.monotonic()

        path = request.url.path.rstrip("/")
        changed = False
        responses = path.endswith("/responses")
        keys = ("max_output_tokens",) if responses else ("max_completion_tokens", "max_tokens")
        max_tokens = read_body(body, responses)  # a field zp reads that is malformed: InvalidRequest
        if max_tokens is None:
            max_tokens = settings.default_max_tokens
            body[keys[-1]] = max_tokens
            changed = True
            if parts.shared.once("default_max_tokens"):
                logger.info(
                    "request without max_tokens: sending %s=%d (Settings.default_max_tokens) so the KV "
                    "lease is a true upper bound; set max_tokens to silence this",
                    keys[-1],
                    max_tokens,
                )
        stream = body.get("stream") is True
        strip_usage = False
        upstream = False
        if (
            not stream
            and parts.stream_upstream
            and not path.endswith("/responses")
            and body.get("stream") in (None, False)
            and reassembly_faithful(body)
        ):
            # Streamed upstream, reassembled here: bytes flow while the answer is generated (no proxy
            # idle timeout) and the lease sees its growth. The usage chunk is always asked for.
            upstream = stream = True
            body["stream"] = True
            so = body.get("stream_options")
            so = dict(so) if isinstance(so, dict) else {}
            so["include_usage"] = True
            body["stream_options"] = so
            changed = True
        elif stream and not path.endswith("/responses"):
            so = body.get("stream_options")
            if not (isinstance(so, dict) and so.get("include_usage") is True):
                so = dict(so) if isinstance(so, dict) else {}
                so["include_usage"] = True
                body["stream_options"] = so
                changed = True
                strip_usage = True
        base, root = api_base(request.url)
        if parts.fleet is not None:  # metadata comes from a replica, not the fleet's own name
            base, root = parts.fleet.metadata_base(base, root)
        model = body.get("model") if isinstance(body.get("model"), str) else None
        ttft, tpot = self._targets(opts, route or model or "default", priority)
        return Parsed(
            body=body,
            changed=changed,
            headers=headers,
            priority=priority,
            deadline=None if deadline_s is None else arrival + deadline_s,
            stream=stream,
            strip_usage=strip_usage,
            max_tokens=max_tokens,
            model=model,
            base=base,
            root=root,
            auth_headers=auth,
            route=route,
            upstream=upstream,
            session=opts.session,
            chat_or_completions=not path.endswith("/responses"),
            arrival=arrival,
            ttft_target_s=ttft,
            tpot_target_s=tpot,
            fail_fast=(settings.fail_fast if opts.fail_fast is None else opts.fail_fast)
            and deadline_s is not None,
        )

    def _targets(self, opts: Options, route: str, priority: int) -> tuple[float | None, float | None]:
        """The request's (TTFT, TPOT) targets in seconds: its header, else its route's setting, else its
        class's, else the global one (docs/admission.md#targets); None where none is set."""
        s = self._parts.settings
        ttft = opts.ttft_target_s
        if ttft is None:
            ttft = s.ttft_route_targets.get(route, s.ttft_targets.get(priority, s.ttft_target_s))
        tpot = opts.tpot_target_s
        if tpot is None:
            tpot = s.tpot_route_targets.get(route, s.tpot_targets.get(priority, s.tpot_target_s))
        return ttft, tpot

    # -- planning -----------------------------------------------------------------------------------
    def shared_prefix(self, est: PromptEstimate, low: int | None = None) -> tuple[str | None, int]:
        """``(prefix_key, full blocks)`` of a prompt estimate's shared preamble (leading system messages
        and tool schemas), or ``(None, 0)``. vLLM shares only full blocks; the prefix is counted from the
        estimate's lower bound ``low`` (default: the estimator's) so an over-estimate never claims
        sharing that does not happen. What every request's lease meta and a pinned prefix
        (:mod:`zp_client.pinning`) carry."""
        key = est.prefix_key
        ptok = int(est.prefix_tokens or 0)
        if key is None or ptok <= 0:
            return None, 0
        if low is None:
            low = int(self._parts.estimator.lower_bound_tokens(est))
        if est.tokens > 0:
            ptok = min(ptok, ptok * low // int(est.tokens))
        pblocks = ptok // self._parts.budget.block_size
        return (key, pblocks) if pblocks > 0 else (None, 0)

    def finish_plan(self, request: HttpRequest, p: Parsed, est: PromptEstimate, mml: int | None) -> Plan:
        """The plan of a parsed request, given its prompt estimate and the model's context length."""
        from zp_client.estimate import kv_blocks

        parts = self._parts
        estimator = parts.estimator
        # Refuse only what surely does not fit: an over-estimate must never refuse a prompt that fits.
        low = int(estimator.lower_bound_tokens(est))
        if mml is not None and low > mml:
            raise PromptTooLong(low, mml)
        prompt = int(estimator.reserve_tokens(est))
        n = int(est.n or 1)
        bs = parts.budget.block_size
        blocks = kv_blocks(prompt, p.max_tokens, block_size=bs, max_model_len=mml, n=n)
        held = min(blocks, kv_blocks(prompt, 0, block_size=bs, max_model_len=mml, n=n))
        route = p.route or p.model or "default"
        meta: LeaseMeta | None = None
        forecast = 0
        known = False
        continuous = strip_continuous = False
        if parts.elastic:
            # n > 1 grows n tokens per step, which the one-token-per-step projection cannot express:
            # project it as non-streamed (its forecast end held from now), which is conservative.
            streaming = p.stream and n == 1
            forecast, known = self._forecast(p, route, streaming)
            meta = {"prompt_tokens": prompt * n, "forecast_tokens": forecast * n, "streaming": streaming}
            if streaming and parts.spread:
                # The upper forecast: what a spread-sized reserve reads (a known forecast has none).
                hi = forecast if known else forecast_hi(parts.forecaster, route, 0, p.max_tokens)
                if hi is not None:
                    meta["forecast_hi"] = max(hi, forecast)
            if streaming and p.chat_or_completions and self._continuous_usage(p):
                so = p.body.get("stream_options")
                so = dict(so) if isinstance(so, dict) else {}
                continuous = True
                # The caller reads per-chunk usage only if it asked for it with include_usage (vLLM
                # ignores continuous_usage_stats without it, and zp added include_usage if missing).
                strip_continuous = p.strip_usage or so.get("continuous_usage_stats") is not True
                if so.get("continuous_usage_stats") is not True:
                    so["continuous_usage_stats"] = True
                    p.body["stream_options"] = so
                    p.changed = True
            key, pblocks = self.shared_prefix(est, low)
            if key is not None:
                meta["prefix_key"] = key
                meta["prefix_blocks"] = pblocks
        if parts.fleet is not None:
            meta = {**(meta or {}), **parts.fleet.routing_meta(p.body, prompt, p.session)}
        targeted = p.ttft_target_s is not None or p.tpot_target_s is not None
        if targeted:  # what the budget's line orders by; age_s is added at each acquire (lease_meta)
            meta = dict(meta or {})
            if p.ttft_target_s is not None:
                meta[TTFT_TARGET_META] = p.ttft_target_s
            if p.tpot_target_s is not None:
                meta[TPOT_TARGET_META] = p.tpot_target_s
            if (parts.settings.answer_allowance and p.ttft_target_s is not None
                    and p.tpot_target_s is not None and forecast > 0 and (p.upstream or not p.stream)):
                # Opt-in. Not streamed to the caller: its SLO is the whole answer within TTFT + output x
                # TPOT (when a streamed call meeting both targets would end), so its line deadline is
                # later by the forecast output at the TPOT target (ledger.line_deadline).
                meta[ANSWER_META] = forecast * p.tpot_target_s  # per choice: n choices decode together
        content = request.content
        if p.changed:
            content = json.dumps(p.body, separators=(",", ":"), ensure_ascii=False).encode()
        return Plan(
            content=content,
            headers=p.headers,
            blocks=blocks,
            held=held,
            priority=p.priority,
            deadline=p.deadline,
            strip_usage=p.strip_usage,
            stream=p.stream,
            prompt_tokens=prompt,
            n=n,
            estimate=est,
            meta=meta,
            route=route,
            max_tokens=p.max_tokens,
            forecast=forecast,
            forecast_known=known,
            spread=parts.spread,
            chat=request.url.path.rstrip("/").endswith("/chat/completions"),
            upstream=p.upstream,
            continuous=continuous,
            strip_continuous=strip_continuous,
            arrival=p.arrival,
            targeted=targeted,
            fail_fast=p.fail_fast,
        )

    def lease_meta(self, plan: Plan, meta: LeaseMeta | None) -> LeaseMeta | None:
        """``meta`` as this acquire sends it: with a target, plus the request's ``age_s`` now (seconds
        since its first arrival, so a retry keeps its original arrival) and the targets themselves."""
        if plan.fail_fast:  # the budget refuses at enqueue when it predicts the wait past the deadline
            meta = {**(meta or {}), FAIL_FAST_META: True}
        if not plan.targeted:
            return meta
        out = dict(meta or {})
        for key in (TTFT_TARGET_META, TPOT_TARGET_META, ANSWER_META):
            if plan.meta is not None and key in plan.meta:
                out[key] = plan.meta[key]
        out[AGE_META] = max(0.0, self._parts.clock.monotonic() - plan.arrival)
        return out

    def _continuous_usage(self, p: Parsed) -> bool:
        """Whether to ask for vLLM's ``continuous_usage_stats`` (``Settings.continuous_usage``; under
        "auto" only for a server whose ``GET models`` said vLLM: others may refuse the unknown field)."""
        mode = self._parts.settings.continuous_usage
        if mode == "auto":
            server = self._servers.known(p.base)
            return server is not None and bool(server.is_vllm)
        return mode == "always"

    def _forecast(self, p: Parsed, route: str, streaming: bool = True) -> tuple[int, bool]:
        """(forecast output tokens per choice, known from the request?). A forecaster that reads the
        request (:class:`~zp_client._admission.ports.RequestForecaster`) answers first; otherwise a
        request whose growth is not seen (``streaming`` False) is forecast at the forecaster's
        ``q_blind``: nothing corrects it later."""
        fc = self._parts.forecaster
        assert fc is not None  # an elastic core always has one (Core.__init__)
        if isinstance(fc, RequestForecaster):
            known = fc.forecast_request(route, p.body, max_tokens=p.max_tokens, streaming=streaming)
            if known is not None:
                return min(int(known), p.max_tokens), True
        if streaming or not isinstance(fc, BlindForecaster) or fc.q_blind is None:
            # a forecaster without the blind quantile: its single q
            return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens)), False
        return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens, streaming=False)), False
