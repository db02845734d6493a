"""Acknowledged removals through a loss of Redis made at once after the call, before the archiver's
next round: a total loss (every master flushed) and `shardlb rebuild --all`, or one shard's slot
lost and `shardlb rebuild BOARD --shard N`. A board deleted (DELETE 204, a season archive) stays
deleted, a player removed (a DELETE, a ban's removal) stays removed, and the call sent again with
the same X-Request-Id answers as the first did (docs/design-notes.md, "A total loss of Redis",
"A removal answered is archived")."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import psycopg
import pytest
import redis.exceptions

from shardlb import archive, keys, moderation, rebuild, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound, NotAcknowledged
from shardlb.settlement import Request, archive_season
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, board_name
from tests.router_support import running as router
from tests.test_archive_outages import NOBODY
from tests.test_rebuild import OnlyStore, own_archive
from tests.test_schema_locks import IMPATIENT
from tests.test_shard_loss import slot_wiped
from tests.test_store_oom import full_primaries

# No test here checks the restore's wait for the routers' copies of the ban list (conftest.py).
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("no_ban_propagation_wait")]

TABLE = [{"rank": 1, "reward": "gold"}]


async def archived_board(
    raw: Any, store: BoardStore, url: str, name: str, idle_ms: int = 0, **settings: Any
) -> Archiver:
    """``name`` created with two players, every result archived in ``url`` (the board's row in
    ``boards`` too); the archiver, to close. ``idle_ms``: p1's result arrived that long before
    p2's (the activity set's times); ``settings``: more of the board's settings."""
    config = BoardConfig.from_dict(name, {"periods": ["daily"], "sharding": {"shards": 3}, **settings})
    board, _ = await store.create(config)
    # Of this board alone: the suite's cluster holds other modules' boards, whose journals it must
    # not archive into this test's database (nor trim).
    only = OnlyStore(store.client, store.scripts, {name})
    a = Archiver(raw, only, await connect_db(url), name, claim_idle_s=0)
    await a.refresh()
    now = times.now_ms()
    for p, at in (("p1", now - idle_ms), ("p2", now)):
        await board.submit([Score(p, 10, f"m-{p}", at - 60_000)], now_ms=at)
    while await a.round():
        pass
    return a


@contextlib.asynccontextmanager
async def archived(
    raw: Any, store: BoardStore, base: str, name: str, idle_ms: int = 0, **settings: Any
) -> AsyncIterator[tuple[str, Archiver]]:
    """A database of its own (its URL) and ``archived_board`` in it (its archiver); at the end the
    archiver's connection closed and the board deleted if it is still there."""
    async with own_archive(base) as url:
        a = await archived_board(raw, store, url, name, idle_ms, **settings)
        try:
            yield url, a
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


@contextlib.asynccontextmanager
async def failing(url: str, failure: str, table: str) -> AsyncIterator[str]:
    """A URL of ``url``'s database on which PostgreSQL fails: ``down``, nothing listens at its
    address; ``locked``, ``table`` held by another transaction past the URL's lock_timeout (its
    writes refused, LockNotAvailable)."""
    if failure == "down":
        yield NOBODY
        return
    async with await psycopg.AsyncConnection.connect(url) as locker:
        await locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        yield f"{url}?{IMPATIENT}"


async def delete_failing_in_redis(client: httpx.AsyncClient, name: str, patch: pytest.MonkeyPatch) -> None:
    """A DELETE of ``name`` through ``client`` whose Redis part fails after its pending mark in
    PostgreSQL (the registry's primary out of reach): 503 ``cluster_unavailable``, nothing deleted."""

    async def unreachable(*args: Any, **kwargs: Any) -> str:
        raise redis.exceptions.ConnectionError("the registry's primary is unreachable")

    with patch.context() as patched:
        patched.setattr(BoardStore, "delete", unreachable)
        r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert r.status_code == 503 and r.json()["error"]["code"] == "cluster_unavailable", r.text


async def connection_lost(*args: Any, **kwargs: Any) -> None:
    """A PostgreSQL call that fails (in place of ``archive.mark_deleted``)."""
    raise psycopg.OperationalError("connection lost")


async def lose_redis_and_rebuild_all(raw: Any, cluster_url: str, url: str) -> None:
    await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
    command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
    assert await asyncio.to_thread(main, command) == 0


async def test_a_board_deleted_through_the_router_stays_deleted_after_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """DELETE answered 204, then Redis lost at once, before the archiver's next refresh: the
    router's DELETE marks the board deleted in PostgreSQL itself (``Bans.forget``), so `rebuild
    --all` leaves it alone, and a DELETE sent again after it answers 404 as it would have."""
    name = "acked-delete-router"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404


