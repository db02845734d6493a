"""router/dashboard.py and router/admin.py without a browser: the page and its files, their headers,
and the admin JSON checked against the cluster itself (tests/test_dashboard_browser.py drives the page)."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from starlette.applications import Starlette

from router import admin, dashboard
from shardlb import keys, reshard
from shardlb.cluster import LocalCluster
from shardlb.reshard import Resharder
from tests.ports import node_ports
from tests.router_support import AS_ADMIN, AS_READER, AS_WRITER, board_name, running, service_of
from tests.test_router_server import Server

pytestmark = pytest.mark.cluster

ADMIN_PATHS = (
    "/v1/admin/cluster",
    "/v1/admin/boards/{board}/shards",
    "/v1/admin/boards/{board}/reshard",
    "/v1/admin/metrics",
)
# The private cluster of the node-down test: a dead node is suspected after this long (instead of
# shardlb's 5 s), so the others agree it has failed sooner.
NODE_TIMEOUT_MS = 2000


@pytest.fixture(scope="module")
async def router(cluster: LocalCluster) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    async with running(cluster.url) as both:
        yield both


@pytest.fixture(scope="module")
async def board(router: tuple[Starlette, httpx.AsyncClient]) -> str:
    _, client = router
    name = board_name("dash")
    settings = {"periods": ["total", "daily"], "sharding": {"strategy": "hash", "shards": 8}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    scores = [{"player_id": f"p{i}", "points": i * 7 % 1000, "match_id": "m1"} for i in range(300)]
    r = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert r.status_code == 200
    return name


async def test_the_page_and_its_files_are_served_with_a_strict_policy(
    router: tuple[Starlette, httpx.AsyncClient],
) -> None:
    _, client = router
    page = await client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "unsafe" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    # No inline script: every <script> has a src on this origin and nothing between its tags.
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", page.text, re.S)
    assert scripts and all(
        re.search(r'src="/dashboard/[a-z.]+"', attrs) and not body for attrs, body in scripts
    )
    assert not re.search(r"\son[a-z]+=", page.text)  # no inline event handlers either
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = await client.get(f"/dashboard/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.headers["content-security-policy"] == policy
        # Offline: nothing is fetched from anywhere but this router.
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", r.text), name
        assert r.content == dashboard.FILES[name]
    assert not re.search(r"https?://", page.text)
    missing = await client.get("/dashboard/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert (await client.get("/dashboard", params={"key": "x"})).status_code == 400


async def test_the_page_is_found_with_a_trailing_slash_and_asks_for_no_icon(
    router: tuple[Starlette, httpx.AsyncClient],
) -> None:
    """`/dashboard/`, as an operator may type it, was 404 not_found; and every visit made the browser
    ask for /favicon.ico, a 404 and a `request refused` line in the router's log (make run, 2026-12-06)."""
    _, client = router
    slashed = await client.get("/dashboard/")
    assert slashed.status_code == 200 and slashed.content == dashboard.FILES["index.html"]
    assert slashed.headers["content-security-policy"] == dashboard.CSP
    # An icon of its own, inline (img-src allows data:), so no browser fetches /favicon.ico.
    assert re.search(r'<link rel="icon" href="data:[^"]*">', slashed.text)


async def test_the_page_carries_no_data(router: tuple[Starlette, httpx.AsyncClient], board: str) -> None:
    _, client = router
    for path in ("/dashboard", "/dashboard/app.js"):
        assert board not in (await client.get(path)).text


