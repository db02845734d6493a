"""The OpenAPI 3.1 document of every route, body and error, served at /openapi.json.

Written as data. Every body is offered as JSON and as MessagePack with the same schema; every error is
the ``Error`` body. Additions to api.md are marked "Addition" in their descriptions.
"""

from __future__ import annotations

from typing import Any

from router.admin import RESHARD_BODY_BYTES
from router.dashboard import ASSETS
from router.limiter import SCRAPE_READS
from router.routes import MAX_AGE_MS, MAX_OFFSET, MAX_RADIUS
from router.scores import MAX_ITEMS
from shardlb import periods, settlement, settlement_delivery, times
from shardlb.board import MAX_FUTURE_MS, STATUS
from shardlb.codec import RESOLUTION_MS
from shardlb.config import (
    BAND_PLACEMENTS,
    CLOSE_GRACE_S,
    DEDUP_WINDOW_S,
    DURABILITY,
    ID_MAX,
    ID_PATTERN,
    MATCH_ID_MAX,
    MAX_BANDS,
    MAX_POINTS,
    MAX_RETENTION_DAYS,
    MAX_SHARDS,
    MODERATION,
    MODERATION_MAX,
    MODES,
    ORDERS,
    RANK_MODES,
    TIE_AWARDS,
    TIEBREAKS,
    BoardConfig,
)
from shardlb.moderation import REASON_MAX, REFUSED

MEDIA = ("application/json", "application/msgpack")
_DEFAULT = BoardConfig("default")  # the settings a PUT leaves out
_MODERATION_TEXT = {
    "max_points_per_result": "a result with more points is refused (status points_limit)",
    "max_results_per_player_per_minute": "results of a player past this many in a minute (of the "
    "server's clock; a match counted once however often it is sent) are refused (status rate_limit)",
    "inactive_after": "seconds: players with no result for this long are removed by the rolling cleanup",
}
_MODERATION_SETTINGS = {
    name: {
        "type": ["integer", "null"],
        "minimum": 1,
        "maximum": MODERATION_MAX[name],
        "default": None,
        "description": f"Addition (moderation): {_MODERATION_TEXT[name]}; null: off",
    }
    for name in MODERATION
}


# Addition (period lifecycle): when the period read ends, in the board's UTC offset; null for total.
_RESETS_AT = {
    "type": ["string", "null"],
    "format": "date-time",
    "description": "Addition: when the period read ends (RFC 3339, the board's UTC offset at that "
    "instant, 'Z' where it is zero); null for total",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _content(schema: dict[str, Any]) -> dict[str, Any]:
    return {media: {"schema": schema} for media in MEDIA}


def _ok(description: str, schema_name: str) -> dict[str, Any]:
    return {"description": description, "content": _content(_ref(schema_name))}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"$ref": f"#/components/responses/E{s}"} for s in statuses}


