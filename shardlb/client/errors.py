"""The client's exceptions: one hierarchy under ``ClientError``.

``ApiError`` is an answer of the server with an error status, and carries what the API's error body
says (``code``, ``message``, ``field``) with the status, the request id and ``Retry-After``; its
subclasses follow the status so that callers can catch a kind of failure. ``TransportError`` is no
answer at all (the connection failed or dropped, or the deadline passed mid-request), or its
``MalformedAnswer``: a 2xx answer the client cannot read. Both record how many attempts the call
made before giving up, and the request id its attempts sent (the router logs each it received).
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Callable
from datetime import UTC
from typing import Any

# 429 and 503 are the API's "come back later"; 502 and 504 are what a proxy in front of the router
# answers when it is restarting. 500 is a bug of the server: sending the same request again would
# most likely meet the same bug. Any other 4xx means the request itself is wrong.
# 408: the request did not arrive whole in time and the router closed the connection without
# running it (router/http.py), so sending it again is safe, as after a lost connection.
RETRYABLE_STATUSES = frozenset({408, 429, 502, 503, 504})
SEEN_BYTES, SEEN_CHARS = 1024, 160  # what a message quotes of an answer that is not the API's


class ClientError(Exception):
    """Every error the client raises. ``attempts``: how many requests the call sent. ``applied``:
    for a ``post_scores`` of more than one request, the outcomes of the requests before the one
    that failed (applied; empty otherwise). ``request_id``: the ``X-Request-Id`` of the request
    that failed, which the router's logs carry (None when nothing was sent)."""

    attempts: int = 1
    request_id: str | None = None
    applied: list[Any] = []  # noqa: RUF012 (a read-only default; post_scores sets its own list)


