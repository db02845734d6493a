"""Bans of a board deleted: a ban of one board holds on the incarnation it was made on, so once that
board is deleted (DELETE /v1/boards/{board}, a season archive, or any deletion the archiver finds)
its bans are never in force again. They are forgotten, in Redis's list and in PostgreSQL, so they
no longer count against the cap, load into every router, or come back with a restore; a ban of
another board, of every board, of the board created again, or stored before incarnations were kept
(on every board of its id) stays (docs/design-notes.md, "Bans")."""

from __future__ import annotations

import contextlib
from typing import Any

import orjson
import psycopg
import pytest
from redis.exceptions import SlotNotCoveredError

from shardlb import keys, moderation, settlement, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound
from shardlb.moderation import ALL, Ban, Bans, ban_field
from shardlb.rebuild import Rebuilder
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, board_name, running
from tests.store_fixture import forget_others_restored
from tests.test_moderation_router import make_board, rows

# No test here checks the restore's wait for the routers' copies of the ban list (conftest.py).
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("no_ban_propagation_wait")]


@pytest.fixture(autouse=True)
def no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)


async def held(store: BoardStore, *fields: str) -> set[str]:
    """Those of ``fields`` that Redis's ban list holds."""
    found = await store.client.hmget(keys.BANS, list(fields))
    return {f for f, record in zip(fields, found, strict=True) if record is not None}


async def stored(postgres_url: str, *pairs: tuple[str, str]) -> set[tuple[str, str]]:
    """Those of ``pairs`` (board, player) that PostgreSQL's bans hold."""
    found = await rows(postgres_url, "SELECT board, player_id FROM bans")
    return set(pairs) & {(b, p) for b, p in found}


