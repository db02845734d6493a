"""The archiver: every shard's journal drained into PostgreSQL, the source of truth.

Each journal (shardlb/journal.py) is read with one consumer group, ``archiver``; several archivers
may run at once under different consumer names and share the entries. One round reads a batch of
new entries from every journal (XREADGROUP), takes over entries another consumer left unacknowledged
for ``claim_idle_s`` (XAUTOCLAIM: a dead archiver's), writes them all in ONE transaction (COPY into a
temporary table, then an upsert into ``match_results``), and only after the commit acknowledges them
(ack.lua: XACK, and each acknowledged entry's results taken off the count of results not yet
archived that write.lua's bound reads; now and then recount.lua sets that count again from the
journal) and trims each journal up to its oldest entry not yet acknowledged. A
crash anywhere leaves entries to read again; the upsert makes a replay harmless:

- rows are keyed by (board, incarnation, match_id, player_id), one per result as the game sent it;
- ``best`` keeps the better score of a key sent twice, ``set`` the later time, ``incr`` the first:
  the same rule the board applied (an incr board's dedup window lets Redis count a replay that
  comes after the window; PostgreSQL counts it once, and reconcile reports the difference);
- but of two applications of a key with a removal of the player between them, the later one, as
  the board the removal emptied took it again (``_CUT``; a later one that lost to the rule before
  the removal was archived waits in ``match_later`` for it: ``_PROMOTE``).

An entry PostgreSQL refuses (a data error, a constraint: not a lost connection, a timeout or a
deadlock, which fail the round for ``run`` to retry) must not stop the other journals: when the
round's one transaction is refused, each journal is archived again on its own (``Archiver._alone``).
Every journal PostgreSQL takes is committed and acknowledged, and so are the refusing journal's
entries before the refused one; that journal is *held* there (nothing from the entry on is
acknowledged, nothing new is read from it), the entry is tried again every RETRY_REFUSED_S, logged
once and counted (``shardlb_archive_refused_entries_total``, ``shardlb_archive_held_journals``).
An entry the archiver cannot decode (damaged, or written by something that is not write.lua) is
held the same way (``Archiver._read`` stops before it; ``shardlb_archive_unreadable_entries_total``):
it used to raise out of every round and stop the archiver for good.
docs/design-notes.md, "An entry PostgreSQL refuses", says how an operator clears it.

psycopg 3 is the driver: it is async, its COPY streams rows without building one big statement, it
ships binary wheels, and the bench already used it for its PostgreSQL rival (one driver, not two).
Board settings are kept in ``boards`` too, so a total loss of Redis can be rebuilt from here.

Beside the rounds, the `shardlb archive` process runs the board upkeep that nothing else always
runs: the inactive-player cleanup (``_cleanup``) and the repair of band moves that writes left
pending (``repair_bands``, every ``--repair-every`` seconds; it needs Redis only). Its refresh also
forgets the bans of boards deleted (``moderation.Bans.sweep``, ``SWEEP_BANS_EVERY_S``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import inspect
import itertools
import logging
import math
import os
import random
import re
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import orjson
import psycopg
from prometheus_client import Counter, Gauge, start_http_server
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ExceptionType, RedisClusterException, RedisError, ResponseError

from shardlb import keys, moderation, pgconn, settlement_delivery
from shardlb.board import Board, band_shards, whence
from shardlb.connection import (
    Script,
    Scripts,
    connect,
    connection_arguments,
    raised_in_redis,
    redacted,
    script_source,
    seconds,
)
from shardlb.errors import ShardlbError
from shardlb.fanout import batch
from shardlb.journal import GROUP, Entry, Lag, decode, journal_lag
from shardlb.outage import Outage
from shardlb.store import GONE_MS, WHOLE_READ_EVERY_S, BoardStore

log = logging.getLogger("shardlb.archive")

# Journals read at once whose reads may each answer ``count`` entries twice over (those that gave
# the last round entries, and reads that failed in a larger pipeline: ``Archiver._poll``): 500 such
# in one pipeline passed the socket's timeout.
JOURNALS_IN_FLIGHT = 16
# Journals whose other calls go in one pipeline per node (``Archiver._each``): the quiet journals'
# reads (poll.lua), and every round's gap-check reads, acknowledgements, trims, recounts and
# forgettings. A round's cost is then a round trip per node and chunk, not per journal.
JOURNALS_AT_ONCE = 500
# Now and then (at most every RECOUNT_EVERY_S a journal, right after an acknowledgement, while at
# most RECOUNT_LIMIT entries are not acknowledged) the count of results not archived is set again
# from the journal itself (recount.lua): a count that drifted is right again on a busy shard too.
RECOUNT_EVERY_S = 30.0
RECOUNT_LIMIT = 200
# A journal that gave a round nothing to archive is trimmed at most this often: its acknowledged
# entries are otherwise trimmed only by the next acknowledgement (Archiver._ack), and an archiver
# killed between its acknowledgement and its trim left them there for good when no write came. At
# SHARDLB_JOURNAL_MAX_ENTRIES no write can come: they refused every write to the shard.
IDLE_TRIM_EVERY_S = 5.0
# An idle archiver waits as long as its last round took, but never longer than this (Archiver.run):
# a round of 20,000 journals takes about a second, and one held up by a failover must not hold back
# the next read of every journal as long.
PAUSE_MAX_S = 5.0
# PostgreSQL's text cannot hold NUL (U+0000). Routers refuse match ids holding it (Board.prepare),
# but an entry journaled before that rule, or through the library past its checks, would fail every
# round of every journal for ever: its NULs are archived as U+FFFD instead.
NUL_STANDIN = "\ufffd"
# A journal held at an entry PostgreSQL refused (Archiver.round) is tried again this often: each try
# is a transaction that fails, and the entry is there until someone changes something.
RETRY_REFUSED_S = 5.0
# Consumers of the group (archivers that ran before) idle this long without pending entries are
# deleted (forget.lua), at most every FORGET_EVERY_S a journal, after a trim or an acknowledgement.
FORGET_IDLE_S = 3600.0
FORGET_EVERY_S = 60.0
# The bans of boards deleted are forgotten (``moderation.Bans.sweep``) when a refresh marks a board
# deleted, at the archiver's start, after a sweep that failed, and at least this often: a board the
# archiver does not keep (no journal) is known deleted by Redis's mark only, which lasts a day.
SWEEP_BANS_EVERY_S = 600.0
# A round that fails (PostgreSQL or the cluster away) is tried again after RETRY_FIRST_S, the pause
# doubling on each failure in a row up to RETRY_MAX_S; the first round that works ends the outage.
# Fixed 1 s pauses logged two warnings a second for as long as an outage lasted; the failures are
# now logged as an Outage (shardlb/outage.py): at its start, once a minute and at its end.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS boards (
    board text NOT NULL,
    incarnation text NOT NULL,
    settings jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    deleted_at timestamptz,
    PRIMARY KEY (board, incarnation)
);
-- When a DELETE of the incarnation began (``mark_deleting``, before its Redis part): pending, not a
-- deletion. `rebuild --all` restores a board marked so alone (its DELETE was never answered 204);
-- ``deleted_at``, written once Redis has deleted the board, is the deletion. NULL in rows of the
-- releases before, as for a board no DELETE began.
ALTER TABLE boards ADD COLUMN IF NOT EXISTS delete_begun_at timestamptz;
CREATE TABLE IF NOT EXISTS match_results (
    board text NOT NULL,
    incarnation text NOT NULL,
    match_id text NOT NULL,
    player_id text NOT NULL,
    points bigint NOT NULL,
    achieved_ms bigint NOT NULL,
    score bigint NOT NULL,
    shard integer NOT NULL,
    journal_id text NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (board, incarnation, match_id, player_id)
);
-- The periods of its achieved time a result was not applied to (closed or frozen, by name).
ALTER TABLE match_results ADD COLUMN IF NOT EXISTS skipped text[] NOT NULL DEFAULT '{}';
-- A shard's rows (a rebuild's snapshot, `archived_to`, the retry records), by shard FIRST: until
-- 2026-12-06 this index was (board, incarnation, shard), and the planner, which estimates a board's
-- rows from averages (a board growing since the last ANALYZE, or one big board among many small
-- ones, looks small), took its (board, incarnation) prefix for the archiver's look-ups of a (match,
-- player): every row of the board read for each row of a batch (tests/test_archive_plans.py). With
-- the shard first it serves only a query that names the shard; the look-ups take the primary key.
CREATE INDEX IF NOT EXISTS match_results_on_shard ON match_results (shard, board, incarnation);
DROP INDEX IF EXISTS match_results_by_shard;
-- That a board's incarnation goes with its id. Without it the planner multiplied their frequencies,
-- estimated a board its statistics do not list (one grown since the last ANALYZE; any board in a plan
-- made for every value, which a statement run again and again on a connection gets) at under a row,
-- and then every index naming the board cost the same: the reads of one shard took the player's
-- index or the primary key and read the whole board (tests/test_read_plans.py). With it, a board is
-- estimated at its frequency, and the shard's index is the cheaper by the shard's share. ANALYZE
-- computes it: no cost to an insert.
CREATE STATISTICS IF NOT EXISTS match_results_board (dependencies) ON board, incarnation FROM match_results;
-- The few rows that skip a period, which `_HOLD_EARLIER` looks up for every row archived.
CREATE INDEX IF NOT EXISTS match_results_skipping ON match_results (board, incarnation, match_id, player_id)
    WHERE skipped <> '{}';
-- A result's earlier application, kept for each period a later one of its (match, player) skipped:
-- the row above then holds the later one, and the period still holds this (see `_HOLD`).
CREATE TABLE IF NOT EXISTS match_holds (
    board text NOT NULL,
    incarnation text NOT NULL,
    match_id text NOT NULL,
    player_id text NOT NULL,
    period text NOT NULL,
    points bigint NOT NULL,
    achieved_ms bigint NOT NULL,
    score bigint NOT NULL,
    shard integer NOT NULL,
    journal_id text NOT NULL,
    PRIMARY KEY (board, incarnation, match_id, player_id, period, journal_id)
);
-- Later applications of a (match, player) than the one `match_results` holds that its rule did not
-- take (a best board's lower score, a set board's earlier time, an incr board's copy), and the row
-- an earlier application replaced by that rule (the trigger below): one becomes the row when a
-- removal of the player archived late turns out to be between them (`_PROMOTE`). Few: a key's
-- results sent again. See `_CUT`.
CREATE TABLE IF NOT EXISTS match_later (
    board text NOT NULL,
    incarnation text NOT NULL,
    match_id text NOT NULL,
    player_id text NOT NULL,
    points bigint NOT NULL,
    achieved_ms bigint NOT NULL,
    score bigint NOT NULL,
    shard integer NOT NULL,
    journal_id text NOT NULL,
    skipped text[] NOT NULL DEFAULT '{}',
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (board, incarnation, match_id, player_id, shard, journal_id)
);
-- An application a row of `match_results` no longer holds (replaced by the upsert or `_PROMOTE`):
-- kept in `match_later` when it is the later one, and held in `match_holds` in every period a
-- removal after it left whole (`player_removals.kept`), where the board still has it.
CREATE INDEX IF NOT EXISTS match_later_by_player ON match_later (board, incarnation, player_id);
CREATE OR REPLACE FUNCTION match_results_keep_replaced() RETURNS trigger LANGUAGE plpgsql AS $keep$
BEGIN
    IF (split_part(NEW.journal_id, '-', 1)::numeric, split_part(NEW.journal_id, '-', 2)::numeric)
       < (split_part(OLD.journal_id, '-', 1)::numeric, split_part(OLD.journal_id, '-', 2)::numeric) THEN
        INSERT INTO match_later (board, incarnation, match_id, player_id, points, achieved_ms, score, shard,
                                 journal_id, skipped)
        VALUES (OLD.board, OLD.incarnation, OLD.match_id, OLD.player_id, OLD.points, OLD.achieved_ms,
                OLD.score, OLD.shard, OLD.journal_id, OLD.skipped)
        ON CONFLICT DO NOTHING;
    END IF;
    INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, achieved_ms, score,
                             shard, journal_id)
    SELECT OLD.board, OLD.incarnation, OLD.match_id, OLD.player_id, p, OLD.points, OLD.achieved_ms,
           OLD.score, OLD.shard, OLD.journal_id
    FROM player_removals x CROSS JOIN LATERAL unnest(x.kept) p
    WHERE (x.board, x.incarnation, x.shard, x.player_id)
        = (OLD.board, OLD.incarnation, OLD.shard, OLD.player_id)
      AND (split_part(x.journal_id, '-', 1)::numeric, split_part(x.journal_id, '-', 2)::numeric)
        > (split_part(OLD.journal_id, '-', 1)::numeric, split_part(OLD.journal_id, '-', 2)::numeric)
      AND NOT p = ANY(OLD.skipped)
    ON CONFLICT DO NOTHING;
    RETURN NEW;
END
$keep$;
CREATE OR REPLACE TRIGGER match_results_keep_replaced BEFORE UPDATE ON match_results FOR EACH ROW
    WHEN (OLD.journal_id <> NEW.journal_id) EXECUTE FUNCTION match_results_keep_replaced();
-- Per journal, the newest entry id archived in this database, written in the transaction of the
-- rows: every entry a journal trimmed (acknowledged after its commit) is at or before it, unless
-- this database lost commits (restored from a backup). See ``_GAPS``.
CREATE TABLE IF NOT EXISTS journal_marks (
    journal text PRIMARY KEY,
    board text NOT NULL,
    incarnation text NOT NULL,
    archived_to text NOT NULL
);
-- Journals found to have trimmed entries this database does not hold: acknowledged results that
-- Redis's board holds and a rebuild would drop (`rebuild._check_archive` refuses it until forced).
CREATE TABLE IF NOT EXISTS archive_gaps (
    journal text NOT NULL,
    board text NOT NULL,
    incarnation text NOT NULL,
    shard integer NOT NULL,
    archived_to text NOT NULL,
    trimmed_to text NOT NULL,
    found_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (journal, trimmed_to)
);
"""

