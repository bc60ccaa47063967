"""THROWAWAY until zp_client.budget.local lands: a polling strict budget for transport tests."""
from __future__ import annotations

import itertools
import threading
import time

import anyio

from zp_client.budget.base import Budget, BudgetStatus, Lease, Ticket
from zp_client.errors import AdmissionTimeout, LeaseTooLarge

_ids = itertools.count()


class _L(Lease):
    def __init__(self, b, blocks, priority, ticket, held):
        self.b, self.bound, self.priority, self.ticket, self._held = b, blocks, priority, ticket, held
        self.id = str(next(_ids))
        self._released = False

    @property
    def held(self):
        return self._held

    @property
    def released(self):
        return self._released

    def report_held(self, blocks):
        self._held = min(self.bound, blocks)

    async def release(self):
        self.release_sync()

    def release_sync(self):
        with self.b.lock:
            if not self._released:
                self._released = True
                self.b.used -= self.bound
                self.b.live.discard(self)


class TmpBudget(Budget):
    def __init__(self, limit_blocks, block_size=16):
        self._limit, self.block_size, self.used = limit_blocks, block_size, 0
        self.lock = threading.Lock()
        self.live = set()
        self.waiting = 0
        self._order = itertools.count()

    @property
    def limit(self):
        return self._limit

    def _try(self, blocks, priority, ticket, held):
        if blocks > self._limit:
            raise LeaseTooLarge(blocks, self._limit)
        with self.lock:
            if self.used + blocks <= self._limit:
                self.used += blocks
                lease = _L(self, blocks, priority, ticket or Ticket(priority, next(self._order)), held or blocks)
                self.live.add(lease)
                return lease
        return None

    async def acquire(self, blocks, *, priority=0, timeout=None, ticket=None, held=None):
        end = None if timeout is None else time.monotonic() + timeout
        self.waiting += 1
        try:
            while (lease := self._try(blocks, priority, ticket, held)) is None:
                if end is not None and time.monotonic() > end:
                    raise AdmissionTimeout("timed out")
                await anyio.sleep(0.005)
            return lease
        finally:
            self.waiting -= 1

    def acquire_sync(self, blocks, *, priority=0, timeout=None, ticket=None, held=None):
        end = None if timeout is None else time.monotonic() + timeout
        self.waiting += 1
        try:
            while (lease := self._try(blocks, priority, ticket, held)) is None:
                if end is not None and time.monotonic() > end:
                    raise AdmissionTimeout("timed out")
                time.sleep(0.005)
            return lease
        finally:
            self.waiting -= 1

    async def status(self):
        from zp_client.budget.base import ClassStatus
        return BudgetStatus(self._limit, self.used, max(0, self._limit - self.used),
                            sum(l.held for l in self.live), len(self.live),
                            {0: ClassStatus(self.waiting, 0)} if self.waiting else {})

    async def set_limit(self, limit):
        self._limit = limit
