"""Region boards keep one entry per player (issue 9, item 3): a player's first region sticks.

Players here post under several regions at random, with replays; every status and every view (the
global board and each region's) must equal the reference board, where a result naming another
region than the player's is refused with ``region_conflict`` and changes nothing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from router.coalescer import Coalescer
from shardlb import periods, times
from shardlb.board import Board, Prepared, Result, Score
from shardlb.config import BoardConfig
from shardlb.errors import PlayerNotFound
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
            # Within one batch a player posts under one region: a conflict's points are the
            # total after its round (shardlb.board.rounds), not at its place in the batch as here.
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


class LostOnce:
    """Board.apply_shard whose first call to ``shard`` fails before it reaches the cluster."""

    def __init__(self, board: Board, shard: int) -> None:
        self.real = board.apply_shard
        self.shard = shard
        self.failed = False

    async def __call__(
        self, shard: int, batch: Sequence[Prepared], now_ms: int | None = None, pipeline: Any = None
    ) -> list[Result]:
        if shard == self.shard and not self.failed:
            self.failed = True
            raise ConnectionError("the call was lost")
        return await self.real(shard, batch, now_ms, pipeline)


@pytest.mark.parametrize("through", ["board", "coalescer"])
@pytest.mark.parametrize("first", ["eu", "na"])
async def test_a_request_naming_two_regions_homes_the_player_in_its_first_even_when_retried(
    store: BoardStore, through: str, first: str
) -> None:
    """A new player named under two regions in one request is homed in the first it names, and a
    request half applied (the first region's call lost) and retried ends the same: the 2026-12-05
    audit found the region whose call went through kept the player, and a retry then refused
    the first region's results (region_conflict) where one whole call had applied them."""
    config = BoardConfig.from_dict(
        f"two-regions-{through}-{first}",
        {"mode": "incr", "sharding": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2}},
    )
    board, _ = await store.create(config)
    second = "na" if first == "eu" else "eu"
    batch = [
        Score("p1", 10, "m1", None, first),
        Score("p1", 20, "m2", None, second),
        Score("p1", 5, "m3", None, first),
    ]
    lost = LostOnce(board, board.layout.home("p1", first))
    board.apply_shard = lost  # type: ignore[method-assign]
    coalescer = Coalescer()

    async def send() -> list[Result]:
        if through == "board":
            return await board.submit(batch)
        return await coalescer.submit(board, board.prepare(batch))

    try:
        with pytest.raises(ConnectionError):
            await send()
        assert lost.failed
        got = await send()
        assert [r.status for r in got] == ["improved", "region_conflict", "improved"]
        assert (await board.player("p1", board.resolve("total", first))).entry.points == 15
        with pytest.raises(PlayerNotFound):
            await board.player("p1", board.resolve("total", second))
        again = await send()  # a replay changes nothing
        assert [r.status for r in again] == ["duplicate", "region_conflict", "duplicate"]
        assert [r.points for r in again] == [15, 15, 15]
    finally:
        await store.delete(config.id)
