"""Load shapes as plain schedules: how many users to run at each second of a test. Pure, no Locust.

A user is paced by ``constant_throughput``, so users = target writes/s / (requests/s per user x
scores per request). When the system cannot keep up, users fall behind their pace and the achieved
rate flattens below the offered one: the plateau of a ramp is the throughput limit.

- ramp: ``steps`` equal steps from target/steps up to the target, each held duration/steps seconds.
- soak: 10 s to reach the target, then hold it for the rest of the duration.
- spike: a tenth of the target, then the whole target (10x) for 30 s, the end of an in-game event
  when every match finishes at once, then back to a tenth until the duration ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHAPES = ("ramp", "soak", "spike")
DEFAULT_SECONDS = {"ramp": 60.0, "soak": 600.0, "spike": 120.0}
SPIKE_FACTOR = 10
SPIKE_SECONDS = 30.0


@dataclass(frozen=True)
class Stage:
    """Run ``users`` users (spawned at ``spawn_rate`` a second) until ``until`` seconds into the test."""

    until: float
    users: int
    spawn_rate: float
    offered: float  # the fresh writes/s these users offer when the system keeps their pace


def users_for(writes_per_s: float, user_rps: float, scores_per_request: int) -> int:
    return max(1, math.ceil(writes_per_s / (user_rps * scores_per_request)))


def schedule(
    shape: str,
    target: float,
    seconds: float | None,
    user_rps: float,
    scores_per_request: int,
    steps: int = 6,
    fresh_share: float = 1.0,
) -> list[Stage]:
    """The stages of ``shape`` for a target of ``target`` player-score writes a second.
    ``fresh_share``: the share of the posts that are new results (1 - SHARDLB_RETRY_SHARE; the rest
    replay one already written and write nothing), so that the fresh ones meet the target."""
    if shape not in SHAPES:
        raise ValueError(f"SHARDLB_SHAPE must be one of {', '.join(SHAPES)}, not {shape!r}")
    if not 0 < fresh_share <= 1:
        raise ValueError(f"SHARDLB_RETRY_SHARE leaves {fresh_share:g} of the posts fresh: nothing to target")
    total = DEFAULT_SECONDS[shape] if seconds is None else seconds
    fresh_rps = user_rps * fresh_share

    def stage(until: float, writes: float) -> Stage:
        users = users_for(writes, fresh_rps, scores_per_request)
        # Spawning all of a step's users in about a second keeps the step's offered load honest.
        return Stage(until, users, max(10.0, float(users)), users * fresh_rps * scores_per_request)

    if shape == "ramp":
        return [stage(total * (i + 1) / steps, target * (i + 1) / steps) for i in range(steps)]
    if shape == "soak":
        ramp_s = min(10.0, total / 4)
        return [stage(ramp_s, target / 2), stage(total, target)]
    base = target / SPIKE_FACTOR
    quiet = max(0.0, (total - SPIKE_SECONDS) / 2)
    return [stage(quiet, base), stage(quiet + SPIKE_SECONDS, target), stage(total, base)]


def at(stages: list[Stage], t: float) -> Stage | None:
    """The stage in force ``t`` seconds into the test; None once the schedule is over."""
    for s in stages:
        if t < s.until:
            return s
    return None
