"""The periods a board still keeps in Redis (shardlb/settlement_history.py, ``kept``), on the suite's
cluster: what ``GET /v1/boards/{board}/periods`` answers as ``kept``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from shardlb import keys, periods, settlement_history, times
from shardlb.board import Score
from shardlb.config import BoardConfig
from shardlb.store import BoardStore

pytestmark = pytest.mark.cluster

DAY_MS = 86_400_000


async def test_a_period_whose_keys_have_expired_is_not_kept(store: BoardStore) -> None:
    """A shard's key index lists a period's key until a later write drops the listings of expired
    keys: on a board that took no write since, the listing outlives the key. Such a period was
    answered ``kept`` although Redis held nothing of it (and its reads answer it empty)."""
    config = BoardConfig.from_dict("kept-expired", {"periods": ["daily"], "retention_days": {"daily": 1}})
    board, _ = await store.create(config)
    now = times.now_ms()
    then = now - 5 * DAY_MS  # the day's keys expired three days ago, and no write came since
    old, today = (periods.names_at(at, config.periods, board.tz)[1] for at in (then, now))
    try:
        await board.submit([Score("a", 1, "m1", then)], now_ms=then)
        shard = board.prefixes[board.layout.home("a")]
        assert not await board.client.exists(keys.period_key(shard, old))
        # The listing as a shard keeps it until its next trimming write: that write trims by Redis's
        # clock since 2026-12-05, so the listing of a key written dated days back goes at once.
        await board.client.zadd(keys.index_key(shard), {keys.period_key(shard, old): then + DAY_MS})
        assert old not in await settlement_history.kept(board)

        await board.submit([Score("b", 1, "m2", now)], now_ms=now)
        assert await settlement_history.kept(board) == {today}
    finally:
        await store.delete(config.id)


async def test_the_periods_listing_reads_every_shard_in_one_round(store: BoardStore) -> None:
    """``GET /v1/boards/{board}/periods`` read each home shard's key index after the one before,
    holding a read permit of the worker's 16 throughout: on a board of 1024 shards 90-140 ms a
    request, and one address listing it 28 times a second (within its read budget) made 23 of 28
    of another client's reads 503. The shards are read as every other read reads them: one
    pipeline per node, each a few reads of Redis's, not one a shard."""
    config = BoardConfig.from_dict("kept-round", {"periods": ["daily"], "sharding": {"shards": 512}})
    board, _ = await store.create(config)
    now = times.now_ms()
    try:
        await board.submit([Score(f"p{i}", 1, f"m{i}", now) for i in range(64)], now_ms=now)
        before = await _reads_processed(board)
        assert await settlement_history.kept(board) == {periods.names_at(now, config.periods, board.tz)[1]}
        assert await _reads_processed(board) - before < 512 // 4  # a shard at a time: 512 and more
    finally:
        await store.delete(config.id)


async def _reads_processed(board: Any) -> int:
    """The reads from clients that the cluster's primaries have processed so far (INFO stats)."""
    stats = await board.client.info("stats", target_nodes=board.client.get_primaries())
    return sum(int(node["total_reads_processed"]) for node in stats.values())


async def test_the_periods_listing_waits_out_a_reshard_of_the_layout_it_read(
    store: BoardStore, cluster_url: str
) -> None:
    """A router that fetched the board while it was being resharded lists its periods from the old
    layout's key indexes; once the new layout was committed and the old keys dropped, ``kept`` found
    none and `GET .../periods` answered an empty list (200) where every other read is refused on the
    old layout and made again on the new one. It now is too: ``kept`` checks the layout's markers
    (Board.check_layout) and the listing is tried again (router/boards.py, through_reshard)."""
    from shardlb.errors import Resharding
    from shardlb.reshard import Resharder
    from tests.router_support import running

    config = BoardConfig.from_dict("kept-resharded", {"periods": ["daily"], "durability": "memory"})
    board, _ = await store.create(config)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", i, f"m{i}", now) for i in range(20)], now_ms=now)
        today = periods.api_name(periods.names_at(now, config.periods, board.tz)[1])
        await Resharder(store, config.id, say=lambda _: None, cache_s=0).start(4)
        moving = await store.get(config.id)
        async with running(cluster_url) as (_, client):
            before = await client.get(f"/v1/boards/{config.id}/periods")  # the router keeps it moving
            assert before.status_code == 200, before.text
            assert [(p["period"], p["kept"]) for p in before.json()["periods"]] == [(today, True)]
            await Resharder(store, config.id, say=lambda _: None, cache_s=0).run()
            with pytest.raises(Resharding):
                await settlement_history.kept(moving)
            after = await client.get(f"/v1/boards/{config.id}/periods")
            assert (after.status_code, after.json()) == (200, before.json())
    finally:
        await store.delete(config.id)


