"""Online reshard (shardlb/reshard.py) on the session cluster, against the in-memory reference board.

Writers keep posting random results (incr board: dedup matters) while the board goes 1 -> 3 -> 16
-> 4 shards; between writes a reader compares top, pages, ranks, around and query with the model,
through a board object it keeps the way a router does (fetched again after ``CACHE`` seconds or
when told the layout moved). A mover killed with SIGKILL in the middle is resumed. Every write
refused during a cut-over is retried with the same match ids, and must count once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest

from shardlb import cli, keys, moderation, reshard, times
from shardlb.board import MAX_FUTURE_MS, Board, Entry, Score
from shardlb.cluster import LocalCluster
from shardlb.config import AUTO_SHARDS, BoardConfig, Sharding
from shardlb.errors import BoardConflict, BoardNotFound, Resharding
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard

pytestmark = pytest.mark.cluster

CACHE = 0.5  # how long the test's "router" keeps a board; the mover is told the same
PAUSES = "copied shard 2/:30,sealed and moved:30"  # where the killed movers wait to be killed
# The killed movers' lease (10 s in production): the mover that resumes after one waits it out.
MOVER_LEASE_MS = 3000


class Router:
    """A board kept as router/boards.py keeps it: for ``CACHE`` seconds, or until it is stale."""

    def __init__(self, store: BoardStore, board_id: str) -> None:
        self.store, self.board_id = store, board_id
        self.board: Board | None = None
        self.fetched = 0.0
        self.refused = 0  # calls answered Resharding (retried)

    async def get(self) -> Board:
        if self.board is None or self.board.stale or time.monotonic() - self.fetched > CACHE:
            self.board = await self.store.get(self.board_id)
            self.fetched = time.monotonic()
        return self.board

    async def call(self, work: Callable[[Board], Awaitable[Any]]) -> Any:
        for _ in range(400):
            try:
                return await work(await self.get())
            except Resharding:
                self.refused += 1
                await asyncio.sleep(0.05)
        raise AssertionError("refused for 20 s")


def expected(ref: ReferenceBoard, name: str = "total") -> list[Entry]:
    return [
        Entry(i + 1, player, points, ref.codec.units_to_ms(units))
        for i, (_, player, points, units) in enumerate(ref.order(name))
    ]


class Workload:
    """Random incr results from a pool of players, some sent twice (a client's retry)."""

    def __init__(self, router: Router, ref: ReferenceBoard, seed: int, players: int) -> None:
        self.router, self.ref = router, ref
        self.rng = random.Random(seed)
        self.players = [f"p{i:05d}" for i in range(players)]
        self.sent: list[list[Score]] = []
        self.lock = asyncio.Lock()  # a read is compared while no write is in flight
        self.writes = 0

    def batch(self) -> list[Score]:
        rng = self.rng
        if self.sent and rng.random() < 0.2:
            return rng.choice(self.sent)  # a retry of an earlier call: duplicates in the model too
        now = times.now_ms()
        scores = [
            Score(
                rng.choice(self.players),
                rng.randint(0, 30),
                f"m{self.writes}-{i}",
                now - rng.randint(0, 5000),
            )
            for i in range(rng.randint(1, 40))
        ]
        self.sent.append(scores)
        return scores

    async def write(self) -> None:
        scores = self.batch()
        async with self.lock:
            now = times.now_ms()
            refused = self.router.refused
            got = await self.router.call(lambda b: b.submit(scores, now))
            want = self.ref.submit(scores, now)
            statuses = [(r.status, r.points) for r in got]
            if self.router.refused == refused:
                assert statuses == want
            else:
                # Refused while the cut-over sealed the shards one by one, the call may have been
                # applied on the shards not sealed yet: its retry finds those results applied and
                # answers them "duplicate" with the player's points of now (as a client's retry
                # would). The board's contents must still be those of one call (``check``).
                assert len(statuses) == len(want)
                for (status, points), (wanted, wanted_points) in zip(statuses, want, strict=True):
                    assert status == "duplicate" or (status, points) == (wanted, wanted_points)
            self.writes += 1

    async def check(self) -> None:
        async with self.lock:
            want = expected(self.ref)
            await self._check(want)

    async def _check(self, want: list[Entry]) -> None:
        r, rng = self.router, self.rng
        assert await r.call(lambda b: b.top(20)) == want[:20]
        assert await r.call(lambda b: b.size()) == len(want)
        offset = rng.randint(0, max(len(want) - 1, 0))
        assert await r.call(lambda b: b.entries(offset, 15)) == want[offset : offset + 15]
        by_player = {e.player_id: e for e in want}
        for e in rng.sample(want, min(5, len(want))):
            found = await r.call(lambda b, p=e.player_id: b.player(p))
            assert found.entry == e and found.players == len(want)
            around = await r.call(lambda b, p=e.player_id: b.around(p, 3))
            assert around == want[max(e.rank - 4, 0) : e.rank + 3]
        asked = rng.sample(self.players, 12)
        got = await r.call(lambda b: b.query(asked))
        assert got == sorted((by_player[p] for p in asked if p in by_player), key=lambda e: e.rank)

    async def run_until(self, done: asyncio.Event, check_every: int = 5) -> None:
        while not done.is_set():
            await self.write()
            if self.writes % check_every == 0:
                await self.check()
            await asyncio.sleep(0)


async def make_board(store: BoardStore, shards: int, **extra: Any) -> tuple[Board, ReferenceBoard]:
    board_id = f"rs-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "incr", "periods": ["daily"], "durability": "memory",
            "sharding": {"strategy": "hash", "shards": shards}, **extra}  # fmt: skip
    config = BoardConfig.from_dict(board_id, body)
    board, _ = await store.create(config)
    return board, ReferenceBoard(config)


async def keys_of(store: BoardStore, board: Board) -> int:
    """How many keys the shards of ``board``'s layout hold (their indexes' listings)."""
    total = 0
    for prefix in board.prefixes:
        total += await store.client.zcard(keys.index_key(prefix))
    return total


