"""Moderation: removing players, banning them, refusing results past a board's sanity limits, and
the rolling cleanup of inactive players (docs/design-notes.md, "Moderation").

- **Removal** (``remove``): remove.lua runs once on every shard the player may live on (the home
  shard; every region's on a region board), each call atomic on its shard: the player leaves every
  period board there, and a delete entry joins the shard's journal in the same call. The archiver
  records delete entries in ``player_removals``; a rebuild drops the shard's results of that player
  journaled before the entry, but in the periods it left whole (a removal made at an earlier call's
  time keeps the entries achieved since: ``kept``). On band boards the call also bumps the player's
  version and records every band as pending, and the band shards then drop the player at that
  version (band.lua), so a retry converges and a late band move cannot bring the player back.
  Removing again is harmless, and a removal named by a request (``remove``'s ``request``: the
  router's X-Request-Id) is made once per shard whatever its retries: a retry keeps the results the
  player posted since.
- **Bans** (``Bans``): PostgreSQL keeps them (``bans``, the truth that a rebuild reads), and Redis
  keeps the list routers cache (``lb:bans``, a hash ``<board or *>/<player>`` -> record, and a
  version ``lb:bans:v`` that moves with every change, so a router reads the list only when it
  changed). A ban or a lift logs the field it writes in the list's change log (``Bans._note``,
  in the version's hash slot: the entry and the version's move are one script), so routers read
  that field alone, not the whole list. The version is drawn at random at each change, not
  counted (``Bans._moved``): a counter lost in a failover with the last change went back a step,
  and the next change handed out the number again, under which routers had loaded the lost change
  and so kept their list.
  A list lost in Redis (a total loss, or its master lost with its replica) is written back from
  PostgreSQL by the archiver's next refresh (``Bans.recover``), which tells a list lost from one
  changed by its mark (``keys.BANS_WHOLE``, in the list's slot): a ban made after the loss writes
  the list again, without it.
  A ban of one board holds on the incarnation it was made on (``Ban.incarnation``): a board
  deleted and created again under its id starts without it, and the board's deletion forgets it
  (``Bans.forget``; the archiver's ``Bans.sweep`` finishes what a deletion left). A ban also
  removes the player's entries, so Redis and a rebuild agree. With ``ack`` (the
  router's SHARDLB_ACK) a ban or lift is answered only once a replica of the list's primary has it
  (``Bans._write``: each write sent with its marker and WAIT).
- **Sanity limits** (``Screen``): per score, before anything is written, ``banned``, then
  ``points_limit`` (points above ``max_points_per_result``), then ``rate_limit`` (past
  ``max_results_per_player_per_minute``; rate.lua counts (match, player) pairs, so a retry is not a
  second result). Refused results are written to ``refused_results`` with the request id, once
  per (board, player, match) whatever the retries (``record_refusals``).
- **Inactive players** (``cleanup``): boards with ``inactive_after`` keep a per-shard activity set
  (player -> last applied post, written by write.lua); a pass removes at most ``limit`` players per
  shard whose last post is older, each removal checked against the set inside remove.lua (a player
  who posts meanwhile stays). A rebuild puts the set back (``Rebuilder.recall_activity``). It
  records each player it removes at their last post, not at its own time (``swept_record``: a
  replay of a result they had is refused for the dedup window, a result achieved later counts),
  and points at its delete entry beside that record, so a removal asked for later that finds the
  player gone archives that entry before it is answered (``_recorded``, ``_delete_entries``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import orjson
import psycopg
from redis.asyncio.cluster import RedisCluster
from redis.client import NEVER_DECODE
from redis.exceptions import ResponseError

from shardlb import keys, times
from shardlb.board import MAX_FUTURE_MS, Board, Prepared
from shardlb.config import check_id
from shardlb.connection import Scripts, connect
from shardlb.errors import BoardConflict, InvalidInput, field_name
from shardlb.fanout import Ack, confirmed
from shardlb.journal import Entry, decode
from shardlb.reshard_copy import Replicated
from shardlb.store import BoardStore

# Per-score statuses of results refused before they were written (the write's other statuses are
# board.STATUS). Nothing of a refused result is written; its `points` are 0.
REFUSED = {"banned": "banned", "points": "points_limit", "rate": "rate_limit"}
ALL = "*"  # the scope of a ban on every board
MAX_BANS = 1_000_000  # bans kept at once: every router holds the whole list in memory
BANS_PAGE = 2000  # bans written back per HSET by a restore
# Each router reads the list's version every REFRESH_S (router/moderation.py, ``BanCache``): a
# change is in every running router's copy within PROPAGATION_S (two refreshes and a margin), which
# a ban waits before it removes the player's entries and `rebuild --all` before it puts boards back.
REFRESH_S = 1.0
PROPAGATION_S = 2 * REFRESH_S + 0.5
# A router's whole read of the list (a restore moves it with no field named): about half a second of
# its worker per 100,000 bans (docs/design-notes.md, "The ban list's change log"); counted twice over.
LOAD_S_PER_BAN = 1e-5

REASON_MAX = 500
VERSIONS = 2**62  # the ban list's versions are drawn from 1..VERSIONS (``Bans._moved``)
CHANGES_KEPT = 10_000  # entries of the list's change log kept (about: XADD's MAXLEN ~)
CHANGES_KEPT_MS = 86_400_000  # and for a day at most: an entry names a player (``_note``)
# The name a note gives for the whole list (a restore, a forgetting: many fields at once); no field
# is named so (a field is "<board or *>/<player>"). A router reads the whole list at it (``_moved``).
WHOLE = "*"
NO_CHANGE = "0-0"  # the change log's position before its first entry (no entry has that id)
# A change's first note stays open (its write may come yet) until its move is read, and this long at
# most, by the entries' clock: a copy reads its field again at every move meanwhile (``Change.first``).
OPEN_MS = 60_000
# An entry of the ban list's change log (``Bans._note``): KEYS[1] the version, KEYS[2] the log (one
# hash slot); ARGV[1] the entries kept, ARGV[2] the version to set ('' : it stays, a note made
# before the list's write), ARGV[3] the fields, as a JSON array, ARGV[4] how long entries are kept
# (ms; older ones go, by the server's clock, which makes the entries' ids). The entry holds the
# version it found (`from`) and the one it leaves (`to`): a router follows the log only along that
# chain, so a version moved without an entry (a router of the release before, a restore) makes it
# load the whole list.
_NOTE = """
local from = redis.call('GET', KEYS[1]) or '0'
local to = from
if ARGV[2] ~= '' then
  to = ARGV[2]
  redis.call('SET', KEYS[1], to)
end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'from', from, 'to', to, 'fields', ARGV[3])
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('XTRIM', KEYS[2], 'MINID', string.format('%d', ms - tonumber(ARGV[4])))
return id
"""
# The version and the log's entries from ARGV[1] on (that entry first, while it is kept), at most
# ARGV[2] of them, read at once (``Bans.changes``); or, with ARGV[1] '', the version and the log's
# entries of the last ARGV[3] ms before its last one, at most ARGV[2] of them, the last first
# (``Bans.mark``: where a router that loads the whole list follows the log from, and the first notes
# still open then).
_CHANGES = """
local version = redis.call('GET', KEYS[1]) or '0'
if ARGV[1] == '' then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if not last[1] then
    return {version, {}}
  end
  local ms = tonumber(string.match(last[1][1], '^(%d+)'))
  local since = string.format('%d', math.max(0, ms - tonumber(ARGV[3])))
  return {version, redis.call('XREVRANGE', KEYS[2], '+', since, 'COUNT', ARGV[2])}
end
return {version, redis.call('XRANGE', KEYS[2], ARGV[1], '+', 'COUNT', ARGV[2])}
"""
# A restore's second pass over the list (``Bans.restore``): KEYS[1] the list; ARGV field, the record
# read, PostgreSQL's record ('' for none), ...: each field set to PostgreSQL's record (removed for
# none) only while it holds the record read: a ban or lift made since wrote its own, which stays.
_CONVERGE = """
for i = 1, #ARGV, 3 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    if ARGV[i + 2] == '' then
      redis.call('HDEL', KEYS[1], ARGV[i])
    else
      redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    end
  end
end
return 0
"""
# The forgetting of a deleted board's bans (``Bans.forget``): KEYS[1] the list, ARGV[1] the board's
# incarnation, then field, the ban's time (ms, PostgreSQL's row), ...: each removed only while its
# record holds that incarnation, or holds none and that time: a router of the release before
# 2026-12-05 writes a ban's record again from its row (a retry, a ban asked for again) without
# `inc`, and that record is this ban still. A ban of the player on the board created again under
# the id since took the field over (its incarnation, or its own time), and stays. A record that is
# no JSON object (written by hand) is left alone, not an error.
_FORGET = """
local removed = 0
for i = 2, #ARGV, 2 do
  local record = redis.call('HGET', KEYS[1], ARGV[i])
  local ok, ban = pcall(cjson.decode, record or '')
  if ok and type(ban) == 'table' and (ban['inc'] == ARGV[1]
      or (ban['inc'] == nil and ban['at'] == tonumber(ARGV[i + 1]))) then
    removed = removed + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return removed
