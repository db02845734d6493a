"""The time an incr board keeps for a player (write.lua, rebuild.lua, Fold, settlement's SQL).

A player's time is the latest of their results that scored (points > 0); a result of 0 points
leaves it as it is, so it moves nobody below the players tied with them. A player whose results all
scored 0 is at the earliest of them. Both are properties of the set of results, whatever the order
they arrive in (docs/design-notes.md, "Writes", the incr time).
"""

from __future__ import annotations

import itertools
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlb import periods, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import expected_entries, sharding

pytestmark = pytest.mark.cluster

MINUTE = 60_000


async def incr_board(store: BoardStore, strategy: str, tiebreak: str, order: str = "desc") -> Board:
    body = {
        "mode": "incr",
        "order": order,
        "tiebreak": tiebreak,
        "periods": ["daily"],
        "points_max": 1000,
        "sharding": sharding(strategy, 3),
    }
    board, _ = await store.create(BoardConfig.from_dict(f"incr-times-{uuid.uuid4().hex[:10]}", body))
    return board


def first_time(board: Board, now: int) -> int:
    """Half an hour before ``now`` in whole seconds (the board keeps seconds), or the first second
    of ``now``'s day when that is earlier: the tests' results, up to 4 minutes after it, fall in
    ``now``'s day (soon after midnight, half an hour back was the day before) and at most 4 minutes
    ahead of ``now`` (the write path takes up to 5)."""
    day = periods.names_at(now, board.config.periods, board.tz)[1]
    return max((now - 30 * MINUTE) // 1000 * 1000, periods.start_ms(day, board.tz) + 1000)


def region(board: Board) -> str | None:
    regions = list(board.config.sharding.regions)
    return regions[0] if regions else None


async def listed(board: Board, api: str = "total", limit: int = 10) -> list[tuple[str, int, int]]:
    return [(e.player_id, e.points, e.achieved_ms) for e in await board.top(limit, board.resolve(api))]


@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
async def test_a_result_of_no_points_moves_nobody_among_players_tied_on_their_sum(
    store: BoardStore, strategy: str, tiebreak: str
) -> None:
    """a reaches 50 before b; a then posts a 0-point match after b reached 50. a keeps the time it
    reached 50 at, in the total and the day: under `earliest` still ahead of b, under `latest`
    still behind (until 2026-12-05 a took the 0-point match's time: behind b, or ahead)."""
    board = await incr_board(store, strategy, tiebreak)
    now = times.now_ms()
    t0 = first_time(board, now)
    where = region(board)
    day = "daily:" + periods.names_at(now, board.config.periods, board.tz)[1][2:]
    try:
        await board.submit([Score("a", 30, "m1", t0, where), Score("b", 30, "m1", t0, where)], now_ms=now)
        await board.submit([Score("a", 20, "m2", t0 + MINUTE, where)], now_ms=now)
        await board.submit([Score("b", 20, "m2", t0 + 2 * MINUTE, where)], now_ms=now)
        first = ["a", "b"] if tiebreak == "earliest" else ["b", "a"]
        assert [p for p, _, _ in await listed(board)] == first
        [r] = await board.submit([Score("a", 0, "m3", t0 + 3 * MINUTE, where)], now_ms=now)
        assert (r.status, r.points) == ("unchanged", 50)
        want = [(p, 50, t0 + (MINUTE if p == "a" else 2 * MINUTE)) for p in first]
        assert await listed(board) == want
        assert await listed(board, day) == want
        # A retry of it is still a duplicate, and a score after it takes the score's time.
        [r] = await board.submit([Score("a", 0, "m3", t0 + 3 * MINUTE, where)], now_ms=now)
        assert (r.status, r.points) == ("duplicate", 50)
        await board.submit([Score("a", 5, "m4", t0 + 4 * MINUTE, where)], now_ms=now)
        assert (await listed(board))[0] == ("a", 55, t0 + 4 * MINUTE)
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
async def test_a_player_of_no_points_is_at_the_earliest_of_their_results_in_any_arrival_order(
    store: BoardStore, strategy: str
) -> None:
    """Three 0-point results, in each of their six orders, one a call or all in one: the player is
    at the first one's time, and only a result that moves them there says `improved`. A score then
    takes its own time, even one achieved before their 0-point results."""
    board = await incr_board(store, strategy, "earliest", "asc")
    now = times.now_ms()
    t0 = first_time(board, now)
    where = region(board)
    day = "daily:" + periods.names_at(now, board.config.periods, board.tz)[1][2:]
    ref = ReferenceBoard(board.config)
    try:
        for n, orders in enumerate(itertools.permutations([2, 0, 1])):
            player = f"z{n}"
            scores = [Score(player, 0, f"m{k}", t0 + k * MINUTE, where) for k in orders]
            calls = [scores] if n % 2 else [[s] for s in scores]
            for call in calls:
                got = await board.submit(call, now_ms=now)
                assert [(r.status, r.points) for r in got] == ref.submit(call, now_ms=now)
            got = await board.submit(scores, now_ms=now)  # retries
            assert [(r.status, r.points) for r in got] == ref.submit(scores, now_ms=now)
            assert [r.status for r in got] == ["duplicate"] * 3
            assert ref.boards["total"][player] == (0, ref.codec.time_units(t0))
        assert await listed(board) == [(f"z{n}", 0, t0) for n in range(5, -1, -1)]
        assert await listed(board, day) == [(f"z{n}", 0, t0) for n in range(5, -1, -1)]
        for n in range(6):
            scored = [Score(f"z{n}", 3, "late", t0 - MINUTE, where)]
            got = await board.submit(scored, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(scored, now_ms=now)
        assert await listed(board) == expected_entries_as_rows(ref)
        assert all(at == t0 - MINUTE for _, _, at in await listed(board))
    finally:
        await store.delete(board.config.id)


def expected_entries_as_rows(ref: ReferenceBoard) -> list[tuple[str, int, int]]:
    return [(e.player_id, e.points, e.achieved_ms) for e in expected_entries(ref, "total", None)]


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_the_board_does_not_depend_on_the_order_results_arrive_in(
    store: BoardStore, data: st.DataObject
) -> None:
    """One set of results (many of 0 points, on few times: ties on the sum are common) sent to two
    boards in two orders, in calls of random sizes, with retries: both hold what the reference
    holds, in every period."""
    tiebreak = data.draw(st.sampled_from(["earliest", "latest"]), "tiebreak")
    strategy = data.draw(st.sampled_from(["hash", "band", "region"]), "strategy")
    one = st.tuples(st.integers(0, 7), st.sampled_from([0, 0, 0, 1, 2, 40]), st.sampled_from([0, 1, 2, 1800]))
    results = data.draw(st.lists(one, min_size=1, max_size=60), "results")
    now = times.now_ms()
    boards = [await incr_board(store, strategy, tiebreak) for _ in range(2)]
    try:
        where = region(boards[0])
        scores = [Score(f"p{p}", n, f"m{i}", now - t * MINUTE, where) for i, (p, n, t) in enumerate(results)]
        ref = ReferenceBoard(boards[0].config)
        ref.submit(scores, now_ms=now)
        for board in boards:
            sent = data.draw(st.permutations(scores), "order")
            sent += data.draw(st.lists(st.sampled_from(scores), max_size=5), "retries")
            while sent:
                size = data.draw(st.integers(1, len(sent)), "call")
                await board.submit(sent[:size], now_ms=now)
                sent = sent[size:]
        for name in ref.boards:
            api = "total" if name == "total" else "daily:" + name[2:]
            want = [(e.player_id, e.points, e.achieved_ms) for e in expected_entries(ref, name, None)]
            for board in boards:
                assert await listed(board, api, len(want) + 1) == want, (name, board.config.id)
    finally:
        for board in boards:
            await store.delete(board.config.id)
