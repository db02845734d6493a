"""router/http.py: the writes of one event-loop turn leave as one write, and nothing is lost or
reordered on the way (unit checks on a recording transport, then a real socket through uvicorn's
protocol: pipelined requests and a large body)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import uvicorn

from router import metrics
from router.http import PIPELINE_MAX, CoalescingTransport, HttpToolsProtocol, Limits


class Recording(asyncio.Transport):
    """The inner transport: records what reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = self.eof = False

    def write(self, data: Any) -> None:
        if not self.closed:
            self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def write_eof(self) -> None:
        self.eof = True

    def get_write_buffer_size(self) -> int:
        return 7


async def test_the_writes_of_one_turn_leave_as_one_write_at_its_end() -> None:
    inner = Recording()
    t = CoalescingTransport(inner, asyncio.get_running_loop())
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    t.write(b"")
    t.writelines([b"o", memoryview(b"k")])
    assert inner.writes == []  # still this turn
    assert t.get_write_buffer_size() == 7 + 40
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]
    t.write(b"next")
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"next"]  # a lone write goes as it is
    assert t.get_write_buffer_size() == 7


async def test_close_sends_what_is_gathered_first_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    inner = Recording()
    t = CoalescingTransport(inner, loop)
    t.write(b"last words")
    t.close()
    assert inner.writes == [b"last words"] and inner.closed
    await asyncio.sleep(0)
    assert inner.writes == [b"last words"]  # the turn's flush finds nothing left

    inner = Recording()
    t = CoalescingTransport(inner, loop)
    t.write(b"never sent")
    t.abort()
    await asyncio.sleep(0)
    assert inner.writes == [] and inner.aborted

    inner = Recording()
    t = CoalescingTransport(inner, loop)
    t.write(b"before eof")
    t.write_eof()
    assert inner.writes == [b"before eof"] and inner.eof


