"""fanout.Batch: per-node pipelines give redis-py's own parsed replies, in order, and any failure on
that path falls back to redis-py's ClusterPipeline (or, for counts.lua, to the script object) with
the same answers."""

from __future__ import annotations

from typing import Any

import pytest

from shardlb import fanout
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster


async def _fill(store: BoardStore) -> list[str]:
    client = store.client
    keys = [f"fanout:{{t{i}}}" for i in range(12)]  # twelve slots: every primary gets some
    for i, key in enumerate(keys):
        await client.delete(key)
        await client.zadd(key, {f"m{j}": float(i * 100 + j) for j in range(i + 1)})
    return keys


def _record(batch: Any, keys: list[str]) -> None:
    for key in keys:
        batch.zcard(key)
        batch.zrevrange(key, 0, 2, withscores=True)
        batch.zscore(key, "m0")
        batch.zscore(key, "nobody")
        batch.zcount(key, "(50", "+inf")


async def test_direct_replies_equal_the_cluster_pipeline(store: BoardStore) -> None:
    keys = await _fill(store)
    batch = fanout.batch(store.client)
    _record(batch, keys)
    direct = await batch.direct()
    pipe = store.client.pipeline(transaction=False)
    _record(pipe, keys)
    assert direct == list(await pipe.execute())
    assert direct is not None and direct[1] == [("m0", 0.0)] and direct[3] is None


async def test_any_failure_on_the_direct_path_falls_back(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = await _fill(store)
    good = fanout.batch(store.client)
    _record(good, keys)
    want = await good.execute()

    async def broken(*_: Any) -> bool:
        raise ConnectionError("node went away")

    monkeypatch.setattr(fanout, "_pipeline", broken)
    batch = fanout.batch(store.client)
    _record(batch, keys)
    assert await batch.direct() is None
    assert await batch.execute() == want  # through redis-py's ClusterPipeline


async def test_counts_survive_an_empty_script_cache(store: BoardStore) -> None:
    """A promoted replica starts with no scripts: the direct EVALSHA gets NOSCRIPT, the script object
    loads counts.lua again, and ranks and friends queries still come out right."""
    config = BoardConfig.from_dict("fanout-noscript", {"sharding": {"strategy": "hash", "shards": 6}})
    board, _ = await store.create(config)
    try:
        await board.submit([Score(f"p{i}", 10 * (i % 5), f"m{i}") for i in range(60)])  # many ties
        before = await board.query([f"p{i}" for i in range(0, 60, 7)])
        ranks = [(await board.player(f"p{i}")).entry.rank for i in range(0, 60, 11)]
        await store.client.execute_command("SCRIPT FLUSH", target_nodes=store.client.PRIMARIES)
        assert await board.query([f"p{i}" for i in range(0, 60, 7)]) == before
        assert [(await board.player(f"p{i}")).entry.rank for i in range(0, 60, 11)] == ranks
    finally:
        await store.delete(config.id)
