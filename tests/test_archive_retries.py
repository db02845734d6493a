"""A result applied again (a client's retry of the identical result) after one of its periods closed:
the retry skips that period, but the first application is in it, on the board as in the archive.
PostgreSQL must keep the result in the period, or settling the period pays without its winner
(a mismatch, and `force` pays PostgreSQL's order). With a removal of the player between the two,
the retry alone counts, as on the board. Against the suite's cluster and PostgreSQL."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
import pytest
from redis.exceptions import ResponseError

from shardlb import keys, moderation, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import Board, Score
from shardlb.errors import SettlementConflict
from shardlb.journal import GROUP
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import reconcile
from shardlb.settlement import Request, Settler, period_bounds
from shardlb.store import BoardStore
from tests import test_settlement
from tests.test_board import sharding
from tests.test_settlement import TABLE, awards_of, day_ago, drain, new_board

pytestmark = pytest.mark.cluster
db = test_settlement.db  # the fixture: a PostgreSQL connection


async def agrees_from_the_archive(
    raw: Any, rebuilder: Rebuilder, board: Board, names: list[str], days: list[str], sid: str
) -> None:
    """With every journal of ``board`` archived, then trimmed (PostgreSQL alone from here), each
    period of ``names`` reconciles without drift, each of ``days`` settles (``sid``-day), and a
    rebuild gives back the boards of ``names`` read before."""
    tops = {n: await board.top(10, board.resolve(n)) for n in names}
    for prefix in board.prefixes:
        await raw.xtrim(keys.journal_key(prefix), maxlen=0)
    drifting = {n for n in names if any(c.drift for c in await reconcile(rebuilder, board, n))}
    settled = {}
    for day in days:
        try:
            request = Request.of({"settlement_id": f"{sid}-{day}", "rewards": TABLE})
            await Settler(rebuilder).settle(board, day, request)
            settled[day] = "paid"
        except SettlementConflict as e:
            settled[day] = e.code
    await rebuilder.rebuild(board)
    rebuilt = {n: await board.top(10, board.resolve(n)) for n in names}
    assert (drifting, settled, rebuilt) == (set(), dict.fromkeys(days, "paid"), tops)


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


async def _window_over(raw: Any, board: Board) -> None:
    """What a dedup window's passing takes away on every shard: the removals' records and the incr
    dedup buckets (best and set results sent with their time keep no pin)."""
    for prefix in board.prefixes:
        await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
        for name in await raw.zrange(keys.index_key(prefix), 0, -1):
            if name.startswith(f"{prefix}dd:".encode()):
                await raw.delete(name)


async def _read_by_dead(raw: Any, board: Board) -> None:
    """An archiver reads every journal's new entries and dies before its commit."""
    for key in (keys.journal_key(p) for p in board.prefixes):
        if await raw.exists(key):
            with contextlib.suppress(ResponseError):  # BUSYGROUP: made by an archiver before
                await raw.xgroup_create(key, GROUP, id="0")
            await raw.xreadgroup(GROUP, "dead", {key: ">"})


async def _archive_live(raw: Any, store: BoardStore, url: str) -> None:
    """Archive what is not held by the dead archiver (its entries are not taken over)."""
    live = Archiver(raw, store, await connect_db(url), "live", claim_idle_s=3600)
    try:
        await live.refresh()
        while await live.round():
            pass
    finally:
        await live.db.close()


