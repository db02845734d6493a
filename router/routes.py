"""The /v1 endpoints of api.md: boards (admin), scores (write) and reads (public unless configured).

Each handler checks the caller's key first, then reads and validates the whole request before it
touches the cluster, so a request that fails validation writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import psycopg
from redis.exceptions import RedisClusterException, RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router import history, hot, metrics, moderation, params, scores
from router.auth import Scope
from router.boards import RESHARD_RETRY_S, RESHARD_WAIT_S, through_reshard
from router.errors import ApiError
from router.histogram import Estimate
from router.media import (
    RawHeaders,
    decode_object,
    entry_body,
    header,
    read_body,
    read_object,
    render,
    render_held,
    rendered,
)
from router.scores import MAX_ITEMS, ScoresEndpoint
from router.service import Service
from shardlb import archive, merge, rebuild, times
from shardlb.board import Board, Entry
from shardlb.config import AUTO_SHARDS, ID_PATTERN, MAX_SHARDS, BoardConfig, check_id
from shardlb.errors import (
    BoardConflict,
    BoardNotFound,
    InvalidInput,
    PlayerNotFound,
    Resharding,
    unknown_field,
)
from shardlb.merge import Row
from shardlb.reads import ResolvedView

log = logging.getLogger("shardlb.router")

MAX_OFFSET = 10**12
# Cached tops, rendered: (view, limit, competition ranks, MessagePack) -> (as_of of the cached top,
# headers, body, ETag). A hit sends bytes rendered once per refresh of the top cache.
_TOPS: hot.Renderings[tuple[ResolvedView, int, bool, bool], tuple[int, RawHeaders, bytes, bytes]] = (
    hot.Renderings()
)
MAX_RADIUS = 100
# "my rank" with max_age_ms: how old the other bands' sizes of a band board may be (the design we
# started from allows 5 s for a player's own rank).
MAX_AGE_MS = 10_000
QUERY_FIELDS = ("player_ids", "period", "region")
QUERY_IDS_PER_TOKEN = 100  # a players:query takes a read token more per this many ids
# ... or per this many bytes of its body, whichever is more: 100 ids of 64 characters take 6.7 KB.
QUERY_BYTES_PER_TOKEN = 8 * 1024


def service(request: Request) -> Service:
    return cast(Service, request.app.state.service)


def _peer(request: Request) -> str:
    client = request.scope.get("client")  # (``request.client`` makes a namedtuple of it)
    return client[0] if client else "unknown"


def _allow(request: Request, need: Scope) -> Service:
    svc = service(request)
    svc.keys.require(header(request, b"authorization"), _peer(request), need)
    return svc


def _allow_read(request: Request) -> Service:
    svc = service(request)
    admit_read(svc, header(request, b"authorization"), _peer(request))
    return svc


def admit_read(svc: Service, authorization: str | None, peer: str, extra: float = 0.0) -> None:
    """Key check for reads, then a token of the caller's bucket, or with ``extra`` that many more
    for a read let in already (429 with Retry-After when it holds fewer)."""
    caller = svc.keys.require(authorization, peer, Scope.READ)
    history.READER.set(caller.client)  # an archive read counts for its client (router/history.py)
    wait = svc.limiter.take_more(caller.client, extra) if extra else svc.limiter.take(caller.client)
    if wait > 0:
        metrics.RATE_LIMITED.inc()
        raise ApiError(429, "rate_limited", "too many reads from this client; slow down", retry_after=wait)


def _through_reshard(
    read: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """A GET read made again while a reshard's cut-over refuses it: ``through_reshard``'s loop
    (router/boards.py), written out here for the hot reads. Through it, a lambda and a coroutine
    more stood between the request and the read, and the coroutine is passed again each time the
    read resumes (twice a "my rank" at least)."""

    @functools.wraps(read)
    async def again(request: Request) -> Response:
        deadline = time.monotonic() + RESHARD_WAIT_S
        while True:
            try:
                return await read(request)
            except Resharding:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(RESHARD_RETRY_S)

    return again


async def _board(svc: Service, request: Request) -> Board:
    return await svc.boards.lookup(request.path_params["board"])


def _view(board: Board, period: object, region: object) -> ResolvedView:
    """The view a read covers (``Board.resolve``), once the period and region are strings."""
    if not isinstance(period, str):
        raise InvalidInput(
            "period must be a string such as 'total' or 'daily:2026-11-30'",
            "period",
            "invalid_period",
        )
    if region is not None and (not isinstance(region, str) or ID_PATTERN.fullmatch(region) is None):
        # Refused on every board: a region that could not name one is a mistake wherever it is sent.
        raise InvalidInput(
            "region must be an id: 1-64 characters of A-Z a-z 0-9 _ - . :", "region", "invalid_region"
        )
    return board.resolve(period, region)


def _query_view(board: Board, query: dict[str, str]) -> ResolvedView:
    return _view(board, query.get("period", "total"), query.get("region"))


# The time the other bands were counted at is the same for every max_age_ms read of a second.
_counts_as_of = functools.lru_cache(maxsize=64)(times.format_ms)


def _query(request: Request, *allowed: str) -> dict[str, str]:
    """The request's query parameters, when they are all among ``allowed`` (400 otherwise)."""
    raw = request.scope["query_string"]
    return params.query(raw, frozenset(allowed)) if raw else {}  # most hot reads have none


