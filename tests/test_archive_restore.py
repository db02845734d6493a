"""PostgreSQL restored from a backup while Redis holds newer data (docs/design-notes.md, "PostgreSQL
restored from a backup"): against the suite's cluster and databases of the test's own, the restore
made with CREATE DATABASE ... TEMPLATE (the backup) and the archiver pointed at the copy."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from pathlib import Path
from typing import Any

import psycopg
import pytest

from shardlb import times
from shardlb.archive import connect_db
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.connection import Scripts
from shardlb.errors import BoardConflict, SettlementConflict
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Resharder
from shardlb.settlement import Request, Settler
from shardlb.store import BoardStore
from tests.test_archive import archived
from tests.test_board import sharding
from tests.test_rebuild import OnlyStore, archiver, drain, own_archive
from tests.test_settlement import TABLE, day_ago, new_board, written
from tests.test_settlement import drain as settle_drain

pytestmark = pytest.mark.cluster


async def backup_of(url: str) -> str:
    """A copy of the database at ``url`` as it is now (no connection to it may be open)."""
    name = f"backup_{secrets.token_hex(4)}"
    base, source = url.rsplit("/", 1)
    async with await psycopg.AsyncConnection.connect(f"{base}/postgres", autocommit=True) as admin:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {source}")
    return f"{base}/{name}"


async def lost_after_backup(board: Board, raw: Any, only: OnlyStore, live: str, now: int) -> str:
    """The loss every test here starts from: ten results (``a0``..``a9``) archived into ``live``,
    the backup taken, ten more (``b0``..``b9``, 100 points up) archived into ``live``, acknowledged
    and trimmed from the journals. Returns the backup's URL (every archiver closed)."""
    a = await archiver(raw, only, live)
    try:
        await board.submit([Score(f"a{i}", i, f"ma{i}", now) for i in range(10)])
        await drain(a)
    finally:
        await a.db.close()
    restored = await backup_of(live)  # the backup: taken here
    a = await archiver(raw, only, live)
    try:
        await board.submit([Score(f"b{i}", 100 + i, f"mb{i}", now) for i in range(10)])
        await drain(a)  # archived into the live database, acknowledged and trimmed
    finally:
        await a.db.close()
    return restored


