"""A board between its restore and its last swap (`rebuild --all` after a total loss of Redis): its
record is back in the registry, so routers find it, but its shards are empty or rebuilt on some and
not yet on others. Reads and writes whose answer depends on a shard not rebuilt yet are refused
(``Rebuilding``, 503 ``board_rebuilding``), and answer exactly once its last swap is made; a
rebuild stopped half way leaves the refusals, and a second run clears them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import pytest

from shardlb import keys, moderation, rebuild, reconcile, times
from shardlb.board import Board, Score
from shardlb.config import BoardConfig
from shardlb.errors import PlayerNotFound, Rebuilding
from shardlb.rebuild import connected
from shardlb.reshard import Resharder
from shardlb.settlement import Request, Settler
from shardlb.store import BoardStore
from tests.reference import ReferenceBoard
from tests.router_support import AS_ADMIN, AS_WRITER, running, service_of
from tests.test_board import expected_entries, sharding
from tests.test_rebuild import OnlyStore, archiver, drain, own_archive
from tests.test_rebuild_jobs import lost
from tests.test_settlement import TABLE, awards_of, day_ago, expected_awards, new_board
from tests.test_settlement import written as written_in

# No test here checks the restore's wait for the routers' copies of the ban list (conftest.py).
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("no_ban_propagation_wait")]


async def written(
    store: BoardStore, raw: Any, url: str, board_id: str, mode: str, strategy: str = "hash"
) -> list[Score]:
    """A board of ``mode`` whose players p0..p8 scored 100 + 10 x i, archived, then lost: the scores."""
    config = BoardConfig.from_dict(board_id, {"mode": mode, "sharding": sharding(strategy, 3)})
    board, _ = await store.create(config)
    scores = [Score(f"p{i}", 100 + 10 * i, f"m{i}", times.now_ms() - 1000) for i in range(9)]
    await board.submit(scores)
    await archived_and_lost(store, raw, url, board)
    return scores


async def archived_and_lost(store: BoardStore, raw: Any, url: str, board: Board) -> None:
    a = await archiver(raw, OnlyStore(store.client, store.scripts, {board.config.id}), url)
    try:
        await drain(a)
    finally:
        await a.db.close()
    await lost(raw)


async def restored(cluster_url: str, url: str) -> list[Board]:
    """``rebuild --all``'s restore alone: every board back in the registry, none rebuilt yet."""
    async with connected(cluster_url, url) as (rebuilder, store):
        return await rebuilder.restore(store)


REFUSED = object()


async def exact_or_refused(call: Any) -> Any:
    """What ``call`` answers (PlayerNotFound as itself), or REFUSED when it raises Rebuilding."""
    try:
        return await call
    except Rebuilding:
        return REFUSED
    except PlayerNotFound as e:
        return e


def reference(board: Board, scores: list[Score]) -> ReferenceBoard:
    ref = ReferenceBoard(board.config)
    ref.submit(scores, now_ms=times.now_ms())
    return ref


async def rebuilt_exactly(store: BoardStore, board_id: str, sent: list[Score]) -> Board:
    """The board as the registry has it now: no shard left marked, and its top the reference's."""
    back = await store.get(board_id)
    assert not back.rebuilding
    assert await back.top(20) == expected_entries(reference(back, sent), "total", None)
    return back


