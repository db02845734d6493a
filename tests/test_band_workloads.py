"""Band boards under random workloads from several clients, against the in-memory reference board.

Players cross band limits in both directions (incr and best boards only rise; set boards go down
too), some band calls are lost on the way (the home shard took the result, a band shard did not:
the move stays pending), and once writes are quiescent and the pending moves repaired
(``Board.repair``, the archiver's pass) every read in both rank modes equals the reference: top,
pages at every offset, each player's rank, around, friends, the board's size. The final state of a
board does not depend on the order concurrent results were applied in (max, sum, latest time),
so the reference takes them in any order.

Removals named by requests (the router's X-Request-Id) join in: calls lost before or after a home
shard's script ran, retries of the same request after the players posted again, the versions of
removed players forgotten by prune passes an hour later (the clock moved with ``now_ms``), retries
meeting players already forgotten, players coming back after that; the reference removes only what
was achieved before a request's first call (tests/reference.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import random
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from shardlb import keys, moderation, periods, times
from shardlb.board import Board, Score
from shardlb.config import RANK_MODES, BoardConfig
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.test_band_repair import LoseBandCalls
from tests.test_board_ranks import check_ranks, expected
from tests.test_reshard import Router

pytestmark = pytest.mark.cluster

CLIENTS = 3
PLAYERS = 40


@contextlib.asynccontextmanager
async def clients(url: str, board_id: str, count: int) -> AsyncIterator[list[Board]]:
    """``count`` board objects, each on a connection of its own (several routers)."""
    made = [connect(url) for _ in range(count)]
    try:
        boards = []
        for client in made:
            scripts = Scripts.register(client)
            await scripts.load(client)
            boards.append(await BoardStore(client, scripts).get(board_id))
        yield boards
    finally:
        for client in made:
            await client.aclose()


def points(rng: random.Random, mode: str) -> int:
    return rng.randint(0, 12) if mode == "incr" else rng.choice([0, 5, 39, 40, 41, 120, 299, 300, 999])


def results(rng: random.Random, mode: str, now: int, tag: str, count: int) -> list[Score]:
    """Random results: few points values (ties), spread over every band; incr adds small steps
    that never pass points_max, so no result overflows whatever order they are applied in."""
    out = []
    for i in range(count):
        player = f"p{rng.randrange(PLAYERS):02d}"
        out.append(Score(player, points(rng, mode), f"{tag}-{i}", now - rng.randint(0, 3) * 1000))
    return out


async def check_everything(board: Board, ref: ReferenceBoard, rng: random.Random, now: int) -> None:
    day = periods.names_at(now, board.config.periods, board.tz)[1]
    for name, api in (("total", "total"), (day, "daily:" + day[2:])):
        for asked in RANK_MODES:
            await check_ranks(board, ref, name, api, None, asked, rng)
    want = expected(ref, "total", None, "unique")
    for e in want:  # the other bands' sizes as the exact reads above left them
        got = await board.player(e.player_id, max_age_ms=60_000, rank_mode="unique")
        assert (got.entry, got.players) == (e, len(want))


FEW = [0, 40, 120, 300]
MANY = [0, 5, 20, 39, 40, 41, 100, 120, 200, 299, 300, 600, 999]  # past ONE_ROUND_BANDS


# Each mode, each order and each number of bands at least once (all twelve took the suite's time).
@pytest.mark.parametrize(
    ("mode", "order", "bands"),
    [("best", "desc", FEW), ("incr", "asc", MANY), ("set", "desc", MANY), ("set", "asc", FEW)],
    ids=["best-desc-few", "incr-asc-many", "set-desc-many", "set-asc-few"],
)
async def test_concurrent_band_crossings_with_lost_band_calls_match_the_reference(
    store: BoardStore, cluster_url: str, mode: str, order: str, bands: list[int]
) -> None:
    rng = random.Random(f"band-workloads/{mode}/{order}/{len(bands)}")
    config = BoardConfig.from_dict(
        f"bandwork-{mode}-{order}-{uuid.uuid4().hex[:6]}",
        {
            "mode": mode,
            "order": order,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "periods": ["daily"],
            "points_max": 1000,
            "sharding": {"strategy": "band", "bands": bands, "shards": 3},
        },
    )
    await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    try:
        async with clients(cluster_url, config.id, CLIENTS) as boards:
            for k, board in enumerate(boards[1:]):  # two of them lose a band call now and then
                losing = LoseBandCalls(board.scripts.band, rng=random.Random(k), share=0.15)
                board.scripts = dataclasses.replace(board.scripts, band=losing)
            sent: list[Score] = []

            async def writer(board: Board, seed: int) -> None:
                wrng = random.Random(seed)
                for step in range(15):
                    batch = results(wrng, mode, now, f"c{seed}-{step}", wrng.randint(1, 12))
                    if sent and wrng.random() < 0.2:
                        batch += wrng.sample(sent, min(3, len(sent)))  # retries of results sent
                    sent.extend(batch)
                    with contextlib.suppress(ConnectionError):  # applied at home, move pending
                        await board.submit(batch, now_ms=now)
                    await asyncio.sleep(0)

            await asyncio.gather(*(writer(b, i) for i, b in enumerate(boards)))
            ref.submit(sent, now_ms=now)
            await boards[0].repair()
            await check_everything(boards[0], ref, rng, now)
            # Some players removed (their band calls lost now and then), then results of later
            # ones, some of the same players, one client after the other.
            for player in rng.sample(sorted(ref.boards["total"]), 6):
                with contextlib.suppress(ConnectionError):
                    await moderation.remove(boards[rng.randrange(CLIENTS)], [player], now_ms=now)
                ref.remove(player, now)
            later = now + 10 * 60_000
            for k, board in enumerate(boards):
                batch = results(rng, mode, later, f"later-{k}", 15)
                with contextlib.suppress(ConnectionError):
                    await board.submit(batch, now_ms=later)
                ref.submit(batch, now_ms=later)
            await boards[0].repair()  # the client that loses no band call
            await check_everything(boards[2], ref, rng, now)
    finally:
        await store.delete(config.id)


MINUTE = 60_000
DAY = 86_400_000


class LoseRemovals:
    """moderation.remove_on_shard behind routers that lose calls: each call is lost before it is
    sent (the shard's remove.lua never runs: 'before') or after it ran (its reply lost: 'after'),
    as ``plan`` says for the next calls ('ok': goes through), then at random with ``share``. ``ran``
    collects the players whose shard's remove.lua ran, where a band call failed after it too
    (LoseBandCalls). moderation.remove gathers its shards' calls and raises the first failure while
    the others go on: ``quiet`` waits for them."""

    def __init__(self, real: Callable[..., Awaitable[list[str]]], rng: random.Random, share: float) -> None:
        self.real, self.rng, self.share = real, rng, share
        self.plan: list[str] = []
        self.ran: set[str] = set()
        self.running = 0

    async def __call__(
        self, board: Board, shard: int, players: Sequence[str], *args: Any, **kw: Any
    ) -> list[str]:
        fault = self.plan.pop(0) if self.plan else ""
        if fault == "" and self.rng.random() < self.share:
            fault = self.rng.choice(["before", "after"])
        if fault == "before":
            raise ConnectionError("the removal's call to the shard was lost")
        self.running += 1
        try:
            got = await self.real(board, shard, players, *args, **kw)
        except ConnectionError:  # a band call lost: remove.lua ran on the home shard before it
            self.ran.update(players)
            raise
        finally:
            self.running -= 1
        self.ran.update(players)
        if fault == "after":
            raise ConnectionError("the removal's reply was lost")
        return got

    async def quiet(self) -> None:
        while self.running:
            await asyncio.sleep(0.01)


async def check_periods(board: Board, ref: ReferenceBoard, rng: random.Random) -> None:
    """Every read of every period the reference holds, in both rank modes."""
    for name in sorted(ref.boards):
        api = "total" if name == "total" else "daily:" + name[2:]
        for asked in RANK_MODES:
            await check_ranks(board, ref, name, api, None, asked, rng)


@pytest.mark.parametrize(
    ("mode", "order", "bands"),
    [("best", "desc", FEW), ("incr", "asc", MANY)],
    ids=["best-desc-few", "incr-asc-many"],
)
async def test_removals_retried_by_request_and_versions_pruned_match_the_reference(
    store: BoardStore,
    cluster_url: str,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    order: str,
    bands: list[int],
) -> None:
    """Removals named by requests (the router's X-Request-Id) on a band board with several clients:
    their calls lost before or after a home shard's script ran and their band calls lost now and
    then, retried with the same request after the players posted again (results achieved since stay,
    replays of before do not), the removed players' versions forgotten by prune passes once the
    removals are an hour old (the clock moved with now_ms), retried again after that, the players
    coming back after it, beside another prune. After a repair every read of every period equals the
    reference (tests/reference.py: a removal retried with its request removes only what was achieved
    before its first call's time), every call that answered answered as the reference, and once
    every removal is old, the prune leaves versions only of the players on the board."""
    rng = random.Random(f"band-requests/{mode}/{order}")
    config = BoardConfig.from_dict(
        f"bandreq-{mode}-{order}-{uuid.uuid4().hex[:6]}",
        {
            "mode": mode,
            "order": order,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "periods": ["daily"],
            "points_max": 1000,
            "dedup_window_s": 3600,  # the prune's hour
            "sharding": {"strategy": "band", "bands": bands, "shards": 3},
        },
    )
    await store.create(config)
    ref = ReferenceBoard(config)
    # The first removals' day ends before the players post again: a best board's older total goes
    # with a retry while a worse result of the new day stays.
    start = (times.now_ms() // DAY + 1) * DAY - 7 * MINUTE
    losing = LoseRemovals(moderation.remove_on_shard, random.Random(f"lose/{mode}"), share=0.3)
    monkeypatch.setattr(moderation, "remove_on_shard", losing)
    try:
        async with clients(cluster_url, config.id, CLIENTS) as boards:
            for k, board in enumerate(boards[1:]):  # two of them lose a band call now and then
                band = LoseBandCalls(board.scripts.band, rng=random.Random(k), share=0.15)
                board.scripts = dataclasses.replace(board.scripts, band=band)

            async def post(at: int, batches: list[list[Score]]) -> None:
                """One batch per client at once (max and sum: the order they land in is free)."""

                async def one(board: Board, batch: list[Score]) -> None:
                    with contextlib.suppress(ConnectionError):  # applied at home, move pending
                        await board.submit(batch, now_ms=at)

                await asyncio.gather(*(one(boards[k % CLIENTS], b) for k, b in enumerate(batches)))
                ref.submit([s for b in batches for s in b], now_ms=at)

            async def remove(players: list[str], request: str, at: int) -> bool:
                """One call of the removal ``request``; the reference takes the players it reached."""
                losing.ran.clear()
                try:
                    got = await moderation.remove(boards[rng.randrange(CLIENTS)], players, at, request)
                except ConnectionError:
                    got = None
                await losing.quiet()
                answers = {p: ref.remove(p, at, request) for p in players if p in losing.ran}
                if got is not None:
                    assert got == {p for p, removed in answers.items() if removed}, request
                return got is not None

            def each(players: list[str], tag: str, at: int) -> list[list[Score]]:
                """A result of each player achieved at ``at``, each in a batch of its own."""
                return [[Score(p, points(rng, mode), f"{tag}-{p}", at)] for p in players]

            async def until_done(requests: list[tuple[str, list[str]]], at: int) -> None:
                for request, players in requests:
                    for attempt in range(30):
                        if await remove(players, request, at + attempt * 1000):
                            break
                    else:
                        pytest.fail(f"{request} never went through")

            sent: list[Score] = []
            for step in range(4):  # the first day: every client at once, retries among them
                batches = [
                    results(rng, mode, start, f"a{step}-{k}", rng.randint(4, 12)) for k in range(CLIENTS)
                ]
                if sent:
                    batches[0] += rng.sample(sent, 3)
                sent += [s for b in batches for s in b]
                await post(start, batches)
            await boards[0].repair()

            # Removals of one to four players, one call each, many of them lost on a shard; the
            # first is lost on its first player's shard and reaches the others' (a retry of it then
            # removes that player at its time), one names a player never seen.
            homes = {p: boards[0].layout.home(p) for p in ref.boards["total"]}
            a = ref.order()[0][1]  # the leader: a worse result of theirs leaves the total as it was
            first = [a, *{homes[p]: p for p in sorted(homes, reverse=True) if homes[p] != homes[a]}.values()]
            requests = [("remove/r0", first)]
            others = sorted(set(homes) - set(first))
            requests += [(f"remove/r{r}", rng.sample(others, rng.randint(1, 3))) for r in range(1, 6)]
            requests[-1][1].append("never")
            removed = sorted({p for _, players in requests for p in players} - {"never"})
            at = start + MINUTE
            losing.plan = ["before", "ok", "ok"]  # the first player's shard comes first
            for request, players in requests:
                await remove(players, request, at)
            assert a not in ref.requests["remove/r0"][1] and first[1] in ref.requests["remove/r0"][1]

            # A new day: later results, half of the removed players' among them (achieved after
            # the removals), and replays of results of before (refused where a removal ran).
            later = start + 10 * MINUTE
            back = [p for p in rng.sample(removed, len(removed) // 2) if p != a]
            batches = [results(rng, mode, later, f"b-{k}", 6) for k in range(CLIENTS)]
            batches[0] += [Score(p, points(rng, mode), f"back-{p}", later) for p in back]
            batches[0].append(Score(a, 1 if mode == "incr" else 0, "back-a", later))  # worse than before
            batches[1] += [s for s in sent if s.player_id in removed][:10]
            await post(later, batches)
            await until_done(requests, later + 2 * MINUTE)  # the retries, till each went through

            # An hour after the removals: the repair, then a prune pass forgets the versions of the
            # players still gone.
            await boards[0].repair()
            assert await boards[0].prune(start + 62 * MINUTE) > 0
            # Each request once more (every shard has its record: nothing changes, and it answers
            # as its first call did), then the players still gone come back, both beside a prune
            # of another client a while later.
            pruned = asyncio.create_task(boards[1].prune(start + 75 * MINUTE))
            await until_done(requests, start + 63 * MINUTE)
            gone = [p for p in removed if p not in ref.boards["total"]]
            await post(start + 64 * MINUTE, each(gone, "c", start + 64 * MINUTE))
            await pruned

            # Removals again, some of the players who came back among them, results before and
            # after their records, and their retries.
            on_board = sorted(ref.boards["total"])
            again = [(f"remove/s{r}", rng.sample(on_board, rng.randint(1, 3))) for r in range(4)]
            again[0][1][0:1] = gone[:1]
            for request, players in again:
                await remove(players, request, start + 80 * MINUTE)
            struck = sorted({p for _, players in again for p in players})
            await post(start + 83 * MINUTE, each(struck, "d", start + 83 * MINUTE))
            await post(start + 90 * MINUTE, each(struck[::2], "e", start + 90 * MINUTE))
            await until_done(again, start + 92 * MINUTE)

            await boards[0].repair()  # the client that loses no band call
            await check_periods(boards[2], ref, rng)
            want = expected(ref, "total", None, "unique")
            assert await boards[2].size() == len(want)

            # Hours later every removal is old: the prune forgets every removed player's versions,
            # and the shards keep versions only of the players on the board.
            while await boards[0].prune(start + 5 * 60 * MINUTE):
                pass
            held = set()
            for prefix in boards[0].prefixes:
                held |= {str(p) for p in await store.client.hkeys(keys.version_key(prefix))}
            assert held <= set(ref.boards["total"]), held - set(ref.boards["total"])
    finally:
        await store.delete(config.id)


async def bands_apply(url: str, board_id: str, count: int) -> subprocess.CompletedProcess[str]:
    """`shardlb bands BOARD --count N --apply` in a process of its own."""
    command = [sys.executable, "-m", "shardlb", "bands", board_id, "--count", str(count), "--apply"]
    command += ["--redis", url]
    return await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("mode", "order"), [("incr", "desc"), ("set", "asc"), ("best", "asc")])
async def test_a_rebalance_in_the_middle_of_writes_ends_equal_to_the_reference(
    store: BoardStore, cluster_url: str, mode: str, order: str
) -> None:
    """Skewed bands (most players in one), writers on several clients (two losing band calls now and
    then) while `shardlb bands --apply` draws new band starts and reshards: every write refused at the
    cut-over is sent again (same match ids), and once they stop, every read equals the reference."""
    rng = random.Random(f"band-rebalance/{mode}/{order}")
    config = BoardConfig.from_dict(
        f"bandrebal-{mode}-{order}-{uuid.uuid4().hex[:6]}",
        {
            "mode": mode,
            "order": order,
            "tiebreak": rng.choice(["earliest", "latest"]),
            "periods": ["daily"],
            "points_max": 1000,
            "durability": "memory",  # a journaled board's reshard also moves its archive
            "sharding": {"strategy": "band", "bands": [0, 900], "shards": 2},
        },
    )
    await store.create(config)
    ref = ReferenceBoard(config)
    now = times.now_ms()
    # Players the writers never touch, with distinct points and most of them in the lower band: the
    # skew `--apply` must fix. The writers' own players soon sit on a few values (a best board's
    # players reach its best choice), which no new starts can split: how far they got by the time
    # the command read the board decided whether it resharded, so a quiet machine failed this.
    sent = [Score(f"q{i:03d}", 1 + i * 4, f"pre-{i}", now - 1000) for i in range(200)]
    sent += [Score(f"r{i:03d}", 901 + i, f"pre-r{i}", now - 1000) for i in range(20)]
    await (await store.get(config.id)).submit(sent, now_ms=now)
    try:
        async with clients(cluster_url, config.id, CLIENTS) as boards:
            routers = [Router(store, config.id) for _ in boards]
            for router, board in zip(routers, boards, strict=True):
                router.store = BoardStore(board.client, board.scripts)
            done = asyncio.Event()
            given: dict[str, int] = {}  # an incr board's points sent to each player, all writers

            def capped(batch: list[Score]) -> list[Score]:
                """The writers go on for as long as the reshard takes, so an incr board's players
                would pass points_max: which result overflows then depends on the order the board
                applied them in, and the reference's order is another. A result that could pass
                it carries no points."""
                if mode != "incr":
                    return batch
                out = []
                for s in batch:
                    fits = given.get(s.player_id, 0) + s.points <= config.points_max
                    out.append(s if fits else s._replace(points=0))
                    given[s.player_id] = given.get(s.player_id, 0) + out[-1].points
                return out

            async def writer(k: int) -> None:
                wrng = random.Random(k)
                step = 0
                while not done.is_set() or step < 5:
                    batch = capped(results(wrng, mode, now, f"c{k}-{step}", wrng.randint(1, 12)))
                    sent.extend(batch)
                    if k:  # this router loses a band call now and then
                        board = await routers[k].get()
                        if not isinstance(board.scripts.band, LoseBandCalls):
                            losing = LoseBandCalls(board.scripts.band, rng=random.Random(step), share=0.15)
                            board.scripts = dataclasses.replace(board.scripts, band=losing)
                    # A lost band call raises after the home shard took the batch (the move stays
                    # pending for the repair); any other ConnectionError (the cut-over's) may have
                    # come before it. The batch goes again, as a game server retries: same match
                    # ids, so it converges to one call's state and the reference's submit holds.
                    for attempt in itertools.count():
                        try:
                            await routers[k].call(lambda b, batch=batch: b.submit(batch, now_ms=now))
                            break
                        except ConnectionError:
                            # A batch given up would be in the reference and not on the board.
                            assert attempt < 3000, "a batch refused for 30 s"
                            await asyncio.sleep(0.01)
                    step += 1
                    await asyncio.sleep(0.01)

            writers = asyncio.gather(*(writer(k) for k in range(len(boards))))
            await asyncio.sleep(0.5)
            try:
                done_cli = await bands_apply(cluster_url, config.id, 4)
            finally:
                done.set()
                await writers
            assert done_cli.returncode == 0, done_cli.stderr
            assert json.loads(done_cli.stdout)["resharded"] is True, done_cli.stdout
            statuses = [status for status, _ in ref.submit(sent, now_ms=now)]
            assert "overflow" not in statuses  # else the final state would depend on the order
            board = await store.get(config.id)
            assert board.config.sharding.bands != (0, 900)
            await board.repair()
            await check_everything(board, ref, rng, now)
    finally:
        await store.delete(config.id)
