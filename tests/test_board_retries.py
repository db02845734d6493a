"""Writes that fail half way or are retried converge to the state of one call (issue 9, items 1 and 4).

Each test provokes the fault on a real cluster (a band call that fails once, a replay after the
period turned) and compares every read with the in-memory reference board fed each result once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from shardlb import keys, periods, times
from shardlb.board import Board, Score
from shardlb.config import PIN_SPAN, BoardConfig
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import expected_entries

pytestmark = pytest.mark.cluster

BANDS = [0, 100, 1000]


class FailOnce:
    """A script that raises the first time it is called, as a lost connection would, then works."""

    def __init__(self, script: Callable[..., Awaitable[Any]]) -> None:
        self.script = script
        self.failures = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures == 0:
            self.failures += 1
            raise ConnectionError("the band call was lost")
        return await self.script(*args, **kwargs)


def fail_band_once(board: Board) -> FailOnce:
    failing = FailOnce(board.scripts.band)
    board.scripts = dataclasses.replace(board.scripts, band=failing)
    return failing


async def assert_board_equals(board: Board, ref: ReferenceBoard) -> None:
    """Top, every page, every rank and the band shards' own rows agree with the reference."""
    want = expected_entries(ref, "total", None)
    assert await board.top(100) == want
    board.shallow = 0
    try:
        for offset in range(len(want) + 1):
            assert await board.entries(offset, 2) == want[offset : offset + 2], offset
    finally:
        board.shallow = 1000
    for e in want:
        got = await board.player(e.player_id)
        assert got.entry == e and got.players == len(want)
    rows: list[str] = []
    for prefix in board.prefixes[board.config.sharding.shards :]:
        rows += await board.client.zrange(keys.period_key(prefix, "total"), 0, -1)
    assert sorted(rows) == sorted(e.player_id for e in want)


async def band_board(store: BoardStore, name: str, mode: str = "best") -> tuple[Board, ReferenceBoard]:
    config = BoardConfig.from_dict(
        name, {"mode": mode, "sharding": {"strategy": "band", "bands": BANDS, "shards": 3}}
    )
    board, _ = await store.create(config)
    return board, ReferenceBoard(config)


async def test_a_band_move_that_failed_is_finished_by_the_retry(store: BoardStore) -> None:
    board, ref = await band_board(store, "retry-band-move")
    now = times.now_ms()
    try:
        first = [Score("p1", 50, "m1", now), Score("p2", 70, "m1", now)]
        await board.submit(first, now_ms=now)
        ref.submit(first, now_ms=now)

        moving = [Score("p1", 500, "m2", now)]  # band 0 -> band 1
        failing = fail_band_once(board)
        with pytest.raises(ConnectionError):
            await board.submit(moving, now_ms=now)
        assert failing.failures == 1
        got = await board.submit(moving, now_ms=now)  # the client's retry
        ref.submit(moving, now_ms=now)
        assert got[0].points == 500
        await assert_board_equals(board, ref)

        later = [Score("p1", 5000, "m3", now)]  # band 1 -> band 2: no stale row may stay behind
        await board.submit(later, now_ms=now)
        ref.submit(later, now_ms=now)
        await assert_board_equals(board, ref)
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_band_move_that_failed_is_finished_by_the_next_write(store: BoardStore, mode: str) -> None:
    board, ref = await band_board(store, f"next-band-move-{mode}", mode)
    now = times.now_ms()
    try:
        await board.submit([Score("p1", 50, "m1", now)], now_ms=now)
        ref.submit([Score("p1", 50, "m1", now)], now_ms=now)
        fail_band_once(board)
        with pytest.raises(ConnectionError):
            await board.submit([Score("p1", 600, "m2", now + 1000)], now_ms=now + 1000)
        ref.submit([Score("p1", 600, "m2", now + 1000)], now_ms=now + 1000)
        # Another player's write on the same home shard, then the player's own unchanged result.
        other = next(f"o{i}" for i in range(100) if board.layout.home(f"o{i}") == board.layout.home("p1"))
        for s in (Score(other, 20, "m3", now + 2000), Score("p1", 0 if mode == "incr" else 1, "m4", now)):
            await board.submit([s], now_ms=now + 2000)
            ref.submit([s], now_ms=now + 2000)
        await assert_board_equals(board, ref)
    finally:
        await store.delete(board.config.id)


