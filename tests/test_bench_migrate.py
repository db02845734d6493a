"""The checks bench/migrate.py applies to every page read and to the write attempts (no server)."""

from __future__ import annotations

from typing import Any

from bench.chaos import RETRY_PAUSE_S, Attempt
from bench.migrate import page_problem, refused_seconds


def page(*rows: tuple[str, int]) -> list[dict[str, Any]]:
    return [{"player_id": p, "points": pts, "rank": i} for i, (p, pts) in enumerate(rows, start=1)]


def test_an_exact_page_passes_and_players_sent_later_may_be_on_it() -> None:
    assert page_problem(page(("a", 9), ("b", 7), ("c", 7)), {"a", "b"}) is None


def test_a_player_shown_twice_is_caught() -> None:
    assert page_problem(page(("a", 9), ("b", 7), ("a", 5)), set()) == "shown twice: ['a']"


def test_a_player_acknowledged_before_the_read_and_missing_is_caught() -> None:
    assert page_problem(page(("a", 9)), {"a", "z"}) == "missing 1 acknowledged: ['z']"


def test_ranks_and_order_are_checked() -> None:
    rows = page(("a", 9), ("b", 7))
    rows[1]["rank"] = 3
    assert page_problem(rows, set()) == "ranks are not 1..n"
    assert page_problem(page(("a", 7), ("b", 9)), set()) == "points out of order"


def test_refused_seconds_are_the_union_of_failed_spans_with_the_retry_pause() -> None:
    attempts = [
        Attempt(0.0, 1.0, 200),
        Attempt(1.0, 2.0, 503),
        Attempt(1.5, 2.5, 503),  # overlaps the one before: counted once
        Attempt(5.0, 5.5, "ReadTimeout"),
        Attempt(6.0, 7.0, 200),
    ]
    expected = (2.5 + RETRY_PAUSE_S - 1.0) + (0.5 + RETRY_PAUSE_S)
    assert refused_seconds(attempts) == round(expected, 2)
    assert refused_seconds([Attempt(0.0, 1.0, 200)]) == 0.0
