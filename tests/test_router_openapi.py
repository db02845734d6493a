"""router/openapi.py: the document is valid OpenAPI and documents exactly the routes the app serves."""

from __future__ import annotations

import ast
from pathlib import Path

import schemathesis
from starlette.routing import Route

import router.app as app_module
from router import errors
from router.app import create_app
from router.openapi import SPEC
from router.settings import Settings
from shardlb import reshard_copy  # noqa: F401  (its error class is one of the subclasses walked)
from shardlb.errors import InvalidInput, SettlementConflict, ShardlbError

ROOT = Path(__file__).resolve().parent.parent


def test_openapi_document_is_valid_and_complete() -> None:
    schemathesis.openapi.from_dict(SPEC).validate()
    app = create_app(Settings(insecure_dev=True))  # the live app's routes, not the lists it is built from
    served = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route)
        for method in route.methods or ()
        if method != "HEAD"
    }
    documented = {
        (path, method) for path, item in SPEC["paths"].items() for method in item if method != "parameters"
    }
    assert served == documented
    for path, method in documented:
        responses = SPEC["paths"][path][method]["responses"]
        assert any(code.startswith("2") for code in responses), (path, method)


def _emitted_codes() -> set[tuple[int, str]]:
    """(status, code) of every error the router can answer: the codes its sources raise (ApiError
    with its status; a library error with a code of its own, mapped by router/errors.py's table)
    and those of every library error class, each status from the router's own mapping."""
    found: set[tuple[int, str]] = {(status, code) for status, code in app_module._HTTP_CODES.items()}
    found.add((503, errors.OUT_OF_MEMORY))
    classes = {"InvalidInput": InvalidInput, "SettlementConflict": SettlementConflict}
    for source in [*ROOT.glob("router/*.py"), *ROOT.glob("shardlb/*.py")]:
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            name = node.func.id
            given = [*node.args, *(k.value for k in node.keywords if k.arg == "code")]
            value = [a.value if isinstance(a, ast.Constant) else None for a in given]
            if name == "ApiError" and isinstance(value[0], int) and isinstance(value[1], str):
                found.add((value[0], value[1]))  # status, code
            elif name in classes and len(value) == 3 and isinstance(value[2], str):
                error = errors.to_api_error(classes[name]("m", None, value[2]))  # message, field, code
                found.add((error.status, error.code))
    pending: list[type[ShardlbError]] = [ShardlbError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls is not ShardlbError:
            error = errors.to_api_error(cls("m"))
            found.add((error.status, error.code))
    return found


def test_every_error_code_is_named_in_the_document_and_the_readme() -> None:
    emitted = _emitted_codes()
    assert (422, "invalid_rewards") in emitted and (409, "settlement_busy") in emitted  # the scan works
    readme = (ROOT / "router" / "README.md").read_text()
    responses = SPEC["components"]["responses"]
    # internal_error (500) is a bug of the router, no answer an operation documents
    answers = [(status, code) for status, code in sorted(emitted) if status != 500]
    assert [(s, c) for s, c in answers if c not in responses[f"E{s}"]["description"]] == []
    assert [c for _, c in answers if f"`{c}`" not in readme] == []


# The fields and query parameters api.md names; everything else in these is an addition.
_API_FIELDS = {
    "Page": {"board", "period", "entries", "as_of"},
    "Player": {"player_id", "rank", "points", "achieved_at", "players", "percentile", "rank_error"},
    "Entries": {"entries"},
    "Entry": {"rank", "player_id", "points", "achieved_at"},
    "Query": {"player_ids", "period"},
    "Score": {"player_id", "points", "match_id", "achieved_at", "region"},
    "ScoreResult": {"player_id", "match_id", "status", "points"},
    "ScoresRequest": {"scores"},
    "BoardSettings": {"mode", "order", "tiebreak", "periods", "timezone", "retention_days", "points_max",
                      "epoch", "sharding"},
}  # fmt: skip
_API_PARAMETERS = {
    ("/v1/boards/{board}/top", "get"): {"board", "limit", "period", "region"},
    ("/v1/boards/{board}/entries", "get"): {"board", "offset", "limit", "period", "region"},
    ("/v1/boards/{board}/players/{player}", "get"): {"board", "player", "period", "region", "estimate"},
    ("/v1/boards/{board}/players/{player}/around", "get"): {"board", "player", "radius", "period", "region"},
    ("/v1/boards/{board}/players:query", "post"): {"board"},
}


def _described(item: dict[str, object]) -> str:
    """An object's description, a reference's own first (OpenAPI 3.1 lets it override the target's)."""
    if "description" in item:
        return str(item["description"])
    ref = item.get("$ref")
    if isinstance(ref, str):
        section, name = ref.split("/")[-2:]
        return _described(SPEC["components"][section][name])
    return ""


def test_additions_to_api_md_are_marked() -> None:
    """api.md: additions are welcome, documented in the OpenAPI spec. Each body field and query
    parameter of api.md's operations that api.md does not name says "Addition" where it is described."""
    schemas = SPEC["components"]["schemas"]
    unmarked = [
        (schema, name)
        for schema, named in _API_FIELDS.items()
        for name, field in schemas[schema]["properties"].items()
        if name not in named and "Addition" not in _described(field)
    ]
    for (path, method), named in _API_PARAMETERS.items():
        operation = SPEC["paths"][path][method]
        for parameter in [*SPEC["paths"][path].get("parameters", []), *operation.get("parameters", [])]:
            name = parameter.get("name") or parameter["$ref"].rsplit("/", 1)[1]
            if name not in named and "Addition" not in _described(parameter):
                unmarked.append((path, name))
    status = schemas["ScoreResult"]["properties"]["status"]
    unmarked += [
        ("ScoreResult.status", value)
        for value in status["enum"]
        if value not in ("improved", "unchanged", "duplicate") and value not in status["description"]
    ]
    assert unmarked == [], unmarked


def test_the_settlement_sections_statuses_name_the_archive_permits_refusals() -> None:
    """router/README.md's settlement section lists its endpoints' statuses, but left out the two
    refusals of 2026-12-05's archive permits (router/history.py): 503 ``overloaded`` for a write
    key's settlement, awards and ack calls past the worker's permits and their queue, and 429
    ``rate_limited`` for a third archive read (history, periods, a settled read) of one client
    without a key. A game server reading the section saw only ``archive_behind`` and
    ``archive_unavailable`` as the 503s to retry."""
    readme = (ROOT / "router" / "README.md").read_text()
    section = readme.split("## Additions: settlement and history", 1)[1].split("\n## ", 1)[0]
    statuses = section.split("- Statuses:", 1)[1].split("\n- ", 1)[0]
    assert "`overloaded`" in statuses and "`rate_limited`" in statuses, statuses
