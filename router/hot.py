"""The cached top served from bytes: a repeat of a top-N query answered without being read again.

``routes.top`` renders each answer from the top cache once (JSON or MessagePack, with its ETag)
and remembers it here under the request's board id, raw query string and format. A GET of a
board's top that repeats such a query in the same wall-clock second is answered by ``HotTop``
straight from those bytes, as long as the board's cached settings are still the ones it was
rendered with and the top cache still holds the list of that moment (same ``as_of``): the
caller's key and read budget are checked, If-None-Match is compared, and nothing else is parsed,
resolved or looked up. Anything else (the first request of a second, a board changed or
resharded, a new refresh of the top, a settled period, a refused key, a query that is not a
plain repeat) goes to the full handler, which renders and remembers it again.

Why whole seconds: a query names its period relatively ("daily") and the day turns on a whole
second in every time zone in use, so a query resolved in one second names the same period for
the rest of that second. The answer is never staler than the top cache's own copy: it is that
copy, and its ``as_of`` says when it was read.
"""

from __future__ import annotations

import hashlib
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import ApiError
from router.media import RawHeaders, header, rendered_error, send_rendered, wants_msgpack
from shardlb.board import Board
from shardlb.reads import ResolvedView

if TYPE_CHECKING:
    from router.service import Service

KEPT = 4096
KEPT_BYTES = 32 * 1024 * 1024  # rendered bodies a worker keeps for repeats, whatever their sizes
CACHE_CONTROL = b"max-age=1"
# What a cacheable top carries besides its ETag: one URL answers JSON or MessagePack by Accept, so
# a cache in front (a CDN, a proxy, a client's) must keep the two apart. A 304 carries the same.
CACHE_HEADERS: RawHeaders = [(b"cache-control", CACHE_CONTROL), (b"vary", b"accept")]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Renderings(Generic[K, V]):
    """Rendered answers kept for repeats: at most ``count`` of them and ``size`` bytes of bodies in
    all, the first kept dropped first. Queries choose the keys (a limit of 1-1000, a format, a
    period, and any padding of the query string), so the bound in bytes, keys counted with bodies
    (``remember``), is what holds a worker's memory whatever callers ask: 4096 tops of 1000 entries
    would be about 400 MB, 4096 keys padded to the URL limit about 250 MB."""

    def __init__(self, count: int = KEPT, size: int = KEPT_BYTES) -> None:
        self.count = count
        self.size = size
        self.held = 0  # bytes of the bodies kept
        self._kept: dict[K, tuple[V, int]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: K) -> V | None:
        found = self._kept.get(key)
        return None if found is None else found[0]

    def put(self, key: K, value: V, size: int) -> None:
        old = self._kept.pop(key, None)
        if old is not None:
            self.held -= old[1]
        self._kept[key] = (value, size)
        self.held += size
        while len(self._kept) > self.count or (self.held > self.size and len(self._kept) > 1):
            first = next(iter(self._kept))
            self.held -= self._kept.pop(first)[1]


@dataclass(frozen=True, slots=True)
class Rendered:
    """One rendered answer and what it was rendered from."""

    second: int  # the wall-clock second its query was resolved in
    # The board it was rendered for, by weak reference: the board cache makes a new Board every few
    # seconds, each with its own caches of players read, and answers kept for queries nobody asks
    # again would otherwise keep thousands of old ones alive, outside the bound in bytes.
    board: weakref.ref[Board]
    view: ResolvedView
    as_of: int  # the top cache's copy it came from
    headers: RawHeaders
    body: bytes
    etag: bytes


_Key = tuple[str, bytes, bool]  # board id, raw query string, MessagePack
_kept: Renderings[_Key, Rendered] = Renderings()


def now_second() -> int:
    """The current wall-clock second (epoch seconds): what an answer's ``second`` is compared with."""
    return int(time.time())


def remember(board_id: str, query: bytes, packed: bool, answer: Rendered) -> None:
    """Keep ``answer`` for repeats of the same query (``Renderings``: the oldest dropped first). The
    key's bytes count with the body's: a caller chooses the query string, and can pad it."""
    _kept.put((board_id, query, packed), answer, len(answer.body) + len(query) + len(board_id))


# Entity tags of an If-None-Match read: a client sends the one it holds; 64 KiB of head hold 30,000.
ETAGS = 16


def matches(if_none_match: str | None, tag: str) -> bool:
    """RFC 9110 If-None-Match against the current ETag (weak comparison: W/ is ignored), among its
    first ETAGS entries (all of them, with a * among them, cost 1.5 ms a top until 2026-12-06)."""
    if if_none_match is None or (tag not in if_none_match and "*" not in if_none_match):
        return False  # no list element can match: not split (a long header costs a scan, no more)
    asked = [t.strip().removeprefix("W/") for t in if_none_match.split(",", ETAGS)[:ETAGS]]
    return tag in asked or "*" in asked


def etag(body: bytes) -> bytes:
    """The strong ETag of a rendered top: a 128-bit hash of its bytes. A 304 tells the client its
    copy is the current one, so two bodies must not share a tag: CRC-32 and the length, as before,
    let tops of one length collide one time in 2^32, and ids can be chosen to make them collide."""
    return b'"' + hashlib.blake2b(body, digest_size=16).hexdigest().encode() + b'"'


def not_modified(etag: bytes) -> tuple[int, RawHeaders, bytes]:
    return 304, [(b"etag", etag), *CACHE_HEADERS], b""


Admit = Callable[["Service", "str | None", str], None]


class HotTop:
    """``GET /v1/boards/{board}/top`` as an ASGI app: the remembered answer when it is still the
    current one (module docstring), else ``full``, the handler on the usual path."""

    def __init__(self, full: ASGIApp, admit: Admit) -> None:
        self.full = full
        self.admit = admit  # the key check and read budget of every read (routes.admit_read)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The first line of a repeated header, as on every other path (Starlette's headers.get).
        authorization = accept = if_none_match = None
        for name, value in scope["headers"]:
            if name == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif name == b"accept" and accept is None:
                accept = value.decode("latin-1")
            elif name == b"if-none-match" and if_none_match is None:
                if_none_match = value.decode("latin-1")
        packed = wants_msgpack(accept)
        svc = cast("Service", scope["app"].state.service)
        answer = _current(svc, scope["path_params"]["board"], scope["query_string"], packed)
        if answer is None:
            await self.full(scope, receive, send)
            return
        client = scope.get("client")
        try:
            self.admit(svc, authorization, client[0] if client else "unknown")
        except ApiError as error:
            scope.setdefault("state", {})["error"] = error  # for the access middleware's log line
            await send_rendered(send, rendered_error(error, packed))
            return
        if matches(if_none_match, answer.etag.decode()):
            await send_rendered(send, not_modified(answer.etag))
        else:
            await send_rendered(send, (200, answer.headers, answer.body))


def _current(svc: Service, board_id: str, query: bytes, packed: bool) -> Rendered | None:
    answer = _kept.get((board_id, query, packed))
    if answer is None or answer.second != now_second():
        return None
    board = svc.boards.cached(board_id)
    if board is None or board is not answer.board() or svc.tops.as_of(answer.view) != answer.as_of:
        return None
    return answer


def request_key(request: Request) -> tuple[bytes, bool]:
    """The raw query string and the format of ``request``, as ``HotTop`` keys it."""
    return request.scope["query_string"], wants_msgpack(header(request, b"accept"))
