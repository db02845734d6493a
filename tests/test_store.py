"""The board registry: incarnations, deletion and re-creation seen from two processes (issue 9, item 2).

Each BoardStore keeps its own cache of boards, as each router process does, so a second store on
the same cluster plays a second process that still holds a board another one deleted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from shardlb import keys, times
from shardlb import store as store_module
from shardlb.board import Board, Score
from shardlb.config import AUTO_SHARDS, BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import BoardConflict, BoardNotFound
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.test_board_retries import FailOnce
from tests.test_router_boards import registry_primary

pytestmark = pytest.mark.cluster


async def keys_of(store: BoardStore, board_id: str) -> dict[str, int]:
    """Every key of ``board_id`` on the cluster, with its remaining time to live in ms (-1: none)."""
    found = [k async for k in store.client.scan_iter(match=f"lb:*:{board_id}:*", count=1000)]
    return {k: await store.client.pttl(k) for k in found}


async def test_a_conflicting_create_names_each_setting_that_differs(store: BoardStore) -> None:
    """A PUT of other settings is 409 board_conflict; its message said only "exists with other
    settings", and a game backend sending README's `arena` again with one period less (or the
    library's 16 shards where the API made one per master) had to diff the settings itself."""
    name = "conflict-named"
    made = {"periods": ["daily", "weekly"], "sharding": {"strategy": "hash", "shards": 3}}
    await store.create(BoardConfig.from_dict(name, made))
    try:
        asked = {"mode": "incr", "periods": ["daily"], "sharding": {"strategy": "hash", "shards": 16}}
        with pytest.raises(BoardConflict) as conflict:
            await store.create(BoardConfig.from_dict(name, asked))
        assert conflict.value.field == "board"
        assert conflict.value.message == (
            'board \'conflict-named\' exists with other settings: mode is "best", not "incr"; '
            'periods is ["total","daily","weekly"], not ["total","daily"]; '
            'retention_days is {"daily":3,"weekly":35}, not {"daily":3}; '
            'sharding is {"strategy":"hash","shards":3}, not {"strategy":"hash","shards":16}'
        )
        # Settings that name no shard count confirm the board (api.md): no conflict to name.
        unsized = BoardConfig.from_dict(name, {"periods": ["daily", "weekly"]}, default_shards=AUTO_SHARDS)
        again, created = await store.create(unsized)
        assert not created and again.config.sharding.shards == 3
    finally:
        await store.delete(name)


async def test_a_conflicting_create_of_a_resharded_board_names_no_sharding_its_creation_had(
    store: BoardStore,
) -> None:
    """A resharded board is confirmed by the settings it was created with as by those of now
    (its sharding of creation, kept in its record): a PUT of its creation's sharding with one
    period less differs in the periods alone. The 409's message named the sharding too (the
    layout of now against the creation's), as if the count were to change."""
    name = "conflict-resharded"
    made = {"durability": "memory", "periods": ["daily"], "sharding": {"strategy": "hash", "shards": 2}}
    await store.create(BoardConfig.from_dict(name, made))
    try:
        mover = Resharder(store, name, say=lambda _: None, cache_s=0)
        await mover.start(3)
        await mover.run()
        assert (await store.get(name)).config.sharding.shards == 3
        _, created = await store.create(BoardConfig.from_dict(name, made))  # the creation's settings
        assert not created
        with pytest.raises(BoardConflict) as conflict:
            await store.create(BoardConfig.from_dict(name, {**made, "periods": []}))
        assert conflict.value.message == (
            "board 'conflict-resharded' exists with other settings: "
            'periods is ["total","daily"], not ["total"]; retention_days is {"daily":3}, not {}'
        )
    finally:
        await store.delete(name)


