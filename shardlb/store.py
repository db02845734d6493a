"""The board registry: create, confirm, list, fetch and delete boards."""

from __future__ import annotations

import time

import orjson
from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.board import Board
from shardlb.client import Scripts
from shardlb.config import BoardConfig, check_id
from shardlb.errors import BoardConflict, BoardNotFound

CACHE_SECONDS = 5.0


class BoardStore:
    """Boards live in one registry hash (``lb:boards``: id -> settings JSON). Fetched boards are kept
    for CACHE_SECONDS, so a board deleted through another process may take writes that long."""

    def __init__(self, client: RedisCluster, scripts: Scripts) -> None:
        self.client = client
        self.scripts = scripts
        self._cache: dict[str, tuple[float, Board]] = {}

    async def create(self, config: BoardConfig) -> tuple[Board, bool]:
        """Create the board, or confirm an identical one. Returns (board, created)."""
        body = orjson.dumps(config.to_dict())
        created = bool(await self.client.hsetnx(keys.BOARDS, config.id, body))
        if not created:
            existing = await self.get(config.id, fresh=True)
            if existing.config != config:
                raise BoardConflict(f"board {config.id!r} exists with other settings", "board")
            return existing, False
        board = Board(self.client, config, self.scripts)
        self._cache[config.id] = (time.monotonic(), board)
        return board, True

    async def get(self, board_id: str, fresh: bool = False) -> Board:
        check_id(board_id, "board")
        hit = self._cache.get(board_id)
        if hit and not fresh and time.monotonic() - hit[0] < CACHE_SECONDS:
            return hit[1]
        raw = await self.client.hget(keys.BOARDS, board_id)
        if raw is None:
            self._cache.pop(board_id, None)
            raise BoardNotFound(f"no board {board_id!r}", "board")
        board = Board(self.client, BoardConfig.from_dict(board_id, orjson.loads(raw)), self.scripts)
        self._cache[board_id] = (time.monotonic(), board)
        return board

    async def list(self) -> list[BoardConfig]:
        raw = await self.client.hgetall(keys.BOARDS)
        configs = (BoardConfig.from_dict(str(k), orjson.loads(v)) for k, v in raw.items())
        return sorted(configs, key=lambda c: c.id)

    async def delete(self, board_id: str) -> None:
        """Unregister the board, then UNLINK every key its shards' key indexes list."""
        board = await self.get(board_id, fresh=True)
        await self.client.hdel(keys.BOARDS, board_id)
        self._cache.pop(board_id, None)
        pipe = self.client.pipeline(transaction=False)
        for prefix in board.prefixes:
            pipe.zrange(keys.index_key(prefix), 0, -1)
        listed = await pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for prefix, names in zip(board.prefixes, listed, strict=True):
            for name in [*names, keys.index_key(prefix)]:
                pipe.execute_command("UNLINK", name)
        await pipe.execute()
