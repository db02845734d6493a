"""Where a band board's shards land: "spread" boards give every master of a cluster with as many
masters as bands one home shard and one band; band boards laid out before ("window": every home
shard first, then the bands) keep their key names and are confirmed by a PUT of their settings."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from shardlb import keys, times
from shardlb.board import Score
from shardlb.config import BoardConfig, Sharding, stored_sharding
from shardlb.connection import primary_name
from shardlb.errors import InvalidInput
from shardlb.sharding import Layout
from shardlb.store import BoardStore


def band(homes: int, bands: int, placement: str | None = None) -> dict[str, object]:
    sharding: dict[str, object] = {
        "strategy": "band",
        "shards": homes,
        "bands": [100 * b for b in range(bands)],
    }
    if placement is not None:
        sharding["placement"] = placement
    return sharding


def windows(homes: int, bands: int, placement: str) -> list[str]:
    """The shards in slot-window order, as h<i> and b<i>."""
    layout = Layout(BoardConfig.from_dict("x", {"sharding": band(homes, bands, placement)}).sharding)
    order = sorted(range(layout.physical), key=lambda shard: layout.slot_group(shard)[0])
    return [f"h{s}" if s < homes else f"b{s - homes}" for s in order]


def test_spread_interleaves_homes_and_bands_and_window_keeps_the_old_order() -> None:
    assert windows(3, 3, "spread") == ["h0", "b0", "h1", "b1", "h2", "b2"]
    assert windows(3, 3, "window") == ["h0", "h1", "h2", "b0", "b1", "b2"]
    assert windows(6, 3, "spread") == ["h0", "b0", "h1", "h2", "b1", "h3", "h4", "b2", "h5"]
    assert windows(1, 4, "spread") == ["b0", "b1", "h0", "b2", "b3"]
    for homes, bands in ((1, 1), (2, 5), (16, 3), (4, 256)):
        layout = Layout(BoardConfig.from_dict("x", {"sharding": band(homes, bands, "spread")}).sharding)
        assert sorted(layout.slot_group(s)[0] for s in range(layout.physical)) == list(range(layout.physical))


def test_new_band_settings_are_spread_and_stored_ones_without_a_placement_are_window() -> None:
    config = BoardConfig.from_dict("b", {"sharding": band(3, 3)})
    assert config.sharding.placement == "spread"
    assert config.to_dict()["sharding"] == {
        "strategy": "band",
        "bands": [0, 100, 200],
        "shards": 3,
        "placement": "spread",
    }
    assert BoardConfig.from_dict("b", config.to_dict()) == config  # stored and read back
    legacy = {"strategy": "band", "bands": [0, 100, 200], "shards": 3}
    assert stored_sharding(legacy) == {**legacy, "placement": "window"}
    assert stored_sharding(config.to_dict()["sharding"]) == config.to_dict()["sharding"]
    assert stored_sharding({"strategy": "hash", "shards": 4}) == {"strategy": "hash", "shards": 4}
    assert BoardConfig.from_dict("h", {}).sharding == Sharding("hash", 16)  # no placement elsewhere
    with pytest.raises(InvalidInput) as e:
        BoardConfig.from_dict("b", {"sharding": band(3, 3, "random")})
    assert e.value.field == "sharding.placement"
    with pytest.raises(InvalidInput):
        BoardConfig.from_dict("h", {"sharding": {"strategy": "hash", "shards": 3, "placement": "spread"}})


@pytest.mark.cluster
@pytest.mark.parametrize(("homes", "per_master"), [(3, 1), (6, 2)])
async def test_a_band_board_gives_every_master_one_band(
    store: BoardStore, homes: int, per_master: int
) -> None:
    """On the suite's cluster of 3 masters, a band board of 3 bands: each master serves one band and
    its share of the home shards (the window placement put two bands on one master, none on another)."""
    config = BoardConfig.from_dict(f"placed-{homes}", {"sharding": band(homes, 3)})
    board, _ = await store.create(config)
    try:
        homes_on: Counter[str] = Counter()
        bands_on: Counter[str] = Counter()
        for shard, prefix in enumerate(board.prefixes):
            (homes_on if shard < homes else bands_on)[primary_name(store.client, prefix)] += 1
        assert sorted(bands_on.values()) == [1, 1, 1], bands_on
        assert sorted(homes_on.values()) == [per_master] * 3, homes_on
        assert set(homes_on) == set(bands_on)
    finally:
        await store.delete(config.id)


@pytest.mark.cluster
async def test_a_band_board_of_before_keeps_its_keys_and_a_put_confirms_it(store: BoardStore) -> None:
    """A registry record written before placements existed (no `placement`): the board is read with
    the window placement (the key names it was written under) and its players are found; a PUT of
    the same settings answers the existing board, not a conflict."""
    board_id = "placed-legacy"
    settings = BoardConfig.from_dict(board_id, {"sharding": band(3, 3, "window")}).to_dict()
    del settings["sharding"]["placement"]
    record = {**settings, "incarnation": "legacy1"}
    assert await store.client.hsetnx(keys.BOARDS, board_id, orjson.dumps(record))
    try:
        old = await store.get(board_id)
        assert old.config.sharding.placement == "window"
        physical = old.layout.physical
        assert old.prefixes == [keys.shard_prefix(board_id, i, physical, "legacy1") for i in range(physical)]
        now = times.now_ms()
        await old.submit([Score(f"p{i}", 50 * i, "m", now) for i in range(8)], now_ms=now)
        body = {k: v for k, v in settings.items() if k != "board"}
        again, created = await store.create(BoardConfig.from_dict(board_id, body))
        assert not created and again.prefixes == old.prefixes
        entry = (await again.player("p7")).entry
        assert entry is not None and entry.rank == 1 and entry.points == 350
    finally:
        await store.delete(board_id)
