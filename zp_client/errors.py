"""Typed errors. Every error zp-client raises on its own account derives from :class:`ZPError`.

Messages say what happened and what to do about it. They never contain API keys or
``Authorization`` headers.
"""

from __future__ import annotations

__all__ = [
    "ZPError",
    "ConfigurationError",
    "AdmissionError",
    "LeaseTooLarge",
    "AdmissionTimeout",
    "DeadlineExceeded",
    "PromptTooLong",
    "InvalidRequest",
    "BudgetUnavailable",
    "LeaseLost",
    "PinRefused",
    "StreamCut",
    "RetryBudgetExhausted",
    "MissingIntegration",
    "ServerInfoError",
    "CalibrationError",
]


class ZPError(Exception):
    """Base class of every error raised by zp-client itself."""


class ConfigurationError(ZPError, ValueError):
    """A setting or argument is invalid (negative weight, unknown policy, ...)."""


class AdmissionError(ZPError):
    """zp-client refused to send a request. Nothing reached the server."""


class LeaseTooLarge(AdmissionError):
    """The request's KV bound exceeds the budget's whole limit, so it could never be admitted.

    Lower ``max_tokens``, shorten the prompt, or raise the budget's ``limit_blocks``.
    """

    def __init__(self, blocks: int, limit: int, detail: str = "") -> None:
        self.blocks = blocks
        self.limit = limit
        msg = (
            f"request needs {blocks} KV blocks but the budget's limit is {limit} blocks, so it can never "
            "be admitted; lower max_tokens, shorten the prompt, or raise limit_blocks"
        )
        super().__init__(f"{msg} ({detail})" if detail else msg)


class AdmissionTimeout(AdmissionError, TimeoutError):
    """The request waited for a lease longer than its timeout or deadline allowed."""


class DeadlineExceeded(AdmissionTimeout):
    """The logical request's deadline left no time for (another) attempt."""


class PromptTooLong(AdmissionError):
    """The prompt alone is longer than the server's ``max_model_len``: the server would answer 400."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt is about {prompt_tokens} tokens but the model's maximum context length is "
            f"{max_model_len} tokens; shorten the prompt (nothing was sent)"
        )


class InvalidRequest(AdmissionError, ValueError):
    """A request's own zp input is malformed (a header, a per-call option or a setting it reads): a target
    or deadline that is not a positive finite number of seconds, a priority that is not an integer, ...

    Raised before any lease is taken, so nothing is held and nothing reached the server. It is a
    ``ValueError`` so that agent frameworks' default retry predicates treat it as permanent. ``field``
    names the header or setting at fault (e.g. ``"X-ZP-TTFT-Target"``).
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        self.field = field
        super().__init__(message)


class BudgetUnavailable(AdmissionError):
    """The shared budget (Redis) could not be reached and the policy is ``fail_closed``."""


class PinRefused(ZPError):
    """A prefix could not be pinned: the budget's pinned blocks would exceed its cap."""

    def __init__(self, blocks: int, pinned: int, cap: int) -> None:
        self.blocks = blocks
        self.pinned = pinned
        self.cap = cap
        super().__init__(
            f"pinning {blocks} more blocks would take the pinned prefixes to {pinned + blocks} blocks, over "
            f"the budget's cap of {cap} (its pin_cap share of the limit); unpin another prefix or raise "
            "pin_cap"
        )


class LeaseLost(ZPError):
    """A lease expired or was removed from the budget while its holder still ran."""


class StreamCut(ZPError):
    """A stream that had started reaching its caller was cut: the replica serving it failed (a fleet's
    replica died or reset the connection). The answer is incomplete and is not resumed elsewhere (a
    resumed stream would repeat or contradict what the caller already read). Raised while reading the
    body, from the transport error as its ``__cause__``; through ``wrap()`` it is also an
    ``openai.OpenAIError`` (openai passes those on unchanged, both majors). ``replica`` is the base URL
    that failed."""

    replica: str | None = None


class RetryBudgetExhausted(ZPError):
    """The shared retry budget is spent: the request failed and is not retried, to avoid a retry storm."""


class ServerInfoError(ZPError):
    """The server could not answer an informational request (``/v1/models``, ``/tokenize``, ``/metrics``).

    ``status`` is the HTTP status (0 when no response arrived). Check the base URL and that the server
    exposes the endpoint (``/tokenize`` and ``/metrics`` are vLLM's, at the server root).
    """

    def __init__(self, what: str, status: int, detail: str = "") -> None:
        self.status = status
        self.detail = detail
        msg = (f"the server's {what} answered HTTP {status}" if status
               else f"the server's {what} did not answer")
        super().__init__(f"{msg}: {detail}" if detail else msg)


class CalibrationError(ServerInfoError):
    """The server cannot size a budget: its ``/metrics`` did not answer, or lacks what calibration reads
    (``vllm:cache_config_info`` with ``num_gpu_blocks`` and ``block_size``).

    ``url`` is the address that was asked, ``missing`` what was not there. Nothing is guessed in its
    place: set ``limit_blocks`` by hand (docs/admission.md#choosing-limit_blocks) or point at vLLM.
    """

    def __init__(self, url: str, missing: str, status: int, detail: str = "") -> None:
        self.url = url
        self.missing = missing
        ServerInfoError.__init__(self, f"GET {url}", status, detail)
        got = f"HTTP {status}" if status else "no answer"
        self.args = (f"cannot calibrate from {url}: {missing} ({got}{': ' + detail if detail else ''}); "
                     "calibration needs vLLM's /metrics with vllm:cache_config_info (num_gpu_blocks, "
                     "block_size), or set limit_blocks by hand",)

    def __str__(self) -> str:
        return str(self.args[0])


class MissingIntegration(ConfigurationError, ImportError):
    """An optional part is not installed: an agent-framework integration or the framework it needs, or an
    extra's packages (``RedisBudget`` without ``zp-client[redis]``); the message says what to install."""
