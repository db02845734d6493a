"""Every endpoint of api.md and every error code, through the router app on the suite's cluster."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import httpx
import msgpack
import orjson
import pytest
from prometheus_client import REGISTRY

from router.logs import JsonFormatter
from shardlb import periods, times
from shardlb.cluster import LocalCluster
from shardlb.config import AUTO_SHARDS, BoardConfig
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster

T0 = 1_790_000_000_000  # 2026-09-21T14:13:20Z: every achieved time below is fixed, so answers are exact
MSGPACK = "application/msgpack"


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url, top_refresh_s=0.2, histogram_samples=8, histogram_refresh_s=0.2) as (
        _,
        c,
    ):
        yield c


async def make_board(client: httpx.AsyncClient, body: dict[str, Any] | None = None) -> str:
    name = board_name()
    r = await client.put(f"/v1/boards/{name}", json=body or {}, headers=AS_ADMIN)
    assert r.status_code == 201, r.text
    return name


async def post(client: httpx.AsyncClient, board: str, scores: list[dict[str, Any]]) -> list[dict[str, Any]]:
    r = await client.post(f"/v1/boards/{board}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert r.status_code == 200, r.text
    results: list[dict[str, Any]] = r.json()["results"]
    return results


def score(player: str, points: int, match: str, at: int = T0, **extra: Any) -> dict[str, Any]:
    return {"player_id": player, "points": points, "match_id": match, "achieved_at": at, **extra}


def assert_error(r: httpx.Response, status: int, code: str, field: str | None = None) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "field"}
    assert body["error"]["code"] == code
    assert body["error"]["field"] == field
    assert body["error"]["message"]


def allowed(r: httpx.Response) -> set[str]:
    """The methods a 405's Allow header names."""
    return {method.strip() for method in r.headers["allow"].split(",")}


# ---- boards --------------------------------------------------------------------------------------


async def test_board_lifecycle(client: httpx.AsyncClient) -> None:
    name = board_name()
    settings = {"mode": "incr", "periods": ["total", "weekly"], "sharding": {"strategy": "hash", "shards": 4}}
    created = await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)
    assert created.status_code == 201
    assert created.json()["mode"] == "incr" and created.json()["periods"] == ["total", "weekly"]
    again = await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)
    assert again.status_code == 200 and again.json() == created.json()
    conflict = await client.put(f"/v1/boards/{name}", json={"mode": "best"}, headers=AS_ADMIN)
    assert_error(conflict, 409, "board_conflict", "board")

    listed = await client.get("/v1/boards")
    assert listed.status_code == 200
    assert created.json() in listed.json()["boards"]
    await post(client, name, [score("a", 5, "m1"), score("b", 7, "m2")])
    got = await client.get(f"/v1/boards/{name}")
    assert got.status_code == 200
    body = got.json()
    assert set(body.pop("resets_at")) == {"weekly"}  # its value: tests/test_router_lifecycle.py
    # weekly 0: T0 is not this week
    assert body == {**created.json(), "players": {"total": 2, "weekly": 0}, "closed": False}

    deleted = await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert deleted.status_code == 204 and deleted.content == b""
    assert_error(await client.get(f"/v1/boards/{name}"), 404, "board_not_found", "board")
    assert_error(await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN), 404, "board_not_found", "board")


async def test_a_retention_of_a_period_not_kept_is_refused_unless_it_confirms_a_board(
    cluster: LocalCluster,
) -> None:
    """`retention_days` naming a period the board does not keep was dropped without a word (201, a
    board made without it, until 2026-12-06): it is 422 naming it now. A board created that way
    before (the key stored nowhere) still answers 200 to the same PUT, which game servers send at
    every start."""
    stray = {"periods": ["total", "weekly"], "retention_days": {"daily": 3, "weekly": 35}}
    async with running(cluster.url) as (app, client):
        name = board_name()
        assert_error(
            await client.put(f"/v1/boards/{name}", json=stray, headers=AS_ADMIN),
            422,
            "invalid_input",
            "retention_days.daily",
        )
        assert_error(await client.get(f"/v1/boards/{name}"), 404, "board_not_found", "board")

        old = board_name()  # made of these settings as the PUT made it before
        config = BoardConfig.from_dict(old, stray, default_shards=AUTO_SHARDS)
        await service_of(app).boards.store.create(config)
        again = await client.put(f"/v1/boards/{old}", json=stray, headers=AS_ADMIN)
        assert again.status_code == 200, again.text
        assert again.json()["retention_days"] == {"weekly": 35}
        kept_only = {**stray, "retention_days": {"weekly": 35}}
        assert (await client.put(f"/v1/boards/{old}", json=kept_only, headers=AS_ADMIN)).status_code == 200
        # Settings that confirm no board: the key is the fault named, not the board's settings.
        assert_error(
            await client.put(f"/v1/boards/{old}", json={**stray, "mode": "incr"}, headers=AS_ADMIN),
            422,
            "invalid_input",
            "retention_days.daily",
        )
        assert (await client.delete(f"/v1/boards/{old}", headers=AS_ADMIN)).status_code == 204


