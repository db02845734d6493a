"""The archive's prune: the rows of board incarnations deleted longer ago than a grace, removed from
PostgreSQL in bounded batches (`shardlb prune`; docs/design-notes.md, "What PostgreSQL keeps").

Nothing else ever removes an archived result: the archiver only inserts, and every result of a live
board stays needed for as long as the board lives (its total is rebuilt, reconciled and settled
from all of them, and a player's history lists them). A deleted incarnation is read by nothing:
`rebuild --all` skips it (``boards.deleted_at``), a rebuild, reconcile, settlement or history read
needs the board in the registry, and a board created again under the id has another incarnation.
So its rows of ``TABLES`` go, and the archiver's marks and gaps of its journals (``BOOKKEEPING``);
what stays:

- its ``boards`` row, the mark that keeps `rebuild --all` from bringing it back;
- its settlements, snapshots, awards, acks and webhook deliveries (a season archive run again
  answers its stored result, the history of a board id lists the settlements of every
  incarnation, and the deliveries are the record of what was paid);
- ``moderation_audit`` and ``refused_results``, which name a board id, not an incarnation.

``refused_results`` has a retention of its own, asked for (``refused_days``; `--refused-days`): its
rows older than that many days go, whatever their board. Nothing in the service reads the table
back (no endpoint, the dashboard, a rebuild, reconcile or settlement); it is a record for the
operator, which `shardlb erase` empties of one player, and its unique index makes a result refused
again once its row is gone a row again, a new record of a new refusal. So removing its old rows
changes no answer. It is not the default: how long a record of refusals is kept is the operator's
decision (the k8s CronJob asks for 90 days: k8s/README.md).

``moderation_audit`` has one too, asked for (``audit_days``; `--audit-days`), of ``AUDIT_MIN_DAYS``
(30) at least. A ban's, lift's or removal's retry with its request id reads the request's row
(``moderation.audit_once``, ``_ban_audited``, ``_lift_audited``, ``audit_removal``) to answer as the
first call was answered; once the row is gone the request id is forgotten and a retry is a new
request: a ban lifted since is stored again, a ban stored since is lifted, a removal past the
board's dedup window removes the results posted since (tests/test_prune_audit.py). So the days are
the horizon of a request id's retries, and at least the longest dedup window (30 days,
``config.DEDUP_WINDOW_S``): within it a removal's retry is the same removal on Redis's records alone,
and beyond it nothing but the audit row says so. No row has to stay for a ban in force: nothing
reads the audit for a ban's state (``bans`` holds the ban, its author, reason, time and request id;
a ban in force answers its retry from there). Nothing else reads the table (no endpoint lists it;
`shardlb erase` counts a player's rows). It is not the default: it is the audit log, which the
operator may have to keep (the k8s CronJob does not ask for it). A batch is its oldest rows by id,
as ``refused_results``'s: the rows are written as requests come, ``at`` the time of their
transaction's start, which a request waiting on its request id's lock (``moderation._hold``) may
put a few seconds before a row of a smaller id.

An incarnation PostgreSQL holds deleted while the registry holds it (an incarnation drawn again
for a board created again under the id: 32 random bits; or a mark set by hand) is a live board and
is left alone. Each batch is one DELETE of at most ``batch`` rows in a transaction of its own: its
row locks are on rows no insert touches (the archiver writes no deleted board's rows: a round that
read entries before the board's deletion may commit them after it, which is what the grace is
for, and what a later prune removes), and its transaction ends before the next, so neither the
archiver's inserts nor a schema set-up's ALTER TABLE (shardlb/archive.py, ``ensure_schema``) wait
long behind it. A call removes at most ``limit`` rows and says whether rows were left; it can be
cut off anywhere and run again (each batch is committed or not at all; a row removed is never
needed again). A batch of ``refused_results`` (``REFUSED_BATCH``) or ``moderation_audit``
(``AUDIT_BATCH``) is its oldest rows by id, of which it removes those older than the days: rows
nothing else locks but `shardlb erase` (refused results) and a retry's read (the audit)."""

from __future__ import annotations

import argparse
import asyncio
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson
import psycopg
from redis.asyncio.cluster import RedisCluster

