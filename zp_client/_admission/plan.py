"""The request plan: what the admission core decided for one admitted request (blocks, priority,
deadline, lease metadata, the body and headers to send). Plain data; see docs/admission.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, SupportsFloat, SupportsIndex

from zp_client.errors import InvalidRequest

if TYPE_CHECKING:
    from zp_client._admission.ports import HttpURL
    from zp_client.estimate import PromptEstimate

__all__ = ["PRIORITY_HEADER", "DEADLINE_HEADER", "ROUTE_HEADER", "SESSION_HEADER", "TTFT_TARGET_HEADER",
           "TPOT_TARGET_HEADER", "FAIL_FAST_HEADER", "TTFT_TARGET_META", "TPOT_TARGET_META", "AGE_META",
           "ANSWER_META", "FAIL_FAST_META", "is_admitted", "Plan", "Parsed", "Options", "read_headers",
           "read_body", "api_base", "seconds"]

PRIORITY_HEADER = "x-zp-priority"
DEADLINE_HEADER = "x-zp-deadline"
ROUTE_HEADER = "x-zp-route"
SESSION_HEADER = "x-zp-session"
TTFT_TARGET_HEADER = "x-zp-ttft-target"
TPOT_TARGET_HEADER = "x-zp-tpot-target"
FAIL_FAST_HEADER = "x-zp-fail-fast"
# Lease meta keys of a request's targets (docs/admission.md#targets): seconds to its first token counted
# from the logical request's first arrival, seconds per output token after it, and the request's age at
# this enqueue (its first arrival is the first attempt's start, on the core's clock: a retry keeps it).
TTFT_TARGET_META = "ttft_target_s"
TPOT_TARGET_META = "tpot_target_s"
AGE_META = "age_s"
# Lease meta key (zp_client.budget.ledger.ANSWER_KEY, the same string): a call whose caller reads the whole
# answer at once (not streamed, whether or not zp streams it upstream) with both targets: its forecast
# output tokens x its TPOT target, seconds. Its SLO is "the answer within TTFT + output x TPOT", so the
# line's deadline is that much later than a streamed call's (docs/admission.md#targets).
ANSWER_META = "answer_s"
# Lease meta key: the caller opted into fail-fast (zp_client.budget.predict.FAIL_FAST_KEY, the same string).
FAIL_FAST_META = "fail_fast"
ADMITTED_SUFFIXES = ("/chat/completions", "/completions", "/responses")


def is_admitted(method: str, path: str) -> bool:
    """True when a request is an LLM call the transport takes a lease for."""
    return method.upper() == "POST" and path.rstrip("/").endswith(ADMITTED_SUFFIXES)


@dataclass
class Plan:
    """What the core decided for one admitted request."""

    content: bytes
    headers: list[tuple[bytes, bytes]]
    blocks: int
    held: int
    priority: int
    deadline: float | None  # monotonic time
    strip_usage: bool
    stream: bool
    prompt_tokens: int
    n: int
    estimate: PromptEstimate
    meta: dict[str, object] | None = None
    """Lease metadata: an elastic budget's, a fleet's routing, the targets (None when none of them)."""
    route: str = "default"
    """The forecaster's key."""
    max_tokens: int = 0
    forecast: int = 0
    """Forecast output tokens per choice (elastic only)."""
    spread: bool = False
    """Send the stream's upper forecast (``forecast_hi``) with its forecast: the budget's policy reads it
    (a spread-sized reserve, ``ElasticPolicy(reserve_z=...)``)."""
    forecast_known: bool = False
    """The forecast came from the request itself (``forecast_request``): outliving it re-forecasts one
    block at a time instead of asking the forecaster's tail quantile."""
    chat: bool = False
    upstream: bool = False
    """A non-streamed call sent upstream as a stream: the transport reassembles the JSON answer."""
    continuous: bool = False
    """zp asked vLLM for ``continuous_usage_stats``: every chunk carries the exact counts so far."""
    strip_continuous: bool = False
    """...and the caller did not: the per-chunk usage is removed from what it reads."""
    arrival: float = 0.0
    """When the logical request first arrived (monotonic, the core's clock): its targets count from it."""
    targeted: bool = False
    """``meta`` holds a TTFT or TPOT target: each acquire sends the request's ``age_s`` with it."""
    fail_fast: bool = False
    """Refuse at enqueue when the budget predicts the wait past the deadline
    (docs/admission.md#predicted-wait-and-fail-fast)."""


