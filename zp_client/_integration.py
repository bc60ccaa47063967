"""What the agent-framework integrations (``langchain_zp``, ``autogen_zp``) build on.

:class:`AdmissionOptions` admits one framework-built openai client once, with per-model zp options;
:func:`openai_http_client` and :func:`openai_client_of` are the one place the integrations reach
openai's private layout (openai has no public accessor for either). See docs/integrations.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

from zp_client._admission.ports import Estimator, Forecaster, RetryPolicy
from zp_client._private import resource_client, sdk_http_client
from zp_client._wrap import admitted_budget, wrap
from zp_client.budget.base import Budget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError
from zp_client.metrics import ZPMetrics, as_metrics
from zp_client.transport import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    ROUTE_HEADER,
    TPOT_TARGET_HEADER,
    TTFT_TARGET_HEADER,
)

__all__ = ["AdmissionOptions", "ZPModelFields", "openai_client_of", "openai_http_client"]

C = TypeVar("C")

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI


class _Reconfigurable(Protocol):
    """An openai client's ``with_options`` (a copy with other options)."""

    def with_options(self, **options: object) -> object: ...


@dataclass(frozen=True)
class AdmissionOptions:
    """zp's options for every call of one framework model: what :func:`~zp_client.wrap` takes, plus the
    default ``X-ZP-*`` headers and the SDK's ``max_retries``.

    ``retry``: a :class:`~zp_client.RetryPolicy`; None (default) builds one from ``settings`` on the
    budget's shared retry budget; False turns retrying off. ``max_retries`` (default 0) are the openai
    SDK's own retries: with zp's retry policy on they add no upstream attempt (zp's error answers say
    ``x-should-retry: false`` and an SDK retry of a call zp gave up on gets zp's failure again:
    docs/retries.md#framework-retries). ``metrics``: a :class:`~zp_client.ZPMetrics` that records
    every call's admission (default None: nothing recorded; docs/admission.md#metrics). ``ttft_target`` /
    ``tpot_target``: the calls' TTFT / TPOT targets in seconds (``X-ZP-TTFT-Target`` /
    ``X-ZP-TPOT-Target``; docs/admission.md#targets). Invalid values (a deadline or target that is not a
    positive finite number of seconds, ...) raise :class:`~zp_client.ConfigurationError` here, at
    construction.
    """

    budget: Budget
    settings: Settings | None = None
    estimator: Estimator | None = None
    retry: RetryPolicy | bool | None = None
    forecaster: Forecaster | None = None
    priority: int | None = None
    deadline: float | None = None
    route: str | None = None
    max_retries: int = 0
    metrics: ZPMetrics | None = None
    ttft_target: float | None = None
    tpot_target: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.budget, Budget):
            raise ConfigurationError(
                "budget must be a zp_client Budget (LocalBudget, RedisBudget), "
                f"got {type(self.budget).__name__}"
            )
        for name in ("deadline", "ttft_target", "tpot_target"):
            value = getattr(self, name)
            if value is not None and not _positive_seconds(value):
                raise ConfigurationError(f"{name} must be a positive finite number of seconds, got {value!r}")
        if self.max_retries < 0:
            raise ConfigurationError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.metrics is not None:
            as_metrics(self.metrics)  # a clear error here, at the model's construction, not at its first call

    def headers(self) -> dict[str, str]:
        """The per-call zp headers, as a model's default headers (a call's ``extra_headers`` win)."""
        out: dict[str, str] = {}
        if self.priority is not None:
            out[PRIORITY_HEADER] = str(int(self.priority))
        if self.deadline is not None:
            out[DEADLINE_HEADER] = repr(float(self.deadline))
        if self.route is not None:
            out[ROUTE_HEADER] = self.route
        if self.ttft_target is not None:
            out[TTFT_TARGET_HEADER] = repr(float(self.ttft_target))
        if self.tpot_target is not None:
            out[TPOT_TARGET_HEADER] = repr(float(self.tpot_target))
        return out

    def admit(self, client: C) -> C:
        """``client`` (``openai.OpenAI`` / ``AsyncOpenAI``) admission-gated on ``budget``, with these options.

        A client already admitted on the same budget is returned as it is (a framework that rebuilds a
        model from its fields must not stack two admissions, i.e. two leases per call); one admitted on
        another budget is a :class:`~zp_client.ConfigurationError`.
        """
        current = admitted_budget(client)
        if current is not None:
            if current is self.budget:
                return client
            raise ConfigurationError(
                "this client is already admitted on another budget; build it again from an unwrapped client"
            )
        # The admitted client sends through the original's transport, and the original closes that
        # transport when it is garbage collected (openai's __del__). The frameworks drop the original as
        # soon as we replace it, so the admitted client keeps it alive (keep_original).
        new = wrap(client, self.budget, settings=self.settings, estimator=self.estimator, retry=self.retry,
                   forecaster=self.forecaster, metrics=self.metrics, keep_original=True)
        extra: dict[str, object] = {}
        headers = self.headers()
        if headers:
            extra["default_headers"] = headers
        if self.max_retries:
            # asked for explicitly: the SDK's retries then run around zp's (each SDK attempt is a new
            # admission, each with zp's own retries inside), so attempts multiply
            extra["max_retries"] = self.max_retries
        if extra:
            # wrap() accepted ``client``, so it is an openai client, which has with_options
            new = cast(C, cast(_Reconfigurable, new).with_options(**extra))
        return new


