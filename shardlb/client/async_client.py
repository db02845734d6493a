"""``AsyncClient``: the HTTP API of api.md for asyncio programs (game servers, tools), on httpx.

Every call runs under a deadline (the client's ``deadline`` seconds, or the call's own): attempts,
waits between them and the last answer all fit inside it, so a call never takes longer, whatever the
server does. Within it, a call is sent again after a failure that a retry can fix: no answer (the
connection failed or dropped, an attempt timed out) or 408, 429, 502, 503, 504 (a board being
rebuilt or resharded among them: ``BoardRebuilding``, ``BoardResharding``); the wait is
``Backoff``'s (exponential, full jitter, at least ``Retry-After``), and a refusal whose
``Retry-After`` would outlast the deadline is raised at once. Other errors are raised at once
(a 4xx means the request is wrong, and would be as wrong the second time). Every call is safe to
send again: reads and board settings are idempotent, and score writes carry their match ids (see
``MatchResult``). The attempts of one call share one ``X-Request-Id``, so the router's logs tie
them together.
"""

from __future__ import annotations

import asyncio
import functools
import math
import operator
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgpack
import orjson

from shardlb.client.backoff import Backoff
from shardlb.client.errors import (
    ApiError,
    BoardNotFound,
    ClientClosed,
    ClientError,
    InvalidRequest,
    MalformedAnswer,
    TransportError,
    answer_seen,
    api_error,
    renumbered,
    retry_after_seconds,
)
from shardlb.client.models import (
    BoardInfo,
    Entry,
    MalformedBody,
    MatchResult,
    Page,
    PlayerRank,
    ScoreOutcome,
    boards_of,
    entries_of,
    outcomes_of,
)

