"""router/limiter.py: token buckets per client, keyed and anonymous rates, and the client address
behind trusted proxies, alone and through the app."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgpack
import pytest

from router.auth import Keys, Scope
from router.limiter import SCRAPE_READS, RateLimiter, ReadLimits, client_address
from router.settings import Network, Settings
from shardlb.cluster import LocalCluster
from tests.router_support import (
    AS_ADMIN,
    AS_READER,
    AS_WRITER,
    WRITE,
    board_name,
    calls_made,
    running,
    service_of,
)
from tests.test_router_server import Server


def test_token_bucket_refills_and_forgets_old_clients() -> None:
    limiter = RateLimiter(rate=2.0, burst=3, max_clients=100)
    assert [limiter.take("c", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("c", now=0.0) == pytest.approx(0.5)
    assert limiter.take("other", now=0.0) == 0.0  # a bucket per client
    assert limiter.take("c", now=0.5) == 0.0  # one token back after 1 / rate seconds
    assert limiter.take("c", now=0.5) > 0
    for i in range(1000):
        limiter.take(f"client-{i}", now=1.0)
    assert len(limiter) == 100
    assert RateLimiter(0.0, 0).take("anyone") == 0.0


def test_keyed_and_anonymous_clients_have_their_own_rates() -> None:
    keys = Keys(Settings(write_keys=(WRITE,)))
    anonymous = keys.require(None, "10.0.0.1", Scope.READ).client
    keyed = keys.require(f"Bearer {WRITE}", "10.0.0.1", Scope.READ).client
    limits = ReadLimits.of(Settings(write_keys=(WRITE,), read_rate=1.0, read_burst=2))
    assert [limits.take(anonymous) > 0 for _ in range(3)] == [False, False, True]
    assert not any(limits.take(keyed) > 0 for _ in range(100))  # keys: off unless set
    limits = ReadLimits.of(Settings(write_keys=(WRITE,), read_rate=0.0, key_read_rate=2.0))
    assert [limits.take(keyed) > 0 for _ in range(3)] == [False, False, True]
    assert not any(limits.take(anonymous) > 0 for _ in range(100))


@pytest.mark.cluster
async def test_read_rate_limit_per_client(cluster: LocalCluster) -> None:
    async with running(cluster.url, read_rate=0.5, read_burst=3) as (_, client):
        board = board_name()
        await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)
        url = f"/v1/boards/{board}/top"
        assert [(await client.get(url)).status_code for _ in range(3)] == [200, 200, 200]
        limited = await client.get(url)
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limited"
        assert int(limited.headers["retry-after"]) >= 1
        other = await client.post(f"/v1/boards/{board}/players:query", json={"player_ids": []})
        assert other.status_code == 429  # every read counts against the same bucket
        # A key is its own client, apart from the anonymous bucket of this address.
        assert (await client.get(url, headers=AS_READER)).status_code == 200
        # Writes and service endpoints are not reads.
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        assert (
            await client.post(f"/v1/boards/{board}/scores", json=body, headers=AS_WRITER)
        ).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_a_query_body_takes_tokens_by_its_bytes_before_it_is_decoded(cluster: LocalCluster) -> None:
    """A players:query body of 90 KB that decodes to 90,000 empty maps (a float32 beside them sends
    MessagePack through the key-by-key decoding that finds a repeated key) cost a worker 19 ms of
    CPU and its client one token, refused 422 after the decoding: 190 cached tops a token, 5.7 of
    a worker's cores within one address's read budget. The body's bytes are paid for first, a
    token per 8 KiB, as its ids are (per 100, after the decoding): 1000 ids of 64 characters take
    68 KB, so a valid query pays what it paid."""
    junk = msgpack.packb(
        {"player_ids": [[{} for _ in range(1000)] for _ in range(90)], "f": 1.5}, use_single_float=True
    )
    assert len(junk) // (8 * 1024) == 11
    headers = {"Content-Type": "application/msgpack"}
    async with running(cluster.url, read_rate=0.01, read_burst=20) as (_, client):
        board = board_name()
        await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)
        path = f"/v1/boards/{board}/players:query"
        first = await client.post(path, content=junk, headers=headers)
        assert first.status_code == 422  # 11 tokens and the read's own: 8 left
        second = await client.post(path, content=junk, headers=headers)
        assert (second.status_code, second.json()["error"]["code"]) == (429, "rate_limited")
        ids = {"player_ids": [f"{i:064d}" for i in range(99)]}  # 6.6 KB: the read's token alone
        assert [(await client.post(path, json=ids)).status_code for _ in range(8)] == [200] * 7 + [429]
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


def proxies(raw: str) -> tuple[Network, ...]:
    return Settings.from_env({"SHARDLB_ADMIN_KEYS": "a", "SHARDLB_TRUSTED_PROXIES": raw}).trusted_proxies


def test_forwarded_address_is_taken_only_from_trusted_proxies() -> None:
    trusted = proxies("10.0.0.0/8, 192.168.1.7")
    # An untrusted peer: its header is ignored, whatever it says.
    assert client_address("203.0.113.9", "1.2.3.4", trusted) == "203.0.113.9"
    # A trusted peer: the right-most address that is not a trusted proxy is the client.
    assert client_address("10.1.1.1", "1.2.3.4", trusted) == "1.2.3.4"
    assert client_address("10.1.1.1", "6.6.6.6, 1.2.3.4, 192.168.1.7", trusted) == "1.2.3.4"
    assert client_address("10.1.1.1", "6.6.6.6,1.2.3.4,10.9.9.9", trusted) == "1.2.3.4"
    # Nothing usable: the peer itself.
    assert client_address("10.1.1.1", None, trusted) == "10.1.1.1"
    assert client_address("10.1.1.1", "", trusted) == "10.1.1.1"
    assert client_address("10.1.1.1", "not-an-address", trusted) == "10.1.1.1"
    # Every hop trusted: the left-most is as far as the chain goes.
    assert client_address("10.1.1.1", "10.2.2.2, 10.3.3.3", trusted) == "10.2.2.2"
    assert client_address("2001:db8::1", "1.2.3.4", proxies("2001:db8::/32")) == "1.2.3.4"
    assert client_address("10.1.1.1", "1.2.3.4", ()) == "10.1.1.1"


def test_a_long_forwarded_header_is_read_from_the_right_a_few_hops_deep() -> None:
    """Behind a trusted proxy a client's own X-Forwarded-For reaches the router with the proxy's hop
    appended: 64 KiB of it held 8,000 hops, each split off and stripped before the right-most was
    looked at (0.8 ms of a worker's CPU a request). The client is among the right-most hops."""
    trusted = proxies("10.0.0.0/8")
    for sent in ("1.1.1.1, " * 8000 + "2.2.2.2", "1.1.1.1, " * 8000 + "2.2.2.2, " + "10.0.0.1, " * 3):
        assert client_address("10.9.9.9", sent, trusted) == "2.2.2.2"
        ordinary = calls_made(lambda: client_address("10.9.9.9", "1.1.1.1, 2.2.2.2", trusted))
        assert calls_made(lambda: client_address("10.9.9.9", sent, trusted)) < ordinary + 400  # noqa: B023
    # Every hop read trusted: the left-most of them, as far as the chain goes.
    assert client_address("10.9.9.9", "1.1.1.1, " + "10.0.0.1, " * 40 + "10.0.0.2", trusted) == "10.0.0.1"


def test_an_ipv6_client_is_one_bucket_per_64_and_mapped_ipv4_is_ipv4() -> None:
    """One IPv6 subscriber holds a /64 (2^64 addresses): a bucket per address gave it a fresh budget
    on every request. An IPv4 address written as IPv6 (a dual-stack listener's ::ffff:a.b.c.d) is
    that IPv4 address, for the buckets and for the trusted proxies alike."""
    keys = Keys(Settings(write_keys=(WRITE,)))

    def bucket(peer: str) -> str:
        return keys.require(None, peer, Scope.READ).client

    assert bucket("2001:db8:1:2::1") == bucket("2001:db8:1:2:ffff::9") == bucket("2001:DB8:1:2:0::1")
    assert bucket("2001:db8:1:2::1") != bucket("2001:db8:1:3::1")
    assert bucket("::ffff:198.51.100.7") == bucket("198.51.100.7") != bucket("198.51.100.8")
    assert bucket("not an address") == "ip:not an address"
    limits = ReadLimits.of(Settings(write_keys=(WRITE,), read_rate=1.0, read_burst=2))
    refused = [limits.take(bucket(f"2001:db8:1:2::{i:x}")) > 0 for i in range(1, 11)]
    assert refused == [False, False] + [True] * 8
    trusted = proxies("10.0.0.0/8")
    assert client_address("::ffff:10.1.1.1", "1.2.3.4", trusted) == "1.2.3.4"


def test_read_rate_limit_is_on_by_default() -> None:
    settings = Settings.from_env({"SHARDLB_ADMIN_KEYS": "a"})
    assert settings.read_rate > 0 and settings.burst >= settings.read_rate
    assert settings.trusted_proxies == ()


@pytest.mark.cluster
async def test_anonymous_reads_are_limited_by_default_and_keys_are_not(cluster: LocalCluster) -> None:
    async with running(cluster.url) as (app, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        burst = service_of(app).settings.burst
        url = f"/v1/boards/{name}/top"
        # Many at once (below the concurrency limit), so that the bucket refills little meanwhile.
        statuses = []
        for _ in range(6):
            statuses += [
                r.status_code for r in await asyncio.gather(*(client.get(url) for _ in range(burst // 2)))
            ]
        assert statuses.count(200) >= burst and 429 in statuses
        keyed = []
        for _ in range(3):
            keyed += await asyncio.gather(*(client.get(url, headers=AS_READER) for _ in range(burst // 2)))
        assert {r.status_code for r in keyed} == {200}
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_forwarded_ipv6_addresses_of_one_64_share_a_bucket(cluster: LocalCluster) -> None:
    async with running(cluster.url, read_rate=1.0, read_burst=2, trusted_proxies=proxies("127.0.0.0/8")) as (
        _,
        client,
    ):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        url = f"/v1/boards/{name}/top"
        statuses = [
            (await client.get(url, headers={"X-Forwarded-For": f"2001:db8:1:2:{i:x}::1"})).status_code
            for i in range(8)
        ]
        # a bucket of 2 refilled at 1/s: a slow machine may see one token come back
        assert statuses[:2] == [200, 200] and statuses.count(429) >= 5, statuses
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_forwarded_for_keys_clients_only_behind_a_trusted_proxy(cluster: LocalCluster) -> None:
    """The test client's peer is 127.0.0.1. Trusted, each X-Forwarded-For is its own client; not
    trusted, the header changes nothing and every request shares the peer's bucket."""
    for trusted, separate in (("127.0.0.0/8", True), ("", False)):
        trusted_proxies = proxies(trusted)
        async with running(cluster.url, read_rate=1.0, read_burst=2, trusted_proxies=trusted_proxies) as (
            _,
            client,
        ):
            name = board_name()
            assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
            url = f"/v1/boards/{name}/top"
            statuses = [
                (await client.get(url, headers={"X-Forwarded-For": f"198.51.100.{i}"})).status_code
                for i in range(6)
            ]
            if separate:
                assert statuses == [200] * 6
            else:  # a bucket of 2 refilled at 1/s: a slow machine may see one token come back
                assert statuses[:2] == [200, 200] and statuses.count(429) >= 3, statuses
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.cluster
def test_server_does_not_trust_forwarded_for_by_default(cluster: LocalCluster, tmp_path: Path) -> None:
    """uvicorn itself must not rewrite the peer from X-Forwarded-For (its default trusts 127.0.0.1):
    a client rotating the header would get a fresh bucket each time."""
    server = Server(cluster.url, tmp_path / "router.log", SHARDLB_READ_RATE="1", SHARDLB_READ_BURST="2")
    try:
        name = board_name()
        assert httpx.put(f"{server.url}/v1/boards/{name}", headers=AS_ADMIN).status_code == 201
        with httpx.Client(base_url=server.url) as client:
            statuses = [
                client.get(
                    f"/v1/boards/{name}/top", headers={"X-Forwarded-For": f"198.51.100.{i}"}
                ).status_code
                for i in range(6)
            ]
        assert statuses.count(429) >= 3, statuses
        httpx.delete(f"{server.url}/v1/boards/{name}", headers=AS_ADMIN)
    finally:
        assert server.stop() == 0


@pytest.mark.cluster
async def test_a_query_of_many_players_costs_as_many_tokens_as_it_does_reads(cluster: LocalCluster) -> None:
    """A players:query of 1000 ids took one token, as a cached top does, while it costs the cluster
    about a rank per id: one address could spend every other caller's read capacity at the price of
    a light read. Now it takes a token per 100 ids more (at most the burst)."""
    async with running(cluster.url, read_rate=0.5, read_burst=20) as (_, client):
        board = board_name()
        await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)
        url = f"/v1/boards/{board}/players:query"
        many = {"player_ids": [f"p{i}" for i in range(1000)]}
        assert (await client.post(url, json=many)).status_code == 200  # 11 of the 20 tokens
        limited = await client.post(url, json=many)
        assert (limited.status_code, limited.json()["error"]["code"]) == (429, "rate_limited")
        few = {"player_ids": ["p1", "p2"]}
        assert (await client.post(url, json=few)).status_code == 200  # a small one still fits
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


def test_a_cost_larger_than_the_burst_waits_for_a_full_bucket() -> None:
    limiter = RateLimiter(rate=1.0, burst=5)
    assert limiter.take("c", now=0.0, cost=50) == 0.0  # capped at the burst: never out of reach
    assert limiter.take("c", now=0.0) == pytest.approx(1.0)


@pytest.mark.cluster
async def test_a_big_query_fits_a_small_bucket(cluster: LocalCluster) -> None:
    """A query took its first token, then its extra ones capped at the whole burst: with a burst
    smaller than 1 + the extra, it could never pass, and each retry spent a token. The extra is now
    capped at the burst less the first token."""
    async with running(cluster.url, read_rate=0.2, read_burst=5) as (_, client):
        board = board_name()
        await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)
        many = {"player_ids": [f"p{i}" for i in range(1000)]}
        r = await client.post(f"/v1/boards/{board}/players:query", json=many)
        assert r.status_code == 200, r.text
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_a_metrics_scrape_costs_its_address_reads(cluster: LocalCluster) -> None:
    """/metrics takes no key and nothing limited it: a scrape cost a worker 3.7 ms of CPU, as much
    as 23 cached tops (160 us), so one address scraping 300 times a second took a whole core, where
    its read budget holds its reads to a few percent. A scrape now takes limiter.SCRAPE_READS of its
    address's read tokens; another address, and the probes, are not concerned."""
    async with running(
        cluster.url, read_rate=0.5, read_burst=2 * SCRAPE_READS, trusted_proxies=proxies("127.0.0.0/8")
    ) as (_, client):
        statuses = [(await client.get("/metrics")).status_code for _ in range(2)]
        limited = await client.get("/metrics")
        assert statuses == [200, 200] and limited.status_code == 429, limited.text
        assert limited.json()["error"]["code"] == "rate_limited"
        assert int(limited.headers["retry-after"]) >= 1
        assert (await client.get("/v1/boards")).status_code == 429  # the same budget as its reads
        elsewhere = {"X-Forwarded-For": "10.1.2.3"}
        assert (await client.get("/metrics", headers=elsewhere)).status_code == 200
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
