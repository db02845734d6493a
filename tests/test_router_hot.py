"""router/hot.py: a top asked again within its second is answered from the bytes rendered for it,
and only while they are still the current answer; keys, read budgets and ETags hold on that path."""

from __future__ import annotations

import asyncio
import gc
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgpack
import pytest
from prometheus_client import REGISTRY

from router import hot
from shardlb.board import Board
from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_READER, AS_WRITER, board_name, running, service_of

pytestmark = pytest.mark.cluster

T0 = 1_790_000_000_000


class Clock:
    """The second ``router.hot`` sees, moved by hand."""

    def __init__(self) -> None:
        self.second = 2_000_000_000

    def __call__(self) -> int:
        return self.second


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fixed = Clock()
    monkeypatch.setattr(hot, "now_second", fixed)
    yield fixed


@pytest.fixture(scope="module")
async def client(cluster: LocalCluster) -> AsyncIterator[httpx.AsyncClient]:
    async with running(cluster.url, top_refresh_s=0.2) as (_, c):
        yield c


def full_reads() -> float:
    """Top reads that went through the full handler (each asks the top cache once)."""
    total = 0.0
    for outcome in ("hit", "miss"):
        labels = {"cache": "top", "result": outcome}
        total += REGISTRY.get_sample_value("shardlb_cache_requests_total", labels) or 0.0
    return total


async def new_board(client: httpx.AsyncClient, scores: list[tuple[str, int]], body: Any = None) -> str:
    name = board_name()
    r = await client.put(f"/v1/boards/{name}", json=body or {}, headers=AS_ADMIN)
    assert r.status_code == 201, r.text
    await post(client, name, scores)
    return name


async def post(client: httpx.AsyncClient, name: str, scores: list[tuple[str, int]]) -> None:
    body = {"scores": [{"player_id": p, "points": n, "match_id": "m", "achieved_at": T0} for p, n in scores]}
    r = await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
    assert r.status_code == 200, r.text