_COLUMNS = "board, incarnation, match_id, player_id, points, achieved_ms, score, shard, journal_id, skipped"
# What a second row of one key does, per board mode: the rule the board itself applied. The same
# result applied again later (best and set take a retry again) keeps the later journal id: after a
# removal of its player (shardlb/moderation.py) it is on the board again, and a rebuild must agree.
_POSITION = "(split_part({0}.journal_id, '-', 1)::numeric, split_part({0}.journal_id, '-', 2)::numeric)"
_LATER = f"{_POSITION.format('EXCLUDED')} > {_POSITION.format('match_results')}"
# ... and its periods are those of both applications: a retry after a period closed skips it, but
# the first application is in it (on the board too), unless a removal of the player came between
# them (then the board holds the retry alone). `_merge_retries` does the same within one batch.
_SKIPPED = (
    "skipped = CASE WHEN EXCLUDED.score = match_results.score "
    "AND EXCLUDED.achieved_ms = match_results.achieved_ms AND NOT EXISTS (SELECT 1 FROM player_removals x "
    "WHERE (x.board, x.incarnation, x.player_id) = (match_results.board, match_results.incarnation, "
    "match_results.player_id) AND x.shard IN (match_results.shard, EXCLUDED.shard) "
    f"AND {_POSITION.format('x')} > {_POSITION.format('match_results')}) "
    "THEN ARRAY(SELECT unnest(match_results.skipped) INTERSECT SELECT unnest(EXCLUDED.skipped)) "
    "ELSE EXCLUDED.skipped END"
)
# A row is *cut* when a removal of its player on its shard was journaled after it: it counts
# nowhere (settlement.REMOVED_AFTER), but in the periods that removal kept. A result sent again once
# the removal's records and the dedup window are gone is taken by the board again, whatever the
# mode: the player is back with it alone. So between two applications of one key, one cut and one
# not, the one not cut is the row, whatever the mode's rule says (a best board's lower score, a set
# board's earlier time, an incr board's retry), and whichever is archived first (an archiver that
# died holding the first one: its entries are taken over after the later one is archived). Until
# 2026-12-05 the rule alone chose, PostgreSQL kept the cut row, and a rebuild dropped the result.
_CUT = (
    "EXISTS (SELECT 1 FROM player_removals x WHERE (x.board, x.incarnation, x.shard, x.player_id) "
    "= ({0}.board, {0}.incarnation, {0}.shard, {0}.player_id) "
    f"AND {_POSITION.format('x')} > {_POSITION.format('{0}')})"
)
_REVIVED = f"({_CUT.format('match_results')} AND NOT {_CUT.format('EXCLUDED')})"
_KEEPS = f"NOT ({_CUT.format('EXCLUDED')} AND NOT {_CUT.format('match_results')})"
_REPLACE = (
    "DO UPDATE SET points = EXCLUDED.points, achieved_ms = EXCLUDED.achieved_ms, score = EXCLUDED.score, "
    f"shard = EXCLUDED.shard, journal_id = EXCLUDED.journal_id, {_SKIPPED} WHERE {_REVIVED} OR ({_KEEPS} AND "
)
_ON_CONFLICT = {
    "best": f"{_REPLACE}(EXCLUDED.score > match_results.score "
    f"OR (EXCLUDED.score = match_results.score AND {_LATER})))",
    "set": f"{_REPLACE}((EXCLUDED.achieved_ms, EXCLUDED.score) "
    "> (match_results.achieved_ms, match_results.score) "
    "OR ((EXCLUDED.achieved_ms, EXCLUDED.score) = (match_results.achieved_ms, match_results.score) "
    f"AND {_LATER})))",
    "incr": f"{_REPLACE}FALSE)",
}
# Best and set boards keep one row per (match, player), so a result sent again with another score
# after a period closed (the board applies it to the total and the open periods only) replaces a row
# the closed period still holds on the board. Before the upsert, the row archived before is kept in
# `match_holds` for every period the incoming application skipped and it did not (`_holds` does the
# same within one batch), so a settlement finds what the frozen period holds. A hold of a row the
# upsert then keeps, or of an application a removal later dropped (its journal id is before the
# removal's), changes nothing: it is a copy of a result the period holds, or one the moderation rule
# leaves out. Incr boards keep the first row and a retry adds nothing: no holds.
_HOLD = (
    "INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, achieved_ms, score, "
    "shard, journal_id) SELECT m.board, m.incarnation, m.match_id, m.player_id, p, m.points, m.achieved_ms, "
    "m.score, m.shard, m.journal_id FROM incoming i JOIN match_results m "
    "USING (board, incarnation, match_id, player_id) CROSS JOIN LATERAL unnest(i.skipped) p "
    "WHERE (i.board, i.incarnation) IN (SELECT * FROM unnest(%s::text[], %s::text[])) "
    "AND NOT p = ANY(m.skipped) ON CONFLICT DO NOTHING"
)
# The same the other way round: an application archived after a later one of its (match, player)
# (an archiver died between its read and its commit, and its entries were taken over after another
# archived the later one; or two archivers committed out of order) is held for every period the row
# skips and it did not: the board has it there. If it then replaces the row, the hold is a copy.
_HOLD_EARLIER = (
    "INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, achieved_ms, score, "
    "shard, journal_id) SELECT i.board, i.incarnation, i.match_id, i.player_id, p, i.points, i.achieved_ms, "
    "i.score, i.shard, i.journal_id FROM incoming i JOIN match_results m "
    "USING (board, incarnation, match_id, player_id) CROSS JOIN LATERAL unnest(m.skipped) p "
    "WHERE (i.board, i.incarnation) IN (SELECT * FROM unnest(%s::text[], %s::text[])) AND m.skipped <> '{}' "
    f"AND NOT p = ANY(i.skipped) AND {_POSITION.format('i')} < {_POSITION.format('m')} ON CONFLICT DO NOTHING"
)
# A stream id as a comparable pair (``_POSITION`` for a column or expression that is the id itself).
_ID = "(split_part({0}, '-', 1)::numeric, split_part({0}, '-', 2)::numeric)"
# Before a journal's entries go in: when the journal has trimmed (``max-deleted-entry-id``, read
# before this transaction) past the newest entry this database holds of it, entries it acknowledged
# after a commit are not here: the database was restored from a backup taken before (or an entry
# was acknowledged by hand). Recorded for good; a journal never marked (archived by a release of
# before 2026-12-05 only, or never) is not judged. Each journal's mark is looked up by the key: the
# LIMIT (of one row, the key's) keeps the subquery apart, so the read is bounded by the journals given.
# Joined to journal_marks as a table, the planner hashed the journals and read the whole table (every
# board's shards, each round) for 100 journals of 20,000, or 4 of 1,204 (tests/test_archive_plans.py,
# 2026-12-06); ``journal = ANY`` of them read it all too, for 1,000 of 200,000.
_GAPS = (
    "INSERT INTO archive_gaps (journal, board, incarnation, shard, archived_to, trimmed_to) "
    "SELECT j.journal, j.board, j.incarnation, j.shard, m.archived_to, j.trimmed "
    "FROM unnest(%s::text[], %s::text[], %s::text[], %s::int[], %s::text[]) "
    "AS j(journal, board, incarnation, shard, trimmed) "
    "JOIN LATERAL (SELECT archived_to FROM journal_marks WHERE journal = j.journal LIMIT 1) m ON TRUE "
    f"WHERE {_ID.format('j.trimmed')} > {_ID.format('m.archived_to')} "
    "ON CONFLICT DO NOTHING RETURNING journal, board, archived_to, trimmed_to"
)
_MARK = (
    "INSERT INTO journal_marks (journal, board, incarnation, archived_to) "
    "SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[]) "
    "ON CONFLICT (journal) DO UPDATE SET archived_to = EXCLUDED.archived_to "
    f"WHERE {_ID.format('EXCLUDED.archived_to')} > {_ID.format('journal_marks.archived_to')}"
)
# The rows archived before of the batch's (match, player) pairs at another achieved time than an
# incoming application: the match id used again with another time (docs/design-notes.md, "Score
# codec"), or a result sent without a time and retried after its pin expired. Each application is in
# the dated periods of its own time on the board; ``_time_holds`` holds those the row loses.
_OTHER_TIMES = (
    "SELECT DISTINCT m.board, m.incarnation, m.match_id, m.player_id, m.points, m.achieved_ms, m.score, "
    "m.shard, m.journal_id, m.skipped FROM incoming i JOIN match_results m "
    "USING (board, incarnation, match_id, player_id) "
    "WHERE (i.board, i.incarnation) IN (SELECT * FROM unnest(%s::text[], %s::text[])) "
    "AND m.achieved_ms <> i.achieved_ms"
)
# Which of one key's rows in a batch goes in: the same rule.
_FIRST = {
    "best": f"score DESC, {_POSITION.format('incoming')} DESC",
    "set": f"achieved_ms DESC, score DESC, {_POSITION.format('incoming')} DESC",
    "incr": "achieved_ms",
}


# A batch's rows that the upsert did not take (it took fewer rows than the batch holds: only a key's
# copies can lose, so most batches skip this), found with one look-up of its row per incoming row:
# one later than the row is kept in `match_later`, for a removal between them archived after them
# (``_PROMOTE``); on a best or set board, one that a removal after it left periods of whole
# (``kept``) is held in those periods, as the trigger on `match_results` holds a row replaced. The
# look-ups are subqueries (OFFSET 0: never flattened), so they are index scans whatever the
# statistics say (a temporary table has none). 2-4 ms for a batch of 500 (2026-12-05).
_LOSERS = (
    "WITH losers AS MATERIALIZED (SELECT i.*, r.journal_id AS row_id FROM incoming i CROSS JOIN LATERAL "
    "(SELECT m.shard, m.journal_id FROM match_results m "
    "WHERE (m.board, m.incarnation, m.match_id, m.player_id) "
    "= (i.board, i.incarnation, i.match_id, i.player_id) OFFSET 0) r "
    "WHERE (i.board, i.incarnation) IN (SELECT * FROM unnest(%s::text[], %s::text[])) "
    "AND (i.shard, i.journal_id) <> (r.shard, r.journal_id)), "
    f"later AS (INSERT INTO match_later ({_COLUMNS}) SELECT {_COLUMNS} FROM losers i "
    f"WHERE {_POSITION.format('i')} > {_ID.format('i.row_id')} ON CONFLICT DO NOTHING) "
)
_KEEP_LATER = {
    "incr": f"{_LOSERS} SELECT 1",
    "held": f"{_LOSERS} INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, "
    "achieved_ms, score, shard, journal_id) SELECT i.board, i.incarnation, i.match_id, i.player_id, k.p, "
    "i.points, i.achieved_ms, i.score, i.shard, i.journal_id FROM losers i CROSS JOIN LATERAL "
    "(SELECT unnest(x.kept) p FROM player_removals x WHERE (x.board, x.incarnation, x.shard, x.player_id) "
    "= (i.board, i.incarnation, i.shard, i.player_id) "
    f"AND {_POSITION.format('x')} > {_POSITION.format('i')} OFFSET 0) k "
    "WHERE NOT k.p = ANY(i.skipped) ON CONFLICT DO NOTHING",
}
# After a batch's removals: a row they cut (``_CUT``) is replaced by the application of `match_later`
# that no removal cut, by the mode's rule (``_FIRST``): a result sent again after a removal whose
# delete entry was archived after it (two archivers, or one that died holding the entry).
_PROMOTE = (
    "UPDATE match_results m SET points = l.points, achieved_ms = l.achieved_ms, score = l.score, "
    "shard = l.shard, journal_id = l.journal_id, skipped = l.skipped FROM (SELECT DISTINCT ON "
    "(board, incarnation, match_id, player_id) * FROM match_later incoming "
    "WHERE (board, incarnation, player_id) IN "
    "(SELECT * FROM unnest(%s::text[], %s::text[], %s::text[])) "
    f"AND NOT {_CUT.format('incoming')} ORDER BY board, incarnation, match_id, player_id, {{0}}) l "
    "WHERE (m.board, m.incarnation, m.match_id, m.player_id) "
    "= (l.board, l.incarnation, l.match_id, l.player_id) "
    f"AND {_CUT.format('m')}"
)


class _Held(NamedTuple):
    """A journal held at an entry PostgreSQL refused or the archiver cannot decode: the entry's id,
    and when it was last tried."""

    entry: str
    tried: float


class _Mark(NamedTuple):
    """One journal of a batch: its newest entry there, and the newest id it had trimmed before."""

    journal: str
    board: str
    incarnation: str
    shard: int
    newest: str
    trimmed: str


class _Unreadable(NamedTuple):
    """A journal entry the archiver cannot decode, and what decoding it raised."""

    id: str
    error: Exception


