"""One JSON object per log line on stderr, for the router's own logger ``shardlb.router``.

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


def configure(level: str = "info") -> logging.Logger:
    """Give ``shardlb.router`` one JSON handler on stderr (once per process) at ``level``."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level.upper())
    if not any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        logger.addHandler(handler)
        logger.propagate = False
    return logger
