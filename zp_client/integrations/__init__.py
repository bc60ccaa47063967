"""Agent frameworks, admission-gated: LangChain and AutoGen on the same transport as ``wrap()``.

Each submodule imports its framework only when it is itself imported, so ``import zp_client`` (and
``import zp_client.integrations``) never needs LangChain or AutoGen:

- :mod:`zp_client.integrations.langchain` (``pip install 'zp-client[langchain]'``):
  :class:`~zp_client.integrations.langchain.ZPChatOpenAI`,
  :class:`~zp_client.integrations.langchain.ZPOpenAI` and
  :func:`~zp_client.integrations.langchain.admit_langchain`.
- :mod:`zp_client.integrations.autogen` (``pip install 'zp-client[autogen]'``):
  :class:`~zp_client.integrations.autogen.ZPOpenAIChatCompletionClient`.

Both build the framework's own openai clients as usual and pass them through :func:`zp_client.wrap`,
so every LLM call (sync or async, plain, streamed, tool calling) takes a lease on the budget first and
zp's retry policy is the only retry loop. A framework that is not installed raises
:class:`MissingIntegration` (a :class:`~zp_client.errors.ConfigurationError` and an ``ImportError``)
naming the extra to install.
"""

from __future__ import annotations

from typing import Any

from zp_client.errors import ConfigurationError

__all__ = ["MissingIntegration", "ZPChatOpenAI", "ZPOpenAI", "admit_langchain", "ZPOpenAIChatCompletionClient"]

_EXPORTS = {
    "ZPChatOpenAI": "langchain",
    "ZPOpenAI": "langchain",
    "admit_langchain": "langchain",
    "ZPOpenAIChatCompletionClient": "autogen",
}


class MissingIntegration(ConfigurationError, ImportError):
    """The agent framework an integration needs is not installed; the message names the extra."""


def missing(framework: str, extra: str, exc: ImportError) -> MissingIntegration:
    """The error an integration module raises when importing its framework failed with ``exc``."""
    what = exc.name or str(exc)
    return MissingIntegration(
        f"zp_client.integrations.{extra} needs {framework} ({what} could not be imported): "
        f"pip install 'zp-client[{extra}]'"
    )


def __getattr__(name: str) -> Any:
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value
