"""The archiver's look-ups of archived rows by their (match, player) key, planned by PostgreSQL on the
statistics it has: they must go through an index on that key, never through every row of the board.

The planner estimates a board's rows from averages (rows over distinct values; a board that grew
since the last ANALYZE, or one big board among many small ones, looks small). Until 2026-12-06 the
index of a shard's rows was (board, incarnation, shard), and on such estimates its (board,
incarnation) prefix looked as good as the primary key and was smaller: each incoming row of a batch
then read every archived row of its board (one archive statement took a minute on a board of 5,000
rows in the suite's database; on a season's board of millions, the archiver would fall behind for
good). That index now leads with the shard (`match_results_on_shard`). The round's check of its
journals' marks (``_GAPS``) reads theirs by the key, not the whole of journal_marks."""

from __future__ import annotations

import itertools
import os
import random
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from shardlb import archive
from shardlb.archive import connect_db
from tests.test_prune import own_db
from tests.test_read_plans import archive_of, generic_rows_read, rows_read

pytestmark = pytest.mark.cluster

BIG_ROWS = 20_000
SMALL_BOARDS = 300

# The statements of an archive round that find the archived row of an incoming (match, player), with
# the board lists they take: ``_KEEP_LATER``'s look-up of the rows a batch lost, the time holds'
# look-up of other times (``_OTHER_TIMES``), and the period holds before the upsert.
OLD_INDEX = "CREATE INDEX match_results_by_shard ON match_results (board, incarnation, shard)"
# The key's index (board, incarnation, match_id, player_id), its partial twin, or the player's rows on
# the board (board, incarnation, player_id, achieved_ms), which the planner takes on some estimates:
# bounded by the player's results on the board, never the board's.
KEY_INDEXES = ("match_results_pkey", "match_results_skipping", "match_results_by_player")
STATEMENTS = {
    "losers, held": archive._KEEP_LATER["held"],
    "losers, incr": archive._KEEP_LATER["incr"],
    "other times": archive._OTHER_TIMES,
    "holds": archive._HOLD,
    "earlier holds": archive._HOLD_EARLIER,
}


