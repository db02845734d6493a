"""A mover that lost its board (its lease ran out while it stalled, or the board was deleted and
created again under its id) must change nothing any more: not the new layout, not the old one's
markers, not the record. Each test stalls one mover in the middle of its work (the way a GC or VM
pause or a network stall does), lets another take over, then lets the first one go on.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import pytest

from shardlb import keys, reshard, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.errors import BoardConflict, BoardNotFound, Resharding
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Lease, Resharder
from shardlb.reshard_copy import Lost
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_READER, running
from tests.test_rebuild import archiver, drain

pytestmark = pytest.mark.cluster

BODY = {"mode": "incr", "periods": ["daily"], "durability": "memory"}


async def make_board(store: BoardStore, shards: int, board_id: str | None = None) -> Board:
    board_id = board_id or f"fence-{os.getpid()}-{random.randrange(10**9)}"
    body = {**BODY, "sharding": {"strategy": "hash", "shards": shards}}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    return board


async def post(store: BoardStore, board_id: str, scores: list[Score]) -> list[str]:
    """Post as a router does: the board fetched anew while a cut-over refuses the call."""
    for _ in range(400):
        board = await store.get(board_id)
        try:
            return [r.status for r in await board.submit(scores, times.now_ms())]
        except Resharding:
            await asyncio.sleep(0.05)
    raise AssertionError("refused for 20 s")


async def points(store: BoardStore, board_id: str) -> dict[str, int]:
    board = await store.get(board_id)
    return {e.player_id: e.points for e in await board.entries(0, await board.size() + 10)}


def stalled(mover: Resharder) -> None:
    """The mover's process stops: its keeper no longer refreshes its lease, which runs out (here at
    once, rather than after LEASE_MS)."""
    assert mover.held is not None and mover.held._task is not None
    mover.held._task.cancel()


async def lease_ran_out(store: BoardStore, board_id: str) -> None:
    await store.client.delete(keys.lease_key(board_id))


async def test_a_stalled_mover_writes_nothing_into_the_layout_another_finished(store: BoardStore) -> None:
    """Mover A reads a batch of the old shard, stalls past its lease; mover B takes the reshard over
    and finishes it, and results are acknowledged on the new layout. A then wrote the values it had
    read before the stall into the live layout: acknowledged increments were lost, and their retries
    answered "duplicate"."""
    board = await make_board(store, 1)
    board_id = board.config.id
    players = [f"p{i:05d}" for i in range(6000)]
    model = dict.fromkeys(players, 10)
    for start in range(0, len(players), 1000):
        await post(store, board_id, [Score(p, 10, f"m0-{p}") for p in players[start : start + 1000]])

    a = Resharder(store, board_id, say=lambda _: None, cache_s=0.5)
    write, batches, held, go = a.copier._write, [], asyncio.Event(), asyncio.Event()

    async def stalls_on_the_third(*args: Any, **kwargs: Any) -> None:
        suffix, rows = args[1], args[4]
        if suffix == "total" and not kwargs.get("moved"):
            batches.append([m for m, _ in rows])
            if len(batches) == 3:
                held.set()
                await go.wait()
        await write(*args, **kwargs)

    a.copier._write = stalls_on_the_third  # type: ignore[method-assign]
    await a.start(2)
    first = asyncio.ensure_future(a.run())
    await held.wait()
    stalled(a)
    await lease_ran_out(store, board_id)
    read = batches[2]
    assert await post(store, board_id, [Score(p, 5, f"m1-{p}") for p in read]) == ["improved"] * len(read)
    for p in read:
        model[p] += 5

    b = Resharder(store, board_id, say=lambda _: None, cache_s=0.5)
    assert (await b.run())["state"] == "none"
    assert await post(store, board_id, [Score(p, 5, f"m2-{p}") for p in read]) == ["improved"] * len(read)
    for p in read:
        model[p] += 5
    assert await points(store, board_id) == model

    go.set()
    with pytest.raises(BoardConflict):
        await first
    now = await points(store, board_id)
    wrong = {p: (model[p], now.get(p)) for p in model if now.get(p) != model[p]}
    assert not wrong, f"{len(wrong)} players changed by the stalled mover, e.g. {list(wrong.items())[:3]}"
    # A retry of an acknowledged result is still answered as one.
    assert await post(store, board_id, [Score(read[0], 5, f"m2-{read[0]}")]) == ["duplicate"]


async def test_the_keeper_does_not_take_back_a_lease_that_ran_out(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper refreshed with the same script that takes a lease: one that had run out (or was
    deleted with the board) was taken again, and the stalled mover went on as if it held it."""
    monkeypatch.setattr(reshard, "LEASE_MS", 900)
    key = keys.lease_key(f"fence-lease-{os.getpid()}-{random.randrange(10**9)}")
    lease = Lease(store.client, key, "mine")
    async with lease:
        await store.client.delete(key)  # it ran out while the process was stalled
        for _ in range(100):
            if lease.lost:
                break
            await asyncio.sleep(0.1)
        taken_back = await store.client.get(key)
        assert (lease.lost, taken_back) == (True, None)
    assert await store.client.get(key) is None


