"""bench/app_cost.py: the router app's own CPU per score write, measured in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from bench import app_cost, lua_cost
from shardlb import keys
from shardlb.cluster import LocalCluster

NO_VALGRIND = lua_cost.missing_tools()


def test_the_fit_splits_a_request_from_its_scores() -> None:
    # 10 scores cost 130 µs and 100 cost 670: 6 µs a score, 70 a request.
    per_request, per_score = app_cost.fit(130.0, 670.0)
    assert per_score == pytest.approx(6.0) and per_request == pytest.approx(70.0)


def test_the_summary_takes_medians_and_the_table_the_change() -> None:
    rounds = {
        "this": [
            {"one_match_us": 130.0, "ten_matches_us": 670.0, "healthz_us": 30.0, "rank_us": 50.0},
            {"one_match_us": 500.0, "ten_matches_us": 680.0, "healthz_us": 20.0, "rank_us": 70.0},
            {"one_match_us": 120.0, "ten_matches_us": 660.0, "healthz_us": 40.0, "rank_us": 60.0},
        ],
        # a round of a run before "my rank" was measured (its app_cost.json): no rank_us
        "abc123": [{"one_match_us": 260.0, "ten_matches_us": 800.0, "healthz_us": 30.0}],
    }
    summary = app_cost.summarise(rounds)
    assert summary["this"]["one_match_us"] == 130.0  # the median, not the outlier
    assert summary["this"]["per_score_us"] == pytest.approx(6.0)
    lines = app_cost.table(summary, "abc123")
    assert lines[0] == "| router app CPU | this | abc123 | change |"
    assert lines[2] == "| post of 1 match (10 scores), µs a request | 130.0 | 260.0 | -50.0% |"
    assert "rank_us" not in summary["abc123"]
    assert lines[5] == "| GET my rank (3 hash shards, 5,000 players), µs a request | 60.0 | - | - |"
    alone = app_cost.table({"this": summary["this"]}, None)
    assert alone[4] == "| GET /healthz (Starlette's path), µs a request | 30.0 |"
    old = app_cost.table({"abc123": summary["abc123"]}, None)
    assert not [line for line in old if "my rank" in line]  # a row no variant has is left out


@pytest.mark.cluster
def test_a_worker_measures_this_tree_against_the_suite_cluster(cluster: LocalCluster) -> None:
    """One round, small: the worker process builds the app, posts to a board of its own and reads
    "my rank" on a second one of 3 shards (a request answered with an error, a 404 of a player
    without a score among them, would fail it) and reports CPU for each measure; its boards are
    deleted."""
    result = app_cost.measure(app_cost.ROOT, cluster.url, 3, 50, 8)
    assert set(result) == set(app_cost.MEASURES)
    assert all(value > 0 for value in result.values())
    # a post of 100 scores costs the app more than one of 10
    assert result["ten_matches_us"] > result["one_match_us"]
    client = redis.RedisCluster.from_url(cluster.url.split(",")[0])
    try:
        assert not [b for b in client.hkeys(keys.BOARDS) if b.startswith(b"app-cost-")]
    finally:
        client.close()


@pytest.mark.skipif(NO_VALGRIND is not None, reason=str(NO_VALGRIND))
def test_a_tiny_counted_run_against_a_revision_ends_with_both_tables() -> None:
    """`make bench-app INSTRUCTIONS=1 AGAINST=rev`, tiny, as a user starts it (a cluster of its own):
    the CPU table, then the instruction counts of both revisions under callgrind, labelled a proxy."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDLB_REDIS_URL"}
    command = [
        sys.executable, "-m", "bench.app_cost", "--instructions", "--against", "HEAD", "--rounds", "1",
        "--requests", "10", "--waves", "1", "--concurrency", "8", "--shards", "3", "--warm", "50",
    ]  # fmt: skip
    # --warm 50, not the 2,000 posts of a real run: under valgrind those took most of the counted
    # runs' time. The warm-up makes the figures repeat from run to run; what this test checks (both
    # tables, whole counts above 10,000 for both revisions) holds after any warm-up, and 50 posts
    # still make the board's keys, load the scripts and open the pools before anything is counted.
    run = subprocess.run(
        command, cwd=app_cost.ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "| router app CPU | this | HEAD | change |" in run.stdout, out[-3000:]
    assert "A proxy" in run.stdout
    assert "| router app instructions (proxy) | this | HEAD | change |" in run.stdout
    counted = [line for line in run.stdout.splitlines() if "instructions a request |" in line]
    assert len(counted) == 6  # one-match post, ten-match post, /healthz, my rank, around, friends
    for line in counted:  # whole numbers for both revisions, every one above 10,000
        assert all(int(cell.replace(",", "")) > 10_000 for cell in line.split("|")[2:4]), line


def test_without_valgrind_the_counted_mode_says_what_to_install(tmp_path: object) -> None:
    """No valgrind on PATH: one line naming it and Debian's package, exit status 1, no traceback
    (as `make bench-lua` says it), before any cluster is started."""
    env = {**os.environ, "PATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "bench.app_cost", "--instructions"],
        cwd=app_cost.ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 1
    assert "valgrind not found" in run.stderr and "apt-get install valgrind" in run.stderr
    assert "Traceback" not in run.stderr
