"""langchain-zp: LangChain's OpenAI models, admission-gated: every call takes a lease on a zp budget first.

    llm = ZPChatOpenAI(model="m", base_url="http://localhost:8000/v1", api_key="x", budget=budget)

:class:`ZPChatOpenAI`, :class:`ZPOpenAI` and :func:`admit_langchain` pass their openai clients through
:func:`zp_client.wrap`; ``max_retries`` defaults to 0. Install: ``pip install -e . -e
integrations/langchain``. What callers may rely on: docs/integrations.md.

Visibility: :class:`ZPChatOpenAI` and :class:`ZPOpenAI` report every call's admission where LangChain's
users look. Each lease grant (one per attempt) is dispatched to the run's callback handlers as the custom
event ``"zp_admission"`` (:data:`ADMISSION_EVENT`; ``on_custom_event`` receives the LLM run's ``run_id``
and :meth:`zp_client.AdmissionInfo.as_dict` as ``data``), and the call's
:func:`zp_client.summarize_admissions` goes into its generations' ``generation_info`` (so a chat
message's ``response_metadata``) under ``"zp_admission"`` (:data:`ADMISSION_KEY`), which tracers record
as the run's output (``on_llm_end``'s ``LLMResult``). A stream carries it on its first chunk.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar, cast

from pydantic import Field, model_validator

from zp_client import AdmissionInfo, AdmissionOptions, Budget, Settings, call_scope, openai_client_of
from zp_client._integration import ZPModelFields
from zp_client._repeat import call_key
from zp_client.errors import ConfigurationError, MissingIntegration
from zp_client.metrics import ZPMetrics
from zp_client.observe import observe_admissions, summarize_admissions

try:
    from langchain_core.callbacks.manager import (
        AsyncCallbackManager,
        AsyncCallbackManagerForLLMRun,
        CallbackManager,
        CallbackManagerForLLMRun,
    )
    from langchain_core.language_models import LanguageModelInput
    from langchain_core.messages import AIMessageChunk, BaseMessage
    from langchain_core.outputs import (
        ChatGenerationChunk,
        ChatResult,
        Generation,
        GenerationChunk,
        LLMResult,
    )
    from langchain_core.runnables import RunnableConfig, ensure_config
    from langchain_core.runnables.config import var_child_runnable_config
    from langchain_openai import ChatOpenAI, OpenAI
    from langchain_openai.chat_models.base import BaseChatOpenAI
    from langchain_openai.llms.base import BaseOpenAI
except ImportError as _exc:  # the missing-framework test hides it from sys.modules
    raise MissingIntegration(
        f"langchain_zp needs langchain-openai ({_exc.name or _exc} could not be imported): "
        "pip install 'zp-client[langchain]', or install langchain-zp again "
        "(pip install -e integrations/langchain)"
    ) from _exc

if sys.version_info >= (3, 11):
    from typing import Self
else:
    from typing_extensions import Self

__all__ = ["ADMISSION_EVENT", "ADMISSION_KEY", "ZPChatOpenAI", "ZPOpenAI", "admit_langchain"]

ADMISSION_EVENT = "zp_admission"
"""The name of the custom event each lease grant is dispatched as (``on_custom_event``'s ``name``)."""
ADMISSION_KEY = "zp_admission"
"""The key of a call's admission summary in ``generation_info`` / ``response_metadata``."""

M = TypeVar("M", bound="BaseChatOpenAI | BaseOpenAI")


def _admit_chat(model: BaseChatOpenAI, opts: AdmissionOptions) -> None:
    """Replace ``model``'s openai clients (built by its validator) with admitted ones, in place."""
    for root_attr, res_attr in (("root_client", "client"), ("root_async_client", "async_client")):
        root = getattr(model, root_attr)
        if root is None:
            if getattr(model, res_attr) is not None:
                raise ConfigurationError(
                    f"{type(model).__name__} was given its own {res_attr!r} without {root_attr!r}; zp "
                    "cannot admit it. Let the model build its clients (pass base_url, api_key, http_client "
                    "instead)"
                )
            continue  # e.g. no sync API key: the base class fails the call with its own message
        admitted = opts.admit(root)
        object.__setattr__(model, root_attr, admitted)
        object.__setattr__(model, res_attr, admitted.chat.completions)


def _admit_llm(model: BaseOpenAI, opts: AdmissionOptions) -> None:
    """The same for the completions LLM, whose fields hold ``client.completions`` resources."""
    for res_attr in ("client", "async_client"):
        resource = getattr(model, res_attr)
        if resource is None:
            continue
        try:
            root = openai_client_of(resource)
        except ConfigurationError:
            raise ConfigurationError(
                f"{type(model).__name__}.{res_attr} is not an openai completions resource; zp cannot admit it"
            ) from None
        object.__setattr__(model, res_attr, opts.admit(root).completions)


class _ZPFields(ZPModelFields):
    """zp's fields (:class:`~zp_client._integration.ZPModelFields`), the seconds constrained: LangChain
    models report a bad field as ``pydantic.ValidationError`` naming it, at construction."""

    zp_deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False, exclude=True)
    zp_ttft_target: float | None = Field(default=None, gt=0, allow_inf_nan=False, exclude=True)
    zp_tpot_target: float | None = Field(default=None, gt=0, allow_inf_nan=False, exclude=True)


