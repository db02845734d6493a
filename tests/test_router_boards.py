"""router/boards.py: board lookups through the app, remembered when missing, never starving writes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import orjson
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError

from router.boards import Boards
from router.gate import Gate
from shardlb import keys
from shardlb import store as store_module
from shardlb.board import Board
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound, Overloaded
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
        self.holding = False

    async def get(self, board_id: str) -> Board:
        try:
            return await super().get(board_id)
        finally:
            if not self.holding:
                self.holding = True
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
        self.holding = False

    async def records(self) -> tuple[Any, dict[str, Any]]:
        listed = await super().records()
        if not self.holding:
            self.holding = True
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
        assert name not in listed(await early)
        assert name in listed(await asyncio.wait_for(later, 10))
    finally:
        held.go.set()
        await store.delete(name)


def listed(body: Any) -> set[str]:
    """The board ids of a GET /v1/boards body as ``Boards.list`` renders it."""
    return {b["board"] for b in orjson.loads(body.json_bytes)["boards"]}


async def registry_reads(store: BoardStore) -> int:
    """HGETALLs the registry's primary has run (INFO commandstats)."""
    node = store.client.get_node_from_key(keys.BOARDS)
    stats = await store.client.info("commandstats", target_nodes=node)
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


def count_boards_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the Board objects made from now on (this process)."""
    made = [0]
    init = Board.__init__

    def counting(self: Board, *args: Any, **kwargs: Any) -> None:
        made[0] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(Board, "__init__", counting)
    return made


@pytest.mark.cluster
async def test_board_lists_read_the_registry_once_while_it_does_not_change(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/boards is a public read. Each one read the whole registry (an HGETALL of 1 MB at
    2,000 boards) and made a Board of every record, 170-200 ms of a worker's event loop: a trickle
    of anonymous lists, each within its address's read budget, kept a worker busy. The body is now
    held with the registry's version: a list while the version stands is a GET, and no Board is
    made for a list at all."""
    name = board_name("listed")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4))
        made = count_boards_made(monkeypatch)
        before = await registry_reads(store)
        bodies = [await boards.list() for _ in range(20)]
        assert await registry_reads(store) - before == 1
        assert made[0] == 0
        assert all(name in listed(b) for b in bodies)
        assert {b.json_bytes for b in bodies} == {bodies[0].json_bytes} and {
            b.msgpack_bytes for b in bodies
        } == {bodies[0].msgpack_bytes}
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_a_list_shows_a_change_made_elsewhere_at_the_next_call(store: BoardStore) -> None:
    """A board created or deleted by another router (not through this one's ``Boards``) moves the
    registry's version: the next list reads the registry again and shows the change."""
    name = board_name("listed")
    boards = Boards(store, Gate(4))
    assert name not in listed(await boards.list())
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        assert name in listed(await boards.list())
    finally:
        await store.delete(name)
    assert name not in listed(await boards.list())
    created = board_name("listed")  # and through this router's own Boards
    await boards.create(BoardConfig.from_dict(created, {}))
    assert created in listed(await boards.list())
    await boards.delete(created)
    assert created not in listed(await boards.list())


