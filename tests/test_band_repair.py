"""A band move that a write left half done is finished without another post of the player.

The home shard commits a player's new total and records the move as pending; the band calls that
follow can be lost (a router that dies between them, a call that times out). The archiver's repair
loop (shardlb/archive.py, ``repair_bands``) sends every pending move of every band board again, so
within its interval every read equals the reference board, whether or not the player posts again.
Meanwhile a half-done move never makes the player vanish (the new band takes the add before the old
band is told to drop the row: shardlb/bands.py), and the player's own reads never count the stale
row an old band still holds.

The faults, as the router sees them after the home shard's commit: ``dead`` (no band call arrives),
``add-lost`` (the call to the new band fails), ``remove-lost`` (the new band took the add, the call to
the old band fails).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import OutOfMemoryError

from shardlb import archive, keys, moderation, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.fanout import ScriptPipeline
from shardlb.reads import SHALLOW
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_band_reads import command_calls
from tests.test_board import expected_entries
from tests.test_moderation import forget

pytestmark = pytest.mark.cluster

BANDS = [0, 100, 1000]
OTHERS = [10, 60, 400, 2000]  # o0..o3: every band holds one or two of them
EVERY_S = 0.2  # the repair interval the loops run at here
BOUND_S = EVERY_S + 3.0  # the interval, plus a pass and the reads on a busy test machine
FAULTS = {"dead": ("", 10**6), "add-lost": ("a", 1), "remove-lost": ("r", 1)}


class LoseBandCalls:
    """band.lua behind a router that loses calls: a call carrying an op of ``kind`` ('a' add, 'r'
    remove, '' any) fails as a lost connection would, ``times`` times (or at random with ``rng`` and
    ``share``); the others go through. ``events`` lists ('start' | 'end', the call's op kinds)."""

    def __init__(
        self,
        script: Callable[..., Awaitable[Any]],
        kind: str = "",
        times: int = 0,
        rng: random.Random | None = None,
        share: float = 0.0,
    ) -> None:
        self.script = script
        self.kind = kind
        self.times = times
        self.rng = rng
        self.share = share
        self.events: list[tuple[str, str]] = []

    async def __call__(self, *, keys: list[str], args: list[Any]) -> Any:
        kinds = "".join(sorted(set(args[0::4])))
        self.events.append(("start", kinds))
        if self.times and self.kind in kinds:
            self.times -= 1
            raise ConnectionError("the band call was lost")
        if self.rng is not None and self.rng.random() < self.share:
            raise ConnectionError("the band call was lost")
        try:
            return await self.script(keys=keys, args=args)
        finally:
            self.events.append(("end", kinds))


def lose(board: Board, kind: str = "", times: int = 0, **random_loss: Any) -> LoseBandCalls:
    losing = LoseBandCalls(board.scripts.band, kind, times, **random_loss)
    board.scripts = dataclasses.replace(board.scripts, band=losing)
    return losing


def band_config(name: str, mode: str = "set") -> BoardConfig:
    return BoardConfig.from_dict(
        name, {"mode": mode, "sharding": {"strategy": "band", "bands": BANDS, "shards": 3}}
    )


async def half_moved(store: BoardStore, name: str, fault: str) -> tuple[Board, ReferenceBoard, Board]:
    """A set board with o0..o3 and p1 at 500; then p1's 50 (band 1 to band 0) posted through a router
    that loses band calls as ``fault`` says, and never posted again. Returns a reader (another
    router's board), the reference and the writer."""
    config = band_config(name)
    writer, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    first = [*(Score(f"o{i}", p, "m1", now) for i, p in enumerate(OTHERS)), Score("p1", 500, "m1", now)]
    await writer.submit(first, now_ms=now)
    ref.submit(first, now_ms=now)
    kind, count = FAULTS[fault]
    lose(writer, kind, count)
    move = [Score("p1", 50, "m2", now + 1000)]
    with pytest.raises(ConnectionError):
        await writer.submit(move, now_ms=now + 1000)
    ref.submit(move, now_ms=now + 1000)
    return await store.get(config.id), ref, writer


async def pending(board: Board) -> int:
    """Moves recorded as unfinished on the board's home shards."""
    return sum(
        [
            await board.client.hlen(keys.pending_key(board.prefixes[s]))
            for s in range(board.config.sharding.shards)
        ]
    )


async def mismatches(board: Board, ref: ReferenceBoard) -> list[str]:
    """The reads (top, every page, every player, query, size) that differ from the reference."""
    want = expected_entries(ref, "total", None)
    ids = [e.player_id for e in want]
    found: dict[str, tuple[Any, Any]] = {
        "top": (await board.top(10), want),
        "size": (await board.size(), len(want)),
        "query": (await board.query([*ids, "nobody"]), want),
    }
    board.shallow = 0  # pages from the band sizes, not cut from a top
    try:
        for offset in range(len(want) + 1):
            found[f"entries({offset}, 2)"] = (await board.entries(offset, 2), want[offset : offset + 2])
    finally:
        board.shallow = SHALLOW
    for e in want:
        got = await board.player(e.player_id)
        found[f"player({e.player_id})"] = ((got.entry, got.players), (e, len(want)))
    return [f"{what}: {got} != {expected}" for what, (got, expected) in found.items() if got != expected]


async def converged(board: Board, ref: ReferenceBoard, within_s: float = BOUND_S) -> None:
    """Every read equals the reference within ``within_s`` seconds from now."""
    deadline = time.monotonic() + within_s
    while (wrong := await mismatches(board, ref)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert wrong == [], f"still wrong after {within_s} s"


@contextlib.asynccontextmanager
async def repairing(store: BoardStore, every_s: float = EVERY_S) -> AsyncIterator[None]:
    """The archiver's repair loop running on ``store`` meanwhile."""
    stop = asyncio.Event()
    task = asyncio.create_task(archive.repair_bands(store, stop, every_s))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_half_done_move_is_finished_without_another_post(store: BoardStore, fault: str) -> None:
    reader, ref, writer = await half_moved(store, f"band-repair-{fault}", fault)
    try:
        assert await pending(writer) == 1  # recorded as unfinished on p1's home shard
        async with repairing(store):
            await converged(reader, ref)
        assert await pending(writer) == 0
    finally:
        await store.delete(writer.config.id)


async def test_the_archiver_runs_the_repair_loop(
    store: BoardStore, cluster_url: str, postgres_url: str
) -> None:
    """`shardlb archive` (``serve``) finishes a move nobody posts again, and counts it."""
    reader, ref, writer = await half_moved(store, "band-repair-archiver", "dead")
    before = REGISTRY.get_sample_value("shardlb_band_repairs_total") or 0.0
    stop = asyncio.Event()
    task = asyncio.create_task(
        archive.serve(cluster_url, postgres_url, "band-repair", stop, repair_every_s=EVERY_S)
    )
    try:
        await converged(reader, ref, BOUND_S + 10)  # and the archiver's start
        assert (REGISTRY.get_sample_value("shardlb_band_repairs_total") or 0.0) >= before + 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await store.delete(writer.config.id)


async def test_a_lost_add_never_makes_the_player_vanish(store: BoardStore) -> None:
    """The old band is told to drop the row only once the new band took the add: a lost add leaves
    the old row (a stale place until the repair), never no row at all."""
    reader, ref, writer = await half_moved(store, "band-add-lost", "add-lost")
    try:
        assert [e.player_id for e in await reader.top(10)].count("p1") == 1
        assert await reader.size() == len(ref.order())
        reader.shallow = 0
        paged = [e.player_id for offset in range(0, 6, 2) for e in await reader.entries(offset, 2)]
        assert sorted(paged) == sorted(row[1] for row in ref.order())
        assert (await reader.player("p1")).entry.points == 50  # the home shard's total
    finally:
        await store.delete(writer.config.id)


@pytest.mark.parametrize("spread", [False, True], ids=["one-home-shard", "every-home-shard"])
async def test_the_new_band_takes_the_add_before_the_old_band_is_told_to_drop(
    store: BoardStore, spread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of one home shard calls band.lua itself; one of several home shards through the
    turn's script pipeline. Either way no remove is sent before every add came back."""
    config = band_config(f"band-order-{spread}", "best")
    board, _ = await store.create(config)
    homes = {board.layout.home(f"p{i}"): f"p{i}" for i in range(100)}
    movers = list(homes.values()) if spread else [homes[0]]
    events: list[tuple[str, str]] = []
    if spread:
        call = ScriptPipeline.call

        async def recorded(
            self: ScriptPipeline, script: Any, keys: list[str], args: list[Any], merge: bool = False
        ) -> Any:
            if script is not board.scripts.band:
                return await call(self, script, keys, args, merge)
            kinds = "".join(sorted(set(args[0::4])))
            events.append(("start", kinds))
            try:
                return await call(self, script, keys, args, merge)
            finally:
                events.append(("end", kinds))

        monkeypatch.setattr(ScriptPipeline, "call", recorded)
    else:
        events = lose(board).events
    now = times.now_ms()
    try:
        await board.submit([Score(p, 50, "m1", now) for p in movers], now_ms=now)
        events.clear()
        await board.submit([Score(p, 500, "m2", now) for p in movers], now_ms=now)  # band 0 to band 1
        removes = [i for i, (what, kinds) in enumerate(events) if what == "start" and "r" in kinds]
        adds = [i for i, (what, kinds) in enumerate(events) if what == "end" and "a" in kinds]
        assert removes and adds
        assert max(adds) < min(removes), events
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("fault", ["dead", "remove-lost"])
async def test_a_players_own_reads_never_count_their_stale_row(store: BoardStore, fault: str) -> None:
    """Before any repair: the old band still holds p1's 500 (and, remove-lost, the new band their
    50). Their rank, their place among friends and their neighbours are those of the reference."""
    reader, ref, writer = await half_moved(store, f"band-own-row-{fault}", fault)
    try:
        want = expected_entries(ref, "total", None)
        me = next(e for e in want if e.player_id == "p1")
        assert (await reader.player("p1")).entry == me
        assert [e for e in await reader.query(["p1", "o0", "o1"]) if e.player_id == "p1"] == [me]
        for radius in (1, 3):
            at = me.rank - 1
            assert await reader.around("p1", radius) == want[max(0, at - radius) : at + radius + 1], radius
    finally:
        await store.delete(writer.config.id)


async def test_a_removal_left_pending_is_finished_by_the_repair(store: BoardStore) -> None:
    """A moderation removal whose band calls were lost: the home shard has no total left, only the
    pending removal, which the repair sends to every band."""
    config = band_config("band-repair-removal")
    writer, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    try:
        scores = [*(Score(f"o{i}", p, "m1", now) for i, p in enumerate(OTHERS)), Score("p1", 500, "m1", now)]
        await writer.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        lose(writer, "", 10**6)
        with pytest.raises(ConnectionError):
            await moderation.remove(writer, ["p1"])
        forget(ref, "p1")
        async with repairing(store):
            await converged(await store.get(config.id), ref)
        assert await pending(writer) == 0
    finally:
        await store.delete(config.id)


async def test_repairs_from_several_processes_beside_writes_of_the_same_players(
    store: BoardStore, cluster_url: str
) -> None:
    """Three repair loops, each with a client of its own (three archivers), run while the players
    post through routers that lose a third of the band calls. Every move is versioned, so sent
    twice, late or beside a newer write it ends in the newest state: once the writes stop, every
    read equals the reference within the bound, and nothing is left pending."""
    config = band_config("band-repair-concurrent")
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    rng = random.Random("band-repair-concurrent")
    now = times.now_ms()
    clients = [connect(cluster_url) for _ in range(3)]
    stores = []
    for client in clients:
        scripts = Scripts.register(client)
        await scripts.load(client)
        stores.append(BoardStore(client, scripts))

    async def player(name: str) -> None:
        writer = await store.get(config.id)  # a router of its own
        lose(writer, rng=random.Random(name), share=0.33)
        for step in range(30):
            at = now + step * 1000  # a later second: a set board takes the later result
            score = Score(name, rng.choice([5, 50, 95, 150, 500, 999, 1500]), f"m{step}", at)
            with contextlib.suppress(ConnectionError):
                await writer.submit([score], now_ms=at)
            ref.submit([score], now_ms=at)
            await asyncio.sleep(rng.random() / 100)

    stops = [asyncio.Event() for _ in stores]
    loops = [
        asyncio.create_task(archive.repair_bands(s, stop, 0.01))
        for s, stop in zip(stores, stops, strict=True)
    ]
    try:
        async with asyncio.TaskGroup() as players:  # one that fails stops the others
            for i in range(8):
                players.create_task(player(f"p{i}"))
        await converged(await store.get(config.id), ref)
        for stop in stops:
            stop.set()
        await asyncio.gather(*loops)
        assert await board.repair() == 0
        assert await pending(board) == 0
    finally:
        for stop in stops:
            stop.set()
        await asyncio.gather(*loops, return_exceptions=True)
        for client in clients:
            await client.aclose()
        await store.delete(config.id)


async def test_writes_between_the_repairs_listing_and_its_reads(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repair lists p1 pending (old band 1); before it reads p1's move, p1's next post finishes
    that move and a later one (back to band 1) loses its band calls, leaving band 0 to drop. The
    repair must send the move it then reads, not the one it listed: no row is left behind."""
    reader, ref, writer = await half_moved(store, "band-repair-race", "dead")  # 500 to 50: band 0
    now = times.now_ms()
    posted = [Score("p1", 60, "m3", now + 2000), Score("p1", 700, "m4", now + 3000)]
    listing = store.client.hscan
    lister = await store.get(writer.config.id)

    async def then_post(*args: Any, **kwargs: Any) -> Any:
        listed = await listing(*args, **kwargs)
        monkeypatch.undo()
        await lister.submit(posted[:1], now_ms=now + 2000)  # finishes the move listed (band 1 drops)
        lose(lister, "", 10**6)
        with pytest.raises(ConnectionError):
            await lister.submit(posted[1:], now_ms=now + 3000)  # band 1 again; band 0 must drop
        return listed

    try:
        monkeypatch.setattr(store.client, "hscan", then_post)
        ref.submit(posted[:1], now_ms=now + 2000)
        ref.submit(posted[1:], now_ms=now + 3000)
        assert await reader.repair() == 1
        assert await mismatches(reader, ref) == []
        assert await pending(writer) == 0
    finally:
        await store.delete(writer.config.id)


async def test_a_pass_with_nothing_pending_reads_one_hlen_per_home_shard(store: BoardStore) -> None:
    config = band_config("band-repair-idle")
    board, _ = await store.create(config)
    now = times.now_ms()
    try:
        await board.submit([Score(f"p{i}", 10 * i, "m1", now) for i in range(30)], now_ms=now)
        asked = ("hlen", "hscan", "hgetall", "hmget", "exec")
        before = await command_calls(board, asked)
        assert await board.repair() == 0
        after = await command_calls(board, asked)
        assert {c: after[c] - before[c] for c in asked} == {**dict.fromkeys(asked, 0), "hlen": 3}
    finally:
        await store.delete(config.id)


async def test_a_page_that_reads_only_the_band_of_a_stale_row_lists_it_until_the_repair(
    store: BoardStore,
) -> None:
    """A best board: p1 rises from 50 to 500 (band 0 to band 1) and the old band's drop is lost.
    Top keeps the better of the two rows it reads, but a page that reads band 0 alone lists p1
    there again, at the old 50, and ranks the players after one lower (docs/design-notes.md, "Band
    boards"): as the docs say, until the repair finishes the move."""
    config = band_config("band-stale-page", "best")
    writer, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    try:
        first = [Score("o1", 2000, "m1", now), Score("o2", 10, "m1", now), Score("p1", 50, "m1", now)]
        await writer.submit(first, now_ms=now)
        ref.submit(first, now_ms=now)
        lose(writer, "r", 1)
        with pytest.raises(ConnectionError):
            await writer.submit([Score("p1", 500, "m2", now)], now_ms=now)
        ref.submit([Score("p1", 500, "m2", now)], now_ms=now)
        reader = await store.get(config.id)
        reader.shallow = 0
        listed = [(e.player_id, e.points, e.rank) for o in range(4) for e in await reader.entries(o, 1)]
        assert listed == [("o1", 2000, 1), ("p1", 500, 2), ("p1", 50, 3), ("o2", 10, 4)]
        assert [e.player_id for e in await reader.top(10)] == ["o1", "p1", "o2"]
        assert await reader.repair() == 1
        assert await mismatches(reader, ref) == []
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("fault", ["dead", "remove-lost"])
async def test_a_move_is_repaired_and_pruned_while_its_home_master_is_out_of_memory(
    store: BoardStore, fault: str
) -> None:
    """A primary at maxmemory (noeviction) refuses every MULTI, reads too. The repair read a
    player's version, pending move and total in one MULTI on their home shard, and the prune a
    removed player's too. Failed before: with p1's home master full, the repair raised
    OutOfMemoryError at every pass, though nothing it does then grows memory there (band.lua writes
    on the band shards, on the other masters here; settle.lua only deletes on the home shard), and
    so did the prune, which frees memory. Now each reads in one round trip of plain reads, the
    versions read again last. p1 moves from 2000 (band 2) to 50 (band 0), its band calls lost as
    ``fault`` says; a player of p1's home shard is removed before the master is full (a removal
    journals: refused there) and pruned after."""
    config = band_config(f"band-repair-oom-{fault}")
    writer, _ = await store.create(config)
    reader = await store.get(config.id)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    home = writer.layout.home("p1")
    node = store.client.get_node_from_key(keys.pending_key(writer.prefixes[home]))
    bands = [writer.prefixes[writer.layout.band_shard(p)] for p in (2000, 50)]
    assert all(store.client.get_node_from_key(keys.pending_key(b)) != node for b in bands)
    removed = [o for o in (f"o{i}" for i in range(len(OTHERS))) if writer.layout.home(o) == home]
    try:
        first = [*(Score(f"o{i}", p, "m1", now) for i, p in enumerate(OTHERS)), Score("p1", 2000, "m1", now)]
        await writer.submit(first, now_ms=now)
        ref.submit(first, now_ms=now)
        lose(writer, *FAULTS[fault])
        move = [Score("p1", 50, "m2", now + 1000)]
        with pytest.raises(ConnectionError):
            await writer.submit(move, now_ms=now + 1000)
        ref.submit(move, now_ms=now + 1000)
        assert removed and await pending(writer) == 1
        assert await moderation.remove(reader, removed) == set(removed)
        for player in removed:
            ref.remove(player)
        await store.client.config_set("maxmemory", 1, target_nodes=node)
        try:
            with pytest.raises(OutOfMemoryError):  # full indeed
                await reader.submit([Score("p1", 70, "m3", now + 2000)], now_ms=now + 2000)
            assert await reader.repair() == 1
            assert await pending(writer) == 0
            assert await mismatches(reader, ref) == []
            assert await reader.bands.prune(now + 10 * 86_400_000) == len(removed)
        finally:
            await store.client.config_set("maxmemory", 0, target_nodes=node)
        assert await mismatches(reader, ref) == []
    finally:
        await store.delete(config.id)
