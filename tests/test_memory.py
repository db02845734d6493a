"""Memory per player at 100k players on a 16-shard board, from INFO memory of every master."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio.cluster import RedisCluster

from shardlb import times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

PLAYERS = 100_000
# A sorted-set entry costs a skiplist node, a dict entry and the member string twice over; well
# under 200 bytes for short ids. Above that something stores more than it should.
BYTES_PER_PLAYER_BOUND = 200


async def used_memory(client: RedisCluster) -> int:
    infos = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
    return sum(int(info["used_memory"]) for info in infos.values())


async def test_bytes_per_player_at_100k(store: BoardStore) -> None:
    # The board's index alone: the journal holds results only until the archiver has them.
    config = BoardConfig.from_dict(
        "memory-100k", {"durability": "memory", "sharding": {"strategy": "hash", "shards": 16}}
    )
    board, _ = await store.create(config)
    try:
        before = await used_memory(store.client)
        now = times.now_ms()
        for start in range(0, PLAYERS, 5000):
            batch = [
                Score(f"player-{i}", (i * 7919) % 1_000_000, f"m{i}", now - i)
                for i in range(start, start + 5000)
            ]
            await board.submit(batch, now_ms=now)
        assert await board.size() == PLAYERS
        per_player = (await used_memory(store.client) - before) / PLAYERS
        print(f"\nmemory: {per_player:.1f} bytes per player (total period, 100k players, 16 shards)")
        assert 0 < per_player < BYTES_PER_PLAYER_BOUND
    finally:
        await store.delete(config.id)


DEDUP_RESULTS = 100_000
# A dedup record of a UUID match and a 17-digit player (54 bytes) measured 96-109 bytes by MEMORY
# USAGE (bench/dedup.py; the hash table's fill moves it). Past this bound a record costs more than
# the planner's bytes_per_dedup_member says.
BYTES_PER_DEDUP_RECORD_BOUND = 160


async def _retry_records(store: BoardStore, mode: str, name: str, timed: bool) -> tuple[int, int]:
    """DEDUP_RESULTS new results on a 4-shard board of ``mode`` (with their time or without), then,
    over the shards' keys of that kind (incr dedup sets when timed, pin hashes otherwise), how many
    records they hold and their MEMORY USAGE in bytes."""
    config = BoardConfig.from_dict(name, {"mode": mode, "sharding": {"strategy": "hash", "shards": 4}})
    board, _ = await store.create(config)
    kind, count = ("dd:*", store.client.scard) if timed else ("pin:*", store.client.hlen)
    try:
        now = times.now_ms()
        for start in range(0, DEDUP_RESULTS, 5000):
            batch = [
                Score(
                    str(76_561_197_960_265_728 + i % 1000), 1, str(uuid.UUID(int=i)), now if timed else None
                )
                for i in range(start, start + 5000)
            ]
            await board.submit(batch, now_ms=now)
        records = size = 0
        for prefix in board.prefixes:
            node = store.client.get_node_from_key(prefix)
            found = [
                k
                async for k in store.client.scan_iter(
                    match=prefix.replace("{", "[{]") + kind, target_nodes=node
                )
            ]
            for key in found:
                records += await count(key)
                size += await store.client.memory_usage(key, samples=0)
        return records, size
    finally:
        await store.delete(config.id)


# A pin (the first server time of a result sent without one) of a UUID match and a 17-digit player:
# a hash field and its value, about 120 bytes by used_memory (bench/dedup.py). Past this bound a pin
# costs more than the planner's bytes_per_pin says.
BYTES_PER_PIN_BOUND = 180


@pytest.mark.parametrize(
    ("mode", "timed", "what", "bound"),
    [
        ("incr", True, "incr dedup record", BYTES_PER_DEDUP_RECORD_BOUND),
        ("best", False, "pin of a result without a time", BYTES_PER_PIN_BOUND),
    ],
)
async def test_bytes_per_retry_record_at_100k(
    store: BoardStore, mode: str, timed: bool, what: str, bound: int
) -> None:
    records, size = await _retry_records(store, mode, f"memory-{mode}-100k", timed)
    assert records == DEDUP_RESULTS
    per_record = size / records
    print(f"\nmemory: {per_record:.1f} bytes per {what} (100k results, 4 shards)")
    assert 54 < per_record < bound
