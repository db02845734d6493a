"""bench/versus.py's pure parts: the same points for both sides, and the table of medians."""

from __future__ import annotations

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