async def test_a_board_archived_for_its_season_stays_deleted_after_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A season archive settles the board and deletes it (answered ``archived: true``). Its
    deletion was marked in PostgreSQL only for a board with bans (``Bans.sweep`` forgets those
    alone), else by the archiver's next refresh: Redis lost before it, `rebuild --all` brought the
    archived board back, closed, with every result of the season. The archive now marks it deleted
    itself; its retry after the rebuild answers as the first call."""
    name = "acked-delete-season"
    async with archived(raw, store, postgres_url, name) as (url, _):
        request = Request.of({"settlement_id": f"{name}-1", "rewards": TABLE})
        first = await archive_season(cluster_url, url, name, request)
        assert (first["archived"], first["players"]) == (True, 2)
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)
        again = await archive_season(cluster_url, url, name, request)
        assert again == first


async def test_a_player_removed_through_the_router_stays_removed_after_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """DELETE /v1/boards/{b}/players/{p} answered ``removed: true``, then Redis lost at once, before
    the archiver's round took the removal's delete entry into ``player_removals``: `rebuild --all`
    must not bring the player back from their archived rows, and the DELETE sent again with the same
    X-Request-Id answers as the first call did."""
    name = "acked-remove-player"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        headers = {**AS_ADMIN, "X-Request-Id": f"{name}-rm-1"}
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
        assert r.status_code == 200 and r.json()["removed"] is True, r.text
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        board = await store.get(name)
        assert [e.player_id for e in await board.top(10)] == ["p2"]
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
        assert r.status_code == 200 and r.json()["removed"] is True, r.text
        assert [e.player_id for e in await board.top(10)] == ["p2"]


async def test_a_player_removed_stays_removed_after_their_shard_is_lost_alone(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """The same removal, then the player's shard lost alone (every key of its slot, the journal
    with the delete entry too) and `shardlb rebuild BOARD --shard N`: the player stays removed."""
    name = "acked-remove-shard"
    async with archived(raw, store, postgres_url, name) as (url, _):
        board = await store.get(name)
        shard = board.layout.home("p1")
        async with router(cluster_url, postgres_url=url) as (_, client):
            headers = {**AS_ADMIN, "X-Request-Id": f"{name}-rm-1"}
            r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
            assert r.status_code == 200 and r.json()["removed"] is True, r.text
            assert await slot_wiped(raw, board, shard)
            command = ["rebuild", name, "--shard", str(shard), "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            assert [e.player_id for e in await board.top(10)] == ["p2"]
            r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
            assert r.status_code == 200 and r.json()["removed"] is True, r.text
            assert [e.player_id for e in await board.top(10)] == ["p2"]


async def test_a_bans_removal_survives_a_total_loss_and_the_lift_that_follows(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A ban of one board, answered with the board in ``removed_from``, then Redis lost at once:
    `rebuild --all` leaves the banned player out (it reads the bans), but the ban's removal was in
    the journal alone. The same ban sent again after the rebuild answered ``removed_from: []`` (the
    first said the board), and once the ban was lifted the next rebuild brought the player back
    with the results of before the ban. The removal is archived before the answer now."""
    name = "acked-ban"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        headers = {**AS_ADMIN, "X-Request-Id": f"{name}-ban-1"}
        scope = {"scope": "board", "board": name, "reason": "test"}
        first = await client.post("/v1/players/p1:ban", json=scope, headers=headers)
        assert first.status_code == 200 and first.json()["removed_from"] == [name], first.text
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        board = await store.get(name)
        assert [e.player_id for e in await board.top(10)] == ["p2"]
        again = await client.post("/v1/players/p1:ban", json=scope, headers=headers)
        assert again.status_code == 200, again.text
        assert again.json()["removed_from"] == first.json()["removed_from"]
        lift = await client.post("/v1/players/p1:unban", json=scope, headers=AS_ADMIN)
        assert lift.status_code == 200 and lift.json()["lifted"] is True, lift.text
        assert not await raw.hexists(keys.BANS, moderation.ban_field(name, "p1"))
        command = ["rebuild", name, "--redis", cluster_url, "--postgres", url]
        assert await asyncio.to_thread(main, command) == 0
        assert [e.player_id for e in await board.top(10)] == ["p2"]


