"""The archive's prune (shardlb/prune.py) against the suite's cluster and a PostgreSQL database of
each test's own: it removes the rows of board incarnations deleted longer ago than the grace, in
bounded batches, and never a row that a live board's rebuild, reconcile, settlement or history reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from shardlb import moderation, prune, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.connection import Scripts
from shardlb.errors import BoardNotFound
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import reconcile
from shardlb.settlement import Request, Settler, archive_season, ensure_schema, period_bounds
from shardlb.settlement_history import player_history
from shardlb.store import BoardStore
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board, written

pytestmark = pytest.mark.cluster

TABLES = ("match_results", "match_holds", "match_later", "player_removals", "removal_records")


@contextlib.asynccontextmanager
async def own_db(postgres_url: str, name: str) -> AsyncIterator[str]:
    """A database of the test's own, dropped after it: a prune there sees this test's boards only,
    and removes no deleted board's rows that another module's test still looks at."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name}")
    try:
        yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def archived(raw: Any, store: BoardStore, db: psycopg.AsyncConnection[Any]) -> None:
    """Every journal drained, and the boards deleted since marked so (the archiver's refresh)."""
    a = Archiver(raw, store, db, "prune-tests", claim_idle_s=0)
    await a.refresh()
    while await a.round():
        pass
    await a.refresh()


async def rows_of(
    db: psycopg.AsyncConnection[Any], board: str, incarnation: str, tables: tuple[str, ...] = TABLES
) -> dict[str, list[Any]]:
    out = {}
    for table in tables:
        cur = await db.execute(
            f"SELECT * FROM {table} WHERE board = %s AND incarnation = %s ORDER BY 1, 2, 3, 4",
            (board, incarnation),
        )
        out[table] = [tuple(row) for row in await cur.fetchall()]
    return out


async def late_retry(board: Board, ref: Any, period: str, seed: str) -> None:
    """A result of the closed day sent again with more points after the close: the day keeps the
    first (a row of ``match_holds``), the total takes the second; then the first sent again, which
    the board leaves as it was (a row of ``match_later``: a later application the row did not take)."""
    start, end = period_bounds(board, board.resolve(period).period)
    first, again = (Score("p003", points, f"{seed}-late", start + 1000) for points in (1, 49))
    for score, now in ((first, end - 1), (again, times.now_ms()), (first, times.now_ms())):
        await board.submit([score], now_ms=now)
        ref.submit([score], now_ms=now)


