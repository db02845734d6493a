"""`make bench-rebuild`: how long a board of SHARDLB_REBUILD_PLAYERS players takes to rebuild.

    SHARDLB_REBUILD_PLAYERS=1000000 python -m bench.rebuild

On a cluster and a PostgreSQL of its own (or SHARDLB_REDIS_URL / SHARDLB_POSTGRES_URL when set), it
creates a `best` board of SHARDLB_REBUILD_SHARDS hash shards with the total and daily periods,
COPYs one archived result per player into ``match_results`` (as the archiver would have written
them, spread over the last two days), and times ``Rebuilder.rebuild`` of the whole board from an
empty Redis, then again over the board it just built (the swap replacing live keys). It prints the
seconds, the rows per second and this process's peak memory; bench/README.md keeps the figures.
"""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.services import up_together
from shardlb import keys, times
from shardlb.archive import connect_db
from shardlb.board import Board
from shardlb.cluster import LocalCluster, free_port_block
from shardlb.config import BoardConfig
from shardlb.postgres import LocalPostgres
from shardlb.rebuild import connected

BOARD = "bench-rebuild"


async def load(board: Board, db: psycopg.AsyncConnection[Any], players: int) -> None:
    codec, layout = board.codec, board.layout
    now = times.now_ms()
    async with db.transaction(), db.cursor() as cur:
        await cur.execute("DELETE FROM match_results WHERE board = %s", (BOARD,))
        columns = "board, incarnation, match_id, player_id, points, achieved_ms, score, shard, journal_id"
        async with cur.copy(f"COPY match_results ({columns}) FROM STDIN") as copy:
            for i in range(players):
                player = f"player-{i:08d}"
                points = (i * 7919) % 2_000_000
                at = now - (i % 172_800) * 1000
                score = codec.encode(points, at)
                await copy.write_row(
                    (BOARD, board.incarnation, f"m{i}", player, points, at, score, layout.home(player), "1-0")
                )


async def main() -> None:
    players = int(os.environ.get("SHARDLB_REBUILD_PLAYERS", "1000000"))
    shards = int(os.environ.get("SHARDLB_REBUILD_SHARDS", "16"))
    with tempfile.TemporaryDirectory(prefix="bench-rebuild-") as tmp:
        cluster = pg = None
        redis_url = os.environ.get("SHARDLB_REDIS_URL")
        postgres_url = os.environ.get("SHARDLB_POSTGRES_URL")
        if not redis_url:
            cluster = LocalCluster(
                masters=3, replicas=0, port=free_port_block(3, start=23000), dir=Path(tmp) / "c"
            )
        if not postgres_url:
            pg = LocalPostgres(Path(tmp) / "pg", fast=True)
        try:
            up_together(cluster, pg)  # at once: each mostly waits
            if cluster:
                redis_url = cluster.url
            if pg:
                postgres_url = pg.url
            schema = await connect_db(postgres_url)  # the archive's tables, as the archiver makes them
            await schema.close()
            async with connected(redis_url, postgres_url, print) as (rebuilder, store):
                config = BoardConfig.from_dict(
                    BOARD,
                    {"periods": ["daily"], "sharding": {"strategy": "hash", "shards": shards}},
                )
                board, _ = await store.create(config)
                start = time.perf_counter()
                await load(board, rebuilder.db, players)
                print(f"loaded {players} rows into PostgreSQL in {time.perf_counter() - start:.1f}s")
                for label in ("from an empty Redis", "over the live board"):
                    start = time.perf_counter()
                    reports = await rebuilder.rebuild(board)
                    seconds = time.perf_counter() - start
                    rows = sum(r.rows for r in reports)
                    size = sum(
                        [await rebuilder.client.zcard(keys.period_key(p, "total")) for p in board.prefixes]
                    )
                    print(
                        f"rebuild {label}: {rows} rows, {size} players in {seconds:.1f}s "
                        f"({rows / seconds:,.0f} rows/s)"
                    )
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(f"peak memory of the rebuilding process: {peak:.0f} MiB")
                await store.delete(BOARD)
        finally:
            if pg:
                pg.destroy()
            if cluster:
                cluster.down()


if __name__ == "__main__":
    asyncio.run(main())
