"""The bench's drivers on the session cluster, on a tiny population: they load, write and read what
they claim, and every store agrees on the same order (sharded board, textbook set, PostgreSQL)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import peers, population, raw
from bench.workload import Workload
from shardlb.board import Board
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

# Small friend lists: the board's friends query makes one call per tied shard, all at once.
W = Workload(board="bench-t", players=300, friends_min=3, friends_max=8, page_limit=10)


@pytest.fixture(scope="module")
async def board(store: BoardStore) -> Board:
    config = BoardConfig.from_dict(W.board, {"sharding": {"strategy": "hash", "shards": 4}})
    made, _ = await store.create(config)
    assert await population.load_board(made, W) == W.players
    await population.load_textbook(made.client, peers.textbook_key(W.board), made, W)
    return made


async def test_preload_gives_every_player_its_initial_points(board: Board) -> None:
    assert await board.size() == W.players
    top = await board.top(W.players)
    assert [e.rank for e in top] == list(range(1, W.players + 1))
    assert {e.player_id: e.points for e in top} == {f"p{i}": W.initial_points(i) for i in range(W.players)}
    # A reloaded player keeps its score (ZADD GT), and the key index lists the loaded key.
    await population.load_board(board, W, 0, 10)
    assert await board.size() == W.players
    assert await board.client.zcard(board.prefixes[0] + "idx") == 1


async def test_the_textbook_set_holds_the_same_order(board: Board) -> None:
    key = peers.textbook_key(W.board)
    for player in ("p0", "p17", "p299"):
        rank = await board.client.zrevrank(key, player)
        assert rank + 1 == (await board.player(player)).entry.rank


async def test_raw_writes_apply_batches_and_keep_the_best(board: Board) -> None:
    pool = raw.MatchPool(W, seed=5, size=20)
    scores = pool.take(30)  # wraps the pool: later matches come back under new ids
    assert len({s.match_id for s in scores}) > 20
    # ...and with fresh points: a replayed (player, points) pair would be a no-op on a best board.
    firsts = {(s.player_id, s.points) for s in scores[: 20 * W.players_per_match]}
    fresh = [s for s in scores[20 * W.players_per_match :] if s.match_id.count(".") == 1]
    assert fresh and sum((s.player_id, s.points) not in firsts for s in fresh) > len(fresh) // 2
    assert await raw.write_batch(board, scores) == len(scores)
    best: dict[str, int] = {}
    for s in scores:
        best[s.player_id] = max(best.get(s.player_id, 0), s.points)
    got = {e.player_id: e.points for e in await board.query(list(best)[:20])}
    for player, points in got.items():
        assert points >= best[player]
    phase = await raw.writes(board, W, seconds=0.5, concurrency=2, batch_matches=5)
    assert phase.errors == 0 and phase.items > 0 and phase.items % W.players_per_match == 0
    assert phase.report()["latency_ms"]["write batch"]["count"] == phase.ops


async def test_raw_writes_stop_at_the_scores_asked_for(board: Board, monkeypatch: pytest.MonkeyPatch) -> None:
    # A long time bound the count ends well before: the phase stops at the first batch past it (each
    # caller's batch in flight then lands too), so the HTTP ramp and the raw run write about as much.
    pools: list[raw.MatchPool] = []

    class Kept(raw.MatchPool):  # a pool of 3 matches unless the phase asks for more
        def __init__(self, workload: Workload, seed: int, size: int = 3) -> None:
            super().__init__(workload, seed, size)
            pools.append(self)

    monkeypatch.setattr(raw, "MatchPool", Kept)
    monkeypatch.setattr(raw, "POOL_MATCHES", 3)
    phase = await raw.writes(board, W, seconds=60, concurrency=2, batch_matches=5, scores=200)
    batch = 5 * W.players_per_match
    assert phase.errors == 0 and 200 <= phase.items <= 200 + 2 * batch
    assert phase.seconds < 30
    # ...and every match it posted was a fresh draw: a pool that wrapped would replay its players.
    assert len(pools) == 1 and 0 < pools[0].next <= len(pools[0].matches)


async def test_raw_and_textbook_reads_run_the_mix_without_errors(board: Board) -> None:
    phase = await raw.reads(board, W, seconds=0.5, concurrency=2)
    assert phase.errors == 0, phase.error_samples
    assert set(phase.latencies) <= set(W.read_mix) and phase.ops > 5
    phase = await peers.textbook_reads(board.client, W.board, W, seconds=0.3, concurrency=2)
    assert phase.errors == 0, phase.error_samples
    written = await peers.textbook_writes(board.client, W.board, board.codec, W, seconds=0.3, concurrency=4)
    assert written.errors == 0 and written.items > 0


async def test_postgres_holds_the_same_ranks(board: Board, postgres_url: str) -> None:
    """The bench's PostgreSQL rival, on the suite's own PostgreSQL (never skipped: it is started)."""
    dsn = postgres_url
    assert await peers.pg_available(dsn) is None
    small = replace(W, board="bench-pg-t")
    assert await peers.pg_load(dsn, small.board, board.codec, small) == small.players
    conn = await peers.pg_connect(dsn)
    try:
        table = peers.pg_table(small.board)
        for player in ("p0", "p42"):
            cur = await conn.execute(
                f"SELECT 1 + (SELECT count(*) FROM {table} WHERE score > me.score) FROM {table} me "
                "WHERE player_id = %s",
                (player,),
            )
            (rank,) = await cur.fetchone()
            # Every store packs (points, earliest first) into one score; the load instant shifts all alike.
            me = int(player[1:])
            key = [(small.initial_points(i), small.initial_age_s(i)) for i in range(small.players)]
            assert rank == 1 + sum(1 for k in key if k > key[me])
        reads = await peers.pg_reads(dsn, small.board, small, seconds=0.3, concurrency=2)
        assert reads.errors == 0 and reads.ops > 0
        writes = await peers.pg_writes(dsn, small.board, board.codec, small, seconds=0.3, concurrency=2)
        assert writes.errors == 0 and writes.items > 0
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {peers.pg_table(small.board)}")
        await conn.close()


async def test_a_loaded_band_board_holds_what_writes_would_have_left(store: BoardStore) -> None:
    """The loader's band board (bench/hot.py ``band_sharding``) against the same scores sent through
    ``Board.submit``: every shard's total rows and version hash agree, and a later write moves a
    loaded player to their new band with nothing left behind."""
    from bench import hot
    from shardlb import keys, times
    from shardlb.board import Score

    w = replace(W, board="bench-t-band")
    sharding = hot.band_sharding(w, 3)
    assert len(sharding["bands"]) == 3  # the population's points part into three bands
    settings = {"sharding": sharding, "durability": "memory"}  # as the bench's boards (bench/testbed.py)
    loaded, _ = await store.create(BoardConfig.from_dict(w.board, settings))
    sent, _ = await store.create(BoardConfig.from_dict("bench-t-band-sent", settings))
    try:
        now = times.now_ms()
        assert await population.load_board(loaded, w, now_ms=now) == w.players
        unit = sent.codec.unit_ms
        scores = [
            Score(
                f"p{i}", w.initial_points(i), "load", (now // unit - w.initial_age_s(i) * 1000 // unit) * unit
            )
            for i in range(w.players)
        ]
        await sent.submit(scores, now_ms=now)
        for a, b in zip(loaded.prefixes, sent.prefixes, strict=True):
            total_a, total_b = keys.period_key(a, "total"), keys.period_key(b, "total")
            assert await loaded.client.zrange(total_a, 0, -1, withscores=True) == await sent.client.zrange(
                total_b, 0, -1, withscores=True
            )
            assert await loaded.client.hgetall(keys.version_key(a)) == await sent.client.hgetall(
                keys.version_key(b)
            )
            listed_a = await loaded.client.zrange(keys.index_key(a), 0, -1, withscores=True)
            listed_b = await sent.client.zrange(keys.index_key(b), 0, -1, withscores=True)
            assert {k.removeprefix(a): v for k, v in listed_a} == {k.removeprefix(b): v for k, v in listed_b}
        top = await loaded.top(1)
        last = await loaded.top(w.players)
        climber = last[-1].player_id
        await loaded.submit([Score(climber, top[0].points + 1, "climb", now)], now_ms=now)
        assert (await loaded.player(climber)).entry.rank == 1
        band_rows: list[str] = []
        for prefix in loaded.prefixes[3:]:
            band_rows += await loaded.client.zrange(keys.period_key(prefix, "total"), 0, -1)
        assert sorted(band_rows) == sorted(f"p{i}" for i in range(w.players))
    finally:
        await store.delete(w.board)
        await store.delete("bench-t-band-sent")


async def test_exact_retries_are_not_counted_as_writes(board: Board, postgres_url: str) -> None:
    """A retried match writes nothing new (the router answers it from its dedup records, the HTTP
    bench counts it apart), so no driver counts its scores as player-scores written: with every
    match after the first a retry, each driver writes one match's scores at most, whatever it sent."""
    replays = replace(W, retry_share=1.0)
    one = replays.players_per_match
    phase = await raw.writes(board, replays, seconds=0.3, concurrency=2, batch_matches=5)
    assert phase.errors == 0, phase.error_samples
    assert phase.items == one and phase.replayed == 5 * one * phase.ops - one
    assert phase.report()["replayed_items"] == phase.replayed
    written = await peers.textbook_writes(board.client, W.board, board.codec, replays, 0.3, 4)
    assert written.errors == 0 and written.ops > one and written.items <= one
    assert written.items + written.replayed == written.ops
    small = replace(replays, board="bench-pg-retries")
    assert await peers.pg_load(postgres_url, small.board, board.codec, small) == small.players
    try:
        pg = await peers.pg_writes(postgres_url, small.board, board.codec, small, seconds=0.3, concurrency=2)
        assert pg.errors == 0 and pg.ops > 1 and pg.items == one
        assert pg.replayed == (pg.ops - 1) * one
    finally:
        conn = await peers.pg_connect(postgres_url)
        await conn.execute(f"DROP TABLE IF EXISTS {peers.pg_table(small.board)}")
        await conn.close()
