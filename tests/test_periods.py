"""Period names and ends (server-free): achieved time, board timezone, ISO weeks."""

from __future__ import annotations

import pytest

from shardlb import periods, times
from shardlb.errors import InvalidInput

KINDS = ("total", "daily", "weekly", "monthly")


def ms(text: str) -> int:
    return times.parse(text, "t")


def test_names_follow_the_achieved_time_in_utc() -> None:
    names = periods.names_at(ms("2026-11-30T05:00:00Z"), KINDS, periods.zone("UTC"))
    assert names == ["total", "d:2026-11-30", "w:2026-W49", "m:2026-11"]


def test_names_follow_the_board_timezone() -> None:
    # 23:30 UTC on Sunday 29 Nov is already Monday 30 Nov in Tokyo: a new day and a new ISO week.
    tokyo = periods.names_at(ms("2026-11-29T23:30:00Z"), KINDS, periods.zone("Asia/Tokyo"))
    utc = periods.names_at(ms("2026-11-29T23:30:00Z"), KINDS, periods.zone("UTC"))
    assert tokyo == ["total", "d:2026-11-30", "w:2026-W49", "m:2026-11"]
    assert utc == ["total", "d:2026-11-29", "w:2026-W48", "m:2026-11"]


def test_iso_week_at_year_end() -> None:
    assert periods.names_at(ms("2027-01-01T12:00:00Z"), ("weekly",), periods.zone("UTC")) == ["w:2026-W53"]


@pytest.mark.parametrize(
    ("name", "end"),
    [
        ("d:2026-11-30", "2026-12-01T00:00:00Z"),
        ("w:2026-W48", "2026-11-30T00:00:00Z"),
        ("m:2026-12", "2027-01-01T00:00:00Z"),
    ],
)
def test_period_end(name: str, end: str) -> None:
    assert periods.end_ms(name, periods.zone("UTC")) == ms(end)


def test_parse_current_and_given_periods() -> None:
    now = ms("2026-11-30T05:00:00Z")
    tz = periods.zone("UTC")
    assert periods.parse("weekly", KINDS, tz, now) == "w:2026-W49"
    assert periods.parse("daily:2026-11-29", KINDS, tz, now) == "d:2026-11-29"
    assert periods.parse("monthly:2026-11", KINDS, tz, now) == "m:2026-11"
    assert periods.parse("total", KINDS, tz, now) == "total"


def test_api_names_spell_what_parse_reads() -> None:
    assert [periods.api_name(n) for n in ("total", "d:2026-11-30", "w:2026-W48", "m:2026-11")] == [
        "total",
        "daily:2026-11-30",
        "weekly:2026-W48",
        "monthly:2026-11",
    ]
    now, tz = ms("2026-11-30T05:00:00Z"), periods.zone("UTC")
    for text in ("total", "daily:2026-11-29", "weekly:2026-W53", "monthly:2026-01"):
        assert periods.api_name(periods.parse(text, KINDS, tz, now)) == text


@pytest.mark.parametrize(
    "text",
    ["yearly", "daily:2026-13-01", "weekly:2026-W60", "total:2026", "monthly:26-1", "total:", "daily:"],
)
def test_bad_periods_rejected(text: str) -> None:
    with pytest.raises(InvalidInput) as err:
        periods.parse(text, KINDS, periods.zone("UTC"), 0)
    assert err.value.code == "invalid_period"


def test_period_the_board_does_not_keep() -> None:
    with pytest.raises(InvalidInput, match="does not keep"):
        periods.parse("daily", ("total",), periods.zone("UTC"), 0)


def test_unknown_timezone() -> None:
    with pytest.raises(InvalidInput):
        periods.zone("Mars/Olympus")


@pytest.mark.parametrize(
    "text",
    [
        "weekly:٢٠٢٦-W48",  # Arabic-Indic digits: int() and \d take them
        "daily:２０２６-11-30",  # fullwidth digits
        "monthly:2026-1١",
        "weekly:2026-W٤8",
    ],
)
def test_only_ascii_digits_name_a_period(text: str) -> None:
    with pytest.raises(InvalidInput) as err:
        periods.parse(text, KINDS, periods.zone("UTC"), 0)
    assert err.value.code == "invalid_period"
