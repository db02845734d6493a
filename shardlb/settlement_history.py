"""History: settled periods read back from their snapshots, the periods a board keeps, and a
player's results from PostgreSQL (issue 12, item 4).

A settled period's snapshot is final (shardlb/settlement.py): its top and a player's final rank are
read from it, whether or not the period's Redis keys still exist. A player outside the snapshot
(below top N and unrewarded) has a final rank only while the frozen Redis board is kept.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import psycopg

from shardlb import keys, moderation, periods, settlement, times
from shardlb.board import Board, exact
from shardlb.fanout import batch

_DATED = re.compile(r"[dwm]:.+")
MAX_HISTORY = 1000


class Settled(NamedTuple):
    settlement_id: str
    players: int


class Standing(NamedTuple):
    rank: int
    player_id: str
    points: int
    achieved_ms: int
    reward: str | None = None


async def settled(db: psycopg.AsyncConnection[Any], board: Board, name: str) -> Settled | None:
    """The settlement of a board's period, when it is settled."""
    cur = await db.execute(
        "SELECT settlement_id, (result->>'players')::bigint FROM settlements "
        "WHERE board = %s AND incarnation = %s AND period = %s AND state = 'settled'",
        (board.config.id, board.incarnation, name),
    )
    row = await cur.fetchone()
    return None if row is None else Settled(row[0], int(row[1]))


async def top(db: psycopg.AsyncConnection[Any], settlement_id: str, limit: int) -> list[Standing]:
    """Ranks 1 to ``limit`` of a snapshot (it keeps 1 to top N, and the rewarded ranks)."""
    cur = await db.execute(
        "SELECT s.rank, s.player_id, s.points, s.achieved_ms, a.reward FROM settlement_snapshots s "
        "LEFT JOIN settlement_awards a USING (settlement_id, player_id) "
        "WHERE s.settlement_id = %s AND s.rank <= %s ORDER BY s.rank",
        (settlement_id, limit),
    )
    out = []
    for n, row in enumerate(await cur.fetchall()):
        if row[0] != n + 1:
            break  # past the contiguous top: rewarded ranks further down are not a page of it
        out.append(Standing(*row))
    return out


async def player(db: psycopg.AsyncConnection[Any], settlement_id: str, player_id: str) -> Standing | None:
    cur = await db.execute(
        "SELECT s.rank, s.player_id, s.points, s.achieved_ms, a.reward FROM settlement_snapshots s "
        "LEFT JOIN settlement_awards a USING (settlement_id, player_id) "
        "WHERE s.settlement_id = %s AND s.player_id = %s",
        (settlement_id, player_id),
    )
    row = await cur.fetchone()
    return None if row is None else Standing(*row)


# The first rank of the run of equal points that a snapshot row (``{sid}``, ``{rank}``, ``{points}``)
# is in, its competition rank, when the snapshot can tell. Points fall with the rank, so the run
# starts right after the last kept rank above the row with other points (or at 1), and is known when
# that rank was kept: every kept rank from there to the row's has its points.
RUN_START = (
    "SELECT q.first FROM (SELECT coalesce(max(b.rank), 0) + 1 AS first FROM settlement_snapshots b "
    "WHERE b.settlement_id = {sid} AND b.rank < {rank} AND b.points <> {points}) q WHERE EXISTS "
    "(SELECT 1 FROM settlement_snapshots k WHERE k.settlement_id = {sid} AND k.rank = q.first)"
)


async def run_start(db: psycopg.AsyncConnection[Any], settlement_id: str, s: Standing) -> int | None:
    """The competition rank of ``s`` (a row of the snapshot): the first rank of its run of equal
    points, or None when the snapshot did not keep that rank (a rewarded rank below its top N)."""
    cur = await db.execute(
        RUN_START.format(sid="%(sid)s", rank="%(rank)s", points="%(points)s"),
        {"sid": settlement_id, "rank": s.rank, "points": s.points},
    )
    row = await cur.fetchone()
    return None if row is None else int(row[0])


# The last kept rank of the run of equal points that a snapshot row (``sid``, ``rank``, ``points``)
# is in, and whether the rank after it was kept (``run_end``). Points fall with the rank, so it is
# the kept rank before the first one below the row with other points: both found in the primary
# key's order, from the row on, reading the run. Until 2026-12-06 it was the largest rank of those
# points from the row on, which read every kept rank below the row (a snapshot of 100,000 ranks
# for a player near the top: tests/test_read_plans.py).
RUN_END = (
    "SELECT e.last, EXISTS (SELECT 1 FROM settlement_snapshots n WHERE n.settlement_id = %(sid)s "
    "AND n.rank = e.last + 1) FROM (SELECT (SELECT r.rank FROM settlement_snapshots r "
    "WHERE r.settlement_id = %(sid)s AND r.rank >= %(rank)s AND r.rank < coalesce(o.rank, "
    "9223372036854775807) "
    "AND r.points = %(points)s ORDER BY r.rank DESC LIMIT 1) AS last FROM (SELECT (SELECT k.rank "
    "FROM settlement_snapshots k WHERE k.settlement_id = %(sid)s AND k.rank > %(rank)s "
    "AND k.points <> %(points)s ORDER BY k.rank LIMIT 1) AS rank) o) e"
)


