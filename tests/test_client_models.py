"""A 2xx answer the models cannot read is a ``ClientError``: every failure of the client is one, as
its errors' docs say. A body without a field the models need (no ``achieved_at``), with one of the
wrong type, or that is no object at all raised KeyError, TypeError or ValueError from the models
(a client audit's finding). Each operation is answered malformed bodies by a mock transport, in
both formats; the error names the request, the field at fault and the answer's status."""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import msgpack
import orjson
import pytest

from shardlb import client as shardlb_client
from shardlb.client import AsyncClient, Backoff, MatchResult

FAST = Backoff(base=0.002, cap=0.02)
AT = "2026-11-30T05:00:00Z"
ENTRY = {"rank": 1, "player_id": "p", "points": 5, "achieved_at": AT}
PAGE = {"board": "b", "period": "total", "entries": [ENTRY], "as_of": AT, "resets_at": None}
BOARD = {
    "board": "b",
    "mode": "best",
    "order": "desc",
    "periods": ["total"],
    "sharding": {"strategy": "hash"},
}

Call = Callable[[AsyncClient], Awaitable[Any]]
# operation: (its call, the request it sends, the status of its answer, a good answer)
OPERATIONS: dict[str, tuple[Call, str, int, dict[str, Any]]] = {
    "post_scores": (
        lambda c: c.post_scores("b", [MatchResult("p", 5, "m")]),
        "POST /v1/boards/b/scores",
        200,
        {"results": [{"player_id": "p", "match_id": "m", "status": "improved", "points": 5}]},
    ),
    "top": (lambda c: c.top("b"), "GET /v1/boards/b/top", 200, PAGE),
    "entries": (lambda c: c.entries("b"), "GET /v1/boards/b/entries", 200, PAGE),
    "player": (
        lambda c: c.player("b", "p"),
        "GET /v1/boards/b/players/p",
        200,
        {**ENTRY, "players": 1, "percentile": 0.0, "resets_at": None},
    ),
    "around": (lambda c: c.around("b", "p"), "GET /v1/boards/b/players/p/around", 200, {"entries": [ENTRY]}),
    "query": (lambda c: c.query("b", ["p"]), "POST /v1/boards/b/players:query", 200, {"entries": [ENTRY]}),
    "put_board": (lambda c: c.put_board("b"), "PUT /v1/boards/b", 201, BOARD),
    "get_board": (
        lambda c: c.get_board("b"),
        "GET /v1/boards/b",
        200,
        {**BOARD, "players": {"total": 1}, "resets_at": {}, "closed": False},
    ),
    "list_boards": (lambda c: c.list_boards(), "GET /v1/boards", 200, {"boards": [BOARD]}),
}

_GONE = object()


