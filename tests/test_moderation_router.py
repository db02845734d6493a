"""Moderation through the router (router/moderation.py) on the suite's cluster and PostgreSQL: a
removal over HTTP is absent from every read and audited with who, why and the request id; bans refuse
later scores per score (`banned`, nothing written) in every router process once it refreshed its list,
and a rebuild leaves banned players out; sanity limits refuse and log with the request id, and a retry
of a counted match is not a second result; bad inputs are 4xx and write nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import httpx
import psycopg
import pytest

import router.boards
import shardlb.moderation
from shardlb import keys, times
from shardlb.archive import connect_db
from shardlb.board import Score
from shardlb.connection import connect
from shardlb.moderation import Screen
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster


def score(player: str, points: int, match: str, at: int | None = None) -> dict[str, Any]:
    return {"player_id": player, "points": points, "match_id": match, "achieved_at": at or times.now_ms()}


async def post(
    client: httpx.AsyncClient, board: str, scores: list[dict[str, Any]], **headers: str
) -> list[str]:
    r = await client.post(
        f"/v1/boards/{board}/scores", json={"scores": scores}, headers={**AS_WRITER, **headers}
    )
    assert r.status_code == 200, r.text
    return [result["status"] for result in r.json()["results"]]


async def rows(postgres_url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """The rows of ``sql``; none while its table is not made yet (the router's background task
    makes ``refused_results`` as it first writes to it: a test alone may look before that)."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as db:
        try:
            cur = await db.execute(sql, args)
        except psycopg.errors.UndefinedTable:
            return []
        return await cur.fetchall()


async def make_board(client: httpx.AsyncClient, **settings: Any) -> str:
    name = board_name("mod")
    r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"], **settings}, headers=AS_ADMIN)
    assert r.status_code == 201, r.text
    return name


