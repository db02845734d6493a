"""Fixtures of the library's test modules: ``store`` (a BoardStore on the session cluster), ``raw`` (a
client that leaves replies undecoded, for journals) and ``rebuilder`` (shardlb/rebuild.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from shardlb.cluster import LocalCluster
from shardlb.connection import Scripts, connect
from shardlb.rebuild import Rebuilder
from shardlb.store import BoardStore


@pytest.fixture(scope="session")
async def store(cluster: LocalCluster) -> AsyncIterator[BoardStore]:
    client = connect(cluster.url)
    scripts = Scripts.register(client)
    await scripts.load(client)
    yield BoardStore(client, scripts)
    await client.aclose()


@pytest.fixture
async def raw(cluster: LocalCluster) -> AsyncIterator[Any]:
    client = connect(cluster.url, decode=False)
    yield client
    await client.aclose()


@pytest.fixture
async def rebuilder(raw: Any, postgres_url: str) -> AsyncIterator[Rebuilder]:
    db = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    yield Rebuilder(raw, Scripts.register(raw).rebuild, db)
    await db.close()
