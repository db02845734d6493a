"""Band moves: how a band board carries each change of a player's total to its band shards.

A band board keeps every player's record on a hash "home" shard and indexes the ``total`` board by
points band on band shards (shardlb/sharding.py). A change of the total is applied on the home shard
by write.lua, which bumps the player's version and records the move as *pending* there, in the same
atomic call; the band shards are then updated by band.lua (one call per band shard) and, once all
have answered, the move is confirmed on the home shard (settle.lua). Until it is confirmed, every
write of that player (a retry of the same result included, which changes nothing else) sends the
move again, and ``Board.repair`` sends every pending move of the board. Band ops carry the version,
so a move sent twice, late or out of order ends in the state of the newest write: the band shards
converge to the home shard's (version, total) whatever failed in between.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import ResponseError

from shardlb import keys

if TYPE_CHECKING:
    from shardlb.board import Board
    from shardlb.fanout import ScriptPipeline


class Move(NamedTuple):
    """A change of one player's total that the band shards may not all have taken yet."""

    player: str
    after: int  # the total score on the home shard
    version: int
    pending: str  # comma-separated band indices that may still hold an old row ('' for none)


class BandMoves:
    def __init__(self, board: Board) -> None:
        self.board = board

    async def finish(self, home: int, moves: Sequence[Move], pipeline: ScriptPipeline | None = None) -> None:
        """Send ``moves`` (all of players living on ``home``) to the band shards, then confirm them.
        A failure raises and leaves them pending, to be sent again later. With ``pipeline``, the
        calls ride the per-node pipelines of the calls made in the same turn: a batch spread over
        many home shards moves players into many bands at once, and each of those calls would
        otherwise take a connection of its own (a board of 16 shards and 16 bands ran out of them)."""
        await self._send(moves, pipeline)
        await self._confirm(home, moves, pipeline)

    async def repair(self) -> int:
        """Finish every pending move of the board; return how many players had one."""
        board = self.board
        done = 0
        for home in range(board.config.sharding.shards):
            prefix = board.prefixes[home]
            pending: dict[Any, Any] = await board.client.hgetall(keys.pending_key(prefix))
            if not pending:
                continue
            players = list(pending)
            versions = await board.client.hmget(keys.version_key(prefix), players)
            totals = await board.client.zmscore(keys.period_key(prefix, "total"), players)
            moves = [
                Move(player, int(total), int(version), pending[player])
                for player, version, total in zip(players, versions, totals, strict=True)
                if version is not None and total is not None
            ]
            await self.finish(home, moves)
            done += len(moves)
        return done

    async def _send(self, moves: Sequence[Move], pipeline: ScriptPipeline | None = None) -> None:
        board, layout = self.board, self.board.layout
        ops: dict[int, list[Any]] = defaultdict(list)
        for m in moves:
            new = layout.band_shard(board.codec.decode_units(m.after)[0])
            ops[new] += ["a", m.player, m.after, m.version]
            for index in filter(None, m.pending.split(",")):
                old = layout.sharding.shards + int(index)
                if old != new:
                    ops[old] += ["r", m.player, 0, m.version]
        prefixes, band = board.prefixes, board.scripts.band
        calls = [
            (
                [
                    keys.period_key(prefixes[s], "total"),
                    keys.version_key(prefixes[s]),
                    keys.index_key(prefixes[s]),
                    keys.gone_key(prefixes[s]),
                ],
                args,
            )
            for s, args in ops.items()
        ]
        try:
            if pipeline is None:
                await asyncio.gather(*(band(keys=k, args=a) for k, a in calls))
            else:
                await asyncio.gather(*(pipeline.call(band, k, a, merge=True) for k, a in calls))
        except ResponseError as e:
            raise board.gone(e) from e

    async def _confirm(
        self, home: int, moves: Sequence[Move], pipeline: ScriptPipeline | None = None
    ) -> None:
        prefix = self.board.prefixes[home]
        args: list[Any] = []
        for m in moves:
            args += [m.player, m.version]
        settle, key_list = self.board.scripts.settle, [keys.version_key(prefix), keys.pending_key(prefix)]
        if pipeline is None:
            await settle(keys=key_list, args=args)
        else:
            await pipeline.call(settle, key_list, args)
