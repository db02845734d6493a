"""Board settings from API bodies (server-free): defaults, round trip, and clear errors."""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from shardlb.config import AUTO_SHARDS, ID_PATTERN, MAX_BANDS, BoardConfig, all_ids
from shardlb.errors import InvalidInput
from shardlb.sharding import Layout


def test_defaults() -> None:
    c = BoardConfig.from_dict("b", {})
    assert (c.mode, c.order, c.tiebreak, c.periods, c.points_max) == (
        "best",
        "desc",
        "earliest",
        ("total",),
        2_097_151,
    )
    assert c.sharding.strategy == "hash" and c.sharding.shards == 16
    assert c.rank_mode == "unique"


def test_round_trip_through_to_dict_is_the_same_board() -> None:
    body = {
        "mode": "incr",
        "order": "asc",
        "tiebreak": "latest",
        "periods": ["monthly", "daily"],
        "timezone": "Europe/Paris",
        "retention_days": {"daily": 7},
        "points_max": 100_000,
        "epoch": "2026-09-01T00:00:00Z",
        "sharding": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 3},
        "rank_mode": "competition",
    }
    c = BoardConfig.from_dict("season-1", body)
    assert c.periods == ("total", "daily", "monthly")
    assert BoardConfig.from_dict("season-1", c.to_dict()) == c
    assert c.to_dict()["epoch"] == "2026-09-01T00:00:00Z"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"mode": "max"}, "mode"),
        ({"periods": ["yearly"]}, "periods"),
        ({"timezone": "Nowhere/City"}, "timezone"),
        ({"points_max": 0}, "points_max"),
        ({"epoch": "yesterday"}, "epoch"),
        ({"sharding": {"strategy": "hash", "shards": 0}}, "sharding.shards"),
        ({"sharding": {"strategy": "region", "regions": []}}, "sharding.regions"),
        ({"sharding": {"strategy": "band", "bands": [5, 10]}}, "sharding.bands"),
        ({"sharding": {"strategy": "band", "bands": [0, 10, 10]}}, "sharding.bands"),
        ({"sharding": {"strategy": "band", "bands": [0, 10**7]}}, "sharding.bands"),
        ({"sharding": {"strategy": "moon"}}, "sharding.strategy"),
        ({"colour": "red"}, "colour"),
        ({"rank_mode": "dense"}, "rank_mode"),
    ],
)
def test_bad_settings_name_their_field(body: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        BoardConfig.from_dict("b", body)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("sharding", "field", "says"),
    [
        # No "strategy" (api.md's name for it): hash is taken, and its settings were listed as if
        # the client had asked for hash ("'kind' is not a setting of hash sharding").
        ({"kind": "band", "shards": 1}, "sharding.kind", ['"strategy": "band"', "hash", "strategy, shards"]),
        ({"strategy": "band", "shards": 1}, "sharding.bands", ["needs sharding.bands", "[0, 1000, 10000]"]),
        ({"strategy": "band", "bands": [0, 1000], "shards": 1023}, "sharding.shards", ["1 to 1022", "1024"]),
        ({"strategy": "hash", "bands": [0, 10]}, "sharding.bands", ["of hash", "strategy, shards"]),
    ],
)
def test_a_refused_sharding_says_what_is_allowed_and_why(
    sharding: dict[str, object], field: str, says: list[str]
) -> None:
    """A band board asked for in the wrong shape is 422 ``invalid_input`` naming the field, and the
    message says what the API takes there (a reviewer's PUT of ``{"kind": "band", "shards": 1}``
    was told about hash sharding, which it had not named)."""
    with pytest.raises(InvalidInput) as err:
        BoardConfig.from_dict("b", {"sharding": sharding}, default_shards=AUTO_SHARDS)
    assert (err.value.code, err.value.field) == ("invalid_input", field)
    for part in says:
        assert part in err.value.message, err.value.message


@pytest.mark.parametrize("board_id", ["", "a" * 65, "has space", "semi;colon", "{brace}"])
def test_bad_board_ids(board_id: str) -> None:
    with pytest.raises(InvalidInput):
        BoardConfig.from_dict(board_id, {})


def test_band_layout_places_by_points_and_reads_best_band_first() -> None:
    c = BoardConfig.from_dict("b", {"sharding": {"strategy": "band", "bands": [0, 100, 1000], "shards": 4}})
    layout = Layout(c.sharding, c.order)
    assert layout.physical == 7
    assert [layout.band_shard(p) for p in (0, 99, 100, 999, 1000, 10**6)] == [4, 4, 5, 5, 6, 6]
    assert layout.view(total=True) == [6, 5, 4]
    assert layout.view(total=False) == [0, 1, 2, 3]
    assert Layout(c.sharding, "asc").view(total=True) == [4, 5, 6]


def test_region_layout() -> None:
    c = BoardConfig.from_dict(
        "b", {"sharding": {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 3}}
    )
    layout = Layout(c.sharding)
    assert layout.view(True, "na") == [3, 4, 5]
    assert layout.home("p1", "na") in (3, 4, 5)
    assert layout.candidates("p1") == [layout.home("p1", "eu"), layout.home("p1", "na")]
    with pytest.raises(InvalidInput):
        layout.home("p1", "mars")


def test_settings_lists_every_field_in_to_dict_order() -> None:
    from shardlb.config import SETTINGS

    assert tuple(BoardConfig.from_dict("b", {}).to_dict()) == SETTINGS


def test_too_many_band_starts_are_refused_saying_how_many_are_allowed() -> None:
    """More than MAX_BANDS increasing starts were refused as if they did not increase from 0."""
    bands = list(range(0, 1000 * (MAX_BANDS + 1), 1000))
    with pytest.raises(InvalidInput, match=f"at most {MAX_BANDS} bands") as refused:
        BoardConfig.from_dict("b", {"sharding": {"strategy": "band", "bands": bands}})
    assert refused.value.field == "sharding.bands"


_ID_CHARS = string.ascii_letters + string.digits + "_-.:"


@given(
    st.lists(
        st.one_of(
            st.text(_ID_CHARS, max_size=66),
            st.text(_ID_CHARS + "\n \x00é/", max_size=66),
            st.integers(),
            st.none(),
        ),
        max_size=8,
    )
)
@example([])
@example(["a\nb"])  # two ids' characters on two lines, one value: not an id
@example(["a", "b\n"])
@example(["a", ""])
@example(["x" * 64, "y"])
@example(["x" * 65])
@example(["\n"])
def test_all_ids_is_the_id_pattern_on_each(values: list[Any]) -> None:
    """One match over every value, one a line (Board.prepare's check of a write's player ids),
    answers as the id pattern on each value would."""
    expected = all(isinstance(v, str) and ID_PATTERN.fullmatch(v) is not None for v in values)
    assert all_ids(values) is expected