async def test_results_archived_after_the_backup_are_reported_and_not_dropped_by_a_rebuild(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """Results acknowledged and archived after the backup are trimmed from the journals: the
    restored archive cannot get them back, but Redis's board still holds them. The archiver records
    the gap at its first write to the restored database, and a rebuild (which would replace the
    board with the archive's rows and drop them) is refused until forced. What the journals still
    held at the restore (not yet archived) is archived into the restored database."""
    config = BoardConfig.from_dict("restore-gap", {"sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        restored = await lost_after_backup(board, raw, only, live, now)
        await board.submit([Score(f"c{i}", 200 + i, f"mc{i}", now) for i in range(10)])
        # PostgreSQL lost, restored from the backup: the archiver now writes there.
        a = await archiver(raw, only, restored)
        try:
            await drain(a)
            rows = {s.player_id for s in await archived(restored, board)}
            assert rows == {f"a{i}" for i in range(10)} | {f"c{i}" for i in range(10)}
            assert await board.size(board.resolve("total")) == 30  # Redis holds the b results
            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                cur = await db.execute(
                    "SELECT count(*) FROM archive_gaps WHERE board = %s AND incarnation = %s",
                    (config.id, board.incarnation),
                )
                row = await cur.fetchone()
                assert row is not None and row[0] >= 1
                rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
                with pytest.raises(BoardConflict) as refused:
                    await rebuilder.rebuild(board)
                assert "archive_gaps" in refused.value.message
                assert await board.size(board.resolve("total")) == 30
                # Later writes archived into the restored database do not hide the gap.
                await board.submit([Score("d1", 1, "md1", now)])
                await drain(a)
                with pytest.raises(BoardConflict):
                    await rebuilder.rebuild(board)
                await rebuilder.rebuild(board, force=True)  # the operator's choice: the archive wins
                assert await board.size(board.resolve("total")) == 21
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_an_archive_that_lost_nothing_records_no_gap(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The same rounds against one database that kept everything: no gap, and the rebuild runs."""
    config = BoardConfig.from_dict("restore-nogap", {"sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        a = await archiver(raw, only, live)
        try:
            for n in range(3):
                await board.submit([Score(f"p{n}{i}", i, f"m{n}{i}", now) for i in range(10)])
                await drain(a)
            await a.db.close()
            a = await archiver(raw, only, live)  # an archiver started again: the marks are kept
            await board.submit([Score("q", 1, "mq", now)])
            await drain(a)
            cur = await a.db.execute("SELECT count(*) FROM archive_gaps")
            row = await cur.fetchone()
            assert row is not None and row[0] == 0
            await Rebuilder(raw, Scripts.register(raw).rebuild, a.db).rebuild(board)
            assert await board.size(board.resolve("total")) == 31
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


@pytest.mark.parametrize("again", ["same-id", "new-id"])
async def test_a_settlement_paid_after_the_backup_is_not_paid_again(
    store: BoardStore, raw: Any, postgres_url: str, again: str
) -> None:
    """The settlement's rows are PostgreSQL's alone: restored to before it, the archive has no
    settlement of the period, and the run asked again (the client never saw its answer) or under
    another id paid every winner a second time, under award ids the restored sequence hands out again.
    Redis keeps the payment's record beside the period's freeze (as long as the period's keys): the
    run is refused (409 period_settled) and nothing is paid again."""
    board = await new_board(store, f"restore-settle-{again}")
    period = day_ago(2)
    request = Request.of({"settlement_id": f"rs-{again}", "rewards": TABLE})
    async with own_archive(postgres_url) as live:
        try:
            await written(board, period, f"rs/{again}")
            await settle_drain(raw, OnlyStore(store.client, store.scripts, {board.config.id}), live)
            restored = await backup_of(live)  # the backup: taken before the settlement
            async with await psycopg.AsyncConnection.connect(live, autocommit=True) as db:
                settler = Settler(Rebuilder(raw, Scripts.register(raw).rebuild, db))
                first = await settler.settle(board, period, request)
                assert first["awards"]["total"] > 0
            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                settler = Settler(Rebuilder(raw, Scripts.register(raw).rebuild, db))
                other = Request.of({"settlement_id": "rs-x", "rewards": TABLE})
                named = request if again == "same-id" else other
                with pytest.raises(SettlementConflict) as refused:
                    await settler.settle(board, period, named)
                assert refused.value.code == "period_settled"
                assert f"rs-{again}" in refused.value.message
                cur = await db.execute("SELECT count(*) FROM settlement_awards")
                row = await cur.fetchone()
                assert row is not None and row[0] == 0
                cur = await db.execute("SELECT count(*) FROM settlements")
                row = await cur.fetchone()
                assert row is not None and row[0] == 0
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board.config.id)


async def test_an_archiver_reconnected_to_a_restored_database_records_the_boards_made_since(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A board created after the backup has no row in the restored `boards`, which `rebuild --all`
    restores boards from. The running archiver, whose connection broke with the restore, knew the
    board already and recorded nothing: after a later loss of Redis the board was not restored."""
    config = BoardConfig.from_dict("restore-boards", {"sharding": sharding("hash", 2)})
    only = OnlyStore(store.client, store.scripts, {config.id})
    async with own_archive(postgres_url) as live:
        a = await archiver(raw, only, live)
        try:
            await a.db.close()
            restored = await backup_of(live)  # the backup: taken before the board
            a.db = await connect_db(live)
            board, _ = await store.create(config)
            await a.refresh()
            await a.db.close()  # PostgreSQL restored: the connection is gone, the URL now reaches the backup
            a.db_url = restored
            await a._reconnect()
            await a.refresh()
            cur = await a.db.execute(
                "SELECT count(*) FROM boards WHERE board = %s AND incarnation = %s AND deleted_at IS NULL",
                (config.id, board.incarnation),
            )
            row = await cur.fetchone()
            assert row is not None and row[0] == 1
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_reconcile_names_the_gap_and_its_repair_keeps_the_board(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb reconcile` after the restore: the drift it shows comes with the gap that explains it,
    and `--repair` (the nightly CronJob's option) is refused rather than dropping the results."""
    config = BoardConfig.from_dict("restore-reconcile", {"sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        restored = await lost_after_backup(board, raw, only, live, now)
        await board.submit([Score("c", 1, "mc", now)])
        a = await archiver(raw, only, restored)
        try:
            await drain(a)
            command = ["reconcile", config.id, "--redis", cluster_url, "--postgres", restored]
            capsys.readouterr()
            assert await asyncio.to_thread(main, command) == 1
            out = capsys.readouterr().out
            assert "DRIFT" in out and "archive_gaps" in out
            assert await asyncio.to_thread(main, [*command, "--repair"]) == 1
            assert "archive_gaps" in capsys.readouterr().err
            assert await board.size(board.resolve("total")) == 21
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_journal_without_writes_since_the_restore_is_judged_too(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A board that takes no write after the restore (a finished event, a quiet hour) has the same
    loss: its results acknowledged after the backup were trimmed and are not in the restored
    archive. Its journals were compared only before a write of entries, so none was, no gap was
    recorded, `reconcile` named nothing and its `--repair` (and a rebuild) dropped them from Redis:
    the archiver compares an idle journal at its idle trim too."""
    config = BoardConfig.from_dict("restore-quiet", {"sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        restored = await lost_after_backup(board, raw, only, live, now)
        a = await archiver(raw, only, restored)  # no write since: every journal idle
        try:
            await drain(a)
            cur = await a.db.execute(
                "SELECT count(*) FROM archive_gaps WHERE board = %s AND incarnation = %s",
                (config.id, board.incarnation),
            )
            row = await cur.fetchone()
            assert row is not None and row[0] >= 1
            command = ["reconcile", config.id, "--redis", cluster_url, "--postgres", restored, "--repair"]
            capsys.readouterr()
            assert await asyncio.to_thread(main, command) == 1
            assert "archive_gaps" in capsys.readouterr().err
            assert await board.size(board.resolve("total")) == 20
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_rebuild_compares_the_journals_with_the_archive_itself(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gap is refused before any archiver has written to (or even reached) the restored
    database: a new URL whose archivers are not restarted yet, archivers scaled down, the reconcile
    CronJob's `--repair` left running. The rebuild compares each journal's trimmed id with the
    archive's mark itself, rather than rely on `archive_gaps` alone."""
    config = BoardConfig.from_dict("restore-unseen", {"sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        try:
            restored = await lost_after_backup(board, raw, only, live, now)
            command = ["reconcile", config.id, "--redis", cluster_url, "--postgres", restored, "--repair"]
            capsys.readouterr()
            assert await asyncio.to_thread(main, command) == 1
            assert "journal_marks" in capsys.readouterr().err
            assert await board.size(board.resolve("total")) == 20
            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
                with pytest.raises(BoardConflict):
                    await rebuilder.rebuild(board)
                await rebuilder.rebuild(board, force=True)
                assert await board.size(board.resolve("total")) == 10
            async with await psycopg.AsyncConnection.connect(live, autocommit=True) as db:
                await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(board)  # the archive whole
                assert await board.size(board.resolve("total")) == 20
        finally:
            with contextlib.suppress(Exception):
                await store.delete(config.id)


def runbook_step_5(board: str, incarnation: str) -> str:
    """The SQL of step 5 of docs/design-notes.md's runbook "PostgreSQL restored to an earlier point",
    as written there (for its example board ``arena``, incarnation ``028a280e``), for this board."""
    notes = (Path(__file__).parent.parent / "docs" / "design-notes.md").read_text()
    step = notes[notes.index("*Runbook: PostgreSQL restored to an earlier point") :]
    step = step[step.index("\n5. ") :]
    sql = step[step.index("```sql\n") + len("```sql\n") : step.index("```", step.index("```sql\n") + 7)]
    assert "'arena'" in sql and "'028a280e'" in sql
    return sql.replace("'arena'", f"'{board}'").replace("'028a280e'", f"'{incarnation}'")


async def test_the_runbooks_step_5_clears_a_gap_for_good(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """Once the operator decided (step 4), step 5 clears the board's gaps: the rows stay gone under
    later archivers and rebuilds run without --force. A DELETE of the rows alone (the step until
    2026-12-05) did neither: the journals' marks were still behind what they trimmed, so the next
    archiver round recorded the gaps again and the rebuild's own comparison refused."""
    config = BoardConfig.from_dict("restore-cleared", {"sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    gaps = "SELECT count(*) FROM archive_gaps WHERE board = %s AND incarnation = %s"
    async with own_archive(postgres_url) as live:
        restored = await lost_after_backup(board, raw, only, live, now)
        a = await archiver(raw, only, restored)
        try:
            await drain(a)
            key = (config.id, board.incarnation)
            assert (await (await a.db.execute(gaps, key)).fetchone()) != (0,)
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            await rebuilder.rebuild(board, force=True)  # step 4: the archive wins
            assert await board.size(board.resolve("total")) == 10
            await a.db.execute("DELETE FROM archive_gaps WHERE board = %s AND incarnation = %s", key)
            await a.db.close()
            a = await archiver(raw, only, restored)
            await drain(a)  # its first round compares every journal again
            assert (await (await a.db.execute(gaps, key)).fetchone()) != (0,)
            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                await db.execute(runbook_step_5(config.id, board.incarnation))
            await a.db.close()
            a = await archiver(raw, only, restored)
            await drain(a)
            assert (await (await a.db.execute(gaps, key)).fetchone()) == (0,)
            await board.submit([Score("c", 1, "mc", now)])
            await drain(a)
            assert (await (await a.db.execute(gaps, key)).fetchone()) == (0,)
            await Rebuilder(raw, Scripts.register(raw).rebuild, a.db).rebuild(board)
            assert await board.size(board.resolve("total")) == 11
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_rebuild_from_an_archive_restored_from_before_a_reshard_is_refused(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A backup taken before a reshard holds the board's rows under the old layout's shards, and
    the new layout's journals have no marks there, so no gap is found. A rebuild (forced or not)
    read each new shard's rows by the old shard numbers: drilled 2026-12-05 on `make run`, a board
    of 600 players resharded 3 -> 2 after the backup came back with 405, the players of the old
    shard 2 gone and the others on shards their reads do not look at. Refused now."""
    config = BoardConfig.from_dict("restore-resharded", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        a = await archiver(raw, only, live)
        try:
            await board.submit([Score(f"a{i}", i, f"ma{i}", now) for i in range(30)])
            await drain(a)
        finally:
            await a.db.close()
        restored = await backup_of(live)  # the backup: taken before the reshard
        mover = Resharder(only, config.id, say=lambda _: None, postgres_url=live, cache_s=0, drain_s=0.2)
        await mover.start(2)
        a = await archiver(raw, only, live)
        try:
            status = await mover.run()
            while status["state"] != "none":
                await drain(a)
                status = await mover.run()
        finally:
            await a.db.close()
        fresh = await store.get(config.id)
        try:
            assert fresh.config.sharding.shards == 2
            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
                for force in (False, True):
                    with pytest.raises(BoardConflict) as refused:
                        await rebuilder.rebuild(fresh, force=force)
                    assert "layout" in refused.value.message
                assert await fresh.size(fresh.resolve("total")) == 30
            async with await psycopg.AsyncConnection.connect(live, autocommit=True) as db:
                await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(fresh)  # re-homed rows
                assert await fresh.size(fresh.resolve("total")) == 30
        finally:
            with contextlib.suppress(Exception):
                await store.delete(config.id)