async def connect_db(url: str) -> psycopg.AsyncConnection[Any]:
    """A connection with the schema in place (idempotent). Autocommit: what must be atomic runs in
    a ``transaction()`` block (BEGIN ... COMMIT), and a statement outside one is committed on its
    own. Until 2026-12-05 it was not autocommit: one statement outside a block left a transaction
    open, every block after it became a savepoint inside it, and closing the connection rolled
    back what those blocks had answered as stored (a ban, its audit row).

    A set-up that fails (or is cancelled) closes the connection: until 2026-12-05 it was left open
    for the garbage collector, a connection of the server's for as long as its error was kept."""
    # Opened within 10 s, and dropped about a minute after its server vanished (shardlb/pgconn.py).
    conn = await psycopg.AsyncConnection.connect(
        url, autocommit=True, application_name="shardlb-archive", **pgconn.options(url)
    )
    try:
        check_server_version(conn.info.server_version)
        await ensure_schema(conn, SCHEMA, moderation.SCHEMA)
    except BaseException:
        # Failed or cancelled (a router's request cut off by its stop): nobody else holds the
        # connection to close it. Until 2026-12-05 it stayed open until the collector took it.
        await conn.close()
        raise
    return conn


# The oldest PostgreSQL the schema runs on: CREATE OR REPLACE TRIGGER (``match_results_keep_replaced``)
# came with 14.
MIN_SERVER_VERSION = 140000


def check_server_version(version: int) -> None:
    """NotSupportedError naming the server's version and the one needed, for a server older than
    MIN_SERVER_VERSION (``connection.info.server_version``: 150020 for 15.20). Without it the schema's
    set-up failed with a syntax error near TRIGGER, which the archiver retried for ever as an outage
    (and, until 2026-12-06, this error too: ``refused_settings``)."""
    if version < MIN_SERVER_VERSION:
        found = f"{version // 10000}.{version % 10000}"
        raise psycopg.NotSupportedError(
            f"PostgreSQL {found} is too old for shardlb's archive: it needs {MIN_SERVER_VERSION // 10000} or "
            "newer (README, requirements)"
        )


# How long setting a new schema up waits for a lock (``ensure_schema``) before it gives up: its
# ALTER TABLEs wait for ACCESS EXCLUSIVE behind every transaction on their table, and every
# statement on the table, the archiver's inserts included, queues behind them meanwhile.
SCHEMA_LOCK_TIMEOUT_S = 5.0

# The digests of the schemas set up in this database (``ensure_schema``).
APPLIED = """
CREATE TABLE IF NOT EXISTS schema_applied (
    digest text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);
"""


async def ensure_schema(db: psycopg.AsyncConnection[Any], *parts: str) -> None:
    """Run the DDL ``parts`` (idempotent: CREATE ... IF NOT EXISTS, ALTER TABLE ... ADD COLUMN IF
    NOT EXISTS) unless this very text was applied to the database before, in one transaction, one
    creator at a time.

    The check comes first because the DDL is not free when it changes nothing: an ALTER TABLE takes
    an ACCESS EXCLUSIVE lock on its table whether or not the column exists, so it waited for every
    transaction reading the table (a rebuild's read of millions of rows) while every statement on
    it, the archiver's inserts included, queued behind it. It ran at every archiver (re)connect,
    every ban request and every settlement. A new version's DDL text has another digest, so an
    upgrade sets its schema up at its first connect. A table dropped by hand is not made again:
    ``rebuild.check_schema`` names it to whoever reads the archive.

    That first set-up waits at most SCHEMA_LOCK_TIMEOUT_S for each lock, then fails
    (LockNotAvailable, an OperationalError: the archiver retries it as an outage, a router answers
    503 archive_unavailable) and is tried again by a later connect. Until 2026-12-05 it waited as
    long as a long read of the table lasted (a rebuild's), and the archiver's inserts, queued
    behind it, with it: the journals filled to their bound and writes were refused."""
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    if await _applied(db, digest):
        return
    async with db.transaction():
        # For this transaction only (the DDL's): the connection's own statements keep the URL's.
        wait = f"{SCHEMA_LOCK_TIMEOUT_S * 1000:.0f}ms"
        await db.execute("SELECT set_config('lock_timeout', %s, true)", (wait,))
        await db.execute("SELECT pg_advisory_xact_lock(7427466)")  # one CREATE at a time
        for part in (*parts, APPLIED):
            await db.execute(part)
        await db.execute("INSERT INTO schema_applied (digest) VALUES (%s) ON CONFLICT DO NOTHING", (digest,))


# What ``SCHEMA`` drops that a release before made. A process of that release whose own digest this
# database had not applied yet (an old router's first settlement or history request during the
# roll-out, after a new archiver's set-up) makes it again, and no digest of this release, applied
# already, would run the DROP: found, the set-up runs again (``_applied``). `match_results_by_shard`
# beside `match_results_on_shard` is taken again for the archiver's look-ups of a (match, player),
# every row of the board for each result (tests/test_archive_plans.py).
RETIRED = ("match_results_by_shard",)


async def _applied(db: psycopg.AsyncConnection[Any], digest: str) -> bool:
    """Whether the schema of ``digest`` was applied to the database and nothing it drops (``RETIRED``)
    was made again since (no lock but catalog reads)."""
    async with db.transaction():
        cur = await db.execute(
            "SELECT to_regclass('schema_applied') IS NOT NULL "
            "AND NOT EXISTS (SELECT 1 FROM unnest(%s::text[]) r WHERE to_regclass(r) IS NOT NULL)",
            (list(RETIRED),),
        )
        row = await cur.fetchone()
        if not (row and row[0]):
            return False
        cur = await db.execute("SELECT 1 FROM schema_applied WHERE digest = %s", (digest,))
        return await cur.fetchone() is not None