async def test_a_removal_is_absent_from_every_read_audited_and_retry_safe(
    cluster_url: str, postgres_url: str
) -> None:
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        await post(client, name, [score(f"p{i}", 10 * i, f"m{i}") for i in range(10)])
        r = await client.delete(
            f"/v1/boards/{name}/players/p4?reason=cheating", headers={**AS_ADMIN, "X-Request-Id": "del-1"}
        )
        assert r.status_code == 200 and r.json() == {"board": name, "player_id": "p4", "removed": True}
        for period in ("total", "daily"):
            assert (await client.get(f"/v1/boards/{name}/players/p4?period={period}")).status_code == 404
            assert (
                await client.get(f"/v1/boards/{name}/players/p4/around?period={period}")
            ).status_code == 404
            for path in ("top", "entries"):
                got = (await client.get(f"/v1/boards/{name}/{path}?period={period}")).json()["entries"]
                assert [e["player_id"] for e in got] == [f"p{i}" for i in (9, 8, 7, 6, 5, 3, 2, 1, 0)]
                assert [e["rank"] for e in got] == list(range(1, 10))
            found = await client.post(
                f"/v1/boards/{name}/players:query", json={"player_ids": ["p4", "p5"], "period": period}
            )
            assert [e["player_id"] for e in found.json()["entries"]] == ["p5"]
        again = await client.delete(f"/v1/boards/{name}/players/p4", headers=AS_ADMIN)  # a retry converges
        assert again.status_code == 200 and again.json()["removed"] is False
        audit = await rows(
            postgres_url,
            "SELECT action, board, player_id, actor, reason, request_id FROM moderation_audit "
            "WHERE board = %s ORDER BY id",
            name,
        )
        assert [a[:3] for a in audit] == [("remove", name, "p4")] * 2
        assert audit[0][3].startswith("key:") and audit[0][4:] == ("cheating", "del-1")
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_removal_is_absent_from_the_routers_cached_reads_once_answered(
    cluster_url: str, postgres_url: str
) -> None:
    # Caches refreshed once an hour: what a read shows after the answer comes from the removal, not
    # from a refresh. Until 2026-12-05 the top cache and the histograms kept the copy read before
    # the removal: /top listed the player removed, ranked, and estimates counted them.
    slow = {"top_refresh_s": 3600.0, "histogram_refresh_s": 3600.0}
    async with running(cluster_url, postgres_url=postgres_url, **slow) as (_, client):
        name = await make_board(client)
        await post(client, name, [score(f"p{i}", 10 * i, f"m{i}") for i in range(6)])
        for player, path, headers in [
            ("p4", f"/v1/boards/{name}/players/p4", {"X-Request-Id": "cached-1"}),
            ("p3", "/v1/players/p3:ban", {}),
        ]:
            for period in ("total", "daily"):  # kept, and its rendering remembered (router/hot.py)
                top = (await client.get(f"/v1/boards/{name}/top?period={period}")).json()["entries"]
                assert player in [e["player_id"] for e in top]
            before = (await client.get(f"/v1/boards/{name}/players/p0?estimate=true")).json()["players"]
            if path.endswith(":ban"):
                body = {"scope": "board", "board": name, "reason": "cheating"}
                r = await client.post(path, json=body, headers={**AS_ADMIN, **headers})
            else:
                r = await client.delete(path, headers={**AS_ADMIN, **headers})
            assert r.status_code == 200, r.text
            for period in ("total", "daily"):
                top = (await client.get(f"/v1/boards/{name}/top?period={period}")).json()["entries"]
                assert player not in [e["player_id"] for e in top]
                assert [e["rank"] for e in top] == list(range(1, len(top) + 1))
            guess = (await client.get(f"/v1/boards/{name}/players/p0?estimate=true")).json()
            assert guess["players"] == before - 1 and guess["rank"] == before - 1
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_bad_removals_are_refused_and_write_nothing(cluster_url: str, postgres_url: str) -> None:
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        await post(client, name, [score("p1", 5, "m1")])
        before = await rows(postgres_url, "SELECT count(*) FROM moderation_audit")
        cases = [
            (f"/v1/boards/{name}/players/p1", AS_WRITER, 403),
            (f"/v1/boards/{name}/players/p1", {}, 401),
            (f"/v1/boards/{name}/players/p!1", AS_ADMIN, 422),
            (f"/v1/boards/{name}/players/p1?reason={'x' * 501}", AS_ADMIN, 422),
            (f"/v1/boards/{name}/players/p1?why=x", AS_ADMIN, 400),
            ("/v1/boards/mod-nobody/players/p1", AS_ADMIN, 404),
        ]
        for path, headers, status in cases:
            assert (await client.delete(path, headers=headers)).status_code == status, path
        assert await rows(postgres_url, "SELECT count(*) FROM moderation_audit") == before
        assert (await client.get(f"/v1/boards/{name}/players/p1")).json()["points"] == 5
    async with running(cluster_url) as (_, client):  # no PostgreSQL: no audit, so no removal
        r = await client.delete(f"/v1/boards/{name}/players/p1", headers=AS_ADMIN)
        assert r.status_code == 409 and r.json()["error"]["code"] == "archive_not_configured"
        assert (await client.get(f"/v1/boards/{name}/players/p1")).status_code == 200
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_refuses_later_scores_in_every_router_and_a_rebuild_leaves_the_player_out(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        running(cluster_url, postgres_url=postgres_url) as (_, client),
        running(cluster_url, postgres_url=postgres_url) as (other_app, other),
    ):
        name = await make_board(client)
        await post(client, name, [score("cheat", 50, "m1"), score("fair", 40, "m2")])
        bad = [
            ({"scope": "board"}, 422),
            ({"scope": "all", "board": name}, 422),
            ({"scope": "everywhere"}, 422),
            ({"scope": "board", "board": name, "why": "x"}, 422),
            ({"scope": "board", "board": "mod-nobody"}, 404),
        ]
        for body, status in bad:
            assert (
                await client.post("/v1/players/cheat:ban", json=body, headers=AS_ADMIN)
            ).status_code == status
        assert (
            await client.post("/v1/players/cheat:ban", json={"scope": "all"}, headers=AS_WRITER)
        ).status_code == 403
        assert (await client.get("/v1/bans?player=cheat", headers=AS_ADMIN)).json() == {"bans": []}
        r = await client.post(
            "/v1/players/cheat:ban",
            json={"scope": "board", "board": name, "reason": "aimbot"},
            headers=AS_ADMIN,
        )
        assert r.status_code == 200, r.text
        assert r.json()["removed_from"] == [name] and r.json()["reason"] == "aimbot"
        await service_of(other_app).moderation.bans.refresh()  # what its refresh task does every second
        for n, c in enumerate((client, other)):
            statuses = await post(c, name, [score("cheat", 90, f"c{n}"), score("fair", 45 + n, f"f{n}")])
            assert statuses == ["banned", "improved"]
        assert (await client.get(f"/v1/boards/{name}/players/cheat")).status_code == 404  # nothing written
        listed = (await client.get("/v1/bans?player=cheat", headers=AS_ADMIN)).json()["bans"]
        assert [(b["player_id"], b["scope"], b["board"]) for b in listed] == [("cheat", "board", name)]
        rebuilt = await client.post(f"/v1/boards/{name}:rebuild", headers=AS_ADMIN)
        assert rebuilt.status_code == 200, rebuilt.text
        assert [
            e["player_id"] for e in (await client.get(f"/v1/boards/{name}/entries")).json()["entries"]
        ] == ["fair"]
        lifted = await client.post(
            "/v1/players/cheat:unban", json={"scope": "board", "board": name}, headers=AS_ADMIN
        )
        assert lifted.json() == {"player_id": "cheat", "lifted": True}
        # The ban's removal takes the player's results dated up to 5 minutes after it for replays
        # of before it (docs/design-notes.md, "A retry after a removal"); past that, they count.
        assert await post(client, name, [score("cheat", 20, "m5")]) == ["duplicate"]
        # With no such margin, a lifted ban lets the player's later results count at once.
        monkeypatch.setattr(shardlb.moderation, "MAX_FUTURE_MS", 0)
        for action in ("ban", "unban"):
            r = await client.post(
                f"/v1/players/other:{action}", json={"scope": "board", "board": name}, headers=AS_ADMIN
            )
            assert r.status_code == 200, r.text
        later = times.now_ms() + 2_000
        assert await post(client, name, [score("other", 20, "m6", later)]) == ["improved"]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_without_a_reason_has_the_empty_reason_everywhere(
    cluster_url: str, postgres_url: str
) -> None:
    """A reason is optional (left out or null): the ban's is then "", never null, in its answer,
    in GET /v1/bans, in PostgreSQL and in the audit (router/README.md; the OpenAPI Ban's reason is
    a string), as a removal without `?reason=` is audited with ""."""
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        for n, sent in enumerate(({}, {"reason": None})):
            player = f"quiet{n}"
            scope = {"scope": "board", "board": name}
            r = await client.post(f"/v1/players/{player}:ban", json={**scope, **sent}, headers=AS_ADMIN)
            assert r.status_code == 200 and r.json()["reason"] == "", r.text
            listed = (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json()["bans"]
            assert [b["reason"] for b in listed] == [""]
            assert await rows(postgres_url, "SELECT reason FROM bans WHERE player_id = %s", player) == [("",)]
            audited = "SELECT action, reason FROM moderation_audit WHERE player_id = %s ORDER BY id"
            assert await rows(postgres_url, audited, player) == [("ban", "")]
            lifted = await client.post(f"/v1/players/{player}:unban", json=scope, headers=AS_ADMIN)
            assert lifted.json() == {"player_id": player, "lifted": True}
            assert await rows(postgres_url, audited, player) == [("ban", ""), ("unban", "")]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_sanity_limits_refuse_and_log_with_the_request_id(cluster_url: str, postgres_url: str) -> None:
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client, max_points_per_result=100, max_results_per_player_per_minute=3)
        board = (await client.get(f"/v1/boards/{name}")).json()
        assert board["max_points_per_result"] == 100 and board["inactive_after"] is None
        at = times.now_ms()
        statuses = await post(
            client,
            name,
            [
                score("p1", 101, "big", at),
                *(score("p1", i, f"m{i}", at) for i in range(1, 6)),
                score("p2", 7, "x", at),
            ],
            **{"X-Request-Id": "sanity-1"},
        )
        assert statuses == [
            "points_limit",
            "improved",
            "improved",
            "improved",
            "rate_limit",
            "rate_limit",
            "improved",
        ]
        assert (await client.get(f"/v1/boards/{name}/players/p1")).json()["points"] == 3
        for _ in range(100):  # the log is written off the write path, by a background task
            logged = await rows(
                postgres_url,
                "SELECT player_id, match_id, status, request_id FROM refused_results "
                "WHERE board = %s ORDER BY id",
                name,
            )
            if len(logged) == 3:
                break
            await asyncio.sleep(0.05)
        assert logged == [
            ("p1", "big", "points_limit", "sanity-1"),
            ("p1", "m4", "rate_limit", "sanity-1"),
            ("p1", "m5", "rate_limit", "sanity-1"),
        ]
        bad = await client.put(
            f"/v1/boards/{board_name()}", json={"max_points_per_result": 0}, headers=AS_ADMIN
        )
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "max_points_per_result"
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_refused_result_answers_the_players_total_as_every_result_does(cluster_url: str) -> None:
    """api.md: a result's ``points`` is the player's value on the total board after the write. A
    result refused by a sanity limit changes nothing, so it answers the total as it stands after
    the results before it (those of the same call included), as ``overflow`` and
    ``region_conflict`` do; it answered 0, as if the player had lost every point."""
    async with running(cluster_url) as (_, client):
        name = await make_board(client, max_points_per_result=100, max_results_per_player_per_minute=2)
        at = times.now_ms()
        body = [
            score("p1", 40, "m1", at),
            score("p1", 500, "big", at),  # points_limit, after m1
            score("p1", 60, "m2", at),
            score("p1", 70, "m3", at),  # rate_limit, after m2
            score("p2", 900, "x", at),  # points_limit, no total yet
        ]
        r = await client.post(f"/v1/boards/{name}/scores", json={"scores": body}, headers=AS_WRITER)
        assert r.status_code == 200, r.text
        assert [(x["status"], x["points"]) for x in r.json()["results"]] == [
            ("improved", 40),
            ("points_limit", 40),
            ("improved", 60),
            ("rate_limit", 60),
            ("points_limit", 0),
        ]
        # Refused alone in a later call: the total the board holds.
        r = await client.post(
            f"/v1/boards/{name}/scores", json={"scores": [score("p1", 999, "big2", at)]}, headers=AS_WRITER
        )
        assert r.status_code == 200, r.text
        assert [(x["status"], x["points"]) for x in r.json()["results"]] == [("points_limit", 60)]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_retried_match_counts_once_against_the_per_minute_limit(store: BoardStore) -> None:
    from shardlb.config import BoardConfig

    config = BoardConfig.from_dict(
        "mod-rate", {"max_results_per_player_per_minute": 2, "sharding": {"shards": 2}}
    )
    board, _ = await store.create(config)
    try:
        screen = Screen(lambda board, player, incarnation: False)
        now = 1_790_000_000_000  # one fixed minute (and the next)
        first = board.prepare([Score("p", 1, "a"), Score("p", 2, "b"), Score("q", 1, "a")], now)
        assert await screen.refusals(board, first, now) == []
        again = board.prepare([Score("p", 2, "b"), Score("p", 1, "a"), Score("p", 3, "c")], now + 1000)
        assert [(r.position, r.status) for r in await screen.refusals(board, again, now + 1000)] == [
            (2, "rate_limit")
        ]
        # A retry of a counted match a minute later is still the same result; a new one counts anew.
        later = board.prepare([Score("p", 1, "a"), Score("p", 3, "c")], now + 60_000)
        assert await screen.refusals(board, later, now + 60_000) == []
    finally:
        await store.delete(config.id)


