"""Time values at the API edge: RFC 3339 strings with an offset, or integer epoch milliseconds."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta

from shardlb.errors import InvalidInput

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_MS = timedelta(milliseconds=1)
END_MS = 253_402_300_800_000  # 10000-01-01T00:00:00Z: every time is within years 1970-9999 UTC
# RFC 3339's date-time with years 1970-9999 and ASCII digits only, and no leap second (no instant
# Python can hold). Python's fromisoformat alone takes much more (basic format, ISO week dates,
# "05:00Z"); the OpenAPI document carries this pattern, so a client knows what will be taken.
# A day that is not in the calendar (30 February) still fails to parse, and so does a time whose
# offset moves it out of 1970-9999 in UTC: the document's "format": "date-time" and the range say so.
RFC3339_PATTERN = (
    r"^(19[7-9][0-9]|[2-9][0-9]{3})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt]"
    r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"
)
_RFC3339 = re.compile(RFC3339_PATTERN)
_MIN_S, _MAX_S = 0, END_MS // 1000 - 1  # the seconds time.gmtime formats as format_ms does


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def parse(value: object, field: str) -> int:
    """Epoch milliseconds from an RFC 3339 string with an offset or an integer of epoch ms."""
    if isinstance(value, bool):
        raise InvalidInput(
            "a time is an RFC 3339 string or integer epoch milliseconds", field, "invalid_time"
        )
    if isinstance(value, int):
        if not 0 <= value < END_MS:
            raise InvalidInput("epoch milliseconds out of range", field, "invalid_time")
        return value
    if isinstance(value, str) and "T" in value.upper():
        if _RFC3339.fullmatch(value) is None:
            raise InvalidInput(
                f"{value!r} is not an RFC 3339 time with an offset, within years 1970 to 9999",
                field,
                "invalid_time",
            )
        try:
            parsed = datetime.fromisoformat(value.upper())
        except ValueError as e:
            raise InvalidInput(f"{value!r} is not a time of the calendar", field, "invalid_time") from e
        # Exact integer arithmetic: float seconds would round some milliseconds down by one.
        ms = (parsed - EPOCH) // ONE_MS
        if not 0 <= ms < END_MS:
            raise InvalidInput("a time must fall in the years 1970 to 9999 (UTC)", field, "invalid_time")
        return ms
    raise InvalidInput("a time is an RFC 3339 string or integer epoch milliseconds", field, "invalid_time")


_DAYS: dict[int, str] = {}  # day number since the epoch -> "YYYY-MM-DDT", for format_ms
_DAYS_KEPT = 4096
_TWO = [f"{n:02d}" for n in range(60)]
_MINUTES = [f"{h:02d}:{m:02d}:" for h in range(24) for m in range(60)]  # minute of the day -> "HH:MM:"


def format_ms(epoch_ms: int) -> str:
    """RFC 3339 in UTC, with milliseconds only when they are not zero."""
    seconds, ms = divmod(int(epoch_ms), 1000)
    if _MIN_S <= seconds <= _MAX_S:
        # Every entry of every read is formatted, and most of a board's times fall on a few days:
        # the date comes from a cache of days, the time of day from tables of minutes and seconds
        # (under half of time.strftime's cost, itself a third of datetime's).
        day, clock = divmod(seconds, 86_400)
        date = _DAYS.get(day)
        if date is None:
            if len(_DAYS) >= _DAYS_KEPT:
                _DAYS.clear()
            date = _DAYS[day] = time.strftime("%Y-%m-%dT", time.gmtime(day * 86_400))
        minute, secs = divmod(clock, 60)
        if ms:
            return f"{date}{_MINUTES[minute]}{_TWO[secs]}.{ms:03d}Z"
        return f"{date}{_MINUTES[minute]}{_TWO[secs]}Z"
    moment = datetime.fromtimestamp(epoch_ms / 1000, tz=UTC)  # out of gmtime's range: as before
    if epoch_ms % 1000:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{epoch_ms % 1000:03d}Z"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
