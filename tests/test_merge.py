"""shardlb/merge.py, server-free: competition ranks of a listing against a count over the whole board."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shardlb.merge import competition


def test_equal_points_share_the_rank_of_their_run() -> None:
    assert competition([9, 9, 7, 7, 7, 2], 1, 1) == [1, 1, 3, 3, 3, 6]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.data())
def test_any_window_of_a_board_gets_the_ranks_counted_on_the_whole_board(
    values: list[int], data: st.DataObject
) -> None:
    board = sorted(values, reverse=True)  # points, best first, as the board order lists them
    counted = [1 + sum(other > points for other in board) for points in board]
    start = data.draw(st.integers(0, len(board) - 1))
    end = data.draw(st.integers(start + 1, len(board)))
    assert competition(board[start:end], start + 1, counted[start]) == counted[start:end]
