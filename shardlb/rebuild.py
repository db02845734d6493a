"""Rebuild: a board recomputed from PostgreSQL and its journals, swapped in shard by shard.

For each home shard, one after another (the design and its reasons: docs/design-notes.md,
"Rebuild and reconcile"):

1. ``mark`` (shardlb/scripts/rebuild.lua) notes the journal's position X: every result the shard
   applied so far has a journal id <= X, every later one a larger id.
2. The snapshot is every result up to X: the journal's entries up to X, then the shard's rows of
   ``match_results``. The journal is read first: an entry trimmed meanwhile was trimmed only after
   the archiver committed it, so it is among the rows read after. An incr board takes only rows with
   ids <= X (it counts each result once); best and set take every row (applying a result twice
   changes nothing for them).
3. ``Fold`` folds the snapshot per period by the board's rule and the boards go into temporary keys
   in the shard's slot (``<prefix>tmp:<token>:<period>``, expiring in an hour should the rebuild die).
4. ``swap`` RENAMEs them over the live keys in one call, but only while the journal is still at X.
   Otherwise the new entries are read and sent with the next attempt, which applies them to the
   temporary keys first: the live board goes from its state at X' to the rebuilt state at X' in one
   atomic call, and readers never see an empty or partial board. After ``swap_tries`` attempts the
   swap is forced, and the few results written between the last attempt and the swap are applied to
   the live keys right after it, each once (``Rebuilder._apply_live``: what a removal since the
   swap wiped on the live keys stays wiped, and a post since the swap stays). The swap sets a
   marker that the apply checks in its call (a failover can lose the swap and keep the board as it
   was, those results on it already), and the apply waits for a replica wherever the primary has
   one, which has the swap before it then too.
   ``swap`` first checks every temporary key's size against what was filled (a failover can lose
   the fill while the journal stays at X, and a missing key would unlink a live board); when one
   differs it changes nothing but drop them, and the shard is filled again from step 1
   (``FILL_TRIES`` times, then ClusterUnavailable).

After a total loss (``Rebuilder.restore``, `rebuild --all`), each swap, and what the shard's
rebuild writes on the live keys after it, wait for a replica of the shard's primary wherever it has
one, each call with its own marker and WAIT (``Rebuilder._acked``), as the ban list and the
registry's records written back do. A rebuild of named boards swaps on the primary alone, but the
apply after a forced swap waits too (``Rebuilder._apply_live``). `rebuild --all` takes ``jobs``
boards side by side (`--jobs`, 4 by default), each on a PostgreSQL connection of its own
(``Rebuilder.recover``): the restore's per-board work (``_restore_board``, then the board's record
confirmed), and each board's rebuild once its own record is confirmed, by the first task with no
board left to restore; the shards of one board go in order as above, and every ordering rule of
one board holds as when the boards went one after another (``side_by_side``: an error in one).

Before any shard, ``start_journal`` gives each journal a last-generated id past the newest id
PostgreSQL holds of its shard: a journal lost with Redis is made again from a clock that may be
behind the lost node's, and PostgreSQL orders the shard's rows by journal id (docs/design-notes.md,
"Clocks"). Before step 1, ``refill`` puts back the shard's retry records of the dedup window
(``RetryRecords``: an incr board's dedup sets, a best or set board's pins) that a loss of Redis
took, so a result sent again after the rebuild is answered as before the loss. Band boards then
rebuild their band shards from the rebuilt totals (``rebuild_bands``). After the swap, a board
with ``inactive_after`` gets its activity set back from the snapshot (``recall_activity``).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple, TypeVar

import msgpack
import orjson
import psycopg
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from shardlb import keys, moderation, periods, pgconn, times
from shardlb.bands import Move
from shardlb.board import GONE, MOVED, Board, band_shards, rebuilding
from shardlb.config import PIN_SPAN, REBUILD_JOBS, BoardConfig, stored_settings
from shardlb.connection import Script, Scripts, connect
from shardlb.errors import (
    ArchiveUnprepared,
    BoardConflict,
    BoardNotFound,
    ClusterUnavailable,
    InvalidInput,
    NotAcknowledged,
)
from shardlb.fanout import Ack, AckedScript, batch, confirmed
from shardlb.journal import Applied, Entry, decode
from shardlb.reads import View
from shardlb.reshard_copy import REPLICA_WAIT_MS, Replicated
from shardlb.store import GONE_MS, BoardStore, not_rebuilt

Id = tuple[int, int]  # a journal entry id, (ms, seq): ordered as Redis orders them
# A removal of a player (a delete entry, or its row of ``player_removals``): its journal id, and the
# periods whose entry of the player it left whole (``Entry.kept_in``; None: none, as most do).
Cut = tuple[Id, frozenset[str] | None]
Cuts = dict[str, list[Cut]]  # player -> their removals
SEQ_MAX = 2**64 - 1
START: Id = (0, 0)  # before every journal entry
TMP_TTL_MS = 3_600_000
SWAP_TRIES = 50
FILL_TRIES = 3  # fills of a shard's temporary keys before a rebuild gives up (see rebuild_shard)
# rebuild.lua ops that wait for a replica once ``confirming``
CONFIRMED = ("swap", "apply", "recall", "start")
PAGE = 2000
DAY_MS = 86_400_000
# A result sent without achieved_at was given its arrival as its time; the journal does not say which
# results were, so a pin is put back for each whose achieved time is within its time unit plus this of
# its arrival (the router's clock against Redis's, a call's queueing and client retries; see
# RetryRecords). A minute, the skew of clocks the design covers (docs/design-notes.md, "Clocks"):
# until 2026-12-05 10 s, and a router 30 s off Redis's clock got none of its pins back.
PIN_SLACK_MS = 60_000
_PERIOD = re.compile(r"total|[dwm]:.+")


def parse_id(value: Any) -> Id:
    text = value.decode() if isinstance(value, bytes) else str(value)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


async def _unrestored(store: BoardStore, former: Board, refilled: list[str]) -> None:
    """Drop what a restore put back of ``former`` (its retry records in ``refilled`` shards, and the
    closing markers of every shard, written before it was registered) when the registry ends up
    holding another board of its id: that incarnation is no board now, and nothing else would ever
    drop its keys. drop.lua on every shard of it, as a deletion's (``gone`` for a day)."""
    if not refilled:
        return
    for prefix in former.prefixes:
        await store.scripts.drop(keys=[keys.index_key(prefix), keys.gone_key(prefix)], args=[GONE_MS])


def _hidden(board_id: str, held: str, archived: Sequence[str]) -> str:
    """What `rebuild --all` says of a board created again before it restored the archive's: the
    two ways out."""
    names = ", ".join(archived)
    quoted = ", ".join(f"'{i}'" for i in archived)
    return (
        f"board {board_id!r}: the registry holds incarnation {held}, and the archive holds {names} "
        f"too, never deleted: the board was created again since Redis lost it (a PUT before "
        f"`rebuild --all`?), and {names} is not restored. To restore it, DELETE "
        f"/v1/boards/{board_id} (what was written to {held} goes with it) and run `shardlb rebuild "
        f"--all` again; to keep {held}, mark the archived one deleted: UPDATE boards SET "
        f"deleted_at = now() WHERE board = '{board_id}' AND incarnation IN ({quoted})"
    )


def format_id(entry_id: Id) -> str:
    return f"{entry_id[0]}-{entry_id[1]}"


def period_expiry(board: Board, name: str) -> int:
    """When a period board's key expires (epoch ms; 0 for the total): its end plus its retention."""
    if name == "total":
        return 0
    kind = periods.first_day(name)[0]
    return (
        periods.end_ms(name, board.tz, board.config.week_start) + board.config.retention_days[kind] * DAY_MS
    )


def checked(board: Board, period: str | None, shard: int | None, now_ms: int) -> str | None:
    """The period board a rebuild of ``board`` writes (``period``, an API period, as a key's name;
    None: all) with ``shard`` (None: all), or InvalidInput when the board has no such period or shard."""
    c, layout = board.config, board.layout
    name = None if period is None else periods.parse(period, c.periods, board.tz, now_ms, c.week_start)
    if shard is not None and not 0 <= shard < layout.physical:
        raise InvalidInput(f"board {c.id!r}: shard must be from 0 to {layout.physical - 1}", "shard")
    if shard is not None and shard >= c.sharding.shards and name not in (None, "total"):
        raise InvalidInput(f"board {c.id!r}: shard {shard} is a band shard: it holds the total only", "shard")
    return name


def wanted_periods(board: Board, period: str | None, now_ms: int) -> Callable[[str], bool]:
    """Which period boards a rebuild writes: ``period`` alone when given, and no dated period past
    its retention (its key is gone or going; a rebuild must not bring it back)."""

    def keep(name: str) -> bool:
        if period is not None and name != period:
            return False
        return name == "total" or period_expiry(board, name) > now_ms

    return keep


def added(old: tuple[int, int] | None, points: int, units: int) -> tuple[int, int]:
    """An incr entry (points, time units) after one more result, write.lua's rule: the sum, at the
    latest time among the results that scored; while nothing has scored (a sum of 0, as points are
    never negative), at the earliest result's time. A property of the set of results, so a fold in
    any order gives what the board holds (docs/design-notes.md, "Writes")."""
    if old is None or (old[0] == 0 and (points > 0 or units < old[1])):
        return points, units
    if points > 0:
        return old[0] + points, max(old[1], units)
    return old


class Fold:
    """One shard's period boards folded from results in any order by the board's rule: write.lua's
    rule in a form that does not depend on order (best: the highest score; set: the latest time,
    then the highest score; incr: ``added``)."""

    def __init__(self, board: Board, wanted: Callable[[str], bool]) -> None:
        self.mode = board.config.mode
        self.codec = board.codec
        self.boards: dict[str, dict[str, Any]] = {}
        self._periods_at = board.periods_at  # the write path's own cache of local days
        self._wanted = lru_cache(maxsize=4096)(lambda names: tuple(n for n in names if wanted(n)))
        # The local day of the result named last, [lo, hi) in epoch ms, with its wanted periods: a
        # shard's results come a day after another (the journal's, the rows in the table's order),
        # and the look-ups of the day and of its wanted periods were a tenth of the rebuilding
        # process's CPU (2026-12-06).
        self._day: tuple[int, int, tuple[str, ...]] = (0, 0, ())

    def names(self, r: Applied) -> tuple[str, ...]:
        """The wanted period boards result ``r`` counts in: those of its achieved time but the closed
        or frozen ones the board skipped when it applied ``r`` (as journaled)."""
        at = self.codec.units_to_ms(r.units)
        day = self._day
        if not day[0] <= at < day[1]:
            lo, hi, every = self._periods_at(at)
            day = self._day = (lo, hi, self._wanted(every))
        return tuple(n for n in day[2] if n not in r.skipped) if r.skipped else day[2]

    def add(self, r: Applied) -> None:
        player, boards = r.player_id, self.boards
        if self.mode == "incr":
            for name in self.names(r):
                board = boards.get(name)
                if board is None:
                    board = boards[name] = {}
                board[player] = added(board.get(player), r.points, r.units)
            return
        score = self.codec.encode_units(r.points, r.units)
        value: Any = score if self.mode == "best" else (r.units, score)
        for name in self.names(r):
            board = boards.get(name)
            if board is None:
                board = boards[name] = {}
            old = board.get(player)
            if old is None or value > old:
                board[player] = value

    def scores(self, name: str) -> dict[str, int]:
        """The period board ``name`` as player -> encoded score."""
        board = self.boards.get(name, {})
        if self.mode == "best":
            return dict(board)
        if self.mode == "set":
            return {p: v[1] for p, v in board.items()}
        return {p: self.codec.encode_units(*v) for p, v in board.items()}


