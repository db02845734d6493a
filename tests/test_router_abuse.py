"""Anonymous abuse: hostile bodies, too many requests at once, floods of unknown boards, one client
posing as many. Each bound is checked where it acts: the router's memory as a process, the 503 of the
concurrency limit, the registry gate that writes keep, and the rate limiter's buckets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest

from router import media
from router.errors import ApiError
from router.limiter import client_address
from router.settings import Network, Settings
from shardlb.cluster import LocalCluster
from shardlb.config import BoardConfig
from shardlb.store import BoardStore
from tests.router_support import AS_ADMIN, AS_READER, AS_WRITER, board_name, running, service_of
from tests.test_router_server import Server

MIB = 1024 * 1024
MSGPACK = {"Content-Type": "application/msgpack"}


def proxies(raw: str) -> tuple[Network, ...]:
    return Settings.from_env({"SHARDLB_ADMIN_KEYS": "a", "SHARDLB_TRUSTED_PROXIES": raw}).trusted_proxies


def _rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` and its children (uvicorn's workers), in KiB."""
    total = 0
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            with open(f"/proc/{current}/task/{current}/children") as children:
                pids += [int(p) for p in children.read().split()]
        except FileNotFoundError:
            continue
    return total


def _empty_maps(size: int) -> bytes:
    """A MessagePack array of about ``size`` bytes, every item an empty map (one byte each)."""
    count = size - 5
    return b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count


def _nested_period(size: int) -> bytes:
    """A query body that is a valid shape but for ``period``: arrays of a thousand empty maps."""
    rows = max(1, (size - 40) // 1003)
    return bytes(msgpack.packb({"player_ids": [], "period": [[{}] * 1000] * rows}))


# ---- bodies --------------------------------------------------------------------------------------


@pytest.mark.cluster
async def test_hostile_query_bodies_do_not_grow_the_router(cluster: LocalCluster, tmp_path: Path) -> None:
    """A 2-worker router, public players:query bodies sent 24 at a time: 1 MiB of MessagePack empty
    maps (about 70 MiB once decoded), and bodies under the read cap whose ``period`` holds thousands
    of empty maps, aimed at unknown boards so the request would wait for the registry holding them.
    The router's resident memory must not grow by more than a few tens of MiB."""
    server = await asyncio.to_thread(Server, cluster.url, tmp_path / "router.log", 2, SHARDLB_READ_RATE="0")
    try:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            name = board_name()
            assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201

            async def send(board: str, body: bytes) -> int:
                r = await client.post(f"/v1/boards/{board}/players:query", content=body, headers=MSGPACK)
                return r.status_code

            warm = bytes(msgpack.packb({"player_ids": ["a"] * 100}))
            for _ in range(3):  # both workers have served queries, their caches and imports are made
                assert set(await asyncio.gather(*(send(name, warm) for _ in range(24)))) == {200}
            before = _rss_kib(server.proc.pid)
            big = _empty_maps(MIB - 64)
            small = _nested_period(90 * 1024)
            for round_ in range(3):
                statuses = await asyncio.gather(
                    *(send(name, big) for _ in range(12)),
                    *(send(f"rand{round_}-{i}", small) for i in range(12)),
                )
                assert all(400 <= s < 500 for s in statuses), statuses
            await asyncio.sleep(0.5)
            grown = (_rss_kib(server.proc.pid) - before) / 1024
            assert grown < 40, f"the router grew by {grown:.0f} MiB"
            await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)
    finally:
        assert await asyncio.to_thread(server.stop) == 0


@pytest.mark.cluster
async def test_read_bodies_have_their_own_small_cap(cluster: LocalCluster) -> None:
    async with running(cluster.url) as (app, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        query = f"/v1/boards/{name}/players:query"
        cap = service_of(app).settings.max_read_body_bytes
        # The largest valid query, pretty-printed, fits under the cap in either format.
        ids = [f"{i:064d}" for i in range(1000)]
        pretty = orjson.dumps({"player_ids": ids, "period": "total"}, option=orjson.OPT_INDENT_2)
        assert len(pretty) <= cap
        r = await client.post(query, content=pretty, headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["entries"] == []
        packed = bytes(msgpack.packb({"player_ids": ids}))
        assert (await client.post(query, content=packed, headers=MSGPACK)).status_code == 200
        # Past the cap: 413 before anything is decoded, declared or streamed.
        over = orjson.dumps({"player_ids": [], "period": "x" * cap})
        r = await client.post(query, content=over, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(over), 8192):
                yield over[i : i + 8192]

        streamed = await client.post(query, content=chunks(), headers={"Content-Type": "application/json"})
        assert streamed.status_code == 413
        # Score writes keep the large cap: a body far past the read cap is taken.
        scores = [{"player_id": f"{i:064d}", "points": i, "match_id": "m" * 128} for i in range(1000)]
        body = orjson.dumps({"scores": scores})
        assert len(body) > 2 * cap
        r = await client.post(f"/v1/boards/{name}/scores", content=body, headers=AS_WRITER)
        assert r.status_code == 200
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ([0] * 1025, "max_array_len"),
        ({str(i): 0 for i in range(33)}, "max_map_len"),
        ("x" * 4097, "max_str_len"),
        (b"x" * 4097, "max_bin_len"),
        (msgpack.ExtType(5, b"x" * 17), "max_ext_len"),
    ],
)
def test_msgpack_containers_are_bounded(value: Any, limit: str) -> None:
    body = bytes(msgpack.packb({"player_ids": value}, use_bin_type=True))
    with pytest.raises(ApiError) as e:
        media.decode(body, "application/msgpack")
    assert (e.value.status, e.value.code) == (400, "malformed_body")
    assert limit in e.value.message


