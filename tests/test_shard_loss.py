"""A PARTIAL loss of Redis: one shard's slot lost every key (a master and its replica lost at once,
`redis-cli --cluster fix --cluster-fix-with-unreachable-masters` serving the slot again, empty) while
the registry, on another master, kept the board (``slot_wiped``: that one slot; the last tests flush
a whole master, with the registry's or the ban list's slot). The shard's sentinel
(keys.sentinel_key) went with it: the archiver's next round finds it missing and marks the shard
not rebuilt, so reads that merge it and writes to it are refused (503 ``board_rebuilding``) until
`shardlb rebuild BOARD --shard N` brings it back from PostgreSQL and its journal. A board of the
release before (no sentinels) is never marked."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY
from redis.exceptions import RedisError

from router import reshards
from router.errors import MESSAGE_MAX
from shardlb import fanout, keys, moderation, rebuild, times
from shardlb.board import Board, Score, band_shards
from shardlb.board import rebuilding as rebuilding_error
from shardlb.cli import main
from shardlb.config import ID_MAX, BoardConfig
from shardlb.errors import BoardConflict, NotAcknowledged, Rebuilding
from shardlb.rebuild import connected
from shardlb.reshard import Resharder, ShardsLost
from shardlb.reshard_check import Mismatch
from shardlb.store import BoardStore, _marked
from tests.router_support import AS_ADMIN, AS_WRITER, running, service_of
from tests.test_board import expected_entries, sharding
from tests.test_rebuild import OnlyStore, archive_round, archiver, drain, own_archive
from tests.test_rebuild_window import _refused, reference, written

pytestmark = pytest.mark.cluster


async def slot_wiped(raw: Any, board: Board, shard: int) -> int:
    """A PARTIAL loss: every key of the shard's slot that is the board's (its shard set, journal,
    dedup, index, sentinel...) and the slot's ack marker deleted, as a slot served again empty has
    none. Left, on purpose: the keys other modules' boards may have in that slot, and every other
    slot of the master that serves it, which a master lost with its replica takes too (on the
    suite's 3 masters shard 1 of 3 shares its master with the registry's slot, 7553, and shard 0
    with the ban list's, 345 and 3298: the tests ending this module flush a whole master). Returns
    how many went."""
    prefix = board.prefixes[shard]
    await raw.initialize()  # a no-op once the client knows the slots
    node = raw.get_node_from_key(prefix)
    slot = keys.slot_of(prefix)
    found = await raw.execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000, target_nodes=node)
    names = [k.decode() if isinstance(k, bytes) else k for k in found]
    ours = [k for k in names if k.startswith(prefix) or k == keys.ack_key(keys.slot_of(prefix))]
    if ours:
        await raw.delete(*ours)
    return len(ours)


async def forget_others_lost(store: BoardStore) -> None:
    """After a test flushed one master: the boards other modules left on the worker's cluster lost
    the shards that master served (their sentinels too) while the registry, if another master kept
    it, still names them. Each is deleted (its keys left on the other masters with it), so no later
    module's archiver on the suite's database marks them lost or rebuilds them."""
    for board in await store.boards():
        with contextlib.suppress(Exception):
            await store.delete(board.config.id, board.incarnation)


async def board_written(store: BoardStore, board_id: str, **more: Any) -> tuple[Board, list[Score]]:
    config = BoardConfig.from_dict(board_id, {"mode": "best", "sharding": sharding("hash", 3), **more})
    board, _ = await store.create(config)
    scores = [Score(f"p{i}", 100 + 10 * i, f"m{i}", times.now_ms() - 1000) for i in range(30)]
    await board.submit(scores)
    return board, scores


async def test_a_shard_lost_alone_is_marked_within_one_archiver_round_and_rebuilt(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Failed before the change: after the wipe the top answered 20 of 30 players (no error), a best
    write answered ``improved`` below the player's real best, and nothing was marked. Now one
    archiver round marks the shard, reads and writes are refused (in the library and as 503 through
    the router), and `rebuild BOARD --shard 1` clears it: reads and writes agree with the reference."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-best")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-best"}), url)
            try:
                await drain(a)
                assert await slot_wiped(raw, board, 1) > 0
                on_lost = [s for s in sent if board.layout.home(s.player_id) == 1]
                await a.refresh()
                await archive_round(a)
                back = await store.get("partial-best")
                assert back.rebuilding == {1}
                with pytest.raises(Rebuilding):
                    await back.top(10)
                with pytest.raises(Rebuilding):
                    await back.player(on_lost[0].player_id)
                with pytest.raises(Rebuilding):
                    await back.submit([Score(on_lost[0].player_id, 1, "late-1", times.now_ms())])
                top, post = "/v1/boards/partial-best/top?limit=5", "/v1/boards/partial-best/scores"
                async with running(cluster_url) as (_, client):
                    _refused(await client.get(top))
                    late = {"player_id": on_lost[0].player_id, "points": 1, "match_id": "late-2"}
                    body = {"scores": [late]}
                    _refused(await client.post(post, json=body, headers=AS_WRITER))
                # Marked once: the next rounds find it marked already and change nothing.
                await a.refresh()
                await archive_round(a)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get("partial-best"), shard=1)
                back = await store.get("partial-best")
                assert not back.rebuilding
                assert await raw.exists(keys.sentinel_key(back.prefixes[1]))
                again = Score(on_lost[0].player_id, 1, "late-3", times.now_ms())
                [result] = await back.submit([again])
                assert result.points == on_lost[0].points
                want = expected_entries(reference(back, [*sent, again]), "total", None)
                assert await back.top(50) == want
                # The rebuild wrote the sentinel again: the archiver leaves the board be.
                await a.refresh()
                await archive_round(a)
                assert not (await store.get("partial-best")).rebuilding
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-best")


async def test_a_board_of_the_release_before_is_never_marked(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A board created before sentinels (no flag in its record, no sentinel on its shards) is left
    as it was: the archiver cannot tell its shards from lost ones, and marks none. A whole rebuild
    of it gives it its sentinels (the way a board of before gets them)."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-old")
            raw_record = await raw.hget(keys.BOARDS, "partial-old")
            record = orjson.loads(raw_record)
            assert record.get("state") == {"sentinels": 0}
            before = {k: v for k, v in record.items() if k != "state"}  # as the release before wrote it
            assert await store.swap("partial-old", raw_record, orjson.dumps(before))
            await raw.delete(*(keys.sentinel_key(p) for p in board.prefixes))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-old"}), url)
            try:
                for _ in range(3):
                    await a.refresh()
                    await archive_round(a)
                    await asyncio.sleep(0.01)
                back = await store.get("partial-old")
                assert not back.rebuilding and not back.sentinels
                assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
                # A whole rebuild gives every shard its sentinel, and the record says so from then
                # on: a shard lost after it is marked.
                await drain(a)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get("partial-old"))
                back = await store.get("partial-old")
                assert back.sentinels and not back.rebuilding
                await slot_wiped(raw, back, 2)
                await a.refresh()
                await archive_round(a)
                assert (await store.get("partial-old")).rebuilding == {2}
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-old")


async def test_a_reshard_gives_the_new_layout_its_sentinels_and_the_record_its_generation(
    store: BoardStore, raw: Any
) -> None:
    """The new layout's shards carry sentinels from the commit on, the record names the new
    generation, and the old layout's sentinels go with its keys (the new one's with the board)."""
    try:
        # durability memory: a journaled board's reshard moves its archive too (PostgreSQL)
        board, sent = await board_written(store, "partial-reshard", durability="memory")
        assert all([await raw.exists(keys.sentinel_key(p)) for p in board.prefixes])
        mover = Resharder(store, "partial-reshard", say=lambda _: None, cache_s=0)
        await mover.start(5)
        await mover.run()
        back = await store.get("partial-reshard")
        record = orjson.loads(await raw.hget(keys.BOARDS, "partial-reshard"))
        assert back.generation == 1 and record["state"]["sentinels"] == 1
        assert all([await raw.exists(keys.sentinel_key(p)) for p in back.prefixes])
        assert not back.sentinels  # a memory board: held to none (the record says they are there)
        assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
    finally:
        with contextlib.suppress(Exception):
            await store.delete("partial-reshard")
    assert not any([await raw.exists(keys.sentinel_key(p)) for p in [*board.prefixes, *back.prefixes]])


async def test_a_write_to_a_lost_shard_is_refused_before_the_archiver_marks_it(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """write.lua checks the shard's sentinel (in the MGET of its markers) on a board whose record
    says its shards carry them: a write to a shard lost since is refused (Rebuilding, nothing
    written) before any archiver round, and the Board that met the refusal refuses its reads of
    that shard too. Failed before: the write answered ``improved`` with 1 point (the player's best
    is higher) and was applied to the empty shard."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-write")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-write"}), url)
            try:
                await drain(a)
            finally:
                await a.db.close()
            await slot_wiped(raw, board, 1)
            on_lost = [s for s in sent if board.layout.home(s.player_id) == 1]
            kept = [s for s in sent if board.layout.home(s.player_id) != 1]
            with pytest.raises(Rebuilding):
                await board.submit([Score(on_lost[0].player_id, 1, "late-1", times.now_ms())])
            assert not await raw.exists(keys.period_key(board.prefixes[1], "total"))
            assert board.rebuilding == {1}
            with pytest.raises(Rebuilding):
                await board.top(10)
            # Other shards take writes as ever.
            [result] = await board.submit([Score(kept[0].player_id, 1, "late-2", times.now_ms())])
            assert result.points == kept[0].points
            # Through a router (its coalesced write path): 503 board_rebuilding, nothing written.
            async with running(cluster_url) as (_, client):
                late = {"player_id": on_lost[1].player_id, "points": 1, "match_id": "late-3"}
                answer = await client.post(
                    "/v1/boards/partial-write/scores", json={"scores": [late]}, headers=AS_WRITER
                )
                _refused(answer)
            assert not await raw.exists(keys.period_key(board.prefixes[1], "total"))
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-write")


