"""The cluster connection (shardlb/connection.py): URL parsing, AUTH on a password-protected cluster.

The session cluster has no password, so this module starts its own small cluster and turns AUTH on
(requirepass, as the Kubernetes Redis nodes run): the client must authenticate to the seed node and
to every node it discovers from it, on the plain command path and on the per-node script pipelines.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import RedisClusterException

from router.service import Service
from router.settings import Settings
from shardlb import times
from shardlb.board import Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect, parse_url, postgres_url, raised_in_redis, redacted
from shardlb.errors import ClusterUnavailable, InvalidInput
from shardlb.fanout import ScriptPipeline
from shardlb.store import BoardStore
from tests.ports import node_ports, server_port

PASSWORD = secrets.token_hex(16)


def raise_through(*files: str) -> BaseException:
    """The RuntimeError raised in a call chain whose functions are compiled as if they came from
    ``files``, outermost first, and raised in the last (the shape of a traceback; the code itself
    is a stand-in)."""
    source = (
        "def step(rest):\n"
        "    if rest:\n"
        "        return rest[0](rest[1:])\n"
        "    raise RuntimeError('unable to perform operation on <TCPTransport closed=True>')\n"
    )
    steps = []
    for file in files:
        scope: dict[str, Any] = {}
        exec(compile(source, file, "exec"), scope)
        steps.append(scope["step"])
    try:
        steps[0](steps[1:])
    except RuntimeError as e:
        return e
    raise AssertionError("nothing raised")


def test_a_failure_in_the_event_loop_under_redis_py_is_redis_pys() -> None:
    """A write on a transport that a failover closed fails inside the event loop (uvloop's
    RuntimeError) under redis-py's own write: cluster trouble, a 503 and not a 500. The same error
    under our own code is ours."""
    redis_code = os.path.join(os.path.dirname(redis.__file__), "asyncio", "connection.py")
    streams = os.path.join(os.path.dirname(asyncio.__file__), "streams.py")
    ours = os.path.join(os.path.dirname(times.__file__), "board.py")
    loop = ["uvloop/handles/stream.pyx", "uvloop/handles/handle.pyx"]
    assert raised_in_redis(raise_through(ours, redis_code, streams, *loop))
    assert raised_in_redis(raise_through(ours, redis_code))
    assert not raised_in_redis(raise_through(redis_code, ours, streams, *loop))
    assert not raised_in_redis(raise_through(ours, *loop))


def test_parse_url_lists_the_nodes() -> None:
    url = "redis://:pw@a:7000,b:7001,c"
    assert parse_url(url) == [("a", 7000), ("b", 7001), ("c", 6379)]
    assert parse_url("redis://a:1") == [("a", 1)]


@pytest.mark.parametrize(
    "url",
    ["redis://:s3cret@a:70000", "redis://:s3cret@:7000", "http://:s3cret@a:7000", "redis://:s3cret@a:1,b:x"],
)
def test_bad_urls_do_not_echo_the_password(url: str) -> None:
    # the message ends up in start-up errors and logs
    with pytest.raises(InvalidInput) as e:
        parse_url(url)
    assert "s3cret" not in e.value.message and e.value.field == "SHARDLB_REDIS_URL"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://shardlb:s3cret@[::1/shardlb",
        "postgresql://shardlb:s3%zzcret@db/shardlb",
        "postgresql://shardlb:s3cret@db/shardlb?x",
    ],
)
def test_a_bad_postgres_url_is_a_usage_error_without_its_password(url: str) -> None:
    """`--postgres` (or SHARDLB_POSTGRES_URL) of `shardlb archive` and the maintenance commands:
    argparse prints the message to stderr, a pod's or a cron job's log; libpq quoted the URL in it,
    or the password's token (until 2026-12-05)."""
    with pytest.raises(argparse.ArgumentTypeError) as e:
        postgres_url(url)
    assert "s3" not in str(e.value) and "cret" not in str(e.value), str(e.value)
    assert str(e.value).startswith("not a PostgreSQL URL: ")


def test_credentials_come_once_before_the_first_node() -> None:
    with pytest.raises(InvalidInput, match="before the first"):
        parse_url("redis://a:1,:s3cret@b:2")