async def test_repair_finishes_a_move_nobody_retried(store: BoardStore) -> None:
    board, ref = await band_board(store, "repair-band-move")
    now = times.now_ms()
    try:
        await board.submit([Score("p1", 50, "m1", now), Score("p2", 500, "m1", now)], now_ms=now)
        ref.submit([Score("p1", 50, "m1", now), Score("p2", 500, "m1", now)], now_ms=now)
        fail_band_once(board)
        with pytest.raises(ConnectionError):
            await board.submit([Score("p1", 5000, "m2", now)], now_ms=now)
        ref.submit([Score("p1", 5000, "m2", now)], now_ms=now)
        assert await board.repair() == 1
        await assert_board_equals(board, ref)
        assert await board.repair() == 0  # nothing is left pending
    finally:
        await store.delete(board.config.id)


# ---- retries without achieved_at (item 4) -------------------------------------------------------


def _midnight_after(now: int) -> int:
    day = 86_400_000
    return (now // day + 1) * day


def _next_midnight() -> int:
    """The coming midnight (UTC). The tests' simulated times lie around it, at most a day before or
    after: Redis expires keys by its own clock, and a pin or dedup bucket written for a time a day
    past would be gone at once (the last midnight made such a test fail late in the day)."""
    return _midnight_after(times.now_ms())


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_retry_without_achieved_at_lands_where_the_first_call_did(
    store: BoardStore, mode: str
) -> None:
    """The first call is made a second before midnight UTC, the retry two seconds later: the retry
    must change nothing, neither the next day's board nor (in ``set``) a newer result."""
    name = f"pin-{mode}"
    config = BoardConfig.from_dict(name, {"mode": mode, "periods": ["daily"]})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    midnight = _next_midnight()
    before, newer, after = midnight - 1000, midnight - 500, midnight + 1000
    first = Score("p1", 300, "match-a", None)
    try:
        await board.submit([first], now_ms=before)
        ref.submit([first], now_ms=before)
        second = Score("p1", 100, "match-b", None)  # a newer (worse) result, also without a time
        await board.submit([second], now_ms=newer)
        ref.submit([second], now_ms=newer)
        replay = await board.submit([first], now_ms=after)  # the retry of match-a
        assert replay[0].status in ("unchanged", "duplicate")
        assert replay[0].points == ref.boards["total"]["p1"][0]
        want = expected_entries(ref, "total", None)
        assert await board.top(10) == want
        today = periods.names_at(after, config.periods, board.tz)[1]
        assert await board.top(10, board.resolve("daily:" + today[2:])) == []
        yesterday = periods.names_at(before, config.periods, board.tz)[1]
        assert await board.top(10, board.resolve("daily:" + yesterday[2:])) == expected_entries(
            ref, yesterday, None
        )
    finally:
        await store.delete(name)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_retry_prepared_before_midnight_and_applied_after_lands_only_where_its_pin_is(
    store: BoardStore, mode: str
) -> None:
    """The router prepares a result when its request comes and the coalescer applies it later: a
    retry prepared at 23:59:59.990 and applied at 00:00:00.005, whose pair another router had
    pinned at 00:00:00.001, was applied with its pinned time to the keys of its own preparing
    (yesterday's board) and counted in two days (a write-path audit's finding)."""
    name = f"pin-late-{mode}"
    config = BoardConfig.from_dict(name, {"mode": mode, "periods": ["daily"]})
    board, _ = await store.create(config)
    midnight = _next_midnight()
    try:
        first = board.prepare([Score("p1", 10, "m1")], now_ms=midnight + 1)
        await board.apply_shard(first[0].shard, first, now_ms=midnight + 1)
        late = board.prepare([Score("p1", 10, "m1")], now_ms=midnight - 10)
        got = await board.apply_shard(late[0].shard, late, now_ms=midnight + 5)
        assert got[0].status in ("unchanged", "duplicate")
        days = [periods.names_at(t, config.periods, board.tz)[1][2:] for t in (midnight - 10, midnight + 1)]
        assert [e.player_id for e in await board.top(10, board.resolve("daily:" + days[1]))] == ["p1"]
        assert await board.top(10, board.resolve("daily:" + days[0])) == []
    finally:
        await store.delete(name)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_pin_taken_by_a_router_ahead_is_found_through_a_router_behind(
    store: BoardStore, mode: str
) -> None:
    """Router A, its clock 20 ms ahead, pins the pair at 00:00:00.020, in the pin span that begins
    at midnight; the retry through router B, whose clock still reads 23:59:59.990, must find that
    pin as dedup finds a record in the next bucket, not be applied with its own time to the day
    before (a write-path audit's finding)."""
    name = f"pin-clocks-{mode}"
    config = BoardConfig.from_dict(name, {"mode": mode, "periods": ["daily"]})
    board, _ = await store.create(config)
    midnight = _next_midnight()
    assert midnight // config.dedup_bucket_ms % PIN_SPAN == 0  # a pin span begins at midnight
    try:
        first = board.prepare([Score("p1", 10, "m1")], now_ms=midnight + 20)
        await board.apply_shard(first[0].shard, first, now_ms=midnight + 20)
        retry = board.prepare([Score("p1", 10, "m1")], now_ms=midnight - 10)
        got = await board.apply_shard(retry[0].shard, retry, now_ms=midnight - 10)
        assert got[0].status in ("unchanged", "duplicate")
        days = [periods.names_at(t, config.periods, board.tz)[1][2:] for t in (midnight - 10, midnight + 20)]
        assert [e.player_id for e in await board.top(10, board.resolve("daily:" + days[1]))] == ["p1"]
        assert await board.top(10, board.resolve("daily:" + days[0])) == []
    finally:
        await store.delete(name)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_same_day_retry_without_achieved_at_takes_one_script_call(
    store: BoardStore, mode: str
) -> None:
    """A retry whose first server time goes to the same periods as now is applied by write.lua
    with that time in the same call (it used to answer ``p`` and be sent again): one call, the
    statuses and the board of one call. A retry from before midnight still takes the second call
    (test_a_retry_without_achieved_at_lands_where_the_first_call_did)."""
    name = f"pin-once-{mode}"
    config = BoardConfig.from_dict(name, {"mode": mode, "periods": ["daily"], "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    first_at = _midnight_after(times.now_ms()) - 86_400_000 + 3_600_000  # 01:00 of the last day begun
    first = [Score("p1", 300, "match-a", None), Score("p2", 200, "match-a", None)]
    calls = 0
    write = board.scripts.write

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return await write(*args, **kwargs)

    board.scripts = dataclasses.replace(board.scripts, write=counted)
    try:
        await board.submit(first, now_ms=first_at)
        ref.submit(first, now_ms=first_at)
        later = Score("p3", 250, "match-b", None)
        calls = 0
        retry_at = first_at + 40 * 60_000  # another quarter hour of the same day
        got = await board.submit([*first, later], now_ms=retry_at)
        want = ref.submit([later], now_ms=retry_at)  # the reference is fed each result once
        assert calls == 1
        again = "duplicate" if mode == "incr" else "unchanged"
        assert [(r.status, r.points) for r in got] == [
            *((again, ref.boards["total"][s.player_id][0]) for s in first),
            *want,
        ]
        assert await board.top(10) == expected_entries(ref, "total", None)
        day = periods.names_at(first_at, config.periods, board.tz)[1]
        assert await board.top(10, board.resolve("daily:" + day[2:])) == expected_entries(ref, day, None)
    finally:
        await store.delete(name)


async def test_dedup_and_pin_buckets_are_named_expire_and_are_indexed_as_the_library_says(
    store: BoardStore,
) -> None:
    """write.lua builds the bucket names itself from the shard's prefix: they are the names of
    keys.dedup_key and keys.pin_key (which the reshard copier, rebuild and drop find through the
    key index). A dedup set expires one window after its bucket ends, a pin hash (PIN_SPAN buckets,
    named by its first) one window after its last bucket ends; each is listed in the index at that
    time, and a retry a bucket later (the span first..current) still finds the first call's record."""
    config = BoardConfig.from_dict("buckets-named", {"mode": "incr", "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    client = store.client
    b, window = config.dedup_bucket_ms, config.dedup_window_s * 1000
    now = times.now_ms()
    prefix = board.prefixes[0]
    try:
        [first] = await board.submit([Score("p1", 5, "m1", None)], now_ms=now)
        assert first.status == "improved"
        k = now // b
        start = k - k % PIN_SPAN
        member = "m1\x00p1"
        index = keys.index_key(prefix)
        for name, expires in (
            (keys.dedup_key(prefix, k), (k + 1) * b + window),
            (keys.pin_key(prefix, start), (start + PIN_SPAN) * b + window),
        ):
            assert await client.exists(name) == 1, name
            assert await client.pexpiretime(name) == expires
            assert await client.zscore(index, name) == expires
        assert await client.sismember(keys.dedup_key(prefix, k), member)
        assert await client.hget(keys.pin_key(prefix, start), member) is not None
        # A new board has no pin hash of another span: its marker says so, kept while the board is.
        marker = keys.pin_span_key(prefix)
        assert await client.get(marker) == f"{PIN_SPAN}:0"
        assert await client.zscore(index, marker) == float("inf")
        [again] = await board.submit([Score("p1", 5, "m1", None)], now_ms=now + b)  # a bucket later
        assert again.status == "duplicate" and again.points == 5
        assert await client.exists(keys.dedup_key(prefix, k + 1)) == 0  # nothing new was recorded
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_large_call_of_timeless_retries_and_repeats_is_looked_up_once_per_member(
    store: BoardStore, mode: str
) -> None:
    """write.lua asks each bucket about all of a call's members at once, in chunks of 1,000. A call
    of 2,510 results on one shard: 1,200 timeless retries of a call made before midnight, 1,300 new
    results and 10 repeats of those new ones inside the call. Every retry must land where its first
    call did, every repeat must see its first occurrence, across the chunk boundaries."""
    name = f"pin-many-{mode}"
    config = BoardConfig.from_dict(name, {"mode": mode, "periods": ["daily"], "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    midnight = _next_midnight()
    before, after = midnight - 1000, midnight + 1000
    old = [Score(f"p{i}", 1, f"a{i}", None) for i in range(1200)]
    new = [Score(f"p{i}", 2, f"b{i}", None) for i in range(1300)]
    try:
        assert {r.status for r in await board.submit(old, now_ms=before)} == {"improved"}
        got = await board.submit(old + new + new[:10], now_ms=after)
        statuses = [r.status for r in got]
        if mode == "incr":
            assert statuses == ["duplicate"] * 1200 + ["improved"] * 1300 + ["duplicate"] * 10
            want_total = {f"p{i}": (3 if i < 1200 else 2) for i in range(1300)}
        else:
            assert statuses == ["unchanged"] * 1200 + ["improved"] * 1300 + ["unchanged"] * 10
            want_total = {f"p{i}": 2 for i in range(1300)}
        total = {e.player_id: e.points for e in await board.entries(0, 2000)}
        assert total == want_total
        yesterday = periods.names_at(before, config.periods, board.tz)[1]
        today = periods.names_at(after, config.periods, board.tz)[1]
        days = [board.resolve("daily:" + name[2:]) for name in (yesterday, today)]
        y, t = [{e.player_id: e.points for e in await board.entries(0, 2000, day)} for day in days]
        assert y == {f"p{i}": 1 for i in range(1200)}
        assert t == {f"p{i}": 2 for i in range(1300)}
    finally:
        await store.delete(name)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_retry_almost_a_window_later_finds_a_pin_whose_hash_began_before_the_window(
    store: BoardStore, mode: str
) -> None:
    """A pin hash is named by the first bucket of its span, which may lie before the window's first
    bucket while the pin itself lies inside the window: the first call is made in the last bucket of
    a span, before midnight, and its retry, after midnight, just under one window later."""
    name = f"pin-late-{mode}"
    config = BoardConfig.from_dict(name, {"mode": mode, "periods": ["daily"], "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    b, window = config.dedup_bucket_ms, config.dedup_window_s * 1000
    midnight = _next_midnight()
    k = (midnight - window // 2) // b
    k += PIN_SPAN - 1 - k % PIN_SPAN  # the last bucket of its span, half a window before midnight
    before = k * b + b // 2
    after = before + window - 1000
    assert after > midnight and (after - window) // b > k - k % PIN_SPAN  # the hash began before the window
    first = Score("p1", 300, "match-a", None)
    newer = Score("p1", 100, "match-b", None)
    try:
        await board.submit([first], now_ms=before)
        ref.submit([first], now_ms=before)
        await board.submit([newer], now_ms=before + 1000)
        ref.submit([newer], now_ms=before + 1000)
        [replay] = await board.submit([first], now_ms=after)
        assert replay.status == "unchanged"
        assert await board.top(10) == expected_entries(ref, "total", None)
        today = periods.names_at(after, config.periods, board.tz)[1]
        assert await board.top(10, board.resolve("daily:" + today[2:])) == []
    finally:
        await store.delete(name)


async def test_pins_written_one_hash_per_bucket_are_found_until_they_expire(store: BoardStore) -> None:
    """Before PIN_SPAN, each bucket had its own pin hash. A shard holding such hashes (listed in its
    key index) reads every bucket's own name until one window after its first call with the span:
    a retry of a result pinned the old way lands where its first call did."""
    name = "pin-legacy"
    config = BoardConfig.from_dict(name, {"mode": "best", "periods": ["daily"], "sharding": {"shards": 1}})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    client = store.client
    prefix = board.prefixes[0]
    b, window = config.dedup_bucket_ms, config.dedup_window_s * 1000
    midnight = _next_midnight()
    k = (midnight - 1000) // b
    if k % PIN_SPAN == 0:
        k -= 1  # a bucket that starts no span: only its own name finds it
    before = k * b + b // 2
    after = midnight + 1000
    first = Score("p1", 300, "match-a", None)
    try:
        # The first call as the former script made it: the pin in the bucket's own hash, listed.
        old = keys.pin_key(prefix, k)
        units = (before - board.codec.epoch_ms) // board.codec.unit_ms
        await client.hset(old, "match-a\x00p1", units)
        await client.zadd(keys.index_key(prefix), {old: (k + 1) * b + window})
        await client.pexpireat(old, (k + 1) * b + window)
        await board.submit([Score("p1", 300, "match-a", before)], now_ms=before)
        ref.submit([Score("p1", 300, "match-a", before)], now_ms=before)
        [replay] = await board.submit([first], now_ms=after)  # the retry, without its time
        assert replay.status == "unchanged"
        assert await board.top(10) == expected_entries(ref, "total", None)
        today = periods.names_at(after, config.periods, board.tz)[1]
        assert await board.top(10, board.resolve("daily:" + today[2:])) == []
        legacy = after // b + window // b
        assert await client.get(keys.pin_span_key(prefix)) == f"{PIN_SPAN}:{legacy}"
    finally:
        await store.delete(name)


async def test_the_index_drops_listings_of_expired_keys_once_a_second(store: BoardStore) -> None:
    """write.lua drops the key index's listings of keys expired by Redis's clock when the caller
    asks, and the library asks on its first call a second a shard: a listing of an expired key lasts
    at most until the next second's first write, and the calls in between skip the command."""
    config = BoardConfig.from_dict("index-trim", {"sharding": {"strategy": "hash", "shards": 1}})
    board, _ = await store.create(config)
    client, index = store.client, keys.index_key(board.prefixes[0])
    now = (times.now_ms() // 1000 + 1) * 1000  # the start of a second: the calls below share it
    gone = now - 2000  # expired by Redis's clock too (``now`` is up to a second ahead of it)
    try:
        await client.zadd(index, {board.prefixes[0] + "gone:1": gone})
        await board.submit([Score("a", 1, "m1", now)], now_ms=now)  # the second's first call
        assert await client.zscore(index, board.prefixes[0] + "gone:1") is None
        await client.zadd(index, {board.prefixes[0] + "gone:2": gone})
        await board.submit([Score("b", 2, "m2", now + 10)], now_ms=now + 10)  # same second: kept
        assert await client.zscore(index, board.prefixes[0] + "gone:2") == gone
        await board.submit([Score("c", 3, "m3", now + 1000)], now_ms=now + 1000)  # the next second
        assert await client.zscore(index, board.prefixes[0] + "gone:2") is None
        assert await client.zscore(index, keys.period_key(board.prefixes[0], "total")) == float("inf")
    finally:
        await store.delete(config.id)
