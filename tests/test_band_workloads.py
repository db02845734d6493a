"""Band boards under random workloads from several clients, against the in-memory reference board.

Players cross band limits in both directions (incr and best boards only rise; set boards go down
too), some band calls are lost on the way (the home shard took the result, a band shard did not:
the move stays pending), and once writes are quiescent and the pending moves repaired
(``Board.repair``, the archiver's pass) every read in both rank modes equals the reference: top,
pages at every offset, each player's rank, around, friends, the board's size. The final state of a
board does not depend on the order concurrent results were applied in (max, sum, latest time),
so the reference takes them in any order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import pytest

from shardlb import moderation, periods, times
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


def results(rng: random.Random, mode: str, now: int, tag: str, count: int) -> list[Score]:
    """Random results: few points values (ties), spread over every band; incr adds small steps
    that never pass points_max, so no result overflows whatever order they are applied in."""
    out = []
    for i in range(count):
        points = rng.randint(0, 12) if mode == "incr" else rng.choice([0, 5, 39, 40, 41, 120, 299, 300, 999])
        out.append(
            Score(f"p{rng.randrange(PLAYERS):02d}", points, f"{tag}-{i}", now - rng.randint(0, 3) * 1000)
        )
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

            async def writer(k: int) -> None:
                wrng = random.Random(k)
                step = 0
                while not done.is_set() or step < 5:
                    batch = results(wrng, mode, now, f"c{k}-{step}", wrng.randint(1, 12))
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
                    for _ in range(50):
                        try:
                            await routers[k].call(lambda b, batch=batch: b.submit(batch, now_ms=now))
                            break
                        except ConnectionError:
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
            ref.submit(sent, now_ms=now)
            board = await store.get(config.id)
            assert board.config.sharding.bands != (0, 900)
            await board.repair()
            await check_everything(board, ref, rng, now)
    finally:
        await store.delete(config.id)
