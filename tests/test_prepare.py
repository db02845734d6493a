"""Board.prepare packs each score as the codec and the layout say, whatever the board's order,
tiebreak and sharding: its loop inlines ScoreCodec.encode_units and Layout.home for speed, and keeps
one local day's period names while its scores stay in that day (exact in any zone: the tests at the
end compare them with tests/zone_reference.py)."""

from __future__ import annotations

import functools
from datetime import date, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardlb import periods
from shardlb.board import QUARTER_HOUR_MS, Board, Score, rounds
from shardlb.config import BoardConfig
from shardlb.errors import InvalidInput
from shardlb.journal import Applied
from shardlb.rebuild import Fold
from tests import zone_reference

EPOCH_MS = 1_780_000_000_000
NOW_MS = EPOCH_MS + 40 * 86_400_000

SHARDINGS: list[dict[str, Any]] = [
    {"strategy": "hash", "shards": 1},
    {"strategy": "hash", "shards": 16},
    {"strategy": "band", "bands": [0, 100, 1000], "shards": 3},
]


def board(order: str, tiebreak: str, sharding: dict[str, Any]) -> Board:
    config = BoardConfig.from_dict(
        "b",
        {
            "order": order,
            "tiebreak": tiebreak,
            "periods": ["total", "daily", "weekly"],
            "epoch": "2026-05-28T20:26:40Z",
            "sharding": sharding,
        },
    )
    return Board(None, config, None)  # type: ignore[arg-type]  # prepare touches no client


