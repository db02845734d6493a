"""Key names and slot placement (server-free), and shard spread over a real 3-master cluster."""

from __future__ import annotations

from collections import Counter

import pytest
import redis

from shardlb import keys
from shardlb.cluster import LocalCluster
from shardlb.config import Sharding
from shardlb.reshard_copy import _player
from shardlb.sharding import Layout


@pytest.mark.parametrize("shards", range(1, 257))
def test_shard_i_of_n_lands_in_the_ith_nth_of_the_slots(shards: int) -> None:
    for i in range(shards):
        slot = keys.slot_of(keys.period_key(keys.shard_prefix("game-1", i, shards), "total"))
        assert i * keys.SLOTS // shards <= slot < (i + 1) * keys.SLOTS // shards


def test_all_keys_of_a_shard_share_one_slot() -> None:
    prefix = keys.shard_prefix("b", 5, 16, "c0ffee00")
    names = [
        keys.period_key(prefix, "total"),
        keys.period_key(prefix, "d:2026-11-30"),
        keys.period_key(prefix, "w:2026-W48"),
        keys.period_key(prefix, "m:2026-11"),
        keys.dedup_key(prefix, 123),
        keys.index_key(prefix),
        keys.version_key(prefix),
        keys.pending_key(prefix),
        keys.removed_versions_key(prefix),
        keys.version_floor_key(prefix),
        keys.pin_key(prefix, 123),
        keys.pin_span_key(prefix),
        keys.gone_key(prefix),
    ]
    assert len({keys.slot_of(n) for n in names}) == 1
    assert len(set(names)) == len(names)
    assert all(n.startswith("lb:{") and ":b:c0ffee00:5:" in n for n in names)


def test_a_region_boards_shards_of_one_index_share_a_slot() -> None:
    """A player may live in shard i of any region: those shards share one slot (one script call)."""
    layout = Layout(Sharding("region", 12, ("eu", "na", "asia"), 4))
    for shard in range(12):
        group = {
            keys.slot_of(keys.shard_prefix("r", s, 12, "1", layout.slot_group(s)))
            for s in [shard, *layout.rivals(shard)]
        }
        assert len(group) == 1
    slots = {keys.slot_of(keys.shard_prefix("r", s, 12, "1", layout.slot_group(s))) for s in range(12)}
    assert len(slots) == 4


def test_slot_of_matches_redis_py() -> None:
    from redis.crc import key_slot

    for name in ("plain", "lb:{x}:y", "{}empty", "a{b}c{d}", keys.shard_prefix("b", 1, 3) + "total"):
        assert keys.slot_of(name) == key_slot(name.encode())


def test_every_slot_has_a_token() -> None:
    tokens = keys.slot_tokens()
    assert len(tokens) == keys.SLOTS
    assert all(keys.slot_of("{" + t + "}") == slot for slot, t in enumerate(tokens))


def test_the_kept_table_of_slot_tokens_is_the_search_s() -> None:
    """Every process reads the tokens from shardlb/slot_tokens.txt, not searching them again (0.2-0.4
    s of CPU a process: every router, CLI call and bench): the file must hold what the search finds,
    or every key would move."""
    assert keys.TOKENS_FILE.read_text().split(",") == list(keys.search_slot_tokens())
    assert keys.slot_tokens() == keys.search_slot_tokens()


def test_boards_spread_over_their_window_and_placement_is_stable() -> None:
    slots = {keys.shard_slot(f"board-{n}", 0, 4) for n in range(50)}
    assert len(slots) > 10
    assert keys.shard_prefix("a", 3, 4) == keys.shard_prefix("a", 3, 4)


def test_out_of_range_shard_is_an_error() -> None:
    with pytest.raises(ValueError):
        keys.shard_prefix("a", 4, 4)


def _slot_owners(cluster: LocalCluster) -> list[tuple[int, int, int]]:
    node = redis.Redis(host=cluster.host, port=cluster.ports[0], decode_responses=True)
    try:
        return [(int(lo), int(hi), int(master[1])) for lo, hi, master, *_ in node.cluster("SLOTS")]
    finally:
        node.close()


