"""bench/scaleout.py: where the nodes and the load generator run, the per-operation arithmetic and
the tables (no server), and one tiny run on private clusters of 1 and 2 masters, then of 2 masters
with a replica each."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench import scaleout
from bench.latency import Phase
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


def test_replicas_follow_the_masters_round_robin_and_the_load_generator_goes_beside_the_fewest() -> None:
    p = scaleout.placement
    # Nodes in port order over CPUs 0, 1: masters 0 1 0, replicas 1 0 1; CPU 0 holds one replica.
    assert p(3, [0, 1], 1) == scaleout.Placement((0, 1, 0), 0, (1, 0, 1))
    # Two replicas each: every master's pair on both CPUs, three replicas a CPU, the last CPU then.
    assert p(3, [0, 1], 2) == scaleout.Placement((0, 1, 0), 1, (1, 0, 1, 0, 1, 0))
    assert p(3, [0, 1, 2, 3], 1) == scaleout.Placement((0, 1, 2), 2, (3, 0, 1))
    assert p(3, [0, 1], 1).shared() and not p(1, [0, 1, 2], 1).shared()
    with pytest.raises(ValueError):
        p(1, [0], -1)


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


def test_replica_figures_split_a_phase_per_replica_and_share_it_within_each_masters_group() -> None:
    # 1,000 reads in 10 s; the replicas of master 0 spent 10 and 12 ms, of master 1 8 and 8 ms.
    f = scaleout.replica_figures(1000, 10.0, [0.010, 0.012, 0.008, 0.008], [0, 0, 1, 1])
    assert f["replica_us_per_op"] == [10.0, 12.0, 8.0, 8.0] and f["replica_us_per_op_all"] == 38.0
    assert f["replica_us_per_op_busiest"] == 12.0 and f["replica_ceiling_per_s"] == 83_333
    assert f["replica_shares"] == [0.45, 0.55, 0.5, 0.5]
    assert f["replica_cores"] == [0.0, 0.0, 0.0, 0.0]
    assert scaleout.replica_figures(1000, 10.0, [0.0, 0.0], [0, 1])["replica_shares"] == [0.0, 0.0]
    assert scaleout.replica_figures(1000, 10.0, [], []) == {}  # no replicas: nothing added
    assert scaleout.replica_figures(0, 10.0, [0.1], [0]) == {}
    assert scaleout._shares(f["replica_shares"], [0, 0, 1, 1]) == "45% + 55% / 50% + 50%"


def test_the_meter_tells_the_masters_cpu_from_the_replicas() -> None:
    # Two masters, then two replicas (one of each master); 1,000 reads in 10 s. The CPUs were busy
    # 3 s in all: the nodes took 0.04 s, the load generator 1 s, other work the rest.
    meter = scaleout.Meter([], groups=[1, 0])
    tick = os.sysconf("SC_CLK_TCK")
    meter.marks = [
        ([1.0, 2.0, 3.0, 4.0], 10.0, {0: (0, 0, 0)}),
        ([1.001, 2.001, 3.02, 4.018], 11.0, {0: (3 * tick, 0, 10 * tick)}),
    ]
    phase = Phase("my rank", seconds=10.0)
    for _ in range(1000):
        phase.record("my rank", 1.0)
    f = meter.phase(phase)
    assert f["redis_us_per_op"] == [1.0, 1.0] and f["replica_us_per_op"] == [20.0, 18.0]
    assert f["replica_shares"] == [1.0, 1.0] and f["replica_ceiling_per_s"] == 50_000
    assert (f["driver_us_per_op"], f["other_cores"], f["cpu_busy"]) == (1000.0, 0.2, {0: 0.3})
    assert "replica_us_per_op" not in scaleout.Meter([], marks=meter.marks[:]).phase(phase)  # no replicas


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scaleout.Settings.from_env() == scaleout.Settings()
    monkeypatch.setenv("SHARDLB_SCALEOUT_MASTERS", "1,3")
    monkeypatch.setenv("SHARDLB_SCALEOUT_PLAYERS", "1000")
    monkeypatch.setenv("SHARDLB_SCALEOUT_SECONDS", "2")
    monkeypatch.setenv("SHARDLB_SCALEOUT_REPLICA_MASTERS", "2")
    monkeypatch.setenv("SHARDLB_SCALEOUT_REPLICAS", "1,3")
    s = scaleout.Settings.from_env()
    assert (s.masters, s.players, s.seconds) == ((1, 3), 1000, 2)
    assert (s.replica_masters, s.replicas) == (2, (1, 3))
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


def measured(points: list[dict[str, Any]], kind: str, *us: list[float], driver_s: float = 1.0) -> None:
    """Give each point a ``kind`` phase of 10,000 operations in 10 s at ``us`` µs per master."""
    for p, per_master in zip(points, us, strict=True):
        p[kind] = scaleout.figures(
            10_000, 10.0, [u * 10_000 / 1e6 for u in per_master], driver_s, driver_s + 1
        )


def fake_replica_point(replicas: int, master_us: float, group_us: float) -> dict[str, object]:
    """3 masters with ``replicas`` each; 1,000 reads/s for 10 s, each costing every master
    ``master_us`` from the primaries, and every group of replicas ``group_us`` (split evenly) from
    the replicas, while the masters then spend 0.5 µs per read."""
    reads, groups = 10_000, [g for g in range(3) for _ in range(replicas)]
    where = scaleout.placement(3, [0, 1], replicas)
    on_primaries = scaleout.figures(reads, 10.0, [master_us * reads / 1e6] * 3, 1.0, 2.0)
    on_primaries |= scaleout.replica_figures(reads, 10.0, [0.0] * len(groups), groups)
    on_replicas = scaleout.figures(reads, 10.0, [0.5 * reads / 1e6] * 3, 1.0, 2.0)
    on_replicas |= scaleout.replica_figures(
        reads, 10.0, [group_us / replicas * reads / 1e6] * len(groups), groups
    )
    return {
        "masters": 3,
        "replicas": replicas,
        "placement": {
            "masters": list(where.masters),
            "driver": where.driver,
            "replicas": list(where.replicas),
        },
        "replica_groups": groups,
        "replicas_caught_up_ms": 40 * replicas,
        "reads_from_primaries": {**on_primaries, "cpu_busy": {0: 0.5, 1: 0.7}, "errors": 0},
        "reads_from_replicas": {**on_replicas, "cpu_busy": {0: 0.6, 1: 0.8}, "errors": 1},
    }


def test_the_replicas_table_shows_each_replica_carrying_its_share_of_the_reads() -> None:
    points = [fake_replica_point(1, 20.0, 20.0), fake_replica_point(2, 20.0, 20.0)]
    rows = scaleout.replica_table(points)
    assert len(rows) == 2 + 2 * len(points)  # a row from the primaries and one from the replicas each
    assert rows[2].startswith(
        "| 1 | primaries | 0 / 1 / 0; 1 / 0 / 1; 0 | 1,000 | 60.0 | 0.0 | 0.0 | - | 50,000 |"
    )
    assert rows[3].startswith(
        "| 1 | replicas | 0 / 1 / 0; 1 / 0 / 1; 0 | 1,000 | 1.5 | 60.0 | 20.0 | 100% / 100% / 100% | 50,000 |"
    )
    assert rows[5].startswith(
        "| 2 | replicas | 0 / 1 / 0; 1 / 0 / 1 / 0 / 1 / 0; 1 | 1,000 | 1.5 | 60.0 | 10.0 "
        "| 50% + 50% / 50% + 50% / 50% + 50% | 100,000 |"
    )
    assert rows[5].endswith("| 100.0 | 60% / 80% | 0.1 | 1 |")
    findings = scaleout.replica_findings(points)
    assert findings[0].startswith("- 1 replica(s) per master: the busiest replica spent 20 µs per read")
    assert "50,000 from the primaries, 50,000 from the replicas (1.00x; the model: 1x)" in findings[0]
    assert "100,000 from the replicas (2.00x; the model: 2x)" in findings[1]
    assert (
        "CPU: 50% to 50% (the model, 1/2: 50%); each master's replicas spent 20.0 µs per read in all"
        in findings[1]
    )
    assert findings[2] == (
        "- From 1 to 2 replicas per master: the busiest replica's µs per read 0.50x, reads/s at 1 core "
        "per busiest replica 2.00x (the model: 0.50x and 2.00x); each master's replicas' µs per read in "
        "all 1.00x (the model: 1.00x, a read costing a group the same however many replicas share it)."
    )
    section = scaleout.replica_section(points, vars(scaleout.Settings()))
    assert section[0] == '## "My rank" reads from replicas (3 masters, 1, 2 replica(s) each, 16 at a time)'
    assert "(../../../router/README.md#reads-and-caches)" in section[-2]
    assert section[-2].endswith(
        "applied the preload (40 / 80 ms after its last write, with 1 / 2 replica(s) per master)."
    )
    assert scaleout.replica_section([], vars(scaleout.Settings())) == []


def test_the_markdown_has_a_row_per_cluster_and_the_ratios() -> None:
    result: dict[str, Any] = {
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
    assert "without replicas, each redis-server" in md and "from replicas" not in md
    assert "Band board" not in md  # not measured: no section
    for p, us in zip(result["points"], ([9.0], [3.0, 3.0, 6.0]), strict=True):
        p["band_reads"] = scaleout.figures(10_000, 10.0, [u * 10_000 / 1e6 for u in us], 1.0, 2.0)
        p["band_writes"] = p["writes"]
        p["band_mib_on_masters"] = [30.0 / p["masters"]] * p["masters"]
        p["band_shards_on_masters"] = [2] * p["masters"]
        p["bands"] = [0, 5000, 9000][: p["masters"]]
    md = scaleout.markdown(result)
    assert "## Band board: one home shard and one band per master (band starts by masters: 1: [0]; 3: " in md
    assert "\n".join(scaleout.table(result["points"], "band_reads", "reads")) in md
    # 1e6 / 9 against 1e6 / 6 at a core per master: 1.50x, where three times the masters would be 3.00x.
    assert (
        "Band board, from 1 to 3 master(s): reads/s at 1 core per master 1.50x (the hash board's: 1.00x;"
        in md
    )
    assert "in proportion to the masters: 3.00x); Redis µs per read in all masters 1.33x" in md
    assert "| 3 | 3.33333 / 3.33333 / 3.33333 | 1 / 1 / 1 | 10 / 10 / 10 | 2 / 2 / 2 |" in md
    assert "max_age_ms" not in md  # not measured: no table
    measured(result["points"], "band_reads_kept", [9.0], [3.0, 3.0, 0.0])
    md = scaleout.markdown(result)
    assert "\n".join(scaleout.table(result["points"], "band_reads_kept", "reads")) in md
    # 1e6 / 9 against 1e6 / 3 at a core per master: 3.00x; all masters 9 -> 6 µs per read.
    assert (
        "With `max_age_ms=1000`, from 1 to 3 master(s): reads/s at 1 core per master 3.00x (in proportion "
        "to the masters: 3.00x); Redis µs per read in all masters 0.67x." in md
    )
    measured(result["points"], "reads_kept", [6.0], [2.0, 2.0, 2.0])  # the hash board's
    md = scaleout.markdown(result)
    assert "\n".join(scaleout.table(result["points"], "reads_kept", "reads")) in md
    # 1e6 / 6 against 1e6 / 2: 3.00x; the exact reads' 1.00x; all masters 6 -> 6 µs per read.
    assert (
        "From 1 to 3 master(s): reads/s at 1 core per master 3.00x (exact: 1.00x; in proportion to the "
        "masters: 3.00x); Redis µs per read in all masters 1.00x." in md
    )
    assert "read again and again" not in md  # the polled reads: not measured, no table
    measured(result["points"], "reads_polled", [6.0], [4.0, 4.0, 4.0])
    measured(result["points"], "reads_polled_kept", [5.0], [3.0, 1.0, 1.0], driver_s=3.0)
    md = scaleout.markdown(result)
    assert "\n".join(scaleout.table(result["points"], "reads_polled_kept", "reads")) in md
    # At 3 masters 12 µs exact, 5 with max_age_ms; ceilings 1e6/6 -> 1e6/4 (1.50x), 1e6/5 -> 1e6/3 (1.67x).
    assert (
        "At 3 master(s), Redis µs per read in all masters: 12 exact, 5 with `max_age_ms`; the load "
        "generator's µs per read 100 and 300. From 1 to 3 master(s), reads/s at 1 core per master "
        "1.50x exact and 1.67x with it." in md
    )
    for p in result["points"]:
        for key in (
            "reads_kept",
            "reads_polled",
            "reads_polled_kept",
            "band_reads",
            "band_reads_kept",
            "band_writes",
            "band_mib_on_masters",
            "band_shards_on_masters",
            "bands",
        ):
            del p[key]
    result["replica_points"] = [fake_replica_point(1, 20.0, 20.0), fake_replica_point(2, 20.0, 20.0)]
    md = scaleout.markdown(result)
    assert "without replicas, then of 3 masters with 1, 2 replica(s) each, each redis-server" in md
    assert "\n".join(scaleout.replica_table(result["replica_points"])) in md
    del result["replica_points"]
    for p, load in zip(result["points"], (0.1, 0.25), strict=True):
        p["load_before_cores"] = load
    result["settings"] = {**result["settings"], "quiet_wait": 60}
    assert "(after waiting up to 60 s for it to drop): 0.1 / 0.25 cores." in scaleout.markdown(result)


@pytest.mark.slow
def test_a_tiny_run_pins_every_node_and_measures_every_phase(tmp_path: Path) -> None:
    s = replace(
        scaleout.Settings(),
        masters=(1, 2),
        players=2000,
        # Every phase runs and is measured; a short one is enough for the figures checked here (each
        # master's CPU per operation, the replicas' part), and 18 phases of 1 s took most of a minute.
        seconds=0.4,
        warmup=0.1,
        pool_matches=4000,  # each write phase's draw: 20,000 matches cost 0.4 s of CPU before it
        read_tasks=4,
        replica_masters=2,
        replicas=(1,),
    )
    workload = replace(Workload(), board="scaleout", players=s.players)
    result = scaleout.run(s, workload, tmp_path)
    assert result["cpus"] == sorted(os.sched_getaffinity(0))
    for point, masters in zip(result["points"], (1, 2), strict=True):
        assert point["masters"] == point["shards"] == masters
        assert point["shards_on_masters"] == [1] * masters
        assert [p["affinity"] for p in point["pinned"]] == [[cpu] for cpu in point["placement"]["masters"]]
        kinds = ("writes", "reads", "reads_kept", "reads_polled", "reads_polled_kept", "band_writes")
        for kind in (*kinds, "band_reads", "band_reads_kept"):
            f = point[kind]
            assert f["ops"] > 0 and f["errors"] == 0, f
            assert len(f["redis_us_per_op"]) == masters and min(f["redis_us_per_op"]) > 0
        # The band board: one home shard and one band on each master, bands at the quantiles.
        assert point["band_shards_on_masters"] == [2] * masters
        assert len(point["bands"]) == masters and point["bands"][0] == 0
    (point,) = result["replica_points"]
    assert (point["masters"], point["replicas"], point["replica_groups"]) == (2, 1, [0, 1])
    assert [p["affinity"] for p in point["pinned"]] == [
        [cpu] for cpu in point["placement"]["masters"] + point["placement"]["replicas"]
    ]
    on_primaries, on_replicas = point["reads_from_primaries"], point["reads_from_replicas"]
    for f in (on_primaries, on_replicas):
        assert f["ops"] > 0 and f["errors"] == 0, f
    # The replicas served the replica reads (each its group's whole share), the primaries the others:
    # a read's cost moved from the masters to the replicas.
    assert on_replicas["replica_shares"] == [1.0, 1.0]
    assert min(on_replicas["replica_us_per_op"]) > max(on_primaries["replica_us_per_op"])
    assert on_replicas["redis_us_per_op_all"] < on_primaries["redis_us_per_op_all"] / 2
    assert os.sched_getaffinity(0) == set(result["cpus"])  # the load generator's pin was undone
    assert not list(tmp_path.iterdir())  # each cluster's folder removed
