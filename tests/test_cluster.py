"""Tests of the local cluster manager (`shardlb/cluster.py`) and its CLI, on real redis-server nodes."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from shardlb.board import Score
from shardlb.cli import main
from shardlb.cluster import ClusterError, ClusterStatus, LocalCluster, free_port_block, master_slots
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.keys import SLOTS
from shardlb.store import BoardStore
from tests.ports import node_ports

PASSWORD = "dur-able/pass"  # a / to show the URL percent-encodes it


def _free_ports(count: int) -> int:
    return node_ports(count)  # this process's own ports, as every test's (tests/ports.py)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(status: ClusterStatus) -> list[int]:
    pids = [n.pid for n in status.nodes if n.pid is not None]
    assert len(pids) == len(status.nodes)
    return pids


def _wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for a test's own cluster; whatever was started there is stopped afterwards."""
    yield tmp_path
    LocalCluster(dir=tmp_path).down()


@pytest.fixture
def listener() -> Iterator[int]:
    """A port on 127.0.0.1 held by a listening socket that is not a Redis node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", _free_ports(1)))
        s.listen()
        yield s.getsockname()[1]


# -- no server needed ---------------------------------------------------------------------------


@pytest.mark.parametrize("masters", [1, 2, 3, 5, 7, 16])
def test_master_slots_cover_all_slots_evenly_in_order(masters: int) -> None:
    ranges = master_slots(masters)
    assert ranges[0][0] == 0 and ranges[-1][1] == SLOTS - 1
    assert all(nxt[0] == cur[1] + 1 for cur, nxt in itertools.pairwise(ranges))
    sizes = {last - first + 1 for first, last in ranges}
    assert max(sizes) - min(sizes) <= 1


def test_master_slots_for_three_masters() -> None:
    assert master_slots(3) == [(0, 5460), (5461, 10921), (10922, 16383)]


def test_ports_and_url_list_every_node() -> None:
    local = LocalCluster(masters=2, replicas=2, port=9000)
    assert local.ports == list(range(9000, 9006))
    assert local.url == "redis://" + ",".join(f"127.0.0.1:{p}" for p in range(9000, 9006))


def test_a_cluster_never_takes_6379() -> None:
    with pytest.raises(ClusterError, match="6379"):
        LocalCluster(port=6376)
    base = free_port_block(4, start=6377)
    assert not base <= 6379 < base + 4


def test_free_port_block_skips_a_taken_port(listener: int) -> None:
    assert free_port_block(3, start=listener) > listener
    assert not listener - 2 <= free_port_block(3, start=listener - 2) <= listener


def test_free_port_block_skips_a_taken_bus_port(listener: int) -> None:
    assert free_port_block(1, start=listener - 10000) != listener - 10000


def test_up_without_redis_server_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ClusterError, match="redis-server not found"):
        LocalCluster(port=_free_ports(6), dir=tmp_path / "c").up()


def test_up_refuses_a_port_taken_by_another_process(tmp_path: Path, listener: int) -> None:
    with pytest.raises(ClusterError, match=f"port {listener} .* taken"):
        LocalCluster(masters=1, replicas=0, port=listener, dir=tmp_path).up()
    assert not (tmp_path / "state.json").exists()


def test_down_leaves_a_recorded_pid_alone_once_it_is_not_a_node(tmp_path: Path) -> None:
    # A pid from an old state file may now belong to anything: down() must not kill it.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        state = {"host": "127.0.0.1", "port": 9000, "masters": 1, "replicas": 0}
        (tmp_path / "state.json").write_text(
            json.dumps({**state, "nodes": [{"port": 9000, "pid": other.pid}]})
        )
        local = LocalCluster.from_state(tmp_path)
        local.down()
        assert other.poll() is None
        assert not local.status().nodes[0].running
    finally:
        other.kill()
        other.wait()


# -- real redis-server nodes --------------------------------------------------------------------


@pytest.mark.cluster
def test_session_cluster_is_three_masters_with_a_replica_each(cluster: LocalCluster) -> None:
    status = cluster.status()
    assert status.ok, status
    masters, replicas = status.nodes[:3], status.nodes[3:]
    assert [n.role for n in masters] == ["master"] * 3
    assert [n.slots for n in masters] == [[r] for r in master_slots(3)]
    assert [(n.role, n.master_port, n.link) for n in replicas] == [
        ("replica", cluster.port + i, "up") for i in range(3)
    ]
    assert {n.cluster_state for n in status.nodes} == {"ok"}
    assert "cluster ok" in str(status)


@pytest.mark.cluster
def test_session_cluster_serves_keys_in_every_slot_range(cluster: LocalCluster) -> None:
    with redis.RedisCluster(host=cluster.host, port=cluster.port, decode_responses=True) as client:
        keys = [f"k{i}" for i in range(30)]
        for key in keys:
            client.set(key, key)
        assert [client.get(key) for key in keys] == keys
        assert len({client.keyslot(key) * 3 // SLOTS for key in keys}) == 3


@pytest.mark.cluster
def test_up_again_changes_nothing(cluster: LocalCluster) -> None:
    state_before = (cluster.dir / "state.json").read_text()
    pids_before = [n.pid for n in cluster.status().nodes]
    status = cluster.up()
    assert status.ok
    assert [n.pid for n in status.nodes] == pids_before
    assert (cluster.dir / "state.json").read_text() == state_before


@pytest.mark.cluster
def test_up_restarts_a_cluster_with_a_dead_node_and_down_stops_it(
    cluster: LocalCluster, cluster_dir: Path
) -> None:
    local = LocalCluster(masters=2, replicas=1, port=_free_ports(4), dir=cluster_dir)
    first = _pids(local.up())

    os.kill(first[0], signal.SIGKILL)
    _wait_until(lambda: not local.status().nodes[0].running)
    broken = local.status()
    assert not broken.ok
    assert f"node {local.port}: not running" in broken.problems

    second = _pids(local.up())
    assert local.status().ok
    assert not set(first) & set(second)
    assert not any(_alive(pid) for pid in first)

    session_pids = [n.pid for n in cluster.status().nodes]
    local.down()
    assert not any(_alive(pid) for pid in second)
    after = local.status()
    assert not after.ok
    assert not any(n.running for n in after.nodes)
    # Only the pids of this cluster were stopped: the session cluster is untouched.
    assert cluster.status().ok
    assert [n.pid for n in cluster.status().nodes] == session_pids


@pytest.mark.cluster
def test_up_of_a_stopped_durable_cluster_names_a_port_another_process_took(cluster_dir: Path) -> None:
    """A durable cluster keeps its data on its ports: up() cannot move it, so it says which port is
    taken and keeps the files (it used to start the nodes and fail with one's 'exited with code 1')."""
    local = LocalCluster(masters=1, replicas=1, port=_free_ports(2), dir=cluster_dir, durable=True)
    local.up()
    local.down()
    with socket.socket() as other:
        # The node just stopped leaves its connections in TIME_WAIT: bound as redis-server binds.
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", local.port + 1))
        other.listen()
        with pytest.raises(ClusterError, match=f"port {local.port + 1} .* is taken") as raised:
            local.up()
    assert "keeps its data" in str(raised.value)
    assert not any(n.running for n in local.status().nodes)
    assert (cluster_dir / f"node-{local.port}" / "nodes.conf").exists()
    assert local.up().ok  # once the port is free again, the cluster starts from its files


@pytest.mark.cluster
def test_up_timeout_names_the_wait_shows_the_log_and_leaves_nothing_running(cluster_dir: Path) -> None:
    local = LocalCluster(masters=1, replicas=0, port=_free_ports(1), dir=cluster_dir)
    with pytest.raises(ClusterError, match="timed out waiting for") as raised:
        local.up(timeout=0.2)
    assert "redis.log" in str(raised.value)
    assert not any(n.running for n in local.status().nodes)


@pytest.mark.cluster
def test_cli_counts_one_node_as_one(cluster_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`shardlb cluster status` and `down` of a one-node cluster said "1 nodes, 1 masters" and "1 nodes
    stopped" (until 2026-12-06)."""
    where = ["--dir", str(cluster_dir)]
    one = ["--masters", "1", "--replicas", "0", "--port", str(_free_ports(1))]
    assert main(["cluster", "up", *one, *where]) == 0
    assert "cluster ok: 1 node, 1 master\n" in capsys.readouterr().out
    assert main(["cluster", "down", *where]) == 0
    assert "1 node stopped" in capsys.readouterr().out


@pytest.mark.cluster
def test_cli_up_status_down(cluster_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = _free_ports(2)
    where = ["--dir", str(cluster_dir)]
    assert main(["cluster", "up", "--masters", "1", "--replicas", "1", "--port", str(base), *where]) == 0
    out = capsys.readouterr().out
    assert "cluster ok" in out
    assert out.splitlines()[-1] == f"SHARDLB_REDIS_URL=redis://127.0.0.1:{base},127.0.0.1:{base + 1}"

    assert main(["cluster", "status", *where]) == 0
    # "1 masters" until 2026-12-06
    assert "cluster ok: 2 nodes, 1 master\n" in capsys.readouterr().out

    assert main(["cluster", "down", *where]) == 0
    assert "2 nodes stopped" in capsys.readouterr().out
    assert main(["cluster", "status", *where]) == 1
    assert f"node {base}: not running" in capsys.readouterr().out
    # Again, with nothing running (`make stop` twice): said so, not "stopped" (an ops audit's finding).
    assert main(["cluster", "down", *where]) == 0
    assert "not running" in capsys.readouterr().out


def test_cli_reports_a_cluster_error_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster", "status", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardlb: error: no cluster state in") and err.count("\n") == 1


def test_python_m_shardlb_runs_the_cli(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "shardlb", "cluster", "down", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "nothing to stop" in done.stdout


@pytest.mark.cluster
async def test_a_durable_cluster_keeps_its_boards_across_a_stop_and_start_of_every_node(
    cluster_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cluster up --durable --password`: AOF on, data kept across a restart; the nodes require the
    password, which the router takes from SHARDLB_REDIS_PASSWORD (``connect(password=)``)."""
    base = _free_ports(2)
    where = ["--dir", str(cluster_dir)]
    up = ["cluster", "up", "--masters", "1", "--replicas", "1", "--port", str(base), "--durable", *where]
    assert main([*up, "--password", PASSWORD]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"SHARDLB_REDIS_URL=redis://:dur-able%2Fpass@127.0.0.1:{base},127.0.0.1:{base + 1}"
    )
    local = LocalCluster.from_state(cluster_dir)
    first = _pids(local.status())
    url = f"redis://127.0.0.1:{base}"
    try:
        with pytest.raises(redis.AuthenticationError), redis.Redis(port=base) as anonymous:
            anonymous.ping()
        config = BoardConfig.from_dict("kept", {"mode": "incr", "sharding": {"shards": 4}})
        store = await _store(url)
        board, _ = await store.create(config)
        await board.submit([Score(f"p{i}", i, "m1") for i in range(1, 41)])
        want = await board.top(40)
        await store.client.aclose()

        assert main(["cluster", "down", *where]) == 0
        assert not any(_alive(pid) for pid in first)
        assert main([*up, "--password", PASSWORD]) == 0
        second = _pids(LocalCluster.from_state(cluster_dir).status())
        assert not set(first) & set(second)

        store = await _store(url)
        assert await (await store.get("kept")).top(40) == want
        await store.client.aclose()
    finally:
        main(["cluster", "down", *where])


async def _store(url: str) -> BoardStore:
    client = connect(url, password=PASSWORD)
    scripts = Scripts.register(client)
    await scripts.load(client)
    return BoardStore(client, scripts)


@pytest.mark.cluster
def test_cli_add_node_rebalance_and_remove_node_keep_every_board_row(
    cluster_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _free_ports(2)
    where = ["--dir", str(cluster_dir)]
    assert main(["cluster", "up", "--masters", "2", "--replicas", "0", "--port", str(base), *where]) == 0

    async def board(write: bool) -> int:
        client = connect(f"redis://127.0.0.1:{base + 1}")  # a master that stays
        scripts = Scripts.register(client)
        await scripts.load(client)
        store = BoardStore(client, scripts)
        try:
            if write:
                b, _ = await store.create(BoardConfig.from_dict("grow", {"sharding": {"shards": 8}}))
                await b.submit([Score(str(i), i + 1, f"m{i}") for i in range(100)])
            return await (await store.get("grow")).size()
        finally:
            await client.aclose()

    assert asyncio.run(board(write=True)) == 100
    capsys.readouterr()
    assert main(["cluster", "add-node", "--replicas", "1", "--rebalance", *where]) == 0
    out = capsys.readouterr().out
    added = int(out.split("added master ")[1].split()[0])
    assert "rebalanced: 5461 slots" in out

    assert main(["cluster", "status", *where]) == 0
    out = capsys.readouterr().out
    assert "cluster ok: 4 nodes, 3 masters" in out
    table = out.split("shards per master:")[1].splitlines()
    assert table[1].split()[1:] == [str(base), str(base + 1), str(added)]
    counts = [int(n) for n in table[2].split()[1:]]
    assert table[2].split()[0] == "grow" and sum(counts) == 8 and min(counts) > 0

    assert main(["cluster", "remove-node", str(base), *where]) == 0
    assert main(["cluster", "status", *where]) == 0
    out = capsys.readouterr().out
    assert "cluster ok: 3 nodes, 2 masters" in out and f"\n  {base} " not in out
    assert asyncio.run(board(write=False)) == 100