from shardlb import keys
from shardlb.archive import connect_db
from shardlb.config import DEDUP_WINDOW_S
from shardlb.connection import connect, connection_arguments, seconds

GRACE_S = 7 * 86_400.0  # how long after its deletion a board's rows are kept
BATCH_ROWS = 10_000  # rows a DELETE removes, in a transaction of its own
LIMIT_ROWS = 10_000_000  # rows a call removes at most
# The archive's tables whose rows name one incarnation, and that nothing reads once it is deleted,
# each with its primary key's third column (after board and incarnation): ``batch_statement``.
TABLES = {
    "match_results": "match_id",
    "match_holds": "match_id",
    "match_later": "match_id",
    "player_removals": "shard",
    "removal_records": "shard",
}
# The archiver's bookkeeping of an incarnation's journals (shardlb/archive.py): a row a shard's
# journal, a few a board, read only while the board lives (a rebuild's restore check). Removed in
# one statement each, after the rows above.
BOOKKEEPING = ("journal_marks", "archive_gaps")
# One batch of refused_results older than the days (parameters: rows, days): the oldest rows by id,
# those of them refused before the days. The router's log inserts them as they come, so id order is
# time order (but for the milliseconds of two routers' inserts at once): a batch that finds fewer
# rows to remove than it read has reached the rows within the days, and is the last. It reads
# ``batch`` entries of the primary key at most, never the table (an index on ``at`` would cost
# every insert, and a first set-up building it on a large table held the schema's locks meanwhile).
# A row older than one before it in id order waits for that one, a night at most.
REFUSED_BATCH = (
    "DELETE FROM refused_results WHERE ctid = ANY(ARRAY(SELECT ctid FROM "
    "(SELECT ctid, at FROM refused_results ORDER BY id LIMIT %s) AS oldest "
    "WHERE at < now() - make_interval(days => %s)))"
)

# One batch of moderation_audit older than the days (parameters: rows, days), read as
# ``REFUSED_BATCH`` reads its table: by the primary key, the table's one index in time order.
AUDIT_BATCH = (
    "DELETE FROM moderation_audit WHERE ctid = ANY(ARRAY(SELECT ctid FROM "
    "(SELECT ctid, at FROM moderation_audit ORDER BY id LIMIT %s) AS oldest "
    "WHERE at < now() - make_interval(days => %s)))"
)
# The fewest days the audit's rows are kept for (``audit_days``): a request id's retries are
# recognised that long, the longest dedup window a board may have (see the module docstring).
AUDIT_MIN_DAYS = DEDUP_WINDOW_S[1] // 86_400


class Pruned(NamedTuple):
    """What a call removed, by (board, incarnation) (only those it removed rows of), and whether it
    left nothing to prune: False when it stopped at its ``limit``."""

    rows: dict[tuple[str, str], int]
    done: bool
    # incarnations deleted less than the grace ago, whose rows a later call removes (``waiting``)
    waiting: int = 0
    # rows of refused_results removed (older than ``refused_days``)
    refused: int = 0
    # rows of moderation_audit removed (older than ``audit_days``)
    audit: int = 0


async def prunable(
    db: psycopg.AsyncConnection[Any], client: RedisCluster, grace_s: float
) -> list[tuple[str, str]]:
    """The incarnations deleted ``grace_s`` seconds ago or more that the registry does not hold."""
    cur = await db.execute(
        "SELECT board, incarnation FROM boards WHERE deleted_at <= now() - make_interval(secs => %s) "
        "ORDER BY deleted_at, board, incarnation",
        (grace_s,),
    )
    return await _unheld(client, await cur.fetchall())


async def waiting(db: psycopg.AsyncConnection[Any], client: RedisCluster, grace_s: float) -> int:
    """How many incarnations deleted less than ``grace_s`` seconds ago, that the registry does not
    hold, still have rows a prune removes: those a later call prunes. Until 2026-12-06 every
    incarnation deleted within the grace was counted, one whose rows a call with a shorter grace
    had removed too, and said to be "pruned later"."""
    left = " OR ".join(
        f"EXISTS (SELECT 1 FROM {table} t WHERE t.board = b.board AND t.incarnation = b.incarnation)"
        for table in (*TABLES, *BOOKKEEPING)
    )
    cur = await db.execute(
        f"SELECT board, incarnation FROM boards b WHERE deleted_at > now() - make_interval(secs => %s) "
        f"AND ({left})",
        (grace_s,),
    )
    return len(await _unheld(client, await cur.fetchall()))