class Archiver:
    """Drains the journals of every board in the registry; see the module docstring."""

    def __init__(
        self,
        client: RedisCluster,
        store: BoardStore,
        db: psycopg.AsyncConnection[Any],
        name: str,
        count: int = 500,
        claim_idle_s: float = 30.0,
        db_url: str | None = None,
        forget_idle_s: float = FORGET_IDLE_S,
        whole_read_s: float = WHOLE_READ_EVERY_S,
    ) -> None:
        self.client = client  # replies as bytes: entries carry MessagePack
        self.store = store
        self.whole_read_s = whole_read_s  # the registry read whole at least this often (``refresh``)
        self.db = db
        self.db_url = db_url  # to open a new connection when PostgreSQL drops this one
        self.name = name
        self.count = count
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.forget_idle_ms = int(forget_idle_s * 1000)
        self.boards: dict[tuple[str, str], Board] = {}
        self._groups: set[str] = set()
        self._known: set[tuple[str, str]] = set()
        # A new archiver reads its own pending entries first ('0', ``_poll_args``), as after a failed
        # round: it may be one killed between its reads and its commit, started again under its
        # name (a pod's restart keeps it). Until 2026-12-06 it read from '>', and those entries
        # waited for XAUTOCLAIM (``claim_idle_s``, 30 s), though no other archiver held them.
        self._failed = True
        self._ready = False
        self._recounted: dict[str, float] = {}  # journal key -> monotonic time of its last recount
        self._trimmed: dict[str, float] = {}  # journal key -> monotonic time of its last trim
        self._forgotten: dict[str, float] = {}  # journal key -> monotonic time of its last forget.lua
        self._unexplained: set[tuple[str, str]] = set()  # boards missing without a mark, reported once
        self._held: dict[str, _Held] = {}  # journal key -> the entry PostgreSQL refused there
        self._busy: set[str] = set()  # journals that gave the last round entries (``_poll``)
        # The journals whose shards carry sentinels (their board's record says so: ``refresh``), for
        # poll.lua to look at, and those it found without one in this round (``_lost``)
        self._watched: set[str] = set()
        self._missing: set[str] = set()
        self._own: set[str] = set()  # journals that may hold more of this consumer's pending entries
        self._swept = -math.inf  # monotonic time of the last sweep of deleted boards' bans that worked
        self.outage = Outage(log, "archive round failed; retrying", "archive rounds work again")
        self.db_outage = Outage(log, "PostgreSQL not reachable; retrying", "PostgreSQL reachable again")
        self.sweep_outage = Outage(
            log, "bans of deleted boards not forgotten; retrying", "bans of deleted boards forgotten again"
        )

    # The journal scripts on this archiver's client (replies as bytes: entries carry MessagePack),
    # made at their first use (bench/archive_size.py makes an archiver without a cluster).
    @functools.cached_property
    def _poller(self) -> Script:
        return Script(self.client, script_source("poll.lua"))

    @functools.cached_property
    def _trimmer(self) -> Script:
        return Script(self.client, script_source("trim.lua"))

    @functools.cached_property
    def _forgetter(self) -> Script:
        return Script(self.client, script_source("forget.lua"))

    @functools.cached_property
    def _acker(self) -> Script:
        return Script(self.client, script_source("ack.lua"))

    @functools.cached_property
    def _recounter(self) -> Script:
        return Script(self.client, script_source("recount.lua"))

    @functools.cached_property
    def _resentinel(self) -> Script:
        return Script(self.client, script_source("sentinel.lua"))

    async def refresh(self) -> None:
        """Learn the registry's boards (and record their settings in PostgreSQL). The registry is
        read only when its version moved, or at least every ``whole_read_s`` (``BoardStore.follow``):
        it was an HGETALL of 1 MB every 2 s at 2,000 boards. What else a refresh does works from
        the boards listed, read or held: boards not recorded yet (``_known``, which ``_reconnect``
        empties) are recorded at the next refresh whether the registry was read or not."""
        if not self._ready:
            # redis-py's cluster client must know the slots before commands run concurrently.
            await self.client.initialize()
            self._ready = True
        found = await self.store.follow(self.whole_read_s)  # Boards made again only for records that changed
        self.boards = {(b.config.id, b.incarnation): b for b in found if b.config.durability == "journal"}
        journals = {keys.journal_key(p) for b in self.boards.values() for p in _journals(b)}
        # What is kept per board or journal goes with it: boards come and go for the archiver's life.
        self._groups &= journals
        self._known &= set(self.boards)
        self._recounted = {k: at for k, at in self._recounted.items() if k in journals}
        self._trimmed = {k: at for k, at in self._trimmed.items() if k in journals}
        self._held = {k: held for k, held in self._held.items() if k in journals}
        self._forgotten = {k: at for k, at in self._forgotten.items() if k in journals}
        self._own &= journals
        # Not a board being resharded: ``BoardStore.lost`` marks none (the mover looks at the old
        # layout's sentinels itself, Resharder._lost_shards), and a mark would outlast its layout.
        watched = [b for b in self.boards.values() if b.sentinels and not b.resharding]
        self._watched = {keys.journal_key(p) for b in watched for p in b.prefixes}
        new = [b for key, b in self.boards.items() if key not in self._known]
        async with self.db.transaction():
            for b in new:
                await self.db.execute(
                    "INSERT INTO boards (board, incarnation, settings) VALUES (%s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (b.config.id, b.incarnation, orjson.dumps(_settings(b)).decode()),
                )
            # A board deleted from the registry is marked deleted: `rebuild --all` must not bring it
            # back. Only on evidence of the deletion (keys.deleted_key): a registry that lacks a
            # board may also be a Redis that lost everything, whose boards `rebuild --all` restores.
            gone = await self._deleted({(b.config.id, b.incarnation) for b in found})
            if gone:
                await self.db.execute(
                    "UPDATE boards SET deleted_at = now() WHERE deleted_at IS NULL AND (board, incarnation) "
                    "IN (SELECT * FROM unnest(%s::text[], %s::text[]))",
                    ([b for b, _ in gone], [i for _, i in gone]),
                )
        # A board recorded now may have been deleted since the registry was read: the DELETE's own
        # mark (``mark_deleted``, an UPDATE) found no row then, and the row just made is live. Its
        # Redis mark (set before that UPDATE) is looked for once the row is committed, so one of the
        # two sees the other (until 2026-12-06 the board stayed live, and `rebuild --all` after a
        # loss of Redis before the next refresh brought it back). One EXISTS per board new to it.
        late = [b for b in new if await self.client.exists(keys.deleted_key(b.config.id, b.incarnation))]
        if late:
            for b in late:
                await mark_deleted(self.db, b.config.id, b.incarnation)
            gone = [*gone, *((b.config.id, b.incarnation) for b in late)]
        self._known.update((b.config.id, b.incarnation) for b in new)
        if gone or time.monotonic() - self._swept >= SWEEP_BANS_EVERY_S:
            # The deletions DELETE or a season archive did not finish forgetting (a router without
            # PostgreSQL, a failure half way, the library's delete): retried at the next refresh.
            # Its failure is logged, not the round's: archiving goes on without it.
            try:
                await moderation.Bans(self.store.client).sweep(self.db)
            except (psycopg.Error, RedisError, OSError, ShardlbError) as e:
                self.sweep_outage.failed(e)
            else:
                self.sweep_outage.succeeded()
                self._swept = time.monotonic()
        # The ban list lost with its master (``Bans.recover``: one GET of its mark a refresh), and
        # written again since or not: written back from PostgreSQL before routers take banned
        # players' results for long. Logged as the sweep.
        try:
            written = await moderation.Bans(self.store.client).recover(self.db)
        except (psycopg.Error, RedisError, OSError, ShardlbError) as e:
            self.sweep_outage.failed(e)
        else:
            if written is not None:
                RECOVERED_BANS.inc(written)
                log.warning(
                    "the ban list was lost from Redis (not marked whole) while PostgreSQL holds bans: "
                    "written back",
                    extra={"fields": {"bans": written}},
                )

    async def _deleted(self, listed: set[tuple[str, str]]) -> list[tuple[str, str]]:
        """The boards PostgreSQL holds as live, the registry lacks, and Redis says were deleted.
        One the registry lacks without that mark is left live and reported (a lost Redis, or a
        deletion older than the mark's day, which `rebuild --all` then restores)."""
        cur = await self.db.execute("SELECT board, incarnation FROM boards WHERE deleted_at IS NULL")
        missing = [(b, i) for b, i in await cur.fetchall() if (b, i) not in listed]
        self._unexplained &= set(missing)
        gone = []
        for board, incarnation in missing:
            if await self.client.exists(keys.deleted_key(board, incarnation)):
                gone.append((board, incarnation))
            elif (board, incarnation) not in self._unexplained:
                self._unexplained.add((board, incarnation))
                log.warning(
                    "a board the archive holds is missing from the registry without a deletion mark: "
                    "left live in PostgreSQL (if Redis lost its data, `shardlb rebuild --all` restores it)",
                    extra={"fields": {"board": board, "incarnation": incarnation}},
                )
        return gone

    async def round(self) -> int:
        """One pass over every journal; returns how many results it archived. Every journal's new
        entries go into one transaction. If PostgreSQL refuses it (not a lost connection: an entry it
        cannot take), each journal is archived again on its own (``_alone``): the one holding the
        refused entry is held at it, the others go on."""
        now = time.monotonic()
        streams = [
            (board, key)
            for board in self.boards.values()
            for key in map(keys.journal_key, _journals(board))
            if key not in self._held or now - self._held[key].tried >= RETRY_REFUSED_S
        ]
        batches = await self._poll([key for _, key in streams])
        journals = {key: (board, got, bad) for (board, key), (got, bad) in zip(streams, batches, strict=True)}
        await self._lost([(board, key) for board, key in streams if key in self._missing])
        together, alone, idle = [], [], []
        for key, (board, got, unreadable) in journals.items():
            trimmed = self._trimmed.get(key, -math.inf)
            if not got and unreadable is None and now - trimmed >= IDLE_TRIM_EVERY_S:
                idle.append(key)
            if key not in self._held and unreadable is None:
                together += [(board, key, e) for e in got]
            elif got or unreadable is not None:
                alone.append(key)
            else:  # nothing of ours pending: acknowledged by hand, or another archiver took it over
                del self._held[key]
        done = 0
        cuts = await self._trim(idle)
        # A journal without its group has no stream yet (``_read``): nothing trimmed to compare.
        await self._judge([(journals[key][0], key, cut) for key, cut in cuts.items() if key in self._groups])
        try:
            done = await self._archive(together)
        except psycopg.Error as e:
            if not self._refusal(e):
                raise
            alone += sorted({key for _, key, _ in together})
        for key in alone:
            board, got, unreadable = journals[key]
            done += await self._alone(key, board, got, unreadable)
        self._failed = False
        HELD_JOURNALS.set(len(self._held))
        return done

    async def _lost(self, found: Sequence[tuple[Board, str]]) -> None:
        """Mark the shards whose journals poll.lua found without their sentinel (Redis lost their
        slot while the registry kept the board: a master and its replica lost at once, the slot
        served again empty) not rebuilt (``BoardStore.lost``): reads that merge one and writes to
        it are refused (503 board_rebuilding) until `shardlb rebuild BOARD --shard N` swaps it in.
        Those marked already are left. Each shard marked is logged as an ERROR and counted
        (LOST_SHARDS); a failure is the round's (it is tried again at the next)."""
        shards: dict[tuple[str, str], tuple[Board, set[int]]] = {}
        for board, key in found:
            shard = _shard(board, key)
            if shard not in board.rebuilding:
                shards.setdefault((board.config.id, board.incarnation), (board, set()))[1].add(shard)
        for board, lost in shards.values():
            lost -= await self._empty(board, lost)
            if not lost:
                continue
            for shard in await self.store.lost(board, lost):
                LOST_SHARDS.inc()
                log.error(
                    "shard %d of board %s lost its keys while the registry kept the board (its "
                    "sentinel is missing): marked not rebuilt, its reads and writes answer 503 "
                    "board_rebuilding until `shardlb rebuild %s --shard %d` brings it back %s",
                    shard,
                    board.config.id,
                    board.config.id,
                    shard,
                    whence([shard], band_shards(board)),
                    extra={"fields": {"board": board.config.id, "incarnation": board.incarnation}},
                )

    async def _empty(self, board: Board, shards: set[int]) -> set[int]:
        """Of ``shards`` (their sentinels found missing), those with nothing a rebuild could bring
        back, whose sentinel is written again instead of a mark (``written_again``, whose rule a
        reshard's mover cancelling for a lost shard follows too). Each written by this call is logged
        as a WARNING and counted (REWRITTEN_SENTINELS); a sentinel found there again (a rebuild, an
        archiver of another name, a mover's cancel) is neither."""
        found = await written_again(self.store, self.db, board, shards, self._resentinel)
        homes = board.layout.sharding.shards if board.layout.strategy == "band" else len(board.prefixes)
        for shard, written in sorted(found.items()):
            if written != 1:
                continue
            REWRITTEN_SENTINELS.inc()
            why = "its home shards hold no player" if shard >= homes else "PostgreSQL holds no row of it"
            fields = {"board": board.config.id, "incarnation": board.incarnation, "shard": shard}
            log.warning(
                "sentinel missing on a shard with nothing archived: written again (shard %d of board "
                "%s holds nothing and %s, so nothing was lost that a rebuild could bring back; a "
                "failover before its replica had the sentinel?)",
                shard,
                board.config.id,
                why,
                extra={"fields": fields},
            )
        return set(found)

    async def _archive(self, batch: Sequence[tuple[Board, str, Entry]]) -> int:
        """Commit ``batch`` in one transaction, then acknowledge it; returns the results archived."""
        if not batch:
            return 0
        rows = _merge_retries([row for board, _, entry in batch for row in _rows(board, entry)], batch)
        removals, records, revived = _removal_rows([(b.config.mode, e) for b, _, e in batch])
        cuts = await self._marks(batch)
        await self._write(rows, removals, records, cuts, revived)
        acked: dict[str, list[str]] = {}
        for _, key, entry in batch:
            acked.setdefault(key, []).extend((entry.id, str(entry.counted)))
        await self._ack(acked)
        return len(rows) + len(removals)

    async def _alone(
        self, key: str, board: Board, got: list[Entry], unreadable: _Unreadable | None = None
    ) -> int:
        """Archive one journal's entries in their order, up to the first that PostgreSQL refuses, in
        transactions of their own; from that entry on nothing is acknowledged: the journal is held
        there and tried again every RETRY_REFUSED_S. Halving the entries on each refusal finds the
        refused one in a few transactions; a held journal tries its refused entry alone first.
        ``got`` stops before an entry that cannot be decoded (``_read``): the journal is then held
        at that one once the entries before it are archived."""
        todo = sorted({e.id: e for e in got}.values(), key=lambda e: _order(e.id))  # XAUTOCLAIM may repeat
        done = 0
        while todo:
            held = self._held.get(key)
            size = 1 if held is not None and todo[0].id == held.entry else len(todo)
            while True:
                try:
                    done += await self._archive([(board, key, e) for e in todo[:size]])
                    break
                except psycopg.Error as e:
                    if not self._refusal(e):
                        raise
                    if size == 1:
                        self._hold(key, todo[0].id, todo[0].board, e)
                        return done
                    size //= 2
            todo = todo[size:]
        if unreadable is not None:
            self._hold(key, unreadable.id, board.config.id, unreadable.error, refused=False)
        else:
            self._held.pop(key, None)
        return done

    def _refusal(self, e: psycopg.Error) -> bool:
        """Whether PostgreSQL refused what it was given (a data error, a constraint, ...), rather
        than failed on its own (a lost connection, a timeout, a deadlock, a full disk: the
        OperationalErrors), which the round's retry in ``run`` deals with."""
        return isinstance(e, psycopg.DatabaseError) and not (
            isinstance(e, psycopg.OperationalError) or self.db.closed or self.db.broken
        )

    def _hold(self, key: str, entry: str, board: str, e: Exception, refused: bool = True) -> None:
        """Hold the journal at ``entry`` (refused by PostgreSQL, or else not decodable), logged and
        counted once per journal and entry."""
        held = self._held.get(key)
        if held is None or held.entry != entry:
            (REFUSED if refused else UNREADABLE).inc()
            what = "PostgreSQL refused entry" if refused else "Entry"
            why = "PostgreSQL takes the entry" if refused else "the entry can be read"
            # The fields in the message too: `shardlb archive` logs plain lines (main).
            log.error(
                "%s %s of journal %s (board %s)%s: %r. The journal is held there, not archived past "
                "it, until %s or it is acknowledged by hand (docs/design-notes.md, \"An entry "
                "PostgreSQL refuses\")",
                what, entry, key, board, "" if refused else " cannot be read", e, why,
                extra={"fields": {"journal": key, "entry": entry, "board": board, "error": repr(e)}},
            )  # fmt: skip
        self._held[key] = _Held(entry, time.monotonic())

    async def run(
        self,
        stop: asyncio.Event,
        idle_s: float = 0.2,
        refresh_s: float = 2.0,
        pause_max_s: float = PAUSE_MAX_S,
    ) -> None:
        """Archive until ``stop`` is set, refreshing the board list every ``refresh_s``; errors are
        logged and retried after a pause (the entries stay in the journals meanwhile).

        After a round that archived nothing it waits ``idle_s``, or as long as that round took if
        longer, up to ``pause_max_s``: an idle archiver polls its journals at most half the time
        (less with so many journals that a round takes longer than ``pause_max_s``), and one round
        held up (a failover, a slow node) holds the next no more than ``pause_max_s``. A round reads every
        journal of the registry, so with many boards its time grows with them (20,000 journals: a
        second or so), and back to back such rounds kept a core and the masters busy finding
        nothing (docs/design-notes.md, "Work that grows with the whole cluster")."""
        refreshed = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() - refreshed > refresh_s:
                    await self.refresh()
                    refreshed = time.monotonic()
                began = time.monotonic()  # the round's own time: a refresh held up is no reason to wait
                done = await self.round()
            except Exception as e:
                if not _passing(e):
                    raise
                FAILED_ROUNDS.inc()
                pause = retry_pause(self.outage.failures + 1)  # the failures in a row, this one too
                self.outage.failed(e, {"pause_s": pause})
                with contextlib.suppress(psycopg.Error):
                    await self.db.rollback()
                await _sleep(stop, pause)
                await self._reconnect()
                continue
            self.outage.succeeded()
            if done:
                ARCHIVED.inc(done)
                continue
            await _sleep(stop, max(idle_s, min(pause_max_s, time.monotonic() - began)))

    async def _reconnect(self) -> None:
        """A new connection when PostgreSQL closed ours (a restart, a failover, a proxy's timeout).

        The boards recorded through the old one are recorded again at the next refresh (``INSERT
        ... ON CONFLICT DO NOTHING``): the server now reached may be a restore from a backup taken
        before some of them (or a failover to a standby that lagged), and `rebuild --all` restores
        boards from its `boards`. Until 2026-12-05 a board recorded before the restore was not
        recorded again while the archiver ran."""
        if not self.db.closed or self.db_url is None:
            return
        try:
            self.db = await connect_db(self.db_url)
        except (psycopg.Error, OSError) as e:
            self.db_outage.failed(e)
        else:
            self._known.clear()
            self.db_outage.succeeded()

    async def lag(self) -> dict[str, Lag]:
        """The lag of every journal this archiver knows, by journal key."""
        out = {}
        for board in self.boards.values():
            for prefix in _journals(board):
                key = keys.journal_key(prefix)
                out[key] = await journal_lag(self.client, key)
        return out

    async def _poll(self, journals: Sequence[str]) -> list[tuple[list[Entry], _Unreadable | None]]:
        """``_read`` of each journal: poll.lua through one pipeline per node (``_each``). Until
        2026-12-06 each journal was three round trips of its own (XAUTOCLAIM, XREADGROUP and the
        COMMAND GETKEYS redis-py asks before each XREADGROUP): an idle archiver of 2,000 boards of
        10 shards took 16 s a round and most of a core to find nothing."""
        calls = [self._poll_call(key) for key in journals]
        self._missing = set()
        # The round counts as failed from here until its entries are committed and acknowledged
        # (``round``): the reads hand entries to this consumer alone, and if one made again alone
        # fails too, the round ends without the others' replies. Marked only after the reads, the
        # next round read from '>' and missed those entries until XAUTOCLAIM took them over
        # (``claim_idle_s``, 30 s).
        self._failed = True
        # The journals that gave the last round entries go JOURNALS_IN_FLIGHT to a pipeline: each
        # reply may hold ``count`` entries twice over (claimed and new), and 500 such in one
        # pipeline (a backlog after a PostgreSQL outage) passed the socket's timeout, every call of
        # it then read again alone. The others, nearly always empty, go JOURNALS_AT_ONCE.
        busy = [c for c in calls if c[0] in self._busy]
        quiet = [c for c in calls if c[0] not in self._busy]
        replies: dict[str, Any] = {}
        for group, at_once in ((busy, JOURNALS_IN_FLIGHT), (quiet, JOURNALS_AT_ONCE)):
            got = await self._each(self._poller, group, at_once, numkeys=2)
            replies.update(zip([c[0] for c in group], got, strict=True))
        # Those that failed there are read again, this consumer's pending entries first: a call
        # that ran but lost its reply handed out entries that only this consumer holds now. Again
        # JOURNALS_IN_FLIGHT to a pipeline: a journal with a backlog the last round did not see
        # (an archiver's first round, entries claimed from a dead archiver) went with the quiet
        # ones, and their pipeline passed the socket's timeout; until 2026-12-06 each was then read
        # alone, one at a time. What fails again is read alone, as is a call its node answered with
        # an error (NOSCRIPT, MOVED...): the cluster client loads the script, or follows the slot.
        failed = [
            key
            for key in journals
            if isinstance(replies[key], BaseException) and not isinstance(replies[key], ResponseError)
        ]
        if failed:
            again = [self._poll_call(key, own_first=True) for key in failed]
            got = await self._each(self._poller, again, JOURNALS_IN_FLIGHT, numkeys=2)
            replies.update(zip(failed, got, strict=True))
        out = []
        for key in journals:
            reply = replies[key]
            if isinstance(reply, BaseException):
                out.append(await self._read(key, own_first=True))
            else:
                out.append(self._entries(key, reply))
        self._busy = {key for key, (got, unreadable) in zip(journals, out, strict=True) if got or unreadable}
        return out

    async def _read(self, key: str, own_first: bool = False) -> tuple[list[Entry], _Unreadable | None]:
        """The journal's entries for this round, in the order read, and the first that cannot be
        decoded, if any: the entries returned stop before it (the journal is held there).
        ``own_first``: this consumer's pending entries (XREADGROUP from '0'), whatever the round."""
        call = self._poll_call(key, own_first)
        return self._entries(key, await self._poller(keys=call[:2], args=call[2:]))

    def _poll_call(self, key: str, own_first: bool = False) -> tuple[Any, ...]:
        """poll.lua's keys and arguments for the journal ``key``: its shard's sentinel beside it
        when its board's record says the shard carries one (``_watched``), else the journal again.
        Not a sentinel that does not exist: while a move of the slot is open, Redis answers a call
        naming keys of the slot some of which it lacks TRYAGAIN, and until 2026-12-06 every round
        failed for as long as a board without sentinels had its slot moved."""
        if key not in self._watched:
            return (key, key, *self._poll_args(key, own_first), "0")
        sentinel = keys.sentinel_key(key.removesuffix(keys.journal_key("")))
        return (key, sentinel, *self._poll_args(key, own_first), "1")

    def _poll_args(self, key: str, own_first: bool = False) -> list[Any]:
        # On a held journal this consumer's own unacknowledged entries alone ("0"): it takes
        # nothing new until its refused entry is gone. After a failed round, in an archiver's first
        # round, and where the last read of them came back full, its own unacknowledged entries
        # first, new ones if none ("0>").
        if key in self._held:
            start = "0"
        elif own_first or self._failed or key in self._own:
            start = "0>"
        else:
            start = ">"
        return [GROUP, self.name, self.claim_idle_ms, self.count, start]

    def _entries(self, key: str, reply: Any) -> tuple[list[Entry], _Unreadable | None]:
        """``_read``'s answer from poll.lua's reply (None: the journal does not exist)."""
        if reply is not None and len(reply) > 3 and reply[3] == 1:
            self._missing.add(key)  # its sentinel is gone: ``_lost``
            if reply[0] is None:
                reply = None
        if reply is None:  # the journal went with its board, or has not been written yet
            self._groups.discard(key)
            return [], None
        self._groups.add(key)
        claimed, fresh, own = reply[:3]
        # A full read of this consumer's own pending entries may have left more: read them next
        # round too, not ``claim_idle_s`` later through XAUTOCLAIM.
        if own and len(fresh) >= self.count:
            self._own.add(key)
        else:
            self._own.discard(key)
        got, unreadable = [], None
        seen = set()  # an entry claimed (XAUTOCLAIM) is also among this consumer's own, read from '0'
        for i, flat in [*claimed, *fresh]:
            if not flat or i in seen:
                continue
            seen.add(i)
            try:
                got.append(decode(i, dict(zip(flat[::2], flat[1::2], strict=True))))
            except Exception as e:  # whatever a damaged entry makes decode raise
                if unreadable is None or _order(_id(i)) < _order(unreadable.id):
                    unreadable = _Unreadable(_id(i), e)
        if unreadable is not None:
            got = [e for e in got if _order(e.id) < _order(unreadable.id)]
        return got, unreadable

    async def _each(
        self,
        script: Script,
        calls: Sequence[tuple[Any, ...]],
        at_once: int = JOURNALS_AT_ONCE,
        numkeys: int = 1,
    ) -> list[Any]:
        """``script`` on each of ``calls`` (its ``numkeys`` keys, a journal's, then its arguments):
        ``at_once`` at a time, one pipeline per node (fanout.batch). Each reply, or the exception
        its call met there (a slot moved, a lost connection, NOSCRIPT, a timeout): the caller makes
        that one again, in the end alone, through the cluster client, which follows redirects and
        loads the script."""
        out: list[Any] = []
        for start in range(0, len(calls), at_once):
            chunk = calls[start : start + at_once]
            pipe = batch(self.client)
            for call in chunk:
                pipe.execute_command("EVALSHA", script.sha, numkeys, *call)
            try:
                out += await pipe.outcomes()
            except (RedisError, RedisClusterException, OSError) as e:
                out += [e] * len(chunk)
        return out

    async def _each_or_alone(
        self, script: Script, calls: Sequence[tuple[Any, ...]], numkeys: int = 1
    ) -> list[Any]:
        """``_each``, and each call that failed there made again alone (its error is raised then,
        and the round fails: its entries are read again). For calls that may be made twice: an
        acknowledgement, a trim, a recount and a forgetting are."""
        replies = await self._each(script, calls, numkeys=numkeys)
        return [
            await script.run(numkeys, list(call)) if isinstance(reply, BaseException) else reply
            for call, reply in zip(calls, replies, strict=True)
        ]

    async def _marks(self, batch: Sequence[tuple[Board, str, Entry]]) -> list[_Mark]:
        """Per journal of ``batch``: its newest entry there, and the newest id it has trimmed, read
        now, before the transaction that compares it with this database's mark (``_GAPS``)."""
        newest: dict[str, Entry] = {}
        for _, key, e in batch:
            if key not in newest or _order(e.id) > _order(newest[key].id):
                newest[key] = e
        found = await self._trimmed_to(list(newest))
        return [
            _Mark(key, e.board, e.incarnation, e.shard, e.id, cut)
            for (key, e), cut in zip(newest.items(), found, strict=True)
        ]

    async def _trimmed_to(self, journals: Sequence[str]) -> list[str]:
        """Each journal's ``max-deleted-entry-id``: the newest entry a trim has deleted ('0-0': none,
        or no journal). XINFO STREAM through one pipeline per node; a read that failed there is
        made again alone (until 2026-12-06 each was a call of its own, 16 at a time)."""
        out: list[str] = []
        for start in range(0, len(journals), JOURNALS_AT_ONCE):
            chunk = journals[start : start + JOURNALS_AT_ONCE]
            pipe = batch(self.client)
            for key in chunk:
                pipe.execute_command("XINFO", "STREAM", key)
            try:
                replies = await pipe.outcomes()
            except (RedisError, RedisClusterException, OSError) as e:
                replies = [e] * len(chunk)
            for key, reply in zip(chunk, replies, strict=True):
                if isinstance(reply, BaseException):
                    try:
                        reply = await self.client.xinfo_stream(key)
                    except ResponseError:  # the journal went with its board: nothing to compare
                        reply = []
                out.append(_deleted_to(reply))
        return out

    async def _trim(self, journals: Sequence[str], recount: bool = False) -> dict[str, str]:
        """Trim ``journals`` (trim.lua), and forget their idle consumers (at most every
        FORGET_EVERY_S a journal); with ``recount``, set their count of results not archived again
        (recount.lua, at most every RECOUNT_EVERY_S a journal). Through one pipeline per node, each
        call that failed there made again alone (``_each_or_alone``). Called for the journals that
        gave a round nothing (at most every IDLE_TRIM_EVERY_S a journal) and, with ``recount``,
        for those a round acknowledged (``_ack``). Returns each one's max-deleted-entry-id ('0-0':
        none, or no journal) for ``_judge``.

        A forgetting that failed in its pipeline is made again alone too: dropped, its NOSCRIPT
        never loaded forget.lua on a node that lost its scripts (a promoted replica), and where
        every journal stayed idle no consumer was forgotten there again."""
        now = time.monotonic()
        trimmed = await self._each_or_alone(self._trimmer, [(key, GROUP) for key in journals])
        out = {key: "0-0" if cut is None else _text(cut) for key, cut in zip(journals, trimmed, strict=True)}
        for key in journals:
            self._trimmed[key] = now
        if recount:
            due = [key for key in journals if now - self._recounted.get(key, -math.inf) >= RECOUNT_EVERY_S]
            calls = [(key, keys.journal_counts_of(key), GROUP, RECOUNT_LIMIT) for key in due]
            await self._each_or_alone(self._recounter, calls, numkeys=2)
            for key in due:
                self._recounted[key] = now
        forgotten = [key for key in journals if now - self._forgotten.get(key, -math.inf) >= FORGET_EVERY_S]
        args: list[str | int] = [GROUP, self.forget_idle_ms, self.name]
        await self._each_or_alone(self._forgetter, [(key, *args) for key in forgotten])
        for key in forgotten:
            self._forgotten[key] = now
        return out

    async def _judge(self, idle: Sequence[tuple[Board, str, str]]) -> None:
        """``_GAPS`` for journals that gave this round nothing, after their idle trim (at most every
        IDLE_TRIM_EVERY_S a journal): a journal without a write since PostgreSQL was restored lost
        its trimmed entries from the archive as much as a busy one. Until 2026-12-05 a journal was
        compared only before a write of its entries, so a quiet board's loss went unrecorded, and
        `reconcile --repair` or a rebuild dropped those results from Redis. No mark is written."""
        marks = [
            _Mark(key, board.config.id, board.incarnation, _shard(board, key), "", cut)
            for board, key, cut in idle
            if cut != "0-0"
        ]
        if not marks:
            return
        async with self.db.transaction(), self.db.cursor() as cur:
            gaps = await self._gaps(cur, marks)
        self._report(gaps)

    async def _write(
        self,
        rows: Sequence[tuple[Any, ...]],
        removals: Sequence[tuple[Any, ...]] = (),
        records: Sequence[tuple[Any, ...]] = (),
        marks: Sequence[_Mark] = (),
        revived: Sequence[tuple[str, str, str, str]] = (),
    ) -> None:
        gaps: list[tuple[Any, ...]] = []
        async with self.db.transaction(), self.db.cursor() as cur:
            if marks:
                gaps = await self._gaps(cur, marks)
                await cur.execute(
                    _MARK,
                    (
                        [m.journal for m in marks],
                        [m.board for m in marks],
                        [m.incarnation for m in marks],
                        [m.newest for m in marks],
                    ),
                )
            await self._rows(cur, rows, removals, records)
            await self._promote(cur, revived)
        self._report(gaps)

    @staticmethod
    async def _gaps(cur: psycopg.AsyncCursor[Any], marks: Sequence[_Mark]) -> list[tuple[Any, ...]]:
        """``_GAPS`` for ``marks``, inside the caller's transaction; returns the gaps recorded."""
        await cur.execute(
            _GAPS,
            (
                [m.journal for m in marks],
                [m.board for m in marks],
                [m.incarnation for m in marks],
                [m.shard for m in marks],
                [m.trimmed for m in marks],
            ),
        )
        return list(await cur.fetchall())

    @staticmethod
    def _report(gaps: Sequence[tuple[Any, ...]]) -> None:
        """Log and count the gaps a committed transaction recorded (each once: ``_GAPS``)."""
        for journal, board, archived_to, trimmed_to in gaps:
            GAPS.inc()
            log.error(
                "journal %s (board %s) trimmed entries up to %s, but this archive holds its entries up to "
                "%s only: results acknowledged after a commit are missing from PostgreSQL (restored from "
                "a backup?). Redis's board still holds them; rebuilds of the board are refused until "
                "forced (docs/design-notes.md, \"PostgreSQL restored from a backup\")",
                journal, board, trimmed_to, archived_to,
                extra={"fields": {"journal": journal, "board": board, "archived_to": archived_to,
                                  "trimmed_to": trimmed_to}},
            )  # fmt: skip

    async def _rows(
        self,
        cur: psycopg.AsyncCursor[Any],
        rows: Sequence[tuple[Any, ...]],
        removals: Sequence[tuple[Any, ...]],
        records: Sequence[tuple[Any, ...]],
    ) -> None:
        """The entries' rows, inside ``_write``'s transaction."""
        await _insert_removals(cur, removals, records)
        if not rows:
            return
        await cur.execute(
            "CREATE TEMP TABLE IF NOT EXISTS incoming (LIKE match_results INCLUDING DEFAULTS) "
            "ON COMMIT DELETE ROWS"
        )
        async with cur.copy(f"COPY incoming ({_COLUMNS}) FROM STDIN") as copy:
            for row in rows:
                await copy.write_row(row[1:])
        held = _holds(rows)
        timed = [r for r in rows if r[0] != "incr" and _dated(self.boards.get((r[1], r[2])))]
        if timed:
            boards = sorted({(r[1], r[2]) for r in timed})
            await cur.execute(_OTHER_TIMES, ([b for b, _ in boards], [i for _, i in boards]))
            held += _time_holds(timed, await cur.fetchall(), self.boards)
        if held:
            await cur.executemany(
                "INSERT INTO match_holds (board, incarnation, match_id, player_id, period, points, "
                "achieved_ms, score, shard, journal_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT DO NOTHING",
                held,
            )
        for mode, rule in _ON_CONFLICT.items():
            boards = sorted({(r[1], r[2]) for r in rows if r[0] == mode})
            if not boards:
                continue
            if mode != "incr" and any(r[10] for r in rows if r[0] == mode):
                await cur.execute(_HOLD, ([b for b, _ in boards], [i for _, i in boards]))
            if mode != "incr":  # rows that skip a period are few: the join finds them at once
                await cur.execute(_HOLD_EARLIER, ([b for b, _ in boards], [i for _, i in boards]))
            named = ([b for b, _ in boards], [i for _, i in boards])
            mine = [r for r in rows if r[0] == mode]
            # Of one key's copies in the batch, one not cut (``_CUT``) comes first, before the mode's
            # rule: looked up for the keys with copies, in a batch that has any.
            copies = len({r[1:5] for r in mine}) < len(mine)
            source = (
                "(SELECT *, count(*) OVER (PARTITION BY board, incarnation, match_id, player_id) AS copies "
                "FROM incoming WHERE (board, incarnation) IN (SELECT * FROM unnest(%s::text[], %s::text[]))) "
                f"incoming ORDER BY board, incarnation, match_id, player_id, CASE WHEN copies > 1 THEN "
                f"{_CUT.format('incoming')} ELSE FALSE END, {_FIRST[mode]}"
                if copies
                else "incoming WHERE (board, incarnation) IN (SELECT * FROM unnest(%s::text[], %s::text[])) "
                f"ORDER BY board, incarnation, match_id, player_id, {_FIRST[mode]}"
            )
            await cur.execute(
                f"INSERT INTO match_results ({_COLUMNS}) "
                f"SELECT DISTINCT ON (board, incarnation, match_id, player_id) {_COLUMNS} FROM {source} "
                f"ON CONFLICT (board, incarnation, match_id, player_id) {rule}",
                named,
            )
            if cur.rowcount < len(mine):  # rows not taken: rare (a key's results sent again)
                await cur.execute(_KEEP_LATER["incr" if mode == "incr" else "held"], named)

    @staticmethod
    async def _promote(cur: psycopg.AsyncCursor[Any], revived: Sequence[tuple[str, str, str, str]]) -> None:
        """``_PROMOTE`` for the players a batch's removals name (mode, board, incarnation, player),
        inside ``_write``'s transaction, after the rows."""
        for mode in sorted({r[0] for r in revived}):
            named = [r[1:] for r in revived if r[0] == mode]
            await cur.execute(_PROMOTE.format(_FIRST[mode]), [list(c) for c in zip(*named, strict=True)])

    async def _ack(self, acked: Mapping[str, Sequence[str]]) -> None:
        """Acknowledge entries (per journal, ``pairs``: id, its count of results, ...) and take
        their results off the count not archived (ack.lua, which counts an entry once however
        often it is acknowledged), then trim what every consumer has acknowledged (``_trim``).
        Through one pipeline per node: until 2026-12-06 each journal's acknowledgement, trim and
        recount were calls of their own, 16 at a time, and writes spread over many journals made
        a round of as many calls."""
        journals = list(acked)
        calls = [(key, keys.journal_counts_of(key), GROUP, *acked[key]) for key in journals]
        await self._each_or_alone(self._acker, calls, numkeys=2)
        await self._trim(journals, recount=True)