def _param(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/parameters/{name}"}


_ID = {"type": "string", "pattern": ID_PATTERN.pattern, "minLength": 1, "maxLength": ID_MAX}
_TIME_IN = {
    "oneOf": [
        {
            "type": "string",
            "format": "date-time",
            "pattern": times.RFC3339_PATTERN,
            "description": "RFC 3339 with an offset, years 1970-9999 (in UTC too)",
        },
        {"type": "integer", "minimum": 0, "maximum": times.END_MS - 1, "description": "epoch milliseconds"},
    ]
}
_PERIOD = {
    "type": "string",
    "pattern": periods.API_PATTERN,
    "description": "total, daily, weekly, monthly (the current one), or one given by its date: "
    "daily:2026-11-30, weekly:2026-W48, monthly:2026-11; a kind the board does not keep is 422",
}
# Optional fields that the server reads as absent when they are null (clients send unset ones so).
_TIME_OR_NULL = {"oneOf": [*_TIME_IN["oneOf"], {"type": "null"}]}
_ID_OR_NULL = {**_ID, "type": ["string", "null"]}
_COUNT = {"type": "integer", "minimum": 1, "maximum": MAX_SHARDS}
_NO_NUL = "^[^\\u0000]*$"  # any characters but NUL (U+0000), which PostgreSQL's text cannot hold
_REASON = {"type": ["string", "null"], "maxLength": REASON_MAX, "pattern": _NO_NUL}
_TIME_OUT = {"type": "string", "format": "date-time"}
# A board or player id of "." or ".." is valid, but clients resolve it as a path segment (RFC 3986)
# unless it is percent-encoded, and the request then reaches another route or none: 404 or 405.
_PATH = (404, 405)
# 400: an unknown or repeated query parameter (and a malformed body where there is one).
_READ_ERRORS = (400, 401, 403, *_PATH, 422, 429, 503)

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message", "field"],
                "properties": {
                    "code": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$"},
                    "message": {"type": "string"},
                    "field": {
                        "type": ["string", "null"],
                        "description": "the offending field, e.g. scores[3].points, or null",
                    },
                },
            }
        },
    },
    "Sharding": {
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "description": "hash sharding is the default: `strategy` may be left out",
                "properties": {
                    "strategy": {"const": "hash"},
                    "shards": {
                        **_COUNT,
                        "description": "Addition: left out, one shard per master of the cluster when the "
                        "board is created; a PUT that leaves it out confirms an existing board of any "
                        "shard count",
                    },
                },
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["strategy", "regions"],
                "properties": {
                    "strategy": {"const": "region"},
                    "regions": {"type": "array", "items": _ID, "minItems": 1, "uniqueItems": True},
                    "shards_per_region": {
                        **_COUNT,
                        "description": f"times the number of regions, at most {MAX_SHARDS}",
                    },
                },
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["strategy", "bands"],
                "properties": {
                    "strategy": {"const": "band"},
                    "bands": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": MAX_POINTS},
                        "minItems": 1,
                        "maxItems": MAX_BANDS,
                        "description": "increasing band starts, the first 0, the last at most points_max",
                    },
                    "shards": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": MAX_SHARDS - 1,
                        "description": "Addition: hash shards that hold the players' records; "
                        f"with the bands at most {MAX_SHARDS}; left out, one per master of the cluster "
                        "when the board is created",
                    },
                    "placement": {
                        "enum": list(BAND_PLACEMENTS),
                        "default": BAND_PLACEMENTS[0],
                        "description": "Addition: where the shards sit on the cluster's slots. spread "
                        "(new boards) interleaves the home shards and the bands, so a cluster of as many "
                        "masters as bands gives each master one band; window (band boards created before "
                        "there was a choice) puts every home shard first, then the bands.",
                    },
                },
            },
        ]
    },
    "BoardSettings": {
        "type": "object",
        "additionalProperties": False,
        "description": "Board settings; every field is optional on PUT. (A `board` field equal to the "
        "path's id is tolerated, so that a listed board can be sent back as it is; any other is 422.)",
        "properties": {
            "mode": {"enum": list(MODES), "default": _DEFAULT.mode},
            "order": {"enum": list(ORDERS), "default": _DEFAULT.order},
            "tiebreak": {"enum": list(TIEBREAKS), "default": _DEFAULT.tiebreak},
            "periods": {
                "type": "array",
                "items": {"enum": list(periods.KINDS)},
                "default": list(_DEFAULT.periods),
            },
            "timezone": {
                "enum": sorted(periods.zone_names()),
                "default": _DEFAULT.timezone,
                "description": "IANA name",
            },
            "retention_days": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    k: {"type": "integer", "minimum": 0, "maximum": MAX_RETENTION_DAYS} for k in periods.DATED
                },
                "description": "only for periods the board keeps: another is 422 (field "
                "retention_days.<period>), unless the settings confirm a board made with them before "
                "2026-12-06, when such a retention was dropped",
            },
            "points_max": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_POINTS,
                "default": _DEFAULT.points_max,
                "description": "with resolution ms, small enough to leave 30 days of time bits",
            },
            "epoch": _TIME_OR_NULL,
            "resolution": {
                "enum": list(RESOLUTION_MS),
                "default": _DEFAULT.resolution,
                "description": "Addition: the time resolution of the tie-break",
            },
            "dedup_window_s": {
                "type": "integer",
                "minimum": DEDUP_WINDOW_S[0],
                "maximum": DEDUP_WINDOW_S[1],
                "default": _DEFAULT.dedup_window_s,
                "description": "Addition: how long incr boards remember a match",
            },
            "durability": {
                "enum": list(DURABILITY),
                "default": _DEFAULT.durability,
                "description": "Addition: `journal` (every result archived in PostgreSQL) or `memory`",
            },
            "sharding": _ref("Sharding"),
            "rank_mode": {
                "enum": list(RANK_MODES),
                "default": _DEFAULT.rank_mode,
                "description": "Addition: the reads' rank mode unless a read asks (see rank_mode)",
            },
            **_MODERATION_SETTINGS,
            "close_grace": {
                "type": "integer",
                "minimum": CLOSE_GRACE_S[0],
                "maximum": CLOSE_GRACE_S[1],
                "default": _DEFAULT.close_grace_s,
                "description": "Addition: seconds after its end a dated period still takes results "
                "achieved inside it; then it is closed",
            },
            "week_start": {
                "enum": list(periods.WEEKDAYS),
                "default": _DEFAULT.week_start,
                "description": "Addition: the local weekday weekly periods start on; weekly:YYYY-Www "
                "names the week that contains the Monday of ISO week YYYY-Www",
            },
            "tie_awards": {
                "enum": list(TIE_AWARDS),
                "default": _DEFAULT.tie_awards,
                "description": "Addition: how a settlement pays equal points at a reward boundary: `cut` "
                "by the unique rank, `all` by competition rank",
            },
        },
    },
    "Board": {
        "type": "object",
        "required": [
            "board",
            "mode",
            "order",
            "tiebreak",
            "periods",
            "timezone",
            "retention_days",
            "points_max",
            "epoch",
            "resolution",
            "dedup_window_s",
            "durability",
            "sharding",
            "rank_mode",
            *MODERATION,
            "close_grace",
            "week_start",
            "tie_awards",
        ],
        "properties": {
            "board": _ID,
            "mode": {"enum": list(MODES)},
            "order": {"enum": list(ORDERS)},
            "tiebreak": {"enum": list(TIEBREAKS)},
            "periods": {"type": "array", "items": {"enum": list(periods.KINDS)}},
            "timezone": {"type": "string"},
            "retention_days": {"type": "object", "additionalProperties": {"type": "integer"}},
            "points_max": {"type": "integer"},
            "epoch": _TIME_OUT,
            "resolution": {"enum": list(RESOLUTION_MS)},
            "dedup_window_s": {"type": "integer"},
            "durability": {"enum": list(DURABILITY)},
            "sharding": {"type": "object", "required": ["strategy"]},
            "rank_mode": {"enum": list(RANK_MODES)},
            **{name: {"type": ["integer", "null"]} for name in MODERATION},
            "close_grace": {"type": "integer"},
            "week_start": {"enum": list(periods.WEEKDAYS)},
            "tie_awards": {"enum": list(TIE_AWARDS)},
        },
    },
    "BoardWithPlayers": {
        "allOf": [
            _ref("Board"),
            {
                "type": "object",
                "required": ["players", "resets_at", "closed"],
                "properties": {
                    "players": {
                        "type": "object",
                        "description": "players per kept period (the current one)",
                        "required": ["total"],
                        "additionalProperties": {"type": "integer", "minimum": 0},
                    },
                    "resets_at": {
                        "type": "object",
                        "description": "Addition: per kept dated period kind, when its current period "
                        "ends (RFC 3339, the board's UTC offset at that instant, 'Z' where it is zero)",
                        "additionalProperties": {"type": "string", "format": "date-time"},
                    },
                    "closed": {
                        "type": "boolean",
                        "description": "Addition: true once a season archive (`:archive`) closed the board: "
                        "it takes no more results (posts are 409 board_closed)",
                    },
                },
            },
        ]
    },
    "BoardList": {
        "type": "object",
        "required": ["boards"],
        "properties": {"boards": {"type": "array", "items": _ref("Board")}},
    },
    "Score": {
        "type": "object",
        "additionalProperties": False,
        "required": ["player_id", "points", "match_id"],
        "properties": {
            "player_id": _ID,
            "points": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_POINTS,
                "description": "at most the board's points_max",
            },
            "match_id": {
                "type": "string",
                "minLength": 1,
                "maxLength": MATCH_ID_MAX,
                "pattern": _NO_NUL,
                "description": "any characters but NUL (U+0000), which PostgreSQL's text cannot hold",
            },
            "achieved_at": {
                **_TIME_OR_NULL,
                "description": "default: the server's time; not before the board's epoch nor more "
                f"than {MAX_FUTURE_MS // 60_000} minutes ahead of the server's clock",
            },
            "region": {
                "description": "one of the board's regions, required on region boards (422 "
                "missing_field without it, invalid_region for another); ignored elsewhere, whatever "
                "it holds (api.md)",
            },
        },
    },
    "ScoresRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["scores"],
        "properties": {"scores": {"type": "array", "maxItems": MAX_ITEMS, "items": _ref("Score")}},
    },
    "ScoreResult": {
        "type": "object",
        "required": ["player_id", "match_id", "status", "points"],
        "properties": {
            "player_id": _ID,
            "match_id": {"type": "string"},
            "status": {
                "enum": [*STATUS.values(), *REFUSED.values()],
                "description": "Addition: 'overflow' (incr boards) when the sum would pass points_max; "
                "nothing was written for that score. Addition (moderation): 'banned', 'points_limit', "
                "'rate_limit': refused before anything was written (points: the player's total, as it "
                "stands). Addition (region boards): "
                "'region_conflict', the result names another region than the player's first; nothing was "
                "written, points is the player's total in their own region.",
            },
            "points": {
                "type": "integer",
                "minimum": 0,
                "description": "the player's total after the write (0 when they have none)",
            },
            "closed_periods": {
                "type": "array",
                "items": {"type": "string"},
                "minItems": 1,
                "description": "Addition, present only when not empty: the periods of the score's "
                "achieved time (e.g. daily:2026-11-29) that were closed (past their end plus "
                "close_grace) or frozen when this call came, so this call wrote nothing there; it counts "
                "in the total and the others. A retry of a score applied before the close names them "
                "too, although its first call counted it there",
            },
        },
    },
    "ScoresResponse": {
        "type": "object",
        "required": ["results"],
        "properties": {"results": {"type": "array", "items": _ref("ScoreResult")}},
    },
    "Entry": {
        "type": "object",
        "required": ["rank", "player_id", "points", "achieved_at"],
        "properties": {
            "rank": {"type": "integer", "minimum": 1},
            "player_id": _ID,
            "points": {"type": "integer", "minimum": 0},
            "achieved_at": _TIME_OUT,
            "reward": {**_ID, "description": "Addition: in a settled period, the reward paid for this rank"},
        },
    },
    "Page": {
        "type": "object",
        "required": ["board", "period", "entries", "as_of", "resets_at"],
        "properties": {
            "board": _ID,
            "period": {"type": "string", "description": "the period read, e.g. daily:2026-11-30"},
            "entries": {"type": "array", "items": _ref("Entry")},
            "as_of": {**_TIME_OUT, "description": "when these entries were read from the cluster"},
            "resets_at": _RESETS_AT,
            "settled": {"type": "boolean", "description": "Addition: read from a settled period's snapshot"},
            "settlement_id": {**_ID, "description": "Addition: with settled, the settlement"},
        },
    },
    "Player": {
        "type": "object",
        "required": ["player_id", "rank", "points", "achieved_at", "players", "percentile", "resets_at"],
        "properties": {
            "player_id": _ID,
            "rank": {"type": "integer", "minimum": 1},
            "points": {"type": "integer", "minimum": 0},
            "achieved_at": _TIME_OUT,
            "players": {"type": "integer", "minimum": 0},
            "percentile": {"type": "number", "minimum": 0, "maximum": 100},
            "rank_error": {
                "type": "integer",
                "minimum": 0,
                "description": "estimate=true only: the exact rank (as of as_of) is within rank ± rank_error",
            },
            "as_of": {**_TIME_OUT, "description": "Addition, estimate=true only: the histogram's time"},
            "counts_as_of": {
                **_TIME_OUT,
                "description": "Addition, max_age_ms > 0 only: when the counts of the other shards were read",
            },
            "resets_at": _RESETS_AT,
            "settled": {"type": "boolean", "description": "Addition: the final rank in a settled period"},
            "settlement_id": {**_ID, "description": "Addition: with settled, the settlement"},
            "reward": {**_ID, "description": "Addition: with settled, the reward paid to the player"},
        },
    },
    "Entries": {
        "type": "object",
        "required": ["entries", "resets_at"],
        "properties": {
            "board": {**_ID, "description": "Addition: the board read"},
            "period": {"type": "string", "description": "Addition: the period read, e.g. daily:2026-11-30"},
            "entries": {"type": "array", "items": _ref("Entry")},
            "resets_at": _RESETS_AT,
        },
    },
    "Query": {
        "type": "object",
        "additionalProperties": False,
        "required": ["player_ids"],
        "properties": {
            "player_ids": {"type": "array", "maxItems": MAX_ITEMS, "items": _ID},
            "period": {
                **_PERIOD,
                "type": ["string", "null"],
                "default": "total",
                "description": "or the query parameter (not both unequal)",
            },
            "region": {
                **_ID_OR_NULL,
                "description": "Addition: limit a region board to one region, as the reads' query "
                "parameter; or the query parameter (not both unequal)",
            },
        },
    },
    "Status": {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}},
    "Ready": {
        "type": "object",
        "required": ["status", "journal", "reshards"],
        "properties": {
            "status": {"type": "string"},
            "journal": {
                "type": "object",
                "description": "Addition: the journal nearest its bound (results and entries not archived "
                "yet, seconds since the oldest, and the bounds)",
                "required": ["board", "entries", "seconds", "bound", "results", "results_bound"],
                "properties": {
                    "board": {"type": ["string", "null"]},
                    "entries": {"type": "integer", "minimum": 0},
                    "seconds": {"type": "number", "minimum": 0},
                    "bound": {"type": "integer", "minimum": 1},
                    "results": {"type": "integer", "minimum": 0},
                    "results_bound": {"type": "integer", "minimum": 1},
                },
            },
            "reshards": {
                "type": "object",
                "description": "Addition (2026-12-05): the reshards under way, and the boards of those "
                "abandoned (no mover has held the lease for a lease; at most 20 named), which a router "
                "that may take them resumes",
                "required": ["under_way", "abandoned"],
                "properties": {
                    "under_way": {"type": "integer", "minimum": 0},
                    "abandoned": {"type": "array", "items": {"type": "string"}, "maxItems": 20},
                },
            },
        },
    },
    "Rebuild": {
        "type": "object",
        "description": "Addition: what a rebuild did, per shard (shardlb/rebuild.py)",
        "required": ["board", "period", "shards", "seconds"],
        "properties": {
            "board": {"type": "string"},
            "period": {"type": ["string", "null"], "description": "the period rebuilt; null for all"},
            "shards": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["shard", "players", "rows", "journal", "tries", "seconds"],
                    "properties": {
                        "shard": {"type": "integer", "minimum": 0},
                        "players": {"type": "integer", "minimum": 0, "description": "on the shard after"},
                        "rows": {"type": "integer", "minimum": 0, "description": "results from PostgreSQL"},
                        "journal": {
                            "type": "integer",
                            "minimum": 0,
                            "description": "results from the journal",
                        },
                        "tries": {"type": "integer", "minimum": 0, "description": "swap attempts"},
                        "seconds": {"type": "number", "minimum": 0},
                    },
                },
            },
            "seconds": {"type": "number", "minimum": 0},
        },
    },
    "Removal": {
        "type": "object",
        "description": "Addition (moderation): a removal of a player from every period of a board",
        "required": ["board", "player_id", "removed"],
        "properties": {
            "board": _ID,
            "player_id": _ID,
            "removed": {
                "type": "boolean",
                "description": "false: the player had no entry (nothing to do); a retry with the same "
                "X-Request-Id answers as the first call did, and keeps the results posted since",
            },
        },
    },
    "BanRequest": {
        "oneOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["scope", "board"],
                "properties": {
                    "scope": {"const": "board"},
                    "board": _ID,
                    "reason": _REASON,
                },
            },
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["scope"],
                "properties": {
                    "scope": {"const": "all"},
                    "board": {"type": "null"},
                    "reason": _REASON,
                },
            },
        ]
    },
    "Ban": {
        "type": "object",
        "required": ["player_id", "scope", "board", "reason", "by", "banned_at"],
        "properties": {
            "player_id": _ID,
            "scope": {"enum": ["board", "all"]},
            "board": {"type": ["string", "null"]},
            "reason": {"type": "string", "description": '"" when the ban was asked for without one'},
            "by": {"type": "string", "description": "the admin key's client id"},
            "banned_at": _TIME_OUT,
            "removed_from": {
                "type": "array",
                "items": _ID,
                "description": "the boards the player's entries were removed from (POST :ban only)",
            },
        },
    },
    "BanList": {
        "type": "object",
        "required": ["bans"],
        "properties": {"bans": {"type": "array", "items": _ref("Ban")}},
    },
    "Unban": {
        "type": "object",
        "required": ["player_id", "lifted"],
        "properties": {"player_id": _ID, "lifted": {"type": "boolean"}},
    },
}