async def test_put_without_body_takes_the_defaults(client: httpx.AsyncClient, cluster: LocalCluster) -> None:
    name = board_name()
    r = await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert r.status_code == 201
    # One shard per master (tests/test_default_shards.py).
    assert r.json()["mode"] == "best" and r.json()["sharding"] == {
        "strategy": "hash",
        "shards": cluster.masters,
    }
    await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


# ---- scores and reads --------------------------------------------------------------------------


async def test_scores_and_every_read(client: httpx.AsyncClient) -> None:
    name = await make_board(client, {"periods": ["total", "daily"]})
    # Today's midnight (UTC): dated periods of long past days would already have expired.
    day = times.now_ms() // 86_400_000 * 86_400_000
    today = times.format_ms(day)
    results = await post(
        client,
        name,
        [
            score("p1", 100, "m1", day),
            score("p2", 300, "m1", day),
            score("p3", 200, "m1", day),
            score("p1", 50, "m2", day),  # lower: best keeps 100
            score("p4", 300, "m2", day + 1000),  # ties p2 on points, later: ranks after p2
        ],
    )
    assert [(r["player_id"], r["status"], r["points"]) for r in results] == [
        ("p1", "improved", 100),
        ("p2", "improved", 300),
        ("p3", "improved", 200),
        ("p1", "unchanged", 100),
        ("p4", "improved", 300),
    ]
    assert all(r["match_id"] in ("m1", "m2") for r in results)
    replay = await post(client, name, [score("p1", 100, "m1", day)])
    assert replay[0]["status"] == "unchanged"

    order = ["p2", "p4", "p3", "p1"]
    top = (await client.get(f"/v1/boards/{name}/top", params={"limit": 3})).json()
    assert top["board"] == name and top["period"] == "total"
    assert [(e["rank"], e["player_id"]) for e in top["entries"]] == [(1, "p2"), (2, "p4"), (3, "p3")]
    assert top["entries"][0] == {"rank": 1, "player_id": "p2", "points": 300, "achieved_at": today}

    page = (await client.get(f"/v1/boards/{name}/entries", params={"offset": 1, "limit": 2})).json()
    assert [(e["rank"], e["player_id"]) for e in page["entries"]] == [(2, "p4"), (3, "p3")]
    assert (await client.get(f"/v1/boards/{name}/entries", params={"offset": 10})).json()["entries"] == []

    me = (await client.get(f"/v1/boards/{name}/players/p3")).json()
    assert me == {
        "player_id": "p3",
        "rank": 3,
        "points": 200,
        "achieved_at": today,
        "players": 4,
        "percentile": 25.0,
        "resets_at": None,  # the total never ends
    }

    around = (await client.get(f"/v1/boards/{name}/players/p4/around", params={"radius": 1})).json()
    assert [(e["rank"], e["player_id"]) for e in around["entries"]] == [(1, "p2"), (2, "p4"), (3, "p3")]
    alone = (await client.get(f"/v1/boards/{name}/players/p4/around", params={"radius": 0})).json()
    assert [e["player_id"] for e in alone["entries"]] == ["p4"]

    friends = await client.post(
        f"/v1/boards/{name}/players:query", json={"player_ids": ["p1", "nobody", "p4"]}
    )
    assert friends.status_code == 200
    assert [(e["rank"], e["player_id"], e["points"]) for e in friends.json()["entries"]] == [
        (2, "p4", 300),
        (4, "p1", 100),
    ]

    daily = (await client.get(f"/v1/boards/{name}/top", params={"period": f"daily:{today[:10]}"})).json()
    assert daily["period"] == f"daily:{today[:10]}"
    assert [e["player_id"] for e in daily["entries"]] == order
    current = (await client.get(f"/v1/boards/{name}/top", params={"period": "daily"})).json()
    assert current["period"].startswith("daily:") and len(current["entries"]) == (
        4 if current["period"] == daily["period"] else 0
    )
    assert_error(
        await client.get(f"/v1/boards/{name}/players/p1", params={"period": "daily:2020-01-01"}),
        404,
        "player_not_found",
        "player",
    )
    assert_error(await client.get(f"/v1/boards/{name}/players/zz/around"), 404, "player_not_found", "player")