@pytest.mark.cluster
@pytest.mark.parametrize("shards", [3, 16, 64])
def test_shards_per_master_differ_by_at_most_one(cluster: LocalCluster, shards: int) -> None:
    owners = _slot_owners(cluster)
    per_master: Counter[int] = Counter()
    for i in range(shards):
        slot = keys.slot_of(keys.period_key(keys.shard_prefix("spread", i, shards), "total"))
        per_master.update(port for lo, hi, port in owners if lo <= slot <= hi)
    assert len(per_master) == 3
    assert max(per_master.values()) - min(per_master.values()) <= 1


@pytest.mark.parametrize(
    "sharding, region",
    [
        (Sharding("hash", 16), None),
        (Sharding("region", 12, ("eu", "na", "asia"), 4), "na"),
        (Sharding("band", 3, (), 0, (0, 100, 1000), "spread"), None),
    ],
)
def test_homes_in_one_pass_are_each_players_home(sharding: Sharding, region: str | None) -> None:
    layout = Layout(sharding)
    players = [f"p{i}" for i in range(500)] + ["", "ünï", "x" * 128]
    assert layout.homes(players, region) == [layout.home(p, region) for p in players]


def test_the_index_of_reshards_shares_the_registrys_slot() -> None:
    """registry.lua writes a record and its place in the index of reshards under way in one call
    (one slot), so no failover can keep one of the two writes without the other."""
    assert keys.slot_of(keys.RESHARDS) == keys.slot_of(keys.BOARDS)


def test_the_registrys_version_shares_the_registrys_slot() -> None:
    """registry.lua moves the version in the call that changes a record: one slot, so a failover
    that loses the change loses the move with it (a reader would not see it moved for nothing, nor
    a change without its move)."""
    assert keys.slot_of(keys.BOARDS_VERSION) == keys.slot_of(keys.BOARDS)


def test_the_registrys_change_log_shares_the_registrys_slot() -> None:
    """registry.lua notes each move of the version in the change log in the same call: one slot."""
    assert keys.slot_of(keys.BOARDS_CHANGES) == keys.slot_of(keys.BOARDS)


def test_the_ban_lists_mark_shares_the_lists_slot() -> None:
    """A master lost with its replica loses the ban list and its mark together (one slot): a list
    written again after the loss (a ban made since) lacks the mark, and is written back whole."""
    assert keys.slot_of(keys.BANS_WHOLE) == keys.slot_of(keys.BANS) != keys.slot_of(keys.BANS_VERSION)


def test_the_registrys_digests_share_the_registrys_slot() -> None:
    """registry.lua writes a record's digest in the call that writes the record, and digests.lua
    reads the records, the version and the digests in one call: one slot."""
    assert keys.slot_of(keys.BOARDS_DIGESTS) == keys.slot_of(keys.BOARDS)


def test_a_removal_position_reads_the_journal_id_remove_lua_wrote() -> None:
    assert keys.removal_position("1234.17335000000427") == "1733500000042-7"
    assert keys.removal_position("1234.00000000000012345") == "1-2345"
    assert keys.removal_position("1234") == ""  # a record that names no entry
    assert keys.removal_position("1234.1") == ""
    assert keys.removal_position_field("p1") == keys.removal_request_field("", "p1")


def test_a_removal_position_value_reads_back_and_its_fields_go_to_the_players_home() -> None:
    for entry_id in ("1733500000042-7", "1-2345", "1733500000042-0"):
        value = keys.removal_position_value(218748776, entry_id)
        assert value.startswith("218748776.") and float(value) >= 218748776  # a number to the prune
        assert keys.removal_position(value) == entry_id
    field = keys.removal_request_position_field("remove/r-1", "p1")
    assert field != keys.removal_request_field("remove/r-1", "p1")
    assert _player(field) == _player(keys.removal_request_field("remove/r-1", "p1")) == "p1"
