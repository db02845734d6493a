"""The `shardlb archive` process and `Archiver.run` when arguments are wrong or a server is away:
a usage error is exit status 2 at once, an outage is a log line that says why and retries that
back off, and what the archiver keeps per board goes with the board."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY

from shardlb import keys, times
from shardlb.archive import Archiver, _journals, connect_db
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

NOBODY = "postgresql://shardlb@127.0.0.1:1/postgres"  # nothing listens on port 1


def archive_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardlb", "archive", *args]


@pytest.mark.parametrize(
    "args",
    [
        ["--postgres", "not a url"],  # was retried for ever as "PostgreSQL not reachable yet"
        ["--metrics-port", "70000"],  # was a traceback (OverflowError from the metrics server)
        ["--metrics-port", "-1"],
        ["--cleanup-every", "-5"],  # was taken, and ran a cleanup pass without pause
        ["--repair-every", "-1"],
        ["--deliver-every", "nan"],
    ],
)
def test_bad_arguments_are_a_usage_error_at_once(cluster_url: str, args: list[str]) -> None:
    argv = ["--redis", cluster_url, "--postgres", NOBODY, *args]
    done = subprocess.run(archive_command(*argv), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("shardlb archive: error:"), done.stderr


def test_the_log_says_why_postgres_is_unreachable(cluster_url: str) -> None:
    """`shardlb archive` logs plain lines; the reason of a failure, kept in the record's fields for
    the router's JSON logs, was left out of them: an operator read "PostgreSQL not reachable yet;
    retrying" every 2 s with nothing saying it was a refused connection, a bad password, ..."""
    process = subprocess.Popen(
        archive_command("--redis", cluster_url, "--postgres", NOBODY, "--repair-every", "0"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = ""
        deadline = time.monotonic() + 30
        while "not reachable" not in line:
            assert time.monotonic() < deadline and process.poll() is None, line
            line = process.stderr.readline()
        assert "OperationalError" in line and "port 1" in line, line
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def failed_rounds() -> float:
    return REGISTRY.get_sample_value("shardlb_archive_failed_rounds_total") or 0.0


async def test_failed_rounds_back_off_and_recover(store: BoardStore, raw: Any, postgres_url: str) -> None:
    """A round that fails (PostgreSQL away) was retried every second for as long as the outage
    lasted, with two warnings each time. The pause now doubles from 1 s (to at most
    RETRY_MAX_S), and the first round that works again goes on at once."""
    config = BoardConfig.from_dict("archive-backoff", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    db = await connect_db(postgres_url)
    await db.close()  # as PostgreSQL leaves it when it goes away
    a = Archiver(raw, store, db, "backoff", db_url=NOBODY)
    stop = asyncio.Event()
    before = failed_rounds()
    task = asyncio.create_task(a.run(stop, idle_s=0.05, refresh_s=0.2))
    try:
        await asyncio.sleep(7.5)  # fixed pauses of 1 s: 7 or 8 failures; doubling: at 0, 1, 3, 7 s
        failures = failed_rounds() - before
        assert 2 <= failures <= 4, failures
        a.db_url = postgres_url  # PostgreSQL is back
        now = times.now_ms()
        await board.submit([Score("back", 1, "m1", now)], now_ms=now)
        deadline = time.monotonic() + 30
        while not await archived_count(postgres_url, board.config.id, board.incarnation):
            assert not task.done(), task
            assert time.monotonic() < deadline, "nothing archived after PostgreSQL came back"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await a.db.close()
        await store.delete(config.id)


async def archived_count(postgres_url: str, board: str, incarnation: str) -> int:
    async with await psycopg.AsyncConnection.connect(postgres_url) as db:
        cur = await db.execute(
            "SELECT count(*) FROM match_results WHERE board = %s AND incarnation = %s", (board, incarnation)
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


async def test_a_deleted_boards_state_is_dropped(store: BoardStore, raw: Any, postgres_url: str) -> None:
    """The archiver kept the journal keys whose consumer group it had made and the boards it had
    recorded in PostgreSQL for its whole life: with boards made and deleted (an event a day, a
    season's boards), both sets only grew."""
    config = BoardConfig.from_dict("archive-forget", {"sharding": {"strategy": "hash", "shards": 3}})
    board, _ = await store.create(config)
    a = Archiver(raw, store, await connect_db(postgres_url), "forget")
    try:
        await a.refresh()
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, "m1", now) for i in range(10)], now_ms=now)
        while await a.round():
            pass
        journals = {keys.journal_key(p) for p in _journals(board)}
        assert journals <= a._groups
        await store.delete(config.id)
        await a.refresh()
        await a.round()
        assert not journals & a._groups, a._groups
        assert (config.id, board.incarnation) not in a._known
    finally:
        await a.db.close()
        if config.id in {c.id for c in await store.list()}:
            await store.delete(config.id)