def _one_of(body: dict[str, object], query: dict[str, str], name: str) -> object:
    """A value the body or the query string may give (null in the body is not given); both may, if
    they agree."""
    given = body.get(name)
    if given is not None and name in query and given != query[name]:
        raise InvalidInput(
            f"{name} is given in the body and in the query string with different values",
            name,
            "conflicting_parameter",
        )
    return query.get(name) if given is None else given


async def _estimate_competition(
    svc: Service, board: Board, view: ResolvedView, row: Row
) -> tuple[Estimate, float]:
    """``estimate=true`` in competition mode, from the same histogram as a unique estimate: the rank
    is 1 + the estimated rows at or above the first score with better points (no row sorts below
    the id ""), with that estimate's guaranteed bound; the percentile is the estimated share of rows
    below the player's points (rows at or above the points' lowest score, likewise)."""
    span = board.codec.scores_of(board.codec.decode_units(row[0])[0])
    guess = await svc.histograms.estimate(board, view, (span.stop, ""))
    level = await svc.histograms.estimate(board, view, (span.start, ""))
    below = max(guess.players - (level.rank - 1), 0)
    return guess, 100.0 * below / guess.players if guess.players else 0.0


# ---- boards (admin) --------------------------------------------------------------------------


async def put_board(request: Request) -> Response:
    svc = _allow(request, Scope.ADMIN)
    _query(request)
    board_id = request.path_params["board"]
    body = params.integral(await read_object(request, svc.settings.max_body_bytes, empty={}))
    if body.get("board", board_id) != board_id:
        raise InvalidInput("the body names another board than the path", "board", "board_mismatch")
    # Hash and band settings without a shard count get one shard per master (BoardStore.create).
    config = BoardConfig.from_dict(board_id, body, default_shards=AUTO_SHARDS)
    try:
        config.to_dict()
    except (ValueError, OverflowError) as e:
        # e.g. an epoch whose UTC instant falls before year 1: accepted by the parser, not writable back.
        raise InvalidInput(f"these settings cannot be stored: {e}", "epoch", "invalid_time") from e
    # A retention of a period the board does not keep was dropped, and the board made without it,
    # until 2026-12-06: a board made so still answers 200 to those settings (a game server's PUT at
    # each start), and they make no board now.
    stray = _retention_not_kept(body, config)
    try:
        board, created = await svc.boards.create(config, confirm_only=stray is not None)
    except (BoardNotFound, BoardConflict) as e:
        if stray is None:
            raise
        kept = ", ".join(config.periods)
        raise InvalidInput(
            f"retention_days names {stray!r}, a period this board does not keep ({kept}): add it to "
            "periods or leave its retention out",
            f"retention_days.{stray}",
        ) from e
    return render(request, board.config.to_dict(), 201 if created else 200)


def _retention_not_kept(body: dict[str, object], config: BoardConfig) -> str | None:
    """The first period kind ``retention_days`` names that the board does not keep, if any (the
    body is checked already: an object of dated kinds, ``BoardConfig.from_dict``)."""
    given = body.get("retention_days")
    if not isinstance(given, dict):
        return None
    return next((kind for kind in given if kind not in config.periods), None)


