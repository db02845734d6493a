"""A board rebuilt after its journals were lost (a total loss of Redis and `rebuild --all`, or one
board's shards lost and `rebuild <board>`) gets journals whose next ids are past every id PostgreSQL
holds of it. PostgreSQL orders a board's rows by journal id (a result journaled before a removal of
its player on its shard counts nowhere; an incr rebuild takes the rows up to the journal's
position), and a new journal's ids come from the new node's clock. Where the lost nodes' clocks were
ahead (skew, a clock stepped back, a restore onto machines whose clocks lag), the rebuild gave a
result posted after the restore an id before an archived removal of its player, and the next rebuild
dropped it; and an incr board came back without the results archived with ids past the new clock.

The old nodes' clock ahead is made here with XSETID: the entries journaled after it get ids a day
past Redis's clock, as a node a day ahead would have given them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import psycopg
import pytest

from shardlb import keys, moderation, times
from shardlb.archive import Archiver
from shardlb.board import MAX_FUTURE_MS, Board, Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.rebuild import parse_id
from shardlb.store import BoardStore
from tests.test_board import sharding
from tests.test_rebuild import archiver, drain, own_archive

pytestmark = pytest.mark.cluster

DAY_MS = 86_400_000


async def clocks_ahead(raw: Any, board: Board, by_ms: int = DAY_MS) -> None:
    """Every journal of the board's home shards gives its next entries ids ``by_ms`` past Redis's
    clock: what nodes whose clocks are that far ahead would give them."""
    at = times.now_ms() + by_ms
    for prefix in board.prefixes[: board.config.sharding.shards]:
        key = keys.journal_key(prefix)
        if await raw.exists(key):
            await raw.execute_command("XSETID", key, f"{at}-0")


async def lose_shards(raw: Any, board: Board) -> None:
    """A PARTIAL loss of Redis: every key of the board's shards is gone, their sentinels
    (``<prefix>here``) included (their nodes lost their data), while the registry's record of it,
    on a node kept, stays (a 2-shard board's shards are on the first and last masters, the
    registry's slot on the middle one). Until 2026-12-06 the sentinels were left, which the loss
    takes: writes to the lost shards were then taken before the rebuild."""
    for prefix in board.prefixes:
        names = await raw.zrange(keys.index_key(prefix), 0, -1)
        await raw.delete(keys.index_key(prefix), keys.sentinel_key(prefix), *names)
        assert not await raw.exists(keys.journal_key(prefix))


async def newest_ids(url: str, board: Board, shard: int) -> list[tuple[int, int]]:
    """Every journal id PostgreSQL holds of the board's home ``shard``, its archiver's marks of the
    shard's journal too."""
    ident = (board.config.id, board.incarnation, shard)
    found: list[tuple[int, int]] = []
    async with await psycopg.AsyncConnection.connect(url) as db:
        for table in ("match_results", "player_removals", "removal_records"):
            sql = f"SELECT journal_id FROM {table} WHERE board = %s AND incarnation = %s AND shard = %s"
            found += [parse_id(row[0]) for row in await (await db.execute(sql, ident)).fetchall()]
        journal = keys.journal_key(board.prefixes[shard])
        cur = await db.execute("SELECT archived_to FROM journal_marks WHERE journal = %s", (journal,))
        found += [parse_id(row[0]) for row in await cur.fetchall()]
    return found


async def journals_past(raw: Any, url: str, board: Board) -> None:
    """Each home shard's journal has its last id at or past every id PostgreSQL holds of the shard
    (its next ids past them), and no entry counted as added and trimmed that was never written (the
    archive checks compare those)."""
    for shard, prefix in enumerate(board.prefixes[: board.config.sharding.shards]):
        held = await newest_ids(url, board, shard)
        if not held:
            continue
        assert await raw.exists(keys.journal_key(prefix)), prefix
        info = await raw.xinfo_stream(keys.journal_key(prefix))
        assert parse_id(info["last-generated-id"]) >= max(held), prefix
        assert info["max-deleted-entry-id"] in (b"0-0", "0-0")
        assert info["entries-added"] == info["length"]


async def archived_again(a: Archiver) -> None:
    """Every entry of the journals made again archived: the archiver's first round after the loss
    finds its group of each gone (NOGROUP), and the next makes it again."""
    await a.refresh()
    for _ in range(2):
        await drain(a)
    assert not any(lag.entries for lag in (await a.lag()).values())


@pytest.mark.parametrize("lost", ["all", "board"])
@pytest.mark.parametrize("strategy", ["hash", "band"])
async def test_a_result_posted_after_a_rebuild_counts_after_a_removal_archived_ahead_of_the_clock(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, strategy: str, lost: str
) -> None:
    """ "cheat" was removed at an id a day ahead of the new nodes' clock. After the loss and the
    rebuild, cheat posts again: Redis counts it; PostgreSQL must too (its id after the removal's),
    or the next rebuild drops it."""
    config = BoardConfig.from_dict(f"ids-removed-{strategy}-{lost}", {"sharding": sharding(strategy, 2)})
    board, _ = await store.create(config)
    now = times.now_ms()
    posts = [Score("cheat", 90, "m1", now - 60_000), Score("fair", 40, "m2", now - 60_000)]
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url)
        try:
            await board.submit(posts)
            await drain(a)
            await clocks_ahead(raw, board)
            assert await moderation.remove(board, ["cheat"]) == {"cheat"}
            await drain(a)
            if lost == "all":
                await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
                command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            else:
                await lose_shards(raw, board)
                command = ["rebuild", config.id, "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            rebuilt = await store.get(config.id)
            assert [e.player_id for e in await rebuilt.top(10)] == ["fair"]
            later = times.now_ms() + MAX_FUTURE_MS + 2_000  # achieved after the removal's record
            [posted] = await rebuilt.submit([Score("cheat", 3, "m-again", later)], later)
            assert posted.status == "improved"
            want = [("fair", 40), ("cheat", 3)]
            assert [(e.player_id, e.points) for e in await rebuilt.top(10)] == want
            await archived_again(a)
            again = ["rebuild", config.id, "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, again) == 0
            assert [(e.player_id, e.points) for e in await rebuilt.top(10)] == want
            async with await psycopg.AsyncConnection.connect(archive_url) as db:
                cur = await db.execute(
                    "SELECT (SELECT journal_id FROM match_results WHERE board = %s AND match_id = %s), "
                    "(SELECT journal_id FROM player_removals WHERE board = %s)",
                    (config.id, "m-again", config.id),
                )
                posted, removed = await cur.fetchone() or ("", "")
            assert parse_id(posted) > parse_id(removed)
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_an_incr_board_comes_back_with_the_results_archived_ahead_of_the_clock(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """An incr rebuild takes the rows up to the journal's position, which for a journal lost was
    the new node's clock: the rows archived with ids past it were left out."""
    config = BoardConfig.from_dict("ids-incr", {"mode": "incr", "sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    now = times.now_ms()
    players = [f"p{i}" for i in range(8)]
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url)
        try:
            await board.submit([Score(p, 10, f"m-{p}", now - 60_000) for p in players])
            await clocks_ahead(raw, board)
            await board.submit([Score(p, 5, f"n-{p}", now - 30_000) for p in players])
            await drain(a)
            before = await board.scores(players)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            rebuilt = await store.get(config.id)
            assert await rebuilt.scores(players) == before
            assert {e.points for e in await rebuilt.top(10)} == {15}
            await journals_past(raw, archive_url, rebuilt)
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_journal_made_again_before_the_rebuild_keeps_its_entries(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The board's shards were lost, the registry kept it, and results were posted before the
    rebuild: their journal, made again by write.lua, holds them unarchived. The rebuild moves its
    next ids past the archive's (XSETID) and trims nothing: they are archived after it. Only a
    board of the release before (no sentinels: its record says none) takes those writes: the
    sentinels went with the shards, and write.lua refuses a board's write where its sentinel is
    missing (503 ``board_rebuilding``; tests/test_shard_loss.py)."""
    config = BoardConfig.from_dict("ids-kept-entries", {"sharding": sharding("hash", 2)})
    await store.create(config)
    raw_record = await raw.hget(keys.BOARDS, config.id)
    before_sentinels = {k: v for k, v in orjson.loads(raw_record).items() if k != "state"}
    assert await store.swap(config.id, raw_record, orjson.dumps(before_sentinels))
    board = await store.get(config.id)
    assert not board.sentinels
    now = times.now_ms()
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url)
        try:
            await board.submit([Score(f"p{i}", i, f"m{i}", now - 60_000) for i in range(8)])
            await clocks_ahead(raw, board)
            await board.submit([Score(f"p{i}", 10 + i, f"n{i}", now - 60_000) for i in range(8)])
            await drain(a)
            await lose_shards(raw, board)
            since = [Score(f"q{i}", 50 + i, f"s{i}", times.now_ms()) for i in range(8)]
            await board.submit(since)
            journals = [keys.journal_key(p) for p in board.prefixes[:2]]
            lengths = [await raw.xlen(k) for k in journals]
            assert sum(lengths) > 0
            command = ["rebuild", config.id, "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            assert [await raw.xlen(k) for k in journals] == lengths
            for shard, k in enumerate(journals):
                info = await raw.xinfo_stream(k)
                assert parse_id(info["last-generated-id"]) >= max(await newest_ids(archive_url, board, shard))
                assert info["entries-added"] == info["length"]
            want = sorted([(f"q{i}", 50 + i) for i in range(8)] + [(f"p{i}", 10 + i) for i in range(8)])
            assert sorted((e.player_id, e.points) for e in await board.top(100)) == want
            await archived_again(a)
            assert await asyncio.to_thread(main, command) == 0
            assert sorted((e.player_id, e.points) for e in await board.top(100)) == want
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_after_a_restore_the_archiver_still_notices_a_postgresql_restored_from_a_backup(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The archiver records a gap when a journal trimmed entries past its mark in PostgreSQL
    (``journal_marks``: a database restored from a backup lacks what was acknowledged since). The
    mark was a day past the journal made again after the restore: its trims never reached it, and a
    PostgreSQL that lost the results posted since went unnoticed."""
    config = BoardConfig.from_dict("ids-gaps", {"sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    now = times.now_ms()
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url)
        try:
            await board.submit([Score("p1", 10, "m1", now - 60_000)])
            await clocks_ahead(raw, board)
            await board.submit([Score("p2", 20, "m2", now - 60_000)])
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as db:
                sql = "SELECT journal, archived_to FROM journal_marks WHERE board = %s"
                cur = await db.execute(sql, (config.id,))
                backup = await cur.fetchall()  # the marks of a backup taken now
                await board.submit([Score("p3", 30, "m3", times.now_ms() - 1000)])
                await archived_again(a)
                # PostgreSQL restored from that backup: p3's row and the mark past it are gone
                sql = "DELETE FROM match_results WHERE board = %s AND player_id = %s"
                await db.execute(sql, (config.id, "p3"))
                for journal, archived_to in backup:
                    sql = "UPDATE journal_marks SET archived_to = %s WHERE journal = %s"
                    await db.execute(sql, (archived_to, journal))
                await board.submit([Score("p4", 40, "m4", times.now_ms() - 1000)])
                await drain(a)
                cur = await db.execute("SELECT count(*) FROM archive_gaps WHERE board = %s", (config.id,))
                assert (await cur.fetchone() or (0,))[0] == 1
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)
