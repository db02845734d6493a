"""router/boards.py: board lookups through the app, remembered when missing, never starving writes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_READER, AS_WRITER, board_name, running, service_of


@pytest.mark.cluster
async def test_unknown_boards_are_remembered_as_missing(cluster: LocalCluster, store: BoardStore) -> None:
    async with running(cluster.url) as (app, client):
        boards = service_of(app).boards
        fetched: list[str] = []
        real_get = boards.store.get

        async def counting_get(board_id: str) -> Any:
            fetched.append(board_id)
            return await real_get(board_id)

        boards.store.get = counting_get  # type: ignore[method-assign]
        name = board_name()
        for _ in range(5):
            r = await client.get(f"/v1/boards/{name}/top")
            assert r.status_code == 404 and r.json()["error"]["code"] == "board_not_found"
        assert fetched == [name]  # one registry read, then the answer is remembered
        # A board made elsewhere is not hidden from writes by a read's negative answer.
        await store.create(BoardConfig.from_dict(name, {}))
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        assert (
            await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        ).status_code == 200
        assert (await client.get(f"/v1/boards/{name}/top")).status_code == 200
        # A board created through this router is visible at once, to reads as well.
        other = board_name()
        assert (await client.get(f"/v1/boards/{other}/top")).status_code == 404
        assert (await client.put(f"/v1/boards/{other}", headers=AS_ADMIN)).status_code == 201
        assert (await client.get(f"/v1/boards/{other}/top")).status_code == 200
        # The memory of missing boards is bounded.
        boards.max_missing = 20
        for i in range(30):
            assert (await client.get(f"/v1/boards/nope{i}-{name}/top")).status_code == 404
        assert len(boards.missing) == 20 and f"nope29-{name}" in boards.missing
        for board in (name, other):
            await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_a_flood_of_unknown_boards_does_not_starve_writes(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """Hundreds of reads of boards that do not exist, all at once, then a write to a board this
    router has not seen yet: the write's lookup is not queued behind the flood. (The reads carry a
    read key: from one address without one, most would be 429 before any lookup.)"""
    async with running(cluster.url, read_rate=0.0, read_queue=20) as (_, client):
        name = board_name()
        await store.create(BoardConfig.from_dict(name, {}))
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        flood = [client.get(f"/v1/boards/rand{i}-{name}/top", headers=AS_READER) for i in range(300)]
        *reads, write = await asyncio.gather(
            *flood, client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        )
        assert {r.status_code for r in reads} <= {404, 503}
        assert write.status_code == 200, write.text
        await store.delete(name)


@pytest.mark.cluster
async def test_a_flood_of_unknown_boards_does_not_starve_reads_of_known_ones(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """While lookups of boards that do not exist fill the read lane and its queue (many addresses
    can keep it full), a read of a board this router knows, whose kept settings have expired, is
    still answered: its settings are fetched again through a lane of their own. A board found
    deleted then is forgotten (reads of it go back to the read lane) and remembered as missing."""
    async with running(cluster.url, read_queue=1) as (app, client):
        boards = service_of(app).boards
        name = board_name()
        await store.create(BoardConfig.from_dict(name, {}))
        assert (await client.get(f"/v1/boards/{name}/top")).status_code == 200
        at, board = boards._kept[name]
        boards._kept[name] = (at - boards.ttl_s, board)  # its settings expired
        await boards.read_lane.acquire()  # the flood's lookup under way ...
        waiter = asyncio.ensure_future(boards.read_lane.acquire(wait_s=30))  # ... and its queue
        await asyncio.sleep(0)
        try:
            assert (await client.get(f"/v1/boards/rand-{name}/top")).status_code == 503
            r = await client.get(f"/v1/boards/{name}/top")
            assert r.status_code == 200, r.text
            at, board = boards._kept[name]
            boards._kept[name] = (at - boards.ttl_s, board)
            await store.delete(name)
            assert (await client.get(f"/v1/boards/{name}/top")).status_code == 404
            assert name not in boards._kept and name in boards.missing
        finally:
            boards.read_lane.release()
            await waiter
            boards.read_lane.release()
