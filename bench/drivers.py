"""Run one non-HTTP phase (raw library, textbook, PostgreSQL) in several processes at once.

One Python process drives a few tens of thousands of writes a second at most, so a single driver
would measure itself. Each process connects on its own, waits for a common start instant, runs the
phase, and returns its Phase; the shares are merged (counts added, latencies pooled).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from bench import peers, raw
from bench.latency import Phase
from bench.workload import Workload
from shardlb.connection import Scripts, connect
from shardlb.store import BoardStore

KINDS = ("raw writes", "raw reads", "textbook writes", "textbook reads", "postgres writes", "postgres reads")


@dataclass(frozen=True)
class Job:
    """One phase for one process. ``start_at`` is a time.time() instant every process waits for;
    ``items`` (raw writes only), when set, ends the phase at that many player-scores, shared out
    among the processes."""

    kind: str
    url: str
    workload: Workload
    seconds: float
    concurrency: int
    batch_matches: int = 100
    pg_dsn: str = ""
    seed: int = 1
    start_at: float = 0.0
    items: int = 0


async def _run(job: Job) -> Phase:
    w = job.workload
    if job.kind.startswith("postgres"):
        await _wait(job.start_at)
        if job.kind == "postgres writes":
            client = connect(job.url)
            try:
                board = await BoardStore(client, Scripts.register(client)).get(w.board)
            finally:
                await client.aclose()
            return await peers.pg_writes(
                job.pg_dsn, w.board, board.codec, w, job.seconds, job.concurrency, job.seed
            )
        return await peers.pg_reads(job.pg_dsn, w.board, w, job.seconds, job.concurrency, job.seed)
    client = connect(job.url, max_connections=max(64, 4 * job.concurrency))
    try:
        scripts = Scripts.register(client)
        await scripts.load(client)
        board = await BoardStore(client, scripts).get(w.board)
        await _wait(job.start_at)
        if job.kind == "raw writes":
            return await raw.writes(
                board, w, job.seconds, job.concurrency, job.batch_matches, job.seed, scores=job.items
            )
        if job.kind == "raw reads":
            return await raw.reads(board, w, job.seconds, job.concurrency, job.seed)
        if job.kind == "textbook writes":
            return await peers.textbook_writes(
                client, w.board, board.codec, w, job.seconds, job.concurrency, job.seed
            )
        if job.kind == "textbook reads":
            return await peers.textbook_reads(client, w.board, w, job.seconds, job.concurrency, job.seed)
        raise ValueError(f"unknown job kind {job.kind!r}; one of {KINDS}")
    finally:
        await client.aclose()


async def _wait(start_at: float) -> None:
    await asyncio.sleep(max(0.0, start_at - time.time()))


def run_job(job: Job) -> Phase:
    """Entry point of one driver process."""
    return asyncio.run(_run(job))


def fan_out(job: Job, processes: int) -> tuple[Phase, list[int]]:
    """Run ``job`` in ``processes`` fresh processes at once; the merged Phase and their pids."""
    if processes <= 1:
        return run_job(replace(job, start_at=time.time())), [os.getpid()]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        # A spawned interpreter takes about a second to import everything; start together after that.
        start_at = time.time() + 2.5
        futures = [
            pool.submit(
                run_job,
                replace(job, seed=job.seed * 1000 + n, start_at=start_at, items=-(-job.items // processes)),
            )
            for n in range(processes)
        ]
        pids = list(pool._processes)
        shares = [f.result() for f in futures]
    merged = shares[0]
    for share in shares[1:]:
        merged.merge(share)
    return merged, pids
