"""Online reshard: a board moved to another layout while it takes writes and answers reads: another
shard count, hash to band board and back, or a band board to new band starts (as its scores move).

The board's registry record names its layout (``sharding`` and a layout ``generation``, part of
every key name: shardlb/keys.py). A reshard builds the next generation beside the current one and
cuts over to it; the design and its reasons are in docs/design-notes.md, "Online reshard". In
short, with the record's ``reshard`` field holding the state, so that any process can resume:

1. ``copying``. Every new shard is marked closed ('c': scripts refuse writes there), every old one
   tracked ('t': write.lua and remove.lua add each result's dedup member to the shard's ``chg``
   set). Then each old shard is copied in bounded batches (ZSCAN, SSCAN, HSCAN of every key its
   index lists: period boards, dedup and pin buckets, the activity set, the rate limit's counters,
   frozen markers) into the new shards, each member to its new home. Changes tracked meanwhile
   are copied again in rounds (the mover takes a shard's ``chg`` into ``chgw`` atomically and
   copies those players' current values), until few are left. Of a band board only the home
   shards are copied (``copied_shards``); a band target's bands are built from the totals copied.
2. ``sealing``. Every old shard gets a seal with a lease: scripts refuse writes (503, retried). The
   last changes are copied, then each old shard is marked moved ('m'), but only if its seal held
   all along and no change is left (one script call, so a lease that ran out means another round,
   never a lost write). The new layout is checked against the old (shardlb/reshard_check.py): one
   that differs is refused, dropped, and copied again at the next run (``_recopy``). Journals of
   the new shards are started past the old ones' last ids.
3. ``committed``. The record names the new layout, then the new shards are opened. Reads of the old
   layout check its markers after reading (``Board.check_layout``): one that saw a moved marker
   while the record names the new layout is refused and made again on the new one.
4. The old journals are drained by the archiver, the archive's rows re-homed to the new shard
   numbers (PostgreSQL), the old keys dropped (their 'm' markers stay a day, so a late write hears
   "moved") and the ``reshard`` field removed. The re-homing alone, to the layout the board has,
   is ``Resharder.rehome`` (`shardlb reshard BOARD --rehome`): for an archive restored from a
   backup taken before a reshard.

A reshard can be cancelled until it is committed: the request is recorded in ``reshard``, a mover
carries it out at its next step, the markers go, the new keys are dropped, and the old layout never
stopped being the whole board. The commit (step 3) is refused in the same compare-and-set of the
record when the request is there, so a cancel recorded after the mover's last check still wins;
a cancel that comes after the commit is refused ("committed already"): either answer is true.

One mover at a time: it holds a lease on the board, and takes the reshard with an epoch, in the
record and in a fence on every shard of both layouts, that each of its calls checks (``_take``,
reshard_copy.FENCED). A mover that stalled past its lease, or whose board was deleted and created
again, changes nothing once another has taken over. One that died leaves the lease to run out, and
a router resumes its reshard once the lease has been free for ``LEASE_MS`` (router/reshards.py, since
2026-12-05; before, only `--resume` or the admin endpoint's resume did).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from importlib import resources
from typing import Any, NoReturn

import orjson
from redis.asyncio.cluster import RedisCluster

from shardlb import keys, pgconn, times
from shardlb.board import Board, band_shards, rebuilding
from shardlb.config import BoardConfig, Sharding, stored_sharding
from shardlb.errors import BoardConflict, BoardNotFound, InvalidInput, NotAcknowledged
from shardlb.fanout import batch
from shardlb.reshard_check import Mismatch, differences
from shardlb.reshard_copy import FENCE, FENCE_MS, FENCED, Copier, Lost, Writes, fence_key, fenced, lost
from shardlb.sharding import player_hash
from shardlb.store import (
    CACHE_SECONDS,
    GONE_MS,
    REBUILDING,
    SENTINELS,
    BoardStore,
    carries_sentinels,
    not_rebuilt,
)

log = logging.getLogger("shardlb.reshard")


def _lease_ms() -> int:
    """10 s, or SHARDLB_RESHARD_LEASE_MS: for tests only, which kill a mover process and would
    otherwise wait out its whole lease before another may take the board (README, "Tests")."""
    raw = os.environ.get("SHARDLB_RESHARD_LEASE_MS", "")
    if not raw:
        return 10_000
    if not raw.isdigit() or int(raw) < 100:
        raise ValueError(f"SHARDLB_RESHARD_LEASE_MS must be whole milliseconds from 100, got {raw!r}")
    return int(raw)


LEASE_MS = _lease_ms()  # the mover's lease on the board; refreshed while it works, so a dead one ends soon
# How long a mover's start is said (``Resharder.announce``) before its lease: its gap is a few
# milliseconds, but covers its look at PostgreSQL (``_reach_archive``, which may take the connect
# timeout, 10 s, to fail) and the wait for a lease another mover let go a moment ago.
STARTING_MS = 15_000


def cli_cache_s() -> float:
    """How long routers may keep a board (CACHE_SECONDS), as a mover the CLI runs waits it out before
    it seals; or SHARDLB_RESHARD_CACHE_S: for tests only, with no router or one that keeps a board
    for less (README, "Tests"). A router's own movers wait its own cache's time."""
    raw = os.environ.get("SHARDLB_RESHARD_CACHE_S", "")
    if not raw:
        return CACHE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= CACHE_SECONDS:
        raise ValueError(f"SHARDLB_RESHARD_CACHE_S must be seconds from 0 to {CACHE_SECONDS:g}, got {raw!r}")
    return value


SEAL_MS = 10_000  # how long a seal holds writes back; the mover finishes well within it
MOVED_MS = 86_400_000  # how long an old shard answers "moved" after its keys are dropped
QUIET = 2_000  # tracked changes left at which the mover seals
ROUNDS = 20  # copy rounds of tracked changes before it seals whatever is left
SEAL_TRIES = 5
DRAIN_S = 120.0  # how long the mover waits for the archiver to drain the old journals
STATES = ("copying", "sealing", "committed")
# The archive's tables whose rows name a shard (a rebuild reads them by it): _rehome moves them.
REHOMED = ("match_results", "match_holds", "match_later", "player_removals", "removal_records")

# Mark a sealed shard moved, only if the seal held and nothing is left to copy (fenced: KEYS[1]
# and ARGV[1] are the shard's fence and the mover's epoch, reshard_copy.FENCED).
_MOVE = (
    FENCED
    + """
if redis.call('GET', KEYS[3]) ~= ARGV[2] or redis.call('SCARD', KEYS[4]) > 0
   or redis.call('EXISTS', KEYS[5]) == 1 then
  return 0
end
redis.call('SET', KEYS[2], 'm', 'PX', ARGV[3])
redis.call('DEL', KEYS[3])
return 1
"""
)
# A journal's last-generated id ('0-0' when there is none); XINFO STREAM would also send its first
# entry, whose MessagePack a decoding client cannot read.
_LAST_ID = """
if redis.call('EXISTS', KEYS[1]) == 0 then return '0-0' end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then return info[i + 1] end
end
return '0-0'
"""
# Undo a sealing that failed before the commit: the old layout takes writes again (fenced, so
# only by the mover that holds the reshard: never on the seals and moves of another).
_UNSEAL = (
    FENCED
    + """
if redis.call('GET', KEYS[2]) == 'm' then redis.call('SET', KEYS[2], 't') end
redis.call('DEL', KEYS[3])
return 1
"""
)
# drop.lua on a shard, only while its fence holds the mover's epoch (KEYS[3], ARGV[2]); its
# `#!lua` line (allow-oom) stays the first.
_FLAGS, _, _DROP_BODY = (resources.files("shardlb.scripts") / "drop.lua").read_text().partition("\n")
_DROP = (
    _FLAGS
    + """
if redis.call('GET', KEYS[3]) ~= ARGV[2] then
  return redis.error_reply('FENCED another mover took this reshard over')
end
"""
    + _DROP_BODY
)
# Take the lease: free, or this mover's already.
_LEASE = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Extend the lease, only while it is this mover's: one that ran out, or went with the board, is
# not taken again by a keeper that cannot know what happened meanwhile.
_KEEP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
# Let a lease go (KEYS[1] the lease, ARGV[1] its holder's token), only if it is still the holder's: a
# mover's, or the journal watch's (router/journals.py).
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


def copied_shards(board: Board) -> list[str]:
    """The prefixes of the shards a reshard copies from ``board``: every shard of a hash board; the
    home shards of a band board, which hold every player's total and periods. Its bands only index
    the totals (and may lag them by a move not yet taken), so the next layout's bands are built from
    the totals copied (reshard_copy.Copier), never from the old bands."""
    return board.prefixes[: board.config.sharding.shards]


HEADROOM = 1.25  # a reshard started by `shardlb bands --apply` wants this times the copy's bytes free


async def layout_bytes(client: RedisCluster, board: Board) -> int:
    """What the board's keys take in Redis now (MEMORY USAGE, 5 samples a key, of every key its
    shards' indexes list): about what a reshard's copy will take beside them until the cut-over."""
    names: list[str] = []
    for prefix in board.prefixes:
        names += [str(n) for n in await client.zrange(keys.index_key(prefix), 0, -1)]
    total = 0
    for start in range(0, len(names), 64):
        sizes = await asyncio.gather(*(client.memory_usage(n, samples=5) for n in names[start : start + 64]))
        total += sum(int(size or 0) for size in sizes)
    return total


async def masters_free(client: RedisCluster) -> list[int | None]:
    """Each master's bytes below its maxmemory (None: no maxmemory set)."""
    info: Any = await client.info("memory", target_nodes=client.PRIMARIES)
    nodes = [info] if "used_memory" in info else list(info.values())  # one primary: its reply alone
    return [
        max(int(node["maxmemory"]) - int(node["used_memory"]), 0) if int(node["maxmemory"]) else None
        for node in nodes
    ]


