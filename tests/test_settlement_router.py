"""The settlement and history endpoints (router/settlements.py, router/history.py) on the suite's
cluster and PostgreSQL: each happy path, and the bad requests answered 4xx with nothing paid."""

from __future__ import annotations

from typing import Any

import httpx
import psycopg
import pytest

from shardlb import keys, times
from shardlb.board import Score
from shardlb.settlement import period_bounds
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_READER, AS_WRITER, board_name, running
from tests.test_settlement import TABLE, day_ago, drain, expected_awards, new_board, written

pytestmark = pytest.mark.cluster


async def settle(client: httpx.AsyncClient, board: str, period: str, **body: Any) -> httpx.Response:
    return await client.post(f"/v1/boards/{board}/periods/{period}:settle", json=body, headers=AS_ADMIN)


async def test_settle_read_page_and_ack_over_http(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    name = board_name("settle")
    board = await new_board(store, name)
    period = day_ago(2)
    sid = f"http-{name}"
    try:
        ref = await written(board, period, name)
        await written(board, day_ago(0), f"{name}-today")  # the open period: read live
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            first = await settle(client, name, period, settlement_id=sid, rewards=TABLE, top_n=5)
            assert first.status_code == 200, first.text
            assert first.json()["state"] == "settled"
            again = await settle(client, name, period, settlement_id=sid, rewards=TABLE, top_n=5)
            assert again.json() == first.json()
            got = await client.get(f"/v1/settlements/{sid}", headers=AS_WRITER)
            assert got.json()["acknowledged"] == 0 and got.json()["awards"] == first.json()["awards"]

            want = expected_awards(ref, period, board)
            seen: list[dict[str, Any]] = []
            after: str | None = None
            while True:
                query = {"limit": "4", **({"after": after} if after else {})}
                page = (
                    await client.get(f"/v1/settlements/{sid}/awards", params=query, headers=AS_WRITER)
                ).json()
                seen += page["awards"]
                after = page["next"]
                if after is None:
                    break
            assert [(a["rank"], a["player_id"], a["reward"]) for a in seen] == want
            # The game server that pages the awards (a write key) acknowledges them; it needed admin.
            first_id = {"award_ids": [seen[0]["award_id"]]}
            refused = await client.post(f"/v1/settlements/{sid}/awards:ack", json=first_id, headers=AS_READER)
            assert refused.status_code == 403
            ack = await client.post(f"/v1/settlements/{sid}/awards:ack", json=first_id, headers=AS_WRITER)
            assert ack.json() == {"settlement_id": sid, "acknowledged": 1, "already": 0}, ack.text
            left = (await client.get(f"/v1/settlements/{sid}/awards", headers=AS_WRITER)).json()["awards"]
            assert [a["award_id"] for a in left] == [a["award_id"] for a in seen[1:]]

            # reads of the settled period come from the snapshot, marked settled
            top = (await client.get(f"/v1/boards/{name}/top", params={"period": period, "limit": 3})).json()
            order = ref.order(board.resolve(period).period)
            assert top["settled"] is True and top["settlement_id"] == sid
            assert [(e["rank"], e["player_id"], e["points"]) for e in top["entries"]] == [
                (i + 1, o[1], o[2]) for i, o in enumerate(order[:3])
            ]
            assert top["entries"][0]["reward"] == "gold"
            every = (await client.get(f"/v1/boards/{name}/top", params={"period": period, "limit": 5})).json()
            ranked = await client.get(
                f"/v1/boards/{name}/top", params={"period": period, "limit": 5, "rank_mode": "competition"}
            )
            points = [e["points"] for e in every["entries"]]
            assert [e["rank"] for e in ranked.json()["entries"]] == [
                1 + sum(p > mine for p in points) for mine in points
            ]
            winner = order[0][1]
            mine = (await client.get(f"/v1/boards/{name}/players/{winner}", params={"period": period})).json()
            assert (mine["rank"], mine["settled"], mine["players"]) == (1, True, len(order))
            # the same shape as a live read (the OpenAPI Page and Player require resets_at), and an
            # estimate of a settled rank is the exact one: it allows no error
            ends = board.resets_at(board.resolve(period).period)
            assert ends is not None and top["resets_at"] == ends and mine["resets_at"] == ends
            guess = await client.get(
                f"/v1/boards/{name}/players/{winner}", params={"period": period, "estimate": "true"}
            )
            assert guess.json() == {**mine, "rank_error": 0}
            live = (await client.get(f"/v1/boards/{name}/top", params={"period": day_ago(0)})).json()
            assert "settled" not in live and live["entries"]

            listed = (await client.get(f"/v1/boards/{name}/periods")).json()["periods"]
            row = next(p for p in listed if p["period"] == period)
            assert row == {**row, "kept": True, "closed": True, "settled": True, "settlement_id": sid}
            today = next(p for p in listed if p["period"] == day_ago(0))
            assert today == {**today, "kept": True, "closed": False, "settled": False, "settlement_id": None}

            history = (
                await client.get(f"/v1/boards/{name}/players/{winner}/history", params={"limit": 500})
            ).json()
            settled = [r for r in history["results"] if period in r["periods"]]
            assert settled and all(
                r["final"] == {period: {"rank": 1, "points": order[0][2]}} for r in settled
            )
            assert all(r["final"] == {} for r in history["results"] if period not in r["periods"])
    finally:
        await store.delete(name)


async def test_a_settled_rank_and_percentile_are_the_live_ones_in_either_mode(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """The snapshot's competition percentile came from the unique rank: of two players tied for
    first of three, one was 66.7 and the other 33.3 (live: both 33.3). A run of equal points that
    the snapshot's top cuts (ranks 4 to 6, top_n 4) is answered by the frozen board, as live."""
    name = board_name("settle-ties")
    board = await new_board(store, name)
    period = day_ago(2)
    start, end = period_bounds(board, board.resolve(period).period)
    points = {"a": 100, "b": 100, "c": 50, "d": 30, "e": 30, "f": 30, "g": 10}
    try:
        scores = [Score(p, n, f"{name}-{p}", start + 1000 * i) for i, (p, n) in enumerate(points.items())]
        await board.submit(scores, now_ms=end - 1)
        await drain(raw, store, postgres_url)

        async def read(client: httpx.AsyncClient, mode: str) -> dict[str, tuple[Any, ...]]:
            out = {}
            for player in points:
                query = {"period": period, "rank_mode": mode}
                got = (await client.get(f"/v1/boards/{name}/players/{player}", params=query)).json()
                out[player] = (got["rank"], got["percentile"], got.get("settled", False))
            return out

        async with running(cluster_url) as (_, client):  # no PostgreSQL: the frozen board answers
            live = {mode: await read(client, mode) for mode in ("unique", "competition")}
        assert [live["competition"][p][:2] for p in "abc"] == [
            (1, 100 * 5 / 7),
            (1, 100 * 5 / 7),
            (3, 100 * 4 / 7),
        ]
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            done = await settle(
                client,
                name,
                period,
                settlement_id=f"s-{name}",
                rewards=[{"rank": 1, "reward": "gold"}],
                top_n=4,
            )
            assert done.status_code == 200, done.text
            settled = {mode: await read(client, mode) for mode in ("unique", "competition")}
        for mode in ("unique", "competition"):
            assert {p: got[:2] for p, got in settled[mode].items()} == {
                p: got[:2] for p, got in live[mode].items()
            }
        in_top = {p for p, got in settled["unique"].items() if got[2]}
        assert in_top == {p for p, got in settled["unique"].items() if got[0] <= 4}
        # the tie of ranks 4 to 6 is wider than the snapshot's top: its competition reads are live
        assert {p for p, got in settled["competition"].items() if got[2]} == {"a", "b", "c"}
    finally:
        await store.delete(name)


async def test_history_leaves_out_a_period_that_skipped_the_result(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A result posted after its day closed counts in the total only (``skipped`` in PostgreSQL);
    the history listed that day for it all the same, with the day's settled rank."""
    name = board_name("settle-late")
    board = await new_board(store, name)
    period = day_ago(2)
    start, end = period_bounds(board, board.resolve(period).period)
    try:
        await board.submit([Score("x", 10, f"{name}-early", start + 1000)], now_ms=end - 1)
        await board.submit([Score("x", 40, f"{name}-late", start + 5000)])  # now: the day is closed
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            done = await settle(client, name, period, settlement_id=f"s-{name}", rewards=TABLE)
            assert (done.status_code, done.json()["players"]) == (200, 1), done.text
            history = (await client.get(f"/v1/boards/{name}/players/x/history")).json()
        rows = {r["match_id"]: (r["periods"], r["final"]) for r in history["results"]}
        assert rows == {
            f"{name}-early": (["total", period], {period: {"rank": 1, "points": 10}}),
            f"{name}-late": (["total"], {}),
        }
    finally:
        await store.delete(name)


async def test_history_gives_the_final_rank_the_board_numbers(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """On a board whose ranks are competition ranks, a player's history gave the snapshot's unique
    rank as the final one: of two players tied for first, the second had final rank 2 while the
    settled read of that player said 1. A rewarded player below the snapshot's top N whose run of
    equal points starts at a rank the snapshot did not keep has no final rank it could give; one
    whose run the snapshot holds whole is read from it, as one in the top N is."""
    name = board_name("hist-comp")
    board = await new_board(store, name, rank_mode="competition")
    period = day_ago(2)
    start, end = period_bounds(board, board.resolve(period).period)
    points = {"a": 100, "b": 100, "c": 50, "d": 30, "e": 30, "f": 30, "g": 20, "h": 20}
    try:
        scores = [Score(p, n, f"{name}-{p}", start + 1000 * i) for i, (p, n) in enumerate(points.items())]
        await board.submit(scores, now_ms=end - 1)
        await drain(raw, store, postgres_url)
        # Kept: ranks 1-2 (top N), 3-4 (c, d) and 8 (h, whose run of 20 points starts at rank 7).
        table = [
            {"rank": 1, "reward": "gold"},
            {"ranks": [3, 4], "reward": "silver"},
            {"rank": 8, "reward": "x"},
        ]
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            done = await settle(client, name, period, settlement_id=f"s-{name}", rewards=table, top_n=2)
            assert done.status_code == 200, done.text
            final, snapshot = {}, set()
            for player in points:
                read = (
                    await client.get(f"/v1/boards/{name}/players/{player}", params={"period": period})
                ).json()
                history = (await client.get(f"/v1/boards/{name}/players/{player}/history")).json()
                [row] = history["results"]
                final[player] = (read["rank"], row["final"].get(period, {}).get("rank"))
                if read.get("settled"):
                    snapshot.add(player)
        assert final == {
            "a": (1, 1),
            "b": (1, 1),
            "c": (3, 3),
            "d": (4, 4),
            "e": (4, None),  # outside the snapshot: the frozen board answers the read
            "f": (4, None),
            "g": (7, None),
            "h": (7, None),  # rewarded, but its run starts at rank 7, not kept
        }
        # d's run of 30 points may go on past rank 4 as far as the snapshot tells: the frozen board
        # answers its percentile
        assert snapshot == {"a", "b", "c"}
    finally:
        await store.delete(name)


async def test_bad_settlement_requests_are_4xx_and_pay_nothing(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    name = board_name("settle-bad")
    board = await new_board(store, name)
    period = day_ago(2)
    try:
        await written(board, period, name)
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            good = {"settlement_id": "b1", "rewards": TABLE}
            cases = [
                (name, day_ago(0), good, 409, "period_open"),
                (name, "daily:2026-02-30", good, 422, "invalid_period"),
                (name, "total", good, 422, "invalid_period"),
                (name, "daily:1900-01-01", good, 422, "invalid_period"),  # before the board's epoch
                ("no-such-board", period, good, 404, "board_not_found"),
                (name, period, {**good, "rewards": {"1": "gold"}}, 422, "invalid_rewards"),
                (name, period, {**good, "rewards": [{"rank": 0, "reward": "x"}]}, 422, "invalid_rewards"),
                (name, period, {**good, "extra": 1}, 422, "unknown_field"),
                (name, period, {**good, "webhook_url": "http://xn--/"}, 422, "invalid_input"),
                (
                    name,
                    period,
                    {**good, "webhook_url": "http://127.0.0.1:9/x"},
                    409,
                    "webhook_not_configured",
                ),
            ]
            for board_id, when, body, status, code in cases:
                answer = await settle(client, board_id, when, **body)
                assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.text
            missing = await client.get("/v1/settlements/nobody", headers=AS_WRITER)
            assert (missing.status_code, missing.json()["error"]["code"]) == (404, "settlement_not_found")
            forbidden = await client.post(
                f"/v1/boards/{name}/periods/{period}:settle",
                json={"settlement_id": "b1", "rewards": TABLE},
                headers=AS_WRITER,
            )
            assert forbidden.status_code == 403
            assert (await client.get("/v1/settlements/b1", headers=AS_READER)).status_code == 403

            ok = await settle(client, name, period, settlement_id="b1", rewards=TABLE)
            assert ok.status_code == 200
            other = await settle(client, name, period, settlement_id="b1", rewards=TABLE[:1])
            assert (other.status_code, other.json()["error"]["code"]) == (409, "settlement_conflict")
            second = await settle(client, name, period, settlement_id="b2", rewards=TABLE)
            assert (second.status_code, second.json()["error"]["code"]) == (409, "period_settled")
            awards = await client.get("/v1/settlements/b1/awards", params={"after": "x"}, headers=AS_WRITER)
            assert awards.status_code == 422
            unknown = await client.post(
                "/v1/settlements/b1/awards:ack", json={"award_ids": ["123456789"]}, headers=AS_ADMIN
            )
            assert (unknown.status_code, unknown.json()["error"]["code"]) == (422, "unknown_award")
            total = (await client.get("/v1/settlements/b1", headers=AS_WRITER)).json()["awards"]["total"]
            assert total == len(
                (await client.get("/v1/settlements/b1/awards", headers=AS_WRITER)).json()["awards"]
            )
        async with running(cluster_url) as (_, client):  # no PostgreSQL: 409, reads stay live
            none = await settle(client, name, period, settlement_id="b3", rewards=TABLE)
            assert (none.status_code, none.json()["error"]["code"]) == (409, "archive_not_configured")
            top = (await client.get(f"/v1/boards/{name}/top", params={"period": period})).json()
            assert "settled" not in top and top["entries"]
    finally:
        await store.delete(name)


async def test_history_of_a_removed_or_banned_player_counts_nowhere(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """A result journaled before its player's removal, and any result of a banned player, counts in
    no period (a rebuild and a settlement leave it out, as Redis did): the history listed them with
    every period of their time all the same, as if a removed cheater's results still counted. A
    result posted after the removal counts again."""
    name = board_name("hist-mod")
    board = await new_board(store, name, mode="incr")
    today = "daily:" + times.format_ms(times.now_ms())[:10]
    try:
        now = times.now_ms()
        await board.submit([Score("x", 10, f"{name}-x1", now - 1000), Score("y", 20, f"{name}-y1", now)])
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            removed = await client.delete(f"/v1/boards/{name}/players/x", headers=AS_ADMIN)
            assert removed.status_code == 200 and removed.json()["removed"] is True
            banned = await client.post(
                "/v1/players/y:ban", json={"scope": "board", "board": name}, headers=AS_ADMIN
            )
            assert banned.status_code == 200, banned.text
            await board.submit([Score("x", 5, f"{name}-x2", times.now_ms() + 2000)])  # after the removal
            await drain(raw, store, postgres_url)
            x = (await client.get(f"/v1/boards/{name}/players/x/history")).json()["results"]
            y = (await client.get(f"/v1/boards/{name}/players/y/history")).json()["results"]
            unbanned = await client.post(
                "/v1/players/y:unban", json={"scope": "board", "board": name}, headers=AS_ADMIN
            )
            assert unbanned.json()["lifted"] is True
        assert {r["match_id"]: r["periods"] for r in x} == {f"{name}-x1": [], f"{name}-x2": ["total", today]}
        assert [(r["match_id"], r["periods"], r["final"]) for r in y] == [(f"{name}-y1", [], {})]
    finally:
        await store.delete(name)


async def test_a_board_archived_at_season_end_keeps_its_history(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    name = board_name("season")
    board = await new_board(store, name)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 10 * i, f"{name}-m{i}", now - 1000) for i in range(1, 6)])
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            body = {"settlement_id": f"season-{name}", "rewards": [{"ranks": [1, 2], "reward": "crown"}]}
            done = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert done.status_code == 200, done.text
            assert (done.json()["archived"], done.json()["period"], done.json()["awards"]["total"]) == (
                True,
                "total",
                2,
            )
            assert (await client.get(f"/v1/boards/{name}")).status_code == 404
            # GET of "<board>:archive" is a read of the board of that id (ids may hold ':'), not the action
            other = await client.get(f"/v1/boards/{name}:archive")
            assert (other.status_code, other.json()["error"]["code"]) == (404, "board_not_found")
            left = await raw.keys(f"*{name}*")  # the deletion markers and the journal stay (shardlb/store.py)
            assert [k for k in left if not k.endswith((b":gone", b":log")) and b"lb:deleted:" not in k] == []
            assert await raw.exists(keys.deleted_key(name, board.incarnation)) == 1
            again = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert again.json() == done.json()
            awards = (await client.get(f"/v1/settlements/season-{name}/awards", headers=AS_WRITER)).json()[
                "awards"
            ]
            assert [(a["player_id"], a["reward"]) for a in awards] == [("p5", "crown"), ("p4", "crown")]
        async with await psycopg.AsyncConnection.connect(postgres_url) as db:
            cur = await db.execute(
                "SELECT count(*) FROM settlement_snapshots WHERE settlement_id = %s", (f"season-{name}",)
            )
            assert (await cur.fetchone()) == (5,)
    finally:
        if name in {c.id for c in await store.list()}:
            await store.delete(name)


async def test_an_archive_run_again_once_its_board_is_gone_is_checked_as_a_settlement(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """With the board deleted, a run again of its archive returned the stored result whenever the id,
    board and period matched: another table or top_n was 200, and so was one naming a webhook_url
    (its answer's webhook_url null, nothing ever delivered)."""
    name = board_name("season-again")
    board = await new_board(store, name)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 10 * i, f"{name}-m{i}", now - 1000) for i in range(1, 6)])
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url, webhook_secret="s3") as (_, client):
            body = {"settlement_id": f"season-{name}", "rewards": [{"rank": 1, "reward": "crown"}]}
            done = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert done.status_code == 200, done.text
            others = [
                ({**body, "rewards": [{"ranks": [1, 5], "reward": "crown"}]}, "settlement_id"),
                ({**body, "top_n": 3}, "settlement_id"),
                ({**body, "webhook_url": "http://127.0.0.1:9/hook"}, "webhook_url"),
            ]
            for other, field in others:
                again = await client.post(f"/v1/boards/{name}:archive", json=other, headers=AS_ADMIN)
                error = again.json().get("error", {})
                assert (again.status_code, error.get("code"), error.get("field")) == (
                    409,
                    "settlement_conflict",
                    field,
                ), again.text
            same = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert same.json() == done.json()
            stored = (await client.get(f"/v1/settlements/season-{name}", headers=AS_WRITER)).json()
            assert stored["webhook_url"] is None
    finally:
        if name in {c.id for c in await store.list()}:
            await store.delete(name)


async def test_an_archive_run_again_after_its_board_was_created_again_answers_its_result(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """An archive whose answer was lost, run again after the next season's board was created under
    the same id: the run found the new board, took the stored settlement for another board's and
    answered 409 settlement_conflict ("a settlement id is used for one settlement only"), as if
    nothing had been archived; a client that then archived under a new id closed, paid and deleted
    the new board. It now answers the stored result, as once the board is gone, and leaves the new
    board (open, its results kept) alone; another table is still 409."""
    name = board_name("season-next")
    board = await new_board(store, name)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 10 * i, f"{name}-m{i}", now - 1000) for i in range(1, 6)])
        await drain(raw, store, postgres_url)
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            body = {"settlement_id": f"season-{name}", "rewards": [{"rank": 1, "reward": "crown"}]}
            done = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert done.status_code == 200, done.text
            r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
            assert r.status_code == 201, r.text
            new = [{"player_id": "next", "points": 7, "match_id": f"{name}-next"}]
            posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": new}, headers=AS_WRITER)
            assert posted.status_code == 200, posted.text
            again = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert (again.status_code, again.json()) == (200, done.json())
            other = {**body, "rewards": [{"ranks": [1, 5], "reward": "crown"}]}
            conflict = await client.post(f"/v1/boards/{name}:archive", json=other, headers=AS_ADMIN)
            assert (conflict.status_code, conflict.json()["error"]["code"]) == (409, "settlement_conflict")
            kept = await client.get(f"/v1/boards/{name}")
            assert (kept.status_code, kept.json()["closed"]) == (200, False)
            got = await client.get(f"/v1/boards/{name}/players/next")
            assert (got.status_code, got.json()["points"]) == (200, 7), got.text
    finally:
        if name in {c.id for c in await store.list()}:
            await store.delete(name)


