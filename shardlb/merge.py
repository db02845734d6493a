"""Pure helpers for cross-shard reads: the one total order, k-way merge, de-duplication, ranks.

The order: a higher score first; equal scores by player id, larger bytes first. That is exactly the
order ZREVRANGE returns inside one shard, so merging shard lists keeps it, and ``(score, player)``
tuples compare in it directly (all ids are ASCII, where str order is byte order).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

Row = tuple[float, str]


def rows(pairs: Sequence[Any]) -> list[Row]:
    """redis-py's ``(member, score)`` pairs as ``(score, member)`` rows."""
    return [(score, member) for member, score in pairs]


def merge(lists: Iterable[Sequence[Row]]) -> list[Row]:
    """K-way merge of lists already in board order (best first) into one list in board order."""
    return list(heapq.merge(*lists, reverse=True))


def unique(merged: Iterable[Row]) -> list[Row]:
    """Keep each player's first (best) row. Only band boards, mid-move, can list a player twice."""
    seen: set[str] = set()
    out: list[Row] = []
    for row in merged:
        if row[1] not in seen:
            seen.add(row[1])
            out.append(row)
    return out


def competition(points: Sequence[int], start: int, first: int) -> list[int]:
    """Competition ranks (1, 1, 3) of consecutive rows of the board order, from their points.

    ``start`` is the unique rank of the first row and ``first`` its competition rank (its run of
    equal points may begin above the listing). A later row with the points of the row before it
    shares that row's rank; any other row begins a run, and everyone ahead of it in the order has
    strictly better points, so its competition rank is its unique rank.
    """
    out: list[int] = []
    for i, value in enumerate(points):
        if i == 0:
            out.append(first)
        else:
            out.append(out[-1] if value == points[i - 1] else start + i)
    return out
