"""router/auth.py: keys and scopes, reads that require a key, the insecure dev mode (the read rate
limit is in test_router_limiter.py)."""

from __future__ import annotations

import ipaddress
import tracemalloc

import httpx
import pytest

from router.auth import Keys, Scope
from router.settings import Settings
from shardlb.cluster import LocalCluster
from tests.router_support import ADMIN, AS_ADMIN, AS_WRITER, READ, WRITE, board_name, running

KEYS = {"none": None, "read": READ, "write": WRITE, "admin": ADMIN, "wrong": "not-a-configured-key"}


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def test_scope_of_each_key_and_the_highest_wins() -> None:
    keys = Keys(Settings(admin_keys=("a-key", "both"), write_keys=("w-key", "both"), read_keys=("r-key",)))
    assert keys.scope_of("a-key") is Scope.ADMIN
    assert keys.scope_of("w-key") is Scope.WRITE
    assert keys.scope_of("r-key") is Scope.READ
    assert keys.scope_of("both") is Scope.ADMIN
    assert keys.scope_of("a-ke") is None and keys.scope_of("") is None and keys.scope_of("a-key ") is None
    # Whom the access middleware lets hold a slot while a body arrives: write and admin keys only.
    assert [keys.may_write(h) for h in ("Bearer a-key", "bearer w-key", "Bearer  both ")] == [True] * 3
    assert not any(keys.may_write(h) for h in ("Bearer r-key", "Bearer nope", "Basic w-key", "w-key", ""))


def test_headers_presented_keep_no_memory_in_proportion_to_their_size() -> None:
    """The access middleware asks ``may_write`` of every request with a body and an Authorization
    header, before any key is checked, and the answer is kept per header. Kept whole, 4096 headers
    (anybody's: nothing is checked yet) of up to SHARDLB_MAX_HEADER_BYTES each stayed in every
    worker, about 256 MiB at the default 64 KiB (64 GiB at the 16 MiB allowed): what an anonymous
    caller can make a worker hold must not grow with the size of what it sends."""
    keys = Keys(Settings(write_keys=(WRITE,)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1024):
            header = f"Bearer {i:08d}" + "x" * 32 * 1024
            assert not keys.may_write(header)
        del header
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 4 * 1024 * 1024, f"{held / 2**20:.0f} MiB kept for 1024 headers of 32 KiB"
    assert keys.may_write(f"Bearer {WRITE}")  # the keys' own headers are still answered


def test_keys_are_not_in_the_settings_repr() -> None:
    """A repr of the settings (a log line, a traceback's locals, an assertion's message) showed every
    key in clear, though the webhook secret beside them was already left out of it."""
    settings = Settings(admin_keys=(ADMIN,), write_keys=(WRITE,), read_keys=(READ,))
    shown = repr(settings)
    assert "admin_keys" not in shown and all(key not in shown for key in (ADMIN, WRITE, READ))
    assert settings.admin_keys == (ADMIN,)
    # Nor the passwords a Redis or PostgreSQL URL may carry (logs show them redacted)
    urls = Settings(redis_url="redis://:redis-pw@127.0.0.1:7000", postgres_url="postgresql://u:pg-pw@db/lb")
    assert "redis-pw" not in repr(urls) and "pg-pw" not in repr(urls)


@pytest.mark.cluster
async def test_scopes(cluster: LocalCluster) -> None:
    async with running(cluster.url) as (_, client):
        board = board_name()
        assert (await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)).status_code == 201

        async def as_admin_op(key: str | None) -> httpx.Response:
            return await client.put(f"/v1/boards/{board}", headers=auth(key))

        async def as_write_op(key: str | None) -> httpx.Response:
            body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
            return await client.post(f"/v1/boards/{board}/scores", json=body, headers=auth(key))

        async def as_read_op(key: str | None) -> httpx.Response:
            return await client.get(f"/v1/boards/{board}/top", headers=auth(key))

        expected = {
            "admin": {"none": 401, "read": 403, "write": 403, "admin": 200, "wrong": 401},
            "write": {"none": 401, "read": 403, "write": 200, "admin": 200, "wrong": 401},
            "read": {"none": 200, "read": 200, "write": 200, "admin": 200, "wrong": 401},
        }
        ops = {"admin": as_admin_op, "write": as_write_op, "read": as_read_op}
        seen = {op: {who: (await ops[op](key)).status_code for who, key in KEYS.items()} for op in ops}
        assert seen == expected

        denied = await as_write_op(None)
        assert denied.headers["www-authenticate"].startswith("Bearer")
        assert denied.json()["error"]["code"] == "unauthorized"
        assert (await as_admin_op(WRITE)).json()["error"]["code"] == "forbidden"
        for header in (f"Basic {ADMIN}", "Bearer", "Bearer  ", ADMIN):
            r = await client.delete(f"/v1/boards/{board}", headers={"Authorization": header})
            assert r.status_code == 401, header
        assert (await client.delete(f"/v1/boards/{board}", headers=AS_WRITER)).status_code == 403
        assert (
            await client.delete(f"/v1/boards/{board}", headers={"Authorization": f"bearer {ADMIN}"})
        ).status_code == 204