@pytest.mark.parametrize("strategy", ["hash", "band"])
async def test_a_board_deleted_elsewhere_takes_no_writes_and_comes_back_empty(
    store: BoardStore, strategy: str
) -> None:
    name = f"reborn-{strategy}"
    sharding = (
        {"strategy": "hash", "shards": 4} if strategy == "hash" else {"strategy": "band", "bands": [0, 100]}
    )
    config = BoardConfig.from_dict(name, {"mode": "incr", "periods": ["daily"], "sharding": sharding})
    other = BoardStore(store.client, store.scripts)  # a second router process and its cache
    now = times.now_ms()
    await store.create(config)
    stale = await other.get(name)
    await stale.submit([Score("before", 10, "m0", now)], now_ms=now)
    await store.delete(name)

    late = [Score(f"p{i}", 5 + i, f"late-{i}", now) for i in range(40)]
    with pytest.raises(BoardNotFound):
        await stale.submit(late, now_ms=now)
    left = await keys_of(store, name)
    assert all(ttl > 0 for ttl in left.values()), left  # only markers that expire stay behind

    board, created = await store.create(config)
    try:
        assert created
        assert await board.top(100) == []
        assert await board.size() == 0
        await board.submit([Score("p1", 7, "late-1", now)], now_ms=now)  # a new board: not a duplicate
        assert [(e.player_id, e.points) for e in await board.top(10)] == [("p1", 7)]
        with pytest.raises(BoardNotFound):
            await stale.submit(late, now_ms=now)  # the old incarnation stays dead beside the new one
        assert [(e.player_id, e.points) for e in await board.top(10)] == [("p1", 7)]
    finally:
        await store.delete(name)
    assert all(ttl > 0 for ttl in (await keys_of(store, name)).values())


async def test_deleting_twice_and_deleting_a_missing_board(store: BoardStore) -> None:
    config = BoardConfig.from_dict("deleted-twice", {})
    await store.create(config)
    await store.delete(config.id)
    with pytest.raises(BoardNotFound):
        await store.delete(config.id)
    with pytest.raises(BoardNotFound):
        await store.get(config.id)


async def test_a_delete_that_stopped_half_way_is_finished(store: BoardStore) -> None:
    """The process deleting a board dies after marking it and dropping some shards: the board reads
    as missing at once, and reclaim (run by every router at start-up) finishes the job."""
    config = BoardConfig.from_dict("half-deleted", {"sharding": {"strategy": "hash", "shards": 8}})
    board, _ = await store.create(config)
    now = times.now_ms()
    await board.submit([Score(f"p{i}", i, "m", now) for i in range(50)], now_ms=now)
    crashing = BoardStore(store.client, dataclasses.replace(store.scripts, drop=FailOnce(store.scripts.drop)))
    with pytest.raises(ConnectionError):
        await crashing.delete(config.id)
    with pytest.raises(BoardNotFound):
        await store.get(config.id)
    assert config.id not in [c.id for c in await store.list()]
    assert any(ttl == -1 for ttl in (await keys_of(store, config.id)).values())  # data still there
    assert await store.reclaim() == 1
    assert all(ttl > 0 for ttl in (await keys_of(store, config.id)).values())
    assert await store.reclaim() == 0
    again, created = await store.create(config)
    assert created and await again.size() == 0
    await store.delete(config.id)


class SentTwice:
    """A script whose first call runs and loses its reply, so that it is sent again, as redis-py's
    cluster client does after a broken connection or a timeout (its retries): both calls run on the
    real cluster, and the caller hears the second's reply."""

    def __init__(self, script: Callable[..., Awaitable[Any]]) -> None:
        self.script = script
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            await self.script(*args, **kwargs)  # ran; its reply lost
        return await self.script(*args, **kwargs)


async def test_a_creation_whose_record_call_is_sent_again_after_its_reply_was_lost_keeps_the_board(
    store: BoardStore,
) -> None:
    """registry.lua's creation of the record ran, its reply was lost, and the client sent it again
    (at least once): the second call finds the record there (this creation's) and answers 0. Failed
    before: the creation took that 0 for a race lost to another creator and took back its sentinels,
    those of the record it had written, then found the board and answered it confirmed (a PUT's 200,
    not 201); the board was left without its sentinels, refused writes, and counted as lost. Now a
    record that names the creation's incarnation is its own: created, its sentinels kept."""
    config = BoardConfig.from_dict("made-twice", {"sharding": {"strategy": "hash", "shards": 2}})
    retried = BoardStore(
        store.client, dataclasses.replace(store.scripts, registry=SentTwice(store.scripts.registry))
    )
    try:
        board, created = await retried.create(config)
        assert created
        assert sorted(await keys_of(store, config.id)) == sorted(keys.sentinel_key(p) for p in board.prefixes)
        now = times.now_ms()
        await board.submit([Score("p1", 5, "m1", now)], now_ms=now)
        assert (await board.player("p1")).entry.points == 5
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)


