"""Cross-shard reads over one period's sorted sets: top, rank counts, neighbours, pages at any depth.

Every function here reads several shards with per-node pipelines that redis-py sends concurrently,
then reassembles locally. None of it is atomic across shards: under concurrent writes an answer can
be off by the writes in flight, and is exact once writes are quiescent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from shardlb.merge import Row, merge, rows, unique

# A page whose start lies in the first SHALLOW rows is read as top(offset + limit): cheaper than bisecting.
SHALLOW = 1000
MAX_BISECT_ROUNDS = 120


@dataclass
class View:
    """The sorted sets one read merges: one key per shard (band boards: band keys, best band first)."""

    client: RedisCluster
    keys: list[str]
    ties: AsyncScript
    banded: bool = False
    shallow: int = SHALLOW

    async def _each(self, command: str, *args: Any, **kwargs: Any) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            getattr(pipe, command)(key, *args, **kwargs)
        return list(await pipe.execute())

    async def sizes(self) -> list[int]:
        return [int(n) for n in await self._each("zcard")]

    async def top(self, n: int) -> list[Row]:
        """The best ``n`` rows: each shard's top n, k-way merged (band boards: best band down)."""
        if n <= 0:
            return []
        if self.banded:
            out: list[Row] = []
            for key in self.keys:
                out = unique([*out, *rows(await self.client.zrevrange(key, 0, n - 1, withscores=True))])
                if len(out) >= n:
                    break
            return out[:n]
        lists = await self._each("zrevrange", 0, n - 1, withscores=True)
        return merge(rows(pairs) for pairs in lists)[:n]

    async def counts_ahead(self, row: Row) -> list[int]:
        """Per shard, how many rows rank ahead of ``row``: ZCOUNT of better scores plus the tie rule."""
        return (await self.counts_ahead_many([row]))[0]

    async def counts_ahead_many(self, targets: Sequence[Row]) -> list[list[int]]:
        """``counts_ahead`` for many rows with one pipeline (ties resolved by script where present)."""
        pipe = self.client.pipeline(transaction=False)
        for score, _ in targets:
            text = _score(score)
            for key in self.keys:
                pipe.zcount(key, f"({text}", "+inf")
                pipe.zcount(key, text, text)
        replies = [int(x) for x in await pipe.execute()] if targets else []
        width = 2 * len(self.keys)
        out = []
        tied: list[tuple[int, int]] = []
        for t in range(len(targets)):
            part = replies[t * width : (t + 1) * width]
            out.append(part[0::2])
            tied += [(t, i) for i, n in enumerate(part[1::2]) if n]
        extra = await asyncio.gather(
            *(self.ties(keys=[self.keys[i]], args=[_score(targets[t][0]), targets[t][1]]) for t, i in tied)
        )
        for (t, i), n in zip(tied, extra, strict=True):
            out[t][i] += int(n)
        return out

    async def around(self, row: Row, counts: list[int], radius: int) -> tuple[list[Row], int]:
        """Up to ``radius`` rows above and below ``row``; returns the rows and the index of ``row``."""
        pipe = self.client.pipeline(transaction=False)
        for key, ahead in zip(self.keys, counts, strict=True):
            pipe.zrevrange(key, max(0, ahead - radius), ahead + radius, withscores=True)
        merged = [r for r in unique(merge(rows(pairs) for pairs in await pipe.execute())) if r[1] != row[1]]
        at = sum(1 for r in merged if r > row)
        return [*merged[max(0, at - radius) : at], row, *merged[at : at + radius]], min(at, radius)

    async def page(self, offset: int, limit: int) -> list[Row]:
        """Rows ``offset`` .. ``offset + limit - 1`` of the merged order, at any depth.

        Bisects on the score to find a cut ``v`` with G(v) = rows strictly above v just at or below
        ``offset`` (per-shard ZCOUNT sums), then reads a bounded window below v from each shard.
        """
        if offset + limit <= self.shallow:
            return (await self.top(offset + limit))[offset:]
        if self.banded:
            return await self._band_page(offset, limit)
        cut, above = await self._cut(offset, limit)
        skip = offset - above
        lists = await self._each("zrevrangebyscore", _score(cut), "-inf", 0, skip + limit, True)
        return merge(rows(pairs) for pairs in lists)[skip : skip + limit]

    async def _above(self, value: int) -> int:
        return sum(int(n) for n in await self._each("zcount", f"({value}", "+inf"))

    async def _cut(self, offset: int, limit: int) -> tuple[int, int]:
        """A score ``hi`` with offset - limit <= G(hi) <= offset, or the tie block holding ``offset``."""
        firsts = await self._each("zrevrange", 0, 0, withscores=True)
        lasts = await self._each("zrange", 0, 0, withscores=True)
        hi = max(int(p[0][1]) for p in firsts if p)
        lo = min(int(p[0][1]) for p in lasts if p) - 1
        g_hi, g_lo = await self._above(hi), sum(await self.sizes())
        for step in range(MAX_BISECT_ROUNDS):
            if hi - lo <= 1 or offset - g_hi <= limit:
                break
            target = offset - limit // 2
            if step % 2 == 0 and g_lo > g_hi:
                # Interpolate on the counts; alternate with plain halving so the worst case stays log2.
                guess = lo + int((hi - lo) * (g_lo - target) / (g_lo - g_hi))
            else:
                guess = (lo + hi) // 2
            mid = min(max(guess, lo + 1), hi - 1)
            g_mid = await self._above(mid)
            if g_mid <= offset:
                hi, g_hi = mid, g_mid
            else:
                lo, g_lo = mid, g_mid
        return hi, g_hi

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
            out.extend(rows(await self.client.zrevrange(key, start, start + need - 1, withscores=True)))
            start = 0
            if len(out) >= limit:
                break
        return unique(out)[:limit]


def _score(value: float) -> str:
    return str(int(value))


async def _gather(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*calls))
