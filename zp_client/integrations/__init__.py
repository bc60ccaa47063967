"""Deprecated: the agent-framework integrations are the ``langchain-zp`` and ``autogen-zp`` distributions.

Import :mod:`langchain_zp` (``pip install -e integrations/langchain``) and :mod:`autogen_zp` (``pip install
-e integrations/autogen``) from the zp-client clone; see docs/integrations.md. The submodules
``zp_client.integrations.langchain`` / ``.autogen`` and the names below re-export their classes with a
:class:`DeprecationWarning`.
"""

from __future__ import annotations

import importlib
from typing import Any

from zp_client.errors import MissingIntegration

__all__ = ["MissingIntegration", "ZPChatOpenAI", "ZPOpenAI", "ZPOpenAIChatCompletionClient",
           "admit_langchain"]

_EXPORTS = {
    "ZPChatOpenAI": "langchain",
    "ZPOpenAI": "langchain",
    "admit_langchain": "langchain",
    "ZPOpenAIChatCompletionClient": "autogen",
}


def __getattr__(name: str) -> Any:
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value
