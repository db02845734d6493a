"""A band board's per-player versions (``ver``) stay bounded by the players it holds.

Every change of a player's total bumps their version on the home shard, and every band shard keeps
the last version it took for each player (band.lua): that is what orders band moves sent twice, late
or out of order. A removal (moderation, or the inactive cleanup of a board with ``inactive_after``)
bumps the version once more and drops the player from every band at it, so the bands keep the
version as a tombstone against a late move. None of those entries was ever dropped: with players
churning through an ``inactive_after`` board, every player who ever posted stayed in the home
shard's hash and in every band shard's. The archiver's repair loop now forgets the versions of
players removed longer ago than the dedup window (at least an hour): on every band shard first,
then on the home shard, each only while the player is still gone and their version the removal's
(shardlb/bands.py, ``BandMoves.prune``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from shardlb import archive, bands, keys, moderation, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Resharder
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_band_repair import converged, lose, mismatches, pending, repairing
from tests.test_moderation import forget

pytestmark = pytest.mark.cluster

BANDS = [0, 100, 1000]
DAY = 86_400_000


def churn_config(name: str, durability: str = "journal") -> BoardConfig:
    return BoardConfig.from_dict(
        name,
        {
            "mode": "best",
            "durability": durability,
            "inactive_after": 3600,
            "dedup_window_s": 3600,
            "sharding": {"strategy": "band", "bands": BANDS, "shards": 3},
        },
    )


async def versions(board: Board) -> dict[int, set[str]]:
    """The players each shard's version hash holds (home shards and band shards)."""
    return {
        shard: set(await board.client.hkeys(keys.version_key(prefix)))
        for shard, prefix in enumerate(board.prefixes)
    }


def held(found: dict[int, set[str]]) -> set[str]:
    return set().union(*found.values())


