"""Concurrent writers with overlapping players and exact replays, on a real cluster.

Every mode's rule is order-independent (best keeps the max, incr sums each (match, player) once, set
keeps the latest achieved time), so whatever the interleaving, the final board must equal the
reference board fed each distinct result once.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import pytest

from shardlb import keys, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import expected_entries

pytestmark = pytest.mark.cluster

WRITERS = 8


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize("strategy", ["hash", "band"])
async def test_concurrent_writers_end_equal_to_reference(store: BoardStore, strategy: str, mode: str) -> None:
    sharding = (
        {"strategy": "hash", "shards": 16}
        if strategy == "hash"
        else {"strategy": "band", "bands": [0, 40, 120, 300], "shards": 3}
    )
    config = BoardConfig.from_dict(f"conc-{strategy}-{mode}", {"mode": mode, "sharding": sharding})
    board, _ = await store.create(config)
    now = times.now_ms()
    rng = random.Random(f"{strategy}{mode}")
    players = [f"player-{i}" for i in range(40)]
    # A shared pool so writers replay each other's results as well as their own.
    pool = [
        Score(
            rng.choice(players),
            rng.randint(0, 25 if mode == "incr" else 500),
            f"match-{n}",
            now - rng.randint(0, 3600) * 1000,
        )
        for n in range(400)
    ]

    async def writer(seed: int) -> None:
        wrng = random.Random(seed)
        for _ in range(12):
            await board.submit(wrng.sample(pool, 25), now_ms=now)
            await asyncio.sleep(0)

    try:
        await asyncio.gather(*(writer(seed) for seed in range(WRITERS)))
        await board.submit(pool, now_ms=now)  # everything at least once, in a different order again
        ref = ReferenceBoard(config)
        ref.submit(pool, now_ms=now)
        want = expected_entries(ref, "total", None)
        got = await board.top(1000)
        assert got == want
        assert len({e.player_id for e in got}) == len(got)
        if mode == "best":
            best: dict[str, int] = defaultdict(int)
            for s in pool:
                best[s.player_id] = max(best[s.player_id], s.points)
            assert {e.player_id: e.points for e in got} == dict(best)
        if mode == "incr":
            sums: dict[str, int] = defaultdict(int)
            for s in {(s.match_id, s.player_id): s for s in pool}.values():
                sums[s.player_id] += s.points
            assert {e.player_id: e.points for e in got} == dict(sums)
        if strategy == "band":
            await assert_band_shards_hold_each_player_once(store, board.prefixes[3:], len(want))
    finally:
        await store.delete(config.id)


async def assert_band_shards_hold_each_player_once(
    store: BoardStore, prefixes: list[str], players: int
) -> None:
    members: list[str] = []
    for prefix in prefixes:
        members += await store.client.zrange(keys.period_key(prefix, "total"), 0, -1)
    assert len(members) == players
    assert len(set(members)) == players


async def test_band_players_crossing_boundaries_never_show_twice(store: BoardStore) -> None:
    """Players climb through every band while readers list the board; no read shows anyone twice."""
    config = BoardConfig.from_dict(
        "band-climb",
        {"mode": "incr", "sharding": {"strategy": "band", "bands": [0, 10, 20, 40, 80], "shards": 2}},
    )
    board, _ = await store.create(config)
    players = [f"climber-{i}" for i in range(20)]
    stop = asyncio.Event()
    seen_lists: list[list[str]] = []

    async def climb(seed: int) -> None:
        rng = random.Random(seed)
        for step in range(25):
            batch = [Score(p, rng.randint(1, 6), f"w{seed}-{step}-{p}") for p in rng.sample(players, 8)]
            await board.submit(batch)

    async def read() -> None:
        while not stop.is_set():
            seen_lists.append([e.player_id for e in await board.top(100)])
            seen_lists.append([e.player_id for e in await board.entries(3, 10)])
            await asyncio.sleep(0)

    reader = asyncio.create_task(read())
    try:
        async with asyncio.TaskGroup() as climbers:  # one that fails stops the others
            for seed in range(WRITERS):
                climbers.create_task(climb(seed))
        stop.set()
        await reader
        assert len(seen_lists) > 10
        for listed in seen_lists:
            assert len(listed) == len(set(listed))
        final = await board.top(100)
        assert len({e.player_id for e in final}) == len(final) == await board.size()
        ranks = [(await board.player(e.player_id)).entry.rank for e in final]
        assert ranks == list(range(1, len(final) + 1))
        await assert_band_shards_hold_each_player_once(store, board.prefixes[2:], len(final))
    finally:
        # Whatever failed, the reader stops: left reading, it went on using the session's client in
        # the modules after this one.
        stop.set()
        await asyncio.gather(reader, return_exceptions=True)
        await store.delete(config.id)
