"""The settings every connection of shardlb to PostgreSQL (the archive) is opened with, unless its
URL gives its own: how long it may take to open, and how soon a server that vanished is noticed.

A server that goes away without a FIN (a host powered off, a network partition, a failover's old
address dropping packets) leaves a connection open with nothing to say it is dead. Without TCP
keepalives, a query whose sending the server acknowledged then waits for its answer for ever (one
not acknowledged, some 15 minutes of retransmissions): the archiver stayed in that query, its
journals filled to their bound and writes were refused (503), with no error logged to say why. With
these settings the kernel probes an idle connection after ``KEEPALIVES_IDLE_S`` and drops it after
``KEEPALIVES_COUNT`` probes unanswered ``KEEPALIVES_INTERVAL_S`` apart (about a minute in all), and
data sent and not acknowledged for ``TCP_USER_TIMEOUT_MS`` drops it too (the keepalives stay silent
while a query is unacknowledged). The query then fails as a lost connection: an outage, retried like
any other (shardlb/archive.py). No statement_timeout is set: a long statement of a live server (a
rebuild's read of millions of rows) is no fault, and the URL may set one (``options=-c
statement_timeout=...``).
"""

from __future__ import annotations

from typing import Any

# Seconds a connection may take to open. An address that takes the connection and then answers
# nothing (a hung server, a failover's old address behind a proxy) held the archiver for psycopg's
# default of 130 s, and a SIGTERM meanwhile waited for it past the pod's 30 s grace period
# (k8s/base/archiver/deployment.yaml), to end in SIGKILL.
CONNECT_TIMEOUT_S = 10
KEEPALIVES_IDLE_S = 30
KEEPALIVES_INTERVAL_S = 10
KEEPALIVES_COUNT = 3
TCP_USER_TIMEOUT_MS = 60_000


def options(url: str, **defaults: Any) -> dict[str, Any]:
    """The connection parameters to pass with ``url`` (psycopg's keyword arguments override the
    URL's): shardlb's defaults, ``defaults`` over them, minus whatever the URL sets itself."""
    # Imported when used: Redis-only deployments need no PostgreSQL driver.
    from psycopg.conninfo import conninfo_to_dict

    wanted: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "keepalives": 1,
        "keepalives_idle": KEEPALIVES_IDLE_S,
        "keepalives_interval": KEEPALIVES_INTERVAL_S,
        "keepalives_count": KEEPALIVES_COUNT,
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
        **defaults,
    }
    given = conninfo_to_dict(url)
    return {name: value for name, value in wanted.items() if name not in given}