class ZPModelFields(BaseModel):
    """The fields every pydantic framework model of zp's integrations adds to its base (langchain-zp's
    ``ZPChatOpenAI`` / ``ZPOpenAI``, crewai-zp's ``ZPLLM``, llama-index-llms-zp's ``ZPOpenAILike``): a
    mixin listed after the framework's class, so that the eleven options are declared, excluded from
    serialisation and turned into :class:`AdmissionOptions` in one place.

    ``budget`` is required; the ``zp_*`` fields are :class:`AdmissionOptions`' own, prefixed (``zp_deadline``
    is its ``deadline``, ...). They are not constrained here: :meth:`zp_options` checks them, raising
    :class:`~zp_client.ConfigurationError` (an integration whose framework reports bad fields as
    ``pydantic.ValidationError`` re-declares them with constraints).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    budget: Budget = Field(exclude=True)
    zp_settings: Settings | None = Field(default=None, exclude=True)
    zp_retry: Any | None = Field(default=None, exclude=True)
    zp_estimator: Any | None = Field(default=None, exclude=True)
    zp_forecaster: Any | None = Field(default=None, exclude=True)
    zp_priority: int | None = Field(default=None, exclude=True)
    zp_deadline: float | None = Field(default=None, exclude=True)
    zp_route: str | None = Field(default=None, exclude=True)
    zp_ttft_target: float | None = Field(default=None, exclude=True)
    zp_tpot_target: float | None = Field(default=None, exclude=True)
    zp_metrics: ZPMetrics | None = Field(default=None, exclude=True)

    def zp_options(self, *, max_retries: int = 0) -> AdmissionOptions:
        """These fields as :class:`AdmissionOptions`, with the openai SDK's ``max_retries``."""
        return AdmissionOptions(
            budget=self.budget, settings=self.zp_settings, estimator=self.zp_estimator, retry=self.zp_retry,
            forecaster=self.zp_forecaster, priority=self.zp_priority, deadline=self.zp_deadline,
            route=self.zp_route, max_retries=max_retries, metrics=self.zp_metrics,
            ttft_target=self.zp_ttft_target, tpot_target=self.zp_tpot_target)


def _positive_seconds(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 and math.isfinite(value)


def _openai_clients() -> tuple[type[OpenAI], type[AsyncOpenAI]]:
    try:
        import openai
    except ImportError:  # pragma: no cover - openai is an optional dependency
        raise ConfigurationError("this needs the openai package: pip install 'zp-client[openai]'") from None
    return (openai.OpenAI, openai.AsyncOpenAI)


def openai_http_client(client: object) -> Any:
    """The ``httpx`` / ``httpx2`` client an ``openai.OpenAI`` / ``AsyncOpenAI`` sends through.

    For what the SDK's public API cannot reach (e.g. adding an event hook to an admitted client). openai
    keeps it in a private attribute; if a release moves it, this raises
    :class:`~zp_client.ConfigurationError` rather than returning something else.
    """
    if not isinstance(client, _openai_clients()):
        raise ConfigurationError(
            f"expected an openai.OpenAI or openai.AsyncOpenAI client, got {type(client).__name__}"
        )
    http = sdk_http_client(client)
    if not (hasattr(http, "send") and hasattr(http, "event_hooks")):
        raise ConfigurationError(
            f"{type(client).__name__} keeps no httpx client where openai used to (._client); this openai "
            "release is not supported by zp_client.openai_http_client"
        )
    return http


def openai_client_of(resource: object) -> OpenAI | AsyncOpenAI:
    """The openai client an API resource (``client.completions``, ``client.chat.completions``, ...) calls.

    For frameworks that keep only the resource (langchain-openai's ``OpenAI`` LLM does). Raises
    :class:`~zp_client.ConfigurationError` for anything else, or if an openai release moved it.
    """
    client = resource_client(resource)
    if not isinstance(client, _openai_clients()):
        raise ConfigurationError(
            f"{type(resource).__name__} is not an openai API resource (such as client.completions)"
        )
    return client
