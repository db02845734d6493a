"""`Board.band_starts` and `shardlb bands`: band starts that part a board's players evenly, checked
by counting each proposed band's players on a real cluster (and by making the band board)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from shardlb import times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import InvalidInput
from shardlb.reshard import Resharder, layout_bytes, short_of_memory
from shardlb.store import BoardStore
from tests.ports import node_ports

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
        best_first = sizes[::-1] if order == "desc" else sizes
        assert await board.band_sizes_at(starts) == best_first
        other = [0, 1, 777, 50_000, config.points_max]  # any starts, some bands empty
        counted = [sum(1 for p in points if lo <= p < hi) for lo, hi in itertools.pairwise([*other, 1 << 30])]
        assert await board.band_sizes_at(other) == (counted[::-1] if order == "desc" else counted)
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
            assert await banded.band_sizes_at(starts) == await banded.band_sizes() == best_first
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


async def test_shardlb_bands_apply_rebalances_a_skewed_band_board(
    store: BoardStore, cluster_url: str
) -> None:
    """`--apply`: bands that hold more than ``--skew`` times their share are resharded to the
    proposed starts (the home shards kept); bands within it are left alone, so it can run from cron."""
    config = BoardConfig.from_dict(
        "starts-apply",
        {"durability": "memory", "sharding": {"strategy": "band", "shards": 2, "bands": [0, 1000]}},
    )
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i * 10, "m", now) for i in range(40)], now_ms=now)
        assert await board.band_sizes() == [0, 40]  # best band first: every player is below 1000
        done = await bands_command("starts-apply", "--count", "2", "--apply", "--redis", cluster_url)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.splitlines()[-1])
        assert out["bands"] == [0, 190] and out["skew"] == 2.0 and out["resharded"] is True
        after = await store.get("starts-apply")
        assert after.config.sharding.bands == (0, 190) and after.config.sharding.shards == 2
        assert await after.band_sizes() == [21, 19]  # the band from 190 up: ranks 1-21
        top = await after.top(40)
        assert [(e.player_id, e.points) for e in top] == [(f"p{i}", i * 10) for i in range(39, -1, -1)]
        again = await bands_command("starts-apply", "--count", "2", "--apply", "--redis", cluster_url)
        assert again.returncode == 0, again.stderr
        out = json.loads(again.stdout.splitlines()[-1])
        assert out["skew"] == 1.05 and out["resharded"] is False
        assert (await store.get("starts-apply")).generation == after.generation
        # A reshard left half way (a Job killed mid-copy) is taken to its end by the next run.
        await Resharder(store, "starts-apply", say=lambda _: None).start(2, [0, 100, 300])
        resumed = await bands_command("starts-apply", "--count", "2", "--apply", "--redis", cluster_url)
        assert resumed.returncode == 0, resumed.stderr
        out = json.loads(resumed.stdout.splitlines()[-1])
        assert out["resumed"] is True and out["state"] == "none" and out["bands"] == [0, 100, 300]
        assert (await store.get("starts-apply")).config.sharding.bands == (0, 100, 300)
        # A hash board is made a band board of its shards as home shards.
        await store.create(
            BoardConfig.from_dict("starts-hash", {"durability": "memory", "sharding": {"shards": 2}})
        )
        hashed = await store.get("starts-hash")
        await hashed.submit([Score(f"p{i}", i * 10, "m", now) for i in range(40)], now_ms=now)
        made = await bands_command("starts-hash", "--count", "2", "--apply", "--redis", cluster_url)
        assert made.returncode == 0, made.stderr
        out = json.loads(made.stdout.splitlines()[-1])
        assert out["skew"] is None and out["resharded"] is True and out["bands"] == [0, 190]
        banded = await store.get("starts-hash")
        assert banded.layout.strategy == "band" and banded.config.sharding.shards == 2
        assert await banded.band_sizes() == [21, 19]
        bad = await bands_command(
            "starts-apply", "--count", "2", "--skew", "0.5", "--apply", "--redis", cluster_url
        )
        assert bad.returncode == 2 and "--skew" in bad.stderr
    finally:
        await store.delete("starts-apply")
        await store.delete("starts-hash")


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_bands_apply_leaves_bands_that_new_starts_would_not_make_more_even(
    store: BoardStore, cluster_url: str, order: str
) -> None:
    """A block of players on equal points is one band's, whatever the starts: 60 of 100 players on
    500 points keep the largest of 3 bands at 1.8 times its share. `--apply` resharded such a board
    on every run whose proposed starts had moved by a point elsewhere (each run copied the whole
    board, from cron, to bands no more even), and every run after a first one that could only make
    fewer bands than --count. It reshards when the new starts give another band count or a smaller
    skew; otherwise it leaves the board."""
    board_id = f"starts-ties-{order}"
    config = BoardConfig.from_dict(
        board_id,
        {
            "mode": "set",
            "order": order,
            "durability": "memory",
            "sharding": {"strategy": "band", "shards": 2, "bands": [0, 1000]},
        },
    )
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        spread = [Score(f"s{i}", i + 1 if order == "desc" else 600 + i, "m1", now) for i in range(40)]
        tied = [Score(f"t{i}", 500, "m1", now) for i in range(60)]
        await board.submit(spread + tied, now_ms=now)
        first = await bands_command(board_id, "--count", "3", "--apply", "--redis", cluster_url)
        assert first.returncode == 0, first.stderr
        out = json.loads(first.stdout.splitlines()[-1])
        assert out["resharded"] is True and len(out["bands"]) == 3, out
        after = await store.get(board_id)
        assert max(await after.band_sizes()) == 60
        # One player of the spread moves past the proposed start between two of them (set: down too).
        player, points = ("s9", 39) if order == "desc" else ("s3", 632)
        await after.submit([Score(player, points, "m2", now + 1000)], now_ms=now + 1000)
        again = await bands_command(board_id, "--count", "3", "--apply", "--redis", cluster_url)
        assert again.returncode == 0, again.stderr
        out = json.loads(again.stdout.splitlines()[-1])
        assert out["bands"] != list(after.config.sharding.bands), out  # the starts did move
        assert out["skew"] == 1.8 and out["resharded"] is False, out
        assert (await store.get(board_id)).generation == after.generation
    finally:
        await store.delete(board_id)


def test_short_of_memory_wants_the_copy_to_fit_below_every_masters_maxmemory() -> None:
    mib = 2**20
    assert short_of_memory(90 * mib, [None, None, None]) is None  # no maxmemory anywhere
    assert short_of_memory(90 * mib, [200 * mib, 200 * mib, None]) is None  # 37.5 MiB a master
    why = short_of_memory(90 * mib, [200 * mib, 30 * mib, 200 * mib])
    assert why is not None and "1 of 3 masters" in why and "37.5 MiB a master" in why


async def test_bands_apply_refuses_a_copy_that_would_not_fit(tmp_path: Path) -> None:
    """On a private one-master cluster with a maxmemory just above what it holds, --apply leaves a
    skewed band board alone (exit 1, why on stderr); without the limit it reshards it."""
    cluster = LocalCluster(masters=1, replicas=0, port=node_ports(1), dir=tmp_path)
    cluster.up()
    client = connect(cluster.url)
    try:
        store = BoardStore(client, Scripts.register(client))
        sharding = {"strategy": "band", "shards": 1, "bands": [0, 100_000]}
        board, _ = await store.create(
            BoardConfig.from_dict("tight", {"durability": "memory", "sharding": sharding})
        )
        now = times.now_ms()
        for start in range(0, 20_000, 1000):
            await board.submit([Score(f"p{i}", i, "m", now) for i in range(start, start + 1000)], now_ms=now)
        assert await layout_bytes(client, board) > 20_000 * 50  # the total, the band and the versions
        node = redis.Redis(port=cluster.port)
        used = int(node.info("memory")["used_memory"])
        node.config_set("maxmemory", used + 256 * 1024)
        try:
            refused = await bands_command("tight", "--count", "2", "--apply", "--redis", cluster.url)
        finally:
            node.config_set("maxmemory", 0)
        assert refused.returncode == 1 and "add memory or masters first" in refused.stderr, refused.stderr
        assert (await store.get("tight")).config.sharding.bands == (0, 100_000)  # nothing started
        assert (await Resharder(store, "tight").status())["state"] == "none"
        done = await bands_command("tight", "--count", "2", "--apply", "--redis", cluster.url)
        assert done.returncode == 0, done.stderr
        assert (await store.get("tight")).config.sharding.bands == (0, 9_999)  # ranks 1-10,000 from 9,999 up
        node.close()
    finally:
        await client.aclose()
        cluster.down()


async def bands_command(*args: str) -> subprocess.CompletedProcess[str]:
    """`shardlb bands ...` in a process of its own (its asyncio.run needs a thread without a loop)."""
    command = [sys.executable, "-m", "shardlb", "bands", *args]
    # No router keeps the boards: the reshards of --apply need not wait for routers' caches.
    env = {**os.environ, "SHARDLB_RESHARD_CACHE_S": "0"}
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60, env=env
    )
