"""Region boards keep one entry per player (issue 9, item 3): a player's first region sticks.

Players here post under several regions at random, with replays; every status and every view (the
global board and each region's) must equal the reference board, where a result naming another
region than the player's is refused with ``region_conflict`` and changes nothing.
"""

from __future__ import annotations

import random

import pytest

from shardlb import periods, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import HOUR, check_view

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize(("regions", "per"), [(3, 1), (3, 4)])
async def test_players_posting_under_several_regions_are_listed_once(
    store: BoardStore, mode: str, regions: int, per: int
) -> None:
    rng = random.Random(f"regions/{mode}/{regions}/{per}")
    names = [f"r{i}" for i in range(regions)]
    config = BoardConfig.from_dict(
        f"multi-region-{mode}-{regions}-{per}",
        {
            "mode": mode,
            "periods": ["daily"],
            "points_max": 1000,
            "sharding": {"strategy": "region", "regions": names, "shards_per_region": per},
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    players = [f"p{i:02d}" for i in range(30)]
    sent: list[Score] = []
    conflicts = 0
    try:
        for batch_no in range(4):
            # Within one batch a player posts under one region: a batch's shards are written
            # concurrently, so which of two regions came first would be a race, not a rule.
            region_now = {p: rng.choice(names) for p in players}
            batch = []
            for _ in range(30):
                if sent and rng.random() < 0.25:
                    old = rng.choice(sent)  # a replay, often under another region than before
                    batch.append(old._replace(region=region_now[old.player_id]))
                    continue
                player = rng.choice(players)
                batch.append(
                    Score(
                        player,
                        rng.randrange(0, 60 if mode == "incr" else 400),
                        f"m{batch_no}-{len(sent)}",
                        now - rng.choice([0, 1, 30]) * HOUR,
                        region_now[player],
                    )
                )
                sent.append(batch[-1])
            got = await board.submit(batch, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)
            conflicts += sum(r.status == "region_conflict" for r in got)
            await check_view(board, ref, "total", "total", None, rng)
            day = periods.names_at(now - 30 * HOUR, config.periods, board.tz)[1]
            await check_view(board, ref, day, "daily:" + day[2:], None, rng)
            for region in names:
                await check_view(board, ref, "total", "total", region, rng)
        assert conflicts > 0  # the workload did post players under a second region
    finally:
        await store.delete(config.id)
