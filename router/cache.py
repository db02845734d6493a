"""The top-N cache: the top of each board/period/region that is read, kept in RAM and refreshed.

The first read of a view fetches its top live (at least ``MIN_FETCH`` rows, or the limit asked for
if larger; through ``live``, the read gate) and keeps it; from then on one task per worker re-reads
every kept view about once every ``refresh_s`` seconds, at the largest limit fetched so far, and
reads slice it. The refresh reads one view at a time, outside the read gate: it takes one
connection per primary, and a flood of reads can neither starve it nor be crowded by it. ``as_of``
is the time the kept copy was read. A view nobody read for ``idle_s`` seconds is dropped, as is a
copy that could not be refreshed for ``STALE_REFRESHES`` rounds, so a broken cluster is reported,
not hidden. A dated period that can hold nothing (expired, or not begun: ``Board.holds_nothing``)
is answered empty and never kept. A copy serves only readers whose board object it could have been
read through exactly: across a reshard, one refreshed through a board fetched before the reshard
began is not served to a reader whose board knows of it (``_fits``). A refresh reads through the
board as the router knows it now (``Boards.current``: looked up again when the registry's version
moved in a way that may have changed its record). The views of a board that is gone or has a shard
marked not rebuilt (a loss of Redis) are dropped, by such a refresh or by a read refused for it:
what they kept may have been read from a shard lost before anything marked it, and the first read
once the board is rebuilt reads it anew.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router import metrics
from router.gate import Gate
from router.refresh import Refreshed
from shardlb import times
from shardlb.board import Board
from shardlb.errors import Rebuilding
from shardlb.reads import ResolvedView

if TYPE_CHECKING:
    from router.boards import Boards

_HIT, _MISS = metrics.CACHE.labels("top", "hit"), metrics.CACHE.labels("top", "miss")

MIN_FETCH = 100
MAX_LIMIT = 1000
MAX_VIEWS = 10_000
STALE_REFRESHES = 10

_Key = ResolvedView
# Entries are kept rendered (api.md's dicts): a hit then only slices and serializes.
Rendered = list[dict[str, Any]]
Fetch = Callable[[Board, ResolvedView, int], Awaitable[Rendered]]


@dataclass
class _Top:
    board: Board
    limit: int
    entries: Rendered
    as_of_ms: int


class TopCache:
    """Per-worker cache of top-N lists keyed by resolved view."""

    def __init__(
        self,
        fetch: Fetch,
        refresh_s: float = 1.0,
        idle_s: float = 60.0,
        live: Gate | None = None,
        max_rows: int | None = None,
        boards: Boards | None = None,
    ) -> None:
        self.fetch = fetch
        self.live = live
        self.boards = boards
        self._views: Refreshed[_Key, _Top] = Refreshed(
            "top",
            self._refetch,
            refresh_s,
            idle_s,
            MAX_VIEWS,
            STALE_REFRESHES,
            max_weight=max_rows,
            weigh=lambda kept: len(kept.entries),
        )

    def __len__(self) -> int:
        return len(self._views)

    @property
    def rows(self) -> int:
        """The rows kept, all views together (at most ``max_rows``)."""
        return self._views.weight

    async def top(self, board: Board, view: ResolvedView, limit: int) -> tuple[Rendered, int]:
        """The best ``limit`` entries of a view and the epoch ms they were read at (cached or live)."""
        key = view  # equal views (two spellings of one period) share one entry
        now = times.now_ms()
        if board.holds_nothing(view.period, now):
            # Expired or not begun: empty by construction. Neither read nor kept, so callers asking
            # for every day of the calendar cannot fill the cache with views to refresh.
            _HIT.inc()
            return [], now
        # A board being rebuilt (shardlb/store.py, ``rebuilding``): refused, not served from what
        # was kept before Redis was lost, nor read from shards not rebuilt yet and kept; and what
        # was kept goes (module docstring).
        try:
            board.check_view(view)
        except Rebuilding:
            self.forget(board.config.id)
            raise
        kept = self._views.get(key)
        if kept is not None and self._fits(kept, board, limit):
            _HIT.inc()
            # The board cache makes a new Board every few seconds: a view keeps the current one, not
            # the one it was first read with (views first read at other moments would each keep
            # another alive, with its caches of players read).
            kept.board = board
            return kept.entries[:limit], kept.as_of_ms
        _MISS.inc()
        want = max(
            limit, MIN_FETCH, kept.limit if kept is not None and kept.board.config == board.config else 0
        )
        fresh = await self._views.load(key, lambda: self._read(key, board, want, live=True))
        if not self._fits(fresh, board, limit):
            fresh = await self._views.fetch(key, lambda: self._read(key, board, max(want, limit), live=True))
        return fresh.entries[:limit], fresh.as_of_ms

    def as_of(self, view: ResolvedView) -> int | None:
        """When the kept copy of ``view`` was read (epoch ms), or None; counted as a read of it."""
        kept = self._views.get(view)
        return None if kept is None else kept.as_of_ms

    def forget(self, board_id: str) -> None:
        """Drop every kept view of ``board_id``: a player was removed from it (router/moderation.py),
        and this worker's reads after the removal's answer must not show them."""
        self._views.forget(lambda view: view.board == board_id)

    async def run(self) -> None:
        """Refresh every kept view forever (router/refresh.py); one task per worker runs this."""
        await self._views.run()

    async def _refetch(self, key: _Key, kept: _Top) -> _Top:
        board = kept.board if self.boards is None else await self.boards.current(kept.board, key)
        if board is None:  # the copy handed back is not kept (Refreshed._keep)
            self._views.forget(lambda view: view == key)
            return kept
        return await self._read(key, board, kept.limit)

    async def _read(self, key: _Key, board: Board, limit: int, live: bool = False) -> _Top:
        as_of = times.now_ms()
        if live and self.live is not None:
            async with self.live:
                entries = await self.fetch(board, key, limit)
        else:
            entries = await self.fetch(board, key, limit)
        return _Top(board, limit, entries, as_of)

    @staticmethod
    def _fits(kept: _Top, board: Board, limit: int) -> bool:
        # A short list (the whole view) serves any limit; a changed board never serves. Nor does a
        # copy refreshed through a board object that cannot tell the layout moved: one kept from
        # before a reshard began (its reads skip Board.check_layout, so after the cut-over they
        # read the old layout, then nothing once it is dropped, and stamp it with a fresh as_of),
        # or one that learnt it was moved or deleted. The reader's board, fetched within
        # CACHE_SECONDS, knows of a reshard before its seals: the read goes live through it.
        return (limit <= kept.limit or len(kept.entries) < kept.limit) and (
            kept.board is board
            or (
                kept.board.config == board.config
                and not kept.board.stale
                and (kept.board.moving or not board.moving)
            )
        )
