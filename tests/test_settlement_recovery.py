"""Settlement through recoveries of Redis: a period closed, then a shard lost alone or every master
flushed, the board rebuilt from PostgreSQL, and the period settled. Each winner is paid once, the
awards are the reference's (the acknowledged results), and a settlement that cannot be exact yet is
refused with a message naming what to run, paying nothing."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from shardlb.errors import Rebuilding
from shardlb.rebuild import connected
from shardlb.settlement import Request, Settler
from shardlb.store import BoardStore
from tests.test_rebuild import OnlyStore, archiver, drain, own_archive
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board, written
from tests.test_shard_loss import slot_wiped

pytestmark = pytest.mark.cluster


async def archived(store: BoardStore, raw: Any, url: str, board_id: str) -> None:
    """Every result of ``board_id`` in the archive ``url`` (its journals drained)."""
    a = await archiver(raw, OnlyStore(store.client, store.scripts, {board_id}), url)
    try:
        await drain(a)
    finally:
        await a.db.close()


async def state_of(db: Any, settlement_id: str) -> str | None:
    cur = await db.execute("SELECT state FROM settlements WHERE settlement_id = %s", (settlement_id,))
    row = await cur.fetchone()
    return None if row is None else row[0]


@pytest.mark.parametrize("when", ["before", "after-freeze"])
async def test_a_shard_lost_alone_is_refused_until_its_rebuild_then_settles_exactly(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, when: str
) -> None:
    """A shard's slot wiped before the settlement (no archiver round since, so nothing marked it),
    or between its drain and its check. The settlement is refused (Rebuilding) naming `shardlb
    rebuild BOARD --shard 1`, its row not left in ``mismatch``, nothing paid; after that rebuild the
    same settlement pays the reference's order, and once only."""
    board_id = f"recover-shard-{when}"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        period = day_ago(2)
        try:
            ref = await written(board, period, board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": f"{board_id}-1", "rewards": TABLE})

            if when == "before":
                assert await slot_wiped(raw, board, 1) > 0
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                settler = Settler(rebuilder)
                if when == "after-freeze":
                    real = settler.drained

                    async def drained_then_wiped(b: Any, name: str) -> None:
                        await real(b, name)
                        assert await slot_wiped(raw, board, 1) > 0

                    settler.drained = drained_then_wiped  # type: ignore[method-assign]
                with pytest.raises(Rebuilding) as refused:
                    await settler.settle(back, period, request)
                assert f"shardlb rebuild {board_id} --shard 1" in refused.value.message
                assert await state_of(rebuilder.db, f"{board_id}-1") != "mismatch"
                assert await awards_of(rebuilder.db, f"{board_id}-1") == []
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(board_id), shard=1)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                result = await Settler(rebuilder).settle(back, period, request)
                assert result["check"]["drifting"] == []
                want = expected_awards(ref, period, back)
                assert want and await awards_of(rebuilder.db, f"{board_id}-1") == want
                assert await Settler(rebuilder).settle(back, period, request) == result
                assert await awards_of(rebuilder.db, f"{board_id}-1") == want
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)
