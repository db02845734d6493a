"""Removals that keep some periods (a retry at the first call's time, remove.lua's `again`) on band and
region boards, against tests/reference.py: a request whose first call missed a player's shard and is
retried after the player posted again, and a DELETE retried past the dedup window (``since_ms``, no
shard keeping its record). Every read of every period (per region too) then equals the reference, the
band shards included, and so does a rebuild of the board from PostgreSQL and the journals. Added
2026-12-05, when these were tested on hash boards only."""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from shardlb import keys, moderation, times
from shardlb.board import Board, Score
from shardlb.config import RANK_MODES, BoardConfig
from shardlb.rebuild import Rebuilder
from shardlb.reconcile import reconcile
from shardlb.settlement import Request, Settler
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_board import sharding
from tests.test_board_ranks import check_ranks
from tests.test_rebuild import archiver, drain
from tests.test_settlement import awards_of

pytestmark = pytest.mark.cluster

HOUR = 3_600_000
DAY = 24 * HOUR
PLAYERS = 24


class MissShards:
    """moderation.remove_on_shard whose calls to the shards in ``missed`` never reach them (remove.lua
    does not run there; the caller is told nothing, as after a call whose failure was not seen)."""

    def __init__(self, real: Any) -> None:
        self.real, self.missed = real, set[int]()

    async def __call__(
        self, board: Board, shard: int, players: Sequence[str], *args: Any, **kw: Any
    ) -> list[str]:
        if shard in self.missed:
            return []
        got: list[str] = await self.real(board, shard, players, *args, **kw)
        return got


async def damage(board: Board, raw: Any, players: Sequence[tuple[str, str | None]]) -> None:
    """Lose the total of the first player's home shard and add a stranger to the second's (shards with
    players: a rebuild replaces the keys a shard's index lists)."""
    first, second = (board.prefixes[board.layout.home(p, r)] for p, r in players[:2])
    await raw.delete(keys.period_key(first, "total"))
    await raw.zadd(keys.period_key(second, "total"), {"stranger": 123})


async def check_all(board: Board, ref: ReferenceBoard, rng: random.Random) -> None:
    """Every read of every period the reference holds, in both rank modes, globally and per region."""
    regions: list[str | None] = [None, *board.config.sharding.regions]
    for name in sorted(ref.boards):
        api = "total" if name == "total" else "daily:" + name[2:]
        for region in regions:
            for asked in RANK_MODES:
                await check_ranks(board, ref, name, api, region, asked, rng)


