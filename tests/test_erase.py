"""Erasing a player's archived rows (shardlb/erase.py) against the suite's cluster and a PostgreSQL
database of each test's own: it removes the rows no board reads any more (results and holds before
a removal that kept nothing, every row on a deleted board, refused results), never one a board still
counts, and a live board's rebuild, reconcile and settlement answer as before it; run again, it
removes nothing more."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import psycopg
import pytest

from shardlb import erase, keys, moderation, times
from shardlb.archive import GROUP, Archiver, connect_db
from shardlb.board import Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.connection import Scripts
from shardlb.errors import BoardNotFound
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import reconcile
from shardlb.settlement import Request, Settler, ensure_schema
from shardlb.settlement_history import player_history
from shardlb.store import BoardStore
from tests.test_prune import TABLES, archived, late_retry, own_db, rows_of
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board, written

pytestmark = pytest.mark.cluster

PLAYER = "p003"  # written's players are p000..p039; late_retry gives p003 a hold too
HOUR = 3_600_000
# An erase judged this far ahead finds every row of now past what a rebuild's refill reads on a
# board of new_board's (a dedup window of 30 days, and pins up to 4 buckets of 30 h before it):
# test_an_erase_keeps_the_rows_a_rebuild_puts_retry_records_back_from.
PAST_WINDOW_MS = 40 * 24 * HOUR


def past_window() -> int:
    return times.now_ms() + PAST_WINDOW_MS


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def of_player(
    db: psycopg.AsyncConnection[Any], board: str, incarnation: str, mine: bool
) -> dict[str, Any]:
    """The board's rows of ``TABLES`` of PLAYER (``mine``) or of every other player."""
    rows = await rows_of(db, board, incarnation)
    return {table: [r for r in found if (r[3] == PLAYER) == mine] for table, found in rows.items()}


