"""A settlement of a closed period while the board is resharded (shardlb/reshard.py): the archive's
rows name the old layout's shards until the mover re-homes them, and the old layout's journals
may still hold results the archiver has not taken. The settlement must wait (a retryable refusal)
or pay the true order; never pay an order that lacks results the board acknowledged."""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest

from shardlb import times
from shardlb.board import Board, Score
from shardlb.errors import Overloaded
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Resharder
from shardlb.settlement import Request, Settler, period_bounds
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_settlement import TABLE, awards_of, day_ago, db, drain, expected_awards, new_board

pytestmark = pytest.mark.cluster
__all__ = ["db"]  # the fixture, shared with tests/test_settlement.py


async def post(board: Board, ref: ReferenceBoard, period: str, seed: str, batches: int = 4) -> None:
    """Results inside ``period`` (some retried), sent with the clock at its last millisecond."""
    rng = random.Random(seed)
    start, end = period_bounds(board, board.resolve(period).period)
    end = min(end, times.now_ms())
    for b in range(batches):
        scores = [
            Score(
                f"p{rng.randrange(40):03d}",
                rng.randrange(1, 50),
                f"{seed}-{b}-{n}",
                rng.randrange(start, end, 1000),
            )
            for n in range(30)
        ]
        await board.submit(scores, now_ms=end - 1)
        ref.submit(scores, now_ms=end - 1)


@pytest.mark.parametrize("force", [False, True])
async def test_a_settlement_during_a_reshard_pays_the_true_order_or_waits(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    postgres_url: str,
    force: bool,
) -> None:
    board = await new_board(store, f"settle-reshard-{force}-{random.randrange(10**9)}", "incr")
    period = day_ago(2)
    ref = ReferenceBoard(board.config)
    try:
        await post(board, ref, period, "before")
        await drain(raw, store, postgres_url)
        mover = Resharder(store, board.config.id, say=lambda _: None, postgres_url=postgres_url,
                          cache_s=0, drain_s=0.2)  # fmt: skip
        record = await mover.start(5)
        await mover._copy(record)
        await post(board, ref, period, "tracked")  # on the old layout, tracked; not archived yet
        status = await mover.run()  # cut over; the old journals are not drained: it stops there
        assert status["state"] == "committed" and status["to_shards"] == 5
        fresh = await store.get(board.config.id)
        sid = f"sr-{board.config.id}"
        request = Request.of({"settlement_id": sid, "rewards": TABLE, "force": force})
        try:
            await Settler(rebuilder, drain_wait_s=0.5).settle(fresh, period, request)
        except Overloaded:  # a retryable refusal: the archive catches up, the mover finishes
            await drain(raw, store, postgres_url)
            assert (await mover.run())["state"] == "none"
            fresh = await store.get(board.config.id)
            await Settler(rebuilder).settle(fresh, period, request)
        assert await awards_of(db, sid) == expected_awards(ref, period, fresh)
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("at", ["copying", "committed"])
async def test_a_settlement_during_a_reshard_whose_shard_was_lost_alone_pays_nothing(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    postgres_url: str,
    at: str,
) -> None:
    """A shard lost alone while the board is resharded (of the old layout while it is copied, of
    the new one after the cut-over: the archiver marks neither while the record names the reshard):
    a forced settlement of a closed period is refused for a retry and pays nothing, where a check
    merging the shards left would pay an order without the lost shard's players. It is refused
    for the reshard itself (``Settler._at_rest``: the record's reshard, whatever its shards hold),
    before its freeze; a pinning test (it held when written, 2026-12-06)."""
    from shardlb.errors import Rebuilding, Resharding
    from tests.test_shard_loss import slot_wiped

    board = await new_board(store, f"settle-reshard-lost-{at}-{random.randrange(10**9)}", "incr")
    period = day_ago(2)
    ref = ReferenceBoard(board.config)
    try:
        await post(board, ref, period, "before")
        await drain(raw, store, postgres_url)
        mover = Resharder(store, board.config.id, say=lambda _: None, postgres_url=postgres_url,
                          cache_s=0, drain_s=0)  # fmt: skip
        await mover.start(5)
        if at == "committed":
            await post(board, ref, period, "tracked")  # not archived: the finish waits for them
            assert (await mover.run())["state"] == "committed"
        fresh = await store.get(board.config.id)
        assert fresh.resharding and await slot_wiped(raw, fresh, 1) > 0
        sid = f"srl-{board.config.id}"
        request = Request.of({"settlement_id": sid, "rewards": TABLE, "force": True})
        with pytest.raises((Resharding, Rebuilding)):
            await Settler(rebuilder, drain_wait_s=0.2).settle(fresh, period, request)
        assert await awards_of(db, sid) == []
        cur = await db.execute("SELECT state FROM settlements WHERE settlement_id = %s", (sid,))
        assert all(row[0] != "settled" for row in await cur.fetchall())
    finally:
        await store.delete(board.config.id)