@pytest.mark.cluster
async def test_a_record_written_without_moving_the_version_is_listed_after_the_ttl(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes of the release before write records without moving the registry's version
    (README, "Upgrading an install"): a held listing is read again once it is ``ttl_s`` old, and
    a read that finds the same records keeps the body it had (nothing parsed or rendered again)."""
    name = board_name("listed")
    boards = Boards(store, Gate(4), ttl_s=3600.0)
    first = await boards.list()
    record = orjson.dumps({**BoardConfig.from_dict(name, {}).to_dict(), "incarnation": "0a0b0c0d"})
    await store.client.hset(keys.BOARDS, name, record)  # as the release before creates: no version
    try:
        assert name not in listed(await boards.list())  # held: the version did not move
        boards.ttl_s = 0.0
        before = await registry_reads(store)
        again = await boards.list()
        assert await registry_reads(store) - before == 1
        assert name in listed(again)
        parsed = [0]
        real = BoardConfig.from_dict

        def counting(*args: Any, **kwargs: Any) -> BoardConfig:
            parsed[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(BoardConfig, "from_dict", counting)
        assert (
            await boards.list()
        ).json_bytes is again.json_bytes  # read again, same records: kept as it was
        assert parsed[0] == 0
        assert first.json_bytes != again.json_bytes
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_the_board_list_body_is_what_it_was(cluster: LocalCluster, store: BoardStore) -> None:
    """GET /v1/boards's body, in JSON and in MessagePack, is byte for byte the one rendered from a
    Board of every record sorted by id (what it was before the body was held), for boards of every
    sharding, moderation settings, records written by releases before (without fields added since)
    and a board being deleted (not listed); and it stays so across a change."""
    prefix = board_name("shape")
    made = [
        BoardConfig.from_dict(f"{prefix}-hash", {"mode": "incr", "periods": ["total", "daily"]}),
        BoardConfig.from_dict(
            f"{prefix}-band", {"sharding": {"strategy": "band", "bands": [0, 100], "shards": 2}}
        ),
        BoardConfig.from_dict(
            f"{prefix}-region",
            {"sharding": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2}},
        ),
        BoardConfig.from_dict(
            f"{prefix}-moderated", {"max_points_per_result": 50, "inactive_after": 86_400, "order": "asc"}
        ),
    ]
    for config in made:
        await store.create(config)
    old_band = {
        "board": f"{prefix}-old-band",
        "sharding": {"strategy": "band", "bands": [0, 10], "shards": 1},
    }
    old_plain = {
        "board": f"{prefix}-old",
        "mode": "set",
        "periods": ["total"],
        "sharding": {"strategy": "hash", "shards": 2},
    }
    gone = {**BoardConfig.from_dict(f"{prefix}-gone", {}).to_dict(), "state": "deleting"}
    for record in (old_band, old_plain, gone):
        await store.swap(str(record["board"]), b"", orjson.dumps({**record, "incarnation": "01020304"}))
    ids = [c.id for c in made] + [f"{prefix}-old-band", f"{prefix}-old", f"{prefix}-gone"]

    async def expected() -> tuple[bytes, bytes]:
        data = {
            "boards": [
                c.to_dict() for c in sorted((b.config for b in await store.boards()), key=lambda c: c.id)
            ]
        }
        return orjson.dumps(data), msgpack.packb(data, use_bin_type=True)

    try:
        async with running(cluster.url) as (_, client):
            for turn in range(2):
                as_json = await client.get("/v1/boards")
                as_msgpack = await client.get("/v1/boards", headers={"Accept": "application/msgpack"})
                assert as_json.headers["content-type"] == "application/json"
                assert as_msgpack.headers["content-type"] == "application/msgpack"
                assert (as_json.content, as_msgpack.content) == await expected()
                assert {f"{prefix}-old", f"{prefix}-old-band"} <= {
                    b["board"] for b in as_json.json()["boards"]
                }
                assert f"{prefix}-gone" not in {b["board"] for b in as_json.json()["boards"]}
                if turn == 0:
                    await store.delete(f"{prefix}-region")
    finally:
        for board_id in ids:
            with contextlib.suppress(BoardNotFound):
                await store.delete(board_id)


@pytest.mark.cluster
async def test_board_lists_through_the_app_read_the_registry_once(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """Through the app, with the router's other registry readers running beside it (the journal
    and reshard watches): N GET /v1/boards with no change make one registry read for the list."""
    name = board_name("listed")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        async with running(cluster.url) as (app, client):
            boards = service_of(app).boards
            real, reads = boards.store.records, [0]

            async def counted() -> tuple[Any, dict[str, Any]]:
                reads[0] += 1
                return await real()

            # The journal watch's first look (``BoardStore.follow``, in the background from the
            # start) reads the registry once; its later looks only while the version stands.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30.0
            while boards.store._followed is None and loop.time() < deadline:
                await asyncio.sleep(0.01)
            boards.store.records = counted  # type: ignore[method-assign]
            answers = [await client.get("/v1/boards") for _ in range(20)]
            assert {r.status_code for r in answers} == {200}
            assert {r.content for r in answers} == {answers[0].content}
            assert reads[0] == 1
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_a_board_deleted_through_another_router_is_gone_soon_from_this_one(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """Two routers read a board; one deletes it. The other learns of it from the registry's version
    (each worker follows it every ``FOLLOW_S``), not when its copy expires: this one keeps a board
    for an hour. Failed before: it answered the deleted board's top, 200, for as long as it kept
    the copy (``CACHE_SECONDS``, 5 s; here an hour). A board created again through the first is
    read by the other at once, though it remembered it missing (for an hour here)."""
    name = board_name("seen")
    async with running(cluster.url) as (_, first), running(cluster.url) as (other_app, other):
        service_of(other_app).boards.ttl_s = 3600.0
        assert (await first.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        assert (await other.get(f"/v1/boards/{name}/top")).status_code == 200
        assert (await first.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0  # generous: the copy is kept for an hour
        while True:
            answer = await other.get(f"/v1/boards/{name}/top")
            if answer.status_code == 404 or loop.time() > deadline:
                break
            assert answer.status_code == 200, answer.text
            await asyncio.sleep(0.02)
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "board_not_found"
        # Remembered missing (for an hour here), then created through the first router: the log
        # names it, and the other router reads it at its next request.
        service_of(other_app).boards.missing_ttl_s = 3600.0
        assert (await first.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        deadline = loop.time() + 20.0
        while True:
            answer = await other.get(f"/v1/boards/{name}/top")
            if answer.status_code == 200 or loop.time() > deadline:
                break
            assert answer.status_code == 404, answer.text
            await asyncio.sleep(0.02)
        assert answer.status_code == 200, answer.text
        assert (await first.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def command_calls(store: BoardStore, command: str) -> int:
    """Calls of ``command`` the registry's primary has run (INFO commandstats)."""
    node = store.client.get_node_from_key(keys.BOARDS)
    stats = await store.client.info("commandstats", target_nodes=node)
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def records_read(store: BoardStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the registry's records the store's client reads from now on (HGET, HMGET; an
    HGETALL reads them all: ``*``), in the order asked."""
    read: list[str] = []
    send = store.client.execute_command

    async def counted(*args: Any, **kwargs: Any) -> Any:
        command = str(args[0]).upper()
        if command in ("HGET", "HMGET", "HGETALL") and args[1] == keys.BOARDS:
            read.extend(str(a) for a in args[2:] if command != "HGET" or a is args[2])
            if command == "HGETALL":
                read.append("*")
        return await send(*args, **kwargs)

    monkeypatch.setattr(store.client, "execute_command", counted)
    return read


async def marked(store: BoardStore, board_id: str, write: Any) -> None:
    """The board's record changed (a shard marked not rebuilt), as another process would: ``write``
    takes (id, record now, new record)."""
    raw = await store.client.hget(keys.BOARDS, board_id)
    record = orjson.loads(raw)
    await write(board_id, raw, orjson.dumps({**record, "state": {**record["state"], "rebuilding": [0]}}))


async def marked_unnoted(store: BoardStore, board_id: str) -> None:
    """``marked``, as a process of the release before the change log writes it: the record set and
    the version moved, with no note in the log and no digest."""

    async def unnoted(board_id: str, _: Any, new: bytes) -> None:
        await store.client.hset(keys.BOARDS, board_id, new)
        await store.client.set(keys.BOARDS_VERSION, board_name("v"))

    await marked(store, board_id, unnoted)


@pytest.mark.cluster
async def test_following_the_version_expires_the_boards_changed_and_only_them(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move of the registry's version expires the copies of the boards whose records changed, and
    only those: the change log names them (one HMGET of the named boards kept, to compare). A
    record written without a note (a
    process of the release before: no version moved, or moved without the log) is found by
    comparing the records kept (their digests, then the record whose digest differs), once the
    version moves."""
    names = [board_name("followed") for _ in range(3)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4), ttl_s=3600.0)
        await boards.follow()
        for name in names:
            await boards.lookup(name)
        await boards.follow()  # nothing moved: nothing read but the version
        await marked(store, names[0], store.swap)
        hmgets, gets = await command_calls(store, "hmget"), await command_calls(store, "hget")
        await boards.follow()
        assert (
            await command_calls(store, "hmget") == hmgets + 1 and await command_calls(store, "hget") == gets
        )
        assert boards.cached(names[0]) is None
        assert all(boards.cached(n) is not None for n in names[1:])
        assert (await boards.lookup(names[0])).rebuilding == {0}

        await marked_unnoted(store, names[1])
        read = records_read(store, monkeypatch)
        await boards.follow()
        assert boards.cached(names[1]) is None
        assert all(boards.cached(n) is not None for n in (names[0], names[2]))
        assert read == [names[1]]
    finally:
        monkeypatch.undo()
        for name in names:
            await store.delete(name)