_ERROR_TEXT = {
    400: "Malformed body: not valid JSON or MessagePack (malformed_body); a query parameter the "
    "operation does not take (unknown_parameter) or one given twice (repeated_parameter); a request "
    "that is not HTTP/1.1 the parser can read, or that asks to switch protocols (Upgrade) and has a "
    "body (malformed_request, the connection is closed); a removal, ban or unban whose X-Request-Id, "
    "its retry key, is not 1-128 characters of A-Z a-z 0-9 . _ : -, or that sends two X-Request-Id "
    "headers that differ (invalid_request_id, nothing written).",
    401: "Missing or unknown key (code unauthorized).",
    403: "The key's scope does not allow this (code forbidden); on a router without keys "
    "(SHARDLB_INSECURE_DEV), a request other than GET or HEAD that a browser sends from another site "
    "(its Origin or Sec-Fetch-Site).",
    404: "Unknown board, player, route or settlement (board_not_found, player_not_found, not_found, "
    "settlement_not_found).",
    405: "Method not allowed on this route (method_not_allowed).",
    409: "The board exists with other settings (board_conflict); this router has no PostgreSQL "
    "(archive_not_configured); settlements: the id names another settlement (settlement_conflict), "
    "the period is open (period_open) or settled under another id (period_settled), Redis and "
    "PostgreSQL disagree (settlement_mismatch), the id is running (settlement_busy) or not "
    "settled (not_settled), a webhook (named or stored) without SHARDLB_WEBHOOK_SECRET "
    "(webhook_not_configured), a board with durability memory (not_journaled); posts to a board whose "
    "season is being archived (board_closed).",
    408: "The request line and headers, or the body, did not arrive within SHARDLB_HEADER_TIMEOUT_S "
    "/ SHARDLB_BODY_TIMEOUT_S (request_timeout); the connection is closed.",
    413: "The body is larger than the operation's cap (body_too_large): SHARDLB_MAX_BODY_BYTES, "
    f"SHARDLB_MAX_READ_BODY_BYTES for players:query, {RESHARD_BODY_BYTES // 1024} KiB for a reshard.",
    415: "Content-Type is neither application/json nor application/msgpack, or the body has a "
    "Content-Encoding (gzip, ...): bodies are sent uncompressed (unsupported_media_type; "
    "Accept-Encoding: identity), or a Transfer-Encoding other than chunked.",
    422: "A well-formed request with an invalid value; `field` names it (e.g. scores[3].points): "
    "invalid_id, invalid_match_id, invalid_time, out_of_range, invalid_period, invalid_region, "
    "invalid_parameter, missing_field, unknown_field, too_many, invalid_body, invalid_input, "
    "board_mismatch (a PUT body's board is not the path's), conflicting_parameter (body and query "
    "disagree); settlements: invalid_rewards, invalid_cursor, invalid_award_id, unknown_award.",
    414: "The request target (path and query string) passed 8 KiB (uri_too_long); the connection is closed.",
    431: "The request line and headers (or a chunked body's trailers) passed SHARDLB_MAX_HEADER_BYTES, "
    "or SHARDLB_MAX_HEADER_FIELDS header fields (headers_too_large); the connection is closed.",
    429: "This client's read rate limit is used up (a /metrics scrape takes "
    f"{SCRAPE_READS} reads of it), or a client without a key has as many requests (or archive reads) "
    "in progress as it may hold, or it sent too many wrong keys (rate_limited); see Retry-After.",
    503: "Retry after Retry-After seconds. Overloaded (overloaded), shutting down "
    "(shutting_down), the cluster unavailable (cluster_unavailable) or the shard's master out of memory "
    "(out_of_memory), not ready (not_ready, /readyz), a reshard's cut-over (board_resharding), a board "
    "whose answer would come from a shard that lost its data in Redis (all of Redis, or one shard's slot "
    "alone) and is not rebuilt yet: `shardlb rebuild` restores it, the message says which "
    "(board_rebuilding: nothing written, retry the same match_id); "
    "PostgreSQL failed (archive_unavailable) or the archiver is behind a settlement (archive_behind).",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 1},
        "required": True,
    }
}