async def test_region_board(client: httpx.AsyncClient) -> None:
    name = await make_board(
        client, {"sharding": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2}}
    )
    await post(
        client,
        name,
        [
            score("e1", 10, "m", region="eu"),
            score("n1", 20, "m", region="na"),
            score("e2", 30, "m", region="eu"),
        ],
    )
    world = (await client.get(f"/v1/boards/{name}/top")).json()["entries"]
    assert [e["player_id"] for e in world] == ["e2", "n1", "e1"]
    eu = (await client.get(f"/v1/boards/{name}/top", params={"region": "eu"})).json()["entries"]
    assert [(e["rank"], e["player_id"]) for e in eu] == [(1, "e2"), (2, "e1")]
    me = (await client.get(f"/v1/boards/{name}/players/e1", params={"region": "eu"})).json()
    assert me["rank"] == 2 and me["players"] == 2
    assert (await client.get(f"/v1/boards/{name}/players/e1")).json()["rank"] == 3
    assert_error(
        await client.get(f"/v1/boards/{name}/top", params={"region": "mars"}), 422, "invalid_region", "region"
    )
    # A region left out (or null, read as absent) is missing, as a match_id left out is: until
    # 2026-12-06 it was `invalid_region`, as if one had been sent.
    for extra, code in [
        ({}, "missing_field"),
        ({"region": None}, "missing_field"),
        *(({"region": region}, "invalid_region") for region in ("", "mars", "r" * 65, 7, ["eu"])),
    ]:
        r = await client.post(
            f"/v1/boards/{name}/scores",
            headers=AS_WRITER,
            json={"scores": [score("e3", 40, "m2", region="eu"), score("x", 1, "m", **extra)]},
        )
        assert_error(r, 422, code, "scores[1].region")
        assert ("required" in r.json()["error"]["message"]) == (code == "missing_field"), r.text
    after = (await client.get(f"/v1/boards/{name}/top")).json()["entries"]
    assert "e3" not in {e["player_id"] for e in after}  # a refused request writes nothing


async def test_incr_duplicates_and_overflow(client: httpx.AsyncClient) -> None:
    name = await make_board(client, {"mode": "incr", "points_max": 1000})
    first = await post(client, name, [score("a", 600, "m1"), score("a", 300, "m2"), score("a", 300, "m1")])
    assert [(r["status"], r["points"]) for r in first] == [
        ("improved", 600),
        ("improved", 900),
        ("duplicate", 900),
    ]
    over = await post(client, name, [score("a", 200, "m3"), score("b", 5, "m3")])
    assert [(r["status"], r["points"]) for r in over] == [("overflow", 900), ("improved", 5)]


async def test_top_is_cached_and_refreshed(client: httpx.AsyncClient) -> None:
    name = await make_board(client)
    await post(client, name, [score("a", 10, "m")])
    first = (await client.get(f"/v1/boards/{name}/top")).json()
    await post(client, name, [score("b", 20, "m")])
    cached = (await client.get(f"/v1/boards/{name}/top")).json()
    if cached["as_of"] == first["as_of"]:  # served from RAM: the new leader is not in it yet
        assert [e["player_id"] for e in cached["entries"]] == ["a"]
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # the refresh task re-reads the view every 0.2 s here
        fresh = (await client.get(f"/v1/boards/{name}/top")).json()
        if len(fresh["entries"]) == 2 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert [e["player_id"] for e in fresh["entries"]] == ["b", "a"]
    assert datetime.fromisoformat(fresh["as_of"]) > datetime.fromisoformat(first["as_of"])
    wide = (await client.get(f"/v1/boards/{name}/top", params={"limit": 1000})).json()
    assert [e["player_id"] for e in wide["entries"]] == ["b", "a"]


async def test_a_cached_top_has_an_etag_and_answers_304_until_it_changes(client: httpx.AsyncClient) -> None:
    """A top is rendered once per refresh of the cache; its ETag names that rendering, so a client
    sending it back gets 304 with no body until the top is refreshed, and then the new body. Each
    format and rank mode is its own rendering."""
    name = await make_board(client)
    await post(client, name, [score("a", 10, "m"), score("b", 10, "m")])
    first = await client.get(f"/v1/boards/{name}/top")
    tag = first.headers["etag"]
    assert first.status_code == 200 and first.headers["cache-control"] == "max-age=1"
    packed = await client.get(f"/v1/boards/{name}/top", headers={"Accept": MSGPACK})
    ranked = await client.get(f"/v1/boards/{name}/top", params={"rank_mode": "competition"})
    assert msgpack.unpackb(packed.content) == first.json()
    assert [e["rank"] for e in ranked.json()["entries"]] == [1, 1]
    assert len({tag, packed.headers["etag"], ranked.headers["etag"]}) == 3
    same = await client.get(f"/v1/boards/{name}/top", headers={"If-None-Match": f'W/"x", {tag}'})
    if same.headers["etag"] == tag:  # not refreshed in between
        assert same.status_code == 304 and same.content == b""
    await post(client, name, [score("c", 30, "m")])
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        fresh = await client.get(f"/v1/boards/{name}/top", headers={"If-None-Match": tag})
        if fresh.status_code == 200 and len(fresh.json()["entries"]) == 3:
            break
        assert fresh.status_code in (200, 304)
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    assert fresh.headers["etag"] != tag
    assert [e["player_id"] for e in fresh.json()["entries"]] == ["c", "b", "a"]