async def test_reshard_chain_under_writes_and_reads(store: BoardStore) -> None:
    board, ref = await make_board(store, 1)
    router = Router(store, board.config.id)
    work = Workload(router, ref, seed=11, players=3000)
    for _ in range(60):  # a board worth copying in several batches
        await work.write()
    await work.check()
    layouts = [board]
    for shards in (3, 16, 4):
        done = asyncio.Event()
        writers = asyncio.gather(work.run_until(done), work.run_until(done, check_every=3))
        mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
        await mover.start(shards)
        status = await mover.run()
        done.set()
        await writers
        assert status["state"] == "none" and status["shards"] == shards
        current = await store.get(board.config.id)
        assert current.config.sharding.shards == shards and not current.also
        await work.check()
        # The old layout's keys are gone (its markers say "moved" for a day).
        assert await keys_of(store, layouts[-1]) == 0
        assert [await store.client.get(keys.move_key(p)) for p in layouts[-1].prefixes] == ["m"] * len(
            layouts[-1].prefixes
        )
        layouts.append(current)
    # Every daily board came along too.
    view = layouts[-1].resolve("daily")
    assert await layouts[-1].top(50, view) == expected(ref, view.period)[:50]
    assert work.writes > 60 and router.refused >= 0


async def test_retried_write_after_cut_over_is_a_duplicate(store: BoardStore) -> None:
    board, ref = await make_board(store, 2)
    now = times.now_ms()
    first = [Score("alice", 10, "m1"), Score("bob", 7, "m2")]
    assert [r.status for r in await board.submit(first, now)] == ["improved", "improved"]
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(5)
    await mover.run()
    with pytest.raises(Resharding):  # the old layout refuses, and the caller fetches the board again
        await board.submit(first, now)
    assert board.stale
    fresh = await store.get(board.config.id)
    assert [r.status for r in await fresh.submit(first, now)] == ["duplicate", "duplicate"]
    assert [(e.player_id, e.points) for e in await fresh.top(5)] == [("alice", 10), ("bob", 7)]
    # A game server that PUTs the settings it created the board with still gets its board.
    same, created = await store.create(ref.config)
    assert not created and same.config.sharding.shards == 5


async def test_a_put_after_a_reshard_confirms_only_the_layouts_the_board_had(store: BoardStore) -> None:
    """After a reshard, a PUT with the settings the board was created with (or with its layout now,
    or naming no shard count) confirms it; any other sharding is 409 board_conflict (api.md) and
    changes nothing. The registry accepted any sharding once the board had been resharded: a PUT
    of 3 hash shards, or of a band or region board, over a board created with 2 and resharded to
    5 was answered as "an identical board exists"."""
    board, ref = await make_board(store, 2)
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(5)
    await mover.run()
    base = {k: v for k, v in ref.config.to_dict().items() if k not in ("board", "sharding")}

    def settings(sharding: dict[str, Any] | None) -> BoardConfig:
        body = {**base, **({} if sharding is None else {"sharding": sharding})}
        return BoardConfig.from_dict(board.config.id, body, default_shards=AUTO_SHARDS)  # as a PUT reads it

    for same in ({"shards": 2}, {"shards": 5}, None, {"strategy": "hash"}):
        found, created = await store.create(settings(same))
        assert not created and found.config.sharding.shards == 5, same
    for other in (
        {"shards": 3},
        {"strategy": "band", "shards": 2, "bands": [0, 100]},
        {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2},
    ):
        with pytest.raises(BoardConflict):
            await store.create(settings(other))
    with pytest.raises(BoardConflict):  # another setting with the layout of creation: still not the board
        await store.create(replace(settings({"shards": 2}), mode="best"))
    assert (await store.get(board.config.id)).config == replace(ref.config, sharding=Sharding("hash", 5))
    # A band reshard of it: the hash settings of its creation still confirm it.
    await mover.start(2, bands=[0, 50])
    await mover.run()
    found, created = await store.create(settings({"shards": 2}))
    assert not created and found.config.sharding.strategy == "band"
    with pytest.raises(BoardConflict):
        await store.create(settings({"strategy": "band", "shards": 2, "bands": [0, 60]}))
    await store.delete(board.config.id)


async def test_a_removal_still_refuses_retries_after_a_reshard(store: BoardStore) -> None:
    """A removal's record (remove.lua's `rmv`, and its marker) is copied with the board: a retry of
    a removed player's result after the cut-over is still a duplicate, not the player back."""
    board, _ = await make_board(store, 2, mode="best")
    now = times.now_ms()
    posts = [Score(f"p{i}", 10 + i, f"m{i}", now - 60_000) for i in range(20)]
    await board.submit(posts, now)
    await moderation.remove(board, ["p3"])
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(5)
    await moderation.remove(board, ["p7"])  # while the reshard is under way
    await mover.run()
    fresh = await store.get(board.config.id)
    again = await fresh.submit([posts[3], posts[7], posts[9]], times.now_ms())
    assert [r.status for r in again] == ["duplicate", "duplicate", "unchanged"]
    assert {e.player_id for e in await fresh.top(50)} == {f"p{i}" for i in range(20)} - {"p3", "p7"}


