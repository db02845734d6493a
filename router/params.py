"""Query parameters: the names each route takes, and strict integers and flags.

Nothing a request names is ignored: a parameter a route does not take, or one given twice, is 400
(a typo such as ``regoin=eu`` would otherwise quietly return the global board). Numbers are ASCII
digits only: Python's ``int()`` also takes "٣", "1_0" and " 5", which no client means and the OpenAPI
document does not allow.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl

from router.errors import ApiError
from shardlb.errors import InvalidInput

_INTEGER = re.compile(r"-?[0-9]+", re.ASCII)
_PART = re.compile(r"[^&]+")  # a parameter of a query string (parse_qsl skips empty ones)
_FLAGS = {"true": True, "false": False, "1": True, "0": False}
MAX_DEPTH = 32  # lists and maps in a body's value (``integral``); the API's deepest bodies nest 4


def query(query_string: bytes, allowed: frozenset[str]) -> dict[str, str]:
    """The parameters of a request's raw ``query_string`` by name, when they are all ``allowed``
    (400 naming the first that is not, or that is given again: ``checked``). Every route reads its
    query string here. Only its first ``len(allowed) + 1`` parameters are read: among them are
    the route's every parameter, or the first it refuses. 60 KiB of query string hold 10,000
    parameters, and reading them all before the first was refused (Starlette's ``query_params``)
    cost 20-30 ms of a worker's CPU a request, 200 cached tops, on the dashboard with no key and
    no read budget (until 2026-12-06)."""
    if not query_string:  # most reads have none: nothing to parse
        return {}
    return checked(pairs(query_string, len(allowed) + 1), allowed)


def pairs(query_string: bytes, most: int | None = None) -> list[tuple[str, str]]:
    """A query string's (name, value) pairs, as Starlette's ``request.query_params`` reads them
    (``parse_qsl`` with blank values kept, on the bytes decoded as Latin-1), the first ``most`` of
    them when given (the rest is not looked at). Without ``%`` or ``+`` there is nothing to
    unquote, and a split is all it takes: the usual hot read's ``?period=...`` or
    ``?max_age_ms=...`` costs a few microseconds less than through ``parse_qsl``."""
    text = query_string.decode("latin-1")
    if most is not None:
        # The first ``most`` non-empty parts, found by the regex engine: runs of "&" cost no turn
        # of a Python loop, and a part left unread no split at all.
        text = "&".join(part[0] for part in itertools.islice(_PART.finditer(text), most))
    if "%" in text or "+" in text:
        return parse_qsl(text, keep_blank_values=True)
    return [(name, value) for name, _, value in (part.partition("=") for part in text.split("&") if part)]


def checked(pairs: Iterable[tuple[str, str]], allowed: frozenset[str]) -> dict[str, str]:
    """The query's parameters by name; 400 naming the first one not ``allowed`` or given twice."""
    found: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            raise ApiError(400, "unknown_parameter", f"this route takes no query parameter {name!r}", name)
        if name in found:
            raise ApiError(400, "repeated_parameter", f"the query parameter {name!r} is given twice", name)
        found[name] = value
    return found


def integer(params: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    # Past 19 digits it is out of every range (and int() refuses strings of thousands of digits).
    value = int(raw) if len(raw) <= 20 and _INTEGER.fullmatch(raw) else lo - 1
    if not lo <= value <= hi:
        raise InvalidInput(f"{name} must be an integer from {lo} to {hi}", name, "invalid_parameter")
    return value


def flag(params: Mapping[str, str], name: str) -> bool:
    raw = params.get(name, "false").lower()
    if raw not in _FLAGS:
        raise InvalidInput(f"{name} must be true or false", name, "invalid_parameter")
    return _FLAGS[raw]


def integral(value: Any) -> Any:
    """``value`` with every float that holds an integer (``5.0``) made an int, in lists and maps too.

    JSON has one number type, and JSON Schema calls 5.0 an integer: a client whose encoder writes
    every number with a decimal point sends integers all the same.
    """
    return _integral(value, MAX_DEPTH)


def _integral(value: Any, depth: int) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list | dict):
        if depth == 0:  # no body of the API nests so deep; Python's own limit is not far beyond
            raise ApiError(400, "malformed_body", f"the body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, list):
            return [_integral(v, depth - 1) for v in value]
        return {k: _integral(v, depth - 1) for k, v in value.items()}
    return value
