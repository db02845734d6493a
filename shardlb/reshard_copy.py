"""The copying half of an online reshard (shardlb/reshard.py): an old shard's keys into their new
homes in bounded batches, and the players its writes touched while it was tracked, copied again.

Every value is copied as it is now (never as an increment), and into a layout that takes no write
until the cut-over, so copying a member twice, or again after a crash, changes nothing.

Every change the mover makes to a shard, old layout or new, is fenced: one script call per shard
that first checks the shard's ``fence`` key still holds this mover's epoch (``Copier.fence``,
taken in shardlb/reshard.py). A mover that stalled between reading a batch and writing it, while
another took the reshard over (a later epoch in every fence), has its write refused in the same
call that would have made it, so it can never put values it read before the stall into a layout
that took writes since. The lease alone could not do that: the mover only looks at it between
steps, and it lives in another slot than the shards.

Every such change on a shard whose primary has replicas is also confirmed by one of them before
the mover goes on (``Copier.run``: the calls, a marker and ``WAIT 1`` on one connection, as
``fanout.confirmed`` sends them). The mover records a shard as copied, drops the changes it took
and marks a shard moved on the strength of its copies; a copy that reached a primary only would
be lost with it in a failover, after the mover had stopped looking for it. A call that no replica
confirms within ``REPLICA_WAIT_MS`` stops the mover with NotAcknowledged, its progress not
recorded, for a resume. A shard whose primary has no replica (``Replicated``) is written as
before, unconfirmed. The mover's record in the registry is read back the same way (``confirm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import defaultdict
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from shardlb import keys
from shardlb.board import Board
from shardlb.connection import slot_of
from shardlb.errors import BoardConflict, NotAcknowledged
from shardlb.fanout import Ack, batch, confirmed
from shardlb.slots import followed

BATCH = 1000  # members copied per call
REPLICA_WAIT_MS = 5_000  # how long the mover's calls wait for a replica of their shard's primary
TOPOLOGY_S = 1.0  # which primaries have replicas is read again at most this often (``Replicated``)
FENCE_MS = 86_400_000  # a fence outlives its mover by a day at most, as the old shards' moved markers
# The head of every fenced script: KEYS[1] is the shard's fence, ARGV[1] the mover's epoch; the
# script's own keys and arguments follow them.
FENCED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED another mover took this reshard over')
end
"""
# Take a shard's fence for an epoch, unless a later epoch holds it (a stalled mover's take that
# arrives after a newer mover's changes nothing). 1 when the fence is this epoch's.
FENCE = """
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
if held > tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# Commands of one shard, each as its argument count then the command and its arguments. One
# pseudo-command: PEXPIREMAX key ms, an expiry that never moves sooner (GROWING: a new shard fed by
# several old ones keeps the latest of their expiries).
_RUN = (
    FENCED
    + """
local i = 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  if ARGV[i + 1] == 'PEXPIREMAX' then
    local at = math.max(tonumber(ARGV[i + 3]), redis.call('PEXPIRETIME', ARGV[i + 2]))
    redis.call('PEXPIREAT', ARGV[i + 2], string.format('%d', at))
  else
    redis.call(unpack(ARGV, i + 1, i + n))
  end
  i = i + n + 1
end
return 1
"""
)
# Keys whose expiry differs between the shards of one layout (a removal's record lives a window
# after that shard's latest removal): copied into a new shard, they keep the latest expiry.
GROWING = ("rmv", "rmvon")
# Move a shard's tracked changes into the set the mover works from, in one call.
_TAKE = (
    FENCED
    + """
redis.call('SUNIONSTORE', KEYS[2], KEYS[2], KEYS[3])
redis.call('DEL', KEYS[3])
return redis.call('SCARD', KEYS[2])
"""
)


fence_key = keys.fence_key  # the shard's fence: FENCED's KEYS[1]


class Lost(BoardConflict):
    """A fenced call was refused: another mover took the reshard over; this one must stop."""


def lost(board_id: str) -> Lost:
    return Lost(
        f"another mover took the reshard of {board_id!r} over (this one's lease ran out): this one "
        "stops here, and the record says where the other goes on",
        "board",
    )


async def fenced(board_id: str, replies: Any) -> Any:
    """``replies`` awaited, with a fenced script's refusal as ``Lost``."""
    try:
        return await replies
    except ResponseError as e:
        if "FENCED" in str(e):
            raise lost(board_id) from e
        raise


