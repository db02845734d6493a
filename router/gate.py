"""Concurrency limits that refuse instead of queueing without bound, in count or in time.

A Gate lets at most ``limit`` holders in at once and at most ``queue`` wait, each for at most
``wait_s`` seconds; past either bound ``acquire`` raises Overloaded (503 with Retry-After) instead of
waiting longer. Waiters are served first come, first served. NodeGates keeps one Gate per cluster
primary. router/README.md ("Connections per primary") adds up what the gates allow. Admission bounds
the requests a worker handles at once, and never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator
from types import TracebackType

from shardlb.errors import Overloaded
from shardlb.loops import LoopRef

UNBOUNDED = 1 << 62


class _Expired(Exception):
    """A waiter's time ran out before a permit came free."""


class Gate:
    def __init__(self, limit: int, queue: int = UNBOUNDED, wait_s: float = 1.0, what: str = "calls") -> None:
        self.limit = limit
        self.queue = queue
        self.wait_s = wait_s
        self.what = what
        self._free = limit
        # Invariant: while a permit is free, nobody waits (release hands permits to waiters first).
        # Waiters that expired or were cancelled stay in the deque, marked done, until release skips them.
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._waiting = 0
        self._loop = LoopRef()  # a busy gate makes a waiter per acquire (shardlb/loops.py)

    @property
    def held(self) -> int:
        return self.limit - self._free

    @property
    def waiting(self) -> int:
        return self._waiting

    async def acquire(self, wait_s: float | None = None) -> None:
        """Take a permit, waiting at most ``wait_s`` (default: the gate's); else raise Overloaded."""
        if self._free:
            self._free -= 1
            return
        if self._waiting >= self.queue:
            raise Overloaded(f"too many {self.what} waiting; retry shortly", retry_after=1.0)
        loop = self._loop.get()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        self._waiting += 1
        timer = loop.call_later(self.wait_s if wait_s is None else wait_s, self._expire, waiter)
        try:
            await waiter
        except _Expired:
            raise Overloaded(f"no room for more {self.what} in time; retry shortly", 1.0) from None
        except asyncio.CancelledError:
            if waiter.cancelled():
                self._waiting -= 1
            elif waiter.exception() is None:
                self.release()  # a permit was handed over just as this task was cancelled: pass it on
            raise
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def spare(self) -> Iterator[None]:
        """Hold a permit that is free now, else raise Overloaded at once: for a background loop that
        must never wait in the queue ahead of requests, nor take a place in it (router/boards.py,
        ``Boards.follow``). While a permit is free nobody waits, so this takes none from a waiter."""
        if not self._free:
            raise Overloaded(f"no {self.what} permit free now", retry_after=1.0)
        self._free -= 1
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._waiting -= 1
                waiter.set_result(None)
                return
        self._free += 1

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._waiting -= 1
            waiter.set_exception(_Expired())

    async def __aenter__(self) -> None:
        if self._free:  # ``acquire``'s first step, without making its coroutine
            self._free -= 1
            return
        await self.acquire()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class NodeGates:
    """One Gate per cluster primary (by node name), made on first use with the same bounds."""

    def __init__(self, limit: int, wait_s: float, what: str) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self.what = what
        self._gates: dict[str, Gate] = {}

    def __call__(self, node: str) -> Gate:
        gate = self._gates.get(node)
        if gate is None:
            gate = self._gates[node] = Gate(self.limit, wait_s=self.wait_s, what=f"{self.what} to {node}")
        return gate

    def held(self) -> dict[str, int]:
        """Permits held now, per node (for tests and debugging)."""
        return {node: gate.held for node, gate in self._gates.items()}


class Admission:
    """At most ``limit`` requests handled at once; one more is refused (Overloaded) without waiting,
    since a request that waits here already holds its connection and its body."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def __enter__(self) -> None:
        if self.held >= self.limit:
            raise Overloaded(f"more than {self.limit} requests at once; retry shortly", retry_after=1.0)
        self.held += 1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.held -= 1
