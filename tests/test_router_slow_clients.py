"""Slow and oversized clients against the router as a process (router/http.py): a body that stalls is
answered 408 once SHARDLB_BODY_TIMEOUT_S has passed, so the admission slot it holds comes free; a
connection that sends nothing, or never ends its headers, is closed after SHARDLB_HEADER_TIMEOUT_S;
a request line and headers past SHARDLB_MAX_HEADER_BYTES are 431 before they are kept in memory.
The deadlines are set to a second here: each test only checks that the slow client is cut off."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest

from router import liveness
from router.settings import Settings, SettingsError
from shardlb.cluster import LocalCluster
from tests.router_support import AS_ADMIN, AS_READER, AS_WRITER, board_name
from tests.test_router_server import Server, free_port

HEADER_BYTES = 16 * 1024
MAX_HEADER_FIELDS = 100  # SHARDLB_MAX_HEADER_FIELDS' default
TARGET_BYTES = 8 * 1024  # router.http.TARGET_BYTES
SLOTS = 4
# How long a test waits for the router to cut a slow client off (its deadlines are a second).
PATIENCE_S = 15


@pytest.fixture(scope="module")
def slow_server(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        cluster.url,
        tmp_path_factory.mktemp("slow") / "router.log",
        SHARDLB_MAX_REQUESTS=str(SLOTS),
        SHARDLB_BODY_TIMEOUT_S="1",
        SHARDLB_HEADER_TIMEOUT_S="1",
        SHARDLB_MAX_HEADER_BYTES=str(HEADER_BYTES),
        SHARDLB_READ_RATE="0",
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def patient_server(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Deadlines of a minute: what ends a connection within PATIENCE_S here is a cap, not a deadline."""
    server = Server(
        cluster.url,
        tmp_path_factory.mktemp("patient") / "router.log",
        SHARDLB_BODY_TIMEOUT_S="60",
        SHARDLB_HEADER_TIMEOUT_S="60",
        SHARDLB_READ_RATE="0",
    )
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def board(slow_server: Server) -> Iterator[str]:
    name = board_name("slow")
    assert httpx.put(f"{slow_server.url}/v1/boards/{name}", headers=AS_ADMIN).status_code == 201
    yield name
    httpx.delete(f"{slow_server.url}/v1/boards/{name}", headers=AS_ADMIN)


async def _open(server: Server, data: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    if data:
        writer.write(data)
        await writer.drain()
    return reader, writer


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """The next response on the connection: status, headers (lower-cased names) and body."""

    async def read() -> tuple[int, dict[str, str], bytes]:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return int(head[0].split()[1]), headers, body

    return await asyncio.wait_for(read(), PATIENCE_S)


async def _closed(reader: asyncio.StreamReader) -> bool:
    """True once the router closed the connection (end of stream or a reset) with nothing more."""

    async def rest() -> bytes:
        try:
            return await reader.read()
        except ConnectionError:
            return b""

    return await asyncio.wait_for(rest(), PATIENCE_S) == b""


async def _ends(reader: asyncio.StreamReader) -> bool:
    """True once the router ends the connection, whatever it answered before."""

    async def drain() -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    try:
        await asyncio.wait_for(drain(), PATIENCE_S)
    except TimeoutError:
        return False
    return True


def _error(body: bytes) -> str:
    error = orjson.loads(body)["error"]
    assert set(error) == {"code", "message", "field"}
    return str(error["code"])


def _stalled_query(board: str) -> bytes:
    return (
        f"POST /v1/boards/{board}/players:query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        'Content-Length: 100\r\n\r\n{"player_ids": ['
    ).encode()


@pytest.mark.cluster
async def test_stalled_bodies_hold_few_slots_and_are_408(slow_server: Server, board: str) -> None:
    """Twice as many anonymous stalled players:query bodies from one address as the worker has slots:
    while they stall, a keyed write, a read and a whole query from the same address get in; then
    each stalled one is answered 408 once its body deadline passed, and the connection closed."""
    stalled = [await _open(slow_server, _stalled_query(board)) for _ in range(2 * SLOTS)]
    try:
        await asyncio.sleep(0.5)  # the router has taken them in (a settling pause, nothing timed)
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=10) as client:
            body = {"scores": [{"player_id": "p", "points": 5, "match_id": "slow-1"}]}
            write = await client.post(f"/v1/boards/{board}/scores", json=body, headers=AS_WRITER)
            assert write.status_code == 200, write.text
            assert (await client.get(f"/v1/boards/{board}/top")).status_code == 200
            query = await client.post(f"/v1/boards/{board}/players:query", json={"player_ids": ["p"]})
            assert query.status_code == 200 and query.json()["entries"][0]["points"] == 5
            # Read ahead only as far as a request without a key may send: past it, 413 at once.
            big = b'{"player_ids": [' + b'"p", ' * 40_000 + b'"p"]}'
            refused = await client.post(f"/v1/boards/{board}/players:query", content=big)
            assert (refused.status_code, _error(refused.content)) == (413, "body_too_large")
        for reader, _ in stalled:
            status, headers, body_bytes = await _answer(reader)
            assert (status, _error(body_bytes)) == (408, "request_timeout")
            assert headers["x-request-id"] and headers["connection"] == "close"
            assert headers["content-type"] == "application/json"
            assert await _closed(reader)
    finally:
        for _, writer in stalled:
            writer.close()


