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
        {"shards": 3, "step": "5,000 scores/s paced", "scores_per_s": 4990, "router_us": 27.84,
         "store_us": 22.06, "p99_ms": 12.3},
        {"shards": 3, "step": "the library, batches of 100 matches", "scores_per_s": 148587,
         "router_us": None, "driver_us": 6.54, "store_us": 3.7, "p99_ms": None},
        {"shards": 16, "step": "64 connections back to back", "skipped": "bench.pacer exited 1: boom"},
    ]  # fmt: skip
    lines = load_steps.table(rows).splitlines()
    assert lines[0].startswith("| shards | step | scores/s |")
    assert lines[2] == "| 3 | 5,000 scores/s paced | 4,990 | 27.8 | 22.1 | 12.3 |"
    assert lines[3] == "| 3 | the library, batches of 100 matches | 148,587 | (6.5) | 3.7 | - |"
    assert lines[4] == "| 16 | 64 connections back to back | skipped: bench.pacer exited 1: boom | | | |"
    assert len(lines) == 5
    no_driver = {**rows[1], "driver_us": None}
    assert (
        load_steps.table([no_driver]).splitlines()[2]
        == "| 3 | the library, batches of 100 matches | 148,587 | - | 3.7 | - |"
    )
