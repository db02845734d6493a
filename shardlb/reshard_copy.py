"""The copying half of an online reshard (shardlb/reshard.py): an old shard's keys into their new
homes in bounded batches, and the players its writes touched while it was tracked, copied again.

Every value is copied as it is now (never as an increment), and into a layout that takes no write
until the cut-over, so copying a member twice, or again after a crash, changes nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from typing import Any

from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.board import Board
from shardlb.fanout import batch

BATCH = 1000  # members copied per call
# Move a shard's tracked changes into the set the mover works from, in one call.
_TAKE = """
redis.call('SUNIONSTORE', KEYS[1], KEYS[1], KEYS[2])
redis.call('DEL', KEYS[2])
return redis.call('SCARD', KEYS[1])
"""


def _kind(suffix: str) -> str:
    """What a key of a shard is, from its name after the prefix: zset (period boards, the activity
    set), set (dedup buckets), hash (pins), frozen (markers), or skip (the journal, counters...)."""
    if suffix in ("total", "seen") or suffix[:2] in ("d:", "w:", "m:"):
        return "zset"
    if suffix.startswith("dd:"):
        return "set"
    if suffix.startswith("pin:"):
        return "hash"
    if suffix.startswith("frozen:"):
        return "frozen"
    return "skip"


def _player(member: str) -> str:
    return member.split("\x00", 1)[-1]


class Copier:
    """Copies shards of one layout into another; ``copied`` counts the members copied so far."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self.copied = 0

    async def _keys(self, prefix: str) -> list[tuple[str, str, str]]:
        """(suffix, kind, expiry) of every key a shard's index lists; expiry as the index spells it."""
        listed: Any = await self.client.zrange(keys.index_key(prefix), 0, -1, withscores=True)
        out = []
        for name, expiry in listed:
            suffix = name[len(prefix) :]
            kind = _kind(suffix)
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
            scan = {"zset": "ZSCAN", "set": "SSCAN", "hash": "HSCAN"}[kind]
            cursor = "0"
            while True:
                cursor, found = await self.client.execute_command(scan, key, cursor, "COUNT", BATCH)
                rows = list(found.items()) if isinstance(found, dict) else found
                if kind == "set":
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
        pipe = batch(self.client)
        for prefix in target.prefixes:
            pipe.execute_command("SET", prefix + suffix, value)
            self._register(pipe, prefix, suffix, expiry)
        await pipe.execute()

    def _register(self, pipe: Any, prefix: str, suffix: str, expiry: str) -> None:
        """The new key in its shard's index, expiring as the old one does (write.lua's rule)."""
        if expiry != "+inf":
            pipe.execute_command("PEXPIREAT", prefix + suffix, int(expiry))
        pipe.execute_command("ZADD", keys.index_key(prefix), expiry, prefix + suffix)

    def _home(self, target: Board, member: str) -> str:
        return target.prefixes[target.layout.home(_player(member))]

    def _bands(
        self, pipe: Any, target: Board, rows: list[tuple[str, Any]], gone: list[str], moved: bool
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
                pipe.execute_command("ZADD", band + "total", *(x for p, v in here for x in (v, p)))
                pipe.execute_command("HSET", keys.version_key(band), *(x for p, _ in here for x in (p, 1)))
                self._register(pipe, band, "total", "+inf")
                self._register(pipe, band, "ver", "+inf")
            away = set(gone) | ({p for p, _ in rows} - {p for p, _ in here} if moved else set())
            if away:
                pipe.execute_command("ZREM", band + "total", *away)
        homes: dict[str, list[str]] = defaultdict(list)
        for player, _ in rows:
            homes[self._home(target, player)].append(player)
        for home, players in homes.items():
            pipe.execute_command("HSET", keys.version_key(home), *(x for p in players for x in (p, 1)))
            self._register(pipe, home, "ver", "+inf")

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
        pipe = batch(self.client)
        if suffix == "total" and target.layout.strategy == "band":
            self._bands(pipe, target, list(rows), list(gone), moved)
        for home, items in by_home.items():
            key = home + suffix
            if kind == "zset":
                pipe.execute_command("ZADD", key, *(x for m, v in items for x in (v, m)))
            elif kind == "set":
                pipe.execute_command("SADD", key, *(m for m, _ in items))
            else:
                pipe.execute_command("HSET", key, *(x for m, v in items for x in (m, v)))
            self._register(pipe, home, suffix, expiry)
        for home, members in removed.items():
            pipe.execute_command("ZREM", home + suffix, *members)
        await pipe.execute()

    async def changes(
        self, source: Board, target: Board, prefixes: list[str] | None = None, final: bool = False
    ) -> int:
        """Copy again the players written on old shards since they were tracked; return how many."""
        total = 0

        async def one(prefix: str) -> None:
            nonlocal total
            taken, changes = keys.taken_key(prefix), keys.changes_key(prefix)
            if not await self.client.eval(_TAKE, 2, taken, changes):
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
            await self.client.delete(taken)
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
        listed = await self._keys(prefix)
        read = batch(self.client)
        wanted = []
        for suffix, kind, expiry in listed:
            if kind == "zset":
                read.execute_command("ZMSCORE", prefix + suffix, *players)
            elif kind == "set" and matches:
                read.execute_command("SMISMEMBER", prefix + suffix, *matches)
            elif kind == "hash" and matches:
                read.execute_command("HMGET", prefix + suffix, *matches)
            else:
                continue
            wanted.append((suffix, kind, expiry))
        for (suffix, kind, expiry), values in zip(wanted, await read.execute(), strict=True):
            if kind == "zset":
                present = [(p, v) for p, v in zip(players, values, strict=True) if v is not None]
                absent = [p for p, v in zip(players, values, strict=True) if v is None]
                await self._write(target, suffix, kind, expiry, present, absent, moved=True)
            elif kind == "set":
                rows = [(m, None) for m, v in zip(matches, values, strict=True) if v]
                await self._write(target, suffix, kind, expiry, rows)
            else:
                rows = [(m, v) for m, v in zip(matches, values, strict=True) if v is not None]
                await self._write(target, suffix, kind, expiry, rows)
