"""Reads of a band board's total from band sizes (shardlb/reads.py, "band boards' total").

A rank there is the sizes of the bands ahead plus one rank inside the player's band, "around me"
reads rows by index in the bands around the player, and friends take one counts.lua call per band
holding some of them. Checked on a real cluster against the in-memory reference board on random
workloads (few and many bands: one round and two rounds), and, while a band move is still pending
(a lost band call), against a count over the band shards' own rows, the answer every other view
gives: 1 + the rows of other players that rank ahead of the player's home row (competition ranks:
that have better points than it).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from redis.exceptions import OutOfMemoryError

from shardlb import keys, reads, times
from shardlb.board import Board, Entry, Score
from shardlb.config import BoardConfig
from shardlb.merge import Row
from shardlb.reads import ONE_ROUND_BANDS
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.router_support import board_name
from tests.test_board import check_view, expected_entries
from tests.test_board_retries import assert_board_equals, fail_band_once
from tests.test_store_oom import full_primaries

pytestmark = pytest.mark.cluster

FEW = [0, 40, 120, 300]
MANY = list(range(0, 1000, 1000 // (ONE_ROUND_BANDS + 4)))[: ONE_ROUND_BANDS + 4]


@pytest.mark.parametrize("order", ["desc", "asc"])
@pytest.mark.parametrize("mode", ["best", "set"])
@pytest.mark.parametrize("bands", [FEW, MANY], ids=["few-bands", "many-bands"])
async def test_band_reads_match_reference(store: BoardStore, bands: list[int], mode: str, order: str) -> None:
    rng = random.Random(f"band-reads/{len(bands)}/{mode}/{order}")
    board_id = f"band-reads-{len(bands)}-{mode}-{order}"
    config = BoardConfig.from_dict(
        board_id,
        {
            "mode": mode,
            "order": order,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "points_max": 1000,
            "sharding": {"strategy": "band", "bands": bands, "shards": 3},
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    players = [f"p{i:03d}" for i in range(60)]
    try:
        for batch_no in range(4):
            batch = [
                Score(
                    rng.choice(players),
                    rng.choice([0, 999, *range(0, 1000, 37)]),  # few values: ties inside bands
                    f"m{batch_no}-{i}",
                    now - rng.choice([0, 1, 2]) * 1000,
                )
                for i in range(40)
            ]
            got = await board.submit(batch, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)
            await check_view(board, ref, "total", "total", None, rng)
    finally:
        await store.delete(board_id)


async def band_rows(board: Board) -> list[Row]:
    """Every row of the band shards' total keys, stale rows of a pending move included."""
    out: list[Row] = []
    for prefix in board.prefixes[board.config.sharding.shards :]:
        pairs = await board.client.zrange(keys.period_key(prefix, "total"), 0, -1, withscores=True)
        out += [(score, member) for member, score in pairs]
    return out


async def home_row(board: Board, player: str) -> Row:
    key = keys.period_key(board.prefixes[board.layout.home(player)], "total")
    score = await board.client.zscore(key, player)
    assert score is not None
    return score, player


def counted_rank(rows: list[Row], row: Row) -> int:
    """1 + the rows ahead of ``row`` of other players: a player's own stale row never counts."""
    return 1 + sum(1 for r in rows if r > row and r[1] != row[1])


def counted_competition(board: Board, rows: list[Row], row: Row) -> tuple[int, float]:
    """The competition rank of ``row`` (1 + the rows of other players with better points: a player's
    own stale row never counts) and its percentile (the share of every row with worse points)."""
    sign = 1 if board.config.order == "desc" else -1
    points = sign * board.codec.decode(row[0])[0]
    others = [sign * board.codec.decode(r[0])[0] for r in rows if r[1] != row[1]]
    worse = sum(1 for r in rows if sign * board.codec.decode(r[0])[0] < points)
    return 1 + sum(1 for p in others if p > points), 100.0 * worse / len(rows)