"""
# The ban list's mark (keys.BANS_WHOLE, ``Bans.recover``): WHOLE_MARK once the list holds every ban
# PostgreSQL holds; "<WRITING><token>" while a restore writes it, which the restore's last write turns
# into WHOLE_MARK only if it is still there (``_MARK``): a list lost during the restore takes the first
# value with it, and the restore's writes after the loss leave the list unmarked.
WHOLE_MARK = "whole"
WRITING = "writing "
# A restore's "writing" mark expires this long after its last write (renewed before each: ``_RENEW``):
# while it lives, an archiver's ``recover`` leaves the list to that restore (``_CLAIM``), and once it
# has run out (a restore cut short) writes it back. Until 2026-12-07 (later that day) the second of
# two archivers wrote a list being written back again beside the first (``recover``).
WRITING_MS = 15_000
# KEYS[1] the mark, ARGV[1] the value a restore set at its start, ARGV[2] WHOLE_MARK. SET without
# KEEPTTL: the whole mark never expires.
_MARK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# KEYS[1] the mark, ARGV[1] a restore's value, ARGV[2] WRITING_MS: its lease renewed while it is there.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# ``recover``'s start: KEYS[1] the mark; ARGV[1] its value, ARGV[2] WRITING_MS, ARGV[3] WHOLE_MARK,
# ARGV[4] WRITING. 0, writing nothing, when the list is whole or another restore's lease lives (a
# value "writing ..." with no expiry is one cut short by a release without leases); else the mark set.
_CLAIM = """
local mark = redis.call('GET', KEYS[1])
if mark == ARGV[3] then
  return 0
