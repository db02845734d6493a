"""`python -m bench.rank_cost` run tiny, as bench/README.md gives it: its own cluster, the board and
the textbook set loaded, each side's reads metered, and the medians printed for the three sides
(this checkout beside itself as ``--against``), with the commands each side's reads sent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_tiny_run_prints_each_sides_medians_and_commands() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHARDLB_REDIS_URL"}
    argv = ["--players", "300", "--reads", "60", "--readers", "4", "--rounds", "1", "--against", str(ROOT)]
    run = subprocess.run(
        [sys.executable, "-m", "bench.rank_cost", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    lines = run.stdout.splitlines()
    for side in ("this", "other", "textbook"):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {side}: "))
        assert "the textbook's" in lines[at], out[-3000:]
        assert "zrevrank 1.0 x" in lines[at + 1], out[-3000:]  # every side's one ZREVRANK a read
    assert "round 1: this" in run.stdout, out[-3000:]


def test_a_tiny_run_of_every_kind_of_read_prints_each_kinds_medians() -> None:
    """``--read``: each kind of the mix measured in turn, its medians under its own heading, with
    the commands that kind sends (friends: ZMSCORE and ZREVRANK on the textbook's side, a page its
    one ZREVRANGE)."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDLB_REDIS_URL"}
    kinds = "rank,around,friends,page,top"
    argv = ["--players", "300", "--reads", "30", "--readers", "4", "--rounds", "1", "--read", kinds]
    run = subprocess.run(
        [sys.executable, "-m", "bench.rank_cost", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    lines = run.stdout.splitlines()
    for kind in kinds.split(","):
        at = lines.index(f" {kind}:")
        assert lines[at + 1].startswith("  this: ") and "the textbook's" in lines[at + 1], out[-3000:]
        book = next(i for i in range(at, len(lines)) if lines[i].startswith("  textbook: "))
        commands = lines[book + 1]
        if kind == "friends":
            assert "zmscore 1.0 x" in commands and "zrevrank" in commands, commands
        elif kind in ("page", "top"):
            assert "zrevrange 1.0 x" in commands, commands
    assert "evalsha" in run.stdout, out[-3000:]  # the library's friends and around call scripts
