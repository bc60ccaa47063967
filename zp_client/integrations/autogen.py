"""AutoGen's OpenAI model client, admission-gated: every ``create`` / ``create_stream`` takes a lease first.

::

    from zp_client import LocalBudget
    from zp_client.integrations.autogen import ZPOpenAIChatCompletionClient

    budget = LocalBudget(limit_blocks=24_000)
    model_client = ZPOpenAIChatCompletionClient(
        model="m", base_url="http://localhost:8000/v1", api_key="x", budget=budget,
        model_info={"vision": False, "function_calling": True, "json_output": True,
                    "family": "unknown", "structured_output": True},
    )
    agent = AssistantAgent("assistant", model_client=model_client)

What callers may rely on:

- :class:`ZPOpenAIChatCompletionClient` is an ``autogen_ext.models.openai.OpenAIChatCompletionClient``:
  it takes the same configuration, builds its ``AsyncOpenAI`` the same way, then passes it through
  :func:`zp_client.wrap`. ``create``, ``create_stream`` (tools, structured output, cancellation tokens)
  go through the admission transport; the lease is released on every exit path, cancellation of the
  task or of the ``CancellationToken`` included.
- zp options are keyword arguments beside the configuration: ``budget`` (required), ``zp_settings``,
  ``zp_retry``, ``zp_estimator``, ``zp_forecaster``, ``zp_priority``, ``zp_deadline``, ``zp_route``
  (the last three become default ``X-ZP-*`` headers; per call ``extra_create_args={"extra_headers":
  {...}}`` overrides them).
- ``max_retries`` defaults to **0** (the openai SDK's default is 2): zp's retry policy is the only retry
  loop (``zp_retry``, by default built from ``zp_settings`` on the budget's shared retry budget;
  ``zp_retry=False`` turns it off). An explicit ``max_retries`` is honoured; its retries run around zp's, so attempts multiply.
- A refusal by zp reaches the caller as zp's type (:class:`~zp_client.PromptTooLong`,
  :class:`~zp_client.LeaseTooLarge`, ...; all :class:`~zp_client.ZPError`).
- Component config: ``dump_component()`` gives the same config an ``OpenAIChatCompletionClient`` would
  (provider ``autogen_ext.models.openai.OpenAIChatCompletionClient``): the budget is a live object and
  is not serialized, so ``load_component`` of it is a plain, unadmitted client. Load it admitted with
  :meth:`ZPOpenAIChatCompletionClient.from_component`. Unpickling re-admits the rebuilt client; pickling
  needs a budget that pickles (a ``LocalBudget`` does not).
- ``create_stream`` closes its HTTP response when the stream ends for any reason, so a stream cancelled
  with a ``CancellationToken`` (AutoGen cancels only the pending read, and the token keeps it alive)
  releases its lease at once rather than when the token is dropped.
- ``close()`` closes the admitted client and the connection pool it shares with the one AutoGen built.

Needs ``pip install 'zp-client[autogen]'``; importing this module without it raises
:class:`~zp_client.integrations.MissingIntegration`.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncGenerator
from typing import Any

from zp_client.budget.base import Budget
from zp_client.config import Settings
from zp_client.integrations import missing
from zp_client.integrations._openai import ZPOptions, admit

try:
    from autogen_core import ComponentModel
    from autogen_ext.models.openai import OpenAIChatCompletionClient
    from autogen_ext.models.openai.config import OpenAIClientConfigurationConfigModel
except ImportError as _exc:  # the missing-extra test hides the framework from sys.modules
    raise missing("autogen-ext[openai]", "autogen", _exc) from _exc

__all__ = ["ZPOpenAIChatCompletionClient"]

# The HTTP responses opened while create_stream starts its request (AutoGen sends it from a task it
# creates then, which copies this context).
_opened: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("zp_autogen_opened", default=None)


async def _remember_response(response: Any) -> None:
    opened = _opened.get()
    if opened is not None:
        opened.append(response)


class ZPOpenAIChatCompletionClient(OpenAIChatCompletionClient):
    """``OpenAIChatCompletionClient`` whose every call is admitted on ``budget`` (see the module doc)."""

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
        **config: Any,
    ) -> None:
        opts = ZPOptions(budget=budget, settings=zp_settings, estimator=zp_estimator, retry=zp_retry,
                         forecaster=zp_forecaster, priority=zp_priority, deadline=zp_deadline, route=zp_route,
                         max_retries=config.get("max_retries") or 0)
        super().__init__(**config)
        self._zp_options = opts
        self._zp_original = self._client
        self._client = admit(self._client, opts)
        self._watch_responses()

    def _watch_responses(self) -> None:
        http = self._client._client  # the admitted client's own httpx / httpx2 client
        hooks = http.event_hooks
        if _remember_response not in hooks["response"]:
            hooks["response"] = [*hooks["response"], _remember_response]
            http.event_hooks = hooks

    async def create_stream(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:  # type: ignore[override]
        """``OpenAIChatCompletionClient.create_stream``, whose response is closed when the stream ends.

        AutoGen cancels a stream (``CancellationToken.cancel()``) by cancelling the pending read only, and
        the token keeps that read, and so the open response, alive: the lease would be held until the
        token is dropped or the idle-stream timeout. Closing the response here releases it at once.
        """
        inner = super().create_stream(*args, **kwargs)
        opened: list[Any] = []
        try:
            marker = _opened.set(opened)
            try:
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
        model = component if isinstance(component, ComponentModel) else ComponentModel.model_validate(component)
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
        self._client = admit(self._client, self._zp_options)
        self._watch_responses()
