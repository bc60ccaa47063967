"""Deprecated: moved to the ``autogen-zp`` distribution; ``from autogen_zp import ...`` instead.

Re-exports :mod:`autogen_zp`; install it from the zp-client clone with ``pip install -e
integrations/autogen`` (docs/integrations.md).
"""

from __future__ import annotations

import warnings

from zp_client.errors import MissingIntegration

warnings.warn(
    "zp_client.integrations.autogen is deprecated: import autogen_zp instead "
    "(the autogen-zp distribution, pip install -e integrations/autogen)",
    DeprecationWarning,
    stacklevel=2,
)

try:
    from autogen_zp import ZPOpenAIChatCompletionClient
except ModuleNotFoundError as _exc:
    if _exc.name != "autogen_zp":
        raise
    raise MissingIntegration(
        "zp_client.integrations.autogen moved to the autogen-zp distribution (import autogen_zp), "
        "which is not installed: pip install -e integrations/autogen (from the zp-client clone)"
    ) from _exc

__all__ = ["ZPOpenAIChatCompletionClient"]
