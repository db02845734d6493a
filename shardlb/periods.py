"""Period names: which daily, weekly and monthly board a result counts in, and when those end.

A result counts in the periods of its *achieved* time in the board's timezone, never its arrival time,
so a replay lands on the same keys. Names are the key suffixes: ``total``, ``d:2026-11-30``,
``w:2026-W48``, ``m:2026-11``.

Weeks start on the board's ``week_start`` day. Whatever that day, a week is named after the ISO week
of the one Monday among its seven days: with ``monday`` the names are exactly ISO weeks, and with
any start every ISO week name still names exactly one week (so the API pattern is the same), the
week containing that Monday. A Sunday-start week from Sunday 29 Nov 2026 to Saturday 5 Dec is
``w:2026-W49``, as is the Monday-start week from Monday 30 Nov.

Every dated period starts where its first local day starts, and a day starts at its first instant
(``day_start_ms``): usually its midnight, but the first of two midnights where clocks turn back
from 01:00 to 00:00 (Havana), and the instant of the jump where they skip midnight (Santiago,
Havana and Beirut go from 00:00 to 01:00). Days are contiguous: a time counts in the last day that
has started by then (``local_day``). That is its local date except where a clock turned back across
midnight (St John's from Sunday 00:01 to Saturday 23:01, until 2011): the repeated Saturday minutes
come after Sunday started, so they count in Sunday, and a period's results are exactly the times in
its [start, end), which is how settlement selects them. Offsets need not be whole minutes (local
mean time: -0:44:30 in Monrovia until 1972); tzdata's are whole seconds, and so is every day's start.
"""

from __future__ import annotations

import functools
import re
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from shardlb.errors import InvalidInput

KINDS = ("total", "daily", "weekly", "monthly")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
DATED = ("daily", "weekly", "monthly")
_PREFIX = {"daily": "d", "weekly": "w", "monthly": "m"}
_KIND_OF_PREFIX = {v: k for k, v in _PREFIX.items()}


def _alternation(values: list[str]) -> str:
    return f"({'|'.join(values)})"


def _api_pattern() -> str:
    """The regular expression of every API period name whose date exists in the calendar.

    Exact, so that the OpenAPI document can carry it and a client can tell a good name from a bad one
    without asking: ASCII digits only, years 0001-9999, days that exist (29 February in leap years),
    and week 53 only in the years that have one. The calendar repeats every 400 years, so a year's
    week count follows from its century modulo 4 and its last two digits.
    """
    year = "([0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"
    month = "(0[1-9]|1[0-2])"
    leap = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
    day = (
        f"{year}-((0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])|(0[13-9]|1[0-2])-(29|30)|(0[13578]|1[02])-31)"
        f"|{leap}-02-29"
    )
    long_years = []
    for century in range(4):
        tails = [
            f"{t:02d}" for t in range(100) if date(2000 + 100 * century + t, 12, 28).isocalendar()[1] == 53
        ]
        centuries = [f"{c:02d}" for c in range(century, 100, 4)]
        long_years.append(_alternation(centuries) + _alternation(tails))
    week = f"{year}-W(0[1-9]|[1-4][0-9]|5[0-2])|{_alternation(long_years)}-W53"
    return f"^(total|daily|weekly|monthly|daily:({day})|weekly:({week})|monthly:{year}-{month})$"


API_PATTERN = _api_pattern()
_API_NAME = re.compile(API_PATTERN)


@functools.cache
def zone_names() -> frozenset[str]:
    """The IANA names a board may use: ZoneInfo also opens other files of the database (such as
    "posixrules"), which no client means and the OpenAPI document cannot list."""
    return frozenset(available_timezones())


def zone(name: str) -> ZoneInfo:
    if name not in zone_names():
        raise InvalidInput(f"unknown timezone {name!r}", "timezone")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise InvalidInput(f"unknown timezone {name!r}", "timezone") from e


def _monday_after_start(week_start: str) -> int:
    """Days from the first day of a week starting on ``week_start`` to the Monday in it."""
    return -WEEKDAYS.index(week_start) % 7


def week_first_day(day: date, week_start: str = "monday") -> date:
    """The first day of the week (starting on ``week_start``) that contains ``day``."""
    return day - timedelta(days=(day.weekday() - WEEKDAYS.index(week_start)) % 7)


