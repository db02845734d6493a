"""POST /v1/boards/{board}/scores: the write endpoint, as a plain ASGI app.

Writes are most of a router's traffic, so this one endpoint skips Starlette's request machinery: the
app (router/app.py) hands a POST to this path straight to ``ScoresEndpoint`` wrapped in the access
middleware, and Starlette's router holds the same object for every other method (its 405 lists
POST). The rules are those of every other route: the key is checked first, then what the head says
of the body (``media.check_body_head``), then the whole body is read (capped), decoded and
validated before anything reaches the cluster, so a request that fails validation writes nothing;
every error leaves as api.md's error body with its 4xx or 503.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from router import params
from router.auth import Scope as KeyScope
from router.boards import through_reshard
from router.errors import shutting_down, to_api_error
from router.media import (
    check_body_head,
    decode_object,
    read_limited,
    rendered,
    rendered_error,
    send_rendered,
    wants_msgpack,
    whole_body,
)
from router.service import Service
from shardlb import times
from shardlb.board import Result, Score
from shardlb.errors import InvalidInput, unknown_field

PATH = "/v1/boards/{board}/scores"
PATH_PATTERN = re.compile(r"/v1/boards/([^/]+)/scores")
MAX_ITEMS = 1000
SCORE_FIELDS = frozenset({"player_id", "points", "match_id", "achieved_at", "region"})
SCORE_REQUIRED = ("player_id", "points", "match_id")
NO_PARAMETERS: frozenset[str] = frozenset()
_WANTED = frozenset(
    {
        b"authorization",
        b"content-type",
        b"content-length",
        b"accept",
        b"content-encoding",
        b"transfer-encoding",
    }
)
_new = tuple.__new__


def parse_scores(body: dict[str, Any]) -> list[Score]:
    """The ``scores`` of a POST body as Score values; shape errors name their field (422)."""
    for name in body:
        if name != "scores":
            raise unknown_field(name, ("scores",))
    items = body.get("scores")
    if not isinstance(items, list):
        raise InvalidInput("scores must be a list of score objects", "scores", "invalid_input")
    if len(items) > MAX_ITEMS:
        raise InvalidInput(f"at most {MAX_ITEMS} scores per request, got {len(items)}", "scores", "too_many")
    scores = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidInput("each score must be an object", f"scores[{i}]", "invalid_input")
        player_id, points, match_id = item.get("player_id"), item.get("points"), item.get("match_id")
        # Three keys, the three required ones: none unknown, nothing more to look at.
        usual = len(item) == 3 and player_id is not None and points is not None and match_id is not None
        if not usual and not item.keys() <= SCORE_FIELDS:
            name = next(name for name in item if name not in SCORE_FIELDS)
            raise unknown_field(name, SCORE_FIELDS, f"scores[{i}].")
        if type(points) is not int:
            points = params.integral(points)
        if player_id is None or points is None or match_id is None:
            name = next(name for name in SCORE_REQUIRED if item.get(name) is None)
            raise InvalidInput(f"{name} is required", f"scores[{i}].{name}", "missing_field")
        achieved = region = None
        if len(item) > 3:  # beyond the three required fields: an achieved time, a region, or both
            achieved = params.integral(item.get("achieved_at"))
            # Kept as sent: a region board refuses any that is not one of its regions (Board.prepare),
            # every other board ignores it (api.md), whatever it holds.
            region = item.get("region")
            if achieved is not None:
                achieved = times.parse(achieved, f"scores[{i}].achieved_at")
        scores.append(_new(Score, (player_id, points, match_id, achieved, region)))  # Score(...), a call less
    return scores


class ScoresEndpoint:
    """The write endpoint. ``scope["path_params"]["board"]`` names the board; the Service comes from
    ``scope["app"].state.service``. It answers every request itself, errors included (remembered
    in the request state for the access middleware, as Starlette's error handlers do)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:
            if name in _WANTED and name not in headers:
                headers[name] = value
        accept = headers.get(b"accept")
        packed = accept is not None and wants_msgpack(accept.decode("latin-1"))
        try:
            response = rendered(await self._write(scope, receive, headers), packed)
        except Exception as e:
            error = to_api_error(e)
            state = scope.setdefault("state", {})
            state["error"] = error
            if error.status >= 500:
                state["cause"] = e  # the access middleware logs it with the request id
            response = rendered_error(error, packed)
        await send_rendered(send, response)

    async def _write(self, scope: Scope, receive: Receive, headers: dict[bytes, bytes]) -> dict[str, Any]:
        svc: Service = scope["app"].state.service
        client = scope.get("client")
        authorization = headers.get(b"authorization")
        svc.keys.require(
            None if authorization is None else authorization.decode("latin-1"),
            client[0] if client else "unknown",
            KeyScope.WRITE,
        )
        query = scope["query_string"]
        if query:  # the endpoint takes no parameter: any is refused (400 unknown_parameter)
            params.query(query, NO_PARAMETERS)
        if svc.draining:
            raise shutting_down()  # before reading the body: it would be refused after that anyway
        declared = headers.get(b"content-length")
        content_type = headers.get(b"content-type")
        media = None if content_type is None else content_type.decode("latin-1")
        encodings = _every(scope, headers, b"content-encoding")
        limit = svc.settings.max_body_bytes
        check_body_head(
            media,
            encodings,
            None if declared is None else declared.decode("latin-1"),
            limit,
            _every(scope, headers, b"transfer-encoding"),
        )
        message = await receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            raw = whole_body(message.get("body", b""), limit)
        else:
            raw = await read_limited(_chunks(receive, message), limit)
        scores = parse_scores(decode_object(raw, media))
        request_id = scope.get("state", {}).get("request_id")
        queued: set[int] = set()  # refusals queued by an attempt before (Moderation.submit)

        async def submit() -> list[Result]:
            # Made again during a reshard's cut-over: a retry of the same results is harmless.
            # A board kept is taken as it is (``get`` would take it so, in a coroutine more).
            board_id = scope["path_params"]["board"]
            board = svc.boards.cached(board_id) or await svc.boards.get(board_id)
            return await svc.moderation.submit(
                board, board.prepare(scores), request_id, svc.coalescer, queued
            )

        results = await through_reshard(submit)
        # result_body inlined for the usual result, one applied to every period it goes to
        return {
            "results": [
                result_body(r)
                if r.closed
                else {
                    "player_id": r.player_id,
                    "match_id": r.match_id,
                    "status": r.status,
                    "points": r.points,
                }
                for r in results
            ]
        }


def result_body(r: Result) -> dict[str, Any]:
    """One score's result as api.md spells it, plus ``closed_periods`` when it has any."""
    body: dict[str, Any] = {
        "player_id": r.player_id,
        "match_id": r.match_id,
        "status": r.status,
        "points": r.points,
    }
    if r.closed:
        body["closed_periods"] = list(r.closed)
    return body


async def _chunks(receive: Receive, message: Message) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive, from its first ``message``; ClientDisconnect when
    the client goes first."""
    while True:
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return
        message = await receive()


def _every(scope: Scope, first: dict[bytes, bytes], name: bytes) -> list[str] | tuple[()]:
    """Every value of the header ``name`` (a header may be repeated), looked for only when
    ``first`` (the first value of each wanted header) has one: most writes carry neither coding."""
    if name not in first:
        return ()
    return [value.decode("latin-1") for header, value in scope["headers"] if header == name]