@pytest.mark.parametrize("lost", [4, 1], ids=["band-shard", "home-shard"])
async def test_a_band_boards_shard_lost_alone_is_marked_and_rebuilt(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    lost: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A band board (3 home shards, band shards 3-6): a band shard lost alone is marked, its top
    refused, and `rebuild BOARD --shard 4` rebuilds the band shards from the homes and takes it
    off; a home shard lost alone is marked, and `--shard 1` rebuilds it (and the band shards) and
    takes it off. Reads then agree with the reference. The archiver's ERROR and the refusal say
    where the rebuild takes the shard from: a band shard from the home shards (until 2026-12-06
    both said "from PostgreSQL and the journal", which a band shard's rebuild never reads)."""
    board_id = f"partial-band-{lost}"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, board_id, sharding=sharding("band", 3))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {board_id}), url)
            logger = logging.getLogger("shardlb.archive")
            try:
                await drain(a)
                await slot_wiped(raw, board, lost)
                await a.refresh()
                logger.addHandler(caplog.handler)
                try:
                    await archive_round(a)
                finally:
                    logger.removeHandler(caplog.handler)
                back = await store.get(board_id)
                assert back.rebuilding == {lost}
                # What brings it back, said truly: a band shard's rebuild reads the home shards only.
                [error] = {r.getMessage() for r in caplog.records if r.levelno == logging.ERROR}
                assert f"`shardlb rebuild {board_id} --shard {lost}` brings it back from" in error
                assert ("PostgreSQL" in error) == (lost < 3) and ("home shards" in error) == (lost >= 3)
                if lost >= 3:
                    with pytest.raises(Rebuilding) as refused:
                        await back.top(10)
                    told = refused.value.message
                    assert "brings it back from the home shards" in told and "PostgreSQL" not in told, told
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get(board_id), shard=lost)
                back = await store.get(board_id)
                assert not back.rebuilding
                assert all([await raw.exists(keys.sentinel_key(p)) for p in back.prefixes])
                assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
                await a.refresh()
                await archive_round(a)
                assert not (await store.get(board_id)).rebuilding
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


@pytest.mark.parametrize("during", ["rest", "copying"])
async def test_a_band_write_moving_a_player_into_a_lost_band_shard_is_answered_exactly(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, during: str
) -> None:
    """band.lua looks at no sentinel: a write that moves a player into a band shard lost alone is
    applied there (the band shard's row, its version) as on any band shard. The answer is still
    exact: it is write.lua's, on the player's home shard, whose sentinel it checks; the band shards
    only index the total, and are made again from the homes' totals (``Rebuilder.rebuild_bands``,
    a reshard building its new bands the same way). So at rest the band shard is marked at the
    archiver's round (it holds the row band.lua wrote: not taken for empty), refused, and its
    rebuild gives the reference's top; during a reshard the new layout commits with the write in
    it. A pinning test (it held when written, 2026-12-06)."""
    board_id = f"partial-band-write-{during}"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, board_id, sharding=sharding("band", 3))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {board_id}), url)
            try:
                await drain(a)
                mover = Resharder(store, board_id, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=5)
                if during == "copying":
                    await mover.start(5)
                p1 = next(s for s in sent if s.player_id == "p1")  # 110 points: the band from 40
                late = Score("p1", 200, "late-1", times.now_ms())  # into the band from 120
                into = board.layout.band_shard(200)
                assert into != board.layout.band_shard(p1.points) and into in band_shards(board)
                assert await slot_wiped(raw, board, into) > 0
                [result] = await (await store.get(board_id)).submit([late])
                assert (result.status, result.points) == ("improved", 200)
                want = expected_entries(reference(board, [*sent, late]), "total", None)
                if during == "copying":
                    await drain(a)
                    assert (await mover.run())["state"] == "none"
                    assert await (await store.get(board_id)).top(50) == want
                    return
                await a.refresh()
                await archive_round(a)
                back = await store.get(board_id)
                assert back.rebuilding == {into}
                with pytest.raises(Rebuilding):
                    await back.top(10)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get(board_id), shard=into)
                assert await (await store.get(board_id)).top(50) == want
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


def test_a_refusal_says_where_the_rebuild_takes_each_shard_from() -> None:
    """``board.rebuilding``: home shards come back from PostgreSQL and the journal, band shards from
    the home shards (``Rebuilder.rebuild_bands``); a refusal naming both says both."""
    homes = rebuilding_error("b", [1], "x", bands=range(3, 7)).message
    assert "brings it back from PostgreSQL and the journal" in homes and "home shards" not in homes
    bands = rebuilding_error("b", [4, 5], "x", bands=range(3, 7)).message
    assert "brings them back from the home shards" in bands and "PostgreSQL" not in bands
    both = rebuilding_error("b", [1, 4], "x", bands=range(3, 7)).message
    assert "brings them back (shard 1 from PostgreSQL and the journal, shard 4 from the home shards)" in both
    assert "from PostgreSQL and the journal" in rebuilding_error("b", [0, 1], "x").message


# The texts each caller of ``board.rebuilding`` gives as what to do (``then``), the longest of each.
THENS = (
    "this removal would not be exact. Nothing was written; retry later",  # Board.check_built
    "this write would not be exact. Nothing was written; retry later",  # write.lua's SHARDLOST
    "nothing was paid; settle again once they are rebuilt",  # Settler._at_rest
    "reconcile it once they are rebuilt",  # Rebuilder.check_layout
    "reshard it once they are rebuilt",  # Resharder.start
)
LONGEST_ID = "L" * ID_MAX


@pytest.mark.parametrize(
    ("lost", "bands"),
    [
        ([1], ()),
        ([1023], ()),
        ([0, 1, 2], ()),
        ([1000, 1001, 1019], ()),
        ([4, 5, 6], range(3, 7)),
        ([1, 4, 5], range(3, 7)),
        ([1000, 1001, 1019], range(1010, 1024)),
        (list(range(0, 1024, 3)), ()),
    ],
)
def test_every_refusal_for_shards_not_rebuilt_fits_the_routers_message(lost: list[int], bands: range) -> None:
    """``board.rebuilding`` for the longest board id ``check_id`` allows, one shard, three and many:
    at most ``router.errors.MESSAGE_MAX`` characters (the router cuts a message there), naming the
    exact command and ending with what the caller does. Failed before the fix: some 350-450
    characters (the board id twice), so a 503 body lost "Nothing was written; retry later" or the
    command."""
    for then in THENS:
        message = rebuilding_error(LONGEST_ID, lost, then, bands).message
        assert len(message) <= MESSAGE_MAX, (len(message), message)
        run = f"`shardlb rebuild {LONGEST_ID}" + (f" --shard {lost[0]}`" if len(lost) == 1 else "`")
        assert run in message and message.count(LONGEST_ID) == 1, message
        assert then in message, message
        if len(lost) <= 3:
            assert all(str(s) in message for s in lost), message
        # During a reshard, which refuses every rebuild, the command is the resume that ends it.
        during = rebuilding_error(LONGEST_ID, lost, then, bands, resharding=True).message
        assert len(during) <= MESSAGE_MAX, (len(during), during)
        assert f"`shardlb reshard {LONGEST_ID} --resume`" in during and then in during, during
        assert "shardlb rebuild" not in during, during


@pytest.mark.parametrize("lost", [[1], [0, 1, 2]], ids=["one", "three"])
async def test_a_routers_refusal_for_the_longest_board_id_is_the_librarys_whole_message(
    store: BoardStore, cluster_url: str, lost: list[int]
) -> None:
    """A board of the longest id, shards marked not rebuilt: the router's 503 body for a read and a
    write is the library's message, not cut, and names the command to run. Failed before the fix:
    the body was cut at 300 characters (``...…``), its tail (the command's end or "Nothing was
    written; retry later") lost."""
    board_id = "x" * ID_MAX
    _, sent = await board_written(store, board_id)
    try:
        raw = await store.client.hget(keys.BOARDS, board_id)
        assert await store.swap(board_id, raw, orjson.dumps(_marked(orjson.loads(raw), set(lost))))
        back = await store.get(board_id)
        assert back.rebuilding == set(lost)
        on_lost = next(s for s in sent if back.layout.home(s.player_id) == lost[0])
        with pytest.raises(Rebuilding) as read:
            await back.top(5)
        with pytest.raises(Rebuilding) as write:
            await back.submit([Score(on_lost.player_id, 1, "late-1", times.now_ms())])
        async with running(cluster_url) as (_, client):
            answer = await client.get(f"/v1/boards/{board_id}/top?limit=5")
            _refused(answer)
            assert answer.json()["error"]["message"] == read.value.message
            late = {"player_id": on_lost.player_id, "points": 1, "match_id": "late-2"}
            post = f"/v1/boards/{board_id}/scores"
            answer = await client.post(post, json={"scores": [late]}, headers=AS_WRITER)
            _refused(answer)
            assert answer.json()["error"]["message"] == write.value.message
        # The read merges every shard: the marked ones; the write touches one shard: that one.
        for message, named in ((read.value.message, lost), (write.value.message, [lost[0]])):
            run = f"`shardlb rebuild {board_id}" + (f" --shard {named[0]}`" if len(named) == 1 else "`")
            assert run in message and "Nothing was written; retry later" in message, message
            assert len(message) <= MESSAGE_MAX, (len(message), message)
    finally:
        with contextlib.suppress(Exception):
            await store.delete(board_id)


