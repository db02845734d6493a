"""Reads of settled periods, served from their snapshots in PostgreSQL (shardlb/settlement_history.py).

``settled_top`` and ``settled_player`` answer a read of a period that is settled, or return None for
the live path to answer it. Only a closed dated period that ends after the board's epoch can be
settled, so reads of an open period (nearly all reads), or of one before the epoch, never wait for
PostgreSQL. Whether a closed period is settled is kept per process:
a settled answer for good (a settlement is final), an unsettled one for ``UNSETTLED_TTL_S``; a
snapshot's top, immutable too, is kept in a small LRU. PostgreSQL is reached on a connection per
miss, as the admin endpoints do, from SHARDLB_POSTGRES_URL; without it reads stay live.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import psycopg

from router.auth import ANONYMOUS_CLIENT as ANONYMOUS
from router.errors import ApiError
from router.media import entry_body
from router.service import Service
from shardlb import merge, periods, pgconn, settlement, settlement_history, times
from shardlb.board import Board, Entry
from shardlb.reads import ResolvedView
from shardlb.settlement_history import Settled, Standing

UNSETTLED_TTL_S = 5.0
ARCHIVE_READS_PER_CLIENT = 2  # a client without a key, in progress or waiting (``archive_read``)
# Who the read in progress was admitted for (router.auth.Caller.client; routes.admit_read sets it).
READER: ContextVar[str] = ContextVar("reader", default="")
TOPS_KEPT = 256

SETTLED_KEPT = 65_536  # closed periods whose settlement is known; the first looked up is dropped first
_settled: OrderedDict[tuple[str, str, str], tuple[Settled | None, float]] = OrderedDict()
_tops: OrderedDict[tuple[str, int], list[Standing]] = OrderedDict()
_schema: set[str] = set()


def archive_url(svc: Service) -> str:
    """The archive's URL; 409 when this router has none (a setting of this router, not a passing
    state: a retry would not help, so not a 503)."""
    if not svc.settings.postgres_url:
        raise ApiError(409, "archive_not_configured", "this router has no PostgreSQL (SHARDLB_POSTGRES_URL)")
    return svc.settings.postgres_url


@asynccontextmanager
async def archive_db(svc: Service) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection to the archive with the settlement tables in place: 409 when this router has
    no PostgreSQL, 503 (retry) when it cannot be reached or fails."""
    url = archive_url(svc)
    try:
        settings = pgconn.options(url, connect_timeout=5)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True, **settings) as db:
            if url not in _schema:
                await settlement.ensure_schema(db)
                _schema.add(url)
            yield db
    except psycopg.Error as e:
        raise ApiError(
            503, "archive_unavailable", f"PostgreSQL failed: {type(e).__name__}", retry_after=5
        ) from e


@asynccontextmanager
async def archive_call(svc: Service) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """``archive_db`` for a write key's call (router/settlements.py): it waits for one of the
    worker's few archive-call permits (``Service.archive_calls``), and past the queue's bounds is
    503 overloaded, so a game server's burst of calls cannot take every connection PostgreSQL
    allows from the archiver, bans and settlements."""
    archive_url(svc)  # 409 first when there is no archive at all
    async with svc.archive_calls, archive_db(svc) as db:
        yield db


@contextmanager
def archive_reader(svc: Service) -> Iterator[None]:
    """The reading client's place among its archive reads for the block: a client without a key
    (``READER``, set by the read's admission) may have ARCHIVE_READS_PER_CLIENT of them in progress
    or waiting; one more is 429 at once, so one address cannot take the worker's few archive-read
    permits (and their queue) from everybody else. A client with a key has no such bound."""
    reader = READER.get()
    if not reader.startswith(ANONYMOUS):
        yield
        return
    held = svc.archive_readers.get(reader, 0)
    if held >= ARCHIVE_READS_PER_CLIENT:
        raise ApiError(
            429,
            "rate_limited",
            f"more than {ARCHIVE_READS_PER_CLIENT} archive reads at once from this client without a key; "
            "wait for their answers",
            retry_after=1.0,
        )
    svc.archive_readers[reader] = held + 1
    try:
        yield
    finally:
        left = svc.archive_readers[reader] - 1
        if left:
            svc.archive_readers[reader] = left
        else:
            del svc.archive_readers[reader]


