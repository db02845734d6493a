"""Reward tables (shardlb/settlement_rewards.py), no server: parsing, the first tier that covers a
rank wins, percentages round down, and the two tie rules at a boundary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardlb.errors import InvalidInput
from shardlb.settlement_rewards import TIE_RULES, Award, assign, deepest, parse, to_json

TABLE = [
    {"rank": 1, "reward": "gold"},
    {"ranks": [2, 10], "reward": "silver"},
    {"top_percent": 1, "reward": "bronze"},
]


def test_a_table_round_trips_in_its_canonical_spelling() -> None:
    assert to_json(parse(TABLE)) == TABLE
    assert to_json(parse([{"top_percent": 2.5, "reward": "x"}])) == [{"top_percent": 2.5, "reward": "x"}]
    assert to_json(parse([{"ranks": [3, 3], "reward": "x"}])) == [{"rank": 3, "reward": "x"}]


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"1": "gold"}, "rewards"),
        ([], "rewards"),
        (["gold"], "rewards[0]"),
        ([{"reward": "gold"}], "rewards[0]"),
        ([{"rank": 1, "ranks": [1, 2], "reward": "gold"}], "rewards[0]"),
        ([{"rank": 0, "reward": "gold"}], "rewards[0].rank"),
        ([{"rank": True, "reward": "gold"}], "rewards[0].rank"),
        ([{"ranks": [5, 2], "reward": "gold"}], "rewards[0].ranks"),
        ([{"ranks": [1], "reward": "gold"}], "rewards[0].ranks"),
        ([{"top_percent": 0, "reward": "gold"}], "rewards[0].top_percent"),
        ([{"top_percent": 101, "reward": "gold"}], "rewards[0].top_percent"),
        ([{"rank": 1, "reward": ""}], "rewards[0].reward"),
        ([{"rank": 1, "reward": "a b"}], "rewards[0].reward"),
        ([{"rank": 1, "reward": "gold", "extra": 1}], "rewards[0].extra"),
        ([{"rank": 1, "reward": "gold"}] * 101, "rewards"),
    ],
)
def test_a_malformed_table_is_refused_naming_the_field(table: object, field: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse(table)
    assert e.value.field == field


def test_the_first_tier_covering_a_rank_wins_and_percentages_round_down() -> None:
    points = list(range(1000, 0, -1))  # 1000 players, no ties
    got = assign(parse(TABLE), points, "cut")
    assert got[:2] == [Award(1, "gold"), Award(2, "silver")]
    assert [a.reward for a in got] == ["gold"] + ["silver"] * 9  # top 1% of 1000 is ranks 1-10, all taken
    wide = parse([*TABLE[:2], {"top_percent": 1.5, "reward": "bronze"}])
    assert [a.rank for a in assign(wide, points, "cut") if a.reward == "bronze"] == list(range(11, 16))
    assert assign(parse([{"top_percent": 1, "reward": "x"}]), [5] * 99, "cut") == []  # 0.99 players


def test_ties_at_a_boundary_cut_or_all() -> None:
    # ranks:          1   2   3   4   5   6
    points = [90, 80, 80, 80, 70, 60]
    table = parse(
        [{"rank": 1, "reward": "gold"}, {"ranks": [2, 3], "reward": "silver"}, {"rank": 4, "reward": "b"}]
    )
    assert assign(table, points, "cut") == [
        Award(1, "gold"),
        Award(2, "silver"),
        Award(3, "silver"),
        Award(4, "b"),
    ]
    # competition ranks 1, 2, 2, 2, 5, 6: the three tied at 80 are silver, and nobody is rank 4
    assert assign(table, points, "all") == [
        Award(1, "gold"),
        Award(2, "silver"),
        Award(3, "silver"),
        Award(4, "silver"),
    ]


@given(st.lists(st.integers(0, 5), max_size=40), st.integers(1, 10), st.integers(0, 10))
def test_all_pays_equal_points_alike_and_cut_pays_exactly_the_ranks(
    raw: list[int], first: int, span: int
) -> None:
    points = sorted(raw, reverse=True)
    table = parse([{"ranks": [first, first + span], "reward": "r"}])
    cut = [a.rank for a in assign(table, points, "cut")]
    assert cut == list(range(first, min(first + span, len(points)) + 1))
    every = {a.rank for a in assign(table, points, "all")}
    for rank in range(1, len(points) + 1):
        competition = 1 + sum(p > points[rank - 1] for p in points)
        assert (rank in every) == (first <= competition <= first + span)


@given(
    st.lists(st.integers(0, 5), max_size=40),
    st.integers(1, 10),
    st.integers(0, 10),
    st.sampled_from(TIE_RULES),
)
def test_the_prefix_to_the_deepest_rank_and_its_ties_pays_the_same(
    raw: list[int], first: int, span: int, rule: str
) -> None:
    points = sorted(raw, reverse=True)
    table = parse([{"ranks": [first, first + span], "reward": "r"}, {"top_percent": 50, "reward": "h"}])
    reach = min(deepest(table, len(points)), len(points))
    while 0 < reach < len(points) and points[reach] == points[reach - 1]:
        reach += 1
    assert assign(table, points[:reach], rule, len(points)) == assign(table, points, rule)
