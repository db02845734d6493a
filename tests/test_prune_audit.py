"""The moderation audit's retention (`shardlb prune --audit-days N`, shardlb/prune.py) against a
PostgreSQL database of each test's own: the rows older than N days go in bounded batches, newer
ones stay, N below ``prune.AUDIT_MIN_DAYS`` is refused; and what a ban's, lift's or removal's retry
with its X-Request-Id does once its audit row is gone (the router's endpoints on the suite's
cluster): a ban in force answers as before, a lift or a ban lifted since is a new request."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import psycopg
import pytest

import router.moderation
import shardlb.moderation
from shardlb import keys, prune, times
from shardlb.archive import connect_db
from shardlb.cli import main
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of
from tests.test_prune import own_db, plan_nodes

pytestmark = pytest.mark.cluster


async def audit_rows(db: psycopg.AsyncConnection[Any], old: int, recent: int) -> list[str]:
    """``old`` audit rows written 400 days ago, then ``recent`` written 10 days ago, in the order the
    router inserts them (id order is time order); their request ids."""
    requests = [f"old-{n}" for n in range(old)] + [f"recent-{n}" for n in range(recent)]
    for request in requests:
        days = 400 if request.startswith("old") else 10
        await db.execute(
            "INSERT INTO moderation_audit (action, board, player_id, actor, reason, request_id, at) "
            "VALUES ('ban', NULL, 'p', 'key:a', '', %s, now() - make_interval(days => %s))",
            (request, days),
        )
    return requests


async def audit_left(db: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await db.execute("SELECT request_id FROM moderation_audit ORDER BY id")
    return [row[0] for row in await cur.fetchall()]


async def test_a_prune_removes_audit_rows_older_than_the_days_asked_in_bounded_batches(
    store: BoardStore, postgres_url: str
) -> None:
    """moderation_audit grew for good: nothing removed a row of it. With ``audit_days`` a prune
    removes the rows older than that, ``batch`` a transaction and at most ``limit`` a call (counted
    with the other tables' rows), and says how many; called again it goes on, and the rows within
    the days stay. Without it none goes (opt-in), and days below the minimum are refused."""
    async with own_db(postgres_url, "prune_audit") as url:
        db = await connect_db(url)
        try:
            requests = await audit_rows(db, 45, 10)
            report = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20, refused_days=1)
            assert report.done and report.audit == 0 and await audit_left(db) == requests

            removed, calls = 0, 0
            while True:
                report = await prune.prune(db, store.client, grace_s=0, batch=7, limit=20, audit_days=365)
                calls += 1
                assert report.audit <= 20 and not report.rows and report.refused == 0
                removed += report.audit
                assert await audit_left(db) == requests[removed:]
                if report.done:
                    break
                assert report.audit == 20
            assert removed == 45 and calls == 3
            again = await prune.prune(db, store.client, grace_s=0, audit_days=365)
            assert again.done and again.audit == 0
            assert await audit_left(db) == [f"recent-{n}" for n in range(10)]
            # a request id's retry is recognised for AUDIT_MIN_DAYS at least
            with pytest.raises(ValueError, match="30 or more"):
                await prune.prune(db, store.client, grace_s=0, audit_days=prune.AUDIT_MIN_DAYS - 1)
            assert len(await audit_left(db)) == 10
        finally:
            await db.close()


async def test_the_prune_command_removes_audit_rows_when_asked(
    store: BoardStore, postgres_url: str, cluster_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardlb prune --audit-days N` says how many rows of moderation_audit it removed; without the
    option it removes none and says nothing of them; days below the minimum (30: a ban's, lift's or
    removal's retry reads its row) are a usage error (2) that says why, and remove nothing."""
    async with own_db(postgres_url, "prune_audit_command") as url:
        db = await connect_db(url)
        try:
            await audit_rows(db, 3, 2)
            capsys.readouterr()
            command = ["prune", "--redis", cluster_url, "--postgres", url]
            assert await asyncio.to_thread(main, command) == 0
            said = capsys.readouterr().out
            assert "moderation_audit" not in said and len(await audit_left(db)) == 5, said
            for bad in ("0", "-1", "x", "29", "1.5"):
                with pytest.raises(SystemExit) as e:
                    main([*command, "--audit-days", bad])
                assert e.value.code == 2
                err = capsys.readouterr().err
                assert "--audit-days" in err and "30 or more" in err and "retry" in err, err
            assert len(await audit_left(db)) == 5
            assert await asyncio.to_thread(main, [*command, "--audit-days", "365"]) == 0
            said = capsys.readouterr().out
            assert "moderation_audit older than 365 days: 3 rows removed" in said, said
            assert "nothing left to prune" in said and len(await audit_left(db)) == 2
            with pytest.raises(SystemExit) as e:
                main(["prune", "--help"])
            assert e.value.code == 0 and "--audit-days" in capsys.readouterr().out
        finally:
            await db.close()


async def test_a_batch_of_audit_rows_reads_a_bounded_part_of_the_index(postgres_url: str) -> None:
    """A batch of moderation_audit reads the oldest ``batch`` rows by the primary key (the table's
    only index by time; id order is the order rows were written in), never the whole table: no index
    on ``at`` is needed, and the schema does not change."""
    async with own_db(postgres_url, "prune_audit_plan") as url:
        db = await connect_db(url)
        try:
            await db.execute(
                "INSERT INTO moderation_audit (action, board, player_id, actor, reason, request_id) "
                "SELECT 'remove', 'b', 'p' || n, 'key:a', '', 'r' || n FROM generate_series(1, 50000) n"
            )
            await db.execute("ANALYZE moderation_audit")
            # none older than the days: the batch removes nothing, and reads 100 entries to know it
            cur = await db.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + prune.AUDIT_BATCH, (100, 30))
            row = await cur.fetchone()
            assert row is not None
            scans = list(plan_nodes(row[0][0]["Plan"]))
            assert {n["Node Type"] for n in scans} & {"Seq Scan", "Bitmap Heap Scan"} == set(), scans
            [index] = [n for n in scans if n.get("Index Name") == "moderation_audit_pkey"]
            assert index["Actual Rows"] <= 100, index
            assert len(await audit_left(db)) == 50_000
        finally:
            await db.close()


