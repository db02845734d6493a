"""The router's connections to PostgreSQL (the archive): what a client sees when PostgreSQL fails,
and how many connections callers can make a worker open."""

from __future__ import annotations

import psycopg
import pytest

from router.errors import to_api_error
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, board_name, running

pytestmark = pytest.mark.cluster

NOBODY = "postgresql://shardlb@127.0.0.1:1/postgres"  # nothing listens on port 1


def test_an_error_of_postgresql_that_escapes_a_handler_is_503_archive_unavailable() -> None:
    """Whatever path it takes, PostgreSQL failing is 503 ``archive_unavailable`` (api.md), never a
    500 that says the router has a bug."""
    error = to_api_error(psycopg.OperationalError("connection failed: Connection refused"))
    assert (error.status, error.code, error.headers) == (503, "archive_unavailable", {"retry-after": "5"})


async def test_a_reshard_of_a_journaled_board_with_postgresql_away_is_503_archive_unavailable(
    store: BoardStore, cluster_url: str
) -> None:
    """A reshard of a journaled board reaches the archive first (``Resharder._reach_archive``): a
    PostgreSQL out of reach is a 503 the admin may retry, and nothing is recorded."""
    name = board_name("pg-away")
    await store.create(BoardConfig.from_dict(name, {"durability": "journal"}))
    try:
        async with running(cluster_url, postgres_url=NOBODY) as (_, client):
            r = await client.post(f"/v1/admin/boards/{name}/reshard", json={"shards": 4}, headers=AS_ADMIN)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "archive_unavailable", r.text
            assert r.headers["retry-after"] == "5"
            r = await client.get(f"/v1/admin/boards/{name}/reshard", headers=AS_ADMIN)
            assert r.json()["state"] == "none", r.text
    finally:
        await store.delete(name)
