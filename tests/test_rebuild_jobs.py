"""`rebuild --all` with boards side by side (`--jobs`, ``Rebuilder.jobs``): the boards come back as
their reference says, a retry posted as a board's record comes back is recognised while the other
boards are still being restored, a board's rebuild begins once its own record is confirmed (while
others are still being restored) and never when it is not, and an error in one board's task is
reported once the other tasks have finished their boards, and a second run converges."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from shardlb import keys, rebuild, times
from shardlb.board import Board, Score
from shardlb.cli import main
from shardlb.config import BoardConfig
from shardlb.connection import Scripts
from shardlb.errors import ClusterUnavailable
from shardlb.fanout import Ack
from shardlb.rebuild import Rebuilder
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_archive import archived
from tests.test_board import sharding
from tests.test_rebuild import OnlyStore, Writer, archiver, check, drain, own_archive

# No test here checks the restore's wait for the routers' copies of the ban list (conftest.py).
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("no_ban_propagation_wait")]

SPECS: dict[str, dict[str, Any]] = {
    "jobs-incr": {"mode": "incr", "periods": ["daily"], "sharding": sharding("hash", 3)},
    "jobs-best": {"mode": "best", "tiebreak": "latest", "sharding": sharding("hash", 3)},
    "jobs-set": {"mode": "set", "periods": ["daily"], "sharding": sharding("hash", 2)},
    "jobs-band": {"mode": "incr", "points_max": 100_000, "sharding": sharding("band", 3)},
}


async def lost(raw: Any) -> None:
    """A total loss of Redis: every master flushed (FLUSHALL), as a cluster whose every node lost
    its data is. Every key goes: the boards' keys and their sentinels (``<prefix>here``), the
    registry with its version and change log, the ban list, the deletion marks, the ack markers.
    Until 2026-12-06 this deleted the boards' listed keys, journals and records alone and left their
    sentinels, so a router that kept a board from before the loss wrote to its empty shards after
    the restore (200) where the real loss answers 503 ``board_rebuilding``. Other modules' boards on
    the worker's cluster go too; a test that restores from the suite's own PostgreSQL calls
    ``tests.store_fixture.forget_others_restored`` after it."""
    await raw.flushall(target_nodes=raw.PRIMARIES)


async def written(store: BoardStore, raw: Any, url: str, specs: dict[str, dict[str, Any]]) -> list[Writer]:
    """The boards of ``specs`` written to (part archived, the last batch of each in its journal
    only, lost with Redis) and then lost: their writers."""
    boards = [(await store.create(BoardConfig.from_dict(b, s)))[0] for b, s in specs.items()]
    writers = [Writer(b, f"jobs/{b.config.id}") for b in boards]
    a = await archiver(raw, OnlyStore(store.client, store.scripts, set(specs)), url)
    try:
        for w in writers:
            for _ in range(3):
                await w.batch()
        await drain(a)
        for w in writers:
            await w.batch()  # in the journal only: PostgreSQL never had it
    finally:
        await a.db.close()
    await lost(raw)
    return writers


async def as_archived(url: str, board: Board) -> ReferenceBoard:
    ref = ReferenceBoard(board.config)
    ref.submit(await archived(url, board), now_ms=times.now_ms())
    return ref


class UnderWay:
    """How many boards were at once in a step of the rebuilders (``_restore_board``, ``rebuild``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now: dict[str, set[str]] = {"restore": set(), "rebuild": set()}
        self.most = {"restore": 0, "rebuild": 0}
        restore, rebuild_ = Rebuilder._restore_board, Rebuilder.rebuild

        async def restoring(r: Rebuilder, store: BoardStore, former: Board, *args: Any) -> Any:
            with self.step("restore", former):
                return await restore(r, store, former, *args)

        async def rebuilding(r: Rebuilder, board: Board, *args: Any) -> Any:
            with self.step("rebuild", board):
                return await rebuild_(r, board, *args)

        monkeypatch.setattr(Rebuilder, "_restore_board", restoring)
        monkeypatch.setattr(Rebuilder, "rebuild", rebuilding)

    @contextlib.contextmanager
    def step(self, name: str, board: Board) -> Any:
        self.now[name].add(board.config.id)
        self.most[name] = max(self.most[name], len(self.now[name]))
        try:
            yield
        finally:
            self.now[name].discard(board.config.id)


async def test_boards_rebuilt_side_by_side_come_back_as_their_reference(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four boards of every mode (a band board among them), three at a time: each as PostgreSQL
    has it, and more than one board was under way at once (restore and rebuild alike)."""
    under_way = UnderWay(monkeypatch)
    async with own_archive(postgres_url) as url:
        try:
            writers = await written(store, raw, url, SPECS)
            lines: list[str] = []
            done = await rebuild.run(cluster_url, url, None, progress=lines.append, jobs=3)
            assert sorted(done) == sorted(SPECS)
            assert under_way.most == {"restore": 3, "rebuild": 3}
            for w in writers:
                back = await store.get(w.board.config.id)
                assert back.incarnation == w.board.incarnation
                await check(back, await as_archived(url, back))
                assert f"{w.board.config.id}: restored to the registry" in lines
        finally:
            for b in SPECS:
                with contextlib.suppress(Exception):
                    await store.delete(b)


class Retrying(BoardStore):
    """A board store whose ``restore`` posts, right after a board's record is back in the registry
    (from then on routers find the board), the retries ``sent`` holds for it: their replies go into
    ``replies``, with the boards the other tasks were restoring at that moment."""

    def __init__(self, store: BoardStore, sent: dict[str, list[Score]], under_way: UnderWay) -> None:
        super().__init__(store.client, store.scripts)
        self.sent, self.under_way = sent, under_way
        self.replies: dict[str, list[str]] = {}
        self.beside: set[str] = set()

    async def restore(
        self, config: BoardConfig, incarnation: str, generation: int = 0, rebuilding: Sequence[int] = ()
    ) -> tuple[Board, bool]:
        board, created = await super().restore(config, incarnation, generation, rebuilding)
        self.beside |= self.under_way.now["restore"] - {config.id}
        # Posted as a router of the release before posts it, ignoring the record's mark and the
        # shards' sentinels, which the loss took and the swaps write again (this release's refuses
        # it: tests/test_rebuild_window.py): its retry records must be back.
        assert board.rebuilding == set(range(board.layout.physical))
        board.rebuilding, board.sentinels = frozenset(), False
        replies = await board.submit(self.sent[config.id], now_ms=times.now_ms())
        self.replies[config.id] = [r.status for r in replies]
        return board, created


async def test_a_retry_posted_as_its_board_comes_back_is_recognised_beside_the_other_boards(
    store: BoardStore, raw: Any, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each board's journals are started and its retry records put back before its record comes
    back in the registry, whatever the other tasks are doing: a retry posted the moment a board is
    found again is answered as before the loss (an incr board's `duplicate`, a best board's pinned
    time), and counts once. The other tasks are restoring their boards meanwhile."""
    under_way = UnderWay(monkeypatch)
    now = times.now_ms()
    sent = {
        "jobs-retry-incr": [Score("p1", 10, "m1", now - 60_000), Score("p2", 10, "m2", None)],
        "jobs-retry-best": [Score("p1", 10, "m1", None)],
        "jobs-retry-other": [Score("p3", 10, "m3", now - 60_000)],
    }
    modes = {"jobs-retry-incr": "incr", "jobs-retry-best": "best", "jobs-retry-other": "incr"}
    settings = {"sharding": sharding("hash", 3), "tiebreak": "latest"}  # a later time would win
    configs = [BoardConfig.from_dict(b, {**settings, "mode": m}) for b, m in modes.items()]
    boards = [(await store.create(c))[0] for c in configs]
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, OnlyStore(store.client, store.scripts, set(modes)), url)
        db = await psycopg.AsyncConnection.connect(url, autocommit=True)
        try:
            for board in boards:
                await board.submit(sent[board.config.id])
            await drain(a)
            players = ["p1", "p2", "p3"]
            before = {b.config.id: await b.scores(players) for b in boards}
            await lost(raw)

            async def another() -> psycopg.AsyncConnection[Any]:
                return await psycopg.AsyncConnection.connect(url, autocommit=True)

            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db, jobs=3, connect=another)
            retrying = Retrying(store, sent, under_way)
            restored = await rebuilder.restore(retrying)
            assert retrying.beside  # the others were still being restored meanwhile
            assert retrying.replies == {
                "jobs-retry-incr": ["duplicate", "duplicate"],
                # its first time again, from its pin (the board itself is empty until its rebuild)
                "jobs-retry-best": ["improved"],
                "jobs-retry-other": ["duplicate"],
            }
            await rebuilder.rebuild_all(restored)
            # each counted once, the best board's at its first time (not the retry's arrival)
            assert {b.config.id: await b.scores(players) for b in boards} == before
        finally:
            await db.close()
            await a.db.close()
            for b in modes:
                with contextlib.suppress(Exception):
                    await store.delete(b)