def short_of_memory(need: int, free: list[int | None], headroom: float = HEADROOM) -> str | None:
    """Why a copy of ``need`` bytes, spread over the masters, would not fit below their maxmemory
    with ``headroom`` to spare; None when it fits (or no master has a maxmemory)."""
    per_master = need * headroom / max(len(free), 1)
    tight = [f for f in free if f is not None and f < per_master]
    if not tight:
        return None
    return (
        f"a copy of the board takes about {need / 2**20:.1f} MiB beside it until the cut-over; "
        f"with {headroom}x to spare that is {per_master / 2**20:.1f} MiB a master, and "
        f"{len(tight)} of {len(free)} masters have less free below their maxmemory "
        f"(least: {min(tight) / 2**20:.1f} MiB): add memory or masters first"
    )


class Resharder:
    """Moves one board to another layout (see the module docstring). ``say`` gets progress."""

    def __init__(
        self,
        store: BoardStore,
        board_id: str,
        say: Callable[[str], None] = print,
        postgres_url: str | None = None,
        cache_s: float = CACHE_SECONDS,
        drain_s: float = DRAIN_S,
    ) -> None:
        self.store = store
        self.client: RedisCluster = store.client
        self.board_id = board_id
        self.say = say
        self.postgres_url = postgres_url
        self.cache_s = cache_s  # routers may hold a record this long: the mover seals only after it
        self.drain_s = drain_s
        self.token = secrets.token_hex(8)
        self.copier = Copier(self.client, board_id)
        self.refused_ms = 0.0  # how long writes were refused at the cut-over
        self.held: Lease | None = None  # the lease of the run under way
        # The board and the reshard this mover works on (``_take``): the incarnation it found (a
        # board deleted and created again under the id is another board), and its epoch, taken in
        # the record and in every shard's fence (reshard_copy.FENCED).
        self.incarnation: str | None = None
        self.epoch: int | None = None
        # When this process first knew of the reshard (time.monotonic): it recorded the start, or
        # found it under way. The wait for the routers' caches is measured from there (``_copy``).
        self.known: float | None = None
        self.committing = False  # the sealing under way has sent its commit (``_seal``)

    # ---- the record ---------------------------------------------------------------------------

    async def record(self) -> tuple[Any, dict[str, Any]]:
        raw: Any = await self.client.hget(keys.BOARDS, self.board_id)
        if raw is None:
            raise BoardNotFound(f"no board {self.board_id!r}", "board")
        record = orjson.loads(raw)
        if record.get("state") == "deleting":
            raise BoardNotFound(f"no board {self.board_id!r}", "board")
        return raw, record

    async def _update(self, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Compare-and-set the record; ``change`` may raise to refuse. Once the mover has taken a
        reshard, a record of another incarnation (the board deleted and created again under its id)
        is refused as the board not found: the board it was moving is gone.

        The record is read back from a replica of the registry's primary before the mover goes on
        (``Copier.confirm``; NotAcknowledged stops it, for a resume), as its shard writes are
        confirmed: as written (perhaps with a cancel asked since: ``_asking``), the mover goes on;
        as it was before (the write lost in a failover), the change is made again; gone, the board
        was deleted; else (changed meanwhile) NotAcknowledged. A
        commit lost in a failover after the new layout was opened would name the old layout
        again, and a resume would find the new one apart from it and drop it with every write it
        took (``_recopy``); a lost epoch could be taken again by another mover."""
        while True:
            raw, record = await self.record()
            if self.incarnation is not None and _incarnation(record) != self.incarnation:
                raise BoardNotFound(f"board {self.board_id!r} was deleted during the reshard", "board")
            new = change(dict(record))
            written = orjson.dumps(new)
            if await self.store.swap(self.board_id, raw, written):  # with the index and the version
                held = await self.copier.confirm(keys.BOARDS, self.board_id, written)
                # Gone: deleted meanwhile, which the record read next says (BoardNotFound).
                if held is not None:
                    if orjson.loads(held) in (new, _asking(new)):
                        return new  # as written, or with a cancel recorded since: seen at the next step
                    if orjson.loads(held) != record:
                        raise NotAcknowledged(
                            f"the registry's record of {self.board_id!r} changed since the mover "
                            "wrote it (another mover, or a failover lost it?): the mover stops "
                            "here; resume it"
                        )
                # As the mover read it (the write lost in a failover): made again.

    def _layouts(self, record: dict[str, Any]) -> tuple[Board, Board]:
        """(the layout being moved away from, the one being moved to) of a reshard under way."""
        move = record["reshard"]
        current = self.store._board(self.board_id, record)
        if move["state"] in STATES[:2]:
            source = current
            target = self.store.layout(
                replace(current.config, sharding=_sharding(stored_sharding(move["sharding"]))),
                current.incarnation,
                int(move["generation"]),
            )
        else:
            target = current
            former = move["from"]
            source = self.store.layout(
                replace(current.config, sharding=_sharding(stored_sharding(former["sharding"]))),
                current.incarnation,
                int(former["generation"]),
            )
        return source, target

    # ---- commands -----------------------------------------------------------------------------

    async def _reach_archive(self) -> None:
        """Connect to the PostgreSQL given for a journaled board once before anything is done: the
        archive's move comes after the cut-over, and a server out of reach (or refusing the
        credentials) found only then left the board committed on its new layout, unfinished."""
        if not self.postgres_url or (await self.store.get(self.board_id)).config.durability != "journal":
            return
        import psycopg  # imported when used: Redis-only deployments need no PostgreSQL driver

        url = self.postgres_url
        async with await psycopg.AsyncConnection.connect(url, **pgconn.options(url)):
            pass

    async def start(self, shards: int, bands: list[int] | None = None) -> dict[str, Any]:
        """Record a reshard of the board to ``shards`` hash shards, or with ``bands`` to a band
        board of ``shards`` home shards and those bands (the mover then does it: ``run``). Asked
        again while that same reshard is under way, it returns the record as it is (a retry)."""
        await self._reach_archive()
        with _given():
            if bands is None:
                sharding = _sharding({"strategy": "hash", "shards": shards})
            else:
                sharding = _sharding({"strategy": "band", "shards": shards, "bands": bands})

        def begin(record: dict[str, Any]) -> dict[str, Any]:
            move = record.get("reshard")
            if move and not move.get("cancel") and self._layouts(record)[1].config.sharding == sharding:
                return record  # the same reshard asked again (a retry): the one under way
            if move:
                raise BoardConflict(
                    f"board {self.board_id!r} is being resharded already: resume or cancel that",
                    "board",
                )
            now = self.store._board(self.board_id, record)
            # A shard not rebuilt that the reshard copies would be copied empty: the rebuild takes
            # the old layout. A band board's band shards are never copied (``copied_shards``: the
            # new bands are built from the homes' totals), so their marks alone refuse nothing, and
            # the commit leaves them with the old layout (until 2026-12-06 they refused the start).
            waiting = now.rebuilding - set(band_shards(now))
            if waiting:
                one = len(waiting) == 1
                raise rebuilding(
                    self.board_id,
                    waiting,
                    f"reshard it once {'it is' if one else 'they are'} rebuilt",
                    band_shards(now),
                )
            if now.layout.strategy not in ("hash", "band"):
                raise BoardConflict(
                    f"only hash and band boards can be resharded; this one is a {now.layout.strategy} board",
                    "shards",
                )
            if now.config.sharding == sharding:
                what = f"these bands already ({len(bands)})" if bands else f"{_shards(shards)} already"
                raise BoardConflict(f"the board has {what}", "shards")
            if now.config.durability == "journal" and not self.postgres_url:
                raise BoardConflict(
                    "a journaled board's archive moves with it: give PostgreSQL (--postgres, "
                    "SHARDLB_POSTGRES_URL) to reshard it",
                    "board",
                )
            if bands is not None:  # the bands checked against the board's points_max, as a PUT would
                with _given():
                    BoardConfig.from_dict(
                        self.board_id, {**now.config.to_dict(), "sharding": sharding.to_dict()}
                    )
            return {
                **record,
                "reshard": {
                    "state": "copying",
                    "sharding": sharding.to_dict(),
                    "generation": now.generation + 1,
                    "from_shards": now.config.sharding.shards,
                    "started_ms": times.now_ms(),
                    "copied": [],
                },
            }

        record = await self._update(begin)
        self._knows()
        banded = f" and {len(bands)} bands" if bands else ""
        self.say(f"{self.board_id}: reshard to {_shards(shards)}{banded} recorded")
        return record

    async def run(self, wait: bool = True) -> dict[str, Any]:
        """Take the reshard under way from wherever it is to its end. Returns the final status.
        A board deleted meanwhile (BoardNotFound) has both layouts' shards dropped again first: a
        copy (or the marks) under way when the deletion dropped them may have written there since.
        The board's lease held by another process is waited for a lease (a mover that died lets
        it run out), then Busy naming a live mover; ``wait=False``: Busy at once (router/reshards.py:
        every router that finds a reshard abandoned tries, one takes it). A reshard that the mover
        holding the lease ended meanwhile is said as its outcome, and the status returned (state
        ``cancelled`` for a cancel), not NoReshard (``_ended``; until 2026-12-06 "no reshard under
        way", as if there had been none)."""
        await self._reach_archive()
        # Read before the lease: a reshard that the mover holding it ends while this one waits is
        # told as that mover's outcome (``_ended``), not as no reshard at all.
        _, seen = await self.record()
        async with self._lease(None if wait else 0.0):
            await self.unannounce()  # the lease says it now
            _, record = await self.record()
            if not record.get("reshard"):
                ended = self._ended(seen, record)
                if ended is None:
                    raise NoReshard(f"board {self.board_id!r} has no reshard under way", "board")
                shards = self.store._board(self.board_id, record).config.sharding.shards
                self.say(
                    f"{self.board_id}: another mover {ended} the reshard while this one waited for it "
                    f"(it held the board's lease): nothing left to resume; the board has {_shards(shards)}"
                )
                status = await self.status()
                return status if ended == "finished" else {**status, "state": "cancelled"}
            self._knows()
            self.incarnation = _incarnation(record)
            record = await self._take()
            if record["reshard"].get("cancel") and record["reshard"]["state"] in STATES[:2]:
                await self._cancel_asked(record)
                return {**await self.status(), "state": "cancelled"}
            began = time.monotonic()
            try:
                if record["reshard"]["state"] == "copying":
                    record = await self._copy(record)
                if record["reshard"]["state"] == "sealing":
                    record = await self._seal(record)
            except BoardNotFound:
                await self._drop_copies(record)
                raise
            except Lost as e:
                # The deletion removes every fence (BoardStore.delete): a mover of a board deleted
                # meanwhile is refused as one that lost the reshard to another. Said as it is.
                if await self._gone():
                    await self._drop_copies(record)
                    raise BoardNotFound(
                        f"board {self.board_id!r} was deleted during the reshard", "board"
                    ) from e
                # So does a shard of the old layout that lost its keys, its fence with them.
                lost, empty = await self._lost_since_taken()
                if lost:
                    raise ShardsLost.of(self.board_id, lost, empty) from e
                raise
            if record["reshard"]["state"] == "committed":
                record = await self._finish(record)
            took = time.monotonic() - began
            self.say(f"{self.board_id}: {record.get('reshard', {}).get('state', 'done')} after {took:.1f} s")
            return await self.status()

    def _ended(self, seen: dict[str, Any], now: dict[str, Any]) -> str | None:
        """How the reshard of the record ``seen`` (read before the lease) ended, by the record
        ``now`` (read once the lease is this mover's) that names none, or another reshard
        (recorded since, ``elsewhere``): "finished" (the board has its new layout) or "cancelled"
        (it kept its layout); None when ``seen`` named none either, or the board was created
        again since."""
        move = seen.get("reshard")
        if not move or _incarnation(seen) != _incarnation(now):
            return None
        if move["state"] == "committed" or int(now.get("generation", 0)) >= int(move["generation"]):
            return "finished"
        return "cancelled"

    async def elsewhere(self, stop: Callable[[], bool] = lambda: False) -> str | None:
        """What a mover elsewhere does with the reshard, for a resume asked of a router
        (router/admin.py), as ``run`` says it to `shardlb reshard --resume`: None when the record
        names no reshard, or names the same one still once no process holds the board's lease
        (at the first look: no mover elsewhere); else, waited for as ``run`` waits (a lease and a
        second, or until ``stop()`` says so: the router drains), "running" (it holds the lease
        still: a live mover, or one the wait was cut short on), "finished" or "cancelled"
        (the reshard seen first is no longer the one under way: that mover ended it, before the
        first look at the lease or during the wait, ``_ended``; None for a board created again
        since), or "stopped" (it let the lease go, or died, with the reshard under way: a resume
        takes it on). A reshard recorded since the one seen ended is not that one's: until
        2026-12-06 it was "stopped", and a reshard ended before the first look at the lease None
        (a resume then answered 409 "no reshard under way"). Nothing is written: the router
        starts its mover only for "stopped" or None."""
        key = keys.lease_key(self.board_id)
        _, seen = await self.record()
        if not seen.get("reshard"):
            return None
        deadline = time.monotonic() + LEASE_MS / 1000 + 1.0
        waited = False
        while await self.client.exists(key):
            if time.monotonic() > deadline or stop():
                _, now = await self.record()
                return "running" if _same_reshard(seen, now) else self._ended(seen, now)
            waited = True
            await asyncio.sleep(0.25)
        _, now = await self.record()
        if _same_reshard(seen, now):
            return "stopped" if waited else None
        return self._ended(seen, now)

    def told_elsewhere(self, other: str, shards: int, since: int | None = None, drains: bool = False) -> str:
        """The sentence a router answers with ``elsewhere``'s ``other`` (the board has ``shards``;
        ``since``: the shard count of a reshard recorded since that mover ended its own; ``drains``:
        the router's stop cut the wait short): `shardlb reshard --resume`'s line or error for the
        same outcome (``run``, ``_lease``)."""
        if other == "running" and drains:
            return (
                f"another mover holds the lease of the reshard of {self.board_id!r} (a `shardlb reshard` "
                "or a router's mover): this router is shutting down and stopped waiting for it, so it "
                "started none; follow the reshard with GET (of another router), or stop it with DELETE"
            )
        if other == "running":
            return (
                f"another mover is running the reshard of {self.board_id!r} (it holds the board's lease "
                "and keeps it fresh: a `shardlb reshard` or a router's mover): nothing for this one to do "
                "while it runs, so this router started none; follow it with GET, or stop it with DELETE"
            )
        if other == "stopped":
            return (
                "another mover held the board's lease and let it go with the reshard under way (it "
                "stopped or died): this router's mover takes it on from its recorded state"
            )
        told = (
            f"another mover {other} the reshard while this one waited for it (it held the board's "
            f"lease): nothing left to resume; the board has {_shards(shards)}"
        )
        if since is None:
            return told
        return f"{told}; another reshard, to {_shards(since)}, was recorded since: follow it with GET"

    def _knows(self) -> float:
        """When this process first knew of the reshard (now, if this is the first time)."""
        if self.known is None:
            self.known = time.monotonic()
        return self.known

    async def _gone(self) -> bool:
        """Whether the board this mover took the reshard of is deleted (or being deleted): the
        registry lacks it, or holds another incarnation."""
        try:
            _, record = await self.record()
        except BoardNotFound:
            return True
        return self.incarnation is not None and _incarnation(record) != self.incarnation

    async def _drop_copies(self, record: dict[str, Any]) -> None:
        """Drop both layouts' shards of a reshard whose board was deleted while it copied (the
        deletion dropped them once; this mover's late copies would otherwise stay, unexpiring). The
        old layout's too: the mover's marks (``_copy``) may have come after the deletion, and a
        `t` marker there had no expiry and was listed in no index (until 2026-12-05 it stayed for
        good). Only shards of the incarnation deleted: a board created again under the id since
        has other key names."""
        source, target = self._layouts(record)
        for prefix in source.prefixes + target.prefixes:
            await self.store.scripts.drop(
                keys=[keys.index_key(prefix), keys.gone_key(prefix)], args=[GONE_MS]
            )
        with contextlib.suppress(Lost):  # another mover's fences: they go with it, or run out
            await self._unfence(source, target)
        self.say(f"{self.board_id}: deleted during the reshard; its copies dropped")

    async def cancel(self) -> str:
        """Cancel a reshard that is not committed yet. The request is recorded first, so a mover
        running elsewhere carries it out at its next step; then this waits for the board's lease (a
        live mover lets it go once it has cancelled, a dead one's runs out) and finishes it. The
        commit refuses a record that carries the request, so once it is recorded the answer
        "cancelled" is what happens; a reshard committed first is refused here (BoardConflict).
        A live mover still in a long step when the wait ends (a large shard's copy) keeps the
        lease: the answer is then "cancelling", as true, since that mover (or a resume, should it
        die) cancels at its next step."""

        def ask(record: dict[str, Any]) -> dict[str, Any]:
            move = record.get("reshard")
            if not move:
                raise BoardConflict(f"board {self.board_id!r} has no reshard under way", "board")
            if move["state"] not in STATES[:2]:
                raise BoardConflict("the reshard is committed already: reshard again to go back", "board")
            return {**record, "reshard": {**move, "cancel": True}}

        await self._update(ask)
        try:
            async with self._lease():
                _, record = await self.record()
                if record.get("reshard", {}).get("cancel"):  # not a reshard started since this one ended
                    self.incarnation = _incarnation(record)
                    await self._cancel_asked(await self._take())
        except Busy:
            self.say(
                f"{self.board_id}: cancel recorded; the mover running elsewhere cancels it at its next step"
            )
            return "cancelling"
        return "cancelled"

    async def status(self) -> dict[str, Any]:
        """The reshard's state, progress and an estimate of the time left (none once it is over)."""
        _, record = await self.record()
        move = record.get("reshard")
        board = self.store._board(self.board_id, record)
        out: dict[str, Any] = {"board": self.board_id, "shards": board.config.sharding.shards}
        if not move:
            return {
                **out,
                "state": "none",
                "generation": board.generation,
                "last": record.get("last_reshard"),
            }
        source, target = self._layouts(record)
        pending = batch(self.client)
        for prefix in source.prefixes:
            pending.execute_command("SCARD", keys.changes_key(prefix))
            pending.execute_command("SCARD", keys.taken_key(prefix))
        pending.execute_command("EXISTS", keys.lease_key(self.board_id))
        pending.execute_command("EXISTS", keys.starting_key(self.board_id))
        *changes, leased, starting = await pending.execute()
        copied = copied_shards(source)
        done = len(move.get("copied", [])) if move["state"] == "copying" else len(copied)
        elapsed = time.time() - move["started_ms"] / 1000
        left = None
        if move["state"] == "copying" and done:
            left = round(elapsed / done * (len(copied) - done), 1)
        return {
            **out,
            "state": move["state"],
            "from_shards": source.config.sharding.shards,
            "to_shards": target.config.sharding.shards,
            "shards_copied": done,
            "changes_pending": sum(changes),
            "elapsed_s": round(elapsed, 1),
            "eta_s": left,
            "cancel_requested": bool(move.get("cancel")),
            "writes_refused_ms": move.get("refused_ms"),
            # "none": no process holds the board's lease, so nothing moves the reshard on; for
            # longer than a lease, the reshard is abandoned (router/reshards.py resumes it).
            # "starting": none holds it, but a mover said it starts (``announce``).
            "mover": "running" if leased else "starting" if starting else "none",
        }

    async def announce(self, replace: bool = True) -> None:
        """Say in Redis that this mover starts (``keys.starting_key``, for ``STARTING_MS``): every
        process's ``status`` then says ``"mover": "starting"``, not "none", until it takes the
        board's lease (``run``), or ``unannounce``. For a router that starts a mover in the
        background (router/reshards.py): until 2026-12-06 only its own worker knew, and another
        worker, router or `shardlb reshard --status` said "none" of a reshard it had just started.
        ``replace=False``: only where no mover has said it starts, for a note made before the mover
        is known to start (router/admin.py), whose ``unannounce`` would otherwise take another's."""
        await self.client.set(keys.starting_key(self.board_id), self.token, px=STARTING_MS, nx=not replace)

    async def unannounce(self) -> None:
        """Take back this mover's ``announce`` (one made since by another mover stays)."""
        await self.client.eval(RELEASE_LEASE, 1, keys.starting_key(self.board_id), self.token)

    # ---- the steps ----------------------------------------------------------------------------

    async def _copy(self, record: dict[str, Any]) -> dict[str, Any]:
        if self.epoch is None:  # a step taken on its own, not from run(): the reshard taken first
            self.incarnation = _incarnation(record)
            record = await self._take()
        source, target = self._layouts(record)
        marks = Writes()
        for prefix in target.prefixes:
            marks.add(prefix, "SET", keys.move_key(prefix), "c")
        for prefix in source.prefixes:
            marks.add(prefix, "SET", keys.move_key(prefix), "t")
        await self.copier.send(marks)
        done = set(record["reshard"].get("copied", []))
        began = time.monotonic()
        homes = copied_shards(source)
        for shard, prefix in enumerate(homes):
            if shard in done:
                continue
            await self._check_cancel()
            members = await self.copier.copy_shard(prefix, target)
            done.add(shard)

            def copied(record: dict[str, Any], shard: int = shard) -> dict[str, Any]:
                move = self._ours(record, "copying")
                return {**record, "reshard": {**move, "copied": sorted({*move["copied"], shard})}}

            record = await self._update(copied)
            rate = self.copier.copied / max(time.monotonic() - began, 1e-6)
            left = len(homes) - len(done)
            await self._tell(
                f"{self.board_id}: copied shard {shard + 1}/{len(homes)} "
                f"({members} members; {rate:,.0f}/s; {_shards(left)} left)"
            )
        for _ in range(ROUNDS):
            await self._check_cancel()
            left = await self.copier.changes(source, target, copied_shards(source))
            self.say(f"{self.board_id}: copied tracked changes, {left} taken")
            if left <= QUIET:
                break
        # Routers that fetched the record before the reshard began may hold it this long; they must
        # all know the layout is moving (and check their reads) before any write is refused. Measured
        # on this process's monotonic clock from when it first knew of the reshard (the record was
        # there by then): until 2026-12-05 from the record's `started_ms` by the wall clock, so a
        # clock stepped ahead since, or a mover resuming on a host ahead of the starter's, sealed at
        # once. A mover that resumes a reshard begun long ago waits once more than it had to.
        wait = self._knows() + self.cache_s + 1.0 - time.monotonic()
        if wait > 0:
            self.say(f"{self.board_id}: waiting {wait:.1f} s for every router to know of the reshard")
            await asyncio.sleep(wait)
            await self.copier.changes(source, target, copied_shards(source))
        sealing = "sealing"
        return await self._update(lambda r: {**r, "reshard": {**self._ours(r, "copying"), "state": sealing}})

    async def _seal(self, record: dict[str, Any]) -> dict[str, Any]:
        source, target = self._layouts(record)
        self.committing = False
        try:
            return await self._sealed(source, target)
        except Exception:
            await self._unseal(source)
            raise
        except asyncio.CancelledError:
            # The mover's task cancelled (a router's stop, router/reshards.py): undone as a failure
            # is, or the shards it had moved refused writes until a router resumed the reshard, a
            # lease and more later (until 2026-12-05). Not once the commit is sent: its reply lost
            # to the cancel, the record read here could precede it, and shards reopened under a
            # committed record would take writes nobody copies. Then the new layout is opened if
            # the record says the commit landed (else its closed shards refused every write until
            # the resume); if not, both wait for the resume.
            if not self.committing:
                await self._unseal(source)
            else:
                await self._open_if_committed(target)
            raise

    async def _open_if_committed(self, target: Board) -> None:
        """Open the new layout if the record names it, committed by this mover (``_seal``)."""
        try:
            _, record = await self.record()
            self._ours(record, "committed")
            await self._open(target)
        except Exception as e:  # not committed, or another mover's now: the resume opens it
            self.say(f"{self.board_id}: stopped at the commit; a resume finishes it ({e!r})")

    async def _unseal(self, source: Board) -> None:
        """After a failure while sealing: if the record still names the old layout (the commit was not
        made), let it take writes again; a resume seals it anew. Otherwise leave everything."""
        try:
            _, record = await self.record()
            if record.get("reshard", {}).get("state") != "sealing":
                return
            await self._reopen(source)
            self.say(f"{self.board_id}: sealing failed; the old layout takes writes again until a resume")
        except Lost:  # or a shard lost its keys, its fence with them: ``run`` tells which
            self.say(
                f"{self.board_id}: sealing failed, and a shard's fence refused the undo (another mover "
                "holds the reshard, or the shard lost its keys)"
            )
        except Exception as e:  # the seals' leases run out on their own; moved shards wait for a resume
            self.say(f"{self.board_id}: sealing failed and could not be undone ({e!r}); resume it")

    async def _reopen(self, source: Board) -> None:
        """The old layout's seals and moved markers undone: its shards take writes again, tracked.
        Each shard's undo is fenced: a mover that lost the reshard leaves the seals and moved
        markers of the one that holds it as they are."""
        undo = batch(self.client)
        for prefix in source.prefixes:
            names = [fence_key(prefix), keys.move_key(prefix), keys.seal_key(prefix)]
            undo.execute_command("EVAL", _UNSEAL, 3, *names, self.copier.fence)
        await fenced(self.board_id, undo.execute())

    async def _lost_shards(self, source: Board) -> list[int]:
        """The old layout's shards without their sentinel (keys.sentinel_key) when the record says
        that layout carries them and the board keeps a journal (as ``Board.sentinels``): Redis lost
        them alone. The archiver leaves a board whose record names a reshard, so nothing else
        would tell: until 2026-12-06 the mover copied such a shard empty, found the new layout
        holding what the old one held, and committed it, the shard's players gone for good. Only
        the shards a reshard copies (``copied_shards``): a band board's band shards are never read,
        the new layout's bands being built from the home shards' totals, so one lost there loses
        nothing to the copy (until 2026-12-06 it cancelled the reshard, sending the operator to a
        rebuild the reshard never needed; the old layout's keys, its bands', go at the commit)."""
        return await self._missing(source, copied_shards(source))

    async def _missing(self, board: Board, prefixes: list[str] | None = None) -> list[int]:
        """The shards of ``board`` (those of ``prefixes``, given: a prefix of ``board.prefixes``)
        without their sentinel, when the record, read now, says that layout carries them and the
        board keeps a journal (as ``Board.sentinels``); else []."""
        _, record = await self.record()
        if carries_sentinels(record) != board.generation or board.config.durability != "journal":
            return []
        found = batch(self.client)
        for prefix in board.prefixes if prefixes is None else prefixes:
            found.execute_command("EXISTS", keys.sentinel_key(prefix))
        return [s for s, there in enumerate(await found.execute()) if not there]

    async def _lost_since_taken(self) -> tuple[list[int], set[int]]:
        """After a fenced call was refused: when the record still holds this mover's reshard (its
        epoch: nobody took it over) before the commit, and shards of the old layout lost their keys
        (``_lost_shards``), their fences with them, those shards, the reshard cancelled as when the
        mover finds them at the cut-over: the reshard taken again (its fences written anew on every
        shard, so the cancel's fenced calls reach the lost ones too), cancelled, and the shards
        marked (``_settle``: with those of them written again). Else ([], set()): the refusal
        stands (another mover's, or a fence lost otherwise: a resume fences anew). Until
        2026-12-06 a shard lost after the mover took the reshard stopped it with Lost, "another
        mover took the reshard over", though none had; the reshard stayed recorded, its fences and
        markers on the other shards, until a resume cancelled it."""
        _, record = await self.record()
        move = record.get("reshard") or {}
        if (
            _incarnation(record) != self.incarnation
            or move.get("epoch") != self.epoch
            or move.get("state") not in STATES[:2]
        ):
            return [], set()
        source = self._layouts(record)[0]
        lost = await self._lost_shards(source)
        if not lost:
            return [], set()
        await self._cancel(await self._take())
        return lost, await self._settle(source, lost)

    async def _settle(self, source: Board, lost: list[int]) -> set[int]:
        """After the cancel for ``lost`` shards of the old layout, which the board keeps: each marked
        not rebuilt at once (``BoardStore.lost``), so reads that merge one are refused (503
        ``board_rebuilding`` naming its rebuild) as they are for a shard lost at rest; or, one that
        held nothing (PostgreSQL holds no row of it and the shard holds nothing), its sentinel
        written again instead (``archive.written_again``: the archiver's own rule, so the board
        serves on). Returns the shards written again. Until 2026-12-06 the mover left both to the
        archiver's next round (every 5 s), which marks nothing while the record names a reshard:
        until then reads answered from the shards left, without the lost shard's players.

        Without PostgreSQL (a resume not given it) nothing tells a shard that held nothing: each is
        marked, and its rebuild (which needs PostgreSQL) brings back nothing and writes the
        sentinel. A failure here is said and left to the archiver's next round, which decides as
        this would; the cancel stands either way."""
        empty: set[int] = set()
        try:
            if self.postgres_url:
                empty = await self._written_again(source, set(lost))
            marked = await self.store.lost(source, set(lost) - empty)
        except Exception as e:  # PostgreSQL or the cluster failing: the archiver's round decides
            self.say(
                f"{self.board_id}: the lost {_shards(len(lost))} not marked ({e!r}); the archiver's "
                "next round marks them"
            )
            return set()
        if marked:
            what = "shard" if len(marked) == 1 else "shards"
            self.say(
                f"{self.board_id}: {what} {', '.join(map(str, marked))} marked not rebuilt: reads and "
                "writes that touch them answer 503 board_rebuilding until they are rebuilt"
            )
        return empty

    async def _written_again(self, source: Board, shards: set[int]) -> set[int]:
        """Of ``shards``, those whose sentinel ``archive.written_again`` wrote (or found) again."""
        import psycopg  # imported when used: Redis-only deployments need no PostgreSQL driver

        from shardlb import archive
        from shardlb.connection import Script, script_source

        url = self.postgres_url or ""
        sentinel = Script(self.client, script_source("sentinel.lua"))
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, **pgconn.options(url)) as db:
            return set(await archive.written_again(self.store, db, source, shards, sentinel))

    async def _recopy(self, source: Board, target: Board, problems: list[str]) -> NoReturn:
        """Refuse the cut-over to a new layout that does not hold what the old one holds
        (reshard_check): the old layout takes writes again, still tracked; the new one is dropped
        and the record goes back to copying with no shard copied, so a resume copies the board
        afresh. Copying again on top would not do: a copy puts members in but never takes out one
        the old layout lacks, so a new layout with one too many would be refused at every resume.
        Each step is safe to stop after: a resume in ``sealing`` seals and checks again, and finds
        the new layout short until it has been copied again."""
        await self._reopen(source)
        for prefix in target.prefixes:
            await self._drop(prefix, 1)

        def again(record: dict[str, Any]) -> dict[str, Any]:
            move = self._ours(record, "sealing")
            return {**record, "reshard": {**move, "state": "copying", "copied": []}}

        await self._update(again)
        raise Mismatch(
            f"the cut-over of {self.board_id!r} is refused: the new layout does not hold what the old "
            f"one holds ({'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}). The old "
            "layout takes writes again and the new one was dropped: resume the reshard to copy the "
            "board again. Refused again, something loses the mover's copies: look for a primary "
            "that restarted without its data or a replica promoted without them"
        )

    async def _sealed(self, source: Board, target: Board) -> dict[str, Any]:
        began = time.monotonic()
        for attempt in range(SEAL_TRIES):
            await self._check_cancel()
            state = batch(self.client)
            for prefix in source.prefixes:
                state.execute_command("GET", keys.move_key(prefix))
            open_ = [p for p, mark in zip(source.prefixes, await state.execute(), strict=True) if mark != "m"]
            if not open_:
                break
            seal = Writes()
            for prefix in open_:
                seal.add(prefix, "SET", keys.seal_key(prefix), self.token, "PX", SEAL_MS)
            await self.copier.send(seal)
            homes = set(copied_shards(source))
            still = [p for p in open_ if p in homes]  # a band board's bands take no tracked write
            if still:
                await self.copier.changes(source, target, still, final=True)
            # Confirmed by a replica (Copier.run): a moved marker lost in a failover would let a
            # router that still holds the old layout write where nobody copies from any more.
            move = []
            for prefix in open_:
                names = [fence_key(prefix), keys.move_key(prefix), keys.seal_key(prefix)]
                names += [keys.changes_key(prefix), keys.taken_key(prefix)]
                move.append(("EVAL", _MOVE, 5, *names, self.copier.fence, self.token, MOVED_MS))
            moved = sum(await self.copier.run(move))
            await self._tell(
                f"{self.board_id}: sealed and moved {moved}/{len(open_)} shards (try {attempt + 1})"
            )
        else:
            raise BoardConflict("could not seal every shard within its lease; resume to try again", "board")
        # Both layouts stand still now. A shard of the old one that Redis lost alone was copied
        # empty, and the new layout would hold what it holds: refused before the check, and the
        # reshard cancelled, since copying again would copy it empty again (a router's mover
        # resumes by itself, sealing the board each time): the board keeps its layout, where the
        # archiver marks the shard for its rebuild.
        lost = await self._lost_shards(source)
        if lost:
            _, record = await self.record()
            await self._cancel(record)
            raise ShardsLost.of(self.board_id, lost, await self._settle(source, lost))
        # The new one must hold what the old one holds.
        problems = await differences(self.client, copied_shards(source), target)
        await self._tell(f"{self.board_id}: new layout checked against the old: {len(problems)} differ")
        if problems:
            await self._recopy(source, target, problems)
        await self._start_journals(source, target)
        # The new layout holds its data: its shards' sentinels, which the commit's record names
        # (store.SENTINELS), so the archiver takes one lost later for a shard Redis lost. Fenced
        # and confirmed on a replica as the copies are: one a failover lost would have its shard
        # taken for lost though it lost nothing (until 2026-12-06 they were plain SETs).
        here = Writes()
        for prefix in target.prefixes:
            here.add(prefix, "SET", keys.sentinel_key(prefix), 1)
        await self.copier.send(here)
        refused = (time.monotonic() - began) * 1000
        former = {"sharding": source.config.sharding.to_dict(), "generation": source.generation}

        def commit(record: dict[str, Any]) -> dict[str, Any]:
            move = self._ours(record, "sealing")
            if move.get("cancel"):  # checked in the compare-and-set that commits: no cancel comes too late
                raise Cancelled(f"the reshard of {self.board_id!r} was cancelled")
            settings = {**record, "sharding": move["sharding"], "generation": move["generation"]}
            if isinstance(record.get("state"), dict | None):
                # The old layout's marks are not the new one's: a reshard starts with none on the
                # shards it copies, and a band shard's (``start``) names a shard of the old layout.
                state = {k: v for k, v in (record.get("state") or {}).items() if k != REBUILDING}
                settings["state"] = {**state, SENTINELS: move["generation"]}
            kept = {k: v for k, v in move.items() if k not in ("sharding", "generation", "copied")}
            return {**settings, "reshard": {**kept, "state": "committed", "from": former}}

        self.committing = True
        try:
            record = await self._update(commit)
        except Cancelled:
            _, record = await self.record()
            if record.get("reshard"):
                await self._cancel_asked(record)
            raise
        await self._open_committed(target)
        self.refused_ms = (time.monotonic() - began) * 1000
        record = await self._update(
            lambda r: {
                **r,
                "reshard": {**self._ours(r, "committed"), "refused_ms": round(self.refused_ms, 1)},
            }
        )
        self.say(
            f"{self.board_id}: cut over to {_shards(target.config.sharding.shards)}; writes refused "
            f"{refused:.0f} ms before the record, {self.refused_ms:.0f} ms in all"
        )
        return record

    async def _finish(self, record: dict[str, Any]) -> dict[str, Any]:
        source, target = self._layouts(record)
        if await self._missing(target):
            # A new shard Redis lost since the commit lost its fence with its keys (every fenced
            # call there refused): the reshard taken again, fenced anew on every shard.
            record = await self._take()
        await self._open(target)  # again, should the mover have died between commit and open
        if source.config.durability == "journal":
            if not await self._drained(source):
                self.say(
                    f"{self.board_id}: the old layout's journals still hold entries the archiver has "
                    "not taken; they stay until it has (is it running?); resume later"
                )
                return record
            if not self.postgres_url:  # the new layout serves; the old keys wait for the archive's move
                self.say(
                    f"{self.board_id}: give PostgreSQL and resume, to move the archive's rows and finish"
                )
                return record
            rows = await self._rehome(target)
            self.say(f"{self.board_id}: {rows} archived rows re-homed to the new shards")
        gate = asyncio.Semaphore(16)

        async def drop(prefix: str) -> None:
            async with gate:
                await self._drop(prefix, MOVED_MS)

        await asyncio.gather(*(drop(p) for p in source.prefixes))
        self.say(f"{self.board_id}: the old layout's {_shards(len(source.prefixes))} dropped")
        # The new layout's shards Redis lost alone since the commit: marked not rebuilt in the record
        # that ends the reshard, as the archiver marks one (it leaves a board being resharded, so
        # until 2026-12-06 the mark came at its first round after the finish, reads answered from
        # the shards left meanwhile, and the rebuild the refusals name was refused until the finish).
        # Nothing brings one back meanwhile: a rebuild is refused while the record names a reshard.
        lost = await self._missing(target)

        def finished(record: dict[str, Any]) -> dict[str, Any]:
            move = self._ours(record, "committed")
            last = {
                "from_shards": move.get("from_shards"),
                "to_shards": record["sharding"].get("shards"),
                "seconds": round(time.time() - move["started_ms"] / 1000, 1),
                "writes_refused_ms": move.get("refused_ms"),
                "finished": times.format_ms(times.now_ms()),
            }
            # The sharding the board was created with (BoardStore.create confirms a PUT of it):
            # the first reshard's source, then carried from reshard to reshard.
            former = move.get("from") or {}
            created = (record.get("last_reshard") or {}).get("created")
            if created is None and int(former.get("generation", -1)) == 0:
                created = former.get("sharding")
            if created is not None:
                last["created"] = created
            done = {**{k: v for k, v in record.items() if k != "reshard"}, "last_reshard": last}
            state = record.get("state")
            if lost and isinstance(state, dict | None):
                done["state"] = {**(state or {}), REBUILDING: sorted(not_rebuilt(record) | set(lost))}
            return done

        record = await self._update(finished)
        if lost:
            then = "marked at the reshard's finish, its reads and writes refused until it is rebuilt"
            if len(lost) > 1:
                then = "marked at the reshard's finish, their reads and writes refused until they are rebuilt"
            self.say(f"{self.board_id}: {rebuilding(self.board_id, lost, then, band_shards(target)).message}")
        await self._unfence(source, target)
        return record

    async def _open_committed(self, target: Board) -> None:
        """Open the new layout right after the commit. A new shard Redis lost since the mover took
        the reshard lost its fence with its keys, and the opening's fenced call there is refused:
        the reshard is then taken again (fenced anew on every shard, as the finish does for one
        lost later) and the opening made again; the finish marks the shard (``_finish``). Until
        2026-12-06 the mover stopped there with "another mover took the reshard over", though none
        had, and a resume finished it."""
        try:
            await self._open(target)
        except Lost:
            _, record = await self.record()
            self._ours(record, "committed")  # taken over since (Lost): the other mover goes on
            if not await self._missing(target):
                raise  # a fence lost otherwise: a resume fences anew
            await self._take()
            await self._open(target)

    async def _open(self, target: Board) -> None:
        """Open the new layout's shards (their ``mv`` markers deleted), fenced."""
        opening = Writes()
        for prefix in target.prefixes:
            opening.add(prefix, "DEL", keys.move_key(prefix))
        await self.copier.send(opening)

    async def _drop(self, prefix: str, gone_ms: int) -> None:
        """drop.lua on one shard, fenced: a mover that lost the reshard drops nothing."""
        names = [keys.index_key(prefix), keys.gone_key(prefix), fence_key(prefix)]
        await fenced(self.board_id, self.client.eval(_DROP, 3, *names, gone_ms, self.copier.fence))

    async def _unfence(self, source: Board, target: Board) -> None:
        """Remove the fences of a reshard that is over (a stalled mover finds none: refused too)."""
        gone = Writes()
        for prefix in source.prefixes + target.prefixes:
            gone.add(prefix, "DEL", fence_key(prefix))
        # A fence left behind expires; it guards nothing now. A shard that refuses (FENCED) holds
        # none of this mover's to remove: lost with the shard's keys (until 2026-12-06 the mover
        # then stopped with Lost, "another mover took the reshard over", its reshard over), or a
        # later mover's, which stays.
        for reply in await self.copier.run(gone.calls(self.copier.fence), outcomes=True, confirm=False):
            if isinstance(reply, Exception) and "FENCED" not in str(reply):
                raise reply

    async def _cancel(self, record: dict[str, Any]) -> None:
        if record["reshard"]["state"] not in STATES[:2]:
            raise BoardConflict("the reshard is committed already: reshard again to go back", "board")
        self._ours(record)
        source, target = self._layouts(record)
        clear = Writes()
        for prefix in source.prefixes:
            for name in (keys.move_key, keys.seal_key, keys.changes_key, keys.taken_key):
                clear.add(prefix, "DEL", name(prefix))
        await self.copier.send(clear)
        for prefix in target.prefixes:
            await self._drop(prefix, 1)

        def cancelled(record: dict[str, Any]) -> dict[str, Any]:
            self._ours(record)
            return {k: v for k, v in record.items() if k != "reshard"}

        await self._update(cancelled)
        await self._unfence(source, target)
        kept = source.config.sharding.shards
        self.say(f"{self.board_id}: reshard cancelled; the board keeps {_shards(kept)}")

    async def _cancel_asked(self, record: dict[str, Any]) -> None:
        """``_cancel`` for a cancel that was asked for (`shardlb reshard --cancel`, a router's DELETE
        of the reshard), carried out by whichever process holds the lease: shards of the old layout
        that lost their keys meanwhile are settled at once, as for the mover's own cancel for them
        (``_settle``: marked not rebuilt, or written again where they held nothing). Until
        2026-12-06 they were left to the archiver's next round (about 5 s), and reads that merge
        them answered from the shards left meanwhile."""
        source = self._layouts(record)[0]
        lost = await self._lost_shards(source)
        await self._cancel(record)
        if not lost:
            return
        empty = await self._settle(source, lost)
        if empty:
            one = len(empty) == 1
            self.say(
                f"{self.board_id}: {'shard' if one else 'shards'} {', '.join(map(str, sorted(empty)))} of "
                f"the old layout lost {'its' if one else 'their'} keys and held nothing archived: "
                f"{'its sentinel' if one else 'their sentinels'} written again, nothing lost"
            )

    async def _start_journals(self, source: Board, target: Board) -> None:
        """Start every new journal past the last id of every old one (an empty stream whose last id
        is that), so ids keep their order across the cut-over even where the new shard's node has a
        clock behind the old one's (a rebuild compares the ids of rows from both)."""
        if source.config.durability != "journal":
            return
        last = (0, 0)
        ids = batch(self.client)
        for prefix in source.prefixes:
            ids.execute_command("EVAL", _LAST_ID, 1, keys.journal_key(prefix))
        for found in await ids.execute():
            ms, seq = str(found).split("-")
            last = max(last, (int(ms), int(seq)))
        start = Writes()
        for prefix in target.prefixes:
            key = keys.journal_key(prefix)
            start.add(prefix, "ZADD", keys.index_key(prefix), "+inf", key)  # first: the XADD may refuse
            start.add(prefix, "XADD", key, "MAXLEN", "0", f"{last[0]}-{last[1] + 1}", "start", "1")
        for reply in await self.copier.run(start.calls(self.copier.fence), outcomes=True):
            if isinstance(reply, Exception) and "FENCED" in str(reply):
                raise lost(self.board_id) from reply
            if isinstance(reply, Exception) and "equal or smaller" not in str(reply):
                raise reply

    async def _drained(self, source: Board) -> bool:
        """Wait (up to ``drain_s``) until the archiver has taken every entry of the old journals."""
        deadline = time.monotonic() + self.drain_s
        while True:
            pipe = batch(self.client)
            for prefix in source.prefixes:
                pipe.execute_command("XLEN", keys.journal_key(prefix))
            left = sum(await pipe.execute())
            if not left:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.5)

    async def rehome(self) -> dict[str, Any]:
        """Give the board's archived rows the shards of the layout the registry names now: the
        reshard's last step (``_rehome``) made again, for an archive restored from a backup taken
        before a reshard of the board, whose rows name the old layout's shards (a rebuild refuses
        them: docs/design-notes.md, "PostgreSQL restored from a backup"). Refused while a reshard
        is under way (its finish re-homes them), on a region board (never resharded) and on one
        that keeps no journal (nothing archived). One transaction that sets only the shard of rows
        not on their player's home shard: cut off, it changed nothing, and run again it converges.
        Returns the board, its layout and the rows it moved."""
        if not self.postgres_url:
            raise BoardConflict(
                "the archive's rows are what moves: give PostgreSQL (--postgres, SHARDLB_POSTGRES_URL)",
                "board",
            )
        _, record = await self.record()
        board = self._at_rest(record)
        if board.layout.strategy not in ("hash", "band"):
            raise BoardConflict(
                f"only hash and band boards are resharded; this one is a {board.layout.strategy} "
                "board, whose archived rows are on its layout's shards",
                "board",
            )
        if board.config.durability != "journal":
            raise BoardConflict(
                f"board {self.board_id!r} keeps no journal (durability memory): nothing archived to re-home",
                "board",
            )
        rows = await self._rehome(board, at_rest=True)
        shards = board.config.sharding.shards
        self.say(
            f"{self.board_id}: {rows} archived {'row' if rows == 1 else 'rows'} re-homed to the layout's "
            f"{_shards(shards)}; next, "
            f"`shardlb reconcile {self.board_id}`: drift there is what this archive lacks (results "
            "acknowledged after its backup point, which no gap names), and a rebuild or --repair "
            "would drop it from Redis"
        )
        return {"board": self.board_id, "shards": shards, "generation": board.generation, "rehomed": rows}

    def _at_rest(self, record: dict[str, Any], layout: Board | None = None) -> Board:
        """The board ``record`` names, refused (BoardConflict) while a reshard is under way or, given
        ``layout``, when the record names another incarnation or layout generation than it."""
        move = record.get("reshard")
        if move:
            raise BoardConflict(
                f"board {self.board_id!r} is being resharded ({move['state']}): the reshard's finish "
                f"re-homes the archive's rows; finish it (`shardlb reshard {self.board_id} --resume`) "
                "or cancel it first",
                "board",
            )
        board = self.store._board(self.board_id, record)
        now = (board.incarnation, board.generation)
        if layout is not None and now != (layout.incarnation, layout.generation):
            raise BoardConflict(
                f"board {self.board_id!r} changed while its rows were re-homed (another layout or "
                "incarnation); nothing was changed: run it again",
                "board",
            )
        return board

    async def _rehome(self, target: Board, at_rest: bool = False) -> int:
        """Give the board's archived rows their shard in the new layout: its results, its delete
        entries and its removal records, every one of which a rebuild reads by shard. The players
        are those any of the three names: a player removed before they posted has a record and no
        result. Re-homings of one board (a reshard's finish, ``rehome``) take turns on a lock of
        the transaction, and the registry is read once it is held. ``at_rest`` (``rehome``): the
        board must still have ``target``'s layout and no reshard under way. A reshard whose finish
        waited meanwhile moves the rows after this, to its own layout; one that finished before
        has changed the layout, or is still in the record: refused. A reshard's finish: the record
        must still hold this mover's reshard, committed to ``target`` (``_finishing``), or the
        mover stops (``Lost``) having changed nothing. A mover that stalled here past its lease
        would otherwise move the rows (and ``boards``' settings) after another finished the
        reshard, or after a newer reshard, to a layout that is no longer the board's."""
        import psycopg  # imported when used: Redis-only deployments need no PostgreSQL driver

        shards = target.config.sharding.shards
        ident = [target.config.id, target.incarnation]
        url = self.postgres_url or ""
        async with await psycopg.AsyncConnection.connect(url, autocommit=False, **pgconn.options(url)) as db:
            async with db.cursor() as cur:
                await cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [f"rehome/{ident[0]}"])
                if at_rest:
                    self._at_rest((await self.record())[1], target)
                else:
                    self._finishing((await self.record())[1], target)
                # Those the archive has: `match_later` came with the archiver of 2026-12-05 (later that
                # day), and an archive set up by an archiver of before has none yet.
                await cur.execute(
                    "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL", [list(REHOMED)]
                )
                tables = [row[0] for row in await cur.fetchall()]
                await cur.execute(
                    " UNION ".join(
                        f"SELECT player_id FROM {table} WHERE board = %(board)s AND incarnation = %(inc)s"
                        for table in tables
                    ),
                    {"board": ident[0], "inc": ident[1]},
                )
                players = [row[0] for row in await cur.fetchall()]
                homes = [player_hash(p) % shards for p in players]
                updated = 0
                for table in tables:
                    await cur.execute(
                        f"UPDATE {table} AS m SET shard = u.shard "
                        "FROM unnest(%s::text[], %s::int[]) AS u(player_id, shard) "
                        "WHERE m.board = %s AND m.incarnation = %s AND m.player_id = u.player_id "
                        "AND m.shard <> u.shard",
                        [players, homes, *ident],
                    )
                    updated += cur.rowcount
                # The board's settings as PostgreSQL keeps them name the new layout, in the same
                # transaction as the rows' new shards: a rebuild after a total loss of Redis
                # restores the board from them (shardlb/rebuild.py, ``restore``), and with the
                # settings of its creation it would look for these rows on the old shards.
                record = {**target.config.to_dict(), "generation": target.generation}
                await cur.execute(
                    "UPDATE boards SET settings = %s WHERE board = %s AND incarnation = %s",
                    [orjson.dumps(record).decode(), *ident],
                )
            await db.commit()
        return updated

    def _finishing(self, record: dict[str, Any], target: Board) -> None:
        """Refuse the archive's move (``_rehome``) at a reshard's finish unless ``record`` still
        holds this mover's reshard (its epoch, as every fenced step checks it: ``_ours``), committed,
        and the layout it names is ``target``. Read under the re-homing's lock: a mover that takes
        the reshard over meanwhile, or a newer reshard, moves the rows after this one, by that lock.
        Until 2026-12-05 the move checked nothing: a mover that stalled before it past its lease
        moved the rows back to its layout after another mover had finished the reshard and the
        board had been resharded again, and a rebuild found them on shards its layout does not
        give their players (tests/test_reshard_fencing.py)."""
        if self.incarnation is not None and _incarnation(record) != self.incarnation:
            raise BoardNotFound(f"board {self.board_id!r} was deleted during the reshard", "board")
        if self.epoch is not None and (record.get("reshard") or {}).get("epoch") != self.epoch:
            raise lost(self.board_id)  # taken over, or finished by another mover (and perhaps more since)
        self._ours(record, "committed")
        now = self._layouts(record)[1]
        if (now.incarnation, now.generation, now.config.sharding) != (
            target.incarnation,
            target.generation,
            target.config.sharding,
        ):
            raise lost(self.board_id)

    async def _tell(self, line: str) -> None:
        """Say ``line``; then, for fault-injection tests, pause if SHARDLB_RESHARD_PAUSE names a part
        of it (``text:seconds``, several separated by commas), so a test can kill the mover there."""
        self.say(line)
        for rule in os.environ.get("SHARDLB_RESHARD_PAUSE", "").split(","):
            text, _, seconds = rule.rpartition(":")
            if text and text in line:
                await asyncio.sleep(float(seconds))

    # ---- the mover's lease and cancel ---------------------------------------------------------

    def _ours(self, record: dict[str, Any], state: str | None = None) -> dict[str, Any]:
        """The record's reshard, if it is still the one this mover took (``_take``): the same board
        (incarnation), this mover's epoch (no other mover took it over since) and, given, ``state``."""
        move = record.get("reshard")
        if self.incarnation is not None and _incarnation(record) != self.incarnation:
            raise BoardNotFound(f"board {self.board_id!r} was deleted during the reshard", "board")
        if not move or (state is not None and move["state"] != state):
            raise BoardConflict(f"the reshard of {self.board_id!r} changed under this mover", "board")
        if self.epoch is not None and move.get("epoch") != self.epoch:
            raise lost(self.board_id)
        return dict(move)

    async def _take(self) -> dict[str, Any]:
        """Take the reshard under way for this mover (it holds the lease): a new epoch, later than
        any before, in the record, then in the fence of every shard of both layouts, then the record
        read again. A stalled mover's fenced calls are refused from the moment the fences hold the
        new epoch; whatever it wrote before, this mover reads after. A stalled mover that takes
        fences after this one (it had its epoch first) cannot take them back (``FENCE`` keeps the
        later epoch) and finds the record names another epoch. The epoch starts from the reshard's
        start time, so a reshard begun after a cancelled one (whose new layout had the same key
        names) outranks every mover of the cancelled one."""

        def take(record: dict[str, Any]) -> dict[str, Any]:
            move = record.get("reshard")
            if not move:
                raise NoReshard(f"board {self.board_id!r} has no reshard under way", "board")
            epoch = max(int(move.get("epoch", 0)), int(move["started_ms"]) * 1000) + 1
            return {**record, "reshard": {**move, "epoch": epoch}}

        record = await self._update(take)
        self.epoch = int(record["reshard"]["epoch"])
        self.copier.fence = str(self.epoch)
        source, target = self._layouts(record)
        # Confirmed on a replica, as the mover's other calls are (Copier.run): a fence a failover
        # lost would leave the epoch of the mover taken over from, whose stalled write there then
        # lands (until 2026-12-06 they were plain writes; docs/design-notes.md, "Copies that
        # survive a failover").
        every = source.prefixes + target.prefixes
        fences = [("EVAL", FENCE, 1, fence_key(p), self.epoch, FENCE_MS) for p in every]
        if not all(await self.copier.run(fences)):
            raise lost(self.board_id)
        _, record = await self.record()
        self._ours(record)
        return record

    async def _check_cancel(self) -> None:
        if self.held is not None and self.held.lost:
            raise BoardConflict(
                f"this mover lost its lease on {self.board_id!r} (another mover holds it, or it could not "
                "be refreshed in time): it stops here, and the record says where the other goes on",
                "board",
            )
        _, record = await self.record()
        if record.get("reshard", {}).get("cancel"):
            await self._cancel_asked(record)
            raise Cancelled(f"the reshard of {self.board_id!r} was cancelled")

    def _lease(self, wait_s: float | None = None) -> Lease:
        busy = (
            f"another mover is running the reshard of {self.board_id!r} (it holds the board's lease and "
            "keeps it fresh: a `shardlb reshard` or a router's mover): nothing for this one to do while "
            f"it runs; follow it with `shardlb reshard {self.board_id} --status`, or stop it with --cancel"
        )
        self.held = Lease(self.client, keys.lease_key(self.board_id), self.token, wait_s, busy)
        return self.held


