"""Settlement: a closed period frozen, ordered from PostgreSQL, checked against Redis, and paid once.

``Settler.settle`` runs these steps; each is idempotent, so a settlement killed between any two of
them (or inside the last, whose transaction then rolls back) and run again with the same id ends in
the same state as one uninterrupted run (tests/test_settlement.py kills a real process at each):

1. ``begin``: the settlement row is inserted, or the one stored under the id is compared with the
   request (another board, period, reward table, top N or webhook URL: 409; already settled: its
   stored result is returned and nothing else happens). One settlement per (board, incarnation, period).
2. ``freeze``: the period is frozen on every shard (``freeze``: no write changes it from then on;
   reads go on). The total's freeze closes the board: it takes no more results at all. Before it,
   the row records that the run goes to its freeze (``freeze_begun``, ``_freeze_begun``): what
   `rebuild --all` reads after a total loss of Redis to close the board again, or not.
3. ``drain``: the journals are read for their position after the freeze; every result the period
   holds was journaled before it. Settling waits until the archiver has copied the journals up to
   there into PostgreSQL (each journal's first entry is past that position), or raises
   ArchiveBehind, which a caller retries.
4. ``compute``: the final order from ``match_results`` (the source of truth), folded per player by
   the board's rule (as shardlb/rebuild.py's ``Fold``), in the codec's unique order.
5. ``check``: per shard, the member count and checksum of that order against the frozen Redis board
   (shardlb/reconcile.py's checksum). A difference stops the settlement with the report (stored on
   the row, state ``mismatch``) unless ``force`` is given; PostgreSQL's order is the one paid.
6. ``store``: ONE transaction writes the snapshot (ranks 1 to top N and every rewarded rank), the
   awards (UNIQUE (settlement, player)), the webhook deliveries, and marks the row ``settled`` with
   the result, unless a rewarded player was banned since step 4 (409, nothing paid; a ban being
   committed is waited for, later ones wait for this commit). Before the commit nothing is paid;
   after it, a re-run only returns the result.

While the board is resharded (shardlb/reshard.py) a settlement is refused for a retry
(``Resharding``), before its freeze and again after its check: ``_at_rest``; so it is while
`shardlb rebuild` has not rebuilt every shard of the board after a loss of Redis (``Rebuilding``).

Two runs of one id at once are kept apart by a PostgreSQL advisory lock held for the run (the second
gets 409 ``settlement_busy``); a killed run's lock goes with its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx
import orjson
import psycopg
from redis.exceptions import ResponseError

from shardlb import archive, keys, moderation, periods, rebuild, settlement_rewards, times
from shardlb.board import Board, band_shards
from shardlb.board import rebuilding as rebuilding_error
from shardlb.config import check_id
from shardlb.errors import (
    ArchiveBehind,
    BoardConflict,
    BoardNotFound,
    InvalidInput,
    Resharding,
    SettlementConflict,
    unknown_field,
)
from shardlb.fanout import batch
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import ShardCheck, checksum
from shardlb.settlement_rewards import Tier
from shardlb.store import BoardStore

DEFAULT_TOP_N = 1000
MAX_TOP_N = 100_000
DRAIN_WAIT_S = 30.0
RESHARD_RETRY_S = 5.0  # the Retry-After of a settlement refused while its board is resharded
MAX_URL = 2048  # characters of a webhook_url
SHARDS_IN_FLIGHT = 8  # shards read at once by the check (each a ZSCAN on its own connection)
# Award ids (``award_id``) lie in [AWARD_ID_FLOOR, 2^63): above every id the table's sequence gave
# out (before 2026-12-06, and a release of before writing beside this one), so the two never meet.
AWARD_ID_FLOOR = 2**40
AWARD_SALTS = 4  # draws of a settlement's award ids before a clash of ids is raised
STEPS = ("begin", "freeze", "drain", "compute", "check", "snapshot", "awards", "commit")

SCHEMA = """
CREATE TABLE IF NOT EXISTS settlements (
    settlement_id text PRIMARY KEY,
    board text NOT NULL,
    incarnation text NOT NULL,
    period text NOT NULL,
    rewards jsonb NOT NULL,
    top_n integer NOT NULL,
    tie_awards text NOT NULL,
    webhook_url text,
    state text NOT NULL,
    report jsonb,
    result jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    settled_at timestamptz,
    UNIQUE (board, incarnation, period)
);
CREATE TABLE IF NOT EXISTS settlement_snapshots (
    settlement_id text NOT NULL REFERENCES settlements,
    rank bigint NOT NULL,
    player_id text NOT NULL,
    points bigint NOT NULL,
    achieved_ms bigint NOT NULL,
    score bigint NOT NULL,
    PRIMARY KEY (settlement_id, rank)
);
CREATE INDEX IF NOT EXISTS settlement_snapshots_by_player ON settlement_snapshots (player_id, settlement_id);
CREATE TABLE IF NOT EXISTS settlement_awards (
    award_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    settlement_id text NOT NULL REFERENCES settlements,
    rank bigint NOT NULL,
    player_id text NOT NULL,
    points bigint NOT NULL,
    reward text NOT NULL,
    UNIQUE (settlement_id, player_id)
);
CREATE INDEX IF NOT EXISTS settlement_awards_by_rank ON settlement_awards (settlement_id, rank);
CREATE TABLE IF NOT EXISTS settlement_acks (
    award_id bigint PRIMARY KEY REFERENCES settlement_awards,
    acked_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS settlement_deliveries (
    award_id bigint PRIMARY KEY REFERENCES settlement_awards,
    url text NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    next_at timestamptz NOT NULL DEFAULT now(),
    delivered_at timestamptz,
    last_error text
);
CREATE INDEX IF NOT EXISTS settlement_deliveries_due ON settlement_deliveries (next_at)
    WHERE delivered_at IS NULL;
CREATE INDEX IF NOT EXISTS match_results_by_player
    ON match_results (board, incarnation, player_id, achieved_ms);
ALTER TABLE settlements ADD COLUMN IF NOT EXISTS freeze_begun boolean;
"""


# The rows a rebuild keeps (shardlb/rebuild.py, ``_rows``): none of a banned player's (``BANNED``:
# the parameter is moderation.ALL), none journaled before a removal of their player on that shard
# (shardlb/moderation.py) that did not leave the period whole (``REMOVED``: the parameters are the
# board and incarnation of the rows, then the period's name; ``kept`` lists those a removal made at
# an earlier call's time left whole, where the player's entry was achieved since). A removed or
# banned player is therefore neither ranked nor rewarded, and Redis (which the removal emptied too)
# agrees.
BANNED = (
    "AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.player_id = m.player_id AND (b.board = %s "
    "OR (b.board = m.board AND (b.incarnation IS NULL OR b.incarnation = m.incarnation))))"
)
# A removal of the row's player on its shard journaled after the row, in ``x``.
REMOVED_AFTER = (
    "(x.board, x.incarnation, x.shard, x.player_id) = (m.board, m.incarnation, m.shard, m.player_id) "
    "AND (split_part(x.journal_id, '-', 1)::numeric, split_part(x.journal_id, '-', 2)::numeric) "
    "> (split_part(m.journal_id, '-', 1)::numeric, split_part(m.journal_id, '-', 2)::numeric)"
)
# The board and incarnation are given again, as constants, though ``REMOVED_AFTER`` ties them to the
# row's: the settlement's rows come out of a UNION ALL (``order_sql``), whose branches' constants the
# planner does not carry to its output, and on an archive analysed as it is it hashed every board's
# removals for the anti join (all of player_removals, for each settlement). With them, the board's
# removals only, read once (with ``ORDER_SETTINGS``; tests/test_read_plans.py, 2026-12-06).
REMOVED = (
    "AND NOT EXISTS (SELECT 1 FROM player_removals x WHERE (x.board, x.incarnation) = (%s, %s) "
    f"AND {REMOVED_AFTER} AND NOT coalesce(%s = ANY(x.kept), FALSE))"
)
# ``BANNED`` with the board and its incarnation as constants (``moderation.BANNED_ON``: the
# parameters are the board and incarnation): the order runs with nested loops off, and its anti join
# then hashed the bans the condition could not tell apart from the row's board, every ban of every
# board (245-265 ms a settlement with 1,000,000 bans of other boards; 24-34 ms with the constants and
# the index on the bans' board, ``bans_by_board``; tests/test_read_plans.py, 2026-12-06).
BANNED_HERE = (
    f"AND NOT EXISTS (SELECT 1 FROM bans b WHERE b.player_id = m.player_id AND {moderation.BANNED_ON})"
)
MODERATED = f"{BANNED_HERE} {REMOVED}"
# For the transaction of ``order_sql``'s read (``Settlement.final_order``): no nested loop. On a board
# grown since the last ANALYZE (estimated at a row or two) the planner, given ``REMOVED``'s constants,
# made the NOT EXISTS a nested loop over a copy of the board's removals, all of them read again for
# each row: 3.2 s for 20,000 rows and 2,000 removals. Without it, a hash of them (a look-up of each
# row's removals by the full key, OFFSET 0, made a board of 100,000 rows 6x slower). As the rebuild's
# read of a shard (rebuild.ROWS_SETTINGS).
ORDER_SETTINGS = "SELECT set_config('enable_nestloop', 'off', true)"


async def ensure_schema(db: psycopg.AsyncConnection[Any]) -> None:
    """The archive's and moderation's tables and the settlement's (idempotent; one creator at a time)."""
    await archive.ensure_schema(db, archive.SCHEMA, moderation.SCHEMA, SCHEMA)


@dataclass(frozen=True)
class Request:
    """What a caller asks: ``rewards`` is the parsed table (shardlb/settlement_rewards.py).

    ``webhook_url`` is part of the settlement once stored: the first one stored is kept, a later run
    naming none delivers to it and one naming another is 409 ``settlement_conflict``.
    ``webhook_default`` (the router's SHARDLB_SETTLEMENT_WEBHOOK_URL) is stored only when the request
    names none and the settlement has none yet. ``can_sign`` says whether the caller holds
    SHARDLB_WEBHOOK_SECRET: without it a settlement with a webhook is 409 ``webhook_not_configured``
    before anything is done, as nothing is ever signed with an empty key."""

    settlement_id: str
    rewards: tuple[Tier, ...]
    top_n: int = DEFAULT_TOP_N
    force: bool = False
    webhook_url: str | None = None
    webhook_default: str | None = None
    can_sign: bool = True

    @classmethod
    def of(cls, body: dict[str, Any]) -> Request:
        """A request from its JSON body (the endpoint's and the command's); InvalidInput if bad."""
        allowed = ("settlement_id", "rewards", "top_n", "force", "webhook_url")
        for name in body:
            if name not in allowed:
                raise unknown_field(name, allowed)
        settlement_id = check_id(body.get("settlement_id"), "settlement_id")
        top_n = body.get("top_n", DEFAULT_TOP_N)
        if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= MAX_TOP_N:
            raise InvalidInput(f"top_n must be an integer from 0 to {MAX_TOP_N}", "top_n")
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise InvalidInput("force must be true or false", "force")
        url = body.get("webhook_url")
        if url is not None:
            url = webhook_url(url)
        return cls(settlement_id, settlement_rewards.parse(body.get("rewards")), top_n, force, url)


def webhook_url(value: object) -> str:
    """``value`` if it is an http:// or https:// URL with a host (and a port, if any, from 1 to
    65535) that httpx can send to; InvalidInput naming ``webhook_url`` otherwise."""
    message = f"webhook_url must be an http:// or https:// URL with a host, at most {MAX_URL} characters"
    if not isinstance(value, str) or len(value) > MAX_URL:
        raise InvalidInput(message, "webhook_url")
    try:
        # Every part is read inside: ``host`` decodes IDNA, and an invalid A-label (``xn--``)
        # raises there, not in the parse.
        url = httpx.URL(value)
        port = url.port
        good = url.scheme in ("http", "https") and bool(url.host) and (port is None or 0 < port < 65536)
    except (httpx.InvalidURL, ValueError) as e:  # IDNA errors are ValueErrors
        raise InvalidInput(f"{message} ({e})", "webhook_url") from e
    if not good:
        raise InvalidInput(message, "webhook_url")
    return value


class Standing(NamedTuple):
    """One player's final place: ``score`` packs points and time as the board's codec does."""

    score: int
    player_id: str
    shard: int


def period_bounds(board: Board, name: str) -> tuple[int, int]:
    """[start, end) of a dated period in epoch ms, in the board's time zone and week start."""
    week_start = board.config.week_start
    return periods.start_ms(name, board.tz, week_start), periods.end_ms(name, board.tz, week_start)


def closes_at(board: Board, name: str) -> int:
    """When a dated period is closed: its end plus the board's ``close_grace``, or plus its
    retention when that is shorter (``periods.closes_ms``)."""
    c = board.config
    kept = c.retention_days[periods.first_day(name)[0]]
    return periods.closes_ms(name, board.tz, c.close_grace_s, c.week_start, kept)


async def freeze(board: Board, name: str) -> None:
    """Step 2: freeze a dated period on every shard (``Board.freeze``: idempotent). The total, of a
    board archived at its season's end, is frozen by closing the board (``Board.close``): from each
    shard's marker on, the board takes no result, so every one it took is drained, checked and paid."""
    if name == "total":
        await board.close()
    else:
        await board.freeze(name)


class Settler:
    """Settles periods of one cluster against one archive; see the module docstring.

    ``step`` is called with each step's name once it is done (the crash tests stop a process there).
    """

    def __init__(
        self,
        rebuilder: Rebuilder,
        step: Callable[[str], None] | None = None,
        drain_wait_s: float = DRAIN_WAIT_S,
    ) -> None:
        self.rebuilder = rebuilder
        self.db = rebuilder.db  # autocommit; transactions are explicit
        self.step = step or (lambda _: None)
        self.drain_wait_s = drain_wait_s

    async def settle(
        self, board: Board, period: str, request: Request, now_ms: int | None = None, season: bool = False
    ) -> dict[str, Any]:
        """Settle ``board``'s API period (``daily:2026-11-30``...) as ``request`` says; return the
        result, the same one on every run of the same id. ``season`` settles the total instead (a
        board archived at its season's end: ``archive_season``), which never closes by itself."""
        if board.config.durability != "journal":
            raise SettlementConflict(
                f"board {board.config.id!r} keeps no journal (durability memory): nothing to settle from",
                "board",
                "not_journaled",
            )
        now = times.now_ms() if now_ms is None else now_ms
        c = board.config
        name = "total" if season else periods.parse(period, c.periods, board.tz, now, c.week_start)
        if name == "total" and not season:
            raise InvalidInput(
                "the total period never closes: settle a dated period (or archive the board)",
                "period",
                "invalid_period",
            )
        # No result is achieved before the epoch (the codec refuses it): a period ending by then is
        # empty for good, and settling it would only use it up.
        if not season and periods.end_ms(name, board.tz, c.week_start) <= c.epoch_ms:
            raise InvalidInput(
                f"period {periods.api_name(name)} ends by the board's epoch {times.format_ms(c.epoch_ms)}: "
                "it holds no result",
                "period",
                "invalid_period",
            )
        if not season and now < closes_at(board, name):
            raise SettlementConflict(
                f"period {periods.api_name(name)} is not closed yet: it closes at "
                f"{times.format_ms(closes_at(board, name))}",
                "period",
                "period_open",
            )
        await ensure_schema(self.db)
        lock = _lock_key(request.settlement_id)
        cur = await self.db.execute("SELECT pg_try_advisory_lock(%s)", (lock,))
        if not (await cur.fetchone() or (False,))[0]:
            raise SettlementConflict(
                f"settlement {request.settlement_id!r} is running now; try again when it ends",
                "settlement_id",
                "settlement_busy",
            )
        try:
            return await self._run(board, name, request, now)
        finally:
            with contextlib.suppress(psycopg.Error):  # a broken connection took the lock with it
                await self.db.execute("SELECT pg_advisory_unlock(%s)", (lock,))

    async def _run(self, board: Board, name: str, request: Request, now: int) -> dict[str, Any]:
        await self._not_lost(board, name)
        stored = await self._begin(board, name, request)
        if stored is not None:
            await self._record_paid(board, name, request)  # a run killed before it, or of before
            return stored
        self.step("begin")
        await self._at_rest(board)
        await self._freeze_begun(request)
        await freeze(board, name)
        self.step("freeze")
        await self.drained(board, name)
        self.step("drain")
        order = await self.final_order(board, name)
        self.step("compute")
        checks = await self.check(board, name, order)
        self.step("check")
        await self._at_rest(board)  # a reshard since the first look: the check may have compared two layouts
        drifting = [c for c in checks if c.drift]
        if drifting and not request.force:
            report = check_report(checks)
            # Past its retention a period's keys have expired: nothing is left in Redis to check
            # PostgreSQL's order against (the board's reads answer it empty too: holds_nothing).
            expired = board.holds_nothing(name, now)
            if expired:
                report["redis_expired"] = True
            await self.db.execute(
                "UPDATE settlements SET state = 'mismatch', report = %s WHERE settlement_id = %s",
                (orjson.dumps(report).decode(), request.settlement_id),
            )
            if expired:
                kept = board.config.retention_days[periods.first_day(name)[0]]
                raise SettlementConflict(
                    f"period {periods.api_name(name)} is past its retention ({kept} days after its end): "
                    "its Redis keys have expired, so there is nothing to check PostgreSQL's order against; "
                    "nothing was paid; settle again with force to pay PostgreSQL's order",
                    "period",
                    "settlement_mismatch",
                )
            raise SettlementConflict(
                f"Redis and PostgreSQL disagree on {len(drifting)} of {len(checks)} shards ("
                + "; ".join(
                    f"shard {c.shard}: redis {c.redis_players} players, postgres {c.postgres_players}"
                    for c in drifting[:5]
                )
                + "): nothing was paid; see GET /v1/settlements/{id}, or settle again with force",
                "period",
                "settlement_mismatch",
            )
        result = await self._store(board, name, request, order, checks)
        # After the commit: a Redis record of the payment that outlives a restore of PostgreSQL
        # (``_not_lost``). Failing here, the run is answered with the error; run again, it finds
        # the stored result and records it then.
        await self._record_paid(board, name, request)
        return result

    async def _freeze_begun(self, request: Request) -> None:
        """Record in PostgreSQL, before step 2, that the run goes to its freeze (``freeze_begun``):
        the one record a total loss of Redis leaves of whether a season archive closed its board.
        `rebuild --all` closes again the board of a total's row that says so, or that a release of
        before wrote (NULL: it cannot tell), and leaves open one whose archive was refused or stopped
        before it (FALSE, as ``_begin`` inserts it): shardlb/rebuild.py, ``_seasons``. Written before
        the close, so a run killed between the two has the board come back closed, as the run again
        closes it, and never open after the archive closed it."""
        await self.db.execute(
            "UPDATE settlements SET freeze_begun = TRUE "
            "WHERE settlement_id = %s AND freeze_begun IS NOT TRUE",
            (request.settlement_id,),
        )

    async def _record_paid(self, board: Board, name: str, request: Request) -> None:
        """``Board.mark_paid``, after the payment's commit. A board deleted since (a season's
        archive, or a deletion meanwhile) has nothing to record it on and no period to settle
        again. A reshard's refusal is Resharding: the run again, after it, records it."""
        try:
            await board.mark_paid(name, request.settlement_id)
        except BoardNotFound:
            pass
        except ResponseError as e:
            if "BOARDMOVED" not in str(e):
                raise
            raise Resharding(
                f"board {board.config.id!r} is being resharded: settlement {request.settlement_id!r} is "
                "paid; run it again when the reshard ends to record it in Redis",
                RESHARD_RETRY_S,
            ) from e

    async def _at_rest(self, board: Board) -> None:
        """Refuse, for a retry, while the board is resharded or has been since ``board`` was read
        (shardlb/reshard.py). Until a reshard has finished, the archive's rows name the old layout's
        shards, which the check compares with the new one's, and the old layout's journals may hold
        results the archiver has not taken (``drained`` waits for the layout's own journals only): a
        settlement then would find a drift that is no drift, and a forced one would pay an order that
        lacks results the board acknowledged. Refused too (Rebuilding, 503 board_rebuilding) while
        the board is being rebuilt after a loss of Redis: the check would read shards still empty
        (docs/design-notes.md, "A board being rebuilt"), and while a shard of it has lost its keys
        alone (``_lost_shards``). Only the shards the settlement reads count: a band board's band
        shards, which hold the top of the total alone, made again from the home shards by their
        rebuild, are never drained nor checked (``Layout.view(False)``: the home shards). Until
        2026-12-06 a band shard lost alone refused the settlement too, which had nothing to lose by
        it (tests/test_settlement_recovery.py)."""
        try:
            await self.rebuilder.check_layout(board, "settle", reads=board.layout.view(False))
        except BoardNotFound:
            raise
        except BoardConflict as e:
            raise Resharding(
                f"board {board.config.id!r} is being resharded: its archive moves to the new layout "
                "when the reshard finishes; settle it then (shardlb reshard --status)",
                RESHARD_RETRY_S,
            ) from e
        lost = await self._lost_shards(board)
        if lost:  # the command to run is named once, by ``rebuilding_error``: until 2026-12-06 twice
            once = "it is" if len(lost) == 1 else "they are"
            then = f"nothing was paid; settle again once {once} rebuilt"
            raise rebuilding_error(board.config.id, lost, then, band_shards(board))

    async def _lost_shards(self, board: Board) -> list[int]:
        """The board's home shards without their sentinel (keys.sentinel_key) when its record says its
        layout carries them (``Board.sentinels``): Redis lost them alone, and the archiver may not
        have marked them yet (its next round; none while no archiver runs). Asked before the freeze
        and after the check (``_at_rest``), so a shard lost before or while the check read it is
        refused, not reported as drift: until 2026-12-06 the settlement stopped with
        ``settlement_mismatch``, its row left in ``mismatch``, and its message said to settle again
        with ``force``."""
        if not board.sentinels:
            return []
        shards = board.layout.view(False)  # those the drain and the check read (``_at_rest``)
        found = batch(self.rebuilder.client)
        for shard in shards:
            found.execute_command("EXISTS", keys.sentinel_key(board.prefixes[shard]))
        return [s for s, there in zip(shards, await found.execute(), strict=True) if not there]

    async def _not_lost(self, board: Board, name: str) -> None:
        """Refuse (409 period_settled) a period Redis records as paid (``Board.mark_paid``) by a
        settlement this archive does not hold as settled: PostgreSQL was restored from a backup
        taken before it was paid. Its awards went out (webhooks, pages read); the run would pay
        every winner again, under award ids the restored sequence hands out again (docs/
        design-notes.md, "PostgreSQL restored from a backup"). Until 2026-12-05 it did."""
        paid = await board.paid(name)
        if paid is None:
            return
        cur = await self.db.execute(
            "SELECT 1 FROM settlements WHERE settlement_id = %s AND state = 'settled'", (paid,)
        )
        if await cur.fetchone() is not None:
            return
        raise SettlementConflict(
            f"period {periods.api_name(name)} of board {board.config.id!r} was paid by settlement "
            f"{paid!r}, which this archive does not hold (PostgreSQL restored from a backup taken before "
            'it?): not paid again. See docs/design-notes.md, "PostgreSQL restored from a backup"',
            "settlement_id",
            "period_settled",
        )

    async def _begin(self, board: Board, name: str, request: Request) -> dict[str, Any] | None:
        """Step 1: the row, inserted or compared (``_compare``); the stored result when it is
        settled already. The webhook rule is Request's: the first URL stored is kept."""
        rewards = settlement_rewards.to_json(request.rewards)
        named = request.webhook_url
        _check_signable(request)
        await self.db.execute(
            "INSERT INTO settlements (settlement_id, board, incarnation, period, rewards, top_n, tie_awards, "
            "webhook_url, state, freeze_begun) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'started', FALSE) "
            "ON CONFLICT DO NOTHING",
            (
                request.settlement_id,
                board.config.id,
                board.incarnation,
                name,
                orjson.dumps(rewards).decode(),
                request.top_n,
                board.config.tie_awards,
                named or request.webhook_default,
            ),
        )
        row = await self.stored(request.settlement_id)
        if row is None:
            cur = await self.db.execute(
                "SELECT settlement_id FROM settlements WHERE board = %s AND incarnation = %s AND period = %s",
                (board.config.id, board.incarnation, name),
            )
            other = await cur.fetchone()
            raise SettlementConflict(
                f"period {periods.api_name(name)} of board {board.config.id!r} has settlement "
                f"{other[0] if other else '?'!r} already: run that one again",
                "settlement_id",
                "period_settled",
            )
        _compare(request, (board.config.id, board.incarnation, name, rewards, request.top_n), row)
        state, stored, result = row[5:]
        if state == "settled":
            return dict(result)
        if not stored and (named or request.webhook_default):  # stopped before; nothing is paid yet
            await self.db.execute(
                "UPDATE settlements SET webhook_url = %s WHERE settlement_id = %s AND webhook_url IS NULL",
                (named or request.webhook_default, request.settlement_id),
            )
        return None

    async def stored(self, settlement_id: str) -> tuple[Any, ...] | None:
        """The settlement row under an id, as ``_compare`` takes it (then its result), or None."""
        cur = await self.db.execute(
            "SELECT board, incarnation, period, rewards, top_n, state, webhook_url, result FROM settlements "
            "WHERE settlement_id = %s",
            (settlement_id,),
        )
        row = await cur.fetchone()
        return None if row is None else tuple(row)

    async def settled_season(
        self, board_id: str, request: Request, besides: str | None = None
    ) -> dict[str, Any] | None:
        """The stored result of a season archive of ``board_id`` (a board it deleted) under the
        request's id, checked against the request as a run of a settlement is (``_compare``); None
        when there is none, as for a board that never existed. ``besides``: the incarnation of the
        board that holds the id now; a settlement of it is not one of a board deleted (None)."""
        _check_signable(request)
        await ensure_schema(self.db)
        row = await self.stored(request.settlement_id)
        if row is None or row[0] != board_id or row[2] != "total" or row[5] != "settled":
            return None
        if besides is not None and row[1] == besides:
            return None
        rewards = settlement_rewards.to_json(request.rewards)
        _compare(request, (board_id, row[1], "total", rewards, request.top_n), row)
        return dict(row[7])

    async def drained(self, board: Board, name: str) -> None:
        """Step 3: wait until every result journaled before the freeze is in PostgreSQL."""
        prefixes = [board.prefixes[s] for s in board.layout.view(False)]
        marks = [await self.rebuilder.mark(p) for p in prefixes]
        deadline = time.monotonic() + self.drain_wait_s
        while True:
            behind = 0
            for prefix, mark in zip(prefixes, marks, strict=True):
                first = (await self.rebuilder.mark(prefix)).first
                behind += first is not None and first <= mark.position
            if not behind:
                return
            if time.monotonic() >= deadline:
                raise ArchiveBehind(
                    f"the archiver has not yet copied {behind} shard journal(s) of board "
                    f"{board.config.id!r} up to the freeze into PostgreSQL; retry shortly "
                    "(is `shardlb archive` running?)",
                    5.0,
                )
            await asyncio.sleep(0.2)

    async def final_order(self, board: Board, name: str) -> list[Standing]:
        """Step 4: every player of the period from ``match_results``, best first (the codec's
        unique order: a higher score, then the larger player id, as shardlb/merge.py)."""
        start, end = (0, 2**62) if name == "total" else period_bounds(board, name)
        mode, codec = board.config.mode, board.codec
        sql, params = order_sql(mode), order_params(board.config.id, board.incarnation, start, end, name)
        async with self.db.transaction():
            await self.db.execute(ORDER_SETTINGS)
            cur = await self.db.execute(sql, params)
            found = await cur.fetchall()
        if mode == "incr":
            out = [
                Standing(codec.encode_units(int(total), (last - codec.epoch_ms) // codec.unit_ms), p, s)
                for total, p, s, last in found
            ]
        else:
            out = [Standing(int(score), p, s) for score, p, s in found]
        out.sort(reverse=True)
        return out

    async def check(self, board: Board, name: str, order: Sequence[Standing]) -> list[ShardCheck]:
        """Step 5: each shard's frozen Redis board against its share of ``order``."""
        expected: dict[int, dict[str, int]] = defaultdict(dict)
        for s in order:
            expected[s.shard][s.player_id] = s.score
        gate = asyncio.Semaphore(SHARDS_IN_FLIGHT)

        async def one(shard: int) -> ShardCheck:
            async with gate:
                actual = await self.rebuilder.members(keys.period_key(board.prefixes[shard], name))
            mine = expected.get(shard, {})
            return ShardCheck(shard, len(actual), len(mine), checksum(actual), checksum(mine), 0)

        return list(await asyncio.gather(*(one(s) for s in board.layout.view(False))))

    async def _store(
        self, board: Board, name: str, request: Request, order: Sequence[Standing], checks: list[ShardCheck]
    ) -> dict[str, Any]:
        """Step 6: snapshot, awards, deliveries and the settled mark in one transaction."""
        codec = board.codec
        # Only the ranks the table reaches are decoded (and the ties after its last), not every player.
        reach = min(settlement_rewards.deepest(request.rewards, len(order)), len(order))
        points = [codec.decode_units(s.score)[0] for s in order[:reach]]
        while points and reach < len(order) and codec.decode_units(order[reach].score)[0] == points[-1]:
            points.append(points[-1])
            reach += 1
        awards = settlement_rewards.assign(request.rewards, points, board.config.tie_awards, len(order))
        kept = sorted({*range(1, min(request.top_n, len(order)) + 1), *(a.rank for a in awards)})
        sid = request.settlement_id
        by_reward = Counter(a.reward for a in awards)
        result = {
            "settlement_id": sid,
            "board": board.config.id,
            "period": periods.api_name(name),
            "state": "settled",
            "players": len(order),
            "top_n": request.top_n,
            "rewards": settlement_rewards.to_json(request.rewards),
            "tie_awards": board.config.tie_awards,
            "awards": {"total": len(awards), "by_reward": dict(sorted(by_reward.items()))},
            "forced": any(c.drift for c in checks),
            "check": check_report(checks),
        }
        # The award ids are drawn from the settlement and the player (``award_id``), not from the
        # table's sequence: a PostgreSQL restored from a backup hands a sequence's numbers out again.
        for salt in range(AWARD_SALTS):
            try:
                await self._write(board, name, request, result, order, awards, points, kept, salt)
            except psycopg.errors.UniqueViolation as e:
                # Two awards drew one id (a chance of about n^2 / 2^64 for n awards in the table):
                # rolled back, drawn again under the next salt.
                if e.diag.constraint_name != "settlement_awards_pkey" or salt == AWARD_SALTS - 1:
                    raise
                continue
            break
        self.step("commit")
        return result

    async def _write(
        self,
        board: Board,
        name: str,
        request: Request,
        result: dict[str, Any],
        order: Sequence[Standing],
        awards: Sequence[settlement_rewards.Award],
        points: Sequence[int],
        kept: Sequence[int],
        salt: int,
    ) -> None:
        """``_store``'s transaction, the award ids drawn under ``salt`` (``award_id``)."""
        sid, codec = request.settlement_id, board.codec
        of = (board.config.id, board.incarnation, name)  # what a run of the id again settles too
        async with self.db.transaction(), self.db.cursor() as cur:
            await cur.execute(
                "SELECT state, webhook_url FROM settlements WHERE settlement_id = %s FOR UPDATE", (sid,)
            )
            row = await cur.fetchone()
            if row is None or row[0] == "settled":  # settled meanwhile (the lock makes this rare)
                raise SettlementConflict(
                    f"settlement {sid!r} changed while it ran; run it again", "settlement_id"
                )
            url = result["webhook_url"] = row[1]  # the one stored (``_begin``), not this run's
            # A ban committed since ``compute`` read the order (after the check, Redis may still
            # hold the player): nothing is paid, and the run again leaves the player out. SHARE
            # mode waits for a ban being inserted to commit (or roll back) and holds new ones off
            # until this commits, so no ban falls between the look-up and the awards.
            await cur.execute("LOCK TABLE bans IN SHARE MODE")
            await cur.execute(
                f"SELECT player_id FROM bans b WHERE {moderation.BANNED_ON} AND player_id = ANY(%s) LIMIT 1",
                (board.config.id, board.incarnation, [order[a.rank - 1].player_id for a in awards]),
            )
            banned = await cur.fetchone()
            if banned is not None:
                raise SettlementConflict(
                    f"player {banned[0]!r} was banned while settlement {sid!r} ran: nothing was paid; "
                    "run it again (its order then leaves the player out)",
                    "settlement_id",
                )
            async with cur.copy(
                "COPY settlement_snapshots (settlement_id, rank, player_id, points, achieved_ms, score) "
                "FROM STDIN"
            ) as copy:
                for rank in kept:
                    s = order[rank - 1]
                    p, at = codec.decode(s.score)
                    await copy.write_row((sid, rank, s.player_id, p, at, s.score))
            self.step("snapshot")
            async with cur.copy(
                "COPY settlement_awards (award_id, settlement_id, rank, player_id, points, reward) FROM STDIN"
            ) as copy:
                for a in awards:
                    player = order[a.rank - 1].player_id
                    await copy.write_row(
                        (award_id(sid, player, salt, of), sid, a.rank, player, points[a.rank - 1], a.reward)
                    )
            self.step("awards")
            if url:
                await cur.execute(
                    "INSERT INTO settlement_deliveries (award_id, url) "
                    "SELECT award_id, %s FROM settlement_awards WHERE settlement_id = %s",
                    (url, sid),
                )
            await cur.execute(
                "UPDATE settlements SET state = 'settled', settled_at = now(), report = %s, result = %s "
                "WHERE settlement_id = %s",
                (orjson.dumps(result["check"]).decode(), orjson.dumps(result).decode(), sid),
            )


def order_sql(mode: str) -> str:
    """``Settlement.final_order``'s query on a board of ``mode`` (parameters: ``order_params``), run
    after ``ORDER_SETTINGS`` in its transaction: per (player, shard), the period's applications that
    moderation leaves (``MODERATED``) folded by the mode's rule."""
    # The period's applications: the rows that did not skip it, and those a later application
    # of their (match, player) replaced after it closed (``match_holds``: shardlb/archive.py).
    held = (
        "SELECT board, incarnation, player_id, shard, points, achieved_ms, score, journal_id FROM {} "
        "WHERE board = %s AND incarnation = %s AND achieved_ms >= %s AND achieved_ms < %s AND {}"
    )
    applied = (
        held.format("match_results", "NOT %s = ANY(skipped)")
        + " UNION ALL "
        + held.format("match_holds", "period = %s")
    )
    where = f"FROM ({applied}) m WHERE TRUE {MODERATED}"
    if mode == "best":
        return f"SELECT max(score), player_id, shard {where} GROUP BY player_id, shard"
    if mode == "set":  # the latest result, the better of two at one time (write.lua's rule)
        return (
            f"SELECT DISTINCT ON (player_id, shard) score, player_id, shard {where} "
            "ORDER BY player_id, shard, achieved_ms DESC, score DESC"
        )
    # incr: the sum, at the latest time that scored; with nothing scored, the earliest (write.lua)
    return (
        "SELECT sum(points), player_id, shard, CASE WHEN sum(points) > 0 THEN "
        f"max(achieved_ms) FILTER (WHERE points > 0) ELSE min(achieved_ms) END {where} "
        "GROUP BY player_id, shard"
    )


def order_params(board_id: str, incarnation: str, start: int, end: int, name: str) -> tuple[Any, ...]:
    """``order_sql``'s parameters: the period ``name`` of a board's incarnation, achieved in [start, end)."""
    board = (board_id, incarnation)
    return (*(*board, start, end, name) * 2, *board, *board, name)


def check_report(checks: Sequence[ShardCheck]) -> dict[str, Any]:
    """The check as stored and returned: shards compared, and those that differ."""
    return {
        "shards": len(checks),
        "players": {
            "redis": sum(c.redis_players for c in checks),
            "postgres": sum(c.postgres_players for c in checks),
        },
        "drifting": [
            {
                "shard": c.shard,
                "redis_players": c.redis_players,
                "postgres_players": c.postgres_players,
                "redis_sum": f"{c.redis_sum:016x}",
                "postgres_sum": f"{c.postgres_sum:016x}",
            }
            for c in checks
            if c.drift
        ],
    }


def _compare(request: Request, values: tuple[Any, ...], row: Sequence[Any]) -> None:
    """A request against the settlement stored under its id (``Settler.stored``'s row): ``values``
    (board, incarnation, period, reward table, top_n) must be the row's, then the webhook rule of
    Request holds, and a stored URL, which a run delivers to, needs the secret. One home for the
    checks of a run (``_begin``) and of a season archive run again once its board is gone."""
    if tuple(row[:5]) != values:
        raise SettlementConflict(
            f"settlement {request.settlement_id!r} was made for another board, period, reward table "
            "or top_n: a settlement id is used for one settlement only",
            "settlement_id",
        )
    named, state, stored = request.webhook_url, row[5], row[6]
    if named and stored and named != stored:
        raise SettlementConflict(
            f"settlement {request.settlement_id!r} delivers to another webhook_url: its first one is "
            "kept (send the same one, or none)",
            "webhook_url",
        )
    if named and not stored and state == "settled":
        raise SettlementConflict(
            f"settlement {request.settlement_id!r} was settled without a webhook: send none",
            "webhook_url",
        )
    if stored and not request.can_sign:
        raise _unsigned(request.settlement_id)


def _check_signable(request: Request) -> None:
    """A request naming a webhook (or with a default) without the secret: refused before anything."""
    if (request.webhook_url or request.webhook_default) and not request.can_sign:
        raise _unsigned(request.settlement_id)


def _unsigned(settlement_id: str) -> SettlementConflict:
    return SettlementConflict(
        f"settlement {settlement_id!r} has a webhook, whose bodies are signed: set "
        "SHARDLB_WEBHOOK_SECRET where it runs (nothing was done)",
        None,
        "webhook_not_configured",
    )


def award_id(
    settlement_id: str, player_id: str, salt: int = 0, of: tuple[str, str, str] = ("", "", "")
) -> int:
    """The id of the award of ``settlement_id`` to ``player_id``: the webhook's Idempotency-Key and
    the id a game server pages and acknowledges. Drawn from the two, what the settlement settles
    (``of``: its board, incarnation and period) and ``salt`` (0 unless two awards drew one id),
    not from a sequence: after PostgreSQL is restored from a backup taken before a settlement, the
    sequence would hand its award ids out again to the next settlements, whose webhooks a receiver
    then drops as repeats of keys it took (until 2026-12-06; tests/test_settlement_recovery.py).
    The same settlement paying the same player again (run again after such a restore, once nothing
    refuses it) gives the same id, so the receiver drops that repeat instead; its id used for
    another period then (the restore freed it) gives others (drawn from the id and the player
    alone, earlier on 2026-12-06, they were the first payment's, and that period's webhooks were
    dropped as repeats)."""
    board, incarnation, period = of
    digest = hashlib.blake2b(
        f"award\x00{salt}\x00{settlement_id}\x00{player_id}\x00{board}\x00{incarnation}\x00{period}".encode(),
        digest_size=8,
    ).digest()
    return AWARD_ID_FLOOR + int.from_bytes(digest, "big") % (2**63 - AWARD_ID_FLOOR)


def _lock_key(settlement_id: str) -> int:
    """A signed 64-bit advisory lock key for a settlement id (the same in every process)."""
    digest = hashlib.blake2b(f"settlement\x00{settlement_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def run(
    redis_url: str,
    postgres_url: str,
    board_id: str,
    period: str,
    request: Request,
    step: Callable[[str], None] | None = None,
    drain_wait_s: float = DRAIN_WAIT_S,
) -> dict[str, Any]:
    """Settle on fresh connections (closed on exit): what `shardlb settle` and the endpoint run."""
    async with rebuild.connected(redis_url, postgres_url) as (rebuilder, store):
        board = await store.get(board_id)
        return await Settler(rebuilder, step, drain_wait_s).settle(board, period, request)


async def archive_season(
    redis_url: str,
    postgres_url: str,
    board_id: str,
    request: Request,
    step: Callable[[str], None] | None = None,
    drain_wait_s: float = DRAIN_WAIT_S,
    delete: Callable[[str, str | None], Awaitable[object]] | None = None,
) -> dict[str, Any]:
    """A board's season ended: settle its total (snapshot, awards) like a period, then delete the
    board (every key UNLINKed, shardlb/store.py); the settlement and its snapshot stay in PostgreSQL.
    Run again with the same id after a crash, it finishes what is left and returns the same result;
    once the board is gone, the stored result is checked against the request as any run's is, also
    when a board was created again under its id since (the next season's), which is left alone."""
    async with rebuild.connected(redis_url, postgres_url) as (rebuilder, store):
        try:
            board = await store.get(board_id)
        except BoardNotFound:
            # Deleted already: by this archive (its stored result), or it never existed.
            done = await Settler(rebuilder).settled_season(board_id, request)
            if done is None:
                raise
            await _deleted(rebuilder, store, board_id, request)  # if a run before failed to
            return {**done, "archived": True}
        # The id's settlement archived an earlier incarnation, deleted since: its answer was lost and
        # the board created again. Until 2026-12-05 this run took the new board for the settlement's
        # and answered 409 settlement_conflict, and a client that archived under a new id then
        # closed, paid and deleted the new season's board.
        done = await Settler(rebuilder).settled_season(board_id, request, besides=board.incarnation)
        if done is not None:
            await _deleted(rebuilder, store, board_id, request)
            return {**done, "archived": True}
        result = await Settler(rebuilder, step, drain_wait_s).settle(board, "total", request, season=True)
        # The router's delete, so that its cache forgets the board. The board settled only: one
        # deleted since is gone already, and one created again under the id meanwhile (the next
        # season's) is another board, which until 2026-12-05 this deleted with all its results.
        with contextlib.suppress(BoardNotFound):
            await (delete or store.delete)(board_id, board.incarnation)
        await _deleted(rebuilder, store, board_id, request)
        return {**result, "archived": True}


async def _deleted(rebuilder: Rebuilder, store: BoardStore, board_id: str, request: Request) -> None:
    """Record in PostgreSQL that the incarnation the settlement ``request`` archived is deleted,
    then forget the bans of the board's incarnations deleted (the one archived among them), as a
    DELETE does (``Bans.sweep``: only those known deleted). The mark is the archive's own: until
    2026-12-06 only a board with bans got it here (``Bans.forget``, through the sweep), the others
    from the archiver's next refresh, so Redis lost before that refresh had `rebuild --all` bring
    the archived board back, closed, with every result of its season. A run that fails here has
    deleted the board already: run again, it finds the settlement stored and finishes this."""
    row = await Settler(rebuilder).stored(request.settlement_id)
    if row is not None and row[0] == board_id:
        await archive.mark_deleted(rebuilder.db, board_id, str(row[1]))
    await moderation.Bans(store.client).sweep(rebuilder.db, board_id)