def failing_at(step: str, boards: set[str], at_shard: int | None = None) -> Callable[..., Any]:
    """``Rebuilder.<step>`` (refill, rebuild_shard: called with a board and a shard) that raises
    ClusterUnavailable for ``boards`` (on ``at_shard`` alone, when given)."""
    real = getattr(Rebuilder, step)

    async def fails(self: Rebuilder, board: Board, shard: int, *args: Any) -> Any:
        if board.config.id in boards and at_shard in (None, shard):
            raise ClusterUnavailable(f"{step} of {board.config.id} failed here (a test)", "board")
        return await real(self, board, shard, *args)

    return fails


async def run_again_converges(
    command: list[str], store: BoardStore, url: str, specs: dict[str, dict[str, Any]]
) -> None:
    """The same command run again exits 0 and leaves every board of ``specs`` as archived."""
    assert await asyncio.to_thread(main, command) == 0
    for b in specs:
        back = await store.get(b)
        await check(back, await as_archived(url, back))


@pytest.mark.parametrize("step", ["refill", "rebuild_shard"])
async def test_an_error_in_one_boards_task_is_reported_after_the_others_and_a_second_run_converges(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    step: str,
) -> None:
    """One board's restore (its refill) or rebuild (a shard's) fails: the tasks of the other
    boards finish theirs (a board's rebuild begun as soon as it was restored, every shard of it),
    every error is printed naming its board, then the command exits 1 (no task left running:
    nothing is printed after). Run again, it brings every board back."""
    specs = {f"jobs-fail-{n}": s for n, s in zip("abc", SPECS.values(), strict=False)}
    failing_board = "jobs-fail-b"
    why = f"{step} of {failing_board} failed here (a test)"

    async with own_archive(postgres_url) as url:
        try:
            await written(store, raw, url, specs)
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url, "--jobs", "3"]
            with monkeypatch.context() as patch:
                patch.setattr(Rebuilder, step, failing_at(step, {failing_board}, at_shard=1))
                assert await asyncio.to_thread(main, command) == 1
            out, err = capsys.readouterr()
            assert why in err
            lines = out.splitlines()
            assert f"{failing_board}: stopped: ClusterUnavailable: {why}" in lines
            others = [b for b in specs if b != failing_board]
            if step == "refill":  # the other boards' restores finished; the failing one's not
                assert {f"{b}: restored to the registry" for b in others} <= set(lines)
                assert f"{failing_board}: restored to the registry" not in lines
                assert not [line for line in lines if line.startswith(f"{failing_board} shard 0 (")]
            for b in others:  # a rebuild begun (a board's own, once restored) finished every shard
                shards = specs[b]["sharding"]["shards"]
                if [line for line in lines if line.startswith(f"{b} shard 0 (")]:
                    assert [line for line in lines if line.startswith(f"{b} shard {shards - 1} (")]
            await asyncio.sleep(0.2)
            assert not capsys.readouterr().out  # no task went on after the command returned
            await run_again_converges(command, store, url, specs)
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)