async def _unheld(client: RedisCluster, idents: list[tuple[Any, ...]]) -> list[tuple[str, str]]:
    """The (board, incarnation) pairs of ``idents`` the registry does not hold: a live board's
    incarnation is never pruned, whatever PostgreSQL's mark says (the module docstring)."""
    out = []
    for board, incarnation in idents:
        record = await client.hget(keys.BOARDS, board)
        if record is None or str(orjson.loads(record).get("incarnation", "0")) != incarnation:
            out.append((board, incarnation))
    return out


async def prune(
    db: psycopg.AsyncConnection[Any],
    client: RedisCluster,
    grace_s: float = GRACE_S,
    batch: int = BATCH_ROWS,
    limit: int = LIMIT_ROWS,
    refused_days: int | None = None,
    audit_days: int | None = None,
) -> Pruned:
    """Remove the rows of ``TABLES`` of every incarnation ``prunable`` names, at most ``batch`` a
    transaction and ``limit`` in all (see the module docstring), then its ``BOOKKEEPING`` rows (a few a
    board: neither counted in ``Pruned.rows`` nor against ``limit``); then, with ``refused_days``, the
    rows of ``refused_results`` older than that many days, and with ``audit_days`` (``AUDIT_MIN_DAYS``
    at least, else ValueError) those of ``moderation_audit``, within the same ``batch`` and
    ``limit``. ``db`` is in autocommit."""
    if audit_days is not None and audit_days < AUDIT_MIN_DAYS:
        raise ValueError(f"audit_days: {AUDIT_MIN_DAYS} or more, got {audit_days}")
    removed: dict[tuple[str, str], int] = {}
    left = limit
    for ident in await prunable(db, client, grace_s):
        for table in TABLES:
            while left:
                size = min(batch, left)
                async with db.transaction():
                    await db.execute(BATCH_SETTINGS)
                    cur = await db.execute(batch_statement(table), (*ident, size))
                if cur.rowcount:
                    removed[ident] = removed.get(ident, 0) + cur.rowcount
                left -= cur.rowcount
                if cur.rowcount < size:
                    break
            if not left:
                return Pruned(removed, False)
        for table in BOOKKEEPING:
            await db.execute(f"DELETE FROM {table} WHERE board = %s AND incarnation = %s", ident)
    older = {REFUSED_BATCH: 0, AUDIT_BATCH: 0}
    for statement, days in ((REFUSED_BATCH, refused_days), (AUDIT_BATCH, audit_days)):
        while days is not None:
            if not left:
                return Pruned(removed, False, refused=older[REFUSED_BATCH], audit=older[AUDIT_BATCH])
            size = min(batch, left)
            cur = await db.execute(statement, (size, days))
            older[statement] += cur.rowcount
            left -= cur.rowcount
            if cur.rowcount < size:
                break
    later = await waiting(db, client, grace_s)
    return Pruned(removed, True, later, older[REFUSED_BATCH], older[AUDIT_BATCH])


# Run in a batch's transaction before ``batch_statement``: the batch is read in the primary key's
# order, never sorted. A board grown since the last ANALYZE looks like a row or two to the planner,
# which then read it through another index and sorted all of it for each batch (21,000 rows for a
# batch of 1,000 on a board of 20,000: a board of n rows pruned in n²/batch;
# tests/test_read_plans.py), as rebuild.ROWS_SETTINGS does for the nested loops of a shard's read.
BATCH_SETTINGS = "SELECT set_config('enable_sort', 'off', true)"


def batch_statement(table: str) -> str:
    """The DELETE of one batch of a board incarnation's rows of ``table`` (parameters: board,
    incarnation, rows): their physical addresses, read and deleted in one statement (a TID scan).
    Ordered by the primary key, so the planner reads its index: with ``LIMIT`` alone, statistics
    taken before a prune removed the incarnation's rows (until autovacuum's next ANALYZE) had it
    scan the whole table to find none (tests/test_prune.py)."""
    return (
        f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "
        f"WHERE board = %s AND incarnation = %s ORDER BY board, incarnation, {TABLES[table]} LIMIT %s))"
    )


