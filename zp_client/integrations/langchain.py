"""Deprecated: moved to the ``langchain-zp`` distribution; ``from langchain_zp import ...`` instead.

Re-exports :mod:`langchain_zp`; install it from the zp-client clone with ``pip install -e
integrations/langchain`` (docs/integrations.md).
"""

from __future__ import annotations

import warnings

from zp_client.errors import MissingIntegration

warnings.warn(
    "zp_client.integrations.langchain is deprecated: import langchain_zp instead "
    "(the langchain-zp distribution, pip install -e integrations/langchain)",
    DeprecationWarning,
    stacklevel=2,
)

try:
    from langchain_zp import ZPChatOpenAI, ZPOpenAI, admit_langchain
except ModuleNotFoundError as _exc:
    if _exc.name != "langchain_zp":
        raise
    raise MissingIntegration(
        "zp_client.integrations.langchain moved to the langchain-zp distribution (import langchain_zp), "
        "which is not installed: pip install -e integrations/langchain (from the zp-client clone)"
    ) from _exc

__all__ = ["ZPChatOpenAI", "ZPOpenAI", "admit_langchain"]
