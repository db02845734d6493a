"""Period names: which daily, ISO-weekly and monthly board a result counts in, and when those end.

A result counts in the periods of its *achieved* time in the board's timezone, never its arrival time,
so a replay lands on the same keys. Names are the key suffixes: ``total``, ``d:2026-11-30``,
``w:2026-W48``, ``m:2026-11``.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from shardlb.errors import InvalidInput

KINDS = ("total", "daily", "weekly", "monthly")
DATED = ("daily", "weekly", "monthly")
_PREFIX = {"daily": "d", "weekly": "w", "monthly": "m"}
_KIND_OF_PREFIX = {v: k for k, v in _PREFIX.items()}
_PATTERNS = {
    "daily": re.compile(r"^(\d{4})-(\d{2})-(\d{2})$"),
    "weekly": re.compile(r"^(\d{4})-W(\d{2})$"),
    "monthly": re.compile(r"^(\d{4})-(\d{2})$"),
}


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as e:
        raise InvalidInput(f"unknown timezone {name!r}", "timezone") from e


def name_for(kind: str, day: date) -> str:
    """The period name of ``kind`` containing the local calendar day ``day``."""
    if kind == "total":
        return "total"
    if kind == "daily":
        return f"d:{day.isoformat()}"
    if kind == "weekly":
        year, week, _ = day.isocalendar()
        return f"w:{year}-W{week:02d}"
    if kind == "monthly":
        return f"m:{day.year}-{day.month:02d}"
    raise InvalidInput(f"unknown period kind {kind!r}", "period")


def local_day(epoch_ms: int, tz: ZoneInfo) -> date:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).astimezone(tz).date()


def names_at(epoch_ms: int, kinds: tuple[str, ...], tz: ZoneInfo) -> list[str]:
    """The period names (``total`` first) that a result achieved at ``epoch_ms`` counts in."""
    day = local_day(epoch_ms, tz)
    return [name_for(kind, day) for kind in kinds]


def first_day(name: str) -> tuple[str, date]:
    """(kind, first local day) of a dated period name."""
    kind = _KIND_OF_PREFIX[name[0]]
    value = name[2:]
    if kind == "daily":
        return kind, date.fromisoformat(value)
    if kind == "weekly":
        year, week = value.split("-W")
        return kind, date.fromisocalendar(int(year), int(week), 1)
    year, month = value.split("-")
    return kind, date(int(year), int(month), 1)


def end_ms(name: str, tz: ZoneInfo) -> int:
    """The epoch ms at which the dated period ``name`` ends (local midnight after its last day)."""
    kind, start = first_day(name)
    if kind == "daily":
        nxt = start + timedelta(days=1)
    elif kind == "weekly":
        nxt = start + timedelta(days=7)
    else:
        nxt = date(start.year + start.month // 12, start.month % 12 + 1, 1)
    return int(datetime(nxt.year, nxt.month, nxt.day, tzinfo=tz).timestamp() * 1000)


def parse(text: str, kinds: tuple[str, ...], tz: ZoneInfo, now_ms: int) -> str:
    """Resolve an API period (``weekly``, ``daily:2026-11-30``, ...) to a name this board keeps."""
    kind, _, given = text.partition(":")
    if kind not in KINDS:
        raise InvalidInput(
            f"period must be one of {', '.join(KINDS)}, optionally with ':<date>'", "period", "invalid_period"
        )
    if kind not in kinds:
        raise InvalidInput(f"this board does not keep the {kind} period", "period", "invalid_period")
    if kind == "total":
        if given:
            raise InvalidInput("the total period takes no date", "period", "invalid_period")
        return "total"
    if not given:
        return name_for(kind, local_day(now_ms, tz))
    match = _PATTERNS[kind].fullmatch(given)
    try:
        if match is None:
            raise ValueError(given)
        name = f"{_PREFIX[kind]}:{given}"
        first_day(name)
    except ValueError as e:
        example = {"daily": "2026-11-30", "weekly": "2026-W48", "monthly": "2026-11"}[kind]
        raise InvalidInput(
            f"bad {kind} period {given!r}; expected e.g. {kind}:{example}", "period", "invalid_period"
        ) from e
    return name