class ShardsLost(Mismatch):
    """The cut-over refused and the reshard cancelled: ``shards`` of the old layout lost their keys
    (``Resharder._lost_shards``). ``commands``: what brings them back, one `shardlb rebuild` a shard
    the cancel marked not rebuilt (``Resharder._settle``), after which the board can be resharded
    again; none for a shard that held nothing (``empty``: its sentinel written again). A router's
    mover logs it as one line (router/reshards.py), not as a failure with its traceback. Made by
    ``of``; the constructor is every library error's (message, field)."""

    board_id = ""
    shards: tuple[int, ...] = ()
    commands: tuple[str, ...] = ()

    @classmethod
    def of(cls, board_id: str, shards: list[int], empty: Collection[int] = ()) -> ShardsLost:
        marked = [s for s in shards if s not in empty]
        commands = tuple(f"shardlb rebuild {board_id} --shard {s}" for s in marked)
        one = len(shards) == 1
        said = (
            f"the cut-over of {board_id!r} is refused and the reshard cancelled: "
            f"{'shard' if one else 'shards'} {', '.join(map(str, shards))} of the old layout lost "
            f"{'its' if one else 'their'} keys ("
        )
        if one:
            said += "the sentinel is missing: Redis lost the slot and serves it again empty)"
        else:  # each shard its own hash tag: as many sentinels, in as many slots (two may share one)
            named = f"{', '.join(map(str, shards[:-1]))} and {shards[-1]}"
            said += f"the sentinels of shards {named} are missing: Redis lost their slots and serves them "
            said += "again empty)"
        # Only a shard marked held players to lose (one written again held nothing archived).
        if marked and not empty:
            said += ", and a copy would lose those players for good"
        elif marked:
            named = f"shard{'' if len(marked) == 1 else 's'} {', '.join(map(str, marked))}"
            said += f", and a copy would lose the players of {named} for good"
        said += ". The board keeps its layout"
        if marked:
            run = " and ".join(f"`{c}`" for c in commands)
            them = "it" if len(marked) == 1 else "them"
            said += f": run {run} to bring {them} back from PostgreSQL and the journal, then reshard again"
        if empty:
            written = ", ".join(map(str, sorted(empty)))
            one_empty = len(empty) == 1
            sentinels = "its sentinel is" if one_empty else "their sentinels are"
            said += (
                f"{'; ' if marked else ': '}shard{'' if one_empty else 's'} {written} held nothing "
                f"archived, so nothing was lost: {sentinels} written again"
            )
            if not marked:
                said += "; reshard again"
        error = cls(said, "board")
        error.board_id, error.shards, error.commands = board_id, tuple(shards), commands
        return error


