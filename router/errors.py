"""HTTP errors: the one table from library and Redis exceptions to status codes and error bodies.

Every error leaves the router as ``{"error": {"code", "message", "field"}}`` with the status below.
A 5xx is only ever the router's or the cluster's fault: anything a client sent maps to a 4xx, and
trouble with the cluster (or with PostgreSQL, the archive) is a 503 with Retry-After, which a client may
retry.
"""

from __future__ import annotations

import math

import psycopg
from redis import exceptions as rx

from shardlb.connection import raised_in_redis
from shardlb.errors import (
    ArchiveUnprepared,
    BoardConflict,
    BoardNotFound,
    ClusterUnavailable,
    InvalidInput,
    Overloaded,
    PlayerNotFound,
    ShardlbError,
    field_name,
)

CLUSTER_UNAVAILABLE = "cluster_unavailable"
OUT_OF_MEMORY = "out_of_memory"
# A master at `maxmemory` (policy noeviction) refuses commands that may grow memory: the board's
# writes that land on it, never its reads or other masters' shards. Memory comes back as dedup
# buckets and period boards expire, or when an operator adds memory or masters: minutes, not the
# second that a failover takes, so clients are asked to wait longer.
OUT_OF_MEMORY_RETRY_S = 10
ARCHIVE_UNAVAILABLE = "archive_unavailable"
ARCHIVE_RETRY_S = 5  # as the handlers that wrap their own PostgreSQL calls answer (router/history.py)
# An error's message and field often quote what the client sent (an unknown field's name, a bad
# id): both are cut to these lengths, so an answer and its log line stay small whatever was sent.
MESSAGE_MAX = 300
FIELD_MAX = 160

# Exception class -> (status, code); None keeps the library error's own code. The first row whose
# class matches wins, so a subclass comes before its base. No redis-py error is the client's fault:
# each means the cluster is busy, moving or unreachable, so each is 503 cluster_unavailable.
TABLE: tuple[tuple[type[BaseException], int, str | None], ...] = (
    (InvalidInput, 422, None),
    (BoardNotFound, 404, None),
    (PlayerNotFound, 404, None),
    (BoardConflict, 409, None),
    (Overloaded, 503, None),
    (ClusterUnavailable, 503, None),
    (ArchiveUnprepared, 503, None),  # archive_unavailable, as PostgreSQL failing (api.md)
    # PostgreSQL failing on a path that does not wrap its own calls (a reshard's first reach of the
    # archive was a 500 until 2026-12-05): never the client's fault, nor a bug of the router.
    (psycopg.Error, 503, ARCHIVE_UNAVAILABLE),
    (rx.MaxConnectionsError, 503, CLUSTER_UNAVAILABLE),  # a node's connection pool was full
    (rx.ConnectionError, 503, CLUSTER_UNAVAILABLE),  # refused, reset, closed mid-call, still loading
    (rx.TimeoutError, 503, CLUSTER_UNAVAILABLE),  # socket or connect timeout
    (rx.ClusterDownError, 503, CLUSTER_UNAVAILABLE),  # CLUSTERDOWN, MASTERDOWN: a failover under way
    (rx.TryAgainError, 503, CLUSTER_UNAVAILABLE),  # TRYAGAIN: the slot is being migrated
    (rx.OutOfMemoryError, 503, OUT_OF_MEMORY),  # OOM: the shard's master is at maxmemory
    (rx.ClusterError, 503, CLUSTER_UNAVAILABLE),  # redirects outlasted the client's retry budget
    (rx.ResponseError, 503, CLUSTER_UNAVAILABLE),  # other error replies: MOVED/ASK left, READONLY, OOM
    (rx.RedisError, 503, CLUSTER_UNAVAILABLE),  # whatever else redis-py raises on purpose
    (rx.RedisClusterException, 503, CLUSTER_UNAVAILABLE),  # slot not covered, no node for a command
    (OSError, 503, CLUSTER_UNAVAILABLE),  # a socket error or timeout that escaped redis-py's wrapping
)


class ApiError(Exception):
    """An error with its HTTP status, raised by the router itself or mapped from another exception."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _cut(message, MESSAGE_MAX)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        named = field_name(field)
        self.field = None if named is None else _cut(named, FIELD_MAX)
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["retry-after"] = str(max(1, math.ceil(retry_after)))

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"code": self.code, "message": self.message, "field": self.field}}


def shutting_down() -> ApiError:
    return ApiError(503, "shutting_down", "this router is shutting down; retry on another", retry_after=1)


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception to the ApiError the client sees. Unknown exceptions become a plain 500."""
    if isinstance(exc, ApiError):
        return exc
    row = next((row for row in TABLE if isinstance(exc, row[0])), None)
    if row is None:
        if not raised_in_redis(exc):  # a failure inside redis-py is cluster trouble (shardlb/connection.py)
            return ApiError(500, "internal_error", "the router failed on this request; it has been logged")
        row = (type(exc), 503, CLUSTER_UNAVAILABLE)
    _, status, code = row
    if isinstance(exc, ShardlbError) and code is None:
        retry = getattr(exc, "retry_after", 1.0) if status == 503 else None
        return ApiError(status, exc.code, exc.message, exc.field, retry_after=retry)
    if code == ARCHIVE_UNAVAILABLE:
        return ApiError(
            503, ARCHIVE_UNAVAILABLE, f"PostgreSQL failed: {type(exc).__name__}", retry_after=ARCHIVE_RETRY_S
        )
    if code == OUT_OF_MEMORY:
        return ApiError(
            503,
            OUT_OF_MEMORY,
            "a Redis node this request writes to (one holding the board's shards, or the board "
            "registry's) is out of memory (maxmemory): writes to it are refused until memory is "
            "freed; reads and board deletions still work",
            retry_after=OUT_OF_MEMORY_RETRY_S,
        )
    return ApiError(
        status,
        code or CLUSTER_UNAVAILABLE,
        f"the cluster is unavailable ({type(exc).__name__}); retry shortly",
        retry_after=1,
    )


def is_cluster_trouble(exc: BaseException) -> bool:
    """A failure of the cluster or of the connection to it (the 503 cluster_unavailable rows), or a
    node out of memory."""
    return to_api_error(exc).code in (CLUSTER_UNAVAILABLE, OUT_OF_MEMORY)


def redis_error_kind(exc: BaseException) -> str:
    """A short, bounded label for an exception from a cluster call (a metrics label)."""
    return type(exc).__name__ if is_cluster_trouble(exc) else "other"


def _cut(text: str, most: int) -> str:
    """``text``, or its start and an ellipsis when it is longer than ``most`` characters."""
    return text if len(text) <= most else text[: most - 1] + "\u2026"