@pytest.mark.cluster
async def test_a_copy_fetched_after_the_change_the_log_names_is_kept(store: BoardStore) -> None:
    """A board this router created and read since: the log names it at the router's next look,
    but the copy kept is of the record as it is now, so it is kept (and what was built of it, its
    cached top). Failed before: every board the log named expired, and the next read fetched the
    board again and read its top again from every shard (tests/test_router_hot.py's
    ``test_not_modified_on_a_repeat`` saw one full read too many now and then)."""
    name = board_name("own")
    boards = Boards(store, Gate(4), ttl_s=3600.0)
    await boards.follow()
    await boards.create(BoardConfig.from_dict(name, {}))
    try:
        first = await boards.lookup(name)
        await boards.follow()  # the log names the creation
        assert boards.cached(name) is first
        await marked(store, name, store.swap)  # then a change made elsewhere
        await boards.follow()
        assert boards.cached(name) is None
        assert (await boards.lookup(name)).rebuilding == {0}
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_a_fetch_begun_before_a_move_keeps_nothing(store: BoardStore) -> None:
    """A fetch that read a record before another process changed it, and ends after ``follow``
    took the move in, answers its callers but keeps nothing: kept, it would hide the change until
    the copy expired. Requests after the move do not join it."""
    name = board_name("held")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        held = HeldStore(store.client, store.scripts)
        boards = Boards(held, Gate(4), ttl_s=3600.0)
        await boards.follow()
        fetch = asyncio.ensure_future(boards.get(name))  # a write's lookup, its answer held
        await held.read.wait()
        await marked(store, name, store.swap)
        await boards.follow()
        later = asyncio.ensure_future(boards.get(name))  # does not join the held fetch
        assert (await asyncio.wait_for(later, 10)).rebuilding == {0}
        held.go.set()
        assert not (await fetch).rebuilding  # its own answer: read before the change
        assert boards.cached(name) is not None and boards.cached(name).rebuilding == {0}  # type: ignore[union-attr]
    finally:
        held.go.set()
        await store.delete(name)