async def test_a_board_whose_archive_stopped_takes_no_more_results(
    store: BoardStore, raw: Any, cluster_url: str, postgres_url: str
) -> None:
    """The archive closes the board before it settles: stopped at a mismatch, the board is still read
    but every post is 409 board_closed with nothing written; archived with force, it is gone."""
    name = board_name("closed")
    board = await new_board(store, name)
    try:
        now = times.now_ms()
        await board.submit([Score(f"p{i}", 10 * i, f"{name}-m{i}", now - 1000) for i in range(1, 6)])
        await drain(raw, store, postgres_url)
        await raw.zadd(keys.period_key(board.prefixes[0], "total"), {"intruder": 2**40})  # not in PostgreSQL
        async with running(cluster_url, postgres_url=postgres_url) as (_, client):
            body = {"settlement_id": f"season-{name}", "rewards": [{"rank": 1, "reward": "crown"}]}
            stopped = await client.post(f"/v1/boards/{name}:archive", json=body, headers=AS_ADMIN)
            assert (stopped.status_code, stopped.json()["error"]["code"]) == (409, "settlement_mismatch")
            journals = [await raw.xlen(keys.journal_key(prefix)) for prefix in board.prefixes]
            late = [{"player_id": f"late{i}", "points": 99, "match_id": f"{name}-late{i}"} for i in range(6)]
            posted = await client.post(f"/v1/boards/{name}/scores", json={"scores": late}, headers=AS_WRITER)
            assert (posted.status_code, posted.json()["error"]["code"]) == (409, "board_closed")
            assert [await raw.xlen(keys.journal_key(prefix)) for prefix in board.prefixes] == journals
            assert (await client.get(f"/v1/boards/{name}")).json()["closed"] is True
            top = await client.get(f"/v1/boards/{name}/top")
            assert top.status_code == 200 and "late0" not in {e["player_id"] for e in top.json()["entries"]}
            forced = await client.post(
                f"/v1/boards/{name}:archive", json={**body, "force": True}, headers=AS_ADMIN
            )
            assert forced.status_code == 200, forced.text
            assert forced.json()["players"] == 5  # PostgreSQL's order, without the intruder
            assert (await client.get(f"/v1/boards/{name}")).status_code == 404
    finally:
        if name in {c.id for c in await store.list()}:
            await store.delete(name)