def _options(model: ZPChatOpenAI | ZPOpenAI) -> AdmissionOptions:
    return model.zp_options(max_retries=model.max_retries or 0)


# ---------------------------------------------------------------------------------------- visibility
#
# The admission happens inside the openai call that _generate / _stream make, so those are wrapped in an
# observe_admissions() scope (a stream's per step: a scope must never stay open across a yield, or it
# would see what the consumer does between chunks). The records are reported to the run's callback
# handlers: _generate gets its run manager; _stream gets one only from some callers, so stream() /
# astream() and _generate_with_cache() (the ``streaming=True`` path) leave the run's target in a
# context variable for the step in progress.


class _Target:
    """Where one LangChain run's custom events go: its handlers and its run id. The callback manager is
    built on the first event, so a call that reports nothing costs nothing more."""

    __slots__ = ("run_id", "is_async", "_build", "_manager")

    def __init__(self, run_id: uuid.UUID, is_async: bool, build: Any) -> None:
        self.run_id = run_id
        self.is_async = is_async
        self._build = build
        self._manager: Any = None

    @classmethod
    def of(cls, rm: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None) -> _Target | None:
        """The run of a run manager (what _generate and some callers of _stream are given)."""
        if rm is None:
            return None
        is_async = isinstance(rm, AsyncCallbackManagerForLLMRun)
        manager_cls = AsyncCallbackManager if is_async else CallbackManager

        def build() -> Any:
            return manager_cls(handlers=rm.handlers, inheritable_handlers=rm.inheritable_handlers,
                               parent_run_id=rm.parent_run_id, tags=rm.tags,
                               inheritable_tags=rm.inheritable_tags, metadata=rm.metadata,
                               inheritable_metadata=rm.inheritable_metadata)

        return cls(rm.run_id, is_async, build)

    @classmethod
    def for_stream(cls, model: Any, config: RunnableConfig | None, *,
                   is_async: bool) -> tuple[RunnableConfig, _Target]:
        """stream() / astream() of a chat model make their run manager themselves and do not pass it to
        _stream: pin the run's id in its config, and configure the same handlers (as LangChain does)."""
        config = ensure_config(config)
        run_id = config.get("run_id") or uuid.uuid4()
        config["run_id"] = run_id
        manager_cls = AsyncCallbackManager if is_async else CallbackManager

        def build() -> Any:
            return manager_cls.configure(config.get("callbacks"), model.callbacks, model.verbose,
                                         config.get("tags"), model.tags, config.get("metadata"),
                                         model.metadata)

        return config, cls(run_id, is_async, build)

    def _handlers(self) -> Any:
        if self._manager is None:
            self._manager = self._build()
        return self._manager

    def emit(self, records: list[AdmissionInfo]) -> None:
        if self.is_async:  # not reachable from a sync call; nothing to await on here
            return
        manager = self._handlers()
        for info in records:
            manager.on_custom_event(ADMISSION_EVENT, info.as_dict(), run_id=self.run_id)

    async def aemit(self, records: list[AdmissionInfo]) -> None:
        manager = self._handlers()
        for info in records:
            if self.is_async:
                await manager.on_custom_event(ADMISSION_EVENT, info.as_dict(), run_id=self.run_id)
            else:
                manager.on_custom_event(ADMISSION_EVENT, info.as_dict(), run_id=self.run_id)


