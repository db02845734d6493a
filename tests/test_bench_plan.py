"""The capacity planner's arithmetic on known costs, and its fallback without bench results."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from bench import plan
from shardlb.config import DEDUP_BUCKETS, PIN_SPAN

COSTS = {
    "bytes_per_player": 100.0,
    "redis_master_us_per_write": 10.0,
    "redis_replica_us_per_write": 2.0,
    "router_us_per_write": 50.0,
    "router_us_per_request": 200.0,
    "router_scores_per_request": 10.0,
    "redis_master_us_per_read": 1600.0,
    "router_us_per_read": 1000.0,
    "bytes_per_dedup_member": 100.0,
    "bytes_per_pin": 110.0,
    "redis_master_us_per_dedup_lookup": 0.5,
    "bytes_per_journal_entry": 200.0,
    "bytes_per_journaled_result": 70.0,
    "bytes_per_archived_result": 350.0,
    "journal_calls_per_shard_s": 100.0,
    "redis_node_us_per_read": 100.0,
    "redis_shard_us_per_read": 20.0,
    "band_store_read_factor": 0.5,
    "band_router_read_factor": 0.8,
    "band_store_write_factor": 2.0,
    "band_router_write_factor": 1.5,
    "band_bytes_per_player": 250.0,
    # No fixed part per script call: a master's CPU per write is the same in calls of any size
    # (the tests of the call size give one).
    "redis_master_us_per_call": 0.0,
    "redis_master_us_per_score_in_call": 10.0,
    "raw_scores_per_call": 50.0,
}
GIB = 2**30


def _main_args(tmp_path: Path, writes: int) -> list[str]:
    """`plan` for 1,000 players, ``writes``/s and no reads, on the summary in ``tmp_path``."""
    summary = str(tmp_path / "summary.json")
    return ["--players", "1000", "--writes", str(writes), "--reads", "0", "--summary", summary]


def test_writes_and_memory_size_the_masters() -> None:
    # Writes: 180k x 10 us = 1.8 cores -> 4 masters (0.5 core each), one shard each; reads: 100/s, 30%
    # from the top cache, x (100 us a node + 20 us a shard) = 0.0084 core of each group, which the
    # primaries take beside their 0.45 core of writes.
    p = plan.plan(players=1_000_000, writes=180_000, reads=100, replicas=1, periods=["total"], costs=COSTS)
    assert (p.masters, p.shards, p.read_from, p.replicas, p.reasons["masters"]) == (4, 4, "primary", 1, "CPU")
    # and each replica applies its master's writes: 180k x 2 us over the 4 masters' one replica each
    assert p.redis_cores == pytest.approx(1.8 + 4 * 100 * 0.7 * 120e-6 + 180_000 * 2e-6)
    assert p.router_cores == pytest.approx(180_000 * 50e-6 + 100 * 1e-3)
    assert p.routers == 16  # 9.1 cores / 0.6
    assert p.data_bytes == pytest.approx(1_000_000 * 100 * 1.2)
    assert p.memory_per_node_bytes == int((p.data_bytes / 4 + p.journal.bytes_per_master) * 2)
    # 2 billion players: 2e9 x 100 B x 1.2 = 223.5 GiB -> 9 masters of at most 25 GiB; 5 shards each
    # keep every shard under 50M players.
    big = plan.plan(players=2_000_000_000, writes=1, reads=0, replicas=1, periods=["total"], costs=COSTS)
    assert (big.masters, big.reasons["masters"]) == (9, "memory")
    assert big.shards == 9 * 5


def test_periods_cost_memory_and_write_cpu() -> None:
    assert plan.memory_factor(["total"]) == 1.0
    assert plan.memory_factor(["total", "daily", "monthly"]) == pytest.approx(1 + 4 * 0.1 + 14 * 0.4)
    one = plan.plan(1000, 100_000, 0, 1, ["total"], COSTS)
    two = plan.plan(1000, 100_000, 0, 1, ["total", "daily"], COSTS)
    assert two.redis_cores == pytest.approx(one.redis_cores * 1.5)


def test_reads_beyond_the_primaries_are_served_by_enough_replicas() -> None:
    # 10k reads/s x 0.7 x 120 us = 0.84 core of every group: more than a primary's 0.5, so two
    # replicas per master serve them (0.5 core each); reads do not add masters (each touches all):
    # the minimum of 3.
    p = plan.plan(1000, 1000, 10_000, 1, ["total"], COSTS)
    assert (p.masters, p.shards, p.read_from, p.replicas) == (3, 3, "replicas", 2)
    assert "2 replicas per master" in p.reasons["reads"] and "OVER BUDGET" not in p.reasons["reads"]
    assert plan.plan(1000, 1000, 0, 1, ["total"], COSTS).masters == p.masters
    # Asked for more replicas than the reads need: kept. All reads cached: the primaries suffice.
    assert plan.plan(1000, 1000, 10_000, 3, ["total"], COSTS).replicas == 3
    assert plan.plan(1000, 1000, 10_000, 1, ["total"], COSTS, cached=1.0).read_from == "primary"
    over = plan.plan(1000, 1000, 10_000_000, 1, ["total"], COSTS)
    assert over.replicas == plan.MAX_REPLICAS and "OVER BUDGET" in over.reasons["reads"]


def test_the_issue_13_target_load_gets_a_layout_that_fits() -> None:
    """100M players, 50k writes/s and 200k reads/s on the measured defaults: every group's primary
    and replicas within budget."""
    p = plan.plan(100_000_000, 50_000, 200_000, 1, ["total"], dict(plan.DEFAULTS))
    c = plan.DEFAULTS
    group = (
        200_000 * 0.7 * (c["redis_node_us_per_read"] + c["redis_shard_us_per_read"] * p.shards // p.masters)
    )
    assert group / 1e6 <= p.replicas * plan.MASTER_UTILISATION
    assert 50_000 * p.write_us / 1e6 / p.masters <= plan.MASTER_UTILISATION
    assert p.write_us >= c["redis_master_us_per_write"]  # the routers' calls are smaller than the bench's
    assert p.read_from == "replicas" and "OVER BUDGET" not in p.reasons["reads"]


def test_main_reads_the_latest_summary_or_says_it_has_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan, "LATEST", tmp_path / "latest" / "summary.json")  # a checkout without one
    assert plan.main(["--players", "1000000", "--writes", "5000", "--reads", "10"]) == 0
    assert "using the documented defaults" in capsys.readouterr().out
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"started": "then", "costs": {**COSTS, "router_us_per_read": None}}))
    assert (
        plan.main(
            [
                "--players",
                "1000000",
                "--writes",
                "100000",
                "--reads",
                "100",
                "--periods",
                "daily",
                "--summary",
                str(summary),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "measured by the bench of then" in out
    assert "router_us_per_read" in out.split("defaults for ", 1)[1].splitlines()[0]
    assert "periods total,daily" in out
    with pytest.raises(SystemExit):
        plan.main(["--players", "1", "--writes", "1", "--reads", "1", "--periods", "hourly"])


def test_incr_dedup_records_size_the_masters_by_memory() -> None:
    # 10k incr writes/s, a 24 h window: 10,000 x 86,400 x (1 + 1/24) = 900M records x 100 B x 1.2
    # = 100.6 GiB, over 25 GiB a master: 5 masters, where the same writes to best boards need 1 (and
    # get the minimum of 3).
    best = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS)
    incr = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS, incr=1.0, dedup_window_s=86_400)
    members = 10_000 * 86_400 * (1 + 1 / DEDUP_BUCKETS)
    assert plan.dedup_members(10_000, 1.0, 86_400) == pytest.approx(members)
    assert best.dedup_bytes == 0 and (best.masters, best.reasons["masters"]) == (3, "minimum")
    assert incr.dedup_bytes == pytest.approx(members * 100 * 1.2)
    assert (incr.masters, incr.reasons["masters"]) == (5, "memory")
    assert incr.data_bytes == pytest.approx(best.data_bytes + incr.dedup_bytes)
    # Each new incr result looks in every bucket of the window and the current one.
    assert incr.redis_cores - best.redis_cores == pytest.approx(10_000 * (DEDUP_BUCKETS + 1) * 0.5e-6)
    # Half the writes to incr boards, or a window of an hour, shrink the records in proportion.
    half = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS, incr=0.5)
    hour = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS, incr=1.0, dedup_window_s=3600)
    assert half.dedup_bytes == pytest.approx(incr.dedup_bytes / 2)
    assert hour.dedup_bytes == pytest.approx(incr.dedup_bytes / 24)
    assert hour.masters == 3


def test_main_takes_incr_flags_and_the_dedup_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    (tmp_path / "dedup.json").write_text(
        json.dumps(
            {
                "bytes_per_dedup_member": 80.0,
                "cpu": [
                    {"buckets": 24, "lookups": 25, "redis_us_per_result": 14.0},
                    {"buckets": 4, "lookups": 5, "redis_us_per_result": 8.0},
                ],
            }
        )
    )
    costs, source = plan.load_costs(tmp_path / "summary.json")
    assert costs["bytes_per_dedup_member"] == 80.0
    assert costs["redis_master_us_per_dedup_lookup"] == pytest.approx(0.3)  # (14 - 8) / 20 lookups
    assert "dedup costs from" in source and "defaults for" not in source
    args = _main_args(tmp_path, 10_000)
    assert plan.main([*args, "--incr", "1", "--dedup-window", "86400"]) == 0
    out = capsys.readouterr().out
    members = 10_000 * 86_400 * (1 + 1 / DEDUP_BUCKETS)
    assert f"= {members:,.0f} records" in out
    assert f"= {members * 80 * 1.2 / GIB:.1f} GiB" in out
    assert "Redis masters        4  (memory-bound" in out  # 80.5 GiB / 25 GiB a master
    assert "noeviction" in out
    assert plan.main(args) == 0
    assert "Redis masters        3  (the minimum: a failover" in capsys.readouterr().out
    for bad in (["--incr", "1.5"], ["--incr", "-0.1"], ["--dedup-window", "30"]):
        with pytest.raises(SystemExit):
            plan.main([*args, *bad])


def test_pins_of_results_without_a_time_count_in_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 10k writes/s, all without achieved_at, a 24 h window: 10,000 x 86,400 x (1 + 4/24) = 1.008G pins
    # x 110 B x 1.2 = 124 GiB, over 25 GiB a master: 5 masters, where writes with their time need 1
    # (and get the minimum of 3).
    timed = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS)
    timeless = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS, timeless=1.0)
    pins = 10_000 * 86_400 * (1 + PIN_SPAN / DEDUP_BUCKETS)
    assert plan.pins(10_000, 1.0, 86_400) == pytest.approx(pins)
    assert timeless.dedup_bytes == pytest.approx(pins * 110 * 1.2)
    assert timeless.data_bytes == pytest.approx(timed.data_bytes + timeless.dedup_bytes)
    assert (timed.masters, timeless.masters, timeless.reasons["masters"]) == (3, 5, "memory")
    # An hour's window keeps a 24th of them; incr results without a time keep both records.
    hour = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS, timeless=1.0, dedup_window_s=3600)
    assert hour.dedup_bytes == pytest.approx(timeless.dedup_bytes / 24)
    both = plan.plan(1000, 10_000, 0, 1, ["total"], COSTS, incr=1.0, timeless=1.0, dedup_window_s=3600)
    records = plan.dedup_members(10_000, 1.0, 3600) * 100 * 1.2
    assert both.dedup_bytes == pytest.approx(hour.dedup_bytes + records)
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = _main_args(tmp_path, 10_000)
    assert plan.main([*args, "--timeless", "1"]) == 0
    out = capsys.readouterr().out
    assert f"= {pins:,.0f} pins x bytes_per_pin" in out and "100% without achieved_at" in out
    assert "Redis masters        5  (memory-bound" in out
    for bad in (["--timeless", "1.5"], ["--timeless", "-0.1"]):
        with pytest.raises(SystemExit):
            plan.main([*args, *bad])


def test_full_journals_are_counted_per_master() -> None:
    # 32k writes/s: the minimum of 3 masters, one shard each, and 3 routers (32k x 50 us / 0.6). A
    # journal entry is one write script call: a request's 10 scores over the 2.95 of 3 shards it
    # touches + 32,000 / 3 routers / 3 shards x 1.5 ms = 8.7 results. The bound is 1,000,000 results
    # not yet archived (1,000,000 entries of 8.7 would be more): 114,613 entries, (114,613 x 200 +
    # 1,000,000 x 70) B x 1.2 = 106 MiB a shard, which hold 93.75 s of a shard's 10,667 writes/s.
    p = plan.plan(1000, 32_000, 0, 1, ["total"], COSTS)
    assert (p.masters, p.shards, p.routers) == (3, 3, 3)
    entry = 10 / plan.touched_shards(10, 3) + 32_000 / 3 / 3 * plan.COALESCE_DELAY_S
    assert p.journal.results_per_entry == pytest.approx(entry) == p.scores_per_call
    assert entry == pytest.approx(8.725, abs=0.001)
    assert (p.journal.bound, p.journal.results) == ("results", 1_000_000)
    assert p.journal.entries == pytest.approx(1_000_000 / entry)
    assert p.journal.bytes_per_shard == pytest.approx((1_000_000 / entry * 200 + 1_000_000 * 70) * 1.2)
    assert p.journal.bytes_per_master == pytest.approx(p.journal.bytes_per_shard)
    assert p.journal.buffer_s == pytest.approx(1_000_000 / (32_000 / 3))  # results / writes a shard
    assert p.memory_per_node_bytes == int((p.data_bytes / 3 + p.journal.bytes_per_master) * 2)
    # Half the writes journaled: their calls gather half as many; none: no journal.
    half = plan.plan(1000, 32_000, 0, 1, ["total"], COSTS, journaled=0.5)
    half_entry = 10 / plan.touched_shards(10, 3) + 16_000 / 3 / 3 * plan.COALESCE_DELAY_S
    assert half.journal.results_per_entry == pytest.approx(half_entry)
    assert plan.plan(1000, 32_000, 0, 1, ["total"], COSTS, journaled=0).journal.bytes_per_master == 0
    # A bound in entries that comes first: 5,000 entries of 8.7 results.
    small = plan.plan(1000, 32_000, 0, 1, ["total"], COSTS, journal_max_entries=5000)
    assert (small.journal.bound, small.journal.results) == ("entries", pytest.approx(5000 * entry))
    assert small.journal.bytes_per_shard == pytest.approx((5000 * 200 + 5000 * entry * 70) * 1.2)
    assert small.journal.buffer_s == pytest.approx(5000 * entry / (32_000 / 3))
    fewer = plan.plan(1000, 32_000, 0, 1, ["total"], COSTS, journal_max_results=100_000)
    assert fewer.journal.buffer_s == pytest.approx(p.journal.buffer_s / 10)
    assert fewer.journal.bytes_per_master == pytest.approx(p.journal.bytes_per_master / 10)
    # Many routers sharing the writes make small calls, an entry per one or two results: the bound
    # in results holds the writes as long as the large calls', in more entries, so more memory.
    many = plan.plan(1000, 32_000, 100_000, 1, ["total"], COSTS)
    assert many.routers > 100 and many.journal.results_per_entry < entry / 2 and many.shards == p.shards
    assert many.journal.buffer_s == pytest.approx(p.journal.buffer_s)
    assert many.journal.bytes_per_shard > p.journal.bytes_per_shard
    # ... where a bound in entries alone would have held them for far less time
    entries_only = {"journal_max_entries": 50_000, "journal_max_results": 10**9}
    small_calls = plan.plan(1000, 32_000, 100_000, 1, ["total"], COSTS, **entries_only).journal
    large_calls = plan.plan(1000, 32_000, 0, 1, ["total"], COSTS, **entries_only).journal
    assert small_calls.buffer_s < large_calls.buffer_s / 2


def test_main_prints_the_journal_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = [
        "--players",
        "1000",
        "--writes",
        "32000",
        "--reads",
        "0",
        "--summary",
        str(tmp_path / "summary.json"),
    ]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert (
        "journal bound        106 MiB per master at 1,000,000 results (SHARDLB_JOURNAL_MAX_RESULTS) a "
        "shard in entries of 8.7 results (106 MiB a shard)" in out
    )
    assert "holds 94 s of writes" in out
    # 93.75 s is short of five minutes: the bound that would hold them (1,000,000 x 300 / 93.75)
    assert "to hold 5 minutes, --journal-max-results 3,200,000 (SHARDLB_JOURNAL_MAX_RESULTS): 340 MiB" in out
    assert plan.main([*args, "--journal-max-results", "3200000"]) == 0
    out = capsys.readouterr().out
    assert "holds 300 s of writes" in out and "to hold 5 minutes" not in out
    # with a bound in entries that comes first, both bounds are named
    assert plan.main([*args, "--journal-max-entries", "5000"]) == 0
    out = capsys.readouterr().out
    assert "at 5,000 entries (SHARDLB_JOURNAL_MAX_ENTRIES), 43,627 results a shard" in out  # 5,000 x 8.725
    assert (
        "--journal-max-results 3,200,000 (SHARDLB_JOURNAL_MAX_RESULTS) and --journal-max-entries 367,000 "
        "(SHARDLB_JOURNAL_MAX_ENTRIES)" in out
    )
    assert plan.main([*args, "--journaled", "0"]) == 0
    assert "journal bound        none (no journaled board)" in capsys.readouterr().out
    for bad in (["--journaled", "2"], ["--journal-max-entries", "0"], ["--journal-max-results", "0"]):
        with pytest.raises(SystemExit):
            plan.main([*args, *bad])


def test_more_masters_come_before_the_reshard_that_spreads_the_board_over_them() -> None:
    # 200k writes/s x 10 us = 2 cores -> 4 masters of 0.5 core, one shard each; today 2 masters and
    # the board on 2 shards.
    p = plan.plan(1_000_000, 200_000, 0, 1, ["total"], COSTS)
    assert (p.masters, p.shards, p.replicas) == (4, 4, 1)
    steps = plan.layout_steps(p, masters_now=2, shards_now=2, board="global")
    assert [s.what.split(" ", 1)[0] for s in steps] == ["add", "reshard", "check"]
    add, reshard, check = steps
    assert "add 2 masters, 2 -> 4 (CPU-bound), 1 replica each" in add.what
    assert add.commands[0].split(":", 1)[1].split() == [
        "shardlb", "cluster", "add-node", "--replicas", "1", "(2", "times)",
    ]  # fmt: skip
    assert add.commands[1].split() == ["shardlb", "cluster", "rebalance"]
    assert "statefulset/redis-cluster --replicas=8;" in add.commands[2]  # 4 masters x (1 + 1 replica)
    assert "--cluster-use-empty-masters" in add.commands[3]
    assert "2 -> 4 shards (to spread its writes over every master; hash boards)" in reshard.what
    assert reshard.commands[0].startswith("shardlb reshard global --shards 4 ")
    assert 'POST /v1/admin/boards/global/reshard {"shards": 4}' in reshard.commands[1]
    assert (
        reshard.commands[2]
        == "kubectl -n NS exec deploy/shardlb-archiver -- shardlb reshard global --shards 4"
    )
    assert check.what == "check that every master serves 1 of global's shards"
    assert "shardlb cluster status" in check.commands[0]


def test_fewer_shards_first_then_removing_masters_is_optional() -> None:
    # 5k writes/s fit the minimum of 3 masters; today 5 masters and 16 shards: reshard down, then
    # masters may go.
    p = plan.plan(1_000_000, 5_000, 0, 1, ["total"], COSTS)
    assert (p.masters, p.shards) == (3, 3)
    reshard, remove, check = plan.layout_steps(p, masters_now=5, shards_now=16)
    assert reshard.what.startswith("reshard BOARD online, 16 -> 3 shards (a read pays a round trip per node")
    assert reshard.commands[0].startswith("shardlb reshard BOARD --shards 3 ")
    assert remove.what.startswith("optional: the load needs 3 masters of today's 5; to give 2 back")
    assert "shardlb cluster remove-node PORT" in remove.commands[0]
    assert "--cluster-weight <node-id>=0" in remove.commands[1]
    assert "del-node" in remove.commands[2] and "statefulset/redis-cluster --replicas=6" in remove.commands[2]
    assert check.what == "check that every master serves 1 of BOARD's shards"


def test_no_steps_when_today_is_the_plan_and_only_the_part_given() -> None:
    p = plan.plan(1_000_000, 200_000, 0, 1, ["total"], COSTS)  # 4 masters, 4 shards
    assert plan.layout_steps(p, 4, 4) == []
    assert plan.layout_steps(p, None, None) == []
    # Masters alone: no reshard and no check (the board's shard count is not known).
    assert [s.what.split(" ", 1)[0] for s in plan.layout_steps(p, 3, None)] == ["add"]
    # The shard count alone, or the same masters and another shard count: the reshard, then the check.
    reshard, _ = plan.layout_steps(p, None, 16)
    assert reshard.what.startswith("reshard BOARD online, 16 -> 4 shards")
    assert [s.what.split(" ", 1)[0] for s in plan.layout_steps(p, 4, 8)] == ["reshard", "check"]


def test_main_prints_the_steps_from_todays_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = [
        "--players",
        "1000000",
        "--writes",
        "200000",
        "--reads",
        "0",
        "--summary",
        str(tmp_path / "summary.json"),
    ]
    assert plan.main([*args, "--masters-now", "2", "--shards-now", "2", "--board", "global"]) == 0
    out = capsys.readouterr().out
    assert (
        "From today's layout (2 masters; the board on 2 shards) to the plan's (4 masters; 4 shards):" in out
    )
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  1. add 2 masters, 2 -> 4"))
    assert lines[first + 1] == "       local:      shardlb cluster add-node --replicas 1   (2 times)"
    assert any(line.startswith("  2. reshard global online, 2 -> 4 shards") for line in lines)
    assert any(line.strip().startswith("shardlb reshard global --shards 4") for line in lines)
    assert out.index("From today's layout") < out.index("Costs:")  # the steps come with the plan
    assert plan.main([*args, "--masters-now", "4", "--shards-now", "4"]) == 0
    assert "Today's layout (4 masters; the board on 4 shards) is the plan's: nothing to change." in (
        capsys.readouterr().out
    )
    assert plan.main([*args, "--masters-now", "2"]) == 0
    assert "(the plan puts a board on 4 shards: --shards-now prints its reshard)" in capsys.readouterr().out
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "From today's layout" not in out and "Today's layout" not in out
    for bad in (["--masters-now", "0"], ["--shards-now", "0"], ["--shards-now", "1025"]):
        with pytest.raises(SystemExit):
            plan.main([*args, *bad])


def scaleout_point(masters: int, write_us: list[float], read_us: list[float]) -> dict[str, object]:
    return {
        "masters": masters,
        "writes": {"redis_us_per_op": write_us},
        "reads": {"redis_us_per_op": read_us},
    }


def test_the_scaleout_bench_is_printed_beside_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = {
        "name": "scaleout-then",
        "machine": {"cpus": 2},
        "points": [
            scaleout_point(1, [12.0], [10.0]),
            scaleout_point(2, [6.5, 6.5], [11.0, 13.0]),
            scaleout_point(3, [5.0, 4.0, 4.0], [12.0, 12.0, 12.0]),
        ],
    }
    lines = plan.scaleout_lines(result)
    assert lines[0].startswith(
        "Scale-out measured by `make bench-scaleout` (scaleout-then; 1 / 2 / 3 masters"
    )
    assert "on 2 CPUs" in lines[0]
    assert lines[1] == (
        "  Redis µs per write, all masters: 12.0 / 13.0 / 13.0; the busiest master's share: "
        "1.00 / 0.50 / 0.38 (the model: 1/masters, 1.00 / 0.50 / 0.33)"
    )
    assert lines[2].startswith(
        "  Redis µs per read, each master (mean): 10.0 / 12.0 / 12.0; all masters: 10.0 / 24.0 / 36.0"
    )
    # One cluster, or a run without per-master costs, says nothing.
    assert plan.scaleout_lines({"points": result["points"][:1]}) == []
    assert plan.scaleout_lines({"points": [{"masters": 1, "writes": {"ops_per_s": 0.0}}] * 2}) == []
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = [
        "--players",
        "1000",
        "--writes",
        "1000",
        "--reads",
        "0",
        "--summary",
        str(tmp_path / "summary.json"),
    ]
    assert plan.main(args) == 0
    assert "Scale-out measured" not in capsys.readouterr().out
    (tmp_path / "scaleout.json").write_text(json.dumps(result))
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert lines[1] in out and out.index(lines[0]) < out.index("Assumptions:")


def test_a_band_board_scales_the_hash_boards_costs_by_its_measured_factors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """--sharding band: reads per group x band_store_read_factor, writes x the write factors, and
    each player's extra bytes for the band row and versions."""
    band = COSTS  # band_store_read_factor 0.5, band_router_read_factor 0.8, write factors 2.0 and 1.5
    args = (10_000_000, 20_000, 50_000, 1, ["total"], band)
    hashed, banded = plan.plan(*args), plan.plan(*args, sharding="band")
    assert (hashed.masters, banded.masters) == (3, 3)  # the minimum
    group = 50_000 * 0.7 * 120e-6  # each of the 3 groups
    writes = 20_000 * 10e-6
    replica = 20_000 / 3 * 2e-6  # what each replica spends applying its master's writes
    assert hashed.redis_cores == pytest.approx(writes + 3 * group + 3 * replica * hashed.replicas)
    assert banded.redis_cores == pytest.approx(
        2 * writes + 3 * 0.5 * group + 3 * 2 * replica * banded.replicas
    )
    assert hashed.replicas == math.ceil(group / (0.5 - replica))  # each replica's room less its writes
    assert banded.router_cores == pytest.approx(20_000 * 50e-6 * 1.5 + 50_000 * 1e-3 * 0.8)
    assert banded.data_bytes == pytest.approx(10_000_000 * 250.0 * plan.FRAGMENTATION)
    assert hashed.data_bytes == pytest.approx(10_000_000 * 100.0 * plan.FRAGMENTATION)
    assert banded.replicas < hashed.replicas  # the reads need fewer replicas
    assert "band" in banded.reasons["shards"] and "shardlb bands" in banded.reasons["shards"]
    (tmp_path / "summary.json").write_text(json.dumps({"costs": band}))
    cli = [
        "--players",
        "10000000",
        "--writes",
        "20000",
        "--reads",
        "50000",
        "--summary",
        str(tmp_path / "summary.json"),
    ]
    assert plan.main([*cli, "--sharding", "band"]) == 0
    out = capsys.readouterr().out
    assert (
        "a band board" in out and "band_store_read_factor = 0.5" in out and "band board: the store's w" in out
    )
    with pytest.raises(SystemExit):
        plan.main([*cli, "--sharding", "region"])