Admin = psycopg.AsyncConnection[Any]


@contextlib.asynccontextmanager
async def archive_of_a_role(postgres_url: str) -> AsyncIterator[tuple[str, Admin, str]]:
    """A database of its own (as ``own_archive``) owned by a role made for the test, not a
    superuser (PostgreSQL holds a role's CONNECTION LIMIT against it, never against a superuser),
    both dropped after: its URL as that role, an admin connection to set the limit on, the role."""
    role = f"jobs_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        try:
            async with own_archive(postgres_url) as url:
                await admin.execute(f"ALTER DATABASE {url.rsplit('/', 1)[1]} OWNER TO {role}")
                parts = urlsplit(url)
                yield parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}").geturl(), admin, role
        finally:
            await admin.execute(f"DROP ROLE IF EXISTS {role}")


async def alone_under_the_limit(url: str) -> None:
    """Returns once the role of ``url`` (its CONNECTION LIMIT just set to 1) holds no session, so
    that the next connection, the CLI's first, gets in. A connection closed just before (the
    archiver's, in ``written``) still counts against the limit until its backend process has exited,
    a while after the client closed it; under load that refused the CLI's first connection. A
    backend drops out of pg_stat_activity a little before it stops counting, so that view is not
    enough: a connection of the role is made (it gets in only if no other is counted) and its own
    backend is waited out until its process is gone (the suite's PostgreSQL runs on this machine).
    Bounded: after 30 s the test fails here, not in the CLI."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            probe = await psycopg.AsyncConnection.connect(url)
            break
        except psycopg.OperationalError as e:
            if "too many connections" not in str(e) or asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)
    pid = probe.info.backend_pid
    await probe.close()
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert asyncio.get_running_loop().time() < deadline, f"backend {pid} still running"
        await asyncio.sleep(0.02)


async def test_a_postgresql_that_takes_no_more_connections_still_restores_every_board(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The recovery after a total loss asked one PostgreSQL connection until --jobs came: a server
    at its connection limit (max_connections, the role's) refuses the others, and the run goes on
    with the connections it has, saying so, rather than failing after the bans went back (until
    2026-12-06, exit 1 and every board missing from the registry)."""
    specs = {f"jobs-limit-{n}": s for n, s in zip("abc", SPECS.values(), strict=False)}
    async with archive_of_a_role(postgres_url) as (url, admin, role):
        try:
            await written(store, raw, url, specs)
            await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT 1")
            await alone_under_the_limit(url)
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url, "--jobs", "3"]
            assert await asyncio.to_thread(main, command) == 0
            lines = capsys.readouterr().out.splitlines()
            assert lines[-1] == "rebuilt 3 board(s)"
            refused = [line for line in lines if line.startswith("PostgreSQL refused a connection")]
            # once: the restores and the rebuilds go on the same tasks (``Rebuilder.recover``)
            assert len(refused) == 1 and refused[0].endswith(": 1 board at a time, not 3")
            assert f'too many connections for role "{role}"' in refused[0]
            await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
            for b in specs:
                back = await store.get(b)
                await check(back, await as_archived(url, back))
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)


