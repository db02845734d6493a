"""The router's own query-string split (``params.pairs``) against Starlette's ``QueryParams``: the
same (name, value) pairs in the same order for any query string, the fast split's and the
unquoting ones alike."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import QueryParams
from starlette.requests import Request

from router import dashboard, params, routes
from tests.router_support import calls_made

# The characters that matter to a split (& = ; % +), some that do not, and bytes past ASCII.
ALPHABET = b"&=;%+ab1 \xe9"
QUERY_BYTES = st.binary(max_size=60).map(lambda b: bytes(ALPHABET[x % len(ALPHABET)] for x in b))


@given(QUERY_BYTES)
def test_pairs_are_starlettes(raw: bytes) -> None:
    assert params.pairs(raw) == QueryParams(raw).multi_items()


@given(QUERY_BYTES, st.integers(min_value=1, max_value=8))
def test_the_first_pairs_are_starlettes_first(raw: bytes, most: int) -> None:
    assert params.pairs(raw, most) == QueryParams(raw).multi_items()[:most]


def test_examples() -> None:
    assert params.pairs(b"max_age_ms=1000") == [("max_age_ms", "1000")]
    assert params.pairs(b"period=daily&&region=eu&flag") == [
        ("period", "daily"),
        ("region", "eu"),
        ("flag", ""),
    ]
    assert params.pairs(b"a=x%20y&b=1+2") == [("a", "x y"), ("b", "1 2")]  # unquoted as Starlette does
    assert params.pairs(b"=v&a==b") == QueryParams(b"=v&a==b").multi_items()


def _route(query: bytes) -> None:
    """A read's parameters (``GET .../top`` takes these two and more)."""
    routes._query(_request(query), "limit", "period")


def _dashboard(query: bytes) -> None:
    """The dashboard's page, which takes none and needs no key (it awaits nothing: run without a loop)."""
    with contextlib.suppress(StopIteration):
        dashboard.page(_request(query)).send(None)


def _request(query: bytes) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "query_string": query, "headers": []})


@pytest.mark.parametrize("read", [_route, _dashboard])
@pytest.mark.parametrize(
    "query",
    [b"a=%41&" * 10_000, b"a&" * 30_000, b"x=1+2&" * 10_000, b"limit=1&" * 8_000],
    ids=["escaped", "bare", "plus", "repeated"],
)
def test_a_long_query_string_is_read_up_to_its_first_refused_parameter(
    read: Callable[[bytes], None], query: bytes
) -> None:
    """60 KiB of query string hold 10,000 parameters, and every one was split and unquoted before
    the first was refused: 20-30 ms of a worker's CPU a request (200 cached tops), on the dashboard
    with no key and no read budget, on a read after its one token. A route that takes n parameters
    finds the first it refuses among the first n + 1, and reads no more."""
    ordinary = calls_made(lambda: read(b"a=%41"))  # first: urllib makes its table of escapes once
    assert calls_made(lambda: read(query)) < ordinary + 200  # all 10,000 read: 16,000 and more
