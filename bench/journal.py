"""Bytes of Redis memory a journal spends per entry and per result, for ``shardlb plan``.

A shard's journal is a stream of one entry per write-script call, holding that call's applied
results packed with MessagePack (shardlb/journal.py). Its memory is a part per entry (the stream's
node and ID, the board, incarnation and shard fields) and a part per result (``<match>\\0<player>``,
points, time units). For each batch size in SIZES this writes entries of that many fresh results
(UUID match ids, 17-digit player ids, as bench/dedup.py draws them) through the real write script
onto a one-shard journaled board, with no archiver running, and reads ``MEMORY USAGE ... SAMPLES 0``
of the stream. A least-squares line through (results per entry, bytes per entry) gives the two
parts; the planner multiplies them by what a journal may hold at its entry bound.
"""

from __future__ import annotations

import random
from typing import Any

from bench.dedup import results_batch
from bench.harness import log
from shardlb import keys
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore

SIZES = (1, 10, 60, 250)
RESULTS_PER_SIZE = 100_000  # results written per batch size (at most MAX_ENTRIES entries)
MAX_ENTRIES = 2_000
PLAYERS = 10_000_000


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``points`` (x, y)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


async def measure(url: str, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    """Bytes per journal entry at each batch size, and the fitted bytes per entry and per result."""
    client = connect(url)
    raw = connect(url, decode=False)
    rng = random.Random(11)
    rows = []
    try:
        scripts = Scripts.register(client)
        await scripts.load(client)
        for size in sizes:
            config = BoardConfig.from_dict(
                f"journal-memory-{size}", {"sharding": {"strategy": "hash", "shards": 1}}
            )
            board, _ = await BoardStore(client, scripts).create(config)
            key = keys.journal_key(board.prefixes[0])
            entries = max(1, min(MAX_ENTRIES, RESULTS_PER_SIZE // size))
            for _ in range(entries):
                await board.submit(results_batch(rng, size, PLAYERS))
            held = int(await raw.xlen(key))
            used = int(await raw.memory_usage(key, samples=0) or 0)
            rows.append(
                {
                    "results_per_entry": size,
                    "entries": held,
                    "bytes_per_entry": round(used / held, 1),
                    "bytes_per_result": round(used / held / size, 1),
                }
            )
            log(f"journal memory: {rows[-1]}")
            await raw.delete(key)
    finally:
        await client.aclose()
        await raw.aclose()
    sample = results_batch(rng, 1, PLAYERS)[0]
    fixed, per_result = fit([(r["results_per_entry"], r["bytes_per_entry"]) for r in rows])
    return {
        "sizes": rows,
        "bytes_per_journal_entry": round(fixed, 1),
        "bytes_per_journaled_result": round(per_result, 1),
        "member_bytes": len(f"{sample.match_id}\0{sample.player_id}".encode()),
    }
