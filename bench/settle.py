"""`make bench-settle`: settle a daily board of SHARDLB_SETTLE_PLAYERS players, each step timed.

    SHARDLB_SETTLE_PLAYERS=1000000 python -m bench.settle

On a cluster and a PostgreSQL of its own (or SHARDLB_REDIS_URL / SHARDLB_POSTGRES_URL when set), it
creates a `best` board of SHARDLB_SETTLE_SHARDS hash shards keeping daily periods, COPYs one archived
result per player into ``match_results`` (as the archiver writes them) inside the day before
yesterday, rebuilds the Redis board from there, and settles that day (1 gold, ranks 2-10 silver, top
1% bronze), printing the seconds each step took (shardlb/settlement.py, STEPS). Then, with
SHARDLB_SETTLE_KILLS=1 (the default), it settles the day before that as `shardlb settle` processes
killed by SIGKILL after each step in turn, runs it once more, and checks one award per winner.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench.services import up_together
from shardlb.archive import connect_db
from shardlb.board import Board
from shardlb.cluster import LocalCluster, free_port_block
from shardlb.config import BoardConfig
from shardlb.postgres import LocalPostgres
from shardlb.rebuild import connected
from shardlb.settlement import STEPS, Request, Settler, ensure_schema, period_bounds

BOARD = "bench-settle"
TABLE = [
    {"rank": 1, "reward": "gold"},
    {"ranks": [2, 10], "reward": "silver"},
    {"top_percent": 1, "reward": "bronze"},
]


def day(days_ago: int) -> str:
    return "daily:" + (datetime.now(UTC).date() - timedelta(days=days_ago)).isoformat()


async def load(board: Board, db: psycopg.AsyncConnection[Any], players: int, period: str, tag: str) -> None:
    """One result per player inside ``period``; points repeat, so ties are many."""
    codec, layout = board.codec, board.layout
    start, end = period_bounds(board, board.resolve(period).period)
    span = (end - start) // 1000
    async with db.transaction(), db.cursor() as cur:
        columns = "board, incarnation, match_id, player_id, points, achieved_ms, score, shard, journal_id"
        async with cur.copy(f"COPY match_results ({columns}) FROM STDIN") as copy:
            for i in range(players):
                player = f"player-{i:08d}"
                points = (i * 7919) % 100_000
                at = start + (i * 104_729 % span) * 1000
                await copy.write_row(
                    (BOARD, board.incarnation, f"{tag}{i}", player, points, at, codec.encode(points, at),
                     layout.home(player), "1-0")
                )  # fmt: skip


async def timed_settle(settler: Settler, board: Board, period: str) -> dict[str, Any]:
    marks: list[tuple[str, float]] = []
    settler.step = lambda name: marks.append((name, time.perf_counter()))
    start = time.perf_counter()
    result = await settler.settle(
        board, period, Request.of({"settlement_id": f"bench-{period}", "rewards": TABLE})
    )
    before = start
    for name, at in marks:
        print(f"  {name:<9} {at - before:8.2f}s")
        before = at
    print(f"  {'total':<9} {time.perf_counter() - start:8.2f}s")
    again = time.perf_counter()
    assert (
        await settler.settle(
            board, period, Request.of({"settlement_id": f"bench-{period}", "rewards": TABLE})
        )
        == result
    )
    print(f"  the same id again: {time.perf_counter() - again:.2f}s (the stored result, nothing paid)")
    return result


def killed_runs(redis_url: str, postgres_url: str, period: str) -> None:
    argv = [sys.executable, "-m", "shardlb", "settle", BOARD, period, "--id", f"bench-kill-{period}"]
    argv += ["--rewards", orjson.dumps(TABLE).decode(), "--redis", redis_url, "--postgres", postgres_url]
    for step in STEPS:
        start = time.perf_counter()
        done = subprocess.run(
            argv, env={**os.environ, "SHARDLB_SETTLE_KILL_AFTER": step}, capture_output=True
        )
        if done.returncode != -signal.SIGKILL:
            raise SystemExit(
                f"the run to be killed after {step} ended with {done.returncode}: {done.stderr!r}"
            )
        print(f"  killed after {step:<9} ({time.perf_counter() - start:.1f}s)")
    done = subprocess.run(argv, capture_output=True, check=True)
    print(f"  run again: {orjson.loads(done.stdout)['awards']}")


async def count_awards(db: psycopg.AsyncConnection[Any], settlement_id: str) -> tuple[int, int]:
    cur = await db.execute(
        "SELECT count(*), count(DISTINCT player_id) FROM settlement_awards WHERE settlement_id = %s",
        (settlement_id,),
    )
    row = await cur.fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))


async def main() -> None:
    players = int(os.environ.get("SHARDLB_SETTLE_PLAYERS", "1000000"))
    shards = int(os.environ.get("SHARDLB_SETTLE_SHARDS", "16"))
    kills = os.environ.get("SHARDLB_SETTLE_KILLS", "1") == "1"
    with tempfile.TemporaryDirectory(prefix="bench-settle-") as tmp:
        cluster = pg = None
        redis_url = os.environ.get("SHARDLB_REDIS_URL")
        postgres_url = os.environ.get("SHARDLB_POSTGRES_URL")
        if not redis_url:
            cluster = LocalCluster(
                masters=3, replicas=0, port=free_port_block(3, start=23100), dir=Path(tmp) / "c"
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
            async with connected(redis_url, postgres_url) as (rebuilder, store):
                await ensure_schema(rebuilder.db)
                config = BoardConfig.from_dict(
                    BOARD,
                    {"periods": ["daily"], "retention_days": {"daily": 7}, "sharding": {"shards": shards}},
                )
                board, _ = await store.create(config)
                days = [day(2), day(3)] if kills else [day(2)]
                for n, period in enumerate(days):
                    start = time.perf_counter()
                    await load(board, rebuilder.db, players, period, f"d{n}-")
                    print(
                        f"{period}: {players} results COPYed into PostgreSQL "
                        f"in {time.perf_counter() - start:.1f}s"
                    )
                start = time.perf_counter()
                await rebuilder.rebuild(board)
                print(f"Redis board rebuilt from PostgreSQL in {time.perf_counter() - start:.1f}s")
                print(f"settle {days[0]} ({players} players, {shards} shards), seconds per step:")
                result = await timed_settle(Settler(rebuilder), board, days[0])
                print(f"  awards: {result['awards']}; check: {result['check']['players']}")
                if kills:
                    print(f"settle {days[1]} killed by SIGKILL after each step, then run again:")
                    killed_runs(redis_url, postgres_url, days[1])
                    total, distinct = await count_awards(rebuilder.db, f"bench-kill-{days[1]}")
                    print(f"  awards stored: {total}, players awarded: {distinct} (one award per winner)")
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(f"peak memory of the settling process: {peak:.0f} MiB")
                await store.delete(BOARD)
        finally:
            if pg:
                pg.destroy()
            if cluster:
                cluster.down()


if __name__ == "__main__":
    asyncio.run(main())