end
if mark and string.sub(mark, 1, string.len(ARGV[4])) == ARGV[4] and redis.call('PTTL', KEYS[1]) > 0 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# The first ban of a list that PostgreSQL holds no other ban of (``Bans.add``): KEYS[1] the list,
# KEYS[2] its mark (one hash slot); ARGV field, record, WHOLE_MARK. The record and the mark in one
# call; the mark only where none is (a restore under way marks the list itself).
_FIRST = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'NX')
return 1
"""
STALE_TRIES = 10  # key-index reads before a removal gives up (a period begins at most every day)
SHARDS_IN_FLIGHT = 16
PAGE = 1000  # journal entries a read when a removal's retry looks for its first call's entry
CLEANUP_LIMIT = 1000  # players removed per shard and cleanup pass

SCHEMA = """
CREATE TABLE IF NOT EXISTS removal_records (
    board text NOT NULL,
    incarnation text NOT NULL,
    shard integer NOT NULL,
    player_id text NOT NULL,
    units bigint NOT NULL,
    journal_id text NOT NULL,
    PRIMARY KEY (board, incarnation, shard, player_id, journal_id)
);
-- A removal named by a request (the router's X-Request-Id) records the request beside the player's
-- record (remove.lua): its name, and the value it gave it (units; ".1" after them: removed).
ALTER TABLE removal_records ADD COLUMN IF NOT EXISTS request text;
ALTER TABLE removal_records ADD COLUMN IF NOT EXISTS request_mark text;
CREATE TABLE IF NOT EXISTS player_removals (
    board text NOT NULL,
    incarnation text NOT NULL,
    shard integer NOT NULL,
    player_id text NOT NULL,
    journal_id text NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (board, incarnation, shard, player_id, journal_id)
);
-- The periods whose entry of the player the removal left whole (remove.lua's `a`: a removal made at
-- an earlier call's time keeps the entries achieved since): the player's earlier rows still count
-- there. NULL: it left none, as every removal archived before this column.
ALTER TABLE player_removals ADD COLUMN IF NOT EXISTS kept text[];
CREATE TABLE IF NOT EXISTS bans (
    player_id text NOT NULL,
    board text NOT NULL,
    reason text NOT NULL,
    banned_by text NOT NULL,
    request_id text,
    banned_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (player_id, board)
);
-- The incarnation of the board a ban of one board was made on (``Ban.incarnation``): the ban holds
-- on that board only, not on one created again under its id. NULL: every board of the id (a ban of
-- every board, and one stored before this column).
ALTER TABLE bans ADD COLUMN IF NOT EXISTS incarnation text;
-- The bans of one incarnation, which its deletion forgets (``Bans.forget``).
CREATE INDEX IF NOT EXISTS bans_by_incarnation ON bans (board, incarnation) WHERE incarnation IS NOT NULL;
-- The bans in force on a board (``BANNED_ON``: every board's, and the board's own), which a rebuild
-- reads per shard (``banned_in``) and a settlement's order hashes (settlement.BANNED_HERE): without
-- it, every ban of every board (1,000,000 of other boards: 55-90 ms a read, 2026-12-06).
CREATE INDEX IF NOT EXISTS bans_by_board ON bans (board);
CREATE TABLE IF NOT EXISTS moderation_audit (
    id bigserial PRIMARY KEY,
    action text NOT NULL,
    board text,
    player_id text NOT NULL,
    actor text NOT NULL,
    reason text NOT NULL,
    request_id text,
    detail jsonb,
    at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS moderation_audit_player ON moderation_audit (player_id, board);
CREATE TABLE IF NOT EXISTS refused_results (
    id bigserial PRIMARY KEY,
    board text NOT NULL,
    player_id text NOT NULL,
    match_id text NOT NULL,
    points bigint NOT NULL,
    status text NOT NULL,
    request_id text,
    at timestamptz NOT NULL DEFAULT now()
);
-- One row per refused result, which (board, player, match) names as it names a result: a retried
-- call, the router's own retry through a reshard and the log's retry of a batch whose commit lost
-- its reply record nothing new (record_refusals). A table from before this rule holds the copies
-- those retries wrote: the first row of each result is kept. The trigger skips a row already
-- there for the plain INSERT of a router of the release before (a rolling upgrade, a rollback),
-- whose batch would otherwise fail on the index at every try, for good.
DO $migrate$
BEGIN
    IF to_regclass('refused_results_once') IS NULL THEN
        DELETE FROM refused_results r USING refused_results f
        WHERE (f.board, f.player_id, f.match_id) = (r.board, r.player_id, r.match_id) AND f.id < r.id;
        CREATE UNIQUE INDEX refused_results_once ON refused_results (board, player_id, match_id);
        CREATE OR REPLACE FUNCTION refused_results_skip_recorded() RETURNS trigger
        LANGUAGE plpgsql AS $skip$
        BEGIN
            IF EXISTS (SELECT 1 FROM refused_results
                       WHERE (board, player_id, match_id) = (NEW.board, NEW.player_id, NEW.match_id)) THEN
                RETURN NULL;
            END IF;
            RETURN NEW;
        END
        $skip$;
        DROP TRIGGER IF EXISTS refused_results_once ON refused_results;  -- the index dropped by hand
        CREATE TRIGGER refused_results_once BEFORE INSERT ON refused_results
            FOR EACH ROW EXECUTE FUNCTION refused_results_skip_recorded();
    END IF;
END
$migrate$;
"""


# ---- removal ------------------------------------------------------------------------------


async def remove(
    board: Board,
    players: Sequence[str],
    now_ms: int | None = None,
    request: str | None = None,
    since_ms: int | None = None,
    journaled: list[tuple[str, Entry]] | None = None,
) -> set[str]:
    """Remove ``players`` from every period of ``board``; return those that had an entry anywhere.
    One remove.lua call per shard, atomic on its shard, concurrent across shards (not atomic across
    them); a retry after any failure converges to the state of one call.

    ``request`` names the removal asked for (the router's ``remove/<X-Request-Id>``): a call again
    with the same name within the dedup window is the same removal, not a new one. A shard where it
    ran already changes nothing and answers as it did, so the results the player posted since stay;
    a shard it did not reach (a call that failed half way) is removed at the time the first call
    recorded elsewhere (``first_units``), keeping what was achieved since. Without it (and past the
    window, unless ``since_ms`` is given) a call again removes again. ``since_ms``, with
    ``request``: when no shard has a record of it, the time the request was made, and every shard is
    removed as one it did not reach (a ban's retry after the ban was lifted, whose first call
    removed nothing: results posted since the lift stay; a DELETE's retry past the window, at the
    time its audit row keeps).

    ``journaled``: the delete entries the calls journaled are added to it, (the board's mode,
    entry), for the caller to archive before it answers (``archive.record_removals``)."""
    for i, player in enumerate(players):
        check_id(player, f"players[{i}]")
    if request is not None and (not request or "\x00" in request or "\x01" in request):
        # U+0001 marks where a request's entry is (keys.removal_request_position_field)
        raise InvalidInput("a removal's request name must be non-empty text without NUL or U+0001", "request")
    groups: dict[int, list[str]] = defaultdict(list)
    for player in dict.fromkeys(players):
        for shard in board.layout.candidates(player):
            groups[shard].append(player)
    # A shard not rebuilt yet after a loss of Redis would answer "no entry" for a player it will
    # hold after its swap: refused whole, nothing written (a retry after the rebuild converges).
    board.check_built(groups, "removal")
    gate = asyncio.Semaphore(SHARDS_IN_FLIGHT)

    now = times.now_ms() if now_ms is None else now_ms  # one removal time on every shard
    units = None if request is None else await first_units(board, groups, request)
    if units is None and request is not None and since_ms is not None:
        units = record_units(board, since_ms)

    async def one(shard: int, members: list[str]) -> list[str]:
        async with gate:
            return await remove_on_shard(
                board, shard, members, now_ms=now, request=request, units=units, journaled=journaled
            )

    found = await asyncio.gather(*(one(s, m) for s, m in groups.items()))
    return {p for got in found for p in got}


async def first_units(board: Board, groups: dict[int, list[str]], request: str) -> int | None:
    """The record time (units) an earlier call of ``request`` left on any shard of ``groups``
    (shard -> players), or None when none has it. Two calls of one request sent at once may both
    find none and record two times, each shard one of them (a state of one call on each shard)."""
    gate = asyncio.Semaphore(SHARDS_IN_FLIGHT)

    async def one(shard: int, members: list[str]) -> list[Any]:
        fields = [keys.removal_request_field(request, p) for p in members]
        async with gate:
            got: list[Any] = await board.client.hmget(keys.removals_key(board.prefixes[shard]), fields)
            return got

    found = await asyncio.gather(*(one(s, m) for s, m in groups.items()))
    held = [int(_text(v).partition(".")[0]) for got in found for v in got if v is not None]
    return min(held) if held else None


async def remove_on_shard(
    board: Board,
    shard: int,
    players: Sequence[str],
    stale_before_ms: int = 0,
    now_ms: int | None = None,
    request: str | None = None,
    units: int | None = None,
    journaled: list[tuple[str, Entry]] | None = None,
) -> list[str]:
    """remove.lua on one shard (see the module docstring); returns the players it removed. With
    ``stale_before_ms``, only players whose last post (activity set) is at or before it, each
    recorded at that post (``swept_record``). Without it (a removal asked for, not the inactive
    cleanup), the shard records the removal's time for the dedup window: a result of the player
    achieved before it (before its time unit), a retry above all, is then a duplicate that writes
    nothing (remove.lua, write.lua). ``request`` and
    ``units`` (the time an earlier call of the request recorded): see ``remove``; a player the
    request removed here already counts as removed when the first call found them."""
    prefix = board.prefixes[shard]
    now, codec = times.now_ms() if now_ms is None else now_ms, board.codec
    removed_units = record_units(board, now) if units is None else units
    fixed = [
        keys.index_key(prefix), keys.gone_key(prefix), keys.journal_key(prefix),
        keys.version_key(prefix), keys.pending_key(prefix), keys.activity_key(prefix),
    ]  # fmt: skip
    banded = board.layout.strategy == "band"
    header = msgpack.packb(
        [
            int(board.config.durability == "journal"),
            len(board.config.sharding.bands) if banded else 0,
            board.config.id,
            board.incarnation,
            shard,
            stale_before_ms,
            -1 if stale_before_ms else removed_units,
            now + board.config.dedup_window_s * 1000,
            codec.time_bits,
            int(codec.tiebreak == "earliest"),
            # A record below this is from a removal older than the dedup window (record_units of
            # that removal would be at least its time): remove.lua forgets it.
            max(0, (now - board.config.dedup_window_s * 1000 - codec.epoch_ms) // codec.unit_ms),
            now,  # band boards: when the player's versions may be forgotten from (BandMoves.prune)
            "" if stale_before_ms or request is None else request,
            int(units is not None),
            board.journal_max,  # the journal's bounds hold for a delete entry too (remove.lua)
            board.journal_max_results,
            # A removal asked for is refused on a shard Redis lost alone (Board.gone: Rebuilding);
            # the inactive cleanup would remove nothing there, and goes on.
            int(board.sentinels and not stale_before_ms),
            # The inactive cleanup's pointers at its delete entry (remove.lua): pruned a window on.
            record_units(board, now) if stale_before_ms else -1,
            # The inactive cleanup's record of each player at their last post (remove.lua).
            swept_record(board) if stale_before_ms else [],
        ]
    )
    args = [header, msgpack.packb(list(players))]
    archived = journaled is not None and board.config.durability == "journal"
    for _ in range(STALE_TRIES):
        listed = [_text(k) for k in await board.client.zrange(keys.index_key(prefix), 0, -1)]
        names = fixed + [k for k in dict.fromkeys(listed) if k not in fixed]
        try:
            reply = await board.scripts.remove(keys=names, args=args)
        except ResponseError as e:
            raise board.gone(e) from e
        if _text(reply[0]) == "ok":
            break
    else:
        raise BoardConflict("the board's key index kept changing during the removal; retry", "board")
    entry_id = _text(reply[1])
    removed, versions, again = [], [], []
    for n, player in enumerate(players):
        flag, version = int(reply[2 + 2 * n]), int(reply[3 + 2 * n])
        if flag:
            removed.append(player)
        if version > 0:
            versions.append((player, version))
        elif version < 0 and banded:
            again.append(player)
    if journaled is not None and archived:
        # The players removed here within the dedup window, with the entry that last removed each
        # (their records, read after the call: one this call finds gone may be so by a delete
        # entry not archived yet, made by another removal just before it, which a read before the
        # call missed until 2026-12-06). A player this call removed is named by its own entry, whose
        # kept periods (`a`) send the call to the journal for their earlier removals as a gone
        # player's named entry would; one it found gone with no record before, by its own too.
        # With a request, the players its first call recorded here, each with the id of that call's
        # entry ("" when the shard keeps none: a call of the release before), read alone (a retry
        # answers ``removed`` as its first call did, journaling nothing here).
        last, firsts = await _recorded(board, shard, players, request)
        unplaced = request if any(not at for at in firsts.values()) else None
        mine = {at for at in firsts.values() if at}
        found = await _delete_entries(board, shard, entry_id, unplaced, last, mine)
        journaled += [(board.config.mode, entry) for entry in found]
    if versions:
        await _remove_from_bands(board, shard, versions)
    if again:  # the first call's band part, if it was lost (a later write may have sent it since)
        await board.bands.finish_pending(shard, again)
    return removed


async def _recorded(
    board: Board, shard: int, players: Sequence[str], request: str | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """The players of ``players`` the shard holds a removal record of (``keys.removals_key``: removed
    there within the dedup window), or only where their last removal there is (the inactive
    cleanup's, which records a player only when their last post is within the window), each with
    the id of the delete entry that last removed them there ("" when the record names none: a
    record, or a rebuild's, of the release before 2026-12-06); and, with ``request``, the players
    that request's earlier call recorded there, each with the id of that call's delete entry (""
    when the shard keeps none: a call, or a rebuild's, of the release before). One HMGET, read after
    remove.lua's call: a player it removed is named by its entry, one it found gone by the entry
    that removed them (its own, with no record before)."""

    def named(player: str) -> list[str]:
        out = [player, keys.removal_position_field(player)]
        if request is not None:
            out.append(keys.removal_request_field(request, player))
            out.append(keys.removal_request_position_field(request, player))
        return out

    per = 2 if request is None else 4
    fields = [f for p in players for f in named(p)]
    held = await board.client.hmget(keys.removals_key(board.prefixes[shard]), fields)
    earlier: dict[str, str] = {}
    firsts: dict[str, str] = {}
    for n, p in enumerate(players):
        record, at, *asked = held[per * n : per * n + per]
        if record is not None or at is not None:
            earlier[p] = keys.removal_position(_text(at)) if at is not None else ""
        if asked and asked[0] is not None:
            firsts[p] = keys.removal_position(_text(asked[1])) if asked[1] is not None else ""
    return earlier, firsts


async def _delete_entries(
    board: Board,
    shard: int,
    entry_id: str,
    request: str | None,
    last: dict[str, str] | None = None,
    mine: set[str] | None = None,
) -> list[Entry]:
    """The delete entries a removal's call on the shard archives before its answer: its own
    (``entry_id``: "" when it journaled none); with ``request``, that request's (a retry of a
    request whose call here journaled nothing, as it ran here before, looks for its first call's
    entry that way); with ``last`` (players the shard held a removal record of before the call ->
    the id of the entry that last removed them there, from ``_recorded``; for one the call removed,
    its own), that entry. Not archived yet, such an entry
    is still in the journal (the archiver trims only what it committed); gone, PostgreSQL has it. A
    removal found by another's retry is one whose archiving failed (its caller answered 503) or the
    archiver has not taken yet: until 2026-12-06 a removal sent again under another request id
    answered ``removed: false`` and archived nothing of the first, which a loss of Redis then undid.
    An entry that removed the player before the one named is not looked for (the later removal
    drops every result of theirs the earlier one did), unless the one named kept some period of
    theirs whole (its `a`): the journal is then read for the player, as for a record that names
    none; so too when the call's own entry kept a period of a player it removed whole (until
    2026-12-06 it archived its own entry alone there). Read undecoded (their fields are MessagePack)
    from the shard's primary: each entry named alone (XRANGE of its id), and the whole journal
    (which holds what the archiver has not committed yet, up to its bound, PAGE at a time) only for
    a request's, or for a player whose record names no entry or one that kept a period whole."""
    last, mine = last or {}, mine or set()
    key, raw = keys.journal_key(board.prefixes[shard]), {NEVER_DECODE: True}
    named = {at for at in (entry_id, *last.values(), *mine) if at}
    unplaced = [p for p, at in last.items() if not at]
    wanted = request.encode() if request else None
    out: dict[str, Entry] = {}

    def take(got: Any, scanned: bool) -> None:
        for at, fields in got or ():
            if not fields or b"x" not in fields:
                continue
            entry = decode(at, fields)
            ours = entry.id == entry_id or entry.id in mine
            ours = ours or (scanned and wanted is not None and fields.get(b"q") == wanted)
            if ours or ((scanned or entry.id in named) and not set(last).isdisjoint(entry.removed)):
                out.setdefault(entry.id, entry)

    for at in sorted(named):
        take(await board.client.execute_command("XRANGE", key, at, at, **raw), False)
    # A reshard committed, the entry may be in the old layout's journals (the record was copied here
    # with its id), which the archiver drains before the reshard ends: an XRANGE of the id on each.
    missed = sorted(named - set(out) - {entry_id}) if board.also and not board.moving else []
    for prefix in board.also if missed else ():
        for at in missed:
            take(await board.client.execute_command("XRANGE", keys.journal_key(prefix), at, at, **raw), False)
    # An entry named that kept some period of the player whole (`a`) does not drop their results of
    # before an earlier removal there: that removal's entry is looked for in the journal, as before.
    unplaced += [p for p, at in last.items() if at in out and out[at].kept_in(p) is not None]
    if wanted is not None or unplaced:
        low = "-"
        while True:
            got: Any = await board.client.execute_command("XRANGE", key, low, "+", "COUNT", PAGE, **raw)
            take(got, True)
            if not got or len(got) < PAGE:
                break
            low = "(" + _text(got[-1][0])
    return list(out.values())


def propagation_s(bans: int) -> float:
    """How long a list of ``bans`` written back whole (``restore``) takes at most to be in every
    running router's copy: two refreshes and a margin (``PROPAGATION_S``), and the whole read."""
    return PROPAGATION_S + bans * LOAD_S_PER_BAN


def record_units(board: Board, now_ms: int) -> int:
    """The time (board units) before which a removal at ``now_ms`` takes a result of the player for
    one of before it. Best and set boards keep no record of the matches a player posted, and a result
    applied before the removal can be dated up to MAX_FUTURE_MS past it (a board takes times that
    far ahead of its clock) without being kept (a best's worse result): so the record covers that
    far, and a result dated within 5 minutes after the removal is taken for a replay too. Incr
    boards keep their dedup records through a removal: the removal's own time is enough there."""
    codec = board.codec
    if board.config.mode == "incr":
        return min(max(0, (now_ms - codec.epoch_ms) // codec.unit_ms), codec.time_max)
    return min(max(0, (now_ms + MAX_FUTURE_MS - codec.epoch_ms) // codec.unit_ms + 1), codec.time_max + 1)


def swept_record(board: Board) -> list[int]:
    """How the inactive cleanup records a player it removes (remove.lua's ``swept``): ``record_units``
    at the player's last post (the activity set's time, read in the call), so a replay of a result
    they had before it (achieved at most MAX_FUTURE_MS past their last post) is refused, and a result
    achieved later counts at once, one that arrives late too. [shift, unit, cap]: the record is
    floor((last post + shift) / unit) + 1, at most cap. Incr boards: none (their dedup records,
    which a removal leaves, refuse replays; a late result of before counts)."""
    codec = board.codec
    if board.config.mode == "incr":
        return []
    return [MAX_FUTURE_MS - codec.epoch_ms, codec.unit_ms, codec.time_max + 1]


async def _remove_from_bands(board: Board, home: int, versions: Sequence[tuple[str, int]]) -> None:
    """Drop the players from every band shard at their new version, then confirm on the home shard."""
    ops: list[Any] = []
    for player, version in versions:
        ops += ["r", player, 0, version]
    prefixes = board.prefixes
    bands = range(board.config.sharding.shards, board.layout.physical)
    try:
        await asyncio.gather(
            *(
                board.scripts.band(
                    keys=[
                        keys.period_key(prefixes[s], "total"),
                        keys.version_key(prefixes[s]),
                        keys.index_key(prefixes[s]),
                        keys.gone_key(prefixes[s]),
                    ],
                    args=ops,
                )
                for s in bands
            )
        )
    except ResponseError as e:
        raise board.gone(e) from e
    confirm: list[Any] = [v for pair in versions for v in pair]
    prefix = prefixes[home]
    await board.scripts.settle(keys=[keys.version_key(prefix), keys.pending_key(prefix)], args=confirm)


# ---- inactive players --------------------------------------------------------------------


async def cleanup(board: Board, now_ms: int | None = None, limit: int = CLEANUP_LIMIT) -> int:
    """One pass of the rolling cleanup of a board with ``inactive_after``: per home shard, at most
    ``limit`` players whose last post is older than that are removed. Returns how many."""
    idle = board.config.inactive_after
    if not idle:
        return 0
    now = times.now_ms() if now_ms is None else now_ms
    cutoff = now - idle * 1000
    done = 0
    for shard in range(board.config.sharding.shards):
        key = keys.activity_key(board.prefixes[shard])
        stale = await board.client.zrangebyscore(key, "-inf", cutoff, start=0, num=limit)
        if stale:
            done += len(await remove_on_shard(board, shard, [_text(p) for p in stale], cutoff, now))
    return done


async def cleanup_pass(
    store: BoardStore, names: Sequence[str] = (), limit: int = CLEANUP_LIMIT
) -> dict[str, int]:
    """One cleanup pass over the boards ``names`` (all with ``inactive_after`` when empty): players
    removed per board. `shardlb cleanup` runs one; the archiver runs one every ``--cleanup-every``.
    Each board is cleaned up on its own: one that fails (resharded or deleted meanwhile, a master
    down) does not hold up the boards after it; the first failure is raised once every board was
    gone over. (Until 2026-12-05 it ended the pass, so the boards after it kept their idle players
    for as long as it failed.)"""
    boards = [await store.get(n) for n in names] if names else await store.boards()
    done: dict[str, int] = {}
    failed: Exception | None = None
    for b in boards:
        if not b.config.inactive_after:
            continue
        try:
            done[b.config.id] = await cleanup(b, limit=limit)
        except Exception as e:
            failed = failed or e
    if failed is not None:
        raise failed
    return done


def main(argv: list[str] | None = None) -> int:
    """`shardlb cleanup`: one pass of the inactive-player cleanup (boards with inactive_after)."""
    parser = argparse.ArgumentParser(prog="shardlb cleanup", description=main.__doc__)
    parser.add_argument("boards", nargs="*", help="these boards only (default: every board with the setting)")
    parser.add_argument(
        "--limit",
        type=int,
        default=CLEANUP_LIMIT,
        help=f"players removed per shard at most (default {CLEANUP_LIMIT:,})",
    )
    parser.add_argument(
        "--redis",
        default=os.environ.get("SHARDLB_REDIS_URL", "redis://127.0.0.1:7000"),
        help="the cluster (default $SHARDLB_REDIS_URL or redis://127.0.0.1:7000)",
    )
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error("--limit must be at least 1")

    async def run() -> dict[str, int]:
        client = connect(args.redis)
        try:
            scripts = Scripts.register(client)
            await scripts.load(client)
            return await cleanup_pass(BoardStore(client, scripts), args.boards, args.limit)
        finally:
            await client.aclose()

    done = asyncio.run(run())
    for board, removed in done.items():
        print(f"{board}: {removed} inactive player(s) removed")
    for board in args.boards:
        if board not in done:  # named, and found, but nothing to do: said, not silent
            print(f"{board}: no inactive_after setting; nothing to clean up")
    if not args.boards and not done:
        print("no board has an inactive_after setting; nothing to clean up")
    return 0


# ---- bans ---------------------------------------------------------------------------------


class Ban(NamedTuple):
    player: str
    board: str  # a board id, or ALL
    reason: str
    by: str
    at_ms: int
    # The board's incarnation, for a ban of one board: it holds on that board, not on one deleted
    # and created again under its id (a new board starts without the old one's bans). None: on
    # every incarnation (a ban of every board; one made before incarnations were kept).
    incarnation: str | None = None

    def holds_on(self, incarnation: str) -> bool:
        return self.incarnation is None or self.incarnation == incarnation

    def body(self) -> dict[str, Any]:
        return {
            "player_id": self.player,
            "scope": "all" if self.board == ALL else "board",
            "board": None if self.board == ALL else self.board,
            "reason": self.reason,
            "by": self.by,
            "banned_at": times.format_ms(self.at_ms),
        }


def ban_field(board: str, player: str) -> str:
    return f"{board}/{player}"


def parse_scope(body: dict[str, Any]) -> tuple[str, str]:
    """(board or ALL, reason) of a ban or unban body: {"scope": "board", "board": ..., "reason": ...}
    or {"scope": "all", ...}. Raises InvalidInput naming the field."""
    for name in body:
        if name not in ("scope", "board", "reason"):
            raise InvalidInput(f"unknown field {field_name(name)!r}", field_name(name), "unknown_field")
    scope = body.get("scope")
    if scope not in ("board", "all"):
        raise InvalidInput("scope must be 'board' or 'all'", "scope")
    board = body.get("board")
    if scope == "board" and board is None:
        raise InvalidInput("a ban of scope 'board' names its board", "board", "missing_field")
    if scope == "board":
        board = check_id(board, "board")
    elif board is not None:
        raise InvalidInput("a ban of scope 'all' names no board", "board")
    return (ALL if scope == "all" else str(board)), check_reason(body.get("reason"), required=False)


def check_reason(value: object, required: bool) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or len(value) > REASON_MAX or (required and not value.strip()):
        raise InvalidInput(f"reason must be a string of at most {REASON_MAX} characters", "reason")
    if "\x00" in value:  # PostgreSQL's text cannot hold it
        raise InvalidInput("reason must not contain the NUL character (U+0000)", "reason")
    return value


class Bans:
    """The ban list: PostgreSQL (the truth, read by rebuilds) and Redis (what routers cache)."""

    def __init__(self, client: RedisCluster, ack: Ack | None = None) -> None:
        self.client = client
        self.ack = Ack(0, 0) if ack is None else ack  # the router's SHARDLB_ACK (``_write``)

    async def add(
        self, db: psycopg.AsyncConnection[Any], ban: Ban, request_id: str | None
    ) -> tuple[Ban, bool]:
        """Store the ban, and return the ban kept and whether it is in force: ``ban`` when it is
        new, else the first one (its time, reason and author), as PostgreSQL has it. Idempotent: a
        retry, whatever reason it gives, stores nothing new, writes no second audit row, passes at
        the cap on bans (only a new ban counts against it) and answers the same ban. A request that
        finds the ban in force is audited all the same (its own actor and reason; the detail holds
        the ban it answers, ``kept``): the trail shows every request, and its retry finds the row.
        A retry of ``request_id`` after its ban was lifted (the request's audit row is there, the
        ban is not) bans nothing either: it answers the ban as the request was answered, not in
        force."""
        field = ban_field(ban.board, ban.player)
        board = None if ban.board == ALL else ban.board
        first = False  # the list's first ban: it holds every ban PostgreSQL holds once written
        async with db.transaction():
            if request_id is not None:  # a retry sent while the first runs waits for its row
                await _hold(db, "ban", board, ban.player, request_id)
            made = None if request_id is None else await _ban_audited(db, ban, request_id)
            if made is None:
                if (
                    not await self.client.hexists(keys.BANS, field)
                    and await self.client.hlen(keys.BANS) >= MAX_BANS
                ):
                    raise BoardConflict(f"at most {MAX_BANS} bans are kept", "player")
                # A ban of a board deleted since (another incarnation) is not in force: this one
                # takes its place.
                cur = await db.execute(
                    "INSERT INTO bans (player_id, board, reason, banned_by, request_id, banned_at, "
                    "incarnation) VALUES (%s, %s, %s, %s, %s, to_timestamp(%s / 1000.0), %s) "
                    "ON CONFLICT (player_id, board) DO UPDATE SET reason = EXCLUDED.reason, "
                    "banned_by = EXCLUDED.banned_by, request_id = EXCLUDED.request_id, "
                    "banned_at = EXCLUDED.banned_at, incarnation = EXCLUDED.incarnation "
                    "WHERE bans.incarnation <> EXCLUDED.incarnation RETURNING player_id",
                    (ban.player, ban.board, ban.reason, ban.by, request_id, ban.at_ms, ban.incarnation),
                )
                if await cur.fetchone() is not None:
                    detail: dict[str, Any] = {"scope": ban.board, "at": ban.at_ms}
                    if ban.incarnation is not None:
                        detail["incarnation"] = ban.incarnation
                    await audit(db, "ban", board, ban.player, ban.by, ban.reason, request_id, detail)
                    kept: Ban | None = ban
                    first = not await self.whole() and await _alone(db, ban)
                else:
                    kept = await _ban_row(db, ban.player, ban.board)
                    if kept is not None:
                        # Until 2026-12-05 unaudited: a retry after the lift then banned again.
                        again = {"scope": ban.board, "at": kept.at_ms, "kept": True}
                        again |= {"reason": kept.reason, "by": kept.by}
                        if kept.incarnation is not None:  # for a retry (``_ban_audited``)
                            again["incarnation"] = kept.incarnation
                        await audit(db, "ban", board, ban.player, ban.by, ban.reason, request_id, again)
            else:
                kept = await _ban_row(db, ban.player, ban.board)  # a ban stored since the lift, if any
        if kept is None:  # lifted since (or meanwhile): Redis follows the lift, not this request
            return made or ban, False
        # PostgreSQL's row, written over whatever Redis held: the two converge on the ban kept.
        await self._note([field])
        if first:  # a new install's, or one whose bans were all lifted before a loss (``recover``)
            marked = (keys.BANS, keys.BANS_WHOLE, field, _record(kept), WHOLE_MARK)
            await self._write(("EVAL", _FIRST, 2, *marked))
        else:
            await self._write(("HSET", keys.BANS, field, _record(kept)))
        # Moved whether or not the record was new: a retry of a ban whose move failed after its
        # record was stored must still make the routers read it (a read too many is cheap).
        await self._moved([field])
        return kept, True

    async def lift(
        self,
        db: psycopg.AsyncConnection[Any],
        player: str,
        board: str,
        by: str,
        reason: str,
        request_id: str | None,
        incarnation: str | None = ALL,
    ) -> bool:
        """Lift a ban; return whether there was one in force. A retry of ``request_id`` (its audit
        row is there) lifted the ban already: it deletes nothing in PostgreSQL, where a ban stored
        since is a new one that stays in force, puts Redis's record in line with PostgreSQL's, and
        answers as the first call did (the row's ``lifted``). Until 2026-12-05 it answered false,
        the ban it had lifted being gone: as if there had been none.

        ``incarnation``: the board's now (None: there is none), for a ban of one board: a ban made
        on another incarnation is not in force (``Ban.holds_on``; GET /v1/bans does not list it),
        and its lift, which deletes it all the same, answers false (until 2026-12-05 it answered
        true). ALL: whatever the ban's incarnation."""
        field, scope = ban_field(board, player), None if board == ALL else board
        since: Ban | None = None
        async with db.transaction():
            first = None if request_id is None else await _lift_audited(db, scope, player, request_id)
            if first is None:
                cur = await db.execute(
                    "DELETE FROM bans WHERE player_id = %s AND board = %s RETURNING incarnation",
                    (player, board),
                )
                found = await cur.fetchone()
                held, made_on = found is not None, None if found is None else found[0]
                lifted = held and (incarnation == ALL or made_on is None or made_on == incarnation)
                detail = {"scope": board, "lifted": lifted}
                await audit(db, "unban", scope, player, by, reason, request_id, detail)
            else:
                lifted, held, since = first, True, await _ban_row(db, player, board)
        await self._note([field])
        if since is not None:
            await self._write(("HSET", keys.BANS, field, _record(since)))
        else:
            # A record PostgreSQL did not hold (a lift's HDEL lost in a failover, a restore not yet
            # run) was a ban in force for the routers: its lift says so.
            lifted = (bool(await self._write(("HDEL", keys.BANS, field))) and not held) or lifted
        await self._moved([field])
        return lifted

    async def forget(self, db: psycopg.AsyncConnection[Any], board: str, incarnation: str) -> int:
        """Forget the bans of ``board``'s incarnation ``incarnation``, which the caller knows deleted:
        they hold on that board alone (``Ban.holds_on``), so none is in force again, but they counted
        against MAX_BANS, loaded into every router and sent every board's writes through the
        screen. Returns how many PostgreSQL held. Redis's records go first (only while they hold
        that incarnation: ``_FORGET``), then PostgreSQL's rows, the list of what is left to do: a
        call that fails half way leaves the rows, and the call made again (or ``sweep``) finishes
        it; a restore meanwhile writes the records back, which it removes again. The board is
        marked deleted in PostgreSQL in the same transaction, as the archiver marks it (a no-op for
        a board it does not keep): `rebuild --all` never brings back a board whose bans are gone.
        A record without ``inc`` but with the row's time is the same ban, written again by a router
        of the release before (until 2026-12-05 it stayed, refusing the player on the board created
        again while PostgreSQL held no ban). Bans stored without an incarnation (before 2026-12-05:
        every board of the id) stay, and the audit rows of the bans stay (no row is written: the
        ban stopped with the board's deletion, not here)."""
        async with db.transaction():
            cur = await db.execute(
                "SELECT player_id, (extract(epoch FROM banned_at) * 1000)::bigint FROM bans "
                "WHERE board = %s AND incarnation = %s",
                (board, incarnation),
            )
            found = await cur.fetchall()
        players = [row[0] for row in found]
        args = [v for player, at_ms in found for v in (ban_field(board, player), int(at_ms))]
        if players:
            await self._note([WHOLE])
        for i in range(0, len(args), 2 * BANS_PAGE):
            await self._write(("EVAL", _FORGET, 1, keys.BANS, incarnation, *args[i : i + 2 * BANS_PAGE]))
        async with db.transaction():
            await db.execute("DELETE FROM bans WHERE board = %s AND incarnation = %s", (board, incarnation))
            await db.execute(
                "UPDATE boards SET deleted_at = now() WHERE deleted_at IS NULL AND board = %s "
                "AND incarnation = %s",
                (board, incarnation),
            )
        if players:  # also when a call before removed the records and failed before the version
            await self._moved([WHOLE])
        return len(players)

    async def sweep(self, db: psycopg.AsyncConnection[Any], board: str | None = None) -> int:
        """``forget`` the bans of every incarnation known deleted (of ``board`` only, when given);
        returns how many. Known deleted: PostgreSQL's ``boards`` has it deleted (the archiver's mark,
        or ``forget``'s), or Redis's mark of the deletion is there (``keys.deleted_key``, kept a
        day). A board that the registry merely lacks is left alone: it may be a Redis that lost
        everything, whose boards `rebuild --all` puts back with their bans. So is one it holds
        (not being deleted), whatever PostgreSQL says."""
        async with db.transaction():
            cur = await db.execute(
                "SELECT DISTINCT b.board, b.incarnation, d.deleted_at IS NOT NULL FROM bans b "
                "LEFT JOIN boards d ON (d.board, d.incarnation) = (b.board, b.incarnation) "
                "WHERE b.incarnation IS NOT NULL AND (%s::text IS NULL OR b.board = %s)",
                (board, board),
            )
            found = await cur.fetchall()
        done = 0
        for name, incarnation, deleted in found:
            if not deleted and not await self.client.exists(keys.deleted_key(name, incarnation)):
                continue
            # One the registry holds is a live board, its bans in force, whatever PostgreSQL says: a
            # DELETE records the deletion there only once Redis has made it (router/routes.py,
            # ``delete_board``), so such a mark is one made by hand, which must not lift bans.
            record = await self.client.hget(keys.BOARDS, name)
            held = {} if record is None else orjson.loads(record)
            if held and held.get("state") != "deleting" and str(held.get("incarnation", "0")) == incarnation:
                continue
            done += await self.forget(db, name, incarnation)
        return done

    async def _moved(self, fields: Sequence[str], replicated: Replicated | None = None) -> None:
        """Give the list a new version, drawn at random (1..2**62): routers look at the list again
        when the version they read is not the one they hold (``BanCache.refresh``), whatever its
        order. A counter could hand out a number again after a failover, when the replica promoted
        had not yet got the last change: a router that had loaded that change under the number then
        kept it, and missed the next change. A router of the release before INCRs the number, which
        moves it too (2**62 leaves it room below INCR's overflow). Confirmed as ``_write`` is, once
        the list's writes before it are: a router that reads on it finds them.

        ``fields``: the fields the change wrote, logged with the move in one script (``_note``), so
        routers read those alone; [WHOLE] (a restore, a forgetting: many fields at once), routers
        read the whole list. Until 2026-12-06 (later that day) those moved the version with no
        entry, and none before their writes: a move of theirs lost in a failover, or never made
        (the call cut short), left the copies that followed the next ban's notes without their
        writes until the hourly whole read."""
        await self._note(fields, 1 + secrets.randbelow(VERSIONS), replicated)

    async def _note(
        self, fields: Sequence[str], version: int | None = None, replicated: Replicated | None = None
    ) -> None:
        """Log the fields a change writes in the list's change log (``_NOTE``), moving the version
        to ``version`` in the same script. A change notes its fields twice: before it writes them,
        with the version as it is, and with the move once they are written. The move's entry is the
        one routers wait for, read after the write; the first names the fields for a change cut
        short between its write and its move (a crash, a lost connection): the next change's move
        makes routers read them, as a reload of the whole list did. Confirmed as ``_write`` is."""
        names = orjson.dumps(list(fields)).decode()
        move = "" if version is None else str(version)
        note = (_NOTE, 2, keys.BANS_VERSION, keys.BANS_LOG, CHANGES_KEPT, move, names, CHANGES_KEPT_MS)
        await self._write(("EVAL", *note), replicated)

    async def _write(self, command: tuple[Any, ...], replicated: Replicated | None = None) -> Any:
        """Make one write of the list or its version (a command on one key) and return its
        reply, confirmed as ``ack`` asks: the write, a marker and WAIT go to the key's primary as
        one pipeline on one connection (fanout.confirmed), else NotAcknowledged. A ban lost in a
        failover would go unenforced until a rebuild wrote the list back from PostgreSQL, and a lost
        lift would go on refusing the player; either, sent again, writes the same record and moves
        the version again (a reload too many). A primary that fails during the call has the write
        made again on the replica promoted. Until 2026-12-05 the marker and WAIT were a call of
        their own after the writes (``_confirm``): a failover in between had them confirmed on the
        replica promoted, which never had the ban, and the ban was answered.
        ``replicated`` (read already): confirmed only where it says the key's primary has a replica
        (``restore``)."""
        key = str(command[3] if command[0] == "EVAL" else command[1])
        if not self.ack.replicas or (replicated is not None and not replicated(key)):
            return await self.client.execute_command(*command)
        [reply] = await confirmed(self.client, self.ack, [command])
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def restore(self, db: psycopg.AsyncConnection[Any], replicated: Replicated | None = None) -> int:
        """Make Redis's list PostgreSQL's and move the version (routers reload the list): after a
        loss of Redis the list is empty and routers would take banned players' results again
        (``Rebuilder.restore``); after a failover that lost a lift's HDEL it holds a ban PostgreSQL
        lifted, which went on refusing the player (until 2026-12-05 a restore removed nothing).
        Every ban PostgreSQL holds is written first, over Redis's record as in ``add``; only then
        are the records it does not hold removed (``_differences``), so a router reading the list
        meanwhile never misses a ban in force. Idempotent; a ban or lift made during the call ends
        as it made it. Confirmed as ``ack`` asks, like a ban (``_write``; with ``replicated``,
        where the list's primaries have a replica). Returns how many bans it wrote.

        It marks the list whole (``keys.BANS_WHOLE``, ``recover``) once everything is written: the
        mark is set to a value of its own first and made whole at the end only if it is still there
        (``_MARK``), so a restore during which the list was lost again (its first value with it)
        leaves it unmarked, as does one cut short, and the archiver writes it back again. That first
        value is a lease (``WRITING_MS``, renewed before each write), which ``recover`` leaves alone
        while it lives."""
        if replicated is not None:
            await replicated.read()
        writing = WRITING + secrets.token_hex(8)
        await self._write(("SET", keys.BANS_WHOLE, writing, "PX", WRITING_MS), replicated)
        return await self._rewrite(db, writing, replicated)

    async def _rewrite(
        self, db: psycopg.AsyncConnection[Any], writing: str, replicated: Replicated | None = None
    ) -> int:
        """``restore``'s writes, under the mark ``writing`` it set: its lease renewed before each
        (``_RENEW``), and made whole after the last if still there (``_MARK``)."""
        try:
            await self._note([WHOLE], replicated=replicated)
            written = await _records(db)
            fields = list(written)
            for i in range(0, len(fields), BANS_PAGE):
                page = [v for f in fields[i : i + BANS_PAGE] for v in (f, written[f])]
                await self._renew(writing)
                await self._write(("HSET", keys.BANS, *page), replicated)
            await self._renew(writing)
            changes = await self._differences(db)
            for i in range(0, len(changes), BANS_PAGE):
                pairs = [v for change in changes[i : i + BANS_PAGE] for v in change]
                await self._renew(writing)
                await self._write(("EVAL", _CONVERGE, 1, keys.BANS, *pairs), replicated)
            await self._write(("EVAL", _MARK, 1, keys.BANS_WHOLE, writing, WHOLE_MARK), replicated)
        except BaseException:
            # Its lease given up, so that the next refresh writes the list back at once (when Redis
            # answers: else the lease runs out).
            with contextlib.suppress(Exception):
                await self._renew(writing, 1)
            raise
        await self._moved([WHOLE], replicated)
        return len(written)

    async def _renew(self, writing: str, ms: int | None = None) -> None:
        """Renew a restore's lease on the mark for ``ms`` (``WRITING_MS``) while it holds
        ``writing``; unconfirmed: a renewal lost in a failover lets another restore begin at worst,
        as before leases."""
        lease = WRITING_MS if ms is None else ms
        await self.client.execute_command("EVAL", _RENEW, 1, keys.BANS_WHOLE, writing, lease)

    async def recover(self, db: psycopg.AsyncConnection[Any]) -> int | None:
        """``restore`` the list when Redis lost it: its mark (``keys.BANS_WHOLE``) missing while
        PostgreSQL holds a ban. A master lost with its replica takes the list with its slot while
        the registry, on another master, keeps the boards: the runbook of a shard lost alone
        (`rebuild BOARD --shard N`) never writes it back, and until 2026-12-06 banned players posted
        again for good (the archiver calls this at each refresh).

        Lost, not merely changed: the mark lives in the list's slot and goes with it, and only a
        restore (once every ban is written) or a first ban (PostgreSQL holding no other, ``add``)
        writes it. Until 2026-12-07 a loss was the list's key missing: a ban made after the loss
        and before this call (an admin's, through any router) wrote its record, the key was there
        again, and every other ban stayed lost for good (until a `rebuild --all`). An empty list
        stays marked (a lift's HDEL of the last record leaves the mark), and one never marked (a
        list of before 2026-12-07) is written back once.

        A restore under way (its mark ``writing <token>``, a lease of ``WRITING_MS`` renewed before
        each of its writes: ``_CLAIM``) is left to finish, and one cut short is written back once
        its lease has run out. Until 2026-12-07 (later that day) the second of two archivers (every
        overlay runs two) took the first's restore for one cut short and wrote the list back beside
        it: twice the writes, and two moves that each made every router read the whole list; and
        each restore's mark, set over the other's, left neither marked when each one's next refresh
        began before the other's end, and they went on writing it back in turn
        (``test_two_archivers_write_a_lost_list_back_once``).

        A list unmarked while PostgreSQL holds no ban (a new install's, one whose slot was lost after
        every ban was lifted) is marked whole as it is, under the same lease, and nothing moves:
        until 2026-12-07 (later that day) it stayed unmarked until a first ban, and each refresh read
        PostgreSQL again (``test_an_unmarked_list_with_no_ban_to_write_back_is_marked_once``).

        Returns how many bans it wrote, None when the list was whole, is being written, or
        PostgreSQL holds none: one GET, and one read of PostgreSQL only when the mark is not whole."""
        if await self.whole():
            return None
        writing = WRITING + secrets.token_hex(8)
        claim = (_CLAIM, 1, keys.BANS_WHOLE, writing, WRITING_MS, WHOLE_MARK, WRITING)
        if not await self._write(("EVAL", *claim)):
            return None  # whole since, or another archiver's restore under way (``WRITING_MS``)
        try:
            async with db.transaction():
                cur = await db.execute("SELECT EXISTS (SELECT 1 FROM bans)")
                row = await cur.fetchone()
            if row is None or not row[0]:
                # Nothing to write back: whole as it is, a ban made since the claim included (it
                # writes its record before or after the mark; a loss meanwhile takes the claim).
                await self._write(("EVAL", _MARK, 1, keys.BANS_WHOLE, writing, WHOLE_MARK))
                return None
        except BaseException:
            with contextlib.suppress(Exception):
                await self._renew(writing, 1)
            raise
        return await self._rewrite(db, writing)

    async def whole(self) -> bool:
        """Whether the list is marked whole (``recover``)."""
        return _text(await self.client.get(keys.BANS_WHOLE) or "") == WHOLE_MARK

    async def _differences(self, db: psycopg.AsyncConnection[Any]) -> list[tuple[str, bytes, bytes]]:
        """Each record of Redis's list that is not PostgreSQL's: (field, the record read,
        PostgreSQL's record, or b"" when it holds no such ban), for ``_CONVERGE``. The list is read
        first, then PostgreSQL: a ban or lift changes its row before its record, so a record that
        one made meanwhile, read here, agrees with the rows read after; a record the restore wrote
        over one made meanwhile (from the rows it read before) does not, and is set right."""
        held: dict[str, bytes] = {}
        async for field, record in self.client.hscan_iter(keys.BANS, count=BANS_PAGE):
            held[_text(field)] = record if isinstance(record, bytes) else str(record).encode()
        records = await _records(db)
        return [(f, r, records.get(f, b"")) for f, r in held.items() if records.get(f) != r]

    async def version(self) -> int:
        return int(await self.client.get(keys.BANS_VERSION) or 0)

    async def mark(self, count: int) -> tuple[int, list[Change]]:
        """The version and the change log's entries of the last OPEN_MS up to its last one, at most
        ``count`` (the last of them), oldest first, read at once: a router that loads the whole list
        (``scan``) follows the log from the last, and reads again the fields of the first notes
        among them still open (``Change.first``)."""
        version, found = await self._read_log("", count)
        return int(version), [_change(entry_id, flat) for entry_id, flat in reversed(found)]

    async def changes(self, position: str, count: int) -> tuple[int, list[Change]]:
        """The version and the change log's entries from ``position`` on (that entry first, while
        the log keeps it), at most ``count``, read at once."""
        version, found = await self._read_log(position, count)
        return int(version), [_change(entry_id, flat) for entry_id, flat in found]

    async def _read_log(self, position: str, count: int) -> Any:
        args = ("EVAL", _CHANGES, 2, keys.BANS_VERSION, keys.BANS_LOG, position, count, OPEN_MS)
        return await self.client.execute_command(*args)

    async def held_on(self, fields: Sequence[str]) -> list[tuple[str, str | None, bool]]:
        """(field, the incarnation its ban holds on, whether the list holds it) of each field."""
        records = await self.client.hmget(keys.BANS, list(fields)) if fields else []
        return [(f, _incarnation(r), r is not None) for f, r in zip(fields, records, strict=True)]

    async def scan(self) -> AsyncIterator[tuple[str, str | None]]:
        """Every field of the list and the incarnation its ban holds on, a page at a time (HSCAN):
        a router's event loop serves requests between pages. A field written or removed during the
        scan may be missed or seen: its change's entries come after a ``mark`` read before."""
        async for field, record in self.client.hscan_iter(keys.BANS, count=BANS_PAGE):
            yield _text(field), _incarnation(record)

    async def all(self) -> list[Ban]:
        raw = await self.client.hgetall(keys.BANS)
        out = []
        for name, record in raw.items():
            board, _, player = _text(name).partition("/")
            r = orjson.loads(record)
            inc = r.get("inc")
            out.append(Ban(player, board, str(r["reason"]), str(r["by"]), int(r["at"]), inc and str(inc)))
        return sorted(out, key=lambda b: (b.player, b.board))


async def banned_in(db: psycopg.AsyncConnection[Any], board: Board) -> set[str]:
    """The players banned on ``board`` (its incarnation) or everywhere, as PostgreSQL has them (for
    a rebuild)."""
    async with db.transaction():
        cur = await db.execute(
            f"SELECT player_id FROM bans b WHERE {BANNED_ON}", (board.config.id, board.incarnation)
        )
        return {row[0] for row in await cur.fetchall()}


# The bans of ``bans b`` in force on a board, given its id and incarnation (in that order): a ban of
# every board, or one of this board made on this incarnation (or before incarnations were kept).
BANNED_ON = f"(b.board = '{ALL}' OR (b.board = %s AND (b.incarnation IS NULL OR b.incarnation = %s)))"


async def _records(db: psycopg.AsyncConnection[Any]) -> dict[str, bytes]:
    """Every ban PostgreSQL holds, as Redis's list keeps it: field -> record."""
    async with db.transaction():
        cur = await db.execute(
            "SELECT player_id, board, reason, banned_by, (extract(epoch FROM banned_at) * 1000)::bigint, "
            "incarnation FROM bans"
        )
        rows = await cur.fetchall()
    return {
        ban_field(board, player): _record(Ban(player, board, reason, by, int(at_ms), incarnation))
        for player, board, reason, by, at_ms, incarnation in rows
    }


class Change(NamedTuple):
    """An entry of the ban list's change log: its id, the version it found and the one it left
    (equal for a change's first note), and the fields the change writes. ``before`` and ``after``
    None: an entry that is no note of this release (written by hand, or by a later release in
    another form), which says nothing a router can follow."""

    id: str
    before: int | None
    after: int | None
    fields: list[str]

    @property
    def first(self) -> bool:
        """Whether it is a change's first note, made before its write (``Bans._note``)."""
        return self.before is not None and self.before == self.after

    @property
    def ms(self) -> int:
        """When the log's primary made it (its id's time part)."""
        return int(self.id.partition("-")[0])


def _change(entry_id: Any, flat: Sequence[Any]) -> Change:
    """An entry of the change log as ``_CHANGES`` reads it."""
    values = {_text(k): v for k, v in zip(flat[::2], flat[1::2], strict=True)}
    try:
        names = orjson.loads(values["fields"])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("fields: not a list of names")
        return Change(_text(entry_id), int(values["from"]), int(values["to"]), names)
    except (KeyError, TypeError, ValueError):  # orjson's errors are ValueErrors
        return Change(_text(entry_id), None, None, [])


async def _alone(db: psycopg.AsyncConnection[Any], ban: Ban) -> bool:
    """Whether PostgreSQL holds no ban but ``ban`` (in the caller's transaction, which stored it):
    a list unmarked (``Bans.recover``) that it is written onto then holds every ban. Two first bans
    made at once may both find none, and both mark the list, which holds both once written."""
    cur = await db.execute(
        "SELECT NOT EXISTS (SELECT 1 FROM bans WHERE (player_id, board) <> (%s, %s))", (ban.player, ban.board)
    )
    row = await cur.fetchone()
    return row is not None and bool(row[0])


def _incarnation(record: Any) -> str | None:
    """The incarnation a ban's record holds on (None: every incarnation, as a record without `inc`
    of before 2026-12-05, or one that is no JSON object, written by hand: a ban all the same)."""
    try:
        found = orjson.loads(record) if record is not None else None
    except orjson.JSONDecodeError:
        return None
    inc = found.get("inc") if isinstance(found, dict) else None
    return None if inc is None else str(inc)


def _record(ban: Ban) -> bytes:
    """A ban's record in Redis's list (``keys.BANS``); ``inc``: its incarnation, if it has one (a
    router of the release before reads the other fields only)."""
    record: dict[str, Any] = {"reason": ban.reason, "by": ban.by, "at": ban.at_ms}
    if ban.incarnation is not None:
        record["inc"] = ban.incarnation
    return orjson.dumps(record)


async def _ban_row(db: psycopg.AsyncConnection[Any], player: str, board: str) -> Ban | None:
    """The ban of ``player`` with scope ``board`` that PostgreSQL holds, if any."""
    cur = await db.execute(
        "SELECT reason, banned_by, (extract(epoch FROM banned_at) * 1000)::bigint, incarnation "
        "FROM bans WHERE player_id = %s AND board = %s",
        (player, board),
    )
    row = await cur.fetchone()
    return None if row is None else Ban(player, board, row[0], row[1], int(row[2]), row[3])


async def _ban_audited(db: psycopg.AsyncConnection[Any], ban: Ban, request_id: str) -> Ban | None:
    """The ban that the request ``request_id`` stored for ``ban``'s player and scope, or found in
    force (``kept``), from its audit row; None when it has none. Its time is the audit's when the
    row has no ``at``; its incarnation the row's (none in a row of before 2026-12-05)."""
    cur = await db.execute(
        "SELECT coalesce(detail ->> 'by', actor), coalesce(detail ->> 'reason', reason), "
        "coalesce((detail ->> 'at')::bigint, (extract(epoch FROM at) * 1000)::bigint), "
        "detail ->> 'incarnation' "
        "FROM moderation_audit WHERE player_id = %s AND board IS NOT DISTINCT FROM %s AND action = 'ban' "
        "AND request_id = %s ORDER BY id LIMIT 1",
        (ban.player, None if ban.board == ALL else ban.board, request_id),
    )
    row = await cur.fetchone()
    return None if row is None else Ban(ban.player, ban.board, row[1], row[0], int(row[2]), row[3])


async def _lift_audited(
    db: psycopg.AsyncConnection[Any], board: str | None, player: str, request_id: str
) -> bool | None:
    """Whether the request ``request_id``'s lift of ``player``'s ban of ``board`` (None: every
    board) lifted one, from its audit row (false for a row of before 2026-12-05, which does not
    say); None when it has no row. Holds the request until the caller's transaction ends, as
    ``audit_once`` does: a retry sent while the first runs waits for its row."""
    await _hold(db, "unban", board, player, request_id)
    cur = await db.execute(
        "SELECT coalesce((detail ->> 'lifted')::boolean, FALSE) FROM moderation_audit "
        "WHERE player_id = %s AND board IS NOT DISTINCT FROM %s AND action = 'unban' AND request_id = %s "
        "ORDER BY id LIMIT 1",
        (player, board, request_id),
    )
    row = await cur.fetchone()
    return None if row is None else bool(row[0])


async def audit_once(
    db: psycopg.AsyncConnection[Any],
    action: str,
    board: str | None,
    player: str,
    actor: str,
    reason: str,
    request_id: str | None,
    detail: dict[str, Any] | None = None,
) -> bool:
    """``audit``, unless the request ``request_id`` (a client's retry sends its X-Request-Id again)
    audited ``action`` on ``player`` of ``board`` already; whether it wrote a row. Inside the
    caller's transaction: a lock on the request id until it ends makes a retry sent while the first
    is still running wait for the first's row (or for its rollback), so both cannot find none."""
    if request_id is not None:
        await _hold(db, action, board, player, request_id)
        cur = await db.execute(
            "SELECT 1 FROM moderation_audit WHERE player_id = %s AND board IS NOT DISTINCT FROM %s "
            "AND action = %s AND request_id = %s LIMIT 1",
            (player, board, action, request_id),
        )
        if await cur.fetchone() is not None:
            return False
    await audit(db, action, board, player, actor, reason, request_id, detail)
    return True


async def _hold(
    db: psycopg.AsyncConnection[Any], action: str, board: str | None, player: str, request_id: str
) -> None:
    """Lock the request ``request_id``'s ``action`` on ``player`` of ``board`` until the caller's
    transaction ends: a retry sent while the first still runs waits for the first's audit row."""
    # Ids hold no '/': one text per (action, board, player, request id).
    name = f"{action}/{board or ALL}/{player}/{request_id}"
    await db.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (name,))


async def audit_removal(
    db: psycopg.AsyncConnection[Any],
    board: str,
    player: str,
    actor: str,
    reason: str,
    request_id: str | None,
    at_ms: int,
) -> int | None:
    """``audit_once`` of a removal of ``player`` from ``board`` asked for at ``at_ms``; None when it
    wrote the row (the first call of ``request_id``), else the time of the removal the request's
    first call asked for (the row's ``at``; a row written before it was kept: the row's own time).

    A retry is finished at that time (``remove``'s ``since_ms``) when no shard keeps a record of the
    request any more: past the dedup window they have all expired, and the audit row is then all
    that says the retry is not a new removal (it removed the results posted since the first call)."""
    if await audit_once(db, "remove", board, player, actor, reason, request_id, {"at": at_ms}):
        return None
    cur = await db.execute(
        "SELECT coalesce((detail ->> 'at')::bigint, (extract(epoch FROM at) * 1000)::bigint) "
        "FROM moderation_audit WHERE player_id = %s AND board = %s AND action = 'remove' "
        "AND request_id = %s ORDER BY id LIMIT 1",
        (player, board, request_id),
    )
    row = await cur.fetchone()
    return None if row is None else int(row[0])


async def audit(
    db: psycopg.AsyncConnection[Any],
    action: str,
    board: str | None,
    player: str,
    actor: str,
    reason: str,
    request_id: str | None,
    detail: dict[str, Any] | None = None,
) -> None:
    await db.execute(
        "INSERT INTO moderation_audit (action, board, player_id, actor, reason, request_id, detail) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (
            action,
            board,
            player,
            actor,
            reason,
            request_id,
            None if detail is None else orjson.dumps(detail).decode(),
        ),
    )


# ---- sanity limits ------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    position: int  # in the request
    status: str  # a value of REFUSED


class Screen:
    """Refusals of a batch of prepared results (see the module docstring). ``banned(board,
    player, incarnation)`` answers from the caller's ban list (a router's cache)."""

    def __init__(self, banned: Callable[[str, str, str], bool]) -> None:
        self.banned = banned

    def needed(self, board: Board, any_bans: bool) -> bool:
        c = board.config
        return (
            any_bans or c.max_points_per_result is not None or c.max_results_per_player_per_minute is not None
        )

    async def refusals(
        self, board: Board, prepared: Sequence[Prepared], now_ms: int | None = None
    ) -> list[Refusal]:
        c, board_id = board.config, board.config.id
        out: list[Refusal] = []
        counted: list[int] = []
        for i, p in enumerate(prepared):
            if self.banned(board_id, p.player_id, board.incarnation):
                out.append(Refusal(i, REFUSED["banned"]))
            elif c.max_points_per_result is not None and p.points > c.max_points_per_result:
                out.append(Refusal(i, REFUSED["points"]))
            else:
                counted.append(i)
        limit = c.max_results_per_player_per_minute
        if limit is not None and counted:
            over = await _over_rate(board, [prepared[i] for i in counted], limit, now_ms)
            out += [Refusal(counted[n], REFUSED["rate"]) for n in over]
        # A refusal writes nothing, so nothing tells a caller that holds a board deleted since (a
        # router keeps one for seconds) that it is gone: its ban (which holds on that incarnation
        # only) or its limits would refuse the results of the board created again under the id.
        # Answered as that write would be (BoardNotFound; rate.lua asked its shards already).
        # Until 2026-12-05 such a router answered `banned` for a player not banned there.
        screened = {prepared[r.position].shard for r in out if r.status != REFUSED["rate"]}
        if screened:
            await board.check_live(screened)
        return sorted(out, key=lambda r: r.position)


async def _over_rate(board: Board, prepared: Sequence[Prepared], limit: int, now_ms: int | None) -> list[int]:
    """Positions in ``prepared`` past the per-minute limit (rate.lua per shard, concurrently)."""
    now = times.now_ms() if now_ms is None else now_ms
    minute = now // 60_000
    # The incr dedup window's buckets, as Board.apply_shard names them for write.lua: a result in
    # it is a retry of one applied (rate.lua).
    c, b = board.config, board.config.dedup_bucket_ms
    dedup = [(now - c.dedup_window_s * 1000) // b, now // b] if c.mode == "incr" else [1, 0]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prepared):
        groups[p.shard].append(i)

    async def one(shard: int, idx: list[int]) -> list[int]:
        prefix = board.prefixes[shard]
        counted, counts = keys.rate_keys(prefix, minute)
        previous, _ = keys.rate_keys(prefix, minute - 1)
        following, _ = keys.rate_keys(prefix, minute + 1)  # a router ahead's (rate.lua)
        # The shard, for rate.lua to refuse it without its sentinel as write.lua does (SHARDLOST).
        args: list[Any] = [limit, (minute + 2) * 60_000, *dedup, shard if board.sentinels else -1]
        for i in idx:
            args += [f"{prepared[i].match_id}\x00{prepared[i].player_id}", prepared[i].player_id]
        try:
            reply = await board.scripts.rate(
                keys=[keys.index_key(prefix), counted, counts, previous, keys.gone_key(prefix), following],
                args=args,
            )
        except ResponseError as e:
            raise board.gone(e) from e
        return [i for i, ok in zip(idx, reply, strict=True) if not int(ok)]

    found = await asyncio.gather(*(one(s, idx) for s, idx in groups.items()))
    return sorted(i for got in found for i in got)


async def record_refusals(
    db: psycopg.AsyncConnection[Any], rows: Iterable[tuple[str, str, str, int, str, str | None]]
) -> None:
    """Rows (board, player, match, points, status, request id) into ``refused_results``, each result
    once: a row whose (board, player, match) is there already adds nothing (see SCHEMA), so the
    first refusal of a result is the one kept, with its request id; later ones (retries, replays)
    are in the router's log lines only."""
    async with db.transaction(), db.cursor() as cur:
        await cur.executemany(
            "INSERT INTO refused_results (board, player_id, match_id, points, status, request_id) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            list(rows),
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
