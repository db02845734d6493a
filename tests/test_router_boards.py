"""router/boards.py: board lookups through the app, remembered when missing, never starving writes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.boards import Boards
from router.gate import Gate
from shardlb.board import Board
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound
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


class HeldStore(BoardStore):
    """A board store whose first ``get`` is held, after it read the registry, until ``go`` is set:
    a read's fetch of a board that began before a create or a delete and ends after it."""

    def __init__(self, client: Any, scripts: Any) -> None:
        super().__init__(client, scripts)
        self.read = asyncio.Event()
        self.go = asyncio.Event()
        self.held = False

    async def get(self, board_id: str) -> Board:
        try:
            return await super().get(board_id)
        finally:
            if not self.held:
                self.held = True
                self.read.set()
                await self.go.wait()


async def held_lookup(boards: Boards, store: HeldStore, board_id: str) -> asyncio.Future[Board]:
    """A read's lookup of ``board_id`` whose registry read is done and whose answer is held."""
    fetch = asyncio.ensure_future(boards.lookup(board_id))
    await store.read.wait()
    return fetch


@pytest.mark.cluster
async def test_a_read_begun_before_a_create_does_not_hide_the_new_board(store: BoardStore) -> None:
    """A board created through this router is visible to reads at once (router/boards.py); a read
    of it that found it missing just before and ended just after marked it missing anew: reads
    answered 404 for a second after the create's 201."""
    held = HeldStore(store.client, store.scripts)
    boards = Boards(held, Gate(4))
    name = board_name("held")
    fetch = await held_lookup(boards, held, name)
    try:
        await boards.create(BoardConfig.from_dict(name, {}))
        held.go.set()
        with pytest.raises(BoardNotFound):
            await fetch  # the read's own answer: the board was not there when it looked
        assert (await boards.lookup(name)).config.id == name
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_a_read_begun_before_a_delete_does_not_keep_the_deleted_board(store: BoardStore) -> None:
    """A delete through this router forgets the board at once; a read of it that began before and
    ended after kept the deleted incarnation: reads of it answered for CACHE_SECONDS more."""
    name = board_name("held")
    await store.create(BoardConfig.from_dict(name, {}))
    held = HeldStore(store.client, store.scripts)
    boards = Boards(held, Gate(4))
    fetch = await held_lookup(boards, held, name)
    await boards.delete(name)
    held.go.set()
    assert (await fetch).config.id == name  # the read's own answer: it was there when it looked
    assert boards.cached(name) is None
    with pytest.raises(BoardNotFound):
        await boards.lookup(name)


@pytest.mark.cluster
async def test_a_write_after_a_create_does_not_wait_for_a_fetch_begun_before_it(store: BoardStore) -> None:
    """A write's lookup of a board joins the fetch of it under way; one begun before the board was
    created through this router answered the write after it 404 board_not_found."""
    held = HeldStore(store.client, store.scripts)
    boards = Boards(held, Gate(4))
    name = board_name("held")
    early = asyncio.ensure_future(boards.get(name))  # a write's fetch before the create
    await held.read.wait()
    try:
        await boards.create(BoardConfig.from_dict(name, {}))
        later = await asyncio.wait_for(boards.get(name), 10)  # held until `go` if it joins the early one
        assert later.config.id == name
    finally:
        held.go.set()
        with pytest.raises(BoardNotFound):
            await early
        await store.delete(name)


class HeldList(BoardStore):
    """A board store whose first listing is held, after it read the registry, until ``go`` is set."""

    def __init__(self, client: Any, scripts: Any) -> None:
        super().__init__(client, scripts)
        self.read = asyncio.Event()
        self.go = asyncio.Event()
        self.held = False

    async def list(self) -> list[BoardConfig]:
        listed = await super().list()
        if not self.held:
            self.held = True
            self.read.set()
            await self.go.wait()
        return listed


@pytest.mark.cluster
async def test_a_list_after_a_create_does_not_join_a_listing_begun_before_it(store: BoardStore) -> None:
    """GET /v1/boards shares the registry read under way; one begun before a create through this
    router answered the list after the create's 201 without the new board."""
    held = HeldList(store.client, store.scripts)
    boards = Boards(held, Gate(4))
    name = board_name("held")
    early = asyncio.ensure_future(boards.list())
    await held.read.wait()
    try:
        await boards.create(BoardConfig.from_dict(name, {}))
        later = asyncio.ensure_future(boards.list())
        await asyncio.sleep(0)  # it joins the early listing, or takes its turn in the read lane
        held.go.set()
        assert name not in {c.id for c in await early}
        assert name in {c.id for c in await asyncio.wait_for(later, 10)}
    finally:
        held.go.set()
        await store.delete(name)