async def test_a_retried_ban_answers_the_ban_stored_and_is_audited_once(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ban retried (its answer lost: the same X-Request-Id), even with another reason, answers the
    ban that is kept (the first's time and reason, as GET /v1/bans and PostgreSQL have them), writes
    one audit row, and passes at the cap on bans, which only a new ban would exceed. A ban asked
    for again under another request id answers the same, and is audited as a request of its own."""
    import router.moderation
    import shardlb.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        name = await make_board(client)
        player = f"twice-{name}"
        url, asked = f"/v1/players/{player}:ban", {**AS_ADMIN, "X-Request-Id": f"twice-{name}"}
        scope = {"scope": "board", "board": name}
        first = await client.post(url, json={**scope, "reason": "aimbot"}, headers=asked)
        assert first.status_code == 200, first.text
        await asyncio.sleep(0.05)
        held = await service_of(app).client.hlen(keys.BANS)
        monkeypatch.setattr(shardlb.moderation, "MAX_BANS", held)
        again = await client.post(url, json={**scope, "reason": "wallhack"}, headers=asked)
        assert again.status_code == 200, again.text
        kept = {k: first.json()[k] for k in ("player_id", "scope", "board", "reason", "by", "banned_at")}
        assert {k: again.json()[k] for k in kept} == kept
        listed = (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json()["bans"]
        assert listed == [kept]
        [(reason, at)] = await rows(
            postgres_url,
            "SELECT reason, (extract(epoch FROM banned_at) * 1000)::bigint FROM bans WHERE player_id = %s",
            player,
        )
        assert (reason, times.format_ms(at)) == ("aimbot", kept["banned_at"])
        audited = await rows(
            postgres_url,
            "SELECT count(*) FROM moderation_audit WHERE action = 'ban' AND player_id = %s",
            player,
        )
        assert audited == [(1,)]
        another = await client.post(url, json=scope, headers=AS_ADMIN)
        assert {k: another.json()[k] for k in kept} == kept
        audited = await rows(
            postgres_url,
            "SELECT request_id = %s, detail ->> 'kept' FROM moderation_audit WHERE action = 'ban' "
            "AND player_id = %s ORDER BY id",
            f"twice-{name}",
            player,
        )
        assert audited == [(True, None), (False, "true")]
        other = await client.post(
            f"/v1/players/other-{name}:ban", json={"scope": "board", "board": name}, headers=AS_ADMIN
        )
        assert other.status_code == 409  # a new ban past the cap
        await client.post(
            url.replace(":ban", ":unban"), json={"scope": "board", "board": name}, headers=AS_ADMIN
        )
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_retries_sent_at_once_or_of_an_unban_are_audited_once_per_request_id(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose DELETE timed out may send its retry (the same X-Request-Id) while the first is
    still running: each looked for the request id's audit row before either had written it, and both
    wrote one. A retried unban wrote a row each time too. One row per request id now."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        await post(client, name, [score("p1", 5, "m1")])
        retry = {**AS_ADMIN, "X-Request-Id": f"del-{name}"}
        answers = await asyncio.gather(
            *(client.delete(f"/v1/boards/{name}/players/p1", headers=retry) for _ in range(6))
        )
        assert [a.status_code for a in answers] == [200] * 6
        assert [a.json()["removed"] for a in answers] == [True] * 6  # each answers as the first
        for scope in ({"scope": "board", "board": name}, {"scope": "all"}):
            await client.post("/v1/players/p1:ban", json=scope, headers=AS_ADMIN)
            unban = {**AS_ADMIN, "X-Request-Id": f"unban-{scope['scope']}-{name}"}
            lifted = [
                (await client.post("/v1/players/p1:unban", json=scope, headers=unban)).json()["lifted"]
                for _ in range(2)
            ]
            assert lifted == [True, True]  # the retry answers as the first (since 2026-12-05)
        audited = await rows(
            postgres_url,
            "SELECT action, request_id, count(*) FROM moderation_audit WHERE player_id = 'p1' "
            "AND request_id LIKE %s GROUP BY action, request_id ORDER BY request_id",
            f"%{name}",
        )
        assert audited == [
            ("remove", f"del-{name}", 1),
            ("unban", f"unban-all-{name}", 1),
            ("unban", f"unban-board-{name}", 1),
        ]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_removal_and_a_ban_that_meet_a_reshard_wait_it_out_and_are_audited_once(
    cluster_url: str, postgres_url: str, store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal (DELETE, or a ban's) that reached a board's old layout after a reshard was answered
    503: after the ban was stored, and with scope `all` the boards after that one were left out;
    a retried DELETE wrote a second audit row (a reshard audit's finding). Both now wait out the
    cut-over as score writes do (router/boards.py, through_reshard), and a DELETE retried with the
    same X-Request-Id is not audited again."""
    import router.moderation
    from shardlb.reshard import Resharder

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    # A router that does not see the reshards before its calls (its looks at the registry's
    # version failing, or a router of the release before: router/boards.py, ``follow``).
    monkeypatch.setattr(router.boards, "FOLLOW_S", 3600.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        service_of(app).boards.ttl_s = 3600.0  # nor when its copies expire (a slow run's reshards)
        removed, banned = [await make_board(client, durability="memory") for _ in range(2)]
        for name in (removed, banned):
            await post(client, name, [score(f"p{i}", 10 * i, f"m{i}") for i in range(10)])
        for name in (removed, banned):  # the router keeps the old layouts meanwhile
            await Resharder(store, name, say=lambda _: None, cache_s=0).start(4)
            await Resharder(store, name, say=lambda _: None, cache_s=0).run()
        kept = [service_of(app).boards.cached(name) for name in (removed, banned)]
        assert [b.generation if b else None for b in kept] == [0, 0]
        url, asked = f"/v1/boards/{removed}/players/p4?reason=cheat", {**AS_ADMIN, "X-Request-Id": "rm-1"}
        r = await client.delete(url, headers=asked)
        assert (r.status_code, r.json()) == (200, {"board": removed, "player_id": "p4", "removed": True})
        again = await client.delete(url, headers=asked)  # a retry whose answer was lost: as the first
        assert (again.status_code, again.json()["removed"]) == (200, True)
        audit = await rows(postgres_url, "SELECT request_id FROM moderation_audit WHERE board = %s", removed)
        assert audit == [("rm-1",)]
        r = await client.post(
            "/v1/players/p5:ban", json={"scope": "board", "board": banned}, headers=AS_ADMIN
        )
        assert (r.status_code, r.json().get("removed_from")) == (200, [banned]), r.text
        for name, gone in ((removed, "p4"), (banned, "p5")):
            top = (await client.get(f"/v1/boards/{name}/top?limit=20")).json()["entries"]
            assert gone not in {e["player_id"] for e in top} and len(top) == 9
        await client.post("/v1/players/p5:unban", json={"scope": "board", "board": banned}, headers=AS_ADMIN)
        for name in (removed, banned):
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def refusals_recorded(postgres_url: str, board: str, *apps: Any) -> list[tuple[Any, ...]]:
    """``board``'s rows of refused_results once every router's background log has written what it
    was given (a row leaves its queue only after its commit)."""
    for _ in range(200):
        if not any(service_of(app).moderation.refusals.rows for app in apps):
            break
        await asyncio.sleep(0.05)
    return await rows(
        postgres_url,
        "SELECT player_id, match_id, points, status, request_id FROM refused_results "
        "WHERE board = %s ORDER BY id",
        board,
    )


async def test_a_refused_result_retried_after_a_503_is_recorded_once(
    cluster_url: str, postgres_url: str
) -> None:
    """A score call answered 503 after its refused results were queued for refused_results (here:
    the journal of the router the call reached is full; results are screened before anything is
    written), then sent again with the same X-Request-Id or none (the router then makes up another
    id): each call queued the refused result again, and refused_results held it once per call.
    One row per refused result now, the first call's."""
    body = [score("cheat", 1000, "big"), score("p1", 7, "m1")]
    async with (
        running(cluster_url, postgres_url=postgres_url, journal_max_results=1) as (full_app, full),
        running(cluster_url, postgres_url=postgres_url) as (other_app, other),
    ):
        name = await make_board(full, max_points_per_result=100, sharding={"shards": 1})
        await post(full, name, [score("p0", 5, "m0")])  # all the journal of `full` may hold
        url, asked = f"/v1/boards/{name}/scores", {**AS_WRITER, "X-Request-Id": "retry-1"}
        refused = await full.post(url, json={"scores": body}, headers=asked)
        assert refused.status_code == 503, refused.text
        # Sent again to a router with room (behind a load balancer), as the same request and as
        # another one.
        assert await post(other, name, body, **{"X-Request-Id": "retry-1"}) == ["points_limit", "improved"]
        assert await post(other, name, body) == ["points_limit", "unchanged"]
        recorded = await refusals_recorded(postgres_url, name, full_app, other_app)
        assert recorded == [("cheat", "big", 1000, "points_limit", "retry-1")]
        await full.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_refused_result_of_a_call_that_waits_out_a_reshard_is_recorded_once(
    cluster_url: str, postgres_url: str, store: BoardStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A score call that reached a board's old layout after a reshard is made again by the router
    itself on the new one (router/boards.py, through_reshard), and each attempt queued the results
    it refused (a log line each, and room in the bounded queue): one call answered 200 left its
    refused result twice in refused_results. Queued and logged once per call now."""
    from shardlb.reshard import Resharder

    class Refusals(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[dict[str, Any]] = []

        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage() == "result refused":
                self.seen.append(getattr(record, "fields", {}))

    logged, logger = Refusals(), logging.getLogger("shardlb.router")
    # A router that does not see the reshard before the call (router/boards.py, ``follow``).
    monkeypatch.setattr(router.boards, "FOLLOW_S", 3600.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        service_of(app).boards.ttl_s = 3600.0  # nor when its copy expires (a slow run's reshard)
        name = await make_board(client, durability="memory", max_points_per_result=100)
        await post(client, name, [score(f"p{i}", i, f"m{i}") for i in range(10)])
        await Resharder(store, name, say=lambda _: None, cache_s=0).start(4)
        await Resharder(store, name, say=lambda _: None, cache_s=0).run()
        kept = service_of(app).boards.cached(name)
        assert kept is not None and kept.generation == 0  # the router still holds the old layout
        body = [score("cheat", 500, "big"), score("p1", 50, "m50")]
        logger.addHandler(logged)
        try:
            statuses = await post(client, name, body, **{"X-Request-Id": "cut-1"})
        finally:
            logger.removeHandler(logged)
        assert statuses == ["points_limit", "improved"]
        assert [(f["player_id"], f["match_id"], f["request_id"]) for f in logged.seen] == [
            ("cheat", "big", "cut-1")
        ]
        recorded = await refusals_recorded(postgres_url, name, app)
        assert recorded == [("cheat", "big", 500, "points_limit", "cut-1")]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


class CountedBans(shardlb.moderation.Bans):
    """The ban list of a real cluster client, counting the refreshes that asked for its version
    (or for its mark, where a refresh that loads the whole list starts)."""

    asked = 0

    async def version(self) -> int:
        self.asked += 1
        return await super().version()

    async def mark(self, count: int) -> tuple[int, list[shardlb.moderation.Change]]:
        self.asked += 1
        return await super().mark(count)


async def until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_ban_list_outage_logs_its_start_and_end_not_every_refresh(store: BoardStore) -> None:
    """The ban refresher logged "ban list not refreshed" at every refresh it could not make: one
    warning a second per worker for as long as the cluster was out of reach. Now its first failure,
    then one a minute at most, and an info line once it refreshes again."""
    from router.moderation import BanCache
    from tests.test_router_logs import kept

    dead = connect("redis://127.0.0.1:1")  # nothing listens: every refresh fails at once
    cache = BanCache(CountedBans(dead), every_s=0.001)
    with kept("shardlb.router") as log:
        task = asyncio.create_task(cache.run())
        try:
            await until(lambda: cache.bans.asked >= 300, "300 refreshes")
            failed = cache.bans.asked
            cache.bans = shardlb.moderation.Bans(store.client)  # the cluster is back
            await until(lambda: cache.version >= 0, "a refresh that worked")
        finally:
            cache.closed = True
            await task
            await dead.aclose()
    warnings = log.lines(logging.WARNING)
    assert [m for m, _ in warnings] == ["ban list not refreshed"], len(warnings)
    [(message, fields)] = log.lines(logging.INFO)
    assert message == "ban list refreshed again" and fields["failures"] >= failed


async def test_a_postgresql_outage_logs_the_refusal_logs_retries_once_a_minute(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal log retried PostgreSQL every second and logged a warning each time: the same
    flood during a PostgreSQL outage. The rows wait (at most LOG_MAX) and go in once it is back."""
    import router.moderation
    from router.moderation import RefusalLog
    from tests.test_router_logs import kept

    tries: list[str] = []
    connect_db = router.moderation.connect_db

    async def counted(url: str) -> Any:  # the real connection, counted
        tries.append(url)
        return await connect_db(url)

    monkeypatch.setattr(router.moderation, "connect_db", counted)
    refusals = RefusalLog("postgresql://127.0.0.1:1/nothing")
    refusals.retry_s = 0.001
    match = f"outage-{times.now_ms()}"
    with kept("shardlb.router") as log:
        task = asyncio.create_task(refusals.run())
        try:
            refusals.add([("b", "p", match, 5, "banned", None)])
            await until(lambda: len(tries) >= 100, "100 tries")
            refusals.url = postgres_url
            await until(lambda: not refusals.rows, "the rows recorded")
        finally:
            refusals.closed = True
            refusals.ready.set()
            await task
    warnings = log.lines(logging.WARNING)
    assert [m for m, _ in warnings] == ["refused results not recorded; retrying"], len(warnings)
    [(message, fields)] = [line for line in log.lines(logging.INFO) if line[0] != "result refused"]
    assert message == "refused results recorded again" and fields["failures"] >= 99
    assert await rows(postgres_url, "SELECT status FROM refused_results WHERE match_id = %s", match) == [
        ("banned",)
    ]


@pytest.mark.parametrize("mode", ["incr", "best"])
async def test_a_removal_retried_with_its_request_id_keeps_the_results_posted_since(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """An admin's DELETE whose answer was lost is sent again with the same X-Request-Id after the
    player posted new results: the retry removed those too (the audit row was written once, the
    removal ran twice). It now ends as one removal followed by the new results, and answers as the
    first did; a DELETE with another request id is a removal of its own. The first removal is made
    10 minutes back on the removal's clock, so that a best board (whose record of a removal reaches
    5 minutes past it) takes a result achieved now as a new one (the router gives the removal its
    time, which its audit row keeps)."""
    import types

    import router.moderation

    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client, mode=mode, periods=["total"])
        now = times.now_ms()
        before = now - 1_200_000
        await post(client, name, [score("p1", 10, "m1", before), score("p2", 5, "m2", before)])
        url, asked = f"/v1/boards/{name}/players/p1", {**AS_ADMIN, "X-Request-Id": f"del-{name}"}
        with monkeypatch.context() as m:
            back = types.SimpleNamespace(now_ms=lambda: now - 600_000)
            m.setattr(shardlb.moderation, "times", back)
            m.setattr(router.moderation, "times", back)
            first = await client.delete(url, headers=asked)
        assert (first.status_code, first.json()["removed"]) == (200, True)
        assert await post(client, name, [score("p1", 7, "m3", now)]) == ["improved"]
        again = await client.delete(url, headers=asked)  # its answer was lost: sent again
        assert (again.status_code, again.json()) == (200, first.json())
        got = await client.get(f"/v1/boards/{name}/players/p1")
        assert (got.status_code, got.json().get("points")) == (200, 7), got.text
        top = (await client.get(f"/v1/boards/{name}/top")).json()["entries"]
        assert [(e["player_id"], e["points"]) for e in top] == [("p1", 7), ("p2", 5)]
        other = await client.delete(url, headers={**AS_ADMIN, "X-Request-Id": f"del-2-{name}"})
        assert (other.status_code, other.json()["removed"]) == (200, True)
        assert (await client.get(f"/v1/boards/{name}/players/p1")).status_code == 404
        audit = await rows(postgres_url, "SELECT request_id FROM moderation_audit WHERE board = %s", name)
        assert sorted(audit) == [(f"del-2-{name}",), (f"del-{name}",)]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.parametrize("mode", ["best", "incr"])
async def test_a_removal_retried_past_the_dedup_window_keeps_the_results_posted_since(
    cluster_url: str, postgres_url: str, store: BoardStore, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A DELETE retried with its X-Request-Id after the board's dedup window, when every shard has
    let its record of the request expire: the retry removed the player again, results posted since
    the first call included, although its audit row (kept in PostgreSQL) said it was the same
    request. It is now finished at the first call's time, which that row holds, as a retry within
    the window is: what the player posted since stays. The first call is made 10 minutes back on
    the router's clock, as in the test above (a best board's record reaches 5 minutes past it)."""
    import types

    import router.moderation

    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client, mode=mode, periods=["total"])
        now = times.now_ms()
        before = now - 1_200_000
        await post(client, name, [score("p1", 10, "m1", before), score("p2", 5, "m2", before)])
        url, asked = f"/v1/boards/{name}/players/p1", {**AS_ADMIN, "X-Request-Id": f"late-{name}"}
        with monkeypatch.context() as m:
            back = types.SimpleNamespace(now_ms=lambda: now - 600_000)
            m.setattr(shardlb.moderation, "times", back)
            m.setattr(router.moderation, "times", back)
            first = await client.delete(url, headers=asked)
        assert (first.status_code, first.json()["removed"]) == (200, True)
        board = await store.get(name)
        assert await post(client, name, [score("p1", 7, "m3", now)]) == ["improved"]
        for prefix in board.prefixes:  # the window is over: every shard's records have expired
            await store.client.delete(keys.removals_key(prefix))
        again = await client.delete(url, headers=asked)
        assert again.status_code == 200, again.text
        assert again.json()["removed"] is False  # nothing of before the first call was left
        got = await client.get(f"/v1/boards/{name}/players/p1")
        assert (got.status_code, got.json().get("points")) == (200, 7), got.text
        audit = await rows(postgres_url, "SELECT request_id FROM moderation_audit WHERE board = %s", name)
        assert audit == [(f"late-{name}",)]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_removal_half_applied_is_finished_by_its_retry_at_the_first_calls_time(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal on a region board runs on the player's shard in every region; here the call to the
    `na` shard is lost (503) after the `eu` one, where the player lived, removed them. The player
    then posts in `na`, and the admin sends the DELETE again with its X-Request-Id: the retry leaves
    `eu` as the first call left it and finishes `na` as the first call would have, at its time, so
    the result posted since stays, and answers as the first call would have (removed)."""
    from redis.exceptions import ConnectionError as Lost

    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        regions = {"strategy": "region", "regions": ["eu", "na"], "shards_per_region": 2}
        name = await make_board(client, mode="incr", periods=["total"], sharding=regions)
        now = times.now_ms()
        await post(client, name, [{**score("p1", 10, "m1", now - 60_000), "region": "eu"}])
        await post(client, name, [{**score("p2", 5, "m2", now - 60_000), "region": "eu"}])
        layout = (await service_of(app).boards.get(name)).layout
        na = layout.home("p1", "na")
        remove_on_shard, lost, eu_done = shardlb.moderation.remove_on_shard, [], asyncio.Event()

        async def lose_na_once(board: Any, shard: int, *args: Any, **kwargs: Any) -> list[str]:
            if shard == na and not lost:
                lost.append(shard)
                await eu_done.wait()  # lost after the eu shard's call came back
                raise Lost("the call to the na shard was lost")
            try:
                return await remove_on_shard(board, shard, *args, **kwargs)
            finally:
                eu_done.set()

        monkeypatch.setattr(shardlb.moderation, "remove_on_shard", lose_na_once)
        url, asked = f"/v1/boards/{name}/players/p1", {**AS_ADMIN, "X-Request-Id": f"half-{name}"}
        first = await client.delete(url, headers=asked)
        assert first.status_code == 503 and lost == [na], first.text
        assert (await client.get(f"/v1/boards/{name}/players/p1")).status_code == 404  # eu's part held
        assert await post(client, name, [{**score("p1", 7, "m3"), "region": "na"}]) == ["improved"]
        again = await client.delete(url, headers=asked)
        assert (again.status_code, again.json()) == (200, {"board": name, "player_id": "p1", "removed": True})
        got = await client.get(f"/v1/boards/{name}/players/p1")
        assert (got.status_code, got.json().get("points")) == (200, 7), got.text
        eu = (await client.get(f"/v1/boards/{name}/top?region=eu")).json()["entries"]
        assert [e["player_id"] for e in eu] == ["p2"]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_an_unban_retried_after_a_new_ban_leaves_that_ban_in_force(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unban whose answer was lost is sent again with its X-Request-Id after another admin banned
    the player anew: the retry lifted that new ban, and wrote no audit row for it (the request had
    its row), so the audit said the player was banned while nothing refused their scores. The retry
    is the lift made already: the new ban stays, in PostgreSQL, in Redis and in the routers."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        name = await make_board(client)
        player, scope = f"aba-{name}", {"scope": "board", "board": name}

        async def act(action: str, request_id: str) -> dict[str, Any]:
            r = await client.post(
                f"/v1/players/{player}:{action}",
                json={**scope, "reason": request_id},
                headers={**AS_ADMIN, "X-Request-Id": request_id},
            )
            assert r.status_code == 200, r.text
            return cast(dict[str, Any], r.json())

        await act("ban", f"b1-{name}")
        assert (await act("unban", f"u1-{name}"))["lifted"] is True
        await act("ban", f"b2-{name}")
        await act("unban", f"u1-{name}")  # the first unban's answer was lost: sent again
        listed = (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json()["bans"]
        assert [b["reason"] for b in listed] == [f"b2-{name}"]
        assert await rows(postgres_url, "SELECT reason FROM bans WHERE player_id = %s", player) == [
            (f"b2-{name}",)
        ]
        assert service_of(app).moderation.bans.banned(name, player)
        assert await post(client, name, [score(player, 5, "m1")]) == ["banned"]
        audit = await rows(
            postgres_url,
            "SELECT action, request_id FROM moderation_audit WHERE player_id = %s ORDER BY id",
            player,
        )
        assert audit == [("ban", f"b1-{name}"), ("unban", f"u1-{name}"), ("ban", f"b2-{name}")]
        await act("unban", f"u2-{name}")
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_retried_after_it_was_lifted_does_not_ban_again(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ban of every board answered 503 after it was stored (its removals' calls were lost) is
    lifted, the player posts again, and then the ban's retry arrives with its X-Request-Id: it
    stored the ban again, wrote a second audit row for the request and removed the result posted
    since the lift. The retry is the ban made already: it answers that ban, stores nothing, and its
    removals are made at the ban's time, as the first call would have made them: the result of
    before the ban goes (board `before`), the one posted since the lift (board `since`) stays."""
    from redis.exceptions import ConnectionError as Lost

    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        before, since = [await make_board(client, mode="incr", periods=["total"]) for _ in range(2)]
        player = f"again-{before}"
        await post(client, before, [score(player, 10, "m1", times.now_ms() - 60_000)])
        url, asked = f"/v1/players/{player}:ban", {**AS_ADMIN, "X-Request-Id": f"b1-{before}"}
        remove = shardlb.moderation.remove

        async def lost(*args: Any, **kwargs: Any) -> set[str]:
            raise Lost("the removal's call was lost")

        monkeypatch.setattr(shardlb.moderation, "remove", lost)
        first = await client.post(url, json={"scope": "all", "reason": "aimbot"}, headers=asked)
        assert first.status_code == 503, first.text
        monkeypatch.setattr(shardlb.moderation, "remove", remove)
        lifted = await client.post(f"/v1/players/{player}:unban", json={"scope": "all"}, headers=AS_ADMIN)
        assert lifted.json()["lifted"] is True
        later = times.now_ms() + 2_000  # seconds after the ban, whatever the clock's second now
        assert await post(client, since, [score(player, 7, "m2", later)]) == ["improved"]
        again = await client.post(url, json={"scope": "all", "reason": "retry"}, headers=asked)
        assert again.status_code == 200, again.text
        assert again.json()["reason"] == "aimbot"
        assert (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json() == {"bans": []}
        assert await rows(postgres_url, "SELECT 1 FROM bans WHERE player_id = %s", player) == []
        assert not service_of(app).moderation.bans.banned(since, player)
        assert (await client.get(f"/v1/boards/{before}/players/{player}")).status_code == 404
        got = await client.get(f"/v1/boards/{since}/players/{player}")
        assert (got.status_code, got.json().get("points")) == (200, 7), got.text
        audit = await rows(
            postgres_url, "SELECT action FROM moderation_audit WHERE player_id = %s ORDER BY id", player
        )
        assert audit == [("ban",), ("unban",)]
        for name in (before, since):
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_retry_key_that_is_not_sane_is_refused_and_writes_nothing(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A removal's, ban's or lift's X-Request-Id is its retry key. One that is not sane (here 129
    characters) was replaced by a random id, as for any call's tracing: the client believed it had a
    retry key and had none, so a ban lifted and then retried with that id banned again. Such a call
    is now 400 `invalid_request_id`, with nothing written; sent without an id it goes through (the
    router makes one up), and other calls still just replace an id that is not sane."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        player = f"key-{name}"
        await post(client, name, [score(player, 5, "m1")])
        bad = {**AS_ADMIN, "X-Request-Id": "k" * 129}
        ban, body = f"/v1/players/{player}:ban", {"scope": "board", "board": name, "reason": "aimbot"}
        calls = [
            ("POST", ban, body, bad),
            ("POST", f"/v1/players/{player}:unban", body, bad),
            ("DELETE", f"/v1/boards/{name}/players/{player}", None, bad),
            ("POST", ban, body, {**AS_ADMIN, "X-Request-Id": "bad id"}),
            ("POST", ban, body, {**AS_ADMIN, "X-Request-Id": ""}),
        ]
        for method, url, json, headers in calls:
            r = await client.request(method, url, json=json, headers=headers)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request_id"
            assert "1-128 characters" in r.json()["error"]["message"]
            assert r.headers["x-request-id"] != "k" * 129
        assert await rows(postgres_url, "SELECT 1 FROM moderation_audit WHERE player_id = %s", player) == []
        assert await rows(postgres_url, "SELECT 1 FROM bans WHERE player_id = %s", player) == []
        assert (await client.get(f"/v1/boards/{name}/players/{player}")).json()["points"] == 5
        # Other calls keep their tracing-only id; a removal without one gets one made up.
        read = await client.get(f"/v1/boards/{name}/players/{player}", headers={"X-Request-Id": "k" * 129})
        assert read.status_code == 200 and read.headers["x-request-id"] != "k" * 129
        removed = await client.delete(f"/v1/boards/{name}/players/{player}", headers=AS_ADMIN)
        assert removed.json()["removed"] is True
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_two_different_retry_keys_in_one_call_are_refused_and_write_nothing(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two X-Request-Id headers that differ (a client's own and a proxy's, or a sane one beside one
    that is not) on a removal, ban or lift: the first sane one was the retry key (until
    2026-12-06), so which key the call was stored under hung on the order of the headers, which a
    proxy may change between a try and its retry. Such a call is 400 `invalid_request_id` now, with
    nothing written; the same id sent twice is one key, and the other calls keep the first sane id."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        player = f"keys-{name}"
        await post(client, name, [score(player, 5, "m1")])
        admin = list(AS_ADMIN.items())
        ban, body = f"/v1/players/{player}:ban", {"scope": "board", "board": name, "reason": "aimbot"}
        both = [*admin, ("X-Request-Id", "try-1"), ("X-Request-Id", "proxy-9")]
        calls = [
            ("POST", ban, body, both),
            ("POST", f"/v1/players/{player}:unban", body, both),
            ("DELETE", f"/v1/boards/{name}/players/{player}", None, both),
            ("POST", ban, body, [*admin, ("X-Request-Id", "bad id"), ("X-Request-Id", "try-1")]),
        ]
        for method, url, json, headers in calls:
            r = await client.request(method, url, json=json, headers=headers)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_request_id"
            assert "2 different" in r.json()["error"]["message"], r.text
        assert await rows(postgres_url, "SELECT 1 FROM moderation_audit WHERE player_id = %s", player) == []
        assert await rows(postgres_url, "SELECT 1 FROM bans WHERE player_id = %s", player) == []
        assert (await client.get(f"/v1/boards/{name}/players/{player}")).json()["points"] == 5
        # Other calls trace the first sane id; the same id twice is one retry key.
        read = await client.get(f"/v1/boards/{name}/players/{player}", headers=both)
        assert read.status_code == 200 and read.headers["x-request-id"] == "try-1"
        same = [*admin, ("X-Request-Id", "try-2"), ("X-Request-Id", "try-2")]
        banned = await client.post(ban, json=body, headers=same)
        assert banned.status_code < 300 and banned.headers["x-request-id"] == "try-2", banned.text
        audited = "SELECT request_id FROM moderation_audit WHERE player_id = %s"
        audit = await rows(postgres_url, audited, player)
        assert len(audit) == 1 and "try-2" in str(audit[0][0]), audit
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_of_every_board_skips_a_board_deleted_meanwhile(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ban of scope `all` lists the boards, stores the ban, waits for the routers, then removes
    the player from each board: a board deleted in between made the ban 404 `board_not_found` (the
    ban stored, and the boards after it left unremoved, for a client that takes a 404 as final).
    A board gone is skipped: there is nothing of the player left on it."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        gone, kept = await make_board(client), await make_board(client)
        player = f"everywhere-{gone}"
        for name in (gone, kept):
            await post(client, name, [score(player, 5, "m1")])
        cache = service_of(app).moderation.bans
        refresh = cache.refresh

        async def delete_then_refresh() -> None:
            await client.delete(f"/v1/boards/{gone}", headers=AS_ADMIN)
            await refresh()

        monkeypatch.setattr(cache, "refresh", delete_then_refresh)
        r = await client.post(f"/v1/players/{player}:ban", json={"scope": "all"}, headers=AS_ADMIN)
        monkeypatch.setattr(cache, "refresh", refresh)
        assert r.status_code == 200, r.text
        assert {gone, kept} & set(r.json()["removed_from"]) == {kept}
        assert (await client.get(f"/v1/boards/{kept}/players/{player}")).status_code == 404
        await client.post(f"/v1/players/{player}:unban", json={"scope": "all"}, headers=AS_ADMIN)
        await client.delete(f"/v1/boards/{kept}", headers=AS_ADMIN)


async def test_a_board_created_again_under_its_id_starts_without_the_old_boards_bans(
    cluster_url: str, postgres_url: str, store: BoardStore, rebuilder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A board deleted and created again with the same id is a new board (a new incarnation, none
    of the old keys), but bans of the old board's scope were kept by id: the new board refused the
    player's scores, GET /v1/bans listed the ban, and a rebuild of the new board left the player
    out. A board ban now holds on the board it was made on; a ban of every board still holds."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        player, everywhere = f"old-ban-{name}", f"all-ban-{name}"
        scope = {"scope": "board", "board": name}
        r = await client.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        r = await client.post(f"/v1/players/{everywhere}:ban", json={"scope": "all"}, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        assert await post(client, name, [score(player, 5, "m1"), score(everywhere, 5, "m2")]) == [
            "improved",
            "banned",
        ]
        listed = (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json()["bans"]
        assert listed == []
        banned = await shardlb.moderation.banned_in(rebuilder.db, await store.get(name))
        assert player not in banned and everywhere in banned
        # Banned again on the new board: a ban of its own, in force, audited.
        again = {**scope, "reason": "again"}
        r = await client.post(f"/v1/players/{player}:ban", json=again, headers=AS_ADMIN)
        assert r.status_code == 200 and r.json()["reason"] == "again", r.text
        assert await post(client, name, [score(player, 6, "m3")]) == ["banned"]
        for who, lifted in ((player, scope), (everywhere, {"scope": "all"})):
            await client.post(f"/v1/players/{who}:unban", json=lifted, headers=AS_ADMIN)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_of_a_board_deleted_since_removes_nothing_from_the_board_created_again(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ban of one board holds on the board it was made on, but its removal looked the board up
    again by id: a ban whose board was deleted and created again during its wait for the routers,
    or a retry of a ban (its X-Request-Id) sent after that, removed the player from the new board,
    on which the ban is not in force. The player's results there were gone, and so were they from a
    rebuild and a settlement of the new board (the removal is journaled). The removal now runs on
    the board the ban holds on only."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        name = await make_board(client)
        raced, retried, lifted = f"raced-{name}", f"retried-{name}", f"lifted-{name}"
        scope = {"scope": "board", "board": name}
        asked = {**AS_ADMIN, "X-Request-Id": f"old-{name}"}
        assert (await client.post(f"/v1/players/{retried}:ban", json=scope, headers=asked)).status_code == 200
        asked_lifted = {**AS_ADMIN, "X-Request-Id": f"lifted-{name}"}
        r = await client.post(f"/v1/players/{lifted}:ban", json=scope, headers=asked_lifted)
        assert r.status_code == 200, r.text
        r = await client.post(f"/v1/players/{lifted}:unban", json=scope, headers=AS_ADMIN)
        assert r.json()["lifted"] is True, r.text

        async def created_again() -> None:
            assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
            r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
            assert r.status_code == 201, r.text
            scores = [score(raced, 5, "m1"), score(retried, 7, "m2"), score(lifted, 6, "m5")]
            assert await post(client, name, scores) == ["improved"] * 3

        cache = service_of(app).moderation.bans
        refresh = cache.refresh

        async def recreate_then_refresh() -> None:  # during the ban's wait for the routers
            monkeypatch.setattr(cache, "refresh", refresh)
            await created_again()
            await refresh()

        monkeypatch.setattr(cache, "refresh", recreate_then_refresh)
        r = await client.post(f"/v1/players/{raced}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["removed_from"] == []
        # The first ban's answer was lost: its retry comes after the board was created again.
        r = await client.post(f"/v1/players/{retried}:ban", json=scope, headers=asked)
        assert r.status_code == 200, r.text
        assert r.json()["removed_from"] == []
        # And one lifted before: its retry finishes its removal, at the ban's time, on its board only.
        r = await client.post(f"/v1/players/{lifted}:ban", json=scope, headers=asked_lifted)
        assert r.status_code == 200, r.text
        assert r.json()["removed_from"] == []
        for player, points in ((raced, 5), (retried, 7), (lifted, 6)):
            got = await client.get(f"/v1/boards/{name}/players/{player}")
            assert (got.status_code, got.json().get("points")) == (200, points), got.text
        assert await post(client, name, [score(raced, 8, "m3"), score(retried, 9, "m4")]) == [
            "improved",
            "improved",
        ]
        for player in (raced, retried):
            await client.post(f"/v1/players/{player}:unban", json=scope, headers=AS_ADMIN)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_refused_results_queued_when_the_router_stops_are_recorded_first(
    cluster_url: str, postgres_url: str
) -> None:
    """A router stopping (SIGTERM's lifespan shutdown) cancelled its refusal log's task with the
    rows still queued, or half way through writing them: refused results answered just before a
    rolling restart never reached refused_results. The stop writes them first, within the drain."""
    await (await connect_db(postgres_url)).close()  # the schema in place, as in any archive
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client, max_points_per_result=100)
    # The board's settings are read again by the second router; the first is stopped right after
    # the call is answered, before its background task had time to write the row.
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        refusals = service_of(app).moderation.refusals
        assert await post(client, name, [score("cheat", 1000, "big")], **{"X-Request-Id": "stop-1"}) == [
            "points_limit"
        ]
        assert refusals.rows  # queued, not written yet
    recorded = await rows(
        postgres_url,
        "SELECT player_id, match_id, status, request_id FROM refused_results WHERE board = %s",
        name,
    )
    assert recorded == [("cheat", "big", "points_limit", "stop-1")]
    async with running(cluster_url) as (_, client):
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_write_refused_for_a_full_queue_counts_nothing_against_the_limit(cluster_url: str) -> None:
    """A request refused at once because the write queue is full (503 overloaded) is screened for
    nothing: it counts none of its results against the per-minute limit, so another match of that
    player is still taken within the limit afterwards."""
    # A long tick keeps the first request's scores queued: the queue is full while the second comes.
    async with running(cluster_url, queue_limit=1000, coalesce_delay_ms=1000, coalesce_max_batch=5000) as (
        app,
        client,
    ):
        name = await make_board(client, max_results_per_player_per_minute=1)
        at = times.now_ms()
        filler = asyncio.ensure_future(post(client, name, [score(f"f{i}", 1, "m", at) for i in range(1000)]))
        while service_of(app).coalescer.depth < 1000:
            await asyncio.sleep(0.01)
        r = await client.post(
            f"/v1/boards/{name}/scores", json={"scores": [score("p", 5, "m1", at)]}, headers=AS_WRITER
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert await filler == ["improved"] * 1000
        assert await post(client, name, [score("p", 7, "m2", at)]) == ["improved"]
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_flood_of_refused_results_is_a_bounded_number_of_log_lines_and_every_one_recorded(
    cluster_url: str, postgres_url: str
) -> None:
    """A game server that keeps posting a banned player's results (or a cheat's points past the
    limit) logged a `result refused` info line per refused result, without bound: as many lines a
    second as it posted. Now the first 100 refused results of a minute are a line each; the others
    are debug lines, counted by status and board in one `refused results not logged each` line when
    the minute is over (at the next refusal, or the router's stop). refused_results still holds every
    refused result, and shardlb_results_refused_total counts each."""
    from tests.test_router_logs import kept

    now = [0.0]
    with kept("shardlb.router") as log:
        async with running(cluster_url, postgres_url=postgres_url) as (app, client):
            name = await make_board(client, max_points_per_result=100)
            counted = [await refused_count(client)]
            service_of(app).moderation.refusals.clock = lambda: now[0]
            for call in range(3):  # 300 refused results within a minute
                body = [score(f"c{call}-{i}", 500, f"m{call}-{i}") for i in range(100)]
                assert set(await post(client, name, body)) == {"points_limit"}
            assert len(await refusals_recorded(postgres_url, name, app)) == 300
            counted.append(await refused_count(client))
            now[0] = 60.0  # the next minute: 101 more
            body = [score(f"later-{i}", 500, f"later-{i}") for i in range(101)]
            assert set(await post(client, name, body)) == {"points_limit"}
            assert len(await refusals_recorded(postgres_url, name, app)) == 401
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    each = [fields for message, fields in log.lines(logging.INFO) if message == "result refused"]
    assert len(each) == 200
    assert [f["match_id"] for f in each[:100]] == [f"m{c}-{i}" for c in range(1) for i in range(100)]
    assert [f["match_id"] for f in each[100:]] == [f"later-{i}" for i in range(100)]
    summaries = [fields for message, fields in log.lines() if message == "refused results not logged each"]
    assert summaries == [
        {"refused": 200, "statuses": {"points_limit": 200}, "boards": {name: 200}, "since_s": 60.0},
        {"refused": 1, "statuses": {"points_limit": 1}, "boards": {name: 1}, "since_s": 0.0},
    ]
    debug = [m for m, _ in log.lines(logging.DEBUG) if m == "result refused"]
    assert len(debug) == 201  # SHARDLB_LOG_LEVEL=debug shows each one
    assert counted[1] - counted[0] == 300


async def refused_count(client: httpx.AsyncClient) -> float:
    """shardlb_results_refused_total{status="points_limit"} as /metrics has it (0 before the first)."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith('shardlb_results_refused_total{status="points_limit"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_the_count_of_refused_results_not_logged_each_comes_when_their_minute_ends() -> None:
    """A flood that stops within its minute leaves its count to the log's task, which says it once
    the minute is over, with no further refusal to bring it; then nothing more."""
    from router.moderation import LINES_PER_MINUTE, RefusalLog
    from tests.test_router_logs import kept

    refusals = RefusalLog("", every_s=0.05)  # no archive: the rows are dropped, the lines stay

    def said() -> list[dict[str, Any]]:
        return [fields for message, fields in log.lines() if message == "refused results not logged each"]

    with kept("shardlb.router") as log:
        task = asyncio.create_task(refusals.run())
        try:
            flood = [("b1" if i % 3 else "b2", f"p{i}", f"m{i}", 5, "banned", None) for i in range(250)]
            refusals.add(flood)
            await until(lambda: bool(said()), "the minute's count")
            refusals.add([("b1", "late", "late", 5, "rate_limit", None)])  # a minute of its own
        finally:
            refusals.close()
            await task
    [summary] = said()
    assert summary.pop("since_s") >= 0.05
    unlogged = flood[LINES_PER_MINUTE:]
    boards = {b: sum(1 for row in unlogged if row[0] == b) for b in ("b1", "b2")}
    assert summary == {"refused": 150, "statuses": {"banned": 150}, "boards": boards}
    each = [f["match_id"] for m, f in log.lines(logging.INFO) if m == "result refused"]
    assert each == [row[2] for row in flood[:LINES_PER_MINUTE]] + ["late"]


def test_the_count_names_the_boards_with_the_most_refused_results() -> None:
    """A flood over many boards keeps its count line short: the boards with the most, and how many
    others."""
    from router.moderation import LINES_PER_MINUTE, SUMMARY_BOARDS, RefusalLog
    from tests.test_router_logs import kept

    refusals = RefusalLog("", clock=lambda: 0.0)
    rows = [("b0", f"p{i}", f"m{i}", 5, "banned", None) for i in range(LINES_PER_MINUTE)]
    rows += [
        (f"b{n}", f"p{n}-{i}", f"m{n}-{i}", 5, "rate_limit", None) for n in range(30) for i in range(n + 1)
    ]
    with kept("shardlb.router") as log:
        refusals.add(rows)
        refusals.summarize()
    [(_, fields)] = [line for line in log.lines() if line[0] == "refused results not logged each"]
    assert fields["refused"] == sum(n + 1 for n in range(30))
    assert fields["statuses"] == {"rate_limit": fields["refused"]}
    assert fields["boards"] == {f"b{n}": n + 1 for n in range(29, 29 - SUMMARY_BOARDS, -1)}
    assert fields["other_boards"] == 30 - SUMMARY_BOARDS


def test_refused_results_past_the_queue_are_counted_where_an_operator_sees_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past LOG_MAX waiting rows, refused results were dropped from the record with nothing to say
    so: a count in the object only. They are now a metric and a field of the minute's count line."""
    from router import metrics
    from router import moderation as router_moderation
    from router.moderation import LINES_PER_MINUTE, RefusalLog
    from tests.test_router_logs import kept

    monkeypatch.setattr(router_moderation, "LOG_MAX", LINES_PER_MINUTE + 10)
    refusals = RefusalLog("postgresql://127.0.0.1:1/nothing", clock=lambda: 0.0)
    before = metrics.REFUSED_UNRECORDED._value.get()
    rows = [("b1", f"p{i}", f"m{i}", 5, "banned", None) for i in range(LINES_PER_MINUTE + 50)]
    with kept("shardlb.router") as log:
        refusals.add(rows)
        refusals.summarize()
    assert metrics.REFUSED_UNRECORDED._value.get() - before == 40
    [summary] = [f for m, f in log.lines() if m == "refused results not logged each"]
    assert summary["not_recorded"] == 40
