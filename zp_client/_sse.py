"""Server-sent events, sans I/O: the scanner that watches a response body go by, and the reassembler
that rebuilds a non-streamed answer from a stream.

The :class:`Scanner` counts ``data:`` events (growth reports to the lease), finds ``usage`` (vLLM's
continuous usage too) and removes the usage zp asked for; the :class:`Reassembler` turns the stream of a
non-streamed call back into its JSON answer. Neither reads a clock or a socket. See docs/admission.md.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from zp_client._admission.ports import Forecaster, SpreadForecaster
from zp_client.budget.base import Lease

if TYPE_CHECKING:
    from zp_client._admission.plan import Plan

logger = logging.getLogger("zp_client.transport")

# Growth is reported every few blocks under strict (accounting only), and at every new block under
# elastic: the projected peak reads ``held`` as the lease's occupancy now, and a stream reporting every 4
# blocks runs up to 3 blocks ahead of what the policy sees (with 40 live streams, up to 120 blocks of the
# pool unseen). Reports are a lock and a dict update locally; RedisBudget batches them
# (``held_report_blocks``), so a Redis backend is still not hit per block.
_REPORT_STEP_BLOCKS = 4
_ELASTIC_REPORT_STEP_BLOCKS = 1
# Non-streamed bodies are kept (up to this size) only to read their ``usage`` at the end.
_MAX_USAGE_BODY = 4 * 1024 * 1024
SSE_SEPARATOR = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_USAGE_NULL = re.compile(rb'\s*,\s*"usage"\s*:\s*null(?=\s*[,}])|"usage"\s*:\s*null\s*,\s*')
# vLLM's continuous usage in a chunk: a flat object, or one with one level of nested details
# (prompt_tokens_details), matched where the key is (found with rfind: vLLM writes it last).
_USAGE_AT = re.compile(rb'"usage"\s*:\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')
_JSON_WS = b" \t\r\n"
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def usage_member(event: bytes) -> tuple[int, int, int, int] | None:
    """Where the ``"usage": {...}`` member of a chunk is: (start, end) of the member with one of its
    commas, so that cutting it leaves valid JSON, and (start, end) of the object. None without one.
    Inside a JSON string a quote is escaped, so ``"usage"`` found here is a key."""
    i = event.rfind(b'"usage"')
    if i < 0:
        return None
    m = _USAGE_AT.match(event, i)
    if m is None:
        return None
    start, end = i, m.end()
    j = start
    while j > 0 and event[j - 1] in _JSON_WS:
        j -= 1
    if j > 0 and event[j - 1] == 0x2C:  # ',' before it: take that one
        start = j - 1
    else:  # the first member: take the comma after it, if any
        k = end
        while k < len(event) and event[k] in _JSON_WS:
            k += 1
        if k < len(event) and event[k] == 0x2C:
            end = k + 1
            while end < len(event) and event[end] in _JSON_WS:
                end += 1
    return start, end, m.start(1), m.end(1)


def reforecast(fc: Forecaster, route: str, generated: int, max_tokens: int) -> int:
    """A stream that reached its forecast, re-forecast given its length so far at the tail quantile (a
    forecaster without one, e.g. a custom duck-typed one, answers with its usual quantile)."""
    try:
        return int(fc.forecast(route, generated=generated, max_tokens=max_tokens, tail=True))
    except TypeError:
        return int(fc.forecast(route, generated=generated, max_tokens=max_tokens))


def forecast_hi(fc: Forecaster | None, route: str, generated: int, max_tokens: int) -> int | None:
    """A stream's upper forecast (total output tokens) from the forecaster's ``spread`` (see
    :meth:`~zp_client.forecast.LengthForecaster.spread`); None for a forecaster without one."""
    if not isinstance(fc, SpreadForecaster):
        return None
    return int(fc.spread(route, generated=generated, max_tokens=max_tokens))


class Scanner:
    """Watches a response body go by: counts SSE events, finds ``usage``, strips the one zp added."""

    def __init__(self, plan: Plan, block_size: int, bound: int, lease: Lease, is_sse: bool,
                 forecaster: Forecaster | None = None) -> None:
        self.plan = plan
        # Elastic progress: first token, exact tokens with each held report, re-forecasts.
        self.elastic = plan.meta is not None and plan.meta.get("streaming", False) is True and is_sse
        self.forecaster = forecaster
        self.forecast = plan.forecast
        self.first_sent = False
        # A chat stream's first event is the role chunk: it carries no token.
        self.skip = 1 if plan.chat else 0
        self.block_size = block_size
        self.bound = bound
        self.lease = lease
        self.sse = is_sse
        self.strip = plan.strip_usage and is_sse
        # Exact counts from vLLM's continuous usage: (prompt tokens, completion tokens so far).
        self.continuous = self.elastic and plan.continuous
        self.strip_continuous = self.continuous and plan.strip_continuous
        self.counts: tuple[int, int] | None = None
        self.prompt_reported = False
        # The bytes handed back may differ from the server's (a usage removed): no Content-Length then.
        self.rewrites = self.strip or self.strip_continuous
        self.buf = bytearray()
        self.events = 0
        self.reported = plan.held
        self.usage: dict[str, object] | None = None
        self.pending: bytes | None = None
        self.body = bytearray() if not is_sse else None
        self.observed = False

    def feed(self, chunk: bytes) -> bytes:
        if not self.sse:
            if self.body is not None:
                if len(self.body) + len(chunk) <= _MAX_USAGE_BODY:
                    self.body += chunk
                else:
                    self.body = None
            return chunk
        if not self.buf and b'"usage"' not in chunk and chunk.endswith((b"\n\n", b"\r\r")):
            # Fast path, the usual case: whole events and nothing to strip or read, so just count them.
            n = chunk.count(b"data:")
            if n:
                self._grow(n)
            return chunk
        if self.continuous and not self.buf and chunk.find(b"\n\n") == len(chunk) - 2:
            # One whole event (vLLM writes one per chunk): every event carries usage, so skip the buffer.
            keep = self._event(chunk)
            if not self.rewrites:
                return chunk
            return self._take(chunk) if keep else b""
        self.buf += chunk
        out = bytearray() if self.rewrites else None
        start = 0
        for m in SSE_SEPARATOR.finditer(self.buf):
            event = bytes(self.buf[start : m.end()])
            start = m.end()
            if self._event(event) and out is not None:
                out += self._take(event)
        del self.buf[:start]
        if out is None:
            return chunk
        return bytes(out)

    def flush(self) -> bytes:
        """Whatever is left after the last separator (a server that ends without a blank line)."""
        if not self.sse or not self.buf:
            return b""
        rest = bytes(self.buf)
        self.buf.clear()
        keep = self._event(rest)
        return self._take(rest) if (self.rewrites and keep) else b""

    def _take(self, event: bytes) -> bytes:
        """The event as the caller gets it (with an added ``"usage": null`` removed)."""
        if self.pending is not None:
            event, self.pending = self.pending, None
        return event

    def _event(self, event: bytes) -> bool:
        """Account one SSE event; False when it is the usage-only chunk zp asked for."""
        if b"data:" not in event:
            return True
        if self.continuous and not (b"[]" in event and _EMPTY_CHOICES.search(event)):
            found = usage_member(event)
            if found is not None:
                start, end, a, b = found
                pt, ct = _PROMPT_TOKENS.search(event, a, b), _COMPLETION_TOKENS.search(event, a, b)
                if pt is not None and ct is not None:
                    self.counts = (int(pt.group(1)), int(ct.group(1)))
                    if self.strip_continuous:
                        self.pending = event[:start] + event[end:]
                    self._grow(1)
                    return True
        if b'"usage"' in event:
            data = b"".join(
                line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")
            )
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if obj.get("choices") == []:
                    return not self.strip
            elif self.strip and isinstance(obj, dict) and "usage" in obj:
                # OpenAI-style servers put "usage": null in every chunk once include_usage is on;
                # without it they send no such key, so drop the key to hand back the original bytes.
                self.pending = _USAGE_NULL.sub(b"", event)
        self._grow(1)
        return True

    def _grow(self, events: int) -> None:
        self.events += events
        if self.elastic:
            self._progress()
            return
        # About one token per choice per event; the first (role) event carries none, which only makes
        # this a slight overestimate of growth: fine for accounting.
        generated = self.events // self.plan.n
        held = min(
            self.bound,
            -(-(self.plan.prompt_tokens + generated) // self.block_size) * self.plan.n,
        )
        if held >= self.reported + _REPORT_STEP_BLOCKS:
            self.reported = held
            self.lease.report_held(held)

    def _progress(self) -> None:
        """Elastic (n == 1, streamed): report first token, growth with exact tokens, re-forecasts."""
        plan = self.plan
        counts = self.counts
        if counts is not None:
            # vLLM's continuous usage: exact, also when one chunk carries several tokens
            prompt, generated = counts
            tokens = prompt + generated
        else:
            prompt = plan.prompt_tokens
            generated = max(0, self.events - self.skip)
            tokens = prompt + generated
        if (
            self.first_sent
            and generated < self.forecast
            and tokens < (self.reported + _ELASTIC_REPORT_STEP_BLOCKS - 1) * self.block_size + 1
            and (counts is None or self.prompt_reported)
        ):
            return  # the common case, per event: nothing to report yet
        fields: dict[str, object] = {}
        if not self.first_sent:
            # vLLM sends a stream's first event once the prompt is prefilled: its prefix is cached now.
            self.first_sent = True
            fields["first_token"] = True
        if counts is not None and not self.prompt_reported:
            # The server's count replaces the estimate (and its error bound) for the rest of the lease.
            self.prompt_reported = True
            if prompt != plan.prompt_tokens:
                fields["prompt_tokens"] = prompt
        if generated >= self.forecast and self.forecast < plan.max_tokens:
            # Reached its forecast and still going: ask again, given the tokens so far. At the forecast
            # end itself the policy already reads the lease as outgrown (projected to its bound), so a
            # new forecast here loosens that as soon as it is known.
            hi: int | None
            if plan.forecast_known or self.forecaster is None:
                new = hi = min(plan.max_tokens, generated + self.block_size)
            else:
                new = reforecast(self.forecaster, plan.route, generated, plan.max_tokens)
                hi = None
                if plan.spread:
                    hi = forecast_hi(self.forecaster, plan.route, generated, plan.max_tokens)
            if new > self.forecast:
                self.forecast = new
                fields["forecast_tokens"] = new
                if hi is not None and plan.spread:
                    fields["forecast_hi"] = max(hi, new)
        held = min(self.bound, -(-tokens // self.block_size))
        if fields or held >= self.reported + _ELASTIC_REPORT_STEP_BLOCKS:
            self.reported = held
            try:
                self.lease.report_progress(held, tokens=tokens, **fields)
            except Exception:  # progress is advisory; it must never break the caller's stream
                logger.debug("progress report failed", exc_info=True)

    def advance(self, events: int, usage: dict[str, object] | None = None) -> None:
        """Account ``events`` SSE data events already split and parsed elsewhere (a stream the transport
        reassembles itself): the same growth, first-token and re-forecast reports as :meth:`feed`."""
        if usage is not None:
            self.usage = usage
            if self.continuous:
                pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if isinstance(pt, int) and isinstance(ct, int):
                    self.counts = (pt, ct)
        if events:
            self._grow(events)

    def final_usage(self) -> dict[str, object] | None:
        if self.usage is None and self.body is not None:
            try:
                obj = json.loads(bytes(self.body))
            except ValueError:
                return None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
        return self.usage



# Non-streamed calls streamed upstream: the answer is rebuilt from the stream (sans I/O).
# --------------------------------------------------------------------------------------------------

# Body fields whose answer a stream cannot carry faithfully into the non-streamed shape (logprobs are
# laid out differently; echo, beam search and best_of behave differently or are refused when streamed).
_UNFAITHFUL_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "use_beam_search")
# Delta fields that name something rather than accumulate text: the first non-null value wins.
_IDENTITY_FIELDS = frozenset(("id", "type", "role", "name"))
# Chunk-level fields that only make sense in a stream.
_STREAM_ONLY_FIELDS = frozenset(("choices", "usage", "object", "obfuscation"))
# Upstream headers that described the stream, not the JSON body handed to the caller.
REASSEMBLY_DROPPED_HEADERS = (b"content-length", b"transfer-encoding", b"content-type", b"content-encoding")


def reassembly_faithful(body: Mapping[str, object]) -> bool:
    """True when a stream of this request can be turned back into its exact non-streamed answer."""
    for key in _UNFAITHFUL_FIELDS:
        value = body.get(key)
        if value is not None and value is not False:
            return False
    best_of, n = body.get("best_of"), body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 1
    return not (isinstance(best_of, int) and not isinstance(best_of, bool) and best_of > n)


class BadEvent(ValueError):
    """An SSE event that cannot be reassembled (surfaced as the HTTP library's DecodingError)."""


def _merge_delta(into: dict[str, object], delta: dict[str, object]) -> None:
    """Fold one streamed delta into the message built so far (see :class:`Reassembler`)."""
    for key, value in delta.items():
        if value is None:
            into.setdefault(key, None)
            continue
        current = into.get(key)
        if key == "tool_calls" and isinstance(value, list):
            # Built as {index: call} (an earlier "tool_calls": null left None); a list in body().
            calls: dict[int, dict[str, object]] = current if isinstance(current, dict) else {}
            into[key] = calls
            for call in value:
                if not isinstance(call, dict):
                    continue
                i = call.get("index")
                if not isinstance(i, int) or isinstance(i, bool):
                    # A server without indices: a call with an id starts a new one, the rest continue.
                    i = len(calls) if (call.get("id") or not calls) else max(calls)
                _merge_delta(calls.setdefault(i, {}), {k: v for k, v in call.items() if k != "index"})
        elif isinstance(value, str):
            if key in _IDENTITY_FIELDS:
                if current is None:
                    into[key] = value
            else:
                into[key] = (current if isinstance(current, str) else "") + value
        elif isinstance(value, dict):
            if not isinstance(current, dict):
                current = into[key] = {}
            _merge_delta(current, value)
        else:
            into[key] = value


class _Choice:
    """One choice's state in a :class:`Reassembler`: the merged chat message, the completion text, the
    other fields (last non-null value)."""

    __slots__ = ("message", "text", "fields")

    def __init__(self) -> None:
        self.message: dict[str, object] = {}
        self.text = ""
        self.fields: dict[str, object] = {}


class Reassembler:
    """Rebuilds the JSON answer a server gives a non-streamed call from the SSE stream of the same call.

    Chat deltas merge per choice ``index``: strings concatenate (``content``, ``reasoning_content``,
    ``refusal``, ``function.arguments``...) except identity fields (``id``, ``type``, ``role``,
    ``name``: first non-null wins); ``tool_calls`` merge by their ``index`` (dropped from the result);
    other choice fields (``finish_reason``, vLLM's ``stop_reason``) keep their last non-null value.
    ``content`` is null when only tool calls were generated; ``tool_calls`` is always a list, as vLLM
    answers. Completions concatenate ``text``. Top-level fields (``id``, ``created``, ``model``,
    ``system_fingerprint``...) keep their first non-null value; ``usage`` comes from the usage chunk.
    An ``{"error": ...}`` event (vLLM's mid-stream error) is kept as :attr:`error`.
    """

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.buf = bytearray()
        self.top: dict[str, object] = {}
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, object] | None = None
        self.error: dict[str, object] | None = None
        self.done = False

    def feed(self, chunk: bytes) -> int:
        """Take bytes of the stream; returns how many ``data:`` events they completed."""
        self.buf += chunk
        start = events = 0
        for m in SSE_SEPARATOR.finditer(self.buf):
            events += self._event(bytes(self.buf[start : m.start()]))
            start = m.end()
        if start:
            del self.buf[:start]
        return events

    def end(self) -> int:
        """The stream ended: whatever follows the last separator is a last event."""
        rest, self.buf = bytes(self.buf), bytearray()
        return self._event(rest) if rest.strip() else 0

    def _event(self, raw: bytes) -> int:
        lines = [line[5:] for line in raw.splitlines() if line.startswith(b"data:")]
        if not lines:
            return 0  # a comment, a keep-alive, an event: line alone
        data = b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines).strip()
        if data == b"[DONE]":
            self.done = True
            return 1
        try:
            obj = json.loads(data)
        except ValueError:
            raise BadEvent(f"the server sent an event that is not JSON: {data[:200]!r}") from None
        if not isinstance(obj, dict):
            raise BadEvent(f"the server sent an event that is not a JSON object: {data[:200]!r}")
        if isinstance(obj.get("error"), dict) and not obj.get("choices"):
            self.error = obj["error"]
            return 1
        if obj.get("object") == "error":  # older vLLM: the error fields at the top level
            self.error = {k: obj.get(k) for k in ("message", "type", "param", "code")}
            return 1
        for key, value in obj.items():
            if key not in _STREAM_ONLY_FIELDS and self.top.get(key) is None:
                self.top[key] = value
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                self._choice(choice)
        return 1

    def _choice(self, choice: dict[str, object]) -> None:
        i = choice.get("index", 0)
        i = i if isinstance(i, int) and not isinstance(i, bool) else 0
        state = self.choices.get(i)
        if state is None:
            state = self.choices[i] = _Choice()
        fields = state.fields
        for key, value in choice.items():
            if key in ("index", "logprobs"):
                continue
            if self.chat and key == "delta":
                if isinstance(value, dict):
                    _merge_delta(state.message, value)
            elif not self.chat and key == "text":
                if isinstance(value, str):
                    state.text += value
            elif value is not None or key not in fields:
                fields[key] = value

    def body(self) -> dict[str, object]:
        """The non-streamed answer (call after the stream ended with ``[DONE]`` and no error)."""
        choices = []
        for i in sorted(self.choices):
            state = self.choices[i]
            fields = dict(state.fields)
            out: dict[str, object] = {"index": i}
            if self.chat:
                msg = dict(state.message)
                role = msg.pop("role", None) or "assistant"
                content = msg.pop("content", None)
                calls = msg.pop("tool_calls", None)  # {index: call} (see _merge_delta), or None
                tool_calls = [calls[k] for k in sorted(calls)] if isinstance(calls, dict) else []
                if not content:  # nothing generated: null beside tool calls (or when never sent)
                    content = None if (tool_calls or content is None) else ""
                out["message"] = {"role": role, "content": content, **msg, "tool_calls": tool_calls}
            else:
                out["text"] = state.text
            out["logprobs"] = None
            out["finish_reason"] = fields.pop("finish_reason", None)
            out.update(fields)
            choices.append(out)
        top = dict(self.top)
        return {
            "id": top.pop("id", None),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": top.pop("created", None),
            "model": top.pop("model", None),
            "choices": choices,
            "usage": self.usage,
            **top,
        }

    def error_body(self) -> tuple[int, dict[str, object]]:
        """(status, body) of the error answer a server gives a non-streamed call that failed so."""
        error = self.error or {}
        code = error.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else 500
        return status, {"error": error}