async def test_the_direct_reads_answer_errors_as_every_route_does(client: httpx.AsyncClient) -> None:
    """The top and "my rank" skip Starlette's router (router/app.py, Direct); their errors still
    leave as api.md's bodies, in the format asked for, with a request id, and HEAD still works."""
    name = await make_board(client)
    await post(client, name, [score("a", 10, "m")])
    assert_error(await client.get("/v1/boards/nobody-here/top"), 404, "board_not_found", "board")
    assert_error(await client.get(f"/v1/boards/{name}/players/zed"), 404, "player_not_found", "player")
    assert_error(
        await client.get(f"/v1/boards/{name}/top", params={"limit": 0}), 422, "invalid_parameter", "limit"
    )
    assert_error(await client.get(f"/v1/boards/{name}/top", params={"x": 1}), 400, "unknown_parameter", "x")
    r = await client.get(f"/v1/boards/{name}/players/zed", headers={"Accept": MSGPACK})
    assert r.status_code == 404 and msgpack.unpackb(r.content)["error"]["code"] == "player_not_found"
    assert r.headers["x-request-id"]
    head = await client.head(f"/v1/boards/{name}/top")
    assert head.status_code == 200 and head.content == b""
    assert (await client.get(f"/v1/boards/{name}/players/a")).json()["rank"] == 1


async def test_spellings_of_one_view_share_its_cache_entries(client: httpx.AsyncClient) -> None:
    """``weekly`` and ``weekly:<this week>``, with or without a region on a board that has none, are
    one view: after the first read, the others hit the top cache and the histograms' one entry."""
    name = await make_board(client, {"periods": ["total", "weekly"]})
    now = times.now_ms()
    await post(client, name, [score("a", 10, "m", now)])
    week = periods.api_name(periods.names_at(now, ("weekly",), periods.zone("UTC"))[0])

    def hits(cache: str) -> float:
        found = REGISTRY.get_sample_value("shardlb_cache_requests_total", {"cache": cache, "result": "hit"})
        return found or 0.0

    spellings = [{"period": week}, {"period": week, "region": "eu"}, {"period": "weekly", "region": "eu"}]
    for cache, path, extra in (("top", "top", {}), ("histogram", "players/a", {"estimate": "true"})):
        first = await client.get(f"/v1/boards/{name}/{path}", params={"period": "weekly", **extra})
        assert first.status_code == 200, first.text
        before = hits(cache)
        for spelling in spellings:
            again = await client.get(f"/v1/boards/{name}/{path}", params={**spelling, **extra})
            assert again.status_code == 200, again.text
            assert again.json().get("period", week) == week  # top names its period; a player, none
        assert hits(cache) == before + len(spellings), cache


async def test_estimated_rank_is_within_its_stated_error(client: httpx.AsyncClient) -> None:
    name = await make_board(client, {"sharding": {"strategy": "hash", "shards": 4}})
    players = 1200
    for start in range(0, players, 1000):
        await post(
            client,
            name,
            [
                score(f"p{i}", (i * 7919) % 5000, "m", T0 + i * 1000)
                for i in range(start, min(players, start + 1000))
            ],
        )
    errors = []
    for i in range(0, players, 97):
        exact = (await client.get(f"/v1/boards/{name}/players/p{i}")).json()
        guess = (await client.get(f"/v1/boards/{name}/players/p{i}", params={"estimate": "true"})).json()
        assert guess["players"] == exact["players"] == players
        assert guess["points"] == exact["points"] and guess["achieved_at"] == exact["achieved_at"]
        assert abs(guess["rank"] - exact["rank"]) <= guess["rank_error"]
        assert guess["percentile"] == pytest.approx(100 * (players - guess["rank"]) / players)
        errors.append(guess["rank_error"])
    # 4 shards of ~300 players sampled at 9 ranks each: a bucket holds ~38 players; the interval is at
    # most one bucket per shard wide, so the stated error is about N / (2 * 8), twice that at worst.
    assert 0 < max(errors) <= players // 8
    assert_error(
        await client.get(f"/v1/boards/{name}/players/nobody", params={"estimate": "true"}),
        404,
        "player_not_found",
        "player",
    )
    assert_error(
        await client.get(f"/v1/boards/{name}/players/p1", params={"estimate": "maybe"}),
        422,
        "invalid_parameter",
        "estimate",
    )


# ---- formats ---------------------------------------------------------------------------------------