class Writes:
    """Commands gathered per shard, sent as one fenced script call per shard (``_RUN``)."""

    def __init__(self) -> None:
        self.by_prefix: dict[str, list[Any]] = defaultdict(list)

    def add(self, prefix: str, *command: Any) -> None:
        """One command on keys of the shard ``prefix``."""
        self.by_prefix[prefix] += [len(command), *command]

    def calls(self, fence: str) -> list[tuple[Any, ...]]:
        """The fenced script call of each shard (``Copier.run`` makes them)."""
        return [("EVAL", _RUN, 1, fence_key(prefix), fence, *args) for prefix, args in self.by_prefix.items()]


class Replicated:
    """Which slots are served by a primary that has a replica to wait for, by CLUSTER NODES (read
    at most once every ``TOPOLOGY_S``), by the rule slot migration follows (``slots.followed``):
    every replica the cluster lists counts, one it has marked failed included (one frozen and back
    as its primary dies is promoted without the copies), so the mover waits for it."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self.slots = bytearray(keys.SLOTS)
        self.read_at = -math.inf
        self.known: dict[str, dict[str, Any]] = {}  # CLUSTER NODES as last read, by address

    async def read(self, again: bool = False) -> None:
        """Read the topology if it is older than ``TOPOLOGY_S`` (``again``: whatever its age)."""
        if not again and time.monotonic() - self.read_at < TOPOLOGY_S:
            return
        # Asked of the registry's primary, which the mover needs anyway (a random node may be a
        # replica that does not answer); a client that sent nothing yet knows no slot map.
        await self.client.initialize()
        node = self.client.get_node_from_key(keys.BOARDS)
        known: Any = await self.client.execute_command("CLUSTER NODES", target_nodes=node)
        waited = followed(known.values())
        slots = bytearray(keys.SLOTS)
        for n in known.values():
            if n["node_id"] in waited and "master" in n["flags"].split(","):
                for first, *rest in n["slots"]:
                    last = int(rest[-1]) if rest else int(first)
                    slots[int(first) : last + 1] = b"\x01" * (last + 1 - int(first))
        self.slots, self.known, self.read_at = slots, dict(known), time.monotonic()

    def __call__(self, key: str) -> bool:
        """Whether the primary of ``key`` has a replica to wait for (as last read)."""
        return bool(self.slots[slot_of(key)])

    def describe(self, key: str) -> str:
        """The primary of ``key`` and its replicas, as last read: for a message to an operator."""
        slot = slot_of(key)
        for address, n in self.known.items():
            if "master" in n["flags"].split(",") and any(
                int(first) <= slot <= int(rest[-1] if rest else first) for first, *rest in n["slots"]
            ):
                replicas = [
                    f"{a} {','.join(f for f in m['flags'].split(',') if f != 'slave') or 'ok'}"
                    for a, m in self.known.items()
                    if m["master_id"] == n["node_id"]
                ]
                return f"primary {address} (replicas: {', '.join(replicas) or 'none'})"
        return f"the primary of slot {slot}"


def kind_of(suffix: str) -> str:
    """What a key of a shard is, from its name after the prefix: zset (period boards, the activity
    set), set (dedup buckets), hash (pins), pairs (a set of match NUL player the check leaves out:
    the rate limit's counted results), players (a hash by player: the recent removals, the rate
    limit's counts), frozen (markers, copied to every new shard), or skip (the journal, counters...)."""
    if suffix in ("total", "seen") or suffix[:2] in ("d:", "w:", "m:"):
        return "zset"
    if suffix.startswith("dd:"):
        return "set"
    if suffix.startswith("pin:"):
        return "hash"
    # rate.lua's minute: a player at the limit stays there, and a retry of a result it counted is
    # not counted again, after the cut-over as before it.
    if suffix.startswith("rated:"):
        return "pairs"
    if suffix.startswith("rate:"):
        return "players"
    if suffix == "rmv":  # recent removals (remove.lua): player (or request NUL player) -> when, to their home
        return "players"
    if suffix.startswith("frozen:") or suffix == "rmvon":  # markers: copied to every new shard
        return "frozen"
    return "skip"


def _player(member: str) -> str:
    return member.split("\x00", 1)[-1]


class Copier:
    """Copies shards of one layout into another; ``copied`` counts the members copied so far.
    ``fence`` is the epoch of the mover it copies for: every write is refused once it is not the
    one the shard's fence holds."""

    def __init__(self, client: RedisCluster, board_id: str = "", wait_ms: int = REPLICA_WAIT_MS) -> None:
        self.client = client
        self.board_id = board_id
        self.fence = ""  # no epoch taken yet: every fenced call is refused
        self.copied = 0
        self.replicated = Replicated(client)
        self.ack = Ack(1, wait_ms)

    async def send(self, writes: Writes, confirm: bool = True) -> None:
        """Make the writes' fenced calls (``run``); raise the first error one met."""
        if writes.by_prefix:
            await self.run(writes.calls(self.fence), confirm=confirm)

    async def run(
        self, calls: list[tuple[Any, ...]], outcomes: bool = False, confirm: bool = True
    ) -> list[Any]:
        """Make fenced script calls (EVAL script numkeys fence ...: the fence names the shard) and
        return their replies. A call on a shard whose primary has replicas returns once one of them
        has it (``fanout.confirmed``; every call of the mover's is safe to make twice), else fails
        with NotAcknowledged; the others (all, without ``confirm``) go as before, in one batch.
        Raises the first error a call met (a refused fence as ``Lost``), or with ``outcomes``
        returns it in its place."""
        if confirm:
            await self.replicated.read()
        acked = [i for i, call in enumerate(calls) if confirm and self.replicated(str(call[3]))]
        if not acked:  # a cluster without replicas: one batch, as it always was
            return await self._plain(calls, outcomes)
        plain = sorted(set(range(len(calls))) - set(acked))
        replies: list[Any] = [None] * len(calls)
        done, sure = await asyncio.gather(
            self._plain([calls[i] for i in plain], outcomes),
            confirmed(self.client, self.ack, [calls[i] for i in acked]),
        )
        for i, reply in zip(plain, done, strict=True):
            replies[i] = reply
        for i, reply in zip(acked, sure, strict=True):
            replies[i] = reply
        failed = next((r for r in sure if isinstance(r, BaseException)), None)
        if failed is None or outcomes:
            return replies
        if isinstance(failed, NotAcknowledged):
            with contextlib.suppress(RedisError):  # the replicas' flags as they are now, if it can
                await self.replicated.read(again=True)
            short = [calls[i][3] for i, r in zip(acked, sure, strict=True) if isinstance(r, NotAcknowledged)]
            where = dict.fromkeys(self.replicated.describe(str(fence)) for fence in short)
            raise NotAcknowledged(
                f"no replica confirmed the reshard's writes of {self.board_id!r} within "
                f"{self.ack.timeout_ms} ms on {'; '.join(where)}: a failover could lose them, so "
                "nothing is recorded for them. Resume once that replica is in sync with its primary; "
                "a replica gone for good is waited for until an operator removes it (CLUSTER FORGET "
                "its id on every node), then resume"
            ) from failed
        if isinstance(failed, ResponseError) and "FENCED" in str(failed):
            raise lost(self.board_id) from failed
        raise failed

    async def confirm(self, key: str, field: str, written: Any) -> Any:
        """The hash ``key``'s ``field`` as a replica of its primary holds it, once it does: an HGET
        with the marker and WAIT of ``fanout.confirmed``, made again on the new primary after a
        failover, where a value lost is then read as the replica promoted has it; ``written`` when
        that primary has no replica (nothing to wait for). NotAcknowledged when none confirms in
        time. For the board's registry record (``Resharder._update``), which compares. Until
        2026-12-05 an EXISTS of ``key`` carried the marker and WAIT, a call of its own after the
        write: a failover in between had the replica promoted confirm a record it never had."""
        await self.replicated.read()
        if not self.replicated(key):
            return written
        [reply] = await confirmed(self.client, self.ack, [("HGET", key, field)])
        if isinstance(reply, NotAcknowledged):
            raise NotAcknowledged(
                f"no replica confirmed the reshard's record of {self.board_id!r} within "
                f"{self.ack.timeout_ms} ms on {self.replicated.describe(key)}: a failover could lose "
                "it, so the mover stops here; resume once that replica is in sync with its primary"
            ) from reply
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def _plain(self, calls: list[tuple[Any, ...]], outcomes: bool) -> list[Any]:
        if not calls:
            return []
        pipe = batch(self.client)
        for call in calls:
            pipe.execute_command(*call)
        return list(await (pipe.outcomes() if outcomes else fenced(self.board_id, pipe.execute())))

    async def _keys(self, prefix: str) -> list[tuple[str, str, str]]:
        """(suffix, kind, expiry) of every key a shard's index lists; expiry as the index spells it."""
        listed: Any = await self.client.zrange(keys.index_key(prefix), 0, -1, withscores=True)
        out = []
        for name, expiry in listed:
            suffix = name[len(prefix) :]
            kind = kind_of(suffix)
            if kind != "skip":
                out.append((suffix, kind, "+inf" if math.isinf(expiry) else str(int(expiry))))
        return out

    async def copy_shard(self, prefix: str, target: Board) -> int:
        """Copy every member of one old shard into its new home shards, in bounded batches."""
        count = 0
        for suffix, kind, expiry in await self._keys(prefix):
            key = prefix + suffix
            if kind == "frozen":
                await self._copy_frozen(key, suffix, expiry, target)
                continue
            scan = {"zset": "ZSCAN", "set": "SSCAN", "pairs": "SSCAN", "hash": "HSCAN", "players": "HSCAN"}[
                kind
            ]
            cursor = "0"
            while True:
                cursor, found = await self.client.execute_command(scan, key, cursor, "COUNT", BATCH)
                rows = list(found.items()) if isinstance(found, dict) else found
                if kind in ("set", "pairs"):
                    rows = [(member, None) for member in rows]
                elif kind == "zset" and rows and not isinstance(rows[0], tuple):
                    rows = list(zip(rows[::2], rows[1::2], strict=True))
                await self._write(target, suffix, kind, expiry, rows)
                count += len(rows)
                self.copied += len(rows)
                if str(cursor) == "0":
                    break
        return count

    async def _copy_frozen(self, key: str, suffix: str, expiry: str, target: Board) -> None:
        value = await self.client.get(key)
        if value is None:
            return
        writes = Writes()
        for prefix in target.prefixes:
            writes.add(prefix, "SET", prefix + suffix, value, *(("KEEPTTL",) if suffix in GROWING else ()))
            self._register(writes, prefix, suffix, expiry)
        await self.send(writes)

    def _register(self, writes: Writes, prefix: str, suffix: str, expiry: str) -> None:
        """The new key in its shard's index, expiring as the old one does (write.lua's rule); a
        GROWING key never sooner than it does already."""
        growing = suffix in GROWING
        if expiry != "+inf":
            writes.add(prefix, "PEXPIREMAX" if growing else "PEXPIREAT", prefix + suffix, int(expiry))
        later = ("GT",) if growing else ()
        writes.add(prefix, "ZADD", keys.index_key(prefix), *later, expiry, prefix + suffix)

    def _home(self, target: Board, member: str) -> str:
        return target.prefixes[target.layout.home(_player(member))]

    def _bands(
        self, writes: Writes, target: Board, rows: list[tuple[str, Any]], gone: list[str], moved: bool
    ) -> None:
        """A band target's band index for totals copied (``rows``: player, score) or gone: each
        player in the band shard of its points, at version 1 on its home and there (band.lua takes a
        later move with a higher version). ``moved``: the player may be in another band already (a
        copy again), so they leave every other band shard."""
        layout, codec = target.layout, target.codec
        bands = [target.prefixes[b] for b in range(layout.sharding.shards, layout.physical)]
        placed: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        for player, score in rows:
            placed[target.prefixes[layout.band_shard(codec.decode_units(int(score))[0])]].append(
                (player, score)
            )
        for band in bands:
            here = placed.get(band, [])
            if here:
                writes.add(band, "ZADD", band + "total", *(x for p, v in here for x in (v, p)))
                writes.add(band, "HSET", keys.version_key(band), *(x for p, _ in here for x in (p, 1)))
                self._register(writes, band, "total", "+inf")
                self._register(writes, band, "ver", "+inf")
            away = set(gone) | ({p for p, _ in rows} - {p for p, _ in here} if moved else set())
            if away:
                writes.add(band, "ZREM", band + "total", *away)
        homes: dict[str, list[str]] = defaultdict(list)
        for player, _ in rows:
            homes[self._home(target, player)].append(player)
        for home, players in homes.items():
            writes.add(home, "HSET", keys.version_key(home), *(x for p in players for x in (p, 1)))
            self._register(writes, home, "ver", "+inf")

    async def _write(
        self,
        target: Board,
        suffix: str,
        kind: str,
        expiry: str,
        rows: list[tuple[str, Any]],
        gone: list[str] | None = None,
        moved: bool = False,
    ) -> None:
        """Write ``rows`` (member, value) of one key kind into their new homes; remove ``gone``.
        ``moved``: copied again, so a band target's index may hold the player in another band."""
        gone = gone or []
        by_home: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        for member, value in rows:
            by_home[self._home(target, member)].append((member, value))
        removed: dict[str, list[str]] = defaultdict(list)
        for member in gone:
            removed[self._home(target, member)].append(member)
        if not by_home and not removed:
            return
        writes = Writes()
        if suffix == "total" and target.layout.strategy == "band":
            self._bands(writes, target, list(rows), list(gone), moved)
        for home, items in by_home.items():
            key = home + suffix
            if kind == "zset":
                writes.add(home, "ZADD", key, *(x for m, v in items for x in (v, m)))
            elif kind in ("set", "pairs"):
                writes.add(home, "SADD", key, *(m for m, _ in items))
            else:
                writes.add(home, "HSET", key, *(x for m, v in items for x in (m, v)))
            self._register(writes, home, suffix, expiry)
        for home, members in removed.items():
            writes.add(home, "ZREM", home + suffix, *members)
        await self.send(writes)

    async def changes(
        self, source: Board, target: Board, prefixes: list[str] | None = None, final: bool = False
    ) -> int:
        """Copy again the players written on old shards since they were tracked; return how many."""
        total = 0

        async def one(prefix: str) -> None:
            nonlocal total
            taken, changes = keys.taken_key(prefix), keys.changes_key(prefix)
            took = self.client.eval(_TAKE, 3, fence_key(prefix), taken, changes, self.fence)
            if not await fenced(self.board_id, took):
                if final:
                    await self._frozen_again(prefix, target)
                return
            cursor = 0
            while True:
                cursor, members = await self.client.sscan(taken, cursor, count=BATCH)
                await self._copy_members(prefix, target, [str(m) for m in members])
                total += len(members)
                if not cursor:
                    break
            done = Writes()
            done.add(prefix, "DEL", taken)
            await self.send(done)
            if final:
                await self._frozen_again(prefix, target)

        await asyncio.gather(*(one(p) for p in prefixes or source.prefixes))
        return total

    async def _frozen_again(self, prefix: str, target: Board) -> None:
        """Frozen markers set since the copy (a freeze while the shard was tracked)."""
        for suffix, kind, expiry in await self._keys(prefix):
            if kind == "frozen":
                await self._copy_frozen(prefix + suffix, suffix, expiry, target)

    async def _copy_members(self, prefix: str, target: Board, members: list[str]) -> None:
        """Copy the current values of the players (and dedup members) of ``members`` from one old
        shard: every key kind as in the copy; a player gone from a sorted set goes from its copy."""
        if not members:
            return
        players = list(dict.fromkeys(_player(m) for m in members))
        matches = [m for m in members if not m.startswith("\x00")]
        # and where each player's removal entry is (remove.lua's NUL <player>, beside the record)
        positions = [keys.removal_position_field(p) for p in players]
        listed = await self._keys(prefix)
        read = batch(self.client)
        wanted = []
        for suffix, kind, expiry in listed:
            if kind == "zset":
                read.execute_command("ZMSCORE", prefix + suffix, *players)
            elif kind in ("set", "pairs") and matches:
                read.execute_command("SMISMEMBER", prefix + suffix, *matches)
            elif kind == "hash" and matches:
                read.execute_command("HMGET", prefix + suffix, *matches)
            elif kind == "players":  # and a removal request's fields (remove.lua tracks them as named)
                beside = positions if suffix == "rmv" else []
                read.execute_command("HMGET", prefix + suffix, *players, *matches, *beside)
            else:
                continue
            wanted.append((suffix, kind, expiry))
        for (suffix, kind, expiry), values in zip(wanted, await read.execute(), strict=True):
            if kind == "zset":
                present = [(p, v) for p, v in zip(players, values, strict=True) if v is not None]
                absent = [p for p, v in zip(players, values, strict=True) if v is None]
                await self._write(target, suffix, kind, expiry, present, absent, moved=True)
            elif kind in ("set", "pairs"):
                rows = [(m, None) for m, v in zip(matches, values, strict=True) if v]
                await self._write(target, suffix, kind, expiry, rows)
            else:
                beside = positions if suffix == "rmv" else []
                named = players + matches + beside if kind == "players" else matches
                rows = [(m, v) for m, v in zip(named, values, strict=True) if v is not None]
                await self._write(target, suffix, kind, expiry, rows)