@pytest.mark.cluster
async def test_stalled_bodies_with_a_read_key_hold_few_slots(slow_server: Server, board: str) -> None:
    """A read key is the least of the keys (with SHARDLB_READS_REQUIRE_KEY it is handed to whoever
    may read): a players:query sent with one and stalled in its body took its slot at once, as a
    game server's write does, so twice the worker's slots of them from one address held every slot
    and a write key's post was 503 overloaded until their body deadline. Such a body now holds a
    slot as one without a key does; a key of the write scope still takes its slot at once."""
    keyed = f"Host: x\r\nAuthorization: {AS_READER['Authorization']}\r\n".encode()
    head = _stalled_query(board).replace(b"Host: x\r\n", keyed)
    stalled = [await _open(slow_server, head) for _ in range(2 * SLOTS)]
    try:
        await asyncio.sleep(0.5)  # the router has taken them in (a settling pause, nothing timed)
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=10) as client:
            body = {"scores": [{"player_id": "p", "points": 6, "match_id": "slow-read-key"}]}
            write = await client.post(f"/v1/boards/{board}/scores", json=body, headers=AS_WRITER)
            assert write.status_code == 200, write.text
            query = await client.post(
                f"/v1/boards/{board}/players:query", json={"player_ids": ["p"]}, headers=AS_READER
            )
            assert query.status_code == 200, query.text
        for reader, _ in stalled:
            status, _, body_bytes = await _answer(reader)
            assert (status, _error(body_bytes)) == (408, "request_timeout")
    finally:
        for _, writer in stalled:
            writer.close()


@pytest.mark.cluster
async def test_a_stalled_write_body_is_408(slow_server: Server, board: str) -> None:
    """The write endpoint (raw ASGI, keys checked first) is cut off alike, in MessagePack if asked."""
    reader, writer = await _open(
        slow_server,
        (
            f"POST /v1/boards/{board}/scores HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            f"{AS_WRITER['Authorization'].split()[1]}\r\nAccept: application/msgpack\r\n"
            'Content-Length: 500\r\n\r\n{"scores": ['
        ).encode(),
    )
    try:
        status, headers, _ = await _answer(reader)
        assert status == 408 and headers["content-type"] == "application/msgpack"
        assert await _closed(reader)
    finally:
        writer.close()


@pytest.mark.cluster
async def test_silent_connections_and_unfinished_headers_are_closed(slow_server: Server) -> None:
    silent, silent_writer = await _open(slow_server)
    partial, partial_writer = await _open(slow_server, b"GET /v1/boards HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    try:
        assert await _closed(silent)
        status, _, body = await _answer(partial)
        assert (status, _error(body)) == (408, "request_timeout")
        assert await _closed(partial)
    finally:
        silent_writer.close()
        partial_writer.close()


@pytest.mark.cluster
async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(slow_server: Server) -> None:
    reader, writer = await _open(slow_server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        status, _, _ = await _answer(reader)
        assert status == 200
        assert await _closed(reader)
    finally:
        writer.close()


def _padding(size: int) -> bytes:
    line = b"X-Pad: " + b"a" * 1000 + b"\r\n"
    return line * (size // len(line) + 1)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _padding(HEADER_BYTES), id="unfinished"),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _padding(HEADER_BYTES) + b"\r\n", id="complete"
        ),
        pytest.param(b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * (2 * HEADER_BYTES), id="one-line"),
    ],
)
async def test_headers_past_the_cap_are_431(slow_server: Server, request_: bytes) -> None:
    reader, writer = await _open(slow_server, request_)
    try:
        status, headers, body = await _answer(reader)
        assert (status, _error(body)) == (431, "headers_too_large")
        assert headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()