async def test_a_board_rebuilt_after_a_total_loss_carries_its_sentinels(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """`rebuild --all` after a total loss: the restored record says the layout carries sentinels,
    each swap writes its shard's, and once the board is rebuilt a shard lost alone is marked."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            sent = await written(store, raw, url, "partial-total", "best")
            assert list(await rebuild.run(cluster_url, url, None)) == ["partial-total"]
            back = await store.get("partial-total")
            assert not back.rebuilding and back.sentinels
            assert all([await raw.exists(keys.sentinel_key(p)) for p in back.prefixes])
            assert await back.top(20) == expected_entries(reference(back, sent), "total", None)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-total"}), url)
            try:
                await archive_round(a)
                assert not (await store.get("partial-total")).rebuilding
                await slot_wiped(raw, back, 0)
                await a.refresh()
                await archive_round(a)
                assert (await store.get("partial-total")).rebuilding == {0}
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-total")


async def test_a_memory_boards_shard_lost_alone_takes_writes_as_before(store: BoardStore, raw: Any) -> None:
    """A board of `durability: memory` keeps no journal: nothing could rebuild a shard it lost, so
    neither write.lua nor the archiver holds its shards to their sentinels (a refusal could never be
    lifted). Failed before the fix: its writes to the lost shard were refused (Rebuilding) for good."""
    try:
        board, sent = await board_written(store, "partial-memory", durability="memory")
        await slot_wiped(raw, board, 1)
        back = await store.get("partial-memory")
        assert not back.sentinels
        player = next(s.player_id for s in sent if board.layout.home(s.player_id) == 1)
        [result] = await back.submit([Score(player, 1, "late-1", times.now_ms())])
        assert result.points == 1  # the shard starts again empty, as memory boards do
    finally:
        with contextlib.suppress(Exception):
            await store.delete("partial-memory")


@contextlib.asynccontextmanager
async def slot_open(raw: Any, key: str) -> AsyncIterator[Any]:
    """The slot of ``key`` open as a move opens it (``CLUSTER SETSLOT ... MIGRATING`` on its master,
    ``IMPORTING`` on another; shardlb/slots.py) with no key moved yet, and made stable again after."""
    await raw.initialize()
    slot = keys.slot_of(key)
    source = raw.get_node_from_key(key)
    target = next(n for n in raw.get_primaries() if n.name != source.name)
    ids = [await raw.execute_command("CLUSTER MYID", target_nodes=n) for n in (source, target)]
    source_id, target_id = (i.decode() if isinstance(i, bytes) else i for i in ids)
    await raw.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id, target_nodes=target)
    await raw.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id, target_nodes=source)
    try:
        yield source, target
    finally:
        for node in (source, target):
            await raw.execute_command("CLUSTER SETSLOT", slot, "STABLE", target_nodes=node)


async def test_an_open_slot_leaves_the_archiver_reading_a_board_without_sentinels(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A board of the release before has no sentinel: poll.lua named the missing key beside its
    journal all the same, and while a move of their slot was open (`shardlb cluster rebalance`,
    `add-node`, `remove-node`) Redis answered every read of that journal TRYAGAIN (a command naming
    keys of an open slot, some there and some not): each archiver round failed until the slot was
    closed. Failed before the fix: ClusterError "TTL exhausted." (TRYAGAIN every time) from the round."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-open")
            raw_record = await raw.hget(keys.BOARDS, "partial-open")
            before = {k: v for k, v in orjson.loads(raw_record).items() if k != "state"}
            assert await store.swap("partial-open", raw_record, orjson.dumps(before))
            await raw.delete(*(keys.sentinel_key(p) for p in board.prefixes))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-open"}), url)
            try:
                async with slot_open(raw, keys.journal_key(board.prefixes[1])):
                    archived = await drain(a)
                assert archived == len(sent)
                assert not (await store.get("partial-open")).rebuilding
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-open")


async def test_a_reshard_refuses_to_commit_a_shard_the_old_layout_lost(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A shard lost alone while its board is resharded: the archiver leaves a board whose record
    names a reshard, and the mover copied the empty shard, found the new layout holding what the old
    one held, gave the new layout its sentinels and committed: the shard's players were gone for good,
    the loss never marked. Failed before: DID NOT RAISE, the board committed on 5 shards with 19 of 30
    players. Now the cut-over is refused and the reshard cancelled (the new layout dropped): the
    board keeps its layout, whose shard is held to its sentinel again (a write there refused), and
    the cancel marks the shard not rebuilt at once, so a read that merges it is refused (503
    ``board_rebuilding`` naming the rebuild), library and router. Failed before (2026-12-06): no
    mark until the archiver's next round, the top answered from the two shards left meanwhile."""
    name = "partial-reshard-lost"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, name)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)  # shard 1's results archived: its rebuild brings them back
            finally:
                await a.db.close()
            on_lost = [s for s in sent if board.layout.home(s.player_id) == 1]
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            await slot_wiped(raw, board, 1)
            with pytest.raises(Mismatch, match="shard 1 of the old layout lost its keys"):
                await mover.run()
            record = orjson.loads(await raw.hget(keys.BOARDS, name))
            assert int(record.get("generation", 0)) == 0 and "reshard" not in record
            back = await store.get(name)
            assert back.generation == 0 and back.sentinels
            assert back.rebuilding == {1}
            with pytest.raises(Rebuilding, match=f"`shardlb rebuild {name} --shard 1`"):
                await back.top(10)
            with pytest.raises(Rebuilding):
                await back.submit([Score(on_lost[0].player_id, 1, "late-1", times.now_ms())])
            async with running(cluster_url) as (_, client):
                answer = await client.get(f"/v1/boards/{name}/top?limit=5")
                _refused(answer)
                assert f"`shardlb rebuild {name} --shard 1`" in answer.json()["error"]["message"], answer.text
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_reshard_of_a_band_board_commits_though_a_band_shard_of_the_old_layout_lost_its_keys(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A band shard (not a home shard) of the old layout lost alone while the board is resharded: a
    reshard never copies a band shard (``copied_shards``: the new layout's bands are built from the
    home shards' totals), so nothing of the board was lost to the copy and the reshard commits, the
    new layout holding every player. Failed before: Mismatch "shard 4 of the old layout lost its
    keys", the reshard cancelled and the operator sent to a rebuild the reshard never needed."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-reshard-band", sharding=sharding("band", 3))
            mover = Resharder(
                store, "partial-reshard-band", say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0
            )
            await mover.start(5)
            assert await slot_wiped(raw, board, 4)
            await mover.run()
            back = await store.get("partial-reshard-band")
            record = orjson.loads(await raw.hget(keys.BOARDS, "partial-reshard-band"))
            assert back.generation == 1 and back.layout.strategy == "hash" and not back.rebuilding
            assert record["reshard"]["state"] == "committed" and record["state"]["sentinels"] == 1
            assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-reshard-band")


@pytest.mark.parametrize("lost", [4, 1], ids=["band-shard", "home-shard"])
async def test_a_band_board_whose_only_marked_shards_are_bands_is_resharded_its_bands_built_from_the_homes(
    store: BoardStore, raw: Any, postgres_url: str, lost: int
) -> None:
    """A band board (home shards 0-2, band shards 3-6) whose band shard 4 the archiver marked not
    rebuilt: a reshard copies the home shards alone and builds the new layout's bands from their
    totals (``copied_shards``), so it starts and commits, the old layout's mark not carried into the
    new layout's record (there, shard 4 is another, whole shard), and the new layout's reads are the
    reference's. A home shard marked still refuses the start (its players would be copied empty).
    Failed before the fix: Rebuilding at ``start`` for the band shard ("reshard it once it is
    rebuilt"), though the rebuild it asked for builds nothing the reshard reads."""
    name = f"partial-band-mark-{lost}"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, name, sharding=sharding("band", 3))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
                assert await slot_wiped(raw, board, lost)
                await a.refresh()
                await archive_round(a)
                assert (await store.get(name)).rebuilding == {lost}
            finally:
                await a.db.close()
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            if lost < 3:
                with pytest.raises(Rebuilding) as refused:
                    await mover.start(3, bands=[0, 100, 250])
                assert f"`shardlb rebuild {name} --shard 1`" in refused.value.message
                assert not orjson.loads(await raw.hget(keys.BOARDS, name)).get("reshard")
                return
            await mover.start(3, bands=[0, 100, 250])
            await mover.run()
            record = orjson.loads(await raw.hget(keys.BOARDS, name))
            assert record.get("reshard", {}).get("state", "committed") == "committed", record
            assert record["state"] == {"sentinels": 1}, record["state"]  # no "rebuilding": [4]
            back = await store.get(name)
            assert back.generation == 1 and back.layout.strategy == "band" and not back.rebuilding
            assert back.config.sharding.bands == (0, 100, 250)
            assert all([await raw.exists(keys.sentinel_key(p)) for p in back.prefixes])
            want = expected_entries(reference(back, sent), "total", None)
            assert await back.top(50) == want
            for entry in want[::7]:  # a player's rank counts the band shards above his
                assert (await back.player(entry.player_id)).entry == entry
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_routers_mover_cancelling_for_a_lost_shard_logs_one_line_naming_the_command(
    store: BoardStore, raw: Any, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A router's mover (router/reshards.py) whose reshard is cancelled because a shard of the old
    layout lost its keys: one ERROR line, no traceback, naming the board, the shard and the command
    to run, and no retry. Failed before: "reshard stopped" logged with the Mismatch's traceback,
    then a second try that found the reshard over ("reshard over before this mover took it")."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, _ = await board_written(store, "partial-reshard-log")
            mover = Resharder(
                store, "partial-reshard-log", say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0
            )
            await mover.start(5)
            await slot_wiped(raw, board, 1)
            logger = logging.getLogger("shardlb")  # where the router's handler is (router/logs.py)
            logger.addHandler(caplog.handler)
            caplog.set_level(logging.INFO, logger="shardlb.router")
            try:
                await reshards._move(mover, wait=True)
            finally:
                logger.removeHandler(caplog.handler)
            # Each record once: caplog's own handler may see it too, when the logger propagates.
            ours = list({id(r): r for r in caplog.records if r.name == "shardlb.router"}.values())
            assert len(ours) == 1, [r.getMessage() for r in ours]
            [line] = ours
            assert line.levelno == logging.ERROR and line.exc_info is None
            text = line.getMessage()
            assert "\n" not in text
            assert "shard 1" in text and "`shardlb rebuild partial-reshard-log --shard 1`" in text
            assert line.fields["board"] == "partial-reshard-log" and line.fields["shards"] == [1]  # type: ignore[attr-defined]
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-reshard-log")


def bettered(score: Score, match: str) -> Score:
    """A result of ``score``'s player one point above it, now."""
    return Score(score.player_id, score.points + 1, match, times.now_ms())


async def shard_keys(raw: Any, prefix: str) -> list[str]:
    """Every key of one shard (its prefix) in its slot, expired or not: what a reshard left there."""
    await raw.initialize()
    node = raw.get_node_from_key(prefix)
    slot = keys.slot_of(prefix)
    found = await raw.execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000, target_nodes=node)
    names = [k.decode() if isinstance(k, bytes) else k for k in found]
    return sorted([k for k in names if k.startswith(prefix) and await raw.exists(k)])


async def reshard_left(raw: Any, store: BoardStore, board: Board, shards: int) -> list[str]:
    """What a reshard of ``board`` to ``shards`` hash shards left: the old layout's reshard keys
    (fence, `mv` marker, seal, tracked changes) and any key of the new layout's shards."""
    settings = {**board.config.to_dict(), "sharding": sharding("hash", shards)}
    config = BoardConfig.from_dict(board.config.id, settings)
    target = store.layout(config, board.incarnation, board.generation + 1)
    names = (keys.fence_key, keys.move_key, keys.seal_key, keys.changes_key, keys.taken_key)
    left = [name(p) for p in board.prefixes for name in names if await raw.exists(name(p))]
    for prefix in target.prefixes:
        left += await shard_keys(raw, prefix)
    return left


async def test_a_cli_reshard_cancelled_for_a_lost_shard_leaves_the_board_as_it_was(
    store: BoardStore,
    raw: Any,
    postgres_url: str,
    cluster_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`shardlb reshard BOARD --shards 5` run after a shard lost its keys and before the archiver's
    round marked it: exit 1, the message names the rebuild, and the cancel leaves the board as it
    was before the reshard: no fence, marker, seal or tracked set on the old layout's shards, nothing
    on the new one's, the healthy shards taking writes, the lost one refusing them, then marked by
    the archiver's round. Run again then, the reshard is refused (exit 1, nothing recorded); after
    `shardlb rebuild BOARD --shard 1` the shard holds what it held and no reshard key, and the
    reshard commits with every player. (A pinning test: it held.)"""
    monkeypatch.setenv("SHARDLB_RESHARD_CACHE_S", "0")
    name = "partial-reshard-cli"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, name)
            on = {s: [x for x in sent if board.layout.home(x.player_id) == s] for s in range(3)}
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
                assert await slot_wiped(raw, board, 1) > 0
                reshard = ["reshard", name, "--shards", "5", "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, reshard) == 1
                out, err = capsys.readouterr()
                assert f"{name}: reshard cancelled; the board keeps 3 shards" in out
                assert "shard 1 of the old layout lost its keys" in err
                assert f"`shardlb rebuild {name} --shard 1`" in err
                record = orjson.loads(await raw.hget(keys.BOARDS, name))
                assert "reshard" not in record and int(record.get("generation", 0)) == 0
                assert await reshard_left(raw, store, board, 5) == []
                assert await shard_keys(raw, board.prefixes[1]) == []
                back = await store.get(name)
                late = [bettered(on[s][0], f"late-{s}") for s in (0, 2)]
                assert [r.status for r in await back.submit(late)] == ["improved", "improved"]
                with pytest.raises(Rebuilding):
                    await back.submit([Score(on[1][0].player_id, 1, "late-1", times.now_ms())])
                await a.refresh()
                await archive_round(a)
                assert (await store.get(name)).rebuilding == {1}
                assert await asyncio.to_thread(main, reshard) == 1
                assert f"`shardlb rebuild {name} --shard 1`" in capsys.readouterr().err
                assert "reshard" not in orjson.loads(await raw.hget(keys.BOARDS, name))
                rebuild_1 = ["rebuild", name, "--shard", "1", "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, rebuild_1) == 0
                back = await store.get(name)
                assert not back.rebuilding and await reshard_left(raw, store, board, 5) == []
                assert not await raw.exists(keys.fence_key(board.prefixes[1]))
                again = Score(on[1][0].player_id, 1, "late-3", times.now_ms())
                [result] = await back.submit([again])
                assert result.points == on[1][0].points
                await drain(a)
                assert await asyncio.to_thread(main, reshard) == 0
                capsys.readouterr()
                moved = await store.get(name)
                assert moved.generation == 1 and moved.config.sharding.shards == 5
                want = expected_entries(reference(moved, [*sent, *late, again]), "total", None)
                assert await moved.top(50) == want
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_shard_with_nothing_to_bring_back_is_sentinelled_again_after_the_reshard_it_cancelled(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A reshard cancelled for a shard that lost its keys where PostgreSQL holds no row of it (its
    players all on the other shards): the archiver's rule writes its sentinel again rather than
    marking it (sentinel.lua, ``archive.written_again``), which only holds if the cancel left none
    of the reshard's keys there (its `fence`, `mv`, seal, tracked sets are among those sentinel.lua
    takes for "holds something"). Since 2026-12-06 the mover's cancel applies that rule itself (it
    marks every other shard lost at once): the sentinel is back when the run ends, the board not
    marked, and the archiver's round finds nothing to write. Then the shard takes writes and the
    reshard commits."""
    name = "partial-reshard-empty"
    async with own_archive(postgres_url, "partial") as url:
        try:
            config = BoardConfig.from_dict(name, {"mode": "best", "sharding": sharding("hash", 3)})
            board, _ = await store.create(config)
            players = [f"p{i}" for i in range(200) if board.layout.home(f"p{i}") != 1][:30]
            sent = [Score(p, 100 + i, f"m{i}", times.now_ms() - 1000) for i, p in enumerate(players)]
            await board.submit(sent)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
                await slot_wiped(raw, board, 1)
                mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
                await mover.start(5)
                with pytest.raises(ShardsLost) as cancelled:
                    await mover.run()
                assert cancelled.value.shards == (1,) and cancelled.value.commands == ()
                assert "held nothing" in cancelled.value.message, cancelled.value.message
                assert await reshard_left(raw, store, board, 5) == []
                assert await raw.exists(keys.sentinel_key(board.prefixes[1]))
                assert not (await store.get(name)).rebuilding
                before = rewritten()
                await a.refresh()
                await archive_round(a)
                back = await store.get(name)
                assert not back.rebuilding and rewritten() == before
                assert await raw.exists(keys.sentinel_key(board.prefixes[1]))
                new = next(f"q{i}" for i in range(100) if back.layout.home(f"q{i}") == 1)
                [result] = await back.submit([Score(new, 5, "late-1", times.now_ms())])
                assert result.points == 5
                await drain(a)
                mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
                await mover.start(5)
                assert (await mover.run())["state"] == "none"
                moved = await store.get(name)
                assert moved.generation == 1 and len(await moved.top(50)) == 31
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_reshard_refused_for_several_lost_shards_names_each_and_their_sentinels(
    store: BoardStore, raw: Any, postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two shards of the old layout lost their keys before a router's mover ran: ShardsLost names
    both, and what is missing, and so does the router's error line. Failed before: the message said
    "shards 0, 2 of the old layout lost their keys (the sentinel is missing: Redis lost the slot and
    serves it again empty)", and the line "(Redis lost the slot)": one sentinel and one slot for two
    shards, whose sentinels are in two slots (each shard its own hash tag). Now "the sentinels of
    shards 0 and 2 are missing: Redis lost their slots and serves them again empty", and "(Redis
    lost their slots)"; one shard's wording is as it was."""
    name = "partial-reshard-two"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, _ = await board_written(store, name)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)  # both shards' results archived: their rebuilds bring them back
            finally:
                await a.db.close()
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            assert await slot_wiped(raw, board, 0) > 0 and await slot_wiped(raw, board, 2) > 0
            run, caught = mover.run, []

            async def keeping(wait: bool = True) -> dict[str, Any]:
                try:
                    return await run(wait)
                except ShardsLost as e:
                    caught.append(e)
                    raise

            mover.run = keeping  # type: ignore[method-assign]
            logger = logging.getLogger("shardlb")  # where the router's handler is (router/logs.py)
            logger.addHandler(caplog.handler)
            try:
                await reshards._move(mover, wait=True)
            finally:
                logger.removeHandler(caplog.handler)
            [line] = {r.getMessage() for r in caplog.records if r.levelno == logging.ERROR}
            assert "shards 0, 2 of the old layout lost their keys (Redis lost their slots)" in line, line
            [cancelled] = caught
            said = cancelled.message
            assert cancelled.shards == (0, 2), said
            assert "shards 0, 2 of the old layout lost their keys" in said, said
            assert "the sentinel is missing" not in said and "lost the slot" not in said, said
            assert "the sentinels of shards 0 and 2 are missing" in said, said
            assert "Redis lost their slots and serves them again empty" in said, said
            assert f"`shardlb rebuild {name} --shard 0` and `shardlb rebuild {name} --shard 2`" in said, said
            assert (await store.get(name)).rebuilding == {0, 2}
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


@pytest.mark.parametrize("after", ["copied shard 1/3", "sealed and moved"])
async def test_a_shard_lost_while_the_mover_works_cancels_the_reshard_as_one_lost_before(
    store: BoardStore, raw: Any, postgres_url: str, after: str
) -> None:
    """A shard of the old layout loses its keys after the mover took the reshard (its fence went with
    them): while it copies, or once it has sealed and moved the old shards, before it looks at their
    sentinels. Nobody else took the reshard over, so the answer is the one a shard lost before the
    run gets: ShardsLost, the reshard cancelled and the board as it was (no reshard key on either
    layout, the healthy shards taking writes, the lost shard refusing them and marked by the
    archiver's round). Failed before: the mover's next fenced call on the shard was refused and it
    stopped with Lost "another mover took the reshard ... over (this one's lease ran out)", though
    none did, leaving the reshard recorded (copying, or sealing), its fences and markers on every
    other shard for a day, and the lost shard taking writes against an empty shard (the record's
    reshard turns write.lua's sentinel check off) until a resume. Since 2026-12-06 the cancel also
    marks the shard not rebuilt at once; before, reads merged the shards left until the archiver's
    next round marked it."""
    name = "partial-reshard-mid"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, name)
            on = {s: [x for x in sent if board.layout.home(x.player_id) == s] for s in range(3)}
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
                mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
                tell, wiped = mover._tell, []

                async def wiping(line: str) -> None:
                    await tell(line)
                    if after in line and not wiped:
                        wiped.append(await slot_wiped(raw, board, 1))

                mover._tell = wiping  # type: ignore[method-assign]
                await mover.start(5)
                with pytest.raises(ShardsLost, match="shard 1 of the old layout lost its keys"):
                    await mover.run()
                assert wiped and wiped[0] > 0
                record = orjson.loads(await raw.hget(keys.BOARDS, name))
                assert "reshard" not in record and int(record.get("generation", 0)) == 0
                assert await reshard_left(raw, store, board, 5) == []
                back = await store.get(name)
                assert back.sentinels and not back.moving
                assert back.rebuilding == {1}  # marked by the cancel, no archiver round first
                with pytest.raises(Rebuilding, match=f"`shardlb rebuild {name} --shard 1`"):
                    await back.top(10)
                late = [bettered(on[s][0], f"late-{s}") for s in (0, 2)]
                assert [r.status for r in await back.submit(late)] == ["improved", "improved"]
                with pytest.raises(Rebuilding):
                    await back.submit([Score(on[1][0].player_id, 1, "late-1", times.now_ms())])
                await a.refresh()
                await archive_round(a)
                assert (await store.get(name)).rebuilding == {1}
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


