"""An incr board's dedup across routers whose clocks differ: a result first taken by a router whose
clock is a little ahead, just past a dedup bucket's start, is recognised when its retry reaches a
router whose clock is still before that start (write.lua looks in the bucket after the current one
too). Against the suite's cluster."""

from __future__ import annotations

import pytest

from shardlb import times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("ahead_ms", [5, 60_000])
async def test_a_retry_through_a_router_whose_clock_is_behind_is_a_duplicate(
    store: BoardStore, ahead_ms: int
) -> None:
    config = BoardConfig.from_dict(f"dedup-clocks-{ahead_ms}", {"mode": "incr", "sharding": {"shards": 3}})
    board, _ = await store.create(config)
    try:
        length = config.dedup_bucket_ms
        start = times.now_ms() // length * length  # the current bucket's start, already passed
        result = Score("p1", 10, "match-1", start - 3_600_000)
        first = await board.submit([result], now_ms=start + ahead_ms // 2)  # router A, ahead
        retry = await board.submit([result], now_ms=start - ahead_ms // 2)  # router B, behind
        assert [(r.status, r.points) for r in first + retry] == [("improved", 10), ("duplicate", 10)]
        again = await board.submit([result], now_ms=start + ahead_ms)  # and back through A
        assert [(r.status, r.points) for r in again] == [("duplicate", 10)]
    finally:
        await store.delete(config.id)
