"""Cross-shard reads over one period's sorted sets: top, rank counts, neighbours, pages at any depth.

Every function here reads several shards with per-node pipelines sent concurrently (``fanout.Batch``),
then reassembles locally. None of it is atomic across shards: under concurrent writes an answer can
be off by the writes in flight, and is exact once writes are quiescent.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
from redis.asyncio.cluster import RedisCluster

from shardlb.connection import Script
from shardlb.fanout import batch, script_calls
from shardlb.merge import Row, merge, rows, unique

# A page whose start lies in the first SHALLOW rows is read as top(offset + limit): cheaper than bisecting.
SHALLOW = 1000
MAX_BISECT_ROUNDS = 120
TOP_SLACK = 8  # rows read from each shard for a best n beyond its share n / shards and 2 sqrt of it
# A shard's rows tied with a player, read back to order them locally; a larger block takes counts.lua.
TIE_ROWS = 32
# A band board's rank of one player in one round (the home key and every band key) up to this many
# bands; past it, two rounds (the home key, then the player's band and the sizes).
ONE_ROUND_BANDS = 8


class Located(NamedTuple):
    """A player found in their home key (``View.locate``): their row, the key's index in the view,
    the rows ahead of them there and the key's size."""

    row: Row
    home: int
    ahead: int
    size: int


class BandPlace(NamedTuple):
    """A player placed on a band board's total (``View.band_place``): their row from their home
    key, the index of their band among the view's keys, the rows of other players ahead of them on
    the whole view, every band's size, whether their band holds them at that very row (``ahead``
    came from ZREVRANK, not from counting) and the stale rows of theirs in the bands before (a
    pending move: in ``sizes``, not in ``ahead``)."""

    row: Row
    band: int
    ahead: int
    sizes: list[int]
    held: bool
    stale: int


@dataclass(frozen=True, slots=True)
class ResolvedView:
    """What one read of a board covers, resolved once from the request's period and region
    (``Board.resolve``). Every read takes it, and the router's caches key on it: two spellings of
    one period, or a region on a board without regions, resolve to equal views, and the keys name
    the board's incarnation, so a board re-created under its id is a different view."""

    board: str
    period: str  # the board's period name: the keys' suffix (total, d:2026-11-30)
    api: str  # the same period as answers spell it (total, daily:2026-11-30)
    region: str | None  # the region the read is limited to; None: the whole board
    keys: tuple[str, ...]  # one per shard merged (band boards' total: the band keys, best band first)
    banded: bool = False

    def __hash__(self) -> int:
        # Hashed on every cache lookup of a read: the board, period and region tell views apart
        # well enough (equal views still compare all fields), without hashing every shard's key.
        return hash((self.board, self.period, self.region))


