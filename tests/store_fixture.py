"""The ``store`` fixture: a BoardStore on the session cluster, shared by the library's test modules."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shardlb.cluster import LocalCluster
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore


@pytest.fixture(scope="session")
async def store(cluster: LocalCluster) -> AsyncIterator[BoardStore]:
    client = connect(cluster.url)
    scripts = Scripts.register(client)
    await scripts.load(client)
    yield BoardStore(client, scripts)
    await client.aclose()
