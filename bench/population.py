"""Preloading one population of players into every store the bench compares.

The sharded board is loaded with ZADD of many members per call straight onto its shard keys, built
with the library's own key scheme (``Board.prefixes`` from ``keys.shard_prefix``), placement
(``Layout.home``) and score codec, and each key is listed in its shard's key index the way the write
script lists it, so the board reads, writes and deletes exactly as if every score had come through
``Board.submit`` at load time. That is the same state at a small fraction of the cost: a bulk load
is not what this bench measures.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from redis.asyncio.cluster import RedisCluster

from bench.workload import Workload
from shardlb import keys, periods
from shardlb.board import Board
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore

CHUNK = 2000
PIPELINE_CHUNKS = 16


def _initial_score(board: Board, workload: Workload, index: int, now_units: int) -> int:
    age = workload.initial_age_s(index) * 1000 // board.codec.unit_ms
    return board.codec.encode_units(workload.initial_points(index), now_units - age)


def chunks(count: int, size: int = CHUNK) -> Iterator[range]:
    for start in range(0, count, size):
        yield range(start, min(count, start + size))


async def load_board(
    board: Board, workload: Workload, start: int = 0, stop: int | None = None, now_ms: int | None = None
) -> int:
    """Give players ``start`` .. ``stop - 1`` their initial points on every period of ``board``.

    Returns how many players were written. Pipelined: many ZADDs of CHUNK members per round trip.
    """
    stop = workload.players if stop is None else stop
    now = int(time.time() * 1000) if now_ms is None else now_ms
    units = board.codec.time_units(now)
    names = periods.names_at(now, board.config.periods, board.tz, board.config.week_start)
    layout = board.layout
    banded = layout.strategy == "band"
    touched: set[int] = set()
    pending: list[tuple[int, dict[str, int]]] = []
    for block in chunks(stop - start, CHUNK * PIPELINE_CHUNKS):
        by_shard: dict[int, dict[str, int]] = defaultdict(dict)
        by_band: dict[int, dict[str, int]] = defaultdict(dict)
        for i in block:
            player = f"p{start + i}"
            score = _initial_score(board, workload, start + i, units)
            by_shard[layout.home(player)][player] = score
            if banded:
                by_band[layout.band_shard(workload.initial_points(start + i))][player] = score
        for shard, members in by_shard.items():
            touched.add(shard)
            pending.append((shard, members))
        await _flush(board, names, pending)
        if banded:
            touched.update(by_band)
            await _flush_bands(board, by_shard, by_band)
        pending = []
    await _index(board, names, touched)
    return stop - start


async def _flush_bands(
    board: Board, by_shard: dict[int, dict[str, int]], by_band: dict[int, dict[str, int]]
) -> None:
    """A band board: each player's total row on their band shard, and version 1 of it on both their
    home shard and that band shard, as write.lua's first change of a total and band.lua leave them."""
    pipe = board.client.pipeline(transaction=False)
    for shard, members in by_shard.items():
        items = list(members)
        for part in chunks(len(items)):
            pipe.hset(
                keys.version_key(board.prefixes[shard]),
                mapping=dict.fromkeys(items[part.start : part.stop], 1),
            )
    for shard, members in by_band.items():
        items = list(members.items())
        prefix = board.prefixes[shard]
        for part in chunks(len(items)):
            mapping = dict(items[part.start : part.stop])
            pipe.zadd(keys.period_key(prefix, "total"), mapping)
            pipe.hset(keys.version_key(prefix), mapping=dict.fromkeys(mapping, 1))
    await pipe.execute()


async def _flush(board: Board, names: list[str], pending: list[tuple[int, dict[str, int]]]) -> None:
    pipe = board.client.pipeline(transaction=False)
    for shard, members in pending:
        items = list(members.items())
        for part in chunks(len(items)):
            mapping = dict(items[part.start : part.stop])
            for name in names:
                pipe.zadd(keys.period_key(board.prefixes[shard], name), mapping, gt=True)
    await pipe.execute()


async def _index(board: Board, names: list[str], shards: set[int]) -> None:
    """List the loaded keys in their shards' key indexes, with the expiry the write script would set."""
    pipe = board.client.pipeline(transaction=False)
    bands = board.config.sharding.shards if board.layout.strategy == "band" else None
    for shard in shards:
        prefix = board.prefixes[shard]
        if bands is not None:  # the version hash of every shard; a band shard has only the total,
            pipe.zadd(keys.index_key(prefix), {keys.version_key(prefix): float("inf")})
            if shard >= bands:
                pipe.zadd(keys.index_key(prefix), {keys.period_key(prefix, "total"): float("inf")})
                continue
            pipe.zadd(keys.index_key(prefix), {keys.pending_key(prefix): float("inf")})  # a home its moves
        for name in names:
            key = keys.period_key(prefix, name)
            expire_at = board._expiry(name)
            if expire_at:
                pipe.pexpireat(key, expire_at)
            pipe.zadd(keys.index_key(prefix), {key: expire_at or float("inf")})
    await pipe.execute()


async def load_textbook(
    client: RedisCluster,
    key: str,
    board: Board,
    workload: Workload,
    start: int = 0,
    stop: int | None = None,
    now_ms: int | None = None,
) -> int:
    """The same players and scores (same codec, so the same order) in ONE sorted set ``key``."""
    stop = workload.players if stop is None else stop
    now = int(time.time() * 1000) if now_ms is None else now_ms
    units = board.codec.time_units(now)
    for block in chunks(stop - start, CHUNK * PIPELINE_CHUNKS):
        pipe = client.pipeline(transaction=False)
        for part in chunks(len(block)):
            first = start + block.start
            pipe.zadd(key, {f"p{first + i}": _initial_score(board, workload, first + i, units) for i in part})
        await pipe.execute()
    return stop - start


async def _load(url: str, workload: Workload, start: int, stop: int, textbook_key: str | None) -> int:
    client = connect(url)
    try:
        board = await BoardStore(client, Scripts.register(client)).get(workload.board)
        if textbook_key:
            return await load_textbook(client, textbook_key, board, workload, start, stop)
        return await load_board(board, workload, start, stop)
    finally:
        await client.aclose()


def load_range(url: str, workload: Workload, start: int, stop: int, textbook_key: str | None = None) -> int:
    """Entry point of one loader process."""
    return asyncio.run(_load(url, workload, start, stop, textbook_key))


def load_parallel(
    url: str, workload: Workload, start: int, stop: int, processes: int, textbook_key: str | None = None
) -> float:
    """Load players start..stop-1 into the board (or the textbook set) split over ``processes``
    fresh processes; returns the seconds taken. One Python process is the bottleneck of a load."""
    t0 = time.perf_counter()
    bounds = [start + (stop - start) * i // processes for i in range(processes + 1)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        jobs = [
            pool.submit(load_range, url, workload, a, b, textbook_key) for a, b in itertools.pairwise(bounds)
        ]
        for job in jobs:
            job.result()
    return time.perf_counter() - t0