async def test_a_prune_removes_a_deleted_board_and_no_row_a_live_board_reads(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The deleted board's results, holds, removals and records go, past the grace; its ``boards``
    row stays (the mark `rebuild --all` reads); the live board's rows are the same, and its rebuild,
    reconcile, settlement of a closed day and history read answer as before the prune."""
    async with own_db(postgres_url, "prune_live") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        gone = await new_board(store, "prune-gone")
        live = await new_board(store, "prune-live")
        period = day_ago(2)
        try:
            await late_retry(gone, await written(gone, period, "gone"), period, "gone")
            await moderation.remove(gone, ["p001"])
            ref = await written(live, period, "live")
            await late_retry(live, ref, period, "live")
            await moderation.remove(live, ["p001"])
            await archived(raw, store, db)
            before = await rows_of(db, live.config.id, live.incarnation)
            history = await player_history(db, live, "p002", 100)
            assert all(before.values())  # results, a hold, a removal and its record
            assert all((await rows_of(db, gone.config.id, gone.incarnation)).values())
            marks = ("journal_marks",)
            live_marks = await rows_of(db, live.config.id, live.incarnation, marks)
            live_ident = (live.config.id, live.incarnation)
            assert all((await rows_of(db, gone.config.id, gone.incarnation, marks)).values())
            await db.execute(  # a gap of each board, as the archiver records one (shardlb/archive.py)
                "INSERT INTO archive_gaps (journal, board, incarnation, shard, archived_to, trimmed_to) "
                "VALUES (%s, %s, %s, 0, '1-0', '2-0'), (%s, %s, %s, 0, '1-0', '2-0')",
                ("gone-journal", gone.config.id, gone.incarnation, "live-journal", *live_ident),
            )
            await store.delete(gone.config.id)
            await archived(raw, store, db)

            report = await prune.prune(db, store.client, grace_s=0)

            assert report.done and report.rows[(gone.config.id, gone.incarnation)] > 0
            assert not any((await rows_of(db, gone.config.id, gone.incarnation)).values())
            # the archiver's bookkeeping of the deleted incarnation's journals goes too, not the live one's
            bookkeeping = ("journal_marks", "archive_gaps")
            assert not any((await rows_of(db, gone.config.id, gone.incarnation, bookkeeping)).values())
            assert await rows_of(db, live.config.id, live.incarnation, marks) == live_marks
            live_gaps = await rows_of(db, live.config.id, live.incarnation, ("archive_gaps",))
            assert len(live_gaps["archive_gaps"]) == 1
            await db.execute("DELETE FROM archive_gaps WHERE journal = 'live-journal'")
            cur = await db.execute("SELECT deleted_at IS NOT NULL FROM boards WHERE board = 'prune-gone'")
            assert await cur.fetchall() == [(True,)]
            assert await rows_of(db, live.config.id, live.incarnation) == before
            assert await player_history(db, live, "p002", 100) == history
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
            before_top = await live.top(1000)
            await rebuilder.rebuild(live)
            assert await live.top(1000) == before_top
            assert not any(c.drift for c in await reconcile(rebuilder, live, "total"))
            request = Request.of({"settlement_id": "prune-live-1", "rewards": TABLE, "top_n": 7})
            result = await Settler(rebuilder).settle(live, period, request)
            assert result["check"]["drifting"] == []
            ref.remove("p001")
            assert await awards_of(db, "prune-live-1") == expected_awards(ref, period, live)
        finally:
            await db.close()
            for board in (gone, live):
                with contextlib.suppress(BoardNotFound):
                    await store.delete(board.config.id)


async def test_a_prune_waits_for_the_grace_and_leaves_a_board_the_registry_holds(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A deletion younger than the grace is kept. An incarnation PostgreSQL holds deleted while the
    registry holds it (an incarnation drawn again for a board created again under the id, or a mark
    set by hand) is a live board: kept whatever its mark says, and it rebuilds whole."""
    async with own_db(postgres_url, "prune_grace") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        gone = await new_board(store, "prune-grace-gone")
        marked = await new_board(store, "prune-grace-marked")
        try:
            for board in (gone, marked):
                await written(board, day_ago(2), board.config.id)
            await archived(raw, store, db)
            await store.delete(gone.config.id)
            await archived(raw, store, db)
            await db.execute(
                "UPDATE boards SET deleted_at = now() - interval '2 hours' WHERE board IN (%s, %s)",
                (gone.config.id, marked.config.id),
            )
            kept = {b.config.id: await rows_of(db, b.config.id, b.incarnation) for b in (gone, marked)}

            report = await prune.prune(db, store.client, grace_s=3 * 3600)
            assert report.rows == {} and report.done
            assert kept[gone.config.id] == await rows_of(db, gone.config.id, gone.incarnation)

            report = await prune.prune(db, store.client, grace_s=3600)
            assert set(report.rows) == {(gone.config.id, gone.incarnation)} and report.done
            assert await rows_of(db, marked.config.id, marked.incarnation) == kept[marked.config.id]
            top = await marked.top(1000)
            await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(marked)
            assert await marked.top(1000) == top
        finally:
            await db.close()
            for board in (gone, marked):
                with contextlib.suppress(BoardNotFound):
                    await store.delete(board.config.id)


async def test_a_prune_is_bounded_per_call_and_converges_when_run_again(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """Each call removes at most ``limit`` rows, ``batch`` rows a transaction, and says whether rows
    are left; called again it goes on where it stopped (a call cut off mid-way too), and a call after
    the last removes nothing."""
    async with own_db(postgres_url, "prune_bounded") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        gone = await new_board(store, "prune-bounded")
        try:
            await written(gone, day_ago(2), "bounded")
            await moderation.remove(gone, ["p001", "p002"])
            await archived(raw, store, db)
            total = sum(map(len, (await rows_of(db, gone.config.id, gone.incarnation)).values()))
            await store.delete(gone.config.id)
            await archived(raw, store, db)

            removed, calls = 0, 0
            while True:
                report = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20)
                calls += 1
                got = sum(report.rows.values())
                assert got <= 20
                removed += got
                left = sum(map(len, (await rows_of(db, gone.config.id, gone.incarnation)).values()))
                assert removed + left == total
                if report.done:
                    break
                assert got == 20
            assert left == 0 and calls >= total // 20
            again = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20)
            assert again.rows == {} and again.done
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(gone.config.id)


