"""Adversarial checks of the incr time rule of 2026-12-05 (docs/design-notes.md, "An incr player's
time") where it meets the rest of the system: a reshard under writes, removals (a request retried at
its first call's time), a period that closes, a settlement, reconcile and rebuild, on hash, band and
region boards. Most results score 0 and the players are few, so sums tie and the time decides."""

from __future__ import annotations

import asyncio
import contextlib
import random
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from shardlb import erase, keys, moderation, reconcile, times
from shardlb.archive import connect_db
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.connection import Scripts
from shardlb.errors import BoardNotFound, SettlementConflict
from shardlb.rebuild import Rebuilder
from shardlb.reshard import Resharder
from shardlb.settlement import Request, Settler, archive_season, ensure_schema, period_bounds
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_band_repair import BANDS, FAULTS, OTHERS, lose, mismatches, pending
from tests.test_board import sharding
from tests.test_erase import past_window
from tests.test_kept_removals import MissShards, check_all, damage
from tests.test_prune import archived, own_db
from tests.test_rebuild import archive_round, archiver, drain
from tests.test_reshard import CACHE, Router, Workload, make_board
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board, written
from tests.test_settlement import drain as drain_settle

pytestmark = pytest.mark.cluster


class ZeroWorkload(Workload):
    """Workload's calls with most results of 0 points, achieved up to 10 minutes back in any order
    (whole seconds: equal times are common), and retries of earlier calls."""

    def batch(self) -> list[Score]:
        rng = self.rng
        if self.sent and rng.random() < 0.25:
            return rng.choice(self.sent)
        now = times.now_ms()
        scores = [
            Score(
                rng.choice(self.players),
                rng.choice([0, 0, 0, 0, 1, 7]),
                f"m{self.writes}-{i}",
                now - rng.randint(0, 600) * 1000,
            )
            for i in range(rng.randint(1, 12))
        ]
        self.sent.append(scores)
        return scores


RESHARDS = {
    "hash": ({"strategy": "hash", "shards": 2}, (5, None)),
    "band": ({"strategy": "band", "shards": 2, "bands": [0, 400]}, (3, [0, 3, 8, 20])),
}


@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
@pytest.mark.parametrize("kind", sorted(RESHARDS))
async def test_a_reshard_under_results_of_no_points_keeps_every_time_and_rebuilds_to_it(
    store: BoardStore, raw: Any, rebuilder: Any, postgres_url: str, kind: str, tiebreak: str
) -> None:
    """Writers post mostly 0-point results (and retries) while the board is resharded (a band board
    into bands its players cross); reads agree with the reference all along, and after it reconcile
    finds no drift and a rebuild from PostgreSQL gives the same board."""
    first, (shards, bands) = RESHARDS[kind]
    board, ref = await make_board(
        store, first["shards"], durability="journal", sharding=first, tiebreak=tiebreak
    )
    router = Router(store, board.config.id)
    seed = sorted(RESHARDS).index(kind) * 2 + (tiebreak == "latest")
    work = ZeroWorkload(router, ref, seed=seed, players=40)
    a = await archiver(raw, store, postgres_url)
    stop = asyncio.Event()

    async def archive() -> None:
        while not stop.is_set():
            await a.refresh()
            if not await archive_round(a):
                await asyncio.sleep(0.02)

    archiving = asyncio.ensure_future(archive())
    try:
        for _ in range(40):
            await work.write()
        await work.check()
        done = asyncio.Event()
        writers = asyncio.ensure_future(work.run_until(done, check_every=3))
        try:
            mover = Resharder(
                store, board.config.id, say=lambda _: None, postgres_url=postgres_url, cache_s=CACHE
            )
            await mover.start(shards, bands)
            final = await mover.run()
        finally:
            done.set()
            await writers
        assert final["state"] == "none" and final["shards"] == shards
        for _ in range(20):
            await work.write()
        await work.check()
    finally:
        stop.set()
        await archiving
    try:
        await a.refresh()
        await drain(a)
        current = await store.get(board.config.id)
        for period in ("total", "daily"):
            checks = await reconcile.reconcile(rebuilder, current, period)
            assert not [c for c in checks if c.drift], (period, checks)
        await rebuilder.rebuild(current)
        router.board = None
        await work.check()
        day = current.resolve("daily")
        want = sorted(ref.order(day.period), reverse=True)
        got = await current.top(len(want) + 1, day)
        assert [(e.player_id, e.points, ref.codec.time_units(e.achieved_ms)) for e in got] == [
            (p, points, units) for _, p, points, units in want
        ]
    finally:
        await a.db.close()
        await store.delete(board.config.id)


