"""Shared fixtures: the suite's own Redis Cluster, started by the same code as `shardlb cluster up`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from shardlb import compat
from shardlb.cluster import LocalCluster, free_port_block
from shardlb.postgres import LocalPostgres
from tests.ports import search_start

# As every process of shardlb does (the CLI, the router's app): the code under test runs with the
# asyncio it runs with in production (shardlb/compat.py).
compat.mend_wait_for()


def _free_ports(count: int) -> int:
    # Searching from a start of this process's own (tests/ports.py) keeps test sessions and xdist
    # workers running side by side from racing for one block; bus ports (+10000) stay below Linux's
    # ephemeral range (32768 and up).
    return free_port_block(count, start=search_start(20000, 200))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A healthy cluster of 3 masters with 1 replica each for the whole session; stopped at the end."""
    local = LocalCluster(masters=3, replicas=1, port=_free_ports(6), dir=tmp_path_factory.mktemp("cluster"))
    local.up()
    try:
        yield local
    finally:
        local.down()


@pytest.fixture(scope="session")
def cluster_url(cluster: LocalCluster) -> str:
    """`redis://host:port,...` listing every node of the session cluster."""
    return cluster.url


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SHARDLB_POSTGRES_URL, or a private PostgreSQL server for the session (stopped at the end)."""
    given = os.environ.get("SHARDLB_POSTGRES_URL")
    if given:
        yield given
        return
    # Its own start here too: the xdist workers may each start a server at the same moment.
    server = LocalPostgres(tmp_path_factory.mktemp("postgres"), port=search_start(25432, 50), fast=True)
    url = server.up()
    try:
        yield url
    finally:
        server.destroy()


pytest_plugins = ["tests.store_fixture"]
