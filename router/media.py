"""Request and response bodies: JSON or MessagePack, by Content-Type in and by Accept out.

Responses are rendered by orjson or msgpack straight to bytes, in one place (``rendered``) for
Starlette's path and the raw ASGI paths alike. A request body is read with a byte cap (413 past it)
before it is decoded, so an oversized upload never reaches the parser. The cap is what
bounds the memory a decoded body takes: a byte of MessagePack can become a 64-byte empty dict, and
JSON's ``[],`` a 56-byte empty list (a MiB of either decodes to 20 to 70 MiB of objects). Public read
bodies therefore get their own small cap (SHARDLB_MAX_READ_BODY_BYTES), and MessagePack is decoded
with bounds on each container and string (``MSGPACK_LIMITS``): no single length prefix may ask for
more than a valid request holds.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Send

from router.errors import ApiError
from shardlb import times
from shardlb.board import Entry

JSON = "application/json"
MSGPACK = "application/msgpack"
# application/x-msgpack and vnd.msgpack are what older clients send for the same format.
_MSGPACK_TYPES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
_JSON_TYPES = frozenset({JSON, "application/*", "*/*"})
_JSON_BYTES, _MSGPACK_BYTES = JSON.encode(), MSGPACK.encode()
# What most clients send as Accept (HTTP libraries' default, or JSON asked for): JSON, not parsed.
_PLAIN_ACCEPTS = frozenset({JSON, "*/*"})
# The most a valid body holds: 1000 scores or player ids, 1024 regions of a board; five fields in a
# score (the room above lets an unknown field still be named by a 422); ids of 64 and match ids of
# 128 characters. Nothing valid is binary or an extension type but a MessagePack timestamp, which
# then gets its own 422 as a time.
MSGPACK_LIMITS: dict[str, int] = {
    "max_array_len": 1024,
    "max_map_len": 32,
    "max_str_len": 4096,
    "max_bin_len": 4096,
    "max_ext_len": 16,
}


# Media ranges of an Accept header read (a client sends a few; 64 KiB of head hold thousands), and
# parameters of each (a client sends a q, perhaps a charset; one range of 64 KiB holds 30,000).
ACCEPT_RANGES = 16
ACCEPT_PARAMS = 8
# Codings of a Content-Encoding or Transfer-Encoding line read: a line of more is refused whole.
CODINGS = 8


def header(request: Request, name: bytes) -> str | None:
    """The request's first ``name`` header (lower case, as the server hands names over), as
    ``request.headers.get`` reads it, read off the scope: Starlette's Headers would be made for it,
    and a header the request lacks (a "my rank" sent with no key or Accept, as most are) looked up
    through Mapping.get, which raises and catches a KeyError each time."""
    headers: RawHeaders = request.scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def wants_msgpack(accept: str | None) -> bool:
    """True when Accept prefers MessagePack over JSON (q-values honoured; JSON wins ties and absence),
    among its first ACCEPT_RANGES media ranges and their first ACCEPT_PARAMS parameters: reading
    thousands cost a hundred requests' CPU (ranges until 2026-12-05, parameters until 2026-12-06)."""
    if not accept or accept in _PLAIN_ACCEPTS:
        return False
    best_json = best_msgpack = -1.0
    for part in accept.split(",", ACCEPT_RANGES)[:ACCEPT_RANGES]:
        media, _, params = part.strip().partition(";")
        media = media.strip().lower()
        q = 1.0
        for param in params.split(";", ACCEPT_PARAMS)[:ACCEPT_PARAMS]:
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if media in _MSGPACK_TYPES:
            best_msgpack = max(best_msgpack, q)
        elif media in _JSON_TYPES or media.endswith("+json"):
            best_json = max(best_json, q)
    return best_msgpack > 0 and best_msgpack > best_json


