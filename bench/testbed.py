"""What a bench run stands up and inspects: the local cluster, the board and its preloaded players,
PostgreSQL's copy of them, and the machine itself."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import peers, population
from bench.services import MAX_NODE_PORT
from bench.workload import Workload
from shardlb.cluster import STATE_FILE, LocalCluster, free_port_block
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore


def node_pids(cluster: LocalCluster) -> tuple[list[int], list[int]]:
    """(master pids, replica pids) from the cluster's state file (masters take the first ports)."""
    state = json.loads((cluster.dir / STATE_FILE).read_text())
    pid = {int(n["port"]): int(n["pid"]) for n in state["nodes"]}
    return [pid[p] for p in cluster.ports[: cluster.masters]], [
        pid[p] for p in cluster.ports[cluster.masters :]
    ]


def postgres_pids() -> list[int]:
    """The PostgreSQL server's processes on this machine (read-only: their CPU is metered, nothing else)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def start_cluster(masters: int, replicas: int, dir: Path, start: int) -> LocalCluster:
    count = masters * (1 + replicas)
    base = free_port_block(count, start=start)
    if base + count - 1 > MAX_NODE_PORT:
        raise SystemExit(f"no {count} free ports below {MAX_NODE_PORT} for the cluster")
    cluster = LocalCluster(masters=masters, replicas=replicas, port=base, dir=dir)
    cluster.up()
    return cluster


async def masters_memory(url: str) -> int:
    """Sum of INFO used_memory over the masters."""
    client = connect(url)
    try:
        info = await client.info("memory", target_nodes=client.PRIMARIES)
        return sum(int(node["used_memory"]) for node in info.values())
    finally:
        await client.aclose()


async def create_board(
    url: str,
    workload: Workload,
    shards: int,
    durability: str = "memory",
    sharding: dict[str, Any] | None = None,
) -> None:
    """The bench's board: ``shards`` hash shards, or the ``sharding`` given. ``memory`` unless asked:
    the main phases measure the index itself, as the rivals keep no journal either;
    bench/durability.py measures the journal beside it."""
    client = connect(url)
    try:
        scripts = Scripts.register(client)
        await scripts.load(client)
        settings = {"sharding": sharding or {"strategy": "hash", "shards": shards}, "durability": durability}
        config = BoardConfig.from_dict(workload.board, settings)
        await BoardStore(client, scripts).create(config)
    finally:
        await client.aclose()


def preload(url: str, workload: Workload, processes: int) -> dict[str, Any]:
    """Load the population into the board, then into the textbook set; memory per player of each."""
    before = asyncio.run(masters_memory(url))
    board_s = population.load_parallel(url, workload, 0, workload.players, processes)
    middle = asyncio.run(masters_memory(url))
    key = peers.textbook_key(workload.board)
    textbook_s = population.load_parallel(url, workload, 0, workload.players, processes, key)
    after = asyncio.run(masters_memory(url))
    return {
        "players": workload.players,
        "board_load_s": round(board_s, 1),
        "textbook_load_s": round(textbook_s, 1),
        "board_bytes_per_player": round((middle - before) / workload.players, 1),
        "textbook_bytes_per_player": round((after - middle) / workload.players, 1),
    }


def pg_preload(dsn: str, workload: Workload, url: str) -> dict[str, Any]:
    """Runs in its own process, beside the Redis preload."""

    async def go() -> dict[str, Any]:
        reason = await peers.pg_available(dsn)
        if reason:
            return {"skipped": reason}
        client = connect(url)
        try:
            board = await BoardStore(client, Scripts.register(client)).get(workload.board)
        finally:
            await client.aclose()
        t0 = time.perf_counter()
        await peers.pg_load(dsn, workload.board, board.codec, workload)
        return {"load_s": round(time.perf_counter() - t0, 1)}

    return asyncio.run(go())


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except OSError:
        mem_kb = 0
    redis_version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gb": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "redis": redis_version,
    }
