"""Reads that share a round share its one-number replies (``fanout.SharedRounds``, ``ONE_REPLY``).

Many "my rank" reads started together (as a router's concurrent requests are) on the suite's
cluster: the ranks, sizes and points are those of the same reads made one at a time and of a plain
in-memory reference, on a hash board and a band board, tied points included; and each shard's ZCARD
goes to Redis once per round instead of once per read. The spy only counts the commands handed to
the real per-node pipelines: Redis answers every one of them.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from shardlb import fanout
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.router_support import board_name

pytestmark = pytest.mark.cluster

PLAYERS = 300
READERS = 40


class Spy:
    """Counts the commands of every round sent to Redis, by name."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()
        self.rounds = 0

    def wrap(self, real: Any) -> Any:
        async def pipelines(sends: Sequence[tuple[Any, list[fanout.Command]]], timeout: float | None) -> Any:
            self.rounds += 1
            for _, commands in sends:
                self.sent.update(str(c.args[0]).upper() for c in commands)
            return await real(sends, timeout)

        return pipelines


async def loaded(store: BoardStore, sharding: dict[str, Any]) -> tuple[Board, dict[str, int]]:
    board_id = board_name("shared")
    config = BoardConfig.from_dict(board_id, {"durability": "memory", "sharding": sharding})
    board, _ = await store.create(config)
    rng = random.Random(board_id)
    points = {f"p{i}": rng.randrange(0, 400) for i in range(PLAYERS)}  # 300 players, ties certain
    for i in range(0, PLAYERS, 100):
        batch = list(points.items())[i : i + 100]
        # One time for all: equal points are equal scores, ordered by the tie rule (player id).
        await board.submit([Score(p, n, f"m-{p}", 1_790_000_000_000) for p, n in batch])
    return board, points


def reference_rank(points: dict[str, int], player: str) -> int:
    """Unique ranks of equal scores follow the sorted set's own order: the greater member first."""
    mine = points[player]
    return 1 + sum(1 for p, n in points.items() if n > mine or (n == mine and p > player))


@pytest.mark.parametrize(
    "sharding",
    [{"strategy": "hash", "shards": 3}, {"strategy": "band", "bands": [0, 100, 250], "shards": 3}],
    ids=["hash", "band"],
)
async def test_concurrent_ranks_share_one_number_replies(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch, sharding: dict[str, Any]
) -> None:
    board, points = await loaded(store, sharding)
    readers = random.Random(1).sample(sorted(points), READERS)
    alone = [await board.player(p) for p in readers]

    spy = Spy()
    monkeypatch.setattr(fanout, "_pipelines", spy.wrap(fanout._pipelines))
    together = await asyncio.gather(*(board.player(p) for p in readers))

    assert together == alone
    for player, answer in zip(readers, together, strict=True):
        assert answer.entry.player_id == player and answer.entry.points == points[player]
        assert answer.entry.rank == reference_rank(points, player) and answer.players == PLAYERS
    # Alone, each read asks every shard's size: READERS x (shards, + bands) ZCARDs. Together, one per
    # key and round at most.
    keys = len(board.prefixes)
    assert spy.rounds >= 1 and spy.sent["ZCARD"] <= keys * spy.rounds < READERS, (spy.sent, spy.rounds)
    await store.delete(board.config.id)
