"""The router's own query-string split (``params.pairs``) against Starlette's ``QueryParams``: the
same (name, value) pairs in the same order for any query string, the fast split's and the
unquoting ones alike."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import QueryParams

from router import params

# The characters that matter to a split (& = ; % +), some that do not, and bytes past ASCII.
ALPHABET = b"&=;%+ab1 \xe9"
QUERY_BYTES = st.binary(max_size=60).map(lambda b: bytes(ALPHABET[x % len(ALPHABET)] for x in b))


@given(QUERY_BYTES)
def test_pairs_are_starlettes(raw: bytes) -> None:
    assert params.pairs(raw) == QueryParams(raw).multi_items()


def test_examples() -> None:
    assert params.pairs(b"max_age_ms=1000") == [("max_age_ms", "1000")]
    assert params.pairs(b"period=daily&&region=eu&flag") == [
        ("period", "daily"),
        ("region", "eu"),
        ("flag", ""),
    ]
    assert params.pairs(b"a=x%20y&b=1+2") == [("a", "x y"), ("b", "1 2")]  # unquoted as Starlette does
    assert params.pairs(b"=v&a==b") == QueryParams(b"=v&a==b").multi_items()
