"""One JSON object per log line on stderr, for every logger of a router process: the router's own
``shardlb.router``, shardlb's library modules' and uvicorn's.

Structured fields travel in ``extra={"fields": {...}}`` and become keys of the line.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable

import orjson

from shardlb import times

LOGGER = "shardlb.router"
OUTAGE_LOG_EVERY_S = 60.0


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": times.format_ms(int(record.created * 1000)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["trace"] = "".join(traceback.format_exception(*record.exc_info))
        return orjson.dumps(line, default=str).decode()


class _AnsweredBy400Line(logging.Filter):
    """Drops uvicorn's plain warning for a request llhttp cannot parse: router/http.py's
    send_400_response answers that request and logs it as one 400 line with its request id."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Invalid HTTP request received."


def configure(level: str = "info") -> logging.Logger:
    """Give ``shardlb`` (the router's logger ``shardlb.router`` and the library modules' loggers
    below it: reshard, settlement, archive) and ``uvicorn.error`` one JSON handler on stderr, once
    per process, at ``level``; return the router's logger.

    Neither propagates: a handler above them (uvicorn's plain-text one on ``uvicorn``, or one on the
    root logger) would write each line a second time."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("shardlb", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        logger.propagate = False
        if not any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
            logger.addHandler(handler)
        if name == "uvicorn.error" and not any(isinstance(f, _AnsweredBy400Line) for f in logger.filters):
            logger.addFilter(_AnsweredBy400Line())
    return logging.getLogger(LOGGER)


class Outage:
    """The failures of a loop that retries every second or so (the ban list's refresh, the refusal
    log's writes), logged so that an outage of Redis or PostgreSQL costs a few lines per worker, not
    one per try: its first failure as a warning at once, then one warning every ``every_s`` at most,
    with ``failures`` since the line before and ``since_s`` since the outage began, and an info line
    (``recovered``, with every failure and ``outage_s``) at the first success after."""

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

    def failed(self, error: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        self.unlogged += 1
        fields: dict[str, object] = {"error": repr(error), "failures": self.unlogged}
        if self.began is None:
            self.began = now
        elif now - self.logged_at < self.every_s:
            return
        else:
            fields["since_s"] = round(now - self.began, 1)
        self.log.warning(self.message, extra={"fields": fields})
        self.logged_at, self.unlogged = now, 0

    def succeeded(self) -> None:
        if self.began is None:
            return
        fields = {"failures": self.failures, "outage_s": round(self.clock() - self.began, 1)}
        self.log.info(self.recovered, extra={"fields": fields})
        self.began, self.failures, self.unlogged = None, 0, 0
