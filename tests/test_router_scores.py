"""The write endpoint's short way in (router/scores.py, RouterApp): the same answers, headers, metrics
and logs as a Starlette route, and the Starlette route still answering what the short way leaves."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import orjson
import pytest

from router.app import RouterApp
from router.scores import parse_scores
from shardlb.board import Score
from shardlb.errors import InvalidInput
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def app_client(cluster: Any) -> AsyncIterator[tuple[RouterApp, httpx.AsyncClient]]:
    async with running(cluster.url) as (app, client):
        assert isinstance(app, RouterApp)
        yield app, client


@pytest.fixture(scope="module")
async def board(app_client: tuple[RouterApp, httpx.AsyncClient]) -> str:
    name = board_name("fast")
    r = await app_client[1].put(f"/v1/boards/{name}", json={"sharding": {"shards": 4}}, headers=AS_ADMIN)
    assert r.status_code == 201
    return name


def _scores(*players: str) -> dict[str, Any]:
    items = [{"player_id": p, "points": 10 + i, "match_id": f"m-{p}"} for i, p in enumerate(players)]
    return {"scores": items}


async def test_json_and_msgpack_answers_with_their_headers(
    app_client: tuple[RouterApp, httpx.AsyncClient], board: str
) -> None:
    _, client = app_client
    r = await client.post(f"/v1/boards/{board}/scores", json=_scores("a", "b"), headers=AS_WRITER)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    assert [x["status"] for x in r.json()["results"]] == ["improved", "improved"]
    packed = await client.post(
        f"/v1/boards/{board}/scores",
        content=msgpack.packb(_scores("a", "c")),
        headers={
            **AS_WRITER,
            "Content-Type": "application/msgpack",
            "Accept": "application/msgpack",
            "X-Request-Id": "mine-1",
        },
    )
    assert packed.status_code == 200 and packed.headers["content-type"] == "application/msgpack"
    assert packed.headers["x-request-id"] == "mine-1"
    body = msgpack.unpackb(packed.content)
    assert [(x["player_id"], x["status"], x["points"]) for x in body["results"]] == [
        ("a", "unchanged", 10),
        ("c", "improved", 11),
    ]


async def test_errors_keep_their_bodies_and_headers(
    app_client: tuple[RouterApp, httpx.AsyncClient], board: str
) -> None:
    _, client = app_client
    url = f"/v1/boards/{board}/scores"
    unauthorized = await client.post(url, json=_scores("z"))
    assert unauthorized.status_code == 401 and unauthorized.headers["www-authenticate"].startswith("Bearer")
    assert unauthorized.json()["error"]["code"] == "unauthorized"
    wrong_type = await client.post(url, content=b"x", headers={**AS_WRITER, "Content-Type": "text/plain"})
    assert wrong_type.status_code == 415
    bad = await client.post(url, content=orjson.dumps({"scores": [{"player_id": "a\n"}]}), headers=AS_WRITER)
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "scores[0].points"
    bad_id = await client.post(url, json=_scores("a\n"), headers=AS_WRITER)
    assert bad_id.status_code == 422 and bad_id.json()["error"] == {
        "code": "invalid_id",
        "message": "ids are 1-64 characters of A-Z a-z 0-9 _ - . :",
        "field": "scores[0].player_id",
    }
    for r in (unauthorized, wrong_type, bad, bad_id):
        assert len(r.headers["x-request-id"]) == 32
    assert len({r.headers["x-request-id"] for r in (unauthorized, wrong_type, bad, bad_id)}) == 4


async def test_other_methods_on_the_path_are_starlettes_405(
    app_client: tuple[RouterApp, httpx.AsyncClient], board: str
) -> None:
    _, client = app_client
    r = await client.get(f"/v1/boards/{board}/scores")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
    slash = await client.post(f"/v1/boards/{board}/scores/", json=_scores("q"), headers=AS_WRITER)
    assert slash.status_code == 404


async def test_a_failure_inside_is_a_logged_500_not_a_dropped_connection(
    app_client: tuple[RouterApp, httpx.AsyncClient],
    board: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, client = app_client
    coalescer = service_of(app).coalescer

    async def broken(*_: Any) -> Any:
        raise RuntimeError("a bug in the router")

    monkeypatch.setattr(coalescer, "submit", broken)
    logger = logging.getLogger("shardlb")  # where the router's JSON handler is (router/logs.py)
    logger.addHandler(caplog.handler)
    try:
        r = await client.post(
            f"/v1/boards/{board}/scores", json=_scores("x"), headers={**AS_WRITER, "X-Request-Id": "boom-1"}
        )
    finally:
        logger.removeHandler(caplog.handler)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    failed = [x for x in caplog.records if getattr(x, "fields", {}).get("request_id") == "boom-1"]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert "a bug in the router" in str(failed[0].exc_info[1])


async def test_a_root_path_takes_starlettes_route_with_the_same_result(cluster: Any) -> None:
    async with running(cluster.url) as (app, _):
        transport = httpx.ASGITransport(app=app, root_path="/lb")
        async with httpx.AsyncClient(transport=transport, base_url="http://router.test") as client:
            name = board_name("rooted")
            assert (await client.put(f"/lb/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
            r = await client.post(f"/lb/v1/boards/{name}/scores", json=_scores("r"), headers=AS_WRITER)
            assert r.status_code == 200 and r.json()["results"][0]["status"] == "improved"
            assert len(r.headers["x-request-id"]) == 32


@pytest.mark.parametrize(
    ("item", "field", "code"),
    [
        # Three keys, one of them unknown: the unknown one is named, as with any other count of keys.
        ({"player_id": "p", "points": 1, "bonus": 1}, "scores[0].bonus", "unknown_field"),
        ({"player_id": "p", "points": 1, "match_id": "m", "bonus": 1}, "scores[0].bonus", "unknown_field"),
        # The three required keys, one of them null: missing, not taken for the usual score.
        ({"player_id": "p", "points": None, "match_id": "m"}, "scores[0].points", "missing_field"),
        ({"player_id": None, "points": 1, "match_id": "m"}, "scores[0].player_id", "missing_field"),
        ({"player_id": "p", "points": 1}, "scores[0].match_id", "missing_field"),
    ],
)
def test_parse_scores_names_the_first_fault_of_a_score(item: dict[str, Any], field: str, code: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_scores({"scores": [item]})
    assert (e.value.field, e.value.code) == (field, code)


def test_parse_scores_keeps_what_a_score_sends() -> None:
    usual = {"player_id": "p", "points": 5.0, "match_id": "m"}
    timed = {**usual, "achieved_at": "2026-12-06T00:00:00Z", "region": "eu"}
    assert parse_scores({"scores": [usual, timed]}) == [
        Score("p", 5, "m"),
        Score("p", 5, "m", 1_796_515_200_000, "eu"),
    ]


@pytest.mark.parametrize(
    ("body", "field", "hint"),
    [
        ({"score": []}, "score", "'scores'"),
        (
            {"scores": [{"player": "p", "points": 1, "match_id": "m"}]},
            "scores[0].player",
            "'player_id'",
        ),
        (
            {"scores": [{"player_id": "p", "point": 1, "match_id": "m"}]},
            "scores[0].point",
            "'points'",
        ),
        ({"scores": [], "zzzz": 1}, "zzzz", None),  # nothing close: no guess
        ({"s" * 5000: 1}, "s" * 5000, None),  # a long name is not compared
    ],
)
def test_an_unknown_field_close_to_a_known_one_is_named_in_the_message(
    body: dict[str, Any], field: str, hint: str | None
) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_scores(body)
    assert (e.value.field, e.value.code) == (field, "unknown_field")
    if hint is None:
        assert "did you mean" not in e.value.message
    else:
        assert e.value.message == f"unknown field {field.rsplit('.', 1)[-1]!r} (did you mean {hint}?)"
