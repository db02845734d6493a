"""The reader process of bench/rank_cost.py: one kind of the read mix, by the library or the textbook way.

    python bench/rank_reader.py library URL BOARD PLAYERS READS READERS SEED [READ]
    python bench/rank_reader.py textbook URL KEY PLAYERS READS READERS SEED [READ]

``READ`` is the kind of read (``READS``, default ``rank``): ``rank`` ("my rank", ``Board.player``;
the textbook's ZSCORE, ZREVRANK and ZCARD in one pipeline), ``around`` (``Board.around``, radius
``RADIUS``; the textbook's ZREVRANK, then ZREVRANGE around it), ``friends`` (``Board.query`` of
``FRIENDS`` ids drawn uniformly; the textbook's ZMSCORE and a ZREVRANK per id in one pipeline),
``page`` (``Board.entries`` of ``PAGE`` rows from an offset drawn as the bench's workload draws it,
shallow pages more often; the textbook's ZREVRANGE) and ``top`` (``Board.top(100)``, uncached; the
textbook's ZREVRANGE 0 99). The sizes are the bench's defaults (bench/workload.py).

Run by its path, with the checkout whose library is measured first on PYTHONPATH: it imports
nothing of bench/ and only the library's public names (``connect``, ``Scripts``, ``BoardStore``,
``Board.player``, ``around``, ``query``, ``entries``, ``top``), so another revision's library runs
it as it is. It makes its connections and ``WARMUP`` reads, prints "ready", waits for a line on
stdin, then makes ``READS`` reads of random players (``p<i>``, i below PLAYERS, drawn from SEED),
``READERS`` at a time as a router's concurrent requests are, and prints "done <seconds>". What it
sends before "ready" is left out of the window its parent measures.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from shardlb import BoardStore, Scripts, compat, connect
from shardlb.connection import slot_of

WARMUP = 200
READS = ("rank", "around", "friends", "page", "top")
RADIUS = 5  # SHARDLB_AROUND_RADIUS
FRIENDS = (20, 200)  # SHARDLB_FRIENDS
PAGE = 50  # SHARDLB_PAGE_LIMIT


def _asks(kind: str, players: int, count: int, rng: random.Random) -> list[Any]:
    """What each read asks for: a player id, a friends list, a page's offset."""
    if kind == "friends":
        return [
            [f"p{i}" for i in rng.sample(range(players), min(rng.randint(*FRIENDS), players))]
            for _ in range(count)
        ]
    if kind == "page":
        return [int(max(0, players - PAGE) * rng.random() ** 3) for _ in range(count)]
    return [f"p{rng.randrange(players)}" for _ in range(count)]


async def _run(read: Callable[[Any], Awaitable[object]], players: list[Any], readers: int) -> float:
    queue = iter(players)

    async def reader() -> None:
        for player in queue:
            await read(player)

    t0 = time.perf_counter()
    await asyncio.gather(*(reader() for _ in range(readers)))
    return time.perf_counter() - t0


async def main(
    kind: str, url: str, name: str, players: int, reads: int, readers: int, seed: int, what: str = "rank"
) -> None:
    compat.mend_wait_for()
    rng = random.Random(seed)
    ids = _asks(what, players, WARMUP + reads, rng)
    cluster = connect(url)
    close: list[Callable[[], Awaitable[None]]] = [cluster.aclose]
    if kind == "library":
        scripts = Scripts.register(cluster)
        await scripts.load(cluster)
        board = await BoardStore(cluster, scripts).get(name)

        async def read(ask: Any) -> object:
            if what == "around":
                return await board.around(ask, RADIUS)
            if what == "friends":
                return await board.query(ask)
            if what == "page":
                return await board.entries(ask, PAGE)
            if what == "top":
                return await board.top(100)
            return await board.player(ask)

    else:  # the textbook: one pipeline to the one master of the one set (bench/textbook_service.py)
        await cluster.initialize()
        node = cluster.nodes_manager.get_node_from_slot(slot_of(name))
        client = aioredis.Redis(host=node.host, port=node.port, decode_responses=True, max_connections=64)
        close.append(client.aclose)

        async def read(ask: Any) -> object:
            if what == "around":
                at = int(await client.zrevrank(name, ask) or 0)
                return await client.zrevrange(name, max(0, at - RADIUS), at + RADIUS, withscores=True)
            if what == "page":
                return await client.zrevrange(name, ask, ask + PAGE - 1, withscores=True)
            if what == "top":
                return await client.zrevrange(name, 0, 99, withscores=True)
            pipe = client.pipeline(transaction=False)
            if what == "friends":
                pipe.zmscore(name, ask)
                for player in ask:
                    pipe.zrevrank(name, player)
            else:
                pipe.zscore(name, ask)
                pipe.zrevrank(name, ask)
                pipe.zcard(name)
            return await pipe.execute()

    await _run(read, ids[:WARMUP], readers)
    print("ready", flush=True)
    sys.stdin.readline()
    seconds = await _run(read, ids[WARMUP:], readers)
    print(f"done {seconds:.3f}", flush=True)
    for aclose in close:
        await aclose()


if __name__ == "__main__":
    kind, url, name, *numbers = sys.argv[1:8]
    what = sys.argv[8] if len(sys.argv) > 8 else "rank"
    if what not in READS:
        sys.exit(f"unknown read {what!r}: one of {', '.join(READS)}")
    players, reads, readers, seed = (int(n) for n in numbers)
    asyncio.run(main(kind, url, name, players, reads, readers, seed, what))