def _with(body: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """``body`` with the field at ``path`` replaced by ``value`` (removed for ``_GONE``)."""
    out = copy.deepcopy(body)
    parent: Any = out
    for step in path[:-1]:
        parent = parent[step]
    if value is _GONE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


# operation: [(where in the good answer, what to put there, what the error must name)]
DAMAGE: dict[str, list[tuple[tuple[str | int, ...], Any, str]]] = {
    "post_scores": [
        (("results",), _GONE, "results is missing"),
        (("results",), "improved", "results is not a list"),
        (("results", 0, "points"), _GONE, "results[0].points is missing"),
        (("results", 0, "points"), "5", "results[0].points is not an integer"),
        (("results", 0, "status"), None, "results[0].status is not a string"),
        (("results", 0), ["p", "m"], "results[0] is not an object"),
        (("results",), [], "1 score"),
    ],
    "top": [
        (("as_of",), _GONE, "as_of is missing"),
        (("entries", 0, "achieved_at"), _GONE, "entries[0].achieved_at is missing"),
        (("entries", 0, "achieved_at"), "yesterday", "entries[0].achieved_at is not an RFC 3339 time"),
        (("entries", 0, "achieved_at"), 1764478800000, "entries[0].achieved_at is not an RFC 3339 time"),
        (("entries", 0, "achieved_at"), "2026-11-30T05:00:00", "entries[0].achieved_at"),
        (("entries", 0, "rank"), True, "entries[0].rank is not an integer"),
        (("entries",), {"rank": 1}, "entries is not a list"),
        (("settled",), "yes", "settled is not a boolean"),
    ],
    "entries": [(("board",), 7, "board is not a string"), (("resets_at",), 7, "resets_at")],
    "player": [
        (("achieved_at",), _GONE, "achieved_at is missing"),
        (("percentile",), "high", "percentile is not a number"),
        (("players",), _GONE, "players is missing"),
        (("rank_error",), 0.5, "rank_error is not an integer"),
        (("counts_as_of",), "soon", "counts_as_of is not an RFC 3339 time"),
    ],
    "around": [
        (("entries",), _GONE, "entries is missing"),
        (("entries", 0), 5, "entries[0] is not an object"),
    ],
    "query": [(("entries", 0, "player_id"), _GONE, "entries[0].player_id is missing")],
    "put_board": [
        (("mode",), _GONE, "mode is missing"),
        (("sharding",), "hash", "sharding is not an object"),
        (("periods",), 5, "periods is not a list"),
    ],
    "get_board": [
        (("players",), [1], "players is not an object"),
        (("players", "total"), "1", "players.total is not an integer"),
        (("players", "total"), True, "players.total is not an integer"),
        (("resets_at",), {"daily": 5}, "resets_at.daily is not an RFC 3339 time"),
        (("resets_at",), {"daily": "2026-11-30T05:00:00"}, "resets_at.daily is not an RFC 3339 time"),
        (("closed",), "no", "closed is not a boolean"),
    ],
    "list_boards": [
        (("boards",), _GONE, "boards is missing"),
        (("boards", 0, "order"), _GONE, "boards[0].order is missing"),
    ],
}

CASES = [
    pytest.param(op, path, value, named, id=f"{op}-{'.'.join(map(str, path))}-{named.split(' is ')[-1][:12]}")
    for op, damages in DAMAGE.items()
    for path, value, named in damages
]


def _client(format: str, status: int, body: Any) -> AsyncClient:
    media = "application/msgpack" if format == "msgpack" else "application/json"
    content = msgpack.packb(body) if format == "msgpack" else orjson.dumps(body)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"content-type": media}, content=content)

    return AsyncClient("http://r.test", format=format, backoff=FAST, transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("format", ["msgpack", "json"])
@pytest.mark.parametrize("op", list(OPERATIONS))
async def test_the_good_answers_of_these_tests_are_read(op: str, format: str) -> None:
    """The answers the other tests damage are read as they are: their errors come from the damage."""
    call, _, status, good = OPERATIONS[op]
    async with _client(format, status, good) as client:
        await call(client)


@pytest.mark.parametrize("format", ["msgpack", "json"])
@pytest.mark.parametrize(("op", "path", "value", "named"), CASES)
async def test_a_malformed_answer_is_a_client_error_naming_the_request_and_the_field(
    op: str, path: tuple[str | int, ...], value: Any, named: str, format: str
) -> None:
    call, request, status, good = OPERATIONS[op]
    async with _client(format, status, _with(good, path, value)) as client:
        with pytest.raises(shardlb_client.TransportError) as raised:
            await call(client)
    error = raised.value
    assert isinstance(error, shardlb_client.MalformedAnswer)
    assert error.status == status
    assert request in str(error) and named in str(error)
    assert error.attempts == 1


@pytest.mark.parametrize("format", ["msgpack", "json"])
@pytest.mark.parametrize("op", list(OPERATIONS))
@pytest.mark.parametrize(
    ("status", "body"), [(200, [1, 2]), (200, "ok"), (204, None)], ids=["list", "text", "204"]
)
async def test_an_answer_that_is_no_object_is_a_malformed_answer(
    op: str, status: int, body: Any, format: str
) -> None:
    """A 2xx whose body is no object (or none at all) for an operation that reads one."""
    call, request, _, _ = OPERATIONS[op]
    async with _client(format, status, body) as client:
        with pytest.raises(shardlb_client.TransportError) as raised:
            await call(client)
    error = raised.value
    assert isinstance(error, shardlb_client.MalformedAnswer)
    assert error.status == status and request in str(error)


async def test_a_body_that_is_not_json_at_all_keeps_its_status() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=b"{not json")

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", format="json", backoff=FAST, transport=transport) as client:
        with pytest.raises(shardlb_client.TransportError) as raised:
            await client.top("b")
    assert isinstance(raised.value, shardlb_client.MalformedAnswer) and raised.value.status == 200
    assert "GET /v1/boards/b/top" in str(raised.value)


