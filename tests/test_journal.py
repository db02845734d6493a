"""The journal agrees with the board (issue 11, item 1): replaying every shard's journal into the
reference board gives exactly what the cluster's board shows, for every mode and strategy, with
retries, duplicates, overflows and region conflicts in the workload; and a full journal refuses
the whole call, applying nothing."""

from __future__ import annotations

import random

import msgpack
import pytest

from shardlb import keys, moderation, periods, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import connect
from shardlb.errors import Overloaded
from shardlb.journal import GROUP, decode, journal_lag
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import HOUR, expected_entries, sharding

pytestmark = pytest.mark.cluster


async def journal_of(board: Board, url: str) -> list[Score]:
    """Every journaled result of the board, as the Scores that would apply it again."""
    raw = connect(url, decode=False)
    codec, layout = board.codec, board.layout
    out = []
    try:
        for shard, prefix in enumerate(board.prefixes):
            for entry_id, fields in await raw.xrange(keys.journal_key(prefix)):
                entry = decode(entry_id, fields)
                assert (entry.board, entry.incarnation, entry.shard) == (
                    board.config.id,
                    board.incarnation,
                    shard,
                )
                region = None
                if layout.strategy == "region":
                    region = layout.sharding.regions[shard // layout.sharding.shards_per_region]
                for r in entry.results:
                    achieved = codec.epoch_ms + r.units * codec.unit_ms
                    out.append(Score(r.player_id, r.points, r.match_id, achieved, region))
    finally:
        await raw.aclose()
    return out


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize("strategy", ["hash", "region", "band"])
async def test_replaying_the_journal_gives_the_board(
    store: BoardStore, cluster_url: str, strategy: str, mode: str
) -> None:
    rng = random.Random(f"journal/{strategy}/{mode}")
    config = BoardConfig.from_dict(
        f"journal-{strategy}-{mode}",
        {"mode": mode, "periods": ["daily"], "points_max": 500, "sharding": sharding(strategy, 3)},
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    regions = list(config.sharding.regions)
    players = [f"p{i:02d}" for i in range(40)]
    sent: list[Score] = []
    try:
        for batch_no in range(5):
            where = {p: rng.choice(regions) for p in players} if regions else {}
            batch = []
            for _ in range(40):
                if sent and rng.random() < 0.2:
                    old = rng.choice(sent)
                    batch.append(old._replace(region=where.get(old.player_id)))
                    continue
                player = rng.choice(players)
                at = None if rng.random() < 0.2 else now - rng.choice([0, 1, 30]) * HOUR
                batch.append(
                    Score(player, rng.randrange(0, 300), f"m{batch_no}-{len(sent)}", at, where.get(player))
                )
                sent.append(batch[-1])
            await board.submit(batch, now_ms=now + batch_no)
        replayed = ReferenceBoard(config)
        replayed.submit(await journal_of(board, cluster_url), now_ms=now)
        want = expected_entries(replayed, "total", None)
        assert want and await board.top(len(want) + 5) == want
        day = periods.names_at(now - 30 * HOUR, config.periods, board.tz)[1]
        want_day = expected_entries(replayed, day, None)
        assert await board.top(len(want_day) + 5, board.resolve("daily:" + day[2:])) == want_day
    finally:
        await store.delete(config.id)


async def test_a_full_journal_refuses_the_whole_call(store: BoardStore) -> None:
    config = BoardConfig.from_dict("journal-full", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max = 2
    now = times.now_ms()
    try:
        await board.submit([Score("a", 1, "m1", now)], now_ms=now)
        await board.submit([Score("b", 2, "m2", now)], now_ms=now)
        with pytest.raises(Overloaded):
            await board.submit([Score("c", 3, "m3", now), Score("a", 9, "m3", now)], now_ms=now)
        assert [(e.player_id, e.points) for e in await board.top(10)] == [("b", 2), ("a", 1)]
        board.journal_max = 3
        await board.submit([Score("c", 3, "m3", now)], now_ms=now)
        assert await board.size() == 3
    finally:
        await store.delete(config.id)


async def test_the_results_bound_counts_results_not_entries(store: BoardStore, cluster_url: str) -> None:
    """SHARDLB_JOURNAL_MAX_RESULTS: a shard whose journal holds that many results not yet archived
    refuses the whole next call, however few entries hold them; acknowledging entries (ack.lua, as
    the archiver does) makes room again, each entry counted once however often it is acknowledged."""
    config = BoardConfig.from_dict("journal-results", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max_results = 4
    raw = connect(cluster_url, decode=False)
    key = keys.journal_key(board.prefixes[0])
    counts = keys.journal_counts_key(board.prefixes[0])
    now = times.now_ms()
    try:
        await board.submit([Score(f"a{i}", i, "m1", now) for i in range(3)], now_ms=now)  # one entry
        assert (await journal_lag(raw, key)).results == 3
        await board.submit([Score("b", 7, "m2", now)], now_ms=now)  # 3 < 4: applied, and now at 4
        lag = await journal_lag(raw, key)
        assert (lag.entries, lag.results) == (2, 4)
        with pytest.raises(Overloaded):
            await board.submit([Score("c", 9, "m3", now)], now_ms=now)
        assert await board.size() == 4
        # acknowledged as the archiver does: the first entry's 3 results are archived
        await raw.xgroup_create(key, GROUP, id="0")
        delivered = await raw.xreadgroup(GROUP, "t", {key: ">"}, count=1)
        entry = decode(*delivered[0][1][0])
        assert entry.counted == 3
        for _ in range(2):  # a retried ack counts it once
            await store.scripts.ack(keys=[key, counts], args=[GROUP, entry.id, str(entry.counted)])
        assert (await journal_lag(raw, key)).results == 1
        await board.submit([Score("c", 9, "m3", now)], now_ms=now)
        assert await board.size() == 5
    finally:
        await raw.aclose()
        await store.delete(config.id)
    # acknowledging after the board is gone writes no stray counts key
    await store.scripts.ack(keys=[key, counts], args=[GROUP, "1-0", "5"])
    assert not await store.client.exists(counts)


async def test_a_full_journal_refuses_a_removal_and_a_delete_entry_counts_its_players(
    store: BoardStore, cluster_url: str
) -> None:
    """A removal journals a delete entry, so it is held to the journal's bounds as a write is: at
    either bound it is refused (Overloaded, 503 over HTTP) before anything is removed or journaled,
    and a delete entry's players count against the results bound until the archiver acknowledges
    it. Until 2026-12-05 remove.lua appended its entry whatever the bounds: removals (of players
    present or not) grew a full journal without end while the archive was away."""
    config = BoardConfig.from_dict("journal-removals", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max_results = 3
    raw = connect(cluster_url, decode=False)
    key = keys.journal_key(board.prefixes[0])
    counts = keys.journal_counts_key(board.prefixes[0])
    now = times.now_ms()
    try:
        await board.submit([Score("a", 1, "m1", now), Score("b", 2, "m1", now)], now_ms=now)
        assert await moderation.remove(board, ["a"], now_ms=now) == {"a"}  # 2 < 3: taken, now at 3
        lag = await journal_lag(raw, key)
        assert (lag.entries, lag.results) == (2, 3)
        for players in (["b"], ["nobody"]):
            with pytest.raises(Overloaded):
                await moderation.remove(board, players, now_ms=now)
        assert [e.player_id for e in await board.top(10)] == ["b"]
        assert (await journal_lag(raw, key)).entries == 2
        # the archiver acknowledges the delete entry by its count: room for the removal again
        await raw.xgroup_create(key, GROUP, id="0")
        delivered = await raw.xreadgroup(GROUP, "t", {key: ">"})
        entry = decode(*delivered[0][1][1])
        assert (entry.removed, entry.counted) == (("a",), 1)
        await store.scripts.ack(keys=[key, counts], args=[GROUP, entry.id, str(entry.counted)])
        assert await moderation.remove(board, ["b"], now_ms=now) == {"b"}
        # the entries bound holds for removals too
        board.journal_max = 3
        with pytest.raises(Overloaded):
            await moderation.remove(board, ["nobody"], now_ms=now)
        assert (await journal_lag(raw, key)).entries == 3
    finally:
        await raw.aclose()
        await store.delete(config.id)


async def test_an_empty_journal_sets_its_results_count_right(store: BoardStore, cluster_url: str) -> None:
    """A count that drifted (entries journaled before entries carried their count, a consumer group
    made again) is set right by the first write to an empty journal: nothing is left to archive."""
    config = BoardConfig.from_dict("journal-drift", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    board.journal_max_results = 4
    raw = connect(cluster_url, decode=False)
    key = keys.journal_key(board.prefixes[0])
    now = times.now_ms()
    try:
        await board.submit([Score("a", 1, "m1", now)], now_ms=now)
        await raw.xtrim(key, maxlen=0, approximate=False)  # archived and trimmed, but never counted
        await store.client.set(keys.journal_counts_key(board.prefixes[0]), 40)
        await board.submit([Score("b", 2, "m2", now)], now_ms=now)  # not refused: the journal was empty
        assert (await journal_lag(raw, key)).results == 1
    finally:
        await raw.aclose()
        await store.delete(config.id)


async def test_a_recount_sets_a_drifted_count_to_the_results_not_acknowledged(
    store: BoardStore, cluster_url: str
) -> None:
    """recount.lua: the results of the entries not acknowledged (pending, or never delivered), each
    by its n, whatever the count said; acknowledged entries not trimmed yet are not counted, and a
    journal longer than the limit is left for later."""
    config = BoardConfig.from_dict("journal-recount", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    raw = connect(cluster_url, decode=False)
    key, counts = keys.journal_key(board.prefixes[0]), keys.journal_counts_key(board.prefixes[0])
    now = times.now_ms()

    async def recount(limit: int = 100) -> int:
        return int(await store.scripts.recount(keys=[key, counts], args=[GROUP, limit]))

    try:
        for match, size in (("m1", 2), ("m2", 3), ("m3", 1)):  # three entries, six results
            await board.submit([Score(f"{match}p{i}", i, match, now) for i in range(size)], now_ms=now)
        await store.client.set(counts, 999)  # drifted
        assert await recount() == 6 and int(await store.client.get(counts)) == 6  # no group yet: all
        await raw.xgroup_create(key, GROUP, id="0")
        [[_, [first]]] = await raw.xreadgroup(GROUP, "t", {key: ">"}, count=1)
        await store.scripts.ack(keys=[key, counts], args=[GROUP, decode(*first).id, "2"])
        assert int(await store.client.get(counts)) == 4
        await raw.xreadgroup(GROUP, "t", {key: ">"}, count=1)  # the 3-result entry, pending
        await store.client.set(counts, 100)
        assert await recount() == 4  # 3 pending + 1 never delivered; the acknowledged 2 not counted
        assert await recount(limit=1) == -1 and int(await store.client.get(counts)) == 4
        lag = await journal_lag(raw, key)
        assert (lag.entries, lag.results) == (3, 4)  # the acknowledged entry is still there, untrimmed
    finally:
        await raw.aclose()
        await store.delete(config.id)
    assert await recount() == -1  # the board is gone: nothing is set, no key comes back
    assert not await store.client.exists(counts)


async def test_a_memory_board_keeps_no_journal(store: BoardStore, cluster_url: str) -> None:
    config = BoardConfig.from_dict(
        "journal-none", {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    )
    board, _ = await store.create(config)
    now = times.now_ms()
    try:
        await board.submit([Score(f"p{i}", i, "m", now) for i in range(10)], now_ms=now)
        assert await board.size() == 10
        assert await journal_of(board, cluster_url) == []
    finally:
        await store.delete(config.id)


def test_a_delete_entry_names_the_periods_its_removal_left_whole() -> None:
    """`a` (remove.lua, since 2026-12-05): per player, the periods their entry stayed in. An entry
    without it, as every one journaled before, left none (``kept_in`` None), as it meant then."""
    head = {b"b": b"board", b"i": b"inc", b"s": b"0", b"n": b"2", b"x": msgpack.packb(["p", "q"])}
    old = decode(b"5-0", head)
    assert old.kept == () and old.kept_in("p") is None and old.kept_in("q") is None
    new = decode(b"6-0", {**head, b"a": msgpack.packb(["p", "total,d:2026-12-03"])})
    assert new.kept_in("p") == frozenset({"total", "d:2026-12-03"}) and new.kept_in("q") is None
