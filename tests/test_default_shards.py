"""Boards whose settings name no shard count get one shard per master (issue 13: "a default shard count
that matches the cluster"), on the suite's cluster of 3 masters: through the library (AUTO_SHARDS in
``BoardConfig.from_dict``, resolved by ``BoardStore.create``) and through ``PUT /v1/boards``. A PUT
that names no shard count confirms an existing board of any shard count, so a client that PUTs its
settings at every start keeps working against boards made with another count."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from shardlb.cluster import LocalCluster
from shardlb.config import AUTO_SHARDS, DEFAULT_SHARDS, MAX_SHARDS, BoardConfig, resolve_shards
from shardlb.connection import primary_name
from shardlb.errors import BoardConflict
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = pytest.mark.cluster


def auto(board_id: str, body: dict[str, Any]) -> BoardConfig:
    return BoardConfig.from_dict(board_id, body, default_shards=AUTO_SHARDS)


def test_settings_without_a_shard_count() -> None:
    # The library's default stays DEFAULT_SHARDS; the API's is AUTO_SHARDS, until a store resolves it.
    assert BoardConfig.from_dict("b", {}).sharding.shards == DEFAULT_SHARDS
    assert auto("b", {}).sharding.shards == AUTO_SHARDS
    assert auto("b", {"sharding": {"strategy": "hash"}}).sharding.shards == AUTO_SHARDS
    assert auto("b", {"sharding": {"strategy": "band", "bands": [0, 10]}}).sharding.shards == AUTO_SHARDS
    assert auto("b", {"sharding": {"strategy": "hash", "shards": 5}}).sharding.shards == 5
    region = auto("b", {"sharding": {"strategy": "region", "regions": ["eu", "na"]}})
    assert region.sharding.shards == 8 and resolve_shards(region, 3) == region  # 4 per region, as before

    assert resolve_shards(auto("b", {}), 3).sharding.shards == 3
    assert resolve_shards(auto("b", {}), 0).sharding.shards == 1
    assert resolve_shards(auto("b", {}), 5000).sharding.shards == MAX_SHARDS
    bands = list(range(0, 2560, 10))  # 256 bands: the home shards are what is left of MAX_SHARDS
    banded = auto("b", {"sharding": {"strategy": "band", "bands": bands}})
    assert resolve_shards(banded, 5000).sharding.shards == MAX_SHARDS - len(bands)
    # An existing board of the same strategy lends its count; one of another strategy does not.
    sixteen = BoardConfig.from_dict("b", {})
    assert resolve_shards(auto("b", {}), 3, sixteen).sharding.shards == 16
    assert resolve_shards(banded, 3, sixteen).sharding.shards == 3
    explicit = auto("b", {"sharding": {"strategy": "hash", "shards": 5}})
    assert resolve_shards(explicit, 3, sixteen) == explicit


async def test_the_store_gives_one_shard_per_master(store: BoardStore, cluster: LocalCluster) -> None:
    masters = cluster.masters
    assert await store.masters() == masters

    name = board_name("auto")
    board, created = await store.create(auto(name, {"durability": "memory"}))
    assert created and board.config.sharding.shards == masters
    # Shard i of N sits in the i-th N-th of the slots, and `cluster up` gives each master an equal
    # range: one shard on each master.
    assert len({primary_name(store.client, prefix) for prefix in board.prefixes}) == masters
    again, created = await store.create(auto(name, {"durability": "memory"}))
    assert not created and again.config == board.config

    banded = board_name("auto-band")
    board, created = await store.create(
        auto(banded, {"durability": "memory", "sharding": {"strategy": "band", "bands": [0, 100, 1000]}})
    )
    assert (
        created and board.config.sharding.shards == masters and board.config.sharding.bands == (0, 100, 1000)
    )

    # A board made with a count: settings without one confirm it; another count, or another
    # strategy, is a conflict as before.
    fixed = board_name("fixed")
    made, _ = await store.create(BoardConfig.from_dict(fixed, {"durability": "memory"}))
    assert made.config.sharding.shards == DEFAULT_SHARDS
    confirmed, created = await store.create(auto(fixed, {"durability": "memory"}))
    assert not created and confirmed.config.sharding.shards == DEFAULT_SHARDS
    with pytest.raises(BoardConflict):
        await store.create(
            auto(fixed, {"durability": "memory", "sharding": {"strategy": "hash", "shards": 5}})
        )
    with pytest.raises(BoardConflict):
        await store.create(
            auto(fixed, {"durability": "memory", "sharding": {"strategy": "band", "bands": [0, 9]}})
        )
    with pytest.raises(BoardConflict):  # settings other than the count still have to match
        await store.create(auto(fixed, {"durability": "memory", "mode": "incr"}))
    for board_id in (name, banded, fixed):
        await store.delete(board_id)


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url) as (_, c):
        yield c


async def test_put_without_a_shard_count(client: httpx.AsyncClient, cluster: LocalCluster) -> None:
    masters = cluster.masters
    name = board_name("auto")
    made = await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert made.status_code == 201, made.text
    assert made.json()["sharding"] == {"strategy": "hash", "shards": masters}
    for body in (
        {},
        {"sharding": {"strategy": "hash"}},
        {"sharding": {"strategy": "hash", "shards": masters}},
    ):
        again = await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
        assert again.status_code == 200 and again.json() == made.json(), (body, again.text)
    other = await client.put(
        f"/v1/boards/{name}", json={"sharding": {"strategy": "hash", "shards": masters + 1}}, headers=AS_ADMIN
    )
    assert other.status_code == 409 and other.json()["error"]["code"] == "board_conflict"

    # Scores and ranks on it, as on any board.
    scores = [{"player_id": f"p{i}", "points": 10 * i, "match_id": f"m{i}"} for i in range(30)]
    posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert posted.status_code == 200 and {r["status"] for r in posted.json()["results"]} == {"improved"}
    player = await client.get(f"/v1/boards/{name}/players/p7")
    assert player.status_code == 200 and (player.json()["rank"], player.json()["players"]) == (23, 30)
    top = await client.get(f"/v1/boards/{name}/top", params={"limit": 3})
    assert [e["player_id"] for e in top.json()["entries"]] == ["p29", "p28", "p27"]

    # A board made with 16 shards is confirmed by a PUT without a count, and keeps them.
    fixed = board_name("fixed")
    sixteen = {"sharding": {"strategy": "hash", "shards": 16}}
    assert (await client.put(f"/v1/boards/{fixed}", json=sixteen, headers=AS_ADMIN)).status_code == 201
    confirmed = await client.put(f"/v1/boards/{fixed}", headers=AS_ADMIN)
    assert confirmed.status_code == 200 and confirmed.json()["sharding"] == sixteen["sharding"]

    banded = board_name("auto-band")
    band = await client.put(
        f"/v1/boards/{banded}", json={"sharding": {"strategy": "band", "bands": [0, 50]}}, headers=AS_ADMIN
    )
    assert band.status_code == 201 and band.json()["sharding"]["shards"] == masters
    for board_id in (name, fixed, banded):
        assert (await client.delete(f"/v1/boards/{board_id}", headers=AS_ADMIN)).status_code == 204
