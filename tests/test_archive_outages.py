"""The `shardlb archive` process and `Archiver.run` when arguments are wrong or a server is away:
a usage error is exit status 2 at once, an outage is a log line that says why and retries that
back off, and what the archiver keeps per board goes with the board."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, cast

import psycopg
import pytest
from prometheus_client import REGISTRY

import shardlb.archive
from shardlb import keys, moderation, pgconn, settlement_delivery, times
from shardlb.archive import Archiver, _cleanup, _journals, _watch_lag, connect_db, repair_bands, serve
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.connection import connect
from shardlb.errors import BoardNotFound, Resharding
from shardlb.journal import Lag, journal_lag
from shardlb.store import BoardStore
from tests.test_moderation_router import until
from tests.test_router_journals import dead_store
from tests.test_router_logs import Kept, kept

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


async def test_failed_rounds_back_off_and_recover(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that fails (PostgreSQL away) was retried every second for as long as the outage
    lasted, with two warnings each time. The pause now doubles from RETRY_FIRST_S (to at most
    RETRY_MAX_S), and the first round that works again goes on at once. The first pause is a
    quarter of production's 1 s here, and so is the time watched: the same count of failures
    tells doubling from fixed pauses, and the round after the outage comes at 3.75 s, not at 15 s
    (until 2026-12-07 the test waited out production's pauses, 15 s of the suite's time)."""
    # Production's pauses: 1 s, doubling.
    assert [shardlb.archive.retry_pause(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    monkeypatch.setattr(shardlb.archive, "RETRY_FIRST_S", 0.25)
    config = BoardConfig.from_dict("archive-backoff", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    db = await connect_db(postgres_url)
    await db.close()  # as PostgreSQL leaves it when it goes away
    a = Archiver(raw, store, db, "backoff", db_url=NOBODY)
    stop = asyncio.Event()
    before = failed_rounds()
    task = asyncio.create_task(a.run(stop, idle_s=0.05, refresh_s=0.2))
    try:
        # Fixed pauses of 0.25 s: 7 or 8 failures; doubling: at 0, 0.25, 0.75, 1.75 s (the next at 3.75)
        await asyncio.sleep(1.875)
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


# ---- outages of the archiver's loops: logged at their start, once a minute and at their end --------


async def staged(
    logger: str,
    run: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
    failures: Callable[[], int],
    recover: Callable[[], None],
    worked: Callable[[Kept], bool],
) -> Kept:
    """The log lines of ``run(stop)`` through an outage: at least 100 failures, then ``recover()``
    and wait until ``worked(lines)``."""
    stop = asyncio.Event()
    with kept(logger) as log:
        task = asyncio.create_task(run(stop))
        try:
            await until(lambda: failures() >= 100, "100 failures")
            recover()
            await until(lambda: worked(log), "a try that worked")
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
    return log


# Warnings that are not the outage's: the suite's PostgreSQL holds other modules' boards, which an
# archive round that reaches it reports as missing from its registry, and their settlements, whose
# due webhooks a sweep that reaches it tries (tests/test_settlement_webhooks.py's failing receivers).
ELSEWHERE = ("a board the archive holds is missing from the registry", "webhook delivery raised")


def warned(log: Kept) -> list[tuple[str, dict[str, Any]]]:
    """The warnings ``log`` kept, those of other modules' boards (``ELSEWHERE``) left out."""
    return [line for line in log.lines(logging.WARNING) if not line[0].startswith(ELSEWHERE)]


def one_outage(log: Kept, message: str, recovered: str, failures: int) -> None:
    """The outage was one warning (its first failure: the test's last less than a minute) and one
    info line with every failure."""
    warnings = warned(log)
    assert [m for m, _ in warnings] == [message], len(warnings)
    [(_, fields)] = [line for line in log.lines(logging.INFO) if line[0] == recovered]
    assert fields["failures"] >= failures


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shardlb.archive, "retry_pause", lambda failures: 0.001)


class Lags:
    """``Archiver.lag`` of a client that can be swapped: a closed port's, then the cluster's."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.asked = self.read = 0

    async def lag(self) -> dict[str, Lag]:
        self.asked += 1
        lag = await journal_lag(self.client, keys.journal_key("lb:{nothing:0}"))
        self.read += 1
        return {"k": lag}


async def test_a_redis_outage_logs_the_lag_watch_at_its_start_and_end(raw: Any) -> None:
    """``_watch_lag`` logged "journal lag not read" at every failed reading (every 5 s)."""
    lags = Lags(connect("redis://127.0.0.1:1", decode=False))
    dead = lags.client

    def recover() -> None:
        lags.client = raw

    run = functools.partial(_watch_lag, cast(Archiver, lags), every_s=0.001)
    log = await staged(
        "shardlb.archive", lambda stop: run(stop), lambda: lags.asked, recover, lambda _: lags.read >= 2
    )
    await dead.aclose()
    one_outage(log, "journal lag not read", "journal lag read again", 100)


@pytest.mark.parametrize("loop", ["cleanup", "repair"])
async def test_a_redis_outage_logs_the_cleanup_and_the_band_repair_at_its_start_and_end(
    store: BoardStore, loop: str
) -> None:
    """``_cleanup`` and ``repair_bands`` logged a warning at every pass that could not list the
    boards."""
    down = dead_store()
    dead = down.client
    at = [0]

    def recover() -> None:
        down.client, down.scripts = store.client, store.scripts
        at[0] = down.asked

    if loop == "cleanup":
        run = functools.partial(_cleanup, down, every_s=0.001)
        message, recovered = "inactive cleanup failed; retrying", "inactive cleanup works again"
    else:
        run = functools.partial(repair_bands, down, every_s=0.001)
        message, recovered = "band repair failed; retrying", "band repair works again"

    def worked(_: Kept) -> bool:  # a pass after the one that listed the boards again
        return down.asked - at[0] >= 2

    log = await staged("shardlb.archive", lambda stop: run(stop), lambda: down.asked, recover, worked)
    await dead.aclose()
    one_outage(log, message, recovered, 100)


async def test_a_postgresql_outage_logs_the_archive_rounds_at_its_start_and_end(
    store: BoardStore, raw: Any, postgres_url: str, fast_retries: None
) -> None:
    """A failed round logged "archive round failed" and "PostgreSQL not reachable" each time: with
    the pause at its cap of 30 s, four warnings a minute for as long as PostgreSQL was away."""
    db = await connect_db(postgres_url)
    await db.close()  # as PostgreSQL leaves it when it goes away
    a = Archiver(raw, store, db, "outage", db_url=NOBODY)
    rounds = [0]
    round_of = a.round

    async def counted() -> int:
        done = await round_of()
        rounds[0] += 1
        return done

    a.round = counted  # type: ignore[method-assign]
    before = failed_rounds()

    def recover() -> None:
        a.db_url = postgres_url

    try:
        log = await staged(
            "shardlb.archive",
            lambda stop: a.run(stop, idle_s=0.001, refresh_s=0.001),
            lambda: int(failed_rounds() - before),
            recover,
            lambda _: rounds[0] >= 2,
        )
    finally:
        await a.db.close()
    warnings = warned(log)
    assert {m for m, _ in warnings} == {
        "PostgreSQL not reachable; retrying",
        "archive round failed; retrying",
    }
    assert len(warnings) == 2, warnings
    infos = [m for m, _ in log.lines(logging.INFO)]
    assert infos.count("archive rounds work again") == 1 and infos.count("PostgreSQL reachable again") == 1


async def test_postgresql_away_at_start_is_logged_at_its_start_and_end(
    cluster_url: str, postgres_url: str, fast_retries: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve`` logged "PostgreSQL not reachable yet" at each try until it could connect."""
    tries: list[str] = []
    up = [False]

    async def counted(url: str) -> Any:
        tries.append(url)
        return await connect_db(postgres_url if up[0] else url)

    monkeypatch.setattr(shardlb.archive, "connect_db", counted)

    def recover() -> None:
        up[0] = True

    log = await staged(
        "shardlb.archive",
        lambda stop: serve(cluster_url, NOBODY, "outage-start", stop),
        lambda: len(tries),
        recover,
        lambda lines: "archiver running" in [m for m, _ in lines.lines(logging.INFO)],
    )
    one_outage(log, "PostgreSQL not reachable yet; retrying", "PostgreSQL reachable", 100)
    assert "OperationalError" in str(warned(log)[0][1]["error"])


async def test_a_postgresql_outage_logs_the_webhook_sweep_at_its_start_and_end(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sweep_forever`` logged "webhook sweep failed" at every sweep it could not make."""
    tries: list[str] = []
    up = [False]
    swept = [0]
    connect = psycopg.AsyncConnection.connect
    sweep = settlement_delivery.sweep

    async def counted(url: str, **options: Any) -> Any:
        tries.append(url)
        return await connect(postgres_url if up[0] else url, **options)

    async def counted_sweep(*args: Any) -> int:
        done = await sweep(*args)
        swept[0] += 1
        return done

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", counted)
    monkeypatch.setattr(settlement_delivery, "sweep", counted_sweep)

    def recover() -> None:
        up[0] = True

    log = await staged(
        "shardlb.settlement",
        lambda stop: settlement_delivery.sweep_forever(NOBODY, "s" * 32, stop, every_s=0.001),
        lambda: len(tries),
        recover,
        lambda _: swept[0] >= 2,
    )
    one_outage(log, "webhook sweep failed; retrying", "webhook sweep works again", 100)


async def test_a_stop_ends_an_archiver_whose_postgresql_never_answers(
    cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An address that takes the connection and then answers nothing (a hung server, a failover's
    old address behind a proxy) held `serve` in its connect for psycopg's default of 130 s, past a
    pod's 30 s grace period: a SIGTERM then ended in SIGKILL, not in an orderly stop. The connect
    gives up after ``pgconn.CONNECT_TIMEOUT_S``: production's 10 s (tests/test_pgconn.py) is held
    within the 25 s the stop is given here, and the connect waits libpq's least, 2 s (until
    2026-12-07 it waited out the 10 s)."""
    assert pgconn.CONNECT_TIMEOUT_S < 25
    monkeypatch.setattr(pgconn, "CONNECT_TIMEOUT_S", 2)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the connection is made, and never served
        url = f"postgresql://shardlb@127.0.0.1:{silent.getsockname()[1]}/shardlb"
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cluster_url, url, "silent-postgres", stop))
        stop.set()
        await asyncio.wait_for(task, 25)


@pytest.mark.parametrize(
    "error",
    [
        Resharding("board 'x' is being resharded; retry", 1.0),  # the nightly bands Job's reshard
        BoardNotFound("board 'x' was deleted", "board"),  # deleted between the listing and its removal
    ],
)
async def test_a_board_resharded_or_deleted_under_the_cleanup_does_not_end_it(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """A pass that met a board being resharded or deleted (the library's error, not an outage of
    the cluster) ended ``_cleanup`` for the archiver's life, logging nothing: ``serve`` gathers its
    tasks only when it stops. The pass is logged and the next one runs."""
    passes = [0]
    real = moderation.cleanup_pass

    async def fails_once(given: BoardStore) -> dict[str, int]:
        passes[0] += 1
        if passes[0] == 1:
            raise error
        return await real(given)

    monkeypatch.setattr(moderation, "cleanup_pass", fails_once)
    stop = asyncio.Event()
    with kept("shardlb.archive") as log:
        task = asyncio.create_task(_cleanup(store, stop, 0.001))
        try:
            await until(lambda: passes[0] >= 3 or task.done(), "three cleanup passes")
            assert not task.done(), task.exception()
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
    assert log.lines(logging.WARNING)[0][0] == "inactive cleanup failed; retrying"
    assert log.lines(logging.INFO)[0][0] == "inactive cleanup works again"
