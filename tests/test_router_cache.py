"""router/cache.py on the session cluster: what the top cache answers stays as fresh as its ``as_of``
says, across a reshard of the board it holds, and across a shard lost and rebuilt."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from shardlb import times
from shardlb.board import Board, Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.reads import ResolvedView
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


async def _lose_b(store: BoardStore, name: str) -> tuple[Board, ResolvedView, int, str, bytes]:
    """Board ``name`` (``two_players``) loses the total of the shard holding b, as Redis loses a shard
    whose master and replica went at once: its view, the shard, its key and the key's dump."""
    board = await store.get(name)
    view = board.resolve("total")
    [key] = [k for k in view.keys if await store.client.zscore(k, "b") is not None]
    dumped = await store.client.dump(key)
    await store.client.delete(key)
    return board, view, view.keys.index(key), key, dumped


async def _first_answer(client: httpx.AsyncClient, name: str) -> list[str]:
    """The first top the router answers once it serves the board again (503 board_rebuilding before)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while loop.time() < deadline:
        r = await client.get(f"/v1/boards/{name}/top")
        if r.status_code == 200:
            return top_of(r)[0]
        assert (r.status_code, r.json()["error"]["code"]) == (503, "board_rebuilding"), r.text
        await asyncio.sleep(0.02)
    raise AssertionError("the board was never served again")


async def test_a_top_read_while_a_shard_was_lost_is_not_served_once_it_is_rebuilt(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """A shard's keys lost (before anything marked it) and a refresh of the kept top read the shards
    left; the shard is then marked not rebuilt (reads refused: 503 board_rebuilding), rebuilt and
    unmarked. The first top answered after that is the board's, not the copy read while the shard
    was gone. Failed before: a refused read left the copy kept, and the reader's board, unmarked
    again, was served it (`["a"]`) until the next refresh, as after `shardlb rebuild --all` a
    `make run` router answered an empty or partial top for up to a second (README.md, item 22)."""
    name = board_name("lost")
    async with running(cluster.url, top_refresh_s=3.0) as (app, client):
        await two_players(client, name)
        tops = service_of(app).tops
        try:
            before = tops.as_of(store_view := (await store.get(name)).resolve("total"))
            board, view, shard, key, dumped = await _lose_b(store, name)
            assert view == store_view and before is not None
            while tops.as_of(view) == before:  # a refresh reads the shard left
                await asyncio.sleep(0.05)
            await store.unbuilt(board, [shard])  # as the archiver marks a shard it finds lost
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5.0
            while (r := await client.get(f"/v1/boards/{name}/top")).status_code == 200:
                assert loop.time() < deadline, "the mark was never seen"
                await asyncio.sleep(0.02)
            assert r.json()["error"]["code"] == "board_rebuilding", r.text
            await store.client.restore(key, 0, dumped)  # the shard rebuilt
            await store.rebuilt(name, board.incarnation, [shard])
            assert await _first_answer(client, name) == ["b", "a"]
        finally:
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_top_refreshed_while_its_shard_is_marked_not_rebuilt_is_dropped(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """As above, with no read while the shard is marked (a rebuild of a few seconds, as `rebuild
    --all`'s after a loss of Redis): the refresh in that time reads through the board as the
    router knows it, marked, and drops the copy, so the first top answered once the shard is
    rebuilt is read anew. Failed before: the refresh read through the board object the copy was
    last served with, which knew of no mark, and kept what the shards left held (`[]`) to serve."""
    name = board_name("marked")
    async with running(cluster.url, top_refresh_s=3.0) as (app, client):
        await two_players(client, name)
        tops = service_of(app).tops
        try:
            board, view, shard, key, dumped = await _lose_b(store, name)
            await store.unbuilt(board, [shard])
            await asyncio.sleep(0.5)  # the router takes the mark in (its registry look, every 0.25 s)
            before = tops.as_of(view)
            while tops.as_of(view) == before:  # a refresh while the shard is marked
                await asyncio.sleep(0.05)
            await store.client.restore(key, 0, dumped)
            await store.rebuilt(name, board.incarnation, [shard])
            assert await _first_answer(client, name) == ["b", "a"]
        finally:
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_rank_estimate_sampled_while_its_shard_is_marked_not_rebuilt_is_not_given(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """The rank estimates' histograms (`estimate=true`, router/histogram.py) are kept and refreshed
    as the tops are: one sampled while a shard's keys were gone, through a board object that knew
    of no mark, must not answer once the shard is rebuilt. Failed before: b's estimate then read
    the emptied shard's sample (`players` 1 where the board holds 2)."""
    name = board_name("estimated")
    async with running(cluster.url, histogram_refresh_s=3.0) as (app, client):
        await two_players(client, name)
        assert (await client.get(f"/v1/boards/{name}/players/b?estimate=true")).json()["players"] == 2
        views = service_of(app).histograms._views
        try:
            board, view, shard, key, dumped = await _lose_b(store, name)
            await store.unbuilt(board, [shard])
            await asyncio.sleep(0.5)  # the router takes the mark in
            before = views.get(view)
            while (now := views.get(view)) is before:  # a refresh while the shard is marked
                await asyncio.sleep(0.05)
            await store.client.restore(key, 0, dumped)
            await store.rebuilt(name, board.incarnation, [shard])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10.0
            while (r := await client.get(f"/v1/boards/{name}/players/b?estimate=true")).status_code == 503:
                assert loop.time() < deadline, r.text
                await asyncio.sleep(0.02)
            assert r.status_code == 200 and (r.json()["rank"], r.json()["players"]) == (1, 2), (r.text, now)
        finally:
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
