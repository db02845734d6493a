"""The one total order at the codec's extremes, on hash, band and region boards, against the reference.

Hypothesis draws a board (mode, order, tie-break, resolution, a points_max up to the largest its
resolution allows, an epoch that puts the codec's last time unit just ahead of now, bands that
start at 1 and at points_max) and results whose points and times sit at the ends: 0, 1,
points_max - 1, points_max, a band start and the point below it, the epoch, the last unit, equal
times (so equal scores on several shards, ordered by player id). Incr sums run past points_max.
Every read is then compared with tests/reference.py in both rank modes: tops and pages past the
end, each player, around the first and the last player, friends with duplicate and unknown ids.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlb import times
from shardlb.board import Board, Score
from shardlb.codec import RESOLUTION_MS, ScoreCodec
from shardlb.config import RANK_MODES, BoardConfig
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board_ranks import check_ranks, expected

pytestmark = pytest.mark.cluster

# Ids that tie-break in byte order: every character class, prefixes of each other, both ends.
IDS = ["-", "--", ".", "0", "9", ":", "A", "Z", "_", "a", "z", "z" * 64, "a-", "a.", "a:", "aA", "a_", "p00"]
LARGEST = {"s": 2**31 - 1, "ms": 2**21 - 1}  # the largest points_max each resolution allows


def board_settings(data: st.DataObject, strategy: str, now: int) -> dict[str, Any]:
    resolution = data.draw(st.sampled_from(["s", "ms"]), "resolution")
    points_max = data.draw(st.sampled_from([1, 2, 1000, 2**20, LARGEST[resolution]]), "points_max")
    order = data.draw(st.sampled_from(["desc", "asc"]), "order")
    tiebreak = data.draw(st.sampled_from(["earliest", "latest"]), "tiebreak")
    unit = RESOLUTION_MS[resolution]
    time_max = ScoreCodec(points_max, order, tiebreak, resolution).time_max
    # The last unit a minute ahead (results may be 5 minutes ahead), or a board started a while ago.
    late = time_max * unit < 50 * 365 * 86_400_000 and data.draw(st.booleans(), "late")
    span = time_max * unit
    epoch = now - span + 60_000 - 7 if late else now - min(365 * 86_400_000, span // 2) - 3
    sharding: dict[str, Any]
    if strategy == "hash":
        sharding = {"strategy": "hash", "shards": data.draw(st.sampled_from([1, 3, 5]), "shards")}
    elif strategy == "region":
        sharding = {"strategy": "region", "regions": ["eu", "na", "asia"], "shards_per_region": 2}
    else:
        # Up to 11 bands: past reads.ONE_ROUND_BANDS (a rank then takes two rounds)
        ends = [1, 2, 3, points_max // 4, points_max // 2, points_max // 2 + 1, points_max - 2]
        ends += [points_max - 1, points_max, *(points_max * k // 10 for k in range(1, 10))]
        starts = {0, *data.draw(st.sets(st.sampled_from([e for e in ends if 0 < e <= points_max])), "bands")}
        sharding = {"strategy": "band", "bands": sorted(starts), "shards": 3}
    return {
        "mode": data.draw(st.sampled_from(["best", "incr", "set"]), "mode"),
        "order": order,
        "tiebreak": tiebreak,
        "resolution": resolution,
        "points_max": points_max,
        "epoch": epoch,
        "durability": "memory",
        "sharding": sharding,
    }


def edge_points(config: BoardConfig) -> list[int]:
    top = config.points_max
    near = {0, 1, top // 2, top - 1, top}
    for start in config.sharding.bands:
        near |= {start - 1, start, start + 1}
    return sorted(p for p in near if 0 <= p <= top)


def edge_times(config: BoardConfig, now: int) -> list[int]:
    codec = config.codec()
    unit = codec.unit_ms
    last = min(codec.last_ms, now)
    return sorted({codec.epoch_ms, codec.epoch_ms + unit - 1, codec.epoch_ms + unit, last - unit, last})


async def check_extremes(board: Board, ref: ReferenceBoard, region: str | None, rng: random.Random) -> None:
    """What check_ranks leaves out: pages at and past the end, around the ends with radii past
    the board, and friends lists that repeat ids and name players without a score."""
    view = board.resolve("total", region)
    for asked in RANK_MODES:
        want = expected(ref, "total", region, asked)
        n = len(want)
        for shallow in (0, 1000):
            board.shallow = shallow
            try:
                for offset in (n - 1, n, n + 1, n + 1000):
                    if offset < 0:
                        continue
                    for limit in (1, 2, 1000):
                        got = await board.entries(offset, limit, view, asked)
                        assert got == want[offset : offset + limit], (asked, shallow, offset, limit)
            finally:
                board.shallow = 1000
        if n:
            for i in (0, n - 1):
                for radius in (0, 1, n, 100):
                    around = await board.around(want[i].player_id, radius, view, asked)
                    assert around == want[max(0, i - radius) : i + radius + 1], (asked, i, radius)
        if asked == "unique":  # my rank with the other shards' or bands' counts kept a moment
            for _ in range(2):
                for e in want:
                    got = await board.player(e.player_id, view, asked, max_age_ms=60_000)
                    assert (got.entry, got.players) == (e, n), e
        ids = [e.player_id for e in want] * 2 + ["nobody", "nobody", "zz-unknown"]
        rng.shuffle(ids)
        assert await board.query(ids, view, asked) == want, asked
        assert await board.query(["nobody"], view, asked) == []


async def run(store: BoardStore, strategy: str, data: st.DataObject) -> None:
    now = times.now_ms()
    body = board_settings(data, strategy, now)
    config = BoardConfig.from_dict(f"extreme-{uuid.uuid4().hex[:10]}", body)
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    regions = list(config.sharding.regions)
    pts, when = edge_points(config), edge_times(config, now)
    drawn = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(IDS) - 1), st.sampled_from(pts), st.sampled_from(when)),
            min_size=1,
            max_size=40,
        ),
        "results",
    )
    scores = [
        Score(IDS[p], points, f"m{i}", at, regions[p % len(regions)] if regions else None)
        for i, (p, points, at) in enumerate(drawn)
    ]
    rng = random.Random(data.draw(st.integers(0, 2**32), "seed"))
    try:
        for batch in (scores[: len(scores) // 2], scores[len(scores) // 2 :]):
            got = await board.submit(batch, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)
        for region in (None, *regions):
            for asked in RANK_MODES:
                await check_ranks(board, ref, "total", "total", region, asked, rng)
            await check_extremes(board, ref, region, rng)
    finally:
        await store.delete(config.id)


EXAMPLES = settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
@EXAMPLES
@given(data=st.data())
async def test_results_at_the_codec_ends_read_as_the_reference(
    store: BoardStore, strategy: str, data: st.DataObject
) -> None:
    await run(store, strategy, data)


@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
@settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_tie_blocks_larger_than_a_page_read_as_the_reference(
    store: BoardStore, strategy: str, data: st.DataObject
) -> None:
    """Many players on one exact score (more than reads.TIE_ROWS on a shard, more than a page):
    pages that start and end inside the block, ranks and neighbours inside it, on every board kind."""
    now = times.now_ms()
    body = board_settings(data, strategy, now)
    body["mode"] = "best"
    config = BoardConfig.from_dict(f"ties-{uuid.uuid4().hex[:10]}", body)
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    regions = list(config.sharding.regions)
    pts, when = edge_points(config), edge_times(config, now)
    level = data.draw(st.sampled_from(pts), "level")
    at = data.draw(st.sampled_from(when), "at")
    count = data.draw(st.integers(100, 240), "count")
    scores = [
        Score(f"t{p:03d}", level, f"m{p}", at, regions[p % len(regions)] if regions else None)
        for p in range(count)
    ]
    scores += [
        Score(
            f"o{p}",
            data.draw(st.sampled_from(pts)),
            f"o{p}",
            data.draw(st.sampled_from(when)),
            regions[p % len(regions)] if regions else None,
        )
        for p in range(data.draw(st.integers(0, 6), "others"))
    ]
    rng = random.Random(data.draw(st.integers(0, 2**32), "seed"))
    try:
        got = await board.submit(scores, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(scores, now_ms=now)
        for region in (None, *regions):
            view = board.resolve("total", region)
            for asked in RANK_MODES:
                want = expected(ref, "total", region, asked)
                n = len(want)
                for shallow in (0, 1000):
                    board.shallow = shallow
                    try:
                        for _ in range(12):
                            offset, limit = rng.randrange(0, n + 3), rng.choice([1, 3, 10, 50])
                            page = await board.entries(offset, limit, view, asked)
                            assert page == want[offset : offset + limit], (asked, shallow, offset, limit)
                    finally:
                        board.shallow = 1000
                for i in rng.sample(range(n), min(15, n)):
                    e = want[i]
                    assert (await board.player(e.player_id, view, asked)).entry == e
                    radius = rng.choice([0, 1, 5, 40])
                    around = await board.around(e.player_id, radius, view, asked)
                    assert around == want[max(0, i - radius) : i + radius + 1], (asked, i, radius)
                ids = [e.player_id for e in rng.sample(want, min(50, n))]
                assert await board.query(ids, view, asked) == [e for e in want if e.player_id in ids]
            await check_extremes(board, ref, region, rng)
    finally:
        await store.delete(config.id)
