"""Online reshard through the HTTP API under load (issue 15, item 3's short form of `make chaos`).

A router process with the archive, `shardlb archive`, HTTP writers keeping a ledger and readers
checking whole pages, while the router's admin endpoint reshards an incr and a best board (16 ->
4 shards, then new boards 16 -> 40, then new boards made band boards and given new band starts):
bench/reshard.py's table rows, each checked here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import reshard
from shardlb.cluster import LocalCluster
from tests.ports import server_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LOAD = {"tasks": 4, "players": 40, "batch": 10, "settle_s": 30.0}
WRITE_S = 1.5


@pytest.fixture(scope="module")
async def steps(
    cluster: LocalCluster, postgres_url: str, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    logs = Path(tmp_path_factory.mktemp("reshard-logs"))
    return await reshard.with_router(logs, cluster.url, postgres_url, WRITE_S, server_port(), **LOAD)


@pytest.mark.parametrize("name", [name for name, _ in reshard.STEPS])
async def test_nothing_acknowledged_is_lost_and_every_page_is_exact_while_boards_are_resharded(
    steps: list[dict[str, Any]], name: str
) -> None:
    [report] = [r for r in steps if r["phase"] == f"reshard-{name}"]
    shards, bands = dict(reshard.STEPS)[name][-1]
    assert (report["shards"], report["bands"]) == (shards, bands), report
    assert {"copying", "none"} <= set(report["states_seen"]), report  # it was seen under way
    assert report["acknowledged"] > 0 and report["unsettled_writes"] == 0, report
    assert (report["lost"], report["duplicates"]) == (0, 0), report
    assert report["reads_checked"] > 0 and report["reads_inexact"] == 0, report
    answered = {**report["write_statuses"], **report["read_statuses"]}
    assert set(answered) <= {"200", "503"}, report  # errors are at most retryable 503s
    assert report["drifting_shards"] == 0, report  # the archive followed the board to its new shards
    assert isinstance(report["cutover_ms"], float), report  # recorded (a figure, not a bound)
