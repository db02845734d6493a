"""Rank estimates from per-shard score histograms held in RAM (``estimate=true`` on player reads).

For each view asked about, every shard of the view is sampled by ``sample.lua``: its size and the rows
at ranks 0, s, 2s, ..., last (an equi-depth histogram: each bucket holds the same number of players,
so the error is even over the whole board). A row (score, player) then has, in each shard, a number
of players ahead between L (one past the rank of the worst sampled row above it) and U (the rank of
the best sampled row not above it), and its board rank lies in [1 + sum L, 1 + sum U]. The estimate is
the middle of that interval and ``rank_error`` half its width, rounded up: a guaranteed bound on the
distance from the exact rank *as of the snapshot* (``as_of``). Writes after ``as_of`` are not in it.

With ``samples`` K per shard the error is at most about N / (2K) for a board of N players, whatever
the number of shards; shards of at most K + 1 players are sampled whole, so small boards are exact.
The snapshots are refreshed every ``refresh_s`` seconds by one task per worker, one view at a time,
and dropped when idle. Each sampling call holds a permit of its primary's script gate.
"""

from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from redis.asyncio.cluster import RedisCluster

from router import metrics
from router.budget import BoundedScript
from router.gate import NodeGates
from router.refresh import Refreshed
from shardlb import times
from shardlb.board import Board
from shardlb.errors import Rebuilding
from shardlb.merge import Row
from shardlb.reads import ResolvedView

if TYPE_CHECKING:
    from router.boards import Boards

_HIT, _MISS = metrics.CACHE.labels("histogram", "hit"), metrics.CACHE.labels("histogram", "miss")
MAX_VIEWS = 1_000

_Key = ResolvedView


@dataclass(frozen=True)
class ShardSample:
    """One shard's size and sampled rows, worst first (ascending, for bisect), with best-first ranks."""

    size: int
    rows: list[Row]
    ranks: list[int]

    def ahead(self, row: Row) -> tuple[int, int]:
        """Bounds (L, U) on how many of this shard's rows rank ahead of ``row``."""
        i = bisect.bisect_right(self.rows, row)
        low = self.ranks[i] + 1 if i < len(self.rows) else 0
        high = self.ranks[i - 1] if i > 0 else self.size
        return low, high


@dataclass(frozen=True)
class Estimate:
    rank: int
    error: int
    players: int
    as_of_ms: int

    @property
    def percentile(self) -> float:
        return 100.0 * (self.players - self.rank) / self.players if self.players else 0.0


@dataclass
class Snapshot:
    board: Board
    shards: list[ShardSample]
    as_of_ms: int

    def estimate(self, row: Row) -> Estimate:
        """Rank of ``row`` from the samples: the middle of the guaranteed interval, and its half-width."""
        low = high = 0
        for shard in self.shards:
            lo, hi = shard.ahead(row)
            low += lo
            high += hi
        ahead = (low + high) // 2
        players = max(sum(s.size for s in self.shards), high + 1)
        return Estimate(ahead + 1, max(ahead - low, high - ahead), players, self.as_of_ms)


def parse_sample(reply: list[object]) -> ShardSample:
    """``sample.lua``'s flat reply as a ShardSample."""
    size = int(str(reply[0]))
    members, scores, ranks = reply[1::3], reply[2::3], reply[3::3]
    rows = [(float(str(s)), str(m)) for m, s in zip(members, scores, strict=True)][::-1]
    return ShardSample(size, rows, [int(str(r)) for r in ranks][::-1])


class Histograms:
    """Per-worker equi-depth histograms of the views read with ``estimate=true``."""

    def __init__(
        self,
        client: RedisCluster,
        gates: NodeGates,
        samples: int = 1024,
        refresh_s: float = 5.0,
        idle_s: float = 300.0,
        max_samples: int | None = None,
    ) -> None:
        source = resources.files("router").joinpath("sample.lua").read_text()
        self.script = BoundedScript(client, source, gates)
        self.samples = samples
        self.boards: Boards | None = None  # the board cache, once the service has made it
        self._views: Refreshed[_Key, Snapshot] = Refreshed(
            "histogram",
            self._refetch,
            refresh_s,
            idle_s,
            MAX_VIEWS,
            drop_after=1,
            max_weight=max_samples,
            weigh=lambda snapshot: sum(len(shard.rows) for shard in snapshot.shards),
        )

    @property
    def kept_samples(self) -> int:
        """The samples kept, all views together (at most ``max_samples``)."""
        return self._views.weight

    async def load_script(self, client: RedisCluster) -> None:
        """Put the sampling script on every primary (at start-up, with the library's scripts)."""
        self.script.sha = await client.script_load(self.script.script)

    async def estimate(self, board: Board, view: ResolvedView, row: Row) -> Estimate:
        """The estimated rank of ``row`` in a view, from the kept snapshot (built on first use)."""
        key = view  # equal views (two spellings of one period) share one entry
        try:
            board.check_view(view)  # a board being rebuilt: no estimate from shards not rebuilt yet
        except Rebuilding:
            self.forget(board.config.id)  # nor from what was kept (router/cache.py, TopCache)
            raise
        kept = self._views.get(key)
        if kept is not None and (kept.board is board or kept.board.config == board.config):
            _HIT.inc()
            kept.board = board  # the current Board, not the first one read (router/cache.py, TopCache.top)
            return kept.estimate(row)
        _MISS.inc()
        snapshot = await self._views.load(key, lambda: self._sample(key, board))
        return snapshot.estimate(row)

    def forget(self, board_id: str) -> None:
        """Drop every kept snapshot of ``board_id`` (a player was removed: ``TopCache.forget``)."""
        self._views.forget(lambda view: view.board == board_id)

    async def run(self) -> None:
        """Refresh every kept snapshot forever (router/refresh.py). One that cannot be refreshed is
        dropped at once: it would state a bound for an ever older board."""
        await self._views.run()

    async def _refetch(self, key: _Key, kept: Snapshot) -> Snapshot:
        board = kept.board if self.boards is None else await self.boards.current(kept.board, key)
        if board is None:  # dropped, as the top cache's views (router/cache.py)
            self._views.forget(lambda view: view == key)
            return kept
        return await self._sample(key, board)

    async def _sample(self, key: _Key, board: Board) -> Snapshot:
        as_of = times.now_ms()
        async with metrics.redis_call("histogram"):
            replies = await asyncio.gather(*(self.script(keys=[k], args=[self.samples]) for k in key.keys))
        return Snapshot(board, [parse_sample(r) for r in replies], as_of)
