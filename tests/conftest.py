"""Shared fixtures: the suite's own Redis Cluster, started by the same code as `shardlb cluster up`.

Ports: every server a test starts takes its port from tests/ports.py, ``node_ports`` for Redis nodes
and ``server_port`` for anything else, never from a start of its own: the xdist workers of a run
then never search the same ports (see that module for the ranges and the slices).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from shardlb import compat
from shardlb.cluster import LocalCluster
from shardlb.postgres import LocalPostgres
from tests.ports import node_ports, server_port

# As every process of shardlb does (the CLI, the router's app): the code under test runs with the
# asyncio it runs with in production (shardlb/compat.py).
compat.mend_wait_for()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A healthy cluster of 3 masters with 1 replica each for the whole session; stopped at the end."""
    local = LocalCluster(masters=3, replicas=1, port=node_ports(6), dir=tmp_path_factory.mktemp("cluster"))
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
    # From this process's own ports too: the xdist workers may each start a server at the same moment.
    server = LocalPostgres(tmp_path_factory.mktemp("postgres"), port=server_port(), fast=True)
    url = server.up()
    try:
        yield url
    finally:
        server.destroy()


pytest_plugins = ["tests.store_fixture"]
