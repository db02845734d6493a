"""What one timed phase of a non-HTTP driver measured: counts, errors and latencies per operation,
and the loop that runs a phase's concurrent callers until its deadline."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


def percentile(sorted_ms: list[float], q: float) -> float:
    """The q-th percentile (0-100) of an ascending list by nearest rank, as Locust reports it."""
    if not sorted_ms:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_ms)))
    return sorted_ms[rank - 1]


@dataclass
class Phase:
    """A timed phase: player-scores written (or reads done) in ``items``, latencies in ms per kind,
    and the CPU seconds the driving process(es) spent, to tell whether the driver was the limit.
    ``replayed``: the scores of exact retries a write phase sent beside its ``items``; they cost
    the store a check and write nothing new, so rates and costs per write leave them out, as the
    HTTP bench does (bench/locustfile.py)."""

    name: str
    seconds: float = 0.0
    items: int = 0
    replayed: int = 0
    errors: int = 0
    cpu_seconds: float = 0.0
    processes: int = 1
    latencies: dict[str, list[float]] = field(default_factory=dict)
    error_samples: list[str] = field(default_factory=list)

    def record(self, kind: str, ms: float, items: int = 1) -> None:
        self.latencies.setdefault(kind, []).append(ms)
        self.items += items

    def fail(self, kind: str, error: BaseException) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(f"{kind}: {type(error).__name__}: {error}")

    def merge(self, other: Phase) -> None:
        """Add another process's share of the same phase (wall time is the longest share)."""
        self.seconds = max(self.seconds, other.seconds)
        self.items += other.items
        self.replayed += other.replayed
        self.errors += other.errors
        self.cpu_seconds += other.cpu_seconds
        self.processes += other.processes
        for kind, values in other.latencies.items():
            self.latencies.setdefault(kind, []).extend(values)
        self.error_samples = (self.error_samples + other.error_samples)[:5]

    @property
    def ops(self) -> int:
        return sum(len(v) for v in self.latencies.values())

    @property
    def rate(self) -> float:
        """Items a second over the phase."""
        return self.items / self.seconds if self.seconds else 0.0

    def report(self) -> dict[str, Any]:
        """The phase as summary.json stores it."""
        per_kind = {}
        for kind, values in sorted(self.latencies.items()):
            ordered = sorted(values)
            per_kind[kind] = {
                "count": len(ordered),
                "rate": round(len(ordered) / self.seconds, 1) if self.seconds else 0.0,
                "p50": round(percentile(ordered, 50), 2),
                "p95": round(percentile(ordered, 95), 2),
                "p99": round(percentile(ordered, 99), 2),
            }
        return {
            "name": self.name,
            "seconds": round(self.seconds, 2),
            "items": self.items,
            "items_per_s": round(self.rate, 1),
            "replayed_items": self.replayed,
            "ops": self.ops,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "driver_processes": self.processes,
            "driver_cpu_seconds": round(self.cpu_seconds, 2),
            # Above ~0.9 per process the driver, not the system under test, set the pace.
            "driver_cpu_share": round(self.cpu_seconds / (self.seconds * self.processes), 2)
            if self.seconds
            else 0.0,
            "latency_ms": per_kind,
        }


Step = Callable[[Phase, int], Awaitable[None]]


async def run_phase(phase: Phase, seconds: float, concurrency: int, step: Step, items: int = 0) -> Phase:
    """Run ``concurrency`` callers of ``step`` until ``seconds`` have passed, or (with ``items``) until
    the phase has recorded that many items if that comes first; each records into phase.

    A step that raises is counted as an error in ``phase`` and the caller goes on.
    """
    cpu0, start = time.process_time(), time.perf_counter()
    end = start + seconds

    async def caller(n: int) -> None:
        while time.perf_counter() < end and not (items and phase.items >= items):
            try:
                await step(phase, n)
            except Exception as e:  # a bench reports failures, it does not stop on them
                phase.fail(type(step).__name__, e)
                await asyncio.sleep(0.01)

    await asyncio.gather(*(caller(n) for n in range(concurrency)))
    phase.seconds = time.perf_counter() - start
    phase.cpu_seconds = time.process_time() - cpu0
    return phase


def elapsed_ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000
