"""crewai-zp: CrewAI's native OpenAI LLM, admission-gated on a zp budget.

    llm = ZPLLM(model="m", base_url="http://localhost:8000/v1", api_key="x", budget=budget)
    agent = Agent(role=..., goal=..., backstory=..., llm=llm)

:class:`ZPLLM` is CrewAI's ``OpenAICompletion`` (what ``crewai.LLM(model="openai/...")`` builds) whose sync
and async openai clients are passed through :func:`zp_client.wrap` on the one ``budget`` when the model is
built: every LLM call of an agent, crew or flow takes a lease first. CrewAI has no public hook for those
clients; they are replaced in one place, ``zp_client._private.replace_crewai_clients``, whose test fails
if CrewAI renames them. ``max_retries`` (the openai SDK's retries; CrewAI's default is 2) defaults to 0.
Install: ``pip install -e . -e integrations/crewai`` (CrewAI 1.15 needs openai < 3, httpx 0.28, pydantic
< 2.13). What callers may rely on: docs/integrations.md.
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import Field, ValidationError, model_validator

from zp_client._integration import ZPModelFields
from zp_client._private import replace_crewai_clients
from zp_client._repeat import call_key
from zp_client.errors import ConfigurationError, MissingIntegration

try:
    from crewai.llms.providers.openai.completion import OpenAICompletion
except ImportError as _exc:  # the missing-framework test hides it from sys.modules
    raise MissingIntegration(
        f"crewai_zp needs crewai ({_exc.name or _exc} could not be imported): install crewai-zp again "
        "(pip install -e integrations/crewai)"
    ) from _exc

if sys.version_info >= (3, 11):
    from typing import Self
else:
    from typing_extensions import Self

__all__ = ["ZPLLM"]


class ZPLLM(OpenAICompletion, ZPModelFields):
    """CrewAI's ``OpenAICompletion`` whose every call is admitted on ``budget`` (see the module doc).

    Fields beyond CrewAI's: ``budget`` (required: a LocalBudget or RedisBudget), ``zp_settings``
    (:class:`~zp_client.Settings`), ``zp_retry`` (:class:`~zp_client.RetryPolicy`, or False for one
    attempt), ``zp_estimator``, ``zp_forecaster`` (elastic budgets), ``zp_priority`` (lower = earlier),
    ``zp_deadline`` (seconds for queueing plus every attempt), ``zp_route``, ``zp_ttft_target`` /
    ``zp_tpot_target`` (TTFT / TPOT targets in seconds, docs/admission.md#targets) and ``zp_metrics``, as
    in langchain-zp. ``max_retries`` defaults to 0; an explicit value is honoured and adds no upstream
    attempt (zp's one retry loop: docs/retries.md#framework-retries). Both clients are built and admitted
    at construction, so ``api_key`` (any string, for vLLM) must be given or in ``OPENAI_API_KEY``: without
    it, a :class:`~zp_client.ConfigurationError`. Clients CrewAI built already admitted on another budget
    are a ConfigurationError too.
    """

    max_retries: int = Field(default=0, ge=0)
    """Retries of the openai SDK; a retry of a call zp gave up on gets zp's failure again (no attempt)."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            # pydantic wraps a validator's ValueError (ConfigurationError is one): give the caller zp's own
            for err in exc.errors():
                cause = (err.get("ctx") or {}).get("error")
                if isinstance(cause, ConfigurationError):
                    raise cause from None
            raise

    # CrewAI's agent retries a failed task (max_retry_limit, default 2) by running its executor again,
    # whose LLM calls start in a fresh context copy (its flow runtime): the failure zp recorded is not in
    # it. The agent and task CrewAI passes to every call are stable across those retries: they key the
    # call (zp_client._repeat.call_key), so the retry of a call zp gave up on gets its failure again and
    # makes no upstream attempt. Marked as wrapped: BaseLLM already runs CrewAI's rate-limit retry around
    # OpenAICompletion.call, which these call.
    def call(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        with call_key(_crew_key(kwargs)):
            return super().call(messages, *args, **kwargs)

    call._crewai_rate_limit_wrapped = True  # type: ignore[attr-defined]

    async def acall(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        with call_key(_crew_key(kwargs)):
            return await super().acall(messages, *args, **kwargs)

    acall._crewai_rate_limit_wrapped = True  # type: ignore[attr-defined]

    # A unique name: after validators run parent-first, so OpenAICompletion's _init_clients has built the
    # clients (or left them None, without an API key) when this runs.
    @model_validator(mode="after")
    def _zp_admit_clients(self) -> Self:
        opts = self.zp_options(max_retries=self.max_retries)
        built: list[Any] = []

        def admit(client: Any) -> Any:
            built.append(client)
            return opts.admit(client)

        replace_crewai_clients(self, admit)
        if len(built) != 2:
            # CrewAI would build them lazily, unadmitted, on the first call
            raise ConfigurationError(
                "ZPLLM could not build its openai clients at construction: pass api_key= (any string for "
                "vLLM) or set OPENAI_API_KEY"
            )
        return self


def _crew_key(kwargs: dict[str, Any]) -> str | None:
    """A logical-call key stable across CrewAI's task retries: the agent and task of the call, when CrewAI
    says (None for a direct ``llm.call``: its retries run in its own context, where zp sees them)."""
    agent, task = kwargs.get("from_agent"), kwargs.get("from_task")
    if agent is None and task is None:
        return None
    return f"crewai:{id(agent)}:{id(task)}"
