"""bench/lua_cost.py: write.lua's instructions per score under callgrind, on a standalone redis-server."""

from __future__ import annotations

import pytest

from bench import lua_cost

pytestmark = pytest.mark.skipif(lua_cost.missing_tools() is not None, reason=str(lua_cost.missing_tools()))


def test_counts_repeat_and_a_timeless_result_costs_more_than_a_timed_one() -> None:
    """The point of counting instructions: the same calls give the same count, and a result
    without achieved_at, which looks for its pin in the window's buckets and records one, costs more
    than the same result with a time. Within 2%: on an idle machine two counts agree within 0.02%,
    but the server's once-a-second timer runs inside the counted window as often as the window
    lasts, and under a loaded CI one tick more (about 400k instructions) made 1.1% of these 40
    calls of 10 results."""
    script = lua_cost.SCRIPT.read_text()
    timeless = lua_cost.Shape("best", 10, False)
    first = lua_cost.instructions_per_score(script, timeless, warm=20, calls=40, full_window=True)
    again = lua_cost.instructions_per_score(script, timeless, warm=20, calls=40, full_window=True)
    timed = lua_cost.instructions_per_score(script, lua_cost.Shape("best", 10, True), 20, 20, True)
    assert first > 10_000
    assert abs(first - again) / first < 0.02
    assert first > 1.2 * timed


def test_the_table_gives_each_shape_and_the_change() -> None:
    rows = [{"shape": "best, 10 per call, with achieved_at", "this": 75_000, "abc123": 100_000}]
    assert (
        lua_cost.table(rows, "abc123")[2]
        == "| best, 10 per call, with achieved_at | 75,000 | 100,000 | -25.0% |"
    )
    assert lua_cost.table(rows, None)[2] == "| best, 10 per call, with achieved_at | 75,000 |"


def test_a_journaled_board_counts_its_journal_too() -> None:
    """--durability journal: the calls of a journaled board also append to its journal (and its
    count of results not archived), which costs instructions a memory board does not spend."""
    script = lua_cost.SCRIPT.read_text()
    shape = lua_cost.Shape("best", 10, True)
    memory = lua_cost.instructions_per_score(script, shape, 10, 20, False)
    journal = lua_cost.instructions_per_score(script, shape, 10, 20, False, durability="journal")
    assert journal > 1.02 * memory
