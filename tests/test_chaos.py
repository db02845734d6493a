"""The failover test that counts (issue 11, item 7): the short form of `make chaos` (bench/chaos.py).

On a durable cluster of its own (3 masters, 1 replica each), a router process in `replica` mode
takes writes from several clients, which keep a ledger of every acknowledged result; a master is
killed -9 while its replica lags behind (stopped for `chaos.LAG_S` seconds), and then, separately,
a replica takes over with CLUSTER FAILOVER. Every acknowledged result must still be on the boards,
none counted twice: that is what `SHARDLB_ACK=replica` promises. (The same kill with the router in
`primary` mode loses thousands of acknowledged results: `make chaos` reports it.) Then every node
is stopped and emptied, and `shardlb rebuild --all` must give back boards equal to what they were.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest

from bench import chaos
from bench.durability import ArchiverProcess
from bench.services import Router, free_port
from shardlb.cluster import LocalCluster
from tests.ports import node_ports, server_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

LOAD = {"tasks": 12, "players": 50, "batch": 20, "settle_s": 30.0}  # enough to outrun the socket buffers
WRITE_S = 2.0  # of writes before the fault, and again once the cluster is healthy


@pytest.fixture(scope="module")
def durable_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    port = node_ports(6)
    local = LocalCluster(3, 1, port, Path(tmp_path_factory.mktemp("chaos")), durable=True)
    local.up()
    try:
        yield local
    finally:
        local.down()


@pytest.fixture(scope="module")
async def archive_url(postgres_url: str) -> str:
    """A database of the module's own on the suite's PostgreSQL: the cluster's archive, as in
    production. `rebuild --all` after the total loss restores every board its archive knows; on the
    suite's database that was also every board the worker's modules before this one had archived
    (tests/test_archive.py's, test_settlement.py's...), rebuilt into this cluster beside its own."""
    name = f"chaos_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
        await admin.execute(f"CREATE DATABASE {name}")
    return postgres_url.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture(scope="module")
async def runs(
    durable_cluster: LocalCluster, archive_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[list[chaos.Scenario], dict[str, object]]]:
    """Both faults under replica-mode writes, then the total loss: what each measured."""
    logs = Path(tmp_path_factory.mktemp("chaos-logs"))
    archiver = ArchiverProcess(durable_cluster.url, archive_url, logs / "archiver.log").start()
    try:
        port = free_port(server_port())
        with Router(durable_cluster.url, port, 1, logs / "router.log", chaos.router_env("replica")) as r:
            scenarios = [
                await chaos.scenario(r.url, durable_cluster, "replica", fault, WRITE_S, WRITE_S, **LOAD)
                for fault in ("kill-lagging", "failover")
            ]
        loss = await chaos.total_loss(durable_cluster, archive_url, archiver, scenarios, logs, server_port())
        yield scenarios, loss
    finally:
        archiver.stop()


def check_no_acknowledged_result_lost(scenario: chaos.Scenario) -> None:
    report = scenario.report
    assert report["acknowledged"] > 0 and report["unsettled_writes"] == 0, report
    assert (report["lost"], report["doubled"]) == (0, 0), report
    assert (report["best_lost"], report["best_unknown"]) == (0, 0), report
    assert report["recovery_s"] is not None, report  # writes succeeded again after the fault
    # Cluster trouble is a 503 with Retry-After, never a 500 (router/errors.py).
    answered = {s for s in report["statuses"] if s.isdigit()}
    assert answered <= {"200", "503"}, report


async def test_replica_mode_loses_nothing_when_a_lagging_master_is_killed(
    runs: tuple[list[chaos.Scenario], dict[str, object]],
) -> None:
    killed = runs[0][0]
    assert killed.fault == "kill-lagging"
    # The fault was real: writes failed while the replica lagged and until it was promoted.
    assert killed.report["5xx"] + killed.report["transport_errors"] > 0, killed.report
    check_no_acknowledged_result_lost(killed)


async def test_replica_mode_loses_nothing_through_a_cluster_failover(
    runs: tuple[list[chaos.Scenario], dict[str, object]],
) -> None:
    handed_over = runs[0][1]
    assert handed_over.fault == "failover"
    check_no_acknowledged_result_lost(handed_over)


async def test_a_total_loss_of_redis_is_rebuilt_from_postgresql(
    runs: tuple[list[chaos.Scenario], dict[str, object]],
) -> None:
    scenarios, loss = runs
    assert loss["boards"] == sum(len(s.boards) for s in scenarios) == 4
    for board, sums in loss["checksums"].items():  # type: ignore[attr-defined]
        assert sums["before"][0] > 0, board  # players on the board before the loss
        assert sums["after"] == sums["before"], board
    assert loss["lost_after"] == {"replica": 0, "primary": 0}
