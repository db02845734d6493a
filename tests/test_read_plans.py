"""The archive's reads of a board's rows beyond the archiver's round (tests/test_archive_plans.py),
planned by PostgreSQL on the statistics it has: each look-up of a row's removals goes through the
full key, and none reads a whole table or board where an index on the statement's key would do.

Two archives: many small boards and one big one analysed as they are (``even``), and the same with
the big board analysed while it was small (``grown``: a board grown since the last ANALYZE, which the
planner estimates at a row or two). Audit of 2026-12-06: on ``grown`` the rebuild's read of a shard
(``rebuild.rows_sql``: a rebuild, reconcile, the settlement's check) looked up the removals of each
row by (board, incarnation, shard) alone, every removal of the shard read again for each of its rows
(1.4 s for a shard of 5,000 rows and 1,000 removals); the rebuild's check for any archived row
read the table up to the board's first row (a sequential scan under LIMIT 1), and the end of a run
of equal points in a settled snapshot read every rank below it. The settlement's final order
(``settlement.order_sql``) hashed every board's removals on ``even``. Later that day: the reads of
one shard's results read the whole board's on ``grown``, and on ``even`` too in the plan made for
every value that a statement run over and over on one connection gets."""

from __future__ import annotations

import os
import random
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from shardlb import archive, erase, moderation, prune, rebuild, settlement, settlement_history
from shardlb.archive import connect_db
from tests.test_prune import own_db

pytestmark = pytest.mark.cluster

SMALL_BOARDS = 300
BIG_ROWS = 20_000
SHARDS = 4


async def small(db: psycopg.AsyncConnection[Any], removals: int = 3) -> None:
    """300 boards of 20 results, ``removals`` removals and a few holds, and a settled snapshot each."""
    await db.execute(
        "INSERT INTO match_results (board, incarnation, match_id, player_id, points, achieved_ms, score, "
        "shard, journal_id) SELECT 'small-' || b, 'inc-' || b, 'm' || r, 'p' || r, r, 1, r, r %% 4, "
        "'1-' || r FROM generate_series(1, %s) b, generate_series(1, 20) r",
        (SMALL_BOARDS,),
    )
    await db.execute(
        "INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, achieved_ms, "
        "score, shard, journal_id) SELECT 'small-' || b, 'inc-' || b, 'm' || r, 'p' || r, 'daily:x', r, 1, "
        "r, r %% 4, '0-' || r FROM generate_series(1, %s) b, generate_series(1, 2) r",
        (SMALL_BOARDS,),
    )
    await db.execute(
        "INSERT INTO player_removals (board, incarnation, shard, player_id, journal_id) SELECT 'small-' || "
        "b, "
        "'inc-' || b, r %% 4, 'p' || r, '1-' || (r * 2) FROM generate_series(1, %s) b, generate_series(1, "
        "%s) r",
        (SMALL_BOARDS, removals),
    )
    await db.execute(
        "INSERT INTO settlements (settlement_id, board, incarnation, period, rewards, top_n, tie_awards, "
        "state) "
        "SELECT 's-' || b, 'small-' || b, 'inc-' || b, 'total', '[]', 20, 'split', 'settled' "
        "FROM generate_series(1, %s) b",
        (SMALL_BOARDS,),
    )
    await db.execute(
        "INSERT INTO settlement_snapshots (settlement_id, rank, player_id, points, achieved_ms, score) "
        "SELECT 's-' || b, r, 'p' || r, 100 - r, 1, 100 - r FROM generate_series(1, %s) b, "
        "generate_series(1, 20) r",
        (SMALL_BOARDS,),
    )


