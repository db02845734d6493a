"""router/journals.py: the journal furthest behind the archive, in /readyz and /metrics."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from router.journals import JournalWatch
from shardlb import keys
from shardlb.board import Board, Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster


async def test_readyz_and_metrics_show_the_journal_furthest_behind(cluster: LocalCluster) -> None:
    async with running(cluster.url, journal_max_entries=1234, journal_max_results=5678) as (app, client):
        name = board_name("lag")
        assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
        body = {"scores": [{"player_id": f"p{i}", "points": i, "match_id": "m"} for i in range(5)]}
        assert (
            await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        ).status_code == 200
        worst = await service_of(app).journals.check()  # no archiver runs: the entries stay
        assert worst.board is not None and worst.lag.entries >= 1 and worst.lag.results >= 1
        ready = (await client.get("/readyz")).json()
        assert ready["journal"]["bound"] == 1234 and ready["journal"]["entries"] == worst.lag.entries
        assert ready["journal"]["results_bound"] == 5678 and ready["journal"]["results"] == worst.lag.results
        text = (await client.get("/metrics")).text
        assert f"shardlb_journal_lag_entries {float(worst.lag.entries)}" in text
        assert f"shardlb_journal_lag_results {float(worst.lag.results)}" in text
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


class CountedStore(BoardStore):
    """A board store, counting the board listings asked of it: ``boards`` (the archiver's loops)
    and ``follow`` (a check of the journals; one that reads the registry again asks both)."""

    asked = 0

    async def boards(self, reuse: bool = False) -> list[Board]:
        self.asked += 1
        return await super().boards(reuse)

    async def follow(self, whole_every_s: float = 60.0) -> list[Board]:
        self.asked += 1
        return await super().follow(whole_every_s)


def dead_store() -> CountedStore:
    """A store on a client of a closed port: every listing fails at once, as in a Redis outage."""
    dead = connect("redis://127.0.0.1:1")
    return CountedStore(dead, Scripts.register(dead))


async def test_a_redis_outage_logs_the_journal_watch_at_its_start_and_end_not_every_check(
    store: BoardStore, raw: Any
) -> None:
    """The journal watch logged "journal lag not read" at every check it could not make (every
    5 s per worker, for as long as the cluster was out of reach). Now as the ban list's refresh:
    its first failure, then once a minute at most, and an info line when it reads again."""
    from tests.test_moderation_router import until
    from tests.test_router_logs import kept

    down = dead_store()
    watch = JournalWatch(raw, down, 100, 100, every_s=0.001)
    with kept("shardlb.router") as log:
        task = asyncio.create_task(watch.run())
        try:
            await until(lambda: down.asked >= 300, "300 checks")
            failed = down.asked
            up = CountedStore(store.client, store.scripts)
            watch.store = up  # the cluster is back
            await until(lambda: up.asked >= 2, "a check that worked")
        finally:
            watch.closed = True
            await task
            await down.client.aclose()
    warnings = log.lines(logging.WARNING)
    assert [m for m, _ in warnings] == ["journal lag not read"], len(warnings)
    [(message, fields)] = log.lines(logging.INFO)
    assert message == "journal lag read again" and fields["failures"] >= failed


class HeldStore(BoardStore):
    """A board store whose first listing is held, after it is read, until ``go`` is set: a check
    of the journal watch that began before a write and ends after it. It lists the board ``only``
    alone: the session's cluster holds the journals other modules left behind, further behind."""

    def __init__(self, client: Any, scripts: Scripts, only: str) -> None:
        super().__init__(client, scripts)
        self.only = only
        self.listed = asyncio.Event()
        self.go = asyncio.Event()
        self.holding = False

    async def boards(self, reuse: bool = False) -> list[Board]:
        listed = [b for b in await super().boards(reuse) if b.config.id == self.only]
        if not self.holding:
            self.holding = True
            self.listed.set()
            await self.go.wait()
        return listed


async def test_a_check_begun_before_a_newer_one_does_not_replace_its_view(
    store: BoardStore, raw: Any
) -> None:
    """The CI run of stop 50 failed here: /readyz showed 0 entries just after a check had found
    the new board's entry. The watch's own loop had listed the boards before the board was made,
    finished after the test's check, and put its older view in place of the newer one."""
    name = board_name("late")
    held = HeldStore(store.client, store.scripts, only=name)
    watch = JournalWatch(raw, held, 1000, 1000)
    early = asyncio.create_task(watch.check())  # the loop's check: lists the boards, then waits
    await held.listed.wait()
    board, _ = await store.create(BoardConfig.from_dict(name, {}))
    try:
        await board.submit([Score("p1", 5, "m")])
        await watch.check()  # the test's check, begun after the write and done before the loop's
        held.go.set()
        await early
        assert watch.worst.board == board.config.id and watch.worst.lag.entries == 1, watch.worst
    finally:
        await store.delete(board.config.id)


async def journal_reads(client: Any) -> int:
    """XLEN calls the cluster's primaries have run (INFO commandstats): one per journal a check reads."""
    stats = await client.info("commandstats", target_nodes=client.PRIMARIES)
    return sum(int(node.get("cmdstat_xlen", {}).get("calls", 0)) for node in stats.values())


async def test_one_check_of_the_journals_serves_every_worker(store: BoardStore, raw: Any) -> None:
    """Every worker of every router read every journal itself every 5 s: with 2,000 boards of 10
    shards, 60,000 commands a check per worker, one after another (7 s on loopback, longer than the
    interval), so a thousand workers kept the cluster busy with lag reads alone. A check's reading
    is now published for ``every_s``, and a worker's loop takes it instead of reading the journals."""
    from tests.test_moderation_router import until

    board, _ = await store.create(BoardConfig.from_dict(board_name("shared"), {}))
    await raw.delete(keys.JOURNAL_LAG, keys.JOURNAL_LAG_LEASE)
    first = JournalWatch(raw, store, 1000, 1000, every_s=60)
    second = JournalWatch(raw, store, 1000, 1000, every_s=60)
    tasks = []
    try:
        await board.submit([Score("p1", 5, "m")])
        before = await journal_reads(raw)
        tasks.append(asyncio.create_task(first.run()))
        await until(lambda: first.kept > 0, "the first worker's check")
        read = await journal_reads(raw) - before
        assert read >= 1 and first.worst.lag.entries >= 1
        tasks.append(asyncio.create_task(second.run()))
        await until(lambda: second.kept > 0, "the second worker's view")
        assert await journal_reads(raw) - before == read  # the second worker read no journal
        assert (second.worst.board, second.worst.lag.entries) == (first.worst.board, first.worst.lag.entries)
    finally:
        first.closed = second.closed = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await raw.delete(keys.JOURNAL_LAG, keys.JOURNAL_LAG_LEASE)
        await store.delete(board.config.id)


async def test_a_check_that_outlived_its_lease_leaves_the_next_holders_lease(
    store: BoardStore, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check that outlives its lease (``LEASE_MS``) lets another worker take it; when the first
    ended, it deleted the lease whoever held it (a plain DEL), and a third worker could check beside
    the second. It now deletes the lease only while it still holds its own."""
    import router.journals

    monkeypatch.setattr(router.journals, "LEASE_MS", 100)
    await raw.delete(keys.JOURNAL_LAG, keys.JOURNAL_LAG_LEASE)
    slow = JournalWatch(raw, store, 1000, 1000, every_s=0.05)
    checked = asyncio.Event()
    release = asyncio.Event()

    async def slow_check() -> Any:
        checked.set()
        await release.wait()  # past its lease

    monkeypatch.setattr(slow, "check", slow_check)
    try:
        task = asyncio.create_task(slow.look())
        await checked.wait()
        await asyncio.sleep(0.3)  # the lease expired: another worker takes it
        assert await raw.set(keys.JOURNAL_LAG_LEASE, b"another", nx=True, px=60_000)
        release.set()
        await task
        assert await raw.get(keys.JOURNAL_LAG_LEASE) == b"another"
    finally:
        await raw.delete(keys.JOURNAL_LAG, keys.JOURNAL_LAG_LEASE)


async def test_a_check_makes_boards_only_of_records_that_changed(
    store: BoardStore, raw: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A check listed the registry and made a Board of every record, 200 ms of the checking
    worker's event loop at 2,000 boards, every 5 s. A Board is now made again only for a record
    whose bytes changed since the last check (``BoardStore.boards(reuse=True)``)."""
    board, _ = await store.create(BoardConfig.from_dict(board_name("reused"), {}))
    watch = JournalWatch(raw, store, 1000, 1000, every_s=60)
    made: list[str] = []
    make = store._board

    def counted(board_id: str, record: Any) -> Any:
        made.append(board_id)
        return make(board_id, record)

    monkeypatch.setattr(store, "_board", counted)
    try:
        await watch.check()
        assert board.config.id in made
        made.clear()
        await watch.check()
        assert made == []
        other, _ = await store.create(BoardConfig.from_dict(board_name("reused-new"), {}))
        made.clear()
        await watch.check()
        assert made == [other.config.id]
        await store.delete(other.config.id)
    finally:
        await store.delete(board.config.id)


async def test_a_check_reads_the_registry_only_when_its_version_moved(store: BoardStore, raw: Any) -> None:
    """A check read the whole registry (1.1 MB at 2,000 boards) every 5 s. It now reads it again
    only when the registry's version moved (``BoardStore.follow``): a board created is in the next
    check all the same."""
    from tests.test_archive import registry_reads

    board, _ = await store.create(BoardConfig.from_dict(board_name("followed"), {}))
    watch = JournalWatch(raw, store, 1000, 1000, every_s=60)
    other = None
    try:
        await watch.check()
        before = await registry_reads(store.client)
        for _ in range(3):
            await watch.check()
        assert await registry_reads(store.client) == before
        other, _ = await store.create(BoardConfig.from_dict(board_name("followed-new"), {}))
        await watch.check()
        assert await registry_reads(store.client) == before + 1
    finally:
        await store.delete(board.config.id)
        if other is not None:
            await store.delete(other.config.id)