# Addition: every response, of every route and status, names its request (router/middleware.py).
_HEADERS: dict[str, Any] = {
    "X-Request-Id": {
        "description": "Addition: the request's id, also in the router's log lines: the client's own "
        "X-Request-Id when it sent a sane one (1-128 characters of A-Z a-z 0-9 . _ : -), else a new one "
        "(a removal, ban or unban sent with one that is not sane, or with two that differ, is 400 "
        "invalid_request_id; other calls take the first sane one)",
        "schema": {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"},
        "required": True,
    },
    "WWW-Authenticate": {
        "description": 'the challenge: Bearer realm="shardlb"',
        "schema": {"type": "string"},
        "required": True,
    },
    "Allow": {
        "description": "the methods the route takes",
        "schema": {"type": "string"},
        "required": True,
    },
}
_ERROR_HEADERS = {401: "WWW-Authenticate", 405: "Allow"}


def _header(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/headers/{name}"}


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {"description": _ERROR_TEXT[status], "content": _content(_ref("Error"))}
    headers: dict[str, Any] = {"X-Request-Id": _header("X-Request-Id")}
    if status in (429, 503):
        headers.update(_RETRY_AFTER)
    if status in _ERROR_HEADERS:
        headers[_ERROR_HEADERS[status]] = _header(_ERROR_HEADERS[status])
    response["headers"] = headers
    return response


_PARAMETERS: dict[str, Any] = {
    "board": {"name": "board", "in": "path", "required": True, "schema": _ID},
    "player": {"name": "player", "in": "path", "required": True, "schema": _ID},
    "period": {
        "name": "period",
        "in": "query",
        "required": False,
        "schema": {**_PERIOD, "default": "total"},
    },
    "region": {
        "name": "region",
        "in": "query",
        "required": False,
        "schema": _ID,
        "description": "limit a region board to one region; ignored on other boards",
    },
    "limit": {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ITEMS, "default": 100},
    },
    "offset": {
        "name": "offset",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET, "default": 0},
    },
    "radius": {
        "name": "radius",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_RADIUS, "default": 5},
    },
    "estimate": {
        "name": "estimate",
        "in": "query",
        "required": False,
        "schema": {"type": "boolean", "default": False},
        "description": "rank and percentile from the router's in-RAM histograms, with rank_error",
    },
    "max_age_ms": {
        "name": "max_age_ms",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_AGE_MS, "default": 0},
        "description": "Addition (unique ranks): on a band board the other bands' sizes, on a hash board "
        "the other shards' counts for this player at their unchanged score, may be up to this many ms "
        "old (counts_as_of says when they were read), so the read touches the player's home (and band) "
        "shards only; 0: exact. Competition ranks answer exactly",
    },
    "rank_mode": {
        "name": "rank_mode",
        "in": "query",
        "required": False,
        "schema": {"enum": list(RANK_MODES)},
        "description": "Addition: `unique` ranks 1..N in the board order; `competition` gives equal "
        "points equal ranks (1, 1, 3), the order unchanged. Default: the board's rank_mode",
    },
}

# The key scope each operation needs, as the role names OpenAPI 3.1 allows in a requirement of a
# scheme that is not OAuth: a key of a smaller scope is 403 (scopes nest: admin > write > read).
_ADMIN: list[dict[str, list[str]]] = [{"bearer": ["admin"]}]
_WRITE: list[dict[str, list[str]]] = [{"bearer": ["write"]}]
_READ: list[dict[str, list[str]]] = [{}, {"bearer": ["read"]}]  # open unless SHARDLB_READS_REQUIRE_KEY

