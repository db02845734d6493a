"""Moderation over HTTP (router/README.md, "Additions: moderation"): removing a player from a board,
bans, and the write path's screen of banned players and sanity limits (shardlb/moderation.py).

Every router holds the ban list in memory (``BanCache``) and checks each score against it before it
is queued. The list is refreshed every ``REFRESH_S``: one GET of the list's version and, only when it
moved, the records of the fields the list's change log names since this copy last read it
(``BanCache.follow``; shardlb/moderation.py, ``Bans._note``). The whole list is read, a page at a
time, only when the log cannot say what changed (the first refresh, a change by a router of the
release before, a restore or a forgetting, entries trimmed or lost in a failover) and at least every
``FULL_LOAD_S``. So a ban reaches every router within about ``REFRESH_S``. Until 2026-12-06 every
move read the whole list: at 100,000 bans half a second of each worker's event loop and 12.7 MB
from one primary, in every worker of every router, at every ban or lift. A ban request therefore
stores the ban, waits ``PROPAGATION_S`` (two refreshes), and only
then removes the player's entries: a score that a router accepted before it learnt of the ban has
been written by then, and the removal takes it away too. A router that cannot reach Redis keeps its
last list (and cannot write either).

Refused results (``banned``, ``points_limit``, ``rate_limit``) are logged to PostgreSQL's
``refused_results`` by a background task, in batches, off the write path; at most ``LOG_MAX`` wait,
more are dropped and counted (a flood of refusals must not hold memory or slow writes). The table
keeps one row per refused result (``moderation.record_refusals``; those dropped past ``LOG_MAX`` are
counted by shardlb_refused_results_unrecorded_total and the ``not_recorded`` field of the minute's
count line below), so the rows of a call retried,
and a batch written again after a lost reply, add nothing; a call made again through a reshard's
cut-over queues each refusal once (``Moderation.submit``).

Each refused result is counted (shardlb_results_refused_total, by status), but only the first
``LINES_PER_MINUTE`` of a minute are a `result refused` info line each: a game server that keeps
posting a banned player's results, or a ban of a very active player, made a line per refused
result, as many a second as were posted, for as long as it lasted. The others are debug lines
(SHARDLB_LOG_LEVEL=debug shows each), and once the minute is over one info line, `refused results
not logged each`, counts them by status and board (``RefusalLog.summarize``): at the next refusal,
when the log's task sees the minute end, or at the router's stop. The table is the record of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import psycopg
from redis.exceptions import RedisClusterException, RedisError
from starlette.requests import Request
from starlette.responses import Response

from router import metrics, params
from router.auth import Scope
from router.boards import through_reshard
from router.errors import ApiError
from router.media import read_object, render
from router.middleware import retry_key
from shardlb import archive, moderation, times
from shardlb.archive import connect_db
from shardlb.board import Board, Prepared, Result
from shardlb.config import check_id
from shardlb.errors import BoardNotFound, NotAcknowledged
from shardlb.journal import Entry
from shardlb.moderation import ALL, Ban, Bans, Screen
from shardlb.outage import Outage

if TYPE_CHECKING:
    from router.service import Service

log = logging.getLogger("shardlb.router")
REFRESH_S = moderation.REFRESH_S
PROPAGATION_S = moderation.PROPAGATION_S  # a ban's wait (the module docstring)
LOG_MAX = 10_000
LOG_BATCH = 500
LINES_PER_MINUTE = 100  # refused results logged a line each in a minute (the module docstring)
LINES_EVERY_S = 60.0
CHANGES_READ = 1000  # change-log entries a refresh reads; more, and it loads the whole list
FULL_LOAD_S = 3600.0  # the whole list is loaded again at least this often (``BanCache.refresh``)
MARK_AGAIN_S = 60.0  # a whole read put off for the list's mark looks at it again after this long
SUMMARY_BOARDS = 20  # boards named in a `refused results not logged each` line, those with the most


class BanCache:
    """The ban list as this router knows it (see the module docstring)."""

    def __init__(
        self, bans: Bans, every_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bans = bans
        self.every_s = every_s
        self.clock = clock
        self.version = -1  # the list's version this copy is at; -1: none loaded yet
        self.position = moderation.NO_CHANGE  # the change log's last entry read
        # Fields of changes whose first note was read and whose move was not yet: field -> (how many
        # such notes, the last one's time). Read again at every move (``follow``): see ``opened``.
        self.open: dict[str, tuple[int, int]] = {}
        self.load_by = 0.0  # when the whole list is next loaded at the latest (``clock``)
        self.kept = False  # the copy was kept across a loss of the list (``lost``) and not loaded since
        self.marked = False  # the list was marked whole (``Bans.whole``) when the copy last loaded it
        self.fields: dict[str, str | None] = {}  # ban field -> the board's incarnation (Ban.incarnation)
        self.closed = False
        self.outage = Outage(log, "ban list not refreshed", "ban list refreshed again")
        # Refreshes overlap (the task's and a ban's or an unban's request): one at a time, so a
        # refresh begun before a ban never puts back a copy without it after one begun since.
        self.lock = asyncio.Lock()

    def banned(self, board: str, player: str, incarnation: str | None = None) -> bool:
        """Whether ``player`` is banned on ``board`` (of ``incarnation``; None: any) or everywhere."""
        fields = self.fields
        if not fields:
            return False
        if moderation.ban_field(ALL, player) in fields:
            return True
        field = moderation.ban_field(board, player)
        if field not in fields:
            return False
        made_on = fields[field]
        return made_on is None or incarnation is None or made_on == incarnation

    async def refresh(self) -> None:
        """Bring the copy up to the list: nothing when the version has not moved; else the fields
        the change log names since the copy's position (``follow``), or the whole list (``load``)
        when the log cannot say (the first refresh, a move the log lacks, entries trimmed or lost),
        and at least every ``FULL_LOAD_S``; the copy as it is while Redis has lost the list
        (``lost``), and the changes made since on top of it until the list is written back."""
        async with self.lock:
            due = self.clock() >= self.load_by
            if self.version >= 0:
                version = await self.bans.version()
                if version == 0 and self.fields:
                    self.lost()
                    return
                if due and (self.kept or self.marked) and not await self.bans.whole():
                    # The list holds the changes since its loss alone (``lost``), or lost its slot
                    # alone, its version kept (the mark gone with it): until it is written back.
                    # Until 2026-12-07 (later that day) a copy that was not ``lost`` read it whole.
                    # The mark is looked at again later, not at every refresh (a list nothing
                    # writes back, PostgreSQL holding no ban, stays unmarked for good; the
                    # write-back's move reads the list whole anyway): until 2026-12-07 (later
                    # still) two GETs a refresh.
                    due, self.load_by = False, self.clock() + MARK_AGAIN_S
                if not due and (version == self.version or await self.follow()):
                    return
            await self.load()

    def lost(self) -> None:
        """The list's version is missing while this copy holds bans: Redis lost the list (a total
        loss, or the masters of the list and its version lost with their replicas), as a list that
        ever held a ban has a version (``Bans._moved``). The copy is kept until the list is written
        back (`rebuild --all`, the archiver's ``Bans.recover``), whose move makes the next refresh
        read it whole. Until 2026-12-07 the copy loaded the empty list, and banned players' results
        were taken until that refresh.

        The log went with the version (one slot) and starts anew at the next change: the copy
        follows it from its start, from version 0, so a ban or a lift made before the list is
        written back (the list then holds it alone) is read by its field, on top of what the copy
        kept; and its hourly whole read waits for the list's mark (``Bans.whole``). Until
        2026-12-07 (later that day) such a change made the copy read the list whole, and banned
        players' results were taken until the list was written back. Changes in flight at the loss
        (``open``) were lost with the list, or are made again by their retry."""
        if self.version != 0:
            log.warning(
                "ban list lost from Redis: keeping this copy until it is written back (%d bans)",
                len(self.fields),
            )
        self.version, self.position, self.open, self.kept = 0, moderation.NO_CHANGE, {}, True

    async def follow(self) -> bool:
        """Read the fields the change log names since this copy's position, and those of the
        changes still open (``opened``), and take their records as the list holds them now; False,
        changing nothing, unless the log's entries lead without a gap from this copy's version to
        the list's."""
        now, entries = await self.bans.changes(self.position, CHANGES_READ)
        if self.position != moderation.NO_CHANGE:
            if not entries or entries[0].id != self.position:
                return False  # the entry read last is gone: trimmed, or lost with a failover
            entries = entries[1:]
        at: int | None = self.version
        named = set(self.open)
        for entry in entries:
            if entry.before != at:
                # A move the log lacks (a router of the release before, a restore), or an entry that
                # is no note of this release (``before`` None).
                return False
            at = entry.after
            named.update(entry.fields)
        if at != now or len(entries) >= CHANGES_READ - 1:
            return False  # a move since the last entry that the log lacks, or more to read
        if moderation.WHOLE in named:
            return False  # a restore or a forgetting, under way (its first note open) or made
        for field, incarnation, held in await self.bans.held_on(sorted(named)):
            if held:
                self.fields[field] = incarnation
            else:
                self.fields.pop(field, None)
        self.version = now
        if entries:
            self.position = entries[-1].id
            self.open = opened(self.open, entries)
        metrics.BAN_LIST_READS.labels("changes").inc()
        return True

    async def load(self) -> None:
        """Load the whole list, a page at a time; the log's position and the version are read
        first, so a change made during the scan is read again from the log at the next refresh,
        and so is one whose first note was there already (it may write during the scan, behind it,
        and be cut short). Its mark before the list too (``marked``): a copy of a list marked whole
        reads it whole again only while it is (``refresh``).

        A copy of a list marked whole, or kept across a loss (``lost``), that reads the list
        unmarked (lost and not yet written back whole; a write-back under way) keeps what it held
        beside what it reads, and stays ``kept``, until it reads the list marked: the list may hold
        the changes since a loss alone, and the restore's pages written so far. A change it could
        not follow makes it read the list whole (the write-back's own first note, read with a ban
        made while it writes; a forgetting's; a router of the release before): until 2026-12-07
        (later that day) it then took the list as it was, and the router took the results of the
        players banned before the loss until the write-back's move. A lift it could not follow
        meanwhile refuses the player until then."""
        version, recent = await self.bans.mark(CHANGES_READ)
        marked = await self.bans.whole()
        fields = {field: incarnation async for field, incarnation in self.bans.scan()}
        kept = not marked and (self.kept or self.marked) and bool(self.fields)
        if kept:
            fields = self.fields | fields
        self.fields, self.version, self.kept, self.marked = fields, version, kept, marked
        self.position = recent[-1].id if recent else moderation.NO_CHANGE
        self.open = opened({}, recent)
        # Spread, so that the workers started together do not all load it at once again.
        self.load_by = self.clock() + FULL_LOAD_S * random.uniform(0.75, 1.25)
        metrics.BAN_LIST_READS.labels("whole").inc()

    async def run(self) -> None:
        while not self.closed:
            try:
                await self.refresh()
            except Exception as e:  # the cluster is in trouble: keep the last list meanwhile
                self.outage.failed(e)
            else:
                self.outage.succeeded()
            await asyncio.sleep(self.every_s)


def opened(
    before: dict[str, tuple[int, int]], entries: Sequence[moderation.Change]
) -> dict[str, tuple[int, int]]:
    """The changes still open after ``entries``, given those open ``before`` (``BanCache.open``). A
    change notes its field before its write and again with its move (``Bans._note``); a copy may
    read the first note, and the field, before the write. Were the change then cut short (no move:
    a crash, a lost reply, a write not confirmed), nothing after would name the field, and the copy
    would miss the write until its hourly whole read, where a reload of the whole list at the next
    move read it before 2026-12-06 (later that day). So a first note stays open, its field read
    again at every move, until a move naming the field is read, or for OPEN_MS at most (after the
    last entry read): a change writes within that. Counted per field, as two changes of one player
    may run at once."""
    found = dict(before)
    for entry in entries:
        for field in entry.fields:
            notes, _ = found.get(field, (0, 0))
            if entry.first:
                found[field] = (notes + 1, entry.ms)
            elif notes > 1:
                found[field] = (notes - 1, found[field][1])
            else:
                found.pop(field, None)
    since = entries[-1].ms - moderation.OPEN_MS if entries else 0
    return {field: (notes, ms) for field, (notes, ms) in found.items() if ms >= since}


class RefusalLog:
    """Refused results on their way to ``refused_results`` (see the module docstring)."""

    def __init__(
        self, postgres_url: str, every_s: float = LINES_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.url = postgres_url
        self.rows: list[tuple[str, str, str, int, str, str | None]] = []
        self.dropped = 0
        self.ready = asyncio.Event()
        self.closed = False
        self.retry_s = 1.0  # the pause before PostgreSQL is tried again
        self.outage = Outage(log, "refused results not recorded; retrying", "refused results recorded again")
        self.every_s = every_s
        self.clock = clock
        self.minute: float | None = None  # when the minute of log lines under way began; None: none is
        self.lined = 0  # refused results logged a line each in it
        self.unlined: dict[tuple[str, str], int] = {}  # the others, by (board, status)
        self.unrecorded = 0  # refused results of the minute past the queue (LOG_MAX): not in the table

    def add(self, rows: Sequence[tuple[str, str, str, int, str, str | None]]) -> None:
        self.summarize(over_only=True)
        if self.minute is None:
            self.minute = self.clock()
        for row in rows:
            metrics.RESULTS_REFUSED.labels(row[4]).inc()
            fields = {"fields": dict(zip(_ROW, row, strict=True))}
            if self.lined < LINES_PER_MINUTE:
                self.lined += 1
                log.info("result refused", extra=fields)
            else:
                self.unlined[row[0], row[4]] = self.unlined.get((row[0], row[4]), 0) + 1
                log.debug("result refused", extra=fields)
        room = LOG_MAX - len(self.rows)
        self.rows += rows[:room]
        dropped = max(0, len(rows) - room)
        if dropped:
            self.dropped += dropped
            self.unrecorded += dropped
            metrics.REFUSED_UNRECORDED.inc(dropped)
        self.ready.set()

    def summarize(self, over_only: bool = False) -> None:
        """End the minute of log lines under way (``over_only``: if it is over), with the line that
        counts its refused results not logged each, if any."""
        if self.minute is None:
            return
        since = self.clock() - self.minute
        if over_only and since < self.every_s:
            return
        unlined, self.unlined, self.minute, self.lined = self.unlined, {}, None, 0
        unrecorded, self.unrecorded = self.unrecorded, 0
        if not unlined and not unrecorded:
            return
        statuses: dict[str, int] = {}
        boards: dict[str, int] = {}
        for (board, status), count in unlined.items():
            statuses[status] = statuses.get(status, 0) + count
            boards[board] = boards.get(board, 0) + count
        most = dict(sorted(boards.items(), key=lambda item: -item[1])[:SUMMARY_BOARDS])
        fields: dict[str, object] = {"refused": sum(statuses.values()), "statuses": statuses, "boards": most}
        if len(boards) > len(most):
            fields["other_boards"] = len(boards) - len(most)
        if unrecorded:  # past the queue while PostgreSQL was slow or away: in no table
            fields["not_recorded"] = unrecorded
        fields["since_s"] = round(since, 1)
        log.info("refused results not logged each", extra={"fields": fields})

    async def _wait(self) -> None:
        """Until rows are added or the close, or the minute of log lines under way is over."""
        if self.minute is None:
            await self.ready.wait()
        else:
            with contextlib.suppress(TimeoutError):
                left = self.minute + self.every_s - self.clock()
                await asyncio.wait_for(self.ready.wait(), max(left, 0.0))
            self.summarize(over_only=True)
        self.ready.clear()

    def close(self) -> None:
        """Let ``run`` write what is queued, then end (the router's stop waits for it, within
        SHARDLB_DRAIN_SECONDS, and cuts it off after that)."""
        self.closed = True
        self.ready.set()

    async def run(self) -> None:
        db: psycopg.AsyncConnection[Any] | None = None
        try:
            while not self.closed or self.rows:
                await self._wait()
                if not self.url:
                    # no archive: the log lines are the record (past 100 a minute, their count)
                    self.rows.clear()
                    continue
                while self.rows:
                    batch = self.rows[:LOG_BATCH]
                    try:
                        db = db if db is not None and not db.closed else await connect_db(self.url)
                        await moderation.record_refusals(db, batch)
                    except (psycopg.Error, OSError) as e:
                        self.outage.failed(e)
                        await asyncio.sleep(self.retry_s)
                        self.summarize(over_only=True)
                        continue
                    self.outage.succeeded()
                    del self.rows[: len(batch)]
        finally:
            self.summarize()
            if db is not None:
                await db.close()


_ROW = ("board", "player_id", "match_id", "points", "status", "request_id")


class Moderation:
    """What the write path asks before it queues a request's scores."""

    def __init__(self, bans: BanCache, refusals: RefusalLog) -> None:
        self.bans = bans
        self.refusals = refusals
        self.screen = Screen(bans.banned)

    def submit(
        self,
        board: Board,
        prepared: Sequence[Prepared],
        request_id: str | None,
        coalescer: Any,
        queued: set[int] | None = None,
    ) -> Awaitable[list[Result]]:
        """The request's results in order: refused ones with their status (nothing of them is
        written), the others as the coalescer applied them.

        ``queued``, kept by the caller across the attempts of one call (through_reshard makes the
        call again), holds the positions whose refusal is queued already: an attempt again queues
        and logs only the others. refused_results keeps the first refusal anyway, and the copies
        took room in the bounded queue from other calls' refusals.

        Not a coroutine itself: a board with nothing to screen (no ban, no limit: most writes)
        hands back the coalescer's own coroutine, a coroutine less a write."""
        if not self.screen.needed(board, bool(self.bans.fields)):
            return cast("Awaitable[list[Result]]", coalescer.submit(board, prepared))
        return self._screened(board, prepared, request_id, coalescer, queued)

    async def _screened(
        self,
        board: Board,
        prepared: Sequence[Prepared],
        request_id: str | None,
        coalescer: Any,
        queued: set[int] | None,
    ) -> list[Result]:
        # A full queue refuses the request before the screen counts its results (rate.lua) or
        # queues its refusals: a 503 overloaded leaves nothing behind.
        coalescer.check_room(len(prepared))
        refused = {r.position: r.status for r in await self.screen.refusals(board, prepared)}
        if not refused:
            return cast(list[Result], await coalescer.submit(board, prepared))
        fresh = [(i, prepared[i]) for i in refused if queued is None or i not in queued]
        self.refusals.add(
            [(board.config.id, p.player_id, p.match_id, p.points, refused[i], request_id) for i, p in fresh]
        )
        if queued is not None:
            queued.update(i for i, _ in fresh)
        allowed = [p for i, p in enumerate(prepared) if i not in refused]
        # Read before the writes: a refused result's points are the total after the results before
        # it (api.md), which for a player none of whose results came earlier in the call is the
        # total that the board holds now.
        totals = await _totals(board, prepared, refused)
        applied = iter(await coalescer.submit(board, allowed) if allowed else [])
        out: list[Result] = []
        for i, p in enumerate(prepared):
            if i in refused:
                out.append(Result(p.player_id, p.match_id, refused[i], totals.get(p.player_id, 0)))
            else:
                out.append(result := next(applied))
                totals[p.player_id] = result.points  # what a later refused result of theirs answers
        return out


async def _totals(board: Board, prepared: Sequence[Prepared], refused: dict[int, str]) -> dict[str, int]:
    """The points on the total board of the players refused in ``prepared`` before any result of
    theirs came in it (one ZMSCORE per home shard); a player without any is left out."""
    players, seen = [], set()
    for i, p in enumerate(prepared):
        if i in refused and p.player_id not in seen:
            players.append(p.player_id)
        seen.add(p.player_id)
    if not players:
        return {}
    found = await board.scores(players, board.resolve())
    return {player: board.codec.decode_units(score)[0] for player, score in found.items()}


# ---- endpoints (admin) -------------------------------------------------------------------------


def _service(request: Request) -> Service:
    return cast("Service", request.app.state.service)


def _admin(request: Request) -> tuple[Service, str]:
    """The service and who is asking (the key's client id), once the key is admin."""
    svc = _service(request)
    peer = request.client.host if request.client else "unknown"
    caller = svc.keys.require(request.headers.get("authorization"), peer, Scope.ADMIN)
    return svc, caller.client


@contextlib.asynccontextmanager
async def _archive(svc: Service) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection to PostgreSQL, where bans and the audit live (409 when this router has none)."""
    if not svc.settings.postgres_url:
        raise ApiError(409, "archive_not_configured", "this router has no PostgreSQL (SHARDLB_POSTGRES_URL)")
    try:
        db = await connect_db(svc.settings.postgres_url)
    except (psycopg.Error, OSError) as e:
        raise ApiError(
            503, "archive_unavailable", f"PostgreSQL failed: {type(e).__name__}", retry_after=5
        ) from e
    try:
        yield db
    except psycopg.Error as e:
        raise ApiError(
            503, "archive_unavailable", f"PostgreSQL failed: {type(e).__name__}", retry_after=5
        ) from e
    finally:
        await db.close()


async def _remove(
    svc: Service,
    board_id: str,
    player: str,
    request: str | None,
    since_ms: int | None = None,
    now_ms: int | None = None,
    incarnation: str | None = None,
    anew: bool = False,
    db: psycopg.AsyncConnection[Any] | None = None,
) -> bool:
    """Remove ``player`` from the board, waiting out a reshard's cut-over as score writes do: each
    try looks the board up anew (a refusal marked the one kept stale), and a removal tried again
    converges (shardlb/moderation.py). Whether the player had an entry (as the first call of
    ``request`` found it: a client's retry with the same X-Request-Id is that removal again, and
    keeps the results the player posted since; a request id the router made up is new each try).
    ``since_ms`` and ``now_ms``: see ``moderation.remove``. ``incarnation``: remove only from that
    incarnation of the board (a ban's, which holds on it alone); a board created again under the id
    since is left alone (False), as a board deleted is.

    ``anew`` (a ban's removals): this router's copy of the board is looked up in the registry again
    when it is not of ``incarnation``, or turns out deleted, rather than taken for the board: a
    router keeps a board for seconds, and one deleted and created again through another router
    meanwhile is the board in the ban's scope (its incarnation read from the registry). Until
    2026-12-05 such a ban removed nothing there, and the banned player stayed on the board, ranked.

    ``db``: the delete entries the removal journaled are archived there before this returns
    (``archive.record_removals``), so a removal answered survives a loss of Redis before the
    archiver's next round; a failure there is the caller's 503, and the retry with the same
    X-Request-Id converges and archives them again."""
    journaled: list[tuple[str, Entry]] = []

    async def attempt() -> bool:
        board = await svc.boards.get(board_id)
        if anew and incarnation is not None and board.incarnation != incarnation:
            board = await svc.boards.store.get(board_id)
        if incarnation is not None and board.incarnation != incarnation:
            return False
        try:
            removed = await moderation.remove(
                board, [player], now_ms, request=request, since_ms=since_ms, journaled=journaled
            )
        except BoardNotFound:
            if not anew or incarnation is not None:  # the board the ban holds on is gone: nothing left
                raise
            # This router's copy was deleted (now marked so): the board under the id now, if any.
            board = await svc.boards.store.get(board_id)
            removed = await moderation.remove(
                board, [player], now_ms, request=request, since_ms=since_ms, journaled=journaled
            )
        return player in removed

    try:
        found = await through_reshard(attempt)
        if db is not None:
            await archive.record_removals(db, journaled)
        return found
    finally:
        # This worker's cached tops and histograms of the board were read before the removal (or
        # its part that went through, when it failed half way): its reads after the answer go live.
        svc.tops.forget(board_id)
        svc.histograms.forget(board_id)


def _request(action: str, request_id: str | None) -> str | None:
    """The name of a removal that ``action`` makes for the request ``request_id`` (request ids
    hold no '/'): a ban's removals and a DELETE sent with one id by mistake stay two removals."""
    return None if request_id is None else f"{action}/{request_id}"


async def remove_player(request: Request) -> Response:
    """DELETE /v1/boards/{board}/players/{player}?reason=...: audited first (once per request id),
    then removed."""
    svc, actor = _admin(request)
    request_id = retry_key(request)  # a retry with the same id is this call again
    query = params.query(request.scope["query_string"], frozenset({"reason"}))
    reason = moderation.check_reason(query.get("reason"), required=False)
    board_id = (await svc.boards.get(request.path_params["board"])).config.id
    player = check_id(request.path_params["player"], "player")
    now = times.now_ms()  # the removal's time, kept in its audit row for a retry past the window
    async with _archive(svc) as db:
        async with db.transaction():
            # A request id the router made up is new, so a retry without one is audited again.
            first_ms = await moderation.audit_removal(db, board_id, player, actor, reason, request_id, now)
        removal = _request("remove", request_id)
        if first_ms is None:
            removed = await _remove(svc, board_id, player, removal, now_ms=now, db=db)
        else:  # a retry: at the first call's time wherever no shard has its record (moderation.remove)
            removed = await _remove(svc, board_id, player, removal, since_ms=first_ms, db=db)
    return render(request, {"board": board_id, "player_id": player, "removed": removed})


async def _ban_body(request: Request, svc: Service) -> tuple[str, str, str]:
    params.query(request.scope["query_string"], frozenset())
    player = check_id(request.path_params["player"], "player")
    body = params.integral(await read_object(request, svc.settings.max_body_bytes))
    scope, reason = moderation.parse_scope(body)
    return player, scope, reason


async def ban(request: Request) -> Response:
    """POST /v1/players/{player}:ban: store the ban, let every router learn it, then remove the
    player's entries from the boards in its scope. A retry after the ban was lifted stores
    nothing, and finishes the removal as the first call would have made it, at the ban's time
    (``Bans.add``, ``moderation.remove``). A board deleted since it was listed is skipped: nothing
    of the player is left there."""
    svc, actor = _admin(request)
    request_id = retry_key(request)  # a retry with the same id is this call again
    player, scope, reason = await _ban_body(request, svc)
    # The registry's record, not this router's cached one: a board ban holds on the incarnation
    # it names, which must be the board's now, not one deleted since.
    boards = [await svc.boards.store.get(scope)] if scope != ALL else await svc.boards.store.boards()
    async with _archive(svc) as db:
        # A ban of one board holds on this board, not on one created again under its id.
        incarnation = None if scope == ALL else boards[0].incarnation
        record, in_force = await svc.moderation.bans.bans.add(
            db, Ban(player, scope, reason, actor, times.now_ms(), incarnation), request_id
        )
    if in_force:
        await svc.moderation.bans.refresh()
        await asyncio.sleep(PROPAGATION_S)
    removal, since = _request("ban", request_id), None if in_force else record.at_ms
    removed = []
    async with _archive(svc) as db:  # each board's removal archived before the answer (``_remove``)
        for board in boards:
            try:
                # Only from the board the ban holds on (``record.incarnation``: the one it was made
                # on, None for a ban of every board or of before 2026-12-05): one deleted and created
                # again under its id since (while this ban waited, or before its retry) is another
                # board, on which this ban is not in force. Until 2026-12-05 the removal took the
                # player's results off the new board, and out of its rebuild and settlement.
                if await _remove(
                    svc,
                    board.config.id,
                    player,
                    removal,
                    since,
                    incarnation=record.incarnation,
                    anew=True,
                    db=db,
                ):
                    removed.append(board.config.id)
            except BoardNotFound:
                continue
    return render(request, {**record.body(), "removed_from": sorted(removed)})


async def unban(request: Request) -> Response:
    """POST /v1/players/{player}:unban: lift a ban of that scope (later scores count again).
    ``lifted`` says whether a ban in force was lifted: one of a board deleted since (another
    incarnation, or none now) was not, as GET /v1/bans has it."""
    svc, actor = _admin(request)
    request_id = retry_key(request)  # a retry with the same id is this call again
    player, scope, reason = await _ban_body(request, svc)
    incarnation: str | None = ALL
    if scope != ALL:
        try:
            incarnation = (await svc.boards.store.get(scope)).incarnation  # the registry's, not a copy
        except BoardNotFound:
            incarnation = None
    bans = svc.moderation.bans.bans
    async with _archive(svc) as db:
        lifted = await bans.lift(db, player, scope, actor, reason, request_id, incarnation)
    await svc.moderation.bans.refresh()
    return render(request, {"player_id": player, "lifted": lifted})


async def forget_bans(
    svc: Service,
    board_id: str,
    incarnation: str,
    connection: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]],
) -> None:
    """After DELETE /v1/boards/{board}: forget the bans of the board deleted (``Bans.forget``), in
    force nowhere now, on the DELETE's own PostgreSQL connection (``connection`` opens it when no
    mark has: ``routes._Marks``, which closes it). The deletion is done (and recorded in PostgreSQL
    before this: ``routes.delete_board``) and answered 204 whatever happens here: without
    PostgreSQL, or when it or Redis fails (a RedisError, or the cluster client's own
    ``RedisClusterException``, e.g. a slot not covered: 503 until 2026-12-06), the bans are left
    (not in force, and not listed) for the archiver's sweep (``Bans.sweep``), and logged."""
    if not svc.settings.postgres_url:
        return
    try:
        await svc.moderation.bans.bans.forget(await connection(), board_id, incarnation)
    except (psycopg.Error, OSError, RedisError, RedisClusterException, NotAcknowledged) as e:
        log.warning(
            "the bans of a board deleted were not forgotten: the archiver's sweep forgets them",
            extra={"fields": {"board": board_id, "incarnation": incarnation, "error": type(e).__name__}},
        )


async def list_bans(request: Request) -> Response:
    """GET /v1/bans[?player=]: every ban in force, or one player's. A ban of a board that was
    deleted (or deleted and created again: another incarnation) is not in force, and not listed."""
    svc, _ = _admin(request)
    query = params.query(request.scope["query_string"], frozenset({"player"}))
    player = None if "player" not in query else check_id(query["player"], "player")
    found = [b for b in await moderation.Bans(svc.client).all() if player is None or b.player == player]
    held = {b.board for b in found if b.incarnation is not None}
    boards = await svc.boards.store.boards() if held else []
    incarnations = {board.config.id: board.incarnation for board in boards}
    listed = [b for b in found if b.incarnation is None or incarnations.get(b.board) == b.incarnation]
    return render(request, {"bans": [b.body() for b in listed]})