async def mark_deleted(db: psycopg.AsyncConnection[Any], board: str, incarnation: str) -> None:
    """Record in ``boards`` that ``board``'s incarnation ``incarnation`` is deleted, as the archiver's
    refresh does once it sees Redis's mark (a no-op for an incarnation it does not keep): `rebuild
    --all` then never restores it, whatever Redis has lost since. Made by whoever deletes a board,
    once it is deleted in Redis and before the answer (a DELETE, a season archive)."""
    await db.execute(
        "UPDATE boards SET deleted_at = now() WHERE deleted_at IS NULL AND board = %s AND incarnation = %s",
        (board, incarnation),
    )


async def mark_deleting(db: psycopg.AsyncConnection[Any], board: Board) -> None:
    """Record that a DELETE of ``board`` begins (``boards.delete_begun_at``), before its Redis part:
    a pending mark, which `rebuild --all` does not take for a deletion (the DELETE may fail in
    Redis, and answers 503 with the board live), and which ``mark_deleted`` makes the deletion once
    Redis has deleted the board. The row is written when the archiver has not recorded the
    incarnation yet (its INSERT then changes nothing: ON CONFLICT DO NOTHING), so that the final
    mark finds it: an UPDATE alone found no row there, and the archiver, recording the board
    between the two marks and looking for Redis's mark of the deletion before it was set, left the
    row it made live (docs/design-notes.md, "A total loss of Redis")."""
    await db.execute(
        "INSERT INTO boards (board, incarnation, settings, delete_begun_at) VALUES (%s, %s, %s, now()) "
        "ON CONFLICT (board, incarnation) DO UPDATE SET delete_begun_at = now()",
        (board.config.id, board.incarnation, orjson.dumps(_settings(board)).decode()),
    )


