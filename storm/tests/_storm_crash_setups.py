"""Storm setups that fail inside worker processes (imported by tests/test_storm.py and by the workers)."""

from __future__ import annotations

import os

from zp_storm.setups import SetupSpec, register_setup


async def _exit_hard(ctx, stack):  # the process dies without a word, as on OOM-kill
    os._exit(7)


async def _raise(ctx, stack):
    raise RuntimeError("factory exploded on purpose")


register_setup(SetupSpec("crash-exit", True, workers=2, description="test: worker dies"), _exit_hard)
register_setup(SetupSpec("crash-raise", True, workers=2, description="test: worker raises"), _raise)
