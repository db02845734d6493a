"""The check before a reshard's cut-over (shardlb/reshard.py, ``Resharder._sealed``): does the new
layout hold what the old one holds? It is made once every old shard is moved (none takes a write)
and before any new one opens, so both layouts stand still while it reads them; and it costs a few
pipelined round trips whatever the board's size, because writes wait while it runs.

- Counts: for every sorted set (period boards, the activity set), dedup bucket and pin hash that
  the old home shards' indexes list, its members summed over the old layout's home shards and over
  the new layout's. Every member has one home in either layout, so the sums agree. Of a band
  target, the members of its bands too: each player's total is in one band.
- Scores: ``SAMPLE`` random members of each of those sorted sets on each old shard, with their
  scores, looked up in their new home shard (and a total of a band target in its band).

Left out: the recent removals (``rmv``: remove.lua forgets old records on the old layout whose
copies stay, which is harmless), the rate limit's counters (rate.lua counts before the write, on a
sealed shard too: a count the copy lacks is of a result refused there, whose retry is counted on
the new layout), the frozen markers (copied whole to every new shard), and keys that expire within
``MARGIN_MS`` (one could expire between the reads of the two layouts).

A check, not a proof: a wrong score outside the sample passes, and so would one member missing
and another too many under the same key. It catches what loses players in bulk: copies lost with a
primary that had no replica to confirm them (reshard_copy, ``Replicated``), a shard skipped, a bug.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.board import Board
from shardlb.errors import BoardConflict
from shardlb.fanout import batch
from shardlb.reshard_copy import kind_of

SAMPLE = 16  # members of each sorted set of each old shard whose scores are compared
MARGIN_MS = 60_000  # keys that expire sooner are left out
COUNTS = {"zset": "ZCARD", "set": "SCARD", "hash": "HLEN"}


class Mismatch(BoardConflict):
    """The new layout does not hold what the old one holds: the cut-over was refused."""


def _pairs(reply: Any) -> list[tuple[str, float]]:
    """(member, score) of a WITHSCORES reply, flat (RESP2) or in pairs (RESP3)."""
    if not reply:
        return []
    if isinstance(reply[0], list | tuple):
        return [(str(m), float(s)) for m, s in reply]
    return [(str(m), float(s)) for m, s in zip(reply[::2], reply[1::2], strict=True)]


async def differences(client: RedisCluster, homes: list[str], target: Board) -> list[str]:
    """How the new layout ``target`` differs from the old layout's home shards (``homes``, their
    prefixes), one line per key that differs; empty when they agree."""
    soon = time.time() * 1000 + MARGIN_MS
    listings = batch(client)
    for prefix in homes:
        listings.zrange(keys.index_key(prefix), 0, -1, withscores=True)
    kinds: dict[str, str] = {}
    held: list[list[str]] = []  # of each old shard, the suffixes of the keys it has to compare
    for prefix, listed in zip(homes, await listings.execute(), strict=True):
        suffixes = []
        for name, expiry in _pairs(listed):
            suffix = name[len(prefix) :]
            kind = kind_of(suffix)
            if kind in COUNTS and (math.isinf(expiry) or expiry > soon):
                kinds[suffix] = kind
                suffixes.append(suffix)
        held.append(suffixes)

    new_homes = target.prefixes[: target.config.sharding.shards]
    bands = target.prefixes[target.config.sharding.shards :] if target.layout.strategy == "band" else []
    reads = batch(client)
    counted: list[tuple[str, str]] = []  # ("old" or "new" or "bands", suffix) of each count read
    for prefix, suffixes in zip(homes, held, strict=True):
        for suffix in suffixes:
            reads.execute_command(COUNTS[kinds[suffix]], prefix + suffix)
            counted.append(("old", suffix))
    for suffix, kind in kinds.items():
        for prefix in new_homes:
            reads.execute_command(COUNTS[kind], prefix + suffix)
            counted.append(("new", suffix))
    if bands and "total" in kinds:
        for prefix in bands:
            reads.execute_command("ZCARD", prefix + "total")
            counted.append(("bands", "total"))
    sampled: list[str] = []  # the key (old prefix + suffix) of each sample read
    for prefix, suffixes in zip(homes, held, strict=True):
        for suffix in suffixes:
            if kinds[suffix] == "zset":
                reads.zrandmember(prefix + suffix, SAMPLE, withscores=True)
                sampled.append(suffix)
    replies = await reads.execute()

    sums: dict[tuple[str, str], int] = defaultdict(int)
    for where, count in zip(counted, replies[: len(counted)], strict=True):
        sums[where] += int(count)
    problems = []
    for suffix in kinds:
        old, new = sums[("old", suffix)], sums[("new", suffix)]
        if old != new:
            problems.append(f"{suffix}: {old} members on the old layout, {new} on the new")
    if bands and "total" in kinds and sums[("bands", "total")] != sums[("old", "total")]:
        problems.append(
            f"bands: {sums[('bands', 'total')]} players in the new bands, "
            f"{sums[('old', 'total')]} totals on the old layout"
        )

    looks = batch(client)
    wanted: list[tuple[str, str, list[tuple[str, float]]]] = []  # (new key, suffix, old pairs)
    for suffix, reply in zip(sampled, replies[len(counted) :], strict=True):
        by_key: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for member, score in _pairs(reply):
            by_key[target.prefixes[target.layout.home(member)] + suffix].append((member, score))
            if bands and suffix == "total":
                band = target.layout.band_shard(target.codec.decode_units(int(score))[0])
                by_key[target.prefixes[band] + suffix].append((member, score))
        for key, pairs in by_key.items():
            looks.zmscore(key, [m for m, _ in pairs])
            wanted.append((key, suffix, pairs))
    wrong: dict[str, list[str]] = defaultdict(list)
    for (key, suffix, pairs), found in zip(wanted, await looks.execute(), strict=True):
        for (member, score), now in zip(pairs, found, strict=True):
            if now is None or float(now) != score:
                wrong[suffix].append(f"{member!r} {score:.0f} on the old layout, {now} in {key}")
    for suffix, lines in wrong.items():
        problems.append(f"{suffix}: {len(lines)} sampled members differ, e.g. {lines[0]}")
    return problems