async def mark_gone(
    db: psycopg.AsyncConnection[Any], client: RedisCluster, board: str, owed: Sequence[str]
) -> list[str]:
    """``mark_deleted`` for each incarnation of ``board`` among ``owed`` (``owed_deletions``) that
    Redis says was deleted (``keys.deleted_key``, kept a day); returns those, whose debt is paid
    (``paid_deletions``). A DELETE that deleted the board in Redis and failed on its final mark
    (503), sent again, finds the board gone and records the deletion before its 404. The archiver's
    refresh does the same for every board, a refresh later."""
    marked = []
    for incarnation in owed:
        if await client.exists(keys.deleted_key(board, incarnation)):
            await mark_deleted(db, board, incarnation)
            marked.append(incarnation)
    return marked


async def owe_deletion(scripts: Scripts, board: str, incarnation: str) -> None:
    """Note in Redis (``keys.owed_key``) that the DELETE of ``board``'s ``incarnation``, marked
    begun in PostgreSQL (``mark_deleting``), owes it the deletion (``mark_deleted``) until
    ``paid_deletions``: a DELETE that finds no board asks PostgreSQL only for a deletion owed
    (``mark_gone``), and every other 404 costs it nothing. Kept as long as Redis's mark of a
    deletion (``store.GONE_MS``, which ``mark_gone`` needs too); one call of owe.lua, so no entry is
    left without its expiry, run by a registry primary out of memory too (a DELETE frees memory:
    docs/design-notes.md, "Creating and deleting boards on a full cluster"). A total loss of Redis
    takes the note with the deletion's marks: then PostgreSQL's pending mark alone decides, and
    `rebuild --all` restores the board (its DELETE was never acknowledged: docs/design-notes.md, "A
    total loss of Redis")."""
    await scripts.owe(keys=[keys.owed_key(board)], args=[incarnation, GONE_MS])


async def owed_deletions(client: RedisCluster, board: str) -> list[str]:
    """The incarnations of ``board`` whose deletion PostgreSQL is owed (``owe_deletion``)."""
    found = await client.smembers(keys.owed_key(board))
    return sorted(i.decode() if isinstance(i, bytes) else str(i) for i in found)


async def paid_deletions(client: RedisCluster, board: str, incarnations: Sequence[str]) -> None:
    """Forget the debts of ``incarnations`` of ``board``: PostgreSQL records their deletion."""
    if incarnations:
        await client.srem(keys.owed_key(board), *incarnations)


async def record_removals(db: psycopg.AsyncConnection[Any], entries: Sequence[tuple[str, Entry]]) -> None:
    """Archive delete entries ((board mode, entry): ``moderation.remove``'s ``journaled``) now, in
    one transaction, as a round would (``player_removals``, ``removal_records``, ``_PROMOTE``): a
    removal asked for is in PostgreSQL before it is answered. Until 2026-12-06 it was in the
    journal alone until the archiver's next round, and Redis lost meanwhile (a total loss, or the
    shard's master with its replica) took it: the rebuild brought the player back from their
    archived rows. The round that archives the entry again changes nothing (ON CONFLICT DO
    NOTHING; ``_PROMOTE`` is idempotent), as for an entry two archivers both read."""
    removals, records, revived = _removal_rows(entries)
    if not removals and not records:
        return
    async with db.transaction(), db.cursor() as cur:
        await _insert_removals(cur, removals, records)
        await Archiver._promote(cur, revived)


def _removal_rows(
    entries: Sequence[tuple[str, Entry]],
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], list[tuple[str, str, str, str]]]:
    """The rows of the delete entries among ``entries`` ((board mode, entry)): ``player_removals``,
    ``removal_records``, and the players removed, whose rows the removals cut (``_PROMOTE``)."""
    removals = [
        (e.board, e.incarnation, e.shard, p, e.id, _listed(e.kept_in(p)))
        for _, e in entries
        for p in e.removed
    ]
    records: list[tuple[Any, ...]] = []
    for _, e in entries:  # with a removal request's name and mark (NULL: named by none)
        marks: list[str | None] = [*e.marks()] or [None] * len(e.recorded)
        records += [
            (e.board, e.incarnation, e.shard, p, u, e.id, e.request or None, mark)
            for (p, u), mark in zip(e.recorded, marks, strict=True)
        ]
    revived = sorted({(mode, e.board, e.incarnation, p) for mode, e in entries for p in e.removed})
    return removals, records, revived


async def _insert_removals(
    cur: psycopg.AsyncCursor[Any], removals: Sequence[tuple[Any, ...]], records: Sequence[tuple[Any, ...]]
) -> None:
    if records:  # removals' records (remove.lua's `rmv`), which a rebuild puts back
        await cur.executemany(
            "INSERT INTO removal_records (board, incarnation, shard, player_id, units, journal_id, "
            "request, request_mark) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            records,
        )
    if removals:  # delete entries (shardlb/moderation.py): a rebuild drops the results before
        # them, but in the periods the removal left whole (``kept``)
        await cur.executemany(
            "INSERT INTO player_removals (board, incarnation, shard, player_id, journal_id, kept) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            removals,
        )


async def written_again(
    store: BoardStore, db: psycopg.AsyncConnection[Any], board: Board, shards: set[int], resentinel: Script
) -> dict[int, int]:
    """Of ``shards`` of ``board`` (their sentinels found missing), those with nothing a rebuild could
    bring back, whose sentinel is written again (sentinel.lua, run by ``resentinel``) instead of a
    mark; each with sentinel.lua's answer (1 written by this call, 0 found there already). The
    archiver's rule (``Archiver._empty``) and a reshard's mover's, which cancels for a shard lost
    and marks the others at once (shardlb/reshard.py, ``Resharder._settle``).

    Written again where PostgreSQL holds no row of the shard (SHARD_ARCHIVED: what a rebuild of the
    shard reads) and the shard holds nothing in Redis. A failover lost the sentinel of a board
    created (or a shard rebuilt) with ``SHARDLB_ACK=primary`` before its replica had it; marked, the
    healthy board refused service until an operator's rebuild. The journal's entries not archived
    died with the node either way. A band shard's rebuild reads no rows: it takes the home shards'
    totals and versions (``Rebuilder.rebuild_bands``), so it is written again when it holds nothing
    and no home shard holds a total, a version or a pending move, each home carrying its sentinel
    and unmarked (``_homes_empty``): its rebuild would write nothing there either.

    The record is read first (``BoardStore.watched``): nothing for a board being deleted,
    resharded, or of another incarnation or layout since, nor for a shard it marks already. A
    write meanwhile is refused by write.lua until the sentinel is back (the shard stays empty);
    a deletion leaves its `gone` marker and a reshard its `mv`, which sentinel.lua refuses."""
    homes = board.layout.sharding.shards if board.layout.strategy == "band" else len(board.prefixes)
    marked = await store.watched(board) if shards else None
    if marked is None:
        return {}
    done: dict[int, int] = {}
    # The home shards first: one written again there may let the band shards be written again.
    for shard in sorted(shards - marked):
        params = {"board": board.config.id, "incarnation": board.incarnation, "shard": shard}
        if shard >= homes:
            if not await _homes_empty(store.client, board, homes, marked):
                continue
        else:
            async with db.transaction():
                await db.execute(SHARD_ARCHIVED_SETTINGS)
                cur = await db.execute(SHARD_ARCHIVED, params)
                row = await cur.fetchone()
            if row is None or row[0]:
                continue
        prefix = board.prefixes[shard]
        names = [keys.sentinel_key(prefix), *(prefix + k for k in _HOLDING)]
        written = int(await resentinel(keys=names, args=[]))
        if written != -1:
            done[shard] = written
    return done


