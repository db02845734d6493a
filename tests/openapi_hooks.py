"""Schemathesis hooks for tests/test_openapi.py's run (loaded by the CLI through SCHEMATHESIS_HOOKS).

MessagePack bodies both ways, and three checks in place of schemathesis's own:

- for ``positive_data_acceptance``, the same, except for the refusals that no schema can foresee
  because they depend on the board a request names, on other fields of the same body, or on the
  clock. Each is accepted only when it is exactly that: the named board is fetched and the refused
  value is checked against it.
- for ``unsupported_method``, the same, except on the paths of the board actions (``:rebuild``,
  ``:archive``), which are also the paths of boards whose ids end that way: GET, PUT and DELETE
  there reach the board's own route rather than answer 405.
- for ``allow_header_conformance``, the same, except that a 405's Allow on those paths names the
  board's methods too (the path's methods, as RFC 9110 has it), which the document gives to
  ``/v1/boards/{board}`` only.
"""

from __future__ import annotations

import itertools
import re
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgpack
import schemathesis
from schemathesis.core.failures import Failure
from schemathesis.specs.openapi.checks import (
    allow_header_conformance,
    positive_data_acceptance,
    unsupported_method,
)

from router.params import integral
from shardlb import times
from shardlb.errors import InvalidInput
from tests.router_support import AS_ADMIN

# PUT settings that depend on each other, which JSON Schema cannot relate: band starts must increase
# and stay at or below points_max; shards in all at most 1024 (regions x shards_per_region, or bands
# plus hash shards); points_max must leave 30 days of time bits at resolution "ms"; an epoch near
# year 1 has no UTC instant to store, and one too old leaves no time to write in; a `board` field
# must equal the path (the schema leaves it out, yet schemathesis may still send one while testing
# that extra fields are refused).
_SETTINGS_FIELDS = {
    "sharding.bands",
    "sharding.shards",
    "sharding.shards_per_region",
    "points_max",
    "epoch",
    "board",
}
_SCORE_FIELD = re.compile(r"scores\[(\d+)\]\.(points|achieved_at|region)")
_RANKS_FIELD = re.compile(r"rewards\[(\d+)\]\.ranks")


@schemathesis.deserializer("application/msgpack")
def _unpack(ctx: Any, response: Any) -> Any:
    return msgpack.unpackb(response.content)


@schemathesis.serializer("application/msgpack")
def _pack(ctx: Any, value: Any) -> bytes:
    try:
        return bytes(msgpack.packb(value))
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"  # not representable (an integer past 64 bits): a byte msgpack never uses


@schemathesis.check
def positive_data_accepted_unless_the_board_refuses(ctx: Any, response: Any, case: Any) -> bool | None:
    try:
        return positive_data_acceptance(ctx, response, case)
    except Failure:
        if response.status_code == 422 and (_board_rule(case, response) or _said_twice(case, response)):
            return None
        if response.status_code == 400 and _unpackable(case):
            return None  # the client could not send it: _pack wrote a byte that is never MessagePack
        raise


def _said_twice(case: Any, response: Any) -> bool:
    """players:query takes its period and region in the body (api.md) or the query (as the client
    sends them); given in both with different values, it is 422 conflicting_parameter."""
    error = response.json()["error"]
    field, body = error["field"], case.body if isinstance(case.body, dict) else {}
    return bool(
        error["code"] == "conflicting_parameter"
        and field in (case.query or {})
        and field in body
        and str((case.query or {})[field]) != str(body[field])
    )


def _unpackable(case: Any) -> bool:
    """A MessagePack request whose body MessagePack cannot hold (an integer past 64 bits, which a
    schema allowing any value, such as a score's region, lets schemathesis generate)."""
    if "msgpack" not in str(
        (case.headers or {}).get("Content-Type", getattr(case, "media_type", None) or "")
    ):
        return False
    try:
        msgpack.packb(case.body)
    except (OverflowError, TypeError, ValueError):
        return True
    return False


# An action's path is also a board's: board ids may hold ':' (api.md), so "/v1/boards/x:rebuild" is
# the board "x:rebuild" to GET, PUT and DELETE, and only a POST there is the action on "x".
_ACTION_PATHS = ("/v1/boards/{board}:rebuild", "/v1/boards/{board}:archive")
_BOARD_METHODS = ("GET", "HEAD", "PUT", "DELETE")


