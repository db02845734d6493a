"""A reshard's copy through a failover: a master of the new layout killed (SIGKILL) while its
replica lags, the replica promoted without the copies it had not received, the mover resumed. The
mover must not go on (nor record a shard copied) while no replica confirms its writes, and the
board after the cut-over must hold every player it held before (shardlb/reshard_copy.py,
``Copier.run``)."""

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
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import NotAcknowledged
from shardlb.fanout import Ack
from shardlb.reshard import Resharder
from shardlb.reshard_copy import Replicated
from shardlb.store import BoardStore
from tests.ports import node_ports

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def failing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    port = node_ports(6)
    local = LocalCluster(3, 1, port, Path(tmp_path_factory.mktemp("reshard-failover")), durable=True)
    local.up()
    try:
        yield local
    finally:
        local.down()


def owner(status: list, slot: int) -> int:  # type: ignore[type-arg]
    return next(n.port for n in status if n.role == "master" and any(a <= slot <= b for a, b in n.slots))


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
        # No replica confirms the mover's writes there: it stops, recording nothing as copied,
        # and says which primary and replica it waited for, and what to do.
        with pytest.raises(NotAcknowledged, match="Resume once") as refused:
            await mover._copy(record)
        assert f"primary {cluster.host}:{master.port} (replicas: {cluster.host}:{replica.port}" in str(
            refused.value
        )
        assert "CLUSTER FORGET" in str(refused.value)
        assert (await mover.status())["shards_copied"] == 0
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


async def waits(cluster: LocalCluster, ports: list[int]) -> int:
    """WAIT calls the masters on ``ports`` have served (INFO commandstats)."""
    total = 0
    for port in ports:
        r = node(cluster, port)
        try:
            stats = await r.info("commandstats")
        finally:
            await r.aclose()
        total += int(stats.get("cmdstat_wait", {}).get("calls", 0))
    return total


async def reshard_counting_waits(cluster: LocalCluster, board_id: str) -> tuple[int, set[bool]]:
    """A 1 -> 3 reshard of a small board: the WAITs it cost the masters, and what ``Replicated``
    said of the new shards' primaries."""
    client = connect(cluster.url, timeout=5.0)
    try:
        store = BoardStore(client, Scripts.register(client))
        await client.initialize()
        body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}}
        board, _ = await store.create(BoardConfig.from_dict(board_id, body))
        await board.submit([Score(f"p{i}", i, f"m{i}") for i in range(500)])
        masters = [n.port for n in (await asyncio.to_thread(cluster.status)).nodes if n.role == "master"]
        before = await waits(cluster, masters)
        mover = Resharder(store, board_id, say=lambda _: None, cache_s=0)
        record = await mover.start(3)
        _, target = mover._layouts(record)
        assert (await mover.run())["state"] == "none"
        replicated = Replicated(client)
        await replicated.read()
        assert await (await store.get(board_id)).size() == 500
        return await waits(cluster, masters) - before, {replicated(p) for p in target.prefixes}
    finally:
        await client.aclose()


async def test_the_mover_waits_for_replicas_only_where_primaries_have_them(
    failing_cluster: LocalCluster, tmp_path: Path
) -> None:
    """With replicas every new shard's writes are confirmed (WAIT); a cluster of masters only gets
    none, as before the confirmation."""
    waited, replicated = await reshard_counting_waits(failing_cluster, "fo-waits")
    assert replicated == {True} and waited > 0
    port = node_ports(1)
    alone = LocalCluster(1, 0, port, tmp_path / "alone")
    alone.up()
    try:
        waited, replicated = await reshard_counting_waits(alone, "alone")
        assert replicated == {False} and waited == 0
    finally:
        alone.down()


async def flagged_failed(cluster: LocalCluster, port: int, timeout: float = 60.0) -> None:
    """Wait until the cluster marks the node on ``port`` failed (``fail``, agreed by the masters;
    not one node's ``fail?``), as every master's CLUSTER NODES says."""
    masters = [n.port for n in (await asyncio.to_thread(cluster.status)).nodes if n.role == "master"]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        seen = []
        for master in masters:
            r = node(cluster, master)
            try:
                known = await r.execute_command("CLUSTER NODES")
            finally:
                await r.aclose()
            flags = next(n["flags"] for address, n in known.items() if address.endswith(f":{port}"))
            seen.append("fail" in flags.split(","))
        if all(seen):
            return
        assert asyncio.get_running_loop().time() < deadline, f"node {port} not marked failed"
        await asyncio.sleep(0.2)