# ---- Additions: settlement and history (router/settlements.py, shardlb/settlement.py) ----------
_SETTLEMENT_ID = {"name": "settlement", "in": "path", "required": True, "schema": _ID}
_RANK = {"type": "integer", "minimum": 1, "maximum": 10**9}
# The usual form of a webhook URL: a host name or IPv4 address, a port of 1-65535, a plain path.
# shardlb/settlement.py (``webhook_url``) takes any http(s) URL with a host that httpx can send to,
# every string of this pattern among them (IPv6 literals and other hosts too).
_LABEL = r"[A-Za-z][A-Za-z0-9]*(-[A-Za-z0-9]+)*"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_PORT = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
_WEBHOOK_URL = {
    "type": "string",
    "maxLength": settlement.MAX_URL,
    "pattern": rf"^https?://({_LABEL}(\.{_LABEL})*|{_OCTET}(\.{_OCTET}){{3}})(:{_PORT})?"
    r"([/?][A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)?$",
    "description": "POST each award here; the first one stored is kept for the settlement",
}
_SETTLEMENT_SCHEMAS: dict[str, Any] = {
    "RewardTier": {
        "type": "object",
        "additionalProperties": False,
        "description": "One tier of a reward table: the first tier covering a rank pays it",
        "required": ["reward"],
        "properties": {
            "rank": _RANK,
            "ranks": {"type": "array", "items": _RANK, "minItems": 2, "maxItems": 2},
            "top_percent": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
            "reward": _ID,
        },
        "oneOf": [{"required": ["rank"]}, {"required": ["ranks"]}, {"required": ["top_percent"]}],
    },
    "SettleRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["settlement_id", "rewards"],
        "properties": {
            "settlement_id": {**_ID, "description": "the same id never pays twice"},
            "rewards": {"type": "array", "items": _ref("RewardTier"), "minItems": 1, "maxItems": 100},
            "top_n": {"type": "integer", "minimum": 0, "maximum": 100_000, "default": 1000},
            "force": {"type": "boolean", "default": False, "description": "pay even if Redis differs"},
            "webhook_url": _WEBHOOK_URL,
        },
    },
    "Settlement": {
        "type": "object",
        "required": ["settlement_id", "board", "period", "state"],
        "properties": {
            "settlement_id": _ID,
            "board": _ID,
            "period": {"type": "string"},
            "state": {"enum": ["started", "mismatch", "settled"]},
            "players": {"type": "integer", "minimum": 0},
            "top_n": {"type": "integer", "minimum": 0},
            "rewards": {"type": "array", "items": _ref("RewardTier")},
            "tie_awards": {"enum": list(TIE_AWARDS)},
            "awards": {
                "type": "object",
                "properties": {"total": {"type": "integer"}, "by_reward": {"type": "object"}},
            },
            "forced": {"type": "boolean"},
            "check": {"type": "object", "description": "shards compared with Redis, and those that differ"},
            "report": {"type": ["object", "null"], "description": "before it is settled: the last check"},
            "acknowledged": {"type": "integer", "minimum": 0},
            "archived": {"type": "boolean"},
            "delivery": {
                "type": "object",
                "description": "with a webhook: its deliveries delivered, pending, and failed for good",
                "properties": {
                    "delivered": {"type": "integer", "minimum": 0},
                    "pending": {"type": "integer", "minimum": 0},
                    "failed": {"type": "integer", "minimum": 0},
                },
            },
        },
    },
    "Award": {
        "type": "object",
        "required": ["award_id", "rank", "player_id", "points", "reward"],
        "properties": {
            "award_id": {"type": "string", "pattern": "^[0-9]+$"},
            "rank": {"type": "integer", "minimum": 1},
            "player_id": _ID,
            "points": {"type": "integer", "minimum": 0},
            "reward": _ID,
        },
    },
    "AwardsPage": {
        "type": "object",
        "required": ["settlement_id", "awards", "next"],
        "properties": {
            "settlement_id": _ID,
            "awards": {"type": "array", "items": _ref("Award")},
            "next": {"type": ["string", "null"], "description": "the cursor of the next page (after=)"},
        },
    },
    "AckRequest": {
        "type": "object",
        "additionalProperties": False,
        "required": ["award_ids"],
        "properties": {
            "award_ids": {
                "type": "array",
                "items": {"type": "string", "pattern": "^[0-9]{1,18}$"},
                "minItems": 1,
                "maxItems": 1000,
            }
        },
    },
    "AckResult": {
        "type": "object",
        "required": ["settlement_id", "acknowledged", "already"],
        "properties": {
            "settlement_id": _ID,
            "acknowledged": {"type": "integer", "minimum": 0},
            "already": {"type": "integer", "minimum": 0},
        },
    },
    "Periods": {
        "type": "object",
        "required": ["board", "periods"],
        "properties": {
            "board": _ID,
            "periods": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["period", "ends_at", "closed", "kept", "settled", "settlement_id"],
                    "properties": {
                        "period": {"type": "string"},
                        "ends_at": _TIME_OUT,
                        "closed": {"type": "boolean"},
                        "kept": {"type": "boolean", "description": "its keys are still in Redis"},
                        "settled": {"type": "boolean"},
                        "settlement_id": {"type": ["string", "null"]},
                    },
                },
            },
        },
    },
    "History": {
        "type": "object",
        "required": ["board", "player_id", "results"],
        "properties": {
            "board": _ID,
            "player_id": _ID,
            "results": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["match_id", "points", "achieved_at", "periods", "final"],
                    "properties": {
                        "match_id": {"type": "string"},
                        "points": {"type": "integer"},
                        "achieved_at": _TIME_OUT,
                        "periods": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "the periods the result counts in: those of its time, less any "
                            "already closed when it was posted",
                        },
                        "final": {
                            "type": "object",
                            "description": "per settled period whose snapshot holds the player: the "
                            "final rank (as the board's rank_mode numbers it) and points reached",
                        },
                    },
                },
            },
        },
    },
}
_SETTLE_BODY = {"required": True, "content": _content(_ref("SettleRequest"))}
_SETTLEMENT_PATHS: dict[str, Any] = {
    "/v1/boards/{board}/periods/{period}:settle": {
        "parameters": [
            _param("board"),
            {"name": "period", "in": "path", "required": True, "schema": _PERIOD},
        ],
        "post": {
            "operationId": "settlePeriod",
            "summary": "Addition: freeze a closed period, order it from PostgreSQL and pay its awards once",
            "security": _ADMIN,
            "requestBody": _SETTLE_BODY,
            "responses": {
                "200": _ok("Settled (now, or by an earlier run of the same id)", "Settlement"),
                **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
            },
        },
    },
    "/v1/boards/{board}:archive": {
        "parameters": [_param("board")],
        "post": {
            "operationId": "archiveBoard",
            "summary": "Addition: season end: settle the total, then delete the board; its history stays",
            "description": "As for :rebuild, this path is also that of the board '{board}:archive' for "
            "GET, PUT and DELETE.",
            "security": _ADMIN,
            "requestBody": _SETTLE_BODY,
            "responses": {
                "200": _ok("Settled and deleted", "Settlement"),
                **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
            },
        },
    },
    "/v1/boards/{board}/periods": {
        "parameters": [_param("board")],
        "get": {
            "operationId": "listPeriods",
            "summary": "Addition: the dated periods kept in Redis and those settled, newest first",
            "security": _READ,
            "responses": {"200": _ok("The periods", "Periods"), **_errors(409, *_READ_ERRORS)},
        },
    },
    "/v1/boards/{board}/players/{player}/history": {
        "parameters": [_param("board"), _param("player")],
        "get": {
            "operationId": "playerHistory",
            "summary": "Addition: a player's results from PostgreSQL, latest first",
            "security": _READ,
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
                }
            ],
            "responses": {"200": _ok("The results", "History"), **_errors(409, *_READ_ERRORS)},
        },
    },
    "/v1/settlements/{settlement}": {
        "parameters": [_SETTLEMENT_ID],
        "get": {
            "operationId": "getSettlement",
            "summary": "Addition: a settlement: its result, or its state and last check before",
            "security": _WRITE,
            "responses": {
                "200": _ok("The settlement", "Settlement"),
                **_errors(400, 401, 403, *_PATH, 409, 422, 503),
            },
        },
    },
    "/v1/settlements/{settlement}/awards": {
        "parameters": [_SETTLEMENT_ID],
        "get": {
            "operationId": "listAwards",
            "summary": "Addition: the awards not acknowledged yet, by rank, a page at a time",
            "security": _WRITE,
            "parameters": [
                {
                    "name": "after",
                    "in": "query",
                    "required": False,
                    "schema": {
                        "type": "string",
                        "pattern": f"^[0-9]{{1,{settlement_delivery.CURSOR_DIGITS}}}$",
                    },
                    "description": "the `next` of the previous page",
                },
                {
                    "name": "limit",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
                },
            ],
            "responses": {
                "200": _ok("A page of awards", "AwardsPage"),
                **_errors(400, 401, 403, *_PATH, 409, 422, 503),
            },
        },
    },
    "/v1/settlements/{settlement}/awards:ack": {
        "parameters": [_SETTLEMENT_ID],
        "post": {
            "operationId": "ackAwards",
            "summary": "Addition: acknowledge paid awards, never offered again (a write key: who pays)",
            "security": _WRITE,
            "requestBody": {"required": True, "content": _content(_ref("AckRequest"))},
            "responses": {
                "200": _ok("Acknowledged", "AckResult"),
                **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
            },
        },
    },
}