# ---- retries once the request's audit row is gone ---------------------------------------------


@contextlib.asynccontextmanager
async def router_on_own_db(
    cluster_url: str, postgres_url: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Any, httpx.AsyncClient, str]]:
    """A router whose PostgreSQL is a database of the test's own (a prune there ages and removes
    this test's audit rows only); bans answered without the routers' 2.5 s wait."""
    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with own_db(postgres_url, name) as url, running(cluster_url, postgres_url=url) as (app, client):
        yield app, client, url


async def pruned_audit_of(url: str, client: Any, player: str) -> int:
    """Age ``player``'s audit rows past the minimum retention and prune with it: what a nightly
    `shardlb prune --audit-days 30` does to a request's row 31 days on. How many rows went."""
    db = await connect_db(url)
    try:
        await db.execute(
            "UPDATE moderation_audit SET at = at - make_interval(days => %s) WHERE player_id = %s",
            (prune.AUDIT_MIN_DAYS + 1, player),
        )
        report = await prune.prune(db, client, grace_s=86_400, audit_days=prune.AUDIT_MIN_DAYS)
        assert report.done
        return report.audit
    finally:
        await db.close()


async def audited(url: str, player: str) -> list[tuple[str, str]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as db:
        cur = await db.execute(
            "SELECT action, request_id FROM moderation_audit WHERE player_id = %s ORDER BY id", (player,)
        )
        return [(row[0], row[1]) for row in await cur.fetchall()]


async def make_board(client: httpx.AsyncClient, **settings: Any) -> str:
    name = board_name("aud")
    r = await client.put(f"/v1/boards/{name}", json={"periods": ["total"], **settings}, headers=AS_ADMIN)
    assert r.status_code == 201, r.text
    return name


async def post(client: httpx.AsyncClient, board: str, player: str, points: int, match: str, at: int) -> str:
    body = {"scores": [{"player_id": player, "points": points, "match_id": match, "achieved_at": at}]}
    r = await client.post(f"/v1/boards/{board}/scores", json=body, headers=AS_WRITER)
    assert r.status_code == 200, r.text
    return cast(str, r.json()["results"][0]["status"])


async def act(
    client: httpx.AsyncClient, player: str, action: str, body: dict[str, Any], request_id: str
) -> Any:
    r = await client.post(
        f"/v1/players/{player}:{action}", json=body, headers={**AS_ADMIN, "X-Request-Id": request_id}
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_ban_in_force_whose_audit_row_was_pruned_answers_its_retry_as_before(
    cluster_url: str, postgres_url: str, store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing reads a ban's audit row for the ban's state: ``bans`` holds the ban in force (its
    author, reason, time, request id and incarnation), which the routers, a rebuild, a settlement and
    GET /v1/bans read. So the row of a ban in force may go: the ban stays in force, its retry with
    its X-Request-Id answers the same ban and stores nothing new (it is audited again, as a request
    that found the ban in force), and its lift lifts it."""
    on_own_db = router_on_own_db(cluster_url, postgres_url, "prune_audit_ban", monkeypatch)
    async with on_own_db as (app, client, url):
        name = await make_board(client)
        player, scope = f"inforce-{name}", {"scope": "board", "board": name, "reason": "aimbot"}
        first = await act(client, player, "ban", scope, f"b1-{name}")
        listed = (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json()
        assert await pruned_audit_of(url, store.client, player) == 1
        assert await audited(url, player) == []
        assert (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json() == listed
        assert await post(client, name, player, 5, "m1", times.now_ms()) == "banned"
        again = await act(client, player, "ban", {**scope, "reason": "retry"}, f"b1-{name}")
        assert again == first
        assert (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json() == listed
        assert service_of(app).moderation.bans.banned(name, player)
        lifted = await act(client, player, "unban", {"scope": "board", "board": name}, f"u1-{name}")
        assert lifted["lifted"] is True
        assert await audited(url, player) == [("ban", f"b1-{name}"), ("unban", f"u1-{name}")]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_or_lift_retried_after_its_audit_row_was_pruned_is_a_new_request(
    cluster_url: str, postgres_url: str, store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its audit row a request id is forgotten: a ban retried after its lift bans again, and a
    lift retried after a new ban lifts that ban, as requests of their own (audited again). Within
    the days the rows are kept (30 at least) the same retries change nothing (test_moderation_router:
    `a_ban_retried_after_it_was_lifted_does_not_ban_again`, `an_unban_retried_after_a_new_ban`)."""
    on_own_db = router_on_own_db(cluster_url, postgres_url, "prune_audit_again", monkeypatch)
    async with on_own_db as (app, client, url):
        name = await make_board(client)
        player, scope = f"again-{name}", {"scope": "board", "board": name}
        await act(client, player, "ban", {**scope, "reason": "aimbot"}, f"b1-{name}")
        assert (await act(client, player, "unban", scope, f"u1-{name}"))["lifted"] is True
        assert await pruned_audit_of(url, store.client, player) == 2
        again = await act(client, player, "ban", {**scope, "reason": "retry"}, f"b1-{name}")
        assert again["reason"] == "retry"  # a new ban
        listed = (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json()["bans"]
        assert [b["reason"] for b in listed] == ["retry"]
        assert service_of(app).moderation.bans.banned(name, player)
        assert await pruned_audit_of(url, store.client, player) == 1
        assert (await act(client, player, "unban", scope, f"u1-{name}"))["lifted"] is True  # lifts it
        assert (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json() == {"bans": []}
        assert await audited(url, player) == [("unban", f"u1-{name}")]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.parametrize("window", ["within", "past"])
async def test_a_removal_retried_after_its_audit_row_was_pruned(
    cluster_url: str, postgres_url: str, store: BoardStore, monkeypatch: pytest.MonkeyPatch, window: str
) -> None:
    """A DELETE retried with its X-Request-Id once its audit row is gone: within the board's dedup
    window (30 days at most, never longer than the rows are kept) every shard's record of the request
    still makes it the same removal, and the result posted since stays; past the window, with the
    records gone too, it is a removal of its own, and removes the results posted since."""
    on_own_db = router_on_own_db(cluster_url, postgres_url, f"prune_audit_rm_{window}", monkeypatch)
    async with on_own_db as (_, client, url):
        name = await make_board(client, mode="incr")
        now = times.now_ms()
        await post(client, name, "p1", 10, "m1", now - 1_200_000)
        await post(client, name, "p2", 5, "m2", now - 1_200_000)
        target, asked = f"/v1/boards/{name}/players/p1", {**AS_ADMIN, "X-Request-Id": f"del-{name}"}
        with monkeypatch.context() as m:
            back = types.SimpleNamespace(now_ms=lambda: now - 600_000)
            m.setattr(shardlb.moderation, "times", back)
            m.setattr(router.moderation, "times", back)
            first = await client.delete(target, headers=asked)
        assert (first.status_code, first.json()["removed"]) == (200, True)
        assert await post(client, name, "p1", 7, "m3", now) == "improved"
        assert await pruned_audit_of(url, store.client, "p1") == 1
        if window == "past":
            for prefix in (await store.get(name)).prefixes:
                await store.client.delete(keys.removals_key(prefix))
        again = await client.delete(target, headers=asked)
        assert again.status_code == 200, again.text
        got = await client.get(f"/v1/boards/{name}/players/p1")
        if window == "within":
            assert again.json() == first.json()
            assert (got.status_code, got.json().get("points")) == (200, 7), got.text
        else:
            assert again.json()["removed"] is True and got.status_code == 404, got.text
        assert await audited(url, "p1") == [("remove", f"del-{name}")]  # the retry's own row
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