async def test_json_and_msgpack_give_the_same_answers(client: httpx.AsyncClient) -> None:
    twins = [await make_board(client), await make_board(client)]
    batch = [score(f"p{i}", i * 10 % 70, f"m{i}", T0 + i) for i in range(20)]
    as_json = await client.post(f"/v1/boards/{twins[0]}/scores", headers=AS_WRITER, json={"scores": batch})
    as_msgpack = await client.post(
        f"/v1/boards/{twins[1]}/scores",
        content=msgpack.packb({"scores": batch}),
        headers={**AS_WRITER, "Content-Type": MSGPACK, "Accept": MSGPACK},
    )
    assert as_msgpack.headers["content-type"] == MSGPACK
    assert msgpack.unpackb(as_msgpack.content) == as_json.json()

    for path, params in [
        ("top", {"limit": 5}),
        ("entries", {"offset": 3, "limit": 4}),
        ("players/p3", {}),
        ("players/p3/around", {"radius": 2}),
        ("", {}),
    ]:
        answers = []
        for board in twins:
            url = f"/v1/boards/{board}/{path}".rstrip("/")
            j = await client.get(url, params=params)
            m = await client.get(url, params=params, headers={"Accept": MSGPACK})
            assert j.status_code == m.status_code == 200
            assert j.headers["content-type"] == "application/json" and m.headers["content-type"] == MSGPACK
            decoded, parsed = msgpack.unpackb(m.content), j.json()
            for body in (parsed, decoded):
                body.pop("as_of", None)
                body.pop("board", None)
            assert decoded == parsed
            answers.append(decoded)
        assert answers[0] == answers[1]
    query = {"player_ids": ["p1", "p2", "p9"]}
    j = await client.post(f"/v1/boards/{twins[0]}/players:query", json=query)
    m = await client.post(
        f"/v1/boards/{twins[0]}/players:query",
        content=msgpack.packb(query),
        headers={"Content-Type": MSGPACK, "Accept": f"application/json;q=0.5, {MSGPACK}"},
    )
    assert msgpack.unpackb(m.content) == j.json()
    bad = await client.post(
        f"/v1/boards/{twins[0]}/scores",
        headers={**AS_WRITER, "Content-Type": MSGPACK, "Accept": MSGPACK},
        content=msgpack.packb({"scores": [score("x", -1, "m")]}),
    )
    assert bad.status_code == 422
    assert msgpack.unpackb(bad.content)["error"]["field"] == "scores[0].points"


# ---- errors ----------------------------------------------------------------------------------------


async def test_validation_errors_write_nothing(client: httpx.AsyncClient) -> None:
    name = await make_board(client, {"points_max": 1000})
    url = f"/v1/boards/{name}/scores"

    async def bad(body: Any, field: str | None, code: str) -> None:
        assert_error(await client.post(url, json=body, headers=AS_WRITER), 422, code, field)

    good = score("fine", 10, "m")
    await bad({"scores": [good, score("x", 1001, "m")]}, "scores[1].points", "out_of_range")
    await bad({"scores": [good, score("x", -1, "m")]}, "scores[1].points", "out_of_range")
    await bad({"scores": [good, score("x", 1.5, "m")]}, "scores[1].points", "out_of_range")
    await bad({"scores": [good, {"player_id": "x", "points": 1}]}, "scores[1].match_id", "missing_field")
    await bad({"scores": [good, score("bad id!", 1, "m")]}, "scores[1].player_id", "invalid_id")
    await bad({"scores": [good, score("x", 1, "m" * 129)]}, "scores[1].match_id", "invalid_match_id")
    await bad({"scores": [good, score("x", 1, "m", "yesterday")]}, "scores[1].achieved_at", "invalid_time")
    await bad({"scores": [good, score("x", 1, "m", 10)]}, "scores[1].achieved_at", "out_of_range")
    await bad({"scores": [good, {**score("x", 1, "m"), "bonus": 1}]}, "scores[1].bonus", "unknown_field")
    await bad({"scores": [good] * 1001}, "scores", "too_many")
    await bad({"scores": {"player_id": "x"}}, "scores", "invalid_input")
    await bad({"scores": [good], "extra": 1}, "extra", "unknown_field")
    await bad([good], None, "invalid_body")
    assert_error(await client.get(f"/v1/boards/{name}/players/fine"), 404, "player_not_found", "player")
    assert (await client.get(f"/v1/boards/{name}")).json()["players"] == {"total": 0}

    ok = await client.post(url, json={"scores": [good] * 1000}, headers=AS_WRITER)
    assert ok.status_code == 200 and len(ok.json()["results"]) == 1000
    empty = await client.post(url, json={"scores": []}, headers=AS_WRITER)
    assert empty.status_code == 200 and empty.json() == {"results": []}


async def test_board_settings_that_cannot_be_stored_are_422(client: httpx.AsyncClient) -> None:
    """An epoch in year 1 with a positive offset is year 0 in UTC: parsed, but not writable back
    (schemathesis found it as a 500)."""
    body = {"epoch": "0001-01-01T00:00:00+02:00"}
    r = await client.put(f"/v1/boards/{board_name()}", json=body, headers=AS_ADMIN)
    assert_error(r, 422, "invalid_time", "epoch")


