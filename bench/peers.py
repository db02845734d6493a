"""The rivals, on the same players and the same workload as the sharded board.

- textbook: ONE unsharded sorted set and one tiny Lua call (ZADD GT) per write, the design most
  leaderboard tutorials show. Every read is one or two commands on that one key, so it all lands on
  one master (one core) however large the cluster.
- PostgreSQL: the same players in a table with a B-tree index on the packed score; top-100 is an
  index scan, "my rank" is ``COUNT(*) WHERE score > x`` (it reads every row ahead of the player).
  A write is one upsert per match (``ON CONFLICT ... WHERE old < new``, keep the best).
  ``synchronous_commit`` is off for the bench's sessions, to match a Redis without fsync.
Both use the board's own score codec, so all three hold exactly the same order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable
from typing import Any

from redis.asyncio.cluster import RedisCluster

from bench.latency import Phase, elapsed_ms, run_phase
from bench.raw import MatchPool, read_mix
from bench.workload import Workload
from shardlb.codec import ScoreCodec

TEXTBOOK_LUA = "return redis.call('ZADD', KEYS[1], 'GT', ARGV[1], ARGV[2])"


def textbook_key(board: str) -> str:
    return f"textbook:{{{board}}}"


def now_units(codec: ScoreCodec) -> int:
    return codec.time_units(int(time.time() * 1000))


async def textbook_writes(
    client: RedisCluster,
    board: str,
    codec: ScoreCodec,
    workload: Workload,
    seconds: float,
    concurrency: int = 64,
    seed: int = 3,
) -> Phase:
    """One EVALSHA per player-score, ``concurrency`` in flight."""
    script = client.register_script(TEXTBOOK_LUA)
    script.sha = await client.script_load(TEXTBOOK_LUA)
    key = textbook_key(board)
    pool = MatchPool(workload, seed)
    queue: list[tuple[str, int, bool]] = []

    async def step(phase: Phase, _: int) -> None:
        if not queue:
            for _ in range(50):
                scores, fresh = pool.draw(1)
                queue.extend((s.player_id, s.points, fresh > 0) for s in scores)
        player, points, new = queue.pop()
        score = codec.encode_units(points, now_units(codec))
        t0 = time.perf_counter()
        await script(keys=[key], args=[score, player])
        # A retry's call costs the set a ZADD and writes nothing new: sent, not written.
        phase.record("write", elapsed_ms(t0), 1 if new else 0)
        phase.replayed += 0 if new else 1

    return await run_phase(Phase("textbook writes"), seconds, concurrency, step)


async def textbook_read(
    client: RedisCluster, key: str, workload: Workload, rng: random.Random, kind: str
) -> None:
    if kind == "top":
        await client.zrevrange(key, 0, 99, withscores=True)
    elif kind in ("rank", "around"):
        player = workload.player(rng)
        pipe = client.pipeline(transaction=False)
        pipe.zrevrank(key, player)
        pipe.zscore(key, player)
        pipe.zcard(key)
        rank, _, _ = await pipe.execute()
        if kind == "around" and rank is not None:
            r = workload.around_radius
            await client.zrevrange(key, max(0, rank - r), rank + r, withscores=True)
    elif kind == "friends":
        pipe = client.pipeline(transaction=False)
        for player in workload.friends(rng):
            pipe.zrevrank(key, player)
            pipe.zscore(key, player)
        await pipe.execute()
    else:
        offset = workload.page_offset(rng)
        await client.zrevrange(key, offset, offset + workload.page_limit - 1, withscores=True)


async def textbook_reads(
    client: RedisCluster, board: str, workload: Workload, seconds: float, concurrency: int = 16, seed: int = 4
) -> Phase:
    key = textbook_key(board)

    def read(rng: random.Random, kind: str) -> Awaitable[None]:
        return textbook_read(client, key, workload, rng, kind)

    return await read_mix("textbook reads", workload, seconds, concurrency, seed, read)


# ---- PostgreSQL ---------------------------------------------------------------------------------


def pg_table(board: str) -> str:
    return "bench_" + "".join(c if c.isalnum() else "_" for c in board)


async def pg_connect(dsn: str) -> Any:
    import psycopg

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=3)
    await conn.execute("SET synchronous_commit = off")
    return conn


async def pg_load(dsn: str, board: str, codec: ScoreCodec, workload: Workload) -> int:
    """(Re)create the table and COPY the population in, then build the index (faster than before)."""
    table = pg_table(board)
    units = now_units(codec)
    conn = await pg_connect(dsn)
    try:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.execute(f"CREATE TABLE {table} (player_id text PRIMARY KEY, score bigint NOT NULL)")
        async with conn.cursor() as cur, cur.copy(f"COPY {table} (player_id, score) FROM STDIN") as copy:
            per_s = 1000 // codec.unit_ms
            for i in range(workload.players):
                age = workload.initial_age_s(i) * per_s
                await copy.write_row((f"p{i}", codec.encode_units(workload.initial_points(i), units - age)))
        await conn.execute(f"CREATE INDEX {table}_score ON {table} (score DESC, player_id DESC)")
        await conn.execute(f"ANALYZE {table}")
    finally:
        await conn.close()
    return workload.players


async def pg_writes(
    dsn: str,
    board: str,
    codec: ScoreCodec,
    workload: Workload,
    seconds: float,
    concurrency: int = 16,
    seed: int = 5,
) -> Phase:
    """One upsert statement per match (its players sorted, so concurrent upserts cannot deadlock)."""
    table = pg_table(board)
    sql = (
        f"INSERT INTO {table} AS t (player_id, score) SELECT * FROM unnest(%s::text[], %s::bigint[]) "
        "ON CONFLICT (player_id) DO UPDATE SET score = EXCLUDED.score WHERE t.score < EXCLUDED.score"
    )
    pool = MatchPool(workload, seed)
    conns = [await pg_connect(dsn) for _ in range(concurrency)]

    async def step(phase: Phase, n: int) -> None:
        drawn, fresh = pool.draw(1)
        scores = sorted(drawn, key=lambda s: s.player_id)
        units = now_units(codec)
        ids = [s.player_id for s in scores]
        values = [codec.encode_units(s.points, units) for s in scores]
        t0 = time.perf_counter()
        await conns[n].execute(sql, (ids, values))
        phase.record("write match", elapsed_ms(t0), fresh)  # a retried match writes nothing new
        phase.replayed += len(scores) - fresh

    try:
        return await run_phase(Phase("postgres writes"), seconds, concurrency, step)
    finally:
        for conn in conns:
            await conn.close()


async def pg_reads(
    dsn: str, board: str, workload: Workload, seconds: float, concurrency: int = 8, seed: int = 6
) -> Phase:
    """Top-100 and "my rank" (COUNT(*) of better scores), in the same proportion as the read mix."""
    table = pg_table(board)
    rng = random.Random(seed)
    conns = [await pg_connect(dsn) for _ in range(concurrency)]
    mix = {k: v for k, v in workload.read_mix.items() if k in ("top", "rank")} or {"top": 1, "rank": 1}
    weights = list(mix.values())

    async def step(phase: Phase, n: int) -> None:
        kind = rng.choices(list(mix), weights=weights)[0]
        t0 = time.perf_counter()
        if kind == "top":
            await (
                await conns[n].execute(
                    f"SELECT player_id, score FROM {table} ORDER BY score DESC, player_id DESC LIMIT 100"
                )
            ).fetchall()
        else:
            await (
                await conns[n].execute(
                    f"SELECT 1 + (SELECT count(*) FROM {table} WHERE score > me.score) FROM {table} me "
                    "WHERE player_id = %s",
                    (workload.player(rng),),
                )
            ).fetchall()
        phase.record(kind, elapsed_ms(t0))

    try:
        return await run_phase(Phase("postgres reads"), seconds, concurrency, step)
    finally:
        for conn in conns:
            await conn.close()


async def pg_available(dsn: str) -> str | None:
    """None when PostgreSQL answers at ``dsn``, else why not (the summary prints it)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[bench]')"
    try:
        conn = await pg_connect(dsn)
        await conn.close()
    except Exception as e:
        return f"PostgreSQL not reachable at {dsn!r}: {type(e).__name__}: {e}"
    return None