async def refused(db: psycopg.AsyncConnection[Any], player: str) -> int:
    cur = await db.execute("SELECT count(*) FROM refused_results WHERE player_id = %s", (player,))
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def test_an_erase_removes_only_rows_no_board_reads_and_converges(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async with own_db(postgres_url, "erase_rows") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        removed, ranked, gone = [
            await new_board(store, unique(prefix))
            for prefix in ("erase-removed", "erase-ranked", "erase-gone")
        ]
        period = day_ago(2)
        try:
            ref = await written(removed, period, "removed")
            await late_retry(removed, ref, period, "removed")
            await late_retry(ranked, await written(ranked, period, "ranked"), period, "ranked")
            await written(gone, period, "gone")
            for board in (removed, gone):
                await moderation.remove(board, [PLAYER], request="remove/erase-1")
            await moderation.record_refusals(
                db, [(b.config.id, PLAYER, "refused-1", 99, "points_limit", None) for b in (removed, ranked)]
            )
            await archived(raw, store, db)
            mine = await of_player(db, removed.config.id, removed.incarnation, True)
            assert all(mine[t] for t in ("match_results", "match_holds", "match_later", "player_removals"))
            others = {
                b.config.id: await of_player(db, b.config.id, b.incarnation, False) for b in (removed, ranked)
            }
            ranked_mine = await of_player(db, ranked.config.id, ranked.incarnation, True)
            assert ranked_mine["match_results"]
            await store.delete(gone.config.id)
            await archived(raw, store, db)

            done = await erase.erase(db, store.client, PLAYER, batch=3, now_ms=past_window())

            for table in ("match_results", "match_holds", "match_later"):
                assert done.rows[(removed.config.id, removed.incarnation, table)] == len(mine[table])
            assert done.rows[("*", "", "refused_results")] == 2 and await refused(db, PLAYER) == 0
            after = await of_player(db, removed.config.id, removed.incarnation, True)
            assert after == {**{t: [] for t in TABLES}, "player_removals": mine["player_removals"],
                             "removal_records": mine["removal_records"]}  # fmt: skip
            assert not any((await of_player(db, gone.config.id, gone.incarnation, True)).values())
            assert any((await of_player(db, gone.config.id, gone.incarnation, False)).values())
            # The board where the player is still ranked keeps every row of theirs, and says so.
            assert await of_player(db, ranked.config.id, ranked.incarnation, True) == ranked_mine
            still = sum(len(ranked_mine[table]) for table in ("match_results", "match_holds", "match_later"))
            assert done.left == {(ranked.config.id, ranked.incarnation): still}
            assert done.kept["player_removals"] == len(mine["player_removals"])
            for board in (removed, ranked):
                still_others = await of_player(db, board.config.id, board.incarnation, False)
                assert still_others == others[board.config.id]
            assert await player_history(db, removed, PLAYER, 100) == []

            # The board from which the player was erased answers as before: rebuilt, reconciled, settled.
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
            for view in (None, period):
                before = await removed.top(1000, removed.resolve(view) if view else None)
                await rebuilder.rebuild(removed)
                assert await removed.top(1000, removed.resolve(view) if view else None) == before
                assert PLAYER not in [e.player_id for e in before]
            assert not any(c.drift for c in await reconcile(rebuilder, removed, "total"))
            request = Request.of({"settlement_id": f"{removed.config.id}-1", "rewards": TABLE, "top_n": 7})
            result = await Settler(rebuilder).settle(removed, period, request)
            assert result["check"]["drifting"] == []
            ref.remove(PLAYER)
            assert await awards_of(db, f"{removed.config.id}-1") == expected_awards(ref, period, removed)

            again = await erase.erase(db, store.client, PLAYER, now_ms=past_window())  # again: nothing more
            assert again.rows == {} and again.left == done.left
            command = ["erase", PLAYER, "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 3  # the command runs its own event loop
            await moderation.remove(ranked, [PLAYER])
            await archived(raw, store, db)
            # Removed now, their rows arrived within the dedup window: held, and said so (exit 3).
            capsys.readouterr()
            assert await asyncio.to_thread(main, command) == 3
            printed = capsys.readouterr().out
            assert f"{ranked.config.id} (incarnation {ranked.incarnation}): " in printed
            assert "kept for the dedup window" in printed and "still count" not in printed
            assert (await of_player(db, ranked.config.id, ranked.incarnation, True))["match_results"]
            done = await erase.erase(db, store.client, PLAYER, now_ms=past_window())
            assert done.left == done.held == {}
            assert not (await of_player(db, ranked.config.id, ranked.incarnation, True))["match_results"]
            assert await asyncio.to_thread(main, command) == 0
            for bad in (["p!3"], []):
                with pytest.raises(SystemExit) as e:
                    main(["erase", *bad, "--redis", cluster_url, "--postgres", url])
                assert e.value.code == 2
        finally:
            await db.close()
            for board in (removed, ranked, gone):
                with contextlib.suppress(BoardNotFound):
                    await store.delete(board.config.id)


async def test_an_erase_keeps_a_result_posted_after_the_removal(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A result of the player achieved after the removal counts again (Redis ranks it, a rebuild
    puts it back): its row stays, reported as still counting; the row from before the removal goes."""
    async with own_db(postgres_url, "erase_since") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        board = await new_board(store, unique("erase-since"), mode="incr")
        try:
            now = times.now_ms()
            await board.submit([Score(PLAYER, 10, "before", now - 60_000), Score("p001", 5, "other", now)])
            await moderation.remove(board, [PLAYER])
            await board.submit([Score(PLAYER, 7, "since", times.now_ms() + 2000)])
            await archived(raw, store, db)

            done = await erase.erase(db, store.client, PLAYER, now_ms=past_window())

            left = (await of_player(db, board.config.id, board.incarnation, True))["match_results"]
            assert [r[2] for r in left] == ["since"]
            assert done.rows == {(board.config.id, board.incarnation, "match_results"): 1}
            assert done.left == {(board.config.id, board.incarnation): 1}
            before = await board.top(10)
            await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(board)
            assert await board.top(10) == before
            assert [(e.player_id, e.points) for e in before] == [(PLAYER, 7), ("p001", 5)]
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(board.config.id)


@pytest.mark.parametrize("erased", ["between", "after"])
@pytest.mark.parametrize("mode", ["best", "set", "incr"])
async def test_an_erase_keeps_a_result_sent_again_past_the_window_after_the_removal(
    store: BoardStore, raw: Any, postgres_url: str, mode: str, erased: str
) -> None:
    """The match of before the removal sent again once the dedup window has passed (a best board's
    lower score, a set board's earlier time, an incr board's same result): Redis ranks the player
    with it. Its row is the one that counts (shardlb/archive.py, ``_CUT``), and an erase, made
    between the removal and the post or after both, leaves it, reported as still counting. Until
    2026-12-05 the row of before the removal stayed in its place, and an erase after the post
    removed it: a rebuild then dropped the acknowledged result."""
    async with own_db(postgres_url, f"erase_again_{mode}_{erased}") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        board = await new_board(store, unique("erase-again"), mode=mode)
        try:
            t0 = times.now_ms() - 120_000
            await board.submit([Score(PLAYER, 100, "m1", t0), Score("p001", 5, "other", t0)])
            await moderation.remove(board, [PLAYER])
            await archived(raw, store, db)
            if erased == "between":
                await erase.erase(db, store.client, PLAYER, now_ms=past_window())
            for prefix in board.prefixes:  # the window over: the removal's records and dedup sets gone
                await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
                for name in await raw.zrange(keys.index_key(prefix), 0, -1):
                    if name.startswith(f"{prefix}dd:".encode()):
                        await raw.delete(name)
            again = {"best": Score(PLAYER, 50, "m1", t0), "set": Score(PLAYER, 50, "m1", t0 - 1000)}.get(
                mode, Score(PLAYER, 100, "m1", t0)
            )
            assert (await board.submit([again]))[0].status == "improved"
            await archived(raw, store, db)

            done = await erase.erase(db, store.client, PLAYER, now_ms=past_window())

            left = (await of_player(db, board.config.id, board.incarnation, True))["match_results"]
            assert [r[2] for r in left] == ["m1"]
            assert done.rows == {} and done.left == {(board.config.id, board.incarnation): 1}
            before = await board.top(10)
            assert [(e.player_id, e.points) for e in before] == [(PLAYER, again.points), ("p001", 5)]
            await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(board)
            assert await board.top(10) == before
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(board.config.id)


@pytest.mark.parametrize("mode", ["incr", "best"])
async def test_an_erase_keeps_the_rows_a_rebuild_puts_retry_records_back_from(
    store: BoardStore, raw: Any, postgres_url: str, mode: str
) -> None:
    """Within the dedup window a rebuild puts back a shard's retry records from match_results (an
    incr board's dedup sets, a best board's pins: RetryRecords), a removed player's rows included:
    the retry of a result sent without achieved_at, made after the removal and a loss of the
    shard's records, is then answered `duplicate`, as before the loss. An erase of the removal's
    rows must wait for the window: erased at once, the retry put the player back on the board."""
    async with own_db(postgres_url, f"erase_window_{mode}") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        settings = {"mode": mode, "sharding": {"shards": 3}}  # the default window, 24 h
        config = BoardConfig.from_dict(unique(f"erase-window-{mode}"), settings)
        board, _ = await store.create(config)
        try:
            await board.submit([Score(PLAYER, 10, "m1", None), Score("p001", 5, "m2", None)])
            await moderation.remove(board, [PLAYER])
            await archived(raw, store, db)

            now = times.now_ms()
            done = await erase.erase(db, store.client, PLAYER, now_ms=now)

            # Nothing of the results goes yet; they count nowhere (not "left"), held for the window.
            ident = (config.id, board.incarnation)
            assert done.rows == {} and done.left == {}
            rows, until = done.held[ident]
            assert rows == 1 and now + 24 * HOUR < until <= now + 30 * HOUR
            mine = (await of_player(db, config.id, board.incarnation, True))["match_results"]
            assert [r[2] for r in mine] == ["m1"]
            # A PARTIAL loss, on purpose: the player's home shard loses its retry records alone
            # (a master back empty takes every key, tests/test_shard_loss.py), and is rebuilt.
            home = board.layout.home(PLAYER)
            prefix = board.prefixes[home]
            lost = [
                name
                for name in await raw.zrange(keys.index_key(prefix), 0, -1)
                if name.startswith((f"{prefix}dd:".encode(), f"{prefix}pin:".encode()))
            ]
            assert lost
            await raw.delete(*lost)
            await raw.zrem(keys.index_key(prefix), *lost)
            await Rebuilder(raw, Scripts.register(raw).rebuild, db).rebuild(board, shard=home)
            later = times.now_ms() + 2 * HOUR  # well within the 24 h window
            again = await board.submit([Score(PLAYER, 10, "m1", None)], now_ms=later)
            assert [r.status for r in again] == ["duplicate"]
            assert [e.player_id for e in await board.top(10)] == ["p001"]

            # From the time it gave, the window has passed them: they go, and nothing is held.
            early = (await erase.erase(db, store.client, PLAYER, now_ms=until - 60_000)).held[ident]
            assert early[0] == 1 and abs(early[1] - until) <= 60_000
            done = await erase.erase(db, store.client, PLAYER, now_ms=until)
            assert done.rows == {(*ident, "match_results"): 1} and done.held == done.left == {}
            assert not (await of_player(db, config.id, board.incarnation, True))["match_results"]
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(config.id)


async def test_an_erase_waits_for_the_entries_of_before_the_removal_still_in_a_journal(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Two archivers commit a journal's entries out of order: one read the player's result and died
    before its commit, another archived the removal after it; the first entry comes in once it is
    taken over. An erase in between removes nothing and must not answer that none of the player's
    results is left (exit 0): it says the board's journals still hold entries of before the
    removal (exit 3), and a call once they are archived removes the row they brought."""
    async with own_db(postgres_url, "erase_late") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        board = await new_board(store, unique("erase-late"))
        ident = (board.config.id, board.incarnation)
        try:
            now = times.now_ms()
            await board.submit([Score(PLAYER, 10, "m1", now - 60_000), Score("p001", 5, "m2", now - 60_000)])
            for prefix in board.prefixes:  # an archiver reads the results and dies before its commit
                key = keys.journal_key(prefix)
                if await raw.exists(key):
                    await raw.xgroup_create(key, GROUP, id="0")
                    await raw.xreadgroup(GROUP, "dead", {key: ">"})
            await moderation.remove(board, [PLAYER])
            late = Archiver(raw, store, db, "late", claim_idle_s=3600)  # the removal alone
            await late.refresh()
            while await late.round():
                pass
            cur = await db.execute("SELECT count(*) FROM player_removals WHERE player_id = %s", (PLAYER,))
            assert (await cur.fetchone()) == (1,)
            assert not (await of_player(db, *ident, True))["match_results"]

            done = await erase.erase(db, store.client, PLAYER, now_ms=past_window())
            assert done.rows == {} and done.left == {} and done.held == {}
            assert done.unarchived == {ident}
            command = ["erase", PLAYER, "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 3

            await archived(raw, store, db)  # taken over: the result comes in, after the removal's row
            assert (await of_player(db, *ident, True))["match_results"]
            done = await erase.erase(db, store.client, PLAYER, now_ms=past_window())
            assert done.rows == {(*ident, "match_results"): 1}
            assert done.left == done.held == {} and done.unarchived == set()
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(board.config.id)


@pytest.mark.parametrize(("mode", "shards"), [("best", 3), ("incr", 1)])
async def test_an_erase_across_a_reshard_keeps_what_the_board_counts(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch, mode: str, shards: int
) -> None:
    """A board of 2 shards resharded, its mover stopped between the cut-over and the re-homing of the
    archive's rows: rows of the old layout keep its shard numbers, the removals made since have the
    new ones. Erases then (and after the resumed reshard re-homed the rows) remove only what no
    shard counts: the board reconciles without drift and rebuilds to what Redis held, with the
    results posted after each removal."""
    from shardlb.reshard import Resharder
    from tests.test_rebuild import archive_round

    async with own_db(postgres_url, f"erase_reshard_{mode}") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
        config = BoardConfig.from_dict(unique("erase-reshard"), {"mode": mode, "sharding": {"shards": 2}})
        board, _ = await store.create(config)
        a = Archiver(raw, store, db, "erase-reshard", claim_idle_s=0)
        players = [f"r{i:02d}" for i in range(24)]
        ahead = past_window() + PAST_WINDOW_MS

        async def archive_while(run: Any) -> Any:
            stop = asyncio.Event()

            async def archive() -> None:
                while not stop.is_set():
                    await a.refresh()
                    if not await archive_round(a):
                        await asyncio.sleep(0.02)

            task = asyncio.ensure_future(archive())
            try:
                return await run
            finally:
                stop.set()
                await task

        try:
            now = times.now_ms()
            await board.submit([Score(p, 10 + i, f"a-{p}", now - 60_000) for i, p in enumerate(players)], now)
            await moderation.remove(board, players[:8], now_ms=now + 1000)
            since = now + 7 * 60_000  # after the removal's record
            await board.submit([Score(p, 3, f"b-{p}", since) for p in players[:4]], now_ms=since)
            await archived(raw, store, db)

            async def stopped_before_the_rehome(mover: Any, target: Any) -> int:
                raise RuntimeError("the mover stopped before the re-homing")

            real = Resharder._rehome
            monkeypatch.setattr(Resharder, "_rehome", stopped_before_the_rehome)
            mover = Resharder(store, config.id, say=lambda _: None, postgres_url=url, cache_s=0)
            await mover.start(shards, None)
            with pytest.raises(RuntimeError, match="re-homing"):
                await archive_while(mover.run())
            monkeypatch.setattr(Resharder, "_rehome", real)

            board = await store.get(config.id)
            later = times.now_ms() + 20 * 60_000
            await moderation.remove(board, players[8:16], now_ms=later)
            since = later + 7 * 60_000
            await board.submit([Score(p, 4, f"c-{p}", since) for p in players[8:11] + players[16:20]], since)
            await archived(raw, store, db)
            want = set(players) - set(players[:16]) | set(players[:4]) | set(players[8:11])
            assert {e.player_id for e in await board.top(100)} == want
            for player in players[:16]:
                await erase.erase(db, store.client, player, now_ms=ahead)
            before = await board.top(100)

            mover = Resharder(store, config.id, say=lambda _: None, postgres_url=url, cache_s=0)
            await archive_while(mover.run())
            await archived(raw, store, db)
            board = await store.get(config.id)
            assert board.layout.physical == shards and await board.top(100) == before
            for player in players[:16]:
                await erase.erase(db, store.client, player, now_ms=ahead)
            assert not [c for c in await reconcile(rebuilder, board, "total") if c.drift]
            await rebuilder.rebuild(board)
            assert await board.top(100) == before
            cur = await db.execute(
                "SELECT DISTINCT player_id FROM match_results WHERE board = %s AND player_id = ANY(%s)",
                (config.id, players[:16]),
            )
            assert {row[0] for row in await cur.fetchall()} == set(players[:4]) | set(players[8:11])
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(config.id)


async def test_an_erase_with_nothing_to_erase_says_so(
    postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb erase` of a player with no rows printed nothing at all (`shardlb prune` says "nothing
    left to prune"): it says so now."""
    async with own_db(postgres_url, "erase_nothing") as url:
        command = ["erase", unique("nobody"), "--redis", cluster_url, "--postgres", url]
        capsys.readouterr()
        assert await asyncio.to_thread(main, command) == 0
        assert capsys.readouterr().out == "nothing to erase\n"


def test_an_erases_lines_count_one_row_as_one() -> None:
    """What `shardlb erase` prints (``erase.lines``): "1 rows" was printed for a single row."""
    done = erase.Erased(
        rows={("b", "i1", "match_results"): 1, ("*", "", "refused_results"): 2},
        left={("c", "i2"): 1},
        kept={"moderation_audit": 1},
        held={("d", "i3"): (1, 0)},
        unarchived=set(),
    )
    assert erase.lines(done) == [
        "b (incarnation i1): 1 row of match_results removed",
        "every board: 2 rows of refused_results removed",
        "c (incarnation i2): 1 result still counts: not removed",
        "d (incarnation i3): 1 result of before the removal kept for the dedup window (a rebuild's retry "
        f"records): run it again from {times.format_ms(0)}",
        "kept on purpose: 1 row of moderation_audit",
    ]
    nothing_now = erase.Erased({}, {}, {}, {("d", "i3"): (2, 0)}, set())
    assert erase.lines(nothing_now)[0] == "nothing erased yet"