HOUR = 3_600_000
DAY = 24 * HOUR


@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
async def test_removals_around_results_of_no_points_match_the_reference_the_archive_and_a_rebuild(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
    tiebreak: str,
) -> None:
    """A request whose first call misses a player's shard, retried at its time after the player
    posted only 0-point results (their entry of before goes now); a removal after a 0-point result
    dated ahead of the clock, whose retry stays a duplicate; players of 0 points throughout. Reads
    (every period, per region, band shards included), reconcile, the settlement of the closed day
    and a rebuild all agree with the reference."""
    rng = random.Random(f"incr-attack-removals/{strategy}/{tiebreak}")
    config = BoardConfig.from_dict(
        f"incr-attack-rm-{strategy}-{tiebreak}-{rng.randrange(10**6)}",
        {
            "mode": "incr",
            "tiebreak": tiebreak,
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
    home_region = {f"p{i:02d}": rng.choice(regions) if regions else None for i in range(24)}
    today = times.now_ms() // DAY * DAY
    day1, day2 = today - 4 * DAY, today - 3 * DAY
    a = await archiver(raw, store, postgres_url)
    made = 0

    async def post(players: list[str], at: int, now: int, points: list[int] | None = None) -> None:
        nonlocal made
        batch = []
        for n, p in enumerate(players):
            made += 1
            value = points[n] if points is not None else rng.choice([0, 0, 0, 2, 9])
            batch.append(Score(p, value, f"m{made}", at + rng.randrange(0, 3) * 1000, home_region[p]))
        got = await board.submit(batch, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)
        return None

    async def again(batch: list[Score], now: int) -> None:
        got = await board.submit(batch, now_ms=now)
        assert [(r.status, r.points) for r in got] == ref.submit(batch, now_ms=now)

    try:
        everyone = sorted(home_region)
        zeros = everyone[:4]  # players of 0 points throughout
        others = everyone[4:]
        for k in range(3):
            await post(zeros, day1 + (5 - k) * HOUR, day1 + 21 * HOUR, [0] * len(zeros))
            await post(rng.sample(others, 10), day1 + rng.randrange(1, 20) * HOUR, day1 + 21 * HOUR)
        await post(others, day2 + HOUR // 2, day2 + HOUR, [rng.choice([1, 4]) for _ in others])
        await post(zeros, day2 + HOUR // 2, day2 + HOUR, [0] * len(zeros))
        await drain(a)

        # Request R: its first call misses the home shard of one player with points and one of 0
        # points (sharing a shard, when one does); both then post only 0-point results.
        homes = {p: board.layout.home(p, home_region[p]) for p in everyone}
        target = next(p for p in others if any(homes[z] == homes[p] for z in zeros))
        zero = next(z for z in zeros if homes[z] == homes[target])
        reached = [p for p in others if homes[p] != homes[target]][:2]
        at_r = day2 + 2 * HOUR
        miss.missed = {homes[target]}
        await moderation.remove(board, [target, zero, *reached], now_ms=at_r, request="remove/R")
        for p in reached:
            ref.remove(p, at_r, "remove/R")
        miss.missed = set()
        since = day2 + 3 * HOUR + 2000
        sent_since = [Score(p, 0, f"since-{p}", since, home_region[p]) for p in (target, zero)]
        await again(sent_since, day2 + 3 * HOUR)
        await post([target, zero], day2 + 3 * HOUR, day2 + 3 * HOUR, [0, 0])
        await moderation.remove(board, [target, zero, *reached], now_ms=day2 + 4 * HOUR, request="remove/R")
        for p in (target, zero, *reached):
            ref.remove(p, day2 + 4 * HOUR, "remove/R")
        # Their entries of before went, in every period (until 2026-12-05 the 0-point result's time
        # kept them, with their points of before).
        assert target not in ref.boards["total"] and zero not in ref.boards["total"]
        await again(sent_since, day2 + 4 * HOUR)  # retries: duplicates
        await post([target, zero], day2 + 5 * HOUR, day2 + 5 * HOUR, [0, 3])
        # Results of day 1 that come after it closed: the total alone takes them.
        late = rng.sample([p for p in others if p not in (target, *reached)], 6)
        await post(late, day1 + 22 * HOUR, day2 + 5 * HOUR, [0, 0, 0, 5, 0, 1])
        assert set(ref.closed) == {("daily:" + datetime.fromtimestamp(day1 / 1000, UTC).date().isoformat(),)}

        # A 0-point result dated 3 minutes ahead of the clock, then a removal; its retry after it is
        # a duplicate, and a new result dated between the removal and it is taken.
        ahead = next(p for p in others if p not in (target, *reached))
        now = day2 + 6 * HOUR
        early = [Score(ahead, 0, "ahead", now + 3 * 60_000, home_region[ahead])]
        await again(early, now)
        await moderation.remove(board, [ahead], now_ms=now + 1000)
        ref.remove(ahead, now + 1000)
        await again(early, now + 2000)
        await post([ahead], now + 60_000, now + 3000, [0])

        await board.repair()
        await check_all(board, ref, rng)
        await drain(a)
        names = ["total", *(n for n in sorted(ref.boards) if n != "total")]
        for name in names:
            api = "total" if name == "total" else "daily:" + name[2:]
            assert not any(c.drift for c in await reconcile.reconcile(rebuilder, board, api)), name
        day = "daily:" + datetime.fromtimestamp(day2 / 1000, UTC).date().isoformat()
        sid = f"{config.id}-day2"
        table = [{"rank": r, "reward": f"r{r}"} for r in range(1, 8)]
        asked = Request.of({"settlement_id": sid, "rewards": table})
        result = await Settler(rebuilder).settle(board, day, asked)
        assert result["check"]["drifting"] == [] and not result["forced"]
        want = [(i + 1, p, f"r{i + 1}") for i, (_, p, _, _) in enumerate(ref.order("d:" + day[6:])[:7])]
        assert await awards_of(rebuilder.db, sid) == want
        on_board = sorted(ref.boards["total"])
        await damage(board, raw, [(p, home_region[p]) for p in (on_board[0], on_board[-1])])
        await rebuilder.rebuild(board)
        await check_all(board, ref, rng)
    finally:
        await a.db.close()
        await store.delete(config.id)


async def test_a_retry_of_an_erased_result_of_no_points_dated_ahead_stays_a_duplicate_after_a_loss(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A player posts points, then a 0-point result dated 3 minutes ahead of the clock (a board takes
    that), and is removed. Their archived rows are erased (`shardlb erase`), and Redis loses the
    shard's retry records, which a refill puts back from the journal and PostgreSQL: the dedup
    records of the erased rows cannot come back, so only the removal's record refuses a retry. It
    must cover every result applied before the removal, as it did while the entry's time was the
    latest of all: a retry of the 0-point result is a duplicate, and the player stays off the board."""
    async with own_db(postgres_url, "incr_attack_erase") as url:
        db = await connect_db(url)
        await ensure_schema(db)
        config = BoardConfig.from_dict(
            f"incr-attack-erase-{random.randrange(10**6)}",
            {"mode": "incr", "durability": "journal", "sharding": {"strategy": "hash", "shards": 1}},
        )
        board, _ = await store.create(config)
        prefix = board.prefixes[0]
        rebuilder = Rebuilder(raw, Scripts.register(raw).rebuild, db)
        try:
            now = times.now_ms()
            ahead = Score("cheat", 0, "m-ahead", now + 3 * 60_000)
            first = [Score("cheat", 10, "m1", now - 60_000), Score("fair", 4, "m2", now - 60_000)]
            await board.submit(first, now)
            assert [r.status for r in await board.submit([ahead], now)] == ["unchanged"]
            assert await moderation.remove(board, ["cheat"], now_ms=now + 1000) == {"cheat"}
            await archived(raw, store, db)
            # judged past the dedup window, as an erase run then would (erase keeps the rows a refill
            # within the window reads; tests/test_erase.py)
            done = await erase.erase(db, store.client, "cheat", now_ms=past_window())
            assert done.rows[(config.id, board.incarnation, "match_results")] == 2
            # The loss, PARTIAL on purpose: the shard's dedup sets and removal records alone (the
            # rest of the shard kept), put back by a refill.
            listed = [k.decode() for k in await raw.zrange(keys.index_key(prefix), 0, -1)]
            lost = [k for k in listed if k.startswith(prefix + "dd:")]
            await raw.delete(*lost, keys.removals_key(prefix), keys.removals_marker_key(prefix))
            await rebuilder.refill(board, 0)
            got = await board.submit([ahead], times.now_ms())
            assert [(r.status, r.points) for r in got] == [("duplicate", 0)]
            assert [e.player_id for e in await board.top(10)] == ["fair"]
        finally:
            await db.close()
            with contextlib.suppress(BoardNotFound):
                await store.delete(config.id)


async def test_an_upgraded_period_with_entries_of_the_old_rule_settles_after_a_reconcile_repair(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, postgres_url: str
) -> None:
    """README "Upgrading an install", item 11: entries a router of before wrote (the time of a
    player's latest result, a 0-point one included) make a settlement of their period stop with
    nothing paid; `shardlb reconcile BOARD --period P --repair` rewrites them by the new rule, and
    the settlement then pays the reference's order. The old entries are made by hand here: the
    reference's entry, at the player's latest result's time."""
    board = await new_board(store, f"incr-attack-upgrade-{random.randrange(10**6)}", "incr")
    period = day_ago(2)
    name = board.resolve(period).period
    try:
        ref = await written(board, period, "upgrade", players=20, results=80, values=[0, 0, 0, 3, 8])
        start, end = period_bounds(board, name)
        tied = [Score("a", 11, "ua-1", start + 1000), Score("b", 11, "ub-1", start + 2000)]
        tied.append(Score("a", 0, "ua-2", end - 1000))  # the old rule put a below b
        await board.submit(tied, now_ms=end - 1)
        ref.submit(tied, now_ms=end - 1)
        codec = board.codec
        old = {"a": codec.encode_units(11, codec.time_units(end - 1000))}
        for view in ("total", name):
            await raw.zadd(keys.period_key(board.prefixes[board.layout.home("a", None)], view), old)
        await drain_settle(raw, store, postgres_url)
        request = Request.of({"settlement_id": f"{board.config.id}-1", "rewards": TABLE})
        with pytest.raises(SettlementConflict, match="disagree"):
            await Settler(rebuilder).settle(board, period, request)
        for view in ("total", period):
            checks = await reconcile.reconcile(rebuilder, board, view)
            assert [c.shard for c in checks if c.drift] == [board.layout.home("a", None)], view
            await reconcile.repair(rebuilder, board, checks, view)
            assert not any(c.drift for c in await reconcile.reconcile(rebuilder, board, view)), view
        result = await Settler(rebuilder).settle(board, period, request)
        assert result["check"]["drifting"] == [] and not result["forced"]
        assert await awards_of(rebuilder.db, f"{board.config.id}-1") == expected_awards(ref, period, board)
        got = [e.player_id for e in await board.top(100, board.resolve(period))]
        assert got == [p for _, p, _, _ in ref.order(name)] and got.index("a") < got.index("b")
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("fault", ["dead", "add-lost", "remove-lost"])
async def test_a_result_of_no_points_finishes_a_band_move_a_lost_call_left(
    store: BoardStore, fault: str
) -> None:
    """An incr band board: p1's result crosses a band limit through a router that loses band calls;
    p1's next result scores 0 (the total stays, no new version) through another router, whose call
    still answers the pending move and sends it: every read equals the reference at once, with no
    repair pass. Likewise a player of 0 points moved to an earlier time (a new version)."""
    config = BoardConfig.from_dict(
        f"incr-attack-band-{fault}-{random.randrange(10**6)}",
        {"mode": "incr", "sharding": {"strategy": "band", "bands": BANDS, "shards": 3}},
    )
    writer, _ = await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms() // 1000 * 1000
    try:
        first = [Score(f"o{i}", p, "m1", now - 60_000) for i, p in enumerate(OTHERS)]
        first += [Score("p1", 60, "m1", now), Score("z", 0, "m1", now - 30_000)]
        await writer.submit(first, now_ms=now)
        ref.submit(first, now_ms=now)
        kind, count = FAULTS[fault]
        lose(writer, kind, count)
        move = [Score("p1", 50, "m2", now + 1000)]
        with pytest.raises(ConnectionError):
            await writer.submit(move, now_ms=now + 1000)
        ref.submit(move, now_ms=now + 1000)
        reader = await store.get(config.id)
        zero = [Score("p1", 0, "m3", now + 2000)]
        got = await reader.submit(zero, now_ms=now + 2000)
        assert ref.submit(zero, now_ms=now + 2000) == [("unchanged", 110)]
        assert [(r.status, r.points) for r in got] == [("unchanged", 110)]
        assert await mismatches(reader, ref) == []
        assert await pending(reader) == 0
        # z, of 0 points, is moved earlier by a 0-point result through the losing router (when it
        # still loses), then posts 0 again later: the move is finished by that call.
        lose(writer, kind, count)
        earlier = [Score("z", 0, "m2", now - 50_000)]
        with contextlib.suppress(ConnectionError):
            await writer.submit(earlier, now_ms=now + 3000)
        ref.submit(earlier, now_ms=now + 3000)
        later = [Score("z", 0, "m3", now + 3000)]
        got = await reader.submit(later, now_ms=now + 3000)
        assert ref.submit(later, now_ms=now + 3000) == [("unchanged", 0)]
        assert [(r.status, r.points) for r in got] == [("unchanged", 0)]
        assert await mismatches(reader, ref) == []
        assert await pending(reader) == 0
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
async def test_a_season_of_results_of_no_points_is_archived_in_the_boards_order(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, tiebreak: str
) -> None:
    """A season's archive settles the total (frozen, checked against PostgreSQL's order, the new
    rule's SQL): sums that tie often and many 0-point results over two days, players of 0 points
    among them: no drift, and the snapshot is the live board's order and times."""
    board = await new_board(store, f"incr-attack-season-{tiebreak}-{random.randrange(10**6)}", "incr",
                            tiebreak=tiebreak)  # fmt: skip
    name = board.config.id
    try:
        for days, seed in ((3, "season-a"), (2, "season-b")):
            await written(board, day_ago(days), seed, players=25, results=60, values=[0, 0, 0, 4])
        await drain_settle(raw, store, postgres_url)
        request = Request.of({"settlement_id": f"{name}-season", "rewards": TABLE, "top_n": 50})
        live = [(e.player_id, e.points, e.achieved_ms) for e in await board.top(100)]
        assert sum(1 for _, points, _ in live if points == 0) > 1
        result = await archive_season(cluster_url, postgres_url, name, request)
        assert result["archived"] and result["check"]["drifting"] == [] and not result["forced"]
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
            cur = await db.execute(
                "SELECT player_id, points, achieved_ms FROM settlement_snapshots WHERE settlement_id = %s "
                "ORDER BY rank",
                (f"{name}-season",),
            )
            assert [tuple(r) for r in await cur.fetchall()] == live
    finally:
        with contextlib.suppress(BoardNotFound):
            await store.delete(name)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("strategy", ["hash", "band", "region"])
async def test_random_histories_of_results_of_no_points_retries_and_removals_agree_everywhere(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
    seed: int,
) -> None:
    """Random steps over a day and past its close: calls of mostly 0-point results (achieved hours
    back, up to 4 minutes ahead of the clock, or left to the server's clock), retries of earlier
    calls, removals (plain, and requests whose first call misses a shard, retried later at its time).
    Then every read, reconcile, a rebuild after damage and the closed day's settlement agree with the
    reference."""
    rng = random.Random(f"incr-attack-random/{strategy}/{seed}")
    config = BoardConfig.from_dict(
        f"incr-attack-rand-{strategy}-{seed}-{rng.randrange(10**6)}",
        {
            "mode": "incr",
            "tiebreak": rng.choice(["earliest", "latest"]),
            "order": rng.choice(["desc", "asc"]),
            "periods": ["daily"],
            "retention_days": {"daily": 30},
            "points_max": 10_000,
            "dedup_window_s": 30 * 86_400,
            "sharding": sharding(strategy, 16 if strategy == "region" else 3),
        },
    )
    board, _ = await store.create(config)
    ref = ReferenceBoard(config)
    miss = MissShards(moderation.remove_on_shard)
    monkeypatch.setattr(moderation, "remove_on_shard", miss)
    regions = list(config.sharding.regions)
    home_region = {f"p{i:02d}": rng.choice(regions) if regions else None for i in range(16)}
    players = sorted(home_region)
    today = times.now_ms() // DAY * DAY
    day = today - 3 * DAY
    now = day + HOUR
    a = await archiver(raw, store, postgres_url)
    sent: list[list[Score]] = []
    open_requests: list[tuple[str, list[str]]] = []

    pins: dict[tuple[str, str], int] = {}  # a result sent without a time: the first time it was seen

    def pinned(s: Score) -> Score:
        return s._replace(achieved_ms=pins.setdefault((s.match_id, s.player_id), now))

    async def submit(batch: list[Score]) -> None:
        got = await board.submit(batch, now_ms=now)
        # The board pins a result without a time to its first server time, refused or not (the
        # reference has no pins): its retries are answered at that time.
        timed = [s if s.achieved_ms is not None else pinned(s) for s in batch]
        assert [(r.status, r.points) for r in got] == ref.submit(timed, now_ms=now), batch

    def first_call(request: str, reached: list[str], recorded: bool) -> None:
        """The reference after a request's first call that reached the homes of ``reached``: every
        entry of theirs goes, one dated ahead of the clock too (the reference's ``remove`` with a
        request it knows takes a later player of the same call for a retry, which keeps those), then
        the request is recorded if a shard recorded it (``recorded``: on a region board any shard
        a player could live on; a request no shard recorded is a new removal when sent again)."""
        found = {p for p in reached if ref.remove(p, now)}
        if recorded:
            ref.requests[request] = (ref.record_units(now), set(reached), found)

    try:
        for step in range(90):
            now += rng.choice([1000, 60_000, 20 * 60_000])
            if step == 70:
                now = day + DAY + HOUR  # past the day's close: its late results count in the total only
            roll = rng.random()
            if roll < 0.6 or not sent:
                batch = []
                for n in range(rng.randint(1, 6)):
                    p = rng.choice(players)
                    kind = rng.random()
                    at = (
                        None
                        if kind < 0.15
                        else now + rng.randrange(0, 240) * 1000
                        if kind < 0.3
                        else max(day, now - rng.randrange(0, 3 * 3600) * 1000)
                    )
                    points = rng.choice([0, 0, 0, 0, 1, 5])
                    batch.append(Score(p, points, f"m{step}-{n}", at, home_region[p]))
                sent.append(batch)
                await submit(batch)
            elif roll < 0.8:
                await submit(rng.choice(sent))
            elif roll < 0.9:
                p = rng.choice(players)
                await moderation.remove(board, [p], now_ms=now)
                ref.remove(p, now)
            elif open_requests and rng.random() < 0.6:
                request, who = open_requests.pop()
                await moderation.remove(board, who, now_ms=now, request=request)
                if request not in ref.requests:
                    first_call(request, who, True)
                for p in who:
                    ref.remove(p, now, request)
            else:
                who = rng.sample(players, 3)
                homes = {p: board.layout.home(p, home_region[p]) for p in who}
                miss.missed = {homes[who[0]]}
                request = f"remove/{step}"
                await moderation.remove(board, who, now_ms=now, request=request)
                recorded = any(set(board.layout.candidates(p)) - miss.missed for p in who)
                miss.missed = set()
                first_call(request, [p for p in who if homes[p] != homes[who[0]]], recorded)
                open_requests.append((request, who))
        for request, who in open_requests:
            await moderation.remove(board, who, now_ms=now, request=request)
            if request not in ref.requests:
                first_call(request, who, True)
            for p in who:
                ref.remove(p, now, request)
        await board.repair()
        await check_all(board, ref, rng)
        await drain(a)
        names = ["total", *(n for n in sorted(ref.boards) if n != "total")]
        for name in names:
            api = "total" if name == "total" else "daily:" + name[2:]
            assert not any(c.drift for c in await reconcile.reconcile(rebuilder, board, api)), name
        dayname = "daily:" + datetime.fromtimestamp(day / 1000, UTC).date().isoformat()
        if ref.order("d:" + dayname[6:]):
            sid = f"{config.id}-day"
            table = [{"rank": r, "reward": f"r{r}"} for r in range(1, 6)]
            asked = Request.of({"settlement_id": sid, "rewards": table})
            result = await Settler(rebuilder).settle(board, dayname, asked)
            assert result["check"]["drifting"] == [] and not result["forced"]
            order = ref.order("d:" + dayname[6:])[:5]
            want = [(i + 1, p, f"r{i + 1}") for i, (_, p, _, _) in enumerate(order)]
            assert await awards_of(rebuilder.db, sid) == want
        on_board = sorted(ref.boards["total"])
        if len(on_board) >= 2:
            await damage(board, raw, [(p, home_region[p]) for p in (on_board[0], on_board[-1])])
        await rebuilder.rebuild(board)
        await check_all(board, ref, rng)
    finally:
        await a.db.close()
        await store.delete(config.id)