# Addition: the cacheable top's headers (router/hot.py), on its 200 and its 304; a settled
# period's top (from its snapshot) carries none of them.
_TOP_HEADERS = {
    "ETag": {
        "description": "Addition: names this rendering of the cached top",
        "schema": {"type": "string"},
    },
    "Cache-Control": {
        "description": "Addition: max-age=1 (the cache's refresh)",
        "schema": {"type": "string"},
    },
    "Vary": {
        "description": "Addition: Accept (JSON or MessagePack at one URL)",
        "schema": {"type": "string"},
    },
}

SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "shardlb",
        "version": "1",
        "description": "A sharded leaderboard on Redis Cluster. Bodies are JSON or MessagePack, chosen "
        "by Content-Type (requests) and Accept (responses). Keys: admin > write > read.",
    },
    "servers": [{"url": "/"}],
    "components": {
        "securitySchemes": {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "description": "Authorization: Bearer <key>. Each operation's requirement names the "
                "scope its key needs: admin (manage boards), write (post scores), read; an admin key "
                "may do everything, a write key what a read key may. Keys come from SHARDLB_ADMIN_KEYS, "
                "SHARDLB_WRITE_KEYS and SHARDLB_READ_KEYS. Reads need no key unless the server is "
                "configured to require one (SHARDLB_READS_REQUIRE_KEY).",
            }
        },
        "schemas": {**_SCHEMAS, **_SETTLEMENT_SCHEMAS},
        "parameters": _PARAMETERS,
        "responses": {f"E{s}": _error_response(s) for s in _ERROR_TEXT},
        "headers": _HEADERS,
    },
    "paths": {
        "/v1/boards": {
            "get": {
                "operationId": "listBoards",
                "summary": "List boards",
                "security": _READ,
                "responses": {
                    "200": _ok("Every board's settings", "BoardList"),
                    **_errors(400, 401, 403, 429, 503),
                },
            }
        },
        "/v1/boards/{board}": {
            "parameters": [_param("board")],
            "put": {
                "operationId": "putBoard",
                "summary": "Create or confirm a board",
                "security": _ADMIN,
                "requestBody": {"required": False, "content": _content(_ref("BoardSettings"))},
                "responses": {
                    "200": _ok("An identical board exists", "Board"),
                    "201": _ok("Created", "Board"),
                    **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
                },
            },
            "get": {
                "operationId": "getBoard",
                "summary": "A board's settings and sizes",
                "security": _READ,
                "responses": {
                    "200": _ok("Settings and players per kept period", "BoardWithPlayers"),
                    **_errors(*_READ_ERRORS),
                },
            },
            "delete": {
                "operationId": "deleteBoard",
                "summary": "Remove a board and all its keys",
                "description": "Addition: a journaled board's DELETE is recorded in PostgreSQL as "
                "begun before anything is deleted in Redis, and as done before the 204, so a rebuild "
                "after a loss of Redis never brings back a board answered 204 (and brings back one "
                "whose DELETE failed); PostgreSQL failing is 503 archive_unavailable, with nothing "
                "deleted when it fails first (send the DELETE again).",
                "security": _ADMIN,
                "responses": {"204": {"description": "Deleted"}, **_errors(400, 401, 403, *_PATH, 422, 503)},
            },
        },
        "/v1/boards/{board}:rebuild": {
            "parameters": [_param("board")],
            "post": {
                "operationId": "rebuildBoard",
                "summary": "Addition: recompute a board from PostgreSQL while writes go on (admin)",
                "description": "Board ids may hold ':', so this path is also that of the board "
                "'{board}:rebuild': GET, PUT and DELETE on it are the board routes' (/v1/boards/{board}).",
                "security": _ADMIN,
                "parameters": [
                    {
                        "name": "period",
                        "in": "query",
                        "required": False,
                        "schema": _PARAMETERS["period"]["schema"],
                        "description": "one period only (default: every period the board keeps)",
                    },
                    {
                        "name": "shard",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_SHARDS - 1},
                        "description": "one shard only (default: every shard)",
                    },
                ],
                "responses": {
                    "200": _ok("Every shard rebuilt and swapped in", "Rebuild"),
                    **_errors(400, 401, 403, *_PATH, 409, 422, 503),
                },
            },
        },
        "/v1/players/{player}:ban": {
            "parameters": [_param("player")],
            "post": {
                "operationId": "banPlayer",
                "summary": "Addition: ban a player on one board or all (admin); later scores are refused "
                "(status banned) and the player's entries are removed",
                "security": _ADMIN,
                "requestBody": {"required": True, "content": _content(_ref("BanRequest"))},
                "responses": {
                    "200": _ok(
                        "Banned (again: the first ban is kept; a retry of a ban lifted since answers it, "
                        "not in force)",
                        "Ban",
                    ),
                    **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
                },
            },
        },
        "/v1/players/{player}:unban": {
            "parameters": [_param("player")],
            "post": {
                "operationId": "unbanPlayer",
                "summary": "Addition: lift a ban of that scope (admin)",
                "security": _ADMIN,
                "requestBody": {"required": True, "content": _content(_ref("BanRequest"))},
                "responses": {
                    "200": _ok("Lifted, or there was none", "Unban"),
                    **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
                },
            },
        },
        "/v1/bans": {
            "get": {
                "operationId": "listBans",
                "summary": "Addition: the bans in force (admin)",
                "security": _ADMIN,
                "parameters": [
                    {
                        "name": "player",
                        "in": "query",
                        "required": False,
                        "schema": _ID,
                        "description": "one player's",
                    }
                ],
                "responses": {"200": _ok("Bans", "BanList"), **_errors(400, 401, 403, 422, 503)},
            },
        },
        "/v1/boards/{board}/scores": {
            "parameters": [_param("board")],
            "post": {
                "operationId": "postScores",
                "summary": f"Post match results (at most {MAX_ITEMS})",
                "security": _WRITE,
                "requestBody": {"required": True, "content": _content(_ref("ScoresRequest"))},
                "responses": {
                    "200": _ok("One result per score, in order", "ScoresResponse"),
                    **_errors(400, 401, 403, *_PATH, 409, 413, 415, 422, 503),
                },
            },
        },
        "/v1/boards/{board}/top": {
            "parameters": [_param("board")],
            "get": {
                "operationId": "top",
                "summary": "The top of a board (served from a cache refreshed each second)",
                "security": _READ,
                "parameters": [
                    _param("limit"),
                    _param("period"),
                    _param("region"),
                    _param("rank_mode"),
                    {
                        "name": "If-None-Match",
                        "in": "header",
                        "required": False,
                        "description": "Addition: the ETag of a top already held; 304 while it is current",
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {
                    "200": {**_ok("The best entries", "Page"), "headers": _TOP_HEADERS},
                    "304": {
                        "description": "Addition: the top named by If-None-Match is still current (no body)",
                        "headers": _TOP_HEADERS,
                    },
                    **_errors(*_READ_ERRORS),
                },
            },
        },
        "/v1/boards/{board}/entries": {
            "parameters": [_param("board")],
            "get": {
                "operationId": "entries",
                "summary": "A page at any depth",
                "security": _READ,
                "parameters": [
                    _param("offset"),
                    _param("limit"),
                    _param("period"),
                    _param("region"),
                    _param("rank_mode"),
                ],
                "responses": {"200": _ok("Ranks offset+1 .. offset+limit", "Page"), **_errors(*_READ_ERRORS)},
            },
        },
        "/v1/boards/{board}/players/{player}": {
            "parameters": [_param("board"), _param("player")],
            "get": {
                "operationId": "player",
                "summary": "A player's rank, points and percentile",
                "security": _READ,
                "parameters": [
                    _param("period"),
                    _param("region"),
                    _param("estimate"),
                    _param("rank_mode"),
                    _param("max_age_ms"),
                ],
                "responses": {"200": _ok("The player's standing", "Player"), **_errors(*_READ_ERRORS)},
            },
            "delete": {
                "operationId": "removePlayer",
                "summary": "Addition: remove a player from every period of the board (admin, audited)",
                "security": _ADMIN,
                "parameters": [
                    {
                        "name": "reason",
                        "in": "query",
                        "required": False,
                        "schema": {**_REASON, "type": "string"},
                        "description": "why, kept in the audit",
                    }
                ],
                "responses": {
                    "200": _ok("Removed (or absent already)", "Removal"),
                    **_errors(400, 401, 403, *_PATH, 409, 422, 503),
                },
            },
        },
        "/v1/boards/{board}/players/{player}/around": {
            "parameters": [_param("board"), _param("player")],
            "get": {
                "operationId": "around",
                "summary": "Entries around a player",
                "security": _READ,
                "parameters": [_param("radius"), _param("period"), _param("region"), _param("rank_mode")],
                "responses": {
                    "200": _ok("Up to radius entries above and below, the player included", "Entries"),
                    **_errors(*_READ_ERRORS),
                },
            },
        },
        "/v1/boards/{board}/players:query": {
            "parameters": [_param("board")],
            "post": {
                "operationId": "queryPlayers",
                "summary": "Many players (friends) with global ranks",
                "security": _READ,
                # period and region may come in the body (api.md) or the query, as the client sends them
                "parameters": [
                    {
                        **_PARAMETERS["period"],
                        "description": "Addition: the body's period, given as the other reads give it",
                    },
                    {
                        **_PARAMETERS["region"],
                        "description": "Addition: the body's region, given as the other reads give it",
                    },
                    _param("rank_mode"),
                ],
                "requestBody": {"required": True, "content": _content(_ref("Query"))},
                "responses": {
                    "200": _ok("The players with a score, by rank", "Entries"),
                    **_errors(413, 415, *_READ_ERRORS),
                },
            },
        },
        **_SETTLEMENT_PATHS,
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "The process is up",
                "security": [],
                "responses": {"200": _ok("Up", "Status")},
            },
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "security": [],
                "summary": "Ready: the cluster answers and serves every slot; 503 otherwise or draining",
                "responses": {
                    "200": _ok("Ready; `journal` names the journal nearest its bound", "Ready"),
                    **_errors(503),
                },
            },
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "description": f"Addition: a scrape takes {SCRAPE_READS} tokens of its client address's "
                "read budget (SHARDLB_READ_RATE), whatever key it carries.",
                "security": [],
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(429),
                },
            },
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "security": [],
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": _content({"type": "object", "required": ["openapi", "paths"]}),
                    }
                },
            },
        },
    },
}

