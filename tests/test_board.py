"""Random workloads on a real cluster, compared after every batch with the in-memory reference board.

Every strategy (hash, region, band) x shard count (1, 3, 16) x mode x order: top, pages at several
offsets (deep pages forced through the bisection path), the rank and entry of every player, around
for sampled players and query for sampled id sets. Few distinct points and times make ties common,
so the tie rule (equal score -> larger player id first) is exercised on every read.
"""

from __future__ import annotations

import io
import random
from typing import Any

import msgpack
import pytest

from shardlb import fanout, keys, periods, reads, times
from shardlb.board import STREAM_VALUES, Board, Entry, Score
from shardlb.config import BoardConfig
from shardlb.errors import InvalidInput
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.router_support import board_name

pytestmark = pytest.mark.cluster

HOUR = 3_600_000


def sharding(strategy: str, shards: int) -> dict[str, object]:
    if strategy == "hash":
        return {"strategy": "hash", "shards": shards}
    if strategy == "region":
        regions, per = {1: (1, 1), 3: (3, 1), 16: (4, 4)}[shards]
        return {"strategy": "region", "regions": [f"r{i}" for i in range(regions)], "shards_per_region": per}
    return {"strategy": "band", "bands": [0, 40, 120, 300], "shards": shards}


def expected_entries(ref: ReferenceBoard, name: str, region: str | None) -> list[Entry]:
    codec = ref.codec
    return [
        Entry(i + 1, player, points, codec.units_to_ms(units))
        for i, (_, player, points, units) in enumerate(ref.order(name, region))
    ]


async def hash_board_with_reference(
    store: BoardStore, board_id: str, order: str
) -> tuple[Board, ReferenceBoard]:
    """A ``best`` board of 3 hash shards in ``order``, created on the cluster, and its reference."""
    config = BoardConfig.from_dict(
        board_id, {"mode": "best", "order": order, "sharding": {"strategy": "hash", "shards": 3}}
    )
    board, _ = await store.create(config)
    return board, ReferenceBoard(config)