async def list_boards(request: Request) -> Response:
    svc = _allow_read(request)
    _query(request)
    return render_held(request, await svc.boards.list())


@_through_reshard
async def get_board(request: Request) -> Response:
    svc = _allow_read(request)
    _query(request)
    board = await _board(svc, request)
    kinds = board.config.periods
    async with svc.reads, metrics.redis_call("size"):
        sizes = [await board.size(board.resolve(kind)) for kind in kinds]  # one after another: a read's share
        closed = await board.closed()
    # Addition (period lifecycle): when each kept dated period's current period ends.
    resets = {kind: board.resets_at(board.resolve(kind).period) for kind in kinds if kind != "total"}
    # Addition (season end): whether an archive closed the board (router/README.md).
    body = {
        **board.config.to_dict(),
        "players": dict(zip(kinds, sizes, strict=True)),
        "resets_at": resets,
        "closed": closed,
    }
    return render(request, body)


async def delete_board(request: Request) -> Response:
    """DELETE /v1/boards/{board}. A journaled board, on a router with PostgreSQL, is recorded in
    two marks (docs/design-notes.md, "A total loss of Redis"): its DELETE begun before anything
    changes in Redis (``archive.mark_deleting``), then its deletion once Redis has deleted it
    (``archive.mark_deleted``), before the 204. `rebuild --all` restores a board with the first
    alone, so a DELETE that fails in Redis (503, the board live) loses nothing to a loss of Redis,
    and one answered 204 is never undone by it. PostgreSQL failing is 503 ``archive_unavailable``:
    at the first mark nothing is deleted; at the second the board is gone from Redis, and the
    DELETE sent again finds it gone and records the deletion before its 404 (``_mark_gone``), or,
    the id created again meanwhile, deletes that board and records both before its 204. Redis
    failing that look at the deletions owed, once this one's is recorded, is a 204 when PostgreSQL
    holds none pending (``_none_pending``). One PostgreSQL connection at most serves the whole
    DELETE (``_Marks``)."""
    svc = _allow(request, Scope.ADMIN)
    _query(request)
    board_id = request.path_params["board"]
    marks = _Marks(svc.settings.postgres_url)
    try:
        try:
            board = await _mark_deleting(svc, marks, board_id)
            incarnation = await svc.boards.delete(board_id, None if board is None else board.incarnation)
        except BoardNotFound:
            await _mark_gone(svc, marks, board_id)
            raise
        if board is not None and board.config.durability == "journal":
            async with marks.archive("the board is deleted, its deletion not recorded") as db:
                await archive.mark_deleted(db, board_id, incarnation)
            await _paid(svc, board_id, [incarnation])
        # An earlier incarnation whose DELETE deleted it and failed on its last mark (503), the id
        # created again before that DELETE was sent again: the retry deletes this one and is
        # answered 204 for the id, so the earlier one is recorded deleted now too, not only by the
        # archiver's next refresh (a loss of Redis before it had `rebuild --all` restore it under
        # the 204). Only a deletion Redis notes owed costs PostgreSQL anything, whatever the new
        # board's durability.
        try:
            await _mark_gone(svc, marks, board_id)
        except (RedisError, RedisClusterException, OSError) as e:
            if not await _none_pending(svc, marks, board_id):
                raise
            fields = {"board": board_id, "error": type(e).__name__}
            log.warning("a board's deletion is done; the deletions owed not read", extra={"fields": fields})
        await moderation.forget_bans(svc, board_id, incarnation, marks.connection)  # none holds now
    finally:
        await marks.close()
    return Response(status_code=204)


async def _mark_deleting(svc: Service, marks: _Marks, board_id: str) -> Board | None:
    """Before DELETE /v1/boards/{board} changes anything in Redis: the board it deletes (the
    registry's incarnation, one whose deletion stopped half way too), its DELETE recorded begun in
    PostgreSQL when it is journaled, and noted in Redis as owing PostgreSQL its deletion
    (``archive.owe_deletion``). None without PostgreSQL (the incarnation the registry holds then is
    deleted); a board without a journal has nothing there to mark."""
    if not svc.settings.postgres_url:
        return None
    board = await svc.boards.store.get(board_id, deleting=True)
    if board.config.durability == "journal":
        async with marks.archive("the board is not deleted") as db:
            await archive.mark_deleting(db, board)
        await archive.owe_deletion(svc.boards.store.scripts, board_id, board.incarnation)
    return board


