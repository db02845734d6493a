"""The simulated workload and the load shapes: pure, no server."""

from __future__ import annotations

import random

import pytest

from bench import shapes
from bench.workload import Points, Workload, parse_mix, top_share


def test_skew_puts_the_expected_share_on_the_most_active_players() -> None:
    w = Workload(players=10_000, skew=2.0)
    rng = random.Random(1)
    draws = [int(w.player(rng)[1:]) for _ in range(50_000)]
    share = sum(1 for d in draws if d < 1_000) / len(draws)
    assert share == pytest.approx(top_share(2.0, 0.1), abs=0.01)
    assert all(0 <= d < 10_000 for d in draws)


def test_initial_points_are_the_same_everywhere_and_follow_the_distribution() -> None:
    w = Workload(points=Points("uniform", 100, 200))
    values = [w.initial_points(i) for i in range(5_000)]
    assert values == [Workload(points=Points("uniform", 100, 200)).initial_points(i) for i in range(5_000)]
    assert min(values) >= 100 and max(values) < 200
    assert 140 < sum(values) / len(values) < 160
    assert all(0 <= w.initial_age_s(i) < 30 * 86_400 for i in range(100))


def test_points_never_leave_the_codec_range() -> None:
    assert Points("normal", 0, 1e9).at(0.001) == 0
    assert Points("lognormal", 30, 5).at(0.999) == 2_097_151


def test_a_match_has_distinct_players_and_a_unique_id() -> None:
    w = Workload(players=50, players_per_match=10, skew=4.0)
    rng = random.Random(2)
    matches = [w.match(rng) for _ in range(200)]
    assert len({m for m, _ in matches}) == 200
    assert all(len({p for p, _ in players}) == 10 for _, players in matches)


def test_env_settings_and_their_errors() -> None:
    w = Workload.from_env(
        {
            "SHARDLB_PLAYERS": "1000",
            "SHARDLB_MATCH_PLAYERS": "4",
            "SHARDLB_FRIENDS": "5-9",
            "SHARDLB_READ_MIX": "top:1,rank:3",
            "SHARDLB_POINTS": "normal:10,2",
        }
    )
    assert (w.players, w.players_per_match, w.friends_min, w.friends_max) == (1000, 4, 5, 9)
    assert dict(w.read_mix) == {"top": 1, "rank": 3}
    assert 5 <= len(w.friends(random.Random(3))) <= 9
    with pytest.raises(ValueError, match="SHARDLB_SKEW"):
        Workload.from_env({"SHARDLB_SKEW": "0.5"})
    with pytest.raises(ValueError, match="SHARDLB_READ_MIX"):
        parse_mix("top:1,sideways:2")
    with pytest.raises(ValueError, match="SHARDLB_POINTS"):
        Points.parse("zipf:1")


def test_ramp_steps_up_to_the_target() -> None:
    stages = shapes.schedule("ramp", 60_000, 60, user_rps=10, scores_per_request=10, steps=6)
    assert [s.until for s in stages] == [10, 20, 30, 40, 50, 60]
    assert [s.offered for s in stages] == [10_000, 20_000, 30_000, 40_000, 50_000, 60_000]
    assert shapes.at(stages, 0).users == 100
    assert shapes.at(stages, 59.9).users == 600
    assert shapes.at(stages, 60) is None


def test_the_shapes_target_counts_fresh_scores_not_replays() -> None:
    # Half the posts replay an earlier one (SHARDLB_RETRY_SHARE 0.5): twice the users post 1,000
    # fresh scores a second, which is what the stage offers.
    (stage,) = shapes.schedule("ramp", 1000, 10, user_rps=10, scores_per_request=10, steps=1, fresh_share=0.5)
    assert (stage.users, stage.offered) == (20, 1000)
    with pytest.raises(ValueError, match="SHARDLB_RETRY_SHARE"):
        shapes.schedule("ramp", 1000, 10, user_rps=10, scores_per_request=10, fresh_share=0.0)


def test_spike_is_ten_times_the_base_for_thirty_seconds() -> None:
    stages = shapes.schedule("spike", 20_000, 90, user_rps=10, scores_per_request=10)
    base, spike, after = stages
    assert (base.until, spike.until, after.until) == (30, 60, 90)
    assert spike.users == 10 * base.users == 10 * after.users
    soak = shapes.schedule("soak", 20_000, None, user_rps=10, scores_per_request=10)
    assert soak[-1].until == 600 and soak[-1].offered == 20_000
    with pytest.raises(ValueError, match="SHARDLB_SHAPE"):
        shapes.schedule("wave", 1, 1, 1, 1)
