"""Setting the archive's schema up takes no lock once it is in place.

Every ban, lift and audit request of a router (router/moderation.py), every settlement and the
archiver at each reconnect ran the whole schema's DDL, its `ALTER TABLE ... ADD COLUMN IF NOT
EXISTS` included. Such an ALTER takes an ACCESS EXCLUSIVE lock whether or not the column exists: it
waited for every transaction reading the table (a rebuild's or a reconcile's read of millions of
rows), and meanwhile every other statement on the table queued behind it, the archiver's inserts
included (journals then filling to their bound, writes refused). The DDL now runs only when this
version's schema was never applied to the database (archive.ensure_schema)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from shardlb import archive, moderation, settlement, times
from tests.test_rebuild import own_archive

pytestmark = pytest.mark.cluster

# A statement that must wait for a lock fails after this instead of waiting.
IMPATIENT = "options=-c%20lock_timeout%3D1500"


@pytest.fixture
async def archive_url(postgres_url: str) -> AsyncIterator[str]:
    async with own_archive(postgres_url) as url:
        await (await archive.connect_db(url)).close()  # set up once: an archiver's first start
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
            await settlement.ensure_schema(db)  # and a first settlement's
        yield url


async def test_the_schema_in_place_is_not_set_up_again_under_a_long_read(archive_url: str) -> None:
    impatient = f"{archive_url}?{IMPATIENT}"
    async with await psycopg.AsyncConnection.connect(archive_url) as reader:
        # A long read in progress (a rebuild's): it holds ACCESS SHARE on the tables it read.
        for table in ("match_results", "player_removals", "bans", "removal_records", "boards"):
            await reader.execute(f"SELECT count(*) FROM {table}")
        db = await archive.connect_db(impatient)  # the archiver's (re)connect, a router's ban request
        await db.close()
        async with await psycopg.AsyncConnection.connect(impatient, autocommit=True) as other:
            await settlement.ensure_schema(other)  # a settlement's, a router's history read
        await reader.rollback()


async def test_a_schema_of_another_version_is_set_up(archive_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as db:
        await db.execute("ALTER TABLE bans DROP COLUMN incarnation")
        await db.execute("DELETE FROM schema_applied")  # as if set up by an earlier version
        await (await archive.connect_db(archive_url)).close()
        cur = await db.execute(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'bans'::regclass AND attname = 'incarnation'"
        )
        assert (await cur.fetchone()) == (1,)


async def test_a_write_after_a_read_outside_a_transaction_is_committed(archive_url: str, store: Any) -> None:
    """``connect_db``'s connections were not autocommit: a statement run outside a ``transaction()``
    block left a transaction open, every block after it became a savepoint inside it, and closing
    the connection rolled them back. A ban and its audit row answered as stored were then never in
    PostgreSQL (a test's reads between a ban and its lift left the ban there, which a later
    `rebuild --all` wrote back into Redis: a CI run of 2026-12-05), and the open transaction held
    its locks meanwhile. The connection commits every statement outside a block now."""
    bans = moderation.Bans(store.client)
    ban = moderation.Ban(f"read-first-{times.now_ms()}", moderation.ALL, "bot", "test", times.now_ms())
    db = await archive.connect_db(archive_url)
    try:
        await db.execute("SELECT count(*) FROM bans")  # a read of its own, outside any block
        await bans.add(db, ban, "read-first")
        async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as other:
            cur = await other.execute("SELECT reason FROM bans WHERE player_id = %s", (ban.player,))
            assert await cur.fetchall() == [("bot",)]
        await bans.lift(db, ban.player, ban.board, "test", "cleanup", None)
    finally:
        await db.close()
    async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as other:
        cur = await other.execute("SELECT count(*) FROM bans WHERE player_id = %s", (ban.player,))
        assert await cur.fetchone() == (0,)
    assert ban.player not in {b.player for b in await bans.all()}


async def test_a_new_schema_under_a_long_read_gives_up_rather_than_hold_the_archive_up(
    archive_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new version's schema is set up at its first connect (an archiver's, a router's ban or
    history read): its ALTER TABLE waits for ACCESS EXCLUSIVE behind a long read of the table (a
    rebuild's), and every statement on the table queues behind it. Until 2026-12-05 it waited for
    as long as the read lasted, and the archiver's inserts (and every read of the archive) with it;
    now it gives up after ``SCHEMA_LOCK_TIMEOUT_S`` (an error its callers retry: an outage of the
    archiver, a 503 of the router), lets the queue go on, and is set up by a later connect. The
    connection whose set-up failed is closed (it was left open for the garbage collector)."""
    monkeypatch.setattr(archive, "SCHEMA_LOCK_TIMEOUT_S", 0.2)
    async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as db:
        await db.execute("DELETE FROM schema_applied")  # a version whose schema is not set up yet
    async with await psycopg.AsyncConnection.connect(archive_url) as reader:
        await reader.execute("SELECT count(*) FROM match_results")  # a long read in progress
        with pytest.raises(psycopg.errors.LockNotAvailable):
            # The guard only stops a test that would otherwise wait for ever.
            await asyncio.wait_for(archive.connect_db(archive_url), 60)
        async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as writer:
            # And the connection it opened is closed, not left to the garbage collector.
            cur = await writer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = 'shardlb-archive'"
            )
            assert await cur.fetchone() == (0,)
            # The archiver's write meanwhile goes through: nothing queues it behind the DDL now.
            await asyncio.wait_for(
                writer.execute(
                    "INSERT INTO match_results (board, incarnation, match_id, player_id, points, "
                    "achieved_ms, score, shard, journal_id) VALUES ('b', 'i', 'm', 'p', 1, 1, 1, 0, '1-0')"
                ),
                60,
            )
        await reader.rollback()
    await (await archive.connect_db(archive_url)).close()  # the read over: set up
    async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as db:
        cur = await db.execute("SELECT count(*) FROM schema_applied")
        assert await cur.fetchone() == (1,)


async def test_the_trigger_is_set_up_again_by_two_processes_at_once(archive_url: str) -> None:
    """A new version's set-up (schema_applied emptied: another digest) run by two processes at once on
    an archive that has the trigger of ``match_results`` already: ``CREATE OR REPLACE FUNCTION`` and
    ``CREATE OR REPLACE TRIGGER`` run again, one after the other (the advisory lock), without error,
    and one trigger stays. (Under a long read the set-up gives up at the ALTER TABLEs, as above.)"""
    async with await psycopg.AsyncConnection.connect(archive_url, autocommit=True) as db:
        await db.execute("DELETE FROM schema_applied")
        for one in await asyncio.gather(archive.connect_db(archive_url), archive.connect_db(archive_url)):
            await one.close()
        cur = await db.execute(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'match_results'::regclass "
            "AND tgname = 'match_results_keep_replaced'"
        )
        assert (await cur.fetchone()) == (1,)


async def test_a_server_older_than_the_schema_needs_is_named_not_a_syntax_error(archive_url: str) -> None:
    """The schema's trigger needs PostgreSQL 14: an older server is refused with its version and the
    one needed, before any DDL runs. The suite's server (15 or newer) passes the same check."""
    with pytest.raises(psycopg.NotSupportedError, match=r"PostgreSQL 13\.4 is too old .* needs 14 or newer"):
        archive.check_server_version(130004)
    archive.check_server_version(140000)
    db = await archive.connect_db(archive_url)
    try:
        assert db.info.server_version >= archive.MIN_SERVER_VERSION
    finally:
        await db.close()