async def big(db: psycopg.AsyncConnection[Any], first: int, last: int) -> None:
    """The big board's results ``first`` to ``last``: 1,000 players on their shard (player % 4), a
    removal of a player every 10 results, a hold every 10, and its snapshot's ranks (runs of 3)."""
    await db.execute(
        "INSERT INTO match_results (board, incarnation, match_id, player_id, points, achieved_ms, score, "
        "shard, journal_id) SELECT 'big', 'inc-big', 'm' || (r / 10), 'p' || (r %% 1000), r, r, r, "
        "(r %% 1000) %% 4, '2-' || r FROM generate_series(%s::int, %s::int) r",
        (first, last),
    )
    await db.execute(
        "INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, achieved_ms, "
        "score, "
        "shard, journal_id) SELECT 'big', 'inc-big', 'm' || (r / 10), 'p' || (r %% 1000), 'daily:x', r, r, "
        "r, "
        "(r %% 1000) %% 4, '1-' || r FROM generate_series(%s::int, %s::int, 10) r",
        (first, last),
    )
    await db.execute(
        "INSERT INTO player_removals (board, incarnation, shard, player_id, journal_id) SELECT 'big', "
        "'inc-big', "
        "(k %% 1000) %% 4, 'p' || (k %% 1000), '2-' || (k * 10 + 5) FROM generate_series(%s::int, %s::int, "
        "10) k",
        (first, last),
    )
    await db.execute(
        "INSERT INTO settlements (settlement_id, board, incarnation, period, rewards, top_n, tie_awards, "
        "state) "
        "VALUES ('s-big', 'big', 'inc-big', 'total', '[]', 100000, 'split', 'settled') ON CONFLICT DO NOTHING"
    )
    await db.execute(
        "INSERT INTO settlement_snapshots (settlement_id, rank, player_id, points, achieved_ms, score) "
        "SELECT 's-big', r, 'q' || r, 1000000 - r / 3, 1, 1000000 - r FROM generate_series(%s::int, "
        "%s::int) r",
        (first, last),
    )


async def archive_of(db: psycopg.AsyncConnection[Any], shape: str, removals: int = 3) -> None:
    """``even``: analysed as it is; ``grown``: analysed when the big board had 20 results. Each small
    board has ``removals`` removals (the big board's 2,000 are the most of the table with 3)."""
    await settlement.ensure_schema(db)
    await small(db, removals)
    if shape == "grown":
        await big(db, 1, 20)
        await db.execute("ANALYZE")
        await big(db, 21, BIG_ROWS)
    else:
        await big(db, 1, BIG_ROWS)
        await db.execute("ANALYZE")


async def plan(
    db: psycopg.AsyncConnection[Any], sql: str, params: Any, analyze: bool = False
) -> dict[str, Any]:
    cur = await db.execute(f"EXPLAIN ({'ANALYZE, ' if analyze else ''}FORMAT JSON) {sql}", params)
    row = await cur.fetchone()
    assert row is not None
    return dict(row[0][0]["Plan"])


