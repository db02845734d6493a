"""The router's connections to PostgreSQL (the archive): what a client sees when PostgreSQL fails,
and how many connections callers can make a worker open."""

from __future__ import annotations

import asyncio

import httpx
import psycopg
import pytest

from router import service
from router.errors import to_api_error
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running
from tests.test_rebuild import own_archive

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


async def waiters(db: psycopg.AsyncConnection[object]) -> int:
    """The sessions of ``db``'s database waiting for a lock."""
    cur = await db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock'"
    )
    return int((await cur.fetchone() or (0,))[0])


async def test_calls_of_a_write_key_to_the_archive_wait_for_a_few_connections(
    cluster_url: str, postgres_url: str
) -> None:
    """The settlement endpoints of a write key (a settlement, its awards, their acknowledgement)
    opened a PostgreSQL connection each, as many at once as the worker took requests (1000): a game
    server's burst of award pages could take every connection PostgreSQL allows, and the archiver
    reconnecting, bans and settlements then failed. They now take one of a few permits per worker
    (``service.ARCHIVE_CALL_LANES``), queued like reads and 503 ``overloaded`` past that. Here the
    settlements table is locked: each call that got a connection waits in PostgreSQL."""
    lanes = service.ARCHIVE_CALL_LANES
    path = "/v1/settlements/nobody/awards"
    async with (
        own_archive(postgres_url) as url,
        running(cluster_url, postgres_url=url, queue_wait_s=0.05) as (_, client),
    ):
        r = await client.get(path, headers=AS_WRITER)  # the schema set up by the first call
        assert r.status_code == 404, r.text
        async with await psycopg.AsyncConnection.connect(url) as locker:
            await locker.execute("LOCK TABLE settlements IN ACCESS EXCLUSIVE MODE")
            calls = [asyncio.create_task(client.get(path, headers=AS_WRITER)) for _ in range(lanes + 6)]
            try:
                # The guard only stops a test that would otherwise wait for ever.
                async with asyncio.timeout(60):
                    while sum(c.done() for c in calls) < 6:
                        await asyncio.sleep(0.01)
                refused = [c.result() for c in calls if c.done()]
                codes = {(r.status_code, r.json()["error"]["code"]) for r in refused}
                assert codes == {(503, "overloaded")}
                async with asyncio.timeout(60):  # the calls let in wait for the lock, and no others
                    while (waiting := await waiters(locker)) < lanes:
                        await asyncio.sleep(0.01)
                assert waiting == lanes
            finally:
                await locker.rollback()
                answers: list[httpx.Response] = await asyncio.gather(*calls)
        assert sorted(r.status_code for r in answers) == [404] * lanes + [503] * 6
