"""Endpoints of settlement and history (issue 12, items 2-4; the mechanism: shardlb/settlement.py).

Settling and archiving (admin) run on connections of their own to the cluster and PostgreSQL, as a
rebuild does; every other handler opens one connection to PostgreSQL (router/history.py), under a
permit of the worker's: ``archive_read`` for public reads, ``archive_call`` for a write key's. A
settlement with a webhook gets its deliveries sent by a task of this worker after the answer, for
as long as its retries last (about 12 hours); any left when the worker stops, and any that failed
for good, are sent when the same settlement is requested again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Coroutine
from typing import Any

import psycopg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from router import params, routes
from router.auth import Scope
from router.boards import through_reshard
from router.errors import ApiError
from router.history import archive_call, archive_read, archive_reader, archive_url
from router.media import read_object, render
from router.service import Service
from shardlb import periods, settlement, settlement_delivery, settlement_history, times
from shardlb.board import Board
from shardlb.config import check_id
from shardlb.errors import unknown_field

log = logging.getLogger("shardlb.router")
MAX_HISTORY = settlement_history.MAX_HISTORY
MAX_PAGE = 1000  # awards per page


def _request(svc: Service, body: dict[str, object]) -> settlement.Request:
    request = settlement.Request.of(params.integral(body))
    default = svc.settings.settlement_webhook_url or None
    secret = svc.settings.webhook_secret
    if (request.webhook_url or default) and not secret:
        raise ApiError(
            409, "webhook_not_configured", "a webhook needs SHARDLB_WEBHOOK_SECRET set on this router"
        )
    # A webhook stored by an earlier run is refused without the secret too (shardlb/settlement.py).
    return dataclasses.replace(request, webhook_default=default, can_sign=bool(secret))


def _deliver_later(svc: Service, result: dict[str, Any]) -> None:
    """Send the settlement's webhook deliveries after the answer, those that failed for good
    included (shardlb/settlement_delivery.py). One task per settlement in this worker
    (``Service.deliveries``): a request for one already delivering here replaces its task (the new
    one starts once the old has given back its claims), and stopping the worker cancels them and
    waits for them all, replaced ones included (``Service.delivering``), to give back theirs; what
    a stopped worker leaves is sent by an archiver's sweep (``settlement_delivery.sweep_forever``)
    or on the next request for the same settlement."""
    if not result.get("webhook_url"):
        return
    # A result with a webhook_url comes only with the secret (shardlb/settlement.py, ``_compare``).
    settlement_id = str(result["settlement_id"])
    deliveries = svc.deliveries
    running = deliveries.pop(settlement_id, None)
    if running is not None:
        running.cancel()  # it gives back the rows it holds as it ends (settlement_delivery.deliver)

    async def deliver() -> None:
        if running is not None:  # before that, this one's first round would find them leased
            try:
                await asyncio.wait([running])
            except asyncio.CancelledError:
                # Replaced in its turn (or stopped) before it began: the task replacing it waits
                # for it alone, so it ends once the one it replaced has given its claims back.
                # Until 2026-12-05 it ended at once, and a third request's task found the first's
                # rows leased and slept out the 5-minute lease. The stop's cut-off still ends it.
                await asyncio.wait([running])
                raise
        try:
            counts = await settlement_delivery.deliver_all(
                svc.settings.postgres_url, svc.settings.webhook_secret, settlement_id
            )
            log.info("webhook deliveries", extra={"fields": {"settlement": settlement_id, **counts}})
        except Exception as e:  # the task's own end: nobody else would see it
            log.warning(
                "webhook deliveries stopped",
                exc_info=not isinstance(e, psycopg.Error | OSError),
                extra={"fields": {"settlement": settlement_id, "error": repr(e)}},
            )

    if svc.draining:  # the answer is out; a task made now would outlive Service.stop
        return
    task = asyncio.create_task(deliver())
    deliveries[settlement_id] = task
    svc.delivering.add(task)
    task.add_done_callback(svc.delivering.discard)

    def forget(done: asyncio.Task[None]) -> None:
        if deliveries.get(settlement_id) is done:
            del deliveries[settlement_id]

    task.add_done_callback(forget)


async def _run(svc: Service, work: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    try:
        result = await work
    except psycopg.Error as e:
        raise ApiError(
            503, "archive_unavailable", f"PostgreSQL failed: {type(e).__name__}", retry_after=5
        ) from e
    _deliver_later(svc, result)
    return result


async def settle(request: Request) -> Response:
    """Freeze, order from PostgreSQL, check against Redis and store the awards of a closed period."""
    svc = routes._allow(request, Scope.ADMIN)
    routes._query(request)
    body = await read_object(request, svc.settings.max_body_bytes)
    wanted = _request(svc, body)
    board = await routes._board(svc, request)
    period = request.path_params["period"]
    board.resolve(period)  # a bad period: 422 before anything else
    url = archive_url(svc)
    result = await _run(svc, settlement.run(svc.settings.redis_url, url, board.config.id, period, wanted))
    return render(request, result)


async def archive(request: Request) -> Response:
    """Season end: settle the board's total, then delete the board; its history stays."""
    svc = routes._allow(request, Scope.ADMIN)
    routes._query(request)
    body = await read_object(request, svc.settings.max_body_bytes)
    wanted = _request(svc, body)
    board_id = check_id(request.path_params["board"], "board")
    url = archive_url(svc)
    work = settlement.archive_season(svc.settings.redis_url, url, board_id, wanted, delete=svc.boards.delete)
    result = await _run(svc, work)
    return render(request, result)