class Connections:
    """The PostgreSQL connections opened from here on (psycopg's ``AsyncConnection.connect``
    followed) and the most of them open at once while a board was in a step of the rebuilders
    (``_restore_board``, ``rebuild``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened: list[psycopg.AsyncConnection[Any]] = []
        self.most = {"restore": 0, "rebuild": 0}
        connect = psycopg.AsyncConnection.connect
        restore, rebuild_ = Rebuilder._restore_board, Rebuilder.rebuild

        async def connecting(*args: Any, **kwargs: Any) -> Any:
            db = await connect(*args, **kwargs)
            self.opened.append(db)
            return db

        async def restoring(r: Rebuilder, *args: Any) -> Any:
            self.most["restore"] = max(self.most["restore"], self.open())
            return await restore(r, *args)

        async def rebuilding(r: Rebuilder, *args: Any) -> Any:
            self.most["rebuild"] = max(self.most["rebuild"], self.open())
            return await rebuild_(r, *args)

        monkeypatch.setattr(psycopg.AsyncConnection, "connect", connecting)
        monkeypatch.setattr(Rebuilder, "_restore_board", restoring)
        monkeypatch.setattr(Rebuilder, "rebuild", rebuilding)

    def open(self) -> int:
        return sum(not db.closed for db in self.opened)


async def test_more_jobs_than_boards_open_a_connection_per_board_and_no_board_none(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--jobs 8 for 2 boards: 2 connections at once (the run's and one more), not 8; an archive of
    no board: none more, and `rebuilt 0 board(s)`. Every one is closed at the end."""
    specs = {f"jobs-few-{n}": s for n, s in zip("ab", SPECS.values(), strict=False)}
    async with own_archive(postgres_url) as url:
        try:
            await written(store, raw, url, specs)
            connections = Connections(monkeypatch)
            done = await rebuild.run(cluster_url, url, None, jobs=8)
            assert sorted(done) == sorted(specs)
            assert connections.most == {"restore": 2, "rebuild": 2}
            # the run's and one more, for the restores and the rebuilds alike
            assert len(connections.opened) == 2 and not connections.open()
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)
    async with own_archive(postgres_url) as url:
        await (await archiver(raw, OnlyStore(store.client, store.scripts, set()), url)).db.close()
        connections = Connections(monkeypatch)
        assert await rebuild.run(cluster_url, url, None, jobs=8) == {}
        assert len(connections.opened) == 1 and not connections.open()
        command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url, "--jobs", "8"]
        capsys.readouterr()
        assert await asyncio.to_thread(main, command) == 0
        assert capsys.readouterr().out.splitlines()[-1] == "rebuilt 0 board(s)"