async def run_end(
    db: psycopg.AsyncConnection[Any], settlement_id: str, s: Standing, players: int
) -> int | None:
    """The last rank of the run of equal points that ``s`` is in (the players with at least its
    points), or None when the snapshot cannot tell: the snapshot's last row of those points is not
    the board's last rank and the rank after it was not kept, so the run may go on past it. Points
    fall with the rank, so every rank between two rows of equal points has those points too."""
    cur = await db.execute(RUN_END, {"sid": settlement_id, "rank": s.rank, "points": s.points})
    row = await cur.fetchone()
    if row is None or row[0] is None:
        return None
    last, next_kept = int(row[0]), bool(row[1])
    return last if next_kept or last == players else None


@exact
async def kept(board: Board, now_ms: int | None = None) -> set[str]:
    """The dated periods whose keys some home shard of the board still holds at ``now_ms``: those its
    key index lists with an expiry still to come (a listing outlives its key until a later write
    drops it). Resharding when the board's layout was replaced meanwhile (as the other reads: the
    old one's keys are dropped after the cut-over, and their listings with them). Rebuilding when a
    home shard is not rebuilt (``Board.check_built``), or, during a reshard, is found without its
    sentinel (``exact``): its index went with its keys, and the periods it alone held would be
    missing. Until 2026-12-06 the listing answered from the other shards in both cases."""
    shards = board.layout.view(False)
    board.check_built(shards)
    now = times.now_ms() if now_ms is None else now_ms
    # One round, a pipeline per node, as every board read: shard after shard, a public listing of
    # a board of 1024 shards held a read permit for 90-140 ms (until 2026-12-06).
    pipe = batch(board.client)
    for shard in shards:
        pipe.zrange(keys.index_key(board.prefixes[shard]), f"({now}", "+inf", byscore=True)
    found: set[str] = set()
    for shard, listed in zip(shards, await pipe.execute(), strict=True):
        prefix = board.prefixes[shard]
        for key in listed:
            name = (key.decode() if isinstance(key, bytes) else str(key))[len(prefix) :]
            if _DATED.fullmatch(name):
                found.add(name)
    return found


async def settled_periods(db: psycopg.AsyncConnection[Any], board_id: str) -> dict[str, dict[str, Any]]:
    """Every settlement of a board id (all incarnations, the board archived or not), by period."""
    cur = await db.execute(
        "SELECT period, settlement_id, state, settled_at, incarnation FROM settlements WHERE board = %s "
        "ORDER BY created_at",
        (board_id,),
    )
    return {
        period: {"settlement_id": sid, "state": state, "settled_at": at, "incarnation": inc}
        for period, sid, state, at, inc in await cur.fetchall()
    }


async def player_history(
    db: psycopg.AsyncConnection[Any], board: Board, player_id: str, limit: int
) -> list[dict[str, Any]]:
    """The player's results on this board, latest achieved first, each with the periods it counts
    in (those of its time that did not skip it: a period already closed when it was posted; none
    for a result of a banned player or one before its player's removal) and,
    for each of those that is settled, the final rank and points the player reached there (the rank
    is known when the player is in the snapshot)."""
    # A result the moderation rule leaves out (its player banned, or removed after it) counts in
    # no period: a rebuild and a settlement skip it, as Redis does since the removal; but in the
    # periods every later removal left whole (``player_removals.kept``: per removal, its periods
    # comma-separated, '' for none).
    cur = await db.execute(
        f"SELECT m.match_id, m.points, m.achieved_ms, m.skipped, TRUE {settlement.BANNED}, "
        "(SELECT array_agg(coalesce(array_to_string(x.kept, ','), '')) FROM player_removals x "
        f"WHERE {settlement.REMOVED_AFTER}) "
        "FROM match_results m WHERE m.board = %s AND m.incarnation = %s AND m.player_id = %s "
        "ORDER BY m.achieved_ms DESC, m.match_id LIMIT %s",
        (moderation.ALL, board.config.id, board.incarnation, player_id, limit),
    )
    results = await cur.fetchall()
    # On a board numbering competition ranks, the final rank is one too (as a read of the settled
    # period gives it); a rank the snapshot cannot tell is left out, as for a player outside it.
    competition = board.config.rank_mode == "competition"
    first = (
        RUN_START.format(sid="s.settlement_id", rank="s.rank", points="s.points") if competition else "NULL"
    )
    cur = await db.execute(
        f"SELECT t.period, s.rank, s.points, ({first}) FROM settlements t "
        "JOIN settlement_snapshots s USING (settlement_id) "
        "WHERE t.board = %s AND t.incarnation = %s AND t.state = 'settled' AND s.player_id = %s",
        (board.config.id, board.incarnation, player_id),
    )
    final = {
        period: (start if competition else rank, points)
        for period, rank, points, start in await cur.fetchall()
        if start is not None or not competition
    }
    out = []
    for match_id, points, achieved, skipped, counts, removals in results:
        every = periods.names_at(achieved, board.config.periods, board.tz, board.config.week_start)
        kept = [set(k.split(",")) for k in removals or ()]
        names = [n for n in every if n not in skipped and all(n in k for k in kept)] if counts else []
        out.append(
            {
                "match_id": match_id,
                "points": points,
                "achieved_ms": achieved,
                "periods": [periods.api_name(n) for n in names],
                "final": {
                    periods.api_name(n): {"rank": final[n][0], "points": final[n][1]}
                    for n in names
                    if n in final
                },
            }
        )
    return out
