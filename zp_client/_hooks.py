"""Late-bound factories a lower layer offers and a higher one provides.

The budget layer imports nothing above it, yet :meth:`Budget.adapt <zp_client.Budget.adapt>` hands back an
:class:`~zp_client.AdaptiveLimit`, which lives above it (it polls the server and changes the budget's
limit). The composition root (``zp_client/__init__.py``, which runs before any submodule) installs the
factory here; the budget calls it without knowing the module it comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["adaptive_limit"]

adaptive_limit: Callable[..., Any] | None = None
"""``adaptive_limit(budget, server_url, **kwargs)``: a new, unstarted adaptive limit of ``budget``."""
