"""What a board keeps beside its scores, through an online reshard (shardlb/reshard.py): dedup
records, pins, removal records, the activity set, frozen periods and a closed board. Each must hold
on the new layout exactly as on the old one, including what changed while the old one was tracked."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from shardlb import keys, moderation, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.errors import BoardClosed
from shardlb.reshard import Resharder
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

DAY_MS = 86_400_000


async def make_board(store: BoardStore, shards: int, **extra: Any) -> Board:
    board_id = f"rst-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "incr", "periods": ["daily"], "durability": "memory",
            "sharding": {"strategy": "hash", "shards": shards}, **extra}  # fmt: skip
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    return board


async def activity(board: Board) -> dict[str, float]:
    out: dict[str, float] = {}
    for prefix in board.prefixes:
        for player, at in await board.client.zrange(keys.activity_key(prefix), 0, -1, withscores=True):
            assert str(player) not in out, f"{player} active on two shards"
            out[str(player)] = at
    return out


async def test_dedup_pins_removals_activity_and_frozen_periods_survive_a_reshard(store: BoardStore) -> None:
    board = await make_board(store, 2)
    now = times.now_ms()
    yesterday = now - DAY_MS
    players = [f"p{i:02d}" for i in range(30)]
    before = [Score(p, 5, f"a-{p}", yesterday) for p in players]  # in yesterday's period
    pinned = [Score(p, 3, f"pin-{p}") for p in players[:10]]  # no time: pinned to the first seen
    await board.submit(before + pinned, now)
    yesterday_view = board.resolve(f"daily:{times.format_ms(yesterday)[:10]}", now_ms=now)
    await board.freeze(yesterday_view.period)
    await moderation.remove(board, ["p03"])
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    record = await mover.start(5)
    record = await mover._copy(record)  # copied; the old layout is tracked from here to the seal
    during = [Score(p, 7, f"b-{p}", now - 1000) for p in players[10:20]]
    more_pins = [Score(p, 2, f"pin2-{p}") for p in players[20:25]]
    await board.submit(during + more_pins, now + 10)
    await moderation.remove(board, ["p12"])
    late = [Score(p, 11, f"late-{p}", yesterday) for p in players[25:]]  # into the frozen period
    await board.submit(late, now + 20)
    seen_before = await activity(board)
    old_top = await board.top(100)
    old_yesterday = await board.top(100, yesterday_view)
    await mover.run()

    fresh = await store.get(board.config.id)
    assert fresh.config.sharding.shards == 5
    assert await fresh.top(100) == old_top
    yview = fresh.resolve(yesterday_view.api, now_ms=now)
    assert await fresh.top(100, yview) == old_yesterday
    assert await fresh.frozen(yview.period)
    # Every retry after the cut-over is a duplicate: none counts twice, none brings a removed player back.
    retried = await fresh.submit(before + pinned + during + more_pins, now + 30_000)
    assert {r.status for r in retried} == {"duplicate"}, [r for r in retried if r.status != "duplicate"]
    assert await fresh.top(100) == old_top
    # A new result dated in the frozen period counts in the total, not in the period.
    got = await fresh.submit([Score("p00", 4, "c-p00", yesterday)], now + 40_000)
    assert got[0].status == "improved" and got[0].closed == (yview.api,)
    assert await fresh.top(100, yview) == old_yesterday
    assert await activity(fresh) == seen_before
    await store.delete(board.config.id)


async def test_a_closed_board_stays_closed_through_a_reshard(store: BoardStore) -> None:
    board = await make_board(store, 3)
    now = times.now_ms()
    await board.submit([Score(f"p{i}", 5, f"m{i}", now - 1000) for i in range(20)], now)
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    record = await mover.start(4)
    await mover._copy(record)
    await board.close()  # while the old layout is tracked, after its copy
    top = await board.top(50)
    await mover.run()
    fresh = await store.get(board.config.id)
    assert await fresh.closed()
    with pytest.raises(BoardClosed):
        await fresh.submit([Score("q", 9, "q1", now)], now + 1000)
    assert await fresh.top(50) == top
    await store.delete(board.config.id)


async def test_the_per_minute_rate_limit_holds_through_a_reshard(store: BoardStore) -> None:
    """rate.lua's counters (the (match, player) pairs counted this minute and each player's count)
    were left behind on the old layout: after the cut-over a player at the limit could post as
    many results again in the same minute, and a retry of a result applied before it was counted
    anew, so it could be refused as past the limit (and recorded as refused) though it is on the
    board. They are copied with the board, counted before the reshard or while it copies."""
    board = await make_board(store, 2, max_results_per_player_per_minute=2)
    screen = moderation.Screen(lambda _board, _player, _incarnation: False)
    # The start of this minute: the posts below, 2 s apart at most, count in one minute (from a
    # time in a minute's last seconds the third fell in the next one, answered improved).
    now = times.now_ms() // 60_000 * 60_000
    first, second = Score("p1", 5, "m1", now), Score("p1", 6, "m2", now)

    async def post(target: Board, score: Score, at: int) -> list[str]:
        refused = await screen.refusals(target, target.prepare([score], at), at)
        if refused:
            return [r.status for r in refused]
        return [r.status for r in await target.submit([score], at)]

    assert await post(board, first, now) == ["improved"]
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    record = await mover.start(3)
    await mover._copy(record)  # copied; the old layout is tracked from here to the seal
    assert await post(board, second, now + 10) == ["improved"]
    await mover.run()
    fresh = await store.get(board.config.id)
    assert fresh.config.sharding.shards == 3
    # A third result in the same minute is past the limit; the retries are duplicates.
    assert await post(fresh, Score("p1", 7, "m3", now), now + 1_000) == ["rate_limit"]
    assert await post(fresh, first, now + 2_000) == ["duplicate"]
    assert await post(fresh, second, now + 2_000) == ["duplicate"]
    assert [(e.player_id, e.points) for e in await fresh.top(5)] == [("p1", 11)]
    await store.delete(board.config.id)
