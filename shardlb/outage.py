"""How a background loop logs the failures of an outage: a few lines per process, not one per try.

Every loop that retries on its own (the router's wait for the cluster at start, ban list refresh,
refusal log, journal watch and cached views; the archiver's wait for PostgreSQL at start, rounds,
journal lag, cleanup, band repairs and webhook sweep) logs through an ``Outage``, so a Redis or
PostgreSQL outage of an hour costs each of them about sixty lines per process, whatever its pace.
So do the router's write coalescer's failed script calls, one ``Outage`` per primary (each call
fails on its own, as many a second as writes come in: router/coalescer.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

OUTAGE_LOG_EVERY_S = 60.0


def described(error: BaseException) -> str:
    """``repr(error)``, with its message (escaped, as a repr has it) when the repr leaves it out:
    redis-py 8 gives its errors a repr of their kind and class alone
    (``server:RedisClusterUnreachableError``), so until 2026-12-06 an outage's warnings named no
    node tried and no cause (a refused connection, a timeout, a name that does not resolve)."""
    text = repr(error)
    if type(error).__repr__ is BaseException.__repr__ or not str(error):
        return text  # the message is in it, escaped
    return f"{text}({str(error)!r})"


class Outage:
    """The failures of a loop that retries, logged as its first failure (a warning at once), then
    one warning every ``every_s`` at most, with ``failures`` since the line before and ``since_s``
    since the outage began, and an info line (``recovered``, with every failure and ``outage_s``)
    at the first success after. A warning carries the latest error and the ``fields`` given with it
    (the board that failed, the pause before the next try); with ``trace`` its traceback too (an
    error that is no outage but a bug, which must not be hidden, nor flood the log either)."""

    def __init__(
        self,
        log: logging.Logger,
        message: str,
        recovered: str,
        every_s: float = OUTAGE_LOG_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.message = message
        self.recovered = recovered
        self.every_s = every_s
        self.clock = clock
        self.began: float | None = None  # None: no outage
        self.logged_at = 0.0
        self.failures = 0  # since the outage began
        self.unlogged = 0  # since the last warning

    def failed(
        self, error: BaseException, fields: dict[str, object] | None = None, trace: bool = False
    ) -> None:
        now = self.clock()
        self.failures += 1
        self.unlogged += 1
        line: dict[str, object] = {**(fields or {}), "error": described(error), "failures": self.unlogged}
        if self.began is None:
            self.began = now
        elif now - self.logged_at < self.every_s:
            return
        else:
            line["since_s"] = round(now - self.began, 1)
        self.log.warning(self.message, exc_info=error if trace else None, extra={"fields": line})
        self.logged_at, self.unlogged = now, 0

    def succeeded(self, fields: dict[str, object] | None = None) -> None:
        """The end of the outage, if one is under way: its info line, with ``fields`` (what recovered)."""
        if self.began is None:
            return
        line = {**(fields or {}), "failures": self.failures, "outage_s": round(self.clock() - self.began, 1)}
        self.log.info(self.recovered, extra={"fields": line})
        self.began, self.failures, self.unlogged = None, 0, 0