async def test_query_and_parameter_errors(client: httpx.AsyncClient) -> None:
    name = await make_board(client)
    base = f"/v1/boards/{name}"
    for path, params, field in [
        ("top", {"limit": 0}, "limit"),
        ("top", {"limit": 1001}, "limit"),
        ("top", {"limit": "ten"}, "limit"),
        ("entries", {"offset": -1}, "offset"),
        ("players/p/around", {"radius": 101}, "radius"),
    ]:
        assert_error(await client.get(f"{base}/{path}", params=params), 422, "invalid_parameter", field)
    for period in ("yearly", "weekly", "daily:2026-13-01", "total:2026"):
        assert_error(
            await client.get(f"{base}/top", params={"period": period}), 422, "invalid_period", "period"
        )
    assert_error(await client.get(f"{base}/players/{'x' * 65}"), 422, "invalid_id", "player")
    assert_error(await client.get(f"/v1/boards/{'b' * 65}/top"), 422, "invalid_id", "board")
    query = f"{base}/players:query"
    assert_error(await client.post(query, json={"player_ids": ["a"] * 1001}), 422, "too_many", "player_ids")
    assert_error(
        await client.post(query, json={"player_ids": ["ok", "no way"]}), 422, "invalid_id", "player_ids[1]"
    )
    assert_error(await client.post(query, json={"player_ids": "a"}), 422, "invalid_input", "player_ids")
    assert_error(
        await client.post(query, json={"player_ids": [], "period": 7}), 422, "invalid_period", "period"
    )
    assert (await client.post(query, json={"player_ids": ["a"] * 1000})).json()["entries"] == []


async def test_a_body_that_repeats_a_key_is_400_and_writes_nothing(client: httpx.AsyncClient) -> None:
    """Before, the last of a repeated key won: 200 and 2,000,000 points, a "best" board where a
    proxy reading the first key saw "incr" (an API audit's finding)."""
    name = await make_board(client)
    body = b'{"scores": [{"player_id": "p", "points": 5, "points": 2000000, "match_id": "m"}]}'
    r = await client.post(
        f"/v1/boards/{name}/scores", content=body, headers={**AS_WRITER, "Content-Type": "application/json"}
    )
    assert_error(r, 400, "malformed_body")
    assert_error(await client.get(f"/v1/boards/{name}/players/p"), 404, "player_not_found", "player")
    other = board_name()
    r = await client.put(
        f"/v1/boards/{other}",
        content=b'{"mode": "incr", "mode": "best"}',
        headers={**AS_ADMIN, "Content-Type": "application/json"},
    )
    assert_error(r, 400, "malformed_body")
    assert_error(await client.get(f"/v1/boards/{other}"), 404, "board_not_found", "board")


async def test_status_codes(client: httpx.AsyncClient) -> None:
    name = await make_board(client)
    url = f"/v1/boards/{name}/scores"
    assert_error(
        await client.post(
            url, content=b'{"scores": [', headers={**AS_WRITER, "Content-Type": "application/json"}
        ),
        400,
        "malformed_body",
    )
    assert_error(
        await client.post(url, content=b"\xc1", headers={**AS_WRITER, "Content-Type": MSGPACK}),
        400,
        "malformed_body",
    )
    assert_error(
        await client.post(url, content=b"{}", headers={**AS_WRITER, "Content-Type": "text/csv"}),
        415,
        "unsupported_media_type",
    )
    assert_error(
        await client.put(
            f"/v1/boards/{board_name()}",
            content=b"x=1",
            headers={**AS_ADMIN, "Content-Type": "application/x-www-form-urlencoded"},
        ),
        415,
        "unsupported_media_type",
    )
    assert_error(await client.get("/v1/nothing"), 404, "not_found")
    assert_error(await client.get(f"/v1/boards/{name}/top/"), 404, "not_found")
    assert_error(await client.get("/v1/boards/no-such-board/top"), 404, "board_not_found", "board")
    assert_error(
        await client.post("/v1/boards/no-such-board/scores", json={"scores": []}, headers=AS_WRITER),
        404,
        "board_not_found",
        "board",
    )
    r = await client.patch(f"/v1/boards/{name}")
    assert_error(r, 405, "method_not_allowed")
    assert allowed(r) == {"GET", "HEAD", "PUT", "DELETE"}
    for method, path, allow in [
        ("DELETE", f"/v1/boards/{name}/top", {"GET", "HEAD"}),
        ("PUT", f"/v1/boards/{name}/players/p", {"GET", "HEAD", "DELETE"}),
        ("GET", f"/v1/boards/{name}/scores", {"POST"}),
        ("PATCH", "/v1/bans", {"GET", "HEAD"}),
        ("POST", "/healthz", {"GET", "HEAD"}),
    ]:
        r = await client.request(method, path, headers=AS_ADMIN)
        assert_error(r, 405, "method_not_allowed")
        assert allowed(r) == allow and method in r.json()["error"]["message"], (path, r.headers, r.text)
    # Ids may hold ':' (api.md), so "<board>:rebuild" and "<board>:archive" are boards of their own
    # to PUT, GET and DELETE; only a POST there is the action on <board>.
    for action in (":rebuild", ":archive"):
        other = f"{name}{action}"
        made = await client.put(f"/v1/boards/{other}", json={"mode": "incr"}, headers=AS_ADMIN)
        assert made.status_code == 201, made.text
        assert (await client.get(f"/v1/boards/{other}")).json()["board"] == other
        wrote = await client.post(
            f"/v1/boards/{other}/scores",
            json={"scores": [{"player_id": "p", "points": 3, "match_id": "m"}]},
            headers=AS_WRITER,
        )
        assert wrote.json()["results"][0]["points"] == 3
        assert (await client.get(f"/v1/boards/{other}/players/p")).json()["points"] == 3
        assert (await client.get(f"/v1/boards/{name}/players/p")).status_code == 404
        assert (await client.delete(f"/v1/boards/{other}", headers=AS_ADMIN)).status_code == 204
        assert_error(await client.get(f"/v1/boards/{other}"), 404, "board_not_found", "board")
    # Allow names every method the path takes: an action's POST and the board's own (until
    # 2026-12-06 only POST, the action's route being the first that matched).
    for action in (":rebuild", ":archive"):
        r = await client.patch(f"/v1/boards/{name}{action}", headers=AS_ADMIN)
        assert_error(r, 405, "method_not_allowed")
        assert allowed(r) == {"POST", "GET", "HEAD", "PUT", "DELETE"}, r.headers
    assert_error(
        await client.put(f"/v1/boards/{name}", json={"board": "other"}, headers=AS_ADMIN),
        422,
        "board_mismatch",
        "board",
    )
    assert_error(
        await client.put(f"/v1/boards/{board_name()}", json={"mode": "max"}, headers=AS_ADMIN),
        422,
        "invalid_input",
        "mode",
    )


