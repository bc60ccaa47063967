"""Configuration has one home: :class:`Settings`, also read from ``ZP_*`` environment variables.

Example::

    settings = Settings(default_max_tokens=1024)       # explicit values win
    # or: ZP_DEFAULT_MAX_TOKENS=1024 in the environment
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]

# A target in seconds: positive and finite (nan, inf, 0 and negatives are refused at construction).
_Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class Settings(BaseSettings):
    """Every tunable of zp-client. Field docs say what each one does and its default."""

    model_config = SettingsConfigDict(env_prefix="ZP_", extra="forbid", validate_assignment=True)

    # --- budget -----------------------------------------------------------------------------------
    block_size: int = Field(16, ge=1, description="Tokens per KV block on the server (vLLM default 16).")
    starvation_bound_s: float = Field(
        2.0,
        ge=0,
        description="How long the head of a priority class may wait before backfill stops and capacity "
        "drains to it.",
    )
    longest_first_s: float = Field(
        0.0,
        ge=0,
        description="Elastic budgets: for how long a waiter may be overtaken by one with a longer forecast "
        "(admission tries the younger waiters longest first; 0 = off, line order). Trades tail TTFT for "
        "makespan and median TTFT; see docs/elastic.md#longest-first.",
    )
    line: Literal["fifo", "slo"] = Field(
        "slo",
        description="The budget's line discipline: 'slo' (default: waiters that can still meet their TTFT "
        "target go first, earliest deadline first; with no targets set it is exactly 'fifo'; see "
        "docs/admission.md#the-slo-aware-line) or 'fifo' (arrival order within a priority class).",
    )
    late_bound_s: float = Field(
        60.0,
        ge=0,
        description="Under line='slo': how long a waiter may be passed by waiters of its class with an "
        "earlier deadline; after that it is tried in arrival order ahead of them (and, past the starvation "
        "bound, becomes a barrier).",
    )
    lease_ttl_s: float = Field(30.0, gt=0, description="Lease time-to-live for backends that expire leases.")

    # --- estimation -------------------------------------------------------------------------------
    estimator: Literal["auto", "tiktoken", "heuristic", "server"] = Field(
        "auto",
        description="Prompt-token estimator: 'auto' uses tiktoken when its BPE data is available "
        "locally, else a fast heuristic; 'server' asks the server's POST /tokenize (opt-in network).",
    )
    encoding: str = Field("cl100k_base", description="tiktoken encoding name.")
    encoding_path: str | None = Field(None, description="Path to a local .tiktoken BPE file.")
    estimate_margin: float = Field(
        0.05, ge=0, description="Extra fraction added to calibrated prompt estimates when reserving."
    )
    default_max_tokens: int = Field(
        4096,
        ge=1,
        description="max_tokens assumed (and sent) when a request gives none, so the lease is a true bound.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="The server's context length; read lazily from /v1/models when unset."
    )

    # --- requests ---------------------------------------------------------------------------------
    deadline_s: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Default deadline per logical request (queue wait, attempts, backoff, to its last byte).",
    )
    fail_fast: bool = Field(
        False,
        description="Fail-fast (opt-in): a request with a deadline (X-ZP-Deadline or deadline_s) whose wait "
        "in line the budget predicts to exceed what is left of it is refused at once with "
        "DeadlineExceeded (predicted_wait_s, retry_after_s) instead of waiting; per call: header "
        "X-ZP-Fail-Fast: 1/0. LocalBudget only (docs/admission.md#predicted-wait-and-fail-fast).",
    )
    # Targets (docs/admission.md#targets): what the budget's line may order waiters by. A request's target
    # is its X-ZP-TTFT-Target header, else its route's, else its priority class's, else the global one;
    # none of them set (the default): no target, and the request's lease meta carries none.
    ttft_target_s: _Seconds | None = Field(
        None,
        description="Default TTFT target in seconds, counted from the logical request's first arrival "
        "(a retry keeps it); overridden per class (ttft_targets), per route (ttft_route_targets) and per "
        "call (header X-ZP-TTFT-Target). None (default): no target.",
    )
    ttft_targets: dict[int, _Seconds] = Field(
        default_factory=dict,
        description="TTFT target in seconds per priority class, e.g. {0: 1.0, 1: 30.0} (env: JSON, "
        "ZP_TTFT_TARGETS='{\"0\": 1, \"1\": 30}'); wins over ttft_target_s.",
    )
    ttft_route_targets: dict[str, _Seconds] = Field(
        default_factory=dict,
        description="TTFT target in seconds per route (the X-ZP-Route header, else the request's model); "
        "wins over the class's and the global target, loses to the call's header.",
    )
    tpot_target_s: _Seconds | None = Field(
        None,
        description="Default TPOT target (seconds per output token after the first); overridden like "
        "ttft_target_s by tpot_targets, tpot_route_targets and header X-ZP-TPOT-Target. None: no target.",
    )
    tpot_targets: dict[int, _Seconds] = Field(
        default_factory=dict, description="TPOT target in seconds per priority class (env: JSON)."
    )
    tpot_route_targets: dict[str, _Seconds] = Field(
        default_factory=dict, description="TPOT target in seconds per route (env: JSON)."
    )
    answer_allowance: bool = Field(
        False,
        description="Opt-in: a call whose caller reads the whole answer at once (not streamed) and that "
        "has both targets gets a line deadline later by its forecast output x its TPOT target (meta "
        "answer_s; elastic budgets, which forecast). Off by default: with the default forecaster it cost "
        "requests in SLO at 1x and 4x in the storm (docs/benchmark.md, 'A non-streamed call's deadline "
        "from both targets').",
    )
    idle_stream_timeout_s: float = Field(
        300.0, gt=0, description="A stream the caller stops reading for this long releases its lease."
    )
    stream_upstream: bool = Field(
        True,
        description="Send non-streamed chat/completions calls upstream as streams and reassemble the "
        "JSON answer inside the transport: proxies' idle timeouts no longer cut long generations (504), "
        "and elastic budgets see the request grow. Calls asking for logprobs/echo are sent as they are.",
    )
    continuous_usage: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Elastic budgets: ask vLLM's stream_options.continuous_usage_stats so every chunk "
        "carries the exact prompt and completion tokens so far. The lease then holds the exact prompt "
        "from the first token on (not the estimate plus its error bound) and counts growth exactly when "
        "the server packs several tokens into one chunk. 'auto': when GET models said the server is "
        "vLLM (zp reads GET models for max_model_len; with Settings.max_model_len set it does not, so "
        "use 'always' there). The per-chunk usage is removed from what the caller reads unless it "
        "asked for it.",
    )
    pool_check: bool = Field(
        True,
        description="Read the server's GET /metrics once per budget and server (lazily, on the first "
        "admitted request; one short read) and log a warning when the budget's limit is larger than the "
        "server's KV pool (num_gpu_blocks - 1 usable blocks): such a budget cannot prevent preemption. A "
        "server without vLLM's /metrics is left alone (debug log). False (ZP_POOL_CHECK=false): no read.",
    )
    api_key: SecretStr | None = Field(None, description="API key for the drop-in client (never logged).")
    base_url: str | None = Field(None, description="Server base URL for the drop-in client.")

    # --- retries (zp_client.retry) ----------------------------------------------------------------
    retry_max_attempts: int = Field(3, ge=1, description="Attempts per logical request, the first included.")
    retry_backoff_initial_s: float = Field(
        0.5, gt=0, description="Full-jitter backoff: the first retry waits uniform(0, this)."
    )
    retry_backoff_max_s: float = Field(8.0, gt=0, description="Full-jitter backoff: the largest window.")
    retry_after_cap_s: float = Field(
        30.0, ge=0, description="Longest Retry-After honoured; a longer one is not retried (not shortened)."
    )
    retry_on_504: bool = Field(
        False,
        description="Also retry 504 and read timeouts. Only safe when the upstream aborts abandoned "
        "requests (vLLM directly, or a gateway that closes its upstream connection on timeout).",
    )
    retry_min_attempt_s: float = Field(
        0.5, ge=0,
        description="Least time an attempt needs; a retry that cannot fit it in the deadline fails.",
    )
    repeat_window_s: float = Field(
        60.0, ge=0,
        description="One retry loop: for this long after zp gave up on a call, the same call again from "
        "the same context (an SDK or agent-framework retry) gets zp's last error without being sent "
        "(zp_client._repeat); 0 turns it off.",
    )
    retry_budget_ratio: float = Field(
        0.5, ge=0,
        description="Retry budget: retries earned per answered request (a status below 500 that is not "
        "retryable); failures earn nothing, so a server failing everything gets only the floor.")
    retry_budget_floor_per_s: float = Field(
        0.5, ge=0, description="Retry budget: retries allowed per second regardless of traffic."
    )
    retry_budget_window_s: float = Field(
        20.0, gt=0,
        description="Retry budget: sliding window length; floor_per_s x window_s is the reserve a burst of "
        "failures may use at once (10 retries by default).")
    retry_budget_wait_s: float = Field(
        30.0, ge=0,
        description="How long a retry the spent retry budget refuses waits for it (holding no KV lease) "
        "when the request has no deadline (a deadline bounds the wait instead); then the request fails "
        "with RetryBudgetExhausted. 0: fail at once.")