@pytest.mark.parametrize("during", ["copied shard 1/3", "sealed and moved"], ids=["copying", "sealing"])
async def test_a_write_to_a_shard_lost_during_a_reshard_is_refused_before_the_movers_next_call_there(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, during: str
) -> None:
    """A shard of the old layout loses its keys while the mover copies (or once it has sealed and
    moved the old shards): until the mover's next fenced call there, a write to a player homed on it
    is refused (503 ``board_rebuilding``, nothing written), by the library and through a router,
    and so is a read that merges the shard; a read of a healthy shard is answered, and a write
    there too while the copy goes on. The reshard then cancels as it does for a shard lost before
    it. Failed before: the record's reshard turned write.lua's sentinel check off, and the write
    answered ``improved`` at 1 point (the player's best is higher) against the empty shard (when
    sealing, too: the shard's moved marker went with its keys)."""
    name = "partial-reshard-write"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, name)
            on = {s: [x for x in sent if board.layout.home(x.player_id) == s] for s in range(3)}
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            tell, seen = mover._tell, []

            async def losing(line: str) -> None:
                await tell(line)
                if during not in line or seen:
                    return
                assert await slot_wiped(raw, board, 1) > 0
                moving = await store.get(name)
                assert moving.moving
                late = Score(on[1][0].player_id, 1, "late-1", times.now_ms())
                with pytest.raises(Rebuilding, match="shard 1 lost its data"):
                    await moving.submit([late])
                assert not await raw.exists(keys.period_key(board.prefixes[1], "total"))
                with pytest.raises(Rebuilding):
                    await (await store.get(name)).top(10)
                healthy = await store.get(name)
                assert list(await healthy.scores([on[0][0].player_id])) == [on[0][0].player_id]
                if during.startswith("copied"):  # sealed, the healthy shards refuse writes for a retry
                    [result] = await healthy.submit([bettered(on[0][1], "late-9")])
                    assert result.status == "improved"
                async with running(cluster_url) as (_, client):
                    body = {"scores": [{"player_id": on[1][1].player_id, "points": 1, "match_id": "late-2"}]}
                    answer = await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
                    _refused(answer)
                assert not await raw.exists(keys.period_key(board.prefixes[1], "total"))
                seen.append(line)

            mover._tell = losing  # type: ignore[method-assign]
            await mover.start(5)
            with pytest.raises(ShardsLost, match="shard 1 of the old layout lost its keys"):
                await mover.run()
            assert seen
            record = orjson.loads(await raw.hget(keys.BOARDS, name))
            assert "reshard" not in record and int(record.get("generation", 0)) == 0
            assert await reshard_left(raw, store, board, 5) == []
            back = await store.get(name)
            late = [bettered(on[s][0], f"late-{s}") for s in (0, 2)]
            assert [r.status for r in await back.submit(late)] == ["improved", "improved"]
            with pytest.raises(Rebuilding):
                await back.submit([Score(on[1][0].player_id, 1, "late-3", times.now_ms())])
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_write_to_a_new_shard_lost_after_the_cut_over_is_refused_before_the_reshard_finishes(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A shard of the new layout loses its keys after the commit, while the reshard waits to finish
    (the archiver has not drained the old journals yet): the record still names the reshard, so the
    archiver marks nothing, but the new layout was given its sentinels before the commit, and a
    write to a player homed on the lost shard is refused (nothing written), as is a read that merges
    it. Once the reshard finishes the shard is marked (by the finish itself since 2026-12-06), and
    the archiver's round leaves it so. Failed before: the write answered ``improved`` at 1 point
    against the empty shard."""
    name = "partial-reshard-committed"
    async with own_archive(postgres_url, "partial") as url:
        try:
            _, sent = await board_written(store, name)
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            assert (await mover.run())["state"] == "committed"  # no archiver ran: its journals wait
            moved = await store.get(name)
            assert moved.generation == 1 and not moved.moving
            assert await slot_wiped(raw, moved, 2) > 0
            on = {s: [x for x in sent if moved.layout.home(x.player_id) == s] for s in (0, 2)}
            with pytest.raises(Rebuilding, match="shard 2 lost its data"):
                await moved.submit([Score(on[2][0].player_id, 1, "late-1", times.now_ms())])
            assert not await raw.exists(keys.period_key(moved.prefixes[2], "total"))
            with pytest.raises(Rebuilding):
                await (await store.get(name)).top(10)
            healthy = await store.get(name)
            assert list(await healthy.scores([on[0][0].player_id])) == [on[0][0].player_id]
            [result] = await healthy.submit([bettered(on[0][0], "late-0")])
            assert result.status == "improved"
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
                again = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=5)
                assert (await again.run())["state"] == "none"
                await a.refresh()
                await archive_round(a)
                assert (await store.get(name)).rebuilding == {2}
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_lost_shards_refusal_during_a_reshard_names_the_resume_whose_finish_marks_it_for_the_rebuild(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A new layout's shard lost after the cut-over, while the reshard waits to finish: the 503 (a
    write's and a read's, library and router) names `shardlb reshard BOARD --resume`, not the
    rebuild, which is refused (409) while the reshard is under way; the resume's finish marks the
    shard in the record it writes (no archiver round needed: a read is refused at once, not answered
    from the shards left) and says the rebuild to run, which then brings the board back whole.
    Failed before: the refusal named `shardlb rebuild BOARD --shard 2`, refused until the finish,
    and after the finish the top answered the players of the shards left until the archiver's round."""
    name = "partial-reshard-path"
    resume = f"`shardlb reshard {name} --resume`"
    async with own_archive(postgres_url, "partial") as url:
        try:
            _, sent = await board_written(store, name)
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            assert (await mover.run())["state"] == "committed"  # no archiver ran: its journals wait
            moved = await store.get(name)
            assert await slot_wiped(raw, moved, 2) > 0
            lost = next(x for x in sent if moved.layout.home(x.player_id) == 2)
            with pytest.raises(Rebuilding) as write:
                await moved.submit([Score(lost.player_id, 1, "late-1", times.now_ms())])
            with pytest.raises(Rebuilding) as read:
                await (await store.get(name)).top(10)
            for message in (write.value.message, read.value.message):
                assert resume in message and "shardlb rebuild" not in message, message
            async with running(cluster_url) as (_, client):
                answer = await client.get(f"/v1/boards/{name}/top?limit=5")
                _refused(answer)
                assert resume in answer.json()["error"]["message"], answer.text
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                async with connected(cluster_url, url) as (rebuilder, other):
                    with pytest.raises(BoardConflict, match="being resharded"):
                        await rebuilder.rebuild(await other.get(name), shard=2)
                await drain(a)
                said: list[str] = []
                again = Resharder(store, name, say=said.append, postgres_url=url, cache_s=0, drain_s=5)
                assert (await again.run())["state"] == "none"
                assert any(f"`shardlb rebuild {name} --shard 2`" in line for line in said), said
                back = await store.get(name)
                assert back.rebuilding == {2}
                with pytest.raises(Rebuilding, match=f"shardlb rebuild {name} --shard 2"):
                    await back.top(10)
            finally:
                await a.db.close()
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(name), shard=2)
            back = await store.get(name)
            assert not back.rebuilding
            assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