def test_msgpack_bounds_admit_every_valid_body() -> None:
    """The largest lists and maps a valid request holds: 1000 scores of five fields, 1024 regions."""
    score = {"player_id": "p" * 64, "points": 1, "match_id": "m" * 128, "achieved_at": 0, "region": "r"}
    assert (
        len(media.decode(msgpack.packb({"scores": [score] * 1000}), "application/msgpack")["scores"]) == 1000
    )
    regions = {"sharding": {"strategy": "region", "regions": [f"r{i}" for i in range(1024)]}}
    assert media.decode(msgpack.packb(regions), "application/msgpack") == regions


# ---- concurrency -----------------------------------------------------------------------------------


@pytest.mark.cluster
async def test_requests_past_the_concurrency_limit_get_503(cluster: LocalCluster) -> None:
    async with running(cluster.url, max_requests=2) as (_, client):
        name = board_name()
        assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
        release = asyncio.Event()
        started = asyncio.Semaphore(0)

        async def slow_body() -> AsyncIterator[bytes]:
            started.release()
            await release.wait()
            yield b'{"player_ids": []}'

        held = [
            asyncio.create_task(client.post(f"/v1/boards/{name}/players:query", content=slow_body()))
            for _ in range(2)
        ]
        for _ in held:
            await asyncio.wait_for(started.acquire(), 10)
        refused = await client.get(f"/v1/boards/{name}/top")
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 1
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        write = await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        assert write.status_code == 503  # writes count too: the bound is on the whole worker
        assert (await client.get("/healthz")).status_code == 200  # probes are never refused
        assert (await client.get("/readyz")).status_code == 200
        release.set()
        assert [(await task).status_code for task in held] == [200, 200]
        assert (await client.get(f"/v1/boards/{name}/top")).status_code == 200
        await client.delete(f"/v1/boards/{name}", headers=AS_ADMIN)


# ---- board lookups ---------------------------------------------------------------------------------


@pytest.mark.cluster
async def test_unknown_boards_are_remembered_as_missing(cluster: LocalCluster, store: BoardStore) -> None:
    async with running(cluster.url) as (app, client):
        boards = service_of(app).boards
        fetched: list[str] = []
        real_get = boards.store.get

        async def counting_get(board_id: str) -> Any:
            fetched.append(board_id)
            return await real_get(board_id)

        boards.store.get = counting_get  # type: ignore[method-assign]
        name = board_name()
        for _ in range(5):
            r = await client.get(f"/v1/boards/{name}/top")
            assert r.status_code == 404 and r.json()["error"]["code"] == "board_not_found"
        assert fetched == [name]  # one registry read, then the answer is remembered
        # A board made elsewhere is not hidden from writes by a read's negative answer.
        await store.create(BoardConfig.from_dict(name, {}))
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        assert (
            await client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        ).status_code == 200
        assert (await client.get(f"/v1/boards/{name}/top")).status_code == 200
        # A board created through this router is visible at once, to reads as well.
        other = board_name()
        assert (await client.get(f"/v1/boards/{other}/top")).status_code == 404
        assert (await client.put(f"/v1/boards/{other}", headers=AS_ADMIN)).status_code == 201
        assert (await client.get(f"/v1/boards/{other}/top")).status_code == 200
        # The memory of missing boards is bounded.
        boards.max_missing = 20
        for i in range(30):
            assert (await client.get(f"/v1/boards/nope{i}-{name}/top")).status_code == 404
        assert len(boards.missing) == 20 and f"nope29-{name}" in boards.missing
        for board in (name, other):
            await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_a_flood_of_unknown_boards_does_not_starve_writes(
    cluster: LocalCluster, store: BoardStore
) -> None:
    """Hundreds of anonymous reads of boards that do not exist, all at once, then a write to a board
    this router has not seen yet: the write's lookup is not queued behind the flood."""
    async with running(cluster.url, read_rate=0.0, read_queue=20) as (_, client):
        name = board_name()
        await store.create(BoardConfig.from_dict(name, {}))
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        flood = [client.get(f"/v1/boards/rand{i}-{name}/top") for i in range(300)]
        *reads, write = await asyncio.gather(
            *flood, client.post(f"/v1/boards/{name}/scores", json=body, headers=AS_WRITER)
        )
        assert {r.status_code for r in reads} <= {404, 503}
        assert write.status_code == 200, write.text
        await store.delete(name)


# ---- rate limit ------------------------------------------------------------------------------------


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