async def get_settlement(request: Request) -> Response:
    svc = routes._allow(request, Scope.WRITE)
    routes._query(request)
    settlement_id = check_id(request.path_params["settlement"], "settlement")
    async with archive_call(svc) as db:
        found = await settlement_delivery.get(db, settlement_id)
    return render(request, found)


async def list_awards(request: Request) -> Response:
    """A page of the awards not yet acknowledged, by rank; ``next`` is the cursor of the next page."""
    svc = routes._allow(request, Scope.WRITE)
    query = routes._query(request, "after", "limit")
    settlement_id = check_id(request.path_params["settlement"], "settlement")
    limit = params.integer(query, "limit", 100, 1, MAX_PAGE)
    async with archive_call(svc) as db:
        page = await settlement_delivery.awards(db, settlement_id, query.get("after"), limit)
    return render(request, page)


async def ack_awards(request: Request) -> Response:
    """Acknowledge paid awards: never offered again. A write key does it, as it pages them: the
    game server that pays (shardlb/settlement_delivery.py)."""
    svc = routes._allow(request, Scope.WRITE)
    routes._query(request)
    settlement_id = check_id(request.path_params["settlement"], "settlement")
    body = await read_object(request, svc.settings.max_body_bytes)
    for name in body:
        if name != "award_ids":
            raise unknown_field(name, ("award_ids",))
    async with archive_call(svc) as db:
        done = await settlement_delivery.ack(db, settlement_id, body.get("award_ids"))
    return render(request, done)


async def list_periods(request: Request) -> Response:
    """The dated periods a board keeps in Redis and those settled, newest first."""
    svc = routes._allow_read(request)
    routes._query(request)
    now = times.now_ms()

    async def read() -> tuple[Board, set[str]]:
        # Each try looks the board up anew: a layout replaced since it was kept is read again
        # (through_reshard), as every other read is.
        board = await routes._board(svc, request)
        async with svc.reads:  # public: a call per home shard, in the reads' bound like every other read
            return board, await settlement_history.kept(board, now)

    settled: dict[str, dict[str, object]] = {}
    if not svc.settings.postgres_url:
        board, kept = await through_reshard(read)
    else:
        # The client's place among its archive reads first: past its bound, the 429 comes before
        # the home shards are read (until 2026-12-06 after: a refused listing cost the cluster as
        # much as an answered one).
        with archive_reader(svc):
            board, kept = await through_reshard(read)
            async with archive_read(svc, placed=True) as db:
                every = await settlement_history.settled_periods(db, board.config.id)
        settled = {p: s for p, s in every.items() if s["incarnation"] == board.incarnation and p != "total"}
    week_start = board.config.week_start
    out = []
    for name in sorted(
        kept | set(settled), key=lambda n: periods.end_ms(n, board.tz, week_start), reverse=True
    ):
        found = settled.get(name)
        out.append(
            {
                "period": periods.api_name(name),
                "ends_at": times.format_ms(periods.end_ms(name, board.tz, week_start)),
                "closed": now >= settlement.closes_at(board, name),
                "kept": name in kept,
                "settled": found is not None and found["state"] == "settled",
                "settlement_id": None if found is None else found["settlement_id"],
            }
        )
    return render(request, {"board": board.config.id, "periods": out})


async def player_history(request: Request) -> Response:
    """A player's results on a board from PostgreSQL, latest first, with final ranks where settled."""
    svc = routes._allow_read(request)
    query = routes._query(request, "limit")
    board = await routes._board(svc, request)
    player_id = check_id(request.path_params["player"], "player")
    limit = params.integer(query, "limit", 100, 1, MAX_HISTORY)
    async with archive_read(svc) as db:
        found = await settlement_history.player_history(db, board, player_id, limit)
    return render(
        request,
        {
            "board": board.config.id,
            "player_id": player_id,
            "results": [
                {
                    "match_id": r["match_id"],
                    "points": r["points"],
                    "achieved_at": times.format_ms(r["achieved_ms"]),
                    "periods": r["periods"],
                    "final": r["final"],
                }
                for r in found
            ],
        },
    )


ROUTES = [
    # As `:rebuild` (router/routes.py): only a POST is the action; other methods reach the board
    # whose id is "x:archive".
    Route("/v1/boards/{board}:archive", archive, methods=["POST"]),
    Route("/v1/boards/{board}/periods", list_periods, methods=["GET"]),
    Route("/v1/boards/{board}/periods/{period}:settle", settle, methods=["POST"]),
    Route("/v1/boards/{board}/players/{player}/history", player_history, methods=["GET"]),
    Route("/v1/settlements/{settlement}", get_settlement, methods=["GET"]),
    Route("/v1/settlements/{settlement}/awards", list_awards, methods=["GET"]),
    Route("/v1/settlements/{settlement}/awards:ack", ack_awards, methods=["POST"]),
]
