"""langchain-zp: LangChain's OpenAI models, admission-gated: every call takes a lease on a zp budget first.

    llm = ZPChatOpenAI(model="m", base_url="http://localhost:8000/v1", api_key="x", budget=budget)

:class:`ZPChatOpenAI`, :class:`ZPOpenAI` and :func:`admit_langchain` pass their openai clients through
:func:`zp_client.wrap`; ``max_retries`` defaults to 0. Install: ``pip install -e . -e
integrations/langchain``. What callers may rely on: docs/integrations.md.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar, cast

from pydantic import Field, model_validator

from zp_client import AdmissionOptions, Budget, Settings, openai_client_of
from zp_client.errors import ConfigurationError, MissingIntegration
from zp_client.metrics import ZPMetrics

try:
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

__all__ = ["ZPChatOpenAI", "ZPOpenAI", "admit_langchain"]

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


def _options(model: Any) -> AdmissionOptions:
    return AdmissionOptions(
        budget=model.budget,
        settings=model.zp_settings,
        estimator=model.zp_estimator,
        retry=model.zp_retry,
        forecaster=model.zp_forecaster,
        priority=model.zp_priority,
        deadline=model.zp_deadline,
        route=model.zp_route,
        max_retries=model.max_retries or 0,
        metrics=model.zp_metrics,
    )


class ZPChatOpenAI(ChatOpenAI):
    """``langchain_openai.ChatOpenAI`` whose every call is admitted on ``budget`` (see the module doc).

    Fields beyond ChatOpenAI's: ``budget`` (required: a LocalBudget or RedisBudget), ``zp_settings``
    (:class:`~zp_client.Settings`), ``zp_retry`` (:class:`~zp_client.RetryPolicy`), ``zp_estimator``,
    ``zp_forecaster`` (elastic budgets), ``zp_priority`` (lower = earlier), ``zp_deadline`` (seconds for
    queueing plus every attempt), ``zp_route`` (the forecaster's key) and ``zp_metrics`` (a
    :class:`~zp_client.ZPMetrics` recording every call's admission). ``max_retries`` defaults to 0.
    """

    budget: Budget = Field(exclude=True)
    zp_settings: Settings | None = Field(default=None, exclude=True)
    zp_retry: Any | None = Field(default=None, exclude=True)
    zp_estimator: Any | None = Field(default=None, exclude=True)
    zp_forecaster: Any | None = Field(default=None, exclude=True)
    zp_priority: int | None = Field(default=None, exclude=True)
    zp_deadline: float | None = Field(default=None, gt=0, exclude=True)
    zp_route: str | None = Field(default=None, exclude=True)
    zp_metrics: ZPMetrics | None = Field(default=None, exclude=True)
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
    """``langchain_openai.OpenAI`` (the completions LLM) admitted on ``budget``; fields as in
    :class:`ZPChatOpenAI`."""

    budget: Budget = Field(exclude=True)
    zp_settings: Settings | None = Field(default=None, exclude=True)
    zp_retry: Any | None = Field(default=None, exclude=True)
    zp_estimator: Any | None = Field(default=None, exclude=True)
    zp_forecaster: Any | None = Field(default=None, exclude=True)
    zp_priority: int | None = Field(default=None, exclude=True)
    zp_deadline: float | None = Field(default=None, gt=0, exclude=True)
    zp_route: str | None = Field(default=None, exclude=True)
    zp_metrics: ZPMetrics | None = Field(default=None, exclude=True)
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
    metrics: ZPMetrics | None = None,
    **setting_overrides: Any,
) -> M:
    """A copy of ``model`` (``ChatOpenAI``, ``AzureChatOpenAI``, ``OpenAI``, ...) admitted on ``budget``.

    Like :func:`zp_client.wrap` for openai clients: ``settings`` (or keyword overrides of its fields,
    e.g. ``default_max_tokens=1024``), ``estimator``, ``retry`` and ``forecaster`` configure the
    admission transport; ``priority`` / ``deadline`` / ``route`` become default zp headers; ``metrics`` (a
    :class:`~zp_client.ZPMetrics`) records every call's admission. The copy's
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
        except ValueError as exc:  # pydantic's ValidationError
            raise ConfigurationError(f"invalid zp option for admit_langchain(): {exc}") from None
    opts = AdmissionOptions(budget=budget, settings=settings, estimator=estimator, retry=retry,
                            forecaster=forecaster, priority=priority, deadline=deadline, route=route,
                            max_retries=max_retries, metrics=metrics)
    # model_copy returns Self, which mypy widens to M's bound for a type variable
    copy = cast(M, model.model_copy(update={"max_retries": max_retries}))
    if isinstance(copy, BaseChatOpenAI):
        _admit_chat(copy, opts)
    else:
        _admit_llm(copy, opts)
    return copy
