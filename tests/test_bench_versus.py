"""bench/versus.py, bench/versus_writes.py and bench/versus_reads.py, their pure parts: the same
points for both sides, the tables of medians, a router's CPU per write, a read mix's figures."""

from __future__ import annotations

import pytest

from bench import versus


def test_both_sides_get_the_same_long_tailed_points() -> None:
    drawn = versus.points(10_000)
    assert drawn == versus.points(10_000)
    assert min(drawn) >= 100 and max(drawn) > 10 * sorted(drawn)[len(drawn) // 2]


def test_the_table_gives_each_sides_median_and_their_ratio() -> None:
    def run(rps: float, p99: float, cpu: float) -> dict[str, float]:
        return {"rps": rps, "p99_ms": p99, "router_us": cpu}

    runs = {
        "old": [run(100.0, 9.0, 300.0), run(80.0, 12.0, 320.0), run(90.0, 10.0, 310.0)],
        "new": [run(400.0, 3.0, 75.0), run(360.0, 4.0, 80.0), run(380.0, 2.0, 70.0)],
    }
    header, rule, row = versus.table({"my rank": runs}, ("old", "new"))
    assert header.startswith("| target | old requests/s (p99 ms) | new requests/s (p99 ms) | new / old |")
    assert rule.count("|") == header.count("|")
    assert row == "| my rank | 90 (10) | 380 (3) | 4.22 | 310 / 75 |"


def test_versus_writes_counts_router_cpu_per_write_over_the_shared_window() -> None:
    from bench.versus_writes import medians, per_write_us

    # 40,000 writes/s counted over 10 s; 2.4 s of router CPU metered over 6 s: 10 µs a write.
    assert per_write_us(2.4, 400_000, 10.0, 6.0) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        per_write_us(1.0, 0, 10.0, 6.0)
    rounds = [
        {"side": "this", "writes_per_s": 100, "router_us_per_write": 15.0},
        {"side": "other", "writes_per_s": 90, "router_us_per_write": 16.0},
        {"side": "this", "writes_per_s": 120, "router_us_per_write": 14.0},
        {"side": "other", "writes_per_s": 95, "router_us_per_write": 17.0},
        {"side": "this", "writes_per_s": 110, "router_us_per_write": 30.0},
    ]
    assert medians(rounds) == {
        "this": {"writes_per_s": 110, "router_us_per_write": 15.0},
        "other": {"writes_per_s": 92.5, "router_us_per_write": 16.5},
    }


def test_versus_reads_figures_count_cpu_over_every_request_as_make_bench_does() -> None:
    from bench.versus_reads import figures

    endpoint = {"requests": 0, "failures": 0, "rps": 0.0, "p50": 1.0, "p95": 2.0, "max": 9.0}
    reads = {
        "reads_per_s": 990.0,
        "requests": 10_000,
        "failures": 100,
        "locust_cpu_bound": False,
        "endpoints": {
            "GET /v1/boards/[board]/top": {**endpoint, "rps": 400.0, "p99": 20.0},
            "Aggregated": {**endpoint, "rps": 1000.0, "p99": float("nan")},
        },
        "cpu": {
            "cpu_s": {"redis masters": 3.0, "redis replicas": 1.0, "router": 5.0, "locust": 7.0},
            "other_cpu_s": 5.0,
            "steal_cpu_s": 0.0,
            "wall_s": 10.0,
        },
    }
    got = figures(reads)
    assert got["store_us_per_read"] == 400.0  # masters and replicas: 4 s over 10,000 requests
    assert got["masters_us_per_read"] == 300.0
    assert got["router_us_per_read"] == 500.0
    assert got["GET /v1/boards/[board]/top: reads/s"] == 400.0
    assert got["GET /v1/boards/[board]/top: p99 ms"] == 20.0
    assert got["all reads: reads/s"] == 1000.0
    assert got["other_cores"] == 0.5


def test_versus_reads_medians_and_ratio_per_figure() -> None:
    from bench.versus_reads import medians, paired, table

    rounds = [
        {"round": 1, "side": "this", "requests": 5, "reads_per_s": 100.0, "p99": 10.0, "flag": True},
        {"round": 1, "side": "other", "requests": 5, "reads_per_s": 200.0, "p99": 5.0, "flag": False},
        {"round": 2, "side": "other", "requests": 5, "reads_per_s": 240.0, "p99": float("nan")},
        {"round": 2, "side": "this", "requests": 5, "reads_per_s": 140.0, "p99": 14.0},
        {"round": 3, "side": "this", "requests": 5, "reads_per_s": 120.0, "p99": 11.0, "failures": 0},
    ]
    summary = medians(rounds)
    # NaN (Locust's N/A) and flags are left out; a figure only some rounds have is their median.
    assert summary == {
        "this": {"reads_per_s": 120.0, "p99": 11.0, "failures": 0},
        "other": {"reads_per_s": 220.0, "p99": 5.0},
    }
    header, rule, *rows = table(summary)
    assert header == "| median over the rounds | this | other | this / other |"
    assert rule.count("|") == header.count("|")
    assert rows == [
        "| reads_per_s | 120.0 | 220.0 | 0.545 |",
        "| p99 | 11.0 | 5.0 | 2.200 |",
        "| failures | 0.0 | - | - |",
    ]
    # Round by round: round 3 has no "other" side, so no ratio.
    assert paired(rounds, "reads_per_s") == [0.5, 0.583]
    assert paired(rounds, "p99") == [2.0]  # round 2's "other" is NaN
