"""The admission core, sans I/O: the request plan, the attempt loop and learning from usage.

:meth:`Core.admit` returns a :class:`Machine`, the attempt loop of one request as a state machine: it
yields actions (:class:`Acquire`, :class:`Send`, :class:`Decide`, :class:`Sleep`, :class:`Release`...)
and takes their results, the way ``h11`` or :mod:`zp_client.budget.ledger` keep decisions apart from
I/O. The transports (:mod:`zp_client._drivers`) perform the actions, async or blocking; the loop exists
only here. Time comes from an injectable :class:`~zp_client.clock.Clock`. See docs/admission.md.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from zp_client._plan import (
    AGE_META,
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
from zp_client._release import Holder, watchdog
from zp_client._repeat import one_loop
from zp_client._sse import BadEvent, Reassembler, Scanner, forecast_hi, reassembly_faithful
from zp_client.budget.base import Budget, Lease, Ticket
from zp_client.clock import SYSTEM_CLOCK, Clock
from zp_client.config import Settings
from zp_client.errors import (
    AdmissionTimeout,
    ConfigurationError,
    DeadlineExceeded,
    LeaseTooLarge,
    PromptTooLong,
    ServerUnreachable,
    ZPError,
    error_chain,
)
from zp_client.observe import AdmissionInfo
from zp_client.observe import active as active_observers
from zp_client.observe import notify as notify_observers

if TYPE_CHECKING:
    from zp_client._httplib import HttpLib
    from zp_client.metrics import ZPMetrics
    from zp_client.retry import RetryPolicy

__all__ = ["Core", "Machine", "Done", "RequestForecaster", "check_pool", "default_retry", "forecaster_for"]

logger = logging.getLogger("zp_client.transport")

_logged_default_max_tokens = False
_logged_compressed = False
_logged_no_max_model_len: set[str] = set()
# The servers (roots) whose pool each budget was checked against, so a budget whose limit is larger than
# a server's KV pool warns once however many transports share it (see Core._pool_probe).
_pool_checked: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
_pool_checked_lock = threading.Lock()
# Answers that mean the server is overloaded: each is reported to the budget (Budget.note_overload), which
# tells an attached adaptive limit (zp_client.adaptive).
OVERLOAD_STATUSES = frozenset({429, 503, 529})


# --------------------------------------------------------------------------------------------------
# Actions: what the attempt loop asks its driver to do. The comment says what the driver sends back.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Estimate the prompt with the server's tokenizer (``Settings.estimator == "server"``) -> estimate."""

    path: str
    body: dict[str, Any]
    server: Any


@dataclass(frozen=True)
class ModelLen:
    """Read the model's context length from the server -> int or None."""

    server: Any
    model: str | None


@dataclass(frozen=True)
class PoolSize:
    """Read the server's ``GET /metrics`` (its KV pool, ``vllm:cache_config_info``) -> ServerMetrics."""

    server: Any


@dataclass(frozen=True)
class NewRetryState:
    """Start the retry policy's state for this request -> RetryState."""

    policy: Any


