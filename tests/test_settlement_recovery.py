"""Settlement through recoveries of Redis: a period closed, then a shard lost alone or every master
flushed, the board rebuilt from PostgreSQL, and the period settled. Each winner is paid once, the
awards are the reference's (the acknowledged results), and a settlement that cannot be exact yet is
refused with a message naming what to run, paying nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
import psycopg
import pytest
from redis.exceptions import RedisClusterException

from shardlb import archive, keys, rebuild, settlement, times
from shardlb.board import Score, band_shards
from shardlb.cli import main
from shardlb.errors import BoardClosed, Rebuilding, SettlementConflict
from shardlb.rebuild import connected
from shardlb.settlement import STEPS, Request, Settler, ensure_schema
from shardlb.settlement_delivery import deliver_until_done
from shardlb.store import BoardStore
from tests.client_support import free_port
from tests.router_support import AS_ADMIN, running
from tests.test_archive_outages import failed_rounds
from tests.test_board import sharding
from tests.test_rebuild import OnlyStore, archive_round, archiver, drain, own_archive
from tests.test_rebuild_jobs import lost
from tests.test_router_logs import Kept, kept
from tests.test_settlement import TABLE, Receiver, awards_of, day_ago, expected_awards, new_board, written
from tests.test_shard_loss import slot_wiped

pytestmark = pytest.mark.cluster

NO_REDIS = "redis://127.0.0.1:1"  # nothing listens on port 1
SECRET = "s3cret"
ARCHIVED = "SELECT count(*) FROM match_results WHERE board = %s"


async def archived(store: BoardStore, raw: Any, url: str, board_id: str) -> None:
    """Every result of ``board_id`` in the archive ``url`` (its journals drained)."""
    a = await archiver(raw, OnlyStore(store.client, store.scripts, {board_id}), url)
    try:
        await drain(a)
    finally:
        await a.db.close()


async def awards_with_ids(db: Any, settlement_id: str) -> list[tuple[Any, ...]]:
    """(award id, rank, player) of each award of the settlement, by rank."""
    cur = await db.execute(
        "SELECT award_id, rank, player_id FROM settlement_awards WHERE settlement_id = %s ORDER BY rank",
        (settlement_id,),
    )
    return [tuple(row) for row in await cur.fetchall()]


async def state_of(db: Any, settlement_id: str) -> str | None:
    cur = await db.execute("SELECT state FROM settlements WHERE settlement_id = %s", (settlement_id,))
    row = await cur.fetchone()
    return None if row is None else row[0]


@pytest.mark.parametrize("when", ["before", "after-freeze", "two-before"])
async def test_a_shard_lost_alone_is_refused_until_its_rebuild_then_settles_exactly(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, when: str
) -> None:
    """A shard's slot wiped before the settlement (no archiver round since, so nothing marked it),
    or between its drain and its check (or two shards' slots before it). The settlement is refused
    (Rebuilding) naming `shardlb rebuild BOARD --shard 1` (`shardlb rebuild BOARD` for two), its row not
    left in ``mismatch``, nothing paid; after that rebuild the same settlement pays the reference's
    order, and once only."""
    board_id = f"recover-shard-{when}"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        period = day_ago(2)
        try:
            ref = await written(board, period, board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": f"{board_id}-1", "rewards": TABLE})

            if when != "after-freeze":
                assert await slot_wiped(raw, board, 1) > 0
            if when == "two-before":
                assert await slot_wiped(raw, board, 2) > 0
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
                if when == "two-before":
                    assert "shards 1, 2 lost their data" in refused.value.message
                    assert f"`shardlb rebuild {board_id}` brings them back" in refused.value.message
                else:
                    assert f"`shardlb rebuild {board_id} --shard 1` brings it back" in refused.value.message
                assert await state_of(rebuilder.db, f"{board_id}-1") != "mismatch"
                assert await awards_of(rebuilder.db, f"{board_id}-1") == []
            async with connected(cluster_url, url) as (rebuilder, other):
                for shard in (1, 2) if when == "two-before" else (1,):
                    await rebuilder.rebuild(await other.get(board_id), shard=shard)
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


@pytest.mark.parametrize("lost", [[1], [1, 2]])
async def test_a_settlement_refused_for_a_shard_lost_alone_names_its_rebuild_once(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    capsys: pytest.CaptureFixture[str],
    lost: list[int],
) -> None:
    """The message of that refusal, as `shardlb settle` prints it and as the router's 503 body
    gives it: the lost shards and the command that brings them back, once, then what the caller
    does. Failed before the fix: the Board's text (``board.rebuilding``) named `shardlb rebuild
    BOARD --shard 1` and the settlement's own named it again ("Run `shardlb rebuild BOARD --shard
    1`, then settle again"; for two shards `shardlb rebuild BOARD`, then `--shard N` for each), and
    the message, some 440 characters, was cut at the router's 300 (``router.errors.MESSAGE_MAX``)
    to "...; nothing wa…": the 503 body said neither that nothing was paid nor to settle again."""
    board_id = f"recover-once-{len(lost)}"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        period = day_ago(2)
        try:
            await written(board, period, board_id, players=6, results=12)
            await archived(store, raw, url, board_id)
            for shard in lost:
                assert await slot_wiped(raw, board, shard) > 0
            command = ["settle", board_id, period, "--id", f"{board_id}-1"]
            command += ["--rewards", orjson.dumps(TABLE).decode()]
            command += ["--redis", cluster_url, "--postgres", url]
            code = await asyncio.to_thread(main, command)
            printed = capsys.readouterr().err.strip()
            async with running(cluster_url, postgres_url=url) as (_, client):
                answer = await client.post(
                    f"/v1/boards/{board_id}/periods/{period}:settle",
                    json={"settlement_id": f"{board_id}-1", "rewards": TABLE},
                    headers=AS_ADMIN,
                )
            assert code == 1 and answer.status_code == 503, (printed, answer.text)
            body = answer.json()["error"]
            assert body["code"] == "board_rebuilding"
            assert printed == f"shardlb: error: {body['message']}"  # whole: not cut by the router
            message = body["message"]
            one = len(lost) == 1
            run = f"`shardlb rebuild {board_id}" + (" --shard 1`" if one else "`")
            assert message.count(f"shardlb rebuild {board_id}") == 1 and run in message, message
            then = f"nothing was paid; settle again once {'it is' if one else 'they are'} rebuilt"
            # What the caller does, before the command.
            assert f"not rebuilt yet: {then}. " in message, message
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


@pytest.mark.parametrize("marked", [False, True])
async def test_a_band_shard_lost_alone_holds_up_no_settlement(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, marked: bool
) -> None:
    """A band board's settlement reads its home shards alone: it drains their journals and checks
    their period against PostgreSQL's order (``Layout.view(False)``), where a band shard holds the
    top of the total only, made again from the homes by its rebuild. So a band shard lost alone (its
    slot wiped, before the archiver's round or marked by it) holds up no settlement: it pays the
    reference's order, exactly, and the band shard stays lost (the top of the total refused once it
    is marked) until `shardlb rebuild BOARD --shard N`. Failed before the fix: Rebuilding, "shard 4
    lost its data in Redis", from the settlement's look at every shard's sentinel (``_lost_shards``)
    and, marked, from its look at the record (``Rebuilder.check_layout``), nothing paid."""
    board_id = f"recover-band-{'marked' if marked else 'unmarked'}"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id, sharding=sharding("band", 3))
        period = day_ago(2)
        band = band_shards(board)[1]
        try:
            ref = await written(board, period, board_id)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {board_id}), url)
            try:
                await drain(a)
                assert await slot_wiped(raw, board, band) > 0
                if marked:
                    await a.refresh()
                    await archive_round(a)
                    assert (await store.get(board_id)).rebuilding == {band}
            finally:
                await a.db.close()
            request = Request.of({"settlement_id": f"{board_id}-1", "rewards": TABLE})
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                result = await Settler(rebuilder).settle(back, period, request)
                assert result["check"]["drifting"] == [] and result["check"]["shards"] == 3
                want = expected_awards(ref, period, back)
                assert want and await awards_of(rebuilder.db, f"{board_id}-1") == want
                assert await Settler(rebuilder).settle(back, period, request) == result
            back = await store.get(board_id)
            assert await back.paid(back.resolve(period).period) == f"{board_id}-1"
            if marked:
                assert back.rebuilding == {band}
                with pytest.raises(Rebuilding):
                    await back.top(10)
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
            await lost(raw)
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
            await lost(raw)
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


