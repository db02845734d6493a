"""One client without a key cannot take what every other client needs: a worker's few archive reads
(PostgreSQL connections) or its requests in progress, while it stays within its own read budget.
(An auth audit's findings: one address's concurrent history reads made everyone else's 503.)"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from shardlb import settlement_history
from shardlb.board import Board
from tests.router_support import AS_ADMIN, AS_READER, board_name, running

pytestmark = pytest.mark.cluster


def _from(app: Starlette, host: str) -> httpx.AsyncClient:
    """A client whose requests come from ``host`` (the ASGI scope's client address)."""
    transport = httpx.ASGITransport(app=app, client=(host, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://router.test", timeout=30)


def _slowed(original: Callable[..., Awaitable[Any]], seconds: float) -> Callable[..., Awaitable[Any]]:
    async def slow(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(seconds)
        return await original(*args, **kwargs)

    return slow


async def _flood_and_probe(app: Starlette, url: str, flood: int) -> tuple[Counter[int], list[int]]:
    """``flood`` reads of ``url`` at once from one address, then, while they run, a few from another
    address (with a read key and without): the statuses of each."""
    async with _from(app, "198.51.100.7") as greedy, _from(app, "203.0.113.9") as other:
        pending = [asyncio.ensure_future(greedy.get(url)) for _ in range(flood)]
        await asyncio.sleep(0.1)
        probes = await asyncio.gather(*(other.get(url, headers=AS_READER) for _ in range(2)), other.get(url))
        done = await asyncio.gather(*pending)
    return Counter(r.status_code for r in done), [r.status_code for r in probes]


async def test_one_client_cannot_take_every_archive_read(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settlement_history, "player_history", _slowed(settlement_history.player_history, 0.3))
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        name = board_name("fair")
        assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
        greedy, others = await _flood_and_probe(app, f"/v1/boards/{name}/players/p1/history", 40)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert others == [200, 200, 200], others  # before: 503, no room for more archive reads in time
    assert greedy[200] >= 2 and greedy[429] > 0 and set(greedy) <= {200, 429}, greedy


async def test_one_client_cannot_take_every_request_slot(
    cluster_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Board, "player", _slowed(Board.player, 0.5))
    async with running(cluster_url, max_requests=100) as (app, client):
        name = board_name("fair")
        assert (await client.put(f"/v1/boards/{name}", json={}, headers=AS_ADMIN)).status_code == 201
        greedy, others = await _flood_and_probe(app, f"/v1/boards/{name}/players/p1", 150)
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    assert others == [404, 404, 404], others  # answered (no such player): before, 503 for all
    assert greedy[404] >= 6 and greedy[429] > 0 and set(greedy) <= {404, 429}, greedy


async def test_a_periods_listing_past_the_clients_archive_reads_is_refused_before_the_shards_are_read(
    cluster_url: str, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The periods listing reads every home shard's key index, then PostgreSQL's settlements. A
    client without a key holding its archive reads (here two listings waiting in PostgreSQL) is
    refused a third with 429, before its shards are read: the key indexes read (``kept``'s calls)
    count the two listings alone. Until 2026-12-06 the third read them all, then was refused."""
    entered, release = asyncio.Event(), asyncio.Event()
    waiting = 0
    shard_reads = 0
    kept, settled_periods = settlement_history.kept, settlement_history.settled_periods

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal shard_reads
        shard_reads += 1
        return await kept(*args, **kwargs)

    async def held(*args: Any, **kwargs: Any) -> Any:
        nonlocal waiting
        waiting += 1
        if waiting == 2:
            entered.set()
        await release.wait()
        return await settled_periods(*args, **kwargs)

    monkeypatch.setattr(settlement_history, "kept", counted)
    monkeypatch.setattr(settlement_history, "settled_periods", held)
    async with running(cluster_url, postgres_url=postgres_url) as (app, client):
        name = board_name("listed")
        settings = {"periods": ["total", "daily"]}
        assert (await client.put(f"/v1/boards/{name}", json=settings, headers=AS_ADMIN)).status_code == 201
        url = f"/v1/boards/{name}/periods"
        async with _from(app, "198.51.100.8") as anonymous:
            first = [asyncio.ensure_future(anonymous.get(url)) for _ in range(2)]
            try:
                await asyncio.wait_for(entered.wait(), 10)
                assert shard_reads == 2
                r = await anonymous.get(url)
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
                assert shard_reads == 2  # before: 3, the refused listing's shards read
            finally:
                release.set()
                answered = await asyncio.gather(*first)
            assert [r.status_code for r in answered] == [200, 200]
            assert (await anonymous.get(url)).status_code == 200  # its places given back
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
