"""Memory per player at 100k players on a 16-shard board, from INFO memory of every master."""

from __future__ import annotations

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
    config = BoardConfig.from_dict("memory-100k", {"sharding": {"strategy": "hash", "shards": 16}})
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
