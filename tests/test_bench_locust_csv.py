"""Reading Locust's CSVs: a fixture in Locust's own format (header lines as Locust 2.x writes them)."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import locust_csv, report, shapes

PCTS = ["50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]
STATS = [
    "Type",
    "Name",
    "Request Count",
    "Failure Count",
    "Median Response Time",
    "Average Response Time",
    "Min Response Time",
    "Max Response Time",
    "Average Content Size",
    "Requests/s",
    "Failures/s",
    *PCTS,
]
HISTORY = [
    "Timestamp",
    "User Count",
    "Type",
    "Name",
    "Requests/s",
    "Failures/s",
    *PCTS,
    "Total Request Count",
    "Total Failure Count",
    "Total Median Response Time",
    "Total Average Response Time",
    "Total Min Response Time",
    "Total Max Response Time",
    "Total Average Content Size",
]


def stats_row(
    type_: str, name: str, count: int, failures: int, size: float, p50: int, p95: int, p99: int
) -> list:
    pct = [p50, p50, p50, p50, p95, p95, p99, p99, p99, p99, p99]
    return [type_, name, count, failures, p50, p50, 1, p99, size, count / 20, failures / 20, *pct]


def history_row(
    t: int, users: int, type_: str, name: str, count: int, size: float, p99: str = "N/A", p50: str = "N/A"
) -> list:
    return [
        t,
        users,
        type_,
        name,
        "0.0",
        "0.0",
        *([p50] * 5),  # 50% to 90%
        p99,  # 95%
        p99,  # 98%
        p99,
        "N/A",
        "N/A",
        "N/A",
        count,
        0,
        0,
        0,
        0,
        0,
        size,
    ]


def write(path: Path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


@pytest.fixture
def run(tmp_path: Path) -> SimpleNamespace:
    prefix = tmp_path / "http-writes"
    write(
        Path(f"{prefix}_stats.csv"),
        STATS,
        [
            stats_row("POST", "/v1/boards/[board]/scores", 2010, 10, 0.0, 20, 80, 120),
            stats_row("WRITE", "player-scores", 2000, 0, 9.5, 20, 80, 120),
            stats_row("", "Aggregated", 4010, 10, 4.7, 20, 80, 120),
        ],
    )
    rows = [history_row(100, 0, "", "Aggregated", 0, 0)]
    # Workers report every 2 s: the master repeats the last total in between.
    counts = {
        101: 0,
        102: 100,
        103: 100,
        104: 300,
        105: 300,
        106: 600,
        107: 600,
        108: 1000,
        109: 1000,
        110: 1400,
        111: 1400,
        112: 2000,
    }
    for t, count in counts.items():
        rows.append(history_row(t, 10, "WRITE", "player-scores", count, 9.5 if count else 0))
        rows.append(history_row(t, 10, "POST", "/v1/boards/[board]/scores", count, 0, str(t), str(t - 100)))
    write(Path(f"{prefix}_stats_history.csv"), HISTORY, rows)
    cpu = {"busiest_process_share": {"locust": 0.95}, "cpu_s": {}, "wall_s": 12}
    return SimpleNamespace(
        stats=Path(f"{prefix}_stats.csv"),
        history=Path(f"{prefix}_stats_history.csv"),
        cpu=cpu,
        warnings=[],
        returncode=0,
    )


def test_stats_and_scores_written(run: SimpleNamespace) -> None:
    endpoints = locust_csv.read_stats(run.stats)
    assert [e.key for e in endpoints] == [
        "POST /v1/boards/[board]/scores",
        "WRITE player-scores",
        "Aggregated",
    ]
    assert endpoints[0].failures == 10 and endpoints[0].p99 == 120
    assert locust_csv.scores_written(endpoints) == 19_000


def test_rates_use_only_the_moments_counts_moved(run: SimpleNamespace) -> None:
    history = locust_csv.read_history(run.history, "WRITE", "player-scores")
    assert [s.t for s in locust_csv.updates(history)] == [101, 102, 104, 106, 108, 110, 112]
    # 102 -> 110: (1400 - 100) requests x 9.5 scores over 8 s
    assert locust_csv.rate_between(history, 101.5, 111) == pytest.approx(1300 * 9.5 / 8)
    assert locust_csv.best_window(history, 4) == pytest.approx((2000 - 1000) * 9.5 / 4)
    assert locust_csv.rate_between(history, 200, 300) == 0.0


def test_report_of_a_ramp(run: SimpleNamespace) -> None:
    stages = shapes.schedule("ramp", 2000, 12, user_rps=10, scores_per_request=10, steps=2)
    out = report.http_writes(run, stages)
    assert out["scores_written"] == 19_000
    assert out["failures"] == 10
    assert out["locust_cpu_bound"] is True  # the busiest Locust process used 95% of a core
    assert [s["offered"] for s in out["steps"]] == [1000, 2000]
    assert out["steps"][1]["achieved"] == round((2000 - 1000) * 9.5 / 4)
    assert out["steps"][1]["p99_ms"] == 112


def test_report_of_a_constant_rate_step(run: SimpleNamespace) -> None:
    stages = shapes.schedule("soak", 1000, 12, user_rps=10, scores_per_request=10)
    assert [s.until for s in stages] == [3, 12]  # 3 s at half the rate, then held
    out = report.latency_step(run, stages)
    assert (out["users"], out["offered"]) == (10, 1000)
    # held from 3 s, spawning over 2 s more: 106 -> 112, (2000 - 600) requests x 9.5 scores over 6 s
    assert out["achieved"] == round((2000 - 600) * 9.5 / 6)
    # Locust's window at the end of the step: the last history row up to t0 + 12
    assert (out["p50_ms"], out["p95_ms"], out["p99_ms"]) == (12, 112, 112)
    assert out["latency_window_s"] == locust_csv.RECENT_WINDOW_S
    assert (out["requests"], out["failures"]) == (2010, 10)
    assert out["locust_cpu_bound"] is True


def test_a_step_without_windowed_percentiles_reports_the_whole_runs(run: SimpleNamespace) -> None:
    with open(run.history, newline="") as f:
        rows = list(csv.reader(f))
    for row in rows[1:]:
        row[6:17] = ["N/A"] * 11
    write(run.history, rows[0], rows[1:])
    out = report.latency_step(run, shapes.schedule("soak", 1000, 12, user_rps=10, scores_per_request=10))
    assert (out["p50_ms"], out["p95_ms"], out["p99_ms"]) == (20, 80, 120)  # the stats file's POST row
    assert out["latency_window_s"] == 12


def test_a_read_mix_counts_only_the_reads_that_succeeded(tmp_path: Path) -> None:
    """Locust's Requests/s counts every request, failed ones too: a router answering a third of the
    reads with a quick 503 would read as a third more reads/s. The mix's rate is its successes'."""
    prefix = tmp_path / "http-reads"
    write(
        Path(f"{prefix}_stats.csv"),
        STATS,
        [
            stats_row("GET", "/v1/boards/[board]/top", 2000, 1000, 0.0, 5, 9, 12),
            stats_row("GET", "/v1/boards/[board]/players/[id]", 1000, 0, 0.0, 5, 9, 12),
            stats_row("", "Aggregated", 3000, 1000, 0.0, 5, 9, 12),
        ],
    )
    cpu = {"busiest_process_share": {"locust": 0.2}, "cpu_s": {}, "wall_s": 20}
    run = SimpleNamespace(stats=Path(f"{prefix}_stats.csv"), cpu=cpu, warnings=[], returncode=1)
    out = report.http_reads(run)
    assert out["reads_per_s"] == 100.0  # 2,000 that succeeded over 20 s, not Locust's 150
    assert (out["failures"], out["requests"]) == (1000, 3000)
    assert out["endpoints"]["Aggregated"]["rps"] == 150.0  # Locust's own figure, as it printed it
