"""llama-index-llms-zp: LlamaIndex's OpenAI-compatible LLM, admission-gated on a zp budget.

    llm = ZPOpenAILike(model="m", api_base="http://localhost:8000/v1", api_key="x", budget=budget,
                       is_chat_model=True, is_function_calling_model=True)

:class:`ZPOpenAILike` is ``llama_index.llms.openai_like.OpenAILike`` whose sync and async openai clients are
both built at construction and passed through :func:`zp_client.wrap` on the one ``budget``: every call
(``chat`` / ``complete`` / their streams, sync and async, and the agents built on them) takes a lease
first. LlamaIndex's own retries are off: its ``max_retries`` (default 3 in LlamaIndex) drives both a
tenacity loop around each call and the openai SDK's retries, and each would multiply zp's attempts, so
here it is 0 and zp's retry policy (``zp_retry``) is the only retry loop. Install: ``pip install -e . -e
integrations/llama-index`` (needs openai < 3). What callers may rely on: docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr

from zp_client import AdmissionOptions, Budget, admitted_budget
from zp_client._integration import ZPModelFields
from zp_client.errors import ConfigurationError, MissingIntegration

try:
    # llama-index-llms-openai-like ships no py.typed (llama-index-llms-openai, its base, does)
    from llama_index.llms.openai_like import OpenAILike  # type: ignore[import-untyped]
    from openai import AsyncOpenAI, OpenAI
except ImportError as _exc:  # the missing-framework test hides it from sys.modules
    raise MissingIntegration(
        f"llama_index_zp needs llama-index-llms-openai-like ({_exc.name or _exc} could not be imported): "
        "install llama-index-llms-zp again (pip install -e integrations/llama-index)"
    ) from _exc

__all__ = ["ZPOpenAILike"]


class ZPOpenAILike(OpenAILike, ZPModelFields):  # type: ignore[misc]  # OpenAILike is untyped (see the import)
    """``OpenAILike`` whose every call is admitted on ``budget`` (see the module doc).

    Fields beyond OpenAILike's: ``budget`` (required: a LocalBudget or RedisBudget), ``zp_settings``
    (:class:`~zp_client.Settings`), ``zp_retry`` (:class:`~zp_client.RetryPolicy`, or False for one
    attempt), ``zp_estimator``, ``zp_forecaster`` (elastic budgets), ``zp_priority`` (lower = earlier),
    ``zp_deadline`` (seconds for queueing plus every attempt), ``zp_route`` (the forecaster's key),
    ``zp_ttft_target`` / ``zp_tpot_target`` (TTFT / TPOT targets in seconds, docs/admission.md#targets) and
    ``zp_metrics`` (a :class:`~zp_client.ZPMetrics`), as in langchain-zp. ``max_retries`` is 0 and must
    stay 0 (LlamaIndex's retries would run around zp's: a value > 0 is a
    :class:`~zp_client.ConfigurationError`).

    ``openai_client`` / ``async_openai_client`` may be given unwrapped (they are admitted here, on
    ``budget``); one already admitted by :func:`zp_client.wrap` is a ConfigurationError (it would be
    admitted twice, or on another budget). With ``reuse_client=False`` each call builds a fresh client,
    admitted on the same budget with the same options.
    """


    max_retries: int = Field(default=0, ge=0, le=0, description="Always 0: zp does the retrying (zp_retry).")

    _zp_options: AdmissionOptions = PrivateAttr()

    def __init__(self, *, max_retries: int = 0, openai_client: OpenAI | None = None,
                 async_openai_client: AsyncOpenAI | None = None, **kwargs: Any) -> None:
        if not isinstance(kwargs.get("budget"), Budget):  # before pydantic, for zp's error type
            raise ConfigurationError(
                "ZPOpenAILike needs budget=, a zp_client Budget (LocalBudget, RedisBudget), got "
                f"{type(kwargs.get('budget')).__name__}"
            )
        if max_retries:
            raise ConfigurationError(
                f"ZPOpenAILike takes no max_retries (got {max_retries}): LlamaIndex's retries (a tenacity "
                "loop and the openai SDK's) would each run around zp's attempts and multiply them. zp "
                "retries each call itself: configure it with zp_retry=RetryPolicy(max_attempts=...)"
            )
        for name, given in (("openai_client", openai_client), ("async_openai_client", async_openai_client)):
            on = admitted_budget(given)
            if on is not None:
                which = "this" if on is kwargs.get("budget") else "another"
                raise ConfigurationError(
                    f"{name} is already admitted by zp_client.wrap() (on {which} budget); "
                    "ZPOpenAILike admits its clients itself: pass the unwrapped client, or use LlamaIndex's "
                    "OpenAILike with the wrapped one"
                )
        OpenAILike.__init__(self, max_retries=0, **kwargs)  # next in the MRO (mypy sees only the mixin)
        self._zp_options = self.zp_options()
        # Both clients now, from the one budget: OpenAI's lazy _get_client would build unadmitted ones.
        self._client = self._zp_options.admit(openai_client or OpenAI(**self._get_credential_kwargs()))
        self._aclient = self._zp_options.admit(
            async_openai_client or AsyncOpenAI(**self._get_credential_kwargs(is_async=True)))

    @classmethod
    def class_name(cls) -> str:
        return "ZPOpenAILike"

    # OpenAI's own versions build unadmitted clients when none is kept (reuse_client=False, or a client
    # dropped by a copy): here every client they hand out is admitted with this model's options.
    def _get_client(self) -> OpenAI:
        if self._client is None or not self.reuse_client:
            client = self._zp_options.admit(OpenAI(**self._get_credential_kwargs()))
            if not self.reuse_client:
                return client
            self._client = client
        return self._client

    def _get_aclient(self) -> AsyncOpenAI:
        if self._aclient is None or not self.reuse_client:
            client = self._zp_options.admit(AsyncOpenAI(**self._get_credential_kwargs(is_async=True)))
            if not self.reuse_client:
                return client
            self._aclient = client
        return self._aclient