async def test_the_admin_endpoint_reconcile_and_settle_stay_on_one_connection(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rebuild.connected`` without ``jobs`` (the router's POST /v1/boards/{board}:rebuild,
    `reconcile --repair`, the settlement's) holds one PostgreSQL connection, whatever it rebuilds:
    given several boards, ``rebuild_all`` takes them one after another on it."""
    specs = {f"jobs-one-{n}": s for n, s in zip("ab", SPECS.values(), strict=False)}
    boards = [(await store.create(BoardConfig.from_dict(b, s)))[0] for b, s in specs.items()]
    async with own_archive(postgres_url) as url:
        await (await archiver(raw, OnlyStore(store.client, store.scripts, set(specs)), url)).db.close()
        under_way = UnderWay(monkeypatch)
        connections = Connections(monkeypatch)
        try:
            async with rebuild.connected(cluster_url, url) as (rebuilder, _):
                done = await rebuilder.rebuild_all(boards)
            assert sorted(done) == sorted(specs)
            assert under_way.most["rebuild"] == 1
            assert connections.most["rebuild"] == 1 and len(connections.opened) == 1
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)


async def test_a_cancelled_run_ends_every_task_and_closes_every_connection(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ^C (asyncio.run cancels the command's task) while boards are rebuilt side by side: the
    run raises CancelledError once every task has ended, each PostgreSQL connection closed, and no
    task goes on writing after it."""
    specs = {f"jobs-cancel-{n}": s for n, s in zip("abc", SPECS.values(), strict=False)}
    stuck = asyncio.Event()
    real = Rebuilder.rebuild_shard

    async def hangs(self: Rebuilder, board: Board, shard: int, *args: Any) -> Any:
        if board.config.id == "jobs-cancel-b" and shard == 1:
            stuck.set()
            await asyncio.sleep(3600)
        return await real(self, board, shard, *args)

    monkeypatch.setattr(Rebuilder, "rebuild_shard", hangs)
    async with own_archive(postgres_url) as url:
        try:
            await written(store, raw, url, specs)
            connections = Connections(monkeypatch)
            lines: list[str] = []
            run = asyncio.ensure_future(rebuild.run(cluster_url, url, None, progress=lines.append, jobs=3))
            await asyncio.wait_for(stuck.wait(), 120)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            # the run's, then 2 more for the restores and the rebuilds: every one closed
            assert len(connections.opened) == 3 and not connections.open()
            left = [t for t in asyncio.all_tasks() if "side_by_side" in t.get_coro().__qualname__]
            assert not left
            seen = len(lines)
            await asyncio.sleep(0.2)
            assert len(lines) == seen  # nothing went on after
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)


@pytest.mark.parametrize("jobs", ["1", "3"])
async def test_one_job_stops_at_the_failing_board_and_more_report_every_failing_board(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    jobs: str,
) -> None:
    """Two boards' refills fail. --jobs 1 goes as before --jobs came: the first error stops the
    run at its board (the board before it restored, the one after it not begun), printed once, no
    `stopped` line. --jobs 3: both errors are printed naming their boards, the first on stderr
    too, the third board is restored beside them. Exit 1 either way."""
    specs = {f"jobs-two-{n}": s for n, s in zip("abc", SPECS.values(), strict=False)}
    failing_boards = {"jobs-two-b", "jobs-two-c"} if jobs == "3" else {"jobs-two-b"}

    async with own_archive(postgres_url) as url:
        try:
            await written(store, raw, url, specs)
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url, "--jobs", jobs]
            with monkeypatch.context() as patch:
                patch.setattr(Rebuilder, "refill", failing_at("refill", failing_boards))
                capsys.readouterr()
                assert await asyncio.to_thread(main, command) == 1
            out, err = capsys.readouterr()
            lines = out.splitlines()
            stopped = sorted(line for line in lines if ": stopped: " in line)
            assert "jobs-two-a: restored to the registry" in lines
            if jobs == "1":
                assert not stopped
                assert err == "shardlb: error: refill of jobs-two-b failed here (a test)\n"
                assert not await raw.hexists(keys.BOARDS, "jobs-two-c")  # not begun
            else:
                why = "ClusterUnavailable: refill of {} failed here (a test)"
                assert stopped == [f"{b}: stopped: {why.format(b)}" for b in sorted(failing_boards)]
                assert len(err.splitlines()) == 1 and "failed here (a test)" in err
            assert not [line for line in lines if "swapped on try" in line]  # nothing rebuilt
            await run_again_converges(command, store, url, specs)
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)