@contextlib.asynccontextmanager
async def _serving(app: Any) -> AsyncIterator[int]:
    """``app`` behind uvicorn with HttpToolsProtocol on a free port of 127.0.0.1; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=HttpToolsProtocol, lifespan="off", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def served() -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"].strip("/")
        body = bytes(i % 251 for i in range(int(path))) if path.isdigit() else path.encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async with _serving(app) as port:
        yield port


async def _response(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    length = next(
        int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")
    )
    return head.split("\r\n")[0], await reader.readexactly(length)


async def test_pipelined_requests_are_answered_in_order_and_a_large_body_whole(served: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    try:
        writer.write(b"".join(f"GET /r{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(20)))
        for i in range(20):
            status, body = await _response(reader)
            assert (status, body) == ("HTTP/1.1 200 OK", f"r{i}".encode())
        big = 3_000_000  # past the socket's buffer: the real transport's flow control takes over
        writer.write(f"GET /{big} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        status, body = await _response(reader)
        assert status == "HTTP/1.1 200 OK" and body == bytes(i % 251 for i in range(big))
    finally:
        writer.close()


@pytest.fixture
async def held() -> Any:
    """A server whose app answers no request until ``release`` is set; yields (port, release)."""
    release = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with _serving(app) as port:
        try:
            yield port, release
        finally:
            release.set()  # before the server stops: it waits for the app's tasks


async def _answers_until_closed(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """How many answers arrive, and whether the server closed the connection (else a 5 s lull)."""
    count = 0
    try:
        while True:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            await reader.readexactly(2)
            count += 1
    except (asyncio.IncompleteReadError, ConnectionError):
        return count, True
    except TimeoutError:
        return count, False


async def test_a_client_that_pipelines_past_the_cap_is_cut_off(held: tuple[int, asyncio.Event]) -> None:
    # 200 requests in one write, none answered yet: uvicorn would queue every one (a request cycle
    # each, without bound); past PIPELINE_MAX the connection is closed instead.
    port, release = held
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"".join(f"GET /r{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(200)))
        await writer.drain()
        await asyncio.sleep(0.3)
        release.set()
        answered, closed = await _answers_until_closed(reader)
        assert closed and answered <= PIPELINE_MAX + 1
    finally:
        writer.close()


async def test_pipelined_requests_within_the_cap_are_all_answered(held: tuple[int, asyncio.Event]) -> None:
    port, release = held
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"".join(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" for _ in range(PIPELINE_MAX)))
        await writer.drain()
        await asyncio.sleep(0.3)
        release.set()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert await _answers_until_closed(reader) == (PIPELINE_MAX + 1, True)
    finally:
        writer.close()


async def test_connections_past_the_cap_are_closed_counted_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import router.http

    monkeypatch.setattr(router.http, "limits", lambda: Limits(65536, 10.0, 10.0, 2))
    monkeypatch.setattr(router.http, "_refusals", router.http.Refusals())
    refused = metrics.CONNECTIONS_REFUSED._value.get()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with _serving(app) as port:
        await _four_connections(port, caplog, refused)


async def _four_connections(port: int, caplog: pytest.LogCaptureFixture, refused: float) -> None:
    """4 connections to a worker that keeps 2: two answered, two closed at once, counted, logged."""
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    try:
        with caplog.at_level("WARNING", logger="shardlb.router"):
            outcomes = []
            for reader, writer in opened:
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                outcomes.append(await _answers_until_closed(reader))
        assert outcomes == [(1, True), (1, True), (0, True), (0, True)]
        assert metrics.CONNECTIONS_REFUSED._value.get() == refused + 2
        lines = [r for r in caplog.records if r.getMessage() == "connections refused"]
        # one line for a burst of refusals, not one each: the first, and the rest counted later
        assert len(lines) == 1 and lines[0].fields["limit"] == 2  # type: ignore[attr-defined]
    finally:
        for _, writer in opened:
            writer.close()


async def test_a_pipelined_body_that_is_not_http_is_answered_400_in_its_turn(
    held: tuple[int, asyncio.Event],
) -> None:
    """A request queued behind an answer under way whose chunked body does not parse: its 400 comes
    after the answer before it, then the connection closes. Before, its app was started anyway in
    its turn, and one that reads its body waited for ever for a body that could not come."""
    port, release = held
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /second HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
        )
        await writer.drain()
        await asyncio.sleep(0.3)
        release.set()
        assert await _response(reader) == ("HTTP/1.1 200 OK", b"ok")
        status, body = await asyncio.wait_for(_response(reader), 5)
        assert status == "HTTP/1.1 400 Bad Request"
        assert orjson.loads(body)["error"]["code"] == "malformed_request"
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_a_client_that_half_closes_after_its_requests_gets_every_answer(served: int) -> None:
    """A client may shut its side down (shutdown(SHUT_WR)) once its requests are sent, and read the
    answers on. uvicorn closed the connection at the end of the stream, with the answers unsent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served)
    try:
        writer.write(b"".join(f"GET /h{i} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for i in range(3)))
        writer.write_eof()
        for i in range(3):
            assert await asyncio.wait_for(_response(reader), 5) == ("HTTP/1.1 200 OK", f"h{i}".encode())
        assert await asyncio.wait_for(reader.read(), 5) == b""  # then closed
    finally:
        writer.close()


async def test_a_half_close_within_a_request_still_ends_it(held: tuple[int, asyncio.Event]) -> None:
    """A request cut short by the end of stream can never be whole: closed at once, not kept open."""
    port, _ = held
    for partial in (
        b"GET / HTTP/1.1\r\nHost: x\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(partial)
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 5) == b""
        finally:
            writer.close()


@pytest.fixture
async def recorded(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A server whose app reads each request's body whole and answers 200; yields (port, calls),
    calls being (path, body) per request the app ran. One client address may hold 2 connections."""
    import router.http

    monkeypatch.setattr(router.http, "limits", lambda: Limits(65536, 10.0, 10.0, 100, client_connections=2))
    monkeypatch.setattr(router.http, "_clients", {})
    calls: list[tuple[str, bytes]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        calls.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with _serving(app) as port:
        yield port, calls


def _upgrade(path: str, protocol: str, body: bytes = b"") -> bytes:
    """A request asking to switch to ``protocol`` (a WebSocket handshake's headers, or h2c's)."""
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n"
    if protocol == "websocket":
        head += "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    if body:
        head = head.replace("GET", "POST") + f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def _head_and_close(reader: asyncio.StreamReader) -> tuple[str, bytes, bool]:
    """The status line and body of the one answer on the connection, and whether it then closed."""
    status, body = await asyncio.wait_for(_response(reader), 5)
    try:
        rest = await asyncio.wait_for(reader.read(), 5)
    except TimeoutError:
        return status, body, False
    return status, body, rest == b""


@pytest.mark.parametrize("protocol", ["websocket", "h2c"])
async def test_a_request_asking_to_switch_protocols_is_answered_over_http(
    recorded: tuple[int, list[tuple[str, bytes]]], protocol: str
) -> None:
    """The router speaks HTTP/1.1 only. A WebSocket handshake went to uvicorn's WebSocket protocol
    (websockets is installed), which answered in plain text past every bound of this module and
    never gave the connection back: each one stayed counted for its client, and after
    SHARDLB_MAX_CLIENT_CONNECTIONS of them (each long closed) every connection from that address (a
    NAT's players, a /64) was refused until the worker restarted. Now the request is answered by the
    app, as if it had not asked, and the connection closed after it; the address stays welcome."""
    port, calls = recorded
    answers = []
    plain = b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    for request in [*(_upgrade(f"/up{i}", protocol) for i in range(4)), plain]:  # 4: twice the cap
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            answers.append(await _head_and_close(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            answers.append(("refused", b"", True))
        finally:
            writer.close()
    assert answers[4][0] == "HTTP/1.1 200 OK", answers  # the address may still connect
    assert answers[:4] == [("HTTP/1.1 200 OK", b"ok", True)] * 4
    assert calls == [*((f"/up{i}", b"") for i in range(4)), ("/after", b"")]


@pytest.mark.parametrize("protocol", ["websocket", "h2c", "foo"])
@pytest.mark.parametrize("split", [False, True])
async def test_a_body_that_asks_to_switch_protocols_is_refused_and_never_read_as_a_request(
    recorded: tuple[int, list[tuple[str, bytes]]], protocol: str, split: bool
) -> None:
    """llhttp takes what follows the head of a request asking to switch protocols for the other
    protocol: it reads no body of it. The app ran with an empty body (a board PUT made a board of
    the default settings, not those sent), and a body that came in a later packet was parsed as a
    request of its own and answered (a request smuggled inside another's body). Now such a request
    is 400 malformed_request before any app runs, the connection closed, nothing after it read."""
    port, calls = recorded
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    request = _upgrade("/put", protocol, smuggled)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if split:
            writer.write(request[: -len(smuggled)])
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(smuggled)
        else:
            writer.write(request)
        status, body, closed = await _head_and_close(reader)
        assert status == "HTTP/1.1 400 Bad Request" and closed
        assert orjson.loads(body)["error"]["code"] == "malformed_request"
    finally:
        writer.close()
    await asyncio.sleep(0.1)
    assert calls == []


@pytest.mark.parametrize(("header_s", "body_s"), [(5.0, 0.5), (0.5, 5.0)])
async def test_each_deadline_holds_whichever_is_shorter(
    monkeypatch: pytest.MonkeyPatch, header_s: float, body_s: float
) -> None:
    """One timer serves both deadlines, and it was set only when none was: a body deadline shorter
    than the head's fired when the head's timer did (SHARDLB_BODY_TIMEOUT_S=1 with the header
    timeout at 6: a stalled body answered after 6 s, "did not arrive within 1 s"), and the head
    deadline of a request after a slow body, shorter than the body's, likewise. Each now ends
    within its own deadline."""
    import router.http

    monkeypatch.setattr(router.http, "limits", lambda: Limits(65536, header_s, body_s, 100))

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with _serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            start = asyncio.get_running_loop().time()
            if body_s < header_s:  # a body that stalls
                writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
                expected = "HTTP/1.1 408 Request Timeout"
            else:  # a request whose body outlasts the head deadline, then a second head that stalls
                writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\na")
                await asyncio.sleep(header_s + 0.3)
                writer.write(b"b")
                assert await asyncio.wait_for(_response(reader), 5) == ("HTTP/1.1 200 OK", b"ok")
                start = asyncio.get_running_loop().time()
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
                expected = "HTTP/1.1 408 Request Timeout"
            status, _ = await asyncio.wait_for(_response(reader), 10)
            waited = asyncio.get_running_loop().time() - start
            assert status == expected
            assert waited < min(header_s, body_s) + 1.5, waited
        finally:
            writer.close()


async def _head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """The next answer's status line and headers (lower-cased names); its 2-byte body read."""
    lines = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).decode().split("\r\n")
    await reader.readexactly(2)
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    return lines[0], headers


async def test_a_drain_answers_what_open_connections_send_then_closes_them() -> None:
    """SIGTERM (``should_exit``) closed every connection between two requests at once, and one in the
    middle of a request's head: a request on its way on a keep-alive connection, or half sent, then
    met a closed connection or a reset, never an answer (in a rolling restart, the clients of a pod
    whose endpoint was removed keep their connections to it). Each is now answered, with
    ``connection: close``, and the connection closed after it; a connection left idle is closed by
    its keep-alive timeout as ever."""
    release = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/hold":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, http=HttpToolsProtocol, lifespan="off", log_level="warning", timeout_keep_alive=30
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    opened = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    try:
        (idle_r, idle_w), (half_r, half_w), (busy_r, busy_w) = opened
        idle_w.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _head(idle_r))[0] == "HTTP/1.1 200 OK"  # kept alive, between requests now
        half_w.write(b"GET /h HTTP/1.1\r\nHo")
        busy_w.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")  # holds the drain open
        await asyncio.sleep(0.2)  # both read by the server
        server.should_exit = True  # what SIGTERM does
        while True:  # the listener is closed first, the connections told in the same step
            try:
                _, probe = await asyncio.open_connection("127.0.0.1", port)
            except ConnectionError:
                break
            probe.close()
            await asyncio.sleep(0.05)
        idle_w.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        half_w.write(b"st: x\r\n\r\n")
        answers = []
        for reader in (idle_r, half_r):
            try:
                answers.append(await _head(reader))
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                answers.append((type(e).__name__, {}))
        release.set()
        answers.append(await _head(busy_r))
        assert [(status, headers.get("connection")) for status, headers in answers] == [
            ("HTTP/1.1 200 OK", "close")
        ] * 3
        for reader, _ in opened:
            assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        release.set()
        for _, writer in opened:
            writer.close()
        await serving