async def _mark_gone(svc: Service, marks: _Marks, board_id: str) -> None:
    """Before a DELETE's 404: record in PostgreSQL the deletions of the board that Redis notes it
    is owed (``archive.owe_deletion``: a DELETE that failed on its last mark), and only those. A
    board with none (made up, deleted and answered 204, never journaled) costs PostgreSQL nothing:
    until 2026-12-06 every 404 connected to it to look, so any admin client made connections by
    deleting made-up names, and PostgreSQL down made their 404 a 503."""
    if not svc.settings.postgres_url:
        return
    owed = await archive.owed_deletions(svc.client, board_id)
    if not owed:
        return
    async with marks.archive("the board's deletion is not recorded") as db:
        marked = await archive.mark_gone(db, svc.client, board_id, owed)
    await _paid(svc, board_id, marked)


async def _none_pending(svc: Service, marks: _Marks, board_id: str) -> bool:
    """Whether PostgreSQL holds no incarnation of ``board_id`` whose DELETE began and whose deletion
    is not recorded: asked, on the DELETE's connection, when Redis failed the look at the deletions
    it notes owed after the deletion was done and recorded (``_mark_gone``). None such: no note can
    name one that `rebuild --all` would restore after a total loss (a note is written only after
    the pending mark, ``_mark_deleting``), so the DELETE answers 204 and a note left (its own, were
    ``_paid`` to fail too) is paid by the next DELETE of the id or runs out. One such (an earlier
    DELETE that failed on its last mark): only Redis's mark of its deletion may record it
    (``archive.mark_gone``), so the DELETE answers 503, as until 2026-12-06 it did whatever
    PostgreSQL held, and its retry records it. PostgreSQL failing too: False, the same 503."""
    try:
        db = await marks.connection()
        cur = await db.execute(
            "SELECT 1 FROM boards WHERE board = %s AND deleted_at IS NULL AND delete_begun_at IS NOT NULL "
            "LIMIT 1",
            (board_id,),
        )
        return await cur.fetchone() is None
    except psycopg.Error:
        return False


async def _paid(svc: Service, board_id: str, incarnations: list[str]) -> None:
    """The deletions recorded in PostgreSQL: their notes in Redis go. The DELETE is done and
    answered (204, or 404 by ``_mark_gone``) whatever happens here; a note left (Redis failing, with
    a RedisError or one of the cluster client's own, ``RedisClusterException``: a slot not covered)
    costs a DELETE of the board that finds it gone one look in PostgreSQL, which pays it, until it
    expires. Until 2026-12-06 the second made a DELETE recorded 503, and a RedisError caught here
    was met again by ``_mark_gone``'s own payment, which did not catch it."""
    try:
        await archive.paid_deletions(svc.client, board_id, incarnations)
    except (RedisError, RedisClusterException, OSError) as e:
        log.warning(
            "a deletion recorded in PostgreSQL is still noted owed in Redis",
            extra={"fields": {"board": board_id, "incarnations": incarnations, "error": type(e).__name__}},
        )


class _Marks:
    """The PostgreSQL connection of one DELETE /v1/boards/{board}: opened at its first use (a mark,
    or the forgetting of the board's bans) and kept for the rest of the DELETE, closed when it
    ends. Until 2026-12-06 each mark and the bans' forgetting opened a connection of their own:
    three for a journaled board, each with its schema check (``archive.connect_db``).

    It is held, idle, through the DELETE's Redis part: autocommit, so it holds no transaction, no
    lock and no snapshot there, only a server process. Closing it after the first mark and opening
    another for the second would cost more than it frees: on the suite's cluster and PostgreSQL
    ``connect_db`` took 36 ms (median of 20; 57 at most) where the Redis part of an 8-shard board
    of 1,000 players took 28 ms (43 at most), and a second connection is a second server process
    and schema check for every DELETE, and one more way for PostgreSQL to fail between the marks."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.db: psycopg.AsyncConnection[Any] | None = None

    async def connection(self) -> psycopg.AsyncConnection[Any]:
        """The DELETE's connection, opened now if it is not yet (PostgreSQL's errors raised)."""
        if self.db is None:
            self.db = await archive.connect_db(self.url)
        return self.db

    @contextlib.asynccontextmanager
    async def archive(self, state: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The connection for a mark; PostgreSQL failing (there or in the block) is 503
        ``archive_unavailable`` saying ``state``, to be sent again."""
        try:
            yield await self.connection()
        except psycopg.Error as e:
            raise ApiError(
                503,
                "archive_unavailable",
                f"PostgreSQL failed ({type(e).__name__}): {state}; send the DELETE again",
                retry_after=5,
            ) from e

    async def close(self) -> None:
        if self.db is not None:
            db, self.db = self.db, None
            await db.close()


