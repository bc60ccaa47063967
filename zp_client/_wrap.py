"""``wrap(openai_client, budget=...)``: the official openai SDK, admission-gated.

Returns a copy of an ``openai.AsyncOpenAI`` / ``openai.OpenAI`` client whose every call is admitted
by the budget; it shares the original's transport, retries with zp's policy, and raises zp's refusals
as openai-compatible errors. What callers may rely on: docs/wrap.md.
"""

from __future__ import annotations

import logging
from typing import TypeVar, cast

from zp_client._admission.httplib import module_of, watch_sdk_streams
from zp_client._admission.ports import Estimator, Forecaster, Metrics, RetryPolicy
from zp_client._private import http_mounts, http_transport, sdk_http_client
from zp_client.budget.base import Budget
from zp_client.config import Settings
from zp_client.errors import ConfigurationError, ServerUnreachable, ZPError
from zp_client.transport import transport_classes

__all__ = ["wrap", "openai_compatible_error", "admitted_budget"]

logger = logging.getLogger("zp_client.wrap")

C = TypeVar("C")

_compat_classes: dict[type, type] = {}


def openai_compatible_error(err: ZPError) -> ZPError:
    """The same error as an instance of a subclass of ``type(err)`` and ``openai.OpenAIError``.

    openai passes ``OpenAIError`` through its request loop untouched (anything else becomes
    ``APIConnectionError``), so this is how a zp refusal reaches the caller with its own type.
    :class:`~zp_client.ServerUnreachable` becomes an ``openai.APIConnectionError`` too (with ``message``
    and ``request`` set, as openai's own has them), so code and frameworks that handle openai's
    connection errors handle it.
    """
    import openai

    if isinstance(err, openai.OpenAIError):
        return err
    cls = type(err)
    compat = _compat_classes.get(cls)
    if compat is None:
        base: type = openai.APIConnectionError if isinstance(err, ServerUnreachable) else openai.OpenAIError
        compat = type(cls.__name__, (cls, base), {"__module__": cls.__module__, "__doc__": cls.__doc__})
        compat.__qualname__ = cls.__qualname__
        _compat_classes[cls] = compat
    new: ZPError = compat.__new__(compat, *err.args)  # the built-in base (e.g. OSError) must make it
    new.__dict__.update(err.__dict__)
    new.args = err.args  # __new__ keeps none where the class has its own __init__ (DeadlineExceeded)
    if isinstance(new, openai.APIError):
        # openai.APIError's attributes, which its __init__ (not called: it takes other arguments) sets
        for name, value in (("message", str(err)), ("request", None), ("body", None), ("code", None),
                            ("param", None), ("type", None)):
            new.__dict__.setdefault(name, value)
    new.__cause__ = err.__cause__
    new.__context__ = err.__context__
    new.__suppress_context__ = err.__suppress_context__
    return new


