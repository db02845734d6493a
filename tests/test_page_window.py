"""Pages and tops where one hash shard holds far more than its share (``View._best_from``).

Each shard is first asked for a little over its share of the rows wanted; a shard whose every row
made the merged answer is asked again from where it stopped. Players are picked by their home shard
so that the best rows all live on one shard, and pages (through the score bisection) and tops are
compared with the in-memory reference board on a real cluster.
"""

from __future__ import annotations

import pytest

from shardlb import times
from shardlb.board import Score
from shardlb.store import BoardStore
from tests.test_board import expected_entries, hash_board_with_reference

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_a_shard_holding_the_whole_window_is_read_on(store: BoardStore, order: str) -> None:
    board_id = f"page-window-{order}"
    board, ref = await hash_board_with_reference(store, board_id, order)
    now = times.now_ms()
    by_home: dict[int, list[str]] = {0: [], 1: [], 2: []}
    i = 0
    while len(by_home[0]) < 150 or len(by_home[1]) < 40 or len(by_home[2]) < 40:
        player = f"w{i}"
        by_home[board.layout.home(player)].append(player)
        i += 1
    best = by_home[0][:150]  # the best 150 results of the board, all on shard 0
    rest = by_home[1][:40] + by_home[2][:40]
    good, bad = (1000, 10) if order == "desc" else (10, 1000)
    scores = [Score(p, good + n, "m1", now) for n, p in enumerate(best)]
    scores += [Score(p, bad + n % 7, "m1", now) for n, p in enumerate(rest)]  # ties among them
    try:
        await board.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        want = expected_entries(ref, "total", None)
        assert await board.top(100) == want[:100]
        board.shallow = 0  # every page through the bisection and the window below the cut
        for offset, limit in [(0, 50), (10, 50), (90, 100), (140, 30), (149, 6), (160, 50), (200, 50)]:
            assert await board.entries(offset, limit) == want[offset : offset + limit], (offset, limit)
    finally:
        board.shallow = 1000
        await store.delete(board_id)