async def rebuild_board(request: Request) -> Response:
    """Recompute the board from PostgreSQL while writes go on (shardlb/rebuild.py); answers when
    every shard is swapped in, with a line per shard."""
    svc = _allow(request, Scope.ADMIN)
    query = _query(request, "period", "shard")
    # The record as the registry has it now, not the board this router keeps (up to CACHE_SECONDS
    # old): a reshard recorded meanwhile must refuse the rebuild (409), and a kept board knows
    # nothing of it.
    board = await svc.boards.store.get(request.path_params["board"])
    shard = params.integer(query, "shard", -1, 0, MAX_SHARDS - 1)
    url = svc.settings.postgres_url
    if not url:
        # A setting of this router, not a passing state: a retry would not help, so not a 503.
        raise ApiError(409, "archive_not_configured", "this router has no PostgreSQL (SHARDLB_POSTGRES_URL)")
    start = time.perf_counter()
    try:
        async with rebuild.connected(svc.settings.redis_url, url) as (rebuilder, _):
            reports = await rebuilder.rebuild(board, query.get("period"), None if shard < 0 else shard)
    except psycopg.Error as e:
        raise ApiError(
            503, "archive_unavailable", f"PostgreSQL failed: {type(e).__name__}", retry_after=5
        ) from e
    return render(
        request,
        {
            "board": board.config.id,
            "period": query.get("period"),
            "shards": [r.to_dict() for r in reports],
            "seconds": round(time.perf_counter() - start, 3),
        },
    )


async def player_route(request: Request) -> Response:
    """GET reads a player, DELETE removes one (router/moderation.py): one route, one Allow header."""
    return await (moderation.remove_player if request.method == "DELETE" else player)(request)


async def board_route(request: Request) -> Response:
    """One route for the three methods, so a 405 on it lists them all in Allow."""
    handler = {"PUT": put_board, "DELETE": delete_board}.get(request.method, get_board)
    return await handler(request)


# ---- reads -----------------------------------------------------------------------------------


@_through_reshard
async def top(request: Request) -> Response:
    """The top N, from the top cache; the answer is remembered for ``HotTop`` (router/hot.py)."""
    second = hot.now_second()  # before the view is resolved: see router/hot.py
    svc = _allow_read(request)
    query = _query(request, "limit", "period", "region", "rank_mode")
    board = await _board(svc, request)
    limit = params.integer(query, "limit", 100, 1, MAX_ITEMS)
    view = _query_view(board, query)
    competition = board.rank_mode(query.get("rank_mode")) == "competition"
    settled = await history.settled_top(svc, board, view, limit, competition)  # settled: its snapshot
    if settled is not None:
        return render(request, {**settled, "resets_at": board.resets_at(view.period)})
    best, as_of = await svc.tops.top(board, view, limit)
    raw_query, packed = hot.request_key(request)
    key = (view, limit, competition, packed)
    kept = _TOPS.get(key)
    if kept is None or kept[0] != as_of:
        if competition:  # the cache keeps unique ranks; a top starts at rank 1: its runs are all in it
            ranks = merge.competition([e["points"] for e in best], 1, 1)
            best = [{**e, "rank": rank} for e, rank in zip(best, ranks, strict=True)]
        body = {
            "board": board.config.id,
            "period": view.api,
            "entries": best,
            "as_of": times.format_ms(as_of),
            "resets_at": board.resets_at(view.period),
        }
        _, headers, raw = rendered(body, packed)
        tag = hot.etag(raw)
        headers += [(b"etag", tag), *hot.CACHE_HEADERS]
        kept = (as_of, headers, raw, tag)
        _TOPS.put(key, kept, len(raw))  # the oldest rendering goes first past the bounds
    _, headers, raw, tag = kept
    answer = hot.Rendered(second, weakref.ref(board), view, as_of, headers, raw, tag)
    hot.remember(board.config.id, raw_query, packed, answer)
    status = 200
    if hot.matches(request.headers.get("if-none-match"), tag.decode()):
        status, headers, raw = hot.not_modified(tag)
    response = Response(raw, status)
    response.raw_headers = headers
    return response


