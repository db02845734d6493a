"""/openapi.json against the server: what the document calls valid, the router accepts, and the rest
it refuses. Each value is judged by the served document (jsonschema) and by the router on the suite's
cluster, and the two verdicts must agree; then schemathesis runs every check it has on every operation
(on a cluster of its own: see ``server``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest
from jsonschema import Draft202012Validator

from router.openapi import SPEC
from shardlb import times
from shardlb.cluster import LocalCluster
from shardlb.errors import InvalidInput
from shardlb.moderation import REASON_MAX, check_reason
from tests.ports import node_ports
from tests.router_support import ADMIN, AS_ADMIN, AS_READER, AS_WRITER, board_name, running
from tests.test_router_server import ROOT, Server

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url) as (_, c):
        yield c


@pytest.fixture(scope="module")
async def document(client: httpx.AsyncClient) -> dict[str, Any]:
    served: dict[str, Any] = (await client.get("/openapi.json")).json()
    return served


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The router schemathesis runs against, on a cluster of its own. Its stateful phase follows the
    board list to every board the cluster holds: on the suite's cluster it wrote to, resharded and
    deleted the boards the worker's modules before this one had left, so what it met (and checked)
    depended on which modules those were."""
    local = LocalCluster(masters=3, replicas=1, port=node_ports(6), dir=tmp_path_factory.mktemp("cluster"))
    local.up()
    try:
        running_server = Server(local.url, tmp_path_factory.mktemp("router") / "router.log")
        yield running_server
        assert running_server.stop() == 0
    finally:
        local.down()


def valid(document: dict[str, Any], schema: dict[str, Any], value: object) -> bool:
    """Whether ``value`` is valid against ``schema``, whose $refs point into the served document."""
    return Draft202012Validator({**document, **schema}).is_valid(value)


