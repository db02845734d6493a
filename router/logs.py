"""One JSON object per log line on stderr, for every logger of a router process: the router's own
``shardlb.router``, shardlb's library modules', uvicorn's and, at warning and above, every other
library's (redis-py, asyncio).

Structured fields travel in ``extra={"fields": {...}}`` and become keys of the line.
"""

from __future__ import annotations

import logging
import sys
import traceback

import orjson

from shardlb import times

LOGGER = "shardlb.router"


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
    # Every other library's lines (redis-py's, the event loop's, psycopg's) through the root logger,
    # at warning and above: without a handler there they went out through Python's last resort, as
    # plain text among the JSON lines. Their info lines stay out (httpx's, one per request it sends,
    # name each webhook's URL, often its credential).
    root = logging.getLogger()
    root.setLevel(max(logging.WARNING, logging.getLevelName(level.upper())))
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        root.addHandler(handler)
    return logging.getLogger(LOGGER)