@pytest.mark.parametrize(
    "when", ["_open", "_finish", "_drained"], ids=["before-the-open", "before-the-finish", "draining"]
)
async def test_a_new_shard_lost_during_the_movers_own_finish_is_marked_not_taken_for_another_mover(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, when: str
) -> None:
    """The mover that cut over goes on to finish, and a shard of the new layout loses its keys
    (its fence with them) between the commit and the new layout's opening, as the finish begins,
    or while it waits for the old journals: the mover opens the new layout, the finish drops the
    old one, marks the shard and says the rebuild to run, which brings the board back whole.
    Failed before: the finish's first (or last) fenced call met the lost shard's missing fence and
    the run stopped with "another mover took the reshard over", though none had (and, draining,
    the reshard was over); lost before the opening, until 2026-12-06 too, the opening's call."""
    name = "partial-reshard-finish"
    async with own_archive(postgres_url, "partial") as url:
        try:
            _, sent = await board_written(store, name)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)
            finally:
                await a.db.close()
            said: list[str] = []
            mover = Resharder(store, name, say=said.append, postgres_url=url, cache_s=0, drain_s=5)
            step, wiped = getattr(mover, when), []

            async def losing(*args: Any) -> Any:
                if not wiped:  # once: the opening is made again at the finish
                    record = orjson.loads(await raw.hget(keys.BOARDS, name))
                    assert record["reshard"]["state"] == "committed"
                    wiped.append(await slot_wiped(raw, await store.get(name), 2))
                    assert wiped[0] > 0
                return await step(*args)

            setattr(mover, when, losing)
            await mover.start(5)
            assert (await mover.run())["state"] == "none"
            assert any(f"`shardlb rebuild {name} --shard 2`" in line for line in said), said
            back = await store.get(name)
            assert back.generation == 1 and back.rebuilding == {2}
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(name), shard=2)
            back = await store.get(name)
            assert not back.rebuilding
            assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


@pytest.mark.parametrize("at", ["copying", "committed"])
async def test_a_read_of_a_board_deleted_during_its_reshard_is_not_found_not_rebuilding(
    store: BoardStore, postgres_url: str, at: str
) -> None:
    """A process holding a board being resharded (a router, until it fetches the record again) reads
    it after the board was deleted: the deletion dropped every shard, sentinels with them, and the
    read's look at the sentinels (``Board.check_layout``) took every shard for lost alone: 503
    ``board_rebuilding``, naming a reshard to resume, where the board is gone. Now a read that finds a
    sentinel missing reads the record too: gone (or being deleted, or another incarnation), the
    read is BoardNotFound (404 ``board_not_found``) and the Board marked deleted (a cache drops it)."""
    from shardlb.errors import BoardNotFound

    name = f"partial-reshard-deleted-{at}"
    async with own_archive(postgres_url, "partial") as url:
        try:
            await board_written(store, name)
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            if at == "committed":
                assert (await mover.run())["state"] == "committed"  # no archiver ran: its journals wait
            held = await store.get(name)
            assert held.resharding and held.sentinels
            await store.delete(name)
            with pytest.raises(BoardNotFound):
                await held.top(10)
            assert held.deleted and held.stale
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)


