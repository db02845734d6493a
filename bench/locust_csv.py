"""Reading Locust's CSV output (``--csv PREFIX --csv-full-history``) into plain numbers.

Player-score writes come from the ``WRITE player-scores`` entry the locustfile fires per accepted
post, whose response length is the number of scores in it: scores = Request Count x Average Content
Size. The history file (one row a second per entry) gives the same product cumulatively, so any
window's writes/s is a difference of two rows.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

SCORES_TYPE = "WRITE"
SCORES_NAME = "player-scores"
# Locust's CURRENT_RESPONSE_TIME_PERCENTILE_WINDOW: a history row's percentiles cover this many seconds
# (not imported: importing locust monkey-patches the interpreter with gevent).
RECENT_WINDOW_S = 10.0


def _num(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan  # Locust writes N/A for a percentile with no samples yet


@dataclass(frozen=True)
class Endpoint:
    """One row of ``PREFIX_stats.csv``: latencies in ms, rates a second over the whole run."""

    type: str
    name: str
    requests: int
    failures: int
    p50: float
    p95: float
    p99: float
    max: float
    rps: float
    avg_size: float

    @property
    def key(self) -> str:
        return f"{self.type} {self.name}".strip()


def read_stats(path: Path) -> list[Endpoint]:
    """Every entry of a stats CSV, the ``Aggregated`` row included (type empty)."""
    with open(path, newline="") as f:
        return [
            Endpoint(
                row["Type"],
                row["Name"],
                int(row["Request Count"]),
                int(row["Failure Count"]),
                _num(row["50%"]),
                _num(row["95%"]),
                _num(row["99%"]),
                _num(row["Max Response Time"]),
                _num(row["Requests/s"]),
                _num(row["Average Content Size"]),
            )
            for row in csv.DictReader(f)
        ]


@dataclass(frozen=True)
class Sample:
    """One history row of one entry: cumulative counts at ``t`` (unix seconds)."""

    t: float
    users: int
    requests: int
    failures: int
    avg_size: float
    # Latency percentiles (ms) over Locust's recent window (its last 10 s) at ``t``
    p50_recent: float
    p95_recent: float
    p99_recent: float

    @property
    def items(self) -> float:
        return self.requests * self.avg_size


def read_history(path: Path, type_: str, name: str) -> list[Sample]:
    """The history rows of one entry, in time order (``--csv-full-history`` writes one per entry)."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["Type"] == type_ and row["Name"] == name:
                out.append(
                    Sample(
                        float(row["Timestamp"]),
                        int(row["User Count"]),
                        int(row["Total Request Count"]),
                        int(row["Total Failure Count"]),
                        _num(row["Total Average Content Size"]),
                        _num(row["50%"]),
                        _num(row["95%"]),
                        _num(row["99%"]),
                    )
                )
    return out


def scores_written(endpoints: list[Endpoint]) -> int:
    """Player-scores acknowledged over the run (0 when no write was accepted)."""
    for e in endpoints:
        if e.type == SCORES_TYPE and e.name == SCORES_NAME:
            return round(e.requests * e.avg_size)
    return 0


def updates(samples: list[Sample]) -> list[Sample]:
    """The samples where the count moved. In distributed mode workers report every few seconds and
    the master repeats the last total in between; only the moves carry timing."""
    out: list[Sample] = []
    for s in samples:
        if not out or s.requests != out[-1].requests:
            out.append(s)
    return out


def rate_between(samples: list[Sample], t0: float, t1: float) -> float:
    """Items a second between the first and last count updates inside [t0, t1]."""
    inside = [s for s in updates(samples) if t0 <= s.t <= t1]
    if len(inside) < 2:
        return 0.0
    return (inside[-1].items - inside[0].items) / (inside[-1].t - inside[0].t)


def best_window(samples: list[Sample], window: float = 10.0) -> float:
    """The highest items/s held over at least ``window`` seconds (between count updates): the
    sustained rate of a ramp."""
    moves = updates(samples)
    best = 0.0
    for i, first in enumerate(moves):
        for last in moves[i + 1 :]:
            if last.t - first.t >= window:
                best = max(best, (last.items - first.items) / (last.t - first.t))
                break
    return best