def entry_body(entry: Entry) -> dict[str, Any]:
    """An entry as api.md spells it (``achieved_at`` in RFC 3339)."""
    return {
        "rank": entry.rank,
        "player_id": entry.player_id,
        "points": entry.points,
        "achieved_at": times.format_ms(entry.achieved_ms),
    }


RawHeaders = list[tuple[bytes, bytes]]


def rendered(
    data: Any, packed: bool, status: int = 200, headers: Mapping[str, str] | None = None
) -> tuple[int, RawHeaders, bytes]:
    """A response as ASGI sends it: status, headers (with Content-Type and Content-Length) and body.
    Every body the router sends is rendered here, on Starlette's path and on the raw ASGI ones."""
    return _framed(
        msgpack.packb(data, use_bin_type=True) if packed else orjson.dumps(data), packed, status, headers
    )


def _framed(
    body: bytes, packed: bool, status: int = 200, headers: Mapping[str, str] | None = None
) -> tuple[int, RawHeaders, bytes]:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()] if headers else []
    raw.append((b"content-length", str(len(body)).encode()))
    raw.append((b"content-type", _MSGPACK_BYTES if packed else _JSON_BYTES))
    return status, raw, body


def rendered_error(error: ApiError, packed: bool) -> tuple[int, RawHeaders, bytes]:
    """An error as api.md spells it: ``{"error": {"code", "message", "field"}}``, its status and headers."""
    return rendered(error.body(), packed, error.status, error.headers)


async def send_rendered(send: Send, response: tuple[int, RawHeaders, bytes]) -> None:
    """Send a rendered response on a raw ASGI path."""
    status, headers, body = response
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _response(parts: tuple[int, RawHeaders, bytes]) -> Response:
    status, headers, body = parts
    response = Response(body, status)
    response.raw_headers = headers  # already complete: Starlette's own would only repeat them
    return response


def render(request: Request, data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """``data`` rendered in the format the request's Accept header asks for."""
    return _response(rendered(data, wants_msgpack(header(request, b"accept")), status, headers))


@dataclass(frozen=True)
class Rendered:
    """A body rendered once in both formats, for an answer sent again and again (GET /v1/boards)."""

    json_bytes: bytes
    msgpack_bytes: bytes

    @classmethod
    def of(cls, data: Any) -> Rendered:
        return cls(orjson.dumps(data), msgpack.packb(data, use_bin_type=True))


def render_held(request: Request, body: Rendered) -> Response:
    """``body`` in the format the request's Accept header asks for, as ``render`` sends it."""
    packed = wants_msgpack(header(request, b"accept"))
    return _response(_framed(body.msgpack_bytes if packed else body.json_bytes, packed))


class Unchanging:
    """A body that does not change while the app runs (the OpenAPI document): each format rendered
    at the first request that asks for it, and sent from those bytes after, as ``render`` sends it."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self._bodies: dict[bool, bytes] = {}  # MessagePack or not -> the body

    def response(self, request: Request) -> Response:
        packed = wants_msgpack(header(request, b"accept"))
        body = self._bodies.get(packed)
        if body is None:
            body = self._bodies[packed] = rendered(self.data, packed)[2]
        return _response(_framed(body, packed))


def error_response(request: Request, error: ApiError) -> Response:
    """The error body; remembered in the request state so the access middleware can log it."""
    request.state.error = error
    return _response(rendered_error(error, wants_msgpack(header(request, b"accept"))))


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 once it passes ``limit`` bytes (declared or streamed), and
    refused on its head before any of it is read (``check_body_head``)."""
    headers = request.headers
    check_body_head(
        headers.get("content-type"),
        headers.getlist("content-encoding"),
        headers.get("content-length"),
        limit,
        headers.getlist("transfer-encoding"),
    )
    return await read_limited(request.stream(), limit)


def check_body_head(
    content_type: str | None,
    encodings: Iterable[str],
    declared: str | None,
    limit: int,
    transfer: Iterable[str] = (),
) -> None:
    """Refuse a body on what its request's head says of it, before any of it is read: a content
    or transfer coding (415), a media type (415) or a declared length past ``limit`` (413) the
    router does not take. The first read of the body sends ``100 Continue`` to a client that sent
    ``Expect: 100-continue``; a request refused here is answered without it, and its body is never
    sent (router/http.py closes the connection after such an answer)."""
    # The parser takes a chunked body's framing off and leaves any other transfer coding before it
    # (``gzip, chunked``) in the bytes: read as they came, they would be a malformed body at best,
    # or applied as sent when the coding changed nothing. RFC 9112 6.1 has 501 for a transfer
    # coding the server does not know; a 4xx, as for a content coding, tells the client the fault
    # is its request, and that a retry of it fails alike.
    # Most requests name no coding: they pay for a test of each, not for a call.
    unread = transfer and _not_taken(transfer, ("", "chunked"))
    if unread:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send the body with a Content-Length or chunked: Transfer-Encoding {', '.join(unread)} "
            "is not accepted",
        )
    coded = encodings and _not_taken(encodings, ("", "identity"))
    if coded:
        # A body is decoded as it came: a compressed one would be a malformed JSON or MessagePack
        # body (400) at best. api.md has bodies uncompressed; RFC 9110 15.5.16 says 415 and which
        # codings are taken.
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send the body uncompressed: Content-Encoding {', '.join(coded)} is not accepted",
            headers={"Accept-Encoding": "identity"},
        )
    media_type(content_type)
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)


