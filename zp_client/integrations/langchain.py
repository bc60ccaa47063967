"""LangChain's OpenAI models, admission-gated: every call takes a lease on a zp budget first.

::

    from zp_client import LocalBudget
    from zp_client.integrations.langchain import ZPChatOpenAI

    budget = LocalBudget(limit_blocks=24_000)
    llm = ZPChatOpenAI(model="m", base_url="http://localhost:8000/v1", api_key="x", budget=budget,
                       max_tokens=512, zp_priority=1)
    llm.invoke("hi"); await llm.ainvoke("hi"); llm.stream(...); llm.bind_tools([...]).batch([...])

What callers may rely on:

- :class:`ZPChatOpenAI` (a ``langchain_openai.ChatOpenAI``) and :class:`ZPOpenAI` (a
  ``langchain_openai.OpenAI``, the completions LLM) build their openai clients exactly as their base
  classes do (base URL, key, timeout, proxies, LangChain's pooled HTTP client), then pass each through
  :func:`zp_client.wrap`. Sync and async calls, ``invoke`` / ``stream`` / ``batch`` / tool calling /
  structured output all go through the admission transport; the lease is held while the call runs
  (for a stream: until it ends or is abandoned) and released on every exit path, cancellation included.
- ``max_retries`` defaults to **0**: zp's retry policy (``zp_retry``, else the default built from
  ``zp_settings`` on the budget's shared retry budget; ``zp_retry=False``: none) is then the only retry loop, and it respects the lease and the retry budget. An
  explicit ``max_retries=n`` is honoured, but the SDK's retries run *around* zp's (each SDK attempt
  is a new admission with zp's retries inside), so attempts multiply. LangChain's
  ``.with_retry()`` runnable likewise sits outside zp.
- Cancelling an ``ainvoke`` / ``astream`` task releases its lease. Caveat (langchain-openai, not zp):
  its per-chunk stream timeout (``stream_chunk_timeout``, default 120 s) uses ``asyncio.wait_for``,
  which on Python < 3.12 can swallow a cancellation that races a chunk, so the stream runs to its end
  holding its lease; ``stream_chunk_timeout=0`` avoids it.
- ``zp_priority`` / ``zp_deadline`` / ``zp_route`` become the default ``X-ZP-Priority`` /
  ``X-ZP-Deadline`` / ``X-ZP-Route`` headers of every call; per call,
  ``llm.invoke(..., extra_headers={"X-ZP-Priority": "0"})`` overrides them. zp strips them before
  sending.
- A refusal by zp reaches the caller as zp's type (:class:`~zp_client.PromptTooLong`,
  :class:`~zp_client.LeaseTooLarge`, :class:`~zp_client.AdmissionTimeout`, ...; all
  :class:`~zp_client.ZPError`): LangChain re-wraps only ``openai.APIError``, which these are not.
- Errors in the zp options at construction (an invalid ``zp_settings``, a non-budget) surface as
  pydantic's ``ValidationError``, as for any LangChain model field.
- :func:`admit_langchain` returns an admitted copy of an existing ``ChatOpenAI`` / ``AzureChatOpenAI`` /
  ``OpenAI`` model; the original is not modified. Rebuilding a model from its fields (LangChain's
  ``configurable_fields`` does) keeps the admission of a :class:`ZPChatOpenAI` without stacking a
  second one; a model copied by :func:`admit_langchain` rebuilt that way is a plain, unadmitted model.
- The budget and the zp options are live objects and are not serialized: ``dumpd`` / ``to_json`` of
  these classes gives LangChain's "not implemented" stub.
- Works with openai 2.x (httpx) and 3.x (httpx2), whichever langchain-openai was installed against.

Needs ``pip install 'zp-client[langchain]'``; importing this module without it raises
:class:`~zp_client.integrations.MissingIntegration`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import Field, model_validator

from zp_client.budget.base import Budget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError
from zp_client.integrations import missing
from zp_client.integrations._openai import ZPOptions, admit

try:
    from langchain_openai import ChatOpenAI, OpenAI
    from langchain_openai.chat_models.base import BaseChatOpenAI
    from langchain_openai.llms.base import BaseOpenAI
except ImportError as _exc:  # the missing-extra test hides the framework from sys.modules
    raise missing("langchain-openai", "langchain", _exc) from _exc

try:
    from typing import Self
except ImportError:  # Python 3.10
    from typing_extensions import Self

__all__ = ["ZPChatOpenAI", "ZPOpenAI", "admit_langchain"]

M = TypeVar("M", bound="BaseChatOpenAI | BaseOpenAI")


def _admit_chat(model: BaseChatOpenAI, opts: ZPOptions) -> None:
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
        admitted = admit(root, opts)
        object.__setattr__(model, root_attr, admitted)
        object.__setattr__(model, res_attr, admitted.chat.completions)


def _admit_llm(model: BaseOpenAI, opts: ZPOptions) -> None:
    """The same for the completions LLM, whose fields hold ``client.completions`` resources."""
    for res_attr in ("client", "async_client"):
        resource = getattr(model, res_attr)
        if resource is None:
            continue
        root = getattr(resource, "_client", None)
        if root is None:
            raise ConfigurationError(
                f"{type(model).__name__}.{res_attr} is not an openai completions resource; zp cannot admit it"
            )
        object.__setattr__(model, res_attr, admit(root, opts).completions)


def _options(model: Any) -> ZPOptions:
    return ZPOptions(
        budget=model.budget,
        settings=model.zp_settings,
        estimator=model.zp_estimator,
        retry=model.zp_retry,
        forecaster=model.zp_forecaster,
        priority=model.zp_priority,
        deadline=model.zp_deadline,
        route=model.zp_route,
        max_retries=model.max_retries or 0,
    )


class ZPChatOpenAI(ChatOpenAI):
    """``langchain_openai.ChatOpenAI`` whose every call is admitted on ``budget`` (see the module doc).

    Fields beyond ChatOpenAI's: ``budget`` (required: a LocalBudget or RedisBudget), ``zp_settings``
    (:class:`~zp_client.Settings`), ``zp_retry`` (:class:`~zp_client.RetryPolicy`), ``zp_estimator``,
    ``zp_forecaster`` (elastic budgets), ``zp_priority`` (lower = earlier), ``zp_deadline`` (seconds for
    queueing plus every attempt) and ``zp_route`` (the forecaster's key). ``max_retries`` defaults to 0.
    """

    budget: Budget = Field(exclude=True)
    zp_settings: Settings | None = Field(default=None, exclude=True)
    zp_retry: Any | None = Field(default=None, exclude=True)
    zp_estimator: Any | None = Field(default=None, exclude=True)
    zp_forecaster: Any | None = Field(default=None, exclude=True)
    zp_priority: int | None = Field(default=None, exclude=True)
    zp_deadline: float | None = Field(default=None, gt=0, exclude=True)
    zp_route: str | None = Field(default=None, exclude=True)
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


class ZPOpenAI(OpenAI):
    """``langchain_openai.OpenAI`` (the completions LLM) admitted on ``budget``; fields as :class:`ZPChatOpenAI`."""

    budget: Budget = Field(exclude=True)
    zp_settings: Settings | None = Field(default=None, exclude=True)
    zp_retry: Any | None = Field(default=None, exclude=True)
    zp_estimator: Any | None = Field(default=None, exclude=True)
    zp_forecaster: Any | None = Field(default=None, exclude=True)
    zp_priority: int | None = Field(default=None, exclude=True)
    zp_deadline: float | None = Field(default=None, gt=0, exclude=True)
    zp_route: str | None = Field(default=None, exclude=True)
    max_retries: int = 0
    """Retries of the openai SDK, around zp's own; 0 (the default) leaves retrying to zp."""

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    @model_validator(mode="after")
    def _zp_admit_clients(self) -> Self:
        _admit_llm(self, _options(self))
        return self


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
    **setting_overrides: Any,
) -> M:
    """A copy of ``model`` (``ChatOpenAI``, ``AzureChatOpenAI``, ``OpenAI``, ...) admitted on ``budget``.

    Like :func:`zp_client.wrap` for openai clients: ``settings`` (or keyword overrides of its fields,
    e.g. ``default_max_tokens=1024``), ``estimator``, ``retry`` and ``forecaster`` configure the
    admission transport; ``priority`` / ``deadline`` / ``route`` become default zp headers. The copy's
    ``max_retries`` is ``max_retries`` (default 0, leaving retries to zp). ``model`` is not modified and
    shares its connection pool with the copy.
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
        except Exception as exc:
            raise ConfigurationError(f"invalid zp option for admit_langchain(): {exc}") from None
    opts = ZPOptions(budget=budget, settings=settings, estimator=estimator, retry=retry, forecaster=forecaster,
                     priority=priority, deadline=deadline, route=route, max_retries=max_retries)
    copy = model.model_copy(update={"max_retries": max_retries})
    if isinstance(copy, BaseChatOpenAI):
        _admit_chat(copy, opts)
    else:
        _admit_llm(copy, opts)
    return copy
