"""bench/app_cost.py: the router app's own CPU per score write, measured in a process of its own."""

from __future__ import annotations

import pytest
import redis

from bench import app_cost
from shardlb import keys
from shardlb.cluster import LocalCluster


def test_the_fit_splits_a_request_from_its_scores() -> None:
    # 10 scores cost 130 µs and 100 cost 670: 6 µs a score, 70 a request.
    per_request, per_score = app_cost.fit(130.0, 670.0)
    assert per_score == pytest.approx(6.0) and per_request == pytest.approx(70.0)


def test_the_summary_takes_medians_and_the_table_the_change() -> None:
    rounds = {
        "this": [
            {"one_match_us": 130.0, "ten_matches_us": 670.0, "healthz_us": 30.0},
            {"one_match_us": 500.0, "ten_matches_us": 680.0, "healthz_us": 20.0},
            {"one_match_us": 120.0, "ten_matches_us": 660.0, "healthz_us": 40.0},
        ],
        "abc123": [{"one_match_us": 260.0, "ten_matches_us": 800.0, "healthz_us": 30.0}],
    }
    summary = app_cost.summarise(rounds)
    assert summary["this"]["one_match_us"] == 130.0  # the median, not the outlier
    assert summary["this"]["per_score_us"] == pytest.approx(6.0)
    lines = app_cost.table(summary, "abc123")
    assert lines[0] == "| router app CPU | this | abc123 | change |"
    assert lines[2] == "| post of 1 match (10 scores), µs a request | 130.0 | 260.0 | -50.0% |"
    alone = app_cost.table({"this": summary["this"]}, None)
    assert alone[4] == "| GET /healthz (Starlette's path), µs a request | 30.0 |"


@pytest.mark.cluster
def test_a_worker_measures_this_tree_against_the_suite_cluster(cluster: LocalCluster) -> None:
    """One round, small: the worker process builds the app, posts to a board of its own (a post
    answered with an error would fail it) and reports CPU for each measure; its board is deleted."""
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