async def test_a_removal_retried_after_a_reshard_is_still_the_same_removal(store: BoardStore) -> None:
    """A removal's record of its request (remove.lua's `<request> NUL <player>` in `rmv`) is copied
    with the board, made before the reshard or after its shard was copied (a tracked change): the
    retry of the request
    after the cut-over changes nothing, and the results the players posted since stay."""
    board, _ = await make_board(store, 2, mode="best")
    now = times.now_ms()
    await board.submit([Score(f"p{i}", 10 + i, f"m{i}", now - 60_000) for i in range(20)], now)
    await moderation.remove(board, ["p3"], now_ms=now, request="remove/r-3")
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(5)
    copy_shard, copied = mover.copier.copy_shard, []

    async def then_remove(prefix: str, target: Board) -> int:
        count = await copy_shard(prefix, target)
        copied.append(prefix)
        if len(copied) == len(board.prefixes):  # every old shard copied: only tracked from now on
            await moderation.remove(board, ["p7"], now_ms=now, request="remove/r-7")
        return count

    mover.copier.copy_shard = then_remove  # type: ignore[method-assign]
    await mover.run()
    assert len(copied) == len(board.prefixes)
    fresh = await store.get(board.config.id)
    later = now + MAX_FUTURE_MS + 2_000  # achieved after the removals' records
    posted = await fresh.submit([Score("p3", 1, "n3", later), Score("p7", 2, "n7", later)], later)
    assert [r.status for r in posted] == ["improved", "improved"]
    for player in ("p3", "p7"):
        assert await moderation.remove(fresh, [player], request=f"remove/r-{player[1:]}") == {player}
    assert [(e.player_id, e.points) for e in (await fresh.top(50))[-2:]] == [("p7", 2), ("p3", 1)]


async def test_a_reshard_never_shortens_the_life_of_a_removal_record(store: BoardStore) -> None:
    """A new shard fed by several old ones took the expiry of whichever old shard's record was
    copied last, often the earliest: a later removal's record then lapsed early and its player's
    retry was applied again. Each new record now expires no sooner than the latest it was fed by."""
    board, _ = await make_board(store, 2, mode="best")
    now = times.now_ms()
    players = [f"p{i}" for i in range(40)]
    await board.submit([Score(p, 10, "m1", now - 60_000) for p in players], now)
    early = [p for p in players if board.layout.home(p) == 1]  # old shard 1's latest removal ...
    late = [p for p in players if board.layout.home(p) == 0]  # ... an hour before old shard 0's
    await moderation.remove(board, early, now_ms=now - 3_600_000)
    await moderation.remove(board, late, now_ms=now)
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(3)
    await mover.run()
    fresh = await store.get(board.config.id)
    latest = now + fresh.config.dedup_window_s * 1000
    for prefix in fresh.prefixes:
        for key in (keys.removals_key(prefix), keys.removals_marker_key(prefix)):
            assert await store.client.pexpiretime(key) >= latest, key


async def test_stale_read_of_the_old_layout_is_refused(store: BoardStore) -> None:
    board, _ = await make_board(store, 2)
    await board.submit([Score("a", 5, "m1")])
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(3)
    moving = await store.get(board.config.id)
    assert moving.moving
    await mover.run()
    await (await store.get(board.config.id)).submit([Score("b", 9, "m2")])
    # A router that fetched the board while it was moving reads the old layout: it must not answer
    # from it once the new one takes writes.
    with pytest.raises(Resharding):
        await moving.top(10)
    assert moving.stale


async def test_cancel_leaves_the_board_as_it_was(store: BoardStore) -> None:
    board, ref = await make_board(store, 3)
    router = Router(store, board.config.id)
    work = Workload(router, ref, seed=5, players=500)
    for _ in range(20):
        await work.write()
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
    await mover.start(7)
    with pytest.raises(BoardConflict):
        await mover.start(8)  # one reshard at a time
    target = store.layout(replace(board.config, sharding=Sharding("hash", 7)), board.incarnation, 1)
    # Copy, then cancel instead of sealing: the source keeps tracking until then.
    record = (await mover.record())[1]
    await mover._copy(record)
    for _ in range(10):
        await work.write()
    assert await keys_of(store, target) > 0
    assert await Resharder(store, board.config.id, say=lambda _: None).cancel() == "cancelled"
    assert await keys_of(store, target) == 0
    for prefix in board.prefixes + target.prefixes:
        assert await store.client.get(keys.move_key(prefix)) is None
        assert not await store.client.exists(keys.changes_key(prefix))
    after = await store.get(board.config.id)
    assert after.config.sharding.shards == 3 and not after.moving and not after.also
    await work.check()
    with pytest.raises(BoardConflict):
        await Resharder(store, board.config.id).cancel()


async def test_a_cancel_recorded_just_before_the_commit_wins_and_is_answered_truly(store: BoardStore) -> None:
    """A cancel recorded after the mover's last check for one, just before its commit: the commit
    went ahead anyway (the new layout won), and cancel() still answered "cancelled" once it found
    no reshard in the record. The commit must refuse, so that what cancel() answers is true."""
    board, ref = await make_board(store, 3)
    work = Workload(Router(store, board.config.id), ref, seed=13, players=300)
    for _ in range(15):
        await work.write()
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(5)
    target = store.layout(replace(board.config, sharding=Sharding("hash", 5)), board.incarnation, 1)
    start_journals, answers = mover._start_journals, []

    async def cancelled_meanwhile(source: Board, into: Board) -> None:
        # Every shard is sealed and moved and the last check for a cancel is made: the commit is next.
        answers.append(asyncio.ensure_future(Resharder(store, board.config.id, say=lambda _: None).cancel()))
        while not (await mover.record())[1]["reshard"].get("cancel"):
            await asyncio.sleep(0.01)
        await start_journals(source, into)

    mover._start_journals = cancelled_meanwhile  # type: ignore[method-assign]
    [ended] = await asyncio.gather(mover.run(), return_exceptions=True)
    after = await store.get(board.config.id)
    # What the operator is told must be true of the board: before, ("cancelled", 5).
    assert (await answers[0], after.config.sharding.shards) == ("cancelled", 3)
    assert isinstance(ended, reshard.Cancelled), ended
    assert not after.moving and not after.also
    assert await keys_of(store, target) == 0
    for prefix in board.prefixes:  # the old layout takes writes again
        assert await store.client.get(keys.move_key(prefix)) is None
        assert not await store.client.exists(keys.seal_key(prefix))
    for _ in range(5):
        await work.write()
    await work.check()