class Cancelled(Exception):
    """The reshard this mover was doing was cancelled (by ``Resharder.cancel`` elsewhere)."""


class Busy(BoardConflict):
    """Another process held the board's lease for longer than a lease: a live mover."""


class NoReshard(BoardConflict):
    """The board has no reshard under way (any more, for a resume: another mover finished it, it
    was cancelled, or the board was created again without one)."""


class Lease:
    """The mover's hold on a board, refreshed while it works: one mover at a time."""

    def __init__(
        self,
        client: RedisCluster,
        key: str,
        token: str,
        wait_s: float | None = None,
        busy: str = "another process is resharding this board",
    ) -> None:
        self.client, self.key, self.token = client, key, token
        self.wait_s = wait_s  # how long another's lease is waited for (None: a lease)
        self.busy = busy  # Busy's message, once the wait is over
        self._task: asyncio.Task[None] | None = None
        self.lost = False  # another process holds it, or it ran out unrefreshed: the mover stops

    async def __aenter__(self) -> Lease:
        # A mover that died leaves its lease to run out: wait that long for it, not longer.
        deadline = time.monotonic() + (LEASE_MS / 1000 + 1.0 if self.wait_s is None else self.wait_s)
        while not await self.client.eval(_LEASE, 1, self.key, self.token, LEASE_MS):
            if time.monotonic() > deadline:
                raise Busy(self.busy, "board")
            await asyncio.sleep(0.25)
        self._task = asyncio.create_task(self._keep())
        return self

    async def _keep(self) -> None:
        """Refresh every third of the lease; a refresh that fails is tried again at the next, and
        the lease is ``lost`` once another process holds it or it ran out unrefreshed."""
        refreshed = time.monotonic()
        while True:
            await asyncio.sleep(LEASE_MS / 3000)
            try:
                held = await self.client.eval(_KEEP, 1, self.key, self.token, LEASE_MS)
            except Exception as e:  # the cluster busy or moving: try again, while the lease lasts
                log.warning(
                    "reshard lease not refreshed", extra={"fields": {"key": self.key, "error": repr(e)}}
                )
                if time.monotonic() - refreshed >= LEASE_MS / 1000:
                    self.lost = True
                    return
                continue
            if not held:
                self.lost = True
                return
            refreshed = time.monotonic()

    async def __aexit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.eval(RELEASE_LEASE, 1, self.key, self.token)


