"""Erasing a player's archived rows (`shardlb erase PLAYER`; router/README.md, "Erasing a player").

A removal (a DELETE of the player, a ban's, the inactive cleanup) takes the player off the board in
Redis and keeps their archived results, which then count nowhere: PostgreSQL's rule, the one every
rebuild, reconcile and settlement reads (``settlement.REMOVED``), leaves out a row journaled before a
removal of its player on its shard. This command removes what that rule already leaves out, and
nothing a board still reads:

- the player's ``match_results``, ``match_holds`` and ``match_later`` rows journaled before a removal
  of the player on the same shard that kept no period (``ERASABLE``; a row of ``match_later`` is a
  later application that the row of its (match, player) did not take, shardlb/archive.py: one a
  removal cut never becomes the row). A row of a removal that kept some periods
  (a retry made at an earlier call's time), a row posted after the last removal, and any row while
  the removal is not archived yet still count: they stay, and the call reports them (``left``).
  A ``match_results`` row that arrived within the board's dedup window stays too, reported as
  ``held`` with the time it may go (``_window``): a rebuild puts the shard's retry records back
  from those rows (``rebuild.RetryRecords``: an incr board's dedup sets, a best or set board's
  pins), a removed player's too: without them, the retry of a result sent without ``achieved_at``
  after a loss of Redis would be taken again and put the player back on the board (erased at once,
  until 2026-12-05; tests/test_erase.py);
- every row of the player in prune's tables on an incarnation deleted and not held by the registry
  (``prune.prunable`` without its grace: nothing reads them; `shardlb prune` would take them with
  the board's other rows);
- the player's ``refused_results`` (the record of refused results; nothing reads it back but the
  insert's check for a row already there).

Kept on purpose, and counted in the report: on a live board the player's ``player_removals`` and
``removal_records`` (they keep a result journaled before the removal and archived after this call
from counting again, and a rebuild within the dedup window puts the retry records back from them;
on an incr board ``_cover`` first raises each record to cover the results erased before it, whose
dedup records a rebuild cannot put back; they go with the board, by `shardlb prune`);
``moderation_audit`` (the audit log, which a request's retry reads); ``bans`` (a ban in force is
what refuses the player's later results); the settlements' snapshots and awards (the record of
what was paid). Redis is not touched: remove the player first.

Each batch is one DELETE of at most ``batch`` rows in a transaction of its own, as prune's are, and a
row it removes is never needed again: the call can be cut off anywhere and run again, and a call
after the last removes nothing. Rows journaled before the removal that the archiver commits after
the call are left out by the removal's row, which stays, and go at the next call. One archiver
commits a journal in order, so those come while the removal's own row is not archived yet (its
rows still count: ``left``); but an archiver that read an entry and died before its commit leaves
it to be taken over after another has archived the later ones, the removal's among them. A call
then finds nothing left of the player, and says the board's journals still hold entries of before
the removal (``unarchived``; until 2026-12-05 it answered that nothing was left)."""

from __future__ import annotations

import argparse
import asyncio
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import psycopg
from redis.asyncio.cluster import RedisCluster

from shardlb import keys, prune, times
from shardlb.archive import connect_db
from shardlb.board import Board
from shardlb.config import DEDUP_WINDOW_S, BoardConfig, check_id, stored_settings
from shardlb.connection import Scripts, connect, connection_arguments
from shardlb.errors import InvalidInput
from shardlb.rebuild import PIN_SLACK_MS, RetryRecords
from shardlb.settlement import REMOVED_AFTER, ensure_schema
from shardlb.store import BoardStore

BATCH_ROWS = prune.BATCH_ROWS
# A row of ``m`` (match_results or match_holds) journaled before a removal of its player on its shard
# that kept no period: the archive's rule counts it nowhere (settlement.REMOVED, for every period).
ERASABLE = (
    f"EXISTS (SELECT 1 FROM player_removals x WHERE {REMOVED_AFTER} AND coalesce(cardinality(x.kept), 0) = 0)"
)
COUNTED = ("match_results", "match_holds", "match_later")
# When a row arrived (its journal id's time, Redis's clock): what a rebuild's refill goes by.
ARRIVED = "split_part(m.journal_id, '-', 1)::bigint"
# Taken off the window's start for the clocks of this host, Redis and a later rebuild's host
# (the skew the design covers: docs/design-notes.md, "Clocks").
CLOCK_SLACK_MS = PIN_SLACK_MS
# What stays of a player on purpose (the module docstring), counted for the report.
KEPT = {
    "player_removals": "SELECT count(*) FROM player_removals WHERE player_id = %s",
    "removal_records": "SELECT count(*) FROM removal_records WHERE player_id = %s",
    "moderation_audit": "SELECT count(*) FROM moderation_audit WHERE player_id = %s",
    "bans": "SELECT count(*) FROM bans WHERE player_id = %s",
    "settlement_snapshots": "SELECT count(*) FROM settlement_snapshots WHERE player_id = %s",
    "settlement_awards": "SELECT count(*) FROM settlement_awards WHERE player_id = %s",
}


