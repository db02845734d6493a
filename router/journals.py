"""How far the archive is behind, as this router sees the journals: for /metrics and /readyz.

A check reads each journaled board's shards (XLEN, the oldest entry's id and the results counts,
through a small client of its own that leaves replies undecoded; one pipeline per node for up to
``journal.LAGS_AT_ONCE`` journals at a time) and keeps the worst journal, the one nearest either
bound: its entries and results not yet archived and the age of the oldest. Writes to a shard whose
journal reaches a bound are refused with 503 (write.lua); the gauges show it coming.

The journals are the cluster's, not the worker's: one check every ``every_s`` seconds serves every
worker of every router. A check publishes its reading (``keys.JOURNAL_LAG``, living ``every_s``),
and each worker's loop takes that reading while it lives; once it has expired, the worker that gets
the lease (``keys.JOURNAL_LAG_LEASE``, SET NX) checks and publishes, and the others keep their last
view meanwhile. Until 2026-12-06 every worker read every journal itself every ``every_s``: with
2,000 boards of 10 shards, 60,000 commands a check, one after another (7 s on loopback, longer than
the interval), in each worker of each router.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster

from router import metrics
from shardlb import keys
from shardlb.journal import Lag, journal_lags
from shardlb.outage import Outage
from shardlb.reshard import RELEASE_LEASE
from shardlb.store import BoardStore

log = logging.getLogger("shardlb.router")
# How long the worker checking the journals holds the lease at most: a check that outlives it (or a
# worker killed mid-check) lets another worker check too.
LEASE_MS = 60_000


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
        """Read every journal once; return the worst, publish it for the other workers (the module
        docstring), and keep it unless a newer check was kept."""
        self.begun += 1
        mine = self.begun
        worst = Worst(None, Lag(0, 0.0), self.worst.bound, self.worst.results_bound)
        # Boards made again only for records that changed since the last check (making every one
        # held the checking worker's event loop 200 ms at 2,000 boards, each check until
        # 2026-12-06); the store keeps them between checks (18 MB at 2,000 boards of 10 shards),
        # and reads the registry only when its version moved, or once a minute (``follow``).
        journals = [
            (board.config.id, keys.journal_key(prefix))
            for board in await self.store.follow()
            if board.config.durability == "journal"
            for prefix in board.prefixes
        ]
        if self.closed:
            return worst
        lags = await journal_lags(self.raw, [key for _, key in journals])
        for (board_id, _), lag in zip(journals, lags, strict=True):
            if (worst.share(lag), lag.seconds) > (worst.share(worst.lag), worst.lag.seconds):
                worst = Worst(board_id, lag, worst.bound, worst.results_bound)
        if self._keep(worst, mine):  # an older check's view is not published over a newer one
            oldest_ms = int((time.time() - worst.lag.seconds) * 1000)
            reading = {"board": worst.board, "entries": worst.lag.entries, "results": worst.lag.results}
            await self.raw.set(keys.JOURNAL_LAG, orjson.dumps({**reading, "oldest_ms": oldest_ms}),
                               px=max(1, int(self.every_s * 1000)))  # fmt: skip
        return worst

    async def look(self) -> None:
        """The loop's turn: take the reading another worker published while it lives; else check,
        if this worker gets the lease (else another worker is checking: keep the last view)."""
        self.begun += 1
        mine = self.begun
        published = await self.raw.get(keys.JOURNAL_LAG)
        if published is not None:
            got = orjson.loads(published)
            seconds = 0.0 if not got["entries"] else max(0.0, time.time() - got["oldest_ms"] / 1000)
            lag = Lag(int(got["entries"]), seconds, int(got["results"]))
            self._keep(Worst(got["board"], lag, self.worst.bound, self.worst.results_bound), mine)
            return
        token = secrets.token_hex(8)
        if not await self.raw.set(keys.JOURNAL_LAG_LEASE, token, nx=True, px=LEASE_MS):
            return
        try:
            await self.check()
        finally:
            # Only while it is still this worker's: a check that outlived it (until 2026-12-06 a
            # plain DEL) let another take it, whose lease a DEL would end, and a third check too.
            await self.raw.eval(RELEASE_LEASE, 1, keys.JOURNAL_LAG_LEASE, token)

    def _keep(self, worst: Worst, mine: int) -> bool:
        if mine < self.kept:
            return False
        self.worst, self.kept = worst, mine
        metrics.JOURNAL_ENTRIES.set(worst.lag.entries)
        metrics.JOURNAL_RESULTS.set(worst.lag.results)
        metrics.JOURNAL_SECONDS.set(worst.lag.seconds)
        return True

    async def run(self) -> None:
        while not self.closed:
            try:
                await self.look()
            except Exception as e:  # the cluster is in trouble: /readyz says so on its own
                self.outage.failed(e)
            else:
                self.outage.succeeded()
            if not self.closed:  # closed during a check whose cancellation redis-py swallowed: no wait
                await asyncio.sleep(self.every_s)
