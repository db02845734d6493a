"""router/errors.py: every redis-py error is a 503 the client may retry; other bugs stay 500."""

from __future__ import annotations

import pytest
from redis import exceptions as rx
from redis.asyncio.connection import Connection

from router.errors import to_api_error
from shardlb.errors import ArchiveUnprepared, ClusterUnavailable, Overloaded


async def _error_inside_redis_py() -> BaseException:
    """What a call gets when redis-py's own code fails on a connection that was torn down under it:
    a plain AttributeError raised in redis-py (seen in the load test on a closed writer after a
    failover). A connection's repr on an object without its attributes raises one there in every
    redis-py version we run (8.1 and 8.2 differ in how a never-connected connection fails)."""
    try:
        Connection.repr_pieces(object())  # type: ignore[arg-type]
    except Exception as e:
        return e
    raise AssertionError("expected a failure")


@pytest.mark.parametrize(
    "exc",
    [
        rx.MaxConnectionsError(),
        rx.ConnectionError("Connection reset by peer"),
        rx.TimeoutError("Timeout reading from socket"),
        rx.ClusterDownError("CLUSTERDOWN The cluster is down"),
        rx.TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        rx.ClusterError("TTL exhausted."),
        rx.ResponseError("LOADING Redis is loading the dataset in memory"),
        rx.ResponseError("Command # 1 (ZCOUNT k 1 +inf) of pipeline caused error: MOVED 42 10.0.0.1:7000"),
        rx.MovedError("42 127.0.0.1:7001"),
        rx.ReadOnlyError("READONLY You can't write against a read only replica."),
        rx.RedisClusterException("No targets were found to execute ('EVALSHA',) command on"),
        rx.SlotNotCoveredError('Slot "42" is not covered by the cluster.'),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError(),
        ClusterUnavailable("no cluster"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_redis_error_is_503_cluster_unavailable(exc: BaseException) -> None:
    error = to_api_error(exc)
    assert (error.status, error.code, error.headers["retry-after"]) == (503, "cluster_unavailable", "1")


async def test_a_failure_inside_redis_py_is_503_and_other_bugs_stay_500() -> None:
    inside = await _error_inside_redis_py()
    assert isinstance(inside, AttributeError)
    assert (to_api_error(inside).status, to_api_error(inside).code) == (503, "cluster_unavailable")
    try:
        raise AttributeError("a bug of the router")
    except AttributeError as e:
        assert (to_api_error(e).status, to_api_error(e).code) == (500, "internal_error")
    busy = to_api_error(Overloaded("too many reads", 2.5))
    assert (busy.status, busy.code, busy.headers["retry-after"]) == (503, "overloaded", "3")


def test_an_archive_without_its_schema_is_503_archive_unavailable() -> None:
    """A rebuild's PostgreSQL without the archive's schema (shardlb/rebuild.py, ``check_schema``) is
    answered as PostgreSQL failing is (api.md), with the library's message saying what is missing."""
    error = to_api_error(ArchiveUnprepared("PostgreSQL has no table bans: start `shardlb archive`"))
    assert (error.status, error.code, error.headers) == (503, "archive_unavailable", {"retry-after": "5"})
    assert "shardlb archive" in error.message
