"""Region boards under random workloads from several clients, against the in-memory reference board.

Players are homed by the first region they post under (docs/design-notes.md, "Regions"); later
results naming another region are refused (``region_conflict``), replays included, whatever client
sends them and in whatever order. Once writes are quiescent every read of every view (the whole
board and each region, the total and two days of a dated period) equals the reference in both rank
modes: top, pages at every offset, each player's rank with and without a region, around, friends,
and the router's estimates hold the exact rank within their stated error. Then some players are
removed and post again, some under another region: their new first region homes them.

A player's home is decided by the first result applied, so the results that home players are sent
one client after the other (one region per player in a batch, whose statuses and points are
compared with the reference's); the concurrent phase only writes players who have a home, where
the final state does not depend on the order (max, sum, latest time; a conflict is a conflict in
any order).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import httpx
import pytest

from router.media import entry_body
from shardlb import keys, moderation, periods, times
from shardlb.board import Board, Score
from shardlb.config import RANK_MODES, BoardConfig
from shardlb.errors import PlayerNotFound
from shardlb.rebuild import Rebuilder
from shardlb.settlement import Request, Settler, period_bounds
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.router_support import running
from tests.test_band_workloads import clients
from tests.test_board import HOUR
from tests.test_board_ranks import check_ranks, expected
from tests.test_rebuild import archiver, drain
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board
from tests.test_settlement import drain as drain_all

pytestmark = pytest.mark.cluster

CLIENTS = 3
PLAYERS = 36
REGIONS = ["eu", "na", "asia"]
AGO = [0, 0, 1, 30]  # hours before now: today mostly, yesterday too (the dated period's two days)


def result(rng: random.Random, mode: str, player: str, region: str, at: int, match: str) -> Score:
    """Few points values (ties); incr steps small enough that no total passes points_max."""
    points = rng.randint(0, 9) if mode == "incr" else rng.choice([0, 3, 50, 51, 400, 999])
    return Score(player, points, match, at - rng.choice(AGO) * HOUR, region)


def views(board: Board, now: int) -> list[tuple[str, str, str | None]]:
    """(kept name, API period, region) of every view read: the total and today and yesterday."""
    today = periods.names_at(now, board.config.periods, board.tz)[1]
    yesterday = periods.names_at(now - 30 * HOUR, board.config.periods, board.tz)[1]
    named = [("total", "total")] + [(d, "daily:" + d[2:]) for d in (today, yesterday)]
    return [(name, api, region) for name, api in named for region in [None, *REGIONS]]


async def check_everything(board: Board, ref: ReferenceBoard, rng: random.Random, now: int, url: str) -> None:
    for name, api, region in views(board, now):
        for asked in RANK_MODES:
            await check_ranks(board, ref, name, api, region, asked, rng)
            want = expected(ref, name, region, asked)
            view = board.resolve(api, region)
            board.shallow = 0  # every page through the score bisection
            try:
                for offset in range(len(want) + 1):
                    got = await board.entries(offset, 3, view, asked)
                    assert got == want[offset : offset + 3], (name, region, asked, offset)
            finally:
                board.shallow = 1000
        # A player read without a region, on a view of one region: their own region's rank; a
        # player of another region is not on it.
        if region is not None:
            homed = {e.player_id for e in expected(ref, name, region, "unique")}
            for e in expected(ref, name, None, "unique"):
                if e.player_id not in homed:
                    with pytest.raises(PlayerNotFound):
                        await board.player(e.player_id, board.resolve(api, region))
    # Estimates: a router made now, so its histograms are sampled from the board as it is.
    async with running(url, histogram_samples=2, histogram_refresh_s=60) as (_, http):
        await check_estimates(http, board, ref, now)


async def check_estimates(http: httpx.AsyncClient, board: Board, ref: ReferenceBoard, now: int) -> None:
    for name, api, region in views(board, now):
        for asked in RANK_MODES:
            want = expected(ref, name, region, asked)
            for e in want:
                params = {"estimate": "true", "period": api, "rank_mode": asked}
                if region is not None:
                    params["region"] = region
                got = await http.get(f"/v1/boards/{board.config.id}/players/{e.player_id}", params=params)
                assert got.status_code == 200, got.text
                guess = got.json()
                assert guess["players"] == len(want), (name, region, asked, guess)
                assert guess["points"] == e.points
                assert abs(guess["rank"] - e.rank) <= guess["rank_error"], (name, region, asked, e, guess)
            # The router's own reads of the view: its cached top, a page, a rank, friends.
            params = {"period": api, "rank_mode": asked} | ({"region": region} if region else {})
            at = f"/v1/boards/{board.config.id}"
            body = [entry_body(e) for e in want]
            top = await http.get(f"{at}/top", params={**params, "limit": str(len(want) + 5)})
            assert top.status_code == 200 and top.json()["entries"] == body, (name, region, asked)
            page = await http.get(f"{at}/entries", params={**params, "offset": "2", "limit": "5"})
            assert page.status_code == 200 and page.json()["entries"] == body[2:7], (name, region, asked)
            friends = [e.player_id for e in want[::3]] + ["nobody"]
            query = await http.post(f"{at}/players:query", params=params, json={"player_ids": friends})
            assert query.status_code == 200 and query.json()["entries"] == body[::3], (name, region, asked)
            if want:
                one = await http.get(f"{at}/players/{want[-1].player_id}", params=params)
                assert one.status_code == 200 and one.json()["rank"] == want[-1].rank


async def home(board: Board, ref: ReferenceBoard, scores: list[Score], now: int) -> None:
    """Results that may home players, applied by one client, and compared status by status."""
    got = await board.submit(scores, now_ms=now)
    assert [(r.status, r.points) for r in got] == ref.submit(scores, now_ms=now)


# Each mode once, both orders (all six took the suite's time).
@pytest.mark.parametrize(("mode", "order"), [("best", "desc"), ("incr", "asc"), ("set", "asc")])
async def test_concurrent_clients_on_a_region_board_match_the_reference(
    store: BoardStore,
    raw: Any,
    rebuilder: Rebuilder,
    postgres_url: str,
    cluster_url: str,
    mode: str,
    order: str,
) -> None:
    rng = random.Random(f"region-workloads/{mode}/{order}")
    config = BoardConfig.from_dict(
        f"regionwork-{mode}-{order}-{uuid.uuid4().hex[:6]}",
        {
            "mode": mode,
            "order": order,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "periods": ["daily"],
            "points_max": 1000,
            "close_grace": 7 * 86_400,  # yesterday stays open: it takes results
            "sharding": {"strategy": "region", "regions": REGIONS, "shards_per_region": 2},
        },
    )
    await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    players = [f"p{i:02d}" for i in range(PLAYERS)]
    try:
        async with clients(cluster_url, config.id, CLIENTS) as boards:
            # Every player homed, one client after the other; a third of them named a second
            # region in a later batch (a conflict: nothing written).
            region_of = {p: rng.choice(REGIONS) for p in players}
            for k, board in enumerate(boards):
                mine = players[k::CLIENTS]
                await home(
                    board, ref, [result(rng, mode, p, region_of[p], now, f"h{k}-{p}") for p in mine], now
                )
            sent: list[Score] = []

            async def writer(board: Board, seed: int) -> None:
                wrng = random.Random(seed)
                for step in range(12):
                    batch = []
                    for i in range(wrng.randint(1, 10)):
                        player = wrng.choice(players)
                        region = region_of[player] if wrng.random() < 0.7 else wrng.choice(REGIONS)
                        batch.append(result(wrng, mode, player, region, now, f"c{seed}-{step}-{i}"))
                    if sent and wrng.random() < 0.3:  # retries, some naming another region
                        for old in wrng.sample(sent, min(3, len(sent))):
                            batch.append(
                                old._replace(region=wrng.choice(REGIONS)) if wrng.random() < 0.3 else old
                            )
                    sent.extend(batch)
                    await board.submit(batch, now_ms=now)
                    await asyncio.sleep(0)

            await asyncio.gather(*(writer(b, i) for i, b in enumerate(boards)))
            ref.submit(sent, now_ms=now)
            assert any(r.region != region_of[r.player_id] for r in sent)  # conflicts were sent
            await check_everything(boards[0], ref, rng, now, cluster_url)

            # Some players removed (each by some client); later, one client after the other, they
            # and others post again, some of the removed under another region: their new home.
            gone = rng.sample(players, 8)
            for player in gone:
                await moderation.remove(boards[rng.randrange(CLIENTS)], [player], now_ms=now)
                ref.remove(player, now)
            later = now + 10 * 60_000
            for k, board in enumerate(boards):
                batch = []
                for i, player in enumerate(rng.sample(players, 12)):
                    if player not in gone:  # (one region per player in a batch)
                        batch.append(result(rng, mode, player, region_of[player], later, f"later-{k}-{i}"))
                for i, player in enumerate(gone[k::CLIENTS]):  # back after the removal, the first
                    moved = REGIONS[(REGIONS.index(region_of[player]) + i % 2) % len(REGIONS)]
                    batch.append(Score(player, rng.randint(1, 9), f"back-{k}-{i}", later, moved))
                await home(board, ref, batch, later)
                await home(board, ref, batch[::-1], later)  # their replays, and others' own
            rehomed = [p for p in gone if ref.region_of.get(p, region_of[p]) != region_of[p]]
            assert rehomed  # some removed player did come back under another region
            await check_everything(boards[2], ref, rng, later, cluster_url)

            # Every period board lost (a PARTIAL loss, on purpose: the journals, retry records and
            # sentinels kept), then rebuilt from PostgreSQL: each player in the region of the shard
            # that applied their results, removals and new homes included.
            a = await archiver(raw, store, postgres_url)
            try:
                await drain(a)
            finally:
                await a.db.close()
            board = boards[1]
            for name in {name for name, _, _ in views(board, later)}:
                await raw.delete(*(keys.period_key(prefix, name) for prefix in board.prefixes))
            assert await board.size() == 0
            await rebuilder.rebuild(board)
            await check_everything(board, ref, rng, later, cluster_url)
    finally:
        await store.delete(config.id)


@pytest.mark.parametrize(("mode", "order"), [("best", "desc"), ("incr", "asc"), ("set", "desc")])
async def test_a_region_board_settles_in_the_reference_order(
    store: BoardStore, raw: Any, rebuilder: Rebuilder, mode: str, order: str
) -> None:
    """A closed day of a region board, its players posting under several regions (conflicts, a
    removal and a new home among them), settles from PostgreSQL in the order of the whole board."""
    rng = random.Random(f"region-settle/{mode}/{order}")
    sharding = {"strategy": "region", "regions": REGIONS, "shards_per_region": 2}
    board = await new_board(
        store, f"region-settle-{mode}-{uuid.uuid4().hex[:6]}", mode, order=order, sharding=sharding
    )
    period = day_ago(2)
    name = board.resolve(period).period
    start, end = period_bounds(board, name)
    ref = ReferenceBoard(board.config)
    region_of = {f"p{i:02d}": rng.choice(REGIONS) for i in range(30)}
    try:
        for step in range(6):
            batch = []
            for i, player in enumerate(rng.sample(sorted(region_of), 15)):
                region = region_of[player] if rng.random() < 0.7 else rng.choice(REGIONS)
                batch.append(
                    result(rng, mode, player, region, rng.randrange(start, end, 1000), f"s{step}-{i}")
                )
            batch = [s._replace(achieved_ms=max(s.achieved_ms or start, start)) for s in batch]
            await home(board, ref, batch, end - 1)
            if step == 2:
                for player in rng.sample(sorted(ref.region_of), 3):
                    await moderation.remove(board, [player], now_ms=end - 60 * 60_000)
                    ref.remove(player, end - 60 * 60_000)
                    region_of[player] = REGIONS[(REGIONS.index(region_of[player]) + 1) % len(REGIONS)]
        await drain_all(raw, store, rebuilder.db.info.dsn)
        sid = f"region-{mode}-{order}-{uuid.uuid4().hex[:6]}"
        result_ = await Settler(rebuilder).settle(
            board, period, Request.of({"settlement_id": sid, "rewards": TABLE, "top_n": 7})
        )
        assert result_["check"]["drifting"] == [] and result_["forced"] is False
        assert result_["players"] == len(ref.order(name))
        want = expected_awards(ref, period, board)
        assert want and await awards_of(rebuilder.db, sid) == want
    finally:
        await store.delete(board.config.id)
