"""One board spread over many shards: validated writes applied per shard, and exact merged reads."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

import msgpack
import orjson
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from shardlb import keys, merge, periods, times
from shardlb.bands import BandMoves, Move
from shardlb.config import (
    ID_PATTERN,
    MATCH_ID_MAX,
    MAX_BANDS,
    PIN_SPAN,
    RANK_MODES,
    BoardConfig,
    Sharding,
    all_ids,
    check_id,
)
from shardlb.connection import Scripts
from shardlb.errors import (
    BoardClosed,
    BoardNotFound,
    InvalidInput,
    Overloaded,
    PartlyApplied,
    PlayerNotFound,
    Rebuilding,
    Resharding,
)
from shardlb.fanout import ScriptPipeline, batch
from shardlb.merge import Row
from shardlb.reads import ONE_ROUND_BANDS, SHALLOW, BandPlace, Located, ResolvedView, View
from shardlb.sharding import Layout

STATUS = {"i": "improved", "u": "unchanged", "d": "duplicate", "o": "overflow", "r": "region_conflict"}
GONE = "BOARDGONE"  # the error write.lua and band.lua answer with once the board was deleted
MOVED = "BOARDMOVED"  # the scripts' error while a reshard holds the shard (shardlb/reshard.py)
REBUILDING_RETRY_S = 5.0  # Retry-After of a call refused while its shards are rebuilt (check_built)
CLOSED = "BOARDCLOSED"  # write.lua's error once the board's total is closed (a season's archive)
JOURNAL_FULL = "JOURNALFULL"  # write.lua's error when the shard's journal is at its bound
LOST = "SHARDLOST"  # write.lua's error (then the shard) when its sentinel is missing (keys.sentinel_key)
# Results a shard's journal may hold not yet archived before writes are refused: the buffer while
# PostgreSQL or the archiver is down (router setting SHARDLB_JOURNAL_MAX_RESULTS). Counted in
# results, it lasts the same time at any call size, and bounds memory at about 67 to 284 bytes a
# result (calls of many results to calls of one: `shardlb plan`).
JOURNAL_MAX_RESULTS = 1_000_000
# Entries (script calls) it may hold (SHARDLB_JOURNAL_MAX_ENTRIES): an entry counts at least one
# result (a removal's delete entry, a player: remove.lua), so entries never outnumber the results
# bound, and by default this one never bites (the setting's maximum). Set it lower to cap entries too.
JOURNAL_MAX_ENTRIES = 100_000_000
MAX_FUTURE_MS = 5 * 60_000
HOLDS_NOTHING_MARGIN_MS = 3_600_000  # Board.holds_nothing's margin for other clocks
# How often a process's write calls ask write.lua to drop a shard's index listings of expired keys.
TRIM_EVERY_MS = 1000
# Period names are cached per quarter hour of the time: each quarter keeps the local days (almost
# always one) that meet it, with their bounds (Board.periods_at).
QUARTER_HOUR_MS = 15 * 60_000
_new = tuple.__new__  # builds a NamedTuple from a tuple of its fields without its __new__'s call


STREAM_VALUES = (
    6_000  # at most this many item values go to write.lua as a stream (a Lua call returns <= 8,000)
)
SAME_PERIODS_MS = 86_400_000  # how far (a day either way) write.lua's window of a pin's periods reaches
KEPT_BAND_SIZES = 256  # banded views whose band sizes a board keeps for max_age_ms reads
PLACED_PLAYERS = 20_000  # players whose last band a board keeps for max_age_ms reads (a few MB)
COUNTED_PLAYERS = 20_000  # hash boards: players whose other shards' counts a board keeps (a few MB)
MAX_TOTAL_VIEWS = 256  # a region board's regions, and its whole view: more than any board has


class Score(NamedTuple):
    """One match result for one player, as a game server posts it."""

    player_id: str
    points: int
    match_id: str
    achieved_ms: int | None = None
    region: str | None = None


# Prepared and Result are made once per score on the write path: tuples build several times faster
# than frozen dataclasses, and read the same.
class Prepared(NamedTuple):
    """A checked Score with its home shard and packed score, ready for a shard's script call."""

    player_id: str
    match_id: str
    points: int
    units: int
    score: int
    shard: int
    periods: tuple[str, ...]
    server_time: bool = False  # no achieved time was sent: the write pins the server's (see write.lua)


class Result(NamedTuple):
    player_id: str
    match_id: str
    status: str
    points: int
    closed: tuple[str, ...] = ()  # the periods (API names) it was not applied to: closed or frozen


@dataclass(frozen=True, slots=True)
class Entry:
    rank: int
    player_id: str
    points: int
    achieved_ms: int


@dataclass(frozen=True, slots=True)
class PlayerEntry:
    entry: Entry
    players: int
    percentile: float
    # With ``max_age_ms``: when the counts of the rows on other shards were read (ms since the
    # epoch); the player's own shards are always read at the time of the call.
    counts_ms: int | None = None


P = ParamSpec("P")
R = TypeVar("R")


Read = Callable[Concatenate["Board", P], Coroutine[Any, Any, R]]


def exact(read: Read[P, R]) -> Read[P, R]:
    """A public read that stays exact while the board is resharded: on a board whose layout is
    being moved (``Board.moving``) the answer is checked against the layout's markers after it was
    read (``Board.check_layout``), and refused (Resharding) once another layout took over. While the
    record names a reshard the archiver marks no shard lost alone, so the same check looks at the
    layout's sentinels: a shard found without one is held as not rebuilt (``rebuilding``, as
    write.lua's refusal holds it) and the read made again, refused if it merges that shard."""

    @functools.wraps(read)
    async def checked(self: Board, /, *args: P.args, **kwargs: P.kwargs) -> R:
        answer = await read(self, *args, **kwargs)
        if self.moving or (self.resharding and self.sentinels):
            lost = await self.check_layout()
            if not lost <= self.rebuilding:
                self.rebuilding = self.rebuilding | lost
                return await checked(self, *args, **kwargs)
        return answer

    return checked


def band_skew(sizes: Sequence[int]) -> float:
    """A band board's largest band over its mean band, in players (``Board.band_sizes``): 1.0 when
    the bands are even, 0.0 for an empty board. ``shardlb bands --apply`` reshards above its --skew."""
    total = sum(sizes)
    return round(max(sizes) * len(sizes) / total, 3) if total else 0.0