async def assert_reads_count_band_rows(board: Board, players: list[str]) -> None:
    """Rank, around and friends of ``players`` agree with a count over the band shards' rows (a
    player's own stale row never counts ahead of them; the size counts every row)."""
    rows = await band_rows(board)
    homes = {p: await home_row(board, p) for p in players}
    codec = board.codec

    def entry(rank: int, row: Row) -> Entry:
        points, achieved = codec.decode(row[0])
        return Entry(rank, row[1], points, achieved)

    for p, row in homes.items():
        got = await board.player(p)
        assert got.entry == entry(counted_rank(rows, row), row), p
        assert got.players == len(rows)
        for radius in (0, 1, 3):
            others = sorted({r for r in rows if r[1] != p}, reverse=True)
            at = sum(1 for r in others if r > row)
            lo = max(0, at - radius)
            want = [*others[lo:at], row, *others[at : at + radius]]
            rank = counted_rank(rows, row) - (at - lo)
            assert await board.around(p, radius) == [entry(rank + i, r) for i, r in enumerate(want)], (
                p,
                radius,
            )
    ids = [*players, "nobody"]
    listed = sorted(homes.values(), reverse=True)
    assert await board.query(ids) == [entry(counted_rank(rows, row), row) for row in listed]
    competition = {p: counted_competition(board, rows, row) for p, row in homes.items()}
    for p, row in homes.items():
        rank, percentile = competition[p]
        got = await board.player(p, rank_mode="competition")
        assert (got.entry, got.players) == (entry(rank, row), len(rows)), p
        assert got.percentile == pytest.approx(percentile), p
        for radius in (0, 3):
            window = await board.around(p, radius, rank_mode="competition")
            assert entry(rank, row) in window, (p, radius, window)
    assert await board.query(ids, rank_mode="competition") == [
        entry(competition[row[1]][0], row) for row in listed
    ]


