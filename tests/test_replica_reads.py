"""Board reads served by replicas (SHARDLB_READ_FROM, connection.connect's read_from), on the suite's
cluster of 3 masters with a replica each.

Once the replicas have caught up, every read through a replica-reading store equals the reference
board (hash boards; a band board's tops and pages), and the replicas, not the primaries, served them:
their command counters grew by the reads' commands (counts.lua included, loaded there by
Scripts.load) while the primaries' did not grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from router.settings import Settings, SettingsError
from shardlb import fanout, times
from shardlb.board import Board, Entry, Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_ack import replica_pid
from tests.test_board import expected_entries

pytestmark = pytest.mark.cluster

READ_COMMANDS = ("zcount", "zrevrange", "zrevrank", "zscore", "zcard", "zmscore", "evalsha", "zrangebyscore")


@pytest.fixture
async def replica_store(cluster: LocalCluster) -> AsyncIterator[BoardStore]:
    client = connect(cluster.url, read_from="replicas")
    scripts = Scripts.register(client)
    await scripts.load(client)
    store = BoardStore(client, scripts)
    store.read_replicas = True
    yield store
    await client.aclose()


async def _calls(client: object, nodes: list[object]) -> int:
    """Read commands the nodes have run so far (INFO commandstats)."""
    total = 0
    for node in nodes:
        stats = await client.info("commandstats", target_nodes=node)  # type: ignore[attr-defined]
        total += sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in READ_COMMANDS)
    return total


async def _caught_up(client: object) -> None:
    """Until every replica has acknowledged what its primary had written when this was called
    (replicas acknowledge once a second; a primary's offset also grows by its pings)."""
    primaries = client.get_primaries()  # type: ignore[attr-defined]
    infos = await client.info("replication", target_nodes=primaries)  # type: ignore[attr-defined]
    wanted = {name: int(info["master_repl_offset"]) for name, info in infos.items()}
    for _ in range(200):
        infos = await client.info("replication", target_nodes=primaries)  # type: ignore[attr-defined]
        behind = [
            name
            for name, info in infos.items()
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict) and int(value["offset"]) < wanted[name]
        ]
        if not behind:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"replicas still behind: {behind}")