def _at_least(least: int, what: str, why: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number of ``what``, ``least`` or more (``why``: said when not)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"a number of {what}, {least} or more{why}, got {text!r}")
        return value

    return parse


_positive = _at_least(1, "rows")
_days = _at_least(1, "days")
_audit_days = _at_least(
    AUDIT_MIN_DAYS,
    "days",
    " (a ban's, lift's or removal's retry with its X-Request-Id reads its audit row: once it is gone "
    "the retry is a new request)",
)


def removed(rows: int) -> str:
    """A line's count of rows removed: "1 row removed" (until 2026-12-06 "1 rows"), "2 rows removed"."""
    return f"{rows:,} row{'' if rows == 1 else 's'} removed"


def main(argv: list[str] | None = None) -> int:
    """`shardlb prune`: remove from PostgreSQL the archived rows of the boards deleted at least --grace
    seconds ago (results: match_results; holds: match_holds; later applications a result's row did
    not take: match_later; removals and their records: player_removals, removal_records; the
    archiver's marks of their journals: journal_marks, archive_gaps), --batch rows a transaction and
    at most --limit rows; with --refused-days, the refused results recorded more than that many days
    ago too; with --audit-days, the moderation audit's rows (bans, lifts, removals asked for) written
    more than that many days ago (30 at least: a request's retry with its X-Request-Id after its row
    is gone is a new request). Exit status 0 when nothing is left to prune, 1 when it could not be
    done (Redis or PostgreSQL out of reach or failing: what was removed stays removed; run it
    again), 2 for bad arguments, 3 when --limit stopped it (run it again). The boards' settlements,
    snapshots and awards stay, and the refused results and the moderation audit without their
    options."""
    parser = argparse.ArgumentParser(
        prog="shardlb prune",
        description=inspect.cleandoc(main.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    connection_arguments(parser)
    parser.add_argument(
        "--grace",
        type=seconds,
        default=GRACE_S,
        help=f"seconds after a board's deletion before its rows go (default {GRACE_S:.0f}: 7 days)",
    )
    parser.add_argument(
        "--batch", type=_positive, default=BATCH_ROWS, help=f"rows a transaction (default {BATCH_ROWS:,})"
    )
    parser.add_argument(
        "--limit", type=_positive, default=LIMIT_ROWS, help=f"rows at most in all (default {LIMIT_ROWS:,})"
    )
    parser.add_argument(
        "--refused-days",
        type=_days,
        default=None,
        help="remove the rows of refused_results older than this many days (default: keep them all)",
    )
    parser.add_argument(
        "--audit-days",
        type=_audit_days,
        default=None,
        help=f"remove the rows of moderation_audit older than this many days, {AUDIT_MIN_DAYS} or more: "
        "a ban, lift or removal retried with its X-Request-Id after that is a new request "
        "(default: keep them all)",
    )
    args = parser.parse_args(argv)
    if not args.postgres:
        parser.error("give --postgres or SHARDLB_POSTGRES_URL")

    async def run() -> Pruned:
        client = connect(args.redis)
        try:
            db = await connect_db(args.postgres)  # the schema in place: a new database has no table yet
            try:
                return await prune(
                    db, client, args.grace, args.batch, args.limit, args.refused_days, args.audit_days
                )
            finally:
                await db.close()
        finally:
            await client.aclose()

    done = asyncio.run(run())
    for (board, incarnation), rows in done.rows.items():
        print(f"{board} (incarnation {incarnation}, deleted): {removed(rows)}")
    if args.refused_days is not None:
        print(f"refused_results older than {args.refused_days:,} days: {removed(done.refused)}")
    if args.audit_days is not None:
        print(f"moderation_audit older than {args.audit_days:,} days: {removed(done.audit)}")
    if done.waiting:
        these = "incarnation is" if done.waiting == 1 else "incarnations are"
        grace = f"--grace {args.grace:,.0f} s"
        print(f"{done.waiting:,} deleted board {these} within the grace ({grace}): pruned later")
    print("nothing left to prune" if done.done else f"--limit {args.limit:,} reached: run it again")
    return 0 if done.done else 3