# The run whose step is in progress (set by stream() / astream() / _generate_with_cache()), and whether an
# outer wrapper of the same call already observes it (then inner ones pass through: one report per call).
_run_target: contextvars.ContextVar[_Target | None] = contextvars.ContextVar("zp_lc_run", default=None)
_reporting: contextvars.ContextVar[bool] = contextvars.ContextVar("zp_lc_reporting", default=False)


def _with_target(inner: Iterator[Any], target: _Target, key: str | None = None) -> Iterator[Any]:
    """``inner``, each step run with ``target`` as the run in progress (and ``key`` as its call key)."""
    try:
        while True:
            token = _run_target.set(target)
            try:
                with call_key(key):
                    item = next(inner)
            except StopIteration:
                return
            finally:
                _run_target.reset(token)
            yield item
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()


async def _awith_target(inner: AsyncIterator[Any], target: _Target,
                        key: str | None = None) -> AsyncIterator[Any]:
    try:
        while True:
            token = _run_target.set(target)
            try:
                with call_key(key):
                    item = await inner.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _run_target.reset(token)
            yield item
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()


def _graph_key(config: RunnableConfig | None = None) -> str | None:
    """The logical-call key of a call made from a LangGraph node: its task id, the same for every attempt
    of the node that LangGraph's ``RetryPolicy`` makes (each attempt runs in a fresh copy of the context
    taken before the first, where zp's record of the failed attempt is not: zp_client._repeat). None
    outside LangGraph. Read from the run's config (LangChain's context variable when none is passed)."""
    for cfg in (config, var_child_runnable_config.get()):
        task = ((cfg or {}).get("configurable") or {}).get("__pregel_task_id")
        if task:
            return f"langgraph:{task}"
    return None


def _annotate(generation: Generation, summary: dict[str, Any]) -> None:
    """Put a call's admission summary on one generation (and its message, for a chat generation)."""
    generation.generation_info = {**(generation.generation_info or {}), ADMISSION_KEY: summary}
    message = getattr(generation, "message", None)
    if isinstance(message, BaseMessage):
        message.response_metadata = {**message.response_metadata, ADMISSION_KEY: summary}


def _forget_admission(result: ChatResult) -> None:
    """Drop an admission summary a cached answer replays (it was the cached call's, not this one's)."""
    for g in result.generations:
        if g.generation_info and ADMISSION_KEY in g.generation_info:
            g.generation_info = {k: v for k, v in g.generation_info.items() if k != ADMISSION_KEY}
        if ADMISSION_KEY in g.message.response_metadata:
            g.message.response_metadata = {k: v for k, v in g.message.response_metadata.items()
                                           if k != ADMISSION_KEY}


def _annotate_result(result: ChatResult | LLMResult, records: list[AdmissionInfo]) -> None:
    summary = summarize_admissions(records)
    if isinstance(result, LLMResult):
        for generations in result.generations:
            for g in generations:
                _annotate(g, summary)
        result.llm_output = {**(result.llm_output or {}), ADMISSION_KEY: summary}
    else:
        for cg in result.generations:
            _annotate(cg, summary)


