"""`make bench-scale`: a 10M-player board on 16 shards; memory per player and read latency at 1M
and at 10M players. Long (minutes) and not part of CI.

    SHARDLB_SCALE_PLAYERS=10000000 python -m bench.scale

Loading: ZADD of 2000 members per call straight onto the shard keys, pipelined, in several processes
(bench/population.py explains why that is the same state as writing through the library). Memory
per player is INFO used_memory summed over the masters, after minus before, over players loaded.
Latency: one caller through the library, one read at a time (no queueing), SHARDLB_SCALE_SAMPLES
reads of each kind: rank, top-100, around (radius 5) and a page of 100 at offset 5M (at a board
smaller than that: at half the board; the offset used is recorded).

Settings: SHARDLB_SCALE_PLAYERS (10000000), SHARDLB_SCALE_SHARDS (16), SHARDLB_SCALE_MASTERS (3),
SHARDLB_SCALE_REPLICAS (0: memory is counted on masters; replicas would only slow the load),
SHARDLB_SCALE_SAMPLES (200), SHARDLB_SCALE_PROCESSES (2, loaders).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import sys
import time
from dataclasses import replace
from typing import Any

from bench import plots, population
from bench.harness import env_int, log, publish, run_dir
from bench.latency import percentile
from bench.testbed import create_board, machine, masters_memory, start_cluster
from bench.workload import Workload
from shardlb.board import Board
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore

PAGE_OFFSET = 5_000_000
CHECKPOINT = 1_000_000


def checkpoints(players: int) -> list[int]:
    """Where to measure: at 1M and at the full size (or a tenth and the full size when smaller)."""
    first = CHECKPOINT if players > CHECKPOINT else max(1, players // 10)
    return [first, players] if first < players else [players]


async def latencies(board: Board, workload: Workload, players: int, samples: int) -> dict[str, Any]:
    """p50/p99 (ms) of each read kind, one at a time, over players p0..p<players-1>."""
    rng = random.Random(11)
    offset = PAGE_OFFSET if players > PAGE_OFFSET + 100 else players // 2
    loaded = replace(workload, players=players)

    async def rank() -> None:
        await board.player(loaded.player(rng))

    async def top() -> None:
        await board.top(100)

    async def around() -> None:
        await board.around(loaded.player(rng), 5)

    async def page() -> None:
        await board.entries(offset, 100)

    out: dict[str, Any] = {"page_offset": offset}
    for name, call in (("rank", rank), ("top-100", top), ("around", around), ("page", page)):
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await call()
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        out.setdefault("latency_ms", {})[name] = {
            "p50": round(percentile(times, 50), 2),
            "p99": round(percentile(times, 99), 2),
        }
    return out


async def measure(url: str, workload: Workload, players: int, samples: int) -> dict[str, Any]:
    client = connect(url)
    try:
        scripts = Scripts.register(client)
        await scripts.load(client)
        board = await BoardStore(client, scripts).get(workload.board)
        return await latencies(board, workload, players, samples)
    finally:
        await client.aclose()


def markdown(result: dict[str, Any]) -> str:
    ops = list(result["points"][0]["latency_ms"])
    lines = [
        f"# shardlb bench-scale {result['name']}",
        "",
        f"Machine: {result['machine']['cpus']} CPUs, {result['machine']['memory_gb']} GB; "
        f"{result['masters']} "
        f"masters, {result['replicas']} replicas, one board of {result['shards']} hash shards.",
        "",
        "| players | bytes/player | load s | page offset | "
        + " | ".join(f"{op} p50 / p99 ms" for op in ops)
        + " |",
        "|---:|---:|---:|---:|" + "---|" * len(ops),
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['players']:,} | {p['bytes_per_player']} | {p['load_s']} | {p['page_offset']:,} | "
            + " | ".join(f"{p['latency_ms'][op]['p50']} / {p['latency_ms'][op]['p99']}" for op in ops)
            + " |"
        )
    lines += [
        "",
        "Latency: one caller through the library (no HTTP), one read at a time; the page offset is "
        "5M where the board holds that many players, else half the board.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    players = env_int("SHARDLB_SCALE_PLAYERS", 10_000_000)
    shards = env_int("SHARDLB_SCALE_SHARDS", 16)
    masters = env_int("SHARDLB_SCALE_MASTERS", 3)
    replicas = int(os.environ.get("SHARDLB_SCALE_REPLICAS", "0") or 0)
    samples = env_int("SHARDLB_SCALE_SAMPLES", 200)
    processes = env_int("SHARDLB_SCALE_PROCESSES", 2)
    workload = replace(Workload.from_env(), board="scale", players=players)
    name = time.strftime("scale-%Y%m%d-%H%M%S")
    out = run_dir(name)
    result: dict[str, Any] = {
        "name": name,
        "machine": machine(),
        "masters": masters,
        "replicas": replicas,
        "shards": shards,
        "players": players,
        "points": [],
    }
    cluster = start_cluster(masters, replicas, out / "cluster", start=22100)
    try:
        asyncio.run(create_board(cluster.url, workload, shards))
        base = asyncio.run(masters_memory(cluster.url))
        loaded = 0
        for target in checkpoints(players):
            log(f"loading players {loaded:,}..{target:,} with {processes} processes")
            seconds = population.load_parallel(cluster.url, workload, loaded, target, processes)
            loaded = target
            used = asyncio.run(masters_memory(cluster.url))
            log(f"{loaded:,} players in memory: {(used - base) / loaded:.1f} bytes each; measuring reads")
            point = {
                "players": loaded,
                "load_s": round(seconds, 1),
                "used_memory": used - base,
                "bytes_per_player": round((used - base) / loaded, 1),
                **asyncio.run(measure(cluster.url, workload, loaded, samples)),
            }
            result["points"].append(point)
            log(f"{loaded:,}: {point['latency_ms']}")
    finally:
        cluster.down()
        shutil.rmtree(out / "cluster", ignore_errors=True)
    (out / "scale.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "scale.md").write_text(markdown(result))
    plots.latency_vs_players(result, out / "latency_players.png")
    publish(out, ("scale.json", "scale.md", "latency_players.png"))
    print((out / "scale.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
