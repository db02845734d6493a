"""Rank modes (issue 12, item 6) on a real cluster, against the reference board.

Hypothesis draws workloads with few distinct points and few achieved times, so most players share
their points with others (and many their exact score): every read (top, pages shallow and deep,
player, around, query) must give the reference's competition ranks (1 + the players with strictly
better points) and its unique ranks, in the same listing order, on hash, band and region boards.
"""

from __future__ import annotations

import random
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlb import periods, times
from shardlb.board import Board, Entry, Score
from shardlb.config import RANK_MODES, BoardConfig
from shardlb.errors import InvalidInput
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import sharding

pytestmark = pytest.mark.cluster

PLAYERS = 30


def expected(ref: ReferenceBoard, name: str, region: str | None, rank_mode: str) -> list[Entry]:
    standing = ref.competition(name, region)
    return [
        Entry(
            i + 1 if rank_mode == "unique" else standing[player][0],
            player,
            points,
            ref.codec.units_to_ms(units),
        )
        for i, (_, player, points, units) in enumerate(ref.order(name, region))
    ]


async def check_ranks(
    board: Board,
    ref: ReferenceBoard,
    name: str,
    api: str,
    region: str | None,
    asked: str | None,
    rng: random.Random,
) -> None:
    """Every read of one view in one rank mode (``asked``; None: the board's) against the reference."""
    rank_mode = asked or board.config.rank_mode
    want = expected(ref, name, region, rank_mode)
    n = len(want)
    view = board.resolve(api, region)
    assert await board.top(n + 5, view, asked) == want
    k = rng.randrange(1, n + 2)
    assert await board.top(k, view, asked) == want[:k]
    try:
        for shallow in (0, 1000):  # 0: every page bisects, and a competition page counts its first rank
            board.shallow = shallow
            for offset in sorted({0, 1, 2, n // 3, n // 2, max(n - 3, 0), max(n - 1, 0), n + 2}):
                limit = rng.choice([1, 3, 7])
                assert await board.entries(offset, limit, view, asked) == want[offset : offset + limit]
    finally:
        board.shallow = 1000
    standing = ref.competition(name, region)
    for e in want:
        got = await board.player(e.player_id, view, asked)
        assert got.entry == e
        assert got.players == n
        below = n - e.rank if rank_mode == "unique" else standing[e.player_id][1]
        assert got.percentile == pytest.approx(100.0 * below / n)
    for i in rng.sample(range(n), min(6, n)):
        radius = rng.choice([0, 1, 2, 5])
        around = await board.around(want[i].player_id, radius, view, asked)
        assert around == want[max(0, i - radius) : i + radius + 1]
    ids = [e.player_id for e in rng.sample(want, min(10, n))] + ["nobody"]
    rng.shuffle(ids)
    assert await board.query(ids, view, asked) == [e for e in want if e.player_id in ids]


@st.composite
def workloads(draw: st.DrawFn, mode: str) -> list[tuple[int, int, int]]:
    """(player, points, seconds before now): a few points values and times shared by many results."""
    small = mode == "incr"  # sums of a few small values collide as often as best's few values
    levels = draw(
        st.lists(st.integers(0, 4 if small else 400), min_size=1, max_size=2 if small else 4, unique=True)
    )
    ago = draw(st.lists(st.sampled_from([0, 1, 2, 3600, 30 * 3600]), min_size=1, max_size=3, unique=True))
    return draw(
        st.lists(
            st.tuples(st.integers(0, PLAYERS - 1), st.sampled_from(levels), st.sampled_from(ago)),
            min_size=1,
            max_size=90,
        )
    )


async def run_workload(store: BoardStore, strategy: str, shards: int, data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(["best", "incr", "set"]), "mode")
    body = {
        "mode": mode,
        "order": data.draw(st.sampled_from(["desc", "asc"]), "order"),
        "tiebreak": data.draw(st.sampled_from(["earliest", "latest"]), "tiebreak"),
        "rank_mode": data.draw(st.sampled_from(RANK_MODES), "rank_mode"),
        "periods": ["daily"],
        "points_max": 1000,
        "sharding": sharding(strategy, shards),
    }
    config = BoardConfig.from_dict(f"ranks-{uuid.uuid4().hex[:10]}", body)
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    regions = list(config.sharding.regions)
    region_of = {p: regions[p % len(regions)] if regions else None for p in range(PLAYERS)}
    rng = random.Random(data.draw(st.integers(0, 2**32), "seed"))
    try:
        results = data.draw(workloads(mode), "results")
        scores = [
            Score(f"p{p:02d}", points, f"m{i}", now - ago * 1000, region_of[p])
            for i, (p, points, ago) in enumerate(results)
        ]
        for batch in (scores[: len(scores) // 2], scores[len(scores) // 2 :]):
            got = await board.submit(batch, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)
        day = periods.names_at(now, config.periods, board.tz)[1]
        views = [("total", "total", None), (day, "daily:" + day[2:], None)]
        views += [("total", "total", region) for region in regions]
        for name, api, region in views:
            for asked in (None, *RANK_MODES):
                await check_ranks(board, ref, name, api, region, asked, rng)
    finally:
        await store.delete(config.id)


EXAMPLES = settings(
    max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


BOARDS = [("hash", 1), ("hash", 3), ("hash", 16), ("band", 3), ("region", 3), ("region", 16)]


@pytest.mark.parametrize(("strategy", "shards"), BOARDS)
@EXAMPLES
@given(data=st.data())
async def test_every_read_matches_the_reference_in_both_rank_modes(
    store: BoardStore, strategy: str, shards: int, data: st.DataObject
) -> None:
    await run_workload(store, strategy, shards, data)


async def test_a_competition_rank_ignores_the_time_that_orders_the_listing(store: BoardStore) -> None:
    """Three players on 50 points at three times and one on 40: listed by time, ranked 1, 1, 1, 4;
    a deep page that starts inside the run of 50s still says 1, and the percentile of the 50s is
    the share of the board they beat outright."""
    config = BoardConfig.from_dict(
        f"ranks-{uuid.uuid4().hex[:10]}", {"sharding": {"strategy": "hash", "shards": 3}}
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    scores = [Score(p, 50, f"m{p}", now - i * 1000) for i, p in enumerate(["c", "b", "a"])]
    scores.append(Score("d", 40, "md", now - 9000))
    try:
        await board.submit(scores, now_ms=now)
        listed = await board.top(10, rank_mode="competition")
        assert [(e.player_id, e.rank) for e in listed] == [("a", 1), ("b", 1), ("c", 1), ("d", 4)]
        assert [e.rank for e in await board.top(10)] == [1, 2, 3, 4]  # the board's default: unique
        board.shallow = 0
        assert [e.rank for e in await board.entries(1, 2, rank_mode="competition")] == [1, 1]
        got = await board.player("b", rank_mode="competition")
        assert (got.entry.rank, got.players, got.percentile) == (1, 4, 25.0)
        assert [e.rank for e in await board.around("d", 1, rank_mode="competition")] == [1, 4]
        assert [e.rank for e in await board.query(["d", "c"], rank_mode="competition")] == [1, 4]
        with pytest.raises(InvalidInput) as err:
            await board.top(10, rank_mode="dense")
        assert (err.value.field, err.value.code) == ("rank_mode", "invalid_parameter")
    finally:
        await store.delete(config.id)