@pytest.mark.cluster
async def test_reads_can_require_a_key(cluster: LocalCluster) -> None:
    async with running(cluster.url, reads_require_key=True) as (_, client):
        board = board_name()
        await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)
        assert (await client.get(f"/v1/boards/{board}/top")).status_code == 401
        assert (await client.get("/v1/boards")).status_code == 401
        r = await client.post(f"/v1/boards/{board}/players:query", json={"player_ids": []})
        assert r.status_code == 401
        for key in (READ, WRITE, ADMIN):
            assert (await client.get(f"/v1/boards/{board}/top", headers=auth(key))).status_code == 200
        # Service endpoints stay open: probes and scrapers carry no key.
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await client.get(path)).status_code == 200
        await client.delete(f"/v1/boards/{board}", headers=AS_ADMIN)


@pytest.mark.cluster
async def test_insecure_dev_mode_opens_everything(cluster: LocalCluster) -> None:
    async with running(cluster.url, admin_keys=(), write_keys=(), read_keys=(), insecure_dev=True) as (
        _,
        client,
    ):
        board = board_name()
        assert (await client.put(f"/v1/boards/{board}")).status_code == 201
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}
        assert (await client.post(f"/v1/boards/{board}/scores", json=body)).status_code == 200
        assert (await client.delete(f"/v1/boards/{board}")).status_code == 204