def name_for(kind: str, day: date, week_start: str = "monday") -> str:
    """The period name of ``kind`` containing the local calendar day ``day``."""
    if kind == "total":
        return "total"
    if kind == "daily":
        return f"d:{day.isoformat()}"
    if kind == "weekly":
        monday = week_first_day(day, week_start) + timedelta(days=_monday_after_start(week_start))
        year, week, _ = monday.isocalendar()
        return f"w:{year}-W{week:02d}"
    if kind == "monthly":
        return f"m:{day.year}-{day.month:02d}"
    raise InvalidInput(f"unknown period kind {kind!r}", "period")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)
_ONE_DAY = timedelta(days=1)
# The end of the last day Python's dates hold (9999-12-31): past any time a board takes.
_END_OF_CALENDAR_MS = 2**62


def _shows(second: int, tz: ZoneInfo) -> datetime:
    """The local wall clock (naive) at the epoch second ``second``."""
    return datetime.fromtimestamp(second, tz).replace(tzinfo=None)


@functools.lru_cache(maxsize=4096)
def day_start_ms(day: date, tz: ZoneInfo) -> int:
    """The first instant (epoch ms) of the local day ``day``: the first whose local date is ``day``
    or later (see the module's docstring). A day the zone skipped whole (Apia's 30 Dec 2011) starts
    and ends where the next one starts: it holds no time.

    ``datetime(day, tzinfo=tz)`` alone is its midnight read with the offset before a change (fold
    0): the first midnight where there are two, and where the clock jumps over midnight an instant
    past the jump unless the jump starts at midnight exactly. So midnight is used only when it is a
    reading of the clock; else the jump lies between the two readings of the skipped midnight, and
    is found by bisection over whole seconds. Cached: every period name, end and close goes here.
    """
    midnight = datetime(day.year, day.month, day.day)
    earlier = midnight.replace(tzinfo=tz)  # fold 0: the offset before a change
    at = (earlier - _EPOCH) // _ONE_MS
    try:
        if _shows(at // 1000, tz) == midnight:
            return at
    except (OverflowError, ValueError):  # a reading in year 0 or 10000: no change of offset there
        return at
    # Skipped: read with the offset after the change (fold 1) midnight is before the jump, and with
    # the offset before it (fold 0) after it.
    before = (midnight.replace(tzinfo=tz, fold=1) - _EPOCH) // _ONE_MS // 1000
    after = at // 1000
    while after - before > 1:
        mid = (before + after) // 2
        if _shows(mid, tz) >= midnight:
            after = mid
        else:
            before = mid
    return after * 1000


def local_day(epoch_ms: int, tz: ZoneInfo) -> date:
    """The local day the time ``epoch_ms`` counts in: the last that has started by then. That is its
    local date, but for the minutes a clock repeats after turning back across midnight, which count
    in the day already started (the module's docstring)."""
    day = datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).astimezone(tz).date()
    while day < date.max and day_start_ms(day + _ONE_DAY, tz) <= epoch_ms:
        day += _ONE_DAY
    return day


def day_span(epoch_ms: int, tz: ZoneInfo) -> tuple[date, int, int]:
    """(day, start, end): the local day ``epoch_ms`` counts in and its [start, end) in epoch ms, in
    which every time counts in the same periods (every period starts where a day does)."""
    day = local_day(epoch_ms, tz)
    end = day_start_ms(day + _ONE_DAY, tz) if day < date.max else _END_OF_CALENDAR_MS
    return day, day_start_ms(day, tz), end


def names_at(epoch_ms: int, kinds: tuple[str, ...], tz: ZoneInfo, week_start: str = "monday") -> list[str]:
    """The period names (``total`` first) that a result achieved at ``epoch_ms`` counts in."""
    day = local_day(epoch_ms, tz)
    return [name_for(kind, day, week_start) for kind in kinds]


def first_day(name: str, week_start: str = "monday") -> tuple[str, date]:
    """(kind, first local day) of a dated period name."""
    kind = _KIND_OF_PREFIX[name[0]]
    value = name[2:]
    if kind == "daily":
        return kind, date.fromisoformat(value)
    if kind == "weekly":
        year, week = value.split("-W")
        monday = date.fromisocalendar(int(year), int(week), 1)
        return kind, monday - timedelta(days=_monday_after_start(week_start))
    year, month = value.split("-")
    return kind, date(int(year), int(month), 1)


def start_ms(name: str, tz: ZoneInfo, week_start: str = "monday") -> int:
    """The epoch ms at which the dated period ``name`` starts: its first day's start (``day_start_ms``)."""
    return day_start_ms(first_day(name, week_start)[1], tz)