@pytest.mark.parametrize("order", ["apart", "together", "first late", "removal late", "twice", "closed"])
@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
@pytest.mark.parametrize("mode", ["best", "set", "incr"])
async def test_a_result_sent_again_past_the_window_after_a_removal_counts_in_postgresql_as_on_the_board(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, mode: str, strategy: str, order: str
) -> None:
    """A removed player's result sent again with the same match id once the dedup window has passed
    (the removal's record and the incr dedup records gone) is taken by Redis: the player is back on
    the board with it alone. PostgreSQL kept the row of before the removal (``best``: a lower score
    sent again, ``set``: an earlier time, ``incr``: any), which the removal rule counts nowhere:
    reconcile showed drift and a rebuild dropped the acknowledged result (until 2026-12-05).
    ``order``: each step archived before the next; all in one round; the first application archived
    last (an archiver died holding it); the removal archived last; removed and sent again twice; the
    first sent while a period was open that is closed when it is sent again (the board has the player
    in the total alone, and no period keeps the first: the removal took it out)."""
    sid = f"again-{mode}-{strategy}-{order.replace(' ', '-')}"
    url = rebuilder.db.info.dsn
    board = await new_board(store, sid, mode, sharding=sharding(strategy, 3))
    region = "r0" if strategy == "region" else None
    t0, first_at = times.now_ms() - 120_000, None
    if order == "closed":
        start, end = period_bounds(board, board.resolve(day_ago(2)).period)
        t0, first_at = start + 60_000, end - 1
    again = {"best": [50, 30], "set": [100, 100], "incr": [100, 100]}[mode]
    sent = [Score("P", 100, "m1", t0, region)] + [
        Score("P", points, "m1", t0 - 1000 * (k + 1) if mode == "set" else t0, region)
        for k, points in enumerate(again)
    ]
    try:
        await board.submit([sent[0], Score("Q", 10, "q1", t0, region)], now_ms=first_at)
        if order == "first late":
            await _read_by_dead(raw, board)
        elif order != "together":
            await drain(raw, store, url)
        for k in range(2 if order == "twice" else 1):
            await moderation.remove(board, ["P"])
            if order == "removal late":
                await _read_by_dead(raw, board)
            elif order in ("apart", "twice", "closed"):
                await drain(raw, store, url)
            await _window_over(raw, board)
            got = await board.submit([sent[k + 1]])
            assert got[0].status == "improved"
            if order in ("first late", "removal late"):
                await _archive_live(raw, store, url)
        await drain(raw, store, url)  # takes over what the dead archiver held
        want = sent[2 if order == "twice" else 1]
        top = await board.top(10)
        assert [(e.player_id, e.points) for e in top] == [("P", want.points), ("Q", 10)]
        names = ["total", day_ago(2)] if order == "closed" else ["total"]
        for name in names:
            assert not [c for c in await reconcile(rebuilder, board, name) if c.drift], name
        closed = await board.top(10, board.resolve(day_ago(2)))
        await rebuilder.rebuild(board)  # from PostgreSQL alone: the journals are trimmed
        assert await board.top(10) == top
        assert await board.top(10, board.resolve(day_ago(2))) == closed
        if order == "closed":
            assert [e.player_id for e in closed] == ["Q"]
            result = await Settler(rebuilder).settle(
                board, day_ago(2), Request.of({"settlement_id": sid, "rewards": TABLE})
            )
            assert result["forced"] is False and result["players"] == 1
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("order", ["apart", "first late"])
@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_result_sent_again_after_a_removal_that_kept_its_periods_stays_in_them(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, mode: str, strategy: str, order: str
) -> None:
    """The same past a removal that kept some periods (a DELETE retried past the window, at the time
    of its first call: the entries achieved since stay). The board keeps the first application there,
    and the worse one sent again changes nothing in them (it is in the others: a best board's total):
    PostgreSQL's row is now the one sent again (the first is cut), and the first is held in the
    periods the removal kept (the trigger on ``match_results``). With ``first late`` the first is
    archived after the rest (an archiver died holding it): it loses to the row, and is held so."""
    sid = f"again-kept-{mode}-{strategy}-{order.replace(' ', '-')}"
    url = rebuilder.db.info.dsn
    board = await new_board(store, sid, mode, sharding=sharding(strategy, 3))
    region = "r0" if strategy == "region" else None
    now = times.now_ms()
    today = now - now % 86_400_000
    t1 = today + (now - today) // 2
    first, worse = Score("P", 50, "m1", t1, region), Score("P", 30, "m1", t1 - (mode == "set") * 1000, region)
    try:
        await board.submit([Score("P", 100, "m0", today - 3_600_000, region), first])
        if order == "first late":
            await _read_by_dead(raw, board)
        await board.submit([Score("Q", 10, "q1", t1, region)])
        await drain(raw, store, url) if order == "apart" else await _archive_live(raw, store, url)
        # Keeps today's entry (m1), and on a set board the total's (the latest: m1 too).
        await moderation.remove(board, ["P"], request="remove/late", since_ms=today)
        await drain(raw, store, url) if order == "apart" else await _archive_live(raw, store, url)
        await _window_over(raw, board)
        await board.submit([worse])
        await drain(raw, store, url)
        names = ["total", "daily", day_ago(1)]
        before = [await board.top(10, board.resolve(n)) for n in names]
        total = {"best": [("P", 30), ("Q", 10)], "set": [("P", 50), ("Q", 10)]}[mode]
        assert [(e.player_id, e.points) for e in before[0]] == total
        assert [(e.player_id, e.points) for e in before[1]] == [("P", 50), ("Q", 10)]
        for name in names:
            assert not [c for c in await reconcile(rebuilder, board, name) if c.drift], name
        await rebuilder.rebuild(board)
        assert [await board.top(10, board.resolve(n)) for n in names] == before
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize(
    "order", ["apart", "together", "first late", "removal late", "twice", "twice, first late"]
)
@pytest.mark.parametrize("kept", [False, True])
@pytest.mark.parametrize(("mode", "first", "second"), [("best", 10, 40), ("best", 40, 10), ("set", 40, 10)])
async def test_a_match_id_used_again_on_another_day_after_a_removal_holds_what_the_board_holds(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    mode: str,
    first: int,
    second: int,
    kept: bool,
    order: str,
) -> None:
    """The two archive changes of 2026-12-05 together (a match id used again on another day:
    ``_time_holds``; a result sent again after a removal: ``_CUT``, ``match_later``, the trigger):
    P posts m1 on day D-3, is removed (``kept``: a DELETE retried past the window at a time after an
    older result m0 of D-4, so the removal keeps D-3's entry), the window passes, and P posts m1 again
    on day D-2. Whatever the order the entries are archived in, every period (the total, D-4, D-3,
    D-2) reconciles, settles without a mismatch and rebuilds from PostgreSQL to what Redis held."""
    sid = f"reuse-rm-{mode}-{first}-{second}-{int(kept)}-{order.replace(' ', '-').replace(',', '')}"
    url = rebuilder.db.info.dsn
    board = await new_board(store, sid, mode)
    days = [day_ago(4), day_ago(3), day_ago(2)] + ([day_ago(1)] if order.startswith("twice") else [])
    starts = {d: period_bounds(board, board.resolve(d).period) for d in days}
    try:
        s4, e4 = starts[days[0]]
        at4 = s4 + 3_600_000
        await board.submit([Score("P", 100, "m0", at4), Score("Q", 5, "q4", at4)], now_ms=e4 - 1)
        s3, e3 = starts[days[1]]
        at3 = s3 + 3_600_000
        await board.submit([Score("P", first, "m1", at3), Score("Q", 5, "q3", at3)], now_ms=e3 - 1)
        if order.endswith("first late"):
            await _read_by_dead(raw, board)
        elif order != "together":
            await drain(raw, store, url)
        later = [(days[2], second)] + ([(days[3], second + 5)] if order.startswith("twice") else [])
        for k, (day, points) in enumerate(later):
            if kept:
                await moderation.remove(board, ["P"], request=f"remove/late-{k}", since_ms=s3)
            else:
                await moderation.remove(board, ["P"])
            if order == "removal late":
                await _read_by_dead(raw, board)
            elif order in ("apart", "twice"):
                await drain(raw, store, url)
            elif order == "twice, first late":
                await _archive_live(raw, store, url)
            await _window_over(raw, board)
            start, end = starts[day]
            got = await board.submit(
                [Score("P", points, "m1", start + 3_600_000), Score("Q", 5, f"q-{day}", start + 3_600_000)],
                now_ms=end - 1,
            )
            assert not got[0].closed and got[0].status != "duplicate", got[0]
        if order in ("first late", "removal late", "twice, first late"):
            await _archive_live(raw, store, url)
        await drain(raw, store, url)  # takes over what the dead archiver held
        assert "P" in [e.player_id for e in await board.top(10, board.resolve(days[-1]))]
        await agrees_from_the_archive(raw, rebuilder, board, ["total", *days], days, sid)
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("order", ["apart", "first late"])
@pytest.mark.parametrize(("mode", "first", "again"), [("best", 10, 40), ("best", 40, 10), ("set", 40, 10)])
async def test_a_match_id_used_again_after_a_removal_that_kept_another_matchs_day_stays_out_of_it(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, mode: str, first: int, again: int, order: str
) -> None:
    """P posts m1 on D-3 and m2 on D-2; a removal retried past the window at the start of D-2 keeps
    D-2 (m2, achieved since) and takes m1 out; m1 is sent again on D-1. The row of m1 is replaced by
    the one sent again, and the one it replaces is held for the periods the removal kept
    (``match_results_keep_replaced``): D-2 is one, though m1 of D-3 was never in it. Every period
    must still reconcile, settle and rebuild to what Redis holds."""
    sid = f"reuse-kept-other-{mode}-{first}-{again}-{order.replace(' ', '-')}"
    url = rebuilder.db.info.dsn
    board = await new_board(store, sid, mode)
    days = [day_ago(3), day_ago(2), day_ago(1)]
    bounds = {d: period_bounds(board, board.resolve(d).period) for d in days}
    try:
        sent = [("m1", first), ("m2", 20), ("m1", again)]
        for k, (day, (match, points)) in enumerate(zip(days, sent, strict=True)):
            start, end = bounds[day]
            if k == 2:
                await moderation.remove(board, ["P"], request="remove/late", since_ms=bounds[days[1]][0])
                await drain(raw, store, url) if order == "apart" else await _archive_live(raw, store, url)
                await _window_over(raw, board)
            at = start + 3_600_000
            sent_now = [Score("P", points, match, at), Score("Q", 5, f"q{k}", at)]
            got = await board.submit(sent_now, now_ms=end - 1)
            assert not got[0].closed and got[0].status != "duplicate", got[0]
            if k == 0 and order == "first late":
                await _read_by_dead(raw, board)
            elif order == "apart":
                await drain(raw, store, url)
        await drain(raw, store, url)
        assert [e.player_id for e in await board.top(10, board.resolve(days[0]))] == ["Q"]
        assert "P" in [e.player_id for e in await board.top(10, board.resolve(days[1]))]
        await agrees_from_the_archive(raw, rebuilder, board, ["total", *days], days, sid)
    finally:
        await store.delete(board.config.id)
