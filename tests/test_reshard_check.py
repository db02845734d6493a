"""The check before a reshard's cut-over (shardlb/reshard_check.py), on the session cluster: a new
layout that lost a member or holds a wrong score is not cut over to; the old layout takes writes
again, and a resume copies the board afresh and cuts over with every player."""

from __future__ import annotations

import os
import random

import pytest

from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.reshard import Resharder
from shardlb.reshard_check import SAMPLE, Mismatch
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster


async def test_a_new_layout_that_lost_a_member_or_a_score_is_not_cut_over_to(store: BoardStore) -> None:
    board_id = f"rc-{os.getpid()}-{random.randrange(10**9)}"
    sharding = {"strategy": "hash", "shards": 2}
    body = {"mode": "incr", "periods": ["daily"], "durability": "memory", "sharding": sharding}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    players = SAMPLE  # no more than SAMPLE on an old shard: every score is in the sample
    await board.submit([Score(f"p{i}", 10 + i, f"m{i}") for i in range(players)])
    mover = Resharder(store, board_id, say=lambda _: None, cache_s=0)
    record = await mover.start(3)
    _, target = mover._layouts(record)
    record = await mover._copy(record)
    client = store.client
    # Between the copy and the cut-over, one new shard loses a player, another gets a wrong score.
    held = [(p, await client.zrange(p + "total", 0, -1, withscores=True)) for p in target.prefixes]
    (short, [(lost, _), *_]), (other, [(changed, score), *_]) = [(p, m) for p, m in held if m][:2]
    await client.zrem(short + "total", lost)
    await client.zadd(other + "total", {changed: score + 1})

    with pytest.raises(Mismatch) as refused:
        await mover._seal(record)
    message = str(refused.value)
    assert f"total: {players} members on the old layout, {players - 1} on the new" in message
    assert "sampled members differ" in message and "resume the reshard" in message
    status = await mover.status()
    assert (status["state"], status["shards_copied"]) == ("copying", 0)
    assert not any([await client.exists(p + "total") for p in target.prefixes])  # dropped
    # The old layout takes writes again (tracked: the resume copies them too).
    old = await store.get(board_id)
    assert old.config.sharding.shards == 2
    await old.submit([Score("late", 7, "m-late"), Score(lost, 1, "m-again")])
    before = await old.top(100)
    assert len(before) == players + 1

    assert (await Resharder(store, board_id, say=lambda _: None, cache_s=0).run())["state"] == "none"
    after = await store.get(board_id)
    assert after.config.sharding.shards == 3
    assert await after.top(100) == before


async def test_a_band_layout_whose_band_lost_a_player_is_not_cut_over_to(store: BoardStore) -> None:
    board_id = f"rc-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "best", "durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    await board.submit([Score(f"p{i}", 10 + i, f"m{i}") for i in range(SAMPLE)])
    before = await board.top(100)
    mover = Resharder(store, board_id, say=lambda _: None, cache_s=0)
    record = await mover.start(2, [0, 15, 20])
    _, target = mover._layouts(record)
    record = await mover._copy(record)
    band = target.prefixes[target.layout.band_shard(30)]  # the top band: p10 and up
    await store.client.zrem(band + "total", "p12")  # its home shard still holds its total

    with pytest.raises(Mismatch) as refused:
        await mover._seal(record)
    assert f"bands: {SAMPLE - 1} players in the new bands, {SAMPLE} totals on the old layout" in str(
        refused.value
    )
    assert "sampled members differ" in str(refused.value)

    assert (await Resharder(store, board_id, say=lambda _: None, cache_s=0).run())["state"] == "none"
    after = await store.get(board_id)
    assert after.layout.strategy == "band"
    assert await after.top(100) == before