@dataclass
class View:
    """Reads over the sorted sets of one ResolvedView (its ``keys``), merged across shards."""

    client: RedisCluster
    keys: Sequence[str]
    counts: Script
    banded: bool = False
    shallow: int = SHALLOW
    replicas: bool = False  # reads may be served by replicas (connection.connect's read_from)
    near_script: Script | None = None  # near.lua: a player's home shard for "around me" in one call
    places_script: Script | None = None  # places.lua: players' scores and places in their home keys
    # Band boards' total: the index in ``keys`` of the band that a score belongs to.
    band_of: Callable[[float], int] | None = None

    async def _each(self, command: str, *args: Any, **kwargs: Any) -> list[Any]:
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key in self.keys:
            getattr(pipe, command)(key, *args, **kwargs)
        return list(await pipe.execute())

    async def sizes(self) -> list[int]:
        return [int(n) for n in await self._each("zcard")]

    async def top(self, n: int) -> list[Row]:
        """The best ``n`` rows, k-way merged from each shard's best (band boards: best band down)."""
        if n <= 0:
            return []
        if self.banded:
            out: list[Row] = []
            for key in self.keys:
                out = unique([*out, *await self._band_rows(key, 0, n)])
                if len(out) >= n:
                    break
            return out[:n]
        return await self._best_from([0] * len(self.keys), n)

    async def _best_from(self, starts: Sequence[int], n: int) -> list[Row]:
        """The best ``n`` rows of the merged order among each key's rows from index ``starts[i]`` on.

        A hash shard holds about share = n / shards of them (binomial: standard deviation under
        sqrt(share)): read share + 2 sqrt(share) plus slack from each, then read further only from
        shards whose every row read so far is in the merged best n. Their next rows rank below all
        they sent, so any other shard's unread rows cannot make it. Rows are most of a window's
        cost (Redis formats each score), so the first read is kept near the expected need.
        """
        share = n / len(self.keys)
        first = n if len(self.keys) == 1 else min(n, math.ceil(share + 2 * math.sqrt(share)) + TOP_SLACK)
        asked = [first] * len(self.keys)
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key, start in zip(self.keys, starts, strict=True):
            pipe.zrevrange(key, start, start + asked[0] - 1, withscores=True)
        got = [rows(pairs) for pairs in await pipe.execute()]
        while True:
            best = merge(got)[:n]
            cutoff = best[-1] if len(best) == n else None
            more = [
                i
                for i, part in enumerate(got)
                if len(part) == asked[i] < n and (cutoff is None or part[-1] >= cutoff)
            ]
            if not more:
                return best
            pipe = batch(self.client, replicas=self.replicas, shared=True)
            for i in more:
                start = starts[i] + asked[i]
                pipe.zrevrange(self.keys[i], start, starts[i] + min(n, 2 * asked[i]) - 1, withscores=True)
            for i, pairs in zip(more, await pipe.execute(), strict=True):
                got[i] += rows(pairs)
                asked[i] = min(n, 2 * asked[i])

    async def counts_ahead(
        self, row: Row, floors: Sequence[int] = (), sizes: list[int] | None = None
    ) -> tuple[list[int], list[int]]:
        """Per shard, how many rows rank ahead of ``row``: ZCOUNT of better scores plus the tie rule;
        and, summed over shards, how many rows score at least each of ``floors`` (``at_least``; as
        in ``counts``, floors above ``row`` leave out the player's own stale rows: ``_less_own``).
        ``sizes``, when given, is filled with each shard's size, taken with its count.

        One pipeline (per node, nodes in parallel) of ZCOUNT above, ZCOUNT equal and the row's own
        ZSCORE, plus one ZCOUNT per floor (and ZCARD, for ``sizes``); only a shard where someone
        other than the row shares its exact score needs the tie-resolving script, which then gives
        that shard's size too: rows may reach it between the two rounds, and a count of after them
        with a size of before them could rank the player past the board's size.
        """
        score, member = row
        text = _score(score)
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key in self.keys:
            pipe.zcount(key, f"({text}", "+inf")
            pipe.zcount(key, text, text)
            pipe.zscore(key, member)
            for floor in floors:
                pipe.zcount(key, floor, "+inf")
            if sizes is not None:
                pipe.zcard(key)
        replies = await pipe.execute()
        step = 3 + len(floors) + (sizes is not None)
        counts = [int(n) for n in replies[0::step]]
        owns = replies[2::step]
        others = [int(t) - (own == score) for t, own in zip(replies[1::step], owns, strict=True)]
        tied = [i for i, n in enumerate(others) if n > 0]
        sized = () if sizes is None else (_pack([]), b"size")
        exact = await self._count_calls([(self.keys[i], _pack([text, member]), *sized) for i in tied])
        if sizes is not None:
            sizes[:] = [int(n) for n in replies[step - 1 :: step]]
        for i, reply in zip(tied, exact, strict=True):
            counts[i] = int(reply[0])
            if sizes is not None:
                sizes[i] = int(reply[1])
        for i, own in enumerate(owns):  # the row's own stale row in a band (a pending move)
            if own is not None and own > score:
                counts[i] -= 1
        totals = [sum(int(n) for n in replies[3 + f :: step]) for f in range(len(floors))]
        return counts, [_less_own(n, floor, row, owns) for n, floor in zip(totals, floors, strict=True)]

    async def locate(self, member: str, home: int) -> Located | None:
        """The player's row, their exact place and size in their home key ``self.keys[home]``: one
        pipeline to one node (ZSCORE, ZREVRANK, ZCARD). None when they have no row there.

        ZREVRANK counts the rows ahead in the board's order (higher score, then larger id first),
        ties included, so the home shard needs no tie resolution. Only for views whose player lives
        in exactly one of ``keys`` (hash boards, and region boards read in one region).
        """
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        key = self.keys[home]
        # The commands as redis-py's zscore, zrevrank and zcard record them, less the options that
        # change nothing here (``keys``, its routing hint: a batch routes by the first key; ZREVRANK's
        # defaults, no score asked): their replies are parsed alike, without those options passed
        # on command by command (``rank_of`` likewise). "My rank" makes these nine times a read.
        pipe.execute_command("ZSCORE", key, member)
        pipe.execute_command("ZREVRANK", key, member)
        pipe.execute_command("ZCARD", key)
        score, ahead, size = await pipe.execute()
        if score is None or ahead is None:
            return None
        return Located((score, member), home, int(ahead), int(size))

    async def rank_of(self, found: Located) -> tuple[int, int]:
        """The player's unique rank and the view's size, from ``locate``: one more pipeline per node
        holding the other keys, of one-number replies only (ZCOUNT above, ZCOUNT at the player's
        score, ZCARD), so a rank costs two rounds of round trips whatever the number of shards; a
        third only where a key counted rows at that very score (``_resolve_ties``), which counts
        that key again whole."""
        others = [i for i in range(len(self.keys)) if i != found.home]
        if not others:
            return found.ahead + 1, found.size
        score = found.row[0]
        text = _score(score)
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for i in others:  # (recorded as ``locate`` records its commands)
            key = self.keys[i]
            pipe.execute_command("ZCOUNT", key, f"({text}", "+inf")
            pipe.execute_command("ZCOUNT", key, text, text)  # ties: read in a third round if any
            pipe.execute_command("ZCARD", key)
        replies = await pipe.execute()
        counts = [int(n) for n in replies[0::3]]
        sizes = [int(n) for n in replies[2::3]]
        await self._resolve_ties(found, others, counts, [int(n) for n in replies[1::3]], sizes)
        return found.ahead + sum(counts) + 1, found.size + sum(sizes)

    async def near(self, member: str, home: int, radius: int) -> tuple[Located, list[Row]] | None:
        """``locate`` for "around me": the player's row, place and key size, and the rows from
        ``radius`` above to ``radius`` below them in their home key, in one call of near.lua (one
        round trip to one node). None when they have no row there."""
        script = self.near_script
        assert script is not None
        key = self.keys[home]
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        pipe.execute_command("EVALSHA", script.sha, 1, key, member, radius)
        replies = await pipe.direct()
        await pipe.load_scripts(script)
        # Anything but a reply on that path (NOSCRIPT, a moved slot): the script object, on the primary.
        reply = replies[0] if replies is not None else await script(keys=[key], args=[member, radius])
        if not reply:
            return None
        score, ahead, size, flat = reply
        row: Row = (float(score), member)
        window = [(float(flat[i + 1]), str(flat[i])) for i in range(0, len(flat), 2)]
        return Located(row, home, int(ahead), int(size)), window

    async def around_of(
        self, found: Located, home_rows: list[Row], radius: int
    ) -> tuple[list[Row], int, int] | None:
        """Up to ``radius`` rows above and below the player, with the player's rank and index among
        them, from ``near``: one more pipeline per node holding the other keys. Each of those gives
        its ``radius`` nearest rows strictly above and below the player's score and its whole tie
        block at that score; with the home key's window by index they hold the nearest ``radius``
        rows of the merged order on either side. None when another key's tie block is larger than
        TIE_ROWS (the caller then reads by index)."""
        score, member = found.row
        text = _score(score)
        others = [i for i in range(len(self.keys)) if i != found.home]
        near = [r for r in home_rows if r[1] != member]
        counts: list[int] = []
        if others:
            pipe = batch(self.client, replicas=self.replicas, shared=True)
            for i in others:
                key = self.keys[i]
                pipe.zcount(key, f"({text}", "+inf")
                pipe.zrangebyscore(key, text, text, 0, TIE_ROWS + 1, withscores=True)
                pipe.zrangebyscore(key, f"({text}", "+inf", 0, radius, withscores=True)
                pipe.zrevrangebyscore(key, f"({text}", "-inf", 0, radius, withscores=True)
            replies = await pipe.execute()
            for j in range(len(others)):
                above, block, up, down = replies[4 * j : 4 * j + 4]
                if len(block) > TIE_ROWS:
                    return None
                counts.append(int(above) + sum(1 for m, _ in block if m > member))
                near += rows(block) + rows(up) + rows(down)
        rank = found.ahead + sum(counts) + 1
        near = sorted(set(near), reverse=True)
        at = sum(1 for r in near if r > found.row)
        window = [*near[max(0, at - radius) : at], found.row, *near[at : at + radius]]
        return window, rank, min(at, radius)

    async def _resolve_ties(
        self, found: Located, others: list[int], counts: list[int], tied: list[int], sizes: list[int]
    ) -> None:
        """Count the rows ahead of the player again, rows tied with them included, on the keys of
        ``others`` that counted rows at the player's score (``tied``), into ``counts`` (and their
        sizes into ``sizes``): where the tie block is small (at most TIE_ROWS rows, read up to one
        past, so that its length says whether it still is), ZCOUNT above, the block and ZCARD, in
        one pipeline per node, the block ordered here; else counts.lua, which takes the key's size
        in the same call. Ties are rare, so most ranks need neither: a list reply costs Redis more
        than a count (docs/design-notes.md, "What a rank costs inside Redis"). Counted again, not
        added to the round before's count: a row that moved between the two rounds (tied ahead, then
        above; above, then tied ahead) was counted in neither or in both, a rank no order of the
        writes gives (1 where a rival was ahead all along, or past the board's size), until
        2026-12-06; and a large block's count was of a later moment than its key's size (rows that
        arrived between were in the rank and not in the size: rank 36 of 34 players), until later
        that day."""
        score, member = found.row
        text = _score(score)
        small = [j for j, n in enumerate(tied) if 0 < n <= TIE_ROWS]
        big = [j for j, n in enumerate(tied) if n > TIE_ROWS]
        if small:
            pipe = batch(self.client, replicas=self.replicas, shared=True)
            for j in small:
                key = self.keys[others[j]]
                pipe.zcount(key, f"({text}", "+inf")
                pipe.zrangebyscore(key, text, text, 0, TIE_ROWS + 1)
                pipe.zcard(key)
            replies = await pipe.execute()
            for j, above, block, size in zip(small, replies[0::3], replies[1::3], replies[2::3], strict=True):
                sizes[j] = int(size)
                if len(block) > TIE_ROWS:  # it grew since it was counted
                    big.append(j)
                else:
                    counts[j] = int(above) + sum(1 for m in block if m > member)
        if big:  # counted with the key's size in one call: rows may arrive since it was sized
            packed, sized = _pack([text, member]), (_pack([]), b"size")
            exact = await self._count_calls([(self.keys[others[j]], packed, *sized) for j in big])
            for j, reply in zip(big, exact, strict=True):
                counts[j], sizes[j] = int(reply[0]), int(reply[1])

    # ---- band boards' total ----------------------------------------------------------------
    # The bands part the points, best band first in ``keys``: every row of a band ranks ahead of
    # every row of the bands after it. So the rows ahead of a player are the sizes of the bands
    # before theirs (O(1) each) plus the rows ahead of them inside their band: one ZREVRANK where
    # the band holds them at the row their home key gives. That is the count of every band's rows
    # ahead of that row, the count the other views take, with one sorted set descended instead of
    # all of them. A band that does not hold them at that row (a move not yet taken there) is
    # counted from the home row (counts.lua), which gives the same count. A stale row of the
    # player's own (a pending move: shardlb/bands.py) is never counted ahead of them: those in the
    # bands before theirs are taken off the sizes, which ZSCORE on those bands finds in the same
    # round, and counts.lua leaves out one in their band.

    async def band_place(
        self, home_key: str, member: str, sizes: Sequence[int] | None = None, guess: int | None = None
    ) -> BandPlace | None:
        """Place a player on a band board's total: their row from ``home_key`` (their record's
        shard) and the rows ahead of them. Up to ONE_ROUND_BANDS bands, one round: ZSCORE on the
        home key, and ZSCORE, ZREVRANK and ZCARD on every band (a band without the player answers
        the first two from its hash table, without a descent). More bands: the home key first, then
        ZCARD on every band, ZSCORE on theirs and the bands before it, and ZREVRANK on theirs. None
        when the home key has no row. Where their band does not hold them at the home row (a move
        pending), counts.lua counts their place in it in one round more, with the band's size.

        ``sizes``: the bands' sizes as read a moment ago (``Board.player``'s ``max_age_ms``). Then
        only the home key and the player's own band are read: ZSCORE, ZREVRANK and ZCARD (which
        replaces that band's entry in ``sizes``) go to the band ``guess`` (where the player was
        last placed) in the home key's round, and again to their band after it if the home row
        says they are elsewhere now (or there is no guess). The other bands are as they were read:
        a stale row of the player's there is not looked for."""
        assert self.band_of is not None
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        pipe.zscore(home_key, member)
        found: list[Any] = []  # the player's score in the bands before theirs, where asked
        if sizes is not None:
            band = guess
            if band is not None:
                pipe.zscore(self.keys[band], member)
                pipe.zrevrank(self.keys[band], member)
                pipe.zcard(self.keys[band])
            score, *replies = await pipe.execute()
            if score is None:
                return None
            if band != self.band_of(score):
                band = self.band_of(score)
                pipe = batch(self.client, replicas=self.replicas, shared=True)
                pipe.zscore(self.keys[band], member)
                pipe.zrevrank(self.keys[band], member)
                pipe.zcard(self.keys[band])
                replies = await pipe.execute()
            held, inside, own = replies
            sizes = [*sizes[:band], int(own), *sizes[band + 1 :]]
        elif len(self.keys) <= ONE_ROUND_BANDS:
            for key in self.keys:
                pipe.zscore(key, member)
                pipe.zrevrank(key, member)
                pipe.zcard(key)
            replies = await pipe.execute()
            score = replies[0]
            if score is None:
                return None
            band = self.band_of(score)
            found = replies[1 : 3 * band : 3]
            sizes = [int(n) for n in replies[3::3]]
            held, inside = replies[1 + 3 * band], replies[2 + 3 * band]
        else:
            [score] = await pipe.execute()
            if score is None:
                return None
            band = self.band_of(score)
            pipe = batch(self.client, replicas=self.replicas, shared=True)
            for key in self.keys[: band + 1]:
                pipe.zscore(key, member)
            pipe.zrevrank(self.keys[band], member)
            for key in self.keys:
                pipe.zcard(key)
            replies = await pipe.execute()
            found, held, inside = replies[:band], replies[band], replies[band + 1]
            sizes = [int(count) for count in replies[band + 2 :]]
        whole = held == score and inside is not None
        if not whole:  # counted from the home row; counts.lua leaves out a stale row of theirs
            # and gives the band's size with the count: rows may have reached it since it was sized.
            [reply] = await self._count_calls(
                [(self.keys[band], _pack([_score(score), member]), bytes(msgpack.packb([1])), b"size")]
            )
            inside = reply[0]
            sizes = [*sizes[:band], int(reply[1]), *sizes[band + 1 :]]
        stale = sum(1 for at in found if at is not None)
        return BandPlace((score, member), band, sum(sizes[:band]) - stale + int(inside), sizes, whole, stale)

    async def band_window(self, place: BandPlace, radius: int) -> tuple[list[Row], int] | None:
        """Up to ``radius`` rows above and below a placed player, and the player's index among
        them: the view's rows by index around the player's, read from the one or few bands they
        fall in (one round). None when the rows read do not hold the player at their place, or
        hold someone twice (writes moved rows meanwhile): the caller then reads the generic way.
        The index is among the bands' rows, the player's stale rows ahead (``place.stale``) included."""
        at = place.ahead + place.stale
        lo, hi = max(0, at - radius), at + radius + 1
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        start = 0
        for key, size in zip(self.keys, place.sizes, strict=True):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                pipe.zrevrange(key, a - start, b - start - 1, withscores=True)
            start += size
        got = [row for pairs in await pipe.execute() for row in rows(pairs)]
        if at - lo >= len(got) or got[at - lo] != place.row or len({m for _, m in got}) != len(got):
            return None
        return got, at - lo

    async def band_counts(self, targets: Sequence[Row]) -> list[int]:
        """For each of ``targets`` (rows read from their home keys, one per player), the rows of
        other players ahead of it on a band board's total: the sizes of the bands before its own,
        less its own stale rows there (ZMSCORE of the targets of later bands, beside each ZCARD),
        plus its place inside its band from one counts.lua call per band holding targets (ZREVRANK
        where the band holds the row, a count where not), all in one round."""
        if not targets:
            return []
        assert self.band_of is not None
        by_band: dict[int, list[int]] = defaultdict(list)
        for t, (score, _) in enumerate(targets):
            by_band[self.band_of(score)].append(t)
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        later: list[list[int]] = []  # per band, the targets of the bands after it
        for i, key in enumerate(self.keys):
            pipe.zcard(key)
            later.append([t for band, ts in by_band.items() if band > i for t in ts])
            if later[-1]:
                pipe.zmscore(key, [targets[t][1] for t in later[-1]])
        calls: list[tuple[str, bytes] | tuple[str, bytes, bytes]] = [
            (
                self.keys[band],
                _pack([x for t in ts for x in (_score(targets[t][0]), targets[t][1])]),
                bytes(msgpack.packb(list(range(1, len(ts) + 1)))),
            )
            for band, ts in by_band.items()
        ]
        got, replies = await asyncio.gather(pipe.execute(), self._count_calls(calls))
        sizes: list[int] = []
        out = [0] * len(targets)
        at = 0
        for ts in later:
            sizes.append(int(got[at]))
            held = got[at + 1] if ts else []
            at += 2 if ts else 1
            for t, score in zip(ts, held, strict=True):
                out[t] -= score is not None
        before = [0, *itertools.accumulate(sizes)]
        for (band, ts), reply in zip(by_band.items(), replies, strict=True):
            for t, inside in zip(ts, reply, strict=True):
                out[t] += before[band] + int(inside)
        return out

    async def at_least(self, floors: Sequence[int], row: Row | None = None) -> list[int]:
        """Summed over shards, how many rows score at least each of ``floors``: one ZCOUNT per shard
        and floor, in one pipeline. (Every score is at least 0: a floor of 0 counts the view.)

        ``row``: the player's row from their home key; floors above it count the rows of other
        players only (``_less_own``). On a band board's total the same pipeline asks ZSCORE of the
        player on their band and the bands before it, where a pending move can leave a stale row of
        theirs; other views hold none above the home row, and ask nothing more."""
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key in self.keys:
            for floor in floors:
                pipe.zcount(key, floor, "+inf")
        if row is not None:
            for i in self._stale_keys(row):
                pipe.zscore(self.keys[i], row[1])
        replies = await pipe.execute()
        counted = len(self.keys) * len(floors)
        totals = [sum(int(n) for n in replies[f : counted : len(floors)]) for f in range(len(floors))]
        if row is None:
            return totals
        return [_less_own(n, floor, row, replies[counted:]) for n, floor in zip(totals, floors, strict=True)]

    async def at_least_each(self, targets: Sequence[Row], floors: Sequence[int]) -> list[int]:
        """For each of ``targets`` (rows from their home keys, one per player), how many rows of
        other players score at least its floor in ``floors``, a score above its row: counts.lua,
        one call per key, given (floor, "") for each distinct floor (the rows ahead of it are
        exactly those scoring the floor or more, as no id sorts below the empty one). On a band
        board's total, concurrently, a ZMSCORE per band of the targets of that band and the bands
        after it finds their own stale rows, which are left out (``_less_own``)."""
        distinct = list(dict.fromkeys(floors))
        counting = self.counts_ahead_many([(floor, "") for floor in distinct])
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        asked: list[list[int]] = []  # per ZMSCORE sent, the targets it asks for
        for i, key in enumerate(self.keys):
            ts = [t for t, target in enumerate(targets) if i in self._stale_keys(target)]
            if ts:
                pipe.zmscore(key, [targets[t][1] for t in ts])
                asked.append(ts)
        counts, held = await asyncio.gather(counting, pipe.execute()) if asked else (await counting, [])
        owns: list[list[float | None]] = [[] for _ in targets]
        for ts, scores in zip(asked, held, strict=True):
            for t, score in zip(ts, scores, strict=True):
                owns[t].append(score)
        ahead = {floor: sum(c) for floor, c in zip(distinct, counts, strict=True)}
        return [_less_own(ahead[f], f, t, own) for t, f, own in zip(targets, floors, owns, strict=True)]

    def _stale_keys(self, row: Row) -> range:
        """Where a stale row of the player of ``row`` can rank above it (a pending move): on a band
        board's total, the indexes of their band and the bands before it; elsewhere none."""
        if self.band_of is None:
            return range(0)
        return range(self.band_of(row[0]) + 1)

    async def counts_ahead_many(
        self, targets: Sequence[Row], homes: Sequence[int | None] = ()
    ) -> list[list[int]]:
        """``counts_ahead`` for many rows: one script call per shard counting all of them inside Redis.
        ``homes``: per row, the index of the key its member lives in (None: unknown), where
        counts.lua takes its ZREVRANK instead of counting."""
        if not targets:
            return []
        packed = _pack([x for score, member in targets for x in (_score(score), member)])
        at_home: dict[int, list[int]] = defaultdict(list)
        for t, home in enumerate(homes):
            if home is not None:
                at_home[home].append(t + 1)
        calls: list[tuple[str, bytes] | tuple[str, bytes, bytes]] = [
            (key, packed, bytes(msgpack.packb(at_home[i]))) if i in at_home else (key, packed)
            for i, key in enumerate(self.keys)
        ]
        replies = await self._count_calls(calls)
        return [[int(reply[t]) for reply in replies] for t in range(len(targets))]

    async def home_places(self, members: Mapping[int, list[str]]) -> list[tuple[Row, int, int]]:
        """Players in the keys they live in (``members``: index in ``keys`` -> ids): for each with a
        row there, (row, that index, rows ahead of it there), from one places.lua call per key, one
        round. ZREVRANK counts the home key's ties with the player, so only the other keys count."""
        script = self.places_script
        assert script is not None
        groups = [(home, ids) for home, ids in members.items() if ids]
        calls = [(self.keys[home], _pack(ids)) for home, ids in groups]
        replies = await script_calls(self.client, script, calls, self.replicas, shared=True)
        return [
            ((float(score), member), home, ahead)
            for (home, ids), reply in zip(groups, replies, strict=True)
            for member, score, ahead in zip(ids, reply[0::2], reply[1::2], strict=True)
            if score is not None
        ]

    async def counts_away(self, placed: Sequence[tuple[Row, int]]) -> list[int]:
        """For each (row, home) of ``home_places``, the rows ahead of it in the keys other than its
        home: one counts.lua call per key, given the rows that do not live there."""
        pairs = [(_score(score), member) for (score, member), _ in placed]
        homes = [home for _, home in placed]
        away = [[t for t, home in enumerate(homes) if home != i] for i in range(len(self.keys))]
        asked = [(i, ts) for i, ts in enumerate(away) if ts]
        calls = [(self.keys[i], _pack([x for t in ts for x in pairs[t]])) for i, ts in asked]
        out = [0] * len(placed)
        for (_, ts), reply in zip(asked, await self._count_calls(calls), strict=True):
            for t, n in zip(ts, reply, strict=True):
                out[t] += int(n)
        return out

    async def _count_calls(
        self, calls: Sequence[tuple[str, bytes] | tuple[str, bytes, bytes] | tuple[str, bytes, bytes, bytes]]
    ) -> list[Any]:
        """counts.lua on several shards, each with its packed (score, member) list (and its homes,
        and a flag that asks for the key's size after the counts)."""
        return await script_calls(self.client, self.counts, calls, self.replicas, shared=True)

    async def around(self, row: Row, counts: list[int], radius: int) -> tuple[list[Row], int]:
        """Up to ``radius`` rows above and below ``row``; returns the rows and the index of ``row``."""
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key, ahead in zip(self.keys, counts, strict=True):
            pipe.zrevrange(key, max(0, ahead - radius), ahead + radius, withscores=True)
        merged = [r for r in unique(merge(rows(pairs) for pairs in await pipe.execute())) if r[1] != row[1]]
        at = sum(1 for r in merged if r > row)
        return [*merged[max(0, at - radius) : at], row, *merged[at : at + radius]], min(at, radius)

    async def page(self, offset: int, limit: int) -> list[Row]:
        """Rows ``offset`` .. ``offset + limit - 1`` of the merged order, at any depth.

        Bisects on the score to find a cut ``v`` with G(v) = rows strictly above v just at or below
        ``offset`` (per-shard ZCOUNT sums), then merges the best rows below v by index from each
        shard's count above it, a little over its share of them from each (``_best_from``). When more
        than ``limit`` players share the score ``v`` itself, the cut is refined by player id inside
        that tie block, so the window stays bounded there too.
        """
        if offset + limit <= self.shallow:
            return (await self.top(offset + limit))[offset:]
        if self.banded:
            return await self._band_page(offset, limit)
        sizes, firsts, lasts = await self._ends()
        if offset >= sum(sizes):
            return []
        cut, above = await self._cut(offset, limit, sizes, firsts, lasts)
        starts = (
            above
            if offset - sum(above) <= limit
            else await self._cut_tie_block(cut, offset - sum(above), limit)
        )
        skip = offset - sum(starts)
        return (await self._best_from(starts, skip + limit))[skip:]

    async def _cut_tie_block(self, score: int, within: int, limit: int) -> list[int]:
        """Per shard, the index where the merged page starts inside the tie block at ``score``.

        Same bracketing as ``_cut``, over player ids instead of scores: pivots are ids read at the
        interpolated index of each shard's part of the block, counted with ``counts.lua``.
        """
        text = _score(score)
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key in self.keys:
            pipe.zcount(key, f"({text}", "+inf")
            pipe.zcount(key, text, text)
        replies = [int(x) for x in await pipe.execute()]
        base, tied = replies[0::2], replies[1::2]
        top, bottom = [0] * len(self.keys), list(tied)
        target = within - limit // 2
        for _ in range(MAX_BISECT_ROUNDS):
            if within - sum(top) <= limit or sum(bottom) - sum(top) <= 1:
                break
            fraction = (target - sum(top)) / (sum(bottom) - sum(top))
            pivot = await self._pivot(
                [b + t for b, t in zip(base, top, strict=True)],
                [b + t for b, t in zip(base, bottom, strict=True)],
                fraction,
                member=True,
            )
            counted = await self._count_calls([(key, _pack([text, pivot])) for key in self.keys])
            ahead = [int(reply[0]) - b for reply, b in zip(counted, base, strict=True)]
            before = (top, bottom)
            if sum(ahead) <= within:
                top = [max(a, t) for a, t in zip(ahead, top, strict=True)]
            else:
                bottom = [min(a, b) for a, b in zip(ahead, bottom, strict=True)]
            if (top, bottom) == before:
                break  # the pivot sat on the bracket's edge: read the (correct, wider) window from here
        return [b + t for b, t in zip(base, top, strict=True)]

    async def _counts_above(self, value: int) -> list[int]:
        return [int(n) for n in await self._each("zcount", f"({value}", "+inf")]

    async def _ends(self) -> tuple[list[int], list[int], list[int]]:
        """Per shard, in one round: its size and its best and worst score (0 where it is empty)."""
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        for key in self.keys:
            pipe.zcard(key)
            pipe.zrevrange(key, 0, 0, withscores=True)
            pipe.zrange(key, 0, 0, withscores=True)
        replies = await pipe.execute()
        ends = [[int(p[0][1]) if p else 0 for p in replies[i::3]] for i in (1, 2)]
        return [int(n) for n in replies[0::3]], ends[0], ends[1]

    async def _cut(
        self, offset: int, limit: int, sizes: list[int], firsts: list[int], lasts: list[int]
    ) -> tuple[int, list[int]]:
        """A score ``hi`` with offset - limit <= G(hi) <= offset, or the tie block holding ``offset``,
        and each key's rows above ``hi`` (G(hi) is their sum).

        The bracket (lo, hi] is kept with per-shard counts above each end, from the best and worst
        scores of the non-empty shards (``_ends``). Each round reads, from every shard, the row at the
        interpolated index inside its part of the bracket and cuts at the weighted median of those
        scores: on any score distribution this lands close to the target rank, so pages take a few
        rounds. Every third round halves the bracket to bound the worst case.
        """
        filled = [i for i, n in enumerate(sizes) if n]
        hi = max(firsts[i] for i in filled)
        lo = min(lasts[i] for i in filled) - 1
        c_hi, c_lo = [0] * len(self.keys), list(sizes)
        target = offset - limit // 2
        for step in range(MAX_BISECT_ROUNDS):
            g_hi, g_lo = sum(c_hi), sum(c_lo)
            if hi - lo <= 1 or offset - g_hi <= limit:
                break
            mid = (
                (lo + hi) // 2
                if step % 3 == 2
                else await self._pivot(c_hi, c_lo, (target - g_hi) / (g_lo - g_hi))
            )
            mid = min(max(mid, lo + 1), hi - 1)
            c_mid = await self._counts_above(mid)
            if sum(c_mid) <= offset:
                hi, c_hi = mid, c_mid
            else:
                lo, c_lo = mid, c_mid
        return hi, c_hi

    async def _pivot(self, c_hi: list[int], c_lo: list[int], fraction: float, member: bool = False) -> Any:
        """Weighted median of each shard's score (or player id) at ``fraction`` of its rows inside
        the bracket."""
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        weights = []
        for key, top, bottom in zip(self.keys, c_hi, c_lo, strict=True):
            if bottom > top:
                index = min(top + int(fraction * (bottom - top)), bottom - 1)
                pipe.zrevrange(key, index, index, withscores=True)
                weights.append(bottom - top)
        found = sorted(
            (pairs[0][0] if member else int(pairs[0][1]), w)
            for pairs, w in zip(await pipe.execute(), weights, strict=True)
            if pairs
        )
        half, seen = sum(w for _, w in found) / 2, 0
        for value, weight in found:
            seen += weight
            if seen >= half:
                return value
        return found[-1][0]

    async def _band_page(self, offset: int, limit: int) -> list[Row]:
        """Band boards: band sizes place the page in one or two bands; read those by index."""
        sizes = await self.sizes()
        out: list[Row] = []
        start = offset
        for key, size in zip(self.keys, sizes, strict=True):
            if start >= size:
                start -= size
                continue
            need = limit - len(out)
            out.extend(await self._band_rows(key, start, need))
            start = 0
            if len(out) >= limit:
                break
        return unique(out)[:limit]

    async def _band_rows(self, key: str, start: int, count: int) -> list[Row]:
        """Up to ``count`` rows of one band from index ``start``: one ZREVRANGE, on a replica where
        reads go to replicas (a round of its own: whether the next band is needed depends on it)."""
        pipe = batch(self.client, replicas=self.replicas, shared=True)
        pipe.zrevrange(key, start, start + count - 1, withscores=True)
        [pairs] = await pipe.execute()
        return rows(pairs)


def _score(value: float) -> str:
    return str(int(value))


def _less_own(total: int, floor: int, row: Row, owns: Sequence[float | None]) -> int:
    """``total``, the rows scoring at least ``floor``, less those of the player of ``row`` among
    them (``owns``: their scores in the keys asked, None where absent) when ``floor`` is above the
    row: there the count is of rows ahead of the player, and a row of theirs above the home row is
    a stale one (a pending move), never ahead of them. A floor at or below the row counts every
    row, as the board's size does."""
    if floor <= row[0]:
        return total
    return total - sum(1 for own in owns if own is not None and own >= floor)


def _pack(flat: list[str]) -> bytes:
    """A script's one argument for many values: counts.lua's flat (score, member, ...) list or
    places.lua's ids, as MessagePack (one argument to encode instead of one per value: redis-py
    encodes arguments one by one, in Python)."""
    return bytes(msgpack.packb(flat))