@schemathesis.check
def unsupported_method_unless_the_path_names_a_board(ctx: Any, response: Any, case: Any) -> bool | None:
    try:
        return unsupported_method(ctx, response, case)
    except Failure:
        if case.path in _ACTION_PATHS and response.request.method in _BOARD_METHODS:
            return None  # answered by the board route, as api.md's ids require
        raise


@schemathesis.check
def allow_header_conforms_unless_the_path_names_a_board(ctx: Any, response: Any, case: Any) -> bool | None:
    try:
        return allow_header_conformance(ctx, response, case)
    except Failure:
        values = ", ".join(response.headers.get("allow") or [])  # a list per header, as schemathesis's
        allow = {method.strip() for method in values.split(",")}
        if case.path in _ACTION_PATHS and allow == {"POST", *_BOARD_METHODS}:
            return None  # the action's POST and the board's methods (router/app.py, ``_allowed``)
        raise


def _retention_not_kept(case: Any, field: str | None) -> bool:
    """A PUT's retention of a period its `periods` does not keep (`retention_days.daily`): refused
    unless the settings confirm a board made with them before, which no schema can say."""
    kind = (field or "").removeprefix("retention_days.")
    body = case.body if isinstance(case.body, dict) else {}
    kept = body.get("periods") or ["total"]
    return field != kind and kind in (body.get("retention_days") or {}) and kind not in kept


def _board_rule(case: Any, response: Any) -> bool:
    error = response.json()["error"]
    field, code = error["field"], error["code"]
    if case.method == "PUT":
        return field in _SETTINGS_FIELDS or _retention_not_kept(case, field)
    if case.path.endswith("/reshard") and field in ("bands", "shards"):
        # A reshard's bands must increase from 0 and start at or below the board's points_max, and
        # bands plus shards make at most 1024 shards.
        bands = case.body["bands"]
        increasing = bands[0] == 0 and all(a < b for a, b in itertools.pairwise(bands))
        board = _settings(response, case.path_parameters["board"])
        too_high = board is not None and bands[-1] > board["points_max"]
        return not increasing or too_high or integral(case.body["shards"]) + len(bands) > 1024
    ranks = _RANKS_FIELD.fullmatch(field or "")
    if ranks is not None and code == "invalid_rewards":  # a reward tier's [first, last] needs first <= last
        first, last = case.body["rewards"][int(ranks[1])]["ranks"]
        return bool(first > last)
    board = _settings(response, case.path_parameters["board"])
    if board is None:
        return False
    body = case.body if isinstance(case.body, dict) else {}
    if field == "period" and code == "invalid_period":
        # A read's period is a query parameter or a body field; a settlement's is in its path.
        period = (
            (case.query or {}).get("period")
            or body.get("period")
            or (case.path_parameters or {}).get("period")
            or "total"
        )
        return str(period).partition(":")[0] not in board["periods"]
    if field == "region" and code == "invalid_region":
        return board["sharding"]["strategy"] == "region"
    match = _SCORE_FIELD.fullmatch(field or "")
    if match is None:
        return False
    score = body["scores"][int(match[1])]
    if match[2] == "region":
        return (
            board["sharding"]["strategy"] == "region"
            and score.get("region") not in board["sharding"]["regions"]
        )
    if match[2] == "points":
        return code == "out_of_range" and score["points"] > board["points_max"]
    # achieved_at: out_of_range is the board's window (its epoch to 5 minutes ahead of the clock);
    # invalid_time of a schema-valid string can only be an offset that moves 1970-01-01 or
    # 9999-12-31 out of years 1970-9999 in UTC.
    if score.get("achieved_at") is None:
        # Sent without a time: the clock's, past the board's last time only on a board whose
        # codec's range (its epoch and resolution) ends before now, which only the board decides.
        return code == "out_of_range"
    value = integral(score["achieved_at"])
    if code == "out_of_range":
        try:
            times.parse(value, "achieved_at")
        except InvalidInput:
            return False
        return True
    return isinstance(value, str) and value[:10] in ("1970-01-01", "9999-12-31")


def _settings(response: Any, board: str) -> dict[str, Any] | None:
    url = urlsplit(response.request.url)
    for _ in range(20):  # a 503 (the fuzzing may have started a reshard of the board) is retried
        found = httpx.get(f"{url.scheme}://{url.netloc}/v1/boards/{board}", headers=AS_ADMIN, timeout=10)
        if found.status_code != 503:
            break
        time.sleep(0.25)
    return found.json() if found.status_code == 200 else None
