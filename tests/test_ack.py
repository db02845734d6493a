"""Acknowledgement levels (SHARDLB_ACK): in `replica` mode a write is answered only once a replica of
its shard's primary has it (WAIT on the connection that made the write), else 503; `primary` mode
answers as soon as the primary applied it.

The replica of one master of the suite's cluster is stopped (SIGSTOP) for a moment: it stays
connected, so its primary still counts it, but it acknowledges nothing until it is resumed. A
replica killed for good runs on a cluster of this module's own (``orphan_cluster``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from bench.chaos import flagged_failed, healthy, node
from router.errors import to_api_error
from router.settings import Settings, SettingsError
from shardlb import fanout, keys, times
from shardlb.board import Score
from shardlb.cluster import LocalCluster, NodeStatus, free_port_block
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import NotAcknowledged
from shardlb.replicas import Replicated
from shardlb.sharding import player_hash
from shardlb.store import BoardStore
from tests.ports import search_start
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = pytest.mark.cluster

ACK_MS = 300  # short: every write to the stopped replica's primary waits this long


def shard_nodes(cluster: LocalCluster, board: str) -> tuple[NodeStatus, NodeStatus]:
    """The master that holds the only shard of a one-shard board, and its replica."""
    slot = keys.slot_of(keys.shard_prefix(board, 0, 1))
    status = cluster.status()
    master = next(n for n in status.nodes if any(a <= slot <= b for a, b in n.slots))
    replica = next(n for n in status.nodes if n.role == "replica" and n.master_port == master.port)
    return master, replica


def replica_pid(cluster: LocalCluster, board: str) -> int:
    """The pid of the replica of the master that holds the only shard of a one-shard board."""
    pid = shard_nodes(cluster, board)[1].pid
    assert pid is not None
    return pid


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped (not killed: its connections stay open) for the block, then resumed.
    Kept well under the cluster's node timeout (5 s), so nobody marks the replica as failed."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def one_score(player: str, match: str, points: int = 10) -> dict[str, Any]:
    return {"scores": [{"player_id": player, "points": points, "match_id": match}]}


async def make_board(client: httpx.AsyncClient) -> str:
    name = board_name("ack")
    r = await client.put(
        f"/v1/boards/{name}", json={"mode": "incr", "sharding": {"shards": 1}}, headers=AS_ADMIN
    )
    assert r.status_code == 201, r.text
    return name


async def wait_count(client: RedisCluster, board: str) -> int:
    """WAIT commands the primary of the board's shard has served so far."""
    node = client.get_node_from_key(keys.shard_prefix(board, 0, 1))
    stats = await client.info("commandstats", target_nodes=node)
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def test_replica_mode_writes_succeed_and_wait_on_the_shards_primary(cluster: LocalCluster) -> None:
    async with running(cluster.url, ack="replica", ack_timeout_ms=ACK_MS) as (_, client):
        board = await make_board(client)
        redis_client = connect(cluster.url)
        try:
            await redis_client.initialize()
            before = await wait_count(redis_client, board)
            r = await client.post(f"/v1/boards/{board}/scores", json=one_score("p1", "m1"), headers=AS_WRITER)
            assert r.status_code == 200, r.text
            assert [x["status"] for x in r.json()["results"]] == ["improved"]
            assert await wait_count(redis_client, board) > before
        finally:
            await redis_client.aclose()
        r = await client.get(f"/v1/boards/{board}/players/p1")
        assert r.json()["points"] == 10


async def test_a_write_no_replica_confirms_is_503_in_replica_mode_and_200_in_primary_mode(
    cluster: LocalCluster,
) -> None:
    async with (
        running(cluster.url, ack="replica", ack_timeout_ms=ACK_MS) as (_, acked),
        running(cluster.url) as (_, plain),
    ):
        board = await make_board(acked)
        pid = replica_pid(cluster, board)
        url = f"/v1/boards/{board}/scores"
        with stopped(pid):
            r = await acked.post(url, json=one_score("p1", "m1"), headers=AS_WRITER)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "cluster_unavailable"
            assert "replica" in r.json()["error"]["message"] and "retry" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 1
            r = await plain.post(url, json=one_score("p2", "m2"), headers=AS_WRITER)
            assert r.status_code == 200, r.text
        # The refused write was applied on the primary: the client's retry, once a replica answers
        # again, changes nothing and is acknowledged.
        r = await acked.post(url, json=one_score("p1", "m1"), headers=AS_WRITER)
        assert r.status_code == 200, r.text
        assert [x["status"] for x in r.json()["results"]] == ["duplicate"]
        r = await acked.get(f"/v1/boards/{board}/players/p1")
        assert r.json()["points"] == 10