def wrap(
    client: C,
    budget: Budget,
    *,
    settings: Settings | None = None,
    estimator: Estimator | None = None,
    retry: RetryPolicy | bool | None = None,
    forecaster: Forecaster | None = None,
    keep_original: bool | None = None,
    metrics: Metrics | None = None,
    **setting_overrides: object,
) -> C:
    """Return a copy of ``client`` (``openai.AsyncOpenAI`` / ``openai.OpenAI``) that admits every call.

    ``budget`` is the shared KV budget (LocalBudget, RedisBudget). ``settings`` (or keyword overrides of
    its fields, e.g. ``default_max_tokens=1024``), ``estimator`` and ``retry`` (a RetryPolicy; default:
    the policy from the settings on ``budget.retry_budget()``; ``False``: no retries) configure the
    admission transport. ``keep_original``: the wrapped client keeps ``client`` alive (default: only a
    sync one, see the module docstring; a framework that drops the original pass True). With an elastic
    budget, ``forecaster`` (a :class:`~zp_client.forecast.LengthForecaster`; default: the one shared by
    the budget's transports) forecasts output lengths (one with a ``forecast_request`` hook may forecast
    from the request body, see docs/elastic.md). ``metrics``: a :class:`~zp_client.metrics.ZPMetrics` to
    record admission into (default None: nothing recorded; docs/admission.md#metrics). See the module
    docstring for what is kept from the original client.
    """
    try:
        import openai
    except ImportError:  # pragma: no cover - openai is an optional dependency
        raise ConfigurationError("wrap() needs the openai package: pip install 'zp-client[openai]'") from None
    if not isinstance(client, (openai.AsyncOpenAI, openai.OpenAI)):
        raise ConfigurationError(
            f"wrap() takes an openai.AsyncOpenAI or openai.OpenAI client, got {type(client).__name__}; "
            "for other front ends pass zp_client.AsyncAdmissionTransport as their httpx transport"
        )
    if setting_overrides:
        base = settings.model_dump() if settings is not None else {}
        try:
            settings = Settings(**{**base, **setting_overrides})
        except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
            raise ConfigurationError(f"invalid zp option for wrap(): {exc}") from None
    is_async = isinstance(client, openai.AsyncOpenAI)
    http = sdk_http_client(client)
    mod = module_of(http)
    classes = transport_classes(mod)
    cls = classes.AsyncAdmissionTransport if is_async else classes.AdmissionTransport

    transport = cls(http_transport(http), budget=budget, settings=settings, estimator=estimator, retry=retry,
                    close_inner=False, forecaster=forecaster, metrics=metrics)
    transport.core.convert_error = openai_compatible_error
    watch_sdk_streams(openai)  # a dropped stream releases its lease at once (no reference cycle left)
    mounts: dict[str, object] = {}
    for pattern, inner in http_mounts(http).items():
        if inner is None:
            mounts[pattern.pattern] = None
            continue
        t = cls(inner, budget=budget, settings=settings, estimator=estimator, retry=retry, close_inner=False)
        t.share_core(transport)  # one estimator, one metadata cache, one error conversion for all routes
        mounts[pattern.pattern] = t

    client_cls = mod.AsyncClient if is_async else mod.Client
    new_http = client_cls(
        transport=transport,
        mounts=mounts,
        # the original's env proxies already live in its mounts, which we copied
        trust_env=False,
        timeout=http.timeout,
        follow_redirects=http.follow_redirects,
        max_redirects=http.max_redirects,
        event_hooks=http.event_hooks,
        base_url=http.base_url,
        headers=http.headers,
        cookies=http.cookies,
        auth=http.auth,
    )
    # The wrapped client sends through the original's connection pool, and openai's sync HTTP client
    # closes that pool when the original is garbage-collected (its __del__), which the cycle collector
    # may do mid-request: the transport keeps a sync original alive as long as the wrapped client. An
    # async original is not kept: its __del__ schedules aclose() on whatever loop runs then, so keeping it
    # would close connections of a finished loop from a later one.
    if keep_original or (keep_original is None and not is_async):
        transport.keep_alive(client)
    logger.debug("wrapped %s (%s) with admission", type(client).__name__, mod.__name__)
    # with_options returns the client's own type (C): mypy sees only the two openai classes.
    return cast(C, client.with_options(http_client=new_http, max_retries=0))


def admitted_budget(client: object) -> Budget | None:
    """The budget an openai client (as returned by :func:`wrap`) is admitted on, or None."""
    try:
        import openai
    except ImportError:  # pragma: no cover - openai is an optional dependency
        return None
    if not isinstance(client, (openai.AsyncOpenAI, openai.OpenAI)):
        return None
    http = sdk_http_client(client)
    try:
        classes = transport_classes(module_of(http))
    except ConfigurationError:
        return None
    transport = http_transport(http)
    if isinstance(transport, (classes.AsyncAdmissionTransport, classes.AdmissionTransport)):
        budget: Budget = transport.budget
        return budget
    return None
