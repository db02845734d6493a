"""A master that reaches `maxmemory` refuses writes to the boards it holds with 503 `out_of_memory`;
their reads, and every board on the other masters, keep answering.

The test runs on a cluster of its own: it fills one master to its limit, which would fail the tests
sharing the session cluster."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.cluster import LocalCluster
from shardlb.connection import connect
from tests.ports import node_ports
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

HEADROOM = 1 << 20  # room left above the used memory: filled by a few requests of incr results
MAX_REQUESTS = 200


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    port = node_ports(2)
    local = LocalCluster(masters=2, replicas=0, port=port, dir=Path(tmp_path_factory.mktemp("oom")))
    local.up()
    try:
        yield local
    finally:
        local.down()


@pytest.fixture
async def redis_client(small_cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    client = connect(small_cluster.url)
    await client.initialize()
    try:
        yield client
    finally:
        await client.config_set("maxmemory", 0, target_nodes=client.PRIMARIES)
        await client.aclose()


def master_of(client: RedisCluster, board: str) -> Any:
    """The primary holding the only shard of a one-shard board."""
    return client.get_node_from_key(keys.shard_prefix(board, 0, 1) + "total")


def scores(n: int, prefix: str = "p") -> dict[str, Any]:
    return {
        "scores": [
            {"player_id": f"{prefix}{i}", "points": 1, "match_id": str(uuid.uuid4())} for i in range(n)
        ]
    }


async def test_a_full_master_refuses_writes_to_its_boards_only(
    small_cluster: LocalCluster, redis_client: RedisCluster
) -> None:
    full = board_name("oom")
    other = board_name("oom")
    while master_of(redis_client, other) == master_of(redis_client, full):
        other = board_name("oom")
    node = master_of(redis_client, full)
    async with running(small_cluster.url) as (_, http):
        for name in (full, other):
            body = {"mode": "incr", "sharding": {"strategy": "hash", "shards": 1}}
            created = await http.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
            assert created.status_code == 201, created.text
        first = await http.post(f"/v1/boards/{full}/scores", json=scores(10), headers=AS_WRITER)
        assert first.status_code == 200, first.text

        used = int((await redis_client.info("memory", target_nodes=node))["used_memory"])
        await redis_client.config_set("maxmemory", used + HEADROOM, target_nodes=node)
        refused: httpx.Response | None = None
        for _ in range(MAX_REQUESTS):
            r = await http.post(f"/v1/boards/{full}/scores", json=scores(500, "q"), headers=AS_WRITER)
            if r.status_code != 200:
                refused = r
                break
        assert refused is not None, f"{MAX_REQUESTS} requests fit in {HEADROOM} bytes"
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "out_of_memory"
        assert int(refused.headers["retry-after"]) >= 1

        # Keep the master full (at the limit, freed client buffers could let one more call in): a
        # new result is refused whole, and leaves nothing behind.
        await redis_client.config_set("maxmemory", used // 2, target_nodes=node)
        late = scores(5, "late")
        assert (await http.post(f"/v1/boards/{full}/scores", json=late, headers=AS_WRITER)).status_code == 503
        # Reads of the full board still answer, and the other master takes writes.
        assert (await http.get(f"/v1/boards/{full}/top")).status_code == 200
        assert (await http.get(f"/v1/boards/{full}/players/p0")).status_code == 200
        other_write = await http.post(f"/v1/boards/{other}/scores", json=scores(10), headers=AS_WRITER)
        assert other_write.status_code == 200, other_write.text

        await redis_client.config_set("maxmemory", 0, target_nodes=node)
        again = await http.post(f"/v1/boards/{full}/scores", json=late, headers=AS_WRITER)
        assert again.status_code == 200, again.text
        assert {r["status"] for r in again.json()["results"]} == {"improved"}