async def test_awards_after_a_restore_of_postgresql_never_reuse_an_idempotency_key(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A period settled and its webhooks delivered, then PostgreSQL restored from a backup taken
    before that settlement (its rows gone, the award ids' sequence back where it was), then another
    period settled. Failed before the fix: the second settlement's awards were given the award ids
    of the first one's, and so its webhooks the Idempotency-Keys the receiver had taken already: a
    receiver dropping repeats by the key, as it must, dropped every one of them, and the game
    server's pages offered ids it had paid. Now no key is used twice."""
    board_id = "recover-keys"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        first, second = day_ago(2), day_ago(3)
        try:
            for period in (first, second):
                await written(board, period, f"{board_id}/{period}")
            await archived(store, raw, url, board_id)
            async with connected(cluster_url, url) as (rebuilder, other):
                db = rebuilder.db
                back = await other.get(board_id)
                await ensure_schema(db)
                seq = "pg_get_serial_sequence('settlement_awards', 'award_id')"
                cur = await db.execute(f"SELECT {seq}")
                name = (await cur.fetchone())[0]  # type: ignore[index]
                cur = await db.execute(f"SELECT last_value, is_called FROM {name}")
                backup = await cur.fetchone()
                with Receiver("s3cret") as receiver:
                    body = {"settlement_id": f"{board_id}-1", "rewards": TABLE, "webhook_url": receiver.url}
                    await Settler(rebuilder).settle(back, first, Request.of(body))
                    await deliver_until_done(db, "s3cret", f"{board_id}-1", deadline_s=60, base_s=0.05)
                    taken = set(receiver.posts)
                    assert taken
                    # The restore: the settlement's rows gone, the sequence as the backup had it.
                    await forgotten(db, f"{board_id}-1")
                    await db.execute(f"SELECT setval({seq}, %s, %s)", tuple(backup))  # type: ignore[arg-type]
                    body = {"settlement_id": f"{board_id}-2", "rewards": TABLE, "webhook_url": receiver.url}
                    await Settler(rebuilder).settle(back, second, Request.of(body))
                    await deliver_until_done(db, "s3cret", f"{board_id}-2", deadline_s=60, base_s=0.05)
                    keys_now = {str(row[0]) for row in await awards_with_ids(db, f"{board_id}-2")}
                    assert keys_now and set(receiver.posts) >= keys_now
                    assert not keys_now & taken
                    # The first settlement run again once nothing refuses it (its record in Redis
                    # gone too: past the period's retention) pays its players under the same keys,
                    # which the receiver drops as repeats.
                    name_first = back.resolve(first).period
                    await raw.delete(*(keys.paid_key(p, name_first) for p in back.prefixes))
                    body = {"settlement_id": f"{board_id}-1", "rewards": TABLE, "webhook_url": receiver.url}
                    await Settler(rebuilder).settle(back, first, Request.of(body))
                    assert {str(row[0]) for row in await awards_with_ids(db, f"{board_id}-1")} == taken
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_two_awards_drawing_one_id_are_drawn_again(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Award ids come from a hash of the settlement and the player: when two draw one id (made
    certain here for the first draw), the transaction rolls back and the ids are drawn again under
    the next salt; the settlement pays the reference's awards, each under its own id."""
    board_id = "recover-clash"
    real = settlement.award_id

    def clashing(settlement_id: str, player_id: str, salt: int = 0, of: Any = ("", "", "")) -> int:
        return real(settlement_id, "" if salt == 0 else player_id, salt, of)

    monkeypatch.setattr(settlement, "award_id", clashing)
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        period = day_ago(2)
        try:
            ref = await written(board, period, board_id)
            await archived(store, raw, url, board_id)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                request = Request.of({"settlement_id": board_id, "rewards": TABLE})
                await Settler(rebuilder).settle(back, period, request)
                want = expected_awards(ref, period, back)
                assert want and await awards_of(rebuilder.db, board_id) == want
                ids = [row[0] for row in await awards_with_ids(rebuilder.db, board_id)]
                assert len(set(ids)) == len(ids) and min(ids) >= settlement.AWARD_ID_FLOOR
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_the_archivers_webhook_sweep_goes_on_while_redis_is_out_of_reach(postgres_url: str) -> None:
    """An award's delivery left due (its router stopped), and `shardlb archive` started while Redis
    cannot be reached (a Redis outage, the archiver's pod restarted meanwhile). Failed before the
    fix: ``serve`` raised RedisClusterUnreachableError at its start (the command exited 1, its pod
    restarting over and over), so the sweep, which needs PostgreSQL alone, sent nothing until Redis
    was back. Now the archiver waits for Redis as it waits for PostgreSQL, the sweep running
    meanwhile: the delivery is made (its first post failed, its retry taken), under its award id."""
    async with own_archive(postgres_url, "settle_recover") as url:
        db = await psycopg.AsyncConnection.connect(url, autocommit=True)
        stack = contextlib.ExitStack()
        try:
            await ensure_schema(db)
            with Receiver(SECRET) as receiver:
                await db.execute(
                    "INSERT INTO settlements (settlement_id, board, incarnation, period, rewards, top_n, "
                    "tie_awards, webhook_url, state) VALUES "
                    "('sweep-1', 'sweep', '0', 'd:2026-11-30', '[]', 10, 'cut', %s, 'settled')",
                    (receiver.url,),
                )
                cur = await db.execute(
                    "INSERT INTO settlement_awards (settlement_id, rank, player_id, points, reward) "
                    "VALUES ('sweep-1', 1, 'p1', 10, 'gold') RETURNING award_id"
                )
                award = (await cur.fetchone())[0]  # type: ignore[index]
                await db.execute(
                    "INSERT INTO settlement_deliveries (award_id, url) VALUES (%s, %s)", (award, receiver.url)
                )
                stop = asyncio.Event()
                logged = stack.enter_context(kept("shardlb.archive"))
                task = asyncio.create_task(
                    archive.serve(NO_REDIS, url, "off", stop, deliver_every_s=0.05, webhook_secret=SECRET)
                )
                for _ in range(600):  # a bound, not a timing: the sweep's retry is due after 1 s
                    if task.done() or receiver.posts.get(str(award), 0) >= 2:
                        break
                    await asyncio.sleep(0.1)
                stop.set()
                await asyncio.wait_for(task, 30)
            assert receiver.posts == {str(award): 2}
            assert [m for m, _ in logged.lines(logging.WARNING)] == ["Redis not reachable yet; retrying"]
        finally:
            stack.close()
            await db.close()


async def test_an_archiver_started_before_redis_archives_once_redis_is_there(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for Redis ends: its first tries meet no cluster, a later one the suite's; the archiver
    then runs and archives a result written meanwhile (each try with a client of its own)."""
    tries: list[str] = []
    real = archive.connect

    def connecting(url: str, **kwargs: Any) -> Any:
        tries.append(url)
        return real(NO_REDIS if len(tries) <= 3 else url, **kwargs)

    monkeypatch.setattr(archive, "connect", connecting)
    monkeypatch.setattr(archive, "retry_pause", lambda failures: 0.01)
    board = await new_board(store, "recover-late-redis")
    try:
        await board.submit([Score("p1", 10, "m1", times.now_ms())])
        async with own_archive(postgres_url, "settle_recover") as url:
            stop = asyncio.Event()
            with kept("shardlb.archive") as logged:
                task = asyncio.create_task(archive.serve(cluster_url, url, "late", stop))
                db = await psycopg.AsyncConnection.connect(url, autocommit=True)
                try:
                    for _ in range(600):  # a bound, not a timing
                        if task.done():
                            break
                        with contextlib.suppress(psycopg.Error):
                            cur = await db.execute(ARCHIVED, ("recover-late-redis",))
                            if (await cur.fetchone())[0]:  # type: ignore[index]
                                break
                        await asyncio.sleep(0.1)
                    stop.set()
                    await asyncio.wait_for(task, 30)
                    cur = await db.execute(ARCHIVED, ("recover-late-redis",))
                    assert (await cur.fetchone())[0] == 1  # type: ignore[index]
                finally:
                    await db.close()
            assert len(tries) >= 4
            assert "Redis reachable" in [m for m, _ in logged.lines(logging.INFO)]
    finally:
        await store.delete(board.config.id)


@pytest.mark.parametrize("stop", ["freeze", "commit"])
async def test_a_board_closed_for_its_season_stays_closed_after_a_shard_lost_alone_is_rebuilt(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, stop: str
) -> None:
    """A season archive (the total's settlement) stopped after its freeze, which closed the board
    for good (``Board.close``), or after its commit (paid, the board not deleted yet); then shard
    1's slot lost alone and `shardlb rebuild BOARD --shard 1`. Failed before the fix: the rebuild
    wrote back the markers of the dated periods' settlements only (``Rebuilder._settled_again``
    skipped the total), so shard 1 lost its close marker for good and took results again (and the
    record of the season's payment), while the other shards refused them."""
    board_id = f"recover-season-{stop}"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        try:
            await written(board, day_ago(2), board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": board_id, "rewards": TABLE})

            def step(name: str) -> None:
                if name == stop:
                    raise Fault(name)

            async with connected(cluster_url, url) as (rebuilder, other):
                with pytest.raises(Fault):
                    settler = Settler(rebuilder, step)
                    await settler.settle(await other.get(board_id), "total", request, season=True)
            assert await slot_wiped(raw, board, 1) > 0
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(board_id), shard=1)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                closed = [bool(await raw.exists(keys.frozen_key(p, "total"))) for p in back.prefixes]
                assert closed == [True] * len(back.prefixes)
                # The run stopped before its record of the payment (``_record_paid``): the rebuilt
                # shard has it from PostgreSQL, the others get it from the run again.
                paid = await raw.get(keys.paid_key(back.prefixes[1], "total"))
                assert paid == (board_id.encode() if stop == "commit" else None)
                late = next(p for p in (f"late{i}" for i in range(100)) if back.layout.home(p) == 1)
                with pytest.raises(BoardClosed):
                    await back.submit([Score(late, 10, "late-m", times.now_ms())])
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_a_season_archive_refused_before_its_close_leaves_a_rebuilt_shard_open(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A season archive refused before its freeze (shard 1 lost alone: Rebuilding, its row left
    ``started``, no shard closed), then `rebuild BOARD --shard 1` as its message says. The rebuild
    writes back the close of a season archive only where it closed the board (another shard closed,
    or the settlement past its check): this board stays open on every shard, not closed on shard 1
    alone for good while the others take results."""
    board_id = "recover-season-refused"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        try:
            await written(board, day_ago(2), board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": board_id, "rewards": TABLE})
            assert await slot_wiped(raw, board, 1) > 0
            async with connected(cluster_url, url) as (rebuilder, other):
                with pytest.raises(Rebuilding):
                    await Settler(rebuilder).settle(await other.get(board_id), "total", request, season=True)
                assert await state_of(rebuilder.db, board_id) == "started"
                await rebuilder.rebuild(await other.get(board_id), shard=1)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                assert not await back.closed()
                late = next(p for p in (f"late{i}" for i in range(100)) if back.layout.home(p) == 1)
                await back.submit([Score(late, 10, "late-m", times.now_ms())])
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_a_season_archive_refused_before_its_close_leaves_a_one_shard_board_open(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The test before on a board of one shard, lost alone: the archive is refused (Rebuilding)
    before its freeze, and `rebuild BOARD --shard 0` has no shard left to tell whether the archive
    closed the board. Failed before the fix: the `started` row closed it
    (``Rebuilder._season_closed``), its writes refused for good; now its row says the run never went
    to its freeze (``freeze_begun`` FALSE), and the board stays open."""
    board_id = "recover-season-refused-one"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id, sharding={"shards": 1})
        try:
            await written(board, day_ago(2), board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": board_id, "rewards": TABLE})
            assert await slot_wiped(raw, board, 0) > 0
            async with connected(cluster_url, url) as (rebuilder, other):
                with pytest.raises(Rebuilding):
                    await Settler(rebuilder).settle(await other.get(board_id), "total", request, season=True)
                assert await state_of(rebuilder.db, board_id) == "started"
                await rebuilder.rebuild(await other.get(board_id), shard=0)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                assert not await back.closed()
                [taken] = await back.submit([Score("late", 10, "late-m", times.now_ms())])
                assert taken.status == "improved" and "total" not in taken.closed
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


@pytest.mark.parametrize(
    "stop", ["refused", "begin", "freeze", "commit", "begin-release-before", "begin-no-column"]
)
async def test_a_season_archive_stopped_before_its_close_leaves_the_board_open_after_a_total_loss(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, stop: str
) -> None:
    """A season archive refused before its freeze (shard 1 lost alone: Rebuilding), or stopped right
    after its first step (the row inserted, ``started``), neither of which closed the board; or
    stopped after its freeze, or after its commit (paid, the board not deleted yet), which did. Then
    every key of Redis lost and `shardlb rebuild --all`. Failed before the fix: ``_restore_board``
    (and the rebuild's ``_settled_again``, no shard being left to tell) closed the board for every
    row of the total, so the two boards live before the loss came back closed, their writes
    refused for good. Now PostgreSQL records when the archive goes to close the board
    (``settlements.freeze_begun``), and only those come back closed. A row of a release before
    (``freeze_begun`` NULL, or an archive without the column) cannot tell, and closes the board as
    then, though this one stopped after ``begin``."""
    board_id = f"recover-season-lost-{stop}"
    before = stop.startswith("begin-")
    stop = stop.split("-")[0]
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        try:
            await written(board, day_ago(2), board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": board_id, "rewards": TABLE})

            def step(name: str) -> None:
                if name == stop:
                    raise Fault(name)

            if stop == "refused":
                assert await slot_wiped(raw, board, 1) > 0
            async with connected(cluster_url, url) as (rebuilder, other):
                with pytest.raises(Rebuilding if stop == "refused" else Fault):
                    settler = Settler(rebuilder, step)
                    await settler.settle(await other.get(board_id), "total", request, season=True)
                state = await state_of(rebuilder.db, board_id)
                assert state == ("settled" if stop == "commit" else "started")
                assert await (await other.get(board_id)).closed() == (stop in ("freeze", "commit"))
                if before:
                    await rebuilder.db.execute("UPDATE settlements SET freeze_begun = NULL")
                if board_id.endswith("no-column"):
                    await rebuilder.db.execute("ALTER TABLE settlements DROP COLUMN freeze_begun")
            await lost(raw)
            await rebuild.run(cluster_url, url, None)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                late = [Score("late", 10, "late-m", times.now_ms())]
                if stop in ("refused", "begin") and not before:
                    assert not await back.closed()
                    [taken] = await back.submit(late)
                    assert taken.status == "improved" and "total" not in taken.closed
                else:
                    assert await back.closed()
                    with pytest.raises(BoardClosed):
                        await back.submit(late)
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


@pytest.mark.parametrize("setting", ["credentials", "no-cluster"])
async def test_an_archiver_whose_redis_settings_are_refused_exits_rather_than_waits(
    cluster_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, setting: str
) -> None:
    """The wait for Redis at the archiver's start is for an outage, not for settings no wait
    repairs: credentials the cluster refuses (a user it does not know), or a seed node that is a
    Redis out of cluster mode, end ``serve`` with the error, as a bad URL does, so `shardlb
    archive` exits 1 and its pod restarts with the Secret as it is now. Failed before the fix: it
    retried for good, logging "Redis not reachable yet; retrying", its liveness probe (the metrics
    server) answering, nothing archived."""
    monkeypatch.setattr(archive, "retry_pause", lambda failures: 0.01)
    with contextlib.ExitStack() as stack:
        if setting == "credentials":
            refused, expected = cluster_url.replace("redis://", "redis://nobody:wrong@"), "username-password"
        else:
            port = free_port()
            server = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            standalone = subprocess.Popen([*server, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
            stack.callback(standalone.wait, 30)
            stack.callback(standalone.terminate)
            refused, expected = f"redis://127.0.0.1:{port}", "Cluster mode is not enabled"
            for _ in range(100):  # a bound: the server listening
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                    break
                await asyncio.sleep(0.05)
        stop = asyncio.Event()
        logged = stack.enter_context(kept("shardlb.archive"))
        task = asyncio.create_task(archive.serve(refused, "postgresql://127.0.0.1:1/x", "refused", stop))
        for _ in range(300):  # a bound, not a timing: tries come every 0.01 s
            if task.done():
                break
            await asyncio.sleep(0.1)
        stop.set()
        with pytest.raises(RedisClusterException) as error:
            await asyncio.wait_for(task, 30)
    assert expected in str(error.value)
    assert "Redis not reachable yet; retrying" not in [m for m, _ in logged.lines(logging.WARNING)]


@contextlib.asynccontextmanager
async def a_role(postgres_url: str, *options: str) -> AsyncIterator[str]:
    """A role made for the test on the suite's PostgreSQL (``options``: LOGIN, NOLOGIN, CONNECTION
    LIMIT 0), dropped after: its name."""
    role = f"refused_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
        await admin.execute(f"CREATE ROLE {role} {' '.join(options)}")
    try:
        yield role
    finally:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
            await admin.execute(f"DROP ROLE IF EXISTS {role}")


def as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}").geturl()


async def served(redis_url: str, postgres_url: str) -> tuple[BaseException | None, Kept]:
    """``serve`` run until it ends (stopped after 300 tries): what it raised, and its log."""
    stop = asyncio.Event()
    with kept("shardlb.archive") as logged:
        task = asyncio.create_task(archive.serve(redis_url, postgres_url, "settings", stop))
        for _ in range(300):  # a bound, not a timing: tries come every 0.01 s
            if task.done():
                break
            await asyncio.sleep(0.1)
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        except Exception as e:  # what the test asserts on
            return e, logged
    return None, logged


@pytest.mark.parametrize("setting", ["no-role", "no-login", "no-database", "no-create", "too-old"])
async def test_an_archiver_whose_postgresql_settings_are_refused_exits_rather_than_waits(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """The wait for PostgreSQL at the archiver's start is for an outage, as the wait for Redis is
    (the test before): a role the server does not know or lets not log in (SQLSTATE class 28,
    invalid authorization: a wrong password is one too), a database that does not exist (3D000),
    a role not allowed to create the archive's tables (42501), a server too old for the schema end
    ``serve`` with the error, so `shardlb archive` exits 1 and its pod restarts with the Secret as
    it is now. Failed before the fix: each was retried for good as "PostgreSQL not reachable yet",
    the pod live and archiving nothing. The server tells the first three at the connection's
    start, where libpq gives psycopg no SQLSTATE (``sqlstate`` is None): its message says it."""
    monkeypatch.setattr(archive, "retry_pause", lambda failures: 0.01)
    async with contextlib.AsyncExitStack() as stack:
        if setting == "no-role":
            url, expected = as_role(postgres_url, f"nobody_{secrets.token_hex(4)}"), "does not exist"
        elif setting == "no-login":
            url = as_role(postgres_url, await stack.enter_async_context(a_role(postgres_url, "NOLOGIN")))
            expected = "is not permitted to log in"
        elif setting == "no-database":
            url = f"{postgres_url.rsplit('/', 1)[0]}/nothing_{secrets.token_hex(4)}"
            expected = "does not exist"
        elif setting == "no-create":  # may connect, may not create a table in schema public
            role = await stack.enter_async_context(a_role(postgres_url, "LOGIN"))
            url = await stack.enter_async_context(own_archive(postgres_url, "settle_refused"))
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
                await admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
            url, expected = as_role(url, role), "permission denied for schema public"
        else:
            monkeypatch.setattr(archive, "MIN_SERVER_VERSION", 99_0000)
            url, expected = postgres_url, "too old"
        error, logged = await served(cluster_url, url)
    assert isinstance(error, psycopg.Error), error
    assert expected in str(error)
    refused = "PostgreSQL refused the archiver's settings; not retried"
    assert [m for m, _ in logged.lines(logging.ERROR)] == [refused]
    assert "PostgreSQL not reachable yet; retrying" not in [m for m, _ in logged.lines(logging.WARNING)]


async def test_an_archiver_whose_role_is_at_its_connection_limit_waits(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that takes no more connections (SQLSTATE 53300, here the role's CONNECTION LIMIT 0)
    is an outage, not a setting refused: the archiver waits, and runs once the limit is lifted (as it
    does through a refused connection, tests/test_archive_outages.py)."""
    monkeypatch.setattr(archive, "retry_pause", lambda failures: 0.01)
    async with (
        a_role(postgres_url, "LOGIN", "CONNECTION LIMIT 0") as role,
        own_archive(postgres_url, "settle_limit") as url,
        await psycopg.AsyncConnection.connect(url, autocommit=True) as admin,
    ):
        await admin.execute(f"ALTER DATABASE {url.rsplit('/', 1)[1]} OWNER TO {role}")
        before = failed_rounds()
        stop = asyncio.Event()
        with kept("shardlb.archive") as logged:
            task = asyncio.create_task(archive.serve(cluster_url, as_role(url, role), "limit", stop))
            for _ in range(300):  # a bound, not a timing: tries come every 0.01 s
                if task.done() or failed_rounds() - before >= 3:
                    break
                await asyncio.sleep(0.1)
            await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT -1")
            for _ in range(300):  # a bound, not a timing
                if task.done() or "archiver running" in [m for m, _ in logged.lines(logging.INFO)]:
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.wait_for(task, 30)
    warnings = logged.lines(logging.WARNING)
    assert warnings and all(m == "PostgreSQL not reachable yet; retrying" for m, _ in warnings)
    assert "too many connections" in warnings[0][1]["error"]
    assert "archiver running" in [m for m, _ in logged.lines(logging.INFO)]
    assert not logged.lines(logging.ERROR)


async def test_a_one_shard_board_closed_for_its_season_stays_closed_after_its_shard_is_rebuilt(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A season archive stopped after its freeze, on a board of one shard, whose slot is then lost
    alone and rebuilt: no shard is left to say whether the archive closed the board, and its close
    comes back, as after a total loss (its row is `started` either way)."""
    board_id = "recover-season-one"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id, sharding={"shards": 1})
        try:
            await written(board, day_ago(2), board_id)
            await archived(store, raw, url, board_id)
            request = Request.of({"settlement_id": board_id, "rewards": TABLE})

            def step(name: str) -> None:
                if name == "freeze":
                    raise Fault(name)

            async with connected(cluster_url, url) as (rebuilder, other):
                with pytest.raises(Fault):
                    settler = Settler(rebuilder, step)
                    await settler.settle(await other.get(board_id), "total", request, season=True)
            assert await slot_wiped(raw, board, 0) > 0
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(board_id), shard=0)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get(board_id)
                assert await back.closed()
                with pytest.raises(BoardClosed):
                    await back.submit([Score("late", 10, "late-m", times.now_ms())])
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_an_archiver_waiting_for_redis_at_its_start_counts_failed_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While it waits for Redis at its start, the archiver's pod is live and ready (the probes ask
    its metrics server) and its lag gauges read 0 (no journal read yet): each failed try counts in
    ``shardlb_archive_failed_rounds_total``, the counter the runbook alerts on when it rises (k8s/
    README.md), as a round that fails once it runs does. Failed before the fix: the counter stayed
    where it was for as long as the wait lasted, and nothing in the metrics told the archiver had
    not started (the restarts that said so before the wait came are gone)."""
    monkeypatch.setattr(archive, "retry_pause", lambda failures: 0.01)
    before = failed_rounds()
    stop = asyncio.Event()
    with kept("shardlb.archive"):
        task = asyncio.create_task(archive.serve(NO_REDIS, "postgresql://127.0.0.1:1/x", "waiting", stop))
        for _ in range(300):  # a bound, not a timing: tries come every 0.01 s
            if task.done() or failed_rounds() - before >= 3:
                break
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 30)
    assert failed_rounds() - before >= 3


async def test_a_settlement_id_used_again_for_another_period_after_a_restore_draws_other_keys(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A settlement paid and delivered, then PostgreSQL restored from a backup taken before it (its
    rows gone, its id free again), then its id used for another period of the board (a game server
    whose own records were restored too counts its ids again), the same players winning. Failed
    before the fix: the award ids, drawn from the settlement id and the player alone, were the
    first payment's, so a receiver dropping repeats by the Idempotency-Key dropped every webhook
    of the new period's payment. Now the board, its incarnation and the period are drawn from too."""
    board_id = "recover-reused-id"
    async with own_archive(postgres_url, "settle_recover") as url:
        board = await new_board(store, board_id)
        first, second = day_ago(2), day_ago(3)
        try:
            for period in (first, second):  # five players, every one of them a winner
                await written(board, period, f"{board_id}/{period}", players=5, results=60)
            await archived(store, raw, url, board_id)
            async with connected(cluster_url, url) as (rebuilder, other):
                db = rebuilder.db
                back = await other.get(board_id)
                with Receiver(SECRET) as receiver:
                    body = {"settlement_id": f"{board_id}-1", "rewards": TABLE, "webhook_url": receiver.url}
                    for period in (first, second):
                        await Settler(rebuilder).settle(back, period, Request.of(body))
                        await deliver_until_done(db, SECRET, f"{board_id}-1", deadline_s=60, base_s=0.05)
                        paid = {str(row[0]) for row in await awards_with_ids(db, f"{board_id}-1")}
                        if period == first:
                            taken = paid
                            await forgotten(db, f"{board_id}-1")  # the restore
                    assert taken and paid and set(receiver.posts) >= taken | paid
                    assert not paid & taken
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_the_archivers_wait_for_redis_logs_what_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait's warning (``Outage``) names the failure, not only its class: redis-py 8 gives its
    errors a repr of their kind and class alone ("server:RedisClusterUnreachableError"), so until the fix
    the log an operator is told to watch while an archiver waits said nothing of the nodes tried or
    why they failed (a refused connection, a timeout, a name that does not resolve)."""
    monkeypatch.setattr(archive, "retry_pause", lambda failures: 0.01)
    stop = asyncio.Event()
    with kept("shardlb.archive") as logged:
        task = asyncio.create_task(archive.serve(NO_REDIS, "postgresql://127.0.0.1:1/x", "waiting", stop))
        for _ in range(300):  # a bound, not a timing
            if task.done() or logged.lines(logging.WARNING):
                break
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 30)
    (message, fields), *_ = logged.lines(logging.WARNING)
    assert message == "Redis not reachable yet; retrying"
    assert "RedisClusterUnreachableError" in fields["error"] and "127.0.0.1:1" in fields["error"], fields
