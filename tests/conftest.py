"""Shared fixtures: the suite's own Redis Cluster, started by the same code as `shardlb cluster up`.

Ports: every server a test starts takes its port from tests/ports.py, ``node_ports`` for Redis nodes
and ``server_port`` for anything else, never from a start of its own: the xdist workers of a run
then never search the same ports (see that module for the ranges and the slices).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import psycopg
import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException

from shardlb import compat, keys, moderation
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


@pytest.fixture
def no_ban_propagation_wait() -> Iterator[None]:
    """A restore of the ban list (``Rebuilder.restore``, `rebuild --all`) that wrote a ban back
    waits ``shardlb.moderation.PROPAGATION_S`` (2.5 s) before any board goes back, so that every
    running router holds the bans by then (2026-12-07). A test that checks nothing of that wait (no
    router of its posts a banned player's results after the restore) takes it out with this
    fixture: on the suite's database any ban another module left there makes each restore pay it.
    The wait itself is tested in tests/test_moderation.py
    (test_a_rebuild_puts_boards_back_once_a_router_started_after_the_loss_holds_the_bans). A
    MonkeyPatch of its own: a test's ``monkeypatch.undo()`` leaves it in place. In this process
    only: a CLI run in a subprocess still waits."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moderation, "PROPAGATION_S", 0.0)
        yield


# The fixtures through which a module reaches the session's cluster (``cluster`` under them all).
ON_CLUSTER = ("cluster", "cluster_url", "store", "raw", "rebuilder")


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_no_global_ban(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each module on the session's cluster: a ban of every board (scope ``all``) that it
    made and left in place fails it by name. The modules after it on the same xdist worker share
    the cluster's ban list: routers and writes there refuse that player everywhere, and many tests
    post as the same few players (``p1``, ``cheat``); rebuilds and settlements leave them out. The
    ban is taken out of Redis's list (its version moved, as a lift does) and out of the suite's
    PostgreSQL database, so the modules after it start without it (a database of a test's own is
    that test's)."""
    items = [i for i in request.session.items if i.module is request.module]
    used = {name for item in items for name in item.fixturenames}
    if not used & set(ON_CLUSTER):
        yield
        return
    cluster = request.getfixturevalue("cluster")
    if not isinstance(cluster, LocalCluster):  # a module's own kind of cluster (test_k8s_scripts's pods)
        yield
        return
    before = _global_bans(cluster)
    yield
    after = _global_bans(cluster)
    left = set() if before is None or after is None else after - before
    if not left:
        return
    client = _sync_client(cluster)
    try:
        client.hdel(keys.BANS, *left)
        client.set(keys.BANS_VERSION, 1 + secrets.randbelow(moderation.VERSIONS))
    finally:
        client.close()
    if "postgres_url" in used:  # and from the suite's database, where rebuilds and settlements read bans
        players = [field.partition("/")[2] for field in left]
        with psycopg.connect(request.getfixturevalue("postgres_url"), autocommit=True) as db:
            db.execute("DELETE FROM bans WHERE board = %s AND player_id = ANY(%s)", (moderation.ALL, players))
    pytest.fail(f"{request.module.__name__} left bans of every board in place: {sorted(left)}")


def _global_bans(cluster: LocalCluster) -> set[str] | None:
    """The ban list's fields that ban a player on every board; None when the cluster cannot be
    read (a module that leaves it broken fails on that, not here)."""
    everywhere = moderation.ban_field(moderation.ALL, "")
    unreadable = (redis.RedisError, RedisClusterException)
    try:
        client = _sync_client(cluster)
    except unreadable:
        return None
    try:
        fields = client.hkeys(keys.BANS)
    except unreadable:
        return None
    finally:
        client.close()
    return {f for f in fields if f.startswith(everywhere)}


def _sync_client(cluster: LocalCluster) -> RedisCluster:
    """A blocking client of its own: nothing on the session's event loop, which the library modules
    check for what they leave running (tests/store_fixture.py)."""
    nodes = [ClusterNode(cluster.host, port) for port in cluster.ports]
    return RedisCluster(
        startup_nodes=nodes,
        password=cluster.password,
        decode_responses=True,
        socket_timeout=10,  # a node a module left stopped (SIGSTOP) does not hold up the suite
        socket_connect_timeout=10,
    )


# The modules that take longest (a minute or so each: their own clusters, reshards, failovers, Locust,
# a browser), handed to the xdist workers first: `--dist loadscope` gives out modules in the order
# they were collected, and one of these started last kept its worker busy for a minute after the
# others had ended. The order of tests within a module does not change.
SLOW_FIRST = (
    "test_chaos",
    "test_reshard_http",
    "test_reshard",
    "test_bench_locustfile",
    "test_k8s_scripts",
    "test_dashboard_browser",
    "test_migration",
    "test_router_reshards",
    "test_reshard_failover",
    "test_settlement_webhooks",
    "test_router_slow_clients",
    "test_openapi",
    "test_router_server",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: n for n, name in enumerate(SLOW_FIRST)}

    def module_rank(item: pytest.Item) -> int:
        name = item.module.__name__.rpartition(".")[2] if item.module else ""
        return rank.get(name, len(SLOW_FIRST))

    items.sort(key=module_rank)  # stable: each module's tests keep their order


pytest_plugins = ["tests.store_fixture"]