def conditions(node: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(relation, node type, index condition) of every scan in a JSON plan."""
    found = []
    if "Relation Name" in node:
        found.append((node["Relation Name"], node["Node Type"], node.get("Index Cond", "")))
    for child in node.get("Plans", []):
        found += conditions(child)
    return found


def rows_read(node: dict[str, Any], relation: str) -> int:
    """The rows an EXPLAIN ANALYZE's scans of ``relation`` read (returned or filtered out), all loops,
    and those a Materialize of them gave again after its first loop (a nested loop over a copy)."""
    read = 0
    if node.get("Relation Name") == relation:
        got = node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        read += int(got * node.get("Actual Loops", 1))
    if node.get("Node Type") == "Materialize" and rows_read({"Plans": node.get("Plans", [])}, relation):
        read += int(node.get("Actual Rows", 0) * (node.get("Actual Loops", 1) - 1))
    for child in node.get("Plans", []):
        read += rows_read(child, relation)
    return read


BIG = ("big", "inc-big")


async def removals_read_past_the_boards(
    postgres_url: str,
    shape: str,
    lookups: dict[str, tuple[str, tuple[Any, ...]]],
    settings: str,
    removals: int = 3,
) -> dict[str, int]:
    """The statements of ``lookups`` (run as their code runs them: in a transaction, after
    ``settings``) that read more of player_removals than the big board's removals, with how many,
    on an archive of ``shape`` of a database of its own."""
    name = f"reads_{shape}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, shape, removals=removals)
            cur = await db.execute("SELECT count(*) FROM player_removals WHERE board = 'big'")
            row = await cur.fetchone()
            assert row is not None
            bad = {}
            for what, (sql, params) in lookups.items():
                async with db.transaction():
                    await db.execute(settings)
                    read = rows_read(await plan(db, sql, params, analyze=True), "player_removals")
                if read > row[0]:
                    bad[what] = read
            return bad
        finally:
            await db.close()


def removal_lookups() -> dict[str, tuple[str, tuple[Any, ...]]]:
    """The rebuild's reads of a shard, which look up each row's removals (``settlement.REMOVED_AFTER``),
    with the big board's parameters (the settlement's order: ``order_lookups``)."""
    out: dict[str, tuple[str, tuple[Any, ...]]] = {}
    for holds in (False, True):
        table = "holds" if holds else "results"
        whole = rebuild.rows_sql(holds, False, False)
        out[f"rebuild's {table} of a shard"] = (whole, (*BIG, 1))
        out[f"rebuild's {table} of a shard since"] = (
            rebuild.rows_sql(holds, True, True),
            (*BIG, 1, 2, BIG_ROWS // 2, 2, BIG_ROWS),
        )
    return out


def order_lookups() -> dict[str, tuple[str, tuple[Any, ...]]]:
    """The settlement's final order (``Settlement.final_order``) of the big board, per board mode, for
    the total and for a dated period that holds keep rows of."""
    out: dict[str, tuple[str, tuple[Any, ...]]] = {}
    for mode in ("best", "set", "incr"):
        for name, start, end in (("total", 0, 2**62), ("daily:x", 1, BIG_ROWS // 2)):
            out[f"settlement's {mode} order of {name}"] = (
                settlement.order_sql(mode),
                settlement.order_params(*BIG, start, end, name),
            )
    return out


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_the_settlements_order_reads_the_boards_removals_only(postgres_url: str, shape: str) -> None:
    """Until 2026-12-06, on ``even``, the order hashed every board's removals: the board is a
    parameter of each branch of its UNION ALL, which the planner did not carry to the NOT EXISTS."""
    # the big board's removals a tenth of the table (a sequential scan is right for most)
    bad = await removals_read_past_the_boards(
        postgres_url, shape, order_lookups(), settlement.ORDER_SETTINGS, 60
    )
    assert not bad, bad


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_the_removals_of_a_boards_rows_are_read_at_most_once(postgres_url: str, shape: str) -> None:
    # At most the board's removals, once (a hash of them) or a player's for each row (by the full
    # key): neither the shard's again for each row (a prefix), nor every board's.
    bad = await removals_read_past_the_boards(postgres_url, shape, removal_lookups(), rebuild.ROWS_SETTINGS)
    assert not bad, bad


async def test_the_check_for_an_archived_row_reads_the_boards_index(postgres_url: str) -> None:
    """The big board's rows are last in the table: a sequential scan under LIMIT 1 reads every other
    board's first."""
    name = f"reads_any_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, "even")
            found = conditions(await plan(db, rebuild.ANY_ROW, BIG))
            assert [s for s in found if s[0] == "match_results" and "Index" not in s[1]] == [], found
            node = await plan(db, rebuild.ANY_ROW, BIG, analyze=True)
            assert rows_read(node, "match_results") == 1
        finally:
            await db.close()


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_the_end_of_a_run_of_equal_points_reads_the_run(postgres_url: str, shape: str) -> None:
    """Ranks 9 to 11 of the big board's snapshot have equal points; 20,000 ranks are kept."""
    name = f"reads_run_{shape}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, shape)
            for rank, last in ((10, 11), (9, 11), (11, 11), (BIG_ROWS - 1, BIG_ROWS)):
                params = {"sid": "s-big", "rank": rank, "points": 1000000 - rank // 3}
                cur = await db.execute(settlement_history.RUN_END, params)
                assert await cur.fetchone() == (last, last != BIG_ROWS)
                node = await plan(db, settlement_history.RUN_END, params, analyze=True)
                read = rows_read(node, "settlement_snapshots")
                assert read <= 10, (rank, read)
        finally:
            await db.close()


async def test_the_bans_read_are_the_boards_and_every_boards_only(postgres_url: str) -> None:
    """With nested loops off (``ROWS_SETTINGS``, ``ORDER_SETTINGS``), the rebuild's read of a shard
    and the settlement's order hashed every ban of every board for their NOT EXISTS, and a rebuild's
    reading of the bans in force (``banned_in``, per shard) read the whole table: 300 ms, 245-265 ms
    and 55-90 ms at 1,000,000 bans of other boards (2026-12-06). Now the shard's read reads no ban
    (its callers leave banned players out, from ``banned_in``), and the others read the board's own
    bans and every board's, through ``bans_by_board``. Here 50,000 bans of 500 other boards."""
    name = f"reads_bans_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, "even")
            await db.execute(
                "INSERT INTO bans (player_id, board, reason, banned_by, incarnation) SELECT 'o' || i, "
                "'other-' || (i %% %s), '', 'test', 'inc' FROM generate_series(1, 50000) i",
                (500,),
            )
            await db.execute(
                "INSERT INTO bans (player_id, board, reason, banned_by, incarnation) SELECT 'p' || (i * 7), "
                "CASE WHEN i %% 2 = 0 THEN %s ELSE 'big' END, '', 'test', CASE WHEN i %% 2 = 0 THEN NULL "
                "ELSE 'inc-big' END FROM generate_series(1, 60) i",
                (moderation.ALL,),
            )
            await db.execute("ANALYZE bans")
            reads = {**removal_lookups(), **order_lookups()}
            in_force = f"SELECT player_id FROM bans b WHERE {moderation.BANNED_ON}"
            reads["bans in force (banned_in)"] = (in_force, BIG)
            read = {}
            for what, (sql, params) in reads.items():
                async with db.transaction():
                    await db.execute(rebuild.ROWS_SETTINGS)
                    read[what] = rows_read(await plan(db, sql, params, analyze=True), "bans")
            assert {w: n for w, n in read.items() if w.startswith("rebuild") and n} == {}
            assert {w: n for w, n in read.items() if n > 60} == {}
            cur = await db.execute(f"SELECT count(*) FROM bans b WHERE {moderation.BANNED_ON}", BIG)
            assert await cur.fetchone() == (60,)
        finally:
            await db.close()


def shard_reads() -> dict[str, tuple[str, tuple[Any, ...], str]]:
    """The reads of one shard's results (statement, the big board's shard 1, settings of the
    transaction they run in): the newest journal id archived (``Rebuilder.archived_to``), the results
    of the dedup window (``Rebuilder.refill``'s retry records), and the rebuild's read of a shard,
    whole and since a journal id."""
    shard = (*BIG, 1)
    return {
        "newest journal id archived": (rebuild.newest_sql("match_results"), shard, ""),
        "retry records": (rebuild.RECENT_ROWS, (*shard, 0), ""),
        "rebuild's read of a shard": (rebuild.rows_sql(False, False, False), shard, rebuild.ROWS_SETTINGS),
        "rebuild's read of a shard since": (
            rebuild.rows_sql(False, True, True),
            (*shard, 2, BIG_ROWS // 2, 2, BIG_ROWS),
            rebuild.ROWS_SETTINGS,
        ),
    }


async def generic_rows_read(db: psycopg.AsyncConnection[Any], sql: str, params: Any, relation: str) -> int:
    """The rows of ``relation`` read by ``sql``'s generic plan (planned without its parameters' values),
    which a statement run over and over on a connection gets: psycopg prepares it at its 5th run, and
    PostgreSQL plans it once for all values from its 6th prepared run on where that plan looks no
    dearer than those made for the values."""
    numbered = sql
    for n in range(1, len(params) + 1):
        numbered = numbered.replace("%s", f"${n}", 1)
    await db.execute(f"PREPARE generic_read AS {numbered}")
    try:
        await db.execute("SELECT set_config('plan_cache_mode', 'force_generic_plan', true)")
        values = pgsql.SQL(", ").join(pgsql.Literal(v) for v in params)
        cur = await db.execute(
            pgsql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE generic_read ({})").format(values)
        )
        row = await cur.fetchone()
        assert row is not None
        return rows_read(row[0][0]["Plan"], relation)
    finally:
        await db.execute("DEALLOCATE generic_read")


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_a_shards_reads_read_the_shards_rows_only(postgres_url: str, shape: str) -> None:
    """The big board's shard holds a quarter of its 20,000 results. Until 2026-12-06 (night), on
    ``grown`` each of these reads took the (board, incarnation) prefix of the player's index (or the
    primary key) and read all 20,000: the planner, taking board and incarnation for independent
    columns, estimated the board at under a row, and every index that names the board then cost
    the same. A rebuild of 16 shards read the board 16 times."""
    name = f"reads_shard_{shape}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, shape)
            cur = await db.execute("SELECT count(*) FROM match_results WHERE board = 'big' AND shard = 1")
            assert await cur.fetchone() == (BIG_ROWS // SHARDS,)
            read = {}
            for what, (sql, params, settings) in shard_reads().items():
                async with db.transaction():
                    if settings:
                        await db.execute(settings)
                    read[what] = rows_read(await plan(db, sql, params, analyze=True), "match_results")
                    read[f"{what}, generic"] = await generic_rows_read(db, sql, params, "match_results")
            assert {w: n for w, n in read.items() if n > BIG_ROWS // SHARDS} == {}, read
        finally:
            await db.close()


def batch_reads(
    shard_removals: int, board_holds: int, batch: int
) -> dict[str, tuple[str, tuple[Any, ...], str, int]]:
    """Statements a connection runs over and over, one shard or batch at a time, beside the shard's
    results (``shard_reads``): (statement, the big board's parameters, the relation it reads, the
    most it must read of it). The removals a rebuild reads per shard (``Rebuilder._removals``) and
    the newest of them (``archived_to``); a shard's holds (no index names the shard: the board's
    holds, few); a prune's batch of a deleted board's rows (its batch and the batch's tuples); an
    erase's batch of a player's rows on a board (the player's 20)."""
    shard = (*BIG, 1)
    removals = (
        "SELECT player_id, journal_id, kept FROM player_removals "
        "WHERE board = %s AND incarnation = %s AND shard = %s"
    )
    player = "m.board = %s AND m.incarnation = %s AND m.player_id = %s"
    erased = f"{player} AND {erase.ERASABLE} AND {erase.ARRIVED} < %s"
    return {
        "removals of a shard": (removals, shard, "player_removals", shard_removals),
        "newest removal": (rebuild.newest_sql("player_removals"), shard, "player_removals", shard_removals),
        "newest hold": (rebuild.newest_sql("match_holds"), shard, "match_holds", board_holds),
        "prune's batch of results": (
            prune.batch_statement("match_results"),
            (*BIG, batch),
            "match_results",
            2 * batch,
        ),
        "prune's batch of removals": (
            prune.batch_statement("player_removals"),
            (*BIG, batch),
            "player_removals",
            2 * batch,
        ),
        "erase's batch of results": (
            "DELETE FROM match_results WHERE ctid = ANY(ARRAY("
            f"SELECT m.ctid FROM match_results m WHERE {erased} LIMIT %s))",
            (*BIG, "p7", 2**62, batch),
            "match_results",
            BIG_ROWS // 1000,
        ),
    }


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_per_shard_and_per_batch_statements_read_no_more_in_the_generic_plan(
    postgres_url: str, shape: str
) -> None:
    """Each statement's plan made for every value (``generic_rows_read``) reads what it must, as the
    plan made for its values does (2026-12-06: no statement of the archiver, a rebuild, a prune or
    an erase read more in it; docs/design-notes.md)."""
    name = f"reads_batch_{shape}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, shape)
            cur = await db.execute(
                "SELECT (SELECT count(*) FROM player_removals WHERE board = 'big' AND shard = 1), "
                "(SELECT count(*) FROM match_holds WHERE board = 'big')"
            )
            counts = await cur.fetchone()
            assert counts is not None
            read = {}
            for what, (sql, params, relation, most) in batch_reads(*counts, batch=1000).items():
                async with db.transaction(force_rollback=True):
                    found = await generic_rows_read(db, sql, params, relation)
                if found > most:
                    read[what] = (found, most)
            assert read == {}
        finally:
            await db.close()


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_a_prunes_batch_reads_its_batch(postgres_url: str, shape: str) -> None:
    """A prune's batch of a deleted board's rows reads the batch, whatever the statistics say: on a
    board grown since the last ANALYZE the plan made for its values took another index and sorted
    the whole board for each batch (21,000 rows for a batch of 1,000 on main at a752fe4), so a
    prune of a board of n rows read n²/batch."""
    name = f"reads_prune_{shape}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, shape)
            read = {}
            for table in ("match_results", "player_removals"):
                async with db.transaction(force_rollback=True):
                    await db.execute(prune.BATCH_SETTINGS)
                    found = rows_read(
                        await plan(db, prune.batch_statement(table), (*BIG, 1000), analyze=True), table
                    )
                read[table] = found
            assert {t: n for t, n in read.items() if n > 2 * 1000} == {}, read
        finally:
            await db.close()


@pytest.mark.parametrize("shape", ["even", "grown"])
async def test_the_check_for_a_shards_archived_rows_reads_a_few(postgres_url: str, shape: str) -> None:
    """``archive.SHARD_ARCHIVED`` (the archiver's look before it writes a missing sentinel again):
    on the big board's shard 1 (rows) and a shard of it without any (7), each table is read
    through an index and no further than a few rows past what it answers. Without
    SHARD_ARCHIVED_SETTINGS (``even``, shard 1) every EXISTS was a sequential scan, the one on
    ``match_results`` reading 6,001 rows; with ``match_holds`` in it, every hold of the board
    (2,000) was read for shard 7."""
    name = f"reads_shard_any_{shape}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await archive_of(db, shape)
            for shard, want in ((1, True), (7, False)):
                params = {"board": BIG[0], "incarnation": BIG[1], "shard": shard}
                async with db.transaction():
                    await db.execute(archive.SHARD_ARCHIVED_SETTINGS)
                    cur = await db.execute(archive.SHARD_ARCHIVED, params)
                    assert await cur.fetchone() == (want,)
                    node = await plan(db, archive.SHARD_ARCHIVED, params, analyze=True)
                found = conditions(node)
                assert [s for s in found if "Index" not in s[1]] == [], found
                tables = ("match_results", "player_removals", "removal_records")
                read = {t: rows_read(node, t) for t in tables}
                assert all(n <= 50 for n in read.values()), (shard, read)
        finally:
            await db.close()
