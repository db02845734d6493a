"""The archiver (issue 11, item 2) against the suite's cluster and a real PostgreSQL: what it
archives gives the board back, a replay or a second archiver changes nothing, a dead archiver's
entries are taken over, and while PostgreSQL is away the journals buffer up to their bound, past
which writes are refused, never dropped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import orjson
import psycopg
import pytest
from prometheus_client import REGISTRY

from shardlb import archive, keys, times
from shardlb.archive import Archiver, connect_db
from shardlb.archive import _rows as archive_rows
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import Overloaded
from shardlb.journal import GROUP, journal_lag
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import HOUR, expected_entries, sharding

pytestmark = pytest.mark.cluster


async def archiver(raw: Any, store: BoardStore, postgres_url: str, name: str = "a1", **kw: Any) -> Archiver:
    a = Archiver(raw, store, await connect_db(postgres_url), name, **kw)
    await a.refresh()
    return a


async def drain(a: Archiver) -> int:
    total = 0
    while n := await a.round():
        total += n
    return total


async def archived(postgres_url: str, board: Board) -> list[Score]:
    """The board's rows in PostgreSQL, as Scores (region from the shard, as the board placed them)."""
    layout = board.layout
    async with await psycopg.AsyncConnection.connect(postgres_url) as db:
        cur = await db.execute(
            "SELECT match_id, player_id, points, achieved_ms, shard FROM match_results "
            "WHERE board = %s AND incarnation = %s ORDER BY journal_id",
            (board.config.id, board.incarnation),
        )
        rows = await cur.fetchall()
    out = []
    for match, player, points, achieved, shard in rows:
        region = None
        if layout.strategy == "region":
            region = layout.sharding.regions[shard // layout.sharding.shards_per_region]
        out.append(Score(player, points, match, achieved, region))
    return out


async def write_random(board: Board, rng: random.Random, batches: int = 4) -> None:
    now = times.now_ms()
    regions = list(board.config.sharding.regions)
    players = [f"p{i:02d}" for i in range(30)]
    sent: list[Score] = []
    for batch_no in range(batches):
        where = {p: rng.choice(regions) for p in players} if regions else {}
        batch = []
        for _ in range(30):
            if sent and rng.random() < 0.25:
                old = rng.choice(sent)  # a client's retry
                batch.append(old._replace(region=where.get(old.player_id)))
                continue
            player = rng.choice(players)
            at = now - rng.choice([0, 1, 30]) * HOUR
            batch.append(
                Score(player, rng.randrange(0, 300), f"m{batch_no}-{len(sent)}", at, where.get(player))
            )
            sent.append(batch[-1])
        await board.submit(batch, now_ms=now)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize("strategy", ["hash", "region", "band"])
async def test_the_archive_gives_the_board_back(
    store: BoardStore, raw: Any, postgres_url: str, strategy: str, mode: str
) -> None:
    config = BoardConfig.from_dict(
        f"archive-{strategy}-{mode}", {"mode": mode, "points_max": 500, "sharding": sharding(strategy, 3)}
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    try:
        await write_random(board, random.Random(f"archive/{strategy}/{mode}"))
        assert await drain(a) > 0
        ref = ReferenceBoard(config)
        ref.submit(await archived(postgres_url, board), now_ms=times.now_ms())
        want = expected_entries(ref, "total", None)
        assert want and await board.top(len(want) + 5) == want
        counted = 0  # shards that counted results
        for prefix in board.prefixes:  # every archived entry was trimmed from its journal
            assert await journal_lag(raw, keys.journal_key(prefix)) == (0, 0.0, 0)
            # and every result journaled was taken off the count as it was archived, once (ack.lua)
            left = await raw.get(keys.journal_counts_key(prefix))
            assert left is None or int(left) == 0
            counted += left is not None
        assert counted, "no shard counted its journaled results"
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_journaled_nul_does_not_stop_the_archive(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """Routers refuse a match id holding NUL (U+0000) now, but one journaled before (by a router of
    before, or straight through the library) must not stop the archive: PostgreSQL's text cannot
    hold it, and the round that failed on it was every journal's round, for ever. It is archived
    with U+FFFD in its place, and the other board's results with it."""
    bad = BoardConfig.from_dict("archive-nul", {"mode": "incr"})
    good = BoardConfig.from_dict("archive-nul-other", {})
    board, _ = await store.create(bad)
    other, _ = await store.create(good)
    a = await archiver(raw, store, postgres_url)
    try:
        now = times.now_ms()
        [p] = board.prepare([Score("p1", 3, "m-ok", now)])
        await board.apply_shard(p.shard, [p._replace(match_id="m\x00nul")])  # past the checks
        await other.submit([Score("p2", 4, "m2", now)])
        assert await drain(a) == 2
        assert [(s.match_id, s.points) for s in await archived(postgres_url, board)] == [("m\ufffdnul", 3)]
        assert [(s.player_id, s.points) for s in await archived(postgres_url, other)] == [("p2", 4)]
    finally:
        await a.db.close()
        await store.delete(bad.id)
        await store.delete(good.id)


async def deleted_at(postgres_url: str, board: Board) -> object:
    async with await psycopg.AsyncConnection.connect(postgres_url) as db:
        cur = await db.execute(
            "SELECT deleted_at FROM boards WHERE board = %s AND incarnation = %s",
            (board.config.id, board.incarnation),
        )
        row = await cur.fetchone()
    assert row is not None, "the archiver never recorded the board"
    return row[0]


async def test_only_a_deleted_board_is_marked_deleted_not_one_redis_lost(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The archiver marks a board deleted in PostgreSQL (so `rebuild --all` leaves it) when it was
    deleted, not whenever the registry lacks it: after a total loss of Redis the registry is empty,
    and marking every board then left `rebuild --all` nothing to restore."""
    deleted, lost = BoardConfig.from_dict("archive-deleted", {}), BoardConfig.from_dict("archive-lost", {})
    one, _ = await store.create(deleted)
    other, _ = await store.create(lost)
    a = await archiver(raw, store, postgres_url)
    try:
        assert await deleted_at(postgres_url, one) is None and await deleted_at(postgres_url, other) is None
        await store.delete(deleted.id)
        # A PARTIAL model of a Redis that lost everything, on purpose: the record alone (no record,
        # no deletion mark of this board; a real loss would take the other board's mark too).
        await raw.hdel(keys.BOARDS, lost.id)
        await a.refresh()
        assert await deleted_at(postgres_url, one) is not None
        assert await deleted_at(postgres_url, other) is None
        await a.refresh()  # and not on a later look either
        assert await deleted_at(postgres_url, other) is None
    finally:
        await a.db.close()
        with contextlib.suppress(Exception):
            await store.delete(lost.id)


async def keys_left(client: Any, board: Board) -> dict[str, int]:
    """Every key of ``board``'s incarnation on the cluster, with its time to live in ms (-1: none)."""
    pattern = f"lb:*:{board.config.id}:{board.incarnation}*"
    found = [k async for k in client.scan_iter(match=pattern, count=1000)]
    return {k.decode() if isinstance(k, bytes) else k: await client.pttl(k) for k in found}


@pytest.mark.parametrize("written", [False, True])
async def test_the_archiver_leaves_no_journal_of_a_deleted_board(
    store: BoardStore, raw: Any, postgres_url: str, written: bool
) -> None:
    """The archiver's rounds between a board's deletion and its next look at the registry (2 s),
    and its first round on a board never written, make no journal stream: one made outside the
    board's key index is not unlinked by the deletion, and one made after it stays for good."""
    config = BoardConfig.from_dict(f"archive-left-{written}", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    try:
        if written:
            now = times.now_ms()
            await board.submit([Score(f"p{i}", i, f"m{i}", now) for i in range(6)], now_ms=now)
        await a.round()
        await store.delete(config.id)
        for _ in range(3):  # the archiver still holds the board
            await a.round()
        left = await keys_left(raw, board)
        assert left and all(ttl > 0 for ttl in left.values()), left  # only markers that expire
        await store.create(config)  # the archiver meets the board of that id again, another one
        await a.refresh()
        await a.round()
        assert all(ttl > 0 for ttl in (await keys_left(raw, board)).values())
    finally:
        await a.db.close()
        with contextlib.suppress(Exception):
            await store.delete(config.id)


async def test_archivers_that_ran_before_are_forgotten_once_they_hold_nothing(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """Each archiver process is a consumer of its own name (host and pid, a pod's name), which
    Redis keeps in every journal's group until it is deleted: every restart left one more for good.
    A consumer idle past ``forget_idle_s`` without pending entries is deleted; one still holding
    entries (a dead archiver's, not taken over yet) is kept."""
    config = BoardConfig.from_dict("archive-forget", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(config)
    before = [await archiver(raw, store, postgres_url, f"before-{i}") for i in range(3)]
    dead = await archiver(raw, store, postgres_url, "dead")
    live = await archiver(raw, store, postgres_url, "live", forget_idle_s=0.3)
    journals = [keys.journal_key(p) for p in board.prefixes]
    try:
        for n, a in enumerate(before):
            now = times.now_ms()
            await board.submit([Score(f"p{i}", n, f"m{n}-{i}", now) for i in range(10)], now_ms=now)
            assert await drain(a) == 10
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 9, f"late-{i}", now) for i in range(10)], now_ms=now)
        for key in journals:  # delivered to `dead`, which never writes them
            await dead._read(key)
        await asyncio.sleep(0.4)
        await live.round()  # nothing to archive: `dead` holds the entries for 30 s

        async def consumers(key: str) -> set[str]:
            return {c["name"].decode() for c in await raw.xinfo_consumers(key, GROUP)}

        for key in journals:  # (Redis 7 makes `live` only once it has read an entry)
            assert await consumers(key) - {"live"} == {"dead"}
    finally:
        for a in [*before, dead, live]:
            await a.db.close()
        await store.delete(config.id)


async def test_a_replay_and_a_second_archiver_change_nothing(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    config = BoardConfig.from_dict(
        "archive-replay", {"mode": "incr", "sharding": {"strategy": "hash", "shards": 4}}
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, "a1", claim_idle_s=0)
    b = await archiver(raw, store, postgres_url, "b1", claim_idle_s=0)
    try:
        await write_random(board, random.Random("replay"))
        # a reads and commits, but dies before it acknowledges: b takes the entries over
        real_ack = a._ack

        async def lost(*_: Any) -> None:
            raise ConnectionError("archiver a died after its commit")

        a._ack = lost  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            await a.round()
        first = await archived(postgres_url, board)
        assert first
        assert await drain(b) > 0  # the same entries again, through the upsert
        a._ack = real_ack  # type: ignore[method-assign]
        await drain(a)
        again = await archived(postgres_url, board)
        assert sorted(again) == sorted(first)
        ref = ReferenceBoard(config)
        ref.submit(again, now_ms=times.now_ms())
        assert await board.top(100) == expected_entries(ref, "total", None)
    finally:
        await a.db.close()
        await b.db.close()
        await store.delete(config.id)


async def test_a_dead_archivers_unread_entries_are_taken_over(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    config = BoardConfig.from_dict("archive-dead", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(config)
    dead = await archiver(raw, store, postgres_url, "dead")
    alive = await archiver(raw, store, postgres_url, "alive", claim_idle_s=0)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(20)], now_ms=now)
        for prefix in board.prefixes:  # delivered to `dead`, which never writes them
            assert (await dead._read(keys.journal_key(prefix)))[0]
        assert await drain(alive) == 20
        assert len(await archived(postgres_url, board)) == 20
    finally:
        await dead.db.close()
        await alive.db.close()
        await store.delete(config.id)


async def test_without_postgres_the_journal_buffers_then_refuses(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    config = BoardConfig.from_dict("archive-down", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max = 3
    a = await archiver(raw, store, postgres_url)
    try:
        await a.db.close()  # PostgreSQL is gone
        now = times.now_ms()
        for i in range(3):
            await board.submit([Score(f"p{i}", 10 + i, f"m{i}", now)], now_ms=now)
        with pytest.raises(psycopg.Error):
            await a.round()
        with pytest.raises(Overloaded):  # refused, not accepted and dropped
            await board.submit([Score("late", 99, "m9", now)], now_ms=now)
        assert (await journal_lag(raw, keys.journal_key(board.prefixes[0]))).entries == 3
        a.db = await connect_db(postgres_url)  # PostgreSQL is back
        assert await drain(a) == 3
        await board.submit([Score("late", 99, "m9", now)], now_ms=now)
        assert await drain(a) == 1
        assert {s.player_id for s in await archived(postgres_url, board)} == {"p0", "p1", "p2", "late"}
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_the_results_bound_holds_while_postgres_is_away(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """SHARDLB_JOURNAL_MAX_RESULTS with the archiver: results not archived are counted as written
    and as archived, so one call of many results fills the bound as many calls of one would, and
    the archive catching up makes room again."""
    config = BoardConfig.from_dict("archive-results", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max_results = 3
    key = keys.journal_key(board.prefixes[0])
    a = await archiver(raw, store, postgres_url)
    try:
        await a.db.close()  # PostgreSQL is gone
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 10 + i, "m0", now) for i in range(3)], now_ms=now)
        with pytest.raises(psycopg.Error):
            await a.round()
        with pytest.raises(Overloaded):
            await board.submit([Score("late", 99, "m9", now)], now_ms=now)
        lag = await journal_lag(raw, key)
        assert (lag.entries, lag.results) == (1, 3)
        a.db = await connect_db(postgres_url)  # PostgreSQL is back
        assert await drain(a) == 3
        assert (await journal_lag(raw, key)).results == 0
        await board.submit([Score("late", 99, "m9", now)], now_ms=now)
        assert (await journal_lag(raw, key)).results == 1
        assert await drain(a) == 1
        assert {s.player_id for s in await archived(postgres_url, board)} == {"p0", "p1", "p2", "late"}
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_entries_acknowledged_by_an_archiver_that_died_before_its_trim_are_trimmed(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archiver killed between its acknowledgement and its trim leaves archived entries in the
    journal. At the entries bound they refuse every write, and no new entry comes to make another
    acknowledgement trim them: an archiver must trim such a journal itself."""
    config = BoardConfig.from_dict("archive-untrimmed", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max = 3
    key = keys.journal_key(board.prefixes[0])
    dead = await archiver(raw, store, postgres_url, "dead")
    alive = await archiver(raw, store, postgres_url, "alive")
    try:
        now = times.now_ms()
        for i in range(3):
            await board.submit([Score(f"p{i}", 10 + i, f"m{i}", now)], now_ms=now)

        trim = dead._trim

        async def killed(journals: Any, recount: bool = False) -> Any:
            # Only the trim after this board's acknowledgement: the round also takes up every other
            # journal board the session's registry holds (other modules leave some), and a trim of
            # those killed first ended the round before this board's entries were acknowledged.
            if recount and key in journals:
                raise ConnectionError("archiver killed after its acknowledgement, before its trim")
            return await trim(journals, recount)

        monkeypatch.setattr(dead, "_trim", killed)
        with pytest.raises(ConnectionError):
            await dead.round()
        monkeypatch.undo()
        assert (await journal_lag(raw, key)).results == 0  # committed and acknowledged
        assert await raw.xlen(key) == 3  # not trimmed
        assert await drain(alive) == 0
        assert await raw.xlen(key) == 0  # trimmed by a round that had nothing to archive
        await board.submit([Score("late", 99, "m9", now)], now_ms=now)  # not refused
        assert await drain(alive) == 1
        assert {s.player_id for s in await archived(postgres_url, board)} == {"p0", "p1", "p2", "late"}
    finally:
        await dead.db.close()
        await alive.db.close()
        await store.delete(config.id)


async def test_the_archiver_sets_a_drifted_count_right_while_the_shard_is_busy(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archiver of before acknowledged without counting down, so the count of results not
    archived drifted up; the archiver recounts right after an acknowledgement (at most every
    RECOUNT_EVERY_S a journal), so the count is right again although the journal is never empty."""
    config = BoardConfig.from_dict("archive-recount", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    key, counts = keys.journal_key(board.prefixes[0]), keys.journal_counts_key(board.prefixes[0])
    a = await archiver(raw, store, postgres_url)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(4)], now_ms=now)
        await raw.incrby(counts, 50_000)  # the drift
        # the archive reads what is there; a result written meanwhile stays in the journal
        entries, _ = await a._read(key)
        await board.submit([Score("late", 9, "m2", now)], now_ms=now)
        assert int(await raw.get(counts)) == 50_005
        await a._write([row for e in entries for row in archive_rows(board, e)])
        await a._ack({key: [x for e in entries for x in (e.id, str(e.counted))]})
        assert int(await raw.get(counts)) == 1 == (await journal_lag(raw, key)).results
        await raw.incrby(counts, 7)  # drifts again: the next recount is RECOUNT_EVERY_S away
        monkeypatch.setattr(archive, "RECOUNT_EVERY_S", 3600.0)
        await board.submit([Score("later", 9, "m3", now)], now_ms=now)
        assert await drain(a) == 2
        assert int(await raw.get(counts)) == 7  # counted down exactly, not recounted: not due
        monkeypatch.setattr(archive, "RECOUNT_EVERY_S", 0.0)
        await board.submit([Score("last", 9, "m4", now)], now_ms=now)
        assert await drain(a) == 1
        assert int(await raw.get(counts)) == 0  # recounted
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_shardlb_archive_runs_until_sigterm(
    store: BoardStore, cluster_url: str, postgres_url: str, tmp_path: Path
) -> None:
    """The `shardlb archive` process archives what is written while it runs and exits 0 on SIGTERM."""
    config = BoardConfig.from_dict("archive-process", {"sharding": {"strategy": "hash", "shards": 3}})
    board, _ = await store.create(config)
    await (await connect_db(postgres_url)).close()  # the tables exist before we look
    output = tmp_path / "archive.log"
    with output.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardlb", "archive", "--redis", cluster_url, "--postgres", postgres_url],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(25)], now_ms=now)
        deadline = time.monotonic() + 30
        while len(await archived(postgres_url, board)) < 25:
            assert process.poll() is None, output.read_text()
            assert time.monotonic() < deadline, "the archiver did not archive within 30 s"
            await asyncio.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await store.delete(config.id)


async def test_the_archiver_reconnects_when_postgres_drops_it(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A PostgreSQL restart or failover closes the archiver's connection: `run` must open a new one
    and go on, not fail every round from then on."""
    config = BoardConfig.from_dict("archive-reconnect", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(config)
    a = Archiver(raw, store, await connect_db(postgres_url), "reconnect", db_url=postgres_url)
    stop = asyncio.Event()
    task = asyncio.create_task(a.run(stop, idle_s=0.05, refresh_s=0.2))
    try:
        now = times.now_ms()
        await board.submit([Score("before", 1, "m1", now)], now_ms=now)
        await wait_archived(postgres_url, board, 1)
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND application_name = 'shardlb-archive'"
            )
        await board.submit([Score("after", 2, "m2", now)], now_ms=now)
        await wait_archived(postgres_url, board, 2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await a.db.close()
        await store.delete(config.id)


async def test_a_failure_inside_redis_py_does_not_stop_the_archiver(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing on a pooled connection that a failover closed makes redis-py fail inside itself with
    an AttributeError, not a RedisError (seen under `make chaos`, where it ended the archiver and its
    journals went undrained). The round is retried like any other cluster failure."""
    from redis.asyncio.connection import Connection

    config = BoardConfig.from_dict("archive-leak", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    real = a.round
    failures = [Connection()]

    async def first_round_breaks() -> int:
        if failures:
            closed = failures.pop()  # its writer is gone, as after the peer closed it
            await closed._send_packed_command([b"PING"])
        return await real()

    monkeypatch.setattr(a, "round", first_round_breaks)
    stop = asyncio.Event()
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(5)], now_ms=now)
        running = asyncio.create_task(a.run(stop, idle_s=0.05))
        deadline = time.monotonic() + 20
        while len(await archived(postgres_url, board)) < 5:
            assert not running.done(), running.exception()
            assert time.monotonic() < deadline, "nothing archived after the failure"
            await asyncio.sleep(0.1)
        assert not failures
        stop.set()
        await running
    finally:
        stop.set()
        await a.db.close()
        await store.delete(config.id)


async def wait_archived(postgres_url: str, board: Board, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(await archived(postgres_url, board)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} results archived within {timeout_s} s"
        await asyncio.sleep(0.1)


async def test_an_archiver_reads_more_journals_than_a_node_has_connections(
    cluster_url: str, raw: Any, postgres_url: str
) -> None:
    """A round reads every journal. Reading them all at once, a node holding more journals than the
    client has connections to it (64, `connect`) failed every round with MaxConnectionsError, and
    the archive stopped for good (seen under `make chaos`: 12 boards of 16 shards)."""
    # A store of its own: writing 256 shards fills its pool, which the session's must not keep
    # (test_memory counts the buffers of the session client's connections).
    client = connect(cluster_url)
    scripts = Scripts.register(client)
    await scripts.load(client)
    store = BoardStore(client, scripts)
    config = BoardConfig.from_dict("archive-wide", {"sharding": {"strategy": "hash", "shards": 256}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(300)], now_ms=now)
        assert await drain(a) == 300
    finally:
        await a.db.close()
        await store.delete(config.id)
        await client.aclose()


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.parametrize(
    "fields",
    [{"n": "1", "r": b"\xc1"}, {"n": "1"}],  # a byte msgpack never writes; no results at all
    ids=["garbled", "missing"],
)
async def test_an_entry_that_cannot_be_read_holds_its_own_journal_only(
    store: BoardStore, raw: Any, postgres_url: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch, fields: dict[str, Any],
) -> None:  # fmt: skip
    """An entry the archiver cannot decode (written by a broken or foreign writer, or damaged) raised
    out of every round: `shardlb archive` exited, and restarted it met the same entry again, so no
    journal of any board was archived any more. Now it is held like an entry PostgreSQL refuses:
    the entries before it in its journal are archived, its journal waits at it, every other journal
    goes on, it is logged and counted once, and an operator acknowledging it by hand lets the
    journal go on."""
    bad = BoardConfig.from_dict("archive-unreadable", {"sharding": {"strategy": "hash", "shards": 1}})
    good = BoardConfig.from_dict("archive-unreadable-other", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(bad)
    other, _ = await store.create(good)
    key, counts = keys.journal_key(board.prefixes[0]), keys.journal_counts_key(board.prefixes[0])
    a = await archiver(raw, store, postgres_url)
    caplog.set_level(logging.WARNING, logger="shardlb.archive")
    unreadable, held = sample("shardlb_archive_unreadable_entries_total"), "shardlb_archive_held_journals"
    try:
        now = times.now_ms()
        await board.submit([Score("before", 1, "m1", now)], now_ms=now)
        broken = (await raw.xadd(key, {"b": bad.id, "i": board.incarnation, "s": "0", **fields})).decode()
        await raw.incrby(counts, 1)
        await board.submit([Score("after", 3, "m3", now)], now_ms=now)
        await other.submit([Score(f"p{i}", i, "m1", now) for i in range(6)], now_ms=now)

        assert await drain(a) == 6 + 1  # no exception: the round goes on
        assert sorted(s.player_id for s in await archived(postgres_url, other)) == [f"p{i}" for i in range(6)]
        assert [s.player_id for s in await archived(postgres_url, board)] == ["before"]
        pending = await raw.xpending(key, GROUP)  # nothing from the broken entry on acknowledged
        assert (pending["pending"], pending["min"].decode()) == (2, broken)
        assert sample("shardlb_archive_unreadable_entries_total") == unreadable + 1
        assert sample(held) == 1
        [record] = [r for r in caplog.records if "cannot be read" in r.getMessage()]
        assert record.fields["entry"] == broken and record.fields["journal"] == key  # type: ignore[attr-defined]

        monkeypatch.setattr(archive, "RETRY_REFUSED_S", 0.0)
        await other.submit([Score("p9", 9, "m2", now)], now_ms=now)
        assert await drain(a) == 1  # tried again, quietly, and still held
        assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1
        assert [s.player_id for s in await archived(postgres_url, board)] == ["before"]
        assert sample(held) == 1

        await raw.xack(key, GROUP, broken)  # the operator skips it
        monkeypatch.setattr(archive, "RECOUNT_EVERY_S", 0.0)
        await board.submit([Score("later", 4, "m4", now)], now_ms=now)
        assert await drain(a) == 2
        assert [s.player_id for s in await archived(postgres_url, board)] == ["before", "after", "later"]
        assert sample(held) == 0
    finally:
        await a.db.close()
        await store.delete(bad.id)
        await store.delete(good.id)


async def test_an_entry_postgres_refuses_holds_its_own_journal_only(
    store: BoardStore, raw: Any, postgres_url: str, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """An entry PostgreSQL refuses (here points no bigint holds, journaled as write.lua journals;
    any data error or constraint alike) failed the round of every journal, for ever: every journaled
    board's journals filled and its writes were refused. Now every other journal is archived and
    acknowledged, and so are the entries before it in its own; its journal is held at it (nothing
    from it on acknowledged), tried again every RETRY_REFUSED_S, logged and counted once, until an
    operator acknowledges it by hand (or PostgreSQL takes it)."""
    bad = BoardConfig.from_dict("archive-refused", {"sharding": {"strategy": "hash", "shards": 1}})
    good = BoardConfig.from_dict("archive-refused-other", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(bad)
    other, _ = await store.create(good)
    key, counts = keys.journal_key(board.prefixes[0]), keys.journal_counts_key(board.prefixes[0])
    a = await archiver(raw, store, postgres_url)
    caplog.set_level(logging.WARNING, logger="shardlb.archive")
    refusals, held = sample("shardlb_archive_refused_entries_total"), "shardlb_archive_held_journals"
    try:
        now = times.now_ms()
        await board.submit([Score("before", 1, "m1", now)], now_ms=now)
        huge = msgpack.packb(["m2\x00huge", 2**63, board.codec.time_units(now)])
        fields = {"b": bad.id, "i": board.incarnation, "s": "0", "n": "1", "r": huge}
        refused = (await raw.xadd(key, fields)).decode()
        await raw.incrby(counts, 1)  # as write.lua counts what it journals
        await board.submit([Score("after", 3, "m3", now)], now_ms=now)
        await other.submit([Score(f"p{i}", i, "m1", now) for i in range(6)], now_ms=now)

        assert await drain(a) == 6 + 1
        assert sorted(s.player_id for s in await archived(postgres_url, other)) == [f"p{i}" for i in range(6)]
        for prefix in other.prefixes:  # acknowledged and trimmed
            assert await journal_lag(raw, keys.journal_key(prefix)) == (0, 0.0, 0)
        assert [s.player_id for s in await archived(postgres_url, board)] == ["before"]
        pending = await raw.xpending(key, GROUP)  # nothing from the refused entry on acknowledged
        assert (pending["pending"], pending["min"].decode()) == (2, refused)
        lag = (await a.lag())[key]  # what the lag gauges and /readyz read: the journal is behind
        assert (lag.entries, lag.results) == (2, 2)
        assert sample("shardlb_archive_refused_entries_total") == refusals + 1
        assert sample(held) == 1
        [record] = [r for r in caplog.records if "refused" in r.getMessage()]
        assert record.fields["entry"] == refused and record.fields["journal"] == key  # type: ignore[attr-defined]

        monkeypatch.setattr(archive, "RETRY_REFUSED_S", 0.0)
        await other.submit([Score("p9", 9, "m2", now)], now_ms=now)
        assert await drain(a) == 1  # the others go on; the refused entry is tried again, quietly
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
        assert sample("shardlb_archive_refused_entries_total") == refusals + 1

        # the operator skips it (its result stays on the board in Redis, not in PostgreSQL)
        await raw.xack(key, GROUP, refused)
        monkeypatch.setattr(archive, "RECOUNT_EVERY_S", 0.0)
        await board.submit([Score("later", 4, "m4", now)], now_ms=now)
        assert await drain(a) == 2
        assert [s.player_id for s in await archived(postgres_url, board)] == ["before", "after", "later"]
        assert await journal_lag(raw, key) == (0, 0.0, 0)
        assert sample(held) == 0
    finally:
        await a.db.close()
        await store.delete(bad.id)
        await store.delete(good.id)


async def test_a_connection_whose_schema_check_is_cancelled_is_closed(postgres_url: str) -> None:
    """``connect_db`` opens a connection, then checks the schema on it. Cancelled there (a router's
    ban or removal cut off by its stop, an archiver stopped while PostgreSQL is slow), it left the
    connection open, with nothing to close it but the collector once the cancelled task is gone:
    a PostgreSQL backend held meanwhile, and a ResourceWarning. The check is made to wait on a
    lock here, so that the cancellation lands in it."""
    await (await connect_db(postgres_url)).close()  # the schema is in place
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as blocker:
        waiting = "SELECT pid FROM pg_stat_activity WHERE application_name = 'shardlb-archive' AND pid <> %s"
        async with blocker.transaction():
            await blocker.execute("LOCK TABLE schema_applied IN ACCESS EXCLUSIVE MODE")
            task = asyncio.create_task(connect_db(postgres_url))
            pids: list[tuple[Any, ...]] = []
            while not pids:  # the new connection waits for the lock, in its schema check
                await asyncio.sleep(0.05)
                assert not task.done()
                pids = await (await blocker.execute(waiting, (blocker.info.backend_pid,))).fetchall()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # The cancelled task is still referenced (as a server's task list holds it a while): its
        # connection must be closed all the same.
        left = pids
        for _ in range(100):
            left = await (await blocker.execute(waiting, (blocker.info.backend_pid,))).fetchall()
            if not left:
                break
            await asyncio.sleep(0.05)
        assert task.cancelled() and not left, f"backend still open: {left}"


# `shardlb archive` as main() sets it up, its serve() replaced by one webhook POST (as the webhook
# sweep sends them: httpx) to a receiver whose URL carries its token, and a line of the archiver's.
WEBHOOK_POST = """
import asyncio, http.server, logging, threading
import httpx
from shardlb import archive

class Receiver(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", 0), Receiver)
threading.Thread(target=server.serve_forever, daemon=True).start()
url = f"http://127.0.0.1:{server.server_address[1]}/hooks/T0/s3cret-token?key=s3cret-key"

async def serve(*args, **kwargs):
    async with httpx.AsyncClient() as http:
        assert (await http.post(url, content=b"{}")).status_code == 200
    logging.getLogger("shardlb.archive").info("webhook deliveries swept", extra={"fields": {"delivered": 1}})

archive.serve = serve
archive.main(["--redis", "redis://127.0.0.1:1", "--postgres", "postgresql://shardlb@127.0.0.1:1/x"])
"""


def test_the_archivers_log_holds_no_webhook_url() -> None:
    """httpx logs every request it sends at info, URL and all, and `shardlb archive` logs at info
    through the root logger: each webhook delivery was a line holding the receiver's URL, whose path
    or query often is its credential (a token the receiver checks), one line per award."""
    done = subprocess.run(
        [sys.executable, "-c", WEBHOOK_POST], capture_output=True, text=True, timeout=60, check=True
    )
    assert "webhook deliveries swept delivered=1" in done.stderr, done.stderr
    assert "s3cret" not in done.stderr, done.stderr


async def test_an_idle_round_reads_and_trims_its_journals_through_pipelines(
    store: BoardStore, raw: Any, postgres_url: str, cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An archiver read each journal every round with three round trips of its own (XAUTOCLAIM,
    XREADGROUP, and the COMMAND GETKEYS redis-py's cluster client asks before each XREADGROUP), and
    trimmed each idle one every 5 s with four more: with 2,000 boards of 10 shards an idle round
    took 16 s and most of a core. A round now reads and trims through one pipeline per node and
    chunk of journals: no call of its own per journal, and no COMMAND GETKEYS."""
    import redis as sync_redis

    config = BoardConfig.from_dict("archive-pipelined", {"sharding": {"strategy": "hash", "shards": 8}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, "piped")
    try:
        await drain(a)  # what other modules left in the registry's journals
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(40)], now_ms=now)
        assert await drain(a) == 40
        await a.round()  # any script a node lacked is loaded by now
        a._trimmed.clear()  # every journal's idle trim is due
        a._forgotten.clear()
        calls: list[Any] = []
        direct = raw.execute_command

        async def counted(*args: Any, **options: Any) -> Any:
            calls.append(args[0])
            return await direct(*args, **options)

        def getkeys() -> int:
            total = 0
            for port in cluster.ports:
                node = sync_redis.Redis(host=cluster.host, port=port, password=cluster.password)
                stats = node.info("commandstats")
                node.close()
                total += stats.get("cmdstat_command|getkeys", {}).get("calls", 0)
            return total

        before = getkeys()
        monkeypatch.setattr(raw, "execute_command", counted)
        assert await a.round() == 0
        monkeypatch.undo()
        assert calls == []
        assert getkeys() == before
        for prefix in board.prefixes:  # each journal trimmed: every entry was archived
            assert await raw.xlen(keys.journal_key(prefix)) == 0
        late = times.now_ms()
        await board.submit([Score("late", 99, "m2", late)], now_ms=late)
        assert await drain(a) == 1
        assert {s.player_id for s in await archived(postgres_url, board)} >= {"p0", "p39", "late"}
    finally:
        await a.db.close()
        await store.delete(config.id)


async def first_pause(
    a: Archiver,
    monkeypatch: pytest.MonkeyPatch,
    round_takes_s: float,
    refresh_takes_s: float = 0.0,
    **run: Any,
) -> float:
    """The pause of ``a.run(**run)`` after its first round, an idle one that takes
    ``round_takes_s``, the refresh of the board list before it ``refresh_takes_s`` (neither
    touches Redis or PostgreSQL)."""
    stop = asyncio.Event()
    pauses: list[float] = []

    async def refresh() -> None:
        await asyncio.sleep(refresh_takes_s)

    async def idle_round() -> int:
        await asyncio.sleep(round_takes_s)
        return 0

    async def pause(_: asyncio.Event, seconds: float) -> None:
        pauses.append(seconds)
        stop.set()

    monkeypatch.setattr(a, "refresh", refresh)
    monkeypatch.setattr(a, "round", idle_round)
    monkeypatch.setattr(archive, "_sleep", pause)
    try:
        await a.run(stop, **run)
    finally:
        monkeypatch.undo()
    assert len(pauses) == 1
    return pauses[0]


async def test_an_idle_archiver_waits_as_long_as_its_round_took(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round reads every journal of the registry; with many boards it takes a second or more, and
    an idle archiver ran them back to back (0.2 s apart), keeping a core and the masters busy
    finding nothing. After a round that archived nothing it now waits as long as the round took."""
    a = await archiver(raw, store, postgres_url, "paced")
    try:
        assert await first_pause(a, monkeypatch, round_takes_s=0.3, idle_s=0.2) >= 0.3  # many journals
    finally:
        await a.db.close()


async def test_the_archivers_refresh_makes_again_only_the_boards_whose_record_changed(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The archiver's look at the registry every 2 s made a Board of every record: 170-200 ms of
    its event loop at 2,000 boards. It keeps those whose record did not change; one that changed
    is made again (here a reshard recorded: the new layout's journals are the archiver's too)."""
    from tests.test_store import MadeStore

    config = BoardConfig.from_dict("archive-kept", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(config)
    counted = MadeStore(store)
    a = await archiver(raw, counted, postgres_url)
    try:
        counted.made.clear()
        await a.refresh()
        assert config.id not in counted.made
        await Resharder(store, config.id, say=lambda _: None, postgres_url=postgres_url).start(3)
        await a.refresh()
        assert counted.made.count(config.id) == 2  # both its layouts
        assert len(a.boards[(config.id, board.incarnation)].also) == 3
    finally:
        await a.db.close()
        with contextlib.suppress(Exception):
            await Resharder(store, config.id, say=lambda _: None, postgres_url=postgres_url).cancel()
        await store.delete(config.id)


async def registry_reads(raw: Any) -> int:
    """HGETALL and HSCAN calls the cluster's primaries have run (INFO commandstats)."""
    stats = await raw.info("commandstats", target_nodes=raw.PRIMARIES)
    counted = ("cmdstat_hgetall", "cmdstat_hscan")
    return sum(int(node.get(c, {}).get("calls", 0)) for node in stats.values() for c in counted)


async def test_an_idle_archiver_reads_the_registry_only_when_its_version_moved(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The archiver's refresh read the whole registry every 2 s (an HGETALL of 1 MB at 2,000
    boards) whether or not a record had changed. Every change of a record moves the registry's
    version in the same call (registry.lua): a refresh reads the registry only when the version
    moved, and sees each kind of change at the next refresh."""
    kept = BoardConfig.from_dict("followed-kept", {"sharding": {"strategy": "hash", "shards": 2}})
    later = BoardConfig.from_dict("followed-later", {"sharding": {"strategy": "hash", "shards": 2}})
    board, _ = await store.create(kept)
    a = await archiver(raw, store, postgres_url, whole_read_s=3600.0)
    try:
        before = await registry_reads(store.client)
        for _ in range(5):
            await a.refresh()
        assert await registry_reads(store.client) == before

        new, _ = await store.create(later)  # a creation
        await a.refresh()
        assert (later.id, new.incarnation) in a.boards
        assert await deleted_at(postgres_url, new) is None  # recorded in PostgreSQL

        raw_record = await raw.hget(keys.BOARDS, later.id)
        record = orjson.loads(raw_record)
        assert await store.swap(later.id, raw_record, orjson.dumps({**record, "durability": "memory"}))
        await a.refresh()  # a change of settings: no journal to drain any more
        assert (later.id, new.incarnation) not in a.boards

        await Resharder(store, kept.id, say=lambda _: None, postgres_url=postgres_url).start(3)
        await a.refresh()  # a reshard: the new layout's journals are the archiver's too
        assert len(a.boards[(kept.id, board.incarnation)].also) == 3

        await store.delete(kept.id)  # a deletion
        await a.refresh()
        assert (kept.id, board.incarnation) not in a.boards
        assert await deleted_at(postgres_url, board) is not None

        await store.swap(later.id, await raw.hget(keys.BOARDS, later.id), raw_record)  # journaled again
        await a.refresh()
        assert (later.id, new.incarnation) in a.boards
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
            await db.execute("DELETE FROM boards WHERE board = %s", (later.id,))  # a restore from before
        a._known.clear()  # as ``_reconnect`` leaves it: every board recorded again at the next refresh
        reads = await registry_reads(store.client)
        await a.refresh()
        assert await registry_reads(store.client) == reads
        assert await deleted_at(postgres_url, new) is None
    finally:
        await a.db.close()
        for config in (kept, later):
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_record_written_without_moving_the_version_is_read_at_the_whole_read(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """Processes of the release before write records without moving the registry's version
    (during a rolling upgrade): the archiver reads the whole registry at least every
    ``whole_read_s`` (a minute) all the same, and a Board it holds that learnt it was deleted or
    resharded has it read at the next refresh."""
    config = BoardConfig.from_dict("followed-old", {"sharding": {"strategy": "hash", "shards": 2}})
    record = {**config.to_dict(), "incarnation": "0ld0"}
    a = await archiver(raw, store, postgres_url, whole_read_s=3600.0)
    try:
        await raw.hsetnx(keys.BOARDS, config.id, orjson.dumps(record))  # as the release before creates it
        await a.refresh()
        assert (config.id, "0ld0") not in a.boards  # the version did not move
        a.whole_read_s = 0.0
        await a.refresh()
        assert (config.id, "0ld0") in a.boards
        a.whole_read_s = 3600.0
        await raw.hdel(keys.BOARDS, config.id)  # deleted by the release before
        a.boards[(config.id, "0ld0")].deleted = True  # as a script's BOARDGONE tells a Board it holds
        await a.refresh()
        assert (config.id, "0ld0") not in a.boards
    finally:
        await a.db.close()
        with contextlib.suppress(Exception):
            await store.delete(config.id)
