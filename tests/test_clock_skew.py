"""Routers, jobs and Redis whose clocks differ by seconds (NTP steps, VMs): what each wall-clock time
decides must hold with one router 30 s ahead and another 30 s behind. The skew is injected in
process, by replacing ``shardlb.times.now_ms`` (the clock every router and job reads), against the
suite's cluster. docs/design-notes.md, "Clocks", lists the assumptions these tests confirm."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest

from shardlb import keys, moderation, periods, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound
from shardlb.reshard import Resharder
from shardlb.store import CACHE_SECONDS, BoardStore
from tests.test_board_retries import _next_midnight

pytestmark = pytest.mark.cluster

SKEW_MS = 30_000


def clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """A setter of this process's clock: ``at(ms)`` makes ``times.now_ms`` answer ``ms`` from then
    on (one router's clock, read at one true moment)."""

    def at(ms: int) -> None:
        monkeypatch.setattr(times, "now_ms", lambda: ms)

    return at


async def redis_ms(store: BoardStore) -> int:
    seconds, micros = await store.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_router_ahead_keeps_the_key_index_listing_of_a_key_still_alive(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write.lua dropped the shard's index listings of keys expired by the writing router's clock:
    a router 30 s ahead dropped those of keys Redis keeps for up to 30 s more, which a deletion or a
    reshard (both go by the index) then missed. The listings now go by Redis's own clock, the one
    that expires the keys."""
    config = BoardConfig.from_dict("clock-trim", {"sharding": {"shards": 1}})
    board, _ = await store.create(config)
    prefix = board.prefixes[0]
    index, alive = keys.index_key(prefix), prefix + "dd:1"  # a dedup bucket Redis still holds
    try:
        expire_at = await redis_ms(store) + 20_000
        await store.client.set(alive, 1, pxat=expire_at)
        await store.client.zadd(index, {alive: expire_at})
        clock(monkeypatch)(times.now_ms() + SKEW_MS)
        fresh = await BoardStore(store.client, store.scripts).get(config.id)  # trims on its first call
        assert [r.status for r in await fresh.submit([Score("p1", 5, "m1")])] == ["improved"]
        assert await store.client.zscore(index, alive) == expire_at
        monkeypatch.undo()
        await store.delete(config.id)
        assert not await store.client.exists(alive)
    finally:
        monkeypatch.undo()
        await store.client.delete(alive)
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)


async def test_a_retry_through_a_router_behind_is_not_counted_again_per_minute(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rate.lua recognised a retry by its (match, player) in this minute's and the previous
    minute's counters: a result counted by a router 30 s ahead, in the minute it had begun, and
    retried through one 30 s behind, still in the minute before, was counted again, and at the
    limit refused as ``rate_limit`` though the board holds it. The next minute's pairs are read too."""
    config = BoardConfig.from_dict(
        "clock-rate", {"max_results_per_player_per_minute": 1, "sharding": {"shards": 1}}
    )
    board, _ = await store.create(config)
    screen = moderation.Screen(lambda _board, _player, _incarnation: False)
    at = clock(monkeypatch)
    true = (times.now_ms() // 60_000 + 1) * 60_000 + 10_000  # 10 s into a minute, in the past for neither

    async def post(score: Score, router_ms: int) -> list[str]:
        at(router_ms)
        refused = await screen.refusals(board, board.prepare([score]))
        if refused:
            return [r.status for r in refused]
        return [r.status for r in await board.submit([score])]

    try:
        achieved = true - 60_000
        behind, ahead = true - SKEW_MS, true + SKEW_MS  # in minutes m and m + 1
        assert await post(Score("p1", 5, "m0", achieved), behind) == ["improved"]  # minute m: 1
        assert await post(Score("p1", 7, "m1", achieved), ahead) == ["improved"]  # minute m + 1: 1
        # the game server did not hear the answer and sends m1 again, through the router behind
        assert await post(Score("p1", 7, "m1", achieved), behind + 1) == ["unchanged"]
        assert await post(Score("p1", 9, "m2", achieved), behind + 2) == ["rate_limit"]  # at the limit
        assert [(e.player_id, e.points) for e in await board.top(5)] == [("p1", 7)]
    finally:
        monkeypatch.undo()
        await store.delete(config.id)


async def test_a_mover_whose_clock_steps_ahead_still_waits_for_the_routers_caches(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routers keep a board's record up to CACHE_SECONDS: the mover seals the old shards only once
    every router knows of the reshard (its reads then check the layout). It measured that wait from
    the record's ``started_ms`` by the wall clock, so a clock stepped 30 s ahead meanwhile (NTP, or a
    mover resuming on a host ahead of the one that started) sealed at once. The wait is now measured
    on this process's monotonic clock, from when it first knew of the reshard."""
    config = BoardConfig.from_dict("clock-reshard", {"durability": "memory", "sharding": {"shards": 2}})
    await store.create(config)
    said: list[str] = []
    try:
        mover = Resharder(store, config.id, say=said.append, cache_s=CACHE_SECONDS)
        await mover.start(3)
        wall, now_ms = time.time, times.now_ms
        monkeypatch.setattr(time, "time", lambda: wall() + SKEW_MS / 1000)  # the host's clock steps ahead
        monkeypatch.setattr(times, "now_ms", lambda: now_ms() + SKEW_MS)
        status = await mover.run()
        monkeypatch.undo()
        assert status["state"] == "none" and status["shards"] == 3
        assert [line for line in said if "for every router to know of the reshard" in line], said
    finally:
        monkeypatch.undo()
        await store.delete(config.id)


@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_a_result_without_a_time_retried_across_midnight_through_routers_a_minute_apart(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Confirms an assumption (no defect): a result sent without ``achieved_at`` takes the writing
    router's clock, so 15 s before midnight a router 30 s ahead files it in the new day. Its retry
    through a router 30 s behind (still 45 s before midnight) lands there too, once (the pin), and
    back through the router ahead is still one result."""
    config = BoardConfig.from_dict(
        f"clock-midnight-{mode}", {"mode": mode, "periods": ["daily"], "sharding": {"shards": 1}}
    )
    board, _ = await store.create(config)
    at = clock(monkeypatch)
    true = _next_midnight() - 15_000
    try:
        statuses = []
        for router_ms in (true + SKEW_MS, true - SKEW_MS, true + SKEW_MS + 1):
            at(router_ms)
            statuses += [r.status for r in await board.submit([Score("p1", 10, "m1")])]
        assert statuses[0] == "improved" and set(statuses[1:]) <= {"unchanged", "duplicate"}, statuses
        before, after = (
            board.resolve("daily:" + periods.names_at(t, config.periods, board.tz)[1][2:])
            for t in (true - SKEW_MS, true + SKEW_MS)
        )
        assert before.period != after.period
        assert [(e.player_id, e.points) for e in await board.top(5, after)] == [("p1", 10)]
        assert await board.top(5, before) == []
    finally:
        monkeypatch.undo()
        await store.delete(config.id)
