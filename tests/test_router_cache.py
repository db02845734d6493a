"""router/cache.py on the session cluster: what the top cache answers stays as fresh as its ``as_of``
says, across a reshard of the board it holds."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shardlb import times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.reshard import Resharder
from shardlb.store import CACHE_SECONDS, BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

T0 = 1_790_000_000_000


def top_of(r: httpx.Response) -> tuple[list[str], int]:
    assert r.status_code == 200, r.text
    body = r.json()
    return [e["player_id"] for e in body["entries"]], times.parse(body["as_of"], "as_of")


async def two_players(client: httpx.AsyncClient, name: str) -> None:
    """Board ``name`` created in memory on 2 shards, players a (10) and b (20) posted, its top read."""
    body = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
    scores = [
        {"player_id": p, "points": n, "match_id": "m", "achieved_at": T0} for p, n in (("a", 10), ("b", 20))
    ]
    posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text
    assert top_of(await client.get(f"/v1/boards/{name}/top"))[0] == ["b", "a"]


async def test_a_top_kept_across_a_reshard_is_never_the_old_layout_read_as_new(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """A router that kept a board's top before a reshard began (and never writes to the board, so
    only its board cache's expiry tells it of the reshard) must not answer, once the new layout is
    open, the old layout's rows (or nothing, once they are dropped) stamped with a fresh ``as_of``:
    an answer as of T holds every write acknowledged before T."""
    name = board_name("moved")
    async with running(cluster.url, top_refresh_s=0.05) as (_, client):
        await two_players(client, name)
        try:
            # The mover waits out the routers' board caches before it seals, as in production.
            mover = Resharder(store, name, say=lambda _: None, cache_s=CACHE_SECONDS)
            await mover.start(3)
            moving = asyncio.ensure_future(mover.run())
            while not moving.done():  # readers go on reading the top meanwhile
                seen = top_of(await client.get(f"/v1/boards/{name}/top"))[0]
                assert seen == ["b", "a"]
                await asyncio.sleep(0.1)
            assert (await moving)["shards"] == 3
            # Another router writes to the new layout.
            fresh = await store.get(name)
            await fresh.submit([Score("c", 30, "m", T0)], times.now_ms())
            acknowledged = times.now_ms()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + CACHE_SECONDS + 2
            while loop.time() < deadline:
                seen, as_of = top_of(await client.get(f"/v1/boards/{name}/top"))
                # A copy read after the write was acknowledged has c; one stamped before may have
                # it too (its reads of the shards come after its stamp, and may come after the write).
                want = [["c", "b", "a"]] if as_of > acknowledged else [["b", "a"], ["c", "b", "a"]]
                assert seen in want, (seen, as_of - acknowledged)
                await asyncio.sleep(0.1)
            assert seen == ["c", "b", "a"]
        finally:
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_router_that_keeps_a_board_follows_a_reshard_made_elsewhere(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """A router that reads a board and keeps it (an hour here) while another process reshards it
    learns of each step from the registry's version (router/boards.py, ``Boards.follow``): once the
    new layout is open, its top holds a write made there. Failed before: the router kept the old
    layout's Board for as long as its copy lived, and its top never held the write."""
    name = board_name("moved")
    async with running(cluster.url, top_refresh_s=0.05) as (app, client):
        service_of(app).boards.ttl_s = 3600.0
        await two_players(client, name)
        try:
            # The mover waits a second for the routers' copies: this one follows the version.
            mover = Resharder(store, name, say=lambda _: None, cache_s=1.0)
            await mover.start(3)
            assert (await mover.run())["shards"] == 3
            fresh = await store.get(name)
            await fresh.submit([Score("c", 30, "m", T0)], times.now_ms())
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20.0  # generous: the router keeps a board for an hour
            while loop.time() < deadline:
                seen = top_of(await client.get(f"/v1/boards/{name}/top"))[0]
                if seen == ["c", "b", "a"]:
                    break
                assert seen == ["b", "a"], seen
                await asyncio.sleep(0.05)
            assert seen == ["c", "b", "a"]
            kept = service_of(app).boards.cached(name)
            assert kept is not None and kept.generation == fresh.generation
        finally:
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_top_kept_of_a_board_deleted_and_created_again_elsewhere_is_not_served(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """A router keeps a board's top; another process deletes the board and creates it again with
    the same settings (a new incarnation, empty). Once the router has taken the new board in (its
    next look at the registry's version), its top is the new board's, not the kept top of the one
    deleted: the views the top cache keys on name the incarnation (shardlb/reads.py). Checked in a
    review of the version's following; it held. Without the following it fails (the router keeps
    the deleted board's copy for an hour here)."""
    name = board_name("again")
    body = {"durability": "memory"}
    async with running(cluster.url, top_refresh_s=3600.0) as (app, client):
        service_of(app).boards.ttl_s = 3600.0
        assert (await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
        scores = [{"player_id": "a", "points": 10, "match_id": "m", "achieved_at": T0}]
        posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
        assert posted.status_code == 200, posted.text
        assert top_of(await client.get(f"/v1/boards/{name}/top"))[0] == ["a"]
        old = service_of(app).boards.cached(name)
        try:
            await store.delete(name)  # another process
            await store.create(BoardConfig.from_dict(name, body))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20.0  # generous: the router keeps a board for an hour
            while service_of(app).boards.cached(name) in (old, None) and loop.time() < deadline:
                await client.get(f"/v1/boards/{name}/top")
                await asyncio.sleep(0.05)
            assert service_of(app).boards.cached(name) not in (old, None)
            assert top_of(await client.get(f"/v1/boards/{name}/top"))[0] == []
        finally:
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