class TransportError(ClientError):
    """No answer: the connection could not be made, dropped, or the deadline passed while waiting
    (the cause is chained); or an answer the client cannot read (not the API's, or in an encoding
    httpx cannot undo), raised at once. For a write, the server may or may not have applied it:
    ``request_id`` is the ``X-Request-Id`` that every attempt of the call sent, under which the
    router logged each attempt that reached it (None when nothing was sent)."""

    def __init__(self, message: str, attempts: int = 1, request_id: str | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.request_id = request_id


class MalformedAnswer(TransportError):
    """A 2xx answer that is not the API's: no object, or one without a field the call reads or with
    one of the wrong type (a proxy's or a captive portal's page, or a server of another version).
    ``status`` is the answer's; the message names the request and the field at fault;
    ``request_id`` is the answer's ``X-Request-Id`` (the router's), or the one sent when the
    answer names none. After a ``post_scores`` the results were most likely applied: posting them
    again is safe (match ids)."""

    def __init__(self, message: str, status: int, attempts: int = 1, request_id: str | None = None) -> None:
        super().__init__(message, attempts, request_id)
        self.status = status


class ClientClosed(ClientError):
    """A call on a client after its ``close()`` (``aclose()``): nothing was sent."""


class ApiError(ClientError):
    """An error answer of the API: ``{"error": {"code", "message", "field"}}`` and its status."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.request_id = request_id
        self.retry_after = retry_after
        self.attempts = attempts

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE_STATUSES


SCORE_FIELD = re.compile(r"scores\[([0-9]+)\](.*)")  # an error's field naming one score of a request


def renumbered(error: ApiError, index: Callable[[int], int]) -> ApiError:
    """``error`` with the score its ``field`` names (``scores[3].points``) renumbered by ``index``."""
    match = SCORE_FIELD.fullmatch(error.field or "")
    field = f"scores[{index(int(match[1]))}]{match[2]}" if match else error.field
    return type(error)(
        error.status, error.code, error.message, field, error.request_id, error.retry_after, error.attempts
    )


class InvalidRequest(ApiError):
    """400, 413, 415 or 422: the request is wrong (``field`` names the part at fault)."""


class Unauthorized(ApiError):
    """401: no key where one is needed, or a key the server does not know."""


class Forbidden(ApiError):
    """403: the key's scope is too small (e.g. a read key creating a board)."""


class NotFound(ApiError):
    """404."""


class BoardNotFound(NotFound):
    """404 ``board_not_found``: no such board. Also, after a loss of all of Redis, every board from
    when the cluster serves again until `shardlb rebuild --all` restores it (then
    ``BoardRebuilding`` until its shards are rebuilt): a board that existed is not gone for good,
    and a ``put_board`` then would create it again, empty (docs/design-notes.md, "A board created
    again before the restore")."""


class PlayerNotFound(NotFound):
    """404 ``player_not_found``: the player has no score in that period."""


class Conflict(ApiError):
    """409, e.g. ``board_conflict``: the board exists with other settings."""


class BoardClosed(Conflict):
    """409 ``board_closed``: the board's season is being archived; it takes no more results."""


class RateLimited(ApiError):
    """429 ``rate_limited``: this client's read rate is used up, it holds as many requests at once
    as a client without a key may, or it sent too many wrong keys; ``retry_after`` says when to come
    back. Retried until the deadline like a 503 (raised at once when ``retry_after`` outlasts it)."""


class Unavailable(ApiError):
    """5xx: the service cannot take the call now (503, with ``retry_after``: ``overloaded``,
    ``shutting_down``, ``cluster_unavailable``, ``out_of_memory``, ``not_ready``,
    ``archive_unavailable``, ``archive_behind``, and the board's own states below), a proxy's
    502/504, all retried until the deadline; or a server bug (500, never retried). A write so
    refused may have been applied in part (a request across shards): sent again with the same
    match ids, each result still counts once."""


class BoardRebuilding(Unavailable):
    """503 ``board_rebuilding``: the board is being rebuilt after a loss of Redis, and the call's
    answer would come from a shard not rebuilt yet; nothing of it was written. After a total loss
    `shardlb rebuild --all` is under way; a shard lost alone (its master and replica at once) waits
    for an operator's `shardlb rebuild BOARD --shard N`, which may take far longer than a call's
    deadline. Keep the results and post them again later with the same match ids (within the
    board's dedup window, 24 h by default): the rebuild puts back what the service already
    applied, so each counts once."""


class BoardResharding(Unavailable):
    """503 ``board_resharding``: the board's layout is changing (a reshard's cut-over); nothing was
    written, and the call goes through once the new layout is in place (seconds)."""


_BY_CODE: dict[str, type[ApiError]] = {
    "board_not_found": BoardNotFound,
    "player_not_found": PlayerNotFound,
    "board_closed": BoardClosed,
    "board_rebuilding": BoardRebuilding,
    "board_resharding": BoardResharding,
}
_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: InvalidRequest,
    415: InvalidRequest,
    422: InvalidRequest,
    429: RateLimited,
}


def answer_seen(content_type: str | None, content: bytes) -> str:
    """`` (Content-Type text/html: '<html>...')``: an answer that is not the API's, as a message
    shows it: its type and the start of its text on one line (a proxy's page names the proxy)."""
    text = " ".join(content[:SEEN_BYTES].decode("utf-8", "replace").split())
    return f" (Content-Type {content_type or 'none'}: {text[:SEEN_CHARS]!r})" if text else " (no body)"


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds: delta-seconds, or an HTTP date (RFC 9110); None when absent or bad."""
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an asctime date (RFC 9110 has recipients take it): GMT, not local time
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def api_error(
    status: int,
    body: Any,
    request_id: str | None,
    retry_after: float | None,
    attempts: int,
    seen: Callable[[], str] = lambda: "",
) -> ApiError:
    """The exception for an error answer. A body that is not the API's (a proxy's HTML page) still
    gives an error with the status, under the code ``http_<status>``, and a message that ends with
    ``seen()``: what the answer was (``answer_seen``), for a person to tell who answered."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str):
        code, message, field = error["code"], str(error.get("message", "")), error.get("field")
    else:
        code, message, field = f"http_{status}", f"the answer is not an API error body{seen()}", None
    kind = _BY_CODE.get(code) or _BY_STATUS.get(status)
    if kind is None:
        kind = Unavailable if status >= 500 else InvalidRequest
    return kind(status, code, message, field, request_id, retry_after, attempts)