@_through_reshard
async def entries(request: Request) -> Response:
    svc = _allow_read(request)
    query = _query(request, "offset", "limit", "period", "region", "rank_mode")
    board = await _board(svc, request)
    offset = params.integer(query, "offset", 0, 0, MAX_OFFSET)
    limit = params.integer(query, "limit", 100, 1, MAX_ITEMS)
    view = _query_view(board, query)
    rank_mode = board.rank_mode(query.get("rank_mode"))
    as_of = times.now_ms()
    async with svc.reads, metrics.redis_call("entries"):
        found = await board.entries(offset, limit, view, rank_mode)
    return render(
        request,
        {
            "board": board.config.id,
            "period": view.api,
            "entries": [entry_body(e) for e in found],
            "as_of": times.format_ms(as_of),
            "resets_at": board.resets_at(view.period),
        },
    )


@_through_reshard
async def player(request: Request) -> Response:
    svc = _allow_read(request)
    query = _query(request, "period", "region", "estimate", "rank_mode", "max_age_ms")
    board = await _board(svc, request)
    player_id = check_id(request.path_params["player"], "player")
    view = _query_view(board, query)
    rank_mode = board.rank_mode(query.get("rank_mode"))
    max_age_ms = params.integer(query, "max_age_ms", 0, 0, MAX_AGE_MS)
    estimate = params.flag(query, "estimate")
    # settled: its snapshot
    settled = (
        await history.settled_player(svc, board, view, player_id, rank_mode)
        if history.may_be_settled(svc, view)
        else None
    )
    if settled is not None:
        # A snapshot's rank is final and exact: an estimate of it allows no error.
        extra = {"rank_error": 0} if estimate else {}
        return render(request, {**settled, "resets_at": board.resets_at(view.period), **extra})
    if not estimate:
        async with svc.reads:
            with metrics.redis_call("player"):
                found = await board.player(player_id, view, rank_mode, max_age_ms)
        body = {**entry_body(found.entry), "players": found.players, "percentile": found.percentile}
        if found.counts_ms is not None:
            body["counts_as_of"] = _counts_as_of(found.counts_ms)
        return render(request, {**body, "resets_at": board.resets_at(view.period)})
    # One ZMSCORE on the player's home shard; the rank then comes from RAM, not from every shard.
    async with svc.reads, metrics.redis_call("player_score"):
        scores = await board.scores([player_id], view)
    if player_id not in scores:
        raise PlayerNotFound(f"player {player_id!r} has no score in this period", "player")
    row = (scores[player_id], player_id)
    if rank_mode == "unique":
        guess = await svc.histograms.estimate(board, view, row)
        percentile = guess.percentile
    else:
        guess, percentile = await _estimate_competition(svc, board, view, row)
    return render(
        request,
        {
            **entry_body(board.entry(guess.rank, row)),
            "players": guess.players,
            "percentile": percentile,
            "rank_error": guess.error,
            "as_of": times.format_ms(guess.as_of_ms),
            "resets_at": board.resets_at(view.period),
        },
    )


@_through_reshard
async def around(request: Request) -> Response:
    svc = _allow_read(request)
    query = _query(request, "radius", "period", "region", "rank_mode")
    board = await _board(svc, request)
    player_id = check_id(request.path_params["player"], "player")
    radius = params.integer(query, "radius", 5, 0, MAX_RADIUS)
    view = _query_view(board, query)
    rank_mode = board.rank_mode(query.get("rank_mode"))
    async with svc.reads, metrics.redis_call("around"):
        found = await board.around(player_id, radius, view, rank_mode)
    return _listing(request, board, view, found)


def _listing(request: Request, board: Board, view: ResolvedView, found: list[Entry]) -> Response:
    """The body of around and players:query: the board, the period and the entries."""
    body = {"board": board.config.id, "period": view.api, "entries": [entry_body(e) for e in found]}
    return render(request, {**body, "resets_at": board.resets_at(view.period)})


