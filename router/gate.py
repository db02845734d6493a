"""A concurrency limit that refuses instead of queueing without bound.

At most ``limit`` holders at once and at most ``queue`` waiting; past that ``enter`` raises
Overloaded at once, which the router answers with 503 and Retry-After. This keeps a burst of reads
from turning into redis-py's MaxConnectionsError storm or into unbounded memory.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from shardlb.errors import Overloaded


class Gate:
    def __init__(self, limit: int, queue: int) -> None:
        self.limit = limit
        self.queue = queue
        self._sem = asyncio.Semaphore(limit)
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    async def __aenter__(self) -> None:
        if self._sem.locked():
            if self._waiting >= self.queue:
                raise Overloaded("too many reads in flight", retry_after=1.0)
            self._waiting += 1
            try:
                await self._sem.acquire()
            finally:
                self._waiting -= 1
        else:
            await self._sem.acquire()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._sem.release()
