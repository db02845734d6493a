"""The periods a board still keeps in Redis (shardlb/settlement_history.py, ``kept``), on the suite's
cluster: what ``GET /v1/boards/{board}/periods`` answers as ``kept``."""

from __future__ import annotations

import pytest

from shardlb import keys, periods, settlement_history, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

DAY_MS = 86_400_000


async def test_a_period_whose_keys_have_expired_is_not_kept(store: BoardStore) -> None:
    """A shard's key index lists a period's key until a later write drops the listings of expired
    keys: on a board that took no write since, the listing outlives the key. Such a period was
    answered ``kept`` although Redis held nothing of it (and its reads answer it empty)."""
    config = BoardConfig.from_dict("kept-expired", {"periods": ["daily"], "retention_days": {"daily": 1}})
    board, _ = await store.create(config)
    now = times.now_ms()
    then = now - 5 * DAY_MS  # the day's keys expired three days ago, and no write came since
    old, today = (periods.names_at(at, config.periods, board.tz)[1] for at in (then, now))
    try:
        await board.submit([Score("a", 1, "m1", then)], now_ms=then)
        shard = board.prefixes[board.layout.home("a")]
        assert not await board.client.exists(keys.period_key(shard, old))
        assert await board.client.zscore(keys.index_key(shard), keys.period_key(shard, old)) is not None
        assert old not in await settlement_history.kept(board)

        await board.submit([Score("b", 1, "m2", now)], now_ms=now)
        assert await settlement_history.kept(board) == {today}
    finally:
        await store.delete(config.id)