def players(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [e["player_id"] for e in r.json()["entries"]]


async def test_a_repeat_in_its_second_is_the_same_bytes_without_the_handler(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    name = await new_board(client, [("a", 10), ("b", 20)])
    first = await client.get(f"/v1/boards/{name}/top", params={"limit": 5})
    assert players(first) == ["b", "a"]
    before = full_reads()
    again = [await client.get(f"/v1/boards/{name}/top", params={"limit": 5}) for _ in range(3)]
    assert full_reads() == before
    assert {r.content for r in again} == {first.content}
    assert {r.headers["etag"] for r in again} == {first.headers["etag"]}
    assert all(r.headers["x-request-id"] and r.headers["cache-control"] == "max-age=1" for r in again)
    # One URL answers JSON or MessagePack by Accept: a cache in front must keep them apart.
    assert {first.headers.get("vary"), *(r.headers.get("vary") for r in again)} == {"accept"}
    # Another query, or another format, is another answer: it takes the handler once.
    other = await client.get(f"/v1/boards/{name}/top", params={"limit": 1})
    assert players(other) == ["b"] and full_reads() == before + 1
    packed = await client.get(
        f"/v1/boards/{name}/top", params={"limit": 5}, headers={"Accept": "application/msgpack"}
    )
    assert packed.headers["content-type"] == "application/msgpack" and full_reads() == before + 2
    # The next second resolves the query again.
    clock.second += 1
    await client.get(f"/v1/boards/{name}/top", params={"limit": 5})
    assert full_reads() == before + 3


async def test_a_refreshed_top_is_never_answered_with_the_old_bytes(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    name = await new_board(client, [("a", 10)])
    assert players(await client.get(f"/v1/boards/{name}/top")) == ["a"]
    await post(client, name, [("b", 20)])
    deadline = asyncio.get_running_loop().time() + 10
    while True:  # the same second all along: only the top cache's refresh can bring b in
        seen = players(await client.get(f"/v1/boards/{name}/top"))
        if seen == ["b", "a"]:
            break
        assert seen == ["a"] and asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_a_board_created_again_is_not_answered_from_the_old_one(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    name = await new_board(client, [("a", 10)])
    assert players(await client.get(f"/v1/boards/{name}/top")) == ["a"]
    assert (await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 204
    assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
    assert players(await client.get(f"/v1/boards/{name}/top")) == []


async def test_not_modified_on_a_repeat(client: httpx.AsyncClient, clock: Clock) -> None:
    name = await new_board(client, [("a", 10)])
    tag = (await client.get(f"/v1/boards/{name}/top")).headers["etag"]
    before = full_reads()
    same = await client.get(f"/v1/boards/{name}/top", headers={"If-None-Match": f'W/"other", {tag}'})
    assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", tag)
    assert same.headers.get("vary") == "accept"  # a 304 carries the Vary its 200 would
    changed = await client.get(f"/v1/boards/{name}/top", headers={"If-None-Match": '"other"'})
    assert changed.status_code == 200 and players(changed) == ["a"]
    assert full_reads() == before


async def test_keys_hold_on_a_repeat(cluster: LocalCluster, clock: Clock) -> None:
    async with running(cluster.url, reads_require_key=True) as (_, c):
        name = await new_board(c, [("a", 10)])
        assert players(await c.get(f"/v1/boards/{name}/top", headers=AS_READER)) == ["a"]
        before = full_reads()
        packed = {"Accept": "application/msgpack"}
        anonymous = await c.get(f"/v1/boards/{name}/top", headers={"Accept": "application/json"})
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthorized"
        wrong = await c.get(f"/v1/boards/{name}/top", headers={"Authorization": "Bearer nope", **packed})
        assert wrong.status_code == 401 and msgpack.unpackb(wrong.content)["error"]["code"] == "unauthorized"
        assert players(await c.get(f"/v1/boards/{name}/top", headers=AS_READER)) == ["a"]
        assert full_reads() == before  # refused, and answered, on the short path


async def test_read_budgets_hold_on_a_repeat(cluster: LocalCluster, clock: Clock) -> None:
    async with running(cluster.url, read_rate=0.01, read_burst=3) as (_, c):
        name = await new_board(c, [("a", 10)])
        before = full_reads()
        answered = [(await c.get(f"/v1/boards/{name}/top")).status_code for _ in range(5)]
        assert answered == [200, 200, 200, 429, 429]
        assert full_reads() == before + 1  # the first took the handler; the rest the short path
        limited = await c.get(f"/v1/boards/{name}/top")
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        assert limited.json()["error"]["code"] == "rate_limited"


async def test_repeated_headers_are_read_as_on_the_full_path(client: httpx.AsyncClient, clock: Clock) -> None:
    """The hot path kept the LAST Accept and Authorization lines where every other path takes the
    first (Starlette's ``headers.get``): the same request was JSON cold and MessagePack once another
    caller had warmed the MessagePack answer of that second."""
    name = await new_board(client, [("a", 10)])
    twice = [("accept", "application/json"), ("accept", "application/msgpack")]
    cold = await client.get(f"/v1/boards/{name}/top", headers=twice)
    assert cold.headers["content-type"].startswith("application/json")
    await client.get(f"/v1/boards/{name}/top", headers={"Accept": "application/msgpack"})
    warm = await client.get(f"/v1/boards/{name}/top", headers=twice)
    assert warm.headers["content-type"].startswith("application/json") and warm.content == cold.content


def live_boards(name: str) -> int:
    """The Boards of the board ``name`` alive in this process. Only its own: the router's journal
    watch lists every board of the registry (a Board each), and under xdist the registry holds the
    boards of every module running beside this one (CI at d22ff84: 58 made by a check that fell
    within the loop below)."""
    gc.collect()
    return sum(1 for thing in gc.get_objects() if isinstance(thing, Board) and thing.config.id == name)


async def test_remembered_answers_do_not_keep_old_boards_alive(cluster: LocalCluster, clock: Clock) -> None:
    """A remembered answer held the Board it was rendered with. The board cache makes a new Board
    every few seconds (each with its own caches of players read, up to several MB), so a caller
    asking one top with a new query string (``?limit=N``) now and then kept an old Board alive per
    answer, up to 4096 of them, outside the bound in bytes. Here every request looks the board up
    anew (as if the board cache's seconds had passed between them)."""
    async with running(cluster.url) as (app, c):
        name = await new_board(c, [("a", 10), ("b", 20)])
        service_of(app).boards.ttl_s = 0.0
        before = live_boards(name)
        for limit in range(1, 201):
            assert players(await c.get(f"/v1/boards/{name}/top", params={"limit": limit}))[0] == "b"
        assert live_boards(name) - before < 10
        # A repeat in its second is still answered from its bytes while its board is the current one.
        service_of(app).boards.ttl_s = 60.0
        await c.get(f"/v1/boards/{name}/top", params={"limit": 7})
        reads = full_reads()
        assert players(await c.get(f"/v1/boards/{name}/top", params={"limit": 7})) == ["b", "a"]
        assert full_reads() == reads


async def test_kept_views_do_not_keep_old_boards_alive(cluster: LocalCluster, clock: Clock) -> None:
    """A view of the top cache, and a histogram of the rank estimates, kept the Board it was first
    read with for as long as it was read, while the board cache made a new Board every few seconds:
    views first read at different moments each kept another (with its own caches of players read,
    up to several MB). Now a view read with the board's current Board keeps that one. Here a new
    view is first read after each renewal of the board cache, and the views read before are read
    again."""
    async with running(cluster.url) as (app, c):
        name = board_name()
        periods = {"periods": ["total", "daily", "weekly", "monthly"]}
        assert (await c.put(f"/v1/boards/{name}", json=periods, headers=AS_ADMIN)).status_code == 201
        now = {"scores": [{"player_id": "a", "points": 10, "match_id": "m"}]}  # in today's periods too
        assert (await c.post(f"/v1/boards/{name}/scores", json=now, headers=AS_WRITER)).status_code == 200
        boards = service_of(app).boards
        reads = [
            (f"/v1/boards/{name}/{path}", {"period": period, **extra})
            for period in ("total", "daily", "weekly", "monthly")
            for path, extra in (("top", {}), ("players/a", {"estimate": "true"}))
        ]
        before = live_boards(name)
        for first in range(1, len(reads) + 1):
            boards._kept.clear()  # as when the board cache's seconds have passed: a new Board
            for path, query in reads[:first]:
                assert (await c.get(path, params=query)).status_code == 200
        assert live_boards(name) - before <= 2


def test_the_bytes_bound_counts_the_queries_callers_choose(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys are raw query strings, which a caller can pad (`?&&&...&limit=1`, up to the URL limit)
    into a new key each time: the bound in bytes counted only the bodies, so 4096 padded keys of
    64 KB held about 250 MB per worker. Now a key's bytes count too."""
    kept: hot.Renderings[Any, Any] = hot.Renderings(count=4096, size=1_000_000)
    monkeypatch.setattr(hot, "_kept", kept)
    answer = hot.Rendered(0, None, None, 0, [], b"x" * 100, b'"t"')  # type: ignore[arg-type]
    for n in range(100):
        hot.remember("board", b"&" * 60_000 + str(n).encode(), False, answer)
    assert kept.held <= 1_000_000
    assert len(kept) < 20


def test_an_etag_never_names_two_bodies() -> None:
    """Two tops of one length whose bytes have one CRC-32 (these two player ids, found by a search
    of random ids): a client holding one must not get 304 for the other."""
    one, two = (
        b'{"board":"arena","entries":[{"rank":1,"player_id":"%s","points":1520}]}' % player
        for player in (b"uqY31LKK8hAU", b"Y8nbnvcDl2wA")
    )
    assert one != two and len(one) == len(two) and zlib.crc32(one) == zlib.crc32(two)
    assert hot.etag(one) != hot.etag(two)
    assert hot.etag(one) == hot.etag(bytes(one)) and hot.matches(
        f"W/{hot.etag(one).decode()}", hot.etag(one).decode()
    )