async def test_a_board_restored_and_not_rebuilt_refuses_what_it_cannot_answer_exactly(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Failed before the fix: the top was empty, the rank missing, and a best board's write of 50
    for p8 (best 180) answered ``improved`` with 50 points; an incr board's answered the increment
    as the total. Now each is refused until the board's last swap, and exact after it."""
    async with own_archive(postgres_url, "window") as url:
        try:
            sent = {b: await written(store, raw, url, b, b[7:]) for b in ("window-best", "window-incr")}
            await restored(cluster_url, url)
            now = times.now_ms()
            wrong = []  # every inexact answer of the window, named
            for board_id in ("window-best", "window-incr"):
                back = await store.get(board_id)
                want = expected_entries(reference(back, sent[board_id]), "total", None)
                top = await exact_or_refused(back.top(10))
                if top is not REFUSED and top != want:
                    wrong.append(f"{board_id} top: {top}")
                found = await exact_or_refused(back.player("p8"))
                got = (getattr(found, "rank", None), getattr(found, "points", None))
                if found is not REFUSED and got != (1, 180):
                    wrong.append(f"{board_id} p8: {found}")
            # p8's best is 180, its incr total 180: a write answers the total after it.
            for board_id, late, points in (("window-best", 50, 180), ("window-incr", 5, 185)):
                back = await store.get(board_id)
                answer = await exact_or_refused(back.submit([Score("p8", late, f"late-{board_id}", now)]))
                if answer is not REFUSED and answer[0].points != points:
                    wrong.append(f"{board_id} write of {late}: {answer[0]}")
            assert not wrong
            # The rebuild: the marks go with its swaps, and reads and writes are exact again.
            async with connected(cluster_url, url) as (rebuilder, other):
                for board_id in ("window-best", "window-incr"):
                    await rebuilder.rebuild(await other.get(board_id))
            for board_id, late, points in (("window-best", 50, 180), ("window-incr", 5, 185)):
                back = await store.get(board_id)
                assert not back.rebuilding
                [result] = await back.submit([Score("p8", late, f"late-{board_id}", now)])
                assert result.points == points
                ref = reference(back, [*sent[board_id], Score("p8", late, f"late-{board_id}", now)])
                want = expected_entries(ref, "total", None)
                assert await back.top(20) == want
        finally:
            for b in ("window-best", "window-incr"):
                with contextlib.suppress(Exception):
                    await store.delete(b)


async def test_the_router_answers_503_board_rebuilding_and_caches_nothing_of_the_window(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Through the router: the top, a rank (exact and estimated) and a write are 503
    ``board_rebuilding`` with Retry-After while the board is restored and not rebuilt; after the
    rebuild the router (a fresh fetch of the board) answers the whole top, not an empty one kept."""
    async with own_archive(postgres_url, "window") as url:
        try:
            sent = await written(store, raw, url, "window-http", "best")
            await restored(cluster_url, url)
            async with running(cluster_url) as (_, client):
                reads = [
                    "/v1/boards/window-http/top?limit=5",
                    "/v1/boards/window-http/players/p8",
                    "/v1/boards/window-http/players/p8?estimate=true",
                    "/v1/boards/window-http/players/p8/around?radius=2",
                ]
                for path in reads:
                    _refused(await client.get(path))
                body = {"scores": [{"player_id": "p8", "points": 50, "match_id": "late"}]}
                _refused(await client.post("/v1/boards/window-http/scores", json=body, headers=AS_WRITER))
                assert list(await rebuild.run(cluster_url, url, None)) == ["window-http"]
                for _ in range(100):  # until this router fetches the record without its mark (1 s)
                    answer = await client.get(reads[0])
                    if answer.status_code != 503:
                        break
                    await asyncio.sleep(0.05)
                ref = reference((await store.get("window-http")), sent)
                want = expected_entries(ref, "total", None)[:5]
                assert [e["player_id"] for e in answer.json()["entries"]] == [e.player_id for e in want]
                for path in reads[1:]:
                    assert (await client.get(path)).status_code == 200, path
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-http")


async def test_a_router_that_kept_the_board_from_before_a_total_loss_refuses_its_writes_at_once(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """A router that read and wrote the board before the loss keeps its copy (for an hour here) and
    has not looked at the registry's version since (its next look is an hour away here: a router
    within its ``FOLLOW_S``, or of the release before, which follows nothing). After the loss (every
    master flushed: the shards' sentinels go with their keys) and the restore, its writes meet the
    empty shards and are refused at once (write.lua finds no sentinel: 503 ``board_rebuilding``);
    once it looks, its reads are refused too, and after the rebuild and its next look it answers
    the reference. With the loss modelled by deleting the boards' listed keys and records alone
    (``lost`` until 2026-12-06: the sentinels left), this router's writes were answered 200 against
    the empty shards."""
    async with own_archive(postgres_url, "window") as url:
        try:
            config = BoardConfig.from_dict("window-kept", {"mode": "best", "sharding": sharding("hash", 3)})
            board, _ = await store.create(config)
            sent = [Score(f"p{i}", 100 + 10 * i, f"m{i}", times.now_ms() - 1000) for i in range(9)]
            await board.submit(sent)
            async with running(cluster_url) as (app, client):
                boards = service_of(app).boards
                boards.ttl_s, boards.follow_s = 3600.0, 3600.0
                await asyncio.sleep(0.5)  # its loop's last look at FOLLOW_S, then an hour's sleep
                top = "/v1/boards/window-kept/top?limit=20"
                post = "/v1/boards/window-kept/scores"
                assert (await client.get(top)).status_code == 200
                body = {"scores": [{"player_id": "p8", "points": 1, "match_id": "before"}]}
                assert (await client.post(post, json=body, headers=AS_WRITER)).status_code == 200
                await archived_and_lost(store, raw, url, board)
                await restored(cluster_url, url)
                for player in ("p0", "p1", "p2", "p8"):
                    late = {"scores": [{"player_id": player, "points": 500, "match_id": f"late-{player}"}]}
                    _refused(await client.post(post, json=late, headers=AS_WRITER))
                await boards.follow()  # its next look: the record's marks
                _refused(await client.get(top))
                assert list(await rebuild.run(cluster_url, url, None)) == ["window-kept"]
                await boards.follow()
                answer = await client.get(top)
                assert answer.status_code == 200, answer.text
                want = expected_entries(reference(await store.get("window-kept"), sent), "total", None)
                assert [e["player_id"] for e in answer.json()["entries"]] == [e.player_id for e in want]
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-kept")


def _refused(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "board_rebuilding"
    assert int(response.headers["retry-after"]) >= 1


async def test_a_rebuild_stopped_half_way_leaves_its_refusals_and_a_second_run_clears_them(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rebuild --all` killed at the board's second shard: the first shard is rebuilt and its mark
    gone, the others keep theirs, so reads of the whole board are refused (explicitly, not answered
    from one shard of three); running it again clears them, and the board is its reference."""
    async with own_archive(postgres_url, "window") as url:
        try:
            sent = await written(store, raw, url, "window-stop", "incr")
            real, calls = rebuild.Rebuilder.rebuild_shard, []

            async def dying(r: rebuild.Rebuilder, board: Board, shard: int, *args: Any) -> Any:
                calls.append(shard)
                if len(calls) == 2:
                    raise ConnectionError("killed")
                return await real(r, board, shard, *args)

            monkeypatch.setattr(rebuild.Rebuilder, "rebuild_shard", dying)
            with pytest.raises(ConnectionError):
                await rebuild.run(cluster_url, url, None, jobs=1)
            back = await store.get("window-stop")
            assert back.rebuilding == {1, 2}
            with pytest.raises(Rebuilding):
                await back.top(10)
            monkeypatch.setattr(rebuild.Rebuilder, "rebuild_shard", real)
            assert list(await rebuild.run(cluster_url, url, None, jobs=1)) == ["window-stop"]
            await rebuilt_exactly(store, "window-stop", sent)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-stop")


async def test_a_settlement_in_the_window_is_refused_until_the_rebuild_and_pays_after_it(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Failed before the fix: a settlement run in the window froze the empty shards and stopped
    with ``settlement_mismatch`` (its check reads the frozen Redis board: every shard drifting),
    leaving its row in state mismatch. It is now refused (Rebuilding, 503 board_rebuilding) before
    its freeze, and the same settlement run after the rebuild pays the reference's order."""
    async with own_archive(postgres_url, "window") as url:
        board = await new_board(store, "window-settle")
        period = day_ago(2)
        try:
            ref = await written_in(board, period, "window-settle")
            await archived_and_lost(store, raw, url, board)
            await restored(cluster_url, url)
            request = Request.of({"settlement_id": "window-settle-1", "rewards": TABLE})
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get("window-settle")
                with pytest.raises(Rebuilding) as refused:
                    await Settler(rebuilder).settle(back, period, request)
                assert "settle it once" in refused.value.message
                assert not await back.frozen(back.resolve(period).period)  # refused before its freeze
            await rebuild.run(cluster_url, url, None)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get("window-settle")
                result = await Settler(rebuilder).settle(back, period, request)
                assert result["check"]["drifting"] == []
                assert await awards_of(rebuilder.db, "window-settle-1") == expected_awards(ref, period, back)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-settle")


async def test_a_reconcile_its_repair_and_a_reshard_are_refused_until_the_rebuild(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Failed before the fix: a reconcile in the window reported every shard not rebuilt yet as
    drifting, its repair rebuilt a marked shard's total (writing into it beside the rebuild), and a
    reshard was recorded, to copy empty shards. Each is now refused (Rebuilding) with nothing
    written, and the reconcile after the rebuild finds no drift."""
    async with own_archive(postgres_url, "window") as url:
        try:
            await written(store, raw, url, "window-check", "best")
            await restored(cluster_url, url)
            async with connected(cluster_url, url) as (rebuilder, other):
                back = await other.get("window-check")
                with pytest.raises(Rebuilding):
                    await reconcile.reconcile(rebuilder, back, "total")
                drifting = [reconcile.ShardCheck(1, 0, 3, 0, 1, 0)]
                with pytest.raises(Rebuilding):
                    await reconcile.repair(rebuilder, back, drifting, "total")
                assert await rebuilder.members(keys.period_key(back.prefixes[1], "total")) == {}
                with pytest.raises(Rebuilding):
                    await Resharder(other, "window-check", say=lambda _: None, postgres_url=url).start(4)
                assert "reshard" not in orjson.loads(await raw.hget(keys.BOARDS, "window-check"))
            await rebuild.run(cluster_url, url, None)
            async with connected(cluster_url, url) as (rebuilder, other):
                checks = await reconcile.reconcile(rebuilder, await other.get("window-check"), "total")
                assert [c.drift for c in checks] == [False] * 3
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-check")


async def test_a_removal_in_the_window_is_refused_and_the_same_removal_after_it_removes(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Failed before the fix: removing p8 in the window answered that p8 had no entry (its shard
    empty), while the delete entry it journaled took p8 off at the swap; the same removal again
    (its request's record found) answered the same. It is now refused with nothing written (no
    entry in the journal), and the same removal after the rebuild removes p8 and answers so."""
    async with own_archive(postgres_url, "window") as url:
        try:
            sent = await written(store, raw, url, "window-remove", "incr")
            await restored(cluster_url, url)
            back = await store.get("window-remove")
            journal = keys.journal_key(back.prefixes[back.layout.home("p8")])
            before = await raw.xlen(journal)
            with pytest.raises(Rebuilding):
                await moderation.remove(back, ["p8"], request="remove/window")
            assert await raw.xlen(journal) == before
            await rebuild.run(cluster_url, url, ["window-remove"])  # one board, not --all
            back = await store.get("window-remove")
            assert await moderation.remove(back, ["p8"], request="remove/window") == {"p8"}
            ref = reference(back, [s for s in sent if s.player_id != "p8"])
            assert await back.top(20) == expected_entries(ref, "total", None)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-remove")


async def test_a_band_boards_band_shards_keep_their_mark_until_every_home_shard_is_rebuilt(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Failed before the fix: `shardlb rebuild BOARD --shard 3` (a band shard) of a band board
    restored by a stopped `--all` rebuilt its band shards from home shards still empty and took
    their marks off, and so did `--shard 0` from one home shard of three: the board's top (its band
    shards) answered an empty or partial top. The band shards now keep their marks until no home
    shard is marked; a rebuild of the whole board (one board, not --all) takes every mark off."""
    async with own_archive(postgres_url, "window") as url:
        try:
            sent = await written(store, raw, url, "window-band", "best", "band")
            await restored(cluster_url, url)
            bands = set(range(3, 7))
            for shard, left in ((3, {0, 1, 2} | bands), (0, {1, 2} | bands)):
                await rebuild.run(cluster_url, url, ["window-band"], shard=shard)
                back = await store.get("window-band")
                assert back.rebuilding == left, shard
                with pytest.raises(Rebuilding):
                    await back.top(10)
            await rebuild.run(cluster_url, url, ["window-band"])
            await rebuilt_exactly(store, "window-band", sent)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-band")


async def test_the_routers_removals_bans_reshards_and_board_reads_answer_503_then_converge(
    store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """Through the router in the window: GET of the board (what the dashboard opens), a DELETE of
    a player, a ban of the board and a reshard through the admin endpoint are 503
    ``board_rebuilding`` (the removal answered "no entry" before the fix). After the rebuild the
    DELETE and the ban sent again with their X-Request-Id converge: the player is removed once,
    the banned one is gone, the board is exact."""
    async with own_archive(postgres_url, "window") as url:
        try:
            sent = await written(store, raw, url, "window-admin", "best")
            await restored(cluster_url, url)
            async with running(cluster_url, postgres_url=url) as (_, client):
                base = "/v1/boards/window-admin"
                remove = {**AS_ADMIN, "X-Request-Id": "window-remove-1"}
                ban = {**AS_ADMIN, "X-Request-Id": "window-ban-1"}
                ban_body = {"scope": "board", "board": "window-admin", "reason": "test"}
                _refused(await client.get(base))
                _refused(await client.delete(f"{base}/players/p8", headers=remove))
                _refused(await client.post("/v1/players/p7:ban", json=ban_body, headers=ban))
                reshard = "/v1/admin/boards/window-admin/reshard"
                _refused(await client.post(reshard, json={"shards": 4}, headers=AS_ADMIN))
                await rebuild.run(cluster_url, url, None)
                for _ in range(100):  # until this router fetches the record without its mark (1 s)
                    answer = await client.delete(f"{base}/players/p8", headers=remove)
                    if answer.status_code != 503:
                        break
                    await asyncio.sleep(0.05)
                assert answer.status_code == 200 and answer.json()["removed"] is True, answer.text
                # The ban was stored before its 503, and the rebuild leaves banned players out (it
                # reads the bans from PostgreSQL): its retry finds nothing of p7 left to remove.
                answer = await client.post("/v1/players/p7:ban", json=ban_body, headers=ban)
                assert answer.status_code == 200 and answer.json()["removed_from"] == [], answer.text
                assert (await client.get(base)).status_code == 200
            back = await store.get("window-admin")
            ref = reference(back, [s for s in sent if s.player_id not in ("p7", "p8")])
            assert await back.top(20) == expected_entries(ref, "total", None)
        finally:
            with contextlib.suppress(Exception):
                await store.delete("window-admin")