async def _homes_empty(client: RedisCluster, board: Board, homes: int, marked: set[int]) -> bool:
    """Whether a band board's home shards hold nothing its band shards' rebuild would read
    (``Rebuilder.rebuild_bands``: every home's totals and versions): each home unmarked, carrying
    its sentinel (one lost with its keys is no evidence), and holding no total, no version and
    no pending band move. Two EXISTS per home shard, only for a band shard found without its
    sentinel. A write to a home after this look that moves a player into the band shard reaches
    it by band.lua, which checks no sentinel: before sentinel.lua, the band shard holds its row
    and is marked; after, it holds its row and its sentinel."""
    if marked.intersection(range(homes)):
        return False
    for home in range(homes):
        prefix = board.prefixes[home]
        if not await client.exists(keys.sentinel_key(prefix)):
            return False
        held = (keys.period_key(prefix, "total"), keys.version_key(prefix), keys.pending_key(prefix))
        if await client.exists(*held):
            return False
    return True


def _settings(board: Board) -> dict[str, Any]:
    """What PostgreSQL keeps of a board to restore it (shardlb/rebuild.py): its settings, and its
    layout generation once a reshard drew one (shardlb/reshard.py records each new one)."""
    settings = board.config.to_dict()
    return {**settings, "generation": board.generation} if board.generation else settings


# Whether PostgreSQL holds any row of a board's shard that its rebuild reads (``written_again``):
# its results (``match_results``, through match_results_on_shard, shard first), its removals and
# removal records (their primary keys: board, incarnation, shard). Not ``match_holds``, which has no
# index by shard (a look there read every hold of the board: 2,000 in tests/test_read_plans.py): a
# hold is an earlier application of a (match, player) whose later one is the ``match_results`` row,
# on the same shard (the player's home; a reshard rehomes both), and no deletion takes the row and
# leaves the hold (``erase`` takes rows journaled before a removal: the hold, earlier, goes first).
# Each EXISTS stops at its first row. Run only for a shard whose sentinel is missing, never on the
# round's path, and after SHARD_ARCHIVED_SETTINGS in its transaction: without them PostgreSQL
# planned an EXISTS it expects a row from soon as a sequential scan, which reads the table up to the
# shard's first row (6,001 rows for the big board's shard in tests/test_read_plans.py, against 1),
# or the whole table when the estimate is wrong and the shard has none.
SHARD_ARCHIVED_SETTINGS = "SELECT set_config('enable_seqscan', 'off', true)"
SHARD_ARCHIVED = (
    "SELECT EXISTS (SELECT 1 FROM match_results "
    "WHERE shard = %(shard)s AND board = %(board)s AND incarnation = %(incarnation)s) "
    "OR EXISTS (SELECT 1 FROM player_removals "
    "WHERE board = %(board)s AND incarnation = %(incarnation)s AND shard = %(shard)s) "
    "OR EXISTS (SELECT 1 FROM removal_records "
    "WHERE board = %(board)s AND incarnation = %(incarnation)s AND shard = %(shard)s)"
)
# The keys of a shard (after its prefix) that say it holds something, or is being dropped or moved,
# which sentinel.lua checks before it writes a sentinel again: the journal and its count (every
# write and removal of a journaled board), the key index (every key written that expires, and the
# dated periods), the total, the removals, a band home's versions and moves, the activity set and
# pin marker, a rebuild's forced swap, the closed board's freeze, a deletion's `gone`, a reshard's.
_HOLDING = (
    "log",
    "logn",
    "idx",
    "total",
    "rmv",
    "rmvon",
    "ver",
    "pend",
    "vrm",
    "vfl",
    "seen",
    "pspan",
    "swap",
    "frozen:total",
    "gone",
    "mv",
    "seal",
    "chg",
    "chgw",
    "fence",
)


def _shard(board: Board, journal: str) -> int:
    """The shard number of one of ``_journals(board)``: its place in its layout's prefixes."""
    for prefixes in (board.prefixes, board.also):
        for shard, prefix in enumerate(prefixes):
            if keys.journal_key(prefix) == journal:
                return shard
    raise ValueError(f"{journal!r} is no journal of board {board.config.id!r}")


def _listed(periods: frozenset[str] | None) -> list[str] | None:
    """``player_removals.kept`` of a removal that left ``periods`` whole (None: none)."""
    return None if periods is None else sorted(periods)


def _journals(board: Board) -> list[str]:
    """The prefixes of the shards whose journals hold the board's entries: its layout's, and after a
    reshard's cut-over the old layout's until they are drained (shardlb/reshard.py)."""
    return board.prefixes if board.moving else board.prefixes + board.also


def _rows(board: Board, entry: Entry) -> list[tuple[Any, ...]]:
    """``match_results`` rows of one journal entry, each led by the board's mode."""
    codec, mode = board.codec, board.config.mode
    out = []
    for r in entry.results:
        achieved = codec.epoch_ms + r.units * codec.unit_ms
        score = codec.encode_units(r.points, r.units)
        match = r.match_id if "\x00" not in r.match_id else r.match_id.replace("\x00", NUL_STANDIN)
        out.append((mode, entry.board, entry.incarnation, match, r.player_id, r.points, achieved, score,
                    entry.shard, entry.id, list(r.skipped)))  # fmt: skip
    return out


def _merge_retries(
    rows: list[tuple[Any, ...]], batch: Sequence[tuple[Board, str, Entry]]
) -> list[tuple[Any, ...]]:
    """``rows`` with the periods of a result applied more than once in the batch made those of every
    application (a copy's ``skipped``: what all copies skipped), as the upsert does with a row
    archived before (``_SKIPPED``): the copy the upsert keeps must not drop a period an earlier one
    is in on the board. A removal of the player between two copies starts again from the later one.
    Rows carry their skips only when a result met a closed or frozen period, so most batches return
    at once."""
    if not any(row[10] for row in rows):
        return rows
    # (board, incarnation, match, player, achieved, score): copies of one result, in journal order.
    copies: dict[tuple[Any, ...], list[int]] = {}
    for n, row in enumerate(rows):
        copies.setdefault((*row[1:5], row[6], row[7]), []).append(n)
    removed: dict[tuple[str, str, str], list[tuple[int, int]]] = {}
    for _, _, entry in batch:
        for player in entry.removed:
            removed.setdefault((entry.board, entry.incarnation, player), []).append(_order(entry.id))
    out = list(rows)
    for key, found in copies.items():
        if len(found) < 2:
            continue
        found.sort(key=lambda n: _order(rows[n][9]))
        kept = set(rows[found[0]][10])
        for before, n in itertools.pairwise(found):
            between = (_order(rows[before][9]), _order(rows[n][9]))
            if any(between[0] < at < between[1] for at in removed.get((key[0], key[1], key[3]), ())):
                kept = set(rows[n][10])
            else:
                kept &= set(rows[n][10])
            out[n] = (*rows[n][:10], sorted(kept))
    return out


