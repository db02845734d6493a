"""One fetch per key at a time, and values kept per key and refreshed in the background.

``SingleFlight`` is the mechanism every cache of the router shares: while a fetch for a key is under
way, callers asking for that key wait for the same result (or the same error) instead of sending a
fetch each; a caller that gives up does not cancel it for the others. ``Refreshed`` keeps what was
fetched: one task re-fetches every kept value each ``refresh_s`` seconds, one key at a time; a key
nobody read for ``idle_s`` seconds is dropped, as is one whose refresh failed ``drop_after`` times in
a row (a cache must report a broken cluster, not hide it, in its log too: an outage is logged as
the first failure, once a minute at most, and the first pass whose refreshes all work, as an
``Outage``); past ``max_kept`` keys, or past
``max_weight`` for what the kept values weigh together (``weigh``: the top cache's rows, the
histograms' samples), the least recently read go first, and a value heavier than the whole budget
is handed to its caller but not kept: what callers can make a worker keep and refresh is bounded
in bytes, not only in keys. ``forget`` drops the values of the keys it names (a player removed from
a board: router/moderation.py) and keeps nothing a fetch begun before it read. The board cache
(router/boards.py) uses only the single flight: its entries expire instead of being refreshed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from shardlb.outage import Outage

log = logging.getLogger("shardlb.router")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    """At most one fetch per key at a time; callers arriving meanwhile share its outcome."""

    def __init__(self) -> None:
        self._running: dict[K, asyncio.Future[V]] = {}

    def __contains__(self, key: K) -> bool:
        """Whether a fetch for ``key`` is under way."""
        future = self._running.get(key)
        return future is not None and not future.done()

    async def join(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        """The outcome of the fetch under way for ``key``, starting ``fetch()`` when none is."""
        future = self._running.get(key)
        if future is None or future.done():
            future = self._running[key] = asyncio.ensure_future(fetch())
            future.add_done_callback(functools.partial(self._done, key))
        return await asyncio.shield(future)

    def forget(self, key: K) -> None:
        """Callers asking for ``key`` from now on start a fetch of their own: the one under way
        (its callers still get its outcome) may have read what has changed since."""
        self._running.pop(key, None)

    def clear(self) -> None:
        """``forget`` every key."""
        self._running.clear()

    def _done(self, key: K, done: asyncio.Future[V]) -> None:
        # A failure nobody waits for any more is not logged as never retrieved: asyncio.shield
        # marks it retrieved for each waiter that gave up.
        if self._running.get(key) is done:
            del self._running[key]


@dataclass
class _Kept(Generic[V]):
    value: V
    started: float  # when the fetch that got ``value`` started: an older one never replaces it
    read_at: float
    weight: int = 0


def _unweighed(value: object) -> int:
    return 0


class Refreshed(Generic[K, V]):
    """Values by key, fetched once at a time, refreshed by ``run`` with ``refetch(key, value)``."""

    def __init__(
        self,
        name: str,
        refetch: Callable[[K, V], Awaitable[V]],
        refresh_s: float,
        idle_s: float,
        max_kept: int,
        drop_after: int,
        max_weight: int | None = None,
        weigh: Callable[[V], int] = _unweighed,
    ) -> None:
        self.name = name
        self.refetch = refetch
        self.refresh_s = refresh_s
        self.idle_s = idle_s
        self.max_kept = max_kept
        self.drop_after = drop_after
        self.max_weight = max_weight
        self.weigh = weigh
        self.weight = 0  # what the kept values weigh together
        self._kept: OrderedDict[K, _Kept[V]] = OrderedDict()  # least recently read first
        self._flights: SingleFlight[K, V] = SingleFlight()
        self._fetching: dict[K, int] = {}  # key -> fetches under way (``fetch``)
        # key -> when ``forget`` dropped it, while a fetch begun before may still keep what it read
        self._cuts: dict[K, float] = {}
        self.outage = Outage(log, f"{name} refresh failed", f"{name} refresh works again")

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: K) -> V | None:
        """The kept value of ``key`` (None when there is none), counted as read now."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        kept.read_at = time.monotonic()
        self._kept.move_to_end(key)
        return kept.value

    async def load(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        """``fetch()``'s value, kept for ``key``; callers loading ``key`` meanwhile share it."""
        return await self._flights.join(key, lambda: self.fetch(key, fetch))

    async def fetch(self, key: K, fetch: Callable[[], Awaitable[V]]) -> V:
        """``fetch()``'s value, kept for ``key`` unless a fetch started later was kept first; not shared."""
        started = time.monotonic()
        self._fetching[key] = self._fetching.get(key, 0) + 1
        try:
            value = await fetch()
            if started >= self._cuts.get(key, started):
                self._keep(key, value, started, add=True)
        finally:
            self._fetching[key] -= 1
            if not self._fetching[key]:
                del self._fetching[key]
                self._cuts.pop(key, None)
        return value

    def forget(self, which: Callable[[K], bool]) -> None:
        """Drop the kept values of the keys ``which`` names, as read before what just changed: the
        next read of one fetches it anew, and neither a refresh nor a fetch begun before this call
        keeps what it read (its callers, who asked before, still get it)."""
        now = time.monotonic()
        for key in [k for k in self._kept if which(k)]:
            self._drop(key)
        for key in [k for k in self._fetching if which(k)]:
            self._cuts[key] = now
            self._flights.forget(key)

    async def run(self) -> None:
        """Refresh every kept value forever, dropping idle ones and ones that keep failing (one task
        per worker runs this)."""
        failures: dict[K, int] = {}
        while True:
            await asyncio.sleep(self.refresh_s)
            self._drop_idle(time.monotonic())
            refreshed = failed = 0
            for key in list(self._kept):
                kept = self._kept.get(key)
                if kept is None:
                    continue
                started = time.monotonic()
                try:
                    value = await self.refetch(key, kept.value)
                except Exception as outcome:
                    failures[key] = failures.get(key, 0) + 1
                    if failures[key] >= self.drop_after:
                        self._drop(key)
                    failed += 1
                    self.outage.failed(outcome, {"view": key})
                else:
                    failures.pop(key, None)
                    self._keep(key, value, started, add=False)  # one dropped meanwhile stays dropped
                    refreshed += 1
            if refreshed and not failed:
                self.outage.succeeded()
            for key in list(failures):
                if key not in self._kept:
                    del failures[key]

    def _keep(self, key: K, value: V, started: float, add: bool) -> None:
        kept = self._kept.get(key)
        weight = self.weigh(value)
        if kept is None:
            if not add:
                return
            if len(self._kept) >= self.max_kept:
                self._drop(next(iter(self._kept)))
            kept = self._kept[key] = _Kept(value, started, time.monotonic())
        elif kept.started <= started:
            kept.value, kept.started = value, started
            self.weight -= kept.weight
        else:
            return
        kept.weight = weight
        self.weight += weight
        if self.max_weight is not None and weight > self.max_weight:
            self._drop(key)  # heavier than the whole budget: served, not kept
            return
        while self.max_weight is not None and self.weight > self.max_weight:
            self._drop(next(k for k in self._kept if k != key))  # the least recently read first

    def _drop(self, key: K) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            self.weight -= kept.weight

    def _drop_idle(self, now: float) -> None:
        while self._kept:
            key, kept = next(iter(self._kept.items()))
            if now - kept.read_at <= self.idle_s:
                return  # the rest were read later
            self._drop(key)
