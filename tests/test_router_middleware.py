"""router/middleware.py: the bound on requests at once, and the error body it sends itself when
nothing else answered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
from starlette.types import Receive, Scope, Send

from router import metrics, middleware
from router.middleware import LOGGED_PATH_CHARS, Observe, RefusedLines
from shardlb.cluster import LocalCluster
from shardlb.errors import ClusterUnavailable
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of


@pytest.mark.cluster
async def test_a_last_resort_500_is_in_the_format_the_client_asked_for(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug under a Starlette route escapes every handler; the middleware answers it, in MessagePack
    when Accept asks for it (api.md: the response format follows Accept), with its length."""
    async with running(cluster.url) as (app, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201

        async def broken(*_: Any) -> Any:
            raise RuntimeError("a bug in the router")

        monkeypatch.setattr(service_of(app).tops, "top", broken)
        packed = await client.get(f"/v1/boards/{name}/top", headers={"Accept": "application/msgpack"})
        assert packed.status_code == 500 and packed.headers["content-type"] == "application/msgpack"
        assert msgpack.unpackb(packed.content)["error"]["code"] == "internal_error"
        assert int(packed.headers["content-length"]) == len(packed.content)
        assert packed.headers["x-request-id"]
        plain = await client.get(f"/v1/boards/{name}/top")
        assert plain.status_code == 500 and plain.headers["content-type"] == "application/json"
        assert plain.json()["error"]["code"] == "internal_error"
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_requests_past_the_concurrency_limit_get_503(cluster: LocalCluster) -> None:
    async with running(cluster.url, max_requests=2) as (_, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        release = asyncio.Event()
        started = asyncio.Semaphore(0)

        async def slow_body() -> AsyncIterator[bytes]:
            started.release()
            await release.wait()
            yield b'{"player_ids": []}'

        held = [
            asyncio.create_task(client.post(f"/v1/boards/{name}/players:query", content=slow_body()))
            for _ in range(2)
        ]
        for _ in held:
            await asyncio.wait_for(started.acquire(), 10)
        refused = await client.get(f"/v1/boards/{name}/top")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 1
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        write = await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        assert write.status_code == 503  # writes count too: the bound is on the whole worker
        assert (await client.get("/healthz")).status_code == 200  # probes are never refused
        assert (await client.get("/readyz")).status_code == 200
        release.set()
        assert [(await task).status_code for task in held] == [200, 200]
        assert (await client.get(f"/v1/boards/{name}/top")).status_code == 200
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


def test_body_slots_are_counted_per_ipv6_network_not_per_address() -> None:
    """One subscriber's IPv6 /64 holds more addresses than a worker has slots: counted per address,
    one client could take them all with a body each. IPv4 addresses stay apart."""
    from router.middleware import body_client

    same = body_client("2001:db8:1:2::1")
    assert same == body_client("2001:db8:1:2:ffff::9") != body_client("2001:db8:1:3::1")
    assert body_client("10.0.0.1") != body_client("10.0.0.2")
    assert body_client("not an address") == "not an address"


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"no"})


def _methods_seen() -> set[str]:
    return {
        sample.labels["method"]
        for family in metrics.REQUEST_SECONDS.collect()
        for sample in family.samples
        if sample.name.endswith("_count")
    }


async def test_a_method_outside_the_usual_seven_is_counted_as_other() -> None:
    """llhttp parses 34 methods: each one a series of its own would let anyone without a key add
    thousands of series (methods times routes times buckets) to every scrape."""
    transport = httpx.ASGITransport(app=Observe(_not_found))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        for method in ("PROPFIND", "MKCALENDAR", "PURGE", "M-SEARCH", "GET", "PATCH"):
            assert (await client.request(method, "/v1/boards/b/top")).status_code == 404
    seen = _methods_seen()
    assert {"other", "GET", "PATCH"} <= seen
    assert seen <= {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "other"}