async def test_a_replica_the_cluster_marked_failed_still_stops_the_mover_until_it_is_back(
    failing_cluster: LocalCluster,
) -> None:
    """A replica the cluster has marked failed is still waited for: one frozen past
    cluster-node-timeout is marked so, and if it came back as its primary died, the cluster would
    promote it without the copies (tests/test_chaos.py lost acknowledged writes that way when they
    were not waited for). The mover stops resumable, naming the replica and what to do, and a
    resume once the replica is back ends with every player."""
    cluster = failing_cluster
    nodes = (await asyncio.to_thread(cluster.status)).nodes
    replica = next(n for n in nodes if n.role == "replica")
    assert replica.pid and replica.master_port
    os.kill(replica.pid, signal.SIGKILL)
    client = connect(cluster.url, timeout=10.0)
    try:
        await flagged_failed(cluster, replica.port)
        store = BoardStore(client, Scripts.register(client))
        await client.initialize()
        body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}}
        board, _ = await store.create(BoardConfig.from_dict("fo-gone", body))
        await board.submit([Score(f"p{i}", 1 + i, f"m{i}") for i in range(2000)])
        before = await board.top(2000)
        mover = Resharder(store, "fo-gone", say=lambda _: None, cache_s=0)
        await mover.start(6)
        with pytest.raises(NotAcknowledged) as stopped:
            await mover.run()
        assert str(replica.port) in str(stopped.value) and "CLUSTER FORGET" in str(stopped.value)
        await asyncio.to_thread(cluster.up)
        await healthy(cluster)
        assert (await mover.run())["state"] == "none"
        after = await store.get("fo-gone")
        assert after.config.sharding.shards == 6
        assert await after.top(2000) == before
    finally:
        await client.aclose()
        await asyncio.to_thread(cluster.up)
        await healthy(cluster)


async def test_a_cut_over_no_replica_of_the_registry_confirms_leaves_the_new_layout_closed(
    cluster: LocalCluster,
) -> None:
    """A failover audit's finding: the record naming the new layout was written on the registry's
    primary alone before the new shards were opened. Lost in a failover after the new layout took
    writes, it named the old layout again: a resume then checked the old layout against the new,
    found them apart and dropped the new one (``_recopy``), with the writes acknowledged there; a
    resume after the old shards were dropped could lose the whole board so. The mover now has a
    replica of the registry's primary confirm each record it writes before it goes on, and stops
    resumable, with the new layout still closed, when none does."""
    client = connect(cluster.url, timeout=5.0)
    try:
        store = BoardStore(client, Scripts.register(client))
        await client.initialize()
        nodes = (await asyncio.to_thread(cluster.status)).nodes
        registry = owner(nodes, keys.slot_of(keys.BOARDS))
        pid = next(n.pid for n in nodes if n.role == "replica" and n.master_port == registry)
        assert pid is not None
        board_id = f"fo-cut-{os.getpid()}"
        # The new shards have their replicas (their opening waits for one): only the record waits.
        new = [keys.shard_prefix(board_id, s, 2) for s in range(2)]
        assert all(owner(nodes, keys.slot_of(p)) != registry for p in new), (
            "a new shard on the registry's master"
        )
        body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 1}}
        board, _ = await store.create(BoardConfig.from_dict(board_id, body))
        await board.submit([Score(f"p{i}", 1 + i, f"m{i}") for i in range(200)])
        before = await board.top(200)
        stopped: list[int] = []

        def say(line: str) -> None:  # right before the commit: the registry's replica stops
            if "new layout checked against the old" in line:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)

        mover = Resharder(store, board_id, say=say, cache_s=0)
        mover.copier.ack = Ack(1, 300)  # stopped well under the cluster's node timeout
        record = await mover.start(2)
        _, target = mover._layouts(record)
        try:
            with pytest.raises(NotAcknowledged, match="resume"):
                await mover.run()
        finally:
            for each in stopped:
                os.kill(each, signal.SIGCONT)
        assert stopped
        # The record names the new layout on the primary, but the new layout took no write: lost in
        # a failover, the record goes back to sealing, and a resume seals and checks again.
        assert [await client.get(keys.move_key(p)) for p in target.prefixes] == ["c", "c"]
        status = await Resharder(store, board_id, say=lambda _: None, cache_s=0).run()
        assert status["state"] == "none" and status["shards"] == 2
        assert await (await store.get(board_id)).top(200) == before
    finally:
        await client.aclose()
