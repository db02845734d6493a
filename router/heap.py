"""A worker's garbage collector: start-up's heap frozen, young collections rare, every pause measured.

A score post or a read makes a few hundred container objects (the parsed body, Score and Prepared
values, coroutines, futures) that live until its answer leaves. CPython collects its young
generation after a fixed number of net allocations, and every object still alive then is walked
and moved to an older generation. Under load that is every request in flight: with young
collections every 10,000 allocations, one router worker at its write maximum (a 16-shard board
of 200k players, `bench.pacer` with 256 connections posting back to back, gc callbacks timing each
collection) collected 8 to 10 times a second, each young collection walking about 20,000 live
objects and stopping the worker for a median of 5 to 8 ms, a pause that every request in flight
waits out (in four 9.5 s windows: 73-93 young and 7-9 middle collections, 480-540 ms of pauses).
At 50,000 the same load made no collection in those windows: the objects of the requests in
flight die before that many are made. The worker's CPU per score did not move measurably with it
(20.6 µs at 10,000, 20.8 at 50,000, four interleaved pairs of runs that each vary by about 8%):
what goes for certain is the pauses. The bound is still a bound: the collector runs once that
many objects pile up, so garbage in reference cycles stays below it.

``settled`` does this once the worker is up: what start-up made (modules, settings, the cluster
client) goes out of the collector's way (``gc.freeze``), young collections come at most every
``GC_YOUNG`` allocations, and each collection's pause is timed into ``shardlb_gc_pause_seconds``
(router/metrics.py) by generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import AsyncIterator
from typing import Any

from router import metrics

GC_YOUNG = 50_000
FLUSH_S = 1.0


class Pauses:
    """The collector's callback: each collection's generation and pause, kept in a plain list.

    The callback runs wherever a collection starts, possibly inside prometheus-client's lock (in
    multiprocess mode one lock guards every value), so it only appends; ``flush`` moves what it kept
    into the histogram from ordinary code, every FLUSH_S while the worker runs."""

    def __init__(self) -> None:
        self._started = 0.0
        self.pending: list[tuple[int, float]] = []

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pending.append((info["generation"], time.perf_counter() - self._started))

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for generation, seconds in pending:
            metrics.GC_PAUSE.labels(str(generation)).observe(seconds)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            self.flush()


@contextlib.asynccontextmanager
async def settled() -> AsyncIterator[Pauses]:
    """Freeze start-up's heap, make young collections rare and time every collection, until the
    worker stops (then the callback is removed: tests start several apps in one process)."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, older, oldest)
    pauses = Pauses()
    gc.callbacks.append(pauses)
    flusher = asyncio.create_task(pauses.run())
    try:
        yield pauses
    finally:
        flusher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flusher
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(pauses)
        pauses.flush()