def test_auto_recommends_the_layout_that_fits_on_the_fewest_nodes() -> None:
    """Read-heavy: the band board's cheaper reads need fewer replicas; write-heavy: the hash board's
    cheaper writes need fewer masters; a tie goes to the first layout, and fitting comes first."""
    reads = {
        s: plan.plan(10_000_000, 20_000, 50_000, 1, ["total"], COSTS, sharding=s) for s in plan.SHARDINGS
    }
    assert reads["band"].nodes < reads["hash"].nodes
    chosen, why = plan.choose(reads)
    assert chosen == "band"
    assert why.startswith(f"{reads['band'].nodes} Redis nodes and {reads['band'].routers} router processes")
    assert f"hash: {reads['hash'].nodes} nodes" in why
    writes = {s: plan.plan(1_000_000, 200_000, 0, 1, ["total"], COSTS, sharding=s) for s in plan.SHARDINGS}
    assert writes["hash"].masters < writes["band"].masters  # band writes cost the store twice as much
    assert plan.choose(writes)[0] == "hash"
    same = plan.plan(1_000, 10, 0, 1, ["total"], COSTS)
    assert plan.choose({"hash": same, "band": same})[0] == "hash"
    over = dataclasses.replace(reads["band"], fits=False)
    assert plan.choose({"hash": reads["hash"], "band": over})[0] == "hash"
    assert "band: " in plan.choose({"hash": reads["hash"], "band": over})[1]
    assert "OVER BUDGET" in plan.choose({"hash": reads["hash"], "band": over})[1]


