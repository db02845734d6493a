"""The board registry as requests see it: cached, one fetch per board at a time, bounded.

Every request names a board. Its settings are kept for ``ttl_s`` seconds, or until a write finds
this incarnation deleted (``Board.deleted``: another process deleted it; a new one may exist), or
until this worker sees that another process changed its record (below); when they expire, the
first request fetches them and the requests arriving meanwhile wait for that same fetch
(router/refresh.py) instead of sending one each (a thousand writers must not all HGET the registry
at once, on one primary). Fetches, listing, creating and deleting boards share one small Gate, so
the registry takes at most ``gate.limit`` connections, on the one primary that holds it.

A change made by another process (the archiver's mark of a shard lost alone, a rebuild's marks
taken off, a deletion or a reshard's step through another router or the CLI) is seen within a
quarter of a second: each worker reads the registry's version (a GET of one key, through the
registry gate) every ``FOLLOW_S`` (``run``), and when it moved, reads which boards changed from
the change log registry.lua writes with it (``BoardStore.moved``: one round trip of the version, an
LRANGE of a few entries and the version again; no MULTI, which a registry primary out of memory
refuses, reads too: the looks go on there) and expires their copies only; the next request of
such a board fetches it as an expired one (single flight, the kept lane). When the log cannot say
(a move without a note, or more moves than it keeps), the records kept unexpired are compared
with the registry's: their digests first (``BoardStore.digests``, an HMGET of about 20 bytes a
board, read after the version), then the records whose digest differs (an HMGET of those only),
at most once every ``RECHECK_S_PER_BOARD`` per board compared; meanwhile the moves the log names
after the one it lacks are taken in as any other. A fetch under way of a board a move taken in
names (of any board, when the log cannot say) keeps nothing, and later requests do not join it,
unless it read the registry at the version the move was taken in through (``_moved_since``).
Costs per worker: 4 GETs a second to the registry's primary; a move costs a round trip of a few
hundred bytes whatever the boards kept (a comparison of 2,000 boards kept: about 50 kB and the
records changed, at most once a second; it was about 1 MB, every record, until the digests).
Nothing is added on a request's path. The expiry (``ttl_s``, 5 s) stays the bound for
what the version does not show: records written by processes of the release before the version
(they do not move it), and any time the looks fail (Redis unreachable: logged as an ``Outage``, a
few lines an hour), and while every permit of the registry gate is held (a look takes only a
permit free now: it never waits in the gate's queue ahead of requests' fetches, nor takes a place
in it; it is skipped).

Public reads (``lookup``) must not be able to crowd writes out of that gate with a flood of board
ids that do not exist: their fetches and listings first take the read lane, a gate of one permit
with the registry gate's queue and wait, so they hold at most one registry permit and a write's
fetch waits behind at most one of them. A write never waits for a fetch a read started. A read of
a board this router keeps, whose settings expired, takes a lane of its own (the kept lane, alike):
a flood of unknown ids (from many addresses, it can keep the read lane's queue full) must not make
every read of a real board 503 each time its settings expire, and the kept lane's fetches are at
most one per kept board and ``ttl_s`` (a board found gone is no longer kept). So a write's fetch
waits behind at most one read of each lane. A board a read found missing is remembered as
missing for ``missing_ttl_s`` (at most ``max_missing`` ids, the oldest forgotten first); writes do
not trust that memory, and a create through this router clears it. A fetch that overlapped a create
or a delete through this router answers its callers but keeps nothing, and requests after the
change do not join it: what it read may be from before the change, and would hide a board just
created or keep one just deleted.

The board list (GET /v1/boards, public) is held as rendered, with the registry's version it was
read at (``BoardStore.records``, no MULTI either: the list is answered from a registry primary out
of memory): a list while the version stands and the listing is younger than
``ttl_s`` costs a GET of the version. Every change of a record moves the version, but processes of
the release before the version (README, "Upgrading an install", 19) write records without moving
it, so a listing older than ``ttl_s`` is read again; when its records are those it was made of (a
digest), the body is kept as it was. A worker holds one listing, its two renderings (1.7 MB at
2,000 boards), never a Board of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from redis.exceptions import RedisClusterException, RedisError

from router import metrics
from router.gate import Gate
from router.media import Rendered
from router.refresh import SingleFlight
from shardlb.board import Board
from shardlb.config import BoardConfig, check_id
from shardlb.errors import BoardNotFound, Overloaded, Rebuilding, Resharding
from shardlb.outage import Outage
from shardlb.reads import ResolvedView
from shardlb.store import CACHE_SECONDS, BoardStore, configs, digest

log = logging.getLogger("shardlb.router")

MAX_BOARDS = 10_000
MAX_MISSING = 10_000
MISSING_TTL_S = 1.0
# How long a request waits out a reshard's cut-over (shardlb/reshard.py) before it is answered 503
# board_resharding: the cut-over takes tens of milliseconds, a few hundred at most.
RESHARD_WAIT_S = 2.0
# How long a board being rebuilt after a loss of Redis (``Board.rebuilding``) is kept
REBUILDING_TTL_S = 1.0
RESHARD_RETRY_S = 0.05
# How often each worker reads the registry's version (``Boards.run``): a record changed by another
# process is seen within this (and a look), not when the copy expires.
FOLLOW_S = 0.25
# A comparison of the records kept (``Boards.follow`` when the change log cannot say which changed)
# waits this long per board compared before the next: at most 2,000 digests a second a worker (and
# the records whose digest differs).
RECHECK_S_PER_BOARD = 0.0005
T = TypeVar("T")
_UNREAD = object()  # the version before the first look


async def through_reshard(attempt: Callable[[], Awaitable[T]], wait_s: float = RESHARD_WAIT_S) -> T:
    """``attempt()`` again while it meets Resharding (nothing was written: a write refused by a
    sealed or moved shard, or a read of a layout that was just replaced), for up to ``wait_s``.
    Each attempt looks the board up anew: the refusal marked the cached one stale."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await attempt()
        except Resharding:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(RESHARD_RETRY_S)


