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

``HttpToolsProtocol`` also bounds what a slow or oversized client can make a worker hold, where
uvicorn's protocol bounds nothing (it keeps every header line, and waits for a body for ever):

- the request line and headers may take SHARDLB_MAX_HEADER_BYTES (64 KiB); past it the request is
  answered 431 ``headers_too_large`` and the connection closed. The bytes are counted as they come
  in (``data_received``), not in the parser's callbacks: httptools joins one header line's pieces
  itself and only hands the whole line over, so a line that never ends would be seen by no callback;
- the request target (path and query string) may take TARGET_BYTES (8 KiB, nginx's request line);
  past it the request is answered 414 ``uri_too_long`` and the connection closed, the parser
  stopped there (``on_url``). uvicorn unquotes the path and every route's pattern scans it: 60 KiB
  of it cost 4-7 ms of a worker's CPU a request, on a 404 no read budget counts;
- they may hold SHARDLB_MAX_HEADER_FIELDS (100) header fields, a chunked body's trailers counted
  with them; one more is 431 ``headers_too_large`` too, and the parser stops at it (``on_header``).
  64 KiB hold 15,000 empty ones, each a Python call here and a turn of every scan of the headers:
  4-6 ms of a worker's CPU a request, 40 cached tops, on any path and before any limit applied;
- a connection has SHARDLB_HEADER_TIMEOUT_S (10 s) to send its first request line and headers (and
  a later request as much from its first byte); past it, 408 ``request_timeout`` when a request had
  begun, else the connection is closed without an answer;
- a request's body has SHARDLB_BODY_TIMEOUT_S (10 s) from the end of its headers to arrive whole;
  past it, 408 ``request_timeout`` when no answer has begun (the app then sees the client gone, and
  the access middleware logs the 408), and the connection is closed;
- a worker keeps at most SHARDLB_MAX_CONNECTIONS connections open; one more is closed at once,
  counted in ``shardlb_http_connections_refused_total`` and logged (one warning a minute at most,
  with the number refused since the last one: a flood of connections must not flood the log too);
- of them, one client address (an IPv6 /64, as the read budgets count clients) may hold at most
  SHARDLB_MAX_CLIENT_CONNECTIONS; one more is closed at once, counted and logged alike. Without it
  one address could hold every connection (silent ones reopened as they are closed, or keep-alive
  ones kept busy with /healthz) and every other client's would be closed at once. A peer among
  SHARDLB_TRUSTED_PROXIES carries many clients and is not counted;
- a connection may have at most PIPELINE_MAX requests read ahead of their answers (pipelined);
  one that sends more without reading its answers is closed;
- an answer that cannot be written because the client reads nothing (the transport's buffer past
  its high-water mark, ``pause_writing``) may wait SHARDLB_BODY_TIMEOUT_S for the client to read
  down to the low mark; past it the connection is aborted. uvicorn waits for ever there, and the
  request holds its admission slot while it waits.
- when the server's drain begins (SIGTERM), the request under way on a connection, or the next
  one it sends (a request on its way, or half sent), is answered with ``connection: close`` and the
  connection closed after it; uvicorn closed a connection between requests, or in a request's head,
  at once, with no answer (``shutdown``). An idle one is closed by the keep-alive timeout. A
  request that waits on something outside the router asks ``drain_begun`` to answer sooner;
- a request that asked for ``100 Continue`` (``Expect: 100-continue``) and is answered before its
  body was asked for (refused on its head: a key, a media type, a declared length) closes the
  connection after that answer (``_send_after_expect``);
- a request the parser cannot read is answered 400 ``malformed_request`` with the API's error body
  (uvicorn's own answer is a plain-text page), and the connection closed;
- the router speaks HTTP/1.1 only: a request that asks to switch protocols (``Upgrade`` with
  ``Connection: upgrade``: a WebSocket handshake, h2c) is answered by the app as if it had not asked,
  then the connection closed. llhttp takes what follows such a request's head for the other
  protocol and reads no body of it, so one that carries a body is 400 ``malformed_request`` before
  any app runs, and nothing after its head is read as a request (``on_headers_complete``).

One timer per connection serves both deadlines: a request that moves on only moves the deadline,
and the timer, when it fires early, sets itself again for the rest (it is set anew only for a
deadline earlier than its own). These errors have the API's
shape (``{"error": {...}}``, MessagePack if Accept asks for it) and an ``X-Request-Id``.

``serve`` runs uvicorn with ``http="router.http:HttpToolsProtocol"``; the limits come from the
environment's settings (the defaults when it holds no valid settings, as in a test's own uvicorn).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.types import Message, Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, RequestResponseCycle
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _UvicornHttpTools
from uvicorn.server import ServerState

from router import metrics
from router.auth import client_network
from router.errors import ApiError
from router.limiter import trusted
from router.media import (
    TIMED_OUT,
    RawHeaders,
    header_fields_too_many,
    headers_too_large,
    rendered_error,
    request_timeout,
    wants_msgpack,
)
from router.middleware import LOGGED_PATH_CHARS, log_refused, new_request_id
from router.settings import Network, Settings, SettingsError


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


@dataclass(frozen=True)
class Limits:
    """What one connection may take: bytes of request line and headers, and time for them and a body."""

    header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    connections: int
    client_connections: int = 1 << 62
    proxies: tuple[Network, ...] = ()
    header_fields: int = 100
    # SHARDLB_ACCESS_LOG: a request refused here has no access line, so its refusal line is its
    # only trace, and is logged each time rather than a line a minute (router/middleware.py).
    access_log: bool = False


@functools.cache
def limits() -> Limits:
    """The limits of this process, from SHARDLB_* (checked by ``shardlb serve`` before any worker)."""
    try:
        settings = Settings.from_env()
    except SettingsError:  # not under `shardlb serve` (a test's own uvicorn): the defaults
        settings = Settings()
    return Limits(
        settings.max_header_bytes,
        settings.header_timeout_s,
        settings.body_timeout_s,
        settings.max_connections,
        settings.max_client_connections,
        settings.trusted_proxies,
        settings.max_header_fields,
        settings.access_log,
    )


PIPELINE_MAX = 32  # requests of one connection read ahead of their answers, at most
# A request target's bytes, at most: three ids and a moderation reason of 500 characters, every byte
# escaped, take about 6.5 KiB.
TARGET_BYTES = 8 * 1024
REFUSALS_LOG_EVERY_S = 60.0
log = logging.getLogger("shardlb.router")


class Refusals:
    """Connections refused over a cap: each counted, logged as one warning a minute at most."""

    def __init__(self, message: str = "connections refused") -> None:
        self.message = message
        self.unlogged = 0
        self.logged_at: float | None = None

    def refused(self, limit: int) -> None:
        metrics.CONNECTIONS_REFUSED.inc()
        self.unlogged += 1
        now = time.monotonic()
        if self.logged_at is not None and now - self.logged_at < REFUSALS_LOG_EVERY_S:
            return
        fields: dict[str, float] = {"limit": limit, "refused": self.unlogged}
        if self.logged_at is not None:
            fields["since_s"] = round(now - self.logged_at, 1)
        log.warning(self.message, extra={"fields": fields})
        self.unlogged, self.logged_at = 0, now


_refusals = Refusals()
_client_refusals = Refusals("connections refused for one client")
# Connections open per client (``client_network``) in this worker, those of trusted proxies left out.
_clients: dict[str, int] = {}
# A request's scope["state"] entry: its connection's ``draining`` (``drain_begun``).
DRAINING = "shardlb.draining"


def drain_begun(scope: MutableMapping[str, Any]) -> bool:
    """Whether the server of this request's connection has begun its drain (SIGTERM: ``shutdown``).
    For a request that waits on something outside the router (the reshard POST's wait for a mover
    elsewhere, router/admin.py): it answers what it knows then, where the drain's end
    (SHARDLB_DRAIN_SECONDS) would cancel it (503 ``shutting_down``), and holds the drain no longer
    than its own work. False for a request served otherwise (a test's ASGI transport)."""
    draining = scope.get("state", {}).get(DRAINING)
    return draining is not None and bool(draining())


# Where a connection is: connected and silent, in a request's head, in its body, or between requests
# (an answer under way, or idle: uvicorn's keep-alive timeout closes it then).
_SILENT, _HEAD, _BODY, _BETWEEN = range(4)


class HttpToolsProtocol(_UvicornHttpTools):
    """uvicorn's httptools protocol writing through a ``CoalescingTransport``, with a cap on the
    bytes of a request's head and deadlines for its head and its body (see the module)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits()
        self._phase = _SILENT
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # of the request head being read
        self._fields = 0  # header fields of the request being read, its trailers included
        self._stopped: ApiError | None = None  # why a callback stopped the parser (on_url, on_header)
        self._body_raw = self._body_bytes = 0  # bytes read in the body phase, and of them the body
        self._refused = False  # answered and closing: whatever else comes is dropped
        self._counted_as: str | None = None  # the client this connection counts for (``_clients``)
        self._unread: asyncio.TimerHandle | None = None  # the deadline of a write the client blocks
        self._switching = False  # a request asked to switch protocols: what follows is not read
        self._draining = False  # the server is stopping: the next request read is the last

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))
        if len(self.connections) > self.limits.connections:
            self._refused = True
            self.transport.close()
            _refusals.refused(self.limits.connections)
            return
        host = self.client[0] if self.client else None
        if host is not None and not trusted(host, self.limits.proxies):
            client = client_network(host)
            held = _clients.get(client, 0)
            if held >= self.limits.client_connections:
                self._refused = True
                self.transport.close()
                _client_refusals.refused(self.limits.client_connections)
                return
            _clients[client] = held + 1
            self._counted_as = client
        self._expect(_SILENT, self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None
        client, self._counted_as = self._counted_as, None
        if client is not None:
            left = _clients[client] - 1
            if left:
                _clients[client] = left
            else:
                del _clients[client]

    def shutdown(self) -> None:
        """The server's drain (SIGTERM) begins. uvicorn closed a connection between two requests at
        once, and one in the middle of a request's head: a request on its way, or half sent, met a
        closed connection (or a reset) and no answer. Here the request under way, or the next one
        read, is answered with ``connection: close`` and the connection closed after it; one that
        stays idle is closed by the keep-alive timeout (or the head deadline, if nothing came yet)
        as at any other time, and the server's drain waits for it."""
        self._draining = True
        cycle = self.cycle
        if self._phase != _HEAD and cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False  # the newest request read (a pipelined one, if any)

    def _drains(self) -> bool:
        return self._draining

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread is None:
            self._unread = self.loop.call_later(self.limits.body_timeout_s, self._not_read)

    def resume_writing(self) -> None:
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None
        super().resume_writing()

    def _not_read(self) -> None:
        """The client read too little of its answers for a deadline: aborted (closing would wait
        to send what it does not read); the answer under way sees the client gone."""
        self._unread = None
        self._refused = True
        self.transport.abort()

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol's own type
        """The client's end of stream (a half-close) says only that no more requests come: the ones
        read whole are answered, then the connection closed (uvicorn closed it at once, their answers
        unsent). Inside a request, or with nothing left to answer, it is closed now; an app waiting
        for a body sees the client gone."""
        cycle = self.cycle
        if self._refused or self._phase != _BETWEEN or cycle is None or cycle.response_complete:
            return None
        cycle.keep_alive = False  # the last request read: the connection closes after its answer
        return True

    def data_received(self, data: bytes) -> None:
        if self._refused or self._switching:
            return
        if self._phase == _BODY:
            self._body_raw += len(data)
            super().data_received(data)
            # What the body phase took beyond the body itself (chunk framing, trailers) counts as
            # head: trailers are kept like headers (uvicorn appends them), and nothing else bounded
            # them. Only while the request is still in its body: once it is complete, the rest of
            # this read was the next request's, counted as its head.
            if (
                self._phase == _BODY
                and self._body_raw - self._body_bytes > self.limits.header_bytes
                and not self._refused
            ):
                self._overflow()
            return
        if self._phase == _BETWEEN and (self.cycle is None or self.cycle.response_complete):
            # Bytes between requests that begin none (llhttp skips line ends there) stop uvicorn's
            # keep-alive timer: the next request's head deadline starts with them.
            self._expect(_HEAD, self.limits.header_timeout_s)
        cap = self.limits.header_bytes
        room = cap - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # Only what fits reaches the parser: if the head ends within it (on_headers_complete starts
        # the count again), the rest is the body or the next request; else the head is too large.
        self._head_bytes = cap
        super().data_received(data[:room])
        if self._refused or self.transport.is_closing():
            return
        if self._head_bytes < cap:
            self.data_received(data[room:])
        else:
            self._refuse(headers_too_large(cap))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._fields = 0
        if self._phase == _SILENT:  # the first request: its deadline runs from the connection's start
            self._phase = _HEAD
        else:
            self._expect(_HEAD, self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > TARGET_BYTES:
            self._stop(ApiError(414, "uri_too_long", f"the request target passed {TARGET_BYTES} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.limits.header_fields:
            self._stop(header_fields_too_many(self.limits.header_fields))
        super().on_header(name, value)

    def _stop(self, error: ApiError) -> None:
        """Stop the parser where it is, the rest of the head never parsed: an exception in its
        callback does it. uvicorn takes it for a malformed request and calls ``send_400_response``,
        which answers ``error``."""
        self._stopped = error
        raise _Stopped(error.message)

    def on_headers_complete(self) -> None:
        if not self.parser.should_upgrade():
            super().on_headers_complete()
        else:
            # The request asks to switch protocols (or is a CONNECT). llhttp hands everything after
            # its head to the other protocol: it reads no body of it, and bytes fed after that would
            # be parsed as a new request (a request smuggled in another's body). None is read
            # (``data_received``); the request is answered as if it had not asked, then the
            # connection closed. With a body, the app would see none: refused before it runs.
            self._switching = True
            if _has_body(self.headers):
                app, self.app = self.app, functools.partial(self._refusal, _SWITCH_WITH_BODY)
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
            else:
                super().on_headers_complete()
            self.cycle.keep_alive = False
        if self._draining:
            self.cycle.keep_alive = False
        self.cycle.scope["state"][DRAINING] = self._drains
        if self.expect_100_continue:
            # The cycle's class is uvicorn's (the module makes it by name): its send is wrapped here.
            cycle = self.cycle
            cycle.send = functools.partial(_send_after_expect, cycle, cycle.send)  # type: ignore[method-assign]
        self._head_bytes = self._body_raw = self._body_bytes = 0
        if len(self.pipeline) > PIPELINE_MAX:
            # Requests read ahead of their answers (pipelined) each hold a request cycle, and
            # uvicorn bounds their number nowhere: a client that never reads its answers is cut off.
            self._refused = True
            self.transport.close()
            return
        self._expect(_BODY, self.limits.body_timeout_s)

    def _should_upgrade(self) -> bool:
        """Never: uvicorn would hand a WebSocket handshake to its WebSocket protocol (websockets is
        installed), past every bound of this class, and this connection's count for its client
        (SHARDLB_MAX_CLIENT_CONNECTIONS) would never be given back: its ``connection_lost`` is that
        protocol's. The router serves no WebSocket (``on_headers_complete``)."""
        return False

    def _unsupported_upgrade_warning(self) -> None:
        """Nothing to warn of: the request is answered (``on_headers_complete``), and a warning line
        per request would let anybody flood the log."""

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def _overflow(self) -> None:
        """Trailers past the head cap: 431 while no answer has begun, then the connection closed."""
        self._cut_body(headers_too_large(self.limits.header_bytes))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _BETWEEN

    def _expect(self, phase: int, timeout_s: float) -> None:
        """Enter ``phase`` with ``timeout_s`` to leave it. The timer is set again only when none is
        or it would fire after this deadline (a body deadline shorter than the head's, or the
        reverse); one that fires early sets itself for the rest (``_expired``)."""
        self._phase = phase
        self._deadline = deadline = self.loop.time() + timeout_s
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self._phase == _BETWEEN or self._refused or self.transport.is_closing():
            return
        if self._phase == _BODY and self.pipeline:
            # A pipelined request is read only once the answers before it are sent: that wait is
            # the router's, not the client's.
            self._deadline = self.loop.time() + self.limits.body_timeout_s
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._expired)
        elif self._phase == _SILENT:
            self._refused = True
            self.transport.close()
        elif self._phase == _HEAD:
            self._refuse(request_timeout("line and headers", self.limits.header_timeout_s))
        else:
            self._body_late()

    def _refuse(self, error: ApiError) -> None:
        """Answer ``error`` to a request whose head was refused, and close the connection."""
        self._refused = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # An answer to an earlier request is under way: it is sent, then the connection closed.
            cycle.keep_alive = False
            self.flow.pause_reading()
            return
        request_id = new_request_id()
        url = getattr(self, "url", None)
        url = url[:LOGGED_PATH_CHARS].decode("latin-1") if isinstance(url, bytes) else ""
        log_refused(error, request_id, "", url, self.limits.access_log)
        self.transport.write(self._answer(error, self.headers or [], request_id))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """What llhttp cannot parse (a control character in the path, a Content-Length that is not a
        number, a space in a header's name) gets the API's error body, not uvicorn's plain text.
        A body's framing (a chunk size, an unknown transfer coding) fails after its head was read:
        the request's app is waiting for that body, so the request is ended as a late body is.
        A callback that stopped the parser (``_stop``: a target too long, too many header fields
        or trailers) gives its own error, 414 or 431."""
        error = self._stopped or ApiError(400, "malformed_request", "the request is not valid HTTP/1.1")
        if self._phase == _BODY:
            self._cut_body(error)
        else:
            self._refuse(error)

    def _body_late(self) -> None:
        """The body did not arrive in time: 408 unless the app has begun its answer; then close."""
        self._cut_body(request_timeout("body", self.limits.body_timeout_s))

    def _cut_body(self, error: ApiError) -> None:
        """End a request in its body phase: ``error`` unless the app has begun its answer; then close.
        A pipelined request waiting for the answers before it gets ``error`` in its turn instead of
        its app: written now, it would go out ahead of them, as their answer."""
        self._refused = True
        cycle = self.cycle
        if self.pipeline and self.pipeline[0][0] is cycle:
            self.pipeline[0] = (cycle, functools.partial(self._refusal, error))
            return
        if not cycle.response_started:
            state = cycle.scope["state"]
            state[TIMED_OUT] = error  # for the access middleware's log line and metrics
            request_id = state.get("request_id") or new_request_id()
            self.transport.write(self._answer(error, cycle.scope["headers"], request_id))
            # The app, waiting for the body, sees the client gone; whatever it answers is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    async def _refusal(self, error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        """The app of a pipelined request refused in its body phase: ``error``, then the close."""
        request_id = new_request_id()
        log_refused(error, request_id, scope["method"], scope["path"], self.limits.access_log)
        status, headers, body = _rendered(error, scope["headers"])
        headers += [(b"x-request-id", request_id.encode()), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _answer(self, error: ApiError, headers: Iterable[tuple[bytes, bytes]], request_id: str) -> bytes:
        status, extra, body = _rendered(error, headers)
        lines = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers, *extra]:
            lines += [name, b": ", value, b"\r\n"]
        lines += [b"x-request-id: ", request_id.encode(), b"\r\nconnection: close\r\n\r\n", body]
        return b"".join(lines)


class _Stopped(Exception):
    """A callback stopped the parser (``HttpToolsProtocol._stop``)."""


_SWITCH_WITH_BODY = ApiError(
    400,
    "malformed_request",
    "a request that asks to switch protocols (Upgrade) may not have a body: this server speaks HTTP/1.1 only",
)


async def _send_after_expect(
    cycle: RequestResponseCycle, send: Callable[[Any], Awaitable[None]], message: Message
) -> None:
    """``send`` of a request that asked for ``100 Continue``: an answer begun before its body was
    asked for (the app refused it on its head: a key, a media type, a declared length) closes the
    connection. The client may skip the body once it has a final answer (RFC 9110 10.1.1), or send
    it all the same: kept open, the connection would read its next request as that body, or that
    body as a request."""
    if message["type"] == "http.response.start" and cycle.waiting_for_100_continue and cycle.more_body:
        cycle.keep_alive = False
    await send(message)


def _has_body(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's head announces a body (as llhttp reads it: chunked, or a length past 0)."""
    return any(
        name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" \t0"))
        for name, value in headers
    )


def _rendered(error: ApiError, headers: Iterable[tuple[bytes, bytes]]) -> tuple[int, RawHeaders, bytes]:
    """``error`` rendered in the format the request's (first) Accept header asks for."""
    accept = next((value for name, value in headers if name == b"accept"), None)
    return rendered_error(error, accept is not None and wants_msgpack(accept.decode("latin-1")))
