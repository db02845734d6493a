"""``estimate=true`` on a real cluster, against the reference board: on random workloads the stated
``rank_error`` must hold the exact rank (the reference's), in both rank modes, on every strategy."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardlb import periods, times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.config import RANK_MODES, BoardConfig
from tests.reference import ReferenceBoard
from tests.router_support import AS_ADMIN, AS_WRITER, running
from tests.test_board import sharding
from tests.test_board_ranks import workloads

pytestmark = pytest.mark.cluster

SAMPLES = 2  # a histogram of 3 rows per shard: most shards here are sampled, not held whole


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url, histogram_samples=SAMPLES, histogram_refresh_s=60) as (_, c):
        yield c


BOARDS = [("hash", 1), ("hash", 3), ("hash", 16), ("band", 3), ("region", 3), ("region", 16)]


@pytest.mark.parametrize(("strategy", "shards"), BOARDS)
@settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
async def test_estimated_ranks_are_within_their_error(
    client: httpx.AsyncClient, strategy: str, shards: int, data: st.DataObject
) -> None:
    mode = data.draw(st.sampled_from(["best", "incr", "set"]), "mode")
    body = {
        "mode": mode,
        "order": data.draw(st.sampled_from(["desc", "asc"]), "order"),
        "tiebreak": data.draw(st.sampled_from(["earliest", "latest"]), "tiebreak"),
        "periods": ["daily"],
        "points_max": 1000,
        "sharding": sharding(strategy, shards),
    }
    name = f"est-{uuid.uuid4().hex[:10]}"
    created = await client.put(f"/v1/boards/{name}", json=body, headers=AS_ADMIN)
    assert created.status_code == 201, created.text
    ref = ReferenceBoard(BoardConfig.from_dict(name, created.json()))
    regions = list(ref.config.sharding.regions)
    now = times.now_ms()
    try:
        results = data.draw(workloads(mode), "results")
        scores = [
            Score(
                f"p{p:02d}", points, f"m{i}", now - ago * 1000, regions[p % len(regions)] if regions else None
            )
            for i, (p, points, ago) in enumerate(results)
        ]
        sent = [
            {
                "player_id": s.player_id,
                "points": s.points,
                "match_id": s.match_id,
                "achieved_at": s.achieved_ms,
            }
            | ({"region": s.region} if s.region else {})
            for s in scores
        ]
        posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": sent}, headers=AS_WRITER)
        assert posted.status_code == 200, posted.text
        applied = [(r["status"], r["points"]) for r in posted.json()["results"]]
        assert applied == ref.submit(scores, now_ms=now)  # the cluster holds the reference's board
        day = periods.names_at(now, ref.config.periods, periods.zone("UTC"))[1]
        views = [("total", "total", None), (day, "daily:" + day[2:], None)]
        views += [("total", "total", region) for region in regions]
        for kept, api, region in views:
            order = ref.order(kept, region)
            standing = ref.competition(kept, region)
            for i, (_, player, _, _) in enumerate(order):
                for rank_mode in RANK_MODES:
                    exact = i + 1 if rank_mode == "unique" else standing[player][0]
                    params = {"estimate": "true", "period": api, "rank_mode": rank_mode}
                    if region is not None:
                        params["region"] = region
                    got = await client.get(f"/v1/boards/{name}/players/{player}", params=params)
                    assert got.status_code == 200, got.text
                    guess = got.json()
                    assert guess["players"] == len(order)
                    assert abs(guess["rank"] - exact) <= guess["rank_error"], (kept, region, rank_mode, guess)
    finally:
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
