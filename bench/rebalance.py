"""`make bench-rebalance`: what drawing a band board's band starts again buys once its scores moved.

    python -m bench.rebalance      # ~1 min: its own cluster; SHARDLB_REBALANCE_* settings

A private cluster of 3 masters, each redis-server pinned to a CPU as `make bench-scaleout` pins
them (bench/scaleout.py), and a band board of 3 home shards and 3 bands (one of each per master)
whose starts part the preloaded players evenly: points drawn uniformly below 1,000, bands from
[0, 333, 666]. Then the season goes on: every player posts one more result, their points plus up
to 2,000 more (a `best` board keeps the higher), so most players climb into the top band. "My rank"
(`Board.player`, 16 at a time, players drawn uniformly) is metered per master on those drifted
bands, exact and with ``max_age_ms=1000`` for 1,000 players polled again and again (a read then
touches the player's home shard and their own band only). Then `shardlb bands --apply`'s work:
`Board.band_starts(3)` and a reshard to those starts, timed. The same reads again.

Per master: Redis µs per read (INFO cpu of each node over the phase) and the read ceiling, the rate
at which the busiest master would fill one core (what a layout is sized by, bench/scaleout.py's
model). On two shared cores the reads/s themselves are the load generator's, not Redis's.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import env_int, log, publish, run_dir
from bench.latency import Phase, elapsed_ms, run_phase
from bench.scaleout import Meter, pinned, pinned_cluster
from bench.testbed import machine
from shardlb import times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.reshard import Resharder
from shardlb.store import BoardStore

MASTERS = 3
BOARD = "rebalance"
START_POINTS = 1000  # the preload's points: uniform below this
CLIMB = 2000  # the season's second result: the first's points plus up to this many more
POLLED = 1000
KEPT_AGE_MS = 1000
WARMUP_S = 1.0
FILES = ("rebalance.json", "rebalance.md")


@dataclass(frozen=True)
class Settings:
    players: int = 200_000
    seconds: int = 6
    tasks: int = 16

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        return cls(
            env_int("SHARDLB_REBALANCE_PLAYERS", d.players),
            env_int("SHARDLB_REBALANCE_SECONDS", d.seconds),
            env_int("SHARDLB_REBALANCE_TASKS", d.tasks),
        )


async def post(board: Board, points: list[int], match: str) -> None:
    """One result per player (``points[i]`` for player ``p<i>``), 1,000 a call, 4 calls in flight."""
    now = times.now_ms()
    calls = [
        [Score(f"p{i}", points[i], match, now) for i in range(start, min(start + 1000, len(points)))]
        for start in range(0, len(points), 1000)
    ]
    gate = asyncio.Semaphore(4)

    async def one(scores: list[Score]) -> None:
        async with gate:
            await board.submit(scores, now_ms=now)

    await asyncio.gather(*(one(c) for c in calls))


async def reads(board: Board, s: Settings, seed: int, players: list[str], max_age_ms: int = 0) -> Phase:
    rng = random.Random(seed)

    async def step(phase: Phase, _: int) -> None:
        t0 = time.perf_counter()
        await board.player(rng.choice(players), max_age_ms=max_age_ms)
        phase.record("my rank", elapsed_ms(t0))

    return await run_phase(Phase("my rank"), s.seconds, s.tasks, step)


async def measured(
    board: Board, s: Settings, meter: Meter, everyone: list[str], polled: list[str]
) -> dict[str, Any]:
    """The band sizes, then exact reads of anyone and kept reads of the polled players, metered."""
    out: dict[str, Any] = {"band_sizes": await board.band_sizes(), "bands": list(board.config.sharding.bands)}
    for kind, players, age, seed in (("exact", everyone, 0, 1), ("kept", polled, KEPT_AGE_MS, 3)):
        await reads(board, Settings(s.players, int(WARMUP_S), s.tasks), seed, players, age)
        meter.mark()
        phase = await reads(board, s, seed + 1, players, age)
        meter.mark()
        out[kind] = meter.phase(phase)
    return out


async def scenario(url: str, s: Settings, meter: Meter, driver_cpu: int) -> dict[str, Any]:
    client = connect(url, max_connections=64)
    scripts = Scripts.register(client)
    await scripts.load(client)
    try:
        store = BoardStore(client, scripts)
        third = START_POINTS // MASTERS
        sharding = {"strategy": "band", "shards": MASTERS, "bands": [third * b for b in range(MASTERS)]}
        board, _ = await store.create(
            BoardConfig.from_dict(BOARD, {"mode": "best", "durability": "memory", "sharding": sharding})
        )
        rng = random.Random(7)
        first = [rng.randrange(START_POINTS) for _ in range(s.players)]
        await post(board, first, "start")
        loaded = await board.band_sizes()
        await post(board, [p + rng.randrange(CLIMB + 1) for p in first], "later")
        everyone = [f"p{i}" for i in range(s.players)]
        polled = random.Random("polled").sample(everyone, min(POLLED, s.players))
        with pinned(driver_cpu):
            drifted = await measured(board, s, meter, everyone, polled)
            log(f"drifted bands {drifted['bands']}: players per band {drifted['band_sizes']}")
            t0 = time.monotonic()
            starts = await board.band_starts(MASTERS)
            mover = Resharder(store, BOARD, say=lambda line: None, cache_s=0.0)
            await mover.start(MASTERS, starts)
            status = await mover.run()
            took = round(time.monotonic() - t0, 1)
            log(f"resharded to bands {starts} in {took} s")
            board = await store.get(BOARD)
            redrawn = await measured(board, s, meter, everyone, polled)
        return {
            "loaded_band_sizes": loaded,
            "drifted": drifted,
            "reshard_s": took,
            "writes_refused_ms": status.get("last", {}).get("writes_refused_ms"),
            "redrawn": redrawn,
        }
    finally:
        await client.aclose()


def run(s: Settings, out: Path) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    with pinned_cluster(MASTERS, 0, cpus, out / "cluster") as bed:
        meter = Meter(bed.nodes[:MASTERS])
        result = asyncio.run(scenario(bed.cluster.url, s, meter, bed.where.driver))
        return {
            "machine": machine(),
            "cpus": cpus,
            "settings": {"players": s.players, "seconds": s.seconds, "tasks": s.tasks},
            "placement": {"masters": list(bed.where.masters), "driver": bed.where.driver},
            **result,
        }


def _row(label: str, part: dict[str, Any], kind: str) -> str:
    f = part[kind]
    each = " / ".join(f"{us:.2f}" for us in f["redis_us_per_op"])
    return (
        f"| {label} | {part['bands']} | {' / '.join(f'{n:,}' for n in part['band_sizes'])} | "
        f"{f['ops_per_s']:,.0f} | {each} | {max(f['redis_us_per_op']):.2f} | {f['ceiling_per_s']:,} |"
    )


def table(result: dict[str, Any]) -> list[str]:
    before, after = result["drifted"], result["redrawn"]
    lines = [
        f"# shardlb bench-rebalance ({result['settings']['players']:,} players, {MASTERS} masters)",
        "",
        f"Preloaded bands {before['bands']} held {result['loaded_band_sizes']} players (best band first); "
        f"after the season's second result they held {before['band_sizes']}. "
        f"`band_starts` and the reshard to {after['bands']}: {result['reshard_s']} s.",
        "",
        "| reads | bands | players per band (best first) | reads/s | Redis µs per read, each master "
        "| busiest | reads/s at 1 core for the busiest master |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for kind, what in (
        ("exact", "exact, any player"),
        ("kept", f"max_age_ms={KEPT_AGE_MS}, {POLLED:,} polled"),
    ):
        lines.append(_row(f"{what}, drifted", before, kind))
        lines.append(_row(f"{what}, redrawn", after, kind))
    for kind in ("exact", "kept"):
        a, b = before[kind]["ceiling_per_s"], after[kind]["ceiling_per_s"]
        lines.append("")
        lines.append(f"- {kind}: the busiest master's ceiling {a:,} -> {b:,} reads/s ({b / a:.2f}x).")
    return lines


def main() -> int:
    s = Settings.from_env()
    out = run_dir("rebalance-" + time.strftime("%Y%m%d-%H%M%S"))
    result = run(s, out)
    (out / "rebalance.json").write_text(json.dumps(result, indent=2))
    (out / "rebalance.md").write_text("\n".join(table(result)) + "\n")
    publish(out, FILES)
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
