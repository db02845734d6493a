"""HTTP errors: the one table from library and Redis exceptions to status codes and error bodies.

Every error leaves the router as ``{"error": {"code", "message", "field"}}`` with the status below.
A 5xx is only ever the router's or the cluster's fault: anything a client sent maps to a 4xx.
"""

from __future__ import annotations

import math

from redis import exceptions as rx

from shardlb.errors import (
    BoardConflict,
    BoardNotFound,
    ClusterUnavailable,
    InvalidInput,
    Overloaded,
    PlayerNotFound,
    ShardlbError,
)

# Library errors by class; the most specific class listed first wins.
STATUS: tuple[tuple[type[ShardlbError], int], ...] = (
    (InvalidInput, 422),
    (BoardNotFound, 404),
    (PlayerNotFound, 404),
    (BoardConflict, 409),
    (Overloaded, 503),
    (ClusterUnavailable, 503),
)

# Redis replies that mean "the cluster is busy or moving", not "the router sent nonsense".
_TRANSIENT_REPLIES = (
    rx.ClusterDownError,
    rx.TryAgainError,
    rx.ReadOnlyError,
    rx.OutOfMemoryError,
    rx.BusyLoadingError,
    rx.AskError,
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
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
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
    if isinstance(exc, ShardlbError):
        for kind, status in STATUS:
            if isinstance(exc, kind):
                retry = getattr(exc, "retry_after", 1.0) if status == 503 else None
                return ApiError(status, exc.code, exc.message, exc.field, retry_after=retry)
    if isinstance(exc, rx.MaxConnectionsError):
        return ApiError(503, "overloaded", "too many calls in flight to the cluster", retry_after=1)
    if isinstance(exc, _TRANSIENT_REPLIES) or (
        isinstance(exc, rx.RedisError | rx.RedisClusterException) and not isinstance(exc, rx.ResponseError)
    ):
        return ApiError(
            503, "cluster_unavailable", f"the cluster is unavailable ({type(exc).__name__})", retry_after=1
        )
    return ApiError(500, "internal_error", "the router failed on this request; it has been logged")


def redis_error_kind(exc: BaseException) -> str:
    """A short, bounded label for an exception from a cluster call (a metrics label)."""
    return type(exc).__name__ if isinstance(exc, rx.RedisError | rx.RedisClusterException) else "other"
