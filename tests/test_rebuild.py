"""Rebuild (issue 11, item 3) against the suite's cluster and a real PostgreSQL: a board damaged in
Redis comes back as the reference board says, for every mode and strategy, with part of its results
archived and part still in the journals; a rebuild while writers keep writing (and the archiver keeps
trimming) loses and doubles nothing, and readers never see the board shrink; `rebuild --all` puts
boards whose every key was lost back in the registry with their incarnation, then their players."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import redis.exceptions

from shardlb import keys, moderation, times
from shardlb.archive import Archiver, connect_db
from shardlb.board import MAX_FUTURE_MS, Board, Score
from shardlb.cli import main
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.errors import BoardConflict, ClusterUnavailable, NotAcknowledged
from shardlb.reads import ResolvedView
from shardlb.rebuild import Rebuilder
from shardlb.settlement import period_bounds
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.removal_support import JournalReads, filled
from tests.router_support import AS_ADMIN, AS_WRITER, running
from tests.store_fixture import forget_others_restored
from tests.test_ack import key_replica_pid, stopped
from tests.test_archive import archived
from tests.test_board import HOUR, expected_entries, sharding

# No test here checks the restore's wait for the routers' copies of the ban list (conftest.py).
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("no_ban_propagation_wait")]


async def archiver(raw: Any, store: BoardStore, postgres_url: str, only: set[str] | None = None) -> Archiver:
    """An archiver of every board in ``store``'s registry, or of the boards named ``only``
    (``OnlyStore``): not those other modules left on the worker's cluster, which each round reads."""
    if only is not None:
        store = OnlyStore(store.client, store.scripts, only)
    a = Archiver(raw, store, await connect_db(postgres_url), "rebuild-tests", claim_idle_s=0)
    await a.refresh()
    return a


async def archive_round(a: Archiver) -> int:
    """One archive round, made again after a dropped connection, as ``Archiver.run`` would (a failed
    round leaves its entries to read again)."""
    for _ in range(10):
        try:
            return await a.round()
        except redis.exceptions.ConnectionError:
            await asyncio.sleep(0.05)
    return await a.round()


async def drain(a: Archiver) -> int:
    """Archive rounds until one finds nothing; the entries archived in all."""
    archived = 0
    while got := await archive_round(a):
        archived += got
    return archived