def parameter(document: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = document["components"]["parameters"][name]["schema"]
    return found


async def test_period_schema_is_what_the_server_takes(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    name = board_name()
    every = {"periods": ["total", "daily", "weekly", "monthly"]}
    assert (await client.put(f"/v1/boards/{name}", json=every, headers=AS_ADMIN)).status_code == 201
    schema = parameter(document, "period")
    for period in [
        "total", "daily", "weekly", "monthly", "daily:2026-11-30", "weekly:2026-W48", "monthly:2026-11",
        "m", "", "total:", "daily:", "Daily", "daily:2026-11-30 ", "weekly:2026-w48", "monthly:2026-11-01",
        "weekly:٢٠٢٦-W48", "daily:2026-13-01", "weekly:2026-W00", "yearly", "total:2026",
    ]:  # fmt: skip
        r = await client.get(f"/v1/boards/{name}/top", params={"period": period})
        assert r.status_code in (200, 422), r.text
        assert valid(document, schema, period) == (r.status_code == 200), (period, r.text)


async def test_achieved_at_schema_is_the_range_the_server_takes(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    """Judged by the parser every time value goes through (a board adds its own epoch and clock)."""
    schema = document["components"]["schemas"]["Score"]["properties"]["achieved_at"]
    for value in [
        "1970-01-01T00:00:00Z", "2026-11-30T05:00:00.5+02:00", "9999-12-31T23:59:59.999Z", 0,
        times.END_MS - 1, "0194-11-30T05:00:00Z", "1969-12-31T23:59:59Z", "10000-01-01T00:00:00Z",
        "2026-11-30T05:00Z", "20261130T050000Z", "2026-11-30 05:00:00Z", -1, times.END_MS,
    ]:  # fmt: skip
        try:
            times.parse(value, "achieved_at")
            accepted = True
        except InvalidInput:
            accepted = False
        assert valid(document, schema, value) == accepted, value


async def test_board_settings_schema_names_no_other_board(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    """A body naming another board than the path is refused, so the PUT schema must not offer one."""
    name = board_name()
    body = {"board": "another-board"}
    schema = document["paths"]["/v1/boards/{board}"]["put"]["requestBody"]["content"]["application/json"]
    r = await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
    assert r.status_code == 422 and r.json()["error"]["code"] == "board_mismatch"
    assert not valid(document, schema["schema"], body)
    assert valid(document, schema["schema"], {"mode": "incr"})


async def test_region_schema_is_what_the_server_takes(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    name = board_name()
    assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
    schema = parameter(document, "region")
    in_score = document["components"]["schemas"]["Score"]["properties"]["region"]
    for region in ["eu", "r" * 64, "r" * 65, "", "e u", "é"]:
        read = await client.get(f"/v1/boards/{name}/top", params={"region": region})
        assert read.status_code == (200 if valid(document, schema, region) else 422)
        # a score's region is ignored on a board without regions, whatever it holds (api.md)
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m", "region": region}]}
        write = await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        assert write.status_code == 200 and valid(document, in_score, region)


async def test_score_id_lengths_in_the_schema_are_what_the_server_takes(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    name = board_name()
    assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
    schema = document["components"]["schemas"]["Score"]
    for player, match in [("p", "m" * 128), ("p", "m" * 129), ("p", ""), ("p" * 64, "m"), ("p" * 65, "m")]:
        score = {"player_id": player, "points": 1, "match_id": match}
        r = await client.post(f"/v1/boards/{name}/scores", json={"scores": [score]}, headers=AS_WRITER)
        assert r.status_code == (200 if valid(document, schema, score) else 422), (len(player), len(match))


async def test_a_moderation_reason_schema_is_what_the_server_takes(document: dict[str, Any]) -> None:
    """A ban's (or unban's) reason and a removal's ``reason`` parameter, judged by the parser both
    go through: it refuses NUL (PostgreSQL's text cannot hold it), which the schemas allowed."""
    ban = document["components"]["schemas"]["BanRequest"]["oneOf"]
    [removal] = document["paths"]["/v1/boards/{board}/players/{player}"]["delete"]["parameters"]
    for value in ["why", "", "r" * REASON_MAX, "r" * (REASON_MAX + 1), "a\x00b", "\x00", None]:
        try:
            check_reason(value, required=False)
            accepted = True
        except InvalidInput:
            accepted = False
        for scope in ban:
            body = {"scope": scope["properties"]["scope"]["const"], "board": "b", "reason": value}
            if body["scope"] == "all":
                body["board"] = None
            assert valid(document, scope, body) == accepted, (body, accepted)
        if value is not None:  # a query parameter is a string or absent
            assert valid(document, removal["schema"], value) == accepted, (value, accepted)


async def test_the_awards_cursor_schema_is_what_the_server_takes(
    cluster: LocalCluster, postgres_url: str
) -> None:
    """``after`` is checked before the settlement is looked up: 422 invalid_cursor for a value the
    server refuses, 404 settlement_not_found (no such settlement) for one it takes. The schema
    allowed any string."""
    async with running(cluster.url, postgres_url=postgres_url) as (_, c):
        document = (await c.get("/openapi.json")).json()
        [after, _] = document["paths"]["/v1/settlements/{settlement}/awards"]["get"]["parameters"]
        for value in ["0", "17", "9" * 12, "9" * 13, "", "x", "-1", "1.5", "٣", " 5"]:
            r = await c.get(
                f"/v1/settlements/{board_name()}/awards", params={"after": value}, headers=AS_WRITER
            )
            assert r.status_code in (404, 422), r.text
            assert valid(document, after["schema"], value) == (r.status_code == 404), (value, r.text)


def test_schemathesis_with_every_check(server: Server, tmp_path: Path) -> None:
    """schemathesis run --checks all on the served document, all phases (coverage, fuzzing, stateful),
    with an admin key so every operation gets past auth; deterministic (no seed, no example database),
    one worker, 20 examples per operation. Its three narrowed checks are in tests/openapi_hooks.py: a
    schema-valid request may still be 422 for what only the named board or the clock decides, and an
    action's path is also a board's for GET, PUT and DELETE (and so in a 405's Allow there)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.openapi_hooks"}
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "schemathesis"),
            "run",
            f"{server.url}/openapi.json",
            "--checks=all",
            "--exclude-checks=positive_data_acceptance,unsupported_method,allow_header_conformance",
            f"--header=Authorization: Bearer {ADMIN}",
            "--max-examples=20",
            "--generation-deterministic",
            "--workers=1",
            "--request-timeout=10",
            "--no-color",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-20_000:] + done.stderr[-5_000:]


async def test_a_band_boards_settings_and_placement_are_what_the_schema_says(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    """A band board is created spread unless told; its GET (placement included) is valid against
    the served schema; an unknown placement is refused by both."""
    name = board_name()
    body = {"sharding": {"strategy": "band", "bands": [0, 100, 1000], "shards": 3}}
    assert (await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
    got = (await client.get(f"/v1/boards/{name}")).json()
    assert got["sharding"] == {**body["sharding"], "placement": "spread"}
    schemas = document["components"]["schemas"]
    assert valid(document, {"$ref": "#/components/schemas/BoardWithPlayers"}, got)
    settings = {"sharding": got["sharding"]}  # sent back as listed: the same board
    again = await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)
    assert again.status_code == 200, again.text
    window = {"sharding": {**body["sharding"], "placement": "window"}}
    assert valid(document, schemas["BoardSettings"], window)
    bad = {"sharding": {**body["sharding"], "placement": "anywhere"}}
    r = await client.put(f"/v1/boards/{board_name()}", json=bad, headers=AS_ADMIN)
    assert r.status_code == 422 and r.json()["error"]["field"] == "sharding.placement"
    assert not valid(document, schemas["BoardSettings"], bad)


def _needed_scope(security: list[dict[str, list[str]]]) -> str | None:
    """The key scope an operation's security says it needs: None for no key, "read" for a read that
    is open unless the server requires read keys."""
    if not security:
        return None
    named = {scope for requirement in security for scope in requirement.get("bearer", [])}
    assert len(named) == 1, security  # one scope, named, on every keyed operation
    return named.pop()


async def test_each_operations_security_names_the_scope_the_router_asks_for(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    """Every operation is called without a key and with a read and a write key: a key of a smaller
    scope than the one the document names is 403 (none: 401), and one of that scope gets past the
    key check. Admin keys are not sent: they pass every check, and would act."""
    name = board_name()
    assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
    keys = {None: {}, "read": AS_READER, "write": AS_WRITER}
    order = [None, "read", "write", "admin"]
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            needed = _needed_scope(operation["security"])
            url = (
                path.replace("{board}", name)
                .replace("{player}", "p")
                .replace("{settlement}", "s")
                .replace("{period}", "daily:2026-11-30")
                .replace("{asset}", "app.js")
            )
            for scope, headers in keys.items():
                body = {} if method in ("post", "put") else None
                r = await client.request(method.upper(), url, headers=headers, json=body)
                enough = needed in (None, "read") or order.index(scope) >= order.index(needed)
                refused = 401 if scope is None else 403
                assert (r.status_code not in (401, 403)) == enough, (method, path, scope, needed, r.text)
                assert enough or r.status_code == refused, (method, path, scope, r.text)


def _declared_headers(document: dict[str, Any], path: str, method: str, status: int) -> set[str]:
    """The headers the document declares on one response, lower case."""
    response = document["paths"][path][method]["responses"][str(status)]
    if "$ref" in response:
        response = document["components"]["responses"][response["$ref"].rsplit("/", 1)[1]]
    return {name.lower() for name in response.get("headers", {})}


async def test_the_headers_the_router_sends_are_in_the_document(
    client: httpx.AsyncClient, document: dict[str, Any]
) -> None:
    """Each response's headers that a client may act on (its request id, caching, auth challenge,
    retry) are declared on that operation's response of that status."""
    name = board_name()
    watched = {"x-request-id", "etag", "cache-control", "vary", "retry-after", "www-authenticate", "allow"}
    board, top = "/v1/boards/{board}", "/v1/boards/{board}/top"
    as_text = {**AS_ADMIN, "content-type": "text/plain"}
    calls: list[tuple[str, str, httpx.Response]] = [
        (board, "put", await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)),
        (board, "put", await client.put(f"/v1/boards/{name}")),
        (board, "put", await client.put(f"/v1/boards/{name}", headers=AS_WRITER)),
        (board, "put", await client.put(f"/v1/boards/{name}", content=b"{}", headers=as_text)),
        (board, "get", await client.get(f"/v1/boards/{name}")),
        (top, "get", await client.get(f"/v1/boards/{name}/top")),
        (top, "get", await client.get(f"/v1/boards/{name}/top?limit=0")),
        (top, "get", await client.get(f"/v1/boards/{name}/top?lmit=1")),
        (top, "get", await client.get(f"/v1/boards/{board_name()}/top")),
        ("/healthz", "get", await client.get("/healthz")),
        ("/readyz", "get", await client.get("/readyz")),
        ("/metrics", "get", await client.get("/metrics")),
        ("/openapi.json", "get", await client.get("/openapi.json")),
    ]
    tag = calls[5][2].headers["etag"]
    calls.append((top, "get", await client.get(f"/v1/boards/{name}/top", headers={"If-None-Match": tag})))
    calls.append((board, "delete", await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)))
    assert [r.status_code for _, _, r in calls] == [
        201, 401, 403, 415, 200, 200, 422, 400, 404, 200, 200, 200, 200, 304, 204
    ]  # fmt: skip
    for path, method, r in calls:
        sent = watched & {h.lower() for h in r.headers}
        assert "x-request-id" in sent
        assert sent <= _declared_headers(document, path, method, r.status_code), (path, method, r.status_code)


async def test_the_document_is_rendered_once_per_media_type(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The document does not change while the app runs: each media type is rendered at its first
    request and its bytes sent again after (until 2026-12-06 every request rendered 94 KB, 0.35 ms
    as MessagePack, for anybody, without a key or a limit). The renderings are counted, and what is
    sent is what rendering it anew gives, with the same headers (no ETag)."""
    dumps, packb = orjson.dumps, msgpack.packb
    renderings = {"json": 0, "msgpack": 0}

    def counted(kind: str, original: Any) -> Any:
        def render(data: Any, *args: Any, **kwargs: Any) -> Any:
            renderings[kind] += data is SPEC
            return original(data, *args, **kwargs)

        return render

    monkeypatch.setattr(orjson, "dumps", counted("json", dumps))
    monkeypatch.setattr(msgpack, "packb", counted("msgpack", packb))
    packed = {"Accept": "application/msgpack"}
    async with running(cluster.url) as (_, c):
        answers = [await c.get("/openapi.json", headers=headers) for headers in ({}, packed) * 3]
    assert renderings == {"json": 1, "msgpack": 1}  # before: 3 each
    monkeypatch.undo()
    expected = {"application/json": dumps(SPEC), "application/msgpack": packb(SPEC, use_bin_type=True)}
    for r in answers:
        assert r.status_code == 200
        assert r.content == expected[r.headers["content-type"]]
        assert int(r.headers["content-length"]) == len(r.content)
        assert "etag" not in r.headers and "cache-control" not in r.headers
    assert [r.headers["content-type"] for r in answers] == list(expected) * 3
