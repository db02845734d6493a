"""router/http.py: the writes of one event-loop turn leave as one write, and nothing is lost or
reordered on the way (unit checks on a recording transport, then a real socket through uvicorn's
protocol: pipelined requests and a large body)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvicorn

from router.http import CoalescingTransport, HttpToolsProtocol


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

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=HttpToolsProtocol, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task


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
