"""Two router processes on one cluster: a board deleted through one is gone for the other (issue 9, item 2).

Router B holds the board in its cache (and its coalescer) when router A deletes it; B's writes must
then fail with 404, write nothing, and a board re-created under the same id must start empty.
"""

from __future__ import annotations

import pytest

from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running

pytestmark = pytest.mark.cluster


def scores(n: int, match: str) -> dict[str, object]:
    return {
        "scores": [
            {"player_id": f"p{i}", "points": 10 + i, "match_id": match, "achieved_at": "2026-11-30T05:00:00Z"}
            for i in range(n)
        ]
    }


async def test_writes_through_a_stale_router_after_delete_are_refused(cluster: LocalCluster) -> None:
    name = board_name("reborn")
    body = {"mode": "incr", "periods": ["daily"], "sharding": {"strategy": "hash", "shards": 16}}
    async with running(cluster.url) as (_, a), running(cluster.url) as (_, b):
        assert (await a.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
        first = await b.post(f"/v1/boards/{name}/scores", json=scores(5, "m0"), headers=AS_WRITER)
        assert first.status_code == 200  # B has the board cached now
        assert (await a.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204

        late = await b.post(f"/v1/boards/{name}/scores", json=scores(40, "m1"), headers=AS_WRITER)
        assert late.status_code == 404, late.text
        assert late.json()["error"]["code"] == "board_not_found"

        assert (await a.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
        board = await a.get(f"/v1/boards/{name}")
        assert board.json()["players"] == {"total": 0, "daily": 0}
        assert (await a.get(f"/v1/boards/{name}/top")).json()["entries"] == []
        # B learns the new incarnation and writes into it
        again = await b.post(f"/v1/boards/{name}/scores", json=scores(3, "m1"), headers=AS_WRITER)
        assert again.status_code == 200
        assert [r["status"] for r in again.json()["results"]] == ["improved"] * 3
        top = (await a.get(f"/v1/boards/{name}/entries")).json()["entries"]  # entries: never cached
        assert [(e["player_id"], e["points"]) for e in top] == [("p2", 12), ("p1", 11), ("p0", 10)]
        await a.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_board_re_created_under_its_id_is_not_read_from_the_old_ones_caches(
    cluster: LocalCluster,
) -> None:
    """The top cache and the histograms are keyed on the resolved view, whose keys carry the
    incarnation: a router that cached the old board's top must not serve it for the new board."""
    name = board_name("recached")
    body = {"sharding": {"strategy": "hash", "shards": 4}}
    async with running(cluster.url, top_refresh_s=60, histogram_refresh_s=60) as (_, a):
        assert (await a.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
        assert (
            await a.post(f"/v1/boards/{name}/scores", json=scores(3, "m0"), headers=AS_WRITER)
        ).status_code == 200
        old = (await a.get(f"/v1/boards/{name}/top")).json()["entries"]
        assert [e["player_id"] for e in old] == ["p2", "p1", "p0"]
        guess = (await a.get(f"/v1/boards/{name}/players/p0", params={"estimate": "true"})).json()
        assert guess["rank"] == 3
        assert (await a.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204

        assert (await a.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)).status_code == 201
        reborn = {"scores": [{"player_id": "q", "points": 5, "match_id": "m1"}, *scores(1, "m1")["scores"]]}
        assert (await a.post(f"/v1/boards/{name}/scores", json=reborn, headers=AS_WRITER)).status_code == 200
        new = (await a.get(f"/v1/boards/{name}/top")).json()["entries"]
        assert [(e["player_id"], e["points"]) for e in new] == [("p0", 10), ("q", 5)]
        guess = (await a.get(f"/v1/boards/{name}/players/p0", params={"estimate": "true"})).json()
        assert (guess["rank"], guess["players"]) == (1, 2)
        await a.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
