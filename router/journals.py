"""How far the archive is behind, as this router sees the journals: for /metrics and /readyz.

Every ``every_s`` seconds the watcher reads each journaled board's shards (XLEN, the oldest
entry's id and the results counts, through a small client of its own that leaves replies
undecoded) and keeps the worst journal, the one nearest either bound: its entries and results not
yet archived and the age of the oldest. Writes to a shard whose journal reaches a bound are refused
with 503 (write.lua); the gauges show it coming.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster

from router import metrics
from shardlb import keys
from shardlb.journal import Lag, journal_lag
from shardlb.outage import Outage
from shardlb.store import BoardStore

log = logging.getLogger("shardlb.router")


@dataclass
class Worst:
    """The journal furthest behind (None when no board keeps one), and the bounds writes stop at:
    ``bound`` in entries, ``results_bound`` in results not yet archived."""

    board: str | None
    lag: Lag
    bound: int
    results_bound: int

    def body(self) -> dict[str, Any]:
        return {"board": self.board, "entries": self.lag.entries, "seconds": round(self.lag.seconds, 1),
                "bound": self.bound, "results": self.lag.results,
                "results_bound": self.results_bound}  # fmt: skip

    def share(self, lag: Lag) -> float:
        """How near ``lag`` is to the nearer of the two bounds (1.0: writes are refused)."""
        return max(lag.entries / self.bound, lag.results / self.results_bound)


class JournalWatch:
    def __init__(
        self, raw: RedisCluster, store: BoardStore, bound: int, results_bound: int, every_s: float = 5.0
    ) -> None:
        self.raw = raw
        self.store = store
        self.every_s = every_s
        self.worst = Worst(None, Lag(0, 0.0), bound, results_bound)
        # redis-py has been seen swallowing a task's cancellation inside its retries: the loop also
        # ends on this flag, which Service.stop sets before it cancels.
        self.closed = False
        self.outage = Outage(log, "journal lag not read", "journal lag read again")
        # Checks may overlap (the loop's and a caller's): a check's view is kept only if no check
        # begun after it has been kept already, so an older view never replaces a newer one.
        self.begun = 0
        self.kept = 0

    async def check(self) -> Worst:
        """Read every journal once; return the worst, and keep it unless a newer check was kept."""
        self.begun += 1
        mine = self.begun
        worst = Worst(None, Lag(0, 0.0), self.worst.bound, self.worst.results_bound)
        for board in await self.store.boards():
            if self.closed:
                break
            if board.config.durability != "journal":
                continue
            for prefix in board.prefixes:  # one call at a time: the client has two connections a node
                lag = await journal_lag(self.raw, keys.journal_key(prefix))
                if (worst.share(lag), lag.seconds) > (worst.share(worst.lag), worst.lag.seconds):
                    worst = Worst(board.config.id, lag, worst.bound, worst.results_bound)
        if mine < self.kept:
            return worst
        self.worst, self.kept = worst, mine
        metrics.JOURNAL_ENTRIES.set(worst.lag.entries)
        metrics.JOURNAL_RESULTS.set(worst.lag.results)
        metrics.JOURNAL_SECONDS.set(worst.lag.seconds)
        return worst

    async def run(self) -> None:
        while not self.closed:
            try:
                await self.check()
            except Exception as e:  # the cluster is in trouble: /readyz says so on its own
                self.outage.failed(e)
            else:
                self.outage.succeeded()
            if not self.closed:  # closed during a check whose cancellation redis-py swallowed: no wait
                await asyncio.sleep(self.every_s)