@dataclass(frozen=True)
class Acquire:
    """Take a lease from the budget -> Lease."""

    blocks: int
    priority: int
    timeout: float | None
    ticket: Ticket | None
    held: int
    meta: dict[str, Any] | None
    budget: Any = None
    """The budget to take it from (None: the core's; a disaggregated fleet's prefill leg names its prefill
    fleet)."""

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``Budget.acquire``; ``meta`` only when there is some (a backend written
        before it existed keeps working)."""
        kw: dict[str, Any] = {"priority": self.priority, "timeout": self.timeout, "ticket": self.ticket,
                              "held": self.held}
        if self.meta is not None:
            kw["meta"] = dict(self.meta)
        return kw


@dataclass(frozen=True)
class Send:
    """Send the request through the inner transport -> its response (headers read, body not)."""

    request: Any
    deadline: float | None = None
    """The call's deadline (monotonic): the driver ends the wait for the headers there with
    :class:`DeadlineExceeded` (the deadline bounds the whole call up to its last byte)."""


@dataclass(frozen=True)
class ReadAll:
    """Read the response body to its end, passing each chunk to ``sink`` -> None."""

    response: Any
    sink: Callable[[bytes], None]
    on_first: Holder | None = None
    """Released (shielded) as soon as the first chunk arrived: a prefill leg, whose KV the decode replica
    has read once it answers."""
    deadline: float | None = None
    """As :attr:`Send.deadline`: the whole read ends there (idle or trickling alike)."""


@dataclass(frozen=True)
class Peek:
    """Read the response body's first chunk -> ``(chunk, rest)``: the chunk (None: the body was empty)
    and an iterator over the rest of the body (a fleet's stream is handed to its caller only once its
    first bytes came: a replica that fails before them is not the caller's problem)."""

    response: Any
    deadline: float | None = None
    """As :attr:`Send.deadline`."""


@dataclass(frozen=True)
class Close:
    """Close the response (``shield``: even while the caller is being cancelled) -> None."""

    response: Any
    shield: bool


@dataclass(frozen=True)
class Release:
    """Release the holder's lease (once; shielded from cancellation) -> None. ``after_s`` > 0: in that
    many seconds, without waiting for it (a prefill leg whose KV the prefill replica keeps until vLLM's
    lease on it expires)."""

    holder: Holder
    after_s: float = 0.0


@dataclass(frozen=True)
class Decide:
    """Ask the retry policy about a failed attempt -> RetryDecision."""

    policy: Any
    state: Any
    status: int | None
    headers: Mapping[str, str] | None
    error: BaseException | None
    remaining_s: float | None

    def kwargs(self) -> dict[str, Any]:
        return {"status": self.status, "headers": self.headers, "error": self.error, "delivered": False,
                "remaining_s": self.remaining_s, "wait_for_budget": True}


@dataclass(frozen=True)
class WaitBudget:
    """Wait, holding no lease, until the retry budget grants the retry a decision said it owes -> None
    (or raises RetryBudgetExhausted)."""

    policy: Any
    state: Any
    remaining_s: float | None


@dataclass(frozen=True)
class Sleep:
    """Sleep before the next attempt (the retry policy's sleep) -> None."""

    policy: Any
    seconds: float


Action = (Estimate | ModelLen | PoolSize | NewRetryState | Acquire | Send | ReadAll | Peek | Close | Release
          | Decide | Sleep | WaitBudget)
Steps = Generator[Action, Any, Any]


@dataclass(frozen=True)
class Done:
    """The request is over: ``response`` goes to the caller."""

    response: Any


class Machine:
    """One request's attempt loop. A driver calls :meth:`start`, performs each action it gets and hands
    back the result (:meth:`send`) or the exception it raised (:meth:`throw`) until it gets
    :class:`Done`; an exception the loop does not handle propagates out of ``send``/``throw``."""

    __slots__ = ("_steps",)

    def __init__(self, steps: Steps) -> None:
        self._steps = steps

    def start(self) -> Action | Done:
        return self.send(None)

    def send(self, result: Any) -> Action | Done:
        try:
            return self._steps.send(result)
        except StopIteration as stop:
            return Done(stop.value)

    def throw(self, error: BaseException) -> Action | Done:
        try:
            return self._steps.throw(error)
        except StopIteration as stop:
            return Done(stop.value)


def is_unreachable(exc: BaseException) -> bool:
    """An httpx/httpx2 connect error or connect timeout: the attempt reached no server."""
    from zp_client.retry import is_unreachable as _is

    return _is(exc)


def unreachable(request: Any, exc: BaseException, attempts: int) -> ServerUnreachable:
    """The :class:`ServerUnreachable` for a request whose last attempt could not connect."""
    try:
        url = str(request.url.copy_with(query=None))
    except Exception:  # noqa: BLE001 - any URL type: its text is enough
        url = str(request.url)
    if type(exc).__name__ == "ConnectTimeout":
        reason = "timed out connecting"
    elif any(isinstance(e, ConnectionRefusedError) or getattr(e, "errno", None) == errno.ECONNREFUSED
             or "refused" in str(e).lower() for e in error_chain(exc)):
        reason = "connection refused"
    else:
        reason = f"could not connect ({exc})" if str(exc) else "could not connect"
    err = ServerUnreachable(url, reason, attempts)
    err.request = request  # type: ignore[attr-defined]  # what openai.APIConnectionError carries
    return err


# --------------------------------------------------------------------------------------------------
# Forecasting hook and shared defaults
# --------------------------------------------------------------------------------------------------


class RequestForecaster(Protocol):
    """What the core asks of an elastic budget's forecaster (a :class:`~zp_client.forecast.LengthForecaster`
    has all of it). Optionally, ``forecast_request(route, body, *, max_tokens, streaming) -> int | None``
    forecasts from the request itself (the parsed JSON body): an int is taken as known (capped at
    ``max_tokens``), None falls back to :meth:`forecast`. The benchmark's oracle uses it; see
    docs/elastic.md."""

    def forecast(self, key: str, *, generated: int = 0, max_tokens: int | None = None,
                 streaming: bool = True) -> int: ...

    def observe(self, key: str, completion_tokens: int) -> None: ...


def default_retry(budget: Budget, settings: Settings, clock: Clock | None = None) -> RetryPolicy:
    """The retry policy a front end gets when it is given none: :meth:`RetryPolicy.from_settings`
    (``Settings.retry_*``) drawing on the KV budget's own shared retry budget
    (:meth:`Budget.retry_budget`, fleet-wide for a RedisBudget), sleeping on ``clock`` (the core's)."""
    from zp_client.retry import RetryPolicy

    return RetryPolicy.from_settings(settings, budget=budget.retry_budget(settings), clock=clock)


_forecasters: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_forecasters_lock = threading.Lock()


def forecaster_for(budget: Budget) -> Any:
    """The :class:`~zp_client.forecast.LengthForecaster` every transport of ``budget`` shares by
    default (made on first use with the forecaster's defaults: ``DEFAULT_Q`` for streams,
    ``DEFAULT_Q_BLIND`` for requests whose growth is not seen), so wrapped clients of one budget learn
    together. A budget with a ``shared_forecaster()`` method (RedisBudget) supplies it: the fleet
    learns together."""
    from zp_client.forecast import LengthForecaster

    with _forecasters_lock:
        fc = _forecasters.get(budget)
        if fc is None:
            # A budget that shares forecasts across processes (RedisBudget) provides its own.
            shared = getattr(budget, "shared_forecaster", None)
            fc = _forecasters[budget] = shared() if shared is not None else LengthForecaster()
        return fc


def check_pool(budget: Budget, root: str, metrics: Any) -> bool:
    """Warn (``logging``, logger ``zp_client.transport``) when ``budget``'s limit is larger than the KV pool
    ``metrics`` (a :class:`~zp_client.server.ServerMetrics`) describes; True when it warned. The pool has
    ``num_gpu_blocks - 1`` usable blocks (vLLM's null block); with different block sizes the comparison is
    in tokens. A pool the metrics do not state is logged at debug level."""
    n = getattr(metrics, "num_gpu_blocks", None)
    if not isinstance(n, int) or n < 1:
        logger.debug("pool check: %s/metrics has no vllm:cache_config_info num_gpu_blocks", root)
        return False
    usable = n - 1
    server_bs = getattr(metrics, "block_size", None) or budget.block_size
    limit, bs = budget.limit, budget.block_size
    if limit * bs <= usable * server_bs:
        return False
    from zp_client.server import suggest_limit_blocks

    policy = "elastic" if getattr(budget, "policy_name", "strict") == "elastic" else "strict"
    suggested = suggest_limit_blocks(n, policy=policy) * server_bs // bs  # in the budget's blocks
    logger.warning(
        "budget limit_blocks=%d (blocks of %d tokens) is larger than the KV pool of the server at %s: %d "
        "usable blocks (num_gpu_blocks=%d minus vLLM's null block) of %d tokens, so it cannot keep the "
        "server from preempting; size it from the pool: limit_blocks=%d (suggest_limit_blocks(%d), or "
        "zp-client status --server URL). Settings.pool_check=False (ZP_POOL_CHECK=false) turns this "
        "check off.",
        limit, bs, root, usable, n, server_bs, suggested, n,
    )
    return True


# --------------------------------------------------------------------------------------------------
# The core
# --------------------------------------------------------------------------------------------------


class Core:
    """Shared by the transports of one configuration: the plan, the attempt loop, learning from usage."""

    def __init__(
        self,
        budget: Budget,
        settings: Settings | None,
        estimator: Any | None,
        retry: Any | None,
        forecaster: Any | None = None,
        stream_upstream: bool | None = None,
        *,
        lib: HttpLib,
        clock: Clock | None = None,
        metrics: Any | None = None,  # a zp_client.metrics.ZPMetrics (checked)
    ) -> None:
        if not isinstance(budget, Budget):
            raise ConfigurationError(
                f"budget must be a zp_client Budget (LocalBudget, RedisBudget), got {type(budget).__name__}"
            )
        self.budget = budget
        self.settings = settings or Settings()
        if estimator is None:
            from zp_client.estimate import Estimator

            estimator = Estimator(self.settings)
        self.estimator = estimator
        # Elastic metadata is worth its cost only when the budget's policy reads it.
        self.elastic = getattr(budget, "policy_name", "strict") == "elastic"
        if forecaster is None and self.elastic:
            forecaster = forecaster_for(budget)
        self.forecaster = forecaster
        # Upper forecasts only for a policy that reads them (a spread-sized reserve): otherwise unsent.
        self.spread = self.elastic and bool(getattr(budget, "reads_forecast_spread", False))
        self.lib = lib
        # the budget's clock unless told otherwise: one ``LocalBudget(clock=...)`` moves the whole client
        self.clock: Clock = clock if clock is not None else getattr(budget, "clock", SYSTEM_CLOCK)
        self.retry = default_retry(budget, self.settings, self.clock) if retry is None else (retry or None)
        self.stream_upstream = (
            self.settings.stream_upstream if stream_upstream is None else bool(stream_upstream)
        )
        # A fleet (zp_client.fleet.Fleet) routes: each lease says which replica the attempt goes to.
        self.fleet: Any = budget if getattr(budget, "is_fleet", False) else None
        self._servers: dict[str, Any] = {}
        self._mml: dict[tuple[str, str | None], int | None] = {}
        self._pool_roots: set[str] = set()  # Core._claim_pool_check's fallback registry
        self._pool_roots_seen: set[str] = set()  # roots this core has asked about (no lock after the first)
        # Opt-in Prometheus metrics (zp_client.metrics); None records nothing and reads no extra time.
        self.metrics: ZPMetrics | None = None
        if metrics is not None:
            from zp_client.metrics import as_metrics  # imported only when asked for

            self.metrics = as_metrics(metrics)
            self.metrics.track(budget)
        # wrap() sets this so zp refusals pass through the openai SDK as a catchable type.
        self.convert_error: Callable[[ZPError], BaseException] | None = None

    # -- parsing ------------------------------------------------------------------------------------
    def parse(self, request: Any) -> Parsed | None:
        """Read the request's JSON and per-call options; None when it cannot be admitted (not JSON)."""
        try:
            body = json.loads(request.content)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict):
            return None
        opts = read_headers(request.headers.raw)  # a bad zp header: InvalidRequest, before anything is held
        headers, auth, route, priority = opts.headers, opts.auth, opts.route, opts.priority
        deadline_s = opts.deadline_s if opts.deadline_s is not None else self.settings.deadline_s
        if priority is None:
            bp = body.get("priority")
            priority = bp if isinstance(bp, int) and not isinstance(bp, bool) else 0
        arrival = self.clock.monotonic()

        path = request.url.path.rstrip("/")
        changed = False
        responses = path.endswith("/responses")
        keys = ("max_output_tokens",) if responses else ("max_completion_tokens", "max_tokens")
        max_tokens = read_body(body, responses)  # a field zp reads that is malformed: InvalidRequest
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
            body[keys[-1]] = max_tokens
            changed = True
            global _logged_default_max_tokens
            if not _logged_default_max_tokens:
                _logged_default_max_tokens = True
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
            and self.stream_upstream
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
        if self.fleet is not None:  # metadata comes from a replica, not the fleet's own name
            base, root = self.fleet.metadata_base(base, root)
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
            fail_fast=(self.settings.fail_fast if opts.fail_fast is None else opts.fail_fast)
            and deadline_s is not None,
        )

    def _targets(self, opts: Options, route: str, priority: int) -> tuple[float | None, float | None]:
        """The request's (TTFT, TPOT) targets in seconds: its header, else its route's setting, else its
        class's, else the global one (docs/admission.md#targets); None where none is set."""
        s = self.settings
        ttft = opts.ttft_target_s
        if ttft is None:
            ttft = s.ttft_route_targets.get(route, s.ttft_targets.get(priority, s.ttft_target_s))
        tpot = opts.tpot_target_s
        if tpot is None:
            tpot = s.tpot_route_targets.get(route, s.tpot_targets.get(priority, s.tpot_target_s))
        return ttft, tpot

    def shared_prefix(self, est: Any, low: int | None = None) -> tuple[str | None, int]:
        """``(prefix_key, full blocks)`` of a prompt estimate's shared preamble (leading system messages
        and tool schemas), or ``(None, 0)``. vLLM shares only full blocks; the prefix is counted from the
        estimate's lower bound ``low`` (default: the estimator's) so an over-estimate never claims
        sharing that does not happen. What every request's lease meta and a pinned prefix
        (:mod:`zp_client.pinning`) carry."""
        key = getattr(est, "prefix_key", None)
        ptok = int(getattr(est, "prefix_tokens", 0) or 0)
        if key is None or ptok <= 0:
            return None, 0
        lower = getattr(self.estimator, "lower_bound_tokens", None)
        if low is None:
            low = int(lower(est)) if lower is not None else int(est.tokens)
        if est.tokens > 0 and lower is not None:
            ptok = min(ptok, ptok * low // int(est.tokens))
        pblocks = ptok // self.budget.block_size
        return (key, pblocks) if pblocks > 0 else (None, 0)

    def finish_plan(self, request: Any, p: Parsed, est: Any, mml: int | None) -> Plan:
        from zp_client.estimate import kv_blocks

        lower = getattr(self.estimator, "lower_bound_tokens", None)
        # Refuse only what surely does not fit: an over-estimate must never refuse a prompt that fits.
        low = int(lower(est)) if lower is not None else int(est.tokens)
        if mml is not None and low > mml:
            raise PromptTooLong(low, mml)
        prompt = int(self.estimator.reserve_tokens(est))
        n = int(getattr(est, "n", 1) or 1)
        bs = self.budget.block_size
        blocks = kv_blocks(prompt, p.max_tokens, block_size=bs, max_model_len=mml, n=n)
        held = min(blocks, kv_blocks(prompt, 0, block_size=bs, max_model_len=mml, n=n))
        route = p.route or p.model or "default"
        meta: dict[str, Any] | None = None
        forecast = 0
        known = False
        continuous = strip_continuous = False
        if self.elastic:
            # n > 1 grows n tokens per step, which the one-token-per-step projection cannot express:
            # project it as non-streamed (its forecast end held from now), which is conservative.
            streaming = p.stream and n == 1
            forecast, known = self._forecast(p, route, streaming)
            meta = {"prompt_tokens": prompt * n, "forecast_tokens": forecast * n, "streaming": streaming}
            if streaming and self.spread:
                # The upper forecast: what a spread-sized reserve reads (a known forecast has none).
                hi = forecast if known else forecast_hi(self.forecaster, route, 0, p.max_tokens)
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
        if self.fleet is not None:
            meta = {**(meta or {}), **self.fleet.routing_meta(p.body, prompt, p.session)}
        targeted = p.ttft_target_s is not None or p.tpot_target_s is not None
        if targeted:  # what the budget's line orders by; age_s is added at each acquire (_lease_meta)
            meta = dict(meta or {})
            if p.ttft_target_s is not None:
                meta[TTFT_TARGET_META] = p.ttft_target_s
            if p.tpot_target_s is not None:
                meta[TPOT_TARGET_META] = p.tpot_target_s
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
            spread=self.spread,
            chat=request.url.path.rstrip("/").endswith("/chat/completions"),
            upstream=p.upstream,
            continuous=continuous,
            strip_continuous=strip_continuous,
            arrival=p.arrival,
            targeted=targeted,
            fail_fast=p.fail_fast,
        )

    def _lease_meta(self, plan: Plan, meta: dict[str, Any] | None) -> dict[str, Any] | None:
        """``meta`` as this acquire sends it: with a target, plus the request's ``age_s`` now (seconds
        since its first arrival, so a retry keeps its original arrival) and the targets themselves."""
        if plan.fail_fast:  # the budget refuses at enqueue when it predicts the wait past the deadline
            meta = {**(meta or {}), FAIL_FAST_META: True}
        if not plan.targeted:
            return meta
        out = dict(meta or {})
        for key in (TTFT_TARGET_META, TPOT_TARGET_META):
            if plan.meta is not None and key in plan.meta:
                out[key] = plan.meta[key]
        out[AGE_META] = max(0.0, self.clock.monotonic() - plan.arrival)
        return out

    def _continuous_usage(self, p: Parsed) -> bool:
        """Whether to ask for vLLM's ``continuous_usage_stats`` (``Settings.continuous_usage``; under
        "auto" only for a server whose ``GET models`` said vLLM: others may refuse the unknown field)."""
        mode = self.settings.continuous_usage
        if mode == "auto":
            server = self._servers.get(p.base)
            return bool(getattr(server, "is_vllm", False))
        return mode == "always"

    def _forecast(self, p: Parsed, route: str, streaming: bool = True) -> tuple[int, bool]:
        """(forecast output tokens per choice, known from the request?). The forecaster's
        ``forecast_request`` hook answers first (see :class:`RequestForecaster`); otherwise a request
        whose growth is not seen (``streaming`` False) is forecast at the forecaster's ``q_blind``:
        nothing corrects it later."""
        fc = self.forecaster
        assert fc is not None  # an elastic core always has one (__init__)
        hook = getattr(fc, "forecast_request", None)
        if hook is not None:
            known = hook(route, p.body, max_tokens=p.max_tokens, streaming=streaming)
            if known is not None:
                return min(int(known), p.max_tokens), True
        if streaming or getattr(fc, "q_blind", None) is None:
            # a forecaster without the blind quantile: its single q
            return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens)), False
        return int(fc.forecast(route, generated=0, max_tokens=p.max_tokens, streaming=False)), False

    # -- server metadata ----------------------------------------------------------------------------
    def server_for(self, p: Parsed, inner: Any) -> Any:
        """A ServerInfo for this request's server, fetching through the inner transport (no admission)."""
        server = self._servers.get(p.base)
        if server is None:
            server = self._servers[p.base] = self.lib.server_info(inner, p.base, p.root, p.auth_headers,
                                                                  self.settings)
        return server

    def _mml_failed(self, p: Parsed, exc: BaseException) -> None:
        if p.base not in _logged_no_max_model_len:
            _logged_no_max_model_len.add(p.base)
            logger.warning(
                "could not read max_model_len from %s/models (%s); bounds are not capped by the context "
                "length and long prompts are not refused locally. Set Settings.max_model_len to fix.",
                p.base,
                type(exc).__name__,
            )

    def _max_model_len(self, p: Parsed, inner: Any) -> Steps:
        if self.settings.max_model_len is not None:
            return self.settings.max_model_len
        key = (p.base, p.model)
        if key in self._mml:
            return self._mml[key]
        try:
            value = yield ModelLen(self.server_for(p, inner), p.model)
        except Exception as exc:  # noqa: BLE001 - metadata only tightens the bound: logged, never fatal
            self._mml_failed(p, exc)
            value = None
        if value is not None:  # unknown stays uncached: ServerInfo retries (no sooner than 30 s apart)
            self._mml[key] = value
        return value

    def _claim_pool_check(self, p: Parsed) -> bool:
        """True for the one request that reads this server's pool for this budget (``Settings.pool_check``);
        claimed before the read, so concurrent first requests do not wait on it nor read it again."""
        if not self.settings.pool_check or p.root in self._pool_roots_seen or self.fleet is not None:
            return False  # the fast path: this core already knows the root was claimed
        self._pool_roots_seen.add(p.root)
        with _pool_checked_lock:
            try:
                roots = _pool_checked.setdefault(self.budget, set())
            except TypeError:  # a budget that cannot be a weak key (unhashable): once per core instead
                roots = self._pool_roots
            if p.root in roots:
                return False
            roots.add(p.root)
            return True

    def _pool_probe(self, p: Parsed, inner: Any) -> Steps:
        """Read the server's KV pool once per budget and server and warn when the limit exceeds it. A
        server that cannot answer (no /metrics, not vLLM, no answer within the short read: every such case
        is a ServerInfoError) is logged at debug level and otherwise ignored: the check never fails a
        request and is not retried."""
        try:
            metrics = yield PoolSize(self.server_for(p, inner))
        except ZPError as exc:
            logger.debug("pool check: could not read %s/metrics (%s: %s)", p.root, type(exc).__name__, exc)
            return
        check_pool(self.budget, p.root, metrics)

    # -- errors and deadlines -----------------------------------------------------------------------
    def surface(self, exc: BaseException) -> BaseException:
        """The error the caller sees for a zp error (wrap() makes it openai-compatible)."""
        if isinstance(exc, ZPError) and self.convert_error is not None:
            return self.convert_error(exc)
        return exc

    def remaining(self, plan: Plan) -> float | None:
        return None if plan.deadline is None else plan.deadline - self.clock.monotonic()

    def check_deadline(self, plan: Plan, attempt: int) -> float | None:
        rem = self.remaining(plan)
        if rem is not None and rem <= 0:
            raise DeadlineExceeded(
                f"the request's deadline passed before attempt {attempt + 1} could be admitted; "
                "raise X-ZP-Deadline / Settings.deadline_s or lower the load"
            )
        return rem

    # -- the attempt loop ---------------------------------------------------------------------------
    def admit(self, request: Any, inner: Any, *, is_async: bool) -> Machine:
        """The state machine of one admitted request (already read), for a driver to run."""
        steps = self._admit(request, inner, is_async)
        if self.metrics is not None:
            steps = self._metered(steps)  # inside one_loop: a replayed refusal is a repeat, not a new refusal
        if self.retry is not None and self.settings.repeat_window_s > 0:
            steps = one_loop(self, request, steps, ReadAll)  # zp's loop is the only one (zp_client._repeat)
        return Machine(steps)

    def _metered(self, steps: Steps) -> Steps:
        """``steps`` counting the zp error that ends the request, if one does (refusals by type)."""
        try:
            return (yield from steps)
        except ZPError as exc:
            assert self.metrics is not None
            self.metrics.refused(exc)
            raise

    def _admit(self, request: Any, inner: Any, is_async: bool) -> Steps:
        p = self.parse(request)
        if p is None:  # not JSON: not admitted, sent as it is
            return (yield Send(request))
        if self.settings.estimator == "server":
            est = yield Estimate(request.url.path, p.body, self.server_for(p, inner))
        else:
            est = self.estimator.estimate(request.url.path, p.body)
        mml = yield from self._max_model_len(p, inner)
        if self._claim_pool_check(p):
            yield from self._pool_probe(p, inner)
        plan = self.finish_plan(request, p, est, mml)
        pd = getattr(self.fleet, "pd", None) if self.fleet is not None else None
        if pd is None or not p.chat_or_completions or "kv_transfer_params" in p.body or plan.n > 1:
            return (yield from self._attempts(request, plan, is_async, None))
        st = _PDCall(pd, plan, p.body)  # a disaggregated fleet: the two-phase lease (zp_client.fleet.pd)
        try:
            resp = yield from self._attempts(request, plan, is_async, st)
        except BaseException:
            yield from self._pd_drop(st)
            raise
        yield from self._pd_drop(st)
        return resp

    def _attempts(self, request: Any, plan: Plan, is_async: bool, st: _PDCall | None) -> Steps:
        """The attempt loop: lease, send, retry; ``st``: a disaggregated request's prefill side."""
        retry = self.retry
        state = (yield NewRetryState(retry)) if retry is not None else None
        ticket: Ticket | None = None
        attempt = 0
        moves = 0
        fleet = self.fleet
        m = self.metrics
        while True:
            timeout = self.check_deadline(plan, attempt)
            observers = active_observers()  # () unless the caller is inside observe_admissions()
            asked = self.clock.monotonic() if m is not None or observers else 0.0
            reuse = None if st is None else st.reusable_for(self.clock.monotonic())
            if st is not None and reuse is None:
                yield from self._pd_drop(st)  # its KV is too old to hand to another decode replica
                if st.pd.disaggregates(plan.prompt_tokens, self.fleet.best_matched_tokens(plan.meta)):
                    yield from self._pd_leg(st, plan, is_async)  # the prefill leg first (fleet/pd.py)
                    timeout = self.check_deadline(plan, attempt)  # what is left after that wait
            if reuse is not None and (timeout is None or reuse < timeout):
                # a prefill leg kept for a decode retry waits for decode room only while its KV is alive
                try:
                    lease = yield Acquire(plan.blocks, plan.priority, reuse, ticket, plan.held,
                                          self._lease_meta(plan, plan.meta))
                except AdmissionTimeout:
                    yield from self._pd_drop(st)  # type: ignore[arg-type]
                    continue
            else:
                lease = yield Acquire(plan.blocks, plan.priority, timeout, ticket, plan.held,
                                      self._lease_meta(plan, plan.meta))
            holder = Holder(lease, self.settings.idle_stream_timeout_s, is_async=is_async, clock=self.clock,
                            metrics=m)
            try:
                if m is not None:
                    m.waited(plan.priority, holder.granted_at - asked)
                    predicted = getattr(lease, "predicted_wait_s", None)
                    if predicted is not None:
                        m.predicted(plan.priority, predicted, holder.granted_at - asked)
                if observers:
                    self._notify(observers, plan, lease, holder.granted_at - asked, attempt)
            except BaseException:  # an observer's KeyboardInterrupt / SystemExit: the lease goes back
                yield Release(holder)
                raise
            ticket = lease.ticket
            if state is not None:
                state.ticket = ticket
            assembled = False
            prefetched = None
            try:
                url = request.url if fleet is None else fleet.route_url(lease, request.url)
                out = plan
                if st is not None:  # a disaggregated fleet: the prefill phase first
                    out = yield from self._pd_prefill(st, plan, request, lease, holder.granted_at)
                resp = yield Send(self.lib.request(request, out, url), plan.deadline)
                if st is not None:
                    self._pd_answered(st, resp)
                if plan.upstream and self.lib.is_event_stream(resp):
                    resp = yield from self._consume(plan, request, resp, holder,
                                                    None if st is None else st.holder)
                    assembled = True
                elif fleet is not None and plan.stream and self.lib.is_event_stream(resp):
                    # on a fleet the stream reaches its caller with its first bytes: a replica that
                    # fails before them moves the request like a refused connection
                    prefetched = yield from self._peek(resp, plan.deadline)
                    if st is not None:  # the decode replica has read the KV: the prefill leg ends
                        st.reached = True
                        yield from self._pd_drop(st)
            except Exception as exc:
                yield Release(holder)
                if st is not None and type(exc).__name__ in ("ConnectError", "ConnectTimeout"):
                    st.shipped = False  # no decode replica has the request: its KV may go to another
                if fleet is not None and self._move(fleet, lease, exc, moves):
                    moves += 1  # sent elsewhere, keeping its place: no retry spent, no attempt counted
                    plan.meta = fleet.avoiding(plan.meta, lease)
                    continue
                if getattr(exc, "_zp_answered", False):  # the server answered: only its caller may retry
                    raise
                if state is None:
                    if is_unreachable(exc):
                        raise unreachable(request, exc, attempt + 1) from None
                    raise
                d = yield Decide(retry, state, None, None, exc, self.remaining(plan))
                if not d.retry:
                    if d.error is not None and d.error is not exc:
                        raise d.error from exc
                    if is_unreachable(exc):  # no server answered: say so, not "overloaded"
                        raise unreachable(request, exc, attempt + 1) from None
                    raise
                logger.info("attempt %d failed (%s): retrying in %.3f s", attempt + 1, d.reason, d.delay_s)
                if fleet is not None:
                    plan.meta = fleet.avoiding(plan.meta, lease)
                yield Sleep(retry, d.delay_s)
                if d.budget_owed:
                    yield WaitBudget(retry, state, self.remaining(plan))
                if m is not None:  # granted now
                    m.retried(None, exc)
                attempt += 1
                continue
            except BaseException:
                yield Release(holder)
                raise
            try:
                if resp.status_code in OVERLOAD_STATUSES:
                    self.budget.note_overload(resp.status_code)  # an adaptive limit's signal
                elif fleet is not None:  # the replica's health: 5xx answers count against it
                    if resp.status_code >= 500:
                        fleet.note_failure(lease)
                    else:
                        fleet.note_success(lease)
                if state is not None:  # successes too: an answer is the retry budget's deposit
                    d = yield Decide(retry, state, resp.status_code, resp.headers, None, self.remaining(plan))
                    if d.retry or d.error is not None:
                        yield Close(resp, shield=False)
                        yield Release(holder)
                        if not d.retry:
                            raise d.error
                        logger.info(
                            "attempt %d got HTTP %d (%s): retrying in %.3f s",
                            attempt + 1, resp.status_code, d.reason, d.delay_s,
                        )
                        if fleet is not None:
                            plan.meta = fleet.avoiding(plan.meta, lease)
                        yield Sleep(retry, d.delay_s)
                        if d.budget_owed:
                            yield WaitBudget(retry, state, self.remaining(plan))
                        if m is not None:  # granted now
                            m.retried(resp.status_code, None)
                        attempt += 1
                        continue
                if assembled:  # consumed, observed and released already
                    return resp
                return (yield from self._deliver(plan, resp, holder, is_async, prefetched))
            except BaseException:
                yield Close(resp, shield=True)
                yield Release(holder)
                raise

    # -- the two-phase lease of a disaggregated fleet (zp_client.fleet.pd) ----------------------------
    def _pd_leg(self, st: _PDCall, plan: Plan, is_async: bool) -> Steps:
        """Take the prefill leg: the prompt's blocks (and one) on the prefill fleet, placed by prefix."""
        pre = st.pd.prefill
        blocks = max(1, -(-(plan.prompt_tokens + 1) // self.budget.block_size))
        try:
            plea = yield Acquire(blocks, plan.priority, self.remaining(plan), None, blocks,
                                 self._lease_meta(plan, pre.routing_only(plan.meta)), budget=pre)
        except LeaseTooLarge:  # larger than any prefill replica takes: its decode replica prefills it
            return
        st.holder = Holder(plea, self.settings.idle_stream_timeout_s, is_async=is_async, clock=self.clock)
        st.kv, st.until, st.reached, st.shipped = None, None, False, False

    def _pd_prefill(self, st: _PDCall, plan: Plan, request: Any, lease: Lease, granted_at: float) -> Steps:
        """The prefill phase of one attempt, both legs held (``lease`` the decode leg): returns the plan
        the decode call sends. Reuses a live prefill's ``kv_transfer_params``; sends a request whose
        uncached prompt on its decode replica is short (or that took no prefill leg) straight there;
        otherwise makes the prefill call and passes its ``kv_transfer_params`` on (none: the decode
        replica prefills locally)."""
        pd = st.pd
        counts = pd.counts
        if st.kv is not None and st.holder is not None and not st.holder.done:
            counts["reused"] += 1
            st.reached, st.shipped = False, True
            return st.decode_plan(plan)
        if st.holder is None or not pd.disaggregates(plan.prompt_tokens, self.fleet.matched_tokens(lease)):
            yield from self._pd_drop(st)  # a leg taken on the best match elsewhere: not needed here
            counts["direct"] += 1
            return plan
        pre = pd.prefill
        plea = st.holder.lease
        counts["prefills"] += 1
        try:
            resp = yield Send(self.lib.request(request, st.prefill_plan(plan),
                                               pre.route_url(plea, request.url)))
        except Exception as exc:  # noqa: BLE001 - no answer: the decode replica prefills locally
            yield from self._pd_drop(st)
            self._pd_failed(pre, plea, exc)
            counts["prefill_failed"] += 1
            return plan
        # an answer: a finished prefill's blocks stay there until read, aborted or vLLM's lease expires
        st.until = self.clock.monotonic() + pd.kv_lease_s
        chunks: list[bytes] = []
        try:
            yield ReadAll(resp, chunks.append)
        except Exception as exc:  # noqa: BLE001 - a cut answer: the decode replica prefills locally
            yield Close(resp, shield=True)
            yield from self._pd_drop(st)  # kept until the lease expires: nobody will read it
            self._pd_failed(pre, plea, exc)
            counts["prefill_failed"] += 1
            return plan
        except BaseException:
            yield Close(resp, shield=True)
            raise
        if resp.status_code >= 500:
            pre.note_failure(plea)
        elif resp.status_code < 400:
            pre.note_success(plea)
        kv = st.parse(b"".join(chunks)) if resp.status_code == 200 else None
        if kv is None:  # nothing held for us there (an error, a server without P/D): prefill locally
            st.until = None
            yield from self._pd_drop(st)
            counts["local"] += 1
            return plan
        st.kv, st.at = kv, self.clock.monotonic()
        st.until = st.at + pd.kv_lease_s
        # the decode leg's wait for its KV: held on the decode pool, not yet used by the server
        idle_ms = round(1000 * (st.at - granted_at))
        counts["decode_leg_idle_ms"] += idle_ms
        st.shipped = True
        return st.decode_plan(plan)

    @staticmethod
    def _pd_failed(pre: Any, lease: Lease, exc: BaseException) -> None:
        """A prefill call that failed counts against its replica's health (a connection error at once)."""
        from zp_client.retry import classify_error

        if classify_error(exc) is not None:
            pre.note_failure(lease, connect=type(exc).__name__ in ("ConnectError", "ConnectTimeout"))

    def _pd_answered(self, st: _PDCall, resp: Any) -> None:
        """A decode replica answered the call carrying ``st.kv``. A complete (non-streamed) success means
        it read the KV; a stream's first bytes do (see the attempt loop). An error answer may come from
        before its scheduler (a proxy, a full queue) or after (it then told the prefill replica to free):
        zp cannot tell, so those parameters are never sent again (vLLM's read is one-sided: blocks freed
        and reused would be read as if they were the prompt's) and the prefill leg stays until vLLM's
        lease on them has expired; the next attempt prefills again."""
        if resp.status_code < 400 and not self.lib.is_event_stream(resp):
            st.reached = True

    def _pd_drop(self, st: _PDCall) -> Steps:
        """End the prefill leg, once: at once when nothing waits on the prefill replica for us (never
        answered, no KV, or a decode replica has the request), else when vLLM's lease on the KV ends."""
        h, st.holder = st.holder, None
        kv_alive = st.until is not None and not st.reached
        until, st.kv, st.until = st.until, None, None
        if h is None or h.done:
            return
        now = self.clock.monotonic()
        if kv_alive and until is not None and until > now:
            st.pd.counts["held_to_expiry"] += 1
            yield Release(h, after_s=until - now)
        else:
            yield Release(h)

    def _move(self, fleet: Any, lease: Lease, exc: BaseException, moves: int) -> bool:
        """Whether a failed attempt on a fleet replica moves to another one: the request never reached
        the caller and the connection failed (no connection, reset, cut: not a timeout, where the server
        may still be working). Tells the fleet either way; bounded by ``fleet.max_moves`` per replica."""
        from zp_client.retry import classify_error

        kind = classify_error(exc)
        name = type(exc).__name__
        if kind is None or name in ("ReadTimeout", "WriteTimeout", "PoolTimeout"):
            return False
        connect = name in ("ConnectError", "ConnectTimeout")
        fleet.note_failure(lease, connect=connect)
        if getattr(exc, "_zp_incomplete", False):  # the server ended it: moving would redo the work
            return False
        if moves >= fleet.max_moves * max(1, len(fleet.replicas)):
            return False
        fleet.note_move()
        logger.info("attempt on %s failed (%s): moving the request to another replica",
                    getattr(lease, "replica", "?"), name)
        return True

    def stream_cut(self, lease: Lease, exc: BaseException) -> BaseException | None:
        """The error a caller reading a fleet replica's stream gets when the connection failed under it
        (a :class:`~zp_client.errors.StreamCut`; through ``wrap()`` also an ``openai.OpenAIError``), after
        telling the fleet; None outside a fleet or for other errors (a timeout, a decoding error: those
        surface as they are)."""
        fleet = self.fleet
        if fleet is None:
            return None
        from zp_client.retry import classify_error

        if classify_error(exc) is None or type(exc).__name__ in ("ReadTimeout", "PoolTimeout"):
            return None
        from zp_client.errors import StreamCut

        replica = getattr(lease, "replica", None)
        fleet.note_failure(lease)
        cut = StreamCut(f"the stream from replica {replica} was cut after it started ({type(exc).__name__}: "
                        f"{exc}); the answer is incomplete")
        cut.replica = replica
        return self.surface(cut)  # through wrap(): also an openai.OpenAIError, which openai passes on

    def passthrough(self, request: Any) -> Any:
        """A request the core does not admit, aimed at a fleet's own name: sent to one of its replicas."""
        fleet = self.fleet
        if fleet is None:
            return request
        url = fleet.passthrough_url(request.url)
        if url == request.url:
            return request
        headers = [(b"Host", url.netloc), *((k, v) for k, v in request.headers.raw if k.lower() != b"host")]
        return self.lib.module.Request(request.method, url, headers=headers, stream=request.stream,
                                       extensions=request.extensions)

    def _notify(self, observers: tuple[Any, ...], plan: Plan, lease: Lease, waited: float,
                attempt: int) -> None:
        """One :class:`~zp_client.observe.AdmissionInfo` for this grant, to the caller's observers."""
        info = AdmissionInfo(
            queue_wait_s=max(0.0, waited),
            leased_blocks=int(getattr(lease, "bound", plan.blocks)),
            held_blocks=plan.held,
            priority=plan.priority,
            attempt=attempt + 1,
            budget=getattr(self.budget, "name", None),
            policy=self.budget.policy_name,
            route=plan.route,
            lease_id=str(getattr(lease, "id", "")),
            replica=getattr(lease, "replica", None),
            predicted_wait_s=getattr(lease, "predicted_wait_s", None),
        )
        notify_observers(observers, info)

    def _peek(self, resp: Any, deadline: float | None = None) -> Steps:
        """The body's first chunk and the rest (:class:`Peek`); on failure the response is closed first
        (the server sees the disconnect) and the error goes on to the attempt loop."""
        try:
            return (yield Peek(resp, deadline))
        except BaseException:
            yield Close(resp, shield=True)
            raise

    def _deliver(self, plan: Plan, resp: Any, holder: Holder, is_async: bool,
                 prefetched: tuple[bytes | None, Any] | None = None) -> Steps:
        """The response handed to the caller: its body streams through a scanner that owns the lease
        (``prefetched``: its first chunk and the rest, when :class:`Peek` read it already)."""
        scanner = self.scanner_for(plan, resp, holder.lease)
        if self.lib.is_preread(resp):
            yield Release(holder)
            content = scanner.feed(resp.content) + scanner.flush()
            self.observe(plan, scanner)
            return self.lib.preread_response(resp, content, scanner.rewrites)
        holder.resp = resp
        watchdog.add(holder)
        return self.lib.streamed_response(resp, self, plan, holder, scanner, is_async=is_async,
                                          prefetched=prefetched)

    def _consume(self, plan: Plan, original: Any, resp: Any, holder: Holder,
                 first: Holder | None = None) -> Steps:
        """Read the upstream stream of a non-streamed call to its end, reporting its growth; the lease is
        released once it is consumed. Any other exit (error, cancellation) closes the connection first,
        so the server aborts the request before the blocks return."""
        lease = holder.lease
        scanner = Scanner(plan, self.budget.block_size, lease.bound, lease, True, self.forecaster)
        asm = Reassembler(plan.chat)
        answered = False  # a body byte arrived: the server works on this request (no retry from here)

        def sink(chunk: bytes) -> None:
            nonlocal answered
            answered = answered or bool(chunk)
            scanner.advance(asm.feed(chunk), asm.usage)

        try:
            try:
                yield ReadAll(resp, sink, first, plan.deadline)
                scanner.advance(asm.end(), asm.usage)
            except BadEvent as exc:
                raise self.lib.module.DecodingError(str(exc), request=original) from None
            except Exception as exc:
                if answered:
                    raise self._cut_answer(original, exc) from exc
                raise
        except BaseException:
            yield Close(resp, shield=True)
            raise
        yield Release(holder)
        if asm.error is not None:
            status, payload = asm.error_body()
        elif not asm.done:
            incomplete = self.lib.module.RemoteProtocolError(
                "the server ended the event stream without 'data: [DONE]': the answer is incomplete",
                request=original,
            )
            incomplete._zp_incomplete = True  # not a failed connection: a fleet does not move it
            incomplete._zp_answered = answered  # the server generated it: not retried either
            raise incomplete
        else:
            self.observe(plan, scanner)
            status, payload = 200, asm.body()
        return self.lib.reassembled_response(resp, status, payload)

    def _cut_answer(self, original: Any, exc: Exception) -> Exception:
        """A transport error while reading a non-streamed call's upstream stream after its first byte: the
        server was generating the answer, so the attempt is not retried (a retry would run the whole
        generation again, docs/retries.md) and a fleet does not move it. A timeout stays the library's
        timeout (openai: ``APITimeoutError``); a cut becomes its ``RemoteProtocolError`` (openai:
        ``APIConnectionError``) saying so, the original as ``__cause__``."""
        from zp_client.retry import classify_error

        if classify_error(exc) is None:
            return exc  # not a transport error: it surfaces as it is (the policy retries only those)
        if "Timeout" in type(exc).__name__:
            out: Exception = exc
        else:
            out = self.lib.module.RemoteProtocolError(
                f"the server's answer was cut after it started ({type(exc).__name__}: {exc}); the answer "
                "is incomplete and is not retried (the server had started generating it)",
                request=original,
            )
        out._zp_incomplete = True  # type: ignore[attr-defined]
        out._zp_answered = True  # type: ignore[attr-defined]
        return out

    # -- watching the body and learning from it -----------------------------------------------------
    def scanner_for(self, plan: Plan, resp: Any, lease: Lease) -> Scanner:
        ctype = resp.headers.get("content-type", "")
        is_sse = plan.stream and ctype.startswith("text/event-stream")
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # A compressed body cannot be scanned without decoding it (vLLM never compresses SSE; a
            # proxy might). Growth is then not reported and an added usage chunk is not removed.
            global _logged_compressed
            if is_sse and not _logged_compressed:
                _logged_compressed = True
                logger.warning(
                    "server compressed an event stream (%s): zp cannot report its growth or remove the "
                    "usage chunk it asked for; turn compression off for text/event-stream",
                    encoding,
                )
            scanner = Scanner(plan, self.budget.block_size, lease.bound, lease, False)
            scanner.body = None  # nor parse usage out of compressed bytes
            return scanner
        return Scanner(plan, self.budget.block_size, lease.bound, lease, is_sse, self.forecaster)

    def observe(self, plan: Plan, scanner: Scanner) -> None:
        """Learn from the response's usage, once (calibration and the length forecaster)."""
        if scanner.observed:
            return
        scanner.observed = True
        try:
            usage = scanner.final_usage()
            if usage:
                # chat/completions say prompt_tokens; /responses says input_tokens
                prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
                if isinstance(prompt, int):
                    self.estimator.observe(plan.estimate, prompt)
                if self.forecaster is not None:
                    out = usage.get("completion_tokens", usage.get("output_tokens"))
                    if isinstance(out, int) and not isinstance(out, bool) and out >= 0:
                        # Per choice: what one sequence of this route produces.
                        per_choice = round(out / max(1, plan.n))
                        self.forecaster.observe(plan.route, per_choice)
                        if self.metrics is not None and self.elastic:
                            self.metrics.forecast_missed(per_choice, plan.forecast)
        except Exception:  # calibration must never break a response
            logger.debug("usage reconciliation failed", exc_info=True)

    def observe_seen(self, plan: Plan, scanner: Scanner) -> None:
        """A stream closed before its body ended: learn only if its usage chunk already went by (SDKs
        stop reading at ``[DONE]`` and close; the usage chunk comes before it, so the answer was
        complete)."""
        if scanner.sse and scanner.usage is not None:
            self.observe(plan, scanner)


class _PDCall:
    """One disaggregated request's prefill side across its attempts (see :meth:`Core._pd_prefill`)."""

    __slots__ = ("pd", "body", "holder", "kv", "at", "until", "reached", "shipped", "_rid", "_n", "_headers")

    def __init__(self, pd: Any, plan: Plan, body: Mapping[str, Any]) -> None:
        self.pd = pd
        self.body: dict[str, Any] = json.loads(plan.content) if plan.content else dict(body)
        self.holder: Holder | None = None
        """The prefill leg, while held."""
        self.kv: dict[str, Any] | None = None
        """The prefill's ``kv_transfer_params``, while its KV may still be read."""
        self.at = 0.0
        self.until: float | None = None
        """When vLLM's lease on the prefill's KV expires (None: the prefill replica holds nothing)."""
        self.reached = False
        """A decode replica has read ``kv`` (its first bytes came)."""
        self.shipped = False
        """``kv`` went out in a decode call that may have reached a replica's scheduler: never again."""
        rid = next((v for k, v in plan.headers if k.lower() == b"x-request-id"), None)
        self._rid = rid.decode("latin-1") if rid else f"zp-pd-{uuid.uuid4().hex}"
        self._n = 0
        self._headers: list[tuple[bytes, bytes]] = []

    def reusable_for(self, now: float) -> float | None:
        """Seconds the KV may still go to another decode replica (None: nothing to reuse)."""
        if self.kv is None or self.shipped or self.holder is None or self.holder.done:
            return None
        left = self.at + self.pd.reuse_s - now
        return left if left > 0 else None

    def _with_rid(self, plan: Plan, rid: str) -> list[tuple[bytes, bytes]]:
        return [*((k, v) for k, v in plan.headers if k.lower() != b"x-request-id"),
                (b"X-Request-Id", rid.encode("latin-1"))]

    def prefill_plan(self, plan: Plan) -> Plan:
        from zp_client.fleet.pd import prefill_body

        self._n += 1  # one id per prefill, shared with its decode calls
        rid = self._rid if self._n == 1 else f"{self._rid}-{self._n}"
        self._headers = self._with_rid(plan, rid)
        content = json.dumps(prefill_body(self.body), separators=(",", ":"), ensure_ascii=False).encode()
        return replace(plan, content=content, headers=self._headers)

    def decode_plan(self, plan: Plan) -> Plan:
        from zp_client.fleet.pd import decode_body

        content = json.dumps(decode_body(self.body, self.kv), separators=(",", ":"),
                             ensure_ascii=False).encode()
        return replace(plan, content=content, headers=self._headers or plan.headers)

    @staticmethod
    def parse(answer: bytes) -> dict[str, Any] | None:
        from zp_client.fleet.pd import kv_params_of

        return kv_params_of(answer)