async def test_a_board_with_more_shards_than_connections_per_node_is_deleted(cluster_url: str) -> None:
    """Dropping every shard at once ran out of the client's connections to a node (64, `connect`)
    on a board of a few hundred shards, and the delete failed every time."""
    client = connect(cluster_url)  # its own: the session store's pool stays as small as it was
    scripts = Scripts.register(client)
    await scripts.load(client)
    store = BoardStore(client, scripts)
    try:
        config = BoardConfig.from_dict("store-wide", {"sharding": {"strategy": "hash", "shards": 256}})
        board, _ = await store.create(config)
        await board.submit([Score(f"p{i}", i, "m1") for i in range(300)])
        await store.delete(config.id)
        with pytest.raises(BoardNotFound):
            await store.get(config.id)
    finally:
        await client.aclose()


async def indexed(store: BoardStore, board_id: str) -> bool:
    return bool(await store.client.sismember(keys.RESHARDS, board_id))


async def registry_reads(store: BoardStore) -> int:
    """HGETALL calls the cluster's primaries have run (INFO commandstats)."""
    stats = await store.client.info("commandstats", target_nodes=store.client.PRIMARIES)
    return sum(int(node.get("cmdstat_hgetall", {}).get("calls", 0)) for node in stats.values())


async def test_the_index_of_reshards_follows_every_write_of_the_registry(store: BoardStore) -> None:
    """The routers' watch (router/reshards.py) read the whole registry (1.1 MB at 2,000 boards)
    every 5 s in every worker to find the few boards under reshard. registry.lua, the one writer
    of records that name a reshard, keeps their ids in an index beside it, in the same call."""
    config = BoardConfig.from_dict("indexed", {"mode": "incr", "durability": "memory"})
    await store.create(config)
    try:
        assert not await indexed(store, config.id)
        mover = Resharder(store, config.id, say=lambda _: None, cache_s=0)
        await mover.start(2)
        assert await indexed(store, config.id)
        await mover.cancel()
        assert not await indexed(store, config.id)
        await mover.start(3)
        assert await indexed(store, config.id)
        assert [b.config.id for b in await store.resharding() if b.config.id == config.id] == [config.id]
        assert (await Resharder(store, config.id, say=lambda _: None, cache_s=0).run())["state"] == "none"
        assert not await indexed(store, config.id)
        await mover.start(4)
        assert await indexed(store, config.id)
    finally:
        await store.delete(config.id)
    assert not await indexed(store, config.id)  # deleted with its reshard under way


async def test_a_look_at_the_reshards_reads_only_their_records(store: BoardStore) -> None:
    """``resharding`` read the whole registry; it reads the index and the records it names, and
    the whole registry only when asked (``whole``)."""
    config = BoardConfig.from_dict("looked-at", {"mode": "incr", "durability": "memory"})
    await store.create(config)
    try:
        await Resharder(store, config.id, say=lambda _: None).start(2)
        before = await registry_reads(store)
        for _ in range(3):
            assert config.id in [b.config.id for b in await store.resharding()]
        assert await registry_reads(store) == before
        assert config.id in [b.config.id for b in await store.resharding(whole=True)]
        assert await registry_reads(store) == before + 1
    finally:
        await store.delete(config.id)


