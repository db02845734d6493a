"""Local days in a time zone the plain way, by brute force with zoneinfo: the reference that
shardlb/periods.py's day starts and the board's cached period names are checked against.

The rule it states (docs/design-notes.md, "Period boundaries"): a day starts at the first instant
whose local date is that day or later, and a time counts in the last day that has started by then.
So days are contiguous and cover every instant once, even where the clock skips midnight (the day
starts when the clock jumps) or turns back across it (the repeated hour after midnight counts in the
new day, which had already started).
"""

from __future__ import annotations

import functools
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

# Zones and years (UTC) where local days are odd: offsets that are not whole quarter hours
# (local mean time, Monrovia's -0:44:30 until 1972, Kiritimati's -10:40 until 1979), the clock
# skipping midnight (Santiago, Havana, Beirut), turning back across it (St John's and Goose Bay
# at 00:01 until 2011, Casey in 2010), and whole days skipped (Apia in 2011, Kiritimati in 1994).
ODD_ERAS: tuple[tuple[str, int, int], ...] = (
    ("Africa/Monrovia", 1969, 1973),
    ("Pacific/Kiritimati", 1975, 1996),
    ("Europe/Amsterdam", 1930, 1946),
    ("Asia/Kolkata", 1938, 1946),
    ("Europe/Paris", 1890, 1912),
    ("America/New_York", 1880, 1886),
    ("Asia/Kathmandu", 1983, 1988),
    ("America/Santiago", 2010, 2030),
    ("America/Havana", 2008, 2030),
    ("Asia/Beirut", 2008, 2030),
    ("America/St_Johns", 1986, 2012),
    ("America/Goose_Bay", 1986, 2012),
    ("Antarctica/Casey", 2009, 2012),
    ("Pacific/Apia", 2010, 2013),
    ("Australia/Lord_Howe", 2010, 2030),
)
# The same, for times a board can hold (from 1970 on: a board's epoch is no earlier).
BOARD_ERAS: tuple[tuple[str, int, int], ...] = tuple(
    (zone, max(first, 1970), last) for zone, first, last in ODD_ERAS if last > 1970
)


def _local_date(s: int, tz: ZoneInfo) -> date:
    return datetime.fromtimestamp(s, tz).date()


def first_instant_ms(day: date, tz: ZoneInfo) -> int:
    """The first instant (epoch ms) whose local date is ``day`` or later: every minute from more
    than a day before, then every second of the minute found (tzdata's offsets and transitions are
    whole seconds)."""
    s = int(datetime(day.year, day.month, day.day, tzinfo=UTC).timestamp()) - 26 * 3600
    assert _local_date(s, tz) < day
    while _local_date(s + 60, tz) < day:
        s += 60
    while _local_date(s + 1, tz) < day:
        s += 1
    return (s + 1) * 1000


def day_of(epoch_ms: int, tz: ZoneInfo) -> date:
    """The day a time counts in: the last whose first instant is at or before it."""
    day = datetime.fromtimestamp(epoch_ms // 1000, tz).date()
    while first_instant_ms(day + timedelta(days=1), tz) <= epoch_ms:
        day += timedelta(days=1)
    return day


@functools.cache
def turn_days(zone: str, first: int, last: int) -> tuple[date, ...]:
    """The days of years ``first`` to ``last`` whose UTC noon has another offset than the day
    before's: the zone changed its offset in between, where a random day would rarely fall."""
    tz, out = ZoneInfo(zone), []
    day, before = date(first, 1, 1), None
    while day.year <= last:
        offset = datetime(day.year, day.month, day.day, 12, tzinfo=UTC).astimezone(tz).utcoffset()
        if before is not None and offset != before:
            out.append(day)
        day, before = day + timedelta(days=1), offset
    return tuple(out)