@dataclass
class Parsed:
    body: dict[str, object]
    changed: bool
    headers: list[tuple[bytes, bytes]]
    priority: int
    deadline: float | None
    stream: bool
    strip_usage: bool
    max_tokens: int
    model: str | None
    base: str
    root: str
    auth_headers: dict[str, str] = field(default_factory=dict)
    route: str | None = None
    upstream: bool = False
    session: str | None = None
    chat_or_completions: bool = True
    """``/chat/completions`` or ``/completions`` (not ``/responses``, whose events carry no such usage)."""
    fail_fast: bool = False
    arrival: float = 0.0
    """When the request arrived (monotonic, the core's clock)."""
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None


def api_base(url: HttpURL) -> tuple[str, str]:
    """(API base, server root) of an admitted request's URL: ``http://h:p/v1``, ``http://h:p``."""
    key = (url.scheme, url.host, url.port, url.path)
    hit = _bases.get(key)
    if hit is None:
        if len(_bases) > 1024:
            _bases.clear()
        hit = _bases[key] = _api_base_uncached(url)
    return hit


_bases: dict[tuple[str, str, int | None, str], tuple[str, str]] = {}


def _api_base_uncached(url: HttpURL) -> tuple[str, str]:
    path = url.path.rstrip("/")
    for suffix in ADMITTED_SUFFIXES:
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    port = f":{url.port}" if url.port else ""
    root = f"{url.scheme}://{url.host}{port}"
    return root + path, root


@dataclass
class Options:
    """The per-call options read from a request's headers, and the headers to send on."""

    headers: list[tuple[bytes, bytes]]
    """Without zp's own headers and the body lengths (recomputed for the body sent)."""
    auth: dict[str, str]
    """The credentials among them (for server metadata calls)."""
    priority: int | None = None
    deadline_s: float | None = None
    route: str | None = None
    session: str | None = None
    """``X-ZP-Session``: a fleet keeps the requests of one session on one replica."""
    ttft_target_s: float | None = None
    """``X-ZP-TTFT-Target``: seconds from the request's arrival to its first token."""
    fail_fast: bool | None = None
    """``X-ZP-Fail-Fast``: ``1``/``true`` or ``0``/``false`` (None: Settings.fail_fast decides)."""
    tpot_target_s: float | None = None
    """``X-ZP-TPOT-Target``: seconds per output token after the first."""


def seconds(value: object, field: str, kind: str = "header") -> float:
    """``value`` as a positive finite number of seconds, else :class:`~zp_client.InvalidRequest` whose
    ``field`` is ``field`` (a header's or an option's name; ``kind`` says which in the message). Takes
    numbers and their text (bytes: ASCII); refuses bools, nan, inf, 0 and negatives."""
    got = value
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        try:
            value = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise InvalidRequest(f"{kind} {field} must be a positive number of seconds, got bytes that are "
                                 f"not text: {raw!r}", field=field) from None
        got = value
    out = math.nan
    if not isinstance(value, bool) and isinstance(value, (str, SupportsFloat, SupportsIndex)):
        try:
            out = float(value)
        except (TypeError, ValueError):
            out = math.nan
    if not (out > 0 and math.isfinite(out)):
        raise InvalidRequest(f"{kind} {field} must be a positive finite number of seconds, got {got!r}",
                             field=field)
    return out


