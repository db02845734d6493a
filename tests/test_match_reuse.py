"""A match id used again for a player with another result (other points, another ``achieved_at``)
on best and set boards: docs/design-notes.md ("Score codec") says the board takes it as a new
result, and Redis files each application under the dated periods of its own time. PostgreSQL keeps
one row per (board, incarnation, match, player), the better (best) or later (set) application, so
the archiver holds the other in ``match_holds`` for the dated periods of its time that the row is
not in (``archive._time_holds``). Until 2026-12-05 it held an application only for periods it
*skipped* (closed or frozen): once the journal was trimmed, the day of the dropped application
drifted (reconcile), its settlement stopped (``settlement_mismatch``) and a rebuild took the player
out of it. Found by bisecting a concurrency run (two archivers, removals, a rebuild, a writer clock
days ahead, match ids from a small pool): no other ingredient made Redis and PostgreSQL disagree.

Incr refuses the second application as ``duplicate`` within the dedup window, so both sides agree
(the control case); past the window an incr board counts it again in Redis alone, a documented
limit ("Rebuild and reconcile", "Known limit")."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from shardlb import keys
from shardlb.archive import Archiver, connect_db
from shardlb.board import Score
from shardlb.journal import GROUP
from shardlb.rebuild import Rebuilder
from shardlb.settlement import period_bounds
from shardlb.store import BoardStore
from tests.test_archive_retries import agrees_from_the_archive
from tests.test_settlement import day_ago, drain, new_board

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("archived", ["in one batch", "in order", "the later first"])
@pytest.mark.parametrize(
    ("mode", "first", "second"),
    [
        ("best", 10, 40),
        ("best", 40, 10),
        ("set", 40, 10),
        ("incr", 40, 10),
    ],
)
async def test_a_match_id_used_again_on_another_day_stays_in_both_days(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    mode: str,
    first: int,
    second: int,
    archived: str,
) -> None:
    """Player P posts match m1 on day D-3 (``first`` points) and m1 again on day D-2 (``second``),
    each sent while its day was open; Q posts a match of its own each day. Redis holds P in both
    days (best and set; incr refuses the second as duplicate). Once archived and trimmed, each day
    must reconcile, rebuild to what Redis held, and settle without drift."""
    board = await new_board(store, f"reuse-{mode}-{first}-{second}-{archived.split()[-1]}", mode)
    days = [day_ago(3), day_ago(2)]
    try:
        for day, points in zip(days, (first, second), strict=True):
            start, end = period_bounds(board, board.resolve(day).period)
            sent = [Score("P", points, "m1", start + 3_600_000), Score("Q", 5, f"q-{day}", start + 3_600_000)]
            got = await board.submit(sent, now_ms=end - 1)
            assert not got[0].closed
            if day == days[1]:
                break
            if archived == "in order":  # the second application meets the first's row
                await drain(raw, store, rebuilder.db.info.dsn)
            elif archived == "the later first":  # an archiver reads the first and dies before its commit
                for key in (keys.journal_key(p) for p in board.prefixes):
                    if await raw.exists(key):
                        await raw.xgroup_create(key, GROUP, id="0")
                        await raw.xreadgroup(GROUP, "dead", {key: ">"})
        if archived == "the later first":  # another archives the second; the first is taken over after
            late = Archiver(raw, store, await connect_db(rebuilder.db.info.dsn), "late", claim_idle_s=3600)
            try:
                await late.refresh()
                while await late.round():
                    pass
            finally:
                await late.db.close()
        held = [e.player_id for e in await board.top(10, board.resolve(days[1]))]
        assert held == (["Q"] if mode == "incr" else ["P", "Q"])
        await drain(raw, store, rebuilder.db.info.dsn)
        sid = f"{board.config.id}-{uuid.uuid4().hex[:6]}"
        await agrees_from_the_archive(raw, rebuilder, board, days, days, sid)
    finally:
        await store.delete(board.config.id)
