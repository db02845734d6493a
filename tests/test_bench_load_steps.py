"""bench/load_steps.py: the arithmetic and the table of `make bench-load-steps` (the steps themselves
start a cluster and routers: they run by hand, not in the suite)."""

from __future__ import annotations

import pytest

from bench import load_steps


def test_paced_users_offer_the_rate_in_one_match_requests() -> None:
    assert load_steps.paced_users(5000, 10) == 100  # 100 users x 5 requests/s x 10 scores
    assert load_steps.paced_users(15000, 10) == 300
    assert load_steps.paced_users(15000, 10, rps=10) == 150
    assert load_steps.paced_users(1, 10) == 1  # never none
    # With 5% of the posts exact retries (which write nothing new), more users offer the fresh rate.
    assert load_steps.paced_users(5000, 10, fresh_share=0.95) == 105


def test_the_steps_are_the_paced_rates_then_the_connections_back_to_back() -> None:
    assert load_steps.plan([5000, 15000], 64, 10) == [
        ("5,000 scores/s paced", 100, 5),
        ("15,000 scores/s paced", 300, 5),
        ("64 connections back to back", 64, load_steps.BACK_TO_BACK_RPS),
    ]
    assert load_steps.plan([20000], 0, 10) == [("20,000 scores/s paced", 400, 5)]


def test_a_count_may_be_zero_and_must_be_a_whole_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDLB_STEPS_T", raising=False)
    assert load_steps.count("SHARDLB_STEPS_T", 64) == 64
    monkeypatch.setenv("SHARDLB_STEPS_T", "0")
    assert load_steps.count("SHARDLB_STEPS_T", 64) == 0
    for bad in ("-1", "1.5", "many"):
        monkeypatch.setenv("SHARDLB_STEPS_T", bad)
        with pytest.raises(SystemExit, match="SHARDLB_STEPS_T"):
            load_steps.count("SHARDLB_STEPS_T", 64)


def test_cpu_per_score_counts_masters_and_replicas_as_the_store() -> None:
    cpu = {"router": 2.0, "redis masters": 1.5, "redis replicas": 0.5, "client": 9.0, "harness": 3.0}
    assert load_steps.per_score(cpu, 100_000) == {"router_us": 20.0, "store_us": 20.0}
    assert load_steps.per_score({"redis masters": 1.0}, 1_000_000) == {"router_us": 0.0, "store_us": 1.0}
    assert load_steps.per_score(cpu, 0) == {"router_us": None, "store_us": None}


def test_the_table_has_a_line_per_step_and_says_why_one_was_skipped() -> None:
    rows = [
        {"shards": 3, "step": "5,000 scores/s paced", "scores_per_s": 4990, "scores_per_call": 3.04,
         "router_us": 27.84, "store_us": 22.06, "p99_ms": 12.3},
        {"shards": 3, "step": "the library, batches of 100 matches", "scores_per_s": 148587,
         "router_us": None, "driver_us": 6.54, "store_us": 3.7, "p99_ms": None},
        {"shards": 16, "step": "64 connections back to back", "skipped": "bench.pacer exited 1: boom"},
    ]  # fmt: skip
    rows[0]["failures"] = 0
    rows[1]["errors"] = 0
    lines = load_steps.table(rows).splitlines()
    assert lines[0].startswith("| shards | step | scores/s |") and lines[0].endswith("| p99 ms | failures |")
    assert lines[2] == "| 3 | 5,000 scores/s paced | 4,990 | 3.0 | 27.8 | 22.1 | 12.3 | 0 |"
    assert lines[3] == "| 3 | the library, batches of 100 matches | 148,587 | - | (6.5) | 3.7 | - | 0 |"
    assert lines[4] == "| 16 | 64 connections back to back | skipped: bench.pacer exited 1: boom | | | | | |"
    assert len(lines) == 5
    no_driver = {**rows[1], "driver_us": None}
    assert (
        load_steps.table([no_driver]).splitlines()[2]
        == "| 3 | the library, batches of 100 matches | 148,587 | - | - | 3.7 | - | 0 |"
    )
    # A step's rate counts the requests that succeeded: the ones refused are beside it.
    refused = {**rows[0], "failures": 412}
    assert load_steps.table([refused]).splitlines()[2].endswith("| 12.3 | 412 |")


def test_the_two_library_steps_split_a_calls_fixed_part_from_its_scores_part() -> None:
    # Masters: 120 us a call and 10 us a score; replicas: 40 and 3. 10,000 calls of 1.3 scores,
    # then 2,000 calls of 62.
    def step(calls: int, per_call: float) -> dict[str, object]:
        scores = round(calls * per_call)
        cpu = {
            "redis masters": (calls * 120 + scores * 10) / 1e6,
            "redis replicas": (calls * 40 + scores * 3) / 1e6,
        }
        return {"script_calls": calls, "scores": scores, "cpu": {"cpu_s": cpu}}

    got = load_steps.call_costs(step(10_000, 1.3), step(2_000, 62))
    assert got == {
        "redis_master_us_per_call": 120.0,
        "redis_master_us_per_score_in_call": 10.0,
        "redis_replica_us_per_call": 40.0,
        "redis_replica_us_per_score_in_call": 3.0,
    }
    same = step(1_000, 10)
    assert load_steps.call_costs(same, step(3_000, 10)) == {}  # one call size: no split
    assert load_steps.call_costs({**same, "script_calls": 0}, step(2_000, 62)) == {}

    costs = {"3": got}
    line = load_steps.call_lines(costs)
    assert line.startswith("- 3 shards, a write script call: masters 120.0 µs a call + 10.00 µs a score")
    assert "replicas 40.0 + 3.00" in line
    assert load_steps.call_lines({}) == ""


def test_a_library_step_counts_retries_in_its_calls_not_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    # 95,000 fresh scores and 5,000 exact retries in 1,000 script calls over 10 s: the retries make
    # the calls' size, and the CPU and the rate are per score written, as the router's steps' are.
    phase = {
        "items": 95_000,
        "replayed_items": 5_000,
        "items_per_s": 9_500.0,
        "driver_cpu_seconds": 0.95,
        "cpu": {
            "cpu_s": {"redis masters": 0.76, "redis replicas": 0.19},
            "commands": {"evalsha": {"calls": 1_000}},
        },
    }
    monkeypatch.setattr(load_steps, "driver_phase", lambda job, processes, groups: phase)
    phase["errors"] = 3
    row = load_steps.library_step("redis://x", load_steps.Workload(), {}, 10.0, 100)
    assert row["errors"] == 3
    assert row["scores_per_s"] == 9_500 and row["scores"] == 100_000 and row["written"] == 95_000
    assert row["scores_per_call"] == 100.0
    assert (row["store_us"], row["driver_us"]) == (10.0, 10.0)