class RetryRecords:
    """The records write.lua keeps of one shard's results for the board's dedup window, to put back
    after a loss of Redis (``Rebuilder.refill``), batched into rebuild.lua's ``recall`` calls.

    - incr: the dedup sets. A result's member (match_id NUL player_id) goes into the bucket of its
      arrival, the time part of its journal id (write.lua used the router's clock of the same call),
      if that bucket is still looked up: buckets from (now - window) // length on, each expiring at
      (k + 1) x length + window.
    - best and set: the pins of results sent without achieved_at (their first server time, which
      their retries get again). The journal does not say which results those were; a server time is
      its arrival, so a result whose achieved time is within its time unit plus PIN_SLACK_MS of its
      arrival is taken as one. A result sent with a time that close gets a pin too, which only ever
      gives a retry of it sent without a time that same time. A result applied again before the loss
      (a retry: PostgreSQL keeps the later journal id of a best or set result) may be missed, and its
      next retry then takes its own arrival as its time, as every retry did before pins came back.
      Each pin goes into the hash of PIN_SPAN buckets named by its first, expiring at
      (first + PIN_SPAN) x length + window.

    An incr board keeps no pins here: a retry of it is a duplicate whatever its time, and its dedup
    sets already cost a window of memory (README, "Memory").

    - every mode: the removals of the window (``removed``: remove.lua's ``rmv``, player -> the
      removal's time units, the latest removal of a player kept; the hash expires a window after
      its latest removal), so a retry of a removed player's result stays a duplicate, and the
      records of the removals named by a request (``requested``: request NUL player -> as
      remove.lua wrote it, the first kept), so the request sent again changes nothing; and where
      their delete entries are (``named``, ``asked``, written by ``place``), so a removal that
      finds the player gone, or the request sent again, reads one entry, not the journal."""

    def __init__(self, board: Board, prefix: str, now_ms: int) -> None:
        c = board.config
        self.prefix = prefix
        self.incr = c.mode == "incr"
        self.length, self.window = c.dedup_bucket_ms, c.dedup_window_s * 1000
        self.codec = board.codec
        self.slack = board.codec.unit_ms + PIN_SLACK_MS
        first = (now_ms - self.window) // self.length  # the first bucket write.lua looks up now
        self.first, self.first_pin = first, first - first % PIN_SPAN
        self.removals_since = now_ms - self.window  # a removal's record lives a window
        # ``named``: player -> ((removed, id), entry id, units, at ms); ``asked``: (request, player)
        # -> (entry id, units, at ms). Kept across batches, written by ``place``.
        self.positions: dict[str, tuple[tuple[bool, Id], str, int, int]] = {}
        self.firsts: dict[tuple[str, str], tuple[str, int, int]] = {}
        self._clear()

    def _clear(self) -> None:
        self.names: dict[str, int] = {}
        self.pin: list[int] = []
        self.expiry: list[int] = []
        self.items: list[Any] = []
        # A dedup bucket's or pin hash's number in this batch, by its bucket (``_bucket``).
        self.buckets: dict[int, int] = {}

    @property
    def since_ms(self) -> int:
        """The earliest arrival a record of the window can have."""
        records = self.first * self.length if self.incr else self.first_pin * self.length - self.slack
        return min(records, self.removals_since)

    def removed(self, at_ms: int, player_id: str, units: int) -> None:
        """A removal's record of ``player_id`` (``units``, as remove.lua made it) journaled at
        ``at_ms``, if still in the window."""
        if at_ms < self.removals_since:
            return
        self._put(keys.removals_key(self.prefix), 2, at_ms + self.window, player_id, units)

    def requested(self, at_ms: int, request: str, player_id: str, mark: str) -> None:
        """A removal request's record of ``player_id`` (``mark``, as remove.lua made it: ``Entry.marks``)
        journaled at ``at_ms``, if still in the window: the request sent again changes nothing."""
        if at_ms < self.removals_since:
            return
        field = keys.removal_request_field(request, player_id)
        self._put(keys.removals_key(self.prefix), 2, at_ms + self.window, field, mark)

    def named(self, entry_id: str, at_ms: int, player_id: str, removed: bool, units: int) -> None:
        """A delete entry of the window journaled at ``at_ms`` that names ``player_id`` (``removed``:
        it removed them; ``units``: the record it made of them). remove.lua's NUL <player> names
        the latest entry that removed the player there, or, while none did, one that named them
        (nothing of theirs to look for); so does ``place``'s, among the entries the refill reads:
        the journal's (an entry not archived among them) and PostgreSQL's (archived: a removal that
        reads it finds nothing, or the entry archived already), its units the player's record's."""
        if at_ms < self.removals_since:
            return
        key, held = (removed, parse_id(entry_id)), self.positions.get(player_id)
        if held is None or key > held[0]:
            self.positions[player_id] = (key, entry_id, max(units, held[2] if held else units), at_ms)
        else:
            self.positions[player_id] = (*held[:2], max(units, held[2]), held[3])

    def asked(self, entry_id: str, at_ms: int, request: str, player_id: str, units: int) -> None:
        """The delete entry of the removal ``request`` (its ``units``) that recorded ``player_id``,
        journaled at ``at_ms``: the first kept, as its record is (``requested``)."""
        if at_ms < self.removals_since:
            return
        held = self.firsts.get((request, player_id))
        if held is None or parse_id(entry_id) < parse_id(held[0]):
            self.firsts[(request, player_id)] = (entry_id, units, at_ms)

    def place(self) -> None:
        """Where the delete entries ``named`` and ``asked`` are, into the batch (HSETNX: a removal
        made since wrote its own)."""
        key = keys.removals_key(self.prefix)
        for player, (_, entry_id, units, at_ms) in self.positions.items():
            value = keys.removal_position_value(units, entry_id)
            self._put(key, 2, at_ms + self.window, keys.removal_position_field(player), value)
        for (request, player), (entry_id, units, at_ms) in self.firsts.items():
            field = keys.removal_request_position_field(request, player)
            self._put(key, 2, at_ms + self.window, field, keys.removal_position_value(units, entry_id))
        self.positions.clear()
        self.firsts.clear()

    def arrived(self, player_id: str, at_ms: int) -> None:
        """The activity set's entry of ``player_id`` (``Rebuilder.recall_activity``)."""
        self._put(keys.activity_key(self.prefix), 3, 0, player_id, at_ms)

    def add(self, arrived_ms: int, match_id: str, player_id: str, units: int) -> None:
        member = f"{match_id}\x00{player_id}"
        if self.incr:
            k = arrived_ms // self.length
            if k >= self.first:
                self.items += [self.buckets.get(k) or self._bucket(k), member, 0]
            return
        achieved = self.codec.units_to_ms(units)
        if abs(arrived_ms - achieved) > self.slack:
            return
        k = achieved // self.length
        start = k - k % PIN_SPAN
        if start >= self.first_pin:
            self.items += [self.buckets.get(start) or self._bucket(start), member, units]

    def _bucket(self, k: int) -> int:
        """The number of bucket ``k``'s dedup set (incr) or of the pin hash it starts (best, set),
        its key named once a batch (``buckets``): the results of a batch fall in a few buckets, and
        naming the key of each was a tenth of ``refill``'s CPU (2026-12-06)."""
        if self.incr:
            name, pin, expiry = keys.dedup_key(self.prefix, k), 0, (k + 1) * self.length + self.window
        else:
            name, pin, expiry = keys.pin_key(self.prefix, k), 1, (k + PIN_SPAN) * self.length + self.window
        number = self.buckets[k] = self._number(name, pin, expiry)
        return number

    def _put(self, name: str, pin: int, expiry: int, member: str, units: int | str) -> None:
        self.items += [self._number(name, pin, expiry), member, units]

    def _number(self, name: str, pin: int, expiry: int) -> int:
        """Key ``name``'s number in this batch (from 1), listed with ``pin`` and ``expiry`` the first
        time; a removals hash expires at the latest of its records' ``expiry``."""
        number = self.names.get(name)
        if number is None:
            self.pin.append(pin)
            self.expiry.append(expiry)
            number = self.names[name] = len(self.names) + 1
        self.expiry[number - 1] = max(self.expiry[number - 1], expiry)
        return number

    def __len__(self) -> int:
        return len(self.items) // 3

    def take(self) -> tuple[list[str], bytes, bytes]:
        """The batch as rebuild.lua's ``recall`` takes it (bucket keys, header, records); empties it."""
        header = msgpack.packb([PIN_SPAN if 1 in self.pin else 0, self.pin, self.expiry])
        batch = list(self.names), header, msgpack.packb(self.items)
        self._clear()
        return batch


class Mark(NamedTuple):
    """A shard's journal position: ``last`` its last-generated id as Redis spells it; every result
    applied so far has an id <= ``position``, every later one a larger id; ``first`` the id of its
    first entry (None when it has none): every entry before it was archived and trimmed."""

    last: str
    position: Id
    first: Id | None


# Rows of a board whose shards ``_check_rows_layout`` compares with its layout before a rebuild.
LAYOUT_SAMPLE = 1000


class Snapshot(NamedTuple):
    mark: Mark
    rows: int  # results taken from PostgreSQL
    journal: int  # results taken from the journal
    # inactive_after boards: player -> the latest arrival of their results (their journal ids' time)
    arrivals: dict[str, int]


@dataclass
class ShardReport:
    shard: int
    players: int = 0  # on the rebuilt board after the swap (the total, or the one period rebuilt)
    rows: int = 0  # results read from PostgreSQL
    journal: int = 0  # results read from the journal, the snapshot's and those caught up
    retries: int = 0  # results whose retry records (dedup members, pins) ``refill`` put back
    tries: int = 0  # swap attempts (more than one when writes moved the journal meanwhile)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "players": self.players,
            "rows": self.rows,
            "journal": self.journal,
            "tries": self.tries,
            "seconds": round(self.seconds, 3),
        }


