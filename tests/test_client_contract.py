"""The client says what the API answers, and fails only the caller at fault (a client audit's
findings, 2026-12-05): results it cannot encode fail alone and as ``InvalidRequest``; a result's
``closed_periods`` and a settled read's ``settled``, ``settlement_id`` and rewards reach the
caller; a 408 (the request never reached the app) is sent again."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from shardlb.client import (
    ApiError,
    AsyncClient,
    Backoff,
    InvalidRequest,
    MatchResult,
    ScoreBuffer,
    ScoreOutcome,
    TransportError,
)
from shardlb.store import BoardStore
from tests.client_support import Served, served_router
from tests.router_support import ADMIN, AS_ADMIN, board_name

FAST = Backoff(base=0.002, cap=0.02)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
async def router(cluster: Any) -> AsyncIterator[Served]:
    async with served_router(cluster.url) as served:
        yield served


@pytest.mark.cluster
@pytest.mark.parametrize("format", ["msgpack", "json"])
@pytest.mark.parametrize(
    "bad",
    [
        MatchResult("cheater", 2**64, "bad-1"),
        MatchResult("\ud800", 5, "bad-2"),
        # Values of types neither format carries (a Decimal from a database, a date that is no
        # datetime): MessagePack's TypeError failed the whole batch, outside ClientError.
        MatchResult("p", Decimal(5), "bad-3"),  # type: ignore[arg-type]
        MatchResult("p", 5, "bad-4", achieved_at=date(2026, 12, 5)),  # type: ignore[arg-type]
        MatchResult("p", 5, "bad-5", achieved_at=datetime(2026, 12, 5, 12, 0)),  # no time zone
        MatchResult("p", 5, "bad-6", achieved_at=math.nan),  # type: ignore[arg-type]
    ],
    ids=["bigint", "surrogate", "decimal", "date", "naive", "nan"],
)
async def test_a_result_the_client_cannot_encode_fails_alone(
    router: Served, format: str, bad: MatchResult
) -> None:
    name = board_name("contract")
    async with AsyncClient(router.url, ADMIN, format=format, backoff=FAST) as client:
        await client.put_board(name)
        with pytest.raises(InvalidRequest) as refused:
            await client.post_scores(name, [MatchResult("p", 1, "m"), bad])
        assert refused.value.status == 422 and (refused.value.field or "").startswith("scores[1].")
        async with ScoreBuffer(client, max_scores=10, max_delay_ms=50) as buffer:
            posts = [buffer.post(name, MatchResult(f"p{i}", i + 1, f"m{i}")) for i in range(9)]
            posts.append(buffer.post(name, bad))
            done = await asyncio.gather(*posts, return_exceptions=True)
        assert all(isinstance(d, ScoreOutcome) for d in done[:9]), done
        assert isinstance(done[9], InvalidRequest)
        assert (await client.get_board(name)).players == {"total": 9}
        await client.delete_board(name)


@pytest.mark.cluster
async def test_a_result_it_cannot_encode_past_the_first_request_is_refused_before_anything_is_sent(
    router: Served,
) -> None:
    """A post of more than one request's 1000 results, one of the second request's not encodable:
    refused before anything is sent, as README.md says of such a result. The check ran request by
    request: the first 1000 were applied, and the error, raised before the second, carried no
    ``applied`` (a client audit's finding), so a caller could not tell that they had been."""
    name = board_name("contract")
    results = [MatchResult(f"p{i}", i + 1, f"m{i}") for i in range(1500)]
    results[1200] = MatchResult("p1200", 2**64, "m1200")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        with pytest.raises(InvalidRequest) as refused:
            await client.post_scores(name, results)
        error = refused.value
        assert (error.code, error.field, error.request_id, error.applied) == (
            "out_of_range",
            "scores[1200].points",
            None,
            [],
        )
        assert (await client.get_board(name)).players == {"total": 0}
        await client.delete_board(name)


@pytest.mark.cluster
@pytest.mark.parametrize("format", ["msgpack", "json"])
@pytest.mark.parametrize(("name", "code"), [("points", "out_of_range"), ("achieved_at", "invalid_time")])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
async def test_a_number_that_is_not_finite_is_refused_before_it_is_sent(
    router: Served, format: str, name: str, code: str, value: float
) -> None:
    """JSON has no NaN nor infinity, and orjson writes them as null: a NaN ``achieved_at`` (a game's
    clock arithmetic gone wrong) went as null, which the server takes as left out, and the result
    was applied at the server's time (``improved``); a NaN ``points`` was refused as "points is
    required". MessagePack carried them, and the server refused them for what they are. The client
    refuses them itself in both formats, naming the field, before anything is sent."""
    board = board_name("contract")
    bad = MatchResult("q", 2, "n", achieved_at=value)  # type: ignore[arg-type]
    if name == "points":
        bad = MatchResult("q", value, "n")  # type: ignore[arg-type]
    async with AsyncClient(router.url, ADMIN, format=format, backoff=FAST) as client:
        await client.put_board(board)
        with pytest.raises(InvalidRequest) as refused:
            await client.post_scores(board, [MatchResult("p", 1, "m"), bad])
        error = refused.value
        assert (error.status, error.code, error.field) == (422, code, f"scores[1].{name}")
        assert "finite" in error.message and error.request_id is None
        assert (await client.get_board(board)).players == {"total": 0}
        await client.delete_board(board)


@pytest.mark.cluster
@pytest.mark.parametrize("format", ["msgpack", "json"])
async def test_an_achieved_at_without_a_time_zone_is_refused_before_it_is_sent(
    router: Served, format: str
) -> None:
    """A ``datetime`` without a time zone went as RFC 3339 text without an offset, which the server
    refuses (422 ``invalid_time``, the whole request): the client now refuses it itself, naming the
    field, before anything is sent (no request id: no request), as it does a value it cannot encode."""
    name = board_name("contract")
    naive = datetime.now(UTC).replace(tzinfo=None, microsecond=0)  # a UTC time, its zone dropped
    async with AsyncClient(router.url, ADMIN, format=format, backoff=FAST) as client:
        await client.put_board(name)
        async with httpx.AsyncClient(base_url=router.url) as http:  # what the client sent before
            sent = {"player_id": "p", "points": 1, "match_id": "m", "achieved_at": naive.isoformat()}
            server = await http.post(f"/v1/boards/{name}/scores", json={"scores": [sent]}, headers=AS_ADMIN)
        assert (server.status_code, server.json()["error"]["code"]) == (422, "invalid_time"), server.text
        with pytest.raises(InvalidRequest) as refused:
            await client.post_scores(name, [MatchResult("p", 1, "m"), MatchResult("q", 2, "n", naive)])
        error = refused.value
        assert (error.status, error.code, error.field) == (422, "invalid_time", "scores[1].achieved_at")
        assert "time zone" in error.message and error.request_id is None
        assert (await client.get_board(name)).players == {"total": 0}
        aware = naive.replace(tzinfo=UTC)
        [posted] = await client.post_scores(name, [MatchResult("q", 2, "n", achieved_at=aware)])
        assert posted.status == "improved"
        await client.delete_board(name)


@pytest.mark.cluster
async def test_a_results_closed_periods_reach_the_caller(router: Served) -> None:
    name = board_name("contract")
    three_days_ago = int((datetime.now(UTC) - timedelta(days=3)).timestamp() * 1000)
    async with AsyncClient(router.url, ADMIN, format="json") as client:
        await client.put_board(name, periods=["total", "daily"], retention_days={"daily": 30})
        [old] = await client.post_scores(name, [MatchResult("p1", 5, "m1", achieved_at=three_days_ago)])
        assert old.status == "improved" and old.closed_periods and old.closed_periods[0].startswith("daily:")
        [fresh] = await client.post_scores(name, [MatchResult("p2", 5, "m2")])
        assert fresh.closed_periods == ()
        await client.delete_board(name)


@pytest.mark.cluster
async def test_settled_reads_say_so_with_their_rewards(
    cluster: Any, store: BoardStore, raw: Any, postgres_url: str
) -> None:
    from tests.test_settlement import TABLE, day_ago, drain, new_board, written

    name = board_name("contract-settle")
    board = await new_board(store, name)
    period = day_ago(2)
    await written(board, period, name)
    await drain(raw, store, postgres_url)
    async with served_router(cluster.url, postgres_url=postgres_url) as served:
        async with httpx.AsyncClient(timeout=60) as h:
            settled = await h.post(
                f"{served.url}/v1/boards/{name}/periods/{period}:settle",
                json={"settlement_id": f"c-{name}", "rewards": TABLE, "top_n": 5},
                headers=AS_ADMIN,
            )
            assert settled.status_code == 200, settled.text
        async with AsyncClient(served.url, ADMIN) as client:
            page = await client.top(name, 3, period=period)
            winner = await client.player(name, page.entries[0].player_id, period=period)
            live = await client.top(name, 3)
    assert (page.settled, page.settlement_id, page.entries[0].reward) == (True, f"c-{name}", "gold")
    assert (winner.settled, winner.settlement_id) == (True, f"c-{name}")
    assert (live.settled, live.settlement_id, live.resets_at) == (False, None, None)
    await store.delete(name)


async def test_a_408_is_sent_again() -> None:
    """408 request_timeout: the request did not arrive whole, the app never ran it (router/http.py)."""
    answers: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        answers.append(1)
        if len(answers) == 1:
            body = {"error": {"code": "request_timeout", "message": "body too slow", "field": None}}
            return httpx.Response(408, json=body, headers={"connection": "close"})
        page = {"board": "b", "period": "total", "entries": [], "as_of": "2026-11-30T05:00:00Z"}
        return httpx.Response(200, json=page)

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", format="json", backoff=FAST, transport=transport) as client:
        page = await client.top("b")
    assert page.entries == [] and len(answers) == 2


def test_a_client_left_open_does_not_hold_the_process_at_exit() -> None:
    """A ``Client`` never closed held the interpreter at exit for good: its portal was stopped
    from the generator's finaliser while the loop thread could no longer answer (a client audit's
    finding). It is closed at exit (and when collected) instead."""
    import subprocess
    import sys

    script = (
        "from shardlb.client import Client\nc = Client('http://127.0.0.1:1', format='json')\nprint('made')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=15, cwd=ROOT)
    assert done.returncode == 0 and done.stdout == b"made\n", done


def test_a_forked_process_neither_hangs_on_a_client_of_its_parent_nor_at_exit() -> None:
    """A ``Client`` made before ``os.fork()`` (a pre-forking server's workers) runs its calls in
    its parent's loop thread, which the child does not have: a call there, and the child's exit
    (which closes clients left open), waited for it for good. The child's calls are
    ``ClientClosed`` saying why, and it exits; the parent's client goes on working."""
    import subprocess
    import sys

    script = """
import os, signal, sys
from shardlb.client import Client, ClientClosed
c = Client('http://127.0.0.1:1', format='json', deadline=0.2)
pid = os.fork()
if pid == 0:
    signal.alarm(5)  # a hung child ends, rather than outlive the test
    try:
        c.top('b')
    except ClientClosed as e:
        print('child:', e, flush=True)
    sys.exit(0)
os.waitpid(pid, 0)
try:
    c.top('b')
except Exception as e:
    print('parent:', type(e).__name__, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=10, cwd=ROOT)
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0 and len(lines) == 2, done
    assert lines[0].startswith("child:") and "fork" in lines[0] and lines[1] == "parent: TransportError"


async def test_a_later_request_lost_in_transit_still_tells_what_was_applied() -> None:
    """post_scores of more than 1000 results: the error of a later request carries the outcomes of
    the earlier ones (``applied``), a lost connection's as an API error's (only the latter did)."""
    from shardlb.client import TransportError

    calls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 1:
            scores = orjson.loads(request.content)["scores"]
            results = [
                {"player_id": s["player_id"], "match_id": s["match_id"], "status": "improved", "points": 1}
                for s in scores
            ]
            return httpx.Response(200, json={"results": results})
        raise httpx.ConnectError("router gone")

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", "k", format="json", backoff=FAST, transport=transport) as client:
        with pytest.raises(TransportError) as lost:
            await client.post_scores("b", [MatchResult(f"p{i}", 1, "m") for i in range(1500)], deadline=0.3)
    assert len(lost.value.applied) == 1000


def test_the_blocking_buffer_takes_the_async_buffers_deadline() -> None:
    from shardlb.client import Client

    with Client("http://127.0.0.1:1", format="json") as client:
        buffer = client.buffer(max_scores=10, deadline=5.0)
        assert buffer._buffer.deadline == 5.0
        buffer.close()


@pytest.mark.cluster
async def test_rank_mode_is_asked_per_read(router: Served) -> None:
    """api.md's reads take rank_mode; the client could not ask it (a client audit's finding)."""
    name = board_name("contract")
    async with AsyncClient(router.url, ADMIN) as client:
        await client.put_board(name)
        await client.post_scores(name, [MatchResult(p, 5, f"m-{p}") for p in ("a", "b", "c")])
        unique = [e.rank for e in (await client.top(name, rank_mode="unique")).entries]
        assert unique == [1, 2, 3]
        mode = "competition"
        assert [e.rank for e in (await client.top(name, rank_mode=mode)).entries] == [1, 1, 1]
        assert [e.rank for e in (await client.entries(name, 1, 2, rank_mode=mode)).entries] == [1, 1]
        assert [e.rank async for e in client.iter_entries(name, rank_mode=mode)] == [1, 1, 1]
        assert (await client.player(name, "c", rank_mode=mode)).rank == 1
        assert [e.rank for e in await client.around(name, "c", 1, rank_mode=mode)] == [1, 1]
        assert [e.rank for e in await client.query(name, ["a", "c"], rank_mode=mode)] == [1, 1]
        await client.delete_board(name)


@pytest.mark.cluster
async def test_a_buffer_holds_at_most_max_pending_results(router: Served) -> None:
    """While the router refuses every write, results piled up in a lane without bound (a client
    audit's finding: 19,990 held by one lane). Past ``max_pending`` unsettled results a ``post``
    waits for room; every result still goes through once the router takes writes again."""
    name = board_name("contract")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        router.faults.refuse = 1.0
        try:
            buffer = ScoreBuffer(client, max_scores=10, max_delay_ms=1, max_in_flight=1, max_pending=50)
            posts = [
                asyncio.create_task(buffer.post(name, MatchResult(f"p{i}", 1, f"m{i}"))) for i in range(400)
            ]
            await asyncio.sleep(0.5)
            held = sum(len(lane.waiting) for lane in buffer._lanes.values())
            assert held <= 50, held
        finally:
            router.faults.calm()
        await buffer.close()
        done = await asyncio.gather(*posts, return_exceptions=True)
        assert all(isinstance(d, ScoreOutcome) for d in done), {type(d).__name__ for d in done}
        assert (await client.get_board(name)).players == {"total": 400}
        await client.delete_board(name)


@pytest.mark.cluster
async def test_a_cancelled_caller_keeps_its_room_until_its_result_is_answered(router: Served) -> None:
    """A cancelled caller's result is still sent, so it still holds room: before, cancelling gave
    the room back at once and the buffer held more than ``max_pending`` (a client audit's finding)."""
    name = board_name("contract")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        router.faults.refuse = 1.0
        try:
            buffer = ScoreBuffer(client, max_scores=10, max_delay_ms=1, max_in_flight=1, max_pending=20)
            first = [
                asyncio.create_task(buffer.post(name, MatchResult(f"p{i}", 1, f"m{i}"))) for i in range(20)
            ]
            await asyncio.sleep(0.2)
            for caller in first:
                caller.cancel()
            await asyncio.gather(*first, return_exceptions=True)
            later = [
                asyncio.create_task(buffer.post(name, MatchResult(f"q{i}", 1, f"n{i}"))) for i in range(20)
            ]
            await asyncio.sleep(0.3)
            held = sum(len(lane.waiting) for lane in buffer._lanes.values())
            assert held <= 20 - 10, held  # one request of 10 is out, retrying
        finally:
            router.faults.calm()
        await buffer.close()
        done = await asyncio.gather(*later, return_exceptions=True)
        assert all(isinstance(d, ScoreOutcome) for d in done), {type(d).__name__ for d in done}
        assert (await client.get_board(name)).players == {"total": 40}
        await client.delete_board(name)


@pytest.mark.cluster
async def test_ids_of_dots_name_themselves_not_a_parent_path(router: Served) -> None:
    """api.md allows ``.`` and ``..`` as ids, but a path segment of dots is a relative step that
    httpx resolves: ``player(b, "..")`` asked for ``/v1/boards/b`` and failed parsing the board (a
    client audit's finding)."""
    name = board_name("contract")
    dots = [".", "..", "..."]
    async with AsyncClient(router.url, ADMIN) as client:
        await client.put_board(name)
        await client.post_scores(name, [MatchResult(p, 10 + i, f"m{i}") for i, p in enumerate(dots)])
        for i, player in enumerate(dots):
            found = await client.player(name, player)
            assert (found.player_id, found.points, found.rank) == (player, 10 + i, 3 - i)
            assert player in [e.player_id for e in await client.around(name, player, 1)]
        await client.delete_board(name)
        for board in dots[:2]:
            info = await client.put_board(board, sharding={"shards": 2})
            assert info.id == board
            await client.post_scores(board, [MatchResult("p", 5, "m")])
            assert [e.player_id for e in (await client.top(board)).entries] == ["p"]
            assert (await client.get_board(board)).players == {"total": 1}
            await client.delete_board(board)


@pytest.mark.cluster
async def test_a_cancelled_close_leaves_the_requests_to_their_callers(router: Served) -> None:
    """``close()`` waited for the requests with ``gather``, which cancels them when it is cancelled
    itself (``wait_for(buffer.close(), t)`` running out): every caller of a request in flight got
    CancelledError although nobody cancelled it, and its result was abandoned mid-retry (a client
    audit's finding). The requests go on; a later ``close()`` waits for them."""
    name = board_name("contract")
    async with AsyncClient(router.url, ADMIN, backoff=FAST) as client:
        await client.put_board(name)
        router.faults.refuse = 1.0
        try:
            buffer = ScoreBuffer(client, max_scores=10, max_delay_ms=1)
            posts = [
                asyncio.create_task(buffer.post(name, MatchResult(f"p{i}", 1, f"m{i}"))) for i in range(20)
            ]
            await asyncio.sleep(0.1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(buffer.close(), 0.1)
        finally:
            router.faults.calm()
        done = await asyncio.gather(*posts, return_exceptions=True)
        assert all(isinstance(d, ScoreOutcome) for d in done), {type(d).__name__ for d in done}
        await buffer.close()
        assert (await client.get_board(name)).players == {"total": 20}
        await client.delete_board(name)


async def test_a_query_that_fails_in_one_part_stops_the_others() -> None:
    """A friends list past 1000 ids goes as requests at once; when one failed for good, ``gather``
    raised its error and left the others running, retrying in the background until their deadline
    with the call long over (a client audit's finding). They are cancelled with the call."""
    stopped: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        ids = orjson.loads(request.content)["player_ids"]
        if "p0" in ids:
            body = {"error": {"code": "invalid_input", "message": "bad id", "field": "player_ids[0]"}}
            return httpx.Response(422, json=body)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            stopped.append(ids[0])
            raise
        return httpx.Response(200, json={"entries": []})

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", format="json", backoff=FAST, transport=transport) as client:
        with pytest.raises(InvalidRequest):
            await client.query("b", [f"p{i}" for i in range(2500)], deadline=20)
        await asyncio.sleep(0.05)
        assert sorted(stopped) == ["p1000", "p2000"]


@pytest.mark.parametrize(
    ("headers", "content"),
    [
        ({"content-encoding": "gzip"}, b"not gzip at all"),
        ({"content-type": "text/html"}, b"<html>portal</html>"),
    ],
    ids=["bad-encoding", "not-the-api"],
)
async def test_an_answer_the_client_cannot_read_is_a_client_error(
    headers: dict[str, str], content: bytes
) -> None:
    """Every failure is a ``ClientError``, as the errors' docs say: an answer whose encoding httpx
    could not undo escaped as ``httpx.DecodingError``, and a 2xx that is not the API's (a portal's
    page) as a ``TypeError`` from parsing it (a client audit's finding)."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(content))

    transport = httpx.MockTransport(handler)
    async with AsyncClient("http://r.test", format="json", backoff=FAST, transport=transport) as client:
        with pytest.raises(TransportError):
            await client.top("b", deadline=0.3)


@pytest.mark.cluster
@pytest.mark.parametrize("format", ["msgpack", "json"])
async def test_board_settings_take_a_datetime_in_both_formats(router: Served, format: str) -> None:
    """``put_board(epoch=datetime(...))`` worked in JSON (orjson writes RFC 3339) and raised a bare
    TypeError in MessagePack, the default format (a client audit's finding)."""
    name = board_name("contract")
    epoch = datetime(2026, 9, 1, tzinfo=UTC)
    async with AsyncClient(router.url, ADMIN, format=format) as client:
        info = await client.put_board(name, epoch=epoch)
        assert datetime.fromisoformat(info.settings["epoch"]) == epoch
        assert (await client.put_board(name, epoch="2026-09-01T00:00:00Z")).created is False
        await client.delete_board(name)


def _pages(request: httpx.Request) -> httpx.Response:
    """Pages of a board that never ends: ``iter_entries`` always has another page to ask for."""
    offset, limit = int(request.url.params["offset"]), int(request.url.params["limit"])
    rows = [
        {"rank": r + 1, "player_id": f"p{r}", "points": 10**6 - r, "achieved_at": "2026-11-30T05:00:00Z"}
        for r in range(offset, offset + limit)
    ]
    page = {"board": "b", "period": "total", "entries": rows, "as_of": "2026-11-30T05:00:00Z"}
    return httpx.Response(200, json=page)


def test_a_closed_blocking_client_closes_its_iterations_quietly_and_fails_as_a_client_error() -> None:
    """After ``Client.close()``, closing an unfinished ``iter_entries`` raised the portal's
    RuntimeError ("This portal is not running"), and so did every later call: every failure of the
    client is a ``ClientError``. Closing what is left over is quiet; a call is a ``ClientClosed``."""
    from shardlb.client import Client, ClientClosed, ClientError

    client = Client("http://r.test", format="json", transport=httpx.MockTransport(_pages))
    walked, left = client.iter_entries("b", page_size=2), client.iter_entries("b", page_size=2)
    assert next(walked).rank == 1 and next(left).rank == 1
    buffer = client.buffer()
    client.close()
    walked.close()
    with pytest.raises(ClientClosed):
        for _ in range(3):  # the first page's second row, then a page it must ask for
            next(left)
    left.close()
    for call in (lambda: client.top("b"), lambda: buffer.post("b", MatchResult("p", 1, "m"))):
        with pytest.raises(ClientError, match="closed"):
            call()


async def test_a_closed_async_client_fails_as_a_client_error() -> None:
    """After ``aclose()`` a call raised httpx's RuntimeError ("the client has been closed"), outside
    ``ClientError``; an unfinished ``iter_entries`` failed so at its next page."""
    from shardlb.client import ClientClosed

    client = AsyncClient("http://r.test", format="json", transport=httpx.MockTransport(_pages))
    walked, left = client.iter_entries("b", page_size=2), client.iter_entries("b", page_size=2)
    assert (await anext(walked)).rank == 1 and (await anext(left)).rank == 1
    await client.aclose()
    await walked.aclose()
    with pytest.raises(ClientClosed):
        for _ in range(3):
            await anext(left)
    await left.aclose()
    with pytest.raises(ClientClosed):
        await client.top("b")


@pytest.mark.cluster
async def test_a_request_over_the_routers_body_cap_goes_again_in_smaller_ones(cluster: Any) -> None:
    """A router whose ``SHARDLB_MAX_BODY_BYTES`` is below a batch's size answered every large
    request 413, nothing of it read: ``post_scores`` raised it, and a ``ScoreBuffer`` failed every
    caller of every full batch, for good. The results now go again in requests half the size."""
    async with served_router(cluster.url, max_body_bytes=4096) as served:
        name = board_name("cap")
        async with AsyncClient(served.url, ADMIN, format="json", backoff=FAST) as client:
            await client.put_board(name, mode="incr")
            direct = [MatchResult(f"player-{i:04d}", 1, f"match-{i:06d}") for i in range(300)]
            outcomes = await client.post_scores(name, direct)
            assert [(o.player_id, o.status) for o in outcomes] == [(r.player_id, "improved") for r in direct]
            async with ScoreBuffer(client, max_scores=200, max_delay_ms=50) as buffer:
                again = [MatchResult(f"player-{i:04d}", 2, f"again-{i:06d}") for i in range(200)]
                done = await asyncio.gather(*(buffer.post(name, r) for r in again))
            assert [(o.player_id, o.points) for o in done] == [(f"player-{i:04d}", 3) for i in range(200)]
            assert (await client.get_board(name)).players == {"total": 300}


class _Statuses(httpx.AsyncHTTPTransport):
    """The network transport, keeping each answer's status and each request's number of scores."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        sent = len(orjson.loads(request.content).get("scores", [])) if request.content else 0
        self.seen.append((response.status_code, sent))
        return response


@pytest.mark.cluster
async def test_the_client_remembers_the_batch_size_a_413_taught_it(cluster: Any) -> None:
    """After a 413 the client split the request, but the next call started again at 1000 scores a
    request: every call of a ScoreBuffer's full batches paid a refused request first. The size that
    went through is kept for the client's later calls; the results of both calls apply once each,
    with their own match ids."""
    async with served_router(cluster.url, max_body_bytes=4096) as served:
        name = board_name("cap")
        transport = _Statuses()
        async with AsyncClient(served.url, ADMIN, format="json", backoff=FAST, transport=transport) as client:
            await client.put_board(name, mode="incr")
            first = [MatchResult(f"player-{i:04d}", 1, f"match-{i:06d}") for i in range(300)]
            assert {o.status for o in await client.post_scores(name, first)} == {"improved"}
            refused = [sent for status, sent in transport.seen if status == 413]
            assert refused and all(sent > 1 for sent in refused)
            transport.seen.clear()
            second = [MatchResult(f"player-{i:04d}", 2, f"later-{i:06d}") for i in range(300)]
            assert [o.points for o in await client.post_scores(name, second)] == [3] * 300
            assert {status for status, _ in transport.seen} == {200}  # no request refused again
            assert sum(sent for _, sent in transport.seen) == 300
            assert (await client.get_board(name)).players == {"total": 300}


async def test_a_cancelled_callers_result_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A cancelled caller's result is still sent; when its request then failed, nobody heard of
    it: the error went to a future no one awaited. It is logged, naming the result."""

    def refuse(request: httpx.Request) -> httpx.Response:
        error = {"code": "board_closed", "message": "closed", "field": None}
        return httpx.Response(409, json={"error": error})

    transport = httpx.MockTransport(refuse)
    client = AsyncClient("http://r.test", "k", format="json", transport=transport)
    async with client, ScoreBuffer(client, max_delay_ms=20) as buffer:
        post = asyncio.ensure_future(buffer.post("b", MatchResult("alice", 5, "match-77")))
        await asyncio.sleep(0)
        post.cancel()
    assert post.cancelled()
    logged = [r for r in caplog.records if r.name == "shardlb.client"]
    assert len(logged) == 1 and "alice" in logged[0].getMessage() and "match-77" in logged[0].getMessage()
    assert "board_closed" in logged[0].getMessage()


class _SplitServer:
    """A router of a small body cap (413 past ``cap`` scores) that refuses any request naming
    ``refused`` with ``status``/``code`` (422 naming that score's field), and applies the rest,
    counting how many times each result was sent in a request it answered 200."""

    def __init__(self, cap: int, refused: str, status: int, code: str) -> None:
        self.cap, self.refused, self.status, self.code = cap, refused, status, code
        self.applied: Counter[str] = Counter()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        scores = orjson.loads(request.content)["scores"]
        if len(scores) > self.cap:
            error = {"code": "body_too_large", "message": "too large", "field": None}
            return httpx.Response(413, json={"error": error})
        players = [s["player_id"] for s in scores]
        if self.refused in players:
            field = f"scores[{players.index(self.refused)}].points" if self.status == 422 else None
            error = {"code": self.code, "message": "no", "field": field}
            return httpx.Response(self.status, json={"error": error})
        self.applied.update(players)
        results = [{**s, "status": "improved"} for s in scores]
        return httpx.Response(200, json={"results": results})


@pytest.mark.parametrize("status,code", [(409, "board_closed"), (422, "out_of_range")])
async def test_a_buffered_batch_split_by_a_413_answers_the_results_applied_before_a_refusal(
    status: int, code: str
) -> None:
    """A batch the client split after a 413 (it keeps the smaller size since 2026-12-05) went as
    several requests; when a later one was refused, every caller of the batch got the error, also
    those whose results an earlier request had applied (the error's ``applied``): they were told
    their results failed, and a refused value made the buffer send the applied ones again. Each
    caller whose result was applied now gets its outcome, and no result is sent twice."""
    server = _SplitServer(cap=2, refused="late", status=status, code=code)
    transport = httpx.MockTransport(server)
    client = AsyncClient("http://r.test", "k", format="json", backoff=FAST, transport=transport)
    async with client, ScoreBuffer(client, max_scores=4, max_delay_ms=20) as buffer:
        players = ["a", "b", "late", "d"]
        done = await asyncio.gather(
            *(buffer.post("b", MatchResult(p, 5, f"m-{p}")) for p in players), return_exceptions=True
        )
    assert [o.status for o in done[:2] if isinstance(o, ScoreOutcome)] == ["improved", "improved"], done
    assert isinstance(done[2], ApiError) and done[2].status == status
    if status == 422:  # the refused value fails its own caller only; the others are applied once
        assert isinstance(done[3], ScoreOutcome)
        assert server.applied == Counter({"a": 1, "b": 1, "d": 1})
    else:  # the request that carried it was refused whole
        assert isinstance(done[3], ApiError) and done[3].status == status
        assert server.applied == Counter({"a": 1, "b": 1})