@asynccontextmanager
async def archive_read(svc: Service, placed: bool = False) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """``archive_db`` for a public read: it waits for one of the worker's few archive-read permits
    (``Service.archive_reads``), and past the queue's bounds is 503 overloaded; the client takes its
    place first (``archive_reader``), unless ``placed``: a read whose other work comes first holds
    its place from the start, so that a client past its bound is refused before that work."""
    archive_url(svc)  # 409 first when there is no archive at all
    with nullcontext() if placed else archive_reader(svc):
        async with svc.archive_reads, archive_db(svc) as db:
            yield db


def may_be_settled(svc: Service, view: ResolvedView) -> bool:
    """Whether a read of ``view`` may have a settled snapshot to answer it (``_lookup`` asks
    PostgreSQL only then): not the total, nor a region's view, nor without PostgreSQL. Most reads
    are of the total: a read asks this first, and makes no coroutines of ``settled_player``'s."""
    return bool(svc.settings.postgres_url) and view.period != "total" and view.region is None


async def _lookup(svc: Service, board: Board, view: ResolvedView) -> Settled | None:
    if not may_be_settled(svc, view):
        return None
    if times.now_ms() < settlement.closes_at(board, view.period):
        return None
    c = board.config
    if periods.end_ms(view.period, board.tz, c.week_start) <= c.epoch_ms:
        return None  # it holds no result, and settling it is refused: nothing to ask PostgreSQL
    key = (board.config.id, board.incarnation, view.period)
    found = _settled.get(key)
    if found is not None and (found[0] is not None or time.monotonic() < found[1]):
        return found[0]
    async with archive_read(svc) as db:
        done = await settlement_history.settled(db, board, view.period)
    found = _settled.get(key)
    if done is None and found is not None and found[0] is not None:
        # A lookup begun after this one found it settled meanwhile: that answer is final.
        return found[0]
    _settled[key] = (done, time.monotonic() + UNSETTLED_TTL_S)
    _settled.move_to_end(key)
    while len(_settled) > SETTLED_KEPT:
        _settled.popitem(last=False)
    return done


def _entry(s: Standing, rank: int) -> dict[str, Any]:
    body = entry_body(Entry(rank, s.player_id, s.points, s.achieved_ms))
    if s.reward is not None:
        body["reward"] = s.reward
    return body


async def settled_top(
    svc: Service, board: Board, view: ResolvedView, limit: int, competition: bool = False
) -> dict[str, Any] | None:
    """The top of a settled period from its snapshot (at most its top N), or None."""
    done = await _lookup(svc, board, view)
    if done is None:
        return None
    key = (done.settlement_id, limit)
    rows = _tops.get(key)
    if rows is None:
        async with archive_read(svc) as db:
            rows = await settlement_history.top(db, done.settlement_id, limit)
        _tops[key] = rows
        while len(_tops) > TOPS_KEPT:
            _tops.popitem(last=False)
    ranks = [s.rank for s in rows]
    if competition:  # a snapshot's top starts at rank 1: its runs of equal points are all in it
        ranks = merge.competition([s.points for s in rows], 1, 1)
    return {
        "board": board.config.id,
        "period": view.api,
        "entries": [_entry(s, rank) for s, rank in zip(rows, ranks, strict=True)],
        "as_of": times.format_ms(times.now_ms()),
        "settled": True,
        "settlement_id": done.settlement_id,
    }


async def settled_player(
    svc: Service, board: Board, view: ResolvedView, player_id: str, rank_mode: str = "unique"
) -> dict[str, Any] | None:
    """A player's final rank and percentile in a settled period from its snapshot, or None (not
    settled, the player is not in the snapshot, or a competition read whose run of equal points
    the snapshot does not hold whole: the frozen board answers while it is kept)."""
    done = await _lookup(svc, board, view)
    if done is None:
        return None
    async with archive_read(svc) as db:
        found = await settlement_history.player(db, done.settlement_id, player_id)
        if found is None:
            return None
        players = done.players
        rank, ahead = found.rank, found.rank  # ``ahead``: the players with at least its points
        if rank_mode == "competition":
            # The percentile counts the whole run of equal points (docs/design-notes.md,
            # "Percentile"); the snapshot tells a run's start when it kept that rank, and its end
            # when it kept the rank after it: otherwise the frozen board answers.
            last = await settlement_history.run_end(db, done.settlement_id, found, players)
            first = await settlement_history.run_start(db, done.settlement_id, found)
            if last is None or first is None:
                return None
            rank, ahead = first, last
    return {
        **_entry(found, rank),
        "players": players,
        "percentile": 100.0 * (players - ahead) / players if players else 0.0,
        "settled": True,
        "settlement_id": done.settlement_id,
    }
