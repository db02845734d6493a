"""Acknowledged removals through a total loss of Redis (every master flushed) and `shardlb rebuild
--all`, made at once after the call, before the archiver's next round: a board deleted (DELETE 204,
a season archive) stays deleted, a player removed stays removed (docs/design-notes.md, "A total
loss of Redis")."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from shardlb import times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound
from shardlb.settlement import Request, archive_season
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN
from tests.router_support import running as router
from tests.test_rebuild import own_archive

pytestmark = pytest.mark.cluster

TABLE = [{"rank": 1, "reward": "gold"}]


async def archived_board(raw: Any, store: BoardStore, url: str, name: str) -> Archiver:
    """``name`` created with two players, every result archived in ``url`` (the board's row in
    ``boards`` too); the archiver, to close."""
    config = BoardConfig.from_dict(name, {"periods": ["daily"], "sharding": {"shards": 3}})
    board, _ = await store.create(config)
    a = Archiver(raw, store, await connect_db(url), name, claim_idle_s=0)
    await a.refresh()
    await board.submit([Score(p, 10, f"m-{p}", times.now_ms() - 60_000) for p in ("p1", "p2")])
    while await a.round():
        pass
    return a


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
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        try:
            async with router(cluster_url, postgres_url=url) as (_, client):
                assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
                await lose_redis_and_rebuild_all(raw, cluster_url, url)
                with pytest.raises(BoardNotFound):
                    await store.get(name)
                assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 404
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_a_board_archived_for_its_season_stays_deleted_after_a_total_loss(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A season archive settles the board and deletes it (answered ``archived: true``). Its
    deletion was marked in PostgreSQL only for a board with bans (``Bans.sweep`` forgets those
    alone), else by the archiver's next refresh: Redis lost before it, `rebuild --all` brought the
    archived board back, closed, with every result of the season. The archive now marks it deleted
    itself; its retry after the rebuild answers as the first call."""
    name = "acked-delete-season"
    async with own_archive(postgres_url) as url:
        a = await archived_board(raw, store, url, name)
        try:
            request = Request.of({"settlement_id": f"{name}-1", "rewards": TABLE})
            first = await archive_season(cluster_url, url, name, request)
            assert (first["archived"], first["players"]) == (True, 2)
            await lose_redis_and_rebuild_all(raw, cluster_url, url)
            with pytest.raises(BoardNotFound):
                await store.get(name)
            again = await archive_season(cluster_url, url, name, request)
            assert again == first
        finally:
            await a.db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)
