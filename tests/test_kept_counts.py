"""``max_age_ms`` on a hash board (shardlb/board.py, ``Board._rank_of``).

A player read that way has their other shards' counts kept; a later such read, while those are no
older than asked and the player's home shard still holds the score they were counted at, adds them
to the home shard's fresh place and size: one round to one node. Checked on a real cluster against
the in-memory reference board, before and after writes move other players past them, with the
commands the read sends counted by ``INFO commandstats``.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from shardlb import times
from shardlb.board import Board, Entry, Score
from shardlb.store import BoardStore
from tests.test_band_reads import command_calls
from tests.test_board import expected_entries, hash_board_with_reference

pytestmark = pytest.mark.cluster

COUNTING = ("zcount", "zrangebyscore")  # what the other shards answer an exact rank with


def stale_rank(board: Board, then: list[Entry], now: list[Entry], player: str) -> tuple[int, int]:
    """(rank, players) from the home shard's rows now and the other shards' rows ``then``."""
    view = board.resolve()
    home = board._home_index(player, view)

    def at_home(e: Entry) -> bool:
        return board._home_index(e.player_id, view) == home

    ahead_now = next(i for i, e in enumerate(now) if e.player_id == player)
    ahead_then = next(i for i, e in enumerate(then) if e.player_id == player)
    rank = 1 + sum(at_home(e) for e in now[:ahead_now]) + sum(not at_home(e) for e in then[:ahead_then])
    return rank, sum(at_home(e) for e in now) + sum(not at_home(e) for e in then)


@pytest.mark.parametrize("order", ["desc", "asc"])
async def test_my_rank_with_max_age_on_a_hash_board_keeps_the_other_shards_counts(
    store: BoardStore, order: str
) -> None:
    rng = random.Random(f"hash-max-age/{order}")
    board_id = f"hash-max-age-{order}"
    board, ref = await hash_board_with_reference(store, board_id, order)
    now = times.now_ms()
    players = [f"p{i:02d}" for i in range(45)]

    async def write(round_no: int, who: list[str]) -> None:
        batch = [Score(p, rng.randrange(0, 60), f"m{round_no}", now) for p in who]  # ties of points
        await board.submit(batch, now_ms=now)
        ref.submit(batch, now_ms=now)

    try:
        await write(0, players)
        then = expected_entries(ref, "total", None)
        started = times.now_ms()
        for e in then:  # each player's first such read is exact, and keeps the other shards' part
            got = await board.player(e.player_id, max_age_ms=60_000)
            assert (got.entry, got.players) == (e, len(then))
            assert got.counts_ms is not None and got.counts_ms >= started
        kept_at = times.now_ms()
        for e in then:  # nothing written since: the kept counts are the board's
            got = await board.player(e.player_id, max_age_ms=60_000)
            assert (got.entry, got.players) == (e, len(then))
            assert got.counts_ms is not None and started <= got.counts_ms <= kept_at

        await write(1, rng.sample(players, 30))
        await write(2, [f"new{i}" for i in range(6)])  # new players on every shard
        now_entries = expected_entries(ref, "total", None)
        before = {e.player_id: (e.points, e.achieved_ms) for e in then}
        unchanged = [e for e in now_entries if before.get(e.player_id) == (e.points, e.achieved_ms)]
        assert unchanged and len(unchanged) < len(then)
        stale = 0
        for e in now_entries:
            got = await board.player(e.player_id, max_age_ms=60_000)
            if e in unchanged:  # the home shard now, the other shards as they were counted
                rank, size = stale_rank(board, then, now_entries, e.player_id)
                assert (got.entry.rank, got.entry.points, got.players) == (rank, e.points, size), e
                assert got.counts_ms is not None and got.counts_ms <= kept_at
                stale += (rank, size) != (e.rank, len(now_entries))
            else:  # a new score (or a new player): counted now
                assert (got.entry, got.players) == (e, len(now_entries))
                assert got.counts_ms is not None and got.counts_ms > kept_at
        assert stale  # the writes moved players past some of them on other shards

        before_calls = await command_calls(board, ("zscore", "zrevrank", "zcard", *COUNTING))
        await board.player(unchanged[0].player_id, max_age_ms=60_000)
        after_calls = await command_calls(board, ("zscore", "zrevrank", "zcard", *COUNTING))
        sent = {c: after_calls[c] - before_calls[c] for c in after_calls}
        assert sent == {"zscore": 1, "zrevrank": 1, "zcard": 1, "zcount": 0, "zrangebyscore": 0}

        exact = await board.player(unchanged[0].player_id)  # without max_age_ms: exact, always
        assert (exact.entry, exact.players, exact.counts_ms) == (unchanged[0], len(now_entries), None)
        await asyncio.sleep(0.02)
        for e in now_entries:  # what was kept is older than 10 ms: exact again, and kept again
            got = await board.player(e.player_id, max_age_ms=10)
            assert (got.entry, got.players) == (e, len(now_entries))
        for e in now_entries:
            got = await board.player(e.player_id, max_age_ms=60_000)
            assert (got.entry, got.players) == (e, len(now_entries))
    finally:
        await store.delete(board_id)