class Erased(NamedTuple):
    """What a call removed, by (board, incarnation, table) (only those it removed rows of; the
    incarnation '' for ``refused_results``, which names a board id only); the player's rows that
    still count, by (board, incarnation); the rows naming the player kept on purpose, by table; and
    the rows that count nowhere but stay for the dedup window, by (board, incarnation): how many,
    and the time (epoch ms) from which a call removes them all; and the live boards whose journals
    still hold entries of before the player's last removal there (``_unarchived``)."""

    rows: dict[tuple[str, str, str], int]
    left: dict[tuple[str, str], int]
    kept: dict[str, int]
    held: dict[tuple[str, str], tuple[int, int]]
    unarchived: set[tuple[str, str]]


def _window(board: str, incarnation: str, settings: Any) -> Callable[[int], int]:
    """For a time (ms), the earliest arrival (ms) of a ``match_results`` row of the board that a
    rebuild's refill may read from then on (``RetryRecords.since_ms``), less the clocks' slack.
    Settings that do not parse are given the longest window a board can have, twice."""
    try:
        stored = {k: v for k, v in dict(settings).items() if k != "generation"}
        config = BoardConfig.from_dict(board, stored_settings(stored))
    except (InvalidInput, TypeError, ValueError):
        return lambda now_ms: now_ms - 2 * DEDUP_WINDOW_S[1] * 1000 - CLOCK_SLACK_MS
    former = Board(None, config, None, incarnation)  # type: ignore[arg-type]  # read by no server
    return lambda now_ms: RetryRecords(former, "", now_ms).since_ms - CLOCK_SLACK_MS


def _erasable_from(window: Callable[[int], int], arrived_ms: int, now_ms: int) -> int:
    """The time (to the minute) from which ``window`` has passed a row that arrived at ``arrived_ms``
    (``window`` moves on by dedup buckets: the start is found near, then stepped to)."""
    at = arrived_ms + now_ms - window(now_ms)
    while window(at) <= arrived_ms:
        at += 60_000
    while window(at - 60_000) > arrived_ms:
        at -= 60_000
    return at


# Whether a journal (KEYS[1]) holds an entry up to ARGV[1] (XRANGE's end): 1 or 0. A script, as the
# entry itself (MessagePack) is no text a decoding client can read.
_BEFORE = "return #redis.call('XRANGE', KEYS[1], '-', ARGV[1], 'COUNT', 1)"