class _Step:
    """A stream's reporting state: what was dispatched, whether a chunk carries the summary yet."""

    __slots__ = ("records", "sent", "annotated")

    def __init__(self) -> None:
        self.records: list[AdmissionInfo] = []
        self.sent = 0
        self.annotated = False

    def new(self) -> list[AdmissionInfo]:
        fresh = self.records[self.sent:]
        self.sent = len(self.records)
        return fresh

    def annotate(self, chunk: Any) -> None:
        # One chunk only: LangChain merges chunks' metadata, and two summaries would not merge.
        if self.records and not self.annotated and isinstance(chunk, Generation):
            self.annotated = True
            _annotate(chunk, summarize_admissions(self.records))


R = TypeVar("R", ChatResult, LLMResult)
T = TypeVar("T")


def _generate_reported(call: Callable[[], R], rm: CallbackManagerForLLMRun | None) -> R:
    """``call()`` (a _generate), its admissions dispatched to the run and put on its generations."""
    if _reporting.get():  # an outer wrapper of the same call reports it
        return call()
    target = _Target.of(rm) or _run_target.get()
    token = _reporting.set(True)
    try:
        with observe_admissions() as seen:
            try:
                result = call()
            finally:  # a call that failed after its admission still waited for it
                if seen and target is not None:
                    target.emit(seen)
    finally:
        _reporting.reset(token)
    if seen:
        _annotate_result(result, seen)
    return result


async def _agenerate_reported(call: Callable[[], Awaitable[R]],
                              rm: AsyncCallbackManagerForLLMRun | None) -> R:
    if _reporting.get():
        return await call()
    target = _Target.of(rm) or _run_target.get()
    token = _reporting.set(True)
    try:
        with observe_admissions() as seen:
            try:
                result = await call()
            finally:
                if seen and target is not None:
                    await target.aemit(seen)
    finally:
        _reporting.reset(token)
    if seen:
        _annotate_result(result, seen)
    return result


def _stream_reported(inner: Iterator[T], rm: CallbackManagerForLLMRun | None) -> Iterator[T]:
    """``inner`` (a _stream), its admissions dispatched as they happen and put on the chunk that follows."""
    if _reporting.get():
        return inner
    return _reported_steps(inner, _Target.of(rm) or _run_target.get())


def _reported_steps(inner: Iterator[T], target: _Target | None) -> Iterator[T]:
    step = _Step()
    try:
        while True:
            token = _reporting.set(True)
            try:
                with observe_admissions() as seen:
                    try:
                        chunk = next(inner)
                    except StopIteration:
                        return
                    finally:
                        step.records.extend(seen)
                        fresh = step.new()
                        if fresh and target is not None:
                            target.emit(fresh)
            finally:
                _reporting.reset(token)
            step.annotate(chunk)
            yield chunk
    finally:
        close = getattr(inner, "close", None)
        if close is not None:
            close()


def _astream_reported(inner: AsyncIterator[T], rm: AsyncCallbackManagerForLLMRun | None) -> AsyncIterator[T]:
    if _reporting.get():
        return inner
    return _areported_steps(inner, _Target.of(rm) or _run_target.get())


async def _areported_steps(inner: AsyncIterator[T], target: _Target | None) -> AsyncIterator[T]:
    step = _Step()
    try:
        while True:
            token = _reporting.set(True)
            try:
                with observe_admissions() as seen:
                    try:
                        chunk = await inner.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        step.records.extend(seen)
                        fresh = step.new()
                        if fresh and target is not None:
                            await target.aemit(fresh)
            finally:
                _reporting.reset(token)
            step.annotate(chunk)
            yield chunk
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()