def scans(plan: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(node type, relation, index) of every scan in a JSON plan."""
    found = []
    if "Relation Name" in plan or "Index Name" in plan:
        found.append((plan["Node Type"], plan.get("Relation Name", ""), plan.get("Index Name", "")))
    for child in plan.get("Plans", []):
        found += scans(child)
    return found


async def filled(db: psycopg.AsyncConnection[Any]) -> None:
    """An archive of many small boards and one big one, as the planner sees it after ANALYZE."""
    await db.execute(
        "INSERT INTO match_results (board, incarnation, match_id, player_id, points, achieved_ms, score, "
        "shard, journal_id) SELECT 'small-' || b, 'inc-' || b, 'm' || r, 'p' || r, r, 1, r, r %% 3, "
        "'1-' || r FROM generate_series(1, %s) b, generate_series(1, 20) r",
        (SMALL_BOARDS,),
    )
    await db.execute(
        "INSERT INTO match_results (board, incarnation, match_id, player_id, points, achieved_ms, score, "
        "shard, journal_id) SELECT 'big', 'inc-big', 'm' || (r / 10), 'p' || (r %% 1000), r, 1, r, r %% 3, "
        "'2-' || r FROM generate_series(1, %s) r",
        (BIG_ROWS,),
    )
    await db.execute("ANALYZE")


async def explained(db: psycopg.AsyncConnection[Any], sql: str, params: Any, generic: bool) -> dict[str, Any]:
    """The JSON plan of ``sql``: made for ``params``, or with ``generic`` the plan made once for every
    value, which a statement run over and over on one connection may get (psycopg prepares it at its
    5th run; tests/test_read_plans.py, ``generic_rows_read``). Inside a transaction."""
    if not generic:
        cur = await db.execute(f"EXPLAIN (FORMAT JSON) {sql}", params)
    else:
        numbered = sql
        for n in range(1, len(params) + 1):
            numbered = numbered.replace("%s", f"${n}", 1)
        await db.execute(f"PREPARE generic_plan AS {numbered}")
        await db.execute("SELECT set_config('plan_cache_mode', 'force_generic_plan', true)")
        values = pgsql.SQL(", ").join(pgsql.Literal(v) for v in params)
        cur = await db.execute(pgsql.SQL("EXPLAIN (FORMAT JSON) EXECUTE generic_plan ({})").format(values))
    row = await cur.fetchone()
    if generic:
        await db.execute("DEALLOCATE generic_plan")
        await db.execute("SELECT set_config('plan_cache_mode', 'auto', true)")
    assert row is not None
    return dict(row[0][0]["Plan"])


@pytest.mark.parametrize("shape", ["analysed", "even", "grown"])
async def test_a_batchs_lookups_of_archived_rows_never_read_the_whole_board(
    postgres_url: str, shape: str
) -> None:
    """``analysed``: this module's archive; ``even`` and ``grown``: tests/test_read_plans.py's (the
    big board analysed as it is, or while it was small)."""
    name = f"plans_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            if shape == "analysed":
                await filled(db)
            else:
                await archive_of(db, shape)
            async with db.transaction(force_rollback=True):
                await db.execute("CREATE TEMP TABLE incoming (LIKE match_results INCLUDING DEFAULTS)")
                await db.execute(
                    "INSERT INTO incoming SELECT board, incarnation, match_id, player_id, points + 1, 2, "
                    "score + 1, shard, '3-' || points, archived_at, '{daily:x}' FROM match_results "
                    "WHERE board = 'big' LIMIT 500"
                )
                bad = {}
                for (what, sql), generic in itertools.product(STATEMENTS.items(), (False, True)):
                    found = scans(await explained(db, sql, (["big"], ["inc-big"]), generic))
                    # every scan of match_results, by the key's index or the player's
                    wrong = [
                        s
                        for s in found
                        if (s[1] == "match_results" or s[2].startswith("match_results"))
                        and s[2] not in KEY_INDEXES
                    ]
                    if wrong:
                        bad[f"{what}{', generic' if generic else ''}"] = wrong
                assert not bad, bad
        finally:
            await db.close()


async def indexes_after_a_connect(url: str) -> set[str]:
    """The indexes of match_results once a process of this release has connected (its set-up)."""
    db = await connect_db(url)
    try:
        cur = await db.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'match_results'")
        return {row[0] for row in await cur.fetchall()}
    finally:
        await db.close()


async def test_the_set_up_replaces_the_index_that_led_with_the_board(postgres_url: str) -> None:
    """An archive set up by a release before 2026-12-06 has `match_results_by_shard`: the next
    set-up builds `match_results_on_shard` and drops it (README, "Upgrading an install", 14)."""
    name = f"plans_up_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await db.execute("DROP INDEX match_results_on_shard")
            await db.execute(OLD_INDEX)
            await db.execute("DELETE FROM schema_applied")  # as a database of the release before
            await db.commit()
        finally:
            await db.close()
        names = await indexes_after_a_connect(url)
        assert "match_results_on_shard" in names and "match_results_by_shard" not in names, names


async def test_the_old_index_built_again_by_an_older_release_is_dropped_at_the_next_connect(
    postgres_url: str,
) -> None:
    """A process of the release before whose schema digest this database has not applied yet (an old
    router's first history request or settlement during the roll-out, after a new archiver's set-up)
    runs the old DDL: `match_results_by_shard` is built again, and the new digests, applied already,
    would never drop it. Beside `match_results_on_shard` the planner takes it again for the archiver's
    look-ups (every row of the board for each result of a batch). The next set-up of this release
    drops it."""
    name = f"plans_old_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)  # this release's schema, applied
        try:
            # as the old release's first set-up does: its DDL, then its own digest recorded
            await db.execute(OLD_INDEX)
            await db.execute("INSERT INTO schema_applied (digest) VALUES ('a digest of the release before')")
        finally:
            await db.close()
        names = await indexes_after_a_connect(url)
        assert "match_results_on_shard" in names and "match_results_by_shard" not in names, names


@pytest.mark.parametrize(("boards", "passed"), [(301, 4), (5_000, 100)])
async def test_a_rounds_gap_check_reads_the_marks_of_its_journals(
    postgres_url: str, boards: int, passed: int
) -> None:
    """``_GAPS`` (every round that writes, and the idle journals' check) reads the marks of the
    journals it is given, by the key, among those of every board's 4 shards. Until 2026-12-06 it
    joined them to the whole table: a sequential scan of journal_marks for 4 journals of 1,204, or
    100 of 20,000."""
    name = f"plans_gaps_{passed}_{os.getpid()}_{random.randrange(10**6)}"
    async with own_db(postgres_url, name) as url:
        db = await connect_db(url)
        try:
            await db.execute(
                "INSERT INTO journal_marks (journal, board, incarnation, archived_to) "
                "SELECT 'j:b' || b || ':' || s, 'b' || b, 'inc', '5-' || b "
                "FROM generate_series(1, %s) b, generate_series(0, 3) s",
                (boards,),
            )
            await db.execute("ANALYZE")
            await db.commit()
            # the journals of the first boards, and one never marked (of board 0); every other one
            # trimmed past its mark (5-<board>), the others up to it
            journals = [f"j:b{1 + i // 4}:{i % 4}" for i in range(passed - 1)] + ["j:b0:0"]
            owners = [j.split(":")[1] for j in journals]
            trimmed = [f"{14 if i % 2 else 5}-{owners[i][1:]}" for i in range(passed)]
            params = (journals, owners, ["inc"] * passed, [int(j[-1]) for j in journals], trimmed)
            async with db.transaction(force_rollback=True):
                cur = await db.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {archive._GAPS}", params)
                row = await cur.fetchone()
                assert row is not None
                read = rows_read(row[0][0]["Plan"], "journal_marks")
            assert read <= passed, (read, scans(row[0][0]["Plan"]))
            async with db.transaction(force_rollback=True):  # in the plan made for every value
                generic = await generic_rows_read(db, archive._GAPS, params, "journal_marks")
            assert generic <= passed, generic
            async with db.transaction(force_rollback=True):
                cur = await db.execute(archive._GAPS, params)
                found = sorted(await cur.fetchall())
            assert found == sorted(
                (journals[i], owners[i], f"5-{owners[i][1:]}", trimmed[i]) for i in range(passed - 1) if i % 2
            )
        finally:
            await db.close()
