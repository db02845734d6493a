"""router/media.py: Accept negotiation and the bounds MessagePack bodies are decoded with."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from router import media
from router.errors import ApiError
from router.media import wants_msgpack


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
