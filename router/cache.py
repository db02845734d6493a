"""The top-N cache: the top of each board/period/region that is read, kept in RAM and refreshed.

The first read of a view fetches its top live (at least ``MIN_FETCH`` rows, or the limit asked for
if larger; through ``live``, the read gate) and keeps it; from then on one task per worker re-reads
every kept view about once every ``refresh_s`` seconds, at the largest limit fetched so far, and
reads slice it. The refresh reads one view at a time, outside the read gate: it takes one
connection per primary, and a flood of reads can neither starve it nor be crowded by it. ``as_of``
is the time the kept copy was read. A view nobody read for ``idle_s`` seconds is dropped, as is a
copy that could not be refreshed for ``STALE_REFRESHES`` rounds, so a broken cluster is reported,
not hidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from router import metrics
from router.gate import Gate
from shardlb import times
from shardlb.board import Board
from shardlb.reads import ResolvedView

log = logging.getLogger("shardlb.router")
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
    read_at: float


class TopCache:
    """Per-worker cache of top-N lists keyed by resolved view."""

    def __init__(
        self, fetch: Fetch, refresh_s: float = 1.0, idle_s: float = 60.0, live: Gate | None = None
    ) -> None:
        self.fetch = fetch
        self.live = live
        self.refresh_s = refresh_s
        self.idle_s = idle_s
        self._views: dict[_Key, _Top] = {}
        self._loading: dict[_Key, asyncio.Future[_Top]] = {}

    def __len__(self) -> int:
        return len(self._views)

    async def top(self, board: Board, view: ResolvedView, limit: int) -> tuple[Rendered, int]:
        """The best ``limit`` entries of a view and the epoch ms they were read at (cached or live)."""
        key = view  # equal views (two spellings of one period) share one entry
        kept = self._views.get(key)
        if kept is not None and self._fits(kept, board, limit):
            kept.read_at = time.monotonic()
            _HIT.inc()
            return kept.entries[:limit], kept.as_of_ms
        _MISS.inc()
        want = max(
            limit, MIN_FETCH, kept.limit if kept is not None and kept.board.config == board.config else 0
        )
        loading = self._loading.get(key)
        if loading is None or loading.done():
            loading = asyncio.ensure_future(self._load(key, board, want, live=True))
            self._loading[key] = loading
        try:
            fresh = await asyncio.shield(loading)
        finally:
            if loading.done() and self._loading.get(key) is loading:
                del self._loading[key]
        if not self._fits(fresh, board, limit):
            fresh = await self._load(key, board, max(want, limit), live=True)
        return fresh.entries[:limit], fresh.as_of_ms

    async def run(self) -> None:
        """Refresh every kept view forever, dropping idle ones (one task per worker runs this)."""
        failures: dict[_Key, int] = {}
        while True:
            await asyncio.sleep(self.refresh_s)
            now = time.monotonic()
            for key, kept in list(self._views.items()):
                if now - kept.read_at > self.idle_s:
                    self._views.pop(key, None)
            for key in list(self._views):
                view = self._views.get(key)
                if view is None:
                    continue
                try:
                    await self._load(key, view.board, view.limit)
                except Exception as outcome:
                    failures[key] = failures.get(key, 0) + 1
                    if failures[key] >= STALE_REFRESHES:
                        self._views.pop(key, None)
                    if failures[key] == 1:
                        log.warning(
                            "top refresh failed", extra={"fields": {"view": key, "error": repr(outcome)}}
                        )
                else:
                    failures.pop(key, None)
            for key in list(failures):
                if key not in self._views:
                    del failures[key]

    async def _load(self, key: _Key, board: Board, limit: int, live: bool = False) -> _Top:
        as_of = times.now_ms()
        if live and self.live is not None:
            async with self.live:
                entries = await self.fetch(board, key, limit)
        else:
            entries = await self.fetch(board, key, limit)
        previous = self._views.get(key)
        read_at = previous.read_at if previous is not None else time.monotonic()
        kept = _Top(board, limit, entries, as_of, read_at)
        if previous is None or previous.as_of_ms <= as_of:
            if previous is None and len(self._views) >= MAX_VIEWS:
                with contextlib.suppress(StopIteration):
                    self._views.pop(min(self._views, key=lambda k: self._views[k].read_at))
            self._views[key] = kept
        return kept

    @staticmethod
    def _fits(kept: _Top, board: Board, limit: int) -> bool:
        # A short list (the whole view) serves any limit; a changed board never serves.
        return (limit <= kept.limit or len(kept.entries) < kept.limit) and (
            kept.board is board or kept.board.config == board.config
        )