@pytest.mark.parametrize("shards", [3, 16])
async def test_reads_from_replicas_equal_the_reference(
    store: BoardStore, replica_store: BoardStore, shards: int
) -> None:
    config = BoardConfig.from_dict(
        f"replica-reads-{shards}", {"sharding": {"strategy": "hash", "shards": shards}}
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    rng = random.Random(shards)
    now = times.now_ms()
    scores = [
        Score(f"p{i:03d}", rng.choice([5, 10, 50, *range(0, 900, 7)]), f"m{i}", now) for i in range(150)
    ]
    try:
        reader, want = await _written_then_read_from_replicas(board, ref, scores, replica_store)
        client = replica_store.client
        assert reader.read_replicas
        primaries, replicas = client.get_primaries(), client.get_replicas()
        assert replicas, "the suite's cluster has a replica per master"
        before = (await _calls(client, primaries), await _calls(client, replicas))
        assert await reader.top(40) == want[:40]
        for e in rng.sample(want, 25):
            got = await reader.player(e.player_id)
            assert (got.entry, got.players) == (e, len(want))
            lo = max(0, e.rank - 4)
            assert await reader.around(e.player_id, 3) == want[lo : e.rank + 3]
        reader.shallow = 0
        assert await reader.entries(77, 9) == want[77:86]
        ids = [e.player_id for e in rng.sample(want, 30)]
        assert await reader.query(ids) == [e for e in want if e.player_id in ids]
        after = (await _calls(client, primaries), await _calls(client, replicas))
        served = after[1] - before[1]
        assert served > 25 * 3, "the replicas served the reads"
        # Only INFO itself and nothing of the reads reached the primaries (INFO is not counted here).
        assert after[0] == before[0]
    finally:
        await store.delete(config.id)


async def test_band_tops_and_pages_from_replicas(store: BoardStore, replica_store: BoardStore) -> None:
    """A band board's total reads its top and deep pages band by band, best band first: those reads
    go to the replicas too, and equal the reference."""
    config = BoardConfig.from_dict(
        "replica-band-reads", {"sharding": {"strategy": "band", "bands": [0, 50, 100], "shards": 3}}
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    scores = [Score(f"p{i:03d}", i % 150, f"m{i}", now) for i in range(300)]
    try:
        reader, want = await _written_then_read_from_replicas(board, ref, scores, replica_store)
        client = replica_store.client
        primaries = client.get_primaries()
        before = await _calls(client, primaries)
        assert await reader.top(250) == want[:250]  # rows of all three bands
        reader.shallow = 0
        assert await reader.entries(120, 50) == want[120:170]  # across two bands
        assert await _calls(client, primaries) == before
    finally:
        await store.delete(config.id)


async def test_a_replica_that_lost_its_scripts_serves_script_reads_again(
    store: BoardStore, replica_store: BoardStore
) -> None:
    """A failover audit's finding: a replica started again (a primary killed and back as its
    successor's replica, or any restart) has an empty script cache. near.lua, places.lua and
    counts.lua answered NOSCRIPT there, the read fell back to the primaries, and nothing loaded them
    again: until the router restarted, every such read went to the replica and then to the primary.
    The first NOSCRIPT from a replica now loads the script there, so the next reads stay on it."""
    config = BoardConfig.from_dict("replica-noscript", {"sharding": {"strategy": "hash", "shards": 3}})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    scores = [Score(f"p{i:03d}", (i * 37) % 500, f"m{i}", now) for i in range(90)]
    client = replica_store.client
    try:
        reader, want = await _written_then_read_from_replicas(board, ref, scores, replica_store)
        await client.execute_command("SCRIPT FLUSH", target_nodes=client.get_replicas())
        primaries = client.get_primaries()
        asked = want[::9]
        for attempt in ("first", "again"):
            before = await _calls(client, primaries)
            for e in asked:
                lo = max(0, e.rank - 3)
                assert await reader.around(e.player_id, 2) == want[lo : e.rank + 2]
            ids = [e.player_id for e in asked]
            assert await reader.query(ids) == asked
            if attempt == "again":
                assert await _calls(client, primaries) == before, "the primaries served the reads"
    finally:
        await replica_store.scripts.load(client)  # the replicas' scripts, as the other tests expect
        await store.delete(config.id)


def test_read_from_is_one_of_its_values() -> None:
    for value in ("primary", "replicas", "any"):
        Settings(read_from=value, insecure_dev=True).check()
    with pytest.raises(SettingsError, match="SHARDLB_READ_FROM"):
        Settings(read_from="replica", insecure_dev=True).check()


async def test_a_key_a_replica_lacks_is_read_from_its_primary(replica_store: BoardStore) -> None:
    """A replica answers for a key it does not hold (one its primary moved away, or that has not
    reached it yet) as for an empty key. Each key read from a replica is checked by an EXISTS after
    its reads; a 0 sends the whole batch to the primaries. The key is written through the primary
    only after the replica was asked, so the replica's answer is 0 and the primaries' answer is the
    batch's."""
    client = replica_store.client
    present, missing = "replica-check:{a}", "replica-check:{b}"
    await client.delete(present, missing)
    await client.zadd(present, {"m1": 1.0, "m2": 2.0})
    await _caught_up(client)
    for last in ("zcard", "zscore"):
        batch = fanout.batch(client, replicas=True)
        batch.zcount(present, "-inf", "+inf")
        batch.zscore(missing, "m1")
        batch.zcard(missing) if last == "zcard" else batch.zscore(missing, "m2")
        outcomes = await batch.outcomes()
        assert len(outcomes) == 1 and type(outcomes[0]).__name__ == "_KeyNotOnReplica"
        await client.zadd(missing, {"m1": 5.0, "m2": 6.0})  # on the primary; the replica may lag
        again = fanout.batch(client, replicas=True)
        again.zcount(present, "-inf", "+inf")
        again.zscore(missing, "m1")
        again.zcard(missing) if last == "zcard" else again.zscore(missing, "m2")
        got = await again.execute()
        assert got == [2, 5.0, 2 if last == "zcard" else 6.0]
        await client.delete(missing)
        await _caught_up(client)


async def _written_then_read_from_replicas(
    board: Board, ref: ReferenceBoard, scores: list[Score], replica_store: BoardStore
) -> tuple[Board, list[Entry]]:
    """``scores`` written through ``board`` and its reference, replicated: the board as a store
    reading from replicas has it, and the reference's entries."""
    now = times.now_ms()
    await board.submit(scores, now_ms=now)
    ref.submit(scores, now_ms=now)
    await _caught_up(replica_store.client)
    return await replica_store.get(board.config.id), expected_entries(ref, "total", None)


@pytest.fixture
def shunned_forgotten() -> Iterator[None]:
    """Replicas shunned by a test are asked again by the next one (they were only stopped or cut off
    for the test)."""
    yield
    fanout._SHUNNED.clear()
    fanout._LINK_DOWN_SINCE.clear()


async def test_a_stalled_replica_is_left_alone_after_one_read(
    cluster: LocalCluster, store: BoardStore, shunned_forgotten: None
) -> None:
    """A replica that takes connections and answers nothing (SIGSTOP, a hung host) held every board
    read sent to it for the client's socket timeout, then the read went to the primaries: every
    read, for as long as it hung, since nothing made the router stop choosing it. Now the read that
    finds it stalled shuns it: the next reads go to its primary at once, and stay exact."""
    timeout = 1.0
    client = connect(cluster.url, read_from="replicas", timeout=timeout)
    scripts = Scripts.register(client)
    await scripts.load(client)
    replicas = BoardStore(client, scripts)
    replicas.read_replicas = True
    config = BoardConfig.from_dict("replica-stalled", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    scores = [Score(f"p{i:02d}", i * 3, f"m{i}", now) for i in range(40)]
    try:
        reader, want = await _written_then_read_from_replicas(board, ref, scores, replicas)
        with _stopped(replica_pid(cluster, config.id)):
            took = []
            for e in want[::8]:
                start = time.monotonic()
                got = await reader.player(e.player_id)
                took.append(time.monotonic() - start)
                assert (got.entry, got.players) == (e, len(want))
        assert took[0] >= timeout  # the first read did wait for the stopped replica
        assert max(took[1:]) < timeout / 2, took  # the others did not ask it again
    finally:
        await store.delete(config.id)
        await client.aclose()


async def test_a_replica_cut_off_from_its_primary_for_long_serves_no_reads(
    cluster: LocalCluster,
    store: BoardStore,
    replica_store: BoardStore,
    shunned_forgotten: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica whose link to its primary is down keeps answering reads from what it had (Redis's
    replica-serve-stale-data): a player's rank stayed the one of before the link broke, however
    long ago. Each replica is cut off here by a wrong masterauth (its primary refuses it at once)
    for longer than ``fanout.STALE_LINK_S`` (shortened); scores written then must show in reads
    through the replica-reading store."""
    monkeypatch.setattr(fanout, "STALE_LINK_S", 0.5)
    config = BoardConfig.from_dict("replica-cut-off", {"sharding": {"strategy": "hash", "shards": 3}})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    first = [Score(f"p{i:02d}", i, "m1", now) for i in range(30)]
    replica_ports = [n.port for n in cluster.status().nodes if n.role == "replica"]
    try:
        await _written_then_read_from_replicas(board, ref, first, replica_store)
        with _cut_off(cluster, replica_ports):
            await asyncio.sleep(1.0)
            later = [Score(f"p{i:02d}", 100 + i, "m2", now) for i in range(30)]
            await board.submit(later, now_ms=now)
            ref.submit(later, now_ms=now)
            want = expected_entries(ref, "total", None)
            reader = await replica_store.get(config.id)
            assert await reader.top(10) == want[:10]
            got = await reader.player("p00")
            assert (got.entry, got.players) == (want[-1], len(want))
    finally:
        await store.delete(config.id)


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)  # well under the node timeout: the cluster still counts it healthy
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def _cut_off(cluster: LocalCluster, ports: list[int]) -> Iterator[None]:
    """The replicas on ``ports`` with their replication link down for the block (their primaries
    require no password, so one given makes the handshake fail), then back in sync."""
    nodes = [redis.Redis(host=cluster.host, port=port, decode_responses=True) for port in ports]
    try:
        for node in nodes:
            node.config_set("masterauth", "not-the-password")
            node.execute_command("CLIENT KILL TYPE master")
        deadline = time.monotonic() + 10
        while any(n.info("replication")["master_link_status"] != "down" for n in nodes):
            assert time.monotonic() < deadline, "the replicas kept their links"
            time.sleep(0.05)
        yield
    finally:
        for node in nodes:
            node.config_set("masterauth", "")
        deadline = time.monotonic() + 30
        while any(n.info("replication")["master_link_status"] != "up" for n in nodes):
            assert time.monotonic() < deadline, "the replicas did not resynchronise"
            time.sleep(0.1)
        for node in nodes:
            node.close()
