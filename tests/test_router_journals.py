"""router/journals.py: the journal furthest behind the archive, in /readyz and /metrics."""

from __future__ import annotations

import pytest

from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster


async def test_readyz_and_metrics_show_the_journal_furthest_behind(cluster: LocalCluster) -> None:
    async with running(cluster.url, journal_max_entries=1234, journal_max_results=5678) as (app, client):
        name = board_name("lag")
        assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
        body = {"scores": [{"player_id": f"p{i}", "points": i, "match_id": "m"} for i in range(5)]}
        assert (
            await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        ).status_code == 200
        worst = await service_of(app).journals.check()  # no archiver runs: the entries stay
        assert worst.board is not None and worst.lag.entries >= 1 and worst.lag.results >= 1
        ready = (await client.get("/readyz")).json()
        assert ready["journal"]["bound"] == 1234 and ready["journal"]["entries"] == worst.lag.entries
        assert ready["journal"]["results_bound"] == 5678 and ready["journal"]["results"] == worst.lag.results
        text = (await client.get("/metrics")).text
        assert f"shardlb_journal_lag_entries {float(worst.lag.entries)}" in text
        assert f"shardlb_journal_lag_results {float(worst.lag.results)}" in text
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
