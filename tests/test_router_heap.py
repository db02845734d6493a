"""router/heap.py: a started worker freezes what start-up made, collects its young generation
rarely, and times every collection into ``shardlb_gc_pause_seconds``."""

from __future__ import annotations

import asyncio
import gc

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from router import heap
from shardlb.cluster import LocalCluster
from tests.router_support import running

pytestmark = pytest.mark.cluster


def pauses_counted(text: str, generation: str) -> float:
    """The pause histogram's count for ``generation`` in a /metrics page (0 when absent)."""
    for family in text_string_to_metric_families(text):
        if family.name == "shardlb_gc_pause_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count") and sample.labels.get("generation") == generation:
                    return sample.value
    return 0.0


async def test_a_started_worker_keeps_its_start_up_heap_out_of_collections(cluster: LocalCluster) -> None:
    """What start-up made is frozen and young collections are rarer, so no collection walks the
    whole worker in the middle of requests; the timing callback goes when the worker stops."""
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    callbacks = len(gc.callbacks)
    async with running(cluster.url):
        assert gc.get_freeze_count() > 1000
        assert gc.get_threshold()[0] == heap.GC_YOUNG == 50_000
        assert len(gc.callbacks) == callbacks + 1
    assert len(gc.callbacks) == callbacks


async def test_every_collection_shows_in_the_pause_histogram(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heap, "FLUSH_S", 0.05)
    async with running(cluster.url) as (_, client):
        before = pauses_counted((await client.get("/metrics")).text, "1")
        for _ in range(3):
            gc.collect(1)
        deadline = asyncio.get_running_loop().time() + 10
        while (after := pauses_counted((await client.get("/metrics")).text, "1")) - before < 3:
            assert asyncio.get_running_loop().time() < deadline, after - before  # the flushes never came
            await asyncio.sleep(0.05)


def test_the_callback_only_keeps_the_pause_until_a_flush() -> None:
    """The callback may run inside prometheus-client's lock: it must not touch a metric itself."""
    pauses = heap.Pauses()
    counted = REGISTRY.get_sample_value("shardlb_gc_pause_seconds_count", {"generation": "2"}) or 0.0
    pauses("start", {"generation": 2, "collected": 0, "uncollectable": 0})
    pauses("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    assert len(pauses.pending) == 1 and pauses.pending[0][0] == 2 and pauses.pending[0][1] >= 0
    assert REGISTRY.get_sample_value("shardlb_gc_pause_seconds_count", {"generation": "2"}) in (None, counted)
    pauses.flush()
    assert pauses.pending == []
    assert REGISTRY.get_sample_value("shardlb_gc_pause_seconds_count", {"generation": "2"}) == counted + 1