@pytest.mark.cluster
async def test_insecure_dev_mode_takes_nothing_a_browser_sends_from_another_site(
    cluster: LocalCluster,
) -> None:
    """Without keys every request is admin, and a POST a web page makes with fetch(..., {mode:
    "no-cors"}) and a body without a type needs no preflight: any site a developer visited could
    post scores to the router on their laptop, archive a board, ban a player. Such a request (its
    Origin another site's, or Sec-Fetch-Site cross-site or same-site) is 403 and does nothing; one
    from the dashboard's own page (same origin), curl and clients (no Origin) do as before."""
    async with running(cluster.url, admin_keys=(), write_keys=(), read_keys=(), insecure_dev=True) as (
        _,
        client,
    ):
        board = board_name()
        assert (await client.put(f"/v1/boards/{board}")).status_code == 201
        body = b'{"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}'
        for browser in (
            {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"},
            {"Origin": "https://evil.example"},
            {"Origin": "null"},
            {"Origin": "http://localhost:3000", "Sec-Fetch-Site": "same-site"},
            {"Sec-Fetch-Site": "cross-site"},
        ):
            r = await client.post(f"/v1/boards/{board}/scores", content=body, headers=browser)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (browser, r.text)
            r = await client.post(f"/v1/boards/{board}:archive", content=b"{}", headers=browser)
            assert r.status_code == 403, (browser, r.text)
        assert (await client.get(f"/v1/boards/{board}/players/p")).status_code == 404  # nothing written
        own = {"Origin": "http://router.test", "Sec-Fetch-Site": "same-origin"}
        assert (await client.post(f"/v1/boards/{board}/scores", content=body, headers=own)).status_code == 200
        assert (await client.post(f"/v1/boards/{board}/scores", content=body)).status_code == 200
        assert (await client.delete(f"/v1/boards/{board}")).status_code == 204


def test_a_call_without_a_key_names_the_scope_it_needs() -> None:
    """The 401 of a call made without a key says which key to send, in a sentence a person reads
    (until 2026-12-06 an admin call's said "needs a admin key")."""
    from router.errors import ApiError

    keys = Keys(Settings(admin_keys=(ADMIN,), write_keys=(WRITE,)))
    messages = {}
    for need in (Scope.WRITE, Scope.ADMIN):
        with pytest.raises(ApiError) as e:
            keys.require(None, "10.0.0.1", need)
        assert (e.value.status, e.value.code) == (401, "unauthorized")
        messages[need] = e.value.message
    assert messages[Scope.WRITE].startswith("this call needs a write key:")
    assert messages[Scope.ADMIN].startswith("this call needs an admin key:")


def test_wrong_keys_from_one_client_are_throttled() -> None:
    """Each wrong key costs its client (address; IPv6 /64) a token of a small bucket: past
    AUTH_FAILURE_BURST of them every keyed request from there is 429 until tokens come back (one a
    second), so keys cannot be guessed at the router's speed (an auth audit's finding: 500 wrong
    keys in a row, none limited). Other clients, and clients that send right keys, are not touched."""
    from router.auth import AUTH_FAILURE_BURST
    from router.errors import ApiError

    keys = Keys(Settings(write_keys=(WRITE,), read_keys=(READ,)))

    def status(header: str | None, peer: str) -> int:
        try:
            keys.require(header, peer, Scope.READ)
        except ApiError as e:
            return e.status
        return 200

    assert [status(f"Bearer {READ}", "10.0.0.1") for _ in range(100)] == [200] * 100
    wrong = [status(f"Bearer guess-{i}", "10.0.0.1") for i in range(AUTH_FAILURE_BURST + 5)]
    assert wrong[:AUTH_FAILURE_BURST] == [401] * AUTH_FAILURE_BURST
    assert set(wrong[AUTH_FAILURE_BURST:]) == {429}
    assert status(f"Bearer {READ}", "10.0.0.1") == 429  # a guesser cannot tell a right key either
    assert status("Basic abc", "10.0.0.1") == 429
    assert status(f"Bearer {READ}", "10.0.0.2") == 200
    assert status(None, "10.0.0.1") == 200  # no key: the read budget's business, not this
    same_64 = [status(f"Bearer guess-{i}", f"2001:db8::{i:x}") for i in range(AUTH_FAILURE_BURST + 1)]
    assert same_64[-1] == 429


def test_the_wrong_key_table_is_bounded_whatever_the_number_of_addresses() -> None:
    """A botnet presenting wrong keys from many addresses (or one IPv6 block of many /64s) adds a
    bucket per address: at most SHARDLB_RATE_CLIENTS are kept, the least recently seen forgotten
    first (which only gives that address a full bucket again)."""
    from router.errors import ApiError

    keys = Keys(Settings(write_keys=(WRITE,), read_keys=(READ,), rate_clients=500))
    for i in range(5000):
        with pytest.raises(ApiError):
            keys.require("Bearer guess", f"2001:db8:{i:x}::1", Scope.READ)
    assert len(keys.failures) == 500


async def test_a_guesser_behind_a_trusted_proxy_leaves_its_neighbours_alone(cluster: LocalCluster) -> None:
    """Behind a trusted proxy the client is the X-Forwarded-For address, on every path that checks a
    key (the score write's short way in included): one client's wrong keys throttle that client, not
    every client of the proxy."""
    from router.auth import AUTH_FAILURE_BURST

    async with running(cluster.url, trusted_proxies=(ipaddress.ip_network("127.0.0.1/32"),)) as (_, client):
        board = board_name("guess")
        assert (await client.put(f"/v1/boards/{board}", headers=AS_ADMIN)).status_code == 201
        body = {"scores": [{"player_id": "p", "points": 1, "match_id": "m"}]}

        async def post(headers: dict[str, str]) -> int:
            return (await client.post(f"/v1/boards/{board}/scores", json=body, headers=headers)).status_code

        guesser = {"X-Forwarded-For": "203.0.113.7", "Authorization": "Bearer guess"}
        assert [await post(guesser) for _ in range(AUTH_FAILURE_BURST)] == [401] * AUTH_FAILURE_BURST
        assert await post(guesser) == 429
        assert await post({**AS_WRITER, "X-Forwarded-For": "203.0.113.7"}) == 429
        assert await post({**AS_WRITER, "X-Forwarded-For": "203.0.113.8"}) == 200
        admin = {**AS_ADMIN, "X-Forwarded-For": "203.0.113.8"}
        assert (await client.get(f"/v1/boards/{board}", headers=admin)).status_code == 200
        assert (await client.delete(f"/v1/boards/{board}", headers=admin)).status_code == 204
