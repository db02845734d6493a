"""The board registry on a cluster out of memory: masters at a real `maxmemory` (noeviction) under
what they hold. A creation refused there leaves nothing behind, and a board is deleted there (a
deletion frees memory: what it writes is bounded)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from redis.exceptions import OutOfMemoryError, ResponseError

from shardlb import keys, times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running
from tests.test_router_boards import registry_primary
from tests.test_store import keys_of

pytestmark = pytest.mark.cluster


@contextlib.asynccontextmanager
async def full_primaries(store: BoardStore) -> AsyncIterator[None]:
    """Every primary of the cluster out of memory (maxmemory 1, noeviction) for the block."""
    client = store.client
    policies = await client.config_get("maxmemory-policy", target_nodes=client.PRIMARIES)
    assert all("noeviction" in str(p) for p in policies.values())  # else they would evict
    await client.config_set("maxmemory", 1, target_nodes=client.PRIMARIES)
    try:
        yield
    finally:
        await client.config_set("maxmemory", 0, target_nodes=client.PRIMARIES)


@pytest.mark.parametrize("shards", [2, 16])
async def test_a_creation_the_registry_refuses_out_of_memory_leaves_nothing(
    store: BoardStore, shards: int
) -> None:
    """The registry's primary out of memory refuses registry.lua's creation of the record (503
    ``out_of_memory`` for a PUT). Failed before: the shards' sentinels, written first on the other
    primaries, stayed, listed nowhere and never expiring, and each retry (a new incarnation) left
    as many again. Now a refused creation leaves no key of the board; the retry once memory is
    freed makes the board as one creation does. Two shards are on the other primaries (of the
    suite's three): every sentinel is written, the record refused. With 16 shards, some sentinels
    are refused too (the registry's primary holds some shards) while others are being written."""
    name = f"oom-made-{shards}"
    config = BoardConfig.from_dict(name, {"sharding": {"strategy": "hash", "shards": shards}})
    registry = store.client.get_node_from_key(keys.BOARDS)
    on_registry = [
        store.client.get_node_from_key(keys.sentinel_key(keys.shard_prefix(name, s, shards))) == registry
        for s in range(shards)
    ]
    assert any(on_registry) == (shards == 16)
    try:
        async with registry_primary(store, "maxmemory", 1):
            for _ in range(2):  # the client's retry, refused as well
                with pytest.raises(OutOfMemoryError):
                    await store.create(config)
                assert await keys_of(store, name) == {}
            assert await store.client.hget(keys.BOARDS, name) is None
        board, created = await store.create(config)
        assert created
        made = await keys_of(store, name)
        assert sorted(made) == sorted(keys.sentinel_key(p) for p in board.prefixes)
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


async def test_a_board_is_deleted_while_every_primary_is_out_of_memory(store: BoardStore) -> None:
    """Operators delete boards to free memory. Failed before: registry.lua's mark ``deleting`` (an
    HSET, which may grow memory) was refused on a registry primary out of memory, and so were the
    deletion's marker and each shard's drop (drop.lua sets the shard's ``gone`` marker first): no
    board could be deleted on a full cluster. Now each runs there (``allow-oom``; each writes a
    bounded amount: a record of the same size, one marker a shard, all expiring), and the board's
    keys are unlinked."""
    sharding = {"strategy": "hash", "shards": 8}
    config = BoardConfig.from_dict("oom-deleted", {"mode": "incr", "sharding": sharding})
    board, _ = await store.create(config)
    now = times.now_ms()
    await board.submit([Score(f"p{i}", i, f"m{i}", now) for i in range(200)], now_ms=now)
    held = await keys_of(store, config.id)
    assert any(ttl == -1 for ttl in held.values())
    deleted: Any = None
    try:
        async with full_primaries(store):
            with pytest.raises(OutOfMemoryError):  # the cluster is full indeed
                await store.client.set(keys.sentinel_key(board.prefixes[0]) + "x", 1)
            deleted = await store.delete(config.id)
            assert deleted == board.incarnation
            with pytest.raises(BoardNotFound):
                await store.get(config.id, deleting=True)
            left = await keys_of(store, config.id)
            assert left and all(ttl > 0 for ttl in left.values()), left  # only the markers, expiring
            assert await store.client.exists(keys.deleted_key(config.id, board.incarnation))
    finally:
        if deleted is None:
            with contextlib.suppress(BoardNotFound):
                await store.delete(config.id)


async def test_a_put_refused_out_of_memory_is_a_503_and_its_retry_one_creation(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """PUT /v1/boards/{board} on a registry primary out of memory: 503 ``out_of_memory`` with
    Retry-After, nothing of the board left; the same PUT once memory is freed is a 201 of one
    board, whose only keys are its shards' sentinels."""
    name = board_name("oom")
    body = {"sharding": {"strategy": "hash", "shards": 2}}
    try:
        async with running(cluster.url) as (_, http):
            async with registry_primary(store, "maxmemory", 1):
                refused = await http.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "out_of_memory"
                assert "registry" in refused.json()["error"]["message"]  # not only a board's shards
                assert int(refused.headers["retry-after"]) >= 1
                assert await keys_of(store, name) == {}
            made = await http.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
            assert made.status_code == 201, made.text
            board = await store.get(name)
            assert sorted(await keys_of(store, name)) == sorted(keys.sentinel_key(p) for p in board.prefixes)
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


async def test_a_delete_is_answered_204_while_every_primary_is_out_of_memory(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """DELETE /v1/boards/{board} on a cluster whose every primary is out of memory: a 204, the
    board gone (failed before: 503 ``out_of_memory``, its mark ``deleting`` refused), while a write
    to another board is still refused there."""
    name, other = board_name("oom"), board_name("oom")
    deleted = False
    try:
        async with running(cluster.url) as (_, http):
            for board in (name, other):
                made = await http.put(f"/v1/boards/{board}", json={"mode": "incr"}, headers=AS_ADMIN)
                assert made.status_code == 201, made.text
            scores = {"scores": [{"player_id": f"p{i}", "points": i, "match_id": f"m{i}"} for i in range(50)]}
            written = await http.post(f"/v1/boards/{name}/scores", json=scores, headers=AS_WRITER)
            assert written.status_code == 200, written.text
            async with full_primaries(store):
                refused = await http.post(f"/v1/boards/{other}/scores", json=scores, headers=AS_WRITER)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "out_of_memory"
                answer = await http.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
                assert answer.status_code == 204, answer.text
                deleted = True
                assert (await http.get(f"/v1/boards/{name}")).status_code == 404
            assert all(ttl > 0 for ttl in (await keys_of(store, name)).values())
    finally:
        for board in (other,) if deleted else (name, other):
            with contextlib.suppress(BoardNotFound):
                await store.delete(board)


async def test_a_freeing_call_of_the_registry_only_removes_or_marks_deleting(store: BoardStore) -> None:
    """registry.lua loaded with allow-oom (``swap``'s ``freeing``) runs on a primary out of memory:
    it takes a removal of a record or its mark "deleting" only (the record 32 bytes longer at most),
    so what it writes there stays bounded; a creation or any other change through it is an error,
    and writes nothing."""
    name = board_name("oom")
    version = await store.version()
    with pytest.raises(ResponseError, match="freeing call"):
        await store.swap(name, b"", b'{"mode": "best"}', freeing=True)
    assert await store.client.hget(keys.BOARDS, name) is None and await store.version() == version
    await store.create(BoardConfig.from_dict(name, {}))
    try:
        raw = await store.client.hget(keys.BOARDS, name)
        record = orjson.loads(raw)
        grown = orjson.dumps({**record, "state": {"sentinels": 0, "pad": "x" * 1000}})
        padded = orjson.dumps({**record, "pad": "x" * 1000, "state": "deleting"})  # marked, but grown
        for new in (grown, padded):
            with pytest.raises(ResponseError, match="freeing call"):
                await store.swap(name, raw, new, freeing=True)
        assert await store.client.hget(keys.BOARDS, name) == raw
        assert await store.swap(name, raw, orjson.dumps({**record, "state": "deleting"}), freeing=True)
        # The index's mending (ARGV[1] '', then board ids) is not a freeing call, whatever its ids.
        registry = [keys.BOARDS, keys.RESHARDS, keys.BOARDS_VERSION, keys.BOARDS_CHANGES, keys.BOARDS_DIGESTS]
        mended = ["", *(board_name("none") for _ in range(4)), "freeing", name]
        assert await store.scripts.registry(keys=registry, args=mended) == 1
    finally:
        await store.delete(name)