async def query(request: Request) -> Response:
    svc = _allow_read(request)
    query = _query(request, "period", "region", "rank_mode")
    authorization = request.headers.get("authorization")
    raw = await read_body(request, svc.settings.max_read_body_bytes)
    # Decoding costs what the bytes hold, whatever they decode to: a token per QUERY_BYTES_PER_TOKEN
    # more, before the decoding. 90 KB of 90,000 empty maps cost 19 ms of a worker's CPU and one
    # token until 2026-12-06; a valid body pays no more than its ids do (below).
    paid = len(raw) // QUERY_BYTES_PER_TOKEN
    if paid:
        admit_read(svc, authorization, _peer(request), paid)
    body = decode_object(raw, request.headers.get("content-type"))
    for name in body:
        if name not in QUERY_FIELDS:
            raise unknown_field(name, QUERY_FIELDS)
    ids = body.get("player_ids")
    if not isinstance(ids, list):
        raise InvalidInput("player_ids must be a list of player ids", "player_ids", "invalid_input")
    if len(ids) > MAX_ITEMS:
        raise InvalidInput(
            f"at most {MAX_ITEMS} player ids per request, got {len(ids)}", "player_ids", "too_many"
        )
    for i, value in enumerate(ids):
        check_id(value, f"player_ids[{i}]")
    # The cluster's work grows with the ids (a rank each): a token per QUERY_IDS_PER_TOKEN more,
    # beside the one the read took to be let in, so a query of 1000 costs the caller 11 reads
    # (those its bytes paid for counted).
    more = len(ids) // QUERY_IDS_PER_TOKEN - paid
    if more > 0:
        admit_read(svc, authorization, _peer(request), more)
    # Only checked or small values may wait for the board below (a public body can decode to MiBs of
    # objects): a period or region that is not a string is kept as 0, which _view refuses alike.
    period, region = (
        v if v is None or isinstance(v, str) else 0
        for v in (_one_of(body, query, "period"), _one_of(body, query, "region"))
    )
    del body

    async def answer() -> Response:
        board = await _board(svc, request)
        view = _view(board, "total" if period is None else period, region)
        rank_mode = board.rank_mode(query.get("rank_mode"))
        async with svc.reads, metrics.redis_call("query"):
            found = await board.query(ids, view, rank_mode)
        return _listing(request, board, view, found)

    return await through_reshard(answer)


# GET routes the app sends straight to their handler (router/app.py, ``Direct``): the top and "my
# rank", most of a leaderboard's reads. Each: the path's pattern, its parameters, the route's path.
HOT_GETS = [
    (re.compile(r"/v1/boards/([^/]+)/top"), ("board",), "/v1/boards/{board}/top", top),
    (
        re.compile(r"/v1/boards/([^/]+)/players/([^/]+)"),
        ("board", "player"),
        "/v1/boards/{board}/players/{player}",
        player,
    ),
]

ROUTES = [
    Route("/v1/boards", list_boards, methods=["GET"]),
    # Ids may hold ':' (api.md), so "/v1/boards/x:rebuild" is also the board "x:rebuild": a POST
    # there is the action on "x" (boards take no POST), and GET, PUT and DELETE find no method
    # here and go on to the board's own route below (Starlette takes the first route that matches
    # both path and method).
    Route("/v1/boards/{board}:rebuild", rebuild_board, methods=["POST"]),
    Route("/v1/boards/{board}", board_route, methods=["GET", "PUT", "DELETE"]),
    Route(scores.PATH, ScoresEndpoint(), methods=["POST"]),
    Route("/v1/boards/{board}/top", top, methods=["GET"]),
    Route("/v1/boards/{board}/entries", entries, methods=["GET"]),
    Route("/v1/boards/{board}/players:query", query, methods=["POST"]),
    Route("/v1/boards/{board}/players/{player}", player_route, methods=["GET", "DELETE"]),
    Route("/v1/players/{player}:ban", moderation.ban, methods=["POST"]),
    Route("/v1/players/{player}:unban", moderation.unban, methods=["POST"]),
    Route("/v1/bans", moderation.list_bans, methods=["GET"]),
    Route("/v1/boards/{board}/players/{player}/around", around, methods=["GET"]),
]