async def test_a_long_path_is_cut_in_the_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """A 60 KB path refused 404 is one log line of a few hundred bytes, not 60 KB: its first
    LOGGED_PATH_CHARS characters, as router/http.py logs a request it refuses itself."""
    path = "/v1/boards/" + "a" * 60_000
    transport = httpx.ASGITransport(app=Observe(_not_found))
    with caplog.at_level("DEBUG", logger="shardlb.router"):  # a line a minute at info (RefusedLines)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            assert (await client.get(path, headers={"X-Request-Id": "long-path"})).status_code == 404
    [line] = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == "long-path"]
    assert line.fields["path"] == path[:LOGGED_PATH_CHARS]  # type: ignore[attr-defined]
    assert LOGGED_PATH_CHARS == 200


async def _no_cluster(scope: Scope, receive: Receive, send: Send) -> None:
    raise ClusterUnavailable("no cluster at redis://***@db:7000: Connection refused")


def _logged(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shardlb.router" and r.levelno == level]


@pytest.mark.cluster
async def test_client_errors_are_not_one_log_line_each(
    cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Anybody may send tens of thousands of requests a second that are refused (a path that is no
    route, a board that does not exist, a wrong key, a body that is no JSON, a bad id): a line each
    at the default level was some 10 MB of log a second per worker. They are counted
    (shardlb_http_responses_total); the log holds one line of them a minute at most."""
    async with running(cluster.url) as (_, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        logger = logging.getLogger("shardlb")  # where the router's JSON handler is (router/logs.py)
        logger.addHandler(caplog.handler)
        try:
            for i in range(60):
                scores = f"/v1/boards/{name}/scores"
                answers = [
                    await client.get(f"/v1/nothing/{i}"),
                    await client.get(f"/v1/boards/no-{i}/top"),
                    await client.get(f"/v1/boards/{name}/players/bad%20id"),
                    await client.post(scores, headers={"Authorization": "Bearer x"}),
                    await client.post(scores, content=b"{", headers=AS_WRITER),
                ]
                assert all(400 <= a.status_code < 500 for a in answers), answers
        finally:
            logger.removeHandler(caplog.handler)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert len([r for r in caplog.records if r.levelno >= logging.INFO]) <= 1, caplog.text


async def test_503s_are_not_one_log_line_each(caplog: pytest.LogCaptureFixture) -> None:
    """A cluster out of reach (or a worker past SHARDLB_MAX_REQUESTS) refuses every request: a
    warning each was a line per request, as many a second as came in, while the outage lasted."""
    transport = httpx.ASGITransport(app=Observe(_no_cluster))
    with caplog.at_level("INFO", logger="shardlb.router"):
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            for _ in range(300):
                assert (await client.get("/v1/boards/b/top")).status_code == 503
    assert len(_logged(caplog, logging.WARNING)) <= 1


async def test_refusals_are_logged_at_once_then_once_a_minute_with_their_counts(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first refusal is a line at once; the next line, a minute later, counts every refusal
    since the one before by code; the others are debug lines. 503s have a line of their own: a
    flood of 404s does not hide the start of an outage."""
    now = [0.0]
    monkeypatch.setattr(middleware, "_client_errors", RefusedLines(logging.INFO, clock=lambda: now[0]))
    monkeypatch.setattr(middleware, "_unavailable", RefusedLines(logging.WARNING, clock=lambda: now[0]))
    with caplog.at_level("DEBUG", logger="shardlb.router"):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=Observe(_not_found)), base_url="http://router"
        ) as client:
            for second in range(100):
                now[0] = float(second)
                assert (await client.get(f"/v1/x/{second}")).status_code == 404
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=Observe(_no_cluster)), base_url="http://router"
        ) as client:
            assert (await client.get("/v1/boards/b/top")).status_code == 503
    lines = [(r.levelno, r.fields) for r in caplog.records if r.name == "shardlb.router"]  # type: ignore[attr-defined]
    assert len(lines) == 101  # each refusal once, at one level or the other
    info = [fields for level, fields in lines if level == logging.INFO]
    assert [(f["path"], f["refused"], f["codes"]) for f in info] == [
        ("/v1/x/0", 1, {"404": 1}),
        ("/v1/x/60", 60, {"404": 60}),  # 1 to 60
    ]
    [(level, fields)] = [(level, f) for level, f in lines if f["status"] == 503]
    assert level == logging.WARNING and fields["code"] == "cluster_unavailable"
    assert fields["refused"] == 1 and "Connection refused" in fields["cause"]