async def test_a_whole_look_finds_the_reshards_the_index_lacks_and_mends_it(store: BoardStore) -> None:
    """A router or CLI of the release before writes records without the index: a reshard it
    records is missing from it, and one it ends (finished, cancelled, the board deleted) stays
    listed. A whole look finds the first and lists it, and drops the second, as the records are at
    that moment (one script call); a look at the index drops what it finds listed without a reshard."""
    started = BoardConfig.from_dict("old-started", {"mode": "incr", "durability": "memory"})
    ended = BoardConfig.from_dict("old-ended", {"mode": "incr", "durability": "memory"})
    for config in (started, ended):
        await store.create(config)
    try:
        await Resharder(store, started.id, say=lambda _: None).start(2)
        await store.client.srem(keys.RESHARDS, started.id)  # as the release before records it
        await store.client.sadd(keys.RESHARDS, ended.id)  # its reshard ended by the release before
        assert started.id not in [b.config.id for b in await store.resharding()]
        assert not await indexed(store, ended.id)  # a look at the index drops what has no reshard
        await store.client.sadd(keys.RESHARDS, ended.id)
        found = [b.config.id for b in await store.resharding(whole=True)]
        assert started.id in found and ended.id not in found
        assert await indexed(store, started.id) and not await indexed(store, ended.id)
        assert started.id in [b.config.id for b in await store.resharding()]
    finally:
        for config in (started, ended):
            await store.delete(config.id)


class MadeStore(BoardStore):
    """A board store that counts the boards it makes (``layout``), by id."""

    def __init__(self, store: BoardStore) -> None:
        super().__init__(store.client, store.scripts)
        self.made: list[str] = []

    def layout(self, config: BoardConfig, incarnation: str, generation: int) -> Board:
        self.made.append(config.id)
        return super().layout(config, incarnation, generation)


async def test_boards_makes_again_only_the_boards_whose_record_changed(store: BoardStore) -> None:
    """The archiver lists the registry's boards every 2 s (``Archiver.refresh``): making a Board of
    every record took 170-200 ms at 2,000 boards. With ``reuse``, a record whose bytes are those of
    the last listing gives the Board made then, unless that Board learnt it is deleted or moved."""
    ids = ["kept-a", "kept-b", "kept-c"]
    for board_id in ids:
        await store.create(BoardConfig.from_dict(board_id, {"mode": "incr", "durability": "memory"}))
    counted = MadeStore(store)
    try:
        first = {b.config.id: b for b in await counted.boards(reuse=True) if b.config.id in ids}
        assert sorted(first) == ids
        counted.made.clear()
        again = {b.config.id: b for b in await counted.boards(reuse=True) if b.config.id in ids}
        assert [i for i in counted.made if i in ids] == []
        assert all(again[i] is first[i] for i in ids)
        await Resharder(store, "kept-a", say=lambda _: None).start(2)  # its record changes
        first["kept-b"].deleted = True  # as a script's answer tells a holder
        await store.delete("kept-c")
        now = {b.config.id: b for b in await counted.boards(reuse=True) if b.config.id in ids}
        # kept-a: both its layouts
        assert sorted(i for i in counted.made if i in ids) == ["kept-a", "kept-a", "kept-b"]
        assert now["kept-a"].also and now["kept-a"] is not first["kept-a"]
        assert now["kept-b"] is not first["kept-b"] and not now["kept-b"].deleted
        assert "kept-c" not in now
    finally:
        with contextlib.suppress(BoardConflict):  # none recorded, if the test stopped before
            await Resharder(store, "kept-a", say=lambda _: None).cancel()
        for board_id in ids[:2]:
            await store.delete(board_id)


async def test_every_change_of_the_registry_moves_its_version(store: BoardStore) -> None:
    """``follow`` reads the registry again only when its version moved: every writer of a record
    (a creation, a restore, a reshard's steps, a deletion's mark and removal) moves it in the same
    registry.lua call; a confirmation of a board that exists, and a whole look's mending of the
    index, change no record and leave it."""
    config = BoardConfig.from_dict("versioned", {"mode": "incr", "durability": "memory"})

    async def version() -> Any:
        return await store.client.get(keys.BOARDS_VERSION)

    seen = [await version()]

    async def moved() -> bool:
        seen.append(await version())
        return seen[-1] != seen[-2]

    try:
        board, _ = await store.create(config)
        assert await moved()
        await store.create(config)  # confirmed
        assert not await moved()
        await Resharder(store, config.id, say=lambda _: None, cache_s=0).start(2)
        assert await moved()
        await store.client.sadd(keys.RESHARDS, "versioned-none")  # mended by a whole look
        await store.resharding(whole=True)
        assert not await moved() and not await indexed(store, "versioned-none")
        await store.delete(config.id)
        assert await moved()
        _, registered = await store.restore(config, board.incarnation)
        assert registered and await moved()
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)


