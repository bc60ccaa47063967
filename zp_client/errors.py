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
    "ServerUnreachable",
    "MissingIntegration",
    "ServerInfoError",
    "CalibrationError",
    "retry_on",
    "unwrap_error",
]


class ZPError(Exception):
    """Base class of every error raised by zp-client itself."""


class ConfigurationError(ZPError, ValueError):
    """A setting or argument is invalid (negative weight, unknown policy, ...)."""


class AdmissionError(ZPError):
    """zp-client refused to send a request. Nothing reached the server."""


class LeaseTooLarge(AdmissionError, ValueError):
    """The request's KV bound exceeds the budget's whole limit, so it could never be admitted.

    Lower ``max_tokens``, shorten the prompt, or raise the budget's ``limit_blocks``. A permanent refusal:
    also a ``ValueError``, which agent frameworks' default retry predicates treat as permanent
    (docs/retries.md#zp-errors-and-framework-retries).
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
    """The logical request's deadline left no time for (another) attempt, passed while an attempt was in
    flight (waiting for headers, reading the body: the call was ended there, its lease released), or
    (fail-fast, opt-in) the budget predicted its wait in line to exceed what is left of the deadline and
    refused it at enqueue.

    ``predicted_wait_s``: the predicted wait in seconds when the refusal is a fail-fast one (else None);
    ``retry_after_s``: a hint, the seconds after which a new call's wait is predicted to fit the same
    deadline (``predicted_wait_s - time left``; None when not a fail-fast refusal). See
    docs/admission.md#predicted-wait-and-fail-fast."""

    def __init__(self, message: str = "", *, predicted_wait_s: float | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.predicted_wait_s = predicted_wait_s
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        return (_deadline_exceeded, (str(self), self.predicted_wait_s, self.retry_after_s))


def _deadline_exceeded(message: str, predicted_wait_s: float | None,
                       retry_after_s: float | None) -> DeadlineExceeded:
    return DeadlineExceeded(message, predicted_wait_s=predicted_wait_s, retry_after_s=retry_after_s)


class PromptTooLong(AdmissionError, ValueError):
    """The prompt alone is longer than the server's ``max_model_len``: the server would answer 400.

    A permanent refusal: also a ``ValueError`` (see :class:`LeaseTooLarge`)."""

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


class RetryBudgetExhausted(ZPError, ValueError):
    """The shared retry budget stayed spent for as long as the request could wait for it
    (its deadline, else ``Settings.retry_budget_wait_s``): the request failed and is not retried, to avoid
    a retry storm. ``__cause__`` is the last attempt's error when there was one.

    Also a ``ValueError``, so that agent frameworks' default retry predicates do not retry it: a framework
    retry is exactly the extra load the budget refused (docs/retries.md).
    """


class ServerUnreachable(ZPError):
    """No attempt reached the server: every connection was refused or timed out.

    ``url`` is the address that was tried, ``reason`` ``"connection refused"`` or ``"timed out"``,
    ``attempts`` how many attempts were made. The message names both; the transport errors behind it are
    not chained (they say nothing more). Never counted as overload: the retry budget is not spent on it.
    Through ``wrap()`` it is also an ``openai.APIConnectionError``; through zp's own ``Client`` /
    ``AsyncClient`` also a :class:`zp_client.client.APIConnectionError`.
    """

    def __init__(self, url: str, reason: str, attempts: int = 1) -> None:
        self.url = url
        self.reason = reason
        self.attempts = attempts
        tries = f" ({attempts} attempts)" if attempts > 1 else ""
        super().__init__(
            f"the server at {url} is unreachable: {reason}{tries}; check that it is running and that the "
            "base URL is right"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (ServerUnreachable, (self.url, self.reason, self.attempts))


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


def install_hint(extra: str) -> str:
    """The command that installs zp-client's ``extra``, for a message: from the clone this zp-client runs
    from when it runs from one (an editable install or a source tree: ``pip install 'zp-client[x]'``
    there would fetch another copy from PyPI), else from PyPI; the other way is named after it."""
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        clone = 'name = "zp-client"' in (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        clone = False
    pypi = f"pip install 'zp-client[{extra}]'"
    if clone:
        clone_cmd = f"pip install -e {shlex.quote(f'{root}[{extra}]')}"
        return f"{clone_cmd} (zp-client runs from the clone at {root}; from PyPI: {pypi})"
    return f"{pypi} (from a clone: pip install -e '.[{extra}]')"


# --------------------------------------------------------------------------------------------------
# for frameworks' retry predicates
# --------------------------------------------------------------------------------------------------

# Refusals a retry cannot fix (same request, same answer) or must not try (the budget refused the load).
_PERMANENT: tuple[type[BaseException], ...] = (
    ConfigurationError, InvalidRequest, LeaseTooLarge, PromptTooLong, RetryBudgetExhausted, DeadlineExceeded,
    PinRefused, MissingIntegration,
)
# HTTP statuses a retry may fix (openai's own rule: 408, 409, 429 and every 5xx).
_TRANSIENT_STATUSES = frozenset({408, 409, 429})
# Transport errors by class name (httpx, httpx2, requests, aiohttp...): nothing to import.
_TRANSIENT_NAMES = frozenset({
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "ReadError", "WriteError",
    "RemoteProtocolError", "APIConnectionError", "APITimeoutError",
})


def error_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from or during, breadth-first, each once (chains can be cycles)."""
    seen: set[int] = set()
    out: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        nxt: list[BaseException | None] = [e.__cause__, e.__context__]
        # an exception group (anyio task groups, asyncio.TaskGroup) holds the failures of its tasks
        nxt.extend(getattr(e, "exceptions", None) or ())
        todo.extend(x for x in nxt if isinstance(x, BaseException))
    return out


def unwrap_error(exc: BaseException) -> ZPError | None:
    """The zp-client error behind ``exc``: ``exc`` itself if it is one, else the first :class:`ZPError`
    found by walking ``__cause__``, ``__context__`` (and the members of an exception group), each
    exception once, so a cyclic chain ends. ``None`` when there is none.

    Frameworks that re-raise an LLM error as their own type keep the original in that chain: LiteLLM's
    ``InternalServerError`` (raised while handling the openai error, so ``__context__``), Microsoft
    Agent Framework's ``ChatClientException`` (``raise ... from``). Imports no framework::

        try:
            await agent.run(...)
        except Exception as exc:
            zp = zp_client.unwrap_error(exc)
            if isinstance(zp, zp_client.LeaseTooLarge):
                ...
    """
    for e in error_chain(exc):
        if isinstance(e, ZPError):
            return e
    return None


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def retry_on(exc: BaseException) -> bool:
    """Whether retrying the call that raised ``exc`` may help: a retry predicate for agent frameworks.

    Usable as LangGraph's ``RetryPolicy(retry_on=zp_client.retry_on)``, tenacity's
    ``retry=retry_if_exception(zp_client.retry_on)`` and the like. It looks through the framework's own
    wrapping (:func:`unwrap_error`):

    * ``False`` for zp's permanent refusals (:class:`LeaseTooLarge`, :class:`PromptTooLong`,
      :class:`InvalidRequest`, :class:`ConfigurationError`, :class:`PinRefused`), for
      :class:`RetryBudgetExhausted` (a retry is the load the budget just refused) and
      :class:`DeadlineExceeded` (the caller's time is up);
    * ``True`` for the other zp errors (:class:`AdmissionTimeout`, :class:`ServerUnreachable`,
      :class:`BudgetUnavailable`, :class:`LeaseLost`, :class:`StreamCut`...): a later call may succeed;
    * otherwise by the HTTP status when the error carries one (``status_code`` or ``response.status_code``):
      408, 409, 429 and 5xx, openai's rule; by type for transport errors (connect/read/write errors and
      timeouts, Python's ``ConnectionError`` / ``TimeoutError``); ``False`` for anything else (a bug is
      not fixed by running it again).

    zp already retried what it could inside the call (docs/retries.md): a framework retry on top only
    helps after the condition has passed.
    """
    zp = unwrap_error(exc)
    if zp is not None:
        if isinstance(zp, _PERMANENT):
            return False
        status = _status_of(zp)
        if status is not None:
            return status in _TRANSIENT_STATUSES or status >= 500
        return True
    for e in error_chain(exc):
        status = _status_of(e)
        if status is not None:
            return status in _TRANSIENT_STATUSES or status >= 500
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_NAMES for c in type(e).__mro__):
            return True
    return False
