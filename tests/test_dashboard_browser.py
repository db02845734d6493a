"""The dashboard as an operator uses it: Debian's chromium, driven by Playwright, against a real
router process on the suite's cluster. Everything the page shows is checked against the API's own
answers. Screenshots go to $SHARDLB_SCREENSHOTS (``make screenshots``: docs/img), else a temp dir.

Playwright's own browser download is never used: the test launches /usr/bin/chromium, which
scripts/ensure-chromium.sh (a prerequisite of ``make test``) installs with apt-get when it can.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import subprocess
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from PIL import Image
from playwright.async_api import Browser, Page, Route, async_playwright, expect

from shardlb.cluster import LocalCluster
from shardlb.rebuild import connected
from shardlb.store import BoardStore
from tests.router_support import ADMIN, AS_ADMIN, AS_WRITER, READ, board_name
from tests.test_rebuild import OnlyStore, archive_round, archiver, drain, own_archive
from tests.test_router_server import ROOT, Server
from tests.test_shard_loss import slot_wiped

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
PLAYERS = 6000
TODAY_EVERY = 5  # every fifth player also plays today: the daily board holds 1200
SEARCHED = "player-00035"
XSS = '<img src=x onerror="window.__xss=1">'
# Eight points on the scores chart: eight intervals of traffic between the page's samples.
CHART_POINTS = (
    "() => (document.querySelector('#chart-scores path')?.getAttribute('d') || '').split('L').length >= 8"
)


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "ensure-chromium.sh")], check=False)
    if not CHROMIUM.exists():
        pytest.skip(
            f"{CHROMIUM} is missing and could not be installed (needs root and apt-get: "
            "`apt-get install chromium`); the dashboard's browser test did not run"
        )
    return CHROMIUM


@pytest.fixture(scope="module")
def server(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(cluster.url, tmp_path_factory.mktemp("router") / "router.log")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def board(server: Server) -> str:
    """A board of 6000 players played yesterday, 1200 of whom also played today (the daily board)."""
    name = board_name("arena")
    # Yesterday's results arrive a day late: a week's grace keeps that day open for them.
    settings = {
        "periods": ["total", "daily"],
        "sharding": {"strategy": "hash", "shards": 8},
        "close_grace": 7 * 86_400,
    }
    assert httpx.put(f"{server.url}/v1/boards/{name}", json=settings, headers=AS_ADMIN).status_code == 201
    rng = random.Random(14)
    yesterday = (datetime.now(UTC) - timedelta(hours=30)).isoformat()
    scores = [
        {
            "player_id": f"player-{i:05d}",
            "points": rng.randrange(100_000),
            "match_id": "m1",
            "achieved_at": yesterday,
        }
        for i in range(PLAYERS)
    ]
    scores += [
        {"player_id": f"player-{i:05d}", "points": rng.randrange(100_000), "match_id": "m2"}
        for i in range(0, PLAYERS, TODAY_EVERY)
    ]
    for start in range(0, len(scores), 1000):
        batch = {"scores": scores[start : start + 1000]}
        r = httpx.post(f"{server.url}/v1/boards/{name}/scores", json=batch, headers=AS_WRITER, timeout=30)
        assert r.status_code == 200, r.text
    return name


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    target = Path(os.environ.get("SHARDLB_SCREENSHOTS") or tmp_path)
    target = target if target.is_absolute() else ROOT / target
    target.mkdir(parents=True, exist_ok=True)
    return target


@pytest.fixture(scope="module")
async def launched(chromium: Path) -> AsyncIterator[Browser]:
    """One chromium for the module: a launch cost each test 1-2 s of setup, most of it CPU."""
    async with async_playwright() as p:
        started = await p.chromium.launch(executable_path=str(chromium), args=FLAGS)
        try:
            yield started
        finally:
            await started.close()


@pytest.fixture
async def browser(launched: Browser) -> AsyncIterator[Browser]:
    """The module's chromium, as fresh as a new launch for each test: every ``new_page`` opens a
    browser context of its own (its own cookies, storage and cache), and the contexts a test opened
    are closed after it, so none of its pages goes on polling the router in the tests after it."""
    before = set(launched.contexts)
    try:
        yield launched
    finally:
        for context in [c for c in launched.contexts if c not in before]:
            await context.close()


async def screenshot(page: Page, path: Path, full_page: bool = False) -> None:
    """A PNG of the page in 64 colours: a fifth of the bytes, for docs/img (the page uses a dozen)."""
    png = await page.screenshot(full_page=full_page)
    with Image.open(io.BytesIO(png)) as shot:
        shot.convert("RGB").quantize(colors=64).save(path, optimize=True)


def api(server: Server, path: str, **params: Any) -> Any:
    r = httpx.get(f"{server.url}{path}", params=params, headers=AS_ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


async def table(page: Page, selector: str) -> list[tuple[int, str, int]]:
    """(rank, player, points) of each row of a table the page shows."""
    rows = await page.eval_on_selector_all(
        f"{selector} tbody tr",
        "rows => rows.map(r => [r.querySelector('.rank').textContent, r.querySelector('.player').textContent,"
        " r.querySelector('.points').textContent])",
    )
    return [(int(rank), player, int(points)) for rank, player, points in rows]


def entries(body: dict[str, Any]) -> list[tuple[int, str, int]]:
    return [(e["rank"], e["player_id"], e["points"]) for e in body["entries"]]


async def player_panel(page: Page) -> dict[str, str]:
    fields = ("id", "rank", "points", "percentile", "players")
    return {f: await page.locator(f"#player-{f}").inner_text() for f in fields}


def expected_panel(found: dict[str, Any]) -> dict[str, str]:
    return {
        "id": found["player_id"],
        "rank": str(found["rank"]),
        "points": str(found["points"]),
        "percentile": f"{found['percentile']:.2f}",
        "players": str(found["players"]),
    }


async def test_an_operator_finds_a_player_pages_deep_and_switches_period(
    browser: Browser, server: Server, board: str, shots: Path
) -> None:
    page = await browser.new_page(viewport={"width": 1280, "height": 860})
    requests: list[tuple[str, str | None]] = []
    page.on("request", lambda r: requests.append((r.url, r.headers.get("authorization"))))
    csp_violations: list[str] = []
    page.on(
        "console", lambda m: csp_violations.append(m.text) if "Content Security Policy" in m.text else None
    )

    await page.goto(f"{server.url}/dashboard")
    await expect(page.locator("#login")).to_be_visible()
    # A read key is not enough, and the page says so.
    await page.fill("#key", READ)
    await page.click("#login-form button")
    await expect(page.locator("#login-error")).to_contain_text("403")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")

    # Boards: settings and sizes as the API gives them.
    row = page.locator("#boards-table tbody tr", has_text=board)
    await expect(row).to_have_count(1)
    sizes = api(server, f"/v1/boards/{board}")["players"]
    assert sizes["total"] == PLAYERS and sizes["daily"] == PLAYERS // TODAY_EVERY
    await expect(row).to_contain_text(f"total {sizes['total']}, daily {sizes['daily']}")
    await expect(row).to_contain_text("hash: 8 shards")

    # The board: the live top 100, from the cached /top.
    await row.locator("a").click()
    await expect(page.locator("#entries tbody tr")).to_have_count(100)
    await expect(page.locator("#page-info")).to_contain_text("total · live top")
    assert await table(page, "#entries") == entries(api(server, f"/v1/boards/{board}/top", limit=100))

    # Search a player: rank, points, percentile, and the players around.
    await page.fill("#search", SEARCHED)
    await page.click("#search-form button")
    await expect(page.locator("#player-id")).to_have_text(SEARCHED)
    found = api(server, f"/v1/boards/{board}/players/{SEARCHED}")
    assert await player_panel(page) == expected_panel(found)
    around = entries(api(server, f"/v1/boards/{board}/players/{SEARCHED}/around", radius=5))
    await expect(page.locator("#around tbody tr")).to_have_count(len(around))
    assert await table(page, "#around") == around
    await expect(page.locator("#around tr.me .player")).to_have_text(SEARCHED)
    await expect(page.locator("#player")).to_be_in_viewport()
    await screenshot(page, shots / "dashboard-board.png")

    # Page to offset 5000: ranks 5001-5100, as /entries gives them.
    await page.fill("#offset", "5000")
    await page.click("#go")
    await expect(page.locator("#entries tbody tr .rank").first).to_have_text("5001")
    await expect(page.locator("#entries tbody tr")).to_have_count(100)
    assert await table(page, "#entries") == entries(
        api(server, f"/v1/boards/{board}/entries", offset=5000, limit=100)
    )
    await expect(page.locator("#page-info")).to_contain_text("ranks 5001–5100")

    # Switch to today's board: its top, and the searched player's standing there.
    await page.click("#periods button[data-value=daily]")
    daily = api(server, f"/v1/boards/{board}/top", period="daily", limit=100)
    await expect(page.locator("#page-info")).to_contain_text(daily["period"])
    await expect(page.locator("#entries tbody tr .rank").first).to_have_text("1")
    await expect(page.locator("#entries tbody tr")).to_have_count(100)
    assert await table(page, "#entries") == entries(daily)
    await expect(page.locator("#player-period")).to_have_text(daily["period"])
    await expect(page.locator("#player")).to_be_in_viewport()
    found = api(server, f"/v1/boards/{board}/players/{SEARCHED}", period="daily")
    assert found["players"] == PLAYERS // TODAY_EVERY
    assert await player_panel(page) == expected_panel(found)
    await screenshot(page, shots / "dashboard-daily.png")

    # A day by its date: the day the 6000 players first played.
    day = f"daily:{(datetime.now(UTC) - timedelta(hours=30)).date().isoformat()}"
    await page.fill("#period-name", day)
    await page.click("#period-form button")
    await expect(page.locator("#page-info")).to_contain_text(day)
    await expect(page.locator("#entries tbody tr")).to_have_count(100)
    first_day = api(server, f"/v1/boards/{board}/top", period=day, limit=100)
    assert await table(page, "#entries") == entries(first_day)
    await expect(page.locator("#player-players")).to_have_text(str(PLAYERS))
    await page.fill("#period-name", "weekly")  # a kind this board does not keep
    await page.click("#period-form button")
    await expect(page.locator("#notice")).to_contain_text("422 invalid_period")

    # Player ids are user input: what the page shows is text, never markup.
    await page.fill("#search", XSS)
    await page.click("#search-form button")
    await expect(page.locator("#player-error")).to_contain_text("422")
    await expect(page.locator("#player-error")).to_contain_text(XSS)
    await page.goto(f"{server.url}/dashboard#/board/{quote(XSS)}")
    await expect(page.locator("#board-name")).to_have_text(XSS)
    await expect(page.locator("#notice")).to_contain_text("422")
    assert await page.evaluate("window.__xss") is None
    assert await page.locator("main img").count() == 0

    # The key: in this tab's session storage, sent as a header, never in a URL; nothing fetched
    # from anywhere but the router.
    assert await page.evaluate("sessionStorage.getItem('shardlb.adminKey')") == ADMIN
    assert await page.evaluate("localStorage.length") == 0 and await page.context.cookies() == []
    assert requests and all(url.startswith(server.url) and ADMIN not in url for url, _ in requests)
    keyed = [auth for url, auth in requests if "/v1/" in url]
    assert keyed[0] == f"Bearer {READ}" and set(keyed[1:]) == {f"Bearer {ADMIN}"}  # the refused login, then
    assert ADMIN not in page.url
    assert csp_violations == []
    await page.close()


async def open_player(page: Page, server: Server, board: str, player: str) -> None:
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await expect(page.locator("#nav")).to_be_visible()
    await page.goto(f"{server.url}/dashboard#/board/{board}?player={player}")
    await expect(page.locator("#player-id")).to_have_text(player)


async def test_removing_a_player_asks_first_and_says_why_it_cannot(
    browser: Browser, server: Server, board: str
) -> None:
    """This router has no PostgreSQL for the removal's audit: the page shows the API's refusal."""
    page = await browser.new_page()
    victim = "player-00007"
    await open_player(page, server, board, victim)
    # Cancel first: nothing happens.
    await page.click("#remove")
    await expect(page.locator("#confirm")).to_be_visible()
    await expect(page.locator("#confirm-text")).to_contain_text(victim)
    await page.click("#confirm-no")
    await expect(page.locator("#confirm")).to_be_hidden()
    await page.click("#remove")
    await page.click("#confirm-yes")
    await expect(page.locator("#player-error")).to_contain_text("409 archive_not_configured")
    assert httpx.get(f"{server.url}/v1/boards/{board}/players/{victim}").status_code == 200
    await page.close()


async def test_a_removal_without_an_answer_says_so(browser: Browser, server: Server, board: str) -> None:
    """A removal whose request got no answer (the router restarting, the network cut) showed
    "undefined undefined: Failed to fetch": the page read an HTTP status and code that a failed
    fetch does not have. It now says there was no answer, and that the removal may have been made."""
    page = await browser.new_page()
    victim = "player-00009"
    await open_player(page, server, board, victim)

    async def cut(route: Route) -> None:
        if route.request.method == "DELETE":
            await route.abort("connectionreset")
        else:
            await route.continue_()

    await page.route(f"**/v1/boards/{board}/players/{victim}*", cut)
    await page.click("#remove")
    await page.click("#confirm-yes")
    error = page.locator("#player-error")
    await expect(error).to_contain_text("no answer from the router")
    assert "undefined" not in await error.inner_text()
    await page.close()


async def test_removing_a_player_is_audited_with_the_reason_given(
    browser: Browser, cluster: LocalCluster, postgres_url: str, board: str, tmp_path: Path
) -> None:
    """A router with the archive: the confirmed removal deletes the player, audited with its reason."""
    server = Server(cluster.url, tmp_path / "router.log", SHARDLB_POSTGRES_URL=postgres_url)
    try:
        page = await browser.new_page()
        victim = "player-00011"
        await open_player(page, server, board, victim)
        await page.click("#remove")
        await page.fill("#confirm-reason", "aimbot <b>reported</b> twice")
        await page.click("#confirm-yes")
        await expect(page.locator("#notice")).to_contain_text(f"Removed {victim} from {board}")
        await expect(page.locator("#player")).to_be_hidden()
        r = httpx.get(f"{server.url}/v1/boards/{board}/players/{victim}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "player_not_found"
        async with await psycopg.AsyncConnection.connect(postgres_url) as db:
            cursor = await db.execute(
                "SELECT reason FROM moderation_audit WHERE action = 'remove' AND board = %s "
                "AND player_id = %s",
                (board, victim),
            )
            assert await cursor.fetchall() == [("aimbot <b>reported</b> twice",)]
        await page.close()
    finally:
        assert server.stop() == 0


async def test_the_cluster_view_shows_nodes_shards_and_live_traffic(
    browser: Browser, server: Server, board: str, shots: Path
) -> None:
    banded = f"{board}-bands"  # a band board too, for the shard map's band column and skew
    settings = {"durability": "memory", "sharding": {"strategy": "band", "shards": 2, "bands": [0, 100]}}
    made = httpx.put(f"{server.url}/v1/boards/{banded}", json=settings, headers=AS_ADMIN, timeout=30)
    assert made.status_code == 201, made.text
    scores = [{"player_id": f"b{i}", "points": i * 5, "match_id": "m"} for i in range(30)]  # 20 below 100
    posted = httpx.post(f"{server.url}/v1/boards/{banded}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text
    page = await browser.new_page(viewport={"width": 1280, "height": 1000})
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await page.click("#nav-cluster")

    cluster = api(server, "/v1/admin/cluster")
    await expect(page.locator("#nodes tbody tr")).to_have_count(len(cluster["nodes"]))
    await expect(page.locator("#cluster-state")).to_contain_text("cluster_state ok")
    shown = await page.eval_on_selector_all(
        "#nodes tbody tr td:first-child", "cells => cells.map(c => c.textContent)"
    )
    assert shown == [n["address"] for n in cluster["nodes"]]
    journal = api(server, "/readyz")["journal"]
    await expect(page.locator("#journal-bound")).to_have_text(str(journal["bound"]))
    await expect(page.locator("#journal-results-bound")).to_have_text(str(journal["results_bound"]))
    await expect(page.locator("#reshards")).to_contain_text(" under way")

    await page.select_option("#shard-board", board)
    shard_map = api(server, f"/v1/admin/boards/{board}/shards")
    await expect(page.locator("#shards tbody tr")).to_have_count(8)
    cells = await page.eval_on_selector_all(
        "#shards tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )
    assert cells == [
        [str(s["shard"]), str(s["slot"]), s["node"], str(s["members"]), "", ""] for s in shard_map["shards"]
    ]
    await expect(page.locator("#shard-skew")).to_have_text("")
    await page.select_option("#shard-board", banded)
    await expect(page.locator("#shards tbody tr")).to_have_count(4)
    cells = await page.eval_on_selector_all(
        "#shards tbody tr", "rows => rows.map(r => r.cells[4].textContent)"
    )
    assert cells == ["home", "home", "band from 0 points", "band from 100 points"]
    await expect(page.locator("#shard-skew")).to_contain_text("largest band / mean band: 1.333")

    # Traffic while the charts fill: their lines come from the router's own counters.
    stop = asyncio.Event()

    async def play() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            n = 0
            while not stop.is_set():
                n += 1
                scores = [
                    {"player_id": f"live-{n % 300}-{i}", "points": n + i, "match_id": f"live{n}"}
                    for i in range(20)
                ]
                await client.post(f"/v1/boards/{board}/scores", json={"scores": scores}, headers=AS_WRITER)
                await client.get(f"/v1/boards/{board}/players/{SEARCHED}")
                await client.get(f"/v1/boards/{board}/entries", params={"offset": n * 10 % 5000})

    player = asyncio.create_task(play())
    try:
        await page.wait_for_function(
            CHART_POINTS,
            timeout=60_000,
        )
    finally:
        stop.set()
        await player
    assert not (await page.locator("#rate-scores").inner_text()).startswith("now: 0.0/s")
    await expect(page.locator("#chart-requests path")).to_have_count(2)  # writes and reads
    await expect(page.locator("#chart-p99 path")).to_have_count(2)
    await screenshot(page, shots / "dashboard-cluster.png", full_page=True)
    await page.close()


async def test_the_cluster_view_says_when_the_router_is_gone_and_when_it_is_back(
    browser: Browser, cluster: LocalCluster, tmp_path: Path
) -> None:
    """The router stops under an open cluster view: the state turns unknown (not the last "ok"), the
    nodes and journal are marked stale and the error is shown; a router back on the same address
    ends all three at the next poll."""
    server = Server(cluster.url, tmp_path / "router.log")
    try:
        page = await browser.new_page()
        await page.goto(f"{server.url}/dashboard")
        await page.fill("#key", ADMIN)
        await page.click("#login-form button")
        await page.click("#nav-cluster")
        state = page.locator("#cluster-state")
        await expect(state).to_contain_text("cluster_state ok")
        await expect(state).to_have_class("state ok")
        await expect(page.locator("#nodes tbody tr")).to_have_count(6)
        await expect(page.locator("#nodes")).not_to_have_class("stale")

        assert server.stop() == 0
        await expect(state).to_have_class("state bad")
        await expect(state).to_contain_text("cluster state unknown")
        await expect(state).not_to_contain_text("router ready")
        await expect(page.locator("#nodes")).to_have_class("stale")
        await expect(page.locator("#durability")).to_have_class("inline stale")
        await expect(page.locator("#notice")).to_have_class("error")

        server = Server(cluster.url, tmp_path / "router-again.log", port=server.port)
        await expect(state).to_have_class("state ok", timeout=10_000)
        await expect(state).to_contain_text("cluster_state ok")
        await expect(page.locator("#nodes")).not_to_have_class("stale")
        await expect(page.locator("#durability")).to_have_class("inline")
        await expect(page.locator("#notice")).to_have_text("")
        await expect(page.locator("#notice")).not_to_have_class("error")
        await page.close()
    finally:
        assert server.stop() == 0


async def test_the_rates_restart_when_the_counters_go_back(browser: Browser, server: Server) -> None:
    """The counters go back when the router restarts or a poll lands on another router behind the
    same address: the page starts its differences again there instead of charting a negative rate."""
    counts = [5000, 9000, 120, 4000, 8000]  # the third answer is from a fresh router
    served = 0

    async def metrics(route: Route) -> None:
        nonlocal served
        n = counts[min(served, len(counts) - 1)]
        body = {
            "at_ms": 1_790_000_000_000 + served * 2000,
            "bounds": [0.1],
            "writes": {"requests": n, "scores": n * 10, "buckets": [n, n]},
            "reads": {"requests": n, "buckets": [n, n]},
        }
        served += 1
        await route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page = await browser.new_page()
    await page.route("**/v1/admin/metrics", metrics)
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await page.click("#nav-cluster")
    await page.wait_for_function(
        "() => (document.querySelector('#chart-requests path')?.getAttribute('d') || '')"
        ".split('L').length >= 4",
        timeout=30_000,
    )
    for chart in ("#chart-requests", "#chart-scores"):
        for d in await page.eval_on_selector_all(
            f"{chart} path", "paths => paths.map(p => p.getAttribute('d'))"
        ):
            heights = [float(point.split(",")[1]) for point in d.replace("M", "L").split("L") if point]
            assert max(heights) <= 88.0, d  # the chart's axis is at 88: below it, a negative rate
    assert "-" not in await page.locator("#rate-requests").inner_text()
    await page.close()


async def test_a_board_view_never_shows_another_answer_as_its_own(browser: Browser, server: Server) -> None:
    """A board that cannot be opened (deleted, or never made) shows nothing of the board opened
    before it under its name, and a failed poll of the live top marks the rows it leaves as stale
    until a poll answers again."""
    shown, gone = board_name("shown"), board_name("gone")
    for name in (shown, gone):
        assert httpx.put(f"{server.url}/v1/boards/{name}", json={}, headers=AS_ADMIN).status_code == 201
    scores = [{"player_id": f"s{i}", "points": 10 * i, "match_id": "m"} for i in range(3)]
    posted = httpx.post(f"{server.url}/v1/boards/{shown}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text
    assert httpx.delete(f"{server.url}/v1/boards/{gone}", headers=AS_ADMIN).status_code == 204

    page = await browser.new_page()
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await expect(page.locator("#nav")).to_be_visible()
    await page.goto(f"{server.url}/dashboard#/board/{shown}?player=s1")
    await expect(page.locator("#entries tbody tr")).to_have_count(3)
    await expect(page.locator("#player-id")).to_have_text("s1")
    await expect(page.locator("#board-settings")).to_contain_text("total: 3 players")

    await page.goto(f"{server.url}/dashboard#/board/{gone}")
    await expect(page.locator("#notice")).to_contain_text("404 board_not_found")
    await expect(page.locator("#board-name")).to_have_text(gone)
    await expect(page.locator("#entries tbody tr")).to_have_count(0)
    await expect(page.locator("#board-settings")).to_have_text("")
    await expect(page.locator("#page-info")).to_have_text("")
    await expect(page.locator("#periods button")).to_have_count(0)
    await expect(page.locator("#player")).to_be_hidden()

    # The live top of a board that opened: a poll that fails leaves its rows marked stale.
    async def refused(route: Route) -> None:
        body = {"error": {"code": "cluster_unavailable", "message": "refused by the test", "field": None}}
        await route.fulfill(status=503, content_type="application/json", body=json.dumps(body))

    await page.goto(f"{server.url}/dashboard#/board/{shown}")
    await expect(page.locator("#entries tbody tr")).to_have_count(3)
    await expect(page.locator("#entries")).not_to_have_class("stale")
    await page.route("**/top?*", refused)
    await expect(page.locator("#notice")).to_contain_text("503 cluster_unavailable")
    await expect(page.locator("#entries")).to_have_class("stale")
    await expect(page.locator("#page-info")).to_have_class("muted stale")
    await page.unroute("**/top?*", refused)
    await expect(page.locator("#entries")).not_to_have_class("stale")
    await expect(page.locator("#page-info")).to_have_class("muted")
    await expect(page.locator("#notice")).to_have_text("")
    await page.close()


async def test_a_board_being_rebuilt_says_so_and_opens_once_the_rebuild_is_done(
    browser: Browser, server: Server
) -> None:
    """GET /v1/boards/{board} answers 503 ``board_rebuilding`` while `shardlb rebuild --all` has not
    rebuilt the board's shards after a loss of Redis (tests/test_rebuild_window.py makes one). The
    view showed the error once and stayed empty for good; it now shows the API's message,
    and opens by itself once the board answers (the page asks again after Retry-After)."""
    name = board_name("rebuilt")
    assert httpx.put(f"{server.url}/v1/boards/{name}", json={}, headers=AS_ADMIN).status_code == 201
    scores = [{"player_id": f"r{i}", "points": 10 * i, "match_id": "m"} for i in range(3)]
    posted = httpx.post(f"{server.url}/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text

    async def rebuilding(route: Route) -> None:
        message = (
            "shards 0, 1 lost their data in Redis, not rebuilt yet: this read would not be exact. Nothing "
            f"was written; retry later. `shardlb rebuild {name}` brings them back from PostgreSQL and the "
            "journal, unless a rebuild of the board is under way"
        )
        body = {"error": {"code": "board_rebuilding", "message": message, "field": None}}
        await route.fulfill(
            status=503, content_type="application/json", body=json.dumps(body), headers={"retry-after": "1"}
        )

    page = await browser.new_page()
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await expect(page.locator("#nav")).to_be_visible()
    await page.route(f"**/v1/boards/{name}", rebuilding)
    await page.goto(f"{server.url}/dashboard#/board/{name}")
    # The API's message, which names the shards and the command (until 2026-12-06 the page said
    # "being rebuilt after a loss of Redis", also of a shard lost alone that waits for an operator).
    settings = page.locator("#board-settings")
    await expect(settings).to_contain_text(f"`shardlb rebuild {name}` brings them back")
    await expect(page.locator("#entries tbody tr")).to_have_count(0)
    await page.unroute(f"**/v1/boards/{name}", rebuilding)
    await expect(page.locator("#board-settings")).to_contain_text("total: 3 players")
    await expect(page.locator("#entries tbody tr")).to_have_count(3)
    await page.close()


async def signed_in(browser: Browser, server: Server) -> Page:
    page = await browser.new_page()
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await expect(page.locator("#nav")).to_be_visible()
    return page


def small_board(server: Server, prefix: str, players: int = 3, shards: int = 2) -> str:
    name = board_name(prefix)
    settings = {"sharding": {"strategy": "hash", "shards": shards}}
    assert httpx.put(f"{server.url}/v1/boards/{name}", json=settings, headers=AS_ADMIN).status_code == 201
    scores = [{"player_id": f"r{i}", "points": 10 * i + 10, "match_id": "m"} for i in range(players)]
    posted = httpx.post(f"{server.url}/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER)
    assert posted.status_code == 200, posted.text
    return name


def refusing(code: str, status: int, times: int) -> Any:
    """A route handler that answers the request ``times`` times with this refusal (Retry-After 1),
    then lets it through to the router."""
    left = [times]

    async def handler(route: Route) -> None:
        if left[0] <= 0:
            await route.continue_()
            return
        left[0] -= 1
        error = {"code": code, "message": f"refused by the test ({code})", "field": None}
        body, wait = json.dumps({"error": error}), {"retry-after": "1"}
        await route.fulfill(status=status, content_type="application/json", body=body, headers=wait)

    return handler


@pytest.mark.parametrize(
    ("code", "status", "says"),
    [
        ("board_resharding", 503, "being resharded"),
        ("overloaded", 503, "cannot answer for this board now (503 overloaded"),
        ("rate_limited", 429, "cannot answer for this board now (429 rate_limited"),
    ],
    ids=["resharding", "overloaded", "rate-limited"],
)
async def test_a_board_refused_for_now_says_why_and_opens_by_itself(
    browser: Browser, server: Server, code: str, status: int, says: str
) -> None:
    """GET /v1/boards/{board} refused for now: a reshard's cut-over (503 ``board_resharding``), an
    overloaded router (503) or the read limit (429), each with Retry-After. Only
    ``board_rebuilding`` was asked for again; after any other the view showed the error once and
    stayed empty until the operator opened it again. It now says what the refusal is and opens by
    itself once the board answers."""
    name = small_board(server, "later")
    page = await signed_in(browser, server)
    await page.route(f"**/v1/boards/{name}", refusing(code, status, 2))
    await page.goto(f"{server.url}/dashboard#/board/{name}")
    await expect(page.locator("#board-settings")).to_contain_text(says)
    await expect(page.locator("#board-settings")).to_contain_text("opens by itself")
    await expect(page.locator("#board-settings")).to_contain_text("total: 3 players", timeout=15_000)
    await expect(page.locator("#entries tbody tr")).to_have_count(3)
    await page.close()


async def test_the_live_top_refused_for_now_waits_its_retry_after_bounded(
    browser: Browser, server: Server
) -> None:
    """The live top's poll refused with a Retry-After (503 overloaded) asks again only once it has
    passed, at most a minute later (a Retry-After of an hour waits a minute), its rows marked stale
    meanwhile; then it polls every second again. The page's clock is Playwright's, moved by the
    test: each request's time is the page's. Failed before: the second poll came 1 s after the
    first refusal (it polled every second whatever the router said)."""
    name = small_board(server, "patient")
    page = await browser.new_page()
    await page.clock.install()
    await page.goto(f"{server.url}/dashboard")
    await page.fill("#key", ADMIN)
    await page.click("#login-form button")
    await expect(page.locator("#nav")).to_be_visible()
    await page.clock.pause_at(datetime.now(UTC) + timedelta(seconds=5))
    await page.goto(f"{server.url}/dashboard#/board/{name}")
    await expect(page.locator("#entries tbody tr")).to_have_count(3)

    asked: list[int] = []  # the page's time of each poll of the top
    waits = ["30", "3600"]

    async def handler(route: Route) -> None:
        asked.append(int(await page.evaluate("Date.now()")))
        if len(asked) > len(waits):
            await route.continue_()
            return
        error = {"code": "overloaded", "message": "refused by the test", "field": None}
        body, headers = json.dumps({"error": error}), {"retry-after": waits[len(asked) - 1]}
        await route.fulfill(status=503, content_type="application/json", body=body, headers=headers)

    await page.route("**/top?*", handler)
    await page.clock.run_for(1000)
    await expect(page.locator("#entries")).to_have_class("stale")
    await expect(page.locator("#notice")).to_contain_text("503 overloaded")
    for _ in range(150):  # seconds of the page's time, one at a time
        await page.clock.run_for(1000)
        await page.evaluate("0")
        if len(asked) >= 3:
            break
    await expect(page.locator("#entries")).not_to_have_class("stale")
    await expect(page.locator("#entries tbody tr")).to_have_count(3)
    assert len(asked) >= 3, asked
    assert asked[1] - asked[0] >= 30_000, asked
    assert asked[2] - asked[1] >= 60_000, asked  # an hour asked for: a minute waited
    await page.close()


async def test_a_page_of_entries_refused_for_now_is_read_again(browser: Browser, server: Server) -> None:
    """A page at an offset is read once (not polled as the top is): refused for now (503, Retry-After)
    it stayed empty and stale until the operator paged again. It is read again after Retry-After."""
    name = small_board(server, "deep")
    page = await signed_in(browser, server)
    await page.route("**/entries?*", refusing("overloaded", 503, 1))
    await page.goto(f"{server.url}/dashboard#/board/{name}?offset=1")
    await expect(page.locator("#page-info")).to_contain_text("asking again")
    await expect(page.locator("#entries tbody tr")).to_have_count(2, timeout=15_000)
    await expect(page.locator("#entries")).not_to_have_class("stale")
    await expect(page.locator("#page-info")).to_contain_text("ranks 2–3")
    await page.close()


async def test_a_shard_lost_alone_is_named_with_its_command_and_the_board_opens_once_rebuilt(
    browser: Browser, server: Server, store: BoardStore, raw: Any, postgres_url: str, cluster_url: str
) -> None:
    """One shard of a board lost alone (its slot served again empty) and marked by the archiver's
    round: the board's GET answers 503 ``board_rebuilding``. The board view named neither the shard
    nor the command that brings it back (`shardlb rebuild BOARD --shard N`: nothing runs it by
    itself), and the cluster view's shard map showed the shard as an empty one of the board. The
    board view now names the shard and the command, the shard map says the shard is not rebuilt,
    and both show the board again once the rebuild is done."""
    name = small_board(server, "lost", players=30, shards=3)
    async with own_archive(postgres_url, "dashboard") as url:
        board = await store.get(name)
        a = await archiver(raw, OnlyStore(store.client, store.scripts, {name}), url)
        try:
            await drain(a)
            assert await slot_wiped(raw, board, 1) > 0
            await a.refresh()
            await archive_round(a)
        finally:
            await a.db.close()
        assert (await store.get(name)).rebuilding == {1}
        page = await signed_in(browser, server)
        await page.goto(f"{server.url}/dashboard#/board/{name}")
        settings = page.locator("#board-settings")
        # The router may answer from the record it kept of before the mark for a few seconds.
        await expect(settings).to_contain_text("lost its data in Redis and is not rebuilt", timeout=15_000)
        await expect(settings).to_contain_text(f"shardlb rebuild {name} --shard 1")
        await expect(page.locator("#entries tbody tr")).to_have_count(0)
        shard_map = await browser.new_page()
        await shard_map.goto(f"{server.url}/dashboard#/cluster")  # the same key: sessionStorage is per tab
        await shard_map.fill("#key", ADMIN)
        await shard_map.click("#login-form button")
        await shard_map.select_option("#shard-board", name)
        states = shard_map.locator("#shards tbody tr td:last-child")
        await expect(states).to_have_text(["", "NOT REBUILT", ""])
        await expect(shard_map.locator("#shard-lost")).to_contain_text(f"shardlb rebuild {name} --shard 1")
        async with connected(cluster_url, url) as (rebuilder, other):
            await rebuilder.rebuild(await other.get(name), shard=1)
        await expect(states).to_have_text(["", "", ""], timeout=15_000)
        await expect(shard_map.locator("#shard-lost")).to_have_text("")
        await expect(settings).to_contain_text("total: 30 players", timeout=15_000)
        await expect(page.locator("#entries tbody tr")).to_have_count(30)
        await shard_map.close()
        await page.close()
    await store.delete(name)


async def test_a_removal_refused_for_now_and_confirmed_again_is_one_call(
    browser: Browser, cluster: LocalCluster, store: BoardStore, raw: Any, postgres_url: str, tmp_path: Path
) -> None:
    """A removal of a player whose shard was lost alone: the router audits it, then refuses it (503
    ``board_rebuilding``, nothing removed). The page sent no X-Request-Id, the removal's retry key
    (router/middleware.py ``retry_key``), so the operator's Remove after the rebuild was a second
    call: audited twice, removed at a time of its own. The page now keeps the id of a removal
    refused for now or left without an answer, and sends it again when the same removal is
    confirmed again: one call, audited once."""
    async with own_archive(postgres_url, "dashremove") as url:
        only: set[str] = set()
        a = await archiver(raw, OnlyStore(store.client, store.scripts, only), url)  # its schema first
        server = Server(cluster.url, tmp_path / "router.log", SHARDLB_POSTGRES_URL=url)
        try:
            name = small_board(server, "remove", players=30, shards=3)
            only.add(name)
            await a.refresh()
            await drain(a)
            board = await store.get(name)
            victim = next(f"r{i}" for i in range(30) if board.layout.home(f"r{i}") == 1)
            page = await signed_in(browser, server)
            await page.goto(f"{server.url}/dashboard#/board/{name}?player={victim}")
            await expect(page.locator("#player-id")).to_have_text(victim)
            assert await slot_wiped(raw, board, 1) > 0

            async def remove() -> httpx.Headers:
                await page.click("#remove")
                await page.fill("#confirm-reason", "cheating")
                async with page.expect_response(lambda r: r.request.method == "DELETE") as answered:
                    await page.click("#confirm-yes")
                response = await answered.value
                sent = await response.request.all_headers()
                return httpx.Headers({**sent, ":status": str(response.status)})

            first = await remove()
            assert first[":status"] == "503"
            await expect(page.locator("#player-error")).to_contain_text("503 board_rebuilding")
            async with connected(cluster.url, url) as (rebuilder, other):
                await rebuilder.rebuild(await other.get(name), shard=1)
            tries = [first]
            while tries[-1][":status"] == "503" and len(tries) < 30:  # until the router reads the record
                await asyncio.sleep(0.2)
                tries.append(await remove())
            assert tries[-1][":status"] == "200"
            await expect(page.locator("#notice")).to_contain_text(f"Removed {victim} from {name}")
            ids = {t.get("x-request-id") for t in tries}
            assert len(ids) == 1 and None not in ids, ids
            async with await psycopg.AsyncConnection.connect(url) as db:
                cursor = await db.execute(
                    "SELECT count(*) FROM moderation_audit WHERE action = 'remove' AND board = %s "
                    "AND player_id = %s",
                    (name, victim),
                )
                assert await cursor.fetchone() == (1,)
            r = httpx.get(f"{server.url}/v1/boards/{name}/players/{victim}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "player_not_found"
            await page.close()
            await store.delete(name)
        finally:
            await a.db.close()
            assert server.stop() == 0


async def test_the_boards_list_says_which_board_is_being_rebuilt(browser: Browser, server: Server) -> None:
    """The boards list reads each board's GET for its players: one refused (503 ``board_rebuilding``
    after a loss of Redis, ``board_resharding``) showed "–", as for a board that failed for any
    reason. It now says the board's state; the others show their players as ever."""
    rebuilt, moving, fine = (small_board(server, p) for p in ("listrebuilt", "listmoving", "listfine"))
    page = await signed_in(browser, server)
    await page.route(f"**/v1/boards/{rebuilt}", refusing("board_rebuilding", 503, 1000))
    await page.route(f"**/v1/boards/{moving}", refusing("board_resharding", 503, 1000))
    await page.goto(f"{server.url}/dashboard#/boards")
    players = page.locator("#boards-table tbody tr", has_text=rebuilt).locator("td").last
    await expect(players).to_have_text("being rebuilt (503 board_rebuilding)")
    players = page.locator("#boards-table tbody tr", has_text=moving).locator("td").last
    await expect(players).to_have_text("being resharded (503 board_resharding)")
    players = page.locator("#boards-table tbody tr", has_text=fine).locator("td").last
    await expect(players).to_have_text("total 3")
    await page.close()
