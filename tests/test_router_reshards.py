"""router/reshards.py: a reshard whose mover died (a router restarted under it, a killed
`shardlb reshard`) is seen, and finished by a router that may take it.

Until 2026-12-05 nothing noticed one: the board stayed in both layouts, and every write added a
member to the old shards' change sets (``chg``, no expiry) until an operator resumed or cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from typing import Any

import pytest

from router.gate import Gate
from router.reshards import ReshardWatch
from shardlb import keys, reshard, times
from shardlb.board import Board, Score
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.errors import BoardConflict
from shardlb.reshard import Busy, Cancelled, Resharder
from shardlb.store import BoardStore
from tests.router_support import running, service_of
from tests.test_reshard import MOVER_LEASE_MS, _kill_at, _mover
from tests.test_reshard_fencing import points
from tests.test_reshard_fencing import post as fenced_post
from tests.test_store import MadeStore

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

WAIT_S = 120.0  # the longest a test waits for a router to notice and finish a reshard


async def make_board(store: BoardStore, shards: int, durability: str = "memory") -> Board:
    board_id = f"rsa-{os.getpid()}-{random.randrange(10**9)}"
    body = {"mode": "incr", "durability": durability, "sharding": {"strategy": "hash", "shards": shards}}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    return board


async def changes_held(store: BoardStore, board: Board) -> tuple[int, list[int]]:
    """The members of the old shards' change sets, and each set's expiry (PTTL: -1 none)."""
    held, expiries = 0, []
    for prefix in board.prefixes:
        held += await store.client.scard(keys.changes_key(prefix))
        expiries.append(await store.client.pttl(keys.changes_key(prefix)))
    return held, expiries


async def post(board: Board, count: int, tag: str) -> None:
    now = times.now_ms()
    for start in range(0, count, 100):
        scores = [Score(f"p{i % 300}", 1, f"{tag}-{i}", now) for i in range(start, start + 100)]
        await board.submit(scores, now)


async def until(check: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.5)


async def test_a_killed_movers_reshard_is_resumed_by_a_router(
    store: BoardStore, cluster: LocalCluster
) -> None:
    """A mover killed mid-copy leaves the board tracked: every write adds a member to a change set
    that never expires, beside the new layout's copy, until a mover comes back. A router sees the
    reshard abandoned once the lease has been free for a lease, and finishes it."""
    board = await make_board(store, 3)
    await post(board, 600, "before")
    await _kill_at(_mover(cluster, board.config.id, "--shards", "5"), "copied shard 2/3")
    assert (await Resharder(store, board.config.id).status())["state"] == "copying"
    held, _ = await changes_held(store, board)
    await post(board, 2000, "after")  # results of 2,000 matches: one member each
    grown, expiries = await changes_held(store, board)
    assert grown - held == 2000 and expiries == [-1, -1, -1]  # unbounded, until a mover comes

    async def no_mover() -> bool:  # the killed mover's lease runs out
        return (await Resharder(store, board.config.id).status())["mover"] == "none"

    await until(no_mover, "the killed mover's lease never ran out")

    async with running(cluster.url) as (app, _client):
        watch = service_of(app).reshards
        # Free for a lease: the killed mover's (shortened for the test, as the look's interval).
        watch.every_s, watch.after_s = 0.5, MOVER_LEASE_MS / 1000

        async def done() -> bool:
            return (await Resharder(store, board.config.id).status())["state"] == "none"

        await until(done, "no router finished the reshard")
    fresh = await store.get(board.config.id)
    assert fresh.config.sharding.shards == 5
    assert sum([e.points for e in await fresh.top(300)]) == 2600  # every result, once
    assert await changes_held(store, board) == (0, [-2, -2, -2])  # the old layout dropped
    await store.delete(board.config.id)


async def test_a_router_without_the_archive_reports_a_journaled_boards_reshard_and_leaves_it(
    store: BoardStore, cluster: LocalCluster, postgres_url: str
) -> None:
    """A journaled board's reshard moves its archive: a router without SHARDLB_POSTGRES_URL must
    not take it, but shows it abandoned (/readyz, /metrics, the reshard's status), so that an
    operator (or a router with the archive) finishes or cancels it."""
    board = await make_board(store, 2, durability="journal")
    await Resharder(store, board.config.id, say=lambda _: None, postgres_url=postgres_url).start(3)
    async with running(cluster.url) as (app, client):
        watch = service_of(app).reshards
        watch.after_s = 0.0  # no mover at this first look counts
        await watch.check()
        watch.resume()
        ready = (await client.get("/readyz")).json()
        assert board.config.id in ready["reshards"]["abandoned"], ready
        assert ready["reshards"]["under_way"] >= 1, ready
        text = (await client.get("/metrics")).text
        assert "shardlb_reshards_abandoned " in text and "shardlb_reshards_abandoned 0.0" not in text, text
        await asyncio.sleep(0.5)
        status = await Resharder(store, board.config.id).status()
        assert (status["state"], status["shards_copied"], status["mover"]) == ("copying", 0, "none"), status
    await Resharder(store, board.config.id, say=lambda _: None, postgres_url=postgres_url).cancel()
    await store.delete(board.config.id)


async def test_a_resume_that_finds_a_live_mover_gives_way(store: BoardStore) -> None:
    """Routers that see the same reshard abandoned all try: the lease lets one mover run, and the
    others give way at once (``run(wait=False)``), where a resume asked by an operator waits a
    lease for a mover that died."""
    board = await make_board(store, 2)
    mover = Resharder(store, board.config.id, say=lambda _: None)
    await mover.start(3)
    lease = reshard.Lease(store.client, keys.lease_key(board.config.id), "another")
    await lease.__aenter__()
    assert (await mover.status())["mover"] == "running"
    with pytest.raises(Busy):
        await Resharder(store, board.config.id, say=lambda _: None).run(wait=False)
    await lease.__aexit__()
    assert (await mover.status())["mover"] == "none"
    await mover.cancel()
    await store.delete(board.config.id)


async def test_a_router_stopped_while_its_mover_runs_leaves_no_mover_running(
    store: BoardStore, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router's movers (its admin endpoint's, those its watch resumed) were tasks of the process,
    not of the router: its stop left them running on the client it had closed, reconnecting
    connections nobody closed (a CI run of 2026-12-05: ResourceWarnings in a later test of the same
    worker), and in a test process they moved boards for routers long stopped. The stop cancels
    them now: the lease they held runs out, and another router resumes the reshard."""
    monkeypatch.setenv("SHARDLB_RESHARD_PAUSE", "copied shard 1/3:30")  # mid-copy at the stop
    board = await make_board(store, 3)
    await post(board, 300, "before")
    await Resharder(store, board.config.id, say=lambda _: None).start(5)
    async with running(cluster.url) as (app, _client):
        watch = service_of(app).reshards
        watch.after_s, watch.every_s = 0.0, 0.2  # resumed at the watch's next look

        async def holding() -> bool:
            return (await Resharder(store, board.config.id).status())["mover"] == "running"

        await until(holding, "the resumed mover never took the lease")
        movers = list(watch.movers.values())
    assert movers and all(task.done() for task in movers)
    monkeypatch.delenv("SHARDLB_RESHARD_PAUSE")
    await Resharder(store, board.config.id, say=lambda _: None).cancel()
    await store.delete(board.config.id)


@pytest.mark.parametrize("meanwhile", ["cancelled", "finished", "created again"])
async def test_a_resume_that_finds_the_reshard_over_gives_way_without_an_error(
    store: BoardStore, caplog: pytest.LogCaptureFixture, meanwhile: str
) -> None:
    """Every router worker that sees a reshard abandoned resumes it, each from its own last look:
    by the time its mover reads the record, another router's mover may have finished it, an
    operator cancelled it, or the board been deleted and created again without one. The mover then
    met "no reshard under way" (BoardConflict), logged as a failure with its traceback ("reshard
    stopped") and tried again, MOVER_TRIES times, each failing alike: a benign race of the watch
    that many routers make common, seen as an error."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await post(board, 200, "before")
    await Resharder(store, board_id, say=lambda _: None).start(3)
    watch = ReshardWatch(store, Gate(4), every_s=0.2, after_s=0.0)
    assert await watch.check() == [board_id]  # seen abandoned: no mover holds its lease
    if meanwhile == "cancelled":
        assert await Resharder(store, board_id, say=lambda _: None).cancel() == "cancelled"
    elif meanwhile == "finished":
        assert (await Resharder(store, board_id, say=lambda _: None, cache_s=0).run())["state"] == "none"
    else:
        await store.delete(board_id)
        await store.create(BoardConfig.from_dict(board_id, {"mode": "incr", "durability": "memory"}))
    logger = logging.getLogger("shardlb")  # where the router's handler is (router/logs.py)
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="shardlb.router")
    try:
        assert watch.resume() == [board_id]
        await asyncio.gather(*watch.movers.values())
    finally:
        logger.removeHandler(caplog.handler)
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, [(r.getMessage(), r.exc_info and r.exc_info[1]) for r in failed]
    assert (await Resharder(store, board_id).status())["state"] == "none"
    await store.delete(board_id)


async def test_a_router_stopped_while_its_mover_seals_lets_the_old_layout_take_writes(
    store: BoardStore, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router's stop cancels its movers. One cancelled while it sealed left the old shards it had
    sealed marked moved (for a day) under a record that still names the old layout: every write
    to them was refused (503 board_resharding after the router's 2 s of retries) until another
    router saw the lease free for a lease and resumed it, 10-15 s, where the cut-over refuses
    writes for tens to hundreds of milliseconds. The seal phase holds the whole layout check, so a
    rolling deploy during a large board's cut-over met it. A failed sealing is undone (the old
    layout takes writes again, tracked); a cancelled one before its commit now is too."""
    monkeypatch.setenv("SHARDLB_RESHARD_PAUSE", "sealed and moved:60")
    board = await make_board(store, 2)
    board_id = board.config.id
    await post(board, 200, "before")
    await Resharder(store, board_id, say=lambda _: None).start(3)

    async def sealed() -> bool:
        return [await store.client.get(keys.move_key(p)) for p in board.prefixes] == ["m", "m"]

    async with running(cluster.url) as (app, _client):
        watch = service_of(app).reshards
        watch.after_s, watch.every_s = 0.0, 0.2  # resumed at the watch's next look
        await until(sealed, "the resumed mover never sealed the old layout")
    monkeypatch.delenv("SHARDLB_RESHARD_PAUSE")
    status = await Resharder(store, board_id).status()
    assert (status["state"], status["mover"]) == ("sealing", "none"), status
    markers = [await store.client.get(keys.move_key(p)) for p in board.prefixes]
    assert markers == ["t", "t"], f"the old layout stays refusing writes: {markers}"
    fresh = await store.get(board_id)
    now = times.now_ms()
    [result] = await fresh.submit([Score("p1", 1, "after-stop", now)], now)
    assert result.status == "improved"
    final = await Resharder(store, board_id, say=lambda _: None, cache_s=0).run()
    assert (final["state"], final["shards"]) == ("none", 3)
    assert sum([e.points for e in await (await store.get(board_id)).top(300)]) == 201
    await store.delete(board_id)


async def test_routers_that_take_over_from_a_live_mover_whose_lease_ran_out_lose_nothing(
    store: BoardStore,
    cluster: LocalCluster,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live mover (another process's) stalls mid-copy with a batch it read in hand, and its lease
    refresh comes too late: the lease runs out. Three routers see the reshard abandoned at once and
    resume it: one mover takes it (a new epoch in every shard's fence), the others give way without
    an error line, and it finishes while results keep coming. Then the stalled mover goes on: its
    late refresh does not take the lease back, its write of what it read before the stall is
    refused and it stops; every result counts once and a retry of one is still a duplicate."""
    board = await make_board(store, 3)
    board_id = board.config.id
    players = [f"p{i:04d}" for i in range(3000)]
    model = dict.fromkeys(players, 2)
    for start in range(0, len(players), 1000):
        await fenced_post(store, board_id, [Score(p, 2, f"m0-{p}") for p in players[start : start + 1000]])

    a = Resharder(store, board_id, say=lambda _: None, cache_s=0.5)
    write, batches, held, go = a.copier._write, [], asyncio.Event(), asyncio.Event()

    async def stalls_on_the_second(*args: Any, **kwargs: Any) -> None:
        suffix, rows = args[1], args[4]
        if suffix == "total" and not kwargs.get("moved"):
            batches.append([m for m, _ in rows])
            if len(batches) == 2:
                held.set()
                await go.wait()
        await write(*args, **kwargs)

    a.copier._write = stalls_on_the_second  # type: ignore[method-assign]
    await a.start(4)
    first = asyncio.ensure_future(a.run())
    await held.wait()
    assert a.held is not None and a.held._task is not None
    a.held._task.cancel()  # its refresh is late: the lease runs out (here at once, not after LEASE_MS)
    await store.client.delete(keys.lease_key(board_id))
    read = batches[1]
    improved = ["improved"] * len(read)
    assert await fenced_post(store, board_id, [Score(p, 3, f"m1-{p}") for p in read]) == improved
    for p in read:
        model[p] += 3

    takes = []
    take = Resharder._take

    async def counted(self: Resharder) -> dict[str, Any]:
        takes.append(self.board_id)
        return await take(self)

    monkeypatch.setattr(Resharder, "_take", counted)
    logger = logging.getLogger("shardlb")
    async with contextlib.AsyncExitStack() as routers:
        apps = [(await routers.enter_async_context(running(cluster.url)))[0] for _ in range(3)]
        logger.addHandler(caplog.handler)
        routers.callback(logger.removeHandler, caplog.handler)
        watches = [service_of(app).reshards for app in apps]

        async def looked() -> bool:  # each watch's first look (then it sleeps every_s, 5 s)
            return all(board_id in [b for b, _ in w.free_since] for w in watches)

        await until(looked, "a router never looked at the reshards")
        for watch in watches:
            watch.after_s, watch.every_s = 0.0, 0.2
        tried = await asyncio.gather(*(w.check() for w in watches))
        assert all(board_id in seen for seen in tried), tried
        for watch in watches:
            watch.resume()

        async def done() -> bool:
            return (await Resharder(store, board_id).status())["state"] == "none"

        await until(done, "no router finished the reshard")
        for watch in watches:
            await asyncio.gather(*watch.movers.values())
        assert await fenced_post(store, board_id, [Score(p, 4, f"m2-{p}") for p in read]) == improved
        for p in read:
            model[p] += 4
        await asyncio.gather(*(w.check() for w in watches))
        # Other tests' boards may have reshards under way: only this board's are looked at.
        assert all(board_id not in w.under_way and board_id not in w.abandoned for w in watches)
    assert takes == [board_id], f"{len(takes)} movers took the reshard over"
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not failed, [(r.getMessage(), r.exc_info and r.exc_info[1]) for r in failed]
    assert await points(store, board_id) == model

    go.set()
    with pytest.raises(BoardConflict):
        await first
    assert await store.client.get(keys.lease_key(board_id)) is None  # not taken back by the late mover
    now = await points(store, board_id)
    wrong = {p: (model[p], now.get(p)) for p in model if now.get(p) != model[p]}
    assert not wrong, f"{len(wrong)} players changed by the stalled mover, e.g. {list(wrong.items())[:3]}"
    assert (await store.get(board_id)).config.sharding.shards == 4
    assert await fenced_post(store, board_id, [Score(read[0], 4, f"m2-{read[0]}")]) == ["duplicate"]
    await store.delete(board_id)


async def test_a_resume_that_cannot_reach_the_archive_is_one_line_a_try(
    store: BoardStore, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A journaled board's reshard, abandoned, and a router whose PostgreSQL is down: its watch
    tries it once a minute (RETRY_S), the README says so that a mover that keeps failing is logged
    at each try, "not every few seconds". Each try was the admin endpoint's five (MOVER_TRIES), 2 s
    apart: five error lines with their tracebacks in 8 s, a minute, per worker of every router.
    The watch's tries are its own retries: one line each."""
    board = await make_board(store, 2, durability="journal")
    board_id = board.config.id
    await Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url).start(3)
    down = "postgresql://shardlb@127.0.0.1:1/postgres"  # nothing listens on port 1
    watch = ReshardWatch(store, Gate(4), postgres_url=down, every_s=0.2, after_s=0.0)
    logger = logging.getLogger("shardlb")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="shardlb.router")
    try:
        assert await watch.check() == [board_id]
        assert watch.resume() == [board_id]
        await asyncio.gather(*watch.movers.values())
        assert watch.resume() == []  # tried again only after RETRY_S
    finally:
        logger.removeHandler(caplog.handler)
    # Through the handler on ``shardlb`` and, where no router has configured logging, the root's.
    failed = list({id(r): r for r in caplog.records if r.levelno >= logging.ERROR}.values())
    assert len(failed) == 1, [r.getMessage() for r in failed]
    status = await Resharder(store, board_id).status()
    assert (status["state"], status["shards_copied"]) == ("copying", 0), status
    await Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url).cancel()
    await store.delete(board_id)


async def test_a_reshard_recorded_after_an_abandoned_one_was_cancelled_is_not_abandoned_at_once(
    store: BoardStore,
) -> None:
    """A watch counted a lease's free time per board, not per reshard: an operator who cancels an
    abandoned reshard and records another (`shardlb reshard B --cancel`, then `--shards N`) has
    the new one seen abandoned at the watch's next look, before the command's mover takes its
    lease (the cancel held the lease between two looks, unseen). A router then resumed it, and the
    operator's command waited a lease for the lease and failed: "another process is resharding
    this board"."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await Resharder(store, board_id, say=lambda _: None).start(3)
    watch = ReshardWatch(store, Gate(4), every_s=0.2, after_s=0.5)
    assert await watch.check() == []  # first seen free now
    await asyncio.sleep(0.6)
    assert await watch.check() == [board_id]  # abandoned, left to the operator here
    assert await Resharder(store, board_id, say=lambda _: None).cancel() == "cancelled"
    await Resharder(store, board_id, say=lambda _: None).start(4)  # the command's mover comes next
    assert await watch.check() == [], "a reshard recorded this instant counted as abandoned"
    await asyncio.sleep(0.6)
    assert await watch.check() == [board_id]  # free for after_s since it was seen: abandoned now
    await Resharder(store, board_id, say=lambda _: None).cancel()
    await store.delete(board_id)


async def test_a_mover_started_after_the_routers_stop_is_not_left_running(store: BoardStore) -> None:
    """A router's stop cancels its movers; a reshard request still being answered then (its record
    written while the stop ran: the lifespan shutdown answers requests while it drains) started one
    after it, which nothing cancelled: it moved the board on the client the stop closed. Once
    stopped, the watch starts none (the reshard is recorded: a router still running resumes it)."""
    board = await make_board(store, 2)
    board_id = board.config.id
    mover = Resharder(store, board_id, say=lambda _: None)
    await mover.start(3)
    watch = ReshardWatch(store, Gate(4))
    await watch.stop()
    watch.start(mover)
    left = list(watch.movers.values())
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    assert not left, "a mover started after the stop"
    await Resharder(store, board_id, say=lambda _: None).cancel()
    await store.delete(board_id)


async def test_a_cancel_recorded_as_the_mover_confirms_its_record_is_carried_out(store: BoardStore) -> None:
    """An operator cancels while a mover (a router's resumed one, or `shardlb reshard`) records its
    progress: the cancel lands between the mover's compare-and-set and its read-back from a
    replica. The mover found the record neither as it wrote it nor as before and stopped with
    NotAcknowledged, "another mover, or a failover lost it?": an error line (the command's
    exit with that message) for a cancel that was carried out only by the operator's wait for the
    lease. The mover sees its write there, with the cancel on top, and cancels at its next step."""
    board = await make_board(store, 3)
    board_id = board.config.id
    await post(board, 300, "before")
    mover = Resharder(store, board_id, say=lambda _: None, cache_s=0)
    await mover.start(4)
    confirm, cancels = mover.copier.confirm, []

    async def cancelled_meanwhile(key: str, field: str, written: Any) -> Any:
        if not cancels and b'"copied":[0]' in written:
            cancels.append(asyncio.ensure_future(Resharder(store, board_id, say=lambda _: None).cancel()))
            while not (await mover.record())[1]["reshard"].get("cancel"):
                await asyncio.sleep(0.01)
        return await confirm(key, field, written)

    mover.copier.confirm = cancelled_meanwhile  # type: ignore[method-assign]
    with pytest.raises(Cancelled):
        await mover.run()
    assert await cancels[0] == "cancelled"
    status = await Resharder(store, board_id).status()
    assert (status["state"], status["shards"]) == ("none", 3), status
    assert sum([e.points for e in await (await store.get(board_id)).top(300)]) == 300
    await store.delete(board_id)


async def test_a_mover_cancelled_once_its_commit_is_written_opens_the_new_layout(store: BoardStore) -> None:
    """A mover's task cancelled (a router's stop) while it waited for a replica to confirm its
    commit: the record names the new layout, whose shards were still closed, so every write was
    refused (503 after the router's 2 s of retries) until a router resumed the reshard a lease and
    more later. The cancelled mover opens them if the record it reads says the commit landed."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await post(board, 200, "before")
    mover = Resharder(store, board_id, say=lambda _: None, cache_s=0)
    await mover.start(3)
    confirm, waiting = mover.copier.confirm, asyncio.Event()

    async def stalls_on_the_commit(key: str, field: str, written: Any) -> Any:
        if b'"state":"committed"' in written and b"refused_ms" not in written:
            waiting.set()
            await asyncio.sleep(3600)  # a replica slow to confirm
        return await confirm(key, field, written)

    mover.copier.confirm = stalls_on_the_commit  # type: ignore[method-assign]
    task = asyncio.ensure_future(mover.run())
    await waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fresh = await store.get(board_id)
    assert fresh.config.sharding.shards == 3  # committed
    now = times.now_ms()
    [result] = await fresh.submit([Score("p1", 1, "after-stop", now)], now)
    assert result.status == "improved"
    final = await Resharder(store, board_id, say=lambda _: None, cache_s=0).run()
    assert (final["state"], final["shards"]) == ("none", 3)
    assert sum([e.points for e in await (await store.get(board_id)).top(300)]) == 201
    await store.delete(board_id)


async def test_the_watch_makes_no_board_without_a_reshard(store: BoardStore) -> None:
    """Every worker's watch made a Board of every record of the registry every 5 s to find the few
    under reshard: 200 ms of its event loop at 2,000 boards, 0.4 s every 5 s with the journal watch's
    listing. It makes only the boards whose record names a reshard."""
    quiet = await make_board(store, 2)
    moving = await make_board(store, 2)
    counted = MadeStore(store)
    watch = ReshardWatch(counted, Gate(4))
    try:
        await Resharder(store, moving.config.id, say=lambda _: None).start(3)
        await watch.check()
        assert moving.config.id in watch.under_way
        assert quiet.config.id not in counted.made and moving.config.id in counted.made
    finally:
        await store.delete(quiet.config.id)
        await store.delete(moving.config.id)


async def registry_reads(store: BoardStore) -> int:
    """HGETALL calls the cluster's primaries have run (INFO commandstats)."""
    stats = await store.client.info("commandstats", target_nodes=store.client.PRIMARIES)
    return sum(int(node.get("cmdstat_hgetall", {}).get("calls", 0)) for node in stats.values())


async def test_the_watch_reads_the_whole_registry_only_at_a_whole_look(store: BoardStore) -> None:
    """Every worker of every router read the whole registry every 5 s (HGETALL, 1.1 MB at 2,000
    boards) to find the few boards under reshard. A look reads the index of reshards under way
    (kept by registry.lua beside the registry) and their records; the whole registry is read at a
    whole look only, by one worker of the cluster every ``whole_every_s``."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await Resharder(store, board_id, say=lambda _: None).start(3)
    watch = ReshardWatch(store, Gate(4), whole_every_s=3600)
    try:
        await watch.check()  # its first look may be the cluster's whole look
        before = await registry_reads(store)
        for _ in range(3):
            await watch.check()
            assert board_id in watch.under_way
        assert await registry_reads(store) == before
    finally:
        await store.client.delete(keys.RESHARDS_LOOK)  # the turn it took, for an hour
        await Resharder(store, board_id, say=lambda _: None).cancel()
        await store.delete(board_id)


async def test_a_reshard_the_index_lacks_is_seen_by_every_worker_after_a_whole_look(
    store: BoardStore,
) -> None:
    """A reshard recorded by a router or CLI of the release before (which writes no index), and
    left there (its process restarted by the rolling deploy): the whole look, every
    ``whole_every_s`` by one worker of the cluster, finds it and mends the index, and every worker's
    next look sees it, abandoned, and resumes it."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await post(board, 200, "before")
    await Resharder(store, board_id, say=lambda _: None).start(3)
    await store.client.srem(keys.RESHARDS, board_id)  # as the release before records it
    # A router's watch (another test's) may hold the turn for its minute: the test's come first.
    await store.client.delete(keys.RESHARDS_LOOK)
    watches = [ReshardWatch(store, Gate(4), after_s=0.0, whole_every_s=0.5) for _ in range(2)]
    try:

        async def seen() -> bool:
            for watch in watches:
                await watch.check()
            return all(board_id in w.abandoned for w in watches)

        await until(seen, "a worker never saw the reshard the index lacked")
        assert await store.client.sismember(keys.RESHARDS, board_id)
        assert watches[0].resume() == [board_id]
        await asyncio.gather(*watches[0].movers.values())
        assert (await Resharder(store, board_id).status())["state"] == "none"
        assert not await store.client.sismember(keys.RESHARDS, board_id)
    finally:
        for watch in watches:
            await watch.stop()
        await store.delete(board_id)