async def test_body_cap_is_413(client: httpx.AsyncClient) -> None:
    name = await make_board(client)
    url = f"/v1/boards/{name}/scores"
    huge = orjson.dumps({"scores": [score("p", 1, "m" * 100)] * 9000})
    assert len(huge) > 1024 * 1024
    assert_error(
        await client.post(url, content=huge, headers={**AS_WRITER, "Content-Type": "application/json"}),
        413,
        "body_too_large",
    )

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the cap applies while streaming
        for i in range(0, len(huge), 65536):
            yield huge[i : i + 65536]

    streamed = await client.post(
        url, content=chunks(), headers={**AS_WRITER, "Content-Type": "application/json"}
    )
    assert_error(streamed, 413, "body_too_large")
    assert (await client.get(f"/v1/boards/{name}")).json()["players"]["total"] == 0


# ---- service endpoints -----------------------------------------------------------------------------


async def test_service_endpoints(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    ready = await client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    journal = {"board", "entries", "seconds", "bound", "results", "results_bound"}
    assert set(ready.json()["journal"]) == journal
    spec = (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.") and "/v1/boards/{board}/players:query" in spec["paths"]
    name = await make_board(client)
    await post(client, name, [score("a", 1, "m")])
    await client.get(f"/v1/boards/{name}/top")
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for needle in (
        'shardlb_http_request_duration_seconds_bucket{le="0.005",method="GET",route="/v1/boards/{board}/top"}',
        'shardlb_http_responses_total{route="/v1/boards/{board}/scores",status="200"}',
        'shardlb_scores_applied_total{status="improved"}',
        "shardlb_coalescer_batch_size_count",
        "shardlb_coalescer_queue_depth",
        'shardlb_redis_call_duration_seconds_count{op="apply"}',
        'shardlb_cache_requests_total{cache="top",result="miss"}',
    ):
        assert needle in text, needle


async def test_request_ids(client: httpx.AsyncClient) -> None:
    mine = await client.get("/healthz", headers={"X-Request-Id": "trace-42"})
    assert mine.headers["x-request-id"] == "trace-42"
    made = await client.get("/v1/nothing", headers={"X-Request-Id": "no spaces allowed"})
    assert len(made.headers["x-request-id"]) == 32 and made.headers["x-request-id"] != "no spaces allowed"


async def test_errors_are_logged_once_as_json(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="shardlb.router")  # a 4xx is a line a minute at info (RefusedLines)
    logging.getLogger("shardlb").addHandler(caplog.handler)  # where the JSON handler is
    try:
        await client.get("/v1/boards/no-such-board/top", headers={"X-Request-Id": "log-me"})
    finally:
        logging.getLogger("shardlb").removeHandler(caplog.handler)
    lines = [r for r in caplog.records if getattr(r, "fields", {}).get("request_id") == "log-me"]
    assert len(lines) == 1
    fields = getattr(lines[0], "fields", {})
    assert fields["status"] == 404 and fields["code"] == "board_not_found"
    parsed = orjson.loads(JsonFormatter().format(lines[0]))
    assert parsed["request_id"] == "log-me" and parsed["status"] == 404


# ---- what a request names is never ignored -------------------------------------------------------


async def test_players_query_takes_period_and_region_as_query_parameters(client: httpx.AsyncClient) -> None:
    name = await make_board(
        client,
        {
            "periods": ["total", "daily"],
            "sharding": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2},
        },
    )
    await post(
        client,
        name,
        [
            score("e1", 10, "m", region="eu"),
            score("n1", 20, "m", region="na"),
            score("e2", 5, "m", region="eu"),
        ],
    )
    query = f"/v1/boards/{name}/players:query"
    ids = {"player_ids": ["e1", "e2", "n1"]}
    world = await client.post(query, json=ids)
    assert [(e["rank"], e["player_id"]) for e in world.json()["entries"]] == [(1, "n1"), (2, "e1"), (3, "e2")]
    eu = await client.post(query, params={"region": "eu"}, json=ids)
    assert eu.status_code == 200, eu.text
    assert [(e["rank"], e["player_id"]) for e in eu.json()["entries"]] == [(1, "e1"), (2, "e2")]
    both = await client.post(
        query, params={"region": "eu", "period": "total"}, json={**ids, "period": "total"}
    )
    assert both.status_code == 200 and both.json()["period"] == "total"
    assert [e["player_id"] for e in both.json()["entries"]] == ["e1", "e2"]
    assert_error(
        await client.post(query, params={"region": "eu"}, json={**ids, "region": "na"}),
        422,
        "conflicting_parameter",
        "region",
    )
    assert_error(
        await client.post(query, params={"period": "total"}, json={**ids, "period": "daily"}),
        422,
        "conflicting_parameter",
        "period",
    )


async def test_unknown_query_parameters_are_400_naming_them(client: httpx.AsyncClient) -> None:
    name = await make_board(client)
    await post(client, name, [score("p", 1, "m")])
    base = f"/v1/boards/{name}"
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/boards", {}),
        ("GET", base, {}),
        ("PUT", base, {"json": {}, "headers": AS_ADMIN}),
        ("DELETE", base, {"headers": AS_ADMIN}),
        ("POST", f"{base}/scores", {"json": {"scores": []}, "headers": AS_WRITER}),
        ("GET", f"{base}/top", {}),
        ("GET", f"{base}/entries", {}),
        ("GET", f"{base}/players/p", {}),
        ("GET", f"{base}/players/p/around", {}),
        ("POST", f"{base}/players:query", {"json": {"player_ids": ["p"]}}),
    ]
    for method, path, extra in requests:
        r = await client.request(method, path, params={"limit": "5", "regoin": "eu"}, **extra)
        if path.endswith(("/top", "/entries")):
            assert_error(r, 400, "unknown_parameter", "regoin")
        else:  # limit is not a parameter of these either: the first unknown one is named
            assert r.status_code == 400, (method, path, r.text)
            assert r.json()["error"]["code"] == "unknown_parameter"
            assert r.json()["error"]["field"] in ("limit", "regoin")
    twice = await client.get(f"{base}/top", params=[("limit", "5"), ("limit", "6")])
    assert_error(twice, 400, "repeated_parameter", "limit")
    assert (await client.get(f"{base}/top", params={"limit": "5"})).status_code == 200
    assert (await client.get(f"{base}/players/p")).status_code == 200


