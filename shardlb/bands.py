"""Band moves: how a band board carries each change of a player's total to its band shards.

A band board keeps every player's record on a hash "home" shard and indexes the ``total`` board by
points band on band shards (shardlb/sharding.py). A change of the total is applied on the home shard
by write.lua, which bumps the player's version and records the move as *pending* there, in the same
atomic call; the band shards are then updated by band.lua (one call per band shard) and, once all
have answered, the move is confirmed on the home shard (settle.lua). The new band takes the add
first; the old bands are told to drop the player's row only once it came back, so a call lost in
between leaves the player in the old band or in both (the reads keep one row per player), never in
none. Until it is confirmed, every write of that player (a retry of the same result included, which
changes nothing else) sends the move again, and so does ``repair``, which the archiver runs on every
band board every few seconds (shardlb/archive.py, ``repair_bands``): a move whose band calls were
lost is finished then, whether or not the player posts again. Band ops carry the version, so a move
sent twice, late, out of order or by several processes at once ends in the state of the newest
write: the band shards converge to the home shard's (version, total) whatever failed in between.

A removal (shardlb/moderation.py: moderation, or the inactive cleanup) bumps the version once more
and drops the player from every band at it, so every band shard keeps the version as a tombstone
against a late move. Those versions are forgotten once the removal is older than the dedup window
(an hour at least): ``prune``, run by the same repair loop, so a board whose players churn keeps
versions for the players it holds and the recent removals, not for everyone who ever posted.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import ResponseError

from shardlb import keys, times
from shardlb.fanout import batch

if TYPE_CHECKING:
    from shardlb.board import Board
    from shardlb.fanout import ScriptPipeline


class Move(NamedTuple):
    """A change of one player's total that the band shards may not all have taken yet."""

    player: str
    after: int | None  # the total score on the home shard (None: the player was removed there)
    version: int
    pending: str  # comma-separated band indices that may still hold an old row ('' for none)


# Pending moves a repair reads and sends at a time (HSCAN's COUNT hint): a backlog left by a band
# shard that was away is worked through in calls of bounded size.
REPAIR_CHUNK = 500

# Pages of REPAIR_CHUNK a prune pass reads at most of one home shard's list of removed players. The
# players it must keep (a removal still pending: a band shard failing for them) stay at the head of
# the list, and a pass reading only its first page would read them again and again and never reach
# the players behind: it pages on past them instead, this far, so a pass stays bounded.
PRUNE_PAGES = 8


# A removed player's versions are kept this long after the removal at the least, whatever the
# board's dedup window: a band move made before the removal (a call held in a client's retries
# through a failover, a repair that read the move just before) has landed or been given up by then.
FORGET_AFTER_MIN_MS = 3_600_000


