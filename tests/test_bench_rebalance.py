"""bench/rebalance.py (`make bench-rebalance`): a tiny run on a private pinned cluster, and its table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench import rebalance
from shardlb.board import band_skew

pytestmark = pytest.mark.cluster


def test_a_tiny_run_draws_even_bands_again_and_meters_every_phase(tmp_path: Path) -> None:
    s = rebalance.Settings(players=3000, seconds=1, tasks=4)
    result = rebalance.run(s, tmp_path)
    assert result["settings"]["players"] == 3000
    assert band_skew(result["loaded_band_sizes"]) < 1.2  # the first starts fit the first points
    drifted, redrawn = result["drifted"], result["redrawn"]
    assert drifted["bands"] == [0, 333, 666] and sum(drifted["band_sizes"]) == 3000
    assert drifted["band_sizes"][0] > 0.7 * 3000  # the season lifted most players into the top band
    assert redrawn["bands"] != drifted["bands"] and sum(redrawn["band_sizes"]) == 3000
    assert band_skew(redrawn["band_sizes"]) < 1.2  # the new starts part them evenly again
    for part in (drifted, redrawn):
        for kind in ("exact", "kept"):
            f = part[kind]
            assert f["ops"] > 0 and f["errors"] == 0, f
            assert len(f["redis_us_per_op"]) == rebalance.MASTERS and f["ceiling_per_s"] > 0, f
    assert result["reshard_s"] > 0
    assert os.sched_getaffinity(0) == set(result["cpus"])  # the load generator's pin was undone
    lines = rebalance.table(result)
    assert lines[0].startswith("# shardlb bench-rebalance (3,000 players, 3 masters)")
    assert sum(1 for line in lines if line.startswith("| exact") or line.startswith("| max_age_ms")) == 4
    assert any(line.startswith("- kept: the busiest master's ceiling") for line in lines)
