"""Moderation in the library (shardlb/moderation.py) against the suite's cluster and PostgreSQL: a
removed player is absent from every read of every period and from a rebuild, as the reference board
says after the same removal, on random workloads of every strategy; a retried or half-applied removal
converges; a banned player is left out of a rebuild; the inactive cleanup removes exactly the stale
players, a bounded number per pass, journaled so that a rebuild agrees, and a replay of a result a
player had before it stays out for the dedup window."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import psycopg
import pytest

from shardlb import archive, journal, keys, moderation, periods, reconcile, times
from shardlb.archive import connect_db
from shardlb.board import MAX_FUTURE_MS, Board, Score
from shardlb.cli import main
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts
from shardlb.errors import (
    BoardNotFound,
    InvalidInput,
    NotAcknowledged,
    PlayerNotFound,
    Rebuilding,
    Resharding,
)
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.removal_support import JournalReads, filled
from tests.test_ack import key_replica_pid, stopped
from tests.test_board import HOUR, sharding
from tests.test_board_retries import fail_band_once
from tests.test_rebuild import Writer, archiver, check, damage, drain, own_archive
from tests.test_reshard_state import make_board

pytestmark = pytest.mark.cluster

DAY = 86_400_000


async def held(bans: moderation.Bans, board: str) -> list[moderation.Ban]:
    """The bans of ``board`` that Redis's list holds (the list is the suite's cluster's)."""
    return [b for b in await bans.all() if b.board == board]


def forget(ref: ReferenceBoard, player: str, at_ms: int | None = None) -> None:
    """The reference's removal (``ReferenceBoard.remove``): with ``at_ms``, the time given to
    moderation.remove, results achieved before it are refused from then on."""
    ref.remove(player, at_ms)


async def assert_absent(board: Board, ref: ReferenceBoard, player: str) -> None:
    """No read of any period finds ``player``: the player reads, around and query included."""
    for name in ref.boards:
        api = "total" if name == "total" else "daily:" + name[2:]
        view = board.resolve(api)
        with pytest.raises(PlayerNotFound):
            await board.player(player, view)
        with pytest.raises(PlayerNotFound):
            await board.around(player, 3, view)
        assert player not in {e.player_id for e in await board.query([player, "p000"], view)}
        assert player not in {e.player_id for e in await board.entries(0, 1000, view)}


async def delete_entries(raw: Any, board: Board) -> list[journal.Entry]:
    found = []
    for prefix in board.prefixes:
        for entry_id, fields in await raw.xrange(keys.journal_key(prefix)):
            entry = journal.decode(entry_id, fields)
            if entry.removed:
                found.append(entry)
    return found


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({"scope": "board"}, "missing_field", "scope 'board' names its board"),
        ({"scope": "board", "board": None}, "missing_field", "scope 'board' names its board"),
        ({"scope": "board", "board": "a b"}, "invalid_id", "ids are"),
        ({"scope": "all", "board": "arena"}, "invalid_input", "scope 'all' names no board"),
    ],
)
def test_a_ban_body_says_what_its_board_field_lacks(body: dict[str, Any], code: str, words: str) -> None:
    """A ban of one board sent without the board was refused as a malformed id ("ids are 1-64
    characters ..."), which a caller who left the field out cannot tell from a typo (until
    2026-12-06)."""
    with pytest.raises(InvalidInput) as e:
        moderation.parse_scope(body)
    assert (e.value.code, e.value.field) == (code, "board")
    assert words in str(e.value)


