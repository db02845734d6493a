"""Settlement through recoveries of Redis: a period closed, then a shard lost alone or every master
flushed, the board rebuilt from PostgreSQL, and the period settled. Each winner is paid once, the
awards are the reference's (the acknowledged results), and a settlement that cannot be exact yet is
refused with a message naming what to run, paying nothing."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from shardlb import rebuild
from shardlb.errors import Rebuilding, SettlementConflict
from shardlb.rebuild import connected
from shardlb.settlement import STEPS, Request, Settler
from shardlb.store import BoardStore
from tests.test_rebuild import OnlyStore, archiver, drain, own_archive
from tests.test_rebuild_jobs import lost
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


async def forgotten(db: Any, settlement_id: str) -> None:
    """The settlement's rows gone, as from PostgreSQL restored from a backup taken before it."""
    awards = "SELECT award_id FROM settlement_awards WHERE settlement_id = %s"
    await db.execute(f"DELETE FROM settlement_deliveries WHERE award_id IN ({awards})", (settlement_id,))
    await db.execute(f"DELETE FROM settlement_acks WHERE award_id IN ({awards})", (settlement_id,))
    for table in ("settlement_awards", "settlement_snapshots", "settlements"):
        await db.execute(f"DELETE FROM {table} WHERE settlement_id = %s", (settlement_id,))


async def test_a_period_paid_before_a_total_loss_stays_paid_after_rebuild_all(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A period settled, then every key of Redis lost and `shardlb rebuild --all` run, then
    PostgreSQL restored from a backup taken before the settlement. Failed before the fix: the
    record of the payment in Redis (keys.paid_key, which refuses a second payment after such a
    restore) and the period's freeze went with the loss and the rebuild did not write them back, so
    a run under the same id and one under another id both paid every winner again. Now the restore
    writes them back from the settlements PostgreSQL holds, and both runs are 409 period_settled."""
    board_id = "recover-paid"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        period = day_ago(2)
        try:
            ref = await written(board, period, board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": f"{board_id}-1", "rewards": TABLE})
            async with connected(cluster_url, url) as (rebuilder, other):
                await Settler(rebuilder).settle(await other.get(board_id), period, request)
                want = expected_awards(ref, period, board)
                assert want and await awards_of(rebuilder.db, f"{board_id}-1") == want
            await lost(raw, [board])
            await rebuild.run(cluster_url, url, None)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                name = back.resolve(period).period
                assert await back.frozen(name)
                assert await back.paid(name) == f"{board_id}-1"
                await forgotten(rebuilder.db, f"{board_id}-1")
                for again in (request, Request.of({"settlement_id": f"{board_id}-2", "rewards": TABLE})):
                    with pytest.raises(SettlementConflict) as refused:
                        await Settler(rebuilder).settle(back, period, again)
                    assert refused.value.code == "period_settled"
                    assert await awards_of(rebuilder.db, again.settlement_id) == []
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


class Fault(Exception):
    """The settling process stopping between two of its steps."""


async def test_a_settlement_stopped_after_any_step_then_a_total_loss_pays_each_winner_once(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """One period per step: its settlement stops right after that step (inside the storing
    transaction for ``snapshot`` and ``awards``, which rolls back), then every key of Redis is lost
    and `shardlb rebuild --all` runs. Run again, each settlement pays the reference's awards, once;
    a third run answers the same result, and another id for a period is 409 period_settled."""
    board_id = "recover-steps"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        days = {step: day_ago(2 + i) for i, step in enumerate(STEPS)}
        try:
            refs = {step: await written(board, period, f"{board_id}/{step}") for step, period in days.items()}
            await archived(store, raw, url, board_id)
            for stop, period in days.items():

                def step(name: str, stop: str = stop) -> None:
                    if name == stop:
                        raise Fault(name)

                async with connected(cluster_url, url) as (rebuilder, other):
                    request = Request.of({"settlement_id": f"{board_id}-{stop}", "rewards": TABLE})
                    with pytest.raises(Fault):
                        await Settler(rebuilder, step).settle(await other.get(board_id), period, request)
                    paid = await awards_of(rebuilder.db, f"{board_id}-{stop}")
                    assert paid == ([] if stop != "commit" else expected_awards(refs[stop], period, board))
            await lost(raw, [board])
            await rebuild.run(cluster_url, url, None)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                for stop, period in days.items():
                    request = Request.of({"settlement_id": f"{board_id}-{stop}", "rewards": TABLE})
                    result = await Settler(rebuilder).settle(back, period, request)
                    assert result["check"]["drifting"] == [], stop
                    want = expected_awards(refs[stop], period, back)
                    assert want and await awards_of(rebuilder.db, f"{board_id}-{stop}") == want, stop
                    assert await Settler(rebuilder).settle(back, period, request) == result
                    assert await awards_of(rebuilder.db, f"{board_id}-{stop}") == want
                    assert await back.paid(back.resolve(period).period) == f"{board_id}-{stop}"
                other_id = Request.of({"settlement_id": f"{board_id}-other", "rewards": TABLE})
                with pytest.raises(SettlementConflict) as refused:
                    await Settler(rebuilder).settle(back, days["begin"], other_id)
                assert refused.value.code == "period_settled"
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)