async def test_a_lost_shards_refusals_name_the_rebuild_to_run_not_a_rebuild_under_way(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Every refusal a shard lost alone brings (write.lua's SHARDLOST before the archiver's round, a
    read once it marked the shard, a settlement's or reconcile's check, a reshard's start, through
    the library and as the router's 503 body) names the command that brings it back, and says no
    rebuild is under way. Failed before: "board 'partial-words' is being rebuilt after a loss of
    Redis (shards 1 not rebuilt yet): this read would not be exact. Nothing was written; retry
    shortly", though no rebuild ran and none would until an operator's."""
    command = "`shardlb rebuild partial-words --shard 1`"

    def told(message: str) -> None:
        assert command in message, message
        assert "being rebuilt" not in message and "after a loss of Redis" not in message, message
        assert "shard 1 lost its data in Redis" in message, message
        # One shard: "it", not "they"; and no run of `shardlb rebuild` stopped half way (none ran).
        assert "they are" not in message and "stopped half way" not in message, message

    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-words")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-words"}), url)
            try:
                await drain(a)
                await slot_wiped(raw, board, 1)
                on_lost = next(s.player_id for s in sent if board.layout.home(s.player_id) == 1)
                with pytest.raises(Rebuilding) as refused:
                    await board.submit([Score(on_lost, 1, "late-1", times.now_ms())])
                told(refused.value.message)
                await a.refresh()
                await archive_round(a)
                back = await store.get("partial-words")
                with pytest.raises(Rebuilding) as refused:
                    await back.top(10)
                told(refused.value.message)
                async with connected(cluster_url, url) as (rebuilder, _):
                    with pytest.raises(Rebuilding) as refused:
                        await rebuilder.check_layout(back, "settle")
                    told(refused.value.message)
                with pytest.raises(Rebuilding) as refused:
                    await Resharder(store, "partial-words", say=lambda _: None, postgres_url=url).start(5)
                told(refused.value.message)
                async with running(cluster_url) as (_, client):
                    response = await client.get("/v1/boards/partial-words/top?limit=5")
                    _refused(response)
                    told(response.json()["error"]["message"])
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-words")


@pytest.mark.parametrize("moved", ["sentinel", "journal"])
async def test_a_shard_whose_slot_is_moving_is_not_taken_for_lost(
    store: BoardStore, raw: Any, postgres_url: str, moved: str
) -> None:
    """While a move of a shard's slot has taken its sentinel and not yet its journal, or the other
    way round, poll.lua, which names both, gets TRYAGAIN from Redis (the round fails and is made
    again); it never reads the journal where the sentinel is not, and the shard is not marked. Once
    the slot is back (stable here; handed over, the same), the rounds go on."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-moving")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-moving"}), url)
            try:
                prefix = board.prefixes[1]
                key = keys.sentinel_key(prefix) if moved == "sentinel" else keys.journal_key(prefix)
                dump = await raw.dump(key)
                async with slot_open(raw, key) as (source, _):
                    # Gone from the source as a MIGRATE of it takes it (the target's copy is not
                    # needed: the source answers the call before anything is asked there).
                    await raw.execute_command("DEL", key, target_nodes=source)
                    with pytest.raises(RedisError, match=r"TTL exhausted|TRYAGAIN"):
                        await a.round()
                    assert not (await store.get("partial-moving")).rebuilding
                await raw.restore(key, 0, dump)
                assert await drain(a) == len(sent)
                assert not (await store.get("partial-moving")).rebuilding
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-moving")


async def test_a_removal_on_a_lost_shard_is_refused_before_the_archiver_marks_it(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """remove.lua checks the shard's sentinel as write.lua does: a player's removal (a DELETE, a
    ban's) on a shard lost since is refused (Rebuilding, nothing written) before any archiver round.
    Failed before: DID NOT RAISE; the removal answered that the player had no entry, and once
    `rebuild --shard 1` brought the shard back from PostgreSQL the player was on the board again."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-remove")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-remove"}), url)
            try:
                await drain(a)
            finally:
                await a.db.close()
            await slot_wiped(raw, board, 1)
            player = next(s.player_id for s in sent if board.layout.home(s.player_id) == 1)
            with pytest.raises(Rebuilding):
                await moderation.remove(board, [player], request="remove/lost-1")
            assert board.rebuilding == {1}
            # The inactive cleanup is not held to it: it would remove nothing there.
            assert await moderation.remove_on_shard(board, 1, [player], stale_before_ms=times.now_ms()) == []
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get("partial-remove"), shard=1)
            back = await store.get("partial-remove")
            assert await moderation.remove(back, [player], request="remove/lost-1") == {player}
            assert player not in {e.player_id for e in await back.top(50)}
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-remove")


def rewritten() -> float:
    return REGISTRY.get_sample_value("shardlb_archive_rewritten_sentinels_total") or 0.0


async def marked_not_rewritten(store: BoardStore, raw: Any, url: str, board: Board, shard: int) -> None:
    """One archiver round (of ``board`` alone) marks ``shard`` not rebuilt and writes no sentinel of
    it again: the shard lost something its rebuild brings back."""
    name = board.config.id
    a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
    try:
        before = rewritten()
        await archive_round(a)
        assert (await store.get(name)).rebuilding == {shard}
        assert not await raw.exists(keys.sentinel_key(board.prefixes[shard]))
        assert rewritten() == before
    finally:
        await a.db.close()


