"""The board registry as requests see it: cached, one fetch per board at a time, bounded.

Every request names a board. Its settings are kept for ``ttl_s`` seconds, or until a write finds
this incarnation deleted (``Board.deleted``: another process deleted it; a new one may exist);
when they expire, the first request fetches them and the requests arriving meanwhile wait for that
same fetch instead of sending one each (a thousand writers must not all HGET the registry at once,
on one primary). Fetches, listing, creating and deleting boards share one small Gate, so the
registry takes at most ``gate.limit`` connections, on the one primary that holds it.
"""

from __future__ import annotations

import asyncio
import time

from router import metrics
from router.gate import Gate
from shardlb.board import Board
from shardlb.config import BoardConfig, check_id
from shardlb.store import CACHE_SECONDS, BoardStore

MAX_BOARDS = 10_000


class Boards:
    def __init__(self, store: BoardStore, gate: Gate, ttl_s: float = CACHE_SECONDS) -> None:
        self.store = store
        self.gate = gate
        self.ttl_s = ttl_s
        self._kept: dict[str, tuple[float, Board]] = {}
        self._loading: dict[str, asyncio.Future[Board]] = {}

    async def get(self, board_id: str) -> Board:
        """The board (BoardNotFound when there is none; InvalidInput for a malformed id)."""
        kept = self._kept.get(board_id)
        if kept is not None and time.monotonic() - kept[0] < self.ttl_s and not kept[1].deleted:
            return kept[1]
        check_id(board_id, "board")  # a malformed id is the client's 422, never a wait for the gate
        loading = self._loading.get(board_id)
        if loading is None:
            loading = self._loading[board_id] = asyncio.ensure_future(self._fetch(board_id))
            loading.add_done_callback(lambda done: self._done(board_id, done))
        return await asyncio.shield(loading)

    async def create(self, config: BoardConfig) -> tuple[Board, bool]:
        async with self.gate, metrics.redis_call("create_board"):
            made = await self.store.create(config)
        self._kept.pop(config.id, None)
        return made

    async def delete(self, board_id: str) -> None:
        async with self.gate, metrics.redis_call("delete_board"):
            await self.store.delete(board_id)
        self._kept.pop(board_id, None)

    async def list(self) -> list[BoardConfig]:
        async with self.gate, metrics.redis_call("list_boards"):
            return await self.store.list()

    async def _fetch(self, board_id: str) -> Board:
        async with self.gate, metrics.redis_call("board"):
            board = await self.store.get(board_id)
        if len(self._kept) >= MAX_BOARDS:
            self._kept.clear()
        self._kept[board_id] = (time.monotonic(), board)
        return board

    def _done(self, board_id: str, done: asyncio.Future[Board]) -> None:
        if self._loading.get(board_id) is done:
            del self._loading[board_id]
        if not done.cancelled():
            done.exception()  # its waiters have it; this only marks it retrieved when none are left