def _holds(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``match_holds`` rows for copies of one (match, player) within a batch of a best or set board,
    which the upsert's DISTINCT ON keeps one of: each copy for every period a later copy skipped and
    it did not (``_HOLD``, which does the same against the row archived before)."""
    copies: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for row in rows:
        if row[0] != "incr":
            copies.setdefault(row[1:5], []).append(row)
    out = []
    for found in copies.values():
        if len(found) < 2 or not any(row[10] for row in found):
            continue
        found.sort(key=lambda row: _order(row[9]))
        for k, later in enumerate(found):
            for row in found[:k]:
                out += [(*row[1:5], p, *row[5:10]) for p in sorted(set(later[10]) - set(row[10]))]
    return out


def _dated(board: Board | None) -> bool:
    """Whether ``board`` (None: not among the archiver's) keeps a dated period: a board of the
    total alone needs no ``_time_holds``, nor their look-up."""
    return board is not None and len(board.config.periods) > 1


def _time_holds(
    rows: Sequence[tuple[Any, ...]],
    archived: Sequence[tuple[Any, ...]],
    boards: Mapping[tuple[str, str], Board],
) -> list[tuple[Any, ...]]:
    """``match_holds`` rows for the applications of one (match, player) of a best or set board at two
    or more achieved times (``rows`` of the batch, ``archived``: ``_OTHER_TIMES``): each application for
    every dated period of its time that it did not skip and another application is not in. The board
    has it there, and the one row the upsert keeps is in the periods of its own time only. A hold of
    the application the row keeps is a copy, and one of an application the row's rule beats in the
    period changes no fold (best: the highest score; set: the latest time); the moderation rule
    drops a hold journaled before a removal as it drops a row (its own journal id)."""
    found: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for row in rows:
        found.setdefault(row[1:5], []).append(row[1:])
    for row in archived:
        if row[:4] in found:
            found[row[:4]].append(tuple(row))
    out = []
    for (board_id, incarnation, *_), applied in found.items():
        board = boards.get((board_id, incarnation))
        if board is None or len({a[5] for a in applied}) < 2:
            continue
        dated = [set(board.period_names(a[5])) - {"total"} - set(a[9]) for a in applied]
        for a, mine in zip(applied, dated, strict=True):
            out += [(*a[:4], p, *a[4:9]) for p in sorted(mine) if any(p not in other for other in dated)]
    return out


async def trim(script: Script, key: str) -> str | None:
    """Drop the journal's entries that every consumer has acknowledged (trim.lua, ``script``: those
    older than its oldest pending entry, or, with none pending, up to what the group has been
    given). Returns its max-deleted-entry-id; None when the journal or its group does not exist."""
    found = await script(keys=[key], args=[GROUP])
    return None if found is None else _text(found)


def _deleted_to(info: Any) -> str:
    """``max-deleted-entry-id`` of an XINFO STREAM reply: a flat list of names and values (through
    a pipeline), or a dict (redis-py's reply)."""
    fields = info if isinstance(info, dict) else dict(zip(info[::2], info[1::2], strict=True))
    got = {_text(k): v for k, v in fields.items()}
    return _text(got.get("max-deleted-entry-id") or "0-0")


def _id(value: Any) -> str:
    return _text(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _next(entry_id: str) -> str:
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def retry_pause(failures: int) -> float:
    """Seconds to wait after ``failures`` failed tries in a row (RETRY_FIRST_S, doubling, RETRY_MAX_S)."""
    return min(RETRY_FIRST_S * float(1 << min(failures - 1, 32)), RETRY_MAX_S)


def _passing(e: Exception) -> bool:
    """Whether the archiver may retry after ``e``: trouble with PostgreSQL or the cluster, including
    a failover breaking redis-py inside itself (shardlb/connection.py, ``raised_in_redis``)."""
    return isinstance(e, (psycopg.Error, OSError, RedisError, RedisClusterException)) or raised_in_redis(e)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


# ---- the `shardlb archive` process ------------------------------------------------------------

ARCHIVED = Counter("shardlb_archive_results_total", "results copied from the journals into PostgreSQL")
FAILED_ROUNDS = Counter(
    "shardlb_archive_failed_rounds_total",
    "archive rounds that failed and were retried (and tries of the start's waits for Redis and PostgreSQL)",
)
LAG_ENTRIES = Gauge("shardlb_archive_lag_entries", "journal entries not yet archived, largest over journals")
LAG_RESULTS = Gauge("shardlb_archive_lag_results", "results not yet archived, largest over journals")
LAG_SECONDS = Gauge("shardlb_archive_lag_seconds", "age of the oldest journal entry not yet archived")
REFUSED = Counter(
    "shardlb_archive_refused_entries_total",
    "journal entries PostgreSQL refused, each counted once; its journal is held at it (Archiver.round)",
)
UNREADABLE = Counter(
    "shardlb_archive_unreadable_entries_total",
    "journal entries the archiver cannot decode, each counted once; its journal is held at it",
)
HELD_JOURNALS = Gauge(
    "shardlb_archive_held_journals", "journals held at an entry PostgreSQL refused or that cannot be read"
)
LOST_SHARDS = Counter(
    "shardlb_archive_lost_shards_total",
    "shards found without their sentinel (Redis lost their slot, the registry kept the board) and marked "
    "not rebuilt until `shardlb rebuild BOARD --shard N` (Archiver._lost)",
)
RECOVERED_BANS = Counter(
    "shardlb_archive_recovered_bans_total",
    "bans written back from PostgreSQL because Redis had lost the ban list (a master lost with its replica; "
    "its mark missing, Bans.recover)",
)
REWRITTEN_SENTINELS = Counter(
    "shardlb_archive_rewritten_sentinels_total",
    "shards found without their sentinel that held nothing, in Redis or archived in PostgreSQL (a "
    "failover lost a new board's sentinel before its replica had it): written again, not marked "
    "(Archiver._empty)",
)
GAPS = Counter(
    "shardlb_archive_gaps_total",
    "journals found to have trimmed entries the archive lacks (restored from a backup?), each once",
)
BAND_REPAIRS = Counter(
    "shardlb_band_repairs_total",
    "band moves a write left pending (lost band calls) that the repair loop finished (repair_bands)",
)
# Every metric above: a process that imports this module without archiving (a router) leaves them
# out of its scrape (router/metrics.py), where they would read 0.
METRICS = (
    ARCHIVED,
    FAILED_ROUNDS,
    LAG_ENTRIES,
    LAG_RESULTS,
    LAG_SECONDS,
    REFUSED,
    UNREADABLE,
    HELD_JOURNALS,
    LOST_SHARDS,
    RECOVERED_BANS,
    REWRITTEN_SENTINELS,
    GAPS,
    BAND_REPAIRS,
)
# Seconds between the repair loop's passes (`shardlb archive --repair-every`): how long at most a
# band move whose calls were lost stays unfinished, plus the pass itself, while an archiver runs.
REPAIR_EVERY_S = 5.0


async def _failed_try(outage: Outage, stop: asyncio.Event, e: BaseException) -> bool:
    """One failed try of a wait at the archiver's start (for Redis, then PostgreSQL): counted in
    FAILED_ROUNDS (the probes answer meanwhile: the metrics say it, k8s/README.md), logged as an
    outage, then a pause; True when asked to stop meanwhile."""
    FAILED_ROUNDS.inc()
    pause = retry_pause(outage.failures + 1)
    outage.failed(e, {"pause_s": pause})
    await _sleep(stop, pause)
    return stop.is_set()


async def serve(
    redis_url: str,
    postgres_url: str,
    name: str,
    stop: asyncio.Event,
    lag_every_s: float = 5.0,
    cleanup_every_s: float = 0.0,
    repair_every_s: float = 0.0,
    deliver_every_s: float = 0.0,
    webhook_secret: str = "",
) -> None:
    """Archive every journaled board until ``stop`` is set, keeping the lag gauges current; with
    ``repair_every_s``, finish the band moves writes left pending meanwhile (``repair_bands``); with
    ``deliver_every_s`` and a ``webhook_secret``, send the settlement webhook deliveries that are due
    and that no router or command is sending (``settlement_delivery.sweep_forever``).

    The sweep needs PostgreSQL alone, so it starts first, and the archiver waits for Redis as it
    waits for PostgreSQL: until 2026-12-06 an archiver started while Redis was out of reach (an
    outage, its pod restarted meanwhile) exited at once, over and over, and the deliveries a stopped
    router left waited for Redis (tests/test_settlement_recovery.py)."""
    tasks = []
    if deliver_every_s and webhook_secret:  # on a PostgreSQL connection of its own, reconnecting itself
        sweep = settlement_delivery.sweep_forever(postgres_url, webhook_secret, stop, deliver_every_s)
        tasks.append(asyncio.create_task(sweep))
    elif deliver_every_s:
        log.info("settlement webhooks are not swept by this archiver: SHARDLB_WEBHOOK_SECRET is not set")
    raw = client = db = None
    try:
        outage = Outage(log, "Redis not reachable yet; retrying", "Redis reachable")
        while True:  # the cluster may come up after us (the router waits for it too: router/service.py)
            client = connect(redis_url)  # a client of its own each try: none keeps a failed start's state
            scripts = Scripts.register(client)
            try:
                await scripts.load(client)
                break
            except (RedisError, RedisClusterException, OSError) as e:
                await client.aclose()
                client = None
                if misconfigured(e):  # no wait repairs it: exit, the pod restarted with its settings
                    fields = {"error": str(e), "redis": redacted(redis_url)}
                    log.error("Redis refused the archiver's settings; not retried", extra={"fields": fields})
                    raise
                if await _failed_try(outage, stop, e):
                    return
        outage.succeeded()
        raw = connect(redis_url, decode=False)
        store = BoardStore(client, scripts)
        # Band repairs need Redis only: they go on while PostgreSQL is away.
        if repair_every_s:
            tasks.append(asyncio.create_task(repair_bands(store, stop, repair_every_s)))
        outage = Outage(log, "PostgreSQL not reachable yet; retrying", "PostgreSQL reachable")
        while db is None:  # PostgreSQL may come up after us: the journals wait meanwhile
            try:
                db = await connect_db(postgres_url)
            except (psycopg.Error, OSError) as e:
                if refused_settings(e):  # as for Redis above: exit, the pod restarted with its settings
                    refused = "PostgreSQL refused the archiver's settings; not retried"
                    log.error(refused, extra={"fields": {"error": str(e)}})
                    raise
                if await _failed_try(outage, stop, e):
                    return
        outage.succeeded()
        archiver = Archiver(raw, store, db, name, db_url=postgres_url)
        tasks.append(asyncio.create_task(_watch_lag(archiver, stop, lag_every_s)))
        if cleanup_every_s:
            tasks.append(asyncio.create_task(_cleanup(store, stop, cleanup_every_s)))
        log.info("archiver running", extra={"fields": {"name": name, "redis": redacted(redis_url)}})
        await archiver.run(stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if db is not None:
            await db.close()
        if raw is not None:
            await raw.aclose()
        if client is not None:
            await client.aclose()


def misconfigured(error: BaseException) -> bool:
    """Whether ``error`` (of the start's try for Redis) is one of the settings that no wait repairs:
    credentials the cluster refuses (AuthenticationError, AuthorizationError, NoPermissionError:
    redis-py's ``ExceptionType.AUTH``), or a seed node that is no cluster node; the cluster client
    raises either as the cause of a RedisClusterException, an outage as a
    RedisClusterUnreachableError or a connection error. ``serve`` waits out an outage and exits on
    these, as on a bad URL: until 2026-12-06 (the wait came that day) it waited on them for good,
    its liveness probe answering and nothing archived (tests/test_settlement_recovery.py)."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "error_type", None) == ExceptionType.AUTH:
            return True
        if type(seen) is RedisClusterException and "Cluster mode is not enabled" in str(seen):
            return True
        seen = seen.__cause__
    return False


# The SQLSTATEs of a PostgreSQL that refuses the archiver's settings, which no wait repairs: class
# 28 (invalid authorization: a wrong password, a role unknown or not allowed to log in, no
# pg_hba.conf entry), 3D000 (no such database), 42501 (insufficient privilege: no CONNECT on the
# database, no CREATE in its schema for the archive's tables).
REFUSED_SQLSTATES = ("28", "3D000", "42501")

# What libpq says of the same refusals at a connection's start, where it gives psycopg no SQLSTATE
# (``sqlstate`` is None: psycopg issue 1188), only the server's message, and the message is all
# there is to go by. These are the server's English texts: a server whose lc_messages is another
# language says them in it, and its refusals are waited on, as any failure was before.
REFUSED_AT_CONNECT = re.compile(
    r"authentication failed for user"  # 28P01, and 28000 of ident, peer, LDAP, certificates, ...
    r"|no pg_hba\.conf entry for|pg_hba\.conf rejects connection"  # 28000
    r'|role "[^"]*" (?:does not exist|is not permitted to log in)'  # 28000
    r'|database "[^"]*" does not exist'  # 3D000
    r"|permission denied for database"  # 42501, no CONNECT privilege
    r"|fe_sendauth: no password supplied"  # libpq's own: the server asks one, the URL has none
)


def refused_settings(error: BaseException) -> bool:
    """Whether ``error`` (of the start's try for PostgreSQL, ``connect_db``) is a refusal of the
    archiver's settings that no wait repairs (REFUSED_SQLSTATES, REFUSED_AT_CONNECT), or a server
    too old for the schema (NotSupportedError, ``check_server_version``). An outage is none of them:
    a refused connection or a timeout (no SQLSTATE, no such message), a server that takes no more
    connections (53300), one starting up or shutting down (57P03). ``serve`` exits on these, as on
    the settings Redis refuses (``misconfigured``): until 2026-12-06 it waited on them for good, the
    pod live, nothing archived, its Secret never read again (tests/test_settlement_recovery.py)."""
    if isinstance(error, psycopg.NotSupportedError):
        return True
    if not isinstance(error, psycopg.Error):
        return False
    state = error.sqlstate
    if state is not None:
        return state.startswith(REFUSED_SQLSTATES)
    return REFUSED_AT_CONNECT.search(str(error)) is not None


async def _watch_lag(archiver: Archiver, stop: asyncio.Event, every_s: float) -> None:
    outage = Outage(log, "journal lag not read", "journal lag read again")
    while not stop.is_set():
        try:
            lags = list((await archiver.lag()).values())
            LAG_ENTRIES.set(max((lag.entries for lag in lags), default=0))
            LAG_RESULTS.set(max((lag.results for lag in lags), default=0))
            LAG_SECONDS.set(max((lag.seconds for lag in lags), default=0.0))
        except Exception as e:
            if not _passing(e):
                raise
            outage.failed(e)
        else:
            outage.succeeded()
        await _sleep(stop, every_s)


async def _cleanup(store: BoardStore, stop: asyncio.Event, every_s: float) -> None:
    """The inactive-player cleanup (shardlb/moderation.py), one bounded pass every ``every_s``. Several
    archivers may run it at once: a removal is idempotent and checks the player's idleness itself.
    A pass that fails is logged as an outage, as ``repair_bands`` does: one that met a board being
    resharded or deleted (the library's error) used to end the loop, silently, for the process's life."""
    outage = Outage(log, "inactive cleanup failed; retrying", "inactive cleanup works again")
    while not stop.is_set():
        await _sleep(stop, every_s)
        try:
            done = await moderation.cleanup_pass(store)
        except Exception as e:
            outage.failed(e, trace=not _passing(e) and not isinstance(e, ShardlbError))
            continue
        outage.succeeded()
        if any(done.values()):
            log.info("inactive players removed", extra={"fields": done})


async def repair_bands(store: BoardStore, stop: asyncio.Event, every_s: float) -> None:
    """Finish the band moves that writes left pending (``Board.repair``, shardlb/bands.py) on every
    band board, one pass every ``every_s`` seconds, jittered down to half of it so that several
    archivers spread their passes. A move whose band calls were lost (a router that died after the
    home shard's commit, a call that timed out) is finished within ``every_s`` plus a pass, whether
    or not the player posts again. A pass over a board with nothing pending is one HLEN per home
    shard. Several archivers may run it at once, beside the writes: band moves are versioned.
    Each pass also forgets the versions of players removed longer ago than the dedup window
    (``Board.prune``), so a board whose players churn keeps versions bounded by the players it holds.
    A pass that fails (the boards not listed, or a board not repaired) is logged as an outage that
    the next pass without a failure ends; a failure that is no outage is logged with its traceback."""
    outage = Outage(log, "band repair failed; retrying", "band repair works again")
    while not stop.is_set():
        await _sleep(stop, every_s * random.uniform(0.5, 1.0))
        if stop.is_set():
            return
        try:
            boards = [b for b in await store.boards() if b.layout.strategy == "band"]
        except Exception as e:
            outage.failed(e, {"board": None}, trace=not _passing(e))
            continue
        failed = False
        for board in boards:
            try:
                done = await board.repair()
                if done:
                    BAND_REPAIRS.inc(done)
                    log.info(
                        "pending band moves finished",
                        extra={"fields": {"board": board.config.id, "players": done}},
                    )
                forgotten = await board.prune()
                if forgotten:
                    log.info(
                        "versions of removed players forgotten",
                        extra={"fields": {"board": board.config.id, "players": forgotten}},
                    )
            except Exception as e:  # a board deleted or resharded meanwhile, or the cluster failing
                outage.failed(e, {"board": board.config.id}, trace=not _passing(e))
                failed = True
        if not failed:
            outage.succeeded()


class _PlainLines(logging.Formatter):
    """`shardlb archive`'s log lines: plain text, with the record's ``fields`` (the keys of the
    router's JSON lines, router/logs.py) after the message, since they say why something failed."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            line += " " + " ".join(f"{key}={value}" for key, value in fields.items())
        return line


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535 (0: none), got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """`shardlb archive`: run one archiver until SIGTERM or SIGINT (several may run at once).
    Exit status 0 when stopped so, 2 for bad arguments, 1 for settings Redis or PostgreSQL refuses
    at the start (the `shardlb` command line's message); an unreachable cluster or PostgreSQL is
    waited for (logged, retried)."""
    parser = argparse.ArgumentParser(
        prog="shardlb archive",
        description=inspect.cleandoc(main.__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    connection_arguments(parser)
    parser.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}", help="consumer name")
    parser.add_argument(
        "--metrics-port", type=_port, default=0, help="serve Prometheus metrics on this port (default: none)"
    )
    parser.add_argument(
        "--cleanup-every",
        type=seconds,
        default=60.0,
        help="seconds between inactive-player cleanups (0: none; default 60)",
    )
    parser.add_argument(
        "--repair-every",
        type=seconds,
        default=REPAIR_EVERY_S,
        help="seconds between passes that finish band moves left pending by lost band calls "
        f"(0: none; default {REPAIR_EVERY_S:g})",
    )
    parser.add_argument(
        "--deliver-every",
        type=seconds,
        default=settlement_delivery.SWEEP_EVERY_S,
        help="seconds between sweeps that send due settlement webhooks no router is sending; needs "
        f"SHARDLB_WEBHOOK_SECRET (0: none; default {settlement_delivery.SWEEP_EVERY_S:g})",
    )
    args = parser.parse_args(argv)
    if not args.postgres:
        parser.error("give --postgres or SHARDLB_POSTGRES_URL")
    handler = logging.StreamHandler()
    handler.setFormatter(_PlainLines("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    # httpx logs each request it sends at info, URL and all: one line per webhook delivery, holding
    # the receiver's URL, whose path or query is often its credential. Its warnings still show.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="0.0.0.0")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(
            args.redis,
            args.postgres,
            args.name,
            stop,
            cleanup_every_s=args.cleanup_every,
            repair_every_s=args.repair_every,
            deliver_every_s=args.deliver_every,
            webhook_secret=os.environ.get("SHARDLB_WEBHOOK_SECRET", ""),
        )

    asyncio.run(run())
    return 0