@pytest.mark.parametrize(
    ("strategy", "mode"), [("hash", "best"), ("region", "set"), ("band", "incr"), ("band", "best")]
)
async def test_a_removed_player_is_absent_from_every_read_and_from_a_rebuild(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, strategy: str, mode: str
) -> None:
    config = BoardConfig.from_dict(
        f"moderation-{strategy}-{mode}",
        {"mode": mode, "periods": ["daily"], "points_max": 500, "sharding": sharding(strategy, 3)},
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    try:
        w = Writer(board, f"remove/{strategy}/{mode}")
        for _ in range(3):
            await w.batch()
        await drain(a)  # some results archived and trimmed ...
        await w.batch()  # ... some only in the journals
        present = sorted(w.ref.boards["total"])
        gone = present[:2] + present[-2:]
        removed_at = times.now_ms()
        assert await moderation.remove(board, gone, now_ms=removed_at) == set(gone)
        for player in gone:
            forget(w.ref, player, removed_at)
            await assert_absent(board, w.ref, player)
        await check(board, w.ref)
        assert await moderation.remove(board, gone) == set()  # again: nothing more to remove
        removed = [p for e in await delete_entries(raw, board) for p in e.removed]
        assert sorted(removed) == sorted(gone)  # one delete entry per player and shard, journaled once
        for _ in range(2):
            await w.batch()  # later results (retries of earlier ones among them) count again
        await check(board, w.ref)
        await drain(a)  # the delete entries reach PostgreSQL between results before and after them
        await w.batch()
        for period in ("total", "daily"):  # Redis after the removal agrees with PostgreSQL's rule
            assert not any(c.drift for c in await reconcile.reconcile(rebuilder, board, period))
        await damage(board, raw)
        await rebuilder.rebuild(board)
        await check(board, w.ref)
        still_gone = [p for p in gone if p not in w.ref.boards["total"]]
        for player in still_gone:
            await assert_absent(board, w.ref, player)
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_removal_that_failed_half_way_converges_when_retried(store: BoardStore) -> None:
    """The band shards' part of a removal is lost once: the player is then still in a band shard,
    and the retry of the same removal finishes it, as one call would have."""
    config = BoardConfig.from_dict("moderation-retry", {"sharding": sharding("band", 3)})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        players = [f"p{i}" for i in range(20)]
        await board.submit([Score(p, 10 * i, f"m{i}", now) for i, p in enumerate(players)], now)
        ref = ReferenceBoard(config)
        ref.submit([Score(p, 10 * i, f"m{i}", now) for i, p in enumerate(players)], now)
        failing = fail_band_once(board)
        with pytest.raises(ConnectionError):
            await moderation.remove(board, ["p7"])
        assert failing.failures == 1
        home = board.prefixes[board.layout.home("p7")]
        assert await store.client.hget(keys.pending_key(home), "p7") is not None  # recorded as unfinished
        assert await moderation.remove(board, ["p7"]) == set()  # the home shard had nothing left ...
        assert await store.client.hget(keys.pending_key(home), "p7") is None
        version = await store.client.hget(keys.version_key(home), "p7")
        for band in board.prefixes[config.sharding.shards :]:
            assert await store.client.hget(keys.version_key(band), "p7") == version  # every band took it
        forget(ref, "p7")
        assert [e.player_id for e in await board.top(100)] == [row[1] for row in ref.order()]  # ... done
        later = times.now_ms() + MAX_FUTURE_MS + 2_000  # achieved after the removal's record
        await board.submit([Score("p7", 3, "m-again", later)], later)  # a later result re-adds cleanly
        ref.submit([Score("p7", 3, "m-again", later)], later)
        assert [(e.player_id, e.points) for e in await board.top(100)] == [(r[1], r[2]) for r in ref.order()]
        assert await board.repair() == 0
    finally:
        await store.delete(config.id)


async def test_a_replay_of_a_removed_player_whose_band_drop_is_pending_finishes_it(store: BoardStore) -> None:
    """A band board's removal whose band part is lost leaves the drop pending, and the player's total
    gone from the home shard. A replay of a result of before the removal (a game server's retry) is
    a duplicate there, and its write call answers the pending drop with no total: the call sends the
    drop to every band (as the repair does) and answers the replay. Until this was found the call
    raised ValueError on the empty total, a 500 for a retry of a score, the others' moves unsent."""
    config = BoardConfig.from_dict("moderation-replay-pending", {"sharding": sharding("band", 3)})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        first = [Score(f"p{i}", 10 * i, f"m{i}", now) for i in range(20)]
        await board.submit(first, now)
        failing = fail_band_once(board)
        with pytest.raises(ConnectionError):
            await moderation.remove(board, ["p7"], now_ms=now + 1000)
        assert failing.failures == 1
        replayed = await board.submit([first[7], Score("p3", 5, "m-later", now)], now + 2000)
        assert [r.status for r in replayed] == ["duplicate", "unchanged"]
        home = board.prefixes[board.layout.home("p7")]
        assert await store.client.hget(keys.pending_key(home), "p7") is None
        for band in board.prefixes[config.sharding.shards :]:
            assert await store.client.zscore(keys.period_key(band, "total"), "p7") is None
        assert "p7" not in [e.player_id for e in await board.top(100)]
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("posted_before_the_retry", [True, False])
async def test_a_removal_retried_with_its_request_keeps_later_results_and_finishes_its_band_part(
    store: BoardStore, posted_before_the_retry: bool
) -> None:
    """A band board's removal named by a request (the router passes the X-Request-Id) loses its
    band part once; the player posts a later result before or after the retry of the same request.
    The retry finishes the band part as one call would have (the band shards drop the row the
    removal left, or take the later result's move) and keeps the later result, where it ran the
    removal again; a removal named by another request is a removal of its own."""
    config = BoardConfig.from_dict("moderation-request", {"sharding": sharding("band", 3)})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        players = [f"p{i}" for i in range(20)]
        ref = ReferenceBoard(config)
        first = [Score(p, 10 * i, f"m{i}", now) for i, p in enumerate(players)]
        await board.submit(first, now)
        ref.submit(first, now)
        failing = fail_band_once(board)
        with pytest.raises(ConnectionError):
            await moderation.remove(board, ["p7"], now_ms=now, request="remove/r-1")
        assert failing.failures == 1
        forget(ref, "p7", now)
        later = now + MAX_FUTURE_MS + 2_000  # achieved after the removal's record
        if posted_before_the_retry:
            await board.submit([Score("p7", 3, "m-again", later)], later)
            ref.submit([Score("p7", 3, "m-again", later)], later)
        assert await moderation.remove(board, ["p7"], request="remove/r-1") == {"p7"}  # as the first
        if not posted_before_the_retry:
            await board.submit([Score("p7", 3, "m-again", later)], later)
            ref.submit([Score("p7", 3, "m-again", later)], later)
            assert await moderation.remove(board, ["p7"], request="remove/r-1") == {"p7"}
        home = board.prefixes[board.layout.home("p7")]
        assert await store.client.hget(keys.pending_key(home), "p7") is None
        assert [(e.player_id, e.points) for e in await board.top(100)] == [(r[1], r[2]) for r in ref.order()]
        assert (await board.player("p7")).entry.points == 3
        assert await board.repair() == 0
        assert await moderation.remove(board, ["p7"], request="remove/r-2") == {"p7"}
        forget(ref, "p7")
        assert [e.player_id for e in await board.top(100)] == [row[1] for row in ref.order()]
    finally:
        await store.delete(config.id)


async def test_a_removal_lost_on_the_players_shard_is_finished_at_the_first_calls_time(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A region board's removal (one shard per region) named by a request reaches the shard of a
    region the player never played in, and is lost on the player's own. The retry of the request,
    a minute later, removes the player there at the first call's time, as the first call would
    have (both shards hold one record time), and answers that the player was removed."""
    sharded = {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 1}
    config = BoardConfig.from_dict("moderation-lost-home", {"mode": "set", "sharding": sharded})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("p1", 10, "m1", now - 60_000, "eu"), Score("p2", 5, "m2", now, "eu")], now)
        eu, na = board.layout.home("p1", "eu"), board.layout.home("p1", "na")
        remove_on_shard, na_done = moderation.remove_on_shard, asyncio.Event()

        async def lose_eu(board: Board, shard: int, *args: Any, **kwargs: Any) -> list[str]:
            if shard == eu:
                await na_done.wait()  # lost after the na shard's call came back (as below)
                raise ConnectionError("the call to the eu shard was lost")
            try:
                return await remove_on_shard(board, shard, *args, **kwargs)
            finally:
                na_done.set()

        monkeypatch.setattr(moderation, "remove_on_shard", lose_eu)
        with pytest.raises(ConnectionError):
            await moderation.remove(board, ["p1"], now_ms=now, request="remove/r-1")
        monkeypatch.undo()
        assert (await board.player("p1")).entry.points == 10
        assert await moderation.remove(board, ["p1"], now_ms=now + 60_000, request="remove/r-1") == {"p1"}
        assert [e.player_id for e in await board.top(10)] == ["p2"]
        field = keys.removal_request_field("remove/r-1", "p1")
        held = [await store.client.hget(keys.removals_key(board.prefixes[s]), field) for s in (na, eu)]
        units = moderation.record_units(board, now)
        assert held == [str(units), f"{units}.1"]  # one time; removed on eu only
        late = await board.submit([Score("p1", 9, "m3", now + 1_000, "eu")], now + 60_000)
        assert [r.status for r in late] == ["duplicate"]  # within the first call's record
    finally:
        await store.delete(config.id)


async def test_a_retry_that_keeps_a_later_daily_entry_still_drops_the_old_total_from_the_bands(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A band board's removal of two players on two home shards, named by a request, is lost on
    the second player's shard. That player then posts a worse result on a later day: the total keeps
    the older best (a best board), the new day's board holds the new one. The retry of the request
    removes the total there (achieved before the first call) and keeps the new day's entry, so the
    player has no total any more: the band shards must drop the row too, as the home shard's
    removal of the total says (until this was found, the version was bumped only when nothing was
    kept, and the bands kept listing the player at the old best for good, nothing pending)."""
    sharded = {"strategy": "band", "bands": [0, 100, 1000], "shards": 3}
    config = BoardConfig.from_dict("moderation-kept-day", {"periods": ["daily"], "sharding": sharded})
    board, _ = await store.create(config)
    try:
        names = [f"p{i}" for i in range(20)]
        a = names[0]
        b = next(p for p in names if board.layout.home(p) != board.layout.home(a))
        base = times.now_ms() // DAY * DAY + DAY  # a day boundary ahead: the records stay live
        then = base - HOUR
        first = [Score(a, 50, "m1", then), Score(b, 500, "m2", then), Score("o", 7, "m3", then)]
        await board.submit(first, then)
        remove_on_shard = moderation.remove_on_shard
        lost = board.layout.home(b)
        others = asyncio.Event()

        async def lose_b(board: Board, shard: int, *args: Any, **kwargs: Any) -> list[str]:
            if shard == lost:
                # Lost once the first player's shard has its call done: ``remove`` does not wait
                # for the other calls when one fails, and a retry sent while the first player's
                # was still in flight found no record of the first call anywhere (a state of the
                # retry alone, removing the new day's entry too): the test failed now and then.
                await others.wait()
                raise ConnectionError("the call to the second player's shard was lost")
            try:
                return await remove_on_shard(board, shard, *args, **kwargs)
            finally:
                others.set()

        monkeypatch.setattr(moderation, "remove_on_shard", lose_b)
        with pytest.raises(ConnectionError):
            await moderation.remove(board, [a, b], now_ms=then + 60_000, request="remove/r-1")
        monkeypatch.undo()
        later = base + HOUR  # a new day, past the first call's record
        assert [r.status for r in await board.submit([Score(b, 20, "m4", later)], later)] == ["unchanged"]
        assert await moderation.remove(board, [a, b], now_ms=later + 60_000, request="remove/r-1") == {a, b}
        assert await board.repair() == 0
        assert [e.player_id for e in await board.top(10)] == ["o"]
        with pytest.raises(PlayerNotFound):
            await board.player(b)
        day = "daily:" + periods.names_at(later, config.periods, board.tz)[1][2:]
        assert [(e.player_id, e.points) for e in await board.top(10, board.resolve(day))] == [(b, 20)]
        for band in board.prefixes[config.sharding.shards :]:
            assert await store.client.zscore(keys.period_key(band, "total"), b) is None
    finally:
        await store.delete(config.id)


async def test_a_banned_player_is_left_out_of_a_rebuild(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    config = BoardConfig.from_dict("moderation-ban", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    db = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    bans = moderation.Bans(store.client)
    try:
        w = Writer(board, "ban", players=10)
        for _ in range(3):
            await w.batch()
        await drain(a)
        await w.batch()
        cheat, other = sorted(w.ref.boards["total"])[:2]
        await bans.add(db, moderation.Ban(cheat, config.id, "aimbot", "test", times.now_ms()), "req-1")
        await bans.add(db, moderation.Ban(other, "another-board", "", "test", times.now_ms()), None)
        await rebuilder.rebuild(board)  # the ban alone (no removal): the rebuild leaves the player out
        forget(w.ref, cheat)
        await check(board, w.ref)
        assert await bans.lift(db, cheat, config.id, "test", "appeal", None)
        assert not await bans.lift(db, cheat, config.id, "test", "again", None)
        assert {(b.player, b.board) for b in await bans.all()} >= {(other, "another-board")}
    finally:
        await bans.lift(db, other, "another-board", "test", "cleanup", None)
        await db.close()
        await a.db.close()
        await store.delete(config.id)


async def test_a_ban_retried_after_it_was_half_stored_reaches_the_routers(
    store: BoardStore, postgres_url: str
) -> None:
    """Routers reload the ban list when its version moves. A ban whose record was stored but whose
    version bump failed (a lost connection, a crash between the two) must move it when retried;
    before, the retry found the record (HSETNX 0), bumped nothing, and no router ever loaded it."""
    bans = moderation.Bans(store.client)
    ban = moderation.Ban("half-banned", moderation.ALL, "bot", "test", times.now_ms())
    db = await connect_db(postgres_url)  # the schema in place
    try:
        record = b'{"reason": "bot", "by": "test", "at": 1}'
        await store.client.hsetnx(keys.BANS, moderation.ban_field(ban.board, ban.player), record)
        before = await bans.version()
        await bans.add(db, ban, "retry")
        assert await bans.version() != before
        assert ("half-banned", moderation.ALL) in {(b.player, b.board) for b in await bans.all()}
    finally:
        await bans.lift(db, ban.player, ban.board, "test", "cleanup", None)
        await db.close()


async def test_a_ban_list_version_lost_in_a_failover_is_never_handed_out_again(
    store: BoardStore, postgres_url: str
) -> None:
    """A failover audit's finding: the ban list's version was a counter (INCR). A primary killed
    before its replica had the last change left the promoted replica one version behind, and the
    next change handed out the number a router had already loaded the lost change under: that
    router kept its list, and never refused the player banned by the new change. The state the
    failover leaves is written here by hand (the list and version as the replica had them)."""
    from router.moderation import BanCache

    bans = moderation.Bans(store.client)
    cache = BanCache(bans)
    now = times.now_ms()
    lost = moderation.Ban("lost-in-failover", moderation.ALL, "bot", "test", now)
    later = moderation.Ban("banned-after-failover", moderation.ALL, "bot", "test", now)
    db = await connect_db(postgres_url)
    try:
        before = await store.client.get(keys.BANS_VERSION)
        await bans.add(db, lost, None)
        await cache.refresh()
        assert cache.banned("any", lost.player)
        # The failover: the replica promoted had neither the record nor the version's move.
        await store.client.hdel(keys.BANS, moderation.ban_field(lost.board, lost.player))
        await store.client.set(keys.BANS_VERSION, before or 0)
        await bans.add(db, later, None)
        await cache.refresh()
        assert cache.banned("any", later.player)
        assert not cache.banned("any", lost.player)
    finally:
        for ban in (lost, later):
            await bans.lift(db, ban.player, ban.board, "test", "cleanup", None)
        await db.close()


async def test_a_ban_asked_again_under_another_request_is_audited_and_its_retry_bans_nothing(
    store: BoardStore, postgres_url: str
) -> None:
    """A ban asked for while the same ban was in force (another admin, another X-Request-Id) kept
    the first ban, and wrote no audit row: the audit trail did not show the request, and its retry
    after the ban was lifted found no row of its request and stored the ban again. Now the request
    is audited (its own actor and reason, ``kept`` in the detail), once whatever its retries, sent
    at once too, and its retry after the lift answers the ban it was answered and stores nothing."""
    bans = moderation.Bans(store.client)
    player, now = f"asked-twice-{times.now_ms()}", times.now_ms()
    first = moderation.Ban(player, moderation.ALL, "aimbot", "admin-a", now)
    again = moderation.Ban(player, moderation.ALL, "wallhack", "admin-b", now + 1000)
    db = await connect_db(postgres_url)
    others = [await connect_db(postgres_url) for _ in range(3)]
    try:
        assert await bans.add(db, first, "r1") == (first, True)
        answers = await asyncio.gather(*(bans.add(other, again, "r2") for other in others))
        assert answers == [(first, True)] * 3
        cur = await db.execute(
            "SELECT action, request_id, actor, reason, detail ->> 'kept' FROM moderation_audit "
            "WHERE player_id = %s ORDER BY id",
            (player,),
        )
        assert await cur.fetchall() == [
            ("ban", "r1", "admin-a", "aimbot", None),
            ("ban", "r2", "admin-b", "wallhack", "true"),
        ]
        assert await bans.lift(db, player, moderation.ALL, "admin-a", "appeal", "u1")
        retried = moderation.Ban(player, moderation.ALL, "retry", "admin-b", now + 60_000)
        assert await bans.add(db, retried, "r2") == (first, False)
        assert player not in {b.player for b in await bans.all()}
        cur = await db.execute("SELECT count(*) FROM bans WHERE player_id = %s", (player,))
        assert await cur.fetchone() == (0,)
        cur = await db.execute("SELECT count(*) FROM moderation_audit WHERE player_id = %s", (player,))
        assert await cur.fetchone() == (3,)
    finally:
        await bans.lift(db, player, moderation.ALL, "test", "cleanup", None)
        for conn in (db, *others):
            await conn.close()


@pytest.mark.usefixtures("no_ban_propagation_wait")  # no router: the bans' return alone
async def test_bans_come_back_after_a_total_loss(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A durability audit's finding: bans lived in Redis only as they were made, and `rebuild --all`
    never put them back from PostgreSQL; after a total loss the routers loaded an empty list and
    took a banned player's results again. The restore now writes every ban back and moves the
    version (routers reload the list when it changes)."""
    config = BoardConfig.from_dict("moderation-ban-loss", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    bans = moderation.Bans(store.client)
    now = times.now_ms()
    kept = [
        moderation.Ban("cheat", moderation.ALL, "aimbot", "admin", now),
        moderation.Ban("smurf", config.id, "", "admin", now),
    ]
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url)
        try:
            await board.submit(
                [Score("cheat", 90, "m1", now - 60_000), Score("fair", 40, "m2", now - 60_000)]
            )
            for ban in kept:
                await bans.add(a.db, ban, None)
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            assert await bans.all() == [] and await bans.version() == 0  # what a router loads now
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            assert await bans.all() == kept
            assert await bans.version() > 0
            rebuilt = await store.get(config.id)
            assert [e.player_id for e in await rebuilt.top(10)] == ["fair"]
            assert await asyncio.to_thread(main, command) == 0  # again: the same list
            assert await bans.all() == kept
        finally:
            for ban in kept:  # the list is the cluster's, shared by the suite's tests
                await bans.lift(a.db, ban.player, ban.board, "test", "cleanup", None)
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_rebuild_puts_boards_back_once_a_router_started_after_the_loss_holds_the_bans(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A `make run` check's finding: a router that loaded the ban list after a total loss (started
    since, or one of the release before) holds none, and `rebuild --all` wrote the bans back and put
    the boards back at once: until the router's next refresh it took a banned player's results on a
    board restored (seen: a post answered ``duplicate``, saved only by the player's removal record).
    The boards now go back ``PROPAGATION_S`` after the bans, when every copy refreshed; the router
    here, refreshing as routers do, holds the ban when it first finds the board."""
    from router.moderation import BanCache

    config = BoardConfig.from_dict("moderation-ban-propagation", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    bans = moderation.Bans(store.client)
    now = times.now_ms()
    ban = moderation.Ban("cheat", config.id, "aimbot", "admin", now)
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url)
        refreshing: asyncio.Task[None] | None = None
        try:
            await board.submit([Score("cheat", 90, "m1", now - 60_000), Score("fair", 40, "m2", now)])
            await bans.add(a.db, ban, None)
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            cache = BanCache(moderation.Bans(store.client))  # a router started since
            await cache.refresh()
            assert not cache.banned(config.id, "cheat")
            refreshing = asyncio.create_task(cache.run())
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            rebuilding = asyncio.create_task(asyncio.to_thread(main, command))
            while True:  # as a router finds the board: its record back in the registry
                try:
                    await store.get(config.id)
                    break
                except BoardNotFound:
                    assert not rebuilding.done(), rebuilding.result()
                    await asyncio.sleep(0.005)
            assert cache.banned(config.id, "cheat"), "the board came back before the router's ban"
            assert await rebuilding == 0
        finally:
            if refreshing is not None:
                cache.closed = True
                refreshing.cancel()
            await bans.lift(a.db, ban.player, ban.board, "test", "cleanup", None)
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


@pytest.mark.parametrize("since", ["ban", "lift"])
async def test_a_ban_list_lost_then_changed_is_written_back_at_the_archivers_next_refresh(
    store: BoardStore, raw: Any, postgres_url: str, since: str
) -> None:
    """The archiver wrote the list back (``Bans.recover``) only when its key was missing: a ban
    made after a loss and before the archiver's next refresh (an admin's, through any router) wrote
    its own record, the key was there again, and every other ban stayed lost for good (until a
    `rebuild --all`, which the runbook of a total loss runs, but not that of the list's master lost
    alone). Failed before the fix with the ban: the list held the new ban alone. A lift made after
    the loss leaves the key missing, and was written back before too. Now a restore marks the list
    whole (``keys.BANS_WHOLE``, lost with it), and the archiver writes back a list without the
    mark."""
    bans = moderation.Bans(store.client)
    now = times.now_ms()
    board = "moderation-lost-list"
    kept = [moderation.Ban(p, board, "aimbot", "admin", now) for p in ("lost-a", "lost-b")]
    late = moderation.Ban("banned-after-the-loss", board, "wallhack", "admin", now + 1000)
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url, only=set())
        try:
            for ban in kept:
                await bans.add(a.db, ban, None)
            await a.refresh()
            assert await held(bans, board) == kept
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            if since == "ban":
                await bans.add(a.db, late, None)
                expected = sorted([*kept, late])
            else:
                await bans.lift(a.db, kept[1].player, board, "admin", "appeal", None)
                expected = kept[:1]
            await a.refresh()
            assert await held(bans, board) == expected
            version = await bans.version()
            await a.refresh()  # whole again: not written again
            assert await bans.version() == version
        finally:
            for ban in (*kept, late):
                await bans.lift(a.db, ban.player, ban.board, "test", "cleanup", None)
            await a.db.close()


async def test_a_first_ban_marks_the_list_and_a_restore_cut_short_by_a_loss_does_not(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark that tells the archiver a list is whole (``keys.BANS_WHOLE``): the first ban of a
    list PostgreSQL holds no other ban of writes it with its record (a new install's first ban is
    not taken for a loss, and written back), and a list never marked (written by a release before)
    is written back once. A restore during which the list is lost again (the list's keys and its
    mark gone with the master, after its first page) leaves its last pages on an unmarked list,
    which the next refresh writes back whole."""
    bans = moderation.Bans(store.client)
    now = times.now_ms()
    board = "moderation-marked-list"
    first, second = (moderation.Ban(p, board, "bot", "admin", now) for p in ("first", "second"))
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url, only=set())
        real = store.client.execute_command
        try:
            await raw.delete(keys.BANS_WHOLE)  # a list never marked
            await bans.add(a.db, first, None)  # PostgreSQL holds no other ban
            assert await bans.whole()
            version = await bans.version()
            assert await bans.recover(a.db) is None and await bans.version() == version
            await bans.add(a.db, second, None)
            await raw.delete(keys.BANS_WHOLE)  # as the release before left it
            assert await bans.recover(a.db) == 2
            assert await bans.whole() and await bans.version() != version
            assert await bans.recover(a.db) is None

            pages: list[tuple[Any, ...]] = []

            async def lost(*args: Any, **kwargs: Any) -> Any:
                reply = await real(*args, **kwargs)
                if args[:2] == ("HSET", keys.BANS) and not pages:  # its first page written, then lost
                    pages.append(args)
                    await raw.delete(keys.BANS, keys.BANS_WHOLE)
                return reply

            monkeypatch.setattr(moderation, "BANS_PAGE", 1)
            monkeypatch.setattr(store.client, "execute_command", lost)
            assert await bans.restore(a.db) == 2
            monkeypatch.undo()
            assert not await bans.whole()
            assert len(await held(bans, board)) == 1  # the page after the loss alone
            assert await bans.recover(a.db) == 2
            assert await bans.whole() and await held(bans, board) == [first, second]
        finally:
            monkeypatch.undo()
            for ban in (first, second):
                await bans.lift(a.db, ban.player, ban.board, "test", "cleanup", None)
            await a.db.close()


async def test_an_unmarked_list_with_no_ban_to_write_back_is_marked_once(
    store: BoardStore, postgres_url: str
) -> None:
    """A list unmarked while PostgreSQL holds no ban (a new install's, one whose slot was lost after
    every ban was lifted, one of the release before) stayed unmarked until a first ban: every
    archiver's refresh (2 s) read PostgreSQL again, for good on an install with no ban, and a
    router's copy kept across a loss went on keeping, beside the list, a ban lifted since that it
    could not follow (``BanCache.load``). Failed before: the list stayed unmarked. Now the refresh
    marks it whole (under a restore's lease, so a loss or a first ban meanwhile is not taken for
    it), moving nothing, and the next reads nothing of PostgreSQL."""
    bans = moderation.Bans(store.client)
    async with own_archive(postgres_url) as url:
        db = await connect_db(url)
        try:
            await store.client.delete(keys.BANS_WHOLE)
            version = await bans.version()
            assert await bans.recover(db) is None
            assert await bans.whole(), "left unmarked: PostgreSQL read again at every refresh"
            assert await bans.version() == version  # nothing written: the routers read nothing
            await db.close()
            assert await bans.recover(db) is None  # one GET: PostgreSQL (closed) not read
        finally:
            await db.close()


async def test_two_archivers_write_a_lost_list_back_once(
    store: BoardStore, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two archivers (every overlay runs two) both find the list unmarked after a loss. The second's
    refresh, while the first's restore wrote (seconds at a large list), took the first's `writing`
    mark for a restore cut short and wrote the list back again beside it: twice the writes, two
    moves that each made every router read the whole list, two WARNINGs; and each restore's mark set
    over the other's, so when each one's next refresh began before the other's end, neither marked
    the list and they went on writing it back in turn. Failed before: the second archiver's refresh
    wrote the list back. Now a restore holds its mark for ``WRITING_MS`` after its last write, and an
    archiver's refresh leaves a list being written alone; a restore cut short (its lease run out) is
    written back at the next refresh."""
    bans = moderation.Bans(store.client)
    board = "moderation-two-archivers"
    now = times.now_ms()
    banned = [moderation.Ban(p, board, "aimbot", "admin", now) for p in ("two-a", "two-b")]
    async with own_archive(postgres_url) as url:
        first, second = await connect_db(url), await connect_db(url)
        real = store.client.execute_command
        writing, go_on = asyncio.Event(), asyncio.Event()
        restoring: asyncio.Task[int | None] | None = None

        async def slow(*args: Any, **kwargs: Any) -> Any:
            if args[:2] == ("HSET", keys.BANS) and not writing.is_set():  # the first's restore, writing
                writing.set()
                await go_on.wait()
            return await real(*args, **kwargs)

        try:
            for ban in banned:
                await bans.add(first, ban, None)
            await store.client.delete(keys.BANS, keys.BANS_WHOLE)  # the list's master lost
            monkeypatch.setattr(moderation, "BANS_PAGE", 1)
            monkeypatch.setattr(store.client, "execute_command", slow)
            restoring = asyncio.create_task(moderation.Bans(store.client).recover(first))
            await writing.wait()
            assert await moderation.Bans(store.client).recover(second) is None, "written back twice"
            go_on.set()
            assert await restoring == 2
            monkeypatch.undo()
            assert await bans.whole() and await held(bans, board) == banned
            assert await bans.recover(second) is None

            # A restore cut short: its mark's lease runs out, and the next refresh writes it back.
            monkeypatch.setattr(moderation, "WRITING_MS", 200)
            await store.client.delete(keys.BANS, keys.BANS_WHOLE)
            token = moderation.WRITING + "cut-short"
            await store.client.set(keys.BANS_WHOLE, token, px=moderation.WRITING_MS)
            assert await bans.recover(second) is None  # a restore under way, as far as it can tell
            await asyncio.sleep(0.4)
            assert await bans.recover(second) == 2
            assert await bans.whole() and await held(bans, board) == banned
        finally:
            monkeypatch.undo()
            go_on.set()
            if restoring is not None:
                with contextlib.suppress(Exception):
                    await restoring
            for ban in banned:
                await bans.lift(first, ban.player, ban.board, "test", "cleanup", None)
            await first.close()
            await second.close()


@pytest.mark.usefixtures("no_ban_propagation_wait")  # no router: the bans' return alone
async def test_the_bans_a_rebuild_restores_wait_for_a_replica_of_the_list(
    store: BoardStore, raw: Any, postgres_url: str, cluster: LocalCluster
) -> None:
    """A failover audit's finding: bans and lifts waited for a replica of the list (41c70cc), but
    `rebuild --all` wrote the bans back (``Bans.restore``) on the list's primary alone, and went on
    to restore the boards: a kill -9 of that primary within its replication lag lost the list
    again, and routers took the banned players' results on the boards restored. The restore now
    waits for a replica wherever the list's primaries have one, as the reshard's mover does, else
    stops with NotAcknowledged (running it again is safe)."""
    bans = moderation.Bans(store.client)
    ban = moderation.Ban("restored-on-a-replica", moderation.ALL, "bot", "admin", times.now_ms())
    async with own_archive(postgres_url) as url:
        db = await connect_db(url)
        try:
            await bans.add(db, ban, None)
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
            rebuilder.replica_wait_ms = 300  # the replica is stopped well within the node timeout
            with stopped(key_replica_pid(cluster, keys.BANS)), pytest.raises(NotAcknowledged):
                await rebuilder.restore(store)
            assert await rebuilder.restore(store) == []  # confirmed, the replica back
            assert ban in await bans.all()
        finally:
            await bans.lift(db, ban.player, ban.board, "test", "cleanup", None)
            await db.close()


async def test_a_restore_removes_a_ban_whose_lift_redis_lost(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A failover audit's finding: ``Bans.restore`` wrote PostgreSQL's bans over Redis's list and
    removed none, so a lift whose HDEL a failover lost (PostgreSQL's row deleted, the promoted
    replica still holding the record) kept refusing the player after `rebuild --all`, though
    PostgreSQL said the ban was lifted. The restore now leaves Redis's list as PostgreSQL's, and
    moves the version (routers reload); the bans in force are written before anything is removed."""
    bans = moderation.Bans(store.client)
    now = times.now_ms()
    kept = moderation.Ban("restore-kept", moderation.ALL, "bot", "admin", now)
    lifted = moderation.Ban("restore-lifted", moderation.ALL, "bot", "admin", now)
    async with own_archive(postgres_url) as url:
        db = await connect_db(url)
        try:
            for ban in (kept, lifted):
                await bans.add(db, ban, None)
            record = await raw.hget(keys.BANS, moderation.ban_field(lifted.board, lifted.player))
            await bans.lift(db, lifted.player, lifted.board, "admin", "appeal", None)
            # The lift's HDEL lost in a failover: the promoted replica has the record still.
            await raw.hset(keys.BANS, moderation.ban_field(lifted.board, lifted.player), record)
            assert lifted in await bans.all()
            before = await bans.version()
            assert await bans.restore(db) == 1
            assert await bans.all() == [kept]
            assert await bans.version() != before
            assert await bans.restore(db) == 1  # again: the same list
            assert await bans.all() == [kept]
        finally:
            for ban in (kept, lifted):
                await bans.lift(db, ban.player, ban.board, "test", "cleanup", None)
            await db.close()


async def test_a_ban_and_a_lift_made_while_a_restore_runs_end_as_they_made_them(
    store: BoardStore, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore writes the bans it read from PostgreSQL, then sets right what differs: a lift
    made between its read and its write (the restore's write puts the record back) is removed, and
    a ban made meanwhile (not among the rows it read) stays."""
    bans = moderation.Bans(store.client)
    now = times.now_ms()
    lifted = moderation.Ban("restore-lifted-meanwhile", moderation.ALL, "bot", "admin", now)
    made = moderation.Ban("restore-made-meanwhile", moderation.ALL, "bot", "admin", now)
    async with own_archive(postgres_url) as url:
        db = await connect_db(url)
        real, meanwhile = store.client.execute_command, []

        async def write(*args: Any, **kwargs: Any) -> Any:
            # The list's next HSET is the restore's write of the rows it read.
            if args[:2] == ("HSET", keys.BANS) and not meanwhile:
                meanwhile.append(True)
                await bans.lift(db, lifted.player, lifted.board, "admin", "appeal", None)
                await bans.add(db, made, None)
            return await real(*args, **kwargs)

        try:
            await bans.add(db, lifted, None)
            monkeypatch.setattr(store.client, "execute_command", write)
            assert await bans.restore(db) == 1
            assert meanwhile
            assert await bans.all() == [made]
        finally:
            monkeypatch.undo()
            for ban in (lifted, made):
                await bans.lift(db, ban.player, ban.board, "test", "cleanup", None)
            await db.close()


async def test_the_inactive_cleanup_removes_exactly_the_stale_players_a_bounded_number_per_pass(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    config = BoardConfig.from_dict(
        "moderation-idle", {"mode": "incr", "inactive_after": 3600, "sharding": sharding("hash", 3)}
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    rng = random.Random("idle")
    try:
        now = times.now_ms()
        ref = ReferenceBoard(config)
        last: dict[str, int] = {}
        for n in range(300):
            player, at = f"p{rng.randrange(60):02d}", now - rng.randrange(0, 5) * HOUR
            score = Score(player, rng.randrange(1, 50), f"m{n}", at)
            # The activity set keeps the arrival time of each player's last applied result.
            await board.submit([score], now_ms=at)
            ref.submit([score], now_ms=at)
            last[player] = max(last.get(player, 0), at)
        await drain(a)
        cutoff = now - 3600 * 1000
        stale = {p for p, at in last.items() if at <= cutoff}
        assert stale and len(stale) < len(last)
        passes = []
        while removed := await moderation.cleanup(board, now_ms=now, limit=2):
            assert removed <= 2 * config.sharding.shards  # bounded work per pass
            passes.append(removed)
        assert sum(passes) == len(stale) and len(passes) > 1
        for player in stale:
            forget(ref, player)
        await check(board, ref)
        await drain(a)
        await damage(board, raw)
        await rebuilder.rebuild(board)  # the cleanup's delete entries hold in the rebuild too
        await check(board, ref)
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("lost", ["redis", "activity"])
async def test_players_idle_before_a_loss_are_still_cleaned_up(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, lost: str
) -> None:
    """A durability audit's finding: the cleanup removes the players its activity set lists, and a
    rebuild did not put that set back; after a total loss of Redis (or a shard's activity set lost)
    no player idle before it was ever cleaned up. A rebuild now puts back each player's latest
    arrival (the time of its journal id, from the journal and from PostgreSQL), keeping a later
    post's time (ZADD GT)."""
    config = BoardConfig.from_dict(
        f"moderation-idle-{lost}", {"inactive_after": 3600, "sharding": sharding("hash", 3)}
    )
    board, _ = await store.create(config)
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url)
        try:
            await board.submit([Score("idle", 90, "m1", times.now_ms() - 60_000)])
            await asyncio.sleep(0.05)
            between = times.now_ms()  # the cleanup's cutoff: idle posted before it, busy after
            await asyncio.sleep(0.05)
            await board.submit([Score("busy", 40, "m2", times.now_ms())])
            if lost == "redis":
                await drain(a)
                await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
                command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, command) == 0
            else:  # the journal still holds every result
                await raw.delete(*(keys.activity_key(p) for p in board.prefixes))
                await Rebuilder(raw, Scripts.register(raw).rebuild, a.db).rebuild(board)
            rebuilt = await store.get(config.id)
            assert sorted(e.player_id for e in await rebuilt.top(10)) == ["busy", "idle"]
            assert await moderation.cleanup(rebuilt, now_ms=between + 3600_000) == 1
            assert [e.player_id for e in await rebuilt.top(10)] == ["busy"]
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "set", "incr"])
async def test_a_replay_after_the_inactive_cleanup_does_not_bring_the_player_back(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, mode: str
) -> None:
    """api.md: replaying the same (match_id, player_id) never changes a board. The inactive cleanup
    recorded no removal, so on best and set boards a replay of a result the player had before the
    cleanup (a game server's retry, with or without its time, a worse result kept nowhere dated
    ahead of the clock), within the dedup window, answered `improved` and put the player back (incr's
    dedup refused it). The cleanup now records each player it removes at their last post (5 minutes
    on, as a removal's record, on best and set boards): those replays are duplicates, after a total
    loss and `rebuild --all` too, and a new result achieved after that counts at once, one that
    arrives late too."""
    config = BoardConfig.from_dict(
        f"moderation-idle-replay-{mode}",
        {"mode": mode, "periods": ["daily"], "inactive_after": 60, "sharding": sharding("hash", 2)},
    )
    board, _ = await store.create(config)
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url)
        try:
            posted = times.now_ms()  # idle's last post (the activity set's time)
            old = [
                Score("idle", 90, "m1", posted - 60_000),
                Score("idle", 50, "m2", posted + 120_000),  # worse, ahead of the clock: kept nowhere
                Score("idle", 80, "m3", None),  # its time pinned: a retry gets it again
            ]
            await board.submit(old, now_ms=posted)
            await board.submit([Score("busy", 40, "b1", posted)], now_ms=posted + 2_000)
            swept = posted + 61_000
            assert await moderation.cleanup(board, now_ms=swept) == 1

            async def replayed(at: int) -> None:
                got = await board.submit(old, now_ms=at)
                assert [r.status for r in got] == ["duplicate"] * 3, got
                assert [e.player_id for e in await board.top(10)] == ["busy"]
                with pytest.raises(PlayerNotFound):
                    await board.player("idle", board.resolve("daily"))

            await replayed(swept + 1_000)
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            board = await store.get(config.id)
            await replayed(swept + 2_000)
            # Achieved after the last post (past the 5 minutes a result of before may be dated
            # ahead): counts at once, a late one too.
            later = posted + MAX_FUTURE_MS + 120_000
            late, fresh = Score("idle", 60, "m4", later - 60_000), Score("idle", 70, "m5", later)
            got = await board.submit([late, fresh], now_ms=later)
            assert [r.status for r in got] == ["improved", "improved"], got
            assert got[1].points == (130 if mode == "incr" else 70)
            assert {e.player_id for e in await board.top(10)} == {"busy", "idle"}
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_the_inactive_cleanup_records_a_player_for_a_dedup_window_from_their_last_post(
    store: BoardStore,
) -> None:
    """The cleanup's record of a player it removes (a replay of a result they had is a duplicate)
    is at their last post and lives a dedup window from it, as the record of a removal at that
    time: a player whose last post is older than the window gets none (every first post of their
    results is that old, and a replay past the window counts again, as after any removal), and a
    later removal's scan forgets the others once their window is over. Memory: one field a player
    removed within a window of their last post, none on a board whose ``inactive_after`` is longer."""
    window_s = 3600
    config = BoardConfig.from_dict(
        "moderation-idle-record",
        {"inactive_after": 600, "dedup_window_s": window_s, "sharding": {"shards": 1}},
    )
    board, _ = await store.create(config)
    record = keys.removals_key(board.prefixes[0])
    try:
        now = times.now_ms()
        long_ago = now - window_s * 1000 - MAX_FUTURE_MS - 60_000
        old, recent = Score("old", 5, "m1", long_ago), Score("recent", 5, "m2", now - 1_800_000)
        await board.submit([old], now_ms=long_ago)
        await board.submit([recent], now_ms=now - 1_800_000)
        assert await moderation.cleanup(board, now_ms=now) == 2
        positions = {keys.removal_position_field(p) for p in ("old", "recent")}
        assert set(await board.client.hkeys(record)) == {"recent", *positions}
        got = await board.submit([old, recent], now_ms=now + 1_000)
        assert [r.status for r in got] == ["improved", "duplicate"], got
        later = now + window_s * 1000 + MAX_FUTURE_MS  # recent's window is over
        await moderation.remove(board, ["someone"], now_ms=later)
        assert "recent" not in set(await board.client.hkeys(record))
    finally:
        await store.delete(config.id)


async def test_shardlb_cleanup_runs_one_pass(
    store: BoardStore, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = BoardConfig.from_dict("moderation-cli", {"inactive_after": 60, "sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("old", 5, "m1", now - HOUR)], now_ms=now - HOUR)
        await board.submit([Score("new", 5, "m2", now)], now_ms=now)
        assert await asyncio.to_thread(main, ["cleanup", config.id, "--redis", cluster_url]) == 0
        assert f"{config.id}: 1 inactive player(s) removed" in capsys.readouterr().out
        assert [e.player_id for e in await board.top(10)] == ["new"]
        # A board named that has no inactive_after: said so (it printed nothing; an ops audit's finding).
        plain, _ = await store.create(BoardConfig.from_dict("moderation-cli-plain", {}))
        assert await asyncio.to_thread(main, ["cleanup", plain.config.id, "--redis", cluster_url]) == 0
        assert "moderation-cli-plain: no inactive_after setting" in capsys.readouterr().out
    finally:
        await store.delete(config.id)
        with contextlib.suppress(Exception):
            await store.delete("moderation-cli-plain")


async def test_a_board_whose_cleanup_fails_does_not_hold_up_the_other_boards(store: BoardStore) -> None:
    """One cleanup pass goes over every board with ``inactive_after``. A board that refused it (here
    one of its shards marked moved away by a reshard, as a dead master or a board deleted meanwhile
    would also refuse) ended the pass there, so every board after it kept its idle players, pass
    after pass, for as long as that board failed (a retry records audit's finding, 2026-12-05).
    Now each board is cleaned up on its own, and the pass raises the failure once it has gone
    over them all (the archiver logs it as an outage)."""
    configs = [
        BoardConfig.from_dict(f"moderation-pass-{n}", {"inactive_after": 60, "sharding": sharding("hash", 1)})
        for n in ("a", "b")
    ]
    boards = [(await store.create(c))[0] for c in configs]
    now = times.now_ms()
    try:
        for board in boards:
            await board.submit([Score("old", 5, "m1", now - HOUR)], now_ms=now - HOUR)
            await board.submit([Score("new", 5, "m2", now)], now_ms=now)
        moved = keys.gone_key(boards[0].prefixes[0])[:-4] + "mv"  # write.lua's and remove.lua's `mv`
        await boards[0].client.set(moved, "m")
        with pytest.raises(Resharding):
            await moderation.cleanup_pass(store, [c.id for c in configs])
        assert [e.player_id for e in await boards[1].top(10)] == ["new"]
        await boards[0].client.delete(moved)
        assert await moderation.cleanup_pass(store, [c.id for c in configs]) == {
            configs[0].id: 1,
            configs[1].id: 0,
        }
        assert [e.player_id for e in await boards[0].top(10)] == ["new"]
    finally:
        for c in configs:
            with contextlib.suppress(Exception):
                await store.delete(c.id)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_removal_during_a_rebuild_holds_after_the_swap(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, mode: str
) -> None:
    """The removal (and a later result of the player) lands after the rebuild's snapshot position:
    the catch-up applies the removal to the new keys before the later result."""
    config = BoardConfig.from_dict(
        f"moderation-catch-up-{mode}", {"mode": mode, "periods": ["daily"], "sharding": sharding("hash", 2)}
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url)
    try:
        w = Writer(board, f"catch-up/{mode}", players=12)
        for _ in range(3):
            await w.batch()
        await drain(a)
        victim = sorted(w.ref.boards["total"])[0]
        home = board.layout.home(victim)
        snapshot = rebuilder.snapshot
        now = times.now_ms() + MAX_FUTURE_MS + 60_000  # achieved after the removal's record
        later = Score(victim, 1, "after-removal", now)

        async def snapshot_then_remove(b: Board, shard: int, fold: Any) -> Any:
            taken = await snapshot(b, shard, fold)
            if shard == home:
                assert await moderation.remove(board, [victim]) == {victim}
                await board.submit([later], now_ms=now)
            return taken

        rebuilder.snapshot = snapshot_then_remove  # type: ignore[method-assign]
        reports = await rebuilder.rebuild(board)
        assert reports[home].tries > 1  # the swap saw the journal move, and caught up
        forget(w.ref, victim)
        w.ref.submit([later], now_ms=now)
        await check(board, w.ref)
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize(
    ("strategy", "mode"), [("hash", "best"), ("region", "set"), ("band", "best"), ("hash", "incr")]
)
async def test_a_result_sent_again_after_a_removal_does_not_bring_the_player_back(
    store: BoardStore, strategy: str, mode: str
) -> None:
    """api.md: replaying the same (match_id, player_id) never changes a board. On best and set
    boards a game server's retry after an admin removed the player put the removed result back
    (incr's dedup refused it). Now a removal takes away the player's results achieved up to it, for
    the dedup window: a replay (with or without its time), or a result of before that arrives late,
    is a duplicate and writes nothing; a result achieved after the removal counts."""
    config = BoardConfig.from_dict(
        f"moderation-replay-{strategy}-{mode}",
        {"mode": mode, "periods": ["daily"], "points_max": 500, "sharding": sharding(strategy, 3)},
    )
    board, _ = await store.create(config)
    region = "r0" if strategy == "region" else None
    try:
        now = times.now_ms()
        timed = Score("cheater", 99, "m1", now - 60_000, region)
        timeless = Score("cheater", 98, "m2", None, region)
        await board.submit([timed, timeless], now_ms=now - 30_000)
        await board.submit([Score("honest", 10, "m1", now - 60_000, region)], now_ms=now - 30_000)
        assert await moderation.remove(board, ["cheater"]) == {"cheater"}
        late = Score("cheater", 97, "m3", now - 20_000, region)
        again = await board.submit([timed, timeless, late], now_ms=times.now_ms())
        assert [r.status for r in again] == ["duplicate"] * 3, again
        for api in ("total", "daily"):
            with pytest.raises(PlayerNotFound):
                await board.player("cheater", board.resolve(api))
        assert [e.player_id for e in await board.top(10)] == ["honest"]
        # Achieved after the removal: counts (on best and set boards once past the 5 minutes a
        # result applied before the removal may be dated ahead; within them it is a duplicate).
        soon = times.now_ms() + 2_000
        [early] = await board.submit([Score("cheater", 7, "m4", soon, region)], now_ms=soon)
        assert early.status == ("improved" if mode == "incr" else "duplicate")
        later = times.now_ms() + MAX_FUTURE_MS + 2_000
        [fresh] = await board.submit([Score("cheater", 7, "m5", later, region)], now_ms=later)
        assert fresh.status == "improved" and fresh.points == (14 if mode == "incr" else 7)
        assert {e.player_id for e in await board.top(10)} == {"honest", "cheater"}
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_retry_of_a_result_dated_ahead_of_the_clock_stays_out_after_a_removal(
    store: BoardStore, mode: str
) -> None:
    """A board takes achieved_at up to 5 minutes ahead of its clock (a game server's clock runs
    ahead). The removal recorded its own time only, so the retry of such a result, later than that,
    was applied again and brought the player back. The record now covers the player's kept results."""
    config = BoardConfig.from_dict(f"moderation-ahead-{mode}", {"mode": mode, "periods": ["daily"]})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        ahead = Score("cheater", 900, "m1", now + 120_000)
        [first] = await board.submit([ahead], now_ms=now)
        assert first.status == "improved"
        assert await moderation.remove(board, ["cheater"], now_ms=now) == {"cheater"}
        [again] = await board.submit([ahead], now_ms=now + 1_000)
        assert again.status == "duplicate"
        assert await board.top(10) == []
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("offset_ms", [0, 120_000, MAX_FUTURE_MS])
async def test_a_retry_of_a_result_not_kept_stays_out_after_a_removal(
    store: BoardStore, offset_ms: int
) -> None:
    """A best board keeps a player's best only: a worse result is applied ('unchanged') and kept
    nowhere, so the removal saw no time of it. Dated in the removal's own second or ahead of the
    clock (up to 5 minutes), its retry after the removal was later than the record and brought the
    player back with it (a writes audit's finding). The record now covers every time a result
    applied before the removal can have: up to 5 minutes past it."""
    config = BoardConfig.from_dict(f"moderation-unkept-{offset_ms}", {"mode": "best", "periods": ["daily"]})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("cheater", 1000, "m1", now - 60_000)], now_ms=now)
        worse = Score("cheater", 500, "m2", now + offset_ms)
        [first] = await board.submit([worse], now_ms=now)
        assert first.status == "unchanged"
        assert await moderation.remove(board, ["cheater"], now_ms=now) == {"cheater"}
        [again] = await board.submit([worse], now_ms=now + 1_000)
        assert again.status == "duplicate", again
        assert await board.top(10) == []
    finally:
        await store.delete(config.id)


async def test_a_retry_of_an_applied_result_is_a_duplicate_not_a_rate_limit(store: BoardStore) -> None:
    """rate.lua knew a result's (match, player) for two minutes only: a game server retrying a
    result applied earlier, while its player was at the per-minute limit, got ``rate_limit`` (and a
    row in refused_results for a result the board holds) where the board says ``duplicate``. A
    result in the incr board's dedup window is let through uncounted, as one counted this minute."""
    board = await make_board(store, 2, max_results_per_player_per_minute=2)  # an incr board
    screen = moderation.Screen(lambda _board, _player, _incarnation: False)
    now = times.now_ms()

    async def post(score: Score, at: int) -> list[str]:
        refused = await screen.refusals(board, board.prepare([score], at), at)
        if refused:
            return [r.status for r in refused]
        return [r.status for r in await board.submit([score], at)]

    first = Score("p1", 5, "m1", now)
    assert await post(first, now) == ["improved"]
    later = now + 5 * 60_000  # past the two minutes rate.lua keeps, well within the dedup window
    assert await post(Score("p1", 1, "m2", later), later) == ["improved"]
    assert await post(Score("p1", 1, "m3", later), later + 1) == ["improved"]
    assert await post(Score("p1", 1, "m4", later), later + 2) == ["rate_limit"]  # at the limit
    assert await post(first, later + 3) == ["duplicate"]  # a retry: the board's own answer
    assert await post(Score("p1", 1, "m5", later), later + 4) == ["rate_limit"]  # still at the limit
    assert [(e.player_id, e.points) for e in await board.top(5)] == [("p1", 7)]
    await store.delete(board.config.id)


@pytest.mark.parametrize("then", ["deleted", "resharded"])
async def test_the_rate_limit_of_a_stale_board_leaves_no_key_behind(store: BoardStore, then: str) -> None:
    """A router that still holds a board deleted or resharded away (its cache lives 5 s) counts
    results per minute on the old shards: rate.lua refuses as write.lua does (the router then drops
    its copy, or retries on the new layout) and writes nothing there. It used to add its counters
    to the shard's key index, which the deletion or the reshard had dropped: an index made again,
    without expiry, that nothing deletes."""
    config = BoardConfig.from_dict(
        f"rate-stale-{then}",
        {
            "durability": "memory",
            "max_results_per_player_per_minute": 5,
            "sharding": {"strategy": "hash", "shards": 2},
        },
    )
    await store.create(config)
    stale = await BoardStore(store.client, store.scripts).get(config.id)  # another router's copy
    now = times.now_ms()
    screen = moderation.Screen(lambda _board, _player, _incarnation: False)
    scores = [Score(f"p{i}", 1, f"m{i}", now) for i in range(8)]
    try:
        assert await screen.refusals(stale, stale.prepare(scores, now), now) == []
        if then == "deleted":
            await store.delete(config.id)
        else:
            mover = Resharder(store, config.id, say=lambda _: None, cache_s=0)
            await mover.start(3)
            await mover.run()
        with pytest.raises(BoardNotFound if then == "deleted" else Resharding):
            await screen.refusals(stale, stale.prepare(scores, now + 60_000), now + 60_000)
        old = [k async for k in store.client.scan_iter(match=f"lb:*:{config.id}:{stale.incarnation}:*")]
        assert old and all([await store.client.pttl(k) > 0 for k in old]), old
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)


async def test_the_rate_limit_of_a_shard_that_lost_its_sentinel_writes_nothing_there(
    store: BoardStore,
) -> None:
    """Redis lost the board's shards (a FLUSHALL of every master, or a slot lost alone) while a
    router still holds the board (its copy lives until it sees the registry's version move, about
    0.25 s): rate.lua now refuses a shard without its sentinel as write.lua does (SHARDLOST:
    Rebuilding, nothing written). Failed before: the results were counted (no refusal) and rate.lua
    made the shard's key index again, without expiry, on a shard that no longer carries the board:
    a key nothing deletes when the board is not brought back, and one that makes the archiver take
    a fresh board's shard whose sentinel a failover lost for a shard that held something (marked,
    not written again: tests/test_shard_loss.py)."""
    config = BoardConfig.from_dict(
        "rate-lost", {"max_results_per_player_per_minute": 5, "sharding": {"strategy": "hash", "shards": 2}}
    )
    board, _ = await store.create(config)
    stale = await BoardStore(store.client, store.scripts).get(config.id)  # a router's copy
    assert stale.sentinels
    pattern = f"lb:*:{config.id}:{stale.incarnation}:*"
    now = times.now_ms()
    screen = moderation.Screen(lambda _board, _player, _incarnation: False)
    scores = [Score(f"p{i}", 1, f"m{i}", now) for i in range(8)]
    try:
        # The board's shards lose every key, their sentinels with them (a new board holds no other).
        lost = [k async for k in store.client.scan_iter(match=pattern)]
        assert lost and await store.client.delete(*lost) == len(lost)
        with pytest.raises(Rebuilding):
            await screen.refusals(stale, stale.prepare(scores, now), now)
        left = {_name(k): await store.client.pttl(k) async for k in store.client.scan_iter(match=pattern)}
        assert left == {}, left  # key -> its TTL (ms; -1: none)
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(board.config.id)


def _name(key: Any) -> str:
    return key.decode() if isinstance(key, bytes) else str(key)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_shards_removal_record_forgets_removals_older_than_the_dedup_window(
    store: BoardStore, mode: str
) -> None:
    """Each removal kept its player in the shard's `rmv` hash, and each later removal pushed the
    whole hash's expiry to its own time plus the dedup window: a shard with a removal or a ban every
    day kept every player ever removed there, for good. A removal now also drops the record's
    entries whose removal is older than the window (a few per call, more than it adds), as each
    would have expired on its own; a removal within the window still refuses its replay."""
    window_s = 3600
    config = BoardConfig.from_dict(
        f"moderation-record-{mode}", {"mode": mode, "dedup_window_s": window_s, "sharding": {"shards": 1}}
    )
    board, _ = await store.create(config)
    record = keys.removals_key(board.prefixes[0])
    try:
        now = times.now_ms()
        old = [f"old{i}" for i in range(20)]
        await board.submit([Score(p, 5, "m1", now - 60_000) for p in [*old, "recent", "late"]], now_ms=now)
        await moderation.remove(board, old, now_ms=now)
        later = now + window_s * 1000 + MAX_FUTURE_MS + 60_000  # past every old record's window
        await moderation.remove(board, ["recent"], now_ms=later - 60_000)
        await moderation.remove(board, ["late"], now_ms=later)
        # (with where the entry that removed each is: pruned with the record)
        positions = {keys.removal_position_field(p) for p in ("recent", "late")}
        assert set(await board.client.hkeys(record)) == {"recent", "late", *positions}
        # the recent ones still refuse a replay of their result
        again = await board.submit([Score("recent", 5, "m1", now - 60_000)], now_ms=later)
        assert [r.status for r in again] == ["duplicate"]
    finally:
        await store.delete(config.id)


REFUSED_BEFORE = """
CREATE TABLE refused_results (
    id bigserial PRIMARY KEY,
    board text NOT NULL,
    player_id text NOT NULL,
    match_id text NOT NULL,
    points bigint NOT NULL,
    status text NOT NULL,
    request_id text,
    at timestamptz NOT NULL DEFAULT now()
)
"""  # as releases up to 2026-12-05 created it


async def test_refused_results_are_recorded_once_and_an_archive_with_copies_is_migrated(
    postgres_url: str,
) -> None:
    """A refused result was recorded once per try: a call retried after a 503, the router's own
    retry through a reshard, the background log's retry of a batch whose commit lost its reply.
    refused_results now keeps one row per (board, player, match): ``record_refusals`` again is a
    no-op, and so is the plain INSERT of a router of the release before (its batch would otherwise
    fail for ever). A database from before, with such copies, is migrated on connection: the first
    row of each result is kept."""
    async with own_archive(postgres_url) as url:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as old:
            await old.execute(REFUSED_BEFORE)
            for request in ("r1", "r1", "r2"):
                await old.execute(
                    "INSERT INTO refused_results (board, player_id, match_id, points, status, request_id) "
                    "VALUES ('b', 'cheat', 'm1', 900, 'points_limit', %s), "
                    "('b', 'cheat', 'm2', 5, 'banned', %s)",
                    (request, request),
                )
        db = await connect_db(url)
        try:
            await (await connect_db(url)).close()  # the migration again: nothing to do
            rows = [
                ("b", "cheat", "m1", 900, "points_limit", "r3"),
                ("b", "cheat", "m3", 7, "rate_limit", "r3"),
                ("b", "cheat", "m3", 7, "rate_limit", "r3"),
                ("c", "cheat", "m3", 7, "rate_limit", None),
            ]
            for _ in range(2):
                await moderation.record_refusals(db, rows)
            async with db.transaction():
                await db.execute(  # as a router of the release before writes one
                    "INSERT INTO refused_results (board, player_id, match_id, points, status, request_id) "
                    "VALUES ('b', 'cheat', 'm2', 5, 'banned', 'r4')"
                )
                cur = await db.execute(
                    "SELECT board, player_id, match_id, points, status, request_id FROM refused_results "
                    "ORDER BY id"
                )
                kept = await cur.fetchall()
            assert kept == [
                ("b", "cheat", "m1", 900, "points_limit", "r1"),
                ("b", "cheat", "m2", 5, "banned", "r1"),
                ("b", "cheat", "m3", 7, "rate_limit", "r3"),
                ("c", "cheat", "m3", 7, "rate_limit", None),
            ]
            async with db.transaction():  # an operator drops the index: the next connection makes it again
                await db.execute("DROP INDEX refused_results_once")
            await (await connect_db(url)).close()
            await moderation.record_refusals(db, rows)
            async with db.transaction():
                cur = await db.execute("SELECT count(*) FROM refused_results")
                assert await cur.fetchone() == (4,)
        finally:
            await db.close()


FILLERS = 3 * moderation.PAGE  # journal entries the archiver has not taken (removal_support.filled)


async def test_a_removal_that_finds_a_player_gone_reads_the_earlier_entry_not_the_whole_journal(
    store: BoardStore, raw: Any
) -> None:
    config = BoardConfig.from_dict("moderation-gone-cost", {"mode": "best", "sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("p1", 10, "m1", now), Score("p2", 20, "m2", now)], now)
        first: list[tuple[str, journal.Entry]] = []
        assert await moderation.remove(board, ["p1"], request="remove/r-1", journaled=first) == {"p1"}
        (earlier,) = [e for _, e in first if "p1" in e.removed]
        await filled(raw, keys.journal_key(board.prefixes[0]), FILLERS)  # the archiver behind
        reads, again = JournalReads(board), []
        assert await moderation.remove(board, ["p1"], request="remove/r-2", journaled=again) == set()
        assert earlier.id in {e.id for _, e in again}  # the first call's entry, archived with this one
        print(f"\n{FILLERS} fillers: {reads.calls} XRANGE, {reads.entries} entries, {reads.bytes} bytes")
        assert reads.entries <= 2  # the earlier entry, not the journal's FILLERS behind it
        # A player never here (a ban of every board sent twice under two ids): no entry to look for.
        assert await moderation.remove(board, ["p3"], request="remove/r-5", journaled=[]) == set()
        reads.entries = 0
        assert await moderation.remove(board, ["p3"], request="remove/r-6", journaled=[]) == set()
        assert reads.entries <= 2
        # A record of the release before names no entry: the journal is read for it, as then.
        assert await moderation.remove(board, ["p2"], request="remove/r-3", journaled=first) == {"p2"}
        (before,) = [e for _, e in first if "p2" in e.removed]
        await raw.hdel(keys.removals_key(board.prefixes[0]), keys.removal_position_field("p2"))
        reads.entries, again = 0, []
        assert await moderation.remove(board, ["p2"], request="remove/r-4", journaled=again) == set()
        assert before.id in {e.id for _, e in again}
        assert reads.entries > FILLERS
    finally:
        await store.delete(board.config.id)


async def test_a_removal_that_finds_a_player_removed_meanwhile_archives_that_removals_entry(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two removals of p1 under two request ids at once (a client's retry while its first call
    is still under way): the first runs on the shard after the second read the shard's records
    (none of p1 then) and before its call there, and its archiving then fails (503). The second
    finds p1 gone and answers ``removed: false``; it must archive the first's entry, as for a
    player found gone by an earlier removal (a loss of Redis would otherwise bring p1 back). Until
    2026-12-06 the records were read before the call alone, and the entry was not looked for."""
    settings = {"mode": "best", "sharding": sharding("hash", 1)}
    config = BoardConfig.from_dict("moderation-gone-meanwhile", settings)
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("p1", 10, "m1", now), Score("p2", 20, "m2", now)], now)
        original = board.scripts.remove
        lost: list[tuple[str, journal.Entry]] = []  # the first call's, never archived

        async def first_meanwhile(*args: Any, **kwargs: Any) -> Any:
            # The second call is about to run remove.lua (its records read before, if ever).
            monkeypatch.setattr(board.scripts, "remove", original)
            assert await moderation.remove(board, ["p1"], request="remove/r-1", journaled=lost) == {"p1"}
            return await original(*args, **kwargs)

        monkeypatch.setattr(board.scripts, "remove", first_meanwhile)
        again: list[tuple[str, journal.Entry]] = []
        assert await moderation.remove(board, ["p1"], request="remove/r-2", journaled=again) == set()
        (first,) = [e for _, e in lost if "p1" in e.removed]
        assert first.id in {e.id for _, e in again}
    finally:
        await store.delete(board.config.id)


async def test_a_removal_retried_with_its_request_reads_its_first_entry_not_the_whole_journal(
    store: BoardStore, raw: Any
) -> None:
    """A retry with the same request (a DELETE sent again with its X-Request-Id after a 503 or a
    lost answer) journals nothing where its first call ran, and archives that call's entry: found
    by reading the whole journal for the request's name, up to its bound when the archiver is
    behind. It is read alone now, where the shard keeps it beside the request's record: the entry
    that removed p1, and the one that found p2 gone (p2 removed before under another request,
    whose entry the shard's record of p2 names)."""
    config = BoardConfig.from_dict("moderation-retry-cost", {"mode": "best", "sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("p1", 10, "m1", now), Score("p2", 20, "m2", now)], now)
        first: list[tuple[str, journal.Entry]] = []
        assert await moderation.remove(board, ["p2"], request="remove/r-0", journaled=first) == {"p2"}
        assert await moderation.remove(board, ["p1"], request="remove/r-1", journaled=first) == {"p1"}
        assert await moderation.remove(board, ["p2"], request="remove/r-2", journaled=first) == set()
        entries = {e.request: e for _, e in first}
        await filled(raw, keys.journal_key(board.prefixes[0]), FILLERS)  # the archiver behind
        reads = JournalReads(board)
        for player, request, removed in [("p1", "remove/r-1", {"p1"}), ("p2", "remove/r-2", set())]:
            reads.calls = reads.entries = reads.bytes = 0
            again: list[tuple[str, journal.Entry]] = []
            started = time.perf_counter()
            assert await moderation.remove(board, [player], request=request, journaled=again) == removed
            took = time.perf_counter() - started
            assert entries[request].id in {e.id for _, e in again}  # its first call's entry
            read = f"{reads.calls} XRANGE, {reads.entries} entries, {reads.bytes} bytes"
            print(f"\n{FILLERS} fillers, {request}: {read}, {took:.3f} s")
            assert reads.entries <= 3  # its entry (and the one that removed the player), not FILLERS
        assert entries["remove/r-0"].id in {e.id for _, e in again}  # the entry that removed p2
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("when", ["before", "while-copied"])
async def test_a_removal_that_finds_a_player_gone_after_a_reshard_archives_the_old_layouts_entry(
    store: BoardStore, postgres_url: str, when: str
) -> None:
    """The first removal's entry is in the old layout's journal, which the archiver has not drained
    yet (the reshard committed, the new layout serving): a removal sent again under another request
    id there finds the player gone, and archives that entry before it answers, as on one layout.
    Made while the old layout was copied, its record reaches the new layout by the mover's tracked
    rounds, where it is, too."""
    body = {"mode": "best", "sharding": sharding("hash", 1)}
    config = BoardConfig.from_dict(f"moderation-gone-reshard-{when}", body)
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score("p1", 10, "m1", now)], now)
        mover = Resharder(
            store, config.id, say=lambda _: None, postgres_url=postgres_url, cache_s=0, drain_s=0.1
        )
        first: list[tuple[str, journal.Entry]] = []
        if when == "while-copied":
            await mover.start(2)
            await mover._copy((await mover.record())[1])
        assert await moderation.remove(board, ["p1"], request="remove/r-1", journaled=first) == {"p1"}
        (earlier,) = [e for _, e in first if "p1" in e.removed]
        if when == "before":
            await mover.start(2)
        await mover.run()  # committed; the old journal waits for an archiver
        moved = await store.get(config.id)
        assert moved.generation != board.generation and moved.also
        again: list[tuple[str, journal.Entry]] = []
        assert await moderation.remove(moved, ["p1"], request="remove/r-2", journaled=again) == set()
        assert earlier.id in {e.id for _, e in again}
        # Sent again under its own id: where its entry is was copied beside its record too.
        again = []
        assert await moderation.remove(moved, ["p1"], request="remove/r-1", journaled=again) == {"p1"}
        assert earlier.id in {e.id for _, e in again}
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("later_call", ["finds", "retry-finds-gone"])
async def test_a_removal_keeping_a_period_whole_archives_the_players_earlier_entry(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, later_call: str
) -> None:
    """A removal r-2 that keeps a period of the player whole (``since_ms``: its entry's `a`) drops
    nothing of theirs there: an earlier removal's entry r-1, never archived (its caller's write to
    PostgreSQL failed, the archiver behind), is what drops their results of before it in that period
    (the total's 100 here). So the call that answers archives r-1's entry too: r-2 itself (``finds``:
    it finds the player), or a retry r-3 under another id that finds the player gone and the
    shard's record naming r-2's entry (``retry-finds-gone``). Before, each archived its own or the
    named entry alone, and after a total loss of Redis `rebuild --all` brought back the total of
    before the first removal."""
    config = BoardConfig.from_dict(
        f"moderation-kept-{later_call}",
        {"mode": "best", "periods": ["daily"], "dedup_window_s": 2_592_000, "sharding": sharding("hash", 1)},
    )
    board, _ = await store.create(config)
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url)
        try:
            day = 86_400_000
            today = times.now_ms() // day * day
            await board.submit([Score("p1", 100, "m0", today - 5 * day)], now_ms=today - 5 * day + HOUR)
            await drain(a)  # archived; nothing after it is, but what the calls below archive themselves
            first: list[tuple[str, journal.Entry]] = []  # not archived: its caller's write failed
            assert await moderation.remove(
                board, ["p1"], request="remove/r-1", now_ms=today - 4 * day, journaled=first
            ) == {"p1"}
            (earlier,) = [e for _, e in first if "p1" in e.removed]
            for points, match, at in [(5, "m2", today - 3 * day), (10, "m3", today - 2 * day)]:
                await board.submit([Score("p1", points, match, at + HOUR)], now_ms=at + 2 * HOUR)
            since, second = today - 2 * day, []
            got = await moderation.remove(
                board, ["p1"], request="remove/r-2", since_ms=since, now_ms=today - day, journaled=second
            )
            assert got == {"p1"}
            (later,) = [e for _, e in second if e.request == "remove/r-2"]
            assert "total" in (later.kept_in("p1") or ())  # the total (10, achieved since) kept
            answered = second
            if later_call == "retry-finds-gone":
                answered = []
                retry = {"since_ms": since, "now_ms": today - day + 1, "journaled": answered}
                got = await moderation.remove(board, ["p1"], request="remove/r-3", **retry)
                assert got == set()
                assert later.id in {e.id for _, e in answered}
            assert earlier.id in {e.id for _, e in answered}
            await archive.record_removals(a.db, answered)  # as the answering call's caller does first
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            rebuilt = await store.get(config.id)
            assert [e.player_id for e in await rebuilt.top(10)] == []  # not the 100 of before r-1
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)