async def test_a_removal_no_replica_confirms_is_503_in_replica_mode_and_200_in_primary_mode(
    cluster: LocalCluster, postgres_url: str
) -> None:
    """A durability audit's finding: only write.lua waited for a replica, and a DELETE of a player
    was answered 200 by the primary alone; a failover could then lose the removal with its journal
    entry, and a rebuild brought the player back (router/README.md says it never does). remove.lua
    now waits as a score write does."""
    async with (
        running(cluster.url, ack="replica", ack_timeout_ms=ACK_MS, postgres_url=postgres_url) as (_, acked),
        running(cluster.url, postgres_url=postgres_url) as (_, plain),
    ):
        board = await make_board(acked)
        url = f"/v1/boards/{board}"
        for player in ("p1", "p2"):
            r = await acked.post(f"{url}/scores", json=one_score(player, f"m-{player}"), headers=AS_WRITER)
            assert r.status_code == 200, r.text
        redis_client = connect(cluster.url)
        try:
            await redis_client.initialize()
            before = await wait_count(redis_client, board)
            with stopped(replica_pid(cluster, board)):
                r = await acked.delete(f"{url}/players/p1", headers=AS_ADMIN)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "cluster_unavailable"
                assert int(r.headers["retry-after"]) >= 1
                r = await plain.delete(f"{url}/players/p2", headers=AS_ADMIN)
                assert r.status_code == 200, r.text
            assert await wait_count(redis_client, board) > before
        finally:
            await redis_client.aclose()
        # Applied on the primary all the same: the retry changes nothing and is acknowledged.
        r = await acked.delete(f"{url}/players/p1", headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        assert (await acked.get(f"{url}/players/p1")).status_code == 404


@pytest.fixture
async def acked_store(cluster: LocalCluster) -> AsyncIterator[BoardStore]:
    """A library user's store whose writes wait for one replica (fanout.acknowledged)."""
    client = connect(cluster.url)
    scripts = fanout.acknowledged(Scripts.register(client), fanout.Ack(1, ACK_MS))
    await scripts.load(client)
    yield BoardStore(client, scripts)
    await client.aclose()


async def test_a_retry_on_another_connection_waits_for_the_first_write(
    cluster: LocalCluster, acked_store: BoardStore
) -> None:
    """A retry from another router (other connections) that finds the write already applied is
    refused as long as no replica has it, and acknowledged once one has. WAIT counts what its own
    connection wrote; the marker written before each WAIT makes that cover the first call's write
    (Redis 7.0 also stamps the connection's offset after every command; later versions only after
    a command that replicated something, so there the marker is what keeps this test green)."""
    config = BoardConfig.from_dict(board_name("ack"), {"mode": "incr", "sharding": {"shards": 1}})
    board, _ = await acked_store.create(config)
    other = connect(cluster.url)  # another router process: its own connections
    try:
        scripts = fanout.acknowledged(Scripts.register(other), fanout.Ack(1, ACK_MS))
        await scripts.load(other)
        again, _ = await BoardStore(other, scripts).create(config)
        await again.submit([Score("p0", 1, "m0")])  # its connection's last write is confirmed
        score = Score("p1", 5, "m1", achieved_ms=times.now_ms())
        with stopped(replica_pid(cluster, config.id)):
            with pytest.raises(NotAcknowledged):
                await board.submit([score])  # Board.submit: no pipeline
            with pytest.raises(NotAcknowledged):
                await again.submit([score])
        assert [r.status for r in await again.submit([score])] == ["duplicate"]
    finally:
        await other.aclose()
        await acked_store.delete(config.id)


async def test_the_fallback_path_waits_and_reloads_scripts(
    cluster: LocalCluster, acked_store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the turn's pipeline fails, the write is made alone, still with its WAIT on the same
    connection; an empty script cache (a promoted replica) is reloaded on the way."""
    config = BoardConfig.from_dict(board_name("ack"), {"mode": "incr", "sharding": {"shards": 1}})
    board, _ = await acked_store.create(config)
    client = acked_store.client
    real = fanout._pipelines
    failures = [ConnectionError("the turn's pipeline broke")]

    async def once_broken(sends: list[tuple[Any, list[Any]]], timeout: float | None) -> list[Any]:
        if failures:
            raise failures.pop()
        return await real(sends, timeout)

    try:
        pipeline = fanout.ScriptPipeline(client)
        await client.execute_command("SCRIPT FLUSH", target_nodes=client.PRIMARIES)
        monkeypatch.setattr(fanout, "_pipelines", once_broken)
        prepared = board.prepare([Score("p1", 7, "m1")])
        results = await board.apply_shard(0, prepared, pipeline=pipeline)
        assert [r.status for r in results] == ["improved"] and not failures
        with stopped(replica_pid(cluster, config.id)), pytest.raises(NotAcknowledged) as refused:
            await board.apply_shard(0, board.prepare([Score("p1", 7, "m2")]), pipeline=pipeline)
        assert to_api_error(refused.value).status == 503
    finally:
        await acked_store.delete(config.id)


async def test_primary_mode_sends_no_wait(cluster: LocalCluster, store: BoardStore) -> None:
    config = BoardConfig.from_dict(board_name("ack"), {"mode": "incr", "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    try:
        before = await wait_count(store.client, config.id)
        await asyncio.gather(board.submit([Score("p1", 1, "m1")]), board.submit([Score("p2", 1, "m1")]))
        assert await wait_count(store.client, config.id) == before
    finally:
        await store.delete(config.id)


def test_ack_and_password_settings_are_checked_at_start_up() -> None:
    base = {"SHARDLB_INSECURE_DEV": "true"}
    assert Settings.from_env(base).ack == "primary"
    assert Settings.from_env({**base, "SHARDLB_ACK": "Replica"}).ack == "replica"
    with pytest.raises(SettingsError, match=r"^SHARDLB_ACK: must be one of primary, replica"):
        Settings.from_env({**base, "SHARDLB_ACK": "all"})
    with pytest.raises(SettingsError, match=r"^SHARDLB_ACK_TIMEOUT_MS"):
        Settings.from_env({**base, "SHARDLB_ACK_TIMEOUT_MS": "0"})  # WAIT 1 0 would wait forever
    with pytest.raises(SettingsError, match=r"^SHARDLB_REDIS_PASSWORD: .* give it once"):
        Settings.from_env({**base, "SHARDLB_REDIS_URL": "redis://:pw@h:1", "SHARDLB_REDIS_PASSWORD": "x"})
    settings = Settings.from_env({**base, "SHARDLB_REDIS_PASSWORD": "s3cret-pw"})
    assert settings.redis_password == "s3cret-pw" and "s3cret-pw" not in repr(settings)


@pytest.fixture(scope="module")
def orphan_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster of this module's own (3 masters, a replica each, kept on disk so a killed node
    starts again with its data), for a test that kills a replica for good."""
    port = free_port_block(6, start=search_start(23600, 30))
    local = LocalCluster(3, 1, port, Path(tmp_path_factory.mktemp("ack-orphan")), durable=True)
    local.up()
    try:
        yield local
    finally:
        local.down()


async def cluster_nodes_calls(cluster: LocalCluster) -> int:
    """CLUSTER NODES calls the masters of ``cluster`` have served (INFO commandstats)."""
    total = 0
    for n in (await asyncio.to_thread(cluster.status)).nodes:
        if n.role != "master":
            continue
        r = node(cluster, n.port)
        try:
            stats = await r.info("commandstats")
        finally:
            await r.aclose()
        total += int(stats.get("cmdstat_cluster|nodes", {}).get("calls", 0))
    return total


async def posted(client: httpx.AsyncClient, board: str, match: str, within_s: float) -> httpx.Response:
    """The first answer other than 503 to one score, sent again (a safe retry) until ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        r = await client.post(f"/v1/boards/{board}/scores", json=one_score("p1", match), headers=AS_WRITER)
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        await asyncio.sleep(0.1)


async def test_a_primary_whose_only_replica_the_cluster_marked_failed_takes_writes_flagged(
    orphan_cluster: LocalCluster, postgres_url: str
) -> None:
    """A replica killed for good used to take its primary's writes down in replica mode: every
    write waited for it (WAIT 1) and was answered 503, until an operator forgot the replica. Once
    the cluster has marked it failed, its primary is written as one without replicas (the rule of
    slot moves and the reshard mover, slots.followed): answered 200 with ``ack: primary``, logged
    once, counted; every other primary still waits for its replica. When the replica is back,
    writes wait for it again. The router learns the topology from a cached CLUSTER NODES, not one
    per write."""
    cluster = orphan_cluster
    logger = logging.getLogger("shardlb")  # where the router's JSON handler is (router/logs.py)
    seen: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(catch)
    try:
        async with running(cluster.url, ack="replica", ack_timeout_ms=ACK_MS, postgres_url=postgres_url) as (
            _,
            client,
        ):
            orphan = await make_board(client)
            master, replica = shard_nodes(cluster, orphan)
            # A board whose last shard (of 3) lives on another master, and a player of that shard.
            other = board_name("ack")
            r = await client.put(f"/v1/boards/{other}", json={"sharding": {"shards": 3}}, headers=AS_ADMIN)
            assert r.status_code == 201, r.text
            slot = keys.slot_of(keys.shard_prefix(other, 2, 3))
            other_master = next(n for n in cluster.status().nodes if any(a <= slot <= b for a, b in n.slots))
            assert other_master.port != master.port
            player = next(p for p in (f"o{i}" for i in range(100)) if player_hash(p) % 3 == 2)
            assert replica.pid is not None
            os.kill(replica.pid, signal.SIGKILL)
            await flagged_failed(cluster, replica.port)

            # Answered 200 (a retry is safe), the level it got said, the result applied.
            r = await posted(client, orphan, "m1", within_s=5.0)
            assert r.status_code == 200, r.text
            assert r.json()["ack"] == "primary"
            assert (await client.get(f"/v1/boards/{orphan}/players/p1")).json()["points"] == 10

            # No CLUSTER NODES per write, and no WAIT on the orphaned primary.
            nodes_before = await cluster_nodes_calls(cluster)
            waits_before = await waits_on(cluster, master.port)
            started = time.monotonic()
            for i in range(40):
                r = await client.post(
                    f"/v1/boards/{orphan}/scores", json=one_score(f"q{i}", f"n{i}"), headers=AS_WRITER
                )
                assert r.status_code == 200 and r.json()["ack"] == "primary", r.text
            elapsed = time.monotonic() - started
            assert await waits_on(cluster, master.port) == waits_before
            assert await cluster_nodes_calls(cluster) - nodes_before <= min(20, elapsed + 2)

            # A removal too, and a library user's write without a pipeline (fanout.AckedScript).
            r = await client.delete(f"/v1/boards/{orphan}/players/q0", headers=AS_ADMIN)
            assert r.status_code == 200, r.text
            library = connect(cluster.url)
            logged = len(seen)
            try:
                scripts = fanout.acknowledged(Scripts.register(library), fanout.Ack(1, ACK_MS))
                await scripts.load(library)
                board = await BoardStore(library, scripts).get(orphan)
                await Replicated.of(library).read()  # its first view of the topology, at once
                [result] = await board.submit([Score("lib", 3, "lib-1")])
                assert result.unconfirmed and result.status == "improved"
            finally:
                await library.aclose()
            del seen[logged:]  # its own view says it once too; the router's is checked below

            # The other primaries still wait for their replicas.
            waits_before = await waits_on(cluster, other_master.port)
            url = f"/v1/boards/{other}/scores"
            r = await client.post(url, json=one_score(player, "m1"), headers=AS_WRITER)
            assert r.status_code == 200 and r.json()["ack"] == "replica", r.text
            assert await waits_on(cluster, other_master.port) > waits_before

            metrics = (await client.get("/metrics")).text
            assert "shardlb_primaries_without_replica 1.0" in metrics
            assert "shardlb_scores_unconfirmed_total 41.0" in metrics

            # The replica back (it catches up with its primary): writes wait for it again.
            await asyncio.to_thread(cluster.up)
            await healthy(cluster)
            deadline = time.monotonic() + 30
            while True:
                r = await client.post(
                    f"/v1/boards/{orphan}/scores", json=one_score("p2", "m2"), headers=AS_WRITER
                )
                if r.status_code == 200 and r.json()["ack"] == "replica":
                    break
                assert time.monotonic() < deadline, r.text
                await asyncio.sleep(0.2)
            assert "shardlb_primaries_without_replica 0.0" in (await client.get("/metrics")).text
    finally:
        logger.removeHandler(catch)
    address = f"{cluster.host}:{master.port}"
    changes = [r for r in seen if getattr(r, "fields", {}).get("primary") == address]
    assert [r.levelno for r in changes] == [logging.WARNING, logging.INFO], [r.getMessage() for r in changes]


async def waits_on(cluster: LocalCluster, port: int) -> int:
    """WAIT calls the node on ``port`` has served."""
    r = node(cluster, port)
    try:
        stats = await r.info("commandstats")
    finally:
        await r.aclose()
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))
