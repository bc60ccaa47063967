"""Client-side waits measured in virtual seconds: the storm's simulator runs ``speedup`` times faster than
the wall clock, so a 4 s backoff must last 4 / ``speedup`` wall seconds (see :mod:`zp_storm.setups`).

Imports openai at module level; :mod:`zp_storm.setups` imports this module only when it builds a
client, so ``zp-client storm --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import openai

from zp_client.errors import ConfigurationError
from zp_client.retry import RetryPolicy

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

__all__ = ["VirtualTimeAsyncOpenAI", "VirtualTimeRetryPolicy"]


def _positive(speedup: float) -> float:
    speedup = float(speedup)
    if not speedup > 0:
        raise ConfigurationError(f"speedup must be > 0 virtual seconds per wall second, got {speedup!r}")
    return speedup


class VirtualTimeAsyncOpenAI(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose retry backoff (``max_retries``) is measured in virtual seconds.

    ``speedup`` is virtual seconds per wall second; every other argument is ``AsyncOpenAI``'s.
    ``copy()`` / ``with_options()`` keep the speedup.
    """

    def __init__(self, *, speedup: float, **kwargs: Any) -> None:
        self.speedup = _positive(speedup)
        super().__init__(**kwargs)

    def _calculate_retry_timeout(self, *args: Any, **kwargs: Any) -> float:
        return float(super()._calculate_retry_timeout(*args, **kwargs)) / self.speedup

    def copy(self, *args: Any, **kwargs: Any) -> Self:
        # openai's copy builds ``self.__class__(...)`` and passes ``_extra_kwargs`` through to it
        extra: Mapping[str, object] = kwargs.pop("_extra_kwargs", None) or {}
        return super().copy(*args, _extra_kwargs={"speedup": self.speedup, **extra}, **kwargs)

    with_options = copy


class VirtualTimeRetryPolicy(RetryPolicy):
    """zp's :class:`~zp_client.retry.RetryPolicy` with its sleeps measured in virtual seconds.

    ``speedup`` is virtual seconds per wall second; the keyword arguments are ``RetryPolicy``'s.
    """

    def __init__(self, speedup: float, **kwargs: Any) -> None:
        self.speedup = _positive(speedup)
        super().__init__(**kwargs)

    async def sleep(self, seconds: float) -> None:
        await super().sleep(seconds / self.speedup)

    def sleep_sync(self, seconds: float) -> None:
        super().sleep_sync(seconds / self.speedup)
