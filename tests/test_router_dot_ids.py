"""Ids made of dots only (``.``, ``..``) through the router: valid ids (api.md), which a path can
carry only percent-encoded (``%2E``), as router/README.md says.

A URL's normalisation (RFC 3986, 5.2.4: httpx, curl and browsers apply it) resolves a literal ``.``
or ``..`` segment before the request is sent: ``GET .../players/..`` reaches the board itself, and
``DELETE .../players/..`` deletes the board. Percent-encoded, the segment reaches the route as the
id, for a player and for a board alike.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import httpx
import pytest

from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url) as (_, c):
        yield c


async def test_percent_encoded_dot_ids_reach_the_player_and_the_board(client: httpx.AsyncClient) -> None:
    name = board_name("dots")
    assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
    try:
        scores = [{"player_id": p, "points": n, "match_id": "m"} for p, n in ((".", 1), ("..", 2), ("a", 3))]
        posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
        assert posted.status_code == 200, posted.text
        for path, player, rank in (("%2E", ".", 3), ("%2E%2E", "..", 2), ("%2e%2e", "..", 2)):
            me = await client.get(f"/v1/boards/{name}/players/{path}")
            assert (me.status_code, me.json()["player_id"], me.json()["rank"]) == (200, player, rank), path
            near = await client.get(f"/v1/boards/{name}/players/{path}/around?radius=0")
            assert [e["player_id"] for e in near.json()["entries"]] == [player], path
        # Unencoded, the client resolves the segment: the request names the board, not the player.
        assert str((await client.get(f"/v1/boards/{name}/players/..")).url).endswith(f"/v1/boards/{name}")
    finally:
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
    # A board whose id is dots only (a count of its own: other test processes share the cluster),
    # created, read and deleted through its encoded segment.
    dots = "." * (3 + secrets.randbelow(60))
    path = "/v1/boards/" + "%2E" * len(dots)
    made = await client.put(path, json={}, headers=AS_ADMIN)
    assert (made.status_code, made.json()["board"]) == (201, dots)
    try:
        assert (await client.get(path)).json()["board"] == dots
    finally:
        assert (await client.delete(path, headers=AS_ADMIN)).status_code == 204
    assert (await client.get(path)).status_code == 404