async def test_a_stalled_mover_does_not_unseal_the_shards_another_sealed(store: BoardStore) -> None:
    """A mover whose sealing failed unsealed the old layout without asking whether it still held the
    reshard: a stalled one put the shards another mover had sealed and moved back to tracked, so
    they took writes again after their last changes had been copied."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await post(store, board_id, [Score(f"p{i}", 3, f"m{i}") for i in range(300)])

    a = Resharder(store, board_id, say=lambda _: None, cache_s=0.5)
    a_tell, a_held, a_go = a._tell, asyncio.Event(), asyncio.Event()

    async def a_stalls(line: str) -> None:
        await a_tell(line)
        if "copied shard 1/" in line:
            a_held.set()
            await a_go.wait()

    a._tell = a_stalls  # type: ignore[method-assign]
    await a.start(3)
    first = asyncio.ensure_future(a.run())
    await a_held.wait()
    stalled(a)
    await lease_ran_out(store, board_id)

    b = Resharder(store, board_id, say=lambda _: None, cache_s=0.5)
    b_tell, b_held, b_go = b._tell, asyncio.Event(), asyncio.Event()

    async def b_stalls(line: str) -> None:
        await b_tell(line)
        if "sealed and moved" in line:
            b_held.set()
            await b_go.wait()

    b._tell = b_stalls  # type: ignore[method-assign]
    second = asyncio.ensure_future(b.run())
    await b_held.wait()
    assert [await store.client.get(keys.move_key(p)) for p in board.prefixes] == ["m", "m"]
    await a._unseal(board)  # what A's sealing does when it fails
    markers = [await store.client.get(keys.move_key(p)) for p in board.prefixes]
    assert markers == ["m", "m"], f"the stalled mover unsealed the other's shards: {markers}"
    b_go.set()
    assert (await second)["state"] == "none"
    a_go.set()
    with pytest.raises(BoardConflict):
        await first
    assert len(await points(store, board_id)) == 300


async def test_a_mover_of_a_deleted_board_leaves_the_board_created_again_alone(store: BoardStore) -> None:
    """The board is deleted while its mover works and created again under its id, and a reshard of
    the new board is recorded. The old mover's record checks compared the reshard's state only: it
    took up the new board's reshard and cut it over to a layout nobody had copied (every result
    acknowledged on the new board disappeared)."""
    board = await make_board(store, 2)
    board_id = board.config.id
    await post(store, board_id, [Score(f"old{i}", 1, f"m{i}") for i in range(300)])
    old = Resharder(store, board_id, say=lambda _: None, cache_s=0)
    changes, again = old.copier.changes, []

    async def deleted_and_created_again(*args: Any, **kwargs: Any) -> int:
        if not again:
            await store.delete(board_id)
            again.append(await make_board(store, 2, board_id))
            await post(store, board_id, [Score(f"new{i}", 5, f"n{i}") for i in range(500)])
            await Resharder(store, board_id, say=lambda _: None).start(3)
        return await changes(*args, **kwargs)

    old.copier.changes = deleted_and_created_again  # type: ignore[method-assign]
    await old.start(3)
    with pytest.raises((BoardNotFound, BoardConflict)):
        await old.run()
    assert again
    now = await store.get(board_id)
    assert now.incarnation == again[0].incarnation
    assert now.config.sharding.shards == 2 and now.moving, "the old mover moved the new board"
    final = await Resharder(store, board_id, say=lambda _: None, cache_s=0).run()
    assert final["state"] == "none" and final["shards"] == 3
    assert await points(store, board_id) == {f"new{i}": 5 for i in range(500)}


async def journaled(store: BoardStore, raw: Any, postgres_url: str) -> Board:
    """A journaled board of 2 shards with 200 players, archived."""
    board_id = f"fence-rb-{os.getpid()}-{random.randrange(10**9)}"
    body = {**BODY, "durability": "journal", "sharding": {"strategy": "hash", "shards": 2}}
    board, _ = await store.create(BoardConfig.from_dict(board_id, body))
    await post(store, board_id, [Score(f"p{i:03d}", 4, f"m{i}") for i in range(200)])
    a = await archiver(raw, store, postgres_url)
    try:
        await drain(a)
    finally:
        await a.db.close()
    return board


async def copied(store: BoardStore, board_id: str, postgres_url: str) -> Resharder:
    """A reshard to 3 shards recorded and copied: the old shards are tracked, the new ones closed."""
    mover = Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url, cache_s=0)
    await mover.start(3)
    await mover._copy((await mover.record())[1])
    return mover


async def test_a_rebuild_begun_before_a_reshard_is_refused_before_it_swaps(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """A rebuild checked for a reshard once, with the board it was given: one fetched before the
    reshard was recorded swapped its shards in while the mover copied them, untracked, and the
    cut-over left what it restored behind (the rebuild said ok)."""
    board = await journaled(store, raw, postgres_url)
    lost = [f"p{i:03d}" for i in range(200) if board.layout.home(f"p{i:03d}") == 0]
    await store.client.zrem(keys.period_key(board.prefixes[0], "total"), *lost)  # PARTIAL: these alone
    await copied(store, board.config.id, postgres_url)
    with pytest.raises(BoardConflict, match="resharded"):
        await rebuilder.rebuild(board)  # fetched before the reshard: it says nothing of one
    assert await Resharder(store, board.config.id, say=lambda _: None).cancel() == "cancelled"
    await rebuilder.rebuild(await store.get(board.config.id))
    assert len(await points(store, board.config.id)) == 200


async def test_rebuild_lua_refuses_a_shard_a_reshard_has_marked(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """rebuild.lua swapped keys in on a shard the reshard tracked, sealed or had moved: a write the
    reshard never hears of. It refuses, as write.lua does, whatever the rebuild was told."""
    board = await journaled(store, raw, postgres_url)
    await copied(store, board.config.id, postgres_url)
    prefix = board.prefixes[0]
    temporary, live = f"{prefix}tmp:test:total", keys.period_key(prefix, "total")
    await store.client.zadd(temporary, {"intruder": 1})
    with pytest.raises(BoardConflict, match="resharded"):
        await rebuilder._swap_keys(prefix, [(temporary, live, 0, 1)], "swap", board, "", True, [])
    assert await store.client.zscore(live, "intruder") is None
    assert await Resharder(store, board.config.id, say=lambda _: None).cancel() == "cancelled"


async def test_the_rebuild_endpoint_checks_the_board_as_the_registry_has_it(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """The endpoint checked the router's cached board (up to CACHE_SECONDS old): a rebuild asked
    just after a reshard was recorded was not refused (409) as the rule says."""
    board = await journaled(store, raw, postgres_url)
    board_id = board.config.id
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        assert (await client.get(f"/v1/boards/{board_id}/top", headers=AS_READER)).status_code == 200
        await Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url).start(3)
        r = await client.post(f"/v1/boards/{board_id}:rebuild", headers=AS_ADMIN)
        assert r.status_code == 409, r.text
    assert await Resharder(store, board_id, say=lambda _: None).cancel() == "cancelled"


async def rows_and_settings(postgres_url: str, board: Board) -> tuple[dict[str, list[tuple[str, int]]], Any]:
    """The board's archived rows that name a shard (player, shard; per table) and its settings as
    PostgreSQL keeps them (what a rebuild after a total loss restores it from)."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        rows = {}
        ident = (board.config.id, board.incarnation)
        for table in reshard.REHOMED:
            cur = await db.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
            if (await cur.fetchone() or [False])[0]:
                cur = await db.execute(
                    f"SELECT player_id, shard FROM {table} WHERE board = %s AND incarnation = %s "
                    "ORDER BY player_id, shard",
                    ident,
                )
                rows[table] = [(p, s) for p, s in await cur.fetchall()]
        cur = await db.execute("SELECT settings FROM boards WHERE board = %s AND incarnation = %s", ident)
        settings = [row[0] for row in await cur.fetchall()]
    return rows, settings