async def test_a_fresh_boards_lost_sentinel_is_written_again_not_marked(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A board created with ``SHARDLB_ACK=primary`` whose sentinel a failover lost before its replica
    had it (deleted here): PostgreSQL holds nothing of the shard and the shard holds nothing, so a
    rebuild would bring nothing back. The archiver's round writes the sentinel again instead of
    marking the shard, and the board takes writes there. Failed before: the round marked shard 1
    (``rebuilding == {1}``) and every write to it answered 503 until an operator's rebuild."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            config = BoardConfig.from_dict("partial-fresh", {"mode": "best", "sharding": sharding("hash", 3)})
            board, _ = await store.create(config)
            await raw.delete(keys.sentinel_key(board.prefixes[1]))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-fresh"}), url)
            try:
                before = rewritten()
                await archive_round(a)
                back = await store.get("partial-fresh")
                assert not back.rebuilding
                assert await raw.exists(keys.sentinel_key(board.prefixes[1]))
                assert rewritten() == before + 1
                player = next(f"p{i}" for i in range(100) if back.layout.home(f"p{i}") == 1)
                [result] = await back.submit([Score(player, 7, "m1", times.now_ms() - 1000)])
                assert result.points == 7
                await drain(a)
                assert not (await store.get("partial-fresh")).rebuilding
                assert rewritten() == before + 1
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-fresh")


async def test_a_fresh_rate_limited_boards_lost_sentinel_is_written_again_after_a_refused_write(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """As above, on a board with a per-minute limit, and a write to the shard before the archiver's
    round: the router's screen (rate.lua) runs before write.lua, and now refuses the shard without
    its sentinel as write.lua does, writing nothing, so the round still finds the shard empty and
    writes its sentinel again. Failed before: rate.lua made the shard's key index (`idx`, kept with
    no expiry), sentinel.lua took it for a shard holding something, and the round marked shard 1:
    the healthy board refused every read and write there until an operator's rebuild."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            limit = {"max_results_per_player_per_minute": 5}
            settings = {"mode": "best", "sharding": sharding("hash", 3), **limit}
            board, _ = await store.create(BoardConfig.from_dict("partial-rated", settings))
            await raw.delete(keys.sentinel_key(board.prefixes[1]))
            player = next(f"p{i}" for i in range(100) if board.layout.home(f"p{i}") == 1)
            now = times.now_ms()
            score = Score(player, 7, "m1", now - 1000)
            screen = moderation.Screen(lambda _board, _player, _incarnation: False)
            with pytest.raises(Rebuilding):  # the router's path: the screen, then the write
                await screen.refusals(board, board.prepare([score], now), now)
                await board.submit([score], now)
            assert not await raw.exists(keys.index_key(board.prefixes[1]))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-rated"}), url)
            try:
                before = rewritten()
                await archive_round(a)
                back = await store.get("partial-rated")
                assert not back.rebuilding
                assert rewritten() == before + 1
                assert await screen.refusals(back, back.prepare([score], now), now) == []
                [result] = await back.submit([score], now)
                assert result.points == 7
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-rated")


async def test_a_shard_with_nothing_archived_is_sentinelled_again_the_others_marked(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A board whose results went to shards 0 and 2 alone, archived: shard 1 wiped holds nothing and
    PostgreSQL holds no row of it, so the round writes its sentinel again; shard 2 wiped, whose rows
    PostgreSQL holds, is marked as before, and shard 0 is left as it was."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            config = BoardConfig.from_dict("partial-some", {"mode": "best", "sharding": sharding("hash", 3)})
            board, _ = await store.create(config)
            players = [f"p{i}" for i in range(200) if board.layout.home(f"p{i}") != 1][:30]
            assert {board.layout.home(p) for p in players} == {0, 2}
            sent = [Score(p, 100 + i, f"m{i}", times.now_ms() - 1000) for i, p in enumerate(players)]
            await board.submit(sent)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-some"}), url)
            try:
                await drain(a)
                await slot_wiped(raw, board, 1)
                await slot_wiped(raw, board, 2)
                await a.refresh()
                await archive_round(a)
                back = await store.get("partial-some")
                assert back.rebuilding == {2}
                assert await raw.exists(keys.sentinel_key(board.prefixes[1]))
                assert not await raw.exists(keys.sentinel_key(board.prefixes[2]))
                assert await raw.exists(keys.sentinel_key(board.prefixes[0]))
                kept = [s for s in sent if board.layout.home(s.player_id) == 0]
                new = next(f"q{i}" for i in range(100) if back.layout.home(f"q{i}") == 1)
                [result] = await back.submit([Score(new, 5, "late-1", times.now_ms())])
                assert result.points == 5
                [result] = await back.submit([Score(kept[0].player_id, 1, "late-2", times.now_ms())])
                assert result.points == kept[0].points
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-some")


async def test_a_shard_holding_results_not_archived_is_marked_though_postgres_has_none(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """The sentinel alone gone from a shard that holds results no archiver took yet: PostgreSQL holds
    no row of it, but the shard holds its journal and keys, so it is not written again (sentinel.lua
    finds them) and the shard is marked as before."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, _ = await board_written(store, "partial-held")
            await raw.delete(keys.sentinel_key(board.prefixes[1]))
            await marked_not_rewritten(store, raw, url, board, 1)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-held")


async def test_a_fresh_band_boards_lost_band_sentinel_is_written_again_not_marked(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A band board (3 home shards, band shards 3-6) created with ``SHARDLB_ACK=primary`` whose band
    shard's sentinel a failover lost before its replica had it (deleted here): the band shard holds
    nothing, and its rebuild (from the home shards' totals and versions) would bring nothing back,
    the home shards holding none. The round writes the sentinel again instead of marking the shard,
    and the board's top is served. Failed before: the round marked shard 4 (``rebuilding == {4}``)
    and every top read answered 503 until an operator's rebuild."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            settings = {"mode": "best", "sharding": sharding("band", 3)}
            config = BoardConfig.from_dict("partial-band-fresh", settings)
            board, _ = await store.create(config)
            # A band shard's, and a home shard's (a failover of a primary holding both: "spread")
            lost = [keys.sentinel_key(board.prefixes[s]) for s in (4, 0)]
            await raw.delete(*lost)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-band-fresh"}), url)
            try:
                before = rewritten()
                await archive_round(a)
                back = await store.get("partial-band-fresh")
                assert not back.rebuilding
                assert all([await raw.exists(n) for n in lost])
                assert rewritten() == before + 2
                sent = [Score(f"p{i}", 100 + 10 * i, f"m{i}", times.now_ms() - 1000) for i in range(30)]
                await back.submit(sent)
                assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
                await drain(a)
                assert not (await store.get("partial-band-fresh")).rebuilding
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-band-fresh")


async def test_a_band_shard_whose_homes_hold_players_is_marked_though_it_holds_none(
    store: BoardStore, raw: Any, postgres_url: str
) -> None:
    """A band shard's sentinel gone (its keys wiped) while the home shards hold players: its rebuild
    would bring back their versions (and any of them in its band), so it is marked as before, not
    sentinelled again, though the band shard holds nothing and PostgreSQL holds no row of it."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, _ = await board_written(store, "partial-band-held", sharding=sharding("band", 3))
            await slot_wiped(raw, board, 4)
            await marked_not_rewritten(store, raw, url, board, 4)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-band-held")


async def test_a_rebuilds_sentinel_is_confirmed_on_a_replica_before_its_mark_goes(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rebuild BOARD --shard N` wrote the shard's sentinel on its primary alone (SHARDLB_ACK=primary,
    a rebuild of a named board) and took the mark off: a failover before the replica had it lost the
    sentinel after the rebuild said done, and the archiver marked the healthy shard again (its writes
    refused SHARDLOST meanwhile). Now the rebuild confirms its sentinels on a replica (EXISTS, the
    marker and WAIT on one connection, wherever the primary has one) before it takes the mark off;
    one found lost (deleted here, at that confirmation: the failover before it) is not written
    again, since the swap before it may have gone too: NotAcknowledged, the shard stays marked, and
    the rebuild run again clears it. Failed before: ``assert ran`` (no confirmation named the
    sentinel; the rebuild said done)."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-confirmed")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-confirmed"}), url)
            try:
                await drain(a)
                await slot_wiped(raw, board, 1)
                await a.refresh()
                await archive_round(a)
                assert (await store.get("partial-confirmed")).rebuilding == {1}
                sentinel = keys.sentinel_key(board.prefixes[1])
                ran: list[bool] = []

                async def losing(client: Any, ack: Any, commands: Any) -> list[Any]:
                    if not ran and any(sentinel in map(str, c) for c in commands):
                        await raw.delete(sentinel)  # its primary failed over before its replica had it
                        ran.append(True)
                    return await fanout.confirmed(client, ack, commands)

                monkeypatch.setattr(rebuild, "confirmed", losing, raising=False)
                async with connected(cluster_url, url) as (rebuilder, other):
                    with pytest.raises(NotAcknowledged, match="sentinel"):
                        await rebuilder.rebuild(await other.get("partial-confirmed"), shard=1)
                assert ran
                monkeypatch.undo()
                assert (await store.get("partial-confirmed")).rebuilding == {1}
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get("partial-confirmed"), shard=1)
                back = await store.get("partial-confirmed")
                assert not back.rebuilding and await raw.exists(sentinel)
                assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
                await a.refresh()
                await archive_round(a)
                assert not (await store.get("partial-confirmed")).rebuilding
                # A whole rebuild of the healthy board waits for no replica on sentinels that were
                # there all along (a failover losing the SET leaves them there).
                named: list[str] = []

                async def recording(client: Any, ack: Any, commands: Any) -> list[Any]:
                    named.extend(str(x) for c in commands for x in c)
                    return await fanout.confirmed(client, ack, commands)

                monkeypatch.setattr(rebuild, "confirmed", recording)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get("partial-confirmed"))
                monkeypatch.undo()
                assert not any(n.endswith("here") for n in named), named
            finally:
                await a.db.close()
        finally:
            monkeypatch.undo()
            with contextlib.suppress(Exception):
                await store.delete("partial-confirmed")


async def test_a_router_that_keeps_the_board_refuses_its_reads_soon_after_another_process_marks_it(
    store: BoardStore, raw: Any, cluster_url: str
) -> None:
    """A router that reads a board (and writes nothing to it) keeps its record; another process
    (the archiver) marks a shard lost. The router learns of it from the registry's version, which
    each worker follows every ``FOLLOW_S``, not when its copy expires. The router here keeps a
    board for an hour, so only that can tell it. Failed before: its top answered the players of
    the shards left, 200, until the copy expired (``CACHE_SECONDS``, 5 s; here an hour)."""
    try:
        board, sent = await board_written(store, "partial-seen", durability="journal")
        async with running(cluster_url, top_refresh_s=0.05) as (app, client):
            service_of(app).boards.ttl_s = 3600.0
            top = "/v1/boards/partial-seen/top?limit=50"
            first = await client.get(top)
            assert first.status_code == 200 and len(first.json()["entries"]) == len(sent)
            await slot_wiped(raw, board, 1)
            assert await store.lost(await store.get("partial-seen"), [1]) == [1]  # as the archiver does
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20.0  # generous: the copy is kept for an hour
            while True:
                answer = await client.get(top)
                if answer.status_code == 503 or loop.time() > deadline:
                    break
                assert answer.status_code == 200, answer.text
                await asyncio.sleep(0.02)
            _refused(answer)
    finally:
        with contextlib.suppress(Exception):
            await store.delete("partial-seen")


async def test_a_board_of_the_release_before_carries_sentinels_only_once_a_replica_has_them(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole rebuild of a board of the release before writes every shard's sentinel and then says
    in the record that its layout carries them (``BoardStore.carry``): from then on one missing is a
    shard lost. A run whose confirmation came short (NotAcknowledged, a replica out of sync) leaves
    the sentinels it wrote on the primaries; the rebuild run again found them there and waited for
    no replica ("there all along"), so with that replica as far behind as before a run said done and
    wrote the record's word: a failover then lost the sentinels (and only the rebuild's tail) and
    the archiver marked the healthy shards, their writes refused until another rebuild. Now every
    sentinel is confirmed until the record says the layout carries them. Failed before: the fourth
    run, the replica as far behind, said done (``said`` ending in "done") and the record named the
    sentinels."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-old-lag")
            raw_record = await raw.hget(keys.BOARDS, "partial-old-lag")
            before = {k: v for k, v in orjson.loads(raw_record).items() if k != "state"}
            assert await store.swap("partial-old-lag", raw_record, orjson.dumps(before))
            await raw.delete(*(keys.sentinel_key(p) for p in board.prefixes))
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-old-lag"}), url)
            try:
                await drain(a)
            finally:
                await a.db.close()
            asked: list[str] = []

            async def behind(client: Any, ack: Any, commands: Any) -> list[Any]:
                # A replica that does not catch up: every WAIT comes short.
                replies = await fanout.confirmed(client, ack, commands)
                asked.extend(str(c[1]) for c in commands)
                return [NotAcknowledged("WAIT came short") for _ in replies]

            monkeypatch.setattr(rebuild, "confirmed", behind)
            said: list[str] = []
            for _ in range(len(board.prefixes) + 1):
                async with connected(cluster_url, url) as (rebuilder, other):
                    try:
                        await rebuilder.rebuild(await other.get("partial-old-lag"))
                        said.append("done")
                    except NotAcknowledged as e:
                        assert "sentinel" in e.message
                        # No shard of this board is marked; a replica gone for good is never in sync.
                        assert "mark stays" not in e.message and "CLUSTER FORGET" in e.message, e.message
                        said.append("NotAcknowledged")
            assert said == ["NotAcknowledged"] * (len(board.prefixes) + 1)
            assert not (await store.get("partial-old-lag")).sentinels
            assert asked and set(asked) <= {keys.sentinel_key(p) for p in board.prefixes}
            monkeypatch.undo()
            async with connected(cluster_url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get("partial-old-lag"))
            back = await store.get("partial-old-lag")
            assert back.sentinels and not back.rebuilding
            assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
        finally:
            monkeypatch.undo()
            with contextlib.suppress(Exception):
                await store.delete("partial-old-lag")


async def test_a_band_shard_lost_with_the_home_shard_of_its_players_is_marked_not_written_again(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A band board whose players all live on home shard 0 (archived), their totals in band shard
    4: the two slots lost at once (a primary holding both). Home shard 0 holds nothing now, and
    shards 1 and 2 never held anything, but PostgreSQL holds shard 0's rows: it is marked, and so
    is band shard 4, though every home shard holds no total or version, since home shard 0 lacks
    its sentinel (one lost with its keys is no evidence: ``archive._homes_empty``). Written again,
    band shard 4 would serve the board's top empty, unrefused, until shard 0's rebuild. A pin of
    86b59e5's rule: `rebuild BOARD --shard 0` then brings both back."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            settings = {"mode": "best", "sharding": sharding("band", 3)}
            board, _ = await store.create(BoardConfig.from_dict("partial-band-pair", settings))
            players = [f"p{i}" for i in range(300) if board.layout.home(f"p{i}") == 0][:20]
            sent = [Score(p, 100 + i % 10, f"m{i}", times.now_ms() - 1000) for i, p in enumerate(players)]
            assert {board.layout.band_shard(s.points) for s in sent} == {4}
            await board.submit(sent)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-band-pair"}), url)
            try:
                await drain(a)
                await slot_wiped(raw, board, 0)
                await slot_wiped(raw, board, 4)
                before = rewritten()
                await a.refresh()
                await archive_round(a)
                back = await store.get("partial-band-pair")
                assert back.rebuilding == {0, 4}
                assert not await raw.exists(keys.sentinel_key(board.prefixes[4]))
                assert rewritten() == before
                with pytest.raises(Rebuilding):
                    await back.top(10)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get("partial-band-pair"), shard=0)
                back = await store.get("partial-band-pair")
                assert not back.rebuilding
                assert await back.top(50) == expected_entries(reference(back, sent), "total", None)
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-band-pair")


async def test_a_band_boards_top_is_never_served_from_bands_rebuilt_while_a_home_shard_waits(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A band board (3 home shards, band shards 3-6) whose home shards 1 and 2 Redis lost at once (a
    primary holding both): the archiver marks both, the band shards, untouched, still index every
    player. `rebuild BOARD --shard 1`, the command the archiver's first ERROR line names, rebuilds
    home shard 1 and then the band shards from every home's totals, home shard 2's empty: its
    players went from the band shards. The band shards stayed unmarked (their mark goes once no home
    is marked; they had none), and the total view reads them alone: the top was served without home
    shard 2's players, no error, until `--shard 2`. Now the band shards are marked before a rebuild
    that reads a home shard not rebuilt (marked, or without its sentinel), so the top is refused
    (503 board_rebuilding) until the last home's rebuild, which takes every mark off. Failed before:
    the top answered (DID NOT RAISE Rebuilding) with fewer players than the reference."""
    board_id = "partial-band-two"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, board_id, sharding=sharding("band", 3))
            assert {board.layout.home(s.player_id) for s in sent} == {0, 1, 2}
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {board_id}), url)
            try:
                await drain(a)
                await slot_wiped(raw, board, 1)
                await slot_wiped(raw, board, 2)
                await a.refresh()
                await archive_round(a)
                assert (await store.get(board_id)).rebuilding == {1, 2}
                want = expected_entries(reference(board, sent), "total", None)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get(board_id), shard=1)
                back = await store.get(board_id)
                assert 2 in back.rebuilding and 1 not in back.rebuilding
                with pytest.raises(Rebuilding):
                    await back.top(50)
                await a.refresh()
                await archive_round(a)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get(board_id), shard=2)
                back = await store.get(board_id)
                assert not back.rebuilding
                assert await back.top(50) == want
                await a.refresh()
                await archive_round(a)
                assert not (await store.get(board_id)).rebuilding
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete(board_id)


