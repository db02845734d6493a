"""Period names and ends (server-free): achieved time, board timezone, week starts, closing."""

from __future__ import annotations

import re
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis.strategies import DrawFn, booleans, composite, dates, integers, sampled_from

from shardlb import periods, times
from shardlb.errors import InvalidInput
from tests import zone_reference

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
        # At offset zero, "Z", as every other time the API writes (achieved_at, as_of): until
        # 2026-12-06 a UTC board's resets_at read "+00:00" beside them.
        ("d:2026-11-30", "UTC", "monday", "2026-12-01T00:00:00Z"),
        ("d:2026-11-30", "Europe/London", "monday", "2026-12-01T00:00:00Z"),
        ("d:2026-06-30", "Europe/London", "monday", "2026-07-01T00:00:00+01:00"),
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
    assert not at.endswith("+00:00"), at  # UTC is "Z": test_resets_at_is_the_end_in_the_boards_offset
    assert datetime.fromisoformat(at).timestamp() * 1000 == periods.end_ms(name, ZoneInfo(zone))


# ---- odd zones: offsets off the quarter hour, midnights skipped or repeated ------------------------


@composite
def zone_days(draw: DrawFn) -> tuple[ZoneInfo, date]:
    """A zone of zone_reference.ODD_ERAS and a day of its era, half of them within a day of a
    change of its offset."""
    zone, first, last = draw(sampled_from(zone_reference.ODD_ERAS))
    turns = zone_reference.turn_days(zone, first, last)
    if turns and draw(booleans()):
        return ZoneInfo(zone), draw(sampled_from(turns)) + timedelta(days=draw(integers(-1, 1)))
    return ZoneInfo(zone), draw(dates(min_value=date(first, 1, 1), max_value=date(last, 12, 31)))


def _next_first_day(kind: str, first: date) -> date:
    if kind == "daily":
        return first + timedelta(days=1)
    if kind == "weekly":
        return first + timedelta(days=7)
    return date(first.year + first.month // 12, first.month % 12 + 1, 1)


@settings(max_examples=300, deadline=None)
@given(zone_day=zone_days(), week_start=sampled_from(periods.WEEKDAYS))
def test_periods_start_at_the_first_instant_of_their_first_day(
    zone_day: tuple[ZoneInfo, date], week_start: str
) -> None:
    """Whatever the zone's offset (local mean time off the minute, -0:44:30 in Monrovia) and
    whether its clock skips or repeats midnight, a dated period starts at the first instant of its
    first local day (the reference scans the zone second by second) and ends where the next starts."""
    tz, day = zone_day
    for kind in periods.DATED:
        name = periods.name_for(kind, day, week_start)
        first = periods.first_day(name, week_start)[1]
        assert periods.start_ms(name, tz, week_start) == zone_reference.first_instant_ms(first, tz), name
        following = periods.name_for(kind, _next_first_day(kind, first), week_start)
        assert periods.end_ms(name, tz, week_start) == periods.start_ms(following, tz, week_start), name


@settings(max_examples=300, deadline=None)
@given(
    zone_day=zone_days(),
    delta=integers(-3 * 3_600_000, 3 * 3_600_000),
    week_start=sampled_from(periods.WEEKDAYS),
)
def test_a_time_counts_in_the_periods_whose_bounds_hold_it(
    zone_day: tuple[ZoneInfo, date], delta: int, week_start: str
) -> None:
    """Near a local midnight (within 3 hours of a day's first instant), the periods a time is filed
    in (names_at, and parse's current period) are those of the reference's day, and each holds the
    time within its [start, end): settlement selects a period's results by those bounds, so a
    result it would not find there must not be filed there either."""
    tz, day = zone_day
    at = zone_reference.first_instant_ms(day, tz) + delta
    day_of = zone_reference.day_of(at, tz)
    expected = [periods.name_for(kind, day_of, week_start) for kind in KINDS]
    assert periods.names_at(at, KINDS, tz, week_start) == expected
    for name in expected[1:]:
        assert periods.start_ms(name, tz, week_start) <= at < periods.end_ms(name, tz, week_start), name
        kind = periods.api_name(name).partition(":")[0]
        assert periods.parse(kind, KINDS, tz, at, week_start) == name


@pytest.mark.parametrize(
    ("zone", "name", "start"),
    [
        # Monrovia kept -0:44:30 until 1972: its days began at 00:44:30 UTC, inside a quarter hour.
        ("Africa/Monrovia", "d:1971-06-01", "1971-06-01T00:44:30Z"),
        # Kiritimati kept -10:40 until 1979.
        ("Pacific/Kiritimati", "d:1978-03-10", "1978-03-10T10:40:00Z"),
        # Santiago skips 00:00-01:00 on 8 Sep 2024: the day starts at 01:00 -03, the jump.
        ("America/Santiago", "d:2024-09-08", "2024-09-08T04:00:00Z"),
        # Havana skips 00:00-01:00 on 10 Mar 2024, and repeats 00:00-01:00 on 3 Nov 2024: the day
        # starts at the first of the two midnights.
        ("America/Havana", "d:2024-03-10", "2024-03-10T05:00:00Z"),
        ("America/Havana", "d:2024-11-03", "2024-11-03T04:00:00Z"),
        # Beirut skips 00:00-01:00 on 31 Mar 2024 and turns 00:00 back to Saturday 23:00 on 27 Oct.
        ("Asia/Beirut", "d:2024-03-31", "2024-03-30T22:00:00Z"),
        ("Asia/Beirut", "d:2024-10-27", "2024-10-26T22:00:00Z"),
        # St John's turned 00:01 back to Saturday 23:01 on 7 Nov 2010: Sunday began at 00:00 NDT.
        ("America/St_Johns", "d:2010-11-07", "2010-11-07T02:30:00Z"),
        # Apia skipped Friday 30 Dec 2011: that day is empty, starting and ending with the 31st.
        ("Pacific/Apia", "d:2011-12-30", "2011-12-30T10:00:00Z"),
        ("Pacific/Apia", "d:2011-12-31", "2011-12-30T10:00:00Z"),
    ],
)
def test_a_day_starts_at_its_first_instant(zone: str, name: str, start: str) -> None:
    assert periods.start_ms(name, periods.zone(zone)) == ms(start)


def test_the_hour_repeated_after_midnight_counts_in_the_new_day() -> None:
    """St John's turned its clocks back at 00:01 on Sunday 7 Nov 2010, to Saturday 23:01: Sunday had
    already started, so the repeated Saturday hour counts in Sunday (the period its bounds give),
    not in a Saturday that had already ended."""
    tz = periods.zone("America/St_Johns")
    repeated = ms("2010-11-07T03:00:00Z")  # Saturday 23:30 NST, the second time
    assert datetime.fromtimestamp(repeated / 1000, tz).date() == date(2010, 11, 6)
    assert periods.names_at(repeated, ("daily",), tz) == ["d:2010-11-07"]
    assert periods.end_ms("d:2010-11-06", tz) == ms("2010-11-07T02:30:00Z")