async def test_a_board_is_rebuilt_as_soon_as_its_record_is_confirmed_while_another_is_restored(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until 2026-12-06 one confirmation of every record restored stood between the restores and
    the rebuilds: no board's rebuild began before the slowest board's restore was done. Now a
    task with no board left to restore rebuilds a board whose own record is confirmed: here one
    board's restore waits (up to 30 s) until another board's rebuild has begun, and does not
    wait in vain. Every rebuild begins after its board's record is confirmed, with its swaps
    waiting for a replica (``confirming``), and every board comes back as PostgreSQL has it."""
    specs = {f"jobs-early-{n}": s for n, s in zip("abc", SPECS.values(), strict=False)}
    slow = "jobs-early-c"
    begun = asyncio.Event()
    confirmed: set[str] = set()
    starts: list[tuple[str, bool, bool, set[str]]] = []  # board, confirmed, confirming, restoring
    restore, confirm, rebuild_ = Rebuilder._restore_board, Rebuilder._confirm_registry, Rebuilder.rebuild

    async def restoring(r: Rebuilder, store: BoardStore, former: Board, *args: Any) -> Any:
        if former.config.id == slow:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(begun.wait(), 30)
        return await restore(r, store, former, *args)

    async def confirming(r: Rebuilder, boards: Any, *args: Any) -> None:
        await confirm(r, boards, *args)
        confirmed.update(b.config.id for b in boards)

    async def rebuilding(r: Rebuilder, board: Board, *args: Any) -> Any:
        now = set(under_way.now["restore"])
        starts.append((board.config.id, board.config.id in confirmed, r.confirming is not None, now))
        begun.set()
        return await rebuild_(r, board, *args)

    monkeypatch.setattr(Rebuilder, "_restore_board", restoring)
    monkeypatch.setattr(Rebuilder, "_confirm_registry", confirming)
    monkeypatch.setattr(Rebuilder, "rebuild", rebuilding)
    under_way = UnderWay(monkeypatch)  # over the patches above: it sees the slow restore as under way
    async with own_archive(postgres_url) as url:
        try:
            await written(store, raw, url, specs)
            done = await rebuild.run(cluster_url, url, None, jobs=3)
            assert sorted(done) == sorted(specs)
            assert sorted(b for b, _, _, _ in starts) == sorted(specs)
            assert all(ok and acked for _, ok, acked, _ in starts)
            assert [b for b, _, _, restoring_now in starts if slow in restoring_now]
            for b in specs:
                back = await store.get(b)
                await check(back, await as_archived(url, back))
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)


async def test_a_record_no_replica_confirms_stops_its_board_before_its_rebuild(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One board's record is not confirmed (its HMGET and WAIT ask one replica more than the
    registry's primary has: a real WAIT that comes back short, as with its replica stopped, but for
    this board alone): that board is never rebuilt, the error is printed naming it and the command
    exits 1, the other boards' rebuilds begun finish. Run again, every board comes back."""
    specs = {f"jobs-unacked-{n}": s for n, s in zip("abc", SPECS.values(), strict=False)}
    failing = "jobs-unacked-b"
    real = rebuild.confirmed

    async def short(client: Any, ack: Ack, commands: Any) -> list[Any]:
        if any(c[0] == "HMGET" and failing in c for c in commands):
            ack = Ack(ack.replicas + 1, 300)
        return await real(client, ack, commands)

    async with own_archive(postgres_url) as url:
        try:
            await written(store, raw, url, specs)
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url, "--jobs", "3"]
            with monkeypatch.context() as patch:
                under_way = UnderWay(patch)
                rebuilt: list[str] = []
                counting = Rebuilder.rebuild

                async def rebuilding(r: Rebuilder, board: Board, *args: Any) -> Any:
                    rebuilt.append(board.config.id)
                    return await counting(r, board, *args)

                patch.setattr(Rebuilder, "rebuild", rebuilding)
                patch.setattr(rebuild, "confirmed", short)
                assert await asyncio.to_thread(main, command) == 1
            assert under_way.most["restore"] >= 2
            out, err = capsys.readouterr()
            lines = out.splitlines()
            why = f"no replica confirmed the registry's restored records of {failing} within"
            assert why in err
            assert [line for line in lines if line.startswith(f"{failing}: stopped: NotAcknowledged: {why}")]
            assert failing not in rebuilt
            assert not [line for line in lines if line.startswith(f"{failing} shard 0 (")]
            for b in rebuilt:  # a rebuild begun finished every shard
                shards = specs[b]["sharding"]["shards"]
                assert [line for line in lines if line.startswith(f"{b} shard {shards - 1} (")]
            assert await asyncio.to_thread(main, command) == 0
            assert f"{failing}: found in the registry" in capsys.readouterr().out.splitlines()
            for b in specs:
                back = await store.get(b)
                await check(back, await as_archived(url, back))
        finally:
            for b in specs:
                with contextlib.suppress(Exception):
                    await store.delete(b)