async def test_admin_endpoints_need_an_admin_key(
    router: tuple[Starlette, httpx.AsyncClient], board: str
) -> None:
    _, client = router
    for template in ADMIN_PATHS:
        path = template.format(board=board)
        r = await client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", path
        for headers in (AS_READER, AS_WRITER):
            r = await client.get(path, headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", path
        assert (await client.get(path, headers=AS_ADMIN)).status_code == 200, path
    assert {r.path for r in admin.ROUTES} == set(ADMIN_PATHS)


async def test_a_board_is_resharded_through_the_admin_endpoint(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, client = router
    # The router keeps a board 0.5 s, not 5 s: each reshard's mover waits that long (and a second)
    # for the routers' caches, not 6 s (router/admin.py); the only router here is this one.
    monkeypatch.setattr(service_of(app).boards, "ttl_s", 0.5)
    name = board_name("dash-rs")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 3}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    scores = [{"player_id": f"p{i}", "points": i, "match_id": "m1"} for i in range(50)]
    assert (
        await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    ).status_code == 200
    path = f"/v1/admin/boards/{name}/reshard"
    for bad in ({}, {"shards": 0}, {"shards": 2, "resume": True}, {"bands": [0, 10]}, {"shards": 2, "x": 1}):
        assert (await client.post(path, json=bad, headers=AS_ADMIN)).status_code == 422, bad
    assert (await client.post(path, json={"resume": True}, headers=AS_ADMIN)).status_code == 409  # none
    assert (await client.post(path, json={"shards": 3}, headers=AS_WRITER)).status_code == 403
    started = await client.post(path, json={"shards": 5}, headers=AS_ADMIN)
    assert started.status_code == 202 and started.json()["to_shards"] == 5, started.text
    assert (await client.post(path, json={"shards": 6}, headers=AS_ADMIN)).status_code == 409  # one at a time
    for _ in range(300):
        status = (await client.get(path, headers=AS_ADMIN)).json()
        if status["state"] == "none":
            break
        await asyncio.sleep(0.1)
    assert status["shards"] == 5 and status["last"]["from_shards"] == 3, status
    assert (await client.delete(path, headers=AS_ADMIN)).status_code == 409  # nothing to cancel
    top = (await client.get(f"/v1/boards/{name}/top?limit=100", headers=AS_ADMIN)).json()["entries"]
    assert [e["points"] for e in top] == list(range(49, -1, -1))
    assert (await client.get(f"/v1/boards/{name}", headers=AS_ADMIN)).json()["sharding"]["shards"] == 5
    # Then a band board, and that band board to new starts and fewer home shards.
    for layout in ({"shards": 5, "bands": [0, 40]}, {"shards": 2, "bands": [0, 10, 25, 40]}):
        started = await client.post(path, json=layout, headers=AS_ADMIN)
        assert started.status_code == 202, started.text
        for _ in range(300):
            status = (await client.get(path, headers=AS_ADMIN)).json()
            if status["state"] == "none":
                break
            await asyncio.sleep(0.1)
        sharding = (await client.get(f"/v1/boards/{name}", headers=AS_ADMIN)).json()["sharding"]
        assert sharding["strategy"] == "band" and sharding["bands"] == layout["bands"], sharding
        assert sharding["shards"] == layout["shards"], sharding
        top = (await client.get(f"/v1/boards/{name}/top?limit=100", headers=AS_ADMIN)).json()["entries"]
        assert [e["points"] for e in top] == list(range(49, -1, -1))
        me = (await client.get(f"/v1/boards/{name}/players/p30", headers=AS_ADMIN)).json()
        assert (me["rank"], me["players"]) == (20, 50), me
        shard_map = (await client.get(f"/v1/admin/boards/{name}/shards", headers=AS_ADMIN)).json()
        homes = [s for s in shard_map["shards"] if s["role"] == "home"]
        bands = [s for s in shard_map["shards"] if s["role"] == "band"]
        assert len(homes) == layout["shards"] and sum(s["members"] for s in homes) == 50
        assert [s["band_from"] for s in bands] == layout["bands"]
        # points 0..49: each band holds the players from its start up to the next band's
        edges = [*layout["bands"], 50]
        assert [s["members"] for s in bands] == [min(b, 50) - a for a, b in itertools.pairwise(edges)]
        sizes = [s["members"] for s in bands]
        assert shard_map["band_skew"] == round(max(sizes) * len(sizes) / 50, 3)
    again = await client.post(path, json={"shards": 2, "bands": [0, 10, 25, 40]}, headers=AS_ADMIN)
    assert again.status_code == 409 and "these bands already" in again.text  # the layout it has


async def _board_whose_movers_wait(
    app: Starlette, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, prefix: str
) -> tuple[str, str, asyncio.Event]:
    """A board of 2 shards, its reshard's path, and the event that lets its movers run: every
    mover's run waits for it (its take of the lease held back, as a busy event loop or a slow
    PostgreSQL would). Boards are kept 0.5 s, as in the tests above."""
    monkeypatch.setattr(service_of(app).boards, "ttl_s", 0.5)
    name = board_name(prefix)
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    released = asyncio.Event()
    run = Resharder.run

    async def held_back(self: Resharder, wait: bool = True) -> dict[str, Any]:
        await released.wait()
        return await run(self, wait)

    monkeypatch.setattr(Resharder, "run", held_back)
    return name, f"/v1/admin/boards/{name}/reshard", released


async def test_a_reshard_started_answers_a_mover_starting_before_it_takes_the_lease(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The POST's 202 is answered once the router has started its mover, which takes the board's
    lease only when its task runs: until 2026-12-06 the status read meanwhile said `"mover":
    "none"` (nothing moves it on) of a reshard whose mover was starting. Here the mover's take is
    held back until the answers are read, as a busy event loop or a slow PostgreSQL would."""
    app, client = router
    name, path, released = await _board_whose_movers_wait(app, client, monkeypatch, "dash-rs-start")
    started = await client.post(path, json={"shards": 3}, headers=AS_ADMIN)
    assert started.status_code == 202 and started.json()["mover"] == "starting", started.text
    status = (await client.get(path, headers=AS_ADMIN)).json()
    assert (status["state"], status["mover"]) == ("copying", "starting"), status
    released.set()
    for _ in range(300):
        status = (await client.get(path, headers=AS_ADMIN)).json()
        if status["state"] == "none":
            break
        assert status["mover"] in ("starting", "running"), status
        await asyncio.sleep(0.1)
    assert (status["shards"], status["last"]["to_shards"]) == (3, 3), status
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def test_every_process_sees_the_mover_a_post_started_as_starting(
    router: tuple[Starlette, httpx.AsyncClient], cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The POST's "starting" was its worker's alone (the mover task it holds): another worker of
    the router, another router, or `shardlb reshard BOARD --status` read `"mover": "none"` (nothing
    moves it on) until the mover took the board's lease. The start is noted in Redis now, until the
    mover takes its lease: every process says "starting", and none says it once the mover is done."""
    app, client = router
    name, path, released = await _board_whose_movers_wait(app, client, monkeypatch, "dash-rs-seen")
    async with running(cluster.url) as (_, other):
        started = await client.post(path, json={"shards": 3}, headers=AS_ADMIN)
        assert started.status_code == 202 and started.json()["mover"] == "starting", started.text
        status = (await other.get(path, headers=AS_ADMIN)).json()
        assert (status["state"], status["mover"]) == ("copying", "starting"), status
        shown = await reshard.command(cluster.url, name, action="status")
        assert (shown["state"], shown["mover"]) == ("copying", "starting"), shown
        released.set()
        for _ in range(300):
            status = (await other.get(path, headers=AS_ADMIN)).json()
            if status["state"] == "none":
                break
            assert status["mover"] in ("starting", "running"), status
            await asyncio.sleep(0.1)
        assert (status["shards"], status["last"]["to_shards"]) == (3, 3), status
    assert not await service_of(app).client.exists(keys.starting_key(name))  # gone with the start
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def test_a_reshard_started_whose_note_of_the_start_fails_is_moved_on(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The POST's note that its mover starts (``Resharder.announce``, for the status alone) fails
    once, Redis failing after the reshard was recorded. Failed before: the POST answered 503 with
    the reshard recorded and no mover started (a client that took the 503 for nothing done left it
    so until a watch found it abandoned). Now the failure is logged, as the mover task's own notes
    are (router/reshards.py), and the POST answers 202 with its mover started."""
    app, client = router
    monkeypatch.setattr(service_of(app).boards, "ttl_s", 0.5)  # as in the tests above
    name = board_name("dash-rs-note")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    announce = Resharder.announce
    failures: list[str] = []

    async def fails_once(self: Resharder, replace: bool = True) -> None:
        if not failures:
            failures.append(self.board_id)
            raise redis.exceptions.ConnectionError("the note's reply was lost")
        await announce(self, replace)

    monkeypatch.setattr(Resharder, "announce", fails_once)
    path = f"/v1/admin/boards/{name}/reshard"
    started = await client.post(path, json={"shards": 3}, headers=AS_ADMIN)
    assert started.status_code == 202, started.text
    assert failures == [name]
    for _ in range(300):
        status = (await client.get(path, headers=AS_ADMIN)).json()
        if status["state"] == "none":
            break
        await asyncio.sleep(0.1)
    assert (status["shards"], status["last"]["to_shards"]) == (3, 3), status
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


@pytest.mark.parametrize("other", ["finished", "cancelled", "running", "stopped"])
async def test_a_resume_while_a_mover_elsewhere_holds_the_lease_says_what_that_mover_did(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """A POST {"resume": true} while a mover elsewhere (a `shardlb reshard`, another router's) holds
    the board's lease. Failed before: the 202 came at once with the status of that mover's reshard,
    and this router's mover waited for the lease in the background, then gave way without a word
    (still running) or logged at info how the other ended it: the operator never learnt either,
    where `shardlb reshard --resume` says both. Now the answer waits a lease and a second, as the
    CLI does, and says it (``other_mover``, ``note``): the other ended it (finished, cancelled:
    nothing started), still runs it (nothing started), or let the lease go with the reshard under
    way (stopped: this router's mover takes it on and finishes it)."""
    app, client = router
    svc = service_of(app)
    monkeypatch.setattr(svc.boards, "ttl_s", 0.5)  # as in the tests above
    monkeypatch.setattr(reshard, "LEASE_MS", 3000)  # the resume waits a lease and a second
    name = board_name("dash-rs-other")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    scores = [{"player_id": f"p{i}", "points": i, "match_id": "m1"} for i in range(20)]
    r = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert r.status_code == 200, r.text
    live = Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0)
    await live.start(3)
    live.token = "a-live-mover"  # its lease, held by it all along
    lease = keys.lease_key(name)
    await svc.client.set(lease, live.token, px=60_000)
    path = f"/v1/admin/boards/{name}/reshard"
    resume = asyncio.create_task(client.post(path, json={"resume": True}, headers=AS_ADMIN))
    await asyncio.sleep(0.5)  # the resume has seen the lease held and waits
    if other == "finished":
        assert (await live.run())["state"] == "none"
    elif other == "cancelled":
        assert await live.cancel() == "cancelled"
    elif other == "stopped":
        await svc.client.delete(lease)  # the mover died, its lease gone with it
    answer = await resume
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert body.get("other_mover") == other, body
    if other == "running":
        assert (body["state"], body["mover"]) == ("copying", "running"), body
        assert "another mover is running the reshard" in body["note"], body
        assert not svc.reshards.moving(name)  # it gave way: no mover of this router waits on
        await svc.client.delete(lease)
        assert await live.cancel() == "cancelled"
    elif other == "stopped":
        assert "this router's mover takes it on" in body["note"], body
        for _ in range(300):
            status = (await client.get(path, headers=AS_ADMIN)).json()
            if status["state"] == "none":
                break
            await asyncio.sleep(0.1)
        assert status["shards"] == 3, status
    else:
        assert f"another mover {other} the reshard" in body["note"], body
        assert (body["state"], body["shards"]) == ("none", 3 if other == "finished" else 2), body
        assert not svc.reshards.moving(name)
    top = (await client.get(f"/v1/boards/{name}/top?limit=100", headers=AS_ADMIN)).json()["entries"]
    assert [e["points"] for e in top] == list(range(19, -1, -1))
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def test_a_reshard_started_whose_look_for_a_mover_elsewhere_fails_in_redis_still_starts_its_mover(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A POST {"shards": N} records the reshard, then looks for a mover elsewhere holding the
    board's lease (``Resharder.elsewhere``, since 2026-12-06). That look failing in Redis answered
    503 over a reshard recorded with no mover started, which the project had ruled out earlier that
    day for the status note (router/admin.py): the mover is started as before the look, and waits
    for the lease itself, and the 202 says so."""
    app, client = router
    svc = service_of(app)
    monkeypatch.setattr(svc.boards, "ttl_s", 0.5)  # as in the tests above
    name = board_name("dash-rs-look")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    scores = [{"player_id": f"p{i}", "points": i, "match_id": "m1"} for i in range(20)]
    r = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert r.status_code == 200, r.text

    async def fails(self: Resharder, stop: Any = None) -> str | None:
        raise redis.exceptions.ConnectionError("lost")

    path = f"/v1/admin/boards/{name}/reshard"
    with monkeypatch.context() as patched:
        patched.setattr(Resharder, "elsewhere", fails)
        answer = await client.post(path, json={"shards": 3}, headers=AS_ADMIN)
    assert answer.status_code == 202, answer.text
    assert "other_mover" not in answer.json(), answer.json()
    for _ in range(300):
        status = (await client.get(path, headers=AS_ADMIN)).json()
        if status["state"] == "none":
            break
        await asyncio.sleep(0.1)
    assert status["shards"] == 3, status
    top = (await client.get(f"/v1/boards/{name}/top?limit=100", headers=AS_ADMIN)).json()["entries"]
    assert [e["points"] for e in top] == list(range(19, -1, -1))
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def test_a_reshard_refused_names_the_field_of_its_body(
    router: tuple[Starlette, httpx.AsyncClient],
) -> None:
    """The shard count and band starts a reshard refuses were named as a PUT's (`sharding.shards`,
    `sharding.bands`), fields its body does not have: the error's field is the body's own
    (api.md: the offending field), and nothing is recorded."""
    _, client = router
    name = board_name("dash-rs-bad")
    settings = {"durability": "memory", "points_max": 1000, "sharding": {"strategy": "hash", "shards": 3}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    path = f"/v1/admin/boards/{name}/reshard"
    for body, field in (
        ({"shards": 2, "bands": [5, 10]}, "bands"),
        ({"shards": 2, "bands": [0, 5000]}, "bands"),  # above the board's points_max
        ({"shards": 1024, "bands": [0, 10]}, "shards"),  # too many beside its bands
    ):
        r = await client.post(path, json=body, headers=AS_ADMIN)
        error = r.json()["error"]
        assert (r.status_code, error["field"]) == (422, field), (body, r.text)
        assert "sharding." not in error["message"], r.text
    status = (await client.get(path, headers=AS_ADMIN)).json()
    assert (status["state"], status["shards"]) == ("none", 3)
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def test_cluster_lists_every_node_with_its_slots_and_memory(
    router: tuple[Starlette, httpx.AsyncClient], cluster: LocalCluster
) -> None:
    _, client = router
    body = (await client.get("/v1/admin/cluster", headers=AS_ADMIN)).json()
    assert body["ready"] and body["problem"] is None and body["state"] == "ok"
    assert body["slots_ok"] == keys.SLOTS and body["primaries"] == 3 and body["known_nodes"] == 6
    nodes = body["nodes"]
    assert sorted(n["address"] for n in nodes) == sorted(f"127.0.0.1:{p}" for p in cluster.ports)
    primaries = [n for n in nodes if n["role"] == "primary"]
    assert len(primaries) == 3 and sum(n["slots"] for n in primaries) == keys.SLOTS
    addresses = {n["address"] for n in primaries}
    assert all(n["primary"] in addresses and n["slots"] == 0 for n in nodes if n["role"] == "replica")
    assert all(n["connected"] and not n["failing"] and n["memory"]["used"] > 0 for n in nodes)


async def test_shard_map_names_each_shards_slot_owner_and_members(
    router: tuple[Starlette, httpx.AsyncClient], board: str
) -> None:
    app, client = router
    svc = service_of(app)
    found = await svc.boards.lookup(board)
    for period in ("total", "daily"):
        body = (
            await client.get(f"/v1/admin/boards/{board}/shards", params={"period": period}, headers=AS_ADMIN)
        ).json()
        size = (await client.get(f"/v1/boards/{board}", headers=AS_ADMIN)).json()["players"][period]
        assert body["board"] == board and body["period"].startswith(period)
        assert [s["shard"] for s in body["shards"]] == list(range(8))
        assert sum(s["members"] for s in body["shards"]) == size == 300
        assert all(s["members"] > 0 for s in body["shards"])  # 300 players hashed over 8 shards
        assert "band_skew" not in body and not any("role" in s for s in body["shards"])  # a hash board
        for s, prefix in zip(body["shards"], found.prefixes, strict=True):
            assert s["slot"] == keys.slot_of(prefix)
            # The router's own client routes the shard's keys to the node the map names.
            assert s["node"] == svc.client.get_node_from_key(prefix).name
    r = await client.get(f"/v1/admin/boards/{board}/shards", params={"period": "weekly"}, headers=AS_ADMIN)
    assert r.status_code == 422 and r.json()["error"]["field"] == "period"
    r = await client.get(f"/v1/admin/boards/{board_name()}/shards", headers=AS_ADMIN)
    assert r.status_code == 404 and r.json()["error"]["code"] == "board_not_found"


async def test_metrics_count_this_routers_writes_scores_and_reads(
    router: tuple[Starlette, httpx.AsyncClient], board: str
) -> None:
    _, client = router
    before = (await client.get("/v1/admin/metrics", headers=AS_ADMIN)).json()
    scores = [{"player_id": f"q{i}", "points": i, "match_id": "m2"} for i in range(5)]
    for _ in range(3):
        r = await client.post(f"/v1/boards/{board}/scores", json={"scores": scores}, headers=AS_WRITER)
        assert r.status_code == 200
    for path in ("top", "entries", "players/p1", "players/p1/around"):
        assert (await client.get(f"/v1/boards/{board}/{path}")).status_code == 200
    r = await client.post(f"/v1/boards/{board}/players:query", json={"player_ids": ["p1"]})
    assert r.status_code == 200
    await client.get(f"/v1/boards/{board}")  # board settings: neither a read of the game nor a write
    after = (await client.get("/v1/admin/metrics", headers=AS_ADMIN)).json()
    assert after["bounds"] == before["bounds"] and after["at_ms"] >= before["at_ms"]
    assert after["writes"]["requests"] - before["writes"]["requests"] == 3
    assert after["writes"]["scores"] - before["writes"]["scores"] == 15
    assert after["reads"]["requests"] - before["reads"]["requests"] == 5
    for kind in ("writes", "reads"):
        buckets = after[kind]["buckets"]
        assert len(buckets) == len(after["bounds"]) + 1 and buckets[-1] == after[kind]["requests"]
        assert buckets == sorted(buckets)  # cumulative


def test_metrics_add_up_every_worker(cluster: LocalCluster, tmp_path: Path) -> None:
    """With two workers each counts its own requests; the answer, from whichever worker, is the sum."""
    server = Server(cluster.url, tmp_path / "router.log", workers=2)
    try:
        name = board_name("dash")
        assert httpx.put(f"{server.url}/v1/boards/{name}", headers=AS_ADMIN).status_code == 201
        before = httpx.get(f"{server.url}/v1/admin/metrics", headers=AS_ADMIN).json()
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        workers: set[str] = set()
        sent = 0
        # A new connection each, until both workers have answered some (the kernel picks the worker).
        while sent < 40 or (len(workers) < 2 and sent < 1000):
            r = httpx.post(f"{server.url}/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
            assert r.status_code == 200
            workers.add(r.headers["x-request-id"][:16])  # a worker's random prefix (router/middleware.py)
            sent += 1
        after = httpx.get(f"{server.url}/v1/admin/metrics", headers=AS_ADMIN).json()
        assert len(workers) == 2
        assert after["writes"]["requests"] - before["writes"]["requests"] == sent
        assert after["writes"]["scores"] - before["writes"]["scores"] == sent
    finally:
        assert server.stop() == 0


async def test_cluster_view_answers_with_a_node_down(tmp_path: Path) -> None:
    """A private cluster loses a replica: the cluster view still answers, shows that node without
    memory, and once the others agree it has failed, flags it."""
    port = node_ports(6)
    local = LocalCluster(3, 1, port, tmp_path / "cluster")
    local.up()
    try:
        for node in local.ports:
            with redis.Redis(host=local.host, port=node) as r:
                r.config_set("cluster-node-timeout", NODE_TIMEOUT_MS)
        async with running(local.url) as (_, client):
            replica = next(n for n in local.status().nodes if n.port == local.ports[3])
            assert replica.pid is not None
            os.kill(replica.pid, signal.SIGKILL)
            dead = f"127.0.0.1:{replica.port}"
            deadline = time.monotonic() + 60
            while True:
                r = await client.get("/v1/admin/cluster", headers=AS_ADMIN)
                assert r.status_code == 200, r.text
                row = next(n for n in r.json()["nodes"] if n["address"] == dead)
                assert row["memory"]["used"] is None
                if row["failing"]:
                    break
                assert time.monotonic() < deadline, "the dead replica was never flagged as failing"
                await asyncio.sleep(0.5)
            body = r.json()
            assert body["state"] == "ok" and body["slots_ok"] == keys.SLOTS  # a replica held no slots
            assert all(n["memory"]["used"] for n in body["nodes"] if n["address"] != dead)
    finally:
        local.down()


@pytest.mark.parametrize("why", ["moving", "stopping"])
async def test_a_resume_that_starts_no_mover_leaves_the_note_of_the_mover_that_starts(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """A POST {"resume": true} that starts no mover (``ReshardWatch.start`` is False): this router
    runs one of the board already, waiting to run again after a failure (moving), or it is stopping.
    That mover, or another process's, has said it starts (``Resharder.announce``). Failed before:
    the POST's own note took its place, and its take-back removed it, so every other process read
    "mover": "none" of a reshard a mover was about to take on. Now the note stays."""
    app, client = router
    svc = service_of(app)
    name = board_name("dash-rs-kept")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    await Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0).start(3)
    await svc.client.set(keys.starting_key(name), "a-starting-mover", px=60_000)
    waits = asyncio.create_task(asyncio.sleep(3600))  # this router's mover between two runs
    if why == "moving":
        svc.reshards.movers[name] = waits
    else:
        monkeypatch.setattr(svc.reshards, "closed", True)
    path = f"/v1/admin/boards/{name}/reshard"
    try:
        answer = await client.post(path, json={"resume": True}, headers=AS_ADMIN)
        assert answer.status_code == 202, answer.text
        assert answer.json()["mover"] == "starting", answer.json()
        elsewhere = Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0)
        assert (await elsewhere.status())["mover"] == "starting"  # as another process reads it
    finally:
        waits.cancel()
        svc.reshards.movers.pop(name, None)
    await svc.client.delete(keys.starting_key(name))
    assert await Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0).cancel() == "cancelled"
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


@pytest.mark.parametrize("ended", ["finished", "cancelled", "finished-another-recorded"])
async def test_a_resume_whose_reshard_ends_elsewhere_after_its_first_look_says_how_it_ended(
    router: tuple[Starlette, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch, ended: str
) -> None:
    """A POST {"resume": true} reads the record (a reshard under way), and before it looks at the
    board's lease the mover elsewhere ends that reshard: finished or cancelled, its lease let go
    (``Resharder.elsewhere``). Failed before: the lease free, the POST took it for no mover and
    answered 409 "no reshard under way". Or that mover finishes it and a new reshard is recorded
    while the lease is still held (finished-another-recorded): the POST said "stopped" and
    started a mover of the new one, as if the one it waited for had been left half done. Now
    both say how the reshard it saw ended, and start no mover."""
    app, client = router
    svc = service_of(app)
    monkeypatch.setattr(svc.boards, "ttl_s", 0.5)  # as in the tests above
    name = board_name("dash-rs-ended")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    scores = [{"player_id": f"p{i}", "points": i, "match_id": "m1"} for i in range(20)]
    r = await client.post(f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert r.status_code == 200, r.text
    live = Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0)
    await live.start(3)
    after = Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0)  # a reshard since
    lease = keys.lease_key(name)
    record = Resharder.record
    looked: list[str] = []
    held = asyncio.Event()

    async def then_ends(self: Resharder) -> tuple[Any, dict[str, Any]]:
        found = await record(self)
        if self.token in (live.token, after.token) or looked:
            return found
        looked.append(self.board_id)  # the POST's first look: the other mover ends it now
        if ended == "cancelled":
            assert await live.cancel() == "cancelled"
        else:
            assert (await live.run())["state"] == "none"
        if ended == "finished-another-recorded":
            await after.start(4)
            await svc.client.set(lease, "a-mover-finishing-up", px=60_000)
            held.set()
        return found

    monkeypatch.setattr(Resharder, "record", then_ends)
    path = f"/v1/admin/boards/{name}/reshard"
    resume = asyncio.create_task(client.post(path, json={"resume": True}, headers=AS_ADMIN))
    if ended == "finished-another-recorded":
        await held.wait()
        await asyncio.sleep(0.5)  # the resume has seen the lease held and waits
        await svc.client.delete(lease)
    answer = await resume
    monkeypatch.setattr(Resharder, "record", record)
    assert answer.status_code == 202, answer.text
    body = answer.json()
    other = ended.split("-")[0]
    assert body.get("other_mover") == other, body
    assert f"another mover {other} the reshard" in body["note"], body
    assert not svc.reshards.moving(name)
    if ended == "finished-another-recorded":
        assert (body["state"], body["shards"], body["to_shards"]) == ("copying", 3, 4), body
        assert "another reshard, to 4 shards, was recorded since" in body["note"], body
        assert await after.cancel() == "cancelled"
    else:
        assert (body["state"], body["shards"]) == ("none", 3 if other == "finished" else 2), body
    top = (await client.get(f"/v1/boards/{name}/top?limit=100", headers=AS_ADMIN)).json()["entries"]
    assert [e["points"] for e in top] == list(range(19, -1, -1))
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204


async def test_a_resume_waiting_for_a_mover_elsewhere_answers_when_its_router_drains(
    router: tuple[Starlette, httpx.AsyncClient], tmp_path: Path
) -> None:
    """A POST {"resume": true} to a router process waits for a mover elsewhere that holds the board's
    lease (a lease and a second, 11 s), and the router is told to stop (SIGTERM) meanwhile, its
    drain shorter than that wait (SHARDLB_DRAIN_SECONDS, 10 by default, 2 here). Failed before: the
    drain ran out with the POST still waiting, and uvicorn cancelled it (503 ``shutting_down``, as
    for any request cut off), though the router knew that another mover held the lease. Now the
    wait ends when the drain begins, and the answer says what is known: that mover runs it."""
    app, client = router
    svc = service_of(app)
    name = board_name("dash-rs-drain")
    settings = {"durability": "memory", "sharding": {"strategy": "hash", "shards": 2}}
    assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
    live = Resharder(svc.boards.store, name, say=lambda _: None, cache_s=0)
    await live.start(3)
    lease = keys.lease_key(name)
    await svc.client.set(lease, "a-live-mover", px=120_000)  # held all along, as by a live mover
    cluster_url = svc.settings.redis_url
    server = Server(cluster_url, tmp_path / "router.log", SHARDLB_DRAIN_SECONDS="2")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as other_router:
            path = f"/v1/admin/boards/{name}/reshard"
            resume = asyncio.create_task(other_router.post(path, json={"resume": True}, headers=AS_ADMIN))
            await asyncio.sleep(1.0)  # the resume has seen the lease held and waits
            server.proc.send_signal(signal.SIGTERM)
            answer = await resume
    finally:
        assert await asyncio.to_thread(server.stop) == 0
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert (body.get("other_mover"), body["mover"]) == ("running", "running"), body
    assert "this router is shutting down" in body["note"], body
    await svc.client.delete(lease)
    assert await live.cancel() == "cancelled"
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
