"""The reader process of bench/rank_cost.py: exact "my rank" reads, by the library or the textbook way.

    python bench/rank_reader.py library URL BOARD PLAYERS READS READERS SEED
    python bench/rank_reader.py textbook URL KEY PLAYERS READS READERS SEED

Run by its path, with the checkout whose library is measured first on PYTHONPATH: it imports
nothing of bench/ and only the library's public names (``connect``, ``Scripts``, ``BoardStore``,
``Board.player``), so another revision's library runs it as it is. It makes its connections and
``WARMUP`` reads, prints "ready", waits for a line on stdin, then reads ``READS`` random players
(``p<i>``, i below PLAYERS, drawn from SEED), ``READERS`` at a time as a router's concurrent
requests are, and prints "done <seconds>". What it sends before "ready" is left out of the window
its parent measures.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from shardlb import BoardStore, Scripts, compat, connect
from shardlb.connection import slot_of

WARMUP = 200


async def _run(read: Callable[[str], Awaitable[object]], players: list[str], readers: int) -> float:
    queue = iter(players)

    async def reader() -> None:
        for player in queue:
            await read(player)

    t0 = time.perf_counter()
    await asyncio.gather(*(reader() for _ in range(readers)))
    return time.perf_counter() - t0


async def main(kind: str, url: str, name: str, players: int, reads: int, readers: int, seed: int) -> None:
    compat.mend_wait_for()
    rng = random.Random(seed)
    ids = [f"p{rng.randrange(players)}" for _ in range(WARMUP + reads)]
    cluster = connect(url)
    close: list[Callable[[], Awaitable[None]]] = [cluster.aclose]
    if kind == "library":
        scripts = Scripts.register(cluster)
        await scripts.load(cluster)
        board = await BoardStore(cluster, scripts).get(name)

        async def read(player: str) -> object:
            return await board.player(player)

    else:  # the textbook: one pipeline to the one master of the one set (bench/textbook_service.py)
        await cluster.initialize()
        node = cluster.nodes_manager.get_node_from_slot(slot_of(name))
        client = aioredis.Redis(host=node.host, port=node.port, decode_responses=True, max_connections=64)
        close.append(client.aclose)

        async def read(player: str) -> object:
            pipe = client.pipeline(transaction=False)
            pipe.zscore(name, player)
            pipe.zrevrank(name, player)
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
    kind, url, name, *numbers = sys.argv[1:]
    players, reads, readers, seed = (int(n) for n in numbers)
    asyncio.run(main(kind, url, name, players, reads, readers, seed))