async def test_a_board_created_again_and_a_season_archived_keep_what_they_read_after_a_prune(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The old incarnation of an id created again is pruned, the new one settles and rebuilds from
    its own rows; a season archived (settled, then deleted) is pruned, and its archive run again
    answers its stored result, its snapshot and awards untouched."""
    async with own_db(postgres_url, "prune_again") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        name = "prune-again"
        old = await new_board(store, name)
        season = await new_board(store, "prune-season")
        period = day_ago(2)
        try:
            await written(old, period, "old")
            await written(season, period, "season")
            await archived(raw, store, db)
            request = Request.of({"settlement_id": "prune-season-1", "rewards": TABLE})
            first = await archive_season(cluster_url, url, season.config.id, request)
            await store.delete(name)
            again = await new_board(store, name)
            ref = await written(again, period, "again")
            await archived(raw, store, db)
            awards = await awards_of(db, "prune-season-1")
            assert awards

            report = await prune.prune(db, store.client, grace_s=0)

            assert set(report.rows) == {(name, old.incarnation), (season.config.id, season.incarnation)}
            assert (await archive_season(cluster_url, url, season.config.id, request)) == first
            assert await awards_of(db, "prune-season-1") == awards
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
            top = await again.top(1000)
            await rebuilder.rebuild(again)
            assert await again.top(1000) == top
            result = await Settler(rebuilder).settle(
                again, period, Request.of({"settlement_id": "prune-again-1", "rewards": TABLE})
            )
            assert result["check"]["drifting"] == []
            assert await awards_of(db, "prune-again-1") == expected_awards(ref, period, again)
        finally:
            await db.close()
            for board_id in (name, "prune-season"):
                with contextlib.suppress(BoardNotFound):
                    await store.delete(board_id)


async def test_the_prune_command(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb prune` prunes and says what, and names what the grace still keeps; a bad --grace or
    --batch is a usage error (2)."""
    async with own_db(postgres_url, "prune_command") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        gone = await new_board(store, "prune-command")
        try:
            await written(gone, day_ago(2), "command")
            await archived(raw, store, db)
            await store.delete(gone.config.id)
            await archived(raw, store, db)
            kept = await rows_of(db, gone.config.id, gone.incarnation)
            capsys.readouterr()
            command = ["prune", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0  # the default grace: 7 days
            said = capsys.readouterr().out
            assert "1 deleted board incarnation is within the grace" in said, said
            assert await rows_of(db, gone.config.id, gone.incarnation) == kept
            assert await asyncio.to_thread(main, [*command, "--grace", "0"]) == 0
            said = capsys.readouterr().out
            assert "rows removed" in said and "nothing left to prune" in said and "within" not in said, said
            assert not any((await rows_of(db, gone.config.id, gone.incarnation)).values())
            # Within the grace again, but nothing of it left: not "pruned later" (until 2026-12-06 it
            # was counted, its rows gone with --grace 0).
            assert await asyncio.to_thread(main, command) == 0
            said = capsys.readouterr().out
            assert "within" not in said and "nothing left to prune" in said, said
            for bad in (["--grace", "-1"], ["--batch", "0"], ["--limit", "0"]):
                with pytest.raises(SystemExit) as e:
                    main(["prune", "--redis", cluster_url, "--postgres", url, *bad])
                assert e.value.code == 2
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(gone.config.id)


async def test_a_batch_reads_the_index_even_when_the_statistics_say_half_the_table_is_the_board(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A batch found its rows with ``LIMIT`` alone: on statistics that said the incarnation held many
    rows (taken before a prune removed them, until autovacuum's next ANALYZE) the planner read the
    table from its start to find them, and found none: every call then read all of match_results,
    billions of live rows, once per deleted incarnation. Ordered by the primary key, the batch reads
    the index (measured on 600,000 rows: a sequential scan of all of them before)."""
    async with own_db(postgres_url, "prune_plan") as url:
        db = await connect_db(url)
        try:
            rows = ", ".join(
                f"('b', '{inc}', 'm{n}', 'p{n}', 1, 1, 1, 0, '1-0')"
                for inc in ("gone", "live")
                for n in range(20_000)
            )
            await db.execute(
                "INSERT INTO match_results (board, incarnation, match_id, player_id, points, achieved_ms, "
                f"score, shard, journal_id) VALUES {rows}"
            )
            await db.execute("ANALYZE match_results")
            await db.execute("DELETE FROM match_results WHERE incarnation = 'gone'")  # statistics now stale
            statement = prune.batch_statement("match_results").replace("%s", "{}")
            cur = await db.execute("EXPLAIN " + statement.format("'b'", "'gone'", 100))
            plan = "\n".join(row[0] for row in await cur.fetchall())
            assert "Seq Scan" not in plan and "match_results_pkey" in plan, plan
        finally:
            await db.close()


async def refused_rows(db: psycopg.AsyncConnection[Any], old: int, recent: int) -> list[str]:
    """``old`` rows of refused_results refused 100 days ago, then ``recent`` refused 10 days ago, in
    the order the router's log inserts them (id order is time order); their match ids."""
    matches = [f"old-{n}" for n in range(old)] + [f"recent-{n}" for n in range(recent)]
    for match in matches:
        days = 100 if match.startswith("old") else 10
        await db.execute(
            "INSERT INTO refused_results (board, player_id, match_id, points, status, at) "
            "VALUES ('b', 'p', %s, 5, 'banned', now() - make_interval(days => %s))",
            (match, days),
        )
    return matches


async def refused_left(db: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await db.execute("SELECT match_id FROM refused_results ORDER BY id")
    return [row[0] for row in await cur.fetchall()]


async def test_a_prune_removes_refused_results_older_than_the_days_asked_in_bounded_batches(
    store: BoardStore, postgres_url: str
) -> None:
    """refused_results grew for good: nothing but `shardlb erase` of one player removed a row of it,
    so a game server posting a banned player's results for months filled PostgreSQL. With
    ``refused_days`` a prune removes the rows older than that, ``batch`` a transaction and at most
    ``limit`` a call (counted with the deleted boards' rows), and says how many; called again it
    goes on, and the rows within the days stay. Without it, none goes (it is opt-in)."""
    async with own_db(postgres_url, "prune_refused") as url:
        db = await connect_db(url)
        try:
            matches = await refused_rows(db, 45, 10)
            report = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20)
            assert report.done and report.refused == 0 and await refused_left(db) == matches

            removed, calls = 0, 0
            while True:
                report = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20, refused_days=90)
                calls += 1
                assert report.refused <= 20 and not report.rows
                removed += report.refused
                assert await refused_left(db) == matches[removed:]
                if report.done:
                    break
                assert report.refused == 20
            assert removed == 45 and calls == 3
            again = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20, refused_days=90)
            assert again.done and again.refused == 0
            assert await refused_left(db) == [f"recent-{n}" for n in range(10)]
            # the days are whole days back from now: 9 takes the rows of 10 days ago
            report = await prune.prune(db, store.client, grace_s=0, refused_days=9)
            assert report.done and report.refused == 10 and await refused_left(db) == []
        finally:
            await db.close()


async def test_the_prune_command_removes_refused_results_when_asked(
    store: BoardStore, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb prune --refused-days N` says how many rows of refused_results it removed; without
    the option it removes none and says nothing of them; days below 1 are a usage error (2)."""
    async with own_db(postgres_url, "prune_refused_command") as url:
        db = await connect_db(url)
        try:
            await refused_rows(db, 3, 2)
            capsys.readouterr()
            command = ["prune", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            said = capsys.readouterr().out
            assert "refused_results" not in said and len(await refused_left(db)) == 5, said
            assert await asyncio.to_thread(main, [*command, "--refused-days", "30"]) == 0
            said = capsys.readouterr().out
            assert "refused_results older than 30 days: 3 rows removed" in said, said
            assert "nothing left to prune" in said and len(await refused_left(db)) == 2
            for bad in ("0", "-1", "x"):
                with pytest.raises(SystemExit) as e:
                    main([*command, "--refused-days", bad])
                assert e.value.code == 2
        finally:
            await db.close()


async def test_a_batch_of_refused_results_reads_a_bounded_part_of_the_index(postgres_url: str) -> None:
    """A batch of refused_results reads the oldest ``batch`` rows by the primary key (id order is
    the order the router's log inserted them), never the whole table: the last batch of a night
    finds the rows within the days there, and stops."""
    async with own_db(postgres_url, "prune_refused_plan") as url:
        db = await connect_db(url)
        try:
            await db.execute(
                "INSERT INTO refused_results (board, player_id, match_id, points, status) "
                "SELECT 'b', 'p', 'm' || n, 5, 'banned' FROM generate_series(1, 50000) n"
            )
            await db.execute("ANALYZE refused_results")
            # none older than the days: the batch removes nothing, and reads 100 entries to know it
            cur = await db.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + prune.REFUSED_BATCH, (100, 90))
            row = await cur.fetchone()
            assert row is not None
            scans = list(plan_nodes(row[0][0]["Plan"]))
            assert {n["Node Type"] for n in scans} & {"Seq Scan", "Bitmap Heap Scan"} == set(), scans
            [index] = [n for n in scans if n.get("Index Name") == "refused_results_pkey"]
            assert index["Actual Rows"] <= 100, index
            assert len(await refused_left(db)) == 50_000
        finally:
            await db.close()


def plan_nodes(node: dict[str, Any]) -> Any:
    """Every node of an EXPLAIN (FORMAT JSON) plan, its init plans' included."""
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)


def test_a_line_counts_one_row_as_one() -> None:
    """`shardlb prune` printed "1 rows removed" (as `shardlb erase` did, until 2026-12-06)."""
    assert prune.removed(1) == "1 row removed"
    assert prune.removed(0) == "0 rows removed"
    assert prune.removed(1_234) == "1,234 rows removed"


def test_the_help_names_every_table_pruned_and_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    """`shardlb prune --help` named results, holds and removals, not the later applications a result's
    row did not take (``match_later``), which it prunes too, and gave the exit statuses 0, 2 and 3,
    not 1 (Redis or PostgreSQL out of reach), until 2026-12-06."""
    with pytest.raises(SystemExit) as e:
        main(["prune", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(f"{table}" in out for table in (*prune.TABLES, *prune.BOOKKEEPING)), out
    for status in ("0 when", "1 when", "2 for", "3 when"):
        assert f" {status} " in out, (status, out)