def by_shard(prepared: Sequence[Prepared]) -> dict[int, list[int]]:
    """The positions of ``prepared`` grouped by home shard, in their order within each shard."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prepared):
        groups[p.shard].append(i)
    return groups


def rounds(sharding: Sharding, prepared: Sequence[Prepared]) -> list[list[int]] | None:
    """On a region board where a request names a player under several regions, the positions of
    ``prepared`` in the rounds their calls are made in, one after the other: round k holds each
    player's results that name the k-th region the request names for them. None when one round
    holds everything (every other board, and nearly every region request).

    Why: write.lua homes a player new to the board in the region whose call comes first and
    refuses the other (region_conflict). The regions' shards are called separately (not atomic
    together): concurrent calls made the home a race, and a request half applied (the first
    region's call lost) and retried homed the player in the other region, where one whole call
    homed them in the first. In rounds, a round is sent once the one before was applied whole, so
    the first region the request names is written first, every try (design-notes, "Regions")."""
    if sharding.strategy != "region":
        return None
    per = sharding.shards_per_region
    named: dict[str, list[int]] = {}
    ranks = []
    for p in prepared:
        regions = named.setdefault(p.player_id, [])
        region = p.shard // per
        if region not in regions:
            regions.append(region)
        ranks.append(regions.index(region))
    if not any(ranks):
        return None
    order: list[list[int]] = [[] for _ in range(max(ranks) + 1)]
    for i, rank in enumerate(ranks):
        order[rank].append(i)
    return order


async def in_rounds(
    prepared: Sequence[Prepared],
    rounds: Sequence[Sequence[int]],
    apply: Callable[[list[Prepared]], Coroutine[Any, Any, list[Result]]],
) -> list[Result]:
    """The results of ``prepared`` applied round after round (``rounds``) by ``apply``, in
    their order: a round that fails fails the whole, and the rounds after it are not sent."""
    results: list[Result | None] = [None] * len(prepared)
    for positions in rounds:
        for i, result in zip(positions, await apply([prepared[i] for i in positions]), strict=True):
            results[i] = result
    return [r for r in results if r is not None]


def band_shards(board: Board) -> range:
    """A band board's band shards (after its home shards: a rebuild makes them again from the
    homes' totals, ``Rebuilder.rebuild_bands``); none for any other board."""
    if board.layout.strategy != "band":
        return range(0)
    return range(board.layout.sharding.shards, len(board.prefixes))


def whence(shards: Iterable[int], bands: Iterable[int] = ()) -> str:
    """Where a rebuild of ``shards`` takes them from, ``bands`` among them being band shards: "from
    PostgreSQL and the journal" (home and hash shards), "from the home shards" (band shards), both
    said when both are there."""
    shards = sorted(shards)
    banded = [s for s in shards if s in set(bands)]
    homes = [s for s in shards if s not in banded]
    if not banded:
        return "from PostgreSQL and the journal"
    if not homes:
        return "from the home shards"

    def named(these: list[int]) -> str:
        return ("shard " if len(these) == 1 else "shards ") + listed(these)

    return f"({named(homes)} from PostgreSQL and the journal, {named(banded)} from the home shards)"


def listed(shards: Iterable[int], most: int | None = None) -> str:
    """``shards`` as "1, 2, 3", runs of four or more as "4-9"; past ``most`` of those, the others as
    "and N more"."""
    runs: list[list[int]] = []
    for s in sorted(shards):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    said = [f"{r[0]}-{r[-1]}" if len(r) > 3 else ", ".join(map(str, r)) for r in runs]
    if most is None or len(said) <= most:
        return ", ".join(said)
    more = sum(len(r) for r in runs[most:])
    return ", ".join(said[:most]) + f" and {more} more"


# The longest message ``rebuilding`` gives: the router cuts an error's message at its MESSAGE_MAX
# (router/errors.py), the same 300.
REBUILDING_MAX = 300


def rebuilding(
    board_id: str, waiting: Iterable[int], then: str, bands: Iterable[int] = (), resharding: bool = False
) -> Rebuilding:
    """The refusal of a call on a board whose shards ``waiting`` lost their data in Redis and are
    not rebuilt yet: all of Redis lost, `rebuild --all` restoring the board (docs/design-notes.md, "A
    board being rebuilt"), or a shard's slot lost alone, marked by the archiver or met by a script
    ("A shard lost alone"), which nothing rebuilds until an operator runs the command it names.
    ``then`` says what the caller may do; ``bands``, the board's band shards (``band_shards``), which
    a rebuild takes from the home shards. Until 2026-12-06 it said "being rebuilt after a loss of
    Redis" in both cases, though a shard lost alone waits for an operator, and that band shards came
    back "from PostgreSQL and the journal", which their rebuild never reads.

    The message is at most REBUILDING_MAX characters for any board id (``check_id``: up to 64) and
    shards: the shards, then ``then``, then the command once (the only place the board id is
    named), where it takes them from and that a rebuild under way does it too. When that is too
    long, where they come from is left out, then the list of shards is shortened ("and N more").
    Until 2026-12-06 it named the board id twice and was some 250 characters for a short id, so the
    router cut the command or "Nothing was written" off for a long one.

    ``resharding``: the board's record names a reshard, which refuses every rebuild (409) until it
    is over, so the command named is the resume that ends it: a cancel before the cut-over
    (``ShardsLost``) or the finish after it (``Resharder._finish``, which marks the new layout's
    lost shards) then names the rebuild to run. Until 2026-12-06 the refusal named the rebuild."""
    shards = sorted(waiting)
    one = len(shards) == 1
    run = f"`shardlb rebuild {board_id}" + (f" --shard {shards[0]}`" if one else "`")
    back = f"brings {'it' if one else 'them'} back"

    def said(most: int | None, where: bool) -> str:
        head = f"{'shard' if one else 'shards'} {listed(shards, most)}"
        came = f" {whence(shards, bands)}" if where else ""
        told = f"{head} lost {'its' if one else 'their'} data in Redis, not rebuilt yet: {then}. "
        if resharding:
            return (
                f"{told}A reshard is under way: `shardlb reshard {board_id} --resume` ends it and "
                "names any rebuild left to run"
            )
        return f"{told}{run} {back}{came}, unless a rebuild of the board is under way"

    message = said(None, not resharding)
    if len(message) > REBUILDING_MAX:
        message = said(None, False)
    most = 8
    while len(message) > REBUILDING_MAX and most > 1:
        most -= 1
        message = said(most, False)
    return Rebuilding(message, REBUILDING_RETRY_S)


class Board:
    """A board: its settings, its shards' key names, and the calls that read and write it."""

    def __init__(
        self,
        client: RedisCluster,
        config: BoardConfig,
        scripts: Scripts,
        incarnation: str = "0",
        generation: int = 0,
    ) -> None:
        self.client = client
        self.config = config
        self.scripts = scripts
        self.incarnation = incarnation
        self.generation = generation  # the layout's: a reshard draws the next (shardlb/reshard.py)
        self.codec = config.codec()
        self.layout = layout = Layout(config.sharding, config.order)
        self.tz = periods.zone(config.timezone)
        token = keys.layout_token(incarnation, generation)
        self.prefixes = [
            keys.shard_prefix(config.id, i, layout.physical, token, layout.slot_group(i))
            for i in range(layout.physical)
        ]
        # Set once a script reports this incarnation deleted: a cache holding the board drops it.
        self.deleted = False
        # The shards `rebuild --all` restored after a loss of Redis and has not swapped in yet (the
        # registry's record, shardlb/store.py): reads and writes that touch one are refused
        # (``check_built``). Empty but for that window.
        self.rebuilding: frozenset[int] = frozenset()
        # Whether every shard of this layout carries its sentinel (keys.sentinel_key, the record's
        # state) and the board keeps a journal to rebuild from: only then does the archiver take one
        # missing for a shard lost alone, and write.lua refuse a call there (SHARDLOST).
        self.sentinels = False
        # A reshard (shardlb/reshard.py): ``resharding`` while the record names one (any state; the
        # archiver then marks no shard, and reads check the sentinels themselves: ``exact``);
        # ``moving`` while this layout is being copied to another (reads then check that it is still
        # current); ``moved`` once this process learnt that it is not (a cache holding the board
        # fetches it again); ``also``: the other layout's prefixes, whose keys go with the board if
        # it is deleted and whose journals the archiver drains.
        self.resharding = False
        self.moving = False
        self.moved = False
        self.also: list[str] = []
        # Which reshard: when it was recorded (its ``started_ms``). Another one recorded after a
        # cancel has another (router/reshards.py counts a lease's free time per reshard).
        self.reshard_ms: int | None = None
        # The registry's record this Board was made of, as read (``BoardStore.get``; None when made
        # otherwise): a router compares it with the record now when it cannot tell which boards
        # changed (router/boards.py, ``Boards.follow``); and the registry's version read just before
        # it (None when made otherwise): a router keeps a copy fetched while it took in a move of
        # that very version (``Boards._moved_since``).
        self.record: str | bytes | None = None
        self.record_version: Any = None
        self.bands = BandMoves(self)
        self.journal_max = JOURNAL_MAX_ENTRIES
        self.journal_max_results = JOURNAL_MAX_RESULTS
        # Per shard, the second (epoch) of the last write call that asked write.lua to drop its key
        # index's listings of expired keys: one call a second does (TRIM_EVERY_MS).
        self._trimmed: dict[int, int] = {}
        self._dedup_bucket_ms = config.dedup_bucket_ms
        self._days_in_quarter = functools.lru_cache(maxsize=4096)(self._days_meeting)
        self._same_periods = functools.lru_cache(maxsize=64)(self._days_like)
        self._expiry = functools.lru_cache(maxsize=4096)(self._period_expiry)
        self._closes = functools.lru_cache(maxsize=4096)(self._period_closes)
        # Pages that start within this many rows are cut from a merged top; deeper ones bisect.
        self.shallow = SHALLOW
        # Reads may be served by replicas (the router's SHARDLB_READ_FROM; connection.connect).
        self.read_replicas = False
        # The total's views, by region (None: the whole board): they do not change with the clock.
        self._total_views: dict[str | None, ResolvedView] = {}
        # Band boards: each band shard's index among the total view's keys (best band first).
        self._band_at = {shard: i for i, shard in enumerate(layout.view(True))}
        # Band boards: the bands' sizes of each banded view as its last exact rank read them, with
        # when (monotonic s, epoch ms): what ``player(max_age_ms=...)`` may count the other bands by.
        self._band_sizes: dict[tuple[str, ...], tuple[float, int, list[int]]] = {}
        # ... and the band each player read that way was last placed in, asked in the home's round.
        self._placed: dict[tuple[tuple[str, ...], str], int] = {}
        # Hash boards: per (view, player) read with max_age_ms, what the other shards counted for
        # them at their score then: (monotonic s, epoch ms, score, rows ahead, rows in all).
        self._counted: dict[tuple[tuple[str, ...], str], tuple[float, int, float, int, int]] = {}

    @property
    def stale(self) -> bool:
        """Whether a cache holding this board should fetch it again (deleted, or resharded)."""
        return self.deleted or self.moved

    # ---- writes ---------------------------------------------------------------------------

    def prepare(
        self, scores: Sequence[Score], now_ms: int | None = None, field: str = "scores"
    ) -> list[Prepared]:
        """Check every score; raise InvalidInput naming the first bad field. Writes nothing."""
        now = times.now_ms() if now_ms is None else now_ms
        codec = self.codec
        lowest, highest = codec.epoch_ms, min(now + MAX_FUTURE_MS, codec.last_ms)
        points_max, unit_ms, time_bits = codec.points_max, codec.unit_ms, codec.time_bits
        # encode_units inlined (the same packing): the points part, then the time part.
        desc, earliest, time_max = codec.order == "desc", codec.tiebreak == "earliest", codec.time_max
        by_region = self.layout.strategy == "region"
        shards = self.layout.sharding.shards
        fullmatch, crc32 = ID_PATTERN.fullmatch, zlib.crc32
        # Every player id checked at once; one by one only when some is not an id (the error path).
        every_id = all_ids([s.player_id for s in scores])
        # A request's scores mostly share their local day (most are sent without a time): its
        # periods hold for every time in [lo, hi).
        lo = hi = -1
        names: tuple[str, ...] = ()
        # Most scores are sent without a time: theirs is ``now``, whose units, time part and
        # check are worked out once a request rather than once a score.
        now_units = (now - lowest) // unit_ms
        now_part = time_max - now_units if earliest else now_units
        now_kept = lowest + now_units * unit_ms
        now_ok = lowest <= now <= highest
        out = []
        for i, s in enumerate(scores):
            player, points, match, sent, region = s
            if sent is None:
                achieved, units, part, kept, in_range = now, now_units, now_part, now_kept, now_ok
            else:
                achieved = sent
                units = (sent - lowest) // unit_ms
                part = time_max - units if earliest else units
                # Periods follow the time kept (whole units from the epoch), as the archive, rebuilds
                # and settlement see it: with resolution "s" and an epoch off a whole second, a result
                # sent in a day's first fraction of a second is kept, and filed, in the day before.
                kept = lowest + units * unit_ms
                in_range = lowest <= sent <= highest
            # One test for the common case of a good score; _refuse says what is wrong, if anything.
            if not (
                (every_id or (type(player) is str and fullmatch(player) is not None))
                and type(match) is str
                and 0 < len(match) <= MATCH_ID_MAX
                and "\x00" not in match
                and type(points) is int
                and 0 <= points <= points_max
                and in_range
            ):
                points = self._refuse(s, achieved, now, f"{field}[{i}]")
            if by_region:
                if region is None:  # left out (or null): missing, as a match_id left out is
                    regions = ", ".join(self.layout.sharding.regions)
                    raise InvalidInput(
                        f"region is required on a region board: one of {regions}",
                        f"{field}[{i}].region",
                        "missing_field",
                    )
                shard = self.layout.home(player, region, f"{field}[{i}].region")
            else:
                shard = crc32(player.encode()) % shards  # Layout.home
            if not lo <= kept < hi:
                lo, hi, names = self.periods_at(kept)
            # tuple.__new__ straight: a NamedTuple's own __new__ is a Python function, a call more
            # per score (about half of a Prepared's cost to build)
            out.append(
                _new(
                    Prepared,
                    (
                        player,
                        match,
                        points,
                        units,
                        ((points if desc else points_max - points) << time_bits) | part,
                        shard,
                        names,
                        sent is None,
                    ),
                )
            )
        if self.rebuilding:
            self.check_built({s for p in out for s in (p.shard, *self.layout.rivals(p.shard))}, "write")
        return out

    def at_units(self, p: Prepared, units: int) -> Prepared:
        """``p`` as if it had been sent with the time ``units`` (a pinned first server time)."""
        achieved = self.codec.epoch_ms + units * self.codec.unit_ms
        return p._replace(
            units=units,
            score=self.codec.encode_units(p.points, units),
            periods=self.periods_at(achieved)[2],
            server_time=False,
        )

    def _refuse(self, s: Score, achieved: int, now: int, where: str) -> int:
        """Raise InvalidInput for the first bad field of ``s``; return its points when all are good."""
        check_id(s.player_id, f"{where}.player_id")
        if not isinstance(s.match_id, str) or not 1 <= len(s.match_id) <= MATCH_ID_MAX:
            raise InvalidInput(
                f"match_id must be 1-{MATCH_ID_MAX} characters", f"{where}.match_id", "invalid_match_id"
            )
        if "\x00" in s.match_id:
            # PostgreSQL's text cannot hold it (the archive would refuse the result for ever), and
            # the dedup records use it to separate a match id from a player id.
            raise InvalidInput(
                "match_id must not contain the NUL character (U+0000)",
                f"{where}.match_id",
                "invalid_match_id",
            )
        points = self.codec.check_points(s.points, f"{where}.points")
        if achieved > now + MAX_FUTURE_MS:
            raise InvalidInput(
                "achieved_at is more than 5 minutes in the future", f"{where}.achieved_at", "out_of_range"
            )
        self.codec.time_units(achieved, f"{where}.achieved_at")
        return int(points)

    async def submit(self, scores: Sequence[Score], now_ms: int | None = None) -> list[Result]:
        """Validate, then apply per shard (atomic per shard, concurrent across shards, not atomic across;
        on a region board in rounds where a player is named under several regions: ``rounds``)."""
        prepared = self.prepare(scores, now_ms)
        order = rounds(self.config.sharding, prepared)
        if order is None:
            return await self._submit(prepared, now_ms)
        return await in_rounds(prepared, order, functools.partial(self._submit, now_ms=now_ms))

    async def _submit(self, prepared: Sequence[Prepared], now_ms: int | None = None) -> list[Result]:
        """Apply prepared results per shard, concurrently across shards."""
        groups = by_shard(prepared)
        pipeline = ScriptPipeline(self.client) if len(groups) > 1 else None  # one pipeline per node
        try:
            replies = await asyncio.gather(
                *(
                    self.apply_shard(shard, [prepared[i] for i in idx], now_ms, pipeline)
                    for shard, idx in groups.items()
                )
            )
        except PartlyApplied as e:  # one request: it fails as on any failed shard call
            raise e.error from None  # (e.error is its cause already)
        results: list[Result | None] = [None] * len(prepared)
        for idx, shard_results in zip(groups.values(), replies, strict=True):
            for i, r in zip(idx, shard_results, strict=True):
                results[i] = r
        return [r for r in results if r is not None]

    async def apply_shard(
        self,
        shard: int,
        batch: Sequence[Prepared],
        now_ms: int | None = None,
        pipeline: ScriptPipeline | None = None,
    ) -> list[Result]:
        """Apply prepared results that all live on ``shard`` with one script call (plus band moves).

        With ``pipeline``, the call rides the per-node pipeline of the calls made in the same turn
        (the router's coalescer sends every shard's batch of a tick that way); if that fails, it is
        made again on its own through the script object. Raises BoardNotFound once the board was
        deleted (this incarnation's shards refuse every write from then on), and PartlyApplied when
        the second call of pinned results fails after the first applied the others.
        """
        now = times.now_ms() if now_ms is None else now_ms
        key_list, args = self._script_call(shard, batch, now)
        try:
            if pipeline is None:
                reply = await self.scripts.write(keys=key_list, args=args)
            else:
                reply = await pipeline.call(self.scripts.write, key_list, args)
        except ResponseError as e:
            raise self.gone(e) from e
        results: list[Result | None] = []
        moves = []
        repin: dict[int, Prepared] = {}
        shift, desc, points_max = self.codec.time_bits, self.codec.order == "desc", self.codec.points_max
        # Five values a result (write.lua's header), taken in turn: no slice of the reply a result.
        fields = iter(reply)
        for n, (p, status, after, version, pending, skipped) in enumerate(
            zip(batch, fields, fields, fields, fields, fields, strict=True)
        ):
            if status == "p":  # sent before without a time: again, with the time it was first seen at
                repin[n] = self.at_units(p, int(after))
                results.append(None)
                continue
            points = int(after) >> shift if after else 0  # the points part of the total after
            if after and not desc:
                points = points_max - points
            closed = tuple(periods.api_name(name) for name in skipped.split(",")) if skipped else ()
            results.append(_new(Result, (p.player_id, p.match_id, STATUS[status], points, closed)))
            if pending != "-":  # no total after: a removal's drop still pending (a replay refused)
                moves.append(Move(p.player_id, int(after) if after else None, int(version), pending))
        if moves:
            # The home shard took the batch: a reshard that refuses its band calls (the old layout
            # moved away, band.lua) does not undo it. If the reshard commits, the new layout's bands
            # are built from the home totals it copied after this call (its writes are tracked); if
            # it is cancelled, the moves stay pending here and the player's next write or the
            # archiver's repair sends them (shardlb/bands.py). So the batch is answered as applied.
            with contextlib.suppress(Resharding):
                await self.bands.finish(shard, moves, pipeline)
        if repin:
            try:
                again = await self.apply_shard(shard, list(repin.values()), now_ms, pipeline)
            except Exception as e:  # the first call's results stay applied: answered, not failed
                raise PartlyApplied(results, e) from e
            for n, result in zip(repin, again, strict=True):
                results[n] = result
        return [r for r in results if r is not None]

    def _script_call(self, shard: int, batch: Sequence[Prepared], now: int) -> tuple[list[str], list[Any]]:
        """The keys and arguments of write.lua for ``batch`` on ``shard`` (see the script's header)."""
        prefix = self.prefixes[shard]
        key_list = [keys.index_key(prefix), keys.gone_key(prefix)]
        expiry = [0, 0]
        slot: dict[str, int] = {}

        def key_index(name: str, expire_at: int) -> int:
            if name not in slot:
                key_list.append(name)
                expiry.append(expire_at)
                slot[name] = len(key_list)
            return slot[name]

        # Dedup and pin buckets go as (first, current): write.lua names them (keys.dedup_key/pin_key;
        # a pin hash spans PIN_SPAN buckets and is named by its first).
        b, window = self._dedup_bucket_ms, self.config.dedup_window_s * 1000
        span = [(now - window) // b, now // b]
        dedup = span if self.config.mode == "incr" else []
        pins = span if any(p.server_time for p in batch) else []
        rivals = [key_index(keys.period_key(self.prefixes[r], "total"), 0) for r in self.layout.rivals(shard)]
        version = pending = 0
        if self.layout.strategy == "band":
            version = key_index(keys.version_key(prefix), 0)
            pending = key_index(keys.pending_key(prefix), 0)
        items: list[Any] = []
        locks: list[Any] = []  # per dated period key: write.lua's test whether it is closed or frozen
        indices: dict[tuple[str, ...], list[int]] = {}  # a batch's scores mostly share their periods
        for player, match, points, units, score, _, names, server_time in batch:  # Prepared's fields
            index = indices.get(names)
            if index is None:
                index = indices[names] = []
                for name in names:
                    key = keys.period_key(prefix, name)
                    fresh = key not in slot
                    index.append(key_index(key, self._expiry(name)))
                    if fresh and name != "total":
                        marker = key_index(keys.frozen_key(prefix, name), 0)
                        locks += [slot[key], marker, self._closes(name), name]
            items += [player, score, points, units, f"{match}\x00{player}", int(server_time), *index]
        journal = key_index(keys.journal_key(prefix), 0) if self.config.durability == "journal" else 0
        activity = key_index(keys.activity_key(prefix), 0) if self.config.inactive_after else 0
        c = self.codec
        header = [
            self.config.mode, c.time_bits, c.points_max, c.order, c.tiebreak, now, len(self.config.periods),
            version, pending, dedup, pins, rivals, list(self.config.sharding.bands), expiry,
            journal, self.journal_max, self.config.id, self.incarnation, shard, locks, activity, b, window,
            PIN_SPAN, int(len(items) <= STREAM_VALUES), *(self._same_period_units(now) if pins else (0, -1)),
            self.journal_max_results if journal else 0, self._trim(shard, now), int(self.sentinels),
        ]  # fmt: skip
        return key_list, [
            _stream(header),
            _stream(items) if len(items) <= STREAM_VALUES else msgpack.packb(items),
        ]

    def _trim(self, shard: int, now: int) -> int:
        """1 when this call should drop the shard's index listings of expired keys (the first call
        of a TRIM_EVERY_MS window on the shard, in this process), else 0."""
        window = now // TRIM_EVERY_MS
        if self._trimmed.get(shard) == window:
            return 0
        self._trimmed[shard] = window
        return 1

    def gone(self, e: ResponseError) -> Exception:
        """The library's error for a script's own error reply: BoardNotFound for BOARDGONE (and the
        board marked deleted), Overloaded for JOURNALFULL, Rebuilding for SHARDLOST (the shard held as
        not rebuilt by this Board); any other reply stays ``e``."""
        if str(e).startswith(GONE):
            self.deleted = True
            return BoardNotFound(f"board {self.config.id!r} was deleted", "board")
        if str(e).startswith(MOVED):
            self.moved = True
            return Resharding(f"board {self.config.id!r} is being resharded; retry", 1.0)
        if str(e).startswith(CLOSED):
            return BoardClosed(
                f"board {self.config.id!r} is closed: its season is being archived, it takes no more results",
                "board",
            )
        if str(e).startswith(JOURNAL_FULL):
            return Overloaded("the board's journal is full: PostgreSQL or the archiver is behind", 5.0)
        if str(e).startswith(LOST):
            # Held by this Board from now on: its reads of the shard are refused too, until the
            # record, fetched again, says whether the archiver marked it (or a rebuild brought it back).
            shard = int(str(e).split()[1])
            self.rebuilding = self.rebuilding | {shard}
            return rebuilding(
                self.config.id,
                [shard],
                "this write would not be exact. Nothing was written; retry later",
                band_shards(self),
                self.resharding,
            )
        return e

    async def check_live(self, shards: Iterable[int]) -> None:
        """Raise as a write to ``shards`` would when one of them was deleted (BoardNotFound) or
        resharded away (Resharding), with this board marked as the write marks it; else return.
        One MGET of those two markers per shard (as rate.lua reads them): for an answer that writes
        nothing, and so learns nothing from a script (a result refused before it is written, Screen)."""

        async def one(shard: int) -> None:
            marks = (keys.move_key(self.prefixes[shard]), keys.gone_key(self.prefixes[shard]))
            move, gone = await self.client.execute_command("MGET", *marks)
            if move is not None and move not in (b"t", "t"):
                raise self.gone(ResponseError(f"{MOVED} this board is being resharded; retry"))
            if gone is not None:
                raise self.gone(ResponseError(f"{GONE} this board was deleted"))

        await asyncio.gather(*(one(s) for s in set(shards)))

    async def repair(self) -> int:
        """Finish band moves that a failed call left pending (band boards); return how many."""
        return await self.bands.repair() if self.layout.strategy == "band" else 0

    async def prune(self, now_ms: int | None = None) -> int:
        """Forget the versions of players removed longer ago than the dedup window (band boards:
        ``BandMoves.prune``); return how many."""
        return await self.bands.prune(now_ms) if self.layout.strategy == "band" else 0

    def period_names(self, at_ms: int) -> tuple[str, ...]:
        """The periods (``total`` first) a result kept at ``at_ms`` counts in: ``periods.names_at``,
        from the board's cache of local days."""
        return self.periods_at(at_ms)[2]

    def periods_at(self, at_ms: int) -> tuple[int, int, tuple[str, ...]]:
        """(lo, hi, names): the local day holding ``at_ms`` as [lo, hi) in epoch ms, and the names of
        the periods every result kept in it counts in (periods begin where days do)."""
        for day in self._days_in_quarter(at_ms // QUARTER_HOUR_MS):
            if at_ms < day[1]:
                return day
        raise AssertionError("the days of a quarter hour cover it")

    def _days_meeting(self, quarter: int) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
        """The local days that meet the quarter hour ``quarter``, first to last, as periods_at gives
        them. Nearly always one: a day starts inside a quarter hour only where the zone's offset is
        no whole quarter hour (local mean time, Monrovia's -0:44:30 until 1972, Kiritimati's -10:40
        until 1979), or where its clock jumps over midnight at an instant off the quarter hour."""
        c = self.config
        at, end, days = quarter * QUARTER_HOUR_MS, (quarter + 1) * QUARTER_HOUR_MS, []
        while at < end:
            day, lo, hi = periods.day_span(at, self.tz)
            days.append((lo, hi, tuple(periods.name_for(kind, day, c.week_start) for kind in c.periods)))
            at = hi
        return tuple(days)

    def _days_like(self, day_start: int) -> tuple[int, int]:
        """[first, end) in epoch ms: the local day starting at ``day_start`` with the days next to it
        whose results go to the same periods (a board without a daily period), as far as a day past
        it either way."""
        first, end, names = self.periods_at(day_start)
        lowest, highest = first - SAME_PERIODS_MS, end + SAME_PERIODS_MS
        while first > lowest and (day := self.periods_at(first - 1))[2] == names:
            first = day[0]
        while end < highest and (day := self.periods_at(end))[2] == names:
            end = day[1]
        return first, end

    def _same_period_units(self, now: int) -> list[int]:
        """[lo, hi]: the time units of the results that go to the same periods as one achieved at
        ``now`` (within a day of it). write.lua applies a result sent without a time whose pin
        (first server time) lies in it at once, with that time, rather than answer ``p``."""
        first, end = self._same_periods(self.periods_at(now)[0])
        c = self.codec
        lo_ms, hi_ms = max(first, now - SAME_PERIODS_MS), min(end, now + SAME_PERIODS_MS)  # [lo_ms, hi_ms)
        return [-(-(lo_ms - c.epoch_ms) // c.unit_ms), (hi_ms - 1 - c.epoch_ms) // c.unit_ms]

    def _period_expiry(self, name: str) -> int:
        if name == "total":
            return 0
        c, kind = self.config, periods.first_day(name)[0]
        return periods.end_ms(name, self.tz, c.week_start) + c.retention_days[kind] * 86_400_000

    def holds_nothing(self, name: str, now_ms: int) -> bool:
        """Whether the period ``name`` (a view's ``period``) is empty by construction at ``now_ms``:
        a dated period whose keys have expired (its end plus the board's retention for its kind), or
        one that starts after any write could reach it (results are at most MAX_FUTURE_MS ahead).
        An hour's margin each way covers the clocks of other routers and of Redis."""
        if name == "total":
            return False
        margin = HOLDS_NOTHING_MARGIN_MS
        if self._period_expiry(name) < now_ms - margin:
            return True
        return periods.start_ms(name, self.tz, self.config.week_start) > now_ms + MAX_FUTURE_MS + margin

    def _period_closes(self, name: str) -> int:
        c = self.config
        kept = c.retention_days[periods.first_day(name)[0]]
        return periods.closes_ms(name, self.tz, c.close_grace_s, c.week_start, kept)

    def dated(self, name: str) -> str:
        """``name`` checked as a dated period name of this board (``d:2026-11-30``); InvalidInput if not."""
        c = self.config
        api = periods.api_name(name)
        if name[1:2] != ":" or periods.parse(api, c.periods, self.tz, 0, c.week_start) != name:
            raise InvalidInput(f"{name!r} is not a dated period of this board", "period", "invalid_period")
        return name

    async def freeze(self, name: str, now_ms: int | None = None) -> int:
        """Freeze the dated period ``name`` (``d:2026-11-30``, as ``resolve`` gives it in
        ``ResolvedView.period``) on every shard: from each shard's marker on, write.lua applies no
        result to the period there, whatever the writing router's clock says (results still count
        in the total and the periods still open). Idempotent: a repeated or retried freeze changes
        nothing, so after a partial failure the caller runs it again. The markers expire with the
        period's keys. Returns how many shards this call froze (0: all were frozen already).
        Concurrent across shards, not atomic across them: ``frozen`` is true once every shard is."""
        name = self.dated(name)
        return await self._freeze(name, self._expiry(name), now_ms)

    async def close(self, now_ms: int | None = None) -> int:
        """Freeze the total on every shard: the board takes no more results (write.lua answers
        BOARDCLOSED, BoardClosed here), for good. A season's archive closes the board before it
        settles the total, so that every result the board took is in PostgreSQL and paid. Idempotent
        like ``freeze``; returns how many shards this call closed."""
        return await self._freeze("total", 0, now_ms)

    async def _freeze(self, name: str, expire_at: int, now_ms: int | None) -> int:
        now = times.now_ms() if now_ms is None else now_ms

        async def one(prefix: str) -> int:
            marker = [keys.index_key(prefix), keys.gone_key(prefix), keys.frozen_key(prefix, name)]
            try:
                return int(await self.scripts.freeze(keys=marker, args=[expire_at, now]))
            except ResponseError as e:
                raise self.gone(e) from e

        return sum(await asyncio.gather(*(one(prefix) for prefix in self.prefixes)))

    async def mark_paid(self, name: str, settlement_id: str) -> None:
        """Record on every shard that period ``name`` (``total`` for a season) was paid by
        ``settlement_id`` (keys.paid_key; freeze.lua's marker write: the first id stays)."""

        async def one(prefix: str) -> None:
            marker = [keys.index_key(prefix), keys.gone_key(prefix), keys.paid_key(prefix, name)]
            try:
                await self.scripts.freeze(keys=marker, args=[self._expiry(name), settlement_id])
            except ResponseError as e:
                raise self.gone(e) from e

        await asyncio.gather(*(one(prefix) for prefix in self.prefixes))

    async def settled_again(self, name: str, shards: Iterable[int], settlement_id: str | None) -> None:
        """Put back on ``shards`` (rebuilt after Redis lost them) the markers of a settlement of the
        dated period ``name`` that PostgreSQL holds: its freeze, and, given the ``settlement_id``
        that paid it, the record of the payment (``mark_paid``). For ``total`` (a season archive
        begun) the freeze is the close (``close``: no expiry). freeze.lua keeps a marker that is
        there, so this is idempotent. A rebuild calls it (shardlb/rebuild.py, ``_built``)."""
        name = name if name == "total" else self.dated(name)
        expire_at, now = self._expiry(name), times.now_ms()
        for shard in shards:
            prefix = self.prefixes[shard]
            markers = [(keys.frozen_key(prefix, name), now), (keys.paid_key(prefix, name), settlement_id)]
            for marker, value in markers:
                if value is None:
                    continue
                try:
                    await self.scripts.freeze(
                        keys=[keys.index_key(prefix), keys.gone_key(prefix), marker], args=[expire_at, value]
                    )
                except ResponseError as e:
                    raise self.gone(e) from e

    async def paid(self, name: str) -> str | None:
        """The settlement that paid period ``name``, as any shard recorded it (``mark_paid``)."""
        pipe = batch(self.client)
        for prefix in self.prefixes:
            pipe.execute_command("GET", keys.paid_key(prefix, name))
        found = [v for v in await pipe.execute() if v is not None]
        return (found[0].decode() if isinstance(found[0], bytes) else str(found[0])) if found else None

    async def closed(self) -> bool:
        """Whether the board is closed (``close``) on any shard: it takes no results there."""
        return await self._marked("total", any)

    async def frozen(self, name: str) -> bool:
        """Whether the dated period ``name`` is frozen on every shard (see ``freeze``)."""
        return await self._marked(self.dated(name), all)

    async def _marked(self, name: str, how: Callable[[list[int]], bool]) -> bool:
        pipe = batch(self.client)
        for prefix in self.prefixes:
            pipe.execute_command("EXISTS", keys.frozen_key(prefix, name))
        return how(await pipe.execute())

    # ---- reads ----------------------------------------------------------------------------

    async def check_layout(self) -> frozenset[int]:
        """Raise Resharding if a read of this layout may have missed a write (shardlb/reshard.py);
        else return the shards found without their sentinel, on a board being resharded whose
        layout carries them (Redis lost them alone: docs/design-notes.md, "A shard lost alone").

        The mover marks every shard of the old layout moved ('m') before the new layout takes a
        write, so a read whose shards all carried no such marker when looked at afterwards saw
        every write acknowledged before it began. A marker alone is not enough to refuse: until
        the registry names the new layout, it has not been opened, and the old one is still whole.
        The sentinels ride in the same pipeline (their shard's slot, so no round trip more); one
        found missing has the record read (``_check_recorded``): a deleted board is BoardNotFound.
        """
        moves = [keys.move_key(p) for p in self.prefixes] if self.moving else []
        here = [keys.sentinel_key(p) for p in self.prefixes] if self.resharding and self.sentinels else []
        pipe = batch(self.client, shared=True)
        for name in moves:
            pipe.execute_command("GET", name)
        for name in here:
            pipe.execute_command("EXISTS", name)
        found = await pipe.execute()
        lost = frozenset(s for s, there in enumerate(found[len(moves) :]) if not there)
        if lost:
            await self._check_recorded()
        if not any(marker in ("m", b"m") for marker in found[: len(moves)]):
            return lost
        raw = await self.client.hget(keys.BOARDS, self.config.id)
        record = orjson.loads(raw) if raw else {}
        if record.get("incarnation") == self.incarnation and record.get("generation", 0) == self.generation:
            return lost
        self.moved = True
        raise Resharding(f"board {self.config.id!r} was resharded meanwhile; read it again", 1.0)

    async def _check_recorded(self) -> None:
        """BoardNotFound (this Board marked deleted) when the registry no longer holds this board:
        no record, one being deleted or another incarnation's. For a read that found a sentinel
        missing (``check_layout``): a deletion drops every shard, sentinels with them, and until
        2026-12-06 a process still holding the board answered such a read 503 ``board_rebuilding``
        (every shard taken for lost alone) until it fetched the record again. One HGET, made only
        then."""
        raw = await self.client.hget(keys.BOARDS, self.config.id)
        record = orjson.loads(raw) if raw else {}
        if (
            not record
            or record.get("state") == "deleting"
            or str(record.get("incarnation", "0")) != self.incarnation
        ):
            self.deleted = True
            raise BoardNotFound(f"board {self.config.id!r} was deleted", "board")

    def resolve(
        self, period: str = "total", region: str | None = None, now_ms: int | None = None
    ) -> ResolvedView:
        """The view a read covers: an API period (``weekly``, ``daily:2026-11-30``...) and a region,
        checked (InvalidInput naming ``period`` or ``region``) and resolved once, for every read to take.

        A board without regions ignores ``region`` (its view is the whole board's); a region board
        limits the read to that region's shards, or reads all of them without one. A read given
        no view reads ``resolve()``: the whole board's total.
        """
        if self.layout.strategy != "region":
            region = None
        if period == "total":  # most reads: one view per region, made once
            view = self._total_views.get(region)
            if view is not None:
                return view
        now = times.now_ms() if now_ms is None else now_ms
        name = periods.parse(period, self.config.periods, self.tz, now, self.config.week_start)
        total = name == "total"
        view = ResolvedView(
            self.config.id,
            name,
            periods.api_name(name),
            region,
            tuple(keys.period_key(self.prefixes[s], name) for s in self.layout.view(total, region)),
            self.layout.strategy == "band" and total,
        )
        if total and len(self._total_views) < MAX_TOTAL_VIEWS:
            self._total_views[region] = view
        return view

    def resets_at(self, name: str) -> str | None:
        """When the period ``name`` (a view's ``period``) ends, in RFC 3339 with the board's UTC
        offset at that instant; None for the total."""
        return periods.resets_at(name, self.tz, self.config.week_start)

    def check_built(self, shards: Iterable[int], what: str = "read") -> None:
        """Rebuilding when one of ``shards`` is not rebuilt yet (``rebuilding``): its answer would
        come from a shard emptied by a loss of Redis (docs/design-notes.md, "A board being rebuilt")."""
        waiting = self.rebuilding.intersection(shards)
        if waiting:
            raise rebuilding(
                self.config.id,
                waiting,
                f"this {what} would not be exact. Nothing was written; retry later",
                band_shards(self),
                self.resharding,
            )

    def check_view(self, view: ResolvedView) -> None:
        """``check_built`` for the shards a read of ``view`` merges."""
        if self.rebuilding:
            shards = self.layout.view(view.period == "total", view.region)
            self.check_built(shards)

    def _merged(self, view: ResolvedView) -> View:
        self.check_view(view)
        return View(
            self.client,
            view.keys,
            self.scripts.counts,
            banded=view.banded,
            shallow=self.shallow,
            replicas=self.read_replicas,
            near_script=self.scripts.near,
            places_script=self.scripts.places,
            band_of=self._band_of if view.banded else None,
        )

    def _band_of(self, score: float) -> int:
        """The index, among a band board's total view keys, of the band a score belongs to."""
        return self._band_at[self.layout.band_shard(self.codec.decode_units(score)[0])]

    async def _band_place(
        self, reader: View, player_id: str, sizes: Sequence[int] | None = None, guess: int | None = None
    ) -> BandPlace:
        """A player placed on a band board's total (``View.band_place``); PlayerNotFound if absent."""
        check_id(player_id, "player")
        home = keys.period_key(self.prefixes[self.layout.home(player_id)], "total")
        place = await reader.band_place(home, player_id, sizes, guess)
        if place is None:
            raise PlayerNotFound(f"player {player_id!r} has no score in this period", "player")
        return place

    def entry(self, rank: int, row: Row) -> Entry:
        points, achieved = self.codec.decode(row[0])
        return Entry(rank, row[1], points, achieved)

    def rank_mode(self, asked: object = None) -> str:
        """The rank mode of a read: ``asked`` (a request's ``rank_mode``), else the board's setting.

        ``unique`` numbers players 1..N in the board order; ``competition`` gives equal points equal
        ranks (1, 1, 3): 1 + the players with strictly better points, whatever their time. The order
        of the listing is the same in both. InvalidInput for any other value.
        """
        if asked is None:
            return self.config.rank_mode
        if asked not in RANK_MODES:
            raise InvalidInput(
                f"rank_mode must be one of {', '.join(RANK_MODES)}", "rank_mode", "invalid_parameter"
            )
        return str(asked)

    def _listed(self, rows: Sequence[Row], start: int, first: int | None = None) -> list[Entry]:
        """Entries of consecutive rows of the board order, the first at unique rank ``start``; given
        ``first``, the first row's competition rank, they carry competition ranks."""
        decoded = [self.codec.decode(score) for score, _ in rows]
        ranks: Sequence[int] = range(start, start + len(rows))
        if first is not None:
            ranks = merge.competition([points for points, _ in decoded], start, first)
        return [
            Entry(rank, row[1], points, achieved)
            for rank, row, (points, achieved) in zip(ranks, rows, decoded, strict=True)
        ]

    def _span(self, score: float) -> range:
        """The scores that carry the points of ``score`` (codec.scores_of)."""
        return self.codec.scores_of(self.codec.decode_units(score)[0])

    async def _first_rank(self, reader: View, rows: Sequence[Row], start: int) -> int:
        """The competition rank of ``rows[0]``, at unique rank ``start``: 1 + the players with better
        points, one ZCOUNT per shard (none at the top)."""
        if start == 1 or not rows:
            return 1
        [better] = await reader.at_least([self._span(rows[0][0]).stop])
        return better + 1

    @exact
    async def top(
        self, n: int = 100, view: ResolvedView | None = None, rank_mode: str | None = None
    ) -> list[Entry]:
        """The best ``n`` entries. Competition ranks come from the listing itself: it starts at 1."""
        competition = self.rank_mode(rank_mode) == "competition"
        rows = await self._merged(view or self.resolve()).top(n)
        return self._listed(rows, 1, 1 if competition else None)

    @exact
    async def entries(
        self, offset: int, limit: int, view: ResolvedView | None = None, rank_mode: str | None = None
    ) -> list[Entry]:
        """Ranks ``offset + 1`` .. ``offset + limit`` of the order. Competition ranks: a shallow page
        is cut from a merged top, which holds every run it continues; a deep one costs one ZCOUNT per
        shard more, for its first entry's rank."""
        if offset < 0 or limit < 1:
            raise InvalidInput("offset must be >= 0 and limit >= 1", "offset" if offset < 0 else "limit")
        competition = self.rank_mode(rank_mode) == "competition"
        reader = self._merged(view or self.resolve())
        if not competition:
            return self._listed(await reader.page(offset, limit), offset + 1)
        if offset + limit <= reader.shallow:
            return self._listed(await reader.top(offset + limit), 1, 1)[offset:]
        rows = await reader.page(offset, limit)
        return self._listed(rows, offset + 1, await self._first_rank(reader, rows, offset + 1))

    @exact
    async def size(self, view: ResolvedView | None = None) -> int:
        return sum(await self._merged(view or self.resolve()).sizes())

    @exact
    async def band_sizes(self) -> list[int]:
        """The players of each band of a band board's total, best band first ([] on other boards):
        how evenly its band starts part the players now (``shardlb bands --apply``)."""
        if self.layout.strategy != "band":
            return []
        return await self._merged(self.resolve()).sizes()

    @exact
    async def band_sizes_at(self, starts: Sequence[int]) -> list[int]:
        """The players each band of ``starts`` (increasing band starts from 0, as ``band_starts``
        gives them) would hold on this board's total now, best band first: one ZCOUNT per shard and
        start, in one pipeline. ``shardlb bands --apply`` compares their skew with the bands'."""
        codec = self.codec
        # Per start, the scores of the players with at least its points: from its first score up
        # (desc), or below the first score of one point fewer (asc: fewer points score higher).
        floors = [
            0,
            *(
                codec.scores_of(s).start if codec.order == "desc" else codec.scores_of(s).stop
                for s in starts[1:]
            ),
        ]
        counted = await self._merged(self.resolve()).at_least(floors)
        holding = [counted[0], *(n if codec.order == "desc" else counted[0] - n for n in counted[1:])]
        sizes = [n - m for n, m in itertools.pairwise([*holding, 0])]
        return sizes[::-1] if codec.order == "desc" else sizes

    async def band_starts(self, count: int) -> list[int]:
        """Band starts (``sharding.bands``) that part this board's total into ``count`` bands of
        about as many players each, from the points of the players at every ``size / count``-th
        rank (one page read each): what a band board's bands should follow as scores move, for
        ``shardlb reshard --bands``. Fewer bands where many players share points: a band holds every
        player of its points. [0] for an empty board."""
        if not 1 <= count <= MAX_BANDS:
            raise InvalidInput(f"count must be 1 to {MAX_BANDS}", "count")
        size = await self.size()
        starts = {0}
        for k in range(1, count if size else 1):
            for at in await self.entries(size * k // count, 1):  # none if the board shrank meanwhile
                # desc: the band from these points up holds this player and the ones above;
                # asc (low is good): the band below one point more does.
                up = self.config.order == "asc"
                starts.add(min(at.points + 1, self.config.points_max) if up else at.points)
        return sorted(starts)

    @exact
    async def scores(self, player_ids: Sequence[str], view: ResolvedView | None = None) -> dict[str, float]:
        """Each player's score in a view, from their home shard(s); players without one are left out."""
        view = view or self.resolve()
        placed = {p: self.layout.candidates(p, view.region) for p in player_ids}
        if self.rebuilding:
            self.check_built({s for shards in placed.values() for s in shards})
        return await self._scores(placed, view)

    async def _scores(self, placed: Mapping[str, Sequence[int]], view: ResolvedView) -> dict[str, float]:
        """``scores`` of players whose candidate shards are known (``Layout.candidates``)."""
        groups: dict[int, list[str]] = defaultdict(list)
        for player, shards in placed.items():
            for shard in shards:
                groups[shard].append(player)
        pipe = batch(self.client, replicas=self.read_replicas, shared=True)
        for shard, members in groups.items():
            pipe.zmscore(keys.period_key(self.prefixes[shard], view.period), members)
        found: dict[str, float] = {}
        for members, values in zip(groups.values(), await pipe.execute(), strict=True):
            for player, value in zip(members, values, strict=True):
                if value is not None and value > found.get(player, -1.0):
                    found[player] = value
        return found

    def _home_index(self, player_id: str, view: ResolvedView) -> int | None:
        """The index in ``view.keys`` of the one key the player can be in, or None where that is not
        one key (band boards' total, a region board read across regions)."""
        check_id(player_id, "player")
        if view.banded:  # (``_home_indices`` for one player, without its table of the view's keys)
            return None
        shards = self.layout.candidates(player_id, view.region)
        if len(shards) != 1:
            return None
        key = keys.period_key(self.prefixes[shards[0]], view.period)
        return view.keys.index(key) if key in view.keys else None

    def _home_indices(self, placed: Sequence[Sequence[int]], view: ResolvedView) -> list[int | None]:
        """``_home_index`` for players of the candidate shards ``placed``, the view's keys looked up once."""
        if view.banded:
            return [None] * len(placed)
        index = {key: i for i, key in enumerate(view.keys)}
        of_shard: dict[int, int | None] = {}
        out: list[int | None] = []
        for shards in placed:
            if len(shards) != 1:
                out.append(None)
                continue
            shard = shards[0]
            if shard not in of_shard:
                of_shard[shard] = index.get(keys.period_key(self.prefixes[shard], view.period))
            out.append(of_shard[shard])
        return out

    async def _located(self, reader: View, player_id: str, home: int) -> Located:
        found = await reader.locate(player_id, home)
        if found is None:
            raise PlayerNotFound(f"player {player_id!r} has no score in this period", "player")
        return found

    async def _row(self, player_id: str, view: ResolvedView) -> Row:
        check_id(player_id, "player")
        found = await self.scores([player_id], view)
        if player_id not in found:
            raise PlayerNotFound(f"player {player_id!r} has no score in this period", "player")
        return found[player_id], player_id

    @exact
    async def player(
        self,
        player_id: str,
        view: ResolvedView | None = None,
        rank_mode: str | None = None,
        max_age_ms: int = 0,
    ) -> PlayerEntry:
        """The player's exact rank (summed per-shard counts), points, board size and percentile.

        The percentile is the share of the board ranked below the player: in unique mode the players
        after them in the order, in competition mode those with strictly worse points (players of
        equal points share it, as they share the rank). A competition rank needs no tie resolution:
        one pipeline of three ZCOUNTs per shard (better points, at least equal points, every row);
        on a band board's total also a ZSCORE on the player's band and those before it, where a
        stale row of theirs (a pending move) would otherwise count as a player with better points.

        ``max_age_ms`` > 0 (band boards, unique ranks): the other bands' sizes may be those an exact
        read of this process took at most that long ago, so the read touches the player's home
        shard and their own band only, not every master; ``counts_ms`` says when they were read.
        The player's place inside their band and that band's size are read now. On a hash board
        (unique ranks) the other shards' counts for this player may be those of this process's last
        such read of them, at most that old and at the score their home shard still holds: one round
        to the home shard's node (``_rank_of``). Elsewhere, and when nothing that recent is kept,
        the read is exact (and keeps what it read).
        """
        view = view or self.resolve()
        reader = self._merged(view)
        competition = self.rank_mode(rank_mode) == "competition"
        if view.banded and not competition:  # sizes of the bands ahead + a rank in the player's band
            sized = tuple(reader.keys)
            kept = self._band_sizes.get(sized) if max_age_ms > 0 and not self.moving else None
            guess = self._placed.get((sized, player_id))
            if (
                kept is not None
                and time.monotonic() - kept[0] <= max_age_ms / 1000
                and (guess is not None or len(reader.keys) > ONE_ROUND_BANDS)
            ):  # one round to two shards (two rounds where the player changed bands)
                place = await self._band_place(reader, player_id, kept[2], guess)
                taken_ms = kept[1]
            else:  # exact: every band's size, in one round up to ONE_ROUND_BANDS bands
                read_at, taken_ms = time.monotonic(), times.now_ms()
                place = await self._band_place(reader, player_id)
                if len(self._band_sizes) >= KEPT_BAND_SIZES and sized not in self._band_sizes:
                    self._band_sizes.clear()  # views of many past periods: start again
                self._band_sizes[sized] = (read_at, taken_ms, list(place.sizes))
            if max_age_ms > 0 and guess != place.band:
                if len(self._placed) >= PLACED_PLAYERS:
                    self._placed.clear()
                self._placed[(sized, player_id)] = place.band
            players = sum(place.sizes)
            rank = place.ahead + 1
            return PlayerEntry(
                self.entry(rank, place.row),
                players,
                100.0 * (players - rank) / players if players else 0.0,
                taken_ms if max_age_ms > 0 else None,
            )
        counts_ms = times.now_ms() if max_age_ms > 0 else None
        if not competition:
            home = self._home_index(player_id, view)
            if home is not None:
                # ``_located`` written out: a coroutine less, passed each time the read resumes
                found = await reader.locate(player_id, home)
                if found is None:
                    raise PlayerNotFound(f"player {player_id!r} has no score in this period", "player")
                if max_age_ms > 0:
                    rank, players, counts_ms = await self._rank_of(
                        reader, player_id, found, max_age_ms, counts_ms
                    )
                else:  # what ``_rank_of`` does then, without its coroutine (most reads)
                    rank, players = await reader.rank_of(found)
                below = players - rank
                percentile = 100.0 * below / players if players else 0.0
                return PlayerEntry(self.entry(rank, found.row), players, percentile, counts_ms)
        row = await self._row(player_id, view)
        if competition:
            span = self._span(row[0])
            better, level, players = await reader.at_least([span.stop, span.start, 0], row)
            rank, below = better + 1, max(players - level, 0)  # clamped: shards are read one by one
        else:
            sizes: list[int] = []  # taken with the counts: a tied shard's count and size at one moment
            counts, _ = await reader.counts_ahead(row, sizes=sizes)
            players = sum(sizes)
            rank = sum(counts) + 1
            below = players - rank
        percentile = 100.0 * below / players if players else 0.0
        return PlayerEntry(self.entry(rank, row), players, percentile, counts_ms)

    async def _rank_of(
        self, reader: View, player_id: str, found: Located, max_age_ms: int, counts_ms: int | None
    ) -> tuple[int, int, int | None]:
        """(rank, players, counts_ms) of a player ``locate`` found in their home shard of a hash view.

        With ``max_age_ms`` > 0, the other shards' part may be what they counted for this player at
        most that long ago, while the home shard's row still holds the score they counted at: then
        the read was one round to one node. Otherwise it is counted now (and kept, for such reads).
        """
        sized = tuple(reader.keys)
        kept = self._counted.get((sized, player_id)) if max_age_ms > 0 and not self.moving else None
        if kept is not None and time.monotonic() - kept[0] <= max_age_ms / 1000 and kept[2] == found.row[0]:
            return found.ahead + kept[3] + 1, found.size + kept[4], kept[1]
        read_at = time.monotonic()
        rank, players = await reader.rank_of(found)
        if max_age_ms > 0 and len(sized) > 1:
            if len(self._counted) >= COUNTED_PLAYERS:
                self._counted.clear()
            assert counts_ms is not None
            others = (read_at, counts_ms, found.row[0], rank - 1 - found.ahead, players - found.size)
            self._counted[(sized, player_id)] = others
        return rank, players, counts_ms

    @exact
    async def around(
        self,
        player_id: str,
        radius: int = 5,
        view: ResolvedView | None = None,
        rank_mode: str | None = None,
    ) -> list[Entry]:
        """Up to ``radius`` entries above and below the player. Competition ranks: the player's own
        count of better points rides the pipeline of the per-shard counts; a first entry with other
        points than the player's costs one ZCOUNT per shard more."""
        view = view or self.resolve()
        reader = self._merged(view)
        competition = self.rank_mode(rank_mode) == "competition"
        if view.banded and not competition:  # the rows by index in the one or few bands around
            place = await self._band_place(reader, player_id)
            if place.held:
                by_index = await reader.band_window(place, radius)
                if by_index is not None:
                    listed, index = by_index
                    return self._listed(listed, place.ahead + 1 - index)
        home = None if competition else self._home_index(player_id, view)
        if home is not None:
            found = await reader.near(player_id, home, radius)
            if found is None:
                raise PlayerNotFound(f"player {player_id!r} has no score in this period", "player")
            near = await reader.around_of(*found, radius)
            if near is not None:
                window, rank, at = near
                return self._listed(window, rank - at)
        row = await self._row(player_id, view)
        span = self._span(row[0])
        counts, better = await reader.counts_ahead(row, [span.stop] if competition else [])
        rank = sum(counts) + 1
        rows, at = await reader.around(row, counts, radius)
        if not competition:
            return self._listed(rows, rank - at)
        if int(rows[0][0]) in span:
            first = better[0] + 1
        else:
            first = await self._first_rank(reader, rows, rank - at)
        return self._listed(rows, rank - at, first)

    @exact
    async def query(
        self, player_ids: Sequence[str], view: ResolvedView | None = None, rank_mode: str | None = None
    ) -> list[Entry]:
        """Scores of many players (friends), sorted by rank, each with its global rank.

        Unique ranks where each player lives in one of the view's keys (hash boards; region boards
        read in one region): two rounds, places.lua on each home key (score and ZREVRANK together),
        then counts.lua on each key for the players who do not live there (``_ranked_at_home``).
        Competition ranks count, for each distinct points value among them, the rows at or above the
        first score with better points (``View.at_least_each``, which leaves out a player's own
        stale rows on a band board's total).
        """
        for i, player in enumerate(player_ids):
            check_id(player, f"player_ids[{i}]")
        view = view or self.resolve()
        reader = self._merged(view)
        competition = self.rank_mode(rank_mode) == "competition"
        if not competition:
            groups = self._home_groups(list(dict.fromkeys(player_ids)), view)  # each id once
            if groups is not None:
                return await self._ranked_at_home(reader, groups)
        placed = {p: self.layout.candidates(p, view.region) for p in player_ids}  # each id once
        found = sorted(((s, p) for p, s in (await self._scores(placed, view)).items()), reverse=True)
        if view.banded and not competition:
            counted = await reader.band_counts(found)
            return [self.entry(n + 1, row) for row, n in zip(found, counted, strict=True)]
        if not competition:  # some player may live in several keys (a region board across regions)
            homes = self._home_indices([placed[player] for _, player in found], view)
            counts = await reader.counts_ahead_many(found, homes)
            return [self.entry(sum(c) + 1, row) for row, c in zip(found, counts, strict=True)]
        better = await reader.at_least_each(found, [self._span(score).stop for score, _ in found])
        return [self.entry(n + 1, row) for row, n in zip(found, better, strict=True)]

    def _home_groups(self, players: Sequence[str], view: ResolvedView) -> dict[int, list[str]] | None:
        """``players`` grouped by the index in ``view.keys`` of the one key each can live in; None
        where a player may live in several (band totals, a region board read across regions) or a
        home key is not in the view."""
        if view.banded or (self.layout.strategy == "region" and view.region is None):
            return None
        by_shard: dict[int, list[str]] = defaultdict(list)
        for player, shard in zip(players, self.layout.homes(players, view.region), strict=True):
            by_shard[shard].append(player)
        index = {key: i for i, key in enumerate(view.keys)}
        groups: dict[int, list[str]] = {}
        for shard, members in by_shard.items():
            at = index.get(keys.period_key(self.prefixes[shard], view.period))
            if at is None:
                return None
            groups[at] = members
        return groups

    async def _ranked_at_home(self, reader: View, groups: dict[int, list[str]]) -> list[Entry]:
        """``query``'s unique ranks for players grouped by their home key (``_home_groups``): their
        rows and the rows ahead of them at home in one atomic call per home key, then the rows ahead
        in every other key. The first round of the general path (ZMSCORE) and its home-key check are
        folded into one, so a friend costs one ZREVRANK at home and a count per other key."""
        placed = sorted(await reader.home_places(groups), reverse=True)
        away = await reader.counts_away([(row, home) for row, home, _ in placed])
        return [self.entry(ahead + n + 1, row) for (row, _, ahead), n in zip(placed, away, strict=True)]


def _stream(values: list[Any]) -> bytes:
    """``values`` as a stream of MessagePack objects: their array's encoding without its header (1,
    3 or 5 bytes by length), which write.lua unpacks into a table sized once."""
    packed: bytes = msgpack.packb(values)
    n = len(values)
    return packed[1 if n < 16 else 3 if n < 65536 else 5 :]