def test_a_plan_that_needs_more_replicas_than_the_limit_does_not_fit() -> None:
    huge = plan.plan(1_000_000, 1_000, 1e9, 1, ["total"], COSTS)
    assert not huge.fits and "OVER BUDGET" in huge.reasons["reads"]
    assert plan.plan(1_000_000, 1_000, 1_000, 1, ["total"], COSTS).fits


def test_main_prints_the_chosen_layout_and_the_steps_to_a_band_board(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    cli = ["--players", "10000000", "--writes", "20000", "--reads", "50000"]
    cli += ["--summary", str(tmp_path / "summary.json"), "--masters-now", "1", "--shards-now", "16"]
    assert plan.main(cli) == 0
    out = capsys.readouterr().out
    assert "  layout               band board  (" in out and "against hash: " in out
    assert "make BOARD a band board online: 16 hash shards -> " in out
    assert "shardlb bands BOARD --count " in out and "--bands <those starts>" in out
    assert plan.main([*cli, "--sharding", "hash"]) == 0
    out = capsys.readouterr().out
    assert "  layout               hash board  (as asked)" in out and "shardlb bands" not in out
    assert "reshard BOARD online, 16 -> " in out


def test_band_steps_convert_the_board_and_check_each_master_holds_a_band() -> None:
    p = plan.plan(10_000_000, 100_000, 50_000, 1, ["total"], COSTS, sharding="band")
    assert p.masters > 1
    replicas, convert, check = plan.layout_steps(p, masters_now=p.masters, shards_now=16, board="global")
    assert replicas.what.startswith(f"give every master {p.replicas} replicas")  # the reads need them
    assert convert.what.startswith(
        f"make global a band board online: 16 hash shards -> {p.shards} home shards"
    )
    assert convert.commands[0].startswith(f"shardlb bands global --count {p.masters} ")
    assert convert.commands[1].startswith(f"shardlb reshard global --shards {p.shards} --bands ")
    assert f"shardlb bands global --count {p.masters} --apply" in convert.commands[3]
    assert f"SHARDLB_BANDS_BOARDS=global:{p.masters}" in convert.commands[3]
    assert check.what == "check that every master serves 1 of global's home shards and one of its bands"
    # the board's layout today not given: the replicas alone
    assert [s.what.split()[0] for s in plan.layout_steps(p, p.masters, None)] == ["give"]


def test_the_scaleout_bench_band_reads_are_printed_when_measured() -> None:
    points = [scaleout_point(1, [12.0], [10.0]), scaleout_point(3, [5.0, 4.0, 4.0], [12.0, 12.0, 12.0])]
    assert not any("band board" in line for line in plan.scaleout_lines({"points": points}))
    points[0]["band_reads"] = {"redis_us_per_op": [9.0]}
    points[1]["band_reads"] = {"redis_us_per_op": [3.0, 8.0, 4.0]}
    line = plan.scaleout_lines({"points": points})[-1]
    assert line.startswith(
        "  band board, Redis µs per read, the busiest master: 9.0 / 8.0; the others (mean): - / 3.5"
    )
    points[0]["band_reads_kept"] = {"redis_us_per_op": [10.0]}
    points[1]["band_reads_kept"] = {"redis_us_per_op": [2.0, 6.0, 3.0]}
    line = plan.scaleout_lines({"points": points})[-1]
    assert line.startswith(
        '  band board, "my rank" with max_age_ms, Redis µs per read, all masters: 10.0 / 11.0; the busiest: '
        "10.0 / 6.0 (two shards a read"
    )


def test_routers_are_sized_for_the_scores_a_request_carries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request costs the router a fixed part (router_us_per_request) spread over its scores:
    router_us_per_write is measured at router_scores_per_request scores a request (the bench's
    matches of 10), and a game that posts 100 scores a request pays that part a tenth as often."""
    costs = COSTS
    load = (1000, 100_000, 0, 1, ["total"], costs)
    default = plan.plan(*load)
    assert default.router_cores == pytest.approx(100_000 * 50e-6)
    assert plan.plan(*load, scores_per_request=10).router_cores == pytest.approx(default.router_cores)
    # 50 - 200/10 + 200/100 = 32 us a write; one score a request: 50 - 20 + 200 = 230 us.
    batched = plan.plan(*load, scores_per_request=100)
    assert batched.router_cores == pytest.approx(100_000 * 32e-6)
    assert batched.routers == 6 < default.routers == 9  # 3.2 and 5 cores, 0.6 each
    assert plan.plan(*load, scores_per_request=1).router_cores == pytest.approx(100_000 * 230e-6)
    assert plan.plan(*load, scores_per_request=100).redis_cores == pytest.approx(default.redis_cores)
    # A request's part larger than the measured write: the per-score part never falls below 1 us.
    lopsided = {**costs, "router_us_per_request": 1000.0}
    assert plan.plan(1000, 100_000, 0, 1, ["total"], lopsided, scores_per_request=1000).router_cores == (
        pytest.approx(100_000 * 1e-6)
    )
    # The command line: the size asked for, and the cost it gives, in the model's router line.
    (tmp_path / "summary.json").write_text(json.dumps({"started": "t", "costs": costs}))
    assert plan.main([*_main_args(tmp_path, 100_000), "--scores-per-request", "100"]) == 0
    out = capsys.readouterr().out
    assert "router processes     6" in out
    assert (
        "router_us_per_write at 100 scores a request = router_us_per_write + router_us_per_request x "
        "(1/100 - 1/10) = 32.0 us"
    ) in out
    with pytest.raises(SystemExit):
        plan.main([*_main_args(tmp_path, 100_000), "--scores-per-request", "0"])
    assert "--scores-per-request" in capsys.readouterr().err


CALLS = {**COSTS, "redis_master_us_per_call": 100.0, "redis_master_us_per_score_in_call": 10.0}


def test_a_request_touches_fewer_shards_than_it_has_scores_on_a_board_of_many() -> None:
    assert plan.touched_shards(10, 1) == pytest.approx(1.0)
    assert plan.touched_shards(1, 16) == pytest.approx(1.0)
    assert plan.touched_shards(10, 2) == pytest.approx(2 * (1 - 0.5**10))
    assert plan.touched_shards(10, 16) == pytest.approx(16 * (1 - (15 / 16) ** 10))  # 7.6


def test_a_call_holds_a_requests_scores_for_its_shard_and_what_arrives_within_the_delay() -> None:
    own = 10 / plan.touched_shards(10, 4)
    # 4,000 scores/s on 4 routers and 4 shards: 250 a second per router and shard, 0.375 in 1.5 ms.
    assert plan.scores_per_call(4_000, 4, 4, 10) == pytest.approx(own + 250 * plan.COALESCE_DELAY_S)
    # One router taking 2M scores/s on one shard: 3,000 in the delay, but a call holds at most 500.
    assert plan.scores_per_call(2_000_000, 1, 1, 10) == plan.MAX_RESULTS_PER_ENTRY
    assert plan.scores_per_call(0, 1, 1024, 1) == 1.0  # never less than one score


def test_small_calls_cost_a_master_more_per_write_than_the_bench_measured() -> None:
    c = {**plan.DEFAULTS, **CALLS}  # 100 us a call, 10 us a score, measured in calls of 50
    assert plan.call_size_factor(c, 50) == pytest.approx(1.0)
    assert plan.call_size_factor(c, 1) == pytest.approx(110 / 12)
    assert plan.call_size_factor(c, 500) == pytest.approx(10.2 / 12)
    assert plan.call_size_factor({**c, "redis_master_us_per_call": 0.0}, 1) == pytest.approx(1.0)


def test_more_routers_and_shards_make_smaller_calls_and_the_masters_grow_until_their_writes_fit() -> None:
    # 200k writes/s, a request of 10 scores: with no fixed part per call, 4 masters (0.5 core each
    # at 10 us a write); with 100 us a call, the routers' calls of a few scores cost more a write.
    flat = plan.plan(1_000_000, 200_000, 0, 1, ["total"], COSTS)
    called = plan.plan(1_000_000, 200_000, 0, 1, ["total"], CALLS)
    assert flat.masters == 4 and flat.write_us == pytest.approx(10.0)
    assert called.masters > flat.masters
    factor = plan.call_size_factor({**plan.DEFAULTS, **CALLS}, called.scores_per_call)
    assert called.write_us == pytest.approx(10.0 * factor)
    assert 200_000 * called.write_us / 1e6 / called.masters <= plan.MASTER_UTILISATION
    # One master fewer would not hold them at its own (larger) calls.
    fewer = called.masters - 1
    batch = plan.scores_per_call(200_000, called.write_routers, fewer, 10)
    w = 10.0 * plan.call_size_factor({**plan.DEFAULTS, **CALLS}, batch)
    assert 200_000 * w / 1e6 / fewer > plan.MASTER_UTILISATION
    # Bigger requests make bigger calls: fewer masters.
    batched = plan.plan(1_000_000, 200_000, 0, 1, ["total"], CALLS, scores_per_request=100)
    assert batched.scores_per_call > called.scores_per_call and batched.masters < called.masters


def test_a_pool_of_routers_for_the_writes_makes_their_calls_bigger() -> None:
    shared = plan.plan(1_000_000, 50_000, 200_000, 1, ["total"], CALLS)
    assert shared.write_routers == shared.routers
    pooled = plan.plan(1_000_000, 50_000, 200_000, 1, ["total"], CALLS, write_routers=1)
    # The pool is at least what the writes' CPU needs (50k x 50 us = 2.5 cores / 0.6: 5 routers).
    assert pooled.write_routers == plan.write_pool(50_000, 50.0) == 5
    assert pooled.routers == 5 + math.ceil(200_000 * 1000e-6 / plan.ROUTER_UTILISATION)
    assert pooled.scores_per_call > shared.scores_per_call and pooled.masters < shared.masters
    big = plan.plan(1_000_000, 50_000, 200_000, 1, ["total"], CALLS, write_routers=50)
    assert big.write_routers == 50


def test_main_offers_the_write_pool_when_it_needs_fewer_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"started": "then", "costs": CALLS}))
    args = ["--players", "1000000", "--writes", "50000", "--reads", "200000", "--summary", str(summary)]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "With a pool of 5 routers that take the score writes (--write-routers 5" in out
    assert "calls of " in out and "cost the masters" in out
    assert plan.main([*args, "--write-routers", "5"]) == 0
    out = capsys.readouterr().out
    assert "With a pool" not in out and "5 of them take the writes" in out
    with pytest.raises(SystemExit):
        plan.main([*args, "--write-routers", "0"])


def test_call_costs_come_from_the_load_steps_and_the_raw_runs_call_size(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    raw = {"items": 900_000, "cpu": {"commands": {"evalsha": {"calls": 12_000, "usec": 1}}}}
    summary.write_text(json.dumps({"started": "then", "costs": COSTS, "raw": {"writes": raw}}))
    three = {"redis_master_us_per_call": 118.6, "redis_master_us_per_score_in_call": 10.35}
    sixteen = {"redis_master_us_per_call": 1.0, "redis_master_us_per_score_in_call": 1.0}
    steps = {"call_costs": {"3": three, "16": sixteen}}
    (tmp_path / plan.LOAD_STEPS_SUMMARY).write_text(json.dumps(steps))
    costs, source = plan.load_costs(summary)
    assert costs["raw_scores_per_call"] == 75.0
    # The raw run's exact retries ride its calls beside the fresh scores it counts as written.
    retried = {**raw, "items": 855_000, "replayed_items": 45_000}
    summary.write_text(json.dumps({"started": "then", "costs": COSTS, "raw": {"writes": retried}}))
    assert plan.load_costs(summary)[0]["raw_scores_per_call"] == 75.0
    summary.write_text(json.dumps({"started": "then", "costs": COSTS, "raw": {"writes": raw}}))
    assert (costs["redis_master_us_per_call"], costs["redis_master_us_per_score_in_call"]) == (118.6, 10.35)
    assert "script call costs from" in source
    (tmp_path / plan.LOAD_STEPS_SUMMARY).write_text(json.dumps({"call_costs": {}}))
    costs, source = plan.load_costs(summary)
    assert costs["redis_master_us_per_call"] == COSTS["redis_master_us_per_call"]  # the summary's
    assert "script call costs" not in source


def test_a_plan_has_at_least_three_masters_for_failover(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1,000 players and 1,000 writes/s fit one master's memory and CPU; but Redis Cluster promotes a
    # replica only when a majority of masters agree that its master failed, which 1 or 2 masters
    # cannot give once one is lost (and the bootstrap Job refuses fewer than 3): 3, one shard each.
    small = plan.plan(1000, 1000, 0, 1, ["total"], COSTS)
    assert (small.masters, small.shards, small.nodes, small.reasons["masters"]) == (3, 3, 6, "minimum")
    add = plan.layout_steps(small, masters_now=1, shards_now=1)[0]
    assert add.what.startswith(
        "add 2 masters, 1 -> 3 (the minimum: a failover needs a majority of masters, so 3 at least)"
    )
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    assert plan.main(_main_args(tmp_path, 1000)) == 0
    assert "Redis masters        3  (the minimum: a failover needs a majority of masters" in (
        capsys.readouterr().out
    )


def test_main_refuses_rates_that_are_not_finite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = ["--summary", str(tmp_path / "none.json")]
    for flag in ("--writes", "--reads"):
        for value in ("nan", "inf", "-inf"):
            rates = {"--writes": "1000", "--reads": "1000", flag: value}
            with pytest.raises(SystemExit) as stop:
                plan.main(["--players", "1000", *[f"{k}={v}" for k, v in rates.items()], *summary])
            assert stop.value.code == 2, (flag, value)  # argparse's usage error, not a traceback
            assert f"{flag} is a rate" in capsys.readouterr().err


def test_no_writes_fill_no_journal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    assert plan.main(_main_args(tmp_path, 0)) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  journal bound"))
    assert "no journaled writes: the bound is never reached" in line
    assert "inf" not in line and "to hold 5 minutes" not in line


def test_a_plan_at_a_cap_says_so_and_its_numbers_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 60 billion players: 60e9 x 100 B x 1.2 = 7.2 TB, 269 masters of 25 GiB, which would need 5
    # shards each to keep 50M players a shard (1,345); a board has at most 1,024: 3 or 4 a master,
    # and 58.6M players a shard.
    big = plan.plan(60_000_000_000, 1, 0, 1, ["total"], COSTS)
    assert (big.masters, big.shards) == (269, 1024)
    assert "4 per master" in big.reasons["shards"] and "5 per master" not in big.reasons["shards"]
    assert any("1,024 shards" in w and "58,593,750 players a shard" in w for w in big.warnings)
    assert big.fits  # more players a shard than planned for, but it runs
    # A billion writes a second: 10,000 cores of writes, 20,000 masters; a cluster of one shard a
    # master stops at 1,024, which do not hold them.
    fast = plan.plan(1000, 1e9, 0, 1, ["total"], COSTS)
    assert fast.masters == plan.MAX_MASTERS and not fast.fits
    assert any("1,024 masters" in w and "20,000" in w for w in fast.warnings)
    assert plan.plan(1000, 1000, 0, 1, ["total"], COSTS).warnings == ()
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    assert plan.main([*_main_args(tmp_path, 10**9), "--sharding", "hash"]) == 0
    out = capsys.readouterr().out
    assert "  WARNING: the writes need 20,000 masters" in out


def test_readme_sizing_is_the_plan_on_the_committed_latest_costs(capsys: pytest.CaptureFixture[str]) -> None:
    """README "Sizing" quotes `shardlb plan` for the issue's load on bench/results/latest: a run put
    into latest without the section rerun would leave the README planning another cluster than the
    command prints (2026-12-05: a run of a slower VM landed in latest, and the plan said 400 nodes
    where README said 198)."""
    root = Path(__file__).resolve().parent.parent
    assert plan.main(["--players", "100000000", "--writes", "50000", "--reads", "200000"]) == 0
    out = capsys.readouterr().out
    layout = next(line for line in out.splitlines() if line.startswith("  layout "))
    masters = next(line for line in out.splitlines() if line.startswith("  Redis masters "))
    nodes, routers = (int(n) for n in re.findall(r"(\d+) Redis nodes and (\d+) router", layout)[0])
    replicas = (nodes - int(masters.split()[2])) // int(masters.split()[2])
    sizing = (root / "README.md").read_text().split("### Sizing", 1)[1].split("\n### ", 1)[0]
    said = " ".join(sizing.split())
    why = f"README Sizing does not say what the plan on bench/results/latest prints ({layout.strip()}): "
    why += "rerun the section for a run copied into latest (make bench does), or put latest back"
    assert f"with {replicas} replicas each ({nodes} Redis nodes," in said, why
    assert f"and {routers} router processes" in said, why


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--players", "0", "--players"),
        ("--players", "-5", "--players"),
        ("--players", str(10**400), "--players"),
        ("--writes", "1e308", "--writes"),
        ("--reads", "1e308", "--reads"),
        ("--replicas", "-1", "--replicas"),
        ("--replicas", str(plan.MAX_REPLICAS + 1), "--replicas"),
        ("--write-routers", str(10**400), "--write-routers"),
        ("--journal-max-results", str(10**400), "--journal-max-results"),
        ("--journal-max-entries", str(10**400), "--journal-max-entries"),
        ("--masters-now", str(10**400), "--masters-now"),
    ],
)
def test_main_names_the_flag_of_a_number_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, named: str
) -> None:
    """A number the plan cannot use is a usage error naming its flag (exit 2), never a traceback
    (huge rates overflowed the arithmetic: OverflowError) or a bare "bad arguments"."""
    args = {"--players": "1000", "--writes": "1000", "--reads": "1000", flag: value}
    with pytest.raises(SystemExit) as stop:
        plan.main([*[f"{k}={v}" for k, v in args.items()], "--summary", str(tmp_path / "none.json")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"shardlb plan: error: {named} "), err


def test_the_journal_bounds_the_plan_takes_are_the_ones_a_router_starts_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--journal-max-results and --journal-max-entries are the routers' settings: a value the
    router refuses at start-up is refused by the plan too, and the largest it takes is planned."""
    from router.settings import Settings, SettingsError

    monkeypatch.setattr(plan, "LATEST", tmp_path / "none.json")  # the documented costs
    summary: list[str] = []
    for flag, most in (
        ("--journal-max-results", plan.MAX_JOURNAL_RESULTS),
        ("--journal-max-entries", plan.MAX_JOURNAL_ENTRIES),
    ):
        variable = "SHARDLB_" + flag.removeprefix("--").replace("-", "_").upper()
        dev = {"SHARDLB_INSECURE_DEV": "true"}
        Settings.from_env({**dev, variable: str(most)})
        with pytest.raises(SettingsError, match=variable):
            Settings.from_env({**dev, variable: str(most + 1)})
        assert plan.main(["--players=1000", "--writes=1000", "--reads=0", f"{flag}={most}", *summary]) == 0
        with pytest.raises(SystemExit) as stop:
            plan.main(["--players=1000", "--writes=1000", "--reads=0", f"{flag}={most + 1}", *summary])
        assert stop.value.code == 2


def test_bench_readme_incr_figures_are_the_models_on_the_committed_latest_costs() -> None:
    """bench/README.md, "The capacity planner", says what bounds an incr deployment with a 24 h
    window: the records one master's data holds against the incr writes its CPU takes. Both come from
    the model on bench/results/latest (until 2026-12-05 the CPU figure was the old defaults', "over
    30,000", where the latest costs give a master's half core about 27,000 even in the bench's own
    large calls)."""
    costs, _ = plan.load_costs(plan.LATEST)
    window = 86_400
    per_write = plan.dedup_members(1, 1.0, window) * costs["bytes_per_dedup_member"] * plan.FRAGMENTATION
    held = plan.MAX_DATA_PER_MASTER / per_write
    # In calls of the raw run's size (call size factor 1): the most a master's CPU takes.
    write_us = (
        costs["redis_master_us_per_write"] + (DEDUP_BUCKETS + 1) * costs["redis_master_us_per_dedup_lookup"]
    )
    taken = plan.MASTER_UTILISATION * 1e6 / write_us
    readme = (Path(__file__).resolve().parent.parent / "bench" / "README.md").read_text()
    said = " ".join(readme.split("## The capacity planner", 1)[1].split())
    assert f"holds the records of about {round(held, -2):,.0f} incr writes/s" in said
    assert f"while its CPU takes about {round(taken, -3):,.0f}" in said, taken


def test_the_steps_give_every_master_the_replicas_the_reads_need(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reads of this load need several replicas a master. Today's masters and shards being the
    plan's, the steps said "nothing to change", and adding masters gave only the new ones their
    replicas: a cluster of 3 masters x 1 replica would have taken the plan without the replicas its
    reads need. --masters-now counts masters alone, so the steps name the replicas a master needs."""
    p = plan.plan(1_000_000, 1_000, 20_000, 1, ["total"], COSTS)
    assert p.replicas > 1 and p.read_from == "replicas"
    for masters_now in (p.masters, 1):
        steps = plan.layout_steps(p, masters_now, p.shards, board="global")
        found = [s for s in steps if s.what.startswith(f"give every master {p.replicas} replicas")]
        assert len(found) == 1, [s.what for s in steps]
        assert f"statefulset/redis-cluster --replicas={p.nodes}" in " ".join(found[0].commands)
        assert steps[-1].what.startswith("check that every master serves")
    # One replica a master (the clusters of make run and of k8s/base): no step of its own.
    small = plan.plan(1_000_000, 200_000, 0, 1, ["total"], COSTS)
    assert small.replicas == 1 and plan.layout_steps(small, small.masters, small.shards) == []
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = ["--players=1000000", "--writes=1000", "--reads=20000", "--sharding=hash"]
    now = [
        f"--masters-now={p.masters}",
        f"--shards-now={p.shards}",
        "--summary",
        str(tmp_path / "summary.json"),
    ]
    assert plan.main([*args, *now]) == 0
    out = capsys.readouterr().out
    assert "nothing to change" not in out
    assert f"  1. give every master {p.replicas} replicas" in out


def test_main_prints_what_the_archive_grows_by_a_day(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator sizing PostgreSQL had no figure: every journaled result is a row of the archive
    for as long as its board lives. The plan prints the disk a day of the journaled writes takes at
    the measured bytes per archived result (1,000 writes/s x 86,400 s x 350 B = 28.2 GiB)."""
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = _main_args(tmp_path, 1000)
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "PostgreSQL disk      28.2 GiB a day of archived results" in out
    assert "bytes_per_archived_result = 350" in out
    assert plan.main([*args, "--journaled", "0.5"]) == 0
    assert "PostgreSQL disk      14.1 GiB a day of archived results" in capsys.readouterr().out
    assert plan.main([*args, "--journaled", "0"]) == 0
    assert "PostgreSQL disk      none (no journaled board)" in capsys.readouterr().out
    assert plan.DEFAULTS["bytes_per_archived_result"] > 0  # a summary without it: the measured default


def _printed_gib(out: str, row: str) -> float:
    """Bytes of the ``row`` line's first figure in GiB (``maxmemory   4.3 GiB per master``)."""
    found = re.search(rf"^  {row} +([0-9.]+) GiB", out, re.MULTILINE)
    assert found, out
    return float(found.group(1)) * GIB


@pytest.mark.parametrize("players", [5_000, 100_000_000])
def test_the_printed_maxmemory_holds_the_data_and_full_journals(
    players: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The printed `maxmemory` goes into REDIS_MAXMEMORY as it reads (k8s/README.md, "Sizing"), and
    the printed memory per node into the container's limit at twice it. Until 2026-12-06 both were
    rounded to the nearest tenth of a GiB: 4.3 GiB for the README's 4.34 GiB of data and journals a
    master, and 0.1 GiB for a small game's 147 MiB of full journals, below what a master must hold."""
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = [f"--players={players}", "--writes=50000", "--reads=2000", "--sharding=hash"]
    assert plan.main([*args, "--summary", str(tmp_path / "summary.json")]) == 0
    out = capsys.readouterr().out
    p = plan.plan(players, 50_000, 2_000, 1, ["total"], {**plan.DEFAULTS, **COSTS})
    need = p.data_bytes / p.masters + p.journal.bytes_per_master
    maxmemory = _printed_gib(out, "maxmemory")
    assert need <= maxmemory < need + 0.1 * GIB
    assert _printed_gib(out, "memory per node") >= plan.FORK_HEADROOM * maxmemory


def test_a_plan_whose_reads_need_more_replicas_than_the_cap_says_so_at_its_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """10M reads a second, none cached, need thousands of replicas a master; the plan gives 256. Until
    2026-12-06 only the model's reads line, far below, said OVER BUDGET (and the layout line, of the
    other layout): the figures at the top read as a plan that holds the load."""
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    args = ["--players=1000000", "--writes=1000", "--reads=10000000", "--cached=0", "--sharding=hash"]
    assert plan.main([*args, "--summary", str(tmp_path / "summary.json")]) == 0
    out = capsys.readouterr().out
    top = out.split("\n\n")[1]  # the plan's own lines, before the costs and the model
    assert re.search(r"^  WARNING: .*OVER BUDGET", top, re.MULTILINE), top
    # a plan that fits has no such line
    assert plan.main([*args[:2], "--reads=1000", "--summary", str(tmp_path / "summary.json")]) == 0
    assert "WARNING" not in capsys.readouterr().out


def test_a_summary_named_that_is_not_there_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped --summary gave a plan on the documented costs, exit 0 (until 2026-12-06)."""
    missing = tmp_path / "20261206-0818O9" / "summary.json"
    with pytest.raises(SystemExit) as exit:
        plan.main(["--players", "1000000", "--writes", "5000", "--reads", "10", "--summary", str(missing)])
    assert exit.value.code == 2
    assert f"--summary: no such file: {missing}" in capsys.readouterr().err


def test_a_plan_past_a_clusters_nodes_says_so_and_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis Cluster is built for about 1,000 nodes. Until 2026-12-06 a plan of 33,567 nodes (167
    masters x 200 replicas) was recommended as one that fits, without a word."""
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": COSTS}))
    summary = ["--summary", str(tmp_path / "summary.json")]
    assert plan.main(["--players=100000000", "--writes=500000", "--reads=1000000", *summary]) == 0
    top = capsys.readouterr().out.split("\n\n")[1]
    assert re.search(r"^  WARNING: [\d,]+ Redis nodes in one cluster, past the 1,000", top, re.MULTILINE), top
    load = {"players": 100_000_000, "writes": 500_000, "reads": 1_000_000, "replicas": 1}
    p = plan.plan(**load, periods=["total"], costs=COSTS)
    assert p.nodes > plan.MAX_CLUSTER_NODES and not p.fits
    # README's plan stays well inside
    assert plan.main(["--players=100000000", "--writes=50000", "--reads=200000", *summary]) == 0
    assert "Redis nodes in one cluster" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "singular"),
    [
        (
            ["--players=1000", "--writes=1", "--reads=1", "--scores-per-request=1", "--masters-now=1"],
            ["and 1 router process against", "a request's 1 score /", "1 replica each", "at 1 score a"],
        ),
        (
            ["--players=1000", "--writes=1", "--reads=1", "--write-routers=1", "--sharding=band"],
            ["1 of them takes the writes", "writes / 1 router taking writes"],
        ),
        (["--players=1000000", "--writes=50000", "--reads=200000"], ["With a pool of 5 routers"]),
        (["--players=1000000", "--writes=1000", "--reads=5000", "--cached=0", "--sharding=hash"], []),
    ],
    ids=["one-of-each", "write-routers", "pool", "replicas"],
)
def test_a_count_of_one_is_printed_singular(
    args: list[str], singular: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "1 router processes against band: 3 nodes and 1 routers", "a request's 1 scores", "add 2
    master(s)" (until 2026-12-06): every count the plan prints agrees with its noun. Rates keep
    their unit ("1 reads/s"), decimals their plural ("1.0 scores")."""
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": CALLS}))
    assert plan.main([*args, "--summary", str(tmp_path / "summary.json")]) == 0
    out = capsys.readouterr().out
    assert not re.findall(r"(?<![\d.,])1 (?:Redis )?[a-z]+s\b(?!/)|\w\(s\)", out)
    assert all(phrase in out for phrase in singular), out


def test_a_write_pool_smaller_than_the_writes_need_is_raised_and_the_plan_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--write-routers 1` for 50,000 writes a second, which take 5 routers' CPU: the plan was of 5,
    said only as "5 of them take the writes" (until 2026-12-06), and a pool of 1 deployed from it
    would not hold the writes."""
    (tmp_path / "summary.json").write_text(json.dumps({"started": "then", "costs": CALLS}))
    summary = ["--summary", str(tmp_path / "summary.json")]
    args = ["--players=1000000", "--writes=50000", "--reads=200000", *summary]
    assert plan.main([*args, "--write-routers=1"]) == 0
    top = capsys.readouterr().out.split("\n\n")[1]
    raised = r"^  WARNING: --write-routers 1 raised to 5: the writes take 2\.50 cores of the routers' CPU"
    assert re.search(raised, top, re.MULTILINE), top
    assert "5 of them take the writes" in top
    assert plan.main([*args, "--write-routers=5"]) == 0  # enough: no word of it
    assert "--write-routers" not in capsys.readouterr().out.split("\n\n")[1]