async def until(check: Callable[[], Awaitable[bool]], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def listed(board: Board) -> set[str]:
    """The players the home shards list as removed with versions kept (``vrm``)."""
    homes = board.prefixes[: board.config.sharding.shards]
    return {p for h in homes for p in await board.client.zrange(keys.removed_versions_key(h), 0, -1)}


async def posted(board: Board, ref: ReferenceBoard, scores: list[Score], at: int) -> None:
    await board.submit(scores, now_ms=at)
    ref.submit(scores, now_ms=at)


async def test_players_churned_out_by_inactivity_leave_no_version_behind(store: BoardStore) -> None:
    """Forty players post three days ago, move between bands, and are dropped by the inactive
    cleanup; four stay active. Once the repair loop has run, no shard's version hash holds a player
    who left, and the four keep theirs (and every read equals the reference)."""
    config = churn_config("band-versions-churn")
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    then = times.now_ms() - 3 * DAY
    churned = [f"c{i}" for i in range(40)]
    staying = [f"s{i}" for i in range(4)]
    try:
        for step, points in enumerate([50, 500, 1500]):  # through every band
            at = then + step * 1000
            scores = [Score(p, points + i, f"m{step}", at) for i, p in enumerate(churned)]
            await board.submit(scores, now_ms=at)
            ref.submit(scores, now_ms=at)
        idle_at = then + 2 * 3600_000  # the cleanup runs two hours later: all forty are idle
        assert await moderation.cleanup(board, now_ms=idle_at) == len(churned)
        for p in churned:
            forget(ref, p)
        now = times.now_ms()
        scores = [Score(p, 10 * (i + 1) ** 3, "m1", now) for i, p in enumerate(staying)]
        await board.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        assert set(churned) <= held(await versions(board))  # before any repair pass: all still there

        async def forgotten() -> bool:
            return not set(churned) & held(await versions(board))

        async with repairing(store):
            await until(forgotten)
        left = await versions(board)
        assert {s: v & set(churned) for s, v in left.items()} == {s: set() for s in left}
        homes = {board.layout.home(p) for p in staying}
        assert set(staying) == set().union(*(left[h] for h in homes))
        assert await mismatches(board, ref) == []
    finally:
        await store.delete(config.id)


async def test_only_removals_older_than_the_window_and_confirmed_are_forgotten(store: BoardStore) -> None:
    """Removed three days ago: ``old`` is forgotten. Removed half an hour ago (the window is an
    hour): ``recent`` is kept. Removed three days ago and back since: ``back`` keeps its versions
    (live again) and leaves the list. Removed three days ago with its band calls lost: ``lost`` is
    kept until the repair has confirmed its removal, then forgotten. Every read equals the
    reference once the repair has finished the removal of ``lost``."""
    config = churn_config("band-versions-window")
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    then = now - 3 * DAY
    try:
        await posted(board, ref, [Score(p, 500, "m1", then) for p in ("old", "recent", "back", "lost")], then)
        await posted(board, ref, [Score("other", 50, "m1", now)], now)
        for player, at in (("old", then + 1000), ("back", then + 1000), ("recent", now - 1800_000)):
            await moderation.remove(board, [player], now_ms=at)
            forget(ref, player)
        writer = await store.get(config.id)  # a router that loses every band call
        lose(writer, "", 10**6)
        with pytest.raises(ConnectionError):
            await moderation.remove(writer, ["lost"], now_ms=then + 1000)
        forget(ref, "lost")
        await posted(board, ref, [Score("back", 1500, "m2", now)], now)
        assert await listed(board) == {"old", "recent", "back", "lost"}
        assert await board.prune() == 1
        assert held(await versions(board)) == {"recent", "back", "lost", "other"}
        assert await listed(board) == {"recent", "lost"}
        assert await board.repair() == 1  # the removal of ``lost`` finished: then it goes too
        assert await board.prune() == 1
        assert held(await versions(board)) == {"recent", "back", "other"}
        assert await listed(board) == {"recent"}
        assert await board.prune(now + 3600_000) == 1  # an hour later, ``recent`` is old too
        assert await listed(board) == set()
        assert await mismatches(board, ref) == []
    finally:
        await store.delete(config.id)


def on_home(board: Board, home: int, prefix: str, count: int) -> list[str]:
    """``count`` player names (``prefix`` and a number) whose home shard is ``home``."""
    names = (f"{prefix}{i}" for i in itertools.count())
    return list(itertools.islice((p for p in names if board.layout.home(p) == home), count))


async def test_a_pass_reaches_the_forgettable_players_behind_a_head_still_pending(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven players on one home shard were removed first, through a router that lost every band
    call: their removals stay pending (a band shard that keeps failing for them). Three more were
    removed a second later, confirmed. A pass read the REPAIR_CHUNK oldest of the list (4 here),
    all pending, and forgot nothing: every pass read the same ones, and the list and the versions
    behind them grew for as long as the head stayed pending. One pass now pages on past those that
    stay and forgets the three everywhere; the seven keep theirs, listed, until the repair confirms
    their removals, and the next pass forgets them too."""
    monkeypatch.setattr(bands, "REPAIR_CHUNK", 4)
    config = churn_config("band-versions-head")
    board, _ = await store.create(config)
    then = times.now_ms() - 3 * DAY
    stuck, free = on_home(board, 0, "s", 7), on_home(board, 0, "f", 3)
    try:
        scores = [Score(p, 10 ** (i % 4), "m1", then) for i, p in enumerate(stuck + free)]
        await board.submit(scores, now_ms=then)
        writer = await store.get(config.id)  # a router that loses every band call
        lose(writer, "", 10**6)
        with pytest.raises(ConnectionError):
            await moderation.remove(writer, stuck, now_ms=then + 1000)
        await moderation.remove(board, free, now_ms=then + 2000)
        assert await listed(board) == set(stuck + free)
        assert await pending(board) == len(stuck)
        assert await board.prune() == len(free)
        assert held(await versions(board)) == set(stuck)
        assert await listed(board) == set(stuck)
        assert await board.repair() == len(stuck)
        assert await board.prune() == 4 and await board.prune() == 3
        assert held(await versions(board)) == set()
        assert await listed(board) == set()
    finally:
        await store.delete(config.id)


async def test_a_pass_reads_a_bounded_number_of_pages_of_the_list(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nine removals pending at the head of one home shard's list, three confirmed behind them,
    pages of 4: a pass reads PRUNE_PAGES pages at most, so with two it reaches none of the three
    (the next passes read the same head: the bound, not a scan of the whole list), with three it
    forgets them all. Ten confirmed removals: a pass forgets about REPAIR_CHUNK of them, as before."""
    monkeypatch.setattr(bands, "REPAIR_CHUNK", 4)
    monkeypatch.setattr(bands, "PRUNE_PAGES", 2)
    config = churn_config("band-versions-pages")
    board, _ = await store.create(config)
    then = times.now_ms() - 3 * DAY
    stuck, free, more = on_home(board, 0, "s", 9), on_home(board, 0, "f", 3), on_home(board, 1, "m", 10)
    try:
        scores = [Score(p, 10 ** (i % 4), "m1", then) for i, p in enumerate(stuck + free + more)]
        await board.submit(scores, now_ms=then)
        writer = await store.get(config.id)
        lose(writer, "", 10**6)
        with pytest.raises(ConnectionError):
            await moderation.remove(writer, stuck, now_ms=then + 1000)
        await moderation.remove(board, free + more, now_ms=then + 2000)
        assert await board.prune() == 4  # home 0: none; home 1: one page of ``more``
        assert await board.prune() == 4
        assert held(await versions(board)) == set(stuck + free + sorted(more)[8:])  # equal times: by name
        monkeypatch.setattr(bands, "PRUNE_PAGES", 3)
        assert await board.prune() == len(free) + 2
        assert held(await versions(board)) == set(stuck)
        assert await listed(board) == set(stuck)
    finally:
        await store.delete(config.id)


async def test_a_forgotten_player_who_comes_back_starts_above_every_version_forgotten(
    store: BoardStore,
) -> None:
    """``p`` moves through the bands (versions 1 to 5) and is removed (6), three days ago; the
    prune forgets them, and the home shard's floor becomes 6. Should a band still hold a version
    of theirs (a rebuild of the bands racing the prune, a drop sent late puts one back), their
    first post after is numbered above the floor, so that band takes it: numbered 1 again, the band
    would drop every move of theirs up to 6, and they would be missing from the board."""
    config = churn_config("band-versions-floor")
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    then = now - 3 * DAY
    home = board.prefixes[board.layout.home("p")]
    try:
        for step, points in enumerate([5, 50, 500, 900, 1500]):
            await posted(board, ref, [Score("p", points, f"m{step}", then + step)], then + step)
        await moderation.remove(board, ["p"], now_ms=then + 1000)
        forget(ref, "p")
        assert await board.client.hget(keys.version_key(home), "p") == "6"
        assert await board.prune() == 1
        assert await board.client.get(keys.version_floor_key(home)) == "6"
        assert "p" not in held(await versions(board))
        kept = board.prefixes[board.layout.band_shard(500)]  # p's next band keeps its old version
        await board.client.hset(keys.version_key(kept), "p", 6)
        await posted(board, ref, [Score("p", 400, "m9", now)], now)
        assert await mismatches(board, ref) == []
        assert await board.client.hget(keys.version_key(home), "p") == "7"
        # A removal of a player without a version numbers it above the floor too.
        await moderation.remove(board, ["never"], now_ms=now)
        assert await board.client.hget(keys.version_key(home), "never") in (None, "7")
        never = board.prefixes[board.layout.home("never")]
        floor = int(await board.client.get(keys.version_floor_key(never)) or 0)
        assert int(await board.client.hget(keys.version_key(never), "never")) == floor + 1
    finally:
        await store.delete(config.id)


async def test_removing_a_removed_player_again_finds_nothing(store: BoardStore) -> None:
    """The list of removed players (``vrm``) is a sorted set among the shard's keys, and a removal
    takes a player out of every sorted set it is given: it must not count that as an entry."""
    config = churn_config("band-versions-again")
    board, _ = await store.create(config)
    now = times.now_ms()
    try:
        await board.submit([Score("p", 500, "m1", now)], now_ms=now)
        assert await moderation.remove(board, ["p"], now_ms=now) == {"p"}
        assert await moderation.remove(board, ["p"], now_ms=now + 1000) == set()
        assert await listed(board) == {"p"}  # still listed, from the later removal
        home = board.prefixes[board.layout.home("p")]
        assert await board.client.zscore(keys.removed_versions_key(home), "p") == now + 1000
    finally:
        await store.delete(config.id)


async def test_a_prune_whose_band_call_fails_forgets_nothing_on_the_home_shard(
    store: BoardStore,
) -> None:
    """The bands are told first; a call that fails leaves the home shard's version and its listing,
    and the next pass finishes the job."""
    config = churn_config("band-versions-lost")
    board, _ = await store.create(config)
    then = times.now_ms() - 3 * DAY
    try:
        await board.submit([Score(f"p{i}", 10**i, "m1", then) for i in range(4)], now_ms=then)
        await moderation.remove(board, [f"p{i}" for i in range(4)], now_ms=then + 1000)
        real, calls = board.scripts.prune, 0

        async def failing(*, keys: list[str], args: list[Any]) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:  # the second band shard's call
                raise ConnectionError("the prune's band call was lost")
            return await real(keys=keys, args=args)

        board.scripts = dataclasses.replace(board.scripts, prune=failing)
        with pytest.raises(ConnectionError):
            await board.prune()
        homes = range(config.sharding.shards)
        found = await versions(board)
        assert held({h: found[h] for h in homes}) == {f"p{i}" for i in range(4)}
        assert await listed(board) == {f"p{i}" for i in range(4)}
        board.scripts = dataclasses.replace(board.scripts, prune=real)
        assert await board.prune() == 4
        assert held(await versions(board)) == set()
        assert await listed(board) == set()
    finally:
        await store.delete(config.id)


async def test_a_player_forgotten_while_the_bands_are_rebuilt_leaves_no_version_there(
    store: BoardStore, rebuilder: Rebuilder
) -> None:
    """rebuild_bands reads every home version, then swaps each band shard in with all of them: a
    player forgotten in between came back in every band's hash (and nothing would forget them
    again). The pass after the swap forgets them there again."""
    config = churn_config("band-versions-rebuild")
    board, _ = await store.create(config)
    then = times.now_ms() - 3 * DAY
    real_fill, pruned = rebuilder._fill, []

    async def fill(key: str, members: dict[str, int], hash: bool = False) -> None:
        if not pruned:  # the versions and totals are read: the first band's fill comes next
            pruned.append(await board.prune())
        await real_fill(key, members, hash)

    try:
        await board.submit([Score(f"p{i}", 10**i, "m1", then) for i in range(4)], now_ms=then)
        await moderation.remove(board, ["p0", "p2"], now_ms=then + 1000)
        rebuilder._fill = fill  # type: ignore[method-assign]
        await rebuilder.rebuild_bands(board)
        assert pruned == [2]
        assert held(await versions(board)) == {"p1", "p3"}
        assert [e.player_id for e in await board.top(10)] == ["p3", "p1"]
    finally:
        await store.delete(config.id)


async def test_prunes_from_several_processes_beside_forgotten_players_posting_again(
    store: BoardStore,
) -> None:
    """Players removed long ago post again, through routers that lose a third of the band calls,
    while three repair loops (each also pruning) run. However the prune's reads, band calls and
    home call interleave with the posts, every read ends equal to the reference, nothing is left
    pending, and no shard keeps a version of a player who is not on the board."""
    config = churn_config("band-versions-concurrent")
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    then = now - 3 * DAY
    players = [f"p{i}" for i in range(8)]  # at most 10 on the board: mismatches reads a top 10
    rng = random.Random("band-versions-concurrent")
    try:
        await posted(board, ref, [Score(p, 50 * (i + 1), "m0", then) for i, p in enumerate(players)], then)
        await moderation.remove(board, players, now_ms=then + 1000)
        for p in players:
            forget(ref, p)

        async def player(name: str) -> None:
            writer = await store.get(config.id)  # a router of its own
            lose(writer, rng=random.Random(name), share=0.33)
            for step in range(rng.randrange(0, 6)):
                at = now + step * 1000
                score = Score(name, rng.choice([5, 50, 150, 500, 999, 1500]), f"m{step + 1}", at)
                with contextlib.suppress(ConnectionError):
                    await writer.submit([score], now_ms=at)
                ref.submit([score], now_ms=at)
                await asyncio.sleep(rng.random() / 100)

        stops = [asyncio.Event() for _ in range(3)]
        loops = [asyncio.create_task(archive.repair_bands(store, stop, 0.01)) for stop in stops]
        try:
            await asyncio.gather(*(player(p) for p in players))
            await converged(board, ref)
        finally:
            for stop in stops:
                stop.set()
            await asyncio.gather(*loops, return_exceptions=True)
        await board.repair()
        await board.prune()
        assert await pending(board) == 0
        assert await mismatches(board, ref) == []
        on_board = {row[1] for row in ref.order()}
        assert held(await versions(board)) == on_board
        assert await listed(board) == set()
    finally:
        await store.delete(config.id)


def test_a_removal_is_kept_an_hour_at_least_whatever_the_window() -> None:
    assert bands.FORGET_AFTER_MIN_MS == 3600_000


@pytest.mark.parametrize("then", ["deleted", "resharded"])
async def test_the_lists_and_floors_go_with_the_board_and_a_reshard_carries_none(
    store: BoardStore, then: str
) -> None:
    """`vrm` and `vfl` are in the key index: a deletion unlinks them. A reshard does not copy them
    (nor any removed player's version): the new layout numbers the players it copies from 1, and
    its first prune has nothing to forget, while the players on the board read as before."""
    config = churn_config(f"band-versions-{then}", "memory")  # a journaled one needs PostgreSQL
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    then_ms = now - 3 * DAY
    try:
        await posted(board, ref, [Score(f"p{i}", 10**i, "m1", then_ms) for i in range(4)], then_ms)
        await moderation.remove(board, ["p0", "p1"], now_ms=then_ms + 1000)
        await moderation.remove(board, ["p2"], now_ms=now)
        for p in ("p0", "p1", "p2"):
            forget(ref, p)
        assert await board.prune() == 2
        homes = board.prefixes[: config.sharding.shards]
        ours = [keys.removed_versions_key(h) for h in homes] + [keys.version_floor_key(h) for h in homes]
        assert await board.client.exists(*ours) >= 2  # p2's listing, and a floor
        if then == "deleted":
            await store.delete(config.id)
            assert await board.client.exists(*ours) == 0
            return
        mover = Resharder(store, config.id, say=lambda _: None, cache_s=0)
        await mover.start(2, [0, 50, 500, 5000])
        await mover.run()
        moved = await store.get(config.id)
        assert moved.layout.strategy == "band" and moved.layout.physical == 6
        assert await listed(moved) == set()
        assert held(await versions(moved)) == {"p3"}
        assert await moved.prune(now + 2 * DAY) == 0
        assert await mismatches(moved, ref) == []
    finally:
        with contextlib.suppress(Exception):
            await store.delete(config.id)


async def test_a_removal_made_again_while_a_pass_lists_the_player_keeps_its_tombstones(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``p`` was removed three days ago, and a pass lists them. Before the pass reads their
    version, they post again (its band call held up: a router stalled, a slow network) and are
    removed again. That removal is minutes old: the bands must keep its version, against that late
    band call. The pass read the new version as the removal's, and told every band to forget it:
    the late add then put ``p`` back on the board for good (nothing was left pending to drop it)."""
    config = churn_config("band-versions-relisted")
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    then = now - 3 * DAY
    held_up: list[tuple[list[str], list[Any]]] = []

    async def stalled(*, keys: list[str], args: list[Any]) -> Any:
        held_up.append((keys, args))
        raise ConnectionError("the band call is held up")

    writer = await store.get(config.id)
    writer.scripts = dataclasses.replace(writer.scripts, band=stalled)
    real = bands.BandMoves._prune_home

    async def relisted(self: bands.BandMoves, home: int, players: list[str], cutoff: int) -> int:
        monkeypatch.undo()
        with pytest.raises(ConnectionError):
            await writer.submit([Score("p", 1500, "m2", now)], now_ms=now)
        await moderation.remove(board, ["p"], now_ms=now)
        return await real(self, home, players, cutoff)

    try:
        await posted(board, ref, [Score("p", 500, "m1", then), Score("other", 50, "m1", now)], now)
        await moderation.remove(board, ["p"], now_ms=then + 1000)
        forget(ref, "p")
        monkeypatch.setattr(bands.BandMoves, "_prune_home", relisted)
        await board.prune()
        assert held_up
        for keys_, args in held_up:  # the post's band call lands at last
            await board.scripts.band(keys=keys_, args=args)
        assert await listed(board) == {"p"}
        assert await mismatches(board, ref) == []
    finally:
        await store.delete(config.id)
