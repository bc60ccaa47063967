"""autogen-zp: AutoGen's OpenAI model client, admission-gated: every ``create`` / ``create_stream`` takes a
lease on a zp budget first.

:class:`ZPOpenAIChatCompletionClient` is an ``OpenAIChatCompletionClient`` whose ``AsyncOpenAI`` goes
through :func:`zp_client.wrap` (``budget=`` is the one extra argument; ``max_retries`` defaults to 0).
Install: ``pip install -e . -e integrations/autogen``. Example and what callers may rely on:
docs/integrations.md.

Visibility: every lease grant of a ``create`` / ``create_stream`` (one per attempt) is logged as a
:class:`ZPAdmissionEvent` (queue wait, leased blocks, ...) on autogen_core's ``EVENT_LOGGER_NAME`` logger,
at INFO, as AutoGen logs its own ``LLMCallEvent``: when the lease is granted, before the request is sent.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from zp_client import (
    AdmissionInfo,
    AdmissionOptions,
    Budget,
    Settings,
    call_scope,
    observe_admissions,
    openai_http_client,
)
from zp_client.errors import MissingIntegration
from zp_client.metrics import ZPMetrics

try:
    from autogen_core import EVENT_LOGGER_NAME, ComponentModel, MessageHandlerContext
    from autogen_core.models import CreateResult
    from autogen_ext.models.openai import OpenAIChatCompletionClient
    from autogen_ext.models.openai.config import OpenAIClientConfigurationConfigModel
except ImportError as _exc:  # the missing-framework test hides it from sys.modules
    raise MissingIntegration(
        f"autogen_zp needs autogen-ext[openai] ({_exc.name or _exc} could not be imported): "
        "pip install 'zp-client[autogen]', or install autogen-zp again (pip install -e integrations/autogen)"
    ) from _exc

__all__ = ["ZPAdmissionEvent", "ZPOpenAIChatCompletionClient"]

event_logger = logging.getLogger(EVENT_LOGGER_NAME)


@dataclass(frozen=True)
class ZPAdmissionEvent:
    """One lease grant of a model call, logged on ``logging.getLogger(autogen_core.EVENT_LOGGER_NAME)``.

    ``str(event)`` is its JSON, as for AutoGen's own events (``LLMCallEvent``): ``{"type": "ZPAdmission",
    "queue_wait_s": ..., "leased_blocks": ..., "held_blocks": ..., "priority": ..., "attempt": ...,
    "budget": ..., "policy": ..., "route": ..., "lease_id": ..., "agent_id": ...}``. ``admission`` is the
    :class:`zp_client.AdmissionInfo` itself; ``agent_id`` the AutoGen agent whose handler made the call
    (None outside one).
    """

    admission: AdmissionInfo
    agent_id: str | None = None

    @property
    def queue_wait_s(self) -> float:
        """Seconds the call waited in line for its KV blocks."""
        return self.admission.queue_wait_s

    @property
    def leased_blocks(self) -> int:
        """The blocks leased (the request's bound)."""
        return self.admission.leased_blocks

    @property
    def kwargs(self) -> dict[str, Any]:
        """The event's fields (AutoGen's events keep theirs in ``kwargs`` too)."""
        return {"type": "ZPAdmission", **self.admission.as_dict(), "agent_id": self.agent_id}

    def __str__(self) -> str:
        return json.dumps(self.kwargs)


def _log_admission(info: AdmissionInfo) -> None:
    """observe_admissions' callback: runs when the lease is granted, in the task that waited for it."""
    try:
        agent_id: str | None = str(MessageHandlerContext.agent_id())
    except RuntimeError:  # not inside an agent's message handler
        agent_id = None
    event_logger.info(ZPAdmissionEvent(info, agent_id))

# The HTTP responses opened while create_stream starts its request (AutoGen sends it from a task it
# creates then, which copies this context).
_opened: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("zp_autogen_opened", default=None)


async def _remember_response(response: Any) -> None:
    opened = _opened.get()
    if opened is not None:
        opened.append(response)


class ZPOpenAIChatCompletionClient(OpenAIChatCompletionClient):
    """``OpenAIChatCompletionClient`` whose every call is admitted on ``budget``.

    zp options are keywords beside the configuration: ``budget`` (required: a LocalBudget or
    RedisBudget), ``zp_settings``, ``zp_retry`` (a :class:`~zp_client.RetryPolicy`; default: built from
    ``zp_settings`` on the budget's shared retry budget; ``False``: no retries), ``zp_estimator``,
    ``zp_forecaster``, and ``zp_priority`` / ``zp_deadline`` / ``zp_route`` / ``zp_ttft_target`` /
    ``zp_tpot_target`` (default ``X-ZP-*`` headers; the targets in seconds, docs/admission.md#targets;
    they win over the same headers in the configuration's ``default_headers``; AutoGen's ``create``
    takes no per-call headers: ``extra_create_args`` refuses ``extra_headers``), ``zp_metrics`` (a
    :class:`~zp_client.ZPMetrics` recording every call's admission). ``max_retries`` defaults to 0.
    Load a dumped component admitted with :meth:`from_component`. Every lease grant of a call is logged
    as a :class:`ZPAdmissionEvent` on autogen_core's ``EVENT_LOGGER_NAME`` logger.
    """

    def __init__(
        self,
        *,
        budget: Budget,
        zp_settings: Settings | None = None,
        zp_retry: Any | None = None,
        zp_estimator: Any | None = None,
        zp_forecaster: Any | None = None,
        zp_priority: int | None = None,
        zp_deadline: float | None = None,
        zp_route: str | None = None,
        zp_metrics: ZPMetrics | None = None,
        zp_ttft_target: float | None = None,
        zp_tpot_target: float | None = None,
        **config: Any,
    ) -> None:
        opts = AdmissionOptions(budget=budget, settings=zp_settings, estimator=zp_estimator, retry=zp_retry,
                                forecaster=zp_forecaster, priority=zp_priority, deadline=zp_deadline,
                                route=zp_route, max_retries=config.get("max_retries") or 0,
                                metrics=zp_metrics, ttft_target=zp_ttft_target, tpot_target=zp_tpot_target)
        super().__init__(**config)
        self._zp_options = opts
        self._zp_original = self._client
        self._client = opts.admit(self._client)
        self._watch_responses()

    def _watch_responses(self) -> None:
        http = openai_http_client(self._client)  # the admitted client's own httpx / httpx2 client
        hooks = http.event_hooks
        if _remember_response not in hooks["response"]:
            hooks["response"] = [*hooks["response"], _remember_response]
            http.event_hooks = hooks

    async def create(self, *args: Any, **kwargs: Any) -> CreateResult:
        """``OpenAIChatCompletionClient.create``; each lease grant is logged as a
        :class:`ZPAdmissionEvent`."""
        call_scope()  # the caller's retry of a call zp gave up on is recognised across AutoGen's task
        with observe_admissions(_log_admission):  # AutoGen sends from a task it makes here, with this context
            return await super().create(*args, **kwargs)

    async def create_stream(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """``OpenAIChatCompletionClient.create_stream``, whose response is closed when the stream ends; each
        lease grant is logged as a :class:`ZPAdmissionEvent`.

        AutoGen cancels a stream (``CancellationToken.cancel()``) by cancelling the pending read only, and
        the token keeps that read, and so the open response, alive: the lease would be held until the
        token is dropped or the idle-stream timeout. Closing the response here releases it at once.
        """
        call_scope()  # as in create()
        inner = super().create_stream(*args, **kwargs)
        opened: list[Any] = []
        try:
            marker = _opened.set(opened)
            try:
                with observe_admissions(_log_admission):  # only this step, never across a yield
                    first = await inner.__anext__()  # sends the request
            except StopAsyncIteration:
                return
            finally:
                _opened.reset(marker)
            yield first
            async for item in inner:
                yield item
        finally:
            await inner.aclose()
            for response in opened:
                await response.aclose()

    @classmethod
    def from_component(
        cls, component: ComponentModel | dict[str, Any], *, budget: Budget, **zp_options: Any
    ) -> ZPOpenAIChatCompletionClient:
        """An admitted client from an ``OpenAIChatCompletionClient`` component (``dump_component()``).

        ``zp_options`` are the constructor's ``zp_*`` keywords.
        """
        model = (component if isinstance(component, ComponentModel)
                 else ComponentModel.model_validate(component))
        config = OpenAIClientConfigurationConfigModel.model_validate(model.config)
        kwargs = config.model_dump(exclude_none=True)
        if config.api_key is not None:
            kwargs["api_key"] = config.api_key.get_secret_value()
        return cls(budget=budget, **zp_options, **kwargs)

    async def close(self) -> None:
        await self._client.close()
        await self._zp_original.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_zp_original"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # rebuilds _client from the raw config
        self._zp_original = self._client
        self._client = self._zp_options.admit(self._client)
        self._watch_responses()