def _positive_int(body: Mapping[str, object], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        # Never coerced: "100" or 1.5 read as "absent" once sent 4096 while the server read 100.
        raise InvalidRequest(f"{key} must be a positive integer, got {v!r}", field=key)
    return v


def read_body(body: Mapping[str, object], responses: bool) -> int | None:
    """Check the body fields zp reads and return the output-token limit the request sets (None: it sets
    none). Each is taken as given or refused with :class:`~zp_client.InvalidRequest` naming the field,
    never rewritten: ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens`` / ``n`` /
    ``best_of`` must be positive integers (bools refused), ``stream`` a bool, ``stream_options`` an object,
    ``priority`` an integer, ``messages`` a list of objects, ``prompt`` a string or a list of strings, of
    token ids or of token-id lists. ``null`` counts as absent (the OpenAI SDKs send it for "not given")."""
    if responses:
        out = _positive_int(body, "max_output_tokens")
    else:
        out = _positive_int(body, "max_completion_tokens")
        fallback = _positive_int(body, "max_tokens")
        out = fallback if out is None else out
    _positive_int(body, "n")
    _positive_int(body, "best_of")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", field="stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):  # would be replaced by zp's {"include_usage": true}
        raise InvalidRequest(f"stream_options must be an object, got {_short(so)}", field="stream_options")
    prio = body.get("priority")
    if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int)):
        raise InvalidRequest(f"priority must be an integer (lower = earlier), got {prio!r}", field="priority")
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise InvalidRequest("messages must be a list of message objects, got "
                                 f"{_short(msgs)}", field="messages")
    if "prompt" in body and not _prompt_shape(body["prompt"]):
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                             f"token-id lists, got {_short(body['prompt'])}", field="prompt")
    return out


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _prompt_shape(p: object) -> bool:
    if isinstance(p, str):
        return True
    if not isinstance(p, list):
        return False
    if all(isinstance(x, str) for x in p):
        return True
    return _ids(p) or all(isinstance(x, list) and _ids(x) for x in p)


def _ids(xs: list[object]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in xs)


def _text(v: bytes, name: str) -> str:
    try:
        return v.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidRequest(f"header {name} is not UTF-8 text: {v!r}", field=name) from None


def read_headers(raw: list[tuple[bytes, bytes]]) -> Options:
    """Read ``X-ZP-Priority`` / ``X-ZP-Deadline`` / ``X-ZP-TTFT-Target`` / ``X-ZP-TPOT-Target`` /
    ``X-ZP-Route`` / ``X-ZP-Session`` (stripped) from raw headers. A bad value (a priority that is not an
    integer, a deadline or target that is not a positive finite number of seconds, bytes that are not
    text) raises :class:`~zp_client.InvalidRequest` naming the header, before anything is taken or sent."""
    opts = Options(headers=[], auth={})
    for k, v in raw:
        lk = k.lower()
        if lk == _ROUTE:
            opts.route = v.decode("utf-8", "replace").strip() or None
        elif lk == _SESSION:
            opts.session = v.decode("utf-8", "replace").strip() or None
        elif lk == _PRIORITY:
            text = _text(v, "X-ZP-Priority")
            try:
                opts.priority = int(text)
            except ValueError:
                raise InvalidRequest(
                    f"header X-ZP-Priority must be an integer (lower = earlier), got {text!r}",
                    field="X-ZP-Priority",
                ) from None
        elif lk == _DEADLINE:
            opts.deadline_s = seconds(v, "X-ZP-Deadline")
        elif lk == _TTFT:
            opts.ttft_target_s = seconds(v, "X-ZP-TTFT-Target")
        elif lk == _TPOT:
            opts.tpot_target_s = seconds(v, "X-ZP-TPOT-Target")
        elif lk == _FAIL_FAST:
            flag = _text(v, "X-ZP-Fail-Fast").lower()
            if flag not in _FLAGS:
                raise InvalidRequest(f"header X-ZP-Fail-Fast must be 1/0 or true/false, got {flag!r}",
                                     field="X-ZP-Fail-Fast")
            opts.fail_fast = _FLAGS[flag]
        elif lk in _NOT_SENT:  # the body lengths are recomputed; X-ZP-Call is zp's (zp_client._repeat)
            continue
        else:
            if lk in (b"authorization", b"api-key", b"x-api-key") or lk.startswith(b"openai-"):
                opts.auth[k.decode("latin-1")] = v.decode("latin-1")
            opts.headers.append((k, v))
    return opts


_ROUTE, _PRIORITY, _DEADLINE = ROUTE_HEADER.encode(), PRIORITY_HEADER.encode(), DEADLINE_HEADER.encode()
_SESSION = SESSION_HEADER.encode()
_TTFT, _TPOT = TTFT_TARGET_HEADER.encode(), TPOT_TARGET_HEADER.encode()
_FAIL_FAST = FAIL_FAST_HEADER.encode()
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_NOT_SENT = (b"content-length", b"transfer-encoding", b"x-zp-call")
