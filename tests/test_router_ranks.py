"""Rank modes through the router: the board setting, the ``rank_mode`` parameter of every read, and
its bad values. (The ranks themselves are checked against the reference in tests/test_board_ranks.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from shardlb import times
from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running
from tests.test_router_api import T0, assert_error, score

pytestmark = pytest.mark.cluster

# Listed a, b, c (50 points, earliest first), d, e (40), f (10).
SCORES = [
    score("a", 50, "m1", T0),
    score("b", 50, "m2", T0 + 1000),
    score("c", 50, "m3", T0 + 2000),
    score("d", 40, "m4", T0),
    score("e", 40, "m5", T0 + 5000),
    score("f", 10, "m6", T0),
]
LISTED = ["a", "b", "c", "d", "e", "f"]
UNIQUE = [1, 2, 3, 4, 5, 6]
COMPETITION = [1, 1, 1, 4, 4, 6]
RANKS = {"unique": UNIQUE, "competition": COMPETITION}
BELOW = {"a": 3, "d": 1, "f": 0}  # players with strictly fewer points: the competition percentile
READS = [
    ("GET", "top", None),
    ("GET", "entries?offset=1&limit=3", None),
    ("GET", "players/d", None),
    ("GET", "players/d?estimate=true", None),
    ("GET", "players/d/around?radius=2", None),
    ("POST", "players:query", {"player_ids": ["c", "e"]}),
]


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url, top_refresh_s=0.2, histogram_samples=8, histogram_refresh_s=0.2) as (
        _,
        c,
    ):
        yield c


async def board_with(client: httpx.AsyncClient, settings: dict[str, Any]) -> str:
    name = board_name("ranks")
    body = {**settings, "sharding": {"strategy": "hash", "shards": 3}}
    created = await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
    assert created.status_code == 201, created.text
    posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": SCORES}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text
    return name


def ranks(entries: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["player_id"], e["rank"]) for e in entries]


def want(mode: str, start: int = 0, end: int = len(LISTED)) -> list[tuple[str, int]]:
    return list(zip(LISTED[start:end], RANKS[mode][start:end], strict=True))


async def read(client: httpx.AsyncClient, board: str, mode: str | None, path: str) -> dict[str, Any]:
    url = f"/v1/boards/{board}/{path}"
    if mode is not None:
        url += ("&" if "?" in url else "?") + f"rank_mode={mode}"
    r = await client.get(url)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_the_board_setting_is_stored_listed_and_checked(client: httpx.AsyncClient) -> None:
    name = board_name("ranks")
    created = await client.put(f"/v1/boards/{name}", json={"rank_mode": "competition"}, headers=AS_ADMIN)
    assert created.status_code == 201 and created.json()["rank_mode"] == "competition"
    assert (await client.get(f"/v1/boards/{name}")).json()["rank_mode"] == "competition"
    other = await client.put(f"/v1/boards/{name}", json={"rank_mode": "unique"}, headers=AS_ADMIN)
    assert_error(other, 409, "board_conflict", "board")
    plain = board_name("ranks")
    assert (await client.put(f"/v1/boards/{plain}", headers=AS_ADMIN)).json()["rank_mode"] == "unique"
    bad = await client.put(f"/v1/boards/{board_name('ranks')}", json={"rank_mode": "dense"}, headers=AS_ADMIN)
    assert_error(bad, 422, "invalid_input", "rank_mode")
    for board in (name, plain):
        assert (await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)).status_code == 204


@pytest.mark.parametrize("default", ["unique", "competition"])
async def test_every_read_takes_the_request_mode_or_the_boards(
    client: httpx.AsyncClient, default: str
) -> None:
    board = await board_with(client, {"rank_mode": default})
    try:
        for asked in (None, "unique", "competition", None):  # the top cache keeps unique ranks
            mode = asked or default
            assert ranks((await read(client, board, asked, "top"))["entries"]) == want(mode)
            assert ranks((await read(client, board, asked, "top?limit=2"))["entries"]) == want(mode, 0, 2)
            page = await read(client, board, asked, "entries?offset=1&limit=3")
            assert ranks(page["entries"]) == want(mode, 1, 4)
            around = await read(client, board, asked, "players/d/around?radius=2")
            assert ranks(around["entries"]) == want(mode, 1, 6)
            url = f"/v1/boards/{board}/players:query" + (f"?rank_mode={asked}" if asked else "")
            friends = await client.post(url, json={"player_ids": ["e", "c", "nobody"]})
            assert friends.status_code == 200, friends.text
            assert ranks(friends.json()["entries"]) == [want(mode)[2], want(mode)[4]]
            for player, at in (("a", 0), ("d", 3), ("f", 5)):
                for estimate in ("false", "true"):  # histograms of 8 samples hold these shards whole
                    got = await read(client, board, asked, f"players/{player}?estimate={estimate}")
                    below = 6 - UNIQUE[at] if mode == "unique" else BELOW[player]
                    assert (got["rank"], got["players"]) == (RANKS[mode][at], 6)
                    assert got["percentile"] == pytest.approx(100.0 * below / 6)
                    assert got.get("rank_error", 0) == 0
    finally:
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


async def test_bad_rank_modes_are_refused_on_every_read(client: httpx.AsyncClient) -> None:
    board = await board_with(client, {})
    try:
        for method, path, body in READS:
            url = f"/v1/boards/{board}/{path}" + ("&" if "?" in path else "?")
            for value in ("dense", "", "UNIQUE", "competition "):
                r = await client.request(method, url + f"rank_mode={value}", json=body)
                assert_error(r, 422, "invalid_parameter", "rank_mode")
            twice = await client.request(method, url + "rank_mode=unique&rank_mode=unique", json=body)
            assert_error(twice, 400, "repeated_parameter", "rank_mode")
        in_body = await client.post(
            f"/v1/boards/{board}/players:query", json={"player_ids": ["a"], "rank_mode": "competition"}
        )
        assert_error(in_body, 422, "unknown_field", "rank_mode")  # a query parameter only
    finally:
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


async def test_my_rank_takes_max_age_ms_and_says_when_the_counts_were_read(client: httpx.AsyncClient) -> None:
    """``max_age_ms`` on a band board and a hash board: the same answer as an exact read while
    nothing changed, with ``counts_as_of``; without it no such field; bad values are 422."""
    name = board_name("max-age")
    body = {"sharding": {"strategy": "band", "bands": [0, 20, 45], "shards": 3}}
    created = await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
    assert created.status_code == 201, created.text
    posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": SCORES}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text
    hashed = await board_with(client, {})
    try:
        for board in (name, hashed):
            for player in LISTED:
                exact = await read(client, board, None, f"players/{player}")
                assert "counts_as_of" not in exact
                kept = await read(client, board, None, f"players/{player}?max_age_ms=5000")
                taken = times.parse(kept.pop("counts_as_of"), "counts_as_of")
                assert times.now_ms() - 5000 <= taken <= times.now_ms()
                assert kept == exact
            for value in ("-1", "10001", "1.5", "soon", ""):
                r = await client.get(f"/v1/boards/{board}/players/a?max_age_ms={value}")
                assert_error(r, 422, "invalid_parameter", "max_age_ms")
    finally:
        for board in (name, hashed):
            await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)
