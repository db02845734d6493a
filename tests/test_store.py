"""The board registry: incarnations, deletion and re-creation seen from two processes (issue 9, item 2).

Each BoardStore keeps its own cache of boards, as each router process does, so a second store on
the same cluster plays a second process that still holds a board another one deleted.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardlb import times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import BoardNotFound
from shardlb.store import BoardStore
from tests.test_board_retries import FailOnce

pytestmark = pytest.mark.cluster


async def keys_of(store: BoardStore, board_id: str) -> dict[str, int]:
    """Every key of ``board_id`` on the cluster, with its remaining time to live in ms (-1: none)."""
    found = [k async for k in store.client.scan_iter(match=f"lb:*:{board_id}:*", count=1000)]
    return {k: await store.client.pttl(k) for k in found}


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