async def test_a_stalled_mover_does_not_rehome_the_archive_to_a_layout_no_longer_the_boards(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """Mover A stalls at the finish, right before it moves the archive's rows to the new layout
    (``_rehome``), past its lease; mover B takes the reshard (2 -> 3 shards) over and finishes it,
    and another reshard (3 -> 5) is done. The move of the rows checked nothing of the reshard: A
    then gave every row its shard in the 3-shard layout, and wrote that layout into PostgreSQL's
    ``boards``, while the board has 5 shards. Its rows named shards its layout does not give their
    players, and a rebuild of the board was refused (a total loss of Redis would have brought it
    back with 3 shards)."""
    board = await journaled(store, raw, postgres_url)
    board_id = board.config.id
    a = Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url, cache_s=0)
    rehome, held, go = a._rehome, asyncio.Event(), asyncio.Event()

    async def stalls_before_the_rehome(target: Board, at_rest: bool = False) -> int:
        held.set()
        await go.wait()
        return await rehome(target, at_rest)

    a._rehome = stalls_before_the_rehome  # type: ignore[method-assign]
    await a.start(3)
    first = asyncio.ensure_future(a.run())
    await held.wait()
    stalled(a)
    await lease_ran_out(store, board_id)

    b = Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url, cache_s=0)
    assert (await b.run())["state"] == "none"
    c = Resharder(store, board_id, say=lambda _: None, postgres_url=postgres_url, cache_s=0)
    await c.start(5)
    assert (await c.run())["shards"] == 5
    now = await store.get(board_id)
    before = await rows_and_settings(postgres_url, now)

    go.set()
    with pytest.raises(Lost):
        await first
    rows, settings = await rows_and_settings(postgres_url, now)
    wrong = {t: [(p, s) for p, s in r if s != now.layout.home(p)] for t, r in rows.items()}
    moved = [row for r in wrong.values() for row in r]
    assert not moved, f"{len(moved)} rows moved off the board's layout by the stalled mover, e.g. {moved[:3]}"
    assert len(rows["match_results"]) == 200
    assert [(s["sharding"]["shards"], s["generation"]) for s in settings] == [(5, now.generation)]
    assert (rows, settings) == before
    lost = [f"p{i:03d}" for i in range(200) if now.layout.home(f"p{i:03d}") == 0]
    await store.client.zrem(keys.period_key(now.prefixes[0], "total"), *lost)  # PARTIAL: these alone
    await rebuilder.rebuild(await store.get(board_id))
    assert await points(store, board_id) == {f"p{i:03d}": 4 for i in range(200)}
