"""A reshard's copy through a failover: a master of the new layout killed (SIGKILL) while its
replica lags, the replica promoted without the copies it had not received, the mover resumed. The
board after the cut-over must hold every player it held before (shardlb/reshard.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos import healthy, node, promoted
from shardlb import keys
from shardlb.board import Score
from shardlb.cluster import LocalCluster, free_port_block
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.ports import search_start

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def failing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    port = free_port_block(6, start=search_start(22900, 50))
    local = LocalCluster(3, 1, port, Path(tmp_path_factory.mktemp("reshard-failover")), durable=True)
    local.up()
    try:
        yield local
    finally:
        local.down()


def owner(status: list, slot: int) -> int:  # type: ignore[type-arg]
    return next(n.port for n in status if n.role == "master" and any(a <= slot <= b for a, b in n.slots))


@pytest.mark.xfail(
    strict=True,
    reason="not fixed: the mover's copies are not replica-acknowledged, and a shard recorded as copied "
    "is not copied again after a failover lost its copies (a third of the board is lost)",
)
async def test_copies_lost_in_a_failover_are_copied_again(failing_cluster: LocalCluster) -> None:
    cluster = failing_cluster
    client = connect(cluster.url, timeout=5.0)
    store = BoardStore(client, Scripts.register(client))
    await client.initialize()
    body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}}
    board, _ = await store.create(BoardConfig.from_dict("fo", body))
    players = [f"p{i:05d}" for i in range(3000)]
    for start in range(0, len(players), 500):
        await board.submit(
            [Score(p, 1 + i % 900, f"m-{p}") for i, p in enumerate(players[start : start + 500])]
        )
    before = await board.top(3000)
    mover = Resharder(store, "fo", say=lambda _: None, cache_s=0)
    record = await mover.start(3)
    source, target = mover._layouts(record)
    nodes = (await asyncio.to_thread(cluster.status)).nodes
    spared = {owner(nodes, keys.slot_of(k)) for k in (keys.BOARDS, keys.lease_key("fo"), source.prefixes[0])}
    victims = [p for p in target.prefixes if owner(nodes, keys.slot_of(p)) not in spared]
    assert victims, "no new shard on a master of its own"
    master = next(n for n in nodes if n.port == owner(nodes, keys.slot_of(victims[0])))
    replica = next(n for n in nodes if n.role == "replica" and n.master_port == master.port)
    assert master.pid and replica.pid
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        # The replication link cut from the master's side while the replica cannot take it up
        # again: the copies reach the master only (as when they are still in flight at the kill).
        r = node(cluster, master.port)
        try:
            await r.execute_command("CLIENT", "KILL", "TYPE", "replica")
        finally:
            await r.aclose()
        await mover._copy(record)
        os.kill(master.pid, signal.SIGKILL)
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    await promoted(cluster, replica.port)
    await asyncio.to_thread(cluster.up)
    await healthy(cluster)
    await client.aclose()
    client = connect(cluster.url, timeout=5.0)
    store = BoardStore(client, Scripts.register(client))
    try:
        assert (await Resharder(store, "fo", say=lambda _: None, cache_s=0).run())["state"] == "none"
        after = await store.get("fo")
        assert after.config.sharding.shards == 3
        assert await after.size() == len(before)
        assert await after.top(3000) == before
    finally:
        await client.aclose()