async def test_a_lookup_begun_before_a_settlement_does_not_hide_it_once_seen(
    store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A router keeps a period found settled for good (a settlement is final, router/history.py);
    a lookup that asked PostgreSQL before the settlement and answered after a later one had found
    it settled put "not settled" in its place: reads of the period went live again for
    UNSETTLED_TTL_S."""
    from router import history
    from tests.test_settlement import day_ago

    board, _ = await store.create(BoardConfig.from_dict(f"held-{times.now_ms()}", {"periods": ["daily"]}))
    view = board.resolve(day_ago(3))
    svc: Any = SimpleNamespace(settings=SimpleNamespace(postgres_url="postgresql://never-reached"))
    asked, go = asyncio.Event(), asyncio.Event()
    done = settlement_history.Settled("held", 3)

    @contextlib.asynccontextmanager
    async def no_db(_: Any) -> AsyncIterator[None]:
        yield None

    async def settled(db: Any, board: Any, name: str) -> settlement_history.Settled | None:
        if not asked.is_set():  # the first lookup: PostgreSQL answers before the settlement
            asked.set()
            await go.wait()
            return None
        return done

    monkeypatch.setattr(history, "archive_read", no_db)
    monkeypatch.setattr(settlement_history, "settled", settled)
    try:
        early = asyncio.ensure_future(history._lookup(svc, board, view))
        await asked.wait()
        assert await history._lookup(svc, board, view) == done
        go.set()
        assert await early == done  # the settlement found meanwhile is final: its answer too
        assert await history._lookup(svc, board, view) == done
    finally:
        go.set()
        await store.delete(board.config.id)


async def test_a_periods_listing_that_merges_a_lost_shard_is_refused_during_a_reshard_and_once_marked(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A shard of the board loses its keys while a reshard copies it (the archiver marks nothing
    then, and nothing had yet): ``kept`` read the other shards' key indexes and answered without
    the period only the lost shard held (yesterday's, of a player homed there), 200 through the
    router, though every other read merging that shard is refused. So it did once the reshard was
    cancelled and the shard marked not rebuilt (``kept`` never looked at ``Board.rebuilding``). Now
    it is refused (Rebuilding: 503 ``board_rebuilding``) in both cases, as the reads are."""
    from shardlb.errors import Rebuilding
    from shardlb.reshard import Resharder, ShardsLost
    from shardlb.store import _marked
    from tests.test_rebuild import own_archive
    from tests.test_shard_loss import board_written, slot_wiped

    name = "kept-lost"
    async with own_archive(postgres_url, "kept") as url:
        try:
            board, sent = await board_written(store, name, periods=["daily"])
            now = times.now_ms()
            then = now - DAY_MS
            lone = next(s.player_id for s in sent if board.layout.home(s.player_id) == 1)
            await board.submit([Score(lone, 5, "y1", then)], now_ms=then)
            yesterday, today = (periods.names_at(at, board.config.periods, board.tz)[1] for at in (then, now))
            assert await settlement_history.kept(board) == {yesterday, today}
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            assert await slot_wiped(raw, board, 1) > 0
            with pytest.raises(Rebuilding, match="shard 1 lost its data"):
                await settlement_history.kept(await store.get(name))
            with pytest.raises(ShardsLost):
                await mover.run()
            record = await store.client.hget(keys.BOARDS, name)
            assert await store.swap(name, record, orjson.dumps(_marked(orjson.loads(record), {1})))
            marked = await store.get(name)
            assert marked.rebuilding == {1} and not marked.resharding
            with pytest.raises(Rebuilding, match="shard 1 lost its data"):
                await settlement_history.kept(marked)
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)
