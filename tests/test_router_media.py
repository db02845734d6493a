"""router/media.py: Accept negotiation and the bounds MessagePack bodies are decoded with."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from starlette.requests import Request

from router import hot, media
from router.errors import ApiError
from router.media import ACCEPT_RANGES, wants_msgpack
from tests.router_support import calls_made


@pytest.mark.parametrize(
    ("accept", "packed"),
    [
        (None, False),
        ("", False),
        ("application/json", False),
        ("*/*", False),
        ("application/msgpack", True),
        ("application/x-msgpack", True),
        ("application/json, application/msgpack", False),
        ("application/json;q=0.5, application/msgpack", True),
        ("application/msgpack;q=0.9, */*;q=0.1", True),
        ("application/msgpack;q=0", False),
        ("text/html", False),
    ],
)
def test_accept_negotiation(accept: str | None, packed: bool) -> None:
    assert wants_msgpack(accept) is packed


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"host", b"router")],
        [(b"accept", b"application/msgpack"), (b"accept", b"application/json")],
        [(b"authorization", b"Bearer k\xe9y"), (b"accept", b"*/*")],
    ],
)
def test_a_header_read_off_the_scope_is_what_starlette_reads(headers: list[tuple[bytes, bytes]]) -> None:
    """``media.header`` (the hot reads' Accept and key) answers as ``request.headers.get`` does: the
    first of a repeated header, latin-1, None when absent."""
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": headers})
    for name in ("accept", "authorization", "host", "content-type"):
        assert media.header(request, name.encode()) == request.headers.get(name)


def test_accept_is_read_up_to_its_first_ranges() -> None:
    """An Accept header of thousands of media ranges (64 KiB of them fit in a request's head) cost
    3-6 ms to read whole, a hundred ordinary requests' CPU, and every request reads it before any
    limit applies: only the first ACCEPT_RANGES are read, more than any client sends."""
    filler = ", ".join(["text/plain;q=0.1"] * (ACCEPT_RANGES - 1))
    assert wants_msgpack(f"{filler}, application/msgpack") is True  # within the first ranges
    assert wants_msgpack(f"{filler}, application/json;q=0.1, application/msgpack") is False
    assert wants_msgpack("application/json;q=0.1, " * 4000 + "application/msgpack") is False
    assert wants_msgpack("application/msgpack, " + "x/y, " * 4000) is True


HEAD_VALUE = 60_000  # characters of one header's value that 64 KiB of head hold


@pytest.mark.parametrize(
    "work",
    [
        pytest.param(lambda n: wants_msgpack("application/json" + ";" * n), id="accept-parameters"),
        pytest.param(lambda n: hot.matches(",*" * (n // 2), '"tag"'), id="if-none-match-star"),
        pytest.param(lambda n: hot.matches('"tag",' * (n // 6), '"tag"'), id="if-none-match-tags"),
        pytest.param(
            lambda n: media.check_body_head(media.JSON, ["," * n], None, 1024), id="content-encoding"
        ),
        pytest.param(
            lambda n: media.check_body_head(media.JSON, ["identity," * (n // 9)], None, 1024),
            id="content-encoding-identity",
        ),
        pytest.param(
            lambda n: media.check_body_head(media.JSON, [], None, 1024, ["," * n + "chunked"]),
            id="transfer-encoding",
        ),
    ],
)
def test_a_long_header_value_is_read_in_a_few_pieces(work: Any) -> None:
    """What a client sends in one header line, read on every request (Accept, If-None-Match of a
    top) or on public bodies' (Content-Encoding, Transfer-Encoding of a players:query), was split
    into every piece it held, each stripped and compared: 60,000 semicolons of an Accept took 12 ms
    of a worker's CPU a request, before any limit applied, where the 16 media ranges read had no
    bound on their parameters. Each is read in a bounded number of pieces now, whatever its length."""
    ordinary = calls_made(lambda: work(10))
    assert calls_made(lambda: work(HEAD_VALUE)) < ordinary + 100


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


@pytest.mark.parametrize(
    "body",
    [
        b'{"scores": [{"player_id": "p", "points": 5, "points": 2000000, "match_id": "m"}]}',
        b'{"mode": "incr", "mode": "best"}',
        b'{"player_ids": ["a"], "player_ids": []}',
        b'{"a": {"b": 1, "b" : 1}}',
        # Compact, as a body encoded again is: only a body that IS its encoding again skips the count.
        b'{"mode":"best","mode":"best"}',
        b'{"scores":[{"player_id":"p","points":5,"match_id":"m","points":5}]}',
        # An escaped colon in a string must not hide a repeated key from a count of colons.
        b'{"scores": [{"player_id": "p\\u003a", "points": 5, "points": 7, "match_id": "m"}]}',
    ],
)
def test_a_json_object_that_repeats_a_key_is_400(body: bytes) -> None:
    """Before, the last of a repeated key won (an API audit's finding): a proxy or validator that
    reads the first one sees another request than the one applied."""
    with pytest.raises(ApiError) as e:
        media.decode(body, "application/json")
    assert (e.value.status, e.value.code) == (400, "malformed_body")
    assert "repeats" in e.value.message


@pytest.mark.parametrize(
    "pairs",
    [
        [("mode", "incr"), ("mode", "best")],
        [("points", 5.0), ("points", 7.0)],  # float64
        [("a", {"x": 1}), ("b", 2), ("a", {"x": 1})],
    ],
)
def test_a_msgpack_map_that_repeats_a_key_is_400(pairs: list[tuple[str, Any]]) -> None:
    packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack_map_header(len(pairs)) + b"".join(packer.pack(k) + packer.pack(v) for k, v in pairs)
    with pytest.raises(ApiError) as e:
        media.decode(body, "application/msgpack")
    assert (e.value.status, e.value.code) == (400, "malformed_body")


def test_a_msgpack_float32_cannot_hide_a_repeated_key() -> None:
    """A float32 is 4 bytes shorter than the float64 the body would be packed again with: enough to
    make a body with a repeated key as long as the same body packed without it."""
    packer = msgpack.Packer(use_bin_type=True, use_single_float=True)
    pairs = [("p", 1.5), ("q", 2.5), ("r", 3.5), ("k", 1), ("k", 1)]
    body = packer.pack_map_header(len(pairs)) + b"".join(packer.pack(k) + packer.pack(v) for k, v in pairs)
    with pytest.raises(ApiError) as e:
        media.decode(body, "application/msgpack")
    assert (e.value.status, e.value.code) == (400, "malformed_body")


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b'{"a": "x:y", "b": {"c": "1:2:3"}, "d": ["e:f"]}', "application/json"),
        (b'{"a": "\\u003a", "b": "\\"quoted\\" : colon"}', "application/json"),
        (bytes(msgpack.packb({"a": 1.5, "b": {"a": 2}, "c": [{"a": 1}, {"a": 2}]})), "application/msgpack"),
        (bytes(msgpack.Packer(use_single_float=True).pack({"a": 1.5, "b": "\xca"})), "application/msgpack"),
    ],
)
def test_the_same_key_in_different_objects_is_not_a_repeat(body: bytes, kind: str) -> None:
    assert isinstance(media.decode(body, kind), dict)


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"[" * 300 + b"]" * 300, "application/json"),
        (b'{"a":' * 300 + b"1" + b"}" * 300, "application/json"),
        (b"[" * 1000 + b"]" * 1000, "application/json"),
        (b"\x91" * 600 + b"\x01", "application/msgpack"),
        (b"\x81\xa1a" * 600 + b"\x01", "application/msgpack"),
    ],
)
def test_deep_bodies_are_decoded_or_400_never_an_exception(body: bytes, kind: str) -> None:
    """orjson encodes 254 levels at most: the check for repeated keys must not fail past that."""
    try:
        media.decode(body, kind)
    except ApiError as e:
        assert (e.status, e.code) == (400, "malformed_body")


@pytest.mark.parametrize("body", [b"\xc1", b"\x81\xa1a\xc1"])
def test_a_msgpack_body_with_a_reserved_byte_is_400_saying_why(body: bytes) -> None:
    """msgpack's error for the one byte that starts no value (0xc1) has no text: the message ended
    "not valid MessagePack: " with nothing after it (until 2026-12-06)."""
    with pytest.raises(ApiError) as e:
        media.decode(body, "application/msgpack")
    assert (e.value.status, e.value.code) == (400, "malformed_body")
    assert not e.value.message.rstrip().endswith(":"), e.value.message
