"""Period names and ends (server-free): achieved time, board timezone, week starts, closing."""

from __future__ import annotations

import re
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis.strategies import dates, sampled_from

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


# ---- period lifecycle: week starts, ends, closing, resets_at ------------------------------------


@pytest.mark.parametrize(
    ("week_start", "first", "last"),
    [
        ("monday", "2026-11-30", "2026-12-06"),
        ("sunday", "2026-11-29", "2026-12-05"),
        ("saturday", "2026-11-28", "2026-12-04"),
        ("wednesday", "2026-11-25", "2026-12-01"),
    ],
)
def test_a_week_is_named_after_the_iso_week_of_its_monday(week_start: str, first: str, last: str) -> None:
    """Every week below contains Monday 30 Nov 2026 (ISO 2026-W49): all are w:2026-W49, from their
    first day through their last, and the days just outside belong to the weeks around it."""
    utc = periods.zone("UTC")
    start, end = date.fromisoformat(first), date.fromisoformat(last)
    for n in range((end - start).days + 1):
        assert periods.name_for("weekly", start + timedelta(days=n), week_start) == "w:2026-W49"
    assert periods.name_for("weekly", start - timedelta(days=1), week_start) == "w:2026-W48"
    assert periods.name_for("weekly", end + timedelta(days=1), week_start) == "w:2026-W50"
    assert periods.first_day("w:2026-W49", week_start) == ("weekly", start)
    assert periods.end_ms("w:2026-W49", utc, week_start) == ms(f"{end + timedelta(days=1)}T00:00:00Z")


@settings(max_examples=300)
@given(
    day=dates(min_value=date(2000, 1, 1), max_value=date(2100, 12, 31)), start=sampled_from(periods.WEEKDAYS)
)
def test_week_names_are_one_to_one_with_weeks(day: date, start: str) -> None:
    """Whatever the week start, the week of ``day`` has one name that the API pattern accepts and
    that parse, first_day and end_ms read back as that same week: seven days starting on ``start``."""
    name = periods.name_for("weekly", day, start)
    kind, first = periods.first_day(name, start)
    assert kind == "weekly" and first.weekday() == periods.WEEKDAYS.index(start)
    assert first <= day < first + timedelta(days=7)
    assert periods.name_for("weekly", first + timedelta(days=7), start) != name
    api = periods.api_name(name)
    assert re.fullmatch(periods.API_PATTERN, api)
    assert periods.parse(api, KINDS, periods.zone("UTC"), 0, start) == name
    assert periods.parse("weekly", KINDS, periods.zone("UTC"), ms(f"{day}T12:00:00Z"), start) == name


def test_weeks_across_a_year_end_keep_iso_numbers() -> None:
    # Sunday 27 Dec 2026 starts the Sunday week holding Monday 28 Dec: ISO 2026-W53.
    assert periods.name_for("weekly", date(2026, 12, 27), "sunday") == "w:2026-W53"
    assert periods.name_for("weekly", date(2027, 1, 2), "sunday") == "w:2026-W53"
    assert periods.name_for("weekly", date(2027, 1, 3), "sunday") == "w:2027-W01"
    # Saturday 26 Dec 2020 starts the week holding Monday 28 Dec 2020: ISO 2020-W53.
    assert periods.name_for("weekly", date(2020, 12, 26), "saturday") == "w:2020-W53"


def test_a_day_ends_at_local_midnight_across_a_dst_change() -> None:
    new_york = periods.zone("America/New_York")
    # 8 Mar 2026 has 23 hours in New York (clocks go forward at 02:00): it ends at 04:00Z, not 05:00Z.
    assert periods.end_ms("d:2026-03-07", new_york) == ms("2026-03-08T05:00:00Z")
    assert periods.end_ms("d:2026-03-08", new_york) == ms("2026-03-09T04:00:00Z")


def test_a_period_closes_its_grace_after_its_end() -> None:
    utc = periods.zone("UTC")
    end = ms("2026-12-01T00:00:00Z")
    assert periods.closes_ms("d:2026-11-30", utc, 300) == end + 300_000
    assert periods.closes_ms("d:2026-11-30", utc, 0) == end
    assert periods.closes_ms("w:2026-W49", utc, 60, "sunday") == ms("2026-12-06T00:01:00Z")
    assert periods.closes_ms("m:2026-11", periods.zone("Asia/Tokyo"), 300) == ms("2026-11-30T15:05:00Z")


@pytest.mark.parametrize(
    ("name", "zone", "week_start", "resets"),
    [
        ("total", "UTC", "monday", None),
        ("d:2026-11-30", "UTC", "monday", "2026-12-01T00:00:00+00:00"),
        ("d:2026-11-30", "Asia/Tokyo", "monday", "2026-12-01T00:00:00+09:00"),
        ("w:2026-W49", "Asia/Tokyo", "sunday", "2026-12-06T00:00:00+09:00"),
        ("m:2026-03", "America/New_York", "monday", "2026-04-01T00:00:00-04:00"),  # daylight time
        ("m:2026-11", "America/New_York", "monday", "2026-12-01T00:00:00-05:00"),  # standard time
        ("d:2026-11-30", "Asia/Kolkata", "monday", "2026-12-01T00:00:00+05:30"),
    ],
)
def test_resets_at_is_the_end_in_the_boards_offset(
    name: str, zone: str, week_start: str, resets: str | None
) -> None:
    assert periods.resets_at(name, periods.zone(zone), week_start) == resets


@pytest.mark.parametrize(
    ("name", "zone"),
    [("d:1971-06-01", "Africa/Monrovia"), ("d:0001-01-01", "America/New_York"), ("d:2026-12-05", "UTC")],
)
def test_resets_at_is_rfc_3339_even_where_the_offset_has_seconds(name: str, zone: str) -> None:
    """Offsets of local mean time (-00:44:30 in Monrovia until 1972, -04:56:02 in New York before
    1883) came out with seconds, which RFC 3339 has no room for; those are given in UTC now."""
    at = periods.resets_at(name, ZoneInfo(zone))
    assert at is not None and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d([+-]\d\d:\d\d|Z)", at), at
    assert datetime.fromisoformat(at).timestamp() * 1000 == periods.end_ms(name, ZoneInfo(zone))