@dataclass(frozen=True)
class Listing:
    """GET /v1/boards's body, with the registry's version read with it, when (monotonic s), and a
    digest of the records it was made of."""

    version: Any
    at: float
    digest: bytes
    body: Rendered


class Boards:
    def __init__(
        self,
        store: BoardStore,
        gate: Gate,
        ttl_s: float = CACHE_SECONDS,
        missing_ttl_s: float = MISSING_TTL_S,
        max_missing: int = MAX_MISSING,
    ) -> None:
        self.store = store
        self.gate = gate
        self.read_lane = Gate(1, gate.queue, gate.wait_s, "lookups of boards not cached")
        self.kept_lane = Gate(1, gate.queue, gate.wait_s, "lookups of boards kept")
        self.ttl_s = ttl_s
        self.missing_ttl_s = missing_ttl_s
        self.max_missing = max_missing
        self.missing: OrderedDict[str, float] = OrderedDict()  # board id -> when it was found missing
        self._kept: dict[str, tuple[float, Board]] = {}
        self._fetched: dict[str, int] = {}  # board id -> ``moves`` when its kept copy was fetched
        self._writes: SingleFlight[str, Board] = SingleFlight()  # fetches for writes
        self._reads: SingleFlight[str, Board] = SingleFlight()  # fetches for reads, through a lane
        self._lists: SingleFlight[str, Rendered] = SingleFlight()  # GET /v1/boards's reads
        self._listing: Listing | None = None  # GET /v1/boards's body, held (module docstring)
        self.changes = 0  # creates and deletes through this router done: see ``_fetch``
        self.follow_s = FOLLOW_S
        self.moves = 0  # moves of the registry's version taken in by ``follow``: see ``_fetch``
        # Board id -> ``moves`` when a move the change log names it in was taken in, and ``moves``
        # when one it could not name was, each with the registry's version it was taken in through:
        # a fetch begun before either keeps nothing, unless it read that version (``_moved_since``).
        self._named: dict[str, tuple[int, Any]] = {}
        self._unnamed: tuple[int, Any] = (0, _UNREAD)
        self._seen: Any = _UNREAD  # the registry's version as ``follow`` last took it in
        self._recheck_by = 0.0  # no comparison of the records kept before this (monotonic s)
        self._owed = False  # a move the change log could not name owes a comparison (``follow``)
        # The digests of the copies at the last comparison (``_compare``), not holding the copies
        self._digests: dict[str, tuple[weakref.ref[Board], str | None]] = {}
        self.closed = False  # ``run`` ends (the worker stops)
        self.outage = Outage(log, "board registry's version not read", "board registry's version read again")

    def cached(self, board_id: str) -> Board | None:
        """The board as kept, while its settings are fresh; else None (``get`` fetches them)."""
        kept = self._kept.get(board_id)
        if kept is None or kept[1].stale:
            return None
        # A board being rebuilt is fetched again sooner: its record loses its mark with the
        # rebuild's last swap, and its reads and writes are refused until this router sees that.
        ttl = min(self.ttl_s, REBUILDING_TTL_S) if kept[1].rebuilding else self.ttl_s
        return kept[1] if time.monotonic() - kept[0] < ttl else None

    def unchanged(self, board: Board) -> bool:
        """Whether ``board`` is the copy kept of its id and no move of the registry's version taken
        in since it was fetched may have changed its record (``follow``): a cache that reads
        through it (router/cache.py) may go on doing so without looking the board up again. Its
        age does not count: an old copy is as good as its record, which the version watches."""
        board_id = board.config.id
        kept = self._kept.get(board_id)
        return (
            kept is not None
            and kept[1] is board
            and kept[0] != -math.inf
            and not board.stale
            and board_id in self._fetched
            and not self._moved_since(board_id, self._fetched[board_id], board.record_version)
        )

    async def current(self, board: Board, view: ResolvedView) -> Board | None:
        """The board a cache that read ``view`` through ``board`` refreshes it through (router/cache.py,
        router/histogram.py): ``board`` while its record cannot have changed (``unchanged``), else the
        board looked up again; None when the view is not to be kept any more: the board gone, a shard
        the view merges marked not rebuilt (what was kept may have been read from it while its keys
        were gone), or another incarnation or layout than the view's keys name."""
        if self.unchanged(board):
            return board
        try:
            now = await self.lookup(board.config.id)
            now.check_view(view)
        except (BoardNotFound, Rebuilding):
            return None
        if (now.incarnation, now.generation) != (board.incarnation, board.generation):
            return None
        return now

    async def get(self, board_id: str) -> Board:
        """The board for a write (BoardNotFound when there is none; InvalidInput for a malformed id)."""
        board = self.cached(board_id)
        if board is not None:
            return board
        check_id(board_id, "board")  # a malformed id is the client's 422, never a wait for the gate
        return await self._writes.join(board_id, lambda: self._fetch(board_id, None))

    async def lookup(self, board_id: str) -> Board:
        """The board for a public read: as ``get``, but a board found missing stays missing for a
        moment, and a fetch goes through a lane: the kept lane for a board kept, else the read lane."""
        board = self.cached(board_id)
        if board is not None:
            return board
        check_id(board_id, "board")
        missed = self.missing.get(board_id)
        if missed is not None and time.monotonic() - missed < self.missing_ttl_s:
            raise BoardNotFound(f"no board {board_id!r}", "board")
        if board_id in self._writes:  # a write's fetch is under way: its answer serves this read too
            return await self._writes.join(board_id, lambda: self._fetch(board_id, None))
        lane = self.kept_lane if board_id in self._kept else self.read_lane
        return await self._reads.join(board_id, lambda: self._fetch(board_id, lane))

    async def create(self, config: BoardConfig, confirm_only: bool = False) -> tuple[Board, bool]:
        async with self.gate, metrics.redis_call("create_board"):
            made = await self.store.create(config, confirm_only)
        self._changed(config.id)
        self._forget(config.id)
        self.missing.pop(config.id, None)
        return made

    async def delete(self, board_id: str, incarnation: str | None = None) -> str:
        """``BoardStore.delete`` (of that incarnation only, when given), forgetting the cached board;
        returns the incarnation deleted."""
        try:
            async with self.gate, metrics.redis_call("delete_board"):
                return await self.store.delete(board_id, incarnation)
        finally:  # failed too: it may have been applied, and a fetch meanwhile may have seen either
            self._changed(board_id)
            self._forget(board_id)

    async def _list(self) -> Rendered:  # before ``list``, which hides the builtin below it
        changes = self.changes
        async with self.read_lane, self.gate, metrics.redis_call("list_boards"):
            held = self._listing
            if (
                held is not None
                and time.monotonic() - held.at < self.ttl_s
                and await self.store.version() == held.version
            ):
                return held.body
            at = time.monotonic()
            version, records = await self.store.records()
        digest = hashlib.blake2b(orjson.dumps(sorted(records.items())), digest_size=16).digest()
        if held is not None and held.digest == digest:
            body = held.body
        else:
            body = Rendered.of({"boards": [c.to_dict() for c in configs(records)]})
        if self.changes == changes:  # else what it read may be from before a create or a delete
            self._listing = Listing(version, at, digest, body)
        return body

    async def list(self) -> Rendered:
        """GET /v1/boards's body: every board's settings, sorted by id (a public read: through the
        read lane), held while the registry does not change (module docstring). Callers that ask
        while a look at the registry is under way share it: a flood of lists is one at a time."""
        return await self._lists.join("", self._list)

    async def _fetch(self, board_id: str, lane: Gate | None) -> Board:
        """Fetch the board's settings through the registry gate; a read's (``lane`` given) first
        takes its lane."""
        read = lane is not None
        changes, moves = self.changes, self.moves
        try:
            if lane is not None:
                async with lane, self.gate, metrics.redis_call("board"):
                    board = await self.store.get(board_id)
            else:
                async with self.gate, metrics.redis_call("board"):
                    board = await self.store.get(board_id)
        except BoardNotFound as e:
            # A create or a delete ended meanwhile, or a move was taken in (``follow``): this may be
            # older, and remembered missing it would hide a board the move created.
            version = _UNREAD if e.record_version is None else e.record_version
            if self.changes != changes or self._moved_since(board_id, moves, version):
                raise
            self._forget(board_id)
            if read:
                self._missing(board_id)
            raise
        if self.changes != changes or self._moved_since(board_id, moves, board.record_version):
            return board  # it may be from before
        self.missing.pop(board_id, None)
        if len(self._kept) >= MAX_BOARDS:
            self._kept.clear()
            self._fetched.clear()
        self._kept[board_id] = (time.monotonic(), board)
        self._fetched[board_id] = moves
        return board

    def _forget(self, board_id: str) -> None:
        """Keep nothing of ``board_id``: its copy, and the moves when it was fetched (``_fetched``,
        which until 2026-12-06 kept an entry for every id ever fetched: cleared only with the
        copies, at MAX_BOARDS kept at once, which boards deleted as they go never reach)."""
        self._kept.pop(board_id, None)
        self._fetched.pop(board_id, None)

    def _changed(self, board_id: str) -> None:
        """After a create or a delete of ``board_id``: fetches under way keep nothing, and later
        lookups and lists do not join them."""
        self.changes += 1
        self._writes.forget(board_id)
        self._reads.forget(board_id)
        self._lists.forget("")
        self._listing = None

    async def run(self) -> None:
        """``follow`` every ``follow_s`` until ``closed``. A failure (Redis unreachable, a timeout)
        is logged as an ``Outage`` (a few lines an hour) and the next look comes at its time: the
        copies meanwhile expire after ``ttl_s``, as before the version was followed. A look that finds
        no registry permit free (``Gate.spare``) is skipped: requests first."""
        while not self.closed:
            try:
                await self.follow()
            except Overloaded:
                pass
            except (RedisError, RedisClusterException, OSError) as e:
                self.outage.failed(e)
            except Exception as e:  # a bug: logged with its trace, as seldom, and the loop goes on
                self.outage.failed(e, trace=True)
            else:
                self.outage.succeeded()
            await asyncio.sleep(self.follow_s)

    async def follow(self) -> None:
        """Read the registry's version (a GET, through the registry gate); when it moved, expire
        the kept copies of the boards whose records changed: those the change log names
        (``BoardStore.moved``, as far back as it chains), and, when it cannot say all, those whose
        record differs from the one kept (``_compare``, at most every ``RECHECK_S_PER_BOARD`` per
        board compared: it is owed until then, and made at a look even if nothing moved since). An
        expired copy stays kept for the kept lane; the next request fetches it (single flight).
        Fetches under way of the boards changed (of every board, when the log cannot say) keep
        nothing, and requests from then on do not join them: what they read may be from before the
        move."""
        with self.gate.spare():  # never queued ahead of requests' fetches: skipped (``run``)
            version = await self.store.version()
        if version != self._seen:
            if self._seen is _UNREAD:
                self._owed = True  # the first look: nothing is known (nothing is kept yet)
            else:
                with self.gate.spare():
                    version, changed, named = await self.store.moved(self._seen)
                # What the log names is taken in at once, even past a move it lacks (a gap).
                await self._expire(named, version)
                if changed is None:
                    # A gap: any board may have changed. Any may have been created (none is
                    # remembered missing any more), and the records kept are compared, in turn.
                    self.missing.clear()
                    self._owed = True
            self._seen = version
        if self._owed and time.monotonic() >= self._recheck_by:
            await self._compare()

    async def _expire(self, changed: set[str], version: Any) -> None:
        """Expire the kept copies of the boards ``changed`` (the change log named them) whose record
        now differs from the one kept (one HMGET of those kept, ``BoardStore.held``), take them off
        the missing memory, and have their fetches under way keep nothing unless they read the
        registry at ``version``, the one the log named them through (``_moved_since``). A
        copy fetched after the change (this router's own create, a board fetched since) is kept,
        and so is what was built of it (its cached top, its ETag): until 2026-12-06 every copy
        named expired, and a board this router had just created was fetched again and its top read
        again from every shard. The names are bounded: past MAX_BOARDS the move is taken as one
        the log could not name."""
        if not changed:
            return
        # The copies to compare, and the fetches under way marked, before the HMGET: a fetch that
        # ends while it is read keeps nothing (it may have read the record before the change).
        compared = {i: self._kept[i] for i in sorted(changed) if i in self._kept}
        if len(self._named) + len(changed) > MAX_BOARDS:
            self._moved(version)
        else:
            self.moves += 1
        for board_id in changed:
            self._named[board_id] = (self.moves, version)
            self._writes.forget(board_id)
            self._reads.forget(board_id)
            self.missing.pop(board_id, None)
        records: list[Any] = []
        if compared:
            with self.gate.spare():  # refused: the next look reads the move again and compares
                records = await self.store.held(list(compared))
        for (board_id, kept), record in zip(compared.items(), records, strict=True):
            if self._kept.get(board_id) is kept and record != kept[1].record:
                self._kept[board_id] = (-math.inf, kept[1])

    async def _compare(self) -> None:
        """The comparison a gap owes: the records kept unexpired against the registry's, those that
        differ expired; fetches under way keep nothing. Their digests first (``BoardStore.digests``,
        about 20 bytes a board), then the records of those whose digest is not their copy's (an
        HMGET, ``BoardStore.held``). The next one no sooner than ``RECHECK_S_PER_BOARD`` per board
        compared."""
        now = time.monotonic()
        compared = {i: k for i, k in self._kept.items() if now - k[0] < self.ttl_s}
        ids = sorted(compared)
        records = []
        # The permit first: a look the gate refuses discards nothing (the next one compares).
        with self.gate.spare() if ids else contextlib.nullcontext():
            self._moved(self._seen)
            self.missing.clear()
            if ids:
                digests = await self.store.digests(ids)
                # Each copy's digest is made once, not at every comparison (2,000: 2-3 ms).
                made, self._digests = self._digests, {}
                for board_id in ids:
                    board = compared[board_id][1]
                    held = made.get(board_id)
                    if held is None or held[0]() is not board:
                        held = (weakref.ref(board), digest(board.record))
                    self._digests[board_id] = held
                pairs = zip(ids, digests, strict=True)
                ids = [i for i, d in pairs if d is None or d != self._digests[i][1]]
                records = await self.store.held(ids) if ids else []
        self._owed = False
        self._recheck_by = time.monotonic() + len(compared) * RECHECK_S_PER_BOARD
        for board_id, record in zip(ids, records, strict=True):
            # A copy kept since was fetched after ``_moved``: newer than the record compared.
            if self._kept.get(board_id) is compared[board_id] and record != compared[board_id][1].record:
                self._kept[board_id] = (-math.inf, compared[board_id][1])

    def _moved(self, version: Any) -> None:
        """A move of the version that may have changed any record is being taken in, through
        ``version``: fetches under way keep nothing (unless they read that version), and later
        lookups do not join them."""
        self.moves += 1
        self._unnamed = (self.moves, version)
        self._named.clear()  # what they say, this says of every board
        self._writes.clear()
        self._reads.clear()

    def _moved_since(self, board_id: str, moves: int, version: Any) -> bool:
        """Whether a move taken in after ``moves`` (``self.moves`` when a fetch began) may have
        changed the record of ``board_id`` that the fetch read at the registry's ``version``
        (``Board.record_version``; ``_UNREAD``: not known): one the change log named it in, or one
        it could not name, unless the fetch read the very version that move was taken in through
        (then it holds every change taken in; the fetch of a board created elsewhere, read while
        ``follow`` took the creation in, is the common one). A fetch that read a version between
        is taken as older: versions are drawn, not ordered."""
        for taken, through in (self._unnamed, self._named.get(board_id, (0, _UNREAD))):
            if taken > moves and (version is _UNREAD or version != through):
                return True
        return False

    def _missing(self, board_id: str) -> None:
        self.missing.pop(board_id, None)
        self.missing[board_id] = time.monotonic()
        while len(self.missing) > self.max_missing:
            self.missing.popitem(last=False)
