"""Bans across a board deleted and created again under its id, through two routers, one of which still
holds the old board in its cache (router/boards.py keeps a board's settings for a few seconds, until
a write finds it deleted): a ban of one board holds on the board it was made on (router/README.md,
"Additions: moderation"), and a router's stale copy must neither refuse the new board's scores for
the old board's ban nor leave a banned player's results on the new board."""

from __future__ import annotations

from typing import Any

import pytest

from shardlb import keys, moderation, times
from shardlb.rebuild import Rebuilder
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_WRITER, running, service_of
from tests.store_fixture import forget_others_restored
from tests.test_moderation_router import make_board, post, refusals_recorded, rows, score

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bans answer at once: both routers refresh their lists by hand here."""
    import router.moderation

    monkeypatch.setattr(router.moderation, "PROPAGATION_S", 0.0)


async def test_a_stale_router_does_not_refuse_the_new_boards_scores_for_the_old_boards_ban(
    cluster_url: str, postgres_url: str
) -> None:
    """The player is banned on the board, which is then deleted and created again through another
    router: the ban does not hold on the new board. A router that still held the old board in its
    cache screened the score against the old board's incarnation, found the ban, and answered
    `banned` (200, final for a client) without writing anything, so it never learnt the board was
    gone; the refusal was recorded in refused_results for the new board too. It answers as for any
    write to a board it still held (404 board_not_found: a retry reaches the new board), and
    records no refusal."""
    async with (
        running(cluster_url, postgres_url=postgres_url) as (app, client),
        running(cluster_url, postgres_url=postgres_url) as (stale_app, stale),
    ):
        name = await make_board(client)
        player, scope = f"stale-{name}", {"scope": "board", "board": name}
        r = await client.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        await service_of(stale_app).moderation.bans.refresh()
        assert await post(stale, name, [score("fair", 1, "m0")]) == ["improved"]  # `stale` keeps it
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        body = {"scores": [score(player, 5, "m1")]}
        first = await stale.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        assert first.status_code in (200, 404), first.text
        if first.status_code == 200:
            assert first.json()["results"][0]["status"] == "improved"
        else:
            assert first.json()["error"]["code"] == "board_not_found"
            assert await post(stale, name, body["scores"]) == ["improved"]  # the retry
        got = await client.get(f"/v1/boards/{name}/players/{player}")
        assert (got.status_code, got.json().get("points")) == (200, 5), got.text
        assert await refusals_recorded(postgres_url, name, app, stale_app) == []
        await client.post(f"/v1/players/{player}:unban", json=scope, headers=AS_ADMIN)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_a_ban_through_a_stale_router_removes_the_player_from_the_board_created_again(
    cluster_url: str, postgres_url: str
) -> None:
    """The board is deleted and created again through one router, the player posts there, and the
    player is banned (on that board, or on every board) through another router that still held the
    old board in its cache. The ban is stored for the new board (its incarnation read from the
    registry), but its removal looked the board up in that cache: the old board's incarnation did
    not match the ban's, so nothing was removed (a ban of every board met the old board deleted, and
    skipped it). The banned player's results stayed on the new board, ranked, while a rebuild or a
    settlement of it leaves them out. The removal now looks the board up again when its copy is not
    the board the ban holds on (or was deleted)."""
    async with (
        running(cluster_url, postgres_url=postgres_url) as (_, client),
        running(cluster_url, postgres_url=postgres_url) as (_, stale),
    ):
        name = await make_board(client)
        on_board, everywhere = f"board-{name}", f"all-{name}"
        assert await post(stale, name, [score("fair", 1, "m0")]) == ["improved"]  # `stale` keeps it
        assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
        r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        at = times.now_ms()
        assert await post(client, name, [score(on_board, 5, "m1", at), score(everywhere, 6, "m2", at)]) == [
            "improved",
            "improved",
        ]
        bans: list[tuple[str, dict[str, Any]]] = [
            # The board's first: its removal reads the registry, leaving `stale`'s copy as it was.
            (on_board, {"scope": "board", "board": name}),
            (everywhere, {"scope": "all"}),
        ]
        for player, scope in bans:
            r = await stale.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
            assert name in r.json()["removed_from"], (player, r.text)
            got = await client.get(f"/v1/boards/{name}/players/{player}")
            assert got.status_code == 404, (player, got.text)
        for player, scope in bans:
            await client.post(f"/v1/players/{player}:unban", json=scope, headers=AS_ADMIN)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_an_unban_retried_answers_as_its_first_call(cluster_url: str, postgres_url: str) -> None:
    """An unban whose answer was lost is sent again with its X-Request-Id: the retry is the lift made
    already (it deletes nothing, and writes no audit row), but it answered `lifted: false`, as if
    there had been no ban to lift: the ban it lifted was gone by then. It answers as the first call
    did, as a ban's or a removal's retry does."""
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name = await make_board(client)
        player, scope = f"unban-{name}", {"scope": "board", "board": name}
        r = await client.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        asked = {**AS_ADMIN, "X-Request-Id": f"u1-{name}"}
        for _ in range(2):
            r = await client.post(f"/v1/players/{player}:unban", json=scope, headers=asked)
            assert r.status_code == 200, r.text
            assert r.json() == {"player_id": player, "lifted": True}
        asked = {**AS_ADMIN, "X-Request-Id": f"u2-{name}"}
        for _ in range(2):  # nothing to lift: so says its retry too
            r = await client.post(f"/v1/players/{player}:unban", json=scope, headers=asked)
            assert r.json() == {"player_id": player, "lifted": False}, r.text
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_an_unban_of_a_ban_not_in_force_since_the_board_was_created_again_lifts_none(
    cluster_url: str, postgres_url: str
) -> None:
    """A ban of a board deleted (and created again) is not in force: GET /v1/bans does not list it
    and no router refuses the player for it. Its lift answered `lifted: true` all the same, as if
    the player had been banned until then. It answers false, and still deletes the old ban; a ban
    made on the board as it is now is lifted as ever."""
    async with running(cluster_url, postgres_url=postgres_url) as (_, client):
        name, gone = await make_board(client), await make_board(client)
        player = f"old-{name}"
        scope, scope_gone = {"scope": "board", "board": name}, {"scope": "board", "board": gone}
        for body in (scope, scope_gone):
            r = await client.post(f"/v1/players/{player}:ban", json=body, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
        for board in (name, gone):
            assert (await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)).status_code == 204
        r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        assert (await client.get(f"/v1/bans?player={player}", headers=AS_ADMIN)).json() == {"bans": []}
        for body in (scope, scope_gone):
            r = await client.post(f"/v1/players/{player}:unban", json=body, headers=AS_ADMIN)
            assert r.json() == {"player_id": player, "lifted": False}, r.text
        assert await rows(postgres_url, "SELECT 1 FROM bans WHERE player_id = %s", player) == []
        r = await client.post(f"/v1/players/{player}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        r = await client.post(f"/v1/players/{player}:unban", json=scope, headers=AS_ADMIN)
        assert r.json() == {"player_id": player, "lifted": True}, r.text
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


async def test_bans_written_back_of_a_board_created_again_do_not_hold_on_the_new_board(
    cluster_url: str, postgres_url: str, store: BoardStore, rebuilder: Rebuilder
) -> None:
    """`shardlb rebuild --all` writes PostgreSQL's bans back into Redis (``Bans.restore``), those of
    a board deleted and created again since among them, with their incarnation: routers that reload
    the list apply them to the old board only, so the new board takes the player's scores, and
    GET /v1/bans does not list them, while a ban of every board and one made on the new board hold.
    (A DELETE forgets the board's bans, test_bans_deleted.py: here it is one that left them, as a
    router without PostgreSQL does, until the archiver's sweep.)"""
    async with (
        running(cluster_url, postgres_url=postgres_url) as (app, client),
        running(cluster_url, postgres_url=postgres_url) as (other_app, other),
    ):
        name = await make_board(client)
        old, everywhere, new = f"old-{name}", f"all-{name}", f"new-{name}"
        scope = {"scope": "board", "board": name}
        for player, body in ((old, scope), (everywhere, {"scope": "all"})):
            r = await client.post(f"/v1/players/{player}:ban", json=body, headers=AS_ADMIN)
            assert r.status_code == 200, r.text
        await store.delete(name)  # the library's delete: the board's bans are left
        r = await client.put(f"/v1/boards/{name}", json={"periods": ["daily"]}, headers=AS_ADMIN)
        assert r.status_code == 201, r.text
        r = await client.post(f"/v1/players/{new}:ban", json=scope, headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        fields = [moderation.ban_field(name, old), moderation.ban_field(moderation.ALL, everywhere)]
        # A PARTIAL loss, on purpose: these three records alone (the list, its version and the
        # other modules' bans kept; a total loss is tests/test_moderation.py's FLUSHALL)
        await store.client.hdel(keys.BANS, *fields, moderation.ban_field(name, new))
        await rebuilder.restore(store)
        await forget_others_restored(store)  # boards of other modules, back marked as being rebuilt
        held = {b.player: b for b in await moderation.Bans(store.client).all()}
        assert {old, everywhere, new} <= set(held) and held[old].incarnation != held[new].incarnation
        for a in (app, other_app):
            await service_of(a).moderation.bans.refresh()
        for n, c in enumerate((client, other)):
            statuses = await post(c, name, [score(p, 5 + n, f"m{n}-{p}") for p in (old, everywhere, new)])
            assert statuses == ["improved", "banned", "banned"]
        listed = (await client.get("/v1/bans", headers=AS_ADMIN)).json()["bans"]
        assert {b["player_id"] for b in listed} & {old, everywhere, new} == {everywhere, new}
        for player, body in ((old, scope), (everywhere, {"scope": "all"}), (new, scope)):
            await client.post(f"/v1/players/{player}:unban", json=body, headers=AS_ADMIN)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
