"""uvicorn's httptools protocol with one socket write per response instead of two.

uvicorn writes a response's status line and headers with one ``transport.write`` and its body with
another, and uvloop sends each at once: two ``send`` system calls, two TCP segments, per response.
On the router's hot paths (the cached top-100, "my rank", a score post) a response is small and the
system call is a large share of its CPU (``RequestResponseCycle.send`` was 17-50% of the router's
samples in `make bench`'s profiles). ``CoalescingTransport`` gathers the writes made in one turn of
the event loop and hands them to the real transport as one at the end of the turn (``call_soon``):
the head and the body of a response go out together, and so do several pipelined responses. Nothing
waits longer than the turn it was written in; ``close`` and ``write_eof`` send what is gathered
first, ``abort`` drops it, as the real transport would.

``serve`` runs uvicorn with ``http="router.http:HttpToolsProtocol"``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _UvicornHttpTools


class CoalescingTransport(asyncio.Transport):
    """A transport that sends the writes of one event-loop turn as one write of ``inner``."""

    __slots__ = ("_inner", "_loop", "_parts", "_size")

    def __init__(self, inner: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._inner = inner
        self._loop = loop
        self._parts: list[bytes] = []
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._parts:
            self._loop.call_soon(self._flush)
        self._parts.append(bytes(data))
        self._size += len(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def _flush(self) -> None:
        parts = self._parts
        if not parts:
            return
        self._parts, self._size = [], 0
        if self._inner.is_closing():
            return  # the real transport drops writes once closing: so do we
        self._inner.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self._flush()
        self._inner.close()

    def abort(self) -> None:
        self._parts, self._size = [], 0
        self._inner.abort()

    def write_eof(self) -> None:
        self._flush()
        self._inner.write_eof()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def is_closing(self) -> bool:
        return self._inner.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._inner.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size() + self._size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()


class HttpToolsProtocol(_UvicornHttpTools):
    """uvicorn's httptools protocol writing through a ``CoalescingTransport``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
