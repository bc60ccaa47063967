"""litellm-zp: LiteLLM's completion calls, admission-gated: every call takes a lease on a zp budget first.

    llm = ZPLiteLLM(budget, api_base="http://localhost:8000/v1", api_key="x", zp_priority=1)
    reply = await llm.acompletion(model="my-model", messages=[...])   # or llm.completion(...)

Every call runs LiteLLM's own code path (``litellm.acompletion`` / ``litellm.completion``, its OpenAI
provider) with ``client=`` an openai client admitted by :func:`zp_client.wrap`, so it is LiteLLM as its
users know it (callbacks, cost tracking, ``stream=True``, tools), plus:

* **One retry loop.** LiteLLM sets its client's ``max_retries`` on every call (2 unless told); the
  adapter sends ``max_retries=0`` and ``num_retries=0`` unless the call says otherwise. Whatever the call
  says, zp's attempts are the only ones that reach the server: error answers carry
  ``x-should-retry: false`` (the openai SDK obeys it) and a LiteLLM ``num_retries`` repeat of a call zp
  gave up on gets zp's failure again without being sent (docs/retries.md, one retry loop).
* **zp's error types.** LiteLLM turns every provider exception into its own (a zp refusal would reach the
  caller as ``litellm.InternalServerError``); the adapter re-raises the zp error found in the exception's
  ``__cause__`` / ``__context__`` chain instead, so ``except zp_client.ZPError`` (``LeaseTooLarge``,
  ``PromptTooLong``, ``RetryBudgetExhausted``, ``AdmissionTimeout``, ...) works; through ``wrap()`` it is
  also an ``openai.OpenAIError``. An upstream HTTP error keeps LiteLLM's type
  (``litellm.ServiceUnavailableError`` for a 503 zp gave up on).
* The options of langchain-zp: ``zp_priority``, ``zp_deadline``, ``zp_route``, ``zp_ttft_target``,
  ``zp_tpot_target``, per adapter and per call.

LiteLLM's ``Router`` is not supported: it builds and caches its own openai clients per deployment and
runs its own retries and fallbacks around them. Install: ``pip install -e . -e integrations/litellm``.
What callers may rely on: docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zp_client import AdmissionOptions, Budget, Settings, unwrap_error
from zp_client.errors import ConfigurationError, MissingIntegration, ZPError
from zp_client.metrics import ZPMetrics

try:
    import litellm
    import openai
except ImportError as _exc:  # the missing-framework case: say what to install
    raise MissingIntegration(
        f"litellm_zp needs litellm ({_exc.name or _exc} could not be imported): "
        "pip install 'litellm>=1.110', or install litellm-zp again (pip install -e integrations/litellm)"
    ) from _exc

__all__ = ["ZPLiteLLM"]

_CALL_OPTIONS = ("zp_priority", "zp_deadline", "zp_route", "zp_ttft_target", "zp_tpot_target")
_FIELDS = {"zp_priority": "priority", "zp_deadline": "deadline", "zp_route": "route",
           "zp_ttft_target": "ttft_target", "zp_tpot_target": "tpot_target"}
_ADAPTER_ONLY = ("client", "base_url", "api_base")


def _reraisable(err: ZPError) -> ZPError:
    """A fresh instance of ``err`` (same type and attributes) to raise from the adapter."""
    cls = type(err)
    try:
        new: ZPError = cls.__new__(cls, *err.args)
        new.__dict__.update(err.__dict__)
    except Exception:  # noqa: BLE001 - an exotic subclass: raise the original object again
        return err
    return new


class ZPLiteLLM:
    """LiteLLM completion calls for one OpenAI-compatible server, admitted on ``budget``.

    ``api_base`` / ``api_key`` name the server (an openai client of each kind is built for it), or pass
    your own ``client`` (``openai.OpenAI``) / ``async_client`` (``openai.AsyncOpenAI``), which are
    admitted here (one already admitted on ``budget`` is used as it is; one admitted on another budget is
    a :class:`~zp_client.ConfigurationError`). ``settings`` (or keyword overrides of its fields),
    ``estimator``, ``retry``, ``forecaster`` and ``metrics`` are :func:`zp_client.wrap`'s; ``zp_priority``
    (lower = earlier), ``zp_deadline`` (seconds for queueing plus every attempt), ``zp_route`` (the
    forecaster's key), ``zp_ttft_target`` / ``zp_tpot_target`` (the calls' TTFT / TPOT targets in seconds,
    docs/admission.md#targets) apply to every call; a call's own ``zp_*`` keyword arguments win.
    """

    def __init__(
        self,
        budget: Budget,
        *,
        api_base: str | None = None,
        api_key: str | None = None,
        client: Any | None = None,
        async_client: Any | None = None,
        settings: Settings | None = None,
        estimator: Any | None = None,
        retry: Any | None = None,
        forecaster: Any | None = None,
        zp_priority: int | None = None,
        zp_deadline: float | None = None,
        zp_route: str | None = None,
        zp_ttft_target: float | None = None,
        zp_tpot_target: float | None = None,
        metrics: ZPMetrics | None = None,
        **setting_overrides: Any,
    ) -> None:
        if setting_overrides:
            base = settings.model_dump() if settings is not None else {}
            try:
                settings = Settings(**{**base, **setting_overrides})
            except ValueError as exc:  # pydantic's ValidationError
                raise ConfigurationError(f"invalid zp option for ZPLiteLLM(): {exc}") from None
        kw: dict[str, Any] = {"budget": budget, "settings": settings, "estimator": estimator, "retry": retry,
                              "forecaster": forecaster, "priority": zp_priority, "deadline": zp_deadline,
                              "route": zp_route, "metrics": metrics, "ttft_target": zp_ttft_target,
                              "tpot_target": zp_tpot_target}
        self.options = AdmissionOptions(**kw)
        if client is None and async_client is None and api_base is None:
            raise ConfigurationError("ZPLiteLLM needs api_base (the server's URL, e.g. http://host:8000/v1) "
                                     "or an openai client (client= / async_client=)")
        if client is not None and not isinstance(client, openai.OpenAI):
            raise ConfigurationError(f"client must be an openai.OpenAI, got {type(client).__name__}")
        if async_client is not None and not isinstance(async_client, openai.AsyncOpenAI):
            raise ConfigurationError(
                f"async_client must be an openai.AsyncOpenAI, got {type(async_client).__name__}")
        given = client if client is not None else async_client
        if api_base is not None:
            base_url = api_base
        else:
            assert given is not None  # one of the three was given (checked above)
            base_url = str(given.base_url)
        key = api_key if api_key is not None else (given.api_key if given is not None else "EMPTY")
        self._owned: list[Any] = []  # the clients built here, whose connection pools the admitted ones use
        if client is None:
            client = openai.OpenAI(base_url=str(base_url), api_key=key, max_retries=0)
            self._owned.append(client)
        if async_client is None:
            async_client = openai.AsyncOpenAI(base_url=str(base_url), api_key=key, max_retries=0)
            self._owned.append(async_client)
        self.client: openai.OpenAI = self.options.admit(client)
        """The admitted blocking client every :meth:`completion` goes through."""
        self.async_client: openai.AsyncOpenAI = self.options.admit(async_client)
        """The admitted async client every :meth:`acompletion` goes through."""

    @property
    def budget(self) -> Budget:
        """The budget every call is admitted on."""
        return self.options.budget

    async def aclose(self) -> None:
        """Close the admitted clients and the connection pools of those built here (the async ones on the
        running event loop: an async client left to the garbage collector closes its connections on
        whatever loop runs then). Clients passed in are the caller's to close."""
        self.client.close()
        await self.async_client.close()
        for c in self._owned:
            await c.close() if isinstance(c, openai.AsyncOpenAI) else c.close()

    def _kwargs(self, kwargs: dict[str, Any], client: Any) -> dict[str, Any]:
        for name in _ADAPTER_ONLY:
            if name in kwargs:
                raise ConfigurationError(
                    f"{name}= is the adapter's: a call given its own would not be admitted; build another "
                    "ZPLiteLLM for another server or client")
        provider = kwargs.pop("custom_llm_provider", "openai")
        if provider != "openai":
            raise ConfigurationError(
                f"custom_llm_provider={provider!r}: ZPLiteLLM calls the server through LiteLLM's openai "
                "provider (any OpenAI-compatible server, vLLM included); the model name is sent as it is")
        per_call = {_FIELDS[k]: kwargs.pop(k) for k in _CALL_OPTIONS if k in kwargs}
        headers = dict(kwargs.pop("extra_headers", None) or {})
        if per_call:  # validated as the adapter's own options are (AdmissionOptions.__post_init__)
            headers = {**dataclasses.replace(self.options, **per_call).headers(), **headers}
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("num_retries", 0)
        if headers:
            kwargs["extra_headers"] = headers
        return {**kwargs, "client": client, "custom_llm_provider": "openai"}

    def completion(self, **kwargs: Any) -> Any:
        """``litellm.completion(**kwargs)`` through the admitted client; a zp error is raised as itself."""
        call = self._kwargs(kwargs, self.client)
        try:
            return litellm.completion(**call)
        except Exception as exc:
            zp = unwrap_error(exc)
            if zp is None:
                raise
            raise _reraisable(zp) from None

    async def acompletion(self, **kwargs: Any) -> Any:
        """``await litellm.acompletion(**kwargs)`` through the admitted async client; a zp error is raised
        as itself."""
        call = self._kwargs(kwargs, self.async_client)
        try:
            return await litellm.acompletion(**call)
        except Exception as exc:
            zp = unwrap_error(exc)
            if zp is None:
                raise
            raise _reraisable(zp) from None

