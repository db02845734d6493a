"""The raw limit: the same writes and reads as the HTTP bench, straight at the cluster through the
library, no HTTP. This is the ceiling the router can approach, measured on the same cluster and data.

Writes are batched the way the router's coalescer batches them: many matches' scores are prepared
together, grouped by shard, and every shard gets one ``apply_shard`` script call, all concurrently.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence

from bench.latency import Phase, elapsed_ms, run_phase
from bench.workload import Workload
from shardlb.board import Board, Score, by_shard

POOL_MATCHES = 20_000
LAP_STRIDE = 7919  # a prime: lap k pairs match i's players with match i + k * LAP_STRIDE's points


class MatchPool:
    """Pre-drawn matches, so the timed loop measures the library, not the random number generator.

    ``take`` hands out ``n`` matches (``draw``: and how many of their scores are fresh); a
    ``retry_share`` of them repeat an earlier match (same match id, same scores), as a game server
    retrying a post whose reply it lost. Once the pool wraps, a match comes back under a new id with
    its players paired with another match's points, different on each lap: replaying the same
    (player, points) pairs would make most writes of a long phase no-ops for a ``best`` board, which
    cost the cluster far less than the fresh results Locust posts.
    """

    def __init__(self, workload: Workload, seed: int, size: int = POOL_MATCHES) -> None:
        rng = random.Random(seed)
        self.workload = workload
        self.rng = rng
        self.matches = [workload.match(rng) for _ in range(size)]
        self.next = 0

    def take(self, n: int) -> list[Score]:
        """The scores of ``n`` matches. Once the pool wraps, its matches come back under new ids."""
        return self.draw(n)[0]

    def draw(self, n: int) -> tuple[list[Score], int]:
        """The scores of ``n`` matches, and how many of them are fresh (not a retry's). A retry
        writes nothing new (the HTTP bench counts its scores apart, bench/locustfile.py), so a driver
        counts only the fresh ones as player-scores written."""
        out: list[Score] = []
        fresh = 0
        size = len(self.matches)
        for _ in range(n):
            retry = bool(self.next) and self.rng.random() < self.workload.retry_share
            if retry:
                seq = self.rng.randrange(max(0, self.next - size), self.next)
            else:
                seq = self.next
                self.next += 1
            match_id, players = self.matches[seq % size]
            lap = seq // size
            if lap:
                match_id = f"{match_id}.{lap}"
                _, other = self.matches[(seq + lap * LAP_STRIDE) % size]
                players = [(player, points) for (player, _), (_, points) in zip(players, other, strict=False)]
            out.extend(Score(player, points, match_id) for player, points in players)
            fresh += 0 if retry else len(players)
        return out, fresh


async def write_batch(board: Board, scores: Sequence[Score]) -> int:
    """Prepare, group by shard, one script call per shard, concurrently. Returns the results the
    store answered (a retry's among them: its ``duplicate`` or ``unchanged``)."""
    prepared = board.prepare(scores)
    groups = by_shard(prepared)
    replies = await asyncio.gather(
        *(board.apply_shard(shard, [prepared[i] for i in idx]) for shard, idx in groups.items())
    )
    return sum(len(r) for r in replies)


async def writes(
    board: Board,
    workload: Workload,
    seconds: float,
    concurrency: int = 8,
    batch_matches: int = 50,
    seed: int = 1,
    name: str = "raw writes",
    scores: int = 0,
    pool_matches: int = POOL_MATCHES,
) -> Phase:
    """Batched writes for ``seconds``, or until about ``scores`` player-scores are applied if that comes
    first; one latency sample per batch of ``batch_matches`` matches. The phase's ``items`` are the
    fresh scores written, its ``replayed`` the retries' (sent in the same calls, written before).
    The pool is drawn first, ``pool_matches`` at least (a short phase needs fewer).

    With ``scores``, the pool holds enough matches that it does not wrap: a lap pairs the same players
    with other points, so on a ``best`` board a wrapped pool beats fewer bests than fresh draws (as
    Locust posts) would, and costs the store less."""
    wanted = -(-scores // workload.players_per_match) + concurrency * batch_matches if scores else 0
    pool = MatchPool(workload, seed, max(pool_matches, wanted))

    async def step(phase: Phase, _: int) -> None:
        batch, fresh = pool.draw(batch_matches)
        t0 = time.perf_counter()
        answered = await write_batch(board, batch)
        applied = min(fresh, answered)
        phase.record("write batch", elapsed_ms(t0), applied)
        phase.replayed += answered - applied

    return await run_phase(Phase(name), seconds, concurrency, step, scores)


async def read_one(board: Board, workload: Workload, rng: random.Random, kind: str) -> None:
    """One read of the mix, as the HTTP routes would issue it."""
    if kind == "top":
        await board.top(100)
    elif kind == "rank":
        await board.player(workload.player(rng))
    elif kind == "around":
        await board.around(workload.player(rng), workload.around_radius)
    elif kind == "friends":
        await board.query(workload.friends(rng))
    else:
        await board.entries(workload.page_offset(rng), workload.page_limit)


async def reads(
    board: Board,
    workload: Workload,
    seconds: float,
    concurrency: int = 16,
    seed: int = 2,
    name: str = "raw reads",
) -> Phase:
    """The read mix for ``seconds``: one latency sample per read, per kind."""

    def read(rng: random.Random, kind: str) -> Awaitable[None]:
        return read_one(board, workload, rng, kind)

    return await read_mix(name, workload, seconds, concurrency, seed, read)


async def read_mix(
    name: str,
    workload: Workload,
    seconds: float,
    concurrency: int,
    seed: int,
    read: Callable[[random.Random, str], Awaitable[None]],
) -> Phase:
    """``read(rng, kind)`` for each read of the workload's mix, for ``seconds``, ``concurrency`` at a
    time: one latency sample per read, per kind. The raw limit and the textbook read through this."""
    rng = random.Random(seed)

    async def step(phase: Phase, _: int) -> None:
        kind = workload.read_kind(rng)
        t0 = time.perf_counter()
        await read(rng, kind)
        phase.record(kind, elapsed_ms(t0))

    return await run_phase(Phase(name), seconds, concurrency, step)
