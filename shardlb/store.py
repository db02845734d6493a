"""The board registry: create, confirm, list, fetch and delete boards.

Boards live in one registry hash (``lb:boards``: id -> record JSON, the settings plus the board's
incarnation), and the ids of those whose record names a reshard under way in an index beside it
(``keys.RESHARDS``, written with the record by registry.lua: ``resharding``). Every change of a
record (its creation too) moves the registry's version (``keys.BOARDS_VERSION``) in the same
registry.lua call, so a reader that holds the registry reads it again only when it moved
(``follow``), and writes the record's digest beside it (``keys.BOARDS_DIGESTS``), so a router that
compares the records it keeps reads only those that changed (``digests``). The incarnation is
drawn at creation and is part of every key name of the board (shardlb/keys.py), so a board deleted
and created again never meets its former data.

Deleting is retry-safe and leaves nothing behind: the record is first marked ``deleting`` (from then
on the board reads as missing), then every shard is dropped by drop.lua, which sets the shard's
``gone`` marker and unlinks its keys in one call (a late write from a router that still holds the
board is refused by the marker; a reshard's mover, by its fence, removed right before), and only
then is the record removed. A delete that stopped half
way is finished by the next delete or create of that id, or by ``reclaim``.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from shardlb import keys, times
from shardlb.board import JOURNAL_MAX_ENTRIES, JOURNAL_MAX_RESULTS, Board
from shardlb.config import (
    AUTO_SHARDS,
    BoardConfig,
    Sharding,
    check_id,
    resolve_shards,
    stored_settings,
    stored_sharding,
)
from shardlb.connection import Scripts
from shardlb.errors import BoardConflict, BoardNotFound, NotAcknowledged, OutOfRange
from shardlb.fanout import Ack, confirmed

# How long routers may cache a board's settings (router/boards.py). A board deleted through one
# process keeps its shards' `gone` markers far longer, so no cached copy can write after it.
CACHE_SECONDS = 5.0
GONE_MS = 86_400_000
# Shards dropped at once: each call holds a connection to its node, and a board may have up to
# 1024 shards; all at once would outrun the client's connections per node.
DROPS_IN_FLIGHT = 16
# Registry fields that are not board settings: the layout generation and a reshard under way are
# the board's (shardlb/reshard.py). No field is added here lightly: during a rolling upgrade the
# routers of the release before read the same records, and a field unknown to them is an unknown
# setting, so they refuse every request to the board. What is new goes inside these: the sharding a
# board was created with is in ``last_reshard`` (``created``), once a reshard has changed it.
# (``created`` at the top: records written by main for a few hours on 2026-12-05, read still.)
_RECORD = ("incarnation", "state", "generation", "reshard", "last_reshard", "created")
# What every record that names a reshard under way holds (``last_reshard`` is another field):
# ``resharding`` parses only the records that hold it.
_RESHARD_FIELD = '"reshard"'
# A record's ``state`` while `rebuild --all` rebuilds the board after a loss of Redis: {REBUILDING:
# [shards not rebuilt yet]}. Inside ``state``, not a field of its own: routers of the release before
# take only "deleting" from it, and would refuse a record with an unknown field (see _RECORD).
REBUILDING = "rebuilding"
# A record's ``state`` {SENTINELS: generation}: every shard of that layout generation was given its
# sentinel (keys.sentinel_key) when it came to exist, so one missing is a shard Redis lost while the
# registry kept the board (the archiver marks it REBUILDING, ``lost``). Records of the release
# before have none: their shards are never taken for lost. The generation, not a flag: a writer of
# the record that keeps its state (a reshard's commit) leaves it naming a layout that is gone.
SENTINELS = "sentinels"
SENTINEL_ATTEMPTS = 3  # writes of a shard's sentinel lost in failovers before ``sentinels`` gives up
RESHARD_SOURCE_STATES = ("copying", "sealing")  # the registry's layout is being copied away
# ``follow`` reads the whole registry at least this often, moved or not: processes of the release
# before write records without moving the version (README, "Upgrading an install").
WHOLE_READ_EVERY_S = 60.0
# The moves of the version the change log keeps (keys.BOARDS_CHANGES, about 100 bytes each), and how
# many ``moved`` reads first: a router that follows the version every quarter second finds the
# one or two moves since its last look in that first read, and the whole log covers 500 moves a
# second between two looks (a `rebuild --all` swaps a shard at a time, far fewer).
CHANGES_KEPT = 128
CHANGES_FIRST = 8
HELD_PAGE = 500  # records a ``held`` HMGET asks at once (about 250 kB)
DIGESTS_PAGE = 2000  # digests a ``digests`` HMGET asks at once (about 40 kB)
DIGESTS_TRIES = 3  # reads of a page of digests (``digests``), each after they were made whole
DIGEST_CHARS = 16  # the hex digits of a record's SHA-1 a digest keeps (registry.lua, digests.lua)
# Reads of the registry with its version (``records``, ``moved``) made again while the version moves
# between the reads of one round trip (``records``); then what was read is held as of no version.
SETTLE_TRIES = 3
# The version ``records`` returns when the registry moved under each of its reads: equal to none, so
# a holder of that listing reads the registry again at its next look.
UNSETTLED: Any = object()


class BoardStore:
    def __init__(
        self,
        client: RedisCluster,
        scripts: Scripts,
        journal_max: int = JOURNAL_MAX_ENTRIES,
        journal_max_results: int = JOURNAL_MAX_RESULTS,
    ) -> None:
        self.client = client
        self.scripts = scripts
        # given to every Board made here (Board.journal_max, Board.journal_max_results)
        self.journal_max = journal_max
        self.journal_max_results = journal_max_results
        self.read_replicas = False  # given to every Board made here (Board.read_replicas)
        # The router's SHARDLB_ACK: a board answered created, confirmed or deleted is on a replica
        # of the registry's primary first, as a score write is on one of its shard's (``_confirm``).
        self.ack = Ack(0, 0)
        # ``boards``' last listing with ``reuse``: board id -> (its record's bytes, this store's
        # settings, the Board made of them)
        self._made: dict[str, tuple[Any, tuple[int, int, bool], Board]] = {}
        self._made_version: Any = None  # the registry's version, read with that listing
        # ``follow``'s last whole read: the version read before it, when (monotonic s), the
        # store's settings then, and the boards listed
        self._followed: tuple[Any, float, tuple[int, int, bool], list[Board]] | None = None

    async def create(self, config: BoardConfig, confirm_only: bool = False) -> tuple[Board, bool]:
        """Create the board, or confirm an identical one. Returns (board, created).

        Settings with AUTO_SHARDS (hash or band sharding that names no shard count, as the HTTP API
        reads them) create a board of one shard per master, and confirm an existing board of any
        shard count (``resolve_shards``). OutOfRange (field ``epoch``) for settings whose codec
        holds no time from now on, unless they confirm a board that exists. ``confirm_only``: never
        create; BoardNotFound when no board has the id."""
        given = config
        # Settings whose codec holds no time from now on (an epoch too old for the points_max and
        # resolution: with the default epoch, resolution "ms" ends in February 2020) would make a
        # board that refuses every write: refused here, unless they confirm a board that exists.
        codec = config.codec()
        ended = codec.last_ms < times.now_ms()
        while True:
            config = resolve_shards(given, await self.masters()) if _auto(given) else given
            record = {**config.to_dict(), "incarnation": secrets.token_hex(4), "state": {SENTINELS: 0}}
            # Read first: a PUT that confirms a board (the common one) writes no sentinel.
            raw = await self.client.hget(keys.BOARDS, config.id)
            if raw is None and confirm_only:
                raise BoardNotFound(f"no board {config.id!r}", "board")
            if raw is None and not ended:
                # The sentinels before the record that says they are there: the archiver never
                # sees the record without them. A creation that loses the race takes them back.
                board = self._board(config.id, record)
                try:
                    await self.sentinels(board.prefixes)
                except (NotAcknowledged, RedisError):
                    # No record names them (a replica that did not confirm them, under the ack):
                    # taken back, or they would stay for good, listed in no index.
                    await self._unmade(board)
                    raise
                try:
                    made = await self.swap(config.id, b"", orjson.dumps(record))
                except ResponseError:
                    # Refused before registry.lua wrote anything (a registry primary out of memory
                    # refuses its first write, the record's HSET): taken back as well. Until
                    # 2026-12-06 they stayed, and each retry (another incarnation) left as many
                    # again. A reply lost (a broken connection) may follow a record written that
                    # names them: they stay then, and so they do when the record is found to name
                    # them (a call that ran, then its client's retry refused).
                    if not await self._named(board):
                        await self._unmade(board)
                    raise
                # 0 from a call sent again after its reply was lost (redis-py's retries) whose first
                # run wrote the record: this creation's, not a race lost. Until 2026-12-06 its
                # sentinels were taken back, and the board answered confirmed (200) without them.
                if made or await self._named(board):
                    await self._confirm(config.id, record["incarnation"])
                    return board, True
                await self._unmade(board)
                continue
            if raw is None:
                if ended:
                    raise OutOfRange(
                        f"with points_max {codec.points_max} at resolution {codec.resolution!r}, scores "
                        f"hold times from {times.format_ms(codec.epoch_ms)} to "
                        f"{times.format_ms(codec.last_ms)}, all past: no result could be written. "
                        "Set an epoch near the season's start",
                        "epoch",
                    )
                continue  # deleted meanwhile
            found = orjson.loads(raw)
            if found.get("state") == "deleting":
                await self._drop(config.id, raw, found)
                continue
            existing = self._board(config.id, found).config
            layouts = [existing.sharding]
            if _resharded(found):
                # The sharding of creation, which the first reshard keeps in last_reshard: a PUT of
                # those settings still confirms the board, and only they (or the layout of now) do.
                created = found.get("created") or (found.get("last_reshard") or {}).get("created")
                if created is None:
                    # Resharded before records kept their sharding of creation, or under way: any
                    # sharding the other settings go with may have been it.
                    layouts.append(resolve_shards(given, 0, existing).sharding)
                else:
                    layouts.append(_sharding(created))
            if not any(_confirms(replace(existing, sharding=s), given) for s in layouts):
                # Named against the layout it is nearest (a resharded board's creation's, when the
                # PUT has that): until 2026-12-06 always the layout of now, so a PUT of the
                # creation's sharding was told its shard count differs too.
                near = min((_differences(replace(existing, sharding=s), given) for s in layouts), key=len)
                differ = "; ".join(near)
                raise BoardConflict(
                    f"board {config.id!r} exists with other settings" + (f": {differ}" if differ else ""),
                    "board",
                )
            # A retry of a creation answered 503 finds it made, perhaps unconfirmed.
            await self._confirm(config.id, str(found.get("incarnation", "0")))
            return self._board(config.id, found), False

    async def _unmade(self, board: Board) -> None:
        """Take back the sentinels of a creation that no record names (``create``)."""
        await self.client.delete(*(keys.sentinel_key(p) for p in board.prefixes))

    async def _named(self, board: Board) -> bool:
        """Whether the registry's record of ``board``'s id names its incarnation (``create``: the
        creation's own record, written by a registry.lua call whose reply was lost)."""
        raw = await self.client.hget(keys.BOARDS, board.config.id)
        return raw is not None and str(orjson.loads(raw).get("incarnation", "0")) == board.incarnation

    async def masters(self) -> int:
        """How many masters the cluster has (what AUTO_SHARDS becomes)."""
        await self.client.initialize()  # a no-op once the client knows the cluster
        return len(self.client.get_primaries())

    async def restore(
        self, config: BoardConfig, incarnation: str, generation: int = 0, rebuilding: Sequence[int] = ()
    ) -> tuple[Board, bool]:
        """Register a board under the incarnation (and layout generation) it had (a rebuild after
        Redis lost the registry, shardlb/rebuild.py), so its keys and its rows in PostgreSQL are
        found again. Returns (board, registered); a board already in the registry is returned as it
        is there, whatever its incarnation. ``rebuilding``: the shards not rebuilt yet, which the
        record names (``state``) until ``rebuilt`` takes them off (``Board.rebuilding``)."""
        record: dict[str, Any] = {**config.to_dict(), "incarnation": incarnation}
        if generation:
            record["generation"] = generation
        if rebuilding:
            # Each shard's swap writes its sentinel before it takes the shard off (shardlb/rebuild.py):
            # only a restore that names every shard says the layout carries them.
            physical = self.layout(config, incarnation, generation).layout.physical
            every = set(rebuilding) == set(range(physical))
            record["state"] = {REBUILDING: sorted(rebuilding), **({SENTINELS: generation} if every else {})}
        if await self.swap(config.id, b"", orjson.dumps(record)):
            return self._board(config.id, record), True
        return await self.get(config.id), False

    async def rebuilt(self, board_id: str, incarnation: str, shards: Iterable[int]) -> None:
        """Take ``shards`` off the shards the board's record names not rebuilt (``restore``), the
        mark gone with the last of them; through ``swap``, so the registry's version moves and
        routers fetch the record again. Nothing when the record is another incarnation's, being
        deleted, or names none of them."""
        done = set(shards)
        while True:
            raw = await self.client.hget(keys.BOARDS, board_id)
            if raw is None:
                return
            record = orjson.loads(raw)
            if str(record.get("incarnation", "0")) != incarnation:
                return
            left = not_rebuilt(record)
            if not left & done:
                return
            if await self.swap(board_id, raw, orjson.dumps(_marked(record, left - done))):
                return

    async def unbuilt(self, board: Board, shards: Iterable[int]) -> None:
        """Mark ``shards`` of ``board`` not rebuilt (REBUILDING), whatever their sentinels say: a
        band board's band shards about to be rebuilt from a home shard that is not rebuilt, which
        would leave them inexact (``Rebuilder.rebuild``). Through ``swap``, so routers fetch the
        record again. Nothing when the record is gone, another incarnation's or layout's, names a
        reshard, is being deleted, or names them already."""
        wanted = set(shards)
        while True:
            raw = await self.client.hget(keys.BOARDS, board.config.id)
            if raw is None:
                return
            record = orjson.loads(raw)
            if (
                str(record.get("incarnation", "0")) != board.incarnation
                or int(record.get("generation", 0)) != board.generation
                or record.get("reshard")
                or not isinstance(record.get("state"), dict | None)
            ):
                return
            left = not_rebuilt(record)
            if wanted <= left:
                return
            if await self.swap(board.config.id, raw, orjson.dumps(_marked(record, left | wanted))):
                return

    async def lost(self, board: Board, shards: Iterable[int]) -> list[int]:
        """Mark ``shards`` of ``board`` not rebuilt (REBUILDING) because their sentinels are
        missing: Redis lost them while the registry kept the board (the archiver's finding,
        shardlb/archive.py). Reads and writes that touch one are refused until `shardlb rebuild
        BOARD --shard N` swaps it in (``rebuilt``). Returns the shards marked by this call.

        Each sentinel is read again after the record and before the compare-and-set, and once more
        after it: a whole rebuild of the shard writes its sentinel before it takes the mark off, so
        a rebuild that ran between the archiver's look and this call either changed the record (the
        compare-and-set fails and the sentinel is found) or wrote the sentinel, found then, and the
        mark made is taken off again here. Nothing when the record is another incarnation's or
        layout's, being deleted, or no longer says the layout carries sentinels."""
        wanted = set(shards)
        while True:
            raw = await self.client.hget(keys.BOARDS, board.config.id)
            if raw is None:
                return []
            record = orjson.loads(raw)
            if not _watched(record, board):
                return []
            left = not_rebuilt(record)
            missing = [s for s in sorted(wanted - left) if not await self._sentinel(board, s)]
            if not missing:
                return []
            if await self.swap(board.config.id, raw, orjson.dumps(_marked(record, left | set(missing)))):
                break
        back = [s for s in missing if await self._sentinel(board, s)]
        if back:
            await self.rebuilt(board.config.id, board.incarnation, back)
        return [s for s in missing if s not in back]

    async def watched(self, board: Board) -> set[int] | None:
        """The shards the registry's record of ``board`` names not rebuilt, read now, when the record
        is still that incarnation's and layout's, names no reshard, is not being deleted and says the
        layout carries sentinels (the shards ``lost`` would mark); else None."""
        raw = await self.client.hget(keys.BOARDS, board.config.id)
        if raw is None:
            return None
        record = orjson.loads(raw)
        return not_rebuilt(record) if _watched(record, board) else None

    async def carry(self, board: Board) -> None:
        """Record that every shard of ``board``'s layout carries its sentinel (SENTINELS), once a
        whole rebuild wrote them all (shardlb/rebuild.py): a board created by the release before
        has none until then. Nothing when the record says so already, is another incarnation's
        or layout's, names a reshard or is being deleted."""
        while True:
            raw = await self.client.hget(keys.BOARDS, board.config.id)
            if raw is None:
                return
            record = orjson.loads(raw)
            state = record.get("state")
            if (
                str(record.get("incarnation", "0")) != board.incarnation
                or int(record.get("generation", 0)) != board.generation
                or record.get("reshard")
                or not isinstance(state, dict | None)
                or carries_sentinels(record) == board.generation
            ):
                return
            new = {**record, "state": {**(state or {}), SENTINELS: board.generation}}
            if await self.swap(board.config.id, raw, orjson.dumps(new)):
                return

    async def _sentinel(self, board: Board, shard: int) -> bool:
        return bool(await self.client.exists(keys.sentinel_key(board.prefixes[shard])))

    async def sentinels(self, prefixes: Iterable[str]) -> None:
        """Set the sentinel of each shard of ``prefixes`` (keys.sentinel_key), DROPS_IN_FLIGHT at once,
        confirmed as ``ack`` asks (fanout.confirmed): one a failover lost before a replica had it
        is set again. Unconfirmed, a creation answered after such a failover left its shard taken
        for lost though it lost nothing (write.lua's SHARDLOST, the archiver's mark)."""
        gate = asyncio.Semaphore(DROPS_IN_FLIGHT)

        async def put(prefix: str) -> None:
            async with gate:
                await self.client.set(keys.sentinel_key(prefix), 1)

        todo = list(prefixes)
        for _ in range(SENTINEL_ATTEMPTS):
            # Every put answered before one's error is raised: the caller takes them back
            # (``create``), which a put still in flight would outlive.
            for outcome in await asyncio.gather(*(put(p) for p in todo), return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
            if not self.ack.replicas:
                return
            replies = await confirmed(self.client, self.ack, [("EXISTS", keys.sentinel_key(p)) for p in todo])
            for reply in replies:
                if isinstance(reply, BaseException):
                    raise reply
            todo = [p for p, there in zip(todo, replies, strict=True) if not there]
            if not todo:
                return
        raise NotAcknowledged(
            f"{len(todo)} shard sentinels were lost again and again before a replica held them (failovers?); "
            "retrying is safe"
        )

    async def get(self, board_id: str, deleting: bool = False) -> Board:
        """The board as its record is now (BoardNotFound when there is none), with the record and
        the registry's version read just before it (``Board.record``, ``record_version``): the
        record is that version's or newer. One round trip, not a MULTI: a primary out of memory
        refuses every MULTI, and boards must still be fetched there. ``deleting``: a board whose
        deletion stopped half way too (its record marked ``deleting``), which a DELETE of it
        finishes (``delete``); else it reads as missing."""
        check_id(board_id, "board")
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.get(keys.BOARDS_VERSION)  # first: read after it, the record is as new as it
            pipe.hget(keys.BOARDS, board_id)
            version, raw = await pipe.execute()
        record = None if raw is None else orjson.loads(raw)
        if record is None or (record.get("state") == "deleting" and not deleting):
            missing = BoardNotFound(f"no board {board_id!r}", "board")
            missing.record_version = version
            raise missing
        board = self._board(board_id, record)
        board.record, board.record_version = raw, version
        return board

    async def boards(self, reuse: bool = False) -> list[Board]:
        """Every board of the registry (not those being deleted).

        ``reuse``: a record whose bytes are those of the last listing made with ``reuse`` gives the
        Board made then, unless that Board has learnt since that it is deleted or moved. For a caller
        that lists the boards every few seconds and holds them between (the archiver, every 2 s:
        making a Board of every record took 170-200 ms at 2,000 boards, reading them 3 ms); the
        store then holds the listing too (18 MB at 2,000 boards of 10 shards, Boards included),
        which a router's occasional listings would keep for nothing. A Board given again is
        shared, as a router's cache shares one (router/boards.py)."""
        version, raw = await self.records()  # ``follow`` holds the listing with that version
        settings = (self.journal_max, self.journal_max_results, self.read_replicas)
        kept = self._made if reuse else {}
        made: dict[str, tuple[Any, tuple[int, int, bool], Board]] = {}
        for key, value in raw.items():
            board_id = str(key)
            last = kept.get(board_id)
            if last is not None and last[:2] == (value, settings) and not (last[2].deleted or last[2].moved):
                made[board_id] = last
                continue
            record = orjson.loads(value)
            if record.get("state") != "deleting":
                made[board_id] = (value, settings, self._board(board_id, record))
        if reuse:
            self._made, self._made_version = made, version
        return [board for _, _, board in made.values()]

    async def follow(self, whole_every_s: float = WHOLE_READ_EVERY_S) -> list[Board]:
        """``boards(reuse=True)``, read again only when the registry's version moved since the
        last read, a Board listed then has learnt since that it is deleted or moved, the store's
        settings changed, or ``whole_every_s`` passed: else the boards of the last read, at the
        cost of a GET. For callers that list the boards every few seconds (the archiver's refresh,
        the journal watch), where the registry is 1.1 MB at 2,000 boards. A listing is held with
        the version it is exactly (``records``: read before and after the registry, unchanged
        between): a change after it moves the version, and a failover that loses a change it lists
        sets the version back to another (drawn, never counted). ``whole_every_s`` bounds how late a
        record written without moving the version (by a process of the release before) is seen; a
        registry lost with Redis loses its version too."""
        version = await self.version()
        settings = (self.journal_max, self.journal_max_results, self.read_replicas)
        last = self._followed
        if (
            last is not None
            and last[0] == version
            and last[2] == settings
            and time.monotonic() - last[1] < whole_every_s
            and not any(b.stale for b in last[3])
        ):
            return list(last[3])
        at = time.monotonic()
        boards = await self.boards(reuse=True)
        # The version read with the registry, not the one above (two reads): ``boards`` sets it
        # with the listing it returns, nothing awaited between, so no other read comes in between.
        self._followed = (self._made_version, at, settings, boards)
        return list(boards)

    async def resharding(self, whole: bool = False) -> list[Board]:
        """The boards of the registry with a reshard recorded (``Board.also``), not those being
        deleted. Routers ask every few seconds (router/reshards.py), where the whole registry is
        1.1 MB at 2,000 boards: the boards are those of the index of reshards under way that
        registry.lua keeps beside the registry in the same calls (keys.RESHARDS), and only their
        records are read. ``whole``: those of the whole registry, which also finds the reshards
        recorded by processes of the release before (they write no index) and mends the index.
        Either way an id listed whose record names no reshard (one such a process ended) is
        dropped from it. The mending is registry.lua's, as the records are when it runs: a look
        that raced a change of the registry mends nothing wrong."""
        listed = {str(i) for i in await self.client.smembers(keys.RESHARDS)}
        if whole:
            raw = {str(k): v for k, v in (await self.client.hgetall(keys.BOARDS)).items()}
        else:
            ids = sorted(listed)
            values = await self.client.hmget(keys.BOARDS, ids) if ids else []
            raw = {i: v for i, v in zip(ids, values, strict=True) if v is not None}
        named = {k: orjson.loads(v) for k, v in raw.items() if _RESHARD_FIELD in str(v)}
        # as registry.lua lists them: those with a "reshard" object (cjson makes a table of a list too)
        named = {k: r for k, r in named.items() if isinstance(r.get("reshard"), dict | list)}
        wrong = listed ^ set(named) if whole else listed - set(named)
        if wrong:
            await self.scripts.registry(keys=_REGISTRY, args=["", *sorted(wrong)])
        boards = [self._board(k, r) for k, r in named.items() if r.get("state") != "deleting"]
        return [b for b in boards if b.also]

    async def records(self) -> tuple[Any, dict[str, Any]]:
        """The registry's version and its records (board id -> record JSON), the records exactly
        that version's. A holder of what it read asks the version again (``version``) to know
        whether a record has changed since (``follow``, router/boards.py). Read with the version
        before only, a change made between the two reads and then lost in a failover (which sets
        the version back) was held as if it were the version's.

        Not a MULTI: a primary out of memory refuses every MULTI, reads too, and the boards must
        still be listed there (GET /v1/boards, the archiver's refresh). One round trip of the
        version, the records and the version again: every change of a record moves the version to
        one drawn anew in the same registry.lua call, so when both reads of it agree no change came
        between, and the records are that version's, as in a MULTI. When they differ (Redis ran
        another client's change between two commands of the round trip: seldom), it is read again,
        SETTLE_TRIES times; a registry that moved under each is returned with UNSETTLED, which
        equals no version, so its holder reads it again at its next look. Left: a failover between
        the records and the second read (which the node serves in one go unless the round trip came
        in pieces) that lost a change the records hold, its promoted replica still at the first
        version: the listing is held with it until its holder reads the whole registry anyway (the
        archiver a minute on, a router's list after ``ttl_s``)."""
        version: Any = UNSETTLED
        for _ in range(SETTLE_TRIES):
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.get(keys.BOARDS_VERSION)
                pipe.hgetall(keys.BOARDS)
                pipe.get(keys.BOARDS_VERSION)
                before, raw, after = await pipe.execute()
            if before == after:
                version = before
                break
        return version, {str(k): v for k, v in raw.items()}

    async def version(self) -> Any:
        """The registry's version (``records``; None while no record was written by this release)."""
        return await self.client.get(keys.BOARDS_VERSION)

    async def moved(self, since: Any) -> tuple[Any, set[str] | None, set[str]]:
        """The registry's version now, the boards whose records changed since version ``since``,
        as the change log says (``keys.BOARDS_CHANGES``, read with the version), and
        the boards the log names from the version now back to the first move it lacks (all those
        changed, when it lacks none). None for the boards changed when the log cannot say:
        ``since`` is not in it (more moves than it keeps, a failover that set the version back), or
        a move in between is not (a process of a release before the log moves the version without
        a note). The caller then compares the records it holds (``held``). A first read of
        CHANGES_FIRST entries, then of the whole log. (A process of a release before the version
        moves nothing: README, "Upgrading an install", 19.)

        Not a MULTI, which a primary out of memory refuses, reads too (routers must go on following
        there: a delete's removal of a record is taken there, it frees memory). One round trip of
        the version, the log and the version again: both reads alike, no move came between (each
        draws a new version), and the log's newest entry is the move to that version unless that
        move was not noted, as in a MULTI. Else the log may begin with moves made after the first
        read: read again, SETTLE_TRIES times, then taken as a gap (a comparison; the moves after the
        version returned are read at the next look). A failover between the reads that lost a move
        the log holds, its promoted replica at the first version, makes the log's newest entry a
        move to another version: a gap too, never a move taken for one it was not."""
        for last in (CHANGES_FIRST - 1, CHANGES_KEPT - 1):
            for _ in range(SETTLE_TRIES):
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.get(keys.BOARDS_VERSION)
                    pipe.lrange(keys.BOARDS_CHANGES, 0, last)
                    pipe.get(keys.BOARDS_VERSION)
                    version, entries, after = await pipe.execute()
                if version == after:
                    break
            else:
                return version, None, set()
            named, whole, gap = _chain(entries, version, since)
            if whole or gap or len(entries) <= last:  # else ``since`` may be further back
                break
        return version, (named if whole else None), named

    async def held(self, board_ids: Sequence[str]) -> list[Any]:
        """The registry's records of ``board_ids`` as they are now (None: none), HELD_PAGE at a time."""
        found: list[Any] = []
        for at in range(0, len(board_ids), HELD_PAGE):
            found.extend(await self.client.hmget(keys.BOARDS, list(board_ids[at : at + HELD_PAGE])))
        return found

    async def digests(self, board_ids: Sequence[str]) -> list[str | None]:
        """The digests of the registry's records of ``board_ids`` as they are now (``digest``; None:
        no record, or none known), DIGESTS_PAGE at a time: a caller that holds records (a router,
        router/boards.py) reads only those whose digest differs from its own's. Each page is an
        HMGET read after the version, and taken when the digests are whole through it
        (registry.lua); else a process that writes none (of a release before them) moved the
        version since, and digests.lua makes every digest again first, once for every reader.

        The version first, then the HMGET (with the field '', the version the digests are whole
        through), in one round trip, not a MULTI, which a primary out of memory refuses, reads too.
        One HMGET is read at once: when its '' is the version read before it, every digest it holds
        is its record's at that version or at a later change through registry.lua (which writes
        record and digest together); a change after the version by a process that writes none is
        not in them, but it moved the version, which the caller's next look sees. A move between
        the two reads through registry.lua leaves '' at a version newer than the one read: not
        taken, digests.lua has nothing to do (its field is the version now), and the page is read
        again."""
        found: list[str | None] = []
        for at in range(0, len(board_ids), DIGESTS_PAGE):
            page = list(board_ids[at : at + DIGESTS_PAGE])
            for _ in range(DIGESTS_TRIES):
                async with self.client.pipeline(transaction=False) as pipe:
                    pipe.get(keys.BOARDS_VERSION)
                    pipe.hmget(keys.BOARDS_DIGESTS, ["", *page])
                    version, values = await pipe.execute()
                if values[0] is not None and _text(values[0]) == _text(version):
                    found.extend(None if v is None else _text(v) for v in values[1:])
                    break
                try:
                    await self.scripts.digests(keys=_DIGESTS)
                except ResponseError:  # refused (it writes; NOREPLICAS): none known, every record read
                    found.extend(None for _ in page)
                    break
            else:  # writers that write none keep moving the version: none known, every record read
                found.extend(None for _ in page)
        return found

    async def list(self) -> list[BoardConfig]:
        return configs((await self.records())[1])

    async def delete(self, board_id: str, incarnation: str | None = None) -> str:
        """Mark the board deleting, drop every shard, then remove its record (see the module docstring);
        returns the incarnation deleted. ``incarnation``: only that board; one created again under
        the id since is BoardNotFound (a season archive deletes the board it settled, not the next
        season's)."""
        check_id(board_id, "board")
        while True:
            raw = await self.client.hget(keys.BOARDS, board_id)
            if raw is None:
                raise BoardNotFound(f"no board {board_id!r}", "board")
            record = orjson.loads(raw)
            if incarnation is not None and str(record.get("incarnation", "0")) != incarnation:
                raise BoardNotFound(f"no board {board_id!r} of incarnation {incarnation!r}", "board")
            if record.get("state") != "deleting":
                marked = orjson.dumps({**record, "state": "deleting"})
                if not await self.swap(board_id, raw, marked, freeing=True):
                    continue  # changed meanwhile: look again
                raw = marked
            await self._drop(board_id, raw, record)
            deleted = str(record.get("incarnation", "0"))
            await self._confirm(board_id, deleted, deleted=True)
            return deleted

    async def reclaim(self) -> int:
        """Finish every deletion that stopped half way; return how many."""
        raw = await self.client.hgetall(keys.BOARDS)
        left = [(str(k), v) for k, v in raw.items() if orjson.loads(v).get("state") == "deleting"]
        for board_id, record in left:
            await self._drop(board_id, record, orjson.loads(record))
        return len(left)

    async def _confirm(self, board_id: str, incarnation: str, deleted: bool = False) -> None:
        """Return once, as ``ack`` asks, a replica of the registry's primary holds the board's
        record of ``incarnation`` (``deleted``: holds none of it); else raise NotAcknowledged (a
        retry is safe: the same board, or its deletion made again). The record is read back with
        the marker and WAIT of fanout.confirmed (which cover writes made on other connections too),
        made again on the new primary after a failover, where a record lost is then seen as the
        promoted replica has it. Until 2026-12-05 it confirmed with an EXISTS of the registry: a
        failover between the write and that call had the replica promoted confirm a creation (or a
        deletion) it never had, and a 201 was answered for a board then gone."""
        if not self.ack.replicas:
            return
        # A deletion's marker through marker.lua: a registry primary out of memory runs it.
        [reply] = await confirmed(self.client, self.ack, [("HGET", keys.BOARDS, board_id)], freeing=deleted)
        if isinstance(reply, BaseException):
            raise reply
        held = reply is not None and str(orjson.loads(reply).get("incarnation", "0")) == incarnation
        if held == deleted:
            raise NotAcknowledged(
                f"the registry's record of board {board_id!r} is "
                f"{'there again' if deleted else 'gone'} since it was written (a failover lost the "
                "write, or another request changed it meanwhile); retrying is safe"
            )

    def _board(self, board_id: str, record: dict[str, Any]) -> Board:
        config = _config(board_id, record)
        incarnation, generation = str(record.get("incarnation", "0")), int(record.get("generation", 0))
        board = self.layout(config, incarnation, generation)
        board.rebuilding = frozenset(not_rebuilt(record))
        # A board without a journal is held to none: nothing could rebuild a shard it lost, and a
        # refusal (write.lua's, a mark) could never be lifted; it takes the loss, as ever. Held to
        # them while a reshard is under way too: the layout the record names keeps its sentinels
        # until its keys are dropped (the old one, until the commit; the new one was given them
        # before it), and until 2026-12-06 a write to a shard lost then was answered against the
        # empty shard (docs/design-notes.md, "A shard lost alone").
        board.sentinels = carries_sentinels(record) == board.generation and config.durability == "journal"
        move = record.get("reshard")
        if move:
            board.resharding = True
            board.moving = move.get("state") in RESHARD_SOURCE_STATES
            board.reshard_ms = move.get("started_ms")
            other = move.get("from") or move
            board.also = self.layout(
                replace(config, sharding=_sharding(other["sharding"])), incarnation, int(other["generation"])
            ).prefixes
        return board

    def layout(self, config: BoardConfig, incarnation: str, generation: int) -> Board:
        """The board ``config`` under one layout generation, with this store's settings."""
        board = Board(self.client, config, self.scripts, incarnation, generation)
        board.journal_max = self.journal_max
        board.journal_max_results = self.journal_max_results
        board.read_replicas = self.read_replicas
        return board

    async def _drop(self, board_id: str, raw: bytes | str, record: dict[str, Any]) -> None:
        """Drop every shard of the marked record ``raw`` (idempotent), then remove the record."""
        board = self._board(board_id, record)
        # First, so that from the moment the registry stops listing the board (marked deleting) the
        # archiver can tell a deletion from a Redis that lost its registry (shardlb/archive.py).
        # Through marker.lua, which a primary out of memory runs, as it runs drop.lua and the
        # freeing calls of registry.lua: a deletion frees memory, and is made on a full cluster.
        await self.scripts.marker(keys=[keys.deleted_key(board_id, board.incarnation)], args=[1, GONE_MS])
        gate = asyncio.Semaphore(DROPS_IN_FLIGHT)
        moving = bool(record.get("reshard"))  # a mover holds fences only while the record has one

        async def drop(prefix: str) -> None:
            async with gate:
                # A reshard's fence first: a mover's write arriving after it is refused (FENCED), one
                # before it is unlinked by the drop. Until 2026-12-05 the fence outlived the deletion,
                # and a copy the mover had read before it landed on the shard dropped, listed in
                # its index with no expiry: if the mover then stopped before it saw the board gone
                # (killed, or another error), nothing ever removed them.
                if moving:
                    await self.client.delete(keys.fence_key(prefix))
                await self.scripts.drop(keys=[keys.index_key(prefix), keys.gone_key(prefix)], args=[GONE_MS])

        await asyncio.gather(*(drop(p) for p in board.prefixes + board.also))
        if moving:
            await self.client.delete(keys.lease_key(board_id))
        await self.swap(board_id, raw, b"", freeing=True)

    async def swap(self, board_id: str, expected: bytes | str, new: bytes, freeing: bool = False) -> bool:
        """Replace the board's record ``expected`` (b"": none, a creation) by ``new`` (b"": none,
        the record removed) and move the registry's version, in one registry.lua call; False when
        the record was not ``expected``. Every change of the registry goes through here.

        ``freeing``: a deletion's call (``new`` none, or the record marked "deleting"), made through
        registry.lua loaded with the flag allow-oom, so that a registry primary out of memory runs
        it: boards are deleted to free memory. registry.lua then takes only such a change, whose
        writes are bounded (a record 32 bytes longer at most, a version, a digest and one entry of a
        log kept at CHANGES_KEPT); any other change through it is an error that writes nothing."""
        # Drawn, not counted: a counter that a failover set back could come to a value a reader
        # holds again, with other records.
        version = secrets.token_hex(8)
        args = [board_id, expected, new, version, CHANGES_KEPT]
        if freeing:
            return bool(await self.scripts.registry_freeing(keys=_REGISTRY, args=[*args, "freeing"]))
        return bool(await self.scripts.registry(keys=_REGISTRY, args=args))


# The registry, the index of its reshards under way (``resharding``), its version (``follow``), the
# log of its moves (``moved``) and its records' digests (``digests``): registry.lua's keys, in one slot.
_REGISTRY = [keys.BOARDS, keys.RESHARDS, keys.BOARDS_VERSION, keys.BOARDS_CHANGES, keys.BOARDS_DIGESTS]
_DIGESTS = [keys.BOARDS, keys.BOARDS_DIGESTS, keys.BOARDS_VERSION]  # digests.lua's


def digest(record: str | bytes | None) -> str | None:
    """A record's digest as registry.lua writes it beside the record (``BoardStore.digests``)."""
    if record is None:
        return None
    raw = record.encode() if isinstance(record, str) else record
    return hashlib.sha1(raw, usedforsecurity=False).hexdigest()[:DIGEST_CHARS]


def _chain(entries: Sequence[Any], version: Any, since: Any) -> tuple[set[str], bool, bool]:
    """The boards the change log ``entries`` (newest first, '<before> <after> <board id>') names
    from ``version`` back, as far as they chain; whether they reach ``since``; and whether a move
    they lack stopped them (else they ran out)."""
    version, since = _text(version), _text(since)
    at, changed = version, set[str]()
    if version == since:
        return changed, True, False
    for entry in entries:
        parts = _text(entry).split(" ", 2)
        if len(parts) != 3 or parts[1] != at:
            return changed, False, True  # a move the log lacks
        before, _, board_id = parts
        changed.add(board_id)
        at = before
        if at == since:
            return changed, True, False
    return changed, False, False


def _text(value: Any) -> str:
    """A version or a log entry as text ('' for none), whatever the client decodes."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def not_rebuilt(record: dict[str, Any]) -> set[int]:
    """The shards a record names not rebuilt yet (``BoardStore.restore``)."""
    state = record.get("state")
    return {int(s) for s in state.get(REBUILDING, ())} if isinstance(state, dict) else set()


def _watched(record: dict[str, Any], board: Board) -> bool:
    """Whether ``record`` is still ``board``'s (its incarnation and layout), names no reshard and
    says the layout carries sentinels (a record being deleted says nothing of them)."""
    return (
        str(record.get("incarnation", "0")) == board.incarnation
        and int(record.get("generation", 0)) == board.generation
        and not record.get("reshard")
        and carries_sentinels(record) == board.generation
    )


def carries_sentinels(record: dict[str, Any]) -> int | None:
    """The layout generation whose shards carry sentinels, as the record says (None: none)."""
    state = record.get("state")
    found = state.get(SENTINELS) if isinstance(state, dict) else None
    return found if isinstance(found, int) else None


def _marked(record: dict[str, Any], rebuilding: set[int]) -> dict[str, Any]:
    """``record`` naming ``rebuilding`` as its shards not rebuilt (none: no such mark), what else
    its state holds kept."""
    state = record.get("state")
    kept = {k: v for k, v in state.items() if k != REBUILDING} if isinstance(state, dict) else {}
    if rebuilding:
        kept[REBUILDING] = sorted(rebuilding)
    new = {k: v for k, v in record.items() if k != "state"}
    if kept:
        new["state"] = kept
    return new


def configs(records: dict[str, Any]) -> list[BoardConfig]:
    """The settings of ``records`` (board id -> record JSON, as ``records`` reads them) but those
    being deleted, sorted by id. No Board is made: at 2,000 boards of 10 shards that took 140 of
    the 200 ms a listing cost (every shard's key prefix), settings alone 57."""
    listed = []
    for board_id in sorted(records):
        record = orjson.loads(records[board_id])
        if record.get("state") != "deleting":
            listed.append(_config(board_id, record))
    return listed


def _config(board_id: str, record: dict[str, Any]) -> BoardConfig:
    """A record's settings, as they are checked when a board is made of it."""
    return BoardConfig.from_dict(
        board_id, stored_settings({k: v for k, v in record.items() if k not in _RECORD})
    )


def _confirms(known: BoardConfig, given: BoardConfig) -> bool:
    """Whether settings ``given`` to a PUT (perhaps without a shard count) are the board ``known``."""
    return _same_but_placement(known) == _same_but_placement(resolve_shards(given, 0, known))


def _differences(known: BoardConfig, given: BoardConfig) -> list[str]:
    """Each setting in which ``given`` (a PUT's) differs from the board ``known``, in the API's
    names and JSON: the 409's message, so that the caller need not diff the two itself."""
    have = _same_but_placement(known).to_dict()
    want = _same_but_placement(resolve_shards(given, 0, known)).to_dict()
    return [
        f"{name} is {orjson.dumps(value).decode()}, not {orjson.dumps(want.get(name)).decode()}"
        for name, value in have.items()
        if name != "board" and value != want.get(name)
    ]


def _same_but_placement(config: BoardConfig) -> BoardConfig:
    """``config`` without its band placement: a PUT of a band board's settings confirms a board
    laid out before placements were chosen ("window") as the same board, not a conflict."""
    return replace(config, sharding=replace(config.sharding, placement=""))


def _auto(config: BoardConfig) -> bool:
    return config.sharding.shards == AUTO_SHARDS


def _resharded(record: dict[str, Any]) -> bool:
    return int(record.get("generation", 0)) > 0 or bool(record.get("reshard"))


def _sharding(value: dict[str, Any]) -> Sharding:
    """A sharding as the registry stores it (``Sharding.to_dict``), checked again."""
    return BoardConfig.from_dict("x", {"sharding": stored_sharding(value)}).sharding