async def test_a_shards_master_lost_with_the_registrys_slot_is_brought_back_by_rebuild_all(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """What a master and its replica lost at once takes is every slot of that master, not one shard's
    slot (``slot_wiped``): on the suite's 3 masters, shard 1 of a 3-shard board lives on the middle
    master with the registry's slot (7553: its records, version and change log). That master
    flushed, the board is missing from the registry while shards 0 and 2 keep their keys and take
    writes (a process that kept the board: journaled, not archived), and its shard 1 refuses
    them. `rebuild --all` brings the board back whole: the results archived and those written since
    to the shards kept."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, sent = await board_written(store, "partial-master")
            await raw.initialize()
            node = raw.get_node_from_key(board.prefixes[1])
            assert raw.get_node_from_key(keys.BOARDS) == node  # the registry goes with shard 1
            assert node not in {raw.get_node_from_key(board.prefixes[s]) for s in (0, 2)}
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-master"}), url)
            try:
                await drain(a)
                await raw.flushall(target_nodes=node)  # a master lost: every slot of it, empty again
                by_shard = {s: [x for x in sent if board.layout.home(x.player_id) == s] for s in range(3)}
                now = times.now_ms()
                late = [Score(by_shard[s][0].player_id, 1000 + s, f"late-{s}", now) for s in (0, 2)]
                assert [r.points for r in await board.submit(late)] == [1000, 1002]
                with pytest.raises(Rebuilding):
                    await board.submit([Score(by_shard[1][0].player_id, 1001, "late-1", times.now_ms())])
                await a.refresh()
                await archive_round(a)
                assert await store.boards() == [] or "partial-master" not in [
                    b.config.id for b in await store.boards()
                ]
                command = ["rebuild", "--all", "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, command) == 0
                back = await store.get("partial-master")
                assert back.incarnation == board.incarnation and not back.rebuilding
                want = expected_entries(reference(back, [*sent, *late]), "total", None)
                assert await back.top(50) == want
                await drain(a)
                async with connected(cluster_url, url) as (rebuilder, other):
                    await rebuilder.rebuild(await other.get("partial-master"))
                assert await (await store.get("partial-master")).top(50) == want
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-master")
            await forget_others_lost(store)


async def test_a_ban_list_lost_with_its_master_is_written_back_by_the_archivers_next_refresh(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """The ban list (``lb:bans``, slot 345; its version and change log, slot 3298) lives on the first
    of the suite's 3 masters, with shard 0 of every 3-shard board. That master lost (every slot of
    it flushed, the registry kept on the middle one), the archiver marks shard 0 and names the
    command to run, `shardlb rebuild BOARD --shard 0`: nothing else of the runbook writes the list
    back (only `rebuild --all`, for a total loss). Failed before the fix: after the rebuild a router
    took the banned player's result (``duplicate``, not ``banned``: only the removal's retry record
    stopped this one) and the list stayed empty for good. Now the archiver's next refresh finds the
    list missing while PostgreSQL holds a ban, and writes it back (``Bans.recover``): a router
    started then refuses the player, and so does one that ran across the loss once it reads the
    list again (the version moved)."""
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, _ = await board_written(store, "partial-bans")
            await raw.initialize()
            node = raw.get_node_from_key(keys.BANS)
            assert raw.get_node_from_key(board.prefixes[0]) == node != raw.get_node_from_key(keys.BOARDS)
            post = "/v1/boards/partial-bans/scores"
            ban = {"scope": "board", "board": "partial-bans", "reason": "test"}
            field = moderation.ban_field("partial-bans", "p7")
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {"partial-bans"}), url)
            try:
                async with running(cluster_url, postgres_url=url) as (_, kept):  # a router across it
                    answer = await kept.post("/v1/players/p7:ban", json=ban, headers=AS_ADMIN)
                    assert answer.status_code == 200, answer.text
                    await drain(a)
                    await raw.flushall(target_nodes=node)  # that master lost: every slot of it, empty
                    await a.refresh()
                    await archive_round(a)
                    assert (await store.get("partial-bans")).rebuilding == {0}
                    assert await raw.hexists(keys.BANS, field)
                    async with connected(cluster_url, url) as (rebuilder, other):
                        await rebuilder.rebuild(await other.get("partial-bans"), shard=0)
                    assert not (await store.get("partial-bans")).rebuilding
                    async with running(cluster_url, postgres_url=url) as (_, client):  # one started now
                        body = {"scores": [{"player_id": "p7", "points": 5000, "match_id": "after-loss"}]}
                        answer = await client.post(post, json=body, headers=AS_WRITER)
                        assert answer.status_code == 200, answer.text
                        assert [r["status"] for r in answer.json()["results"]] == ["banned"], answer.text
                    # The router that ran across the loss reads the list again once the version moved.
                    loop = asyncio.get_running_loop()
                    deadline, statuses, tries = loop.time() + 20.0, [], 0
                    while loop.time() < deadline:
                        tries += 1
                        late = {"player_id": "p7", "points": 5000, "match_id": f"kept-{tries}"}
                        body = {"scores": [late]}
                        answer = await kept.post(post, json=body, headers=AS_WRITER)
                        statuses = [r["status"] for r in answer.json()["results"]]
                        if statuses == ["banned"]:
                            break
                        await asyncio.sleep(0.1)
                    assert statuses == ["banned"]
                # Found there, the list is not written again: the version stays.
                version = await raw.get(keys.BANS_VERSION)
                await a.refresh()
                assert await raw.get(keys.BANS_VERSION) == version
            finally:
                await a.db.close()
        finally:
            with contextlib.suppress(Exception):
                await store.delete("partial-bans")
            await raw.hdel(keys.BANS, moderation.ban_field("partial-bans", "p7"))
            await forget_others_lost(store)


@pytest.mark.parametrize(
    ("lost", "empty", "said", "unsaid"),
    [
        ([1], set(), ["a copy would lose those players for good", "run `shardlb rebuild b --shard 1`"], []),
        (
            [1, 2],
            {1, 2},
            ["shards 1, 2 held nothing archived, so nothing was lost", "their sentinels are written again"],
            ["would lose", "shardlb rebuild"],
        ),
        ([1], {1}, ["its sentinel is written again; reshard again"], ["would lose", "shardlb rebuild"]),
        (
            [1, 2],
            {2},
            ["a copy would lose the players of shard 1 for good", "shard 2 held nothing archived"],
            ["those players", "--shard 2"],
        ),
    ],
)
def test_shards_lost_says_a_copy_would_lose_players_only_of_the_shards_that_held_some(
    lost: list[int], empty: set[int], said: list[str], unsaid: list[str]
) -> None:
    """``ShardsLost``'s message said "a copy would lose those players for good" also when every
    lost shard held nothing (its sentinel written again: nothing to lose), and named no shard when
    some held players and some not. It says so now only of the shards marked for a rebuild."""
    message = ShardsLost.of("b", lost, empty).message
    for words in said:
        assert words in message, message
    for words in unsaid:
        assert words not in message, message


@pytest.mark.parametrize("by", ["cli", "router"])
async def test_an_operators_cancel_of_a_reshard_marks_a_shard_the_old_layout_lost_at_once(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, by: str
) -> None:
    """A reshard under way (no mover running) whose old layout lost a shard's keys, cancelled by an
    operator: `shardlb reshard BOARD --cancel`, or DELETE /v1/admin/boards/{board}/reshard. The
    mover's own cancel for a lost shard marks it at once (``Resharder._settle``); the operator's
    left it to the archiver's next round (about 5 s, which marks nothing while the record names a
    reshard), and reads answered from the shards left meanwhile. Failed before: the top answered,
    the board unmarked (set() == {1}). Now the read right after the cancel is refused (503
    ``board_rebuilding`` naming the rebuild), library and router."""
    name = f"partial-reshard-cancel-{by}"
    async with own_archive(postgres_url, "partial") as url:
        try:
            board, _ = await board_written(store, name)
            a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
            try:
                await drain(a)  # shard 1's results archived: its rebuild brings them back
            finally:
                await a.db.close()
            mover = Resharder(store, name, say=lambda _: None, postgres_url=url, cache_s=0, drain_s=0)
            await mover.start(5)
            await slot_wiped(raw, board, 1)
            if by == "cli":
                command = ["reshard", name, "--cancel", "--redis", cluster_url, "--postgres", url]
                assert await asyncio.to_thread(main, command) == 0
            else:
                async with running(cluster_url, postgres_url=url) as (_, client):
                    r = await client.delete(f"/v1/admin/boards/{name}/reshard", headers=AS_ADMIN)
                    assert r.status_code == 200 and r.json()["state"] == "none", r.text
            assert await reshard_left(raw, store, board, 5) == []
            back = await store.get(name)
            assert back.generation == 0 and back.rebuilding == {1}
            with pytest.raises(Rebuilding, match=f"`shardlb rebuild {name} --shard 1`"):
                await back.top(10)
            async with running(cluster_url) as (_, client):
                answer = await client.get(f"/v1/boards/{name}/top?limit=5")
                _refused(answer)
                assert f"`shardlb rebuild {name} --shard 1`" in answer.json()["error"]["message"], answer.text
        finally:
            with contextlib.suppress(Exception):
                await store.delete(name)