scores = st.lists(
    st.builds(
        Score,
        player_id=st.from_regex(r"[A-Za-z0-9_.:-]{1,12}", fullmatch=True),
        points=st.integers(0, 2_097_151),
        match_id=st.text("abcdef0123456789", min_size=1, max_size=40),
        # None: the server's time; else a time up to 3 days back, across quarter hours and days.
        achieved_ms=st.one_of(st.none(), st.integers(NOW_MS - 3 * 86_400_000, NOW_MS)),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize("order", ["desc", "asc"])
@pytest.mark.parametrize("tiebreak", ["earliest", "latest"])
@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: f"{s['strategy']}{s['shards']}")
@settings(max_examples=60, deadline=None)
@given(batch=scores)
def test_prepare_packs_as_the_codec_and_places_as_the_layout(
    order: str, tiebreak: str, sharding: dict[str, Any], batch: list[Score]
) -> None:
    b = board(order, tiebreak, sharding)
    codec = b.codec
    prepared = b.prepare(batch, NOW_MS)
    assert len(prepared) == len(batch)
    for s, p in zip(batch, prepared, strict=True):
        achieved = NOW_MS if s.achieved_ms is None else s.achieved_ms
        units = codec.time_units(achieved)
        assert (p.player_id, p.match_id, p.points, p.units) == (s.player_id, s.match_id, s.points, units)
        assert p.score == codec.encode_units(s.points, units) == codec.encode(s.points, achieved)
        assert p.shard == b.layout.home(s.player_id)
        kept = codec.units_to_ms(units)
        assert p.periods == tuple(periods.names_at(kept, b.config.periods, b.tz, b.config.week_start))
        assert p.server_time is (s.achieved_ms is None)


# ---- the periods of a result, in zones whose days do not start on a quarter hour ----------------


@functools.cache
def zone_board(zone: str) -> Board:
    kinds = ["total", "daily", "weekly", "monthly"]
    config = BoardConfig.from_dict("z", {"periods": kinds, "timezone": zone, "epoch": "1970-01-01T00:00:00Z"})
    return Board(None, config, None)  # type: ignore[arg-type]  # prepare touches no client


def reference_names(b: Board, at_ms: int) -> tuple[str, ...]:
    day = zone_reference.day_of(at_ms, b.tz)
    return tuple(periods.name_for(kind, day, b.config.week_start) for kind in b.config.periods)


@st.composite
def odd_times(draw: st.DrawFn) -> tuple[Board, int]:
    """A board in a zone of zone_reference.BOARD_ERAS and a whole second within 3 hours of one of
    its local midnights, half of them within a day of a change of its offset."""
    zone, first, last = draw(st.sampled_from(zone_reference.BOARD_ERAS))
    turns = zone_reference.turn_days(zone, first, last)
    if turns and draw(st.booleans()):
        day = draw(st.sampled_from(turns)) + timedelta(days=draw(st.integers(-1, 1)))
    else:
        day = draw(st.dates(min_value=date(first, 1, 1), max_value=date(last, 12, 31)))
    b = zone_board(zone)
    midnight = zone_reference.first_instant_ms(day, b.tz)
    return b, midnight + 1000 * draw(st.integers(-3 * 3600, 3 * 3600))


@settings(max_examples=200, deadline=None)
@given(board_at=odd_times())
def test_a_result_is_filed_in_the_periods_of_its_local_day_in_any_zone(board_at: tuple[Board, int]) -> None:
    """The write path keeps period names per quarter hour, and a rebuild's Fold did the same, on the
    grounds that local days start on a quarter hour. They did not in Monrovia until 1972 (-0:44:30)
    or Kiritimati until 1979 (-10:40): a result in a day's first minutes was filed in the day before.
    Each path must give the reference's names for the time kept, on both sides of every midnight."""
    b, at = board_at
    expected = reference_names(b, at)
    p = b.prepare([Score("p", 1, "m", at)], at)[0]
    assert p.periods == expected
    assert b.at_units(p, p.units).periods == expected
    assert Fold(b, lambda name: True).names(Applied("m", "p", 1, p.units)) == expected
    assert periods.names_at(at, b.config.periods, b.tz, b.config.week_start) == list(expected)


@settings(max_examples=100, deadline=None)
@given(board_at=odd_times())
def test_the_same_periods_window_is_exact_in_any_zone(board_at: tuple[Board, int]) -> None:
    """write.lua applies a pinned retry at once when its pinned time is in the window the board
    sends (``_same_period_units``): every unit of it must go to the periods of now, and the window
    reaches the units just outside it that do not (or a day from now, where it stops)."""
    b, now = board_at
    lo, hi = b._same_period_units(now)
    names = reference_names(b, now)
    assert lo * 1000 <= now <= hi * 1000
    assert reference_names(b, lo * 1000) == names == reference_names(b, hi * 1000)
    assert reference_names(b, lo * 1000 - 1000) != names or now - lo * 1000 >= 86_400_000 - QUARTER_HOUR_MS
    assert reference_names(b, hi * 1000 + 1000) != names or hi * 1000 - now >= 86_400_000 - QUARTER_HOUR_MS


def test_rounds_send_each_players_regions_in_the_order_a_request_names_them() -> None:
    """``rounds``: round k holds each player's results naming the k-th region the request names
    for them; a request naming one region per player (or a board without regions) is one round."""
    regional = board(
        "desc", "earliest", {"strategy": "region", "regions": ["eu", "na", "as"], "shards_per_region": 4}
    )
    names = [("p1", "na"), ("p2", "eu"), ("p1", "eu"), ("p1", "na"), ("p2", "eu"), ("p1", "as"), ("p3", "as")]
    prepared = regional.prepare([Score(p, 1, f"m{i}", None, r) for i, (p, r) in enumerate(names)], NOW_MS)
    assert rounds(regional.config.sharding, prepared) == [[0, 1, 3, 4, 6], [2], [5]]
    one_each = [p for p in prepared if p.player_id != "p1"]
    assert rounds(regional.config.sharding, one_each) is None
    hashed = board("desc", "earliest", {"strategy": "hash", "shards": 4})
    assert (
        rounds(hashed.config.sharding, hashed.prepare([Score("p1", 1, "m"), Score("p1", 2, "n")], NOW_MS))
        is None
    )


@pytest.mark.parametrize("bad", ["a\nb", "", "x" * 65, "é", 7])
def test_a_player_id_that_is_no_id_is_refused_by_its_place(bad: Any) -> None:
    """The player ids of a request are checked at once (shardlb/config.py, ``all_ids``); one that is
    not an id among others that are is still refused by its own field, nothing prepared."""
    scores = [Score("p1", 5, "m1"), Score(bad, 5, "m1"), Score("p3", 5, "m1")]
    with pytest.raises(InvalidInput) as refused:
        board("desc", "earliest", SHARDINGS[1]).prepare(scores, NOW_MS)
    assert (refused.value.field, refused.value.code) == ("scores[1].player_id", "invalid_id")