def _sharding(value: dict[str, Any]) -> Sharding:
    return BoardConfig.from_dict("x", {"sharding": value}).sharding


@contextlib.contextmanager
def _given() -> Iterator[None]:
    """A shard count or band starts refused, named as a reshard is given them (``shards``,
    ``bands``: the endpoint's body, the CLI's flags), not as a PUT's ``sharding.shards``."""
    try:
        yield
    except InvalidInput as e:
        if not (e.field or "").startswith("sharding."):
            raise
        name = (e.field or "").removeprefix("sharding.")
        raise InvalidInput(e.message.replace(e.field or "", name), name, e.code) from e


def _asking(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with a cancel asked of its reshard, as ``Resharder.cancel`` records it: one
    recorded between the mover's write and its read-back leaves the mover's write standing, and is
    carried out at its next step (until 2026-12-05 the mover stopped with NotAcknowledged)."""
    move = record.get("reshard")
    return {**record, "reshard": {**move, "cancel": True}} if move else record


def _shards(count: int) -> str:
    """A mover's lines' count of shards: "1 shard", "3 shards" (until 2026-12-06 "1 shards left")."""
    return f"{count} shard{'' if count == 1 else 's'}"


def _incarnation(record: dict[str, Any]) -> str:
    return str(record.get("incarnation", "0"))


def _same_reshard(seen: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the record ``now`` names the reshard ``seen`` named (both name one): of the same
    board incarnation, recorded at the same moment toward the same generation."""
    move, moving = seen.get("reshard"), now.get("reshard")
    if not move or not moving or _incarnation(seen) != _incarnation(now):
        return False
    return (move["started_ms"], move["generation"]) == (moving["started_ms"], moving["generation"])


async def command(
    redis_url: str,
    board_id: str,
    shards: int | None = None,
    action: str = "run",
    postgres_url: str | None = None,
    say: Callable[[str], None] = print,
    bands: list[int] | None = None,
) -> dict[str, Any]:
    """`shardlb reshard`'s work on fresh connections: ``action`` is run (start a reshard to
    ``shards``, or resume the one under way when ``shards`` is None), cancel, status or rehome
    (``Resharder.rehome``). A run that carried out a cancel (recorded by another process) returns
    the board's status with the state ``cancelled``."""
    from shardlb.connection import Scripts, connect

    client = connect(redis_url, timeout=30.0)
    try:
        store = BoardStore(client, Scripts.register(client))
        mover = Resharder(store, board_id, say, postgres_url, cache_s=cli_cache_s())
        if action == "status":
            return await mover.status()
        if action == "cancel":
            return {"board": board_id, "state": await mover.cancel()}
        if action == "rehome":
            return await mover.rehome()
        if shards is not None:
            await mover.start(shards, bands)
        try:
            return await mover.run()
        except Cancelled:
            return {**await mover.status(), "state": "cancelled"}
    finally:
        await client.aclose()
