"""A result applied again (a client's retry of the identical result) after one of its periods closed:
the retry skips that period, but the first application is in it, on the board as in the archive.
PostgreSQL must keep the result in the period, or settling the period pays without its winner
(a mismatch, and `force` pays PostgreSQL's order). With a removal of the player between the two,
the retry alone counts, as on the board. Against the suite's cluster and PostgreSQL."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from shardlb import keys, moderation, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Score
from shardlb.journal import GROUP
from shardlb.rebuild import Rebuilder
from shardlb.settlement import Request, Settler, period_bounds
from shardlb.store import BoardStore
from tests import test_settlement
from tests.test_settlement import TABLE, awards_of, day_ago, drain, new_board

pytestmark = pytest.mark.cluster
db = test_settlement.db  # the fixture: a PostgreSQL connection


@pytest.mark.parametrize("removed", [False, True])
@pytest.mark.parametrize("rounds", ["two rounds", "one round"])
@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_retry_after_a_period_closed_keeps_the_result_in_it_unless_removed_between(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    mode: str,
    rounds: str,
    removed: bool,
) -> None:
    sid = f"retry-{'removed' if removed else 'closed'}-{mode}-{rounds[:3]}"
    board = await new_board(store, sid, mode)
    period = day_ago(2)
    start, end = period_bounds(board, board.resolve(period).period)
    try:
        scores = [Score(f"p{i}", 10 + i, f"m{i}", start + 1000 * i) for i in range(5)]
        await board.submit(scores, now_ms=end - 1)  # the period open: applied to it
        if rounds == "two rounds":
            await drain(raw, store, rebuilder.db.info.dsn)
        if removed:
            await moderation.remove(board, ["p4"])  # out of every period
            again = await board.submit([scores[4]], now_ms=times.now_ms())
            assert again[0].status == "duplicate"  # within the dedup window the removal refuses it
            for prefix in board.prefixes:  # the window over: the shard's record of removals expired
                await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
        retried = await board.submit([scores[4]], now_ms=times.now_ms())  # the winner's post again, closed
        assert retried[0].closed == (period,)
        await drain(raw, store, rebuilder.db.info.dsn)
        top = await board.top(10, board.resolve(period))
        assert [e.player_id for e in top][:1] == (["p3"] if removed else ["p4"])  # back in the open ones only
        result = await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": sid, "rewards": TABLE})
        )
        assert result["forced"] is False and result["players"] == (4 if removed else 5)
        assert (await awards_of(db, sid))[0][1:] == ("p3" if removed else "p4", "gold")
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("better", [False, True])
@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_first_application_archived_after_its_retry_keeps_the_result_in_its_period(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    db: psycopg.AsyncConnection[Any],
    mode: str,
    better: bool,
) -> None:
    """The same, with the two applications archived in the other order: an archiver read the first
    and died before its commit, another archived the retry, and the first came in once it was
    taken over (XAUTOCLAIM; two archivers at once do the same). The upsert kept the retry's row,
    which skips the period, and nothing of the first: the period lost its winner in PostgreSQL.
    With ``better`` the post sent again is a better score of the match (a correction), which
    replaces the row: the first application must then be held for the period."""
    sid = f"retry-late-{mode}-{better}"
    board = await new_board(store, sid, mode)
    period = day_ago(2)
    start, end = period_bounds(board, board.resolve(period).period)
    journals = [keys.journal_key(p) for p in board.prefixes]
    try:
        scores = [Score(f"p{i}", 10 + i, f"m{i}", start + 1000 * i) for i in range(5)]
        await board.submit(scores, now_ms=end - 1)  # the period open: applied to it
        for key in journals:  # an archiver reads the first applications and dies before its commit
            if await raw.exists(key):
                await raw.xgroup_create(key, GROUP, id="0")
                await raw.xreadgroup(GROUP, "dead", {key: ">"})
        again = scores[4]._replace(points=99) if better else scores[4]
        retried = await board.submit([again], now_ms=times.now_ms())  # the winner's post again, closed
        assert retried[0].closed == (period,)
        late = Archiver(raw, store, await connect_db(rebuilder.db.info.dsn), "late", claim_idle_s=3600)
        try:
            await late.refresh()
            while await late.round():  # the retry alone: the first applications stay with "dead"
                pass
        finally:
            await late.db.close()
        await drain(raw, store, rebuilder.db.info.dsn)  # takes them over
        top = await board.top(10, board.resolve(period))
        assert [(e.player_id, e.points) for e in top][:1] == [("p4", 14)]
        result = await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": sid, "rewards": TABLE})
        )
        assert result["forced"] is False and result["players"] == 5
        assert (await awards_of(db, sid))[0][1:] == ("p4", "gold")
    finally:
        await store.delete(board.config.id)