def _position(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def _unarchived(
    db: psycopg.AsyncConnection[Any], client: RedisCluster, player: str
) -> set[tuple[str, str]]:
    """The live boards (the registry's incarnations) with a removal of ``player`` archived whose
    journals still hold an entry of before the latest of them: not archived yet, or archived and not
    trimmed yet. An archiver that read such an entry and died before its commit, while another
    archived the later ones (the removal's among them), commits it once the entry is taken over:
    a row of the player the next call removes, which this one cannot see. Any journal of the board
    is looked at (a removal's shard number is its layout's: old and new ones during a reshard)."""
    cur = await db.execute(
        "SELECT board, incarnation, journal_id FROM player_removals WHERE player_id = %s", (player,)
    )
    latest: dict[tuple[str, str], str] = {}
    for board, incarnation, entry_id in await cur.fetchall():
        known = latest.get((board, incarnation))
        if known is None or _position(entry_id) > _position(known):
            latest[(board, incarnation)] = entry_id
    if not latest:
        return set()
    store = BoardStore(client, Scripts.register(client))
    live = {(b.config.id, b.incarnation): b for b in await store.boards()}
    out = set()
    for ident, entry_id in sorted(latest.items()):
        board = live.get(ident)
        if board is None:
            continue
        for prefix in dict.fromkeys(board.prefixes + board.also):
            if await client.eval(_BEFORE, 1, keys.journal_key(prefix), f"({entry_id}"):
                out.add(ident)
                break
    return out


async def erase(
    db: psycopg.AsyncConnection[Any],
    client: RedisCluster,
    player: str,
    batch: int = BATCH_ROWS,
    now_ms: int | None = None,
) -> Erased:
    """Remove ``player``'s archived rows that nothing reads (see the module docstring). ``db`` is
    in autocommit; ``now_ms`` (tests) the time the dedup windows are judged at."""
    check_id(player, "player")
    now = times.now_ms() if now_ms is None else now_ms
    await ensure_schema(db)  # the settlements' tables too, whose rows of the player are counted
    removed: dict[tuple[str, str, str], int] = {}

    async def delete(table: str, where: str, args: tuple[Any, ...], ident: tuple[str, str, str]) -> None:
        statement = (
            f"DELETE FROM {table} WHERE ctid = ANY(ARRAY("
            f"SELECT m.ctid FROM {table} m WHERE {where} LIMIT %s))"
        )
        while True:
            cur = await db.execute(statement, (*args, batch))
            if cur.rowcount:
                removed[ident] = removed.get(ident, 0) + cur.rowcount
            if cur.rowcount < batch:
                return

    deleted = set(await prune.prunable(db, client, 0))
    cur = await db.execute("SELECT board, incarnation, settings FROM boards ORDER BY board, incarnation")
    left: dict[tuple[str, str], int] = {}
    held: dict[tuple[str, str], tuple[int, int]] = {}
    for board, incarnation, settings in await cur.fetchall():
        mine = "m.board = %s AND m.incarnation = %s AND m.player_id = %s"
        args = (board, incarnation, player)
        if (board, incarnation) in deleted:
            for table in prune.TABLES:
                await delete(table, mine, args, (board, incarnation, table))
            continue
        if settings.get("mode") == "incr":
            await _cover(db, board, incarnation, player, settings)
        window = _window(board, incarnation, settings)
        since = window(now)
        recent = (f"{mine} AND {ERASABLE} AND {ARRIVED} >= %s", (*args, since))
        await delete("match_results", f"{mine} AND {ERASABLE} AND {ARRIVED} < %s", (*args, since),
                     (board, incarnation, "match_results"))  # fmt: skip
        for table in COUNTED[1:]:
            await delete(table, f"{mine} AND {ERASABLE}", args, (board, incarnation, table))
        counts = await db.execute(
            "SELECT "
            + " + ".join(f"(SELECT count(*) FROM {table} m WHERE {mine})" for table in COUNTED)
            + f", (SELECT count(*) FROM match_results m WHERE {recent[0]}), "
            f"(SELECT max({ARRIVED}) FROM match_results m WHERE {recent[0]})",
            (*(args * len(COUNTED)), *recent[1], *recent[1]),
        )
        row = await counts.fetchone()
        if row is None:
            continue
        everything, waiting, last = int(row[0]), int(row[1]), row[2]
        if everything > waiting:
            left[(board, incarnation)] = everything - waiting
        if waiting:
            held[(board, incarnation)] = (waiting, _erasable_from(window, int(last), now))
    await delete("refused_results", "m.player_id = %s", (player,), ("*", "", "refused_results"))
    unarchived = await _unarchived(db, client, player)
    kept = {}
    for name, query in KEPT.items():
        found = await (await db.execute(query, (player,))).fetchone()
        if found is not None and found[0]:
            kept[name] = int(found[0])
    return Erased(removed, left, kept, held, unarchived)


async def _cover(
    db: psycopg.AsyncConnection[Any], board: str, incarnation: str, player: str, settings: dict[str, Any]
) -> None:
    """Raise the removal records of ``player`` on an incr board (each removal that kept no period)
    to 1 + the time units of the latest result of theirs journaled before it on its shard, before
    those results are erased. A rebuild within the dedup window puts back the shard's retry records
    from the archive: the dedup records of the rows erased cannot come back, so the removal's record
    alone must refuse a retry of each. remove.lua records the later of the removal's time and 1 +
    the time of the entries it took, which covered every result until 2026-12-05; since then a
    0-point result leaves an incr entry's time alone, and one dated ahead of the clock (a board
    takes up to MAX_FUTURE_MS) can be later than both. Best and set records already cover that far
    (``moderation.record_units``). Idempotent: a record never goes down."""
    stored = dict(settings)
    stored.pop("generation", None)
    codec = BoardConfig.from_dict(board, stored_settings(stored)).codec()
    await db.execute(
        "UPDATE removal_records r SET units = c.units FROM ("
        "SELECT x.shard, x.journal_id, (max(m.achieved_ms) - %s) / %s + 1 AS units "
        f"FROM player_removals x JOIN match_results m ON {REMOVED_AFTER} "
        "WHERE x.board = %s AND x.incarnation = %s AND x.player_id = %s "
        "AND coalesce(cardinality(x.kept), 0) = 0 GROUP BY x.shard, x.journal_id) c "
        "WHERE r.board = %s AND r.incarnation = %s AND r.player_id = %s AND r.shard = c.shard "
        "AND r.journal_id = c.journal_id AND r.units < c.units",
        (codec.epoch_ms, codec.unit_ms, board, incarnation, player, board, incarnation, player),
    )


def _player(text: str) -> str:
    try:
        return check_id(text, "player")
    except InvalidInput as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    """`shardlb erase PLAYER`: remove from PostgreSQL the player's archived rows that nothing reads
    any more: their results and holds journaled before a removal of theirs that kept no period, all
    their rows on boards deleted, and their refused results. Remove the player from the boards first
    (a DELETE per board, or a ban of every board) and let the archiver archive the removals. Exit
    status 0 when none of the player's results is left; 3 when some still count (the player still
    ranked, posted since, or the removal not archived yet: run it again once it is), when results
    of before the removal arrived within the board's dedup window (a rebuild puts the window's
    retry records back from them: they stay until the time printed, run it again then) or when a
    board's journals still hold entries of before the removal (run it again once the archiver has
    archived them); 1 when a server fails; 2 for bad arguments. A player id that begins with '-'
    goes after '--'. Rows naming the player that the service keeps on purpose (the removals' own
    rows on live boards, the moderation audit, bans, settled standings) stay and are counted. Safe
    to run again at any time."""
    parser = argparse.ArgumentParser(
        prog="shardlb erase",
        description=inspect.cleandoc(main.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("player", type=_player, help="the player id")
    connection_arguments(parser)
    args = parser.parse_args(argv)
    if not args.postgres:
        parser.error("give --postgres or SHARDLB_POSTGRES_URL")

    async def run() -> Erased:
        client = connect(args.redis)
        try:
            db = await connect_db(args.postgres)
            try:
                return await erase(db, client, args.player)
            finally:
                await db.close()
        finally:
            await client.aclose()

    done = asyncio.run(run())
    for line in lines(done):
        print(line)
    return 3 if _unfinished(done) else 0


def _unfinished(done: Erased) -> bool:
    """Whether rows of the player are still to erase (now or later): exit status 3."""
    return bool(done.left or done.held or done.unarchived)


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def lines(done: Erased) -> list[str]:
    """What `shardlb erase` prints of ``done``: what it removed, or that it removed nothing (as
    `shardlb prune` says "nothing left to prune"; until 2026-12-06 it printed nothing), then what
    stays and why."""
    out = []
    for (board, incarnation, table), rows in done.rows.items():
        where = "every board" if board == "*" else f"{board} (incarnation {incarnation})"
        out.append(f"{where}: {_count(rows, 'row', 'rows')} of {table} removed")
    if not done.rows:
        out.append("nothing erased yet" if _unfinished(done) else "nothing to erase")
    for (board, incarnation), rows in done.left.items():
        counts = _count(rows, "result still counts", "results still count")
        out.append(f"{board} (incarnation {incarnation}): {counts}: not removed")
    for (board, incarnation), (rows, until) in done.held.items():
        out.append(
            f"{board} (incarnation {incarnation}): {_count(rows, 'result', 'results')} of before the removal "
            "kept for the dedup window (a rebuild's retry records): run it again from "
            + times.format_ms(until)
        )
    for board, incarnation in sorted(done.unarchived):
        out.append(
            f"{board} (incarnation {incarnation}): its journals still hold entries of before the removal, "
            "which the archiver may bring rows of the player from: run it again once it has archived them"
        )
    for name, rows in done.kept.items():
        out.append(f"kept on purpose: {_count(rows, 'row', 'rows')} of {name}")
    return out
