"""Routers, jobs and Redis whose clocks differ by seconds (NTP steps, VMs): what each wall-clock time
decides must hold with one router 30 s ahead and another 30 s behind. The skew is injected in
process, by replacing ``shardlb.times.now_ms`` (the clock every router and job reads), against the
suite's cluster. docs/design-notes.md, "Clocks", lists the assumptions these tests confirm."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from shardlb import keys, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.errors import BoardNotFound
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

SKEW_MS = 30_000


def clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """A setter of this process's clock: ``at(ms)`` makes ``times.now_ms`` answer ``ms`` from then
    on (one router's clock, read at one true moment)."""

    def at(ms: int) -> None:
        monkeypatch.setattr(times, "now_ms", lambda: ms)

    return at


async def redis_ms(store: BoardStore) -> int:
    seconds, micros = await store.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_a_router_ahead_keeps_the_key_index_listing_of_a_key_still_alive(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write.lua dropped the shard's index listings of keys expired by the writing router's clock:
    a router 30 s ahead dropped those of keys Redis keeps for up to 30 s more, which a deletion or a
    reshard (both go by the index) then missed. The listings now go by Redis's own clock, the one
    that expires the keys."""
    config = BoardConfig.from_dict("clock-trim", {"sharding": {"shards": 1}})
    board, _ = await store.create(config)
    prefix = board.prefixes[0]
    index, alive = keys.index_key(prefix), prefix + "dd:1"  # a dedup bucket Redis still holds
    try:
        expire_at = await redis_ms(store) + 20_000
        await store.client.set(alive, 1, pxat=expire_at)
        await store.client.zadd(index, {alive: expire_at})
        clock(monkeypatch)(times.now_ms() + SKEW_MS)
        fresh = await BoardStore(store.client, store.scripts).get(config.id)  # trims on its first call
        assert [r.status for r in await fresh.submit([Score("p1", 5, "m1")])] == ["improved"]
        assert await store.client.zscore(index, alive) == expire_at
        monkeypatch.undo()
        await store.delete(config.id)
        assert not await store.client.exists(alive)
    finally:
        monkeypatch.undo()
        await store.client.delete(alive)
        with contextlib.suppress(BoardNotFound):
            await store.delete(config.id)