MAX_ITEMS = 1000  # scores per write and player ids per query: the API's limit
_NOT_FINITE = {"points": "out_of_range", "achieved_at": "invalid_time"}  # the server's codes for NaN
JSON, MSGPACK = "application/json", "application/msgpack"
# Failures after which the request may or may not have reached the server: worth another attempt
# on a call that is safe to repeat (all of this client's are).
_NO_ANSWER = (TimeoutError, httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
T = TypeVar("T")


def _no_body(body: Any) -> None:
    """What ``delete_board`` reads of its answer (204): nothing."""


def _encodable(result: MatchResult, index: int) -> dict[str, Any]:
    """``result``'s body when it can be sent (JSON or MessagePack); else InvalidRequest naming its
    field (422, as the server would name it), before anything is sent: one result that cannot even
    be encoded must fail alone (a ScoreBuffer then sends the others), not as its batch's
    OverflowError, nor a value of a type neither format carries (a ``Decimal``, a ``date``) as its
    batch's TypeError. A ``datetime`` without a time zone is refused too: it went as a time without
    an offset, which the server refuses (``invalid_time``), and a local time's offset is not ours
    to guess (until 2026-12-06 it was sent, and its request refused). So is a float that is not
    finite (NaN, infinity), which JSON cannot carry: both formats refuse it alike, with the code
    the server gives it in MessagePack."""
    at = result.achieved_at
    if isinstance(at, datetime) and at.utcoffset() is None:
        raise InvalidRequest(
            422,
            "invalid_time",
            f"achieved_at is a datetime without a time zone ({at.isoformat()}): give it one "
            "(datetime.now(UTC), or .replace(tzinfo=...)) or send epoch milliseconds",
            f"scores[{index}].achieved_at",
        )
    score = result.body()
    for name, value in score.items():
        if not isinstance(value, str | int | float):
            raise InvalidRequest(
                422,
                "invalid_input",
                f"{name} cannot be sent: a {type(value).__name__} is no value of the API",
                f"scores[{index}].{name}",
            )
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(
                    422, "invalid_input", f"{name} is not valid UTF-8 text", f"scores[{index}].{name}"
                ) from None
        elif isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise InvalidRequest(
                422, "out_of_range", f"{name} does not fit in 64 bits", f"scores[{index}].{name}"
            )
        elif isinstance(value, float) and not math.isfinite(value):
            # JSON has no NaN nor infinity, and orjson writes them as null: a NaN achieved_at went
            # as left out, and the result was applied at the server's time (until 2026-12-07).
            raise InvalidRequest(
                422,
                _NOT_FINITE.get(name, "invalid_input"),
                f"{name} is {value}, not a finite number",
                f"scores[{index}].{name}",
            )
    return score


def _checked_key(key: str | None) -> str | None:
    """``key`` without its surrounding whitespace, as the router takes its own keys (it strips
    ``SHARDLB_*_KEYS`` and the key presented): a key read from a file keeps the file's newline,
    which no header may carry, and every call failed quoting the key into the caller's logs
    (until 2026-12-07). A key no router holds (router keys are printable ASCII without spaces) is
    refused here, without showing it."""
    if key is None:
        return None
    key = key.strip()
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise ValueError(
            "key must be printable ASCII without spaces, as a router's keys are (the key is not shown)"
        )
    return key


def _packable(value: Any) -> Any:
    """MessagePack's stand-in for what it cannot pack: a ``datetime`` goes as RFC 3339 text, as
    orjson writes it in JSON, so both formats take the same arguments."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot send a {type(value).__name__} as MessagePack")


def _segment(value: str) -> str:
    """``value`` as one path segment. An id of dots only (``.``, ``..``: valid ids) would be a
    relative step that the URL's normalisation resolves, so its dots are percent-encoded."""
    if value.strip(".") == "":
        return value.replace(".", "%2E")
    return quote(value, safe="")


class AsyncClient:
    """A client of one shardlb router (or a load balancer in front of several).

    ``key``: the API key (``write`` to post scores, ``admin`` for boards; reads need none unless the
    server says so), its surrounding whitespace dropped as the router drops it. ``format``:
    ``"msgpack"`` (default: smaller and faster to parse on both sides) or ``"json"``. ``deadline``:
    seconds a call may take in all, retries included (each call may pass its own).
    ``attempt_timeout``: seconds an attempt may wait for any one read or write on its connection
    before it is abandoned and retried; ``connect_timeout`` the same for opening one.
    Connections are HTTP/1.1 and kept alive, at most ``max_connections`` at once (more calls at
    once wait for one; a ``ScoreBuffer`` lets many tasks share few requests). ``transport``
    replaces httpx's network transport (e.g. a custom TLS setup).

    Use it as ``async with AsyncClient(...) as client:`` or call ``aclose()``. It serves one event
    loop, the one its connections were opened in: a program that runs several (``asyncio.run``
    per task) makes one client in each, or uses the blocking ``Client``.
    """

    def __init__(
        self,
        base_url: str,
        key: str | None = None,
        *,
        format: str = "msgpack",
        deadline: float = 10.0,
        attempt_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        backoff: Backoff | None = None,
        max_connections: int = 10,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if format not in ("msgpack", "json"):
            raise ValueError(f"format must be 'msgpack' or 'json', not {format!r}")
        if deadline <= 0:
            raise ValueError("deadline must be positive")
        self.format = format
        self.deadline = deadline
        self.backoff = backoff or Backoff()
        self._media = MSGPACK if format == "msgpack" else JSON
        headers = {"Accept": self._media}
        key = _checked_key(key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        # Requests past the pool's size wait here rather than in httpx's pool, whose cost per
        # request grows with the number of requests waiting in it and with its connections
        # (encode/httpx#3215; measured in README.md, "For game developers").
        self._gate = asyncio.Semaphore(max_connections)
        # Scores a write request may carry: the API's limit, less once a request was refused as too
        # large (413) for the router's body cap, which later calls then keep below (post_scores).
        self._write_items = MAX_ITEMS
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(attempt_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- the one way a request is sent -------------------------------------------------------

    def _end(self, deadline: float | None) -> float:
        budget = self.deadline if deadline is None else deadline
        if budget <= 0:
            raise ValueError("deadline must be positive")
        return time.monotonic() + budget

    def _encode(self, body: Any) -> bytes:
        if self._media == MSGPACK:
            packed: bytes = msgpack.packb(body, use_bin_type=True, default=_packable)
            return packed
        return orjson.dumps(body)

    @staticmethod
    def _decode(response: httpx.Response) -> Any:
        if not response.content:
            return None
        kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
        try:
            if kind.endswith("msgpack"):
                return msgpack.unpackb(response.content)
            return orjson.loads(response.content)
        except ValueError:
            return None  # not a body of the API (a proxy's page): the status alone must do

    async def _call(
        self,
        method: str,
        path: str,
        end: float,
        read: Callable[[Any], T],
        params: dict[str, Any] | None = None,
        body: Any = None,
    ) -> tuple[int, T]:
        """Send until an answer that is not worth retrying, or until the next attempt would not end
        before ``end`` (``time.monotonic()``); the last error is raised then. When ``end`` comes
        during an attempt, that attempt is abandoned and the previous attempt's error raised (a
        ``TransportError`` saying the deadline passed when it was the first). A 2xx answer's status
        and its body as ``read`` (a model's parser) makes it are returned; a body ``read`` cannot
        make sense of is a ``MalformedAnswer``, raised at once."""
        request_id = uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        content = None
        if body is not None:
            content = self._encode(body)
            headers["Content-Type"] = self._media
        query = {k: v for k, v in (params or {}).items() if v is not None}
        attempt = 0
        error: ClientError | None = None
        while True:
            attempt += 1
            if self._http.is_closed:  # httpx would raise its RuntimeError, outside ClientError
                raise ClientClosed(f"{method} {path}: the client is closed")
            try:
                async with asyncio.timeout(max(0.0, end - time.monotonic())), self._gate:
                    response = await self._http.request(
                        method, path, params=query, content=content, headers=headers
                    )
            except _NO_ANSWER as e:
                if isinstance(e, TimeoutError) and error is not None:
                    # The deadline cut a retry short: what made the retries necessary says more.
                    error.attempts = attempt
                    raise error from e
                reason = "deadline passed" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                error = TransportError(f"{method} {path}: no answer ({reason})", attempt, request_id)
                error.__cause__ = e
                wait_at_least = None
            except httpx.HTTPError as e:
                # Not a lost answer: one httpx could not read (a broken Content-Encoding), or a
                # request it would not send (a base URL without http://). Raised as they are.
                raise TransportError(f"{method} {path}: {type(e).__name__}: {e}", attempt, request_id) from e
            else:
                answered_id = response.headers.get("x-request-id", request_id)  # a proxy's answer has none
                if response.status_code < 300:  # a 3xx is never the router's: a proxy's, no API body
                    status, answer = response.status_code, self._decode(response)
                    try:
                        if status != 204 and not isinstance(answer, dict):
                            # A captive portal's page, or a body that does not decode: not the API's.
                            kind = response.headers.get("content-type") or "none"
                            raise MalformedBody(f"its body is no object of the API (Content-Type {kind})")
                        return status, read(answer)
                    except MalformedBody as e:
                        message = f"{method} {path}: the answer ({status}) is not the API's: {e}"
                        raise MalformedAnswer(message, status, attempt, answered_id) from e
                error = api_error(
                    response.status_code,
                    self._decode(response),
                    answered_id,
                    retry_after_seconds(response.headers.get("retry-after")),
                    attempt,
                    functools.partial(answer_seen, response.headers.get("content-type"), response.content),
                )
                if not error.retryable:
                    raise error
                wait_at_least = error.retry_after
            delay = self.backoff.delay(attempt, wait_at_least)
            if time.monotonic() + delay >= end:
                raise error
            await asyncio.sleep(delay)

    # ---- writes ------------------------------------------------------------------------------

    async def post_scores(
        self, board: str, results: Iterable[MatchResult], *, deadline: float | None = None
    ) -> list[ScoreOutcome]:
        """Post match results; one outcome per result, in order.

        Each result carries its match id (``MatchResult`` requires one), which is what makes the
        retries safe: a result the server already applied is recognised and not counted again.
        A result that cannot be sent at all (``_encodable``) is refused before the first request.
        More than 1000 results go as several requests, one after another; if one of them fails
        for good, the error is raised and the earlier ones stay applied (their outcomes are the
        error's ``applied``; a ``field`` such as ``scores[1003].points`` counts from the start of
        ``results``): posting the same list again is safe and applies only what is missing. A
        request the router refuses as too large (413, past its ``SHARDLB_MAX_BODY_BYTES``; nothing
        of it was read) goes again as requests half its size, and so do the ones after it and the
        client's later calls (it never sends more again: a router's cap is not announced).
        """
        end = self._end(deadline)
        # Every result is checked before the first request: one that cannot be sent is refused
        # with nothing sent, where a check per request had sent (and applied) those before it.
        items = [_encodable(r, i) for i, r in enumerate(results)]
        outcomes: list[ScoreOutcome] = []
        start, size = 0, self._write_items
        while start < len(items):
            scores = items[start : start + size]
            try:
                _, applied = await self._call(
                    "POST",
                    f"/v1/boards/{_segment(board)}/scores",
                    end,
                    functools.partial(outcomes_of, sent=len(scores)),
                    body={"scores": scores},
                )
            except ApiError as e:
                if e.status == 413 and len(scores) > 1:
                    size = (len(scores) + 1) // 2
                    self._write_items = min(self._write_items, size)
                    continue
                if start == 0:
                    raise
                error = renumbered(e, functools.partial(operator.add, start))  # the caller's index
                error.applied = outcomes
                raise error from e
            except ClientError as e:  # a later request lost in transit: the earlier ones were applied
                e.applied = outcomes
                raise
            outcomes.extend(applied)
            start += len(scores)
        return outcomes

    # ---- reads -------------------------------------------------------------------------------

    async def top(
        self,
        board: str,
        limit: int = 100,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> Page:
        """The best ``limit`` (1-1000) entries, from the router's cached top (``as_of`` says when it
        was read). ``period``: ``total`` (default), ``daily``, ``weekly``, ``monthly`` or a given one
        (``daily:2026-11-30``); ``region`` limits a region board to one region; ``rank_mode``
        (``unique`` or ``competition``, every read takes it) overrides the board's for this read."""
        params = {"limit": limit, "period": period, "region": region, "rank_mode": rank_mode}
        path = f"/v1/boards/{_segment(board)}/top"
        _, page = await self._call("GET", path, self._end(deadline), Page.from_body, params)
        return page

    async def entries(
        self,
        board: str,
        offset: int = 0,
        limit: int = 100,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> Page:
        """``limit`` (1-1000) entries from rank ``offset + 1`` on, read live."""
        params = {
            "offset": offset,
            "limit": limit,
            "period": period,
            "region": region,
            "rank_mode": rank_mode,
        }
        path = f"/v1/boards/{_segment(board)}/entries"
        _, page = await self._call("GET", path, self._end(deadline), Page.from_body, params)
        return page

    async def iter_entries(
        self,
        board: str,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        start: int = 0,
        page_size: int = MAX_ITEMS,
        deadline: float | None = None,
    ) -> AsyncGenerator[Entry, None]:
        """Every entry from rank ``start + 1`` to the end, a page of ``page_size`` at a time (each page
        its own call with its own deadline). Pages are read one after another while writes go on,
        so this is not a snapshot: a player whose rank moves between two pages may be seen twice or
        not at all."""
        offset = start
        while True:
            page = await self.entries(
                board, offset, page_size, period=period, region=region, rank_mode=rank_mode, deadline=deadline
            )
            for entry in page.entries:
                yield entry
            if len(page.entries) < page_size:
                return
            offset += page_size

    async def player(
        self,
        board: str,
        player_id: str,
        *,
        period: str | None = None,
        region: str | None = None,
        estimate: bool = False,
        max_age_ms: int | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> PlayerRank:
        """A player's rank, points and percentile. ``estimate=True`` answers from the router's
        in-memory histograms (no cluster round trip) with ``rank_error``. ``max_age_ms``: on a band
        board the other bands' sizes may be that old, on a hash board the other shards' counts for
        this player while their score is unchanged (the answer's ``counts_as_of`` says when they were
        read), so the read touches one or two shards instead of every master. Raises
        ``PlayerNotFound`` when the player has no score in that period."""
        params = {
            "period": period,
            "region": region,
            "estimate": "true" if estimate else None,
            "max_age_ms": None if max_age_ms is None else str(max_age_ms),
            "rank_mode": rank_mode,
        }
        path = f"/v1/boards/{_segment(board)}/players/{_segment(player_id)}"
        _, rank = await self._call("GET", path, self._end(deadline), PlayerRank.from_body, params)
        return rank

    async def around(
        self,
        board: str,
        player_id: str,
        radius: int = 5,
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> list[Entry]:
        """Up to ``radius`` (0-100) entries above and below the player, the player included."""
        params = {"radius": radius, "period": period, "region": region, "rank_mode": rank_mode}
        path = f"/v1/boards/{_segment(board)}/players/{_segment(player_id)}/around"
        _, entries = await self._call("GET", path, self._end(deadline), entries_of, params)
        return entries

    async def query(
        self,
        board: str,
        player_ids: Iterable[str],
        *,
        period: str | None = None,
        region: str | None = None,
        rank_mode: str | None = None,
        deadline: float | None = None,
    ) -> list[Entry]:
        """The entries of these players (a friends list) sorted by rank, with their global ranks;
        players without a score are left out. Any number of ids: lists over the API's limit of 1000
        are sent as several requests at once and merged by rank (each rank is the player's place on
        the whole board, so the merge is a sort). Repeated ids are asked for once."""
        end = self._end(deadline)
        ids = list(dict.fromkeys(player_ids))
        path = f"/v1/boards/{_segment(board)}/players:query"
        params = {"period": period, "region": region, "rank_mode": rank_mode}  # in the query, not the body

        async def one(chunk: Sequence[str]) -> list[Entry]:
            _, entries = await self._call("POST", path, end, entries_of, params, {"player_ids": list(chunk)})
            return entries

        if len(ids) <= MAX_ITEMS:
            return await one(ids)
        parts_of = [asyncio.ensure_future(one(ids[i : i + MAX_ITEMS])) for i in range(0, len(ids), MAX_ITEMS)]
        try:
            parts = await asyncio.gather(*parts_of)
        except BaseException:
            for part in parts_of:  # gather leaves the others running: the call is over, so are they
                part.cancel()
            raise
        return sorted((e for part in parts for e in part), key=lambda e: (e.rank, e.player_id))

    # ---- boards (admin) ----------------------------------------------------------------------

    async def put_board(self, board: str, *, deadline: float | None = None, **settings: Any) -> BoardInfo:
        """Create a board, or confirm that an identical one exists (``created`` says which, but for
        a retry: an attempt whose answer was lost may have created it, the next then finds it and
        says False); the settings are api.md's (``mode="incr"``, ``periods=["total", "daily"]``,
        ``sharding={...}``). Raises ``Conflict`` when the board exists with other settings. Needs
        an admin key."""
        path = f"/v1/boards/{_segment(board)}"
        status, info = await self._call("PUT", path, self._end(deadline), BoardInfo.from_body, body=settings)
        return replace(info, created=status == 201)

    async def get_board(self, board: str, *, deadline: float | None = None) -> BoardInfo:
        """A board's settings and its number of players per kept period (``players``)."""
        _, info = await self._call(
            "GET", f"/v1/boards/{_segment(board)}", self._end(deadline), BoardInfo.from_body
        )
        return info

    async def list_boards(self, *, deadline: float | None = None) -> list[BoardInfo]:
        _, boards = await self._call("GET", "/v1/boards", self._end(deadline), boards_of)
        return boards

    async def delete_board(self, board: str, *, deadline: float | None = None) -> None:
        """Remove a board and all its entries. Raises ``BoardNotFound`` when there is no such board,
        except after a retry: an earlier attempt whose answer was lost may have deleted it, and the
        board being gone is what was asked."""
        try:
            await self._call("DELETE", f"/v1/boards/{_segment(board)}", self._end(deadline), _no_body)
        except BoardNotFound as e:
            if e.attempts == 1:
                raise