@pytest.mark.cluster
@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(b"GET /v1/boards/b/players/a\x01b HTTP/1.1\r\nHost: x\r\n\r\n", id="control-in-path"),
        pytest.param(
            b"POST /v1/boards/b/scores HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", id="length"
        ),
        pytest.param(b"GET /healthz HTTP/1.1\r\nBad Name: x\r\n\r\n", id="header-name"),
    ],
)
async def test_a_request_that_is_not_http_gets_the_apis_400(slow_server: Server, request_: bytes) -> None:
    """Before, uvicorn answered these with a text/plain page and no request id (an API audit's
    finding): api.md promises the error body on every error."""
    reader, writer = await _open(slow_server, request_)
    try:
        status, headers, body = await _answer(reader)
        assert (status, _error(body)) == (400, "malformed_request")
        assert headers["content-type"] == "application/json"
        assert headers["x-request-id"] and headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()


@pytest.mark.cluster
async def test_a_huge_header_line_is_cut_off_not_kept(slow_server: Server) -> None:
    """8 MiB of one header line: the router stops reading it at the cap (a 431 may or may not reach
    the client before the reset of what it was still sending) and closes the connection."""
    reader, writer = await _open(slow_server, b"GET /healthz HTTP/1.1\r\nX-Long: ")

    async def send_then_read() -> bytes:
        with contextlib.suppress(ConnectionError):
            for _ in range(128):
                writer.write(b"a" * 65536)
                await writer.drain()
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                data += chunk
        return data

    try:
        data = await asyncio.wait_for(send_then_read(), PATIENCE_S)
        assert not data or data.startswith(b"HTTP/1.1 431 ")
    finally:
        writer.close()


