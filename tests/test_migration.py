"""Slot migration under load (issue 15, item 1), on a private cluster this module starts itself.

First what redis-py and the cluster do while a slot is open (importing on its target, migrating on
its source), checked rather than assumed; then writers and readers going through a router process
while a master is added and slots are rebalanced onto it, and then a master is removed
(bench/migrate.py, the short form of `make chaos`'s migration table); last, that a move onto a
master with a replica deletes nothing on the source before that replica holds it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import RedisCluster

from bench import chaos, migrate
from bench.services import Router, free_port
from router.errors import to_api_error
from shardlb import BoardConfig, BoardStore, Score, Scripts, connect, keys, slots
from shardlb.cluster import ClusterError, LocalCluster
from shardlb.connection import slot_of
from shardlb.fanout import batch
from tests.ports import node_ports, server_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LOAD = {"tasks": 6, "players": 50, "batch": 10, "settle_s": 30.0}
WRITE_S = 1.5  # of writes before the change, and again after it


@pytest.fixture(scope="module")
def moving_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    port = node_ports(3)
    local = LocalCluster(3, 0, port, Path(tmp_path_factory.mktemp("migration")))
    local.up()
    try:
        yield local
    finally:
        local.down()


@pytest.fixture
async def client(moving_cluster: LocalCluster) -> AsyncIterator[RedisCluster]:
    c = connect(moving_cluster.url)
    await c.initialize()
    try:
        yield c
    finally:
        await c.aclose()


def node(cluster: LocalCluster, port: int) -> redis.Redis:
    return redis.Redis(host=cluster.host, port=port, decode_responses=True)


def open_slot(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    """Mark ``slot`` importing on ``target`` and migrating on ``source``, as a move begins."""
    with node(cluster, source) as s, node(cluster, target) as t:
        source_id, target_id = s.cluster("MYID"), t.cluster("MYID")
        t.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        s.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)


def finish(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    slots.move(lambda p: node(cluster, p), cluster.host, [slots.Move(slot, source, target)])


def ends(client: RedisCluster, key: str) -> tuple[int, int]:
    """The port of the primary serving ``key``, and of another primary."""
    source = client.nodes_manager.get_node_from_slot(slot_of(key))
    target = next(n for n in client.get_primaries() if n.name != source.name)
    return int(source.port), int(target.port)


async def test_a_batch_read_of_a_key_that_has_moved_follows_ask_to_its_new_node(
    moving_cluster: LocalCluster, client: RedisCluster
) -> None:
    key = f"lb:{{{keys.slot_tokens()[101]}}}:ask-probe"
    await client.zadd(key, {"p1": 5, "p2": 7})
    source, target = ends(client, key)
    slot = slot_of(key)
    open_slot(moving_cluster, slot, source, target)
    try:
        with node(moving_cluster, source) as s:
            s.execute_command("MIGRATE", moving_cluster.host, target, "", 0, 5000, "KEYS", key)
        # The source now answers ASK. redis-py (8.1, asyncio) sends ASKING on one pooled connection
        # of the target and the command on the next free one: with two free connections there, the
        # target answers MOVED (back to the source) and the call ends in "TTL exhausted".
        target_node = client.get_node(moving_cluster.host, target)
        assert target_node is not None
        held = [target_node.acquire_connection() for _ in range(2)]
        for connection in held:
            await connection.connect()
            target_node.release(connection)
        pipe = batch(client)
        pipe.zscore(key, "p2")
        pipe.zcard(key)
        assert await pipe.execute() == [7.0, 2]
    finally:
        finish(moving_cluster, slot, source, target)


async def test_a_batch_read_follows_ask_to_a_master_its_client_does_not_know_yet(
    moving_cluster: LocalCluster, client: RedisCluster
) -> None:
    key = f"lb:{{{keys.slot_tokens()[103]}}}:ask-new"
    await client.zadd(key, {"p1": 3})
    source, target = ends(client, key)
    slot = slot_of(key)
    open_slot(moving_cluster, slot, source, target)
    try:
        with node(moving_cluster, source) as s:
            s.execute_command("MIGRATE", moving_cluster.host, target, "", 0, 5000, "KEYS", key)
        # As after `cluster add-node`: the client's node list predates the master it is sent to.
        # (redis-py's own ASK fails there with AttributeError: it looks the node up and gets None.)
        del client.nodes_manager.nodes_cache[f"{moving_cluster.host}:{target}"]
        pipe = batch(client)
        pipe.zscore(key, "p1")
        assert await pipe.execute() == [3.0]
        assert client.get_node(moving_cluster.host, target) is not None
    finally:
        finish(moving_cluster, slot, source, target)


async def test_a_batch_read_after_a_move_follows_moved_and_updates_the_clients_slot_map(
    moving_cluster: LocalCluster, client: RedisCluster
) -> None:
    key = f"lb:{{{keys.slot_tokens()[102]}}}:moved-probe"
    await client.zadd(key, {"p1": 5})
    source, target = ends(client, key)
    finish(moving_cluster, slot_of(key), source, target)
    for _ in range(2):
        pipe = batch(client)
        pipe.zscore(key, "p1")
        assert await pipe.execute() == [5.0]
        # Only MOVED is followed by redis-py's way, which updates the map: the next batch goes
        # straight to the new owner instead of being redirected on every call.
        assert client.nodes_manager.get_node_from_slot(slot_of(key)).port == target


async def test_the_redirects_after_a_move_leave_the_connections_of_calls_in_flight_open(
    moving_cluster: LocalCluster, client: RedisCluster
) -> None:
    moved = [f"lb:{{{keys.slot_tokens()[110 + i]}}}:in-flight" for i in range(6)]
    for key in moved:
        await client.set(key, "v")
    source, target = ends(client, moved[0])
    for key in moved:
        finish(moving_cluster, slot_of(key), source, target)
    # A per-node pipeline (shardlb/fanout.py) holds a connection of the source while it waits for
    # its replies. redis-py's default, on every 5th MOVED, closes every connection of every node
    # (RedisCluster.aclose) to reload the slot map: calls in flight then fail half-read
    # (AttributeError, RuntimeError, ConnectionError) all through a rebalance.
    source_node = client.get_node(moving_cluster.host, source)
    assert source_node is not None
    in_flight = source_node.acquire_connection()
    await in_flight.connect()
    try:
        assert [await client.get(key) for key in moved] == ["v"] * len(moved)  # each after a MOVED
        assert in_flight.is_connected
    finally:
        source_node.release(in_flight)


async def test_a_write_is_refused_with_a_503_while_its_shards_slot_is_open_and_applied_once_after(
    moving_cluster: LocalCluster, client: RedisCluster
) -> None:
    scripts = Scripts.register(client)
    await scripts.load(client)
    store = BoardStore(client, scripts)
    board, _ = await store.create(
        BoardConfig.from_dict(f"open-{os.urandom(3).hex()}", {"mode": "incr", "sharding": {"shards": 1}})
    )
    [prefix] = board.prefixes
    await board.submit([Score("a", 1, "m0")])
    source, target = ends(client, prefix)
    slot = slot_of(prefix)
    open_slot(moving_cluster, slot, source, target)
    try:
        # write.lua names its shard's `gone` marker, which never exists: with a key missing, a
        # script of several keys gets TRYAGAIN on the source, and on the target even with ASKING.
        with pytest.raises(Exception) as refused:
            await board.submit([Score("b", 1, "m1")])
        api = to_api_error(refused.value)
        assert (api.status, api.code) == (503, "cluster_unavailable"), refused.value
    finally:
        finish(moving_cluster, slot, source, target)
    assert client.nodes_manager.get_node_from_slot(slot).port == source  # its map is stale: MOVED next
    [result] = await board.submit([Score("b", 1, "m1")])  # the client's retry, the same result
    again = await board.submit([Score("b", 1, "m1")])
    assert (result.status, again[0].status) == ("improved", "duplicate")
    assert {p: board.codec.decode(s)[0] for p, s in (await board.scores(["a", "b"])).items()} == {
        "a": 1,
        "b": 1,
    }


@pytest.fixture(scope="module")
async def moves(
    moving_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[list[dict[str, Any]]]:
    """Both cluster changes under writes and reads through one router: what each measured."""
    logs = Path(tmp_path_factory.mktemp("migration-logs"))
    port = free_port(server_port())
    with Router(moving_cluster.url, port, 1, logs / "router.log", chaos.router_env("primary")) as r:
        yield await migrate.run(r.url, moving_cluster, WRITE_S, 0, **LOAD)


@pytest.mark.parametrize("phase", migrate.PHASES)
async def test_no_acknowledged_result_is_lost_and_no_read_is_inexact_while_slots_move(
    moves: list[dict[str, Any]], phase: str
) -> None:
    [report] = [r for r in moves if r["phase"] == phase]
    assert report["slots_moved"] > 0 and report["keys_moved"] > 0, report  # the change was real
    assert report["acknowledged"] > 0 and report["unsettled_writes"] == 0, report
    assert (report["lost"], report["duplicates"]) == (0, 0), report
    assert report["reads_checked"] > 0 and report["reads_inexact"] == 0, report
    answered = {**report["write_statuses"], **report["read_statuses"]}
    assert set(answered) <= {"200", "503"}, report  # errors are at most retryable 503s
    assert isinstance(report["refused_s"], float), report  # recorded (a figure, not a bound)


@pytest.fixture(scope="module")
def replicated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Its tests kill a node and start it again on its port: no other worker's server may take the
    # port meanwhile (a CI run of 2026-12-05 found a router's search on the killed replica's port),
    # which tests/ports.py's ranges and slices rule out.
    port = node_ports(4)
    local = LocalCluster(2, 1, port, Path(tmp_path_factory.mktemp("migration-replicas")))
    local.up()
    try:
        yield local
    finally:
        local.down()


async def test_a_read_from_replicas_of_a_key_that_has_moved_still_finds_it(
    replicated_cluster: LocalCluster,
) -> None:
    """A replica holds no migration state: it serves a slot its master is moving and answers for a
    key that has left as if it did not exist. The batch checks that every key it read from a
    replica exists there, and reads from the primaries (following ASK) when one does not."""
    client = connect(replicated_cluster.url, read_from="replicas")
    await client.initialize()
    try:
        key = f"lb:{{{keys.slot_tokens()[104]}}}:replica-probe"
        await client.zadd(key, {"p1": 3})
        source, target = ends(client, key)
        slot = slot_of(key)
        with node(replicated_cluster, source) as s:
            s.execute_command("WAIT", 1, 2000)  # the replica has the key
        open_slot(replicated_cluster, slot, source, target)
        try:
            with node(replicated_cluster, source) as s:
                s.execute_command("MIGRATE", replicated_cluster.host, target, "", 0, 5000, "KEYS", key)
                s.execute_command("WAIT", 1, 2000)  # and has seen it leave
            pipe = batch(client, replicas=True)
            pipe.zscore(key, "p1")
            assert await pipe.execute() == [3.0]
        finally:
            finish(replicated_cluster, slot, source, target)
    finally:
        await client.aclose()


# -- a move waits for a replica of its target ---------------------------------------------------
#
# MIGRATE deletes the keys on the source as soon as the target has them, and the target's replica
# gets them later. A target that dies in between is replaced by a replica without them: a whole
# shard lost, results confirmed by SHARDLB_ACK=replica included. Each test below stops the target's
# replica (SIGSTOP: it stays connected and acknowledges nothing) for a moment, well under the node
# timeout (5 s).


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@dataclass
class Slot:
    """A slot of its own filled on its master, and the master and replica it is to move to."""

    number: int
    source: int
    target: int
    target_replica: int  # pid
    names: dict[str, str]  # kind -> key

    def on(self, cluster: LocalCluster, port: int) -> dict[str, Any]:
        """What the node on ``port`` holds under the slot's keys (asked with ASKING: a node importing
        the slot answers for it), read-only so a replica answers too; None for a key it redirects."""
        with node(cluster, port) as r:
            pipe = r.pipeline(transaction=False)
            pipe.execute_command("READONLY")
            for kind, key in self.names.items():
                pipe.execute_command("ASKING")
                if kind == "board":
                    pipe.zrange(key, 0, -1, withscores=True)
                elif kind == "journal":
                    pipe.xlen(key)
                else:
                    pipe.get(key)
            replies = pipe.execute(raise_on_error=False)[1:]
        values = [None if isinstance(v, redis.ResponseError) else v for v in replies[1::2]]
        return dict(zip(self.names, values, strict=True))

    def owner(self, cluster: LocalCluster) -> int:
        """The master serving the slot, as the source sees it."""
        with node(cluster, self.source) as r:
            known = slots.nodes(r)
        return next(
            port
            for port, info in known.items()
            if any(int(span[0]) <= self.number <= int(span[-1]) for span in info["slots"])
        )


def filled_slot(cluster: LocalCluster, number: int, players: int = 2000) -> Slot:
    tag = keys.slot_tokens()[number]
    status = cluster.status()
    source = next(n.port for n in status.nodes if any(a <= number <= b for a, b in n.slots))
    target = next(n.port for n in status.nodes if n.role == "master" and n.port != source)
    pid = next(n.pid for n in status.nodes if n.role == "replica" and n.master_port == target)
    assert pid is not None
    names = {"board": f"lb:{{{tag}}}:total", "journal": f"lb:{{{tag}}}:log", "count": f"lb:{{{tag}}}:logn"}
    with node(cluster, source) as r:
        r.zadd(names["board"], {f"p{i}": i for i in range(players)})
        r.xadd(names["journal"], {"n": players})
        r.set(names["count"], players)
        assert r.execute_command("WAIT", 1, 2000) == 1  # the source's replica has them
    return Slot(number, source, target, pid, names)


def waiting(cluster: LocalCluster, port: int) -> bool:
    """Whether a client of the node on ``port`` waits in WAIT (a move, for the replica)."""
    with node(cluster, port) as r:
        return any(c["cmd"] == "wait" for c in r.client_list())


def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.01)


def test_a_slot_move_hands_keys_over_only_once_a_replica_of_the_target_holds_them(
    replicated_cluster: LocalCluster,
) -> None:
    slot = filled_slot(replicated_cluster, 120)
    before = slot.on(replicated_cluster, slot.source)
    with ThreadPoolExecutor(1) as mover, stopped(slot.target_replica):
        moving = mover.submit(finish, replicated_cluster, slot.number, slot.source, slot.target)
        until(lambda: moving.done() or waiting(replicated_cluster, slot.target))
        time.sleep(0.3)  # time enough for a move that did not wait to delete and hand over
        # The replica cannot have them: the source keeps them, and the slot.
        assert slot.on(replicated_cluster, slot.source) == before
        assert slot.owner(replicated_cluster) == slot.source
        assert not moving.done()
    moving.result(timeout=10)  # once the replica runs again, the move ends
    assert slot.owner(replicated_cluster) == slot.target
    assert slot.on(replicated_cluster, slot.target) == before
    replica = next(
        n.port
        for n in replicated_cluster.status().nodes
        if n.role == "replica" and n.master_port == slot.target
    )
    assert slot.on(replicated_cluster, replica) == before
    with node(replicated_cluster, slot.source) as r:
        assert r.cluster("COUNTKEYSINSLOT", slot.number) == 0


def test_a_slot_move_gives_up_when_no_replica_of_the_target_answers_and_can_be_run_again(
    replicated_cluster: LocalCluster,
) -> None:
    slot = filled_slot(replicated_cluster, 121)
    before = slot.on(replicated_cluster, slot.source)
    with stopped(slot.target_replica), pytest.raises(ClusterError, match="replica"):
        slots.move(
            lambda p: node(replicated_cluster, p),
            replicated_cluster.host,
            [slots.Move(slot.number, slot.source, slot.target)],
            replica_wait_ms=300,
        )
    # Nothing left the source, and the slot is still open, as a move stopped half-way leaves it.
    assert slot.on(replicated_cluster, slot.source) == before
    assert slot.owner(replicated_cluster) == slot.source
    with node(replicated_cluster, slot.source) as r:
        [(_, info)] = [(p, i) for p, i in slots.nodes(r).items() if p == slot.source]
    assert {"slot": str(slot.number), "state": "migrating"}.items() <= info["migrations"][0].items()
    finish(replicated_cluster, slot.number, slot.source, slot.target)  # the same move again ends it
    assert slot.owner(replicated_cluster) == slot.target
    assert slot.on(replicated_cluster, slot.target) == before


def test_a_key_changed_or_deleted_on_the_source_while_its_copy_waits_for_the_replica_is_not_lost(
    replicated_cluster: LocalCluster,
) -> None:
    slot = filled_slot(replicated_cluster, 122)
    with ThreadPoolExecutor(1) as mover:
        with stopped(slot.target_replica):
            moving = mover.submit(finish, replicated_cluster, slot.number, slot.source, slot.target)
            until(lambda: moving.done() or waiting(replicated_cluster, slot.target))
            # The source still serves the keys it holds: a write there after the copy, and a delete.
            with node(replicated_cluster, slot.source) as r:
                r.zadd(slot.names["board"], {"late": 10**6})
                r.delete(slot.names["count"])
        moving.result(timeout=10)
    held = slot.on(replicated_cluster, slot.target)
    assert ("late", 10.0**6) in held["board"] and len(held["board"]) == 2001
    assert held["count"] is None  # deleted on the source: its early copy is gone too
    assert held["journal"] == 1


def test_a_key_deleted_on_the_source_and_written_on_the_target_while_being_copied_stops_the_move(
    replicated_cluster: LocalCluster,
) -> None:
    slot = filled_slot(replicated_cluster, 123)
    before = slot.on(replicated_cluster, slot.source)
    with ThreadPoolExecutor(1) as mover:
        with stopped(slot.target_replica):
            moving = mover.submit(finish, replicated_cluster, slot.number, slot.source, slot.target)
            until(lambda: moving.done() or waiting(replicated_cluster, slot.target))
            with node(replicated_cluster, slot.source) as r:
                r.delete(slot.names["count"])
            with node(replicated_cluster, slot.target) as r:  # a client the source sent there (ASK)
                pipe = r.pipeline(transaction=False)
                pipe.execute_command("ASKING")
                pipe.incr(slot.names["count"])
                pipe.execute()
        # Its copy was stale when that write came: neither dropping it nor keeping it is right.
        with pytest.raises(ClusterError, match="deleted on"):
            moving.result(timeout=10)
    assert slot.on(replicated_cluster, slot.target)["count"] == "2001"  # left for the operator
    assert slot.on(replicated_cluster, slot.source) == {**before, "count": None}
    finish(replicated_cluster, slot.number, slot.source, slot.target)
    assert slot.on(replicated_cluster, slot.target) == {**before, "count": "2001"}


def test_a_slot_move_still_waits_for_a_replica_the_cluster_marked_failed(
    replicated_cluster: LocalCluster,
) -> None:
    """A target whose only replica is killed and marked failed by the masters still refuses the
    move (a replica marked failed may come back and be promoted without the keys), saying how to
    remove one gone for good; the keys stay on the source. (Running the move again once a replica
    is back is the frozen-replica test's second half: this cluster is not durable, so bringing the
    killed node back forms it afresh.)"""
    slot = filled_slot(replicated_cluster, 124)
    before = slot.on(replicated_cluster, slot.source)
    gone = next(n.port for n in replicated_cluster.status().nodes if n.pid == slot.target_replica)
    os.kill(slot.target_replica, signal.SIGKILL)
    try:

        def marked_failed() -> bool:
            for port in (slot.source, slot.target):
                with node(replicated_cluster, port) as r:
                    if "fail" not in slots.nodes(r)[gone]["flags"].split(","):
                        return False
            return True

        until(marked_failed, timeout=60.0)
        with pytest.raises(ClusterError, match="CLUSTER FORGET"):
            slots.move(
                lambda p: node(replicated_cluster, p),
                replicated_cluster.host,
                [slots.Move(slot.number, slot.source, slot.target)],
                replica_wait_ms=300,
            )
        assert slot.on(replicated_cluster, slot.source) == before
    finally:
        replicated_cluster.up()