@pytest.mark.parametrize(
    ("before", "after", "mode"),
    [(50, 500, "best"), (50, 70, "best"), (500, 50, "set"), (5000, 10, "set")],
    ids=["up-a-band", "inside-a-band", "down-a-band", "down-two-bands"],
)
async def test_band_reads_while_a_move_is_pending(
    store: BoardStore, before: int, after: int, mode: str
) -> None:
    """A band call lost: the home shard has the player's new total, the old band shard still the old
    row (the new band took the add first: it is the call lost). Every read counts from the home row,
    over the rows the band shards hold (the player's own stale row never counts for them), until the
    move is finished (here by Board.repair); then they equal the reference."""
    bands = [0, 100, 1000]
    config = BoardConfig.from_dict(
        f"band-pending-{before}-{after}-{mode}",
        {"mode": mode, "sharding": {"strategy": "band", "bands": bands, "shards": 3}},
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    try:
        others = [
            Score(f"o{i}", points, "m1", now)
            for i, points in enumerate([10, 50, 60, 70, 70, 400, 600, 2000, 9000])
        ]
        first = [*others, Score("p1", before, "m1", now)]
        await board.submit(first, now_ms=now)
        ref.submit(first, now_ms=now)
        fail_band_once(board)
        move = [Score("p1", after, "m2", now + 1000)]
        with pytest.raises(ConnectionError):
            await board.submit(move, now_ms=now + 1000)
        ref.submit(move, now_ms=now + 1000)
        assert (await home_row(board, "p1"))[0] != (
            await board.client.zscore(
                keys.period_key(board.prefixes[board.layout.band_shard(before)], "total"), "p1"
            )
        )  # the band shard of the old total still holds the old row: the move is pending
        await assert_reads_count_band_rows(board, ["p1", "o0", "o2", "o4", "o8"])
        assert await board.repair() == 1
        await assert_board_equals(board, ref)
        await assert_reads_count_band_rows(board, ["p1", "o0", "o2", "o4", "o8"])
    finally:
        await store.delete(board.config.id)


async def test_a_rank_counted_from_the_home_row_takes_its_band_size_from_the_same_call(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the player's band does not hold them at their home row (a move pending inside the band),
    their place in it is counted by counts.lua a round after the bands' sizes were read; the band's
    size now comes from that call too. Two players who reach the band between the rounds, ahead of
    the player, are in both the rank and ``players`` (9 of 12, as every order of the writes has it),
    never in the rank alone (9 of 10)."""
    config = BoardConfig.from_dict(
        board_name("band-pending-size"),
        {
            "durability": "memory",
            "mode": "best",
            "sharding": {"strategy": "band", "bands": [0, 100, 1000], "shards": 3},
        },
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    try:
        others = [
            Score(f"o{i}", points, "m1", now)
            for i, points in enumerate([10, 50, 60, 70, 70, 400, 600, 2000, 9000])
        ]
        await board.submit([*others, Score("p1", 50, "m1", now)], now_ms=now)
        fail_band_once(board)
        with pytest.raises(ConnectionError):  # the band keeps p1's row at 50: the move is pending
            await board.submit([Score("p1", 70, "m2", now + 1000)], now_ms=now + 1000)
        got = await board.player("p1")
        # Ahead: 9000, 2000, 600, 400, and o3 and o4, whose 70 came first.
        assert (got.entry.rank, got.players) == (7, 10)
        count = reads.View._count_calls

        async def counted_after_writes(self: reads.View, *args: Any) -> list[Any]:
            monkeypatch.setattr(reads.View, "_count_calls", count)
            arrived = [Score(f"q{i}", 80, "m3", now + 2000) for i in range(2)]  # p1's band, ahead
            await board.submit(arrived, now_ms=now + 2000)
            return await count(self, *args)

        monkeypatch.setattr(reads.View, "_count_calls", counted_after_writes)
        got = await board.player("p1")
        assert reads.View._count_calls is count  # counted from the home row
        assert got.entry.rank <= got.players
        assert (got.entry.rank, got.players) == (9, 12)
    finally:
        await store.delete(board.config.id)


async def test_a_large_batch_on_a_board_of_many_bands_is_applied(store: BoardStore) -> None:
    """A batch of the API's largest size (1000 results) on 16 home shards and 16 bands: every home
    shard's call moves players into most bands at once. Those band calls share pipelines instead of
    each taking a connection of its own (they once ran out of the pool: MaxConnectionsError)."""
    bands = list(range(0, 16_000, 1000))
    config = BoardConfig.from_dict(
        "band-large-batch", {"sharding": {"strategy": "band", "bands": bands, "shards": 16}}
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    try:
        batch = [Score(f"p{i}", (i * 7919) % 16_000, "m1", now) for i in range(1000)]
        got = await board.submit(batch, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)
        assert await board.top(1000) == expected_entries(ref, "total", None)
        assert await board.repair() == 0  # every move was finished by the call itself
    finally:
        await store.delete(config.id)


def band_sizes(want: list[Entry], bands: list[int]) -> list[int]:
    """The reference's rows per band, best band first (a desc board: the highest band first)."""
    starts = sorted(bands, reverse=True)
    ends = [10**18, *starts]
    return [sum(1 for e in want if start <= e.points < end) for start, end in zip(starts, ends, strict=False)]


async def command_calls(board: Board, commands: tuple[str, ...]) -> dict[str, int]:
    """INFO commandstats calls of ``commands`` summed over the cluster's primaries."""
    stats = await board.client.info("commandstats", target_nodes=board.client.PRIMARIES)
    out = dict.fromkeys(commands, 0)
    for node in stats.values():
        for command in commands:
            out[command] += int(node.get(f"cmdstat_{command}", {}).get("calls", 0))
    return out


async def test_my_rank_with_max_age_counts_the_other_bands_as_an_exact_read_left_them(
    store: BoardStore,
) -> None:
    """``max_age_ms``: the other bands' sizes come from the last exact read of this process (while
    no older than asked), the player's own band is read now, asked in the home shard's round where
    the player was placed before; such a read sends commands to two shards only. Checked against
    the reference board before and after more writes move players between bands (their next read
    takes a second round), and exact again once the kept sizes are too old."""
    bands = [0, 40, 120, 300]
    rng = random.Random("band-max-age")
    config = BoardConfig.from_dict(
        "band-max-age", {"mode": "best", "sharding": {"strategy": "band", "bands": bands, "shards": 3}}
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    players = [f"p{i:02d}" for i in range(40)]

    async def write(round_no: int, who: list[str]) -> None:
        batch = [Score(p, rng.randrange(0, 400), f"m{round_no}", now) for p in who]
        await board.submit(batch, now_ms=now)
        ref.submit(batch, now_ms=now)

    try:
        await write(0, players)
        want = expected_entries(ref, "total", None)
        first = await board.player(want[0].player_id)  # exact: keeps the sizes it read
        assert first.counts_ms is None
        kept = band_sizes(want, bands)
        for e in want:  # nothing written since: the kept sizes are the board's
            # (The first read of each player is exact: there is no band to ask in the home's round.)
            got = await board.player(e.player_id, max_age_ms=60_000)
            assert (got.entry, got.players) == (e, len(want))
            assert got.counts_ms is not None and got.counts_ms <= times.now_ms()
        starts = sorted(bands, reverse=True)
        band_then = {e.player_id: next(i for i, b in enumerate(starts) if e.points >= b) for e in want}
        await write(1, rng.sample(players, 25))
        await write(2, rng.sample(players, 25))
        want = expected_entries(ref, "total", None)
        moved = [
            e
            for e in want
            if next(i for i, b in enumerate(starts) if e.points >= b) != band_then[e.player_id]
        ]
        assert moved  # their next read finds them in another band than the one asked first
        now_sizes = band_sizes(want, bands)
        assert now_sizes != kept  # players moved between bands since the sizes were kept
        for e in want:
            band = next(i for i, start in enumerate(starts) if e.points >= start)
            inside = [w for w in want if starts[band] <= w.points < [10**18, *starts][band]]
            rank = sum(kept[:band]) + 1 + inside.index(e)
            players_then = sum(kept) - kept[band] + now_sizes[band]
            got = await board.player(e.player_id, max_age_ms=60_000)
            assert (got.entry.rank, got.entry.points, got.players) == (rank, e.points, players_then), e
        calls = ("zscore", "zrevrank", "zcard")
        before = await command_calls(board, calls)
        await board.player(want[0].player_id, max_age_ms=60_000)
        after = await command_calls(board, calls)
        assert {c: after[c] - before[c] for c in calls} == {"zscore": 2, "zrevrank": 1, "zcard": 1}
        await asyncio.sleep(0.02)
        for e in want:  # the kept sizes are older than 10 ms: exact, and kept again
            got = await board.player(e.player_id, max_age_ms=10)
            assert (got.entry, got.players) == (e, len(want))
        before = await command_calls(board, calls)
        assert (await board.player(want[-1].player_id, max_age_ms=60_000)).entry == want[-1]
        after = await command_calls(board, calls)
        assert after["zcard"] - before["zcard"] == 1  # the sizes the exact reads kept
    finally:
        await store.delete(board.config.id)


async def test_a_band_board_is_read_while_every_primary_is_out_of_memory(store: BoardStore) -> None:
    """A primary at maxmemory (noeviction) refuses every MULTI, reads too, and every command that
    may grow memory. A band board's reads use neither (pipelines of plain reads, and counts.lua,
    near.lua and places.lua, flagged no-writes, which Redis runs out of memory): with every primary
    full, home shards and band shards alike, the total (read the band way) and a daily period (read
    as a hash board's) answer as before. Pinned: it held before (the MULTIs of shardlb/bands.py
    are the repair's and prune's, not a read's)."""
    sharding = {"strategy": "band", "bands": FEW, "shards": 3}
    settings = {"periods": ["daily"], "points_max": 1000, "sharding": sharding}
    config = BoardConfig.from_dict("band-reads-oom", settings)
    board, _ = await store.create(config)
    now = times.now_ms()
    try:
        scores = [Score(f"p{i:03d}", (i * 37) % 1000, f"m{i}", now) for i in range(60)]
        await board.submit(scores, now_ms=now)
        for period in ("total", "daily"):
            view = board.resolve(period, now_ms=now)
            before = (
                await board.top(10, view),
                await board.entries(20, 10, view),
                await board.player("p005", view),
                await board.around("p005", 3, view),
                await board.query(["p001", "p002", "p040"], view),
            )
            async with full_primaries(store):
                with pytest.raises(OutOfMemoryError):  # full indeed
                    await board.submit([Score("late", 500, "m-late", now)], now_ms=now)
                during = (
                    await board.top(10, view),
                    await board.entries(20, 10, view),
                    await board.player("p005", view),
                    await board.around("p005", 3, view),
                    await board.query(["p001", "p002", "p040"], view),
                )
            assert during == before and len(before[0]) == 10, period
    finally:
        await store.delete(config.id)
