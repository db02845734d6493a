"""Times at the API edge: RFC 3339 with an offset or epoch ms, always within years 1970-9999 UTC."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardlb import times
from shardlb.errors import InvalidInput


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1970-01-01T00:00:00Z", 0),
        ("1970-01-01T00:00:00.001Z", 1),
        ("2026-11-30T08:00:00.123+02:00", 1_796_018_400_123),
        ("2026-11-30t06:00:00.123z", 1_796_018_400_123),
        ("9999-12-31T23:59:59.999Z", times.END_MS - 1),
    ],
)
def test_rfc3339_to_epoch_ms(text: str, ms: int) -> None:
    assert times.parse(text, "t") == ms


@pytest.mark.parametrize(
    "value",
    [
        "0001-01-01T00:00:00+02:00",  # before 1970 (and before year 1 in UTC)
        "1969-12-31T23:59:59.999Z",
        "1970-01-01T00:30:00+01:00",  # 1969 in UTC
        "9999-12-31T23:00:00-02:00",  # year 10000 in UTC
        "2026-11-30T08:00:00",  # no offset
        "2026-11-30",
        "yesterday",
        # ISO 8601 forms that Python's fromisoformat takes and RFC 3339 does not:
        "20261130T050000Z",
        "2026-11-30T05:00Z",
        "2026-11-30T05Z",
        "2026-11-30 05:00:00Z",
        "2026-11-30T05:00:00,5Z",
        "2026-W48-1T05:00:00Z",
        "2026-11-30T05:00:00+0200",
        "2026-11-30T0٥:00:00Z",  # a non-ASCII digit
        "2026-02-30T05:00:00Z",  # no such day
        "2026-11-30T24:00:00Z",
        "2026-11-30T23:59:60Z",  # a leap second: RFC 3339 grammar, but no instant Python can hold
        True,
        -1,
        times.END_MS,
        1.5,
        None,
    ],
)
def test_out_of_range_or_malformed_times_are_refused(value: object) -> None:
    with pytest.raises(InvalidInput) as e:
        times.parse(value, "scores[0].achieved_at")
    assert e.value.code == "invalid_time"
    assert e.value.field == "scores[0].achieved_at"


@given(st.integers(min_value=0, max_value=times.END_MS - 1))
def test_every_accepted_time_formats_and_parses_back(ms: int) -> None:
    text = times.format_ms(ms)
    assert times.parse(text, "t") == ms
    assert times.parse(ms, "t") == ms


@given(
    st.one_of(
        st.integers(min_value=0, max_value=times.END_MS - 1),
        st.sampled_from([0, 999, 1000, times.END_MS - 1]),
    )
)
def test_formatting_matches_datetimes_rfc3339(ms: int) -> None:
    """format_ms takes a quicker way than datetime; the text is the same to the millisecond."""
    moment = datetime.fromtimestamp(ms // 1000, tz=UTC)
    fraction = f".{ms % 1000:03d}" if ms % 1000 else ""
    assert times.format_ms(ms) == moment.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"


@given(
    st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9998, 1, 1)),
    st.integers(min_value=-14 * 4, max_value=14 * 4),
)
def test_offsets_name_the_same_instant(moment: datetime, quarters: int) -> None:
    moment = moment.replace(microsecond=moment.microsecond // 1000 * 1000, tzinfo=UTC)
    shifted = moment.astimezone(timezone(timedelta(minutes=15 * quarters)))
    expected = (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    assert times.parse(shifted.isoformat(), "t") == expected
