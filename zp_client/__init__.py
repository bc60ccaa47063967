"""zp-client: client-side KV-block admission for vLLM, so bursts never become preemption storms.

Quick start::

    from zp_client import AsyncClient, LocalBudget

    budget = LocalBudget(limit_blocks=459)  # `zp-client status --server URL` suggests it from the pool
    client = AsyncClient(base_url="http://localhost:8000/v1", budget=budget)
    reply = await client.chat.completions.create(model="sim-llama", messages=[...], max_tokens=256)

Public names are importable from the package root; submodules load on first use, so ``import
zp_client`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # errors
    "ZPError": "zp_client.errors",
    "ConfigurationError": "zp_client.errors",
    "AdmissionError": "zp_client.errors",
    "LeaseTooLarge": "zp_client.errors",
    "AdmissionTimeout": "zp_client.errors",
    "DeadlineExceeded": "zp_client.errors",
    "PromptTooLong": "zp_client.errors",
    "InvalidRequest": "zp_client.errors",
    "BudgetUnavailable": "zp_client.errors",
    "LeaseLost": "zp_client.errors",
    "PinRefused": "zp_client.errors",
    "StreamCut": "zp_client.errors",
    "RetryBudgetExhausted": "zp_client.errors",
    "ServerUnreachable": "zp_client.errors",
    "retry_on": "zp_client.errors",
    "unwrap_error": "zp_client.errors",
    "MissingIntegration": "zp_client.errors",
    # configuration
    "Settings": "zp_client.config",
    # budgets
    "Budget": "zp_client.budget.base",
    "BudgetStatus": "zp_client.budget.base",
    "Lease": "zp_client.budget.base",
    "Ticket": "zp_client.budget.base",
    "LocalBudget": "zp_client.budget.local",
    "AdaptiveLimit": "zp_client.adaptive",
    "RedisBudget": "zp_client.budget.redis",
    "Fleet": "zp_client.fleet",
    "HealthRules": "zp_client.fleet",
    # front ends
    "AsyncClient": "zp_client.client",
    "Client": "zp_client.client",
    "APIStatusError": "zp_client.client",
    "wrap": "zp_client._wrap",
    "admitted_budget": "zp_client._wrap",
    "PinnedPrefix": "zp_client.pinning",
    "PRIORITY_HEADER": "zp_client.transport",
    "DEADLINE_HEADER": "zp_client.transport",
    "ROUTE_HEADER": "zp_client.transport",
    "TTFT_TARGET_HEADER": "zp_client.transport",
    "TPOT_TARGET_HEADER": "zp_client.transport",
    # what the agent-framework integrations (langchain_zp, autogen_zp) build on
    "AdmissionOptions": "zp_client._integration",
    "openai_http_client": "zp_client._integration",
    "openai_client_of": "zp_client._integration",
    "call_scope": "zp_client._repeat",
    "AsyncAdmissionTransport": "zp_client.transport",
    "AdmissionTransport": "zp_client.transport",
    "Estimator": "zp_client.estimate",
    "RetryPolicy": "zp_client.retry",
    "ServerInfo": "zp_client.server",
    # elastic admission
    "ElasticPolicy": "zp_client.budget.elastic",
    "LengthForecaster": "zp_client.forecast",
    "Prior": "zp_client.forecast",
    # opt-in Prometheus metrics
    "ZPMetrics": "zp_client.metrics",
    # per-call admission records
    "AdmissionInfo": "zp_client.observe",
    "observe_admissions": "zp_client.observe",
    "summarize_admissions": "zp_client.observe",
}

# A literal, so type checkers see the re-exports (test_package_exports checks it matches _EXPORTS).
__all__ = [
    "AdaptiveLimit",
    "AdmissionError",
    "AdmissionInfo",
    "AdmissionOptions",
    "AdmissionTimeout",
    "AdmissionTransport",
    "admitted_budget",
    "APIStatusError",
    "AsyncAdmissionTransport",
    "AsyncClient",
    "Budget",
    "BudgetStatus",
    "BudgetUnavailable",
    "call_scope",
    "Client",
    "ConfigurationError",
    "DEADLINE_HEADER",
    "DeadlineExceeded",
    "ElasticPolicy",
    "Estimator",
    "Fleet",
    "HealthRules",
    "Lease",
    "LeaseLost",
    "LeaseTooLarge",
    "LengthForecaster",
    "LocalBudget",
    "MissingIntegration",
    "observe_admissions",
    "openai_client_of",
    "openai_http_client",
    "Prior",
    "PRIORITY_HEADER",
    "PinRefused",
    "PinnedPrefix",
    "PromptTooLong",
    "InvalidRequest",
    "RedisBudget",
    "RetryBudgetExhausted",
    "RetryPolicy",
    "retry_on",
    "ROUTE_HEADER",
    "ServerInfo",
    "ServerUnreachable",
    "Settings",
    "StreamCut",
    "summarize_admissions",
    "Ticket",
    "TPOT_TARGET_HEADER",
    "TTFT_TARGET_HEADER",
    "unwrap_error",
    "wrap",
    "ZPError",
    "ZPMetrics",
    "__version__",
]


def _adaptive_limit(budget: Budget, server_url: str, **kwargs: Any) -> AdaptiveLimit:
    from zp_client.adaptive import AdaptiveLimit

    return AdaptiveLimit(budget, server_url, **kwargs)


# The composition root: what a lower layer offers but a higher one implements is wired here, since this
# module runs before any submodule (Budget.adapt(); see zp_client/_hooks.py).
from zp_client import _hooks  # noqa: E402 - after the names it exports, before first use

_hooks.adaptive_limit = _adaptive_limit


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zp_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from zp_client._integration import AdmissionOptions, openai_client_of, openai_http_client
    from zp_client._repeat import call_scope
    from zp_client._wrap import admitted_budget, wrap
    from zp_client.adaptive import AdaptiveLimit
    from zp_client.budget.base import Budget, BudgetStatus, Lease, Ticket
    from zp_client.budget.elastic import ElasticPolicy
    from zp_client.budget.local import LocalBudget
    from zp_client.budget.redis import RedisBudget
    from zp_client.client import APIStatusError, AsyncClient, Client
    from zp_client.config import Settings
    from zp_client.errors import (
        AdmissionError,
        AdmissionTimeout,
        BudgetUnavailable,
        ConfigurationError,
        DeadlineExceeded,
        InvalidRequest,
        LeaseLost,
        LeaseTooLarge,
        MissingIntegration,
        PinRefused,
        PromptTooLong,
        RetryBudgetExhausted,
        ServerUnreachable,
        StreamCut,
        ZPError,
        retry_on,
        unwrap_error,
    )
    from zp_client.estimate import Estimator
    from zp_client.fleet import Fleet, HealthRules
    from zp_client.forecast import LengthForecaster, Prior
    from zp_client.metrics import ZPMetrics
    from zp_client.observe import AdmissionInfo, observe_admissions, summarize_admissions
    from zp_client.pinning import PinnedPrefix
    from zp_client.retry import RetryPolicy
    from zp_client.server import ServerInfo
    from zp_client.transport import (
        DEADLINE_HEADER,
        PRIORITY_HEADER,
        ROUTE_HEADER,
        TPOT_TARGET_HEADER,
        TTFT_TARGET_HEADER,
        AdmissionTransport,
        AsyncAdmissionTransport,
    )
