"""The score codec, tested first and hardest: order, ties, boundaries and the round trip through a double."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardlb.codec import ScoreCodec
from shardlb.errors import OutOfRange

EPOCH = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SECOND = 1000


def codec(**kw: object) -> ScoreCodec:
    return ScoreCodec(epoch_ms=EPOCH, **kw)  # type: ignore[arg-type]


def test_higher_score_ranks_above_lower_whatever_the_times() -> None:
    c = codec()
    late_high = c.encode(1001, c.last_ms)
    early_low = c.encode(1000, EPOCH)
    assert late_high > early_low


def test_equal_points_earlier_achiever_ranks_above() -> None:
    c = codec()
    assert c.encode(1000, EPOCH + 5 * SECOND) > c.encode(1000, EPOCH + 6 * SECOND)
    latest = codec(tiebreak="latest")
    assert latest.encode(1000, EPOCH + 6 * SECOND) > latest.encode(1000, EPOCH + 5 * SECOND)


def test_largest_points_decode_exactly_after_float_round_trip() -> None:
    c = codec()
    for when in (EPOCH, c.last_ms):
        score = c.encode(c.points_max, when)
        assert score < 2**53
        as_double = float(score)
        assert int(as_double) == score
        assert c.decode(as_double) == (c.points_max, when - (when - EPOCH) % SECOND)


def test_every_score_is_below_2_53_and_round_trips() -> None:
    rng = random.Random(7)
    for order in ("desc", "asc"):
        for tiebreak in ("earliest", "latest"):
            for resolution, points_max in (("s", 2_097_151), ("ms", 1000), ("s", 1)):
                c = codec(order=order, tiebreak=tiebreak, resolution=resolution, points_max=points_max)
                for _ in range(300):
                    points = rng.randint(0, c.points_max)
                    units = rng.randint(0, c.time_max)
                    score = c.encode_units(points, units)
                    assert 0 <= score < 2**53
                    assert c.decode_units(float(score)) == (points, units)


def test_order_matches_the_board_rules() -> None:
    rng = random.Random(11)
    for order in ("desc", "asc"):
        for tiebreak in ("earliest", "latest"):
            c = codec(order=order, tiebreak=tiebreak, points_max=5000)
            results = [(rng.randint(0, 5000), rng.randint(0, 10**6)) for _ in range(500)]

            def better(a: tuple[int, int], b: tuple[int, int]) -> bool:
                if a[0] != b[0]:
                    return a[0] > b[0] if order == "desc" else a[0] < b[0]  # noqa: B023
                return a[1] < b[1] if tiebreak == "earliest" else a[1] > b[1]  # noqa: B023

            for a, b in itertools.pairwise(results):
                sa, sb = c.encode_units(*a), c.encode_units(*b)
                if a == b:
                    assert sa == sb
                else:
                    assert (sa > sb) == better(a, b)


def test_ascending_board_lower_points_rank_above() -> None:
    c = codec(order="asc")
    assert c.encode(10, EPOCH + 99 * SECOND) > c.encode(11, EPOCH)


@pytest.mark.parametrize("points", [0, 2_097_151])
def test_points_boundaries_accepted(points: int) -> None:
    c = codec()
    assert c.decode(c.encode(points, EPOCH))[0] == points


@pytest.mark.parametrize("points", [2_097_152, -1, 1.5, True, "7"])
def test_points_out_of_range_rejected(points: object) -> None:
    with pytest.raises(OutOfRange) as err:
        codec().encode(points, EPOCH)  # type: ignore[arg-type]
    assert err.value.field == "points"


def test_time_before_epoch_rejected() -> None:
    with pytest.raises(OutOfRange, match="before the board's epoch"):
        codec().encode(1, EPOCH - 1)


def test_time_at_both_ends_of_the_range() -> None:
    c = codec()
    assert c.decode(c.encode(1, EPOCH))[1] == EPOCH
    assert c.decode(c.encode(1, c.last_ms))[1] == c.last_ms - (c.last_ms - EPOCH) % SECOND
    with pytest.raises(OutOfRange, match="past the last time"):
        c.encode(1, c.last_ms + 1)


def test_default_layout_is_21_bits_of_points_and_32_of_seconds() -> None:
    c = codec()
    assert (c.points_bits, c.time_bits) == (21, 32)
    assert c.time_max == 2**32 - 1


@pytest.mark.parametrize(
    "settings",
    [
        {"points_max": 0},
        {"points_max": 2**53},
        {"points_max": 2**45, "resolution": "ms"},
        {"order": "up"},
        {"tiebreak": "first"},
        {"resolution": "m"},
    ],
)
def test_bad_settings_rejected(settings: dict[str, object]) -> None:
    with pytest.raises(OutOfRange):
        codec(**settings)


def test_decode_refuses_foreign_values() -> None:
    c = codec()
    for bad in (-1, 2**53, 1.5):
        with pytest.raises(OutOfRange):
            c.decode(bad)


@given(
    st.sampled_from(["desc", "asc"]),
    st.sampled_from(["earliest", "latest"]),
    st.sampled_from([1, 1000, 2_097_151, 2**30]),
    st.data(),
)
def test_scores_of_one_points_value_are_one_range_below_every_better_value(
    order: str, tiebreak: str, points_max: int, data: st.DataObject
) -> None:
    c = codec(order=order, tiebreak=tiebreak, points_max=points_max)
    points = data.draw(st.integers(0, points_max))
    other = data.draw(st.integers(0, points_max))
    units = data.draw(st.integers(0, c.time_max))
    span = c.scores_of(points)
    assert c.encode_units(points, units) in span
    assert span.stop <= 2**53  # the first better score is a double too: ZCOUNT takes it exactly
    other_score = c.encode_units(other, data.draw(st.integers(0, c.time_max)))
    better = other > points if order == "desc" else other < points
    assert (other_score >= span.stop) == better
    assert (other_score in span) == (other == points)


@pytest.mark.parametrize(("resolution", "largest"), [("s", 2**31 - 1), ("ms", 2**21 - 1)])
def test_points_max_one_past_the_largest_is_refused_with_advice_that_applies(
    resolution: str, largest: int
) -> None:
    """The largest points_max leaves at least 30 days of time; one more is refused, and the message
    says what would help: at resolution "s" there is no coarser resolution to move to."""
    assert codec(points_max=largest, resolution=resolution).time_max * {"s": 1000, "ms": 1}[resolution] >= (
        30 * 86_400_000
    )
    with pytest.raises(OutOfRange) as refused:
        codec(points_max=largest + 1, resolution=resolution)
    assert refused.value.field == "points_max"
    message = str(refused.value)
    assert f"at most {largest}" in message
    assert ("use resolution 's'" in message) == (resolution == "ms")
