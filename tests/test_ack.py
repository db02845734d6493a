"""Acknowledgement levels (SHARDLB_ACK): in `replica` mode a write is answered only once a replica of
its shard's primary has it (WAIT on the connection that made the write), else 503; `primary` mode
answers as soon as the primary applied it.

The replica of one master of the suite's cluster is stopped (SIGSTOP) for a moment: it stays
connected, so its primary still counts it, but it acknowledges nothing until it is resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster

from router.errors import to_api_error
from router.settings import Settings, SettingsError
from shardlb import fanout, keys, times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import NotAcknowledged
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = pytest.mark.cluster

ACK_MS = 300  # short: every write to the stopped replica's primary waits this long


def replica_pid(cluster: LocalCluster, board: str) -> int:
    """The pid of the replica of the master that holds the only shard of a one-shard board."""
    return key_replica_pid(cluster, keys.shard_prefix(board, 0, 1))


def key_replica_pid(cluster: LocalCluster, key: str) -> int:
    """The pid of the replica of the master that holds ``key``."""
    slot = keys.slot_of(key)
    status = cluster.status()
    master = next(n.port for n in status.nodes if any(a <= slot <= b for a, b in n.slots))
    pid = next(n.pid for n in status.nodes if n.role == "replica" and n.master_port == master)
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


async def test_board_creation_and_deletion_wait_for_a_replica_of_the_registry_in_replica_mode(
    cluster: LocalCluster,
) -> None:
    """A failover audit's finding: the registry's HSETNX was answered 201 by its primary alone, so a
    kill -9 of that primary within the replication lag lost the board, and with it every score
    acknowledged on it since (a PUT again makes a new incarnation: they stay out of reach). Creating,
    confirming and deleting a board now wait for a replica of the registry's primary as a score write
    waits for its shard's."""
    async with (
        running(cluster.url, ack="replica", ack_timeout_ms=ACK_MS) as (_, acked),
        running(cluster.url) as (_, plain),
    ):
        url = f"/v1/boards/{board_name('ack')}"
        body = {"mode": "incr", "sharding": {"shards": 1}}
        with stopped(key_replica_pid(cluster, keys.BOARDS)):
            r = await acked.put(url, json=body, headers=AS_ADMIN)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "cluster_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            # A retry is not confirmed either: made on the primary, or (when the board's one shard
            # shares the registry's primary) its sentinel unconfirmed and taken back, no record made.
            r = await acked.put(url, json=body, headers=AS_ADMIN)
            assert r.status_code == 503, r.text
            other = f"/v1/boards/{board_name('ack')}"
            r = await plain.put(other, json=body, headers=AS_ADMIN)
            assert r.status_code == 201, r.text
        r = await acked.put(url, json=body, headers=AS_ADMIN)
        # 200: the record made on the primary alone, confirmed now; 201: none was made, for the
        # shard's sentinel, confirmed before the record since ce70fe7, went unconfirmed first and
        # was taken back (its primary the registry's: every local run of this test, and CI at
        # 5d9099d, which failed here with 201).
        assert r.status_code in (200, 201), r.text
        with stopped(key_replica_pid(cluster, keys.BOARDS)):
            r = await acked.delete(url, headers=AS_ADMIN)
            assert r.status_code == 503, r.text
            r = await plain.delete(other, headers=AS_ADMIN)
            assert r.status_code == 204, r.text
        assert (await acked.get(url, headers=AS_ADMIN)).status_code == 404


async def test_bans_and_lifts_wait_for_a_replica_of_the_ban_list_in_replica_mode(
    cluster: LocalCluster, postgres_url: str
) -> None:
    """A failover audit's finding: a ban's record in Redis's list (``lb:bans``) was answered by its
    primary alone, so a kill -9 of that primary within the replication lag lost it, and routers took
    the banned player's scores again until a rebuild wrote the bans back from PostgreSQL (a lost
    lift, likewise, kept refusing a player no longer banned). A ban and a lift now wait for a
    replica of the list's primary as a score write waits for its shard's."""
    async with running(cluster.url, ack="replica", ack_timeout_ms=ACK_MS, postgres_url=postgres_url) as (
        _,
        acked,
    ):
        held = key_replica_pid(cluster, keys.BANS)
        board = await make_board(acked)
        while replica_pid(cluster, board) == held:  # the ban's removal must have its replica
            board = await make_board(acked)
        player = f"{board}-p1"
        url = f"/v1/players/{player}"
        body = {"scope": "board", "board": board, "reason": "cheating"}
        banning = {**AS_ADMIN, "X-Request-Id": f"ban-{board}"}
        with stopped(held):
            r = await acked.post(f"{url}:ban", json=body, headers=banning)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "cluster_unavailable"
            assert int(r.headers["retry-after"]) >= 1
        # Stored all the same (PostgreSQL and the list's primary): the retry is that ban, confirmed.
        r = await acked.post(f"{url}:ban", json=body, headers=banning)
        assert r.status_code == 200, r.text
        assert r.json()["board"] == board and r.json()["reason"] == "cheating"
        r = await acked.get("/v1/bans", params={"player": player}, headers=AS_ADMIN)
        assert [b["board"] for b in r.json()["bans"]] == [board]
        lifting = {**AS_ADMIN, "X-Request-Id": f"unban-{board}"}
        with stopped(held):
            r = await acked.post(f"{url}:unban", json=body, headers=lifting)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "cluster_unavailable"
        r = await acked.post(f"{url}:unban", json=body, headers=lifting)
        assert r.status_code == 200, r.text
        r = await acked.get("/v1/bans", params={"player": player}, headers=AS_ADMIN)
        assert r.json()["bans"] == []


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