async def check_view(
    board: Board, ref: ReferenceBoard, name: str, api: str, region: str | None, rng: random.Random
) -> None:
    want = expected_entries(ref, name, region)
    n = len(want)
    view = board.resolve(api, region)
    assert await board.top(10, view) == want[:10]
    assert await board.top(n + 5, view) == want
    assert await board.size(view) == n
    board.shallow = 0  # every page below goes through the score bisection, not a merged top
    try:
        for offset in sorted({0, 1, 7, n // 3, n // 2, max(n - 6, 0), max(n - 1, 0), n, n + 3}):
            assert await board.entries(offset, 6, view) == want[offset : offset + 6], offset
    finally:
        board.shallow = 1000
    for e in want:
        got = await board.player(e.player_id, view)
        assert got.entry == e
        assert got.players == n
        assert got.percentile == pytest.approx(100.0 * (n - e.rank) / n)
    for e in rng.sample(want, min(5, n)):
        radius = rng.choice([0, 1, 3, 8])
        lo = max(0, e.rank - 1 - radius)
        assert await board.around(e.player_id, radius, view) == want[lo : e.rank + radius]
    ids = [e.player_id for e in rng.sample(want, min(12, n))] + ["nobody", "ghost-1"]
    rng.shuffle(ids)
    assert await board.query(ids, view) == [e for e in want if e.player_id in ids]


@pytest.mark.parametrize("order", ["desc", "asc"])
@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize("shards", [1, 3, 16])
@pytest.mark.parametrize("strategy", ["hash", "region", "band"])
async def test_random_workload_matches_reference(
    store: BoardStore, strategy: str, shards: int, mode: str, order: str
) -> None:
    rng = random.Random(f"{strategy}/{shards}/{mode}/{order}")
    board_id = f"ref-{strategy}-{shards}-{mode}-{order}"
    config = BoardConfig.from_dict(
        board_id,
        {
            "mode": mode,
            "order": order,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "periods": ["daily", "weekly"],
            "points_max": 1000,
            "sharding": sharding(strategy, shards),
            "close_grace": 7 * 86_400,  # yesterday stays open: the day read below takes results
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    regions = list(config.sharding.regions)
    players = [f"p{i:03d}" for i in range(45)]
    region_of = {p: rng.choice(regions) for p in players} if regions else {}
    sent: list[Score] = []
    try:
        for batch_no in range(4):
            batch = []
            for _ in range(30):
                if sent and rng.random() < 0.2:
                    batch.append(rng.choice(sent))  # an exact replay
                    continue
                player = rng.choice(players)
                top = 60 if mode == "incr" else 400
                batch.append(
                    Score(
                        player,
                        rng.choice([0, top, *range(0, top, 13)]),
                        f"m{batch_no}-{len(sent)}-{rng.random()}",
                        now - rng.choice([0, 1, 2, 30]) * HOUR,
                        region_of.get(player),
                    )
                )
                sent.append(batch[-1])
            got = await board.submit(batch, now_ms=now)
            want = ref.submit(batch, now_ms=now)
            assert [(r.status, r.points) for r in got] == want
            await check_view(board, ref, "total", "total", None, rng)
            day = periods.names_at(now - 30 * HOUR, config.periods, board.tz)[1]
            await check_view(board, ref, day, "daily:" + day[2:], None, rng)
            if regions:
                await check_view(board, ref, "total", "total", regions[-1], rng)
    finally:
        await store.delete(board_id)


@pytest.mark.parametrize("shards", [1, 3, 16])
async def test_deep_pages_inside_a_large_tie_block(store: BoardStore, shards: int) -> None:
    """Hundreds of players on one exact score (same points, same second): pages inside that block
    are cut by player id, and still equal the reference order."""
    config = BoardConfig.from_dict(f"ties-{shards}", {"sharding": {"strategy": "hash", "shards": shards}})
    board, _ = await store.create(config)
    now = times.now_ms()
    ref = ReferenceBoard(config)
    scores = [Score(f"tied-{i:04d}", 500, f"m{i}", now) for i in range(400)]
    scores += [Score(f"above-{i}", 900 + i, f"a{i}", now) for i in range(30)]
    scores += [Score(f"below-{i}", i, f"b{i}", now) for i in range(30)]
    try:
        await board.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        want = expected_entries(ref, "total", None)
        board.shallow = 0
        for offset in (0, 25, 31, 100, 217, 399, 420, 455):
            assert await board.entries(offset, 7) == want[offset : offset + 7], offset
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("tied", [5, 40, 400])
@pytest.mark.parametrize("shards", [1, 3, 16])
async def test_ranks_and_neighbours_inside_tie_blocks(store: BoardStore, shards: int, tied: int) -> None:
    """A rank and an around are read in two rounds: the home shard's ZREVRANK, then each other
    shard's counts and its tie block, ordered locally when it is small (TIE_ROWS) and counted by
    counts.lua when not (around then reads by index). Blocks of 5, 40 and 400 players on one exact
    score, with players above and below, give the reference's ranks and neighbours everywhere."""
    config = BoardConfig.from_dict(
        f"tie-ranks-{shards}-{tied}", {"sharding": {"strategy": "hash", "shards": shards}}
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    ref = ReferenceBoard(config)
    scores = [Score(f"tied-{i:04d}", 500, f"m{i}", now) for i in range(tied)]
    scores += [Score(f"above-{i}", 900 + i % 7, f"a{i}", now) for i in range(30)]
    scores += [Score(f"below-{i}", i % 11, f"b{i}", now) for i in range(30)]
    rng = random.Random(f"{shards}/{tied}")
    try:
        await board.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        want = expected_entries(ref, "total", None)
        n = len(want)
        for e in rng.sample(want, min(60, n)):
            got = await board.player(e.player_id)
            assert (got.entry, got.players) == (e, n)
            for radius in (0, 1, 6):
                lo = max(0, e.rank - 1 - radius)
                assert await board.around(e.player_id, radius) == want[lo : e.rank + radius], radius
    finally:
        await store.delete(config.id)


async def test_a_rank_reads_a_tie_block_only_from_the_shards_that_count_one(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exact rank on a hash board asks the other shards for one-number replies only (ZCOUNT
    above the player's score, ZCOUNT at it, ZCARD), in the round after the home shard's; a tie
    block is read back, in one more round, only from a shard that counted rows at that very score
    (with that shard's count above and size again, in the same pipeline). Both kinds of player
    give the reference's rank and size."""
    config = BoardConfig.from_dict(
        board_name("tie-rounds"), {"durability": "memory", "sharding": {"strategy": "hash", "shards": 3}}
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    ref = ReferenceBoard(config)
    scores = [Score(f"solo-{i}", 1000 + i, f"s{i}", now) for i in range(30)]  # no two alike
    scores += [Score(f"tied-{i}", 500, f"t{i}", now) for i in range(12)]  # one exact score
    sent: list[list[str]] = []
    real = fanout._pipelines

    async def spy(sends: Any, timeout: float | None) -> Any:
        sent.append([str(c.args[0]).upper() for _, commands in sends for c in commands])
        return await real(sends, timeout)

    try:
        await board.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        want = {e.player_id: e for e in expected_entries(ref, "total", None)}
        view = board.resolve()
        tied_at = {board._home_index(f"tied-{i}", view) for i in range(12)}
        assert len(tied_at) > 1  # the tie block spreads over several shards
        monkeypatch.setattr(fanout, "_pipelines", spy)
        for player, rounds in (("solo-7", 2), ("tied-3", 3)):
            sent.clear()
            got = await board.player(player)
            assert (got.entry, got.players) == (want[player], len(want)), player
            assert len(sent) == rounds, (player, sent)
            assert set(sent[0]) == {"ZSCORE", "ZREVRANK", "ZCARD"}, sent
            assert set(sent[1]) == {"ZCOUNT", "ZCARD"} and sent[1].count("ZCOUNT") == 4, sent
            # The tie block, with the shard counted again at one moment (a row may move meanwhile).
            again = ["ZCOUNT", "ZRANGEBYSCORE", "ZCARD"] * (len(tied_at) - 1)
            assert sent[2:] in ([], [again]), sent
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("change", ["raised", "lowered"])
async def test_a_rank_counts_each_other_shard_at_one_moment_when_a_tied_row_moves_between_rounds(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """A shard's rows above the player and its rows tied ahead of them are counted at one moment:
    a row that moves between the round that counts the shard and the one that reads its tie block
    is counted once, as some order of the writes has it. Raised: a rival tied ahead of the player
    (the block counted) beats them before the block is read; in every order of the writes the rival
    is ahead, so the rank is 2, never 1. Lowered (a "set" board): a rival above (counted above) comes
    down to the player's very score, still ahead of them in the tie; the rank is 3 of 3 players,
    never 4 of 3."""
    mode = "best" if change == "raised" else "set"
    config = BoardConfig.from_dict(
        board_name(f"tie-moves-{change}"),
        {"durability": "memory", "mode": mode, "sharding": {"strategy": "hash", "shards": 2}},
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    view = board.resolve()
    # The player ("a..."), and rivals ("z...": later bytes, so ahead of them in a tie) homed on the
    # other shard.
    me = "a-player"
    home = board._home_index(me, view)
    rivals = [f"z-rival-{i}" for i in range(64) if board._home_index(f"z-rival-{i}", view) != home][:2]
    try:
        if change == "raised":
            mover, start, moved = rivals[0], 500, 600
            await board.submit([Score(me, 500, "m0", now), Score(mover, start, "m1", now)], now_ms=now)
            want = (2, 2)
        else:
            mover, start, moved = rivals[0], 600, 500
            # Its first row a second earlier: a "set" board keeps the later of two writes.
            first = [Score(me, 500, "m0", now), Score(mover, start, "m1", now - 1000)]
            first.append(Score(rivals[1], 500, "m2", now))
            await board.submit(first, now_ms=now)
            want = (3, 3)
        got = await board.player(me)
        assert (got.entry.rank, got.players) == want  # before any move
        real = reads.View._resolve_ties

        async def moved_between_rounds(self: reads.View, *args: Any) -> None:
            monkeypatch.setattr(reads.View, "_resolve_ties", real)
            await board.submit([Score(mover, moved, "m3", now)], now_ms=now)
            await real(self, *args)

        monkeypatch.setattr(reads.View, "_resolve_ties", moved_between_rounds)
        got = await board.player(me)
        assert (got.entry.rank, got.players) == want
        assert (await board.player(me)).entry.rank == want[0]  # after the move too
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("block", ["large", "grown"])
async def test_a_rank_counts_a_large_tie_block_and_its_shard_size_at_one_moment(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch, block: str
) -> None:
    """A shard whose tie block at the player's score holds more than TIE_ROWS rows is counted by
    counts.lua, and its size is taken in the same call: rows that reach that shard meanwhile are in
    both or in neither. Large: the block had 33 rows when round 2 counted it, and two rivals above
    the player arrive before round 3 counts it. Grown: the block had one row in round 2, 32 more
    arrive before round 3 reads it (now too large to read), and two rivals above before counts.lua
    counts it. In every order of the writes the player is last: rank 34 of 34 before the two, 36 of
    36 after them, never 36 of 34."""
    config = BoardConfig.from_dict(
        board_name(f"tie-large-{block}"),
        {"durability": "memory", "mode": "best", "sharding": {"strategy": "hash", "shards": 2}},
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    view = board.resolve()
    # The player ("a..."), and rivals ("z...": later bytes, so ahead of them in a tie) homed on the
    # other shard.
    me = "a-player"
    home = board._home_index(me, view)
    rivals = [f"z-rival-{i}" for i in range(400) if board._home_index(f"z-rival-{i}", view) != home]
    tied_first = reads.TIE_ROWS + 1 if block == "large" else 1
    tied = [Score(p, 500, f"t{i}", now) for i, p in enumerate(rivals[: reads.TIE_ROWS + 1])]
    above = [Score(p, 600, f"u{i}", now) for i, p in enumerate(rivals[reads.TIE_ROWS + 1 :][:2])]
    try:
        await board.submit([Score(me, 500, "m0", now), *tied[:tied_first]], now_ms=now)
        got = await board.player(me)
        assert (got.entry.rank, got.players) == (tied_first + 1, tied_first + 1)  # before any write
        resolve, count = reads.View._resolve_ties, reads.View._count_calls

        async def counted_after_writes(self: reads.View, *args: Any) -> list[Any]:
            monkeypatch.setattr(reads.View, "_count_calls", count)
            await board.submit(above, now_ms=now)  # two rivals above the player
            return await count(self, *args)

        async def tied_between_rounds(self: reads.View, *args: Any) -> None:
            monkeypatch.setattr(reads.View, "_resolve_ties", resolve)
            if tied[tied_first:]:  # the block grows past TIE_ROWS
                await board.submit(tied[tied_first:], now_ms=now)
            monkeypatch.setattr(reads.View, "_count_calls", counted_after_writes)
            await resolve(self, *args)

        monkeypatch.setattr(reads.View, "_resolve_ties", tied_between_rounds)
        got = await board.player(me)
        assert got.entry.rank <= got.players
        assert (got.entry.rank, got.players) == (reads.TIE_ROWS + 4, reads.TIE_ROWS + 4)
        got = await board.player(me)  # after the writes
        assert (got.entry.rank, got.players) == (reads.TIE_ROWS + 4, reads.TIE_ROWS + 4)
    finally:
        await store.delete(config.id)


async def test_a_rank_across_regions_counts_a_tied_shard_and_its_size_at_one_moment(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of a region board read across regions counts each key in one round, and a key with
    rows tied with the player again in a second (counts.lua); that key's size is taken in the same
    call, not beside the first round: two rivals above the player who reach the tied key between
    the rounds are in both the rank and ``players`` (4 of 4, as every order of the writes has it),
    never in the rank alone (4 of 2)."""
    config = BoardConfig.from_dict(
        board_name("tie-regions"),
        {
            "durability": "memory",
            "mode": "best",
            "sharding": {"strategy": "region", "regions": ["r0", "r1"], "shards_per_region": 1},
        },
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    me, rival = "a-player", "z-rival"  # the rival's later bytes put it ahead in a tie
    above = [Score(f"z-above-{i}", 600, f"u{i}", now, "r1") for i in range(2)]
    try:
        await board.submit([Score(me, 500, "m0", now, "r0"), Score(rival, 500, "m1", now, "r1")], now_ms=now)
        got = await board.player(me)
        assert (got.entry.rank, got.players) == (2, 2)  # before the two
        count = reads.View._count_calls

        async def counted_after_writes(self: reads.View, *args: Any) -> list[Any]:
            monkeypatch.setattr(reads.View, "_count_calls", count)
            await board.submit(above, now_ms=now)
            return await count(self, *args)

        monkeypatch.setattr(reads.View, "_count_calls", counted_after_writes)
        got = await board.player(me)
        assert got.entry.rank <= got.players
        assert (got.entry.rank, got.players) == (4, 4)
        assert reads.View._count_calls is count  # the tied key was counted again
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("shards", [3, 16])
async def test_top_reads_further_from_a_shard_that_holds_most_of_the_best(
    store: BoardStore, shards: int
) -> None:
    """A top n reads about 2 n / shards rows from each shard first; when one shard holds nearly the
    whole top (players that hash together), it must be read again, in rounds, until the answer is
    exact. Ties at the cut and fewer players than n are included."""
    config = BoardConfig.from_dict(f"skew-{shards}", {"sharding": {"strategy": "hash", "shards": shards}})
    board, _ = await store.create(config)
    now = times.now_ms()
    ref = ReferenceBoard(config)
    home = [f"star-{i}" for i in range(2000) if board.layout.home(f"star-{i}") == 0][:150]
    scores = [Score(p, 1000 + i % 40, f"s{i}", now) for i, p in enumerate(home)]  # ties every 40
    scores += [Score(f"rest-{i}", i % 900, f"r{i}", now) for i in range(300)]
    try:
        await board.submit(scores, now_ms=now)
        ref.submit(scores, now_ms=now)
        want = expected_entries(ref, "total", None)
        for n in (1, 10, 37, 100, 149, 150, 151, 400, len(want), len(want) + 9):
            assert await board.top(n) == want[:n], n
        assert await board.entries(120, 50) == want[120:170]  # a shallow page is a merged top too
    finally:
        await store.delete(config.id)


async def test_a_read_resolves_its_view_once(store: BoardStore) -> None:
    """Board.resolve turns (period, region) into the value every read takes and the router's caches
    key on: spellings of one period, and a region a board has no use for, give equal views."""
    now = times.parse("2026-11-30T05:00:00Z", "now")

    def board(sharding: dict[str, object], incarnation: str = "7") -> Board:
        config = BoardConfig.from_dict("views", {"periods": ["daily", "weekly"], "sharding": sharding})
        return Board(store.client, config, store.scripts, incarnation)

    def shard_keys(b: Board, shards: list[int], name: str) -> tuple[str, ...]:
        return tuple(keys.period_key(b.prefixes[s], name) for s in shards)

    hashed = board({"strategy": "hash", "shards": 4})
    week = hashed.resolve("weekly", now_ms=now)
    assert (week.board, week.period, week.api, week.region) == (
        "views",
        "w:2026-W49",
        "weekly:2026-W49",
        None,
    )
    assert week.keys == shard_keys(hashed, [0, 1, 2, 3], "w:2026-W49") and not week.banded
    assert hashed.resolve("weekly:2026-W49", "eu", now_ms=now) == week
    assert hashed.resolve("weekly:2026-W48", now_ms=now) != week
    assert board({"strategy": "hash", "shards": 4}, "8").resolve("weekly", now_ms=now) != week  # re-created
    assert hashed.resolve("daily", now_ms=now).api == "daily:2026-11-30"

    regional = board({"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2})
    na = regional.resolve("total", "na")
    assert (na.region, na.keys) == ("na", shard_keys(regional, [2, 3], "total"))
    assert regional.resolve().keys == shard_keys(regional, [0, 1, 2, 3], "total")
    with pytest.raises(InvalidInput) as err:
        regional.resolve("total", "mars")
    assert (err.value.field, err.value.code) == ("region", "invalid_region")

    banded = board({"strategy": "band", "bands": [0, 40, 120], "shards": 2})
    total = banded.resolve()
    assert total.banded and total.keys == shard_keys(banded, [4, 3, 2], "total")  # best band first
    daily = banded.resolve("daily", now_ms=now)
    assert not daily.banded and daily.keys == shard_keys(banded, [0, 1], "d:2026-11-30")
    with pytest.raises(InvalidInput) as err:
        banded.resolve("monthly")
    assert (err.value.field, err.value.code) == ("period", "invalid_period")


async def test_a_call_applies_alike_whether_its_items_go_as_a_stream_or_as_one_array(
    store: BoardStore,
) -> None:
    """write.lua takes a call's items as a stream of MessagePack values (one table sized once) up
    to STREAM_VALUES, else as one array (a Lua call returns at most 8,000 values): the calls on
    either side of the bound apply every result."""
    config = BoardConfig.from_dict("stream-bound", {"periods": [], "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    per = 6 + 1  # player, score, points, units, member, server_time, the total's key index
    below = [Score(f"a{i}", i % 500, f"m{i}", None) for i in range(STREAM_VALUES // per)]
    above = [Score(f"b{i}", i % 500, f"n{i}", None) for i in range(STREAM_VALUES // per + 1)]
    now = times.now_ms()
    try:
        for scores, stream in ((below, 1), (above, 0)):
            _, args = board._script_call(0, board.prepare(scores, now), now)
            header = list(msgpack.Unpacker(io.BytesIO(args[0])))
            assert header[24] == stream  # the header's 25th value says which
            got = await board.submit(scores, now_ms=now)
            assert [r.status for r in got] == ["improved"] * len(scores)
        entries = {e.player_id: e.points for e in await board.entries(0, 2 * len(above))}
        assert entries == {s.player_id: s.points for s in below + above}
    finally:
        await store.delete("stream-bound")


async def test_a_result_is_filed_in_the_periods_of_the_time_it_is_kept_with(store: BoardStore) -> None:
    """With resolution "s" and an epoch off a whole second (here .900), a result achieved in the
    first .9 s of a day is kept with a time in the day before (the codec counts whole seconds from
    the epoch). The live board filed it by the time sent, in the new day, while the archive,
    a rebuild and settlement file it by the time kept, in the day before: they disagreed. Now the
    live board files it by the time kept too."""
    config = BoardConfig.from_dict(
        board_name("epoch-fraction"), {"periods": ["daily"], "epoch": "2026-12-01T00:00:00.900Z"}
    )
    board, _ = await store.create(config)
    try:
        sent = times.parse("2026-12-05T00:00:00.100Z", "achieved_at")
        now = sent + 60_000
        [result] = await board.submit([Score("alice", 10, "m1", sent)], now_ms=now)
        assert result.status == "improved"
        before = await board.top(10, board.resolve("daily:2026-12-04", now_ms=now))
        after = await board.top(10, board.resolve("daily:2026-12-05", now_ms=now))
        assert [(e.player_id, times.format_ms(e.achieved_ms)) for e in before] == [
            ("alice", "2026-12-04T23:59:59.900Z")
        ]
        assert after == []
    finally:
        await store.delete(config.id)
