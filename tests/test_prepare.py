"""Board.prepare packs each score as the codec and the layout say, whatever the board's order,
tiebreak and sharding: its loop inlines ScoreCodec.encode_units and Layout.home for speed, and keeps
one quarter hour's period names while its scores share it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardlb.board import QUARTER_HOUR_MS, Board, Score
from shardlb.config import BoardConfig

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
        assert p.periods == b._names_in_quarter_hour(achieved // QUARTER_HOUR_MS)
        assert p.server_time is (s.achieved_ms is None)