def _not_taken(lines: Iterable[str], taken: tuple[str, ...]) -> list[str]:
    """The codings a header's ``lines`` name that are not ``taken``. A line is split in CODINGS + 1
    pieces at most, the last the rest of it, refused unless it is one coding taken: nobody sends so
    many, and a line of 60,000 commas was 60,000 pieces to strip and compare (until 2026-12-06)."""
    return [c for v in lines for c in map(str.strip, v.split(",", CODINGS)) if c.lower() not in taken]


async def read_limited(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """Join a body's chunks; 413 as soon as the bytes so far pass ``limit``."""
    parts = []
    size = 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
    except ClientDisconnect as e:  # nobody will read the answer; keep it out of the 5xx logs
        raise ApiError(400, "malformed_body", "the client closed the connection before the body ended") from e
    return b"".join(parts)


def whole_body(body: bytes, limit: int) -> bytes:
    """A body that came in one message, refused with 413 as ``read_limited`` would refuse it."""
    if len(body) > limit:
        raise _too_large(limit)
    return body


def _too_large(limit: int) -> ApiError:
    return ApiError(413, "body_too_large", f"the request body is larger than {limit} bytes")


# Where router/http.py leaves, in the request's state, the 408 it answered itself for a body that did
# not arrive in time: the access middleware logs and counts that answer, not what the app made of
# the disconnect that followed.
TIMED_OUT = "timed_out"


def request_timeout(what: str, seconds: float) -> ApiError:
    """408: the request's ``what`` did not arrive within ``seconds`` (router/http.py)."""
    return ApiError(408, "request_timeout", f"the request {what} did not arrive within {seconds:g} s")


def headers_too_large(limit: int) -> ApiError:
    """431: the request line and headers passed ``limit`` bytes (router/http.py)."""
    return ApiError(431, "headers_too_large", f"the request line and headers are larger than {limit} bytes")


def header_fields_too_many(limit: int) -> ApiError:
    """431: the request's header fields (with a chunked body's trailers) passed ``limit`` (router/http.py)."""
    return ApiError(431, "headers_too_large", f"the request has more than {limit} header fields")


def media_type(content_type: str | None) -> str:
    """The media type of a request's ``content_type``: JSON when absent, 415 when it is neither
    JSON nor MessagePack."""
    if content_type is None or content_type == JSON:  # what most bodies are sent as: nothing to parse
        return JSON
    media = (content_type or JSON).partition(";")[0].strip().lower()
    if media not in _MSGPACK_TYPES and media != JSON and not media.endswith("+json"):
        raise ApiError(
            415, "unsupported_media_type", f"send {JSON} or {MSGPACK}, not {media or 'an empty Content-Type'}"
        )
    return media


def decode(body: bytes, content_type: str | None, empty: Any = None) -> Any:
    """Decode a request body by its Content-Type: 415 for other types, 400 when it does not parse.

    A missing Content-Type is read as JSON (curl-friendly); an empty body is ``empty`` when given.
    """
    media = media_type(content_type)
    if not body.strip() and empty is not None:
        return empty
    packed = media in _MSGPACK_TYPES
    try:
        if packed:
            data = msgpack.unpackb(body, raw=False, strict_map_key=True, **MSGPACK_LIMITS)
        else:
            data = orjson.loads(body)
    except Exception as e:  # only decoding is inside the try: any failure is a malformed body
        kind = "MessagePack" if packed else "JSON"
        # msgpack says nothing of the byte that starts no value (0xc1): its error has no text.
        why = str(e) or "a byte that starts no value"
        raise ApiError(400, "malformed_body", f"the body is not valid {kind}: {why}") from e
    if _may_repeat_a_key(body, data, packed):
        _refuse_repeated_keys(body, packed)
    return data


def _may_repeat_a_key(body: bytes, data: Any, packed: bool) -> bool:
    """False when no object of ``body`` can repeat a key (both decoders keep the last of a repeated
    key without a word, so a proxy reading the first sees another request than the one applied).

    Checked without decoding again, as the common case must be cheap: JSON has a colon for each
    key and none elsewhere outside strings, so a body with a repeated key has more colons than
    ``data`` encoded again, unless an escape (``\\u003a``) hides one. MessagePack packed again with
    the shortest forms is as long as the body unless the body repeats a key (longer) or carries a
    float32 (shorter: ``0xca``, the byte that begins one).

    A JSON body that is ``data`` encoded again byte for byte (compact JSON, as orjson and
    JavaScript's JSON.stringify write it) repeats no key: that comparison is a memcmp, where the
    search for an escape and the two counts walk the body three times (a third of a 10-match
    post's decoding)."""
    try:
        if packed:
            return b"\xca" in body or len(msgpack.packb(data, use_bin_type=True)) != len(body)
        again = orjson.dumps(data)
        return again != body and (b"\\u" in body or body.count(b":") != again.count(b":"))
    except (TypeError, ValueError):  # nested deeper than the encoders go: decode again to know
        return True


def _refuse_repeated_keys(body: bytes, packed: bool) -> None:
    """Decode again, object by object: 400 naming the first key an object repeats."""

    def pairs(items: list[tuple[Any, Any]]) -> dict[Any, Any]:
        found: dict[Any, Any] = {}
        for key, value in items:
            if key in found:
                raise ApiError(400, "malformed_body", f"the body repeats the key {key!r} in one object")
            found[key] = value
        return found

    try:
        if packed:
            msgpack.unpackb(body, raw=False, strict_map_key=True, object_pairs_hook=pairs, **MSGPACK_LIMITS)
        else:
            json.loads(body, object_pairs_hook=pairs)
    except RecursionError as e:  # deeper than the parameters' own bound (params.MAX_DEPTH) refuses
        raise ApiError(400, "malformed_body", "the body nests too deeply") from e


async def read_object(request: Request, limit: int, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """Read, cap and decode a body that must be a JSON/MessagePack object (map)."""
    return decode_object(await read_body(request, limit), request.headers.get("content-type"), empty)


def decode_object(
    body: bytes, content_type: str | None, empty: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Decode a body that must be an object (map): 422 ``invalid_body`` for any other value."""
    data = decode(body, content_type, empty)
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_body", "the body must be an object")
    return data