# ---- Addition: the operator dashboard (router/dashboard.py) and its admin JSON (router/admin.py) ----

_COUNT_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
_NATURAL = {"type": "integer", "minimum": 0}
_TRAFFIC: dict[str, Any] = {
    "type": "object",
    "required": ["requests", "buckets"],
    "properties": {
        "requests": {"type": "integer", "minimum": 0},
        "buckets": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0},
            "description": "cumulative request counts at or under each of `bounds`, then all (+Inf)",
        },
    },
}
_SCHEMAS.update(
    {
        "ReshardRequest": {
            "oneOf": [
                {
                    "type": "object",
                    "required": ["shards"],
                    "additionalProperties": False,
                    "properties": {
                        "shards": {"type": "integer", "minimum": 1, "maximum": MAX_SHARDS},
                        "bands": {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 0, "maximum": MAX_POINTS},
                            "minItems": 1,
                            "maxItems": MAX_BANDS,
                            "description": "a band board (from a hash board, or a band board's new "
                            "starts): band starts, increasing from 0; shards is then its home shards",
                        },
                    },
                },
                {
                    "type": "object",
                    "required": ["resume"],
                    "additionalProperties": False,
                    "properties": {
                        "resume": {"const": True, "description": "take the reshard under way to its end"}
                    },
                },
            ],
            "description": "the new shard count, or resume: true",
        },
        "Reshard": {
            "type": "object",
            "required": ["board", "shards", "state"],
            "properties": {
                "board": {"type": "string"},
                "shards": {"type": "integer", "description": "the shard count reads and writes use now"},
                "state": {"enum": ["none", "copying", "sealing", "committed"]},
                "generation": {"type": "integer"},
                "from_shards": {"type": "integer"},
                "to_shards": {"type": "integer"},
                "shards_copied": {"type": "integer", "description": "old shards copied so far"},
                "changes_pending": {"type": "integer", "description": "tracked writes left to copy"},
                "elapsed_s": {"type": "number"},
                "eta_s": {"type": ["number", "null"], "description": "estimated seconds left in the copy"},
                "cancel_requested": {"type": "boolean"},
                "writes_refused_ms": {"type": ["number", "null"], "description": "the cut-over's pause"},
                "mover": {
                    "enum": ["running", "starting", "none"],
                    "description": "while one is under way, whether a process holds the board's lease "
                    "(starting: none does, but a router runs a mover of the board that will take it, "
                    "e.g. the one a POST just started; none for longer than a lease: abandoned, resumed "
                    "by a router that may take it)",
                },
                "last": {
                    "type": ["object", "null"],
                    "description": "the last reshard done (state none): from_shards, to_shards, seconds, "
                    "writes_refused_ms, finished",
                },
                "other_mover": {
                    "enum": ["running", "finished", "cancelled", "stopped"],
                    "description": "Addition (2026-12-06), a POST's answer only: a mover elsewhere held the "
                    "board's lease, and was waited for a lease and a second, as `shardlb reshard --resume` "
                    "waits (since 2026-12-06 until the router's drain begins, at most): it still runs the "
                    "reshard, or finished or cancelled it meanwhile (this router "
                    "started no mover; since 2026-12-06 also one ended before the lease was looked at, and "
                    "the status then that of a reshard recorded since, if any), or let the lease go with the "
                    "reshard under way (stopped: this router's mover takes it on); absent when none held it",
                },
                "note": {"type": "string", "description": "with other_mover: what it means, in a sentence"},
            },
        },
        "AdminCluster": {
            "type": "object",
            "description": "Addition: readiness, CLUSTER INFO and every node (CLUSTER NODES, INFO memory)",
            "required": ["ready", "problem", "state", "slots_ok", "slots_failing", "known_nodes", "primaries",
                         "nodes", "as_of"],
            "properties": {
                "ready": {"type": "boolean", "description": "what /readyz would answer"},
                "problem": {"type": ["string", "null"], "description": "why not ready"},
                "state": {"type": ["string", "null"], "description": "cluster_state of CLUSTER INFO"},
                "slots_ok": {"type": "integer", "minimum": 0},
                "slots_failing": {"type": "integer", "minimum": 0},
                "known_nodes": {"type": "integer", "minimum": 0},
                "primaries": {"type": "integer", "minimum": 0},
                "as_of": _TIME_OUT,
                "nodes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["address", "id", "role", "primary", "slots", "ranges", "connected",
                                     "failing", "memory"],
                        "properties": {
                            "address": {"type": "string"},
                            "id": {"type": "string"},
                            "role": {"enum": ["primary", "replica"]},
                            "primary": {"type": ["string", "null"], "description": "a replica's primary"},
                            "slots": {"type": "integer", "minimum": 0},
                            "ranges": {
                                "type": "array",
                                "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
                            },
                            "connected": {"type": "boolean"},
                            "failing": {"type": "boolean"},
                            "memory": {
                                "type": "object",
                                "description": "bytes, from INFO memory; max 0 is no maxmemory",
                                "properties": {n: _COUNT_OR_NULL for n in ("used", "peak", "rss", "max")},
                            },
                        },
                    },
                },
            },
        },
        "ShardMap": {
            "type": "object",
            "description": "Addition: each shard's slot, the primary serving it, and its players",
            "required": ["board", "period", "shards"],
            "properties": {
                "board": {"type": "string"},
                "period": {"type": "string"},
                "shards": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["shard", "slot", "node", "members"],
                        "properties": {
                            "shard": {"type": "integer", "minimum": 0},
                            "slot": {"type": "integer", "minimum": 0, "maximum": 16383},
                            "node": {"type": ["string", "null"], "description": "null: slot unassigned"},
                            "members": {"type": "integer", "minimum": 0},
                            "rebuilding": {
                                "type": "boolean",
                                "description": "the shard is marked not rebuilt after a loss of Redis "
                                "(all of it, or the shard's slot alone): reads and writes of it are 503 "
                                "board_rebuilding until `shardlb rebuild` brings it back",
                            },
                            "role": {
                                "enum": ["home", "band"],
                                "description": "band boards: a home shard (every player's record) or a band "
                                "shard (the total of the players whose points are in its band)",
                            },
                            "band_from": {
                                "type": "integer",
                                "minimum": 0,
                                "description": "band shards: the points the band starts at",
                            },
                        },
                    },
                },
                "band_skew": {
                    "type": "number",
                    "minimum": 0,
                    "description": "band boards, total: the largest band's players over the mean band's "
                    "(1.0: even; `shardlb bands --apply` reshards above its --skew, 1.5 by default)",
                },
            },
        },
        "Traffic": {
            "type": "object",
            "description": "Addition: this router's (every worker's) totals so far; rates and "
            "percentiles are the differences between two of these",
            "required": ["at_ms", "bounds", "writes", "reads"],
            "properties": {
                "at_ms": {"type": "integer"},
                "bounds": {"type": "array", "items": {"type": "number"}, "description": "bucket bounds, s"},
                "writes": {**_TRAFFIC, "required": ["requests", "buckets", "scores"],
                           "properties": {**_TRAFFIC["properties"], "scores": _NATURAL}},
                "reads": _TRAFFIC,
            },
        },
    }
)  # fmt: skip
_ADMIN_ERRORS = (400, 401, 403, 503)
_STATIC_HEADERS = {
    "Content-Security-Policy": {
        "description": "default-src 'self', no inline script",
        "schema": {"type": "string"},
    }
}
# The schemas above were added after SPEC copied _SCHEMAS: without this their references dangled.
SPEC["components"]["schemas"].update(_SCHEMAS)
SPEC["paths"].update(
    {
        "/v1/admin/cluster": {
            "get": {
                "operationId": "adminCluster",
                "summary": "Addition: the cluster's state and nodes, with slots and memory (admin)",
                "security": _ADMIN,
                "responses": {"200": _ok("The cluster now", "AdminCluster"), **_errors(*_ADMIN_ERRORS)},
            },
        },
        "/v1/admin/boards/{board}/shards": {
            "parameters": [_param("board")],
            "get": {
                "operationId": "adminShards",
                "summary": "Addition: shard -> slot -> node of a board, and its players per shard (admin)",
                "security": _ADMIN,
                "parameters": [_param("period")],
                "responses": {
                    "200": _ok("One line per shard", "ShardMap"),
                    **_errors(*_ADMIN_ERRORS, *_PATH, 422),
                },
            },
        },
        "/v1/admin/boards/{board}/reshard": {
            "parameters": [_param("board")],
            "get": {
                "operationId": "reshardStatus",
                "summary": "Addition: a board's online reshard: its state, progress and time left (admin)",
                "security": _ADMIN,
                "responses": {
                    "200": _ok("The reshard now", "Reshard"),
                    **_errors(*_ADMIN_ERRORS, *_PATH, 422),
                },
            },
            "post": {
                "operationId": "reshardBoard",
                "summary": "Addition: move a hash or band board to another shard count or band starts while "
                "it takes writes and reads, or resume the reshard under way; runs in the background of "
                "this router (admin)",
                "security": _ADMIN,
                "requestBody": {"required": True, "content": _content(_ref("ReshardRequest"))},
                "responses": {
                    "202": _ok("Started (or resumed)", "Reshard"),
                    **_errors(*_ADMIN_ERRORS, *_PATH, 409, 413, 415, 422),
                },
            },
            "delete": {
                "operationId": "cancelReshard",
                "summary": "Addition: cancel a reshard not committed yet; the board keeps its layout (admin)",
                "security": _ADMIN,
                "responses": {
                    "200": _ok("Cancelled", "Reshard"),
                    **_errors(*_ADMIN_ERRORS, *_PATH, 409, 422),
                },
            },
        },
        "/v1/admin/metrics": {
            "get": {
                "operationId": "adminMetrics",
                "summary": "Addition: write and read counts and latency buckets of this router (admin)",
                "security": _ADMIN,
                "responses": {
                    "200": _ok("Totals since the router started", "Traffic"),
                    **_errors(*_ADMIN_ERRORS),
                },
            },
        },
        "/dashboard": {
            "get": {
                "operationId": "dashboard",
                "summary": "Addition: the operator dashboard page (no data in it; it asks for the admin key)",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The page",
                        "headers": _STATIC_HEADERS,
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    },
                    **_errors(400),
                },
            },
        },
        "/dashboard/": {
            "get": {
                "operationId": "dashboardSlashed",
                "summary": "Addition: the operator dashboard page, as /dashboard",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The page",
                        "headers": _STATIC_HEADERS,
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    },
                    **_errors(400),
                },
            },
        },
        "/dashboard/{asset}": {
            "parameters": [
                {"name": "asset", "in": "path", "required": True, "schema": {"enum": list(ASSETS)}}
            ],
            "get": {
                "operationId": "dashboardAsset",
                "summary": "Addition: the dashboard's script and style sheet",
                "security": [],
                "responses": {
                    "200": {
                        "description": "The file",
                        "headers": _STATIC_HEADERS,
                        "content": {
                            t: {"schema": {"type": "string"}} for t in ("text/javascript", "text/css")
                        },
                    },
                    **_errors(400, 404),
                },
            },
        },
    }
)
# Any request may be cut off by the HTTP protocol itself (router/http.py), before a route runs; an
# API request without a key, by the middleware's share of the requests in progress for its client.
# Every answer carries X-Request-Id (the error responses in components have it already).
for _path, _operations in SPEC["paths"].items():
    for _method, _operation in _operations.items():
        if _method != "parameters":
            _operation["responses"].update(_errors(408, 414, 431))
            if _path.startswith("/v1/"):
                _operation["responses"].update(_errors(429))
            for _response in _operation["responses"].values():
                if "$ref" not in _response:
                    _response["headers"] = {
                        **_response.get("headers", {}),
                        "X-Request-Id": _header("X-Request-Id"),
                    }