@pytest.mark.cluster
async def test_headers_under_the_cap_and_pipelined_requests_still_pass(slow_server: Server) -> None:
    reader, writer = await _open(
        slow_server,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _padding(HEADER_BYTES // 2) + b"\r\n"
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + _padding(HEADER_BYTES // 2) + b"\r\n",
    )
    try:
        for _ in range(2):
            status, _, _ = await _answer(reader)
            assert status == 200
    finally:
        writer.close()


@pytest.mark.cluster
async def test_header_fields_past_their_count_are_431(slow_server: Server, board: str) -> None:
    """15,000 empty header lines fit in 64 KiB of head, and each cost a Python call of uvicorn's
    parser and a turn of every scan of the headers: 4-6 ms of a worker's CPU a request (40 cached
    tops), on any path, before any limit applied. Past SHARDLB_MAX_HEADER_FIELDS (100, as Apache's
    LimitRequestFields) a request is 431, and so is a chunked body's trailers past it."""
    fields = MAX_HEADER_FIELDS - 1  # with Host
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    reader, writer = await _open(slow_server, head + b"a: b\r\n" * fields + b"\r\n")
    try:
        status, _, _ = await _answer(reader)
        assert status == 200
        writer.write(head + b"a: b\r\n" * (fields + 1) + b"\r\n")
        status, headers, body = await _answer(reader)
        assert (status, _error(body)) == (431, "headers_too_large")
        assert headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()
    body = orjson.dumps({"scores": [{"player_id": "t", "points": 1, "match_id": "m"}]})
    reader, writer = await _open(
        slow_server,
        f"POST /v1/boards/{board}/scores HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        f"Content-Type: application/json\r\nAuthorization: {AS_WRITER['Authorization']}\r\n\r\n".encode()
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n"
        + b"a: b\r\n" * (MAX_HEADER_FIELDS - 3)  # with the head's four: one past the count
        + b"\r\n",
    )
    try:
        status, headers, body = await _answer(reader)
        assert (status, _error(body)) == (431, "headers_too_large")
        assert await _closed(reader)
    finally:
        writer.close()


@pytest.mark.cluster
async def test_a_request_target_past_8_kib_is_414(slow_server: Server) -> None:
    """A path or query string of 60 KiB cost a worker 4-7 ms of CPU a request (uvicorn unquotes the
    path, every route's pattern scans it), on a 404 that no read budget counts. No request of the
    API needs 8 KiB (three ids and a moderation reason of 500 characters, every byte escaped, take
    about 6.5 KiB); a longer one is 414 before any app runs, and the connection closed."""
    most = TARGET_BYTES
    for target, status in (
        (b"/v1/boards/" + b"a" * (most - len("/v1/boards//top")) + b"/top", 422),  # invalid_id
        (b"/v1/boards/" + b"a" * (most + 1 - len("/v1/boards//top")) + b"/top", 414),
        (b"/healthz?" + b"%41" * most, 414),  # past the head's cap too: its first bytes are enough
    ):
        reader, writer = await _open(slow_server, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            answer, headers, body = await _answer(reader)
            assert answer == status
            if status == 414:
                assert _error(body) == "uri_too_long"
                assert headers["connection"] == "close"
                assert await _closed(reader)
        finally:
            writer.close()


def test_the_limits_are_settings_with_sane_defaults_and_ranges() -> None:
    env = {"SHARDLB_WRITE_KEYS": "k"}
    defaults = Settings.from_env(env)
    assert (defaults.body_timeout_s, defaults.header_timeout_s) == (10.0, 10.0)
    assert (defaults.max_header_bytes, defaults.max_header_fields) == (64 * 1024, MAX_HEADER_FIELDS)
    assert (defaults.max_connections, defaults.max_client_connections) == (2048, 512)
    for name, value in (
        ("SHARDLB_BODY_TIMEOUT_S", "0"),
        ("SHARDLB_HEADER_TIMEOUT_S", "-1"),
        ("SHARDLB_MAX_HEADER_BYTES", "100"),
        ("SHARDLB_MAX_HEADER_FIELDS", "7"),
        ("SHARDLB_MAX_CONNECTIONS", "0"),
        ("SHARDLB_MAX_CLIENT_CONNECTIONS", "0"),
    ):
        with pytest.raises(SettingsError, match=name):
            Settings.from_env({**env, name: value})


async def test_a_connection_sending_only_line_ends_between_requests_is_closed(
    slow_server: Server, board: str
) -> None:
    """After an answer, bytes that begin no request (llhttp skips CR LF between requests) stopped
    uvicorn's keep-alive timer and started no deadline of ours: the connection stayed open for good,
    and 2048 such connections locked every client, probes included, out of a worker."""
    reader, writer = await _open(
        slow_server, f"GET /v1/boards/{board}/top HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    )
    status, _, _ = await _answer(reader)
    assert status == 200
    with contextlib.suppress(ConnectionError):  # the router may cut it off while it writes
        for _ in range(4):  # a line end every half second, past the 1 s deadline
            writer.write(b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.5)
    assert await _ends(reader)
    writer.close()


async def test_endless_trailers_after_a_chunked_body_are_cut_off(patient_server: Server, board: str) -> None:
    """Trailers after a chunked body's last chunk were counted by nothing: one connection sending
    them for the body's 10 s made a worker hold gigabytes. They count against the header cap."""
    head = (
        f"POST /v1/boards/{board}/scores HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        f"Content-Type: application/json\r\nAuthorization: {AS_WRITER['Authorization']}\r\n\r\n"
    )
    body = orjson.dumps({"scores": [{"player_id": "t", "points": 1, "match_id": "m"}]})
    reader, writer = await _open(
        patient_server, head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n"
    )
    with contextlib.suppress(ConnectionError):
        for i in range(200):  # 200 x 1 KiB of trailer lines: past the 64 KiB cap (the deadline is 60 s)
            writer.write(f"X-Pad-{i}: {'a' * 1000}\r\n".encode())
            await writer.drain()
    assert await _ends(reader)
    writer.close()


async def _open_from(server: Server, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection from another loopback address (Linux answers all of 127.0.0.0/8)."""
    return await asyncio.open_connection("127.0.0.1", server.port, local_addr=(source, 0))


async def _healthy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """True when the connection still answers a request."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        await writer.drain()
        status, _, _ = await _answer(reader)
    except (ConnectionError, asyncio.IncompleteReadError):
        return False
    return status == 200


@pytest.mark.cluster
async def test_one_address_cannot_take_every_connection(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The cap on a worker's connections was the only one: one address opening
    SHARDLB_MAX_CONNECTIONS silent (or keep-alive) connections, again as each was closed, had every
    other client's connection closed at once. Now one address (an IPv6 /64) holds at most
    SHARDLB_MAX_CLIENT_CONNECTIONS; a trusted proxy, which carries many clients, is not counted."""
    server = Server(
        cluster.url,
        tmp_path_factory.mktemp("crowd") / "router.log",
        SHARDLB_MAX_CONNECTIONS="8",
        SHARDLB_MAX_CLIENT_CONNECTIONS="3",
        SHARDLB_TRUSTED_PROXIES="127.0.0.3",
        SHARDLB_HEADER_TIMEOUT_S="60",
        SHARDLB_READ_RATE="0",
    )
    opened: list[asyncio.StreamWriter] = []
    try:
        crowd = [await _open_from(server, "127.0.0.2") for _ in range(8)]
        opened += [writer for _, writer in crowd]
        assert [await _healthy(*c) for c in crowd[3:]] == [False] * 5  # closed at once
        assert [await _healthy(*c) for c in crowd[:3]] == [True] * 3
        other = await _open_from(server, "127.0.0.1")
        opened.append(other[1])
        assert await _healthy(*other)
        proxied = [await _open_from(server, "127.0.0.3") for _ in range(4)]
        opened += [writer for _, writer in proxied]
        assert [await _healthy(*c) for c in proxied] == [True] * 4
        # The crowd's connections come free as they close: that address may open them again.
        for _, writer in crowd[:3]:
            writer.close()
        await asyncio.sleep(0.2)
        again = await _open_from(server, "127.0.0.2")
        opened.append(again[1])
        assert await _healthy(*again)
    finally:
        for writer in opened:
            writer.close()
        assert server.stop() == 0


async def _probe(port: int, source: str, target: str = "/healthz") -> tuple[int, bytes]:
    """The kubelet's liveness probe, from ``source``: one GET on a connection of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.33\r\n\r\n".encode())
        await writer.drain()
        status, _, body = await _answer(reader)
        return status, body
    finally:
        writer.close()


@pytest.mark.cluster
async def test_liveness_is_answered_at_the_connection_caps(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The kubelet's liveness probe is one more connection, from the node's address, which the
    traffic kube-proxy forwards from a NodePort shares. A router at SHARDLB_MAX_CONNECTIONS, or with
    that address at SHARDLB_MAX_CLIENT_CONNECTIONS, closed it at once like any other, and after a few
    such probes Kubernetes restarted a router that was busy, not dead. SHARDLB_PROBE_PORT is a
    listener of its own that the caps do not cover: it answers GET /healthz, and nothing else."""
    server = Server(
        cluster.url,
        tmp_path_factory.mktemp("capped") / "router.log",
        probe=True,  # both ports the helper's: a start that finds either taken starts on others
        SHARDLB_MAX_CONNECTIONS="6",
        SHARDLB_MAX_CLIENT_CONNECTIONS="2",
        SHARDLB_HEADER_TIMEOUT_S="60",
        SHARDLB_READ_RATE="0",
        SHARDLB_PROBE_HOST="127.0.0.1",
    )
    assert server.probe_port is not None
    probe_port = server.probe_port
    opened: list[asyncio.StreamWriter] = []
    kubelet = "127.0.0.7"
    try:
        # the node's address at its per-client cap: its next connection to the API port is closed
        held = [await _open_from(server, kubelet) for _ in range(2)]
        opened += [writer for _, writer in held]
        assert [await _healthy(*c) for c in held] == [True, True]
        refused = await _open_from(server, kubelet)
        opened.append(refused[1])
        assert not await _healthy(*refused)
        for _ in range(3):  # a probe period after another
            assert await _probe(probe_port, kubelet) == (200, b'{"status":"ok"}')
        # every connection of the worker taken: any address's next one is closed
        crowd = [await _open_from(server, f"127.0.0.{i}") for i in (2, 3, 4, 5)]
        opened += [writer for _, writer in crowd]
        assert [await _healthy(*c) for c in crowd] == [True] * 4
        late = await _open_from(server, "127.0.0.9")
        opened.append(late[1])
        assert not await _healthy(*late)
        for source in (kubelet, "127.0.0.9"):
            assert await _probe(probe_port, source) == (200, b'{"status":"ok"}')
        # the probe port serves liveness only: not the API, not readiness, not the metrics
        for target in ("/readyz", "/metrics", "/v1/boards/any"):
            status, body = await _probe(probe_port, kubelet, target)
            assert status == 404 and _error(body) == "not_found", target
    finally:
        for writer in opened:
            writer.close()
        assert server.stop() == 0


async def _probe_listener() -> tuple[Settings, liveness.Listener]:
    """A probe listener of this process on a port from tests/ports.py. That port is checked free, not
    held: one taken by another process before the bind (EADDRINUSE) is left for the next, as
    ``Server`` leaves its ports."""

    async def on_a_free_port() -> tuple[Settings, liveness.Listener]:
        settings = Settings(insecure_dev=True, probe_port=free_port(), probe_host="127.0.0.1")
        listener = await liveness.listen(settings)
        assert listener is not None
        return settings, listener

    for _ in range(Server.TRIES - 1):
        try:
            return await on_a_free_port()
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
    return await on_a_free_port()


async def test_the_probe_port_has_bounds_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the caps do not cover is bounded on its own: PROBE_CONNECTIONS at once (one more is
    closed at once), a silent connection closed after PROBE_TIMEOUT_S, a head past PROBE_HEAD_BYTES
    closed."""
    # Long enough that the silent ones are still open while the one more is refused, on a loaded
    # machine too (make test runs three workers on two cores).
    monkeypatch.setattr(liveness, "PROBE_TIMEOUT_S", 1.5)
    settings, listener = await _probe_listener()
    port = settings.probe_port
    opened: list[asyncio.StreamWriter] = []
    try:
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(liveness.PROBE_CONNECTIONS)]
        opened += [writer for _, writer in silent]
        deadline = asyncio.get_running_loop().time() + PATIENCE_S
        while listener.open < liveness.PROBE_CONNECTIONS:  # until the listener has taken them in
            assert asyncio.get_running_loop().time() < deadline, listener.open
            await asyncio.sleep(0.005)
        assert listener.open == liveness.PROBE_CONNECTIONS
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(writer)
        assert await _closed(reader)
        assert listener.open == liveness.PROBE_CONNECTIONS
        # the silent ones end at their deadline; then the port answers again
        assert [await _closed(reader) for reader, _ in silent] == [True] * liveness.PROBE_CONNECTIONS
        assert await _probe(port, "127.0.0.7") == (200, b'{"status":"ok"}')
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(writer)
        writer.write(b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * (2 * liveness.PROBE_HEAD_BYTES))
        assert await _closed(reader)
    finally:
        for writer in opened:
            writer.close()
        listener.close()


async def test_every_worker_binds_the_probe_port() -> None:
    """Workers share the API port; each binds the probe port too (SO_REUSEPORT), and a probe
    reaches one of them."""
    settings, first = await _probe_listener()
    workers = [first, await liveness.listen(settings)]
    try:
        assert all(w is not None and w.server is not None and w.server.is_serving() for w in workers)
        assert await _probe(settings.probe_port, "127.0.0.1") == (200, b'{"status":"ok"}')
    finally:
        for w in workers:
            if w is not None:
                w.close()


def test_the_probe_port_is_a_setting_apart_from_the_api_port() -> None:
    env = {"SHARDLB_WRITE_KEYS": "k"}
    assert Settings.from_env(env).probe_port == 0  # no probe listener unless asked for
    assert Settings.from_env({**env, "SHARDLB_PROBE_PORT": "8001"}).probe_port == 8001
    for value in ("8000", "-1", "65536"):
        with pytest.raises(SettingsError, match="SHARDLB_PROBE_PORT"):
            Settings.from_env({**env, "SHARDLB_PROBE_PORT": value})


@pytest.mark.cluster
@pytest.mark.parametrize(
    "framing",
    [
        pytest.param(b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", id="chunk-size"),
        pytest.param(b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", id="chunk-end"),
        pytest.param(b"Transfer-Encoding: xchunked\r\n\r\n{}", id="transfer-coding"),
    ],
)
async def test_a_body_that_is_not_http_gets_the_apis_400_at_once(
    patient_server: Server, board: str, framing: bytes
) -> None:
    """A request whose head was read and whose body's framing llhttp cannot parse: before, the app
    went on waiting for a body that would never come, the body deadline did nothing for a refused
    connection, and the request held its admission slot with no answer until the client left."""
    head = (
        f"POST /v1/boards/{board}/scores HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {AS_WRITER['Authorization']}\r\n"
    ).encode()
    reader, writer = await _open(patient_server, head + framing)
    try:
        status, headers, body = await _answer(reader)
        assert (status, _error(body)) == (400, "malformed_request")
        assert headers["x-request-id"] and headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()


@pytest.mark.cluster
async def test_a_write_sent_before_a_half_close_is_answered(patient_server: Server, board: str) -> None:
    """The write was applied and its answer never sent: the connection was closed at the client's
    end of stream (shutdown(SHUT_WR)), which only says that no more requests come."""
    body = orjson.dumps({"scores": [{"player_id": "half", "points": 3, "match_id": "half-1"}]})
    reader, writer = await _open(
        patient_server,
        (
            f"POST /v1/boards/{board}/scores HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: {AS_WRITER['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body,
    )
    try:
        writer.write_eof()
        status, headers, answer = await _answer(reader)
        assert status == 200 and orjson.loads(answer)["results"][0]["status"] == "improved"
        assert headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()


async def _never_reading(server: Server, source: str, request: bytes) -> asyncio.StreamWriter:
    """A connection from ``source`` with a tiny receive window that sends ``request`` 100 times, in
    batches within the router's pipelining cap, and reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window offered
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", server.port))
    _, writer = await asyncio.open_connection(sock=sock)
    with contextlib.suppress(ConnectionError):
        for _ in range(5):
            writer.write(request * 20)
            await writer.drain()
            await asyncio.sleep(0.3)
    return writer


@pytest.mark.cluster
async def test_a_client_that_stops_reading_its_answers_is_cut_off(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An answer waiting for a client that reads nothing waited for ever (uvicorn's drain has no
    deadline), holding its admission slot: as many such clients as SHARDLB_MAX_REQUESTS locked
    everyone out of the API with 503s. Now a write that makes no progress for SHARDLB_BODY_TIMEOUT_S
    ends the connection, and the slot comes free."""
    server = Server(
        cluster.url,
        tmp_path_factory.mktemp("unread") / "router.log",
        SHARDLB_MAX_REQUESTS="2",
        SHARDLB_BODY_TIMEOUT_S="1",
        SHARDLB_READ_RATE="0",
    )
    name = board_name("unread")
    stuck: list[asyncio.StreamWriter] = []
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            assert (await client.put(f"/v1/boards/{name}", headers=AS_ADMIN)).status_code == 201
            scores = [{"player_id": f"p{i}", "points": i, "match_id": "m"} for i in range(1000)]
            written = await client.post(
                f"/v1/boards/{name}/scores", json={"scores": scores}, headers=AS_WRITER
            )
            assert written.status_code == 200
            # ~80 KB an answer, 100 of them a connection: past what the socket buffers hold (4 MiB)
            request = f"GET /v1/boards/{name}/entries?limit=1000 HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            for source in ("127.0.0.2", "127.0.0.3"):
                stuck.append(await _never_reading(server, source, request))
            await asyncio.sleep(3)  # past the deadline: what ends them now is the router
            answer = await client.get(f"/v1/boards/{name}/entries", params={"limit": 1}, headers=AS_READER)
            assert answer.status_code == 200, answer.text
    finally:
        for writer in stuck:
            writer.close()
        httpx.delete(f"{server.url}/v1/boards/{name}", headers=AS_ADMIN)
        assert server.stop() == 0


@pytest.mark.cluster
async def test_the_access_log_logs_each_request_the_protocol_refuses(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SHARDLB_ACCESS_LOG=true logs each refused request (router/README.md, "Service endpoints"),
    the 400/408/431 that router/http.py answers before any app runs too: those have no access line
    of their own, and their refusal lines were kept to one a minute whatever the setting."""
    log = tmp_path_factory.mktemp("access") / "router.log"
    server = Server(cluster.url, log, SHARDLB_ACCESS_LOG="true")
    try:
        for i in range(3):
            reader, writer = await _open(server, f"GET /healthz/{i} HTTP/1.1\r\nBad Name: x\r\n\r\n".encode())
            try:
                status, _, body = await _answer(reader)
                assert (status, _error(body)) == (400, "malformed_request")
                assert await _closed(reader)
            finally:
                writer.close()
    finally:
        assert server.stop() == 0
    lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    refused = [line for line in lines if line.get("code") == "malformed_request"]
    assert len(refused) == 3, refused