@pytest.fixture(scope="module")
def protected(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """3 masters, 1 replica each, whose nodes require PASSWORD from clients (and replicas use it)."""
    local = LocalCluster(
        masters=3,
        replicas=1,
        port=node_ports(6),
        dir=tmp_path_factory.mktemp("protected"),
    )
    local.up()
    try:
        for port in local.ports:
            with redis.Redis(host=local.host, port=port) as node:
                node.config_set("masterauth", PASSWORD)
                node.config_set("requirepass", PASSWORD)
        yield local
    finally:
        local.down()


def authed_url(cluster: LocalCluster, password: str) -> str:
    # one seed node only: the others are found through CLUSTER SLOTS and must get the password too
    return f"redis://:{password}@{cluster.host}:{cluster.port}"


@pytest.fixture
async def store(protected: LocalCluster) -> AsyncIterator[BoardStore]:
    client = connect(authed_url(protected, PASSWORD))
    scripts = Scripts.register(client)
    await scripts.load(client)  # SCRIPT LOAD on every primary
    yield BoardStore(client, scripts)
    await client.aclose()


async def test_password_in_the_url_reaches_every_node(protected: LocalCluster, store: BoardStore) -> None:
    config = BoardConfig.from_dict("auth", {"mode": "best", "sharding": {"strategy": "hash", "shards": 16}})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", i, f"m{i}", now, None) for i in range(200)]
        results = await board.submit(scores, now_ms=now)
        assert len(results) == len(scores)
        # the coalescer's path: one pipeline per primary, on the nodes' own connections
        pipeline = ScriptPipeline(store.client)
        prepared = board.prepare([Score("late", 999, "m-late", now, None)], now_ms=now)
        (p,) = prepared
        await board.apply_shard(p.shard, prepared, now_ms=now, pipeline=pipeline)
        top = await board.top(3)
        assert [e.player_id for e in top] == ["late", "p199", "p198"]
    finally:
        await store.delete("auth")
    # every primary holds a part of the 16 shards: all of them were reached with the password
    with redis.Redis(host=protected.host, port=protected.port, password=PASSWORD) as node:
        assert len(node.execute_command("CLUSTER SLOTS")) == 3


async def test_without_the_password_the_cluster_refuses(protected: LocalCluster) -> None:
    for url in (f"redis://{protected.host}:{protected.port}", authed_url(protected, "wrong" + PASSWORD)):
        client = connect(url)
        with pytest.raises(RedisClusterException, match=r"authenticated|username-password"):
            await client.initialize()
        await client.aclose()


def test_percent_encoded_credentials() -> None:
    client = connect("redis://user%40x:p%2Cw%40d@a:7000,b:7001")
    assert client.get_connection_kwargs()["password"] == "p,w@d"
    assert client.get_connection_kwargs()["username"] == "user@x"


def test_the_password_variable_reaches_clients_that_get_only_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """The archiver, rebuild, reconcile, settlement and the router's journal watcher connect with the
    URL alone: SHARDLB_REDIS_PASSWORD must reach them as it reaches the router's own client."""
    monkeypatch.setenv("SHARDLB_REDIS_PASSWORD", "from-env")
    assert connect("redis://a:7000").get_connection_kwargs()["password"] == "from-env"
    assert connect("redis://a:7000", password="given").get_connection_kwargs()["password"] == "given"
    assert connect("redis://:in-url@a:7000").get_connection_kwargs()["password"] == "in-url"
    monkeypatch.delenv("SHARDLB_REDIS_PASSWORD")
    assert connect("redis://a:7000").get_connection_kwargs()["password"] is None


def test_redacted_hides_the_credentials_only() -> None:
    assert redacted("redis://:s3cret@a:1,b:2") == "redis://***@a:1,b:2"
    assert redacted("redis://user:s3cret@a:1") == "redis://***@a:1"
    assert redacted("redis://a:1,b:2") == "redis://a:1,b:2"


async def test_the_routers_start_up_error_does_not_show_the_password() -> None:
    settings = Settings(
        redis_url=f"redis://:s3cret-pw@127.0.0.1:{server_port()}",
        startup_timeout_s=0.2,
        insecure_dev=True,
    )
    with pytest.raises(ClusterUnavailable) as caught:
        await Service.start(settings)
    assert "s3cret-pw" not in str(caught.value) and "***@127.0.0.1" in str(caught.value)


async def test_the_routers_start_up_logs_a_cluster_out_of_reach_once_not_every_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router's start logged "cluster not reachable yet; retrying" at every try, every 0.5 s
    for up to SHARDLB_STARTUP_TIMEOUT_S (at most an hour: 7200 lines). It now logs its first
    failure, then once a minute at most; ClusterUnavailable says the rest when it gives up."""
    import router.service
    from tests.test_router_logs import kept

    tries = [0]
    load = Scripts.load

    async def counted(self: Scripts, client: Any) -> None:
        tries[0] += 1
        await load(self, client)

    monkeypatch.setattr(Scripts, "load", counted)
    monkeypatch.setattr(router.service, "STARTUP_RETRY_S", 0.001)
    settings = Settings(
        redis_url=f"redis://127.0.0.1:{server_port()}", startup_timeout_s=3, insecure_dev=True
    )
    with kept("shardlb.router") as log, pytest.raises(ClusterUnavailable):
        await Service.start(settings)
    assert tries[0] >= 5, tries
    assert [m for m, _ in log.lines(logging.WARNING)] == ["cluster not reachable yet; retrying"]