async def legacy_ban(store: BoardStore, postgres_url: str, board: str, player: str) -> None:
    """A ban stored before incarnations were kept: no incarnation in its row nor in its record."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        await db.execute(
            "INSERT INTO bans (player_id, board, reason, banned_by) VALUES (%s, %s, 'old', 'key:x') "
            "ON CONFLICT DO NOTHING",
            (player, board),
        )
    record = {"reason": "old", "by": "key:x", "at": times.now_ms()}
    await store.client.hset(keys.BANS, ban_field(board, player), orjson.dumps(record))


async def lift(postgres_url: str, store: BoardStore, *pairs: tuple[str, str]) -> None:
    db = await connect_db(postgres_url)
    try:
        for board, player in pairs:
            await Bans(store.client).lift(db, player, board, "test", "", None)
    finally:
        await db.close()


async def test_a_board_deleted_forgets_its_bans_and_leaves_every_other_ban(
    cluster_url: str,
    postgres_url: str,
    store: BoardStore,
    rebuilder: Rebuilder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A board's bans stayed in Redis and PostgreSQL once it was deleted: not in force, not listed,
    but counted against the cap (a game that deletes and creates its board every season ran into
    409s) and loaded by every router, and a restore wrote them back. The DELETE forgets them; a ban
    of another board, of every board and one stored without an incarnation stay."""
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name, other = await make_board(client), await make_board(client)
        gone, everywhere, elsewhere, old = (f"{p}-{name}" for p in ("gone", "all", "else", "old"))
        for player, body in (
            (gone, {"scope": "board", "board": name}),
            (everywhere, {"scope": "all"}),
            (elsewhere, {"scope": "board", "board": other}),
        ):
            r = await client.post(f"/v1/players/{player}:ban", json=body, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
        await legacy_ban(store, postgres_url, name, old)
        pairs = [(name, gone), (ALL, everywhere), (other, elsewhere), (name, old)]
        fields = [ban_field(b, p) for b, p in pairs]
        try:
            # At the cap: a new ban is refused until one goes.
            monkeypatch.setattr(moderation, "MAX_BANS", await store.client.hlen(keys.BANS))
            late = {"scope": "board", "board": other}
            r = await client.post(f"/v1/players/late-{name}:ban", json=late, headers=AS_ADMIN)
            assert r.status_code == 409, r.text
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            assert await held(store, *fields) == set(fields[1:])
            assert await stored(postgres_url, *pairs) == set(pairs[1:])
            r = await client.post(f"/v1/players/late-{name}:ban", json=late, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
            monkeypatch.undo()
            await rebuilder.restore(store)  # PostgreSQL's bans written back: not the one forgotten
            await forget_others_restored(store)  # boards of other modules, back marked as being rebuilt
            assert await held(store, *fields) == set(fields[1:])
            # Created again and banned there: that ban is the new board's, and goes with it.
            r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
            assert r.status_code == 201, r.text
            scope = {"scope": "board", "board": name}
            r = await client.post(f"/v1/players/{gone}:ban", json=scope, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
            assert await held(store, fields[0]) == {fields[0]}
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            assert await held(store, *fields) == set(fields[1:])
            assert await stored(postgres_url, *pairs) == set(pairs[1:])
        finally:
            await lift(postgres_url, store, *pairs[1:], (other, f"late-{name}"))
            await client.delete(f"/v1/boards/{other}", headers=AS_ADMIN)


async def journaled(store: BoardStore, name: str) -> Board:
    config = BoardConfig.from_dict(name, {"periods": ["daily"], "sharding": {"shards": 2}})
    board, _ = await store.create(config)
    return board


async def archived(raw: Any, store: BoardStore, postgres_url: str) -> Archiver:
    """An archiver that knows the boards (and has archived what they hold)."""
    a = Archiver(raw, store, await connect_db(postgres_url), board_name("sweep"), claim_idle_s=0)
    await a.refresh()
    while await a.round():
        pass
    return a


async def test_a_season_archive_forgets_the_bans_of_the_board_it_deletes_also_when_retried(
    cluster_url: str, postgres_url: str, store: BoardStore, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """archive_season settles the board, then deletes it: its bans go too. One whose forgetting
    failed after the deletion (PostgreSQL lost meanwhile) is finished by the archive run again,
    which finds the board gone and its settlement stored."""
    name, other = board_name("season-bans"), board_name("season-other")
    board, kept = await journaled(store, name), await journaled(store, other)
    db = await connect_db(postgres_url)
    bans = Bans(store.client)
    gone, everywhere, elsewhere = f"gone-{name}", f"all-{name}", f"else-{name}"
    pairs = [(name, gone), (ALL, everywhere), (other, elsewhere)]
    fields = [ban_field(b, p) for b, p in pairs]
    try:
        await board.submit([Score("p1", 10, "m1", times.now_ms() - 60_000)])
        for (scope, player), inc in zip(pairs, (board.incarnation, None, kept.incarnation), strict=True):
            await bans.add(db, Ban(player, scope, "cheat", "test", times.now_ms(), inc), None)
        a = await archived(raw, store, postgres_url)
        await a.db.close()

        async def lost(*args: Any, **kw: Any) -> Any:
            raise psycopg.OperationalError("connection lost")

        monkeypatch.setattr(Bans, "forget", lost, raising=False)
        rewards = [{"rank": 1, "reward": "x"}]
        request = settlement.Request.of({"settlement_id": f"{name}-1", "rewards": rewards})
        with pytest.raises(psycopg.OperationalError):
            await settlement.archive_season(cluster_url, postgres_url, name, request)
        with pytest.raises(BoardNotFound):
            await store.get(name)
        assert await held(store, *fields) == set(fields)
        monkeypatch.undo()
        result = await settlement.archive_season(cluster_url, postgres_url, name, request)
        assert result["archived"] is True
        assert await held(store, *fields) == set(fields[1:])
        assert await stored(postgres_url, *pairs) == set(pairs[1:])
    finally:
        await db.close()
        await lift(postgres_url, store, *pairs)
        for n in (name, other):
            with contextlib.suppress(BoardNotFound):
                await store.delete(n)


async def test_the_archiver_forgets_the_bans_of_boards_deleted_without_them_and_no_newer_ban(
    postgres_url: str, store: BoardStore, raw: Any, rebuilder: Rebuilder
) -> None:
    """A board deleted where its bans were not forgotten (the library's delete, a router without
    PostgreSQL, a forgetting that failed half way: Redis's records removed, PostgreSQL's rows left,
    which a restore writes back): the archiver, which marks the board deleted, forgets them. A ban
    of the same player on the board created again under the id (the row and record replaced) stays."""
    name = board_name("swept")
    board = await journaled(store, name)
    db = await connect_db(postgres_url)
    bans = Bans(store.client)
    again, once = f"again-{name}", f"once-{name}"
    a = None
    try:
        for player in (again, once):
            await bans.add(db, Ban(player, name, "cheat", "test", times.now_ms(), board.incarnation), None)
        a = await archived(raw, store, postgres_url)
        await store.delete(name)
        await store.client.hdel(keys.BANS, ban_field(name, once))  # half way: Redis's record only
        await rebuilder.restore(store)
        await forget_others_restored(store)
        assert await held(store, ban_field(name, once)) == {ban_field(name, once)}  # written back
        new = await journaled(store, name)
        await bans.add(db, Ban(again, name, "again", "test", times.now_ms(), new.incarnation), None)
        await a.refresh()
        assert await held(store, ban_field(name, again), ban_field(name, once)) == {ban_field(name, again)}
        assert await stored(postgres_url, (name, again), (name, once)) == {(name, again)}
        [record] = await store.client.hmget(keys.BANS, [ban_field(name, again)])
        assert orjson.loads(record)["inc"] == new.incarnation
    finally:
        if a is not None:
            await a.db.close()
        await db.close()
        await lift(postgres_url, store, (name, again), (name, once))
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


@pytest.mark.parametrize(
    "error",
    [
        psycopg.OperationalError("connection lost"),
        SlotNotCoveredError("slot 1234 is not covered by the cluster"),
    ],
    ids=["postgresql", "cluster-client"],
)
async def test_a_delete_whose_forgetting_fails_answers_204_and_the_archiver_finishes_it(
    cluster_url: str,
    postgres_url: str,
    store: BoardStore,
    raw: Any,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
) -> None:
    """The board is deleted, then the forgetting of its bans fails: PostgreSQL, or redis-py's
    cluster client with an error of its own, not a RedisError (``RedisClusterException``: a slot
    not covered; until 2026-12-06 that was 503 ``cluster_unavailable``). The DELETE is done and
    recorded, and answers 204 (its retry would find no board); the bans, in force nowhere, are left
    for the archiver, whose next refresh forgets them."""
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        player, scope = f"left-{name}", {"scope": "board", "board": name}
        r = await client.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text

        async def failing(*args: Any, **kw: Any) -> Any:
            raise error

        monkeypatch.setattr(Bans, "forget", failing)
        r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 204, r.text
        assert await held(store, ban_field(name, player)) == {ban_field(name, player)}
        monkeypatch.undo()
        a = await archived(raw, store, postgres_url)
        await a.db.close()
        assert await held(store, ban_field(name, player)) == set()
        assert await stored(postgres_url, (name, player)) == set()


async def test_a_ban_whose_record_a_router_of_the_release_before_wrote_again_goes_with_its_board(
    cluster_url: str, postgres_url: str, store: BoardStore
) -> None:
    """While old and new routers run side by side (the upgrade of 2026-12-05), a router of the
    release before that answers a ban's retry, or the ban asked for again while in force, writes
    Redis's record again from PostgreSQL's row in its own format: reason, by and at, no ``inc``.
    The deletion then forgot PostgreSQL's row but left that record (only records holding the
    incarnation went): the ban went on refusing the player on the board created again, in every
    router, and GET /v1/bans listed it, while PostgreSQL held no ban. A record without ``inc``
    whose time is the forgotten row's is that ban, and goes with it; a ban stored before
    incarnations were kept (its row has none) stays."""
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        player, old = f"rewritten-{name}", f"old-{name}"
        scope = {"scope": "board", "board": name}
        r = await client.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        field = ban_field(name, player)
        [record] = await store.client.hmget(keys.BANS, [field])
        written = orjson.loads(record)
        # As the release before writes it back from the row (moderation.py of c25d589, Bans.add).
        before = {"reason": written["reason"], "by": written["by"], "at": written["at"]}
        await store.client.hset(keys.BANS, field, orjson.dumps(before))
        await legacy_ban(store, postgres_url, name, old)
        try:
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            assert await stored(postgres_url, (name, player)) == set()
            assert await held(store, field, ban_field(name, old)) == {ban_field(name, old)}
        finally:
            await lift(postgres_url, store, (name, player), (name, old))