@pytest.mark.cluster
async def test_a_fetch_that_read_the_record_after_its_move_keeps_it(store: BoardStore) -> None:
    """A board created by another process, then read: the fetch reads the record the creation wrote,
    and ``follow`` takes the creation's move in while that fetch is under way. The fetch read the
    registry at the version the move was taken in through, so it holds the record as it is after
    the move: it is kept. Failed before: fetches were stamped with the moves taken in when they
    began, so it kept nothing and the next request fetched the board again
    (``test_a_flood_of_unknown_boards_does_not_starve_reads_of_known_ones`` met a KeyError about 2
    runs in 10, its follow loop taking the creation in during the first read's fetch)."""
    name = board_name("created")
    held = HeldStore(store.client, store.scripts)
    boards = Boards(held, Gate(4), ttl_s=3600.0)
    await boards.follow()
    await store.create(BoardConfig.from_dict(name, {}))  # through another process
    try:
        fetch = await held_lookup(boards, held, name)  # read after the creation, its answer held
        await boards.follow()  # the log names the creation
        held.go.set()
        assert (await fetch).config.id == name
        assert boards.cached(name) is await fetch
    finally:
        held.go.set()
        await store.delete(name)


@pytest.mark.cluster
async def test_a_fetch_that_found_a_board_gone_after_its_move_forgets_it(store: BoardStore) -> None:
    """A board kept, its copy expired, deleted by another process; the read's fetch finds it gone,
    and ``follow`` takes the deletion in while that fetch is under way. The fetch read the registry
    at the version the deletion was taken in through: the board is forgotten and remembered
    missing. Failed before: it kept the expired copy and remembered nothing, so the next read
    fetched it again (the end of ``test_a_flood_of_unknown_boards_does_not_starve_reads_of_known_
    ones`` could fail the same way as its start)."""
    name = board_name("gone")
    await store.create(BoardConfig.from_dict(name, {}))
    held = HeldStore(store.client, store.scripts)
    boards = Boards(held, Gate(4), ttl_s=3600.0, missing_ttl_s=3600.0)
    await boards.follow()
    held.holding = True  # not held: a copy kept
    await boards.lookup(name)
    held.holding = False
    at, board = boards._kept[name]
    boards._kept[name] = (at - boards.ttl_s, board)  # its settings expired
    await store.delete(name)  # through another process
    fetch = await held_lookup(boards, held, name)  # read after the deletion, its answer held
    await boards.follow()  # the log names the deletion
    held.go.set()
    with pytest.raises(BoardNotFound):
        await fetch
    assert name not in boards._kept and name in boards.missing


