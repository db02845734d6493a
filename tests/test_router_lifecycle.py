"""The period lifecycle through the router (issue 12, item 1): ``resets_at`` on the board and on
every read, ``closed_periods`` on a late score's result, and the lifecycle settings refused when bad.

Expected instants are computed here from the calendar (datetime arithmetic), not through
shardlb.periods, so a wrong period end there fails these tests.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, date, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from shardlb import times
from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_WRITER, board_name, running
from tests.test_router_api import assert_error, make_board, post, score

pytestmark = pytest.mark.cluster

TOKYO = ZoneInfo("Asia/Tokyo")
DAY_MS = 86_400_000
WEEKDAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url, top_refresh_s=0.2, histogram_samples=8, histogram_refresh_s=0.2) as (
        _,
        c,
    ):
        yield c


def midnight(day: date, tz: ZoneInfo) -> str:
    return datetime(day.year, day.month, day.day, tzinfo=tz).isoformat()


def ends_in_tokyo(today: date) -> dict[str, str]:
    """When today's day, its Sunday-start week and its month end in Tokyo."""
    to_sunday = (6 - today.weekday()) % 7 or 7
    first_of_next = date(today.year + today.month // 12, today.month % 12 + 1, 1)
    return {
        "daily": midnight(today + timedelta(days=1), TOKYO),
        "weekly": midnight(today + timedelta(days=to_sunday), TOKYO),
        "monthly": midnight(first_of_next, TOKYO),
    }


async def test_resets_at_on_the_board_and_every_read(client: httpx.AsyncClient) -> None:
    settings = {"periods": ["daily", "weekly", "monthly"], "timezone": "Asia/Tokyo", "week_start": "sunday"}
    name = await make_board(client, settings)
    now = times.now_ms()
    today = datetime.now(TOKYO).date()
    await post(client, name, [score("a", 5, "m1", now), score("b", 7, "m1", now)])
    board = (await client.get(f"/v1/boards/{name}")).json()
    assert board["week_start"] == "sunday" and board["close_grace"] == 300
    if datetime.now(TOKYO).date() != today:
        pytest.skip("Tokyo's midnight passed during the test")
    want = ends_in_tokyo(today)
    assert board["resets_at"] == want

    reads: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "top", None),
        ("GET", "entries", None),
        ("GET", "players/a", None),
        ("GET", "players/a?estimate=true", None),
        ("GET", "players/a/around", None),
        ("POST", "players:query", {"player_ids": ["a", "b"]}),
    ]
    yesterday = today - timedelta(days=1)
    for period, expected in [
        ("total", None),
        ("daily", want["daily"]),
        ("weekly", want["weekly"]),
        ("monthly", want["monthly"]),
        (f"daily:{yesterday.isoformat()}", midnight(today, TOKYO)),
    ]:
        for method, path, body in reads:
            sep = "&" if "?" in path else "?"
            r = await client.request(method, f"/v1/boards/{name}/{path}{sep}period={period}", json=body)
            if r.status_code == 404:  # a player read of a period the player has no score in
                assert period.startswith("daily:") and path.startswith("players/")
                continue
            assert r.status_code == 200, (path, period, r.text)
            assert r.json()["resets_at"] == expected, (path, period)


async def test_a_utc_boards_times_are_all_written_with_z(client: httpx.AsyncClient) -> None:
    """Every time of a UTC board's answers reads "...Z", as achieved_at does: until 2026-12-06
    resets_at read "+00:00" beside them (the same instant, spelt another way)."""
    name = await make_board(client, {"periods": ["daily", "weekly", "monthly"]})
    await post(client, name, [score("a", 5, "m1", times.now_ms())])
    utc = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z")
    board = (await client.get(f"/v1/boards/{name}")).json()
    assert set(board["resets_at"]) == {"daily", "weekly", "monthly"}
    written = [board["epoch"], *board["resets_at"].values()]
    for path in ("top?period=daily", "entries?period=weekly", "players/a?period=monthly"):
        body = (await client.get(f"/v1/boards/{name}/{path}")).json()
        entries = body.get("entries", [body])
        written += [body["resets_at"], *(e["achieved_at"] for e in entries)]
        written += [body["as_of"]] if "as_of" in body else []
    assert [at for at in written if not utc.fullmatch(at)] == []


async def test_a_late_score_says_which_periods_it_missed(client: httpx.AsyncClient) -> None:
    now = times.now_ms()
    late = now - 2 * DAY_MS
    late_day = datetime.fromtimestamp(late / 1000, tz=UTC).date()
    # The week starts on the late score's day, so only its day has closed (days ago).
    settings = {"periods": ["daily", "weekly"], "week_start": WEEKDAYS[late_day.weekday()], "mode": "incr"}
    name = await make_board(client, settings)
    results = await post(client, name, [score("a", 5, "m1", now), score("a", 7, "m2", late)])
    assert results == [
        {"player_id": "a", "match_id": "m1", "status": "improved", "points": 5},  # nothing missed: no field
        {
            "player_id": "a",
            "match_id": "m2",
            "status": "improved",
            "points": 12,
            "closed_periods": [f"daily:{late_day.isoformat()}"],
        },
    ]
    again = await post(client, name, [score("a", 7, "m2", late)])  # the client's retry: a duplicate
    assert again == [{"player_id": "a", "match_id": "m2", "status": "duplicate", "points": 12}]
    for period in ("total", "weekly"):  # this week began on the late score's day
        top = (await client.get(f"/v1/boards/{name}/top", params={"period": period})).json()
        assert [(e["player_id"], e["points"]) for e in top["entries"]] == [("a", 12)], period
    closed = (await client.get(f"/v1/boards/{name}/top", params={"period": f"daily:{late_day}"})).json()
    assert closed["entries"] == []


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("close_grace", -1),
        ("close_grace", 7 * 86_400 + 1),
        ("close_grace", "300"),
        ("close_grace", True),
        ("close_grace", 1.5),
        ("close_grace", None),
        ("week_start", "funday"),
        ("week_start", "Monday"),
        ("week_start", 0),
        ("week_start", None),
    ],
)
async def test_bad_lifecycle_settings_are_refused(
    client: httpx.AsyncClient, setting: str, value: Any
) -> None:
    name = board_name()
    r = await client.put(f"/v1/boards/{name}", json={"periods": ["weekly"], setting: value}, headers=AS_ADMIN)
    assert_error(r, 422, "invalid_input", setting)
    assert_error(await client.get(f"/v1/boards/{name}"), 404, "board_not_found", "board")


async def test_lifecycle_settings_are_kept(client: httpx.AsyncClient) -> None:
    name = await make_board(client, {"periods": ["weekly"], "close_grace": 0, "week_start": "saturday"})
    board = (await client.get(f"/v1/boards/{name}", headers=AS_WRITER)).json()
    assert (board["close_grace"], board["week_start"]) == (0, "saturday")
    listed = (await client.get("/v1/boards")).json()["boards"]
    assert {"close_grace": 0, "week_start": "saturday"}.items() <= next(
        b for b in listed if b["board"] == name
    ).items()
