"""`Board.band_starts` and `shardlb bands`: band starts that part a board's players evenly, checked
by counting each proposed band's players on a real cluster (and by making the band board)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest

from shardlb import times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.errors import InvalidInput
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

PLAYERS = 300


@pytest.mark.parametrize("order", ["desc", "asc"])
@pytest.mark.parametrize("count", [1, 3, 7])
async def test_band_starts_part_the_players_evenly(store: BoardStore, order: str, count: int) -> None:
    rng = random.Random(f"{order}/{count}")
    config = BoardConfig.from_dict(
        f"starts-{order}-{count}", {"order": order, "sharding": {"strategy": "hash", "shards": 3}}
    )
    board, _ = await store.create(config)
    try:
        points = rng.sample(range(1, 100_000), PLAYERS)  # distinct: every band can be cut exactly
        now = times.now_ms()
        await board.submit([Score(f"p{i}", p, "m", now) for i, p in enumerate(points)], now_ms=now)
        starts = await board.band_starts(count)
        assert len(starts) == count and starts[0] == 0 and starts == sorted(set(starts))
        ends = [*starts[1:], config.points_max + 1]
        sizes = [sum(1 for p in points if lo <= p < hi) for lo, hi in zip(starts, ends, strict=True)]
        assert sum(sizes) == PLAYERS
        assert all(abs(n - PLAYERS / count) <= 2 for n in sizes), sizes
        # The starts make a valid band board, whose ranks are the hash board's.
        banded, _ = await store.create(
            BoardConfig.from_dict(
                f"starts-{order}-{count}-b",
                {"order": order, "sharding": {"strategy": "band", "bands": starts}},
            )
        )
        try:
            await banded.submit([Score(f"p{i}", p, "m", now) for i, p in enumerate(points)], now_ms=now)
            for player in ("p0", "p1", f"p{PLAYERS - 1}"):
                assert (await banded.player(player)).entry == (await board.player(player)).entry
        finally:
            await store.delete(banded.config.id)
    finally:
        await store.delete(config.id)


async def test_band_starts_of_an_empty_board_and_bad_counts(store: BoardStore) -> None:
    board, _ = await store.create(BoardConfig.from_dict("starts-empty", {}))
    try:
        assert await board.band_starts(4) == [0]
        for bad in (0, 257):
            with pytest.raises(InvalidInput):
                await board.band_starts(bad)
    finally:
        await store.delete("starts-empty")


async def test_shardlb_bands_prints_the_starts_and_the_reshard(store: BoardStore, cluster_url: str) -> None:
    board, _ = await store.create(BoardConfig.from_dict("starts-cli", {"sharding": {"shards": 2}}))
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i * 10, "m", now) for i in range(40)], now_ms=now)
        done = await bands_command("starts-cli", "--count", "4", "--redis", cluster_url)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"board": "starts-cli", "bands": await board.band_starts(4)}
        assert json.loads(done.stdout)["bands"] == [0, 90, 190, 290]
        assert "shardlb reshard starts-cli --shards 2 --bands 0,90,190,290" in done.stderr
        missing = await bands_command("no-such-board", "--count", "2", "--redis", cluster_url)
        assert missing.returncode == 1 and "no board" in missing.stderr
    finally:
        await store.delete("starts-cli")


async def bands_command(*args: str) -> subprocess.CompletedProcess[str]:
    """`shardlb bands ...` in a process of its own (its asyncio.run needs a thread without a loop)."""
    command = [sys.executable, "-m", "shardlb", "bands", *args]
    return await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)