@pytest.mark.cluster
async def test_the_follow_loop_is_quiet_and_goes_on_through_redis_errors(
    store: BoardStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Every look failing (Redis unreachable): one warning for the outage, not one a look, the loop
    goes on, the copies are served as kept, and the first look that works logs the recovery and
    takes the moves in."""
    name = board_name("followed")
    await store.create(BoardConfig.from_dict(name, {}))
    boards = Boards(store, Gate(4), ttl_s=3600.0)
    boards.follow_s = 0.01
    real = store.version
    looks = [0]

    async def failing() -> Any:
        looks[0] += 1
        raise RedisConnectionError("no registry")

    task = asyncio.ensure_future(boards.run())
    try:
        await boards.lookup(name)
        store.version = failing  # type: ignore[method-assign]
        caplog.set_level(logging.INFO, "shardlb.router")
        while looks[0] < 30:
            await asyncio.sleep(0.01)
        assert not task.done()
        assert (await boards.lookup(name)).config.id == name  # served as kept
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not read" in warnings[0].getMessage()
        await marked(store, name, store.swap)
        store.version = real  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0
        while boards.cached(name) is not None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert boards.cached(name) is None
        assert any("read again" in r.getMessage() for r in caplog.records)
    finally:
        boards.closed = True
        store.version = real  # type: ignore[method-assign]
        await asyncio.wait_for(task, 10)
        await store.delete(name)


@pytest.mark.cluster
async def test_a_read_that_found_a_board_missing_before_a_move_does_not_hide_it(store: BoardStore) -> None:
    """A read's fetch that found no board, and ends after ``follow`` took in the move of its
    creation by another process, answers its caller but remembers nothing: the board is read at
    the next request. Failed before: the late answer marked it missing anew after the change log
    had taken it off, and reads answered 404 for ``missing_ttl_s`` (an hour here)."""
    name = board_name("late")
    held = HeldStore(store.client, store.scripts)
    boards = Boards(held, Gate(4), ttl_s=3600.0, missing_ttl_s=3600.0)
    await boards.follow()
    try:
        fetch = await held_lookup(boards, held, name)  # found nothing, its answer held
        await store.create(BoardConfig.from_dict(name, {}))  # through another process
        await boards.follow()
        held.go.set()
        with pytest.raises(BoardNotFound):
            await fetch  # its own answer: read before the creation
        assert (await boards.lookup(name)).config.id == name
    finally:
        held.go.set()
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


@pytest.mark.cluster
async def test_a_board_created_by_a_process_that_writes_no_note_is_not_hidden_by_the_missing_memory(
    store: BoardStore,
) -> None:
    """A board remembered missing, then created by a process whose move the change log does not
    name (a process of the release before the log, or a gap): when ``follow`` cannot tell which
    boards changed, it forgets the boards remembered missing too, as it compares the copies it
    keeps. Failed before: only the boards the log named were taken off that memory, so reads of
    this one answered 404 for ``missing_ttl_s`` (an hour here)."""
    name = board_name("unnoted")
    boards = Boards(store, Gate(4), ttl_s=3600.0, missing_ttl_s=3600.0)
    await boards.follow()
    try:
        with pytest.raises(BoardNotFound):
            await boards.lookup(name)
        await store.create(BoardConfig.from_dict(name, {}))
        await store.client.set(keys.BOARDS_VERSION, board_name("v"))  # a move without a note
        await boards.follow()
        assert (await boards.lookup(name)).config.id == name
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


@pytest.mark.cluster
async def test_a_look_at_the_version_never_waits_for_the_registry_gate(store: BoardStore) -> None:
    """While requests' fetches hold every permit of the registry gate (a slow registry primary), a
    look at the registry's version is skipped, not queued: queued, it took a place in the gate's
    queue and the next permit freed before the requests that came after it, and held it for as
    long as the primary took to answer. Failed before: the look waited in the gate's queue."""
    gate = Gate(2, 10, 30.0)
    boards = Boards(store, gate, ttl_s=3600.0)
    await boards.follow()
    await gate.acquire()
    await gate.acquire()  # two fetches under way
    look = asyncio.ensure_future(boards.follow())
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert gate.waiting == 0
        with pytest.raises(Overloaded):
            await look
    finally:
        gate.release()
        gate.release()
        look.cancel()
        with contextlib.suppress(asyncio.CancelledError, Overloaded):
            await look
    await boards.follow()  # a permit free: the look is made
    assert gate.held == 0


@pytest.mark.cluster
async def test_the_follow_loop_goes_on_through_a_bug_and_says_so_once_with_its_trace(
    store: BoardStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An error that is no outage (a bug: here a ValueError from every look) neither ends the loop
    nor floods the log: one warning, with the traceback, and the looks go on; the first look that
    works again takes the move in."""
    name = board_name("buggy")
    await store.create(BoardConfig.from_dict(name, {}))
    boards = Boards(store, Gate(4), ttl_s=3600.0)
    boards.follow_s = 0.01
    real = store.version
    looks = [0]

    async def broken() -> Any:
        looks[0] += 1
        raise ValueError("a bug")

    task = asyncio.ensure_future(boards.run())
    try:
        await boards.lookup(name)
        caplog.set_level(logging.INFO, "shardlb.router")
        store.version = broken  # type: ignore[method-assign]
        while looks[0] < 30 and not task.done():
            await asyncio.sleep(0.01)
        assert not task.done()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and warnings[0].exc_info is not None
        await marked(store, name, store.swap)
        store.version = real  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0
        while boards.cached(name) is not None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert boards.cached(name) is None
    finally:
        boards.closed = True
        store.version = real  # type: ignore[method-assign]
        await asyncio.wait_for(task, 10)
        await store.delete(name)


@pytest.mark.cluster
async def test_a_fetch_under_way_keeps_its_board_through_a_move_that_names_another(store: BoardStore) -> None:
    """A move the change log says changed another board does not touch a fetch under way: it keeps
    what it read, and requests after the move join it. Failed before: every move taken in made
    every fetch under way keep nothing and start again at the next request (one more registry read
    a fetch and a move: where the registry's primary answers slower than the looks come, a board's
    copy was never kept while the version moved, and each request of it queued a fetch)."""
    names = [board_name("fetched"), board_name("changed")]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    held = HeldStore(store.client, store.scripts)
    try:
        boards = Boards(held, Gate(4), ttl_s=3600.0)
        await boards.follow()
        fetch = asyncio.ensure_future(boards.get(names[0]))
        await held.read.wait()
        await marked(store, names[1], store.swap)
        await boards.follow()
        later = asyncio.ensure_future(boards.get(names[0]))  # joins the fetch under way
        held.go.set()
        assert await fetch is await later
        assert boards.cached(names[0]) is not None
    finally:
        held.go.set()
        for name in names:
            await store.delete(name)


class Crowded(HeldStore):
    """A HeldStore whose ``moved`` ends with a request queued at the registry gate ``gate``: the
    permit it frees goes to that request, and none is free for what comes next."""

    gate: Gate
    queued: asyncio.Future[None] | None = None

    async def moved(self, since: Any) -> tuple[Any, set[str] | None, set[str]]:
        found = await super().moved(since)
        self.queued = asyncio.ensure_future(self.gate.acquire())
        await asyncio.sleep(0)
        return found


@pytest.mark.cluster
async def test_a_comparison_the_gate_refuses_does_not_discard_the_fetches_under_way(
    store: BoardStore,
) -> None:
    """A move the log cannot name, taken in while every registry permit is busy: the comparison of
    the records kept is skipped (the next look makes it), and fetches under way are left as they
    are. Failed before: the look discarded every fetch under way first and then found no permit,
    so under a busy gate each look discarded them again without comparing anything."""
    names = [board_name("kept"), board_name("fetched")]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    gate = Gate(2, 10, 30.0)
    crowded = Crowded(store.client, store.scripts)
    crowded.gate = gate
    try:
        boards = Boards(crowded, gate, ttl_s=3600.0)
        await boards.follow()
        crowded.holding = True  # not held: a copy kept, for the comparison
        await boards.lookup(names[0])
        crowded.holding = False
        fetch = asyncio.ensure_future(boards.get(names[1]))  # holds a permit until ``go``
        await crowded.read.wait()
        await store.client.set(keys.BOARDS_VERSION, board_name("v"))  # a move without a note
        with pytest.raises(Overloaded):
            await boards.follow()
        assert crowded.queued is not None
        await crowded.queued
        gate.release()
        crowded.go.set()
        await fetch
        assert boards.cached(names[1]) is not None  # the fetch kept what it read
        await boards.follow()  # a permit free: the comparison is made
        assert boards.cached(names[0]) is not None and boards.cached(names[1]) is not None
    finally:
        crowded.go.set()
        for name in names:
            await store.delete(name)


@pytest.mark.cluster
async def test_a_change_the_log_names_after_a_gap_is_seen_while_the_comparison_waits(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move the log cannot name (a gap) owes a comparison of the records kept, which waits its
    turn (``RECHECK_S_PER_BOARD`` per board compared: 5 s at 10,000 boards kept). Meanwhile the
    moves the log does name after the gap expire their boards' copies at the next look. Failed
    before: a worker whose comparison was waiting took nothing in, so a shard marked lost by the
    archiver right after a process of the release before changed any record was seen only when the
    comparison came (here never: it waits an hour a board)."""
    names = [board_name("gap") for _ in range(2)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4), ttl_s=3600.0)
        await boards.follow()
        for name in names:
            await boards.lookup(name)
        monkeypatch.setattr("router.boards.RECHECK_S_PER_BOARD", 3600.0)
        await store.client.set(keys.BOARDS_VERSION, board_name("v"))  # a gap
        await boards.follow()  # compares the two kept (nothing changed), the next in 2 hours
        assert all(boards.cached(n) is not None for n in names)
        await store.client.set(keys.BOARDS_VERSION, board_name("v"))  # another gap: its turn waits
        await boards.follow()
        await marked(store, names[0], store.swap)  # named by the log
        await boards.follow()
        assert boards.cached(names[0]) is None
        assert boards.cached(names[1]) is not None
        assert (await boards.lookup(names[0])).rebuilding == {0}
    finally:
        for name in names:
            await store.delete(name)


@pytest.mark.cluster
async def test_a_comparison_reads_only_the_records_that_changed(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move the change log cannot name (a gap) makes every worker compare the copies it keeps
    with the registry: it reads the registry's digests of them (registry.lua writes a record's with
    it) and fetches the records whose digest differs from its copy's only: one changed through
    registry.lua, one changed by a process of the release before the log (an HSET and a move of
    the version, no note and no digest), and, after more moves than the log keeps, the one they
    changed. Failed before: each comparison read every record kept (an HMGET of each, about 1 MB
    a worker at 2,000 boards, and every worker of every router read it for the same move)."""
    names = [board_name("digested") for _ in range(4)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4), ttl_s=3600.0)
        await boards.follow()
        for name in names:
            await boards.lookup(name)
        await boards.follow()

        await marked_unnoted(store, names[0])
        await marked(store, names[1], store.swap)
        read = records_read(store, monkeypatch)
        await boards.follow()
        assert sorted(read) == sorted(names[:2])
        assert boards.cached(names[0]) is None and boards.cached(names[1]) is None
        assert all(boards.cached(n) is not None for n in names[2:])
        assert (await boards.lookup(names[0])).rebuilding == {0}
        assert (await boards.lookup(names[1])).rebuilding == {0}
        await boards.follow()

        raw = await store.client.hget(keys.BOARDS, names[2])
        for turn in range(store_module.CHANGES_KEPT + 1):  # a gap: more moves than the log keeps
            record = orjson.loads(raw)
            new = orjson.dumps({**record, "state": {**record["state"], "turn": turn}})
            assert await store.swap(names[2], raw, new)
            raw = new
        read.clear()
        await boards.follow()
        assert read == [names[2]]
        assert boards.cached(names[2]) is None
        assert all(boards.cached(n) is not None for n in (names[0], names[1], names[3]))
    finally:
        monkeypatch.undo()
        for name in names:
            await store.delete(name)


@contextlib.asynccontextmanager
async def registry_primary(store: BoardStore, setting: str, value: Any) -> AsyncIterator[None]:
    """The registry's primary with CONFIG ``setting`` at ``value`` for the block, then as it was."""
    node = store.client.get_node_from_key(keys.BOARDS)
    policy = await store.client.execute_command("CONFIG GET", "maxmemory-policy", target_nodes=node)
    assert "noeviction" in str(policy)  # else a maxmemory under what it holds evicts the registry
    was = await store.client.execute_command("CONFIG GET", setting, target_nodes=node)
    await store.client.execute_command("CONFIG SET", setting, value, target_nodes=node)
    try:
        yield
    finally:
        await store.client.execute_command("CONFIG SET", setting, dict(was)[setting], target_nodes=node)


@pytest.mark.cluster
async def test_boards_are_fetched_while_the_registry_primary_is_out_of_memory(store: BoardStore) -> None:
    """A registry primary out of memory (maxmemory under what it holds) refuses every MULTI, reads
    too; a board's fetch (``BoardStore.get``, the version and the record) is one round trip without
    one, so boards are still read there, and a board that is not there is still not found."""
    name = board_name("oom")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4), ttl_s=3600.0)
        async with registry_primary(store, "maxmemory", 1):
            assert (await boards.lookup(name)).config.id == name
            with pytest.raises(BoardNotFound):
                await boards.lookup(board_name("oom"))
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_the_board_list_is_answered_while_the_registry_primary_is_out_of_memory(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """GET /v1/boards reads the registry's version and records; a primary out of memory refuses
    every MULTI, reads too. Failed before: 503 ``out_of_memory`` for as long as the primary was full,
    though nothing is written. Now 200 with the boards, as a board's fetch is."""
    name = board_name("oom")
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        async with running(cluster.url) as (_, client), registry_primary(store, "maxmemory", 1):
            answer = await client.get("/v1/boards")
            assert answer.status_code == 200, answer.text
            assert name in {b["board"] for b in answer.json()["boards"]}
    finally:
        await store.delete(name)


@pytest.mark.cluster
async def test_the_follow_loop_follows_while_the_registry_primary_is_out_of_memory(store: BoardStore) -> None:
    """A registry primary out of memory takes the removal of a record (registry.lua's, as a delete's
    last step: it frees memory) and refuses every MULTI, reads too. Failed before: the loop's looks
    (``BoardStore.moved``, a MULTI) failed, so a board removed there was served from its copy until
    it expired (an hour here), and so was a record changed just before by a process that notes no
    move. Now the loop takes both in within a few looks: the removal the log names, and the change
    it cannot name through the comparison (digests.lua, which writes, is refused there: every record
    kept is read)."""
    names = [board_name("oom") for _ in range(3)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    removed = await store.client.hget(keys.BOARDS, names[0])
    boards = Boards(store, Gate(4), ttl_s=3600.0)
    loop: asyncio.Task[None] | None = None
    try:
        await boards.follow()
        for name in names:
            await boards.lookup(name)
        await boards.follow()

        await marked_unnoted(store, names[1])
        async with registry_primary(store, "maxmemory", 1):
            assert await store.swap(names[0], removed, b"")
            loop = asyncio.create_task(boards.run())
            deadline = asyncio.get_running_loop().time() + 20 * boards.follow_s
            while boards.cached(names[0]) is not None or boards.cached(names[1]) is not None:
                assert asyncio.get_running_loop().time() < deadline, "the loop did not follow"
                await asyncio.sleep(0.02)
            assert boards.cached(names[2]) is not None
            with pytest.raises(BoardNotFound):
                await boards.lookup(names[0])
            assert (await boards.lookup(names[1])).rebuilding == {0}
    finally:
        boards.closed = True
        if loop is not None:
            await loop
        if not await store.client.hexists(keys.BOARDS, names[0]):
            await store.swap(names[0], b"", removed)  # back, so that its delete drops its keys
        for name in names:
            await store.delete(name)


@pytest.mark.cluster
async def test_a_comparison_whose_digests_cannot_be_made_whole_reads_every_record(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the digests are not whole (a process that writes none moved the version) and the
    registry's primary refuses to make them again (digests.lua writes; here a primary short of the
    replicas ``min-replicas-to-write`` asks refuses every write, and reads go on), the comparison
    reads every record kept, as before the digests, and still finds the one changed. (Until a
    review on 2026-12-06 this test stood a refusal raised by a stand-in for the script; a primary
    out of memory for real is
    ``test_a_registry_primary_out_of_memory_changes_no_record_without_its_digest``'s.)"""
    names = [board_name("undigested") for _ in range(2)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4), ttl_s=3600.0)
        await boards.follow()
        for name in names:
            await boards.lookup(name)
        await boards.follow()

        await marked_unnoted(store, names[0])
        read = records_read(store, monkeypatch)
        async with registry_primary(store, "min-replicas-to-write", 2):  # it has one
            await boards.follow()
            assert await store.client.hget(keys.BOARDS_DIGESTS, "") != await store.version()
        assert sorted(read) == sorted(names)
        assert boards.cached(names[0]) is None and boards.cached(names[1]) is not None
    finally:
        monkeypatch.undo()
        for name in names:
            await store.delete(name)


@pytest.mark.cluster
async def test_a_registry_primary_out_of_memory_changes_no_record_without_its_digest(
    store: BoardStore,
) -> None:
    """A registry primary out of memory for real (maxmemory under what it holds, no eviction):
    registry.lua's change of a record is refused whole (neither the record nor its digest nor the
    version written); the removal of a record, which frees memory, is made whole (the record, its
    digest, the version and the field '' with it). A router's look meanwhile reads there (no MULTI,
    which such a primary refuses, reads too: until 2026-12-06 it failed, and the copies were served
    as kept up to their expiry) and takes the removal in; the copy of the record whose change was
    refused is kept."""
    names = [board_name("oom") for _ in range(2)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {}))
    try:
        boards = Boards(store, Gate(4), ttl_s=3600.0)
        await boards.follow()
        for name in names:
            await boards.lookup(name)
        await boards.follow()
        await store.digests(names)  # whole from here on (digests.lua), whatever wrote before
        kept = await store.client.hget(keys.BOARDS, names[0])
        gone = await store.client.hget(keys.BOARDS, names[1])
        deleting = orjson.dumps({**orjson.loads(gone), "state": "deleting"})
        assert await store.swap(names[1], gone, deleting)  # as a delete marks it, before dropping
        await boards.follow()
        version = await store.version()
        async with registry_primary(store, "maxmemory", 1):
            with pytest.raises(OutOfMemoryError):
                await marked(store, names[0], store.swap)
            assert await store.client.hget(keys.BOARDS, names[0]) == kept
            assert await store.client.hget(keys.BOARDS_DIGESTS, names[0]) == store_module.digest(kept)
            assert await store.version() == version
            assert await store.swap(names[1], deleting, b"")  # a delete's last step
            assert not await store.client.hexists(keys.BOARDS_DIGESTS, names[1])
            assert await store.client.hget(keys.BOARDS_DIGESTS, "") == await store.version() != version
            await boards.follow()
            assert boards.cached(names[0]) is not None
            with pytest.raises(BoardNotFound):
                await boards.lookup(names[1])
        await boards.follow()
        assert boards.cached(names[0]) is not None
    finally:
        with contextlib.suppress(BoardNotFound):
            for name in names:
                await store.delete(name)


@pytest.mark.cluster
async def test_boards_deleted_leave_nothing_kept_of_them(store: BoardStore) -> None:
    """Boards created, fetched and deleted one after another (through this router, and by another
    process, found gone by a fetch): what the worker keeps of each goes with its copy. Failed
    before: ``_fetched`` kept an entry for every id ever fetched, cleared only once 10,000 copies
    were kept at once, which boards deleted as they go never reach (a router's memory growing with
    every board id it ever served)."""
    boards = Boards(store, Gate(4), ttl_s=3600.0)
    for n in range(20):
        name = board_name(f"churn-{n}")
        await boards.create(BoardConfig.from_dict(name, {}))
        await boards.get(name)
        if n % 2:
            await boards.delete(name)
        else:
            await store.delete(name)  # through another process
            boards._kept[name] = (boards._kept[name][0] - boards.ttl_s, boards._kept[name][1])
            with pytest.raises(BoardNotFound):
                await boards.get(name)
    assert not boards._kept
    assert not boards._fetched