class BandMoves:
    def __init__(self, board: Board) -> None:
        self.board = board

    async def finish(self, home: int, moves: Sequence[Move], pipeline: ScriptPipeline | None = None) -> None:
        """Send ``moves`` (all of players living on ``home``) to the band shards, adds before drops
        (``_send``), then confirm them. A failure raises and leaves them pending, to be sent again
        later. With ``pipeline``, the calls ride the per-node pipelines of the calls made in the
        same turn: a batch spread over many home shards moves players into many bands at once, and
        each of those calls would otherwise take a connection of its own (a board of 16 shards and
        16 bands ran out of them)."""
        await self._send(moves, pipeline)
        await self._confirm(home, moves, pipeline)

    async def repair(self) -> int:
        """Finish every pending move of the board; return how many players had one.

        One HLEN per home shard first (one pipeline per node): a board with nothing pending costs
        no more. Each player's version, pending bands and total are read as of one version on their
        home shard (``_settled``: no MULTI, which a primary out of memory refuses), so the move sent
        is the one of that version, and settle.lua confirms it only while the version is still that
        one: beside a newer write of the player, or another repair, the versioned band ops leave the
        newest state, and the move stays pending until it is sent."""
        board = self.board
        homes = range(board.config.sharding.shards)
        pipe = batch(board.client)
        for home in homes:
            pipe.execute_command("HLEN", keys.pending_key(board.prefixes[home]))
        done = 0
        for home, count in zip(homes, await pipe.execute(), strict=True):
            if int(count):
                done += await self._repair_home(home)
        return done

    async def _repair_home(self, home: int) -> int:
        prefix = self.board.prefixes[home]
        done, cursor = 0, 0
        while True:
            cursor, listed = await self.board.client.hscan(
                keys.pending_key(prefix), cursor, count=REPAIR_CHUNK
            )
            moves = await self._pending(prefix, [str(p) for p in listed]) if listed else []
            if moves:
                await self.finish(home, moves)
                done += len(moves)
            if not cursor:
                return done

    async def finish_pending(self, home: int, players: list[str]) -> None:
        """Send the pending moves of ``players`` (home shard ``home``) again, as ``repair`` does: a
        removal retried where its first call's home part held but its band part may have been lost."""
        moves = await self._pending(self.board.prefixes[home], players)
        if moves:
            await self.finish(home, moves)

    async def _pending(self, prefix: str, players: list[str]) -> list[Move]:
        """The pending moves of ``players`` on the home shard ``prefix``, each as of one version
        (``_settled``)."""
        rows = await self._settled(prefix, players)
        return [
            Move(player, None if total is None else int(total), int(version), pending)
            for player, version, pending, total in rows
            if version is not None and pending is not None  # confirmed meanwhile: nothing to send
        ]

    async def _settled(
        self, prefix: str, players: list[str], removals: bool = False
    ) -> list[tuple[Any, ...]]:
        """(player, version, pending bands, total[, removal time]) on the home shard ``prefix``, for
        those of ``players`` whose version is the same before and after the reads.

        One round trip of plain reads, the versions read first and again last, not a MULTI: a
        primary out of memory refuses every MULTI, reads too, and the repair and the prune must go
        on there (neither grows memory on the home shard: settle.lua and prune.lua only delete
        there). Every change of a player's total, pending move or removal (write.lua, remove.lua)
        draws a new version in the same call, so a player whose two versions agree was read as of
        that version, as in a MULTI; one that changed between is left out, for the call that
        changed it sends its own move, and the next pass reads them again. settle.lua's
        confirmation between the reads keeps the version: the move read pending is sent again,
        which the versioned band ops take as the no-op it is."""
        async with self.board.client.pipeline(transaction=False) as pipe:
            pipe.hmget(keys.version_key(prefix), players)
            pipe.hmget(keys.pending_key(prefix), players)
            pipe.zmscore(keys.period_key(prefix, "total"), players)
            if removals:
                pipe.zmscore(keys.removed_versions_key(prefix), players)
            pipe.hmget(keys.version_key(prefix), players)
            before, *read, after = await pipe.execute()
        rows = zip(players, before, after, *read, strict=True)
        return [(player, version, *rest) for player, version, again, *rest in rows if version == again]

    async def prune(self, now_ms: int | None = None) -> int:
        """Forget the versions of players removed longer ago than the dedup window (at least
        FORGET_AFTER_MIN_MS); return how many. Per home shard and call, fewer than twice
        REPAIR_CHUNK players leave the list, and PRUNE_PAGES pages of it are read at most
        (``_prune_home``: past the removals still pending, which stay at its head).

        The home shard lists them (``vrm``, remove.lua). One ZRANGEBYSCORE per home shard (one
        pipeline per node) first: a board with none to forget costs no more. Each player's version,
        pending move, total and removal time are read as of one version on their home shard
        (``_settled``); a player
        still gone there, their removal confirmed (nothing pending) and still that old (not removed
        again since the listing), is forgotten on every band shard (prune.lua:
        only a version at most the removal's, and no row), then, once every band answered, on the
        home shard, only while nothing changed there. Bands first: a router of the release before
        numbers a player without a version from 1 again, so no band may keep one after the home
        shard forgot it (a call that fails leaves the home's version, and the player listed)."""
        board = self.board
        now = times.now_ms() if now_ms is None else now_ms
        cutoff = now - max(board.config.dedup_window_s * 1000, FORGET_AFTER_MIN_MS)
        homes = range(board.config.sharding.shards)
        pipe = batch(board.client)
        for home in homes:
            key = keys.removed_versions_key(board.prefixes[home])
            pipe.execute_command("ZRANGEBYSCORE", key, "-inf", cutoff, "LIMIT", 0, REPAIR_CHUNK)
        done = 0
        for home, listed in zip(homes, await pipe.execute(), strict=True):
            if listed:
                done += await self._prune_home(home, [str(p) for p in listed], cutoff)
        return done

    async def _prune_home(self, home: int, players: list[str], cutoff: int) -> int:
        """Prune ``players``, the oldest page of the home shard's list, then page on past the
        players who stayed listed (a removal still pending) while each page was full, until
        REPAIR_CHUNK players or more left the list or PRUNE_PAGES pages were read. The next page
        starts after as many entries as stayed: should the list change meanwhile (another pass, a
        repair), a page reads some again or skips some, which the next pass reads from the head."""
        key = keys.removed_versions_key(self.board.prefixes[home])
        done = stayed = left = 0
        for page in range(PRUNE_PAGES):
            if page:
                listed = await self.board.client.zrangebyscore(
                    key, "-inf", cutoff, start=stayed, num=REPAIR_CHUNK
                )
                players = [str(p) for p in listed]
                if not players:
                    break
            forgotten, kept = await self._prune_page(home, players, cutoff)
            done, stayed, left = done + forgotten, stayed + kept, left + len(players) - kept
            if len(players) < REPAIR_CHUNK or left >= REPAIR_CHUNK:
                break
        return done

    async def _prune_page(self, home: int, players: list[str], cutoff: int) -> tuple[int, int]:
        """Prune ``players`` of the home shard ``home``; return how many were forgotten, and how
        many the home shard keeps listed whatever happens (gone from the board, a move pending)."""
        prefix = self.board.prefixes[home]
        # The removal's time is read with its version: a player removed again since the listing
        # (posted and removed anew) holds the version of a recent removal, whose tombstones the
        # bands keep against the late band calls of that post. A player whose version moved during
        # the reads is not forgotten (prune.lua takes them off the list if they posted again).
        rows = await self._settled(prefix, players, removals=True)
        gone = {
            player: int(version)
            for player, version, pending, total, at in rows
            if version is not None and pending is None and total is None and at is not None and at <= cutoff
        }
        kept = sum(1 for _, _, pending, total, _ in rows if pending is not None and total is None)
        await self.forget(gone)
        args: list[Any] = [cutoff]
        for player in players:  # 0: only to leave `vrm` (posted again, or forgotten meanwhile)
            args += [player, gone.get(player, 0)]
        key_list = [
            keys.period_key(prefix, "total"), keys.version_key(prefix), keys.index_key(prefix),
            keys.gone_key(prefix), keys.pending_key(prefix), keys.removed_versions_key(prefix),
            keys.version_floor_key(prefix),
        ]  # fmt: skip
        try:
            return int(await self.board.scripts.prune(keys=key_list, args=args)), kept
        except ResponseError as e:
            raise self.board.gone(e) from e

    async def forget(self, versions: dict[str, int]) -> None:
        """Forget on every band shard the versions of players gone from the board, each only where
        it is at most the one given and the player has no row (prune.lua)."""
        if not versions:
            return
        args: list[Any] = [0]
        for player, version in versions.items():
            args += [player, version]
        prefixes, board = self.board.prefixes, self.board
        calls = [
            [
                keys.period_key(prefixes[s], "total"),
                keys.version_key(prefixes[s]),
                keys.index_key(prefixes[s]),
                keys.gone_key(prefixes[s]),
            ]
            for s in range(board.config.sharding.shards, board.layout.physical)
        ]
        try:
            await asyncio.gather(*(board.scripts.prune(keys=k, args=args) for k in calls))
        except ResponseError as e:
            raise board.gone(e) from e

    async def _send(self, moves: Sequence[Move], pipeline: ScriptPipeline | None = None) -> None:
        """The band calls of ``moves``: every add first (and the drops of removed players, which
        have no add), then, once those came back, the drops of the old rows."""
        board, layout = self.board, self.board.layout
        adds: dict[int, list[Any]] = defaultdict(list)
        drops: dict[int, list[Any]] = defaultdict(list)
        for m in moves:
            new = None if m.after is None else layout.band_shard(board.codec.decode_units(m.after)[0])
            if new is not None:
                adds[new] += ["a", m.player, m.after, m.version]
            for index in filter(None, m.pending.split(",")):
                old = layout.sharding.shards + int(index)
                if old != new:
                    (adds if new is None else drops)[old] += ["r", m.player, 0, m.version]
        await self._call(adds, pipeline)
        await self._call(drops, pipeline)

    async def _call(self, ops: dict[int, list[Any]], pipeline: ScriptPipeline | None) -> None:
        """One band.lua call per band shard of ``ops``, concurrently (merged per turn in ``pipeline``)."""
        if not ops:
            return
        prefixes, band = self.board.prefixes, self.board.scripts.band
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
            raise self.board.gone(e) from e

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