class ZPChatOpenAI(ChatOpenAI, _ZPFields):
    """``langchain_openai.ChatOpenAI`` whose every call is admitted on ``budget`` (see the module doc).

    Fields beyond ChatOpenAI's: ``budget`` (required: a LocalBudget or RedisBudget), ``zp_settings``
    (:class:`~zp_client.Settings`), ``zp_retry`` (:class:`~zp_client.RetryPolicy`), ``zp_estimator``,
    ``zp_forecaster`` (elastic budgets), ``zp_priority`` (lower = earlier), ``zp_deadline`` (seconds for
    queueing plus every attempt), ``zp_route`` (the forecaster's key), ``zp_ttft_target`` /
    ``zp_tpot_target`` (the calls' TTFT / TPOT targets in seconds, which the budget's line may order by;
    docs/admission.md#targets) and ``zp_metrics`` (a :class:`~zp_client.ZPMetrics` recording every call's
    admission). ``max_retries`` defaults to 0. A per-call ``extra_headers`` wins over these defaults.

    Every call reports its admission: a ``"zp_admission"`` custom event per lease grant to the run's
    callbacks, and ``response_metadata["zp_admission"]`` / ``generation_info`` (see the module doc).
    """

    max_retries: int | None = 0
    """Retries of the openai SDK, around zp's own; 0 (the default) leaves retrying to zp."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False  # the budget is a live object

    # A unique name: pydantic replaces (does not chain) a parent's validator of the same name. After
    # validators run parent-first, so ChatOpenAI's validate_environment has built the clients here.
    @model_validator(mode="after")
    def _zp_admit_clients(self) -> Self:
        _admit_chat(self, _options(self))
        return self

    # -- one retry loop: LangChain sends each prompt from a task of its own (agenerate gathers them), so
    # the caller's context is made a call scope first: a retry of a call zp gave up on is recognised
    def generate(self, *args: Any, **kwargs: Any) -> LLMResult:
        call_scope()
        with call_key(_graph_key()):
            return super().generate(*args, **kwargs)

    async def agenerate(self, *args: Any, **kwargs: Any) -> LLMResult:
        call_scope()
        with call_key(_graph_key()):
            return await super().agenerate(*args, **kwargs)

    # -- visibility (see the module docstring): each entry point that makes the HTTP call is wrapped
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return _generate_reported(functools.partial(super()._generate, messages, stop, run_manager, **kwargs),
                                  run_manager)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        return await _agenerate_reported(
            functools.partial(super()._agenerate, messages, stop, run_manager, **kwargs), run_manager)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        return _stream_reported(super()._stream(messages, stop, run_manager, **kwargs), run_manager)

    def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        return _astream_reported(super()._astream(messages, stop, run_manager, **kwargs), run_manager)

    # stream() / astream() and _generate_with_cache() (an invoke that streams: streaming=True,
    # astream_events) call _stream without the run manager: they leave the run's target for it
    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        call_scope()  # as in generate()
        config, target = _Target.for_stream(self, config, is_async=False)
        key = _graph_key(config)
        return _with_target(super().stream(input, config, stop=stop, **kwargs), target, key)

    def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                stop: list[str] | None = None, **kwargs: Any) -> AsyncIterator[AIMessageChunk]:
        call_scope()  # as in generate()
        config, target = _Target.for_stream(self, config, is_async=True)
        key = _graph_key(config)
        return _awith_target(super().astream(input, config, stop=stop, **kwargs), target, key)

    def _generate_with_cache(self, messages: list[BaseMessage], stop: list[str] | None = None,
                             run_manager: CallbackManagerForLLMRun | None = None,
                             **kwargs: Any) -> ChatResult:
        token = _run_target.set(_Target.of(run_manager))
        try:
            with observe_admissions() as seen:
                result = super()._generate_with_cache(messages, stop=stop, run_manager=run_manager, **kwargs)
        finally:
            _run_target.reset(token)
        if not seen:  # answered from LangChain's cache: not this call's admission
            _forget_admission(result)
        return result

    async def _agenerate_with_cache(self, messages: list[BaseMessage], stop: list[str] | None = None,
                                    run_manager: AsyncCallbackManagerForLLMRun | None = None,
                                    **kwargs: Any) -> ChatResult:
        token = _run_target.set(_Target.of(run_manager))
        try:
            with observe_admissions() as seen:
                result = await super()._agenerate_with_cache(messages, stop=stop, run_manager=run_manager,
                                                             **kwargs)
        finally:
            _run_target.reset(token)
        if not seen:
            _forget_admission(result)
        return result


class ZPOpenAI(OpenAI, _ZPFields):
    """``langchain_openai.OpenAI`` (the completions LLM) admitted on ``budget``; fields and admission
    reports as in :class:`ZPChatOpenAI` (the summary also in the result's ``llm_output``)."""

    max_retries: int = 0
    """Retries of the openai SDK, around zp's own; 0 (the default) leaves retrying to zp."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    @model_validator(mode="after")
    def _zp_admit_clients(self) -> Self:
        _admit_llm(self, _options(self))
        return self

    # -- one retry loop: as in ZPChatOpenAI
    def generate(self, *args: Any, **kwargs: Any) -> LLMResult:
        call_scope()
        with call_key(_graph_key()):
            return super().generate(*args, **kwargs)

    async def agenerate(self, *args: Any, **kwargs: Any) -> LLMResult:
        call_scope()
        with call_key(_graph_key()):
            return await super().agenerate(*args, **kwargs)

    # -- visibility (see the module docstring); BaseLLM passes the run manager everywhere
    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        return _generate_reported(functools.partial(super()._generate, prompts, stop, run_manager, **kwargs),
                                  run_manager)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> LLMResult:
        return await _agenerate_reported(
            functools.partial(super()._agenerate, prompts, stop, run_manager, **kwargs), run_manager)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        return _stream_reported(super()._stream(prompt, stop, run_manager, **kwargs), run_manager)

    def _astream(self, prompt: str, stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        return _astream_reported(super()._astream(prompt, stop, run_manager, **kwargs), run_manager)


def admit_langchain(
    model: M,
    budget: Budget,
    *,
    settings: Settings | None = None,
    estimator: Any | None = None,
    retry: Any | None = None,
    forecaster: Any | None = None,
    priority: int | None = None,
    deadline: float | None = None,
    route: str | None = None,
    max_retries: int = 0,
    metrics: ZPMetrics | None = None,
    ttft_target: float | None = None,
    tpot_target: float | None = None,
    **setting_overrides: Any,
) -> M:
    """A copy of ``model`` (``ChatOpenAI``, ``AzureChatOpenAI``, ``OpenAI``, ...) admitted on ``budget``.

    Like :func:`zp_client.wrap` for openai clients: ``settings`` (or keyword overrides of its fields,
    e.g. ``default_max_tokens=1024``), ``estimator``, ``retry`` and ``forecaster`` configure the
    admission transport; ``priority`` / ``deadline`` / ``route`` / ``ttft_target`` / ``tpot_target``
    become default zp headers (docs/admission.md#targets); ``metrics`` (a
    :class:`~zp_client.ZPMetrics`) records every call's admission. The copy's
    ``max_retries`` is ``max_retries`` (default 0, leaving retries to zp). ``model`` is not modified and
    shares its connection pool with the copy. The copy is of ``model``'s own class, so it does not report
    its admissions in callbacks or metadata as :class:`ZPChatOpenAI` does; wrap its calls in
    :func:`zp_client.observe_admissions` to see them.
    """
    if not isinstance(model, (BaseChatOpenAI, BaseOpenAI)):
        raise ConfigurationError(
            "admit_langchain() takes a langchain_openai chat model or LLM (ChatOpenAI, AzureChatOpenAI, "
            f"OpenAI), got {type(model).__name__}; for other models pass zp's admission transport as their "
            "http client"
        )
    if setting_overrides:
        base = settings.model_dump() if settings is not None else {}
        try:
            settings = Settings(**{**base, **setting_overrides})
        except ValueError as exc:  # pydantic's ValidationError
            raise ConfigurationError(f"invalid zp option for admit_langchain(): {exc}") from None
    opts = AdmissionOptions(budget=budget, settings=settings, estimator=estimator, retry=retry,
                            forecaster=forecaster, priority=priority, deadline=deadline, route=route,
                            max_retries=max_retries, metrics=metrics, ttft_target=ttft_target,
                            tpot_target=tpot_target)
    # model_copy returns Self, which mypy widens to M's bound for a type variable
    copy = cast(M, model.model_copy(update={"max_retries": max_retries}))
    if isinstance(copy, BaseChatOpenAI):
        _admit_chat(copy, opts)
    else:
        _admit_llm(copy, opts)
    return copy
