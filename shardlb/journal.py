"""The journal: each shard's stream of applied results, as write.lua appends them.

One entry per script call that applied anything: ``b`` board, ``i`` incarnation, ``s`` shard, ``n``
its count of results (entries journaled before there was ``n`` have none), and ``r``, a MessagePack
array of (dedup member, points, time units) per applied result, in the order applied, and ``c``
when some result was not applied to a closed or frozen period of its own: the names of those
periods per result (write.lua's header). A result is on the board if and only if it is in its
shard's journal (the script does both in one atomic call). A removal (shardlb/moderation.py,
remove.lua) is an entry with ``x`` instead of ``r``: a MessagePack array of the player ids removed
from every period of the shard at that id (its ``n`` counts the players it names, and counts in
the shard's ``logn`` as results do); results of those players with smaller ids on this shard
no longer count, but in the periods ``a`` says it left whole (``k``, ``q`` and ``u``: the records
it made; ``a``: ``Entry.kept``; ``w``: the inactive cleanup's, ``Entry.swept``). The archiver
(shardlb/archive.py) copies entries into PostgreSQL, acknowledges them (taking their ``n`` off the
shard's ``logn``, the results not yet archived that write.lua's bound reads) and trims what it
committed; a rebuild replays the entries written after its snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.fanout import batch

LAGS_AT_ONCE = 500  # journals whose lag one pipeline per node reads (``journal_lags``)
GROUP = "archiver"  # the consumer group every archiver reads the journals with


class Applied(NamedTuple):
    """One applied result as journaled: what a game server sent, with the time the board used."""

    match_id: str
    player_id: str
    points: int
    units: int
    skipped: tuple[str, ...] = ()  # its periods it was NOT applied to (closed or frozen), by name


class Entry(NamedTuple):
    id: str
    board: str
    incarnation: str
    shard: int
    results: list[Applied]
    removed: tuple[str, ...] = ()  # a delete entry's players (its results are then empty)
    counted: int = 0  # its ``n``: what acknowledging it takes off the shard's results not archived
    # a delete entry's records of removals (remove.lua's `rmv`): (player, time units), every player
    # a removal asked for named, present or not; the inactive cleanup's, those it removed whose last
    # post is within the dedup window (since 2026-12-06; none before)
    recorded: tuple[tuple[str, int], ...] = ()
    # a delete entry of a removal named by a request (remove.lua's `q` and `u`): its name and the
    # units it recorded for each of ``recorded``'s players beside their records ("" and -1: none)
    request: str = ""
    request_units: int = -1
    # a delete entry's players of ``removed`` whose entry stayed in some periods (remove.lua's `a`,
    # journaled since 2026-12-05: a removal made at an earlier call's time keeps the entries
    # achieved since), with the names of those periods; a player not listed stayed in none
    kept: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the inactive cleanup's delete entry (remove.lua's `w`, since 2026-12-06; before, the cleanup's
    # was the delete entry without records)
    swept: bool = False

    def kept_in(self, player: str) -> frozenset[str] | None:
        """The periods whose entry of ``player``, one of ``removed``, this removal left whole: their
        results journaled before it still count there. None when it left none (every entry without
        `a`, as before it was journaled)."""
        for p, names in self.kept:
            if p == player:
                return frozenset(names)
        return None

    def marks(self) -> list[str]:
        """Per player of ``recorded``, the value remove.lua gave the request's record of them (field
        request NUL player): the request's units, with ".1" after them for a player it removed (a
        number either way, for remove.lua's prune); none without a request."""
        if not self.request:
            return []
        return [
            f"{self.request_units}.1" if p in self.removed else f"{self.request_units}"
            for p, _ in self.recorded
        ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def decode(entry_id: Any, fields: dict[Any, Any]) -> Entry:
    """An entry as XRANGE / XREADGROUP return it (from a client that does not decode replies)."""
    get = {_text(k): v for k, v in fields.items()}
    head = (_text(entry_id), _text(get["b"]), _text(get["i"]), int(_text(get["s"])))
    counted = int(_text(get["n"])) if "n" in get else 0
    if "x" in get:
        flat = msgpack.unpackb(get["k"], raw=False) if "k" in get else []
        recorded = tuple((_text(flat[n]), int(flat[n + 1])) for n in range(0, len(flat), 2))
        removed = tuple(_text(p) for p in msgpack.unpackb(get["x"], raw=False))
        request = _text(get["q"]) if "q" in get else ""
        units = int(_text(get["u"])) if request else -1
        held = msgpack.unpackb(get["a"], raw=False) if "a" in get else []
        kept = tuple((_text(held[n]), tuple(_text(held[n + 1]).split(","))) for n in range(0, len(held), 2))
        swept = "w" in get or not recorded
        return Entry(*head, [], removed, counted, recorded, request, units, kept, swept)
    flat = msgpack.unpackb(get["r"], raw=False)
    skips = msgpack.unpackb(get["c"], raw=False) if "c" in get else [""] * (len(flat) // 3)
    results = []
    for n in range(0, len(flat), 3):
        member = flat[n] if isinstance(flat[n], str) else bytes(flat[n]).decode()
        match, _, player = member.rpartition("\x00")  # player ids never hold NUL; match ids may
        skipped = _text(skips[n // 3])
        closed = tuple(skipped.split(",")) if skipped else ()
        results.append(Applied(match, player, int(flat[n + 1]), int(flat[n + 2]), closed))
    return Entry(*head, results, counted=counted)


class Lag(NamedTuple):
    """How far the archive is behind one journal: entries not yet acknowledged, the age of the
    oldest of them (seconds; 0 when there are none), and the results they hold as write.lua counts
    them (its ``logn``: up by each entry's results as it is written, down as the archiver
    acknowledges it)."""

    entries: int
    seconds: float
    results: int = 0


async def journal_lags(client: RedisCluster, journals: Sequence[str]) -> list[Lag]:
    """``journal_lag`` of each of ``journals``, read ``LAGS_AT_ONCE`` at a time with one pipeline per
    node (fanout.batch): a round trip per node and chunk, not three per journal one after another
    (2,000 boards of 10 shards: 60,000 round trips, 7 s on loopback). Each journal's three reads are
    not atomic together, as in ``journal_lag``."""
    out: list[Lag] = []
    now = time.time()
    for start in range(0, len(journals), LAGS_AT_ONCE):
        chunk = journals[start : start + LAGS_AT_ONCE]
        reads = batch(client)
        for key in chunk:
            reads.execute_command("XRANGE", key, "-", "+", "COUNT", 1)
            reads.execute_command("XLEN", key)
            reads.execute_command("GET", keys.journal_counts_of(key))
        replies = await reads.execute()
        for i in range(len(chunk)):
            first, entries, results = replies[3 * i : 3 * i + 3]
            if not first:
                out.append(Lag(0, 0.0))
                continue
            ms = int(_text(first[0][0]).split("-")[0])
            out.append(Lag(int(entries), max(0.0, now - ms / 1000), max(0, int(results or 0))))
    return out


async def journal_lag(client: RedisCluster, key: str) -> Lag:
    """Entries not yet acknowledged by the archive (all of them when no archiver ever ran), the age
    of the oldest in seconds (after ``trim`` the stream holds exactly those), and their results.
    ``client`` must leave replies undecoded (``connect(url, decode=False)``): entries carry MessagePack."""
    first = await client.xrange(key, count=1)
    if not first:
        return Lag(0, 0.0)
    entries = await client.xlen(key)
    results = max(0, int(await client.get(keys.journal_counts_of(key)) or 0))
    ms = int(_text(first[0][0]).split("-")[0])
    return Lag(int(entries), max(0.0, time.time() - ms / 1000), results)