async def archive_until(a: Archiver, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if not await archive_round(a):
            await asyncio.sleep(0.005)


class Writer:
    """Random batches sent to the board and fed to the reference in the order they were answered."""

    def __init__(self, board: Board, seed: str, players: int = 30, zeros: float = 0.0) -> None:
        self.board = board
        self.zeros = zeros  # the share of new results that score 0 points
        self.ref = ReferenceBoard(board.config)
        self.rng = random.Random(seed)
        self.players = [f"p{i:03d}" for i in range(players)]
        self.regions = list(board.config.sharding.regions)
        self.home: dict[str, str] = {}
        self.sent: list[Score] = []

    async def batch(self, size: int = 30) -> None:
        now = times.now_ms()
        batch = []
        for _ in range(size):
            if self.sent and self.rng.random() < 0.2:
                batch.append(self.rng.choice(self.sent))  # a client's retry
                continue
            player = self.rng.choice(self.players)
            region = self.home.setdefault(player, self.rng.choice(self.regions)) if self.regions else None
            at = now - self.rng.choice([0, 1, 30]) * HOUR
            points = 0 if self.zeros and self.rng.random() < self.zeros else self.rng.randrange(0, 300)
            batch.append(Score(player, points, f"m{len(self.sent)}", at, region))
            self.sent.append(batch[-1])
        await self.board.submit(batch, now_ms=now)
        self.ref.submit(batch, now_ms=now)


async def check(board: Board, ref: ReferenceBoard) -> None:
    """Every period board the reference holds, through the board's reads (band shards included)."""
    assert ref.boards
    for name in ref.boards:
        api = "total" if name == "total" else {"d": "daily"}[name[0]] + ":" + name[2:]
        want = expected_entries(ref, name, None)
        assert await board.top(len(want) + 5, board.resolve(api)) == want, name


async def damage(board: Board, client: Any) -> None:
    """Lose one shard's total, add a stranger to another, and change a score in a period board."""
    first, second = board.prefixes[0], board.prefixes[1 % len(board.prefixes)]
    await client.delete(keys.period_key(first, "total"))
    await client.zadd(keys.period_key(second, "total"), {"stranger": 123})
    for name in await client.zrange(keys.index_key(second), 0, -1):
        if name.startswith(second.encode() + b"d:"):
            members = await client.zrange(name, 0, 0)
            if members:
                await client.zadd(name, {members[0]: 7})


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize("strategy", ["hash", "region", "band"])
async def test_a_damaged_board_is_rebuilt_as_the_reference_says(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, strategy: str, mode: str
) -> None:
    config = BoardConfig.from_dict(
        f"rebuild-{strategy}-{mode}",
        {"mode": mode, "periods": ["daily"], "points_max": 500, "sharding": sharding(strategy, 3)},
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        w = Writer(board, f"rebuild/{strategy}/{mode}")
        for _ in range(3):
            await w.batch()
        await drain(a)  # archived and trimmed ...
        for _ in range(2):
            await w.batch()  # ... and still only in the journals
        await check(board, w.ref)
        await damage(board, raw)
        with pytest.raises(AssertionError):
            await check(board, w.ref)
        reports = await rebuilder.rebuild(board)
        assert sum(r.rows for r in reports) > 0 and sum(r.journal for r in reports) > 0
        await check(board, w.ref)
        await w.batch()  # the rebuilt board takes writes as before
        await check(board, w.ref)
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
@pytest.mark.parametrize("strategy", ["hash", "region", "band"])
async def test_an_incr_board_with_results_of_no_points_is_rebuilt_in_its_live_order(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: Any,
    strategy: str,
    tiebreak: str,
) -> None:
    """Many 0-point results, some at a player's latest time: the rebuild (the archive's rows and the
    journal's entries folded, then the results written since its snapshot applied by rebuild.lua,
    on the temporary keys or after a forced swap on the live ones) keeps each player's time as the
    live board has it (the latest result that scored; the earliest for a player of 0 points)."""
    config = BoardConfig.from_dict(
        f"rebuild-zeros-{strategy}-{tiebreak}",
        {"mode": "incr", "tiebreak": tiebreak, "periods": ["daily"], "points_max": 100_000,
         "sharding": sharding(strategy, 3)},
    )  # fmt: skip
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        w = Writer(board, f"zeros/{strategy}/{tiebreak}", players=20, zeros=0.5)
        for _ in range(3):
            await w.batch()
        await drain(a)
        for _ in range(2):
            await w.batch()
        await check(board, w.ref)
        live = {name: await board.top(100, board.resolve(name)) for name in ("total",)}
        await raw.delete(*(keys.period_key(p, "total") for p in board.prefixes))
        await rebuilder.rebuild(board)
        await check(board, w.ref)
        assert {name: await board.top(100, board.resolve(name)) for name in live} == live
        real_snapshot = rebuilder.snapshot

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await w.batch(10)  # after the snapshot: applied by rebuild.lua
            return snap

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        for tries in (50, 0):  # the tail on the temporary keys; after a forced swap, on the live ones
            rebuilder.swap_tries = tries
            await rebuilder.rebuild(board)
            await check(board, w.ref)
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("swap_tries", [50, 1])
@pytest.mark.parametrize(("mode", "strategy"), [("incr", "hash"), ("best", "band"), ("set", "region")])
async def test_a_rebuild_under_writes_loses_and_doubles_nothing(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    cluster_url: str,
    mode: str,
    strategy: str,
    swap_tries: int,
) -> None:
    """Writers and the archiver go on throughout; with one swap try the swap is forced and the
    results written meanwhile are applied after it (the fallback path)."""
    config = BoardConfig.from_dict(
        f"rebuild-live-{mode}-{strategy}-{swap_tries}",
        {"mode": mode, "periods": ["daily"], "points_max": 100_000, "sharding": sharding(strategy, 3)},
    )
    board, _ = await store.create(config)
    own = connect(cluster_url, decode=False)  # the archiver's own connections, as in production
    a = await archiver(own, store, postgres_url, {config.id})
    stop = asyncio.Event()
    archiving = asyncio.create_task(archive_until(a, stop))
    w = Writer(board, f"live/{mode}/{swap_tries}", players=200, zeros=0.3 if mode == "incr" else 0.0)
    for _ in range(5):
        await w.batch()
    floor = await board.size()
    sizes: list[int] = []

    async def write() -> None:
        while not stop.is_set():
            await w.batch(10)
            await asyncio.sleep(0)

    async def read() -> None:
        while not stop.is_set():
            sizes.append(await board.size())
            await asyncio.sleep(0.001)

    tasks = [asyncio.create_task(write()), asyncio.create_task(write()), asyncio.create_task(read())]
    try:
        rebuilder.swap_tries = swap_tries
        for _ in range(2):
            reports = await rebuilder.rebuild(board)
        stop.set()
        await asyncio.gather(*tasks, archiving)
        assert len(w.sent) > 100 and sizes
        assert min(sizes) >= floor  # never empty, never a shard missing
        if swap_tries == 1:
            assert any(r.tries > 1 for r in reports) or all(r.journal == 0 for r in reports)
        await check(board, w.ref)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, archiving)
        await a.db.close()
        await own.aclose()
        await store.delete(config.id)


def lose(raw: Any, how: str) -> Callable[[str, dict[str, int]], Awaitable[Any]]:
    """What a failover between the fill and the swap does to a temporary key that never reached the
    promoted replica (or reached it in part): gone, one member short, or one hash field short."""
    if how == "key":
        return lambda key, _: raw.delete(key)
    if how == "member":
        return lambda key, members: raw.zrem(key, next(iter(members)))
    return lambda key, members: raw.hdel(key, next(iter(members)))


@pytest.mark.parametrize(("strategy", "how"), [("hash", "key"), ("hash", "member"), ("band", "field")])
async def test_temporary_keys_lost_before_the_swap_are_filled_again(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, strategy: str, how: str
) -> None:
    """A durability audit's finding: a failover between the fill and the swap (the fill written on
    the master, never replicated to the replica promoted) left the temporary keys missing or short
    while the journal was still at the snapshot's position; the swap took a missing key for a period
    with no player and unlinked the live board (or swapped in a partial one), and the rebuild said
    ok. The swap now checks each temporary key's size against what was filled (sorted sets and the
    band shards' version hashes), and the rebuild fills again from a new snapshot."""
    config = BoardConfig.from_dict(
        f"rebuild-lost-{strategy}-{how}", {"periods": ["daily"], "sharding": sharding(strategy, 3)}
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    real_fill, dropped = rebuilder._fill, []

    async def fill(key: str, members: dict[str, int], hash: bool = False) -> None:
        await real_fill(key, members, hash)
        if not dropped and members and hash == (how == "field"):
            await lose(raw, how)(key, members)
            dropped.append(key)

    try:
        w = Writer(board, f"lost/{strategy}/{how}")
        for _ in range(3):
            await w.batch()
        await drain(a)
        await w.batch()
        rebuilder._fill = fill  # type: ignore[method-assign]
        reports = await rebuilder.rebuild(board)
        assert dropped
        await check(board, w.ref)
        players = set(w.ref.boards["total"])
        for prefix in board.prefixes[config.sharding.shards :]:  # every band shard knows every version
            assert {p.decode() for p in await raw.hkeys(keys.version_key(prefix))} == players
        assert sum(r.tries for r in reports) == len(reports) + 1  # the lost swap, then the good one
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("step", ["refill", "fill", "swap", "activity", "band swap"])
async def test_a_rebuild_killed_at_any_step_converges_when_run_again(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, step: str
) -> None:
    """A rebuild of one board stopped right after one of its steps (a kill, a lost connection),
    then run again by a fresh process: the board is as the reference says, with the writes taken
    between the two runs."""
    config = BoardConfig.from_dict(
        f"rebuild-killed-{step.replace(' ', '-')}",
        {"mode": "incr", "periods": ["daily"], "inactive_after": 3600, "sharding": sharding("band", 3)},
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    name = {"fill": "_fill", "swap": "_swap_keys", "band swap": "_swap_keys", "activity": "recall_activity"}
    real = getattr(rebuilder, name.get(step, step))

    async def killed(*args: Any, **kwargs: Any) -> Any:
        done = await real(*args, **kwargs)
        if step != "band swap" or args[0] in board.prefixes[config.sharding.shards :]:
            raise Killed(step)  # right after the step's first call (a band shard's swap)
        return done

    try:
        w = Writer(board, f"killed/{step}")
        for _ in range(3):
            await w.batch()
        await drain(a)
        await w.batch()
        await damage(board, raw)
        setattr(rebuilder, name.get(step, step), killed)
        with pytest.raises(Killed):
            await rebuilder.rebuild(board)
        await w.batch()  # taken between the two runs
        again = await store.get(config.id)
        await Rebuilder(raw, Scripts.register(raw).rebuild, rebuilder.db).rebuild(again)
        await check(again, w.ref)
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_rebuild_whose_temporary_keys_keep_being_lost_changes_nothing(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """Filled again a bounded number of times, then refused with the live board left as it was."""
    config = BoardConfig.from_dict("rebuild-lost-always", {"sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    real_fill = rebuilder._fill

    async def fill(key: str, members: dict[str, int], hash: bool = False) -> None:
        await real_fill(key, members, hash)
        await raw.delete(key)

    try:
        await board.submit([Score(f"p{i}", i, f"m{i}", times.now_ms()) for i in range(1, 11)])
        rebuilder._fill = fill  # type: ignore[method-assign]
        with pytest.raises(ClusterUnavailable, match="temporary keys"):
            await rebuilder.rebuild(board)
        assert await board.size(board.resolve("total")) == 10
        assert not await raw.keys(f"{board.prefixes[0]}tmp:*")
    finally:
        await store.delete(config.id)


async def test_rebuild_all_restores_boards_whose_keys_were_all_lost(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    configs = [
        BoardConfig.from_dict(
            "rebuild-all-band", {"mode": "incr", "points_max": 100_000, "sharding": sharding("band", 3)}
        ),
        BoardConfig.from_dict(
            "rebuild-all-region", {"periods": ["daily"], "sharding": sharding("region", 3)}
        ),
    ]
    boards = [(await store.create(c))[0] for c in configs]
    writers = [Writer(b, f"all/{b.config.id}") for b in boards]
    # `rebuild --all` rebuilds every board its archive knows: an archive of the test's own, kept by
    # an archiver that sees the test's boards alone. Run on the suite's PostgreSQL, the command also
    # rebuilt every board other modules had left in the cluster and an archiver had recorded there,
    # and refused one whose journal an archiver of another database had trimmed: it exited 1 (a
    # board of tests/test_ack.py, then test_the_boards_a_rebuild_all_swaps_in_wait_for_a_replica
    # and test_the_admin_endpoint_rebuilds_a_board before this test, in one session).
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, OnlyStore(store.client, store.scripts, {c.id for c in configs}), url)
        try:
            for w in writers:
                for _ in range(3):
                    await w.batch()
            await drain(a)
            await writers[0].batch()  # in the journal only: lost with Redis, as PostgreSQL never had it
            lost_incarnations = [b.incarnation for b in boards]
            # A total loss of Redis: every key goes, the boards' sentinels, the registry and its
            # version and change log included (deleting the boards' listed keys and records alone
            # left the sentinels, which the real loss takes).
            await raw.flushall(target_nodes=raw.PRIMARIES)
            await a.refresh()  # a running archiver looks at the empty registry before the operator acts
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0  # the command runs its own event loop
            out = capsys.readouterr().out
            for board, incarnation in zip(boards, lost_incarnations, strict=True):
                assert f"{board.config.id}: restored to the registry" in out
                back = await store.get(board.config.id)
                assert back.incarnation == incarnation
                ref = ReferenceBoard(board.config)
                ref.submit(await archived(url, back), now_ms=times.now_ms())
                await check(back, ref)
        finally:
            await a.db.close()
            for c in configs:
                with contextlib.suppress(Exception):
                    await store.delete(c.id)


class OnlyStore(BoardStore):
    """A board store that lists the boards named ``only`` alone: an archiver on it archives (and
    records in its database) the test's boards, not those other modules left in the session's
    cluster."""

    def __init__(self, client: Any, scripts: Scripts, only: set[str]) -> None:
        super().__init__(client, scripts)
        self.only = only

    async def boards(self, reuse: bool = False) -> list[Board]:
        return [b for b in await super().boards(reuse) if b.config.id in self.only]


@pytest.mark.parametrize(
    "wrong", [["--period", "weekly"], ["--period", "daily:2026-02-30"], ["--shard", "3"], ["--shard", "-1"]]
)
async def test_rebuild_all_with_a_wrong_period_or_shard_changes_nothing(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, wrong: list[str]
) -> None:
    """`rebuild --all` put every board back in the registry (and their bans and retry records)
    before it looked at --period and --shard, then stopped at the first board that refused them
    (exit 2), with the boards before it rebuilt. Now they are checked against every board first."""
    configs = [
        BoardConfig.from_dict(
            "all-wrong-a", {"periods": ["daily", "weekly"], "sharding": sharding("hash", 3)}
        ),
        BoardConfig.from_dict("all-wrong-b", {"periods": ["daily"], "sharding": sharding("hash", 2)}),
    ]
    boards = [(await store.create(c))[0] for c in configs]
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {c.id for c in configs})
        try:
            for board in boards:
                await board.submit([Score("p1", 10, "m1", times.now_ms() - 60_000)])
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, [*command, *wrong]) == 2
            assert await raw.hlen(keys.BOARDS) == 0
            assert await raw.dbsize() == 0  # nor anything else (bans, retry records)
            assert await asyncio.to_thread(main, command) == 0
            assert [e.player_id for e in await (await store.get(configs[1].id)).top(10)] == ["p1"]
        finally:
            await a.db.close()
            for c in configs:
                with contextlib.suppress(Exception):
                    await store.delete(c.id)


async def test_a_rebuild_from_an_archive_without_the_board_is_refused(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An archive that holds no result of the board (another environment's, a backup from before
    the board, a wrong --postgres) would rebuild its shards from the journal's tail alone: every
    archived player gone. Refused while Redis holds players, unless forced; nothing is changed."""
    config = BoardConfig.from_dict("rebuild-empty-archive", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    async with own_archive(postgres_url, "empty") as empty_url:
        db = await connect_db(empty_url)  # the schema, no rows
        try:
            await board.submit([Score(f"p{i}", i, f"m{i}", times.now_ms()) for i in range(1, 11)])
            a = await archiver(raw, store, postgres_url, {config.id})
            await drain(a)  # archived in the right archive, and out of the journal
            await a.db.close()
            wrong = Rebuilder(raw, Scripts.register(raw).rebuild, db)
            with pytest.raises(BoardConflict) as refused:
                await wrong.rebuild(board)
            assert "holds no result" in refused.value.message and refused.value.field == "board"
            assert await board.size(board.resolve("total")) == 10
            command = ["rebuild", config.id, "--redis", cluster_url, "--postgres", empty_url]
            assert await asyncio.to_thread(main, command) == 1  # the CLI says why
            assert "holds no result" in capsys.readouterr().err
            assert await board.size(board.resolve("total")) == 10
            await wrong.rebuild(board, force=True)  # asked for: the journal's tail alone, here nothing
            assert await board.size(board.resolve("total")) == 0
        finally:
            await db.close()
            await store.delete(config.id)


async def test_a_memory_board_cannot_be_rebuilt(store: BoardStore, rebuilder: Rebuilder) -> None:
    config = BoardConfig.from_dict("rebuild-memory", {"durability": "memory"})
    board, _ = await store.create(config)
    try:
        with pytest.raises(BoardConflict):
            await rebuilder.rebuild(board)
    finally:
        await store.delete(config.id)


async def test_the_admin_endpoint_rebuilds_a_board(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    config = BoardConfig.from_dict("rebuild-api", {"periods": ["daily"], "sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    path = f"/v1/boards/{config.id}:rebuild"
    try:
        w = Writer(board, "rebuild/api")
        for _ in range(3):
            await w.batch()
        await drain(a)
        await damage(board, raw)
        async with running(cluster_url) as (_, client):
            refused = await client.post(path, headers=AS_ADMIN)  # no PostgreSQL configured
            assert refused.status_code == 409
            assert refused.json()["error"]["code"] == "archive_not_configured"
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            assert (await client.post(path, headers=AS_WRITER)).status_code == 403
            bad = await client.post(path, params={"shard": "3"}, headers=AS_ADMIN)
            assert (bad.status_code, bad.json()["error"]["field"]) == (422, "shard")
            missing = await client.post("/v1/boards/rebuild-nobody:rebuild", headers=AS_ADMIN)
            assert missing.status_code == 404
            done = await client.post(path, headers=AS_ADMIN)
            assert done.status_code == 200, done.text
            body = done.json()
            assert [s["shard"] for s in body["shards"]] == [0, 1, 2]
            assert sum(s["players"] for s in body["shards"]) == len(w.ref.boards["total"])
        await check(board, w.ref)
    finally:
        await a.db.close()
        await store.delete(config.id)


@contextlib.asynccontextmanager
async def own_archive(postgres_url: str, prefix: str = "loss") -> AsyncIterator[str]:
    """A database of its own on the suite's PostgreSQL, dropped after: `rebuild --all` then restores
    this test's boards only, not every board the suite archived before. (Until 2026-12-06 it was
    never dropped: each run of the suite left dozens on the machine's PostgreSQL.)"""
    name = f"{prefix}_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
        await admin.execute(f"CREATE DATABASE {name}")
    try:
        yield postgres_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def master_of(cluster: LocalCluster, key: str) -> int:
    """The port of the master that serves ``key``."""
    slot = keys.slot_of(key)
    return next(n.port for n in cluster.status().nodes if any(a <= slot <= b for a, b in n.slots))


def shard_apart(cluster: LocalCluster, board: Board) -> str:
    """The prefix of a shard of ``board`` whose primary holds neither the registry nor the ban list:
    its replica stopped holds up no write of a restore but the board's own."""
    taken = {master_of(cluster, k) for k in (keys.BOARDS, keys.BANS, keys.BANS_VERSION)}
    return next(p for p in board.prefixes if master_of(cluster, keys.index_key(p)) not in taken)


async def rebuild_all(rebuilder: Rebuilder, store: BoardStore) -> list[Board]:
    """What `rebuild --all` does (``rebuild.run``): the restore, then a rebuild of every board, of
    the boards of these tests (named ``rebuild-all-*``): the archiver of the test's own database
    also archived the boards other modules left in the worker's cluster (tests/test_ack.py's, run
    before this module on one worker, made these tests fail), and those are not theirs to rebuild."""
    boards = [b for b in await rebuilder.restore(store) if b.config.id.startswith("rebuild-all-")]
    await forget_others_restored(store, lambda board_id: board_id.startswith("rebuild-all-"))
    for board in boards:
        await rebuilder.rebuild(board)
    return boards


async def test_the_boards_a_rebuild_all_swaps_in_wait_for_a_replica(
    store: BoardStore, raw: Any, postgres_url: str, cluster: LocalCluster
) -> None:
    """A failover audit's finding: after the bans waited for a replica of their list (c0dcfb7),
    `rebuild --all` still swapped the rebuilt boards in on their primaries alone: a kill -9 of a
    primary right after its swap could lose the board just put back, while the rebuild said it
    was done. Each swap of a `rebuild --all` now waits for a replica wherever the shard's primary
    has one, as the bans do, else stops with NotAcknowledged; running it again converges."""
    config = BoardConfig.from_dict("rebuild-all-ack", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    prefix = shard_apart(cluster, board)
    now = times.now_ms()
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url, {config.id})
        try:
            # dated 10 minutes back: not taken for results sent without a time (PIN_SLACK_MS), so the
            # rebuild's first write that waits for a replica is the swap
            await board.submit([Score(f"p{i}", i, f"m{i}", now - 600_000) for i in range(1, 11)])
            await drain(a)
            await raw.delete(keys.period_key(prefix, "total"))  # a PARTIAL loss: the total alone
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            rebuilder.replica_wait_ms = 300  # the replica is stopped well within the node timeout
            replica = key_replica_pid(cluster, keys.index_key(prefix))
            with stopped(replica), pytest.raises(NotAcknowledged, match="swap"):
                await rebuild_all(rebuilder, store)
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            assert [b.config.id for b in await rebuild_all(rebuilder, store)] == [board.config.id]
            assert await board.size(board.resolve("total")) == 10  # again, the replica back
        finally:
            await a.db.close()
            await store.delete(config.id)


async def test_the_activity_a_rebuild_all_puts_back_after_a_swap_waits_for_a_replica(
    store: BoardStore, raw: Any, postgres_url: str, cluster: LocalCluster
) -> None:
    """What a shard's rebuild writes on the live keys after its swap (an inactive_after board's
    activity set, ``recall_activity``) waits for a replica too, as the swap did."""
    config = BoardConfig.from_dict(
        "rebuild-all-activity", {"inactive_after": 3600, "sharding": sharding("hash", 3)}
    )
    board, _ = await store.create(config)
    prefix = shard_apart(cluster, board)
    now = times.now_ms()
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url, {config.id})
        try:
            await board.submit([Score(f"p{i}", i, f"m{i}", now - 60_000) for i in range(1, 31)])
            await drain(a)
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            rebuilder.replica_wait_ms = 300
            replica, real = key_replica_pid(cluster, keys.index_key(prefix)), rebuilder.recall_activity

            async def recall_activity(b: Board, shard: int, arrivals: dict[str, int]) -> None:
                if b.prefixes[shard] == prefix:  # its swap confirmed: the replica stops right after
                    os.kill(replica, signal.SIGSTOP)
                await real(b, shard, arrivals)

            rebuilder.recall_activity = recall_activity  # type: ignore[method-assign]
            try:
                # Each call of it waits (until 2026-12-05 a call of its own after them did).
                with pytest.raises(NotAcknowledged, match="recall on"):
                    await rebuild_all(rebuilder, store)
            finally:
                os.kill(replica, signal.SIGCONT)
            await rebuild_all(Rebuilder(raw, Scripts.register(raw).rebuild, a.db), store)
            assert await board.size(board.resolve("total")) == 30
        finally:
            await a.db.close()
            await store.delete(config.id)


@pytest.mark.parametrize("step", ["bans", "registry", "swap"])
async def test_a_rebuild_all_killed_at_any_step_converges_when_run_again(
    store: BoardStore, raw: Any, postgres_url: str, step: str
) -> None:
    """`rebuild --all` after a total loss of two boards, stopped right after the ban list is
    written back, after the first board's record is, or after its first swap, then run again by a
    fresh process: both boards are back, as PostgreSQL has them."""
    configs = [
        BoardConfig.from_dict(f"rebuild-all-killed-{i}", {"mode": "incr", "sharding": sharding("hash", 3)})
        for i in range(2)
    ]
    boards = [(await store.create(c))[0] for c in configs]
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, OnlyStore(store.client, store.scripts, {c.id for c in configs}), url)
        try:
            writers = [Writer(b, f"all-killed/{step}/{b.config.id}") for b in boards]
            for w in writers:
                for _ in range(2):
                    await w.batch()
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            bans, restore, swap = moderation.Bans.restore, store.restore, rebuilder._swap_keys

            async def killed(call: Callable[..., Awaitable[Any]], *args: Any) -> Any:
                await call(*args)
                raise Killed(step)

            with contextlib.ExitStack() as patches, pytest.raises(Killed):
                mp = patches.enter_context(pytest.MonkeyPatch.context())
                if step == "bans":
                    mp.setattr(moderation.Bans, "restore", lambda self, *args: killed(bans, self, *args))
                elif step == "registry":
                    mp.setattr(store, "restore", lambda *args: killed(restore, *args))
                else:
                    mp.setattr(rebuilder, "_swap_keys", lambda *args: killed(swap, *args))
                await rebuild_all(rebuilder, store)
            back = await rebuild_all(Rebuilder(raw, Scripts.register(raw).rebuild, a.db), store)
            assert sorted(b.config.id for b in back) == [c.id for c in configs]
            for board, w in zip(boards, writers, strict=True):
                assert (await store.get(board.config.id)).incarnation == board.incarnation
                await check(board, w.ref)
        finally:
            await a.db.close()
            for c in configs:
                with contextlib.suppress(Exception):
                    await store.delete(c.id)


async def test_the_registry_a_rebuild_all_restores_waits_for_a_replica(
    store: BoardStore, raw: Any, postgres_url: str, cluster: LocalCluster
) -> None:
    """Likewise the board registry's records `rebuild --all` puts back (``BoardStore.restore``):
    a kill -9 of the registry's primary right after could lose a board restored. They now wait for
    a replica of the registry's primary, if it has one, before any board is rebuilt."""
    config = BoardConfig.from_dict("rebuild-all-registry", {"sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    now = times.now_ms()
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, store, url, {config.id})
        try:
            await board.submit([Score(f"p{i}", i, f"m{i}", now - 60_000) for i in range(1, 11)])
            await drain(a)
            await raw.hdel(keys.BOARDS, config.id)  # a PARTIAL loss: the board's record alone
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            rebuilder.replica_wait_ms = 300
            replica = key_replica_pid(cluster, keys.BOARDS)
            with stopped(replica), pytest.raises(NotAcknowledged, match="registry"):
                await rebuilder.restore(store)
            assert (await store.get(config.id)).incarnation == board.incarnation
            back = await rebuild_all(Rebuilder(raw, Scripts.register(raw).rebuild, a.db), store)
            assert [b.incarnation for b in back] == [board.incarnation]  # again, the replica back
            assert await board.size(board.resolve("total")) == 10
        finally:
            await a.db.close()
            await store.delete(config.id)


async def test_after_a_total_loss_a_retry_is_answered_as_before_the_loss(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The audit's case: a client lost its reply in the outage and sends the result again after
    `rebuild --all`. An incr board answers `duplicate` and counts it once (its dedup sets came back),
    with or without `achieved_at`; a best board (tiebreak latest) and a set board answer a result
    sent without `achieved_at` with the time it was first given (its pin came back): unchanged,
    not a later time that beats the player's own score or their newer result."""
    specs: dict[str, dict[str, Any]] = {
        "loss-incr": {"mode": "incr"},
        "loss-best": {"mode": "best", "tiebreak": "latest"},
        "loss-set": {"mode": "set"},
    }
    configs = [BoardConfig.from_dict(b, {**s, "sharding": sharding("hash", 3)}) for b, s in specs.items()]
    incr, best, set_ = [(await store.create(c))[0] for c in configs]
    now = times.now_ms()
    timed, timeless = Score("p1", 10, "m1", now - 60_000), Score("p2", 10, "m2", None)
    sent = {
        incr: [timed, timeless],
        best: [Score("p1", 10, "m1", None)],
        set_: [Score("p1", 10, "m1", None)],
    }
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {c.id for c in configs})
        try:
            for board, scores in sent.items():
                assert {r.status for r in await board.submit(scores)} == {"improved"}
            newer = Score("p1", 5, "m2", times.now_ms() + 2000)  # the set board's later result
            assert (await set_.submit([newer]))[0].status == "improved"
            await drain(a)
            players = ["p1", "p2"]
            before = {b.config.id: await b.scores(players) for b in sent}
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            boards = {b: await store.get(b.config.id) for b in sent}
            assert {b: await boards[b].scores(players) for b in sent} == {
                b: before[b.config.id] for b in sent
            }
            later = times.now_ms() + 2 * HOUR  # well within the 24 h window
            replies = {b: await boards[b].submit(scores, now_ms=later) for b, scores in sent.items()}
            assert [r.status for r in replies[incr]] == ["duplicate", "duplicate"]
            assert [r.points for r in replies[incr]] == [10, 10]
            assert [r.status for r in replies[best]] == ["unchanged"]
            assert [(r.status, r.points) for r in replies[set_]] == [("unchanged", 5)]
            assert {b: await boards[b].scores(players) for b in sent} == {
                b: before[b.config.id] for b in sent
            }
            # the pins came back in hashes of write.lua's span, and the shard's marker says so
            markers = [await raw.get(keys.pin_span_key(p)) for p in boards[best].prefixes]
            assert b"4:0" in markers and set(markers) <= {None, b"4:0"}
            await drain(a)
            for board in boards.values():  # and PostgreSQL agrees with every board
                ref = ReferenceBoard(board.config)
                ref.submit(await archived(archive_url, board), now_ms=times.now_ms())
                await check(board, ref)
        finally:
            await a.db.close()
            for c in configs:
                with contextlib.suppress(Exception):
                    await store.delete(c.id)


async def test_after_a_total_loss_a_removed_players_retry_is_still_refused(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A removal's record (remove.lua's `rmv`) was not put back by `rebuild --all`: after a total
    loss of Redis, a game server's retry of a removed player's result brought the player back. Now
    the rebuild puts back the removals of the dedup window from PostgreSQL's player_removals."""
    config = BoardConfig.from_dict("loss-removed", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    now = times.now_ms()
    posts = [Score("cheat", 90, "m1", now - 60_000), Score("fair", 40, "m2", now - 60_000)]
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {config.id})
        try:
            await board.submit(posts)
            await drain(a)
            assert await moderation.remove(board, ["cheat"]) == {"cheat"}
            await drain(a)  # the delete entry in player_removals (what only the journal held is lost)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            rebuilt = await store.get(config.id)
            assert [e.player_id for e in await rebuilt.top(10)] == ["fair"]
            again = await rebuilt.submit(posts, now_ms=times.now_ms())
            assert [r.status for r in again] == ["duplicate", "unchanged"]
            assert [e.player_id for e in await rebuilt.top(10)] == ["fair"]
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_after_a_total_loss_a_removal_sent_again_keeps_what_the_player_posted_since(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A removal named by a request (the router's X-Request-Id) is made once whatever its retries:
    remove.lua records the request beside the player's record, and a call again changes nothing.
    That record was not put back by `rebuild --all`: after a total loss of Redis, an admin's retry
    of a DELETE whose answer was lost removed the player again, with the result posted since."""
    config = BoardConfig.from_dict("loss-removal-request", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    now = times.now_ms()
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {config.id})
        try:
            await board.submit([Score("p7", 90, "m1", now - 60_000), Score("fair", 40, "m2", now - 60_000)])
            assert await moderation.remove(board, ["p7", "ghost"], request="remove/r-1") == {"p7"}
            await drain(a)  # the delete entry is in PostgreSQL (and trimmed from the journal)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, command) == 0
            rebuilt = await store.get(config.id)
            await posted_since_and_removed_again(rebuilt)
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_a_refill_puts_back_the_removal_requests_still_in_the_journal(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """The same from a delete entry not archived yet: the request's record comes back from the journal."""
    config = BoardConfig.from_dict("loss-removal-request-journal", {"sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    prefix = board.prefixes[0]
    a = await archiver(raw, store, postgres_url, {config.id})  # the schema; it archives nothing here
    try:
        now = times.now_ms()
        await board.submit([Score("p7", 90, "m1", now - 60_000), Score("fair", 40, "m2", now - 60_000)])
        assert await moderation.remove(board, ["p7", "ghost"], request="remove/r-1") == {"p7"}
        # Where each removal's entry is (remove.lua's NUL <player>, and SOH <request> NUL <player>)
        # comes back too: a removal that finds the player gone, or the request sent again, reads
        # that entry alone, not the journal (moderation._delete_entries).
        kept = await raw.hgetall(keys.removals_key(prefix))
        assert len(kept) == 8  # per player: the record, the request's, and where each entry is
        await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
        await rebuilder.refill(board, 0)
        assert await raw.hgetall(keys.removals_key(prefix)) == kept
        await filled(raw, keys.journal_key(prefix), 2 * moderation.PAGE)  # the archiver behind
        reads = JournalReads(board)
        for request, removed in [("remove/r-1", {"p7"}), ("remove/r-9", set())]:
            assert await moderation.remove(board, ["p7"], request=request, journaled=[]) == removed
        assert reads.entries <= 3  # the entry each names (and r-9's own), not the journal
        await posted_since_and_removed_again(board)
    finally:
        await a.db.close()
        await store.delete(config.id)


async def posted_since_and_removed_again(board: Board) -> None:
    """p7 (removed by the request remove/r-1, with "ghost", who had no entry) posts again; the
    request sent again answers as the first call did and keeps that result; another removes it."""
    later = times.now_ms() + MAX_FUTURE_MS + 2_000  # achieved after the removal's record
    assert (await board.submit([Score("p7", 3, "m-again", later)], later))[0].status == "improved"
    assert await moderation.remove(board, ["p7", "ghost"], request="remove/r-1") == {"p7"}
    assert (await board.player("p7")).entry.points == 3
    assert await moderation.remove(board, ["p7"], request="remove/r-2") == {"p7"}
    assert [e.player_id for e in await board.top(10)] == ["fair"]


async def test_a_refill_puts_back_the_removals_still_in_the_journal(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """The record of a removal whose delete entry is still in the journal (not archived yet) comes
    back from the journal: its time is the entry's, its expiry a window later."""
    config = BoardConfig.from_dict("loss-removed-journal", {"sharding": sharding("hash", 1)})
    board, _ = await store.create(config)
    prefix = board.prefixes[0]
    a = await archiver(raw, store, postgres_url, {config.id})  # the schema; it archives nothing here
    try:
        now = times.now_ms()
        await board.submit([Score("cheat", 90, "m1", now - 60_000)], now_ms=now)
        assert await moderation.remove(board, ["cheat"]) == {"cheat"}
        kept = await raw.hget(keys.removals_key(prefix), "cheat")
        await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
        await rebuilder.refill(board, 0)
        assert await raw.hget(keys.removals_key(prefix), "cheat") == kept
        assert await raw.get(keys.removals_marker_key(prefix)) == b"1"
        expiry = await raw.pexpiretime(keys.removals_key(prefix))
        assert now + 23 * HOUR < expiry <= times.now_ms() + 24 * HOUR
        again = await board.submit([Score("cheat", 90, "m1", now - 60_000)], now_ms=times.now_ms())
        assert again[0].status == "duplicate"
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_shard_rebuild_puts_back_the_retry_records_it_lost(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """A PARTIAL loss, on purpose: one shard's dedup sets alone go (a master that came back empty
    takes every key of its slots, sentinel included: tests/test_shard_loss.py), so the refill's own
    work is seen: `rebuild --shard` puts them back from PostgreSQL and the journal, with write.lua's
    names, members and expiries, listed in the key index (so a deletion of the board drops them);
    the other shards' are left as they were."""
    config = BoardConfig.from_dict("loss-shard", {"mode": "incr", "sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    prefix = board.prefixes[0]
    try:
        w = Writer(board, "loss/shard")
        for _ in range(3):
            await w.batch()
        await drain(a)  # archived and trimmed ...
        await w.batch()  # ... and still only in the journal

        async def records(prefix: str) -> dict[bytes, tuple[set[bytes], int, float]]:
            listed = await raw.zrange(keys.index_key(prefix), 0, -1, withscores=True)
            return {
                name: (await raw.smembers(name), await raw.pexpiretime(name), at)
                for name, at in listed
                if name.startswith(f"{prefix}dd:".encode())
            }

        kept = {p: await records(p) for p in board.prefixes}
        assert kept[prefix]
        await raw.delete(*kept[prefix])
        await raw.zrem(keys.index_key(prefix), *kept[prefix])
        await rebuilder.rebuild(board, shard=0)
        back = await records(prefix)
        members = set().union(*(m for m, _, _ in kept[prefix].values()))
        assert set().union(*(m for m, _, _ in back.values())) == members
        b, window = config.dedup_bucket_ms, config.dedup_window_s * 1000
        for name, (_, expires, listed_at) in back.items():
            k = int(name.rsplit(b":", 1)[1])
            assert expires == listed_at == (k + 1) * b + window
        assert {p: await records(p) for p in board.prefixes[1:]} == {p: kept[p] for p in board.prefixes[1:]}
        replies = await board.submit(w.sent)
        assert {r.status for r in replies} == {"duplicate"}
        await check(board, w.ref)
        await store.delete(config.id)
        assert not await raw.exists(*back)  # the board's deletion dropped them
    finally:
        await a.db.close()
        with contextlib.suppress(Exception):
            await store.delete(config.id)


@pytest.mark.parametrize("archived", [False, True], ids=["journaled", "archived"])
@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_removal_right_after_a_forced_swap_stays_removed(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: Any,
    mode: str,
    archived: bool,
) -> None:
    """A forced swap puts the results written since the snapshot onto the live keys in a second call;
    a player removed between the swap and that call must not come back with their older results.
    ``archived``: the archiver quick, the removal archived and trimmed from the journal before that
    call, where rebuild.lua looked for it alone (until 2026-12-05 the player came back)."""
    config = BoardConfig.from_dict(
        f"rebuild-forced-cut-{mode}-{int(archived)}", {"mode": mode, "sharding": {"shards": 1}}
    )
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", 10 * i, f"m{i}", now) for i in range(1, 4)]
        await board.submit([*scores, Score("cheater", 5, "early", now)], now_ms=now)
        await drain(a)
        rebuilder.swap_tries = 0  # the first swap is forced
        real_snapshot, real_changes = rebuilder.snapshot, rebuilder.changes
        removed = []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("cheater", 999, "late", now)], now_ms=now)  # after the snapshot
            return snap

        async def changes(*args: Any, **kwargs: Any) -> Any:
            got = await real_changes(*args, **kwargs)
            if not removed:  # the forced swap is done: removed before its results go on
                removed.append(await moderation.remove(board, ["cheater"]))
                if archived:
                    await drain(a)
                    await raw.xtrim(keys.journal_key(board.prefixes[0]), maxlen=0)
            return got

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "changes", changes)
        await rebuilder.rebuild(board)
        assert removed == [{"cheater"}]
        top = await board.top(10, board.resolve("total"))
        assert [e.player_id for e in top] == ["p3", "p2", "p1"]
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_post_right_after_a_forced_swap_of_a_player_removed_before_it_stays(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, monkeypatch: Any, mode: str
) -> None:
    """A player removed between the snapshot and a forced swap, who posts again between the swap and
    the call that puts the results written meanwhile onto the live keys: that call removes the
    player's results of before the removal, not the post made after the swap."""
    config = BoardConfig.from_dict(f"rebuild-forced-post-{mode}", {"mode": mode, "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", 10 * i, f"m{i}", now - HOUR) for i in range(1, 4)]
        await board.submit([*scores, Score("back", 5, "early", now - HOUR)], now_ms=now - HOUR)
        await drain(a)
        rebuilder.swap_tries = 0  # the first swap is forced
        real_snapshot, real_changes = rebuilder.snapshot, rebuilder.changes
        posted: list[Any] = []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            assert await moderation.remove(board, ["back"], now_ms=now - HOUR // 2) == {"back"}
            return snap

        async def changes(*args: Any, **kwargs: Any) -> Any:
            got = await real_changes(*args, **kwargs)
            if not posted:  # the forced swap is done: a post before the results go on
                posted.extend(await board.submit([Score("back", 50, "again", now)], now_ms=now))
            return got

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "changes", changes)
        await rebuilder.rebuild(board)
        assert [r.status for r in posted] == ["improved"]
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == [("back", 50), ("p3", 30), ("p2", 20), ("p1", 10)]
    finally:
        await a.db.close()
        await store.delete(config.id)


class Killed(BaseException):
    """The rebuild's process killed at this point (nothing of it catches a BaseException)."""


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_rebuild_killed_between_its_forced_swap_and_the_apply_is_finished_by_the_next(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, monkeypatch: Any, mode: str
) -> None:
    """A rebuild killed after its forced swap and before ``_apply_live`` leaves the live keys at the
    snapshot's state plus what was written after the swap: a result and a removal written between
    the snapshot and the swap are missing (the removed player is back). The journal and the archive
    still hold them, and a rebuild run again folds the whole shard from them and swaps it in: it ends
    where one complete rebuild does, the post after the swap kept."""
    config = BoardConfig.from_dict(f"rebuild-killed-swap-{mode}", {"mode": mode, "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", 10 * i, f"m{i}", now - HOUR) for i in range(1, 4)]
        await board.submit([*scores, Score("cheater", 5, "early", now - HOUR)], now_ms=now - HOUR)
        await drain(a)
        rebuilder.swap_tries = 0  # the first swap is forced
        real_snapshot, real_changes = rebuilder.snapshot, rebuilder.changes

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("p1", 100, "between", now)], now_ms=now)  # before the swap
            assert await moderation.remove(board, ["cheater"]) == {"cheater"}
            return snap

        async def changes(*args: Any, **kwargs: Any) -> Any:
            got = await real_changes(*args, **kwargs)
            await board.submit([Score("p2", 200, "after", now)], now_ms=now)  # after the swap
            return got

        async def killed(*args: Any, **kwargs: Any) -> int:
            raise Killed

        with monkeypatch.context() as m:
            m.setattr(rebuilder, "snapshot", snapshot)
            m.setattr(rebuilder, "changes", changes)
            m.setattr(rebuilder, "_apply_live", killed)
            with pytest.raises(Killed):
                await rebuilder.rebuild(board)
        top = await board.top(10, board.resolve("total"))
        p2 = 200 if mode == "best" else 220
        assert [(e.player_id, e.points) for e in top] == [("p2", p2), ("p3", 30), ("p1", 10), ("cheater", 5)]
        await drain(a)  # the archiver goes on meanwhile
        again = Rebuilder(raw, Scripts.register(raw).rebuild, rebuilder.db)  # a process of its own
        await again.rebuild(board)
        top = await board.top(10, board.resolve("total"))
        p1 = 100 if mode == "best" else 110
        assert [(e.player_id, e.points) for e in top] == [("p2", p2), ("p1", p1), ("p3", 30)]
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_forced_swap_gone_before_its_apply_is_a_503_and_exit_1_and_a_rerun_converges(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: Any
) -> None:
    """The apply after a forced swap refuses when the swap's marker is gone from the shard (the
    swap lost in a failover: tests/test_ack_losses.py, which checks the board a real loss leaves;
    here the marker alone is taken away): the admin endpoint answers 503 cluster_unavailable and
    `shardlb rebuild` exits 1, both saying why; run again, the rebuild converges (each result once)."""
    config = BoardConfig.from_dict("rebuild-unswapped", {"mode": "incr", "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", 10 * i, f"m{i}", now - HOUR) for i in range(1, 4)]
        await board.submit(scores, now_ms=now - HOUR)
        await drain(a)
        real_init, real_snapshot, real_apply = Rebuilder.__init__, Rebuilder.snapshot, Rebuilder._apply_live
        unswapped: list[bool] = []
        loop = asyncio.get_running_loop()

        async def here(call: Awaitable[Any]) -> Any:
            """``call`` on the test's loop, whose clients these are (the CLI runs a loop of its own)."""
            future = asyncio.run_coroutine_threadsafe(call, loop)  # type: ignore[arg-type]
            return await asyncio.wrap_future(future)

        def init(self: Rebuilder, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            self.swap_tries = 0  # the first swap is forced

        async def snapshot(self: Rebuilder, *args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(self, *args, **kwargs)
            await here(board.submit([Score("p1", 100, f"between-{len(unswapped)}", now)], now_ms=now))
            return snap

        async def apply_live(self: Rebuilder, *args: Any, **kwargs: Any) -> int:
            unswapped.append(True)
            await here(raw.delete(keys.swap_marker_key(board.prefixes[0])))  # gone with the swap
            return await real_apply(self, *args, **kwargs)

        monkeypatch.setattr(Rebuilder, "__init__", init)
        monkeypatch.setattr(Rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(Rebuilder, "_apply_live", apply_live)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            answer = await client.post(f"/v1/boards/{config.id}:rebuild", headers=AS_ADMIN)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "cluster_unavailable"
        assert "forced swap" in answer.json()["error"]["message"]
        command = ["rebuild", config.id, "--redis", cluster_url, "--postgres", postgres_url]
        assert await asyncio.to_thread(main, command) == 1
        assert len(unswapped) == 2
        monkeypatch.undo()
        await drain(a)
        assert await asyncio.to_thread(main, command) == 0
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == [("p1", 210), ("p3", 30), ("p2", 20)]
    finally:
        monkeypatch.undo()
        await a.db.close()
        await store.delete(config.id)


async def test_a_forced_swaps_apply_after_another_rebuilds_swap_counts_nothing_twice(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, monkeypatch: Any
) -> None:
    """Two rebuilds of one shard at once (two operators, or `reconcile --repair` beside `shardlb
    rebuild`): one forces its swap, the other swaps its own board in before the first one's apply,
    that board holding the results written before the first swap. The apply added them again on
    top (an incr board counted them twice, and the rebuild said done); now it finds its swap's
    marker replaced and refuses, and the board holds each result once."""
    config = BoardConfig.from_dict("rebuild-two-at-once", {"mode": "incr", "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        now = times.now_ms()
        scores = [Score(f"p{i}", 10 * i, f"m{i}", now - HOUR) for i in range(1, 4)]
        await board.submit(scores, now_ms=now - HOUR)
        await drain(a)
        rebuilder.swap_tries = 0  # the first swap is forced
        other = Rebuilder(raw, rebuilder.script, rebuilder.db)
        real_snapshot, real_changes = rebuilder.snapshot, rebuilder.changes
        done: list[Any] = []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("p1", 100, "between", now)], now_ms=now)  # before the swap
            return snap

        async def changes(*args: Any, **kwargs: Any) -> Any:
            got = await real_changes(*args, **kwargs)
            if not done:  # the forced swap is done: the other rebuild swaps before the apply
                done.append(await other.rebuild(board))
            return got

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "changes", changes)
        refused: list[str] = []
        try:
            await rebuilder.rebuild(board)
        except ClusterUnavailable as e:
            refused.append(str(e))
        assert done
        top = await board.top(10, board.resolve("total"))
        assert [(e.player_id, e.points) for e in top] == [("p1", 110), ("p3", 30), ("p2", 20)]
        assert refused and "another rebuild" in refused[0]
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_refill_puts_back_only_the_records_removals_made(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """A refill made a record of every delete entry, the inactive cleanup's too, at the cleanup's
    time (a late result of a cleaned-up player was refused after a rebuild, taken before it); and a
    removal of a player with no entry on the shard recorded them but journaled nothing, so nothing
    put that record back. Removals now journal the records they make, with their units, and only
    those come back: the cleanup's since 2026-12-06, at the player's last post (so a replay of a
    result they had stays out, and a late result of after it counts as before the rebuild)."""
    settings = {"inactive_after": 3600, "sharding": sharding("hash", 1)}
    config = BoardConfig.from_dict("loss-records-only", settings)
    board, _ = await store.create(config)
    prefix = board.prefixes[0]
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        now = times.now_ms()
        await board.submit([Score("idle", 5, "m1", now - 60_000)], now_ms=now - 60_000)
        assert await moderation.remove_on_shard(board, 0, ["idle"], stale_before_ms=now) == ["idle"]
        assert await moderation.remove(board, ["never-posted"]) == set()  # a record all the same
        kept = await raw.hgetall(keys.removals_key(prefix))
        positions = {keys.removal_position_field(p).encode() for p in ("never-posted", "idle")}
        assert set(kept) == {b"never-posted", b"idle", *positions}
        assert int(kept[b"idle"]) == moderation.record_units(board, now - 60_000)  # at the last post
        # Where the removal's entry is comes back (from `removal_records`: archived, so a removal
        # that finds the player gone reads that id and nothing else); where the cleanup's is comes
        # back from the journal under the cleanup's own units, from `removal_records` (archived)
        # under its record's.
        idle = kept.pop(keys.removal_position_field("idle").encode())
        # From the journal (not archived yet), where the cleanup's entry is comes back too.
        await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
        await rebuilder.refill(board, 0)
        back = await raw.hgetall(keys.removals_key(prefix))
        assert back.pop(keys.removal_position_field("idle").encode()) == idle
        assert back == kept
        await drain(a)  # the records archived, the journal trimmed
        await raw.delete(keys.removals_key(prefix), keys.removals_marker_key(prefix))
        await rebuilder.refill(board, 0)
        back = await raw.hgetall(keys.removals_key(prefix))
        at = back.pop(keys.removal_position_field("idle").encode()).decode()
        assert keys.removal_position(at) == keys.removal_position(idle.decode())
        assert at.partition(".")[0] == kept[b"idle"].decode()
        assert back == kept
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_after_a_reshard_and_a_total_loss_the_board_comes_back_in_its_new_layout(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """PostgreSQL kept a board's settings as it was created: after a reshard (3 -> 4 shards, the
    archived rows moved to their new shards) a total loss of Redis brought it back with 3 shards,
    the rows of shard 3 were never rebuilt and most players were looked for on the wrong shard (an
    ops audit's finding: 2301 of 3000 players missing, and reconcile said ok). The reshard now
    records the new layout with the rows, and the rebuild restores that."""
    config = BoardConfig.from_dict("loss-resharded", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    now = times.now_ms()
    posts = [Score(f"p{i}", i, f"m{i}", now - 60_000) for i in range(300)]
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {config.id})
        try:
            await board.submit(posts)
            await drain(a)
            await _reshard_while_archiving(store, config.id, a, archive_url, 4)
            await _lose_redis_and_rebuild(raw, cluster_url, archive_url)
            rebuilt = await store.get(config.id)
            assert rebuilt.config.sharding.shards == 4
            top = await rebuilt.top(1000)
            assert sorted((e.player_id, e.points) for e in top) == sorted(
                (s.player_id, s.points) for s in posts
            )
            for s in posts[::37]:
                assert (await rebuilt.player(s.player_id, rebuilt.resolve("total"))).entry.points == s.points
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def test_after_a_reshard_and_a_total_loss_a_moved_removed_players_retry_is_still_refused(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The reshard re-homed the archive's results and delete entries, but not the removal records a
    rebuild reads by shard, and only of players with results: after a reshard that moved a removed
    player to another shard and a total loss of Redis, the rebuild looked for their record on the new
    shard, found none, and a retry of their result brought them back (a reshard audit's finding).
    Every row of the three tables now moves, of every player any of them names: "ghost", removed
    before they ever posted, has a record and no result."""
    from shardlb.sharding import player_hash

    config = BoardConfig.from_dict("loss-resharded-removed", {"sharding": sharding("hash", 3)})
    board, _ = await store.create(config)
    cheat, ghost = [p for p in (f"c{i}" for i in range(100)) if player_hash(p) % 3 != player_hash(p) % 4][:2]
    now = times.now_ms()
    posts = [Score(cheat, 90, "m1", now - 60_000), Score("fair", 40, "m2", now - 60_000)]
    late = Score(ghost, 70, "m3", now - 60_000)  # achieved before the ghost's removal
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {config.id})
        try:
            await board.submit(posts)
            await drain(a)
            assert await moderation.remove(board, [cheat, ghost]) == {cheat}
            await drain(a)
            await _reshard_while_archiving(store, config.id, a, archive_url, 4)
            await _lose_redis_and_rebuild(raw, cluster_url, archive_url)
            rebuilt = await store.get(config.id)
            assert rebuilt.config.sharding.shards == 4
            again = await rebuilt.submit([*posts, late], now_ms=times.now_ms())
            assert [r.status for r in again] == ["duplicate", "unchanged", "duplicate"]
            assert [e.player_id for e in await rebuilt.top(10)] == ["fair"]
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)


async def _reshard_while_archiving(
    store: BoardStore, board_id: str, a: Any, archive_url: str, shards: int
) -> None:
    """Reshard the board to ``shards`` while the archiver ``a`` runs its rounds, as in production."""
    from shardlb.reshard import Resharder

    stop = asyncio.Event()

    async def archive() -> None:
        while not stop.is_set():
            await a.refresh()
            if not await archive_round(a):
                await asyncio.sleep(0.02)

    archiving = asyncio.ensure_future(archive())
    try:
        mover = Resharder(store, board_id, say=lambda _: None, postgres_url=archive_url, cache_s=0)
        await mover.start(shards)
        assert (await mover.run())["shards"] == shards
    finally:
        stop.set()
        await archiving


async def _lose_redis_and_rebuild(raw: Any, cluster_url: str, archive_url: str) -> None:
    """A total loss of Redis, then ``shardlb rebuild --all`` from the archive."""
    await raw.flushall(target_nodes=raw.PRIMARIES)
    command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", archive_url]
    assert await asyncio.to_thread(main, command) == 0


async def test_a_player_removed_while_the_bands_are_rebuilt_stays_removed(
    store: BoardStore, rebuilder: Rebuilder
) -> None:
    """rebuild_bands reads the home totals, then swaps each band shard in. A player removed between
    the two (moderation: the home total gone, the live bands told to drop the row at a new version,
    the move confirmed) was put back by the swap, from the totals read before, with the version of
    before; the pass that sends again the moves made meanwhile skipped players with no total, so the
    row stayed on the band board for good (every read listed a removed player)."""
    config = BoardConfig.from_dict(
        "rebuild-bands-removal", {"durability": "memory", "sharding": sharding("band", 3)}
    )
    board, _ = await store.create(config)
    real_fill, removed = rebuilder._fill, []

    async def fill(key: str, members: dict[str, int], hash: bool = False) -> None:
        if not removed:  # the totals are read: the first band's fill comes next
            removed.append(await moderation.remove(board, ["p1"]))
        await real_fill(key, members, hash)

    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 100 * i, "m1", now) for i in range(1, 6)], now_ms=now)
        rebuilder._fill = fill  # type: ignore[method-assign]
        await rebuilder.rebuild_bands(board)
        assert removed == [{"p1"}]
        assert [e.player_id for e in await board.top(10)] == ["p5", "p4", "p3", "p2"]
        assert await board.size() == 4
        assert await board.repair() == 0
        assert [e.player_id for e in await board.top(10)] == ["p5", "p4", "p3", "p2"]
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_late_retry_archived_during_the_catch_up_keeps_the_first_score_in_the_closed_period(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, monkeypatch: Any, mode: str
) -> None:
    """A result applied after the snapshot, its period closed, then a better retry of it (the board
    applies that to the total alone), both archived and trimmed from the journal before the swap: the
    catch-up reads them from PostgreSQL, where the match's row holds the retry and ``match_holds`` the
    first application, which the closed period keeps. Until 2026-12-05 the catch-up read the row
    alone, and the rebuilt period lost the first score."""
    config = BoardConfig.from_dict(
        f"rebuild-catch-up-hold-{mode}",
        {"mode": mode, "periods": ["daily"], "retention_days": {"daily": 30}, "sharding": {"shards": 1},
         "dedup_window_s": 30 * 86_400},
    )  # fmt: skip
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    period = "daily:" + (datetime.now(UTC).date() - timedelta(days=2)).isoformat()  # closed a day ago
    start, end = period_bounds(board, board.resolve(period).period)
    try:
        await board.submit([Score("earlier", 3, "hold-m0", start + 500)], now_ms=end - 1)
        await drain(a)
        real_snapshot, written = rebuilder.snapshot, []

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            first = [Score("first", 10, "hold-m1", start + 1000), Score("second", 5, "hold-m2", start + 2000)]
            await board.submit(first, now_ms=end - 1)
            [late] = await board.submit([Score("first", 40, "hold-m1", start + 1000)])
            written.append(late.closed)
            await drain(a)
            for prefix in board.prefixes:  # archived: the journal holds none of them now
                await raw.xtrim(keys.journal_key(prefix), maxlen=0)
            return snap

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        top = [("first", 10), ("second", 5), ("earlier", 3)]
        await rebuilder.rebuild(board)
        assert written == [(period,)]
        assert [(e.player_id, e.points) for e in await board.top(10, board.resolve(period))] == top
        assert [(e.player_id, e.points) for e in await board.top(10)] == [("first", 40), *top[1:]]
    finally:
        await a.db.close()
        await store.delete(config.id)


async def removed_then_posted_late(board: Board, raw: Any, a: Any) -> tuple[ResolvedView, ResolvedView, int]:
    """The scenario of the kept-removal tests below, archived: p posts 5 on the day two days ago,
    is removed an hour into it (request remove/R), posts 8 later that day, then, the removal's
    records gone (the dedup window over), a late 20 dated the day before. Returns that day before,
    the day, and the removal's time."""
    today = datetime.now(UTC).date()
    old_day, day = (board.resolve(f"daily:{(today - timedelta(days=n)).isoformat()}") for n in (3, 2))
    s1, _ = period_bounds(board, old_day.period)
    s2, e2 = period_bounds(board, day.period)
    at = s2 + HOUR
    first = [Score("p", 5, "p-1", s2 + HOUR // 2), Score("q", 3, "q-1", s2 + 1000)]
    await board.submit(first, now_ms=at - 1)
    await moderation.remove(board, ["p"], now_ms=at, request="remove/R")
    await board.submit([Score("p", 8, "p-2", s2 + 3 * HOUR)], now_ms=e2 - 1)
    await raw.delete(keys.removals_key(board.prefixes[0]))  # the dedup window is over
    await board.submit([Score("p", 20, "p-old", s1 + HOUR)], now_ms=s1 + 2 * HOUR)
    await drain(a)
    return old_day, day, at


@pytest.mark.parametrize(
    ("mode", "archived_between"), [("best", False), ("best", True), ("incr", True), ("set", False)]
)
async def test_a_removal_that_keeps_some_periods_made_during_the_rebuild_stays_as_redis_made_it(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: Any,
    mode: str,
    archived_between: bool,
) -> None:
    """A removal made at an earlier call's time (a DELETE retried past the dedup window) between the
    snapshot and the swap, its delete entry read from the journal or, archived and trimmed, from
    PostgreSQL: the catch-up removes the player from the periods the removal did not leave whole
    only, and the periods it kept hold the player's entry as Redis does. Until 2026-12-05 the
    catch-up removed the player from every period."""
    config = BoardConfig.from_dict(
        f"rebuild-kept-{mode}-{int(archived_between)}",
        {"mode": mode, "periods": ["daily"], "retention_days": {"daily": 30}, "sharding": {"shards": 1},
         "dedup_window_s": 30 * 86_400},
    )  # fmt: skip
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        old_day, day, at = await removed_then_posted_late(board, raw, a)
        real_snapshot, tops = rebuilder.snapshot, {}

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            if not tops:
                # The rebuild put back the records of the window it finds (the test's clock is
                # not past it): gone again, as they would be
                await raw.delete(keys.removals_key(board.prefixes[0]))
                assert await moderation.remove(board, ["p"], request="remove/R", since_ms=at) == {"p"}
                for period in (board.resolve("total"), day, old_day):
                    tops[period.period] = [(e.player_id, e.points) for e in await board.top(10, period)]
                if archived_between:
                    await drain(a)
                    await raw.xtrim(keys.journal_key(board.prefixes[0]), maxlen=0)
            return snap

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        await rebuilder.rebuild(board)
        assert tops[day.period] == [("p", 8), ("q", 3)]
        for period in (board.resolve("total"), day, old_day):
            assert [(e.player_id, e.points) for e in await board.top(10, period)] == tops[period.period]
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("strategy", ["hash", "band"])
@pytest.mark.parametrize("archived", [False, True], ids=["journaled", "archived"])
@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_removal_that_keeps_some_periods_right_after_a_forced_swap_keeps_them(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: Any,
    mode: str,
    archived: bool,
    strategy: str,
) -> None:
    """A removal made at an earlier call's time (a DELETE retried past the dedup window) between a
    forced swap and its apply, its delete entry in the journal where rebuild.lua reads it or,
    archived and trimmed, in PostgreSQL: the apply leaves the player out of the periods it wiped
    alone, and puts the player's results written before the swap into those it left whole (as the
    next rebuild does). Until 2026-12-05 the apply left the player out of every period."""
    # A band board's band shards (the band total's reads) follow the home shard: 2026-12-05.
    shards = {"shards": 1} if strategy == "hash" else {"strategy": "band", "shards": 1, "bands": [0, 10, 25]}
    config = BoardConfig.from_dict(
        f"rebuild-forced-kept-{mode}-{int(archived)}-{strategy}",
        {"mode": mode, "periods": ["daily"], "retention_days": {"daily": 30}, "sharding": shards,
         "dedup_window_s": 30 * 86_400},
    )  # fmt: skip
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    try:
        old_day, day, at = await removed_then_posted_late(board, raw, a)
        s2, e2 = period_bounds(board, day.period)
        rebuilder.swap_tries = 0  # the first swap is forced
        real_snapshot, real_changes = rebuilder.snapshot, rebuilder.changes
        removed: list[Any] = []
        late = {"best": 30, "incr": 4}[mode]

        async def snapshot(*args: Any, **kwargs: Any) -> Any:
            snap = await real_snapshot(*args, **kwargs)
            await board.submit([Score("p", late, "p-3", s2 + 4 * HOUR)], now_ms=e2 - 1)  # after it
            return snap

        async def changes(*args: Any, **kwargs: Any) -> Any:
            got = await real_changes(*args, **kwargs)
            if not removed:  # the forced swap is done: the retry removes p-old's periods
                await raw.delete(keys.removals_key(board.prefixes[0]))  # put back by the rebuild
                removed.append(await moderation.remove(board, ["p"], request="remove/R", since_ms=at))
                if archived:
                    await drain(a)
                    await raw.xtrim(keys.journal_key(board.prefixes[0]), maxlen=0)
            return got

        monkeypatch.setattr(rebuilder, "snapshot", snapshot)
        monkeypatch.setattr(rebuilder, "changes", changes)
        await rebuilder.rebuild(board)
        assert removed == [{"p"}]
        # On the swapped board the retry found p-old's total on best (gone), p-2 + p-old on incr
        # (achieved since: kept); p-3 goes into the day, and into the total where it was kept.
        want = {
            "best": {"total": [("q", 3)], day.period: [("p", 30), ("q", 3)], old_day.period: []},
            "incr": {"total": [("p", 32), ("q", 3)], day.period: [("p", 12), ("q", 3)], old_day.period: []},
        }[mode]
        got = {}
        for period in (board.resolve("total"), day, old_day):
            got[period.period] = [(e.player_id, e.points) for e in await board.top(10, period)]
        assert got == want
        monkeypatch.undo()
        await drain(a)
        await rebuilder.rebuild(board)  # from PostgreSQL alone: the same
        for period in (board.resolve("total"), day, old_day):
            assert [(e.player_id, e.points) for e in await board.top(10, period)] == want[period.period]
    finally:
        await a.db.close()
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_the_activity_a_rebuild_puts_back_keeps_a_post_a_removal_that_kept_some_periods_left(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, mode: str
) -> None:
    """remove.lua keeps a player's activity entry (inactive_after boards: the last post's time) whole
    when it leaves any of their period entries whole, even where it removed the post that set it (a
    best total of before the removal). A rebuild after the activity set was lost puts back the same
    time: that post's. Until 2026-12-05 it took the player's last post among the results still on
    the board (the best total's p-old gone: p-2's, earlier)."""
    config = BoardConfig.from_dict(
        f"rebuild-kept-activity-{mode}",
        {"mode": mode, "periods": ["daily"], "retention_days": {"daily": 30}, "sharding": {"shards": 1},
         "dedup_window_s": 30 * 86_400, "inactive_after": 30 * 86_400},
    )  # fmt: skip
    board, _ = await store.create(config)
    a = await archiver(raw, store, postgres_url, {config.id})
    today = datetime.now(UTC).date()
    old_day, day = (board.resolve(f"daily:{(today - timedelta(days=n)).isoformat()}") for n in (3, 2))
    s1, _ = period_bounds(board, old_day.period)
    s2, e2 = period_bounds(board, day.period)
    at = s2 + HOUR
    prefix, seen = board.prefixes[0], keys.activity_key(board.prefixes[0])
    journal = keys.journal_key(prefix)
    try:
        first = [Score("p", 5, "p-1", s2 + HOUR // 2), Score("q", 3, "q-1", s2 + 1000)]
        await board.submit(first, now_ms=at - 1)
        await moderation.remove(board, ["p"], now_ms=at, request="remove/R")
        await board.submit([Score("p", 8, "p-2", s2 + 3 * HOUR)], now_ms=e2 - 1)
        await raw.delete(keys.removals_key(prefix))  # the dedup window is over
        before = int((await raw.xrevrange(journal, count=1))[0][0].split(b"-")[0])
        while times.now_ms() <= before:  # p-old's entry a later ms than p-2's
            await asyncio.sleep(0.002)
        await board.submit([Score("p", 20, "p-old", s1 + HOUR)], now_ms=s1 + 2 * HOUR)
        last_post = int((await raw.xrevrange(journal, count=1))[0][0].split(b"-")[0])
        assert last_post > before
        await raw.delete(keys.removals_key(prefix))
        assert await moderation.remove(board, ["p"], request="remove/R", since_ms=at) == {"p"}
        assert await raw.zscore(seen, "p") is not None  # kept with the day's entry
        await drain(a)
        await raw.delete(seen)  # lost
        await rebuilder.rebuild(board)
        assert await raw.zscore(seen, "p") == last_post
    finally:
        await a.db.close()
        await store.delete(config.id)


class CreatedMeanwhile(BoardStore):
    """A board store on which an admin creates the board again under its id (another incarnation)
    right before `rebuild --all` registers the one it restores: the one in the registry is left
    alone, as the restore says."""

    async def restore(
        self, config: BoardConfig, incarnation: str, generation: int = 0, rebuilding: Sequence[int] = ()
    ) -> tuple[Board, bool]:
        await self.create(config)
        return await super().restore(config, incarnation, generation, rebuilding)


async def test_a_board_created_meanwhile_leaves_no_key_of_the_one_a_restore_refilled(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """`rebuild --all` puts a board's retry records back (``refill``) before it registers it; when
    the registry holds another incarnation by then, the restored one is left out. Its refilled
    shards stayed: their key index and pin marker with no expiry, under an incarnation no registry
    names and no deletion would drop, for good."""
    config = BoardConfig.from_dict("rebuild-all-meanwhile", {"mode": "incr", "sharding": sharding("hash", 2)})
    board, _ = await store.create(config)
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, OnlyStore(store.client, store.scripts, {config.id}), url)
        try:
            await board.submit([Score(f"p{i}", i, f"m{i}") for i in range(1, 21)])  # pinned, deduped
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            restored = await rebuilder.restore(CreatedMeanwhile(store.client, store.scripts))
            await forget_others_restored(store)  # other modules' boards, back marked
            assert config.id not in [b.config.id for b in restored]
            assert (await store.get(config.id)).incarnation != board.incarnation
            left = {}
            for prefix in board.prefixes:
                for name in await raw.keys(f"{prefix}*"):
                    left[name] = await raw.pttl(name)
            assert {k: ttl for k, ttl in left.items() if ttl < 0} == {}, left
        finally:
            await a.db.close()
            await store.delete(config.id)


async def test_a_board_created_again_before_rebuild_all_is_named_and_the_others_restored(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a total loss of Redis, a `PUT /v1/boards/{board}` before `rebuild --all` (an admin
    script that confirms its boards at start; `make run` does it for `demo`) creates the board
    again, empty, under a new incarnation. `rebuild --all` then said "found in the registry",
    rebuilt that one from its own few rows and exited 0: the incarnation that held every archived
    result stayed out of the registry, named nowhere (found walking k8s/README.md's runbook,
    2026-12-06). Now the other boards are restored and rebuilt, and the run exits 1 naming both
    incarnations; deleting the new one and running it again brings the archived one back."""
    configs = [
        BoardConfig.from_dict("again-after-loss", {"sharding": sharding("hash", 2)}),
        BoardConfig.from_dict("again-after-loss-other", {"sharding": sharding("hash", 2)}),
    ]
    boards = [(await store.create(c))[0] for c in configs]
    async with own_archive(postgres_url) as url:
        a = await archiver(raw, OnlyStore(store.client, store.scripts, {c.id for c in configs}), url)
        try:
            for board in boards:
                await board.submit([Score(f"p{i}", i, f"m{i}") for i in range(1, 21)])
            await drain(a)
            await raw.flushall(target_nodes=raw.PRIMARIES)  # a total loss of Redis
            again, _ = await store.create(configs[0])  # the PUT before the operator's rebuild
            await again.submit([Score("late", 5, "m-late")])
            await a.refresh()  # the archiver records the new incarnation
            await drain(a)
            command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 1
            said = capsys.readouterr()
            assert boards[0].incarnation in said.err and again.incarnation in said.err, said
            other = await store.get(configs[1].id)
            assert other.incarnation == boards[1].incarnation and len(await other.top(50)) == 20
            assert (await store.get(configs[0].id)).incarnation == again.incarnation  # left as it was
            # The way back the message gives, run at once: before the archiver records the
            # deletion, the incarnation deleted is the archive's newest live one of the id.
            await store.delete(configs[0].id)
            assert await asyncio.to_thread(main, command) == 0
            back = await store.get(configs[0].id)
            assert back.incarnation == boards[0].incarnation and len(await back.top(50)) == 20
        finally:
            await a.db.close()
            for c in configs:
                with contextlib.suppress(Exception):
                    await store.delete(c.id)


async def test_a_rebuild_of_one_period_reports_that_periods_players(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb rebuild BOARD --period daily:<a day without results>` printed each shard's total as
    its players ("1665 players" for a day that has none), as the admin endpoint's report did: the
    count fell back to the total when the period rebuilt had no key. Now it counts that period."""
    settings = {"periods": ["daily"], "sharding": sharding("hash", 2)}
    config = BoardConfig.from_dict("rebuild-one-period", settings)
    board, _ = await store.create(config)
    async with own_archive(postgres_url) as archive_url:
        a = await archiver(raw, store, archive_url, {config.id})
        try:
            await board.submit([Score(f"p{i}", i, f"m{i}", times.now_ms() - 1000) for i in range(10)])
            await drain(a)
            yesterday = "daily:" + (datetime.now(UTC).date() - timedelta(days=1)).isoformat()
            rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, a.db)
            assert [r.players for r in await rebuilder.rebuild(board, yesterday)] == [0, 0]
            assert sum(r.players for r in await rebuilder.rebuild(board, "daily")) == 10
            assert sum(r.players for r in await rebuilder.rebuild(board)) == 10
            capsys.readouterr()
            command = ["rebuild", config.id, "--redis", cluster_url, "--postgres", archive_url]
            assert await asyncio.to_thread(main, [*command, "--period", yesterday]) == 0
            out = capsys.readouterr().out
            assert out.count(": 0 players,") == 2, out
            # Its lines name a shard as --shard, reconcile and archive_gaps do (from 0): "shard 1/2"
            # was shard 0, and `--shard 1` printed "shard 2/2".
            assert await asyncio.to_thread(main, [*command, "--shard", "1"]) == 0
            assert f"{config.id} shard 1 (2 of 2): " in capsys.readouterr().out
        finally:
            await a.db.close()
            with contextlib.suppress(Exception):
                await store.delete(config.id)