@pytest.mark.parametrize("strategy", ["band", "region"])
@pytest.mark.parametrize("mode", ["best", "incr", "set"])
async def test_removals_that_keep_some_periods_match_the_reference_and_rebuild(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
    mode: str,
) -> None:
    rng = random.Random(f"kept-removals/{strategy}/{mode}")
    config = BoardConfig.from_dict(
        f"kept-{strategy}-{mode}-{rng.randrange(10**6)}",
        {
            "mode": mode,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "periods": ["daily"],
            "retention_days": {"daily": 30},
            "points_max": 1000,
            "dedup_window_s": 30 * 86_400,
            "sharding": sharding(strategy, 16 if strategy == "region" else 3),
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    miss = MissShards(moderation.remove_on_shard)
    monkeypatch.setattr(moderation, "remove_on_shard", miss)
    regions = list(config.sharding.regions)
    home_region = {f"p{i:02d}": rng.choice(regions) if regions else None for i in range(PLAYERS)}
    today = times.now_ms() // DAY * DAY
    day1, day2 = today - 4 * DAY, today - 3 * DAY
    a = await archiver(raw, store, postgres_url)
    made = 0

    async def post(players: Sequence[str], at: int, now: int, moved: bool = False) -> None:
        """A result of each of ``players`` (``moved``: under another region than their home's),
        answered as the reference answers it."""
        nonlocal made
        batch = []
        for p in players:
            made += 1
            points = rng.randrange(0, 13) if mode == "incr" else rng.choice([0, 5, 39, 40, 41, 120, 300, 999])
            region = home_region[p]
            if moved and region is not None:
                region = rng.choice([r for r in regions if r != region])
            batch.append(Score(p, points, f"m{made}", at + rng.randrange(0, 3) * 1000, region))
        got = await board.submit(batch, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)

    def homes(players: Sequence[str]) -> dict[str, int]:
        return {p: board.layout.home(p, home_region[p]) for p in players}

    try:
        everyone = sorted(home_region)
        for _ in range(3):
            await post(rng.sample(everyone, 12), day1 + rng.randrange(1, 20) * HOUR, day1 + 21 * HOUR)
        await post(rng.sample(everyone, 12), day2 + HOUR // 2, day2 + HOUR)
        await drain(a)

        # Request R: its first call misses the home shard of one of its players (each player of
        # another home), who then posts again; its retry takes that player's entries of before the
        # first call's time only.
        placed = homes(ref.boards["total"])
        by_home: dict[int, str] = {}
        for p in sorted(placed, key=lambda p: rng.random()):
            by_home.setdefault(placed[p], p)
        r_players = list(by_home.values())[:3]
        missed = r_players[0]
        at_r = day2 + 2 * HOUR
        miss.missed = {placed[missed]}
        await moderation.remove(board, r_players, now_ms=at_r, request="remove/R")
        for p in r_players[1:]:
            ref.remove(p, at_r, "remove/R")
        miss.missed = set()
        await post([missed, *r_players[1:]], day2 + 3 * HOUR, day2 + 3 * HOUR)
        await post(rng.sample(everyone, 8), day2 + 3 * HOUR, day2 + 3 * HOUR)
        await moderation.remove(board, r_players, now_ms=day2 + 4 * HOUR, request="remove/R")
        for p in r_players:
            ref.remove(p, day2 + 4 * HOUR, "remove/R")
        await drain(a)

        # Request T (a DELETE): its first call reaches no shard; the players post again, every
        # record expires (past the window), and its retry is made at the first call's time.
        t_players = rng.sample(sorted(set(ref.boards["total"]) - set(r_players)), 3)
        at_t = day2 + 5 * HOUR
        miss.missed = set(range(board.layout.physical))
        await moderation.remove(board, t_players, now_ms=at_t, request="remove/T")
        miss.missed = set()
        await post(t_players, day2 + 6 * HOUR, day2 + 6 * HOUR)
        for prefix in board.prefixes:
            await raw.delete(keys.removals_key(prefix), keys.removals_key(prefix) + "on")
        await moderation.remove(board, t_players, now_ms=day2 + 7 * HOUR, request="remove/T", since_ms=at_t)
        ref.requests["remove/T"] = (ref.record_units(at_t), set(), set())
        for p in t_players:
            ref.remove(p, day2 + 7 * HOUR, "remove/T")
        await post(rng.sample(everyone, 6), day2 + 8 * HOUR, day2 + 8 * HOUR)
        # The removed players under another region (region boards): refused wherever their region
        # holds them in a period of the result, the entries a removal kept included.
        await post([*r_players, *t_players], day2 + 9 * HOUR, day2 + 9 * HOUR, moved=True)

        await board.repair()
        await check_all(board, ref, rng)
        await drain(a)
        # Reconcile finds no drift in any period (PostgreSQL keeps the removals' kept periods), and the
        # settlement of the closed day ranks as Redis and the reference do.
        names = ["total", *(n for n in sorted(ref.boards) if n != "total")]
        for name in names:
            api = "total" if name == "total" else "daily:" + name[2:]
            assert not any(c.drift for c in await reconcile(rebuilder, board, api)), name
        day = "daily:" + datetime.fromtimestamp(day2 / 1000, UTC).date().isoformat()
        sid = f"{config.id}-day2"
        table = [{"rank": r, "reward": f"r{r}"} for r in range(1, 6)]
        asked = Request.of({"settlement_id": sid, "rewards": table})
        result = await Settler(rebuilder).settle(board, day, asked)
        assert result["check"]["drifting"] == [] and not result["forced"]
        want = [(i + 1, p, f"r{i + 1}") for i, (_, p, _, _) in enumerate(ref.order("d:" + day[6:])[:5])]
        assert await awards_of(rebuilder.db, sid) == want
        on_board = sorted(ref.boards["total"])
        await damage(board, raw, [(p, home_region[p]) for p in (on_board[0], on_board[-1])])
        await rebuilder.rebuild(board)
        await check_all(board, ref, rng)
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_region_player_who_kept_a_period_posts_under_another_region_once(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A best board's retry at the first call's time takes a player's total (achieved before it) and
    keeps their daily entry (achieved since) on their region's shard. A result of the player under
    another region in that day must not give them a second daily entry there: the board's daily
    would show them twice."""
    config = BoardConfig.from_dict(
        f"kept-region-twice-{random.randrange(10**6)}",
        {"mode": "best", "periods": ["daily"], "retention_days": {"daily": 30},
         "dedup_window_s": 30 * 86_400, "sharding": sharding("region", 16)},
    )  # fmt: skip
    board, _ = await store.create(config)
    miss = MissShards(moderation.remove_on_shard)
    monkeypatch.setattr(moderation, "remove_on_shard", miss)
    today = times.now_ms() // DAY * DAY
    day1, day2 = today - 4 * DAY, today - 3 * DAY
    try:
        await board.submit([Score("p", 100, "p-1", day1 + HOUR, "r0")], now_ms=day1 + 2 * HOUR)
        miss.missed = {board.layout.home("p", "r0")}  # the other regions' shards keep its record
        await moderation.remove(board, ["p"], now_ms=day2 + HOUR, request="remove/R")
        miss.missed = set()
        await board.submit([Score("p", 50, "p-2", day2 + 2 * HOUR, "r0")], now_ms=day2 + 2 * HOUR)
        assert await moderation.remove(board, ["p"], now_ms=day2 + 3 * HOUR, request="remove/R") == {"p"}
        day = board.resolve("daily:" + datetime.fromtimestamp(day2 / 1000, UTC).date().isoformat())
        assert [e.player_id for e in await board.top(10, day)] == ["p"]
        assert await board.top(10, board.resolve("total")) == []
        got = await board.submit([Score("p", 70, "p-3", day2 + 4 * HOUR, "r1")], now_ms=day2 + 4 * HOUR)
        assert [(r.status, r.points) for r in got] == [("region_conflict", 0)]  # no total in r0
        assert [(e.player_id, e.points) for e in await board.top(10, day)] == [("p", 50)]
        assert await board.top(10, board.resolve("total")) == []
        # A result of another day names no period r0 holds them in: it homes them in r1, and each
        # period still shows them once.
        got = await board.submit([Score("p", 70, "p-4", day2 + DAY, "r1")], now_ms=day2 + DAY)
        assert [r.status for r in got] == ["improved"]
        assert [(e.player_id, e.points) for e in await board.top(10, day)] == [("p", 50)]
        total, r1 = board.resolve("total"), board.resolve("total", "r1")
        assert [(e.player_id, e.points) for e in await board.top(10, r1)] == [("p", 70)]
        assert (await board.player("p", total)).entry.points == 70
        assert (await board.player("p", day)).entry.points == 50
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("strategy", ["band", "region"])
async def test_a_retry_in_the_dedup_window_is_not_rate_limited_on_band_and_region_boards(
    store: BoardStore, strategy: str
) -> None:
    """rate.lua reads write.lua's dedup buckets on the shard a result goes to: a player's home on a
    band board, the shard of their region on a region board (the region the result names)."""
    config = BoardConfig.from_dict(
        f"kept-rate-{strategy}-{random.randrange(10**6)}",
        {"mode": "incr", "periods": ["daily"], "max_results_per_player_per_minute": 2,
         "sharding": sharding(strategy, 16 if strategy == "region" else 3)},
    )  # fmt: skip
    board, _ = await store.create(config)
    screen = moderation.Screen(lambda _board, _player, _incarnation: False)
    region = config.sharding.regions[-1] if config.sharding.regions else None
    now = times.now_ms()

    async def post(score: Score, at: int) -> list[str]:
        refused = await screen.refusals(board, board.prepare([score], at), at)
        if refused:
            return [r.status for r in refused]
        return [r.status for r in await board.submit([score], at)]

    try:
        first = Score("p1", 5, "m1", now, region)
        assert await post(first, now) == ["improved"]
        later = now + 5 * 60_000
        assert await post(Score("p1", 1, "m2", later, region), later) == ["improved"]
        assert await post(Score("p1", 1, "m3", later, region), later + 1) == ["improved"]
        assert await post(Score("p1", 1, "m4", later, region), later + 2) == ["rate_limit"]
        assert await post(first, later + 3) == ["duplicate"]
        assert [(e.player_id, e.points) for e in await board.top(5)] == [("p1", 7)]
    finally:
        await store.delete(config.id)