async def test_a_change_a_failover_lost_after_a_whole_read_is_not_held(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``follow`` read the version (a GET) and then the registry (an HGETALL), two calls: a
    creation made between the two was in the listing, held with the version from before it. A
    failover that then lost the creation (the promoted replica has the record and the version as
    they were before it: one registry.lua call on one slot) set the version back to the one held,
    and the board lost was listed until the next whole read, a minute later. The version a
    listing is held with is read with it, in one MULTI."""
    config = BoardConfig.from_dict("followed-lost", {"durability": "memory"})
    follower = BoardStore(store.client, store.scripts)  # a reader of its own: nothing held yet
    client = store.client
    get = client.get
    before: list[Any] = []

    async def get_then_create(name: Any, *args: Any, **kwargs: Any) -> Any:
        got = await get(name, *args, **kwargs)
        if name == keys.BOARDS_VERSION and not before:
            before.append(got)
            await store.create(config)  # a creation between the GET and the registry's read
        return got

    try:
        monkeypatch.setattr(client, "get", get_then_create)
        assert config.id in [b.config.id for b in await follower.follow()]
        monkeypatch.undo()
        # The failover: the promoted replica holds neither the record nor the version's move.
        await client.hdel(keys.BOARDS, config.id)
        if before[0] is None:
            await client.delete(keys.BOARDS_VERSION)
        else:
            await client.set(keys.BOARDS_VERSION, before[0])
        assert config.id not in [b.config.id for b in await follower.follow()]
    finally:
        monkeypatch.undo()
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)


async def test_the_digests_are_the_records_even_after_a_writer_that_writes_none(store: BoardStore) -> None:
    """registry.lua writes each record's digest (``store.digest``) with it, and the version through
    which every digest is whole (field ''), which ``digests`` then reads as they are. A process of
    the release before the digests (it moves the version without writing one) breaks that chain,
    and a change through registry.lua after it does not mend it: ``digests`` makes every digest
    again from its record (digests.lua), a removed record's taken out."""
    names = ["digest-a", "digest-b", "digest-c"]

    async def records() -> list[Any]:
        return list(await store.client.hmget(keys.BOARDS, names))

    async def whole() -> Any:
        return await store.client.hget(keys.BOARDS_DIGESTS, "")

    try:
        for name in names:
            await store.create(BoardConfig.from_dict(name, {"durability": "memory"}))
        await store.digests([])  # whole from here on, whatever wrote the registry before this test
        assert await store.digests(names) == [store_module.digest(r) for r in await records()]
        raw = await store.client.hget(keys.BOARDS, names[0])
        marked = orjson.dumps({**orjson.loads(raw), "state": {"rebuilding": [0]}})
        assert await store.swap(names[0], raw, marked)
        assert await whole() == await store.version()
        assert await store.digests(names) == [store_module.digest(r) for r in await records()]
        # A process of the release before: a record changed and another removed, no digest written.
        await store.client.hset(keys.BOARDS, names[1], marked.replace(b"rebuilding", b"other"))
        removed = await store.client.hget(keys.BOARDS, names[2])
        await store.client.hdel(keys.BOARDS, names[2])
        await store.client.set(keys.BOARDS_VERSION, "moved-by-an-older-process")
        raw = await store.client.hget(keys.BOARDS, names[0])
        assert await store.swap(names[0], raw, orjson.dumps({**orjson.loads(raw), "state": {}}))
        assert await whole() != await store.version()  # the chain stays broken
        now = await records()
        assert now[2] is None
        assert await store.digests(names) == [store_module.digest(now[0]), store_module.digest(now[1]), None]
        assert await whole() == await store.version()
        assert not await store.client.hexists(keys.BOARDS_DIGESTS, names[2])
        await store.delete(names[0])
        assert (await store.digests(names))[0] is None
        await store.client.hset(keys.BOARDS, names[2], removed)  # deleted below, with its shards
    finally:
        for name in names:
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_the_change_log_names_the_boards_changed_between_two_versions(store: BoardStore) -> None:
    """registry.lua notes each move of the version with the board whose record changed
    (keys.BOARDS_CHANGES): ``moved`` names the boards changed since a version, and None when the
    log cannot say (a move without a note, as a process of the release before makes, or a version
    older than the log keeps). The log keeps CHANGES_KEPT moves."""
    names = ["logged-a", "logged-b"]
    try:
        since = await store.version()
        assert (await store.moved(since))[1] == set()
        await store.create(BoardConfig.from_dict(names[0], {"durability": "memory"}))
        await store.create(BoardConfig.from_dict(names[1], {"durability": "memory"}))
        version, changed, _ = await store.moved(since)
        assert changed == set(names) and version == await store.version()
        raw = await store.client.hget(keys.BOARDS, names[0])
        for turn in range(store_module.CHANGES_KEPT + 2):  # more moves than the log keeps
            record = orjson.loads(raw)
            marked = {**record, "state": {**record["state"], "turn": turn}}
            assert await store.swap(names[0], raw, orjson.dumps(marked))
            raw = orjson.dumps(marked)
            if turn == 10:
                recent = await store.version()
        assert await store.client.llen(keys.BOARDS_CHANGES) == store_module.CHANGES_KEPT
        assert (await store.moved(version))[1] is None  # further back than the log keeps
        assert (await store.moved(recent))[1] == {names[0]}
        now = await store.version()
        await store.client.set(keys.BOARDS_VERSION, "moved-by-an-older-process")  # no note
        assert (await store.moved(now))[1:] == (None, set())
        await store.delete(names[1])  # noted, but after a move without a note: still None from `now`
        assert (await store.moved(now))[1:] == (None, {names[1]})  # what the log names past the gap
        after = await store.version()
        await store.delete(names[0])
        assert (await store.moved(after))[1] == {names[0]}
    finally:
        for name in names:
            with contextlib.suppress(BoardNotFound):
                await store.delete(name)


async def test_the_registry_is_read_and_followed_while_its_primary_is_out_of_memory(
    store: BoardStore,
) -> None:
    """A registry primary out of memory refuses every MULTI, reads too, and takes the removal of a
    record (registry.lua's, a delete's last step: it frees memory). Failed before: ``records``,
    ``moved`` and ``digests`` were MULTIs, so the archiver's listing (``follow``) failed for as long
    as the primary was full, and so did a router's look. Now each reads there, and a listing after
    the removal no longer has the board."""
    names = [f"oom-followed-{i}" for i in range(2)]
    for name in names:
        await store.create(BoardConfig.from_dict(name, {"durability": "memory"}))
    removed = await store.client.hget(keys.BOARDS, names[0])
    follower = BoardStore(store.client, store.scripts)
    try:
        assert set(names) <= {b.config.id for b in await follower.follow()}
        await store.digests(names)  # whole from here on (digests.lua), whatever wrote before
        since = await store.version()
        async with registry_primary(store, "maxmemory", 1):
            assert set(names) <= set((await store.records())[1])
            assert await store.swap(names[0], removed, b"")
            version, changed, named = await store.moved(since)
            assert version == await store.version() and changed == named == {names[0]}
            digests = await store.digests(names)
            assert digests == [None, store_module.digest(await store.client.hget(keys.BOARDS, names[1]))]
            listed = {b.config.id for b in await follower.follow()}
            assert names[0] not in listed and names[1] in listed
    finally:
        if not await store.client.hexists(keys.BOARDS, names[0]):
            await store.swap(names[0], b"", removed)  # back, so that its delete drops its keys
        for name in names:
            await store.delete(name)


class Stepwise:
    """A pipeline that sends its commands one at a time, and awaits the first of ``changes`` (taken
    off) after its command number ``at`` (the first by default): another client's change that Redis
    ran between two commands of a round trip, as it may. The commands go to the real cluster."""

    def __init__(self, client: Any, changes: list[Callable[[], Awaitable[Any]]], at: int = 1) -> None:
        self.client, self.changes, self.queued = client, changes, list[tuple[str, tuple[Any, ...]]]()
        self.at = at

    async def __aenter__(self) -> Stepwise:
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    def __getattr__(self, command: str) -> Callable[..., None]:
        return lambda *args: self.queued.append((command, args))

    async def execute(self) -> list[Any]:
        replies = []
        for command, args in self.queued:
            replies.append(await getattr(self.client, command)(*args))
            if len(replies) == self.at and self.changes:
                await self.changes.pop(0)()
        return replies


async def test_a_change_between_the_reads_of_one_round_trip_is_read_again(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``records`` and ``moved`` read the version, the registry (or its log) and the version again in
    one round trip, not a MULTI (a primary out of memory refuses every MULTI); Redis may run another
    client's change between two of those commands. Read again then: a listing is held with the
    version it is exactly, not the one before a change it holds (which a failover could lose, and set
    the version back to: ``test_a_change_a_failover_lost_after_a_whole_read_is_not_held``), and the
    log is chained from the version it begins with, not taken for a gap. A registry that moves
    under every read is held as of no version (``UNSETTLED``)."""
    config = BoardConfig.from_dict("stepwise", {"durability": "memory"})
    since = await store.version()

    async def touch() -> None:
        raw = await store.client.hget(keys.BOARDS, config.id)
        record = orjson.loads(raw)
        state = {**record["state"], "turn": record["state"].get("turn", 0) + 1}
        assert await store.swap(config.id, raw, orjson.dumps({**record, "state": state}))

    changes: list[Callable[[], Awaitable[Any]]] = [lambda: store.create(config)]
    try:
        monkeypatch.setattr(store.client, "pipeline", lambda **_: Stepwise(store.client, changes))
        version, records = await store.records()
        assert config.id in records and version == await store.version()
        changes.append(touch)
        version, changed, named = await store.moved(since)
        assert version == await store.version() and changed == named == {config.id}
        changes.extend([touch] * store_module.SETTLE_TRIES)
        version, records = await store.records()
        assert version is store_module.UNSETTLED and not changes
    finally:
        monkeypatch.undo()
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)


@pytest.mark.parametrize("at", [1, 2])
async def test_a_log_that_moves_under_every_read_is_taken_as_a_gap(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    """``moved`` reads the version, the log and the version again, and reads again while the two
    versions differ, SETTLE_TRIES round trips in all; then it gives up and answers a gap (no boards
    named: the caller compares what it holds, router/boards.py ``follow``), with the version read
    first in its last round trip, so that the caller's next look reads the moves since. A move
    after the log's read (``at`` 2) leaves a log that chains from the first version read: it is not
    taken either, as a move before it (``at`` 1), whose entry breaks the chain, is not."""
    config = BoardConfig.from_dict(f"stepwise-moved-{at}", {"durability": "memory"})
    await store.create(config)

    async def touch() -> None:
        raw = await store.client.hget(keys.BOARDS, config.id)
        record = orjson.loads(raw)
        state = {**record["state"], "turn": record["state"].get("turn", 0) + 1}
        assert await store.swap(config.id, raw, orjson.dumps({**record, "state": state}))

    since = await store.version()
    changes: list[Callable[[], Awaitable[Any]]] = [touch] * store_module.SETTLE_TRIES
    rounds: list[Stepwise] = []

    def pipeline(**_: Any) -> Stepwise:
        rounds.append(Stepwise(store.client, changes, at))
        return rounds[-1]

    try:
        monkeypatch.setattr(store.client, "pipeline", pipeline)
        version, changed, named = await store.moved(since)
        monkeypatch.undo()
        assert changed is None and named == set()
        assert len(rounds) == store_module.SETTLE_TRIES and not changes
        now = await store.version()
        assert version not in (since, now)  # the last move is read at the next look
        # The next look, the registry still, names what the give-up left.
        assert await store.moved(version) == (now, {config.id}, {config.id})
    finally:
        monkeypatch.undo()
        await store.delete(config.id)
