"""`make bench-archive`: the PostgreSQL disk an archived result takes (`shardlb plan`'s
bytes_per_archived_result).

    SHARDLB_ARCHIVE_RESULTS=1000000 python -m bench.archive_size

On a PostgreSQL of its own (or a database it creates and drops on SHARDLB_POSTGRES_URL's server), it
sets up the schema of the archiver and of settlement (whose index ``match_results_by_player`` is on
the same table), archives SHARDLB_ARCHIVE_RESULTS results through the archiver's own upsert
(``Archiver._write``, in batches of 5,000 as a busy round writes them): matches of 10 players, UUID
match ids, player ids among 10M, 10 shards, then again with short match ids. It prints
``pg_total_relation_size`` of ``match_results`` (heap, TOAST and every index) over its rows, and each
index's part. bench/README.md keeps the figures.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from shardlb import settlement
from shardlb.archive import Archiver, connect_db
from shardlb.postgres import LocalPostgres

BATCH = 5000
PLAYERS_PER_MATCH = 10
MATCH_IDS: dict[str, Callable[[random.Random], str]] = {
    "uuid": lambda rng: str(uuid.UUID(int=rng.getrandbits(128))),
    "short": lambda rng: f"m{rng.randrange(10**9)}",
}


def _rows(rng: random.Random, inc: str, n: int, match_id: Callable[[random.Random], str]) -> list[Any]:
    """``n`` rows as ``archive._rows`` makes them (led by the board's mode), journal ids rising."""
    out: list[Any] = []
    ms = 1_764_979_200_000
    while len(out) < n:
        ms += rng.randrange(0, 3)
        match = match_id(rng)
        for seq in range(PLAYERS_PER_MATCH):
            points, at, player = rng.randrange(1_000_000), ms - rng.randrange(60_000), rng.randrange(10**7)
            score = points * 2**31 + at // 1000 % 2**31
            out.append(("best", "global", inc, match, str(player), points, at, score, seq, f"{ms}-{seq}", []))
    return out[:n]


async def measure(url: str, results: int, match_ids: str = "uuid") -> dict[str, float]:
    """Bytes a row of ``match_results`` takes after archiving ``results`` results into a database of
    its own on ``url``'s server (dropped after): ``total`` and each relation's part."""
    name = f"archive_size_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        await admin.execute(f"CREATE DATABASE {name}")
    try:
        db = await connect_db(url.rsplit("/", 1)[0] + f"/{name}")
        try:
            await settlement.ensure_schema(db)
            # Only _write is used, which needs the connection alone: the same statements as a round.
            archiver = Archiver(None, None, db, "bench")  # type: ignore[arg-type]
            rows = _rows(random.Random(1), secrets.token_hex(4), results, MATCH_IDS[match_ids])
            for i in range(0, len(rows), BATCH):
                await archiver._write(rows[i : i + BATCH])
            cur = await db.execute(
                "SELECT count(*), pg_total_relation_size('match_results'), pg_relation_size('match_results') "
                "FROM match_results"
            )
            count, total, heap = await cur.fetchone() or (0, 0, 0)
            cur = await db.execute(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
                "WHERE indrelid = 'match_results'::regclass ORDER BY 1"
            )
            out = {"rows": float(count), "total": total / count, "heap": heap / count}
            out.update({index: size / count for index, size in await cur.fetchall()})
            return out
        finally:
            await db.close()
    finally:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def main() -> None:
    results = int(os.environ.get("SHARDLB_ARCHIVE_RESULTS", "1000000"))
    with tempfile.TemporaryDirectory(prefix="bench-archive-") as tmp:
        pg = None
        url = os.environ.get("SHARDLB_POSTGRES_URL")
        if not url:
            pg = LocalPostgres(Path(tmp) / "pg", fast=True)
            url = pg.up()
        try:
            for kind in MATCH_IDS:
                found = await measure(url, results, kind)
                parts = ", ".join(f"{k} {v:.1f}" for k, v in found.items() if k not in ("rows", "total"))
                print(
                    f"{kind} match ids: {found['rows']:,.0f} results, {found['total']:.1f} bytes per "
                    f"archived result ({parts})"
                )
        finally:
            if pg:
                pg.destroy()


if __name__ == "__main__":
    asyncio.run(main())