def end_ms(name: str, tz: ZoneInfo, week_start: str = "monday") -> int:
    """The epoch ms at which the dated period ``name`` ends: the start of the day after its last."""
    kind, start = first_day(name, week_start)
    if kind == "daily":
        nxt = start + timedelta(days=1)
    elif kind == "weekly":
        nxt = start + timedelta(days=7)
    else:
        nxt = date(start.year + start.month // 12, start.month % 12 + 1, 1)
    return day_start_ms(nxt, tz)


def closes_ms(
    name: str, tz: ZoneInfo, grace_s: int, week_start: str = "monday", retention_days: int | None = None
) -> int:
    """The epoch ms from which the dated period ``name`` takes no more results: its end plus the
    board's close grace, or plus its retention when that is shorter (its keys expire then: a
    result taken later would be answered counted and deleted at once). write.lua compares it with
    the writing router's clock."""
    after = grace_s * 1000
    if retention_days is not None:
        after = min(after, retention_days * 86_400_000)
    return end_ms(name, tz, week_start) + after


def resets_at(name: str, tz: ZoneInfo, week_start: str = "monday") -> str | None:
    """When the period ``name`` ends, as RFC 3339 with the board's UTC offset at that instant
    (``2026-12-01T00:00:00+09:00``); None for the total, which never ends. An offset of zero is
    written "Z" (``2026-12-01T00:00:00Z``), as every other time of the API (shardlb/times.py):
    the same instant as "+00:00", which a UTC board's resets_at read beside them until 2026-12-06.
    An offset with seconds (local mean time, before a zone's standard time: -00:44:30 in Monrovia
    until 1972), which RFC 3339 cannot write, is given in UTC instead."""
    if name == "total":
        return None
    at = datetime.fromtimestamp(end_ms(name, tz, week_start) / 1000, tz=tz)
    offset = at.utcoffset()
    if offset is None or offset.total_seconds() % 60:
        at = at.astimezone(UTC)
    if not at.utcoffset():
        return at.replace(tzinfo=None).isoformat() + "Z"
    return at.isoformat()


def api_name(name: str) -> str:
    """A period name (``d:2026-11-30``) as the API spells it (``daily:2026-11-30``): ``parse`` undone."""
    kind = _KIND_OF_PREFIX.get(name[:1]) if name[1:2] == ":" else None
    return f"{kind}:{name[2:]}" if kind else name


def parse(text: str, kinds: tuple[str, ...], tz: ZoneInfo, now_ms: int, week_start: str = "monday") -> str:
    """Resolve an API period (``weekly``, ``daily:2026-11-30``, ...) to a name this board keeps."""
    kind, dated, given = text.partition(":")
    if kind not in KINDS:
        raise InvalidInput(
            f"period must be one of {', '.join(KINDS)}, optionally with ':<date>'", "period", "invalid_period"
        )
    if kind not in kinds:
        raise InvalidInput(f"this board does not keep the {kind} period", "period", "invalid_period")
    if _API_NAME.fullmatch(text) is None:
        if kind == "total":
            raise InvalidInput("the total period takes no date", "period", "invalid_period")
        example = {"daily": "2026-11-30", "weekly": "2026-W48", "monthly": "2026-11"}[kind]
        raise InvalidInput(
            f"bad {kind} period {given!r}; expected e.g. {kind}:{example}", "period", "invalid_period"
        )
    if kind == "total":
        return "total"
    if not dated:
        return name_for(kind, local_day(now_ms, tz), week_start)
    name = f"{_PREFIX[kind]}:{given}"
    if given.startswith(("0001-", "9999-")):
        _check_in_calendar(name, tz, week_start)
    return name


def _check_in_calendar(name: str, tz: ZoneInfo, week_start: str) -> None:
    """Refuse (422) a period of the calendar's first or last year whose start or end falls outside
    the dates Python holds (0001-01-01 to 9999-12-31): ``daily:9999-12-31`` ends on 10000-01-01, and
    ``weekly:0001-W01`` of a week starting on Sunday begins on 0000-12-31."""
    try:
        start_ms(name, tz, week_start)
        end_ms(name, tz, week_start)
    except (OverflowError, ValueError) as e:
        raise InvalidInput(
            f"the period {api_name(name)} starts or ends outside the years 0001-9999",
            "period",
            "invalid_period",
        ) from e