async def test_only_ascii_digits_are_numbers_and_periods(client: httpx.AsyncClient) -> None:
    name = await make_board(client, {"periods": ["total", "weekly"]})
    base = f"/v1/boards/{name}"
    assert_error(
        await client.get(f"{base}/top", params={"period": "weekly:٢٠٢٦-W48"}), 422, "invalid_period", "period"
    )
    assert (await client.get(f"{base}/top", params={"period": "weekly:2026-W48"})).status_code == 200
    for value in ("٣", "1_0", " 5", "+5", "５"):
        assert_error(
            await client.get(f"{base}/top", params={"limit": value}), 422, "invalid_parameter", "limit"
        )


async def test_a_scores_region_is_ignored_on_boards_without_regions(client: httpx.AsyncClient) -> None:
    """api.md: a score's region is "required on region boards and ignored elsewhere", whatever it
    holds; a read's region parameter that could not name a region is still refused."""
    name = await make_board(client)
    long = "r" * 65
    assert_error(
        await client.get(f"/v1/boards/{name}/top", params={"region": long}), 422, "invalid_region", "region"
    )
    for i, region in enumerate((long, "", 7, ["eu"], "eu")):
        r = await client.post(
            f"/v1/boards/{name}/scores",
            headers=AS_WRITER,
            json={"scores": [score(f"x{i}", 1 + i, "m", region=region)]},
        )
        assert r.status_code == 200, (region, r.text)
        assert r.json()["results"][0]["status"] == "improved"
    top = (await client.get(f"/v1/boards/{name}/top")).json()["entries"]
    assert [e["player_id"] for e in top] == ["x4", "x3", "x2", "x1", "x0"]
    assert (await client.get(f"/v1/boards/{name}/top", params={"region": "r" * 64})).status_code == 200
