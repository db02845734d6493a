"""bench/scaleout.py: where the masters and the load generator run, the per-operation arithmetic and
the tables (no server), and one tiny run on private clusters of 1 and 2 masters."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from bench import scaleout
from bench.workload import Workload


def test_masters_go_round_robin_and_the_load_generator_to_the_emptiest_cpu() -> None:
    p = scaleout.placement
    assert p(1, [0, 1]) == scaleout.Placement((0,), 1)  # a core each: nothing shared
    assert not p(1, [0, 1]).shared()
    assert p(2, [0, 1]) == scaleout.Placement((0, 1), 1)
    assert p(3, [0, 1]) == scaleout.Placement((0, 1, 0), 1)  # beside the CPU's one master, not two
    assert p(2, [0, 1]).shared() and p(3, [0, 1]).shared()
    assert p(3, [3, 1, 2, 0]) == scaleout.Placement((0, 1, 2), 3)
    assert not p(3, [0, 1, 2, 3]).shared()
    assert p(2, [5]) == scaleout.Placement((5, 5), 5)
    with pytest.raises(ValueError):
        p(0, [0])
    with pytest.raises(ValueError):
        p(1, [])


STAT = """cpu  30 0 10 100 0 0 0 0 0 0
cpu0 10 1 4 50 5 1 1 3 0 0
cpu1 20 0 6 50 0 0 0 0 0 0
intr 12345
"""


def test_cpu_ticks_and_busy_shares_from_proc_stat() -> None:
    before = scaleout.cpu_ticks(STAT)
    assert before == {0: (17, 3, 75), 1: (26, 0, 76)}  # busy = user nice system irq softirq
    after = {0: (17 + 45, 3 + 5, 75 + 100), 1: (26 + 100, 0, 76 + 100)}
    assert scaleout.busy_shares(before, after) == {0: 0.45, 1: 1.0}


def test_figures_split_a_phase_per_master_and_give_the_busiest_masters_ceiling() -> None:
    # 100,000 writes in 10 s; the masters spent 0.5 and 0.3 CPU s, the load generator 4 s, and the
    # CPUs 6 s busy in all: 0.12 core that none of them took.
    f = scaleout.figures(100_000, 10.0, [0.5, 0.3], 4.0, 6.0)
    assert f["ops_per_s"] == 10_000
    assert f["redis_us_per_op"] == [5.0, 3.0] and f["redis_us_per_op_all"] == 8.0
    assert f["ceiling_per_s"] == 200_000  # the busiest master fills a core at 1e6 / 5 us
    assert f["master_cores"] == [0.05, 0.03]
    assert (f["driver_us_per_op"], f["driver_cores"], f["other_cores"]) == (40.0, 0.4, 0.12)
    assert scaleout.figures(0, 10.0, [0.1], 1.0, 2.0) == {"ops": 0, "ops_per_s": 0.0}


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scaleout.Settings.from_env() == scaleout.Settings()
    monkeypatch.setenv("SHARDLB_SCALEOUT_MASTERS", "1,3")
    monkeypatch.setenv("SHARDLB_SCALEOUT_PLAYERS", "1000")
    monkeypatch.setenv("SHARDLB_SCALEOUT_SECONDS", "2")
    s = scaleout.Settings.from_env()
    assert (s.masters, s.players, s.seconds) == ((1, 3), 1000, 2)
    monkeypatch.setenv("SHARDLB_SCALEOUT_SECONDS", "0")
    with pytest.raises(SystemExit, match="SHARDLB_SCALEOUT_SECONDS"):
        scaleout.Settings.from_env()


def fake_point(masters: int, writes: float, write_us: list[float], reads: float) -> dict[str, object]:
    phase = scaleout.figures(int(writes * 10), 10.0, [us * writes * 10 / 1e6 for us in write_us], 1.0, 2.0)
    read = scaleout.figures(int(reads * 10), 10.0, [20 * reads * 10 / 1e6] * masters, 1.0, 2.0)
    where = scaleout.placement(masters, [0, 1])
    return {
        "masters": masters,
        "placement": {"masters": list(where.masters), "driver": where.driver},
        "writes": {**phase, "cpu_busy": {0: 0.9, 1: 1.0}, "errors": 0},
        "reads": {**read, "cpu_busy": {0: 0.5, 1: 1.0}, "errors": 2},
        "board_mib_on_masters": [10.0 / masters] * masters,
        "shards_on_masters": [1] * masters,
    }


def test_the_markdown_has_a_row_per_cluster_and_the_ratios() -> None:
    result = {
        "name": "scaleout-test",
        "machine": {"cpus": 2, "cpu_model": "test CPU", "redis": "Redis 7"},
        "cpus": [0, 1],
        "settings": vars(scaleout.Settings()),
        "workload": {"players": 1000},
        "points": [fake_point(1, 10_000, [10.0], 5000), fake_point(3, 12_000, [4.0, 3.0, 3.0], 4000)],
    }
    md = scaleout.markdown(result)
    writes = scaleout.table(result["points"], "writes", "writes")
    assert writes[2].startswith("| 1 | 0 / 1 | 10,000 | 10 | 10.0 | 100,000 |")
    assert writes[3].startswith("| 3 | 0 / 1 / 0 / 1 | 12,000 | 4 / 3 / 3 | 10.0 | 250,000 |")
    assert writes[3].endswith("| 90% / 100% | 0.0 | 0 |")
    assert "| 3 | 3.33333 / 3.33333 / 3.33333 | 1 / 1 / 1 |" in md
    # Writes: 1.2x measured, 2.5x at a core per master; reads: every master pays for each read.
    assert "writes/s 1.20x, writes/s at 1 core per master 2.50x" in md
    assert "reads/s 0.80x, reads/s at 1 core per master 1.00x" in md
    assert "Redis µs per read in all masters 3.00x" in md
    assert scaleout.TWO_CORES in md
    assert "Other load on the machine" not in md  # no wait for quiet asked
    for p, load in zip(result["points"], (0.1, 0.25), strict=True):
        p["load_before_cores"] = load
    result["settings"] = {**result["settings"], "quiet_wait": 60}
    assert "(after waiting up to 60 s for it to drop): 0.1 / 0.25 cores." in scaleout.markdown(result)


@pytest.mark.slow
def test_a_tiny_run_pins_every_master_and_measures_both_phases(tmp_path: Path) -> None:
    s = replace(scaleout.Settings(), masters=(1, 2), players=2000, seconds=1, read_tasks=4)
    workload = replace(Workload(), board="scaleout", players=s.players)
    result = scaleout.run(s, workload, tmp_path)
    assert result["cpus"] == sorted(os.sched_getaffinity(0))
    for point, masters in zip(result["points"], (1, 2), strict=True):
        assert point["masters"] == point["shards"] == masters
        assert point["shards_on_masters"] == [1] * masters
        assert [p["affinity"] for p in point["pinned"]] == [[cpu] for cpu in point["placement"]["masters"]]
        for kind in ("writes", "reads"):
            f = point[kind]
            assert f["ops"] > 0 and f["errors"] == 0, f
            assert len(f["redis_us_per_op"]) == masters and min(f["redis_us_per_op"]) > 0
    assert os.sched_getaffinity(0) == set(result["cpus"])  # the load generator's pin was undone
    assert not list(tmp_path.iterdir())  # each cluster's folder removed