async def test_a_malformed_answer_names_the_request_id() -> None:
    """A 2xx that is not the API's carries the request's id: the router's, when the answer names
    one (its logs have the request), else the one the client sent (a proxy's page names none)."""
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["x-request-id"])
        headers = {"content-type": "text/html"}
        if len(sent) == 2:
            headers["x-request-id"] = "the-routers-own"
        return httpx.Response(200, headers=headers, content=b"<html>portal</html>")

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", format="json", backoff=FAST, transport=transport) as client:
        with pytest.raises(shardlb_client.MalformedAnswer) as proxy:
            await client.top("b")
        with pytest.raises(shardlb_client.MalformedAnswer) as router:
            await client.top("b")
    assert (proxy.value.request_id, router.value.request_id) == (sent[0], "the-routers-own")


@pytest.mark.parametrize("format", ["msgpack", "json"])
async def test_a_proxys_error_page_is_retried_and_says_what_answered(format: str) -> None:
    """A proxy's 502 page (HTML, not the API's body) is ``Unavailable`` with its status, retried
    under the one request id, and its message gives the page's Content-Type and first words: it
    said only "the answer is not an API error body", whoever had answered (a client audit's
    finding: a load balancer's page names the balancer)."""
    page = b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>nginx/1.25.3</body></html>" * 20
    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["x-request-id"])
        return httpx.Response(502, headers={"content-type": "text/html"}, content=page)

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", "k", format=format, backoff=FAST, transport=transport) as client:
        with pytest.raises(shardlb_client.Unavailable) as raised:
            await client.post_scores("b", [MatchResult("p", 5, "m")], deadline=0.3)
    error = raised.value
    assert (error.status, error.code, error.request_id) == (502, "http_502", sent[0])
    assert error.attempts == len(sent) > 1 and set(sent) == {sent[0]}
    assert "text/html" in error.message and "<title>502 Bad Gateway</title>" in error.message
    assert "\n" not in error.message and len(error.message) < 300  # one line, however long the page


def test_a_blocking_client_raises_the_same() -> None:
    good = OPERATIONS["top"][3]
    body = orjson.dumps(_with(good, ("entries", 0, "achieved_at"), _GONE))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "application/json"}, content=body)

    with (
        shardlb_client.Client(
            "http://r.test", format="json", transport=httpx.MockTransport(handler)
        ) as client,
        pytest.raises(shardlb_client.ClientError, match=r"entries\[0\]\.achieved_at is missing"),
    ):
        client.top("b")


@pytest.mark.parametrize("format", ["msgpack", "json"])
async def test_times_come_back_in_utc_whatever_offset_the_answer_spells(format: str) -> None:
    """The models' docstring promises UTC: a time the server spells with an offset (a period's
    bounds in the board's zone, a setting echoed as it was given) is the same instant in UTC."""
    at = "2026-11-30T10:30:00+05:30"
    page = {
        **PAGE,
        "entries": [{**ENTRY, "achieved_at": at}],
        "as_of": at,
        "resets_at": "2026-12-01T00:00:00-08:00",
    }
    async with _client(format, 200, page) as client:
        got = await client.top("b")
    want = datetime(2026, 11, 30, 5, 0, tzinfo=UTC)
    assert got.entries[0].achieved_at == want and got.entries[0].achieved_at.utcoffset() == timedelta(0)
    assert got.as_of.tzinfo == UTC and got.as_of == want
    assert got.resets_at == datetime(2026, 12, 1, 8, 0, tzinfo=UTC) and got.resets_at.tzinfo == UTC