async def test_a_board_deleted_while_rebuild_all_restores_it_stays_deleted(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE made in the rebuild window (the board back in the registry, marked, its shards not
    swapped yet: docs/design-notes.md, "A board being rebuilt") is answered 204 and holds: the run
    does not bring the board back, a second `rebuild --all` leaves it alone, and none of its shards
    keeps a key the rebuild wrote (a sentinel, which never expires)."""
    name = "acked-delete-window"
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        board = await store.get(name)
        try:
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            async with router(cluster_url, postgres_url=url) as (_, client):
                answers = []
                original = rebuild.Rebuilder.rebuild

                async def deleted_first(self: rebuild.Rebuilder, *args: Any, **kwargs: Any) -> Any:
                    if not answers:  # in the window: restored, not rebuilt
                        assert (await store.get(name)).rebuilding
                        answer = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
                        answers.append(answer.status_code)
                    return await original(self, *args, **kwargs)

                monkeypatch.setattr(rebuild.Rebuilder, "rebuild", deleted_first)
                with contextlib.suppress(BoardNotFound):
                    async with rebuild.connected(cluster_url, url) as (rebuilder, other):
                        await rebuilder.recover(other)
                monkeypatch.undo()
                assert answers == [204]
                with pytest.raises(BoardNotFound):
                    await store.get(name)
                command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, command) == 0
                with pytest.raises(BoardNotFound):
                    await store.get(name)
                for prefix in board.prefixes:
                    assert not await raw.exists(keys.sentinel_key(prefix), keys.index_key(prefix))
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_a_removal_whose_archiving_failed_is_archived_by_its_retry(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL failing once the removal is made in Redis: 503 ``archive_unavailable``; the retry
    with the same X-Request-Id answers as the first would have, and archives the removal, so a
    total loss right after it does not undo it."""
    name = "acked-remove-retry"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        headers = {**AS_ADMIN, "X-Request-Id": f"{name}-rm-1"}

        async def lost(*args: Any, **kwargs: Any) -> None:
            raise psycopg.OperationalError("connection lost")

        monkeypatch.setattr(archive, "record_removals", lost)
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
        assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
        monkeypatch.undo()
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
        assert r.status_code == 200 and r.json()["removed"] is True, r.text
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        assert [e.player_id for e in await (await store.get(name)).top(10)] == ["p2"]


async def test_a_player_the_inactive_cleanup_removed_stays_removed_after_a_delete_and_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """The inactive cleanup removes p1 (idle for two hours on a board with ``inactive_after`` one
    hour); its delete entry waits in the journal for the archiver. A DELETE of p1 then answers
    ``removed: false`` (p1 is gone), as does its retry, and Redis is lost at once: the player must not
    come back from their archived rows, and the DELETE sent again answers as it did. The cleanup
    left no removal record, so the DELETE did not look for the cleanup's entry, archived its own
    alone (which names p1 as absent), and `rebuild --all` brought p1 back after the answer (only
    a retry with the same X-Request-Id before the loss archived it: its read of the whole
    journal by the request's name took every entry that removed p1)."""
    name = "acked-remove-idle"
    async with (
        archived(
            raw, store, postgres_url, name, idle_ms=7_200_000, inactive_after=3600, dedup_window_s=3600
        ) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        board = await store.get(name)
        assert await moderation.cleanup(board) == 1
        assert [e.player_id for e in await board.top(10)] == ["p2"]
        removals = keys.removals_key(board.prefixes[board.layout.home("p1")])
        # No record (p1's last post is older than the dedup window: so is every first post of a
        # result of theirs, whose replay is past the window): where the cleanup's entry is, alone.
        assert await raw.hget(removals, "p1") is None
        assert await raw.hget(removals, keys.removal_position_field("p1")) is not None
        assert await raw.pttl(removals) > 0
        headers = {**AS_ADMIN, "X-Request-Id": f"{name}-rm-1"}
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
        assert r.status_code == 200 and r.json()["removed"] is False, r.text
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        assert [e.player_id for e in await (await store.get(name)).top(10)] == ["p2"]
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)  # its retry
        assert r.status_code == 200 and r.json()["removed"] is False, r.text
        assert [e.player_id for e in await (await store.get(name)).top(10)] == ["p2"]


async def test_a_board_deleted_whose_bans_are_not_forgotten_stays_deleted_after_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE answers 204 when forgetting the board's bans fails (``Bans.forget``: its Redis
    part first, NotAcknowledged when no replica of the ban list's primary confirms in time). That
    call was also what marked the board deleted in PostgreSQL: Redis lost before the archiver's next
    refresh, `rebuild --all` brought the deleted board back. The mark is made before the bans now."""
    name = "acked-delete-unforgotten"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        scope = {"scope": "board", "board": name, "reason": "test"}
        r = await client.post("/v1/players/p1:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text

        async def unconfirmed(*args: Any, **kwargs: Any) -> int:
            raise NotAcknowledged("no replica of the ban list's primary confirmed in time")

        monkeypatch.setattr(moderation.Bans, "forget", unconfirmed)
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        monkeypatch.undo()
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)


async def test_a_lift_answered_holds_through_a_total_loss_and_its_retry_answers_as_it_did(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A ban, then its lift (``lifted: true``), then Redis lost at once: `rebuild --all` writes the
    ban list back from PostgreSQL, without the ban lifted (its row went first); the lift and the
    ban sent again with their X-Request-Ids answer as their
    first calls did, and the ban's retry bans nothing (it was lifted since)."""
    name = "acked-lift"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        scope = {"scope": "board", "board": name, "reason": "test"}
        ban_headers = {**AS_ADMIN, "X-Request-Id": f"{name}-ban-1"}
        lift_headers = {**AS_ADMIN, "X-Request-Id": f"{name}-lift-1"}
        ban = await client.post("/v1/players/p1:ban", json=scope, headers=ban_headers)
        assert ban.status_code == 200 and ban.json()["removed_from"] == [name], ban.text
        lift = await client.post("/v1/players/p1:unban", json=scope, headers=lift_headers)
        assert lift.status_code == 200 and lift.json()["lifted"] is True, lift.text
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        assert not await raw.hexists(keys.BANS, moderation.ban_field(name, "p1"))
        again = await client.post("/v1/players/p1:unban", json=scope, headers=lift_headers)
        assert again.status_code == 200 and again.json() == lift.json(), again.text
        again = await client.post("/v1/players/p1:ban", json=scope, headers=ban_headers)
        assert again.status_code == 200, again.text
        assert again.json()["removed_from"] == [name]
        assert not await raw.hexists(keys.BANS, moderation.ban_field(name, "p1"))
        board = await store.get(name)
        assert [e.player_id for e in await board.top(10)] == ["p2"]  # the ban's removal held


async def test_a_board_deleted_while_the_archiver_first_records_it_stays_deleted_after_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A board new to the archiver, deleted between the refresh's read of the registry and its
    INSERT of the board's row: the DELETE's mark in PostgreSQL (an UPDATE) found no row yet, the
    INSERT then made a live one, and the refresh judged the board listed. Redis lost before the
    next refresh, `rebuild --all` brought the deleted board back. The refresh now looks for the
    deletion mark of each board it recorded, once its row is committed."""
    name = "acked-delete-first-refresh"
    config = BoardConfig.from_dict(name, {"periods": ["daily"], "sharding": {"shards": 3}})
    await store.create(config)
    async with own_archive(postgres_url) as url:

        class DeletedAfterTheRead(OnlyStore):
            async def follow(self, *args: Any, **kwargs: Any) -> list[Board]:
                listed = await super().follow(*args, **kwargs)
                if any(b.config.id == name for b in listed):
                    incarnation = await store.delete(name)  # the router's DELETE, meanwhile
                    await archive.mark_deleted(a.db, name, incarnation)
                return listed

        only = DeletedAfterTheRead(store.client, store.scripts, {name})
        a = Archiver(raw, only, await connect_db(url), name)
        try:
            await a.refresh()
            await lose_redis_and_rebuild_all(raw, cluster_url, url)
            with pytest.raises(BoardNotFound):
                await store.get(name)
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


@pytest.mark.parametrize("failure", ["down", "locked"])
async def test_a_board_delete_postgresql_fails_deletes_nothing_and_its_retry_stays_deleted(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, failure: str
) -> None:
    """PostgreSQL failing at the DELETE (down, or refusing the write to ``boards``): the DELETE was
    answered 204 on Redis's mark alone, and Redis lost before the archiver's next refresh had
    `rebuild --all` bring the board back. The mark in PostgreSQL now comes first: its failure is
    503 ``archive_unavailable`` with Retry-After and nothing deleted, and the DELETE sent again
    once PostgreSQL answers is the one deletion, which holds through a total loss."""
    name = f"acked-delete-pg-{failure}"
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        incarnation = (await store.get(name)).incarnation
        try:
            async with (
                failing(url, failure, "boards") as broken,
                router(cluster_url, postgres_url=broken) as (_, client),
            ):
                r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
                assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
                assert r.headers["retry-after"] == "5"
            assert (await store.get(name)).incarnation == incarnation  # nothing deleted
            async with router(cluster_url, postgres_url=url) as (_, client):
                assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
                await lose_redis_and_rebuild_all(raw, cluster_url, url)
                with pytest.raises(BoardNotFound):
                    await store.get(name)
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


@pytest.mark.parametrize("retry", ["same-id", "new-id"])
async def test_a_removal_whose_archiving_failed_holds_through_a_total_loss_after_its_retry(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, retry: str
) -> None:
    """PostgreSQL refusing the removal's rows (``player_removals`` locked) once the removal is made
    in Redis: 503 ``archive_unavailable``, its delete entry in the journal alone (the archiver has
    not run). The DELETE sent again answers 200, and the removal must hold through a total loss:
    with the same X-Request-Id the retry finds the first call's entry by its request's name; with
    another id (a new removal, which finds the player gone: ``removed: false``) it archived only
    its own entry, which names nobody removed, and `rebuild --all` brought the player back."""
    name = f"acked-remove-pg-{retry}"
    async with archived(raw, store, postgres_url, name) as (url, _):
        async with (
            failing(url, "locked", "player_removals") as broken,
            router(cluster_url, postgres_url=broken) as (_, client),
        ):
            headers = {**AS_ADMIN, "X-Request-Id": f"{name}-rm-1"}
            r = await client.delete(f"/v1/boards/{name}/players/p1", headers=headers)
            assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
            assert r.headers["retry-after"] == "5"
        async with router(cluster_url, postgres_url=url) as (_, client):
            again = headers if retry == "same-id" else {**AS_ADMIN, "X-Request-Id": f"{name}-rm-2"}
            r = await client.delete(f"/v1/boards/{name}/players/p1", headers=again)
            assert r.status_code == 200 and r.json()["removed"] is (retry == "same-id"), r.text
            await lose_redis_and_rebuild_all(raw, cluster_url, url)
            assert [e.player_id for e in await (await store.get(name)).top(10)] == ["p2"]


async def test_a_board_the_archiver_records_between_the_deletes_mark_and_its_redis_part_stays_deleted(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE's mark in PostgreSQL comes before the deletion in Redis: for a board the archiver
    has not recorded yet, an UPDATE would find no row, and the archiver's refresh between the two
    (the board still listed, Redis's mark of the deletion not set yet) would record it live, and
    with the forgetting of its bans failing after it (which marks it too) nothing marked it
    before Redis was lost. The mark writes the row deleted, which the archiver's INSERT leaves
    alone."""
    name = "acked-delete-unrecorded"
    config = BoardConfig.from_dict(name, {"periods": ["daily"], "sharding": {"shards": 3}})
    await store.create(config)
    async with own_archive(postgres_url) as url:
        a = Archiver(raw, OnlyStore(store.client, store.scripts, {name}), await connect_db(url), name)
        original = archive.mark_deleting

        async def refreshed_after(*args: Any, **kwargs: Any) -> None:
            await original(*args, **kwargs)
            await a.refresh()  # the archiver's first refresh of the board, meanwhile

        async def unconfirmed(*args: Any, **kwargs: Any) -> int:  # its bans' forgetting marks it too
            raise NotAcknowledged("no replica of the ban list's primary confirmed in time")

        monkeypatch.setattr(archive, "mark_deleting", refreshed_after)
        monkeypatch.setattr(moderation.Bans, "forget", unconfirmed)
        try:
            async with router(cluster_url, postgres_url=url) as (_, client):
                assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            monkeypatch.undo()
            await lose_redis_and_rebuild_all(raw, cluster_url, url)
            with pytest.raises(BoardNotFound):
                await store.get(name)
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_a_bans_removal_whose_archiving_failed_holds_after_the_ban_sent_again_under_another_id(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A ban whose removal PostgreSQL refused (503 ``archive_unavailable``: the ban stored, the
    player removed in Redis, the delete entry in the journal alone), then the ban sent again under
    another X-Request-Id: a new request, which finds the player gone (``removed_from: []``). It
    archived nothing of the first removal: Redis lost, `rebuild --all` left the player out while
    banned, and brought them back with their results of before the ban once it was lifted."""
    name = "acked-ban-pg"
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        scope = {"scope": "board", "board": name, "reason": "test"}
        try:
            async with (
                failing(url, "locked", "player_removals") as broken,
                router(cluster_url, postgres_url=broken) as (_, client),
            ):
                headers = {**AS_ADMIN, "X-Request-Id": f"{name}-ban-1"}
                r = await client.post("/v1/players/p1:ban", json=scope, headers=headers)
                assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
            async with router(cluster_url, postgres_url=url) as (_, client):
                headers = {**AS_ADMIN, "X-Request-Id": f"{name}-ban-2"}
                r = await client.post("/v1/players/p1:ban", json=scope, headers=headers)
                assert r.status_code == 200 and r.json()["removed_from"] == [], r.text
                await lose_redis_and_rebuild_all(raw, cluster_url, url)
                lift = await client.post("/v1/players/p1:unban", json=scope, headers=AS_ADMIN)
                assert lift.status_code == 200 and lift.json()["lifted"] is True, lift.text
                command = ["rebuild", name, "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, command) == 0
                assert [e.player_id for e in await (await store.get(name)).top(10)] == ["p2"]
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_a_board_whose_deletion_stopped_half_way_is_marked_and_finished_by_a_delete(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A deletion that stopped half way (the record marked ``deleting``: the board reads as
    missing) is finished by the next DELETE, which marks that incarnation deleted in PostgreSQL
    first as for any other: the mark's read of the registry takes such a record too."""
    name = "acked-delete-half-way"
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        incarnation = (await store.get(name)).incarnation
        try:
            async with router(cluster_url, postgres_url=url) as (_, client):
                # After the router's start, whose reclaim would finish it.
                record = orjson.loads(await raw.hget(keys.BOARDS, name))
                await raw.hset(keys.BOARDS, name, orjson.dumps({**record, "state": "deleting"}))
                r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
                assert r.status_code == 204, r.text
            assert await raw.hget(keys.BOARDS, name) is None
            cur = await a.db.execute(
                "SELECT deleted_at IS NOT NULL FROM boards WHERE board = %s AND incarnation = %s",
                (name, incarnation),
            )
            assert await cur.fetchall() == [(True,)]
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_a_board_whose_delete_failed_after_its_mark_keeps_its_bans_and_its_restore(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE marks the board in PostgreSQL, then fails in Redis (503 ``cluster_unavailable``,
    nothing deleted) and is not sent again: the board lives. When that mark was the deletion's, the
    archiver's sweep forgot its bans (in force on a live board), and `rebuild --all` after a loss
    of Redis left the board out. The mark made before Redis is a pending one now (and the sweep
    leaves an incarnation the registry holds alone whatever PostgreSQL says)."""
    name = "acked-delete-failed-after-mark"
    field = moderation.ban_field(name, "p1")
    async with archived(raw, store, postgres_url, name) as (url, a):
        async with router(cluster_url, postgres_url=url) as (_, client):
            scope = {"scope": "board", "board": name, "reason": "test"}
            r = await client.post("/v1/players/p1:ban", json=scope, headers=AS_ADMIN)
            assert r.status_code == 200, r.text

            await delete_failing_in_redis(client, name, monkeypatch)
        await moderation.Bans(raw).sweep(a.db)
        assert await raw.hexists(keys.BANS, field)  # in force: the board lives
        monkeypatch.setattr(archive, "SWEEP_BANS_EVERY_S", 0.0)
        await a.refresh()
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        assert [e.player_id for e in await (await store.get(name)).top(10)] == ["p2"]
        assert await raw.hexists(keys.BANS, field)


async def test_a_board_whose_delete_failed_in_redis_comes_back_from_a_total_loss_within_the_minute(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE writes its mark in PostgreSQL, then fails in Redis (503 ``cluster_unavailable``:
    the board is not deleted) and is not sent again; Redis is lost at once, an archiver's refresh
    (with its sweep) between the two. The board's writes were acknowledged and its deletion was
    not: `rebuild --all` must bring it back with its scores. The mark made before Redis was the
    deletion's own, which the archiver took back only at its sweep, for a mark older than 60 s (up
    to about 11 minutes after the 503): `rebuild --all` left the board out. It is a pending mark
    now, which `rebuild --all` does not take for a deletion."""
    name = "acked-delete-failed-then-lost"
    async with archived(raw, store, postgres_url, name) as (url, a):
        async with router(cluster_url, postgres_url=url) as (_, client):
            await delete_failing_in_redis(client, name, monkeypatch)
        monkeypatch.setattr(archive, "SWEEP_BANS_EVERY_S", 0.0)
        await a.refresh()
        monkeypatch.undo()
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        top = await (await store.get(name)).top(10)
        assert sorted((e.player_id, e.points) for e in top) == [("p1", 10), ("p2", 10)]


async def test_a_delete_whose_last_mark_fails_is_a_503_and_its_retry_marks_it(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE deletes the board in Redis, then PostgreSQL fails on the mark that records the
    deletion done: 503 ``archive_unavailable`` (not acknowledged; Redis lost now, `rebuild --all`
    may bring the board back). The DELETE sent again finds the board gone (404) and records the
    deletion first, from Redis's mark: Redis lost then, the board stays deleted."""
    name = "acked-delete-last-mark-failed"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        monkeypatch.setattr(archive, "mark_deleted", connection_lost)
        r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
        assert r.headers["retry-after"] == "5"
        monkeypatch.undo()
        with pytest.raises(BoardNotFound):
            await store.get(name)
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)


async def test_a_delete_that_finds_no_board_asks_postgresql_only_for_a_deletion_it_owes(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every DELETE answered 404 connected to PostgreSQL to look for a deletion to record there
    (``archive.mark_gone``), so any admin client made connections by deleting made-up names, and
    with PostgreSQL down the DELETE of a board that never was answered 503 ``archive_unavailable``.
    Redis now keeps which deletions still owe PostgreSQL their mark: one that does not is a 404
    with PostgreSQL down (a board that never was, one whose 204 was answered); one whose last mark
    failed is still the 503 until PostgreSQL records it, and a 404 after that."""
    name = "acked-delete-owes"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
        router(cluster_url, postgres_url=NOBODY) as (_, down),
    ):
        r = await down.delete("/v1/boards/acked-delete-never-was", headers=AS_ADMIN)
        assert r.status_code == 404 and r.json()["error"]["code"] == "board_not_found", r.text

        with monkeypatch.context() as patched:
            patched.setattr(archive, "mark_deleted", connection_lost)
            r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
        assert await raw.pttl(keys.owed_key(name)) > 0  # owed, for a bounded time
        r = await down.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        assert (await down.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)
        # Answered 204: nothing owed, PostgreSQL not asked by the DELETE sent again.
        await store.create(BoardConfig.from_dict(name, {}))
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        assert not await raw.exists(keys.owed_key(name))
        assert (await down.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404


async def test_a_delete_whose_last_mark_failed_comes_back_from_a_total_loss_and_deletes_again(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis lost between the Redis part of a DELETE and its last mark (503): Redis's record of the
    deletion owed goes with it, so the DELETE sent again is a 404 that asks PostgreSQL nothing, and
    PostgreSQL's pending mark alone decides: `rebuild --all` brings the board back (its DELETE was
    never acknowledged), and the DELETE sent then deletes it for good."""
    name = "acked-delete-owed-lost"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
        router(cluster_url, postgres_url=NOBODY) as (_, down),
    ):
        with monkeypatch.context() as patched:
            patched.setattr(archive, "mark_deleted", connection_lost)
            r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
        await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
        assert (await down.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        top = await (await store.get(name)).top(10)
        assert sorted((e.player_id, e.points) for e in top) == [("p1", 10), ("p2", 10)]
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)


async def backdated(db: Any, name: str, seconds: float) -> None:
    """``name``'s marks in ``boards`` (its DELETE begun, its deletion) made ``seconds`` ago."""
    await db.execute(
        "UPDATE boards SET delete_begun_at = delete_begun_at - make_interval(secs => %s), "
        "deleted_at = deleted_at - make_interval(secs => %s) WHERE board = %s",
        (seconds, seconds, name),
    )


async def test_a_delete_sent_again_after_failed_delete_s_is_not_taken_back_by_a_refresh_that_listed_it(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DELETE failed in Redis after its mark (503), and is sent again 90 s later, inside an
    archiver's refresh that read the registry before the retry (the board listed). When the
    archiver took back a deletion mark older than 60 s of a board its registry read listed (for a
    DELETE that failed), it took back the retry's after its 204 (the retry's mark kept the first
    call's time): Redis lost before the next refresh, `rebuild --all` brought the board back. The
    deletion is recorded after the Redis part now, and nothing takes it back."""
    name = "acked-delete-retried-late"
    async with archived(raw, store, postgres_url, name) as (url, a):
        async with router(cluster_url, postgres_url=url) as (_, client):
            await delete_failing_in_redis(client, name, monkeypatch)
            await backdated(a.db, name, 90)  # the retry comes later
            original = a._deleted

            async def retried_meanwhile(*args: Any, **kwargs: Any) -> list[tuple[str, str]]:
                # The refresh has read the registry (the board listed); the retry runs now.
                r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
                assert r.status_code == 204, r.text
                return await original(*args, **kwargs)

            monkeypatch.setattr(a, "_deleted", retried_meanwhile)
            monkeypatch.setattr(archive, "SWEEP_BANS_EVERY_S", 0.0)
            a._known.clear()  # a refresh that reads the registry again
            await a.refresh()
            monkeypatch.undo()
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)


async def test_a_delete_slower_than_failed_delete_s_stays_deleted(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DELETE whose Redis part comes 90 s after its mark (Redis slow, the request queued at the
    router's gate), an archiver's refresh (with its sweep) between the two. When the mark before
    Redis was the deletion's, that refresh judged it a DELETE that failed and took it back, the
    DELETE then deleted the board and answered 204 (the forgetting of its bans, which marks it too,
    failing after it), and Redis lost before the next refresh had `rebuild --all` bring it back.
    The deletion is recorded once Redis has made it, before the 204."""
    name = "acked-delete-slow"
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        original = archive.mark_deleting

        async def slow(db: Any, board: Board) -> None:
            await original(db, board)
            await backdated(a.db, name, 90)  # Redis answers that much later
            await a.refresh()  # meanwhile, with a sweep: the board still listed

        async def unconfirmed(*args: Any, **kwargs: Any) -> int:
            raise NotAcknowledged("no replica of the ban list's primary confirmed in time")

        monkeypatch.setattr(archive, "mark_deleting", slow)
        monkeypatch.setattr(archive, "SWEEP_BANS_EVERY_S", 0.0)
        monkeypatch.setattr(moderation.Bans, "forget", unconfirmed)
        try:
            async with router(cluster_url, postgres_url=url) as (_, client):
                assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            monkeypatch.undo()
            await lose_redis_and_rebuild_all(raw, cluster_url, url)
            with pytest.raises(BoardNotFound):
                await store.get(name)
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_a_delete_retried_after_the_board_was_created_again_leaves_no_incarnation_to_restore(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DELETE deletes the board in Redis and fails on its last mark (503: "send the DELETE
    again"); the id is created again (PUT) before the retry, which deletes that board and answers
    204. The first incarnation kept its pending mark alone (the retry found a board, so no 404's
    ``mark_gone``), and Redis lost before the archiver's next refresh had `rebuild --all` bring it
    back: a board the client deleted and was answered 204 for, with the results of before. The
    DELETE that answers 204 records too the deletions Redis marks of the id's pending incarnations."""
    name = "acked-delete-retried-after-recreate"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):

        async def refused(*args: Any, **kwargs: Any) -> None:
            raise psycopg.OperationalError("connection lost")

        with monkeypatch.context() as patched:
            patched.setattr(archive, "mark_deleted", refused)
            r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
        r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)


async def test_a_board_deleted_while_every_primary_is_out_of_memory_is_marked_twice(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """DELETE on a cluster whose every primary is at maxmemory (a deletion frees memory:
    tests/test_store_oom.py): 204, with both of its marks in PostgreSQL, the DELETE begun
    (``delete_begun_at``) and the deletion (``deleted_at``), so `rebuild --all` after a total loss
    leaves it deleted."""
    name = "acked-delete-full"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        board = await store.get(name)
        async with full_primaries(store):
            answer = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
            assert answer.status_code == 204, answer.text
        async with await psycopg.AsyncConnection.connect(url) as db:
            cur = await db.execute(
                "SELECT delete_begun_at IS NOT NULL, deleted_at IS NOT NULL FROM boards "
                "WHERE board = %s AND incarnation = %s",
                (name, board.incarnation),
            )
            assert await cur.fetchall() == [(True, True)]
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)


@contextlib.contextmanager
def delete_connections(patch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The PostgreSQL connections opened by DELETE /v1/boards/{board} (``routes.delete_board`` on
    the stack of the call that opens one) while in the block, as a list that grows: each one's
    application name."""
    opened: list[str] = []
    original = psycopg.AsyncConnection.connect

    async def counted(cls: Any, *args: Any, **kwargs: Any) -> Any:
        stack = traceback.extract_stack()
        if any(f.name == "delete_board" and f.filename.endswith("routes.py") for f in stack):
            opened.append(str(kwargs.get("application_name")))
        return await original(*args, **kwargs)

    with patch.context() as patched:
        patched.setattr(psycopg.AsyncConnection, "connect", classmethod(counted))
        yield opened


async def test_a_delete_opens_one_postgresql_connection_and_a_404_that_owes_nothing_none(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DELETE of a journaled board with a ban marks it in PostgreSQL twice (its DELETE begun,
    then its deletion) and forgets its bans there. Each mark opened a connection of its own, and
    the bans' forgetting a third: three connections for one DELETE, and three times the connection
    set-up (the schema check) on its path. One connection serves the whole DELETE now, and a 404
    that owes PostgreSQL no deletion opens none."""
    name = "acked-delete-one-connection"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        scope = {"scope": "board", "board": name, "reason": "test"}
        r = await client.post("/v1/players/p1:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        board = await store.get(name)
        with delete_connections(monkeypatch) as opened:
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            assert len(opened) == 1, opened
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
            assert len(opened) == 1, opened
        async with await psycopg.AsyncConnection.connect(url) as db:
            cur = await db.execute(
                "SELECT delete_begun_at IS NOT NULL, deleted_at IS NOT NULL FROM boards "
                "WHERE board = %s AND incarnation = %s",
                (name, board.incarnation),
            )
            assert await cur.fetchall() == [(True, True)]
            cur = await db.execute("SELECT count(*) FROM bans WHERE board = %s", (name,))
            assert await cur.fetchall() == [(0,)]  # forgotten, on the same connection


async def test_a_board_deleted_while_every_primary_is_out_of_memory_is_confirmed_by_a_replica(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """The same DELETE on a full cluster under ``SHARDLB_ACK=replica``: the deletion's confirmation
    (``BoardStore._confirm``: the registry read back with a marker and WAIT) wrote its marker with a
    plain SET, which a primary out of memory refuses, so the board was deleted and the DELETE
    answered 503 ``out_of_memory``. Failed before: 503. The deletion's marker goes through
    marker.lua (allow-oom) now: 204, both marks in PostgreSQL."""
    name = "acked-delete-full-replica"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url, ack="replica", ack_timeout_ms=2000) as (_, client),
    ):
        board = await store.get(name)
        async with full_primaries(store):
            answer = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
            assert answer.status_code == 204, answer.text
        with pytest.raises(BoardNotFound):
            await store.get(name)
        async with await psycopg.AsyncConnection.connect(url) as db:
            cur = await db.execute(
                "SELECT delete_begun_at IS NOT NULL, deleted_at IS NOT NULL FROM boards "
                "WHERE board = %s AND incarnation = %s",
                (name, board.incarnation),
            )
            assert await cur.fetchall() == [(True, True)]


@pytest.mark.parametrize(
    "failure",
    [redis.exceptions.SlotNotCoveredError("slot not covered"), redis.exceptions.ConnectionError("lost")],
    ids=lambda e: type(e).__name__,
)
async def test_a_delete_recorded_whose_owed_note_cannot_go_answers_204(
    store: BoardStore,
    raw: Any,
    cluster_url: str,
    postgres_url: str,
    failure: Exception,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deletion done in Redis and recorded in PostgreSQL, the note that PostgreSQL is owed it
    (``archive.paid_deletions``) fails to go: the DELETE is done, and answers 204; the note left
    costs the next DELETE of the id one look in PostgreSQL, which pays it (a 404). Until 2026-12-06
    it answered 503: a cluster client's own error (``RedisClusterException``, not a RedisError:
    a slot not covered) was not caught, and a RedisError caught once was raised by the same call
    made again for the deletions owed (``_mark_gone``)."""
    async with router(cluster_url, postgres_url=postgres_url) as (_, client):
        name = board_name("paid")
        assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
        incarnation = (await store.get(name)).incarnation

        async def unpaid(*args: Any, **kwargs: Any) -> None:
            raise failure

        with monkeypatch.context() as patched:
            patched.setattr(archive, "paid_deletions", unpaid)
            r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        assert r.status_code == 204, r.text  # before: 503 cluster_unavailable
        assert await archive.owed_deletions(raw, name) == [incarnation]  # the note left
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        assert await archive.owed_deletions(raw, name) == []  # paid by that 404's look


@pytest.mark.parametrize("earlier", [False, True], ids=["nothing-else-owed", "an-earlier-delete-owed"])
async def test_a_delete_recorded_whose_look_at_the_owed_notes_fails_answers_204_when_nothing_can_come_back(
    store: BoardStore,
    raw: Any,
    cluster_url: str,
    postgres_url: str,
    earlier: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deletion done in Redis and recorded in PostgreSQL, the DELETE's look at the deletions
    Redis notes owed for the id (``_mark_gone``: an earlier incarnation's DELETE that failed on its
    last mark, the id created again since) fails. Failed before: 503 ``cluster_unavailable`` though
    the deletion was done and recorded. Now PostgreSQL is asked instead (on the DELETE's connection)
    whether any incarnation of the id has its DELETE begun and not recorded: with none, nothing can
    come back from a total loss, and the answer is 204; with one (``earlier``), only Redis's mark of
    its deletion may record it (``archive.mark_gone``), so the answer stays 503 and the retry (a
    404, its own look) records it. Either way `rebuild --all` after a total loss restores nothing."""
    name = "acked-delete-owed-unread"
    async with (
        archived(raw, store, postgres_url, name) as (url, _),
        router(cluster_url, postgres_url=url) as (_, client),
    ):
        if earlier:  # the first DELETE deletes it and fails on its last mark; the id made again
            with monkeypatch.context() as patched:
                patched.setattr(archive, "mark_deleted", connection_lost)
                r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
            assert r.status_code == 503 and r.json()["error"]["code"] == "archive_unavailable", r.text
            r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
            assert r.status_code == 201, r.text
        board = await store.get(name)

        async def unread(*args: Any, **kwargs: Any) -> list[str]:
            raise redis.exceptions.ConnectionError("lost")

        with monkeypatch.context() as patched:
            patched.setattr(archive, "owed_deletions", unread)
            r = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
        with pytest.raises(BoardNotFound):
            await store.get(name)
        async with await psycopg.AsyncConnection.connect(url) as db:
            cur = await db.execute(
                "SELECT deleted_at IS NOT NULL FROM boards WHERE board = %s AND incarnation = %s",
                (name, board.incarnation),
            )
            assert await cur.fetchall() == [(True,)]  # this DELETE's deletion recorded
        if earlier:
            assert r.status_code == 503 and r.json()["error"]["code"] == "cluster_unavailable", r.text
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        else:
            assert r.status_code == 204, r.text  # before: 503 cluster_unavailable
        await lose_redis_and_rebuild_all(raw, cluster_url, url)
        with pytest.raises(BoardNotFound):
            await store.get(name)
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
