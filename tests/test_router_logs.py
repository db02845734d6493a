"""router/logs.py: every line a router process writes is one JSON object, once, whichever logger wrote
it (the router's, shardlb's library modules', uvicorn's), at the level SHARDLB_LOG_LEVEL names."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardlb.cluster import LocalCluster
from tests.test_router_server import Server

# A worker as uvicorn leaves it (its own logging config applied before the app is built), then the
# router's: a line from each kind of logger the router process holds.
LINES = """
import logging, logging.config, sys
from uvicorn.config import LOGGING_CONFIG
from router import logs

logging.config.dictConfig(LOGGING_CONFIG)
logs.configure(sys.argv[1])
logging.getLogger("shardlb.router").info("router line", extra={"fields": {"a": 1}})
logging.getLogger("shardlb.settlement").info("webhook deliveries swept", extra={"fields": {"delivered": 3}})
logging.getLogger("shardlb.reshard").warning("reshard lease not refreshed", extra={"fields": {"key": "k"}})
logging.getLogger("uvicorn.error").info("Started server process [%d]", 42)
logging.getLogger("uvicorn.error").warning("Invalid HTTP request received.")
"""


def lines_at(level: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-c", LINES, level], capture_output=True, text=True, timeout=60, check=True
    )
    return [orjson.loads(line) for line in done.stderr.splitlines()]  # each line JSON, or this fails


def test_every_logger_of_the_router_process_writes_json_once() -> None:
    lines = lines_at("info")
    assert [(x["logger"], x["level"], x["message"]) for x in lines] == [
        ("shardlb.router", "info", "router line"),
        ("shardlb.settlement", "info", "webhook deliveries swept"),
        ("shardlb.reshard", "warning", "reshard lease not refreshed"),
        ("uvicorn.error", "info", "Started server process [42]"),
        # uvicorn's "Invalid HTTP request received." is not repeated: the router's 400 line says it
    ]
    assert lines[1]["delivered"] == 3 and lines[2]["key"] == "k"


def test_the_level_holds_for_every_logger() -> None:
    assert [x["message"] for x in lines_at("warning")] == ["reshard lease not refreshed"]


# The lines of libraries the router runs that log on their own: redis-py (a topology refresh that
# failed while a node is down), the event loop (a task that failed unseen), httpx (each request it
# sends, webhook deliveries included, at info, URL and all).
OTHERS = """
import logging, sys
from router import logs

logs.configure(sys.argv[1])
logging.getLogger("redis.asyncio.cluster").error("Topology refresh failed, keeping the current one: x")
logging.getLogger("asyncio").error("Task exception was never retrieved")
logging.getLogger("httpx").info("HTTP Request: POST https://hooks.example/T0/s3cret-token")
"""


def test_the_lines_of_the_libraries_it_runs_are_json_too() -> None:
    """redis-py's and the event loop's warnings and errors reached stderr through Python's last
    resort handler, as plain text among the JSON lines (a log shipper parsing JSON dropped them,
    or the whole stream). They are JSON lines now, at warning and above only: a library's info
    chatter stays out (httpx's line per request names each webhook URL, often its credential)."""
    done = subprocess.run(
        [sys.executable, "-c", OTHERS, "info"], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [orjson.loads(line) for line in done.stderr.splitlines()]  # each line JSON, or this fails
    assert [(x["logger"], x["level"]) for x in lines] == [
        ("redis.asyncio.cluster", "error"),
        ("asyncio", "error"),
    ]
    assert "s3cret" not in done.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_process_writes_only_json_lines(cluster: LocalCluster, tmp_path: Path, workers: int) -> None:
    """A real router, started, sent a request llhttp cannot parse, and stopped: its log holds JSON
    lines only (uvicorn's own included), the refused request in one of them."""
    log = tmp_path / "router.log"
    server = Server(cluster.url, log, workers=workers)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nBad Name: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 400")
    finally:
        assert server.stop() == 0
    text = log.read_text()
    lines = [orjson.loads(line) for line in text.splitlines() if line.strip()]  # JSON, or this fails
    assert [x.get("code") for x in lines].count("malformed_request") == 1, text
    assert not [x for x in lines if x["message"] == "Invalid HTTP request received."], text
    assert [x for x in lines if x["message"] == "router ready"], text


class Kept(logging.Handler):
    """The records of one logger, kept in a list for a test (added and removed by ``kept``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int | None = None) -> list[tuple[str, dict[str, Any]]]:
        return [
            (r.getMessage(), getattr(r, "fields", {})) for r in self.records if level in (None, r.levelno)
        ]


@contextlib.contextmanager
def kept(name: str) -> Iterator[Kept]:
    logger, handler = logging.getLogger(name), Kept()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_an_outage_is_logged_at_its_start_then_once_a_minute_and_at_its_end() -> None:
    """A loop that fails every second for 1000 s writes 17 warnings (at 0 s, then every 60 s, each
    with the failures since the line before) and one info line when it works again, with them all."""
    from shardlb.outage import Outage

    now = [0.0]
    with kept("tests.outage") as log:
        outage = Outage(logging.getLogger("tests.outage"), "x not read", "x read again", clock=lambda: now[0])
        for second in range(1000):
            now[0] = float(second)
            outage.failed(OSError(f"refused {second}"))
        outage.succeeded()
        outage.succeeded()  # no outage: nothing to say
        outage.failed(OSError("again"))  # a new outage: its first failure is said at once
    warnings = log.lines(logging.WARNING)
    assert [fields["failures"] for _, fields in warnings] == [1] + [60] * 16 + [1]
    assert [fields.get("since_s") for _, fields in warnings[:3]] == [None, 60.0, 120.0]
    assert {m for m, _ in warnings} == {"x not read"}
    assert warnings[1][1]["error"] == repr(OSError("refused 60"))  # the latest error
    assert log.lines(logging.INFO) == [("x read again", {"failures": 1000, "outage_s": 999.0})]


def test_an_outages_warning_carries_the_callers_fields_and_a_trace_when_asked() -> None:
    """The archiver's band repair names the board that failed, and logs the traceback of a failure
    that is no outage (a bug), on the outage's lines only."""
    from shardlb.outage import Outage

    now = [0.0]
    with kept("tests.outage") as log:
        outage = Outage(logging.getLogger("tests.outage"), "x failed", "x works", clock=lambda: now[0])
        try:
            raise KeyError("bug")
        except KeyError as e:
            outage.failed(e, {"board": "b1"}, trace=True)
            outage.failed(e, {"board": "b2"}, trace=True)  # within the minute: not logged
    [record] = [r for r in log.records if r.levelno == logging.WARNING]
    assert record.fields == {"board": "b1", "error": repr(KeyError("bug")), "failures": 1}
    assert record.exc_info is not None and record.exc_info[0] is KeyError
