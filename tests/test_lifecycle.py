"""The period lifecycle on the write path (issue 12, item 1), against the real cluster and the
reference board: a frozen period takes no result whatever the writer's clock says, a period past
its end plus ``close_grace`` takes no late result, both still count in the total and the periods
still open, the results say which periods they missed, and the journal says exactly what was applied.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from shardlb import keys, periods, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.connection import connect
from shardlb.errors import BoardNotFound, InvalidInput
from shardlb.journal import Applied, decode
from shardlb.rebuild import Rebuilder
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import HOUR, expected_entries, sharding
from tests.test_rebuild import archiver, damage, drain

pytestmark = pytest.mark.cluster

DAY = 24 * HOUR


async def assert_matches(board: Board, ref: ReferenceBoard, names: list[str]) -> None:
    for name in names:
        view = board.resolve(periods.api_name(name))
        assert await board.top(1000, view) == expected_entries(ref, name, None), name


async def journaled(board: Board, url: str) -> list[Applied]:
    raw = connect(url, decode=False)
    try:
        return [
            r
            for prefix in board.prefixes
            for entry_id, fields in await raw.xrange(keys.journal_key(prefix))
            for r in decode(entry_id, fields).results
        ]
    finally:
        await raw.aclose()


def workload(board: Board, rng: random.Random, tag: str, at: list[int], n: int = 40) -> list[Score]:
    regions = board.layout.sharding.regions
    out = []
    for i in range(n):
        player = rng.randrange(25)
        region = regions[player % len(regions)] if regions else None
        out.append(
            Score(
                f"p{player:02d}",
                rng.randrange(0, 60),
                f"{tag}-{i}-{rng.randrange(3)}",
                rng.choice(at),
                region,
            )
        )
    return out


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
@pytest.mark.parametrize("strategy", ["hash", "region", "band"])
async def test_a_frozen_period_never_changes(
    store: BoardStore, cluster_url: str, strategy: str, mode: str
) -> None:
    rng = random.Random(f"freeze/{strategy}/{mode}")
    config = BoardConfig.from_dict(
        f"freeze-{strategy}-{mode}",
        {
            "mode": mode,
            "periods": ["daily", "weekly"],
            "points_max": 10_000,
            "sharding": sharding(strategy, 3),
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    day, week = periods.names_at(now, config.periods, board.tz)[1:]
    at = [now, now - 1000, now - 2000]
    try:
        first = workload(board, rng, "a", at)
        await board.submit(first, now_ms=now)
        ref.submit(first, now_ms=now)
        before = await board.top(1000, board.resolve(periods.api_name(day)))
        assert before and not await board.frozen(day)

        assert await board.freeze(day, now_ms=now) == len(board.prefixes)
        assert await board.frozen(day)
        assert await board.freeze(day, now_ms=now) == 0  # a repeat changes nothing
        ref.frozen.add(day)

        # The writers' clock still says the day is open: the marker alone keeps it unchanged.
        late = set()
        for n in range(3):
            second = workload(board, rng, f"b{n}", at) + first[:5]  # new results and replays
            late |= {(s.match_id, s.player_id) for s in second}
            got = await board.submit(second, now_ms=now)
            want = ref.submit(second, now_ms=now)
            assert [(r.status, r.points) for r in got] == want
            assert [r.closed for r in got] == ref.closed
            assert any(r.closed == (periods.api_name(day),) for r in got)
        assert await board.top(1000, board.resolve(periods.api_name(day))) == before
        await assert_matches(board, ref, ["total", day, week])

        # The journal holds each applied result once, with the frozen day among its skipped periods
        # exactly when it was applied after the freeze.
        applied = await journaled(board, cluster_url)
        assert {r.skipped for r in applied if (r.match_id, r.player_id) not in late} <= {()}
        assert any(r.skipped == (day,) for r in applied)
    finally:
        await store.delete(config.id)


async def test_a_late_result_counts_in_the_total_and_the_open_periods(
    store: BoardStore, cluster_url: str
) -> None:
    """Past its end plus close_grace a day takes nothing more; the week it belongs to, still open,
    takes the result, and so does the total. A retry leaves the board as one call did."""
    achieved = times.now_ms()
    # The week starts today, so it stays open when today closes (writes below pass a clock
    # after today's end: a period closes by the writer's clock, and its keys expire days later).
    today = periods.local_day(achieved, periods.zone("UTC"))
    config = BoardConfig.from_dict(
        "late-results",
        {
            "periods": ["daily", "weekly"],
            "close_grace": 600,
            "mode": "incr",
            "week_start": periods.WEEKDAYS[today.weekday()],
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    yesterday = periods.names_at(achieved, config.periods, board.tz)[1]  # the day that closes
    end = periods.end_ms(yesterday, board.tz)
    try:
        for now in (end - 1000, end + 599_000):  # before the end, and inside the grace
            s = [Score("early", 10, f"m{now}", achieved)]
            got = await board.submit(s, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(s, now_ms=now)
            assert got[0].closed == ()
        closes = end + 600_000
        late = [Score("late", 7, "m-late", achieved), Score("early", 5, "m-late", achieved)]
        for _ in range(2):  # the client's retry: a duplicate, nothing changes
            got = await board.submit(late, now_ms=closes)
            want = ref.submit(late, now_ms=closes)
            assert [(r.status, r.points) for r in got] == want
            assert [r.closed for r in got] == ref.closed
        assert ref.closed == [(), ()]  # the retry applied nothing
        await assert_matches(board, ref, ["total", *periods.names_at(achieved, config.periods, board.tz)[1:]])
        assert [e.player_id for e in await board.top(10, board.resolve(periods.api_name(yesterday)))] == [
            "early"
        ]
        assert (await board.player("late")).entry.points == 7
        skipped = {
            r.player_id: r.skipped for r in await journaled(board, cluster_url) if r.match_id == "m-late"
        }
        assert skipped == {"late": (yesterday,), "early": (yesterday,)}
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "set"])
async def test_a_retry_after_the_close_names_the_period_its_first_call_counted_it_in(
    store: BoardStore, mode: str
) -> None:
    """closed_periods says what this call did: a period closed when it came is named, although the
    first call, made before the close, counted the score there (router/README.md, OpenAPI)."""
    config = BoardConfig.from_dict(f"closed-retry-{mode}", {"mode": mode, "periods": ["daily"]})
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    achieved = times.now_ms() - 2 * HOUR  # the period's keys live by Redis's own clock
    day = periods.names_at(achieved, config.periods, board.tz)[1]
    end = periods.end_ms(day, board.tz)
    scores = [Score("p1", 10, "m1", achieved)]
    try:
        for now in (end - 1000, end + config.close_grace_s * 1000 + 1000):  # before the end, after the close
            got = await board.submit(scores, now_ms=now)
            assert [(r.status, r.points) for r in got] == ref.submit(scores, now_ms=now)
        assert [r.closed for r in got] == ref.closed == [(periods.api_name(day),)]
        assert got[0].status == "unchanged"
        await assert_matches(board, ref, ["total", day])
        assert [e.player_id for e in await board.top(10, board.resolve(periods.api_name(day)))] == ["p1"]
    finally:
        await store.delete(config.id)


async def test_a_period_past_its_retention_is_closed_whatever_the_grace(store: BoardStore) -> None:
    """close_grace may be 7 days where a daily period is kept 3: a result dated 4 days back was
    answered improved with no closed period, while its period's key, past its retention, was deleted
    at once; the journal and PostgreSQL held it there and settling that day could only mismatch (a
    periods audit's finding). A period now closes at its end plus the shorter of the two."""
    settings = {"mode": "best", "periods": ["daily"], "close_grace": 7 * 86400}
    config = BoardConfig.from_dict("lifecycle-grace", settings)
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    late = Score("alice", 5, "m1", now - 4 * 86_400_000)
    day = periods.names_at(late.achieved_ms or 0, config.periods, board.tz)[1]
    try:
        [got] = await board.submit([late], now_ms=now)
        assert (got.status, got.closed) == ("improved", (periods.api_name(day),))
        assert ref.submit([late], now_ms=now) == [(got.status, got.points)]
        assert ref.closed == [got.closed]
        assert [e.player_id for e in await board.top(10)] == ["alice"]
    finally:
        await store.delete(config.id)


async def test_the_freeze_marker_expires_with_the_period(store: BoardStore) -> None:
    config = BoardConfig.from_dict("freeze-expiry", {"periods": ["daily"], "retention_days": {"daily": 2}})
    board, _ = await store.create(config)
    now = times.now_ms()
    day = periods.names_at(now, config.periods, board.tz)[1]
    try:
        await board.submit([Score("a", 1, "m1", now)], now_ms=now)
        await board.freeze(day)
        expiry = periods.end_ms(day, board.tz) + 2 * DAY
        for prefix in board.prefixes:
            assert await board.client.pexpiretime(keys.frozen_key(prefix, day)) == expiry
            assert await board.client.zscore(keys.index_key(prefix), keys.frozen_key(prefix, day)) == expiry
        shard = board.layout.home("a")
        assert await board.client.pexpiretime(keys.period_key(board.prefixes[shard], day)) == expiry
    finally:
        await store.delete(config.id)
    assert not await board.client.exists(*(keys.frozen_key(p, day) for p in board.prefixes))
    with pytest.raises(BoardNotFound):
        await board.freeze(day)


@pytest.mark.parametrize("name", ["total", "daily:2026-11-30", "w:2026-W48", "d:2026-13-01", "d:", "x"])
async def test_only_a_kept_dated_period_can_be_frozen(store: BoardStore, name: str) -> None:
    config = BoardConfig.from_dict("freeze-names", {"periods": ["daily"]})
    board, _ = await store.create(config)
    try:
        with pytest.raises(InvalidInput):
            await board.freeze(name)
        with pytest.raises(InvalidInput):
            await board.frozen(name)
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_rebuild_leaves_skipped_periods_as_they_were(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str, mode: str
) -> None:
    """What a closed or frozen period skipped stays skipped after a rebuild from PostgreSQL (the
    archived rows) and the journals (the entries not archived yet)."""
    rng = random.Random(f"rebuild-skips/{mode}")
    config = BoardConfig.from_dict(
        f"rebuild-skips-{mode}",
        {"mode": mode, "periods": ["daily", "weekly"], "sharding": sharding("hash", 3)},
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    a = await archiver(raw, store, postgres_url)
    now = times.now_ms()
    day = periods.names_at(now, config.periods, board.tz)[1]
    at = [now, now - 1000, now - 20 * HOUR, now - 50 * HOUR]  # today, and days closed by the clock

    async def write(tag: str) -> None:
        scores = workload(board, rng, tag, at)
        got = await board.submit(scores, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(scores, now_ms=now)

    try:
        await write("a")
        await board.freeze(day)
        ref.frozen.add(day)
        await write("b")
        await drain(a)  # archived, with what each result skipped ...
        await write("c")  # ... and still only in the journals
        names = sorted(ref.boards)
        await assert_matches(board, ref, names)
        await damage(board, raw)
        await rebuilder.rebuild(board)
        await assert_matches(board, ref, names)
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_freeze_that_stopped_halfway_is_finished_by_running_it_again(store: BoardStore) -> None:
    config = BoardConfig.from_dict("freeze-halfway", {"periods": ["daily"], "sharding": sharding("hash", 4)})
    board, _ = await store.create(config)
    now = times.now_ms()
    day = periods.names_at(now, config.periods, board.tz)[1]
    names = (f"p{i}" for i in range(100))
    frozen_home = next(p for p in names if board.layout.home(p) == 2)
    other = next(p for p in names if board.layout.home(p) != 2)
    try:
        prefix = board.prefixes[2]  # the one shard an interrupted first freeze reached
        marker = [keys.index_key(prefix), keys.gone_key(prefix), keys.frozen_key(prefix, day)]
        assert await board.scripts.freeze(keys=marker, args=[now + DAY, now]) == 1
        assert not await board.frozen(day)
        got = await board.submit([Score(frozen_home, 5, "m1", now), Score(other, 5, "m1", now)], now_ms=now)
        assert [r.closed for r in got] == [(periods.api_name(day),), ()]
        assert await board.freeze(day) == 3  # the three shards left
        assert await board.frozen(day)
        got = await board.submit([Score(frozen_home, 9, "m2", now), Score(other, 9, "m2", now)], now_ms=now)
        assert [r.closed for r in got] == [(periods.api_name(day),)] * 2
        top = await board.top(10, board.resolve(periods.api_name(day)))
        assert [(e.player_id, e.points) for e in top] == [(other, 5)]
    finally:
        await store.delete(config.id)
