"""Delivery: the response handed to the caller, streaming, and learning from usage.

A streamed body goes to the caller through a body class of the HTTP library
(:mod:`zp_client._admission.httplib`) that owns the lease and reports back through the
:class:`~zp_client._admission.loop_ports.BodyObserver` port, which :class:`Delivery` implements; a
non-streamed call sent upstream as a stream is read here to its end and reassembled. Usage learnt at the
end goes to the estimator's calibration and the length forecaster.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import cast

from zp_client._admission.actions import Action, Close, Peek, Prefetched, ReadAll, Release
from zp_client._admission.parts import Parts
from zp_client._admission.plan import Plan
from zp_client._admission.ports import CensorsLengths, HttpRequest, HttpResponse, Placed
from zp_client._admission.release import Holder, watchdog
from zp_client._sse import BadEvent, Reassembler, Scanner
from zp_client.budget.base import Lease
from zp_client.errors import ZPError

__all__ = ["Delivery", "mark", "is_answered", "is_incomplete"]

logger = logging.getLogger("zp_client.transport")

_ANSWERED = "_zp_answered"
_INCOMPLETE = "_zp_incomplete"


def mark(exc: BaseException, *, incomplete: bool, answered: bool) -> None:
    """Mark a transport error: ``incomplete`` (the server ended the answer: a fleet does not move the
    request) and ``answered`` (the server generated it: not retried either)."""
    exc.__dict__[_INCOMPLETE] = incomplete
    exc.__dict__[_ANSWERED] = answered


def is_answered(exc: BaseException) -> bool:
    """The server answered the attempt that failed with ``exc``: only its caller may retry it."""
    return bool(exc.__dict__.get(_ANSWERED, False))


def is_incomplete(exc: BaseException) -> bool:
    """The server ended the answer that failed with ``exc``: moving it to another replica redoes it."""
    return bool(exc.__dict__.get(_INCOMPLETE, False))


class Delivery:
    """Hands responses to the caller and learns from them (one per core)."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts

    # -- errors -------------------------------------------------------------------------------------
    def surface(self, exc: BaseException) -> BaseException:
        """The error the caller sees for a zp error (wrap() makes it openai-compatible)."""
        convert = self._parts.convert_error
        if isinstance(exc, ZPError) and convert is not None:
            return convert(exc)
        return exc

    def stream_cut(self, lease: Lease, exc: BaseException) -> BaseException | None:
        """The error a caller reading a fleet replica's stream gets when the connection failed under it
        (a :class:`~zp_client.errors.StreamCut`; through ``wrap()`` also an ``openai.OpenAIError``), after
        telling the fleet; None outside a fleet or for other errors (a timeout, a decoding error: those
        surface as they are)."""
        fleet = self._parts.fleet
        if fleet is None:
            return None
        from zp_client.retry import classify_error

        if classify_error(exc) is None or type(exc).__name__ in ("ReadTimeout", "PoolTimeout"):
            return None
        from zp_client.errors import StreamCut

        replica = lease.replica if isinstance(lease, Placed) else None
        fleet.note_failure(lease)
        cut = StreamCut(f"the stream from replica {replica} was cut after it started ({type(exc).__name__}: "
                        f"{exc}); the answer is incomplete")
        cut.replica = replica
        return self.surface(cut)  # through wrap(): also an openai.OpenAIError, which openai passes on

    # -- handing the response over ------------------------------------------------------------------
    def peek(self, resp: HttpResponse,
             deadline: float | None = None) -> Generator[Action, object, Prefetched]:
        """The body's first chunk and the rest (:class:`Peek`); on failure the response is closed first
        (the server sees the disconnect) and the error goes on to the attempt loop."""
        try:
            got = yield Peek(resp, deadline)
        except BaseException:
            yield Close(resp, shield=True)
            raise
        return cast(Prefetched, got)  # the driver's (chunk, rest) pair

    def deliver(self, plan: Plan, resp: HttpResponse, holder: Holder, is_async: bool,
                prefetched: Prefetched | None = None) -> Generator[Action, object, HttpResponse]:
        """The response handed to the caller: its body streams through a scanner that owns the lease
        (``prefetched``: its first chunk and the rest, when :class:`Peek` read it already)."""
        lib = self._parts.lib
        scanner = self.scanner_for(plan, resp, holder.lease)
        if lib.is_preread(resp):
            yield Release(holder)
            content = scanner.feed(resp.content) + scanner.flush()
            self.observe(plan, scanner)
            return lib.preread_response(resp, content, scanner.rewrites)
        holder.resp = resp
        watchdog.add(holder)
        return lib.streamed_response(resp, self, plan, holder, scanner, is_async=is_async,
                                     prefetched=prefetched)

    def consume(self, plan: Plan, original: HttpRequest, resp: HttpResponse, holder: Holder,
                first: Holder | None = None) -> Generator[Action, object, HttpResponse]:
        """Read the upstream stream of a non-streamed call to its end, reporting its growth; the lease is
        released once it is consumed. Any other exit (error, cancellation) closes the connection first,
        so the server aborts the request before the blocks return."""
        parts = self._parts
        module = parts.lib.module
        lease = holder.lease
        scanner = Scanner(plan, parts.budget.block_size, lease.bound, lease, True, parts.forecaster)
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
                raise module.DecodingError(str(exc), request=original) from None
            except Exception as exc:
                if answered:
                    raise self.cut_answer(original, exc) from exc
                raise
        except BaseException:
            yield Close(resp, shield=True)
            raise
        yield Release(holder)
        if asm.error is not None:
            status, payload = asm.error_body()
        elif not asm.done:
            incomplete = module.RemoteProtocolError(
                "the server ended the event stream without 'data: [DONE]': the answer is incomplete",
                request=original,
            )
            # not a failed connection: a fleet does not move it; the server generated it: not retried either
            mark(incomplete, incomplete=True, answered=answered)
            raise incomplete
        else:
            self.observe(plan, scanner)
            status, payload = 200, asm.body()
        return parts.lib.reassembled_response(resp, status, payload)

    def cut_answer(self, original: HttpRequest, exc: Exception) -> Exception:
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
            out = self._parts.lib.module.RemoteProtocolError(
                f"the server's answer was cut after it started ({type(exc).__name__}: {exc}); the answer "
                "is incomplete and is not retried (the server had started generating it)",
                request=original,
            )
        mark(out, incomplete=True, answered=True)
        return out

    # -- watching the body and learning from it -----------------------------------------------------
    def scanner_for(self, plan: Plan, resp: HttpResponse, lease: Lease) -> Scanner:
        parts = self._parts
        ctype = resp.headers.get("content-type", "")
        is_sse = plan.stream and ctype.startswith("text/event-stream")
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # A compressed body cannot be scanned without decoding it (vLLM never compresses SSE; a
            # proxy might). Growth is then not reported and an added usage chunk is not removed.
            if is_sse and parts.shared.once("compressed_event_stream"):
                logger.warning(
                    "server compressed an event stream (%s): zp cannot report its growth or remove the "
                    "usage chunk it asked for; turn compression off for text/event-stream",
                    encoding,
                )
            scanner = Scanner(plan, parts.budget.block_size, lease.bound, lease, False)
            scanner.body = None  # nor parse usage out of compressed bytes
            return scanner
        return Scanner(plan, parts.budget.block_size, lease.bound, lease, is_sse, parts.forecaster)

    def observe(self, plan: Plan, scanner: Scanner) -> None:
        """Learn from the response's usage, once (calibration and the length forecaster)."""
        if scanner.observed:
            return
        scanner.observed = True
        parts = self._parts
        try:
            usage = scanner.final_usage()
            if usage:
                # chat/completions say prompt_tokens; /responses says input_tokens
                prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
                if isinstance(prompt, int):
                    parts.estimator.observe(plan.estimate, prompt)
                if parts.forecaster is not None:
                    out = usage.get("completion_tokens", usage.get("output_tokens"))
                    if isinstance(out, int) and not isinstance(out, bool) and out >= 0:
                        # Per choice: what one sequence of this route produces.
                        per_choice = round(out / max(1, plan.n))
                        fc = parts.forecaster
                        if isinstance(fc, CensorsLengths) and fc.censored:
                            # ended at its bound: censored (it would have gone on)
                            fc.observe(plan.route, per_choice,
                                       capped=plan.max_tokens > 0 and per_choice >= plan.max_tokens)
                        else:
                            fc.observe(plan.route, per_choice)
                        if parts.metrics is not None and parts.elastic:
                            parts.metrics.forecast_missed(per_choice, plan.forecast)
        except Exception:  # calibration must never break a response
            logger.debug("usage reconciliation failed", exc_info=True)

    def observe_seen(self, plan: Plan, scanner: Scanner) -> None:
        """A stream closed before its body ended: learn only if its usage chunk already went by (SDKs
        stop reading at ``[DONE]`` and close; the usage chunk comes before it, so the answer was
        complete)."""
        if scanner.sse and scanner.usage is not None:
            self.observe(plan, scanner)
