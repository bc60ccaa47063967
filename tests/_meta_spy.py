"""A LocalBudget that records what every acquire call was given: the lease meta the budget receives (targets,
``age_s``, elastic fields) and the ticket, for the tests of targets (issue 30)."""

from __future__ import annotations

from typing import Any

from zp_client import LocalBudget

TARGET_KEYS = ("ttft_target_s", "tpot_target_s")


class MetaSpy(LocalBudget):
    """``calls``: one ``(meta or None, ticket)`` per acquire, sync or async, in order."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("limit_blocks", 1000)
        super().__init__(**kw)
        self.calls: list[tuple[dict[str, Any] | None, Any]] = []

    def _seen(self, kw: dict[str, Any]) -> None:
        meta = kw.get("meta")
        self.calls.append((None if meta is None else dict(meta), kw.get("ticket")))

    async def acquire(self, blocks: int, **kw: Any) -> Any:
        self._seen(kw)
        return await super().acquire(blocks, **kw)

    def acquire_sync(self, blocks: int, **kw: Any) -> Any:
        self._seen(kw)
        return super().acquire_sync(blocks, **kw)

    @property
    def metas(self) -> list[dict[str, Any] | None]:
        return [m for m, _ in self.calls]

    def granted(self) -> int:
        return int(self.status_sync().extra["granted"])


def targets(meta: dict[str, Any] | None) -> dict[str, Any]:
    """The target keys of a lease meta (``age_s`` aside: it changes with every acquire)."""
    return {k: v for k, v in (meta or {}).items() if k in TARGET_KEYS}
