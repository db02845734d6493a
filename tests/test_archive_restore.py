"""PostgreSQL restored from a backup while Redis holds newer data (docs/design-notes.md, "PostgreSQL
restored from a backup"): against the suite's cluster and databases of the test's own, the restore
made with CREATE DATABASE ... TEMPLATE (the backup) and the archiver pointed at the copy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from pathlib import Path
from typing import Any

import psycopg
import pytest

from shardlb import moderation, times
from shardlb.archive import connect_db
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.connection import Scripts
from shardlb.errors import BoardConflict, SettlementConflict
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import reconcile
from shardlb.reshard import REHOMED, Resharder
from shardlb.settlement import Request, Settler, period_bounds
from shardlb.sharding import player_hash
from shardlb.store import BoardStore
from tests.test_archive import archived
from tests.test_board import sharding
from tests.test_rebuild import OnlyStore, archiver, drain, own_archive
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board, written
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


async def resharded(only: OnlyStore, board_id: str, live: str, shards: int, bands: list[int] | None) -> Board:
    """The board moved to ``shards`` (and ``bands``), to the end: its old journals archived into
    ``live`` and its rows re-homed there. Returns the board on its new layout."""
    mover = Resharder(only, board_id, say=lambda _: None, postgres_url=live, cache_s=0, drain_s=0.2)
    await mover.start(shards, bands)
    a = await archiver(only.client, only, live)
    try:
        status = await mover.run()
        while status["state"] != "none":
            await drain(a)
            status = await mover.run()
    finally:
        await a.db.close()
    return await only.get(board_id)


async def off_layout(url: str, board: Board) -> dict[str, tuple[int, int]]:
    """Per table a reshard re-homes: (rows of ``board``, those on another shard than its layout's)."""
    out = {}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
        for table in REHOMED:
            cur = await db.execute(
                f"SELECT player_id, shard FROM {table} WHERE board = %s AND incarnation = %s",
                (board.config.id, board.incarnation),
            )
            rows = await cur.fetchall()
            out[table] = (len(rows), sum(board.layout.home(p) != s for p, s in rows))
    return out


@pytest.mark.parametrize("strategy", ["hash", "band"])
async def test_rehome_brings_an_archive_restored_from_before_a_reshard_back_in_line(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    capsys: pytest.CaptureFixture[str],
    strategy: str,
) -> None:
    """The drill of 2026-12-05 to its end: a board written (a closed day's results, a late better
    retry of one of them, which leaves a hold, and a removal), the backup, a reshard 3 -> 2 and
    results of that day after it, PostgreSQL restored. The archive holds the rows of before under
    the old layout's shards and those archived since under the new one's: a rebuild is refused
    and a settlement folds a player per shard, twice. `shardlb reshard BOARD --rehome` moves every
    row to the layout's shards (run twice: the second changes nothing); then the rebuild runs,
    reconcile finds no drift, and the settlement pays the reference's order."""
    layout: dict[str, Any] = {"shards": 3}
    bands = None
    if strategy == "band":
        bands = [0, 20, 40]
        layout = {"strategy": "band", "shards": 3, "bands": bands}
    board = await new_board(store, f"restore-rehome-{strategy}", sharding=layout)
    config = board.config
    only = OnlyStore(store.client, store.scripts, {config.id})
    period = day_ago(2)
    name = board.resolve(period).period
    start, end = period_bounds(board, name)
    async with own_archive(postgres_url) as live:
        try:
            ref = await written(board, period, f"rehome/{strategy}/before")
            first = [Score("late", 30, "late-m", start + 1000)]
            await board.submit(first, now_ms=end - 1)
            ref.submit(first, now_ms=end - 1)
            again = [Score("late", 45, "late-m", start + 1000)]  # after the day closed: the total only
            await board.submit(again)
            ref.submit(again, now_ms=times.now_ms())
            # A player whose home moves with the reshard, removed (their earlier rows must stay out).
            cheater = next(p for _, p, _, _ in ref.order(name) if player_hash(p) % 3 != player_hash(p) % 2)
            await moderation.remove(board, [cheater], request="remove/rehome")
            ref.remove(cheater, at_ms=times.now_ms())
            await settle_drain(raw, only, live)
            restored = await backup_of(live)  # the backup: taken before the reshard
            fresh = await resharded(only, config.id, live, 2, bands)
            assert fresh.config.sharding.shards == 2 and fresh.generation == board.generation + 1
            await written(fresh, period, f"rehome/{strategy}/after", ref=ref)  # on the new shards
            await settle_drain(raw, only, restored)  # the restore: the journals' rest archived there
            before = await off_layout(restored, fresh)
            # every table holds rows to move, but `match_later` (a losing copy of a result sent again
            # after a removal: none here; tests/test_archive_retries.py)
            assert all(rows for table, (rows, _) in before.items() if table != "match_later"), before
            assert before["match_results"][1] and before["player_removals"][1] and before["match_holds"][1]

            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
                with pytest.raises(BoardConflict) as refused:
                    await rebuilder.rebuild(fresh)
                assert "--rehome" in refused.value.message
                order = await Settler(rebuilder).final_order(fresh, name)
                assert len(order) > len({s.player_id for s in order})  # players counted twice

            command = ["reshard", config.id, "--rehome", "--redis", cluster_url, "--postgres", restored]
            capsys.readouterr()
            assert await asyncio.to_thread(main, command) == 0
            done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            assert done["rehomed"] == sum(off for _, off in before.values())
            assert done["shards"] == 2 and done["generation"] == fresh.generation
            assert await asyncio.to_thread(main, command) == 0  # again: in line, nothing to change
            assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rehomed"] == 0
            after = await off_layout(restored, fresh)
            assert after == {table: (rows, 0) for table, (rows, _) in before.items()}

            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                cur = await db.execute(
                    "SELECT settings FROM boards WHERE board = %s AND incarnation = %s",
                    (config.id, board.incarnation),
                )
                row = await cur.fetchone()
                assert row is not None and row[0]["generation"] == fresh.generation
                assert row[0]["sharding"]["shards"] == 2
                rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
                players = await fresh.size(fresh.resolve("total"))
                await rebuilder.rebuild(fresh)
                assert await fresh.size(fresh.resolve("total")) == players == len(ref.order("total"))
                for checked_period in ("total", period):
                    checks = await reconcile(rebuilder, fresh, checked_period)
                    assert not any(c.drift for c in checks), checks
                request = Request.of({"settlement_id": f"rehome-{strategy}", "rewards": TABLE})
                result = await Settler(rebuilder).settle(fresh, period, request)
                assert result["check"]["drifting"] == [] and result["forced"] is False
                assert result["players"] == len(ref.order(name))
                assert await awards_of(db, f"rehome-{strategy}") == expected_awards(ref, period, fresh)
        finally:
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_rehome_is_refused_where_it_has_nothing_to_do_or_a_reshard_will(
    store: BoardStore,
    postgres_url: str,
    cluster_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A region board is never resharded, a memory board archives nothing, and a reshard under way
    re-homes the rows at its finish (a re-homing to the layout before its cut-over would be undone
    by it, or undo it): each is refused, exit 1, nothing changed. Without PostgreSQL: exit 2."""
    region = BoardConfig.from_dict("rehome-region", {"sharding": sharding("region", 3)})
    memory = BoardConfig.from_dict("rehome-memory", {"sharding": sharding("hash", 2), "durability": "memory"})
    moving = BoardConfig.from_dict("rehome-moving", {"sharding": sharding("hash", 3)})
    try:
        for config in (region, memory, moving):
            await store.create(config)
        # A reshard recorded while a re-homing waits for its turn (a reshard's finish holds the
        # lock, here a connection of the test): the registry is read again once it has the lock.
        mover = Resharder(store, moving.id, say=lambda _: None, postgres_url=postgres_url)
        async with (
            await psycopg.AsyncConnection.connect(postgres_url) as holder,
            await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as watcher,
        ):
            await holder.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"rehome/{moving.id}",))
            waiting = Resharder(store, moving.id, say=lambda _: None, postgres_url=postgres_url)
            task = asyncio.create_task(waiting.rehome())
            for _ in range(200):
                cur = await watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' "
                    "AND query LIKE 'SELECT pg_advisory_xact_lock%'"
                )
                if ((await cur.fetchone()) or (0,))[0] >= 1:
                    break
                await asyncio.sleep(0.05)
            assert not task.done()
            await mover.start(2)
            await holder.rollback()
            with pytest.raises(BoardConflict) as refused:
                await task
            assert "being resharded" in refused.value.message
        for config, why in ((region, "region board"), (memory, "no journal"), (moving, "being resharded")):
            command = ["reshard", config.id, "--rehome", "--redis", cluster_url, "--postgres", postgres_url]
            capsys.readouterr()
            assert await asyncio.to_thread(main, command) == 1
            assert why in capsys.readouterr().err
        await mover.cancel()
        monkeypatch.delenv("SHARDLB_POSTGRES_URL", raising=False)
        assert await asyncio.to_thread(main, ["reshard", moving.id, "--rehome", "--redis", cluster_url]) == 2
        assert "--postgres" in capsys.readouterr().err
    finally:
        for config in (region, memory, moving):
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_rehome_cut_off_changes_nothing_and_run_again_converges(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The re-homing is one transaction: its connection killed while it waits on a row of its
    third table (a lock held by hand; an archiver's write of that row would do), no row of any
    table has moved, the results it had updated included; run again, every row is on its
    layout's shard."""
    config = BoardConfig.from_dict("restore-rehome-cut", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        try:
            moved = next(f"a{i}" for i in range(30) if player_hash(f"a{i}") % 3 != player_hash(f"a{i}") % 2)
            a = await archiver(raw, only, live)
            try:
                await board.submit([Score(f"a{i}", i, f"ma{i}", now) for i in range(30)])
                await moderation.remove(board, [moved])
                await drain(a)
            finally:
                await a.db.close()
            restored = await backup_of(live)
            fresh = await resharded(only, config.id, live, 2, None)
            before = await off_layout(restored, fresh)
            assert before["match_results"][1] > 0 and before["player_removals"][1] == 1
            mover = Resharder(only, config.id, say=lambda _: None, postgres_url=restored)
            # Two connections: one holds the row, the other looks (pg_stat_activity is read once a
            # transaction).
            async with (
                await psycopg.AsyncConnection.connect(restored, autocommit=True) as holder,
                await psycopg.AsyncConnection.connect(restored, autocommit=True) as watcher,
                holder.transaction(),
            ):
                # Its removal's row: the results before it in the transaction are moved by then.
                await holder.execute(
                    "SELECT 1 FROM player_removals WHERE board = %s AND player_id = %s FOR UPDATE",
                    (config.id, moved),
                )
                task = asyncio.create_task(mover.rehome())
                for _ in range(200):
                    cur = await watcher.execute(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND query LIKE 'UPDATE player_removals%%'"
                    )
                    waiting = await cur.fetchall()
                    if waiting:
                        break
                    await asyncio.sleep(0.05)
                assert waiting, "the re-homing never reached the locked row"
                await watcher.execute("SELECT pg_terminate_backend(%s)", (waiting[0][0],))
                with pytest.raises(psycopg.OperationalError):
                    await task
            assert await off_layout(restored, fresh) == before
            done = await mover.rehome()
            assert done["rehomed"] == sum(off for _, off in before.values())
            assert all(off == 0 for _, off in (await off_layout(restored, fresh)).values())
        finally:
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_after_a_rehome_reconcile_shows_what_the_restore_lost_and_no_gap_names_it(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runbook's step 5 after `--rehome`: results acknowledged after the backup point and before
    the reshard (``b0``..``b9``) were trimmed from journals the reshard then dropped, so no gap
    records them. Reconcile shows their shards drifting, and only that tells them; a rebuild is
    not refused and makes the board agree with the archive (the step 4 choice, made by running it)."""
    config = BoardConfig.from_dict("restore-rehome-lost", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    only = OnlyStore(store.client, store.scripts, {config.id})
    now = times.now_ms()
    async with own_archive(postgres_url) as live:
        try:
            restored = await lost_after_backup(board, raw, only, live, now)
            fresh = await resharded(only, config.id, live, 2, None)
            a = await archiver(raw, only, restored)
            try:
                await drain(a)
            finally:
                await a.db.close()
            rehome = ["reshard", config.id, "--rehome", "--redis", cluster_url, "--postgres", restored]
            assert await asyncio.to_thread(main, rehome) == 0
            capsys.readouterr()
            command = ["reconcile", config.id, "--redis", cluster_url, "--postgres", restored]
            assert await asyncio.to_thread(main, command) == 1
            out = capsys.readouterr().out
            assert "DRIFT" in out and "archive_gaps" not in out
            assert await fresh.size(fresh.resolve("total")) == 20
            async with await psycopg.AsyncConnection.connect(restored, autocommit=True) as db:
                await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(fresh)
            assert await fresh.size(fresh.resolve("total")) == 10
        finally:
            with contextlib.suppress(Exception):
                await store.delete(config.id)
