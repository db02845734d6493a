"""``players:query`` on a hash board (shardlb/board.py, ``Board._ranked_at_home``).

Each friend's row and the rows ahead of them in their home shard come from one places.lua call per
home shard (ZMSCORE and ZREVRANK together); the other shards only count. Checked on a real cluster
against the in-memory reference board on many ties, with the commands sent counted by
``INFO commandstats``.
"""

from __future__ import annotations

import random

import pytest

from shardlb import times
from shardlb.board import Score
from shardlb.store import BoardStore
from tests.test_band_reads import command_calls
from tests.test_board import expected_entries, hash_board_with_reference

pytestmark = pytest.mark.cluster

SENT = ("zmscore", "zrevrank", "zcount", "evalsha")


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_friends_on_a_hash_board_take_their_home_place_with_their_score(
    store: BoardStore, order: str
) -> None:
    rng = random.Random(f"hash-friends/{order}")
    board_id = f"hash-friends-{order}"
    board, ref = await hash_board_with_reference(store, board_id, order)
    now = times.now_ms()
    players = [f"p{i:02d}" for i in range(60)]
    try:
        for round_no in range(3):  # few points, one time: many exact ties on every shard
            batch = [Score(p, rng.randrange(0, 12), f"m{round_no}", now) for p in rng.sample(players, 40)]
            await board.submit(batch, now_ms=now)
            ref.submit(batch, now_ms=now)
            want = expected_entries(ref, "total", None)
            for _ in range(8):
                ids = [*rng.sample(players, rng.randint(1, 25)), "nobody"]
                assert await board.query(ids) == [e for e in want if e.player_id in ids]
        assert await board.query(["nobody", "ghost"]) == []

        view = board.resolve()
        ids = [*rng.sample([e.player_id for e in want], 20), "nobody"]
        homes = {board._home_index(p, view) for p in ids}
        before = await command_calls(board, SENT)
        assert await board.query(ids) == [e for e in want if e.player_id in ids]
        after = await command_calls(board, SENT)
        sent = {c: after[c] - before[c] for c in SENT}
        # One ZMSCORE per home shard asked, one ZREVRANK per friend found (at home), two ZCOUNTs
        # per friend on each of the two other shards; places.lua per home shard, counts.lua per shard.
        assert sent == {
            "zmscore": len(homes),
            "zrevrank": 20,
            "zcount": 2 * 2 * 20,
            "evalsha": len(homes) + 3,
        }
    finally:
        await store.delete(board_id)
