"""A uvicorn server that stops as soon as it is asked (imported when a simulator starts serving HTTP)."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn


class PromptExitServer(uvicorn.Server):
    """uvicorn's main loop looks at ``should_exit`` every 0.1 s, which every stop of a simulator paid;
    this one also wakes on :meth:`exit_now` (called on the server's own event loop)."""

    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    def exit_now(self) -> None:
        """Stop serving (from the server's event loop)."""
        self.should_exit = True
        if self._wake is not None:
            self._wake.set()