class Rebuilder:
    """Rebuilds boards of one cluster from one PostgreSQL archive; see the module docstring.

    ``client`` must leave replies as bytes (``connect(url, decode=False)``: journal entries carry
    MessagePack) and ``script`` is rebuild.lua on that client (``Scripts.register(client).rebuild``).
    ``progress`` gets a line per shard.
    """

    def __init__(
        self,
        client: RedisCluster,
        script: Script,
        db: psycopg.AsyncConnection[Any],
        progress: Callable[[str], None] | None = None,
        swap_tries: int = SWAP_TRIES,
        jobs: int = 1,
        connect: Callable[[], Awaitable[psycopg.AsyncConnection[Any]]] | None = None,
    ) -> None:
        self.client = client
        self.script = script
        self.db = db
        self.progress = progress or (lambda _: None)
        self.swap_tries = swap_tries
        # Boards ``restore`` and ``rebuild_all`` take side by side, each on a PostgreSQL connection
        # of its own that ``connect`` opens (without it, one at a time on ``db``): see ``_workers``.
        self.jobs = jobs
        self.connect = connect
        self.replica_wait_ms = REPLICA_WAIT_MS  # ``restore``'s waits for a replica (``confirming``)
        # Set by ``restore`` (a total loss: what a swap writes is then the whole board): from then
        # on each swap waits for a replica of its shard's primary, wherever it has one.
        self.confirming: Replicated | None = None
        # Which primaries have replicas, for the calls that wait whatever ``confirming`` says (the
        # apply after a forced swap); read when first needed.
        self._replicated: Replicated | None = None
        # Shards (prefixes) whose journals ``restore`` started and whose retry records it put back:
        # their next rebuild skips both (``start_journal``, ``refill``).
        self._refilled: set[str] = set()
        # Boards ``restore`` left out because the registry holds an incarnation created since the
        # loss beside the archive's (``_restore_board``): ``recover`` names them once it is done.
        self._passed_over: list[str] = []

    async def rebuild(
        self, board: Board, period: str | None = None, shard: int | None = None, force: bool = False
    ) -> list[ShardReport]:
        """Rebuild ``board`` (one API period such as ``daily:2026-11-30`` or all, one shard or all).
        Shards are rebuilt one after another; each swap is atomic on its shard, the board as a whole
        is not rebuilt at one instant (a read across shards may see some rebuilt and some not yet).
        Refused (BoardConflict) when the archive holds no result of the board while Redis holds
        players, unless ``force``: that archive is not this board's (see ``_check_archive``)."""
        if board.moving or board.also:
            raise _resharding(board)
        await self.check_layout(board)
        if board.config.durability != "journal":
            raise BoardConflict(
                f"board {board.config.id!r} keeps no journal (durability memory): nothing to rebuild it from",
                "board",
            )
        await self._check_rows_layout(board)
        if not force:
            await self._check_archive(board)
        layout = board.layout
        now = times.now_ms()
        name = checked(board, period, shard, now)
        homes = range(board.config.sharding.shards)
        wanted = wanted_periods(board, name, now)
        chosen = homes if shard is None else [s for s in [shard] if s in homes]
        bands = range(board.config.sharding.shards, layout.physical)
        banded = layout.strategy == "band" and name in (None, "total")
        if banded and (await self._homes_waiting(board)).difference(chosen if name is None else ()):
            # A home shard not rebuilt (marked, or lost and not marked yet) gives the band shards
            # none of its players: marked first, they are refused until the last home's rebuild.
            await self._hold_bands(board, bands)
        for home in chosen:  # all first: the rebuild of one takes a while, and writes go on
            if board.prefixes[home] not in self._refilled:  # else ``restore`` started it just now
                await self.start_journal(board, home)
        reports = []
        for home in chosen:
            reports.append(await self.rebuild_shard(board, home, wanted))
            if name is None:  # every period of the shard rebuilt: its reads and writes are exact
                await self._built(board, [home])
        # A band board's band shards index the totals: rebuilt whenever a total may have changed,
        # and exact once no home shard waits (with --shard, the others may still be empty): until
        # then they are marked (``_hold_bands``), also when a home was lost meanwhile.
        every = shard is None and name is None  # every shard given its sentinel (``_built``)
        if banded:
            reports += await self.rebuild_bands(board)
            waiting = await self._homes_waiting(board)
            if waiting:
                await self._hold_bands(board, bands)
            if name is None and not waiting:
                await self._built(board, bands)
            else:
                every = False
        if every:  # a board of the release before carries sentinels from now on
            await BoardStore(board.client, board.scripts).carry(board)
        return reports

    async def _homes_waiting(self, board: Board) -> set[int]:
        """A band board's home shards that are not rebuilt: those the record (read now) or the Board
        marks, and, on a board whose shards carry sentinels, those without one (lost, the archiver's
        mark still to come). A band shard rebuilt now would miss their players."""
        homes = range(board.config.sharding.shards)
        waiting = set((board.rebuilding | await self._marked(board)).intersection(homes))
        if board.sentinels:
            absent = await self._absent([board.prefixes[h] for h in homes])
            waiting |= {h for h in homes if board.prefixes[h] in absent}
        return waiting

    async def _hold_bands(self, board: Board, bands: Iterable[int]) -> None:
        """Mark a band board's band shards not rebuilt (``BoardStore.unbuilt``) before they are
        rebuilt from a home shard that is not: until 2026-12-06 they were not, and after `rebuild
        BOARD --shard 1` of a board that lost home shards 1 and 2 the top was served from band
        shards holding no player of shard 2, without an error, until `--shard 2`
        (tests/test_shard_loss.py). Their mark goes with the rebuild after which no home waits."""
        bands = set(bands)
        await BoardStore(board.client, board.scripts).unbuilt(board, bands)
        board.rebuilding = board.rebuilding | bands

    async def _built(self, board: Board, shards: Iterable[int]) -> None:
        """Take ``shards``, rebuilt whole, off the shards the board's record names not rebuilt
        (``BoardStore.rebuilt``: after a loss of Redis, ``_restore_board`` marked them all; after
        a loss of their slots alone, the archiver, ``BoardStore.lost``). Their sentinels first
        (keys.sentinel_key): the shards hold their data again, and a mark the archiver makes from
        here on is taken back by it (``lost``). The record's mark is read anew, not the Board's:
        the archiver may have marked a shard since this rebuild fetched the board. The sentinels
        that were not there before (a shard lost), those of the shards whose marks go, and every
        one of a board whose record does not say yet that its layout carries them (a board of the
        release before, whose whole rebuild then says so: ``BoardStore.carry``) are confirmed on a
        replica first (``_confirm_sentinels``); one that was there all along is not waited for: a
        failover that loses the SET leaves it there. Earlier on 2026-12-06 a board of the release
        before had only those missing confirmed, so a run after one that came short
        (NotAcknowledged) found them there, waited for no replica and wrote the record's word:
        a failover then lost the sentinels and the archiver marked the healthy shards."""
        shards = list(shards)
        prefixes = [board.prefixes[s] for s in shards]
        await self._settled_again(board, shards)
        store = BoardStore(board.client, board.scripts)
        absent = await self._absent(prefixes) if board.sentinels else set(prefixes)
        await store.sentinels(prefixes)
        done = (board.rebuilding | await self._marked(board)).intersection(shards)
        new = [p for s, p in zip(shards, prefixes, strict=True) if s in done or p in absent]
        await self._confirm_sentinels(new)
        if done:
            await store.rebuilt(board.config.id, board.incarnation, done)
            board.rebuilding = board.rebuilding - done

    async def _absent(self, prefixes: Sequence[str]) -> set[str]:
        """Of ``prefixes``, those whose shard's sentinel is missing now (one EXISTS each, one
        pipeline per node)."""
        found = batch(self.client)
        for prefix in prefixes:
            found.execute_command("EXISTS", keys.sentinel_key(prefix))
        return {p for p, there in zip(prefixes, await found.execute(), strict=True) if not there}

    async def _confirm_sentinels(self, prefixes: Sequence[str]) -> None:
        """Confirm the sentinels ``_built`` wrote on a replica, wherever the shard's primary has one,
        whatever SHARDLB_ACK says: per node one pipeline of their EXISTS, the marker and WAIT, up to
        ``replica_wait_ms`` (``fanout.confirmed``). The marker is written after the sentinel, and
        the sentinel after the swap, so a replica that has the marker has both (a replica applies
        its primary's writes in order). Until 2026-12-06 they were not confirmed (with
        SHARDLB_ACK=primary, a rebuild of a named board): a failover right after the rebuild
        lost the sentinel of a shard whose swap the replica had, and the archiver marked the
        healthy shard again, its writes refused (SHARDLOST) until another rebuild. A sentinel found
        missing is not written again (a failover lost it, and maybe the swap with it: the shard
        may be as empty as before): NotAcknowledged, and the shard keeps its mark until the
        rebuild runs again, as for a WAIT that came short."""
        replicated = self._replicated = self._replicated or Replicated(self.client)
        await replicated.read()
        names = [n for n in map(keys.sentinel_key, prefixes) if replicated(n)]
        if not names:
            return
        replies = await confirmed(self.client, Ack(1, self.replica_wait_ms), [("EXISTS", n) for n in names])
        for name, reply in zip(names, replies, strict=True):
            if isinstance(reply, NotAcknowledged):
                with suppress(RedisError):  # the replicas' flags as they are now, if it can
                    await replicated.read(again=True)
                raise NotAcknowledged(
                    f"no replica confirmed the rebuild's sentinel {name!r} within {self.replica_wait_ms} "
                    f"ms on {replicated.describe(name)}: a failover could lose it, and the shard be "
                    "taken for lost again. A shard marked not rebuilt stays marked: run the rebuild "
                    "again once that replica is in sync with its primary; a replica gone for good is "
                    "waited for until an operator removes it (CLUSTER FORGET its id on every node)"
                ) from reply
            if isinstance(reply, BaseException):
                raise reply
            if not reply:
                raise NotAcknowledged(
                    f"the rebuild's sentinel {name!r} was lost before a replica had it (a failover?), "
                    "and the shard's rebuild may have gone with it. A shard marked not rebuilt stays "
                    "marked: run the rebuild again"
                )

    async def _settled_again(self, board: Board, shards: list[int]) -> None:
        """The markers of the board's settlements of periods still kept (``Board.
        settled_again``) put back on ``shards``, before their mark is taken off: Redis lost them
        with the shards. The freeze: no write applies to the period there. The record of a payment
        (``Board.mark_paid``): a settlement of the period is refused (409 period_settled) once
        PostgreSQL is restored from a backup taken before it (shardlb/settlement.py, ``_not_lost``).
        Until 2026-12-06 neither came back: after a loss of Redis and `rebuild --all`, a period paid
        before it was paid again, under another id or the same one, by a run after such a restore
        (tests/test_settlement_recovery.py). The total's (a season archive begun, its board not
        deleted yet) too: its freeze closed the board for good (``Board.close``); until 2026-12-06
        a shard lost alone and rebuilt (`rebuild BOARD --shard N`) took results again, the other
        shards refusing them (``_restore_board`` closed it again after a total loss only)."""
        async with self.db.transaction():
            begun = await _freeze_begun(self.db)
            if begun is None:
                return
            cur = await self.db.execute(
                f"SELECT period, settlement_id, state, {begun} FROM settlements "
                "WHERE board = %s AND incarnation = %s",
                (board.config.id, board.incarnation),
            )
            rows = await cur.fetchall()
        now = times.now_ms()
        for name, settlement_id, state, froze in rows:
            if board.holds_nothing(name, now):  # past its retention its keys have expired
                continue
            # A dated period is closed when it is settled, so its freeze changes no write. The
            # total is not: a season archive refused before its freeze (a shard lost, a reshard)
            # left its row `started` and the board open, and its close comes back only where the
            # archive closed the board, or past its check (settled, or stopped at a mismatch).
            # PostgreSQL tells it first (``freeze_begun`` FALSE: the run never went to its freeze;
            # NULL, a row of a release before, cannot tell): after a total loss no shard can, and
            # until 2026-12-06 the board came back closed for good (``_seasons``).
            started = name == "total" and state == "started"
            if started and (froze is False or not await self._season_closed(board, shards)):
                continue
            await board.settled_again(name, shards, settlement_id if state == "settled" else None)

    async def _season_closed(self, board: Board, shards: list[int]) -> bool:
        """Whether the board's season archive, its row `started`, closed it, as Redis tells: a
        shard closed, or no shard left to tell (each one lost, marked or being rebuilt: the close
        comes back, as ``_restore_board`` puts it back after a total loss). Only a shard that kept
        its keys tells that the archive was refused before its freeze (the board open)."""
        if await board.closed():
            return True
        gone = set(shards) | board.rebuilding | await self._marked(board)
        left = [p for s, p in enumerate(board.prefixes) if s not in gone]
        if left and board.sentinels:
            absent = await self._absent(left)
            left = [p for p in left if p not in absent]
        return not left

    async def _marked(self, board: Board) -> set[int]:
        """The shards the board's record names not rebuilt now (those of another incarnation: none)."""
        raw = await self.client.hget(keys.BOARDS, board.config.id)
        record = orjson.loads(raw) if raw is not None else {}
        return not_rebuilt(record) if str(record.get("incarnation", "")) == board.incarnation else set()

    async def _check_rows_layout(self, board: Board) -> None:
        """BoardConflict, forced or not, when the archive's rows of ``board`` name other shards
        than its layout gives their players: an archive restored from a backup taken before a
        reshard (whose re-homing of the rows it lost). Each shard's rebuild reads the rows of its
        number, so it would put players on shards their reads do not look at and leave others out
        (drilled 2026-12-05: 600 players resharded 3 -> 2 after the backup came back as 405). A
        sample of the rows (the oldest in the table's order, those a reshard re-homed) is checked;
        region boards, which a reshard does not take, are not. `shardlb reshard BOARD --rehome`
        (``Resharder.rehome``) moves the rows to the layout's shards."""
        layout = board.layout
        if layout.strategy == "region":
            return
        cur = await self.db.execute(
            "SELECT player_id, shard FROM match_results WHERE board = %s AND incarnation = %s LIMIT %s",
            (board.config.id, board.incarnation, LAYOUT_SAMPLE),
        )
        wrong = [(p, s) for p, s in await cur.fetchall() if layout.home(p) != s]
        if not wrong:
            return
        player, shard = wrong[0]
        raise BoardConflict(
            f"this archive's rows of board {board.config.id!r} (incarnation {board.incarnation}) name "
            f"other shards than its layout ({layout.sharding.shards} shards, generation "
            f"{board.generation}) gives their players: player {player!r} is on shard {shard}, its "
            f"layout puts it on {layout.home(player)} ({len(wrong)} of the rows sampled). Was "
            "PostgreSQL restored from a backup taken before a reshard? A rebuild from these rows "
            "would scatter the board, and is refused even forced: move them to the layout's shards "
            f"first (`shardlb reshard {board.config.id} --rehome`). See docs/design-notes.md, "
            '"PostgreSQL restored from a backup"',
            "board",
        )

    async def gaps(self, board: Board) -> list[tuple[Any, ...]]:
        """The gaps the archiver found in this archive for ``board`` (``archive_gaps``: journals
        that trimmed entries it lacks), as (shard, archived_to, trimmed_to, found_at), by shard."""
        cur = await self.db.execute("SELECT to_regclass('archive_gaps') IS NOT NULL")
        table = await cur.fetchone()
        if not (table and table[0]):  # an archive no archiver of 2026-12-05 or later wrote
            return []
        cur = await self.db.execute(
            "SELECT shard, archived_to, trimmed_to, found_at FROM archive_gaps "
            "WHERE board = %s AND incarnation = %s ORDER BY shard, found_at",
            (board.config.id, board.incarnation),
        )
        return list(await cur.fetchall())

    async def _check_gaps(self, board: Board) -> None:
        """BoardConflict when ``archive_gaps`` holds a gap of ``board`` and Redis holds players."""
        found = await self.gaps(board)
        if not found or not await _held(board):
            return
        raise BoardConflict(
            f"this archive lacks results of board {board.config.id!r} (incarnation {board.incarnation}) "
            f"that its journals acknowledged and trimmed ({len(found)} journal gaps in archive_gaps, the "
            f"first found {min(g[3] for g in found):%Y-%m-%d %H:%M:%S %Z}: was PostgreSQL restored from a "
            "backup?). Redis's board still holds them; rebuilding would drop them. See docs/design-notes.md, "
            '"PostgreSQL restored from a backup" (force it: shardlb rebuild --force)',
            "board",
        )

    async def _check_marks(self, board: Board, deleted: dict[str, tuple[int, str]]) -> None:
        """BoardConflict when a journal of ``board`` trimmed (``deleted``: its shard and
        ``max-deleted-entry-id``, read before this) past the newest entry this archive holds of it
        (``journal_marks``) and Redis holds players: the archiver's comparison (shardlb/archive.py,
        ``_GAPS``) made by the rebuild itself. The archiver records a gap only once it has run
        against this database (a new URL whose archivers were not restarted yet, archivers scaled
        down): until 2026-12-05 a rebuild or `reconcile --repair` run before then dropped the
        results from Redis. A journal never marked (archived by a release of before) is not judged."""
        if not deleted:
            return
        cur = await self.db.execute("SELECT to_regclass('journal_marks') IS NOT NULL")
        table = await cur.fetchone()
        if not (table and table[0]):
            return
        journals = list(deleted)
        cur = await self.db.execute(
            "SELECT j.journal, m.archived_to, j.trimmed FROM unnest(%s::text[], %s::text[]) "
            "AS j(journal, trimmed) JOIN journal_marks m USING (journal) "
            f"WHERE {_position('j.trimmed')} > {_position('m.archived_to')}",
            (journals, [deleted[j][1] for j in journals]),
        )
        behind = sorted(await cur.fetchall(), key=lambda row: deleted[row[0]][0])
        if not behind or not await _held(board):
            return
        shard, archived_to, trimmed_to = deleted[behind[0][0]][0], behind[0][1], behind[0][2]
        raise BoardConflict(
            f"this archive lacks results of board {board.config.id!r} (incarnation {board.incarnation}) "
            f"that its journals acknowledged and trimmed: shard {shard}'s journal trimmed entries up to "
            f"{trimmed_to}, but journal_marks holds them up to {archived_to} only ({len(behind)} journals "
            "behind: was PostgreSQL restored from a backup?). Redis's board still holds them; rebuilding "
            'would drop them. See docs/design-notes.md, "PostgreSQL restored from a backup" (force it: '
            "shardlb rebuild --force)",
            "board",
        )

    async def _check_archive(self, board: Board) -> None:
        """Refuse to rebuild from an archive that holds no result of ``board`` (its id and
        incarnation) when the board's journals say results were archived somewhere (entries were
        added to a journal and trimmed from it, which the archiver does only after its commit) and
        Redis holds players: another environment's archive, a backup from before the board, a
        wrong --postgres. The rebuild would replace every shard with the journal's tail alone, and
        every archived player would be gone. A journal never trimmed still holds every result: a
        rebuild from it alone is whole. The journals are read first: an entry trimmed by then was
        committed before, so the archive read after it holds its rows if it is the board's.

        Refused too (since 2026-12-05) when the archiver found that the board's journals trimmed
        entries this archive lacks (``archive_gaps``: a PostgreSQL restored from a backup older than
        what the archiver had acknowledged): Redis's board holds those results and the archive never
        will, so the rebuild would drop them (docs/design-notes.md, "PostgreSQL restored from a
        backup"). Before, it dropped them and said done."""
        await self._check_gaps(board)
        trimmed = 0
        deleted: dict[str, tuple[int, str]] = {}  # journal -> (its shard, its max-deleted-entry-id)
        for shard, prefix in enumerate(board.prefixes):
            try:
                got: dict[Any, Any] = await self.client.xinfo_stream(keys.journal_key(prefix))
            except ResponseError:  # no journal on this shard (yet)
                continue
            info = {k.decode() if isinstance(k, bytes) else k: v for k, v in got.items()}
            trimmed += int(info.get("entries-added") or 0) - int(info.get("length") or 0)
            cut = _text(info.get("max-deleted-entry-id") or "0-0")
            if cut != "0-0":
                deleted[keys.journal_key(prefix)] = (shard, cut)
        await self._check_marks(board, deleted)
        if not trimmed:
            return
        cur = await self.db.execute(ANY_ROW, (board.config.id, board.incarnation))
        if await cur.fetchone() is not None:
            return
        players = await _held(board)
        if players:
            raise BoardConflict(
                f"this archive holds no result of board {board.config.id!r} (incarnation "
                f"{board.incarnation}), but {trimmed} entries of its journals were archived and trimmed, "
                f"and Redis holds {players} players: rebuilding from it would empty the board. Is it "
                "the board's archive? (force it: shardlb rebuild --force)",
                "board",
            )

    async def rebuild_shard(self, board: Board, shard: int, wanted: Callable[[str], bool]) -> ShardReport:
        """Rebuild the wanted period boards of one home shard (steps 1-4 of the module docstring)."""
        start = time.perf_counter()
        prefix = board.prefixes[shard]
        # First: a retry answered from here on is recognised, also between the snapshot and the swap
        # (where rebuild.lua's catch-up, which has no dedup, would count it again).
        retries = 0
        if prefix in self._refilled:
            self._refilled.discard(prefix)
        else:
            retries = await self.refill(board, shard)
        report = ShardReport(shard, retries=retries)
        for _ in range(FILL_TRIES):
            pairs = await self._fill_and_swap(board, shard, wanted, report)
            if pairs is not None:
                break
            self.progress(
                f"{board.config.id} shard {shard} ({shard + 1} of {board.layout.physical}): its temporary "
                "keys were lost before the swap (a failover?); filling them again"
            )
            report.retries += await self.refill(board, shard)  # lost with them, if as recent
        else:
            raise _lost(board, shard)
        # The period rebuilt: one without a key (a day without results) has none, not the total's.
        counted = "total" if wanted("total") else next(iter(sorted(pairs)), None)
        report.players = int(await self.client.zcard(keys.period_key(prefix, counted))) if counted else 0
        report.seconds = time.perf_counter() - start
        self.progress(
            f"{board.config.id} shard {shard} ({shard + 1} of {board.layout.physical}): "
            f"{report.players} players, {report.rows} results from PostgreSQL, "
            f"{report.journal} from the journal, "
            f"{report.retries} retry records, swapped on try {report.tries}, {report.seconds:.2f}s"
        )
        return report

    async def _fill_and_swap(
        self, board: Board, shard: int, wanted: Callable[[str], bool], report: ShardReport
    ) -> dict[str, str] | None:
        """Steps 1-4 once: the temporary keys (period -> key) swapped in, or None when the swap
        found one of them not as filled (lost in a failover, or expired: swap changed nothing)."""
        prefix = board.prefixes[shard]
        fold = Fold(board, wanted)
        snap = await self.snapshot(board, shard, fold)
        token = secrets.token_hex(4)
        names = set(fold.boards) | await self._live_periods(prefix, wanted)
        sizes = dict.fromkeys(names, 0)
        for name in fold.boards:
            scores = fold.scores(name)
            sizes[name] = len(scores)
            await self._fill(f"{prefix}tmp:{token}:{name}", scores)
        fold.boards = {}  # the temporary keys hold them now
        report.rows, report.journal = snap.rows, snap.journal
        pairs = {name: f"{prefix}tmp:{token}:{name}" for name in sorted(names)}
        mark, items = snap.mark, list[Any]()
        swap = secrets.token_hex(8)  # a forced swap's marker, which the apply after it checks
        await self.check_layout(board)  # a reshard recorded since the rebuild began: refused now
        for tries in itertools.count(1):
            report.tries += 1
            force = tries > self.swap_tries
            marker = swap if force else ""  # a swap not forced unlinks one (no apply follows it)
            status, last = await self._call(
                board, shard, "swap", pairs, mark.last, force, items, sizes, marker
            )
            if status == "lost":
                return None
            if last == mark.last:
                break
            # Written meanwhile: results after the snapshot's position, up to the journal's new end,
            # and removals (each removal's ZREM goes before the player's results kept after it).
            new, cuts = await self.changes(board, shard, mark.position, parse_id(last))
            report.journal += len(new)
            if status == "ok":  # forced: the swap is done, and these go onto the live keys, once
                report.journal += await self._apply_live(board, shard, fold, pairs, new, cuts, last, swap)
                break
            mark = Mark(last, parse_id(last), None)
            removals = _removal_items(cuts, pairs)
            for r in new:
                for name in fold.names(r):
                    if name not in pairs:  # applied to a key the swap creates: nothing filled
                        pairs[name], sizes[name] = f"{prefix}tmp:{token}:{name}", 0
            items = [*items, *removals, *self._items(fold, new, pairs)]
        # Written on the live keys after the swap (``_apply_live``, this): each call confirmed as
        # the swap was (``_script``), the apply wherever the primary has a replica.
        await self.recall_activity(board, shard, snap.arrivals)
        return pairs

    async def _apply_live(
        self,
        board: Board,
        shard: int,
        fold: Fold,
        pairs: dict[str, str],
        new: list[Applied],
        cuts: Cuts,
        swapped: str,
        swap: str,
    ) -> int:
        """After a swap forced at ``swapped`` (its marker ``swap``): put ``new`` (the results
        between the last attempt's position and ``swapped``, which the RENAME overwrote) onto the
        live keys, once, with ``cuts`` (the removals among them). Returns how many results it read
        after the swap.

        Each ``apply`` waits for a replica wherever the shard's primary has one, even in a rebuild
        of named boards, whose swaps do not (``_acked``): the swap and the apply are two calls, and
        a failover between them that kept the swap alone lost ``new`` (acknowledged results) while
        the rebuild said done. The WAIT covers the swap too, which went before on that primary. A
        failover that lost the swap left the board as before it, ``new`` on it already: rebuild.lua
        finds the swap's marker gone and answers "unswapped", changing nothing (ClusterUnavailable;
        until 2026-12-05 it added ``new`` again, and an incr board counted their points twice).
        Either way the rebuild stops, and run again it folds the shard from the journal and the
        archive. Another rebuild's swap since (of the same shard) replaced the marker: refused too.

        What was written since the swap is on the live keys already, so rebuild.lua's ``apply``
        leaves out every player a removal since ``swapped`` wiped there (their results in ``new``
        are older), but in the periods that removal left whole (a removal made at an earlier call's
        time keeps the entries achieved since: its delete entry's ``a``), which held the player's
        entry as the board had it then: their results go on there (until 2026-12-05 the player was
        left out of every period until the next rebuild). A player removed in ``new`` is removed
        from the live keys and gets back their results kept after that removal, with those written
        since the swap (the ZREM wipes them too). rebuild.lua reads what came after the position it
        is given itself; whatever the archiver trimmed of it is read here, from PostgreSQL:
        ``apply`` answers "moved", changing nothing, when an entry after that position may be gone
        from the journal, or when a player it would remove has results after it, and is sent again
        from the journal's new end. After SWAP_TRIES such answers it goes on with what the journal
        still holds."""
        if not new and not cuts:
            return 0
        prefix = board.prefixes[shard]
        through, since, read = swapped, list[Applied](), 0
        gone: Cuts = {}
        for tries in itertools.count(1):
            # A removal since the swap (``gone``) wiped its player on the live keys but in the
            # periods it left whole, where their results go on (every one of them is older).
            outside = _kept(board, gone, set())
            kept = [r for r in (outside(START, r) for r in [*new, *since]) if r is not None]
            live = {name: keys.period_key(prefix, name) for r in kept for name in fold.names(r)}
            live |= {name: keys.period_key(prefix, name) for name in (pairs if cuts else ())}
            wiped = {p for p, found in gone.items() if any(periods is None for _, periods in found)}
            removals = _removal_items({p: c for p, c in cuts.items() if p not in wiped}, live)
            items = [*removals, *self._items(fold, kept, live)]
            force = tries > SWAP_TRIES
            status, last = await self._call(
                board, shard, "apply", live, through, force, items, left=gone, swap=swap, confirm=True
            )
            if status == "ok":
                return read
            if status == "unswapped":
                raise _unswapped(board, shard)
            more, removed = await self.changes(board, shard, parse_id(through), parse_id(last))
            read += len(more)
            gone = _merged(gone, removed)
            since += [r for r in more if r.player_id in cuts]
            through = last
        raise AssertionError("unreachable")

    async def recall_activity(self, board: Board, shard: int, arrivals: dict[str, int]) -> None:
        """Put back the shard's activity set (write.lua's, on inactive_after boards: player -> the
        time of their last applied result, which the inactive cleanup reads) from ``arrivals``, with
        ZADD GT: a later post's time stays. Without it a player idle before a loss of Redis was
        never cleaned up."""
        prefix = board.prefixes[shard]
        records = RetryRecords(board, prefix, times.now_ms())
        for player, at_ms in arrivals.items():
            records.arrived(player, at_ms)
            if len(records) >= PAGE:
                await self._recall(prefix, records)
        await self._recall(prefix, records)

    async def rebuild_bands(self, board: Board) -> list[ShardReport]:
        """Rebuild a band board's band shards from its home shards' totals (and versions).

        Each home's versions are read BEFORE its total, so a band row never carries a version newer
        than its score. Every band shard gets every player's version, as band.lua keeps them: a
        late move older than the rebuild must not add a player back to a band they left. A move made
        while the band shards were being replaced may have been overwritten: every player whose
        version changed since it was read is sent again, a player removed meanwhile as a drop from
        the band the swap put them in (band.lua takes a move only with a newer version than it
        holds, so nothing goes back in time), and every player whose version was forgotten
        meanwhile (``BandMoves.prune``) is forgotten again on the bands."""
        start = time.perf_counter()
        await self.check_layout(board)
        layout, codec = board.layout, board.codec
        homes = range(board.config.sharding.shards)
        seen: dict[int, dict[str, int]] = {}
        members: dict[int, dict[str, int]] = defaultdict(dict)
        versions: dict[str, int] = {}
        placed: dict[str, int] = {}
        for home in homes:
            prefix = board.prefixes[home]
            seen[home] = await self._versions(prefix)
            for player, score in (await self.members(keys.period_key(prefix, "total"))).items():
                band = layout.band_shard(codec.decode_units(score)[0])
                members[band][player] = score
                placed[player] = band
            versions.update(seen[home])
        reports = []
        for band in range(board.config.sharding.shards, layout.physical):
            prefix, report = board.prefixes[band], ShardReport(band, players=len(members[band]))
            for _ in range(FILL_TRIES):
                token = secrets.token_hex(4)
                total, ver = f"{prefix}tmp:{token}:total", f"{prefix}tmp:{token}:ver"
                await self._fill(total, members[band])
                await self._fill(ver, versions, hash=True)
                targets = [
                    (total, keys.period_key(prefix, "total"), 0, len(members[band])),
                    (ver, keys.version_key(prefix), 0, len(versions)),
                ]
                report.tries += 1
                if (await self._swap_keys(prefix, targets))[0] != "lost":
                    break
            else:
                raise _lost(board, band)
            reports.append(report)
        for home in homes:
            prefix = board.prefixes[home]
            now = await self._versions(prefix)
            # Forgotten since they were read (a removal long past: BandMoves.prune): the swap put
            # back the removal's version on every band, which nothing would forget again.
            await board.bands.forget({p: v for p, v in seen[home].items() if p not in now})
            changed = [p for p, v in now.items() if seen[home].get(p) != v]
            if not changed:
                continue
            totals = await self.client.zmscore(keys.period_key(prefix, "total"), changed)
            moves = []
            for player, found in zip(changed, totals, strict=True):
                # Removed since the totals were read: the swap may have put back a row the
                # removal's band calls had dropped, with the version of before. It goes again.
                new = None if found is None else layout.band_shard(codec.decode_units(found)[0])
                old = placed.get(player, new)
                if old is None:
                    continue
                pending = str(old - board.config.sharding.shards) if old != new else ""
                moves.append(Move(player, None if found is None else int(found), now[player], pending))
            await board.bands.finish(home, moves)
        elapsed = time.perf_counter() - start
        for r in reports:
            r.seconds = elapsed / len(reports)
            self.progress(
                f"{board.config.id} band shard {r.shard} ({r.shard + 1} of {layout.physical}): "
                f"{r.players} players"
            )
        return reports

    async def restore(
        self, store: BoardStore, period: str | None = None, shard: int | None = None
    ) -> list[Board]:
        """Put every board that PostgreSQL knows and the registry lacks back in the registry, with
        its incarnation (a total loss of Redis); return the boards to rebuild. A board whose id the
        registry holds under another incarnation, or that Redis says was deleted (its first shard's
        marker, or the board's deletion mark, which any layout leaves), is left out. The bans go back
        first (``Bans.restore``), so routers refuse banned players' results from the first write to
        a board restored: the boards go back ``moderation.propagation_s`` after them, when every
        running router's copy holds them (until 2026-12-07 at once, before a router that had loaded
        the lost list's emptiness refreshed). A board whose season archive went to its freeze is
        closed again (``_seasons``).
        ``period`` and ``shard``, the rebuild's that follows, are checked against every board
        (``checked``) before anything is written: InvalidInput when one board refuses them.

        What it writes waits for a replica wherever the primary has one (the ban list, then each
        board's record: ``_confirm_registry``), and so does every swap of this rebuilder from then
        on (``confirming``): the rebuilds of the boards returned. NotAcknowledged when none has it
        within ``replica_wait_ms``; running it all again converges.

        The boards go back ``jobs`` at a time (``_restore_board``, then its record confirmed;
        ``side_by_side`` says what an error in one does). ``recover`` rebuilds each board as soon
        as its record is confirmed, without waiting for the others."""
        restored, _ = await self._recover(store, period, shard)
        return restored

    async def recover(
        self, store: BoardStore, period: str | None = None, shard: int | None = None, force: bool = False
    ) -> dict[str, list[ShardReport]]:
        """`rebuild --all`: ``restore``, and each board returned rebuilt (``rebuild``) as soon as
        its own record is confirmed on a replica, not once every board's is: a task with no board
        left to restore takes the rebuild of a board restored, while other tasks may still be
        restoring theirs (``side_by_side``'s ``then``). Restores go first, so every board is back
        in the registry, where routers find it, as early as when all were restored before any was
        rebuilt (until 2026-12-06, with one confirmation of every record between the two). Each
        rebuild waits for replicas as after ``restore`` (``confirming``)."""
        _, reports = await self._recover(store, period, shard, force, rebuild=True)
        if self._passed_over:
            raise BoardConflict("; ".join(self._passed_over), "board")
        return reports

    async def _recover(
        self,
        store: BoardStore,
        period: str | None,
        shard: int | None,
        force: bool = False,
        rebuild: bool = False,
    ) -> tuple[list[Board], dict[str, list[ShardReport]]]:
        """``restore``'s work, and with ``rebuild`` ``recover``'s: the boards restored, the
        reports of those rebuilt."""
        self._passed_over.clear()  # in place: the siblings share it
        async with self.db.transaction():
            cur = await self.db.execute(
                "SELECT board, incarnation, settings FROM boards "
                "WHERE deleted_at IS NULL ORDER BY board, created_at DESC"
            )
            found = await cur.fetchall()
        formers = []
        # Per id, newest first, the first incarnation Redis does not say was deleted is restored;
        # those live in the archive below it lost their record without a deletion mark, as a loss
        # of Redis loses them, and the id was created again since (``_restore_board`` says so).
        # One deleted (the mark lasts a day) before the archiver recorded it passes to the next.
        older: dict[str, list[str]] = {}
        for board_id, incarnation, settings in found:
            if board_id in older:
                older[board_id].append(str(incarnation))
                continue
            # The layout a reshard recorded with the rows' new shards (shardlb/reshard.py, _rehome);
            # the generation is the layout's, not a setting.
            generation = int(settings.pop("generation", 0))
            config = BoardConfig.from_dict(board_id, stored_settings(settings))
            former = Board(store.client, config, store.scripts, incarnation, generation)
            marks = (keys.gone_key(former.prefixes[0]), keys.deleted_key(board_id, incarnation))
            if any([await self.client.exists(mark) for mark in marks]):
                self.progress(f"{board_id}: deleted; left alone")
                continue
            checked(former, period, shard, times.now_ms())  # before anything is written
            formers.append(former)
            older[board_id] = []
        # Confirmed by a replica wherever the list's primaries have one, as the reshard's mover
        # confirms its writes: the boards restored next rely on the bans being there for good.
        replicated = Replicated(self.client)
        bans = moderation.Bans(self.client, Ack(1, self.replica_wait_ms))
        restored = await bans.restore(self.db, replicated)
        self.progress(f"bans: {restored} written back from PostgreSQL")
        if restored and formers:
            # A router that loaded the list while Redis had lost it (started since the loss) holds
            # none of them until its next refresh: the boards go back once every copy has them.
            wait = moderation.propagation_s(restored)
            self.progress(f"bans: waiting {wait:.1f} s for the routers to read them")
            await asyncio.sleep(wait)
        seasons = await self._seasons()

        async def put_back(worker: Rebuilder, former: Board) -> Board | None:
            board = await worker._restore_board(store, former, seasons, older[former.config.id])
            if board is not None:
                await worker._confirm_registry([board], replicated)
            return board

        reports: dict[str, list[ShardReport]] = {}

        async def rebuilt(worker: Rebuilder, board: Board) -> None:
            # Its own record confirmed: its swaps wait for a replica as every one of the run's.
            # Set for the rebuild alone: the worker's next restore (its refill's ``recall``) goes
            # on the primary alone, as every restore does.
            before, worker.confirming = worker.confirming, replicated
            try:
                reports[board.config.id] = await worker.rebuild(board, period, shard, force)
            finally:
                worker.confirming = before

        async with self._workers(len(formers)) as workers:
            found = await side_by_side(
                workers,
                formers,
                put_back,
                lambda former: former.config.id,
                self.progress,
                then=rebuilt if rebuild else None,
            )
        out = [board for board in found if board is not None]
        self.confirming = replicated  # the rebuilds of ``out`` that follow: each swap too
        return out, {b.config.id: reports[b.config.id] for b in out if b.config.id in reports}

    async def _restore_board(
        self,
        store: BoardStore,
        former: Board,
        seasons: set[tuple[str, str]],
        older: Sequence[str] = (),
    ) -> Board | None:
        """``restore``'s work on one board: its journals started and its retry records put back,
        then its record in the registry; the board, or None when the registry holds another
        incarnation of its id. Boards go through it side by side (``jobs``), each on its own
        PostgreSQL connection; what a board writes before its record comes back is its own. From
        then on routers find the board, its record naming every shard not rebuilt yet: reads and
        writes that touch one are refused until its swap (``Board.check_built``, ``_built``).

        ``older``: the incarnations of its id live in the archive beside ``former``. A board the
        registry held before the restore while they exist, or held under another incarnation, was
        created again since the loss (a PUT before `rebuild --all`): it is left alone, and the
        archived incarnation it hides is named in ``_passed_over``, for the operator to choose.
        Until 2026-12-06 the one in the registry was rebuilt from its own few rows, "found in the
        registry", and the run exited 0, the archive's results of the id named nowhere."""
        config, board_id, incarnation = former.config, former.config.id, former.incarnation
        refilled: list[str] = []
        closing = (board_id, str(incarnation)) in seasons
        held = await self.client.hexists(keys.BOARDS, board_id)
        if not held:
            # Before routers can find the board again: its retries are recognised from their
            # first write on, not only once its shard's turn to be rebuilt comes; a board
            # closed for its season takes no result.
            if closing:
                await former.close()
            for shard, prefix in enumerate(former.prefixes[: config.sharding.shards]):
                await self.start_journal(former, shard, confirm=True)
                await self.refill(former, shard)
                refilled.append(prefix)
        try:
            # Every shard marked not rebuilt (reads and writes that touch one are refused) until
            # its swap (``rebuild``): the record comes back with its mark, in one write.
            unbuilt = range(former.layout.physical)
            board, created = await store.restore(config, incarnation, former.generation, unbuilt)
        except BoardNotFound:  # the registry's record of the id is being deleted
            await _unrestored(store, former, refilled)
            raise
        if board.incarnation != incarnation:
            # Created again under its id since the loss (or since the registry was read): what was
            # put back of this incarnation is dropped (until 2026-12-05 it stayed, its key index
            # without expiry).
            await _unrestored(store, former, refilled)
            self.progress(f"{board_id}: the registry holds another incarnation; left alone")
            self._passed_over.append(_hidden(board_id, board.incarnation, [str(incarnation), *older]))
            return None
        if held and older:
            self.progress(f"{board_id}: the registry holds an incarnation created since; left alone")
            self._passed_over.append(_hidden(board_id, board.incarnation, older))
            return None
        if closing and await board.close():  # the registry kept it, and a shard lost its marker
            self.progress(f"{board_id}: closed again (its season archive went to its freeze)")
        self._refilled.update(refilled)
        self.progress(f"{board_id}: {'restored to' if created else 'found in'} the registry")
        return board

    async def rebuild_all(
        self,
        boards: Sequence[Board],
        period: str | None = None,
        shard: int | None = None,
        force: bool = False,
    ) -> dict[str, list[ShardReport]]:
        """``rebuild`` of each of ``boards`` (by id, in their order), ``jobs`` boards at a time,
        each on its own PostgreSQL connection; the shards of one board go one after another as
        ever. ``side_by_side`` says what an error in one board does. A board named twice is
        rebuilt once (two rebuilds of one shard at a time would only refuse each other's swaps)."""
        boards = list({b.config.id: b for b in boards}.values())
        async with self._workers(len(boards)) as workers:
            done = await side_by_side(
                workers,
                boards,
                lambda worker, board: worker.rebuild(board, period, shard, force),
                lambda board: board.config.id,
                self.progress,
            )
        return {b.config.id: reports for b, reports in zip(boards, done, strict=True)}

    @asynccontextmanager
    async def _workers(self, boards: int) -> AsyncIterator[list[Rebuilder]]:
        """This rebuilder and, with ``connect``, up to ``jobs`` - 1 others for ``boards`` boards,
        each on a PostgreSQL connection of its own (closed on exit): a connection runs one
        transaction at a time, and ``refill`` and ``snapshot`` read theirs in transactions. They
        share the cluster client (its connection pool serves concurrent calls), rebuild.lua, and
        what ``restore`` leaves for the rebuilds that follow: ``_refilled`` (the same set; each
        board adds and takes its own shards' prefixes) and ``confirming`` as it is when they are
        made (``recover`` sets a worker's own for each rebuild it takes).

        A connection PostgreSQL refuses (max_connections, the role's CONNECTION LIMIT) leaves the
        boards to those opened, this rebuilder's at least, as ``progress`` says: the recovery
        after a total loss needed one connection before `--jobs` came, and until 2026-12-06 a
        server that took no more failed it after the bans went back, every board left out of
        the registry."""
        count = max(1, min(self.jobs, boards)) if self.connect is not None else 1
        opened: list[psycopg.AsyncConnection[Any]] = []
        try:
            for _ in range(count - 1):
                assert self.connect is not None
                try:
                    opened.append(await self.connect())
                except psycopg.OperationalError as e:
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    taken = len(opened) + 1
                    self.progress(
                        f"PostgreSQL refused a connection ({first}): {taken} board"
                        f"{'' if taken == 1 else 's'} at a time, not {count}"
                    )
                    break
            yield [self, *(self._sibling(db) for db in opened)]
        finally:
            for db in opened:
                await db.close()

    def _sibling(self, db: psycopg.AsyncConnection[Any]) -> Rebuilder:
        """A rebuilder like this one on ``db``, sharing its state (``_workers``)."""
        other = Rebuilder(self.client, self.script, db, self.progress, self.swap_tries)
        other.replica_wait_ms = self.replica_wait_ms
        other.confirming, other._replicated = self.confirming, self._replicated
        other._refilled, other._passed_over = self._refilled, self._passed_over
        return other

    async def _confirm_registry(self, boards: Sequence[Board], replicated: Replicated) -> None:
        """Return once a replica of the registry's primary, if it has one, holds the record of
        each of ``boards`` (HMGET with fanout.confirmed's marker and WAIT, made again on the new
        primary after a failover, where a record lost is then seen missing); else raise
        NotAcknowledged: running the restore again writes them again. Until 2026-12-05 the
        records were written on the primary alone, and a kill -9 of it right after could lose a
        board restored while the rebuild went on and said it was done. ``_recover`` confirms each
        board's record as soon as it is written, in that board's task: until 2026-12-06 one call
        confirmed every record once all were written, and no board's rebuild began before the
        slowest board's restore was done."""
        await replicated.read()
        if not boards or not replicated(keys.BOARDS):
            return
        ids = [b.config.id for b in boards]
        ack = Ack(1, self.replica_wait_ms)
        [reply] = await confirmed(self.client, ack, [("HMGET", keys.BOARDS, *ids)])
        if isinstance(reply, NotAcknowledged):
            raise NotAcknowledged(
                f"no replica confirmed the registry's restored records of {', '.join(ids)} within "
                f"{ack.timeout_ms} ms on "
                f"{replicated.describe(keys.BOARDS)}: a failover could lose them. Run the rebuild "
                "again once that replica is in sync with its primary"
            ) from reply
        if isinstance(reply, BaseException):
            raise reply
        lost = [
            b.config.id
            for b, raw in zip(boards, reply, strict=True)
            if raw is None or str(orjson.loads(raw).get("incarnation", "0")) != b.incarnation
        ]
        if lost:
            raise NotAcknowledged(
                f"the registry's records of {', '.join(lost)} are gone since they were restored (a "
                "failover, or deleted meanwhile?): run the rebuild again"
            )

    async def _seasons(self) -> set[tuple[str, str]]:
        """(board, incarnation) of every season settlement in the archive (shardlb/settlement.py:
        the total's, begun by ``archive_season``) that went to its freeze, settled or not: that step
        closed the board for good (``Board.close``, a marker in Redis alone). Settled, the board is
        deleted right after; one still here (the archive died before the deletion) stays closed too.
        One whose row says its run never went to its freeze (``freeze_begun`` FALSE: refused before
        it, a shard lost or a reshard, or stopped before it) left the board open, and it comes back
        open; until 2026-12-06 every row of the total closed it, for good. A row of a release
        before (NULL, or no such column) cannot tell and closes it, as then. None when the archive
        has no settlements table (no settlement ever ran on it)."""
        async with self.db.transaction():
            begun = await _freeze_begun(self.db)
            if begun is None:
                return set()
            cur = await self.db.execute(
                f"SELECT board, incarnation FROM settlements WHERE period = 'total' AND {begun} IS NOT FALSE"
            )
            return {(board, str(incarnation)) for board, incarnation in await cur.fetchall()}

    # ---- reading the snapshot ------------------------------------------------------------

    async def snapshot(self, board: Board, shard: int, fold: Fold) -> Snapshot:
        """Fold every result of ``shard`` up to its journal's position now (steps 1-2)."""
        prefix = board.prefixes[shard]
        mark = await self.mark(prefix)
        incr = board.config.mode == "incr"
        seen: set[tuple[str, str]] = set()
        journal = rows = 0
        entries = await self._entries(prefix, None, mark.position)
        # Removed players' results journaled before the removal, and banned players', are left out
        # (PostgreSQL's own removals are left out by the query in _rows, its rows of banned players
        # by ``kept`` as the journal's are), but in the periods a removal left whole, PostgreSQL's
        # too (``_removals``).
        cuts = _merged(_cuts(entries), await self._removals(board, shard, None, None, partial=True))
        banned = await moderation.banned_in(self.db, board)
        kept, counts = _kept(board, cuts, banned), _active(cuts, banned)
        arrivals: dict[str, int] = {}
        active = board.config.inactive_after is not None

        def arrived(i: Id, r: Applied) -> None:
            # The activity set's time, as write.lua set it and remove.lua left it: a removal that
            # left some period whole keeps the player's whole, posts it took out of the others too.
            if arrivals.get(r.player_id, -1) < i[0] and counts(i, r):
                arrivals[r.player_id] = i[0]

        for i, got in ((parse_id(e.id), r) for e in entries for r in e.results):
            if active:
                arrived(i, got)
            if (r := kept(i, got)) is None:
                continue
            if incr:
                if (r.match_id, r.player_id) in seen:
                    continue  # applied again after the dedup window: PostgreSQL counts it once too
                seen.add((r.match_id, r.player_id))
            fold.add(r)
            journal += 1
        for i, got in await self._rows(board, shard, None, mark.position if incr else None):
            if active:
                arrived(i, got)
            if (r := kept(i, got)) is None:
                continue
            if seen and (r.match_id, r.player_id) in seen:
                continue  # archived, and still in the journal
            fold.add(r)
            rows += 1
        # A closed period of a best or set board may hold an application whose row a later one of
        # its (match, player) replaced: folded into that period alone (the fold takes the best or
        # the latest, so a copy of what a row or entry holds changes nothing). Read after the rows:
        # the archiver writes a hold in the transaction that replaces its row.
        for i, got in [] if incr else await self._rows(board, shard, None, None, holds=True):
            if (r := kept(i, got)) is not None:
                fold.add(r)
                rows += 1
        return Snapshot(mark, rows, journal, arrivals)

    async def refill(self, board: Board, shard: int) -> int:
        """Put back the shard's retry records of the dedup window (``RetryRecords``) from its journal,
        then from PostgreSQL (in that order, as ``snapshot`` reads them: an entry trimmed between the
        two reads was committed before it), a page at a time. Returns how many results it recorded
        (a result found in both counts twice).

        Idempotent and safe under writes: a member added again is no change, a pin write.lua made
        meanwhile stays, and the expiries and key index listings are write.lua's own, so what a
        write records meanwhile and what this puts back agree. rebuild.lua refuses the calls on a
        deleted board (BoardNotFound), which then gets no keys back.

        PostgreSQL has no index by journal time: the query reads every row of the shard (through
        `match_results_on_shard`) and sends those of the window."""
        prefix = board.prefixes[shard]
        records = RetryRecords(board, prefix, times.now_ms())
        count = 0
        start = str(records.since_ms)
        async for page in self._pages(keys.journal_key(prefix), start, "+"):
            for entry in page:
                arrived = parse_id(entry.id)[0]
                for r in entry.results:
                    records.add(arrived, r.match_id, r.player_id, r.units)
                marks = entry.marks()
                for n, (player, units) in enumerate(entry.recorded):
                    records.removed(arrived, player, units)
                    if not entry.swept:
                        records.named(entry.id, arrived, player, player in entry.removed, units)
                    if marks:
                        records.requested(arrived, entry.request, player, marks[n])
                        records.asked(entry.id, arrived, entry.request, player, entry.request_units)
                # The inactive cleanup's: where its entry is, under the units of its own time (its
                # records, at its players' last posts, may be older), as remove.lua points at it.
                if entry.removed and entry.swept:
                    swept = moderation.record_units(board, arrived)
                    for player in entry.removed:
                        records.named(entry.id, arrived, player, True, swept)
                if len(records) >= PAGE:  # an entry holds up to a call's results
                    count += await self._recall(prefix, records)
        codec = board.codec
        arrived_ms = "split_part(journal_id, '-', 1)::bigint"
        async with self.db.transaction(), self.db.cursor(name="retry_records") as cur:
            await cur.execute(RECENT_ROWS, (board.config.id, board.incarnation, shard, records.since_ms))
            while rows := await cur.fetchmany(PAGE):
                for match, player, achieved, arrived in rows:
                    records.add(arrived, match, player, (achieved - codec.epoch_ms) // codec.unit_ms)
                count += await self._recall(prefix, records)
            await cur.execute(
                f"SELECT player_id, units, {arrived_ms}, request, request_mark, journal_id "
                "FROM removal_records WHERE board = %s AND incarnation = %s AND shard = %s "
                f"AND {arrived_ms} >= %s",
                (board.config.id, board.incarnation, shard, records.removals_since),
            )
            while rows := await cur.fetchmany(PAGE):
                for player, units, arrived, request, mark, entry_id in rows:
                    records.removed(arrived, player, units)
                    records.named(entry_id, arrived, player, False, units)  # archived: nothing to find
                    if request:
                        records.requested(arrived, request, player, mark)
                        records.asked(entry_id, arrived, request, player, int(mark.partition(".")[0]))
                count += await self._recall(prefix, records)
        records.place()
        return count + await self._recall(prefix, records)

    async def archived_to(self, board: Board, shard: int) -> Id:
        """The newest journal id PostgreSQL holds of ``board`` (its incarnation) on home ``shard``:
        of its rows there in each table whose rules order them by journal id (results, holds,
        removals, removal records; after a reshard, rows the old layout's journals gave), and of the
        archiver's marks of the shard's journal (``journal_marks``, and the ``archive_gaps`` it
        recorded: the restore detection's). START for none. It reads every row of the shard, as the
        snapshot does."""
        ident = (board.config.id, board.incarnation)
        journal = keys.journal_key(board.prefixes[shard])
        tables = ("match_results", "match_holds", "player_removals", "removal_records")
        queries: list[tuple[str, tuple[Any, ...]]] = [(newest_sql(t), (*ident, shard)) for t in tables]
        async with self.db.transaction():
            cur = await self.db.execute(
                "SELECT to_regclass('journal_marks') IS NOT NULL, to_regclass('archive_gaps') IS NOT NULL"
            )
            marks, gaps = await cur.fetchone() or (False, False)
            if marks:
                queries.append(("SELECT archived_to FROM journal_marks WHERE journal = %s", (journal,)))
            for column in ("archived_to", "trimmed_to") if gaps else ():
                queries.append(
                    (f"SELECT {column} FROM archive_gaps WHERE journal = %s "
                     f"ORDER BY {_position(column)} DESC LIMIT 1", (journal,))
                )  # fmt: skip
            newest = START
            for sql, params in queries:
                cur = await self.db.execute(sql, params)
                found = await cur.fetchone()
                if found is not None:
                    newest = max(newest, parse_id(found[0]))
        return newest

    async def start_journal(self, board: Board, shard: int, confirm: bool = False) -> bool:
        """Give home ``shard``'s journal a last-generated id of at least ``archived_to``'s (rebuild.lua's
        ``start``), so the entries it takes next have ids past every id PostgreSQL holds of the
        shard. A journal lost with Redis is made again by the next write, with ids from its node's
        clock, which can be behind those the lost node gave (skew, a clock stepped back): until
        2026-12-05 PostgreSQL then took a result posted after the rebuild for one journaled before
        an archived removal of its player (counted nowhere there, and the next rebuild dropped it),
        an incr rebuild (rows up to the journal's position) left out the rows past the clock, and the
        archiver's restore detection compared trimmed ids with marks they had not reached. The
        reshard starts a new layout's journals the same way. Made again, it changes nothing;
        ``confirm``: it waits for a replica wherever the primary has one (``_script``). Returns
        whether it moved the journal."""
        if board.config.durability != "journal":
            return False
        floor = await self.archived_to(board, shard)
        if floor == START:
            return False
        prefix = board.prefixes[shard]
        if parse_id((await self.mark(prefix)).last) >= floor:  # as usual: no write, nothing to confirm
            return False
        names = [keys.index_key(prefix), keys.gone_key(prefix), keys.journal_key(prefix)]
        status, _ = await self._script(names, ["start", format_id(floor)], confirm)
        if _text(status) != "started":
            return False
        self.progress(
            f"{board.config.id} shard {shard}: its journal's next ids set past {format_id(floor)}, "
            "the newest id PostgreSQL holds of the shard"
        )
        return True

    async def _recall(self, prefix: str, records: RetryRecords) -> int:
        """rebuild.lua's ``recall`` of the records gathered so far, if any; returns how many."""
        n = len(records)
        if n:
            names, header, items = records.take()
            head = [keys.index_key(prefix), keys.gone_key(prefix), keys.journal_key(prefix)]
            await self._script([*head, keys.pin_span_key(prefix), *names], ["recall", header, items])
        return n

    async def mark(self, prefix: str) -> Mark:
        last, first, seconds, micros = await self.script(
            keys=[keys.index_key(prefix), keys.gone_key(prefix), keys.journal_key(prefix)], args=["mark"]
        )
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        # A journal that does not exist (or exists empty) still gets ids from the clock: any entry
        # added after this call has an id of at least now_ms.
        position = max(parse_id(last), (now_ms - 1, SEQ_MAX))
        return Mark(_text(last), position, parse_id(first) if first else None)

    async def since(self, board: Board, shard: int, after: Id, upto: Id) -> list[Applied]:
        """The shard's results with journal ids in (after, upto]: from the journal, then from
        PostgreSQL those the archiver trimmed away before the journal was read. The archiver trims
        from the start, so whether it trimmed into the range is asked after the read (an entry
        trimmed during the read is then found in PostgreSQL; one found in both is taken once)."""
        return (await self.changes(board, shard, after, upto))[0]

    async def changes(self, board: Board, shard: int, after: Id, upto: Id) -> tuple[list[Applied], Cuts]:
        """``since``, without the results of removed (before their removal, but in the periods it
        left whole) or banned players, and the removals in the range, per player. A best or set
        result trimmed away whose row a later application of its (match, player) replaced after a
        period closed is read from its hold, as ``snapshot`` reads them (the row alone, at the later
        id, skips that period)."""
        prefix = board.prefixes[shard]
        read = await self._entries(prefix, after, upto)
        first = (await self.mark(prefix)).first
        found = [(parse_id(entry.id), r) for entry in read for r in entry.results]
        cuts = _cuts(read)
        if first is None or first > after:
            ids = {entry.id for entry in read}
            found += await self._rows(board, shard, after, upto, skip=ids)
            if board.config.mode != "incr":  # read after the rows, as in ``snapshot``
                found += await self._rows(board, shard, after, upto, skip=ids, holds=True)
            cuts = _merged(cuts, await self._removals(board, shard, after, upto))
        kept = _kept(board, cuts, await moderation.banned_in(self.db, board))
        return [r for r in (kept(i, r) for i, r in found) if r is not None], cuts

    async def _removals(
        self, board: Board, shard: int, after: Id | None, upto: Id | None, partial: bool = False
    ) -> Cuts:
        """Removals the archiver recorded for the shard with ids in (after, upto]; with ``partial``,
        only those that left some periods whole (the query in ``_rows`` leaves out the results
        before the others)."""
        position = _position("journal_id")
        sql = (
            "SELECT player_id, journal_id, kept FROM player_removals WHERE board = %s AND incarnation = %s "
            "AND shard = %s"
        )
        params: list[Any] = [board.config.id, board.incarnation, shard]
        if partial:
            sql += " AND kept IS NOT NULL"
        if after is not None:
            sql += f" AND {position} > (%s, %s)"
            params += after
        if upto is not None:
            sql += f" AND {position} <= (%s, %s)"
            params += upto
        async with self.db.transaction():
            cur = await self.db.execute(sql, params)
            cuts: Cuts = {}
            for player, entry_id, kept in await cur.fetchall():
                periods = None if kept is None else frozenset(kept)
                cuts.setdefault(player, []).append((parse_id(entry_id), periods))
        return cuts

    async def members(self, key: str) -> dict[str, int]:
        """A sorted set as player -> score, read with ZSCAN (a member present all along is seen)."""
        out: dict[str, int] = {}
        async for member, score in self.client.zscan_iter(key, count=PAGE):
            out[_text(member)] = int(score)
        return out

    async def _entries(self, prefix: str, after: Id | None, upto: Id) -> list[Entry]:
        start = "-" if after is None else "(" + format_id(after)
        pages = self._pages(keys.journal_key(prefix), start, format_id(upto))
        return [entry async for page in pages for entry in page]

    async def _pages(self, key: str, start: str, end: str) -> AsyncIterator[list[Entry]]:
        """The journal's entries from ``start`` to ``end`` (XRANGE's bounds), PAGE at a time."""
        while True:
            got: Any = await self.client.xrange(key, min=start, max=end, count=PAGE)
            yield [decode(entry_id, fields) for entry_id, fields in got if fields]
            if len(got) < PAGE:
                return
            start = "(" + _text(got[-1][0])

    async def _rows(
        self,
        board: Board,
        shard: int,
        after: Id | None,
        upto: Id | None,
        skip: set[str] | None = None,
        holds: bool = False,
    ) -> list[tuple[Id, Applied]]:
        """The shard's rows with journal ids in (after, upto], without those journaled before a
        removal of their player on this shard (shardlb/moderation.py) that left no period whole (the
        few others, and banned players' rows, are the callers': ``_removals``, ``_kept``).

        With ``holds``, its rows of ``match_holds`` instead: a best or set result's earlier
        application that a later one of its (match, player) replaced in ``match_results`` after a
        period closed (shardlb/archive.py). Each counts in its one period only: the others of its
        time are given as skipped."""
        sql = rows_sql(holds, after is not None, upto is not None)
        params: list[Any] = [board.config.id, board.incarnation, shard]
        if after is not None:
            params += after
        if upto is not None:
            params += upto
        async with self.db.transaction():
            await self.db.execute(ROWS_SETTINGS)
            cur = await self.db.execute(sql, params)
            found = await cur.fetchall()
        codec = board.codec
        skip = skip or set()
        out = []
        for m, p, points, at, entry_id, skipped in found:
            if entry_id in skip:
                continue
            units = (at - codec.epoch_ms) // codec.unit_ms
            if holds:  # ``skipped`` is the hold's period: every other one of its time is skipped
                skipped = [n for n in board.period_names(codec.units_to_ms(units)) if n != skipped]
            out.append((parse_id(entry_id), Applied(m, p, points, units, tuple(skipped or ()))))
        return out

    # ---- writing -------------------------------------------------------------------------

    async def _fill(self, key: str, members: dict[str, int], hash: bool = False) -> None:
        """A temporary sorted set (or hash) in the shard's slot, expiring should the rebuild not
        swap it in."""
        if not members:
            return
        items = list(members.items())
        pipe = self.client.pipeline()
        for i in range(0, len(items), PAGE):
            if hash:
                pipe.hset(key, mapping=dict(items[i : i + PAGE]))
            else:
                pipe.zadd(key, dict(items[i : i + PAGE]))
        pipe.pexpire(key, TMP_TTL_MS)
        await pipe.execute()

    async def _versions(self, prefix: str) -> dict[str, int]:
        raw: dict[Any, Any] = await self.client.hgetall(keys.version_key(prefix))
        return {_text(p): int(v) for p, v in raw.items()}

    async def _live_periods(self, prefix: str, wanted: Callable[[str], bool]) -> set[str]:
        """The wanted period boards the shard holds now (a rebuild that finds none removes them)."""
        listed = await self.client.zrange(keys.index_key(prefix), 0, -1)
        names = (_text(k)[len(prefix) :] for k in listed if _text(k).startswith(prefix))
        return {n for n in names if _PERIOD.fullmatch(n) and wanted(n)}

    def _items(self, fold: Fold, results: Iterable[Applied], pairs: dict[str, str]) -> list[Any]:
        numbers = {name: i + 1 for i, name in enumerate(pairs)}
        codec = fold.codec
        out: list[Any] = []
        for r in results:
            score = codec.encode_units(r.points, r.units)
            for name in fold.names(r):
                out += [r.player_id, score, r.points, r.units, numbers[name]]
        return out

    async def _call(
        self,
        board: Board,
        shard: int,
        op: str,
        pairs: dict[str, str],
        expected: str,
        force: bool,
        items: Sequence[Any],
        sizes: dict[str, int] | None = None,
        swap: str = "",
        left: Cuts | None = None,
        confirm: bool = False,
    ) -> tuple[str, str]:
        """rebuild.lua's ``swap`` (targets: the temporary keys, each of its size in ``sizes``;
        it sets the marker ``swap``) or ``apply`` (the live keys, leaving out the players ``left``,
        removed since the swap, but in the periods their removals left whole; refused unless the
        marker is ``swap``). ``confirm``: the call waits for a replica whatever
        ``confirming`` says (``_acked``)."""
        prefix = board.prefixes[shard]
        targets = [
            (target, keys.period_key(prefix, name), period_expiry(board, name), (sizes or {}).get(name, -1))
            for name, target in pairs.items()
        ]
        if op == "apply":
            targets = [(live, live, expiry, -1) for _, live, expiry, _ in targets]
        return await self._swap_keys(
            prefix, targets, op, board, expected, force, items, _left(left or {}), swap, confirm
        )

    async def _swap_keys(
        self,
        prefix: str,
        targets: Sequence[tuple[str, str, int, int]],
        op: str = "swap",
        board: Board | None = None,
        expected: str = "",
        force: bool = True,
        items: Sequence[Any] = (),
        left: Sequence[str] = (),
        swap: str = "",
        confirm: bool = False,
    ) -> tuple[str, str]:
        """rebuild.lua's ``swap`` or ``apply`` of ``targets``: (target, live key, expiry, the size the
        target was filled to, -1 for none: ``apply``). Returns (status, the journal's last id); the
        status of a swap is "lost" when a target is not as filled (it changed nothing), that of an
        apply "unswapped" when the shard's swap marker is not ``swap`` (it changed nothing)."""
        c = None if board is None else board.codec
        header = [
            board.config.mode if board else "best", c.time_bits if c else 0, c.points_max if c else 0,
            c.order if c else "desc", c.tiebreak if c else "earliest", expected, int(force),
            [expiry for _, _, expiry, _ in targets], [size for _, _, _, size in targets], list(left),
            swap, TMP_TTL_MS,
        ]  # fmt: skip
        names = [keys.index_key(prefix), keys.gone_key(prefix), keys.journal_key(prefix)]
        for target, live, _, _ in targets:
            names += [target, live]
        args = [op, msgpack.packb(header), msgpack.packb(list(items))]
        status, last = await self._script(names, args, confirm)
        return _text(status), _text(last)

    async def check_layout(self, board: Board, whole: str = "", reads: Iterable[int] | None = None) -> None:
        """Refuse to go on when the registry's record (read now, not the caller's copy, which a
        router may have kept for seconds) is not ``board``'s layout at rest: a reshard under way
        copies the shards without the rebuild's writes (rebuild.lua refuses them too, on the
        shards the reshard has marked), and a layout replaced or a board deleted is not the one
        being rebuilt. ``whole``: the caller's work (a verb: "settle", "reconcile"), which compares
        every shard with the archive, refused (Rebuilding) too while the record names shards not
        rebuilt yet after a loss of Redis: they would all show drift that the rebuild mends.
        ``reads``: the shards that work reads, when not every one (a settlement reads a band
        board's home shards alone): the marks of the others refuse nothing."""
        raw = await self.client.hget(keys.BOARDS, board.config.id)
        record = None if raw is None else orjson.loads(raw)
        if (
            record is None
            or record.get("state") == "deleting"
            or str(record.get("incarnation", "0")) != board.incarnation
        ):
            raise BoardNotFound("the board was deleted during the rebuild", "board")
        if record.get("reshard") or int(record.get("generation", 0)) != board.generation:
            raise _resharding(board)
        waiting = not_rebuilt(record)
        if reads is not None:
            waiting &= set(reads)
        if whole and waiting:
            raise rebuilding(
                board.config.id,
                waiting,
                f"{whole} it once {'it is' if len(waiting) == 1 else 'they are'} rebuilt",
                band_shards(board),
            )

    async def _script(self, names: Sequence[str], args: Sequence[Any], confirm: bool = False) -> Any:
        """rebuild.lua, with a deleted board's refusal as BoardNotFound, and a shard's refusal while
        a reshard has marked it (BOARDMOVED) as the rebuild's refusal during a reshard. A swap,
        and what goes on the live keys after it (``apply``, ``recall``), is confirmed as
        ``confirming`` asks, or, with ``confirm``, wherever the shard's primary has a replica
        (``_acked``)."""
        op = args[0]
        replicated = self.confirming
        if replicated is None and confirm:
            replicated = self._replicated = self._replicated or Replicated(self.client)
        script = self.script
        if op in CONFIRMED and replicated is not None:
            script = await self._acked(replicated, names[0], once=op == "apply")
        try:
            return await script(keys=names, args=args)
        except NotAcknowledged as e:
            assert replicated is not None
            raise NotAcknowledged(
                f"no replica confirmed the rebuild's {op} on {names[0].removesuffix('idx')!r} within "
                f"{self.replica_wait_ms} ms on {replicated.describe(names[0])}: a failover could "
                "lose it. Run the rebuild again once that replica is in sync with its primary"
            ) from e
        except ResponseError as e:
            if str(e).startswith(GONE):
                raise BoardNotFound("the board was deleted during the rebuild", "board") from e
            if str(e).startswith(MOVED):
                raise BoardConflict(
                    "the board is being resharded: rebuild it once that is over", "board"
                ) from e
            raise

    async def _acked(self, replicated: Replicated, key: str, once: bool = False) -> Script:
        """rebuild.lua for a call on the shard of ``key``: once ``restore`` set ``confirming`` (or
        for the apply after a forced swap, ``replicated``: see ``_apply_live``), and wherever the
        shard's primary has a replica, the call, the marker and WAIT on one connection
        (``fanout.AckedScript``): NotAcknowledged when no replica has it within
        ``replica_wait_ms``. After a failover a swap is made again on the new primary, where it
        swaps the temporary keys in if they are there and not swapped, or answers "lost" and the
        shard is filled again; a ``recall`` is made again too (it only adds what is missing). An
        ``apply`` is not (``once``: it adds an incr board's points): its connection broken, it
        raises NotAcknowledged, and the rebuild run again folds the shard from the journal and
        the archive. Until 2026-12-05 a kill -9 of the primary right after the swap could lose
        the board `rebuild --all` had just put back, and it said it was done; and the apply was
        confirmed by a call of its own after it (an EXISTS with the marker and WAIT), which a
        failover in between had the replica promoted confirm without it."""
        await replicated.read()
        if not replicated(key):
            return self.script
        return AckedScript.of(self.script, Ack(1, self.replica_wait_ms), once=once)


Item = TypeVar("Item")
Done = TypeVar("Done")


async def side_by_side(
    workers: Sequence[Rebuilder],
    items: Sequence[Item],
    work: Callable[[Rebuilder, Item], Awaitable[Done]],
    name: Callable[[Item], str],
    progress: Callable[[str], None],
    then: Callable[[Rebuilder, Done], Awaitable[None]] | None = None,
) -> list[Done]:
    """``work(worker, item)`` for each of ``items``, each worker taking the next item once it is
    done with its last (so at most ``len(workers)`` at once, in the items' order); the results in
    the items' order. ``then``: a second step on each result but None (``Rebuilder.recover``: a
    board's rebuild once it is restored), taken by a worker when no item is left to begin, in the
    order the results came; a worker with none ready waits for one while items are under way.
    An error stops the hand-out: no worker takes another item or step, those under way finish
    theirs (a board is not left between two steps), every error is reported through
    ``progress`` naming its item (with one worker, the error alone is raised, as before), and the
    first is raised once all are done: no task is left running. The items not begun, and the
    results whose ``then`` was not, are where a run one item at a time would have stopped: running
    it all again converges (each step writes what PostgreSQL and the journals say). Anything but
    an Exception (a cancellation, ^C) cancels every worker at once and is raised as it is."""
    results: list[Any] = [None] * len(items)
    pending = iter(enumerate(items))
    errors: list[Exception] = []
    ready: list[int] = []  # items whose result awaits ``then``, oldest first
    begun = 0  # items whose ``work`` is under way
    changed = asyncio.Condition()

    def failed(item: Item, e: Exception) -> None:
        errors.append(e)
        if len(workers) > 1:
            progress(f"{name(item)}: stopped: {type(e).__name__}: {e}")

    def news() -> bool:  # what a worker waiting for a result to take on waits for
        return bool(ready or errors or not begun)

    async def run(worker: Rebuilder) -> None:
        nonlocal begun
        while not errors:
            taken = next(pending, None)  # one iterator for every worker: each item is taken once
            if taken is not None:
                n, item = taken
                begun += 1
                try:
                    results[n] = await work(worker, item)
                    if then is not None and results[n] is not None:
                        ready.append(n)
                except Exception as e:
                    failed(item, e)
                finally:
                    begun -= 1
                    async with changed:
                        changed.notify_all()
                continue
            if then is None:
                return
            if not ready:
                if not begun:
                    return
                async with changed:
                    await changed.wait_for(news)
                continue
            n = ready.pop(0)
            try:
                await then(worker, results[n])
            except Exception as e:
                failed(items[n], e)
                return

    tasks = [asyncio.ensure_future(run(worker)) for worker in workers]
    try:
        await asyncio.gather(*tasks)
    except BaseException:  # raised as it is (a TaskGroup would wrap it), once every task has ended
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if errors:
        raise errors[0]
    return results


async def _held(board: Board) -> int:
    """The players Redis holds on ``board``'s total, counted shard by shard whether or not they are
    rebuilt (``Board.size`` refuses a board being rebuilt: ``Board.check_built``)."""
    view = board.resolve("total")
    return sum(await View(board.client, view.keys, board.scripts.counts).sizes())


def _resharding(board: Board) -> BoardConflict:
    return BoardConflict(
        f"board {board.config.id!r} is being resharded: rebuild or reconcile it once that is over "
        f"(shardlb reshard {board.config.id} --status; --resume finishes one left half done)",
        "board",
    )


def _unswapped(board: Board, shard: int) -> ClusterUnavailable:
    return ClusterUnavailable(
        f"board {board.config.id!r} shard {shard}: the rebuild's forced swap is gone from the shard's "
        "primary before the results written between its last try and the swap were put back (lost in a "
        "failover, or another rebuild of the shard swapped since): they were not applied again, the "
        "board the shard holds now has them already. Rebuild it again once the cluster is stable",
        "board",
    )


def _lost(board: Board, shard: int) -> ClusterUnavailable:
    return ClusterUnavailable(
        f"board {board.config.id!r} shard {shard}: the rebuild's temporary keys were lost before the "
        f"swap {FILL_TRIES} times (failovers?); nothing was swapped in. Rebuild it again once the "
        "cluster is stable",
        "board",
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _freeze_begun(db: psycopg.AsyncConnection[Any]) -> str | None:
    """The settlements table's column ``freeze_begun`` (shardlb/settlement.py, ``_freeze_begun``)
    as an expression to select: the column, or NULL (cannot tell) when the table was set up by a
    release before it and no settlement of this one has run since (its ALTER TABLE comes with
    one); None when the archive has no settlements table."""
    cur = await db.execute(
        "SELECT to_regclass('settlements') IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute a "
        "WHERE a.attrelid = to_regclass('settlements') AND a.attname = 'freeze_begun' AND NOT a.attisdropped)"
    )
    found = await cur.fetchone()
    if not found or not found[0]:
        return None
    return "freeze_begun" if found[1] else "NULL::boolean"


# Whether the archive holds a row of a board (its id and incarnation): ``_check_archive``. Ordered by
# the primary key, so the planner reads its index: with LIMIT alone it took a sequential scan, which
# reads every row stored before the board's first (tests/test_read_plans.py).
ANY_ROW = (
    "SELECT 1 FROM match_results WHERE board = %s AND incarnation = %s "
    "ORDER BY board, incarnation, match_id, player_id LIMIT 1"
)


# For the transaction of ``rows_sql``'s read (``Rebuilder._rows``): no nested loop. On a board grown
# since the last ANALYZE (estimated at a row or two) the planner made the NOT EXISTS on
# player_removals a nested-loop anti join over the (board, incarnation, shard) prefix, every removal
# of the shard read again for each row: 32 s for a shard of 25,000 rows and 2,500 removals, 1.4 s
# for 5,000 and 1,000 (tests/test_read_plans.py). Without it, a hash of the shard's removals (and of
# the bans), read once: 32 ms there, and 45 ms against 37 on an archive analysed as it is (a
# look-up of each row's removals by their full key instead took 120 and 165 ms; 2026-12-06).
ROWS_SETTINGS = "SELECT set_config('enable_nestloop', 'off', true)"


def rows_sql(holds: bool, after: bool, upto: bool) -> str:
    """``Rebuilder._rows``'s query (parameters: board, incarnation, shard, then the journal ids
    ``after`` and ``upto`` as (ms, seq) when given), run after ``ROWS_SETTINGS`` in its transaction.

    Banned players' rows are not left out here but by its callers, with the journal's entries
    (``_kept``, from ``moderation.banned_in``): one reading of the bans for both. Until 2026-12-06
    the query left them out too, and with nested loops off that NOT EXISTS hashed every ban of
    every board for each shard read: 300 ms a shard of 20,000 rows with 1,000,000 bans of other
    boards, against 25-31 ms without it (tests/test_read_plans.py)."""
    position = _position("m.journal_id")
    # Most results skipped no period: NULL for them, which psycopg reads as None, where an empty
    # array took a microsecond a row to parse, as much as the rest of the row (2026-12-06).
    columns = "m.period" if holds else "nullif(m.skipped, '{}')"
    sql = (
        f"SELECT m.match_id, m.player_id, m.points, m.achieved_ms, m.journal_id, {columns} "
        f"FROM {'match_holds' if holds else 'match_results'} m "
        "WHERE m.board = %s AND m.incarnation = %s AND m.shard = %s "
        "AND NOT EXISTS (SELECT 1 FROM player_removals x "
        "WHERE (x.board, x.incarnation, x.shard, x.player_id) "
        "= (m.board, m.incarnation, m.shard, m.player_id) "
        f"AND {_position('x.journal_id')} > {position} AND x.kept IS NULL)"
    )
    if after:
        sql += f" AND {position} > (%s, %s)"
    if upto:
        sql += f" AND {position} <= (%s, %s)"
    return sql


# The shard's results that arrived at or after a time (ms), for its retry records (``Rebuilder.refill``;
# parameters: board, incarnation, shard, the time).
RECENT_ROWS = (
    "SELECT match_id, player_id, achieved_ms, split_part(journal_id, '-', 1)::bigint FROM match_results "
    "WHERE board = %s AND incarnation = %s AND shard = %s AND split_part(journal_id, '-', 1)::bigint >= %s"
)


def newest_sql(table: str) -> str:
    """The newest journal id of a board's shard in ``table`` (``Rebuilder.archived_to``; parameters:
    board, incarnation, shard)."""
    return (
        f"SELECT journal_id FROM {table} WHERE board = %s AND incarnation = %s AND shard = %s "
        f"ORDER BY {_position('journal_id')} DESC LIMIT 1"
    )


def _position(column: str) -> str:
    """A journal id column as a (ms, seq) row value that PostgreSQL orders as Redis does."""
    return f"(split_part({column}, '-', 1)::numeric, split_part({column}, '-', 2)::numeric)"


def _cuts(entries: Iterable[Entry]) -> Cuts:
    """The journal's removals (delete entries), per player."""
    cuts: Cuts = {}
    for entry in entries:
        for player in entry.removed:
            cuts.setdefault(player, []).append((parse_id(entry.id), entry.kept_in(player)))
    return cuts


def _merged(cuts: Cuts, more: Cuts) -> Cuts:
    """``cuts`` and ``more``, a removal found in both (the journal and PostgreSQL) taken once."""
    out = dict(cuts)
    for player, found in more.items():
        out[player] = sorted({*out.get(player, ()), *found}, key=lambda cut: cut[0])
    return out


def _kept(board: Board, cuts: Cuts, banned: set[str]) -> Callable[[Id, Applied], Applied | None]:
    """A result journaled at an id as it counts: None when its player is banned, or removed after it
    by a removal that left no period whole; else in the periods every removal after it left whole
    (the others added to its ``skipped``: a removal made at an earlier call's time keeps the
    player's entries achieved since, period by period, remove.lua), or as it is."""
    codec = board.codec

    def kept(entry_id: Id, r: Applied) -> Applied | None:
        if r.player_id in banned:
            return None
        found = cuts.get(r.player_id)
        if not found:  # as most are
            return r
        later = [periods for at, periods in found if at > entry_id]
        if not later:
            return r
        if None in later:
            return None
        every = board.period_names(codec.units_to_ms(r.units))
        dropped = {n for n in every if n not in r.skipped and any(n not in p for p in later if p is not None)}
        if not dropped:
            return r
        if all(n in dropped or n in r.skipped for n in every):
            return None
        return r._replace(skipped=tuple(n for n in every if n in dropped or n in r.skipped))

    return kept


def _left(gone: Cuts) -> list[str]:
    """rebuild.lua's ``left`` for ``gone`` (removals since a forced swap), flat: per player, the
    periods every one of their removals left whole, comma-separated ('': none)."""
    out: list[str] = []
    for player, found in sorted(gone.items()):
        kept = [periods for _, periods in found]
        held = frozenset[str]() if None in kept else frozenset.intersection(*kept)  # type: ignore[arg-type]
        out += [player, ",".join(sorted(held))]
    return out


def _active(cuts: Cuts, banned: set[str]) -> Callable[[Id, Applied], bool]:
    """Whether a result journaled at an id sets its player's time in the activity set (write.lua's
    `seen`): unless the player is banned, or removed after it by a removal that left no period whole.
    remove.lua keeps the activity entry with any period entry it keeps, so a post it took out of
    every period it was in (a best total of before the removal) still counts there."""

    def counts(entry_id: Id, r: Applied) -> bool:
        if r.player_id in banned:
            return False
        return not any(at > entry_id and periods is None for at, periods in cuts.get(r.player_id, ()))

    return counts


def _removal_items(cuts: Cuts, pairs: dict[str, str]) -> list[Any]:
    """rebuild.lua's items for ``cuts``, the removals among results applied to ``pairs`` (period ->
    key, numbered from 1 in their order, as ``Rebuilder._items`` numbers them): a player removed
    from every pair (number 0), or from each pair one of their removals did not leave whole (its
    number, negative)."""
    out: list[Any] = []
    for player, found in cuts.items():
        kept = [periods for _, periods in found]
        if None in kept:
            out += [player, 0, 0, 0, 0]
            continue
        for n, name in enumerate(pairs, 1):
            if any(p is not None and name not in p for p in kept):
                out += [player, 0, 0, 0, -n]
    return out


# What a rebuild and a reconcile read of the archive: each table by the last column it gained (a
# newer archiver's ALTER TABLE), so an archive an archiver of before set up is told apart too.
ARCHIVE_COLUMNS = (
    ("boards", "settings"),
    ("match_results", "skipped"),
    ("match_holds", "journal_id"),
    ("player_removals", "kept"),
    ("removal_records", "request_mark"),
    ("bans", "incarnation"),
)


async def check_schema(db: psycopg.AsyncConnection[Any]) -> None:
    """ArchiveUnprepared when a table or column of ``ARCHIVE_COLUMNS`` is missing. Read only: the
    archiver sets the schema up (``archive.connect_db``), which a rebuild leaves to it, as its
    connection (a router's admin endpoint, an operator's tool) may have no right to run DDL, and
    tables created here would make a wrong --postgres look like an empty archive."""
    async with db.transaction():
        cur = await db.execute(
            "SELECT w.t, w.c, to_regclass(w.t) IS NOT NULL FROM unnest(%s::text[], %s::text[]) "
            "WITH ORDINALITY AS w(t, c, n) WHERE NOT EXISTS (SELECT 1 FROM pg_attribute a "
            "WHERE a.attrelid = to_regclass(w.t) AND a.attname = w.c AND NOT a.attisdropped) ORDER BY w.n",
            ([t for t, _ in ARCHIVE_COLUMNS], [c for _, c in ARCHIVE_COLUMNS]),
        )
        missing = [f"column {t}.{c}" if there else f"table {t}" for t, c, there in await cur.fetchall()]
    if missing:
        raise ArchiveUnprepared(
            f"PostgreSQL has no {', no '.join(missing)}: no archiver of this version has set up its "
            "schema in this database. Start `shardlb archive` against it first (it creates them), or "
            "check the PostgreSQL URL"
        )


@asynccontextmanager
async def connected(
    redis_url: str, postgres_url: str, progress: Callable[[str], None] | None = None, jobs: int = 1
) -> AsyncIterator[tuple[Rebuilder, BoardStore]]:
    """A Rebuilder and the board registry on fresh connections (closed on exit): what `shardlb
    rebuild`, `shardlb reconcile` and the router's admin endpoint work with. ArchiveUnprepared
    when PostgreSQL lacks the archive's schema (``check_schema``). ``jobs``: the Rebuilder's (it
    opens a connection of its own for each board it takes beyond the first)."""
    raw, client = connect(redis_url, decode=False, timeout=30.0), connect(redis_url)
    try:
        settings = pgconn.options(postgres_url)

        async def another() -> psycopg.AsyncConnection[Any]:
            return await psycopg.AsyncConnection.connect(postgres_url, autocommit=True, **settings)

        db = await another()
        try:
            await check_schema(db)
            yield (
                Rebuilder(raw, Scripts.register(raw).rebuild, db, progress, jobs=jobs, connect=another),
                BoardStore(client, Scripts.register(client)),
            )
        finally:
            await db.close()
    finally:
        await raw.aclose()
        await client.aclose()


async def run(
    redis_url: str,
    postgres_url: str,
    boards: Sequence[str] | None,
    period: str | None = None,
    shard: int | None = None,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
    jobs: int = REBUILD_JOBS,
) -> dict[str, list[ShardReport]]:
    """Rebuild ``boards``, or, when None, every board PostgreSQL knows (put back in the registry
    first when it is missing there: ``Rebuilder.recover``), ``jobs`` boards at a time
    (``Rebuilder.rebuild_all``)."""
    async with connected(redis_url, postgres_url, progress, jobs) as (rebuilder, store):
        if boards is None:
            return await rebuilder.recover(store, period, shard, force)
        return await rebuilder.rebuild_all([await store.get(b) for b in boards], period, shard, force)