async def test_a_cancel_after_the_commit_is_refused_and_the_reshard_finishes(store: BoardStore) -> None:
    """The other order: the commit lands first, so the cancel is refused (409) and the reshard ends
    on the new layout; the record never carries a cancel past the commit."""
    board, ref = await make_board(store, 3)
    work = Workload(Router(store, board.config.id), ref, seed=17, players=300)
    for _ in range(15):
        await work.write()
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(5)
    finish = mover._finish

    async def cancelled_after_commit(record: dict[str, Any]) -> dict[str, Any]:
        with pytest.raises(BoardConflict, match="committed already"):
            await Resharder(store, board.config.id, say=lambda _: None).cancel()
        record = (await mover.record())[1]
        assert record["reshard"]["state"] == "committed" and not record["reshard"].get("cancel")
        return await finish(record)

    mover._finish = cancelled_after_commit  # type: ignore[method-assign]
    final = await mover.run()
    assert final["state"] == "none" and final["shards"] == 5
    with pytest.raises(BoardConflict, match="no reshard under way"):
        await Resharder(store, board.config.id, say=lambda _: None).cancel()
    await work.check()


async def test_a_cancel_while_a_live_mover_holds_the_lease_is_answered_as_recorded(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel records its request, then waits for the board's lease to finish the cancel itself.
    A live mover in the middle of a long step (one large shard's copy) keeps its lease past that
    wait: the cancel then failed with 409 "another process is resharding this board", though its
    request was recorded and the running mover (or the next resume) carries it out: the board keeps
    its layout. It answers that the cancel is recorded, and the mover running elsewhere cancels."""
    monkeypatch.setattr(reshard, "LEASE_MS", 500)  # the cancel waits a lease and a second for it
    board, _ = await make_board(store, 2)
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(4)
    key = keys.lease_key(board.config.id)
    await store.client.set(key, "a-live-mover", px=60_000)  # refreshed all along by its holder
    said: list[str] = []
    assert await Resharder(store, board.config.id, say=said.append).cancel() == "cancelling"
    assert said and "cancels it" in said[-1]
    assert (await Resharder(store, board.config.id).status())["cancel_requested"]
    await store.client.delete(key)  # the live mover's next step finds the request and cancels
    assert (await mover.run())["state"] == "cancelled"
    after = await store.get(board.config.id)
    assert after.config.sharding.shards == 2 and not after.moving and not after.also


@pytest.mark.parametrize("outcome", ["finished", "cancelled", "still running"])
async def test_a_resume_while_a_live_mover_holds_the_lease_reports_that_mover(
    store: BoardStore,
    cluster_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    outcome: str,
) -> None:
    """`shardlb reshard BOARD --resume` while a live mover holds the board's lease waits a lease for
    it. That mover ending the reshard meanwhile (finished, or cancelled) is said as such, exit 0,
    where the resume then took the lease, found no reshard and failed with "no reshard under way"
    (exit 1), as if there had never been one. One still running when the wait ends is named as a
    live mover to follow with --status (exit 1, README's statuses), not "another process"."""
    monkeypatch.setattr(reshard, "LEASE_MS", 3000)  # the resume waits a lease and a second for it
    board, _ = await make_board(store, 2)
    await board.submit([Score("a", 5, "m1"), Score("b", 7, "m2")])
    live = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await live.start(3)
    live.token = "a-live-mover"  # its lease, held (and refreshed) by it all along
    key = keys.lease_key(board.config.id)
    await store.client.set(key, live.token, px=60_000)
    resume = ["reshard", board.config.id, "--resume", "--redis", cluster_url]
    waiting = asyncio.create_task(asyncio.to_thread(cli.main, resume))
    await asyncio.sleep(0.5)  # the resume has read the record and waits for the lease
    if outcome == "finished":
        assert (await live.run())["state"] == "none"
    elif outcome == "cancelled":
        assert await live.cancel() == "cancelled"
    code = await waiting
    out, err = capsys.readouterr()
    if outcome == "still running":
        assert code == 1, out + err
        assert "another mover is running the reshard" in err, err
        assert f"shardlb reshard {board.config.id} --status" in err, err
        await store.client.delete(key)
        assert await live.cancel() == "cancelled"
        return
    assert code == 0, out + err
    assert "no reshard under way" not in err, err
    status = json.loads(out.splitlines()[-1])
    line = f"{board.config.id}: another mover {outcome} the reshard while this one waited for it"
    assert line in out, out
    assert status["state"] == ("none" if outcome == "finished" else "cancelled"), status
    assert status["shards"] == (3 if outcome == "finished" else 2), status


async def test_a_resume_after_the_commit_finishes_past_a_stale_cancel(store: BoardStore) -> None:
    """A committed record that still carries a cancel (the commit used to keep it: a mover that
    stopped after such a commit) is finished by the resume, not refused as "committed already"."""
    board, _ = await make_board(store, 2)
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(4)

    async def stops_after_commit(record: dict[str, Any]) -> dict[str, Any]:
        await mover._update(lambda r: {**r, "reshard": {**r["reshard"], "cancel": True}})
        raise ConnectionError("the mover stopped after its commit")

    mover._finish = stops_after_commit  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await mover.run()
    final = await Resharder(store, board.config.id, say=lambda _: None).run()
    assert final["state"] == "none" and final["shards"] == 4


async def test_a_board_deleted_while_it_is_copied_leaves_no_keys(store: BoardStore) -> None:
    """DELETE during a reshard drops both layouts' shards, but the mover's copy under way went on
    writing into the new layout's (registered in its index, the total with no expiry): keys that
    nothing would ever drop. The mover that finds its board gone drops the new layout again."""
    board, ref = await make_board(store, 3)
    work = Workload(Router(store, board.config.id), ref, seed=9, players=300)
    for _ in range(10):
        await work.write()
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
    await mover.start(7)
    target = store.layout(replace(board.config, sharding=Sharding("hash", 7)), board.incarnation, 1)
    copy, write, calls = mover.copier.copy_shard, mover.copier._write, [0, 0]

    async def counted(prefix: str, into: Board) -> int:
        calls[0] += 1
        return await copy(prefix, into)

    async def deleted_midway(*args: Any, **kwargs: Any) -> None:
        calls[1] += 1
        if calls[0] == 2 and not deleted:  # the second shard's rows are read, then the board goes
            deleted.append(await store.delete(board.config.id))
        await write(*args, **kwargs)

    deleted: list[None] = []
    mover.copier.copy_shard = counted  # type: ignore[method-assign]
    mover.copier._write = deleted_midway  # type: ignore[method-assign]
    with pytest.raises(BoardNotFound):
        await mover.run()
    assert deleted and calls[0] == 2
    assert await keys_of(store, target) == 0
    assert await keys_of(store, board) == 0


async def test_a_board_deleted_before_its_layouts_are_marked_keeps_no_marker(store: BoardStore) -> None:
    """The deletion lands between the mover's take of the reshard and its marks on both layouts:
    the marks go onto shards the deletion has dropped already, the old layout's `t` with no expiry
    and listed nowhere. The mover that finds the board gone dropped the new layout again, but not the
    old one, whose `mv` stayed for good."""
    board, _ = await make_board(store, 3)
    await board.submit([Score(f"p{i}", i, f"m{i}") for i in range(20)])
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
    await mover.start(2)
    target = store.layout(replace(board.config, sharding=Sharding("hash", 2)), board.incarnation, 1)
    send, deleted = mover.copier.send, []

    async def deleted_first(*args: Any, **kwargs: Any) -> Any:
        if not deleted:
            deleted.append(await store.delete(board.config.id))
        return await send(*args, **kwargs)

    mover.copier.send = deleted_first  # type: ignore[method-assign]
    with pytest.raises(BoardNotFound):
        await mover.run()
    assert deleted
    markers = [keys.move_key(p) for p in board.prefixes + target.prefixes]
    left = {m: await store.client.pttl(m) for m in markers}
    assert {m: ttl for m, ttl in left.items() if ttl != -2} == {}


async def test_a_mover_killed_after_its_board_was_deleted_leaves_no_copies(store: BoardStore) -> None:
    """The board is deleted while a batch the mover read is on its way to the new layout, and the
    mover dies before it learns of the deletion (killed, or stopped by another error): nothing may
    stay of the copy. The fences outlived the deletion, so the batch landed on shards already
    dropped, listed in their index with no expiry, and no resume could find them (the board is
    gone): they stayed for good."""
    board, ref = await make_board(store, 3)
    work = Workload(Router(store, board.config.id), ref, seed=13, players=300)
    for _ in range(10):
        await work.write()
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
    await mover.start(5)
    target = store.layout(replace(board.config, sharding=Sharding("hash", 5)), board.incarnation, 1)
    write, deleted = mover.copier._write, []

    async def deleted_then_killed(*args: Any, **kwargs: Any) -> None:
        if not deleted:
            deleted.append(await store.delete(board.config.id))
            await write(*args, **kwargs)
            raise RuntimeError("the mover is killed")
        await write(*args, **kwargs)

    mover.copier._write = deleted_then_killed  # type: ignore[method-assign]
    with pytest.raises((RuntimeError, BoardConflict, BoardNotFound)):
        await mover.run()
    assert deleted
    left = {}
    for prefix in board.prefixes + target.prefixes:
        for name in await store.client.keys(f"{prefix}*"):
            left[name] = await store.client.pttl(name)
    assert {k: ttl for k, ttl in left.items() if ttl < 0} == {}, left


@pytest.mark.parametrize("command", ["reshard --resume", "bands --apply"])
async def test_a_cancelled_reshard_is_not_called_unfinished(
    store: BoardStore, cluster_url: str, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A run that carried out a cancel recorded elsewhere (`shardlb reshard --cancel`) exited 3,
    the code of a reshard committed but not finished, and told the operator to finish it with
    `--resume`, which then failed: there was nothing left to resume (a reshard audit's finding). It
    exits 0, its JSON and its line say it was cancelled and how many shards the board keeps."""
    board, _ = await make_board(store, 2)
    await board.submit([Score("a", 5, "m1")])
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(3, [0, 100])
    await mover._update(lambda r: {**r, "reshard": {**r["reshard"], "cancel": True}})  # told, not done
    verb, flag = command.split()
    args = [
        verb,
        board.config.id,
        flag,
        "--redis",
        cluster_url,
        *(["--count", "2"] if verb == "bands" else []),
    ]
    code = await asyncio.to_thread(cli.main, args)
    out, err = capsys.readouterr()
    assert (code, json.loads(out.splitlines()[-1])["state"]) == (0, "cancelled"), err
    assert "keeps 2 shards" in out + err and "--resume" not in err
    after = await store.get(board.config.id)
    assert after.config.sharding.shards == 2 and after.layout.strategy == "hash" and not after.moving


async def test_reshard_refuses_what_it_cannot_do(store: BoardStore) -> None:
    board, _ = await make_board(store, 2)
    mover = Resharder(store, board.config.id, say=lambda _: None)
    with pytest.raises(BoardConflict):
        await mover.start(2)  # the shard count it has
    with pytest.raises(BoardConflict):
        await mover.run()  # nothing under way
    region_id = f"rsr-{os.getpid()}"
    sharding = {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2}
    config = BoardConfig.from_dict(region_id, {"durability": "memory", "sharding": sharding})
    await store.create(config)
    with pytest.raises(BoardConflict, match="hash and band boards"):
        await Resharder(store, region_id).start(4)
    band, _ = await make_board(store, 2, sharding={"strategy": "band", "shards": 2, "bands": [0, 10]})
    with pytest.raises(BoardConflict, match="these bands already"):
        await Resharder(store, band.config.id, say=lambda _: None).start(2, [0, 10])


async def test_a_movers_lines_count_one_shard_as_one(store: BoardStore) -> None:
    """A mover's lines (`shardlb reshard`'s output, a router's log) said "1 shards left", "reshard
    to 1 shards recorded", "cut over to 1 shards", "the board has 1 shards already" and "the board
    keeps 1 shards" (until 2026-12-06)."""
    board, _ = await make_board(store, 2)
    await board.submit([Score(f"p{i}", i, "m1", times.now_ms()) for i in range(20)])
    said: list[str] = []
    await Resharder(store, board.config.id, say=said.append, cache_s=0).start(1)
    await Resharder(store, board.config.id, say=said.append, cache_s=0).run()
    with pytest.raises(BoardConflict) as refused:
        await Resharder(store, board.config.id, say=said.append).start(1)
    mover = Resharder(store, board.config.id, say=said.append, cache_s=0)
    await mover.start(2)
    assert await mover.cancel() == "cancelled"
    lines = "\n".join([*said, refused.value.message])
    assert " 1 shards" not in lines, lines
    for line in (
        ": reshard to 1 shard recorded",
        "; 1 shard left)",
        ": cut over to 1 shard;",
        "the old layout's 2 shards dropped",
        "the board has 1 shard already",
        "the board keeps 1 shard\n",
    ):
        assert line in lines + "\n", (line, lines)


async def test_a_retried_start_of_the_same_reshard_is_the_same_reshard(store: BoardStore) -> None:
    """A client that sends its reshard again (its first answer lost) gets the reshard under way,
    not a 409; another target while one is under way is still refused. No router keeps the board:
    the mover waits for no board cache (it waited 6 s for none until 2026-12-07)."""
    board, _ = await make_board(store, 2)
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    first = await mover.start(4)
    assert await mover.start(4) == first  # recorded once: the same record
    with pytest.raises(BoardConflict, match="being resharded already"):
        await mover.start(8)
    await mover.run()
    assert (await store.get(board.config.id)).config.sharding.shards == 4


def _mover(cluster: LocalCluster, board_id: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "shardlb", "reshard", board_id, "--redis", cluster.url, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Each pause gives the test time to kill the mover right there.
        env={
            **os.environ,
            "SHARDLB_POSTGRES_URL": "",
            "SHARDLB_RESHARD_PAUSE": PAUSES,
            "SHARDLB_RESHARD_LEASE_MS": str(MOVER_LEASE_MS),
            "SHARDLB_RESHARD_CACHE_S": str(CACHE),  # as the in-process movers are told
        },
    )


async def _kill_at(proc: subprocess.Popen[str], marker: str) -> list[str]:
    """SIGKILL the mover right after it printed a line containing ``marker``."""
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    assert proc.stdout is not None
    while True:
        line = await loop.run_in_executor(None, proc.stdout.readline)
        if not line:
            proc.stdout.close()
            raise AssertionError(f"the mover ended before {marker!r}: {seen}")
        seen.append(line)
        if marker in line:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            return seen


@pytest.mark.parametrize(
    ("first", "to"),
    [
        ({"strategy": "hash", "shards": 3}, ["--shards", "16"]),
        ({"strategy": "band", "shards": 3, "bands": [0, 400]}, ["--shards", "4", "--bands", "0,10,25,45"]),
    ],
    ids=["hash", "band"],
)
async def test_killed_mover_is_resumed(
    store: BoardStore, cluster: LocalCluster, first: dict[str, Any], to: list[str]
) -> None:
    """Killed mid-copy and again mid-seal, resumed each time; a band board's copy counts its three
    home shards only (its bands are built again from the totals)."""
    board, ref = await make_board(store, 3, sharding=first)
    router = Router(store, board.config.id)
    work = Workload(router, ref, seed=23, players=4000)
    for _ in range(80):
        await work.write()
    done = asyncio.Event()
    writers = asyncio.ensure_future(work.run_until(done, check_every=4))
    try:
        # Killed in the middle of the copy, then again while its seals hold writes back.
        await _kill_at(_mover(cluster, board.config.id, *to), "copied shard 2/3")
        status = await Resharder(store, board.config.id).status()
        assert status["state"] == "copying" and status["shards_copied"] == 2
        await asyncio.sleep(0.5)
        lines = await _kill_at(_mover(cluster, board.config.id, "--resume"), "sealed and moved")
        assert not any("copied shard 1/3" in line for line in lines)  # the copied shards were kept
        # Killed with its shards sealed or moved and the record not yet committed: writes wait
        # (the writers retry) until the resume below seals what is left and cuts over.
        assert (await Resharder(store, board.config.id).status())["state"] == "sealing"
        await asyncio.sleep(0.5)
        mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
        final = await mover.run()
    finally:
        done.set()
        await writers
    assert final["state"] == "none" and final["shards"] == int(to[1])
    await work.check()
    assert router.refused > 0 or work.writes > 80


# (the board's first sharding, the reshard to (shards, bands), the one after it)
JOURNALED = {
    "hash": ({"strategy": "hash", "shards": 3}, (8, None), (2, None)),
    "band": ({"strategy": "band", "shards": 3, "bands": [0, 400]}, (4, [0, 10, 25, 45]), (2, [0, 20])),
}


@pytest.mark.parametrize("kind", sorted(JOURNALED))
async def test_journal_board_resharded_is_archived_whole_and_rebuilds_to_the_same(
    store: BoardStore, raw: Any, rebuilder: Any, postgres_url: str, kind: str
) -> None:
    """The journal moves with the board: the archiver drains the old layout's journals after the
    cut-over, the archive's rows are re-homed to the new shards, and reconcile and rebuild agree
    (a band board's journals are its home shards', and its next bands are built from them)."""
    from shardlb import reconcile
    from tests.test_rebuild import archive_round, archiver, drain

    first, (shards, bands), (then, then_bands) = JOURNALED[kind]
    board, ref = await make_board(store, first["shards"], durability="journal", sharding=first)
    router = Router(store, board.config.id)
    work = Workload(router, ref, seed=41, players=800)
    a = await archiver(raw, store, postgres_url)
    stop = asyncio.Event()

    async def archive() -> None:
        while not stop.is_set():
            await a.refresh()  # as `shardlb archive` does every few seconds: it learns of the cut-over
            if not await archive_round(a):
                await asyncio.sleep(0.02)

    archiving = asyncio.ensure_future(archive())
    for _ in range(30):
        await work.write()
    done = asyncio.Event()
    writers = asyncio.ensure_future(work.run_until(done))
    try:
        mover = Resharder(
            store, board.config.id, say=lambda _: None, postgres_url=postgres_url, cache_s=CACHE
        )
        await mover.start(shards, bands)
        final = await mover.run()
    finally:
        done.set()
        await writers
        stop.set()
        await archiving
    assert final["state"] == "none" and final["shards"] == shards
    await a.refresh()
    await drain(a)
    await a.db.close()
    current = await store.get(board.config.id)
    checks = await reconcile.reconcile(rebuilder, current)
    assert len(checks) == current.layout.physical and not [c for c in checks if c.drift], checks
    homes, banded = checks[:shards], checks[shards:]  # a band board's bands hold each player once too
    assert sum(c.postgres_players for c in homes) == len(ref.order())
    assert sum(c.redis_players for c in banded) == (len(ref.order()) if bands else 0)
    await rebuilder.rebuild(current)
    router.board = None
    await work.check()
    # Again with no write after the cut-over: every new journal is empty, and the rebuild still
    # finds every archived row (an incr board counts rows up to its journal's position).
    a = await archiver(raw, store, postgres_url)
    mover = Resharder(store, board.config.id, say=lambda _: None, postgres_url=postgres_url, cache_s=0)
    await mover.start(then, then_bands)
    stop.clear()
    archiving = asyncio.ensure_future(archive())
    try:
        assert (await mover.run())["shards"] == then
    finally:
        stop.set()
        await archiving
        await a.db.close()
    await rebuilder.rebuild(await store.get(board.config.id))
    router.board = None
    await work.check()


async def test_hash_board_becomes_a_band_board_under_writes_and_reads(store: BoardStore) -> None:
    """hash -> band: the home shards copied as for any reshard, and the band index built from the
    totals; players keep crossing bands while it runs (incr results of up to 30 points)."""
    board, ref = await make_board(store, 3)
    router = Router(store, board.config.id)
    work = Workload(router, ref, seed=61, players=1500)
    for _ in range(40):
        await work.write()
    done = asyncio.Event()
    writers = asyncio.gather(work.run_until(done), work.run_until(done, check_every=3))
    try:
        mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
        await mover.start(4, [0, 40, 120, 300])
        final = await mover.run()
    finally:
        done.set()
        await writers
    assert final["state"] == "none" and final["shards"] == 4
    current = await store.get(board.config.id)
    assert current.layout.strategy == "band" and current.layout.physical == 8
    await work.check()
    for _ in range(30):  # band moves after the cut-over, through band.lua at the players' versions
        await work.write()
    await work.check()
    view = current.resolve("daily")
    assert await current.top(40, view) == expected(ref, view.period)[:40]


async def test_band_board_takes_new_band_starts_then_becomes_a_hash_board(store: BoardStore) -> None:
    """band -> band (new starts, another home shard count) -> hash, under writes and reads: only
    the home shards are copied (they hold every total and period); the bands of the new layout
    are built from the totals, so a band row the old layout had not settled yet cannot leak in."""
    board, ref = await make_board(store, 4, sharding={"strategy": "band", "shards": 4, "bands": [0, 400]})
    router = Router(store, board.config.id)
    work = Workload(router, ref, seed=67, players=1500)
    for _ in range(40):
        await work.write()
    await work.check()
    for shards, bands in ((3, [0, 10, 25, 45]), (2, None)):
        done = asyncio.Event()
        writers = asyncio.gather(work.run_until(done), work.run_until(done, check_every=3))
        try:
            mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=CACHE)
            await mover.start(shards, bands)
            final = await mover.run()
        finally:
            done.set()
            await writers
        assert final["state"] == "none" and final["shards"] == shards
        current = await store.get(board.config.id)
        assert current.config.sharding.bands == (tuple(bands) if bands else ())
        await work.check()
        for _ in range(30):  # writes of the new layout (band moves through band.lua on a band board)
            await work.write()
        await work.check()
        view = current.resolve("daily")
        assert await current.top(40, view) == expected(ref, view.period)[:40]
        if bands:  # every band holds exactly the players of its points, each once
            sizes = [await store.client.zcard(p + "total") for p in current.prefixes[shards:]]
            assert sum(sizes) == len(expected(ref)) and all(sizes)


async def test_a_write_whose_band_calls_come_after_the_reshard_is_answered_as_applied(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A band board write applied on its home shard whose band calls reached the old layout only
    after the reshard had dropped it: band.lua read the `gone` marker the drop leaves and answered
    BOARDGONE, and the write was answered "board deleted" (404, the board object marked deleted)
    though its result was in the new layout (a reshard audit's finding). band.lua now hears "moved"
    first, as write.lua does, and the write counts as applied: the new layout's bands were built
    from the home totals, which the reshard copied after it."""
    board, _ = await make_board(
        store, 2, mode="best", sharding={"strategy": "band", "shards": 2, "bands": [0, 100]}
    )
    await board.submit([Score("p", 10, "m1")])
    entered, go_on = asyncio.Event(), asyncio.Event()
    finish = board.bands.finish

    async def late(*args: Any) -> None:  # the band calls of the write, held back (a busy node, a pause)
        entered.set()
        await go_on.wait()
        await finish(*args)

    monkeypatch.setattr(board.bands, "finish", late)
    write = asyncio.ensure_future(board.submit([Score("p", 500, "m2")]))
    await entered.wait()  # applied on the old home shard, its band calls not sent yet
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(2, [0, 50, 1000])
    await mover.run()
    go_on.set()
    assert [r.status for r in await write] == ["improved"]
    assert not board.deleted
    fresh = await store.get(board.config.id)
    assert [(e.player_id, e.points) for e in await fresh.top(5)] == [("p", 500)]


async def test_a_band_move_refused_by_a_moved_marker_stays_pending_until_the_reshard_is_cancelled(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the case above: band calls refused by the old layout's moved markers (set
    once it is sealed), and the reshard then cancelled before its commit. The write is still answered
    as applied; its move stays pending on the home shard, and a repair (the archiver's, every few
    seconds) puts the player in their new band. A seal alone lets band calls through: a reshard
    never copies band shards, so the old ones stay current until the cut-over."""
    board, _ = await make_board(
        store, 2, mode="best", sharding={"strategy": "band", "shards": 2, "bands": [0, 100]}
    )
    await board.submit([Score("p", 10, "m1")])
    high = keys.period_key(board.prefixes[3], "total")  # the band of 100 points and up
    mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
    await mover.start(3)
    await mover._copy((await mover.record())[1])  # the old shards tracked ('t')
    for prefix in board.prefixes:  # the mover's seal
        await store.client.set(keys.seal_key(prefix), "a mover", px=10_000)
    with pytest.raises(Resharding):  # the home shard refuses ...
        await board.submit([Score("p", 200, "m2")])
    band = board.prefixes[3]  # ... and band.lua takes its ops (a drop of nobody, at version 1)
    names = [high, keys.version_key(band), keys.index_key(band), keys.gone_key(band)]
    assert await board.scripts.band(keys=names, args=["r", "nobody", 0, 1]) == 1
    entered, go_on = asyncio.Event(), asyncio.Event()
    finish = board.bands.finish

    async def late(*args: Any) -> None:
        entered.set()
        await go_on.wait()
        await finish(*args)

    for prefix in board.prefixes:
        await store.client.delete(keys.seal_key(prefix))
    monkeypatch.setattr(board.bands, "finish", late)
    write = asyncio.ensure_future(board.submit([Score("p", 500, "m3")]))
    await entered.wait()
    for prefix in board.prefixes:  # sealed and moved, between the home call and the band calls
        await store.client.set(keys.move_key(prefix), "m")
    go_on.set()
    assert [r.status for r in await write] == ["improved"]
    assert await Resharder(store, board.config.id, say=lambda _: None).cancel() == "cancelled"
    assert await store.client.zscore(high, "p") is None  # not moved yet
    assert await board.repair() == 1
    assert await store.client.zscore(high, "p") is not None
    assert [(e.player_id, e.points) for e in await board.top(5)] == [("p", 500)]


async def test_a_journaled_board_is_resharded_only_with_its_archive(store: BoardStore) -> None:
    board, _ = await make_board(store, 2, durability="journal")
    with pytest.raises(BoardConflict, match="PostgreSQL"):
        await Resharder(store, board.config.id, say=lambda _: None).start(3)
    assert not (await store.get(board.config.id)).moving


async def test_a_mover_that_lost_its_lease_stops(store: BoardStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease keeps one mover at a time. A mover whose lease another process took (or whose
    refresh failed until it ran out) must stop at its next check rather than go on beside the new
    holder; before, the refresh ignored both and the mover carried on."""
    monkeypatch.setattr(reshard, "LEASE_MS", 600)
    board, _ = await make_board(store, 2)
    key = keys.lease_key(board.config.id)
    async with reshard.Lease(store.client, key, "mine") as lease:
        assert not lease.lost
        await store.client.set(key, "theirs", px=5_000)  # another mover's, after ours ran out
        deadline = time.monotonic() + 4.0  # its next refresh finds it, due in 0.2 s (less than the 5 s)
        while not lease.lost:
            assert time.monotonic() < deadline, "the lease never found itself taken"
            await asyncio.sleep(0.01)
    assert await store.client.get(key) == "theirs"  # not ours to drop
    mover = Resharder(store, board.config.id, say=lambda _: None)
    mover.held = lease
    with pytest.raises(BoardConflict, match="lease"):
        await mover._check_cancel()
    await store.client.delete(key)


async def test_registry_records_stay_readable_by_the_routers_of_before(store: BoardStore) -> None:
    """A rolling upgrade runs routers of two releases on one registry: a field a new router writes
    at the top of a board's record is an unknown setting to the routers before it, which then
    refuse every post and read of the board (422 unknown_field). A record's top level holds only
    the board's settings and the fields the previous release knew; what is new goes inside those."""
    before = {"incarnation", "state", "generation", "reshard", "last_reshard"}  # as of 3cc2c9c
    board, ref = await make_board(store, 2)
    settings = set(ref.config.to_dict())
    try:
        raw = await store.client.hget(keys.BOARDS, board.config.id)
        assert set(orjson.loads(raw)) <= settings | before
        mover = Resharder(store, board.config.id, say=lambda _: None, cache_s=0)
        await mover.start(3)
        await mover.run()
        raw = await store.client.hget(keys.BOARDS, board.config.id)
        assert set(orjson.loads(raw)) <= settings | before
    finally:
        await store.delete(board.config.id)


async def test_an_unreachable_archive_refuses_a_journaled_reshard_before_it_starts(
    store: BoardStore, cluster_url: str
) -> None:
    """A journaled board's reshard given a PostgreSQL it could not reach recorded the reshard,
    copied, sealed and cut over, and only then failed on the archive's move (exit status 1, the
    board left committed on a layout no one asked to keep yet). It is refused before anything is
    recorded, as a reshard given no PostgreSQL is."""
    import psycopg

    config = BoardConfig.from_dict("reshard-no-archive", {"sharding": {"strategy": "hash", "shards": 2}})
    await store.create(config)
    try:
        with pytest.raises(psycopg.OperationalError):
            await reshard.command(cluster_url, config.id, 3, "run", "postgresql://127.0.0.1:1/x", print)
        status = await Resharder(store, config.id).status()
        assert (status["state"], status["shards"]) == ("none", 2), status
    finally:
        await store.delete(config.id)
